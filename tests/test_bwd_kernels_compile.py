"""CPU tier: the sm_90 backward kernels (experimental; `flashqla/ops/gdn/kernels/sm90/NOTES-bwd.md`)
lower and compile for sm_90a without a GPU (TileLang + nvcc), and the experimental backward refuses
to run unless opted in."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

HAVE_NVCC = shutil.which("nvcc") is not None
needs_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="compiling for sm_90a needs nvcc (the CUDA toolkit) on PATH")

#: Hopper's dynamic shared memory per block (227 KB).
SMEM_LIMIT = 232448


def _smem_high_water(src: str) -> int:
    """Largest byte offset into the dynamic shared-memory buffer in the generated source (a lower
    bound of the kernel's dynamic shared memory; the last buffer's size is not added)."""
    offs = [int(m) for m in re.findall(r"buf_dyn_shmem \+ (\d+)", src)]
    offs += [int(m) for m in re.findall(r"\(\(uchar\*\)buf_dyn_shmem\)\[(\d+)\]", src)]
    return max(offs, default=0)


@needs_nvcc
@pytest.mark.parametrize(
    "h_dtype,seq_dtype,varlen", [("bfloat16", "int32", True), ("float32", "int32", False)], ids=["h-bf16-varlen", "h-fp32-fixed"]
)
def test_states_kernel_compiles(h_dtype, seq_dtype, varlen):
    from flashqla.ops.gdn.kernels.sm90.states_bwd import build_states_kernel

    src = build_states_kernel(2, 4, 128, 128, "bfloat16", h_dtype, seq_dtype, varlen).get_kernel_source()
    assert "wgmma" in src and "exp2" in src


def test_states_kernel_rejects_h_dtype():
    from flashqla.ops.gdn.kernels.sm90.states_bwd import build_states_kernel

    with pytest.raises(ValueError, match="h_dtype"):
        build_states_kernel(2, 4, 128, 128, "bfloat16", "int32", "int32", False)


@needs_nvcc
@pytest.mark.parametrize(
    "dtype,h_dtype,beta_dtype,seq_dtype,varlen",
    [("bfloat16", "bfloat16", "float32", "int32", True), ("float16", "float32", "float16", "int64", False)],
    ids=["bf16-hbf16-varlen", "fp16-hfp32-fixed"],
)
def test_chunk_bwd_kernel_compiles(dtype, h_dtype, beta_dtype, seq_dtype, varlen):
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import build_chunk_bwd_kernel

    src = build_chunk_bwd_kernel(1, 2, 128, 128, dtype, h_dtype, beta_dtype, seq_dtype, varlen).get_kernel_source()
    assert "wgmma" in src and "exp2" in src
    assert _smem_high_water(src) < SMEM_LIMIT, "shared memory over Hopper's 227 KB per block"


@needs_nvcc
def test_finish_kernels_compile():
    from flashqla.ops.gdn.kernels.sm90.finish_bwd import build_dg_cumsum_kernel, build_gva_reduce_kernel

    assert "dg" in build_dg_cumsum_kernel(4, "int32", True).get_kernel_source()
    assert "dg" in build_dg_cumsum_kernel(4, "int64", False).get_kernel_source()
    src = build_gva_reduce_kernel(2, 4, 128, "bfloat16").get_kernel_source()
    assert "dq_hv" in src


def test_build_kernels_knows_the_backward_kinds():
    from flashqla.ops.gdn.kernels import sm90

    with pytest.raises(ValueError, match="unknown kernel kind"):
        sm90._build("bogus", ())


def test_custom_ops_fake_shapes_on_meta():
    """The torch.library fake implementations (what torch.compile traces) give the kernels' output
    shapes and dtypes: fixed length and packed, with and without states."""
    import flashqla.ops.gdn.autograd  # noqa: F401 - registers flashqla::gdn_fwd / gdn_bwd

    m = dict(device="meta")
    for B, T, cu, N in ((2, 130, None, 2), (1, 300, torch.tensor([0, 5, 5, 300], **m), 3)):
        q = torch.empty(B, T, 2, 128, dtype=torch.bfloat16, **m)
        v = torch.empty(B, T, 4, 128, dtype=torch.bfloat16, **m)
        g = torch.empty(B, T, 4, **m)
        h0 = torch.empty(N, 4, 128, 128, **m)
        S = B * 3 if cu is None else 300 // 64 + 3
        o, ht, A, gc = torch.ops.flashqla.gdn_fwd(q, q, v, g, g, 0.1, h0, True, cu)
        assert o.shape == v.shape and o.dtype == torch.bfloat16
        assert ht.shape == (N, 4, 128, 128) and ht.dtype == torch.float32
        assert A.shape == (4, S * 64, 64) and A.dtype == torch.bfloat16
        assert gc.shape == (4, S * 64) and gc.dtype == torch.float32
        _, ht, _, _ = torch.ops.flashqla.gdn_fwd(q, q, v, g, g, 0.1, None, False, cu)
        assert ht.numel() == 0
        dq, dk, dv, dg, dbeta, dh0 = torch.ops.flashqla.gdn_bwd(q, q, v, g, g, A, gc, v, h0, 0.1, h0, cu)
        assert dq.shape == q.shape and dv.shape == v.shape and dg.dtype == torch.float32
        assert dbeta.shape == g.shape and dh0.shape == h0.shape


def test_public_op_with_gradients_needs_a_hopper_gpu():
    import flashqla

    x = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16, requires_grad=True)
    g = torch.zeros(1, 4, 1)
    with pytest.raises(RuntimeError, match="CUDA device of compute capability 9.0"):
        flashqla.chunk_gated_delta_rule(x, x, x, g, g)


@pytest.mark.parametrize("varlen", [False, True])
def test_op_kernel_specs_match_the_launch_keys(varlen):
    """`op_kernel_specs` (what precompiling uses) names exactly the kernels a call builds."""
    from flashqla.ops.gdn.kernels.sm90 import op_kernel_specs
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_bwd_kernel_args
    from flashqla.ops.gdn.kernels.sm90.prepare import prepare_kernel_args
    from flashqla.ops.gdn.kernels.sm90.recurrent import recurrent_kernel_args
    from flashqla.ops.gdn.kernels.sm90.states_bwd import states_kernel_args

    q = torch.empty(1, 10, 2, 128, dtype=torch.bfloat16)
    v = torch.empty(1, 10, 4, 128, dtype=torch.bfloat16)
    beta = torch.empty(1, 10, 4)
    cu = torch.tensor([0, 3, 10]) if varlen else None
    h = torch.empty(1, dtype=torch.bfloat16)
    N = 2 if varlen else 1
    specs = dict(op_kernel_specs(2, 4, N=N, varlen=varlen, seq_dtype="int64" if varlen else "int32"))
    assert specs["prepare"] == prepare_kernel_args(q, beta, cu, 4)
    assert specs["recurrent"] == recurrent_kernel_args(q, v, cu)
    assert specs["states_bwd"] == states_kernel_args(q, v, cu, torch.bfloat16)
    assert specs["chunk_bwd"] == chunk_bwd_kernel_args(q, v, beta, h, cu)
    assert specs["gva_reduce"] == (2, 4, 128, "bfloat16") and specs["dg_cumsum"][-1] == varlen


def test_cp_mode_is_checked_before_device_work(monkeypatch):
    import flashqla
    from flashqla.ops.gdn.api import CP_ENV, cp_mode

    monkeypatch.delenv(CP_ENV, raising=False)
    assert cp_mode(None) == "off" and cp_mode("auto") == "auto"
    monkeypatch.setenv(CP_ENV, "on")
    assert cp_mode(None) == "on"
    x = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, 4, 1)
    with pytest.raises(ValueError, match="cp must be"):
        flashqla.chunk_gated_delta_rule(x, x, x, g, g, cp="sometimes")
    monkeypatch.setenv(CP_ENV, "bogus")
    with pytest.raises(ValueError, match="cp must be"):
        flashqla.chunk_gated_delta_rule(x, x, x, g, g)

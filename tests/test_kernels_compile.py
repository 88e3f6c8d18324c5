"""CPU tier: every sm_90 kernel lowers and compiles for sm_90a without a GPU (TileLang + nvcc), and
the public op rejects unsupported inputs before any device work (and before building a kernel)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from flashqla.testing import make_gdn_inputs

HAVE_NVCC = shutil.which("nvcc") is not None
needs_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="compiling for sm_90a needs nvcc (the CUDA toolkit) on PATH")


# --------------------------------------------------------------------------------------------
# kernels lower and compile
# --------------------------------------------------------------------------------------------


@needs_nvcc
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_prepare_kernel_compiles(varlen):
    from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel

    kernel = build_prepare_kernel(2, 4, 128, "bfloat16", "float32", "int32", varlen)
    src = kernel.get_kernel_source()
    assert "wgmma" in src, "K K^T should run on wgmma"
    assert "kTensorFloat32" in src, "the block inverse should run tf32 mma"
    assert "exp2" in src


@needs_nvcc
@pytest.mark.parametrize(
    "BV,dtype,seq_dtype,varlen",
    [(128, "bfloat16", "int32", True), (64, "bfloat16", "int32", False), (64, "float16", "int64", True)],
    ids=["bv128-bf16-varlen", "bv64-bf16-fixed", "bv64-fp16-int64-varlen"],
)
def test_recurrent_kernel_compiles(BV, dtype, seq_dtype, varlen):
    from flashqla.ops.gdn.kernels.sm90.recurrent import build_recurrent_kernel

    kernel = build_recurrent_kernel(1, 2, 128, 128, BV, dtype, seq_dtype, varlen)
    src = kernel.get_kernel_source()
    assert "wgmma_rs" in src, "the state chain should take its left operand from registers"
    assert "tma_load" in src, "chunk tiles should be loaded by TMA"
    assert "warpgroup_reg_dealloc" in src or BV == 64, "producer warpgroup should give registers back"


@needs_nvcc
@pytest.mark.parametrize("BV,varlen", [(128, True), (64, False)], ids=["bv128-varlen", "bv64-fixed"])
def test_recurrent_overlap_schedule_compiles(BV, varlen):
    from flashqla.ops.gdn.kernels.sm90.recurrent import build_recurrent_kernel

    kernel = build_recurrent_kernel(1, 2, 128, 128, BV, "bfloat16", "int32", varlen, "overlap")
    src = kernel.get_kernel_source()
    assert "wgmma_rs" in src and "tma_load" in src
    assert "wait_wgmma<2>" in src and "wait_wgmma<1>" in src, "independent wgmma should be issued back to back"
    # the pipeliner must release a stage only after the wgmma reading it completed: the release of
    # k (its last reader is the state update) follows the last wait of the loop body
    body = src[src.rindex("wait_wgmma<0>") :]
    assert ".arrive();" in body.split("\n    }")[0]


@needs_nvcc
def test_recurrent_serial_schedule_compiles():
    from flashqla.ops.gdn.kernels.sm90.recurrent import build_recurrent_kernel

    src = build_recurrent_kernel(1, 2, 128, 128, 128, "bfloat16", "int32", True, "serial").get_kernel_source()
    assert "wgmma_rs" in src and "wait_wgmma" not in src


def test_recurrent_schedule_is_checked():
    from flashqla.ops.gdn.kernels.sm90.recurrent import SCHEDULES, build_recurrent_kernel

    assert SCHEDULES == ("serial", "overlap")
    with pytest.raises(ValueError, match="schedule"):
        build_recurrent_kernel(1, 2, 128, 128, 64, "bfloat16", "int32", False, "bogus")


@needs_nvcc
def test_compile_cache_hit_does_not_recompile():
    from flashqla.ops.gdn.kernels.sm90._common import compile_count
    from flashqla.ops.gdn.kernels.sm90.recurrent import build_recurrent_kernel

    build_recurrent_kernel(1, 2, 128, 128, 128, "bfloat16", "int32", True)
    n = compile_count()
    build_recurrent_kernel(1, 2, 128, 128, 128, "bfloat16", "int32", True)
    assert compile_count() == n


def test_block_v_heuristic():
    from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v

    assert pick_block_v(4, 64) == 128
    assert pick_block_v(1, 8) == 64
    assert pick_block_v(2, 46) == 128  # 92 CTAs of 132 SMs


def test_slot_count_is_an_upper_bound():
    from flashqla.ops.gdn.kernels.sm90._common import CHUNK, num_slots

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        lens = torch.randint(0, 300, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        S = num_slots(1, cu[-1], len(lens), True)
        end = 0
        for n, L in enumerate(lens):
            first = cu[n] // CHUNK + n
            assert first >= end, "slots of consecutive sequences overlap"
            end = first + (L + CHUNK - 1) // CHUNK
        assert end <= S


# --------------------------------------------------------------------------------------------
# validation fires before device work
# --------------------------------------------------------------------------------------------


def _inputs(**kw):
    x = make_gdn_inputs(B=1, T=8, H=1, HV=2, dtype=torch.bfloat16, **kw)
    return x


def _call(x, **kw):
    from flashqla import chunk_gated_delta_rule

    args = dict(x)
    args.update(kw)
    return chunk_gated_delta_rule(**args)


def _no_compile(fn):
    from flashqla.ops.gdn.kernels.sm90._common import compile_count

    n = compile_count()
    fn()
    assert compile_count() == n, "a kernel was built before the argument checks"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rejects_unsupported_qkv_dtype(dtype):
    x = make_gdn_inputs(B=1, T=8, H=1, HV=2, dtype=dtype)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        _no_compile(lambda: _call(x))


def test_rejects_head_dim_other_than_128():
    x = make_gdn_inputs(B=1, T=8, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K = V = 128"):
        _no_compile(lambda: _call(x))


def test_rejects_g_not_fp32():
    x = _inputs()
    x["g"] = x["g"].to(torch.bfloat16)
    with pytest.raises(TypeError, match="g in float32"):
        _no_compile(lambda: _call(x))


def test_rejects_beta_dtype():
    x = _inputs()
    x["beta"] = x["beta"].to(torch.float16)
    with pytest.raises(TypeError, match="beta"):
        _no_compile(lambda: _call(x))


def test_rejects_initial_state_dtype():
    x = _inputs()
    x["initial_state"] = x["initial_state"].to(torch.bfloat16)
    with pytest.raises(TypeError, match="initial_state in float32"):
        _no_compile(lambda: _call(x))


def test_shape_errors_come_from_shared_validation():
    x = make_gdn_inputs(B=1, T=8, H=2, HV=3, dtype=torch.bfloat16, special_heads=False)
    with pytest.raises(ValueError, match="multiple of the q/k head count"):
        _no_compile(lambda: _call(x))


def test_valid_inputs_off_gpu_raise_device_error_without_building():
    x = _inputs()
    with pytest.raises(RuntimeError, match="compute capability 9.0"):
        _no_compile(lambda: _call(x, output_final_state=True))


def test_backward_not_available():
    x = _inputs()
    x["q"] = x["q"].requires_grad_()
    with pytest.raises(NotImplementedError, match="backward is not available yet"):
        _no_compile(lambda: _call(x))
    with torch.no_grad():  # no grad requested: the check passes and the device check fires
        with pytest.raises(RuntimeError, match="compute capability"):
            _call(x)


def test_import_does_not_load_tilelang():
    code = "import flashqla, sys; flashqla.chunk_gated_delta_rule; print('tilelang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

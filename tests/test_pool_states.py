"""CPU tier of the serving torch path's state-move kernels (`flashqla.ops.gdn.kernels.sm90.pool_states`):
each compiles for sm_90a without spills; the torch functions they replace stay the CPU path
(`CheckpointParts.states()` against a direct fp64 evaluation of record CP-1's combination); where
they apply; the specs a serving warm-up lists. Their values against those torch functions are
checked on the GPU (tests/gpu/test_serving_gpu.py, `test_state_moves_match_torch`)."""

from __future__ import annotations

import shutil

import pytest
import torch

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="compiling for sm_90a needs nvcc")


@needs_nvcc
@pytest.mark.parametrize("layout", ["kv", pytest.param("vk", marks=pytest.mark.compile_all)])
def test_checkpoint_combine_kernel_compiles(layout):
    """The combine: the segment found by a binary search over the ends in the kernel, CP's rows staged
    with one float of padding, the K loop an fp32 FMA loop on the CUDA cores (no tensor-core
    instruction: the product keeps fp32), no spills."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.pool_states import build_checkpoint_combine_kernel

    kernel = build_checkpoint_combine_kernel(128, 128, "bfloat16", layout, "int64")
    src = kernel.get_kernel_source()
    assert "seg_end[" in src and "129" in src, "the binary search or the padded CP rows are gone"
    assert "mma" not in src and "wgmma" not in src
    rep = ptxas_report(kernel)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep


@needs_nvcc
@pytest.mark.parametrize("kind", ["gather", pytest.param("store", marks=pytest.mark.compile_all)])
def test_pool_gather_and_store_kernels_compile(kind):
    """The pool gather (run-time switches for indices and has_initial_state) and store ("vk": through a
    padded shared tile), no spills."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90 import pool_states as ps

    build = ps.build_pool_gather_kernel if kind == "gather" else ps.build_pool_store_kernel
    kernel = build(128, 128, "bfloat16", "vk", "int32")
    src = kernel.get_kernel_source()
    assert "state_indices[" in src
    if kind == "gather":
        assert "has_initial_state[" in src and "indexed" in src and "masked" in src
    rep = ptxas_report(kernel)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep


def test_builders_check_layout_and_width():
    from flashqla.ops.gdn.kernels.sm90 import pool_states as ps

    with pytest.raises(ValueError, match="layout must be one of"):
        ps.build_pool_store_kernel(128, 128, "bfloat16", "kvv", "int32")
    with pytest.raises(ValueError, match="V divisible by 32"):
        ps.build_checkpoint_combine_kernel(128, 48, "float32", "kv", "int32")
    for K in (48, 16):  # 32 rows a CTA: a K that is not a multiple would leave rows unwritten
        with pytest.raises(ValueError, match="multiple of 32"):
            ps.build_pool_gather_kernel(K, 128, "bfloat16", "vk", "int32")
        with pytest.raises(ValueError, match="multiple of 32"):
            ps.build_pool_store_kernel(K, 128, "bfloat16", "kv", "int64")


def test_checkpoint_parts_states_is_record_cp1():
    """`CheckpointParts.states()` (the torch path) = CQ + CP S_in(j), j the first segment whose end is
    past p - 1, against an fp64 loop; positions on a segment's end take that segment."""
    from flashqla.cp.forward import CheckpointParts

    g = torch.Generator().manual_seed(0)
    M, Ms, HV, K, V = 5, 3, 2, 4, 6
    CQ = torch.randn(M, HV, K, V, generator=g, dtype=torch.float64)
    CP = torch.randn(M, HV, K, K, generator=g, dtype=torch.float64)
    S_in = torch.randn(Ms, HV, K, V, generator=g, dtype=torch.float64)
    ends = torch.tensor([10, 10, 30])
    pos = torch.tensor([1, 10, 11, 29, 30])
    got = CheckpointParts(CQ, CP, S_in, ends, pos).states()
    for m, p in enumerate(pos.tolist()):
        j = next(i for i, e in enumerate(ends.tolist()) if e > p - 1)
        assert torch.allclose(got[m], CQ[m] + CP[m] @ S_in[j], rtol=0, atol=1e-12)


def test_state_kernels_do_not_apply_off_gpu():
    from flashqla.ops.gdn.serving import state_kernels_apply
    from flashqla.serving import ServingArgs

    s = ServingArgs(None, None, "vk", None, None, None, False, False, 0)
    assert not state_kernels_apply(torch.zeros(1, 4, 2, 128), s)


def test_serving_specs_list_the_state_moves_with_split():
    from flashqla.ops.gdn.kernels.sm90.registry import BUILDERS, serving_kernel_specs

    specs = serving_kernel_specs(2, 8, N=2, varlen=True, state_dtypes=("bfloat16",), state_layouts=("vk",), split=True)
    kinds = {k for k, _ in specs}
    assert {"pool_gather", "pool_store", "checkpoint_combine"} <= kinds <= set(BUILDERS)
    assert ("checkpoint_combine", (128, 128, "bfloat16", "vk", "int64")) in specs
    plain = {k for k, _ in serving_kernel_specs(2, 8, N=2, varlen=True)}
    assert {"pool_gather", "pool_store"} <= plain and "checkpoint_combine" not in plain


def test_gather_keeps_none_and_non_contiguous_pools_on_torch(monkeypatch):
    """`_gather`: no initial_state stays None (a "vk" call without one must not reach the kernel), and a
    pool with padded rows (a view of a larger cache) takes torch's gather of its N rows, not the
    kernel's contiguous copy of every row."""
    from flashqla.ops.gdn import serving as op_serving
    from flashqla.ops.gdn.kernels.sm90 import pool_states
    from flashqla.serving import ServingArgs, gather_initial_states

    def boom(*a, **k):
        raise AssertionError("the kernel was called")

    monkeypatch.setattr(pool_states, "gather_states", boom)
    s = ServingArgs(None, None, "vk", None, None, None, False, False, 0)
    assert op_serving._gather(None, s, 2, True) is None
    big = torch.randn(6, 2, 8, 8)
    pool = big[::2]  # 3 rows, padded stride
    idx = torch.tensor([2, -1])
    sp = ServingArgs(idx, None, "vk", None, None, None, False, True, 3)
    assert torch.equal(op_serving._gather(pool, sp, 2, True), gather_initial_states(pool, sp, 2, torch.float32))

"""The inference forward's fp16 A_beta product (`flashqla.ops.gdn.fwd.product_dtype`): the prepare
kernel's `a_dtype` and the recurrent kernel's `op_dtype` builds. The default tier lowers the prepare
build and the plain recurrent build for sm_90a (TileLang's lowering, no nvcc: A stored in fp16, the
scaled products in fp16, no division left on either role); under `compile_all` (the CPU suite's
time bound; the product is opt-in) they compile without spills, with the default builds' registers
(and shared memory, plus the row scales and their inverses vn^T shares with the output role), and so
do the dual and serving builds with checkpoints at value slice widths 64 and 128; every build's shared
memory (dynamic plus static) fits a CTA's 232,448 bytes, which the launch needs on an H100 or H200
(an fp32 copy of the scales and their inverses took the width-128 builds 512 bytes past it). Their
default builds' generated sources are the recorded ones (tests/test_kernel_sources.py)."""

from __future__ import annotations

import pytest

from flashqla.ops.gdn.kernels.sm90 import prepare as P
from flashqla.ops.gdn.kernels.sm90 import recurrent as R
from flashqla.ops.gdn.kernels.sm90._common import ptxas_report

from tests.host_cuda import needs_nvcc

#: Shared memory one CTA may use on sm_90 (dynamic plus static, bytes: cudaDevAttrMaxSharedMemoryPerBlockOptin)
SMEM_LIMIT = 232448


def _fits(rep: dict) -> bool:
    return rep["dynamic_smem"] is not None and rep["dynamic_smem"] + rep["static_smem"] <= SMEM_LIMIT


def _lowered(func) -> str:
    tilelang = pytest.importorskip("tilelang")
    from tilelang import tvm

    from flashqla.ops.gdn.kernels.sm90._common import _pass_configs, sm90_target

    with tvm.transform.PassContext(config=_pass_configs()), tvm.target.Target(sm90_target()):
        return tilelang.lower(func, target=sm90_target()).kernel_source


def test_fp16_a_beta_builds_lower():
    """The prepare build stores A in fp16; the plain recurrent build forms both scaled products from
    fp16 operands and multiplies by each row scale's inverse instead of dividing by the scale. The
    prepare source also gets `test_kernels_compile._assert_store_wait_then_barrier` here, where no
    nvcc is needed (several value heads a CTA: the staging tile is rewritten only after a barrier that
    follows the wait for the previous head's TMA store; the compiled bf16 builds of
    `test_prepare_kernel_compiles` check the same)."""
    from test_kernels_compile import _assert_store_wait_then_barrier, _head_loop_body

    prep = _lowered(P._prepare_prim_func(2, 8, 128, "bfloat16", "float32", "int32", True, a_dtype="float16"))
    assert "half_t" in prep
    _assert_store_wait_then_barrier(_head_loop_body(prep))
    rec = _lowered(R._recurrent_prim_func(2, 8, 128, 128, "bfloat16", "int32", True, False, 64, "float16"))
    assert "kFloat16" in rec  # the fp16 wgmma of the A_beta and output products
    assert "wsi" in rec and "/wsc" not in rec.replace(" ", "") and "/v__" not in rec.replace(" ", "")


@needs_nvcc
@pytest.mark.compile_all
def test_fp16_a_beta_prepare_matches_the_shipped_build():
    base = ptxas_report(P.build_prepare_kernel(2, 8, 128, "bfloat16", "float32", "int32", True))
    fp16 = P.build_prepare_kernel(2, 8, 128, "bfloat16", "float32", "int32", True, a_dtype="float16")
    rep = ptxas_report(fp16)
    assert rep["spill_stores"] == rep["spill_loads"] == 0
    assert (rep["registers"], rep["dynamic_smem"]) == (base["registers"], base["dynamic_smem"])
    src = fp16.get_kernel_source()
    assert "half_t" in src  # A stored in fp16


@needs_nvcc
@pytest.mark.parametrize("kw", [
    pytest.param(dict(dual=False), marks=pytest.mark.compile_all),  # opt-in product: the default tier keeps the prepare check
    pytest.param(dict(dual=True, indexed=True, state_dtype="float32", state_layout="kv", checkpoints=True),
                 marks=pytest.mark.compile_all),
    pytest.param(dict(dual=False, indexed=True, state_dtype="bfloat16", state_layout="vk", checkpoints=True),
                 marks=pytest.mark.compile_all),
], ids=["plain", "dual-serving-ckpt", "serving-vk-bf16-ckpt"])
def test_fp16_a_beta_product_builds_spill_free(kw):
    kw = dict(kw)
    dual = kw.pop("dual")
    base = ptxas_report(R.build_recurrent_kernel(2, 8, 128, 128, 64, "bfloat16", "int32", True, dual, **kw))
    rep = ptxas_report(R.build_recurrent_kernel(2, 8, 128, 128, 64, "bfloat16", "int32", True, dual, op_dtype="float16",
                                                **kw))
    assert rep["spill_stores"] == rep["spill_loads"] == 0
    assert rep["registers"] == base["registers"] and _fits(rep)
    # vn^T's row scales and their inverses shared with the output role: 2 stages x 2 x BV bf16
    assert base["dynamic_smem"] <= rep["dynamic_smem"] <= base["dynamic_smem"] + 2 * 2 * 64 * 2


@needs_nvcc
@pytest.mark.compile_all
def test_fp16_a_beta_product_plain_build_at_width_128_is_spill_free():
    """The plain build at value slice width 128 (the SM-filling rows' width): no spill, the default
    build's registers (the past-the-end mask runs on a sequence's last chunk only; in the W^T loop it
    spilled 24 B a thread)."""
    base = ptxas_report(R.build_recurrent_kernel(16, 32, 128, 128, 128, "bfloat16", "int32", True))
    rep = ptxas_report(R.build_recurrent_kernel(16, 32, 128, 128, 128, "bfloat16", "int32", True, False, "float16"))
    assert rep["spill_stores"] == rep["spill_loads"] == 0
    assert rep["registers"] == base["registers"] and _fits(rep), rep


@needs_nvcc
@pytest.mark.compile_all
def test_fp16_a_beta_dual_build_at_width_128_fits():
    """The split path's run + transition launch with serving checkpoints at value slice width 128 and
    the fp16 product: no spill, shared memory within a CTA's."""
    kw = dict(indexed=True, state_dtype="float32", state_layout="kv", checkpoints=True)
    rep = ptxas_report(R.build_recurrent_kernel(16, 32, 128, 128, 128, "bfloat16", "int32", True, True,
                                                op_dtype="float16", **kw))
    assert rep["spill_stores"] == rep["spill_loads"] == 0 and _fits(rep), rep


@needs_nvcc
@pytest.mark.compile_all
def test_fp16_a_beta_serving_build_at_width_128_is_spill_free():
    """The serving build with bf16 "vk" states and checkpoints at value slice width 128 takes
    `NREG_SERVING_FP16`'s counts with the fp16 product (its output role spills at `NREG`'s), and then
    neither role spills; without checkpoints it keeps `NREG`'s (its chain needs 168) and does not
    spill either."""
    kw = dict(indexed=True, state_dtype="bfloat16", state_layout="vk", checkpoints=True)
    assert sum(R.NREG_SERVING_FP16[128][r] * n for r, n in (("chain", 2), ("output", 1), ("producer", 1))) \
        == R.reg_budget(128)
    rep = ptxas_report(R.build_recurrent_kernel(16, 32, 128, 128, 128, "bfloat16", "int32", True, False,
                                                op_dtype="float16", **kw))
    assert rep["spill_stores"] == rep["spill_loads"] == 0 and _fits(rep), rep
    src = R.build_recurrent_kernel(16, 32, 128, 128, 128, "bfloat16", "int32", True, False, op_dtype="float16",
                                   **kw).get_kernel_source()
    assert "warpgroup_reg_alloc<160>" in src and "warpgroup_reg_alloc<168>" in src
    kw["checkpoints"] = False
    plain = R.build_recurrent_kernel(16, 32, 128, 128, 128, "bfloat16", "int32", True, False, op_dtype="float16", **kw)
    rep = ptxas_report(plain)
    assert rep["spill_stores"] == rep["spill_loads"] == 0
    assert "warpgroup_reg_alloc<168>" in plain.get_kernel_source() and "warpgroup_reg_alloc<160>" not in plain.get_kernel_source()

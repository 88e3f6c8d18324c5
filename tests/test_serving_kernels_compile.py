"""CPU tier: the recurrent kernel's serving build (pools by index, state layout and dtype, in-kernel
checkpoints; `flashqla.ops.gdn.kernels.sm90.recurrent`) lowers for sm_90a, its options are checked by
name, and its device tables (rows, checkpoint slots) are right; under `compile_all` every width and
storage compiles with nvcc without register spills."""

from __future__ import annotations

import shutil

import pytest
import torch

from flashqla.ops.gdn.kernels.sm90 import recurrent as rec

HAVE_NVCC = shutil.which("nvcc") is not None


def test_serving_options_are_checked():
    with pytest.raises(ValueError, match="indexed=True"):
        rec.build_recurrent_kernel(2, 4, 128, 128, 64, "bfloat16", "int32", True, checkpoints=True)
    with pytest.raises(ValueError, match="state_dtype"):
        rec.build_recurrent_kernel(2, 4, 128, 128, 64, "bfloat16", "int32", True, indexed=True, state_dtype="float64")
    with pytest.raises(ValueError, match="state_layout"):
        rec.build_recurrent_kernel(2, 4, 128, 128, 64, "bfloat16", "int32", True, indexed=True, state_layout="kvv")
    with pytest.raises(ValueError, match="dual"):
        rec.build_recurrent_kernel(2, 4, 128, 128, 64, "bfloat16", "int32", True, True, indexed=True)


def test_serving_build_lowers():
    """The serving build with bf16 vk states and checkpoints lowers for sm_90a: states are read and
    written through the row tables, the checkpoint product is a wgmma over half the columns, and a
    chunk without a checkpoint ending before its last token takes the plain build's order (a run-time
    branch on its table range), a checkpoint at a chunk's last token is stored from the updated state,
    and each chunk's range is found by the producer warp from the positions themselves (no table) and
    handed to the chain in shared memory."""
    tilelang = pytest.importorskip("tilelang")
    from tilelang import tvm

    from flashqla.ops.gdn.kernels.sm90._common import _pass_configs, sm90_target

    f = rec._serving_prim_func(2, 4, 128, 128, "bfloat16", "int32", True, 64, "bfloat16", "vk", True)
    with tvm.transform.PassContext(config=_pass_configs()), tvm.target.Target(sm90_target()):
        src = tilelang.lower(f, target=sm90_target()).kernel_source
    assert "gdn_recurrent_serving_fwd" in src
    for name in ("rows[", "has_init[", "positions[", "ckpt"):
        assert name in src, f"{name} is not used by the serving build"
    # chain: U, vn, the checkpoint half, the S update in each order (chunks with checkpoints publish vn
    # first; chunks without run the plain build's order); output: O += Pg vn
    assert src.count("wgmma_rs<") == 5 + 1, "chain: U, vn, checkpoint half, S update x 2; output: O += Pg vn"
    assert "if (mid == 0)" in src and "if (mid != 0)" in src, \
        "chunks without a checkpoint inside them should take the plain order at run time"
    producer = src[src.index("warpgroup_reg_dealloc"):]
    roles = src[:src.index("warpgroup_reg_dealloc")]
    assert producer.count("__ballot_sync(0xFFFFFFFFu") == 4, \
        "the producer warp counts positions by ballot: the first-checkpoint search (2) and each chunk's range (p <= e, p < e)"
    assert "positions[" in producer and roles.count("positions[") == 1, \
        "the chain reads a position only for a checkpoint inside a chunk; the ranges are the producer's"
    assert "ck_s)[" in producer and "ck_s)[" in roles, "the range should reach the chain through shared memory"
    assert "64, 64, 16, false, true" in src, "the checkpoint's wgmma should be 64 columns (half of K) wide"


@pytest.mark.compile_all
@pytest.mark.skipif(not HAVE_NVCC, reason="compiling for sm_90a needs nvcc (the CUDA toolkit) on PATH")
@pytest.mark.parametrize("BV", [64, 128])
@pytest.mark.parametrize("state_dtype,layout,ckpt", [("float32", "kv", False), ("bfloat16", "vk", True),
                                                     ("float16", "kv", True)])
def test_serving_build_compiles_without_spills(BV, state_dtype, layout, ckpt):
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report

    kernel = rec.build_recurrent_kernel(2, 4, 128, 128, BV, "bfloat16", "int32", True, indexed=True,
                                        state_dtype=state_dtype, state_layout=layout, checkpoints=ckpt)
    r = ptxas_report(kernel)
    print(r)
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"register spills: {r}"

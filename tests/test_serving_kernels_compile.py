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
    and the table reads are the producer's (handed to the chain in shared memory)."""
    tilelang = pytest.importorskip("tilelang")
    from tilelang import tvm

    from flashqla.ops.gdn.kernels.sm90._common import _pass_configs, sm90_target

    f = rec._serving_prim_func(2, 4, 128, 128, "bfloat16", "int32", True, 64, "bfloat16", "vk", True)
    with tvm.transform.PassContext(config=_pass_configs()), tvm.target.Target(sm90_target()):
        src = tilelang.lower(f, target=sm90_target()).kernel_source
    assert "gdn_recurrent_serving_fwd" in src
    for name in ("state_read", "state_write", "ck_slots", "ck_j", "ckpt"):
        assert name in src, f"{name} is not used by the serving build"
    # chain: U, vn, the checkpoint half, the S update in each order (chunks with checkpoints publish vn
    # first; chunks without run the plain build's order); output: O += Pg vn
    assert src.count("wgmma_rs<") == 5 + 1, "chain: U, vn, checkpoint half, S update x 2; output: O += Pg vn"
    assert "if (mid == 0)" in src and "if (mid != 0)" in src, \
        "chunks without a checkpoint inside them should take the plain order at run time"
    assert src.count("ck_j[") == 2, "ck_j read by the producer (the chunk-end suffix) and for the inside checkpoints"
    producer = src[src.index("tl::tma_load(q_desc"):]
    assert "ck_slots[" in producer and "ck_slots[" not in src[:src.index("tl::tma_load(q_desc")], \
        "the chunk's checkpoint range should be read by the producer only, off the chain's path"
    assert "ck_s)[" in producer and "ck_s)[" in src[:src.index("tl::tma_load(q_desc")], \
        "the range should reach the chain through shared memory"
    assert "64, 64, 16, false, true" in src, "the checkpoint's wgmma should be 64 columns (half of K) wide"


def _tables_by_loop(positions, cu, B, T):
    C = 64
    slot0 = [cu[n] // C + n for n in range(len(cu) - 1)] if cu is not None else None
    bounds = list(zip(cu[:-1], cu[1:])) if cu is not None else [(b * T, (b + 1) * T) for b in range(B)]
    if slot0 is None:
        slot0 = [b * ((T + C - 1) // C) for b in range(B)]
    slots, js = [], []
    for p in positions:
        n = next(i for i, (b, e) in enumerate(bounds) if b < p <= e)
        c = (p - 1 - bounds[n][0]) // C
        slots.append(slot0[n] + c)
        js.append(p - bounds[n][0] - c * C)
    return slots, js


@pytest.mark.parametrize("cu,B,T,positions", [
    ([0, 130, 131, 131, 195, 300], 1, 300, [1, 63, 64, 65, 130, 131, 132, 195, 259, 300]),
    (None, 2, 200, [1, 64, 65, 200, 201, 400]),
    ([0, 64, 128], 1, 128, []),
])
def test_checkpoint_tables(cu, B, T, positions):
    """ck_slots / ck_j (device ops, no host read) against a host loop: each checkpoint's chunk slot
    and its token count 1..64 inside the chunk, the slots' ranges covering every checkpoint once."""
    cu_t = torch.tensor(cu, dtype=torch.int32) if cu is not None else None
    ck_slots, ck_j = rec.checkpoint_tables(torch.tensor(positions, dtype=torch.int64), cu_t, B, T)
    slots, js = _tables_by_loop(positions, cu, B, T)
    assert ck_j.tolist() == js and ck_j.dtype == torch.int32
    for m, s in enumerate(slots):
        assert int(ck_slots[s]) <= m < int(ck_slots[s + 1])
    assert int(ck_slots[0]) == 0 and int(ck_slots[-1]) == len(positions)


def test_serving_state_rows():
    idx = torch.tensor([3, -1, 0, 5])
    has = torch.tensor([True, True, False, True])
    read, write = rec.serving_state_rows(4, idx, has, "cpu")
    assert read.tolist() == [3, -1, -1, 5] and write.tolist() == [3, -1, 0, 5]
    read, write = rec.serving_state_rows(3, None, None, "cpu")
    assert read.tolist() == write.tolist() == [0, 1, 2] and read.dtype == torch.int32


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


@pytest.mark.skipif(not HAVE_NVCC, reason="compiling for sm_90a needs nvcc (the CUDA toolkit) on PATH")
@pytest.mark.parametrize("seq,pos,varlen", [("int32", "int64", True), ("int64", "int32", True), ("int32", "int64", False)])
def test_checkpoint_tables_kernel_compiles(seq, pos, varlen):
    """The one-launch table kernel (`ckpt_tables`) lowers and compiles for sm_90a for each key; its
    source has the two binary searches (slot -> sequence, slot -> checkpoints before it) when packed,
    and no shared memory. (Its values against `recurrent.checkpoint_tables`: tests/gpu/test_serving_gpu.py.)"""
    from flashqla.ops.gdn.kernels.sm90.ckpt_tables import build_checkpoint_tables_kernel

    src = build_checkpoint_tables_kernel(seq, pos, varlen).get_kernel_source()
    assert "gdn_checkpoint_tables" in src and "__shared__" not in src
    assert src.count("for (int") >= (3 if varlen else 1)

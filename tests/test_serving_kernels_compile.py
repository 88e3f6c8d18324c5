"""CPU tier: the recurrent kernel's serving build (pools by index, state layout and dtype, in-kernel
checkpoints; `flashqla.ops.gdn.kernels.sm90.recurrent`) lowers for sm_90a, its options are checked by
name, and its device tables (rows, checkpoint slots) are right; under `compile_all` every width and
storage compiles with nvcc without register spills."""


import functools
import shutil
import tempfile

import pytest
import torch

from flashqla.ops.gdn.kernels.sm90 import recurrent as rec

HAVE_NVCC = shutil.which("nvcc") is not None


@functools.lru_cache(maxsize=None)
def _lowered_serving_source(phase_clock: bool = False) -> str:
    """The generated CUDA of the (2, 4) BV = 64 serving build with bf16 "vk" states and checkpoints
    (lowered once per process for the tests below; TileLang's lowering only, no nvcc)."""
    tilelang = pytest.importorskip("tilelang")
    from tilelang import tvm

    from flashqla.ops.gdn.kernels.sm90._common import _pass_configs, sm90_target

    f = rec._serving_prim_func(2, 4, 128, 128, "bfloat16", "int32", True, 64, "bfloat16", "vk", True,
                               phase_clock=phase_clock)
    with tvm.transform.PassContext(config=_pass_configs()), tvm.target.Target(sm90_target()):
        return tilelang.lower(f, target=sm90_target()).kernel_source


def test_serving_options_are_checked():
    with pytest.raises(ValueError, match="indexed=True"):
        rec.build_recurrent_kernel(2, 4, 128, 128, 64, "bfloat16", "int32", True, checkpoints=True)
    with pytest.raises(ValueError, match="state_dtype"):
        rec.build_recurrent_kernel(2, 4, 128, 128, 64, "bfloat16", "int32", True, indexed=True, state_dtype="float64")
    with pytest.raises(ValueError, match="state_layout"):
        rec.build_recurrent_kernel(2, 4, 128, 128, 64, "bfloat16", "int32", True, indexed=True, state_layout="kvv")
    with pytest.raises(ValueError, match="dual"):
        rec.build_recurrent_kernel(2, 4, 128, 128, 64, "bfloat16", "int32", True, True, indexed=True)
    with pytest.raises(ValueError, match="dual"):  # the split path's checkpoint build: fp32 kv only
        rec.build_recurrent_kernel(2, 4, 128, 128, 64, "bfloat16", "int32", True, True, indexed=True,
                                   state_dtype="bfloat16", checkpoints=True)
    with pytest.raises(ValueError, match="dual"):
        rec.build_recurrent_kernel(2, 4, 128, 128, 64, "bfloat16", "int32", True, True, indexed=True,
                                   state_layout="vk", checkpoints=True)
    with pytest.raises(ValueError, match="K == V"):
        rec.build_recurrent_kernel(2, 4, 128, 64, 64, "bfloat16", "int32", True, True, indexed=True, checkpoints=True)


def test_split_checkpoint_build_lowers():
    """The split path's dual launch with checkpoints (`chunk_recurrent_dual_checkpoints`) lowers for
    sm_90a: a grid of transition then run CTAs, the transitions' checkpoints into ckp and U, the
    run's into ckpt and o, P cut where the walk stopped short."""
    tilelang = pytest.importorskip("tilelang")
    from tilelang import tvm

    from flashqla.ops.gdn.kernels.sm90._common import _pass_configs, sm90_target

    f = rec._serving_prim_func(2, 4, 128, 128, "bfloat16", "int32", True, 128, "float32", "kv", True, True)
    with tvm.transform.PassContext(config=_pass_configs()), tvm.target.Target(sm90_target()):
        src = tilelang.lower(f, target=sm90_target()).kernel_source
    for name in ("ckp[", "ckpt[", "limit[", "pt[", "(u + ", "(o + "):  # (o and U by 16-byte vector stores)
        assert name in src, f"{name} is not used by the split checkpoint build"
    assert "positions[" in src and "__ballot_sync" in src, "the ranges should come from the positions"


def test_serving_build_lowers():
    """The serving build with bf16 vk states and checkpoints lowers for sm_90a: states are read and
    written through the row tables, the checkpoint product is a wgmma over half the columns, the chunks
    without a checkpoint run the plain chain in an inner loop (bounded by the next chunk that holds one,
    handed over by the producer) and a chunk that holds one runs its own code (a checkpoint inside it
    takes the checkpoint order at run time, one at its last token is stored from the updated state),
    and each chunk's range is found by the producer warp from the positions themselves (no table) and
    handed to the chain in shared memory."""
    src = _lowered_serving_source()
    assert "gdn_recurrent_serving_fwd" in src
    for name in ("rows[", "has_init[", "positions[", "ckpt"):
        assert name in src, f"{name} is not used by the serving build"
    # chain: the plain run's U, vn and S update; the checkpoint chunk's U, vn, checkpoint half and S update
    # in each order (a checkpoint inside the chunk publishes vn first); output: O += Pg vn
    assert src.count("wgmma_rs<") == 3 + 5 + 1, \
        "chain: plain U, vn, S update; checkpoint chunk U, vn, checkpoint half, S update x 2; output: O += Pg vn"
    assert "for (int c = cb; c < c_nx; ++c)" in src, "the chunks before the next checkpoint should run the plain loop"
    assert "if (mid == 0)" in src and "if (mid != 0)" in src, \
        "a chunk holding only chunk-end checkpoints should take the plain order at run time"
    producer = src[src.index("warpgroup_reg_dealloc"):]
    roles = src[:src.index("warpgroup_reg_dealloc")]
    assert producer.count("__ballot_sync(0xFFFFFFFFu") == 4, \
        "the producer warp counts positions by ballot: the first-checkpoint search (2) and each chunk's range (p <= e, p < e)"
    assert "positions[" in producer and roles.count("positions[") == 1, \
        "the chain reads a position only for a checkpoint inside a chunk; the ranges are the producer's"
    assert "ck_s)[" in producer and "ck_s)[" in roles, "the range should reach the chain through shared memory"
    assert "64, 64, 16, false, true" in src, "the checkpoint's wgmma should be 64 columns (half of K) wide"


def test_serving_phase_clock_build_lowers_and_leaves_the_shipped_source():
    """The serving build's phase-clock option (a measurement tool: `build_recurrent_serving_kernel_clocked`)
    lowers for sm_90a with its clock reads and its 7 sums a CTA and the same products, and the shipped
    build (phase_clock=False, the default) has no clock code."""
    pytest.importorskip("tilelang")
    shipped, clocked = _lowered_serving_source(), _lowered_serving_source(phase_clock=True)
    assert "clock64" not in shipped
    assert clocked.count("clocks[") == len(rec.SERVING_CLOCKS) and clocked.count("clock64") >= 10
    # the clocked build differs only by its stamps: the same products
    assert clocked.count("wgmma_rs<") == shipped.count("wgmma_rs<")


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


@pytest.mark.compile_all
@pytest.mark.skipif(not HAVE_NVCC, reason="compiling for sm_90a needs nvcc (the CUDA toolkit) on PATH")
@pytest.mark.parametrize("BV", [64, 128])
def test_split_checkpoint_build_compiles_without_spills(BV):
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report

    kernel = rec.build_recurrent_kernel(2, 8, 128, 128, BV, "bfloat16", "int32", True, True, indexed=True,
                                        checkpoints=True)
    r = ptxas_report(kernel)
    print(r)
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0, f"register spills: {r}"


# --------------------------------------------------------------------------------------------
# the checkpoint ranges (`recurrent.CheckpointRanges`): generated source run on the host
# --------------------------------------------------------------------------------------------

def _ranges_by_loop(positions, cu):
    """{chunk slot: (lo, end, hi)} by a host loop (the definition): chunk c of sequence n (slot
    cu[n] // 64 + n + c) holds the checkpoints with bos + 64 c < p <= e, e = bos + min(64 (c + 1), len),
    consecutive in the sorted positions; those with p < e, or all of them in a partial last chunk,
    come first (they end inside the chunk)."""
    out = {}
    for n in range(len(cu) - 1):
        bos, L = cu[n], cu[n + 1] - cu[n]
        for c in range((L + 63) // 64):
            e = bos + min(64 * (c + 1), L)
            ms = [m for m, p in enumerate(positions) if bos + 64 * c < p <= e]
            lo = sum(1 for p in positions if p <= bos + 64 * c)
            assert ms == list(range(lo, lo + len(ms)))
            inside = [m for m in ms if positions[m] < e or 64 * (c + 1) > L]
            out[cu[n] // 64 + n + c] = (lo, lo + len(inside), lo + len(ms))
    return out


def _ranges_prim_func(varlen: bool):
    """A one-warp-per-sequence kernel that writes `CheckpointRanges`' (lo, end, hi) for every chunk slot:
    the serving build's range code alone, so that its generated source can run on the host. Packed
    (cu_seqlens) or fixed-length (B sequences of Tn tokens, global offset b * Tn: the serving build's
    g0 = bidx * T + bos)."""
    import tilelang.language as T

    from flashqla.ops.gdn.kernels.sm90._common import sequence_span

    Np1, MP, NS = T.dynamic("Np1"), T.dynamic("MP"), T.dynamic("NS")

    @T.prim_func
    def checkpoint_ranges(cu_seqlens: T.Tensor((Np1,), "int32"), positions: T.Tensor((MP,), "int32"),
                          pos_stride: T.int32, n_ckpt: T.int32, nseq: T.int32, Tn: T.int32,
                          out: T.Tensor((NS, 3), "int32")):
        with T.Kernel(nseq, threads=32) as bx:
            tx = T.get_thread_binding()
            bos, seqlen, bidx, slot0, nchunks = sequence_span(bx, cu_seqlens, Tn, varlen)
            ranges = rec.CheckpointRanges(positions, pos_stride, n_ckpt, tx, bidx * Tn + bos, seqlen)
            for c in T.serial(nchunks):
                lo, end, hi = ranges.chunk(c)
                if tx == 0:
                    out[slot0 + c, 0] = lo
                    out[slot0 + c, 1] = end
                    out[slot0 + c, 2] = hi

    return checkpoint_ranges


@pytest.fixture(scope="module")
def ranges_on_host():
    pytest.importorskip("tilelang")
    from tests import host_cuda
    if host_cuda.CXX is None:
        pytest.skip("running the generated source on the host needs a C++ compiler")
    import tilelang
    from tilelang import tvm

    from flashqla.ops.gdn.kernels.sm90._common import _pass_configs, sm90_target

    kernels = {}
    with tempfile.TemporaryDirectory() as d:
        for varlen in (True, False):
            with tvm.transform.PassContext(config=_pass_configs()), tvm.target.Target(sm90_target()):
                src = tilelang.lower(_ranges_prim_func(varlen), target=sm90_target()).kernel_source
            assert src.count("__ballot_sync(0xFFFFFFFFu") == 4, "the search's two votes and the chunk's two"
            kernels[varlen] = host_cuda.HostKernel(src, d, f"ranges{int(varlen)}")
        yield kernels


def _random_case(g):
    N = int(torch.randint(1, 7, (1,), generator=g))
    lens = [[0, 1, 63, 64, 65, 128, int(torch.randint(0, 400, (1,), generator=g))][int(torch.randint(0, 7, (1,), generator=g))]
            for _ in range(N)]
    cu = [0]
    for L in lens:
        cu.append(cu[-1] + L)
    pos = []
    for b, e in zip(cu[:-1], cu[1:]):
        if e == b:
            continue
        k = [0, 1, 3, 40, 100][int(torch.randint(0, 5, (1,), generator=g))]
        pos += torch.randint(b + 1, e + 1, (k,), generator=g).tolist()
        if torch.rand(1, generator=g) < 0.3:
            pos += [b + 1] * int(torch.randint(1, 70, (1,), generator=g))  # one position repeated
        if torch.rand(1, generator=g) < 0.3:
            pos += list(range(b + 1, min(e, b + 130) + 1))  # every token of two chunks
    return cu, sorted(pos)


def _run_ranges(kernel, cu, pos, pos_dtype, nseq, Tn, NS):
    p = torch.tensor(pos if pos else [0], dtype=pos_dtype)
    words = p.view(torch.int32) if pos_dtype == torch.int64 else p
    out = torch.full((NS, 3), -7, dtype=torch.int32)
    kernel.launch(nseq, dict(cu_seqlens=torch.tensor(cu, dtype=torch.int32), positions=words, out=out),
                  dict(Np1=len(cu), MP=words.numel(), NS=NS, pos_stride=2 if pos_dtype == torch.int64 else 1,
                       n_ckpt=len(pos), nseq=nseq, Tn=Tn))
    return out


@pytest.mark.parametrize("pos_dtype", [torch.int32, torch.int64])
def test_checkpoint_ranges_source_on_the_host(ranges_on_host, pos_dtype):
    """`CheckpointRanges` lowered by TileLang and its generated source run on the host (32 host threads
    as the warp's lanes, the ballots emulated) gives every chunk slot's (lo, end, hi) of the host loop,
    on random packs with empty, 1-token and chunk-edge lengths, M from 0 to several hundred (several
    search rounds), a position repeated up to 69 times and every token of two chunks (several ballot
    rounds per chunk), int32 and int64 positions (the latter read through their low words); and on
    fixed-length batches (global offsets b * T), one with M > 1024 (three search rounds)."""
    g = torch.Generator().manual_seed(7 if pos_dtype == torch.int32 else 8)
    for _ in range(40):
        cu, pos = _random_case(g)
        out = _run_ranges(ranges_on_host[True], cu, pos, pos_dtype, len(cu) - 1, 0, cu[-1] // 64 + len(cu) + 1)
        want = _ranges_by_loop(pos, cu)
        assert {s: tuple(out[s].tolist()) for s in want} == want, (cu, pos[:80])
    for B, Tn, extra in ((3, 150, 0), (4, 64, 0), (2, 300, 1500)):
        cu = [b * Tn for b in range(B + 1)]
        pos = sorted(torch.randint(1, B * Tn + 1, (int(torch.randint(0, 200, (1,), generator=g)),), generator=g).tolist()
                     + [Tn + 1] * extra)
        out = _run_ranges(ranges_on_host[False], [0], pos, pos_dtype, B, Tn, B * -(-Tn // 64))
        # fixed length: sequence b's chunk c sits in slot b * ceil(Tn / 64) + c
        want = {b * -(-Tn // 64) + c: r for (s, r), (b, c) in zip(sorted(_ranges_by_loop(pos, cu).items()),
                                                                  [(b, c) for b in range(B) for c in range(-(-Tn // 64))])}
        assert {s: tuple(out[s].tolist()) for s in want} == want, (B, Tn, pos[:80])


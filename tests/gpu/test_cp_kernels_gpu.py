"""GPU tier: the split path's one-launch kernels, as regression tests:

- the segment tables (`flashqla.ops.gdn.kernels.sm90.cp_tables`, `flashqla.cp.segments.segment_tables_device`)
  equal the torch tables (`build_segment_tables`) field by field, on edge cases and random packed
  mixes, with poisoned outputs, and across CUDA-graph replays with cu_seqlens edited in place;
- the combine scans (`kernels/sm90/cp_scan.py`) against the fp64 scans and the torch fp32 scans of
  `flashqla.cp.merge` (on CPU copies), every variant and CTA shape bit for bit, the cut's limits bit
  for bit; the output correction and segment-gradient kernels (`kernels/sm90/cp_correct.py`) against
  fp64;
- the open-sequence forward and backward (what `flashqla.distributed` runs per rank) on the kernels
  against fp64 and against the same calls on the torch paths (scans, token kernels, run states and
  transition limits in torch);
- the dual run + transition launch against the two launches (a backend without `recurrent_dual`),
  and the gate-driven transition cut, forward and backward;
- the slot relayouts and the runs' initial states against their torch expressions;
- the backward's longest-first launch order (`kernels/sm90/launch_order.py`) against the stable torch
  argsort, also across CUDA-graph replays with the offsets edited in place.
"""

from __future__ import annotations

import contextlib

import pytest
import torch

pytestmark = pytest.mark.gpu

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not HOPPER:
    pytest.skip("needs a CUDA GPU of compute capability 9.0 (Hopper)", allow_module_level=True)


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _bitwise(got, base) -> bool:
    """Whether two `cp_scan` results (tuples with None for an output not made) are bit for bit equal."""
    return all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, base))


def _to(tables, device):
    """`SegmentTables` with every tensor field moved to `device`."""
    return type(tables)(**{k: (v.to(device) if isinstance(v, torch.Tensor) else v) for k, v in tables.__dict__.items()})


@contextlib.contextmanager
def _torch_paths():
    """The split path's torch code on the device (what the one-launch scans, token kernels, run states
    and transition limits replace): the sm_90 test of `flashqla.cp.merge` and `flashqla.cp.forward`
    answers False (the recurrent and backward launches still run on the kernels)."""
    import flashqla.cp.forward as fwd
    import flashqla.cp.merge as merge

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(fwd, "on_sm90", lambda t: False)
        mp.setattr(merge, "on_sm90", lambda t: False)
        yield


# ----------------------------------------------------------------------------------------------
# segment tables: the one-launch kernel against the torch tables
# ----------------------------------------------------------------------------------------------

TABLE_FIELDS = ("cu_seqlens", "seq", "index", "start", "end", "valid", "first", "last", "prev", "h0_index",
                "need_transition", "need_correction", "seq_first", "seq_num", "seq_last")
TABLE_LS = (64, 128, 1024, 2048, 4096)
TABLE_T_MAX = 2**20


def _table_mismatches(got, ref) -> list:
    """The fields (and sizes) that differ, described; empty when the tables are equal."""
    bad = [k for k in ("segment_len", "N", "M") if getattr(got, k) != getattr(ref, k)]
    for f in TABLE_FIELDS:
        a, b = getattr(got, f), getattr(ref, f)
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device:
            bad.append(f"{f}: {a.dtype} {tuple(a.shape)} {a.device} vs {b.dtype} {tuple(b.shape)} {b.device}")
        elif not torch.equal(a, b):
            idx = (a != b).nonzero().flatten()[:8].tolist()
            bad.append(f"{f}: first differing indices {idx}: kernel {a[idx].tolist()} torch {b[idx].tolist()}")
    return bad


def _offsets(lengths, dtype, device, lead=0):
    cu = torch.tensor([lead] + list(lengths), dtype=torch.int64).cumsum(0)
    return cu.to(dtype=dtype, device=device)


def _random_lengths(gen, L, n_max=300):
    """A random packed mix: empty, 1-token, shorter than L, multiples of 64 and of L, off by one, and
    several segments long; scaled down to at most TABLE_T_MAX tokens."""
    N = int(torch.randint(1, n_max + 1, (1,), generator=gen)) if torch.rand(1, generator=gen) < 0.6 else \
        int(torch.randint(1, 9, (1,), generator=gen))
    lens = []
    for _ in range(N):
        k = int(torch.randint(1, 9, (1,), generator=gen))
        lens.append([0, 1, int(torch.randint(2, 64, (1,), generator=gen)), 64 * k, 64 * k - 1, 64 * k + 1, L, L - 1,
                     L + 1, int(torch.randint(1, 8 * L, (1,), generator=gen)),
                     int(torch.randint(1, 70000, (1,), generator=gen))][int(torch.randint(0, 11, (1,), generator=gen))])
    total = sum(lens)
    if total > TABLE_T_MAX - 8 * L:
        f = (TABLE_T_MAX - 8 * L) / total
        lens = [int(x * f) for x in lens]
    return lens


def _table_edge_cases(dev):
    """(name, cu, L, T) outside the random mixes: empty and 1-token sequences, one sequence, N == 0,
    lengths off a multiple of 64 by one, offsets past 2^31 in int64, int32 offsets up to 2^31 - 1, a
    view into a larger buffer, a strided view, a leading offset."""
    out = []
    for dt in (torch.int32, torch.int64):
        d = str(dt).split(".")[-1]
        for lens, L, tail in (([0], 64, 0), ([0], 64, 500), ([1], 64, 0), ([64], 64, 0), ([65], 64, 63),
                              ([0, 0, 0], 128, 0), ([0, 1, 63, 64, 65, 0, 130, 5, 0], 64, 0),
                              ([0, 1, 63, 64, 65, 0, 130, 5, 0], 128, 77), ([4097, 1, 4095], 1024, 1),
                              ([32768], 2048, 0), ([8192, 0, 8191, 8193], 4096, 5000), ([1] * 300, 64, 0),
                              ([0] * 299 + [70000], 2048, 3), ([TABLE_T_MAX], 64, 0), ([TABLE_T_MAX - 1], 4096, 1)):
            cu = _offsets(lens, dt, dev)
            out.append((f"{d} {lens[:6]}{'...' if len(lens) > 6 else ''} N={len(lens)} L={L} tail={tail}", cu, L,
                        int(cu[-1]) + tail))
        out.append((f"{d} N=0 T=300", torch.zeros(1, dtype=dt, device=dev), 64, 300))
        out.append((f"{d} N=0 T=0", torch.zeros(1, dtype=dt, device=dev), 64, 0))
        out.append((f"{d} N=1 T=0", torch.zeros(2, dtype=dt, device=dev), 64, 0))
        buf = _offsets([7, 70, 0, 300, 64, 1], dt, dev)
        out.append((f"{d} view at offset 2", buf[2:], 64, 1000))
        out.append((f"{d} strided view", _offsets([3, 70, 4, 200, 9], dt, dev)[::2], 128, 1000))
        out.append((f"{d} leading offset (cu[0] > 0)", _offsets([70, 0, 200], dt, dev, lead=130), 64, 500))
    big = _offsets([2**30, 2**30 + 12345, 0, 1, 3 * 2**20 + 7], torch.int64, dev)
    out.append(("int64 offsets past 2^31, L = 2^20", big, 2**20, int(big[-1]) + 999))
    near = _offsets([2**31 - 2 - 4096 * 3, 1, 4096 * 3], torch.int32, dev)
    out.append(("int32 offsets up to 2^31 - 1, L = 4096", near, 4096, 2**31 - 1))
    return out


def _poisoned_tables(cu, L: int, N: int, M: int):
    """The segment-tables kernel launched once into output buffers filled with a poison first (every
    exposed element must be written), as `SegmentTables` (what `cp_tables.segment_tables` and
    `segment_tables_device` make of its outputs)."""
    from flashqla.cp.segments import SegmentTables
    from flashqla.ops.gdn.kernels.sm90 import cp_tables
    from flashqla.ops.gdn.kernels.sm90._common import tl_dtype

    MS, NS = -(-M // cp_tables.ROW_ALIGN) * cp_tables.ROW_ALIGN, -(-N // cp_tables.ROW_ALIGN) * cp_tables.ROW_ALIGN
    pseudo = torch.full((M + 1,), -0x5A5A5A5, dtype=cu.dtype, device=cu.device)
    slot_tab = torch.full((6, MS), -0x77777777, dtype=torch.int64, device=cu.device)
    flag_tab = torch.full((5, MS), 0xA5, dtype=torch.uint8, device=cu.device)
    seq_tab = torch.full((3, NS), -0x66666666, dtype=torch.int64, device=cu.device)
    cp_tables.build_segment_tables_kernel(tl_dtype(cu.dtype))(cu.contiguous(), L, pseudo, slot_tab, flag_tab, seq_tab)
    seq, index, start, end, prev, h0_index = slot_tab[:, :M].unbind(0)
    valid, first, last, need_transition, need_correction = flag_tab.view(torch.bool)[:, :M].unbind(0)
    seq_first, seq_num, seq_last = seq_tab[:, :N].unbind(0)
    return SegmentTables(cu_seqlens=pseudo, seq=seq, index=index, start=start, end=end, valid=valid, first=first,
                         last=last, prev=prev, h0_index=h0_index, need_transition=need_transition,
                         need_correction=need_correction, seq_first=seq_first, seq_num=seq_num, seq_last=seq_last,
                         segment_len=L, N=N, M=M)


def test_segment_tables_equal_torch_tables_and_survive_graph_replays():
    """`segment_tables_device` equals `build_segment_tables` field by field (dtype and values) on the
    edge cases and 200 random packed mixes (N 1-300, L 64-4096, T up to 2^20, packed tails, int32 and
    int64 offsets), each random case also launched into poisoned outputs; then each configuration's
    call captured once in a CUDA graph and replayed 5 times with cu_seqlens rewritten in place (same
    N), compared after every replay; no recompilation after the first builds."""
    from flashqla.cp.segments import build_segment_tables, segment_tables_device
    from flashqla.ops.gdn.kernels.sm90 import cp_tables
    from flashqla.ops.gdn.kernels.sm90._common import compile_count

    dev = torch.device("cuda")
    assert cp_tables.kernel_supported(torch.zeros(2, dtype=torch.int32, device=dev)), "the kernel path is not taken"
    for dt in ("int32", "int64"):
        cp_tables.build_segment_tables_kernel(dt)
    compiles = compile_count()
    failed, total = [], 0

    def check(name, got, ref):
        nonlocal total
        total += 1
        bad = _table_mismatches(got, ref)
        if bad:
            failed.append(f"{name}: " + "; ".join(bad))

    # 1. values: the edge cases, then random packed mixes (alternating int32 / int64)
    gen = torch.Generator().manual_seed(0)
    for name, cu, L, T in _table_edge_cases(dev):
        check(name, segment_tables_device(cu, L, T), build_segment_tables(cu, L, T=T))
    for c in range(200):
        dt = (torch.int32, torch.int64)[c % 2]
        L = TABLE_LS[(c // 2) % len(TABLE_LS)]
        lens = _random_lengths(gen, L)
        cu = _offsets(lens, dt, dev)
        tail = [0, 0, 1, 63, 64, L, 3 * L + 5][int(torch.randint(0, 7, (1,), generator=gen))]
        T = int(cu[-1]) + tail
        name = f"random {c}: {str(dt)[6:]} N={len(lens)} L={L} T={T}"
        ref = build_segment_tables(cu, L, T=T)
        check(name, segment_tables_device(cu, L, T), ref)
        check(name + " (poisoned outputs)", _poisoned_tables(cu, L, len(lens), ref.M), ref)

    # 2. CUDA graphs: the call captured once, cu_seqlens rewritten in place between replays
    gen = torch.Generator().manual_seed(1)
    for dt, N, L, T in ((torch.int32, 1, 2048, 32768), (torch.int32, 8, 128, 65536), (torch.int64, 300, 64, TABLE_T_MAX),
                        (torch.int64, 2, 4096, 40000), (torch.int32, 257, 1024, 300000)):
        cu = torch.zeros(N + 1, dtype=dt, device=dev)

        def fill():
            # N random lengths summing to at most T (cuts of [0, T]), some empty
            cuts = torch.randint(0, T + 1, (N,), generator=gen).sort().values
            if torch.rand(1, generator=gen) < 0.5:
                cuts[: N // 3] = cuts[0]
            cu.copy_(torch.cat([torch.zeros(1, dtype=torch.int64), cuts]).to(dtype=dt, device=dev))

        fill()
        segment_tables_device(cu, L, T)
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            segment_tables_device(cu, L, T)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tabs = segment_tables_device(cu, L, T)
        for r in range(5):
            fill()
            graph.replay()
            torch.cuda.synchronize()
            check(f"graph {str(dt)[6:]} N={N} L={L} T={T} replay {r}", tabs, build_segment_tables(cu, L, T=T))
    assert total > 0 and not failed, failed[:10]
    assert compile_count() == compiles, f"{compile_count() - compiles} recompilation(s) for new sizes or values"


# ----------------------------------------------------------------------------------------------
# the combine scans and the token kernels
# ----------------------------------------------------------------------------------------------

#: name: (HV, lengths or None for 300 random ones, T, L)
SCAN_CASES = {
    "1 seq 32768 L2048 HV8": (8, [32768], 32768, 2048),
    "1 seq 32768 L4096 HV32": (32, [32768], 32768, 4096),
    "28672+4096 L2048 HV8": (8, [28672, 4096], 32768, 2048),
    "ragged L512 HV4": (4, [500, 0, 1, 3000, 64, 4097, 0], 7662, 512),
    "300 short L256 HV2": (2, None, 30000, 256),
    "one seq ends before T L1024 HV8": (8, [5000], 9000, 1024),
}


def _scan_tables(lengths, T, L, dev, gen):
    from flashqla.cp.segments import build_segment_tables

    if lengths is None:
        cuts = torch.randint(1, T, (299,), generator=gen).sort().values
        cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([T])])
    else:
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    return build_segment_tables(cu.to(torch.int32).to(dev), L, T=T)


def _scans(P, Q, tab, T, h0, first_from_h0, D):
    """Both combine scans of `flashqla.cp.merge` (the kernel for fp32 on the GPU; torch for fp64, or on
    CPU tensors): (entering states, final states, the reverse scan's G with Q as E)."""
    from flashqla.cp.merge import scan_segment_grads, scan_segment_states

    S, fin = scan_segment_states(P, Q, tab, T, h0, first_from_h0=first_from_h0)
    G = scan_segment_grads(P, Q, tab, T, D)
    return S, fin, G


def test_scans_against_fp64():
    """The scan kernel (fp32) and the torch scan (fp32, on CPU copies) against the fp64 torch scan on
    every case of SCAN_CASES, forward (with and without h0, first segments from h0 or not) and reverse
    (with and without dht): relative Frobenius error per output at most 1e-5 and at most 4x the torch
    fp32 error (+1e-7), finite; slots of no sequence exactly zero."""
    gen = torch.Generator().manual_seed(0)
    f32 = lambda x, dev: None if x is None else x.to(dev, torch.float32)  # noqa: E731
    bad = []
    for name, (HV, lengths, T, L) in SCAN_CASES.items():
        for h0_on, ffh in ((False, False), (True, True), (True, False)):
            tab = _scan_tables(lengths, T, L, "cuda", gen)
            tab_cpu = _to(tab, "cpu")
            M, N, K = tab.M, tab.N, 128
            P = (torch.randn(M, HV, K, K, generator=gen, dtype=torch.float64) * (0.9 / K**0.5)).cuda()
            Q = torch.randn(M, HV, K, K, generator=gen, dtype=torch.float64).cuda()
            h0 = torch.randn(N, HV, K, K, generator=gen, dtype=torch.float64).cuda() if h0_on else None
            D = torch.randn(N, HV, K, K, generator=gen, dtype=torch.float64).cuda() if h0_on else None
            ref = _scans(P, Q, tab, T, h0, ffh, D)  # fp64: the torch scan
            tor = _scans(f32(P, "cpu"), f32(Q, "cpu"), tab_cpu, T, f32(h0, "cpu"), ffh, f32(D, "cpu"))
            ker = _scans(f32(P, "cuda"), f32(Q, "cuda"), tab, T, f32(h0, "cuda"), ffh, f32(D, "cuda"))
            for nm, r, t, k in zip(("starts", "final", "G"), ref, tor, ker):
                ek, et = _rel(k, r), _rel(t.cuda(), r)
                print(f"{name} h0={int(h0_on)} ffh={int(ffh)} {nm}: kernel {ek:.1e} (torch fp32 {et:.1e})")
                if not (ek <= 1e-5 and ek <= 4 * et + 1e-7) or not bool(torch.isfinite(k).all()):
                    bad.append((name, h0_on, ffh, nm, ek, et))
            inert = ~tab.valid
            if bool(inert.any()):
                if ker[0][inert].abs().max().item():
                    bad.append((name, h0_on, ffh, "inert slots not zero"))
                if ker[2][inert].abs().max().item():
                    bad.append((name, h0_on, ffh, "inert G not zero"))
    assert not bad, bad


def test_correction_and_segment_gradients_against_fp64():
    """`cp_correct` / `cp_state_grads` against fp64 on the tables of SCAN_CASES (random U, S, o, do in
    bf16): o within 8e-3 (one bf16 rounding), E within 1e-3, rows of no corrected slot untouched, E
    zero on unflagged slots."""
    from flashqla.ops.gdn.kernels.sm90.cp_correct import cp_correct, cp_state_grads

    dev = "cuda"
    gen = torch.Generator().manual_seed(2)
    bad = []
    for name, (HV, lengths, T, L) in SCAN_CASES.items():
        tab = _scan_tables(lengths, T, L, dev, gen)
        M, K = tab.M, 128
        U = torch.randn(1, T, HV, K, generator=gen).to(dev, torch.bfloat16)
        o = torch.randn(1, T, HV, K, generator=gen).to(dev, torch.bfloat16)
        do = torch.randn(1, T, HV, K, generator=gen).to(dev, torch.bfloat16)
        S = (torch.randn(M, HV, K, K, generator=gen) / K**0.5).to(dev)
        flag = tab.need_correction
        # fp64 reference (on the device), slot by slot over rows [start, end)
        st, en, fl = tab.start.tolist(), tab.end.tolist(), flag.tolist()
        want_o = o[0].double().clone()
        want_E = torch.zeros(M, HV, K, K, dtype=torch.float64, device=dev)
        sel = torch.zeros(T, dtype=torch.bool, device=dev)
        for j in range(M):
            if fl[j] and en[j] > st[j]:
                r = slice(st[j], en[j])
                Ur = U[0, r].double()
                want_o[r] += torch.einsum("thk,hkv->thv", Ur, S[j].double())
                want_E[j] = torch.einsum("thk,thv->hkv", Ur, do[0, r].double())
                sel[r] = True
        got_o = cp_correct(o.clone(), U, S, tab.cu_seqlens, flag)
        got_E = cp_state_grads(U, do, tab.cu_seqlens, flag)
        eo, eE = _rel(got_o[0], want_o), _rel(got_E, want_E)
        untouched = bool(torch.equal(got_o[0][~sel], o[0][~sel]))
        zeros = bool((got_E[~flag] == 0).all())
        print(f"{name}: o {eo:.1e}, rows outside untouched {untouched}; E {eE:.1e}, unflagged zero {zeros}")
        if not (eo < 8e-3 and eE < 1e-3 and untouched and zeros and bool(torch.isfinite(got_o).all())):
            bad.append((name, eo, eE, untouched, zeros))
    assert not bad, bad


def test_scan_variants_bitwise_equal():
    """Every scan variant (`cp_scan.VARIANTS`) gives the default's bits, forward (h0, first segments
    from it or not) and reverse, on the packed mixes of SCAN_CASES."""
    from flashqla.ops.gdn.kernels.sm90.cp_scan import DEFAULT_VARIANT, VARIANTS, cp_scan

    gen = torch.Generator().manual_seed(3)
    bad = []
    for name, (HV, lengths, T, L) in SCAN_CASES.items():
        tab = _scan_tables(lengths, T, L, "cuda", gen)
        M, N, K = tab.M, tab.N, 128
        P = (torch.randn(M, HV, K, K, generator=gen) * (0.9 / K**0.5)).cuda()
        Q = torch.randn(M, HV, K, K, generator=gen).cuda()
        h0 = torch.randn(N, HV, K, K, generator=gen).cuda()
        for label, kw in (("fwd h0 skip", dict(init=h0, skip_first=True)), ("fwd", dict()),
                          ("rev dht", dict(init=h0, reverse=True))):
            base = cp_scan(P, Q, tab.seq_first, tab.seq_num, variant=DEFAULT_VARIANT, **kw)
            for v in VARIANTS:
                if not _bitwise(cp_scan(P, Q, tab.seq_first, tab.seq_num, variant=v, **kw), base):
                    bad.append((name, label, v))
    assert not bad, bad


def test_scan_with_cut_limits_bitwise_equal():
    """The scan told which transitions the gate-driven cut dropped (`cp_scan(limit=...)`: it skips
    their products) gives the bits of the scan reading those zero P, in every variant, forward (h0
    with and without first segments from it, none) and reverse (dht, none), with limits that cut some
    slots, none and every one."""
    from flashqla.ops.gdn.kernels.sm90.cp_scan import VARIANTS, cp_scan

    gen = torch.Generator().manual_seed(4)
    bad = []
    for name, (HV, lengths, T, L) in SCAN_CASES.items():
        tab = _scan_tables(lengths, T, L, "cuda", gen)
        M, N, K = tab.M, tab.N, 128
        nchunks = ((tab.end - tab.start + 63) // 64).cpu()
        for cut in ("some", "none", "all"):
            if cut == "some":  # a random number of walked chunks, 0 .. all, per (slot, head)
                lim = (torch.rand(M, HV, generator=gen) * (nchunks[:, None] + 1).double()).floor().to(torch.int32)
            elif cut == "none":
                lim = nchunks[:, None].expand(M, HV).to(torch.int32)
            else:
                lim = torch.zeros(M, HV, dtype=torch.int32)
            lim = lim.cuda().contiguous()
            live = lim.to(torch.int64) >= ((tab.end - tab.start + 63) // 64)[:, None]
            P = (torch.randn(M, HV, K, K, generator=gen) * (0.9 / K**0.5)).cuda()
            P = torch.where(live[:, :, None, None], P, P.new_zeros(()))  # what the transition launch stores
            Q = torch.randn(M, HV, K, K, generator=gen).cuda()
            h0 = torch.randn(N, HV, K, K, generator=gen).cuda()
            for label, kw in (("fwd h0 skip", dict(init=h0, skip_first=True)), ("fwd h0", dict(init=h0)),
                              ("fwd", dict()), ("rev dht", dict(init=h0, reverse=True)), ("rev", dict(reverse=True))):
                for v in VARIANTS:
                    base = cp_scan(P, Q, tab.seq_first, tab.seq_num, variant=v, **kw)
                    got = cp_scan(P, Q, tab.seq_first, tab.seq_num, variant=v, limit=lim, seg_start=tab.start,
                                  seg_end=tab.end, **kw)
                    if not _bitwise(got, base):
                        bad.append((name, cut, label, v))
    assert not bad, bad


#: (variant, value columns a CTA) of the scans `test_scan_shapes_bitwise_equal` compares (None: the
#: default width)
SCAN_SHAPES = (("prefetch", None), ("ahead", None), ("ahead", 8), ("ahead", 4))
#: name: (HV, T, L): one sequence split as the backward's plan splits it
LIVE_HEAD_CASES = {"4/8 1x8192 L512": (8, 8192, 512), "4/8 1x32768 L2048": (8, 32768, 2048),
                   "8/16 1x8192 L1024": (16, 8192, 1024), "16/32 1x8192 L2048": (32, 8192, 2048)}


def _live_head_case(HV: int, T: int, L: int, gen, dev: str = "cuda"):
    """A scan as the gate-driven cut leaves it on one sequence of T tokens in segments of L: value head
    0 (g == 0) walks every chunk, the others are cut after one (their P stored as 0). Returns (tables,
    P, Q, h0, the cut's keyword arguments of `cp_scan`)."""
    tab = _scan_tables([T], T, L, dev, gen)
    M, N, K = tab.M, tab.N, 128
    nch = ((tab.end - tab.start + 63) // 64).to(torch.int32)
    lim = torch.zeros(M, HV, dtype=torch.int32, device=dev)
    lim[:, 0] = nch
    lim[:, 1:] = torch.clamp(nch, max=1)[:, None]
    lim = torch.where(tab.need_correction[:, None], lim, torch.zeros_like(lim)).contiguous()
    live = lim.to(torch.int64) >= ((tab.end - tab.start + 63) // 64)[:, None]
    P = (torch.randn(M, HV, K, K, generator=gen) * (0.9 / K**0.5)).to(dev)
    P = torch.where(live[:, :, None, None], P, P.new_zeros(()))
    Q = torch.randn(M, HV, K, K, generator=gen).to(dev)
    h0 = torch.randn(N, HV, K, K, generator=gen).to(dev)
    return tab, P, Q, h0, dict(limit=lim, seg_start=tab.start, seg_end=tab.end)


def test_scan_shapes_bitwise_equal():
    """The scan a cut call over one sequence launches (`cp_scan.scan_choice`: "ahead" with narrow
    value slices) against every other variant and CTA shape, only value head 0 live, 4/8 to 16/32
    heads, forward and reverse: bit for bit."""
    from flashqla.ops.gdn.kernels.sm90.cp_scan import cp_scan, scan_slice_width

    gen = torch.Generator().manual_seed(5)
    bad = []
    for name, (HV, T, L) in LIVE_HEAD_CASES.items():
        tab, P, Q, h0, cut = _live_head_case(HV, T, L, gen)
        for label, kw in (("fwd", dict(init=h0, skip_first=True)), ("rev", dict(init=h0, reverse=True))):
            base = cp_scan(P, Q, tab.seq_first, tab.seq_num, **cut, **kw)
            for var, bs in SCAN_SHAPES:
                if bs is not None and bs == scan_slice_width(HV):
                    continue
                got = cp_scan(P, Q, tab.seq_first, tab.seq_num, variant=var, slice_width=bs, **cut, **kw)
                if not _bitwise(got, base):
                    bad.append((name, label, var, bs))
    assert not bad, bad


# ----------------------------------------------------------------------------------------------
# the open-sequence forward and backward (flashqla.distributed's per-rank passes)
# ----------------------------------------------------------------------------------------------

OPEN_NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _run_open(be, d, L, open_first):
    from flashqla.cp.backward import cp_backward_open
    from flashqla.cp.forward import cp_forward_open
    from flashqla.cp.segments import build_segment_tables

    T = d["q"].shape[1]
    tab = build_segment_tables(d["cu_seqlens"], L, T=T)
    sd = be.state_dtype
    conv = lambda x: x.to(sd) if x is not None else None  # noqa: E731
    o, final, saved = cp_forward_open(be, d["q"], d["k"], d["v"], d["g"], d["beta"], 128**-0.5, conv(d["h0"]), tab,
                                      block_v=None, exchange=lambda P, E: conv(d["S_in"]) if open_first else None,
                                      open_first=open_first)
    grads = cp_backward_open(be, d["q"], d["k"], d["v"], d["g"], d["beta"], d["do"], conv(d["dht"]), 128**-0.5,
                             saved, tab, block_v=None, exchange=lambda D: conv(d["X"]))
    return (o, final) + tuple(grads)


@pytest.mark.parametrize("name,seqlens,L,open_first", [
    ("one open sequence 4096", [4096], 512, True),
    ("varlen open 2500,0,100,1500", [2500, 0, 100, 1500], 512, True),
    ("varlen not open 2500,0,100,1500", [2500, 0, 100, 1500], 512, False),
], ids=["open-4096", "varlen-open", "varlen-not-open"])
def test_open_sequence_on_the_kernels(name, seqlens, L, open_first):
    """`cp_forward_open` / `cp_backward_open` on the sm_90 backend with the one-launch scans and token
    kernels: every output (o, final state, dq, dk, dv, dg, dbeta, dh0) finite, within 2e-2 of fp64
    (`reference.gdn.cp.ReferenceCPBackend`) and at most 1.25 x the torch paths' error + 1e-3."""
    from flashqla.ops.gdn.backend import Sm90Backend
    from flashqla.testing import make_gdn_inputs
    from reference.gdn.cp import ReferenceCPBackend

    T, N, HV = sum(seqlens), len(seqlens), 8
    x = make_gdn_inputs(1, T, 2, HV, 128, 128, seqlens=seqlens, dtype=torch.bfloat16, device="cuda",
                        gate="qwen3next", special_heads=True, initial_state=True, seed=3)
    gen = torch.Generator().manual_seed(4)
    extra = dict(do=torch.randn(1, T, HV, 128, generator=gen), dht=torch.randn(N, HV, 128, 128, generator=gen),
                 S_in=torch.randn(HV, 128, 128, generator=gen), X=torch.randn(HV, 128, 128, generator=gen))
    d = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], cu_seqlens=x["cu_seqlens"],
             h0=x["initial_state"], do=extra["do"].to("cuda", torch.bfloat16),
             dht=extra["dht"].cuda(), S_in=extra["S_in"].cuda(), X=extra["X"].cuda())
    d64 = {n: (t.double().cpu() if t.is_floating_point() else t.cpu()) for n, t in d.items()}  # reference: CPU
    ref = _run_open(ReferenceCPBackend(), d64, L, open_first)
    ker = _run_open(Sm90Backend(), d, L, open_first)
    with _torch_paths():
        tor = _run_open(Sm90Backend(), d, L, open_first)
    bad = []
    for n, k_, t_, r_ in zip(OPEN_NAMES, ker, tor, ref):
        if r_ is None:
            continue
        ek, et = _rel(k_.cpu(), r_), _rel(t_.cpu(), r_)
        print(f"{name} {n}: kernels {ek:.1e}, torch paths {et:.1e}")
        if not (bool(torch.isfinite(k_.float()).all()) and ek <= 2e-2 and ek <= 1.25 * et + 1e-3):
            bad.append((n, ek, et))
    assert not bad, bad


# ----------------------------------------------------------------------------------------------
# the dual run + transition launch and the gate-driven transition cut
# ----------------------------------------------------------------------------------------------

DUAL_CASES = [  # (name, H, HV, lengths, segment_len or None (plan), block_v or None, offsets dtype)
    ("2/8 1x32768", 2, 8, [32768], None, None, torch.int32),
    ("2/8 28672+4096 L1024 BV64", 2, 8, [28672, 4096], 1024, 64, torch.int32),
    ("4/16 varlen short+empty L512", 4, 16, [5000, 0, 63, 3000, 1, 2100], 512, None, torch.int64),
    ("16/32 1x16384 L2048", 16, 32, [16384], 2048, None, torch.int32),
    ("2/8 28672+4096 L2048 BV128", 2, 8, [28672, 4096], 2048, 128, torch.int32),
]


def _two_launch_backend():
    """The sm_90 backend without the dual launch: the split path's run and transition as two
    launches."""
    from flashqla.ops.gdn.backend import Sm90Backend

    class TwoLaunches(Sm90Backend):
        recurrent_dual = None

    return TwoLaunches()


def _dual_inputs(H, HV, lengths, dtype=torch.int32, seed=0):
    from flashqla.testing import make_gdn_inputs

    x = make_gdn_inputs(1, sum(lengths), H, HV, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda",
                        gate="qwen3next", special_heads=True, initial_state=True, seed=seed)
    x["cu_seqlens"] = x["cu_seqlens"].to(dtype)
    return x


def _dual_fwd(x, **kw):
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    return chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True,
                                      x["cu_seqlens"], for_backward=False, return_info=True, **kw)


def _limits_compare(x, tables):
    """The limits kernel against the torch version on this case's g_cum_log2 (fp32 sums in another
    order may put the crossing one chunk apart exactly at the cutoff: allowed on <= 0.1% of entries)."""
    from flashqla.contract import TRUNCATE_LOG_DECAY
    from flashqla.cp.forward import _transition_limits_torch, flat, transition_limits
    from flashqla.ops.gdn.kernels.sm90.prepare import chunk_prepare_fwd

    HV = x["v"].shape[2]
    _, G2 = chunk_prepare_fwd(flat(x["k"]), flat(x["g"]), flat(x["beta"]), tables.cu_seqlens, HV)
    out = dict(ok=True)
    for name, cut in (("exact", None), ("cut24", TRUNCATE_LOG_DECAY), ("cut10", -10.0)):
        a = transition_limits(G2, tables, cut).long()
        b = _transition_limits_torch(G2, tables, cut).long()
        diff = (a - b).abs()
        out[name] = int((diff > 0).sum())
        out["ok"] &= bool(diff.max() <= 1) and int((diff > 0).sum()) <= max(1, a.numel() // 1000)
    return out


def _fp64_forward(x):
    """(o, final state) of `reference.chunk_gated_delta_rule` on x's inputs in fp64."""
    import reference

    d = {n: x[n].double() for n in ("q", "k", "v", "g", "beta", "initial_state")}
    return reference.chunk_gated_delta_rule(**d, output_final_state=True, cu_seqlens=x["cu_seqlens"])


def _fp64_grads(x, do, dht) -> dict:
    """{dq, dk, dv, dg, dbeta, dh0} of <o, do> + <final state, dht> through `reference.chunk_gated_delta_rule`
    in fp64 (autograd)."""
    import reference

    names = ("q", "k", "v", "g", "beta", "initial_state")
    d = {n: x[n].double().requires_grad_(True) for n in names}
    o, ht = reference.chunk_gated_delta_rule(**d, output_final_state=True, cu_seqlens=x["cu_seqlens"])
    grads = torch.autograd.grad((o * do.double()).sum() + (ht * dht.double()).sum(), [d[n] for n in names])
    return dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads))


@pytest.mark.parametrize("case", DUAL_CASES, ids=[c[0] for c in DUAL_CASES])
def test_dual_launch_and_transition_cut(case):
    """The run + transition launch is bitwise the two launches (o, the final state, and from `CPInfo`
    P, Q and the entering states; exact transitions); the default cut (ln 2^-24) moves o by < 1e-4 and
    the final state by < 1e-5 relative, never further from fp64 than exact mode (+1e-5), and nothing
    on the g == 0 head (also at the cut -10); the limits kernel agrees with its torch version."""
    name, H, HV, lengths, L, BV, cdt = case
    x = _dual_inputs(H, HV, lengths, cdt)
    kw = dict(cp="on", segment_len=L, block_v=BV)
    two, i2 = _dual_fwd(x, truncate=False, backend=_two_launch_backend(), **kw)
    one, i1 = _dual_fwd(x, truncate=False, **kw)
    bit = {n: bool(torch.equal(a, b)) for n, a, b in (("o", two.o, one.o), ("final", two.final_state, one.final_state),
                                                      ("P", i2.P, i1.P), ("Q", i2.Q, i1.Q), ("S_in", i2.S_in, i1.S_in))}
    ref_o, ref_ht = _fp64_forward(x)
    row = dict(case=name, bitwise=bit, finite=bool(torch.isfinite(one.o).all() and torch.isfinite(one.final_state).all()),
               exact_o=_rel(one.o, ref_o), exact_ht=_rel(one.final_state, ref_ht))
    for tag, cut in (("cut24", True), ("cut10", -10.0)):
        tr, it = _dual_fwd(x, truncate=cut, **kw)
        lim = it.transition_chunks
        nch = -(-(it.tables.end - it.tables.start) // 64)
        corr = it.tables.need_correction
        walked = float(lim[corr].sum()) / max(float((nch[corr, None].expand(-1, HV)).sum()), 1.0)
        row[tag] = dict(o_vs_exact=_rel(tr.o, one.o), ht_vs_exact=_rel(tr.final_state, one.final_state),
                        o=_rel(tr.o, ref_o), ht=_rel(tr.final_state, ref_ht), walked=walked,
                        head0_bitwise=bool(torch.equal(tr.o[..., 0, :], one.o[..., 0, :])),
                        finite=bool(torch.isfinite(tr.o).all() and torch.isfinite(tr.final_state).all()))
    row["limits"] = _limits_compare(x, it.tables)
    print(row)
    c = row["cut24"]
    assert (row["limits"]["ok"] and all(bit.values()) and row["finite"] and c["finite"] and c["head0_bitwise"]
            and row["cut10"]["head0_bitwise"] and c["o_vs_exact"] < 1e-4 and c["ht_vs_exact"] < 1e-5
            and c["o"] <= row["exact_o"] + 1e-5 and c["ht"] <= row["exact_ht"] + 1e-5), row


def test_backward_with_the_transition_cut():
    """The split backward with the cut (ln 2^-24, and -10) against exact transitions (within 1e-4
    relative at ln 2^-24) and fp64 (never further than exact + 1e-5): dq, dk, dv, dg, dbeta, dh0;
    2/8 heads, 1 x 8192, L = 1024."""
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    H, HV, lengths, L = 2, 8, [8192], 1024
    x = _dual_inputs(H, HV, lengths)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").to(torch.bfloat16)
    dht = torch.randn(x["initial_state"].shape, generator=gen, device="cuda")
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    f = chunk_gated_delta_rule_fwd(*args, None, x["initial_state"], True, x["cu_seqlens"], cp="off")
    out = {}
    for tag, cut in (("exact", False), ("cut24", True), ("cut10", -10.0)):
        out[tag] = chunk_gated_delta_rule_bwd(f.q, f.k, x["v"], x["g"], x["beta"], f.A, f.g_cum_log2, do, dht, None,
                                              x["initial_state"], x["cu_seqlens"], cp="on", segment_len=L, truncate=cut)
    ref = _fp64_grads(x, do, dht)
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    row = dict(case=f"{H}/{HV} 1x8192 L{L}")
    for tag in out:
        row[tag] = {n: _rel(out[tag][i], ref[n]) for i, n in enumerate(names)}
        if tag != "exact":
            row[tag + "_vs_exact"] = {n: _rel(out[tag][i], out["exact"][i]) for i, n in enumerate(names)}
    print(row)
    assert all(row["cut24_vs_exact"][n] < 1e-4 for n in names) and all(
        row["cut24"][n] <= row["exact"][n] + 1e-5 for n in names), row


# (lengths or None for B rows, B, T, L, HV): empty and 1-token sequences, lengths at and off chunk
# multiples, a segment length of one chunk, B rows with a partial last chunk
RELAYOUT_CASES = [
    ([161, 1928, 3157, 563, 1244, 229, 177, 733], 1, 8192, 512, 4),
    ([0, 1, 63, 64, 65, 0, 130, 5, 0], 1, 328, 64, 2),
    ([700, 0, 64, 1], 1, 765, 128, 3),
    (None, 2, 1000, 512, 2),
    (None, 3, 64, 64, 1),
]


@pytest.mark.parametrize("case", RELAYOUT_CASES, ids=[f"case{i}" for i in range(len(RELAYOUT_CASES))])
def test_relayout_kernel_equals_the_torch_gathers(case):
    """`kernels/sm90/cp_relayout.py` (A and g_cum_log2 between the caller's chunk slots and the
    segments', one launch) against the torch gathers it replaces (`sequence_slots_to_segment_slots`,
    `segment_slots_to_sequence_slots` on CPU tensors), bit for bit, both directions, with outputs of
    random values everywhere (every slot written, zeros where no chunk is), and inside a CUDA graph."""
    from flashqla.cp.segments import build_segment_tables, segment_slots_to_sequence_slots, sequence_slots_to_segment_slots

    lengths, B, T, L, HV = case
    gen = torch.Generator().manual_seed(len(RELAYOUT_CASES) + T)
    if lengths is None:
        cu = None
        S = B * -(-T // 64)
        tab = build_segment_tables(None, L, T=T, B=B)
        tab = type(tab)(**{**tab.__dict__, "cu_seqlens": tab.cu_seqlens.to(torch.int32)})
    else:
        assert sum(lengths) == T
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        S = T // 64 + len(lengths)
        tab = build_segment_tables(cu, L, T=T)
    Sp = B * T // 64 + tab.M
    A = torch.randn(HV, S * 64, 64, generator=gen).to(torch.bfloat16)
    G = torch.randn(HV, S * 64, generator=gen)
    Ap, Gp = sequence_slots_to_segment_slots(A, G, tab, cu, B, T)  # torch path (CPU)
    A2, G2 = segment_slots_to_sequence_slots(Ap, Gp, tab, cu, B, T)
    assert Ap.shape == (HV, Sp * 64, 64) and A2.shape == A.shape

    def dev_tables(t):
        return type(t)(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in t.__dict__.items()})

    tab_d, cu_d = dev_tables(tab), (None if cu is None else cu.cuda())
    Ap_d, Gp_d = sequence_slots_to_segment_slots(A.cuda(), G.cuda(), tab_d, cu_d, B, T)  # the kernel
    assert torch.equal(Ap_d.cpu(), Ap) and torch.equal(Gp_d.cpu(), Gp)
    A2_d, G2_d = segment_slots_to_sequence_slots(Ap.cuda(), Gp.cuda(), tab_d, cu_d, B, T)
    assert torch.equal(A2_d.cpu(), A2) and torch.equal(G2_d.cpu(), G2)
    # the round trip keeps every used slot and zeroes the rest
    assert torch.count_nonzero(A2) > 0 and torch.count_nonzero(Ap) > 0
    # in a CUDA graph, on fresh inputs copied in before each replay
    A_in, G_in = A.cuda(), G.cuda()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sequence_slots_to_segment_slots(A_in, G_in, tab_d, cu_d, B, T)
    for seed in (1, 2):
        A_new = torch.randn(HV, S * 64, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        A_in.copy_(A_new.cuda())
        graph.replay()
        torch.cuda.synchronize()
        want, _ = sequence_slots_to_segment_slots(A_new, G, tab, cu, B, T)
        assert torch.equal(out[0].cpu(), want)


@pytest.mark.parametrize("case", RELAYOUT_CASES[:3], ids=[f"case{i}" for i in range(3)])
def test_slot_initial_states_equal_the_torch_expression(case):
    """`cp_relayout.slot_initial_states` (the runs' initial states, one launch) against the torch
    expression it replaces (h0[h0_index] on first segments, zero elsewhere), bit for bit, on tables
    with empty and 1-token sequences; the output buffer is poisoned first, so every slot is written."""
    from flashqla.cp.forward import _run_states
    from flashqla.cp.segments import build_segment_tables
    from flashqla.ops.gdn.kernels.sm90.cp_relayout import slot_initial_states

    lengths, _, T, L, HV = case
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    tab = build_segment_tables(cu, L, T=T)
    h0 = torch.randn(len(lengths), HV, 128, 128, generator=torch.Generator().manual_seed(T))
    want = _run_states(h0, tab)  # CPU: the torch expression
    assert bool((want != 0).any()) and bool((want == 0).all(dim=(1, 2, 3)).any())
    poison = torch.full((tab.M * HV * 128 * 128,), float("nan"), device="cuda")
    del poison  # the allocator hands the NaN block to the kernel's output
    got = slot_initial_states(h0.cuda(), tab.h0_index.cuda())
    assert torch.equal(got.cpu(), want)


def test_correction_over_slot_ranges_equals_one_launch(monkeypatch):
    """`cp_correct` launches once per range of slots when M * HV passes the grid's y limit: with the
    limit lowered (so that a small case takes 2-7 launches) the result is bitwise the one launch's,
    with a per-(slot, head) tile limit and with a flag; and at the real limit a case of 64 value heads
    and 1100 slots (two launches) against fp64 on its corrected rows."""
    from flashqla.cp.segments import build_segment_tables
    from flashqla.ops.gdn.kernels.sm90 import cp_correct as cc

    gen = torch.Generator().manual_seed(11)
    lengths = [700, 0, 64, 1, 2000, 130, 1]
    T, L, HV, K = sum(lengths), 128, 3, 128
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    tab = build_segment_tables(cu, L, T=T)
    cu_p, M = tab.cu_seqlens.cuda(), tab.M
    U = torch.randn(1, T, HV, K, generator=gen).to("cuda", torch.bfloat16)
    o = torch.randn(1, T, HV, K, generator=gen).to("cuda", torch.bfloat16)
    S = (torch.randn(M, HV, K, K, generator=gen) / K**0.5).cuda()
    flag = tab.need_correction.cuda()
    limit = torch.randint(0, 3, (M, HV), generator=gen, dtype=torch.int32).cuda()
    one_f = cc.cp_correct(o.clone(), U, S, cu_p, flag, max_rows=L)
    one_l = cc.cp_correct(o.clone(), U, S, cu_p, limit=limit, max_rows=L)
    assert not torch.equal(one_f, o) and not torch.equal(one_l, o)
    for y in (HV, 4 * HV + 1, (M // 2) * HV):
        monkeypatch.setattr(cc, "MAX_GRID_Y", y)
        assert torch.equal(cc.cp_correct(o.clone(), U, S, cu_p, flag, max_rows=L), one_f), y
        assert torch.equal(cc.cp_correct(o.clone(), U, S, cu_p, limit=limit, max_rows=L), one_l), y
    monkeypatch.undo()

    # the real limit: 64 value heads x 1100 slots = 70,400 > 65,535 (two launches)
    HV, L = 64, 64
    T = 1100 * L
    tab = build_segment_tables(torch.tensor([0, T], dtype=torch.int32), L, T=T)
    M = tab.M
    assert M * HV > cc.MAX_GRID_Y
    U = (torch.randn(1, T, HV, K, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    o = torch.randn(1, T, HV, K, generator=gen).to("cuda", torch.bfloat16)
    S = (torch.randn(M, HV, K, K, generator=gen) / K**0.5).cuda()
    got = cc.cp_correct(o.clone(), U, S, tab.cu_seqlens.cuda(), tab.need_correction.cuda(), max_rows=L)
    st, fl = tab.start.tolist(), tab.need_correction.tolist()
    step = cc.MAX_GRID_Y // HV  # slots of the first launch
    for j in (1, step - 1, step, M - 2):  # slots on both sides of the launches' boundary
        assert fl[j]
        r = slice(st[j], st[j] + L)
        want = o[0, r].double() + torch.einsum("thk,hkv->thv", U[0, r].double(), S[j].double())
        err = ((got[0, r].double() - want).norm() / want.norm()).item()
        assert err < 8e-3, (j, err)
    assert torch.equal(got[0, :L], o[0, :L])  # the first segment is not corrected


# ----------------------------------------------------------------------------------------------
# the backward's launch order (`kernels/sm90/launch_order.py`)
# ----------------------------------------------------------------------------------------------

LAUNCH_ORDER_NS = (2, 3, 31, 32, 33, 127, 128, 129, 1000, 1024, 1025, 4096, 8192)


def _launch_order_offsets(gen, N, hi, dtype):
    lens = torch.randint(0, hi, (N,), generator=gen)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_launch_order_kernel_equals_stable_argsort(dtype, monkeypatch):
    """`launch_order.longest_first_order` (one launch) against torch.argsort(cu[1:] - cu[:-1],
    descending=True, stable=True) on random and tie-heavy offsets (a few distinct lengths: ties within
    and across the CTAs' 32-sequence blocks and the 1024-length staging steps), empty and equal
    sequences, N up to ORDER_KERNEL_MAX; the output poisoned first (every element written);
    `launch_order.launch_order(cu, longest_first=True)` takes the kernel up to ORDER_KERNEL_MAX and the
    torch sort past it; a new N builds nothing."""
    from flashqla.ops.gdn.kernels.sm90 import _common
    from flashqla.ops.gdn.kernels.sm90 import launch_order as lo

    gen = torch.Generator().manual_seed(7 if dtype == torch.int32 else 8)
    lo.longest_first_order(torch.tensor([0, 1, 3], dtype=dtype, device="cuda"))  # the one build of this dtype
    built = _common.compile_count()
    launched = []
    real_builder = lo.build_launch_order_kernel
    monkeypatch.setattr(lo, "build_launch_order_kernel", lambda dt: launched.append(dt) or real_builder(dt))
    for N in LAUNCH_ORDER_NS:
        for hi in (1, 2, 5, 64, 1 << 20):
            cu = _launch_order_offsets(gen, N, hi, dtype).cuda()
            want = torch.argsort(cu[1:] - cu[:-1], descending=True, stable=True).to(torch.int32)
            poison = torch.full((N,), -5, dtype=torch.int32, device="cuda")
            del poison  # the allocator hands the poisoned block to the kernel's output
            got = lo.longest_first_order(cu)
            assert got.dtype == torch.int32 and got.shape == (N,)
            assert torch.equal(got, want), (N, hi, (got != want).nonzero()[:5].flatten().tolist())
            n = len(launched)
            assert torch.equal(lo.launch_order(cu, longest_first=True), want) and len(launched) == n + 1, (N, hi)
    # equal lengths everywhere, and sequences past 2^31 tokens in all (int64)
    for N in LAUNCH_ORDER_NS:
        cu = (torch.arange(N + 1, dtype=torch.int64) * (3 if dtype == torch.int32 else (1 << 31) + 1)).to(dtype).cuda()
        assert torch.equal(lo.longest_first_order(cu), torch.arange(N, dtype=torch.int32, device="cuda")), N
    assert _common.compile_count() == built, "a new N recompiled"
    # past the limit: the torch sort
    cu = _launch_order_offsets(gen, lo.ORDER_KERNEL_MAX + 1, 7, dtype).cuda()
    n = len(launched)
    want = torch.argsort(cu[1:] - cu[:-1], descending=True, stable=True).to(torch.int32)
    assert torch.equal(lo.launch_order(cu, longest_first=True), want) and len(launched) == n


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_launch_order_kernel_in_a_cuda_graph(dtype):
    """Captured once, replayed with the offsets edited in place: each replay's order is the stable
    argsort of the new lengths (nothing read on the host at capture)."""
    from flashqla.ops.gdn.kernels.sm90 import launch_order as lo

    gen = torch.Generator().manual_seed(21)
    N = 1000
    cu = _launch_order_offsets(gen, N, 9, dtype).cuda()
    lo.longest_first_order(cu)  # built outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lo.longest_first_order(cu)
    for hi in (1, 3, 9, 1 << 16):
        cu.copy_(_launch_order_offsets(gen, N, hi, dtype).cuda())
        graph.replay()
        torch.cuda.synchronize()
        want = torch.argsort(cu[1:] - cu[:-1], descending=True, stable=True).to(torch.int32)
        assert torch.equal(out, want), hi

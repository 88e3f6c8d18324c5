"""Adversarial CPU checks of the context-parallel pieces (segment tables, combine scans, planner,
driver on the fp64 reference backend, the inference custom op).

Everything runs in fp64 on CPU with small head dims. The scans are compared against plain Python
loops written from the docstrings of `flashqla.cp.merge`:

    forward   S_in(first) = h0 (or 0);  S_in(j + 1) = P_j S_in(j) + Q_j
              (first_from_h0: the first segment's end state is Q_first itself)
    reverse   G(last) = dht (or 0);     G(j - 1) = P_j^T G(j) + E_j

with slots computed independently of `build_segment_tables`: segment j of sequence n sits in slot
floor(cu[n] / L) + n + j. Several tests here are regressions of defects this file found (fixed).
"""

from __future__ import annotations

import itertools
import math
import random

import pytest
import torch

import flashqla.cp.forward as cp_fwd_mod
import flashqla.cp.plan as planner
from flashqla.contract import CHUNK
from flashqla.cp import build_segment_tables, cp_backward, cp_forward, scan_segment_grads, scan_segment_states
from flashqla.cp import segments
from flashqla.cp.plan import plan_cp
from flashqla.testing import make_gdn_inputs
from reference.gdn.cp import ReferenceCPBackend
from reference.gdn.recurrent import recurrent_gated_delta_rule

F64 = torch.float64
TABLE_FIELDS = ("cu_seqlens", "seq", "index", "start", "end", "valid", "first", "last", "prev", "h0_index",
                "need_transition", "need_correction", "seq_first", "seq_num", "seq_last")


def _rel(a, b):
    a, b = a.detach().double(), b.detach().double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _offsets(lengths, dtype=torch.int64):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return torch.tensor(cu, dtype=dtype)


def _layout(cu, L):
    """(first slot, segment count) per sequence, from the offsets alone."""
    cu = [int(x) for x in cu]
    return [(cu[n] // L + n, -(-(cu[n + 1] - cu[n]) // L) if cu[n + 1] > cu[n] else 0) for n in range(len(cu) - 1)]


def _brute_states(P, Q, cu, L, h0, first_from_h0):
    starts = torch.zeros_like(Q)
    HV, K, V = Q.shape[1:]
    finals = []
    for n, (f, ns) in enumerate(_layout(cu, L)):
        S = torch.zeros(HV, K, V, dtype=Q.dtype) if h0 is None else h0[n].clone()
        for j in range(ns):
            starts[f + j] = S
            S = Q[f + j].clone() if (first_from_h0 and j == 0) else P[f + j] @ S + Q[f + j]
        finals.append(S)
    return starts, (torch.stack(finals) if finals else Q.new_zeros(0, HV, K, V))


def _brute_grads(P, E, cu, L, dht):
    G = torch.zeros_like(E)
    HV, K, V = E.shape[1:]
    for n, (f, ns) in enumerate(_layout(cu, L)):
        R = torch.zeros(HV, K, V, dtype=E.dtype) if dht is None else dht[n].clone()
        for j in range(ns - 1, -1, -1):
            if j < ns - 1:
                R = P[f + j + 1].transpose(-1, -2) @ R + E[f + j + 1]
            G[f + j] = R
    return G


def _maps(M, N, HV=2, K=4, V=3, seed=0):
    g = torch.Generator().manual_seed(seed)
    P = torch.randn(M, HV, K, K, generator=g, dtype=F64) / 3
    Q = torch.randn(M, HV, K, V, generator=g, dtype=F64)
    h0 = torch.randn(N, HV, K, V, generator=g, dtype=F64)
    return P, Q, h0


def _close(a, b, tol=1e-12):
    return a.shape == b.shape and torch.allclose(a, b, rtol=tol, atol=tol)


# =============================================================================================
# 1. segment_tables_device: argument checks and the CPU fallback
# =============================================================================================


@pytest.mark.parametrize("L", [0, -64, 32, 63, 65, 100, 96, True, False, 64.5, 0.0, -64.0, "64"],
                         ids=lambda x: repr(x))
def test_tables_bad_segment_len_names_the_argument(L):
    with pytest.raises(ValueError, match="segment_len"):
        segments.segment_tables_device(torch.tensor([0, 10, 100]), L, 100)


@pytest.mark.parametrize("L", [float("nan"), float("inf"), float("-inf")], ids=["nan", "inf", "-inf"])
def test_tables_non_finite_segment_len_names_the_argument(L):
    with pytest.raises(ValueError, match="segment_len"):
        segments.segment_tables_device(torch.tensor([0, 10, 100]), L, 100)


@pytest.mark.parametrize("L", [2**63, 2**64, 2**70], ids=["2^63", "2^64", "2^70"])
def test_tables_segment_len_beyond_int64_is_rejected(L):
    with pytest.raises(ValueError, match="segment_len"):
        segments.segment_tables_device(torch.tensor([0, 10, 100]), L, 100)


def test_tables_huge_segment_len_within_int64_counts_segments():
    L = 2**63 - 64  # a positive multiple of 64 that fits int64
    t = segments.segment_tables_device(torch.tensor([0, 10, 100]), L, 100)
    assert t.seq_num.tolist() == [1, 1] and t.valid.tolist() == [True, True]


@pytest.mark.parametrize("L", [2**31, 2**40, 2**62], ids=["2^31", "2^40", "2^62"])
def test_tables_large_segment_len_falls_back_and_is_right(L):
    """L beyond int32 takes the torch tables (documented); one segment per sequence, none lost."""
    cu = torch.tensor([0, 10, 10, 100], dtype=torch.int32)
    t = segments.segment_tables_device(cu, L, 150)
    assert t.M == 3 and t.segment_len == L
    assert t.seq_num.tolist() == [1, 0, 1] and t.seq_first.tolist() == [0, 1, 2]
    assert t.valid.tolist() == [True, False, True] and t.start.tolist() == [0, 10, 10] and t.end.tolist() == [10, 10, 100]


def test_tables_missing_or_negative_T():
    cu = torch.tensor([0, 10, 100])
    with pytest.raises(ValueError, match="T .*required"):
        segments.segment_tables_device(cu, 64)
    with pytest.raises(ValueError, match="T .*required"):
        segments.segment_tables_device(cu, 64, None)
    for T in (-1, -64, -(2**70)):
        with pytest.raises(ValueError, match="T must be >= 0"):
            segments.segment_tables_device(cu, 64, T)


def test_tables_negative_fractional_T_is_rejected():
    with pytest.raises(ValueError, match="T"):
        segments.segment_tables_device(torch.tensor([0, 0]), 64, -0.5)


@pytest.mark.parametrize("T", [float("nan"), float("inf"), 2**70], ids=["nan", "inf", "2^70"])
def test_tables_non_finite_or_huge_T_names_the_argument(T):
    with pytest.raises(ValueError, match=r"\bT\b"):
        segments.segment_tables_device(torch.tensor([0, 10, 100]), 64, T)


@pytest.mark.parametrize("cu", [None, [0, 10], torch.tensor(5), torch.zeros(0, dtype=torch.int64),
                                torch.zeros(2, 2, dtype=torch.int64), torch.zeros(1, 3, dtype=torch.int32)],
                         ids=["None", "list", "0-d", "empty", "2-D", "1x3"])
def test_tables_bad_offsets_name_the_argument(cu):
    with pytest.raises(ValueError, match="cu_seqlens"):
        segments.segment_tables_device(cu, 64, 10)


def test_tables_segment_len_checked_before_T_and_offsets():
    """Each bad argument gets its own message even when several are bad."""
    with pytest.raises(ValueError, match="segment_len"):
        segments.segment_tables_device(None, 100, None)
    with pytest.raises(ValueError, match="T .*required"):
        segments.segment_tables_device(None, 64, None)


def test_tables_integral_float_segment_len_equals_int():
    cu = _offsets([70, 0, 200, 1])
    a = segments.segment_tables_device(cu, 128.0, 300)
    b = build_segment_tables(cu, 128, T=300)
    assert isinstance(a.segment_len, int) and a.segment_len == 128
    for f in TABLE_FIELDS:
        assert torch.equal(getattr(a, f), getattr(b, f)), f


def _check_tables_against_layout(t, cu, L, T):
    """Independent recomputation of every field from the slot rule."""
    N = cu.numel() - 1
    M = T // L + N
    assert (t.N, t.M, t.segment_len) == (N, M, L)
    lay = _layout(cu, L)
    seq = [0] * M
    idx = list(range(M))
    valid = [False] * M
    for n, (f, ns) in enumerate(lay):
        for j in range(ns):
            assert not valid[f + j], "two segments in one slot"
            valid[f + j] = True
            seq[f + j], idx[f + j] = n, j
    assert t.valid.tolist() == valid
    assert t.seq_first.tolist() == [f for f, _ in lay]
    assert t.seq_num.tolist() == [ns for _, ns in lay]
    assert t.seq_last.tolist() == [f + ns - 1 if ns else -1 for f, ns in lay]
    cl = [int(x) for x in cu]
    for s in range(M):
        if valid[s]:
            n, j = seq[s], idx[s]
            a = cl[n] + j * L
            assert (int(t.start[s]), int(t.end[s])) == (a, min(a + L, cl[n + 1]))
            assert bool(t.first[s]) == (j == 0) and bool(t.last[s]) == (j == lay[n][1] - 1)
            assert int(t.prev[s]) == (s - 1 if j > 0 else -1)
            assert int(t.h0_index[s]) == (n if j == 0 else -1)
            assert bool(t.need_correction[s]) == (j > 0)
            assert bool(t.need_transition[s]) == (0 < j < lay[n][1] - 1)
        else:
            assert int(t.start[s]) == int(t.end[s])
            assert not (t.first[s] or t.last[s] or t.need_correction[s] or t.need_transition[s])
            assert int(t.prev[s]) == -1 and int(t.h0_index[s]) == -1
    # pseudo offsets: non-decreasing, ending at cu[N], in the offsets' dtype
    pc = t.cu_seqlens
    assert pc.dtype == cu.dtype and pc.numel() == M + 1 and int(pc[-1]) == cl[-1]
    assert bool((pc[1:] >= pc[:-1]).all())


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_tables_fallback_random_mixes_with_tails(dtype):
    rng = random.Random(7)
    for _ in range(60):
        L = rng.choice([64, 128, 192, 512])
        N = rng.choice([1, 1, 2, 3, 7])
        lens = [rng.choice([0, 1, 63, 64, 65, 127, 128, 129, 191, 192, 193, 600]) for _ in range(N)]
        cu = _offsets(lens, dtype)
        T = int(cu[-1]) + rng.choice([0, 0, 1, 63, 64, L, L + 1])
        t = segments.segment_tables_device(cu, L, T)
        _check_tables_against_layout(t, cu, L, T)
        ref = build_segment_tables(cu, L, T=T)
        for f in TABLE_FIELDS:
            assert torch.equal(getattr(t, f), getattr(ref, f)), f


# =============================================================================================
# 2. combine scans against Python loops
# =============================================================================================


def _random_mixes(seed, count):
    rng = random.Random(seed)
    for _ in range(count):
        L = rng.choice([64, 128])
        N = rng.choice([1, 1, 1, 2, 3, 5])
        lens = [rng.choice([0, 1, 63, 64, 65, 127, 128, 129, 200, 256, 300]) for _ in range(N)]
        cu = _offsets(lens)
        T = int(cu[-1]) + rng.choice([0, 0, 1, 63, 64, 65, 128, 130])
        yield cu, T, L


def test_scans_match_python_loops_random_mixes():
    for i, (cu, T, L) in enumerate(_random_mixes(0, 80)):
        tab = build_segment_tables(cu, L, T=T)
        N = cu.numel() - 1
        P, Q, h0 = _maps(tab.M, N, seed=i)
        for ffh, use_h0 in itertools.product((False, True), (False, True)):
            h = h0 if use_h0 else None
            s, f = scan_segment_states(P, Q, tab, T, h, first_from_h0=ffh)
            sw, fw = _brute_states(P, Q, cu, L, h, ffh)
            assert _close(s, sw) and _close(f, fw), (cu.tolist(), T, L, ffh, use_h0)
        for use_d in (False, True):
            G = scan_segment_grads(P, Q, tab, T, h0 if use_d else None)
            assert _close(G, _brute_grads(P, Q, cu, L, h0 if use_d else None)), (cu.tolist(), T, L, use_d)


# (end, T, L): one sequence [0, end) in T rows
ONE_SEQUENCE = [
    (0, 0, 64),  # no tokens at all
    (0, 200, 64),  # an empty sequence followed by a tail
    (1, 200, 64),  # one token
    (63, 64, 64),  # shorter than a segment, a 1-token tail
    (64, 64, 64),  # exactly one segment
    (128, 300, 64),  # ends on a segment boundary before T
    (192, 192, 64),  # ends on a segment boundary at T (T a multiple of L)
    (193, 300, 64),  # one token into a segment, long tail
    (300, 300, 128),  # T not a multiple of L, no tail
    (256, 257, 128),  # boundary, a 1-token tail into the next slot
    (129, 1000, 128),  # many inert slots after the sequence
]


@pytest.mark.parametrize("end,T,L", ONE_SEQUENCE)
def test_one_sequence_scans_match_python_loops(end, T, L):
    cu = torch.tensor([0, end])
    tab = build_segment_tables(cu, L, T=T)
    P, Q, h0 = _maps(tab.M, 1, K=8, V=5, seed=end + T)
    for ffh, use_h0 in itertools.product((False, True), (False, True)):
        h = h0 if use_h0 else None
        sw, fw = _brute_states(P, Q, cu, L, h, ffh)
        s, f = scan_segment_states(P, Q, tab, T, h, first_from_h0=ffh)
        assert _close(s, sw) and _close(f, fw), (ffh, use_h0)
        if end == 0:
            assert torch.equal(f, h if use_h0 else torch.zeros_like(f)) and not s.any()
    for use_d in (False, True):
        D = h0 if use_d else None
        G = scan_segment_grads(P, Q, tab, T, D)
        assert _close(G, _brute_grads(P, Q, cu, L, D))
        last = int(tab.seq_last[0])
        if last >= 0:  # the final-state gradient lands on the sequence's own last slot
            assert torch.equal(G[last], D[0] if use_d else torch.zeros_like(G[last]))
        assert not G[~tab.valid].any()


@pytest.mark.parametrize("end,T,L", [c for c in ONE_SEQUENCE if c[0] > 0])
def test_one_sequence_path_equals_general_path(end, T, L):
    """[0, end) alone (N == 1 path) and followed by an empty sequence (general path): same states and
    gradients on its slots, same final state and final-state gradient slot."""
    tab1 = build_segment_tables(torch.tensor([0, end]), L, T=T)
    tab2 = build_segment_tables(torch.tensor([0, end, end]), L, T=T)
    P, Q, h0 = _maps(tab2.M, 2, K=8, V=5, seed=end)
    v = tab1.valid
    assert torch.equal(tab2.valid[: tab1.M], v)
    for ffh in (False, True):
        s1, f1 = scan_segment_states(P[: tab1.M], Q[: tab1.M], tab1, T, h0[:1], first_from_h0=ffh)
        s2, f2 = scan_segment_states(P, Q, tab2, T, h0, first_from_h0=ffh)
        assert _close(s1, s2[: tab1.M]) and _close(f1, f2[:1])
        assert torch.equal(f2[1], h0[1])  # the empty sequence keeps its initial state
    G1 = scan_segment_grads(P[: tab1.M], Q[: tab1.M], tab1, T, h0[:1])
    G2 = scan_segment_grads(P, Q, tab2, T, h0)
    assert _close(G1, G2[: tab1.M])


def test_scans_never_read_unused_slots():
    """NaN in every slot the docstrings say is not read (inert slots; first slots' P with
    first_from_h0; first slots' P and E in the reverse scan) leaves every output bit-identical."""
    for i, (cu, T, L) in enumerate(_random_mixes(1, 40)):
        tab = build_segment_tables(cu, L, T=T)
        P, Q, h0 = _maps(tab.M, cu.numel() - 1, seed=100 + i)
        nan = float("nan")
        for ffh in (False, True):
            Pp, Qp = P.clone(), Q.clone()
            Pp[~tab.valid], Qp[~tab.valid] = nan, nan
            if ffh:
                Pp[tab.first] = nan
            a = scan_segment_states(P, Q, tab, T, h0, first_from_h0=ffh)
            b = scan_segment_states(Pp, Qp, tab, T, h0, first_from_h0=ffh)
            assert all(torch.equal(x, y) for x, y in zip(a, b)), (cu.tolist(), T, L, ffh)
        unread = ~tab.valid | tab.first
        Pp, Ep = P.clone(), Q.clone()
        Pp[unread], Ep[unread] = nan, nan
        assert torch.equal(scan_segment_grads(P, Q, tab, T, h0), scan_segment_grads(Pp, Ep, tab, T, h0))


@pytest.mark.parametrize("T,L", [(0, 64), (63, 64), (300, 64), (1000, 128)])
def test_scans_with_no_sequences(T, L):
    tab = build_segment_tables(torch.zeros(1, dtype=torch.int64), L, T=T)
    P, Q, _ = _maps(tab.M, 0, seed=T)
    s, f = scan_segment_states(P, Q, tab, T)
    assert s.shape == Q.shape and not s.any() and f.shape == (0, *Q.shape[1:])
    G = scan_segment_grads(P, Q, tab, T, Q.new_zeros(0, *Q.shape[1:]))
    assert G.shape == Q.shape and not G.any()


# =============================================================================================
# 3. plan_cp
# =============================================================================================


@pytest.fixture
def fresh_plans():
    planner.clear_plan_cache()
    yield
    planner.clear_plan_cache()


def test_plan_invariants_random_sweep(fresh_plans):
    rng = random.Random(3)
    for _ in range(1500):
        HV = rng.choice([1, 2, 4, 8, 16, 32, 64])
        N = rng.choice([0, 1, 1, 2, 3, 8, 64, 1000])
        T = rng.choice([0, 1, 63, 64, 65, 511, 512, 513, 4096, 32768, 10**6, 2**31, 2**40])
        V = rng.choice([64, 128, 192, 256])
        sms = rng.choice([1, 16, 132])
        kw = dict(exact=rng.random() < 0.5, backward=rng.random() < 0.5)
        r = rng.random()
        if r < 0.15:
            kw["force"] = True
        elif r < 0.25:
            kw["disable"] = True
        if rng.random() < 0.3:
            kw["segment_len"] = rng.choice([64, 128, 192, 512, 4096, 2**20])
        if rng.random() < 0.3:
            kw["max_seqlen"] = rng.choice([0, 1, 100, 4096, T, 10**12])
        if rng.random() < 0.3:
            kw["gate_chunks"] = rng.choice([1, 4, 1000])
        p = plan_cp(HV, N, T, V, sms, **kw)
        what = (HV, N, T, V, sms, kw, p)
        assert p.BV in (128, 64) and V % p.BV == 0, what
        assert math.isfinite(p.est_unsplit) and p.est_unsplit >= 0, what
        assert p.est_split is None or (math.isfinite(p.est_split) and p.est_split > 0), what
        if N > 0 and T > 0 and kw.get("max_seqlen", 1) > 0:
            assert p.est_unsplit > 0, what
        if kw["backward"]:
            assert p.exact, what
        if p.split:
            assert isinstance(p.segment_len, int) and p.segment_len > 0 and p.segment_len % CHUNK == 0, what
            if "segment_len" in kw:
                assert p.segment_len == kw["segment_len"], what
            if not kw.get("force"):
                assert p.est_split is not None and p.est_unsplit >= (planner.BWD_MIN_GAIN if kw["backward"] else planner.MIN_GAIN) * p.est_split * (1 - 1e-12), what
        else:
            assert p.segment_len is None, what
        if kw.get("disable") or N == 0 or T == 0:
            assert not p.split, what
        elif kw.get("force"):
            assert p.split, what


def _cd(a, b):
    return -(-a // b)


def _run_and_transition(HV, T, V, sms, L, BV):
    """The docstring's run and transition launches for one sequence of T tokens at a fixed L:
    (run alone, run + transitions as the dual launch with cut transitions, segments, chunks per
    segment, value heads assumed to walk whole segments)."""
    NV, slots, segs = V // BV, sms * planner.CTAS_PER_SM[BV], _cd(T, L)
    chunks = _cd(min(L, T), CHUNK)
    run = planner.CHUNK_COST[BV] * _cd(NV * HV * segs, slots) * chunks
    later = segs - 1
    full = min(planner.FULL_TRANSITION_HEADS, HV)
    long = NV * (HV * segs + full * later)
    work = long * chunks + NV * (HV - full) * later * min(planner.CUT_CHUNKS, chunks)
    both = planner.CHUNK_COST[BV] * max(_cd(long, slots) * chunks, work / slots)
    return run, both, segs, chunks, full


def _fwd_exact_split(HV, T, V, sms, L, BV):
    """The docstring's exact-mode cost for one sequence of T tokens at a fixed L (dual launch, cut
    transitions, the correction over the walked rows, the per-head overhead)."""
    _, both, segs, _, full = _run_and_transition(HV, T, V, sms, L, BV)
    seg_len = min(L, T)
    corrected = (T - seg_len) * (full + (HV - full) * min(planner.CUT_CHUNKS * CHUNK, seg_len) / seg_len) / HV
    return (both + planner.SCAN_STEP_COST * (segs - 1) + planner.CORRECTION_COST * HV * corrected
            + planner.LAUNCH_COST * planner.EXTRA_LAUNCHES + planner.HEAD_OVERHEAD * HV)


def _bwd_split(HV, T, V, sms, L, BV):
    run, both, segs, chunks, _ = _run_and_transition(HV, T, V, sms, L, BV)
    waves = _cd(HV * segs, sms)
    bwd = planner.BWD_CHUNK_COST * waves * chunks + planner.BWD_WAVE_COST * waves
    return (both + run + 2 * planner.BWD_SCAN_STEP_COST * (segs - 1) + bwd
            + planner.LAUNCH_COST * (2 * planner.EXTRA_LAUNCHES + HV))


@pytest.mark.parametrize("HV,T,L", [(2, 32768, 2048), (8, 32768, 2048), (16, 65536, 4096), (4, 10000, 512)])
def test_plan_fixed_length_costs_follow_the_model(HV, T, L, fresh_plans):
    """At a fixed L the split estimate is the documented model with the forward's scan step
    (SCAN_STEP_COST = 1.0) and the backward's (BWD_SCAN_STEP_COST = 1.5, BWD_WAVE_COST = 20 a wave)."""
    assert planner.SCAN_STEP_COST == 1.0 and planner.BWD_SCAN_STEP_COST == 1.5 and planner.BWD_WAVE_COST == 20.0
    f = plan_cp(HV, 1, T, 128, 132, exact=True, segment_len=L, force=True)
    b = plan_cp(HV, 1, T, 128, 132, segment_len=L, force=True, backward=True)
    # the estimate of the width picked, which is within TIE of the cheapest (BV = 128 wins near-ties)
    for p, model in ((f, _fwd_exact_split), (b, _bwd_split)):
        assert p.est_split == pytest.approx(model(HV, T, 128, 132, L, p.BV), rel=1e-12)
        assert p.est_split <= (1 + planner.TIE) * min(model(HV, T, 128, 132, L, bv) for bv in (128, 64))


def test_forward_and_backward_scan_costs_are_separate(monkeypatch, fresh_plans):
    """SCAN_STEP_COST moves forward plans only, BWD_SCAN_STEP_COST backward plans only (one sequence
    and a packed batch, PACKED_BWD_OWN_PLAN on)."""
    shapes = [(2, 1, 32768), (8, 1, 32768), (4, 8, 8 * 8192), (16, 2, 8192)]
    kw = dict(exact=True, segment_len=1024, force=True)
    base_f = [plan_cp(HV, N, T, 128, 132, **kw) for HV, N, T in shapes]
    base_b = [plan_cp(HV, N, T, 128, 132, backward=True, **kw) for HV, N, T in shapes]
    scan_step_cost = planner.SCAN_STEP_COST
    monkeypatch.setattr(planner, "SCAN_STEP_COST", 100.0)
    planner.clear_plan_cache()
    assert [plan_cp(HV, N, T, 128, 132, backward=True, **kw) for HV, N, T in shapes] == base_b
    assert all(p.est_split > q.est_split for p, q in zip([plan_cp(HV, N, T, 128, 132, **kw) for HV, N, T in shapes], base_f))
    monkeypatch.setattr(planner, "SCAN_STEP_COST", scan_step_cost)
    monkeypatch.setattr(planner, "BWD_SCAN_STEP_COST", 100.0)
    planner.clear_plan_cache()
    assert [plan_cp(HV, N, T, 128, 132, **kw) for HV, N, T in shapes] == base_f
    assert all(p.est_split > q.est_split
               for p, q in zip([plan_cp(HV, N, T, 128, 132, backward=True, **kw) for HV, N, T in shapes], base_b))


@pytest.mark.parametrize("HV,N,T", [(2, 1, 32768), (16, 1, 32768), (16, 2, 8192), (4, 8, 8 * 8192), (2, 64, 64 * 512),
                                    (8, 3, 100)])
def test_packed_backward_flag(HV, N, T, monkeypatch, fresh_plans):
    """PACKED_BWD_OWN_PLAN = False: a packed backward (N > 1) takes the forward's exact plan (decision,
    L, BV and estimates) and says so; one sequence is planned with its own costs either way."""
    own = plan_cp(HV, N, T, 128, 132, backward=True)
    fwd = plan_cp(HV, N, T, 128, 132, exact=True)
    monkeypatch.setattr(planner, "PACKED_BWD_OWN_PLAN", False)
    planner.clear_plan_cache()
    off = plan_cp(HV, N, T, 128, 132, backward=True)
    if N == 1:
        assert off == own and "packed" not in off.reason
    else:
        assert (off.split, off.segment_len, off.BV, off.est_unsplit, off.est_split) == \
            (fwd.split, fwd.segment_len, fwd.BV, fwd.est_unsplit, fwd.est_split)
        assert off.exact and "packed" in off.reason and "packed" not in own.reason
    # force / disable keep their meaning with the flag off
    assert not plan_cp(HV, N, T, 128, 132, backward=True, disable=True).split
    assert plan_cp(HV, N, T, 128, 132, backward=True, force=True).split
    p = plan_cp(HV, N, T, 128, 132, backward=True, force=True, segment_len=192)
    assert p.split and p.segment_len == 192


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("N,T", [(0, 0), (0, 4096), (3, 0)])
def test_plan_empty_inputs(N, T, backward, fresh_plans):
    for kw in ({}, dict(force=True), dict(disable=True), dict(segment_len=128, force=True)):
        p = plan_cp(8, N, T, backward=backward, **kw)
        assert not p.split and p.segment_len is None and p.est_unsplit == 0.0 and p.est_split is None, (kw, p)


def test_plan_huge_T_is_fast_and_quantised(fresh_plans):
    import time

    t0 = time.perf_counter()
    for T in (2**40, 2**50, 2**62):
        for bwd in (False, True):
            for N in (1, 4):
                p = plan_cp(1, N, T, exact=True, backward=bwd)
                assert p.split and p.segment_len % planner.SEGMENT_QUANTUM == 0 and p.segment_len < T, p
                assert math.isfinite(p.est_split) and p.est_split > 0
    assert time.perf_counter() - t0 < 20


# =============================================================================================
# 4. cp_forward / cp_backward on the fp64 reference backend
# =============================================================================================


def _inputs(T, lengths_or_cu, *, H=1, HV=2, K=16, V=16, h0=True, seed=0, cu_given=False):
    d = make_gdn_inputs(1, T, H, HV, K, V, initial_state=False, dtype=F64, seed=seed)
    cu = torch.tensor(lengths_or_cu, dtype=torch.int32) if cu_given else _offsets(lengths_or_cu, torch.int32)
    d["cu_seqlens"] = cu
    N = cu.numel() - 1
    g = torch.Generator().manual_seed(seed + 1)
    d["initial_state"] = torch.randn(N, HV, K, V, generator=g, dtype=F64) if h0 else None
    return d


def _forward(d, L, correction="gemm", backend=None):
    T = d["q"].shape[1]
    tab = build_segment_tables(d["cu_seqlens"], L, T=T)
    be = backend or ReferenceCPBackend()
    o, ht, *_ = cp_forward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], d["q"].shape[-1] ** -0.5,
                           d["initial_state"], True, d["cu_seqlens"], tab, block_v=None, correction=correction)
    return o, ht


def _backward(d, L, do, dht, backend_cls=ReferenceCPBackend):
    T, HV = d["q"].shape[1], d["v"].shape[2]
    tab = build_segment_tables(d["cu_seqlens"], L, T=T)
    be = backend_cls()
    A, G2 = be.prepare(d["k"], d["g"], d["beta"], tab.cu_seqlens, HV)
    return cp_backward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], A, G2, do, dht, d["q"].shape[-1] ** -0.5,
                       d["initial_state"], d["cu_seqlens"], tab, block_v=None)


def _truth(d):
    """Outputs on the sequences' tokens, final states, and a closure giving autograd gradients of
    sum(o * do) + sum(ht * dht) (tokens past cu[-1] get zero gradient)."""
    end = int(d["cu_seqlens"][-1])
    T = d["q"].shape[1]
    x = {n: d[n][:, :end].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    h0 = None if d["initial_state"] is None else d["initial_state"].clone().requires_grad_(True)
    o, ht = recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], d["q"].shape[-1] ** -0.5, h0, True,
                                       d["cu_seqlens"])

    def grads(do, dht):
        loss = (o * do[:, :end]).sum() + ((ht * dht).sum() if dht is not None else 0.0)
        wrt = [x[n] for n in ("q", "k", "v", "g", "beta")] + ([h0] if h0 is not None else [])
        gs = list(torch.autograd.grad(loss, wrt, allow_unused=True)) if end else [torch.zeros_like(w) for w in wrt]
        gs = [torch.zeros_like(w) if gr is None else gr for gr, w in zip(gs, wrt)]
        pad = lambda gr: torch.cat([gr, gr.new_zeros(gr.shape[0], T - end, *gr.shape[2:])], 1)  # noqa: E731
        return [pad(gr) for gr in gs[:5]] + [gs[5] if h0 is not None else None]

    return o.detach(), ht.detach(), grads


def _cotangents(d, with_dht, seed=0):
    g = torch.Generator().manual_seed(seed)
    do = torch.randn(d["v"].shape, generator=g, dtype=F64)
    N, HV, K, V = d["cu_seqlens"].numel() - 1, d["v"].shape[2], d["k"].shape[3], d["v"].shape[3]
    return do, (torch.randn(N, HV, K, V, generator=g, dtype=F64) if with_dht else None)


def _check_grads(got, want, tol=1e-11):
    for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, want):
        if b is None:
            assert a is None, name
            continue
        assert a.shape == b.shape, name
        if b.abs().max() == 0:
            assert a.abs().max() <= 1e-300, name
        else:
            assert _rel(a, b) <= tol, (name, _rel(a, b))


MIXES = [  # (T, lengths, L)
    (331, [0, 0, 0, 130, 0, 0, 1, 0, 0, 200, 0], 64),  # many empty sequences
    (144, [1] * 14 + [129, 1], 64),  # 1-token sequences around one that splits
    (576, [63, 64, 65, 127, 128, 129], 64),  # lengths around the segment length
    (576, [63, 64, 65, 127, 128, 129], 128),
    (258, [129, 129], 128),
    (385, [0, 385], 128),  # a leading empty sequence, then one long one
]


@pytest.mark.parametrize("T,lengths,L", MIXES)
def test_cp_forward_and_backward_awkward_mixes(T, lengths, L):
    d = _inputs(T, lengths, seed=T + L)
    o_ref, ht_ref, grads = _truth(d)
    for corr in ("gemm", "rerun"):
        o, ht = _forward(d, L, corr)
        assert _rel(o, o_ref) <= 1e-12 and _rel(ht, ht_ref) <= 1e-12, corr
    do, dht = _cotangents(d, True, seed=L)
    got = _backward(d, L, do, dht)
    _check_grads(got, grads(do, dht))
    # empty sequences: final state h0, h0's gradient dht
    for n, ln in enumerate(lengths):
        if ln == 0:
            assert torch.equal(ht[n], d["initial_state"][n]) and torch.equal(got[5][n], dht[n])


# (cu, T, L): offsets ending before T (a packed tail)
TAILS = [
    ([0, 65, 200], 300, 64),
    ([0, 0, 1, 130], 200, 64),
    ([0, 192], 300, 64),  # one sequence, ending on a segment boundary
    ([0, 128], 129, 128),
    ([0, 100], 300, 64),  # one sequence, ending inside a segment
    ([0, 1], 200, 64),
    ([0, 300], 301, 128),
]


@pytest.mark.parametrize("h0,with_dht", [(True, True), (False, True), (True, False)], ids=["h0-dht", "dht", "h0"])
@pytest.mark.parametrize("cu,T,L", TAILS)
def test_cp_with_packed_tail(cu, T, L, h0, with_dht):
    d = _inputs(T, cu, h0=h0, seed=T + len(cu), cu_given=True)
    end = cu[-1]
    o_ref, ht_ref, grads = _truth(d)
    o, ht = _forward(d, L)
    assert _rel(o[:, :end], o_ref) <= 1e-12 and _rel(ht, ht_ref) <= 1e-12
    do, dht = _cotangents(d, with_dht, seed=end)
    got = _backward(d, L, do, dht)
    _check_grads(got, grads(do, dht))
    for gr in got[:5]:
        assert not gr[:, end:].any()


@pytest.mark.parametrize("H,HV,lengths,L", [(1, 4, [150, 0, 170], 64), (2, 8, [64, 1, 191], 64)])
def test_cp_gva_initial_state_and_dht(H, HV, lengths, L):
    T = sum(lengths)
    d = _inputs(T, lengths, H=H, HV=HV, K=16, V=8, seed=HV)
    o_ref, ht_ref, grads = _truth(d)
    o, ht = _forward(d, L)
    assert _rel(o, o_ref) <= 1e-12 and _rel(ht, ht_ref) <= 1e-12
    do, dht = _cotangents(d, True, seed=1)
    _check_grads(_backward(d, L, do, dht), grads(do, dht))


class _UnwrittenTailBackend(ReferenceCPBackend):
    """The reference launches, but rows past the last pseudo offset hold garbage, as the sm_90
    recurrent kernel leaves them (its outputs come from torch.empty_like and only the sequences'
    tokens are written)."""

    fill = float("nan")

    def recurrent(self, q, k, v, A, g_cum_log2, scale, initial_state, output_final_state, cu_seqlens, block_v=None,
                  o=None):
        out, S = super().recurrent(q, k, v, A, g_cum_log2, scale, initial_state, output_final_state, cu_seqlens,
                                   block_v, o)
        end = out.shape[1] if cu_seqlens is None else int(cu_seqlens[-1])
        out[:, end:] = self.fill
        return out, S


class _FiniteGarbageBackend(_UnwrittenTailBackend):
    fill = 1e3


@pytest.mark.parametrize("cu,T,L", [([0, 65, 200], 300, 64), ([0, 100, 100], 300, 64), ([0, 192], 300, 64),
                                    ([0, 1], 200, 64)])
def test_unwritten_tail_rows_do_not_leak(cu, T, L):
    """Garbage in the launches' rows past cu[-1] must not reach any gradient or any sequence's output
    (packed batches, and one sequence whose tail starts on a segment boundary or inside its only
    segment)."""
    d = _inputs(T, cu, seed=T, cu_given=True)
    end = cu[-1]
    o_ref, ht_ref, grads = _truth(d)
    o, ht = _forward(d, L, backend=_UnwrittenTailBackend())
    assert _rel(o[:, :end], o_ref) <= 1e-12 and _rel(ht, ht_ref) <= 1e-12
    do, dht = _cotangents(d, True, seed=2)
    _check_grads(_backward(d, L, do, dht, _UnwrittenTailBackend), grads(do, dht))


@pytest.mark.parametrize("backend", [_UnwrittenTailBackend, _FiniteGarbageBackend], ids=["nan", "finite"])
def test_unwritten_tail_rows_one_sequence_inside_segment(backend):
    T, L, cu = 300, 64, [0, 100]
    d = _inputs(T, cu, seed=5, cu_given=True)
    _, _, grads = _truth(d)
    do, dht = _cotangents(d, True, seed=2)
    _check_grads(_backward(d, L, do, dht, backend), grads(do, dht))


def test_one_sequence_fast_path_equals_general_path_with_tail(monkeypatch):
    d = _inputs(300, [0, 100], seed=11, cu_given=True)
    do, dht = _cotangents(d, True, seed=3)
    o1, ht1 = _forward(d, 64)
    g1 = _backward(d, 64, do, dht)
    monkeypatch.setattr(cp_fwd_mod, "ONE_SEQUENCE_FAST_PATH", False)
    o2, ht2 = _forward(d, 64)
    g2 = _backward(d, 64, do, dht)
    assert _rel(o1[:, :100], o2[:, :100]) <= 1e-14 and _rel(ht1, ht2) <= 1e-14
    for a, b in zip(g1, g2):
        assert _rel(a, b) <= 1e-14


@pytest.mark.parametrize("cu,T", [([0, 100], 300), ([0, 192], 300), ([0, 250], 300)])
def test_gated_one_sequence_tail_fast_path_equals_general_path(cu, T, monkeypatch):
    """Gated mode, one sequence ending before T: the per-view correction of the one-sequence path and
    the gathered path agree on the sequence's tokens, final state and flags, with garbage in the
    launches' tail rows."""
    d = _inputs(T, cu, seed=T, cu_given=True)
    tab = build_segment_tables(d["cu_seqlens"], 64, T=T)
    out = []
    for fast in (True, False):
        monkeypatch.setattr(cp_fwd_mod, "ONE_SEQUENCE_FAST_PATH", fast)
        o, ht, _, _, info = cp_forward(_FiniteGarbageBackend(), d["q"], d["k"], d["v"], d["g"], d["beta"], 0.25,
                                       d["initial_state"], True, d["cu_seqlens"], tab, block_v=None, gate_chunks=2)
        out.append((o[:, : cu[-1]], ht, info.gate_ok))
    (o1, h1, ok1), (o2, h2, ok2) = out
    assert _rel(o1, o2) <= 1e-14 and _rel(h1, h2) <= 1e-14 and torch.equal(ok1, ok2)
    assert torch.isfinite(o1).all() and torch.isfinite(h1).all()


def test_cp_forward_all_sequences_empty():
    d = _inputs(100, [0, 0, 0], cu_given=True)
    o, ht = _forward(d, 64)
    assert torch.equal(ht, d["initial_state"])


def test_cp_backward_all_sequences_empty():
    d = _inputs(100, [0, 0, 0], cu_given=True)
    do, dht = _cotangents(d, True)
    got = _backward(d, 64, do, dht)
    assert all(not x.any() for x in got[:5]) and torch.equal(got[5], dht)


# =============================================================================================
# 5. the public op's inference route and its custom op
# =============================================================================================


def _op_inputs(B=1, T=8, H=1, HV=2, K=128, V=128, dtype=torch.bfloat16):
    """Valid inputs of the public op (on CPU: only the device check fails)."""
    gen = torch.Generator().manual_seed(B * T)
    q = torch.randn(B, T, H, K, generator=gen).to(dtype)
    k = torch.randn(B, T, H, K, generator=gen).to(dtype)
    v = torch.randn(B, T, HV, V, generator=gen).to(dtype)
    g = -torch.rand(B, T, HV, generator=gen)
    beta = torch.rand(B, T, HV, generator=gen)
    return dict(q=q, k=k, v=v, g=g, beta=beta, initial_state=None)


def _bad_cases():
    """(name, kwargs of chunk_gated_delta_rule, expected exception type)."""
    base = _op_inputs()
    cases = []

    def case(name, exc, **over):
        kw = dict(base, **over)
        cases.append((name, kw, exc))

    case("q_fp32", TypeError, q=base["q"].float(), k=base["k"].float(), v=base["v"].float())
    case("qkv_mixed", TypeError, k=base["k"].half())
    case("g_bf16", TypeError, g=base["g"].bfloat16())
    case("beta_fp16", TypeError, beta=base["beta"].half())
    case("K_64", ValueError, q=base["q"][..., :64].contiguous(), k=base["k"][..., :64].contiguous())
    case("V_64", ValueError, v=base["v"][..., :64].contiguous())
    case("HV_not_multiple", ValueError, q=torch.zeros(1, 8, 3, 128, dtype=torch.bfloat16),
         k=torch.zeros(1, 8, 3, 128, dtype=torch.bfloat16))
    case("g_shape", ValueError, g=base["g"][:, :, :1].contiguous())
    case("q_rank", ValueError, q=base["q"][0])
    case("h0_fp64", TypeError, initial_state=torch.zeros(1, 2, 128, 128, dtype=F64))
    case("h0_shape", ValueError, initial_state=torch.zeros(2, 2, 128, 128))
    case("scale_nan", ValueError, scale=float("nan"))
    case("scale_bool", TypeError, scale=True)
    case("ofs_int", TypeError, output_final_state=1)
    case("positive_g", ValueError, g=base["g"].abs() + 0.5)
    case("cu_float", TypeError, cu_seqlens=torch.tensor([0.0, 8.0]))
    case("cu_2d", ValueError, cu_seqlens=torch.tensor([[0, 8]], dtype=torch.int32))
    case("cu_short_end", ValueError, cu_seqlens=torch.tensor([0, 4], dtype=torch.int32))
    case("cu_not_zero_start", ValueError, cu_seqlens=torch.tensor([1, 8], dtype=torch.int32))
    case("cu_decreasing", ValueError, cu_seqlens=torch.tensor([0, 6, 5, 8], dtype=torch.int32))
    b2 = _op_inputs(B=2)
    cases.append(("cu_with_B2", dict(b2, cu_seqlens=torch.tensor([0, 8], dtype=torch.int32)), ValueError))
    case("l2norm_int", TypeError, use_qk_l2norm_in_kernel=1)
    case("cp_unknown", ValueError, cp="sometimes")
    case("valid_on_cpu", RuntimeError)
    case("valid_varlen_on_cpu", RuntimeError, cu_seqlens=torch.tensor([0, 3, 3, 8], dtype=torch.int32),
         initial_state=torch.zeros(3, 2, 128, 128))
    return cases


BAD_CASES = _bad_cases()
#: a fragment each message must contain (the argument it is about)
MESSAGE = {"q_fp32": "bfloat16 or float16", "qkv_mixed": "share one dtype", "g_bf16": "g in float32",
           "beta_fp16": "beta", "K_64": "K = V = 128", "V_64": "K = V = 128", "HV_not_multiple": "multiple of",
           "g_shape": "g must be", "q_rank": "q must have 4", "h0_fp64": "initial_state", "h0_shape": "initial_state",
           "scale_nan": "scale", "scale_bool": "scale", "ofs_int": "output_final_state", "positive_g": "g must be <= 0",
           "cu_float": "cu_seqlens", "cu_2d": "cu_seqlens", "cu_short_end": "end at T", "cu_not_zero_start": "start at 0",
           "cu_decreasing": "non-decreasing", "cu_with_B2": "B == 1", "l2norm_int": "use_qk_l2norm_in_kernel",
           "cp_unknown": "cp must be", "valid_on_cpu": "compute capability 9.0",
           "valid_varlen_on_cpu": "compute capability 9.0"}
#: cases that the public wrapper rejects before the custom ops' schema (bool / int arguments)
WRAPPER_ONLY = ("l2norm_int", "scale_bool", "ofs_int")
DIRECT_CASES = [c for c in BAD_CASES if c[0] not in WRAPPER_ONLY]


def _raised(fn):
    try:
        fn()
    except Exception as e:  # noqa: BLE001
        return type(e), str(e)
    return None, None


@pytest.mark.parametrize("name,kw,exc", BAD_CASES, ids=[c[0] for c in BAD_CASES])
def test_inference_and_training_routes_raise_alike(name, kw, exc):
    from flashqla.ops.gdn.api import chunk_gated_delta_rule

    def call(grad_on, requires_grad):
        args = {n: (t.detach().clone().requires_grad_(requires_grad) if isinstance(t, torch.Tensor)
                    and t.is_floating_point() and n != "cu_seqlens" else t) for n, t in kw.items()}
        with torch.set_grad_enabled(grad_on):
            return chunk_gated_delta_rule(**args)

    inference = _raised(lambda: call(True, False))
    training = _raised(lambda: call(True, True))
    no_grad = _raised(lambda: call(False, True))
    assert inference[0] is exc, inference
    assert MESSAGE[name] in inference[1], inference
    assert inference == training == no_grad


@pytest.mark.parametrize("name,kw,exc", DIRECT_CASES, ids=[c[0] for c in DIRECT_CASES])
def test_custom_ops_raise_alike(name, kw, exc):
    """The two forward custom ops called directly (as torch.compile would) check their arguments
    the same way and, on CPU, end in the Hopper RuntimeError."""
    import flashqla.ops.gdn.autograd  # noqa: F401  (registers the ops)

    scale = kw.get("scale")
    args = (kw["q"], kw["k"], kw["v"], kw["g"], kw["beta"], 0.1 if scale is None else float(scale),
            kw.get("initial_state"), bool(kw.get("output_final_state", True)), kw.get("cu_seqlens"), kw.get("cp", "auto"))
    inf = _raised(lambda: torch.ops.flashqla.gdn_fwd_inference(*args))
    trn = _raised(lambda: torch.ops.flashqla.gdn_fwd(*args))
    assert inf == trn
    assert inf[0] is exc and MESSAGE[name] in inf[1], inf


@pytest.mark.parametrize("final", [True, False])
@pytest.mark.parametrize("B,T,H,HV,K,V,N,cu", [(1, 300, 2, 4, 128, 128, 3, True), (2, 100, 1, 3, 64, 32, None, False),
                                               (1, 0, 1, 1, 16, 16, 1, True), (1, 5, 1, 2, 128, 128, 0, True)])
def test_inference_op_fake_shapes(B, T, H, HV, K, V, N, cu, final):
    import flashqla.ops.gdn.autograd  # noqa: F401
    from torch._subclasses.fake_tensor import FakeTensorMode

    n = B if not cu else N

    def make(device):
        q = torch.empty(B, T, H, K, dtype=torch.bfloat16, device=device)
        v = torch.empty(B, T, HV, V, dtype=torch.bfloat16, device=device)
        g = torch.empty(B, T, HV, device=device)
        h0 = torch.empty(n, HV, K, V, device=device)
        c = torch.empty(N + 1, dtype=torch.int32, device=device) if cu else None
        return q, v, g, h0, c

    def check(o, f, q, v):
        assert o.shape == v.shape and o.dtype == q.dtype and o.device == q.device
        assert f.dtype == torch.float32 and f.shape == ((n, HV, K, V) if final else (0,))

    q, v, g, h0, c = make("meta")
    o, f = torch.ops.flashqla.gdn_fwd_inference(q, q, v, g, g, 0.5, h0, final, c, "auto")
    check(o, f, q, v)
    o2, f2, A, G2 = torch.ops.flashqla.gdn_fwd(q, q, v, g, g, 0.5, h0, final, c, "auto")
    assert o2.shape == o.shape and f2.shape == f.shape
    with FakeTensorMode():
        q, v, g, h0, c = make("cpu")
        o, f = torch.ops.flashqla.gdn_fwd_inference(q, q, v, g, g, 0.5, None, final, c, "off")
        check(o, f, q, v)

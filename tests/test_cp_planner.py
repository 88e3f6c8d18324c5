"""flashqla.cp planner (`flashqla.cp.plan`, `flashqla.cp.segments`): the split rule, the segment tables (against reference.gdn.cp's plan and its
exact CP forward in fp64), no host sync while building tables, and a plan cache that cannot go stale."""

from __future__ import annotations

import contextlib
import random

import pytest
import torch

from flashqla.cp import build_segment_tables, clear_plan_cache, plan_cp, plan_for, scan_segment_states
from flashqla.cp.plan import SEGMENT_QUANTUM, TIE, plan_cache_info, plan_key
from flashqla.cp.segments import num_segment_slots, split_tables
from flashqla.testing import make_gdn_inputs
from reference.gdn.chunk import prepare_chunk_layout
from reference.gdn.cp import cp_gated_delta_rule_fwd, output_correction, plan_segments, segment_maps
from reference.gdn.fused import from_chunks, fused_chunk_fwd, gate_cumsum, to_chunks
from reference.gdn.recurrent import recurrent_gated_delta_rule


def _plan_and_tables(q, v, cu_seqlens=None, **kw):
    """(plan, tables): `plan_for`'s plan and, when it splits, the segment tables the op builds for it
    (`flashqla.cp.segments.split_tables`, rebuilt on every call from cu_seqlens' current values);
    tables None when the plan does not split."""
    plan = plan_for(q, v, cu_seqlens, **kw)
    if not plan.split:
        return plan, None
    return plan, split_tables(cu_seqlens, plan.segment_len, q.shape[0], q.shape[1], q.device)[0]


def _cu(lengths, dtype=torch.int32):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


# Length mixes: only some sequences split, empty sequences (first, middle, last), sequences shorter
# than a segment, totals not a multiple of 64.
MIXES = [
    [300],
    [0, 130, 0, 7, 257, 0],
    [64, 64, 65, 1, 200],
    [5, 0, 63, 1, 64, 130],
    [511, 513, 0, 1025, 3],
    [0],
    [0, 0, 190],
]


# ---------------------------------------------------------------------------------------------- rule


@pytest.mark.parametrize(
    "HV,N,T,exact,split,L,BV",
    [
        # 2/8 1x32768: 16 CTAs unsplit; split, 104 run CTAs + 96 transitions in one launch, the
        # transitions of decaying heads cut short (measured best of 2048-4096 on the H200)
        (8, 1, 32768, True, True, 2560, 128),
        (8, 1, 32768, False, True, 2048, 128),
        (64, 4, 32768, True, False, None, 128),  # 16/64 4x8192: 256 CTAs already
        (64, 4, 32768, False, False, None, 128),
        (64, 1, 4096, True, False, None, 64),  # 16/64 1x4096: BV = 64 fills 128 SMs, split not worth it
        # 16/64 x 65536 and x 32768: the unsplit launch at BV = 64 is the role-split kernel (H200, 16/64
        # 1x32768: 1.330 ms unsplit, 1.350 split at L = 16896; with the one-warpgroup kernel 1.92 / 1.49)
        (64, 1, 65536, True, False, None, 64),
        (64, 1, 32768, True, False, None, 64),
        (64, 4, 8192, True, False, None, 128),
        (16, 8, 8192, False, False, None, 128),  # short sequences
    ],
)
def test_rule_examples(HV, N, T, exact, split, L, BV):
    p = plan_cp(HV, N, T, 128, 132, exact=exact)
    assert (p.split, p.segment_len, p.BV) == (split, L, BV), p


@pytest.mark.parametrize("HV", [1, 2, 4, 8, 16, 32, 64])
@pytest.mark.parametrize("N", [1, 2, 3, 8])
@pytest.mark.parametrize("T", [4096, 20000, 65536, 262144])
@pytest.mark.parametrize("exact", [False, True])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_rule_properties(HV, N, T, exact, backward):
    sms = 132
    p = plan_cp(HV, N, T, 128, sms, exact=exact, backward=backward)
    if not p.split:
        assert p.segment_len is None
        return
    L = p.segment_len
    assert L % SEGMENT_QUANTUM == 0 and L < -(-T // N)  # lengths unknown: taken as balanced
    assert p.est_unsplit >= (1.05 if backward else 1.2) * p.est_split  # BWD_MIN_GAIN / MIN_GAIN
    if not backward:
        ctas = (128 // p.BV) * HV * N * -(-(-(-T // N)) // L)
        # the chosen split fills at most a few waves; a shorter segment (more CTAs, more sequential
        # combine steps) is not predicted faster (with few heads the combine steps keep segments long)
        assert ctas <= 4 * sms or L == SEGMENT_QUANTUM, (ctas, p)
    if L > SEGMENT_QUANTUM:
        shorter = plan_cp(HV, N, T, 128, sms, exact=exact, force=True, segment_len=L - SEGMENT_QUANTUM,
                          backward=backward)
        assert shorter.est_split * (1 + TIE) >= p.est_split, (shorter, p)  # near-ties go to the longer L
    # few heads, one long sequence: always split
    if HV * N <= 8 and T >= 16384:
        assert p.split


@pytest.mark.parametrize(
    "HV,N,T,fwd_split,bwd_split",
    [
        (8, 1, 32768, True, True),  # 2/8 1x32768
        (32, 1, 32768, True, True),  # 16/32 1x32768: forward L = 8192 (H200: 1.72 -> 1.43 ms), backward too
        (4, 1, 8192, True, True),  # 2/4 1x8192
        (64, 4, 32768, False, False),  # 16/64 4x8192: 256 CTAs
        (32, 2, 32768, False, True),  # packed: the backward's own costs (PACKED_BWD_OWN_PLAN); the forward
        # unsplit at BV = 64 (role-split kernel; H200, 16/32 16384+16384: 0.708 ms against 0.835 split)
        (32, 8, 65536, False, False),  # 8 x 8192 at 32 heads: 256 CTAs fill the SMs in both
    ],
)
def test_backward_rule_examples(HV, N, T, fwd_split, bwd_split):
    """One sequence: the backward is planned with its own costs (`BWD_CHUNK_COST` per chunk of the
    fused chunk backward, one CTA per sequence and value head) and splits where the forward's plan
    does not; so does a packed batch (N > 1, `PACKED_BWD_OWN_PLAN`)."""
    f = plan_cp(HV, N, T, 128, 132, exact=True)
    b = plan_cp(HV, N, T, 128, 132, exact=True, backward=True)
    assert (f.split, b.split) == (fwd_split, bwd_split), (f, b)
    if N > 1:
        assert "packed" not in b.reason


def test_unknown_lengths_are_balanced_and_a_hint_counts():
    """Without max_seqlen, N sequences are costed as ceil(T / N) tokens each (the case least
    favourable to splitting); a hint bounds the longest sequence (and only that one)."""
    assert not plan_cp(32, 4, 32768, exact=True).split  # balanced: 4 x 8192 at 32 heads, 128 CTAs
    assert plan_cp(32, 4, 32768, exact=True, max_seqlen=28672).split
    assert plan_cp(32, 4, 32768, exact=True, backward=True, max_seqlen=28672).split


def test_rule_overrides():
    assert not plan_cp(8, 1, 32768, disable=True).split
    p = plan_cp(64, 4, 32768, force=True)
    assert p.split and p.segment_len % SEGMENT_QUANTUM == 0 and "forced" in p.reason
    p = plan_cp(64, 4, 32768, force=True, segment_len=192)
    assert p.split and p.segment_len == 192
    p = plan_cp(8, 1, 32768, segment_len=4096)
    assert p.split and p.segment_len == 4096
    assert plan_cp(8, 1, 32768, exact=True).exact and not plan_cp(8, 1, 32768).exact
    assert not plan_cp(8, 1, 400).split  # shorter than one quantum
    assert plan_cp(8, 1, 400, force=True).split
    hint = plan_cp(16, 16, 16 * 2048)  # balanced 2 K-token sequences: no split
    skew = plan_cp(16, 16, 16 * 2048, max_seqlen=30000)  # one sequence holds almost all tokens
    assert not hint.split and skew.split
    for bad in (dict(segment_len=100), dict(segment_len=0), dict(force=True, disable=True)):
        with pytest.raises(ValueError):
            plan_cp(8, 1, 4096, **bad)
    with pytest.raises(ValueError):
        plan_cp(0, 1, 4096)
    assert plan_cp(8, 1, 4096, 64).BV == 64  # V = 64 has one slice width
    with pytest.raises(ValueError):
        plan_cp(8, 1, 4096, 96)


# -------------------------------------------------------------------------------------------- tables


def _check_tables(tab, cu_list, T, L, B=1):
    """Valid slots in slot order are reference.gdn.cp.plan_segments' segments; inert slots empty."""
    if cu_list is None:
        ref = plan_segments(B, T, None, L)
        N, total = B, B * T
    else:
        ref = plan_segments(1, T, torch.tensor(cu_list, dtype=torch.int64), L)
        N, total = len(cu_list) - 1, T
    M = num_segment_slots(total, N, L)
    assert tab.M == M and tab.cu_seqlens.shape == (M + 1,) and tab.N == N
    pcu = tab.cu_seqlens.tolist()
    assert pcu[0] == 0 and pcu[-1] == total and all(a <= b for a, b in zip(pcu, pcu[1:]))
    assert tab.start.tolist() == pcu[:-1] and tab.end.tolist() == pcu[1:]
    v = tab.valid
    assert ((tab.end > tab.start) == v).all()  # inert slots are exactly the empty ones
    rcu = ref.cu_seqlens.tolist()
    assert tab.start[v].tolist() == rcu[:-1] and tab.end[v].tolist() == rcu[1:]
    assert tab.seq[v].tolist() == ref.seq.tolist()
    assert tab.first[v].tolist() == ref.first.tolist() and tab.last[v].tolist() == ref.last.tolist()
    assert not (tab.first | tab.last)[~v].any()
    # combine order: consecutive slots of one sequence; prev links them
    slots = torch.arange(M)
    assert (tab.prev[v & ~tab.first] == slots[v & ~tab.first] - 1).all()
    assert (tab.prev[tab.first | ~v] == -1).all()
    assert (tab.seq[tab.prev[tab.prev >= 0]] == tab.seq[tab.prev >= 0]).all()
    assert (tab.h0_index == torch.where(tab.first, tab.seq, -1)).all()
    assert (tab.need_correction == (v & ~tab.first)).all()
    for n in range(N):
        mine = slots[v & (tab.seq == n)].tolist()
        k = int(tab.seq_num[n])
        assert mine == list(range(int(tab.seq_first[n]), int(tab.seq_first[n]) + k))
        assert int(tab.seq_last[n]) == (mine[-1] if mine else -1)
    assert (tab.need_transition == (v & ~tab.first & ~tab.last)).all()
    assert int(tab.seq_num.max() if N else 0) <= tab.max_segments_per_sequence(total)


@pytest.mark.parametrize("lengths", MIXES)
@pytest.mark.parametrize("L", [64, 128, 192, 512])
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64])
def test_tables_match_reference_plan(lengths, L, dtype):
    cu = _cu(lengths, dtype)
    T = sum(lengths)
    tab = build_segment_tables(cu, L, T=T)
    assert tab.cu_seqlens.dtype == dtype
    _check_tables(tab, cu.tolist(), T, L)


@pytest.mark.parametrize("B,T,L", [(1, 300, 128), (3, 200, 64), (2, 1000, 512), (2, 63, 64)])
def test_tables_fixed_length_rows(B, T, L):
    tab = build_segment_tables(None, L, T=T, B=B)
    _check_tables(tab, None, T, L, B=B)


def test_tables_random_mixes():
    rng = random.Random(0)
    for _ in range(200):
        lengths = [rng.choice([0, 1, 63, 64, 65]) if rng.random() < 0.4 else rng.randrange(0, 1500) for _ in range(rng.randrange(1, 9))]
        L = 64 * rng.randrange(1, 12)
        cu = _cu(lengths)
        _check_tables(build_segment_tables(cu, L, T=sum(lengths)), cu.tolist(), sum(lengths), L)


def test_tables_errors():
    with pytest.raises(ValueError):
        build_segment_tables(_cu([10]), 100, T=10)
    with pytest.raises(ValueError):
        build_segment_tables(_cu([10]), 64)


# ----------------------------------------------------------------------------------- no host sync

_GUARDED = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__", "__len__", "__iter__")


@contextlib.contextmanager
def _no_host_reads():
    """Every way to pull a tensor's value into Python raises (shape reads stay allowed)."""
    saved = {name: getattr(torch.Tensor, name) for name in _GUARDED}

    def deny(name):
        def f(self, *a, **k):
            raise RuntimeError(f"host read of a tensor value: Tensor.{name}")

        return f

    try:
        for name in _GUARDED:
            setattr(torch.Tensor, name, deny(name))
        yield
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)


def test_guard_catches_host_reads():
    cu = _cu([3, 4])
    for read in (lambda: cu[1].item(), lambda: cu.tolist(), lambda: cu.cpu(), lambda: bool(cu[0] == 0), lambda: int(cu[1]), lambda: range(10)[cu[1]]):
        with _no_host_reads(), pytest.raises(RuntimeError, match="host read"):
            read()


@pytest.mark.parametrize("lengths", MIXES)
def test_tables_without_host_sync(lengths):
    cu = _cu(lengths)
    T = sum(lengths)
    expect = build_segment_tables(cu, 128, T=T)
    q = torch.zeros(1, T, 2, 16)
    v = torch.zeros(1, T, 4, 128)
    with _no_host_reads():
        tab = build_segment_tables(cu, 128, T=T)
        plan, tab2 = _plan_and_tables(q, v, cu, force=True, segment_len=128, sm_count_override=132)
        rows = build_segment_tables(None, 64, T=T, B=2)
    assert rows.M == num_segment_slots(2 * T, 2, 64)
    assert plan.split == (T > 0) and (tab2 is None) == (T == 0)  # nothing to split in an empty input
    for f in ("cu_seqlens", "seq", "start", "end", "valid", "first", "last", "prev", "h0_index", "seq_first", "seq_num", "seq_last"):
        assert torch.equal(getattr(tab, f), getattr(expect, f)), f
        assert tab2 is None or torch.equal(getattr(tab2, f), getattr(expect, f)), f


def test_tables_and_scan_on_meta_tensors():
    """Meta tensors carry shapes and no values: anything that read a value would fail here."""
    cu = torch.empty(5, dtype=torch.int32, device="meta")
    tab = build_segment_tables(cu, 128, T=1000)
    M = num_segment_slots(1000, 4, 128)
    assert tab.M == M and tab.cu_seqlens.shape == (M + 1,) and tab.cu_seqlens.device.type == "meta"
    assert tab.seq_first.shape == (4,) and tab.valid.dtype == torch.bool
    P = torch.empty(M, 2, 4, 4, device="meta")
    Q = torch.empty(M, 2, 4, 3, device="meta")
    S, final = scan_segment_states(P, Q, tab, 1000, torch.empty(4, 2, 4, 3, device="meta"))
    assert S.shape == (M, 2, 4, 3) and final.shape == (4, 2, 4, 3)


def test_scan_without_host_sync():
    cu = _cu([5, 200, 0, 70])
    tab = build_segment_tables(cu, 64, T=275)
    P = torch.randn(tab.M, 2, 4, 4, dtype=torch.float64) / 4
    Q = torch.randn(tab.M, 2, 4, 3, dtype=torch.float64)
    h0 = torch.randn(4, 2, 4, 3, dtype=torch.float64)
    expect = scan_segment_states(P, Q, tab, 275, h0)
    with _no_host_reads():
        got = scan_segment_states(P, Q, tab, 275, h0)
    assert all(torch.equal(a, b) for a, b in zip(got, expect))


# -------------------------------------------------------------------------------------------- cache


def test_cache_keys_static_facts_and_follows_in_place_edits():
    clear_plan_cache()
    cu = _cu([100, 300, 0, 150])
    T = 550
    q = torch.zeros(1, T, 2, 16)
    v = torch.zeros(1, T, 4, 128)
    kw = dict(force=True, segment_len=128, sm_count_override=132)
    key = plan_key(q, v, cu, **kw)
    assert not any(isinstance(x, torch.Tensor) for x in key)
    plan1, tab1 = _plan_and_tables(q, v, cu, **kw)
    _check_tables(tab1, cu.tolist(), T, 128)
    before = plan_cache_info()
    cu[1:4] = torch.tensor([400, 410, 420], dtype=cu.dtype)  # same buffer, new lengths 400, 10, 10, 130
    plan2, tab2 = _plan_and_tables(q, v, cu, **kw)
    after = plan_cache_info()
    assert after.hits == before.hits + 1 and after.misses == before.misses  # served from the cache
    assert plan2 is plan1
    _check_tables(tab2, cu.tolist(), T, 128)  # ... and the tables follow the new values
    assert not torch.equal(tab1.cu_seqlens, tab2.cu_seqlens)
    assert plan_key(q, v, cu, **kw) == key
    # a fresh tensor with the same values and a copy elsewhere give the same key too
    assert plan_key(q, v, cu.clone(), **kw) == key
    # static facts do change the key
    assert plan_key(q, v, cu.to(torch.int64), **kw) != key
    assert plan_key(q, v, cu, **{**kw, "sm_count_override": 114}) != key
    assert plan_key(q, v, cu, **{**kw, "exact": True}) != key
    assert plan_key(q.double(), v, cu, **kw) != key


def test_unsplit_plan_has_no_tables():
    q = torch.zeros(1, 1024, 16, 16)
    v = torch.zeros(1, 1024, 64, 128)
    plan, tab = _plan_and_tables(q, v, _cu([512, 512]), sm_count_override=132)
    assert not plan.split and tab is None


# -------------------------------------------------------------------------- exact CP forward in fp64


def _segmented_forward(d, tab, T_row, scale, first_from_h0=False):
    """The exact CP forward assembled from the reference's stages on the planner's segments:
    segment run (pseudo cu_seqlens; from zero, or from h0[h0_index] on first segments), maps (CP-1),
    the planner's combine scan (CP-2), output correction (CP-3). With first_from_h0, P is poisoned
    (NaN) on every slot the tables say needs no transition (last slots keep theirs for the final
    state), and only need_correction slots are corrected."""
    flat = lambda x: x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])  # noqa: E731
    q, k, v, g, beta = (flat(d[n]) for n in ("q", "k", "v", "g", "beta"))
    pcu = tab.cu_seqlens.to(torch.int64)
    lay = prepare_chunk_layout(1, q.shape[1], pcu, 64, q.device)
    g_cum = from_chunks(gate_cumsum(to_chunks(g, lay, dtype=torch.float64)), lay)
    h0 = d["initial_state"]
    h0_slots = None
    if first_from_h0 and h0 is not None:
        h0_slots = torch.where((tab.h0_index >= 0)[:, None, None, None], h0[tab.h0_index.clamp(min=0)], 0.0)
    run = fused_chunk_fwd(q, k, v, g_cum, beta, scale, h0_slots, pcu, 64)
    P, Q0 = segment_maps(k, v, g, beta, pcu, 64)
    Q = Q0
    if first_from_h0:
        Q = run["final_state"]
        P = torch.where((tab.need_transition | tab.last)[:, None, None, None], P, float("nan"))
    S_start, final = scan_segment_states(P, Q, tab, T_row * d["q"].shape[0], h0, first_from_h0=first_from_h0)
    if first_from_h0:
        S_start = torch.where(tab.need_correction[:, None, None, None], S_start, 0.0)
    o = run["o"] + output_correction(q, k, g, beta, S_start, scale, pcu, 64)
    return o.reshape(d["v"].shape), final


def _rel(a, b):
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


@pytest.mark.parametrize(
    "lengths,L",
    [
        ([300], 128),  # T not a multiple of 64, split in three
        ([0, 130, 0, 7, 257, 0], 128),  # empty first / middle / last, one short, two split
        ([5, 0, 63, 1, 64, 130], 64),  # only the last two split
        ([200, 45], 192),  # a segment longer than the short sequence
    ],
)
@pytest.mark.parametrize("first_from_h0", [False, True])
def test_exact_cp_on_planner_segments_fp64(lengths, L, first_from_h0):
    T = sum(lengths)
    d = make_gdn_inputs(1, T, 1, 2, 32, 16, seqlens=lengths, dtype=torch.float64, seed=len(lengths) + L)
    cu = d["cu_seqlens"]
    scale = 32**-0.5
    o_ref, ht_ref = recurrent_gated_delta_rule(
        d["q"], d["k"], d["v"], d["g"], d["beta"], scale, d["initial_state"], True, cu
    )
    tab = build_segment_tables(cu, L, T=T)
    _check_tables(tab, cu.tolist(), T, L)
    o, ht = _segmented_forward(d, tab, T, scale, first_from_h0)
    assert _rel(o, o_ref) <= 1e-12, ("o", _rel(o, o_ref))
    assert _rel(ht, ht_ref) <= 1e-12, ("final_state", _rel(ht, ht_ref))
    # reference.gdn.cp's own exact CP forward on the same segment length agrees too
    o_cp, ht_cp = cp_gated_delta_rule_fwd(
        d["q"], d["k"], d["v"], d["g"], d["beta"], scale, d["initial_state"], True, cu, segment_len=L
    )
    assert _rel(o, o_cp) <= 1e-12 and _rel(ht, ht_cp) <= 1e-12


@pytest.mark.parametrize("first_from_h0", [False, True])
def test_exact_cp_fixed_length_rows_fp64(first_from_h0):
    B, T, L = 2, 150, 64
    d = make_gdn_inputs(B, T, 1, 2, 32, 16, dtype=torch.float64, seed=7)
    scale = 32**-0.5
    o_ref, ht_ref = recurrent_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], scale, d["initial_state"], True)
    tab = build_segment_tables(None, L, T=T, B=B)
    o, ht = _segmented_forward(d, tab, T, scale, first_from_h0)
    assert _rel(o, o_ref) <= 1e-12 and _rel(ht, ht_ref) <= 1e-12


@pytest.mark.parametrize("HV", [2, 8, 16, 32, 48, 64, 128])
@pytest.mark.parametrize("N,T,hint", [(1, 8192, None), (2, 32768, 28672), (4, 32768, None), (8, 8192, 4096)])
def test_unsplit_plan_prices_the_width_the_launch_runs(HV, N, T, hint):
    """A plan that does not split reports (and is costed at) the value slice width the unsplit launch
    runs at, `recurrent.pick_block_v`: pricing the cheaper width instead once kept 16/64 28672 + 4096
    unsplit at a predicted BV = 64 cost while the launch ran BV = 128 (1.79 against 1.60 ms split)."""
    from flashqla.cp.plan import _unsplit_time
    from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v

    p = plan_cp(HV, N, T, 128, 132, exact=True, max_seqlen=hint)
    bv = pick_block_v(N, HV, 128, 132)
    l_max = hint or -(-T // N)
    assert p.est_unsplit == pytest.approx(_unsplit_time(bv, HV, 128, N, min(-(-T // N), l_max), l_max, 132))
    if not p.split:
        assert p.BV == bv, p


def test_plan_ab_rows_changed_by_a_candidate_constant():
    """benchmarks/experiments/cp_plan_ab.py --changed-by: the grid rows whose plan a candidate constant
    changes, each with its plan now and the candidate's; the planner's constants are restored afterwards."""
    from benchmarks.experiments.cp_plan_ab import changed_rows, grid_plans
    from flashqla.cp import plan as P

    before = (dict(P.CHUNK_COST), dict(P.UNSPLIT_CHUNK_COST), P.HEAD_OVERHEAD)
    assert changed_rows(f"CHUNK_COST[128]={P.CHUNK_COST[128]}") == []
    # the constants before the last refit: the rows it changed come back as they were
    specs = changed_rows("CHUNK_COST[128]=1.0,UNSPLIT_CHUNK_COST[64]=0.58,HEAD_OVERHEAD=0.25")
    assert (dict(P.CHUNK_COST), dict(P.UNSPLIT_CHUNK_COST), P.HEAD_OVERHEAD) == before
    now = grid_plans()
    assert specs and all(s.count(":") == 2 for s in specs)
    for spec in specs:
        row, old, new = spec.split(":")
        assert now[row] == old != new
    # measured 0.262 ms unsplit against 0.308 split at 4c5bf31 (planner.py, now plan.py, UNSPLIT_CHUNK_COST)
    assert "8/32 1x8192:off:2048/128" in specs
    with pytest.raises(SystemExit, match="cannot read"):
        changed_rows("NOT_A_CONSTANT=1")

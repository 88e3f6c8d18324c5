"""Adversarial CPU checks of the split path's gate-driven transition cut (fp64 reference backend).

Covered: `resolve_truncate` and $FLASHQLA_CP_EXACT, `_transition_limits_torch` / `transition_limits`
and `_keep_rows` against brute-force Python loops, `cp_forward` / `cp_backward` with a cut against
exact mode (CP-4 / CP-5 bound, g == 0 heads bitwise, no NaN) on awkward but valid inputs (T not a
multiple of 64, one-chunk segments, sequences shorter than a chunk, empty sequences anywhere, many
tiny sequences, packed tails, batch rows, g == 0 everywhere, g = -1e4, extreme cutoffs, K != V, no
initial state, no final state), a CPU emulation of the sm_90 dual launch (rows it does not write are
NaN), the public entry points' `truncate=` argument, and the planner's dual-launch cost model over a
grid of shapes.

Defects found here were fixed; their tests are regressions (see each docstring).
"""

from __future__ import annotations

import math
import random

import pytest
import torch

import flashqla.cp.forward as cp_fwd_mod
import flashqla.cp.plan as planner
from flashqla.contract import CHUNK, EXACT_ENV, TRUNCATE_LOG_DECAY, resolve_truncate
from flashqla.cp import build_segment_tables, cp_backward, cp_forward
from flashqla.cp.forward import _keep_rows, _transition_limits_torch, transition_limits
from flashqla.cp.plan import BWD_MIN_GAIN, MIN_GAIN, clear_plan_cache, plan_cp
from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd
from flashqla.testing import make_gdn_inputs
from reference.gdn.chunk import floor_gates
from reference.gdn.cp import ReferenceCPBackend
from reference.gdn.recurrent import recurrent_gated_delta_rule

F64 = torch.float64


# ------------------------------------------------------------------------------------------------
# inputs
# ------------------------------------------------------------------------------------------------


def _offsets(lengths):
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + int(n))
    return cu


def _inputs(B, T, cu=None, *, H=1, HV=4, K=16, V=16, h0=True, gates="mixed", seed=0):
    """Valid inputs; cu: None (B rows of T tokens) or a list of offsets (B == 1, cu[-1] <= T).

    gates "mixed": head 0 g == 0, head 1 a moderate random decay (chunk sums around -1 .. -15, so
    cuts land inside segments), head 2 g = -1e4 (below the floor), head 3 Qwen3-Next gates; other
    values: make_gdn_inputs' gate argument (special heads off)."""
    mixed = gates == "mixed"
    d = make_gdn_inputs(B, T, H, HV, K, V, initial_state=False, dtype=F64, seed=seed,
                        gate="qwen3next" if mixed else gates, special_heads=False)
    if cu is not None:
        d["cu_seqlens"] = torch.tensor(cu, dtype=torch.int32)
    N = B if cu is None else len(cu) - 1
    gen = torch.Generator().manual_seed(seed + 101)
    if mixed:
        g = d["g"].clone()
        g[..., 0] = 0.0
        if HV > 1:
            g[..., 1] = -0.25 * torch.rand(B, T, generator=gen, dtype=F64) ** 2
        if HV > 2:
            g[..., 2] = -1e4
        d["g"] = g
    d["initial_state"] = torch.randn(N, HV, K, V, generator=gen, dtype=F64) if h0 else None
    return d


def _tables(d, L):
    B, T = d["q"].shape[:2]
    cu = d["cu_seqlens"]
    return build_segment_tables(cu, L, T=T, B=B)


def _scale(d):
    return d["q"].shape[-1] ** -0.5


def _fwd(d, L, truncate, *, backend=None, final=True, correction="gemm"):
    tab = _tables(d, L)
    be = backend or ReferenceCPBackend()
    return cp_forward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], _scale(d), d["initial_state"], final,
                      d["cu_seqlens"], tab, block_v=None, truncate=truncate, correction=correction)


def _prepare(d, tab):
    HV = d["v"].shape[2]
    flat = lambda x: x.reshape(1, -1, *x.shape[2:])  # noqa: E731
    return ReferenceCPBackend().prepare(flat(d["k"]), flat(d["g"]), flat(d["beta"]), tab.cu_seqlens, HV)


def _nchunks(tab):
    return -(-(tab.end - tab.start) // CHUNK)


def _brute_limits(g_flat, tab, cutoff):
    """[M, HV]: walk each corrected slot chunk by chunk in Python, summing the floored g (natural log)."""
    g = floor_gates(g_flat)
    HV = g.shape[1]
    out = torch.zeros(tab.M, HV, dtype=torch.int64)
    for j in range(tab.M):
        if not bool(tab.need_correction[j]):
            continue
        a, b = int(tab.start[j]), int(tab.end[j])
        n = -(-(b - a) // CHUNK)
        for h in range(HV):
            total, lim = 0.0, n
            for c in range(n):
                total += float(g[a + CHUNK * c: min(a + CHUNK * (c + 1), b), h].sum())
                if cutoff is not None and total < cutoff:
                    lim = c + 1
                    break
            out[j, h] = lim
    return out


def _brute_keep(tab, limit, total):
    HV = limit.shape[1]
    keep = torch.zeros(total, HV, dtype=torch.bool)
    for j in range(tab.M):
        a, b = int(tab.start[j]), int(tab.end[j])
        for t in range(a, b):
            for h in range(HV):
                if (t - a) // CHUNK < int(limit[j, h]):
                    keep[t, h] = True
    return keep


# (name, B, T, offsets or None, L)
LAYOUTS = [
    ("T%64", 1, 333, None, 128),  # T not a multiple of 64 (a partial last chunk)
    ("one-chunk-segments", 1, 300, None, 64),
    ("short-seqs", 1, 400, _offsets([10, 63, 1, 326]), 128),  # sequences shorter than a chunk
    ("empties", 1, 400, _offsets([0, 150, 0, 250, 0]), 128),  # empty first, middle, last
    ("tiny-many", 1, 420, _offsets([3, 0, 70, 1, 0, 64, 65, 2, 0, 127, 5, 83]), 64),
    ("tail-one-seq", 1, 400, [0, 290], 128),  # packed tail, N == 1 (the fast paths)
    ("tail-multi", 1, 450, [0, 130, 130, 333], 128),
    ("batch-rows", 3, 200, None, 128),
    ("batch-short", 2, 65, None, 64),  # rows of one chunk and one token
    ("all-empty", 1, 128, [0, 0, 0], 64),  # every sequence empty, a packed tail
    ("T0", 1, 0, [0, 0], 64),
]


def _layout_inputs(name, B, T, cu, L, **kw):
    return _inputs(B, T, cu, seed=sum(map(ord, name)) % 97, **kw)


# ------------------------------------------------------------------------------------------------
# the truncate argument and the environment variable
# ------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("value,want", [
    (True, TRUNCATE_LOG_DECAY), (False, None), (-10, -10.0), (-1e-6, -1e-6), (-1e6, -1e6), (-700, -700.0),
    (-1e-320, -1e-320), (-1.7e308, -1.7e308),
])
def test_resolve_truncate_accepts(value, want, monkeypatch):
    monkeypatch.delenv(EXACT_ENV, raising=False)
    got = resolve_truncate(value)
    assert got == want and (got is None or type(got) is float)


@pytest.mark.parametrize("bad", [0, 0.0, -0.0, 1, 3.5, float("nan"), float("inf"), float("-inf"), "yes", "-10",
                                 [-10], object()])
def test_resolve_truncate_rejects_with_valueerror(bad):
    with pytest.raises(ValueError, match="truncate"):
        resolve_truncate(bad)


def test_resolve_truncate_non_builtin_numbers():
    """Real numbers of other types (numpy scalars) are accepted as cutoffs; tensors and numpy bools are
    not real numbers: rejected with the ValueError naming truncate."""
    np = pytest.importorskip("numpy")
    for ok in (np.float64(-10.0), np.float32(-10.0), np.int64(-10)):
        got = resolve_truncate(ok)
        assert got == -10.0 and type(got) is float
    for other in (torch.tensor(-10.0), np.bool_(True), np.float64("nan")):
        with pytest.raises(ValueError, match="truncate"):
            resolve_truncate(other)


def test_resolve_truncate_huge_negative_int():
    """An int beyond float's range is not a finite log-decay: the ValueError naming truncate (it raised
    OverflowError before)."""
    with pytest.raises(ValueError, match="truncate"):
        resolve_truncate(-(10**400))


@pytest.mark.parametrize("env,exact", [("1", True), ("true", True), ("True", True), ("TRUE", True), ("yes", True),
                                       (" on ", True), ("0", False), ("", False), ("false", False), ("No", False),
                                       ("off", False)])
def test_exact_env_values(env, exact, monkeypatch):
    """$FLASHQLA_CP_EXACT, case-insensitive and blank-tolerant: 1/true/yes/on turn the cut off, empty,
    0/false/no/off keep it. Explicit arguments win over the variable."""
    monkeypatch.setenv(EXACT_ENV, env)
    assert resolve_truncate(None) == (None if exact else TRUNCATE_LOG_DECAY)
    assert resolve_truncate(True) == TRUNCATE_LOG_DECAY
    assert resolve_truncate(False) is None
    assert resolve_truncate(-3.0) == -3.0


@pytest.mark.parametrize("env", ["2", "exact", "maybe", "1 0"])
def test_exact_env_odd_values_raise(env, monkeypatch):
    monkeypatch.setenv(EXACT_ENV, env)
    with pytest.raises(ValueError, match=EXACT_ENV):
        resolve_truncate(None)
    assert resolve_truncate(False) is None  # an explicit argument does not read the variable


def _entry_inputs(T=300, seqlens=None, seed=0):
    # the public entry points plan with V a multiple of 64; heads: g == 0, Qwen3-Next, strong decay
    return make_gdn_inputs(1, T, 1, 3, 16, 64, seqlens=seqlens, initial_state=True, dtype=F64, seed=seed)


def test_entry_point_env_and_argument(monkeypatch):
    d = _entry_inputs(320)
    run = lambda **kw: chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="on", segment_len=128,  # noqa: E731
                                                  backend=ReferenceCPBackend(), return_info=True, **kw)
    monkeypatch.delenv(EXACT_ENV, raising=False)
    out_d, info_d = run()
    tab = info_d.tables
    nch = _nchunks(tab)
    corr = tab.need_correction
    assert bool((info_d.transition_chunks[corr, -1] == 1).all())  # strong decay: cut after its first chunk
    assert torch.equal(info_d.transition_chunks[corr, 0].long(), nch[corr])  # g == 0: never cut
    monkeypatch.setenv(EXACT_ENV, "1")
    out_x, info_x = run()
    assert torch.equal(info_x.transition_chunks[corr].long(), nch[corr][:, None].expand(-1, 3))
    assert torch.equal(info_x.transition_chunks[~corr], torch.zeros_like(info_x.transition_chunks[~corr]))
    out_t, info_t = run(truncate=True)  # the argument wins over the variable
    assert torch.equal(info_t.transition_chunks, info_d.transition_chunks)
    assert torch.equal(out_t.o, out_d.o) and torch.equal(out_t.final_state, out_d.final_state)
    monkeypatch.delenv(EXACT_ENV)
    out_f, info_f = run(truncate=False)
    assert torch.equal(info_f.transition_chunks, info_x.transition_chunks) and torch.equal(out_f.o, out_x.o)
    assert torch.equal(out_d.o[..., 0, :], out_x.o[..., 0, :])


@pytest.mark.parametrize("bad", [0, 2.0, float("nan"), "on"])
def test_bad_truncate_raises_on_split_entry_points(bad):
    d = _entry_inputs(256)
    be = ReferenceCPBackend()
    with pytest.raises(ValueError, match="truncate"):
        chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="on", segment_len=128, backend=be, truncate=bad)
    f = chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="on", segment_len=128, backend=be)
    do = torch.randn_like(d["v"])
    with pytest.raises(ValueError, match="truncate"):
        chunk_gated_delta_rule_bwd(f.q, f.k, d["v"], d["g"], d["beta"], f.A, f.g_cum_log2, do, None, None,
                                   d["initial_state"], None, cp="on", segment_len=128, backend=be, truncate=bad)


@pytest.mark.parametrize("which", ["fwd", "bwd", "gated"])
def test_bad_truncate_raises_when_not_split(which):
    """truncate is checked before planning, like correction and gate_chunks (it was checked only on the
    split exact path before)."""
    d = _entry_inputs(256)
    be = ReferenceCPBackend()
    if which == "gated":  # split, but the gate-driven mode never reads truncate
        with pytest.raises(ValueError, match="truncate"):
            chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="on", segment_len=128, gate_chunks=1,
                                       backend=be, truncate=0)
    elif which == "fwd":
        with pytest.raises(ValueError, match="truncate"):
            chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="off", backend=be, truncate=0)
    else:
        f = chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="off", backend=be)
        with pytest.raises(ValueError, match="truncate"):
            chunk_gated_delta_rule_bwd(f.q, f.k, d["v"], d["g"], d["beta"], f.A, f.g_cum_log2, torch.ones_like(d["v"]),
                                       None, None, d["initial_state"], None, cp="off", backend=be, truncate=0)


# ------------------------------------------------------------------------------------------------
# limits and kept rows against brute force
# ------------------------------------------------------------------------------------------------

CUTOFFS = [None, -1e-6, -0.5, -10.0, TRUNCATE_LOG_DECAY, -700.0, -1e6]


@pytest.mark.parametrize("name,B,T,cu,L", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_limits_equal_brute_force(name, B, T, cu, L):
    d = _layout_inputs(name, B, T, cu, L)
    tab = _tables(d, L)
    _, G2 = _prepare(d, tab)
    g_flat = d["g"].reshape(B * T, d["g"].shape[-1])
    nch = _nchunks(tab)
    corr = tab.need_correction
    for cutoff in CUTOFFS:
        got = _transition_limits_torch(G2, tab, cutoff)
        assert got.dtype == torch.int32 and got.is_contiguous() and tuple(got.shape) == (tab.M, 4)
        assert torch.equal(got, transition_limits(G2, tab, cutoff))  # CPU: the torch function
        want = _brute_limits(g_flat, tab, cutoff)
        assert torch.equal(got.long(), want), (cutoff, got, want)
        assert bool((got[~corr] == 0).all())
        assert bool((got[corr] >= 1).all()) and bool((got[corr].long() <= nch[corr, None]).all())
        assert torch.equal(got[corr, 0].long(), nch[corr])  # g == 0 never cuts, whatever the cutoff
        if cutoff is not None and cutoff > -64000:
            assert bool((got[corr, 2] == 1).all())  # g = -1e4 (floored -1000): the first chunk passes it


def test_limits_with_raw_gates_never_shorter():
    """The count uses the floored g (g >= -1000): against raw g = -1e4 it walks longer (never shorter)
    for cutoffs below one floored chunk (-64000): -1e6 needs 16 floored chunks."""
    d = _inputs(1, 64 * 20, None, HV=3, seed=4)
    tab = _tables(d, 64 * 20 - 64 * 2)
    _, G2 = _prepare(d, tab)
    got = _transition_limits_torch(G2, tab, -1e6)
    corr = tab.need_correction
    assert int(got[corr, 2].min()) == 2  # slot 1 has 2 chunks: -128000 > -1e6, never cut


@pytest.mark.parametrize("B,T,cu", [(0, 100, None), (1, 0, [0, 0, 0]), (1, 128, [0, 0, 0]), (2, 0, None)])
def test_limits_and_keep_rows_on_empty_layouts(B, T, cu):
    tab = build_segment_tables(None if cu is None else torch.tensor(cu), 64, T=T, B=B)
    HV = 3
    S = (B * T) // CHUNK + tab.M
    G2 = torch.zeros(HV, S * CHUNK, dtype=F64)
    for cutoff in (None, -1.0):
        lim = _transition_limits_torch(G2, tab, cutoff)
        assert tuple(lim.shape) == (tab.M, HV) and not bool(lim.any())
        keep = _keep_rows(tab, lim, B * T)
        assert tuple(keep.shape) == (B * T, HV) and not bool(keep.any())


@pytest.mark.parametrize("name,B,T,cu,L", LAYOUTS, ids=[x[0] for x in LAYOUTS])
def test_keep_rows_equal_brute_force(name, B, T, cu, L):
    tab = build_segment_tables(None if cu is None else torch.tensor(cu, dtype=torch.int32), L, T=T, B=B)
    nch = _nchunks(tab)
    rng = random.Random(len(name))
    HV = 3
    for trial in range(3):
        lim = torch.zeros(tab.M, HV, dtype=torch.int32)
        for j in range(tab.M):
            for h in range(HV):
                lim[j, h] = rng.randint(0, int(nch[j])) if trial else int(nch[j])
        got = _keep_rows(tab, lim, B * T)
        assert got.dtype == torch.bool and tuple(got.shape) == (B * T, HV)
        assert torch.equal(got, _brute_keep(tab, lim, B * T))
    if cu is not None and cu[-1] < T:  # rows past the packed sequences are never kept
        assert not bool(_keep_rows(tab, nch[:, None].expand(-1, HV).to(torch.int32), B * T)[cu[-1]:].any())


def test_limits_single_chunk_tie_does_not_cut():
    """Chunk sums exactly equal to the cutoff (dyadic g, so every summation order is exact) do not
    count as below it: the walk goes on to the next chunk."""
    T, L = 512, 128
    xs = [-n / 8 for n in range(1, 161)]  # per-chunk decay, head h
    HV = len(xs)
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, 8, dtype=F64, generator=torch.Generator().manual_seed(0)), dim=-1)
    g = torch.tensor([x / 64 for x in xs], dtype=F64)[None, None].expand(1, T, HV).contiguous()
    tab = build_segment_tables(None, L, T=T, B=1)
    _, G2 = ReferenceCPBackend().prepare(k, g, torch.full((1, T, HV), 0.5, dtype=F64), tab.cu_seqlens, HV)
    for h, x in enumerate(xs):
        lim = _transition_limits_torch(G2[h: h + 1], tab, x)
        assert lim[tab.need_correction, 0].tolist() == [2, 2, 2], (x, lim)


def test_limits_multi_chunk_tie_within_rounding():
    """A summed decay exactly equal to the cutoff after several chunks: the count sums the prepare
    products' fp32 chunk totals in log2 units against cutoff / ln 2, so an exact tie may count as
    below (the documented rounding: the walk stops at most one chunk early, and only within fp32
    rounding of the cutoff); one ulp of margin either way decides as the rule says."""
    T, L = 1024, 512
    x = -4.8125  # per-chunk decay; g = x / 64 is exact in binary, so every natural-log sum is exact
    k = torch.nn.functional.normalize(torch.randn(1, T, 1, 8, dtype=F64, generator=torch.Generator().manual_seed(0)), dim=-1)
    g = torch.full((1, T, 1), x / 64, dtype=F64)
    tab = build_segment_tables(None, L, T=T, B=1)
    _, G2 = ReferenceCPBackend().prepare(k, g, torch.full((1, T, 1), 0.5, dtype=F64), tab.cu_seqlens, 1)
    cutoff = 3 * x  # == the summed decay of chunks 0..2 exactly
    assert _brute_limits(g.reshape(T, 1), tab, cutoff)[1, 0] == 4
    assert int(_transition_limits_torch(G2, tab, cutoff)[1, 0]) in (3, 4)
    assert int(_transition_limits_torch(G2, tab, cutoff * (1 + 1e-5))[1, 0]) == 4  # clearly above: goes on
    assert int(_transition_limits_torch(G2, tab, cutoff * (1 - 1e-5))[1, 0]) == 3  # clearly below: stops


# ------------------------------------------------------------------------------------------------
# forward: cut against exact
# ------------------------------------------------------------------------------------------------


def _check_cut(d, L, cutoff, out_x, out_t):
    """Finite; head 0 (g == 0) bitwise; transition_chunks as brute force; P 0 exactly where cut; the
    CP-4 / CP-5 bound per token (on the sequences' tokens) and per final state."""
    o_x, ht_x, _, _, info_x = out_x
    o_t, ht_t, _, _, info_t = out_t
    B, T = d["q"].shape[:2]
    HV = d["v"].shape[2]
    end = T if d["cu_seqlens"] is None else int(d["cu_seqlens"][-1])
    tab = info_t.tables
    assert bool(torch.isfinite(o_t[:, :end]).all())
    want = _brute_limits(d["g"].reshape(B * T, d["g"].shape[-1]), tab, cutoff)
    assert torch.equal(info_t.transition_chunks.long(), want)
    cut = info_t.transition_chunks < _nchunks(tab)[:, None]
    assert not bool(info_t.P[cut].any())
    assert torch.equal(o_t[:, :end, 0], o_x[:, :end, 0])
    if ht_x is not None:
        assert bool(torch.isfinite(ht_t).all())
        assert torch.equal(ht_t[:, 0], ht_x[:, 0])
    G = cutoff
    smax = float(info_x.S_in.flatten(2).norm(dim=-1).max()) if tab.M else 0.0
    qn = d["q"].norm(dim=-1)
    qn = qn.repeat_interleave(HV // qn.shape[-1], dim=-1)  # [B, T, HV]
    dev = (o_t - o_x).norm(dim=-1)[:, :end]
    bound = 2 * _scale(d) * qn[:, :end] * math.exp(G) * smax * (1 + 1e-9) + 1e-12
    assert bool((dev <= bound).all()), float((dev - bound).max())
    if ht_x is not None:
        assert bool(((ht_t - ht_x).flatten(2).norm(dim=-1) <= math.exp(G) * smax * (1 + 1e-9) + 1e-12).all())
    return cut


@pytest.mark.parametrize("name,B,T,cu,L", LAYOUTS, ids=[x[0] for x in LAYOUTS])
@pytest.mark.parametrize("cutoff", [-10.0, -1e-6, -700.0])
def test_forward_cut_within_bound(name, B, T, cu, L, cutoff):
    d = _layout_inputs(name, B, T, cu, L)
    out_x = _fwd(d, L, False)
    out_t = _fwd(d, L, cutoff)
    cut = _check_cut(d, L, cutoff, out_x, out_t)
    tab = out_t[4].tables
    if cutoff == -1e-6 and bool((_nchunks(tab)[tab.need_correction] >= 2).any()):
        assert bool(cut[:, 1:].any())  # any decay at all passes -1e-6 within a chunk: cuts happen


@pytest.mark.parametrize("name,B,T,cu,L", [LAYOUTS[0], LAYOUTS[4], LAYOUTS[5]], ids=["T%64", "tiny-many", "tail-one-seq"])
def test_forward_exact_mode_equals_recurrence(name, B, T, cu, L):
    d = _layout_inputs(name, B, T, cu, L)
    o, ht, *_ = _fwd(d, L, False)
    end = T if cu is None else cu[-1]
    x = {n: d[n][:, :end] for n in ("q", "k", "v", "g", "beta")}
    o_ref, ht_ref = recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], _scale(d), d["initial_state"],
                                               True, d["cu_seqlens"])
    assert float((o[:, :end] - o_ref).abs().max()) <= 1e-10 and float((ht - ht_ref).abs().max()) <= 1e-10
    # the default cut (ln 2^-24) stays within fp32 rounding of the truth
    o_d, ht_d, *_ = _fwd(d, L, True)
    assert float((o_d[:, :end] - o_ref).abs().max()) <= 1e-6 and float((ht_d - ht_ref).abs().max()) <= 1e-6


@pytest.mark.parametrize("cutoff", [-1e-6, -10.0, TRUNCATE_LOG_DECAY, -1e6])
def test_zero_gates_everywhere_bitwise(cutoff):
    d = _inputs(1, 400, _offsets([0, 150, 1, 249]), gates="zero", seed=2)
    out_x = _fwd(d, 64, False)
    out_t = _fwd(d, 64, cutoff)
    assert torch.equal(out_t[0], out_x[0]) and torch.equal(out_t[1], out_x[1])
    tab = out_t[4].tables
    assert torch.equal(out_t[4].transition_chunks.long(), (_nchunks(tab) * tab.need_correction)[:, None].expand(-1, 4))


@pytest.mark.parametrize("cutoff", [-1e-6, -700.0, -1e6])
def test_strong_decay_everywhere(cutoff):
    """g = -1e4 on every head: the decay over a chunk is exactly 0, so cutting after the first chunk
    drops nothing representable."""
    d = _inputs(1, 333, _offsets([0, 200, 133]), gates=-1e4, seed=3)
    out_x = _fwd(d, 128, False)
    out_t = _fwd(d, 128, cutoff)
    assert bool(torch.isfinite(out_t[0]).all()) and bool(torch.isfinite(out_t[1]).all())
    tab = out_t[4].tables
    corr = tab.need_correction
    lim = out_t[4].transition_chunks[corr].long()
    # a floored chunk sums to -64000: -1e6 is not reached within these 2-chunk segments
    want = torch.ones_like(lim) if cutoff > -64000 else _nchunks(tab)[corr][:, None].expand_as(lim)
    assert torch.equal(lim, want)
    assert float((out_t[0] - out_x[0]).abs().max()) <= 1e-12 and float((out_t[1] - out_x[1]).abs().max()) <= 1e-12


@pytest.mark.parametrize("K,V", [(32, 16), (16, 32)])
@pytest.mark.parametrize("h0,final", [(False, True), (True, False), (False, False)])
def test_forward_k_ne_v_no_h0_no_final(K, V, h0, final):
    d = _inputs(1, 390, _offsets([0, 260, 7, 123]), K=K, V=V, HV=3, h0=h0, seed=K + V)
    out_x = _fwd(d, 128, False, final=final)
    out_t = _fwd(d, 128, -10.0, final=final)
    assert (out_t[1] is None) == (not final)
    _check_cut(d, 128, -10.0, out_x, out_t)


def test_rerun_correction_with_cut():
    """correction='rerun' reads only the (cut) entering states: within exp(G) max ||S_in|| per state."""
    d = _inputs(1, 512, None, seed=7)
    G = -3.0
    o_x, ht_x, _, _, info_x = _fwd(d, 128, False, correction="rerun")
    o_t, ht_t, _, _, info_t = _fwd(d, 128, G, correction="rerun")
    o_g, ht_g, *_ = _fwd(d, 128, G)
    smax = float(info_x.S_in.flatten(2).norm(dim=-1).max())
    assert bool(torch.isfinite(o_t).all())
    assert torch.equal(o_t[..., 0, :], o_x[..., 0, :]) and torch.equal(ht_t[:, 0], ht_x[:, 0])
    assert float((info_t.S_in - info_x.S_in).flatten(2).norm(dim=-1).max()) <= math.exp(G) * smax * (1 + 1e-9)
    qn = d["q"].norm(dim=-1).expand(-1, -1, 4)
    assert bool(((o_t - o_x).norm(dim=-1) <= _scale(d) * qn * math.exp(G) * smax * (1 + 1e-9) + 1e-12).all())
    assert torch.allclose(ht_t, ht_g, rtol=0, atol=1e-12)


def test_one_sequence_fast_path_equals_general_path_with_cut(monkeypatch):
    d = _inputs(1, 400, [0, 290], seed=8)
    outs = []
    for fast in (True, False):
        monkeypatch.setattr(cp_fwd_mod, "ONE_SEQUENCE_FAST_PATH", fast)
        outs.append(_fwd(d, 128, -10.0))
    (o1, h1, *_), (o2, h2, *_) = outs
    assert float((o1[:, :290] - o2[:, :290]).abs().max()) <= 1e-13 and float((h1 - h2).abs().max()) <= 1e-13


class _DualEmulation(ReferenceCPBackend):
    """The sm_90 dual launch's contract on CPU: run and transition in one call; U rows outside the walked
    chunks (past a limit, of slots with limit 0, past the last pseudo offset) and o rows past it are
    left unwritten (NaN here), P is 0 where a limit cut the walk short."""

    def recurrent_dual(self, q, k, v, A, G2, scale, h0, limit, cu, block_v=None, o=None):
        o_run, Q = self.recurrent(q, k, v, A, G2, scale, h0, True, cu, block_v)
        M, HV = limit.shape
        K = k.shape[3]
        eye = torch.eye(K, dtype=self.state_dtype)
        h0_tr = torch.where((limit > 0)[:, :, None, None], eye, torch.zeros((), dtype=self.state_dtype)).contiguous()
        U, P = self.recurrent(q, k, torch.zeros(*v.shape[:3], K, dtype=v.dtype), A, G2, scale, h0_tr, True, cu, block_v)
        cuh = [int(x) for x in cu]
        U = U.clone()
        written = torch.zeros(U.shape[1], HV, dtype=torch.bool)
        for j in range(M):
            a, b = cuh[j], cuh[j + 1]
            for t in range(a, b):
                written[t] = (t - a) // CHUNK < limit[j]
        U[0][~written] = float("nan")
        o_run = o_run.clone()
        o_run[:, cuh[-1]:] = float("nan")
        nch = torch.tensor([-(-(cuh[j + 1] - cuh[j]) // CHUNK) for j in range(M)])
        P = torch.where((limit < nch[:, None])[:, :, None, None], torch.zeros((), dtype=P.dtype), P)
        if o is not None:
            o.copy_(o_run)
            o_run = o
        return o_run, Q, U, P


@pytest.mark.parametrize("name,B,T,cu,L", [LAYOUTS[2], LAYOUTS[3], LAYOUTS[5], LAYOUTS[6], LAYOUTS[7]],
                         ids=["short-seqs", "empties", "tail-one-seq", "tail-multi", "batch-rows"])
@pytest.mark.parametrize("cutoff", [False, -10.0])
def test_dual_launch_unwritten_rows_never_read(name, B, T, cu, L, cutoff, monkeypatch):
    d = _layout_inputs(name, B, T, cu, L)
    end = T if cu is None else cu[-1]
    o2, h2, _, _, i2 = _fwd(d, L, cutoff)
    o1, h1, _, _, i1 = _fwd(d, L, cutoff, backend=_DualEmulation())
    assert bool(torch.isfinite(o1[:, :end]).all()) and bool(torch.isfinite(h1).all())
    assert float((o1[:, :end] - o2[:, :end]).abs().max()) <= 1e-13 and float((h1 - h2).abs().max()) <= 1e-13
    # backward through the same launches
    gen = torch.Generator().manual_seed(9)
    do = torch.randn(d["v"].shape, generator=gen, dtype=F64)
    tab = _tables(d, L)
    A, G2 = _prepare(d, tab)
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"], A, G2, do, None, _scale(d), d["initial_state"], d["cu_seqlens"], tab)
    g2 = cp_backward(ReferenceCPBackend(), *args, block_v=None, truncate=cutoff)
    g1 = cp_backward(_DualEmulation(), *args, block_v=None, truncate=cutoff)
    for a, b in zip(g1, g2):
        assert bool(torch.isfinite(a).all()) and float((a - b).abs().max()) <= 1e-12


# ------------------------------------------------------------------------------------------------
# backward
# ------------------------------------------------------------------------------------------------


BWD_LAYOUTS = [LAYOUTS[0], LAYOUTS[3], LAYOUTS[5], LAYOUTS[7]]


@pytest.mark.parametrize("name,B,T,cu,L", BWD_LAYOUTS, ids=[x[0] for x in BWD_LAYOUTS])
@pytest.mark.parametrize("with_dht", [False, True], ids=["no-dht", "dht"])
def test_backward_cut(name, B, T, cu, L, with_dht):
    """H == HV, so every gradient of head 0 (g == 0) is a per-head quantity: bitwise the exact one."""
    d = _layout_inputs(name, B, T, cu, L, H=4)
    tab = _tables(d, L)
    A, G2 = _prepare(d, tab)
    gen = torch.Generator().manual_seed(len(name))
    do = torch.randn(d["v"].shape, generator=gen, dtype=F64)
    dht = torch.randn(d["initial_state"].shape, generator=gen, dtype=F64) if with_dht else None
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"], A, G2, do, dht, _scale(d), d["initial_state"], d["cu_seqlens"], tab)
    exact = cp_backward(ReferenceCPBackend(), *args, block_v=None, truncate=False)
    end = T if cu is None else cu[-1]
    for cutoff, tol in ((-10.0, 1e-3), (TRUNCATE_LOG_DECAY, 1e-7), (-1e6, 1e-14)):
        got = cp_backward(ReferenceCPBackend(), *args, block_v=None, truncate=cutoff)
        for name_, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, exact):
            assert a.shape == b.shape and bool(torch.isfinite(a).all()), name_
            assert float((a - b).norm()) <= tol * float(b.norm()) + 1e-13, (cutoff, name_)
            head0 = (lambda x: x[:, 0]) if name_ == "dh0" else (lambda x: x[:, :end, 0])  # noqa: E731
            assert torch.equal(head0(a), head0(b)), (cutoff, name_)


def test_backward_entry_point_truncate_forms(monkeypatch):
    monkeypatch.delenv(EXACT_ENV, raising=False)
    d = _entry_inputs(320, seqlens=[200, 0, 120], seed=5)
    be = ReferenceCPBackend()
    f = chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="on", segment_len=64, backend=be)
    gen = torch.Generator().manual_seed(1)
    do = torch.randn(d["v"].shape, generator=gen, dtype=F64)
    dht = torch.randn(d["initial_state"].shape, generator=gen, dtype=F64)
    run = lambda t: chunk_gated_delta_rule_bwd(f.q, f.k, d["v"], d["g"], d["beta"], f.A, f.g_cum_log2, do, dht,  # noqa: E731
                                               None, d["initial_state"], d["cu_seqlens"], cp="on", segment_len=64,
                                               backend=be, truncate=t)
    g_none, g_true, g_false, g_10 = run(None), run(True), run(False), run(-10.0)
    for a, b, c, e in zip(g_none, g_true, g_false, g_10):
        assert torch.equal(a, b)
        assert bool(torch.isfinite(e).all())
        assert float((e - c).norm()) <= 1e-3 * float(c.norm()) + 1e-13
    assert torch.equal(g_10[2][..., 0, :], g_false[2][..., 0, :])  # dv of the g == 0 head
    monkeypatch.setenv(EXACT_ENV, "1")
    for a, c in zip(run(None), g_false):
        assert torch.equal(a, c)


# ------------------------------------------------------------------------------------------------
# planner
# ------------------------------------------------------------------------------------------------

PLAN_HV = (1, 2, 4, 8, 16, 32, 64)
PLAN_N = (1, 2, 4, 8)
PLAN_T = sorted({64 * 2**i for i in range(15)} | {65, 100, 127, 1000, 4097, 12345, 2**20 - 1})


def _check_plan(p, HV, N, T, *, forced=False, max_seqlen=None, backward=False):
    lmax = -(-T // N) if max_seqlen is None else min(max_seqlen, T)
    assert math.isfinite(p.est_unsplit) and p.est_unsplit >= 0
    if p.split:
        assert isinstance(p.segment_len, int) and p.segment_len > 0 and p.segment_len % 64 == 0
        if p.est_split is not None:
            assert math.isfinite(p.est_split) and p.est_split > 0
        if not forced:
            assert p.segment_len < lmax, (HV, N, T, p)
            assert p.est_unsplit >= (BWD_MIN_GAIN if backward else MIN_GAIN) * p.est_split
    else:
        assert p.segment_len is None
    assert p.BV in (64, 128)


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("V", [128, 64])
def test_plan_grid(backward, V):
    for HV in PLAN_HV:
        for N in PLAN_N:
            for T in PLAN_T:
                p = plan_cp(HV, N, T, V, 132, exact=True, backward=backward)
                _check_plan(p, HV, N, T, backward=backward)
                pf = plan_cp(HV, N, T, V, 132, exact=True, backward=backward, force=True)
                assert pf.split
                _check_plan(pf, HV, N, T, forced=True)


def test_plan_grid_with_hints_and_sm_counts():
    for sms in (1, 8, 132):
        for HV in (1, 4, 64):
            for N in PLAN_N:
                for T in (64, 4097, 65536, 2**20):
                    for hint in (0, 1, 64, T // N, T):
                        p = plan_cp(HV, N, T, 128, sms, exact=True, max_seqlen=hint)
                        _check_plan(p, HV, N, T, max_seqlen=hint)


@pytest.mark.parametrize("consts", [
    dict(DUAL_LAUNCH=False),
    dict(FULL_TRANSITION_HEADS=0),
    dict(FULL_TRANSITION_HEADS=1000),
    dict(CUT_CHUNKS=0),
    dict(CUT_CHUNKS=10**6),
    dict(HEAD_OVERHEAD=0.0),
    dict(HEAD_OVERHEAD=100.0),
], ids=lambda c: ",".join(f"{k}={v}" for k, v in c.items()))
def test_plan_grid_with_other_constants(consts, monkeypatch):
    for k, v in consts.items():
        monkeypatch.setattr(planner, k, v)
    clear_plan_cache()
    try:
        for HV in PLAN_HV:
            for N in (1, 8):
                for T in (64, 1000, 32768, 2**20):
                    for backward in (False, True):
                        _check_plan(plan_cp(HV, N, T, 128, 132, exact=True, backward=backward), HV, N, T, backward=backward)
    finally:
        monkeypatch.undo()
        clear_plan_cache()


def test_split_time_dual_terms():
    """The dual-launch estimate: finite, positive, and with every head walking whole segments
    (FULL_TRANSITION_HEADS >= HV) never below the run alone; cut transitions never cost more than
    whole ones."""
    for HV in PLAN_HV:
        for N in (1, 4):
            for T in (4096, 32768, 2**20):
                l_avg = -(-T // N)
                for L in (512, 2048, 8192):
                    if L >= l_avg:
                        continue
                    for bv in (128, 64):
                        args = (bv, HV, 128, T, N, L, l_avg, l_avg, True, 132, True, None)
                        t = planner._split_time(*args)
                        assert math.isfinite(t) and t > 0
                        old = planner.FULL_TRANSITION_HEADS
                        try:
                            planner.FULL_TRANSITION_HEADS = HV
                            t_full = planner._split_time(*args)
                        finally:
                            planner.FULL_TRANSITION_HEADS = old
                        assert t <= t_full + 1e-9


def test_entry_point_batch_rows_cut(monkeypatch):
    """B > 1 rows through the public forward: the cut within its bound, the g == 0 head bitwise."""
    monkeypatch.delenv(EXACT_ENV, raising=False)
    d = make_gdn_inputs(2, 333, 1, 3, 16, 64, initial_state=True, dtype=F64, seed=12)
    be = ReferenceCPBackend()
    run = lambda t: chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="on", segment_len=128,  # noqa: E731
                                               backend=be, return_info=True, truncate=t)
    (fx, ix), (ft, it) = run(False), run(-10.0)
    tab = it.tables
    assert tab.N == 2 and bool((it.transition_chunks[tab.need_correction, -1] == 1).all())
    assert torch.equal(ft.o[..., 0, :], fx.o[..., 0, :]) and torch.equal(ft.final_state[:, 0], fx.final_state[:, 0])
    smax = float(ix.S_in.flatten(2).norm(dim=-1).max())
    qn = d["q"].norm(dim=-1).expand(-1, -1, 3)
    assert bool(((ft.o - fx.o).norm(dim=-1) <= 2 * 16**-0.5 * qn * math.exp(-10.0) * smax * (1 + 1e-9) + 1e-12).all())
    assert torch.equal(ft.A, fx.A) and torch.equal(ft.g_cum_log2, fx.g_cum_log2)

"""FLA's chunked forward (reference.gdn.chunk, reference.chunk_gated_delta_rule) against the fp64
token recurrence, end to end and stage by stage (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from flashqla.testing import BUDGETS, STRONG_DECAY_G, assert_close_rel, make_gdn_inputs, random_cu_seqlens, rel_rms
from reference import chunk_gated_delta_rule, recurrent_gated_delta_rule
from reference.gdn.chunk import (
    chunk_fwd_h,
    chunk_fwd_o,
    chunk_gated_delta_rule_fwd,
    chunk_local_cumsum,
    chunk_scaled_dot_kkt,
    prepare_chunk_layout,
    recompute_w_u,
    solve_tril,
    unit_lower_inverse,
)
from reference.gdn.recurrent import seq_bounds

BUDGET = BUDGETS["reference_fp64"]
F64 = torch.float64


def _inputs(**kw):
    """make_gdn_inputs with small head dims by default."""
    kw.setdefault("K", 16)
    kw.setdefault("V", 8)
    return make_gdn_inputs(**kw)


def _to_f64(x: dict) -> dict:
    return {n: (t.to(F64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()}


def _check_against_recurrence(x: dict, chunk_size: int = 64, scale=None) -> None:
    """o and final state of the reference op == the recurrence, in fp64, per quantity."""
    o_ref, ht_ref = recurrent_gated_delta_rule(**x, scale=scale, output_final_state=True)
    o, ht = chunk_gated_delta_rule(**x, scale=scale, output_final_state=True, chunk_size=chunk_size)
    assert o.dtype == x["q"].dtype and ht.dtype == F64
    assert_close_rel("o", o, o_ref, BUDGET["o"])
    assert_close_rel("ht", ht, ht_ref, BUDGET["ht"])


def _trace(x: dict):
    """Plain per-token loop (fp64): the state before every token, S_{t-1} [B, T, HV, K, V], and the
    recurrence's corrected values u~_t = beta_t (v_t - (exp(g_t) S_{t-1})^T k_t) [B, T, HV, V]."""
    q, k, v, g, beta = (x[n].to(F64) for n in ("q", "k", "v", "g", "beta"))
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    k = k.repeat_interleave(HV // H, dim=2)
    S_before = torch.zeros(B, T, HV, K, V, dtype=F64)
    u = torch.zeros(B, T, HV, V, dtype=F64)
    for n, (b, bos, eos) in enumerate(seq_bounds(B, T, x["cu_seqlens"])):
        S = x["initial_state"][n].to(F64) if x["initial_state"] is not None else torch.zeros(HV, K, V, dtype=F64)
        for t in range(bos, eos):
            S_before[b, t] = S
            for hv in range(HV):
                Sd = math.exp(float(g[b, t, hv])) * S[hv]
                u[b, t, hv] = beta[b, t, hv] * (v[b, t, hv] - Sd.T @ k[b, t, hv])
            S = torch.stack(
                [math.exp(float(g[b, t, hv])) * S[hv] + torch.outer(k[b, t, hv], u[b, t, hv]) for hv in range(HV)]
            )
    return S_before, u


def _chunks(x: dict, C: int):
    """(b, start, end) of every chunk in FLA's order."""
    B, T = x["q"].shape[:2]
    out = []
    for b, bos, eos in seq_bounds(B, T, x["cu_seqlens"]):
        out += [(b, s, min(s + C, eos)) for s in range(bos, eos, C)]
    return out


# ---------------------------------------------------------------------------------------------
# End to end against the recurrence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 5, 63, 64, 65, 200, 1000])
def test_matches_recurrence_over_T(T):
    _check_against_recurrence(_inputs(B=2, T=T, H=2, HV=4, seed=T))


@pytest.mark.parametrize("HV", [2, 4, 8])
def test_matches_recurrence_gva(HV):
    _check_against_recurrence(_inputs(B=2, T=130, H=2, HV=HV, seed=HV))


@pytest.mark.parametrize(
    "lengths",
    [
        [0, 5, 64, 131],  # empty first
        [10, 0, 65, 3, 127],  # empty in the middle, several partial chunks
        [63, 1, 200, 0],  # empty last
        [1, 2, 3, 7, 13, 31, 17, 5],  # all shorter than a chunk
        [0, 0, 70],  # two empty sequences first
    ],
    ids=["empty-first", "empty-middle", "empty-last", "all-short", "two-empty"],
)
@pytest.mark.parametrize("initial_state", [True, False])
def test_matches_recurrence_varlen(lengths, initial_state):
    x = _inputs(B=1, T=sum(lengths), H=2, HV=4, cu_seqlens=lengths, initial_state=initial_state, seed=len(lengths))
    _check_against_recurrence(x)


@pytest.mark.parametrize("initial_state", [True, False])
@pytest.mark.parametrize("scale", [None, 0.3])
def test_matches_recurrence_initial_state_and_scale(initial_state, scale):
    _check_against_recurrence(_inputs(B=2, T=150, H=1, HV=2, initial_state=initial_state, seed=3), scale=scale)


@pytest.mark.parametrize("gate", ["zero", "logsigmoid", -1.0, STRONG_DECAY_G, "mixed-strong"])
def test_matches_recurrence_gates(gate):
    if gate == "mixed-strong":  # per token g uniform in [-30, 0]
        x = _inputs(B=2, T=150, H=2, HV=4, gate="zero", seed=5)
        x["g"] = -30.0 * torch.rand(x["g"].shape, generator=torch.Generator().manual_seed(5), dtype=F64)
    else:
        x = _inputs(B=2, T=150, H=2, HV=4, gate=gate, special_heads=False, seed=5)
    _check_against_recurrence(x)


def test_extreme_decay_stays_finite():
    """Per-token g = -300 (exp(-300) ~ 5e-131; cumulative exponents down to -19200): no inf, no NaN."""
    x = _inputs(B=1, T=150, H=2, HV=4, gate=-300.0, special_heads=False, seed=6)
    _check_against_recurrence(x)
    for dtype in (torch.float32, torch.bfloat16):
        x32 = _inputs(B=1, T=150, H=2, HV=4, gate=-300.0, special_heads=False, dtype=dtype, seed=6)
        g_cum, o, A, ht, h, v_new = chunk_gated_delta_rule_fwd(**x32, output_final_state=True)
        for name, t in dict(g_cum=g_cum, o=o, A=A, ht=ht, h=h, v_new=v_new).items():
            assert bool(torch.isfinite(t).all()), f"{name} is not finite at g = -300 ({dtype})"
        o_ref, _ = recurrent_gated_delta_rule(**_to_f64(x32))
        assert_close_rel(f"o ({dtype} inputs, fp32 compute)", o, o_ref, 1e-5)


@pytest.mark.parametrize("beta_value", [0.0, 1.0])
def test_matches_recurrence_beta_extremes(beta_value):
    x = _inputs(B=2, T=140, H=2, HV=4, seed=7)
    x["beta"] = torch.full_like(x["beta"], beta_value)
    _check_against_recurrence(x)


@pytest.mark.parametrize("chunk_size", [5, 16, 32])
def test_matches_recurrence_other_chunk_sizes(chunk_size):
    x = _inputs(B=1, T=100, H=2, HV=4, cu_seqlens=[37, 0, 63], seed=chunk_size)
    _check_against_recurrence(x, chunk_size=chunk_size)


@pytest.mark.parametrize("lengths", [None, [70, 0, 130]])
def test_matches_recurrence_k128(lengths):
    x = make_gdn_inputs(B=1 if lengths else 2, T=200, H=1, HV=2, K=128, V=128, cu_seqlens=lengths, seed=8)
    _check_against_recurrence(x)


def test_l2norm_in_kernel():
    x = _inputs(B=2, T=100, H=2, HV=4, seed=9)
    gen = torch.Generator().manual_seed(9)
    x["q"] = 3.0 * torch.randn(x["q"].shape, generator=gen, dtype=F64)  # not normalised
    x["k"] = 0.5 * torch.randn(x["k"].shape, generator=gen, dtype=F64)
    o_ref, ht_ref = recurrent_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True, use_qk_l2norm_in_kernel=True)
    assert_close_rel("o", o, o_ref, BUDGET["o"])
    assert_close_rel("ht", ht, ht_ref, BUDGET["ht"])


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_low_precision_inputs(dtype):
    """Compute in fp32: o in q's dtype, final state fp32, close to the fp64 recurrence on the same values."""
    x = _inputs(B=2, T=130, H=2, HV=4, dtype=dtype, seed=10)
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    assert o.dtype == dtype and ht.dtype == torch.float32
    o_ref, ht_ref = recurrent_gated_delta_rule(**_to_f64(x), output_final_state=True)
    tol = 1e-5 if dtype == torch.float32 else 1e-2
    assert_close_rel("o", o, o_ref, tol)
    assert_close_rel("ht", ht, ht_ref, 1e-5)
    g_cum, o32, A, ht32, h, v_new = chunk_gated_delta_rule_fwd(**x, output_final_state=True)
    for name, t in dict(g_cum=g_cum, o=o32, A=A, ht=ht32, h=h, v_new=v_new).items():
        assert t.dtype == torch.float32, f"{name} is {t.dtype}, not the fp32 compute dtype"


def test_final_state_none_unless_asked():
    x = _inputs(B=1, T=20, H=1, HV=2, seed=11)
    o, ht = chunk_gated_delta_rule(**x)
    assert ht is None and o.shape == (1, 20, 2, 8)


# ---------------------------------------------------------------------------------------------
# Composition: two calls == one call; varlen == each sequence alone
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("split", [1, 64, 100])
def test_two_calls_equal_one(split):
    x = _inputs(B=2, T=230, H=2, HV=4, seed=12)
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    first = {n: (t[:, :split] if n in ("q", "k", "v", "g", "beta") else t) for n, t in x.items()}
    second = {n: (t[:, split:] if n in ("q", "k", "v", "g", "beta") else t) for n, t in x.items()}
    o1, ht1 = chunk_gated_delta_rule(**first, output_final_state=True)
    second["initial_state"] = ht1
    o2, ht2 = chunk_gated_delta_rule(**second, output_final_state=True)
    assert_close_rel("o", torch.cat([o1, o2], 1), o, BUDGET["o"])
    assert_close_rel("ht", ht2, ht, BUDGET["ht"])


def test_varlen_equals_each_sequence_alone():
    lengths = [70, 0, 5, 129, 64]
    x = _inputs(B=1, T=sum(lengths), H=2, HV=4, cu_seqlens=lengths, seed=13)
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    cu = x["cu_seqlens"].tolist()
    for n in range(len(lengths)):
        bos, eos = cu[n], cu[n + 1]
        alone = {m: x[m][:, bos:eos] for m in ("q", "k", "v", "g", "beta")}
        o_n, ht_n = chunk_gated_delta_rule(**alone, initial_state=x["initial_state"][n : n + 1], output_final_state=True)
        if eos > bos:
            assert_close_rel(f"o[seq {n}]", o_n, o[:, bos:eos], BUDGET["o"])
        assert_close_rel(f"ht[seq {n}]", ht_n[0], ht[n], BUDGET["ht"])
    assert torch.equal(ht[1], x["initial_state"][1])  # the empty sequence hands back its initial state


# ---------------------------------------------------------------------------------------------
# Stage by stage against straightforward, independent computations
# ---------------------------------------------------------------------------------------------

STAGE_CASES = {
    "fixed": dict(B=2, T=45, cu_seqlens=None),
    "varlen": dict(B=1, T=80, cu_seqlens=[20, 0, 33, 1, 26]),
}
C_STAGE = 16


@pytest.fixture(params=list(STAGE_CASES), ids=list(STAGE_CASES))
def stage(request):
    x = _inputs(H=2, HV=4, seed=14, **STAGE_CASES[request.param])
    g_cum, o, A, ht, h, v_new = chunk_gated_delta_rule_fwd(**x, output_final_state=True, chunk_size=C_STAGE)
    return x, dict(g_cum=g_cum, o=o, A=A, ht=ht, h=h, v_new=v_new)


def test_layout(stage):
    x, r = stage
    B, T = x["q"].shape[:2]
    chunks = _chunks(x, C_STAGE)
    lay = prepare_chunk_layout(B, T, x["cu_seqlens"], C_STAGE)
    assert lay.NC == len(chunks)
    assert lay.length.tolist() == [e - s for _, s, e in chunks]
    expected_h = (B, -(-T // C_STAGE)) if x["cu_seqlens"] is None else (1, len(chunks))
    assert tuple(r["h"].shape) == (*expected_h, 4, 16, 8)
    assert tuple(r["A"].shape) == (B, T, 4, C_STAGE)


def test_stage_chunk_local_cumsum(stage):
    x, r = stage
    g = x["g"]
    fwd = torch.zeros_like(g)
    rev = torch.zeros_like(g)
    for b, s, e in _chunks(x, C_STAGE):
        for t in range(s, e):
            fwd[b, t] = g[b, s : t + 1].sum(0)
            rev[b, t] = g[b, t:e].sum(0)
    assert_close_rel("g_cum", r["g_cum"], fwd, 1e-14)
    assert_close_rel("g_cum reverse", chunk_local_cumsum(g, C_STAGE, x["cu_seqlens"], reverse=True), rev, 1e-14)


def test_stage_kkt_and_solve_tril(stage):
    x, r = stage
    k, beta, g_cum = x["k"], x["beta"], r["g_cum"]
    L = chunk_scaled_dot_kkt(k, beta, g_cum, C_STAGE, x["cu_seqlens"])
    HV, group = beta.shape[2], beta.shape[2] // k.shape[2]
    checked = 0
    for b, s, e in _chunks(x, C_STAGE):
        n = e - s
        for hv in range(HV):
            kc = k[b, s:e, hv // group]
            G = g_cum[b, s:e, hv]
            L_ref = torch.zeros(n, n, dtype=F64)
            for i in range(n):
                for j in range(i):
                    L_ref[i, j] = beta[b, s + i, hv] * (kc[i] @ kc[j]) * math.exp(float(G[i] - G[j]))
            L_got = L[b, s:e, hv]
            assert torch.count_nonzero(L_got[:, n:]) == 0, "columns past the chunk's end must be 0"
            A_got = r["A"][b, s:e, hv]
            assert torch.count_nonzero(A_got[:, n:]) == 0
            if n > 1:
                assert rel_rms(L_got[:, :n], L_ref) <= 1e-14
            A_ref = torch.linalg.inv(torch.eye(n, dtype=F64) + L_ref)
            assert rel_rms(A_got[:, :n], A_ref) <= 1e-12, f"A of chunk ({b}, {s}:{e}), head {hv}"
            checked += 1
    assert checked == len(_chunks(x, C_STAGE)) * HV
    assert_close_rel("A (solve_tril)", solve_tril(L, C_STAGE, x["cu_seqlens"]), r["A"], 1e-15)


def test_unit_lower_inverse_against_inv():
    gen = torch.Generator().manual_seed(15)
    for C in (64, 16, 7):
        L = 0.3 * torch.randn(3, 2, C, C, generator=gen, dtype=F64).tril(-1)
        ref = torch.linalg.inv(torch.eye(C, dtype=F64) + L)
        assert_close_rel(f"(I+L)^-1, C={C}", unit_lower_inverse(L), ref, 1e-13)


def test_stage_w_u(stage):
    x, r = stage
    k, v, beta, A, g_cum = x["k"], x["v"], x["beta"], r["A"], r["g_cum"]
    w, u = recompute_w_u(k, v, beta, A, g_cum, C_STAGE, x["cu_seqlens"])
    w_ref, u_ref = torch.zeros_like(w), torch.zeros_like(u)
    HV, group = v.shape[2], v.shape[2] // k.shape[2]
    for b, s, e in _chunks(x, C_STAGE):
        for hv in range(HV):
            Ac = A[b, s:e, hv, : e - s]
            bt = beta[b, s:e, hv]
            w_ref[b, s:e, hv] = Ac @ torch.diag(bt * g_cum[b, s:e, hv].exp()) @ k[b, s:e, hv // group]
            u_ref[b, s:e, hv] = Ac @ torch.diag(bt) @ v[b, s:e, hv]
    assert_close_rel("w", w, w_ref, 1e-14)
    assert_close_rel("u", u, u_ref, 1e-14)


def test_stage_h_and_v_new_against_recurrence(stage):
    x, r = stage
    S_before, u_rec = _trace(x)
    chunks = _chunks(x, C_STAGE)
    h = r["h"].reshape(len(chunks), *r["h"].shape[2:])
    h_ref = torch.stack([S_before[b, s] for b, s, _ in chunks])
    assert_close_rel("h (chunk-start states)", h, h_ref, 1e-12)
    assert_close_rel("v_new (recurrence u~_t)", r["v_new"], u_rec, 1e-12)
    _, ht_ref = recurrent_gated_delta_rule(**x, output_final_state=True)
    assert_close_rel("final_state", r["ht"], ht_ref, 1e-12)
    # the step function on its own, from w and u
    w, u = recompute_w_u(x["k"], x["v"], x["beta"], r["A"], r["g_cum"], C_STAGE, x["cu_seqlens"])
    h2, v_new2, ht2 = chunk_fwd_h(x["k"], w, u, r["g_cum"], x["initial_state"], True, C_STAGE, x["cu_seqlens"])
    assert torch.equal(h2, r["h"]) and torch.equal(v_new2, r["v_new"]) and torch.equal(ht2, r["ht"])
    assert chunk_fwd_h(x["k"], w, u, r["g_cum"], x["initial_state"], False, C_STAGE, x["cu_seqlens"])[2] is None


def test_stage_o(stage):
    x, r = stage
    q, k, g_cum, v_new = x["q"], x["k"], r["g_cum"], r["v_new"]
    chunks = _chunks(x, C_STAGE)
    h = r["h"].reshape(len(chunks), *r["h"].shape[2:])
    scale = 0.7
    o = chunk_fwd_o(q, k, v_new, r["h"], g_cum, scale, C_STAGE, x["cu_seqlens"])
    o_ref = torch.zeros_like(o)
    HV, group = v_new.shape[2], v_new.shape[2] // q.shape[2]
    for c, (b, s, e) in enumerate(chunks):
        for hv in range(HV):
            for i in range(s, e):
                qi = q[b, i, hv // group]
                acc = math.exp(float(g_cum[b, i, hv])) * (h[c, hv].T @ qi)
                for j in range(s, i + 1):
                    acc = acc + (qi @ k[b, j, hv // group]) * math.exp(float(g_cum[b, i, hv] - g_cum[b, j, hv])) * v_new[b, j, hv]
                o_ref[b, i, hv] = scale * acc
    assert_close_rel("o (chunk_fwd_o)", o, o_ref, 1e-13)
    o_rec, _ = recurrent_gated_delta_rule(**x, scale=scale)
    assert_close_rel("o vs recurrence", o, o_rec, BUDGET["o"])


def test_cu_seqlens_int64_and_int32_agree():
    lengths = [30, 0, 90]
    x = _inputs(B=1, T=120, H=2, HV=4, cu_seqlens=lengths, seed=16)
    o32, ht32 = chunk_gated_delta_rule(**x, output_final_state=True)
    x["cu_seqlens"] = random_cu_seqlens(lengths, dtype=torch.int64)
    o64, ht64 = chunk_gated_delta_rule(**x, output_final_state=True)
    assert torch.equal(o32, o64) and torch.equal(ht32, ht64)

"""Every derivation record's numeric twins, in fp64 at full size (C = 64, K = V = 128).

Each record in `derivations` names the two reference functions computing its left and right sides;
a driver below runs them on valid-domain inputs (`make_gdn_inputs`: L2-normalised q, k, sigmoid
beta, Qwen3-Next gates with a g == 0 head and a g == -30 head, GVA, an initial state) with T not a
multiple of 64, batched and varlen, and returns the pairs to compare. Exact records agree to <= 1e-12
relative RMS; bounded records (CP-4, CP-5) are checked against their bound at per-token g of 0,
-0.01, -1 and -30. A record without a driver fails `test_every_record_has_a_driver`.
"""

from __future__ import annotations

import functools
import importlib
import math

import pytest
import torch

import derivations
from flashqla.testing import make_gdn_inputs, rel_rms
from reference.gdn import chunk, chunk_bwd, cp, fused
from reference.gdn.chunk import prepare_chunk_layout
from reference.gdn.recurrent import recurrent_gated_delta_rule

EXACT_TOL = 1e-12
C = 64

# Input sets: T not a multiple of 64; varlen with a 1-token, an exactly-64 and partial sequences.
CASES = {
    "B2-T200-H2-HV4": dict(B=2, T=200, H=2, HV=4),
    "varlen-130+1+64+105-H1-HV2": dict(B=1, T=300, H=1, HV=2, cu_seqlens=[130, 1, 64, 105]),
}


@functools.lru_cache(maxsize=None)
def inputs(case: str) -> dict:
    kw = dict(CASES[case])
    x = make_gdn_inputs(K=128, V=128, seed=7, **kw)
    gen = torch.Generator().manual_seed(11)
    x["do"] = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    x["dht"] = torch.randn(x["initial_state"].shape, generator=gen, dtype=torch.float64)
    x["scale"] = 128**-0.5
    return x


def fwd_args(x: dict) -> dict:
    return {n: x[n] for n in ("q", "k", "v", "g", "beta", "scale", "initial_state", "cu_seqlens")}


@functools.lru_cache(maxsize=None)
def fla_fwd(case: str):
    """FLA's chunked forward (reference.gdn.chunk): (g_cum, o, A, final_state, h, v_new)."""
    return chunk.chunk_gated_delta_rule_fwd(**fwd_args(inputs(case)), output_final_state=True)


@functools.lru_cache(maxsize=None)
def recurrence(case: str):
    """Ground truth: (o, final_state) of the token recurrence and its autograd gradients."""
    x = inputs(case)
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "initial_state")}
    o, ht = recurrent_gated_delta_rule(**leaves, scale=x["scale"], cu_seqlens=x["cu_seqlens"], output_final_state=True)
    torch.autograd.backward([o, ht], [x["do"], x["dht"]])
    grads = {f"d{n}": leaves[n].grad for n in ("q", "k", "v", "g", "beta")}
    grads["dh0"] = leaves["initial_state"].grad
    return o.detach(), ht.detach(), grads


@functools.lru_cache(maxsize=None)
def fla_bwd(case: str):
    """The hand-written backward (reference.gdn.chunk_bwd): dict dq dk dv dg dbeta dh0."""
    x = inputs(case)
    g_cum, _, A, _, _, _ = fla_fwd(case)
    out = chunk_bwd.chunk_gated_delta_rule_bwd(
        x["q"], x["k"], x["v"], g_cum, x["beta"], A, x["scale"], x["initial_state"], x["do"], x["dht"], x["cu_seqlens"]
    )
    return dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), out))


def chunked(case: str):
    """Chunk tensors [NC, HV, C, ...] of a case: layout, q, k, v, beta, g_cum (padding = last valid)."""
    x = inputs(case)
    HV = x["v"].shape[2]
    lay = prepare_chunk_layout(x["q"].shape[0], x["q"].shape[1], x["cu_seqlens"], C)
    g_cum = fla_fwd(case)[0]
    return dict(
        lay=lay,
        q=fused.to_chunks(x["q"], lay, HV),
        k=fused.to_chunks(x["k"], lay, HV),
        v=fused.to_chunks(x["v"], lay),
        beta=fused.to_chunks(x["beta"], lay),
        g_cum=fused.pad_g_cum(fused.to_chunks(g_cum, lay), lay),
    )


def valid_square(lay) -> torch.Tensor:
    """[NC, 1, C, C] bool: both slots valid (partial chunks compare on their valid part only)."""
    return (lay.valid[:, :, None] & lay.valid[:, None, :])[:, None]


def on_valid(A: torch.Tensor, lay) -> torch.Tensor:
    return torch.where(valid_square(lay), A, torch.zeros((), dtype=A.dtype))


# ------------------------------------------------------------------------------------------------
# Drivers: record id -> function(case) -> list of (quantity, lhs, rhs)
# ------------------------------------------------------------------------------------------------

DRIVERS = {}


def driver(*ids):
    def deco(fn):
        for i in ids:
            DRIVERS[i] = fn
        return fn

    return deco


@driver("CF-1")
def _cf1(case):
    return [("o", recurrence(case)[0], fla_fwd(case)[1])]


@driver("CF-2")
def _cf2(case):
    return [("final_state", recurrence(case)[1], fla_fwd(case)[3])]


@driver("CF-3")
def _cf3(case):
    x = inputs(case)
    u = fused.recurrent_deltas(x["k"], x["v"], x["g"], x["beta"], x["initial_state"], x["cu_seqlens"])
    return [("v_new", u, fla_fwd(case)[5])]


def _wy(case):
    x, c = inputs(case), chunked(case)
    g_cum, _, A, _, _, _ = fla_fwd(case)
    w, u = chunk.recompute_w_u(x["k"], x["v"], x["beta"], A, g_cum, cu_seqlens=x["cu_seqlens"])
    wc, uc = fused.to_chunks(w, c["lay"]), fused.to_chunks(u, c["lay"])
    return [
        ("M", fused.chunk_transition_rank1(c["k"], c["beta"], c["g_cum"]), fused.chunk_transition_wy(c["k"], wc, c["g_cum"])),
        ("F", fused.chunk_state_input_rank1(c["k"], c["v"], c["beta"], c["g_cum"]), fused.chunk_state_input_wy(c["k"], uc, c["g_cum"])),
    ]


DRIVERS["WY-1"] = lambda case: _wy(case)[:1]
DRIVERS["WY-2"] = lambda case: _wy(case)[1:]


def _fla_L_and_A(case):
    x = inputs(case)
    g_cum = fla_fwd(case)[0]
    L = chunk.chunk_scaled_dot_kkt(x["k"], x["beta"], g_cum, cu_seqlens=x["cu_seqlens"])
    A = chunk.solve_tril(L, cu_seqlens=x["cu_seqlens"])
    return L, A


@driver("WY-3")
def _wy3(case):
    lay = chunked(case)["lay"]
    L, A = (fused.to_chunks(t, lay) for t in _fla_L_and_A(case))
    blockdiag = torch.block_diag(*[torch.ones(16, 16, dtype=torch.bool)] * 4)
    lhs = fused.solve_tril_diagonal_blocks(L, 16)
    return [("diag blocks of A", on_valid(lhs, lay), on_valid(torch.where(blockdiag, A, torch.zeros((), dtype=A.dtype)), lay))]


@driver("WY-4")
def _wy4(case):
    lay = chunked(case)["lay"]
    L, A = (fused.to_chunks(t, lay) for t in _fla_L_and_A(case))
    dense = torch.linalg.solve_triangular(torch.eye(C, dtype=L.dtype) + torch.tril(L, -1), torch.eye(C, dtype=L.dtype), upper=False)
    return [
        ("A (vs solve_tril)", on_valid(fused.solve_tril_blocks(L, 16), lay), on_valid(A, lay)),
        ("A (vs dense solve)", on_valid(fused.solve_tril_blocks(L, 16), lay), on_valid(dense, lay)),
    ]


@driver("WY-5")
def _wy5(case):
    lay = chunked(case)["lay"]
    L, A = (fused.to_chunks(t, lay) for t in _fla_L_and_A(case))
    return [("A (vs solve_tril)", on_valid(fused.solve_tril_nilpotent(L, 16), lay), on_valid(A, lay))]


@driver("RW-1")
def _rw1(case):
    c = chunked(case)
    A_gated = fused.to_chunks(_fla_L_and_A(case)[1], c["lay"])
    A_g = fused.regate(fused.kkt_solve(c["k"], c["beta"]), c["g_cum"])
    return [("A_gated", on_valid(A_gated, c["lay"]), on_valid(A_g, c["lay"]))]


@driver("RW-2")
def _rw2(case):
    c = chunked(case)
    _, _, _, _, h, v_new = fla_fwd(case)
    A_g = fused.regate(fused.kkt_solve(c["k"], c["beta"]), c["g_cum"])
    hc = h.reshape(c["lay"].NC, *h.shape[2:])
    rhs = fused.from_chunks(fused.chunk_v_new(c["k"], c["v"], c["beta"], A_g, c["g_cum"], hc), c["lay"])
    return [("v_new", v_new, rhs)]


def _fused_states(case, state_update, use_exp2=False):
    x = inputs(case)
    _, _, _, ht, h, _ = fla_fwd(case)
    out = fused.fused_chunk_fwd(
        x["q"], x["k"], x["v"], fla_fwd(case)[0], x["beta"], x["scale"], x["initial_state"], x["cu_seqlens"],
        state_update=state_update, use_exp2=use_exp2,
    )
    return [("h", h, out["h"]), ("final_state", ht, out["final_state"]), ("o", fla_fwd(case)[1], out["o"])]


@driver("RW-3")
def _rw3(case):
    c = chunked(case)
    _, _, _, _, h, _ = fla_fwd(case)
    hc = h.reshape(c["lay"].NC, *h.shape[2:])
    A = fused.kkt_solve(c["k"], c["beta"])
    T_c, gamma_C = fused.chunk_transition(c["k"], c["beta"], A, c["g_cum"])
    B_c = fused.chunk_state_input(c["k"], c["v"], c["beta"], A, c["g_cum"])
    eye = torch.eye(128, dtype=torch.float64)
    one_step = (gamma_C[..., None, None] * eye - T_c) @ hc + B_c
    # the chunk-end state from FLA's own update of the same entering state
    lhs = fused.chunk_state_update(hc, c["k"], fused.to_chunks(fla_fwd(case)[5], c["lay"]), c["g_cum"])
    return [("S' (one chunk)", lhs, one_step)] + _fused_states(case, "transition")


@driver("RW-4")
def _rw4(case):
    c = chunked(case)
    lhs = fused.decay_mask(c["g_cum"])
    rhs = fused.decay_mask_exp2(fused.g_cum_to_log2(c["g_cum"]))
    return [("Gamma", lhs, rhs)] + _fused_states(case, "direct", use_exp2=True)


@driver("RW-5")
def _rw5(case):
    return _fused_states(case, "xy")


@driver("RW-6")
def _rw6(case):
    x = inputs(case)
    dh, dh0 = fused.fused_state_grad(x["q"], x["k"], x["g"], x["beta"], x["scale"], x["do"], x["dht"], x["cu_seqlens"])
    return [("dh0", fla_bwd(case)["dh0"], dh0), ("dh0 (autograd)", recurrence(case)[2]["dh0"], dh0)]


def _bwd(name):
    def run(case):
        return [(name, fla_bwd(case)[name], recurrence(case)[2][name])]

    return run


for _n in ("dq", "dk", "dv", "dbeta", "dh0", "dg"):
    DRIVERS[f"BWD-{_n}"] = _bwd(_n)


@driver("BWD-dG")
def _bwd_dG(case):
    # hand-written dL/dg_cum (before the reverse cumsum) against autograd of the chunk form in g_cum
    x = inputs(case)
    g_cum, _, A, _, _, _ = fla_fwd(case)
    cs = dict(cu_seqlens=x["cu_seqlens"])
    w, u = chunk.recompute_w_u(x["k"], x["v"], x["beta"], A, g_cum, **cs)
    h, v_new, _ = chunk.chunk_fwd_h(x["k"], w, u, g_cum, x["initial_state"], False, **cs)
    dv_local = chunk_bwd.chunk_bwd_dv_local(x["q"], x["k"], x["do"], g_cum, x["scale"], **cs)
    dh, _, dv2 = chunk_bwd.chunk_bwd_dhu(x["q"], x["k"], w, g_cum, x["initial_state"], x["dht"], x["do"], dv_local, x["scale"], **cs)
    _, _, dw, dg1 = chunk_bwd.chunk_bwd_dqkwg(x["q"], x["k"], v_new, w, g_cum, h, dv2, x["do"], dh, x["scale"], **cs)
    _, _, _, dg2 = chunk_bwd.prepare_wy_repr_bwd(x["k"], x["v"], x["beta"], g_cum, A, dw, dv2, **cs)
    G = g_cum.clone().requires_grad_(True)
    out = fused.fused_chunk_fwd(x["q"], x["k"], x["v"], G, x["beta"], x["scale"], x["initial_state"], x["cu_seqlens"])
    torch.autograd.backward([out["o"], out["final_state"]], [x["do"], x["dht"]])
    return [("dG", dg1 + dg2, G.grad)]


@driver("CP-1")
def _cp1(case):
    x = inputs(case)
    P, Q = cp.segment_maps(x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"])
    return [("S_end", recurrence(case)[1], cp.apply_map((P, Q), x["initial_state"]))]


@driver("CP-2")
def _cp2(case):
    # every sequence cut into 64-token segments; the maps of the pieces, folded from the left and
    # from the right, against the map of the whole sequence
    x = inputs(case)
    B, T = x["q"].shape[:2]
    whole = cp.segment_maps(x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"])
    plan = cp.plan_segments(B, T, x["cu_seqlens"], 64)
    flat = lambda t: t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
    P, Q = cp.segment_maps(flat(x["k"]), flat(x["v"]), flat(x["g"]), flat(x["beta"]), plan.cu_seqlens)
    left, right = [], []
    for n in range(plan.N):
        js = [j for j in range(plan.M) if int(plan.seq[j]) == n]
        maps = [(P[j], Q[j]) for j in js]
        acc = maps[0]
        for m in maps[1:]:
            acc = cp.combine(acc, m)
        left.append(acc)
        acc = maps[-1]
        for m in reversed(maps[:-1]):
            acc = cp.combine(m, acc)
        right.append(acc)
    stack = lambda ms, i: torch.stack([m[i] for m in ms])  # noqa: E731
    return [
        ("P (left fold)", whole[0], stack(left, 0)),
        ("Q (left fold)", whole[1], stack(left, 1)),
        ("P (right fold)", whole[0], stack(right, 0)),
        ("Q (right fold)", whole[1], stack(right, 1)),
    ]


@driver("CP-3")
def _cp3(case):
    x = inputs(case)
    o0, _ = recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], x["scale"], None, False, x["cu_seqlens"])
    corr = cp.output_correction(x["q"], x["k"], x["g"], x["beta"], x["initial_state"], x["scale"], x["cu_seqlens"])
    return [("o", recurrence(case)[0], o0 + corr)]


EXACT = [r.id for r in derivations.registry() if r.kind == "exact"]
BOUNDED = [r.id for r in derivations.registry() if r.kind == "bounded"]


def test_every_record_has_a_driver():
    missing = [r.id for r in derivations.registry() if r.id not in DRIVERS and r.kind == "exact"]
    assert not missing, f"records without a numeric twin test: {missing}"
    assert set(BOUNDED) <= set(BOUNDED_TESTED), f"bounded records without a bound test: {set(BOUNDED) - set(BOUNDED_TESTED)}"


@pytest.mark.parametrize("rid", [r.id for r in derivations.registry()])
def test_twins_importable(rid):
    for name in derivations.get(rid).twins:
        module, _, attr = name.rpartition(".")
        assert callable(getattr(importlib.import_module(module), attr)), f"{rid}: twin {name} is not callable"


@pytest.mark.parametrize("case", list(CASES))
@pytest.mark.parametrize("rid", EXACT)
def test_exact_twins(rid, case):
    for name, lhs, rhs in DRIVERS[rid](case):
        assert lhs.dtype == rhs.dtype == torch.float64
        err = rel_rms(rhs, lhs)
        assert err <= EXACT_TOL, f"{rid} {name} [{case}]: relative RMS {err:.2e} > {EXACT_TOL:.0e}"


@pytest.mark.parametrize("case", list(CASES))
def test_cp_forward_equals_unsplit(case):
    x = inputs(case)
    o_ref, ht_ref, _ = recurrence(case)
    o, ht = cp.cp_gated_delta_rule_fwd(**fwd_args(x), output_final_state=True, segment_len=64)
    assert rel_rms(o, o_ref) <= EXACT_TOL
    assert rel_rms(ht, ht_ref) <= EXACT_TOL


@pytest.mark.parametrize("use_exp2", [False, True], ids=["exp", "exp2"])
@pytest.mark.parametrize("state_update", ["direct", "transition", "xy"])
def test_fused_forward_end_to_end(state_update, use_exp2):
    case = "varlen-130+1+64+105-H1-HV2"
    x = inputs(case)
    o_ref, ht_ref, _ = recurrence(case)
    g_cum, o, A, ht, h, v_new = fused.fused_gated_delta_rule_fwd(
        **fwd_args(x), output_final_state=True, state_update=state_update, use_exp2=use_exp2
    )
    assert rel_rms(o, o_ref) <= EXACT_TOL and rel_rms(ht, ht_ref) <= EXACT_TOL
    assert rel_rms(h, fla_fwd(case)[4]) <= EXACT_TOL and rel_rms(v_new, fla_fwd(case)[5]) <= EXACT_TOL


@pytest.mark.parametrize("segment_len", [64, 128])
def test_cp_empty_sequence(segment_len):
    x = make_gdn_inputs(1, 150, 2, 4, 128, 128, cu_seqlens=[100, 0, 50], seed=5)
    o_ref, ht_ref = recurrent_gated_delta_rule(**x, output_final_state=True)
    o, ht = cp.cp_gated_delta_rule_fwd(**x, output_final_state=True, segment_len=segment_len)
    assert rel_rms(o, o_ref) <= EXACT_TOL and rel_rms(ht, ht_ref) <= EXACT_TOL
    assert torch.equal(ht[1], x["initial_state"][1])  # the empty sequence keeps its initial state
    with pytest.raises(ValueError):
        cp.plan_segments(1, 150, x["cu_seqlens"], 100)


# ------------------------------------------------------------------------------------------------
# Bounded records: the truncated warm-up against CP-4 / CP-5 at adversarial gates
# ------------------------------------------------------------------------------------------------

BOUNDED_TESTED = ("CP-4", "CP-5")
GATES = (0.0, -0.01, -1.0, -30.0)
SEG = 128  # tokens per segment (2 chunks); warm-up window 1 chunk
ROUND = 1e-12  # rounding floor, relative to the magnitude of the exact quantity


@functools.lru_cache(maxsize=None)
def truncated(gate: float):
    # One 3-segment sequence plus a short second sequence, constant per-token gate on every head.
    x = make_gdn_inputs(1, 3 * SEG + 40 + 70, 2, 4, 128, 128, cu_seqlens=[3 * SEG + 40, 70], gate=gate,
                        special_heads=False, seed=3)
    x["scale"] = 128**-0.5
    args = {n: x[n] for n in ("q", "k", "v", "g", "beta", "scale", "initial_state", "cu_seqlens")}
    o, ht, info = cp.cp_gated_delta_rule_fwd(**args, output_final_state=True, segment_len=SEG, warmup_chunks=1, return_info=True)
    o_ref, ht_ref = recurrent_gated_delta_rule(**args, output_final_state=True)
    _, _, _, _, h, _ = chunk.chunk_gated_delta_rule_fwd(**args)
    return x, o, ht, info, o_ref, ht_ref, h


def _windows(gate):
    """(segment j, S_w [HV, K, V] exact state entering j's warm-up window, G_w [HV]) for every
    boundary j -> j + 1 inside a sequence."""
    x, _, _, info, _, _, h = truncated(gate)
    plan = info["plan"]
    lay = prepare_chunk_layout(1, x["q"].shape[1], x["cu_seqlens"], C)
    first_token = (lay.index[:, 0]).tolist()
    out = []
    for j in range(plan.M - 1):
        if bool(plan.last[j]):
            continue
        hi = int(plan.cu_seqlens[j + 1])
        window_start = hi - C  # one warm-up chunk
        c = first_token.index(window_start)
        out.append((j, h[0, c], info["G_w"][j]))
    return out


@pytest.mark.parametrize("gate", GATES, ids=[f"g={g}" for g in GATES])
def test_bound_cp4_states(gate):
    x, _, ht, info, _, ht_ref, _ = truncated(gate)
    plan = info["plan"]
    fro = lambda t: torch.linalg.matrix_norm(t).double()  # noqa: E731  [HV]
    checked = 0
    for j, S_w, G_w in _windows(gate):
        bound = G_w.exp() * fro(S_w)
        err = fro(info["S_start"][j + 1] - info["S_start_exact"][j + 1])
        floor = ROUND * fro(info["S_start_exact"][j + 1])
        assert bool((err <= bound * (1 + 1e-9) + floor).all()), f"CP-4 g={gate} segment {j + 1}: {err} > {bound}"
        # the final state of the sequence (later in the same affine chain) obeys the same bound
        n = int(plan.seq[j])
        if bool(plan.last[j + 1]):
            err_f = fro(ht[n] - ht_ref[n])
            assert bool((err_f <= bound * (1 + 1e-9) + ROUND * fro(ht_ref[n])).all()), f"CP-4 final state g={gate}"
        checked += 1
    assert checked >= 2
    if gate == 0.0:  # with no decay the dropped state is not negligible: the check is not vacuous
        assert float((info["S_start"] - info["S_start_exact"]).abs().max()) > 1e-3


@pytest.mark.parametrize("gate", GATES, ids=[f"g={g}" for g in GATES])
def test_bound_cp5_outputs(gate):
    x, o, _, info, o_ref, _, _ = truncated(gate)
    plan = info["plan"]
    scale = x["scale"]
    HV = o.shape[2]
    q = x["q"].repeat_interleave(HV // x["q"].shape[2], dim=2)[0]  # [T, HV, K]
    floor = ROUND * float(o_ref.abs().max())
    worst = 0.0
    for j, S_w, G_w in _windows(gate):
        lo, hi = int(plan.cu_seqlens[j + 1]), int(plan.cu_seqlens[j + 2])
        err = torch.linalg.vector_norm(o[0, lo:hi] - o_ref[0, lo:hi], dim=-1)  # [t, HV]
        bound = scale * torch.linalg.vector_norm(q[lo:hi], dim=-1) * G_w.exp() * torch.linalg.matrix_norm(S_w)
        assert bool((err <= bound * (1 + 1e-9) + floor).all()), f"CP-5 g={gate} segment {j + 1}: max excess {(err - bound).max():.3e}"
        big = bound > floor
        if bool(big.any()):
            worst = max(worst, float((err[big] / bound[big]).max()))
    assert worst < 1.0


def test_truncation_fallback_is_exact():
    # FlashQLA's fallback: a (segment, head) whose window decay is not below the threshold takes the
    # exact state, so with weak decay everywhere the truncated run is exact.
    x = truncated(-0.01)[0]
    args = {n: x[n] for n in ("q", "k", "v", "g", "beta", "scale", "initial_state", "cu_seqlens")}
    o, ht = cp.cp_gated_delta_rule_fwd(**args, output_final_state=True, segment_len=SEG, warmup_chunks=1, fallback_threshold=-10.0)
    o_ref, ht_ref = recurrent_gated_delta_rule(**args, output_final_state=True)
    assert rel_rms(o, o_ref) <= EXACT_TOL and rel_rms(ht, ht_ref) <= EXACT_TOL


def test_derivation_bounds_cover_the_twin_tests():
    # the bound the tests check is the one the records state
    assert "exp(G)" in derivations.get("CP-4").bound and "scale ||q_t||_2 exp(G)" in derivations.get("CP-5").bound

"""Every derivation record's numeric twins, in fp64 at full size (C = 64, K = V = 128).

Each record in `derivations` names the two reference functions computing its left and right sides;
its driver in `reference.gdn.twins` runs them on valid-domain inputs (`make_gdn_inputs`: L2-normalised q, k, sigmoid
beta, Qwen3-Next gates with a g == 0 head and a g == -30 head, GVA, an initial state) with T not a
multiple of 64, batched and varlen, and returns the pairs to compare. Exact records agree to <= 1e-12
relative RMS; bounded records (CP-4, CP-5) are checked against their bound at per-token g of 0,
-0.01, -1 and -30. A record without a driver fails `test_every_record_has_a_driver`.
"""

from __future__ import annotations

import functools
import importlib

import pytest
import torch

import derivations
from flashqla.testing import make_gdn_inputs, rel_rms
from reference.gdn import chunk, cp, fused, twins
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
def twin_pairs(case: str) -> dict:
    """record id -> [TwinPair] for every exact record, both sides evaluated by reference.gdn.twins
    (which calls the twins by the dotted names the records give)."""
    return twins.pairs_many(EXACT, inputs(case), chunk_size=C)


EXACT = [r.id for r in derivations.registry() if r.kind == "exact"]
BOUNDED = [r.id for r in derivations.registry() if r.kind == "bounded"]


def test_every_record_has_a_driver():
    missing = [r.id for r in derivations.registry() if r.kind == "exact" and not twins.has_driver(r.id)]
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
    pairs = twin_pairs(case)[rid]
    assert pairs, f"{rid}: no pair to compare"
    for p in pairs:
        assert p.lhs.dtype == p.rhs.dtype == torch.float64
        err = rel_rms(p.rhs, p.lhs)
        assert err <= EXACT_TOL, f"{rid} {p.quantity} [{case}]: relative RMS {err:.2e} > {EXACT_TOL:.0e}"


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

BOUNDED_TESTED = ("CP-4", "CP-5", "CP-6")
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


@pytest.mark.parametrize("gate", GATES, ids=[f"g={g}" for g in GATES])
def test_bound_cp6_transposed_map(gate):
    """CP-6: the transposed window map of every window (sequences of 1 to 200 tokens, windows of
    several chunks included) against exp(G) for random Y, and tight where there is no decay."""
    lengths = [1, 63, 64, 65, 130, 200]
    x = make_gdn_inputs(1, sum(lengths), 2, 4, 16, 8, cu_seqlens=lengths, gate=gate, special_heads=False, seed=5)
    P, _ = cp.segment_maps(x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x["cu_seqlens"])  # [N, HV, K, K]
    cu = x["cu_seqlens"].tolist()
    G = torch.stack([x["g"][0, cu[n]:cu[n + 1]].sum(0) for n in range(len(lengths))])  # [N, HV]
    Y = torch.randn(*P.shape[:2], 16, 8, generator=torch.Generator().manual_seed(7), dtype=P.dtype)
    lhs = torch.linalg.matrix_norm(P.transpose(-1, -2) @ Y)
    rhs = G.exp() * torch.linalg.matrix_norm(Y)
    assert bool((lhs <= rhs * (1 + 1e-9)).all()), f"CP-6 g={gate}: max ratio {(lhs / rhs).max():.6f}"
    if gate == 0.0:  # no decay: the bound is 1, and the map keeps a good part of Y (not vacuous)
        assert float((lhs / rhs).max()) > 0.3


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
    assert "exp(G) ||Y||_F" in derivations.get("CP-6").bound

"""Edge cases of the context-parallel planner (`flashqla.cp.plan.plan_cp`, `plan_for`,
`flashqla.cp.plan.cp_splits`, `flashqla.contract.cp_mode`): awkward but valid shapes, invalid
arguments, and regressions found by review of the backward plan / length-scenario change. CPU only."""

from __future__ import annotations

import math
import os
import subprocess
import sys
import textwrap

import pytest
import torch

import flashqla.cp.plan as P
from flashqla.contract import CP_ENV, cp_mode
from flashqla.cp.plan import (BWD_CHUNK_COST, BWD_WAVE_COST, CHUNK, CHUNK_COST, CTAS_PER_SM, UNSPLIT_CHUNK_COST, CPPlan, cp_splits,
                              plan_cp, plan_for, plan_key)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def _cdiv(a, b):
    return -(-a // b)


@pytest.fixture(autouse=True)
def _fresh_caches():
    P.clear_plan_cache()
    yield
    P.clear_plan_cache()


# ----------------------------------------------------------------------------------- regressions


@pytest.mark.parametrize(
    "HV,N,T,max_seqlen",
    [
        (32, 16, 16 * 4096, 16384),  # 16 sequences, at most 4 of them can be 16384 tokens long
        (16, 32, 32 * 2048, 4096),
        (8, 64, 64 * 1024, 2048),
    ],
)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_max_seqlen_hint_does_not_inflate_unsplit_cost(HV, N, T, max_seqlen, backward):
    """A max_seqlen hint bounds the longest sequence; it does not make every sequence that long (N *
    max_seqlen > T here). The unsplit cost is the module docstring's
    t(BV) max(ceil(l_max / 64), ceil(NV HV N / slots) ceil(l_avg / 64)) with l_avg = ceil(T / N) (t: UNSPLIT_CHUNK_COST
    forward, CHUNK_COST for the backward's states pass; one sequence's CTAs are fewer than half the SMs here), and
    can never exceed the list-scheduling bound (total CTA-chunks / slots + longest chain). Costing all
    N sequences at l_max quadruples it here and turns 'no split' into a predicted 1.3-2.5x split."""
    p = plan_cp(HV, N, T, 128, 132, exact=True, max_seqlen=max_seqlen, backward=backward)
    l_avg = _cdiv(T, N)
    bv = p.BV
    slots = 132 * CTAS_PER_SM[bv]
    NV = 128 // bv
    cost = CHUNK_COST if backward else UNSPLIT_CHUNK_COST  # the backward's states pass: CHUNK_COST
    formula = cost[bv] * max(_cdiv(max_seqlen, CHUNK), _cdiv(NV * HV * N, slots) * _cdiv(l_avg, CHUNK))
    bound = cost[bv] * (_cdiv(NV * HV * (_cdiv(T, CHUNK) + N), slots) + _cdiv(max_seqlen, CHUNK))
    if backward:  # plus the fused chunk backward: HV N CTAs, one per SM, BWD_CHUNK_COST per chunk, BWD_WAVE_COST a wave
        waves = _cdiv(HV * N, 132)
        formula += BWD_CHUNK_COST * max(_cdiv(max_seqlen, CHUNK), waves * _cdiv(l_avg, CHUNK)) + BWD_WAVE_COST * waves
        bound += (BWD_CHUNK_COST * (_cdiv(HV * (_cdiv(T, CHUNK) + N), 132) + _cdiv(max_seqlen, CHUNK))
                  + BWD_WAVE_COST * waves)
    assert p.est_unsplit <= bound, (p, bound)
    assert p.est_unsplit == pytest.approx(formula), (p, formula)
    assert not p.split, p  # the split is predicted slower than the (correctly costed) unsplit launch


def test_packed_backward_plan():
    """A packed batch (N > 1) is planned with the backward's own costs (`PACKED_BWD_OWN_PLAN`): two
    sequences of 4096 tokens in all at 16 value heads stay unsplit in the forward and split in the
    backward (at 8192 tokens both split; H200, the backward of the 8/16 7053 + 1139 row: 2.18 -> 1.09
    ms). force and a fixed segment_len act as for one sequence (the distributed backend passes
    both); PACKED_BWD_OWN_PLAN = False restores the forward's plan for every packed batch."""
    from flashqla.cp import plan as planner

    HV, N, T = 8, 8, 8 * 8192
    for L in (1024, 2048, 4096):
        b = plan_cp(HV, N, T, 128, 132, exact=True, segment_len=L, force=True, backward=True)
        assert b.split and b.segment_len == L, (L, b)
    auto_f = plan_cp(16, 2, 4096, 128, 132, exact=True)
    auto_b = plan_cp(16, 2, 4096, 128, 132, exact=True, backward=True)
    assert not auto_f.split and auto_b.split and "packed" not in auto_b.reason, (auto_f, auto_b)
    old = planner.PACKED_BWD_OWN_PLAN
    try:
        planner.PACKED_BWD_OWN_PLAN = False
        planner.clear_plan_cache()
        b = plan_cp(16, 2, 4096, 128, 132, exact=True, backward=True)
        assert (b.split, b.segment_len) == (auto_f.split, auto_f.segment_len) and "packed" in b.reason, b
        f = plan_cp(HV, N, T, 128, 132, exact=True, force=True)
        b = plan_cp(HV, N, T, 128, 132, exact=True, force=True, backward=True)
        assert b.split and (b.segment_len, b.BV) == (f.segment_len, f.BV), (f, b)
    finally:
        planner.PACKED_BWD_OWN_PLAN = old
        planner.clear_plan_cache()


def test_huge_T_plans_in_bounded_time():
    """T = 2**31 tokens (and shape-only queries on meta tensors) must not enumerate every 512-token
    segment length: that took ~55 s and ~2 GB for one plan, and an empty input (N = 0) paid it too
    before answering 'empty input'. Run in a subprocess so that a hang is cut off."""
    code = textwrap.dedent(
        """
        import math, torch
        from flashqla.cp.plan import cp_splits, plan_cp
        T = 2 ** 31
        p = plan_cp(1, 1, T, exact=True)
        assert p.split and p.segment_len % 64 == 0 and 0 < p.segment_len < T and math.isfinite(p.est_split), p
        b = plan_cp(1, 1, T, exact=True, backward=True)
        assert b.split and b.segment_len % 64 == 0 and 0 < b.segment_len < T, b
        e = plan_cp(8, 0, T)
        assert not e.split and e.reason == "empty input", e
        q = torch.empty(1, T, 1, 128, device="meta", dtype=torch.bfloat16)
        assert cp_splits(q, q, None, "auto", sm_count=132)
        print("ok")
        """
    )
    env = dict(os.environ, PYTHONPATH=ROOT + os.pathsep + os.environ.get("PYTHONPATH", ""))
    env.pop(CP_ENV, None)
    try:
        r = subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=env, capture_output=True, text=True,
                           timeout=10)
    except subprocess.TimeoutExpired:
        pytest.fail("plan_cp / cp_splits at T = 2**31 took more than 10 s")
    assert r.returncode == 0 and "ok" in r.stdout, r.stderr[-2000:]


# ------------------------------------------------------------------------------------- invariants


_CASES = [
    # HV, N, T, V, sm_count, kwargs
    (8, 0, 0, 128, 132, {}),
    (8, 0, 4096, 128, 132, {}),
    (8, 1, 0, 128, 132, {}),
    (8, 5, 3, 128, 132, {}),  # T < N
    (8, 5, 5, 128, 132, {}),  # T == N
    (8, 1, 63, 128, 132, {}),
    (8, 1, 64, 128, 132, {}),
    (8, 1, 65, 128, 132, {}),
    (2, 1, 32768, 64, 132, {}),
    (2, 1, 32768, 192, 132, {}),
    (2, 1, 32768, 128, 1, {}),
    (2, 3, 32768, 128, 1, {}),
    (2, 1, 32768, 128, 132, dict(max_seqlen=10**9)),
    (2, 1, 32768, 128, 132, dict(max_seqlen=0)),
    (2, 4, 32768, 128, 132, dict(max_seqlen=30000)),
    (2, 1, 32768, 128, 132, dict(gate_chunks=1)),
    (2, 1, 32768, 128, 132, dict(gate_chunks=10**6)),
    (64, 16, 16 * 8192, 128, 132, {}),
    (1, 1, 1 << 20, 128, 132, {}),
]


@pytest.mark.parametrize("case", _CASES, ids=[str(i) for i in range(len(_CASES))])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
@pytest.mark.parametrize("exact", [False, True], ids=["gated", "exact"])
def test_plan_invariants(case, backward, exact):
    """The rule's output on awkward shapes: a split has a positive multiple-of-64 segment shorter than
    the longest possible sequence and a finite estimate; the plan is deterministic (cached == fresh)."""
    HV, N, T, V, sms, kw = case
    p = plan_cp(HV, N, T, V, sms, exact=exact, backward=backward, **kw)
    assert p == plan_cp.__wrapped__(HV, N, T, V, sms, exact=exact, backward=backward, **kw)
    assert p.reason and isinstance(p.reason, str)
    assert math.isfinite(p.est_unsplit) and p.est_unsplit >= 0
    assert p.est_split is None or (math.isfinite(p.est_split) and p.est_split >= 0)
    assert p.BV in (128, 64) and V % p.BV == 0
    longest = T if kw.get("max_seqlen") is None else max(0, min(kw["max_seqlen"], T))
    if N == 0 or T == 0:
        assert not p.split and p.reason == "empty input"
    if p.split:
        L = p.segment_len
        assert isinstance(L, int) and L > 0 and L % CHUNK == 0
        assert L < longest, p
        assert p.est_split is not None and p.est_unsplit >= (P.BWD_MIN_GAIN if backward else P.MIN_GAIN) * p.est_split * (1 - 1e-9), p
    else:
        assert p.segment_len is None


@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_overrides_with_backward(backward):
    assert not plan_cp(2, 1, 32768, disable=True, backward=backward).split
    assert "disabled" in plan_cp(2, 1, 32768, disable=True, backward=backward).reason
    p = plan_cp(32, 1, 100, force=True, backward=backward)  # shorter than one segment: forced anyway
    assert p.split and p.segment_len % CHUNK == 0 and "forced" in p.reason
    p = plan_cp(2, 1, 32768, segment_len=4096, exact=True, backward=backward)
    assert p.split and p.segment_len == 4096
    p = plan_cp(2, 1, 32768, segment_len=4096, force=True, exact=True, backward=backward)
    assert p.split and p.segment_len == 4096
    # one sequence: the backward's costs (BWD_CHUNK_COST) make its unsplit estimate larger
    f, b = plan_cp(2, 1, 32768, exact=True), plan_cp(2, 1, 32768, exact=True, backward=True)
    assert b.est_unsplit > f.est_unsplit


@pytest.mark.parametrize(
    "kw",
    [
        dict(HV=0), dict(N=-1), dict(T=-1), dict(V=0), dict(V=96), dict(V=1), dict(sm_count=0),
        dict(segment_len=0), dict(segment_len=-64), dict(segment_len=100), dict(gate_chunks=0),
        dict(force=True, disable=True),
    ],
    ids=lambda kw: ",".join(f"{k}={v}" for k, v in kw.items()),
)
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_bad_arguments_raise_value_error(kw, backward):
    args = dict(HV=8, N=1, T=32768, V=128, sm_count=132)
    flags = {k: kw[k] for k in ("segment_len", "gate_chunks", "force", "disable") if k in kw}
    args.update({k: v for k, v in kw.items() if k not in flags})
    for N in {args["N"], 3 if args["N"] >= 0 else args["N"]}:  # one sequence and the packed path
        with pytest.raises(ValueError):
            plan_cp(args["HV"], N, args["T"], args["V"], args["sm_count"], backward=backward, **flags)


def test_plan_key_separates_forward_and_backward():
    q = torch.empty(1, 32768, 2, 128, device="meta", dtype=torch.bfloat16)
    kf, kb = plan_key(q, q, exact=True), plan_key(q, q, exact=True, backward=True)
    assert kf != kb and kb.backward is True and kf.backward is False and kf._replace(backward=True) == kb
    pf = plan_for(q, q, exact=True)
    pb = plan_for(q, q, exact=True, backward=True)
    assert P.plan_cache_info().currsize == 2 and isinstance(pf, CPPlan) and isinstance(pb, CPPlan)
    assert pf == plan_cp(2, 1, 32768, 128, P.DEFAULT_SM_COUNT, exact=True)
    assert pb == plan_cp(2, 1, 32768, 128, P.DEFAULT_SM_COUNT, exact=True, backward=True)
    assert pf.est_unsplit != pb.est_unsplit
    # repeated lookups hit the cache and return the same objects
    assert plan_for(q, q, exact=True, backward=True) is pb
    assert P.plan_cache_info().hits == 1


@pytest.mark.parametrize("device", ["cpu", "meta"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize("backward", [False, True], ids=["fwd", "bwd"])
def test_cp_splits_shapes_only(device, cu_dtype, backward, monkeypatch):
    monkeypatch.delenv(CP_ENV, raising=False)
    q = torch.empty(1, 32768, 2, 128, device=device, dtype=torch.bfloat16)
    one = torch.tensor([0, 32768], dtype=cu_dtype, device=device)
    empty = torch.tensor([0], dtype=cu_dtype, device=device)  # N = 0
    none = torch.tensor([], dtype=cu_dtype, device=device)  # not even cu[0]: unreadable, no split
    assert cp_splits(q, q, None, "auto", sm_count=132, backward=backward)
    assert cp_splits(q, q, one, None, sm_count=132, backward=backward)  # default "auto"
    assert cp_splits(q, q, one, "on", sm_count=132, backward=backward)
    assert not cp_splits(q, q, one, "off", sm_count=132, backward=backward)
    for cu in (empty, none):
        for mode in ("auto", "on"):
            assert cp_splits(q, q, cu, mode, sm_count=132, backward=backward) is False
    small = torch.empty(1, 4096, 64, 128, device=device, dtype=torch.bfloat16)
    assert not cp_splits(small, small, None, "auto", sm_count=132, backward=False)


@pytest.mark.parametrize("value", ["", "AUTO", " auto", "on ", "1", "true", "None", "yes"])
def test_cp_env_odd_values_raise_naming_cp(value, monkeypatch):
    monkeypatch.setenv(CP_ENV, value)
    with pytest.raises(ValueError, match=r"\bcp\b"):
        cp_mode(None)
    q = torch.empty(1, 32768, 2, 128, device="meta", dtype=torch.bfloat16)
    with pytest.raises(ValueError, match=r"\bcp\b"):
        cp_splits(q, q)
    assert cp_mode("off") == "off" and cp_mode(True) == "on" and cp_mode(False) == "off"


def test_cp_default_is_auto(monkeypatch):
    monkeypatch.delenv(CP_ENV, raising=False)
    assert cp_mode(None) == "auto"
    for bad in (1, 0, 1.0, [], "Auto"):
        with pytest.raises(ValueError, match=r"\bcp\b"):
            cp_mode(bad)

"""The backward planner costed on every sequence's length (`flashqla.cp.planner.plan_cp(seqlens=...)`):
the launch-order schedule it simulates, the checks on the hint, the cache keys, and its choices on the
H200 sweep it was fitted on (benchmarks/results/h200-cp-train-sweep.json)."""

from __future__ import annotations

import heapq
import json
import os
import random

import pytest
import torch

from flashqla.cp import planner as P

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SWEEP = os.path.join(ROOT, "benchmarks", "results", "h200-cp-train-sweep.json")


def _one_by_one(runs, slots):
    """The greedy schedule CTA by CTA: each CTA, in launch order, to the SM free first."""
    free = [0] * slots
    heapq.heapify(free)
    end = 0
    for chunks, count in runs:
        for _ in range(count):
            t = heapq.heappop(free) + chunks
            end = max(end, t)
            heapq.heappush(free, t)
    return end


@pytest.mark.parametrize("seed", range(40))
def test_makespan_equals_the_cta_by_cta_schedule(seed):
    rng = random.Random(seed)
    slots = rng.choice([1, 2, 7, 16, 132])
    runs = [(rng.randint(1, 40), rng.randint(1, 300)) for _ in range(rng.randint(1, 12))]
    assert P._greedy_makespan(runs, slots) == _one_by_one(runs, slots)


def test_runs_follow_the_launch_order():
    # 7212 + 25556 tokens at L = 4096, 16 value heads: segment-major, value heads fastest, equal
    # neighbours merged; empty sequences launch nothing
    runs, segs, most = P._lengths_runs((7212, 0, 25556), 4096, 16)
    assert runs == [[64, 16], [49, 16], [64, 6 * 16], [16, 16]]
    assert (segs, most) == (9, 7)
    runs, segs, most = P._lengths_runs((7212, 25556), None, 16)
    assert runs == [[113, 16], [400, 16]] and (segs, most) == (2, 1)
    assert P._greedy_makespan(P._lengths_runs((7212, 25556), 4096, 16)[0], 132) == 64


@pytest.mark.parametrize("bad", [(4096,), (4096, 4095), (4096, -1, 4097), (4096.0, 4096), (True, 8191)])
def test_bad_seqlens_name_the_argument(bad):
    with pytest.raises(ValueError, match="seqlens"):
        P.plan_cp(8, 2, 8192, backward=True, seqlens=bad)
    with pytest.raises(TypeError):  # plans are cached on their arguments: a tuple, not a list
        P.plan_cp(8, 2, 8192, backward=True, seqlens=list(bad))


def test_the_lengths_below_the_longest_change_the_plan():
    """Same N, T and longest sequence; where the other tokens sit decides L (the mean-and-longest model
    cannot see it), and the plan cache keeps the two apart."""
    P.clear_plan_cache()
    a = P.plan_cp(8, 3, 8192, 128, 16, force=True, backward=True, seqlens=(512, 512, 7168))
    b = P.plan_cp(8, 3, 8192, 128, 16, force=True, backward=True, seqlens=(1024, 0, 7168))
    c = P.plan_cp(8, 3, 8192, 128, 16, force=True, backward=True, max_seqlen=7168)
    assert a.split and b.split and c.split
    assert len({a.segment_len, b.segment_len, c.segment_len}) > 1, (a, b, c)
    q = torch.empty(1, 8192, 4, 128)
    v = torch.empty(1, 8192, 8, 128)
    cu = torch.tensor([0, 512, 1024, 8192])
    keys = {P.plan_key(q, v, cu, backward=True, seqlens=s) for s in ((512, 512, 7168), (1024, 0, 7168), None)}
    assert len(keys) == 3
    # a forward plan's key drops the lengths (only the backward's costs read them)
    assert P.plan_key(q, v, cu, seqlens=(512, 512, 7168)).seqlens is None


def test_one_sequence_keeps_the_fitted_one_sequence_model():
    for HV, T in ((8, 8192), (32, 32768), (4, 32768)):
        a = P.plan_cp(HV, 1, T, backward=True, seqlens=(T,))
        b = P.plan_cp(HV, 1, T, backward=True, max_seqlen=T)
        assert (a.split, a.segment_len, a.est_unsplit) == (b.split, b.segment_len, b.est_unsplit)


def _sweep():
    with open(SWEEP) as fh:
        data = json.load(fh)
    rows = {}
    for r in data["rows"]:
        assert r["ok"] and r["step_ms"] > 0, r
        rows.setdefault(r["row"], {})[r["L"]] = r["step_ms"]
    return rows


def test_plans_on_the_measured_sweep():
    """On each swept row, the L (or unsplit) the plan picks among the measured ones is within 2% of the
    fastest measured training step (the mean-and-longest model: up to 1.25x slower on these rows)."""
    from flashqla.bench.bwd_grid import select_bwd_rows

    rows = _sweep()
    assert len(rows) == 10
    worse_old = 0
    for name, steps in rows.items():
        heads, mix = name.split()
        (row,) = select_bwd_rows([heads], [mix])
        lens, HV = tuple(row.mix.lengths), row.heads.h_v
        measured = [L for L in steps if L is not None]
        plan = P.plan_cp(HV, len(lens), sum(lens), backward=True, seqlens=lens, segment_len=None)
        # the model's choice restricted to the measured lengths (the sweep did not time every L)
        t = {L: P._bwd_lengths_time(lens, L, HV, P.DEFAULT_SM_COUNT) for L in measured}
        t[None] = P._bwd_lengths_time(lens, None, HV, P.DEFAULT_SM_COUNT)
        best_model = min(measured, key=lambda L: (t[L], -L))
        pick = best_model if t[None] >= P.BWD_MIN_GAIN * t[best_model] else None
        assert steps[pick] <= 1.02 * min(steps.values()), (name, pick, steps)
        assert plan.split == (pick is not None), (name, plan)
        old = P.plan_cp(HV, len(lens), sum(lens), backward=True, max_seqlen=-(-max(lens) // 64) * 64)
        worse_old += steps.get(old.segment_len if old.split else None, float("inf")) > 1.02 * min(steps.values())
    assert worse_old >= 5  # the rows the lengths fix (the old plans on the same data)

"""Does the forward planner's cost model (with the host-side length hint) pick the fastest split on
packed rows? The split forward timed over segment lengths and value-slice widths, beside the
planner's estimate for each, the data to recalibrate its costs.

Run on the GPU machine (`source .device/on-device.sh` first):

    python benchmarks/experiments/cp_length_sweep.py [--rows "16/32 28672+4096" ...] [--lengths 2048 4096 ...] [--out DIR]

Per row (the forward benchmark's inputs: `flashqla.testing.make_gdn_inputs`, packed int32 offsets,
Qwen3-Next gates with the g == 0 and g = -30 heads, initial state given; ROW in the benchmark's
notation, `flashqla.bench.grid`): the unsplit forward and the split forward at every L of `--lengths`
below the longest sequence (default 1024 to 8192) and BV 64 and 128 (`chunk_gated_delta_rule_fwd`
with cp="off" / cp="on", segment_len, block_v, for_backward=False), each CUDA-graph timed
(`_gpu.time_graph`, median) and gated against the unsplit output (relative RMS of o <= 1e-2).
Beside each time: the planner's estimate in chunk units (`flashqla.cp.plan._split_time` /
`_unsplit_time` with the row's true longest sequence, as `cu_seqlens_cpu` gives it) and its implied
us per unit; the plan `plan_cp(max_seqlen=...)` picks is marked. A row whose cheapest measured plan is
not the picked one is the data a recalibration needs. The default rows mix one long and one short
sequence.

Writes cp_length_sweep.json (one entry per row and setting: row, L, BV, ms, est, err, picked) to
--out (default $OUT, else the working directory), rewritten after every row, and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, HERE]

from _gpu import time_graph  # noqa: E402

ROWS = ["16/32 28672+4096", "8/32 28672+4096", "2/8 6144+2048", "2/8 1024+7168", "8/24 12288+4096",
        "16/64 28672+4096"]
LENGTHS = [1024, 1536, 2048, 3072, 4096, 6144, 8192]


def estimates(HV, lengths, L, BV):
    """(split estimate at L and BV, unsplit estimate, picked plan) in chunk units, true longest length."""
    import flashqla.cp.plan as P

    T, N, lm = sum(lengths), len(lengths), max(lengths)
    hint = -(-lm // 64) * 64
    l_avg = -(-T // N)
    plan = P.plan_cp(HV, N, T, exact=True, max_seqlen=hint)
    split = P._split_time(BV, HV, 128, T, N, L, l_avg, hint, False, P.DEFAULT_SM_COUNT, True, None)
    unsplit = P._unsplit_time(plan.BV, HV, 128, N, min(l_avg, hint), hint, P.DEFAULT_SM_COUNT)
    return split, unsplit, plan


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=ROWS)
    ap.add_argument("--lengths", nargs="+", type=int, default=LENGTHS)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)

    from flashqla.bench.grid import parse_heads, parse_mix
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd
    from flashqla.testing import make_gdn_inputs

    results = []
    for row in a.rows:
        heads, mix = row.split()
        h = parse_heads(heads)
        lengths = list(parse_mix(mix).lengths)
        H, HV, T = h.h_qk, h.h_v, sum(lengths)
        x = make_gdn_inputs(1, T, H, HV, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda",
                            gate="qwen3next", special_heads=True, initial_state=True, seed=0)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5, x["initial_state"], True, x["cu_seqlens"])
        off = lambda: chunk_gated_delta_rule_fwd(*args, cp="off", for_backward=False)  # noqa: E731
        o_ref = off().o.double()
        _, unsplit_est, plan = estimates(HV, lengths, LENGTHS[0], 128)
        t_off = time_graph(off)
        results.append(dict(row=row, L=None, BV=None, ms=t_off, est=unsplit_est, err=0.0, picked=not plan.split))
        print(results[-1], flush=True)
        for L in a.lengths:
            if L >= max(lengths) or L % 64:
                continue
            for BV in (64, 128):
                fn = lambda L=L, BV=BV: chunk_gated_delta_rule_fwd(*args, cp="on", segment_len=L, block_v=BV,  # noqa: E731
                                                                   for_backward=False)
                try:
                    o = fn().o.double()
                    err = float((o - o_ref).norm() / o_ref.norm())
                    ms = time_graph(fn) if err <= 1e-2 else float("nan")
                except Exception as exc:  # a failing configuration is reported, the sweep goes on
                    print(f"{row} L={L} BV={BV}: {type(exc).__name__}: {exc}", flush=True)
                    continue
                est = estimates(HV, lengths, L, BV)[0]
                picked = plan.split and plan.segment_len == L and plan.BV == BV
                results.append(dict(row=row, L=L, BV=BV, ms=ms, est=est, err=err, picked=picked))
                print(results[-1], flush=True)
        with open(os.path.join(a.out, "cp_length_sweep.json"), "w") as f:
            json.dump(results, f, indent=1)
    print("\n== split forward over L and BV (ms, CUDA graphs, median; est = planner chunk units; * = the plan picked)")
    print(f"{'row':18s} {'L':>6s} {'BV':>4s} {'ms':>8s} {'est':>7s} {'us/unit':>8s} {'o vs unsplit':>12s}")
    for r in results:
        L = "off" if r["L"] is None else str(r["L"])
        BV = "-" if r["BV"] is None else str(r["BV"])
        per = 1e3 * r["ms"] / r["est"] if r["est"] else float("nan")
        print(f"{r['row']:18s} {L:>6s} {BV:>4s} {r['ms']:8.3f} {r['est']:7.1f} {per:8.2f} {r['err']:12.1e}"
              + (" *" if r["picked"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

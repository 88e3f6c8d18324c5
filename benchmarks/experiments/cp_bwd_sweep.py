"""Does the backward planner's cost model (`flashqla.cp.plan`: BWD_CHUNK_COST, BWD_SCAN_STEP_COST)
put its optimum where the measured one is? The backward timed unsplit and split at a list of segment
lengths, beside the planner's estimate for each, the data to recalibrate those costs.

Run on the GPU machine (`source .device/on-device.sh` first):

    python benchmarks/experiments/cp_bwd_sweep.py [--rows "4/8 1x8192" "4/8 3274+1029+..." ...] [--lengths 512 1024 ...] [--out DIR]

Per row ("h_qk/h_v MIX", MIX COUNTxLENGTH or a+b+..., `_gpu.parse_row`; the backward benchmark's
inputs: `flashqla.testing.make_gdn_inputs`, packed int32 offsets, Qwen3-Next gates with the g == 0 and
g = -30 heads, dht given, no initial state): one forward, then `chunk_gated_delta_rule_bwd` with
cp="off" and with cp="on", segment_len=L at every L of `--lengths` below the longest sequence, each
CUDA-graph timed (`_gpu.time_graph`, median) and gated against the unsplit gradients (relative RMS of
each of dq, dk, dv, dg, dbeta <= 1e-2). Beside each time: the planner's estimate in chunk units
(`flashqla.cp.plan._split_time(backward=True)` / `_unsplit_bwd_time` with the row's true longest
length) and the row's true segment count. The plan `plan_cp(backward=True, max_seqlen=...)` picks is
marked `*`.

Writes cp_bwd_sweep.json (one entry per row and L: row, L, ms, est, err, segs, picked) to --out
(default $OUT, else the working directory), rewritten after every row, and prints a table last.
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

from _gpu import parse_row, time_graph  # noqa: E402

ROWS = ["4/8 1x8192", "16/32 1x8192", "4/8 1x32768", "4/8 3274+1029+2909+5061+2011+3793+9932+4759",
        "16/32 161+1928+3157+563+1244+229+177+733"]
LENGTHS = [512, 768, 1024, 1536, 2048, 2560, 3072, 4096, 6144, 8192]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=ROWS)
    ap.add_argument("--lengths", nargs="+", type=int, default=LENGTHS)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)

    import flashqla.cp.plan as P
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd
    from flashqla.testing import make_gdn_inputs

    results = []
    names = ("dq", "dk", "dv", "dg", "dbeta")
    for row in a.rows:
        H, HV, lengths = parse_row(row)
        T, N = sum(lengths), len(lengths)
        lm = max(lengths)
        x = make_gdn_inputs(1, T, H, HV, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda",
                            gate="qwen3next", special_heads=True, seed=0)
        q, k, v, g, beta, cu = x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"]
        scale = 128**-0.5
        f = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, None, True, cu, max_seqlen=lm)
        gen = torch.Generator(device="cuda").manual_seed(1)
        do = torch.randn(f.o.shape, device="cuda", generator=gen).to(f.o.dtype)
        dht = torch.randn(f.final_state.shape, device="cuda", generator=gen)
        base = (f.q, f.k, v, g, beta, f.A, f.g_cum_log2, do, dht, scale, None, cu)
        off = lambda: chunk_gated_delta_rule_bwd(*base, cp="off")  # noqa: E731
        ref = [t.double() for t in off()[:5]]
        plan = P.plan_cp(HV, N, T, exact=True, max_seqlen=lm, backward=True)
        l_avg = -(-T // N)
        est_off = P._unsplit_bwd_time(128, HV, 128, N, min(l_avg, lm), lm, P.DEFAULT_SM_COUNT)
        results.append(dict(row=row, L=None, ms=time_graph(off), est=est_off, err=0.0, picked=not plan.split,
                            segs=N))
        print(results[-1], flush=True)
        for L in a.lengths:
            if L >= lm or L % 64:
                continue
            fn = lambda L=L: chunk_gated_delta_rule_bwd(*base, cp="on", segment_len=L, max_seqlen=lm)  # noqa: E731
            try:
                out = [t.double() for t in fn()[:5]]
                err = max(float((o - r).norm() / r.norm()) for o, r in zip(out, ref))
                ms = time_graph(fn) if err <= 1e-2 else float("nan")
            except Exception as exc:  # a failing configuration is reported, the sweep goes on
                print(f"{row} L={L}: {type(exc).__name__}: {exc}", flush=True)
                continue
            est = P._split_time(128, HV, 128, T, N, L, l_avg, lm, N == 1, P.DEFAULT_SM_COUNT, True, None,
                                backward=True)
            segs = sum(-(-n // L) for n in lengths)
            results.append(dict(row=row, L=L, ms=ms, est=est, err=err, segs=segs,
                                picked=plan.split and plan.segment_len == L))
            print(results[-1], flush=True)
        with open(os.path.join(a.out, "cp_bwd_sweep.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    print(f"\n== backward over L (ms, CUDA graphs, median; est = planner chunk units; * = the plan picked; "
          f"err = max over {', '.join(names)} of the relative RMS to the unsplit backward)")
    print(f"{'row':22s} {'L':>6s} {'segs':>5s} {'ms':>8s} {'est':>7s} {'err':>8s}")
    for r in results:
        L = "off" if r["L"] is None else str(r["L"])
        print(f"{r['row'][:22]:22s} {L:>6s} {r['segs']:5d} {r['ms']:8.3f} {r['est']:7.1f} {r['err']:8.1e}"
              + (" *" if r["picked"] else ""))
    return 0


if __name__ == "__main__":
    sys.exit(main())

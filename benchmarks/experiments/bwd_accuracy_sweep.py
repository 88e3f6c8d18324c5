"""Is our backward's gradient error systematically above FLA's, or is a gap on one case the spread of
one sample? Our gradient errors and FLA's on the same inputs, over many seeds and lengths.

Run on the GPU machine with FLA importable (`source .device/on-device.sh` first):

    python benchmarks/experiments/bwd_accuracy_sweep.py [--seeds 8] [--lengths 63 64 65 200 1000] [--dtype fp16] [--out DIR]

Inputs as `tests/gpu/test_bwd_gpu.py::test_lengths` (that module's input, reference and FLA helpers:
`make_gdn_inputs`, 2 q/k heads, 4 value heads, value head 0 with g == 0 and the last with g = -30,
bf16 q/k/v/do (fp16 with --dtype fp16: issue 45's fp16 rule), fp32 g/beta/states, initial state and dht given), one case per (seed, T), seed
1000 i + T. Per case: relative RMS against the fp64 reference of every gradient, ours and FLA's
(`fla.ops.gated_delta_rule.chunk_gated_delta_rule` through autograd), and the GPU tier's rule
(ours <= 1.1 x FLA + 1e-4). Per quantity, over the cases: the geometric mean of ours / FLA, the cases
within the rule, and the worst ratio.

Writes bwd_accuracy_sweep.json (bwd_accuracy_sweep_fp16.json with --dtype fp16; one row per case: T, seed, ours_<grad>, fla_<grad>) to --out (default
$OUT, else the working directory; H200 runs are committed as benchmarks/results/h200-bwd-accuracy-*.json,
and `flashqla.testing.FLA_BWD_SWEEP_ERRORS` holds FLA's errors from them) and prints a table last.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=8)
    ap.add_argument("--lengths", nargs="+", type=int, default=[63, 64, 65, 200, 1000])
    ap.add_argument("--dtype", choices=("bf16", "fp16"), default="bf16", help="q, k, v and do (g, beta, states fp32)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)

    import torch

    from flashqla.testing import rel_rms
    from tests.gpu import test_bwd_gpu as tb  # skips (raises) without a Hopper GPU

    if tb.fla_chunk_gated_delta_rule is None:
        raise SystemExit("FLA is not importable (or FLASHQLA_TEST_WITH_FLA=0): nothing to compare with")
    scale = 128**-0.5
    dtype = {"bf16": torch.bfloat16, "fp16": torch.float16}[a.dtype]
    rows = []
    for T in a.lengths:
        for seed in range(a.seeds):
            s = 1000 * seed + T  # seed 0 is the tier's own case (seed T)
            xd = tb._inputs(seed=s, dtype=dtype, B=1, T=T, H=2, HV=4)
            ref = tb._reference(xd, scale)
            ours, _ = tb._ours(xd, scale)
            fla = tb._fla(xd, scale)
            if isinstance(fla, Exception):
                raise fla
            row = {"T": T, "seed": s}
            for n in NAMES:
                row[f"ours_{n}"] = rel_rms(ours[n], ref[n])
                row[f"fla_{n}"] = rel_rms(fla[n], ref[n])
            rows.append(row)
            print(f"T={T} seed={s} " + " ".join(f"{n} {row[f'ours_{n}']:.2e}/{row[f'fla_{n}']:.2e}" for n in NAMES),
                  flush=True)
    name = "bwd_accuracy_sweep.json" if a.dtype == "bf16" else f"bwd_accuracy_sweep_{a.dtype}.json"
    with open(os.path.join(a.out, name), "w") as f:
        json.dump(rows, f, indent=1)
    print(f"\n{len(rows)} {a.dtype} cases (ours / FLA, relative RMS against fp64)")
    print("| quantity | geo-mean ours / FLA | cases within 1.1 x FLA + 1e-4 | worst ours / FLA | mean ours | mean FLA |")
    print("|---|---|---|---|---|---|")
    for n in NAMES:
        r = [x[f"ours_{n}"] / x[f"fla_{n}"] for x in rows]
        ok = sum(x[f"ours_{n}"] <= 1.1 * x[f"fla_{n}"] + 1e-4 for x in rows)
        gm = math.exp(sum(math.log(v) for v in r) / len(r))
        mo = sum(x[f"ours_{n}"] for x in rows) / len(rows)
        mf = sum(x[f"fla_{n}"] for x in rows) / len(rows)
        print(f"| {n} | {gm:.3f} | {ok}/{len(rows)} | {max(r):.2f} | {mo:.2e} | {mf:.2e} |")
    torch.cuda.synchronize()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

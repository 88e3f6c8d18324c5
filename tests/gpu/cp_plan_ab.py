"""One call on the GPU machine: the split forward of chosen rows under given plans, side by side, to
check a change of the planner's costs on the rows whose plans it changes.

    python tests/gpu/cp_plan_ab.py --rows "2/8 1x2048:off:512/64" "16/64 1x8192:off:4096/128" ...

ROW:PLAN:PLAN...: "h_qk/h_v MIX" in the benchmark's notation (`flashqla.bench.grid.parse_mix`: 8192x4
is four sequences of 8192 tokens), then plans, each "off" (unsplit) or "L/BV" (split at segment
length L with value slices of BV). Inputs of the forward benchmark (`make_gdn_inputs`: packed int32
offsets, Qwen3-Next gates with the g == 0 and g = -30 heads, initial state given). Each plan is
CUDA-graph timed (median) after a gate: its o against the unsplit o, relative RMS <= 1e-2. Prints a
table last (ms per plan, the fastest marked), writes cp_plan_ab.json to --out. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.device_check import time_graph  # noqa: E402


def main(argv=None) -> int:
    from flashqla.bench.grid import parse_heads, parse_mix
    from flashqla.cp.driver import chunk_gated_delta_rule_cp_fwd
    from flashqla.testing import make_gdn_inputs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", required=True)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    results, ok = [], True
    for spec in a.rows:
        row, *plans = spec.split(":")
        heads, mix = row.split()
        h = parse_heads(heads)
        lengths = list(parse_mix(mix).lengths)
        T = sum(lengths)
        x = make_gdn_inputs(1, T, h.h_qk, h.h_v, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda",
                            gate="qwen3next", special_heads=True, initial_state=True, seed=0)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5, x["initial_state"], True, x["cu_seqlens"])
        o_ref = chunk_gated_delta_rule_cp_fwd(*args, cp="off", relayout=False).o.double()
        cells = {}
        for plan in plans:
            if plan == "off":
                fn = lambda: chunk_gated_delta_rule_cp_fwd(*args, cp="off", relayout=False)  # noqa: E731
            else:
                L, BV = (int(v) for v in plan.split("/"))
                fn = lambda L=L, BV=BV: chunk_gated_delta_rule_cp_fwd(*args, cp="on", segment_len=L, block_v=BV,  # noqa: E731
                                                                      relayout=False)
            err = float((fn().o.double() - o_ref).norm() / o_ref.norm())
            ok &= err <= 1e-2
            cells[plan] = (time_graph(fn) if err <= 1e-2 else float("nan"), err)
        results.append(dict(row=row, plans={k: dict(ms=v[0], err=v[1]) for k, v in cells.items()}))
        print(results[-1], flush=True)
    with open(os.path.join(a.out, "cp_plan_ab.json"), "w") as f:
        json.dump(results, f, indent=1)
    print("\n== split forward under given plans (ms, CUDA graphs, median; * fastest; err = o vs unsplit)")
    for r in results:
        best = min(r["plans"], key=lambda k: r["plans"][k]["ms"])
        print(f"{r['row']:22s} " + "  ".join(f"{k:>9s} {v['ms']:.3f}{'*' if k == best else ' '} ({v['err']:.0e})"
                                             for k, v in r["plans"].items()))
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

"""Does a change of the forward planner's cost constants pick faster plans on the rows whose plans it
changes? The split forward of chosen rows under given plans, side by side.

Run on the GPU machine (`source .device/on-device.sh` first):

    python benchmarks/experiments/cp_plan_ab.py --rows "2/8 1x2048:off:512/64" "16/64 1x8192:off:4096/128" ... [--out DIR]
    python benchmarks/experiments/cp_plan_ab.py --changed-by "CHUNK_COST[128]=1.35" [--list]

ROW:PLAN:PLAN...: "h_qk/h_v MIX" in the benchmark's notation (`flashqla.bench.grid.parse_mix`: 8192x4
is four sequences of 8192 tokens), then plans, each "off" (unsplit) or "L/BV" (split at segment
length L with value slices of BV), or "off/BV" (unsplit at value slices of BV; "off" takes
`recurrent.pick_block_v`'s). Inputs of the forward benchmark (`make_gdn_inputs`: packed int32
offsets, Qwen3-Next gates with the g == 0 and g = -30 heads, initial state given). Each plan is
CUDA-graph timed (`_gpu.time_graph`, median) after a gate: its o against the unsplit o, relative RMS
<= 1e-2.

--changed-by instead of --rows: every row of the forward grid and the CP grid whose forward plan
(with the benchmark's length hint) changes when the planner's constants are set as given (NAME=VALUE
or NAME[KEY]=VALUE, comma-separated, names of `flashqla.cp.plan`), timed under its plan now and under
the candidate's; --list prints those row specs and exits (no GPU needed; tests/test_cp_planner.py
runs `changed_rows` on the CPU).

Writes cp_plan_ab.json (per row: ms and error per plan) to --out (default $OUT, else the working
directory) and prints a table last (ms per plan, the fastest marked).
"""
from __future__ import annotations

import argparse
import json
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def _plan_text(p) -> str:
    return f"{p.segment_len}/{p.BV}" if p.split else "off"


def grid_plans() -> dict:
    """{"h_qk/h_v MIX": plan text} for every forward-grid and CP-grid row, as the benchmark's op
    plans it (the longest length as the hint; "off" when not split)."""
    import flashqla.cp.plan as P
    from flashqla.bench.grid import H200_SMS, cp_grid_rows, fwd_rows

    P.clear_plan_cache()
    out = {}
    for r in fwd_rows() + cp_grid_rows():
        lengths = list(r.mix.lengths)
        p = P.plan_cp(r.heads.h_v, len(lengths), sum(lengths), 128, H200_SMS, max_seqlen=max(lengths))
        out[f"{r.heads.h_qk}/{r.heads.h_v} {r.mix.label}"] = _plan_text(p)
    return out


def changed_rows(assignments: str) -> list[str]:
    """Row specs "ROW:PLAN_NOW:PLAN_CANDIDATE" of the grid rows whose plan changes under the planner
    constants `assignments` ("NAME=VALUE" or "NAME[KEY]=VALUE", comma-separated); the planner's
    constants are restored afterwards."""
    import re

    import flashqla.cp.plan as P

    saved = {}
    now = grid_plans()
    try:
        for item in filter(None, (x.strip() for x in assignments.split(","))):
            m = re.fullmatch(r"([A-Z_]+)(?:\[(\d+)\])?=([-+.\deE]+)", item)
            if not m or not hasattr(P, m.group(1)):
                raise SystemExit(f"--changed-by: cannot read {item!r} (NAME=VALUE or NAME[KEY]=VALUE of flashqla.cp.plan)")
            name, key, value = m.group(1), m.group(2), float(m.group(3))
            if name not in saved:
                cur = getattr(P, name)
                saved[name] = dict(cur) if isinstance(cur, dict) else cur
            if key is None:
                setattr(P, name, value)
            else:
                getattr(P, name)[int(key)] = value
        cand = grid_plans()
    finally:
        for name, value in saved.items():
            if isinstance(value, dict):
                getattr(P, name).clear()
                getattr(P, name).update(value)
            else:
                setattr(P, name, value)
        P.clear_plan_cache()
    return [f"{row}:{now[row]}:{cand[row]}" for row in now if now[row] != cand[row]]


def main(argv=None) -> int:
    from flashqla.bench.grid import parse_heads, parse_mix

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+")
    ap.add_argument("--changed-by", metavar="ASSIGNMENTS",
                    help='rows whose plan changes under these planner constants, e.g. "CHUNK_COST[128]=1.35"')
    ap.add_argument("--list", action="store_true", help="print the row specs and exit")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    if bool(a.rows) == bool(a.changed_by):
        ap.error("give --rows or --changed-by")
    specs = a.rows or changed_rows(a.changed_by)
    if a.list:
        for spec in specs:
            print(spec)
        print(f"{len(specs)} rows")
        return 0
    if HERE not in sys.path:
        sys.path.insert(0, HERE)
    from _gpu import time_graph
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd
    from flashqla.testing import make_gdn_inputs

    results, ok = [], True
    for spec in specs:
        row, *plans = spec.split(":")
        heads, mix = row.split()
        h = parse_heads(heads)
        lengths = list(parse_mix(mix).lengths)
        T = sum(lengths)
        x = make_gdn_inputs(1, T, h.h_qk, h.h_v, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda",
                            gate="qwen3next", special_heads=True, initial_state=True, seed=0)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5, x["initial_state"], True, x["cu_seqlens"])
        o_ref = chunk_gated_delta_rule_fwd(*args, cp="off", for_backward=False).o.double()
        cells = {}
        for plan in plans:
            if plan == "off" or plan.startswith("off/"):
                bv = int(plan[4:]) if plan != "off" else None
                fn = lambda bv=bv: chunk_gated_delta_rule_fwd(*args, cp="off", block_v=bv,  # noqa: E731
                                                              for_backward=False)
            else:
                L, BV = (int(v) for v in plan.split("/"))
                fn = lambda L=L, BV=BV: chunk_gated_delta_rule_fwd(*args, cp="on", segment_len=L, block_v=BV,  # noqa: E731
                                                                   for_backward=False)
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

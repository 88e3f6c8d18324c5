"""One call on the GPU machine: forward plans against measured times, for planner calibration.

    python tests/gpu/cp_fwd_plan_check.py [--rows "2/8 1x16384" ...]

Per row (the forward benchmark's inputs: `make_gdn_inputs`, packed int32 offsets, qwen3next gates with
the g == 0 and g = -30 heads): the planner's decision with the constants in the module, and the
candidate decision with the costs of the one-launch split path (no per-head correction launches:
LAUNCH_COST * HV dropped; SCAN_STEP_COST = 1.5, measured 4.4-11 us per step); then the forward timed
(CUDA graphs, median) unsplit and split at the candidate's segment length, each gated against the
other (relative RMS of o <= 1e-2). Prints a table. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.device_check import time_graph  # noqa: E402

ROWS = ["2/8 1x16384", "2/8 1x4096", "2/8 4096+4096", "2/8 6144+2048", "4/16 1x4096", "4/16 28672+4096",
        "8/32 1x32768", "16/32 1x32768", "16/32 1x16384", "16/16 1x4096", "32/32 1x32768", "16/16 16384+16384"]


def candidate_plan(HV, N, T):
    from flashqla.cp import planner as P

    old_scan, old_split = P.SCAN_STEP_COST, P._split_time

    def split(BV, HV_, V, T_, N_, L, l_avg, l_max, balanced, sms, exact, gate_chunks, backward=False):
        t = old_split(BV, HV_, V, T_, N_, L, l_avg, l_max, balanced, sms, exact, gate_chunks, backward)
        return t - P.LAUNCH_COST * HV_ if exact and not backward else t

    try:
        P.SCAN_STEP_COST, P._split_time = 1.5, split
        P.plan_cp.cache_clear()
        return P.plan_cp(HV, N, T, exact=True)
    finally:
        P.SCAN_STEP_COST, P._split_time = old_scan, old_split
        P.plan_cp.cache_clear()


def main(argv=None) -> int:
    from flashqla.cp import planner as P
    from flashqla.cp.driver import chunk_gated_delta_rule_cp_fwd
    from flashqla.testing import make_gdn_inputs

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=ROWS)
    a = ap.parse_args(argv)
    table = []
    for row in a.rows:
        heads, mix = row.split()
        H, HV = (int(x) for x in heads.split("/"))
        lengths = [int(mix.split("x")[1])] * int(mix.split("x")[0]) if "x" in mix else [int(x) for x in mix.split("+")]
        T, N = sum(lengths), len(lengths)
        now = P.plan_cp(HV, N, T, exact=True)
        cand = candidate_plan(HV, N, T)
        x = make_gdn_inputs(1, T, H, HV, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda",
                            gate="qwen3next", special_heads=True, initial_state=True, seed=0)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5, x["initial_state"], True, x["cu_seqlens"])
        off = lambda: chunk_gated_delta_rule_cp_fwd(*args, cp="off", relayout=False)  # noqa: E731
        res = {"off": (time_graph(off), off().o)}
        for L, BV in {(p.segment_len, p.BV) for p in (now, cand) if p.split}:
            fn = lambda L=L, BV=BV: chunk_gated_delta_rule_cp_fwd(*args, cp="on", segment_len=L, block_v=BV, relayout=False)  # noqa: E731
            o = fn().o
            err = float((o.double() - res["off"][1].double()).norm() / res["off"][1].double().norm())
            res[f"L={L} BV={BV}"] = (time_graph(fn), o, err)
        cells = [f"{k} {v[0]:.3f}" + (f" (o vs off {v[2]:.1e})" if len(v) > 2 else "") for k, v in res.items()]
        table.append((row, f"now {'L=' + str(now.segment_len) if now.split else 'unsplit'}",
                      f"candidate {'L=' + str(cand.segment_len) + ' BV=' + str(cand.BV) if cand.split else 'unsplit'}",
                      " | ".join(cells)))
        print(table[-1], flush=True)
    print("\nforward ms (CUDA graphs): the planner now, the candidate costs, measured")
    for r in table:
        print("  ", " ; ".join(r))
    return 0


if __name__ == "__main__":
    sys.exit(main())

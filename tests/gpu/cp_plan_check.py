"""One call on the GPU machine: the split path's plans against measured times.

    python tests/gpu/cp_plan_check.py [--heads 16/32,8/16,4/8,2/4] [--mixes 8k_2seq,...] [--out DIR]

For the backward grid's rows (`flashqla.bench.bwd_grid`, its inputs and random lengths): the backward
(`flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd`) timed in CUDA graphs (median) with
  - cp "off";
  - cp "auto" with the packed batch taking the forward's plan (planner.PACKED_BWD_OWN_PLAN = False);
  - cp "auto" with the backward's own plan (PACKED_BWD_OWN_PLAN = True),
next to each plan's segment length and predicted times. Every timed variant's gradients are compared
with cp "off" (relative Frobenius error, must stay below 2e-2: two bf16 computations). Prints a table
last and writes cp_plan_check.json to --out. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.device_check import time_graph  # noqa: E402


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def main(argv=None) -> int:
    from flashqla.bench.bwd_grid import select_bwd_rows
    from flashqla.cp import planner
    from flashqla.cp.driver import _plan
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
    from flashqla.testing import make_gdn_inputs

    ap = argparse.ArgumentParser()
    ap.add_argument("--heads", default="16/32,8/16,4/8,2/4")
    ap.add_argument("--mixes", default="8k_2seq,8k_4seq,8k_8seq,32k_2seq,32k_4seq,32k_8seq")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    rows = select_bwd_rows(a.heads.split(","), a.mixes.split(","))
    table, ok = [], True
    for row in rows:
        H, HV = row.heads.h_qk, row.heads.h_v
        lengths = list(row.mix.lengths)
        T = sum(lengths)
        try:
            x = make_gdn_inputs(1, T, H, HV, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda",
                                gate="qwen3next", special_heads=True, seed=0)
            q, k, v, g, beta, cu = x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"]
            scale = 128**-0.5
            f = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, None, True, cu, cp="off")
            gen = torch.Generator(device="cuda").manual_seed(1)
            do = torch.randn(f.o.shape, device="cuda", generator=gen).to(f.o.dtype)
            dht = torch.randn(f.final_state.shape, device="cuda", generator=gen)
            res = {}
            for name, cp, own in (("off", "off", False), ("fwd plan", "auto", False), ("own plan", "auto", True)):
                planner.PACKED_BWD_OWN_PLAN = own
                planner.clear_plan_cache()
                plan, _ = _plan(q, v, cu, cp, None, None, None, None, False, backward=True)
                fn = lambda: chunk_gated_delta_rule_bwd(f.q, f.k, v, g, beta, f.A, f.g_cum_log2, do, dht, scale, None,  # noqa: E731
                                                        cu, cp=cp)
                grads = fn()
                res[name] = (time_graph(fn, reps=10, iters=2), plan, grads)
            ref = res["off"][2]
            cells = []
            for name in ("off", "fwd plan", "own plan"):
                ms, plan, grads = res[name]
                err = max(_rel(a_, b_) for a_, b_ in zip(grads[:5], ref[:5]))
                if err > 2e-2 or not all(torch.isfinite(t).all() for t in grads[:5]):
                    ok = False
                cells.append(f"{ms:.3f} (L={plan.segment_len if plan.split else '-'}, err {err:.1e})")
            table.append((row.label, *cells))
        except Exception:
            ok = False
            table.append((row.label, "ERROR", traceback.format_exc(limit=3), ""))
        print(table[-1], flush=True)
    planner.PACKED_BWD_OWN_PLAN = False
    planner.clear_plan_cache()
    with open(os.path.join(a.out, "cp_plan_check.json"), "w") as fh:
        json.dump(table, fh, indent=1)
    print("\nbackward ms (CUDA graphs)        cp off | auto, forward's plan | auto, own plan")
    for r in table:
        print("  ", " | ".join(str(c) for c in r))
    print("all gradients within 2e-2 of cp off" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

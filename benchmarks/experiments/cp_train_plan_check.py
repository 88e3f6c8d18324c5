"""Where should the backward planner split a training step? The training step (a forward keeping its
split states + the backward reusing them) and the backward alone, on backward-grid rows, either with
the backward planner's split threshold `flashqla.cp.plan.BWD_MIN_GAIN` at several values (do rows it
keeps whole gain from a split?) or, with `--lengths`, at forced segment lengths (the data the
lengths-costed backward plan is fitted on).

Run on the GPU machine (`source .device/on-device.sh` first):

    python benchmarks/experiments/cp_train_plan_check.py [--rows "8/16 8k_8seq" ...] [--gains 1.2 1.0]
    python benchmarks/experiments/cp_train_plan_check.py --lengths 512 1024 ... [--rows ...] [--out DIR]

`--lengths` sweeps the backward's segment length instead of the threshold: per row, unsplit (the
backward's plan kept whole; the forward then takes its own plan) and every L of the list below the
row's longest sequence (the backward's plan forced to L, which the forward keeps), the same timings.

Per row: the benchmark's inputs and our loader (`flashqla.bench.bwd_impls`, exactly what the backward
benchmark times), the plan the forward keeps (L or unsplit) and its launch order, the gradients'
relative RMS against the first setting's (gate 1e-2; dg 3e-2), and CUDA-graph times
(`flashqla.bench.timing.time_cuda_graph`) of the backward alone and the training step.

Prints a table last. With `--lengths` it also writes cp_train_sweep.json to --out (default $OUT, else
the working directory), rewritten after every step; the H200 sweep is committed as
benchmarks/results/h200-cp-train-sweep.json, from which `flashqla.cp.plan.fit_lengths_costs` (and
tests/test_cp_planner_lengths.py, on the CPU) refit the BWD_LEN_* costs.
"""
from __future__ import annotations

import argparse
import datetime
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

SWEEP_WHAT = ("training step (forward keeping its split states + backward reusing them) and backward alone, "
              "CUDA-graph timed, per backward-grid row unsplit (L null) and at forced segment lengths L, in the "
              "launch order the plan picks (longest_first); benchmarks/experiments/cp_train_plan_check.py --lengths")
ROWS = ["8/16 8k_8seq", "16/32 32k_4seq", "16/32 32k_8seq", "4/8 32k_8seq", "8/16 32k_2seq", "16/32 8k_2seq"]


def _rel(a, b) -> float:
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-30))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=ROWS)
    ap.add_argument("--gains", nargs="+", type=float, default=[1.2, 1.0])
    ap.add_argument("--lengths", nargs="+", type=int, default=None)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--commit", default="unknown", help="our commit id, written into the sweep's header")
    a = ap.parse_args(argv)

    import flashqla.cp.plan as P
    from flashqla.bench.bwd_grid import select_bwd_rows
    from flashqla.bench.bwd_impls import load_bwd_impls
    from flashqla.bench.bwd_runner import BwdInputFactory
    from flashqla.bench.timing import time_cuda_graph

    search = P._segment_lengths
    impl = load_bwd_impls(("ours",))["ours"]
    fac = BwdInputFactory("cuda", 32768)
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    table = []
    for text in a.rows:
        heads, mix = text.split()
        (row,) = select_bwd_rows([heads], [mix])
        x = fac.get(row)
        base = None
        longest = max(row.mix.lengths)
        settings = [(g, None) for g in a.gains] if a.lengths is None else \
            [(float("inf"), None)] + [(0.0, L) for L in a.lengths if L < longest]
        for gain, forced in settings:
            P.BWD_MIN_GAIN = gain
            P._segment_lengths = search if forced is None else (lambda l_max, *grid, L=forced: [L])
            P.clear_plan_cache()
            f = impl.fwd(x)
            L = f.saved.cp_saved.segment_len if f.saved.cp_saved is not None else None
            lens = tuple(row.mix.lengths)
            plan = P.plan_cp(row.heads.h_v, len(lens), sum(lens), backward=True, seqlens=lens)
            assert (plan.segment_len if plan.split else None) == L, (text, plan, L)  # the plan the forward kept
            lf = bool(plan.split and plan.longest_first)
            grads = dict(zip(names, impl.bwd(x, f.saved)))
            if base is None:
                base = grads
            errs = {n: _rel(grads[n], base[n]) for n in names if grads[n] is not None}
            ok = all(e <= (3e-2 if n == "dg" else 1e-2) and torch.isfinite(grads[n]).all() for n, e in errs.items())
            bwd = time_cuda_graph(lambda: impl.bwd(x, f.saved)).ms
            step = time_cuda_graph(lambda: impl.step(x)).ms
            table.append((text, gain, L, bwd, step, max(errs.values()), ok, lf))
            if a.lengths is not None:  # rewritten after every step: a time-boxed run keeps what it measured
                head = dict(what=SWEEP_WHAT, gpu=torch.cuda.get_device_name(),
                            commit=a.commit,
                            date=datetime.datetime.now(datetime.timezone.utc).date().isoformat())
                rows = [dict(row=r[0], L=r[2], longest_first=r[7], bwd_ms=r[3], step_ms=r[4], err=r[5], ok=r[6])
                        for r in table]
                path = os.path.join(a.out, "cp_train_sweep.json")
                with open(path + ".tmp", "w") as fh:  # replaced whole: a kill mid-write keeps the last one
                    json.dump(dict(head, rows=rows), fh, indent=1)
                os.replace(path + ".tmp", path)
            print(f"{text} BWD_MIN_GAIN {gain}: L={L} bwd {bwd:.3f} step {step:.3f} max rel {max(errs.values()):.1e} {'ok' if ok else 'FAIL'}",
                  flush=True)
        fac.release()
    print("\n| row | BWD_MIN_GAIN | kept L | order | backward ms | training step ms | max rel vs first | gate |")
    print("|---|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r[0]} | {r[1]} | {r[2] or 'unsplit'} | {'longest' if r[7] else 'tokens'} | {r[3]:.3f} | {r[4]:.3f} "
              f"| {r[5]:.1e} | {'ok' if r[6] else 'FAIL'} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One call on the GPU machine: the backward's chain kernels launching a packed batch's sequences
longest first (`_common.launch_order`, FLASHQLA_BWD_ORDER=longest) against token order (=tokens).

    python tests/gpu/bwd_order_check.py [--rows "16/32 8k_8seq" ...]

Per backward-grid row (the benchmark's inputs and loader, `flashqla.bench.bwd_impls`): the plan made
with the longest-first model (FLASHQLA_BWD_ORDER=longest), then the backward on the forward's kept states twice under that same
plan, the kernels launching longest first and in token order: every gradient must be bitwise equal
(the order moves CTAs, not arithmetic); both CUDA-graph timed, with the training step; then the whole
old behaviour (plan and kernels in token order) timed. Prints a table last. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

ROWS = ["16/32 8k_8seq", "16/32 32k_8seq", "16/32 32k_4seq", "8/16 32k_8seq", "4/8 32k_8seq", "8/16 8k_4seq",
        "16/32 8k_1seq"]


def main(argv=None) -> int:
    from flashqla.bench.bwd_grid import select_bwd_rows
    from flashqla.bench.bwd_impls import load_bwd_impls
    from flashqla.bench.bwd_runner import BwdInputFactory
    from flashqla.bench.timing import time_cuda_graph
    from flashqla.cp import planner as P

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=ROWS)
    a = ap.parse_args(argv)
    impl = load_bwd_impls(("ours",))["ours"]
    fac = BwdInputFactory("cuda", 32768)
    table = []
    for text in a.rows:
        heads, mix = text.split()
        (row,) = select_bwd_rows([heads], [mix])
        x = fac.get(row)
        os.environ["FLASHQLA_BWD_ORDER"] = "longest"
        P.clear_plan_cache()
        f = impl.fwd(x)  # plans (longest-first model) and keeps the split states
        L = f.saved.cp_saved.segment_len if f.saved.cp_saved is not None else None
        res = {}
        for mode in ("longest", "tokens"):  # the same plan (cached), the kernels' launch order changes
            os.environ["FLASHQLA_BWD_ORDER"] = mode
            grads = impl.bwd(x, f.saved)
            bwd = time_cuda_graph(lambda: impl.bwd(x, f.saved)).ms
            step = time_cuda_graph(lambda: impl.step(x)).ms
            res[mode] = (grads, bwd, step)
        same = all((g1 is None and g2 is None) or torch.equal(g1, g2)
                   for g1, g2 in zip(res["longest"][0], res["tokens"][0]))
        finite = all(g is None or bool(torch.isfinite(g).all()) for g in res["longest"][0])
        os.environ["FLASHQLA_BWD_ORDER"] = "tokens"  # the old behaviour: plan and kernels in token order
        P.clear_plan_cache()
        f_old = impl.fwd(x)
        L_old = f_old.saved.cp_saved.segment_len if f_old.saved.cp_saved is not None else None
        bwd_old = time_cuda_graph(lambda: impl.bwd(x, f_old.saved)).ms
        step_old = time_cuda_graph(lambda: impl.step(x)).ms
        table.append((text, L, res["longest"][1], res["tokens"][1], res["longest"][2], res["tokens"][2], L_old,
                      bwd_old, step_old, same and finite))
        print(table[-1], flush=True)
        fac.release()
    os.environ["FLASHQLA_BWD_ORDER"] = "longest"
    print("\n| row | L | bwd longest / tokens (ms) | step longest / tokens | old plan L | old bwd / step | bitwise |")
    print("|---|---|---|---|---|---|---|")
    for r in table:
        print(f"| {r[0]} | {r[1] or 'unsplit'} | {r[2]:.3f} / {r[3]:.3f} | {r[4]:.3f} / {r[5]:.3f} | {r[6] or 'unsplit'} "
              f"| {r[7]:.3f} / {r[8]:.3f} | {'yes' if r[9] else 'NO'} |")
    return 0 if all(r[9] for r in table) else 1


if __name__ == "__main__":
    sys.exit(main())

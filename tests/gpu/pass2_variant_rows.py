"""One call on the GPU machine: pass-2 builds side by side on backward-benchmark rows, in one process.

    python tests/gpu/pass2_variant_rows.py v5:dagl v5:dag [--rows "8/16 32k_2seq" ...] [--rounds 3]
        [--no-ref] [--out DIR]

Per row (`flashqla.bench.bwd_grid` names "HEADS MIX"): the benchmark's inputs and our loader
(`flashqla.bench.bwd_impls`, exactly what `python -m flashqla.bench --bwd` times: the training forward
keeping its split states, then the backward with its context-parallel plan), one forward, and for each
pass-2 build (`chunk_bwd.DEFAULT_VARIANT` set to it, every launch of pass 2 takes it, the split path's
segments included): the gradients against the fp64 reference (`flashqla.bench.bwd_runner.reference_grads`;
--no-ref skips it) and CUDA-graph medians of the backward alone, the builds taken in turn for --rounds
rounds (so drift shows as spread, not as a ratio), and whether each build's gradients are bitwise the
first's. Prints a table last (median over rounds, ratio to the first build); everything to
pass2_variant_rows.json in --out. Not collected by pytest; the kernels are expected in TileLang's cache.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

ROWS = ["8/16 32k_2seq", "16/32 8k_8seq", "16/32 32k_8seq", "8/16 32k_4seq", "4/8 32k_8seq", "2/4 8k_8seq"]
NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def main(argv=None) -> int:
    from flashqla.bench.bwd_grid import select_bwd_rows
    from flashqla.bench.bwd_impls import load_bwd_impls
    from flashqla.bench.bwd_runner import BwdInputFactory, errors, reference_grads
    from flashqla.bench.timing import time_cuda_graph
    from flashqla.ops.gdn.kernels.sm90 import chunk_bwd

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("variants", nargs="+", help="pass-2 builds, e.g. v5:dagl (chunk_bwd.VARIANTS or v5:<options>)")
    ap.add_argument("--rows", nargs="+", default=ROWS)
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--no-ref", action="store_true", help="skip the fp64 reference (timings only)")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    if a.rounds < 1:
        ap.error("--rounds must be >= 1")
    for v in a.variants:
        chunk_bwd._variant(v)  # ValueError naming the variant before any device work
    impl = load_bwd_impls(("ours",))["ours"]
    fac = BwdInputFactory("cuda", 32768)
    out = dict(gpu=torch.cuda.get_device_name(), torch=torch.__version__, commit=os.environ.get("FLASHQLA_COMMIT", "unknown"),
               variants=a.variants, rows=[])
    saved_default = chunk_bwd.DEFAULT_VARIANT
    path = os.path.join(a.out, "pass2_variant_rows.json")
    try:
        for text in a.rows:
            heads, mix = text.split()
            (row,) = select_bwd_rows([heads], [mix])
            x = fac.get(row)
            with torch.no_grad():
                f = impl.fwd(x)
            ref = None if a.no_ref else reference_grads(x)
            rec = dict(row=text, errs={}, bitwise={}, ms={v: [] for v in a.variants})
            first = None
            for v in a.variants:
                chunk_bwd.DEFAULT_VARIANT = v
                with torch.no_grad():
                    grads = dict(zip(NAMES, impl.bwd(x, f.saved)))
                torch.cuda.synchronize()
                rec["errs"][v] = errors(grads, ref, NAMES) if ref is not None else {
                    n: float(torch.isfinite(t).all()) for n, t in grads.items() if t is not None}
                if first is None:
                    first = grads
                # the gradients bitwise those of the first build (expected of builds that only reorder work)
                rec["bitwise"][v] = all(torch.equal(grads[n], first[n]) for n in NAMES if grads[n] is not None)
            del first, grads
            for _ in range(a.rounds):
                for v in a.variants:
                    chunk_bwd.DEFAULT_VARIANT = v
                    rec["ms"][v].append(time_cuda_graph(lambda: impl.bwd(x, f.saved)).ms)
            out["rows"].append(rec)
            med = {v: statistics.median(t) for v, t in rec["ms"].items()}
            print(text, " ".join(f"{v} {med[v]:.4f} ms ({med[v] / med[a.variants[0]]:.4f}x)" for v in a.variants), flush=True)
            for v in a.variants:
                print(f"  {v} bitwise {rec['bitwise'][v]} errs " + " ".join(f"{n} {e:.3e}" for n, e in rec["errs"][v].items()),
                      flush=True)
            with open(path + ".tmp", "w") as fh:
                json.dump(out, fh, indent=1)
            os.replace(path + ".tmp", path)
            del f
            fac.release()
    finally:
        chunk_bwd.DEFAULT_VARIANT = saved_default
    v0 = a.variants[0]
    print(f"\n| row | " + " | ".join(f"{v} ms (/{v0})" for v in a.variants) + " | spread (max/min over rounds) |")
    print("|---|" + "---|" * (len(a.variants) + 1))
    for rec in out["rows"]:
        med = {v: statistics.median(t) for v, t in rec["ms"].items()}
        spread = max(max(t) / min(t) for t in rec["ms"].values())
        print(f"| {rec['row']} | " + " | ".join(f"{med[v]:.4f} ({med[v] / med[v0]:.4f})" for v in a.variants)
              + f" | {spread:.4f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

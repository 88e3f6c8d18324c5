"""One call on the GPU machine: pass-2 v5 with build options (`chunk_bwd_v5.OPTS`, variants named
"v5:<letters>") against the plain schedule ("v5:", or --base), for correctness and speed, in one process.

    python tests/gpu/pass2_opts_check.py v5:d v5:a ... [--base v5:] [--precompile] [--cases NAME ...] [--rows ROW ...]
        [--out DIR]

For each variant, `bwd_v2_check.check_case` on the chosen cases (base v5 against the variant on
NaN-poisoned outputs, twice; every gradient against fp64) and `bwd_v2_check.time_row` on the chosen
rows (CUDA-graph medians of pass 2 alone and of the whole backward, base re-timed beside each variant,
which shows the drift). A table is printed last; everything goes to pass2_opts_check.json in --out.
Not collected by pytest; the kernels are expected in TileLang's cache (built on the CPU first).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

import tests.gpu.bwd_v2_check as b  # noqa: E402

DEFAULT_CASES = ("T=65 2/4", "varlen 5,0,63,1,64,130 h0", "g==0 / g=-30 heads T=300 2/4")
DEFAULT_ROWS = ("16/32 8k_8seq", "16/32 4x8192 packed", "8/16 7212+25556", "2/4 1x32768")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("variants", nargs="+")
    ap.add_argument("--cases", nargs="*", default=list(DEFAULT_CASES))
    ap.add_argument("--rows", nargs="*", default=list(DEFAULT_ROWS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--base", default="v5:", help="the build the variants are compared with (default: the plain schedule)")
    ap.add_argument("--precompile", action="store_true", help="build the kernels first, in worker processes")
    a = ap.parse_args()
    rows_all = b._rows()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "runs": [], "errors": []}
    t0 = time.time()
    b.BASE = a.base  # "v5:" the plain schedule (plain "v5" takes chunk_bwd_v5.DEFAULT_OPTS)
    if a.precompile:
        for var in a.variants:
            b.NEW = var
            b.precompile({r: rows_all[r] for r in a.rows}, {c: b.CASES[c] for c in a.cases})
    for var in a.variants:
        b.NEW = var
        for i, name in enumerate(a.cases):
            try:
                r = b.check_case(name, b.CASES[name], seed=100 + i)
                out["runs"].append(dict(r, variant=var, kind="case"))
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                out["errors"].append(f"{var} {name}: {type(exc).__name__}: {exc}")
        for name in a.rows:
            try:
                r = b.time_row(name, *rows_all[name])
                out["runs"].append(dict(r, variant=var, kind="row"))
                print(var, name, {k: round(v, 4) for k, v in r.items() if k.startswith("t_")}, flush=True)
            except Exception as exc:  # noqa: BLE001
                traceback.print_exc()
                out["errors"].append(f"{var} {name}: {type(exc).__name__}: {exc}")
            torch.cuda.empty_cache()
        with open(os.path.join(a.out, "pass2_opts_check.json"), "w") as fh:
            json.dump(dict(out, wall_s=time.time() - t0), fh, indent=1)

    print(f"\n== base {a.base}")
    print("== variant against the base: max rel RMS over the cases per gradient ('=' all bitwise); worst fp64 rel RMS base / "
          "variant; ok = finite and repeatable")
    print(f"{'variant':9s} " + " ".join(f"{n:>22s}" for n in b.NAMES) + "  ok")
    for var in a.variants:
        rs = [r for r in out["runs"] if r["variant"] == var and r["kind"] == "case"]
        if not rs:
            continue
        cells = []
        for n in b.NAMES:
            eq = all(r[f"{n}_bitwise_v1"] for r in rs)
            rel = "=" if eq else b._fmt(max(r[f"{n}_rel_v1"] for r in rs))
            r1 = max((r[f"{n}_ref_v1"] or 0.0) for r in rs)
            r2 = max((r[f"{n}_ref_v2"] or 0.0) for r in rs)
            cells.append(f"{rel:>7s} {b._fmt(r1):>6s}/{b._fmt(r2):>6s}")
        ok = all(r[f"{n}_finite"] and r[f"{n}_repeat"] for r in rs for n in b.NAMES)
        print(f"{var:9s} " + " ".join(f"{c:>22s}" for c in cells) + f"  {ok} ({len(rs)} cases)")
    print("\n== ms, CUDA graphs, median: pass 2 alone and the whole backward, base / variant")
    print(f"{'variant':9s} {'row':16s} {'p2 base':>7s} {'p2 var':>7s} {'x':>6s} {'bwd base':>7s} {'bwd var':>7s} {'x':>6s}")
    for r in out["runs"]:
        if r["kind"] == "row":
            print(f"{r['variant']:9s} {r['row']:16s} {r['t_pass2_v1']:7.3f} {r['t_pass2_v2']:7.3f} "
                  f"{r['t_pass2_v1'] / r['t_pass2_v2']:6.3f} {r['t_bwd_v1']:7.3f} {r['t_bwd_v2']:7.3f} "
                  f"{r['t_bwd_v1'] / r['t_bwd_v2']:6.3f}")
    for e in out["errors"]:
        print("error:", e)
    print(f"wall {time.time() - t0:.0f} s")


if __name__ == "__main__":
    main()

"""Which instructions of a kernel hold its warps, and why (barrier waits, wgmma waits, global loads,
spills, exp2...)? Sums Nsight Compute's per-instruction warp-stall samples by instruction class and
stall reason, and prints the instructions that hold the most samples.

Runs anywhere (no GPU needed), on the CSV of a report such as `ncu_bwd.py`'s or `ncu_fwd.py`'s
(collected on the GPU machine after `source .device/on-device.sh`, with --section WarpStateStats
--section SourceCounters):

    ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv
    python benchmarks/experiments/sass_stalls.py rep.csv [--top N]

Writes no file: prints the tables.
"""
from __future__ import annotations

import argparse
import csv
import re
import sys
from collections import Counter


def load(path):
    with open(path, newline="") as fh:
        lines = fh.read().splitlines()
    start = next(i for i, ln in enumerate(lines) if ln.startswith('"Address"'))
    rows = list(csv.DictReader(lines[start:]))
    return rows


def _num(v):
    try:
        return float(str(v).replace(",", ""))
    except ValueError:
        return 0.0


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("csv")
    ap.add_argument("--top", type=int, default=40)
    a = ap.parse_args(argv)
    rows = load(a.csv)
    if not rows:
        print("no rows")
        return 1
    cols = list(rows[0])
    src = "Source"
    samp = "Warp Stall Sampling (All Samples)"
    stalls = [c for c in cols if c.startswith("stall_") and "Not Issued" not in c]
    tot = sum(_num(r[samp]) for r in rows)
    by = Counter()
    for r in rows:
        op = re.sub(r"^@!?U?P\w+\s+", "", r[src].strip()).split(" ")[0]
        by[op.split(".")[0]] += _num(r[samp])
    print(f"total samples ({samp}): {tot:.0f}")
    reason = Counter({c: sum(_num(r[c]) for r in rows) for c in stalls})
    print("by stall reason: " + ", ".join(f"{c[6:]} {100 * n / max(tot, 1):.1f}%" for c, n in reason.most_common(8)))
    for op, n in by.most_common(25):
        print(f"  {op:14s} {n:10.0f} {100 * n / max(tot, 1):5.1f}%")
    order = sorted(range(len(rows)), key=lambda i: -_num(rows[i][samp]))[: a.top]
    print("\ntop instructions (index, % of samples, sass)")
    for i in order:
        print(f"  {i:6d} {100 * _num(rows[i][samp]) / max(tot, 1):5.2f}%  {rows[i][src].strip()[:110]}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

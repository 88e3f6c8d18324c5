"""One call on the GPU machine: what restoring the exact diagonal of A diag(beta) costs in the
backward's pass 2 (`chunk_bwd_v2.py`), against its build without it (`exact_diagonal=False`, the
stored bf16 diagonal), on the same inputs in one process.

    python tests/gpu/exact_diagonal_check.py [--rows "16/32 8k_8seq" ...] [--out DIR]

Per row (`tests/gpu/bwd_v2_check.py`'s rows and inputs): CUDA-graph medians of pass 2 with and
without the restoration, and the gradients of pass 2 both ways against each other (relative
RMS: the restoration must move them by about bf16's rounding of beta, ~1e-3, never by O(1)) and
finite. Prints a table last and writes exact_diagonal_check.json to --out. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from flashqla.testing import rel_rms  # noqa: E402
from tests.gpu.bwd_v2_check import SCALE, _rows, row_inputs  # noqa: E402
from tests.gpu.device_check import time_graph  # noqa: E402

NAMES = ("dq_hv", "dk_hv", "dv", "dbeta", "dG", "dh0")


def check_row(name, H, HV, lengths, packed):
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v2 import chunk_fused_bwd_v2
    from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd

    x, do, dht, f = row_inputs(H, HV, lengths, packed)
    row = {"row": name}
    outs = {}
    for exact in (False, True):
        key = "exact" if exact else "stored"

        h = chunk_states_bwd(f.k, x["v"], f.A, f.g_cum_log2, x["initial_state"], x["cu_seqlens"], torch.bfloat16)

        def p2():
            return chunk_fused_bwd_v2(f.q, f.k, x["v"], x["beta"], f.A, f.g_cum_log2, h, do, dht, SCALE, x["cu_seqlens"],
                                      exact_diagonal=exact)

        outs[key] = dict(zip(NAMES, p2()))
        torch.cuda.synchronize()
        row[f"t_pass2_{key}"] = time_graph(p2)
    for n in NAMES:
        a, b = outs["stored"][n], outs["exact"][n]
        row[f"{n}_moved"] = rel_rms(b.float(), a.float()) if bool(a.abs().max() > 0) else None
        row[f"{n}_finite"] = bool(torch.isfinite(b).all())
    return row


def main(argv=None) -> int:
    rows_all = _rows()
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=["16/32 8k_8seq", "16/32 4x8192", "2/4 1x32768"], choices=sorted(rows_all))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    results = []
    for name in a.rows:
        r = check_row(name, *rows_all[name])
        results.append(r)
        print(r, flush=True)
        with open(os.path.join(a.out, "exact_diagonal_check.json"), "w") as fh:
            json.dump(results, fh, indent=1)
    print("\n| row | pass 2 stored / exact ms | gradients moved (rel. RMS) | finite |")
    print("|---|---|---|---|")
    for r in results:
        moved = " ".join(f"{n} {r[f'{n}_moved']:.1e}" for n in NAMES if r[f"{n}_moved"] is not None)
        fin = all(r[f"{n}_finite"] for n in NAMES)
        print(f"| {r['row']} | {r['t_pass2_stored']:.3f} / {r['t_pass2_exact']:.3f} | {moved} | {fin} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

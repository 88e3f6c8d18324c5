"""One call on the GPU machine: how long the recurrent kernel's chunk step takes, and how much of it
is the state chain, on rows whose CTAs do not fill the SMs and on one that does.

    python tests/gpu/recurrent_floor.py [--rows ROW ...] [--out DIR]

For each row (the forward benchmark's packed inputs, `flashqla.testing.make_gdn_inputs`), the
recurrent launch alone (prepare run once before) at BV = 64 and 128, in the default build and in the
measuring build "chain" (`recurrent._recurrent_prim_func(_measure="chain")`: the output path left
out, so only U^T, W^T, v_new^T and the state update remain; its results are wrong by design). CUDA
graphs, median; us per chunk step = time / (chunks of the longest sequence x waves). Prints a short
table last and writes recurrent_floor.json to --out. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
from concurrent.futures import ThreadPoolExecutor

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.device_check import time_graph  # noqa: E402

ROWS = {  # name (LENGTHxCOUNT, as the benchmark): (H, HV, lengths)
    "2/8 2048x4": (2, 8, [2048] * 4),
    "2/8 1024x8": (2, 8, [1024] * 8),
    "2/8 8192x1": (2, 8, [8192]),
    "4/16 8192x4": (4, 16, [8192] * 4),
    "16/32 8192x4": (16, 32, [8192] * 4),
    # rows that fill the SMs at BV = 128 (the forward grid's, slower than FlashQLA at 69c42b8)
    "32/32 4096x8": (32, 32, [4096] * 8),
    "16/16 4096x8": (16, 16, [4096] * 8),
    "16/48 8192x4": (16, 48, [8192] * 4),
    "8/24 4096x8": (8, 24, [4096] * 8),
}
BUILDS = ("", "chain", "roles")  # "": schedule "overlap"; "roles": the role-split kernel (BV = 64 and 128)


def main():
    from flashqla.ops.gdn.kernels.sm90._common import placeholder
    from flashqla.ops.gdn.kernels.sm90.prepare import chunk_prepare_fwd
    from flashqla.ops.gdn.kernels.sm90.recurrent import build_recurrent_kernel
    from flashqla.testing import make_gdn_inputs

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="*", default=list(ROWS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--builds", nargs="*", default=list(BUILDS), help=f"of {BUILDS} ('' is written as overlap)")
    a = ap.parse_args()
    builds = tuple("" if b == "overlap" else b for b in a.builds)
    if "" not in builds:
        builds = ("",) + builds
    keys = sorted({(ROWS[r][0], ROWS[r][1], bv, m) for r in a.rows for bv in (64, 128) for m in builds})

    def build(key):
        H, HV, bv, m = key
        if m == "roles":
            return build_recurrent_kernel(H, HV, 128, 128, bv, "bfloat16", "int32", True, "roles")
        return build_recurrent_kernel(H, HV, 128, 128, bv, "bfloat16", "int32", True, "overlap", False, m)

    with ThreadPoolExecutor(8) as ex:
        kernels = dict(zip(keys, ex.map(build, keys)))
    table = []
    for name in a.rows:
        H, HV, lengths = ROWS[name]
        x = make_gdn_inputs(1, sum(lengths), H, HV, seqlens=lengths, dtype=torch.bfloat16, device="cuda", seed=0)
        q, k, v, g, beta, cu = x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"].to(torch.int32)
        N, T = len(lengths), sum(lengths)
        A, gcl = chunk_prepare_fwd(k, g, beta, cu, HV)
        h0 = torch.randn(N, HV, 128, 128, device="cuda")
        o = torch.empty_like(v)
        ht = torch.empty(N, HV, 128, 128, device="cuda")
        u, pt, lim = (placeholder((1,), dt, q.device) for dt in (q.dtype, torch.float32, torch.int32))
        row = {"row": name}
        def rel(x, y):
            return ((x.float() - y.float()).norm() / y.float().norm()).item()

        # the role-split kernel against the "overlap" one at each width (same inputs; outputs poisoned)
        for bv in (64, 128) if "roles" in builds else ():
            outs = {}
            for m in ("", "roles"):
                o.fill_(float("nan"))
                ht.fill_(float("nan"))
                kernels[(H, HV, bv, m)](q, k, v, A, gcl, h0, cu, 128**-0.5, 1, 1, o, ht, u, pt, lim)
                outs[m] = (o.clone(), ht.clone())
            torch.cuda.synchronize()
            (o1, h1), (o2, h2) = outs[""], outs["roles"]
            row[f"roles_vs_overlap_BV{bv}"] = {
                "o_rel": rel(o2, o1), "ht_rel": rel(h2, h1), "o_max": (o2.float() - o1.float()).abs().max().item(),
                "bitwise": bool(torch.equal(o1, o2) and torch.equal(h1, h2)),
                "finite": bool(torch.isfinite(o2).all() and torch.isfinite(h2).all())}
            del outs, o1, h1, o2, h2
        for bv in (64, 128):
            ctas = (128 // bv) * HV * N
            waves = -(-ctas // 132)
            steps = -(-max(lengths) // 64) * waves
            for m in builds:
                kern = kernels[(H, HV, bv, m)]
                t = time_graph(lambda: kern(q, k, v, A, gcl, h0, cu, 128**-0.5, 1, 1, o, ht, u, pt, lim))
                row[f"BV{bv}{'_' + m if m else ''}"] = (round(t, 4), round(1e3 * t / steps, 2), ctas)
        print(row, flush=True)
        table.append(row)
    with open(os.path.join(a.out, "recurrent_floor.json"), "w") as f:
        json.dump(table, f, indent=1)
    print("\n== recurrent launch alone, ms / us per chunk step / CTAs (CUDA graphs, median); 'chain': output path left out")
    cols = [f"BV{bv}{'_' + m if m else ''}" for bv in (64, 128) for m in builds]
    print(f"{'row':14s} " + " ".join(f"{c:>22s}" for c in cols) + "   roles vs overlap per width (o rel, ht rel, bitwise, finite)")
    for r in table:
        cmp = "  ".join(f"BV{bv}: {d['o_rel']:.1e} {d['ht_rel']:.1e} {d['bitwise']} {d['finite']}"
                        for bv in (64, 128) if (d := r.get(f"roles_vs_overlap_BV{bv}")))
        print(f"{r['row']:14s} " + " ".join(f"{r[c][0]:8.3f} {r[c][1]:6.2f} {r[c][2]:5d}" for c in cols) + "   " + cmp)


if __name__ == "__main__":
    main()

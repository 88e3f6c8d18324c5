"""Where the prepare kernel's time goes: CUDA-graph median times of the full kernel and of measuring
variants that leave stages out (`prepare._prepare_prim_func(_skip=...)`; their results are wrong).

    python tests/gpu/prepare_breakdown.py [--rows ROW ...] [--out DIR]

full - {gemms}            : the four tf32 inverse GEMMs and their shared-memory copies
{gemms} - {subst, gemms}  : the forward substitution for D^-1
{subst, gemms}            : loads, cumsum, K K^T, L / E^T, D^-1 stores, A and g_cum stores
Not collected by pytest.
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

from tests.gpu.device_check import BENCH_ROWS, gen_inputs, time_graph  # noqa: E402

VARIANTS = {"full": frozenset(), "no_gemms": frozenset({"gemms"}), "no_subst": frozenset({"subst"}),
            "kkt_only": frozenset({"subst", "gemms"})}


def build(H, HV, skip):
    from flashqla.ops.gdn.kernels.sm90._common import compile_kernel
    from flashqla.ops.gdn.kernels.sm90.prepare import _prepare_prim_func

    func = _prepare_prim_func(H, HV, 128, "bfloat16", "float32", "int32", False, _skip=skip)
    return compile_kernel(func, f"prepare_breakdown_H{H}_HV{HV}_{'_'.join(sorted(skip)) or 'full'}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="*", default=["16/64 4x8192", "16/32 4x8192"])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    from flashqla.ops.gdn.kernels.sm90._common import num_slots
    from flashqla.ops.gdn.kernels.sm90.prepare import dummy_cu_seqlens

    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90 import _build
    from flashqla.ops.gdn.kernels.sm90.recurrent import DEFAULT_SCHEDULE, pick_block_v

    jobs = [(name, v) for name in a.rows for v in VARIANTS]
    op_specs = []
    for name in a.rows:  # the op with the default schedule, timed again beside the variants
        H, HV, lengths = BENCH_ROWS[name]
        op_specs.append(("recurrent", (H, HV, 128, 128, pick_block_v(len(lengths), HV), "bfloat16", "int32", False, DEFAULT_SCHEDULE)))
    with ThreadPoolExecutor(len(jobs) + len(op_specs)) as ex:
        op_f = [ex.submit(_build, *s) for s in op_specs]
        kernels = dict(zip(jobs, ex.map(lambda j: build(*BENCH_ROWS[j[0]][:2], VARIANTS[j[1]]), jobs)))
        [f.result() for f in op_f]
    res = []
    for name in a.rows:
        H, HV, lengths = BENCH_ROWS[name]
        x = gen_inputs(H, HV, lengths, False)
        B, T = x["k"].shape[:2]
        S = num_slots(B, T, B, False)
        A = torch.empty(HV, S * 64, 64, dtype=x["k"].dtype, device="cuda")
        gcl = torch.empty(HV, S * 64, dtype=torch.float32, device="cuda")
        cu = dummy_cu_seqlens("cuda")
        row = {"row": name}
        for v in VARIANTS:
            k = kernels[(name, v)]
            row[v] = time_graph(lambda: k(x["k"], x["g"], x["beta"], cu, A, gcl))
        row["op_" + DEFAULT_SCHEDULE] = time_graph(lambda: chunk_gated_delta_rule_fwd(**x, output_final_state=True))
        print(row, flush=True)
        res.append(row)
        del x, A, gcl
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "prepare_breakdown.json"), "w") as f:
        json.dump(res, f, indent=1)
    print("\n== prepare kernel, ms (CUDA graphs, median)")
    print(f"{'row':14s} {'full':>6s} {'no_gemms':>8s} {'no_subst':>8s} {'kkt_only':>8s}  gemms  subst  op({DEFAULT_SCHEDULE})")
    for r in res:
        print(f"{r['row']:14s} {r['full']:6.3f} {r['no_gemms']:8.3f} {r['no_subst']:8.3f} {r['kkt_only']:8.3f}  "
              f"{r['full'] - r['no_gemms']:5.3f}  {r['no_gemms'] - r['kkt_only']:5.3f}  {r['op_' + DEFAULT_SCHEDULE]:.3f}")


if __name__ == "__main__":
    main()

"""One call on the GPU machine: the prepare kernel's variant "v2" (one CTA per (chunk slot, q/k
head), `kernels/sm90/prepare_v2.py`) against the default "v1", on the benchmark rows.

    python tests/gpu/prepare_v2_check.py [--precompile] [--rows ROW ...] [--breakdown] [--out DIR]

then the GPU tests of v2 (and the stage test of v1 beside them):

    FLASHQLA_TEST_WITH_FLA=0 python -m pytest -m gpu tests/gpu/test_fwd_gpu.py -q -k "v2 or stages"

Per row (inputs of `device_check.gen_inputs`): v2's outputs against v1's on every used slot row
(g_cum_log2 max |diff|, A diag(beta) relative RMS, all finite, v2 bitwise repeatable), then
CUDA-graph median times of the prepare launch for v1 and for v2 built for 4 and 3 CTAs per SM
(`prepare_v2_prim_func(min_blocks=...)`: 128 / 161 registers, no spills either way), and of the
whole op with v1 and with v2. --breakdown also times v2's measuring variants without the inverse GEMMs and
without the substitution (results wrong, as `prepare_breakdown.py` does for v1). Prints a table
last and writes prepare_v2_check.json to --out. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.device_check import BENCH_ROWS, PEERS, gen_inputs, time_graph  # noqa: E402

MIN_BLOCKS = (4, 3)  # 128 registers (4 CTAs/SM) or uncapped (161, 3 CTAs/SM)
SKIPS = {"no_gemms": frozenset({"gemms"}), "no_subst": frozenset({"subst"}), "kkt_only": frozenset({"subst", "gemms"})}


def precompile(rows):
    """The op's kernels for the rows (v1 and v2) and the v2 kernels of the GPU tests, in worker
    processes (TileLang's disk cache; the tuning builds below then load from it)."""
    from flashqla.ops.gdn.kernels.sm90 import precompile as pc
    from flashqla.ops.gdn.kernels.sm90.recurrent import DEFAULT_SCHEDULE, pick_block_v

    bf, f32, i32 = "bfloat16", "float32", "int32"
    specs = []
    for name in rows:
        H, HV, lengths = BENCH_ROWS[name]
        for variant in ("v1", "v2"):
            specs.append(("prepare", (H, HV, 128, bf, f32, i32, False, variant)))
        specs.append(("recurrent", (H, HV, 128, 128, pick_block_v(len(lengths), HV), bf, i32, False, DEFAULT_SCHEDULE)))
    for H, HV, varlen, dt, bt, st in [(1, 2, False, bf, f32, i32), (2, 2, False, bf, f32, i32), (1, 4, True, bf, f32, i32),
                                       (2, 8, True, bf, f32, i32), (1, 2, True, "float16", "float16", "int64")]:
        for variant in ("v1", "v2"):
            specs.append(("prepare", (H, HV, 128, dt, bt, st, varlen, variant)))
        for BV in (64, 128):
            specs.append(("recurrent", (H, HV, 128, 128, BV, dt, st, varlen, DEFAULT_SCHEDULE)))
    t = time.time()
    pc(specs, max_workers=min(len(specs), os.cpu_count() or 8))
    print(f"precompiled {len(set(specs))} kernels in {time.time() - t:.1f} s", flush=True)


def build_v2(H, HV, min_blocks, skip=frozenset()):
    from flashqla.ops.gdn.kernels.sm90._common import compile_kernel
    from flashqla.ops.gdn.kernels.sm90.prepare_v2 import prepare_v2_prim_func

    func = prepare_v2_prim_func(H, HV, 128, "bfloat16", "float32", "int32", False, min_blocks=min_blocks, _skip=skip)
    tag = "_".join(sorted(skip)) or "full"
    return compile_kernel(func, f"prepare_v2_check_H{H}_HV{HV}_mb{min_blocks}_{tag}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--rows", nargs="*", default=list(BENCH_ROWS))
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    from concurrent.futures import ThreadPoolExecutor

    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90 import prepare as P
    from flashqla.ops.gdn.kernels.sm90._common import num_slots
    from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel, chunk_prepare_fwd, dummy_cu_seqlens

    if a.precompile:
        precompile(a.rows)
    jobs = []
    for name in a.rows:
        H, HV, _ = BENCH_ROWS[name]
        jobs += [(name, mb, frozenset()) for mb in MIN_BLOCKS]
        if a.breakdown:
            jobs += [(name, MIN_BLOCKS[0], s) for s in SKIPS.values()]
    t = time.time()
    with ThreadPoolExecutor(min(len(jobs), os.cpu_count() or 8)) as ex:
        kernels = dict(zip(jobs, ex.map(lambda j: build_v2(*BENCH_ROWS[j[0]][:2], j[1], j[2]), jobs)))
    print(f"built {len(jobs)} v2 tuning kernels in {time.time() - t:.1f} s", flush=True)

    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    for name in a.rows:
        H, HV, lengths = BENCH_ROWS[name]
        x = gen_inputs(H, HV, lengths, False)
        k, g, beta = x["k"], x["g"], x["beta"]
        B, T = k.shape[:2]
        S = num_slots(B, T, B, False)
        row = {"row": name}
        # correctness: v2 against v1 on every row of every slot, outputs poisoned
        res = {}
        for variant in ("v1", "v2", "v2"):
            A = torch.full((HV, S * 64, 64), float("nan"), dtype=k.dtype, device="cuda")
            gcl = torch.full((HV, S * 64), float("nan"), dtype=torch.float32, device="cuda")
            chunk_prepare_fwd(k, g, beta, None, HV, A=A, g_cum_log2=gcl, variant=variant)
            res.setdefault(variant, []).append((A, gcl))
        torch.cuda.synchronize()
        (A1, g1), = res["v1"]
        (A2, g2), (A2b, g2b) = res["v2"]
        d = (A2.float() - A1.float())
        row["finite"] = bool(torch.isfinite(A2.float()).all() and torch.isfinite(g2).all())
        row["A_rel_rms"] = float(d.pow(2).mean().sqrt() / A1.float().pow(2).mean().sqrt())
        row["A_max_diff"] = float(d.abs().max())
        row["g_max_diff"] = float((g2 - g1).abs().max())
        row["repeat_bitwise"] = bool(torch.equal(A2, A2b) and torch.equal(g2, g2b))
        print(name, {q: row[q] for q in ("finite", "A_rel_rms", "A_max_diff", "g_max_diff", "repeat_bitwise")}, flush=True)
        del res, A2b, g2b
        # timings
        A, gcl = A1, g1
        cu = dummy_cu_seqlens("cuda")
        v1 = build_prepare_kernel(H, HV, 128, "bfloat16", "float32", "int32", False, "v1")
        row["t_v1"] = time_graph(lambda: v1(k, g, beta, cu, A, gcl))
        for mb in MIN_BLOCKS:
            kern = kernels[(name, mb, frozenset())]
            row[f"t_v2_mb{mb}"] = time_graph(lambda: kern(k, g, beta, cu, A, gcl))
        if a.breakdown:
            for tag, s in SKIPS.items():
                kern = kernels[(name, MIN_BLOCKS[0], s)]
                row[f"t_v2_{tag}"] = time_graph(lambda: kern(k, g, beta, cu, A, gcl))
        for variant in ("v1", "v2"):
            P.DEFAULT_VARIANT = variant
            row[f"t_op_{variant}"] = time_graph(lambda: chunk_gated_delta_rule_fwd(**x, output_final_state=True))
        P.DEFAULT_VARIANT = "v1"
        print(name, {q: round(v, 4) for q, v in row.items() if q.startswith("t_")}, flush=True)
        out["rows"].append(row)
        del A1, g1, A2, g2, d
        torch.cuda.empty_cache()
    with open(os.path.join(a.out, "prepare_v2_check.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("\n== prepare kernel, ms (CUDA graphs, median); v2 mbN = built for N CTAs per SM; diff = v2 vs v1")
    print(f"{'row':14s} {'v1':>6s} {'v2 mb4':>7s} {'v2 mb3':>7s} {'op v1':>6s} {'op v2':>6s} {'FlashQLA':>8s}  A rel / g max / finite / repeat")
    for r in out["rows"]:
        print(f"{r['row']:14s} {r['t_v1']:6.3f} {r['t_v2_mb4']:7.3f} {r['t_v2_mb3']:7.3f} "
              f"{r['t_op_v1']:6.3f} {r['t_op_v2']:6.3f} {PEERS[r['row']][0]:8.3f}  "
              f"{r['A_rel_rms']:.1e} {r['g_max_diff']:.1e} {r['finite']} {r['repeat_bitwise']}")
    if a.breakdown:
        print("\n== v2 breakdown (results wrong): full / no_gemms / no_subst / kkt_only, ms")
        for r in out["rows"]:
            print(f"{r['row']:14s} {r['t_v2_mb4']:6.3f} {r['t_v2_no_gemms']:6.3f} {r['t_v2_no_subst']:6.3f} {r['t_v2_kkt_only']:6.3f}")


if __name__ == "__main__":
    main()

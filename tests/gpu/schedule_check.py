"""One call on the GPU machine: the recurrent kernel's schedules (`recurrent.SCHEDULES`) against
each other on the benchmark rows, and the split of the forward's time between its two launches.

    python tests/gpu/schedule_check.py [--precompile] [--schedules BASE OTHER ...] [--rows ROW ...] [--out DIR]

For each row (inputs of `device_check.gen_inputs`): o and the final state of every schedule against
the first (default "serial overlap"; max |diff| and relative RMS; the schedules compute the same products, so they should agree
to the last bit or nearly), a bitwise repeat of each schedule (a moving result means a race), then
CUDA-graph median times of the whole op per schedule, of the prepare launch alone and of the
recurrent launch alone. Prints a short table last and writes schedule_check.json to --out.
Not collected by pytest; correctness against the fp64 recurrence is the GPU test tier's job
(run it with FLASHQLA_RECURRENT_SCHEDULE=overlap to test that schedule).
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

#: the schedules compared (--schedules); the first is the base of the diffs
SCHEDULES = ("serial", "overlap")


def precompile(rows, test_schedule="overlap"):
    """Kernels of the GPU test tier (with `test_schedule`) and of the rows (every schedule)."""
    from flashqla.ops.gdn.kernels.sm90 import precompile as pc
    from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v

    bf, f32, i32 = "bfloat16", "float32", "int32"
    specs = []
    for (H, HV), varlens, bvs in [
        ((2, 4), (False, True), (64, 128)),
        ((4, 4), (False,), (64,)),
        ((1, 4), (False,), (64,)),
        ((1, 2), (False, True), (64,)),
    ]:
        for varlen in varlens:
            specs.append(("prepare", (H, HV, 128, bf, f32, i32, varlen)))
            for BV in bvs:
                specs.append(("recurrent", (H, HV, 128, 128, BV, bf, i32, varlen, test_schedule)))
    specs += [("prepare", (1, 2, 128, "float16", "float16", "int64", True)),
              ("recurrent", (1, 2, 128, 128, 64, "float16", "int64", True, test_schedule))]
    for name in rows:
        H, HV, lengths = BENCH_ROWS[name]
        varlen = len(set(lengths)) != 1
        specs.append(("prepare", (H, HV, 128, bf, f32, i32, varlen)))
        BV = pick_block_v(len(lengths), HV)
        for sch in SCHEDULES:
            specs.append(("recurrent", (H, HV, 128, 128, BV, bf, i32, varlen, sch)))
    t = time.time()
    pc(specs, max_workers=min(len(specs), os.cpu_count() or 8))
    print(f"precompiled {len(set(specs))} kernels in {time.time() - t:.1f} s", flush=True)


def _diff(a, b):
    a, b = a.float(), b.float()
    d = (a - b).abs()
    rel = (d.pow(2).mean().sqrt() / b.pow(2).mean().sqrt().clamp_min(1e-30)).item()
    return float(d.max().item()), rel, bool(torch.equal(a, b)), bool(torch.isfinite(a).all().item())


def run_rows(rows, out):
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90 import recurrent as R
    from flashqla.ops.gdn.kernels.sm90.prepare import chunk_prepare_fwd

    saved = R.DEFAULT_SCHEDULE
    table = []
    for name in rows:
        H, HV, lengths = BENCH_ROWS[name]
        varlen = len(set(lengths)) != 1
        x = gen_inputs(H, HV, lengths, varlen)
        scale = 128**-0.5
        res = {}
        for sch in SCHEDULES:
            R.DEFAULT_SCHEDULE = sch
            r1 = chunk_gated_delta_rule_fwd(**x, output_final_state=True, poison_outputs=True)
            r2 = chunk_gated_delta_rule_fwd(**x, output_final_state=True, poison_outputs=True)
            torch.cuda.synchronize()
            rep = torch.equal(r1.o, r2.o) and torch.equal(r1.final_state, r2.final_state)
            res[sch] = (r1, rep)
        base = res[SCHEDULES[0]][0]
        row = {"row": name}
        for sch in SCHEDULES:
            r, rep = res[sch]
            do = _diff(r.o, base.o)
            dh = _diff(r.final_state, base.final_state)
            row[sch] = {"o_maxdiff": do[0], "o_rel": do[1], "o_equal": do[2], "o_finite": do[3],
                        "ht_maxdiff": dh[0], "ht_rel": dh[1], "ht_equal": dh[2], "ht_finite": dh[3], "repeat_bitwise": rep}
            print(name, sch, row[sch], flush=True)
        del res, base
        # timings: whole op per schedule, prepare alone, recurrent alone per schedule
        for sch in SCHEDULES:
            R.DEFAULT_SCHEDULE = sch
            row[f"t_{sch}"] = time_graph(lambda: chunk_gated_delta_rule_fwd(**x, output_final_state=True))
        A, gcl = chunk_prepare_fwd(x["k"], x["g"], x["beta"], x["cu_seqlens"], HV)
        row["t_prepare"] = time_graph(lambda: chunk_prepare_fwd(x["k"], x["g"], x["beta"], x["cu_seqlens"], HV, A=A, g_cum_log2=gcl))
        o = torch.empty_like(x["v"])
        ht = torch.empty(len(lengths), HV, 128, 128, dtype=torch.float32, device="cuda")
        for sch in SCHEDULES:
            row[f"t_rec_{sch}"] = time_graph(lambda: R.chunk_recurrent_fwd(
                x["q"], x["k"], x["v"], A, gcl, scale, x["initial_state"], True, x["cu_seqlens"], o=o, final_state=ht, schedule=sch))
        print(name, {k: round(v, 4) for k, v in row.items() if k.startswith("t_")}, flush=True)
        table.append(row)
        del x, A, gcl, o, ht
        torch.cuda.empty_cache()
    R.DEFAULT_SCHEDULE = saved
    out["rows"] = table
    return table


def main():
    global SCHEDULES
    ap = argparse.ArgumentParser()
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--schedules", nargs="+", default=list(SCHEDULES))
    ap.add_argument("--rows", nargs="*", default=list(BENCH_ROWS))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    SCHEDULES = tuple(a.schedules)
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "schedules": SCHEDULES}
    if a.precompile:
        precompile(a.rows, test_schedule=SCHEDULES[-1])
    table = run_rows(a.rows, out)
    with open(os.path.join(a.out, "schedule_check.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    base = SCHEDULES[0]
    print(f"\n== ms (CUDA graphs, median): whole op and recurrent launch alone per schedule; prepare alone; "
          f"diff = each schedule vs {base} (max |o diff|, max |ht diff|, bitwise repeat, finite)")
    print(f"{'row':14s} " + " ".join(f"{'op ' + s_:>14s}" for s_ in SCHEDULES) + f" {'prep':>6s} "
          + " ".join(f"{'rec ' + s_:>14s}" for s_ in SCHEDULES) + f" {'FlashQLA':>8s} {'FLA':>6s}  diff")
    for r in table:
        diffs = "; ".join(f"{s_}: {r[s_]['o_maxdiff']:.1e} {r[s_]['ht_maxdiff']:.1e} {r[s_]['repeat_bitwise']} "
                          f"{r[s_]['o_finite'] and r[s_]['ht_finite']}" for s_ in SCHEDULES[1:])
        print(f"{r['row']:14s} " + " ".join(f"{r['t_' + s_]:14.3f}" for s_ in SCHEDULES) + f" {r['t_prepare']:6.3f} "
              + " ".join(f"{r['t_rec_' + s_]:14.3f}" for s_ in SCHEDULES)
              + f" {PEERS[r['row']][0]:8.3f} {PEERS[r['row']][1]:6.3f}  {diffs}")


if __name__ == "__main__":
    main()

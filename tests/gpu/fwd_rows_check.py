"""One call on the GPU machine: where the forward's time goes on chosen benchmark rows, and what the
split plans around the planner's pick measure.

    python tests/gpu/fwd_rows_check.py [--rows "16/48 8192x4" ...] [--lengths 1024 2048 ...] [--flash-qla] [--out DIR]

Per row (the forward benchmark's inputs: `flashqla.bench.runner.InputFactory`, packed int32 offsets,
initial state given, final state returned): the public op as the benchmark calls it (cp auto with the
host length hint), the op with cp off, its two launches alone (prepare, also on the batched layout when the lengths are equal; recurrent at the planner's
value-slice width), the op at that width (cp off), the split forward at every L of `--lengths` below the longest sequence with BV 128
and (where 128 leaves half the SMs idle) 64, and with `--flash-qla` FlashQLA's public op on the same inputs. Every variant is gated
against the fp64 chunked result (relative RMS of o <= 2e-2) before it is CUDA-graph timed
(`flashqla.bench.timing.time_cuda_graph`, the benchmark's timer). Prints a table last and writes
fwd_rows_check.json to --out. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

ROWS = ["16/48 8192x4", "8/24 4096x8", "16/48 2048x4", "32/32 4096x8", "32/32 1024x8", "16/32 4096x8",
        "16/64 4096x8", "2/8 4096+4096"]
LENGTHS = [1024, 2048, 4096]


def main(argv=None) -> int:
    from flashqla.bench.grid import Row, parse_heads, parse_mix
    from flashqla.bench.runner import InputFactory, reference_for
    from flashqla.bench.timing import time_cuda_graph
    from flashqla.bench.trusted import rel_rms
    from flashqla.cp import planner as P
    from flashqla.cp.driver import chunk_gated_delta_rule_cp_fwd
    from flashqla.ops.gdn.api import chunk_gated_delta_rule, chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90 import recurrent as R
    from flashqla.ops.gdn.kernels.sm90.prepare import chunk_prepare_fwd

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=ROWS)
    ap.add_argument("--lengths", nargs="+", type=int, default=LENGTHS)
    ap.add_argument("--flash-qla", action="store_true")
    ap.add_argument("--time-budget", type=float, default=480.0, help="start no new row after S seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)

    def timed(fn):
        return time_cuda_graph(fn).ms

    results = {}
    t_start = time.time()
    # ours on every row first, FlashQLA after (its first calls in a process have slowed the kernel
    # loads that followed them)
    for peer_pass in ((False, True) if a.flash_qla else (False,)):
        for name in a.rows:
            if time.time() - t_start > a.time_budget:
                print(f"time budget reached: {name} and later rows skipped", flush=True)
                break
            heads, mix = name.split()
            row = Row(parse_heads(heads), parse_mix(mix))
            x = InputFactory("cuda", row.mix.T).get(row)
            HV, lengths = row.heads.h_v, list(row.mix.lengths)
            ref_o, _ = reference_for(x)
            scale = 128**-0.5
            res = results.setdefault(name, {"row": name})

            def gate_time(key, fn):
                try:
                    with torch.no_grad():
                        out = fn()
                        o = out[0] if isinstance(out, tuple) else out.o
                        torch.cuda.synchronize()
                        err = rel_rms(o, ref_o)
                        del o, out
                        res[key] = timed(fn) if err <= 2e-2 else math.nan
                        res[key + "_err"] = err
                except Exception as exc:  # reported, the row goes on
                    res[key] = math.nan
                    res[key + "_error"] = f"{type(exc).__name__}: {str(exc)[:200]}"
                print(name, key, res.get(key), res.get(key + "_err"), res.get(key + "_error", ""), flush=True)

            if peer_pass:
                try:
                    import flash_qla

                    gate_time("flash_qla", lambda: flash_qla.chunk_gated_delta_rule(
                        x.q, x.k, x.v, x.g, x.beta, scale=scale, initial_state=x.h0, output_final_state=True,
                        cu_seqlens=x.cu_seqlens))
                except ImportError as exc:
                    res["flash_qla_error"] = str(exc)
            else:
                plan = P.plan_cp(HV, len(lengths), sum(lengths), exact=True, max_seqlen=-(-max(lengths) // 64) * 64)
                res["plan"] = f"{'split L=%d' % plan.segment_len if plan.split else 'unsplit'} BV={plan.BV}"
                bv = R.pick_block_v(len(lengths), HV)
                res["rec_bv"] = bv
                gate_time("op", lambda: chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, scale=scale, initial_state=x.h0,
                                                               output_final_state=True, cu_seqlens=x.cu_seqlens,
                                                               cu_seqlens_cpu=x.cu_seqlens_cpu))
                gate_time("op_off", lambda: chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, scale=scale, initial_state=x.h0,
                                                                   output_final_state=True, cu_seqlens=x.cu_seqlens, cp="off"))
                gate_time("op_one_width", lambda: chunk_gated_delta_rule_fwd(
                    x.q, x.k, x.v, x.g, x.beta, scale=scale, initial_state=x.h0, output_final_state=True,
                    cu_seqlens=x.cu_seqlens, cp="off", block_v=bv, for_backward=False))
                with torch.no_grad():
                    A, gcl = chunk_prepare_fwd(x.k, x.g, x.beta, x.cu_seqlens, HV)
                    res["prepare"] = timed(lambda: chunk_prepare_fwd(x.k, x.g, x.beta, x.cu_seqlens, HV, A=A, g_cum_log2=gcl))
                    o = torch.empty_like(x.v)
                    ht = torch.empty(len(lengths), HV, 128, 128, dtype=torch.float32, device="cuda")
                    res["recurrent"] = timed(lambda: R.chunk_recurrent_fwd(x.q, x.k, x.v, A, gcl, scale, x.h0, True, x.cu_seqlens,
                                                                           block_v=bv, o=o, final_state=ht))
                    if len(set(lengths)) == 1:  # equal lengths: prepare on the batched layout too (no offsets to search)
                        n, L = len(lengths), lengths[0]
                        kb, gb, bb = (t.reshape(n, L, *t.shape[2:]) for t in (x.k, x.g, x.beta))
                        Ab, gclb = chunk_prepare_fwd(kb, gb, bb, None, HV)
                        res["prepare_batched"] = timed(lambda: chunk_prepare_fwd(kb, gb, bb, None, HV, A=Ab, g_cum_log2=gclb))
                        del Ab, gclb
                    del A, gcl, o, ht
                print(name, "prepare", res["prepare"], "batched", res.get("prepare_batched"), "recurrent", res["recurrent"], flush=True)
                for L in a.lengths:
                    if L >= max(lengths):
                        continue
                    for BV in ((128, 64) if HV * len(lengths) < 66 else (128,)):  # BV 64 only where 128 leaves half the SMs idle
                        gate_time(f"split_{L}_{BV}", lambda L=L, BV=BV: chunk_gated_delta_rule_cp_fwd(
                            x.q, x.k, x.v, x.g, x.beta, scale, x.h0, True, x.cu_seqlens, cp="on", segment_len=L, block_v=BV,
                            max_seqlen=max(lengths), relayout=False))
            with open(os.path.join(a.out, "fwd_rows_check.json"), "w") as f:
                json.dump(list(results.values()), f, indent=1)
            del x, ref_o
            torch.cuda.empty_cache()
    results = list(results.values())

    print("\n== forward rows (ms, CUDA graphs, median; op = cp auto with the length hint)")
    for r in results:
        splits = " ".join(f"{k[6:]}={v:.3f}" for k, v in r.items() if k.startswith("split_") and not k.endswith(("_err", "_error"))
                          and isinstance(v, float))
        fq = r.get("flash_qla", math.nan)
        if "prepare" not in r:
            continue
        print(f"{r['row']:16s} [{r['plan']}] op {r.get('op', math.nan):.3f} off {r.get('op_off', math.nan):.3f} "
              f"one width {r.get('op_one_width', math.nan):.3f} prep {r['prepare']:.3f} (batched {r.get('prepare_batched', math.nan):.3f}) rec(BV{r['rec_bv']}) {r['recurrent']:.3f} "
              f"fq {fq:.3f} | {splits}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

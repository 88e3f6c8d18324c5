"""One call on the GPU machine: the streamed forward (`flashqla.ops.gdn.kernels.sm90.streamed`) against
the plain two-launch forward, row by row.

    python tests/gpu/streamed_check.py [--rows "2/8 1x2048" ...] [--replays-check 50] [--out DIR]

Per row (the forward benchmark's inputs, `flashqla.bench.runner.InputFactory`: packed int32 offsets,
initial state given, final state returned), the public op as the benchmark calls it (cp auto with
the host length hint; rows the planner splits do not reach the streamed launch and are marked so),
once with FLASHQLA_STREAMED=0 and once with 1:
- gate: o against the fp64 chunked result (relative RMS <= 2e-2), both modes;
- o and the final state of the streamed launch bitwise equal to the plain launch's, in eager calls
  and in every one of `--replays-check` replays of one captured CUDA graph (a missed hand-over
  would read a stale or partly written A tile and differ);
- CUDA-graph time of both (`flashqla.bench.timing.time_cuda_graph`, the benchmark's timer).
Prints a table last and writes streamed_check.json to --out. Not collected by pytest.
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

ROWS = ["2/8 1x2048", "4/16 1x2048", "8/32 1x2048", "16/64 1x2048", "8/32 1x4096", "16/64 1x8192", "2/8 2048x4",
        "2/8 1+63+65+2000", "4/16 4096+4096", "16/32 8192x4", "32/32 1024x8"]


def main(argv=None) -> int:
    from flashqla.bench.grid import Row, parse_heads, parse_mix
    from flashqla.bench.runner import InputFactory, reference_for
    from flashqla.bench.timing import time_cuda_graph
    from flashqla.bench.trusted import rel_rms
    from flashqla.cp import planner as P
    from flashqla.ops.gdn.api import STREAMED_ENV, chunk_gated_delta_rule

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=ROWS)
    ap.add_argument("--replays-check", type=int, default=50)
    ap.add_argument("--time-budget", type=float, default=400.0, help="start no new row after S seconds")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)

    results = []
    t_start = time.time()
    for name in a.rows:
        if time.time() - t_start > a.time_budget:
            print(f"time budget reached: {name} and later rows skipped", flush=True)
            break
        heads, mix = name.split()
        row = Row(parse_heads(heads), parse_mix(mix))
        x = InputFactory("cuda", row.mix.T).get(row)
        lengths = list(row.mix.lengths)
        ref_o, _ = reference_for(x)
        scale = 128**-0.5
        plan = P.plan_cp(row.heads.h_v, len(lengths), sum(lengths), exact=True, max_seqlen=-(-max(lengths) // 64) * 64)
        res = {"row": name, "plan": f"split L={plan.segment_len}" if plan.split else f"unsplit BV={plan.BV}"}

        def call():
            return chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, scale=scale, initial_state=x.h0, output_final_state=True,
                                          cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu)

        outs = {}
        try:
            with torch.no_grad():
                for mode in ("0", "1"):
                    os.environ[STREAMED_ENV] = mode
                    o, ht = call()
                    torch.cuda.synchronize()
                    res[f"err_{mode}"] = rel_rms(o, ref_o)
                    outs[mode] = (o.clone(), ht.clone())
                    res[f"ms_{mode}"] = time_cuda_graph(call).ms if res[f"err_{mode}"] <= 2e-2 else math.nan
                o0, h0_ = outs["0"]
                same = [bool(torch.equal(outs["1"][0], o0) and torch.equal(outs["1"][1], h0_))]
                os.environ[STREAMED_ENV] = "1"
                for _ in range(5):  # eager repeats
                    o, ht = call()
                    same.append(bool(torch.equal(o, o0) and torch.equal(ht, h0_)))
                # one captured graph replayed: every replay bitwise the plain result
                side = torch.cuda.Stream()
                side.wait_stream(torch.cuda.current_stream())
                with torch.cuda.stream(side):
                    call()
                torch.cuda.current_stream().wait_stream(side)
                graph = torch.cuda.CUDAGraph()
                with torch.cuda.graph(graph):
                    og, hg = call()
                bad = 0
                for _ in range(a.replays_check):
                    og.fill_(float("nan"))
                    graph.replay()
                    bad += int(not (torch.equal(og, o0) and torch.equal(hg, h0_)))
                torch.cuda.synchronize()
                res["bitwise_eager"] = all(same)
                res["graph_replays_differing"] = bad
                del graph, og, hg
        except Exception as exc:  # reported, the next row goes on
            res["error"] = f"{type(exc).__name__}: {str(exc)[:300]}"
        finally:
            os.environ.pop(STREAMED_ENV, None)
        res["speedup"] = res.get("ms_0", math.nan) / res.get("ms_1", math.nan) if res.get("ms_1") else math.nan
        print(json.dumps(res), flush=True)
        results.append(res)
        with open(os.path.join(a.out, "streamed_check.json"), "w") as f:
            json.dump(results, f, indent=1)
        del x, ref_o, outs
        torch.cuda.empty_cache()

    print("\n== streamed forward vs plain (ms, CUDA graphs, median; op with cp auto and the length hint)")
    print(f"{'row':<22} {'plan':<14} {'plain':>8} {'streamed':>9} {'x':>6} {'bitwise':>8} {'replays !=':>10} {'err':>9}")
    for r in results:
        print(f"{r['row']:<22} {r['plan']:<14} {r.get('ms_0', math.nan):8.4f} {r.get('ms_1', math.nan):9.4f} "
              f"{r.get('speedup', math.nan):6.3f} {str(r.get('bitwise_eager')):>8} {str(r.get('graph_replays_differing')):>10} "
              f"{r.get('err_1', math.nan):9.2e} {r.get('error', '')}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One call on the GPU machine: the prepare kernel with all G value heads of a q/k head per CTA
against one value head per CTA (`prepare.pick_heads_per_cta`), alone and before the recurrent kernel.

    python tests/gpu/prepare_heads_check.py [--rows "2/8 1x2048" ...] [--precompile]

Per row (the forward benchmark's inputs, packed int32 offsets): A diag(beta) and g_cum_log2 of the
two builds compared bitwise (buffers zeroed first, so unwritten gap slots compare equal); CUDA-graph
times (ms, the benchmark's timer, `flashqla.bench.timing.time_cuda_graph`) of each prepare alone,
the recurrent kernel alone, the two prepare + recurrent pairs, and the public op (cp auto, which
picks the build by `pick_heads_per_cta`). `--precompile` only builds the one-head kernels into
TileLang's cache (CPU). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

ROWS = ["2/8 1x2048", "4/16 1x2048", "16/32 1x2048", "8/24 1x2048", "8/32 1x2048", "2/8 2048x4", "4/16 1x4096",
        "2/8 4096+4096"]


def builds(H, HV):
    from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel

    return [build_prepare_kernel(H, HV, 128, "bfloat16", "float32", "int32", True, "v3", p) for p in (None, 1)]


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=ROWS)
    ap.add_argument("--precompile", action="store_true")
    a = ap.parse_args(argv)
    from flashqla.bench.grid import Row, parse_heads, parse_mix

    rows = [(n, Row(parse_heads(n.split()[0]), parse_mix(n.split()[1]))) for n in a.rows]
    if a.precompile:
        for _, r in rows:
            builds(r.heads.h_qk, r.heads.h_v)
        return 0

    import torch

    from flashqla.bench.runner import InputFactory
    from flashqla.bench.timing import time_cuda_graph
    from flashqla.ops.gdn.kernels.sm90._common import CHUNK, num_slots
    from flashqla.ops.gdn.api import chunk_gated_delta_rule
    from flashqla.ops.gdn.kernels.sm90.prepare import pick_heads_per_cta
    from flashqla.ops.gdn.kernels.sm90.recurrent import chunk_recurrent_fwd, pick_block_v

    out = []
    for name, row in rows:
        x = InputFactory("cuda", row.mix.T).get(row)
        H, HV, N = row.heads.h_qk, row.heads.h_v, len(row.mix.lengths)
        S = num_slots(1, row.mix.T, N, True)
        bv = pick_block_v(N, HV)
        scale = 128**-0.5
        kg, k1 = builds(H, HV)
        A = [torch.zeros(HV, S * CHUNK, CHUNK, dtype=x.k.dtype, device="cuda") for _ in range(2)]
        gc = [torch.zeros(HV, S * CHUNK, dtype=torch.float32, device="cuda") for _ in range(2)]
        o = torch.empty_like(x.v)
        ht = torch.empty(N, HV, 128, 128, dtype=torch.float32, device="cuda")

        def prep_g():
            kg(x.k, x.g, x.beta, x.cu_seqlens, A[0], gc[0])

        def prep_1():
            k1(x.k, x.g, x.beta, x.cu_seqlens, A[1], gc[1])

        def rec(i=0):
            chunk_recurrent_fwd(x.q, x.k, x.v, A[i], gc[i], scale, x.h0, True, x.cu_seqlens, block_v=bv, o=o, final_state=ht)

        def op():
            return chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, scale=scale, initial_state=x.h0, output_final_state=True,
                                          cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu)

        with torch.no_grad():
            prep_g(), prep_1()
            torch.cuda.synchronize()
            same = torch.equal(A[0], A[1]) and torch.equal(gc[0], gc[1])
            t = {"row": name, "A_bitwise": same, "picked": "one" if pick_heads_per_cta(S, H, HV) else "G"}
            t["prep_G"] = time_cuda_graph(prep_g).ms
            t["prep_1"] = time_cuda_graph(prep_1).ms
            t["rec"] = time_cuda_graph(rec).ms
            t["pair_G"] = time_cuda_graph(lambda: (prep_g(), rec(0))).ms
            t["pair_1"] = time_cuda_graph(lambda: (prep_1(), rec(1))).ms
            t["op"] = time_cuda_graph(op).ms
        print(t, flush=True)
        out.append(t)
        del x, A, gc
        torch.cuda.empty_cache()
    print("\n== prepare: G value heads a CTA against one (ms, CUDA graphs, median; op: cp auto, picked build)")
    keys = ["prep_G", "prep_1", "rec", "pair_G", "pair_1", "op"]
    print(f"{'row':<16} " + " ".join(f"{k:>8}" for k in keys) + "  picked  A bitwise")
    for t in out:
        print(f"{t['row']:<16} " + " ".join(f"{t[k]:8.4f}" for k in keys) + f"  {t['picked']:>6}  {t['A_bitwise']}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

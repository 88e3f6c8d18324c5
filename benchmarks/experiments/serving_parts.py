"""Question: where does the serving call's checkpoint cost go (issue 43, goal <= 3% over the plain
call)? Splits `serving_overhead.py`'s rows into its two launches, each timed alone by CUDA-graph
replay (median): the prepare kernel, the plain recurrent kernel (fp32 "kv" states, `chunk_recurrent_fwd`:
column "plain"), and the recurrent kernel's serving build without checkpoints
and with k chunk-aligned checkpoints per sequence, for k in --ks. The slope over k is the cost of
one checkpoint's store; the step from no checkpoints to k = 1 is the checkpoint build's fixed cost.

    python benchmarks/experiments/serving_parts.py [--rows 2/8:1024x8,16/64:1024x8] [--ks 1,2,4,8,16]

Inputs as `serving_overhead.make` (bf16 "vk" pool of 2N rows, shuffled). Prints one table (us).
Result: benchmarks/journal/serving.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="2/8:1024x8,16/64:1024x8,16/32:8192x4")
    p.add_argument("--ks", default="1,2,4,8,16")
    a = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("serving_parts: needs a Hopper GPU; nothing timed")
        return 0
    from serving_overhead import make, parse_rows

    from flashqla.bench.timing import time_cuda_graph
    from flashqla.contract import clamp_gates
    from flashqla.ops.gdn.backend import default_backend
    from flashqla.ops.gdn.kernels.sm90.recurrent import chunk_recurrent_fwd, chunk_recurrent_serving

    ks = [int(x) for x in a.ks.split(",")]
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 vk pool | CUDA graphs, median, us")
    head = f"{'H/HV':>7} {'T x N':>10} {'prepare':>8} {'plain':>7} {'kern 0':>7}" + "".join(
        f" {'k=' + str(k):>7}" for k in ks) + f" {'us/ckpt':>8}"
    print(head)
    for H, HV, T, N in parse_rows(a.rows):
        xd, cu, h0, pool, rows, _, _ = make(H, HV, T, N, torch.bfloat16)
        q, k, v, g, beta = (xd[n].contiguous() for n in ("q", "k", "v", "g", "beta"))
        g = clamp_gates(g)
        be = default_backend()
        A, G2 = be.prepare(k, g, beta, cu, HV)
        scale = q.shape[-1] ** -0.5
        t_prep = time_cuda_graph(lambda: be.prepare(k, g, beta, cu, HV)).ms * 1e3
        o = torch.empty_like(v)

        def kern(pos=None, cks=None):
            return chunk_recurrent_serving(q, k, v, A, G2, scale, pool, pool, rows, None, cu, state_layout="vk",
                                           checkpoint_positions=pos, checkpoint_states=cks, o=o)

        h0kv = pool[rows].float().transpose(-1, -2).contiguous()
        t_plain = time_cuda_graph(lambda: chunk_recurrent_fwd(q, k, v, A, G2, scale, h0kv, True, cu, o=o)).ms * 1e3
        t0 = time_cuda_graph(lambda: kern()).ms * 1e3
        tk = []
        for kk in ks:
            step = max(T // kk // 64, 1) * 64
            offs = torch.arange(1, kk + 1, device=q.device) * step
            offs = offs[offs <= T]
            pos = (cu[:-1].long()[:, None] + offs[None]).reshape(-1).contiguous()
            cks = torch.empty(pos.numel(), HV, v.shape[-1], k.shape[-1], device=q.device, dtype=torch.bfloat16)
            tk.append(time_cuda_graph(lambda: kern(pos, cks)).ms * 1e3)
        slope = (tk[-1] - tk[0]) / (ks[-1] - ks[0]) if len(ks) > 1 else float("nan")
        print(f"{H:>3}/{HV:<3} {T:>5} x {N:<3} {t_prep:>8.1f} {t_plain:>7.1f} {t0:>7.1f}"
              + "".join(f" {x:>7.1f}" for x in tk) + f" {slope:>8.2f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

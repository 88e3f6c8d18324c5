"""Question: where in a chunk does the serving build's checkpoint cost go (issue 43: 4 checkpoints a
sequence cost about 9% of the kernel on one-sequence 8192-token rows, about 280 cycles a chunk, while
their stores take about 1 us)? Runs the serving kernel's phase-clock build
(`recurrent.build_recurrent_serving_kernel_clocked`: the chain's thread 0 and the producer's lane 0
sum SM clock cycles per phase over the chunks, `recurrent.SERVING_CLOCKS`) without checkpoints and
with k chunk-aligned checkpoints per sequence, checks that its outputs equal the shipped build's bit
for bit, and prints the median over CTAs of each phase's cycles per chunk beside the kernel's time.

    python benchmarks/experiments/serving_chain_clock.py [--rows 16/32:8192x1,16/32:8192x4] [--ks 0,1,4]
    python benchmarks/experiments/serving_chain_clock.py --precompile-only   # builds its kernels, no GPU

Inputs as `serving_overhead.make` (bf16 "vk" pool). Result: benchmarks/journal/serving.md.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))

#: rows at BV = 64 (N x HV <= 66): the clocked build at BV = 128 spills (8-128 bytes of stores; its
#: timings would not be the shipped kernel's)
DEFAULT_ROWS = "16/32:8192x1,16/64:8192x1,8/32:8192x1,2/8:1024x8"


def _positions(cu, T, k):
    """k chunk-aligned positions per sequence (its k equal parts' ends), int64 on cu's device."""
    if k == 0:
        return None
    step = max(T // k // 64, 1) * 64
    offs = torch.arange(1, k + 1, device=cu.device) * step
    offs = offs[offs <= T]
    return (cu[:-1].long()[:, None] + offs[None]).reshape(-1).contiguous()


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=DEFAULT_ROWS)
    p.add_argument("--ks", default="0,1,4")
    p.add_argument("--precompile-only", action="store_true")
    a = p.parse_args(argv)
    from serving_overhead import parse_rows

    from flashqla.ops.gdn.kernels.sm90 import recurrent as R

    rows = parse_rows(a.rows)
    ks = [int(x) for x in a.ks.split(",")]
    if a.precompile_only:
        for H, HV, T, N in rows:
            bv = R.pick_block_v(N, HV, 128)
            for ck in sorted({k > 0 for k in ks}):
                R.build_recurrent_serving_kernel_clocked(H, HV, 128, 128, bv, "bfloat16", "int32", True, "bfloat16",
                                                         "vk", ck)
        print("built")
        return 0
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("serving_chain_clock: needs a Hopper GPU; nothing timed (--precompile-only builds the kernels)")
        return 0
    from serving_overhead import make

    from flashqla.bench.timing import time_cuda_graph
    from flashqla.contract import clamp_gates
    from flashqla.ops.gdn.backend import default_backend

    names = R.SERVING_CLOCKS
    print(f"# {torch.cuda.get_device_name()} | bf16 vk pool | cycles per chunk, median over CTAs (chain: thread 0; "
          "producer: lane 0) | kernel us: the shipped build, CUDA graphs, median")
    print(f"{'row':>16} {'k':>3} {'us':>7} " + " ".join(f"{n:>13}" for n in names[1:]) + "  bitwise")
    for H, HV, T, N in rows:
        xd, cu, _, pool, idx, _, _ = make(H, HV, T, N, torch.bfloat16)
        q, k, v, g, beta = (xd[n].contiguous() for n in ("q", "k", "v", "g", "beta"))
        A, G2 = default_backend().prepare(k, clamp_gates(g), beta, cu, HV)
        scale = q.shape[-1] ** -0.5
        bv = R.pick_block_v(N, HV, v.shape[-1])
        if bv != 64:
            print(f"# {H}/{HV} {T}x{N} runs at BV = {bv}: the clocked build spills there, its cycles are not the shipped kernel's")
        ncta = (v.shape[-1] // bv) * HV * N
        for kk in ks:
            pos = _positions(cu, T, kk)
            outs = []
            for clocked in (False, True):
                pl = pool.clone()
                cks = None if pos is None else torch.empty(pos.numel(), HV, 128, 128, device=q.device, dtype=pool.dtype)
                clocks = torch.zeros(ncta, len(names), dtype=torch.int64, device=q.device) if clocked else None
                o = R.chunk_recurrent_serving(q, k, v, A, G2, scale, pl, pl, idx, None, cu, state_layout="vk",
                                              checkpoint_positions=pos, checkpoint_states=cks, clocks=clocks)
                torch.cuda.synchronize()
                outs.append((o, pl, cks, clocks))
            same = all(torch.equal(x, y) for x, y in zip(outs[0][:3], outs[1][:3]) if x is not None)
            pl = pool.clone()
            cks = None if pos is None else torch.empty(pos.numel(), HV, 128, 128, device=q.device, dtype=pool.dtype)
            us = time_cuda_graph(lambda: R.chunk_recurrent_serving(q, k, v, A, G2, scale, pl, pl, idx, None, cu,
                                                                   state_layout="vk", checkpoint_positions=pos,
                                                                   checkpoint_states=cks)).ms * 1e3
            c = outs[1][3].double()
            per = c[:, 1:] / c[:, :1].clamp(min=1)
            med = per.median(dim=0).values.tolist()
            print(f"{f'{H}/{HV} {T}x{N}':>16} {kk:>3} {us:>7.1f} " + " ".join(f"{x:>13.0f}" for x in med)
                  + f"  {same}", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

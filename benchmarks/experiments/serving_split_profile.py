"""Question: where does the serving call's time go on the split plan (few long sequences at few
heads: the torch path, +100% to +283% over the plain call on the H100 serving page)? Runs the plain
call and the serving call (bf16 "vk" pool, 4 checkpoints per sequence at its quarter points, as
`flashqla.bench --serving`) under torch.profiler and prints, per row, the CUDA time of each kernel
name per call for both, with the checkpoint method the torch path took.

    python benchmarks/experiments/serving_split_profile.py [--rows 8/32:32768x1,32/32:32768x1] [--top 12]

Result: benchmarks/journal/serving.md.
"""

from __future__ import annotations

import argparse
import collections
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(__file__))


def kernel_times(fn, reps: int) -> dict:
    from torch.profiler import ProfilerActivity, profile

    fn()
    torch.cuda.synchronize()
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(reps):
            fn()
        torch.cuda.synchronize()
    out = collections.Counter()
    for e in prof.key_averages():
        t = getattr(e, "device_time_total", None)
        if t is None:
            t = e.cuda_time_total
        if t > 0 and e.key and not e.key.startswith("ProfilerStep"):
            out[e.key[:70]] += t / reps
    return out


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default="2/8:32768x1,8/32:32768x1,32/32:32768x1")
    p.add_argument("--top", type=int, default=12)
    p.add_argument("--reps", type=int, default=5)
    a = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("serving_split_profile: needs a Hopper GPU; nothing timed")
        return 0
    from serving_overhead import make, parse_rows

    import flashqla
    from flashqla.bench.timing import time_cuda_graph
    from flashqla.ops.gdn import serving as op_serving

    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | bf16 vk pool, 4 checkpoints / sequence")
    for H, HV, T, N in parse_rows(a.rows):
        xd, cu, h0, pool, rows, pos, cks = make(H, HV, T, N, torch.bfloat16)
        cu_cpu = cu.cpu()

        def plain():
            return flashqla.chunk_gated_delta_rule(**xd, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                                   cu_seqlens_cpu=cu_cpu)

        def serving():
            return flashqla.chunk_gated_delta_rule(**xd, initial_state=pool, output_final_state=True, cu_seqlens=cu,
                                                   cu_seqlens_cpu=cu_cpu, state_indices=rows, state_layout="vk",
                                                   checkpoint_positions=pos, checkpoint_states=cks)

        with torch.no_grad():
            serving()
            path = dict(op_serving.LAST_PATH)
            tp = time_cuda_graph(plain).ms
            ts = time_cuda_graph(serving).ms
            kp = kernel_times(plain, a.reps)
            ks = kernel_times(serving, a.reps)
        print(f"\n## {H}/{HV} {T}x{N}: plain {tp:.3f} ms, serving {ts:.3f} ms (graphs); path {path}")
        print(f"{'kernel':<72} {'plain us':>9} {'serving us':>10}")
        names = sorted(set(kp) | set(ks), key=lambda n: -max(kp.get(n, 0), ks.get(n, 0)))
        for n in names[:a.top]:
            print(f"{n:<72} {kp.get(n, 0):9.1f} {ks.get(n, 0):10.1f}")
        print(f"{'total (profiled, not graphed)':<72} {sum(kp.values()):9.1f} {sum(ks.values()):10.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""What does the device-offsets check (`check_offsets=True`: an asynchronous device assert,
`flashqla.contract.assert_offsets_async`) cost per call? Eager calls (the check is skipped under
CUDA-graph timing would hide its host time): per row, the mean wall time of back-to-back calls
with the check and without it, interleaved in blocks, after warm-up.

    python benchmarks/experiments/offsets_check_cost.py [--calls 300]

Prints one table (GPU named). Result: benchmarks/journal/reliability.md.
"""
from __future__ import annotations

import argparse
import statistics
import time

import torch

ROWS = [(2, 4, [256]), (2, 8, [1024] * 4), (16, 32, [8192] * 4), (16, 64, [1024] * 8)]


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--calls", type=int, default=300)
    a = p.parse_args(argv)
    if not torch.cuda.is_available():
        print("needs a CUDA GPU")
        return 0
    import flashqla
    from flashqla.testing import make_gdn_inputs

    print(f"# {torch.cuda.get_device_name()} | eager wall time per call (ms), median of 5 blocks, {a.calls} calls in all")
    print(f"{'H/HV':>7} {'lengths':>14} {'check on':>9} {'off':>9} {'cost us':>8}")
    for H, HV, lengths in ROWS:
        x = make_gdn_inputs(B=1, T=sum(lengths), H=H, HV=HV, seqlens=lengths, seed=0, device="cuda", dtype=torch.bfloat16)
        d = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
        d["g"], d["beta"] = d["g"].float(), d["beta"].float()
        cu = x["cu_seqlens"].to("cuda", torch.int32)
        cpu = cu.cpu()
        res = {True: [], False: []}
        with torch.no_grad():
            for flag in (True, False) * 2:  # warm-up, both
                for _ in range(20):
                    flashqla.chunk_gated_delta_rule(**d, cu_seqlens=cu, cu_seqlens_cpu=cpu, check_offsets=flag)
            torch.cuda.synchronize()
            for _ in range(5):
                for flag in (True, False):
                    t = time.perf_counter()
                    for _ in range(a.calls // 5):
                        flashqla.chunk_gated_delta_rule(**d, cu_seqlens=cu, cu_seqlens_cpu=cpu, check_offsets=flag)
                    torch.cuda.synchronize()
                    res[flag].append((time.perf_counter() - t) * 1e3 / (a.calls // 5))
        on, off = statistics.median(res[True]), statistics.median(res[False])
        print(f"{H:>3}/{HV:<3} {'+'.join(map(str, lengths)) if len(lengths) < 3 else f'{lengths[0]}x{len(lengths)}':>14} "
              f"{on:>9.4f} {off:>9.4f} {1e3 * (on - off):>8.1f}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

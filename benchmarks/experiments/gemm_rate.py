"""The GPU's bf16 dense GEMM rate through torch (cuBLAS), the denominator of the pages' "% of GEMM
rate" column (`flashqla.bench.grid.PEAK_TFLOPS_BY_GPU`).

    python benchmarks/experiments/gemm_rate.py

C = A @ B in bf16 (fp32 accumulation), square shapes and one long-K shape, CUDA-graph replays
(`flashqla.bench.timing.time_cuda_graph`, median), two rounds. Prints a table: ms and TFLOP/s (2 M N K
/ time); the 8192^3 row is the rate the pages use (as on the H200, 726 TFLOP/s).
"""
from __future__ import annotations

import torch

from flashqla.bench.timing import time_cuda_graph

SHAPES = [(4096, 4096, 4096), (8192, 8192, 8192), (16384, 16384, 8192), (8192, 8192, 32768)]


def main():
    name = torch.cuda.get_device_name()
    print(f"{name}, torch {torch.__version__}")
    print("| M x N x K | round | ms | TFLOP/s |\n| --- | ---: | ---: | ---: |")
    for rnd in (1, 2):
        for M, N, K in SHAPES:
            a = torch.randn(M, K, device="cuda", dtype=torch.bfloat16)
            b = torch.randn(K, N, device="cuda", dtype=torch.bfloat16)
            c = torch.empty(M, N, device="cuda", dtype=torch.bfloat16)
            t = time_cuda_graph(lambda: torch.matmul(a, b, out=c))
            ms = t.ms
            print(f"| {M} x {N} x {K} | {rnd} | {ms:.3f} | {2 * M * N * K / ms / 1e9:.0f} |", flush=True)


if __name__ == "__main__":
    main()

"""Where does backward pass 2 (`chunk_bwd.chunk_fused_bwd`, the shipped kernel) spend its time? An
Nsight Compute driver: runs pass 2 on one benchmark row, warm-up outside the profiled range, then
`--calls` calls inside `cudaProfilerStart/Stop`, so that ncu collects only the profiled pass-2
kernels.

Run on the GPU machine (`source .device/on-device.sh` first), under ncu:

    ncu --clock-control none --profile-from-start off -k regex:gdn_chunk_bwd \\
        --section WarpStateStats --section SourceCounters -o rep \\
        python benchmarks/experiments/ncu_bwd.py --row "16/32 8192x4" [--calls N] [--packed] [--no-dh0]

then `ncu -i rep.ncu-rep --page source --csv --print-source sass > rep.csv` gives the warp-stall
samples per SASS instruction, which `benchmarks/experiments/sass_stalls.py rep.csv` sums by
instruction class and code region.

ROW: "h_qk/h_v MIX" in the benchmark's notation (`ncu_fwd.parse_row`); inputs of `_gpu.gen_inputs`
(valid domain, initial state; packed when the lengths differ or with --packed, else batched), do and
dht from a generator seeded 7, h from pass 1 (`states_bwd.chunk_states_bwd`, bf16). Pass 2 is the
build for a call that returns dh0 (`chunk_bwd.DH0_OPTS`), or without it with --no-dh0.

Writes no file itself (ncu writes the report named by its -o); prints the row and the profiled calls'
wall time.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(os.path.dirname(HERE))
sys.path[:0] = [ROOT, HERE]

from _gpu import gen_inputs  # noqa: E402
from ncu_fwd import parse_row, profiled  # noqa: E402


def row_inputs(H, HV, lengths, packed):
    """A row's inputs (`_gpu.gen_inputs`), its do and dht (seed 7) and one forward: (x, do, dht, f)."""
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    x = gen_inputs(H, HV, lengths, packed)
    gen = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(x["v"].shape, device="cuda", generator=gen).to(x["v"].dtype)
    N = len(lengths) if packed else x["v"].shape[0]
    dht = torch.randn(N, HV, 128, 128, device="cuda", generator=gen)
    return x, do, dht, chunk_gated_delta_rule_fwd(**x, output_final_state=True, cp="off")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", required=True)
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--packed", action="store_true", help="cu_seqlens even when every length is equal")
    ap.add_argument("--no-dh0", action="store_true", help="the pass-2 build of a call that returns no dh0")
    a = ap.parse_args(argv)
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_fused_bwd
    from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd

    H, HV, lengths = parse_row(a.row)
    packed = a.packed or len(set(lengths)) > 1
    x, do, dht, f = row_inputs(H, HV, lengths, packed)
    h = chunk_states_bwd(f.k, x["v"], f.A, f.g_cum_log2, x["initial_state"], x["cu_seqlens"])
    scale = 128**-0.5

    def call():
        return chunk_fused_bwd(f.q, f.k, x["v"], x["beta"], f.A, f.g_cum_log2, h, do, dht, scale, x["cu_seqlens"],
                               dh0=not a.no_dh0)

    ms = profiled(call, a.calls)
    print(f"{a.row} pass 2{' (no dh0)' if a.no_dh0 else ''}: {a.calls} call(s), {ms:.3f} ms wall (profiled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

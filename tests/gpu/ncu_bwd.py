"""Nsight Compute driver for backward pass 2: runs `chunk_fused_bwd` of one pass-2 variant on one
benchmark row, warm-up outside the profiled range, then `--calls` calls inside
`cudaProfilerStart/Stop`, so that

    ncu --clock-control none --profile-from-start off -k regex:gdn_chunk_bwd \\
        --section WarpStateStats --section SourceCounters -o rep \\
        python tests/gpu/ncu_bwd.py --row "16/32 4x8192" --variant v2

collects only the profiled pass-2 kernels; `ncu -i rep.ncu-rep --page source --csv --print-source sass`
then gives the warp-stall samples per SASS instruction (`tests/gpu/sass_stalls.py` sums them by
instruction class and code region). Not collected by pytest.

    python tests/gpu/ncu_bwd.py --row ROW [--variant v1|v2] [--calls N]

ROW: "h_qk/h_v MIX" in the benchmark's notation (`ncu_fwd.parse_row`); inputs of
`device_check.gen_inputs` (valid domain, initial state; packed when the lengths differ or with
--packed, else batched), h from pass 1 in bf16.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.ncu_fwd import parse_row, profiled  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", required=True)
    ap.add_argument("--variant", default="v2")
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--packed", action="store_true", help="cu_seqlens even when every length is equal")
    a = ap.parse_args(argv)
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_fused_bwd
    from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd
    from tests.gpu.bwd_v2_check import row_inputs

    H, HV, lengths = parse_row(a.row)
    packed = a.packed or len(set(lengths)) > 1
    x, do, dht, f = row_inputs(H, HV, lengths, packed)
    h = chunk_states_bwd(f.k, x["v"], f.A, f.g_cum_log2, x["initial_state"], x["cu_seqlens"], torch.bfloat16)
    scale = 128**-0.5

    def call():
        return chunk_fused_bwd(f.q, f.k, x["v"], x["beta"], f.A, f.g_cum_log2, h, do, dht, scale, x["cu_seqlens"],
                               variant=a.variant)

    ms = profiled(call, a.calls)
    print(f"{a.row} pass 2 {a.variant}: {a.calls} call(s), {ms:.3f} ms wall (profiled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

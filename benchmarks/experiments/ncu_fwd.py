"""Where does the forward's time go inside its kernels? An Nsight Compute driver: runs the forward on
one benchmark row, warm-up outside the profiled range, then `--calls` forward calls inside
`cudaProfilerStart/Stop`, so that ncu collects only the profiled calls' kernels (prepare, recurrent,
and the split path's kernels with `--cp auto` or `on`).

Run on the GPU machine (`source .device/on-device.sh` first), under ncu:

    ncu --profile-from-start off -k regex:gdn_ --section ... -o rep \
        python benchmarks/experiments/ncu_fwd.py --row "16/64 8192x4" [--cp off|auto|on] [--calls N] [--inference]

ROW: "h_qk/h_v MIX" in the benchmark's notation (`flashqla.bench.grid.parse_mix`: 8192x4 is four
sequences of 8192 tokens, 1x32768 one sequence, 28672+4096 two; packed, B = 1, int32 cu_seqlens),
inputs of `_gpu.gen_inputs` (valid domain, initial state given, final state returned).

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


def parse_row(row: str):
    """"h_qk/h_v MIX" in the benchmark's notation (`flashqla.bench.grid.parse_mix`: 8192x4 is four
    sequences of 8192 tokens, 1x32768 one sequence, 28672+4096 two)."""
    from flashqla.bench.grid import parse_heads, parse_mix

    heads, mix = row.split()
    h = parse_heads(heads)
    return h.h_qk, h.h_v, list(parse_mix(mix).lengths)


def profiled(call, calls: int, warmup: int = 3) -> float:
    """Runs `call` `warmup` times outside the profiled range, then `calls` times inside
    `cudaProfilerStart/Stop` (what `ncu --profile-from-start off` collects); returns the profiled
    calls' wall time in ms (CUDA events)."""
    for _ in range(warmup):
        call()
    torch.cuda.synchronize()
    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    torch.cuda.cudart().cudaProfilerStart()
    start.record()
    for _ in range(calls):
        call()
    end.record()
    torch.cuda.synchronize()
    torch.cuda.cudart().cudaProfilerStop()
    return start.elapsed_time(end)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", required=True)
    ap.add_argument("--cp", default="off", choices=("off", "auto", "on"))
    ap.add_argument("--calls", type=int, default=1)
    ap.add_argument("--inference", action="store_true", help="for_backward=False (the public op without gradients)")
    ap.add_argument("--impl", default="ours", choices=("ours", "flashinfer"),
                    help="flashinfer: `flashinfer.gdn_prefill.chunk_gated_delta_rule` on the same inputs in its "
                         "layout (use_cp from --cp: off -> False, on -> True, auto -> \"auto\"); ncu -k regex:. then")
    a = ap.parse_args(argv)
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    H, HV, lengths = parse_row(a.row)
    x = gen_inputs(H, HV, lengths, varlen=True)

    longest = -(-max(lengths) // 64) * 64

    def call():
        return chunk_gated_delta_rule_fwd(**x, output_final_state=True, cp=a.cp, for_backward=not a.inference,
                                          max_seqlen=longest)

    if a.impl == "flashinfer":
        import types

        from flashinfer.gdn_prefill import chunk_gated_delta_rule as fi_op

        from flashqla.bench.impls import flashinfer_inputs

        # the benchmark's mapping to FlashInfer's layout (alpha = exp(g), state [N, HV, V, K])
        fa = flashinfer_inputs(types.SimpleNamespace(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"],
                                                     h0=x["initial_state"], cu_seqlens=x["cu_seqlens"],
                                                     lengths=lengths, scale=x["q"].shape[-1] ** -0.5))
        use_cp = {"off": False, "on": True, "auto": "auto"}[a.cp]
        ht = torch.empty_like(fa["initial_state"])

        def call():  # noqa: F811
            return fi_op(fa["q"], fa["k"], fa["v"], fa["g"], fa["beta"], scale=fa["scale"],
                         initial_state=fa["initial_state"], output_final_state=True, cu_seqlens=fa["cu_seqlens"],
                         output_state=ht, use_cp=use_cp, max_seqlen=fa["max_seqlen"])

    ms = profiled(call, a.calls)
    print(f"{a.row} cp={a.cp}: {a.calls} call(s), {ms:.3f} ms wall (profiled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""One call on the GPU machine: where the split forward / backward spends its time, kernel by kernel.

    python tests/gpu/cp_profile.py [--rows "2/8 28672+4096" "2/8 1x32768"] [--bwd [--kept] | --inference] [--top 20] [--no-hint]

ROW: "h_qk/h_v MIX", MIX either "COUNTxLENGTH" (1x32768: one sequence; note the benchmark's own
notation is LENGTHxCOUNT) or "a+b+...". Per row (packed input as the benchmark makes it, cp auto, the
planner given the longest length as its max_seqlen hint as the benchmark does; --no-hint: none):
a few warm-up calls, then torch.profiler over
5 calls; prints each device kernel's total time per call, launches per call and name, the sum, and
the number of device launches per call, and the plan. --inference profiles the public op without
gradients as the forward benchmark calls it (initial state given, final state returned, the host
offsets as the hint): the inference op, which keeps A in the segments' slots. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import sys
from collections import defaultdict

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    from torch.profiler import ProfilerActivity, profile

    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
    from flashqla.testing import make_gdn_inputs
    from tests.gpu.device_check import parse_row

    ap = argparse.ArgumentParser()
    ap.add_argument("--rows", nargs="+", default=["2/8 28672+4096", "2/8 1x32768"])
    ap.add_argument("--bwd", action="store_true")
    ap.add_argument("--inference", action="store_true", help="the public op under no_grad, as the benchmark")
    ap.add_argument("--top", type=int, default=18)
    ap.add_argument("--no-hint", action="store_true", help="no max_seqlen hint for the planner")
    ap.add_argument("--kept", action="store_true",
                    help="with --bwd: our backward as the benchmark times it (the forward's kept split states, "
                         "every length given)")
    ap.add_argument("--impl", default="ours", choices=("ours", "flash_qla", "fla"),
                    help="with --bwd: whose backward to profile (peers through flashqla.bench.bwd_impls)")
    ap.add_argument("--segment-len", type=int, default=None,
                    help="with --bwd --kept: force the backward's plan to split at this L (0: unsplit), as "
                         "cp_train_plan_check --lengths does")
    a = ap.parse_args(argv)
    if a.segment_len is not None:
        from flashqla.cp import planner as P

        P.BWD_MIN_GAIN = float("inf") if a.segment_len == 0 else 0.0
        P._segment_lengths = lambda l_max, *grid, L=max(a.segment_len, 64): [L]
        P.clear_plan_cache()
    reps = 5
    for row in a.rows:
        H, HV, lengths = parse_row(row)
        T = sum(lengths)
        x = make_gdn_inputs(1, T, H, HV, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda",
                            gate="qwen3next", special_heads=True, seed=0)
        q, k, v, g, beta, cu = x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"]
        scale = 128**-0.5
        ms = None if a.no_hint else max(lengths)
        f = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, None, True, cu, max_seqlen=ms)
        do, dht = torch.randn_like(f.o), torch.randn_like(f.final_state)
        from flashqla.cp.driver import _plan

        plan, _ = _plan(q, v, cu, "auto", None, None, ms, None, False, backward=a.bwd)
        print(f"our plan {row}: split={plan.split} L={plan.segment_len} BV={plan.BV} ({plan.reason})")
        if a.inference:
            from flashqla import chunk_gated_delta_rule

            h0 = torch.randn(len(lengths), HV, 128, 128, device="cuda")
            cpu = cu.cpu()

            def fn():
                with torch.no_grad():
                    return chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                  cu_seqlens=cu, cu_seqlens_cpu=cpu)
        elif a.bwd and (a.impl != "ours" or a.kept):
            from types import SimpleNamespace

            from flashqla.bench.bwd_impls import load_bwd_impls

            impl = load_bwd_impls((a.impl,))[a.impl]
            if not impl.available:
                print(f"{a.impl}: not available ({impl.reason})")
                continue
            xs = SimpleNamespace(q=q, k=k, v=v, g=g, beta=beta, scale=scale, h0=None, cu_seqlens=cu, do=do, dht=dht,
                                 cu_seqlens_cpu=cu.cpu())
            saved = impl.fwd(xs).saved
            kept = getattr(saved, "cp_saved", None)
            print(f"kept plan {row}: L={None if kept is None else kept.segment_len}")
            fn = lambda: impl.bwd(xs, saved)  # noqa: E731
        elif a.bwd:
            fn = lambda: chunk_gated_delta_rule_bwd(f.q, f.k, v, g, beta, f.A, f.g_cum_log2, do, dht, scale, None, cu,  # noqa: E731
                                                    max_seqlen=ms)
        else:
            fn = lambda: chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, None, True, cu, max_seqlen=ms)  # noqa: E731
        for _ in range(3):
            fn()
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            for _ in range(reps):
                fn()
            torch.cuda.synchronize()
        tot, cnt = defaultdict(float), defaultdict(int)
        for ev in prof.events():
            if ev.device_type.name == "CUDA":
                name = ev.name[:90]
                tot[name] += ev.device_time if hasattr(ev, "device_time") else ev.cuda_time
                cnt[name] += 1
        total = sum(tot.values()) / reps
        print(f"\n== {row} [{a.impl}] {'backward' if a.bwd else 'inference' if a.inference else 'forward'}: {sum(cnt.values()) / reps:.0f} device launches per call, "
              f"{total / 1e3:.3f} ms of kernel time per call")
        for name, t in sorted(tot.items(), key=lambda kv: -kv[1])[: a.top]:
            print(f"  {t / reps / 1e3:8.4f} ms  x{cnt[name] / reps:5.1f}  {name}")
        from flashqla.bench.timing import time_cuda_graph

        print(f"  CUDA-graph time per call: {time_cuda_graph(fn).ms:.4f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""The unsplit forward at both value-slice widths on batches of unequal sequences, beside the
width `recurrent.pick_block_v` takes (from N * HV only, as if the walks were equally long) and the
width a lengths-aware pick would take (the greedy makespan of the CTAs in launch order,
`cp.plan._greedy_makespan`, at each width's chunk step `recurrent.ROLES_STEP_US`).

Question: does the width pick lose time on unequal mixes (16/64 28672+4096 ran faster at BV 64 on
the H100 serving page), and does the makespan model pick the faster width?

    python benchmarks/experiments/width_mix_ab.py            # GPU: o and final state bitwise across widths, times
    python benchmarks/experiments/width_mix_ab.py --model    # CPU: the model's picks only

Prints a table: ms at BV 64 and 128 (`chunk_gated_delta_rule_fwd(cp="off", block_v=...)`, inference,
CUDA graphs, median), the default call's ms with the lengths (the planner given `seqlens`, as the
public op given `cu_seqlens_cpu`: it may split; an unsplit plan runs at `cp.plan.unsplit_block_v`'s
width) and with their maximum only (`max_seqlen`: pick_block_v's width), the two picks and the model's
predicted recurrent-launch times (us).
"""
from __future__ import annotations

import sys

ROWS = ["16/64 28672+4096", "16/64 24576+8192", "16/48 28672+4096", "16/48 24576+8192", "32/32 28672+4096",
        "16/32 28672+4096", "8/32 24576+8192", "16/64 16384+16384", "16/64 8192+8192+8192+8192",
        "16/32 30000+1000+1000+700", "16/64 2048+2048+2048+26624",
        # the forward grid's rows whose unsplit width the lengths change (cp.plan.unsplit_block_v)
        "16/64 12288+4096", "16/64 6144+2048", "16/64 2048+6144", "16/64 1024+7168", "16/48 6144+2048",
        "16/48 2048+6144", "16/48 1024+7168"]


def model(HV: int, lengths: list[int], sms: int = 132) -> dict:
    """Predicted recurrent-launch time (us) per width: CTAs sequence-major, (value head, value slice)
    inside, one CTA an SM, each `ceil(len / 64)` chunk steps."""
    from flashqla.cp.plan import _greedy_makespan
    from flashqla.ops.gdn.kernels.sm90.recurrent import ROLES_STEP_US
    out = {}
    for bv in (64, 128):
        runs = [(-(-n // 64), HV * (128 // bv)) for n in lengths]
        out[bv] = _greedy_makespan(runs, sms) * ROLES_STEP_US[bv]
    return out


def main(model_only: bool):
    sys.path.insert(0, "benchmarks/experiments")
    from _gpu import parse_row

    from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v
    lines = ["| row | pick_block_v | makespan pick | model us 64 / 128 | BV 64 ms | BV 128 ms | 128 / 64 | bitwise | default ms | max-only ms |",
             "| --- | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: |"]
    for row in ROWS:
        H, HV, lens = parse_row(row)
        m = model(HV, lens)
        pick_m = 64 if m[64] < m[128] else 128
        cells = [row, str(pick_block_v(len(lens), HV)), str(pick_m), f"{m[64]:.0f} / {m[128]:.0f}"]
        if model_only:
            lines.append("| " + " | ".join(cells + ["-"] * 6) + " |")
            continue
        import torch
        from _gpu import gen_inputs, time_graph
        from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd
        x = gen_inputs(H, HV, lens, varlen=True, seed=3)
        res, ms = {}, {}
        for bv in (64, 128):
            def fn(bv=bv):
                return chunk_gated_delta_rule_fwd(**x, output_final_state=True, cp="off", block_v=bv, for_backward=False)
            f = fn()
            torch.cuda.synchronize()
            res[bv] = (f.o.clone(), f.final_state.clone())
            ms[bv] = time_graph(fn)
        same = all(torch.equal(a, b) for a, b in zip(res[64], res[128]))
        ms_default = time_graph(lambda: chunk_gated_delta_rule_fwd(**x, output_final_state=True, seqlens=tuple(lens),
                                                                   max_seqlen=max(lens), for_backward=False))
        ms_hint = time_graph(lambda: chunk_gated_delta_rule_fwd(**x, output_final_state=True, max_seqlen=max(lens),
                                                                for_backward=False))
        cells += [f"{ms[64]:.3f}", f"{ms[128]:.3f}", f"{ms[128] / ms[64]:.3f}", str(same), f"{ms_default:.3f}",
                  f"{ms_hint:.3f}"]
        lines.append("| " + " | ".join(cells) + " |")
        print(lines[-1], flush=True)
    if not model_only:
        import torch
        print(torch.cuda.get_device_name())
    print("\n".join(lines))


if __name__ == "__main__":
    main("--model" in sys.argv)

"""What a packed call without a host copy of its offsets pays for o's tail: the memset of all of o it
used to make against the tail launch (`packed_tail.zero_packed_tail`) that replaced it.

Question: a caller that passes device `cu_seqlens` only (vLLM's and SGLang's GDN prefill, through
`flashqla.integrations`) cannot tell the op that the offsets end at T, so o's rows past
cu_seqlens[-1] must be zeroed. How much did zero-filling o cost, and what does the tail launch cost
when the offsets do end at T (every CTA returns at once) and when a tail of 1/8 of the tokens exists?

    python benchmarks/experiments/packed_tail_cost.py

Prints, per row (CUDA graphs, median ms): `torch.zeros_like(v)`; the tail launch with no tail and
with a tail; the unsplit forward (`chunk_gated_delta_rule_fwd(cp="off")`, inference) given the lengths
(`seqlens`: o left uninitialised) and given `max_seqlen` only (the tail launch), o bitwise equal.
"""
from __future__ import annotations

import sys

ROWS = ["16/64 2x16384", "16/32 4x8192", "32/32 8x1024", "2/8 1x32768"]


def main():
    sys.path.insert(0, "benchmarks/experiments")
    import torch
    from _gpu import gen_inputs, parse_row, time_graph

    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90.packed_tail import zero_packed_tail

    lines = ["| row | zeros_like(v) | tail launch, no tail | tail launch, T/8 tail | fwd, lengths | fwd, max_seqlen only | same o |",
             "| --- | ---: | ---: | ---: | ---: | ---: | --- |"]
    for row in ROWS:
        H, HV, lens = parse_row(row)
        x = gen_inputs(H, HV, lens, varlen=True, seed=5)
        v, cu = x["v"], x["cu_seqlens"]
        T = v.shape[1]
        cu_tail = cu.clone()
        cu_tail[-1] = T - T // 8
        o = torch.empty_like(v)
        t_zero = time_graph(lambda: torch.zeros_like(v))
        t_none = time_graph(lambda: zero_packed_tail(o, cu))
        t_tail = time_graph(lambda: zero_packed_tail(o, cu_tail))

        def fwd(**kw):
            return chunk_gated_delta_rule_fwd(**x, output_final_state=True, cp="off", for_backward=False, **kw)
        a, b = fwd(seqlens=tuple(lens)), fwd(max_seqlen=max(lens))
        same = torch.equal(a.o, b.o) and torch.equal(a.final_state, b.final_state)
        t_len = time_graph(lambda: fwd(seqlens=tuple(lens)))
        t_max = time_graph(lambda: fwd(max_seqlen=max(lens)))
        lines.append(f"| {row} | {t_zero:.4f} | {t_none:.4f} | {t_tail:.4f} | {t_len:.3f} | {t_max:.3f} | {same} |")
        print(lines[-1], flush=True)
    print(torch.cuda.get_device_name())
    print("\n".join(lines))


if __name__ == "__main__":
    main()

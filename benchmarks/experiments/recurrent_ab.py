"""Same-process A/B of recurrent-kernel builds: o and the final state bit for bit, and their times.

Question: does a change of `flashqla/ops/gdn/kernels/sm90/recurrent.py` (and of `_common.py`) keep the
forward's outputs and make the recurrent launch faster? Each variant is a folder holding the
`recurrent.py` and `_common.py` of one commit; the variants' modules load under their own names, so
their kernels compile (or load from the TileLang cache) side by side in one process. The prepare
kernel is this checkout's, launched once per row; every variant reads the same A and g_cum_log2.

Make the folders on the CPU machine (the GPU machine's checkout has no .git):

    python benchmarks/experiments/recurrent_ab.py --extract main .device/rec-a
    python benchmarks/experiments/recurrent_ab.py --extract a-lower-blocks .device/rec-b
    python benchmarks/experiments/recurrent_ab.py --variant a=.device/rec-a --variant b=.device/rec-b --precompile-only

then on the GPU machine (carry the folders and the cache):

    python benchmarks/experiments/recurrent_ab.py --variant a=.device/rec-a --variant b=.device/rec-b

Rows: the forward grid's SM-filling and one-sequence shapes at the width the op picks
(`pick_block_v`), the same shapes at the other width where it differs, and packed batches of ragged
sequences (lengths 0, 1, 63, 64, 65 and random up to 300); inputs from `flashqla.testing.make_gdn_inputs`
(L2-normalised q and k, the real gate, a g == 0 head and a strong-decay head, an initial state).
o and the final state are preallocated and filled with 7.0 before each variant runs. Each variant is
timed twice by CUDA-graph replay (`flashqla.bench.timing.time_cuda_graph`, median), in forward then
reverse order. Prints one line per row and a table: times (us) and each variant's best over the first's.
"""

from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ab import ab_parser, ragged_lengths, variants  # noqa: E402

MODULE_FILES = ("recurrent.py", "_common.py")


def rows() -> list:
    """(heads "H/HV", sequence lengths, block_v or None for the op's pick) of the A/B."""
    r = random.Random(5)

    def ragged(n):
        return ragged_lengths(r, n)

    return [("16/32", [8192] * 4, None), ("16/64", [8192] * 4, None), ("32/32", [8192] * 4, None),
            ("16/32", [8192] * 4, 64), ("16/16", [1024] * 8, None), ("32/32", [1024] * 8, None),
            ("2/8", [8192], None), ("8/32", [8192], None), ("16/32", ragged(128), None),
            ("16/32", ragged(300), 64)]


def main() -> None:
    ap = ab_parser(__doc__, MODULE_FILES)
    args = ap.parse_args()
    mods = variants(ap, args, MODULE_FILES, ("recurrent",))
    if mods is None:
        return
    mods = {n: m for n, (m,) in mods.items()}
    import torch

    from flashqla.ops.gdn.kernels.sm90 import prepare as P
    from flashqla.testing import make_gdn_inputs

    device = "cpu" if args.precompile_only else "cuda"
    results = []
    picked = rows() if args.rows is None else [rows()[int(i)] for i in args.rows.split(",")]
    for heads, lens, bv in picked:
        H, HV = map(int, heads.split("/"))
        inp = make_gdn_inputs(1, sum(lens), H, HV, seqlens=lens, dtype=torch.bfloat16, device=device)
        q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
        cu, h0 = inp["cu_seqlens"].to(torch.int32), inp["initial_state"].float().contiguous()
        mix = f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else f"{len(lens)} ragged (T = {sum(lens)})"
        first = next(iter(mods.values()))
        BV = bv or first.pick_block_v(len(lens), HV, 128)
        label = f"{heads} {mix} BV {BV}"
        if args.precompile_only:
            for m in mods.values():
                m.build_recurrent_kernel(*m.recurrent_kernel_args(q, v, cu, BV))
            print(label, "built", flush=True)
            continue
        from flashqla.bench.timing import time_cuda_graph

        A, gc = P.chunk_prepare_fwd(k, g, beta, cu, HV)
        scale = 128 ** -0.5
        outs = {}
        for name, m in mods.items():
            o = torch.full_like(v, 7.0)
            ht = torch.full((len(lens), HV, 128, 128), 7.0, dtype=torch.float32, device=device)
            outs[name] = m.chunk_recurrent_fwd(q, k, v, A, gc, scale, h0, True, cu, block_v=BV, o=o, final_state=ht)
        torch.cuda.synchronize()
        base = outs[next(iter(mods))]
        same = all(torch.equal(a, b) for o in outs.values() for a, b in zip(base, o))
        finite = all(bool(torch.isfinite(t).all()) for o in outs.values() for t in o)
        times = {n: [] for n in mods}
        for order in (list(mods), list(reversed(mods))):
            for name in order:
                m, (o, ht) = mods[name], outs[name]
                times[name].append(time_cuda_graph(
                    lambda: m.chunk_recurrent_fwd(q, k, v, A, gc, scale, h0, True, cu, block_v=BV, o=o, final_state=ht)).ms * 1e3)
        results.append((label, same, finite, times))
        print(label, "bitwise" if same else "DIFFERENT", "finite" if finite else "NOT FINITE",
              {n: [round(x, 1) for x in t] for n, t in times.items()}, flush=True)
    if args.precompile_only:
        return
    names = list(mods)
    print(f"\n{torch.cuda.get_device_name()}")
    print("| row | bitwise | " + " | ".join(f"{n} us" for n in names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:]) + " |")
    print("| --- | --- |" + " ---: |" * (2 * len(names) - 1))
    for label, same, finite, t in results:
        cells = [" / ".join(f"{x:.1f}" for x in t[n]) for n in names]
        ratios = [f"{min(t[n]) / min(t[names[0]]):.3f}" for n in names[1:]]
        print(f"| {label} | {same}{'' if finite else ' (not finite)'} | " + " | ".join(cells) + " | " + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()

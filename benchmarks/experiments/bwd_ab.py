"""Same-process A/B of the backward's pass-1 and pass-2 builds: the gradients bit for bit, each pass's time.

Question: does a change of `flashqla/ops/gdn/kernels/sm90/states_bwd.py` (pass 1) or `chunk_bwd.py`
(pass 2), or of `_common.py`, keep the backward's outputs and make its passes faster? Each variant is a
folder holding those three files of one commit; the variants' modules load under their own names, so
their kernels compile (or load from the TileLang cache) side by side in one process. The forward is
this checkout's (`flashqla.chunk_gated_delta_rule_fwd`, cp off), run once per row; every variant reads
its A and g_cum_log2.

Make the folders on the CPU machine (the GPU machine's checkout has no .git):

    python benchmarks/experiments/bwd_ab.py --extract main .device/bwd-a
    python benchmarks/experiments/bwd_ab.py --extract BRANCH .device/bwd-b
    python benchmarks/experiments/bwd_ab.py --variant a=.device/bwd-a --variant b=.device/bwd-b --precompile-only

then on the GPU machine (carry the folders and the cache):

    python benchmarks/experiments/bwd_ab.py --variant a=.device/bwd-a --variant b=.device/bwd-b

Rows: the backward grid's shapes that fill the GPU, one-sequence rows and a ragged packed batch
(lengths 0, 1, 63, 64, 65 and random up to 300); inputs from `flashqla.testing.make_gdn_inputs`
(L2-normalised q and k, the real gate, a g == 0 head and a strong-decay head, an initial state), do and
dht ~ N(0, 1). Per variant: pass 1 (h), pass 2 (dq_hv, dk_hv, dv, dbeta, dG, dh0) on its own h; pass 2's
outputs compared bitwise with the first variant's (h where pass 1 writes it: the used slots), and each
pass timed twice by CUDA-graph replay (`flashqla.bench.timing.time_cuda_graph`, median), in forward then
reverse order. Prints one line per row and a table (us).
"""

from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ab import ab_parser, ragged_lengths, variants  # noqa: E402

MODULE_FILES = ("states_bwd.py", "chunk_bwd.py", "_common.py")


def rows() -> list:
    """(heads "H/HV", sequence lengths) of the A/B."""
    r = random.Random(5)
    ragged = ragged_lengths(r, 128)
    return [("16/32", [8192] * 4), ("16/64", [8192] * 4), ("8/16", [7212, 25556]), ("4/8", [8192] * 8),
            ("16/32", [8192]), ("2/4", [32768]), ("16/32", ragged)]


def main() -> None:
    ap = ab_parser(__doc__, MODULE_FILES)
    args = ap.parse_args()
    mods = variants(ap, args, MODULE_FILES, ("states_bwd", "chunk_bwd"))
    if mods is None:
        return
    import torch

    from flashqla.testing import make_gdn_inputs

    device = "cpu" if args.precompile_only else "cuda"
    picked = rows() if args.rows is None else [rows()[int(i)] for i in args.rows.split(",")]
    results = []
    for heads, lens in picked:
        H, HV = map(int, heads.split("/"))
        inp = make_gdn_inputs(1, sum(lens), H, HV, seqlens=lens, dtype=torch.bfloat16, device=device)
        q, k, v, g, beta = (inp[n] for n in ("q", "k", "v", "g", "beta"))
        cu, h0 = inp["cu_seqlens"].to(torch.int32), inp["initial_state"].float().contiguous()
        mix = f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else ("+".join(map(str, lens)) if len(lens) < 4
                                                                      else f"{len(lens)} ragged (T = {sum(lens)})")
        label = f"{heads} {mix}"
        if args.precompile_only:
            for sb, cb in mods.values():
                sb.build_states_kernel(*sb.states_kernel_args(k, v, cu))
                cb.build_chunk_bwd_kernel(*cb.chunk_bwd_kernel_args(q, v, beta, cu, True))
            print(label, "built", flush=True)
            continue
        from flashqla import chunk_gated_delta_rule_fwd
        from flashqla.bench.timing import time_cuda_graph
        from flashqla.ops.gdn.kernels.sm90._common import slot_index

        f = chunk_gated_delta_rule_fwd(q, k, v, g, beta, initial_state=h0, output_final_state=True, cu_seqlens=cu, cp="off")
        gen = torch.Generator(device="cuda").manual_seed(1)
        do = torch.randn(v.shape, device="cuda", generator=gen).to(v.dtype)
        dht = torch.randn(h0.shape, device="cuda", generator=gen)
        scale = 128 ** -0.5
        used = torch.tensor([slot_index(n, c, sum(lens), [0] + list(torch.tensor(lens).cumsum(0).tolist())) * HV + hv
                             for n in range(len(lens)) for c in range((lens[n] + 63) // 64) for hv in range(HV)],
                            dtype=torch.long, device="cuda")
        outs = {}
        for name, (sb, cb) in mods.items():
            h = sb.chunk_states_bwd(f.k, v, f.A, f.g_cum_log2, h0, cu)
            outs[name] = (h, cb.chunk_fused_bwd(f.q, f.k, v, beta, f.A, f.g_cum_log2, h, do, dht, scale, cu))
        torch.cuda.synchronize()
        base_h, base_o = outs[next(iter(mods))]
        same_h = all(torch.equal(h[used], base_h[used]) for h, _ in outs.values())
        same = all(torch.equal(a, b) for _, o in outs.values() for a, b in zip(base_o, o))
        finite = all(bool(torch.isfinite(t).all()) for _, o in outs.values() for t in o)
        times = {n: {"pass 1": [], "pass 2": []} for n in mods}
        for order in (list(mods), list(reversed(mods))):
            for name in order:
                sb, cb = mods[name]
                h = outs[name][0]
                times[name]["pass 1"].append(time_cuda_graph(lambda: sb.chunk_states_bwd(f.k, v, f.A, f.g_cum_log2, h0, cu)).ms * 1e3)
                times[name]["pass 2"].append(time_cuda_graph(
                    lambda: cb.chunk_fused_bwd(f.q, f.k, v, beta, f.A, f.g_cum_log2, h, do, dht, scale, cu)).ms * 1e3)
        results.append((label, same_h, same, finite, times))
        print(label, "h bitwise" if same_h else "h DIFFERENT", "gradients bitwise" if same else "gradients DIFFERENT",
              "" if finite else "NOT FINITE", {n: {p: [round(x, 1) for x in t] for p, t in d.items()} for n, d in times.items()},
              flush=True)
    if args.precompile_only:
        return
    names = list(mods)
    print(f"\n{torch.cuda.get_device_name()}")
    print("| row | h / gradients bitwise | " + " | ".join(f"{n} pass 1 / pass 2 us" for n in names) + " | "
          + " | ".join(f"{n} / {names[0]} pass 1, pass 2" for n in names[1:]) + " |")
    print("| --- | --- |" + " ---: |" * (2 * len(names) - 1))
    for label, same_h, same, finite, t in results:
        cells = [f"{min(t[n]['pass 1']):.1f} / {min(t[n]['pass 2']):.1f}" for n in names]
        ratios = [f"{min(t[n]['pass 1']) / min(t[names[0]]['pass 1']):.3f}, {min(t[n]['pass 2']) / min(t[names[0]]['pass 2']):.3f}"
                  for n in names[1:]]
        print(f"| {label} | {same_h} / {same}{'' if finite else ' (not finite)'} | " + " | ".join(cells) + " | "
              + " | ".join(ratios) + " |")


if __name__ == "__main__":
    main()

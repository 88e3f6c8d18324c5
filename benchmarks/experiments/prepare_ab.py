"""Same-process A/B of prepare-kernel builds: A and g_cum_log2 bit for bit, and their times.

Question: does a change of `flashqla/ops/gdn/kernels/sm90/prepare.py` (and of `_common.py`, whose slot
search it calls) keep the outputs and make the kernel faster? Each variant is a folder holding a
`prepare.py` and a `_common.py` (the two files of one commit); the variants' modules are loaded under
their own names, so their kernels compile (or load from the TileLang cache) side by side in one process.

Make the folders on the CPU machine (the GPU machine's checkout has no .git):

    python benchmarks/experiments/prepare_ab.py --extract HEAD~1 .device/prep-a
    python benchmarks/experiments/prepare_ab.py --extract HEAD .device/prep-b

then on the GPU machine (carry the folders; `--precompile-only` on the CPU machine fills the cache):

    python benchmarks/experiments/prepare_ab.py --variant a=.device/prep-a --variant b=.device/prep-b

Rows: the forward grid's SM-filling and one-sequence shapes, and packed batches of 126-300 ragged
sequences (lengths 0, 1, 63, 64, 65 and random up to 300) either side of the 128-offset limit of the
one-barrier slot search. Both outputs are preallocated and filled with 7.0 before each variant runs,
so slots past the end of a sequence (which the kernel does not write) compare equal too. Each variant
is timed twice by CUDA-graph replay (`flashqla.bench.timing.time_cuda_graph`, median), in forward then
reverse order. Prints one line per row and a table: times (us) and each variant's best over the first's.
"""

from __future__ import annotations

import os
import random
import sys

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from _ab import ab_parser, ragged_lengths, variants  # noqa: E402

MODULE_FILES = ("prepare.py", "_common.py")


def rows() -> list:
    """(heads "H/HV", sequence lengths) of the A/B."""
    r = random.Random(5)

    def ragged(n):
        return ragged_lengths(r, n)

    return [("16/32", [8192] * 4), ("16/64", [8192] * 4), ("32/32", [1024] * 8), ("2/8", [8192]),
            ("16/32", [1024] * 8), ("16/32", [8192]), ("8/32", [8192]), ("16/16", [1024] * 8),
            ("16/32", ragged(126)), ("16/32", ragged(127)), ("16/32", ragged(128)), ("16/32", ragged(300))]


def accuracy(k, g, beta, HV: int, lens: list, As: dict) -> dict:
    """Relative RMS error (all chunks together) of each A in `As` ([HV, slots * 64, 64], the op's slot
    layout: sequence n's chunks from slot cu[n] / 64 + n, `_common.slot_index`) against A diag(beta) in
    fp64 from `reference.gdn.fused.prepare_group` on the same inputs (packed sequences of lengths
    that are multiples of 64)."""
    import torch

    from flashqla.ops.gdn.kernels.sm90._common import slot_index
    from reference.gdn.fused import prepare_group

    _, T, H, K = k.shape
    G, S = HV // H, T // 64
    kc = k[0].double().view(S, 64, H, K).permute(0, 2, 1, 3)  # [S, H, C, K]
    gc = g[0].double().view(S, 64, H, G).permute(0, 2, 3, 1)  # [S, H, G, C]
    bc = beta[0].double().view(S, 64, H, G).permute(0, 2, 3, 1)
    ref = torch.cat([prepare_group(kc[i : i + 64], gc[i : i + 64], bc[i : i + 64])[1] for i in range(0, S, 64)])
    ref = ref.reshape(S, HV, 64, 64).permute(1, 0, 2, 3)  # [HV, S, C, C]
    out = {}
    cu = [0]
    for n in lens:
        cu.append(cu[-1] + n)
    used = torch.tensor([slot_index(n, c, T, cu) for n in range(len(lens)) for c in range(lens[n] // 64)], device=k.device)
    for name, A in As.items():
        d = A.view(HV, -1, 64, 64)[:, used].double() - ref
        out[name] = (d.square().sum() / ref.square().sum()).sqrt().item()
    return out


def main() -> None:
    ap = ab_parser(__doc__, MODULE_FILES)
    ap.add_argument("--repeat", type=int, default=0, metavar="N",
                    help="also launch each variant N more times back to back, each into buffers of its own, and count "
                         "the launches whose A or g_cum_log2 differ bitwise from the variant's first (a race check), the "
                         "most elements of A and of g_cum_log2 that differ, and how many later launches equal the second")
    ap.add_argument("--accuracy", action="store_true",
                    help="also each variant's relative RMS error of A diag(beta) against fp64 (`reference.gdn.fused."
                         "prepare_group`), on rows whose lengths are multiples of 64 (for variants whose inverse differs)")
    args = ap.parse_args()
    mods = variants(ap, args, MODULE_FILES, ("prepare",))
    if mods is None:
        return
    mods = {n: m for n, (m,) in mods.items()}
    import torch

    from flashqla.testing import make_gdn_inputs

    device = "cpu" if args.precompile_only else "cuda"
    results = []
    picked = rows() if args.rows is None else [rows()[int(i)] for i in args.rows.split(",")]
    for heads, lens in picked:
        H, HV = map(int, heads.split("/"))
        inp = make_gdn_inputs(1, sum(lens), H, HV, seqlens=lens, dtype=torch.bfloat16, device=device)
        k, g, beta, cu = inp["k"], inp["g"], inp["beta"], inp["cu_seqlens"].to(torch.int32)
        mix = f"{len(lens)}x{lens[0]}" if len(set(lens)) == 1 else f"{len(lens)} ragged (T = {sum(lens)})"
        if args.precompile_only:
            for m in mods.values():
                m.build_prepare_kernel(*m.prepare_kernel_args(k, beta, cu, HV))
            print(heads, mix, "built", flush=True)
            continue
        from flashqla.bench.timing import time_cuda_graph

        first = next(iter(mods.values()))
        S = first.num_slots(1, sum(lens), len(lens), True)
        outs = {}
        for name, m in mods.items():
            A0 = torch.full((HV, S * 64, 64), 7.0, dtype=k.dtype, device=k.device)
            g0 = torch.full((HV, S * 64), 7.0, dtype=torch.float32, device=k.device)
            outs[name] = m.chunk_prepare_fwd(k, g, beta, cu, HV, A=A0, g_cum_log2=g0)
        torch.cuda.synchronize()
        base = outs[next(iter(mods))]
        same = all(torch.equal(a, b) for o in outs.values() for a, b in zip(base, o))
        if args.repeat:
            rep = {}
            for name, m in mods.items():
                runs = []
                for _ in range(args.repeat):
                    A1 = torch.full((HV, S * 64, 64), 7.0, dtype=k.dtype, device=k.device)
                    g1 = torch.full((HV, S * 64), 7.0, dtype=torch.float32, device=k.device)
                    runs.append(m.chunk_prepare_fwd(k, g, beta, cu, HV, A=A1, g_cum_log2=g1))
                torch.cuda.synchronize()
                badA = [int((r[0] != outs[name][0]).sum()) for r in runs]
                badg = [int((r[1] != outs[name][1]).sum()) for r in runs]
                bad = [a + b for a, b in zip(badA, badg)]
                same_runs = sum(torch.equal(runs[i][0], runs[0][0]) for i in range(1, len(runs)))
                rep[name] = (sum(b > 0 for b in bad), max(bad), f"A {max(badA)} / g_cum {max(badg)} elements at most",
                             f"{same_runs} of the later runs equal the second")
                del runs
            print(heads, "repeats (launches differing from the first / most elements differing):", rep, flush=True)
        acc_row = args.accuracy and all(n % 64 == 0 for n in lens)
        if acc_row:
            err = accuracy(k, g, beta, HV, lens, {n: o[0] for n, o in outs.items()})
            print(heads, mix, "relative RMS of A diag(beta) against fp64:", {n: f"{e:.3e}" for n, e in err.items()}, flush=True)
        times = {n: [] for n in mods}
        for order in (list(mods), list(reversed(mods))):
            for name in order:
                m, (A, gc) = mods[name], outs[name]
                times[name].append(time_cuda_graph(lambda: m.chunk_prepare_fwd(k, g, beta, cu, HV, A=A, g_cum_log2=gc)).ms * 1e3)
        results.append((heads, mix, same, times, rep if args.repeat else None, err if acc_row else None))
        print(heads, mix, "bitwise" if same else "DIFFERENT", {n: [round(x, 1) for x in t] for n, t in times.items()}, flush=True)
    if args.precompile_only:
        return
    names = list(mods)
    print(f"\n{torch.cuda.get_device_name()}")
    print("| row | bitwise | " + " | ".join(f"{n} us" for n in names) + " | " + " | ".join(f"{n} / {names[0]}" for n in names[1:])
          + " | launches differing (repeats) | A vs fp64 |")
    print("| --- | --- |" + " ---: |" * (2 * len(names) - 1) + " --- | --- |")
    for heads, mix, same, t, rep, err in results:
        cells = [" / ".join(f"{x:.1f}" for x in t[n]) for n in names]
        ratios = [f"{min(t[n]) / min(t[names[0]]):.3f}" for n in names[1:]]
        reps = " / ".join(str(rep[n][0]) for n in names) if rep else "-"
        errs = " / ".join(f"{err[n]:.2e}" for n in names) if err else "-"
        print(f"| {heads} {mix} | {same} | " + " | ".join(cells) + " | " + " | ".join(ratios) + f" | {reps} | {errs} |")

if __name__ == "__main__":
    main()

"""Whether the recurrent kernel's two value-slice widths (BV = 64 and 128) give bit for bit the same
o, final states and checkpoints, on the plain unsplit forward and on the serving build (a "vk" bf16
pool, checkpoints at 1, 64, 65 and the sequence's last token; the serving call's width forced by
replacing `recurrent.pick_block_v`). batch_invariant relies on it: it takes the width picked from the
batch (N * HV), which it would otherwise have to fix.

    python benchmarks/experiments/width_bitwise.py [--precompile]   # --precompile: CPU, builds only

Prints one line per case and quantity: bitwise equal or the largest difference.
"""
from __future__ import annotations

import sys

import torch

CASES = [(2, 8, [3000, 65, 1, 2000]), (16, 32, [8192, 1000]), (16, 64, [1024] * 8), (4, 4, [9000])]


def specs():
    from flashqla.ops.gdn.kernels.sm90.registry import op_kernel_specs, serving_kernel_specs
    s = []
    for H, HV, lens in CASES:
        for bv in (64, 128):
            s += op_kernel_specs(H, HV, N=len(lens), varlen=True, backward=False, block_v=bv)
            s += serving_kernel_specs(H, HV, N=len(lens), varlen=True, block_v=bv, state_dtypes=("bfloat16",),
                                      state_layouts=("vk",), checkpoints=(True,))
    return list(dict.fromkeys(s))


def bits(x):
    return x.contiguous().view({4: torch.int32, 2: torch.int16}[x.element_size()])


def main():
    sys.path.insert(0, "benchmarks/experiments")
    from _gpu import gen_inputs

    import flashqla
    from flashqla.ops.gdn import serving as op_serving
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90 import recurrent as rec

    pick = rec.pick_block_v

    bad = 0
    for H, HV, lens in CASES:
        x = gen_inputs(H, HV, lens, varlen=True, seed=5)
        N = len(lens)
        name = f"{H}/{HV} {'+'.join(map(str, lens))}"
        res = {}
        for bv in (64, 128):
            f = chunk_gated_delta_rule_fwd(**x, output_final_state=True, cp="off", block_v=bv, for_backward=False)
            ends = torch.tensor(lens).cumsum(0)
            starts = ends - torch.tensor(lens)
            pos = sorted({int(s + p) for s, e, L in zip(starts, ends, lens) for p in (1, 64, 65, L) if 0 < p <= L})
            pos_t = torch.tensor(pos, dtype=torch.int64, device="cuda")
            pool = torch.randn(2 * N, HV, 128, 128, device="cuda", generator=torch.Generator(device="cuda").manual_seed(7)).to(torch.bfloat16)
            idx = torch.arange(N, device="cuda", dtype=torch.int32) * 2 + 1
            cks = torch.full((len(pos), HV, 128, 128), float("nan"), device="cuda", dtype=torch.bfloat16)
            rec.pick_block_v = lambda *a, bv=bv, **k: bv  # the serving call's width (it takes the picked one)
            xs = {n: t for n, t in x.items() if n != "initial_state"}
            try:
                with torch.no_grad():
                    o_s, _ = flashqla.chunk_gated_delta_rule(**xs, initial_state=pool, output_final_state=True,
                                                             state_indices=idx, state_layout="vk",
                                                             checkpoint_positions=pos_t, checkpoint_states=cks,
                                                             batch_invariant=True)
                torch.cuda.synchronize()
            finally:
                rec.pick_block_v = pick
            res[bv] = dict(o=f.o, final=f.final_state, serving_o=o_s, serving_pool=pool, serving_ckpts=cks,
                           path=op_serving.LAST_PATH["path"])
        for q in ("o", "final", "serving_o", "serving_pool", "serving_ckpts"):
            a, b = res[64][q], res[128][q]
            eq = torch.equal(bits(a), bits(b))
            bad += not eq
            d = (a.float() - b.float()).abs().max().item()
            print(f"{name:28s} {q:14s} {'bitwise equal' if eq else f'DIFFERS (max |diff| {d:.3e})'}"
                  f"  [serving path {res[64]['path']}/{res[128]['path']}]", flush=True)
    print(f"width_bitwise: {bad} quantities differ")


if __name__ == "__main__":
    if "--precompile" in sys.argv:
        from flashqla.ops.gdn.kernels.sm90.registry import precompile
        precompile(specs(), max_workers=2)
    else:
        main()

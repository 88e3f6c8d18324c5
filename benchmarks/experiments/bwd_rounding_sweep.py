"""Question (issue 45's accuracy target: every gradient <= 0.9x FLA's error): which dtype changes of
the backward's operands would get there, before any kernel is built? CPU only.

Runs the backward's rounding model (`reference.gdn.fused_bwd.fused_gated_delta_rule_bwd` with
`h_dtype`, `ds_dtype`, `operand_dtype` and the forward's A diag(beta) stored in a given dtype,
`forward_slot_products(dtype=)`), with the kernels' exact diagonal and option "l", on bf16-rounded
valid-domain inputs (`flashqla.testing.make_gdn_inputs`, B = 2, 2/4 heads with a g == 0 and a g = -30
head, an initial state, do and dht ~ N(0, 1); T = 64 and 200, 4 seeds), dq, dk and dv stored in bf16
as the kernels store them, against the fp64 backward on the same inputs. Prints each configuration's
error as a multiple of the shipped kernels' model (geometric mean over the cases), and that multiple
times the GPU-measured ours / FLA ratio of the shipped kernels (dq 0.86, dk 0.82, dv 0.99, dg 1.02,
dbeta 1.08, dh0 0.88; 20 cases on an H200, `backward.md`), as an estimate of the new ratio to FLA.

    python benchmarks/experiments/bwd_rounding_sweep.py [--seeds 4] [--do-scale 1]

--do-scale multiplies do and dht (a loss scale; every error is relative, so a dtype whose range
holds the gradients gives the same ratios at any scale): the unscaled fp16 configurations lose
precision where the gradients leave fp16's normal range; those with "a scale per tile" round each
operand tile after a power-of-two scale of its own (`reference.gdn.fused_bwd._round_tile_scaled`).

Result: benchmarks/journal/accuracy.md ("The backward's operands in fp16: a model").
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from flashqla.testing import make_gdn_inputs, rel_rms  # noqa: E402
from reference.gdn import fused_bwd as fb  # noqa: E402

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
#: ours / FLA of the shipped kernels on the GPU (geometric means over 20 cases, H200, backward.md)
FLA_RATIO = dict(dq=0.86, dk=0.82, dv=0.99, dg=1.02, dbeta=1.08, dh0=0.88)
BF, FP = torch.bfloat16, torch.float16
CONFIGS = {
    "shipped (A_beta, h, dS, operands bf16)": dict(a=BF, h=BF, ds=BF, op=BF),
    "A_beta fp16": dict(a=FP, h=BF, ds=BF, op=BF),
    "pass-2 operands fp16": dict(a=BF, h=BF, ds=BF, op=FP),
    "A_beta and pass-2 operands fp16": dict(a=FP, h=BF, ds=BF, op=FP),
    "A_beta, operands and dS fp16": dict(a=FP, h=BF, ds=FP, op=FP),
    "everything fp16 (h too)": dict(a=FP, h=FP, ds=FP, op=FP),
    "pass-2 operands fp16, a scale per tile": dict(a=BF, h=BF, ds=BF, op=FP, sc=True),
    "A_beta, operands and dS fp16, a scale per tile": dict(a=FP, h=BF, ds=FP, op=FP, sc=True),
    "fp16 (scaled) only where both operands are computed": dict(a=BF, h=BF, ds=BF, op=BF, pair=FP, sc=True),
    "the same and A_beta fp16 with its three products": dict(a=FP, h=BF, ds=BF, op=BF, pair=FP, ap=True, sc=True),
}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--seeds", type=int, default=4)
    ap.add_argument("--do-scale", type=float, default=1.0,
                    help="multiply do and dht by this (a loss scale: the gradients' magnitude; default 1)")
    a = ap.parse_args(argv)
    scale = 128 ** -0.5
    acc = {c: {n: [] for n in NAMES} for c in CONFIGS}
    for seed in range(a.seeds):
        for T in (64, 200):
            x = make_gdn_inputs(B=2, T=T, H=2, HV=4, K=128, V=128, seed=seed)
            gen = torch.Generator().manual_seed(100 + seed)
            x["do"] = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
            x["dht"] = torch.randn(2, 4, 128, 128, generator=gen, dtype=torch.float64) * a.do_scale
            x["do"] = x["do"] * a.do_scale
            xr = dict(x)
            for n in ("q", "k", "v", "do"):
                xr[n] = x[n].to(BF).double()
            ab64, g64 = fb.forward_slot_products(xr["k"], xr["g"], xr["beta"], 4)
            exact = fb.fused_gated_delta_rule_bwd(xr["q"], xr["k"], xr["v"], xr["beta"], ab64, g64, scale,
                                                  xr["initial_state"], xr["do"], xr["dht"])
            f32 = {n: (t.float() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in xr.items()}
            for c, d in CONFIGS.items():
                ab, g2 = fb.forward_slot_products(f32["k"], f32["g"], f32["beta"], 4, dtype=d["a"])
                m = fb.fused_gated_delta_rule_bwd(f32["q"], f32["k"], f32["v"], f32["beta"], ab.float(), g2, scale,
                                                  f32["initial_state"], f32["do"], f32["dht"], h_dtype=d["h"],
                                                  ds_dtype=d["ds"], operand_dtype=d["op"], exact_diagonal=True,
                                                  dog_pair=True, operand_scale=d.get("sc", False),
                                                  pair_dtype=d.get("pair"), a_beta_pairs=d.get("ap", False))
                for n, got, ref in zip(NAMES, m, exact):
                    if n in ("dq", "dk", "dv"):  # stored in the input dtype
                        got = got.to(BF)
                    acc[c][n].append(rel_rms(got, ref))
    gm = lambda xs: math.exp(sum(map(math.log, xs)) / len(xs))  # noqa: E731
    base = acc[next(iter(CONFIGS))]
    print("| configuration | " + " | ".join(NAMES) + " |")
    print("| --- |" + " ---: |" * len(NAMES))
    for c in CONFIGS:
        r = {n: gm([u / w for u, w in zip(acc[c][n], base[n])]) for n in NAMES}
        print(f"| {c}: x shipped | " + " | ".join(f"{r[n]:.2f}" for n in NAMES) + " |")
        print(f"| {c}: estimated / FLA | " + " | ".join(f"{r[n] * FLA_RATIO[n]:.2f}" for n in NAMES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Question: which of the forward's roundings make o's and the final state's error, and what would
fp16 or tf32 operands buy (issue 42's accuracy target: o and final state <= 0.8x FLA's error)? CPU only.

Runs `reference.gdn.numerics.forward_rounding_model` (the chunked forward in fp64 with a rounding at
each named point: ours A_beta, S, W, v_new, v_new_r, P, o; FLA's A, k_beta, v_beta, w, u, h, v_new,
v_new_r, P, o) on bf16-rounded valid-domain inputs (`flashqla.testing.make_gdn_inputs`: a g == 0 head
and a g = -30 head among 2/4 heads, B = 2, an initial state), against the fp64 token recurrence on the
same inputs, and prints the geometric mean over the seeds of each configuration's error and its
ratio to FLA's structure in bf16, per value head too.

    python benchmarks/experiments/fwd_rounding_sweep.py [--T 1024] [--seeds 4]

Result: benchmarks/journal/accuracy.md ("Where the forward's error comes from").
"""

from __future__ import annotations

import argparse
import math
import os
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__)))))

from flashqla.testing import make_gdn_inputs  # noqa: E402
from reference.gdn import numerics as nm  # noqa: E402


def configs() -> dict:
    bf, fp = torch.bfloat16, torch.float16
    ours = lambda **kw: ("ours", {**nm.kernel_roundings("ours"), **kw})  # noqa: E731
    points = nm.FWD_ROUNDING_POINTS["ours"][:-1]
    cfg = {"FLA (all bf16)": ("fla", nm.kernel_roundings("fla")), "ours (all bf16)": ours(),
           "o only (the floor)": ("ours", {"o": bf})}
    cfg.update({f"{p} exact": ours(**{p: None}) for p in points})
    cfg.update({f"{p} fp16": ours(**{p: fp}) for p in points})
    cfg["A_beta, W fp16"] = ours(A_beta=fp, W=fp)
    cfg["A_beta, W tf32"] = ours(A_beta="tf32", W="tf32")
    cfg["A_beta, W, v_new, P fp16"] = ours(A_beta=fp, W=fp, v_new=fp, P=fp)
    cfg["A_beta, W, v_new, P tf32"] = ours(A_beta="tf32", W="tf32", v_new="tf32", P="tf32")
    cfg["S, v_new_r fp16"] = ours(S=fp, v_new_r=fp)
    cfg["all fp16 but o"] = ("ours", {**nm.kernel_roundings("ours", fp), "o": bf})
    return cfg


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--T", type=int, default=1024)
    ap.add_argument("--seeds", type=int, default=4)
    a = ap.parse_args(argv)
    cfg = configs()
    acc: dict = {}
    for seed in range(a.seeds):
        x = make_gdn_inputs(B=2, T=a.T, H=2, HV=4, seed=seed)
        for r in nm.forward_rounding_errors(x, cfg):
            acc.setdefault(r["config"], []).append(r)
    gm = lambda xs: math.exp(sum(math.log(v) for v in xs) / len(xs))  # noqa: E731
    base = acc["FLA (all bf16)"]
    print(f"# T = {a.T}, B = 2, 2/4 heads (value head 0: g == 0, head 3: g = -30), {a.seeds} seeds; "
          "geometric means; ratios to FLA's structure in bf16")
    print("| configuration | o | o / FLA | final state | final / FLA | o / FLA per value head (0 1 2 3) |")
    print("| --- | ---: | ---: | ---: | ---: | --- |")
    for name, rows in acc.items():
        ratio = lambda key: gm([r[key] / b[key] for r, b in zip(rows, base)])  # noqa: E731
        heads = [gm([r["o_head"][h] / b["o_head"][h] for r, b in zip(rows, base)]) for h in range(4)]
        print(f"| {name} | {gm([r['o'] for r in rows]):.2e} | {ratio('o'):.2f} | "
              f"{gm([r['final_state'] for r in rows]):.2e} | {ratio('final_state'):.2f} | "
              + " ".join(f"{v:.2f}" for v in heads) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

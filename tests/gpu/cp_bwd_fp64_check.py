"""One call on the GPU machine: the split backward at given segment lengths against fp64, per gradient.

    python tests/gpu/cp_bwd_fp64_check.py [--row "8/16 1x8192"] [--lengths 1024 2048]

The backward benchmark's inputs (`flashqla.testing.make_gdn_inputs`, Qwen3-Next gates with the g == 0
and g = -30 heads, dht given); the unsplit backward (cp="off") and the split one at each L, each
gradient's relative RMS error against `flashqla.bench.trusted.chunk_gdn_fp64_grads`. Prints one
line per configuration. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def main(argv=None) -> int:
    from flashqla.bench.trusted import chunk_gdn_fp64_grads
    from flashqla.cp.driver import chunk_gated_delta_rule_cp_bwd
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
    from flashqla.testing import make_gdn_inputs
    from tests.gpu.device_check import parse_row

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--row", default="8/16 1x8192")
    ap.add_argument("--lengths", nargs="+", type=int, default=[1024, 2048])
    a = ap.parse_args(argv)
    H, HV, lengths = parse_row(a.row)
    T = sum(lengths)
    x = make_gdn_inputs(1, T, H, HV, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda",
                        gate="qwen3next", special_heads=True, seed=0)
    q, k, v, g, beta, cu = x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"]
    scale = 128**-0.5
    f = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, None, True, cu, max_seqlen=max(lengths))
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(f.o.shape, device="cuda", generator=gen).to(f.o.dtype)
    dht = torch.randn(f.final_state.shape, device="cuda", generator=gen)
    ref = chunk_gdn_fp64_grads(q, k, v, g, beta, do, dht, scale, None, cu)
    names = ("dq", "dk", "dv", "dg", "dbeta")
    base = (f.q, f.k, v, g, beta, f.A, f.g_cum_log2, do, dht, scale, None, cu)
    runs = [("unsplit", lambda: chunk_gated_delta_rule_bwd(*base, cp="off"))]
    runs += [(f"L={L}", lambda L=L: chunk_gated_delta_rule_cp_bwd(*base, cp="on", segment_len=L)) for L in a.lengths]
    for name, fn in runs:
        out = fn()[:5]
        errs = []
        for n, o in zip(names, out):
            r = ref[n].double()
            errs.append(f"{n} {float((o.double() - r).norm() / r.norm()):.2e}")
        print(f"{a.row} {name:8s} " + "  ".join(errs), flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

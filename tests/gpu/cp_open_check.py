"""One call on the GPU machine: the open-sequence CP forward and backward (`flashqla.cp.driver.
cp_forward_open` / `cp_backward_open`, what `flashqla.distributed` runs on each rank) on the sm_90
kernels with the one-launch scans and token kernels, against the same calls with the torch paths
(FLASHQLA_CP_SCAN=torch), and both against fp64 (`reference.gdn.cp.ReferenceCPBackend`).

    python tests/gpu/cp_open_check.py

Cases: one packed sequence continued from elsewhere (open) of 4096 tokens at 2/8 heads, a varlen row
whose first sequence is open, and the same row not open. A case passes when every output (o, final
state, dq, dk, dv, dg, dbeta, dh0) of the kernel path is finite, within 2e-2 of fp64 and no more than
1.25 x the torch path's error + 1e-3. Exit status 1 otherwise. Not collected by pytest.
"""

from __future__ import annotations

import os
import sys
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

NAMES = ("o", "final", "dq", "dk", "dv", "dg", "dbeta", "dh0")


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-30))


def _run(be, d, L, open_first, env):
    from flashqla.cp.driver import cp_backward_open, cp_forward_open
    from flashqla.cp.planner import build_segment_tables

    if env:
        os.environ["FLASHQLA_CP_SCAN"] = env
    try:
        T = d["q"].shape[1]
        tab = build_segment_tables(d["cu_seqlens"], L, T=T)
        sd = be.state_dtype
        conv = lambda x: x.to(sd) if x is not None else None  # noqa: E731
        o, final, saved = cp_forward_open(be, d["q"], d["k"], d["v"], d["g"], d["beta"], 128**-0.5, conv(d["h0"]), tab,
                                          block_v=None, exchange=lambda P, E: conv(d["S_in"]) if open_first else None,
                                          open_first=open_first)
        grads = cp_backward_open(be, d["q"], d["k"], d["v"], d["g"], d["beta"], d["do"], conv(d["dht"]), 128**-0.5,
                                 saved, tab, block_v=None, exchange=lambda D: conv(d["X"]))
    finally:
        os.environ.pop("FLASHQLA_CP_SCAN", None)
    return (o, final) + tuple(grads)


def main() -> int:
    from flashqla.cp.driver import Sm90Backend
    from flashqla.testing import make_gdn_inputs
    from reference.gdn.cp import ReferenceCPBackend

    ok, rows = True, []
    for name, seqlens, L, open_first in (("one open sequence 4096", [4096], 512, True),
                                         ("varlen open 2500,0,100,1500", [2500, 0, 100, 1500], 512, True),
                                         ("varlen not open 2500,0,100,1500", [2500, 0, 100, 1500], 512, False)):
        try:
            T, N, HV = sum(seqlens), len(seqlens), 8
            x = make_gdn_inputs(1, T, 2, HV, 128, 128, seqlens=seqlens, dtype=torch.bfloat16, device="cuda",
                                gate="qwen3next", special_heads=True, initial_state=True, seed=3)
            gen = torch.Generator().manual_seed(4)
            extra = dict(do=torch.randn(1, T, HV, 128, generator=gen), dht=torch.randn(N, HV, 128, 128, generator=gen),
                         S_in=torch.randn(HV, 128, 128, generator=gen), X=torch.randn(HV, 128, 128, generator=gen))
            d = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], cu_seqlens=x["cu_seqlens"],
                     h0=x["initial_state"], do=extra["do"].to("cuda", torch.bfloat16),
                     dht=extra["dht"].cuda(), S_in=extra["S_in"].cuda(), X=extra["X"].cuda())
            d64 = {n: (t.double().cpu() if t.is_floating_point() else t.cpu()) for n, t in d.items()}  # reference: CPU
            ref = _run(ReferenceCPBackend(), d64, L, open_first, None)
            ker = _run(Sm90Backend(), d, L, open_first, None)
            tor = _run(Sm90Backend(), d, L, open_first, "torch")
            cells = []
            for n, k_, t_, r_ in zip(NAMES, ker, tor, ref):
                if r_ is None:
                    continue
                ek, et = _rel(k_.cpu(), r_), _rel(t_.cpu(), r_)
                good = bool(torch.isfinite(k_.float()).all()) and ek <= 2e-2 and ek <= 1.25 * et + 1e-3
                ok &= good
                cells.append(f"{n} {ek:.1e}/{et:.1e}" + ("" if good else " FAIL"))
            rows.append((name, "  ".join(cells)))
        except Exception:
            ok = False
            rows.append((name, "ERROR " + traceback.format_exc(limit=4)))
        print(rows[-1], flush=True)
    print("\nopen-sequence CP on the kernels: error vs fp64, kernels / torch paths")
    for r in rows:
        print("  ", r[0], "|", r[1])
    print("all passed" if ok else "FAILED")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

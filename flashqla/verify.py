"""`flashqla verify`: the main job. Walks the ladder derivations -> reference -> kernels.

1. derivations: every SymPy record proved (`derivations.run_all`), as a table.
2. reference: the chunked reference (FLA's steps, hand-written backward) against the fp64 token
   recurrence (autograd for the gradients), per quantity, on a few valid-domain cases.
3. kernels: the sm_90 TileLang op (forward and, through autograd, backward) against the fp64
   recurrence, per quantity, within the budgets of `flashqla.testing.BUDGETS`; on a machine without a
   Hopper GPU this rung says so and is skipped.

This command is the one place where the production package calls the other two faces of the
project (`reference`, `derivations`); the ops themselves never import them.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from flashqla.faces import face
from flashqla.testing import BUDGETS, make_gdn_inputs, rel_rms

QUANTITIES_FWD = ("o", "ht")
QUANTITIES_BWD = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


@dataclass
class Case:
    """One numeric check: sizes, sequence mix and gate kind."""

    name: str
    T: int
    H: int
    HV: int
    K: int
    V: int
    lengths: tuple[int, ...] | None = None
    gate: str | float = "qwen3next"


CASES = {
    "small": [
        Case("T=65 GVA2 K=V=32", 65, 2, 4, 32, 32),
        Case("varlen 7+0+130 K=V=16", 137, 1, 3, 16, 16, lengths=(7, 0, 130)),
        Case("T=200 g=-1", 200, 2, 2, 16, 8, gate=-1.0),
    ],
    "medium": [
        Case("T=1000 GVA4 K=V=128", 1000, 1, 4, 128, 128),
        Case("varlen 63+64+65+300 K=V=64", 492, 2, 4, 64, 64, lengths=(63, 64, 65, 300)),
    ],
}


def _fmt_err(e: float) -> str:
    return f"{e:.1e}"


def _print_rows(title: str, header: tuple[str, ...], rows: list[tuple]) -> None:
    print(f"\n== {title}")
    cols = list(zip(header, *rows)) if rows else [(h,) for h in header]
    widths = [max(len(str(c)) for c in col) for col in cols]
    print("  ".join(str(h).ljust(w) for h, w in zip(header, widths)))
    for r in rows:
        print("  ".join(str(c).ljust(w) for c, w in zip(r, widths)))


def _derivations_rung() -> bool:
    try:
        derivations = face("derivations")
    except ImportError as exc:  # pragma: no cover - the package is installed with flashqla
        print(f"\n== derivations: not importable ({exc})")
        return False
    if not hasattr(derivations, "run_all"):
        print("\n== derivations: no records registered yet")
        return True
    t0 = time.perf_counter()
    rows = derivations.run_all()
    print("\n== derivations (SymPy proofs)")
    print(derivations.format_table(rows))
    ok = all(r.ok for r in rows)
    n_all = sum(getattr(r, "holds_for", "") == "all sizes" for r in rows)
    print(f"{sum(r.ok for r in rows)}/{len(rows)} proved ({n_all} for all sizes) in {time.perf_counter() - t0:.1f} s")
    return ok


def _grads(fn, x: dict, do: torch.Tensor, dht: torch.Tensor) -> dict:
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta", "initial_state")}
    o, ht = fn(**leaves, cu_seqlens=x["cu_seqlens"], output_final_state=True)
    torch.autograd.backward([o, ht], [do, dht])
    out = {"o": o.detach(), "ht": ht.detach()}
    for n, d in (("q", "dq"), ("k", "dk"), ("v", "dv"), ("g", "dg"), ("beta", "dbeta"), ("initial_state", "dh0")):
        out[d] = leaves[n].grad
    return out


def _reference_rung(size: str) -> bool:
    reference = face("reference")

    rows, ok = [], True
    for c in CASES[size]:
        x = make_gdn_inputs(1, c.T, c.H, c.HV, c.K, c.V, cu_seqlens=list(c.lengths) if c.lengths else None, gate=c.gate)
        gen = torch.Generator().manual_seed(1)
        do = torch.randn(1, c.T, c.HV, c.V, generator=gen, dtype=torch.float64)
        dht = torch.randn(x["initial_state"].shape, generator=gen, dtype=torch.float64)
        t0 = time.perf_counter()
        truth = _grads(reference.recurrent_gated_delta_rule, x, do, dht)
        t_rec = time.perf_counter() - t0
        t0 = time.perf_counter()
        got = _grads(reference.chunk_gated_delta_rule, x, do, dht)
        t_chunk = time.perf_counter() - t0
        errs = {q: rel_rms(got[q], truth[q]) for q in QUANTITIES_FWD + QUANTITIES_BWD}
        budget = BUDGETS["reference_fp64"]
        passed = all(errs[q] <= budget[q] for q in errs)
        ok &= passed
        rows.append(
            (c.name, *(_fmt_err(errs[q]) for q in errs), f"{t_chunk:.2f}/{t_rec:.2f}", "ok" if passed else "FAIL")
        )
    header = ("case (fp64, CPU)", *QUANTITIES_FWD, *QUANTITIES_BWD, "s chunk/rec", "status")
    _print_rows("reference: chunked (FLA steps, hand-written backward) vs token recurrence (autograd)", header, rows)
    b = BUDGETS["reference_fp64"]
    print(f"budgets: forward <= {b['o']:.0e}, gradients <= {b['dq']:.0e} relative RMS")
    return ok


def _kernel_rung(size: str) -> bool | None:
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("\n== kernels: skipped: kernel checks need a CUDA GPU of compute capability 9.0 (Hopper); none found")
        return None
    try:
        from flashqla import chunk_gated_delta_rule
    except ImportError as exc:
        print(f"\n== kernels: the sm_90 op is not available in this build ({exc})")
        return None
    return kernel_checks(size, chunk_gated_delta_rule, "cuda")


def kernel_checks(size: str, op, device, low: torch.dtype = torch.bfloat16) -> bool:
    """The kernel rung's table: `op` (FLA's signature, autograd) on `low`-precision q, k, v and fp32
    g, beta, states on `device`, against the fp64 token recurrence (autograd for the gradients), per
    quantity o, ht, dq, dk, dv, dg, dbeta, dh0, within `BUDGETS["sm90_fwd_bf16"]` and
    `BUDGETS["sm90_bwd_bf16"]`. Cases: `CASES[size]` at K = V = 128 (the fast path). Device-generic
    so that its logic can be exercised off the GPU with another op standing in."""
    reference = face("reference")

    budget = {**BUDGETS["sm90_fwd_bf16"], **BUDGETS["sm90_bwd_bf16"]}
    rows, ok = [], True
    for c in CASES[size]:
        if c.K != 128 or c.V != 128:
            c = Case(c.name.split(" K=")[0] + " K=V=128", c.T, c.H, c.HV, 128, 128, c.lengths, c.gate)
        x = make_gdn_inputs(1, c.T, c.H, c.HV, 128, 128, cu_seqlens=list(c.lengths) if c.lengths else None, gate=c.gate)
        gen = torch.Generator().manual_seed(1)
        do = torch.randn(1, c.T, c.HV, 128, generator=gen, dtype=torch.float64)
        dht = torch.randn(x["initial_state"].shape, generator=gen, dtype=torch.float64)
        truth = _grads(reference.recurrent_gated_delta_rule, x, do, dht)
        xd = {n: (t.to(device) if t is not None else None) for n, t in x.items()}
        for n in ("q", "k", "v"):
            xd[n] = xd[n].to(low)
        for n in ("g", "beta", "initial_state"):
            xd[n] = xd[n].float()
        got = _grads(op, xd, do.to(device, low), dht.to(device, torch.float32))
        errs = {q: rel_rms(got[q], truth[q]) for q in QUANTITIES_FWD + QUANTITIES_BWD}
        passed = all(errs[q] <= budget[q] for q in errs)
        ok &= passed
        rows.append((c.name, *(_fmt_err(errs[q]) for q in errs), "ok" if passed else "FAIL"))
    _print_rows("kernels: sm_90 bf16 op vs fp64 recurrence (forward and autograd)",
                ("case", *QUANTITIES_FWD, *QUANTITIES_BWD, "status"), rows)
    print(f"budgets: o, ht <= {budget['o']:.0e}; gradients <= {budget['dq']:.0e} (dg {budget['dg']:.0e}) relative RMS")
    return ok


def verify(size: str = "small", derivations: bool = True) -> int:
    """Runs the ladder and prints the report. Returns the process exit status (0: all passed)."""
    t0 = time.perf_counter()
    results = {}
    if derivations:
        results["derivations"] = _derivations_rung()
    results["reference"] = _reference_rung(size)
    results["kernels"] = _kernel_rung(size)
    summary = ", ".join(f"{k}: {'pass' if v else 'skipped' if v is None else 'FAIL'}" for k, v in results.items())
    print(f"\nflashqla verify ({size}): {summary}  [{time.perf_counter() - t0:.1f} s]")
    return 0 if all(v is not False for v in results.values()) else 1

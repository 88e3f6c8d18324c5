"""The correctness gate: the fp64 result of a row, the error metric, and the decision.

`fp64_result(x)` computes o and the final state of row `x`, and with `grads=True` the gradients
(dq dk dv dg dbeta dh0) of L = <o, do> + <final_state, dht>, in fp64 on the inputs' device from the
same rounded (bf16 / fp32) inputs the kernels get, by `reference.chunk_gated_delta_rule` (the
reference's chunked forward and its hand-written chunked backward, equal to the token recurrence
and to autograd through it to fp64 rounding: tests/test_bench.py and tests/test_bench_bwd.py check
both at 1e-12). Value heads are independent except for the q/k head they share, so they are
computed in batches of value heads (each batch reads its q/k heads through an index, whose gradient
autograd sums back), each batch of at most `max_token_heads` token-heads of the reference's chunk
layout (`grid.padded_tokens`). The reference's fp64 working set is about 11 KB per token-head
forward and 31 KB with gradients, so the defaults (`REF_BATCH`) bound a batch near 23 and 32 GB.

`rel_rms` is `flashqla.testing.rel_rms` (||x - ref|| / ||ref||, fp64) computed on the reference's
device, so multi-GB outputs need not travel to the host. (torch is imported by the functions that
compute, so that listing rows and rebuilding pages do not load it.)

Decision: an implementation passes when every quantity it is checked on is within its tolerance
(`GATE_TOL`) against the fp64 result; without one (the backward's pairwise gate: `--ref pairwise` or
a row above `--ref-limit`) it passes when it agrees within the same tolerances with at least one
other implementation run on the row, and is "unchecked" when it is alone. Only a passing
implementation is timed.
"""

from __future__ import annotations

import math
from itertools import combinations

from flashqla.bench.grid import padded_tokens

__all__ = ["GRAD_NAMES", "CHECKED", "GATE_TOL", "REF_BATCH", "fp64_result", "rel_rms", "errors", "decide",
           "pairwise", "format_errs", "parse_errs", "worst"]

#: Gradient names, in the order every backward of the benchmark returns them.
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
#: Quantities each benchmark's gate compares, in report order.
CHECKED = {"fwd": ("o", "ht"), "bwd": ("o", "ht") + GRAD_NAMES}
#: Relative-RMS tolerance per quantity against the fp64 result (and between two implementations):
#: FlashQLA's own test tolerance (2 %), loose enough for bf16 intermediates (kernels land near 4e-3),
#: tight enough to catch a wrong kernel (errors of order 1); dg 3 % (its error is dominated by the
#: bf16 state-gradient operand on strongly decaying heads).
GATE_TOL = {
    "fwd": {"o": 2e-2, "ht": 2e-2},
    "bwd": {"o": 2e-2, "ht": 2e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "dg": 3e-2, "dbeta": 2e-2, "dh0": 2e-2},
}
#: Default token-heads per batch of value heads of `fp64_result`: forward, with gradients.
REF_BATCH = {"fwd": 1 << 21, "bwd": 1 << 20}


def fp64_result(x, grads: bool = False, max_token_heads: int | None = None) -> dict:
    """The fp64 result of row `x` (an `inputs.RowInputs`; `x.do`, `x.dht` and `x.scale` used with
    `grads`), by the reference (see the module docstring).

    Returns {"o" [1, T, HV, V], "ht" [N, HV, K, V]} and with `grads` also "dq", "dk" [1, T, H, K],
    "dv" [1, T, HV, V], "dg", "dbeta" [1, T, HV] and "dh0" [N, HV, K, V] (None when `x.h0` is None),
    all fp64 on the inputs' device. `max_token_heads`: default `REF_BATCH` (at least one value head
    per batch)."""
    import torch

    from flashqla.faces import face

    reference = face("reference")  # the benchmark's one import of the reference

    H, HV = x.q.shape[2], x.v.shape[2]
    group = HV // H
    f64, dev = torch.float64, x.q.device
    scale = getattr(x, "scale", None)
    if max_token_heads is None:
        max_token_heads = REF_BATCH["bwd" if grads else "fwd"]
    per_batch = max(1, min(HV, int(max_token_heads) // max(1, padded_tokens(x.lengths))))
    out = {"o": torch.empty(x.v.shape, dtype=f64, device=dev), "ht": None}
    if grads:
        out |= {"dq": torch.zeros(x.q.shape, dtype=f64, device=dev), "dk": torch.zeros(x.k.shape, dtype=f64, device=dev),
                "dv": torch.empty(x.v.shape, dtype=f64, device=dev), "dg": torch.empty(x.g.shape, dtype=f64, device=dev),
                "dbeta": torch.empty(x.beta.shape, dtype=f64, device=dev),
                "dh0": None if x.h0 is None else torch.empty(x.h0.shape, dtype=f64, device=dev)}
    with torch.set_grad_enabled(grads):
        q64 = x.q.detach().to(f64).requires_grad_(grads)
        k64 = x.k.detach().to(f64).requires_grad_(grads)
        for a in range(0, HV, per_batch):
            b = min(HV, a + per_batch)
            heads = torch.arange(a, b, device=dev) // group
            leaves = {n: t[:, :, a:b].detach().to(f64).requires_grad_(grads)
                      for n, t in (("v", x.v), ("g", x.g), ("beta", x.beta))}
            if x.h0 is not None:
                leaves["h0"] = x.h0[:, a:b].detach().to(f64).requires_grad_(grads)
            o, ht = reference.chunk_gated_delta_rule(
                q64.index_select(2, heads), k64.index_select(2, heads), leaves["v"], leaves["g"], leaves["beta"],
                scale=scale, initial_state=leaves.get("h0"), output_final_state=True, cu_seqlens=x.cu_seqlens)
            if grads:
                outputs, grad_outputs = [o], [x.do[:, :, a:b].detach().to(f64)]
                if x.dht is not None:
                    outputs.append(ht)
                    grad_outputs.append(x.dht[:, a:b].detach().to(f64))
                gq, gk, gv, gg, gb, *gh = torch.autograd.grad(outputs, [q64, k64, *leaves.values()], grad_outputs,
                                                              allow_unused=True)
                for name, gr in (("dq", gq), ("dk", gk)):
                    if gr is not None:
                        out[name] += gr
                for name, gr in (("dv", gv), ("dg", gg), ("dbeta", gb)):
                    out[name][:, :, a:b] = gr if gr is not None else 0
                if x.h0 is not None:
                    out["dh0"][:, a:b] = gh[0] if gh[0] is not None else 0
            out["o"][:, :, a:b] = o.detach()
            if out["ht"] is None:
                out["ht"] = torch.empty((ht.shape[0], HV) + tuple(ht.shape[2:]), dtype=f64, device=dev)
            out["ht"][:, a:b] = ht.detach()
            del o, ht, leaves
    return out


def rel_rms(x, ref) -> float:
    """Relative RMS error `||x - ref||_2 / ||ref||_2` of two tensors, in fp64 on `ref`'s device; `inf`
    when `x` has a NaN or inf. Raises ValueError on a shape mismatch or an all-zero reference."""
    import torch

    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs reference {tuple(ref.shape)}")
    rd = ref.detach().to(torch.float64)
    den = float(torch.linalg.vector_norm(rd))
    if den == 0:
        raise ValueError("reference is identically zero: a comparison on zeros proves nothing")
    xd = x.detach().to(rd.device, torch.float64)
    if not bool(torch.isfinite(xd).all()):
        return math.inf
    return float(torch.linalg.vector_norm(xd - rd)) / den


def errors(got: dict, ref: dict, names=CHECKED["bwd"]) -> dict[str, float]:
    """Relative RMS of each quantity of `names` present (not None) in both dicts (`inf` for a
    non-finite value; a shape mismatch raises ValueError)."""
    out = {}
    for n in names:
        a, b = got.get(n), ref.get(n)
        if a is None or b is None:
            continue
        out[n] = rel_rms(a, b)
    return out


def _within(errs: dict, tol: dict) -> bool:
    return bool(errs) and all(e <= tol.get(n, max(tol.values())) for n, e in errs.items())


def decide(names, ref_errs: dict | None, pair_errs: dict, tol: dict) -> dict[str, str]:
    """Gate status of each implementation in `names`: "ok", "FAIL" or "unchecked".

    With fp64 errors (`ref_errs`: name -> {quantity: error}) each is held to `tol` on every
    quantity (nothing compared: FAIL). Without (`ref_errs` None) an implementation passes when, for
    at least one other one, every quantity of the pair (`pair_errs`: (a, b) with a before b in
    `names` -> {quantity: error}) is within `tol`; alone it is "unchecked"."""
    names = list(names)
    if ref_errs is not None:
        return {n: "ok" if _within(ref_errs.get(n, {}), tol) else "FAIL" for n in names}
    out = {}
    for n in names:
        others = [m for m in names if m != n]
        if not others:
            out[n] = "unchecked"
            continue
        agree = any(_within(pair_errs.get((n, m), pair_errs.get((m, n), {})), tol) for m in others)
        out[n] = "ok" if agree else "FAIL"
    return out


def pairwise(got: dict[str, dict], names=CHECKED["bwd"]) -> dict[tuple[str, str], dict[str, float]]:
    """Relative RMS of every pair of implementations (the second of the pair as the reference)."""
    order = list(got)
    return {(a, b): errors(got[a], got[b], names) for a, b in combinations(order, 2)}


def format_errs(errs: dict) -> str:
    """`o=3.9e-03 dq=2.9e-03 ...` in report order (empty for none)."""
    return " ".join(f"{n}={errs[n]:.1e}" for n in CHECKED["bwd"] if n in errs)


def parse_errs(text: str) -> dict[str, float]:
    """Inverse of `format_errs` (unparsable parts are skipped)."""
    out = {}
    for part in str(text or "").split():
        name, _, val = part.partition("=")
        try:
            out[name] = float(val)
        except ValueError:
            continue
    return out


def worst(errs: dict, tol: dict) -> tuple[str, float]:
    """(quantity, error) of the quantity nearest its tolerance; ('', nan) for none."""
    if not errs:
        return "", math.nan
    n = max(errs, key=lambda k: errs[k] / tol.get(k, 1.0))
    return n, errs[n]

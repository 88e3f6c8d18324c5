"""Measuring one backward row: inputs, fp64 gradients, correctness gate, timing.

Inputs: those of the forward benchmark (`runner.InputFactory`: `make_gdn_inputs`, bf16 q/k/v, fp32
g/beta, value head 0 with g = 0 and the last with g = -30, `initial_state` ~ N(0, 1) fp32), plus
the output gradients: `do` ~ N(0, 1) bf16 [1, T, HV, V] (one seeded draw per head configuration
at the largest T, a row takes its first T tokens) and `dht` ~ N(0, 1) fp32 [N, HV, K, V] (seeded
per row); scale = K ** -0.5.

Gate, before any timing: each implementation runs one forward and one backward (`run_once`);
o, final state and the six gradients (dq dk dv dg dbeta dh0) are compared by relative RMS with
the fp64 result of `trusted.chunk_gdn_fp64_grads` (autograd of the fp64 chunked forward on the
GPU, from the same rounded inputs), each within `GATE_TOL_BWD`; and every pair of implementations
is compared the same way (reported, and the gate itself when the fp64 result is not computed:
an implementation then passes when it agrees with at least one other within the same tolerances,
and is "unchecked" when it is alone). Only a passing implementation is timed: its backward alone on
the products of one forward, then its training step (forward + backward), both by
`timing.time_cuda_graph`.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass
from itertools import combinations

import torch

from flashqla.bench.grid import K_DIM, V_DIM, Row
from flashqla.bench.runner import InputFactory, RowInputs, _offsets, _recover, _short, _sync
from flashqla.bench.timing import time_cuda_graph
from flashqla.bench.trusted import GRAD_NAMES, chunk_gdn_fp64_grads, rel_rms

__all__ = [
    "GATE_TOL_BWD",
    "CHECKED",
    "BwdInputs",
    "BwdInputFactory",
    "reference_grads",
    "run_once",
    "errors",
    "decide",
    "format_errs",
    "parse_errs",
    "time_impl",
    "pairwise",
    "worst",
]

#: Relative-RMS tolerance of the gate per quantity against the fp64 result (and between two
#: implementations): FlashQLA's own test tolerance (2 %), dg 3 % (its error is dominated by the bf16
#: state-gradient operand on strongly decaying heads); bf16 kernels land near 4e-3, a wrong gradient
#: near 1.
GATE_TOL_BWD = {"o": 2e-2, "ht": 2e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "dg": 3e-2, "dbeta": 2e-2, "dh0": 2e-2}
#: Quantities the gate compares, in report order.
CHECKED = ("o", "ht") + GRAD_NAMES


@dataclass
class BwdInputs(RowInputs):
    """A forward row's inputs plus the output gradients and the scale."""

    do: torch.Tensor = None    # [1, T, HV, V] bf16
    dht: torch.Tensor = None   # [N, HV, K, V] fp32
    scale: float = K_DIM**-0.5


class BwdInputFactory:
    """Backward inputs per row (see the module docstring)."""

    def __init__(self, device, t_max: int, seed: int = 0):
        self.device, self.t_max, self.seed = device, int(t_max), int(seed)
        self.base = InputFactory(device, t_max, seed)
        self._do_key = None
        self._do = None

    def get(self, row: Row) -> BwdInputs:
        x = self.base.get(row)
        T, N, HV = row.mix.T, row.mix.N, row.heads.h_v
        if self._do_key != row.heads or self._do is None or self._do.shape[1] < T:
            self._do = None
            gen = torch.Generator(device=self.device).manual_seed(self.seed + 104_729 + HV)
            self._do = torch.randn(1, max(self.t_max, T), HV, V_DIM, generator=gen, device=self.device,
                                   dtype=torch.float32).to(torch.bfloat16)
            self._do_key = row.heads
        gen = torch.Generator(device=self.device).manual_seed(self.seed + 15_485_863 + 7919 * N + T)
        dht = torch.randn(N, HV, K_DIM, V_DIM, generator=gen, device=self.device, dtype=torch.float32)
        fields = {f: getattr(x, f) for f in ("q", "k", "v", "g", "beta", "h0", "cu_seqlens", "lengths")}
        return BwdInputs(**fields, do=self._do[:, :T].contiguous(), dht=dht, scale=K_DIM**-0.5)

    def release(self) -> None:
        self.base.release()
        self._do = None
        self._do_key = None


def reference_grads(x: BwdInputs, max_token_heads: int = 1 << 20) -> dict:
    """The fp64 o, final state and gradients of row `x` (`trusted.chunk_gdn_fp64_grads`)."""
    return chunk_gdn_fp64_grads(x.q, x.k, x.v, x.g, x.beta, x.do, x.dht, scale=x.scale, initial_state=x.h0,
                                cu_seqlens=_offsets(x.lengths), max_token_heads=max_token_heads)


def run_once(impl, x: BwdInputs) -> tuple[dict, object]:
    """One forward and one backward of `impl` (untimed). Returns ({o, ht, dq, ..., dh0}, saved
    forward products). Exceptions propagate."""
    with torch.no_grad():
        f = impl.fwd(x)
        grads = impl.bwd(x, f.saved)
    _sync()
    if len(grads) != len(GRAD_NAMES):
        raise RuntimeError(f"{impl.name}: backward returned {len(grads)} tensors, expected {len(GRAD_NAMES)}")
    return {"o": f.o, "ht": f.ht, **dict(zip(GRAD_NAMES, grads))}, f.saved


def errors(got: dict, ref: dict, names=CHECKED) -> dict[str, float]:
    """Relative RMS of each quantity present in both (`inf` for a non-finite value; a shape
    mismatch raises ValueError)."""
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
    quantity. Without (`ref_errs` None) an implementation passes when, for at least one other one,
    every quantity of the pair (`pair_errs`: (a, b) with a before b in `names` -> {quantity:
    error}) is within `tol`; alone it is "unchecked"."""
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


def pairwise(got: dict[str, dict], names=CHECKED) -> dict[tuple[str, str], dict[str, float]]:
    """Relative RMS of every pair of implementations (the second of the pair as the reference)."""
    order = list(got)
    return {(a, b): errors(got[a], got[b], names) for a, b in combinations(order, 2)}


def format_errs(errs: dict) -> str:
    """`dq=2.9e-03 dk=...` in `CHECKED` order (empty for none)."""
    return " ".join(f"{n}={errs[n]:.1e}" for n in CHECKED if n in errs)


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


def time_impl(impl, x: BwdInputs, saved, timer: dict | None = None, time_fn=None, step: bool = True,
              verbose: bool = False) -> dict:
    """Times `impl`'s backward alone on one forward's `saved` products, then (when `step`) its
    training step, with the CUDA-graph timer (or `time_fn`). Returns the fields `bwd_ms`,
    `bwd_launches`, `bwd_spread`, `step_ms`, `step_launches`, `step_spread` and `status` ("ok" or
    "error: timing: ...")."""
    timer = timer or {}
    time_fn = time_fn or time_cuda_graph
    out = {"status": "ok"}
    jobs = [("bwd", lambda: impl.bwd(x, saved))]
    if step:
        jobs.append(("step", lambda: impl.step(x)))
    for key, fn in jobs:
        try:
            with torch.no_grad():
                t = time_fn(fn, **timer)
        except Exception as exc:
            if verbose:
                traceback.print_exc()
            out["status"] = f"error: timing {key}: " + _short(exc)
            _recover()
            return out
        out.update({f"{key}_ms": t.ms, f"{key}_launches": t.launches, f"{key}_spread": t.spread})
    return out

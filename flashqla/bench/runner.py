"""Measuring one row: inputs, trusted result, correctness gate, timing, for each implementation.

Inputs come from `flashqla.testing.make_gdn_inputs` (the valid domain: L2-normalised q and k,
v ~ N(0, 1), Qwen3-Next's gate, beta = sigmoid, value head 0 with g = 0 and the last value head
with g = -30), bf16 q/k/v and fp32 g/beta on the GPU, drawn once per head configuration at the
largest T of the run; a row takes the first T tokens of that draw, packs them with its
`cu_seqlens` (int32) and gets `initial_state` ~ N(0, 1) fp32 [N, HV, K, V] from a seeded generator.

Gate: each implementation runs once; its o and final state are compared with the fp64 chunked
result (`trusted.chunk_gdn_fp64`, on the GPU, from the same inputs) by relative RMS; above the
tolerance (or non-finite) the implementation is marked FAIL and not timed. Only then is it timed
by `timing.time_cuda_graph`, the same timer for every implementation.
"""

from __future__ import annotations

import math
import traceback
from dataclasses import dataclass

import torch

from flashqla.bench.grid import K_DIM, V_DIM, HeadConfig, Row
from flashqla.bench.timing import time_cuda_graph
from flashqla.bench.trusted import chunk_gdn_fp64, rel_rms

__all__ = ["RowInputs", "InputFactory", "measure", "reference_for", "GATE_TOL"]

#: Default relative-RMS tolerance of the gate, per quantity, against the fp64 result: FlashQLA's
#: own test tolerance (2 %), loose enough for bf16 intermediates, tight enough to catch a wrong
#: kernel (a wrong gate or state handling gives errors of order 1).
GATE_TOL = {"o": 2e-2, "ht": 2e-2}


@dataclass
class RowInputs:
    """The tensors of one row (FLA layout, packed varlen, B = 1)."""

    q: torch.Tensor           # [1, T, H, K] bf16
    k: torch.Tensor           # [1, T, H, K] bf16
    v: torch.Tensor           # [1, T, HV, V] bf16
    g: torch.Tensor           # [1, T, HV] fp32, natural-log decay per token
    beta: torch.Tensor        # [1, T, HV] fp32
    h0: torch.Tensor          # [N, HV, K, V] fp32
    cu_seqlens: torch.Tensor  # [N + 1] int32
    lengths: tuple[int, ...]

    @property
    def cu_seqlens_cpu(self) -> torch.Tensor:
        """A host copy of `cu_seqlens` (int64, from `lengths`; no device read): the context-parallel
        planner's length hint that ours takes, as FLA's argument of that name."""
        return torch.tensor(list(_offsets(self.lengths)), dtype=torch.int64)


class InputFactory:
    """Inputs per row; one `make_gdn_inputs` draw per head configuration, at `t_max` tokens."""

    def __init__(self, device, t_max: int, seed: int = 0):
        self.device, self.t_max, self.seed = device, int(t_max), int(seed)
        self._heads: HeadConfig | None = None
        self._base: dict | None = None

    def get(self, row: Row) -> RowInputs:
        from flashqla.testing import make_gdn_inputs

        T, N = row.mix.T, row.mix.N
        if self._heads != row.heads or self._base is None or self._base["q"].shape[1] < T:
            self._base = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._base = make_gdn_inputs(
                B=1, T=max(self.t_max, T), H=row.heads.h_qk, HV=row.heads.h_v, K=K_DIM, V=V_DIM,
                dtype=torch.bfloat16, device=self.device, gate="qwen3next", special_heads=True,
                initial_state=False, beta_dtype=torch.float32, seed=self.seed,
            )
            self._heads = row.heads
        b = self._base

        def head(x):
            return x[:, :T].contiguous()

        gen = torch.Generator(device=self.device).manual_seed(self.seed + 7919 * N + T)
        h0 = torch.randn(N, row.heads.h_v, K_DIM, V_DIM, generator=gen, device=self.device, dtype=torch.float32)
        cu = torch.tensor(row.mix.cu_seqlens, dtype=torch.int32, device=self.device)
        return RowInputs(head(b["q"]), head(b["k"]), head(b["v"]), head(b["g"]), head(b["beta"]), h0, cu, row.mix.lengths)

    def release(self) -> None:
        self._base = None
        self._heads = None


def reference_for(x: RowInputs) -> tuple[torch.Tensor, torch.Tensor]:
    """The trusted (o, final_state), fp64 on the GPU."""
    return chunk_gdn_fp64(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0, cu_seqlens=list(_offsets(x.lengths)))


def _offsets(lengths):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


def _short(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:160] if msg else ''}"


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def measure(fn, x: RowInputs, ref, tol: dict | None = None, timer: dict | None = None, verbose: bool = False,
            time_fn=None) -> dict:
    """Gate then time one implementation on one row.

    `time_fn(callable, **timer) -> Timing` is the timer (default `timing.time_cuda_graph`; tests
    pass a host-clock one).

    Returns a dict with `status` ("ok", "FAIL" or "error: ..."), `err_o`, `err_ht` (relative RMS,
    NaN when not computed), `ms` (median per-call time, NaN unless ok), `launches` and `spread`.
    """
    tol = tol or GATE_TOL
    out = {"status": "", "err_o": math.nan, "err_ht": math.nan, "ms": math.nan, "launches": "", "spread": math.nan}
    ref_o, ref_ht = ref
    try:
        with torch.no_grad():
            o, ht = fn(x)
            _sync()
            out["err_o"] = rel_rms(o, ref_o)
            out["err_ht"] = rel_rms(ht, ref_ht) if ht is not None else math.inf
            del o, ht
    except Exception as exc:
        if verbose:
            traceback.print_exc()
        out["status"] = "error: " + _short(exc)
        _recover()
        return out
    if not (out["err_o"] <= tol["o"] and out["err_ht"] <= tol["ht"]):
        out["status"] = "FAIL"
        return out
    try:
        with torch.no_grad():
            t = (time_fn or time_cuda_graph)(lambda: fn(x), **(timer or {}))
    except Exception as exc:
        if verbose:
            traceback.print_exc()
        out["status"] = "error: timing: " + _short(exc)
        _recover()
        return out
    out.update(status="ok", ms=t.ms, launches=t.launches, spread=t.spread)
    return out


def _recover() -> None:
    try:
        _sync()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass

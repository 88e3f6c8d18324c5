"""Per-rank compute of the cross-rank CP op: the local forward and backward over a rank's pieces.

A backend runs the ordinary chunked op on one rank's packed pieces; the CP op (`flashqla.distributed.op`)
only calls these four methods, so the same orchestration runs the sm_90 kernels on GPUs (NCCL) and
any differentiable implementation with FLA's signature, such as the fp64 reference, on CPUs (gloo):

    check(q, k, v, g, beta, initial_state)    raise before any work if the backend cannot run these
    state_dtype(q, g, beta, initial_state)    dtype of states, maps and state gradients (all ranks agree)
    forward(q, k, v, g, beta, scale, initial_state, cu_seqlens)
        -> (o [1, T, HV, V'], final_state [n, HV, K, V'], saved)     V' = v.shape[-1] (any width)
    backward(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, saved)
        -> (dq, dk, dv, dg, dbeta, dh0 or None)

`cu_seqlens` is the rank-local [n + 1] offsets on the inputs' device; `initial_state` None means
zeros; `saved` is what `forward` returned for the same (k, g, beta, cu_seqlens), or None (recompute).

A backend may also offer the segmented path (`SegmentedBackend`, and `KernelBackend` built on it):

    segment_plan(q, v, cu_seqlens, max_seqlen) -> a `flashqla.cp.plan.CPPlan` that splits, or None
    cp_backend                                   the launch-level `flashqla.ops.gdn.backend.Backend`

with which the op runs the rank's pieces as one intra-device CP pass (`flashqla.cp.forward.
cp_forward_open` / `cp_backward_open`) instead of calling `forward` / `backward` per piece group.
"""

from __future__ import annotations

from typing import Protocol

import torch

from flashqla.contract import check_device, check_supported, cp_mode, dense
from flashqla.cp.plan import BV_CHOICES, DEFAULT_SM_COUNT, CPPlan, plan_for
from flashqla.ops.gdn.backend import default_backend
from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

__all__ = ["CPComputeBackend", "SegmentedBackend", "KernelBackend", "FunctionBackend", "resolve_backend"]


class CPComputeBackend(Protocol):
    name: str

    def check(self, q, k, v, g, beta, initial_state) -> None: ...

    def state_dtype(self, q, g, beta, initial_state) -> torch.dtype: ...

    def forward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens): ...

    def backward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, saved): ...


def _plannable(v) -> bool:
    """Whether the planner can cost this value head dim (a kernel value-slice width divides it)."""
    return any(v.shape[3] % bv == 0 for bv in BV_CHOICES)


class SegmentedBackend:
    """Per-rank compute through the op's drivers (`flashqla.chunk_gated_delta_rule_fwd` / `_bwd`, split
    or not by `flashqla.cp`) over a launch-level backend (`flashqla.ops.gdn.backend.Backend`: prepare,
    recurrent, bwd, zeros, state_dtype), for example
    `reference.gdn.cp.ReferenceCPBackend()` (fp64, any device; what the CPU tests run).

    Besides the four methods of the protocol it offers `segment_plan`: when the rank's pieces split
    into segments (the planner of `flashqla.cp` in mode `cp`, or `segment_len`), the op
    (`flashqla.distributed.op`) runs them through `cp_forward_open` / `cp_backward_open`, treating a
    continuing piece 0 as an open sequence (no extra launch for it). Otherwise `forward` / `backward`
    run the drivers (split or not by the same planner).

    Args:
        cp_backend: the launch-level backend (None: the sm_90 kernels, `flashqla.ops.gdn.backend.Sm90Backend`,
            with the fast path's input checks).
        cp: intra-device mode ("off", "auto", "on"; None reads $FLASHQLA_CP, default "auto").
        segment_len: fix the segment length (a positive multiple of 64) when splitting.
        sm_count: SMs assumed by the planner (None: the device's).
    Raises ValueError for an unknown mode or a bad segment_len.
    """

    name = "segmented"

    def __init__(self, cp_backend=None, cp: str | None = "auto", *, segment_len: int | None = None,
                 sm_count: int | None = None):
        self.cp = cp_mode(cp, default="auto")
        if segment_len is not None and (isinstance(segment_len, bool) or not isinstance(segment_len, int)
                                        or segment_len <= 0 or segment_len % 64):
            raise ValueError(f"segment_len must be None or a positive multiple of 64, got {segment_len!r}")
        self.segment_len = segment_len
        self.sm_count = sm_count
        self._cp_backend = cp_backend
        self.name = f"segmented({getattr(cp_backend, 'name', type(cp_backend).__name__)}, cp={self.cp})"

    @property
    def cp_backend(self):
        """The launch-level backend (the sm_90 one is created at first use)."""
        return default_backend() if self._cp_backend is None else self._cp_backend

    def check(self, q, k, v, g, beta, initial_state) -> None:
        return None

    def state_dtype(self, q, g, beta, initial_state) -> torch.dtype:
        return self.cp_backend.state_dtype

    def segment_plan(self, q, v, cu_seqlens, max_seqlen: int | None = None):
        """The `CPPlan` when the rank's pieces (q [1, T, H, K], v, local cu_seqlens) split into
        segments, else None. Static facts only (shapes, the host-side max_seqlen hint). A value head
        dim no kernel value-slice width divides (only launch-level backends such as the fp64 reference
        run those) is split only when forced with a fixed segment_len."""
        if self.cp == "off":
            return None
        if not _plannable(v):
            if self.cp == "on" and self.segment_len is not None:
                return CPPlan(True, self.segment_len, v.shape[3], True, self.sm_count or DEFAULT_SM_COUNT, 0.0, None,
                              "forced segment_len (head dim outside the kernels' value-slice widths)")
            return None
        plan = plan_for(q, v, cu_seqlens, sm_count_override=self.sm_count, force=self.cp == "on", exact=True,
                        segment_len=self.segment_len, max_seqlen=max_seqlen)
        return plan if plan.split else None

    def _mode(self, v) -> str:
        return self.cp if _plannable(v) else "off"

    def forward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens):
        f = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, True, cu_seqlens, cp=self._mode(v),
                                       segment_len=self.segment_len, sm_count=self.sm_count, backend=self._cp_backend)
        return f.o, f.final_state, (f.A, f.g_cum_log2)

    def backward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, saved):
        q, k, v, g, beta = (dense(x) for x in (q, k, v, g, beta))
        if saved is None:
            saved = self.cp_backend.prepare(k, g, beta, cu_seqlens, v.shape[2])
        A, g_cum_log2 = saved
        sd = self.cp_backend.state_dtype
        do = do.to(q.dtype).contiguous()
        dht = None if dht is None else dht.to(sd).contiguous()
        if initial_state is not None:
            initial_state = initial_state.to(sd).contiguous()
        return chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens,
                                          cp=self._mode(v), segment_len=self.segment_len, sm_count=self.sm_count,
                                          backend=self._cp_backend)


class KernelBackend(SegmentedBackend):
    """The sm_90 kernels (`flashqla.ops.gdn.backend.Sm90Backend`; bf16/fp16 q, k, v; fp32 g and states;
    K = V = 128; compute capability 9.0) through the drivers of `SegmentedBackend`. `saved` is the
    forward's (A diag(beta), g_cum_log2) in the slot layout of the pieces' offsets; without it the
    backward recomputes them with one prepare launch.

    cp: the intra-device context-parallel mode of every local launch ("off", "auto" or "on"; None
    reads $FLASHQLA_CP, default "auto"; `flashqla.contract.cp_mode`): with "auto" the planner of
    `flashqla.cp` splits a rank's long pieces into segments run side by side, as the single-GPU op
    does with the same mode; "off" runs every piece unsplit. segment_len, sm_count: planner
    overrides (as `chunk_gated_delta_rule_fwd`'s). Raises ValueError for an unknown mode."""

    name = "kernels"

    def __init__(self, cp: str | None = "auto", *, segment_len: int | None = None, sm_count: int | None = None):
        super().__init__(None, cp, segment_len=segment_len, sm_count=sm_count)
        self.name = f"kernels(cp={self.cp})"

    def check(self, q, k, v, g, beta, initial_state) -> None:
        check_supported(q, k, v, g, beta, initial_state)
        check_device(q)

    def state_dtype(self, q, g, beta, initial_state) -> torch.dtype:
        return torch.float32


class FunctionBackend:
    """Any op with FLA's signature and autograd, `fn(q, k, v, g, beta, scale=, initial_state=,
    output_final_state=True, cu_seqlens=) -> (o, final_state)`, for instance the fp64 reference
    `reference.chunk_gated_delta_rule` on CPU. The forward runs it without grad; the backward runs it
    again under autograd and takes the vector-Jacobian product (`torch.autograd.grad`). States are
    fp64 when any input is fp64, else fp32."""

    name = "function"

    def __init__(self, fn):
        if not callable(fn):
            raise TypeError(f"FunctionBackend needs a callable op with FLA's signature, got {type(fn).__name__}")
        self.fn = fn
        self.name = f"function:{getattr(fn, '__module__', '?')}.{getattr(fn, '__qualname__', type(fn).__name__)}"

    def check(self, q, k, v, g, beta, initial_state) -> None:
        return None

    def state_dtype(self, q, g, beta, initial_state) -> torch.dtype:
        xs = (q, g, beta) if initial_state is None else (q, g, beta, initial_state)
        return torch.float64 if any(x.dtype == torch.float64 for x in xs) else torch.float32

    def _call(self, q, k, v, g, beta, scale, initial_state, cu_seqlens):
        return self.fn(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=True,
                       cu_seqlens=cu_seqlens)

    def forward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens):
        with torch.no_grad():
            o, ht = self._call(q, k, v, g, beta, scale, initial_state, cu_seqlens)
        return o, ht, None

    def backward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, saved):
        xs = [x.detach().requires_grad_(True) for x in (q, k, v, g, beta)]
        h0 = None if initial_state is None else initial_state.detach().requires_grad_(True)
        leaves = xs + ([h0] if h0 is not None else [])
        with torch.enable_grad():
            o, ht = self._call(*xs, scale, h0, cu_seqlens)
            outs, cots = [o], [do.to(o.dtype)]
            if dht is not None:
                outs.append(ht)
                cots.append(dht.to(ht.dtype))
            grads = torch.autograd.grad(outs, leaves, cots, allow_unused=True)
        grads = [torch.zeros_like(x) if gr is None else gr for x, gr in zip(leaves, grads)]
        return (*grads[:5], grads[5] if h0 is not None else None)


def resolve_backend(backend, q: torch.Tensor):
    """The backend object for `backend`: None (the kernels for CUDA inputs, intra-device mode "auto"
    or $FLASHQLA_CP; no default elsewhere), "kernels" (the same), a backend object (with check / state_dtype / forward / backward), or a callable op with
    FLA's signature (wrapped in `FunctionBackend`).

    Raises ValueError for None on a non-CUDA device or an unknown name, TypeError for anything else."""
    if backend is None:
        if q.device.type == "cuda":
            return KernelBackend(None)
        raise ValueError(
            f"backend: the inputs are on {q.device}, where no kernel backend exists; pass backend= an op with FLA's "
            "signature and autograd (for instance reference.chunk_gated_delta_rule in fp64 on CPU)"
        )
    if isinstance(backend, str):
        if backend == "kernels":
            return KernelBackend(None)
        raise ValueError(f"backend: unknown name {backend!r} (known: 'kernels')")
    if all(hasattr(backend, m) for m in ("check", "state_dtype", "forward", "backward")):
        return backend
    if callable(backend):
        return FunctionBackend(backend)
    raise TypeError(f"backend must be None, 'kernels', a backend object or a callable op, got {type(backend).__name__}")

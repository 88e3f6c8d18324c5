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
"""

from __future__ import annotations

from typing import Protocol

import torch

__all__ = ["CPComputeBackend", "KernelBackend", "FunctionBackend", "resolve_backend"]


class CPComputeBackend(Protocol):
    name: str

    def check(self, q, k, v, g, beta, initial_state) -> None: ...

    def state_dtype(self, q, g, beta, initial_state) -> torch.dtype: ...

    def forward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens): ...

    def backward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, saved): ...


class KernelBackend:
    """The sm_90 kernels: `flashqla.ops.gdn.api.chunk_gated_delta_rule_fwd` and
    `flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd` (bf16/fp16 q, k, v; fp32 g and states;
    K = V = 128; compute capability 9.0). `saved` is the forward's (A diag(beta), g_cum_log2) in the
    slot layout of the pieces' offsets; without it the backward recomputes them with one prepare
    launch.

    cp: the intra-device context-parallel mode of every local launch ("off", "auto" or "on"; None
    reads $FLASHQLA_CP, default "auto"; `flashqla.ops.gdn.api.cp_mode`), passed to both entry points:
    with "auto" the planner of `flashqla.cp` splits a rank's long pieces into segments run side by
    side, as the single-GPU op does with the same mode. Raises ValueError for an unknown mode."""

    name = "kernels"

    def __init__(self, cp: str | None = "auto"):
        from flashqla.ops.gdn.api import cp_mode

        self.cp = cp_mode(cp, default="auto")
        self.name = f"kernels(cp={self.cp})"

    def check(self, q, k, v, g, beta, initial_state) -> None:
        from flashqla.ops.gdn.api import _check_device, _check_supported

        _check_supported(q, k, v, g, beta, initial_state)
        _check_device(q)

    def state_dtype(self, q, g, beta, initial_state) -> torch.dtype:
        return torch.float32

    def forward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens):
        from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd

        f = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, initial_state, True, cu_seqlens, cp=self.cp)
        return f.o, f.final_state, (f.A, f.g_cum_log2)

    def backward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, saved):
        from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd

        q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
        if saved is None:
            from flashqla.ops.gdn.kernels.sm90.prepare import chunk_prepare_fwd

            saved = chunk_prepare_fwd(k, g, beta, cu_seqlens, v.shape[2])
        A, g_cum_log2 = saved
        do = do.to(q.dtype).contiguous()
        dht = None if dht is None else dht.to(torch.float32).contiguous()
        if initial_state is not None:
            initial_state = initial_state.to(torch.float32).contiguous()
        return chunk_gated_delta_rule_bwd(q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens,
                                          cp=self.cp)


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

"""The launches the forward and backward drivers orchestrate, behind one interface, so that the same
orchestration (unsplit, or split over segments by `flashqla.cp`) runs the sm_90 kernels on the GPU
and an fp64 stand-in (`reference.gdn.cp.ReferenceCPBackend`) on any device in the CPU tests.

    Backend       the protocol (shapes as the sm_90 launchers)
    Sm90Backend   the sm_90 kernels (`flashqla.ops.gdn.kernels.sm90`), compiled concurrently on first use
    default_backend()  the process's Sm90Backend
"""

from __future__ import annotations

from typing import Protocol

import torch

from flashqla.contract import dense
from flashqla.ops.gdn.kernels.sm90 import registry
from flashqla.ops.gdn.kernels.sm90._common import tl_dtype
from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_fused_bwd
from flashqla.ops.gdn.kernels.sm90.finish_bwd import chunk_finish_bwd
from flashqla.ops.gdn.kernels.sm90.packed_tail import new_output
from flashqla.ops.gdn.kernels.sm90.prepare import chunk_prepare_fwd, prepare_kernel_args
from flashqla.ops.gdn.kernels.sm90.recurrent import (chunk_recurrent_dual, chunk_recurrent_dual_checkpoints, chunk_recurrent_fwd,
                                                      recurrent_kernel_args)
from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd

__all__ = ["Backend", "Sm90Backend", "current_stream_id", "default_backend"]


class Backend(Protocol):
    """The launches a driver orchestrates.

    state_dtype: dtype of states (fp32 for the kernels).
    prepare(k [1, T, H, K], g [1, T, HV], beta [1, T, HV], cu_seqlens [N + 1], HV)
        -> (A [HV, S * 64, 64], g_cum_log2 [HV, S * 64]) in the slot layout of cu_seqlens
        (S = floor(T / 64) + N; `flashqla.ops.gdn.kernels.sm90._common`).
    recurrent(q, k, v [1, T, HV, V'], A, g_cum_log2, scale, initial_state [N, HV, K, V'] or None,
              output_final_state, cu_seqlens, block_v, o=None) -> (o [1, T, HV, V'], final_state or None).
        V' is V for the run and K for the transition pass (K == V on the kernels).
    zeros(shape, dtype, device) -> a zero tensor the launches only read (may be cached).
    bwd(q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens, order=None, dh0=None)
        -> (dq, dk, dv, dg, dbeta, dh0 or None): the unsplit backward from the forward's products;
        order: the launch order of the sequences (`launch_order.launch_order`), or None (token
        order; the same results); dh0: whether the caller uses the returned dh0 (None: when
        initial_state is given), a hint a backend may ignore.
    Optional: recurrent_dual(q, k, v, A, g_cum_log2, scale, initial_state, limit, cu_seqlens, block_v, o)
    -> (o, Q, U, P) or None (the split path's run and transitions in one launch);
    recurrent_dual_checkpoints(..., cu_seqlens, positions, block_v, o) -> (o, Q, U, P, CQ, CP) or None
    (the same with the run's and the transitions' states at the checkpoint positions: the split
    path's checkpoints, `flashqla.cp.forward.cp_forward`); warm(k, beta, q, v, cu_seqlens, HV,
    block_v, dual=False, checkpoints=False, a_dtype=None) (compile ahead of the launches); deferred_dht
    (bwd takes dht as a callable, called once the states pass is launched); fp16_products (True:
    a forward without gradients on bf16 input passes prepare `a_dtype=torch.float16` and the recurrent
    launches follow A's dtype: the fp16 A_beta product, `flashqla.ops.gdn.fwd.product_dtype`).
    """

    state_dtype: torch.dtype

    def prepare(self, k, g, beta, cu_seqlens, HV: int): ...

    def recurrent(self, q, k, v, A, g_cum_log2, scale, initial_state, output_final_state, cu_seqlens, block_v=None, o=None): ...

    def zeros(self, shape, dtype, device): ...

    def bwd(self, q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens, order=None, dh0=None): ...


class Sm90Backend:
    """`Backend` on the sm_90 kernels. Compiles the kernels of a configuration concurrently on first use
    (`registry.build_once`). `zeros` keeps the last few zero value tensors it made (the transition
    pass reads v = 0; a [1, T, HV, K] buffer per shape and stream)."""

    name = "sm90"
    state_dtype = torch.float32
    #: `bwd` takes dht as a callable (`flashqla.cp.backward` then computes it on a side stream)
    deferred_dht = True
    ZERO_CACHE = 4

    def __init__(self, fp16_products: bool = False):
        """fp16_products: a forward without gradients on bf16 input stores A diag(beta) in fp16 and
        feeds the two products that read it fp16 operands (`flashqla.ops.gdn.fwd.product_dtype`; o's
        and the final state's error about 0.6-0.7x, measured on an H100 at +1.8% to +8.8% forward
        time: README "Precision"). Off by default; the process's backend is `default_backend()`."""
        self.fp16_products = fp16_products
        self._zeros: dict = {}

    @property
    def fp16_products(self) -> bool:
        """The opt-in fp16 A_beta product (`__init__`); settable, a bool (TypeError naming it otherwise)."""
        return self._fp16_products

    @fp16_products.setter
    def fp16_products(self, value: bool) -> None:
        if not isinstance(value, bool):
            raise TypeError(f"fp16_products must be a bool, got {type(value).__name__}")
        self._fp16_products = value

    def warm(self, k, beta, q, v, cu_seqlens, HV: int, block_v, dual: bool = False, checkpoints: bool = False,
             a_dtype: torch.dtype | None = None) -> None:
        """Builds the prepare kernel and the recurrent kernel a call will launch (the dual launch's when
        `dual`; its checkpoint build, `recurrent_dual_checkpoints`, with `checkpoints` too), for A in
        `a_dtype` (None: k's), concurrently, once per key."""
        rec = recurrent_kernel_args(q, v, cu_seqlens, block_v, dual=dual, a_dtype=a_dtype)
        specs = [("prepare", prepare_kernel_args(k, beta, cu_seqlens, HV, a_dtype)),
                 ("recurrent_serving", rec[:8] + ("float32", "kv", True, True) + tuple(rec[9:]))
                 if dual and checkpoints else ("recurrent", rec)]
        registry.build_once(tuple(specs), specs)

    def prepare(self, k, g, beta, cu_seqlens, HV: int, A=None, g_cum_log2=None, a_dtype: torch.dtype | None = None):
        """`chunk_prepare_fwd` (A, g_cum_log2: optional preallocated outputs; a_dtype: A's dtype, None:
        k's; the launches that read A follow its dtype)."""
        return chunk_prepare_fwd(k, g, beta, cu_seqlens, HV, A=A, g_cum_log2=g_cum_log2, a_dtype=a_dtype)

    def recurrent(self, q, k, v, A, g_cum_log2, scale, initial_state, output_final_state, cu_seqlens, block_v=None, o=None,
                  final_state=None):
        """`chunk_recurrent_fwd` (o, final_state: optional preallocated outputs; without o, one from
        `packed_tail.new_output`: a packed tail zeroed by its own launch, not a memset of o)."""
        o = new_output(v, cu_seqlens) if o is None else o
        return chunk_recurrent_fwd(q, k, v, A, g_cum_log2, scale, initial_state, output_final_state, cu_seqlens,
                                   block_v=block_v, o=o, final_state=final_state)

    def recurrent_dual(self, q, k, v, A, g_cum_log2, scale, initial_state, limit, cu_seqlens, block_v=None, o=None):
        """Run and transition in one launch (`chunk_recurrent_dual`): (o, Q, U, P); None when it does
        not apply (K != V)."""
        if q.shape[-1] != v.shape[-1]:
            return None
        o = new_output(v, cu_seqlens) if o is None else o  # (as `recurrent`'s)
        return chunk_recurrent_dual(q, k, v, A, g_cum_log2, scale, initial_state, limit, cu_seqlens, block_v=block_v, o=o)

    def recurrent_dual_checkpoints(self, q, k, v, A, g_cum_log2, scale, initial_state, limit, cu_seqlens, positions,
                                   block_v=None, o=None):
        """`recurrent_dual` that also stores the run's and the transition's states at `positions` (one
        launch, `chunk_recurrent_dual_checkpoints`): (o, Q, U, P, CQ, CP); None when it does not apply
        (K != V)."""
        if q.shape[-1] != v.shape[-1]:
            return None
        o = new_output(v, cu_seqlens) if o is None else o  # (as `recurrent`'s)
        return chunk_recurrent_dual_checkpoints(q, k, v, A, g_cum_log2, scale, initial_state, limit, cu_seqlens,
                                                positions, block_v=block_v, o=o)

    def _build_bwd(self, q, v, beta, cu_seqlens, dh0: bool) -> None:
        """First use of a backward configuration: passes 1-3 on these offsets, compiled concurrently."""
        if q.shape[0] * q.shape[1] == 0:
            return
        H, HV, K, V = q.shape[2], v.shape[2], q.shape[3], v.shape[3]
        seq_dtype = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
        dtype = tl_dtype(q.dtype)
        specs = registry.bwd_specs(H, HV, K, V, dtype, tl_dtype(beta.dtype), seq_dtype, cu_seqlens is not None, dh0)
        specs.append(("gva_reduce", (H, HV, K, dtype)))
        registry.build_once(("bwd", tuple(specs)), specs)

    def bwd(self, q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens, order=None, dh0=None):
        """The unsplit backward's launches (three passes; `flashqla.ops.gdn.bwd`): pass 1 (the states,
        `states_bwd`), pass 2 (every per-chunk gradient, `chunk_bwd`) and pass 3 (dG's reverse cumsum,
        the GVA sum of dq and dk), for bf16 and fp16 inputs alike (h stored in q's dtype). order: the
        sequences' launch order or None. dht: None, a tensor, or a callable returning one, called once
        the states pass (which does not read dht) is launched: the split backward computes the
        segments' terminal gradients on a side stream meanwhile. dh0: whether the caller uses the
        returned state gradients (None: when initial_state is given); pass 2's build follows it.
        Returns (dq, dk, dv, dg, dbeta, dh0 or None without initial_state), FLA's dtypes (dg fp32,
        dbeta in beta's dtype)."""
        join = dht if callable(dht) else None
        try:
            dh0 = initial_state is not None if dh0 is None else bool(dh0)
            self._build_bwd(q, v, beta, cu_seqlens, dh0)
            q, k, v, beta, do = (dense(x) for x in (q, k, v, beta, do))
            h = chunk_states_bwd(k, v, A, g_cum_log2, initial_state, cu_seqlens, order=order)
        finally:  # joined even when a launch above raises (a capture must not end with an open fork)
            if join is not None:
                dht = join()
        dq_hv, dk_hv, dv, dbeta, dG, dS0 = chunk_fused_bwd(q, k, v, beta, A, g_cum_log2, h, do, dht, scale, cu_seqlens,
                                                           order=order, dh0=dh0)
        dq, dk, dg = chunk_finish_bwd(dG, dq_hv, dk_hv, cu_seqlens, q.shape[2], q.dtype)
        return dq, dk, dv, dg, dbeta.to(beta.dtype), (dS0 if initial_state is not None else None)

    def zeros(self, shape, dtype, device):
        """A zero tensor the launches only read, cached per (shape, dtype, device, current stream): a
        buffer is used and evicted (freed) on the stream it was made on only, so the caching allocator
        never hands its memory to another stream while a launch there may still read it (no
        `record_stream` needed; FlashInfer #4476 was this bug)."""
        key = (tuple(shape), dtype, str(device), current_stream_id(device))
        z = self._zeros.pop(key, None)
        if z is None:
            z = torch.zeros(shape, dtype=dtype, device=device)
        self._zeros[key] = z  # most recent last
        while len(self._zeros) > self.ZERO_CACHE:
            self._zeros.pop(next(iter(self._zeros)))
        return z


def current_stream_id(device):
    """The CUDA stream current on `device` (its handle, an int), or None off CUDA: the part of a scratch
    buffer's cache key that keeps two streams from sharing it."""
    device = torch.device(device)
    if device.type != "cuda":
        return None
    return torch.cuda.current_stream(device).cuda_stream


_DEFAULT = None


def default_backend() -> Sm90Backend:
    """The process's `Sm90Backend` (made on first use)."""
    global _DEFAULT
    if _DEFAULT is None:
        _DEFAULT = Sm90Backend()
    return _DEFAULT

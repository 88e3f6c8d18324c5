"""Autograd and `torch.compile` support for the sm_90 Gated DeltaNet op.

Two `torch.library` custom ops wrap the kernels, so that `torch.compile` sees opaque calls with
known output shapes (fake implementations below) instead of tracing into TileLang:

    flashqla::gdn_fwd(q, k, v, g, beta, scale, initial_state?, output_final_state, cu_seqlens?, cp, max_seqlen?)
        -> (o [B, T, HV, V] q's dtype, final_state [N, HV, K, V] fp32 (or [0] when not requested),
            A [HV, S * 64, 64] q's dtype, g_cum_log2 [HV, S * 64] fp32)
    flashqla::gdn_fwd_inference(the same arguments) -> (o, final_state): the public op's forward when
        no input requires a gradient (or grad mode is off): nothing is kept for a backward, so a
        split forward skips moving A and g_cum_log2 back to the caller's layout
    flashqla::gdn_bwd(q, k, v, g, beta, A, g_cum_log2, do, dht?, scale, initial_state?, cu_seqlens?, cp, max_seqlen?,
                      need_dh0)
        -> (dq, dk, dv, dg fp32, dbeta in beta's dtype, dh0 [N, HV, K, V] fp32 (or [0] without initial_state
            or when need_dh0 is False: autograd passes whether initial_state requires grad))

The forward ops check their inputs as the public op does (they can be called directly, and a
compiled graph calls them) and plan their own call (`flashqla.cp.plan`). cp is the context-parallel mode ("off", "auto", "on";
`flashqla.contract.cp_mode`): A and g_cum_log2 come back in the unsplit layout either way. max_seqlen
is the planner's host-side length hint (`flashqla.contract.planning_max_seqlen`; None: balanced lengths
assumed); it changes the plan, never the results. S is the number of chunk slots (`kernels.sm90._common.num_slots`: B * ceil(T / 64), or
floor(T / 64) + N for packed input), a function of shapes only. `gdn_fwd` has a registered
autograd formula that calls `gdn_bwd` with the saved forward products (A diag(beta), g_cum_log2;
nothing state-sized is kept: the backward recomputes the chunk states). Outside torch.compile the
public op uses `GDNEagerFunction` instead: the same launches on the plan the op made once, plus the
split forward's kept states (`flashqla.cp.saved.CPSaved`) handed to the split backward.

The L2 normalisation of q and k (`use_qk_l2norm_in_kernel`) happens before these ops, in plain
differentiable torch (`flashqla.contract.l2norm`), so its gradient comes from autograd.
"""

import weakref
from typing import Optional

import torch

from flashqla.contract import check_device, check_gdn_inputs, check_supported, cp_mode, resolve_truncate
from flashqla.cp.plan import plan_call
from flashqla.cp.saved import CPSaved, cu_key
from flashqla.ops.gdn.bwd import backward, chunk_gated_delta_rule_bwd
from flashqla.ops.gdn.fwd import forward
from flashqla.ops.gdn.kernels.sm90._common import num_slots

__all__ = ["gdn_fwd", "gdn_fwd_inference", "gdn_bwd", "num_slots_for", "keeps_products", "KEEP_ROWS_PER_TOKEN",
           "GDNEagerFunction"]

_EMPTY_SHAPE = (0,)


def _check(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp) -> None:
    """The public op's checks, in its order, for a custom op called directly (torch.ops.flashqla.*):
    the arguments, the fast path's dtypes and head dims, the cp mode, a Hopper GPU. Raises what
    `flashqla.chunk_gated_delta_rule` raises."""
    check_gdn_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    check_supported(q, k, v, g, beta, initial_state)
    cp_mode(cp)
    resolve_truncate(None)
    check_device(q)


def num_slots_for(q: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> int:
    """Chunk slots of the forward's A / g_cum_log2 for q [B, T, H, K] (shapes only)."""
    B, T = q.shape[0], q.shape[1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    return num_slots(B, T, N, cu_seqlens is not None)


#: The most rows of A / g_cum_log2 (chunk slots x 64) the forward keeps for the backward per token of
#: the batch. Slots pad every sequence to whole chunks of 64, so batches of short sequences have many
#: more rows than tokens (T = N = 65536 one-token sequences: 64 x); above this the backward recomputes
#: them instead (one prepare launch, the same values).
KEEP_ROWS_PER_TOKEN = 2


def keeps_products(q: torch.Tensor, cu_seqlens: Optional[torch.Tensor]) -> bool:
    """Whether the training forward keeps A and g_cum_log2 for the backward (shapes only): when their
    rows, `num_slots_for(q, cu_seqlens)` x 64, are at most `KEEP_ROWS_PER_TOKEN` per token (at least
    one chunk). Otherwise nothing A-sized is kept between the forward and the backward, which then
    recomputes them; kept memory per token and value head is then at most 2 x (64 x 2 + 4) = 264 B for
    bf16 / fp16 inputs (132 B per row: a row of A and one of g_cum_log2), whatever the sequence mix."""
    rows = num_slots_for(q, cu_seqlens) * 64
    return rows <= KEEP_ROWS_PER_TOKEN * max(q.shape[0] * q.shape[1], 64)


@torch.library.custom_op("flashqla::gdn_fwd", mutates_args=())
def gdn_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    cu_seqlens: Optional[torch.Tensor],
    cp: str = "off",
    max_seqlen: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """The forward (`flashqla.ops.gdn.fwd.forward`) as a custom op: (o, final_state or an empty [0]
    tensor, A, g_cum_log2); shapes and dtypes in the module docstring. A and g_cum_log2 are empty [0]
    tensors when `keeps_products` is False (the backward recomputes them)."""
    _check(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp)
    plan = plan_call(q, v, cu_seqlens, cp, max_seqlen=max_seqlen)
    keep = keeps_products(q, cu_seqlens)
    f = forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, plan=plan, for_backward=keep,
                training=True)
    final_state = f.final_state if f.final_state is not None else q.new_empty(_EMPTY_SHAPE, dtype=torch.float32)
    if not keep:
        return f.o, final_state, q.new_empty(_EMPTY_SHAPE), q.new_empty(_EMPTY_SHAPE, dtype=torch.float32)
    return f.o, final_state, f.A, f.g_cum_log2


@gdn_fwd.register_fake
def _gdn_fwd_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp="off", max_seqlen=None):
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    S = num_slots_for(q, cu_seqlens)
    o = v.new_empty(v.shape, dtype=q.dtype)
    final_state = q.new_empty((N, HV, K, V) if output_final_state else _EMPTY_SHAPE, dtype=torch.float32)
    keep = keeps_products(q, cu_seqlens)
    A = q.new_empty((HV, S * 64, 64) if keep else _EMPTY_SHAPE)
    g_cum_log2 = q.new_empty((HV, S * 64) if keep else _EMPTY_SHAPE, dtype=torch.float32)
    return o, final_state, A, g_cum_log2


@torch.library.custom_op("flashqla::gdn_fwd_inference", mutates_args=())
def gdn_fwd_inference(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float,
    initial_state: Optional[torch.Tensor],
    output_final_state: bool,
    cu_seqlens: Optional[torch.Tensor],
    cp: str = "off",
    max_seqlen: Optional[int] = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The forward when no gradient is needed: (o, final_state or an empty [0] tensor), without the
    backward's products (`flashqla.ops.gdn.fwd.forward(for_backward=False)`)."""
    _check(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp)
    plan = plan_call(q, v, cu_seqlens, cp, max_seqlen=max_seqlen)
    f = forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, plan=plan, for_backward=False)
    final_state = f.final_state if f.final_state is not None else q.new_empty(_EMPTY_SHAPE, dtype=torch.float32)
    return f.o, final_state


@gdn_fwd_inference.register_fake
def _gdn_fwd_inference_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp="off",
                            max_seqlen=None):
    o, final_state, _, _ = _gdn_fwd_fake(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp)
    return o, final_state


@torch.library.custom_op("flashqla::gdn_bwd", mutates_args=())
def gdn_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    g_cum_log2: torch.Tensor,
    do: torch.Tensor,
    dht: Optional[torch.Tensor],
    scale: float,
    initial_state: Optional[torch.Tensor],
    cu_seqlens: Optional[torch.Tensor],
    cp: str = "off",
    max_seqlen: Optional[int] = None,
    need_dh0: bool = True,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """`flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd` as a custom op: (dq, dk, dv, dg, dbeta, dh0
    or an empty [0] tensor); shapes and dtypes in the module docstring (FLA's dtypes). A and
    g_cum_log2 empty [0] tensors (a forward that did not keep them): recomputed."""
    if A.dim() == 1 and g_cum_log2.dim() == 1:
        A = g_cum_log2 = None
    dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(
        q, k, v, g, beta, A, g_cum_log2, do.contiguous(), dht, scale, initial_state, cu_seqlens, cp=cp,
        max_seqlen=max_seqlen, need_dh0=need_dh0,
    )
    if dh0 is None:
        dh0 = q.new_empty(_EMPTY_SHAPE, dtype=torch.float32)
    return dq, dk, dv, dg, dbeta, dh0


@gdn_bwd.register_fake
def _gdn_bwd_fake(q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens, cp="off", max_seqlen=None,
                  need_dh0=True):
    dh0 = (torch.empty_like(initial_state) if initial_state is not None and need_dh0
           else q.new_empty(_EMPTY_SHAPE, dtype=torch.float32))
    return (torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g, dtype=torch.float32),
            torch.empty_like(beta), dh0)


def _setup_context(ctx, inputs, output):
    q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp, max_seqlen = inputs
    _, _, A, g_cum_log2 = output
    ctx.save_for_backward(q, k, v, g, beta, A, g_cum_log2, initial_state, cu_seqlens)
    ctx.scale = scale
    ctx.output_final_state = output_final_state
    ctx.cp = cp
    ctx.max_seqlen = max_seqlen


def _cotangents(ctx, q, v, do, dht):
    """(do, dht) as the backward takes them: zeros for an unused o, None for an unused final state."""
    if do is None:
        do = torch.zeros_like(v, dtype=q.dtype)
    if not ctx.output_final_state or dht is None or dht.numel() == 0:
        dht = None
    return do, dht


def _need_dh0(ctx, initial_state) -> bool:
    """Whether the backward forms dh0: an initial_state that requires grad (`gdn_fwd`'s input 6).
    Without it pass 2 takes the build without `chunk_bwd.DH0_OPTS`."""
    return initial_state is not None and bool(ctx.needs_input_grad[6])


def _input_grads(g, need_dh0, dq, dk, dv, dg, dbeta, dh0) -> tuple:
    """The gradients of (q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp,
    max_seqlen), the forward's inputs in `gdn_fwd`'s order."""
    return (dq, dk, dv, dg.to(g.dtype), dbeta, None, (dh0 if need_dh0 else None), None, None, None, None)


def _backward(ctx, do, dht, dA, dg_cum):
    del dA, dg_cum  # A and g_cum_log2 are saved products, not differentiable outputs
    q, k, v, g, beta, A, g_cum_log2, initial_state, cu_seqlens = ctx.saved_tensors
    do, dht = _cotangents(ctx, q, v, do, dht)
    need = _need_dh0(ctx, initial_state)
    grads = gdn_bwd(q, k, v, g, beta, A, g_cum_log2, do, dht, ctx.scale, initial_state, cu_seqlens, ctx.cp,
                    ctx.max_seqlen, need)
    return _input_grads(g, need, *grads)


gdn_fwd.register_autograd(_backward, setup_context=_setup_context)


class GDNEagerFunction(torch.autograd.Function):
    """The public op's autograd outside torch.compile: the forward and backward of `gdn_fwd` /
    `gdn_bwd` on the plan the op made once (`flashqla.cp.plan.plan_call(training=True,
    keep_states=True)`), plus the split forward's kept states: when the backward's plan splits, the
    forward splits the same way and the backward reuses its segments' entering states, transitions and
    U rows instead of recomputing them, and its A and g_cum_log2 in the segments' layout, never moved
    to the caller's; the gradients are the same bits. The kept tensors are saved with
    save_for_backward (saved-tensor hooks such as activation checkpointing or CPU offloading see them);
    their sizes and flags ride on the autograd context as Python values, which torch.compile cannot
    trace: under compilation the custom ops above run instead (and the backward recomputes them).
    Differentiable once, as the custom ops (a double backward raises).

    apply(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, plan, backend=None)
        -> (o, final_state or an empty [0] tensor), as `gdn_fwd`'s arguments and first two outputs;
        plan: the call's `CallPlan`; backend: None (the sm_90 kernels) or a
        `flashqla.ops.gdn.backend.Backend`."""

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, plan, backend=None):
        f = forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, plan=plan, backend=backend)
        kept = f.cp_saved
        # the kept tensors go through save_for_backward too, so that saved-tensor hooks see them
        # (activation checkpointing drops and regenerates them, offloading moves them); with them
        # f.A and f.g_cum_log2 are None (A and g_cum_log2 are kept's, in the segments' layout)
        extra = () if kept is None else (kept.S_in, kept.P, kept.U, kept.limit, kept.A, kept.g_cum_log2)
        A, G = (f.A, f.g_cum_log2) if kept is not None or keeps_products(q, cu_seqlens) else (None, None)
        ctx.save_for_backward(q, k, v, g, beta, A, G, initial_state, cu_seqlens, *extra)
        ctx.scale, ctx.output_final_state, ctx.plan, ctx.backend = scale, output_final_state, plan.backward, backend
        ctx.kept_meta = None if kept is None else kept[:6]  # the CPSaved fields before the tensors
        # the caller's offsets, not through the hooks: whether they are unmodified since this forward
        ctx.cu_ref = None if kept is None or cu_seqlens is None else weakref.ref(cu_seqlens)
        final_state = f.final_state if f.final_state is not None else q.new_empty(_EMPTY_SHAPE, dtype=torch.float32)
        return f.o, final_state

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(ctx, do, dht):
        q, k, v, g, beta, A, g_cum_log2, initial_state, cu_seqlens, *extra = ctx.saved_tensors
        do, dht = _cotangents(ctx, q, v, do, dht)
        saved = None
        if ctx.kept_meta is not None:
            meta = ctx.kept_meta
            orig = ctx.cu_ref() if ctx.cu_ref is not None else None
            if orig is not None and orig is not cu_seqlens and cu_key(orig) == meta[5]:
                # a saved-tensor hook (CPU offloading) handed back a copy of offsets the caller has not
                # modified since the forward: its values are the forward's, so the kept states apply
                # to it (the driver otherwise tells them apart by storage and version, and recomputes)
                meta = (*meta[:5], cu_key(cu_seqlens))
            saved = CPSaved(*meta, *extra)
        need = _need_dh0(ctx, initial_state)
        grads = backward(q, k, v, g, beta, A, g_cum_log2, do.contiguous(), dht, ctx.scale, initial_state, cu_seqlens,
                         cp_saved=saved, need_dh0=need, plan=ctx.plan, backend=ctx.backend)
        return _input_grads(g, need, *grads)[:9] + (None, None)  # plan, backend

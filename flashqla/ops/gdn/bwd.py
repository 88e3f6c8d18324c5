"""The backward driver: `chunk_gated_delta_rule_bwd`, the gradients of `chunk_gated_delta_rule` from the
forward's products, unsplit (three passes, four launches) or split over segments
(`flashqla.cp.backward.cp_backward`).

Unsplit launches (kernels in `flashqla.ops.gdn.kernels.sm90`; reference `reference.gdn.fused_bwd`):
    1. states_bwd.chunk_states_bwd  h, the chunk-start states, recomputed from the forward's
                                     A diag(beta) and g_cum_log2 (stored in q's dtype, bf16 or fp16)
    2. chunk_bwd.chunk_fused_bwd    per (sequence, value head), chunks in reverse: dS in registers,
                                     dq/dk per value head, dv, dbeta, dG per slot row, dh0
    3. finish_bwd.chunk_finish_bwd  reverse chunk-local cumsum of dG -> dg; GVA sum of dq, dk
(3 is two small kernels.) bf16 and fp16 inputs run the same kernels, h in q's dtype.
No host synchronisation: every size comes from shapes.
"""

from __future__ import annotations

import torch

from flashqla.contract import (G_FLOOR, check_backend, check_device, check_gdn_inputs, check_supported, clamp_gates, cp_mode, dense,
                               resolve_truncate)
from flashqla.cp.backward import cp_backward
from flashqla.cp.forward import flat
from flashqla.cp.plan import CPPlan, plan_for
from flashqla.cp.saved import CPSaved, check_products, saved_applies, saved_products_in_sequence_slots
from flashqla.cp.segments import sequence_slots_to_segment_slots, split_tables
from flashqla.ops.gdn.backend import default_backend

__all__ = ["backward", "chunk_gated_delta_rule_bwd"]


def chunk_gated_delta_rule_bwd(
    q, k, v, g, beta, A, g_cum_log2, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
    *, cp: str | bool | None = None, max_seqlen: int | None = None, seqlens: tuple[int, ...] | None = None,
    cp_saved: CPSaved | None = None, need_dh0: bool = True, segment_len: int | None = None, truncate=None,
    block_v: int | None = None, sm_count: int | None = None, backend=None, plan: CPPlan | None = None,
):
    """Gradients of `chunk_gated_delta_rule` from the forward's products.

    Args:
        q, k: [B, T, H, K] as the forward used them (`ChunkGDNForward.q`, `.k`: after any L2 norm;
            the gradient through the L2 norm is not applied here); v: [B, T, HV, V]; g, beta:
            [B, T, HV] (g fp32, beta fp32 or q's dtype); A, g_cum_log2: `ChunkGDNForward.A`,
            `.g_cum_log2` (A [HV, S * 64, 64] in q's dtype, g_cum_log2 [HV, S * 64] fp32, the
            caller's slot layout), or both None with the cp_saved of a forward that kept its states
            (they travel in it, in its segments' layout), or both None without cp_saved: recomputed
            here (one prepare launch; what the op's autograd does when the forward did not keep them,
            `flashqla.ops.gdn.autograd.keeps_products`); do: [B, T, HV, V] in q's dtype; dht: None
            or [N, HV, K, V] fp32; scale: the forward's (default K ** -0.5); initial_state: None or
            [N, HV, K, V] fp32 (only decides whether dh0 is returned); cu_seqlens: None or [N + 1].
        cp: context-parallel mode as in the forward (`flashqla.contract.cp_mode`; None reads
            $FLASHQLA_CP, default "auto"): "auto"/"on" split long sequences, planned with the
            backward's costs (`flashqla.cp.plan.plan_cp(backward=True)`).
        max_seqlen, seqlens: the planner's host-side hints (`flashqla.contract.planning_max_seqlen`,
            `.planning_seqlens`); they change the plan, never the results. Pass what the forward got,
            so that its kept states (cp_saved) match this plan.
        cp_saved: the forward's `ChunkGDNForward.cp_saved` (`chunk_gated_delta_rule_fwd(keep_cp_states=True)`)
            or None; a split backward whose segments match uses it instead of recomputing the
            forward's run, transitions and combine scan (the same values). Like A and g_cum_log2 it
            must come from the forward of these inputs: what can be checked without reading values
            is (segments, sizes, cut, initial state given or not, the same unmodified cu_seqlens);
            on a mismatch there it is ignored. With A None its A and g_cum_log2 are read as they
            are by a split backward it matches, else moved to the caller's layout first.
        need_dh0: False when the caller will not use dh0 (autograd: an initial_state that does not
            require grad): dh0 is then None, and pass 2 takes the build without
            `chunk_bwd.DH0_OPTS` (the other gradients keep a no-initial-state call's accuracy).
        segment_len, truncate, block_v, sm_count, backend: as `chunk_gated_delta_rule_fwd`.
        plan: the backward's `CPPlan` when the caller made it (`flashqla.cp.plan.plan_call`); None
            plans here (the options above).

    Returns:
        (dq [B, T, H, K] q's dtype, dk [B, T, H, K] q's dtype, dv [B, T, HV, V] v's dtype,
        dg [B, T, HV] fp32, dbeta [B, T, HV] beta's dtype, dh0 [N, HV, K, V] fp32, or None without
        initial_state or with need_dh0=False). FLA's dtypes. Gradients of tokens past
        cu_seqlens[-1] are zero.

    Raises:
        TypeError, ValueError, RuntimeError: as `flashqla.chunk_gated_delta_rule` for q, k, v, g, beta,
        scale, initial_state, cu_seqlens (arguments, and without a backend the fast path's dtypes and
        head dims and a Hopper GPU); do not of v's shape or not floating point; dht not None or
        [N, HV, K, V] (naming the argument).
        TypeError: cp_saved neither None nor a `CPSaved`; need_dh0 not a bool; backend neither None nor a
        `Backend` instance with prepare, recurrent, zeros and bwd (`contract.check_backend`). ValueError: an unknown
        cp mode or truncate, a bad segment_len; exactly one of A, g_cum_log2 None (naming it); A or
        g_cum_log2 not of these inputs' slot count (naming it); an fp16 A with bf16 q (a
        `for_backward=False` forward's, naming A);
        A None with a cp_saved kept by a forward of other sizes.

    Source: `reference.gdn.fused_bwd.fused_gated_delta_rule_bwd` (records BWD-*).
    """
    d = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, False, cu_seqlens)
    if not isinstance(need_dh0, bool):
        raise TypeError(f"need_dh0 must be a bool, got {type(need_dh0).__name__}")
    check_products(A, g_cum_log2, cp_saved, q, v, cu_seqlens)  # cp_saved's type too
    if not isinstance(do, torch.Tensor) or tuple(do.shape) != tuple(v.shape) or not do.dtype.is_floating_point:
        raise ValueError(f"do must be a floating-point tensor of v's shape {tuple(v.shape)}, got "
                         f"{getattr(do, 'dtype', type(do).__name__)} {tuple(getattr(do, 'shape', ()))}")
    if dht is not None and (not isinstance(dht, torch.Tensor) or tuple(dht.shape) != (d.N, d.HV, d.K, d.V)):
        raise ValueError(f"dht must be None or [N, HV, K, V] = {(d.N, d.HV, d.K, d.V)}, got "
                         f"{tuple(getattr(dht, 'shape', ())) or type(dht).__name__}")
    if do.device != q.device or (dht is not None and dht.device != q.device):
        raise ValueError(f"do and dht must be on q's device {q.device}")
    cp_mode(cp)  # a bad cp is named before the device is
    check_backend(backend, ("prepare", "recurrent", "zeros", "bwd"))
    if backend is None:
        check_supported(q, k, v, g, beta, initial_state)
        check_device(q)
    return backward(q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens, cp=cp,
                    max_seqlen=max_seqlen, seqlens=seqlens, cp_saved=cp_saved, need_dh0=need_dh0,
                    segment_len=segment_len, truncate=truncate, block_v=block_v, sm_count=sm_count, backend=backend,
                    plan=plan)


def backward(
    q, k, v, g, beta, A, g_cum_log2, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
    *, cp: str | bool | None = None, max_seqlen: int | None = None, seqlens: tuple[int, ...] | None = None,
    cp_saved: CPSaved | None = None, need_dh0: bool = True, segment_len: int | None = None, truncate=None,
    block_v: int | None = None, sm_count: int | None = None, backend=None, plan: CPPlan | None = None,
):
    """`chunk_gated_delta_rule_bwd` on inputs and products a forward of this package made (the op's
    autograd): its arguments and returns, without its checks (truncate is still resolved). The launches
    get g clamped at `flashqla.contract.G_FLOOR` (as the forward's) and dg is 0 where g < G_FLOOR
    (two elementwise passes over [B, T, HV])."""
    dq, dk, dv, dg, dbeta, dh0 = _backward(q, k, v, clamp_gates(g), beta, A, g_cum_log2, do, dht, scale, initial_state,
                                           cu_seqlens, cp=cp, max_seqlen=max_seqlen, seqlens=seqlens, cp_saved=cp_saved,
                                           need_dh0=need_dh0, segment_len=segment_len, truncate=truncate,
                                           block_v=block_v, sm_count=sm_count, backend=backend, plan=plan)
    dg = torch.where(g < G_FLOOR, torch.zeros((), dtype=dg.dtype, device=dg.device), dg)
    return dq, dk, dv, dg, dbeta, dh0


def _backward(q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens, *, cp, max_seqlen, seqlens,
              cp_saved, need_dh0, segment_len, truncate, block_v, sm_count, backend, plan):
    cutoff = resolve_truncate(truncate)  # checked on every path, split or not
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    backend = default_backend() if backend is None else backend
    if plan is None:
        mode = cp_mode(cp)
        plan = plan_for(q, v, cu_seqlens, sm_count_override=sm_count, force=mode == "on", disable=mode == "off",
                        exact=True, segment_len=segment_len, max_seqlen=max_seqlen, backward=True, seqlens=seqlens)
    B, T, HV = q.shape[0], q.shape[1], v.shape[2]
    # the kernels take compact arrays: autograd hands over dht as the caller's view (ht.sum() gives a
    # stride-0 one), and initial_state / cu_seqlens are the caller's tensors
    q, k, v, g, beta, do = (dense(x) for x in (q, k, v, g, beta, do))  # contiguous, 16-byte aligned
    dht, initial_state, cu_seqlens = (None if x is None else dense(x) for x in (dht, initial_state, cu_seqlens))
    A, g_cum_log2 = (None if x is None else dense(x) for x in (A, g_cum_log2))  # read by the copy engine too
    if A is None and cp_saved is None:  # not kept by the forward (`keeps_products`): recomputed here
        A, g_cum_log2 = backend.prepare(k, g, beta, cu_seqlens, HV)
    if not plan.split:
        if A is None:  # the kept forward's products, moved from its segments' layout to the caller's
            A, g_cum_log2 = saved_products_in_sequence_slots(cp_saved, cu_seqlens, B, T, HV)
        *grads, dh0 = backend.bwd(q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens,
                                  dh0=initial_state is not None and need_dh0)
        return (*grads, dh0 if need_dh0 else None)
    tables, static_key = split_tables(cu_seqlens, plan.segment_len, B, T, q.device)
    if A is None and saved_applies(cp_saved, tables, B * T, HV, cutoff, initial_state is not None, cu_seqlens):
        A_p, G_p = cp_saved.A, cp_saved.g_cum_log2  # already in these segments' layout
    else:
        if A is None:
            A, g_cum_log2 = saved_products_in_sequence_slots(cp_saved, cu_seqlens, B, T, HV)
        A_p, G_p = sequence_slots_to_segment_slots(A, g_cum_log2, tables, cu_seqlens, B, T)
    BV = block_v or plan.BV
    if hasattr(backend, "warm"):
        backend.warm(flat(k), flat(beta), flat(q), flat(v), tables.cu_seqlens, HV, BV, dual=q.shape[-1] == v.shape[-1])
    return cp_backward(backend, q, k, v, g, beta, A_p, G_p, do, dht, scale, initial_state, cu_seqlens, tables,
                       block_v=BV, static_key=static_key, truncate=False if cutoff is None else cutoff,
                       saved=cp_saved, longest_first=plan.longest_first, need_dh0=need_dh0)

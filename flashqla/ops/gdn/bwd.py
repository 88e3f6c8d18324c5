"""The chunked Gated DeltaNet backward on Hopper in three passes (four launches).

Checked on the H200 against the fp64 reference (`tests/gpu/test_bwd_gpu.py`; NOTES-bwd.md has the
measured errors). `flashqla.chunk_gated_delta_rule` runs it through autograd.

Launches (kernels in `flashqla.ops.gdn.kernels.sm90`; reference `reference.gdn.fused_bwd`):
    1. states_bwd.chunk_states_bwd  h, the chunk-start states, recomputed from the forward's
                                     A diag(beta) and g_cum_log2 (bf16 by default)
    2. chunk_bwd.chunk_fused_bwd    per (sequence, value head), chunks in reverse: dS in registers,
                                     dq/dk per value head, dv, dbeta, dG per slot row, dh0
    3. finish_bwd.chunk_finish_bwd  reverse chunk-local cumsum dG -> dg; GVA sum of dq, dk
(3 is two small kernels.) No host synchronisation: every size comes from shapes.
"""

import torch

__all__ = ["chunk_gated_delta_rule_bwd"]

_BUILT: set = set()


def chunk_gated_delta_rule_bwd(
    q, k, v, g, beta, A, g_cum_log2, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
    *, h_dtype: torch.dtype = torch.bfloat16, cp: str | None = None, max_seqlen: int | None = None,
    cp_saved=None, seqlens: tuple[int, ...] | None = None, need_dh0: bool = True,
):
    """Gradients of `chunk_gated_delta_rule` from the forward's products.

    Args:
        q, k: [B, T, H, K] as the forward used them (`ChunkGDNForward.q`, `.k`: after any L2 norm;
            the gradient through the L2 norm is not applied here); v: [B, T, HV, V]; g, beta:
            [B, T, HV] (g fp32, beta fp32 or q's dtype); A, g_cum_log2: `ChunkGDNForward.A`,
            `.g_cum_log2` (A [HV, S * 64, 64] in q's dtype, g_cum_log2 [HV, S * 64] fp32, the
            caller's slot layout), or both None with the cp_saved of a forward that kept its states
            (they travel in it, in its segments' layout); do: [B, T, HV, V] in q's dtype; dht: None
            or [N, HV, K, V] fp32; scale: the forward's (default K ** -0.5); initial_state: None or [N, HV, K, V] fp32 (only
            decides whether dh0 is returned); cu_seqlens: None or [N + 1] offsets.
        h_dtype: storage dtype of the recomputed states (bf16 or fp32).
        cp: context-parallel mode as in the forward (`flashqla.ops.gdn.api.cp_mode`; None reads
            $FLASHQLA_CP, default "auto"): "auto"/"on" split long sequences
            (`flashqla.cp.driver.chunk_gated_delta_rule_cp_bwd`, planned with the backward's costs;
            checked against fp64 on the H200, tests/gpu/test_cp_gpu.py).
        max_seqlen: the planner's host-side bound on the longest sequence (None: balanced lengths
            assumed; `flashqla.validation.planning_max_seqlen`); it changes the plan, never the results.
        seqlens: the host-side lengths of the sequences (a tuple; `flashqla.validation.planning_seqlens`),
            on which a packed batch's plan is costed; the same rule. Pass what the forward got, so that
            its kept states (cp_saved) match this plan.
        need_dh0: False when the caller will not use dh0 (autograd: an initial_state that does not
            require grad): dh0 is then None, and pass 2 takes the build without `chunk_bwd_v5.DH0_OPTS`
            (NOTES-bwd.md, "dh0 at long T"). The other gradients then have the accuracy of a call
            without an initial state: the option reaches them only through the state gradient's bf16
            copy (on one H200 case without it, dk, dv and dbeta errors were 1.04-1.08x, dg 1.36x).
        cp_saved: the forward's `ChunkGDNForward.cp_saved` (`chunk_gated_delta_rule_fwd(keep_cp_states=True)`)
            or None; a split backward whose segments match uses it instead of recomputing the
            forward's run, transitions and combine scan (the same values). Like A and g_cum_log2 it
            must come from the forward of these inputs: what can be checked without reading values
            is (segments, sizes, cut, initial state given or not, the same unmodified cu_seqlens);
            on a mismatch there it is ignored. With A None its A and g_cum_log2 are read as they
            are by a split backward it matches, else moved to the caller's layout first
            (`flashqla.cp.driver.saved_products_in_sequence_slots`: an unsplit backward, cp="off",
            another plan).

    Returns:
        (dq [B, T, H, K] q's dtype, dk [B, T, H, K] q's dtype, dv [B, T, HV, V] v's dtype,
        dg [B, T, HV] fp32, dbeta [B, T, HV] beta's dtype, dh0 [N, HV, K, V] fp32, or None without
        initial_state or with need_dh0=False).
        FLA's dtypes. Gradients of tokens past cu_seqlens[-1] are zero.

    Raises:
        TypeError: cp_saved neither None nor a `CPSaved`; need_dh0 not a bool. ValueError: an unknown cp mode; exactly one
        of A, g_cum_log2 None (naming it); A None without cp_saved (naming A); A or g_cum_log2 not
        of these inputs' slot count (naming it: e.g. a kept forward's `CPSaved.A`, whose layout is
        its segments'); A None with a cp_saved kept by a forward of other sizes.

    Source: `reference.gdn.fused_bwd.fused_gated_delta_rule_bwd` (records BWD-*, NOTES-bwd.md).
    """
    from flashqla.ops.gdn.kernels.sm90._common import launch_order
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_fused_bwd
    from flashqla.ops.gdn.kernels.sm90.finish_bwd import chunk_finish_bwd
    from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd

    from flashqla.ops.gdn.api import cp_mode

    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    if not isinstance(need_dh0, bool):
        raise TypeError(f"need_dh0 must be a bool, got {type(need_dh0).__name__}")
    dh0_out = initial_state is not None and need_dh0  # the caller uses dh0
    cp = cp_mode(cp)
    from flashqla.cp.driver import _check_products

    _check_products(A, g_cum_log2, cp_saved, q, v, cu_seqlens)  # cp_saved's type too
    if cp != "off":
        from flashqla.cp.driver import chunk_gated_delta_rule_cp_bwd, cp_splits

        if cp_splits(q, v, cu_seqlens, cp, backward=True, max_seqlen=max_seqlen, seqlens=seqlens):
            return chunk_gated_delta_rule_cp_bwd(q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens,
                                                 cp=cp, max_seqlen=max_seqlen, cp_saved=cp_saved, seqlens=seqlens,
                                                 need_dh0=need_dh0)
    if A is None:  # the kept forward's products, moved from its segments' layout to the caller's
        from flashqla.cp.driver import saved_products_in_sequence_slots

        A, g_cum_log2 = saved_products_in_sequence_slots(cp_saved, cu_seqlens, q.shape[0], q.shape[1], v.shape[2])
    _build_once(q, v, beta, cu_seqlens, h_dtype, dh0_out)
    q, k, v, beta, do = (x.contiguous() for x in (q, k, v, beta, do))
    # the kernels take compact arrays: autograd hands over dht as the caller's view (ht.sum() gives a
    # stride-0 one), and initial_state / cu_seqlens are the caller's tensors
    dht, initial_state, cu_seqlens = (None if x is None else x.contiguous() for x in (dht, initial_state, cu_seqlens))
    order = launch_order(cu_seqlens)  # token order unless FLASHQLA_BWD_ORDER=longest (the same results)
    h = chunk_states_bwd(k, v, A, g_cum_log2, initial_state, cu_seqlens, h_dtype, order=order)
    dq_hv, dk_hv, dv, dbeta, dG, dh0 = chunk_fused_bwd(q, k, v, beta, A, g_cum_log2, h, do, dht, scale, cu_seqlens,
                                                       order=order, dh0=dh0_out)
    dq, dk, dg = chunk_finish_bwd(dG, dq_hv, dk_hv, cu_seqlens, q.shape[2], q.dtype)
    if do.dtype != q.dtype:
        do = do.to(q.dtype)
    del g  # the forward kernels do not floor g (unlike the reference op), so neither does dg
    return dq, dk, dv, dg, dbeta.to(beta.dtype), (dh0 if dh0_out else None)


def _build_once(q, v, beta, cu_seqlens, h_dtype, dh0: bool = True) -> None:
    """First use of a configuration: compile concurrently what `op_kernel_specs` lists after the
    forward's two kernels, passes 1-3 only on these offsets, pass 2 for a call returning dh0 or not
    (each later launch finds them in the builders' caches)."""
    from flashqla.ops.gdn.kernels.sm90 import build_kernels, op_kernel_specs
    from flashqla.ops.gdn.kernels.sm90._common import tl_dtype

    if q.shape[0] * q.shape[1] == 0:
        return
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import DEFAULT_VARIANT

    key = (q.shape[2], v.shape[2], q.shape[3], v.shape[3], q.dtype, beta.dtype, h_dtype,
           None if cu_seqlens is None else cu_seqlens.dtype, DEFAULT_VARIANT, bool(dh0))
    if key in _BUILT:
        return
    specs = op_kernel_specs(
        q.shape[2], v.shape[2], K=q.shape[3], V=v.shape[3], dtype=tl_dtype(q.dtype), beta_dtype=tl_dtype(beta.dtype),
        seq_dtype=tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32", varlen=cu_seqlens is not None,
        h_dtype=tl_dtype(h_dtype), segments_first_use=False, one_head_prepare=False, dh0=bool(dh0),
    )[2:]
    # passes 1-3 on this call's offsets only (listed first); their builds on the segments' packed
    # offsets are left to the split path's first use
    direct, seen = [], set()
    for kind, args in specs:
        if kind in ("states_bwd", "chunk_bwd", "dg_cumsum"):
            if kind in seen:
                continue
            seen.add(kind)
        direct.append((kind, args))
    build_kernels(direct)
    _BUILT.add(key)

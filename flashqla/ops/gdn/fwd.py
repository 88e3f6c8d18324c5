"""The forward driver: `chunk_gated_delta_rule_fwd` (validate, plan, run) and `forward` (run a plan on
validated inputs; what the op's autograd and custom ops call).

Unsplit: two launches of the backend, prepare (chunk-local cumsum of g, K K^T, the gated WY inverse
A diag(beta)) and recurrent (the state recurrence and the output, the state on chip). Split (the plan's
`split`): the sequences cut into segments run side by side and stitched exactly
(`flashqla.cp.forward.cp_forward`; derivations CP-1..CP-5).

The A_beta product's precision (`product_dtype`), opt-in (`Sm90Backend(fp16_products=True)`, or
`default_backend().fp16_products = True` for the public op): a forward without gradients
(`training=False`, by default `for_backward=False`: the public op without inputs that require grad
or under `torch.no_grad()`, the serving paths) on bf16 input stores A diag(beta) in fp16 and forms
v_new = A_beta W and O += Pg v_new from fp16 operands (W's rows scaled by powers of two into fp16's
range; record RW-7), 3 more mantissa bits where the forward's error comes from
(`reference.gdn.numerics.forward_rounding_model`); a training forward keeps A in bf16, the dtype
the backward's kernels read (and recompute it in). fp16 input is fp16 throughout either way. The
split path across GPUs (`flashqla.distributed`) stays on q's dtype.
"""

from __future__ import annotations

import torch

from flashqla.contract import (CHUNK, ChunkGDNForward, check_backend, check_device, check_gdn_inputs, check_supported, clamp_gates, cp_mode, dense,
                               l2norm, positive_int, resolve_truncate)
from flashqla.cp.forward import CORRECTIONS, cp_forward, flat
from flashqla.cp.plan import CallPlan, plan_call
from flashqla.cp.segments import segment_slots_to_sequence_slots, split_tables
from flashqla.ops.gdn.backend import Sm90Backend, default_backend
from flashqla.ops.gdn.kernels.sm90._common import num_slots
from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v

__all__ = ["chunk_gated_delta_rule_fwd", "forward", "product_dtype"]


def product_dtype(q: torch.Tensor, training: bool, backend) -> torch.dtype | None:
    """The dtype the prepare launch stores A diag(beta) in (the recurrent launches follow it): fp16
    for bf16 q on a backend whose `fp16_products` is True (`Sm90Backend(fp16_products=True)`; off by
    default) in a forward without gradients, else None (q's dtype; always for a training forward,
    whose A the backward's kernels read, or recompute, in q's dtype)."""
    if training or q.dtype != torch.bfloat16 or not getattr(backend, "fp16_products", False):
        return None
    return torch.float16


def chunk_gated_delta_rule_fwd(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
    *,
    cp: str | bool | None = None,
    for_backward: bool = True,
    keep_cp_states: bool = False,
    max_seqlen: int | None = None,
    seqlens: tuple[int, ...] | None = None,
    segment_len: int | None = None,
    gate_chunks: int | None = None,
    truncate=None,
    correction: str = "gemm",
    block_v: int | None = None,
    sm_count: int | None = None,
    backend=None,
    poison_outputs: bool = False,
    return_info: bool = False,
):
    """Forward of `chunk_gated_delta_rule` returning what a backward needs (`ChunkGDNForward`), with
    every option of the split path. No autograd.

    Args:
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm_in_kernel: as `flashqla.chunk_gated_delta_rule` (q, k [B, T, H, K] bf16/fp16; v
            [B, T, HV, V]; g [B, T, HV] fp32 natural log; beta [B, T, HV] fp32 or q's dtype;
            initial_state [N, HV, K, V] fp32; cu_seqlens [N + 1] int32/int64 with B == 1).
        cp: intra-device context parallelism: "auto" (the planner decides), "on" (always split), "off"
            (never), True / False; None reads $FLASHQLA_CP, default "auto" (`flashqla.contract.cp_mode`).
        for_backward: False (inference) lets a split forward skip moving A and g_cum_log2 back to the
            caller's slot layout (a gather of both): they are then returned as None. With a backend
            whose fp16_products is on it also picks the fp16 A_beta product for bf16 input
            (`product_dtype`; an unsplit forward then returns A in fp16, which
            `chunk_gated_delta_rule_bwd` refuses).
        keep_cp_states: training, with for_backward: when the backward's plan splits these inputs, the
            forward splits the same way and keeps its segments' entering states, transitions and U
            rows (`ChunkGDNForward.cp_saved`, `flashqla.cp.saved.CPSaved`) for
            `chunk_gated_delta_rule_bwd(cp_saved=...)`, which then skips recomputing them. A and
            g_cum_log2 are then returned as None: they travel in cp_saved in the segments' slot layout;
            pass the backward `f.A, f.g_cum_log2` (None) with `f.cp_saved`. Memory kept: about 64 KB
            per segment slot and value head twice (S_in, P) plus 256 B per token and value head (U,
            bf16); A and g_cum_log2 take the place of the caller-layout ones.
        max_seqlen: host-side bound on the longest sequence, the planner's hint
            (`flashqla.contract.planning_max_seqlen`); it changes the plan, never the results.
        seqlens: the host-side lengths of the sequences (a tuple; `flashqla.contract.planning_seqlens`),
            on which the backward's plan is costed when keep_cp_states (pass the backward the same).
        segment_len: fix the segment length L (a positive multiple of 64) when splitting.
        gate_chunks: None (exact) or m >= 1: the gate-driven mode (`flashqla.cp.forward`; opt-in, not
            exact on heads whose gates do not decay within m chunks).
        truncate: the gate-driven cut of each (segment, value head) transition
            (`flashqla.contract.resolve_truncate`): None ($FLASHQLA_CP_EXACT=1: exact; else at
            ln 2^-24), False (exact), True, or a negative natural-log decay.
        correction: "gemm" (default) or "rerun" (exact mode's output correction).
        block_v: value-slice width of the recurrent launches (64 or 128; None: the plan's).
        sm_count: SMs assumed by the planner (None: the device's).
        backend: None (the sm_90 kernels; inputs checked for the fast path and a Hopper GPU) or a
            `flashqla.ops.gdn.backend.Backend` (e.g. `reference.gdn.cp.ReferenceCPBackend()`: any device
            and dtype).
        poison_outputs: testing aid: fill every output with NaN before the launches, so that an
            element a kernel fails to write shows up.
        return_info: also return a `flashqla.cp.forward.CPInfo` (None when not split).

    Returns:
        `ChunkGDNForward(o, final_state, A, g_cum_log2, q, k, cp_saved)`, and the `CPInfo` when
        return_info.

    Raises:
        TypeError, ValueError: as `flashqla.chunk_gated_delta_rule` (argument checks, the fast path's
            dtypes and head dims), an unknown cp mode, correction or truncate, a bad segment_len or
            gate_chunks, non-bool flags; TypeError: backend neither None nor a `Backend` instance
            (`contract.check_backend`). RuntimeError: not on a Hopper GPU (without a backend).
    """
    d = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    for name, flag in (("use_qk_l2norm_in_kernel", use_qk_l2norm_in_kernel), ("for_backward", for_backward),
                       ("keep_cp_states", keep_cp_states), ("poison_outputs", poison_outputs), ("return_info", return_info)):
        if not isinstance(flag, bool):
            raise TypeError(f"{name} must be a bool, got {type(flag).__name__}")
    if correction not in CORRECTIONS:
        raise ValueError(f"correction must be one of {CORRECTIONS}, got {correction!r}")
    gate_chunks = positive_int(gate_chunks, "gate_chunks", 1)
    resolve_truncate(truncate)  # checked on every path, split or not
    cp_mode(cp)  # a bad cp is named before the device is
    check_backend(backend)
    if backend is None:
        check_supported(q, k, v, g, beta, initial_state)
        check_device(q)
    scale = d.K**-0.5 if scale is None else float(scale)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    keep = keep_cp_states and for_backward
    plan = plan_call(q, v, cu_seqlens, cp, training=keep, keep_states=keep, max_seqlen=max_seqlen, seqlens=seqlens,
                     segment_len=segment_len, gate_chunks=gate_chunks, sm_count_override=sm_count)
    return forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, plan=plan, backend=backend,
                   for_backward=for_backward, block_v=block_v, gate_chunks=gate_chunks, correction=correction,
                   truncate=truncate, poison_outputs=poison_outputs, return_info=return_info)


def forward(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens, *, plan: CallPlan,
            backend=None, for_backward: bool = True, block_v: int | None = None, gate_chunks: int | None = None,
            correction: str = "gemm", truncate=None, poison_outputs: bool = False, return_info: bool = False,
            checkpoint_positions=None, training: bool | None = None):
    """Runs `plan` (`flashqla.cp.plan.plan_call`) on validated inputs (q and k after any L2 norm; scale
    a float): the arguments and returns of `chunk_gated_delta_rule_fwd`, without its checks. With
    `plan.keep` the forward keeps its split states (`ChunkGDNForward.cp_saved`). g is clamped at
    `flashqla.contract.G_FLOOR` first (`clamp_gates`: one elementwise pass over [B, T, HV] fp32).
    training (None: for_backward): whether this is a training forward, which decides the A_beta
    product's dtype (`product_dtype`); a training forward whose backward recomputes A passes
    for_backward=False with training=True.

    checkpoint_positions (split plans in exact mode only; validated by the caller: sorted global
    offsets, each inside a sequence): the states after those tokens come back as the info's
    `checkpoints`, a `flashqla.cp.forward.CheckpointParts` (`cp_forward`; return_info must be True; that info's S_in is then None: its masked
    copy is not made). ValueError on an unsplit plan, with
    gate_chunks, or without return_info."""
    if checkpoint_positions is not None and (not plan.forward.split or gate_chunks is not None or not return_info):
        raise ValueError("checkpoint_positions: a split plan in exact mode, with return_info=True")
    backend = default_backend() if backend is None else backend
    a_dtype = product_dtype(q, for_backward if training is None else training, backend)
    q, k, v, beta = (dense(x) for x in (q, k, v, beta))  # contiguous, 16-byte aligned
    g = dense(clamp_gates(g))  # the one gate floor of every path (`flashqla.contract.G_FLOOR`)
    initial_state = None if initial_state is None else dense(initial_state)
    cu_seqlens = None if cu_seqlens is None else dense(cu_seqlens)
    B, T, HV, V = v.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    p = plan.forward
    if not p.split:
        out = _unsplit(backend, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                       block_v or p.BV, poison_outputs, N, plan.ends_at_T, a_dtype)
        return (out, None) if return_info else out
    cutoff = resolve_truncate(truncate)
    BV = block_v or p.BV
    tables, static_key = split_tables(cu_seqlens, p.segment_len, B, T, q.device)
    if hasattr(backend, "warm"):
        backend.warm(flat(k), flat(beta), flat(q), flat(v), tables.cu_seqlens, HV, BV,
                     dual=gate_chunks is None and (correction != "rerun" or checkpoint_positions is not None)
                     and q.shape[-1] == V, checkpoints=checkpoint_positions is not None,
                     **({} if a_dtype is None else {"a_dtype": a_dtype}))
    o, final, A, G2, info = cp_forward(backend, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                       tables, block_v=BV, gate_chunks=gate_chunks, correction=correction,
                                       poison_outputs=poison_outputs, want_info=return_info and checkpoint_positions is None, static_key=static_key,
                                       truncate=False if cutoff is None else cutoff, keep_for_backward=plan.keep,
                                       ends_at_T=plan.ends_at_T, checkpoint_positions=checkpoint_positions,
                                       a_dtype=a_dtype)
    if plan.keep:  # the products travel in the CPSaved, in the segments' layout (what the backward reads)
        A, G2 = None, None
    elif for_backward:
        A, G2 = segment_slots_to_sequence_slots(A, G2, tables, cu_seqlens, B, T)
    else:
        A, G2 = None, None
    out = ChunkGDNForward(o=o, final_state=final, A=A, g_cum_log2=G2, q=q, k=k,
                          cp_saved=info.saved if plan.keep and info is not None else None)
    return (out, info._replace(plan=p)) if return_info else out


def _unsplit(backend, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, block_v, poison, N,
             ends_at_T: bool = False, a_dtype=None):
    """The two launches of the unsplit forward through the backend; with `poison`, into outputs filled
    with NaN first (A, g_cum_log2, o and the final state on the sm_90 backend, o elsewhere). With
    `ends_at_T` (`CallPlan.ends_at_T`) o is allocated uninitialised: every row belongs to a sequence;
    otherwise the launcher zero-fills packed o (device offsets might end before T). a_dtype: A's
    dtype (`product_dtype`; None: k's)."""
    B, T, HV, V = v.shape
    if hasattr(backend, "warm") and B * T > 0 and N > 0:
        block_v = block_v or pick_block_v(N, HV, V)
        backend.warm(k, beta, q, v, cu_seqlens, HV, block_v, **({} if a_dtype is None else {"a_dtype": a_dtype}))
    pre, rec = ({} if a_dtype is None else {"a_dtype": a_dtype}), {}
    if poison:
        nan = float("nan")
        rec["o"] = torch.full_like(v, nan)
        if isinstance(backend, Sm90Backend):
            S = num_slots(B, T, N, cu_seqlens is not None)
            pre["A"] = torch.full((HV, S * CHUNK, CHUNK), nan, dtype=a_dtype or k.dtype, device=k.device)
            pre["g_cum_log2"] = torch.full((HV, S * CHUNK), nan, dtype=torch.float32, device=k.device)
            if output_final_state:
                rec["final_state"] = torch.full((N, HV, q.shape[-1], V), nan, dtype=torch.float32, device=k.device)
    elif ends_at_T and cu_seqlens is not None:
        rec["o"] = torch.empty_like(v)
    A, G2 = backend.prepare(k, g, beta, cu_seqlens, HV, **pre)
    h0 = None if initial_state is None else initial_state.to(backend.state_dtype)
    o, final = backend.recurrent(q, k, v, A, G2, scale, h0, output_final_state, cu_seqlens, block_v, **rec)
    return ChunkGDNForward(o=o, final_state=final, A=A, g_cum_log2=G2, q=q, k=k)

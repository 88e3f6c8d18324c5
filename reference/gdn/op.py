"""The reference public op: FLA's chunked Gated DeltaNet prefill with its hand-written backward.

`chunk_gated_delta_rule` has FLA's signature and return convention; forward and backward are the
per-step functions of `reference.gdn.chunk` and `reference.gdn.chunk_bwd`, wired into autograd by
`ChunkGatedDeltaRuleFunction` (no autograd through the chunked math itself).
"""

from __future__ import annotations

import torch

from flashqla.contract import check_gdn_inputs
from flashqla.serving import check_serving_args, gather_initial_states, serving_requested, write_back
from .chunk import G_FLOOR, check_chunk_size, chunk_checkpoint_states, chunk_gated_delta_rule_fwd
from .chunk_bwd import chunk_gated_delta_rule_bwd
from .recurrent import L2NORM_EPS, compute_dtype, l2norm

__all__ = ["chunk_gated_delta_rule", "ChunkGatedDeltaRuleFunction", "l2norm_fwd", "l2norm_bwd"]


def l2norm_fwd(x: torch.Tensor, eps: float = L2NORM_EPS):
    """y = x * rstd with rstd = 1 / sqrt(sum(x^2) + eps) over the last dim. Returns (y, rstd [..., 1]).

    Source: FLA `l2norm_fwd` (eps inside the sqrt, as `reference.gdn.recurrent.l2norm`).
    """
    rstd = torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)
    return l2norm(x, eps), rstd


def l2norm_bwd(y: torch.Tensor, rstd: torch.Tensor, dy: torch.Tensor) -> torch.Tensor:
    """dL/dx of y = l2norm(x): rstd * (dy - y * sum(dy * y)). Source: FLA `l2norm_bwd`."""
    return rstd * (dy - y * (dy * y).sum(-1, keepdim=True))


class _NoSecondDerivative(torch.autograd.Function):
    """Passes the first-order gradients of `ChunkGatedDeltaRuleFunction` through unchanged when they
    are built with `create_graph=True`, tied to the op's inputs, and raises when differentiated.

    The chunked backward is written by hand and not itself differentiable. `once_differentiable`
    refuses a second derivative only on `.backward()`: its error node is not connected to the op's
    inputs, so `torch.autograd.grad(dq, k, allow_unused=True)` returned None and
    `materialize_grads=True` returned zeros for a second derivative that is not zero. Tied to the
    inputs, every such request reaches `backward` below and raises.
    """

    @staticmethod
    def forward(ctx, n, *tensors):
        return tuple(t.view_as(t) for t in tensors[:n])

    @staticmethod
    def backward(ctx, *grads):
        raise NotImplementedError(
            "reference.chunk_gated_delta_rule has no second derivative (its chunked backward is written "
            "by hand); use reference.recurrent_gated_delta_rule (plain autograd) for higher-order gradients"
        )


class ChunkGatedDeltaRuleFunction(torch.autograd.Function):
    """Autograd wiring of the reference chunked op (inputs are validated by `chunk_gated_delta_rule`).

    Saves what FLA saves (q, k after the optional L2 norm and their rstd, v, g_cum, beta, A,
    initial_state), plus the inputs q, k, g themselves, and recomputes w, u, h, v_new in the backward.
    `dht` is the gradient of final_state (None when final_state is not returned or not used).
    dg is 0 where g < G_FLOOR (the forward floors g there; see `reference.gdn.chunk.G_FLOOR`).
    First order only: a second derivative raises NotImplementedError (`_NoSecondDerivative`).
    """

    @staticmethod
    def forward(ctx, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel, chunk_size):
        cdt = compute_dtype(q, k, v, g, beta, initial_state)
        ctx.dtypes = (q.dtype, k.dtype, v.dtype, g.dtype, beta.dtype, None if initial_state is None else initial_state.dtype)
        q_in, k_in = q, k
        q_rstd = k_rstd = None
        if use_qk_l2norm_in_kernel:
            q, q_rstd = l2norm_fwd(q.to(cdt))
            k, k_rstd = l2norm_fwd(k.to(cdt))
            v = v.to(cdt)  # q, k are now in the compute dtype: v joins them (bf16/fp16 inputs)
        g_cum, o, A, final_state, _, _ = chunk_gated_delta_rule_fwd(
            q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, chunk_size
        )
        ctx.save_for_backward(q, k, v, g_cum, beta, A, initial_state, q_rstd, k_rstd, q_in, k_in, g)
        ctx.scale, ctx.cu_seqlens, ctx.chunk_size, ctx.l2 = scale, cu_seqlens, chunk_size, use_qk_l2norm_in_kernel
        ctx.o_shape = o.shape
        ctx.set_materialize_grads(False)
        return o.to(ctx.dtypes[0]), final_state

    @staticmethod
    def backward(ctx, do, dht):
        q, k, v, g_cum, beta, A, initial_state, q_rstd, k_rstd, q_in, k_in, g = ctx.saved_tensors
        anchors = [t for t in (q_in, k_in, v, g, beta, initial_state, do, dht) if t is not None and t.requires_grad]
        with torch.no_grad():
            if do is None:
                do = torch.zeros(ctx.o_shape, dtype=g_cum.dtype, device=g_cum.device)
            do = do.contiguous()  # o.sum() gives an expanded do: one layout, as the inputs
            dht = None if dht is None else dht.contiguous()
            dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(
                q, k, v, g_cum, beta, A, ctx.scale, initial_state, do, dht, ctx.cu_seqlens, ctx.chunk_size
            )
            if ctx.l2:
                dq, dk = l2norm_bwd(q, q_rstd, dq), l2norm_bwd(k, k_rstd, dk)
            dg = dg.masked_fill(g < G_FLOOR, 0.0)
            tq, tk, tv, tg, tb, th = ctx.dtypes
            grads = [dq.to(tq), dk.to(tk), dv.to(tv), dg.to(tg), dbeta.to(tb), None if dh0 is None else dh0.to(th)]
        if torch.is_grad_enabled() and anchors:  # create_graph=True: keep the graph honest (_NoSecondDerivative)
            idx = [i for i, t in enumerate(grads) if t is not None]
            tied = _NoSecondDerivative.apply(len(idx), *(grads[i] for i in idx), *anchors)
            for i, t in zip(idx, tied):
                grads[i] = t
        dq, dk, dv, dg, dbeta, dh0 = grads
        return dq, dk, dv, dg, dbeta, None, dh0, None, None, None, None


def chunk_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    chunk_size: int = 64,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    state_layout: str = "kv",
    checkpoint_positions: torch.Tensor | None = None,
    checkpoint_states: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    batch_invariant: bool = False,
):
    """Gated DeltaNet chunked prefill, reference (plain PyTorch, fp64-capable, differentiable).

    Computes, per sequence and value head hv (q/k head hv // (HV // H)), per token t:

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T      (S_{-1} = initial_state)
        o_t = scale * S_t^T q_t

    by FLA's chunked algorithm (chunks of `chunk_size` tokens, WY/UT representation; see
    `reference.gdn.chunk`) and, under autograd, FLA's hand-written chunked backward
    (`reference.gdn.chunk_bwd`). Equal to `reference.recurrent_gated_delta_rule` up to rounding.

    Args:
        q: [B, T, H, K] query, any float dtype (one dtype with k and v).
        k: [B, T, H, K] key. Expected L2-normalised per head (or pass use_qk_l2norm_in_kernel).
        v: [B, T, HV, V] value; HV % H == 0 (GVA: value head hv reads q/k head hv // (HV // H)).
        g: [B, T, HV] decay per token in natural log (alpha_t = exp(g_t)), must be finite and <= 0.
        beta: [B, T, HV] write strength (post-sigmoid, in [0, 1]).
        scale: output scale (a real number), default K ** -0.5.
        initial_state: None (zeros) or [N, HV, K, V], the state before each sequence's first token
            (N = B, or len(cu_seqlens) - 1 with cu_seqlens).
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: None or [N + 1] int32/int64 offsets of sequences packed along T (B == 1),
            FlashAttention style [0, l1, l1 + l2, ..., T]; empty sequences are allowed.
        use_qk_l2norm_in_kernel: normalise q and k per head first, x / sqrt(sum(x^2) + 1e-6), and
            differentiate through it.
        chunk_size: C, a positive int (keyword only; FLA passes it through **kwargs; default 64).

    Serving arguments (keyword only; `flashqla.serving` defines them; the public op
    `flashqla.chunk_gated_delta_rule` takes the same):
        state_indices: int32/int64 [N] or None. With it initial_state is a pool [P, HV, K, V]
            (or [P, HV, V, K]); sequence n starts from row state_indices[n] and, with
            output_final_state, its final state is written into that row (rounded once to the
            pool's dtype); the pool is returned as final_state. Negative: a padding sequence (no
            read, no write).
        has_initial_state: bool [N] or None; False starts that sequence from zeros.
        state_layout: "kv" (default) or "vk" for initial_state / the pool, the final state and the
            checkpoints.
        checkpoint_positions, checkpoint_states: int [M] sorted global token offsets, each inside a
            sequence (cu_seqlens[n] < p <= cu_seqlens[n + 1]), and the preallocated [M, HV, K, V]
            (or [M, HV, V, K]) states written in place with the state after the first p tokens
            (`reference.gdn.chunk.chunk_checkpoint_states`: from the chunk states, at any token; o
            is not changed).
        out: preallocated o [B, T, HV, V] in q's dtype, written in place and returned.
        batch_invariant: run each sequence as its own call (its own tensors, its own chunked pass),
            so that its o, final state and checkpoints are bitwise those of a batch holding it alone.
        Every value is checked here (the reference reads them): an index >= P, two sequences on one
        pool row, unsorted positions or one outside every sequence raise ValueError.
        Autograd: o stays differentiable (q, k, v, g, beta and a per-sequence initial_state); a pool
        (with state_indices), checkpoint_states and out are written in place without autograd, so a
        pool or checkpoint_states that requires grad, and out= under autograd, raise ValueError.

    Returns:
        (o, final_state):
            o: [B, T, HV, V] in q's dtype.
            final_state: [N, HV, K, V] in fp32 (fp64 when any input is fp64), or None unless
                output_final_state. Its gradient (dht) flows into the backward when it is used.
        Arithmetic runs in fp64 when any input is fp64, else in fp32. Gradients come back in each
        input's dtype (dg as dL/dg per token, natural log).

    Raises:
        TypeError, ValueError: from `flashqla.contract.check_gdn_inputs(..., check_values=True)`,
            before any work: non-tensor or non-float arguments, mismatched dtypes, shapes, devices,
            HV % H != 0, cu_seqlens with B != 1 or bad values, initial_state of the wrong shape,
            a non-real or non-finite scale, a non-bool output_final_state, and a positive or
            non-finite g; `flashqla.serving.check_serving_args` for the serving arguments. Each
            message names the argument.
        TypeError: use_qk_l2norm_in_kernel not a bool.
        ValueError: chunk_size not a positive int.
        NotImplementedError: (in a later backward) a second derivative through the op: gradients
            built with create_graph=True are first order and raise when differentiated.

    Gates below `reference.gdn.chunk.G_FLOOR` (-1000, whose decay exp(g) is exactly 0 in fp64) are
    raised to it before the chunk-local cumsum; their dg is 0, as the recurrence's.

    Source: FLA `chunk_gated_delta_rule` / `ChunkGatedDeltaRuleFunction`
    (fla/ops/gated_delta_rule/chunk.py), `chunk_gated_delta_rule_fwd` and `chunk_gated_delta_rule_bwd`;
    research/fla-gdn.md sections 2 and 3.
    """
    serving = serving_requested(state_indices, has_initial_state, state_layout, checkpoint_positions,
                                checkpoint_states, out, batch_invariant)
    d = check_gdn_inputs(q, k, v, g, beta, scale, None if serving else initial_state, output_final_state, cu_seqlens,
                         check_values=True)
    if not isinstance(use_qk_l2norm_in_kernel, bool):
        raise TypeError(f"use_qk_l2norm_in_kernel must be a bool, got {type(use_qk_l2norm_in_kernel).__name__}")
    check_chunk_size(chunk_size)
    scale = d.K**-0.5 if scale is None else float(scale)
    if serving:
        s = check_serving_args(d, q, initial_state, output_final_state, cu_seqlens, state_indices=state_indices,
                               has_initial_state=has_initial_state, state_layout=state_layout,
                               checkpoint_positions=checkpoint_positions, checkpoint_states=checkpoint_states, out=out,
                               batch_invariant=batch_invariant, check_values=True)
        return _serve(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                      chunk_size, s, d)
    # one memory layout, so that the rounding (BLAS paths) and the result do not depend on the strides
    # of views (transposes, slices, expanded tensors); autograd carries the gradients back through it
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    return ChunkGatedDeltaRuleFunction.apply(
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel, chunk_size
    )


def _serve(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, l2, chunk_size, s, d):
    """The serving path of `chunk_gated_delta_rule` (validated arguments `s`, sizes `d`)."""
    grad = torch.is_grad_enabled()
    if grad and s.pool and initial_state.requires_grad:
        raise ValueError("initial_state is a state pool (state_indices given) that requires grad: pooled states are "
                         "read and written in place without autograd; pass a per-sequence initial_state to train through it")
    if grad and s.checkpoint_states is not None and s.checkpoint_states.requires_grad:
        raise ValueError("checkpoint_states requires grad: checkpoints are written in place without autograd")
    if grad and s.out is not None and any(x is not None and x.requires_grad for x in (q, k, v, g, beta, initial_state)):
        raise ValueError("out= is not differentiable (o is written in place): call without out under autograd")
    cdt = compute_dtype(q, k, v, g, beta, None if s.pool else initial_state)
    h0 = gather_initial_states(initial_state, s, d.N, cdt)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    pos = [] if s.checkpoint_positions is None else s.checkpoint_positions.to("cpu", torch.int64).tolist()
    if s.batch_invariant:  # each sequence alone: its own tensors, its own chunked pass
        bounds = [(b, 0, d.T) for b in range(d.B)] if cu_seqlens is None else [
            (0, a, e) for a, e in zip(cu_seqlens.tolist()[:-1], cu_seqlens.tolist()[1:])]
        os_, finals, ckpts = [], [], []
        for n, (b, bos, eos) in enumerate(bounds):
            sl = [x[b:b + 1, bos:eos] for x in (q, k, v, g, beta)]
            base = b * d.T + bos
            mine = [p - base for p in pos if base < p <= base + (eos - bos)]
            o_n, f_n, c_n = _run(*sl, scale, None if h0 is None else h0[n:n + 1], None, l2, chunk_size, mine, cdt)
            os_.append(o_n)
            finals.append(f_n)
            if c_n is not None:
                ckpts.append(c_n)
        o = torch.cat(os_, dim=1) if cu_seqlens is not None else torch.cat(os_, dim=0)
        final = torch.cat(finals) if finals else torch.zeros(0, d.HV, d.K, d.V, dtype=cdt, device=q.device)
        ckpt = torch.cat(ckpts) if pos else None
    else:
        o, final, ckpt = _run(q, k, v, g, beta, scale, h0, cu_seqlens, l2, chunk_size, pos, cdt)
    return write_back(o, final, ckpt, s, initial_state, output_final_state)


def _run(q, k, v, g, beta, scale, h0, cu_seqlens, l2, chunk_size, positions, cdt):
    """(o, final state [N, HV, K, V] in cdt, checkpoint states [M, HV, K, V] in cdt or None): the op's
    autograd Function for o and the final state, and, for checkpoints, the chunked forward's products
    (recomputed without autograd) cut at each position."""
    o, final = ChunkGatedDeltaRuleFunction.apply(q, k, v, g, beta, scale, h0, True, cu_seqlens, l2, chunk_size)
    if not positions:
        return o, final, None
    with torch.no_grad():
        if l2:
            q, k, v = l2norm_fwd(q.to(cdt))[0], l2norm_fwd(k.to(cdt))[0], v.to(cdt)
        g_cum, _, _, _, h, v_new = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, h0, False, cu_seqlens, chunk_size)
        ckpt = chunk_checkpoint_states(k, v_new, h, g_cum, positions, chunk_size, cu_seqlens)
    return o, final, ckpt

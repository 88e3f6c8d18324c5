"""The public op `chunk_gated_delta_rule` (forward and backward through autograd) and `warmup`.

One call validates its inputs once (`flashqla.contract`), plans once (`flashqla.cp.plan.plan_call`)
and passes the plan down: to `GDNEagerFunction` (training, eager), or to the forward driver
(inference). Under torch.compile the op is one opaque custom op per direction
(`flashqla.ops.gdn.autograd`), each planning its own call.
"""

from __future__ import annotations

import torch

from flashqla.contract import (SUPPORTED, assert_offsets_async, check_device, check_gdn_inputs, check_supported, cp_mode,
                               l2norm, max_seqlen_hint, offsets_check_applies, planning_seqlens, resolve_truncate)
from flashqla.cp.plan import plan_call
from flashqla.ops.gdn.autograd import GDNEagerFunction, gdn_fwd, gdn_fwd_inference
from flashqla.ops.gdn.fwd import forward
from flashqla.ops.gdn.kernels.sm90._common import compile_count, tl_dtype
from flashqla.ops.gdn.kernels.sm90.registry import build_kernels, op_kernel_specs
from flashqla.ops.gdn.serving import serve
from flashqla.serving import STATE_STORAGE_DTYPES, check_serving_args, serving_requested

__all__ = ["chunk_gated_delta_rule", "warmup"]


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
    cp: str | bool | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
    check_inputs: bool = False,
    check_offsets: bool = False,
    state_indices: torch.Tensor | None = None,
    has_initial_state: torch.Tensor | None = None,
    state_layout: str = "kv",
    checkpoint_positions: torch.Tensor | None = None,
    checkpoint_states: torch.Tensor | None = None,
    out: torch.Tensor | None = None,
    batch_invariant: bool = False,
):
    """Gated DeltaNet chunked prefill, forward and backward (autograd), FLA's signature and return.

    Computes, per sequence and value head hv (q/k head hv // (HV // H)), per token t:

        S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T      (S in R^{K x V}, fp32)
        o_t = scale * S_t^T q_t                                                 (inclusive of token t)

    by the chunked form with chunk size 64 (DESIGN.md section 1; derivation records of
    `derivations.chunk_form`, `derivations.wy`, `derivations.rewrites`), in two kernel launches:
    a prepare kernel parallel over all chunks (chunk-local cumsum of g, K K^T, the gated WY inverse
    A = (I + strictly_lower(diag(beta) (K K^T) * Gamma))^-1 by 16 x 16 blocks) and a recurrent
    kernel per (sequence, value head, value slice) that keeps the fp32 state on chip.

    Args:
        q: [B, T, H, K] bfloat16 or float16, queries (L2-normalised by the caller unless
            use_qk_l2norm_in_kernel).
        k: [B, T, H, K], same dtype, keys (L2-normalised likewise).
        v: [B, T, HV, V], same dtype, values; HV % H == 0 (GVA: HV // H value heads share one q/k head).
        g: [B, T, HV] float32, natural-log decay per token, must be <= 0; -inf is valid ("forget
            everything"). Clamped at `flashqla.contract.G_FLOOR` = -1000 before the kernels (one
            elementwise pass over [B, T, HV] fp32, forward and backward; exp(-1000) is 0 in fp32, so
            the result is unchanged) and dg is 0 below it. A positive or NaN g is outside the domain
            (see `check_inputs`).
        beta: [B, T, HV] float32 or q's dtype, write strength (sigmoid output, in [0, 1]).
        scale: output scale, default K ** -0.5.
        initial_state: [N, HV, K, V] float32 or None (zeros). N = B, or len(cu_seqlens) - 1.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: [N + 1] int32/int64 offsets of packed sequences (B must be 1), starting at 0,
            non-decreasing, ending at T; empty sequences are allowed. Read on device only (no host
            synchronisation; its values are checked only when it is a CPU tensor). Should a device
            cu_seqlens end before T, the tokens past cu_seqlens[-1] belong to no sequence: their
            outputs and gradients are zero (o is then allocated zero-filled: one memset of o on
            calls with device offsets and no cu_seqlens_cpu, the only ones where such a tail can
            exist; pass cu_seqlens_cpu to skip it).
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first (x * rsqrt(sum x^2 + 1e-6), in
            fp32, rounded back to the input dtype; two extra launches).
        cp: keyword-only, intra-device context parallelism for long sequences with few value heads:
            "off", "auto" (`flashqla.cp` planner, exact: segments from zero state, transitions,
            combine scan, output correction; derivations CP-1..CP-3) or "on"; True / False mean
            "on" / "off"; None reads $FLASHQLA_CP, default "auto" (`flashqla.contract.cp_mode`).
        cu_seqlens_cpu: keyword-only, None or a host (CPU) copy of cu_seqlens, as FLA's argument of
            that name. Its lengths are the planner's hints: the longest sequence for the forward's
            plan, every length for the backward's (which a forward under autograd takes, to keep
            its split states for the backward: `flashqla.cp.plan.plan_cp(seqlens=...)`). Without it the
            planner takes every sequence as T / N tokens long and leaves unbalanced batches (one long
            sequence beside short ones) unsplit; for 2 to 32 sequences the unsplit kernel's value-slice
            width follows the lengths. It must equal cu_seqlens (it ends at T); it is not compared
            with it (that would need a device read). A copy that equals it changes the plan, never
            the results (the segment tables are built on the device from cu_seqlens). One that does
            not may cost speed and, since it says the offsets end at T, leaves o's rows past device
            offsets that end earlier unwritten (without the copy they are zeroed). Under
            torch.compile / torch.export only its type, dtype, device and shape are checked and it
            is not used (its values are not known while tracing).
            `flashqla.contract.planning_max_seqlen`, `.planning_seqlens`.
        check_inputs: keyword-only, False (default) or True: also check the values of device
            tensors before any launch (`flashqla.contract.check_gdn_inputs(check_values=True)`): the
            offsets of cu_seqlens, g <= 0 and not NaN, beta in [0, 1], q, k, v, beta and
            initial_state finite. Costs a few reductions and host synchronisations per call (not
            CUDA-graph capturable); skipped while torch.compile traces. The values of CPU tensors
            are always checked. Without it, device values outside that domain are not detected:
            the result is undefined (it may be NaN or overflow), never a crash of the process.
        check_offsets: keyword-only, False (default) or True: check device `cu_seqlens` without a
            host synchronisation (`flashqla.contract.assert_offsets_async`: starts at 0,
            non-decreasing, ends at most at T) by an asynchronous device assert enqueued before the
            kernels (CUDA-graph capturable; skipped while torch.compile traces). Costs eight small
            launches of host time per eager call (README "Valid inputs"; why it is off by default). Bad offsets then end in a device-side assert
            naming cu_seqlens at the next synchronisation, which leaves the CUDA context unusable;
            `check_inputs=True` reports them as a ValueError naming the entry instead (host sync).
            Without either check, offsets that decrease or pass T give out-of-bounds accesses.

    Valid inputs (the numerics assume them; README "Valid inputs"): g <= 0 (-inf allowed),
    0 <= beta <= 1, every tensor finite, and k L2-normalised per head (|k| = 1; or
    use_qk_l2norm_in_kernel), so that each step I - beta k k^T has norm <= 1 and the state stays
    bounded by its inputs. |k| is not checked: with beta |k|^2 > 2 the state can grow without bound.

    Serving arguments (keyword-only, defined in `flashqla.serving`; the same on
    `reference.chunk_gated_delta_rule`; run by `flashqla.ops.gdn.serving.serve`: inference on an
    unsplit plan runs the recurrent kernel's serving build, which reads and writes the pool rows,
    layouts, storage dtypes and checkpoints itself; other calls run torch around the kernels):
        state_indices: int32/int64 [N] on q's device or None. With it initial_state is a pool
            [P, HV, K, V] ("kv") or [P, HV, V, K] ("vk") in fp32, bf16 or fp16: sequence n starts
            from row state_indices[n] (gathered, cast to fp32), and with output_final_state its final
            state is written into that row (rounded once to the pool's dtype); final_state is then
            the pool itself. A negative index is a padding sequence: no read, no write. No host
            read: an index >= P is checked only on CPU tensors, on a GPU it is the caller's to avoid
            (undefined, as in torch's index ops); so are two sequences naming one row.
        has_initial_state: bool [N] or None (all True); False starts that sequence from zeros.
        state_layout: "kv" (FLA's, default) or "vk" (vLLM's / SGLang's / FlashInfer's) for the
            pool or initial_state, the final state and the checkpoints.
        checkpoint_positions: int32/int64 [M] on q's device, sorted global token offsets into the
            packed batch (b * T + t without cu_seqlens), each inside a sequence (cu_seqlens[n] <
            p <= cu_seqlens[n + 1]; checked on CPU tensors only), at any token.
        checkpoint_states: [M, HV, K, V] (or [M, HV, V, K]) fp32/bf16/fp16, preallocated: row m is
            written with the state after the first checkpoint_positions[m] tokens: in-kernel on the
            serving build, inside the split forward on a split plan, else two more forwards on the
            batch cut at the positions (`flashqla.ops.gdn.serving`); o and the final state are those
            of the call without checkpoints.
        out: preallocated o [B, T, HV, V] in q's dtype, written and returned (inference only).
        batch_invariant: a sequence's o, final state and checkpoints bitwise the same whatever else
            is in the batch: the plan is cp="off" (the split's segments depend on the batch); the
            value-slice width still follows N * HV, both widths giving the same bits
            (`flashqla.ops.gdn.serving`). Inference only.
        Autograd: o is differentiable with the serving arguments (a per-sequence initial_state
        too); a pool or checkpoint_states that requires grad, out= and batch_invariant under
        autograd raise ValueError. Under torch.compile the serving arguments raise
        NotImplementedError (eager only, for now).

    Supported fast path: K = V = 128, chunk 64, compute capability 9.0 (H100/H200). T, the number of
    sequences and cu_seqlens are run-time values: a new length or sequence mix never recompiles; the
    kernels are compiled once per (H, HV, dtype, beta dtype, cu_seqlens dtype, flags).

    Gradients (autograd, when any input requires grad): dq, dk in q's dtype, dv in v's dtype, dg
    float32, dbeta in beta's dtype, d initial_state float32; the final state's gradient flows in when
    the final state is used. The forward keeps A diag(beta) [HV, S * 64, 64] (q's dtype) and
    g_cum_log2 [HV, S * 64] fp32 for the backward (S chunk slots, about T / 64 per sequence), and
    the backward recomputes the chunk states (`flashqla.ops.gdn.bwd`). Where the
    backward's context-parallel plan splits, the eager forward splits the same way and also keeps
    its segments' entering states, transitions and U rows (`flashqla.cp.saved.CPSaved`: 256 B per
    token and value head, plus 128 KB per segment and value head) so that the backward does not
    recompute them (`autograd.GDNEagerFunction`); o then comes from the backward's segmentation and
    can differ from a no-grad call's at the level of its rounding. Under `torch.compile` the op is one
    opaque custom op per direction (`flashqla::gdn_fwd`, `flashqla::gdn_bwd`; `flashqla::gdn_fwd_inference`
    without gradients), and that backward recomputes them. The gradients are differentiable once (a
    double backward raises).

    Precision: bf16 operands as FLA's by default. Opt-in (`default_backend().fp16_products = True`,
    `flashqla.ops.gdn.backend`): without gradients and on bf16 input the forward stores A diag(beta)
    in fp16 and feeds the two products that read it fp16 operands (`flashqla.ops.gdn.fwd.product_dtype`;
    W's value columns scaled by powers of two, derivation RW-7): o's and the final state's error
    about 0.6-0.8x FLA's on long sequences at +2% to +9% forward time (README, "Precision").

    Returns:
        (o, final_state): o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] float32, or None
        when output_final_state is False.

    Raises:
        TypeError: check_inputs not a bool, check_offsets not a bool, non-tensor arguments, q/k/v dtypes differ or are not bf16/fp16, g not float32,
            beta not float32 or q's dtype, initial_state not float32, cu_seqlens not int32/int64,
            cu_seqlens_cpu not a dense int32/int64 CPU tensor.
        ValueError: wrong ranks or shapes, HV % H != 0, K or V != 128, cu_seqlens with B != 1,
            tensors on different devices; values outside the valid inputs (bad cu_seqlens offsets,
            g > 0 or NaN, beta outside [0, 1], NaN or inf) in CPU tensors, or with check_inputs;
            cu_seqlens_cpu without cu_seqlens, of another shape, or with bad values.
        TypeError, ValueError for the serving arguments: `flashqla.serving.check_serving_args`
            (dtypes, shapes, devices, the layout string; on CPU tensors indices out of range and
            positions unsorted or outside every sequence), and the autograd refusals above.
        RuntimeError: inputs not on a CUDA device of compute capability 9.0 (raised after the
            argument checks above, before any kernel is built or launched).

    Source: FLA `fla.ops.gated_delta_rule.chunk_gated_delta_rule` (signature and semantics);
    algorithm DESIGN.md section 1 and `reference.gdn.fused`.
    """
    if not isinstance(check_inputs, bool):
        raise TypeError(f"check_inputs must be a bool, got {type(check_inputs).__name__}")
    serving = serving_requested(state_indices, has_initial_state, state_layout, checkpoint_positions,
                                checkpoint_states, out, batch_invariant)
    d = check_gdn_inputs(q, k, v, g, beta, scale, None if serving else initial_state, output_final_state, cu_seqlens,
                         check_values=check_inputs)
    if offsets_check_applies(check_offsets, cu_seqlens) and not check_inputs:  # check_inputs read them already
        assert_offsets_async(cu_seqlens, d.T)
    if serving:
        s = check_serving_args(d, q, initial_state, output_final_state, cu_seqlens, state_indices=state_indices,
                               has_initial_state=has_initial_state, state_layout=state_layout,
                               checkpoint_positions=checkpoint_positions, checkpoint_states=checkpoint_states, out=out,
                               batch_invariant=batch_invariant, check_values=check_inputs,
                               state_dtypes=STATE_STORAGE_DTYPES)
    seqlens = planning_seqlens(cu_seqlens_cpu, cu_seqlens, d.T)  # read once: both hints
    max_seqlen = max_seqlen_hint(seqlens)
    check_supported(q, k, v, g, beta, None if serving else initial_state)
    if not isinstance(use_qk_l2norm_in_kernel, bool):
        raise TypeError(f"use_qk_l2norm_in_kernel must be a bool, got {type(use_qk_l2norm_in_kernel).__name__}")
    cp = cp_mode(cp)
    resolve_truncate(None)  # $FLASHQLA_CP_EXACT, checked on every call, split or not
    check_device(q)
    scale = d.K**-0.5 if scale is None else float(scale)
    if use_qk_l2norm_in_kernel:  # differentiable torch ops: autograd carries dq, dk through the norm
        q, k = l2norm(q), l2norm(k)
    tensors = (q, k, v, g, beta, initial_state)
    training = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors)
    output_final_state = bool(output_final_state)
    if serving:
        if torch.compiler.is_compiling():
            raise NotImplementedError("the serving arguments (state_indices, has_initial_state, state_layout, checkpoints, "
                                      "out, batch_invariant) run eagerly for now, not under torch.compile")
        return serve(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, s, cp=cp,
                     max_seqlen=max_seqlen, seqlens=seqlens, training=training)
    if torch.compiler.is_compiling():  # opaque custom ops, each planning its own call
        if training:
            o, final_state, _, _ = gdn_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, cp,
                                           max_seqlen)
        else:
            o, final_state = gdn_fwd_inference(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                               cp, max_seqlen)
        return o, (final_state if output_final_state else None)
    plan = plan_call(q, v, cu_seqlens, cp, training=training, keep_states=training, max_seqlen=max_seqlen,
                     seqlens=seqlens)
    if training:  # keeping a split forward's states for the backward
        o, final_state = GDNEagerFunction.apply(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                                plan)
        return o, (final_state if output_final_state else None)
    f = forward(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, plan=plan, for_backward=False)
    return f.o, f.final_state


def warmup(H: int, HV: int, *, dtype: torch.dtype = torch.bfloat16, beta_dtype: torch.dtype = torch.float32,
           varlen: bool = True, seqlens_dtype: torch.dtype = torch.int32, backward: bool = True,
           K: int = 128, V: int = 128, fp16_products: bool | None = None) -> int:
    """Compiles every sm_90 kernel that `chunk_gated_delta_rule` can launch for one head
    configuration, so that no later call compiles, whatever its lengths and sequence mix.

    The op compiles on first use: a call builds the kernels its own path needs (the prepare and
    recurrent kernels at the value-slice width `recurrent.pick_block_v` picks from N * HV; the split
    path's kernels when the context-parallel planner splits; the backward's at the first backward).
    Kernels are keyed by head counts, head dims, dtypes and flags only, never by T, N or
    `cu_seqlens`; but a new length or mix can take a path or width not taken before (or the prepare
    build with one value head a CTA that few chunk slots pick, `prepare.pick_heads_per_cta`). `warmup`
    builds them all up front, concurrently: both value-slice widths, both prepare builds, the split
    path's kernels, which run on the segments' packed offsets even for a fixed-length batch (prepare, run + transition launch at
    both widths, transition limits, combine scans, output correction, segment tables, slot
    relayouts) and, with `backward`, the backward's passes on the caller's and the segments' offsets
    (`kernels.sm90.registry.op_kernel_specs`).

    Args:
        H, HV: q/k heads and value heads (HV a multiple of H).
        dtype: q, k, v dtype (torch.bfloat16 or torch.float16).
        beta_dtype: beta's dtype (torch.float32 or `dtype`).
        varlen: whether calls pass `cu_seqlens` (packed sequences); a fixed-length batch is False.
        seqlens_dtype: `cu_seqlens`' dtype (torch.int32 or torch.int64); validated always, used only
            when `varlen` (the split path of a fixed-length batch runs on int32 segment offsets).
        backward: also the backward's kernels (training).
        K, V: head dims, ints (128 only).
        fp16_products: also the builds of the opt-in fp16 A_beta product (bf16 input; README
            "Precision"); None: when the process's backend has it on (`default_backend().fp16_products`).

    Returns: the number of kernels compiled by this call (0 when all were built before; a kernel in
    TileLang's disk cache counts as built here, it is loaded, not recompiled).
    Raises: ValueError naming the argument for an unsupported value. Needs TileLang and nvcc, not a GPU.
    """
    for name, x in (("H", H), ("HV", HV)):
        if isinstance(x, bool) or not isinstance(x, int) or x < 1:
            raise ValueError(f"{name} must be a positive int, got {x!r}")
    for name, x in (("K", K), ("V", V)):
        if isinstance(x, bool) or not isinstance(x, int):
            raise ValueError(f"{name} must be an int, got {x!r}")
    if HV % H:
        raise ValueError(f"HV must be a multiple of H (grouped value attention), got H={H}, HV={HV}")
    if (K, V) != (SUPPORTED["K"], SUPPORTED["V"]):
        raise ValueError(f"K and V must be {SUPPORTED['K']} (the sm_90 kernels' head dims), got K={K}, V={V}")
    if dtype not in SUPPORTED["qkv_dtypes"]:
        raise ValueError(f"dtype must be torch.bfloat16 or torch.float16, got {dtype}")
    if beta_dtype not in (torch.float32, dtype):
        raise ValueError(f"beta_dtype must be torch.float32 or dtype ({dtype}), got {beta_dtype}")
    if seqlens_dtype not in (torch.int32, torch.int64):
        raise ValueError(f"seqlens_dtype must be torch.int32 or torch.int64, got {seqlens_dtype}")
    for name, x in (("varlen", varlen), ("backward", backward)):
        if not isinstance(x, bool):
            raise ValueError(f"{name} must be a bool, got {x!r}")
    if fp16_products is None:
        from flashqla.ops.gdn.backend import default_backend

        fp16_products = default_backend().fp16_products
    elif not isinstance(fp16_products, bool):
        raise ValueError(f"fp16_products must be a bool or None, got {fp16_products!r}")
    specs = []
    for bv in (64, 128):
        specs += op_kernel_specs(H, HV, varlen=varlen, dtype=tl_dtype(dtype), beta_dtype=tl_dtype(beta_dtype),
                                 seq_dtype=tl_dtype(seqlens_dtype) if varlen else "int32", backward=backward,
                                 block_v=bv, K=K, V=V, fp16_products=fp16_products)
    n0 = compile_count()
    build_kernels(list(dict.fromkeys(specs)))
    return compile_count() - n0

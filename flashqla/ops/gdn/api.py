"""Public Gated DeltaNet chunked-prefill op on Hopper: `chunk_gated_delta_rule`, forward and backward.

Forward: two kernel launches (`kernels.sm90.prepare`, `kernels.sm90.recurrent`), plus a few small
elementwise launches when `use_qk_l2norm_in_kernel=True`. Backward (autograd; `flashqla.ops.gdn.bwd`):
four launches. Both are `torch.library` custom ops (`flashqla.ops.gdn.autograd`), so the op works
under `torch.compile`.
"""

from __future__ import annotations

import os
from typing import NamedTuple

import torch

from flashqla.validation import check_gdn_inputs, max_seqlen_hint, planning_seqlens

__all__ = ["chunk_gated_delta_rule", "chunk_gated_delta_rule_fwd", "warmup", "ChunkGDNForward", "SUPPORTED"]

#: What the fast path supports; anything else raises before any device work.
SUPPORTED = {
    "qkv_dtypes": (torch.bfloat16, torch.float16),
    "g_dtype": torch.float32,
    "state_dtype": torch.float32,
    "K": 128,
    "V": 128,
    "chunk_size": 64,
    "compute_capability": (9, 0),
}

L2NORM_EPS = 1e-6

_BUILT: set = set()


class ChunkGDNForward(NamedTuple):
    """What the forward produces and a backward will consume.

    o: [B, T, HV, V] in q's dtype.
    final_state: [N, HV, K, V] fp32, or None.
    A: [HV, S * 64, 64] in q's dtype: per chunk slot, A diag(beta) with A FLA's gated WY inverse
        (I + strictly_lower(diag(beta) (K K^T) * Gamma))^-1 (slot layout: `kernels.sm90._common`).
    g_cum_log2: [HV, S * 64] fp32: chunk-local inclusive cumsum of g in base-2 units (g_cum / ln 2).
        A and g_cum_log2 are None when `chunk_gated_delta_rule_fwd(for_backward=False)` split the
        sequences (context parallelism keeps them in the segments' layout, useless to a backward),
        and when cp_saved is set (they travel in it, `CPSaved.A`, `.g_cum_log2`, in the segments'
        slot layout, which the split backward reads as they are).
    q, k: the q and k the kernels used (L2-normalised when use_qk_l2norm_in_kernel).
    cp_saved: None, or a split forward's `flashqla.cp.driver.CPSaved` (entering states, transitions,
        U rows, A and g_cum_log2 of its segments; `chunk_gated_delta_rule_fwd(keep_cp_states=True)`),
        which `flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd(A, g_cum_log2, cp_saved=...)` uses
        instead of recomputing (pass A and g_cum_log2 as they are here: None).
    """

    o: torch.Tensor
    final_state: torch.Tensor | None
    A: torch.Tensor | None
    g_cum_log2: torch.Tensor | None
    q: torch.Tensor
    k: torch.Tensor
    cp_saved: object = None


def _check_supported(q, k, v, g, beta, initial_state) -> None:
    """Fast-path checks that need no device work (dtypes and head dims); raises TypeError/ValueError."""
    if q.dtype not in SUPPORTED["qkv_dtypes"]:
        raise TypeError(f"chunk_gated_delta_rule supports q, k, v in bfloat16 or float16, got {q.dtype}")
    if g.dtype != torch.float32:
        raise TypeError(f"chunk_gated_delta_rule supports g in float32 (natural-log decay), got {g.dtype}")
    if beta.dtype not in (torch.float32, q.dtype):
        raise TypeError(f"chunk_gated_delta_rule supports beta in float32 or q's dtype ({q.dtype}), got {beta.dtype}")
    K, V = q.shape[-1], v.shape[-1]
    if K != SUPPORTED["K"] or V != SUPPORTED["V"]:
        raise ValueError(f"chunk_gated_delta_rule supports head dims K = V = 128 (chunk size 64), got K = {K}, V = {V}")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise TypeError(f"chunk_gated_delta_rule supports initial_state in float32, got {initial_state.dtype}")


def _check_device(q) -> None:
    if q.device.type != "cuda":
        raise RuntimeError(f"chunk_gated_delta_rule runs on a CUDA device of compute capability 9.0 (Hopper); the inputs are on {q.device}")
    cap = torch.cuda.get_device_capability(q.device)
    if tuple(cap) != SUPPORTED["compute_capability"]:
        raise RuntimeError(
            f"chunk_gated_delta_rule needs compute capability 9.0 (H100/H200, sm_90a kernels); {q.device} has {cap[0]}.{cap[1]}"
        )


#: Environment variable with the op's default context-parallel mode (`cp_mode`).
CP_ENV = "FLASHQLA_CP"


def cp_mode(cp: str | bool | None, default: str = "auto") -> str:
    """The intra-device context-parallel mode of a call: "off" (never split), "auto" (the planner of
    `flashqla.cp` splits long sequences with few value heads, exact mode; the backward has its own
    plan) or "on" (always split); True / False mean "on" / "off". None reads $FLASHQLA_CP, else
    `default`, "auto" (the split forward and backward are checked on the H200 against fp64,
    tests/gpu/test_cp_gpu.py and tests/gpu/test_autograd_gpu.py, and timed by the benchmarks: the
    backward at 2/4 heads x 32768 tokens takes 1.45 ms split against 9.70 ms unsplit). Raises
    ValueError naming `cp` for anything else."""
    mode = os.environ.get(CP_ENV, default) if cp is None else cp
    mode = {True: "on", False: "off"}.get(mode, mode) if isinstance(mode, bool) else mode
    if mode not in ("off", "auto", "on"):
        raise ValueError(f"cp must be 'off', 'auto', 'on' or None (${CP_ENV}, default {default!r}), got {mode!r}")
    return mode


def _l2norm(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2, -1) + L2NORM_EPS) in at least fp32, rounded back to x's dtype
    (differentiable torch ops: autograd carries the gradient through it)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


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
    block_v: int | None = None,
    poison_outputs: bool = False,
    cp: str | None = None,
    for_backward: bool = True,
    max_seqlen: int | None = None,
    keep_cp_states: bool = False,
    seqlens: tuple[int, ...] | None = None,
) -> ChunkGDNForward:
    """Forward of `chunk_gated_delta_rule` returning what a backward needs (see `ChunkGDNForward`).

    Arguments, errors and units as in `chunk_gated_delta_rule` (autograd is not involved here: no
    grad check). `block_v` forces the value slice width of the recurrent kernel (64 or 128; None
    picks it from N * HV). `cp`: intra-device context parallelism (`cp_mode`; ValueError for an
    unknown mode). `poison_outputs` (testing aid) fills every output with NaN before the launches,
    so that an element a kernel fails to write shows up. `for_backward=False` (inference) lets a
    split forward skip moving A and g_cum_log2 back to the caller's slot layout (a gather of both;
    ~0.15 ms at 2/8 heads x 32768 tokens on the H200): they are then returned as None.
    `max_seqlen`: host-side bound on the longest sequence, the context-parallel planner's hint
    (`flashqla.validation.planning_max_seqlen`); it changes the plan, never the results. `seqlens`:
    the host-side lengths of the sequences (a tuple; `flashqla.validation.planning_seqlens`), on which
    the backward's plan is costed when `keep_cp_states` (pass the backward the same); the same rule.
    `keep_cp_states` (training, with for_backward): when the backward's context-parallel plan splits
    these inputs, the forward splits the same way and keeps its segments' entering states,
    transitions and U rows (`ChunkGDNForward.cp_saved`, `flashqla.cp.driver.CPSaved`) for
    `chunk_gated_delta_rule_bwd(cp_saved=...)`, which then skips recomputing them (the same values).
    A and g_cum_log2 are then returned as None: they travel in cp_saved in the segments' slot layout
    (`CPSaved.A`, `.g_cum_log2`), which the split backward reads without moving them to the caller's
    layout and back; pass the backward `f.A, f.g_cum_log2` (None) with `f.cp_saved`. Memory kept:
    about 64 KB per segment slot and value head twice (S_in, P) plus 256 B per token and value head
    (U, bf16); A (128 B per token and value head in bf16) and g_cum_log2 (4 B) take the place of the
    caller-layout ones.
    """
    from flashqla.ops.gdn.kernels.sm90 import build_kernels
    from flashqla.ops.gdn.kernels.sm90.prepare import chunk_prepare_fwd, prepare_kernel_args
    from flashqla.ops.gdn.kernels.sm90.recurrent import chunk_recurrent_fwd, recurrent_kernel_args

    d = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    _check_supported(q, k, v, g, beta, initial_state)
    if not isinstance(use_qk_l2norm_in_kernel, bool):
        raise TypeError(f"use_qk_l2norm_in_kernel must be a bool, got {type(use_qk_l2norm_in_kernel).__name__}")
    if not isinstance(keep_cp_states, bool):
        raise TypeError(f"keep_cp_states must be a bool, got {type(keep_cp_states).__name__}")
    cp = cp_mode(cp)
    _check_device(q)
    scale = d.K**-0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()
    if cp != "off":
        from flashqla.cp.driver import chunk_gated_delta_rule_cp_fwd, cp_splits

        keep = keep_cp_states and for_backward and cp_splits(q, v, cu_seqlens, cp, max_seqlen=max_seqlen,
                                                                   backward=True, seqlens=seqlens)
        if keep or cp_splits(q, v, cu_seqlens, cp, max_seqlen=max_seqlen):
            f = chunk_gated_delta_rule_cp_fwd(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                              use_qk_l2norm_in_kernel, cp=cp, block_v=block_v, max_seqlen=max_seqlen,
                                              poison_outputs=poison_outputs, relayout=for_backward,
                                              keep_for_backward=keep, seqlens=seqlens)
            return f if for_backward else f._replace(A=None, g_cum_log2=None)

    if use_qk_l2norm_in_kernel:
        q, k = _l2norm(q), _l2norm(k)

    if d.T > 0 and d.N > 0:
        key = (prepare_kernel_args(k, beta, cu_seqlens, d.HV), recurrent_kernel_args(q, v, cu_seqlens, block_v))
        if key not in _BUILT:  # first use: compile both kernels concurrently
            build_kernels([("prepare", key[0]), ("recurrent", key[1])])
            _BUILT.add(key)
    bufs = {}
    if poison_outputs:
        from flashqla.ops.gdn.kernels.sm90._common import CHUNK, num_slots

        S = num_slots(d.B, d.T, d.N, cu_seqlens is not None)
        nan = float("nan")
        bufs = dict(
            A=torch.full((d.HV, S * CHUNK, CHUNK), nan, dtype=k.dtype, device=k.device),
            g_cum_log2=torch.full((d.HV, S * CHUNK), nan, dtype=torch.float32, device=k.device),
            o=torch.full_like(v, nan),
            final_state=torch.full((d.N, d.HV, d.K, d.V), nan, dtype=torch.float32, device=k.device),
        )
    A, g_cum_log2 = chunk_prepare_fwd(k, g, beta, cu_seqlens, d.HV, A=bufs.get("A"), g_cum_log2=bufs.get("g_cum_log2"))
    o, final_state = chunk_recurrent_fwd(
        q, k, v, A, g_cum_log2, scale, initial_state, output_final_state, cu_seqlens, block_v=block_v,
        o=bufs.get("o"), final_state=bufs.get("final_state"),
    )
    return ChunkGDNForward(o=o, final_state=final_state, A=A, g_cum_log2=g_cum_log2, q=q, k=k)


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
    cp: str | None = None,
    cu_seqlens_cpu: torch.Tensor | None = None,
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
        g: [B, T, HV] float32, natural-log decay per token, must be <= 0 (not checked on device: a
            positive g is outside the supported domain and may overflow).
        beta: [B, T, HV] float32 or q's dtype, write strength (sigmoid output, in [0, 1]).
        scale: output scale, default K ** -0.5.
        initial_state: [N, HV, K, V] float32 or None (zeros). N = B, or len(cu_seqlens) - 1.
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: [N + 1] int32/int64 offsets of packed sequences (B must be 1), starting at 0,
            non-decreasing, ending at T; empty sequences are allowed. Read on device only (no host
            synchronisation; its values are checked only when it is a CPU tensor). Should a device
            cu_seqlens end before T, the tokens past cu_seqlens[-1] belong to no sequence: their
            outputs are left unwritten and their gradients are zero.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first (x * rsqrt(sum x^2 + 1e-6), in
            fp32, rounded back to the input dtype; two extra launches).
        cp: keyword-only, intra-device context parallelism for long sequences with few value heads:
            "off", "auto" (`flashqla.cp` planner, exact: segments from zero state, transitions,
            combine scan, output correction; derivations CP-1..CP-3) or "on"; None reads
            $FLASHQLA_CP, default "auto" (`cp_mode`). Measured on the H200, 2/8 heads 1 x 32768:
            1.58 ms unsplit, 0.37 ms split.
        cu_seqlens_cpu: keyword-only, None or a host (CPU) copy of cu_seqlens, as FLA's argument of
            that name. Its lengths are the planner's hints: the longest sequence for the forward's
            plan, every length for the backward's (which a forward under autograd takes, to keep
            its split states for the backward: `planner.plan_cp(seqlens=...)`). Without it the
            planner takes every sequence as T / N tokens long and leaves unbalanced batches (one long
            sequence beside short ones) unsplit. It changes the plan, never the results (the
            segment tables are built on the device from cu_seqlens); it is not compared with
            cu_seqlens (that would need a device read). Under torch.compile / torch.export only
            its type, dtype, device and shape are checked and it is not used (its values are not
            known while tracing). `flashqla.validation.planning_max_seqlen`, `.planning_seqlens`.

    Supported fast path: K = V = 128, chunk 64, compute capability 9.0 (H100/H200). T, the number of
    sequences and cu_seqlens are run-time values: a new length or sequence mix never recompiles; the
    kernels are compiled once per (H, HV, dtype, beta dtype, cu_seqlens dtype, flags).

    Gradients (autograd, when any input requires grad): dq, dk in q's dtype, dv in v's dtype, dg
    float32, dbeta in beta's dtype, d initial_state float32; the final state's gradient flows in when
    the final state is used. The forward keeps A diag(beta) [HV, S * 64, 64] (q's dtype) and
    g_cum_log2 [HV, S * 64] fp32 for the backward (S chunk slots, about T / 64 per sequence), and
    the backward recomputes the chunk states (`flashqla.ops.gdn.bwd`, NOTES-bwd.md). Where the
    backward's context-parallel plan splits, the eager forward splits the same way and also keeps
    its segments' entering states, transitions and U rows (`flashqla.cp.driver.CPSaved`: 256 B per
    token and value head, plus 128 KB per segment and value head) so that the backward does not
    recompute them (`autograd.GDNEagerFunction`); o then comes from the backward's segmentation and
    can differ from a no-grad call's at the level of its rounding. Under `torch.compile` the op is one
    opaque custom op per direction (`flashqla::gdn_fwd`, `flashqla::gdn_bwd`), and that backward
    recomputes them. The gradients are differentiable once (a double backward raises).

    Returns:
        (o, final_state): o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] float32, or None
        when output_final_state is False.

    Raises:
        TypeError: non-tensor arguments, q/k/v dtypes differ or are not bf16/fp16, g not float32,
            beta not float32 or q's dtype, initial_state not float32, cu_seqlens not int32/int64,
            cu_seqlens_cpu not a dense int32/int64 CPU tensor.
        ValueError: wrong ranks or shapes, HV % H != 0, K or V != 128, cu_seqlens with B != 1 (and
            bad cu_seqlens values when it is a CPU tensor), tensors on different devices;
            cu_seqlens_cpu without cu_seqlens, of another shape, or with bad values.
        RuntimeError: inputs not on a CUDA device of compute capability 9.0 (raised after the
            argument checks above, before any kernel is built or launched).

    Source: FLA `fla.ops.gated_delta_rule.chunk_gated_delta_rule` (signature and semantics);
    algorithm DESIGN.md section 1 and `reference.gdn.fused`.
    """
    from flashqla.ops.gdn.autograd import GDNEagerFunction, gdn_fwd, gdn_fwd_inference

    d = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    seqlens = planning_seqlens(cu_seqlens_cpu, cu_seqlens, d.T)  # read once: both hints
    max_seqlen = max_seqlen_hint(seqlens)
    _check_supported(q, k, v, g, beta, initial_state)
    if not isinstance(use_qk_l2norm_in_kernel, bool):
        raise TypeError(f"use_qk_l2norm_in_kernel must be a bool, got {type(use_qk_l2norm_in_kernel).__name__}")
    cp = cp_mode(cp)
    _check_device(q)
    scale = d.K**-0.5 if scale is None else float(scale)
    if use_qk_l2norm_in_kernel:  # differentiable torch ops: autograd carries dq, dk through the norm
        q, k = _l2norm(q), _l2norm(k)
    tensors = (q, k, v, g, beta, initial_state)
    if torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in tensors):
        if torch.compiler.is_compiling():  # opaque custom ops (the backward recomputes the split states)
            o, final_state, _, _ = gdn_fwd(q, k, v, g, beta, scale, initial_state, bool(output_final_state), cu_seqlens,
                                           cp, max_seqlen)
        else:  # the same, keeping a split forward's states for the backward
            o, final_state = GDNEagerFunction.apply(q, k, v, g, beta, scale, initial_state, bool(output_final_state),
                                                    cu_seqlens, cp, max_seqlen, seqlens)
    else:  # inference: nothing is kept for a backward
        o, final_state = gdn_fwd_inference(q, k, v, g, beta, scale, initial_state, bool(output_final_state), cu_seqlens,
                                           cp, max_seqlen)
    return o, (final_state if output_final_state else None)


def warmup(H: int, HV: int, *, dtype: torch.dtype = torch.bfloat16, beta_dtype: torch.dtype = torch.float32,
           varlen: bool = True, seqlens_dtype: torch.dtype = torch.int32, backward: bool = True,
           K: int = 128, V: int = 128) -> int:
    """Compiles every sm_90 kernel that `chunk_gated_delta_rule` can launch for one head
    configuration, so that no later call compiles, whatever its lengths and sequence mix.

    The op compiles on first use: a call builds the kernels its own path needs (the prepare and
    recurrent kernels at the value-slice width `recurrent.pick_block_v` picks from N * HV; the split
    path's kernels when the context-parallel planner splits; the backward's at the first backward).
    Kernels are keyed by head counts, head dims, dtypes and flags only, never by T, N or
    `cu_seqlens`; but a new length or mix can take a path or width not taken before (or the prepare
    build with one value head a CTA that few chunk slots pick, `prepare.pick_heads_per_cta`). `warmup`
    builds them all up front, concurrently: both value-slice widths, both prepare builds, the split
    path's kernels, which run on
    the segments' packed offsets even for a fixed-length batch (prepare, run + transition launch at
    both widths, transition limits, combine scans, output correction, segment tables, slot
    relayouts) and, with `backward`, the backward's passes on the caller's and the segments' offsets
    (`kernels.sm90.op_kernel_specs`).

    Args:
        H, HV: q/k heads and value heads (HV a multiple of H).
        dtype: q, k, v dtype (torch.bfloat16 or torch.float16).
        beta_dtype: beta's dtype (torch.float32 or `dtype`).
        varlen: whether calls pass `cu_seqlens` (packed sequences); a fixed-length batch is False.
        seqlens_dtype: `cu_seqlens`' dtype (torch.int32 or torch.int64); validated always, used only
            when `varlen` (the split path of a fixed-length batch runs on int32 segment offsets).
        backward: also the backward's kernels (training).
        K, V: head dims, ints (128 only).

    Returns: the number of kernels compiled by this call (0 when all were built before; a kernel in
    TileLang's disk cache counts as built here, it is loaded, not recompiled).
    Raises: ValueError naming the argument for an unsupported value. Needs TileLang and nvcc, not a GPU.
    """
    from flashqla.ops.gdn.kernels.sm90 import build_kernels, op_kernel_specs
    from flashqla.ops.gdn.kernels.sm90._common import compile_count, tl_dtype

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
    specs = []
    for bv in (64, 128):
        specs += op_kernel_specs(H, HV, varlen=varlen, dtype=tl_dtype(dtype), beta_dtype=tl_dtype(beta_dtype),
                                 seq_dtype=tl_dtype(seqlens_dtype) if varlen else "int32", backward=backward,
                                 block_v=bv, K=K, V=V)
    n0 = compile_count()
    build_kernels(list(dict.fromkeys(specs)))
    return compile_count() - n0

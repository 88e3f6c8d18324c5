"""Fused prepare kernel (launch 1 of 2 of the forward): per (chunk, value head), fully parallel.

Covers the reference stages (FLA's names, `reference.gdn.chunk`):
    chunk_local_cumsum   -> g_cum_log2 (chunk-local inclusive cumsum of g, in base-2 units)
    chunk_scaled_dot_kkt -> L = strictly_lower(diag(beta) (K K^T) * Gamma)
    solve_tril           -> A = (I + L)^-1 (gated, as FLA's A)
and folds beta into the columns of the stored inverse (`A_beta = A diag(beta)`), which turns the
merged update v_new = A diag(beta) (V - diag(gamma) K S) of `reference.gdn.fused` into one GEMM
with the stored operand.

Derivation records relied on (`python -m derivations`): CF-1..CF-3 (chunk form with FLA's gated A),
WY-3 (forward substitution in the diagonal blocks), RW-2 (v_new = A_g diag(beta) W, so beta can be
folded into the stored operand), RW-4 (exp2 of base-2 differences), and the block inverse below,
exact algebra whose record is still to be written (proposed WY-5; stage twin
`reference.gdn.fused.solve_tril_nilpotent`, checked against `solve_tril_blocks` / WY-4): with D the
block-diagonal part of (I + L) in 16 x 16 blocks, E the strictly block-lower part and F = D^-1 E
(nilpotent, F^4 = 0),
    (I + L)^-1 = (I + F)^-1 D^-1 = (I - F) (I + F^2) D^-1.

Per CTA (128 threads, one warpgroup):
1. map the slot to (sequence, chunk) (binary search over cu_seqlens for packed input; see `_common`);
2. load the chunk of k (rows past the sequence end are zero), g and beta (zero past the end);
3. g_cum_log2 = cumsum(g) / ln 2 (fp32, in shared memory);
4. K K^T on the tensor cores (bf16/fp16 operands, fp32 accumulate);
5. L = beta_t (k_t . k_s) exp2(g_cum_log2[t] - g_cum_log2[s]) for t > s (the exponent is masked to
   t > s before exp2, so only differences <= 0 are exponentiated);
6. D^-1 by forward substitution, one thread per column of a 16 x 16 diagonal block (fp32, no syncs);
7. four 64 x 64 x 64 GEMMs in tf32 (mma.sync): F = D^-1 E, X = I + F F, G = X - F X, A = G D^-1;
8. store A diag(beta) (input dtype) and g_cum_log2 for all 64 rows of the slot.

Shared memory: 65 KB after TileLang's liveness-based reuse (k with L, D^-1 with X^T): three CTAs
per SM; 116 registers per thread.

This kernel is variant "v1". Variant "v2" (`prepare_v2.py`: one CTA per (chunk slot, q/k head) for
all its value heads, TMA in and out, 56 KB, four CTAs per SM) writes the same outputs and is the
default before v3 since it ran on the H200: A diag(beta) within 1.8e-5 relative RMS of v1 (tf32
rounding order), g_cum_log2 bitwise equal, bitwise repeatable, and 1.2-1.4x faster (16/64 heads
4x8192: 1.175 -> 0.851 ms; 2/8 1x32768: 0.152 -> 0.116 ms; NOTES.md). Variant "v3" (`prepare_v3.py`:
v2 with a block-recursive inverse) is the default since its H200 check (2026-11-30): as close to fp64
as v2 (1.6e-3 relative RMS, the bf16 output rounding), 1.5e-4 from v2, g_cum_log2 bitwise equal,
bitwise repeatable, 1.6-1.9x faster than v2 (16/64 4x8192: 0.852 -> 0.452 ms; the whole forward
1.685 -> 1.285 ms). FLASHQLA_PREPARE=v1 / v2 or `variant=` picks another.
"""


import functools
import os

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, RCP_LN2, SM_COUNT, compile_kernel, locate_slot, num_slots, placeholder, tl_dtype

__all__ = ["DEFAULT_VARIANT", "VARIANTS", "build_prepare_kernel", "chunk_prepare_fwd", "pick_heads_per_cta", "prepare_kernel_args"]

#: Prepare kernel variants: "v1" (this module's kernel: one CTA per (chunk slot, value head)),
#: "v2" (`prepare_v2`: one CTA per (chunk slot, q/k head) for all its value heads), "v3"
#: (`prepare_v3`: v2 with a block-recursive inverse). Same outputs, same layout. ("v4", v3 walking
#: several chunk slots per CTA at G <= 3, was bitwise v3 on the H200 but 0.73-0.97x as fast at
#: G = 1-3 and was removed: NOTES.md, "Prepare variant v4".)
VARIANTS = ("v1", "v2", "v3")
#: The variant `chunk_prepare_fwd` uses when none is given (read at every call; the environment
#: variable FLASHQLA_PREPARE sets it at import). v3: faster on every benchmark row measured.
DEFAULT_VARIANT = os.environ.get("FLASHQLA_PREPARE", "v3")


def _prepare_prim_func(H: int, HV: int, K: int, dtype: str, beta_dtype: str, seq_dtype: str, varlen: bool,
                       _skip: frozenset = frozenset()):
    """`_skip` is a measuring aid only (results are wrong; `tests/gpu/prepare_breakdown.py`): "subst"
    replaces D^-1 by the identity, "gemms" stores D^-1 instead of running the four inverse GEMMs."""
    import tilelang.language as T

    C = CHUNK
    G = HV // H
    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")  # slot rows = slots * 64
    Np1 = T.dynamic("Np1")
    acc = "float32"

    @T.prim_func
    def gdn_prepare_fwd(
        k: T.Tensor((B, Tn, H, K), dtype),
        g: T.Tensor((B, Tn, HV), "float32"),
        beta: T.Tensor((B, Tn, HV), beta_dtype),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        A: T.Tensor((HV, R, C), dtype),
        g_cum_log2: T.Tensor((HV, R), "float32"),
    ):
        with T.Kernel(R // C, HV, threads=128) as (slot, hv):  # slots on x (up to 2^31 - 1)
            seq, chunk, bos, seqlen, bidx, nvalid, t0 = locate_slot(slot, cu_seqlens, Tn, Np1, varlen)

            k_s = T.alloc_shared((C, K), dtype)
            gc_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            l_s = T.alloc_shared((C, C), acc)  # L, later F
            et_s = T.alloc_shared((C, C), acc)  # E^T, later F^T, later G
            dinv_s = T.alloc_shared((C, C), acc)
            dinvt_s = T.alloc_shared((C, C), acc)
            xt_s = T.alloc_shared((C, C), acc)
            kk_f = T.alloc_fragment((C, C), acc)
            f_f = T.alloc_fragment((C, C), acc)
            x_f = T.alloc_fragment((C, C), acc)
            a_f = T.alloc_fragment((C, C), acc)
            xcol = T.alloc_local((16,), acc)

            if nvalid > 0:
                for t, d in T.Parallel(C, K):
                    k_s[t, d] = T.if_then_else(t < nvalid, k[bidx, t0 + t, hv // G, d], T.cast(0, dtype))
                for t in T.Parallel(C):
                    gc_s[t] = T.if_then_else(t < nvalid, g[bidx, t0 + t, hv] * RCP_LN2, T.float32(0))
                    b_s[t] = T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc), T.float32(0))
                T.cumsum(gc_s, dim=0)

                T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
                for t, s in T.Parallel(C, C):
                    l_s[t, s] = T.if_then_else(
                        t > s,
                        b_s[t] * kk_f[t, s] * T.exp2(T.if_then_else(t > s, gc_s[t] - gc_s[s], T.float32(0))),
                        T.float32(0),
                    )
                for t, s in T.Parallel(C, C):
                    et_s[s, t] = T.if_then_else(
                        t // 16 > s // 16,
                        b_s[t] * kk_f[t, s] * T.exp2(T.if_then_else(t > s, gc_s[t] - gc_s[s], T.float32(0))),
                        T.float32(0),
                    )

                # D^-1: thread (blk, col) < 64 solves column col of diagonal block blk.
                tx = T.get_thread_binding()
                if tx < 64:
                    blk = tx // 16
                    col = tx % 16
                    for r in T.unroll(16):
                        xcol[r] = T.if_then_else(r == col, T.float32(1), T.float32(0))
                        if "subst" not in _skip:
                            for m in T.unroll(16):
                                if m < r:
                                    xcol[r] = xcol[r] - l_s[blk * 16 + r, blk * 16 + m] * xcol[m]
                    for rr in T.unroll(C):
                        dinv_s[rr, blk * 16 + col] = T.if_then_else(rr // 16 == blk, xcol[rr % 16], T.float32(0))
                        dinvt_s[blk * 16 + col, rr] = T.if_then_else(rr // 16 == blk, xcol[rr % 16], T.float32(0))

                if "gemms" in _skip:
                    T.copy(dinv_s, a_f)
                else:
                    # F = D^-1 E
                    T.gemm(dinv_s, et_s, f_f, transpose_B=True, clear_accum=True)
                    T.copy(f_f, l_s)
                    for t, s in T.Parallel(C, C):
                        et_s[s, t] = f_f[t, s]
                    # X = I + F F
                    T.gemm(l_s, et_s, x_f, transpose_B=True, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        x_f[t, s] = x_f[t, s] + T.if_then_else(t == s, T.float32(1), T.float32(0))
                    for t, s in T.Parallel(C, C):
                        xt_s[s, t] = x_f[t, s]
                    # G = X - F X
                    T.gemm(l_s, xt_s, f_f, transpose_B=True, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        et_s[t, s] = x_f[t, s] - f_f[t, s]
                    # A = G D^-1
                    T.gemm(et_s, dinvt_s, a_f, transpose_B=True, clear_accum=True)

                for t, s in T.Parallel(C, C):
                    A[hv, slot * C + t, s] = T.cast(T.if_then_else(t >= s, a_f[t, s] * b_s[s], T.float32(0)), dtype)
                for t in T.Parallel(C):
                    g_cum_log2[hv, slot * C + t] = gc_s[t]

    return gdn_prepare_fwd


def build_prepare_kernel(H: int, HV: int, K: int, dtype: str, beta_dtype: str, seq_dtype: str, varlen: bool,
                         variant: str | None = None, heads_per_cta: int | None = None):
    """Compiled prepare kernel for one static configuration (cached).

    Static key: head counts H, HV; head dim K; dtype of k (and of the stored A); beta's dtype;
    cu_seqlens' dtype; whether input is packed (varlen); the variant (`VARIANTS`; None:
    `DEFAULT_VARIANT`); `heads_per_cta` (v3 only; None: all HV / H value heads of a q/k head, 1: one
    value head a CTA, `pick_heads_per_cta`). Sequence lengths,
    the number of sequences and B are run-time values: a new T or sequence mix reuses the compiled
    kernel.
    """
    variant = variant or DEFAULT_VARIANT
    if variant not in VARIANTS:
        raise ValueError(f"prepare variant must be one of {VARIANTS}, got {variant!r}")
    if heads_per_cta == HV // H:
        heads_per_cta = None
    if heads_per_cta is not None and (variant != "v3" or heads_per_cta != 1):
        raise ValueError(f"heads_per_cta must be None or 1 (variant 'v3'), got {heads_per_cta!r} with {variant!r}")
    return _build_prepare_kernel(H, HV, K, dtype, beta_dtype, seq_dtype, varlen, variant, heads_per_cta)


@functools.lru_cache(maxsize=None)
def _build_prepare_kernel(H, HV, K, dtype, beta_dtype, seq_dtype, varlen, variant, heads_per_cta=None):
    """One cache entry per key, whether or not the caller spelled out the default variant."""
    if variant == "v3":
        from flashqla.ops.gdn.kernels.sm90.prepare_v3 import prepare_v3_prim_func

        func = prepare_v3_prim_func(H, HV, K, dtype, beta_dtype, seq_dtype, varlen, heads_per_cta=heads_per_cta)
        return compile_kernel(func, f"gdn_prepare_v3_fwd_H{H}_HV{HV}_K{K}_{dtype}_{beta_dtype}_{seq_dtype}_{int(varlen)}"
                              + ("_one_head" if heads_per_cta == 1 else ""))
    if variant == "v2":
        from flashqla.ops.gdn.kernels.sm90.prepare_v2 import prepare_v2_prim_func

        func = prepare_v2_prim_func(H, HV, K, dtype, beta_dtype, seq_dtype, varlen)
        return compile_kernel(func, f"gdn_prepare_v2_fwd_H{H}_HV{HV}_K{K}_{dtype}_{beta_dtype}_{seq_dtype}_{int(varlen)}")
    func = _prepare_prim_func(H, HV, K, dtype, beta_dtype, seq_dtype, varlen)
    return compile_kernel(func, f"gdn_prepare_fwd_H{H}_HV{HV}_K{K}_{dtype}_{beta_dtype}_{seq_dtype}_{int(varlen)}")


#: `pick_heads_per_cta` takes one value head a CTA while the grid of one CTA per chunk slot and q/k
#: head has at most this many CTAs (two per SM).
ONE_HEAD_MAX_CTAS = 2 * SM_COUNT


def pick_heads_per_cta(S: int, H: int, HV: int, variant: str | None = None) -> int | None:
    """Value heads a v3 prepare CTA takes for S chunk slots: 1 (one CTA per slot and value head) when
    G = HV / H > 1 and the S x H grid of one CTA per slot and q/k head has at most ONE_HEAD_MAX_CTAS
    CTAs, else None (all G value heads: K K^T formed once for them).

    Measured on the H200 (tests/gpu/prepare_heads_check.py, packed input, ms; NOTES.md): 2/8 x 2048
    tokens (66 CTAs against 264) 0.0201 -> 0.0084, 4/16 x 2048 (132 / 528) 0.0205 -> 0.0106, 2/8 x 4 x
    2048 (264 / 1056) 0.0223 -> 0.0189, 8/24 x 2048 (264 / 792) 0.0183 -> 0.0180; 16/32 x 2048 (528 /
    1056) 0.0162 -> 0.0192, slower: K K^T formed twice costs more than the SMs it fills."""
    variant = variant or DEFAULT_VARIANT
    if variant != "v3" or HV // H == 1 or S * H > ONE_HEAD_MAX_CTAS:
        return None
    return 1


def prepare_kernel_args(k, beta, cu_seqlens, HV: int, variant: str | None = None) -> tuple:
    """The static key (`build_prepare_kernel` arguments) a launch with these inputs uses
    (variant None: `DEFAULT_VARIANT`). The key ends with 1 where `pick_heads_per_cta` takes one value
    head a CTA (the slot count comes from shapes alone: no host synchronisation)."""
    B, T, H, K = k.shape
    seq_dtype = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
    variant = variant or DEFAULT_VARIANT
    key = (H, HV, K, tl_dtype(k.dtype), tl_dtype(beta.dtype), seq_dtype, cu_seqlens is not None, variant)
    N = cu_seqlens.numel() - 1 if cu_seqlens is not None else B
    one = pick_heads_per_cta(num_slots(B, T, N, cu_seqlens is not None), H, HV, variant)
    return key + (one,) if one else key


def dummy_cu_seqlens(device) -> torch.Tensor:
    """A 1-element int32 placeholder for the cu_seqlens argument of fixed-length launches."""
    return placeholder((1,), torch.int32, device)


def chunk_prepare_fwd(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens, HV: int, A=None, g_cum_log2=None,
                      variant: str | None = None):
    """Launches the prepare kernel. Arguments as in `chunk_gated_delta_rule` (already validated,
    contiguous, on an sm_90 device). `A` and `g_cum_log2` may be given as preallocated outputs of
    the shapes below (tests poison them to prove every used row is written). `variant` picks the
    kernel (`VARIANTS`; None: `DEFAULT_VARIANT`, env FLASHQLA_PREPARE); both write the same outputs.

    Returns:
        A: [HV, S * 64, 64] in k's dtype, S = number of chunk slots (`_common.num_slots`); rows
            slot * 64 + t hold row t of chunk slot's A diag(beta) (lower triangular, zero rows past
            the end of the sequence).
        g_cum_log2: [HV, S * 64] fp32, chunk-local inclusive cumsum of g divided by ln 2 (rows past
            the end of the sequence repeat the last valid value).
    """
    B, T, H, K = k.shape
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    S = num_slots(B, T, N, varlen)
    if A is None:
        A = torch.empty(HV, S * CHUNK, CHUNK, dtype=k.dtype, device=k.device)
    if g_cum_log2 is None:
        g_cum_log2 = torch.empty(HV, S * CHUNK, dtype=torch.float32, device=k.device)
    if S == 0 or T == 0:
        return A, g_cum_log2
    cu = cu_seqlens if varlen else dummy_cu_seqlens(k.device)
    kernel = build_prepare_kernel(*prepare_kernel_args(k, beta, cu_seqlens, HV, variant))
    kernel(k, g, beta, cu, A, g_cum_log2)
    return A, g_cum_log2

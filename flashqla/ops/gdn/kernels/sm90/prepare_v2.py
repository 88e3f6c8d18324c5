"""Prepare kernel, variant "v2": one CTA per (chunk slot, q/k head) for all G = HV / H value heads of
the group. Same outputs and slot layout as "v1" (`prepare.py`); selected by
`chunk_prepare_fwd(variant="v2")` or FLASHQLA_PREPARE=v2. Compiled and inspected on CPU only: not yet
run on a GPU (NOTES.md); v1 stays the default until it is.

Covers the reference stages (FLA's names, `reference.gdn.chunk`):
    chunk_local_cumsum   -> g_cum_log2 (chunk-local inclusive cumsum of g, in base-2 units)
    chunk_scaled_dot_kkt -> L = strictly_lower(diag(beta) (K K^T) * Gamma), per value head
    solve_tril           -> A = (I + L)^-1 (gated, as FLA's A)
and stores A diag(beta) (k's dtype) and g_cum_log2, as v1.
Stage twin: `reference.gdn.fused.prepare_group` (one chunk of one q/k head and its G value heads, in
this kernel's order; checked in fp64 against the stages above by tests/test_kernels_compile.py).
Derivation records relied on (`python -m derivations`): CF-1..CF-3 (chunk form with FLA's gated A),
WY-3 (forward substitution in the 16 x 16 diagonal blocks), WY-5 ((I + L)^-1 = (I - F)(I + F^2) D^-1,
F = D^-1 E; here G = (I - F) X is one product, where v1 forms X - F X), RW-2 (beta folded into the
stored operand), RW-4 (exp2 of base-2 differences). Sharing K K^T across the value heads of a group
is no rewrite: value head hv reads q/k head hv // G (the op's GVA definition).

What changes against v1 (NOTES.md, "Prepare kernel: where its time goes"):
1. grid (slots, H) instead of (slots, HV): the k tile is loaded once per G value heads by the copy
   engine (TMA, waited only after g and beta are loaded; rows past the end of the tensor are
   zero-filled, rows past the end of a packed sequence hold the next sequence's keys and are masked
   in L) and K K^T is formed once (wgmma; its fp32 accumulators stay in registers for all G heads);
2. g and beta of the G value heads are loaded together (G consecutive floats per token) and one 2-D
   cumsum scans all G rows;
3. L is formed once per element (one exp2; v1 evaluated every exponential twice): its diagonal
   16 x 16 blocks go to a compact tile for the substitution, its strictly block-lower part
   transposed (E^T) to the GEMM operand;
4. D^-1 is kept as a compact [64, 17] tile and expanded into the GEMM operands (D^-1 for
   F = D^-1 E, D^-T for A = G D^-1) by all 128 threads, instead of 64 threads writing two full tiles;
5. one accumulator fragment live per GEMM (F goes to shared memory, G = (I - F) X) and the GEMMs'
   K loops kept rolled, so the kernel fits 128 registers with K K^T held;
6. A diag(beta) is staged as a bf16 tile in shared memory and stored by one TMA store per value
   head, instead of 32 scalar 2-byte stores per thread;
7. three fp32 64 x 64 tiles reused by hand (the value-head loop hides lifetimes from TileLang's
   planner): 54.25 KB dynamic + 1 KB static shared memory at G = 4, launch bounds (128, 4):
   four CTAs per SM (v1: 64.5 KB, three).
ptxas (sm_90a, CUDA 13.0; `_common.ptxas_report`): 128 registers, no spills at G = 1, 2 (H = 2),
4 and 8; 4 B (one value) at H = 1, HV = 2 packed. The inverse GEMMs run their K loop as a rolled
loop over 16-wide slices (`gemm_nt`, same products in the same order): with TileLang's fully
unrolled K loop ptxas hoisted the ~32 swizzled operand addresses out of the value-head loop and
spilled them (~136 B). `min_blocks=3` (or less) builds it uncapped: 161 registers, three CTAs per
SM (`tests/gpu/prepare_v2_check.py` times both).

Per CTA (128 threads, one warpgroup):
1. map the slot to (sequence, chunk) (binary search over cu_seqlens for packed input; `_common`);
2. issue the TMA load of the k tile of q/k head hk; load g and beta of value heads
   hk*G .. hk*G+G-1 (zero past the end); wait for k; g_cum_log2 = cumsum(g) / ln 2 for all G heads;
3. K K^T on the tensor cores (wgmma);
4. per value head j: L (diagonal blocks + E^T) -> D^-1 by forward substitution (64 threads, one
   column of a diagonal block each) -> F = D^-1 E, X = I + F F, G = (I - F) X, A = G D^-1 (tf32
   mma.sync) -> A diag(beta) through the bf16 staging tile, TMA store;
5. g_cum_log2 of the G heads (64 contiguous floats per head).
"""

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, RCP_LN2, locate_slot

__all__ = ["prepare_v2_prim_func"]

#: Diagonal block size of the block inverse (WY-5) and the padded row length of the compact tiles.
BLOCK = 16
_PAD = BLOCK + 1  # 17 floats per row: rows of different diagonal blocks fall in different banks
#: CTAs per SM the kernel is built for (registers capped at 65536 / (128 * MIN_BLOCKS) per thread;
#: shared memory <= 56 KB)
MIN_BLOCKS = 4
#: K slice of the tf32 inverse GEMMs (`gemm_nt`)
KSLICE = 16


def prepare_v2_prim_func(H: int, HV: int, K: int, dtype: str, beta_dtype: str, seq_dtype: str, varlen: bool,
                         min_blocks: int = MIN_BLOCKS, _skip: frozenset = frozenset()):
    """The v2 kernel for one static configuration. `min_blocks` is the CTAs-per-SM hint of the launch
    bounds (4: 128 registers; 3 or less: 161, uncapped), a tuning knob for the GPU timing
    (`tests/gpu/prepare_v2_check.py`). `_skip` is a measuring aid only (results are wrong), as in
    v1: "subst" replaces D^-1 by the identity, "gemms" stores D^-1 instead of running the four
    inverse GEMMs."""
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout

    C = CHUNK
    G = HV // H
    BS = BLOCK
    acc = "float32"
    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")  # slot rows = slots * 64
    Np1 = T.dynamic("Np1")

    @T.macro
    def gemm_nt(a, b, c):
        """c = a b^T over K = 64 in slices of KSLICE, the slice loop kept rolled (unrolled, ptxas
        hoists every slice's swizzled operand addresses out of the value-head loop and spills them)."""
        T.clear(c)
        for kk in T.unroll(C // KSLICE, unroll_factor=1):
            T.gemm(a[:, kk * KSLICE : (kk + 1) * KSLICE], b[:, kk * KSLICE : (kk + 1) * KSLICE], c, transpose_B=True)

    @T.prim_func
    def gdn_prepare_v2_fwd(
        k: T.Tensor((B, Tn, H, K), dtype),
        g: T.Tensor((B, Tn, HV), "float32"),
        beta: T.Tensor((B, Tn, HV), beta_dtype),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        A: T.Tensor((HV, R, C), dtype),
        g_cum_log2: T.Tensor((HV, R), "float32"),
    ):
        with T.Kernel(R // C, H, threads=128) as (slot, hk):  # slots on x (up to 2^31 - 1)
            T.annotate_min_blocks_per_sm(min_blocks)
            seq, chunk, bos, seqlen, bidx, nvalid, t0 = locate_slot(slot, cu_seqlens, Tn, Np1, varlen)
            row0 = slot * C

            # Three fp32 64 x 64 tiles, reused by hand (the value-head loop hides the lifetimes from
            # TileLang's shared-memory planner): et_s also holds the k tile before the loop, f_s also
            # holds the diagonal blocks of L and the bf16 staging tile of A.
            f_s = T.alloc_shared((C, C), acc)  # L blocks; F (left operand of F F); G; A staged
            et_s = T.alloc_shared((C, C), acc)  # k (bf16, before the loop); E^T, then F^T, then I - F
            d_s = T.alloc_shared((C, C), acc)  # D^-1, then X^T, then D^-T
            di_s = T.alloc_shared((C, _PAD), acc)  # diagonal 16 x 16 blocks of D^-1: [t, s % 16]
            gc_s = T.alloc_shared((G, C), acc)  # g_cum_log2 of the G value heads, head-major
            b_s = T.alloc_shared((G, C), acc)
            k_s = T.view(et_s, (C, K), dtype)
            ld_s = T.view(f_s, (C, C), acc)  # diagonal blocks of L: [t, s % 16]
            a_st = T.view(f_s, (C, 2 * C), dtype)  # [:, :64]: A diag(beta) in k's dtype, staged for the store
            T.annotate_layout({a_st: make_swizzled_layout(a_st)})
            kk_f = T.alloc_fragment((C, C), acc)
            f_f = T.alloc_fragment((C, C), acc)
            x_f = T.alloc_fragment((C, C), acc)
            a_f = T.alloc_fragment((C, C), acc)
            xcol = T.alloc_local((BS,), acc)
            k_bar = T.alloc_barrier(128)  # every thread arrives; the copy engine completes the bytes

            if nvalid > 0:
                # k by the copy engine (zero-filled past the end of the tensor; rows past the end of
                # a packed sequence hold the next sequence's keys and are masked in L below)
                T.tma_copy(k[bidx, t0 : t0 + C, hk, 0:K], k_s, barrier=k_bar)  # waited after g and beta
                T.barrier_arrive(k_bar)
                for t, j in T.Parallel(C, G):
                    gc_s[j, t] = T.if_then_else(t < nvalid, g[bidx, t0 + t, hk * G + j] * RCP_LN2, T.float32(0))
                    b_s[j, t] = T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hk * G + j], acc), T.float32(0))
                T.mbarrier_wait_parity(k_bar, 0)
                T.cumsum(gc_s, dim=1)
                T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)

                for j in T.serial(G):
                    # L = beta_t (k_t . k_s) exp2(gc[t] - gc[s]) for s < t < nvalid, formed once:
                    # diagonal blocks -> ld_s, strictly block-lower part transposed -> et_s (E^T)
                    for t, s in T.Parallel(C, C):
                        lv = T.if_then_else(
                            (t > s) & (t < nvalid),
                            b_s[j, t] * kk_f[t, s] * T.exp2(T.if_then_else(t > s, gc_s[j, t] - gc_s[j, s], T.float32(0))),
                            T.float32(0),
                        )
                        if t // BS == s // BS:
                            ld_s[t, s % BS] = lv
                        et_s[s, t] = T.if_then_else(t // BS > s // BS, lv, T.float32(0))

                    # D^-1: thread (blk, col) < 64 solves column col of diagonal block blk (WY-3)
                    tx = T.get_thread_binding()
                    if tx < C:
                        blk = tx // BS
                        col = tx % BS
                        for r in T.unroll(BS):
                            xcol[r] = T.if_then_else(r == col, T.float32(1), T.float32(0))
                            for m in T.unroll(BS if "subst" not in _skip else 0):
                                if m < r:
                                    xcol[r] = xcol[r] - ld_s[blk * BS + r, m] * xcol[m]
                        for r in T.unroll(BS):
                            di_s[blk * BS + r, col] = xcol[r]

                    if "gemms" in _skip:
                        for t, s in T.Parallel(C, C):
                            a_f[t, s] = T.if_then_else(t // BS == s // BS, di_s[t, s % BS], T.float32(0))
                    else:
                        # F = D^-1 E (WY-5)
                        for t, s in T.Parallel(C, C):
                            d_s[t, s] = T.if_then_else(t // BS == s // BS, di_s[t, s % BS], T.float32(0))
                        gemm_nt(d_s, et_s, f_f)
                        T.copy(f_f, f_s)
                        for t, s in T.Parallel(C, C):
                            et_s[s, t] = f_f[t, s]
                        # X = I + F F  (F no longer held in registers: one accumulator per GEMM)
                        gemm_nt(f_s, et_s, x_f)
                        for t, s in T.Parallel(C, C):
                            d_s[s, t] = x_f[t, s] + T.if_then_else(t == s, T.float32(1), T.float32(0))
                        # G = X - F X = (I - F) X  (WY-5's (I - F) factor as the left operand)
                        for t, s in T.Parallel(C, C):
                            et_s[t, s] = T.if_then_else(t == s, T.float32(1), T.float32(0)) - f_s[t, s]
                        gemm_nt(et_s, d_s, x_f)
                        T.copy(x_f, f_s)
                        # A = G D^-1 (right operand D^-T, expanded from the compact blocks)
                        for t, s in T.Parallel(C, C):
                            d_s[s, t] = T.if_then_else(t // BS == s // BS, di_s[t, s % BS], T.float32(0))
                        gemm_nt(f_s, d_s, a_f)

                    # A diag(beta), lower triangle, through shared memory to whole-row stores
                    for t, s in T.Parallel(C, C):
                        a_st[t, s] = T.cast(T.if_then_else(t >= s, a_f[t, s] * b_s[j, s], T.float32(0)), dtype)
                    T.fence_proxy_async()
                    T.copy(a_st[:, 0:C], A[hk * G + j, row0 : row0 + C, 0:C])

                for j, t in T.Parallel(G, C):
                    g_cum_log2[hk * G + j, row0 + t] = gc_s[j, t]

    return gdn_prepare_v2_fwd

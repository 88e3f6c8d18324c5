"""Prepare kernel, variant "v4": v3's arithmetic (the same products in the same order, so the same
bits of A diag(beta) and g_cum_log2 for every slot), with one CTA walking CPS consecutive chunk slots
of one q/k head instead of one. Not the default; `chunk_prepare_fwd(variant="v4")` or
FLASHQLA_PREPARE=v4 selects it, `tests/gpu/prepare_v3_check.py --base v3 --new v4` checks it.

Why (NOTES.md, "What small G costs, measured"): v3's CTA does per chunk slot a part that its G value
heads share (the slot search over cu_seqlens, k's load, g and beta, zero fills, K K^T, the cumsum),
~2.4 us of CTA time against ~5.5 us per value head; at G = 1 a value head then costs 1.3x what it
costs at G = 4, and the G <= 3 rows of the forward grid are 2-5% slower than FlashQLA's forward.

What changes against v3 (the per-head stages, L, the forward substitution, phases 1-3, the stores,
are v3's: the same code, `prepare_v3.value_head_stages`):
1. grid (ceil(S / CPS), H); CTA (bx, hk) walks slots bx CPS .. bx CPS + CPS - 1 (those < S);
2. k has its own tile and the A diag(beta) staging tile its own 8 KB (v3 staged A in k's tile): the
   next slot's k is loaded by TMA right after this slot's K K^T, under the value heads' work; the
   next slot is located then (the search over cu_seqlens) and its place carried to it, so a slot
   costs one search (two after a gap slot, which looks nothing up);
3. the zero blocks of the block-diagonal operands and of the staging tile are written once per CTA;
4. one mbarrier for k, its phase carried across slots; a slot in a gap loads nothing and waits for
   nothing, and the slot after a gap loads its own k (no prefetch was issued for it).
Shared memory: v3's + 8 KB for the staging tile - 2.5 KB (-Z_top^T of phases 1-2 lives in the first 32
rows of the tile of L's diagonal blocks, dead by then): 55,552 B dynamic at G = 1, 56,320 at G = 2
(four CTAs an SM, as v3), 56,832 at G = 3 (three).
CPS = `chunks_per_cta(G)`: 4 at G = 1, 2 at G = 2 and 3; from G = 4 (one slot per CTA) the
variant builds v3's kernel (`prepare._build_prepare_kernel`). Stage twin: `reference.gdn.fused.prepare_group_recursive`, per slot, as v3.
"""

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, RCP_LN2, locate_slot
from flashqla.ops.gdn.kernels.sm90.prepare_v3 import BLOCK, DROW, HALF, KSLICE, ROW, value_head_stages

__all__ = ["chunks_per_cta", "prepare_v4_prim_func"]


def chunks_per_cta(G: int) -> int:
    """Chunk slots one CTA walks at G value heads per q/k head."""
    return 4 if G == 1 else (2 if G <= 3 else 1)


def prepare_v4_prim_func(H: int, HV: int, K: int, dtype: str, beta_dtype: str, seq_dtype: str, varlen: bool,
                         min_blocks: int | None = None, cps: int | None = None):
    """The v4 kernel for one static configuration: v3's per-slot stages (see prepare_v3.py for
    each), CPS slots per CTA (`chunks_per_cta(HV // H)` unless `cps` is given); `min_blocks` the
    CTAs-per-SM hint of the launch bounds (None: 4 at G <= 2, 3 at G = 3, what the shared memory allows)."""
    import tilelang.language as T
    from tilelang.layout import make_linear_layout

    C = CHUNK
    G = HV // H
    CPS = cps or chunks_per_cta(G)
    if min_blocks is None:  # the shared memory allows four CTAs an SM at G <= 2 (56,320 B), three above
        min_blocks = 4 if G <= 2 else 3
    BS = BLOCK
    HB = HALF
    acc = "float32"
    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")  # slot rows = slots * 64
    Np1 = T.dynamic("Np1")

    @T.macro
    def gemm_nt(a, b, c, a_row0=0):
        """c = a[a_row0 : a_row0 + 32, :32] b[:, :32]^T in rolled slices of KSLICE (as v3)."""
        T.clear(c)
        for kk in T.unroll(HB // KSLICE, unroll_factor=1):
            T.gemm(a[a_row0 : a_row0 + HB, kk * KSLICE : (kk + 1) * KSLICE], b[:, kk * KSLICE : (kk + 1) * KSLICE], c,
                   transpose_B=True)

    @T.prim_func
    def gdn_prepare_v4_fwd(
        k: T.Tensor((B, Tn, H, K), dtype),
        g: T.Tensor((B, Tn, HV), "float32"),
        beta: T.Tensor((B, Tn, HV), beta_dtype),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        A: T.Tensor((HV, R, C), dtype),
        g_cum_log2: T.Tensor((HV, R), "float32"),
    ):
        with T.Kernel(T.ceildiv(R // C, CPS), H, threads=128) as (bx, hk):
            T.annotate_min_blocks_per_sm(min_blocks)
            S = R // C

            k_s = T.alloc_shared((C, K), dtype)  # k of the current slot; the next slot's once K K^T is done
            st_s = T.alloc_shared((C, C), dtype)  # A diag(beta) staged for the TMA store
            dm_s = T.alloc_shared((3 * BS, ROW), acc)  # rows: [Ai22 | 0], [0 | Ai33], [Ai11 | 0]
            lbt_s = T.alloc_shared((HB, ROW), acc)  # Lb^T [s, t - 32]; then Q
            b0t_s = T.alloc_shared((HB, ROW), acc)  # (B_0^-1)^T
            y_s = T.alloc_shared((HB, ROW), acc)  # blockdiag(F10, F32)
            l2t_s = T.alloc_shared((BS, ROW), acc)  # [L10; L32]^T
            d2t_s = T.alloc_shared((BS, ROW), acc)  # [Ai00; Ai22]^T
            # diagonal blocks of L, transposed: [s, t % 16] (L formation -> substitution); its first 32
            # rows then hold -Z_top^T (phase 1 -> phase 2: v3's zt_s, same row length), 2.5 KB less
            # shared memory, which keeps four CTAs an SM at G <= 2
            ld_s = T.alloc_shared((C, DROW), acc)
            gc_s = T.alloc_shared((G, C), acc)
            b_s = T.alloc_shared((G, C), acc)
            T.annotate_layout({x: make_linear_layout(x) for x in (dm_s, lbt_s, b0t_s, y_s, ld_s, l2t_s, d2t_s)})
            kk_f = T.alloc_fragment((C, C), acc)
            g_row = T.alloc_fragment((C,), acc)
            g_col = T.alloc_fragment((C,), acc)
            b_row = T.alloc_fragment((C,), acc)
            y_f = T.alloc_fragment((HB, BS), acc)
            w_f = T.alloc_fragment((HB, BS), acc)
            z_f = T.alloc_fragment((HB, HB), acc)
            o_f = T.alloc_fragment((HB, HB), acc)
            xcol = T.alloc_local((BS,), acc)
            k_bar = T.alloc_barrier(128)  # every thread arrives; the copy engine completes the bytes
            phase = T.alloc_var("int32")  # parity of k_bar's next completion
            pending = T.alloc_var("int32")  # the current slot's k load has been issued
            # the current slot's place (rows in it, first token, batch row), carried over from the slot
            # before (its look-ahead for the prefetch) unless that one was a gap: one search per slot
            known = T.alloc_var("int32")
            c_nvalid = T.alloc_var("int32")
            c_t0 = T.alloc_var("int32")
            c_bidx = T.alloc_var("int32")
            a_nvalid = T.alloc_var("int32")  # the look-ahead's, moved to c_* at the slot's end
            a_t0 = T.alloc_var("int32")
            a_bidx = T.alloc_var("int32")
            phase = 0
            pending = 0

            # blocks no slot or value head writes, zeroed once per CTA (v3: once per slot)
            for t, s in T.Parallel(3 * BS, HB):
                dm_s[t, s] = T.float32(0)
            for t, s in T.Parallel(HB, HB):
                y_s[t, s] = T.float32(0)
                b0t_s[t, s] = T.float32(0)
            for t, s in T.Parallel(C, C):
                st_s[t, s] = T.cast(0, dtype)

            # the first slot's k
            f_seq, f_chunk, f_bos, f_seqlen, f_bidx, f_nvalid, f_t0 = locate_slot(bx * CPS, cu_seqlens, Tn, Np1, varlen)
            c_nvalid = f_nvalid
            c_t0 = f_t0
            c_bidx = f_bidx
            known = 1
            if f_nvalid > 0:
                T.tma_copy(k[f_bidx, f_t0 : f_t0 + C, hk, 0:K], k_s, barrier=k_bar)
                T.barrier_arrive(k_bar)
                pending = 1

            for i in T.serial(CPS):
                slot = bx * CPS + i
                if slot < S:
                    if known == 0:  # the slot before was a gap: no look-ahead was made
                        s_seq, s_chunk, s_bos, s_seqlen, s_bidx, s_nvalid, s_t0 = locate_slot(slot, cu_seqlens, Tn, Np1, varlen)
                        c_nvalid = s_nvalid
                        c_t0 = s_t0
                        c_bidx = s_bidx
                    known = 0
                    nvalid = c_nvalid
                    t0 = c_t0
                    bidx = c_bidx
                    row0 = slot * C
                    if nvalid > 0:
                        if pending == 0:  # the slot before was a gap (no prefetch): load k now
                            T.tma_copy(k[bidx, t0 : t0 + C, hk, 0:K], k_s, barrier=k_bar)
                            T.barrier_arrive(k_bar)
                        for t, j in T.Parallel(C, G):
                            gc_s[j, t] = T.if_then_else(t < nvalid, g[bidx, t0 + t, hk * G + j] * RCP_LN2, T.float32(0))
                            b_s[j, t] = T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hk * G + j], acc), T.float32(0))
                        T.mbarrier_wait_parity(k_bar, phase)
                        phase = 1 - phase
                        pending = 0
                        T.cumsum(gc_s, dim=1)
                        T.gemm(k_s, k_s, kk_f, transpose_B=True, clear_accum=True)
                        # k is dead: the next slot's k by the copy engine, under this slot's value heads
                        if (i + 1 < CPS) & (slot + 1 < S):
                            n_seq, n_chunk, n_bos, n_seqlen, n_bidx, n_nvalid, n_t0 = locate_slot(slot + 1, cu_seqlens, Tn, Np1, varlen)
                            if n_nvalid > 0:
                                T.tma_copy(k[n_bidx, n_t0 : n_t0 + C, hk, 0:K], k_s, barrier=k_bar)
                                T.barrier_arrive(k_bar)
                                pending = 1
                            a_nvalid = n_nvalid
                            a_t0 = n_t0
                            a_bidx = n_bidx
                            known = 1

                        for j in T.serial(G):
                            # v3's stages for value head hk * G + j (-Z_top^T over the tile of L's diagonal blocks, A staged in st_s)
                            value_head_stages(T, j=j, G=G, hk=hk, nvalid=nvalid, row0=row0, A=A, dtype=dtype, gemm_nt=gemm_nt, kk_f=kk_f,
                                              gc_s=gc_s, b_s=b_s, g_row=g_row, g_col=g_col, b_row=b_row, ld_s=ld_s, lbt_s=lbt_s,
                                              l2t_s=l2t_s, d2t_s=d2t_s, b0t_s=b0t_s, dm_s=dm_s, y_s=y_s, zt=ld_s, stage=st_s, y_f=y_f,
                                              w_f=w_f, z_f=z_f, o_f=o_f, xcol=xcol)
                        T.tma_store_wait(0)

                        for j, t in T.Parallel(G, C):
                            g_cum_log2[hk * G + j, row0 + t] = gc_s[j, t]
                        if known == 1:  # this slot is done with c_*: the next one's place
                            c_nvalid = a_nvalid
                            c_t0 = a_t0
                            c_bidx = a_bidx

    return gdn_prepare_v4_fwd

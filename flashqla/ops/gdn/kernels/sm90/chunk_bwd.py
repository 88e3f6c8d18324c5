"""Backward pass 2 of 3: every gradient of every chunk, one CTA of 512 threads per (sequence, value
head), chunks in reverse order, the state gradient dS [K, V] fp32 in registers; the products split
over three consumer warpgroups with their own roles and a TMA producer warp, synchronised by mbarriers
that name each cross-role dependency (no warpgroup waits for a product it does not use).

Reference stage: `reference.gdn.fused_bwd.chunk_bwd_fused` (records BWD-Abeta, BWD-fused, BWD-dq,
BWD-dG). Per chunk, with S0 = h (pass 1), D = dS (gradient of the chunk-end state), gamma, r, Gamma
from g_cum_log2 by exp2 (RW-4; every exponent a difference <= 0, masked before exp2):
    Kg = (K K^T) * Gamma_strict;  A = I - A_beta Kg;  U = K S0;  W = V - D U;  v_new = A_beta W
    dv_new = scale (Q K^T * Gamma)^T dO + diag(r) K D
    X = A^T dv_new;  dv = A_beta^T dv_new + diag(beta - round(beta)) dv_new  (the stored diagonal of
        A_beta is beta rounded to q's dtype: dv takes the exact one)
    M = (dO v_new^T) * Gamma;  dq = scale (diag(gamma) dO S0^T + M K)
    dL = -tril_-1(X v_new^T) * Gamma;  dk = diag(r) v_new D^T + scale M^T Q - diag(gamma) dv S0^T
         + diag(beta) dL K + dL^T diag(beta) K
    dbeta = rowsum(X * W) + rowsum((dL K) * K)
    dG (dL/dg_cum, before the reverse cumsum of pass 3), the cancellation-free form, with the
         chunk-end terms at the last VALID row
    dS <- gamma_C dS + scale Q^T diag(gamma) dO - K^T diag(gamma) dv       (dh0 after the first chunk)

Roles:

    S  (threads   0-127) dS [K, V] fp32 in registers: D's copy in q's dtype, <S0, D>, gamma_C dS,
                         + Q^T (scale diag(gamma) dO), + K^T (-diag(gamma) dv); dh0; the chunk's dG row
                         and dbeta from the roles' partial sums
    K  (threads 128-255) dv_new = diag(r) K D + Pg^T dO; dv = A_beta^T dv_new (+ the exact diagonal);
                         -diag(gamma) dv; dk = diag(r) v_new D^T + (-diag(gamma) dv) S0^T
                         + beta (dLk K) + (diag(beta) dLk)^T K + (scale M Gamma)^T Q;
                         dq = scale diag(gamma) dO S0^T + (scale M Gamma) K; their dG / dbeta rows
    A  (threads 256-383) Pg, Kg, A = I - A_beta Kg, U = K S0, W, X = A^T dv_new, v_new, dL, M;
                         their dG rows, columns and dbeta rows
    P  (threads 384-511) one warp: TMA loads of the next chunk's g, A_beta, v and k, q, h, dO, each
                         group as soon as its last reader released it (k and q then arrive on their own
                         barrier, before h and dO)

Every product is one warpgroup's full-width wgmma, row sums stay inside a warp, the next chunk's
tiles are loaded by TMA while the roles still work. rowsum(-diag(gamma) dv * U) is formed as
rowsum(((-diag(gamma) dv) S0^T) * K) from dk's own product (U = K S0), and dq's first term is
(dO S0^T) scaled by scale * gamma in fp32.

Outputs: dq_hv, dk_hv [B, T, HV, K] fp32 per value head (pass 3 sums the GVA groups and rounds), dv
[B, T, HV, V] in v's dtype, dbeta [B, T, HV] fp32, dG [HV, S * 64] fp32 slot-major, dh0 [N, HV, K, V]
fp32; every row written (`_common.launch_pass2`). The sequence's last chunk (the first walked; the
only one that may be partial) is loaded by every thread with rows past the end zeroed, before the
roles split; the producer loads the earlier, full chunks by TMA.

Resources: the whole 232,448 B of shared memory (several results reuse dead tiles, listed at the
tiles), setmaxnreg per role (`NREG_BY_VARLEN`). Covers K = V = 128, bf16 and fp16 inputs: h (pass 1,
`states_bwd`) and every operand tile (D, Pg, Kg, A, W, v_new, dv_new, ...) in q's dtype, accumulation
in fp32 (an fp16 build has the same tiles, bytes and schedule as the bf16 one).
"""

import functools

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, launch_pass2, sequence_span, tl_dtype

__all__ = ["DEFAULT_OPTS", "DH0_OPTS", "OPTS", "build_chunk_bwd_kernel", "build_options", "chunk_bwd_kernel_args", "chunk_fused_bwd"]

#: Registers per thread of each role (setmaxnreg), by packed input (cu_seqlens) or not. The CTA launches
#: with 128 a thread (65,536 / 512); the producer gives back 104, which the consumers take. Packed builds
#: (every launch of the benchmarks, the split backward's segments included) give A 8 of K's: the
#: fastest of the splits measured, with bitwise the same gradients (`benchmarks/journal/backward.md`,
#: "Registers moved from K to A"). Fixed-length builds keep 184 / 144 (not measured).
NREG_BY_VARLEN = {True: {"S": 160, "K": 176, "A": 152, "P": 24}, False: {"S": 160, "K": 184, "A": 144, "P": 24}}


#: Build options (a string of these letters; `build_options` picks them per launch):
#: "d": S publishes the next chunk's D as soon as dS is complete, before its chunk-end sums wait for
#:      K's and A's partial rows (K's next chunk starts on D); K and A then wait for S's reads of those
#:      rows (`s_done`) before writing the next chunk's;
#: "a": K publishes -diag(gamma) dv before storing dv; takes (-diag(gamma) dv) S0^T right after
#:      v_new D^T and sums its dG rows and the r-terms in one pass; issues (diag(beta) dLk)^T K and
#:      (scale M Gamma)^T Q together;
#: "g": (with "a") K's (scale M Gamma) K runs while dq's dG rows sum.
#: "l": S forms Q^T (scale diag(gamma) dO) from the pair hi + lo of the scaled dO in q's dtype (hi its
#:      rounding, lo the rounding of the remainder), two products into dS over the same tile, instead of
#:      hi alone: the state gradient's only product whose operand is rounded from a computed value that
#:      FLA keeps in fp32 (its dhu kernel: q diag(gamma) in fp32, a tf32 product).
OPTS = "dagl"
#: The options each build takes, by packed input (cu_seqlens) or not, when the call returns no dh0
#: (packed builds reorder K's tail; fixed-length builds keep the plain schedule, which ptxas
#: allocates better there).
DEFAULT_OPTS = {True: "dag", False: ""}
#: Added to `DEFAULT_OPTS` when the backward returns dh0 (an initial state whose gradient is used):
#: dh0's precision at long T, for a few per cent of the backward. Without it dh0 is still written.
DH0_OPTS = "l"


def build_options(varlen: bool, dh0: bool) -> str:
    """The build options of a launch: `DEFAULT_OPTS[varlen]`, plus `DH0_OPTS` when the call returns
    dh0, as letters in `OPTS` order."""
    opts = DEFAULT_OPTS[bool(varlen)] + (DH0_OPTS if dh0 else "")
    return "".join(c for c in OPTS if c in opts)


def _chunk_bwd_prim_func(H: int, HV: int, K: int, V: int, dtype: str, beta_dtype: str, seq_dtype: str, varlen: bool,
                         opts: str):
    """The TileLang kernel (arguments as `build_chunk_bwd_kernel`; opts: `build_options`)."""
    import tilelang.language as T

    if set(opts) - set(OPTS) or ("g" in opts and "a" not in opts):
        raise ValueError(f"build options must be letters of {OPTS!r} ('g' with 'a'), got {opts!r}")
    early_d, async_k, over_gk, dog_lo = "d" in opts, "a" in opts, "g" in opts, "l" in opts
    nreg = NREG_BY_VARLEN[bool(varlen)]

    if K != 128 or V != 128 or dtype not in ("bfloat16", "float16"):
        raise ValueError(f"pass 2 needs K = V = 128 and bf16/fp16 inputs, got K={K}, V={V}, {dtype}")
    h_dtype = dtype  # pass 1 (`states_bwd`) stores h in the inputs' dtype
    # beta in q's dtype: the stored diagonal of A_beta is beta exactly, nothing to restore
    exact_diagonal = beta_dtype != dtype
    qk_dtype = "float32"  # dq_hv / dk_hv per value head, summed over a GVA group and rounded by pass 3
    C = CHUNK
    G = HV // H
    acc = "float32"

    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")
    Np1 = T.dynamic("Np1")
    N1 = T.dynamic("N1")
    N2 = T.dynamic("N2")
    SH = T.dynamic("SH")
    NO = T.dynamic("NO")

    # red_s slots: K's dG rows, K's dbeta rows, A's dG rows, A's dG columns (A writes its dbeta rows
    # to dbeta, S adds K's); scalars after g in g_s: <S0, D> per S warp, then the r-terms moved to the
    # last valid row per K warp (every byte counts: the tiles fill 229,376 of the 232,448 B)
    RGK, RBK, RGA, CGA, SCS = 0, C, 2 * C, 3 * C, C

    @T.prim_func  # (the kernel's symbol name is part of its generated source: kept as it was)
    def gdn_chunk_bwd_v5(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, HV, V), dtype),
        beta: T.Tensor((B, Tn, HV), beta_dtype),
        A: T.Tensor((HV, R, C), dtype),
        g_cum_log2: T.Tensor((HV, R), "float32"),
        h: T.Tensor((SH, K, V), h_dtype),
        do: T.Tensor((B, Tn, HV, V), dtype),
        dht: T.Tensor((N1, HV, K, V), "float32"),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        order: T.Tensor((NO,), "int32"),
        use_order: T.int32,
        scale: T.float32,
        use_dht: T.int32,
        dq_hv: T.Tensor((B, Tn, HV, K), qk_dtype),
        dk_hv: T.Tensor((B, Tn, HV, K), qk_dtype),
        dv: T.Tensor((B, Tn, HV, V), dtype),
        dbeta: T.Tensor((B, Tn, HV), "float32"),
        dG: T.Tensor((HV, R), "float32"),
        dh0: T.Tensor((N2, HV, K, V), "float32"),
    ):
        with T.Kernel(HV * ((Np1 - 1) if varlen else B), threads=512) as (bx,):
            hv = bx % HV
            # packed: the sequences in the order given (`launch_order.launch_order`); fixed-length
            # rows in order, as one expression (a mutable n there costs registers: ptxas serialises wgmma)
            n = T.if_then_else(use_order != 0, order[bx // HV], bx // HV) if varlen else bx // HV
            bos, seqlen, bidx, slot0, nchunks = sequence_span(n, cu_seqlens, Tn, varlen)
            hk = hv // G
            tx = T.get_thread_binding()

            # loaded tiles (the last chunk by every thread, the others by the producer's TMA)
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, V), dtype)  # V; then X = A^T dv_new (A)
            do_s = T.alloc_shared((C, V), dtype)
            ab_s = T.alloc_shared((C, C), dtype)  # A diag(beta)
            h_s = T.alloc_shared((K, V), dtype)  # S0
            g_s = T.alloc_shared((C + 8,), acc)  # g_cum_log2, then the chunk's scalars
            # tiles the roles write
            ds_s = T.alloc_shared((K, V), dtype)  # D (S)
            pg_s = T.alloc_shared((C, C), dtype)  # Pg (A)
            pm_s = T.alloc_shared((C, C), dtype)  # scale M * Gamma (A; its own tile: a loop that reads and
            # writes one shared tile costs a warpgroup barrier an element, TileLang cannot prove each
            # thread keeps to its own elements)
            kg_s = T.alloc_shared((C, C), dtype)  # Kg; then diag(beta) dLk (A)
            am_s = T.alloc_shared((C, C), dtype)  # A = I - A_beta Kg; then dLk (A)
            w_s = T.alloc_shared((C, V), dtype)  # W (A); then scale diag(gamma) dO (S)
            vn_s = T.alloc_shared((C, V), dtype)  # v_new (A)
            dvn_s = T.alloc_shared((C, V), dtype)  # dv_new; then -diag(gamma) dv (K)
            red_s = T.alloc_shared((4 * C,), acc)

            # tile full (producer -> roles; 32 producer arrivals + TMA bytes) and empty (roles -> producer)
            f_g = T.alloc_barrier(arrive_count=32)
            f_ab = T.alloc_barrier(arrive_count=32)
            f_v = T.alloc_barrier(arrive_count=32)
            f_kq = T.alloc_barrier(arrive_count=32)  # k, q (freed with h, dO: e_late)
            f_hd = T.alloc_barrier(arrive_count=32)  # h, dO
            e_g = T.alloc_barrier(arrive_count=384)
            e_ab = T.alloc_barrier(arrive_count=256)
            e_v = T.alloc_barrier(arrive_count=128)
            e_late = T.alloc_barrier(arrive_count=384)
            # results between roles (each completes once a chunk)
            d_ready = T.alloc_barrier(arrive_count=128)  # S -> K: D in ds_s
            pg_ready = T.alloc_barrier(arrive_count=128)  # A -> K: Pg in pg_s
            pg_read = T.alloc_barrier(arrive_count=128)  # K -> A: Pg^T dO done (pg_s may take scale M)
            dvn_ready = T.alloc_barrier(arrive_count=128)  # K -> A: dv_new in dvn_s
            x_done = T.alloc_barrier(arrive_count=128)  # A -> K: A^T dv_new done (dvn_s may take -gamma dv)
            dvg_ready = T.alloc_barrier(arrive_count=128)  # K -> S: -diag(gamma) dv in dvn_s
            dvg_read = T.alloc_barrier(arrive_count=128)  # S -> K: K^T dvg done (dvn_s free)
            vn_ready = T.alloc_barrier(arrive_count=128)  # A -> K, S: v_new in vn_s (and W dead)
            dog_read = T.alloc_barrier(arrive_count=128)  # S -> A: Q^T (scale diag(gamma) dO) done (w_s free)
            kd_done = T.alloc_barrier(arrive_count=128)  # K -> S, A: ds_s and vn_s free
            m_ready = T.alloc_barrier(arrive_count=128)  # A -> K: dLk, diag(beta) dLk, scale M Gamma
            km_done = T.alloc_barrier(arrive_count=128)  # K -> A: pg_s, kg_s, am_s free
            r_ka = T.alloc_barrier(arrive_count=256)  # K, A -> S: their partial rows in red_s
            s_sync = T.alloc_barrier(arrive_count=128)  # S's own warps
            if early_d:
                # S -> K, A: the chunk's partial rows read (red_s and the scalars after g free). Without
                # "d", S publishes the next D only after those reads, and K (and A through K) cannot
                # start the next chunk before; with "d" nothing else orders K's and A's next writes there
                s_done = T.alloc_barrier(arrive_count=128)

            # ---- the sequence's last chunk, every thread (rows past the end zero)
            if nchunks > 0:
                c_last = nchunks - 1
                t0_l = bos + c_last * C
                row0_l = (slot0 + c_last) * C
                nv_l = seqlen - c_last * C
                for t, d in T.Parallel(C, K):
                    q_s[t, d] = T.if_then_else(t < nv_l, q[bidx, t0_l + t, hk, d], T.cast(0, dtype))
                    k_s[t, d] = T.if_then_else(t < nv_l, k[bidx, t0_l + t, hk, d], T.cast(0, dtype))
                for t, d in T.Parallel(C, V):
                    v_s[t, d] = T.if_then_else(t < nv_l, v[bidx, t0_l + t, hv, d], T.cast(0, dtype))
                    do_s[t, d] = T.if_then_else(t < nv_l, do[bidx, t0_l + t, hv, d], T.cast(0, dtype))
                for t, s in T.Parallel(C, C):
                    ab_s[t, s] = A[hv, row0_l + t, s]
                for i, j in T.Parallel(K, V):
                    h_s[i, j] = h[(slot0 + c_last) * HV + hv, i, j]
                for t in T.Parallel(C):
                    g_s[t] = g_cum_log2[hv, row0_l + t]
                T.fence_proxy_async()
            T.sync_threads()

            if tx < 128:
                # ================================================================ S
                T.set_max_nreg(nreg["S"], 1)
                dS = T.alloc_fragment((K, V), acc)
                sc = T.alloc_local((1,), acc)
                gamc = T.alloc_local((1,), acc)
                if use_dht != 0:
                    for i, j in T.Parallel(K, V):
                        dS[i, j] = dht[n, hv, i, j]
                else:
                    T.clear(dS)
                for ci in T.serial(nchunks):
                    c = nchunks - 1 - ci
                    t0 = bos + c * C
                    row0 = (slot0 + c) * C
                    nvalid = T.min(seqlen - c * C, C)
                    par = ci % 2
                    pprev = (ci + 1) % 2
                    if ci > 0:
                        T.barrier_wait(f_g, pprev)
                    gamc[0] = T.exp2(g_s[C - 1])
                    # D of this chunk (dS after the later chunks); K read the previous one
                    if not early_d or ci == 0:
                        if ci > 0:
                            T.barrier_wait(kd_done, pprev)
                        T.copy(dS, ds_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(d_ready)
                    # <S0, D> (the chunk-end term of dG), then gamma_C dS
                    if ci > 0:
                        T.barrier_wait(f_hd, pprev)
                    sc[0] = T.float32(0)
                    for i, j in T.Parallel(K, V):
                        sc[0] = sc[0] + T.cast(h_s[i, j], acc) * dS[i, j]
                        dS[i, j] = dS[i, j] * gamc[0]
                    # dS += Q^T (scale diag(gamma) dO), the scaled dO over W once A formed v_new
                    T.barrier_wait(vn_ready, par)
                    for t, d in T.Parallel(C, V):
                        w_s[t, d] = T.cast(scale * T.exp2(g_s[t]) * T.cast(do_s[t, d], acc), dtype)
                    T.fence_proxy_async()
                    if not dog_lo:
                        T.barrier_arrive(e_g)  # S's last read of g_s this chunk
                    if ci > 0:
                        T.barrier_wait(f_kq, pprev)
                    T.gemm(q_s, w_s, dS, transpose_A=True)
                    if dog_lo:
                        # the remainder of the scaled dO after its rounding to q's dtype, over the same tile;
                        # it reads g_s again, so S frees g_s (e_g: the producer loads the next chunk's
                        # g there) only after it
                        for t, d in T.Parallel(C, V):
                            xs = scale * T.exp2(g_s[t]) * T.cast(do_s[t, d], acc)
                            w_s[t, d] = T.cast(xs - T.cast(T.cast(xs, dtype), acc), dtype)
                        T.fence_proxy_async()
                        T.barrier_arrive(e_g)
                        T.gemm(q_s, w_s, dS, transpose_A=True)
                    T.barrier_arrive(dog_read)
                    # dS += K^T (-diag(gamma) dv)   (the chain's end)
                    T.barrier_wait(dvg_ready, par)
                    T.gemm(k_s, dvn_s, dS, transpose_A=True)
                    T.barrier_arrive(dvg_read)
                    T.barrier_arrive(e_late)
                    if early_d:
                        # D of the next chunk, published before this chunk's sums wait for K's tail
                        if ci < nchunks - 1:
                            T.barrier_wait(kd_done, par)
                            T.copy(dS, ds_s)
                            T.fence_proxy_async()
                            T.barrier_arrive(d_ready)
                    # the chunk's dG row and dbeta: the roles' partial sums, <S0, D> and the r-terms
                    # moved to the last valid row (K wrote 0 there, -r-term elsewhere)
                    w0 = T.warp_reduce_sum(sc[0])
                    if tx % 32 == 0:
                        g_s[SCS + tx // 32] = w0
                    T.barrier_arrive(s_sync)
                    T.barrier_wait(s_sync, par)
                    T.barrier_wait(r_ka, par)
                    for t in T.Parallel(C):
                        if t < nvalid:
                            dbeta[bidx, t0 + t, hv] = dbeta[bidx, t0 + t, hv] + red_s[RBK + t]
                        dG[hv, row0 + t] = red_s[RGK + t] + red_s[RGA + t] - red_s[CGA + t] + T.if_then_else(
                            t == nvalid - 1,
                            gamc[0] * (g_s[SCS] + g_s[SCS + 1] + g_s[SCS + 2] + g_s[SCS + 3])
                            + (g_s[SCS + 4] + g_s[SCS + 5] + g_s[SCS + 6] + g_s[SCS + 7]),
                            T.float32(0))
                    if early_d:
                        T.barrier_arrive(s_done)
                for i, j in T.Parallel(K, V):
                    dh0[n, hv, i, j] = dS[i, j]
                if varlen:
                    # rows of no sequence (before cu_seqlens[0], past cu_seqlens[-1]) get zero gradients,
                    # written by S of the first / last sequence's CTA of each value head
                    lo = T.alloc_var("int32")
                    cnt = T.alloc_var("int32")
                    lo = 0
                    cnt = 0
                    if n == 0:
                        cnt = T.cast(cu_seqlens[0], "int32")
                    for side in T.serial(2):
                        if side == 1:
                            lo = T.cast(cu_seqlens[Np1 - 1], "int32")
                            cnt = T.if_then_else(n == Np1 - 2, Tn - lo, 0)
                        for tb in T.serial(T.ceildiv(cnt, C)):
                            for t, d in T.Parallel(C, K):
                                if tb * C + t < cnt:
                                    dq_hv[0, lo + tb * C + t, hv, d] = T.cast(0, qk_dtype)
                                    dk_hv[0, lo + tb * C + t, hv, d] = T.cast(0, qk_dtype)
                            for t, d in T.Parallel(C, V):
                                if tb * C + t < cnt:
                                    dv[0, lo + tb * C + t, hv, d] = T.cast(0, dtype)
                            for t in T.Parallel(C):
                                if tb * C + t < cnt:
                                    dbeta[0, lo + tb * C + t, hv] = T.float32(0)
            elif tx < 256:
                # ================================================================ K
                T.set_max_nreg(nreg["K"], 1)
                cv = T.alloc_fragment((C, V), acc)  # dv_new, dv; then scratch
                dk = T.alloc_fragment((C, K), acc)
                r_r = T.alloc_fragment((C,), acc)
                gam_r = T.alloc_fragment((C,), acc)
                b_r = T.alloc_fragment((C,), acc)
                d_r = T.alloc_fragment((C,), acc)
                rs = T.alloc_fragment((C,), acc)
                gk = T.alloc_fragment((C,), acc)
                scr = T.alloc_local((1,), acc)
                for ci in T.serial(nchunks):
                    c = nchunks - 1 - ci
                    t0 = bos + c * C
                    nvalid = T.min(seqlen - c * C, C)
                    par = ci % 2
                    pprev = (ci + 1) % 2
                    if ci > 0:
                        T.barrier_wait(f_g, pprev)
                    for t in T.Parallel(C):
                        r_r[t] = T.exp2(T.min(g_s[C - 1] - g_s[t], T.float32(0)))
                        gam_r[t] = T.exp2(g_s[t])
                    for t in T.Parallel(C):
                        b_r[t] = T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc), T.float32(0))
                    if exact_diagonal:
                        for t in T.Parallel(C):  # b_r is 0 past the end
                            d_r[t] = b_r[t] - T.cast(T.cast(b_r[t], dtype), acc)
                    T.barrier_arrive(e_g)
                    # dv_new = diag(r) K D + Pg^T dO
                    T.barrier_wait(d_ready, par)
                    if ci > 0:
                        T.barrier_wait(f_kq, pprev)
                    T.gemm(k_s, ds_s, cv, clear_accum=True)
                    for t, d in T.Parallel(C, V):
                        cv[t, d] = cv[t, d] * r_r[t]
                    T.barrier_wait(pg_ready, par)
                    if ci > 0:
                        T.barrier_wait(f_hd, pprev)
                    T.gemm(pg_s, do_s, cv, transpose_A=True)
                    T.barrier_arrive(pg_read)
                    if ci > 0:
                        T.barrier_wait(dvg_read, pprev)
                    T.copy(cv, dvn_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(dvn_ready)
                    # dv = A_beta^T dv_new (+ diag(beta - stored diagonal) dv_new in fp32)
                    if exact_diagonal:
                        for t, d in T.Parallel(C, V):
                            cv[t, d] = d_r[t] * cv[t, d]
                    if ci > 0:
                        T.barrier_wait(f_ab, pprev)
                    T.gemm(ab_s, dvn_s, cv, transpose_A=True, clear_accum=not exact_diagonal)
                    T.barrier_arrive(e_ab)
                    if not async_k:
                        for t, d in T.Parallel(C, V):
                            if t < nvalid:
                                dv[bidx, t0 + t, hv, d] = T.cast(cv[t, d], dtype)
                        # -diag(gamma) dv over dv_new, once A has read dv_new
                        T.barrier_wait(x_done, par)
                        for t, d in T.Parallel(C, V):
                            dvn_s[t, d] = T.cast(-gam_r[t] * cv[t, d], dtype)
                        T.fence_proxy_async()
                        T.barrier_arrive(dvg_ready)
                        # dk = diag(r) v_new D^T; its r-terms of dG (moved to the last valid row: 0 there)
                        T.barrier_wait(vn_ready, par)
                        T.gemm(vn_s, ds_s, dk, transpose_B=True, clear_accum=True)
                        T.barrier_arrive(kd_done)
                        for t, d in T.Parallel(C, K):
                            dk[t, d] = dk[t, d] * r_r[t]
                        scr[0] = T.float32(0)
                        for t, d in T.Parallel(C, K):
                            pr = T.if_then_else(t == nvalid - 1, T.float32(0), dk[t, d] * T.cast(k_s[t, d], acc))
                            cv[t, d] = pr
                            scr[0] = scr[0] + pr
                        T.reduce_sum(cv, rs, dim=1, batch=2)
                        for t in T.Parallel(C):
                            gk[t] = -rs[t]
                        wr = T.warp_reduce_sum(scr[0])
                        if early_d:
                            if ci > 0:
                                T.barrier_wait(s_done, pprev)
                        if tx % 32 == 0:
                            g_s[SCS + 4 + (tx // 32) % 4] = wr
                        # dk += (-diag(gamma) dv) S0^T; dG rows += rowsum(that * K) (= rowsum(-diag(gamma) dv * U))
                        T.gemm(dvn_s, h_s, cv, transpose_B=True, clear_accum=True)
                        for t, d in T.Parallel(C, K):
                            dk[t, d] = dk[t, d] + cv[t, d]
                        for t, d in T.Parallel(C, K):
                            cv[t, d] = cv[t, d] * T.cast(k_s[t, d], acc)
                        T.reduce_sum(cv, gk, dim=1, clear=False, batch=2)
                        # t = dLk K: dk += diag(beta) t; dbeta rows = rowsum(t * K)
                        T.barrier_wait(m_ready, par)
                        T.gemm(am_s, k_s, cv, clear_accum=True)
                        for t, d in T.Parallel(C, K):
                            dk[t, d] = dk[t, d] + b_r[t] * cv[t, d]
                        for t, d in T.Parallel(C, K):
                            cv[t, d] = cv[t, d] * T.cast(k_s[t, d], acc)
                        T.reduce_sum(cv, rs, dim=1, batch=2)
                        # dk += (diag(beta) dLk)^T K + (scale M Gamma)^T Q
                        T.gemm(kg_s, k_s, dk, transpose_A=True)
                        T.gemm(pm_s, q_s, dk, transpose_A=True)
                        for t, d in T.Parallel(C, K):
                            if t < nvalid:
                                dk_hv[bidx, t0 + t, hv, d] = dk[t, d]
                        # dq = scale diag(gamma) dO S0^T + (scale M Gamma) K; dG rows += rowsum(first term * Q)
                        T.gemm(do_s, h_s, cv, transpose_B=True, clear_accum=True)
                        for t, d in T.Parallel(C, K):
                            cv[t, d] = cv[t, d] * (scale * gam_r[t])
                        for t, d in T.Parallel(C, K):
                            dk[t, d] = cv[t, d] * T.cast(q_s[t, d], acc)
                        T.reduce_sum(dk, gk, dim=1, clear=False, batch=2)
                        T.gemm(pm_s, k_s, cv)
                        T.barrier_arrive(km_done)
                        T.barrier_arrive(e_late)
                        for t, d in T.Parallel(C, K):
                            if t < nvalid:
                                dq_hv[bidx, t0 + t, hv, d] = cv[t, d]
                    else:
                        # the same products, S's -diag(gamma) dv published before dv's store, and
                        # independent wgmma issued together (each waited only where its result is read)
                        T.barrier_wait(x_done, par)
                        for t, d in T.Parallel(C, V):
                            dvn_s[t, d] = T.cast(-gam_r[t] * cv[t, d], dtype)
                        T.fence_proxy_async()
                        T.barrier_arrive(dvg_ready)
                        for t, d in T.Parallel(C, V):
                            if t < nvalid:
                                dv[bidx, t0 + t, hv, d] = T.cast(cv[t, d], dtype)
                        # dk = diag(r) v_new D^T + (-diag(gamma) dv) S0^T; dG rows: rowsum of
                        # ((-diag(gamma) dv) S0^T) * K minus the r-terms (moved to the last valid row)
                        T.barrier_wait(vn_ready, par)
                        T.gemm(vn_s, ds_s, dk, transpose_B=True, clear_accum=True)
                        T.barrier_arrive(kd_done)
                        T.gemm(dvn_s, h_s, cv, transpose_B=True, clear_accum=True)
                        scr[0] = T.float32(0)
                        for t, d in T.Parallel(C, K):
                            kk = T.cast(k_s[t, d], acc)
                            dr = dk[t, d] * r_r[t]
                            pr = T.if_then_else(t == nvalid - 1, T.float32(0), dr * kk)
                            scr[0] = scr[0] + pr
                            dk[t, d] = dr + cv[t, d]
                            cv[t, d] = cv[t, d] * kk - pr
                        T.reduce_sum(cv, gk, dim=1, batch=2)
                        wr = T.warp_reduce_sum(scr[0])
                        if early_d:
                            if ci > 0:
                                T.barrier_wait(s_done, pprev)
                        if tx % 32 == 0:
                            g_s[SCS + 4 + (tx // 32) % 4] = wr
                        # t = dLk K: dk += diag(beta) t; dbeta rows = rowsum(t * K)
                        T.barrier_wait(m_ready, par)
                        T.gemm(am_s, k_s, cv, clear_accum=True)
                        for t, d in T.Parallel(C, K):
                            dk[t, d] = dk[t, d] + b_r[t] * cv[t, d]
                            cv[t, d] = cv[t, d] * T.cast(k_s[t, d], acc)
                        T.reduce_sum(cv, rs, dim=1, batch=2)
                        # dk += (diag(beta) dLk)^T K + (scale M Gamma)^T Q
                        T.wgmma_gemm(kg_s, k_s, dk, transpose_A=True)
                        T.wgmma_gemm(pm_s, q_s, dk, transpose_A=True)
                        T.wait_wgmma(0)
                        for t, d in T.Parallel(C, K):
                            if t < nvalid:
                                dk_hv[bidx, t0 + t, hv, d] = dk[t, d]
                        # dq = scale diag(gamma) dO S0^T + (scale M Gamma) K; dG rows += rowsum(first term * Q)
                        T.wgmma_gemm(do_s, h_s, cv, transpose_B=True, clear_accum=True)
                        T.wait_wgmma(0)
                        for t, d in T.Parallel(C, K):
                            cv[t, d] = cv[t, d] * (scale * gam_r[t])
                            dk[t, d] = cv[t, d] * T.cast(q_s[t, d], acc)
                        if over_gk:  # (scale M Gamma) K while the dG rows sum
                            T.wgmma_gemm(pm_s, k_s, cv)
                            T.reduce_sum(dk, gk, dim=1, clear=False, batch=2)
                            T.wait_wgmma(0)
                        else:
                            T.reduce_sum(dk, gk, dim=1, clear=False, batch=2)
                            T.gemm(pm_s, k_s, cv)
                        T.barrier_arrive(km_done)
                        T.barrier_arrive(e_late)
                        for t, d in T.Parallel(C, K):
                            if t < nvalid:
                                dq_hv[bidx, t0 + t, hv, d] = cv[t, d]
                    T.copy(gk, red_s[RGK : RGK + C])
                    T.copy(rs, red_s[RBK : RBK + C])
                    T.barrier_arrive(r_ka)
            elif tx < 384:
                # ================================================================ A
                T.set_max_nreg(nreg["A"], 1)
                cc = T.alloc_fragment((C, C), acc)
                msk = T.alloc_fragment((C, C), acc)  # Gamma (t >= s), 0 above the diagonal
                za = T.alloc_fragment((C, C), acc)  # Kg; then dL * L + Z (the dG rows and columns)
                F = T.alloc_fragment((C, V), acc)
                gam_a = T.alloc_fragment((C,), acc)
                b_a = T.alloc_fragment((C,), acc)
                rg = T.alloc_fragment((C,), acc)
                cg = T.alloc_fragment((C,), acc)
                rb = T.alloc_fragment((C,), acc)
                for ci in T.serial(nchunks):
                    c = nchunks - 1 - ci
                    t0 = bos + c * C
                    nvalid = T.min(seqlen - c * C, C)
                    par = ci % 2
                    pprev = (ci + 1) % 2
                    if ci > 0:
                        T.barrier_wait(f_g, pprev)
                    for t, s in T.Parallel(C, C):
                        msk[t, s] = T.if_then_else(t >= s, T.exp2(T.if_then_else(t >= s, g_s[t] - g_s[s], T.float32(0))),
                                                   T.float32(0))
                    for t in T.Parallel(C):
                        gam_a[t] = T.exp2(g_s[t])
                    for t in T.Parallel(C):
                        b_a[t] = T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc), T.float32(0))
                    T.barrier_arrive(e_g)
                    # Pg = scale (Q K^T) * Gamma
                    if ci > 0:
                        T.barrier_wait(km_done, pprev)
                        T.barrier_wait(f_kq, pprev)
                    T.gemm(q_s, k_s, cc, transpose_B=True, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        pg_s[t, s] = T.cast(scale * cc[t, s] * msk[t, s], dtype)
                    T.fence_proxy_async()
                    T.barrier_arrive(pg_ready)
                    # Kg = (K K^T) * Gamma_strict;  A = I - A_beta Kg  (BWD-Abeta)
                    T.gemm(k_s, k_s, cc, transpose_B=True, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        kg_s[t, s] = T.cast(T.if_then_else(t > s, cc[t, s] * msk[t, s], T.float32(0)), dtype)
                    T.fence_proxy_async()
                    if ci > 0:
                        T.barrier_wait(f_ab, pprev)
                    T.gemm(ab_s, kg_s, cc, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        am_s[t, s] = T.cast(T.if_then_else(t == s, T.float32(1), T.float32(0)) - cc[t, s], dtype)
                    T.fence_proxy_async()
                    # U = K S0, W = V - diag(gamma) U
                    if ci > 0:
                        T.barrier_wait(f_v, pprev)
                        T.barrier_wait(f_hd, pprev)
                    T.gemm(k_s, h_s, F, clear_accum=True)
                    if ci > 0:
                        T.barrier_wait(dog_read, pprev)
                    for t, d in T.Parallel(C, V):
                        w_s[t, d] = T.cast(T.cast(v_s[t, d], acc) - gam_a[t] * F[t, d], dtype)
                    T.fence_proxy_async()
                    # X = A^T dv_new, over V (dead); dbeta rows: rowsum(X * W)
                    T.barrier_wait(dvn_ready, par)
                    T.gemm(am_s, dvn_s, F, transpose_A=True, clear_accum=True)
                    T.barrier_arrive(x_done)
                    T.copy(F, v_s)
                    T.fence_proxy_async()
                    for t, d in T.Parallel(C, V):
                        F[t, d] = F[t, d] * T.cast(w_s[t, d], acc)
                    T.reduce_sum(F, rb, dim=1, batch=2)
                    # v_new = A_beta W
                    if ci > 0:
                        T.barrier_wait(kd_done, pprev)
                    T.gemm(ab_s, w_s, F, clear_accum=True)
                    T.barrier_arrive(e_ab)
                    T.copy(F, vn_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(vn_ready)
                    # dL = -X v_new^T (strict): dLk = dL * Gamma over A; dG rows / columns of dL * L,
                    # L = diag(beta) Kg; diag(beta) dLk over Kg
                    # Kg into registers first (its tile then takes diag(beta) dLk: see pm_s)
                    for t, s in T.Parallel(C, C):
                        za[t, s] = T.cast(kg_s[t, s], acc)
                    T.gemm(v_s, vn_s, cc, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(e_v)
                    for t, s in T.Parallel(C, C):
                        dl = T.if_then_else(t > s, -cc[t, s], T.float32(0))
                        dlk = T.cast(dl * msk[t, s], dtype)
                        zl = dl * b_a[t] * za[t, s]
                        am_s[t, s] = dlk
                        kg_s[t, s] = T.cast(b_a[t] * T.cast(dlk, acc), dtype)
                        za[t, s] = zl
                    # M = dO v_new^T: dG rows / columns of Z = M * Pg (strict); scale M * Gamma over Pg
                    T.gemm(do_s, vn_s, cc, transpose_B=True, clear_accum=True)
                    T.barrier_wait(pg_read, par)
                    for t, s in T.Parallel(C, C):
                        m = cc[t, s]
                        z = T.if_then_else(t > s, m * T.cast(pg_s[t, s], acc), T.float32(0))
                        pm_s[t, s] = T.cast(scale * m * msk[t, s], dtype)
                        za[t, s] = za[t, s] + z
                    T.fence_proxy_async()
                    T.barrier_arrive(m_ready)
                    T.reduce_sum(za, rg, dim=1, batch=2)
                    T.reduce_sum(za, cg, dim=0, batch=16)
                    T.barrier_arrive(e_late)
                    if early_d:
                        if ci > 0:
                            T.barrier_wait(s_done, pprev)
                    T.copy(rg, red_s[RGA : RGA + C])
                    T.copy(cg, red_s[CGA : CGA + C])
                    for t in T.Parallel(C):
                        if t < nvalid:
                            dbeta[bidx, t0 + t, hv] = rb[t]
                    T.barrier_arrive(r_ka)
            else:
                # ================================================================ P (one warp)
                T.set_max_nreg(nreg["P"], 0)
                if tx < 416:
                    for ci in T.serial(nchunks - 1):
                        par = ci % 2
                        c = nchunks - 2 - ci
                        t0 = bos + c * C
                        row0 = (slot0 + c) * C
                        T.barrier_wait(e_g, par)
                        T.tma_copy(g_cum_log2[hv, row0 : row0 + C], g_s[0:C], barrier=f_g)
                        T.barrier_arrive(f_g)
                        T.barrier_wait(e_ab, par)
                        T.tma_copy(A[hv, row0 : row0 + C, 0:C], ab_s, barrier=f_ab)
                        T.barrier_arrive(f_ab)
                        T.barrier_wait(e_v, par)
                        T.tma_copy(v[bidx, t0 : t0 + C, hv, 0:V], v_s, barrier=f_v)
                        T.barrier_arrive(f_v)
                        T.barrier_wait(e_late, par)
                        T.tma_copy(k[bidx, t0 : t0 + C, hk, 0:K], k_s, barrier=f_kq)
                        T.tma_copy(q[bidx, t0 : t0 + C, hk, 0:K], q_s, barrier=f_kq)
                        T.barrier_arrive(f_kq)
                        T.tma_copy(h[(slot0 + c) * HV + hv, 0:K, 0:V], h_s, barrier=f_hd)
                        T.tma_copy(do[bidx, t0 : t0 + C, hv, 0:V], do_s, barrier=f_hd)
                        T.barrier_arrive(f_hd)

    return gdn_chunk_bwd_v5

@functools.lru_cache(maxsize=None)
def build_chunk_bwd_kernel(H: int, HV: int, K: int, V: int, dtype: str, beta_dtype: str, seq_dtype: str, varlen: bool,
                           dh0: bool = True):
    """Compiled pass-2 kernel (cached). Static key: head counts, head dims (K = V = 128), q's dtype
    ("bfloat16" or "float16"; of the stored h too), beta's dtype (fp32 or q's), cu_seqlens' dtype,
    packed or not, and whether the call returns
    dh0 (the build options, `build_options`)."""
    opts = build_options(varlen, dh0)
    func = _chunk_bwd_prim_func(H, HV, K, V, dtype, beta_dtype, seq_dtype, bool(varlen), opts)
    return compile_kernel(func, f"gdn_chunk_bwd_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{beta_dtype}_{seq_dtype}_{int(varlen)}"
                          + (f"_{opts}" if opts else ""))


def chunk_bwd_kernel_args(q, v, beta, cu_seqlens, dh0: bool = True) -> tuple:
    """The static key (`build_chunk_bwd_kernel` arguments) of a launch with these inputs."""
    seq_dtype = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
    return (q.shape[2], v.shape[2], q.shape[3], v.shape[3], tl_dtype(q.dtype), tl_dtype(beta.dtype), seq_dtype,
            cu_seqlens is not None, bool(dh0))


def chunk_fused_bwd(q, k, v, beta, A, g_cum_log2, h, do, dht, scale: float, cu_seqlens, order=None, dh0: bool = True):
    """Launches pass 2. Arguments: the forward's inputs (contiguous; q, k, v, do bf16 or fp16, beta
    fp32 or q's dtype), its A and g_cum_log2, h from pass 1 (`states_bwd.chunk_states_bwd`, in q's
    dtype), do [B, T, HV, V], dht None or [N, HV, K, V] fp32; order: the sequences'
    launch order (`launch_order.launch_order`) or None (token order; the same results); dh0: whether
    the caller uses the dh0 it returns (the build with `DH0_OPTS`, the more precise state gradient;
    without it dh0 is still written).

    Returns (dq_hv [B, T, HV, K] fp32, dk_hv [B, T, HV, K] fp32, dv [B, T, HV, V] v's dtype,
    dbeta [B, T, HV] fp32, dG [HV, S * 64] fp32, dh0 [N, HV, K, V] fp32). Raises TypeError when h is
    not in q's dtype."""
    if h.dtype != q.dtype:
        raise TypeError(f"h must be in q's dtype {q.dtype} (pass 1, `states_bwd`, stores it so), got {h.dtype}")
    key = chunk_bwd_kernel_args(q, v, beta, cu_seqlens, dh0)
    return launch_pass2(lambda: build_chunk_bwd_kernel(*key), q, k, v, beta, A, g_cum_log2, h, do, dht, scale, cu_seqlens,
                        order=order)

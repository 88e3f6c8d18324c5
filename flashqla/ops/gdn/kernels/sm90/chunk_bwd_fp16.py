"""Backward pass 2 for what `chunk_bwd` does not cover: fp16 inputs, whose chunk-start states h are
stored in bf16 (the fp16 backward's fallback, with `states_bwd_fp16`, until fp16 runs on the main
kernels).

The products and semantics of `chunk_bwd` (reference stage `reference.gdn.fused_bwd.chunk_bwd_fused`;
records BWD-Abeta, BWD-fused, BWD-dq, BWD-dG; the formulas are in `chunk_bwd`'s docstring), on one
CTA per (sequence, value head), chunks in reverse, with two consumer warpgroups that share every
product and a producer warpgroup:
1. `T.Pipelined(num_stages=1)`: TileLang's pipeliner adds a producer warpgroup (128 threads,
   setmaxnreg 24; consumers 240) that loads q, k, v, dO, A diag(beta), g_cum_log2 and h by TMA into
   single-buffered tiles, one full/empty mbarrier pair per tile. A consumer releases a tile after the
   last statement that reads it, so the next chunk's tile is loaded while this chunk still runs:
   g_cum_log2 first (copied to a consumer tile), then A diag(beta) (after v_new), v (after
   X v_new^T; X is written over V), dO (after dO v_new^T and scale D dO), q, h, and k last. Rows past
   a sequence end are zeroed in shared memory (q, k, v, dO; a partial chunk only); beta is loaded by
   the consumers (masked).
2. Independent wgmma issued back to back (`T.wgmma_gemm`), one `T.wait_wgmma(n)` per result in issue
   order, each issue-and-wait group one statement of the pipelined body: the chain D -> K D -> dv_new
   -> dv -> -D dv -> dS is issued first in each group and the off-chain products (K K^T, Q K^T, U, A,
   X, v_new, M, dL, dq, dk) run behind it.
3. U = K S0 is computed once and kept in registers until dv exists.
4. Reductions accumulate in registers (dG rows, dG columns, dbeta rows, and two scalars <S0, D> and the
   r-terms moved to the last valid row, per-thread locals summed by warp shuffles and one slot per
   warp) and are finalised once per chunk.
5. Every row of dq_hv, dk_hv, dv, dbeta and dh0 is written: with packed sequences the CTA of the last
   sequence writes zeros in the rows past cu_seqlens[-1], and the CTA of the first sequence in the rows
   before cu_seqlens[0] (`_common.launch_pass2` allocates them uninitialised).
6. The gates in registers: g_cum_log2 at the rows and columns of the [64, 64] accumulator, beta at its
   rows, gamma = exp2(g) and r = exp2(min(g_C - g, 0)) at the rows of the [64, 128] accumulators, and
   gamma_C, computed once per chunk (not reloaded from shared memory inside the element loops).

Accumulators: a wgmma's accumulator registers stay live across the whole chunk loop, so the kernel
keeps D (64 registers per thread), one [64, 64] and three [64, 128] accumulators and assigns the ~12
products' results to them by lifetime. Shared memory: q, k, v, dO 16 KB each, A diag(beta) 8 KB, h
32 KB, D (bf16) 32 KB, Kg/A/Pg 8 KB each, W, v_new, dv_new 16 KB each, plus the gate copy and the
reductions' staging.
"""

import functools

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, launch_pass2, sequence_span, tl_dtype

__all__ = ["build_chunk_bwd_fp16_kernel", "chunk_fused_bwd_fp16"]


def _chunk_bwd_prim_func(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, beta_dtype: str, seq_dtype: str,
                         varlen: bool):
    """The TileLang kernel (arguments as `build_chunk_bwd_fp16_kernel`)."""
    import tilelang.language as T

    # beta in q's dtype: the stored diagonal is beta exactly, nothing to restore
    exact_diagonal = beta_dtype != dtype

    C = CHUNK
    G = HV // H
    acc = "float32"
    h_tma = h_dtype == dtype  # h stored in q's dtype: TMA straight into the operand tile
    # per-thread 32-bit registers of the accumulators (two consumer warpgroups, 256 threads)
    r_cc = C * C // 256
    r_cv = C * V // 256
    r_ck = C * K // 256
    r_kv = K * V // 256

    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")
    Np1 = T.dynamic("Np1")
    N1 = T.dynamic("N1")  # rows of dht (N, or 1 for the placeholder)
    N2 = T.dynamic("N2")  # rows of dh0
    SH = T.dynamic("SH")

    @T.prim_func  # (the kernel's symbol name is part of its generated source: kept as it was)
    def gdn_chunk_bwd_v2(
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
        scale: T.float32,
        use_dht: T.int32,
        dq_hv: T.Tensor((B, Tn, HV, K), "float32"),
        dk_hv: T.Tensor((B, Tn, HV, K), "float32"),
        dv: T.Tensor((B, Tn, HV, V), dtype),
        dbeta: T.Tensor((B, Tn, HV), "float32"),
        dG: T.Tensor((HV, R), "float32"),
        dh0: T.Tensor((N2, HV, K, V), "float32"),
    ):
        with T.Kernel(HV * ((Np1 - 1) if varlen else B), threads=256) as (bx,):
            hv = bx % HV
            n = bx // HV
            bos, seqlen, bidx, slot0, nchunks = sequence_span(n, cu_seqlens, Tn, varlen)
            hk = hv // G
            tx = T.get_thread_binding()
            T.annotate_producer_reg_dealloc(24)
            T.annotate_consumer_reg_alloc(240)

            # tiles loaded by the producer (TMA, single-buffered, released after their last use)
            gc_s = T.alloc_shared((C,), acc)
            a_s = T.alloc_shared((C, C), dtype)  # A diag(beta)
            v_s = T.alloc_shared((C, V), dtype)  # V, then X = A^T dv_new
            do_s = T.alloc_shared((C, V), dtype)
            h_s = T.alloc_shared((K, V), dtype)
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            # consumer tiles
            gcc_s = T.alloc_shared((C,), acc)  # copy of g_cum_log2 (its TMA tile is released at once)
            b_s = T.alloc_shared((C,), acc)
            ds_s = T.alloc_shared((K, V), dtype)  # bf16 copy of D = dS'
            kg_s = T.alloc_shared((C, C), dtype)  # Kg; then diag(beta) dLk
            am_s = T.alloc_shared((C, C), dtype)  # A (gated); then dLk = dL * Gamma_strict
            pg_s = T.alloc_shared((C, C), dtype)  # scale Q K^T * Gamma; then scale M
            w_s = T.alloc_shared((C, V), dtype)  # W; then scale diag(gamma) dO
            vn_s = T.alloc_shared((C, V), dtype)
            dvn_s = T.alloc_shared((C, V), dtype)  # dv_new; then -diag(gamma) dv
            red_s = T.alloc_shared((3, C), acc)  # finalised dG rows, dG columns, dbeta
            sc_s = T.alloc_shared((2, 8), acc)  # per consumer warp: <S0, D>, r-terms moved to the last valid row

            ds_f = T.alloc_fragment((K, V), acc)
            cc_f = T.alloc_fragment((C, C), acc)
            # three [64, 128] accumulators for seven results with disjoint lifetimes (K == V; an
            # accumulator's registers stay live across the loop: a wgmma reads them even when it
            # clears them, so every extra one costs 32 registers everywhere)
            cv_f = T.alloc_fragment((C, V), acc)  # dv_new, dv; then dq
            u_f = T.alloc_fragment((C, V), acc)  # U = K S0; then X; then dk
            ck2_f = T.alloc_fragment((C, K), acc)  # v_new; then diag(r) v_new D^T
            # reducers (accumulated per thread, all-reduced once per chunk):
            # dG rows: -rowsum(dv * D U) + rowsum(dL * L) + rowsum(Z) + scale rowsum(D dO S0^T * Q)
            #          - rowsum(diag(r) v_new D^T * K) (not at the last valid row)
            # dG columns (subtracted): colsum(dL * L) + colsum(Z);  dbeta: rowsum(X * W) + rowsum(dLk K * K)
            # scalars: <S0, D>, and the r-terms of every row but the last valid one
            rg = T.alloc_reducer((C,), acc, op="sum")
            cg = T.alloc_reducer((C,), acc, op="sum")
            rb = T.alloc_reducer((C,), acc, op="sum")
            sc = T.alloc_local((2,), acc)  # per-thread partials of the two scalars (see the finalisation)
            # the gates in registers, once per chunk, at the rows and columns each thread's
            # accumulators hold (read from shared memory inside the element loops, they would be
            # reloaded at every element: the loops' own shared stores may alias them)
            g_r = T.alloc_fragment((C,), acc)  # g_cum_log2 at the rows of cc_f
            g_c = T.alloc_fragment((C,), acc)  # ... at its columns
            b_r = T.alloc_fragment((C,), acc)  # beta at the rows of cc_f
            gam_r = T.alloc_fragment((C,), acc)  # gamma = exp2(g) at the rows of the [C, V] accumulators
            r_r = T.alloc_fragment((C,), acc)  # r = exp2(min(g_C - g, 0)) at those rows
            gamc = T.alloc_local((1,), acc)  # gamma_C
            # delta = beta - beta rounded to q's dtype (the stored diagonal of A diag(beta): the diagonal
            # of (I + L)^-1 is exactly 1), 0 past the end, at the rows of the [C, V] accumulators: dv
            # starts from diag(delta) dv_new in fp32 (the exact diagonal, `reference.gdn.fused_bwd`'s
            # exact_diagonal; restored in v_new too it is less accurate on a strong-decay head, so v_new
            # keeps the stored one: benchmarks/journal/accuracy.md, "The exact diagonal")
            d_v = T.alloc_fragment((C,), acc)
            rg_f = T.alloc_fragment((C,), acc)
            cg_f = T.alloc_fragment((C,), acc)
            rb_f = T.alloc_fragment((C,), acc)

            if use_dht != 0:
                for i, j in T.Parallel(K, V):
                    ds_f[i, j] = dht[n, hv, i, j]
            else:
                T.clear(ds_f)

            for ci in T.Pipelined(nchunks, num_stages=1):
                c = nchunks - 1 - ci
                t0 = bos + c * C
                row0 = (slot0 + c) * C
                nvalid = T.min(seqlen - c * C, C)
                # producer: in the order the consumers release the tiles
                T.copy(g_cum_log2[hv, row0 : row0 + C], gc_s)
                T.copy(A[hv, row0 : row0 + C, 0:C], a_s)
                T.copy(v[bidx, t0 : t0 + C, hv, 0:V], v_s)
                T.copy(do[bidx, t0 : t0 + C, hv, 0:V], do_s)
                if h_tma:
                    T.copy(h[(slot0 + c) * HV + hv, 0:K, 0:V], h_s)
                T.copy(q[bidx, t0 : t0 + C, hk, 0:K], q_s)
                T.copy(k[bidx, t0 : t0 + C, hk, 0:K], k_s)

                # ---- gates (copy: the TMA tile goes back at once), reducers, rows past the end
                for t in T.Parallel(C):
                    gcc_s[t] = gc_s[t]
                for t in T.Parallel(C):
                    g_r[t] = gc_s[t]
                for s in T.Parallel(C):
                    g_c[s] = gc_s[s]
                for t in T.Parallel(C):
                    gam_r[t] = T.exp2(gc_s[t])
                    r_r[t] = T.exp2(T.min(gc_s[C - 1] - gc_s[t], T.float32(0)))
                gamc[0] = T.exp2(gc_s[C - 1])
                T.reducer_init(rg)
                T.reducer_init(cg)
                T.reducer_init(rb)
                sc[0] = T.float32(0)
                sc[1] = T.float32(0)
                # ---- chain start: bf16 copy of D
                for i, j in T.Parallel(K, V):
                    ds_s[i, j] = T.cast(ds_f[i, j], dtype)
                T.fence_proxy_async()

                for _ in T.serial(1):
                    # rows past a sequence end are zero (a sequence's last chunk only).
                    # Each tile is masked inside the group that first reads it: the pipeliner
                    # waits for a tile's TMA before the first statement that reads it, and does not
                    # count these writes as a use.
                    if nvalid < C:
                        for t, d in T.Parallel(C, K):
                            if t >= nvalid:
                                q_s[t, d] = T.cast(0, dtype)
                                k_s[t, d] = T.cast(0, dtype)
                        T.fence_proxy_async()
                    # Q K^T, K D (chain); then K K^T (into Q K^T's registers once Pg is out)
                    T.wgmma_gemm(q_s, k_s, cc_f, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(k_s, ds_s, cv_f, clear_accum=True)
                    for t in T.Parallel(C):
                        b_s[t] = T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc), T.float32(0))
                    for t in T.Parallel(C):
                        b_r[t] = T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc), T.float32(0))
                    if not h_tma:  # h stored in another dtype than q: loaded and rounded by the consumers
                        for i, j in T.Parallel(K, V):
                            h_s[i, j] = T.cast(h[(slot0 + c) * HV + hv, i, j], dtype)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(cc_f, num_regs=r_cc)
                    # Pg = scale (Q K^T) * Gamma (causal, diagonal included)
                    for t, s in T.Parallel(C, C):
                        pg_s[t, s] = T.cast(
                            T.if_then_else(t >= s, scale * cc_f[t, s] * T.exp2(T.if_then_else(t >= s, g_r[t] - g_c[s], T.float32(0))),
                                           T.float32(0)), dtype)
                    T.wgmma_gemm(k_s, k_s, cc_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(cv_f, num_regs=r_cv)
                    for t, d in T.Parallel(C, V):
                        cv_f[t, d] = cv_f[t, d] * r_r[t]
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(cc_f, num_regs=r_cc)
                    # Kg = (K K^T) * Gamma_strict
                    for t, s in T.Parallel(C, C):
                        kg_s[t, s] = T.cast(
                            T.if_then_else(t > s, cc_f[t, s] * T.exp2(T.if_then_else(t > s, g_r[t] - g_c[s], T.float32(0))),
                                           T.float32(0)), dtype)
                    T.fence_proxy_async()

                for _ in T.serial(1):
                    if nvalid < C:
                        for t, d in T.Parallel(C, V):
                            if t >= nvalid:
                                do_s[t, d] = T.cast(0, dtype)
                        T.fence_proxy_async()
                    # dv_new = diag(r) K D + Pg^T dO (chain), A_beta Kg, U = K S0
                    T.wgmma_gemm(pg_s, do_s, cv_f, transpose_A=True)
                    T.wgmma_gemm(a_s, kg_s, cc_f, clear_accum=True)
                    T.wgmma_gemm(k_s, h_s, u_f, clear_accum=True)
                    T.wait_wgmma(2)
                    T.warpgroup_fence_operand(cv_f, num_regs=r_cv)
                    T.copy(cv_f, dvn_s)
                    if exact_diagonal:
                        for t in T.Parallel(C):  # b_s is 0 past the end
                            d_v[t] = b_s[t] - T.cast(T.cast(b_s[t], dtype), acc)
                        for t, d in T.Parallel(C, V):
                            cv_f[t, d] = d_v[t] * cv_f[t, d]  # diag(delta) dv_new, the start of dv
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(cc_f, num_regs=r_cc)
                    # A = I - A_beta Kg  (BWD-Abeta)
                    for t, s in T.Parallel(C, C):
                        am_s[t, s] = T.cast(T.if_then_else(t == s, T.float32(1), T.float32(0)) - cc_f[t, s], dtype)
                    T.fence_proxy_async()

                for _ in T.serial(1):
                    # dv = A_beta^T dv_new (chain); W = V - D U and v_new = A_beta W; X = A^T dv_new,
                    # issued once U is dead (U, X, v_new and dv live together would not fit in 240
                    # registers)
                    T.wgmma_gemm(a_s, dvn_s, cv_f, transpose_A=True, clear_accum=not exact_diagonal)
                    if nvalid < C:
                        for t, d in T.Parallel(C, V):
                            if t >= nvalid:
                                v_s[t, d] = T.cast(0, dtype)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(u_f, num_regs=r_cv)
                    for t, d in T.Parallel(C, V):
                        w_s[t, d] = T.cast(T.cast(v_s[t, d], acc) - gam_r[t] * u_f[t, d], dtype)
                    T.fence_proxy_async()
                    T.wgmma_gemm(a_s, w_s, ck2_f, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(cv_f, num_regs=r_cv)
                    for t, d in T.Parallel(C, V):
                        if t < nvalid:
                            dv[bidx, t0 + t, hv, d] = T.cast(cv_f[t, d], dtype)
                    # dG: -rowsum(dv * diag(gamma) U)
                    for t, d in T.Parallel(C, V):
                        T.reducer_update(rg[t], -cv_f[t, d] * gam_r[t] * u_f[t, d])
                    T.wgmma_gemm(am_s, dvn_s, u_f, transpose_A=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(ck2_f, num_regs=r_ck)
                    T.copy(ck2_f, vn_s)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(u_f, num_regs=r_cv)
                    T.copy(u_f, v_s)  # X over V (V is dead)
                    # dbeta: rowsum(X * W)
                    for t, d in T.Parallel(C, V):
                        T.reducer_update(rb[t], u_f[t, d] * T.cast(w_s[t, d], acc))
                    for t, d in T.Parallel(C, V):
                        dvn_s[t, d] = T.cast(-gam_r[t] * cv_f[t, d], dtype)  # -diag(gamma) dv
                    # W is dead: scale diag(gamma) dO into its tile
                    for t, d in T.Parallel(C, V):
                        w_s[t, d] = T.cast(scale * T.exp2(gcc_s[t]) * T.cast(do_s[t, d], acc), dtype)
                    # <S0, D> (for the last valid row of dG), then gamma_C dS
                    for i, j in T.Parallel(K, V):
                        sc[0] = sc[0] + T.cast(h_s[i, j], acc) * ds_f[i, j]
                        ds_f[i, j] = ds_f[i, j] * gamc[0]
                    T.fence_proxy_async()

                for _ in T.serial(1):
                    # dS += scale Q^T D dO, -K^T D dv (chain end); dL = -X v_new^T,
                    # dq = scale D dO S0^T; then M = dO v_new^T (into dL's registers)
                    T.wgmma_gemm(q_s, w_s, ds_f, transpose_A=True)
                    T.wgmma_gemm(k_s, dvn_s, ds_f, transpose_A=True)
                    T.wgmma_gemm(v_s, vn_s, cc_f, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(w_s, h_s, cv_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(cc_f, num_regs=r_cc)
                    for t, s in T.Parallel(C, C):
                        am_s[t, s] = T.cast(
                            T.if_then_else(t > s, -cc_f[t, s] * T.exp2(T.if_then_else(t > s, g_r[t] - g_c[s], T.float32(0))),
                                           T.float32(0)), dtype)
                    # dG: rowsum(dL * L) - colsum(dL * L), L = diag(beta) Kg
                    # the term formed once for both sums (the same value, the same sums)
                    for t, s in T.Parallel(C, C):
                        zl = T.if_then_else(t > s, -cc_f[t, s] * b_r[t] * T.cast(kg_s[t, s], acc), T.float32(0))
                        T.reducer_update(rg[t], zl)
                        T.reducer_update(cg[s], zl)
                    T.wgmma_gemm(do_s, vn_s, cc_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(cv_f, num_regs=r_ck)
                    T.warpgroup_fence_operand(ds_f, num_regs=r_kv)
                    # dG: scale rowsum(D dO S0^T * Q)
                    for t, d in T.Parallel(C, K):
                        T.reducer_update(rg[t], cv_f[t, d] * T.cast(q_s[t, d], acc))
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(cc_f, num_regs=r_cc)
                    # dG: rowsum(Z) - colsum(Z), Z = M * (Q K^T) strict (Pg holds scale Gamma Q K^T);
                    # then scale M = scale (dO v_new^T) * Gamma over Pg
                    for t, s in T.Parallel(C, C):
                        zz = T.if_then_else(t > s, cc_f[t, s] * T.cast(pg_s[t, s], acc), T.float32(0))
                        T.reducer_update(rg[t], zz)
                        T.reducer_update(cg[s], zz)
                        pg_s[t, s] = T.cast(
                            T.if_then_else(t >= s, scale * cc_f[t, s] * T.exp2(T.if_then_else(t >= s, g_r[t] - g_c[s], T.float32(0))),
                                           T.float32(0)), dtype)
                    T.fence_proxy_async()

                for _ in T.serial(1):
                    # dLk K, dq += (scale M) K, v_new D^T
                    T.wgmma_gemm(am_s, k_s, u_f, clear_accum=True)
                    T.wgmma_gemm(pg_s, k_s, cv_f)
                    T.wgmma_gemm(vn_s, ds_s, ck2_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(2)
                    T.warpgroup_fence_operand(u_f, num_regs=r_ck)
                    # dbeta: rowsum(dLk K * K)
                    for t, d in T.Parallel(C, K):
                        T.reducer_update(rb[t], u_f[t, d] * T.cast(k_s[t, d], acc))
                    for t, d in T.Parallel(C, K):
                        u_f[t, d] = u_f[t, d] * b_s[t]
                    for t, s in T.Parallel(C, C):
                        kg_s[t, s] = T.cast(b_s[t] * T.cast(am_s[t, s], acc), dtype)  # Kg is dead
                    T.fence_proxy_async()
                    # dk += (diag(beta) dLk)^T K, (-D dv) S0^T, (scale M)^T Q
                    T.wgmma_gemm(kg_s, k_s, u_f, transpose_A=True)
                    T.wgmma_gemm(dvn_s, h_s, u_f, transpose_B=True)
                    T.wgmma_gemm(pg_s, q_s, u_f, transpose_A=True)
                    T.wait_wgmma(4)
                    T.warpgroup_fence_operand(cv_f, num_regs=r_ck)
                    for t, d in T.Parallel(C, K):
                        if t < nvalid:
                            dq_hv[bidx, t0 + t, hv, d] = cv_f[t, d]
                    T.wait_wgmma(3)
                    T.warpgroup_fence_operand(ck2_f, num_regs=r_ck)
                    # dk_state = diag(r) v_new D^T; dG: -rowsum(dk_state * K), moved to the last valid row
                    for t, d in T.Parallel(C, K):
                        ck2_f[t, d] = ck2_f[t, d] * r_r[t]
                    # -pr adds -0.0 at the last valid row, which leaves every sum's bits as they are
                    for t, d in T.Parallel(C, K):
                        pr = T.if_then_else(t == nvalid - 1, T.float32(0), ck2_f[t, d] * T.cast(k_s[t, d], acc))
                        T.reducer_update(rg[t], -pr)
                        sc[1] = sc[1] + pr
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(u_f, num_regs=r_ck)
                    for t, d in T.Parallel(C, K):
                        u_f[t, d] = u_f[t, d] + ck2_f[t, d]
                    for t, d in T.Parallel(C, K):
                        if t < nvalid:
                            dk_hv[bidx, t0 + t, hv, d] = u_f[t, d]

                # ---- dbeta and the dG row (the chunk-end terms at the last valid row)
                T.finalize_reducer(rg, rg_f, batch=2)
                T.finalize_reducer(cg, cg_f, batch=8)
                T.finalize_reducer(rb, rb_f, batch=2)
                T.copy(rg_f, red_s[0, :])
                T.copy(cg_f, red_s[1, :])
                T.copy(rb_f, red_s[2, :])
                # the two scalars: warp sums, one slot per consumer warp (a fully replicated
                # T.alloc_reducer is not used here: TileLang 0.1.15 guards its per-thread init with the
                # consumer thread count but not the warpgroup offset, so the second consumer
                # warpgroup's partials would never be cleared)
                w0 = T.warp_reduce_sum(sc[0])
                w1 = T.warp_reduce_sum(sc[1])
                if tx % 32 == 0:
                    sc_s[0, (tx // 32) % 8] = w0
                    sc_s[1, (tx // 32) % 8] = w1
                for t in T.Parallel(C):
                    if t < nvalid:
                        dbeta[bidx, t0 + t, hv] = red_s[2, t]
                    dG[hv, row0 + t] = red_s[0, t] - red_s[1, t] + T.if_then_else(
                        t == nvalid - 1,
                        T.exp2(gcc_s[C - 1]) * (sc_s[0, 0] + sc_s[0, 1] + sc_s[0, 2] + sc_s[0, 3] + sc_s[0, 4] + sc_s[0, 5] + sc_s[0, 6] + sc_s[0, 7])
                        + (sc_s[1, 0] + sc_s[1, 1] + sc_s[1, 2] + sc_s[1, 3] + sc_s[1, 4] + sc_s[1, 5] + sc_s[1, 6] + sc_s[1, 7]),
                        T.float32(0))

            for i, j in T.Parallel(K, V):
                dh0[n, hv, i, j] = ds_f[i, j]

            if varlen:
                # rows of no sequence (before cu_seqlens[0], past cu_seqlens[-1]) get zero gradients,
                # written by the first / last sequence's CTA of each value head
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
                                dq_hv[0, lo + tb * C + t, hv, d] = T.float32(0)
                                dk_hv[0, lo + tb * C + t, hv, d] = T.float32(0)
                        for t, d in T.Parallel(C, V):
                            if tb * C + t < cnt:
                                dv[0, lo + tb * C + t, hv, d] = T.cast(0, dtype)
                        for t in T.Parallel(C):
                            if tb * C + t < cnt:
                                dbeta[0, lo + tb * C + t, hv] = T.float32(0)

    return gdn_chunk_bwd_v2

@functools.lru_cache(maxsize=None)
def build_chunk_bwd_fp16_kernel(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, beta_dtype: str,
                                seq_dtype: str, varlen: bool):
    """Compiled pass-2 kernel (cached). Static key: head counts, head dims, q's dtype, the stored h's
    dtype, beta's dtype, cu_seqlens' dtype, packed or not."""
    func = _chunk_bwd_prim_func(H, HV, K, V, dtype, h_dtype, beta_dtype, seq_dtype, varlen)
    return compile_kernel(func, f"gdn_chunk_bwd_fp16_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{h_dtype}_{beta_dtype}_{seq_dtype}_{int(varlen)}")


def chunk_fused_bwd_fp16(q, k, v, beta, A, g_cum_log2, h, do, dht, scale: float, cu_seqlens):
    """Launches pass 2 (arguments and results as `chunk_bwd.chunk_fused_bwd`; h in any of the stored
    dtypes; the sequences in token order)."""
    seq_dtype = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
    key = (q.shape[2], v.shape[2], q.shape[3], v.shape[3], tl_dtype(q.dtype), tl_dtype(h.dtype), tl_dtype(beta.dtype),
           seq_dtype, cu_seqlens is not None)
    return launch_pass2(lambda: build_chunk_bwd_fp16_kernel(*key), q, k, v, beta, A, g_cum_log2, h, do, dht, scale,
                        cu_seqlens)

"""Backward pass 2b of the "v3" backward: every gradient of every chunk, chunk-parallel, from the
state gradients pass 2a stored (`dh_bwd.py`). The products of pass 2 "v2" (`chunk_bwd_v2.py`) without
the state-gradient chain: nothing is carried from one chunk to the next, so the chunks of a sequence
run in many CTAs at once.

Why: pass 2 "v2" walks a sequence's chunks in one CTA per (sequence, value head) at ~17 us a chunk, so
when sequences x value heads are fewer than the 132 SMs most of the GPU idles, and splitting the
sequence (context parallelism) re-runs the forward chains to get there. Here the serial part is pass
2a's chain (three dependent products a chunk, per value slice of 64 columns), and pass 2b spreads
HV x slots / cpc CTAs over the SMs.

Math and reference stage: `reference.gdn.fused_bwd.chunk_bwd_fused` on all chunks at once given the
stored D (records BWD-Abeta, BWD-fused, BWD-dq, BWD-dG; the formulas are in `chunk_bwd.py`'s
docstring). Per chunk every product, operand and accumulation order is v2's, with D loaded (TMA) from
pass 2a's dh instead of rounded from registers; the dS update and dh0 are pass 2a's. One difference in
the arithmetic: the chunk-end term <S0, D> of dG reads D as stored (q's dtype) instead of v2's fp32
registers.

Grid: HV x group slots, a group being `cpc` consecutive chunks of one sequence (a run-time argument;
`locate_slot` with span 64 cpc finds the group's sequence: floor(cu[n] / (64 cpc)) + n, as the chunk
slots). Within a group the chunks are walked in reverse with v2's single-buffered TMA pipeline (a tile
is reloaded for the next chunk once its last reader is done). Group slots in a gap do nothing.
Outputs as v2 (`torch.empty` buffers: the first group of the first sequence zeroes the rows before
cu_seqlens[0], the last group of the last sequence the rows past cu_seqlens[-1]); dG zero-filled.
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, locate_slot, num_slots, tl_dtype

__all__ = ["DEFAULT_CPC", "build_chunk_bwd_v3_kernel", "chunk_grads_v3", "chunk_fused_bwd_v3"]

#: Chunks per CTA when the caller does not choose (`chunks_per_cta`).
DEFAULT_CPC = 4


def _chunk_bwd_v3_prim_func(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, beta_dtype: str, seq_dtype: str,
                            varlen: bool):
    import tilelang.language as T

    C = CHUNK
    G = HV // H
    acc = "float32"
    h_tma = h_dtype == dtype  # h stored in q's dtype: TMA straight into the operand tile
    # per-thread 32-bit registers of the accumulators (two consumer warpgroups, 256 threads)
    r_cc = C * C // 256
    r_cv = C * V // 256
    r_ck = C * K // 256

    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")
    Np1 = T.dynamic("Np1")
    SH = T.dynamic("SH")

    @T.prim_func
    def gdn_chunk_bwd_v3(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, HV, V), dtype),
        beta: T.Tensor((B, Tn, HV), beta_dtype),
        A: T.Tensor((HV, R, C), dtype),
        g_cum_log2: T.Tensor((HV, R), "float32"),
        h: T.Tensor((SH, K, V), h_dtype),
        do: T.Tensor((B, Tn, HV, V), dtype),
        dh: T.Tensor((SH, K, V), dtype),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        scale: T.float32,
        cpc: T.int32,
        dq_hv: T.Tensor((B, Tn, HV, K), "float32"),
        dk_hv: T.Tensor((B, Tn, HV, K), "float32"),
        dv: T.Tensor((B, Tn, HV, V), dtype),
        dbeta: T.Tensor((B, Tn, HV), "float32"),
        dG: T.Tensor((HV, R), "float32"),
    ):
        X = C * cpc  # tokens per group of chunks
        with T.Kernel(HV * ((Tn // X + Np1 - 1) if varlen else B * T.ceildiv(Tn, X)), threads=256) as (bx,):
            hv = bx % HV
            gs = bx // HV
            n, gi, bos, seqlen, bidx, _gvalid, _gt0 = locate_slot(gs, cu_seqlens, Tn, Np1, varlen, span=X)
            slot0 = (bos // C + n) if varlen else n * T.ceildiv(Tn, C)
            nchunks = T.ceildiv(seqlen, C)
            # chunks of this group: [gi cpc, gi cpc + nch); none for a slot in a gap or before
            # the first sequence's first group (gi < 0 there)
            nch = T.if_then_else(gi >= 0, T.max(T.min(cpc, nchunks - gi * cpc), 0), 0)
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
            ds_s = T.alloc_shared((K, V), dtype)  # D = dS' (pass 2a's operand copy)
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            # consumer tiles
            gcc_s = T.alloc_shared((C,), acc)  # copy of g_cum_log2 (its TMA tile is released at once)
            b_s = T.alloc_shared((C,), acc)
            kg_s = T.alloc_shared((C, C), dtype)  # Kg; then diag(beta) dLk
            am_s = T.alloc_shared((C, C), dtype)  # A (gated); then dLk = dL * Gamma_strict
            pg_s = T.alloc_shared((C, C), dtype)  # scale Q K^T * Gamma; then scale M
            w_s = T.alloc_shared((C, V), dtype)  # W; then scale diag(gamma) dO
            vn_s = T.alloc_shared((C, V), dtype)
            dvn_s = T.alloc_shared((C, V), dtype)  # dv_new; then -diag(gamma) dv
            red_s = T.alloc_shared((3, C), acc)  # finalised dG rows, dG columns, dbeta
            sc_s = T.alloc_shared((2, 8), acc)  # per consumer warp: <S0, D>, r-terms moved to the last valid row

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
            rg_f = T.alloc_fragment((C,), acc)
            cg_f = T.alloc_fragment((C,), acc)
            rb_f = T.alloc_fragment((C,), acc)

            for ci in T.Pipelined(nch, num_stages=1):
                c = gi * cpc + nch - 1 - ci
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
                T.copy(dh[(slot0 + c) * HV + hv, 0:K, 0:V], ds_s)

                # ---- gates (copy: the TMA tile goes back at once), reducers, rows past the end
                for t in T.Parallel(C):
                    gcc_s[t] = gc_s[t]
                T.reducer_init(rg)
                T.reducer_init(cg)
                T.reducer_init(rb)
                sc[0] = T.float32(0)
                sc[1] = T.float32(0)

                for _ in T.serial(1):
                    # rows past a sequence end are zero, as v1's masked loads (a sequence's last chunk
                    # only). Each tile is masked inside the group that first reads it: the pipeliner
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
                    if not h_tma:  # h stored in another dtype than q: loaded and rounded by the consumers
                        for i, j in T.Parallel(K, V):
                            h_s[i, j] = T.cast(h[(slot0 + c) * HV + hv, i, j], dtype)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(cc_f, num_regs=r_cc)
                    # Pg = scale (Q K^T) * Gamma (causal, diagonal included)
                    for t, s in T.Parallel(C, C):
                        pg_s[t, s] = T.cast(
                            T.if_then_else(t >= s, scale * cc_f[t, s] * T.exp2(T.if_then_else(t >= s, gcc_s[t] - gcc_s[s], T.float32(0))),
                                           T.float32(0)), dtype)
                    T.wgmma_gemm(k_s, k_s, cc_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(cv_f, num_regs=r_cv)
                    for t, d in T.Parallel(C, V):
                        cv_f[t, d] = cv_f[t, d] * T.exp2(T.min(gcc_s[C - 1] - gcc_s[t], T.float32(0)))
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(cc_f, num_regs=r_cc)
                    # Kg = (K K^T) * Gamma_strict
                    for t, s in T.Parallel(C, C):
                        kg_s[t, s] = T.cast(
                            T.if_then_else(t > s, cc_f[t, s] * T.exp2(T.if_then_else(t > s, gcc_s[t] - gcc_s[s], T.float32(0))),
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
                    T.wgmma_gemm(a_s, dvn_s, cv_f, transpose_A=True, clear_accum=True)
                    if nvalid < C:
                        for t, d in T.Parallel(C, V):
                            if t >= nvalid:
                                v_s[t, d] = T.cast(0, dtype)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(u_f, num_regs=r_cv)
                    for t, d in T.Parallel(C, V):
                        w_s[t, d] = T.cast(T.cast(v_s[t, d], acc) - T.exp2(gcc_s[t]) * u_f[t, d], dtype)
                    T.fence_proxy_async()
                    T.wgmma_gemm(a_s, w_s, ck2_f, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(cv_f, num_regs=r_cv)
                    for t, d in T.Parallel(C, V):
                        if t < nvalid:
                            dv[bidx, t0 + t, hv, d] = T.cast(cv_f[t, d], dtype)
                    # dG: -rowsum(dv * diag(gamma) U)
                    for t, d in T.Parallel(C, V):
                        T.reducer_update(rg[t], -cv_f[t, d] * T.exp2(gcc_s[t]) * u_f[t, d])
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
                        dvn_s[t, d] = T.cast(-T.exp2(gcc_s[t]) * cv_f[t, d], dtype)  # -diag(gamma) dv
                    # W is dead: scale diag(gamma) dO into its tile
                    for t, d in T.Parallel(C, V):
                        w_s[t, d] = T.cast(scale * T.exp2(gcc_s[t]) * T.cast(do_s[t, d], acc), dtype)
                    # <S0, D> (for the last valid row of dG): both tiles in shared memory, so the
                    # 256 consumer threads split the elements by hand (a T.Parallel loop adding into
                    # a per-thread scalar from shared memory alone is not partitioned: every thread
                    # summed all 16384)
                    for e in T.serial(K * V // 256):
                        sc[0] = sc[0] + T.cast(h_s[(e * 256 + tx % 256) // V, (e * 256 + tx % 256) % V], acc) * T.cast(
                            ds_s[(e * 256 + tx % 256) // V, (e * 256 + tx % 256) % V], acc)
                    T.fence_proxy_async()

                for _ in T.serial(1):
                    # dL = -X v_new^T, dq = scale D dO S0^T; then M = dO v_new^T (into dL's registers)
                    T.wgmma_gemm(v_s, vn_s, cc_f, transpose_B=True, clear_accum=True)
                    T.wgmma_gemm(w_s, h_s, cv_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(cc_f, num_regs=r_cc)
                    for t, s in T.Parallel(C, C):
                        am_s[t, s] = T.cast(
                            T.if_then_else(t > s, -cc_f[t, s] * T.exp2(T.if_then_else(t > s, gcc_s[t] - gcc_s[s], T.float32(0))),
                                           T.float32(0)), dtype)
                    # dG: rowsum(dL * L) - colsum(dL * L), L = diag(beta) Kg
                    for t, s in T.Parallel(C, C):
                        T.reducer_update(rg[t], T.if_then_else(t > s, -cc_f[t, s] * b_s[t] * T.cast(kg_s[t, s], acc), T.float32(0)))
                        T.reducer_update(cg[s], T.if_then_else(t > s, -cc_f[t, s] * b_s[t] * T.cast(kg_s[t, s], acc), T.float32(0)))
                    T.wgmma_gemm(do_s, vn_s, cc_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(cv_f, num_regs=r_ck)
                    # dG: scale rowsum(D dO S0^T * Q)
                    for t, d in T.Parallel(C, K):
                        T.reducer_update(rg[t], cv_f[t, d] * T.cast(q_s[t, d], acc))
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(cc_f, num_regs=r_cc)
                    # dG: rowsum(Z) - colsum(Z), Z = M * (Q K^T) strict (Pg holds scale Gamma Q K^T);
                    # then scale M = scale (dO v_new^T) * Gamma over Pg
                    for t, s in T.Parallel(C, C):
                        T.reducer_update(rg[t], T.if_then_else(t > s, cc_f[t, s] * T.cast(pg_s[t, s], acc), T.float32(0)))
                        T.reducer_update(cg[s], T.if_then_else(t > s, cc_f[t, s] * T.cast(pg_s[t, s], acc), T.float32(0)))
                        pg_s[t, s] = T.cast(
                            T.if_then_else(t >= s, scale * cc_f[t, s] * T.exp2(T.if_then_else(t >= s, gcc_s[t] - gcc_s[s], T.float32(0))),
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
                        ck2_f[t, d] = ck2_f[t, d] * T.exp2(T.min(gcc_s[C - 1] - gcc_s[t], T.float32(0)))
                    for t, d in T.Parallel(C, K):
                        T.reducer_update(rg[t], T.if_then_else(t == nvalid - 1, T.float32(0), -(ck2_f[t, d] * T.cast(k_s[t, d], acc))))
                        sc[1] = sc[1] + T.if_then_else(t == nvalid - 1, T.float32(0), ck2_f[t, d] * T.cast(k_s[t, d], acc))
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(u_f, num_regs=r_ck)
                    for t, d in T.Parallel(C, K):
                        u_f[t, d] = u_f[t, d] + ck2_f[t, d]
                    for t, d in T.Parallel(C, K):
                        if t < nvalid:
                            dk_hv[bidx, t0 + t, hv, d] = u_f[t, d]

                # ---- dbeta and the dG row (the chunk-end terms at the last valid row, as v1)
                T.finalize_reducer(rg, rg_f, batch=2)
                T.finalize_reducer(cg, cg_f, batch=8)
                T.finalize_reducer(rb, rb_f, batch=2)
                T.copy(rg_f, red_s[0, :])
                T.copy(cg_f, red_s[1, :])
                T.copy(rb_f, red_s[2, :])
                # the two scalars: warp sums, one slot per consumer warp (a fully replicated
                # T.alloc_reducer is not used here: TileLang 0.1.15 guards its per-thread init with the
                # consumer thread count but not the warpgroup offset, so the second consumer
                # warpgroup's partials were never cleared)
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

            if varlen:
                # rows of no sequence (before cu_seqlens[0], past cu_seqlens[-1]) get zero gradients,
                # written by the first group of the first sequence and the last group (or, when it is
                # empty, the only group slot) of the last sequence, per value head
                lo = T.alloc_var("int32")
                cnt = T.alloc_var("int32")
                lo = 0
                cnt = 0
                if T.And(n == 0, gi == 0):
                    cnt = T.cast(cu_seqlens[0], "int32")
                for side in T.serial(2):
                    if side == 1:
                        lo = T.cast(cu_seqlens[Np1 - 1], "int32")
                        cnt = T.if_then_else(T.And(n == Np1 - 2, gi == T.max(T.ceildiv(nchunks, cpc) - 1, 0)), Tn - lo, 0)
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

    return gdn_chunk_bwd_v3


@functools.lru_cache(maxsize=None)
def build_chunk_bwd_v3_kernel(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, beta_dtype: str, seq_dtype: str,
                              varlen: bool):
    """Compiled pass-2b kernel (cached). Same static key as `build_chunk_bwd_kernel`; chunks per CTA
    are a launch argument."""
    func = _chunk_bwd_v3_prim_func(H, HV, K, V, dtype, h_dtype, beta_dtype, seq_dtype, varlen)
    return compile_kernel(func, f"gdn_chunk_bwd_v3_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{h_dtype}_{beta_dtype}_{seq_dtype}_{int(varlen)}")


def chunk_grads_v3(q, k, v, beta, A, g_cum_log2, h, dh, do, scale: float, cu_seqlens, chunks_per_cta: int | None = None):
    """Launches pass 2b: (dq_hv, dk_hv, dv, dbeta, dG) as `chunk_bwd.chunk_fused_bwd`, from h (pass 1)
    and dh (pass 2a, [S * HV, K, V] in q's dtype). chunks_per_cta: chunks per CTA (>= 1; default
    `DEFAULT_CPC`)."""
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_bwd_kernel_args
    from flashqla.ops.gdn.kernels.sm90.prepare import dummy_cu_seqlens

    cpc = DEFAULT_CPC if chunks_per_cta is None else int(chunks_per_cta)
    if cpc < 1:
        raise ValueError(f"chunks_per_cta must be >= 1, got {chunks_per_cta}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    S = num_slots(B, T, N, varlen)
    dev = q.device
    dq_hv = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    dk_hv = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    dv = torch.empty_like(v)
    dbeta = torch.empty(B, T, HV, dtype=torch.float32, device=dev)
    dG = torch.zeros(HV, S * CHUNK, dtype=torch.float32, device=dev)
    if S == 0 or T == 0 or N == 0:  # no CTA would run
        for x in (dq_hv, dk_hv, dv, dbeta):
            x.zero_()
        return dq_hv, dk_hv, dv, dbeta, dG
    cu = cu_seqlens if varlen else dummy_cu_seqlens(dev)
    kernel = build_chunk_bwd_v3_kernel(*chunk_bwd_kernel_args(q, v, beta, h, cu_seqlens))
    kernel(q, k, v, beta, A, g_cum_log2, h, do, dh, cu, float(scale), cpc, dq_hv, dk_hv, dv, dbeta, dG)
    return dq_hv, dk_hv, dv, dbeta, dG


def chunk_fused_bwd_v3(q, k, v, beta, A, g_cum_log2, h, do, dht, scale: float, cu_seqlens, chunks_per_cta: int | None = None):
    """Pass 2 as two launches (2a: the state-gradient chain, `dh_bwd.chunk_dh_bwd`; 2b: the
    chunk-parallel gradients). Arguments and results as `chunk_bwd.chunk_fused_bwd`.

    Raises NotImplementedError for packed input (cu_seqlens given): see NOTES-bwd.md, "Pass-2 variant v3"."""
    from flashqla.ops.gdn.kernels.sm90.dh_bwd import chunk_dh_bwd

    if cu_seqlens is not None:
        raise NotImplementedError(
            "pass-2 variant 'v3' is experimental and refuses packed input (cu_seqlens): on the H200 its "
            "chunk-parallel kernel hung on packed batches (16/32 and 4/8 heads, 8 sequences of 8192 tokens); "
            "use variant 'v2' (the default; FLASHQLA_BWD_VARIANT unset)")
    dh, dh0 = chunk_dh_bwd(q, k, do, A, g_cum_log2, dht, scale, cu_seqlens)
    dq_hv, dk_hv, dv, dbeta, dG = chunk_grads_v3(q, k, v, beta, A, g_cum_log2, h, dh, do, scale, cu_seqlens, chunks_per_cta)
    return dq_hv, dk_hv, dv, dbeta, dG, dh0

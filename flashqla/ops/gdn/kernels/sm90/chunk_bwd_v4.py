"""Backward pass 2, variant "v4" (experimental; compiled on the CPU, not yet run on a GPU): v2's
per-chunk math with the products split over three warpgroups with their own roles, as laid out and
checked in `reference/gdn/staged_bwd.py` (six barrier stages per chunk; NOTES-bwd.md, "Plan: pass 2
with role-specialised consumer warpgroups").

Why: v2 (and the removed chunk-parallel v3) spend ~18-20 us a chunk per SM because two warpgroups share
every product and wait for each. Here each product runs on one warpgroup at full width, and the
roles work on different products of a stage at once. One CTA of 384 threads per (sequence, value
head), chunks in reverse:

    S  (threads   0-127) dS [K, V] fp32 in registers: <S0, D>, D's bf16 copy, gamma_C dS,
                         + Q^T dog, + K^T dvg (the chain's end), dh0; dbeta and the dG row last
    K  (threads 128-255) the chain: K D, + Pg^T dO, dv = A_beta^T dv_new, -diag(gamma) dv (over D's
                         rows 0..63); every dk product, and the dG rows that need dk's products
    A  (threads 256-383) Q K^T, K K^T, A = I - A_beta Kg, U, W, v_new, X, dL, M, dq; dG rows and
                         columns (the columns as row sums of dL^T and M^T, their own products: no
                         cross-warp reduction), dbeta's X W term

Math and reference: `reference.gdn.fused_bwd.chunk_bwd_fused` (records BWD-Abeta, BWD-fused, BWD-dq,
BWD-dG) in the order of `staged_bwd.SCHEDULE` (`tests/test_staged_bwd.py`: that order equals the
fused stage in fp64), with v2's operand roundings. Against v2 the row sums are `T.reduce_sum` per
role, the dG columns come from dL^T = -triu(v_new X^T) and M^T = v_new dO^T, rowsum(dvg * U) is
formed as rowsum((dvg S0^T) * K) by K, and M and dq = dog S0^T are formed twice (a second fragment
would not fit A's registers): fp32 summation orders differ, so results should match v2 to ~1e-6
relative, not bitwise.

Resources (CPU, TileLang 0.1.15, ptxas sm_90a, H = 1, HV = 2, packed):
- shared memory 230,416 B dynamic + 1,024 B static: the regions of `staged_bwd.TILES`, 1 KB under
  the limit (g and beta are read from global memory; no producer warpgroup);
- registers `NREG`: the CTA launches with 168 a thread; setmaxnreg moves 32 from A (dec to 136) to S
  (inc to 200), K keeps 168; 568 B of spill stores. With a producer warpgroup the roles needed
  ~600 registers a thread in all, over the 512 available.

Loads: at each chunk's start K loads q, k and A_beta and A loads V, dO and h (plain masked loads;
rows past a sequence end zero), then every role passes one barrier. They are not overlapped with
the previous chunk (a producer warpgroup with TMA would overlap them, if registers allow).
Synchronisation: one mbarrier per stage, 384 arrivals (every role arrives and waits each stage).
Outputs: every row of dq_hv, dk_hv, dv, dbeta is written (`torch.empty` buffers): S of the first
and last sequence's CTA zeroes the rows outside every sequence, as v2. K writes its dG and dbeta
partial rows to global memory in stages 2 and 4; S adds the other roles' partials in stage 5.

Unverified: whether it is correct and how fast it is. First device check:
`python tests/gpu/bwd_v2_check.py --precompile --base v2 --new v4` (v4's outputs NaN-poisoned, every
gradient against v2 and fp64, the packed tail, then pass 2 and the whole backward timed on four rows).
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, num_slots, sequence_span

__all__ = ["build_chunk_bwd_v4_kernel", "chunk_fused_bwd_v4"]

#: Registers per thread of each role (setmaxnreg; 128 threads each). The CTA launches with
#: LAUNCH_NREG (ptxas: 65536 / 384 rounded down to a multiple of 8) for every thread, so the roles
#: may only move registers between them: S raises its count (setmaxnreg.inc) with what A gives back
#: (setmaxnreg.dec), and the three sum to 3 * LAUNCH_NREG.
LAUNCH_NREG = 168
NREG = {"S": 200, "K": 168, "A": 136}


def _chunk_bwd_v4_prim_func(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, beta_dtype: str, seq_dtype: str,
                            varlen: bool):
    import tilelang.language as T

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

    @T.prim_func
    def gdn_chunk_bwd_v4(
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
        with T.Kernel(HV * ((Np1 - 1) if varlen else B), threads=384) as (bx,):
            hv = bx % HV
            n = bx // HV
            bos, seqlen, bidx, slot0, nchunks = sequence_span(n, cu_seqlens, Tn, varlen)
            hk = hv // G
            tx = T.get_thread_binding()

            # loaded at each chunk's start: q, k, A_beta by K; V, dO, h by A
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, V), dtype)  # V; then X (A, stage 2)
            do_s = T.alloc_shared((C, V), dtype)
            ab_s = T.alloc_shared((C, C), dtype)  # A diag(beta)
            h_s = T.alloc_shared((K, V), dtype)
            # written by the roles
            ds_s = T.alloc_shared((K, V), dtype)  # D (S, stage 0); rows 0..63: -diag(gamma) dv (K, stage 2)
            dog_s = T.alloc_shared((C, V), dtype)  # scale diag(gamma) dO
            pg_s = T.alloc_shared((C, C), dtype)  # scale (Q K^T) * Gamma; then scale M (A, stage 3)
            kg_s = T.alloc_shared((C, C), dtype)  # (K K^T) * Gamma_strict; then diag(beta) dLk
            am_s = T.alloc_shared((C, C), dtype)  # A = I - A_beta Kg; then dLk
            w_s = T.alloc_shared((C, V), dtype)
            vn_s = T.alloc_shared((C, V), dtype)
            dvn_s = T.alloc_shared((C, V), dtype)
            # [0, C): A's dG rows; [C, 2C): A's dG column sums (negated); [2C, 3C): A's dbeta rows;
            # [3C, 4C): K's rowsum(-diag(gamma) dv * U); [4C, 4C + 4): S's per-warp <S0, D>
            red_s = T.alloc_shared((4 * C + 4,), acc)

            bar = [T.alloc_barrier(arrive_count=384) for _ in range(6)]
            # every chunk starts with K loading q, k, A_beta and A loading V, dO, h into these tiles
            # (rows past the sequence end zero; A_beta and h are slot-major with inert padding
            # rows); then every role passes bar_ld
            bar_ld = T.alloc_barrier(arrive_count=384)

            if tx < 128:
                # ---------------------------------------------------------------- S
                T.set_max_nreg(NREG["S"], 1)  # inc: takes what A gives back
                dS = T.alloc_fragment((K, V), acc)
                sc0 = T.alloc_local((1,), acc)
                tot = T.alloc_local((2,), acc)
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
                    T.barrier_arrive(bar_ld)
                    T.barrier_wait(bar_ld, ci % 2)
                    # stage 0: <S0, D>, D's copy, gamma_C D, scale diag(gamma) dO
                    sc0[0] = T.float32(0)
                    for i, j in T.Parallel(K, V):
                        sc0[0] = sc0[0] + T.cast(h_s[i, j], acc) * dS[i, j]
                    T.copy(dS, ds_s)
                    for i, j in T.Parallel(K, V):
                        dS[i, j] = dS[i, j] * T.exp2(g_cum_log2[hv, row0 + C - 1])
                    for t, d in T.Parallel(C, V):
                        dog_s[t, d] = T.cast(scale * T.exp2(g_cum_log2[hv, row0 + t]) * T.cast(do_s[t, d], acc), dtype)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar[0])
                    T.barrier_wait(bar[0], ci % 2)
                    T.barrier_arrive(bar[1])
                    T.barrier_wait(bar[1], ci % 2)
                    # stage 2: dS += Q^T dog
                    T.gemm(q_s, dog_s, dS, transpose_A=True)
                    T.barrier_arrive(bar[2])
                    T.barrier_wait(bar[2], ci % 2)
                    # stage 3: dS += K^T (-diag(gamma) dv)  (the chain's end: D of the previous chunk)
                    T.gemm(k_s, ds_s[0:C, 0:V], dS, transpose_A=True)
                    T.barrier_arrive(bar[3])
                    T.barrier_wait(bar[3], ci % 2)
                    # stage 4: <S0, D> per warp; the sum of K's r-term rows (written to dG in its stage
                    # 2), read here so that no S thread's stage-5 update of dG can precede it
                    w0 = T.warp_reduce_sum(sc0[0])
                    if tx % 32 == 0:
                        red_s[4 * C + tx // 32] = w0
                    tot[1] = T.float32(0)
                    for e in T.serial(C):
                        tot[1] = tot[1] - dG[hv, row0 + e]
                    T.barrier_arrive(bar[4])
                    T.barrier_wait(bar[4], ci % 2)
                    # stage 5: dbeta and the dG row (chunk-end terms at the last valid row); K's
                    # r-term rows are in dG already (its stage 2), its dbeta rows in dbeta (stage 4)
                    tot[0] = red_s[4 * C] + red_s[4 * C + 1] + red_s[4 * C + 2] + red_s[4 * C + 3]
                    for t in T.Parallel(C):
                        if t < nvalid:
                            dbeta[bidx, t0 + t, hv] = dbeta[bidx, t0 + t, hv] + red_s[2 * C + t]
                        dG[hv, row0 + t] = dG[hv, row0 + t] + red_s[t] + red_s[C + t] + red_s[3 * C + t] + T.if_then_else(
                            t == nvalid - 1, T.exp2(g_cum_log2[hv, row0 + C - 1]) * tot[0] + tot[1], T.float32(0))
                    T.barrier_arrive(bar[5])
                    T.barrier_wait(bar[5], ci % 2)
                for i, j in T.Parallel(K, V):
                    dh0[n, hv, i, j] = dS[i, j]
                if varlen:
                    # rows of no sequence (before cu_seqlens[0], past cu_seqlens[-1]) get zero
                    # gradients, written by S of the first / last sequence's CTA of each value head
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
            elif tx < 256:
                # ---------------------------------------------------------------- K
                # K keeps the launch count (NREG["K"] == LAUNCH_NREG)
                cv = T.alloc_fragment((C, V), acc)  # dv_new, dv; then scratch
                dk = T.alloc_fragment((C, K), acc)
                rs = T.alloc_fragment((C,), acc)
                for ci in T.serial(nchunks):
                    c = nchunks - 1 - ci
                    t0 = bos + c * C
                    row0 = (slot0 + c) * C
                    nvalid = T.min(seqlen - c * C, C)
                    for t, s_ in T.Parallel(C, C):
                        ab_s[t, s_] = A[hv, row0 + t, s_]
                    for t, d in T.Parallel(C, K):
                        q_s[t, d] = T.if_then_else(t < nvalid, q[bidx, t0 + t, hk, d], T.cast(0, dtype))
                        k_s[t, d] = T.if_then_else(t < nvalid, k[bidx, t0 + t, hk, d], T.cast(0, dtype))
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_ld)
                    T.barrier_wait(bar_ld, ci % 2)
                    T.barrier_arrive(bar[0])
                    T.barrier_wait(bar[0], ci % 2)
                    # stage 1: dv_new = diag(r) K D + Pg^T dO
                    T.gemm(k_s, ds_s, cv, clear_accum=True)
                    for t, d in T.Parallel(C, V):
                        cv[t, d] = cv[t, d] * T.exp2(T.min(g_cum_log2[hv, row0 + C - 1] - g_cum_log2[hv, row0 + t], T.float32(0)))
                    T.gemm(pg_s, do_s, cv, transpose_A=True)
                    T.copy(cv, dvn_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar[1])
                    T.barrier_wait(bar[1], ci % 2)
                    # stage 2: dv = A_beta^T dv_new (stored); dk = diag(r) v_new D^T and its r-terms
                    # (into dG; 0 at the last valid row); -diag(gamma) dv over D's rows 0..63
                    T.gemm(ab_s, dvn_s, cv, transpose_A=True, clear_accum=True)
                    for t, d in T.Parallel(C, V):
                        if t < nvalid:
                            dv[bidx, t0 + t, hv, d] = T.cast(cv[t, d], dtype)
                    T.gemm(vn_s, ds_s, dk, transpose_B=True, clear_accum=True)
                    for t, d in T.Parallel(C, K):
                        dk[t, d] = dk[t, d] * T.exp2(T.min(g_cum_log2[hv, row0 + C - 1] - g_cum_log2[hv, row0 + t], T.float32(0)))
                    for t, d in T.Parallel(C, V):
                        ds_s[t, d] = T.cast(-T.exp2(g_cum_log2[hv, row0 + t]) * cv[t, d], dtype)
                    for t, d in T.Parallel(C, K):
                        cv[t, d] = dk[t, d] * T.cast(k_s[t, d], acc)
                    T.reduce_sum(cv, rs, dim=1)
                    for t in T.Parallel(C):
                        dG[hv, row0 + t] = T.if_then_else(t == nvalid - 1, T.float32(0), -rs[t])
                    T.fence_proxy_async()
                    T.barrier_arrive(bar[2])
                    T.barrier_wait(bar[2], ci % 2)
                    # stage 3: P = (-diag(gamma) dv) S0^T: dk += P; dG rows += rowsum(P * K)
                    # (= rowsum(-diag(gamma) dv * U), U = K S0: A needs no U after stage 1)
                    T.gemm(ds_s[0:C, 0:V], h_s, cv, transpose_B=True, clear_accum=True)
                    for t, d in T.Parallel(C, K):
                        dk[t, d] = dk[t, d] + cv[t, d]
                    for t, d in T.Parallel(C, K):
                        cv[t, d] = cv[t, d] * T.cast(k_s[t, d], acc)
                    T.reduce_sum(cv, rs, dim=1)
                    for t in T.Parallel(C):
                        red_s[3 * C + t] = rs[t]
                    T.barrier_arrive(bar[3])
                    T.barrier_wait(bar[3], ci % 2)
                    # stage 4: t = dLk K: dbeta rows (into dbeta), dk += beta t;
                    # dk += (diag(beta) dLk)^T K + (scale M)^T Q (stored)
                    T.gemm(am_s, k_s, cv, clear_accum=True)
                    for t, d in T.Parallel(C, K):
                        dk[t, d] = dk[t, d] + T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc), T.float32(0)) * cv[t, d]
                    for t, d in T.Parallel(C, K):
                        cv[t, d] = cv[t, d] * T.cast(k_s[t, d], acc)
                    T.reduce_sum(cv, rs, dim=1)
                    for t in T.Parallel(C):
                        if t < nvalid:
                            dbeta[bidx, t0 + t, hv] = rs[t]
                    T.gemm(kg_s, k_s, dk, transpose_A=True)
                    T.gemm(pg_s, q_s, dk, transpose_A=True)
                    for t, d in T.Parallel(C, K):
                        if t < nvalid:
                            dk_hv[bidx, t0 + t, hv, d] = dk[t, d]
                    T.barrier_arrive(bar[4])
                    T.barrier_wait(bar[4], ci % 2)
                    T.barrier_arrive(bar[5])
                    T.barrier_wait(bar[5], ci % 2)
            else:
                # ---------------------------------------------------------------- A
                T.set_max_nreg(NREG["A"], 0)  # dec
                cc = T.alloc_fragment((C, C), acc)  # Q K^T, K K^T, A_beta Kg, dL, dL^T, M, M^T
                F = T.alloc_fragment((C, V), acc)  # U, v_new, X, dq (and their row-sum scratch)
                rg = T.alloc_fragment((C,), acc)
                cg = T.alloc_fragment((C,), acc)
                rb = T.alloc_fragment((C,), acc)
                rt = T.alloc_fragment((C,), acc)
                for ci in T.serial(nchunks):
                    c = nchunks - 1 - ci
                    t0 = bos + c * C
                    row0 = (slot0 + c) * C
                    nvalid = T.min(seqlen - c * C, C)
                    for t, d in T.Parallel(C, V):
                        do_s[t, d] = T.if_then_else(t < nvalid, do[bidx, t0 + t, hv, d], T.cast(0, dtype))
                        v_s[t, d] = T.if_then_else(t < nvalid, v[bidx, t0 + t, hv, d], T.cast(0, dtype))
                    for i, j in T.Parallel(K, V):
                        h_s[i, j] = T.cast(h[(slot0 + c) * HV + hv, i, j], dtype)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar_ld)
                    T.barrier_wait(bar_ld, ci % 2)
                    # stage 0: Pg = scale (Q K^T) * Gamma
                    T.gemm(q_s, k_s, cc, transpose_B=True, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        pg_s[t, s] = T.cast(
                            T.if_then_else(t >= s, scale * cc[t, s] * T.exp2(T.if_then_else(t >= s, g_cum_log2[hv, row0 + t] - g_cum_log2[hv, row0 + s], T.float32(0))),
                                           T.float32(0)), dtype)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar[0])
                    T.barrier_wait(bar[0], ci % 2)
                    # stage 1: Kg, A = I - A_beta Kg, U = K S0, W = V - diag(gamma) U, v_new = A_beta W
                    T.gemm(k_s, k_s, cc, transpose_B=True, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        kg_s[t, s] = T.cast(
                            T.if_then_else(t > s, cc[t, s] * T.exp2(T.if_then_else(t > s, g_cum_log2[hv, row0 + t] - g_cum_log2[hv, row0 + s], T.float32(0))),
                                           T.float32(0)), dtype)
                    T.gemm(ab_s, kg_s, cc, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        am_s[t, s] = T.cast(T.if_then_else(t == s, T.float32(1), T.float32(0)) - cc[t, s], dtype)
                    T.gemm(k_s, h_s, F, clear_accum=True)
                    for t, d in T.Parallel(C, V):
                        w_s[t, d] = T.cast(T.cast(v_s[t, d], acc) - T.exp2(g_cum_log2[hv, row0 + t]) * F[t, d], dtype)
                    T.gemm(ab_s, w_s, F, clear_accum=True)
                    T.copy(F, vn_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar[1])
                    T.barrier_wait(bar[1], ci % 2)
                    # stage 2: X = A^T dv_new, over V; dbeta rows = rowsum(X W)
                    T.gemm(am_s, dvn_s, F, transpose_A=True, clear_accum=True)
                    T.copy(F, v_s)
                    for t, d in T.Parallel(C, V):
                        F[t, d] = F[t, d] * T.cast(w_s[t, d], acc)
                    T.reduce_sum(F, rb, dim=1)
                    T.fence_proxy_async()
                    T.barrier_arrive(bar[2])
                    T.barrier_wait(bar[2], ci % 2)
                    # stage 3: dL = -tril(X v_new^T): dLk over A, its dG rows; dL^T for the dG columns
                    # (row sums of the transpose: no cross-warp reduction); diag(beta) dLk over Kg;
                    # M = dO v_new^T: Z rows, M^T: Z columns; scale M over Pg; rowsum(dq Q)
                    T.gemm(v_s, vn_s, cc, transpose_B=True, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        cc[t, s] = T.if_then_else(t > s, -cc[t, s], T.float32(0))
                    for t, s in T.Parallel(C, C):
                        am_s[t, s] = T.cast(cc[t, s] * T.exp2(T.if_then_else(t > s, g_cum_log2[hv, row0 + t] - g_cum_log2[hv, row0 + s], T.float32(0))), dtype)
                    for t, s in T.Parallel(C, C):
                        cc[t, s] = cc[t, s] * T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc), T.float32(0)) * T.cast(kg_s[t, s], acc)
                    T.reduce_sum(cc, rg, dim=1)
                    # dL^T [s, t] = -(v_new X^T)[s, t] for t > s: column sums of dL * beta Kg as row sums
                    T.gemm(vn_s, v_s, cc, transpose_B=True, clear_accum=True)
                    for s_, t in T.Parallel(C, C):
                        cc[s_, t] = T.if_then_else(t > s_, -cc[s_, t] * T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc), T.float32(0)) * T.cast(kg_s[t, s_], acc), T.float32(0))
                    T.reduce_sum(cc, cg, dim=1)
                    for t, s in T.Parallel(C, C):
                        kg_s[t, s] = T.cast(T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc), T.float32(0)) * T.cast(am_s[t, s], acc), dtype)
                    # Z = M * Pg (strict; scale and Gamma are in Pg): rows from M, columns from M^T
                    T.gemm(do_s, vn_s, cc, transpose_B=True, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        cc[t, s] = T.if_then_else(t > s, cc[t, s] * T.cast(pg_s[t, s], acc), T.float32(0))
                    T.reduce_sum(cc, rt, dim=1)
                    for t in T.Parallel(C):
                        rg[t] = rg[t] + rt[t]
                    T.gemm(vn_s, do_s, cc, transpose_B=True, clear_accum=True)
                    for s_, t in T.Parallel(C, C):
                        cc[s_, t] = T.if_then_else(t > s_, cc[s_, t] * T.cast(pg_s[t, s_], acc), T.float32(0))
                    T.reduce_sum(cc, rt, dim=1)
                    for t in T.Parallel(C):
                        cg[t] = cg[t] + rt[t]
                    # M again (its registers held Z), then scale M * Gamma over Pg
                    T.gemm(do_s, vn_s, cc, transpose_B=True, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        pg_s[t, s] = T.cast(
                            T.if_then_else(t >= s, scale * cc[t, s] * T.exp2(T.if_then_else(t >= s, g_cum_log2[hv, row0 + t] - g_cum_log2[hv, row0 + s], T.float32(0))),
                                           T.float32(0)), dtype)
                    # dG rows += rowsum(dq Q), dq = dog S0^T (formed again in stage 4 for the output)
                    T.gemm(dog_s, h_s, F, transpose_B=True, clear_accum=True)
                    for t, d in T.Parallel(C, K):
                        F[t, d] = F[t, d] * T.cast(q_s[t, d], acc)
                    T.reduce_sum(F, rt, dim=1)
                    for t in T.Parallel(C):
                        rg[t] = rg[t] + rt[t]
                    T.fence_proxy_async()
                    T.barrier_arrive(bar[3])
                    T.barrier_wait(bar[3], ci % 2)
                    # stage 4: dq = dog S0^T + (scale M) K (stored); partials
                    T.gemm(dog_s, h_s, F, transpose_B=True, clear_accum=True)
                    T.gemm(pg_s, k_s, F)
                    for t, d in T.Parallel(C, K):
                        if t < nvalid:
                            dq_hv[bidx, t0 + t, hv, d] = F[t, d]
                    for t in T.Parallel(C):
                        red_s[t] = rg[t]
                    for t in T.Parallel(C):
                        red_s[C + t] = -cg[t]
                    for t in T.Parallel(C):
                        red_s[2 * C + t] = rb[t]
                    T.barrier_arrive(bar[4])
                    T.barrier_wait(bar[4], ci % 2)
                    T.barrier_arrive(bar[5])
                    T.barrier_wait(bar[5], ci % 2)

    return gdn_chunk_bwd_v4


@functools.lru_cache(maxsize=None)
def build_chunk_bwd_v4_kernel(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, beta_dtype: str, seq_dtype: str,
                              varlen: bool):
    """Compiled pass-2 kernel, variant v4 (cached). Same static key as `build_chunk_bwd_kernel`."""
    func = _chunk_bwd_v4_prim_func(H, HV, K, V, dtype, h_dtype, beta_dtype, seq_dtype, varlen)
    return compile_kernel(func, f"gdn_chunk_bwd_v4_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{h_dtype}_{beta_dtype}_{seq_dtype}_{int(varlen)}")


def chunk_fused_bwd_v4(q, k, v, beta, A, g_cum_log2, h, do, dht, scale: float, cu_seqlens):
    """Launches pass 2 with the v4 kernel. Arguments and results as `chunk_bwd.chunk_fused_bwd`;
    dq_hv, dk_hv, dv, dbeta are allocated uninitialised (the kernel writes every row, as v2)."""
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_bwd_kernel_args
    from flashqla.ops.gdn.kernels.sm90.prepare import dummy_cu_seqlens

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
    dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    if S == 0 or T == 0 or N == 0:
        for x in (dq_hv, dk_hv, dv, dbeta):
            x.zero_()
        if dht is not None:
            dh0.copy_(dht)
        else:
            dh0.zero_()
        return dq_hv, dk_hv, dv, dbeta, dG, dh0
    dht_arg = dht if dht is not None else torch.empty(1, HV, K, V, dtype=torch.float32, device=dev)
    cu = cu_seqlens if varlen else dummy_cu_seqlens(dev)
    kernel = build_chunk_bwd_v4_kernel(*chunk_bwd_kernel_args(q, v, beta, h, cu_seqlens))
    kernel(q, k, v, beta, A, g_cum_log2, h, do, dht_arg, cu, float(scale), int(dht is not None),
           dq_hv, dk_hv, dv, dbeta, dG, dh0)
    return dq_hv, dk_hv, dv, dbeta, dG, dh0

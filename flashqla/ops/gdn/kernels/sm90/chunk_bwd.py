"""Backward pass 2 of 3: every gradient
of every chunk, one CTA per (sequence, value head), chunks in reverse order, the state gradient dS
[K, V] fp32 in registers.

Reference stage: `reference.gdn.fused_bwd.chunk_bwd_fused` (records BWD-Abeta, BWD-fused, BWD-dq,
BWD-dG). Per chunk, with S0 = h (pass 1), D = dS (gradient of the chunk-end state), gamma, r, Gamma
from g_cum_log2 by exp2 (RW-4; every exponent a difference <= 0, masked before exp2):
    Kg = (K K^T) * Gamma_strict;  A = I - A_beta Kg;  U = K S0;  W = V - D U;  v_new = A_beta W
    dv_new = scale (Q K^T * Gamma)^T dO + diag(r) K D
    X = A^T dv_new;  dv = A_beta^T dv_new + diag(beta - round(beta)) dv_new  (the stored diagonal of
        A_beta is beta rounded to q's dtype: dv takes the exact one; NOTES-bwd.md, "The exact diagonal")
    M = (dO v_new^T) * Gamma;  dq = scale (diag(gamma) dO S0^T + M K)
    dL = -tril_-1(X v_new^T) * Gamma;  dk = diag(r) v_new D^T + scale M^T Q - diag(gamma) dv S0^T
         + diag(beta) dL K + dL^T diag(beta) K
    dbeta = rowsum(X * W) + rowsum((dL K) * K)
    dG (dL/dg_cum, before the reverse cumsum of pass 3), the cancellation-free form, with the
         chunk-end terms at the last VALID row
    dS <- gamma_C dS + scale Q^T diag(gamma) dO - K^T diag(gamma) dv       (dh0 after the first chunk)
Outputs: dq_hv, dk_hv [B, T, HV, K] fp32 per value head (pass 3 sums the GVA groups and rounds;
v5 stores them in q's dtype on request: $FLASHQLA_BWD_QK_DTYPE),
dv [B, T, HV, V] in v's dtype, dbeta [B, T, HV] fp32, dG [HV, S * 64] fp32 slot-major, dh0
[N, HV, K, V] fp32. Rows past a sequence end are loaded as zero (masked loads) and never stored.

Schedule: serial per chunk (plain loads, every product waited), 256 threads (two warpgroups); a
first version to prove the stage on the GPU. Products on bf16/fp16 operands in shared memory with
fp32 accumulation; the state gradient goes to a bf16 copy in shared memory for K D and v_new D^T
(`test_low_precision_storage_cost` measures what that rounding alone costs: ~2e-3 .. 4e-3).
"""

import functools
import os

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, num_slots, sequence_span, tl_dtype

__all__ = ["DEFAULT_VARIANT", "VARIANTS", "build_chunk_bwd_kernel", "chunk_bwd_kernel_args", "chunk_fused_bwd", "pass2_variant"]

#: Pass-2 kernels: "v1" (this module), "v2" (`chunk_bwd_v2.py`, rescheduled) and "v5"
#: (`chunk_bwd_v5.py`, role warpgroups with a TMA producer; h in q's dtype and K = V = 128, else v2 runs).
#: "v3" (the state-gradient chain alone, then the other gradients chunk-parallel) and "v4" (role
#: warpgroups without a producer) were measured on the H200, slower than v2, and removed: NOTES-bwd.md,
#: "Pass-2 variant v3" and "Pass-2 variant v4".
VARIANTS = ("v1", "v2", "v5")
#: The variant `chunk_fused_bwd` uses when none is given (read at every call; the environment variable
#: FLASHQLA_BWD_VARIANT sets it at import). "v5" since its H200 check (2026-12-01,
#: tests/gpu/bwd_v2_check.py --base v2 --new v5): dv, dh0 bitwise v2's, the other gradients within
#: summation order and two roundings, pass 2 1.11-1.27x faster than v2.
DEFAULT_VARIANT = os.environ.get("FLASHQLA_BWD_VARIANT", "v5")


def _variant(variant):
    variant = DEFAULT_VARIANT if variant is None else variant
    if variant.startswith("v5:"):  # v5 with the build options given (`chunk_bwd_v5.OPTS`; "v5:" none)
        from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v5 import canonical_opts

        try:
            canonical_opts(variant[3:], True)
            return variant
        except ValueError:
            pass
    if variant not in VARIANTS:
        raise ValueError(f"pass-2 variant must be one of {VARIANTS} or 'v5:' with options of chunk_bwd_v5.OPTS, "
                         f"got {variant!r}")
    return variant


def _v5_opts(variant: str) -> str | None:
    """The build options a v5 variant name asks for; None (`chunk_bwd_v5.DEFAULT_OPTS`) for "v5"."""
    return variant[3:] if variant.startswith("v5:") else None


def pass2_variant(varlen: bool, dh0: bool, variant: str | None = None) -> str:
    """The variant name `chunk_fused_bwd` builds for `variant` (None: `DEFAULT_VARIANT`) on packed
    input or not, returning dh0 or not: plain "v5" resolved to "v5:<letters>"
    (`chunk_bwd_v5.canonical_opts`), any other name as it is (for kernel lists and precompiles)."""
    variant = _variant(variant)
    if variant == "v5":
        from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v5 import canonical_opts

        return "v5:" + canonical_opts(None, varlen, dh0)
    return variant


def _chunk_bwd_prim_func(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, beta_dtype: str, seq_dtype: str,
                         varlen: bool):
    import tilelang.language as T

    C = CHUNK
    G = HV // H
    acc = "float32"

    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")
    Np1 = T.dynamic("Np1")
    N1 = T.dynamic("N1")  # rows of dht (N, or 1 for the placeholder)
    N2 = T.dynamic("N2")  # rows of dh0
    SH = T.dynamic("SH")

    @T.prim_func
    def gdn_chunk_bwd(
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

            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, V), dtype)  # V, then X = A^T dv_new
            do_s = T.alloc_shared((C, V), dtype)
            h_s = T.alloc_shared((K, V), dtype)
            ds_s = T.alloc_shared((K, V), dtype)
            a_s = T.alloc_shared((C, C), dtype)  # A_beta; then scale M
            am_s = T.alloc_shared((C, C), dtype)  # A (gated), from A_beta; then dLk = dL * Gamma_strict
            kg_s = T.alloc_shared((C, C), dtype)  # Kg; then diag(beta) dLk
            pg_s = T.alloc_shared((C, C), dtype)  # scale Q K^T * Gamma
            w_s = T.alloc_shared((C, V), dtype)  # W; then scale diag(gamma) dO
            vn_s = T.alloc_shared((C, V), dtype)
            dvn_s = T.alloc_shared((C, V), dtype)  # dv_new; then -diag(gamma) dv
            gc_s = T.alloc_shared((C,), acc)
            b_s = T.alloc_shared((C,), acc)
            dl_s = T.alloc_shared((C,), acc)  # beta - beta rounded to q's dtype (the stored diagonal), 0 past the end

            ds_f = T.alloc_fragment((K, V), acc)
            cc_f = T.alloc_fragment((C, C), acc)
            cc2_f = T.alloc_fragment((C, C), acc)
            cv_f = T.alloc_fragment((C, V), acc)
            cv2_f = T.alloc_fragment((C, V), acc)
            ck_f = T.alloc_fragment((C, K), acc)
            ck2_f = T.alloc_fragment((C, K), acc)
            kv_f = T.alloc_fragment((K, V), acc)
            kvr_f = T.alloc_fragment((K,), acc)
            # per-row reductions, each in its own fragment (reducer layouts differ), staged in red_s:
            # 0 -rowsum(dv * D U)  1 rowsum(X * W)  2 rowsum(dL * L)  3 colsum(dL * L)  4 rowsum(dLk K * K)
            # 5 rowsum(Z)  6 colsum(Z)  7 rowsum(diag(r) v_new D^T * K)  8 rowsum(scale D dO S0^T * Q)
            r0_f = T.alloc_fragment((C,), acc)
            r1_f = T.alloc_fragment((C,), acc)
            r2_f = T.alloc_fragment((C,), acc)
            r3_f = T.alloc_fragment((C,), acc)
            r4_f = T.alloc_fragment((C,), acc)
            r5_f = T.alloc_fragment((C,), acc)
            r6_f = T.alloc_fragment((C,), acc)
            r7_f = T.alloc_fragment((C,), acc)
            r8_f = T.alloc_fragment((C,), acc)
            red_s = T.alloc_shared((9, C), acc)
            kvr_s = T.alloc_shared((K,), acc)

            if use_dht != 0:
                for i, j in T.Parallel(K, V):
                    ds_f[i, j] = dht[n, hv, i, j]
            else:
                T.clear(ds_f)

            for ci in T.serial(nchunks):
                c = nchunks - 1 - ci
                t0 = bos + c * C
                row0 = (slot0 + c) * C
                nvalid = T.min(seqlen - c * C, C)
                # ---- loads (rows past the sequence end are zero)
                for t, d in T.Parallel(C, K):
                    q_s[t, d] = T.if_then_else(t < nvalid, q[bidx, t0 + t, hk, d], T.cast(0, dtype))
                    k_s[t, d] = T.if_then_else(t < nvalid, k[bidx, t0 + t, hk, d], T.cast(0, dtype))
                for t, d in T.Parallel(C, V):
                    v_s[t, d] = T.if_then_else(t < nvalid, v[bidx, t0 + t, hv, d], T.cast(0, dtype))
                    do_s[t, d] = T.if_then_else(t < nvalid, do[bidx, t0 + t, hv, d], T.cast(0, dtype))
                for t in T.Parallel(C):
                    b_s[t] = T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc), T.float32(0))
                    dl_s[t] = T.if_then_else(
                        t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc) - T.cast(T.cast(beta[bidx, t0 + t, hv], dtype), acc),
                        T.float32(0))
                    gc_s[t] = g_cum_log2[hv, row0 + t]
                for t, s in T.Parallel(C, C):
                    a_s[t, s] = A[hv, row0 + t, s]
                for i, j in T.Parallel(K, V):
                    h_s[i, j] = T.cast(h[(slot0 + c) * HV + hv, i, j], dtype)
                    ds_s[i, j] = T.cast(ds_f[i, j], dtype)
                T.fence_proxy_async()

                # ---- Kg = (K K^T) * Gamma_strict;  A = I - A_beta Kg  (BWD-Abeta)
                T.fence_proxy_async()
                T.gemm(k_s, k_s, cc_f, transpose_B=True, clear_accum=True)
                for t, s in T.Parallel(C, C):
                    kg_s[t, s] = T.cast(
                        T.if_then_else(t > s, cc_f[t, s] * T.exp2(T.if_then_else(t > s, gc_s[t] - gc_s[s], T.float32(0))),
                                       T.float32(0)), dtype)
                T.fence_proxy_async()
                T.gemm(a_s, kg_s, cc2_f, clear_accum=True)
                for t, s in T.Parallel(C, C):
                    am_s[t, s] = T.cast(T.if_then_else(t == s, T.float32(1), T.float32(0)) - cc2_f[t, s], dtype)
                # ---- Pg = scale (Q K^T) * Gamma (causal, diagonal included)
                T.fence_proxy_async()
                T.gemm(q_s, k_s, cc_f, transpose_B=True, clear_accum=True)
                for t, s in T.Parallel(C, C):
                    pg_s[t, s] = T.cast(
                        T.if_then_else(t >= s, scale * cc_f[t, s] * T.exp2(T.if_then_else(t >= s, gc_s[t] - gc_s[s], T.float32(0))),
                                       T.float32(0)), dtype)
                # ---- U = K S0;  W = V - diag(gamma) U;  v_new = A_beta W
                T.fence_proxy_async()
                T.gemm(k_s, h_s, cv_f, clear_accum=True)
                for t, d in T.Parallel(C, V):
                    w_s[t, d] = T.cast(T.cast(v_s[t, d], acc) - T.exp2(gc_s[t]) * cv_f[t, d], dtype)
                T.fence_proxy_async()
                T.gemm(a_s, w_s, cv2_f, clear_accum=True)
                T.copy(cv2_f, vn_s)
                # ---- dv_new = diag(r) K D + Pg^T dO
                T.fence_proxy_async()
                T.gemm(k_s, ds_s, cv_f, clear_accum=True)
                for t, d in T.Parallel(C, V):
                    cv_f[t, d] = cv_f[t, d] * T.exp2(T.min(gc_s[C - 1] - gc_s[t], T.float32(0)))
                T.fence_proxy_async()
                T.gemm(pg_s, do_s, cv_f, transpose_A=True)
                T.copy(cv_f, dvn_s)
                for t, d in T.Parallel(C, V):  # the exact diagonal of A diag(beta) in dv (as v2)
                    cv_f[t, d] = dl_s[t] * cv_f[t, d]
                T.fence_proxy_async()
                # ---- dv = A_beta^T dv_new + diag(delta) dv_new (stored);  -diag(gamma) dv for dS and dk
                T.fence_proxy_async()
                T.gemm(a_s, dvn_s, cv_f, transpose_A=True)
                for t, d in T.Parallel(C, V):
                    if t < nvalid:
                        dv[bidx, t0 + t, hv, d] = T.cast(cv_f[t, d], dtype)
                # dG term: -rowsum(dv * diag(gamma) U), U recomputed (W - V would cancel at strong decay)
                T.fence_proxy_async()
                T.gemm(k_s, h_s, cv2_f, clear_accum=True)
                for t, d in T.Parallel(C, V):
                    cv2_f[t, d] = -cv_f[t, d] * T.exp2(gc_s[t]) * cv2_f[t, d]
                T.reduce_sum(cv2_f, r0_f, dim=1)
                T.copy(r0_f, red_s[0, :])
                # ---- X = A^T dv_new (into v_s: V is dead);  dbeta = rowsum(X * W) + ...
                T.fence_proxy_async()
                T.gemm(am_s, dvn_s, cv2_f, transpose_A=True, clear_accum=True)
                T.copy(cv2_f, v_s)
                for t, d in T.Parallel(C, V):
                    dvn_s[t, d] = T.cast(-T.exp2(gc_s[t]) * cv_f[t, d], dtype)  # -diag(gamma) dv
                for t, d in T.Parallel(C, V):
                    cv2_f[t, d] = cv2_f[t, d] * T.cast(w_s[t, d], acc)
                T.reduce_sum(cv2_f, r1_f, dim=1)
                T.copy(r1_f, red_s[1, :])
                # ---- dL = -tril_-1(X v_new^T);  dLk = dL * Gamma_strict (in am_s); dG: rowsum/colsum(dL * L)
                T.fence_proxy_async()
                T.gemm(v_s, vn_s, cc_f, transpose_B=True, clear_accum=True)
                for t, s in T.Parallel(C, C):
                    am_s[t, s] = T.cast(
                        T.if_then_else(t > s, -cc_f[t, s] * T.exp2(T.if_then_else(t > s, gc_s[t] - gc_s[s], T.float32(0))),
                                       T.float32(0)), dtype)
                for t, s in T.Parallel(C, C):
                    cc2_f[t, s] = T.if_then_else(t > s, -cc_f[t, s] * b_s[t] * T.cast(kg_s[t, s], acc), T.float32(0))
                T.reduce_sum(cc2_f, r2_f, dim=1)
                T.copy(r2_f, red_s[2, :])
                T.reduce_sum(cc2_f, r3_f, dim=0)
                T.copy(r3_f, red_s[3, :])
                T.fence_proxy_async()
                # ---- dk: dLk K (dbeta and beta-weighted), dLk^T diag(beta) K
                T.fence_proxy_async()
                T.gemm(am_s, k_s, ck_f, clear_accum=True)
                for t, d in T.Parallel(C, K):
                    ck2_f[t, d] = ck_f[t, d] * T.cast(k_s[t, d], acc)
                T.reduce_sum(ck2_f, r4_f, dim=1)
                T.copy(r4_f, red_s[4, :])
                for t, d in T.Parallel(C, K):
                    ck_f[t, d] = ck_f[t, d] * b_s[t]
                for t, s in T.Parallel(C, C):
                    kg_s[t, s] = T.cast(b_s[t] * T.cast(am_s[t, s], acc), dtype)  # Kg is dead
                T.fence_proxy_async()
                T.gemm(kg_s, k_s, ck_f, transpose_A=True)
                T.fence_proxy_async()
                T.gemm(dvn_s, h_s, ck_f, transpose_B=True)
                # ---- M = (dO v_new^T) * Gamma; Z = M * (Q K^T) strict for dG
                T.fence_proxy_async()
                T.gemm(do_s, vn_s, cc_f, transpose_B=True, clear_accum=True)
                for t, s in T.Parallel(C, C):
                    a_s[t, s] = T.cast(
                        T.if_then_else(t >= s, scale * cc_f[t, s] * T.exp2(T.if_then_else(t >= s, gc_s[t] - gc_s[s], T.float32(0))),
                                       T.float32(0)), dtype)
                for t, s in T.Parallel(C, C):
                    # Z_ts = M_ts (Q K^T)_ts, strict, = dO v_new^T * Pg (Pg holds scale Gamma * Q K^T)
                    cc2_f[t, s] = T.if_then_else(t > s, cc_f[t, s] * T.cast(pg_s[t, s], acc), T.float32(0))
                T.reduce_sum(cc2_f, r5_f, dim=1)
                T.copy(r5_f, red_s[5, :])
                T.reduce_sum(cc2_f, r6_f, dim=0)
                T.copy(r6_f, red_s[6, :])
                T.fence_proxy_async()
                T.gemm(a_s, q_s, ck_f, transpose_A=True)
                # ---- dk_state = diag(r) v_new D^T; s = rowsum(dk_state * K)
                T.fence_proxy_async()
                T.gemm(vn_s, ds_s, ck2_f, transpose_B=True, clear_accum=True)
                for t, d in T.Parallel(C, K):
                    ck2_f[t, d] = ck2_f[t, d] * T.exp2(T.min(gc_s[C - 1] - gc_s[t], T.float32(0)))
                for t, d in T.Parallel(C, K):
                    ck_f[t, d] = ck_f[t, d] + ck2_f[t, d]
                for t, d in T.Parallel(C, K):
                    if t < nvalid:
                        dk_hv[bidx, t0 + t, hv, d] = ck_f[t, d]
                for t, d in T.Parallel(C, K):
                    ck2_f[t, d] = ck2_f[t, d] * T.cast(k_s[t, d], acc)
                T.reduce_sum(ck2_f, r7_f, dim=1)
                T.copy(r7_f, red_s[7, :])
                # ---- dq = scale diag(gamma) dO S0^T + (scale M) K;  dG: scale rowsum(diag(gamma) dO S0^T * Q)
                for t, d in T.Parallel(C, V):
                    w_s[t, d] = T.cast(scale * T.exp2(gc_s[t]) * T.cast(do_s[t, d], acc), dtype)  # W is dead
                T.fence_proxy_async()
                T.gemm(w_s, h_s, ck_f, transpose_B=True, clear_accum=True)
                for t, d in T.Parallel(C, K):
                    ck2_f[t, d] = ck_f[t, d] * T.cast(q_s[t, d], acc)
                T.reduce_sum(ck2_f, r8_f, dim=1)
                T.copy(r8_f, red_s[8, :])
                T.fence_proxy_async()
                T.gemm(a_s, k_s, ck_f)
                for t, d in T.Parallel(C, K):
                    if t < nvalid:
                        dq_hv[bidx, t0 + t, hv, d] = ck_f[t, d]
                # ---- gamma_C <S0, D> for the last valid row
                for i, j in T.Parallel(K, V):
                    kv_f[i, j] = T.cast(h_s[i, j], acc) * ds_f[i, j]
                T.reduce_sum(kv_f, kvr_f, dim=1)
                T.copy(kvr_f, kvr_s)
                # ---- dbeta and the dG row. The r-term of the last valid row cancels exactly against its
                # share of the chunk-end sum and is left out; the other r-terms move to the last valid
                # row (the cancellation-free form of reference.gdn.chunk_bwd.chunk_bwd_dqkwg).
                for t in T.Parallel(C):
                    if t < nvalid:
                        dbeta[bidx, t0 + t, hv] = red_s[1, t] + red_s[4, t]
                for t in T.Parallel(C):
                    s_all = T.alloc_var(acc)
                    sd = T.alloc_var(acc)
                    s_all = 0.0
                    sd = 0.0
                    for j2 in T.serial(C):
                        s_all = s_all + T.if_then_else(j2 == nvalid - 1, T.float32(0), red_s[7, j2])
                    for j2 in T.serial(K):
                        sd = sd + kvr_s[j2]
                    dG[hv, row0 + t] = (
                        red_s[0, t] + red_s[2, t] - red_s[3, t] + red_s[5, t] - red_s[6, t] + red_s[8, t]
                        - T.if_then_else(t == nvalid - 1, T.float32(0), red_s[7, t])
                        + T.if_then_else(t == nvalid - 1, T.exp2(gc_s[C - 1]) * sd + s_all, T.float32(0))
                    )
                # ---- dS <- gamma_C dS + scale Q^T diag(gamma) dO - K^T diag(gamma) dv
                for i, j in T.Parallel(K, V):
                    ds_f[i, j] = ds_f[i, j] * T.exp2(gc_s[C - 1])
                T.fence_proxy_async()
                T.gemm(q_s, w_s, ds_f, transpose_A=True)
                T.fence_proxy_async()
                T.gemm(k_s, dvn_s, ds_f, transpose_A=True)

            for i, j in T.Parallel(K, V):
                dh0[n, hv, i, j] = ds_f[i, j]

    return gdn_chunk_bwd


@functools.lru_cache(maxsize=None)
def build_chunk_bwd_kernel(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, beta_dtype: str, seq_dtype: str,
                           varlen: bool, variant: str = "v1"):
    """Compiled pass-2 kernel (cached). Static key: head counts, head dims, dtype of q/k/v/A, dtype of
    the stored h, beta's dtype, cu_seqlens' dtype, packed or not, and the variant (`VARIANTS`, or
    "v5:<letters>": v5 with those build options, `chunk_bwd_v5.OPTS`; plain "v5" takes
    `chunk_bwd_v5.DEFAULT_OPTS`); T, B, sequences are run-time."""
    variant = _variant(variant)
    if variant.startswith("v5"):
        from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v5 import build_chunk_bwd_v5_kernel, v5_applies

        if v5_applies(K, V, dtype, h_dtype):
            return build_chunk_bwd_v5_kernel(H, HV, K, V, dtype, h_dtype, beta_dtype, seq_dtype, varlen, opts=_v5_opts(variant))
        variant = "v2"
    if variant == "v2":
        from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v2 import build_chunk_bwd_v2_kernel

        return build_chunk_bwd_v2_kernel(H, HV, K, V, dtype, h_dtype, beta_dtype, seq_dtype, varlen)
    func = _chunk_bwd_prim_func(H, HV, K, V, dtype, h_dtype, beta_dtype, seq_dtype, varlen)
    return compile_kernel(func, f"gdn_chunk_bwd_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{h_dtype}_{beta_dtype}_{seq_dtype}_{int(varlen)}")


def chunk_bwd_kernel_args(q, v, beta, h, cu_seqlens) -> tuple:
    seq_dtype = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
    return (q.shape[2], v.shape[2], q.shape[3], v.shape[3], tl_dtype(q.dtype), tl_dtype(h.dtype), tl_dtype(beta.dtype),
            seq_dtype, cu_seqlens is not None)


def chunk_fused_bwd(q, k, v, beta, A, g_cum_log2, h, do, dht, scale: float, cu_seqlens, variant: str | None = None,
                    order=None, dh0: bool = True):
    """Launches pass 2. Arguments: the forward's inputs (contiguous), its
    A and g_cum_log2, h from pass 1, do [B, T, HV, V], dht None or [N, HV, K, V] fp32; variant: "v1"
    (this kernel), "v2" (`chunk_bwd_v2`), "v5" or "v5:<letters>" (`chunk_bwd_v5`, as
    `build_chunk_bwd_kernel`), None for `DEFAULT_VARIANT`; order: the sequences' launch
    order (`_common.launch_order`, v5 only; the others launch in token order). The same results.
    dh0: whether the caller uses the dh0 it returns (plain "v5" then adds `chunk_bwd_v5.DH0_OPTS`,
    the more precise state gradient; without it dh0 is still written, from the default build).

    Returns (dq_hv [B, T, HV, K], dk_hv [B, T, HV, K] (fp32; q's dtype from v5 under
    $FLASHQLA_BWD_QK_DTYPE=input),
    dv [B, T, HV, V] v's dtype,
    dbeta [B, T, HV] fp32, dG [HV, S * 64] fp32, dh0 [N, HV, K, V] fp32)."""
    variant = _variant(variant)
    if variant.startswith("v5"):
        from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v5 import chunk_fused_bwd_v5, v5_applies

        if v5_applies(*chunk_bwd_kernel_args(q, v, beta, h, cu_seqlens)[2:4], tl_dtype(q.dtype), tl_dtype(h.dtype)):
            return chunk_fused_bwd_v5(q, k, v, beta, A, g_cum_log2, h, do, dht, scale, cu_seqlens, order=order,
                                      opts=_v5_opts(variant), dh0=dh0)
        variant = "v2"
    if variant == "v2":
        from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v2 import chunk_fused_bwd_v2

        return chunk_fused_bwd_v2(q, k, v, beta, A, g_cum_log2, h, do, dht, scale, cu_seqlens)
    from flashqla.ops.gdn.kernels.sm90.prepare import dummy_cu_seqlens

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    S = num_slots(B, T, N, varlen)
    dev = q.device
    dq_hv = torch.zeros(B, T, HV, K, dtype=torch.float32, device=dev)
    dk_hv = torch.zeros(B, T, HV, K, dtype=torch.float32, device=dev)
    dv = torch.zeros_like(v)
    dbeta = torch.zeros(B, T, HV, dtype=torch.float32, device=dev)
    dG = torch.zeros(HV, S * CHUNK, dtype=torch.float32, device=dev)
    dh0 = torch.zeros(N, HV, K, V, dtype=torch.float32, device=dev)
    if S == 0 or T == 0 or N == 0:
        if dht is not None:
            dh0.copy_(dht)
        return dq_hv, dk_hv, dv, dbeta, dG, dh0
    dht_arg = dht if dht is not None else torch.empty(1, HV, K, V, dtype=torch.float32, device=dev)
    cu = cu_seqlens if varlen else dummy_cu_seqlens(dev)
    kernel = build_chunk_bwd_kernel(*chunk_bwd_kernel_args(q, v, beta, h, cu_seqlens))
    kernel(q, k, v, beta, A, g_cum_log2, h, do, dht_arg, cu, float(scale), int(dht is not None),
           dq_hv, dk_hv, dv, dbeta, dG, dh0)
    return dq_hv, dk_hv, dv, dbeta, dG, dh0

"""Backward pass 2a ("v3" backward): the state-gradient chain alone. Per chunk, in reverse, it stores
the gradient D of the chunk's end state, so that every other gradient can then be formed chunk by
chunk in parallel (`chunk_bwd_v3.py`, pass 2b).

Reference stage: `reference.gdn.fused_bwd.state_grad_chain` (the dS lines of record BWD-fused).
Per chunk, with D the gradient of the chunk-end state (dht for the last chunk of a sequence):
    Pg     = scale (Q K^T) * Gamma            (causal, diagonal included)
    dv_new = diag(r) K D + Pg^T dO
    dv     = A_beta^T dv_new
    dS     = gamma_C D + Q^T (scale diag(gamma) dO) - K^T (diag(gamma) dv)   (D of the previous chunk)
The value columns of dS are independent: one CTA per (value slice of BV = 64 columns, value head,
sequence), the transposed gradient dS^T [BV, K] fp32 in registers, 128 threads (one warpgroup) plus
the pipeliner's producer. Before each chunk's update it stores D into dh [S * HV, K, V] (slot-major
like pass 1's h: row (slot * HV + hv) * K + k) in q's dtype (the operand the products of pass 2b
use; the same rounding as pass 2's bf16 copy of D). After the sequence's first chunk it writes dh0.

Products and their operands are those of pass 2 (`chunk_bwd_v2.py`), per value slice: Pg, dv_new,
-D dv and scale D dO rounded to q's dtype, fp32 accumulation, the same accumulation order for dS
(gamma_C D, + Q^T scale D dO, + K^T (-D dv)). Rows past a sequence end: q, k and dO rows are zeroed in
shared memory (a sequence's last chunk only) so that nothing past the end reaches a product
(A_beta's rows and columns there are zero, g_cum_log2 repeats the last valid value).
Dynamic in T, B, the sequence mix; no host synchronisation.
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, num_slots, sequence_span, tl_dtype

__all__ = ["BV", "build_dh_kernel", "chunk_dh_bwd", "dh_kernel_args"]

#: Value columns per CTA.
BV = 64


def _dh_prim_func(H: int, HV: int, K: int, V: int, dtype: str, seq_dtype: str, varlen: bool):
    import tilelang.language as T

    C = CHUNK
    G = HV // H
    NV = V // BV
    row_policy = T.GemmWarpPolicy.FullRow
    acc = "float32"

    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")
    Np1 = T.dynamic("Np1")
    N1 = T.dynamic("N1")  # rows of dht (N, or 1 for the placeholder)
    N2 = T.dynamic("N2")  # rows of dh0
    SH = T.dynamic("SH")  # slots * HV

    @T.prim_func
    def gdn_dh_bwd(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        do: T.Tensor((B, Tn, HV, V), dtype),
        A: T.Tensor((HV, R, C), dtype),
        g_cum_log2: T.Tensor((HV, R), "float32"),
        dht: T.Tensor((N1, HV, K, V), "float32"),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        scale: T.float32,
        use_dht: T.int32,
        dh: T.Tensor((SH, K, V), dtype),
        dh0: T.Tensor((N2, HV, K, V), "float32"),
    ):
        with T.Kernel(NV * HV * ((Np1 - 1) if varlen else B), threads=128) as (bx,):
            iv = bx % NV
            hv = (bx // NV) % HV
            n = bx // (NV * HV)
            bos, seqlen, bidx, slot0, nchunks = sequence_span(n, cu_seqlens, Tn, varlen)
            hk = hv // G
            v0 = iv * BV

            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            do_s = T.alloc_shared((C, BV), dtype)
            a_s = T.alloc_shared((C, C), dtype)  # A diag(beta)
            gc_s = T.alloc_shared((C,), acc)
            pg_s = T.alloc_shared((C, C), dtype)  # scale (Q K^T) * Gamma
            sdo_s = T.alloc_shared((C, BV), dtype)  # scale diag(gamma) dO

            dst = T.alloc_fragment((BV, K), acc)  # dS^T
            dst_b = T.alloc_fragment((BV, K), dtype)
            p_f = T.alloc_fragment((C, C), acc)
            dvnt = T.alloc_fragment((BV, C), acc)  # dv_new^T
            dvnt_b = T.alloc_fragment((BV, C), dtype)
            dvt = T.alloc_fragment((BV, C), acc)  # dv^T
            wt_b = T.alloc_fragment((BV, C), dtype)  # (-diag(gamma) dv)^T

            if use_dht != 0:
                for i, j in T.Parallel(BV, K):
                    dst[i, j] = dht[n, hv, j, v0 + i]
            else:
                T.clear(dst)

            for ci in T.Pipelined(nchunks, num_stages=2):
                c = nchunks - 1 - ci
                t0 = bos + c * C
                row0 = (slot0 + c) * C
                nvalid = T.min(seqlen - c * C, C)
                T.copy(k[bidx, t0 : t0 + C, hk, 0:K], k_s)
                T.copy(q[bidx, t0 : t0 + C, hk, 0:K], q_s)
                T.copy(do[bidx, t0 : t0 + C, hv, v0 : v0 + BV], do_s)
                T.copy(A[hv, row0 : row0 + C, 0:C], a_s)
                T.copy(g_cum_log2[hv, row0 : row0 + C], gc_s)

                # rows past the sequence end: zero (a read of each tile, so it comes after its load)
                if nvalid < C:
                    for t, d in T.Parallel(C, K):
                        q_s[t, d] = T.if_then_else(t < nvalid, q_s[t, d], T.cast(0, dtype))
                        k_s[t, d] = T.if_then_else(t < nvalid, k_s[t, d], T.cast(0, dtype))
                    for t, d in T.Parallel(C, BV):
                        do_s[t, d] = T.if_then_else(t < nvalid, do_s[t, d], T.cast(0, dtype))
                # D of this chunk (the gradient of its end state), then its operand copy
                for i, j in T.Parallel(BV, K):
                    dh[(slot0 + c) * HV + hv, j, v0 + i] = T.cast(dst[i, j], dtype)
                T.copy(dst, dst_b)
                # dv_new^T = diag(r) (D^T K^T) + dO^T Pg
                T.gemm(dst_b, k_s, dvnt, transpose_B=True, clear_accum=True, policy=row_policy)
                T.gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True, policy=row_policy)
                for t, s in T.Parallel(C, C):
                    pg_s[t, s] = T.cast(
                        T.if_then_else(t >= s, scale * p_f[t, s] * T.exp2(T.if_then_else(t >= s, gc_s[t] - gc_s[s], T.float32(0))),
                                       T.float32(0)), dtype)
                for t, d in T.Parallel(C, BV):
                    sdo_s[t, d] = T.cast(scale * T.exp2(gc_s[t]) * T.cast(do_s[t, d], acc), dtype)
                for i, s in T.Parallel(BV, C):
                    dvnt[i, s] = dvnt[i, s] * T.exp2(T.min(gc_s[C - 1] - gc_s[s], T.float32(0)))
                T.gemm(do_s, pg_s, dvnt, transpose_A=True, policy=row_policy)
                # dv^T = dv_new^T A_beta;  (-diag(gamma) dv)^T
                T.copy(dvnt, dvnt_b)
                T.gemm(dvnt_b, a_s, dvt, clear_accum=True, policy=row_policy)
                for i, s in T.Parallel(BV, C):
                    wt_b[i, s] = T.cast(-T.exp2(gc_s[s]) * dvt[i, s], dtype)
                # dS^T = gamma_C dS^T + (scale D dO)^T Q + (-D dv)^T K
                for i, j in T.Parallel(BV, K):
                    dst[i, j] = dst[i, j] * T.exp2(gc_s[C - 1])
                T.gemm(sdo_s, q_s, dst, transpose_A=True, policy=row_policy)
                T.gemm(wt_b, k_s, dst, policy=row_policy)

            for i, j in T.Parallel(BV, K):
                dh0[n, hv, j, v0 + i] = dst[i, j]

    return gdn_dh_bwd


@functools.lru_cache(maxsize=None)
def build_dh_kernel(H: int, HV: int, K: int, V: int, dtype: str, seq_dtype: str, varlen: bool):
    """Compiled state-gradient chain kernel (cached). Static key: H, HV, K, V, q's dtype, cu_seqlens'
    dtype, packed or not."""
    func = _dh_prim_func(H, HV, K, V, dtype, seq_dtype, varlen)
    return compile_kernel(func, f"gdn_dh_bwd_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{seq_dtype}_{int(varlen)}")


def dh_kernel_args(q, v, cu_seqlens) -> tuple:
    """The static key (`build_dh_kernel` arguments) of a launch with these inputs."""
    seq_dtype = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
    return (q.shape[2], v.shape[2], q.shape[3], v.shape[3], tl_dtype(q.dtype), seq_dtype, cu_seqlens is not None)


def chunk_dh_bwd(q, k, do, A, g_cum_log2, dht, scale: float, cu_seqlens, V: int | None = None):
    """Launches pass 2a.

    Args: q, k [B, T, H, K]; do [B, T, HV, V]; A [HV, S * 64, 64] and g_cum_log2 [HV, S * 64] (the
    forward's A diag(beta) and base-2 chunk-local cumsum, slot-major); dht None or [N, HV, K, V] fp32;
    scale: float; cu_seqlens None or [N + 1].

    Returns (dh [S * HV, K, V] in q's dtype: the gradient of the end state of chunk slot s of value
    head hv at row s * HV + hv, rows of unused slots not written; dh0 [N, HV, K, V] fp32: the
    gradient of each sequence's initial state).
    """
    from flashqla.ops.gdn.kernels.sm90.prepare import dummy_cu_seqlens

    B, T, H, K = q.shape
    HV, V = do.shape[2], do.shape[3]
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    S = num_slots(B, T, N, varlen)
    dev = q.device
    dh = torch.empty(S * HV, K, V, dtype=q.dtype, device=dev)
    dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    if S == 0 or T == 0 or N == 0:
        if dht is not None:
            dh0.copy_(dht)
        else:
            dh0.zero_()
        return dh, dh0
    dht_arg = dht if dht is not None else torch.empty(1, HV, K, V, dtype=torch.float32, device=dev)
    cu = cu_seqlens if varlen else dummy_cu_seqlens(dev)
    kernel = build_dh_kernel(*dh_kernel_args(q, do, cu_seqlens))
    kernel(q, k, do, A, g_cum_log2, dht_arg, cu, float(scale), int(dht is not None), dh, dh0)
    return dh, dh0

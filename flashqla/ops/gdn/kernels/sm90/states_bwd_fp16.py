"""Backward pass 1 for what `states_bwd` does not cover: fp16 inputs, whose chunk-start states are
stored in bf16 (the fp16 backward's fallback, with `chunk_bwd_fp16`, until fp16 runs on the main
kernels).

Recomputes the chunk-start states h from the forward's A diag(beta) and g_cum_log2 and stores them,
as `states_bwd` does (the same products and operands). Reference stage:
`reference.gdn.fused_bwd.recompute_states` (records CF-2, RW-2, RW-4):
    W     = V - diag(gamma) K S,   v_new = A_beta W
    S'    = gamma_C S + K^T diag(r) v_new
One CTA per (value slice of BV = 64 columns, value head, sequence), the transposed state S^T [BV, K]
fp32 in registers, walking the sequence's chunks forward; one warpgroup stores S into h
[S * HV, K, V] (slot-major: row (slot * HV + hv) * K + k) from its fragment, in `h_dtype`, before
each chunk's update. Rows past a sequence end are inert as in the forward (A_beta rows and columns
are zero there). Dynamic in T, B, the sequence mix; no host synchronisation.
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, launch_states, sequence_span, tl_dtype

__all__ = ["build_states_fp16_kernel", "chunk_states_bwd_fp16"]

#: Value slice width: one CTA per (value slice, value head, sequence).
BV = 64


def _states_prim_func(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, seq_dtype: str, varlen: bool):
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
    N0 = T.dynamic("N0")
    SH = T.dynamic("SH")  # slots * HV
    NO = T.dynamic("NO")

    @T.prim_func  # (the kernel's symbol name is part of its generated source: kept as it was)
    def gdn_states_bwd(
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, HV, V), dtype),
        A: T.Tensor((HV, R, C), dtype),
        g_cum_log2: T.Tensor((HV, R), "float32"),
        h0: T.Tensor((N0, HV, K, V), "float32"),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        order: T.Tensor((NO,), "int32"),
        use_order: T.int32,
        use_h0: T.int32,
        h: T.Tensor((SH, K, V), h_dtype),
    ):
        with T.Kernel(NV * HV * ((Np1 - 1) if varlen else B), threads=128) as (bx,):
            iv = bx % NV
            hv = (bx // NV) % HV
            n = T.alloc_var("int32")
            n = bx // (NV * HV)
            if varlen:
                if use_order != 0:  # the sequences in the order given (`launch_order.launch_order`)
                    n = order[bx // (NV * HV)]
            bos, seqlen, bidx, slot0, nchunks = sequence_span(n, cu_seqlens, Tn, varlen)
            hk = hv // G
            v0 = iv * BV

            k_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, BV), dtype)
            a_s = T.alloc_shared((C, C), dtype)
            gc_s = T.alloc_shared((C,), acc)

            st = T.alloc_fragment((BV, K), acc)
            st_b = T.alloc_fragment((BV, K), dtype)
            ut = T.alloc_fragment((BV, C), acc)
            nvt = T.alloc_fragment((BV, C), acc)
            wt_b = T.alloc_fragment((BV, C), dtype)
            vpt_b = T.alloc_fragment((BV, C), dtype)

            if use_h0 != 0:
                for i, j in T.Parallel(BV, K):
                    st[i, j] = h0[n, hv, j, v0 + i]
            else:
                T.clear(st)

            for c in T.Pipelined(nchunks, num_stages=2):
                t0 = bos + c * C
                row0 = (slot0 + c) * C
                T.copy(k[bidx, t0 : t0 + C, hk, 0:K], k_s)
                T.copy(v[bidx, t0 : t0 + C, hv, v0 : v0 + BV], v_s)
                T.copy(A[hv, row0 : row0 + C, 0:C], a_s)
                T.copy(g_cum_log2[hv, row0 : row0 + C], gc_s)

                # h of this chunk = the state entering it
                for i, j in T.Parallel(BV, K):
                    h[(slot0 + c) * HV + hv, j, v0 + i] = T.cast(st[i, j], h_dtype)
                # U^T = S^T K^T;  W^T = V^T - U^T diag(gamma);  v_new^T = W^T A_beta^T
                T.copy(st, st_b)
                T.gemm(st_b, k_s, ut, transpose_B=True, clear_accum=True, policy=row_policy)
                for i, s in T.Parallel(BV, C):
                    wt_b[i, s] = T.cast(T.cast(v_s[s, i], acc) - ut[i, s] * T.exp2(gc_s[s]), dtype)
                T.gemm(wt_b, a_s, nvt, transpose_B=True, clear_accum=True, policy=row_policy)
                # S^T = gamma_C S^T + (v_new^T diag(r)) K
                for i, s in T.Parallel(BV, C):
                    vpt_b[i, s] = T.cast(nvt[i, s] * T.exp2(T.min(gc_s[C - 1] - gc_s[s], T.float32(0))), dtype)
                for i, j in T.Parallel(BV, K):
                    st[i, j] = st[i, j] * T.exp2(gc_s[C - 1])
                T.gemm(vpt_b, k_s, st, policy=row_policy)

    return gdn_states_bwd


@functools.lru_cache(maxsize=None)
def build_states_fp16_kernel(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, seq_dtype: str, varlen: bool):
    """Compiled state-recompute kernel (cached). Static key: H, HV, K, V, dtype of k/v/A, dtype of the
    stored h ("bfloat16", "float16" or "float32"; ValueError otherwise), cu_seqlens dtype, packed or not."""
    if h_dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"h_dtype must be bfloat16, float16 or float32, got {h_dtype!r}")
    func = _states_prim_func(H, HV, K, V, dtype, h_dtype, seq_dtype, varlen)
    return compile_kernel(func, f"gdn_states_bwd_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{h_dtype}_{seq_dtype}_{int(varlen)}")


def chunk_states_bwd_fp16(k, v, A, g_cum_log2, initial_state, cu_seqlens, h_dtype: torch.dtype = torch.bfloat16, order=None):
    """Launches pass 1 (arguments and result as `states_bwd.chunk_states_bwd`), h stored in h_dtype."""
    seq_dtype = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
    key = (k.shape[2], v.shape[2], k.shape[3], v.shape[3], tl_dtype(k.dtype), tl_dtype(h_dtype), seq_dtype,
           cu_seqlens is not None)
    return launch_states(lambda: build_states_fp16_kernel(*key), k, v, A, g_cum_log2, initial_state, cu_seqlens, h_dtype, order)

"""Backward pass 3 of 3: the reverse
chunk-local cumsum of the gate gradient and the GVA reduction of dq and dk.

Reference stages (`reference.gdn.fused_bwd`): `reverse_chunk_cumsum` (record BWD-dg: dg_t =
sum_{i >= t in the chunk} dG_i) and the sum of the per-value-head dq, dk over each group of
G = HV // H value heads (what `fused_gated_delta_rule_bwd` does with `gva`).

Two kernels, both dynamic in T, B and the sequence mix (no host synchronisation):
- `gdn_dg_reverse_cumsum`: grid (slots, HV), 64 threads; slot -> (sequence, chunk) as the prepare
  kernel (binary search over cu_seqlens for packed input); reads dG [HV, S * 64] fp32 (slot-major,
  written by pass 2), writes dg [B, T, HV] fp32 for the valid rows of the chunk only.
- `gdn_gva_reduce`: grid (ceil(T / 16), B, H), 128 threads; dq_hv, dk_hv [B, T, HV, K] fp32 -> dq, dk
  [B, T, H, K] in q's dtype (the sum over the group in fp32, left to right, one rounding; with one value
  head per q/k head, the rounding alone).
"""


import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, dummy_cu_seqlens, locate_slot, tl_dtype

__all__ = ["build_dg_cumsum_kernel", "build_gva_reduce_kernel", "chunk_finish_bwd"]

#: Tokens per CTA of the GVA reduction: 16 rows of K = 128 (16 values a thread, in 16-byte vectors), so
#: that few q/k heads still launch enough CTAs to stream at the memory's rate.
GVA_ROWS = 16


def _dg_cumsum_prim_func(HV: int, seq_dtype: str, varlen: bool):
    import tilelang.language as T

    C = CHUNK
    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")
    Np1 = T.dynamic("Np1")

    @T.prim_func
    def gdn_dg_reverse_cumsum(
        dG: T.Tensor((HV, R), "float32"),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        dg: T.Tensor((B, Tn, HV), "float32"),
    ):
        with T.Kernel(R // C, HV, threads=C) as (slot, hv):
            seq, chunk, bos, seqlen, bidx, nvalid, t0 = locate_slot(slot, cu_seqlens, Tn, Np1, varlen)
            d_s = T.alloc_shared((C,), "float32")
            if nvalid > 0:
                # reversed copy, inclusive cumsum, reversed store: dg_t = sum_{i >= t} dG_i
                for t in T.Parallel(C):
                    d_s[t] = dG[hv, slot * C + (C - 1 - t)]
                T.cumsum(d_s, dim=0)
                for t in T.Parallel(C):
                    if t < nvalid:
                        dg[bidx, t0 + t, hv] = d_s[C - 1 - t]

    return gdn_dg_reverse_cumsum


def _gva_reduce_prim_func(H: int, HV: int, K: int, dtype: str):
    import tilelang.language as T

    RT = GVA_ROWS
    G = HV // H
    B = T.dynamic("B")
    Tn = T.dynamic("T")

    def group_sum(x, b, t, h, d):  # x[b, t, h G, d] + ... + x[b, t, h G + G - 1, d], left to right, in fp32
        total = T.cast(x[b, t, h * G, d], "float32")
        for j in range(1, G):
            total = total + T.cast(x[b, t, h * G + j, d], "float32")
        return total

    @T.prim_func
    def gdn_gva_reduce(
        dq_hv: T.Tensor((B, Tn, HV, K), "float32"),
        dk_hv: T.Tensor((B, Tn, HV, K), "float32"),
        dq: T.Tensor((B, Tn, H, K), dtype),
        dk: T.Tensor((B, Tn, H, K), dtype),
    ):
        with T.Kernel(T.ceildiv(Tn, RT), B, H, threads=128) as (tb, b, h):
            # an element-wise body (the group's sum unrolled): vector loads and stores
            for t, d in T.Parallel(RT, K):
                if tb * RT + t < Tn:
                    dq[b, tb * RT + t, h, d] = T.cast(group_sum(dq_hv, b, tb * RT + t, h, d), dtype)
                    dk[b, tb * RT + t, h, d] = T.cast(group_sum(dk_hv, b, tb * RT + t, h, d), dtype)

    return gdn_gva_reduce


@functools.lru_cache(maxsize=None)
def build_dg_cumsum_kernel(HV: int, seq_dtype: str, varlen: bool):
    """Compiled reverse-cumsum kernel (cached). Static key: HV, cu_seqlens dtype, packed or not."""
    return compile_kernel(_dg_cumsum_prim_func(HV, seq_dtype, varlen), f"gdn_dg_reverse_cumsum_HV{HV}_{seq_dtype}_{int(varlen)}")


@functools.lru_cache(maxsize=None)
def build_gva_reduce_kernel(H: int, HV: int, K: int, dtype: str):
    """Compiled GVA reduction kernel (cached). Static key: H, HV, K, output dtype."""
    return compile_kernel(_gva_reduce_prim_func(H, HV, K, dtype), f"gdn_gva_reduce_H{H}_HV{HV}_K{K}_{dtype}")


def chunk_finish_bwd(dG: torch.Tensor, dq_hv: torch.Tensor, dk_hv: torch.Tensor, cu_seqlens, H: int, dtype: torch.dtype):
    """Launches pass 3.

    Args:
        dG: [HV, S * 64] fp32, dL/dg_cum per slot row (pass 2); dq_hv, dk_hv: [B, T, HV, K] fp32 per
        value head (pass 2); cu_seqlens: None or [N + 1] int32/int64 offsets; H: q/k heads; dtype:
        dtype of dq, dk (q's).

    Returns:
        (dq [B, T, H, K] dtype, dk [B, T, H, K] dtype, dg [B, T, HV] fp32 per token, natural log).
    """
    B, T, HV, K = dq_hv.shape
    varlen = cu_seqlens is not None
    dg = torch.zeros(B, T, HV, dtype=torch.float32, device=dG.device)
    dq = torch.empty(B, T, H, K, dtype=dtype, device=dG.device)
    dk = torch.empty(B, T, H, K, dtype=dtype, device=dG.device)
    if T == 0 or B == 0:
        return dq, dk, dg
    seq_dtype = tl_dtype(cu_seqlens.dtype) if varlen else "int32"
    cu = cu_seqlens if varlen else dummy_cu_seqlens(dG.device)
    if dG.shape[1] > 0:
        build_dg_cumsum_kernel(HV, seq_dtype, varlen)(dG, cu, dg)
    build_gva_reduce_kernel(H, HV, K, tl_dtype(dtype))(dq_hv, dk_hv, dq, dk)
    return dq, dk, dg

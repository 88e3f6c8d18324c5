"""Backward pass 1 of 3: recompute the
chunk-start states h from the forward's A diag(beta) and g_cum_log2, and store them.

Reference stage: `reference.gdn.fused_bwd.recompute_states` (records CF-2, RW-2, RW-4):
    W     = V - diag(gamma) K S,   v_new = A_beta W
    S'    = gamma_C S + K^T diag(r) v_new
Schedule "serial" (this module's kernel; the default is "roles", `states_roles.py`, where it applies:
K in (64, 128), V = 128, h in the inputs' dtype; else this one, or on request): one CTA per
(value slice of BV = 64 columns, value head, sequence), the transposed state S^T [BV, K] fp32 in
registers, walking the sequence's chunks forward (the forward recurrent kernel's "serial"
schedule without the output path). Before each chunk's update it stores S into
h [S * HV, K, V] (slot-major: row (slot * HV + hv) * K + k), in `h_dtype` (bf16 halves the bytes:
`tests/test_fused_bwd.py::test_low_precision_storage_cost` measures 1.2e-3 .. 1.8e-3 relative RMS on
dq, dk, dg, dbeta from that rounding alone, fp64 otherwise).
Rows past a sequence end are inert as in the forward (A_beta rows and columns are zero there).
Dynamic in T, B, the sequence mix; no host synchronisation.
"""

import functools
import os

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, num_slots, order_args, sequence_span, tl_dtype

__all__ = ["build_states_kernel", "chunk_states_bwd", "states_kernel_args"]

BV = 64

#: Schedules: "roles" (`states_roles`: the chain, the h stores and the loads on warpgroups of their
#: own; the default where `states_roles.states_roles_applies`, else "serial") and "serial" (this
#: module's kernel: one warpgroup stores h from the fragment between its products). Both give bitwise
#: the same h (H200, `tests/gpu/states_roles_check.py`). Read when a kernel is built; the environment
#: variable FLASHQLA_STATES_SCHEDULE sets it at import (NOTES-bwd.md, "Pass 1 with role-specialised
#: warpgroups").
SCHEDULES = ("roles", "serial")
DEFAULT_SCHEDULE = os.environ.get("FLASHQLA_STATES_SCHEDULE", "roles")


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

    @T.prim_func
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
                if use_order != 0:  # the sequences in the order given (`_common.launch_order`)
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


def resolve_schedule(schedule, K: int, V: int, dtype: str, h_dtype: str) -> str:
    """The schedule a build runs: `schedule` (None: DEFAULT_SCHEDULE), "roles" falling back to
    "serial" where the role-split kernel does not apply. ValueError naming an unknown schedule."""
    from flashqla.ops.gdn.kernels.sm90.states_roles import states_roles_applies

    schedule = DEFAULT_SCHEDULE if schedule is None else schedule
    if schedule not in SCHEDULES:
        raise ValueError(f"states schedule must be one of {SCHEDULES} (FLASHQLA_STATES_SCHEDULE), got {schedule!r}")
    if schedule == "roles" and not states_roles_applies(K, V, dtype, h_dtype):
        return "serial"
    return schedule


@functools.lru_cache(maxsize=None)
def build_states_kernel(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, seq_dtype: str, varlen: bool,
                        schedule: str | None = None):
    """Compiled state-recompute kernel (cached). Static key: H, HV, K, V, dtype of k/v/A, dtype of
    the stored h (bfloat16 or float32), cu_seqlens dtype, packed or not; schedule (None:
    DEFAULT_SCHEDULE; `resolve_schedule`). Both schedules take the same arguments and grid-size
    themselves from the shapes."""
    if h_dtype not in ("bfloat16", "float16", "float32"):
        raise ValueError(f"h_dtype must be bfloat16, float16 or float32, got {h_dtype!r}")
    if resolve_schedule(schedule, K, V, dtype, h_dtype) == "roles":
        from flashqla.ops.gdn.kernels.sm90.states_roles import states_roles_prim_func

        func = states_roles_prim_func(H, HV, K, V, dtype, seq_dtype, varlen)
        return compile_kernel(func, f"gdn_states_roles_bwd_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{seq_dtype}_{int(varlen)}")
    func = _states_prim_func(H, HV, K, V, dtype, h_dtype, seq_dtype, varlen)
    return compile_kernel(func, f"gdn_states_bwd_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{h_dtype}_{seq_dtype}_{int(varlen)}")


def states_kernel_args(k, v, cu_seqlens, h_dtype: torch.dtype) -> tuple:
    """The static key (`build_states_kernel` arguments) of a launch with these inputs."""
    seq_dtype = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
    return (k.shape[2], v.shape[2], k.shape[3], v.shape[3], tl_dtype(k.dtype), tl_dtype(h_dtype), seq_dtype,
            cu_seqlens is not None)


def chunk_states_bwd(k, v, A, g_cum_log2, initial_state, cu_seqlens, h_dtype: torch.dtype = torch.bfloat16,
                     schedule: str | None = None, order=None):
    """Launches pass 1 (schedule: None for DEFAULT_SCHEDULE, "roles" or "serial"; both give the same h;
    order: `_common.launch_order(cu_seqlens)` or None, the sequences' launch order; the same h).

    Args: k [B, T, H, K], v [B, T, HV, V] (the forward's, contiguous); A [HV, S * 64, 64] and
    g_cum_log2 [HV, S * 64] (the forward's `ChunkGDNForward.A`, `.g_cum_log2`); initial_state None or
    [N, HV, K, V] fp32; cu_seqlens None or [N + 1]; h_dtype: bf16 (default) or fp32.

    Returns h [S * HV, K, V] in h_dtype: the state entering chunk slot s of value head hv at row
    s * HV + hv (rows of unused slots are not written).
    """
    from flashqla.ops.gdn.kernels.sm90.prepare import dummy_cu_seqlens

    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    S = num_slots(B, T, N, varlen)
    h = torch.empty(S * HV, K, V, dtype=h_dtype, device=k.device)
    if S == 0 or T == 0 or N == 0:
        return h
    h0 = initial_state if initial_state is not None else torch.empty(1, HV, K, V, dtype=torch.float32, device=k.device)
    cu = cu_seqlens if varlen else dummy_cu_seqlens(k.device)
    args = states_kernel_args(k, v, cu_seqlens, h_dtype)
    kernel = build_states_kernel(*args) if schedule is None else build_states_kernel(*args, schedule)
    kernel(k, v, A, g_cum_log2, h0, cu, *order_args(order, k.device), int(initial_state is not None), h)
    return h

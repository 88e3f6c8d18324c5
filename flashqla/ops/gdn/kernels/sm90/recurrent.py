"""Fused recurrent kernel (launch 2 of 2 of the forward): one CTA per (value slice, value head,
sequence), walking the sequence's chunks with the fp32 state resident in registers.

Covers the reference stages (FLA's names, `reference.gdn.chunk`):
    recompute_w_u + chunk_fwd_h -> v_new, the chunk-start states h (never stored) and final_state
    chunk_fwd_o                 -> o
in the merged form of `reference.gdn.fused`:
    W      = V - diag(gamma) K S                     (gamma_t = exp(g_cum[t]))
    v_new  = A_beta W                                 (A_beta = A diag(beta), from the prepare kernel)
    o      = scale (diag(gamma) Q S + (Q K^T * Gamma) v_new)     (Gamma_ts = exp(g_cum[t] - g_cum[s]), t >= s)
    S'     = gamma_C S + K^T diag(exp(g_cum[C-1] - g_cum)) v_new
Derivation records relied on (`python -m derivations`): CF-1..CF-3 (chunk form: outputs, chunk-end
state, v_new = the recurrence's deltas), RW-2 (merged v_new), RW-4 (exp2 of base-2 differences).
Stage twins in `reference.gdn.fused`: `chunk_v_new`, `chunk_state_update`, `chunk_output`, and
`gate_vectors` (gamma, gamma_C, r in base 2, computed once per chunk and thread in "overlap").

Orientation. The kernel keeps the transposed state S^T [BV, K] (value rows) so that every product on
the serial chain takes its left operand from registers (wgmma with A in registers) and its right
operand from shared memory, and nothing on the chain round-trips through shared memory:
    U^T   = S^T K^T          (bf16 copy of S^T in registers; K from shared memory)
    O^T   = S^T Q^T
    W^T   = V^T - U^T diag(gamma)
    vn^T  = W^T A_beta^T     (A_beta tile from shared memory)
    O^T   = scale O^T diag(gamma) + vn^T Pg^T,   Pg = scale (Q K^T * Gamma), built per chunk in shared memory
    S^T   = gamma_C S^T + (vn^T diag(r)) K,      r_s = exp2(g_cum_log2[C-1] - g_cum_log2[s]) <= 1
Every exponent is a difference <= 0 (masked to the causal half before exp2 for Gamma).

Threads: one producer warpgroup (TMA loads of q, k, v, A_beta, g_cum_log2, two stages, mbarriers;
made by TileLang's pipeliner from `T.Pipelined`) plus one (BV = 64; 256 threads, 113 KB shared
memory, 202 registers) or two (BV = 128; 384 threads, 137 KB, setmaxnreg 24 / 240, 168 registers at
entry, no spills) consumer warpgroups, each owning 64 value rows of S^T. One CTA per SM.
Schedules of the same products (`SCHEDULES`; bitwise-identical results on the H200): "roles" (BV = 64,
`recurrent_roles.py`: the state chain and the output path on two warpgroups; the default there),
"overlap" (the default at BV = 128 and in the dual launch) issues independent wgmma back to back and hides
the output path (Q K^T, Gamma, Pg, the o store) under the state chain; "serial" (the first version,
kept for comparison) waits for each wgmma before the next step. Timings in NOTES.md.
Tail chunks load whole 64-row tiles: rows past the end of the sequence are inert because the prepare
kernel wrote zero rows of A_beta there, and only valid rows of o are stored.
"""

import functools
import os

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, SM_COUNT, compile_kernel, num_slots, placeholder, sequence_span, tl_dtype

__all__ = ["DEFAULT_SCHEDULE", "SCHEDULES", "build_recurrent_kernel", "chunk_recurrent_dual", "chunk_recurrent_fwd", "pick_block_v",
           "resolve_schedule",
           "recurrent_kernel_args"]


def _recurrent_prim_func(H: int, HV: int, K: int, V: int, BV: int, dtype: str, seq_dtype: str, varlen: bool,
                         schedule: str, dual: bool = False, _measure: str = ""):
    """The recurrent kernel in one of its two schedules (`SCHEDULES`): the same products and stages,
    one signature, prologue, chunk loads and final-state store, two chunk-loop bodies.

    dual (schedule "overlap", K == V only): the launch of the split path's run and transition in one
    grid of 2 x NV x HV x N CTAs (`chunk_recurrent_dual`). The first half are transition CTAs: v taken
    as 0, the state started from I (or from 0 where `limit` is 0), `min(nchunks, limit[n, hv])`
    chunks walked, the output rows written to `u` (rows of chunks not walked are not written) and
    the end state to `pt`, or 0 there when fewer chunks than the segment has were walked (the
    truncated transition, records CP-4 / CP-5). The second half are the run CTAs, the plain kernel's
    code and arithmetic. Transition CTAs come first so that long ones (heads whose gates do not
    decay) start in the first wave.

    "serial" (the first version) waits for each wgmma before the next step. "overlap" runs
    independent wgmma back to back and hides the output path under the state chain:

        1. issue U^T = S^T K^T, P = Q K^T, O^T = S^T Q^T; wait for U^T; W^T; wait for the other two
        2. issue v_new^T = W^T A_beta^T; meanwhile Pg -> shared memory, O^T *= scale gamma,
           S^T *= gamma_C; wait
        3. issue O^T += v_new^T Pg^T, then S^T += (v_new^T diag(r)) K; wait for O^T only, store o
           while the state update runs; wait
    In "overlap", v and o go through 128-byte-swizzled shared tiles (no bank conflicts on the
    transposed accesses), and each issue-and-wait group is one statement of the pipelined loop body,
    so the pipeliner releases a stage buffer only after the last wgmma that reads it has completed.
    """
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout

    overlap = schedule == "overlap"
    # measuring builds (wrong results, never dispatched): "chain" leaves the output path out (Q K^T,
    # S^T Q^T, Pg, O^T += v_new^T Pg^T and the o store), so its time is the state chain's alone
    if _measure not in ("", "chain") or (_measure and (not overlap or dual)):
        raise ValueError(f"unknown measuring build {_measure!r} (schedule 'overlap', not dual)")
    out_path = _measure != "chain"
    C = CHUNK
    G = HV // H
    NV = V // BV
    consumer_threads = 256 if BV == 128 else 128
    row_policy = T.GemmWarpPolicy.FullRow
    acc = "float32"
    # per-thread 32-bit registers of the fragments (each consumer warpgroup owns 64 rows of S^T)
    r_acc = 64 * C // 128  # [64, 64] fp32 accumulator slice per warpgroup
    r_st = 64 * K // 128

    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")
    Np1 = T.dynamic("Np1")
    N0 = T.dynamic("N0")  # rows of initial_state (N, or 1 for the placeholder)
    N1 = T.dynamic("N1")  # rows of final_state (N, or 1 for the placeholder)
    if dual and (not overlap or K != V):
        raise ValueError("the dual launch needs schedule 'overlap' and K == V (its role-split form: recurrent_roles.py)")
    NP = T.dynamic("NP")  # rows of pt and limit (dual: N)
    u_shape = (B, Tn, HV, K) if dual else (1,)
    pt_shape = (NP, HV, K, K) if dual else (1,)
    lim_shape = (NP, HV) if dual else (1,)
    nseq = (Np1 - 1) if varlen else B
    ncta = NV * HV * nseq

    @T.prim_func
    def gdn_recurrent_fwd(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, HV, V), dtype),
        A: T.Tensor((HV, R, C), dtype),
        g_cum_log2: T.Tensor((HV, R), "float32"),
        h0: T.Tensor((N0, HV, K, V), "float32"),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        scale: T.float32,
        use_h0: T.int32,
        store_ht: T.int32,
        o: T.Tensor((B, Tn, HV, V), dtype),
        ht: T.Tensor((N1, HV, K, V), "float32"),
        u: T.Tensor(u_shape, dtype),
        pt: T.Tensor(pt_shape, "float32"),
        limit: T.Tensor(lim_shape, "int32"),
    ):
        with T.Kernel(ncta * (2 if dual else 1), threads=consumer_threads) as (bx,):
            if dual:
                tr = bx < ncta  # transition CTA (first half)
                b1 = T.if_then_else(tr, bx, bx - ncta)
            else:
                b1 = bx
            iv = b1 % NV
            hv = (b1 // NV) % HV
            n = b1 // (NV * HV)
            bos, seqlen, bidx, slot0, nchunks = sequence_span(n, cu_seqlens, Tn, varlen)
            if dual:
                nloop = T.alloc_var("int32")
                lim = T.alloc_var("int32")
                nloop = nchunks
                lim = 0
                if tr:
                    lim = limit[n, hv]
                    nloop = T.min(nchunks, lim)
            hk = hv // G
            v0 = iv * BV
            if consumer_threads == 256:
                T.annotate_producer_reg_dealloc(24)
                T.annotate_consumer_reg_alloc(240)

            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, BV), dtype)
            a_s = T.alloc_shared((C, C), dtype)
            gc_s = T.alloc_shared((C,), acc)
            p_s = T.alloc_shared((C, C), dtype)
            o_s = T.alloc_shared((C, BV), dtype)
            if overlap:
                T.annotate_layout({v_s: make_swizzled_layout(v_s), o_s: make_swizzled_layout(o_s)})

            st = T.alloc_fragment((BV, K), acc)
            st_b = T.alloc_fragment((BV, K), dtype)
            ut = T.alloc_fragment((BV, C), acc)
            ot = T.alloc_fragment((BV, C), acc)
            nvt = T.alloc_fragment((BV, C), acc)
            wt_b = T.alloc_fragment((BV, C), dtype)
            nvt_b = T.alloc_fragment((BV, C), dtype)
            vpt_b = T.alloc_fragment((BV, C), dtype)
            p_f = T.alloc_fragment((C, C), acc)
            if overlap:
                gam_f = T.alloc_fragment((C,), acc)  # gamma_s = exp2(g_cum_log2[s]) at this thread's columns
                r_f = T.alloc_fragment((C,), acc)  # r_s = exp2(g_cum_log2[C-1] - g_cum_log2[s]) <= 1

            if dual:
                if tr:
                    for i, j in T.Parallel(BV, K):
                        st[i, j] = T.if_then_else(v0 + i == j, T.if_then_else(lim > 0, T.float32(1), T.float32(0)), T.float32(0))
                elif use_h0 != 0:
                    for i, j in T.Parallel(BV, K):
                        st[i, j] = h0[n, hv, j, v0 + i]
                else:
                    T.clear(st)
            elif use_h0 != 0:
                for i, j in T.Parallel(BV, K):
                    st[i, j] = h0[n, hv, j, v0 + i]
            else:
                T.clear(st)

            for c in T.Pipelined(nloop if dual else nchunks, num_stages=2):
                t0 = bos + c * C
                row0 = (slot0 + c) * C
                T.copy(q[bidx, t0 : t0 + C, hk, 0:K], q_s)
                T.copy(k[bidx, t0 : t0 + C, hk, 0:K], k_s)
                T.copy(v[bidx, t0 : t0 + C, hv, v0 : v0 + BV], v_s)
                T.copy(A[hv, row0 : row0 + C, 0:C], a_s)
                T.copy(g_cum_log2[hv, row0 : row0 + C], gc_s)

                if overlap:  # schedule "overlap" (see the docstring)
                    T.copy(st, st_b)
                    for _ in T.serial(1):  # one statement of the loop body (see docstring)
                        # U^T = S^T K^T (on the chain), P = Q K^T, O^T = S^T Q^T
                        T.wgmma_gemm(st_b, k_s, ut, transpose_B=True, clear_accum=True, policy=row_policy)
                        if out_path:
                            T.wgmma_gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
                            T.wgmma_gemm(st_b, q_s, ot, transpose_B=True, clear_accum=True, policy=row_policy)
                        for s in T.Parallel(C):
                            gam_f[s] = T.exp2(gc_s[s])
                            r_f[s] = T.exp2(T.min(gc_s[C - 1] - gc_s[s], T.float32(0)))
                        T.wait_wgmma(2 if out_path else 0)
                        T.warpgroup_fence_operand(ut, num_regs=r_acc)
                        # W^T = V^T - U^T diag(gamma) (transition CTAs: v = 0)
                        if dual:
                            for i, s in T.Parallel(BV, C):
                                wt_b[i, s] = T.cast(
                                    T.if_then_else(tr, T.float32(0), T.cast(v_s[s, i], acc)) - ut[i, s] * gam_f[s], dtype)
                        else:
                            for i, s in T.Parallel(BV, C):
                                wt_b[i, s] = T.cast(T.cast(v_s[s, i], acc) - ut[i, s] * gam_f[s], dtype)
                        if out_path:
                            T.wait_wgmma(0)
                            T.warpgroup_fence_operand(p_f, num_regs=C * C // consumer_threads)
                            T.warpgroup_fence_operand(ot, num_regs=r_acc)

                    for _ in T.serial(1):
                        # v_new^T = W^T A_beta^T (on the chain); the S-independent work runs meanwhile
                        T.wgmma_gemm(wt_b, a_s, nvt, transpose_B=True, clear_accum=True, policy=row_policy)
                        if out_path:
                            # Pg = scale * (Q K^T * Gamma), causal (t >= s)
                            for t, s in T.Parallel(C, C):
                                p_s[t, s] = T.cast(
                                    T.if_then_else(
                                        t >= s,
                                        scale * p_f[t, s] * T.exp2(T.if_then_else(t >= s, gc_s[t] - gc_s[s], T.float32(0))),
                                        T.float32(0),
                                    ),
                                    dtype,
                                )
                            T.fence_proxy_async()
                            for i, t in T.Parallel(BV, C):
                                ot[i, t] = ot[i, t] * (scale * gam_f[t])
                        for i, j in T.Parallel(BV, K):
                            st[i, j] = st[i, j] * T.exp2(gc_s[C - 1])
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(nvt, num_regs=r_acc)

                    for i, s in T.Parallel(BV, C):
                        nvt_b[i, s] = T.cast(nvt[i, s], dtype)
                        vpt_b[i, s] = T.cast(nvt[i, s] * r_f[s], dtype)

                    if not out_path:  # measuring build: the state update alone
                        for _ in T.serial(1):
                            T.wgmma_gemm(vpt_b, k_s, st, policy=row_policy)
                            T.wait_wgmma(0)
                            T.warpgroup_fence_operand(st, num_regs=r_st)
                    else:
                        for _ in T.serial(1):
                            # O^T += v_new^T Pg^T, then S^T = gamma_C S^T + (v_new^T diag(r)) K
                            T.wgmma_gemm(nvt_b, p_s, ot, transpose_B=True, policy=row_policy)
                            T.wgmma_gemm(vpt_b, k_s, st, policy=row_policy)
                            T.wait_wgmma(1)
                            T.warpgroup_fence_operand(ot, num_regs=r_acc)
                            # o rows of this chunk (only rows inside the sequence) while S^T updates
                            for t, i in T.Parallel(C, BV):
                                o_s[t, i] = T.cast(ot[i, t], dtype)
                            nvalid = T.min(seqlen - c * C, C)
                            if dual:
                                if tr:
                                    for t, i in T.Parallel(C, BV):
                                        if t < nvalid:
                                            u[bidx, t0 + t, hv, v0 + i] = o_s[t, i]
                                else:
                                    for t, i in T.Parallel(C, BV):
                                        if t < nvalid:
                                            o[bidx, t0 + t, hv, v0 + i] = o_s[t, i]
                            else:
                                for t, i in T.Parallel(C, BV):
                                    if t < nvalid:
                                        o[bidx, t0 + t, hv, v0 + i] = o_s[t, i]
                            T.wait_wgmma(0)
                            T.warpgroup_fence_operand(st, num_regs=r_st)
                else:  # schedule "serial"
                    # Pg = scale * (Q K^T * Gamma), causal (t >= s); S-independent
                    T.gemm(q_s, k_s, p_f, transpose_B=True, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        p_s[t, s] = T.cast(
                            T.if_then_else(
                                t >= s,
                                scale * p_f[t, s] * T.exp2(T.if_then_else(t >= s, gc_s[t] - gc_s[s], T.float32(0))),
                                T.float32(0),
                            ),
                            dtype,
                        )
                    T.fence_proxy_async()

                    # U^T = S^T K^T and O^T = S^T Q^T from the bf16 copy of the state
                    T.copy(st, st_b)
                    T.gemm(st_b, k_s, ut, transpose_B=True, clear_accum=True, policy=row_policy)
                    T.gemm(st_b, q_s, ot, transpose_B=True, clear_accum=True, policy=row_policy)
                    # W^T = V^T - U^T diag(gamma)
                    for i, s in T.Parallel(BV, C):
                        wt_b[i, s] = T.cast(T.cast(v_s[s, i], acc) - ut[i, s] * T.exp2(gc_s[s]), dtype)
                    # v_new^T = W^T A_beta^T
                    T.gemm(wt_b, a_s, nvt, transpose_B=True, clear_accum=True, policy=row_policy)
                    T.copy(nvt, nvt_b)
                    # O^T = scale O^T diag(gamma) + v_new^T Pg^T
                    for i, t in T.Parallel(BV, C):
                        ot[i, t] = ot[i, t] * (scale * T.exp2(gc_s[t]))
                    T.gemm(nvt_b, p_s, ot, transpose_B=True, policy=row_policy)
                    # S^T = gamma_C S^T + (v_new^T diag(r)) K
                    for i, s in T.Parallel(BV, C):
                        vpt_b[i, s] = T.cast(nvt[i, s] * T.exp2(T.min(gc_s[C - 1] - gc_s[s], T.float32(0))), dtype)
                    for i, j in T.Parallel(BV, K):
                        st[i, j] = st[i, j] * T.exp2(gc_s[C - 1])
                    T.gemm(vpt_b, k_s, st, policy=row_policy)

                    # o rows of this chunk (only rows inside the sequence)
                    for t, i in T.Parallel(C, BV):
                        o_s[t, i] = T.cast(ot[i, t], dtype)
                    nvalid = T.min(seqlen - c * C, C)
                    for t, i in T.Parallel(C, BV):
                        if t < nvalid:
                            o[bidx, t0 + t, hv, v0 + i] = o_s[t, i]

            if dual:
                if tr:  # the transition P, or 0 where it was cut short
                    for i, j in T.Parallel(BV, K):
                        pt[n, hv, j, v0 + i] = T.if_then_else(nloop == nchunks, st[i, j], T.float32(0))
                elif store_ht != 0:
                    for i, j in T.Parallel(BV, K):
                        ht[n, hv, j, v0 + i] = st[i, j]
            elif store_ht != 0:
                for i, j in T.Parallel(BV, K):
                    ht[n, hv, j, v0 + i] = st[i, j]

    return gdn_recurrent_fwd


#: Recurrent kernel schedules: "serial" (each wgmma waited before the next step) and "overlap"
#: (both built by `_recurrent_prim_func`), and "roles" (the state chain and the output path on
#: warpgroups of their own that run concurrently, `recurrent_roles.py`; BV = 64 and 128).
SCHEDULES = ("serial", "overlap", "roles")
#: The schedule `chunk_recurrent_fwd` uses when none is given (read at every call; the environment
#: variable FLASHQLA_RECURRENT_SCHEDULE sets it at import). "auto" is "roles" (`resolve_schedule`).
#: Measured on the H200 (tests/gpu/recurrent_floor.py, recurrent launch alone, us per chunk step;
#: o and final state bitwise equal between the schedules): BV = 64 "overlap" 2.7-3.4, "roles"
#: 1.6-1.8; BV = 128 "overlap" 3.3-3.7, "roles" 2.7-2.9.
DEFAULT_SCHEDULE = os.environ.get("FLASHQLA_RECURRENT_SCHEDULE", "auto")


#: The schedule of the split path's dual (run + transition) launch: "roles" (the default; the
#: role-split form of `recurrent_roles.py`, checked on the H200 against the plain launches by
#: tests/gpu/test_cp_kernels_gpu.py) or "overlap". Environment variable FLASHQLA_DUAL_SCHEDULE, read at
#: import.
DUAL_SCHEDULE = os.environ.get("FLASHQLA_DUAL_SCHEDULE", "roles")
if DUAL_SCHEDULE not in ("overlap", "roles"):
    raise ValueError(f"FLASHQLA_DUAL_SCHEDULE must be 'overlap' or 'roles', got {DUAL_SCHEDULE!r}")


def resolve_schedule(schedule: str | None, BV: int, dual: bool = False) -> str:
    """The concrete schedule (one of `SCHEDULES`) a launch at value slice width BV uses for a
    requested one (None: `DEFAULT_SCHEDULE`; "auto"; or a concrete one). "auto" is "roles"; the dual
    launch takes DUAL_SCHEDULE whatever is requested."""
    schedule = schedule or DEFAULT_SCHEDULE
    if schedule == "auto":
        schedule = "roles"
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be 'auto' or one of {SCHEDULES}, got {schedule!r}")
    if dual:  # DUAL_SCHEDULE is checked where it is read
        return DUAL_SCHEDULE
    return schedule


@functools.lru_cache(maxsize=None)
def build_recurrent_kernel(H: int, HV: int, K: int, V: int, BV: int, dtype: str, seq_dtype: str, varlen: bool, schedule: str = "overlap",
                           dual: bool = False, _measure: str = ""):
    """Compiled recurrent kernel for one static configuration (cached).

    Static key: head counts, head dims, the value slice width BV (64 or 128), the input dtype,
    cu_seqlens' dtype, whether input is packed (varlen), the schedule (`SCHEDULES`) and whether it is
    the split path's dual launch (run and transition in one grid, `chunk_recurrent_dual`). T, B, the
    number of sequences, the scale, the initial/final-state switches and the transition limits are
    run-time values.
    """
    if V % BV or BV not in (64, 128):
        raise ValueError(f"value slice width BV must be 64 or 128 and divide V = {V}, got {BV}")
    if schedule == "auto":
        schedule = resolve_schedule(schedule, BV, dual)
    if schedule not in SCHEDULES:
        raise ValueError(f"schedule must be 'auto' or one of {SCHEDULES}, got {schedule!r}")
    if schedule == "roles":
        from flashqla.ops.gdn.kernels.sm90.recurrent_roles import ROLES_WIDTHS, recurrent_roles_prim_func

        if BV not in ROLES_WIDTHS or _measure:
            raise ValueError(f"schedule 'roles' is built for BV in {ROLES_WIDTHS} only, without measuring builds")
        if dual and K != V:
            raise ValueError(f"the dual launch needs K == V, got K={K}, V={V}")
        name = (f"gdn_recurrent_roles_fwd_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{seq_dtype}_{int(varlen)}" + ("" if BV == 64 else f"_BV{BV}")
                + ("_dual" if dual else ""))
        return compile_kernel(recurrent_roles_prim_func(H, HV, K, V, dtype, seq_dtype, varlen, dual, BV), name)
    func = _recurrent_prim_func(H, HV, K, V, BV, dtype, seq_dtype, varlen, schedule, dual, _measure)
    name = (f"gdn_recurrent_fwd_H{H}_HV{HV}_K{K}_V{V}_BV{BV}_{dtype}_{seq_dtype}_{int(varlen)}_{schedule}" + ("_dual" if dual else "")
            + (f"_measure_{_measure}" if _measure else ""))
    return compile_kernel(func, name)


#: Chunk step of the role-split kernel per CTA (one CTA an SM), us, by value slice width: measured on
#: the H200 (2026-11-30, tests/gpu/recurrent_floor.py, recurrent launch alone, the staged o store):
#: BV = 64 1.62-1.74, BV = 128 2.70-2.91 on rows of 32 to 512 CTAs. Only their ratio is used
#: (`pick_block_v`).
ROLES_STEP_US = {64: 1.67, 128: 2.78}


def pick_block_v(N: int, HV: int, V: int = 128, sm_count: int = SM_COUNT) -> int:
    """Value slice width of an unsplit launch: the one whose waves cost less, taking the N * HV
    (sequence, value head) walks as equally long (the host does not read the lengths) and one CTA an SM:
    ceil(2 N HV / sms) steps of ROLES_STEP_US[64] against ceil(N HV / sms) of ROLES_STEP_US[128]. On
    132 SMs: BV = 64 up to 66 walks and from 133 to 198, else 128 (64 when V < 128)."""
    if V < 128:
        return V
    nh = N * HV
    waves64, waves128 = -(-2 * nh // sm_count), -(-nh // sm_count)
    return 64 if waves64 * ROLES_STEP_US[64] < waves128 * ROLES_STEP_US[128] else 128


def _check_out(o, v):
    """A caller's preallocated o: v's shape, dtype and device, contiguous, 16-byte aligned (the
    role-split kernel stores o with 16-byte vectors)."""
    if o.shape != v.shape or o.dtype != v.dtype or o.device != v.device or not o.is_contiguous():
        raise ValueError(f"o must be a contiguous {v.dtype} tensor of shape {tuple(v.shape)} on {v.device}, "
                         f"got {o.dtype} {tuple(o.shape)} on {o.device} (contiguous: {o.is_contiguous()})")
    if o.data_ptr() % 16:
        raise ValueError("o must start on a 16-byte boundary (the kernel stores it with 16-byte vectors)")
    return o


def recurrent_kernel_args(q, v, cu_seqlens, block_v=None, schedule=None, dual: bool = False) -> tuple:
    """The static key (`build_recurrent_kernel` arguments) a launch with these inputs uses (the dual
    launch's key ends with True; the plain key has nine entries)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.numel() - 1 if cu_seqlens is not None else B
    BV = block_v or pick_block_v(N, HV, V)
    seq_dtype = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
    key = (H, HV, K, V, BV, tl_dtype(q.dtype), seq_dtype, cu_seqlens is not None, resolve_schedule(schedule, BV, dual))
    return key + (True,) if dual else key


def chunk_recurrent_fwd(q, k, v, A, g_cum_log2, scale: float, initial_state, output_final_state: bool, cu_seqlens, block_v=None, o=None, final_state=None, schedule=None):
    """Launches the recurrent kernel (arguments validated by the caller).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (bf16 or fp16, contiguous).
        A, g_cum_log2: outputs of `chunk_prepare_fwd` for the same inputs.
        scale: output scale (float).
        initial_state: [N, HV, K, V] fp32 contiguous, or None (zeros).
        output_final_state: whether to return the state after each sequence.
        cu_seqlens: [N + 1] int32/int64 or None.
        block_v: value slice width (None: `pick_block_v`).
        schedule: kernel schedule, one of `SCHEDULES` (None: `DEFAULT_SCHEDULE`).
        o, final_state: optional preallocated outputs of the shapes below (tests poison them).

    Returns:
        o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] fp32 or None.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    if o is None:
        o = torch.empty_like(v)
    else:
        _check_out(o, v)
    ht = None
    if output_final_state:
        ht = final_state if final_state is not None else torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
    if N == 0:
        return o, ht
    if T == 0:  # no tokens: nothing to launch (TMA descriptors need non-empty tensors)
        if ht is not None:
            if initial_state is None:
                ht.zero_()
            else:
                ht.copy_(initial_state)
        return o, ht
    use_h0 = initial_state is not None
    h0 = initial_state if use_h0 else placeholder((1, HV, K, V), torch.float32, q.device)
    ht_arg = ht if output_final_state else placeholder((1, HV, K, V), torch.float32, q.device)
    cu = cu_seqlens if varlen else placeholder((1,), torch.int32, q.device)
    kernel = build_recurrent_kernel(*recurrent_kernel_args(q, v, cu_seqlens, block_v, schedule))
    u, pt, lim = (placeholder((1,), dt, q.device) for dt in (q.dtype, torch.float32, torch.int32))
    kernel(q, k, v, A, g_cum_log2, h0, cu, float(scale), int(use_h0), int(output_final_state), o, ht_arg, u, pt, lim)
    return o, ht


def chunk_recurrent_dual(q, k, v, A, g_cum_log2, scale: float, initial_state, limit, cu_seqlens, block_v=None, o=None):
    """The split path's run and transition launches as one launch (K == V; arguments validated by
    the caller; `flashqla.cp.driver`).

    Run CTAs: the plain kernel from `initial_state` (zeros when None) -> o and the end states Q.
    Transition CTAs, per (sequence, value head): v = 0, started from I where limit > 0 (else from 0),
    min(chunks, limit) chunks walked -> U (rows of the chunks walked; other rows are left unwritten)
    and P (the end state, or 0 where the walk was cut short: the gate-driven truncation, records
    CP-4 / CP-5, `flashqla.cp.driver.transition_limits`).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (V == K), bf16 or fp16, contiguous.
        A, g_cum_log2: `chunk_prepare_fwd` outputs for cu_seqlens.
        scale: output scale. initial_state: [N, HV, K, V] fp32 contiguous or None.
        limit: [N, HV] int32 contiguous, chunks of each transition (0: none, the slot is not corrected).
        cu_seqlens: [N + 1] int32/int64 or None. block_v: value slice width (None: `pick_block_v`).
        o: optional preallocated output [B, T, HV, V].

    Returns:
        (o [B, T, HV, V], Q [N, HV, K, V] fp32, U [B, T, HV, K] in q's dtype, P [N, HV, K, K] fp32).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if V != K:
        raise ValueError(f"the dual launch needs K == V, got K={K}, V={V}")
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    if tuple(limit.shape) != (N, HV) or limit.dtype != torch.int32:
        raise ValueError(f"limit must be int32 of shape {(N, HV)}, got {limit.dtype} {tuple(limit.shape)}")
    o = torch.empty_like(v) if o is None else _check_out(o, v)
    U = torch.empty(B, T, HV, K, dtype=q.dtype, device=q.device)
    Q = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
    P = torch.empty(N, HV, K, K, dtype=torch.float32, device=q.device)
    if N == 0:
        return o, Q, U, P
    if T == 0:
        if initial_state is not None:
            Q.copy_(initial_state)
        else:
            Q.zero_()
        P.zero_()
        return o, Q, U, P
    use_h0 = initial_state is not None
    h0 = initial_state if use_h0 else placeholder((1, HV, K, V), torch.float32, q.device)
    cu = cu_seqlens if varlen else placeholder((1,), torch.int32, q.device)
    kernel = build_recurrent_kernel(*recurrent_kernel_args(q, v, cu_seqlens, block_v, dual=True))
    kernel(q, k, v, A, g_cum_log2, h0, cu, float(scale), int(use_h0), 1, o, Q, U, P, limit.contiguous())
    return o, Q, U, P

"""Backward pass 1 of 3: the chunk-start states h, recomputed from the forward's A diag(beta) and
g_cum_log2 and stored, on role-specialised warpgroups.

Reference stage: `reference.gdn.fused_bwd.recompute_states` (records CF-2, RW-2, RW-4):
    W     = V - diag(gamma) K S,   v_new = A_beta W
    S'    = gamma_C S + K^T diag(r) v_new

    chain  (threads [0, 256))   two warpgroups own S^T [128, K] fp32 in registers (64 value rows each;
                                each product is one wgmma split by rows over the two); per chunk
                                S^T -> copy in the inputs' dtype (registers), and S = h of chunk c, transposed,
                                into a 128-byte-swizzled shared tile for the store role
                                U^T   = S^T K^T                        (wgmma, A from registers)
                                W^T   = V^T - U^T diag(gamma)
                                vn^T  = W^T A_beta^T                   (wgmma, A from registers)
                                S^T   = gamma_C S^T + (vn^T diag(r)) K (wgmma, A from registers)
    store  (next 128 threads)   one warp TMA-stores that tile to h's [K, V] rows (a whole warp issues
                                the store; the other three warps only count in the stage's release)
    producer (last 128)         one warp issues the TMA loads of k, v, A_beta and g_cum_log2 into a
                                two-stage ring.

This is the forward's recurrent kernel (`recurrent.py`, BV = 128) without its output role. One CTA
per (value head, sequence) at V = 128.

Synchronisation (mbarriers, two of each, indexed by the stage c % 2, parity (c // 2) % 2): full
(producer -> chain: the stage's tiles landed), empty (chain -> producer), s_full / s_empty (chain ->
store / back: h of chunk c in sb_s[c % 2], released after the TMA store has read it). A waiter on an
"empty" barrier uses the opposite parity, so its first two waits pass at once.

h [S * HV, K, V] (slot-major: row (slot * HV + hv) * K + k) is stored in the inputs' dtype (bf16 or
fp16): the copy of S^T the chain feeds its own product with, which is also the operand the forward's
recurrent kernel rounds from the same fp32 state, and the one pass 2 (`chunk_bwd`) reads. Why fp16
h is safe for fp16 inputs: fp16's range (65,504) is no new limit, since the forward and this chain
already round every chunk-start state to fp16 for their wgmma (a state outside that range would make
the forward's o infinite first), and inside it fp16 keeps 10 mantissa bits against bf16's 7. (The
states themselves are not bounded independently of T: with L2-normalised k and 0 <= beta <= 1 each
step's factor exp(g) (I - beta k k^T) has spectral norm <= 1, so ||S_t|| <= ||S_0|| + sum_s beta_s
||k_s|| ||v_s||, a bound that grows with T; the delta rule's correction keeps S^T k near v in
practice.) Rows past a sequence's end are inert as in the forward (A_beta's rows and columns are
zero there). Dynamic in T, B and the sequence mix; no host synchronisation. Covers K in (64, 128),
V = 128, bf16 and fp16 inputs (the op's path: K = 128).
"""

import functools

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, launch_states, sequence_span, tl_dtype

__all__ = ["build_states_kernel", "chunk_states_bwd", "states_kernel_args"]

#: Value slice width: one CTA per (value head, sequence) at V = 128.
STATES_BV = 128
#: Registers per thread after setmaxnreg (the CTA launches with 128 a thread at 512 threads): each of the
#: two chain warpgroups, the store role, the producer. Sum 2 x 168 + 152 + 24 = 512 = 4 x 128.
NREG = {"chain": 168, "store": 152, "producer": 24}


def _states_prim_func(H: int, HV: int, K: int, V: int, dtype: str, seq_dtype: str, varlen: bool):
    """The TileLang kernel (arguments as `build_states_kernel`)."""
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout

    if K not in (64, 128) or V != STATES_BV or dtype not in ("bfloat16", "float16"):
        raise ValueError(f"the states kernel needs K in (64, 128), V = {STATES_BV} and bf16/fp16 inputs, "
                         f"got K={K}, V={V}, {dtype}")
    C = CHUNK
    BV = STATES_BV
    G = HV // H
    acc = "float32"
    CH = 256  # chain threads [0, 256); store [256, 384); producer [384, 512)
    chain_kw = {"policy": T.GemmWarpPolicy.FullRow}

    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")
    Np1 = T.dynamic("Np1")
    N0 = T.dynamic("N0")
    SH = T.dynamic("SH")  # slots * HV
    NO = T.dynamic("NO")

    @T.prim_func  # (the kernel's symbol name is part of its generated source: kept as it was)
    def gdn_states_roles_bwd(
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, HV, V), dtype),
        A: T.Tensor((HV, R, C), dtype),
        g_cum_log2: T.Tensor((HV, R), "float32"),
        h0: T.Tensor((N0, HV, K, V), "float32"),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        order: T.Tensor((NO,), "int32"),
        use_order: T.int32,
        use_h0: T.int32,
        h: T.Tensor((SH, K, V), dtype),
    ):
        with T.Kernel(HV * ((Np1 - 1) if varlen else B), threads=512) as (bx,):
            hv = bx % HV
            n = T.alloc_var("int32")
            n = bx // HV
            if varlen:
                if use_order != 0:  # the sequences in the order given (`launch_order.launch_order`)
                    n = order[bx // HV]
            bos, seqlen, bidx, slot0, nchunks = sequence_span(n, cu_seqlens, Tn, varlen)
            hk = hv // G
            tx = T.get_thread_binding()

            k_s = T.alloc_shared((2, C, K), dtype)
            v_s = T.alloc_shared((2, C, BV), dtype)
            a_s = T.alloc_shared((2, C, C), dtype)
            gc_s = T.alloc_shared((2, C), acc)
            sb_s = T.alloc_shared((2, K, BV), dtype)  # S of chunk c in q's dtype = h's tile (chain -> store)
            T.annotate_layout({v_s: make_swizzled_layout(v_s), sb_s: make_swizzled_layout(sb_s)})

            full = T.alloc_barrier(arrive_count=[32, 32])
            empty = T.alloc_barrier(arrive_count=[CH, CH])
            s_full = T.alloc_barrier(arrive_count=[CH, CH])
            s_empty = T.alloc_barrier(arrive_count=[128, 128])

            if tx < CH:
                # ------------------------------------------------------------------ chain
                T.set_max_nreg(NREG["chain"], 1)
                st = T.alloc_fragment((BV, K), acc)
                st_b = T.alloc_fragment((BV, K), dtype)
                ut = T.alloc_fragment((BV, C), acc)
                nvt = T.alloc_fragment((BV, C), acc)
                wt_b = T.alloc_fragment((BV, C), dtype)
                vpt_b = T.alloc_fragment((BV, C), dtype)
                gam_f = T.alloc_fragment((C,), acc)
                r_f = T.alloc_fragment((C,), acc)
                gcl = T.alloc_local((1,), acc)
                if use_h0 != 0:
                    for i, j in T.Parallel(BV, K):
                        st[i, j] = h0[n, hv, j, i]
                else:
                    T.clear(st)
                for c in T.serial(nchunks):
                    s = c % 2
                    ph = (c // 2) % 2
                    T.barrier_wait(full[s], ph)
                    T.copy(st, st_b)
                    # U^T = S^T K^T
                    T.wgmma_gemm(st_b, k_s[s, :, :], ut, transpose_B=True, clear_accum=True, **chain_kw)
                    # meanwhile: hand the rounded S^T (h of this chunk) to the store role, gates, S^T *= gamma_C
                    T.barrier_wait(s_empty[s], 1 - ph)
                    for i, j in T.Parallel(BV, K):
                        sb_s[s, j, i] = st_b[i, j]
                    T.fence_proxy_async()
                    T.barrier_arrive(s_full[s])
                    for j in T.Parallel(C):
                        gam_f[j] = T.exp2(gc_s[s, j])
                        r_f[j] = T.exp2(T.min(gc_s[s, C - 1] - gc_s[s, j], T.float32(0)))
                    gcl[0] = T.exp2(gc_s[s, C - 1])
                    for i, j in T.Parallel(BV, K):
                        st[i, j] = st[i, j] * gcl[0]
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(ut, num_regs=BV * C // CH)
                    # W^T = V^T - U^T diag(gamma)
                    for i, j in T.Parallel(BV, C):
                        wt_b[i, j] = T.cast(T.cast(v_s[s, j, i], acc) - ut[i, j] * gam_f[j], dtype)
                    # vn^T = W^T A_beta^T
                    T.wgmma_gemm(wt_b, a_s[s, :, :], nvt, transpose_B=True, clear_accum=True, **chain_kw)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(nvt, num_regs=BV * C // CH)
                    for i, j in T.Parallel(BV, C):
                        vpt_b[i, j] = T.cast(nvt[i, j] * r_f[j], dtype)
                    # S^T = gamma_C S^T + (vn^T diag(r)) K
                    T.wgmma_gemm(vpt_b, k_s[s, :, :], st, **chain_kw)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(st, num_regs=BV * K // CH)
                    T.barrier_arrive(empty[s])
            elif tx < CH + 128:
                # ------------------------------------------------------------------ store
                T.set_max_nreg(NREG["store"], 1)
                for c in T.serial(nchunks):
                    s = c % 2
                    ph = (c // 2) % 2
                    T.barrier_wait(s_full[s], ph)
                    # one whole warp takes the TMA store (TileLang elects its issuing lane with elect.sync,
                    # which every lane of the warp must execute: under a one-thread guard the other
                    # lanes would run ahead to the next chunk's wait and the kernel would hang from the
                    # third chunk on)
                    if tx < CH + 32:
                        T.tma_copy(sb_s[s, :, :], h[(slot0 + c) * HV + hv, 0:K, 0:BV])
                        T.tma_store_arrive()
                        T.tma_store_wait(0)
                    T.barrier_arrive(s_empty[s])
            else:
                # ------------------------------------------------------------------ producer
                T.set_max_nreg(NREG["producer"], 0)
                if tx < CH + 128 + 32:
                    for c in T.serial(nchunks):
                        s = c % 2
                        ph = (c // 2) % 2
                        t0 = bos + c * C
                        row0 = (slot0 + c) * C
                        T.barrier_wait(empty[s], 1 - ph)
                        T.tma_copy(k[bidx, t0 : t0 + C, hk, 0:K], k_s[s, :, :], barrier=full[s])
                        T.tma_copy(v[bidx, t0 : t0 + C, hv, 0:BV], v_s[s, :, :], barrier=full[s])
                        T.tma_copy(A[hv, row0 : row0 + C, 0:C], a_s[s, :, :], barrier=full[s])
                        T.tma_copy(g_cum_log2[hv, row0 : row0 + C], gc_s[s, :], barrier=full[s])
                        T.barrier_arrive(full[s])

    return gdn_states_roles_bwd


@functools.lru_cache(maxsize=None)
def build_states_kernel(H: int, HV: int, K: int, V: int, dtype: str, seq_dtype: str, varlen: bool):
    """Compiled state-recompute kernel (cached). Static key: H, HV, K, V, dtype of k/v/A and of the
    stored h ("bfloat16" or "float16"), cu_seqlens dtype, packed or not. ValueError outside K in
    (64, 128), V = 128, bf16/fp16."""
    func = _states_prim_func(H, HV, K, V, dtype, seq_dtype, varlen)
    return compile_kernel(func, f"gdn_states_roles_bwd_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{seq_dtype}_{int(varlen)}")


def states_kernel_args(k, v, cu_seqlens) -> tuple:
    """The static key (`build_states_kernel` arguments) of a launch with these inputs."""
    seq_dtype = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
    return (k.shape[2], v.shape[2], k.shape[3], v.shape[3], tl_dtype(k.dtype), seq_dtype, cu_seqlens is not None)


def chunk_states_bwd(k, v, A, g_cum_log2, initial_state, cu_seqlens, order=None):
    """Launches pass 1 (order: `launch_order.launch_order(cu_seqlens)` or None, the sequences' launch
    order; the same h either way).

    Args: k [B, T, H, K], v [B, T, HV, V] (the forward's, contiguous); A [HV, S * 64, 64] and
    g_cum_log2 [HV, S * 64] (the forward's `ChunkGDNForward.A`, `.g_cum_log2`); initial_state None or
    [N, HV, K, V] fp32; cu_seqlens None or [N + 1].

    Returns h [S * HV, K, V] in k's dtype (bf16 or fp16; the module docstring says why fp16 is safe):
    the state entering chunk slot s of value head hv at row s * HV + hv (rows of unused slots are not
    written).
    """
    args = states_kernel_args(k, v, cu_seqlens)
    return launch_states(lambda: build_states_kernel(*args), k, v, A, g_cum_log2, initial_state, cu_seqlens, k.dtype, order)

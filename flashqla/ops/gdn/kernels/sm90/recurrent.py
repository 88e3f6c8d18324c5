"""Recurrent kernel (launch 2 of 2 of the unsplit forward): one CTA per (value slice, value head,
sequence), walking the sequence's chunks with the fp32 state resident in registers, on
role-specialised warpgroups.

Covers the reference stages (FLA's names, `reference.gdn.chunk`):
    recompute_w_u + chunk_fwd_h -> v_new, the chunk-start states h (never stored) and final_state
    chunk_fwd_o                 -> o
in the merged form of `reference.gdn.fused`:
    W      = V - diag(gamma) K S                     (gamma_t = exp(g_cum[t]))
    v_new  = A_beta W                                 (A_beta = A diag(beta), from the prepare kernel)
    o      = scale (diag(gamma) Q S + (Q K^T * Gamma) v_new)     (Gamma_ts = exp(g_cum[t] - g_cum[s]), t >= s)
    S'     = gamma_C S + K^T diag(exp(g_cum[C-1] - g_cum)) v_new
Derivation records (`python -m derivations`): CF-1..CF-3 (chunk form: outputs, chunk-end state,
v_new = the recurrence's deltas), RW-2 (merged v_new), RW-4 (exp2 of base-2 differences). Stage twins
in `reference.gdn.fused`: `chunk_v_new`, `chunk_state_update`, `chunk_output`, `gate_vectors`.
Every exponent is a difference <= 0 (masked to the causal half before exp2 for Gamma).

Roles (consumer warpgroups that run concurrently, a producer warp feeding both):

    chain  (threads [0, CH))  owns S^T [BV, K] fp32 in registers; per chunk
                              S^T -> bf16 copy (registers, and shared memory for the output role)
                              U^T   = S^T K^T                        (wgmma, A from registers)
                              W^T   = V^T - U^T diag(gamma)
                              vn^T  = W^T A_beta^T                   (wgmma, A from registers)
                              vn^T  -> shared memory (bf16) for the output role
                              S^T   = gamma_C S^T + (vn^T diag(r)) K (wgmma, A from registers)
    output (next 128 threads) per chunk, in token-major form (o's own layout, no transpose)
                              P  = Q K^T;  Pg = scale (P * Gamma) causal (registers)
                              O  = scale diag(gamma) Q S             (S from the chain's bf16 copy)
                              O += Pg vn                             (wgmma, A from registers)
                              o  <- O (rows inside the sequence)
    producer (last 128)       one warp issues the TMA loads of q, k, v, A_beta and g_cum_log2
                              into a two-stage ring.

CH = 128 at BV = 64 (384 threads). At BV = 128 the chain is two warpgroups (CH = 256, 512 threads),
each owning 64 value rows of S^T; every chain product is one wgmma split by rows over the two, and the
output role's O is [64, 128]. The chain's products are the serial dependency; the output path runs
beside it instead of behind it.

Synchronisation (mbarriers, two of each, indexed by the stage c % 2, parity (c // 2) % 2):
    full     producer -> both roles: the stage's tiles landed (TMA transaction bytes)
    empty    both roles -> producer: the stage's tiles are no longer read
    s_full / s_empty    chain -> output / back: the bf16 S^T of chunk c in sb_s[c % 2]
    n_full / n_empty    chain -> output / back: vn^T of chunk c in nv_s[c % 2]
A waiter on an "empty" barrier uses the opposite parity, so its first two waits pass at once.

The chain role also loads the initial state and stores the final one. Tail chunks load whole 64-row
tiles: rows past the end of the sequence are inert because the prepare kernel wrote zero rows of
A_beta there, and only rows inside the sequence are stored.
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, SM_COUNT, compile_kernel, placeholder, sequence_span, tl_dtype

__all__ = ["CheckpointRanges", "build_recurrent_kernel", "build_recurrent_serving_kernel", "chunk_recurrent_dual",
           "chunk_recurrent_dual_checkpoints", "chunk_recurrent_fwd", "chunk_recurrent_serving",
           "pick_block_v", "recurrent_kernel_args", "recurrent_serving_args", "serving_spec_args"]

#: The value slice widths of the role-split kernel. At BV = 64 one chain warpgroup holds S^T's 64
#: value rows; at BV = 128 two chain warpgroups hold 64 rows each (every chain product is one wgmma
#: split by rows over the two, as the one-warpgroup kernel's consumers at BV = 128), beside one output
#: warpgroup and the producer: 512 threads.
ROLES_WIDTHS = (64, 128)
ROLES_BV = 64
#: The per-CTA sums of the serving build's phase-clock build (`build_recurrent_serving_kernel_clocked`),
#: in SM clock cycles over every chunk the CTA walks: chunks (the count); chain_wait (the chain's wait
#: for the chunk's loads: `full`, in the chunk; the waits before a run of chunks and, at BV = 64,
#: before the loop are in no sum); chain_head (U = S K^T issued, the bf16 S^T published, gates, in a
#: chunk holding a checkpoint its range read, and S scaled); chain_w (U waited, W^T,
#: vn^T = W^T A_beta^T and its casts); chain_tail (the checkpoints inside the chunk, the S update, vn^T published, the chunk-end
#: checkpoints, up to `empty`); producer_wait (the producer's wait for a free stage: `empty`);
#: producer_work (its TMA issue, the checkpoint range search and the hand-over).
SERVING_CLOCKS = ("chunks", "chain_wait", "chain_head", "chain_w", "chain_tail", "producer_wait", "producer_work")
#: Registers per thread after setmaxnreg, per role and width. setmaxnreg only moves registers between
#: the warpgroups of a CTA: the CTA launches with 65,536 / threads rounded down to a multiple of 8
#: (168 at 384 threads, 128 at 512), so the warpgroups' counts must sum to at most `reg_budget(BV)`,
#: or an `inc` waits forever. At BV = 128 "chain" is each of the two chain warpgroups' count.
NREG = {
    64: {"chain": 248, "output": 216, "producer": 40},
    128: {"chain": 168, "output": 152, "producer": 24},
}
#: The serving build's counts with the fp16 A_beta product and checkpoints (`_serving_prim_func`,
#: op_dtype "float16", checkpoints, not the split path's dual build), where they differ from `NREG`: at
#: BV = 128 ptxas allocates that build's output role without spilling only with 168 registers, and
#: its chain fits 160 (without checkpoints the chain needs `NREG`'s 168; benchmarks/journal/forward.md,
#: "The fp16 A_beta product without divisions").
NREG_SERVING_FP16 = {128: {"chain": 160, "output": 168, "producer": 24}}


def roles_threads(BV: int) -> int:
    """Threads of the role-split kernel at value slice width BV: 128 per chain warpgroup (BV / 64 of
    them), 128 for the output role, 128 for the producer warpgroup."""
    return 128 * (BV // 64) + 256


def reg_budget(BV: int) -> int:
    """The registers the warpgroups' setmaxnreg counts may sum to at width BV (see `NREG`)."""
    threads = roles_threads(BV)
    return (threads // 128) * ((65536 // threads) // 8 * 8)


def _recurrent_prim_func(H: int, HV: int, K: int, V: int, dtype: str, seq_dtype: str, varlen: bool,
                         dual: bool = False, BV: int = ROLES_BV, op_dtype: str | None = None):
    """The TileLang kernel at value slice width BV (64 or 128; arguments as `build_recurrent_kernel`).

    dual (K == V): the split path's run and transition launch in one grid of 2 x NV x HV x N CTAs
    (`chunk_recurrent_dual`). The first half are transition CTAs: v taken as 0, the state started
    from I (or from 0 where `limit` is 0), min(nchunks, limit[n, hv]) chunks walked, the output rows
    written to `u` (rows of chunks not walked are not written) and the end state to `pt`, or 0 there
    when fewer chunks than the segment has were walked (the truncated transition, records CP-4 /
    CP-5). The second half are the run CTAs, the plain kernel's code and arithmetic. Transition CTAs
    come first so that long ones (heads whose gates do not decay) start in the first wave.

    The output role writes o (u in transition CTAs) through a 128-byte-swizzled shared tile with
    16-byte vector stores, one row check per 8 values.

    op_dtype (None: the input dtype, the training forward's build, whose A the backward reads;
    "float16" for bf16 input: the inference forward's, `flashqla.ops.gdn.fwd.product_dtype`): the
    dtype of A_beta (as the prepare kernel stored it: `build_prepare_kernel(a_dtype=)`) and of the
    operands of the two products that read it or its result, W^T (vn^T = W^T A_beta^T) and Pg, vn^T
    (O += Pg vn). "float16" keeps 3 more mantissa bits than bf16 there (o 0.73x FLA's error in the
    CPU rounding model, `reference.gdn.numerics.forward_rounding_model`). fp16's range: each row i
    of W^T (one value row, 64 tokens) is scaled by a power of two s_i that puts its largest magnitude
    in [2^7, 2^8) (s_i within 2^-30 .. 2^30; over the sequence's own tokens: the rows past its end
    are zeroed first, A_beta's columns there being 0), so that vn^T's rows (|A_beta| <= 1 on unit keys) stay
    below 2^15; the state update takes vn^T times 1 / s_i (exact), and the output role scales O's column i
    by s_i before O += Pg vn and back by 1 / s_i after (both shared through `sc_s` with vn^T; exact:
    powers of two, so no division on either role)."""
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout

    C = CHUNK
    if BV not in ROLES_WIDTHS:
        raise ValueError(f"the role-split kernel is built for BV in {ROLES_WIDTHS}, got {BV}")
    odt = op_dtype or dtype
    scaled = odt != dtype  # fp16 operands of the A_beta and output products, rows scaled by powers of two
    G = HV // H
    NV = V // BV
    acc = "float32"
    if V % BV:
        raise ValueError(f"the role-split kernel needs V divisible by {BV}, got V={V}")
    if dual and K != V:
        raise ValueError(f"the dual launch needs K == V, got K={K}, V={V}")
    nreg = NREG[BV]
    n_chain = BV // 64  # chain warpgroups
    CH = 128 * n_chain  # chain threads [0, CH); output [CH, CH + 128); producer [CH + 128, CH + 256)
    threads = roles_threads(BV)
    if nreg["chain"] * n_chain + nreg["output"] + nreg["producer"] > reg_budget(BV) or any(r % 8 for r in nreg.values()):
        raise ValueError(f"role registers {nreg} (chain x {n_chain}) must be multiples of 8 summing to <= {reg_budget(BV)}")
    # chain products at BV = 128: one wgmma over both chain warpgroups, split by rows (64 each)
    chain_kw = {"policy": T.GemmWarpPolicy.FullRow} if n_chain > 1 else {}

    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")
    Np1 = T.dynamic("Np1")
    N0 = T.dynamic("N0")
    N1 = T.dynamic("N1")
    NP = T.dynamic("NP")  # rows of pt and limit (dual: N)
    u_shape = (B, Tn, HV, K) if dual else (1,)
    pt_shape = (NP, HV, K, K) if dual else (1,)
    lim_shape = (NP, HV) if dual else (1,)
    nseq = (Np1 - 1) if varlen else B
    ncta = NV * HV * nseq

    @T.prim_func  # (the kernel's symbol name is part of its generated source: kept as it was)
    def gdn_recurrent_roles_fwd(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, HV, V), dtype),
        A: T.Tensor((HV, R, C), odt),
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
        with T.Kernel(ncta * (2 if dual else 1), threads=threads) as (bx,):
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
            tx = T.get_thread_binding()

            q_s = T.alloc_shared((2, C, K), dtype)
            k_s = T.alloc_shared((2, C, K), dtype)
            v_s = T.alloc_shared((2, C, BV), dtype)
            a_s = T.alloc_shared((2, C, C), odt)
            gc_s = T.alloc_shared((2, C), acc)
            sb_s = T.alloc_shared((2, BV, K), dtype)  # bf16 S^T of chunk c (chain -> output)
            nv_s = T.alloc_shared((2, BV, C), odt)  # vn^T of chunk c (chain -> output)
            if scaled:
                # vn^T's row scales of chunk c and their inverses (chain -> output): powers of two, exact in bf16
                sc_s = T.alloc_shared((2, 2, BV), "bfloat16")
            o_s = T.alloc_shared((C, BV), dtype)  # O of this chunk in o's dtype (output role)
            T.annotate_layout({v_s: make_swizzled_layout(v_s), o_s: make_swizzled_layout(o_s)})

            full = T.alloc_barrier(arrive_count=[32, 32])
            empty = T.alloc_barrier(arrive_count=[CH + 128, CH + 128])
            s_full = T.alloc_barrier(arrive_count=[CH, CH])
            s_empty = T.alloc_barrier(arrive_count=[128, 128])
            n_full = T.alloc_barrier(arrive_count=[CH, CH])
            n_empty = T.alloc_barrier(arrive_count=[128, 128])

            if tx < CH:
                # ------------------------------------------------------------------ chain
                T.set_max_nreg(nreg["chain"], 1)
                st = T.alloc_fragment((BV, K), acc)
                st_b = T.alloc_fragment((BV, K), dtype)
                ut = T.alloc_fragment((BV, C), acc)
                nvt = T.alloc_fragment((BV, C), acc)
                wt_b = T.alloc_fragment((BV, C), odt)
                nvt_b = T.alloc_fragment((BV, C), odt)
                vpt_b = T.alloc_fragment((BV, C), dtype)
                gam_f = T.alloc_fragment((C,), acc)
                r_f = T.alloc_fragment((C,), acc)
                gcl = T.alloc_local((1,), acc)
                if scaled:
                    wmax = T.alloc_fragment((BV,), acc)
                    wsc = T.alloc_fragment((BV,), acc)
                    wsi = T.alloc_fragment((BV,), acc)  # 1 / wsc (exact: powers of two)
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
                if BV == 64 and (nloop if dual else nchunks) > 0:
                    # chunk 0's loads waited for once before the loop (the loop's own first wait then passes
                    # at once): with it ptxas schedules the BV = 64 chain's loop faster, same instructions and
                    # results (benchmarks/journal/forward.md, "The BV = 64 chain ... from one wait")
                    T.barrier_wait(full[0], 0)
                for c in T.serial(nloop if dual else nchunks):
                    s = c % 2
                    ph = (c // 2) % 2
                    T.barrier_wait(full[s], ph)
                    T.copy(st, st_b)
                    # U^T = S^T K^T
                    T.wgmma_gemm(st_b, k_s[s, :, :], ut, transpose_B=True, clear_accum=True, **chain_kw)
                    # meanwhile: publish the bf16 S^T, gates, S^T *= gamma_C
                    T.barrier_wait(s_empty[s], 1 - ph)
                    T.copy(st_b, sb_s[s, :, :])
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
                    if scaled:
                        # W^T in fp32 in U^T's registers, each row scaled by a power of two that puts its
                        # largest magnitude in [2^7, 2^8) (2^-30 .. 2^30): fp16's range for any |v|
                        # (tokens past the sequence's end zeroed: the scale depends on the sequence alone;
                        # A_beta's columns there are 0, so vn^T does not change)
                        if dual:
                            for i, j in T.Parallel(BV, C):
                                ut[i, j] = T.if_then_else(tr, T.float32(0), T.cast(v_s[s, j, i], acc)) - ut[i, j] * gam_f[j]
                        else:
                            for i, j in T.Parallel(BV, C):
                                ut[i, j] = T.cast(v_s[s, j, i], acc) - ut[i, j] * gam_f[j]
                        if c * C + C > seqlen:  # the sequence's last, partial chunk
                            for i, j in T.Parallel(BV, C):
                                ut[i, j] = T.if_then_else(c * C + j < seqlen, ut[i, j], T.float32(0))
                        T.reduce_absmax(ut, wmax, dim=1)
                        for i in T.Parallel(BV):
                            wsc[i] = T.max(T.min(T.float32(8) - T.floor(T.log2(T.max(wmax[i], T.float32(1e-30))))
                                                 - T.float32(1), T.float32(30)), T.float32(-30))
                            wsi[i] = T.exp2(-wsc[i])
                            wsc[i] = T.exp2(wsc[i])
                        for i, j in T.Parallel(BV, C):
                            wt_b[i, j] = T.cast(ut[i, j] * wsc[i], odt)
                    elif dual:  # transition CTAs: v = 0
                        for i, j in T.Parallel(BV, C):
                            wt_b[i, j] = T.cast(
                                T.if_then_else(tr, T.float32(0), T.cast(v_s[s, j, i], acc)) - ut[i, j] * gam_f[j], dtype)
                    else:
                        for i, j in T.Parallel(BV, C):
                            wt_b[i, j] = T.cast(T.cast(v_s[s, j, i], acc) - ut[i, j] * gam_f[j], dtype)
                    # vn^T = W^T A_beta^T
                    T.wgmma_gemm(wt_b, a_s[s, :, :], nvt, transpose_B=True, clear_accum=True, **chain_kw)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(nvt, num_regs=BV * C // CH)
                    if scaled:
                        for i, j in T.Parallel(BV, C):
                            nvt_b[i, j] = T.cast(nvt[i, j], odt)  # scaled rows (|.| < 2^15: |A_beta| <= 1)
                            vpt_b[i, j] = T.cast(nvt[i, j] * r_f[j] * wsi[i], dtype)
                    else:
                        for i, j in T.Parallel(BV, C):
                            nvt_b[i, j] = T.cast(nvt[i, j], odt)
                            vpt_b[i, j] = T.cast(nvt[i, j] * r_f[j], dtype)
                    # S^T = gamma_C S^T + (vn^T diag(r)) K; meanwhile publish vn^T
                    T.wgmma_gemm(vpt_b, k_s[s, :, :], st, **chain_kw)
                    T.barrier_wait(n_empty[s], 1 - ph)
                    T.copy(nvt_b, nv_s[s, :, :])
                    if scaled:
                        for i in T.Parallel(BV):
                            sc_s[s, 0, i] = T.cast(wsc[i], "bfloat16")
                            sc_s[s, 1, i] = T.cast(wsi[i], "bfloat16")
                    T.fence_proxy_async()
                    T.barrier_arrive(n_full[s])
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(st, num_regs=BV * K // CH)
                    T.barrier_arrive(empty[s])
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
            elif tx < CH + 128:
                # ------------------------------------------------------------------ output
                T.set_max_nreg(nreg["output"], 1)
                p_f = T.alloc_fragment((C, C), acc)
                pg_b = T.alloc_fragment((C, C), odt)
                of = T.alloc_fragment((C, BV), acc)
                gr_f = T.alloc_fragment((C,), acc)
                for c in T.serial(nloop if dual else nchunks):
                    s = c % 2
                    ph = (c // 2) % 2
                    t0 = bos + c * C
                    T.barrier_wait(full[s], ph)
                    # P = Q K^T, then O = Q S from the chain's bf16 S^T
                    T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True, clear_accum=True)
                    T.barrier_wait(s_full[s], ph)
                    T.wgmma_gemm(q_s[s, :, :], sb_s[s, :, :], of, transpose_B=True, clear_accum=True)
                    for t in T.Parallel(C):
                        gr_f[t] = scale * T.exp2(gc_s[s, t])
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(p_f, num_regs=C * C // 128)
                    # Pg = scale (P * Gamma), causal (t >= j)
                    for t, j in T.Parallel(C, C):
                        pg_b[t, j] = T.cast(
                            T.if_then_else(
                                t >= j,
                                scale * p_f[t, j] * T.exp2(T.if_then_else(t >= j, gc_s[s, t] - gc_s[s, j], T.float32(0))),
                                T.float32(0),
                            ),
                            odt,
                        )
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(of, num_regs=C * BV // 128)
                    T.barrier_arrive(s_empty[s])
                    if scaled:
                        # O += Pg vn with vn^T's rows scaled: O's columns scaled alike around the product
                        T.barrier_wait(n_full[s], ph)
                        for t, i in T.Parallel(C, BV):
                            of[t, i] = of[t, i] * gr_f[t] * T.cast(sc_s[s, 0, i], acc)
                        T.wgmma_gemm(pg_b, nv_s[s, :, :], of, transpose_B=True)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(of, num_regs=C * BV // 128)
                        for t, i in T.Parallel(C, BV):
                            of[t, i] = of[t, i] * T.cast(sc_s[s, 1, i], acc)
                    else:
                        for t, i in T.Parallel(C, BV):
                            of[t, i] = of[t, i] * gr_f[t]
                        # O += Pg vn
                        T.barrier_wait(n_full[s], ph)
                        T.wgmma_gemm(pg_b, nv_s[s, :, :], of, transpose_B=True)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(of, num_regs=C * BV // 128)
                    T.barrier_arrive(n_empty[s])
                    T.barrier_arrive(empty[s])
                    nvalid = T.min(seqlen - c * C, C)
                    for t, i in T.Parallel(C, BV):
                        o_s[t, i] = T.cast(of[t, i], dtype)
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
            else:
                # ------------------------------------------------------------------ producer
                T.set_max_nreg(nreg["producer"], 0)
                if tx < CH + 128 + 32:
                    for c in T.serial(nloop if dual else nchunks):
                        s = c % 2
                        ph = (c // 2) % 2
                        t0 = bos + c * C
                        row0 = (slot0 + c) * C
                        T.barrier_wait(empty[s], 1 - ph)
                        T.tma_copy(q[bidx, t0 : t0 + C, hk, 0:K], q_s[s, :, :], barrier=full[s])
                        T.tma_copy(k[bidx, t0 : t0 + C, hk, 0:K], k_s[s, :, :], barrier=full[s])
                        T.tma_copy(v[bidx, t0 : t0 + C, hv, v0 : v0 + BV], v_s[s, :, :], barrier=full[s])
                        T.tma_copy(A[hv, row0 : row0 + C, 0:C], a_s[s, :, :], barrier=full[s])
                        T.tma_copy(g_cum_log2[hv, row0 : row0 + C], gc_s[s, :], barrier=full[s])
                        T.barrier_arrive(full[s])

    return gdn_recurrent_roles_fwd


#: The storage dtypes of states a serving build reads and writes (TileLang names), and the layouts.
SERVING_STATE_DTYPES = ("float32", "bfloat16", "float16")
SERVING_LAYOUTS = ("kv", "vk")


class CheckpointRanges:
    """The serving build's checkpoint ranges, found by one warp from the sorted positions themselves
    (no table launch; record CF-4's storage). Construct it inside a kernel body, on the warp's 32
    threads (lane 0..31): it allocates its int32 variables and finds the sequence's first checkpoint,
    #{m : p_m <= g0}, by a 32-wide search (32 samples per round narrow [lo, hi) 32-fold: ceil(log32 M)
    rounds of one read per lane and a ballot). `chunk(c)` then emits chunk c's range and returns
    the variables (lo, end, hi): checkpoints [lo, hi) have lo <= m < hi with g0 + 64 c < p_m <= e,
    e = g0 + min(64 (c + 1), seqlen); [lo, end) end inside the chunk (p_m < e, or every one of them
    when the chunk is a sequence's partial last one) and [end, hi) at its last token. Each call reads
    32 positions per round (one per lane) and counts them by ballot, continuing while all 32 belong
    to the chunk, and advances a running index, so chunk(c) must be emitted for c = 0, 1, ... in order.

    positions: the int32 words of the positions (entry m at word m * pos_stride: 2 for an int64 tensor
    read through its low words); n_ckpt: M; g0: the sequence's first token as a global position (the
    offset into the packed, or flattened fixed-length, batch); seqlen: its length. Python twin:
    `tests/test_serving_kernels_compile.py::_ranges_by_loop`; the generated source runs on the host in
    `test_checkpoint_ranges_source_on_the_host`."""

    def __init__(self, positions, pos_stride, n_ckpt, lane, g0, seqlen):
        import tilelang.language as T

        from flashqla.ops.gdn.kernels.sm90._common import _int32_vars

        self.positions, self.pos_stride, self.n_ckpt, self.lane, self.g0, self.seqlen = (
            positions, pos_stride, n_ckpt, lane, g0, seqlen)
        self.v = _int32_vars("p_lo", "p_hi", "p_end", "p_run", "p_step", "p_idx", "p_val", "p_le", "p_lt", "p_more")

        @T.macro
        def first(p_lo, p_hi, p_end, p_run, p_step, p_idx, p_val, p_le, p_lt, p_more):
            p_lo = 0
            p_hi = n_ckpt
            while p_hi - p_lo > 32:
                p_step = (p_hi - p_lo + 31) // 32
                p_idx = p_lo + (lane + 1) * p_step - 1
                p_val = 0
                if p_idx < p_hi:
                    if positions[p_idx * pos_stride] <= g0:
                        p_val = 1
                p_le = T.cast(T.popcount(T.ballot(p_val)), "int32")
                p_lo = p_lo + p_le * p_step
                p_hi = T.min(p_lo + p_step, p_hi)
            p_idx = p_lo + lane
            p_val = 0
            if p_idx < p_hi:
                if positions[p_idx * pos_stride] <= g0:
                    p_val = 1
            p_run = p_lo + T.cast(T.popcount(T.ballot(p_val)), "int32")

        first(*self.v)

    def chunk(self, c):
        import tilelang.language as T

        C = CHUNK
        positions, pos_stride, n_ckpt, lane, g0, seqlen = (
            self.positions, self.pos_stride, self.n_ckpt, self.lane, self.g0, self.seqlen)
        e = g0 + T.min((c + 1) * C, seqlen)
        partial = (c + 1) * C > seqlen

        @T.macro
        def step(p_lo, p_hi, p_end, p_run, p_step, p_idx, p_val, p_le, p_lt, p_more):
            p_lo = p_run
            p_end = p_run
            p_more = 1
            while p_more != 0:
                p_idx = p_run + lane
                p_le = 0
                p_lt = 0
                if p_idx < n_ckpt:
                    p_val = positions[p_idx * pos_stride]
                    if p_val <= e:
                        p_le = 1
                    if p_val < e:
                        p_lt = 1
                p_le = T.cast(T.popcount(T.ballot(p_le)), "int32")
                p_lt = T.cast(T.popcount(T.ballot(p_lt)), "int32")
                p_end = p_end + p_lt
                p_run = p_run + p_le
                p_more = T.if_then_else(p_le == 32, 1, 0)
            p_hi = p_run
            if partial:
                p_end = p_hi

        step(*self.v)
        return self.v[0], self.v[2], self.v[1]


class _ChainArgs:
    """The buffers and values one chunk of the serving build's chain reads (`chain_chunk`), passed to
    the macro as one object: keywords become attributes; a first positional _ChainArgs is extended."""

    def __init__(self, base=None, **kw):
        if base is not None:
            self.__dict__.update(base.__dict__)
        self.__dict__.update(kw)


def _chain_vars(checkpoints: bool, phase_clock: bool) -> tuple:
    """The variables the serving build's chain assigns, allocated in the kernel body (the chain role):
    int32 jj, m_lo, m_end, m_hi, mid with checkpoints, int64 ck_t, ck_wait, ck_head, ck_w,
    ck_tail in the phase-clock build; 0 in place of those a build does not have."""
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    out = []
    for names, dtype, on in ((("jj", "m_lo", "m_end", "m_hi", "mid"), "int32", checkpoints),
                             (("ck_t", "ck_wait", "ck_head", "ck_w", "ck_tail"), "int64", phase_clock)):
        for name in names:
            if on:
                var = T.alloc_var(dtype)
                IRBuilder.name(name, var)
                out.append(var)
            else:
                out.append(0)
    return tuple(out)


def _serving_prim_func(H: int, HV: int, K: int, V: int, dtype: str, seq_dtype: str, varlen: bool, BV: int,
                       state_dtype: str, state_layout: str, checkpoints: bool, dual: bool = False,
                       op_dtype: str | None = None, *, phase_clock: bool = False):
    """The role-split kernel's serving build (`build_recurrent_kernel` with indexed=True): the plain
    kernel's arithmetic (o and every state bitwise those of the plain build with an fp32 kv state), with
    the states addressed by index, in a layout and storage dtype, and checkpoints stored in-kernel.

    - state rows: sequence n's row is rows[n * rows_stride] (rows_stride 0: row n; 2: the low word of
      an int64 index, -1 unless its high word is 0), read only where use_has == 0 or has_init[n] != 0;
      a negative row is neither read nor written;
    - initial states: sequence n starts from h0[row] (layout `state_layout`, dtype `state_dtype`,
      widened to fp32 at the load), or from zeros when use_h0 == 0 or the row is not read;
    - final states: with store_ht, ht[row] = S (rounded once to `state_dtype` at the store, in
      `state_layout`). h0 and ht may be one tensor (a state pool updated in place: each CTA reads and
      writes only its own row's value slice);
    - checkpoints (record CF-4, twin `reference.gdn.chunk.chunk_checkpoint_states`): checkpoint m,
      at global position p_m = positions[m * pos_stride] (sorted, each inside a sequence), is stored
      by the chunk that holds token p_m - 1, j = p_m - (the chunk's first global token) in 1..64 tokens
      in; the chain computes S_m^T = gamma_{j-1} S^T + (vn^T diag(m_j)) K with
      m_j,i = exp2(gc_{j-1} - gc_i) for i < j (else 0), a masked copy of the chunk's own state update
      (one wgmma on the chunk's vn^T and k tile), into a separate accumulator, and stores it to
      ckpt[m] in `state_layout` / `state_dtype`. The chunk's state and vn^T are not changed by it: in a
      chunk with such checkpoints the chain publishes vn^T first and scales S by gamma_C after them
      instead of during U = S K^T (the same products), so o and the states do not depend on the
      checkpoints. A checkpoint at a full chunk's last token (j = 64) is the chunk's end state: it is
      stored from S after the chunk's update, with no extra product. Only the chunks that hold a
      checkpoint run that code (`chain_chunk` with_ck): the chain walks the runs of chunks between
      them with the plain build's chain, instruction for instruction (`chain_walk`). The producer warp
      finds each chunk's range from the positions (the sequence's first checkpoint by a 32-wide
      search of the sorted positions, then 32 positions per warp-wide read and ballot) while the
      chunk's loads are in flight, and hands it to the chain in shared memory under the chunk's
      barrier with the first chunk >= c that holds a checkpoint (the end of the chain's run): no
      table launch, no global read on the chain's serial path.
    - dual (the split path's run and transition launch with checkpoints, `chunk_recurrent_dual_checkpoints`;
      K == V): the plain dual launch's grid of transition CTAs then run CTAs (`_recurrent_prim_func`
      with dual), both storing checkpoints: run CTAs into ckpt (the state at p from the segment's run
      start), transition CTAs into ckp (the segment's transition from its start to p, walked from I
      with v = 0; a checkpoint past the transition's limit is not stored). Rows are n (rows_stride 0).
    - op_dtype (None: the input dtype): the A_beta product's dtype, as `_recurrent_prim_func`'s (W^T's
      rows scaled alike; the checkpoints read vn^T's rows unscaled).
    - phase_clock (False: the shipped kernel, its source unchanged): the measurement build
      (`build_recurrent_serving_kernel_clocked`), with one more argument after ckp, clocks [CTAs,
      len(SERVING_CLOCKS)] int64, where the chain's thread 0 and the producer warp's lane 0 add up
      the SM clock cycles of each phase of every chunk (`SERVING_CLOCKS`). The same outputs bit for bit.
    """
    import tilelang.language as T
    from tilelang.layout import make_swizzled_layout

    C = CHUNK
    if BV not in ROLES_WIDTHS or V % BV:
        raise ValueError(f"the role-split kernel is built for BV in {ROLES_WIDTHS} dividing V, got BV={BV}, V={V}")
    G = HV // H
    NV = V // BV
    acc = "float32"
    odt = op_dtype or dtype
    scaled = odt != dtype  # fp16 operands of the A_beta and output products, rows scaled (as the plain build)
    sdt = state_dtype
    vk = state_layout == "vk"
    sa, sb = (V, K) if vk else (K, V)
    nreg = NREG_SERVING_FP16.get(BV, NREG[BV]) if scaled and checkpoints and not dual else NREG[BV]
    n_chain = BV // 64
    CH = 128 * n_chain
    threads = roles_threads(BV)
    chain_kw = {"policy": T.GemmWarpPolicy.FullRow} if n_chain > 1 else {}
    KH = min(K, 64)  # checkpoint columns per wgmma (registers: S^T and half a checkpoint live at BV = 128)

    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")
    Np1 = T.dynamic("Np1")
    N0 = T.dynamic("N0")
    N1 = T.dynamic("N1")
    NI = T.dynamic("NI")  # int32 words of the state indices (N or 2N; 1 without a pool: a placeholder)
    NH = T.dynamic("NH")  # has_initial_state's bytes (N; 1 without it: a placeholder)
    MP = T.dynamic("MP")  # int32 words of the checkpoint positions (M or 2M; 1 without checkpoints)
    MC = T.dynamic("MC")  # checkpoint rows (M; 1 without checkpoints)
    NP = T.dynamic("NP")  # rows of pt and limit (dual: N)
    u_shape = (B, Tn, HV, K) if dual else (1,)
    pt_shape = (NP, HV, K, K) if dual else (1,)
    lim_shape = (NP, HV) if dual else (1,)
    ckp_shape = (MC, HV, K, K) if dual else (1,)
    nseq = (Np1 - 1) if varlen else B
    ncta = NV * HV * nseq
    # the clocked build's extra argument (None: no kernel argument, the shipped signature)
    clock_arg = T.Tensor((T.dynamic("NCTA"), len(SERVING_CLOCKS)), "int64") if phase_clock else None

    def clock():
        return T.call_extern("int64", "clock64")

    @T.macro
    def load_state(st, src, row, hv, v0):
        for i, j in T.Parallel(BV, K):
            if vk:
                st[i, j] = T.cast(src[row, hv, v0 + i, j], acc)
            else:
                st[i, j] = T.cast(src[row, hv, j, v0 + i], acc)

    @T.macro
    def store_state(dst, row, hv, v0, st, k0):
        for i, j in T.Parallel(BV, st.shape[1]):
            if vk:
                dst[row, hv, v0 + i, k0 + j] = T.cast(st[i, j], sdt)
            else:
                dst[row, hv, k0 + j, v0 + i] = T.cast(st[i, j], sdt)

    @T.macro
    def chain_chunk(b, c, with_ck, jj, m_lo, m_end, m_hi, mid, ck_t, ck_wait, ck_head, ck_w, ck_tail):
        """One chunk of the chain role (the state update). b: the kernel's buffers and values
        (`_ChainArgs`); the int32 / int64 variables the chunk assigns come as arguments (`_chain_vars`:
        a macro takes a variable itself only as an argument). with_ck (static): the checkpoint order and
        stores of a chunk that holds a checkpoint; else the plain build's chain, instruction for
        instruction."""
        st, st_b, ut, nvt, wt_b, nvt_b = b.st, b.st_b, b.ut, b.nvt, b.wt_b, b.nvt_b
        vpt_b, gam_f, r_f, gcl, k_s = b.vpt_b, b.gam_f, b.r_f, b.gcl, b.k_s
        v_s, a_s, gc_s, sb_s, nv_s, full = b.v_s, b.a_s, b.gc_s, b.sb_s, b.nv_s, b.full
        empty, s_full, s_empty, n_full, n_empty, hv = b.empty, b.s_full, b.s_empty, b.n_full, b.n_empty, b.hv
        v0, bidx, bos, seqlen, tx, positions = b.v0, b.bidx, b.bos, b.seqlen, b.tx, b.positions
        pos_stride, n_ckpt, ckpt, ckp = b.pos_stride, b.n_ckpt, b.ckpt, b.ckp
        if scaled:
            sc_s, wmax, wsc, wsi = b.sc_s, b.wmax, b.wsc, b.wsi
        if dual:
            tr = b.tr
        if checkpoints:
            ck, mvt_b, gj, ck_s = b.ck, b.mvt_b, b.gj, b.ck_s
        s = c % 2
        ph = (c // 2) % 2
        if phase_clock:
            if tx == 0:
                ck_t = clock()
        T.barrier_wait(full[s], ph)
        if phase_clock:
            if tx == 0:
                ck_wait = ck_wait + (clock() - ck_t)
                ck_t = clock()
        T.copy(st, st_b)
        # U^T = S^T K^T
        T.wgmma_gemm(st_b, k_s[s, :, :], ut, transpose_B=True, clear_accum=True, **chain_kw)
        T.barrier_wait(s_empty[s], 1 - ph)
        T.copy(st_b, sb_s[s, :, :])
        T.fence_proxy_async()
        T.barrier_arrive(s_full[s])
        for j in T.Parallel(C):
            gam_f[j] = T.exp2(gc_s[s, j])
            r_f[j] = T.exp2(T.min(gc_s[s, C - 1] - gc_s[s, j], T.float32(0)))
        gcl[0] = T.exp2(gc_s[s, C - 1])
        if with_ck:
            # this chunk's checkpoints, sorted by position (found by the producer, `ck_s`):
            # [m_lo, m_end) end inside the chunk (j < C) and take the checkpoint order below;
            # [m_end, m_hi) at its last token (the chunk's end state, stored after the update)
            m_lo = ck_s[s, 1]
            m_end = ck_s[s, 2]
            m_hi = ck_s[s, 3]
            mid = T.if_then_else(m_end > m_lo, 1, 0)
            if mid == 0:
                for i, j in T.Parallel(BV, K):
                    st[i, j] = st[i, j] * gcl[0]
        else:
            for i, j in T.Parallel(BV, K):
                st[i, j] = st[i, j] * gcl[0]
        if phase_clock:
            if tx == 0:
                ck_head = ck_head + (clock() - ck_t)
                ck_t = clock()
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(ut, num_regs=BV * C // CH)
        # W^T = V^T - U^T diag(gamma)
        if scaled:
            # W^T in fp32 in U^T's registers, each row scaled by a power of two that puts its
            # largest magnitude in [2^7, 2^8) (2^-30 .. 2^30): fp16's range for any |v|
            # (tokens past the sequence's end zeroed: the scale depends on the sequence alone;
            # A_beta's columns there are 0, so vn^T does not change)
            if dual:
                for i, j in T.Parallel(BV, C):
                    ut[i, j] = T.if_then_else(tr, T.float32(0), T.cast(v_s[s, j, i], acc)) - ut[i, j] * gam_f[j]
            else:
                for i, j in T.Parallel(BV, C):
                    ut[i, j] = T.cast(v_s[s, j, i], acc) - ut[i, j] * gam_f[j]
            if c * C + C > seqlen:  # the sequence's last, partial chunk
                for i, j in T.Parallel(BV, C):
                    ut[i, j] = T.if_then_else(c * C + j < seqlen, ut[i, j], T.float32(0))
            T.reduce_absmax(ut, wmax, dim=1)
            for i in T.Parallel(BV):
                wsc[i] = T.max(T.min(T.float32(8) - T.floor(T.log2(T.max(wmax[i], T.float32(1e-30))))
                                     - T.float32(1), T.float32(30)), T.float32(-30))
                wsi[i] = T.exp2(-wsc[i])
                wsc[i] = T.exp2(wsc[i])
            for i, j in T.Parallel(BV, C):
                wt_b[i, j] = T.cast(ut[i, j] * wsc[i], odt)
        elif dual:  # transition CTAs: v = 0
            for i, j in T.Parallel(BV, C):
                wt_b[i, j] = T.cast(
                    T.if_then_else(tr, T.float32(0), T.cast(v_s[s, j, i], acc)) - ut[i, j] * gam_f[j], dtype)
        else:
            for i, j in T.Parallel(BV, C):
                wt_b[i, j] = T.cast(T.cast(v_s[s, j, i], acc) - ut[i, j] * gam_f[j], dtype)
        # vn^T = W^T A_beta^T
        T.wgmma_gemm(wt_b, a_s[s, :, :], nvt, transpose_B=True, clear_accum=True, **chain_kw)
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(nvt, num_regs=BV * C // CH)
        if scaled:
            for i, j in T.Parallel(BV, C):
                nvt_b[i, j] = T.cast(nvt[i, j], odt)  # scaled rows (|.| < 2^15: |A_beta| <= 1)
                vpt_b[i, j] = T.cast(nvt[i, j] * r_f[j] * wsi[i], dtype)
        else:
            for i, j in T.Parallel(BV, C):
                nvt_b[i, j] = T.cast(nvt[i, j], odt)
                vpt_b[i, j] = T.cast(nvt[i, j] * r_f[j], dtype)
        if phase_clock:
            if tx == 0:
                ck_w = ck_w + (clock() - ck_t)
                ck_t = clock()
        if with_ck and mid != 0:
            # publish vn^T first (the output role does not wait for the checkpoints)
            T.barrier_wait(n_empty[s], 1 - ph)
            T.copy(nvt_b, nv_s[s, :, :])
            if scaled:
                for i in T.Parallel(BV):
                    sc_s[s, 0, i] = T.cast(wsc[i], "bfloat16")
                    sc_s[s, 1, i] = T.cast(wsi[i], "bfloat16")
            T.fence_proxy_async()
            T.barrier_arrive(n_full[s])
            # the checkpoints ending inside this chunk (CF-4), from the unscaled S^T
            for m in T.serial(m_lo, m_end):
                jj = positions[m * pos_stride] - (bidx * Tn + bos + c * C)
                if jj >= 1 and jj < C:  # (jj outside 1..63 only for unsorted positions)
                    gj[0] = gc_s[s, jj - 1]
                    if scaled:  # vn^T's rows unscaled (exact: powers of two)
                        for i, t in T.Parallel(BV, C):
                            mvt_b[i, t] = T.cast(
                                T.if_then_else(t < jj, T.cast(nv_s[s, i, t], acc) * wsi[i]
                                               * T.exp2(T.min(gj[0] - gc_s[s, t], T.float32(0))),
                                               T.float32(0)),
                                dtype)
                    else:
                        for i, t in T.Parallel(BV, C):
                            mvt_b[i, t] = T.cast(
                                T.if_then_else(t < jj, T.cast(nv_s[s, i, t], acc)
                                               * T.exp2(T.min(gj[0] - gc_s[s, t], T.float32(0))),
                                               T.float32(0)),
                                dtype)
                    for h in T.unroll(K // KH):
                        for i, j in T.Parallel(BV, KH):
                            ck[i, j] = st[i, h * KH + j] * T.exp2(gj[0])
                        T.wgmma_gemm(mvt_b, k_s[s, :, h * KH : (h + 1) * KH], ck, **chain_kw)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(ck, num_regs=BV * KH // CH)
                        if dual:
                            if tr:
                                store_state(ckp, m, hv, v0, ck, h * KH)
                            else:
                                store_state(ckpt, m, hv, v0, ck, h * KH)
                        else:
                            store_state(ckpt, m, hv, v0, ck, h * KH)
            for i, j in T.Parallel(BV, K):
                st[i, j] = st[i, j] * gcl[0]
            # S^T = gamma_C S^T + (vn^T diag(r)) K
            T.wgmma_gemm(vpt_b, k_s[s, :, :], st, **chain_kw)
        else:
            T.wgmma_gemm(vpt_b, k_s[s, :, :], st, **chain_kw)
            T.barrier_wait(n_empty[s], 1 - ph)
            T.copy(nvt_b, nv_s[s, :, :])
            if scaled:
                for i in T.Parallel(BV):
                    sc_s[s, 0, i] = T.cast(wsc[i], "bfloat16")
                    sc_s[s, 1, i] = T.cast(wsi[i], "bfloat16")
            T.fence_proxy_async()
            T.barrier_arrive(n_full[s])
        T.wait_wgmma(0)
        T.warpgroup_fence_operand(st, num_regs=BV * K // CH)
        if with_ck:
            # checkpoints at the chunk's last token: its end state, just computed
            for m in T.serial(m_end, m_hi):
                if dual:
                    if tr:
                        store_state(ckp, m, hv, v0, st, 0)
                    else:
                        store_state(ckpt, m, hv, v0, st, 0)
                else:
                    store_state(ckpt, m, hv, v0, st, 0)
        T.barrier_arrive(empty[s])
        if phase_clock:
            if tx == 0:
                ck_tail = ck_tail + (clock() - ck_t)

    @T.macro
    def chain_walk(b, nwalk, cv):
        """The chain over the sequence's chunks. With checkpoints, the chunks without one run the plain
        chain (the inner loop) and a chunk that holds one runs the checkpoint order. The producer hands
        over with each chunk c (`ck_s`, under its `full` barrier) the first chunk >= c that holds a
        checkpoint: at a run's first chunk the chain waits for that chunk's loads (a wait the chunk's
        own then passes at once) and reads it. No global read on the chain's path."""
        if checkpoints:
            full, ck_s = b.full, b.ck_s
            c_nx = T.alloc_var("int32")  # the next chunk >= cb that holds a checkpoint (nwalk: none)
            c_at = T.alloc_var("int32")
            cb = T.alloc_var("int32")
            cb = 0
            while cb < nwalk:
                T.barrier_wait(full[cb % 2], (cb // 2) % 2)
                c_nx = ck_s[cb % 2, 0]
                for c in T.serial(cb, c_nx):
                    chain_chunk(b, c, False, *cv)
                if c_nx < nwalk:
                    c_at = c_nx
                    chain_chunk(b, c_at, True, *cv)
                    cb = c_at + 1
                else:
                    cb = nwalk
        else:
            if BV == 64 and nwalk > 0:
                T.barrier_wait(b.full[0], 0)  # chunk 0's loads waited for before the loop, as the plain build's
            for c in T.serial(nwalk):
                chain_chunk(b, c, False, *cv)

    @T.macro
    def chain_clock_start(cv):
        ck_t = cv[5]
        ck_wait = cv[6]
        ck_head = cv[7]
        ck_w = cv[8]
        ck_tail = cv[9]
        ck_wait = 0
        ck_head = 0
        ck_w = 0
        ck_tail = 0
        ck_t = clock()

    @T.macro
    def chain_clock_store(clocks, bx, nwalk, tx, cv):
        ck_wait = cv[6]
        ck_head = cv[7]
        ck_w = cv[8]
        ck_tail = cv[9]
        if tx == 0:
            clocks[bx, 0] = T.cast(nwalk, "int64")
            clocks[bx, 1] = ck_wait
            clocks[bx, 2] = ck_head
            clocks[bx, 3] = ck_w
            clocks[bx, 4] = ck_tail

    @T.prim_func
    def gdn_recurrent_serving_fwd(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, HV, V), dtype),
        A: T.Tensor((HV, R, C), odt),
        g_cum_log2: T.Tensor((HV, R), "float32"),
        h0: T.Tensor((N0, HV, sa, sb), sdt),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        scale: T.float32,
        use_h0: T.int32,
        store_ht: T.int32,
        o: T.Tensor((B, Tn, HV, V), dtype),
        ht: T.Tensor((N1, HV, sa, sb), sdt),
        rows: T.Tensor((NI,), "int32"),
        rows_stride: T.int32,
        has_init: T.Tensor((NH,), "uint8"),
        use_has: T.int32,
        positions: T.Tensor((MP,), "int32"),
        pos_stride: T.int32,
        n_ckpt: T.int32,
        ckpt: T.Tensor((MC, HV, sa, sb), sdt),
        u: T.Tensor(u_shape, dtype),
        pt: T.Tensor(pt_shape, "float32"),
        limit: T.Tensor(lim_shape, "int32"),
        ckp: T.Tensor(ckp_shape, sdt),
        clocks: clock_arg,
    ):
        with T.Kernel(ncta * (2 if dual else 1), threads=threads) as (bx,):
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
            nwalk = nloop if dual else nchunks
            hk = hv // G
            v0 = iv * BV
            tx = T.get_thread_binding()

            q_s = T.alloc_shared((2, C, K), dtype)
            k_s = T.alloc_shared((2, C, K), dtype)
            v_s = T.alloc_shared((2, C, BV), dtype)
            a_s = T.alloc_shared((2, C, C), odt)
            gc_s = T.alloc_shared((2, C), acc)
            sb_s = T.alloc_shared((2, BV, K), dtype)
            nv_s = T.alloc_shared((2, BV, C), odt)
            if scaled:
                # vn^T's row scales of chunk c and their inverses (chain -> output): powers of two, exact in bf16
                sc_s = T.alloc_shared((2, 2, BV), "bfloat16")
            o_s = T.alloc_shared((C, BV), dtype)
            if checkpoints:
                # per chunk, from the producer under full[s]: the first chunk >= c holding a checkpoint,
                # then the chunk's range: [lo, end) end inside the chunk, [end, hi) at its last token
                ck_s = T.alloc_shared((2, 4), "int32")
            T.annotate_layout({v_s: make_swizzled_layout(v_s), o_s: make_swizzled_layout(o_s)})

            full = T.alloc_barrier(arrive_count=[32, 32])
            empty = T.alloc_barrier(arrive_count=[CH + 128, CH + 128])
            s_full = T.alloc_barrier(arrive_count=[CH, CH])
            s_empty = T.alloc_barrier(arrive_count=[128, 128])
            n_full = T.alloc_barrier(arrive_count=[CH, CH])
            n_empty = T.alloc_barrier(arrive_count=[128, 128])

            if tx < CH:
                # ------------------------------------------------------------------ chain
                T.set_max_nreg(nreg["chain"], 1)
                st = T.alloc_fragment((BV, K), acc)
                st_b = T.alloc_fragment((BV, K), dtype)
                ut = T.alloc_fragment((BV, C), acc)
                nvt = T.alloc_fragment((BV, C), acc)
                wt_b = T.alloc_fragment((BV, C), odt)
                nvt_b = T.alloc_fragment((BV, C), odt)
                vpt_b = T.alloc_fragment((BV, C), dtype)
                gam_f = T.alloc_fragment((C,), acc)
                r_f = T.alloc_fragment((C,), acc)
                gcl = T.alloc_local((1,), acc)
                if scaled:
                    wmax = T.alloc_fragment((BV,), acc)
                    wsc = T.alloc_fragment((BV,), acc)
                    wsi = T.alloc_fragment((BV,), acc)  # 1 / wsc (exact: powers of two)
                if checkpoints:
                    ck = T.alloc_fragment((BV, KH), acc)  # one half of the checkpoint's columns
                    mvt_b = T.alloc_fragment((BV, C), dtype)
                    gj = T.alloc_local((1,), acc)
                row = T.alloc_var("int32")  # the sequence's state row (read and written)
                row_in = T.alloc_var("int32")  # the row read: -1 where has_initial_state is False
                row = n
                if rows_stride != 0:
                    row = rows[n * rows_stride]  # an int64 index's low word
                    if rows_stride == 2:
                        if rows[n * 2 + 1] != 0:
                            row = -1  # negative, or past 2^31 (no pool has such a row): nothing read or written
                row_in = row
                if use_has != 0:
                    if has_init[n] == 0:
                        row_in = -1
                if dual:
                    if tr:  # the transition walks from I (from 0 where the slot is not corrected)
                        for i, j in T.Parallel(BV, K):
                            st[i, j] = T.if_then_else(v0 + i == j, T.if_then_else(lim > 0, T.float32(1), T.float32(0)),
                                                      T.float32(0))
                    elif use_h0 != 0 and row_in >= 0:
                        load_state(st, h0, row_in, hv, v0)
                    else:
                        T.clear(st)
                elif use_h0 != 0 and row_in >= 0:
                    load_state(st, h0, row_in, hv, v0)
                else:
                    T.clear(st)
                b = _ChainArgs(
                    st=st, st_b=st_b, ut=ut, nvt=nvt, wt_b=wt_b, nvt_b=nvt_b, vpt_b=vpt_b, gam_f=gam_f,
                    r_f=r_f, gcl=gcl, k_s=k_s, v_s=v_s, a_s=a_s, gc_s=gc_s, sb_s=sb_s, nv_s=nv_s,
                    full=full, empty=empty, s_full=s_full, s_empty=s_empty, n_full=n_full, n_empty=n_empty,
                    hv=hv, v0=v0, bidx=bidx, bos=bos, seqlen=seqlen, tx=tx, positions=positions,
                    pos_stride=pos_stride, n_ckpt=n_ckpt, ckpt=ckpt, ckp=ckp)
                if scaled:
                    b = _ChainArgs(b, sc_s=sc_s, wmax=wmax, wsc=wsc, wsi=wsi)
                if dual:
                    b = _ChainArgs(b, tr=tr)
                if checkpoints:
                    b = _ChainArgs(b, ck=ck, mvt_b=mvt_b, gj=gj, ck_s=ck_s)
                cv = _chain_vars(checkpoints, phase_clock)  # the variables chain_chunk assigns
                if phase_clock:
                    chain_clock_start(cv)
                chain_walk(b, nwalk, cv)
                if phase_clock:
                    chain_clock_store(clocks, bx, nwalk, tx, cv)
                if dual:
                    if tr:  # the transition P, or 0 where it was cut short
                        for i, j in T.Parallel(BV, K):
                            pt[n, hv, j, v0 + i] = T.if_then_else(nloop == nchunks, st[i, j], T.float32(0))
                    elif store_ht != 0 and row >= 0:
                        store_state(ht, row, hv, v0, st, 0)
                elif store_ht != 0 and row >= 0:
                    store_state(ht, row, hv, v0, st, 0)
            elif tx < CH + 128:
                # ------------------------------------------------------------------ output
                T.set_max_nreg(nreg["output"], 1)
                p_f = T.alloc_fragment((C, C), acc)
                pg_b = T.alloc_fragment((C, C), odt)
                of = T.alloc_fragment((C, BV), acc)
                gr_f = T.alloc_fragment((C,), acc)
                for c in T.serial(nwalk):
                    s = c % 2
                    ph = (c // 2) % 2
                    t0 = bos + c * C
                    T.barrier_wait(full[s], ph)
                    T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True, clear_accum=True)
                    T.barrier_wait(s_full[s], ph)
                    T.wgmma_gemm(q_s[s, :, :], sb_s[s, :, :], of, transpose_B=True, clear_accum=True)
                    for t in T.Parallel(C):
                        gr_f[t] = scale * T.exp2(gc_s[s, t])
                    T.wait_wgmma(1)
                    T.warpgroup_fence_operand(p_f, num_regs=C * C // 128)
                    for t, j in T.Parallel(C, C):
                        pg_b[t, j] = T.cast(
                            T.if_then_else(
                                t >= j,
                                scale * p_f[t, j] * T.exp2(T.if_then_else(t >= j, gc_s[s, t] - gc_s[s, j], T.float32(0))),
                                T.float32(0),
                            ),
                            odt,
                        )
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(of, num_regs=C * BV // 128)
                    T.barrier_arrive(s_empty[s])
                    if scaled:
                        # O += Pg vn with vn^T's rows scaled: O's columns scaled alike around the product
                        T.barrier_wait(n_full[s], ph)
                        for t, i in T.Parallel(C, BV):
                            of[t, i] = of[t, i] * gr_f[t] * T.cast(sc_s[s, 0, i], acc)
                        T.wgmma_gemm(pg_b, nv_s[s, :, :], of, transpose_B=True)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(of, num_regs=C * BV // 128)
                        for t, i in T.Parallel(C, BV):
                            of[t, i] = of[t, i] * T.cast(sc_s[s, 1, i], acc)
                    else:
                        for t, i in T.Parallel(C, BV):
                            of[t, i] = of[t, i] * gr_f[t]
                        T.barrier_wait(n_full[s], ph)
                        T.wgmma_gemm(pg_b, nv_s[s, :, :], of, transpose_B=True)
                        T.wait_wgmma(0)
                        T.warpgroup_fence_operand(of, num_regs=C * BV // 128)
                    T.barrier_arrive(n_empty[s])
                    T.barrier_arrive(empty[s])
                    nvalid = T.min(seqlen - c * C, C)
                    for t, i in T.Parallel(C, BV):
                        o_s[t, i] = T.cast(of[t, i], dtype)
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
            else:
                # ------------------------------------------------------------------ producer
                T.set_max_nreg(nreg["producer"], 0)
                if tx < CH + 128 + 32:
                    if checkpoints:
                        # the sequence's first checkpoint, then each chunk's range (`CheckpointRanges`)
                        ranges = CheckpointRanges(positions, pos_stride, n_ckpt, tx - (CH + 128), bidx * Tn + bos,
                                                  seqlen)
                        p_nx = T.alloc_var("int32")
                    if phase_clock:
                        pk_t = T.alloc_var("int64")
                        pk_wait = T.alloc_var("int64")
                        pk_work = T.alloc_var("int64")
                        pk_wait = 0
                        pk_work = 0
                        pk_t = clock()
                    for c in T.serial(nwalk):
                        s = c % 2
                        ph = (c // 2) % 2
                        t0 = bos + c * C
                        row0 = (slot0 + c) * C
                        if phase_clock:
                            if tx == CH + 128:
                                pk_t = clock()
                        T.barrier_wait(empty[s], 1 - ph)
                        if phase_clock:
                            if tx == CH + 128:
                                pk_wait = pk_wait + (clock() - pk_t)
                                pk_t = clock()
                        T.tma_copy(q[bidx, t0 : t0 + C, hk, 0:K], q_s[s, :, :], barrier=full[s])
                        T.tma_copy(k[bidx, t0 : t0 + C, hk, 0:K], k_s[s, :, :], barrier=full[s])
                        T.tma_copy(v[bidx, t0 : t0 + C, hv, v0 : v0 + BV], v_s[s, :, :], barrier=full[s])
                        T.tma_copy(A[hv, row0 : row0 + C, 0:C], a_s[s, :, :], barrier=full[s])
                        T.tma_copy(g_cum_log2[hv, row0 : row0 + C], gc_s[s, :], barrier=full[s])
                        if checkpoints:
                            # the chunk's checkpoint range, off the chain's path (read here while the
                            # chunk's loads are in flight, two chunks ahead of the chain)
                            p_lo, p_end, p_hi = ranges.chunk(c)
                            # and the first chunk >= c that holds one: the chunk of checkpoint p_lo's token
                            # p - 1 where it is in this sequence (the chain's runs of plain chunks end there)
                            p_nx = nwalk
                            if p_lo < n_ckpt:
                                if positions[p_lo * pos_stride] <= bidx * Tn + bos + seqlen:
                                    p_nx = T.max(T.min((positions[p_lo * pos_stride] - 1 - (bidx * Tn + bos)) // C,
                                                       nwalk), c)
                            if tx == CH + 128:
                                ck_s[s, 0] = p_nx
                                ck_s[s, 1] = p_lo
                                ck_s[s, 2] = p_end
                                ck_s[s, 3] = p_hi
                        T.barrier_arrive(full[s])
                        if phase_clock:
                            if tx == CH + 128:
                                pk_work = pk_work + (clock() - pk_t)
                    if phase_clock:
                        if tx == CH + 128:
                            clocks[bx, 5] = pk_wait
                            clocks[bx, 6] = pk_work

    return gdn_recurrent_serving_fwd


@functools.lru_cache(maxsize=None)
def build_recurrent_kernel(H: int, HV: int, K: int, V: int, BV: int, dtype: str, seq_dtype: str, varlen: bool,
                           dual: bool = False, op_dtype: str | None = None, *, indexed: bool = False,
                           state_dtype: str = "float32", state_layout: str = "kv", checkpoints: bool = False):
    """Compiled recurrent kernel for one static configuration (cached).

    Static key: head counts, head dims, the value slice width BV (64 or 128), the input dtype,
    cu_seqlens' dtype, whether input is packed (varlen) and whether it is the split path's dual launch
    (run and transition in one grid, `chunk_recurrent_dual`; K == V). T, B, the number of sequences,
    the scale, the initial/final-state switches and the transition limits are run-time values.

    Serving options (keyword-only; `recurrent_serving_args` gives the key of a call): indexed=True
    builds the serving kernel (`chunk_recurrent_serving`: states read and written by row index, in
    `state_layout` "kv" ([.., K, V]) or "vk" ([.., V, K]) and `state_dtype` "float32" / "bfloat16" /
    "float16"; with `checkpoints`, the states after any token stored in-kernel, record CF-4). The
    default options build the plain kernel, whose generated source is unchanged by their existence.

    op_dtype: the dtype of A_beta and of the products that read it (`_recurrent_prim_func`,
    `_serving_prim_func`), in every build: None or the input dtype (the training forward's build), or
    "float16" for bf16 input (the inference forward's fp16 A_beta product, W^T's rows scaled by
    powers of two; `flashqla.ops.gdn.fwd.product_dtype`).

    dual with indexed (`chunk_recurrent_dual_checkpoints`): the split path's dual launch storing the
    run's and the transition's checkpoints; only with checkpoints, state_dtype "float32" and "kv".

    Raises ValueError for another BV, dual with K != V, dual with indexed other than that, serving
    options without indexed, or an unknown state dtype or layout.
    """
    if V % BV or BV not in ROLES_WIDTHS:
        raise ValueError(f"value slice width BV must be 64 or 128 and divide V = {V}, got {BV}")
    if dual and K != V:
        raise ValueError(f"the dual launch needs K == V, got K={K}, V={V}")
    if state_dtype not in SERVING_STATE_DTYPES:
        raise ValueError(f"state_dtype must be one of {SERVING_STATE_DTYPES}, got {state_dtype!r}")
    if state_layout not in SERVING_LAYOUTS:
        raise ValueError(f"state_layout must be one of {SERVING_LAYOUTS}, got {state_layout!r}")
    if not indexed:
        if state_dtype != "float32" or state_layout != "kv" or checkpoints:
            raise ValueError("state_dtype, state_layout and checkpoints are options of the serving build: pass indexed=True")
    elif dual and not (checkpoints and state_dtype == "float32" and state_layout == "kv"):
        raise ValueError("the dual launch's serving build stores checkpoints in fp32 'kv' states only: pass "
                         "checkpoints=True, state_dtype='float32', state_layout='kv' with dual and indexed")
    name = (f"gdn_recurrent_fwd_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{seq_dtype}_{int(varlen)}_BV{BV}"
            + ("_dual" if dual else ""))
    op = op_dtype is not None and op_dtype != dtype
    if indexed:
        name += f"_serving_{state_dtype}_{state_layout}" + ("_ckpt" if checkpoints else "")
        if op:
            return compile_kernel(_serving_prim_func(H, HV, K, V, dtype, seq_dtype, varlen, BV, state_dtype, state_layout,
                                                     checkpoints, dual, op_dtype), name + f"_op{op_dtype}")
        return compile_kernel(_serving_prim_func(H, HV, K, V, dtype, seq_dtype, varlen, BV, state_dtype, state_layout,
                                                 checkpoints, dual), name)
    if op:
        return compile_kernel(_recurrent_prim_func(H, HV, K, V, dtype, seq_dtype, varlen, dual, BV, op_dtype),
                              name + f"_op{op_dtype}")
    return compile_kernel(_recurrent_prim_func(H, HV, K, V, dtype, seq_dtype, varlen, dual, BV), name)


def build_recurrent_serving_kernel(H: int, HV: int, K: int, V: int, BV: int, dtype: str, seq_dtype: str, varlen: bool,
                                   state_dtype: str = "float32", state_layout: str = "kv", checkpoints: bool = False,
                                   dual: bool = False, op_dtype: str | None = None):
    """`build_recurrent_kernel(..., dual, op_dtype, indexed=True, state_dtype=, state_layout=,
    checkpoints=)` with every key entry positional (the registry's kind "recurrent_serving"). Called
    as the launchers call it (dual and op_dtype passed only where they differ from the defaults), so
    that both hit one `functools.lru_cache` entry."""
    op = op_dtype is not None and op_dtype != dtype
    pos = (dual, op_dtype) if op else ((True,) if dual else ())
    return build_recurrent_kernel(H, HV, K, V, BV, dtype, seq_dtype, varlen, *pos, indexed=True,
                                  state_dtype=state_dtype, state_layout=state_layout, checkpoints=checkpoints)


@functools.lru_cache(maxsize=None)
def build_recurrent_serving_kernel_clocked(H: int, HV: int, K: int, V: int, BV: int, dtype: str, seq_dtype: str,
                                           varlen: bool, state_dtype: str = "float32", state_layout: str = "kv",
                                           checkpoints: bool = False):
    """The phase-clock build of the serving kernel (a measurement tool, never launched by the op:
    `benchmarks/experiments/serving_chain_clock.py`): `build_recurrent_serving_kernel`'s kernel for the
    same key (not dual, the input dtype's products) with one more argument after ckp, clocks [CTAs,
    len(SERVING_CLOCKS)] int64 (`_serving_prim_func`'s phase_clock): the same outputs bit for bit."""
    if V % BV or BV not in ROLES_WIDTHS:
        raise ValueError(f"value slice width BV must be 64 or 128 and divide V = {V}, got {BV}")
    name = (f"gdn_recurrent_fwd_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{seq_dtype}_{int(varlen)}_BV{BV}"
            f"_serving_{state_dtype}_{state_layout}" + ("_ckpt" if checkpoints else "") + "_clock")
    return compile_kernel(_serving_prim_func(H, HV, K, V, dtype, seq_dtype, varlen, BV, state_dtype, state_layout,
                                             checkpoints, phase_clock=True), name)


#: Relative chunk-step time per CTA (one CTA an SM) by value slice width, as measured on the H200
#: (benchmarks/journal/forward.md); only their ratio is used (`pick_block_v`).
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


def recurrent_kernel_args(q, v, cu_seqlens, block_v=None, dual: bool = False, a_dtype: torch.dtype | None = None) -> tuple:
    """The static key (`build_recurrent_kernel` arguments) a launch with these inputs uses, A in
    `a_dtype` (None: q's): the plain key has eight entries; the dual launch's ends with True; an A
    dtype other than q's (the fp16 A_beta product) adds (dual, op_dtype)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.numel() - 1 if cu_seqlens is not None else B
    BV = block_v or pick_block_v(N, HV, V)
    seq_dtype = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
    key = (H, HV, K, V, BV, tl_dtype(q.dtype), seq_dtype, cu_seqlens is not None)
    if a_dtype is not None and a_dtype != q.dtype:
        return key + (bool(dual), tl_dtype(a_dtype))
    return key + (True,) if dual else key


def chunk_recurrent_fwd(q, k, v, A, g_cum_log2, scale: float, initial_state, output_final_state: bool, cu_seqlens, block_v=None, o=None, final_state=None):
    """Launches the recurrent kernel (arguments validated by the caller).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (bf16 or fp16, contiguous).
        A, g_cum_log2: outputs of `chunk_prepare_fwd` for the same inputs (A in q's dtype, or fp16
            for bf16 q: the fp16 A_beta product build).
        scale: output scale (float).
        initial_state: [N, HV, K, V] fp32 contiguous, or None (zeros).
        output_final_state: whether to return the state after each sequence.
        cu_seqlens: [N + 1] int32/int64 or None.
        block_v: value slice width (None: `pick_block_v`).
        o, final_state: optional preallocated outputs of the shapes below (tests poison them).

    Returns:
        o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] fp32 or None. With cu_seqlens and no
        `o` given, o is allocated zero-filled (one memset of o): the rows of tokens past
        cu_seqlens[-1] (device offsets that end before T, which no CTA writes) read as zeros. The
        op's backend passes o instead (`packed_tail.new_output`: those rows zeroed by a launch that
        writes them only).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    if o is None:  # packed: zeros, so that rows past a device cu_seqlens[-1] < T are never stale memory
        o = torch.zeros_like(v) if varlen else torch.empty_like(v)
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
    kernel = build_recurrent_kernel(*recurrent_kernel_args(q, v, cu_seqlens, block_v, a_dtype=A.dtype))
    u, pt, lim = (placeholder((1,), dt, q.device) for dt in (q.dtype, torch.float32, torch.int32))
    kernel(q, k, v, A, g_cum_log2, h0, cu, float(scale), int(use_h0), int(output_final_state), o, ht_arg, u, pt, lim)
    return o, ht


def chunk_recurrent_dual(q, k, v, A, g_cum_log2, scale: float, initial_state, limit, cu_seqlens, block_v=None, o=None):
    """The split path's run and transition launches as one launch (K == V; arguments validated by
    the caller; `flashqla.cp.forward`).

    Run CTAs: the plain kernel from `initial_state` (zeros when None) -> o and the end states Q.
    Transition CTAs, per (sequence, value head): v = 0, started from I where limit > 0 (else from 0),
    min(chunks, limit) chunks walked -> U (rows of the chunks walked; other rows are left unwritten)
    and P (the end state, or 0 where the walk was cut short: the gate-driven truncation, records
    CP-4 / CP-5, `flashqla.cp.forward.transition_limits`).

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
    if o is None:  # packed: zeros, as `chunk_recurrent_fwd`'s
        o = torch.zeros_like(v) if varlen else torch.empty_like(v)
    else:
        _check_out(o, v)
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
    kernel = build_recurrent_kernel(*recurrent_kernel_args(q, v, cu_seqlens, block_v, dual=True, a_dtype=A.dtype))
    kernel(q, k, v, A, g_cum_log2, h0, cu, float(scale), int(use_h0), 1, o, Q, U, P, limit.contiguous())
    return o, Q, U, P


def recurrent_serving_args(q, v, cu_seqlens, state_dtype: torch.dtype, state_layout: str, checkpoints: bool,
                           block_v=None, a_dtype: torch.dtype | None = None) -> tuple:
    """(args, kwargs) of the serving build (`build_recurrent_kernel(*args, indexed=True, ...)`) a
    `chunk_recurrent_serving` launch with these inputs (A in `a_dtype`, None: q's) uses."""
    key = recurrent_kernel_args(q, v, cu_seqlens, block_v, a_dtype=a_dtype)
    return key, dict(indexed=True, state_dtype=tl_dtype(state_dtype), state_layout=state_layout,
                     checkpoints=bool(checkpoints))


def serving_spec_args(args: tuple, kw: dict) -> tuple:
    """The registry's positional "recurrent_serving" key (`build_recurrent_serving_kernel`) of
    `recurrent_serving_args`' (args, kwargs)."""
    return args[:8] + (kw["state_dtype"], kw["state_layout"], kw["checkpoints"]) + tuple(args[8:])


def _int32_words(x: torch.Tensor) -> tuple:
    """(int32 tensor, stride) of an int32 / int64 index vector without a copy where it is contiguous:
    an int64 vector is read through its words (entry n: low word at 2n, high word at 2n + 1). The
    kernel takes a state index as a row only when its high word is 0 (else no read or write, as for
    -1) and a position by its low word (exact below 2^31, every position of a batch below 2^31 tokens;
    positions are sorted and inside a sequence by the caller's contract)."""
    x = x.contiguous()
    if x.dtype == torch.int64:
        return x.view(torch.int32), 2
    return x, 1


def chunk_recurrent_serving(q, k, v, A, g_cum_log2, scale: float, initial_state, final_state, state_indices,
                            has_initial_state, cu_seqlens, *, state_layout: str = "kv", checkpoint_positions=None,
                            checkpoint_states=None, block_v=None, o=None, clocks=None):
    """Launches the recurrent kernel's serving build (arguments validated by the caller;
    `flashqla.ops.gdn.serving`): o, and the final states and checkpoints written in place in their
    layout and storage dtype (one rounding, at the store). One launch, no host read, no table
    launch: the kernel reads the indices, has_initial_state and the positions as they are.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (bf16 or fp16, contiguous); A, g_cum_log2: `chunk_prepare_fwd`.
        scale: output scale.
        initial_state: [P, HV, K, V] ("kv") or [P, HV, V, K] ("vk") in fp32/bf16/fp16, contiguous, or
            None (every sequence starts from zeros).
        final_state: like initial_state (it may be the same tensor: a pool updated in place) or None
            (no final state stored).
        state_indices: int32/int64 [N] or None. Sequence n reads and writes row state_indices[n] (row n
            without it); a negative row is neither read nor written.
        has_initial_state: bool [N] or None; False: sequence n starts from zeros (its row is still written).
        cu_seqlens: [N + 1] int32/int64 or None.
        state_layout: "kv" or "vk", of every state tensor.
        checkpoint_positions: int32/int64 [M] sorted global positions (each inside a sequence) or None;
        checkpoint_states: [M, HV, ...] in the states' layout and dtype, written in place (record CF-4).
        block_v: value slice width (None: `pick_block_v`). o: optional preallocated output (the
            packed tokens after cu_seqlens[-1] are written by no CTA: the caller zeroes them).
        clocks: None, or an int64 [CTAs, len(SERVING_CLOCKS)] tensor: launch the phase-clock build
            (`build_recurrent_serving_kernel_clocked`; a measurement tool) and fill it.

    Returns: o [B, T, HV, V]. Raises ValueError when the state tensors do not share one storage dtype
    or are not contiguous.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu_seqlens.numel() - 1 if cu_seqlens is not None else B
    o = torch.empty_like(v) if o is None else _check_out(o, v)
    states = {n: x for n, x in (("initial_state", initial_state), ("final_state", final_state),
                                ("checkpoint_states", checkpoint_states)) if x is not None}
    dtypes = {x.dtype for x in states.values()}
    if len(dtypes) > 1:
        raise ValueError(f"the serving build stores one state dtype: got {', '.join(f'{n} {x.dtype}' for n, x in states.items())}")
    for name, x in states.items():
        if not x.is_contiguous():
            raise ValueError(f"{name} must be contiguous for the serving build")
    sdtype = dtypes.pop() if dtypes else torch.float32
    tail = (K, V) if state_layout == "kv" else (V, K)
    if N == 0 or T == 0:
        raise ValueError("chunk_recurrent_serving needs at least one sequence and one token (the caller handles T == 0)")
    ckpt = checkpoint_positions is not None and checkpoint_positions.numel() > 0
    args, kw = recurrent_serving_args(q, v, cu_seqlens, sdtype, state_layout, ckpt, block_v, A.dtype)
    if clocks is None:
        kernel = build_recurrent_kernel(*args, **kw)
    else:
        if len(args) > 8 or kw.get("indexed") is not True:
            raise ValueError("clocks: the phase-clock build has no fp16 A_beta product")
        ncta = (V // args[4]) * HV * N
        if (clocks.dtype != torch.int64 or clocks.device != q.device or clocks.dim() != 2 or not clocks.is_contiguous()
                or clocks.shape[0] < ncta or clocks.shape[1] != len(SERVING_CLOCKS)):
            raise ValueError(f"clocks must be a contiguous int64 tensor on {q.device} of shape [>= {ncta}, "
                             f"{len(SERVING_CLOCKS)}], got {clocks.dtype} {tuple(clocks.shape)} on {clocks.device}")
        kernel = build_recurrent_serving_kernel_clocked(*args, state_dtype=kw["state_dtype"],
                                                        state_layout=kw["state_layout"], checkpoints=kw["checkpoints"])
    dev = q.device
    h0 = initial_state if initial_state is not None else placeholder((1, HV, *tail), sdtype, dev)
    ht = final_state if final_state is not None else placeholder((1, HV, *tail), sdtype, dev)
    cu = cu_seqlens if cu_seqlens is not None else placeholder((1,), torch.int32, dev)
    if state_indices is not None:
        rows, rows_stride = _int32_words(state_indices)
    else:
        rows, rows_stride = placeholder((1,), torch.int32, dev), 0
    has = (has_initial_state.contiguous().view(torch.uint8) if has_initial_state is not None
           else placeholder((1,), torch.uint8, dev))
    if ckpt:
        pos, pos_stride = _int32_words(checkpoint_positions)
        M, cks = checkpoint_positions.shape[0], checkpoint_states
    else:
        pos, pos_stride, M = placeholder((1,), torch.int32, dev), 1, 0
        cks = placeholder((1, HV, *tail), sdtype, dev)
    one = placeholder((1,), torch.int32, dev)
    kernel(q, k, v, A, g_cum_log2, h0, cu, float(scale), int(initial_state is not None), int(final_state is not None), o,
           ht, rows, rows_stride, has, int(has_initial_state is not None), pos, pos_stride, M, cks,
           placeholder((1,), q.dtype, dev), placeholder((1,), torch.float32, dev), one, placeholder((1,), sdtype, dev),
           *(() if clocks is None else (clocks,)))
    return o


def chunk_recurrent_dual_checkpoints(q, k, v, A, g_cum_log2, scale: float, initial_state, limit, cu_seqlens, positions,
                                     block_v=None, o=None):
    """`chunk_recurrent_dual` that also stores, for every checkpoint position, the run's state and the
    transition's state there (one launch: the serving build with dual; the split path with checkpoints,
    `flashqla.cp.forward.cp_forward`; arguments validated by the caller).

    Position p (a global token offset, sorted, each inside one of the launch's pseudo sequences, the
    segment j with start_j < p <= end_j) gives CQ[m] = the run's state after the tokens [start_j, p)
    (from initial_state[j], zeros without it) and CP[m] = the product of the per-token transitions over
    the same tokens (the transition walked from I with v = 0), or 0 where that transition is not walked
    that far (limit[j, hv] chunks: 0 on uncorrected slots, or the gate-driven cut). The state after p
    tokens of the real sequence is then CQ[m] + CP[m] S_in(j) (records CP-1, CF-4), S_in(j) the
    segment's entering state.

    Args: as `chunk_recurrent_dual`, plus positions: int32/int64 [M] (M >= 1).
    Returns: (o, Q, U, P, CQ [M, HV, K, V] fp32, CP [M, HV, K, K] fp32).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if V != K:
        raise ValueError(f"the dual launch needs K == V, got K={K}, V={V}")
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    M = positions.shape[0]
    if tuple(limit.shape) != (N, HV) or limit.dtype != torch.int32:
        raise ValueError(f"limit must be int32 of shape {(N, HV)}, got {limit.dtype} {tuple(limit.shape)}")
    if N == 0 or T == 0 or M == 0:
        raise ValueError("chunk_recurrent_dual_checkpoints needs a sequence, a token and a checkpoint")
    dev = q.device
    if o is None:
        o = torch.zeros_like(v) if varlen else torch.empty_like(v)
    else:
        _check_out(o, v)
    U = torch.empty(B, T, HV, K, dtype=q.dtype, device=dev)
    Q = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    P = torch.empty(N, HV, K, K, dtype=torch.float32, device=dev)
    CQ = torch.empty(M, HV, K, V, dtype=torch.float32, device=dev)  # every run CTA walks its whole segment
    CP = torch.zeros(M, HV, K, K, dtype=torch.float32, device=dev)  # not stored past a limit
    use_h0 = initial_state is not None
    h0 = initial_state if use_h0 else placeholder((1, HV, K, V), torch.float32, dev)
    cu = cu_seqlens if varlen else placeholder((1,), torch.int32, dev)
    kernel = build_recurrent_kernel(*recurrent_kernel_args(q, v, cu_seqlens, block_v, dual=True, a_dtype=A.dtype),
                                    indexed=True,
                                    state_dtype="float32", state_layout="kv", checkpoints=True)
    pos, pos_stride = _int32_words(positions)
    kernel(q, k, v, A, g_cum_log2, h0, cu, float(scale), int(use_h0), 1, o, Q, placeholder((1,), torch.int32, dev), 0,
           placeholder((1,), torch.uint8, dev), 0, pos, pos_stride, M, CQ, U, P, limit.contiguous(), CP)
    return o, Q, U, P, CQ, CP

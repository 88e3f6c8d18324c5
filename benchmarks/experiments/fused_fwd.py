"""Question: can one kernel do the unsplit inference forward (the prepare kernel's work and the
recurrent kernel's) faster than the two launches, where sequences x value heads fill the GPU?

An experiment, not the package's code (`benchmarks/journal/forward.md`, entries "The fused forward,
second draft" and "The prepare kernel's L tile formed in registers", the third draft). One CTA of 512 threads per (sequence, value head), BV = 128 (the
whole value width), four warpgroups:

    chain  (threads 0-255)   two warpgroups, each owning 64 value rows of S^T [V, K] fp32 in
                             registers; per chunk c:
                               U^T = S^T K^T and O^T = S^T Q^T        (two wgmmas, A = bf16 S^T in registers)
                               W^T = V^T - U^T diag(gamma);  vn^T = W^T A_beta^T
                               S^T = gamma_C S^T + (vn^T diag(r)) K;  O^T = scale diag(gamma) O^T + vn^T Pg^T
                               o <- O^T (through a shared tile, rows inside the sequence)
    aux    (threads 256-383) one chunk ahead of the chain: K K^T, L, A = (I + L)^-1 and A diag(beta) by
                             the prepare kernel's own stages (`prepare.value_head_stages`: the inverse
                             by recursive doubling in fp16 with warp mma.sync), Pg = scale
                             (Q K^T * Gamma) causal (in a bf16 fragment, one copy); into two-stage
                             shared rings the chain reads (A_beta, Pg)
    producer (384-511)       warp 0: TMA loads of q, k, v into a two-stage ring; warp 1: g and beta of
                             the chunk, g_cum_log2 (chunk-local cumsum of g / ln 2, a shuffle scan)
                             into the same ring

So A_beta and g_cum_log2 never go through HBM, and the output role of the recurrent kernel is
folded into the chain warpgroups (FlashInfer's split of the work; registers 192 / 192 / 104 / 24).
Build "2" (`_fused2_prim_func`, entry "The fused forward with two aux warpgroups") gives the aux work
two warpgroups taking alternate chunks (512 threads, no producer warpgroup); "2h" is "2" with the A_beta and output products'
operands in fp16; "2m" and "2hm" form the inverse's first level by products (WY-6).
Same arithmetic as the two launches except where the order of the output's two terms differs (O^T
is formed transposed): o is compared with the two launches' and with the fp64 recurrence, not bit
for bit.

    python benchmarks/experiments/fused_fwd.py [--rows "16/32 4x8192,16/64 4x8192"] [--variants -,2,2h] [--no-clock]
    TILELANG_CACHE_DIR=/tmp/tlc python benchmarks/experiments/fused_fwd.py --precompile-only [--rows ...] \
        [--variants=2,2h] [--no-clock] [--workers 16]

Prints per row and build variant (`VARIANTS`): the relative RMS errors of o and the final state
against fp64 (both paths), their relative difference from the two launches' (BV = 128, cp off, the
op's own launches), the CUDA-graph times (median, ms), and the clocked build's per-chunk cycles by
role (`CLOCKS`) and of the aux role by stage (`AUX_STAGES`). Rows: "h_qk/h_v COUNTxLENGTH" (`_gpu.parse_row`).
"""

import argparse
import functools
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

ROWS = "16/32 4x8192,16/64 4x8192,32/32 4x8192,16/32 8x1024,2/8 1x8192"

#: the clocked build's sums per CTA (cycles): the chain's lifetime, its waits for the loads (full) and
#: for the aux role (x_full); the aux role's lifetime, its waits for the loads and for the chain
#: (x_empty); the chunk count
CLOCKS = ("chain_total", "chain_wait_load", "chain_wait_aux", "aux_total", "aux_wait_load", "aux_wait_chain",
          "chunks", "unused")
#: the clocked build's aux role, by stage (cycles summed over the CTA's chunks, thread 0 of the role, each
#: stamp after a barrier of the role's 128 threads): wait_full, kkt (K K^T), the prepare stages' own
#: names (L; level12, level3, level4, stage), qkt (Q K^T), wait_chain (x_empty), pg, handoff (the A_beta ring copy
#: and the arrives)
AUX_STAGES = ("wait_full", "kkt", "L", "level12", "level3", "level4", "stage", "qkt", "wait_chain", "pg", "handoff")

#: the builds compared by default (`_fused_prim_func` opts, or "2" / "2h": `_fused2_prim_func`; "q", "3" and "3q"
#: were timed within 3.5% of "" on the H100, journal `forward.md`, entry "The fused forward's variants":
#: kept as options, not run by default)
VARIANTS = ("", "2", "2h", "2m", "2hm")

#: registers per thread of each role (setmaxnreg; sum <= 512 at 512 threads)
NREG = {"chain": 192, "aux": 104, "producer": 24}


def _now(T):
    """The SM clock (clock64) as a TIR expression, for the clocked builds."""
    return T.call_extern("int64", "clock64")


def _no_stamp(name):
    """The unclocked builds' stamp: nothing."""


def _aux_stamper(T, tx, clk_s, ax):
    """stamp(name) for a clocked build's aux role: a barrier of the role's 128 threads (named barrier 10),
    then thread `ax` adds the cycles since its last stamp to stage `name` of `AUX_STAGES` in clk_s (the
    prepare stages' store_wait and store_issue go to L and stage)."""
    last = len(AUX_STAGES)

    def stamp(name):
        i = AUX_STAGES.index({"store_wait": "L", "store_issue": "stage"}.get(name, name))

        @T.macro
        def emit():
            T.sync_threads(10, 128)
            if tx == ax:
                clk_s[i] = clk_s[i] + _now(T) - clk_s[last]
                clk_s[last] = _now(T)

        emit()

    return stamp


def gates_warp(T, kv):
    """The producer's gates warp as a T.macro (both builds): per chunk c, its 64 tokens' g / ln 2 and beta,
    two a lane (0 past the sequence), g_cum_log2 by a shuffle scan over the lanes' pair sums, stored into
    ring slot c % NS of gc_s / bq_s after waiting on `empty` there, then an arrive on `full`. kv: the
    kernel's buffers and values, by name (g, beta, gc_s, bq_s, empty, full, lane, nchunks, seqlen, bos,
    bidx, hv, NS)."""
    from flashqla.ops.gdn.kernels.sm90._common import CHUNK as C, RCP_LN2

    g, beta, gc_s, bq_s, empty, full = (kv[x] for x in ("g", "beta", "gc_s", "bq_s", "empty", "full"))
    lane, nchunks, seqlen, bos, bidx, hv, NS = (kv[x] for x in ("lane", "nchunks", "seqlen", "bos", "bidx", "hv", "NS"))
    acc = "float32"

    @T.macro
    def body():
        gp = T.alloc_local((6,), acc)  # g pair, beta pair, scan
        for c in T.serial(nchunks):
            s = c % NS
            ph = (c // NS) % 2
            t0 = bos + c * C
            nvalid = T.min(seqlen - c * C, C)
            gp[0] = T.if_then_else(2 * lane < nvalid, g[bidx, t0 + 2 * lane, hv] * RCP_LN2, T.float32(0))
            gp[1] = T.if_then_else(2 * lane + 1 < nvalid, g[bidx, t0 + 2 * lane + 1, hv] * RCP_LN2, T.float32(0))
            gp[2] = T.if_then_else(2 * lane < nvalid, T.cast(beta[bidx, t0 + 2 * lane, hv], acc), T.float32(0))
            gp[3] = T.if_then_else(2 * lane + 1 < nvalid, T.cast(beta[bidx, t0 + 2 * lane + 1, hv], acc), T.float32(0))
            gp[1] = gp[0] + gp[1]
            gp[4] = gp[1]
            for d in T.unroll(5):
                gp[5] = T.shfl_up(gp[4], 1 << d)
                if lane >= (1 << d):
                    gp[4] = gp[4] + gp[5]
            T.barrier_wait(empty[s], 1 - ph)
            gc_s[s, 2 * lane] = gp[4] - gp[1] + gp[0]
            gc_s[s, 2 * lane + 1] = gp[4]
            bq_s[s, 2 * lane] = gp[2]
            bq_s[s, 2 * lane + 1] = gp[3]
            T.barrier_arrive(full[s])

    return body


def _fused_prim_func(H: int, HV: int, K: int, V: int, dtype: str, beta_dtype: str, seq_dtype: str, varlen: bool,
                     clocked: bool = False, opts: str = ""):
    """opts: "q" = Q K^T issued right after the L tile's stores, so that it runs beside the
    inverse (its accumulator live through it), waited after A diag(beta) is staged;
    "3" = a load ring of three stages (the aux role, one chunk ahead of the chain, finds its loads
    issued a chunk earlier), the chain's o staged in the chunk's own v tile (v is dead once W^T is
    formed; the slot is released after the o store), which frees the 16 KB the third stage needs.
    The variants measured and dropped are in the journal (entry "The prepare kernel's L tile formed
    in registers")."""
    qk_early = "q" in opts
    NS = 3 if "3" in opts else 2  # stages of the load ring (q, k, v, the gates)
    import tilelang.language as T
    from tilelang.layout import make_linear_layout, make_swizzled_layout

    from flashqla.ops.gdn.kernels.sm90 import prepare as P
    from flashqla.ops.gdn.kernels.sm90._common import CHUNK, sequence_span

    if K != 128 or V != 128:
        raise ValueError("the fused draft covers K = V = 128")
    C = CHUNK
    BV = V
    G = HV // H
    acc = "float32"
    HB = P.HALF
    CH = 256  # chain threads
    AX = CH  # first aux thread
    PR = CH + 128  # first producer thread
    chain_kw = {"policy": T.GemmWarpPolicy.FullRow}

    B = T.dynamic("B")
    Tn = T.dynamic("T")
    Np1 = T.dynamic("Np1")
    N0 = T.dynamic("N0")
    N1 = T.dynamic("N1")
    nseq = (Np1 - 1) if varlen else B
    # the clocked build's extra output: per CTA, SM cycles (clock64) summed over its chunks, `CLOCKS`
    clock_arg = T.Tensor((HV * nseq, len(CLOCKS) + len(AUX_STAGES)), "int64") if clocked else None

    now = functools.partial(_now, T)
    no_stamp = _no_stamp

    def aux_stamper(tx, clk_s):
        return _aux_stamper(T, tx, clk_s, AX)

    def qk_issuer(q_s, k_s, p_f, slot):
        """a macro issuing P = Q K^T of ring slot `slot` into p_f (not waited)"""

        @T.macro
        def issue():
            T.wgmma_gemm(q_s[slot, :, :], k_s[slot, :, :], p_f, transpose_B=True, clear_accum=True)

        return issue

    @T.prim_func
    def gdn_fused_fwd(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, HV, V), dtype),
        g: T.Tensor((B, Tn, HV), "float32"),
        beta: T.Tensor((B, Tn, HV), beta_dtype),
        h0: T.Tensor((N0, HV, K, V), "float32"),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        scale: T.float32,
        use_h0: T.int32,
        store_ht: T.int32,
        o: T.Tensor((B, Tn, HV, V), dtype),
        ht: T.Tensor((N1, HV, K, V), "float32"),
        clocks: clock_arg,
    ):
        with T.Kernel(HV * nseq, threads=512) as (bx,):
            hv = bx % HV
            n = bx // HV
            bos, seqlen, bidx, slot0, nchunks = sequence_span(n, cu_seqlens, Tn, varlen)
            hk = hv // G
            tx = T.get_thread_binding()

            q_s = T.alloc_shared((NS, C, K), dtype)
            k_s = T.alloc_shared((NS, C, K), dtype)
            v_s = T.alloc_shared((NS, C, BV), dtype)
            a_s = T.alloc_shared((2, C, C), dtype)  # A_beta (aux -> chain)
            pg_s = T.alloc_shared((2, C, C), dtype)  # Pg (aux -> chain)
            gc_s = T.alloc_shared((NS, C), acc)  # g_cum_log2 (producer's ring)
            bq_s = T.alloc_shared((NS, C), acc)  # beta (producer's ring)
            clk_s = T.alloc_shared((len(AUX_STAGES) + 1,), "int64") if clocked else None
            o_s = T.alloc_shared((C, BV), dtype) if NS == 2 else None  # O of the chunk, token-major (chain)
            # the aux role's tiles (as the prepare kernel's)
            ast = T.alloc_shared((C, C), dtype)  # A diag(beta) staged; blocks above the diagonal blocks stay 0
            m_s = T.alloc_shared((C, P.M_ROW), "float16")  # the inverse's tile
            T.annotate_layout({v_s: make_swizzled_layout(v_s)})
            if NS == 2:
                T.annotate_layout({o_s: make_swizzled_layout(o_s)})
            T.annotate_layout({m_s: make_linear_layout(m_s)})

            full = T.alloc_barrier(arrive_count=[64] * NS)  # producer (TMA warp, gates warp) -> chain and aux
            empty = T.alloc_barrier(arrive_count=[CH + 128] * NS)  # chain and aux -> producer
            x_full = T.alloc_barrier(arrive_count=[128, 128])  # aux -> chain: a_s, pg_s
            x_empty = T.alloc_barrier(arrive_count=[CH, CH])  # chain -> aux

            if tx < CH:
                # ------------------------------------------------------------------ chain
                T.set_max_nreg(NREG["chain"], 1)
                st = T.alloc_fragment((BV, K), acc)
                st_b = T.alloc_fragment((BV, K), dtype)
                ut = T.alloc_fragment((BV, C), acc)
                ot = T.alloc_fragment((BV, C), acc)
                nvt = T.alloc_fragment((BV, C), acc)
                wt_b = T.alloc_fragment((BV, C), dtype)
                nvt_b = T.alloc_fragment((BV, C), dtype)
                vpt_b = T.alloc_fragment((BV, C), dtype)
                gam_f = T.alloc_fragment((C,), acc)
                r_f = T.alloc_fragment((C,), acc)
                gcl = T.alloc_local((1,), acc)
                if clocked:
                    ck = T.alloc_local((4,), "int64")  # start, wait full, wait aux, stamp
                    ck[0] = now()
                    ck[1] = T.int64(0)
                    ck[2] = T.int64(0)
                if use_h0 != 0:
                    for i, j in T.Parallel(BV, K):
                        st[i, j] = h0[n, hv, j, i]
                else:
                    T.clear(st)
                for c in T.serial(nchunks):
                    s = c % NS  # load ring slot
                    ph = (c // NS) % 2
                    sx = c % 2  # aux ring slot
                    phx = (c // 2) % 2
                    t0 = bos + c * C
                    if clocked:
                        ck[3] = now()
                    T.barrier_wait(full[s], ph)
                    if clocked:
                        ck[1] = ck[1] + now() - ck[3]
                    T.copy(st, st_b)
                    T.wgmma_gemm(st_b, k_s[s, :, :], ut, transpose_B=True, clear_accum=True, **chain_kw)
                    T.wgmma_gemm(st_b, q_s[s, :, :], ot, transpose_B=True, clear_accum=True, **chain_kw)
                    if clocked:
                        ck[3] = now()
                    T.barrier_wait(x_full[sx], phx)
                    if clocked:
                        ck[2] = ck[2] + now() - ck[3]
                    gcl[0] = T.exp2(gc_s[s, C - 1])
                    for i, j in T.Parallel(BV, K):
                        st[i, j] = st[i, j] * gcl[0]
                    # both products waited before W^T: the bf16 S^T (the A operand of both) then dies, and
                    # the registers live beside the next product stay within 192 (with S^T, U^T, O^T and the
                    # gates live while O^T is in flight, ptxas serialises every wgmma of the kernel)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(ut, num_regs=BV * C // CH)
                    T.warpgroup_fence_operand(ot, num_regs=BV * C // CH)
                    for j in T.Parallel(C):
                        gam_f[j] = T.exp2(gc_s[s, j])
                    for i, j in T.Parallel(BV, C):
                        wt_b[i, j] = T.cast(T.cast(v_s[s, j, i], acc) - ut[i, j] * gam_f[j], dtype)
                    T.wgmma_gemm(wt_b, a_s[sx, :, :], nvt, transpose_B=True, clear_accum=True, **chain_kw)
                    for i, j in T.Parallel(BV, C):
                        ot[i, j] = ot[i, j] * (scale * gam_f[j])
                    for j in T.Parallel(C):
                        r_f[j] = T.exp2(T.min(gc_s[s, C - 1] - gc_s[s, j], T.float32(0)))
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(nvt, num_regs=BV * C // CH)
                    for i, j in T.Parallel(BV, C):
                        nvt_b[i, j] = T.cast(nvt[i, j], dtype)
                        vpt_b[i, j] = T.cast(nvt[i, j] * r_f[j], dtype)
                    T.wgmma_gemm(vpt_b, k_s[s, :, :], st, **chain_kw)
                    T.wgmma_gemm(nvt_b, pg_s[sx, :, :], ot, transpose_B=True, **chain_kw)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(st, num_regs=BV * K // CH)
                    T.warpgroup_fence_operand(ot, num_regs=BV * C // CH)
                    T.barrier_arrive(x_empty[sx])
                    nvalid = T.min(seqlen - c * C, C)
                    if NS == 2:
                        T.barrier_arrive(empty[s])
                        for i, t in T.Parallel(BV, C):
                            o_s[t, i] = T.cast(ot[i, t], dtype)
                        for t, i in T.Parallel(C, BV):
                            if t < nvalid:
                                o[bidx, t0 + t, hv, i] = o_s[t, i]
                    else:
                        # o staged in this chunk's v tile (read for the last time into W^T), then the slot released
                        for i, t in T.Parallel(BV, C):
                            v_s[s, t, i] = T.cast(ot[i, t], dtype)
                        for t, i in T.Parallel(C, BV):
                            if t < nvalid:
                                o[bidx, t0 + t, hv, i] = v_s[s, t, i]
                        T.fence_proxy_async()  # the generic writes, before the copy engine refills the slot
                        T.barrier_arrive(empty[s])
                if store_ht != 0:
                    for i, j in T.Parallel(BV, K):
                        ht[n, hv, j, i] = st[i, j]
                if clocked:
                    if tx == 0:
                        clocks[bx, 0] = now() - ck[0]
                        clocks[bx, 1] = ck[1]
                        clocks[bx, 2] = ck[2]
                        clocks[bx, 6] = T.cast(nchunks, "int64")
            elif tx < PR:
                # ------------------------------------------------------------------ aux
                T.set_max_nreg(NREG["aux"], 0)  # 128 -> 104: a decrease
                kk_f = T.alloc_fragment((C, C), acc)
                p_f = T.alloc_fragment((C, C), acc)
                pgb = T.alloc_fragment((C, C), dtype)
                g_row = T.alloc_fragment((C,), acc)
                g_col = T.alloc_fragment((C,), acc)
                b_row = T.alloc_fragment((C,), acc)
                inv = P.alloc_inverse_locals(T)
                if clocked:
                    ca = T.alloc_local((4,), "int64")  # start, wait full, wait chain, stamp
                    ca[0] = now()
                    ca[1] = T.int64(0)
                    ca[2] = T.int64(0)
                    if tx == AX:
                        for i in T.serial(len(AUX_STAGES) + 1):
                            clk_s[i] = T.int64(0)
                        clk_s[len(AUX_STAGES)] = now()
                stamp = aux_stamper(tx, clk_s) if clocked else no_stamp
                # the staging tile's block above the diagonal 32-blocks, zeroed once (as the prepare kernel does per CTA)
                for t, u in T.Parallel(C, C):
                    ast[t, u] = T.cast(0, dtype)
                for c in T.serial(nchunks):
                    s = c % NS  # load ring slot
                    ph = (c // NS) % 2
                    sx = c % 2  # aux ring slot
                    phx = (c // 2) % 2
                    nvalid = T.min(seqlen - c * C, C)
                    if clocked:
                        ca[3] = now()
                    T.barrier_wait(full[s], ph)  # q, k and the gates (g_cum_log2 and beta: the producer's second warp)
                    if clocked:
                        ca[1] = ca[1] + now() - ca[3]
                    stamp("wait_full")
                    T.wgmma_gemm(k_s[s, :, :], k_s[s, :, :], kk_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    stamp("kkt")
                    P.value_head_stages(T, j=s, G=1, hk=hv, nvalid=nvalid, row0=0, A=None, dtype=dtype, kk_f=kk_f, gc_s=gc_s,
                                        b_s=bq_s, g_row=g_row, g_col=g_col, b_row=b_row, m_s=m_s, inv=inv,
                                        stage=ast, tx0=AX, store=False,
                                        stamp=stamp if clocked else None,
                                        after_l=qk_issuer(q_s, k_s, p_f, s) if qk_early else None)
                    if not qk_early:
                        T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True, clear_accum=True)
                    T.wait_wgmma(0)
                    stamp("qkt")
                    if clocked:
                        ca[3] = now()
                    T.barrier_wait(x_empty[sx], 1 - phx)
                    if clocked:
                        ca[2] = ca[2] + now() - ca[3]
                    stamp("wait_chain")
                    # Pg in a bf16 fragment (the gates in registers first), then one copy into the ring
                    for t in T.Parallel(C):
                        g_row[t] = gc_s[s, t]
                    for u in T.Parallel(C):
                        g_col[u] = gc_s[s, u]
                    for t, u in T.Parallel(C, C):
                        pgb[t, u] = T.cast(T.if_then_else(t >= u, scale * p_f[t, u] * T.exp2(T.if_then_else(
                            t >= u, g_row[t] - g_col[u], T.float32(0))), T.float32(0)), dtype)
                    T.copy(pgb, pg_s[sx, :, :])
                    stamp("pg")
                    T.copy(ast, a_s[sx, :, :])
                    T.fence_proxy_async()
                    T.barrier_arrive(empty[s])  # q, k and the ring's gates read
                    T.barrier_arrive(x_full[sx])
                    stamp("handoff")
                if clocked:
                    if tx == AX:
                        clocks[bx, 3] = now() - ca[0]
                        clocks[bx, 4] = ca[1]
                        clocks[bx, 5] = ca[2]
                        for i in T.serial(len(AUX_STAGES)):
                            clocks[bx, len(CLOCKS) + i] = clk_s[i]
            else:
                # ------------------------------------------------------------------ producer
                T.set_max_nreg(NREG["producer"], 0)
                if tx < PR + 32:
                    for c in T.serial(nchunks):
                        s = c % NS
                        ph = (c // NS) % 2
                        t0 = bos + c * C
                        T.barrier_wait(empty[s], 1 - ph)
                        T.tma_copy(q[bidx, t0 : t0 + C, hk, 0:K], q_s[s, :, :], barrier=full[s])
                        T.tma_copy(k[bidx, t0 : t0 + C, hk, 0:K], k_s[s, :, :], barrier=full[s])
                        T.tma_copy(v[bidx, t0 : t0 + C, hv, 0:BV], v_s[s, :, :], barrier=full[s])
                        T.barrier_arrive(full[s])
                elif tx < PR + 64:
                    gates_warp(T, dict(g=g, beta=beta, gc_s=gc_s, bq_s=bq_s, empty=empty, full=full, lane=tx - PR - 32,
                                       nchunks=nchunks, seqlen=seqlen, bos=bos, bidx=bidx, hv=hv, NS=NS))()

    return gdn_fused_fwd


#: registers per thread of each role in the two-aux build ("2"; 512 threads: 256 * (176 + 80) = 65,536, all the
#: launch gives: setmaxnreg only moves a CTA's own registers, and the sum over roles must not pass the
#: launch's, 65,536 // threads rounded down to 8 a thread; the chain at 168 makes ptxas serialise its
#: wgmmas, C7512)
NREG2 = {"chain": 176, "aux": 80}
#: False only in register experiments that compile over-budget splits (ptxas reports; such a build hangs on a GPU)
_CHECK_BUDGET = True


def _fused2_prim_func(H: int, HV: int, K: int, V: int, dtype: str, beta_dtype: str, seq_dtype: str, varlen: bool,
                      clocked: bool = False, fp16_ops: bool = False, level1: str = "substitution"):
    """Build "2": two aux warpgroups taking alternate chunks, so that each has two of the chain's
    steps for one chunk's aux work (one aux warpgroup needs about 1.85 of them).

    512 threads, no producer warpgroup (a fifth warpgroup leaves 96 registers a thread at launch, too
    few for 176 / 64 / 24: the first 640-thread draft hung in the chain's setmaxnreg): chain 0-255 (as
    the one-aux build, but S^T's bf16 copy goes through a shared tile, the A operand of U^T and
    O^T, so the chain fits 176 registers; its warp 0 issues the TMA loads: q and k three chunks ahead
    once the chunk's aux role has released the slot, v two ahead), aux 0 256-383 (even chunks),
    aux 1 384-511 (odd chunks; each aux role's warp 0 forms its chunks' g_cum_log2 and beta, the
    next chunk's gates loaded into registers a chunk ahead). q, k and the gates in a three-stage ring
    (the chain on chunk c, the aux roles on c + 1 and c + 2), v in a two-stage ring of its own (the
    chain alone reads it; o is staged in its slot).
    Aux j writes A diag(beta) straight into ring slot j (the slot the chain reads for its chunks
    c = j mod 2), after waiting there for the chain to release it: no staging copy. Each aux role
    has its own fp16 inverse tile.

    fp16_ops (build "2h"): the A_beta product's operands (A_beta, W^T) and the output product's
    (Pg, vn^T) in fp16 instead of bf16 (the rounding model's lever on o's error,
    `benchmarks/journal/accuracy.md`, "Where the forward's error comes from"); fp16's range then bounds
    |W| and |vn| by 65504 (v in the thousands). The other products keep the inputs' dtype.

    level1 ("substitution"; "mma" in builds "2m" and "2hm"): the inverse's first level by products
    (`prepare.diagonal_blocks_8x8_mma`, record WY-6) instead of the shuffle elimination."""
    import tilelang.language as T
    from tilelang.layout import make_linear_layout, make_swizzled_layout

    from flashqla.ops.gdn.kernels.sm90 import prepare as P
    from flashqla.ops.gdn.kernels.sm90._common import CHUNK, RCP_LN2, sequence_span

    if K != 128 or V != 128:
        raise ValueError("the fused draft covers K = V = 128")
    C = CHUNK
    BV = V
    G = HV // H
    acc = "float32"
    NQ = 3  # stages of the q, k, gates ring
    CH = 256  # chain threads
    AXS = (CH, CH + 128)  # first thread of aux 0, aux 1
    NT = CH + 256  # threads
    if _CHECK_BUDGET and 256 * (NREG2["chain"] + NREG2["aux"]) > (65536 // NT) // 8 * 8 * NT:
        raise ValueError(f"roles' registers {NREG2} exceed the launch's at {NT} threads")
    chain_kw = {"policy": T.GemmWarpPolicy.FullRow}
    pdt = "float16" if fp16_ops else dtype  # the A_beta and output products' operand dtype

    B = T.dynamic("B")
    Tn = T.dynamic("T")
    Np1 = T.dynamic("Np1")
    N0 = T.dynamic("N0")
    N1 = T.dynamic("N1")
    nseq = (Np1 - 1) if varlen else B
    clock_arg = T.Tensor((HV * nseq, len(CLOCKS) + len(AUX_STAGES)), "int64") if clocked else None

    now = functools.partial(_now, T)
    no_stamp = _no_stamp

    def aux_stamper(tx, clk_s, ax):
        return _aux_stamper(T, tx, clk_s, ax)

    def waiter(bar, parity):
        @T.macro
        def wait():
            T.barrier_wait(bar, parity)

        return wait

    def aux_role(jj, m_s, kv):
        """aux j's body (a macro); kv: the kernel's buffers and values it reads, by name"""
        q_s, k_s, a_s, pg_s, gc_s, bq_s, clk_s = (kv[x] for x in ("q_s", "k_s", "a_s", "pg_s", "gc_s", "bq_s", "clk_s"))
        gst_s = kv["gst_s"]
        qk_full, qk_empty, x_full, x_empty = (kv[x] for x in ("qk_full", "qk_empty", "x_full", "x_empty"))
        tx, nchunks, seqlen, hv, bx, scale, clocks = (kv[x] for x in ("tx", "nchunks", "seqlen", "hv", "bx", "scale", "clocks"))
        g, beta, bos, bidx = (kv[x] for x in ("g", "beta", "bos", "bidx"))
        ax = AXS[jj]
        lane = tx - ax

        def gate_load(gq, cc):
            """warp 0: chunk cc's g / ln 2 and beta, two tokens a lane (0 past the sequence), into gq[0:4]"""

            @T.macro
            def load():
                t0 = bos + cc * C
                nv = T.min(seqlen - cc * C, C)
                gq[0] = T.if_then_else(2 * lane < nv, g[bidx, t0 + 2 * lane, hv] * RCP_LN2, T.float32(0))
                gq[1] = T.if_then_else(2 * lane + 1 < nv, g[bidx, t0 + 2 * lane + 1, hv] * RCP_LN2, T.float32(0))
                gq[2] = T.if_then_else(2 * lane < nv, T.cast(beta[bidx, t0 + 2 * lane, hv], acc), T.float32(0))
                gq[3] = T.if_then_else(2 * lane + 1 < nv, T.cast(beta[bidx, t0 + 2 * lane + 1, hv], acc), T.float32(0))

            return load

        def gate_stage(gq):
            """warp 0: g_cum_log2 of gq's g pairs by a shuffle scan over the lanes' pair sums, and beta, into
            this role's staging row gst_s[jj] (the same lanes read it back: no barrier needed)"""

            @T.macro
            def stage():
                gq[1] = gq[0] + gq[1]
                gq[4] = gq[1]
                for d in T.unroll(5):
                    gq[5] = T.shfl_up(gq[4], 1 << d)
                    if lane >= (1 << d):
                        gq[4] = gq[4] + gq[5]
                gst_s[jj, 0, 2 * lane] = gq[4] - gq[1] + gq[0]
                gst_s[jj, 0, 2 * lane + 1] = gq[4]
                gst_s[jj, 1, 2 * lane] = gq[2]
                gst_s[jj, 1, 2 * lane + 1] = gq[3]

            return stage

        @T.macro
        def body():
            T.set_max_nreg(NREG2["aux"], 0)
            kk_f = T.alloc_fragment((C, C), acc)
            p_f = T.alloc_fragment((C, C), acc)
            pgb = T.alloc_fragment((C, C), pdt)
            g_row = T.alloc_fragment((C,), acc)
            g_col = T.alloc_fragment((C,), acc)
            b_row = T.alloc_fragment((C,), acc)
            inv = P.alloc_inverse_locals(T)
            l1 = P.alloc_level1_locals(T) if level1 == "mma" else None
            gq = T.alloc_local((6,), acc)  # warp 0: a chunk's g pair and beta pair, the scan
            if clocked and jj == 0:
                ca = T.alloc_local((4,), "int64")
                ca[0] = now()
                ca[1] = T.int64(0)
                ca[2] = T.int64(0)
                if tx == ax:
                    for i in T.serial(len(AUX_STAGES) + 1):
                        clk_s[i] = T.int64(0)
                    clk_s[len(AUX_STAGES)] = now()
            stamp = aux_stamper(tx, clk_s, ax) if clocked and jj == 0 else no_stamp
            # the slot's block above the diagonal 32-blocks stays zero (the stages never write it)
            for t, u in T.Parallel(C, C):
                a_s[jj, t, u] = T.cast(0, pdt)
            if lane < 32:
                if jj < nchunks:
                    gate_load(gq, jj)()
                    gate_stage(gq)()
            for i in T.serial((nchunks + 1 - jj) // 2):
                c = 2 * i + jj
                s = c % NQ
                ph = (c // NQ) % 2
                phx = i % 2
                nvalid = T.min(seqlen - c * C, C)
                if lane < 32:
                    if c + 2 < nchunks:
                        gate_load(gq, c + 2)()  # chunk c + 2's gates, staged below once K K^T is issued
                if clocked and jj == 0:
                    ca[3] = now()
                if c >= NQ:
                    # the other aux role's release of chunk c - 3 (slot s's previous load) first: that load
                    # has then landed, so the parity wait below cannot be passed by its still-open phase
                    # (this role skips every other phase of the slot)
                    T.barrier_wait(qk_empty[s], 1 - ph)
                T.barrier_wait(qk_full[s], ph)
                if clocked and jj == 0:
                    ca[1] = ca[1] + now() - ca[3]
                if lane < 32:
                    # chunk c's g_cum_log2 and beta from the staging row into ring slot s (free: its q and k are
                    # loaded, which the chain issued after it had read chunk c - 3's gates)
                    for e in T.unroll(2):
                        gc_s[s, 2 * lane + e] = gst_s[jj, 0, 2 * lane + e]
                        bq_s[s, 2 * lane + e] = gst_s[jj, 1, 2 * lane + e]
                stamp("wait_full")
                T.wgmma_gemm(k_s[s, :, :], k_s[s, :, :], kk_f, transpose_B=True, clear_accum=True)
                if lane < 32:
                    if c + 2 < nchunks:
                        gate_stage(gq)()
                T.wait_wgmma(0)
                stamp("kkt")
                P.value_head_stages(T, j=s, G=1, hk=hv, nvalid=nvalid, row0=0, A=None, dtype=pdt, kk_f=kk_f,
                                    gc_s=gc_s, b_s=bq_s, g_row=g_row, g_col=g_col, b_row=b_row, m_s=m_s,
                                    inv=inv, l1=l1, stage=a_s, stage_slot=jj, tx0=ax, store=False,
                                    stamp=stamp if clocked and jj == 0 else None,
                                    before_stage=waiter(x_empty[jj], 1 - phx))
                T.wgmma_gemm(q_s[s, :, :], k_s[s, :, :], p_f, transpose_B=True, clear_accum=True)
                T.wait_wgmma(0)
                stamp("qkt")
                for t in T.Parallel(C):
                    g_row[t] = gc_s[s, t]
                for u in T.Parallel(C):
                    g_col[u] = gc_s[s, u]
                for t, u in T.Parallel(C, C):
                    pgb[t, u] = T.cast(T.if_then_else(t >= u, scale * p_f[t, u] * T.exp2(T.if_then_else(
                        t >= u, g_row[t] - g_col[u], T.float32(0))), T.float32(0)), pdt)
                T.copy(pgb, pg_s[jj, :, :])
                stamp("pg")
                T.fence_proxy_async()
                T.barrier_arrive(qk_empty[s])
                T.barrier_arrive(x_full[jj])
                stamp("handoff")
            if clocked and jj == 0:
                if tx == ax:
                    clocks[bx, 3] = now() - ca[0]
                    clocks[bx, 4] = ca[1]
                    clocks[bx, 5] = ca[2]
                    for i in T.serial(len(AUX_STAGES)):
                        clocks[bx, len(CLOCKS) + i] = clk_s[i]

        return body

    @T.prim_func
    def gdn_fused2_fwd(
        q: T.Tensor((B, Tn, H, K), dtype),
        k: T.Tensor((B, Tn, H, K), dtype),
        v: T.Tensor((B, Tn, HV, V), dtype),
        g: T.Tensor((B, Tn, HV), "float32"),
        beta: T.Tensor((B, Tn, HV), beta_dtype),
        h0: T.Tensor((N0, HV, K, V), "float32"),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        scale: T.float32,
        use_h0: T.int32,
        store_ht: T.int32,
        o: T.Tensor((B, Tn, HV, V), dtype),
        ht: T.Tensor((N1, HV, K, V), "float32"),
        clocks: clock_arg,
    ):
        with T.Kernel(HV * nseq, threads=NT, prelude=P.MOVMATRIX_PRELUDE if level1 == "mma" else None) as (bx,):
            hv = bx % HV
            n = bx // HV
            bos, seqlen, bidx, slot0, nchunks = sequence_span(n, cu_seqlens, Tn, varlen)
            hk = hv // G
            tx = T.get_thread_binding()

            q_s = T.alloc_shared((NQ, C, K), dtype)
            k_s = T.alloc_shared((NQ, C, K), dtype)
            v_s = T.alloc_shared((2, C, BV), dtype)
            st_s = T.alloc_shared((BV, K), dtype)  # bf16 S^T, the chain's A operand
            a_s = T.alloc_shared((2, C, C), pdt)  # A_beta of aux j's chunks (aux -> chain)
            pg_s = T.alloc_shared((2, C, C), pdt)  # Pg (aux -> chain)
            gc_s = T.alloc_shared((NQ, C), acc)
            bq_s = T.alloc_shared((NQ, C), acc)
            gst_s = T.alloc_shared((2, 2, C), acc)  # aux j's next chunk's g_cum_log2 and beta, staged
            m0_s = T.alloc_shared((C, P.M_ROW), "float16")  # aux 0's inverse tile
            m1_s = T.alloc_shared((C, P.M_ROW), "float16")  # aux 1's
            clk_s = T.alloc_shared((len(AUX_STAGES) + 1,), "int64") if clocked else None
            T.annotate_layout({v_s: make_swizzled_layout(v_s)})
            T.annotate_layout({m0_s: make_linear_layout(m0_s), m1_s: make_linear_layout(m1_s)})

            qk_full = T.alloc_barrier(arrive_count=[32] * NQ)  # the chain's warp 0 (TMA) -> chain and aux
            qk_empty = T.alloc_barrier(arrive_count=[128] * NQ)  # the chunk's aux -> the chain's warp 0 (its refill)
            v_full = T.alloc_barrier(arrive_count=[32, 32])  # the chain's warp 0 (TMA) -> chain
            x_full = T.alloc_barrier(arrive_count=[128, 128])  # aux j -> chain: a_s[j], pg_s[j]
            x_empty = T.alloc_barrier(arrive_count=[CH, CH])  # chain -> aux j


            if tx < CH:
                # ------------------------------------------------------------------ chain
                T.set_max_nreg(NREG2["chain"], 1)
                st = T.alloc_fragment((BV, K), acc)
                ut = T.alloc_fragment((BV, C), acc)
                ot = T.alloc_fragment((BV, C), acc)
                nvt = T.alloc_fragment((BV, C), acc)
                wt_b = T.alloc_fragment((BV, C), pdt)
                nvt_b = T.alloc_fragment((BV, C), pdt)
                vpt_b = T.alloc_fragment((BV, C), dtype)
                gam_f = T.alloc_fragment((C,), acc)
                r_f = T.alloc_fragment((C,), acc)
                gcl = T.alloc_local((1,), acc)
                if clocked:
                    ck = T.alloc_local((4,), "int64")
                    ck[0] = now()
                    ck[1] = T.int64(0)
                    ck[2] = T.int64(0)
                if tx < 32:
                    # the rings' first loads: q, k of chunks 0-2, v of chunks 0-1
                    for c in T.serial(T.min(nchunks, NQ)):
                        T.tma_copy(q[bidx, bos + c * C : bos + c * C + C, hk, 0:K], q_s[c, :, :], barrier=qk_full[c])
                        T.tma_copy(k[bidx, bos + c * C : bos + c * C + C, hk, 0:K], k_s[c, :, :], barrier=qk_full[c])
                        T.barrier_arrive(qk_full[c])
                    for c in T.serial(T.min(nchunks, 2)):
                        T.tma_copy(v[bidx, bos + c * C : bos + c * C + C, hv, 0:BV], v_s[c, :, :], barrier=v_full[c])
                        T.barrier_arrive(v_full[c])
                if use_h0 != 0:
                    for i, j in T.Parallel(BV, K):
                        st[i, j] = h0[n, hv, j, i]
                else:
                    T.clear(st)
                for c in T.serial(nchunks):
                    s = c % NQ
                    ph = (c // NQ) % 2
                    sv = c % 2  # v ring slot, and the aux ring's (aux sv's chunk)
                    phv = (c // 2) % 2
                    t0 = bos + c * C
                    for i, j in T.Parallel(BV, K):
                        st_s[i, j] = T.cast(st[i, j], dtype)
                    T.fence_proxy_async()
                    if clocked:
                        ck[3] = now()
                    T.barrier_wait(qk_full[s], ph)
                    if clocked:
                        ck[1] = ck[1] + now() - ck[3]
                    T.wgmma_gemm(st_s, k_s[s, :, :], ut, transpose_B=True, clear_accum=True, **chain_kw)
                    T.wgmma_gemm(st_s, q_s[s, :, :], ot, transpose_B=True, clear_accum=True, **chain_kw)
                    if clocked:
                        ck[3] = now()
                    T.barrier_wait(x_full[sv], phv)
                    if clocked:
                        ck[2] = ck[2] + now() - ck[3]
                    gcl[0] = T.exp2(gc_s[s, C - 1])
                    for i, j in T.Parallel(BV, K):
                        st[i, j] = st[i, j] * gcl[0]
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(ut, num_regs=BV * C // CH)
                    T.warpgroup_fence_operand(ot, num_regs=BV * C // CH)
                    for j in T.Parallel(C):
                        gam_f[j] = T.exp2(gc_s[s, j])
                    T.barrier_wait(v_full[sv], phv)
                    for i, j in T.Parallel(BV, C):
                        wt_b[i, j] = T.cast(T.cast(v_s[sv, j, i], acc) - ut[i, j] * gam_f[j], pdt)
                    T.wgmma_gemm(wt_b, a_s[sv, :, :], nvt, transpose_B=True, clear_accum=True, **chain_kw)
                    for i, j in T.Parallel(BV, C):
                        ot[i, j] = ot[i, j] * (scale * gam_f[j])
                    for j in T.Parallel(C):
                        r_f[j] = T.exp2(T.min(gc_s[s, C - 1] - gc_s[s, j], T.float32(0)))
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(nvt, num_regs=BV * C // CH)
                    for i, j in T.Parallel(BV, C):
                        nvt_b[i, j] = T.cast(nvt[i, j], pdt)
                        vpt_b[i, j] = T.cast(nvt[i, j] * r_f[j], dtype)
                    T.wgmma_gemm(vpt_b, k_s[s, :, :], st, **chain_kw)
                    T.wgmma_gemm(nvt_b, pg_s[sv, :, :], ot, transpose_B=True, **chain_kw)
                    T.wait_wgmma(0)
                    T.warpgroup_fence_operand(st, num_regs=BV * K // CH)
                    T.warpgroup_fence_operand(ot, num_regs=BV * C // CH)
                    T.barrier_arrive(x_empty[sv])
                    nvalid = T.min(seqlen - c * C, C)
                    # o staged in this chunk's v tile (read for the last time into W^T)
                    for i, t in T.Parallel(BV, C):
                        v_s[sv, t, i] = T.cast(ot[i, t], dtype)
                    for t, i in T.Parallel(C, BV):
                        if t < nvalid:
                            o[bidx, t0 + t, hv, i] = v_s[sv, t, i]
                    T.fence_proxy_async()  # the generic accesses, before the copy engine refills the slots
                    T.sync_threads(8, CH)  # every chain thread is done with q, k slot s and v slot sv
                    if tx < 32:
                        if c + NQ < nchunks:
                            T.barrier_wait(qk_empty[s], ph)  # the chunk's aux role is done with slot s
                            T.tma_copy(q[bidx, t0 + NQ * C : t0 + NQ * C + C, hk, 0:K], q_s[s, :, :], barrier=qk_full[s])
                            T.tma_copy(k[bidx, t0 + NQ * C : t0 + NQ * C + C, hk, 0:K], k_s[s, :, :], barrier=qk_full[s])
                            T.barrier_arrive(qk_full[s])
                        if c + 2 < nchunks:
                            T.tma_copy(v[bidx, t0 + 2 * C : t0 + 3 * C, hv, 0:BV], v_s[sv, :, :], barrier=v_full[sv])
                            T.barrier_arrive(v_full[sv])
                if store_ht != 0:
                    for i, j in T.Parallel(BV, K):
                        ht[n, hv, j, i] = st[i, j]
                if clocked:
                    if tx == 0:
                        clocks[bx, 0] = now() - ck[0]
                        clocks[bx, 1] = ck[1]
                        clocks[bx, 2] = ck[2]
                        clocks[bx, 6] = T.cast(nchunks, "int64")
            elif tx < AXS[1]:
                aux_role(0, m0_s, dict(q_s=q_s, k_s=k_s, a_s=a_s, pg_s=pg_s, gc_s=gc_s, bq_s=bq_s, clk_s=clk_s, qk_full=qk_full, qk_empty=qk_empty, x_full=x_full, x_empty=x_empty, tx=tx, nchunks=nchunks, seqlen=seqlen, hv=hv, bx=bx, scale=scale, clocks=clocks,
                                       g=g, beta=beta, bos=bos, bidx=bidx, gst_s=gst_s))()
            else:
                aux_role(1, m1_s, dict(q_s=q_s, k_s=k_s, a_s=a_s, pg_s=pg_s, gc_s=gc_s, bq_s=bq_s, clk_s=clk_s, qk_full=qk_full, qk_empty=qk_empty, x_full=x_full, x_empty=x_empty, tx=tx, nchunks=nchunks, seqlen=seqlen, hv=hv, bx=bx, scale=scale, clocks=clocks,
                                       g=g, beta=beta, bos=bos, bidx=bidx, gst_s=gst_s))()
    return gdn_fused2_fwd


@functools.lru_cache(maxsize=None)
def build_fused_kernel(H, HV, K, V, dtype, beta_dtype, seq_dtype, varlen, clocked=False, opts=""):
    from flashqla.ops.gdn.kernels.sm90._common import compile_kernel

    fn = (_fused2_prim_func(H, HV, K, V, dtype, beta_dtype, seq_dtype, varlen, clocked, fp16_ops="h" in opts,
                            level1="mma" if "m" in opts else "substitution")
          if opts in ("2", "2h", "2m", "2hm") else _fused_prim_func(H, HV, K, V, dtype, beta_dtype, seq_dtype, varlen, clocked, opts))
    return compile_kernel(fn,
                          f"gdn_fused_fwd_H{H}_HV{HV}_{dtype}_{beta_dtype}_{seq_dtype}_{int(varlen)}{'_clocked' * clocked}_{opts}")


def fused_key(q, v, beta, cu_seqlens) -> tuple:
    from flashqla.ops.gdn.kernels.sm90._common import tl_dtype

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    seq = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
    return (H, HV, K, V, tl_dtype(q.dtype), tl_dtype(beta.dtype), seq, cu_seqlens is not None)


def fused_fwd(q, k, v, g, beta, scale, initial_state=None, output_final_state=True, cu_seqlens=None, clocks=None, opts=""):
    """o [B, T, HV, V], final state [N, HV, K, V] fp32 (or None) by the fused kernel; g clamped as
    the op clamps it (`contract.clamp_gates`) by the caller."""
    from flashqla.ops.gdn.kernels.sm90._common import placeholder

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    o = torch.zeros_like(v) if varlen else torch.empty_like(v)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device) if output_final_state else None
    h0 = initial_state if initial_state is not None else placeholder((1, HV, K, V), torch.float32, q.device)
    ht_arg = ht if ht is not None else placeholder((1, HV, K, V), torch.float32, q.device)
    cu = cu_seqlens if varlen else placeholder((1,), torch.int32, q.device)
    kernel = build_fused_kernel(*fused_key(q, v, beta, cu_seqlens), clocked=clocks is not None, opts=opts)
    args = (q, k, v, g, beta, h0, cu, float(scale), int(initial_state is not None), int(output_final_state), o, ht_arg)
    kernel(*args, clocks) if clocks is not None else kernel(*args)
    return o, ht


def _row_key(row: str) -> tuple:
    from _gpu import parse_row

    H, HV, lengths = parse_row(row)
    return (H, HV, 128, 128, "bfloat16", "float32", "int32", True)


def _build(key):
    build_fused_kernel(*key[:-2], clocked=key[-2], opts=key[-1])
    return str(key)


def precompile(rows, workers, variants=VARIANTS, clock=True):
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    from _gpu import parse_row

    from flashqla.ops.gdn.kernels.sm90.registry import op_kernel_specs, precompile as precompile_specs

    keys = list(dict.fromkeys(_row_key(r) + (ck, op) for r in rows for ck in ((False, True) if clock else (False,))
                              for op in variants))
    t = time.time()
    # the two launches' kernels of the same rows (run_row compares with them)
    heads = dict.fromkeys(parse_row(r)[:2] for r in rows)
    precompile_specs([s for H, HV in heads for s in op_kernel_specs(H, HV, varlen=True, block_v=128, backward=False)],
                     max_workers=workers)
    print(f"built the two launches' kernels ({time.time() - t:.0f} s)", flush=True)
    with ProcessPoolExecutor(max(1, min(workers, len(keys))), mp_context=mp.get_context("spawn")) as ex:
        for done in ex.map(_build, keys):
            print(f"built {done} ({time.time() - t:.0f} s)", flush=True)


def run_row(row: str, check_fp64: bool, clock: bool = True, variants=VARIANTS) -> dict:
    from _gpu import gen_inputs, parse_row, time_graph

    from flashqla.contract import clamp_gates
    from flashqla.testing import rel_rms as rel
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    H, HV, lengths = parse_row(row)
    x = gen_inputs(H, HV, lengths, varlen=True, h0=True)
    x["g"][..., 0] = 0.0  # a g == 0 head
    x["g"][..., -1] = -30.0  # a strong-decay head
    q, k, v, g, beta, h0, cu = (x[n] for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens"))
    gcl = clamp_gates(g)
    scale = q.shape[-1] ** -0.5

    def two():
        return chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale=scale, initial_state=h0, output_final_state=True,
                                          cu_seqlens=cu, cp="off", block_v=128, for_backward=False)

    r2 = two()
    o2, s2 = r2[0], r2[1]
    out = dict(row=row, variants={})
    ref_out = None
    if check_fp64:
        from reference import chunk_gated_delta_rule as ref

        ref_out = ref(q.double(), k.double(), v.double(), gcl.double(), beta.double(), scale=scale,
                      initial_state=h0.double(), output_final_state=True, cu_seqlens=cu)
        out.update(e_o2=rel(o2, ref_out[0]), e_s2=rel(s2, ref_out[1]))
    out["ms_two"] = time_graph(two)
    for op in variants:
        def fused(op=op):
            return fused_fwd(q, k, v, gcl, beta, scale, h0, True, cu, opts=op)

        of, sf = fused()
        torch.cuda.synchronize()
        d = dict(finite=bool(torch.isfinite(of).all() and torch.isfinite(sf).all()), d_o=rel(of, o2), d_s=rel(sf, s2))
        if ref_out is not None:
            d.update(e_of=rel(of, ref_out[0]), e_sf=rel(sf, ref_out[1]))
        d["ms"] = time_graph(fused)
        if clock:
            N = cu.numel() - 1
            clocks = torch.zeros(N * HV, len(CLOCKS) + len(AUX_STAGES), dtype=torch.int64, device="cuda")
            for _ in range(3):
                fused_fwd(q, k, v, gcl, beta, scale, h0, True, cu, clocks=clocks, opts=op)
            torch.cuda.synchronize()
            c = clocks.double()
            per = c / c[:, 6:7].clamp_min(1)
            med = per.median(dim=0).values.tolist()
            d["clock"] = {n: med[i] for i, n in enumerate(CLOCKS[:6])}
            d["clock"]["aux_busy"] = float((per[:, 3] - per[:, 4] - per[:, 5]).median())
            d["aux_stages"] = {n: med[len(CLOCKS) + i] for i, n in enumerate(AUX_STAGES)}
        out["variants"][op or "-"] = d
        print(f"  {row} [{op or '-'}]: {d}", flush=True)
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--precompile-only", action="store_true")
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--no-fp64", action="store_true", help="skip the fp64 reference (long rows)")
    ap.add_argument("--variants", default=",".join(v or "-" for v in VARIANTS),
                    help="builds to run, comma-separated (\"-\": the one-aux build); default: %(default)s")
    ap.add_argument("--no-clock", action="store_true", help="skip the clocked builds")
    ap.add_argument("--ncu", metavar="OPTS", help="one fused call of build variant OPTS on the first row inside "
                    "cudaProfilerStart/Stop, for `ncu --profile-from-start off -k regex:gdn_fused` (no timing, no check)")
    args = ap.parse_args(argv)
    rows = [r.strip() for r in args.rows.split(",") if r.strip()]
    variants = [v.strip().replace("-", "") for v in args.variants.split(",")]
    if args.precompile_only:  # the builds of --variants (clocked too unless --no-clock)
        precompile(rows, args.workers, variants, clock=not args.no_clock)
        return 0
    if args.ncu is not None:
        from _gpu import gen_inputs, parse_row

        from flashqla.contract import clamp_gates

        H, HV, lengths = parse_row(rows[0])
        x = gen_inputs(H, HV, lengths, varlen=True, h0=True)
        args1 = (x["q"], x["k"], x["v"], clamp_gates(x["g"]), x["beta"], x["q"].shape[-1] ** -0.5, x["initial_state"], True,
                 x["cu_seqlens"])
        for _ in range(3):
            fused_fwd(*args1, opts=args.ncu)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStart()
        fused_fwd(*args1, opts=args.ncu)
        torch.cuda.synchronize()
        torch.cuda.cudart().cudaProfilerStop()
        print(f"profiled one fused call [{args.ncu}] on {rows[0]}")
        return 0
    print(f"device: {torch.cuda.get_device_name()}")
    res = []
    for r in rows:
        try:
            res.append(run_row(r, not args.no_fp64, clock=not args.no_clock, variants=variants))
        except Exception as exc:  # report and go on with the next row
            print(f"{r}: FAILED {type(exc).__name__}: {exc}", flush=True)
            continue
        print(res[-1], flush=True)
    print("\nper chunk, median over CTAs (cycles):")
    for d in res:
        for op, e in d["variants"].items():
            if "clock" in e:
                print(f"- {d['row']} [{op}]: " + ", ".join(f"{n} {v:.0f}" for n, v in e["clock"].items()))
                print("  aux stages: " + ", ".join(f"{n} {v:.0f}" for n, v in e["aux_stages"].items()))
    print("\n| row | variant | o err two / fused | state err two / fused | rel diff o / state | two launches ms | fused ms | fused / two |")
    print("| --- | --- | --- | --- | --- | ---: | ---: | ---: |")
    for d in res:
        for op, e in d["variants"].items():
            err = (f"{d['e_o2']:.2e} / {e['e_of']:.2e} | {d['e_s2']:.2e} / {e['e_sf']:.2e}" if "e_o2" in d else "- | -")
            print(f"| {d['row']} | {op} | {err} | {e['d_o']:.1e} / {e['d_s']:.1e} | {d['ms_two']:.4f} | {e['ms']:.4f} | "
                  f"{e['ms'] / d['ms_two']:.3f} |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

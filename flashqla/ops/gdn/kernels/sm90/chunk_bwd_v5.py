"""Backward pass 2, variant "v5" (the default since its H200 check, 2026-12-01): v2's per-chunk math
with the products split over three consumer warpgroups with their own roles and a TMA producer warp,
synchronised by mbarriers that name each cross-role dependency (no warpgroup waits for a product it does
not use).

Why: v2 (two warpgroups share every product) issues ~4,400 instructions a consumer warp per chunk at
~6 cycles each (NOTES-bwd.md, "Where pass 2's chunk goes"); v4 (three roles, no producer, six
CTA-wide stages, gates read from global memory) was 2.3x slower. Here every product is one
warpgroup's full-width wgmma, row sums stay inside a warp, the next chunk's tiles are loaded by TMA
while the roles still work, and each role only waits for the tiles and results it reads.

One CTA of 512 threads per (sequence, value head), chunks in reverse:

    S  (threads   0-127) dS [K, V] fp32 in registers: D's bf16 copy, <S0, D>, gamma_C dS,
                         + Q^T (scale diag(gamma) dO), + K^T (-diag(gamma) dv); dh0; the chunk's dG row
                         and dbeta from the roles' partial sums
    K  (threads 128-255) dv_new = diag(r) K D + Pg^T dO; dv = A_beta^T dv_new (+ the exact diagonal);
                         -diag(gamma) dv; dk = diag(r) v_new D^T + (-diag(gamma) dv) S0^T
                         + beta (dLk K) + (diag(beta) dLk)^T K + (scale M Gamma)^T Q;
                         dq = scale diag(gamma) dO S0^T + (scale M Gamma) K; their dG / dbeta rows
    A  (threads 256-383) Pg, Kg, A = I - A_beta Kg, U = K S0, W, X = A^T dv_new, v_new, dL, M;
                         their dG rows, columns and dbeta rows
    P  (threads 384-511) one warp: TMA loads of the next chunk's g, A_beta, v and k, q, h, dO, each
                         group as soon as its last reader released it (k and q then arrive on their own
                         barrier, before h and dO)

Math and reference: `reference.gdn.fused_bwd.chunk_bwd_fused` (records BWD-Abeta, BWD-fused, BWD-dq,
BWD-dG), v2's products and operand roundings except: rowsum(-diag(gamma) dv * U) is formed as
rowsum(((-diag(gamma) dv) S0^T) * K) from dk's own product (U = K S0; the bf16 -diag(gamma) dv
operand instead of fp32 dv and U), and dq's first term is (dO S0^T) scaled by scale * gamma in fp32
(v2 rounds scale diag(gamma) dO to bf16 first).

Measured on the H200 (`tests/gpu/bwd_v2_check.py --base v2 --new v5`, nine cases incl. varlen with
empty and 1-token sequences, the packed tail, GVA 1 / 4, the g == 0 / g = -30 heads): dv and dh0
bitwise equal to v2's, dk within 7e-5 relative RMS, dbeta 2e-7, dg 2e-4 .. 9e-4, dq 2.5e-3 from v2 and
closer to fp64 in every case; finite, bitwise repeatable, packed tail zero. Pass 2 1.17x (16/32, 8
packed sequences of 8192 tokens) to 1.35x (16/32, 4 x 8192; 2/4, 1 x 32768) faster than v2: 12.0 us a
chunk on 16/32 4 x 8192 (v2 16.2). NOTES-bwd.md, "Pass-2 variant v5", has the tables, the Nsight
Compute profile and the GPU tier (run on the build before the last change, which was checked on seven
cases of bwd_v2_check.py).

Resources (ptxas, sm_90a; `tests/test_bwd_kernels_compile.py`): 231,424 B dynamic + 1,024 B static
shared memory, the whole 232,448 B (five results reuse dead tiles, listed at the tiles),
setmaxnreg S 160 / K 176 / A 152 / producer 24 packed (K 184 / A 144 fixed length), 32-128 B of spill
stores (H = 1, HV = 2: plain packed 32, "ag" packed ~60, plain fixed 60; "dag" 128 at 16/32 packed, at
the older split), no wgmma serialisation.

Build options (`OPTS`, `DEFAULT_OPTS`; NOTES-bwd.md "Pass-2 v5's build options"): packed builds
reorder K's tail with asynchronous wgmma ("a", "g"): pass 2 1.04-1.08x faster on packed rows (16/32
4 x 8192 packed 1.663 -> 1.541 ms); fixed-length builds keep the schedule above ("a" measured 0.98x
there). "d" (S publishes the next chunk's D as soon as dS is complete) measured 1.01-1.02x alone; the
grids at 82fd41d ran "dag", but "d" as measured let K and A write the next chunk's partial rows while
S could still read the last ones, and now waits for S on a barrier of its own (`s_done`). So guarded,
"dag" and "ag" are within noise of each other in the options check (whole backward 0.0-0.4% apart);
over the backward grid "dag" (014fb06) is 0.35% faster than "ag" (5c9434f) by geometric mean, faster
on 24 of the 32 rows: packed builds default to "dag". Measured and removed: an L2 prefetch of the next
chunk's tiles by the producer (bulk prefetches, 0.84-0.95x of the plain schedule) and Q K^T issued
beside K K^T ("b": whole backward 3.7-9.0% slower than "ag", 2.4-3.7% slower than "dag").
"l" (`DH0_OPTS`, added where the call returns dh0): S takes Q^T (scale diag(gamma) dO) from the bf16
pair hi + lo of the scaled dO, two products over w_s; dh0's error at T = 4096 from 1.16x FLA's to
0.89x, the whole backward 2.4% slower over the grid (same registers, spills and shared memory;
NOTES-bwd.md "dh0 at long T").

The sequence's last chunk (the first walked; the only one that may be partial) is loaded by every
thread with rows past the end zeroed, before the roles split; the producer loads the earlier, full
chunks by TMA. Only h stored in q's dtype and K = V = 128 (else `chunk_bwd` runs v2).
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, sequence_span

__all__ = ["build_chunk_bwd_v5_kernel", "chunk_fused_bwd_v5", "v5_applies"]

#: Registers per thread of each role (setmaxnreg), by packed input (cu_seqlens) or not. The CTA launches
#: with 128 a thread (65,536 / 512); the producer gives back 104, which the consumers take. Packed builds
#: (every launch of the benchmarks, the split backward's segments included) give A 8 of K's: measured on
#: the H200 (`tests/gpu/pass2_variant_rows.py`, six benchmark rows, same process), the backward 0.6-1.4%
#: faster with the "dagl" build and 0.0-0.8% with "dag", gradients bitwise equal; K 168 / A 160 and
#: K 160 / A 168 were 0.6-1.2% slower than 184 / 144 (NOTES-bwd.md, "Registers moved from K to A").
#: Fixed-length builds keep 184 / 144 (not measured).
NREG_BY_VARLEN = {True: {"S": 160, "K": 176, "A": 152, "P": 24}, False: {"S": 160, "K": 184, "A": 144, "P": 24}}


#: Environment variable: "input" makes v5 store dq_hv, dk_hv in q's dtype (rounded per value head, as
#: FLA and FlashQLA store them; with HV == H pass 3 then launches no GVA sum) instead of fp32. Read at
#: each launch. Not the default: measured on the H200 (2026-12-01, `tests/gpu/cp_profile.py --bwd`,
#: NOTES-bwd.md "dq and dk stored in bf16"), the bf16 stores slow pass 2 by 4-9% (16/32 7212 + 7072 +
#: 13725 + 4759: 2.856 against 2.612 ms) for a GVA sum 0.12 ms faster there: 3.736 against 3.599 ms in all.
QK_DTYPE_ENV = "FLASHQLA_BWD_QK_DTYPE"


#: Build options of v5 (a string of these letters), each measured on the H200 against v5 without it
#: (NOTES-bwd.md, "Pass-2 v5's build options"):
#: "d": S publishes the next chunk's D as soon as dS is complete, before its chunk-end sums wait for
#:      K's and A's partial rows (K's next chunk starts on D); K and A then wait for S's reads of those
#:      rows (`s_done`) before writing the next chunk's (so guarded, within noise of "ag" alone);
#: "a": K publishes -diag(gamma) dv before storing dv; takes (-diag(gamma) dv) S0^T right after
#:      v_new D^T and sums its dG rows and the r-terms in one pass; issues (diag(beta) dLk)^T K and
#:      (scale M Gamma)^T Q together;
#: "g": (with "a") K's (scale M Gamma) K runs while dq's dG rows sum.
#: "l": S forms Q^T (scale diag(gamma) dO) from the bf16 pair hi + lo of the scaled dO (hi its bf16
#:      rounding, lo the rounding of the remainder), two products into dS over the same tile, instead of
#:      hi alone: the state gradient's only product whose operand is rounded from a computed value that
#:      FLA keeps in fp32 (its dhu kernel: q diag(gamma) in fp32, a tf32 product); dh0's error at
#:      T = 4096 is 1.16x FLA's with hi alone (NOTES-bwd.md, "dh0 at long T").
#: (Removed after their H200 runs: "b", A issuing Q K^T beside K K^T, 3.7-9.0% slower than "ag" with
#: its spills; "p", an L2 prefetch by the producer, 0.84-0.95x of the plain schedule; "s", S's product
#: over the unscaled diag(gamma) dO with dS divided by scale before it and multiplied after, which
#: makes the g == 0 heads' operand exact but made ptxas spill ~1 KB: pass 2 at 0.74-0.83x of "dagl";
#: "l"'s second product only on chunks whose term reaches dh0 through a gate product above 2^-16, a
#: runtime test per chunk: the grid as fast as with it on every chunk, 1.000x, so not kept; "w", dbeta's
#: rows rowsum(X * W) with W in fp32 beside X in four column slices (dbeta's error 0.85-1.07x FLA's over
#: the tier's seeds, geometric mean 0.954, from 1.08), the backward 2.5-4.7% slower than the same
#: register split without it: code in commit 14fb18b, NOTES-bwd.md "dbeta with W in fp32".)
OPTS = "dagl"
#: The options each build takes by default, by packed input (cu_seqlens) or not, when the call returns
#: no dh0: measured, "dag" made pass 2 1.04-1.08x faster than the plain schedule on packed rows (every
#: row of the benchmarks, the split backward's segments included) and "a" 0.98x on fixed-length rows
#: (B sequences of T tokens, ptxas allocates that build differently).
DEFAULT_OPTS = {True: "dag", False: ""}
#: Added to `DEFAULT_OPTS` when the backward returns dh0, i.e. has an initial state (the op; the split
#: path's segments when the caller gave one): "l" brings dh0's error from 1.16x FLA's to 0.89x at
#: T = 4096 and costs 2.4% of the backward (geometric mean of the H200 grid, 0.8-5.7% a row;
#: NOTES-bwd.md, "dh0 at long T"). The other gradients see the extra precision only through the state
#: gradient's bf16 copy D (measured on one H200 case without it: dk, dv, dbeta errors 1.04-1.08x, dg
#: 1.11-1.36x, as every call without an initial state runs). An initial_state whose gradient autograd
#: does not need takes the build without "l" (`chunk_gated_delta_rule_bwd(need_dh0=False)`); the
#: multi-GPU path's entering states on ranks whose caller gave none still take it.
DH0_OPTS = "l"


def canonical_opts(opts: str | None, varlen: bool, dh0: bool = True) -> str:
    """The build options as compiled: for None, `DEFAULT_OPTS[varlen]` and, when the call returns dh0,
    `DH0_OPTS`; else the letters of `opts` once each, in `OPTS` order. ValueError for other letters,
    or "g" without "a"."""
    if opts is None:
        opts = DEFAULT_OPTS[bool(varlen)] + (DH0_OPTS if dh0 else "")
    if set(opts) - set(OPTS) or ("g" in opts and "a" not in opts):
        raise ValueError(f"v5 options must be letters of {OPTS!r} ('g' with 'a'), got {opts!r}")
    return "".join(c for c in OPTS if c in opts)


def qk_store_dtype(dtype: str) -> str:
    """TileLang dtype in which v5 stores dq_hv, dk_hv: "float32", or `dtype` (q's) when
    $FLASHQLA_BWD_QK_DTYPE is "input". ValueError naming the variable for any other value."""
    import os

    want = os.environ.get(QK_DTYPE_ENV, "")
    if want not in ("", "float32", "input"):
        raise ValueError(f"${QK_DTYPE_ENV} must be unset, 'float32' or 'input', got {want!r}")
    return dtype if want == "input" else "float32"


def v5_applies(K: int, V: int, dtype: str, h_dtype: str) -> bool:
    """Whether the v5 kernel covers this configuration (else pass 2 runs v2)."""
    return K == 128 and V == 128 and h_dtype == dtype


def _chunk_bwd_v5_prim_func(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, beta_dtype: str, seq_dtype: str,
                            varlen: bool, exact_diagonal: bool = True, qk_dtype: str | None = None, opts: str = ""):
    import tilelang.language as T

    opts = canonical_opts(opts, varlen)
    early_d, async_k, over_gk, dog_lo = "d" in opts, "a" in opts, "g" in opts, "l" in opts
    nreg = NREG_BY_VARLEN[bool(varlen)]

    if not v5_applies(K, V, dtype, h_dtype):
        raise ValueError(f"v5 needs K = V = 128 and h in q's dtype, got K={K}, V={V}, {dtype}, h {h_dtype}")
    exact_diagonal = exact_diagonal and beta_dtype != dtype
    qk_dtype = qk_dtype or "float32"  # dq_hv / dk_hv storage (QK_DTYPE_ENV)
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
    NO = T.dynamic("NO")

    # red_s slots: K's dG rows, K's dbeta rows, A's dG rows, A's dG columns (A writes its dbeta rows
    # to dbeta, S adds K's); scalars after g in g_s: <S0, D> per S warp, then the r-terms moved to the
    # last valid row per K warp (every byte counts: the tiles fill 229,376 of the 232,448 B)
    RGK, RBK, RGA, CGA, SCS = 0, C, 2 * C, 3 * C, C

    @T.prim_func
    def gdn_chunk_bwd_v5(
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
        order: T.Tensor((NO,), "int32"),
        use_order: T.int32,
        scale: T.float32,
        use_dht: T.int32,
        dq_hv: T.Tensor((B, Tn, HV, K), qk_dtype),
        dk_hv: T.Tensor((B, Tn, HV, K), qk_dtype),
        dv: T.Tensor((B, Tn, HV, V), dtype),
        dbeta: T.Tensor((B, Tn, HV), "float32"),
        dG: T.Tensor((HV, R), "float32"),
        dh0: T.Tensor((N2, HV, K, V), "float32"),
    ):
        with T.Kernel(HV * ((Np1 - 1) if varlen else B), threads=512) as (bx,):
            hv = bx % HV
            # packed: the sequences in the order given (`_common.launch_order`); fixed-length rows in
            # order, an expression as before (a mutable n there cost registers: ptxas serialised wgmma)
            n = T.if_then_else(use_order != 0, order[bx // HV], bx // HV) if varlen else bx // HV
            bos, seqlen, bidx, slot0, nchunks = sequence_span(n, cu_seqlens, Tn, varlen)
            hk = hv // G
            tx = T.get_thread_binding()

            # loaded tiles (the last chunk by every thread, the others by the producer's TMA)
            q_s = T.alloc_shared((C, K), dtype)
            k_s = T.alloc_shared((C, K), dtype)
            v_s = T.alloc_shared((C, V), dtype)  # V; then X = A^T dv_new (A)
            do_s = T.alloc_shared((C, V), dtype)
            ab_s = T.alloc_shared((C, C), dtype)  # A diag(beta)
            h_s = T.alloc_shared((K, V), dtype)  # S0
            g_s = T.alloc_shared((C + 8,), acc)  # g_cum_log2, then the chunk's scalars
            # tiles the roles write
            ds_s = T.alloc_shared((K, V), dtype)  # D (S)
            pg_s = T.alloc_shared((C, C), dtype)  # Pg (A)
            pm_s = T.alloc_shared((C, C), dtype)  # scale M * Gamma (A; its own tile: a loop that reads and
            # writes one shared tile costs a warpgroup barrier an element, TileLang cannot prove each
            # thread keeps to its own elements)
            kg_s = T.alloc_shared((C, C), dtype)  # Kg; then diag(beta) dLk (A)
            am_s = T.alloc_shared((C, C), dtype)  # A = I - A_beta Kg; then dLk (A)
            w_s = T.alloc_shared((C, V), dtype)  # W (A); then scale diag(gamma) dO (S)
            vn_s = T.alloc_shared((C, V), dtype)  # v_new (A)
            dvn_s = T.alloc_shared((C, V), dtype)  # dv_new; then -diag(gamma) dv (K)
            red_s = T.alloc_shared((4 * C,), acc)

            # tile full (producer -> roles; 32 producer arrivals + TMA bytes) and empty (roles -> producer)
            f_g = T.alloc_barrier(arrive_count=32)
            f_ab = T.alloc_barrier(arrive_count=32)
            f_v = T.alloc_barrier(arrive_count=32)
            f_kq = T.alloc_barrier(arrive_count=32)  # k, q (freed with h, dO: e_late)
            f_hd = T.alloc_barrier(arrive_count=32)  # h, dO
            e_g = T.alloc_barrier(arrive_count=384)
            e_ab = T.alloc_barrier(arrive_count=256)
            e_v = T.alloc_barrier(arrive_count=128)
            e_late = T.alloc_barrier(arrive_count=384)
            # results between roles (each completes once a chunk)
            d_ready = T.alloc_barrier(arrive_count=128)  # S -> K: D in ds_s
            pg_ready = T.alloc_barrier(arrive_count=128)  # A -> K: Pg in pg_s
            pg_read = T.alloc_barrier(arrive_count=128)  # K -> A: Pg^T dO done (pg_s may take scale M)
            dvn_ready = T.alloc_barrier(arrive_count=128)  # K -> A: dv_new in dvn_s
            x_done = T.alloc_barrier(arrive_count=128)  # A -> K: A^T dv_new done (dvn_s may take -gamma dv)
            dvg_ready = T.alloc_barrier(arrive_count=128)  # K -> S: -diag(gamma) dv in dvn_s
            dvg_read = T.alloc_barrier(arrive_count=128)  # S -> K: K^T dvg done (dvn_s free)
            vn_ready = T.alloc_barrier(arrive_count=128)  # A -> K, S: v_new in vn_s (and W dead)
            dog_read = T.alloc_barrier(arrive_count=128)  # S -> A: Q^T (scale diag(gamma) dO) done (w_s free)
            kd_done = T.alloc_barrier(arrive_count=128)  # K -> S, A: ds_s and vn_s free
            m_ready = T.alloc_barrier(arrive_count=128)  # A -> K: dLk, diag(beta) dLk, scale M Gamma
            km_done = T.alloc_barrier(arrive_count=128)  # K -> A: pg_s, kg_s, am_s free
            r_ka = T.alloc_barrier(arrive_count=256)  # K, A -> S: their partial rows in red_s
            s_sync = T.alloc_barrier(arrive_count=128)  # S's own warps
            if early_d:
                # S -> K, A: the chunk's partial rows read (red_s and the scalars after g free). Without
                # "d", S publishes the next D only after those reads, and K (and A through K) cannot
                # start the next chunk before; with "d" nothing else orders K's and A's next writes there
                s_done = T.alloc_barrier(arrive_count=128)

            # ---- the sequence's last chunk, every thread (rows past the end zero)
            if nchunks > 0:
                c_last = nchunks - 1
                t0_l = bos + c_last * C
                row0_l = (slot0 + c_last) * C
                nv_l = seqlen - c_last * C
                for t, d in T.Parallel(C, K):
                    q_s[t, d] = T.if_then_else(t < nv_l, q[bidx, t0_l + t, hk, d], T.cast(0, dtype))
                    k_s[t, d] = T.if_then_else(t < nv_l, k[bidx, t0_l + t, hk, d], T.cast(0, dtype))
                for t, d in T.Parallel(C, V):
                    v_s[t, d] = T.if_then_else(t < nv_l, v[bidx, t0_l + t, hv, d], T.cast(0, dtype))
                    do_s[t, d] = T.if_then_else(t < nv_l, do[bidx, t0_l + t, hv, d], T.cast(0, dtype))
                for t, s in T.Parallel(C, C):
                    ab_s[t, s] = A[hv, row0_l + t, s]
                for i, j in T.Parallel(K, V):
                    h_s[i, j] = h[(slot0 + c_last) * HV + hv, i, j]
                for t in T.Parallel(C):
                    g_s[t] = g_cum_log2[hv, row0_l + t]
                T.fence_proxy_async()
            T.sync_threads()

            if tx < 128:
                # ================================================================ S
                T.set_max_nreg(nreg["S"], 1)
                dS = T.alloc_fragment((K, V), acc)
                sc = T.alloc_local((1,), acc)
                gamc = T.alloc_local((1,), acc)
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
                    par = ci % 2
                    pprev = (ci + 1) % 2
                    if ci > 0:
                        T.barrier_wait(f_g, pprev)
                    gamc[0] = T.exp2(g_s[C - 1])
                    # D of this chunk (dS after the later chunks); K read the previous one
                    if not early_d or ci == 0:
                        if ci > 0:
                            T.barrier_wait(kd_done, pprev)
                        T.copy(dS, ds_s)
                        T.fence_proxy_async()
                        T.barrier_arrive(d_ready)
                    # <S0, D> (the chunk-end term of dG), then gamma_C dS
                    if ci > 0:
                        T.barrier_wait(f_hd, pprev)
                    sc[0] = T.float32(0)
                    for i, j in T.Parallel(K, V):
                        sc[0] = sc[0] + T.cast(h_s[i, j], acc) * dS[i, j]
                        dS[i, j] = dS[i, j] * gamc[0]
                    # dS += Q^T (scale diag(gamma) dO), the scaled dO over W once A formed v_new
                    T.barrier_wait(vn_ready, par)
                    for t, d in T.Parallel(C, V):
                        w_s[t, d] = T.cast(scale * T.exp2(g_s[t]) * T.cast(do_s[t, d], acc), dtype)
                    T.fence_proxy_async()
                    if not dog_lo:
                        T.barrier_arrive(e_g)  # S's last read of g_s this chunk
                    if ci > 0:
                        T.barrier_wait(f_kq, pprev)
                    T.gemm(q_s, w_s, dS, transpose_A=True)
                    if dog_lo:
                        # the remainder of the scaled dO after its bf16 rounding, over the same tile;
                        # it reads g_s again, so S frees g_s (e_g: the producer loads the next chunk's
                        # g there) only after it
                        for t, d in T.Parallel(C, V):
                            xs = scale * T.exp2(g_s[t]) * T.cast(do_s[t, d], acc)
                            w_s[t, d] = T.cast(xs - T.cast(T.cast(xs, dtype), acc), dtype)
                        T.fence_proxy_async()
                        T.barrier_arrive(e_g)
                        T.gemm(q_s, w_s, dS, transpose_A=True)
                    T.barrier_arrive(dog_read)
                    # dS += K^T (-diag(gamma) dv)   (the chain's end)
                    T.barrier_wait(dvg_ready, par)
                    T.gemm(k_s, dvn_s, dS, transpose_A=True)
                    T.barrier_arrive(dvg_read)
                    T.barrier_arrive(e_late)
                    if early_d:
                        # D of the next chunk, published before this chunk's sums wait for K's tail
                        if ci < nchunks - 1:
                            T.barrier_wait(kd_done, par)
                            T.copy(dS, ds_s)
                            T.fence_proxy_async()
                            T.barrier_arrive(d_ready)
                    # the chunk's dG row and dbeta: the roles' partial sums, <S0, D> and the r-terms
                    # moved to the last valid row (K wrote 0 there, -r-term elsewhere)
                    w0 = T.warp_reduce_sum(sc[0])
                    if tx % 32 == 0:
                        g_s[SCS + tx // 32] = w0
                    T.barrier_arrive(s_sync)
                    T.barrier_wait(s_sync, par)
                    T.barrier_wait(r_ka, par)
                    for t in T.Parallel(C):
                        if t < nvalid:
                            dbeta[bidx, t0 + t, hv] = dbeta[bidx, t0 + t, hv] + red_s[RBK + t]
                        dG[hv, row0 + t] = red_s[RGK + t] + red_s[RGA + t] - red_s[CGA + t] + T.if_then_else(
                            t == nvalid - 1,
                            gamc[0] * (g_s[SCS] + g_s[SCS + 1] + g_s[SCS + 2] + g_s[SCS + 3])
                            + (g_s[SCS + 4] + g_s[SCS + 5] + g_s[SCS + 6] + g_s[SCS + 7]),
                            T.float32(0))
                    if early_d:
                        T.barrier_arrive(s_done)
                for i, j in T.Parallel(K, V):
                    dh0[n, hv, i, j] = dS[i, j]
                if varlen:
                    # rows of no sequence (before cu_seqlens[0], past cu_seqlens[-1]) get zero gradients,
                    # written by S of the first / last sequence's CTA of each value head
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
                                    dq_hv[0, lo + tb * C + t, hv, d] = T.cast(0, qk_dtype)
                                    dk_hv[0, lo + tb * C + t, hv, d] = T.cast(0, qk_dtype)
                            for t, d in T.Parallel(C, V):
                                if tb * C + t < cnt:
                                    dv[0, lo + tb * C + t, hv, d] = T.cast(0, dtype)
                            for t in T.Parallel(C):
                                if tb * C + t < cnt:
                                    dbeta[0, lo + tb * C + t, hv] = T.float32(0)
            elif tx < 256:
                # ================================================================ K
                T.set_max_nreg(nreg["K"], 1)
                cv = T.alloc_fragment((C, V), acc)  # dv_new, dv; then scratch
                dk = T.alloc_fragment((C, K), acc)
                r_r = T.alloc_fragment((C,), acc)
                gam_r = T.alloc_fragment((C,), acc)
                b_r = T.alloc_fragment((C,), acc)
                d_r = T.alloc_fragment((C,), acc)
                rs = T.alloc_fragment((C,), acc)
                gk = T.alloc_fragment((C,), acc)
                scr = T.alloc_local((1,), acc)
                for ci in T.serial(nchunks):
                    c = nchunks - 1 - ci
                    t0 = bos + c * C
                    nvalid = T.min(seqlen - c * C, C)
                    par = ci % 2
                    pprev = (ci + 1) % 2
                    if ci > 0:
                        T.barrier_wait(f_g, pprev)
                    for t in T.Parallel(C):
                        r_r[t] = T.exp2(T.min(g_s[C - 1] - g_s[t], T.float32(0)))
                        gam_r[t] = T.exp2(g_s[t])
                    for t in T.Parallel(C):
                        b_r[t] = T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc), T.float32(0))
                    if exact_diagonal:
                        for t in T.Parallel(C):  # b_r is 0 past the end
                            d_r[t] = b_r[t] - T.cast(T.cast(b_r[t], dtype), acc)
                    T.barrier_arrive(e_g)
                    # dv_new = diag(r) K D + Pg^T dO
                    T.barrier_wait(d_ready, par)
                    if ci > 0:
                        T.barrier_wait(f_kq, pprev)
                    T.gemm(k_s, ds_s, cv, clear_accum=True)
                    for t, d in T.Parallel(C, V):
                        cv[t, d] = cv[t, d] * r_r[t]
                    T.barrier_wait(pg_ready, par)
                    if ci > 0:
                        T.barrier_wait(f_hd, pprev)
                    T.gemm(pg_s, do_s, cv, transpose_A=True)
                    T.barrier_arrive(pg_read)
                    if ci > 0:
                        T.barrier_wait(dvg_read, pprev)
                    T.copy(cv, dvn_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(dvn_ready)
                    # dv = A_beta^T dv_new (+ diag(beta - stored diagonal) dv_new in fp32)
                    if exact_diagonal:
                        for t, d in T.Parallel(C, V):
                            cv[t, d] = d_r[t] * cv[t, d]
                    if ci > 0:
                        T.barrier_wait(f_ab, pprev)
                    T.gemm(ab_s, dvn_s, cv, transpose_A=True, clear_accum=not exact_diagonal)
                    T.barrier_arrive(e_ab)
                    if not async_k:
                        for t, d in T.Parallel(C, V):
                            if t < nvalid:
                                dv[bidx, t0 + t, hv, d] = T.cast(cv[t, d], dtype)
                        # -diag(gamma) dv over dv_new, once A has read dv_new
                        T.barrier_wait(x_done, par)
                        for t, d in T.Parallel(C, V):
                            dvn_s[t, d] = T.cast(-gam_r[t] * cv[t, d], dtype)
                        T.fence_proxy_async()
                        T.barrier_arrive(dvg_ready)
                        # dk = diag(r) v_new D^T; its r-terms of dG (moved to the last valid row: 0 there)
                        T.barrier_wait(vn_ready, par)
                        T.gemm(vn_s, ds_s, dk, transpose_B=True, clear_accum=True)
                        T.barrier_arrive(kd_done)
                        for t, d in T.Parallel(C, K):
                            dk[t, d] = dk[t, d] * r_r[t]
                        scr[0] = T.float32(0)
                        for t, d in T.Parallel(C, K):
                            pr = T.if_then_else(t == nvalid - 1, T.float32(0), dk[t, d] * T.cast(k_s[t, d], acc))
                            cv[t, d] = pr
                            scr[0] = scr[0] + pr
                        T.reduce_sum(cv, rs, dim=1, batch=2)
                        for t in T.Parallel(C):
                            gk[t] = -rs[t]
                        wr = T.warp_reduce_sum(scr[0])
                        if early_d:
                            if ci > 0:
                                T.barrier_wait(s_done, pprev)
                        if tx % 32 == 0:
                            g_s[SCS + 4 + (tx // 32) % 4] = wr
                        # dk += (-diag(gamma) dv) S0^T; dG rows += rowsum(that * K) (= rowsum(-diag(gamma) dv * U))
                        T.gemm(dvn_s, h_s, cv, transpose_B=True, clear_accum=True)
                        for t, d in T.Parallel(C, K):
                            dk[t, d] = dk[t, d] + cv[t, d]
                        for t, d in T.Parallel(C, K):
                            cv[t, d] = cv[t, d] * T.cast(k_s[t, d], acc)
                        T.reduce_sum(cv, gk, dim=1, clear=False, batch=2)
                        # t = dLk K: dk += diag(beta) t; dbeta rows = rowsum(t * K)
                        T.barrier_wait(m_ready, par)
                        T.gemm(am_s, k_s, cv, clear_accum=True)
                        for t, d in T.Parallel(C, K):
                            dk[t, d] = dk[t, d] + b_r[t] * cv[t, d]
                        for t, d in T.Parallel(C, K):
                            cv[t, d] = cv[t, d] * T.cast(k_s[t, d], acc)
                        T.reduce_sum(cv, rs, dim=1, batch=2)
                        # dk += (diag(beta) dLk)^T K + (scale M Gamma)^T Q
                        T.gemm(kg_s, k_s, dk, transpose_A=True)
                        T.gemm(pm_s, q_s, dk, transpose_A=True)
                        for t, d in T.Parallel(C, K):
                            if t < nvalid:
                                dk_hv[bidx, t0 + t, hv, d] = dk[t, d] if qk_dtype == acc else T.cast(dk[t, d], qk_dtype)
                        # dq = scale diag(gamma) dO S0^T + (scale M Gamma) K; dG rows += rowsum(first term * Q)
                        T.gemm(do_s, h_s, cv, transpose_B=True, clear_accum=True)
                        for t, d in T.Parallel(C, K):
                            cv[t, d] = cv[t, d] * (scale * gam_r[t])
                        for t, d in T.Parallel(C, K):
                            dk[t, d] = cv[t, d] * T.cast(q_s[t, d], acc)
                        T.reduce_sum(dk, gk, dim=1, clear=False, batch=2)
                        T.gemm(pm_s, k_s, cv)
                        T.barrier_arrive(km_done)
                        T.barrier_arrive(e_late)
                        for t, d in T.Parallel(C, K):
                            if t < nvalid:
                                dq_hv[bidx, t0 + t, hv, d] = cv[t, d] if qk_dtype == acc else T.cast(cv[t, d], qk_dtype)
                    else:
                        # the same products, S's -diag(gamma) dv published before dv's store, and
                        # independent wgmma issued together (each waited only where its result is read)
                        T.barrier_wait(x_done, par)
                        for t, d in T.Parallel(C, V):
                            dvn_s[t, d] = T.cast(-gam_r[t] * cv[t, d], dtype)
                        T.fence_proxy_async()
                        T.barrier_arrive(dvg_ready)
                        for t, d in T.Parallel(C, V):
                            if t < nvalid:
                                dv[bidx, t0 + t, hv, d] = T.cast(cv[t, d], dtype)
                        # dk = diag(r) v_new D^T + (-diag(gamma) dv) S0^T; dG rows: rowsum of
                        # ((-diag(gamma) dv) S0^T) * K minus the r-terms (moved to the last valid row)
                        T.barrier_wait(vn_ready, par)
                        T.gemm(vn_s, ds_s, dk, transpose_B=True, clear_accum=True)
                        T.barrier_arrive(kd_done)
                        T.gemm(dvn_s, h_s, cv, transpose_B=True, clear_accum=True)
                        scr[0] = T.float32(0)
                        for t, d in T.Parallel(C, K):
                            kk = T.cast(k_s[t, d], acc)
                            dr = dk[t, d] * r_r[t]
                            pr = T.if_then_else(t == nvalid - 1, T.float32(0), dr * kk)
                            scr[0] = scr[0] + pr
                            dk[t, d] = dr + cv[t, d]
                            cv[t, d] = cv[t, d] * kk - pr
                        T.reduce_sum(cv, gk, dim=1, batch=2)
                        wr = T.warp_reduce_sum(scr[0])
                        if early_d:
                            if ci > 0:
                                T.barrier_wait(s_done, pprev)
                        if tx % 32 == 0:
                            g_s[SCS + 4 + (tx // 32) % 4] = wr
                        # t = dLk K: dk += diag(beta) t; dbeta rows = rowsum(t * K)
                        T.barrier_wait(m_ready, par)
                        T.gemm(am_s, k_s, cv, clear_accum=True)
                        for t, d in T.Parallel(C, K):
                            dk[t, d] = dk[t, d] + b_r[t] * cv[t, d]
                            cv[t, d] = cv[t, d] * T.cast(k_s[t, d], acc)
                        T.reduce_sum(cv, rs, dim=1, batch=2)
                        # dk += (diag(beta) dLk)^T K + (scale M Gamma)^T Q
                        T.wgmma_gemm(kg_s, k_s, dk, transpose_A=True)
                        T.wgmma_gemm(pm_s, q_s, dk, transpose_A=True)
                        T.wait_wgmma(0)
                        for t, d in T.Parallel(C, K):
                            if t < nvalid:
                                dk_hv[bidx, t0 + t, hv, d] = dk[t, d] if qk_dtype == acc else T.cast(dk[t, d], qk_dtype)
                        # dq = scale diag(gamma) dO S0^T + (scale M Gamma) K; dG rows += rowsum(first term * Q)
                        T.wgmma_gemm(do_s, h_s, cv, transpose_B=True, clear_accum=True)
                        T.wait_wgmma(0)
                        for t, d in T.Parallel(C, K):
                            cv[t, d] = cv[t, d] * (scale * gam_r[t])
                            dk[t, d] = cv[t, d] * T.cast(q_s[t, d], acc)
                        if over_gk:  # (scale M Gamma) K while the dG rows sum
                            T.wgmma_gemm(pm_s, k_s, cv)
                            T.reduce_sum(dk, gk, dim=1, clear=False, batch=2)
                            T.wait_wgmma(0)
                        else:
                            T.reduce_sum(dk, gk, dim=1, clear=False, batch=2)
                            T.gemm(pm_s, k_s, cv)
                        T.barrier_arrive(km_done)
                        T.barrier_arrive(e_late)
                        for t, d in T.Parallel(C, K):
                            if t < nvalid:
                                dq_hv[bidx, t0 + t, hv, d] = cv[t, d] if qk_dtype == acc else T.cast(cv[t, d], qk_dtype)
                    T.copy(gk, red_s[RGK : RGK + C])
                    T.copy(rs, red_s[RBK : RBK + C])
                    T.barrier_arrive(r_ka)
            elif tx < 384:
                # ================================================================ A
                T.set_max_nreg(nreg["A"], 1)
                cc = T.alloc_fragment((C, C), acc)
                msk = T.alloc_fragment((C, C), acc)  # Gamma (t >= s), 0 above the diagonal
                za = T.alloc_fragment((C, C), acc)  # Kg; then dL * L + Z (the dG rows and columns)
                F = T.alloc_fragment((C, V), acc)
                gam_a = T.alloc_fragment((C,), acc)
                b_a = T.alloc_fragment((C,), acc)
                rg = T.alloc_fragment((C,), acc)
                cg = T.alloc_fragment((C,), acc)
                rb = T.alloc_fragment((C,), acc)
                for ci in T.serial(nchunks):
                    c = nchunks - 1 - ci
                    t0 = bos + c * C
                    nvalid = T.min(seqlen - c * C, C)
                    par = ci % 2
                    pprev = (ci + 1) % 2
                    if ci > 0:
                        T.barrier_wait(f_g, pprev)
                    for t, s in T.Parallel(C, C):
                        msk[t, s] = T.if_then_else(t >= s, T.exp2(T.if_then_else(t >= s, g_s[t] - g_s[s], T.float32(0))),
                                                   T.float32(0))
                    for t in T.Parallel(C):
                        gam_a[t] = T.exp2(g_s[t])
                    for t in T.Parallel(C):
                        b_a[t] = T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hv], acc), T.float32(0))
                    T.barrier_arrive(e_g)
                    # Pg = scale (Q K^T) * Gamma
                    if ci > 0:
                        T.barrier_wait(km_done, pprev)
                        T.barrier_wait(f_kq, pprev)
                    T.gemm(q_s, k_s, cc, transpose_B=True, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        pg_s[t, s] = T.cast(scale * cc[t, s] * msk[t, s], dtype)
                    T.fence_proxy_async()
                    T.barrier_arrive(pg_ready)
                    # Kg = (K K^T) * Gamma_strict;  A = I - A_beta Kg  (BWD-Abeta)
                    T.gemm(k_s, k_s, cc, transpose_B=True, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        kg_s[t, s] = T.cast(T.if_then_else(t > s, cc[t, s] * msk[t, s], T.float32(0)), dtype)
                    T.fence_proxy_async()
                    if ci > 0:
                        T.barrier_wait(f_ab, pprev)
                    T.gemm(ab_s, kg_s, cc, clear_accum=True)
                    for t, s in T.Parallel(C, C):
                        am_s[t, s] = T.cast(T.if_then_else(t == s, T.float32(1), T.float32(0)) - cc[t, s], dtype)
                    T.fence_proxy_async()
                    # U = K S0, W = V - diag(gamma) U
                    if ci > 0:
                        T.barrier_wait(f_v, pprev)
                        T.barrier_wait(f_hd, pprev)
                    T.gemm(k_s, h_s, F, clear_accum=True)
                    if ci > 0:
                        T.barrier_wait(dog_read, pprev)
                    for t, d in T.Parallel(C, V):
                        w_s[t, d] = T.cast(T.cast(v_s[t, d], acc) - gam_a[t] * F[t, d], dtype)
                    T.fence_proxy_async()
                    # X = A^T dv_new, over V (dead); dbeta rows: rowsum(X * W)
                    T.barrier_wait(dvn_ready, par)
                    T.gemm(am_s, dvn_s, F, transpose_A=True, clear_accum=True)
                    T.barrier_arrive(x_done)
                    T.copy(F, v_s)
                    T.fence_proxy_async()
                    for t, d in T.Parallel(C, V):
                        F[t, d] = F[t, d] * T.cast(w_s[t, d], acc)
                    T.reduce_sum(F, rb, dim=1, batch=2)
                    # v_new = A_beta W
                    if ci > 0:
                        T.barrier_wait(kd_done, pprev)
                    T.gemm(ab_s, w_s, F, clear_accum=True)
                    T.barrier_arrive(e_ab)
                    T.copy(F, vn_s)
                    T.fence_proxy_async()
                    T.barrier_arrive(vn_ready)
                    # dL = -X v_new^T (strict): dLk = dL * Gamma over A; dG rows / columns of dL * L,
                    # L = diag(beta) Kg; diag(beta) dLk over Kg
                    # Kg into registers first (its tile then takes diag(beta) dLk: see pm_s)
                    for t, s in T.Parallel(C, C):
                        za[t, s] = T.cast(kg_s[t, s], acc)
                    T.gemm(v_s, vn_s, cc, transpose_B=True, clear_accum=True)
                    T.barrier_arrive(e_v)
                    for t, s in T.Parallel(C, C):
                        dl = T.if_then_else(t > s, -cc[t, s], T.float32(0))
                        dlk = T.cast(dl * msk[t, s], dtype)
                        zl = dl * b_a[t] * za[t, s]
                        am_s[t, s] = dlk
                        kg_s[t, s] = T.cast(b_a[t] * T.cast(dlk, acc), dtype)
                        za[t, s] = zl
                    # M = dO v_new^T: dG rows / columns of Z = M * Pg (strict); scale M * Gamma over Pg
                    T.gemm(do_s, vn_s, cc, transpose_B=True, clear_accum=True)
                    T.barrier_wait(pg_read, par)
                    for t, s in T.Parallel(C, C):
                        m = cc[t, s]
                        z = T.if_then_else(t > s, m * T.cast(pg_s[t, s], acc), T.float32(0))
                        pm_s[t, s] = T.cast(scale * m * msk[t, s], dtype)
                        za[t, s] = za[t, s] + z
                    T.fence_proxy_async()
                    T.barrier_arrive(m_ready)
                    T.reduce_sum(za, rg, dim=1, batch=2)
                    T.reduce_sum(za, cg, dim=0, batch=16)
                    T.barrier_arrive(e_late)
                    if early_d:
                        if ci > 0:
                            T.barrier_wait(s_done, pprev)
                    T.copy(rg, red_s[RGA : RGA + C])
                    T.copy(cg, red_s[CGA : CGA + C])
                    for t in T.Parallel(C):
                        if t < nvalid:
                            dbeta[bidx, t0 + t, hv] = rb[t]
                    T.barrier_arrive(r_ka)
            else:
                # ================================================================ P (one warp)
                T.set_max_nreg(nreg["P"], 0)
                if tx < 416:
                    for ci in T.serial(nchunks - 1):
                        par = ci % 2
                        c = nchunks - 2 - ci
                        t0 = bos + c * C
                        row0 = (slot0 + c) * C
                        T.barrier_wait(e_g, par)
                        T.tma_copy(g_cum_log2[hv, row0 : row0 + C], g_s[0:C], barrier=f_g)
                        T.barrier_arrive(f_g)
                        T.barrier_wait(e_ab, par)
                        T.tma_copy(A[hv, row0 : row0 + C, 0:C], ab_s, barrier=f_ab)
                        T.barrier_arrive(f_ab)
                        T.barrier_wait(e_v, par)
                        T.tma_copy(v[bidx, t0 : t0 + C, hv, 0:V], v_s, barrier=f_v)
                        T.barrier_arrive(f_v)
                        T.barrier_wait(e_late, par)
                        T.tma_copy(k[bidx, t0 : t0 + C, hk, 0:K], k_s, barrier=f_kq)
                        T.tma_copy(q[bidx, t0 : t0 + C, hk, 0:K], q_s, barrier=f_kq)
                        T.barrier_arrive(f_kq)
                        T.tma_copy(h[(slot0 + c) * HV + hv, 0:K, 0:V], h_s, barrier=f_hd)
                        T.tma_copy(do[bidx, t0 : t0 + C, hv, 0:V], do_s, barrier=f_hd)
                        T.barrier_arrive(f_hd)

    return gdn_chunk_bwd_v5


def build_chunk_bwd_v5_kernel(H: int, HV: int, K: int, V: int, dtype: str, h_dtype: str, beta_dtype: str, seq_dtype: str,
                              varlen: bool, qk_dtype: str | None = None, opts: str | None = None, dh0: bool = True):
    """Compiled pass-2 kernel, variant v5 (cached). Same static key as `build_chunk_bwd_kernel`, plus the
    storage dtype of dq_hv, dk_hv (None: "float32", as v1 / v2; or `dtype`: QK_DTYPE_ENV) and the build
    options (letters of `OPTS`; None: the defaults for `varlen` and whether the call returns dh0,
    `canonical_opts`)."""
    return _build_v5(H, HV, K, V, dtype, h_dtype, beta_dtype, seq_dtype, bool(varlen), qk_dtype or "float32",
                     canonical_opts(opts, varlen, dh0))


@functools.lru_cache(maxsize=None)
def _build_v5(H, HV, K, V, dtype, h_dtype, beta_dtype, seq_dtype, varlen, qk, opts):
    func = _chunk_bwd_v5_prim_func(H, HV, K, V, dtype, h_dtype, beta_dtype, seq_dtype, varlen, qk_dtype=qk, opts=opts)
    return compile_kernel(func, f"gdn_chunk_bwd_v5_H{H}_HV{HV}_K{K}_V{V}_{dtype}_{h_dtype}_{beta_dtype}_{seq_dtype}_{int(varlen)}"
                          + ("" if qk == "float32" else f"_qk_{qk}") + (f"_{opts}" if opts else ""))


def chunk_fused_bwd_v5(q, k, v, beta, A, g_cum_log2, h, do, dht, scale: float, cu_seqlens, order=None,
                       opts: str | None = None, dh0: bool = True):
    """Launches pass 2 with the v5 kernel (`chunk_bwd_v2.launch_pass2`). Arguments and results as
    `chunk_bwd.chunk_fused_bwd` (order: `_common.launch_order(cu_seqlens)` or None, the sequences'
    launch order; opts, dh0: the build options, `build_chunk_bwd_v5_kernel`); dq_hv and dk_hv in fp32, or in
    q's dtype under QK_DTYPE_ENV. dq_hv, dk_hv, dv, dbeta and dh0 are allocated uninitialised (the
    kernel writes every row, as v2)."""
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v2 import launch_pass2

    from flashqla.ops.gdn.kernels.sm90._common import tl_dtype

    qk = qk_store_dtype(tl_dtype(q.dtype))
    build = (lambda args: build_chunk_bwd_v5_kernel(*args, opts=opts, dh0=dh0)) if qk == "float32" else (
        lambda args: build_chunk_bwd_v5_kernel(*args, qk, opts=opts, dh0=dh0))
    return launch_pass2(build, q, k, v, beta, A, g_cum_log2, h, do, dht, scale, cu_seqlens, qk_dtype=getattr(torch, qk),
                        ordered=True, order=order)

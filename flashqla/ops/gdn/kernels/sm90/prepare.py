"""Prepare kernel (launch 1 of 2 of the unsplit forward): per chunk slot and q/k head, fully parallel.

Covers the reference stages (FLA's names, `reference.gdn.chunk`):
    chunk_local_cumsum   -> g_cum_log2 (chunk-local inclusive cumsum of g, in base-2 units)
    chunk_scaled_dot_kkt -> L = strictly_lower(diag(beta) (K K^T) * Gamma), per value head
    solve_tril           -> A = (I + L)^-1 (gated, as FLA's A)
and stores A diag(beta) (k's dtype, or fp16 for the inference forward: `a_dtype`), which turns the merged update v_new = A diag(beta) (V - diag(gamma)
K S) of `reference.gdn.fused` into one GEMM with the stored operand, and g_cum_log2.
Stage twin: `reference.gdn.fused.prepare_group_recursive` (one chunk of one q/k head and its G value
heads, in this kernel's order of products).
Derivation records (`python -m derivations`): CF-1..CF-3 (chunk form with FLA's gated A), WY-3
(forward substitution in the 16 x 16 diagonal blocks), WY-4 with two blocks, applied to the 16-blocks
of each half and then to the two 32-blocks, RW-2 (beta folded into the stored operand), RW-4 (exp2 of
base-2 differences). Value head hv reads q/k head hv // G, G = HV / H.

The inverse. Blocks of 16: D = blockdiag(Ai_00 .. Ai_33), Ai_ii = (I + L_ii)^-1 by forward
substitution; F_10 = Ai_11 L_10, F_32 = Ai_33 L_32; halves of 32: B_0 = I + L[:32, :32],
B_1 = I + L[32:, 32:], Lb = L[32:, :32]. Then (WY-4 twice)
    B_0^-1 = [[Ai_00, 0], [-F_10 Ai_00, Ai_11]],   B_1^-1 = [[Ai_22, 0], [-F_32 Ai_22, Ai_33]],
    A[32:, :32] = -B_1^-1 Lb B_0^-1 = -Q B_0^-1,   Q = Z - [0; F_32 Z_top],   Z = blockdiag(Ai_22, Ai_33) Lb
in three barrier-separated product phases after the substitution (tf32 mma.sync, fp32 accumulate):
    1. [F_32; F_10] (32 x 16 x 32) and Z (32 x 32 x 32)
    2. [Ai_10; Ai_32] = -blockdiag(F_10, F_32) [Ai_00; Ai_22] (32 x 16 x 32), and Q = Z - [0; F_32 Z_top]
       accumulated onto Z's registers (32 x 32 x 16)
    3. A[32:, :32] = -Q B_0^-1 (32 x 32 x 32)
The block-diagonal operands carry their zero blocks (written once per CTA), so each phase is one or
two whole-tile products on four warps.

Per CTA (128 threads, one warpgroup):
1. map the slot to (sequence, chunk) (packed input: one load of cu_seqlens per thread and one counting
   barrier while N < 128, two such rounds up to 16,256 sequences, else a binary search;
   `_common.locate_slot`);
2. issue the TMA load of the k tile of q/k head hk; load g and beta of its value heads (zero past the
   end); zero the constant blocks; wait for k; g_cum_log2 = cumsum(g) / ln 2;
3. K K^T on the tensor cores (wgmma), held in registers for the value heads;
4. per value head j: L (its elements formed in registers without a branch, one exp2 each, then the ten
   lower 16 x 16 blocks stored; in a fragment of their own when the CTA has several value heads, whose
   K K^T the elements would otherwise overwrite) -> D^-1 by
   forward substitution (lanes 0-15 of warp b solve the columns of diagonal block b; writes the diagonal
   blocks of A diag(beta), and copies D^-1 into the product operands: the transposed copies as 16-byte
   stores, four rows at a time) -> phases 1-3 -> TMA store of A diag(beta) from a staging tile (the store
   of head j overlaps head j + 1's L; waited before the substitution writes the tile again);
5. g_cum_log2 of the value heads (64 contiguous floats per head).
fp32 operand tiles are 32 x 36 floats, linear (rows 144 B apart: conflict-free ldmatrix), with the K
loops of the tf32 products kept rolled over 16-wide slices (`gemm_nt`). Two tiles share another's
memory where their lives do not overlap: blockdiag(F10, F32) (written in phase 1, read in phase 2)
lies in the first 32 rows of the block-diagonal operand of phase 1, whose zero blocks are the same,
and -Z_top^T in the diagonal blocks of L (read only by the substitution). Shared memory about
42-46 KB dynamic (G = 1 to 8) plus 1 KB static; launch bounds (128, 5): five CTAs per SM up to G = 4
(four at G = 8, by shared memory), 96 registers.

With `heads_per_cta=1` (`pick_heads_per_cta`, few chunk slots) the grid has one CTA per chunk slot and
value head instead: the same stages for that one head, the same outputs bit for bit.

Rows past the end of a sequence: A rows are 0 and g_cum_log2 repeats the last valid value, so the
recurrent kernel loads whole 64-row tiles and masks nothing (`_common`, chunk slots).

`build_prepare_kernel_clocked` is a measurement build (never launched by the op): the same kernel
with thread 0 writing SM clock stamps at the phase boundaries into one more int64 output
(`clock_stamps`, `benchmarks/experiments/prepare_phase_clock.py`).
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, RCP_LN2, SM_COUNT, compile_kernel, dummy_cu_seqlens, locate_slot, num_slots, tl_dtype

__all__ = ["build_prepare_kernel", "build_prepare_kernel_clocked", "chunk_prepare_fwd", "clock_stamps",
           "pick_heads_per_cta", "prepare_kernel_args"]

#: Diagonal block size of the forward substitution (WY-3)
BLOCK = 16
#: Half chunk: the two diagonal 32 x 32 blocks of the recursion
HALF = 2 * BLOCK
#: Row length of the compact transposed diagonal blocks of L (16 + 4 floats: 16-byte aligned rows for
#: vector loads in the substitution, conflict-free transposed stores from the K K^T fragment)
DROW = BLOCK + 4
#: Row length of the fp32 operand tiles (32 + 4 floats: ldmatrix rows 144 B apart, conflict free)
ROW = HALF + 4
#: CTAs per SM the kernel is built for (launch bounds: 96 registers; five CTAs need <= 45.6 KB of
#: dynamic + static shared memory each, 1 KB an SM reserved per CTA)
MIN_BLOCKS = 5
#: K slice of the tf32 products (`gemm_nt`)
KSLICE = 16

# --------------------------------------------------------------------------------------------
# the phase-clock build (`build_prepare_kernel_clocked`): a measurement tool, never launched by the op
# --------------------------------------------------------------------------------------------

#: Stamps of a CTA before its value heads, then those after them (the SM clock, `clock64()`, in
#: cycles, unless named otherwise). start: first statement (after the prologue's barrier-init
#: barrier); located: after `locate_slot`; k_ready: after the k tile's mbarrier wait; cumsum: after
#: the cumsum of g (warp 0's rows); kkt: after K K^T (wgmma waited). end: after the last
#: `tma_store_wait` and thread 0's g_cum_log2 stores (empty slots: after located); gt_start, gt_end:
#: `%globaltimer` (ns) beside start and end; smid: `%smid`.
CLOCK_FIRST = ("start", "located", "k_ready", "cumsum", "kkt")
CLOCK_LAST = ("end", "gt_start", "gt_end", "smid")
#: Stamps of value head j (named "h{j}.NAME"): L: after the L tile's elements, the wait for head
#: j - 1's A tile store with the barrier after it, and the L tile's stores; store_wait: right after L
#: (the wait moved before the stores; the stamp keeps the table's columns); subst: after the forward substitution; phase1 .. phase3:
#: after each product phase (its epilogue's shared stores included; phase3 after the proxy fence);
#: store_issue: after the TMA store of head j's A tile is issued.
CLOCK_HEAD = ("L", "store_wait", "subst", "phase1", "phase2", "phase3", "store_issue")
#: Stamps read right after a CTA barrier of the shipped kernel (made explicit in this build at the
#: point where TileLang places it: no barrier is added): they time the whole CTA's progress. The
#: others are thread 0's own progress (no barrier there). Thread 0 writes every stamp.
CLOCK_ALIGNED = frozenset({"k_ready", "kkt", "store_wait", "subst", "phase1", "phase2", "phase3"})

#: %smid and %globaltimer (no CUDA builtin reads them), put before the clocked kernel's source
_CLOCK_PRELUDE = """
__device__ __forceinline__ int flashqla_smid() {
  unsigned r;
  asm volatile("mov.u32 %0, %%smid;" : "=r"(r));
  return (int)r;
}
__device__ __forceinline__ long long flashqla_globaltimer() {
  unsigned long long t;
  asm volatile("mov.u64 %0, %%globaltimer;" : "=l"(t));
  return (long long)t;
}
"""


def clock_stamps(heads: int) -> list:
    """Names of the int64 stamps in one CTA's row of the clocked build's `clocks` output, in order:
    CLOCK_FIRST, CLOCK_LAST, then "h{j}.NAME" for each of the CTA's `heads` value heads (j = 0 ..
    heads - 1) and NAME in CLOCK_HEAD. A stamp not reached is left as the caller filled it."""
    return [*CLOCK_FIRST, *CLOCK_LAST, *(f"h{j}.{n}" for j in range(heads) for n in CLOCK_HEAD)]


def _clock_stamper(T, clocks, slot, hk, j=None):
    """stamp(name), emitting where it is called inside the clocked kernel body: for a name in
    CLOCK_ALIGNED a CTA barrier first, then thread 0 writes the stamp to clocks[slot, hk, index]
    (value head j's CLOCK_HEAD stamps when j is given, a TIR loop variable)."""
    fixed = CLOCK_FIRST + CLOCK_LAST

    def stamp(name):
        i = fixed.index(name) if j is None else len(fixed) + j * len(CLOCK_HEAD) + CLOCK_HEAD.index(name)
        aligned = name in CLOCK_ALIGNED

        @T.macro
        def emit():
            if aligned:
                T.sync_threads()
            if T.get_thread_binding() == 0:
                if name == "smid":
                    clocks[slot, hk, i] = T.cast(T.call_extern("int32", "flashqla_smid"), "int64")
                elif name.startswith("gt_"):
                    clocks[slot, hk, i] = T.call_extern("int64", "flashqla_globaltimer")
                else:
                    clocks[slot, hk, i] = T.call_extern("int64", "clock64")

        emit()

    return stamp


def value_head_stages(T, *, j, G, hk, nvalid, row0, A, dtype, gemm_nt, kk_f, gc_s, b_s, g_row, g_col, b_row, ld_s,
                      lbt_s, l2t_s, d2t_s, b0t_s, dm_s, y_s, zt, stage, y_f, w_f, z_f, o_f, xcol, bcl, stamp=None,
                      tx0=0, store=True, l_f=None, after_l=None):
    """Emits one value head's stages (L, the forward substitution, phases 1-3, the TMA store of
    A diag(beta)) where it is called inside a kernel body: value head hk * G + j of the slot whose rows
    start at row0, nvalid valid rows; the staging tile is `stage` (its first 64 columns) and -Z_top^T
    is `zt` (its first 32 rows). The buffers, the loop variable and the slot's values reach the stages through a closure (a macro
    argument would rename the TIR variables). stamp: None (the shipped build), or the phase-clock
    build's `stamp(name)`, called at each of CLOCK_HEAD's boundaries. tx0: the first thread of the
    warpgroup that runs the stages (0 in this kernel; a warp-specialised kernel's role passes its own).
    store=False leaves A diag(beta) in `stage` (fenced for the async proxy) with no TMA store and no
    wait for one; A, row0 and hk are then unused. l_f: the register fragment (C x C fp32, kk_f's
    layout) the L tile's elements are formed in before they are stored; None: kk_f itself (its
    K K^T then lost: only where one value head reads it). after_l (None: the shipped build): a T.macro
    emitted right after the L tile's stores (a fused kernel issues its Q K^T there, to run beside the
    substitution and the product phases)."""
    C = CHUNK
    BS = BLOCK
    HB = HALF
    RH = BLOCK // 2  # rows of a diagonal block's column one lane of the substitution holds

    @T.macro
    def stages():
        # L = beta_t (k_t . k_s) exp2(gc[t] - gc[s]) for s < t < nvalid, lower blocks only:
        # diagonal blocks -> ld_s, L10 and L32 -> l2t_s, Lb = L[32:, :32] -> lbt_s (transposed)
        for t in T.Parallel(C):
            g_row[t] = gc_s[j, t]
            b_row[t] = b_s[j, t]
        for s in T.Parallel(C):
            g_col[s] = gc_s[j, s]
        # the elements first, in registers and without a branch (their exp2s independent of each other),
        # then the stores, each a predicated store of a ready value
        lf = kk_f if l_f is None else l_f
        for t, s in T.Parallel(C, C):
            lf[t, s] = T.if_then_else(
                (t > s) & (t < nvalid),
                b_row[t] * kk_f[t, s] * T.exp2(T.if_then_else(t > s, g_row[t] - g_col[s], T.float32(0))),
                T.float32(0),
            )
        if store:
            # The previous head's A tile must have been read out of the staging tile by the copy
            # engine before the substitution below writes it. Only the thread that issued that
            # store has a bulk group to wait for: the barrier holds the others until it has (TileLang
            # inserts no barrier for the copy engine's reads; without this one nothing orders them).
            # Here, before the L tile's stores, it also stands for the barrier those stores need
            # after the previous head's reads of the same tiles.
            T.tma_store_wait(0)
            T.sync_threads()
        for t, s in T.Parallel(C, C):
            if t // BS == s // BS:
                ld_s[s, t % BS] = lf[t, s]
        for t, s in T.Parallel(C, C):
            if (t >= HB) & (s < HB):
                lbt_s[s, t - HB] = lf[t, s]
        for t, s in T.Parallel(C, C):
            if (t // BS == s // BS + 1) & (t // BS % 2 == 1):
                l2t_s[s % BS, (t // HB) * BS + t % BS] = lf[t, s]
        if after_l is not None:
            after_l()
        if stamp is not None:
            stamp("L")
            stamp("store_wait")

        # D^-1: warp blk solves diagonal block blk by forward substitution (WY-3's recursion, each
        # row's sum taken column by column), lane (hr, col) of the warp holding rows 8 hr .. 8 hr + 7 of
        # its column col: row m < 8 reaches the lanes of the lower rows by a shuffle; writes the rows where
        # the products read them, and times beta into the staging tile
        tx = T.get_thread_binding() - tx0 if tx0 else T.get_thread_binding()
        blk = tx // 32  # diagonal block blk on warp blk: its stores' branches warp-uniform
        col = tx % BS
        hr = (tx % 32) // BS
        for i in T.unroll(RH):
            xcol[i] = T.if_then_else(hr * RH + i == col, T.float32(1), T.float32(0))
        for m in T.unroll(BS):
            if m < RH:
                xm = T.shfl_sync(xcol[m], col)  # row m of column col, from lane col (hr = 0)
                for i in T.unroll(RH):
                    if (hr == 1) | (i > m):
                        xcol[i] = xcol[i] - ld_s[blk * BS + m, hr * RH + i] * xm
            else:
                for i in T.unroll(RH):
                    if i > m - RH:
                        if hr == 1:
                            xcol[i] = xcol[i] - ld_s[blk * BS + m, RH + i] * xcol[m - RH]
        bcl[0] = b_s[j, blk * BS + col]  # once: read inside the store loop it is re-read after every store
        # four rows at a time: the copies into the transposed operand tiles (row col, four contiguous
        # floats) as one 16-byte store each
        for r4 in T.unroll(RH // 4):
            for rr in T.unroll(4):
                r = hr * RH + r4 * 4 + rr
                stage[blk * BS + r, blk * BS + col] = T.cast(T.if_then_else(r >= col, xcol[r4 * 4 + rr] * bcl[0], T.float32(0)), dtype)
            if blk == 0:
                for rr in T.vectorized(4):
                    d2t_s[col, hr * RH + r4 * 4 + rr] = xcol[r4 * 4 + rr]
                for rr in T.vectorized(4):
                    b0t_s[col, hr * RH + r4 * 4 + rr] = xcol[r4 * 4 + rr]
            elif blk == 1:
                for rr in T.unroll(4):
                    dm_s[2 * BS + hr * RH + r4 * 4 + rr, col] = xcol[r4 * 4 + rr]
                for rr in T.vectorized(4):
                    b0t_s[BS + col, BS + hr * RH + r4 * 4 + rr] = xcol[r4 * 4 + rr]
            elif blk == 2:
                for rr in T.vectorized(4):
                    d2t_s[col, BS + hr * RH + r4 * 4 + rr] = xcol[r4 * 4 + rr]
                for rr in T.unroll(4):
                    dm_s[hr * RH + r4 * 4 + rr, col] = xcol[r4 * 4 + rr]
            else:
                for rr in T.unroll(4):
                    dm_s[BS + hr * RH + r4 * 4 + rr, BS + col] = xcol[r4 * 4 + rr]
        if stamp is not None:
            stamp("subst")

        # phase 1: [F32; F10] = [[0 | Ai33], [Ai11 | 0]] [L10; L32]  and  Z = blockdiag(Ai22, Ai33) Lb
        gemm_nt(dm_s, l2t_s, y_f, BS)
        gemm_nt(dm_s, lbt_s, z_f)
        for t, s in T.Parallel(HB, BS):
            y_s[(t + BS) % HB, ((t + BS) % HB // BS) * BS + s] = y_f[t, s]
        for t, n in T.Parallel(BS, HB):
            zt[n, t] = -z_f[t, n]
        if stamp is not None:
            stamp("phase1")

        # phase 2: [Ai10; Ai32] = -blockdiag(F10, F32) [Ai00; Ai22];  Q = Z - [0; F32 Z_top] onto Z
        gemm_nt(y_s, d2t_s, w_f)
        for kk in T.unroll(BS // 8, unroll_factor=1):  # K = 16 in rolled 8-wide slices (as gemm_nt)
            T.gemm(y_s[0:HB, BS + kk * 8 : BS + kk * 8 + 8], zt[0:HB, kk * 8 : kk * 8 + 8], z_f, transpose_B=True)
        for t, n in T.Parallel(HB, HB):
            lbt_s[t, n] = z_f[t, n]  # Q over Lb^T (read for the last time in phase 1)
        for t, s in T.Parallel(HB, BS):
            if t < BS:
                b0t_s[s, BS + t] = -w_f[t, s]
            stage[BS + t + (t // BS) * BS, s + (t // BS) * HB] = T.cast(-w_f[t, s] * b_s[j, s + (t // BS) * HB], dtype)
        if stamp is not None:
            stamp("phase2")

        # phase 3: A[32:, :32] = -Q B_0^-1
        gemm_nt(lbt_s, b0t_s, o_f)
        for t, s in T.Parallel(HB, HB):
            stage[HB + t, s] = T.cast(-o_f[t, s] * b_s[j, s], dtype)
        T.fence_proxy_async()
        if stamp is not None:
            stamp("phase3")
        if store:
            T.tma_copy(stage[:, 0:C], A[hk * G + j, row0 : row0 + C, 0:C])  # waited before the next head writes the tile
        if stamp is not None:
            stamp("store_issue")

    stages()


def _prepare_prim_func(H: int, HV: int, K: int, dtype: str, beta_dtype: str, seq_dtype: str, varlen: bool,
                       heads_per_cta: int | None = None, a_dtype: str | None = None, *, phase_clock: bool = False):
    """The TileLang kernel for one static configuration (arguments as `build_prepare_kernel`).

    The L tile's gates are read once per value head into register fragments (g at the rows and at
    the columns of kk_f this thread holds, beta at its rows), not from shared memory inside the
    element loop, whose stores to the L tiles may alias them.

    heads_per_cta: the value heads one CTA takes, a divisor of G = HV / H (None: G, one CTA per chunk
    slot and q/k head, K K^T formed once for its G value heads). 1: one CTA per chunk slot and value
    head (K K^T formed G times, by G times as many CTAs, each G times shorter; `pick_heads_per_cta`).

    a_dtype (None: k's dtype, the training forward's build, whose A the backward reads; "float16" for
    bf16 input: the inference forward's, `flashqla.ops.gdn.fwd.product_dtype`): the dtype A
    diag(beta) is stored in ("float16": 3 more mantissa bits than bf16; its entries stay within
    [-1, 1] on unit keys with beta in (0, 1], `benchmarks/journal/accuracy.md`), staged through a
    view of the k tile in that dtype (the same bytes).

    phase_clock (False: the shipped kernel, its source unchanged): the measurement build, with one
    more argument after g_cum_log2, clocks [R // 64, HV // heads_per_cta, len(clock_stamps(heads))]
    int64 (one row per CTA: slot, CTA row), where thread 0 writes the stamps of `clock_stamps`
    (CLOCK_ALIGNED: after a barrier the kernel has anyway). The same A and g_cum_log2 bit for bit."""
    import tilelang.language as T
    from tilelang.layout import make_linear_layout

    if K < CHUNK:
        raise ValueError(f"the prepare kernel stages the A tile in the k tile's first {CHUNK} columns: needs K >= {CHUNK}, got {K}")
    C = CHUNK
    G = HV // H
    BS = BLOCK
    HB = HALF
    acc = "float32"
    adt = a_dtype or dtype
    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")  # slot rows = slots * 64
    Np1 = T.dynamic("Np1")

    @T.macro
    def gemm_nt(a, b, c, a_row0=0):
        """c = a[a_row0 : a_row0 + 32, :32] b[:, :32]^T in slices of KSLICE, the slice loop kept rolled
        (unrolled, ptxas hoists the operand addresses of every slice out of the value-head loop and
        spills them)."""
        T.clear(c)
        for kk in T.unroll(HB // KSLICE, unroll_factor=1):
            T.gemm(a[a_row0 : a_row0 + HB, kk * KSLICE : (kk + 1) * KSLICE], b[:, kk * KSLICE : (kk + 1) * KSLICE], c,
                   transpose_B=True)

    # value heads per CTA (the grid's y extent is HV / P; CTA row hb reads q/k head hb // (G / P))
    P = heads_per_cta or G
    if G % P:
        raise ValueError(f"heads_per_cta must divide HV // H = {G}, got {P}")

    def k_head(hb):
        """The q/k head of CTA row hb (the identity when a CTA takes all G value heads)."""
        return hb if P == G else hb // (G // P)

    # the clocked build's extra argument; None, no tensor annotation, makes no kernel argument of
    # `clocks` (TileLang passes it as a Python value): the shipped signature
    clock_arg = T.Tensor((R // C, HV // P, len(clock_stamps(P))), "int64") if phase_clock else None
    prelude = _CLOCK_PRELUDE if phase_clock else None

    @T.prim_func  # (the kernel's symbol name is part of its generated source: kept as it was)
    def gdn_prepare_v3_fwd(
        k: T.Tensor((B, Tn, H, K), dtype),
        g: T.Tensor((B, Tn, HV), "float32"),
        beta: T.Tensor((B, Tn, HV), beta_dtype),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        A: T.Tensor((HV, R, C), adt),
        g_cum_log2: T.Tensor((HV, R), "float32"),
        clocks: clock_arg,
    ):
        with T.Kernel(R // C, HV // P, threads=128, prelude=prelude) as (slot, hk):  # slots on x (up to 2^31 - 1)
            T.annotate_min_blocks_per_sm(MIN_BLOCKS)
            stamp = _clock_stamper(T, clocks, slot, hk) if phase_clock else None
            if phase_clock:
                stamp("start")
                stamp("gt_start")
            cu_s = T.alloc_shared((128,), "int32") if varlen else None
            seq, chunk, bos, seqlen, bidx, nvalid, t0 = locate_slot(slot, cu_seqlens, Tn, Np1, varlen, cu_s=cu_s, threads=128)
            row0 = slot * C
            if phase_clock:
                stamp("located")

            # k (before the head loop), then A diag(beta) in k's dtype staged in [:, :64] for the TMA store
            ka_s = T.alloc_shared((C, K), dtype)
            # fp32 operand tiles ([rows, K] for A operands, [N, K] for B operands; columns 32..35 unused)
            dm_s = T.alloc_shared((3 * BS, ROW), acc)  # rows: [Ai22 | 0], [0 | Ai33], [Ai11 | 0]
            lbt_s = T.alloc_shared((HB, ROW), acc)  # Lb^T [s, t - 32]; then Q
            b0t_s = T.alloc_shared((HB, ROW), acc)  # (B_0^-1)^T
            l2t_s = T.alloc_shared((BS, ROW), acc)  # [L10; L32]^T
            d2t_s = T.alloc_shared((BS, ROW), acc)  # [Ai00; Ai22]^T
            ld_s = T.alloc_shared((C, DROW), acc)  # diagonal blocks of L, transposed: [s, t % 16]
            y_s = dm_s  # blockdiag(F10, F32) over rows 0..31: the same zero blocks as dm_s's
            zt_s = ld_s  # -Z_top^T in rows 0..31 (ld_s is dead after the substitution)
            gc_s = T.alloc_shared((P, C), acc)  # g_cum_log2 of the CTA's value heads, head-major
            b_s = T.alloc_shared((P, C), acc)
            T.annotate_layout({x: make_linear_layout(x) for x in (dm_s, lbt_s, b0t_s, l2t_s, d2t_s, ld_s)})
            kk_f = T.alloc_fragment((C, C), acc)
            l_f = T.alloc_fragment((C, C), acc) if P > 1 else None  # L of value head j (kk_f serves them all)
            g_row = T.alloc_fragment((C,), acc)  # gc of value head j at the rows of kk_f this thread holds
            g_col = T.alloc_fragment((C,), acc)  # ... at its columns
            b_row = T.alloc_fragment((C,), acc)  # beta of value head j at its rows
            y_f = T.alloc_fragment((HB, BS), acc)
            w_f = T.alloc_fragment((HB, BS), acc)
            z_f = T.alloc_fragment((HB, HB), acc)
            o_f = T.alloc_fragment((HB, HB), acc)
            xcol = T.alloc_local((BS // 2,), acc)
            bcl = T.alloc_local((1,), acc)  # beta of the column the substitution solves
            k_bar = T.alloc_barrier(128)  # every thread arrives; the copy engine completes the bytes

            if nvalid > 0:
                # k by the copy engine (zero-filled past the end of the tensor; rows past the end of
                # a packed sequence hold the next sequence's keys and are masked in L below)
                T.tma_copy(k[bidx, t0 : t0 + C, k_head(hk), 0:K], ka_s, barrier=k_bar)  # waited after g and beta
                T.barrier_arrive(k_bar)
                for t, j in T.Parallel(C, P):
                    gc_s[j, t] = T.if_then_else(t < nvalid, g[bidx, t0 + t, hk * P + j] * RCP_LN2, T.float32(0))
                    b_s[j, t] = T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hk * P + j], acc), T.float32(0))
                # blocks no value head writes, zeroed once: the off-diagonal blocks of the block-diagonal
                # operands and the upper block of (B_0^-1)^T
                for t, s in T.Parallel(3 * BS, HB):
                    dm_s[t, s] = T.float32(0)
                for t, s in T.Parallel(HB, HB):
                    y_s[t, s] = T.float32(0)
                    b0t_s[t, s] = T.float32(0)
                T.mbarrier_wait_parity(k_bar, 0)
                if phase_clock:
                    stamp("k_ready")
                T.cumsum(gc_s, dim=1)
                if phase_clock:
                    stamp("cumsum")
                T.gemm(ka_s, ka_s, kk_f, transpose_B=True, clear_accum=True)
                if phase_clock:
                    stamp("kkt")
                # k is dead: the staging tile's blocks above the diagonal blocks stay zero
                for t, s in T.Parallel(C, C):
                    ka_s[t, s] = T.cast(0, dtype)

                for j in T.serial(P):
                    value_head_stages(T, j=j, G=P, hk=hk, nvalid=nvalid, row0=row0, A=A, dtype=adt, gemm_nt=gemm_nt, kk_f=kk_f,
                                      gc_s=gc_s, b_s=b_s, g_row=g_row, g_col=g_col, b_row=b_row, ld_s=ld_s, lbt_s=lbt_s,
                                      l2t_s=l2t_s, d2t_s=d2t_s, b0t_s=b0t_s, dm_s=dm_s, y_s=y_s, zt=zt_s, stage=ka_s if adt == dtype else T.view(ka_s, dtype=adt), y_f=y_f,
                                      w_f=w_f, z_f=z_f, o_f=o_f, xcol=xcol, bcl=bcl,
                                      stamp=_clock_stamper(T, clocks, slot, hk, j) if phase_clock else None, l_f=l_f)
                T.tma_store_wait(0)

                for j, t in T.Parallel(P, C):
                    g_cum_log2[hk * P + j, row0 + t] = gc_s[j, t]
            if phase_clock:
                stamp("end")
                stamp("gt_end")
                stamp("smid")

    return gdn_prepare_v3_fwd


def build_prepare_kernel(H: int, HV: int, K: int, dtype: str, beta_dtype: str, seq_dtype: str, varlen: bool,
                         heads_per_cta: int | None = None, a_dtype: str | None = None):
    """Compiled prepare kernel for one static configuration (cached).

    Static key: head counts H, HV; head dim K (>= 64); dtype of k (and of the stored A); beta's dtype;
    cu_seqlens' dtype; whether input is packed (varlen); `heads_per_cta` (None: all HV / H value heads
    of a q/k head in one CTA; 1: one value head a CTA, `pick_heads_per_cta`). Sequence lengths, the
    number of sequences and B are run-time values: a new T or sequence mix reuses the compiled kernel.
    `a_dtype` ("float16", or None / dtype: the default build): the dtype A diag(beta) is stored in
    (the inference forward's fp16 A_beta product, `flashqla.ops.gdn.fwd.product_dtype`).
    Raises ValueError for a heads_per_cta other than None, 1 or HV / H.
    """
    if heads_per_cta == HV // H:
        heads_per_cta = None
    if heads_per_cta not in (None, 1):
        raise ValueError(f"heads_per_cta must be None, 1 or HV // H = {HV // H}, got {heads_per_cta!r}")
    if a_dtype is not None and a_dtype != dtype:
        return _build_prepare_kernel(H, HV, K, dtype, beta_dtype, seq_dtype, varlen, heads_per_cta, a_dtype)
    return _build_prepare_kernel(H, HV, K, dtype, beta_dtype, seq_dtype, varlen, heads_per_cta)


def build_prepare_kernel_clocked(H: int, HV: int, K: int, dtype: str, beta_dtype: str, seq_dtype: str, varlen: bool,
                                 heads_per_cta: int | None = None, a_dtype: str | None = None):
    """The phase-clock build of `build_prepare_kernel`'s kernel for the same key (cached; a measurement
    tool: `benchmarks/experiments/prepare_phase_clock.py`). Launched as kernel(k, g, beta, cu_seqlens,
    A, g_cum_log2, clocks), clocks [S, HV // heads, len(clock_stamps(heads))] int64 with S chunk
    slots and heads = heads_per_cta or HV // H: one row per CTA (slot, CTA row), its stamps in
    `clock_stamps` order (`_prepare_prim_func`'s phase_clock). A and g_cum_log2 are the default
    build's bit for bit. Raises ValueError as `build_prepare_kernel`."""
    if heads_per_cta == HV // H:
        heads_per_cta = None
    if heads_per_cta not in (None, 1):
        raise ValueError(f"heads_per_cta must be None, 1 or HV // H = {HV // H}, got {heads_per_cta!r}")
    if a_dtype == dtype:
        a_dtype = None
    return _build_prepare_kernel(H, HV, K, dtype, beta_dtype, seq_dtype, varlen, heads_per_cta, a_dtype, phase_clock=True)


@functools.lru_cache(maxsize=None)
def _build_prepare_kernel(H, HV, K, dtype, beta_dtype, seq_dtype, varlen, heads_per_cta, a_dtype=None, phase_clock=False):
    func = _prepare_prim_func(H, HV, K, dtype, beta_dtype, seq_dtype, varlen, heads_per_cta=heads_per_cta,
                              a_dtype=a_dtype, phase_clock=phase_clock)
    return compile_kernel(func, f"gdn_prepare_fwd_H{H}_HV{HV}_K{K}_{dtype}_{beta_dtype}_{seq_dtype}_{int(varlen)}"
                          + ("_one_head" if heads_per_cta == 1 else "") + (f"_A{a_dtype}" if a_dtype else "")
                          + ("_clock" if phase_clock else ""))


#: `pick_heads_per_cta` takes one value head a CTA while the grid of one CTA per chunk slot and q/k
#: head has at most this many CTAs (two per SM).
ONE_HEAD_MAX_CTAS = 2 * SM_COUNT


def pick_heads_per_cta(S: int, H: int, HV: int) -> int | None:
    """Value heads a prepare CTA takes for S chunk slots: 1 (one CTA per slot and value head) when
    G = HV / H > 1 and the S x H grid of one CTA per slot and q/k head has at most ONE_HEAD_MAX_CTAS
    CTAs (K K^T formed G times, but the SMs filled), else None (all G value heads: K K^T formed once)."""
    if HV // H == 1 or S * H > ONE_HEAD_MAX_CTAS:
        return None
    return 1


def prepare_kernel_args(k, beta, cu_seqlens, HV: int, a_dtype: torch.dtype | None = None) -> tuple:
    """The static key (`build_prepare_kernel` arguments) a launch with these inputs uses. The key ends
    with 1 where `pick_heads_per_cta` takes one value head a CTA (the slot count comes from shapes
    alone: no host synchronisation), then with A's dtype where `a_dtype` is not k's."""
    B, T, H, K = k.shape
    seq_dtype = tl_dtype(cu_seqlens.dtype) if cu_seqlens is not None else "int32"
    key = (H, HV, K, tl_dtype(k.dtype), tl_dtype(beta.dtype), seq_dtype, cu_seqlens is not None)
    N = cu_seqlens.numel() - 1 if cu_seqlens is not None else B
    one = pick_heads_per_cta(num_slots(B, T, N, cu_seqlens is not None), H, HV)
    if a_dtype is not None and a_dtype != k.dtype:
        return key + (one or None, tl_dtype(a_dtype))
    return key + (one,) if one else key


def chunk_prepare_fwd(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, cu_seqlens, HV: int, A=None, g_cum_log2=None,
                      a_dtype: torch.dtype | None = None):
    """Launches the prepare kernel. Arguments as in `chunk_gated_delta_rule` (validated by the caller,
    contiguous, on an sm_90 device): k [B, T, H, K] bf16/fp16, g [B, T, HV] fp32 (natural log), beta
    [B, T, HV] fp32 or k's dtype, cu_seqlens None or [N + 1] int32/int64. `A` and `g_cum_log2` may be
    given as preallocated outputs of the shapes below (tests poison them to prove every used row is
    written). a_dtype: A's dtype (None: k's; torch.float16: the inference forward's fp16 A_beta
    product for bf16 input, `flashqla.ops.gdn.fwd.product_dtype`); a given A's dtype decides instead.

    Returns:
        A: [HV, S * 64, 64] in a_dtype (k's by default), S = number of chunk slots (`_common.num_slots`); rows
            slot * 64 + t hold row t of chunk slot's A diag(beta) (lower triangular, zero rows past
            the end of the sequence).
        g_cum_log2: [HV, S * 64] fp32, chunk-local inclusive cumsum of g divided by ln 2 (rows past
            the end of the sequence repeat the last valid value).
    """
    B, T, H, K = k.shape
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    S = num_slots(B, T, N, varlen)
    if A is None:
        A = torch.empty(HV, S * CHUNK, CHUNK, dtype=a_dtype or k.dtype, device=k.device)
    if g_cum_log2 is None:
        g_cum_log2 = torch.empty(HV, S * CHUNK, dtype=torch.float32, device=k.device)
    if S == 0 or T == 0:
        return A, g_cum_log2
    cu = cu_seqlens if varlen else dummy_cu_seqlens(k.device)
    kernel = build_prepare_kernel(*prepare_kernel_args(k, beta, cu_seqlens, HV, A.dtype))
    kernel(k, g, beta, cu, A, g_cum_log2)
    return A, g_cum_log2

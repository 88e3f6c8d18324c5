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
(the 8 x 8 diagonal blocks), WY-4 with two blocks, applied at 16, 32 and 64 (recursive doubling),
RW-2 (beta folded into the stored operand), RW-4 (exp2 of base-2 differences). Value head hv reads
q/k head hv // G, G = HV / H.

The inverse, by recursive doubling in an fp16 tile M (I + L, then the inverse, in place; every
product an mma.sync of fp16 operands with fp32 accumulation, `value_head_stages`): at each level,
for neighbouring inverted diagonal blocks P^-1, Q^-1,
    [[P, 0], [C, Q]]^-1 = [[P^-1, 0], [-Q^-1 C P^-1, Q^-1]]
    level 1  the 8 x 8 diagonal blocks by column elimination (lanes 0-15 of warp w, one row each of
             rows 16 w .. 16 w + 15, fp32 in registers, shuffles inside each group of 8 lanes)
    level 2  the 16-blocks: warp w's, two m16n8k8 products (Y = Q^-1 C, then -Y P^-1, Y re-packed in
             registers as the second's A operand)
    level 3  the 32-blocks: warps 2b and 2b + 1 both form Y at m16n8k16, each stores its 8 columns
             of -Y P^-1
    level 4  A[32:, :32] = -B_1^-1 Lb B_0^-1: each warp a 16 x 16 tile (the products' zero blocks skipped)
fp16 keeps 3 more mantissa bits than A's bf16 store, and the inverse stays small on valid inputs
(||(I + L)^-1||_2 below 2.5 over notebook 20's sweep of unit keys and beta in (0, 1], observed):
`reference.gdn.fused.solve_tril_doubling` with `storage=torch.float16` is the twin of these
roundings, `reference.gdn.numerics.inverse_error(L, "fp16 mma", "doubling")` their error.

Per CTA (128 threads, one warpgroup):
1. map the slot to (sequence, chunk) (packed input: one load of cu_seqlens per thread and one counting
   barrier while N < 128, two such rounds up to 16,256 sequences, else a binary search;
   `_common.locate_slot`);
2. issue the TMA load of the k tile of q/k head hk; load g and beta of its value heads (zero past the
   end); wait for k; g_cum_log2 = cumsum(g) / ln 2;
3. K K^T on the tensor cores (wgmma), held in registers for the value heads;
4. per value head j: L (its elements formed in registers without a branch, one exp2 each, in a
   fragment of their own when the CTA has several value heads, whose K K^T the elements would
   otherwise overwrite; stored into M in fp16) -> levels 1-4 -> A diag(beta) into a staging tile (the
   diagonal 32-blocks from M, the block below from level 4's registers) -> its TMA store (the store of
   head j overlaps head j + 1's L; waited before head j + 1 writes the staging tile);
5. g_cum_log2 of the value heads (64 contiguous floats per head).
Shared memory: the k tile (which is also the staging tile), M (64 x 72 halves, rows 144 B apart:
conflict-free ldmatrix), g_cum and beta of the value heads; launch bounds (128, 5), 96 registers.

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

#: Half chunk: the two diagonal 32 x 32 blocks of the inverse's last level
HALF = CHUNK // 2
#: Row length of the fp16 tile the inverse is formed in (64 + 8 halves: ldmatrix rows 144 B apart,
#: conflict free)
M_ROW = CHUNK + 8
#: CTAs per SM the kernel is built for (launch bounds: 96 registers)
MIN_BLOCKS = 5

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
#: (the wait moved before the stores; the stamp keeps the table's columns); level12: after the
#: inverse's levels 1 and 2 (the barrier before level 3); level3: after level 3 (the barrier before
#: level 4); level4: after level 4's products (thread 0's); stage: after A diag(beta) is written into
#: the staging tile and fenced; store_issue: after the TMA store of head j's A tile is issued.
CLOCK_HEAD = ("L", "store_wait", "level12", "level3", "level4", "stage", "store_issue")
#: Stamps read right after a CTA barrier of the shipped kernel (made explicit in this build at the
#: point where TileLang places it: no barrier is added): they time the whole CTA's progress. The
#: others are thread 0's own progress (no barrier there). Thread 0 writes every stamp.
CLOCK_ALIGNED = frozenset({"k_ready", "kkt", "store_wait", "level12", "level3"})

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


def alloc_inverse_locals(T) -> dict:
    """The per-thread registers of `value_head_stages`' inverse (allocate once where the kernel's other
    buffers are allocated, pass as `inv`): a row of level 1 (fp16 and fp32), its column scale, and the
    mma.sync operands and accumulators of levels 2-4."""
    f16, f32 = "float16", "float32"
    return dict(fh=T.alloc_local((8,), f16), f=T.alloc_local((8,), f32), sc=T.alloc_local((1,), f32),
                a8=T.alloc_local((4,), f16), b8=T.alloc_local((2,), f16), y8=T.alloc_local((4,), f32),
                a16=T.alloc_local((8,), f16), b16=T.alloc_local((8,), f16), y16=T.alloc_local((8,), f32),
                o16=T.alloc_local((8,), f32))


def diagonal_blocks_8x8(T, m_s, inv, w, lane):
    """Level 1 of the inverse (WY-3) as a T.macro to call inside a kernel body run by one warpgroup,
    whose warp w (0-3) and lane are given (TIR expressions): the 8 x 8 diagonal blocks of the unit lower triangular fp16 tile m_s
    (I + L on and below the diagonal; what is above is ignored) replaced by their inverses, in place.
    Lane i < 16 of warp w holds row r = 16 w + i in fp32 (1 on the diagonal, 0 above) and eliminates
    column by column: step s subtracts L[r, s] x (row s of the inverse, from lane s of its group of 8
    by a shuffle); lanes 16-31 take part in the shuffles only (no load, no store). Each warp reads and
    writes only its own 16 rows. inv: `alloc_inverse_locals`' registers (fh, f, sc)."""
    f16, f32 = "float16", "float32"
    fh, f, sc = inv["fh"], inv["f"], inv["sc"]

    @T.macro
    def level1():
        r = 16 * w + lane % 16
        cb = (r // 8) * 8
        lr = lane % 8
        if lane < 16:
            for jj in T.vectorized(8):
                fh[jj] = m_s[r, cb + jj]
        for jj in T.unroll(8):
            f[jj] = T.if_then_else(jj == lr, T.float32(1), T.if_then_else(jj > lr, T.float32(0), T.cast(fh[jj], f32)))
        for s in T.unroll(7):
            sc[0] = -f[s]
            for i in T.unroll(7):
                if i < s:
                    v = T.shfl_sync(f[i], s, 8)
                    if lr > s:
                        f[i] = f[i] + sc[0] * v
            if lr > s:
                f[s] = sc[0]
        for jj in T.unroll(8):
            fh[jj] = T.cast(f[jj], f16)
        if lane < 16:
            for jj in T.vectorized(8):
                m_s[r, cb + jj] = fh[jj]

    return level1


def _mma_f16(T, shape, a, b, b_off, c, c_off):
    """Emits one fp16 mma.sync (`shape` "m16n8k8" or "m16n8k16", fp32 accumulation) on register arrays:
    A from a[0:], B from b[b_off:], C / D in place at c[c_off:] (a statement, via T.evaluate)."""
    T.evaluate(T.ptx_mma("float32", shape, "row", "col", "fp16", "fp16", "fp32", a.data, 0, b.data, b_off, c.data, c_off,
                         T.bool(False)))


def _ldsm(T, m_s, trans, num, row, col, dst, n):
    """Emits one ldmatrix (x`num`, transposed when `trans`) from m_s[row, col] (each lane's row address)
    into the register array dst (n halves)."""
    T.evaluate(T.ptx_ldmatrix(T.bool(trans), num, T.access_ptr(m_s[row, col], "r", extent=8),
                              T.access_ptr(dst[0], "w", extent=n)))


#: movmatrix (sm_75+): the transpose of an 8 x 8 16-bit matrix held in the mma.sync fragment layout (lane
#: l: row l / 4, columns 2 (l % 4) and + 1), in registers. Put before a kernel's source (T.Kernel's
#: prelude) that calls `diagonal_blocks_8x8_mma`.
MOVMATRIX_PRELUDE = """
__device__ __forceinline__ void flashqla_movtrans(void* dst, const void* src) {
  asm volatile("movmatrix.sync.aligned.m8n8.trans.b16 %0, %1;"
               : "=r"(*reinterpret_cast<unsigned*>(dst)) : "r"(*reinterpret_cast<const unsigned*>(src)));
}
"""


def alloc_level1_locals(T) -> dict:
    """The per-thread registers of `diagonal_blocks_8x8_mma` (allocate where the kernel's other buffers
    are allocated, pass as `l1`): three A fragments (I - L, then X2; hi and lo of L^2) and two B
    fragments (hi and lo of L^2, then of L^4), fp16; the two 16 x 8 fp32 accumulators."""
    f16, f32 = "float16", "float32"
    return dict(xa=T.alloc_local((8,), f16), ha=T.alloc_local((8,), f16), la=T.alloc_local((8,), f16),
                hb=T.alloc_local((4,), f16), lb=T.alloc_local((4,), f16), x=T.alloc_local((4,), f32),
                z=T.alloc_local((4,), f32))


def diagonal_blocks_8x8_mma(T, m_s, inv, l1, w, lane):
    """Level 1 of the inverse by products (WY-6) as a T.macro, in place of `diagonal_blocks_8x8` (same
    call, same result up to the roundings of `reference.gdn.fused.solve_tril_block_product` with
    storage=torch.float16): warp w's two 8 x 8 diagonal blocks of the fp16 tile m_s (L strictly lower
    there: 0 on and above the diagonal) replaced by (I + L_b)^-1 = (I - L_b)(I + L_b^2)(I + L_b^4),
    both blocks at once as m16n8k16 mma.sync products whose A operand is blockdiag(M_b0, M_b1)
    (16 x 16, the off-diagonal quadrants zero) and whose B operand is [M_b0; M_b1] (16 x 8): the
    accumulator of such a product is the A operand of the next one as it is (its two row halves are
    the two blocks' rows) and, transposed by movmatrix, its B operand. L^2 and L^4 enter their products
    as fp16 pairs hi + lo (a single rounding of them loses accuracy on strongly correlated keys, where
    their entries grow). All 32 lanes of the four warps work: eight products and eight movmatrix a warp.
    Needs `MOVMATRIX_PRELUDE` in the kernel's prelude; inv: `alloc_inverse_locals`' a16, b16 (the L
    fragments); l1: `alloc_level1_locals`."""
    f16, f32 = "float16", "float32"
    aL, bL = inv["a16"], inv["b16"]
    xa, ha, la, hb, lb, x, z = (l1[n] for n in ("xa", "ha", "la", "hb", "lb", "x", "z"))

    def mma(a, b, c):
        _mma_f16(T, "m16n8k16", a, b, 0, c, 0)

    def ldsm(trans, num, row, col, dst, n):
        _ldsm(T, m_s, trans, num, row, col, dst, n)

    def movtrans(dst, i, src, j):
        T.evaluate(T.call_extern("handle", "flashqla_movtrans", T.access_ptr(dst[i], "w", extent=2),
                                 T.access_ptr(src[j], "r", extent=2)))

    @T.macro
    def pair_operands():
        # z (L^2 or L^4, fp32) as the fp16 pair hi + lo: the A operands ha, la (blockdiag: the two row
        # halves) and, transposed, the B operands hb, lb
        for e in T.unroll(2):
            ha[e] = T.cast(z[e], f16)
            ha[6 + e] = T.cast(z[2 + e], f16)
            la[e] = T.cast(z[e] - T.cast(ha[e], f32), f16)
            la[6 + e] = T.cast(z[2 + e] - T.cast(ha[6 + e], f32), f16)
        movtrans(hb, 0, ha, 0)
        movtrans(hb, 2, ha, 6)
        movtrans(lb, 0, la, 0)
        movtrans(lb, 2, la, 6)

    @T.macro
    def level1():
        gq = lane // 4
        c2 = (lane % 4) * 2
        r0 = 16 * w
        ldsm(False, 4, r0 + lane % 16, r0 + (lane // 16) * 8, aL, 8)  # the 16 x 16 tile at (r0, r0)
        ldsm(True, 2, r0 + lane % 16, r0 + ((lane % 16) // 8) * 8, bL, 4)  # [L_b0; L_b1] as a B operand
        for i in T.unroll(4):
            aL[2 + i] = T.cast(0, f16)  # blockdiag: the quadrants off the two diagonal blocks
            xa[2 + i] = T.cast(0, f16)
            ha[2 + i] = T.cast(0, f16)
            la[2 + i] = T.cast(0, f16)
        # X1 = I - L (A operand) and its fp32 copy, the accumulator of X2
        for e in T.unroll(2):
            xa[e] = T.cast(T.if_then_else(gq == c2 + e, T.float32(1), T.float32(0)) - T.cast(aL[e], f32), f16)
            xa[6 + e] = T.cast(T.if_then_else(gq == c2 + e, T.float32(1), T.float32(0)) - T.cast(aL[6 + e], f32), f16)
            x[e] = T.cast(xa[e], f32)
            x[2 + e] = T.cast(xa[6 + e], f32)
        # L^2, then its hi + lo pair as A (blockdiag) and B (transposed) operands
        for i in T.unroll(4):
            z[i] = T.float32(0)
        mma(aL, bL, z)
        pair_operands()
        # X2 = X1 + X1 L^2
        mma(xa, hb, x)
        mma(xa, lb, x)
        # L^4 = L^2 L^2 (hi hi + hi lo + lo hi)
        for i in T.unroll(4):
            z[i] = T.float32(0)
        mma(ha, hb, z)
        mma(ha, lb, z)
        mma(la, hb, z)
        # L^4's pair as B operands, X2 as the A operand
        pair_operands()
        for e in T.unroll(2):
            xa[e] = T.cast(x[e], f16)
            xa[6 + e] = T.cast(x[2 + e], f16)
        # X3 = X2 + X2 L^4 = (I + L_b)^-1, both blocks, into m_s
        mma(xa, hb, x)
        mma(xa, lb, x)
        for e in T.unroll(2):
            m_s[r0 + gq, r0 + c2 + e] = T.cast(x[e], f16)
            m_s[r0 + 8 + gq, r0 + 8 + c2 + e] = T.cast(x[2 + e], f16)

    return level1


def value_head_stages(T, *, j, G, hk, nvalid, row0, A, dtype, kk_f, gc_s, b_s, g_row, g_col, b_row, m_s, inv, stage,
                      stamp=None, tx0=0, store=True, l_f=None, after_l=None, stage_slot=None, before_stage=None,
                      l1=None):
    """Emits one value head's stages (L, the inverse's four levels, A diag(beta) into the staging tile,
    its TMA store) where it is called inside a kernel body run by one warpgroup (128 threads): value
    head hk * G + j of the slot whose rows start at row0, nvalid valid rows; the staging tile is
    `stage` (its first 64 columns; the block above the diagonal 32-blocks must hold zeros, written by
    the caller once), m_s the [64, M_ROW] fp16 tile the inverse is formed in, inv the registers of
    `alloc_inverse_locals`. The buffers, the loop variable and the slot's values reach the stages through a closure (a macro
    argument would rename the TIR variables). stamp: None (the shipped build), or the phase-clock
    build's `stamp(name)`, called at each of CLOCK_HEAD's boundaries. tx0: the first thread of the
    warpgroup that runs the stages (0 in this kernel; a warp-specialised kernel's role passes its own).
    store=False leaves A diag(beta) in `stage` (fenced for the async proxy) with no TMA store and no
    wait for one; A, row0 and hk are then unused. l_f: the register fragment (C x C fp32, kk_f's
    layout) the L tile's elements are formed in before they are stored; None: kk_f itself (its
    K K^T then lost: only where one value head reads it). after_l (None: the shipped build): a T.macro
    emitted right after the L tile's stores (a fused kernel issues its Q K^T there, to run beside the
    inverse). stage_slot (None: the shipped build): `stage` is a ring [slots, 64, >= 64] and A diag(beta)
    goes to its slot `stage_slot`; before_stage (None: the shipped build): a T.macro emitted right
    before A diag(beta) is written (a fused kernel waits there until its consumer has released the slot).
    l1 (None: the shipped build, level 1 by `diagonal_blocks_8x8`): `alloc_level1_locals`' registers,
    level 1 then by `diagonal_blocks_8x8_mma` (the kernel's prelude must hold `MOVMATRIX_PRELUDE`; used by
    the fused forward experiment's builds "2m" / "2hm"; the prepare kernel keeps the substitution,
    `benchmarks/journal/forward.md`, "The inverse's first level by products")."""
    C = CHUNK
    HB = HALF
    f16, f32 = "float16", "float32"
    a8, b8, y8 = inv["a8"], inv["b8"], inv["y8"]
    a16, b16, y16, o16 = inv["a16"], inv["b16"], inv["y16"], inv["o16"]

    # (plain Python helpers: each call's value is emitted as a statement by T.evaluate)
    def mma(shape, a, b, b_off, c, c_off):
        _mma_f16(T, shape, a, b, b_off, c, c_off)

    def ldsm(trans, num, row, col, dst, n):
        _ldsm(T, m_s, trans, num, row, col, dst, n)

    @T.macro
    def stages():
        # L = beta_t (k_t . k_s) exp2(gc[t] - gc[s]) for s < t < nvalid, the whole tile (zeros on and
        # above the diagonal) into m_s in fp16
        for t in T.Parallel(C):
            g_row[t] = gc_s[j, t]
            b_row[t] = b_s[j, t]
        for s in T.Parallel(C):
            g_col[s] = gc_s[j, s]
        # the elements first, in registers and without a branch (their exp2s independent of each other),
        # then the stores
        lf = kk_f if l_f is None else l_f
        for t, s in T.Parallel(C, C):
            lf[t, s] = T.if_then_else(
                (t > s) & (t < nvalid),
                b_row[t] * kk_f[t, s] * T.exp2(T.if_then_else(t > s, g_row[t] - g_col[s], T.float32(0))),
                T.float32(0),
            )
        if store:
            # The previous head's A tile must have been read out of the staging tile by the copy
            # engine before this head writes it (below). Only the thread that issued that store has a
            # bulk group to wait for: the barrier holds the others until it has (TileLang inserts no
            # barrier for the copy engine's reads; without this one nothing orders them). Here,
            # before m_s's stores, it also stands for the barrier those need after the previous
            # head's reads of m_s.
            T.tma_store_wait(0)
            T.sync_threads()
        for t, s in T.Parallel(C, C):
            m_s[t, s] = T.cast(lf[t, s], f16)
        if after_l is not None:
            after_l()
        if stamp is not None:
            stamp("L")
            stamp("store_wait")

        tx = T.get_thread_binding() - tx0 if tx0 else T.get_thread_binding()
        w = tx // 32
        lane = tx % 32
        gq = lane // 4  # the mma fragments' row (and row + 8) ...
        c2 = (lane % 4) * 2  # ... and column pair of this lane

        if l1 is None:
            diagonal_blocks_8x8(T, m_s, inv, w, lane)()
        else:
            diagonal_blocks_8x8_mma(T, m_s, inv, l1, w, lane)()

        # Every store into m_s below follows reads of the same elements by other lanes, and every
        # level reads what other lanes stored: TileLang's barrier pass puts a barrier of the
        # warpgroup at each (it cannot see that levels 1 and 2 stay inside a warp; none is written
        # here, so that a warp-specialised kernel's role gets its own), and no store is inside a
        # branch that only some warps take (a barrier there would be one those warps never reach).

        # level 2 (WY-4, two blocks): warp w's 16-block at b2 = 16 w, [[P, 0], [Cl, Q]]: Y = Q^-1 Cl,
        # then -Y P^-1 into Cl's place (m16n8k8; rows 8-15 of the A operands repeat rows 0-7)
        b2 = 16 * w
        ldsm(False, 2, b2 + 8 + lane % 8, b2 + 8, a8, 4)
        ldsm(True, 1, b2 + 8 + lane % 8, b2, b8, 2)
        for i in T.unroll(4):
            y8[i] = T.float32(0)
        mma("m16n8k8", a8, b8, 0, y8, 0)
        for i in T.unroll(4):
            a8[i] = T.cast(y8[i], f16)  # the accumulator's layout is the next A operand's
            y8[i] = T.float32(0)
        ldsm(True, 1, b2 + lane % 8, b2, b8, 2)
        mma("m16n8k8", a8, b8, 0, y8, 0)
        m_s[b2 + 8 + gq, b2 + c2] = T.cast(-y8[0], f16)
        m_s[b2 + 8 + gq, b2 + c2 + 1] = T.cast(-y8[1], f16)
        if stamp is not None:
            stamp("level12")

        # level 3: the 32-block at b3 = 32 (w // 2) on warps 2 (w // 2) and 2 (w // 2) + 1, both forming
        # Y = Q^-1 Cl (m16n8k16, two n-tiles), each then its n-tile nq = w % 2 of -Y P^-1
        b3 = 32 * (w // 2)
        nq = w % 2
        ldsm(False, 4, b3 + 16 + lane % 16, b3 + 16 + (lane // 16) * 8, a16, 8)
        ldsm(True, 4, b3 + 16 + lane % 16, b3 + (lane // 16) * 8, b16, 8)
        for i in T.unroll(8):
            y16[i] = T.float32(0)
        mma("m16n8k16", a16, b16, 0, y16, 0)
        mma("m16n8k16", a16, b16, 4, y16, 4)
        for i in T.unroll(8):
            a16[i] = T.cast(y16[i], f16)
        for i in T.unroll(4):
            o16[i] = T.float32(0)
        ldsm(True, 2, b3 + lane % 16, b3 + 8 * nq, b16, 4)
        mma("m16n8k16", a16, b16, 0, o16, 0)
        for h in T.unroll(2):
            for e in T.unroll(2):
                m_s[b3 + 16 + gq + 8 * h, b3 + 8 * nq + c2 + e] = T.cast(-o16[2 * h + e], f16)
        if stamp is not None:
            stamp("level3")

        # level 4: warp w, the 16 x 16 tile (rows 32 + 16 rb, columns 16 cq) of -B_1^-1 Lb B_0^-1, Lb =
        # L[32:, :32]: per 16 columns s of Y = B_1^-1 Lb (k over B_1^-1's columns, the zero block of
        # rows 32-47 skipped), then its share of Y B_0^-1 (s = 0 skipped for cq = 1: B_0^-1 is zero
        # in rows 0-15 past column 15)
        rb = w // 2
        cq = w % 2
        for i in T.unroll(8):
            o16[i] = T.float32(0)
        for s in T.unroll(2):
            if (cq == 0) | (s == 1):
                for i in T.unroll(8):
                    y16[i] = T.float32(0)
                for kk in T.unroll(2):
                    if (rb == 1) | (kk == 0):
                        ldsm(False, 4, HB + 16 * rb + lane % 16, HB + 16 * kk + (lane // 16) * 8, a16, 8)
                        ldsm(True, 4, HB + 16 * kk + lane % 16, 16 * s + (lane // 16) * 8, b16, 8)
                        mma("m16n8k16", a16, b16, 0, y16, 0)
                        mma("m16n8k16", a16, b16, 4, y16, 4)
                for i in T.unroll(8):
                    a16[i] = T.cast(y16[i], f16)
                ldsm(True, 4, 16 * s + lane % 16, 16 * cq + (lane // 16) * 8, b16, 8)
                mma("m16n8k16", a16, b16, 0, o16, 0)
                mma("m16n8k16", a16, b16, 4, o16, 4)
        if stamp is not None:
            stamp("level4")

        # A diag(beta) (RW-2) into the staging tile: the diagonal 32-blocks from m_s, the block below
        # them from level 4's registers
        if before_stage is not None:
            before_stage()
        if stage_slot is None:
            for t, s in T.Parallel(C, HB):
                stage[t, (t // HB) * HB + s] = T.cast(T.cast(m_s[t, (t // HB) * HB + s], f32) * b_s[j, (t // HB) * HB + s], dtype)
            for nt in T.unroll(2):
                for h in T.unroll(2):
                    for e in T.unroll(2):
                        stage[HB + 16 * rb + gq + 8 * h, 16 * cq + 8 * nt + c2 + e] = T.cast(
                            -o16[4 * nt + 2 * h + e] * b_s[j, 16 * cq + 8 * nt + c2 + e], dtype)
        else:
            for t, s in T.Parallel(C, HB):
                stage[stage_slot, t, (t // HB) * HB + s] = T.cast(
                    T.cast(m_s[t, (t // HB) * HB + s], f32) * b_s[j, (t // HB) * HB + s], dtype)
            for nt in T.unroll(2):
                for h in T.unroll(2):
                    for e in T.unroll(2):
                        stage[stage_slot, HB + 16 * rb + gq + 8 * h, 16 * cq + 8 * nt + c2 + e] = T.cast(
                            -o16[4 * nt + 2 * h + e] * b_s[j, 16 * cq + 8 * nt + c2 + e], dtype)
        T.fence_proxy_async()
        if stamp is not None:
            stamp("stage")
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
    HB = HALF
    acc = "float32"
    adt = a_dtype or dtype
    B = T.dynamic("B")
    Tn = T.dynamic("T")
    R = T.dynamic("R")  # slot rows = slots * 64
    Np1 = T.dynamic("Np1")

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
            m_s = T.alloc_shared((C, M_ROW), "float16")  # I + L, then the inverse, in place (`value_head_stages`)
            gc_s = T.alloc_shared((P, C), acc)  # g_cum_log2 of the CTA's value heads, head-major
            b_s = T.alloc_shared((P, C), acc)
            T.annotate_layout({m_s: make_linear_layout(m_s)})
            kk_f = T.alloc_fragment((C, C), acc)
            l_f = T.alloc_fragment((C, C), acc) if P > 1 else None  # L of value head j (kk_f serves them all)
            g_row = T.alloc_fragment((C,), acc)  # gc of value head j at the rows of kk_f this thread holds
            g_col = T.alloc_fragment((C,), acc)  # ... at its columns
            b_row = T.alloc_fragment((C,), acc)  # beta of value head j at its rows
            inv = alloc_inverse_locals(T)
            k_bar = T.alloc_barrier(128)  # every thread arrives; the copy engine completes the bytes

            if nvalid > 0:
                # k by the copy engine (zero-filled past the end of the tensor; rows past the end of
                # a packed sequence hold the next sequence's keys and are masked in L below)
                T.tma_copy(k[bidx, t0 : t0 + C, k_head(hk), 0:K], ka_s, barrier=k_bar)  # waited after g and beta
                T.barrier_arrive(k_bar)
                for t, j in T.Parallel(C, P):
                    gc_s[j, t] = T.if_then_else(t < nvalid, g[bidx, t0 + t, hk * P + j] * RCP_LN2, T.float32(0))
                    b_s[j, t] = T.if_then_else(t < nvalid, T.cast(beta[bidx, t0 + t, hk * P + j], acc), T.float32(0))
                T.mbarrier_wait_parity(k_bar, 0)
                if phase_clock:
                    stamp("k_ready")
                T.cumsum(gc_s, dim=1)
                if phase_clock:
                    stamp("cumsum")
                T.gemm(ka_s, ka_s, kk_f, transpose_B=True, clear_accum=True)
                if phase_clock:
                    stamp("kkt")
                # k is dead: the staging tile's block above the diagonal 32-blocks stays zero
                for t, s in T.Parallel(C, C):
                    ka_s[t, s] = T.cast(0, dtype)

                for j in T.serial(P):
                    value_head_stages(T, j=j, G=P, hk=hk, nvalid=nvalid, row0=row0, A=A, dtype=adt, kk_f=kk_f, gc_s=gc_s,
                                      b_s=b_s, g_row=g_row, g_col=g_col, b_row=b_row, m_s=m_s, inv=inv,
                                      stage=ka_s if adt == dtype else T.view(ka_s, dtype=adt),
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

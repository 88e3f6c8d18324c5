"""The segment tables of context parallelism in one launch.

`flashqla.cp.segments.build_segment_tables` derives the segment tables of a packed batch from the
device tensor `cu_seqlens` with about fifty small torch ops (a searchsorted, gathers, masks, a
concatenation); they depend on the offsets' values, so they are rebuilt on every split forward and
backward. `segment_tables` computes the same fields (same dtypes and values, bit for bit) with one
TileLang kernel launch and returns them as plain tensors (`flashqla.cp.segments.segment_tables_device`
wraps them).

No host synchronisation: the output sizes come from shapes only (N = cu_seqlens.numel() - 1,
M = T // L + N), nothing reads a device value on the host (no `.item()`, `.tolist()`, `.cpu()`),
and every size the kernel needs (N, M, L) is a run-time argument, so a new sequence mix, a new
segment length or a new T never recompiles. Compile key: the dtype of cu_seqlens only.

Kernel (`cp_segment_tables`): grid ceil((M + 1) / 128) CTAs of 128 threads (M + 1 > N always, since
M = floor(T / L) + N). Thread i works on three independent items, with no shared memory and no
barrier:
    slot i < M        a binary search (32 halvings, any N < 2^31) for the largest sequence n in
                      [0, N) whose first slot base(n) = floor(cu[n] / L) + n is <= i (0 when none, as
                      the torch code's clamp), then every per-slot field is arithmetic on cu[n],
                      cu[n + 1] in int64; the search compares cu[n] < (i - n + 1) L, which is
                      base(n) <= i without a division;
    i == M            the last pseudo offset, cu[N];
    sequence i < N    seq_first, seq_num, seq_last.

Memory: the six int64 per-slot fields are rows of one [6, MS] buffer, the five flags rows of one
[5, MS] uint8 buffer returned as bool views, and the three per-sequence fields rows of one [3, NS]
int64 buffer (MS, NS: M, N rounded up to ROW_ALIGN elements, so every row starts 64-byte aligned).
Each field is a contiguous 1-D view of the size `build_segment_tables` returns.
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import compile_kernel, on_sm90

__all__ = ["INT32_MAX", "ROW_ALIGN", "THREADS", "build_segment_tables_kernel", "kernel_supported", "segment_tables"]

#: Threads per CTA; thread i of the grid owns slot i, sequence i and (i == M) the last pseudo offset.
THREADS = 128
#: Row length of the packed output buffers is rounded up to this many elements (64-byte aligned rows).
ROW_ALIGN = 64
#: Sizes passed to the kernel as int32 (dynamic shapes and L) must stay below this.
INT32_MAX = 2**31 - 1

_SEQ_DTYPES = {torch.int32: "int32", torch.int64: "int64"}


def _tables_prim_func(seq_dtype: str):
    import tilelang.language as T

    i64 = "int64"
    TH = THREADS
    Np1 = T.dynamic("Np1")  # N + 1 offsets
    Mp1 = T.dynamic("Mp1")  # M + 1 pseudo offsets
    MS = T.dynamic("MS")  # row stride of the per-slot buffers (>= M)
    NS = T.dynamic("NS")  # row stride of the per-sequence buffer (>= N)

    @T.prim_func
    def cp_segment_tables(
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        L: T.int32,
        pseudo: T.Tensor((Mp1,), seq_dtype),
        slot_tab: T.Tensor((6, MS), "int64"),  # seq, index, start, end, prev, h0_index
        flag_tab: T.Tensor((5, MS), "uint8"),  # valid, first, last, need_transition, need_correction
        seq_tab: T.Tensor((3, NS), "int64"),  # seq_first, seq_num, seq_last
    ):
        with T.Kernel(T.ceildiv(Mp1, TH), threads=TH) as bx:
            tx = T.get_thread_binding()
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            mid = T.alloc_var("int32")
            i = T.alloc_var(i64)
            Lw = T.alloc_var(i64)
            m = T.alloc_var(i64)
            a = T.alloc_var(i64)
            b = T.alloc_var(i64)
            n = T.alloc_var(i64)
            base = T.alloc_var(i64)
            nseg = T.alloc_var(i64)
            j = T.alloc_var(i64)
            start = T.alloc_var(i64)
            valid = T.alloc_var("bool")
            first = T.alloc_var("bool")
            last = T.alloc_var("bool")
            later = T.alloc_var("bool")

            i = T.cast(bx * TH + tx, i64)
            Lw = T.cast(L, i64)
            m = T.cast(Mp1 - 1, i64)
            # ---- slot i: the sequence it belongs to, then its fields
            if i < m:
                # largest n in [0, N) with floor(cu[n] / L) + n <= i, else 0;
                # floor(cu[n] / L) <= i - n  <=>  cu[n] < (i - n + 1) L  (L > 0)
                lo = 0
                hi = Np1 - 1
                for _ in T.serial(32):
                    if hi - lo > 1:
                        mid = lo + (hi - lo) // 2
                        if T.cast(cu_seqlens[mid], i64) < (i - T.cast(mid, i64) + 1) * Lw:
                            lo = mid
                        else:
                            hi = mid
                n = T.cast(lo, i64)
                a = T.cast(cu_seqlens[lo], i64)
                b = T.cast(cu_seqlens[lo + 1], i64)
                base = T.floordiv(a, Lw) + n
                # ceil((b - a) / L), 0 for an empty (or decreasing) range
                nseg = T.if_then_else(b > a, T.truncdiv(b - a - 1, Lw) + 1, T.int64(0))
                j = i - base
                valid = (j >= 0) & (j < nseg)
                first = valid & (j == 0)
                last = valid & (j == nseg - 1)
                later = valid & (j > 0)  # valid and not first
                start = T.min(a + j * Lw, b)
                slot_tab[0, i] = n
                slot_tab[1, i] = j
                slot_tab[2, i] = start
                slot_tab[3, i] = T.min(start + Lw, b)
                slot_tab[4, i] = T.if_then_else(later, i - 1, T.int64(-1))
                slot_tab[5, i] = T.if_then_else(first, n, T.int64(-1))
                flag_tab[0, i] = T.cast(valid, "uint8")
                flag_tab[1, i] = T.cast(first, "uint8")
                flag_tab[2, i] = T.cast(last, "uint8")
                flag_tab[3, i] = T.cast(later & (j < nseg - 1), "uint8")  # valid, not first, not last
                flag_tab[4, i] = T.cast(later, "uint8")
                pseudo[i] = T.cast(start, seq_dtype)
            # ---- the closing pseudo offset: cu[N]
            if i == m:
                pseudo[i] = cu_seqlens[Np1 - 1]
            # ---- sequence i: first slot, segment count, last slot
            if i < T.cast(Np1 - 1, i64):
                a = T.cast(cu_seqlens[i], i64)
                b = T.cast(cu_seqlens[i + 1], i64)
                base = T.floordiv(a, Lw) + i
                nseg = T.if_then_else(b > a, T.truncdiv(b - a - 1, Lw) + 1, T.int64(0))
                seq_tab[0, i] = base
                seq_tab[1, i] = nseg
                seq_tab[2, i] = T.if_then_else(nseg > 0, base + nseg - 1, T.int64(-1))

    return cp_segment_tables


@functools.lru_cache(maxsize=None)
def build_segment_tables_kernel(seq_dtype: str):
    """Compiled segment-table kernel (cached). Static key: cu_seqlens' dtype, "int32" or "int64".

    Call as kernel(cu_seqlens [N + 1], L (int), pseudo [M + 1] (cu_seqlens' dtype), slot_tab [6, MS]
    int64, flag_tab [5, MS] uint8, seq_tab [3, NS] int64), MS >= M, NS >= N, N >= 1; N, M, MS, NS and
    L are run-time values. `segment_tables` allocates the buffers and launches it.
    """
    if seq_dtype not in ("int32", "int64"):
        raise ValueError(f"seq_dtype must be 'int32' or 'int64', got {seq_dtype!r}")
    return compile_kernel(_tables_prim_func(seq_dtype), f"cp_segment_tables_{seq_dtype}")


def kernel_supported(cu_seqlens: torch.Tensor) -> bool:
    """Whether `segment_tables` can launch for these offsets: int32/int64 on a CUDA device of compute
    capability 9.0 (the kernel is built for sm_90a). Reads no device value."""
    return cu_seqlens.dtype in _SEQ_DTYPES and on_sm90(cu_seqlens)


def _round_up(x: int, m: int) -> int:
    return -(-x // m) * m


def segment_tables(cu_seqlens: torch.Tensor, L: int, N: int, M: int):
    """One launch: the segment tables of the packed offsets cu_seqlens ([N + 1] contiguous int32/int64
    on an sm_90 device, N >= 1) for segments of L tokens over M = T // L + N slots.

    Returns (pseudo [M + 1] in cu_seqlens' dtype, slot_tab [6, M] int64 rows seq, index, start, end,
    prev, h0_index; flag_tab [5, M] bool rows valid, first, last, need_transition, need_correction;
    seq_tab [3, N] int64 rows seq_first, seq_num, seq_last). The rows are contiguous views into
    buffers whose rows start 64-byte aligned. No host synchronisation."""
    dev = cu_seqlens.device
    MS, NS = _round_up(M, ROW_ALIGN), _round_up(N, ROW_ALIGN)
    pseudo = torch.empty(M + 1, dtype=cu_seqlens.dtype, device=dev)
    slot_tab = torch.empty(6, MS, dtype=torch.int64, device=dev)
    flag_tab = torch.empty(5, MS, dtype=torch.uint8, device=dev)
    seq_tab = torch.empty(3, NS, dtype=torch.int64, device=dev)
    kernel = build_segment_tables_kernel(_SEQ_DTYPES[cu_seqlens.dtype])
    if dev.index is not None and dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):
            kernel(cu_seqlens, L, pseudo, slot_tab, flag_tab, seq_tab)
    else:
        kernel(cu_seqlens, L, pseudo, slot_tab, flag_tab, seq_tab)
    return pseudo, slot_tab[:, :M], flag_tab.view(torch.bool)[:, :M], seq_tab[:, :N]

"""The segment tables of a split launch, and the moves of the prepare products between the caller's
chunk slots and the segments'.

Segment tables (`build_segment_tables`)
----------------------------------------
With segment length L (a multiple of 64) sequence n = [cu[n], cu[n+1]) is cut from its start into
ceil(len_n / L) segments (the last one shorter; an empty sequence has none), exactly as
`reference.gdn.cp.plan_segments`. Segment j of sequence n occupies slot

    slot(n, j) = floor(cu[n] / L) + n + j

(the forward's chunk-slot trick with L for 64: floor(cu[n+1] / L) - floor(cu[n] / L) + 1 >=
ceil(len_n / L) slots are free before sequence n + 1 starts, so slots never collide), and the slot
count M = floor(T / L) + N is known from shapes alone. Slots are in token order; a slot beyond its
sequence's last segment is inert: an empty segment at the sequence's end (start == end == cu[n+1]).
Every table is computed by torch ops from `cu_seqlens` on its device (searchsorted over the strictly
increasing slot bases, no `.item()`, `.tolist()`, `.cpu()`, no data-dependent Python branch):

    cu_seqlens [M + 1]  pseudo offsets: the segments (inert ones empty) as M independent sequences;
                        the existing kernels run them with N' = M from zero (or h0_index) state
    seq [M]             sequence of each slot; index [M] its position j in the sequence
    start, end [M]      token offsets (inert: start == end); valid, first, last [M] bool
    prev [M]            slot of the previous segment of the same sequence, -1 if none: the combine
                        order (segments of a sequence are consecutive slots, first to last)
    h0_index [M]        the sequence whose initial state a first segment starts from, else -1
    need_transition [M] valid, not first, not last: P_j is needed for the next segment's entering
                        state (a first segment runs from h0 and ends exact; a last one's P S only
                        feeds the final state, which its correction pass produces: X = P_<c S
                        walks to P S at the segment's end)
    need_correction [M] valid and not first (its entering state is not known at launch)
    seq_first, seq_num, seq_last [N]  first slot, segment count, last slot (-1 when empty): the final
                        state of sequence n is the state leaving slot seq_last[n] (h0 when empty)

For fixed-length input (no cu_seqlens) the tables depend on shapes alone and are built once per
shape (`split_tables`' cache); with cu_seqlens they are rebuilt from its current values on every
call, in one kernel launch on sm_90 (`segment_tables_device`).
"""

from __future__ import annotations

import dataclasses
import math
import operator
from dataclasses import dataclass, replace

import torch

from flashqla.contract import CHUNK
from flashqla.ops.gdn.kernels.sm90 import cp_tables
from flashqla.ops.gdn.kernels.sm90.cp_relayout import relayout_slots

__all__ = ["SegmentTables", "build_segment_tables", "check_segment_args", "num_segment_slots", "segment_slots_to_sequence_slots",
           "segment_tables_device", "sequence_slots_to_segment_slots", "split_tables"]


def num_segment_slots(T: int, N: int, segment_len: int) -> int:
    """Upper bound on the segments of N sequences with T tokens in all: floor(T / L) + N (shapes only)."""
    return T // segment_len + N


@dataclass(frozen=True)
class SegmentTables:
    """Segment tables over M = floor(T / L) + N slots (see the module docstring for each field).

    cu_seqlens [M + 1] (cu_seqlens' dtype, int64 when built from B rows); every other index tensor
    int64; valid, first, last, need_transition, need_correction bool. seq_first, seq_num, seq_last
    [N]. segment_len: L. N, M: ints from shapes.
    """

    cu_seqlens: torch.Tensor
    seq: torch.Tensor
    index: torch.Tensor
    start: torch.Tensor
    end: torch.Tensor
    valid: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    prev: torch.Tensor
    h0_index: torch.Tensor
    need_transition: torch.Tensor
    need_correction: torch.Tensor
    seq_first: torch.Tensor
    seq_num: torch.Tensor
    seq_last: torch.Tensor
    segment_len: int
    N: int
    M: int

    def max_segments_per_sequence(self, T: int) -> int:
        """ceil(T / L): a shape-only bound on any sequence's segment count (T total tokens)."""
        return -(-T // self.segment_len)


_INT64_MAX = 2**63 - 1


def _whole_number(value, name: str) -> int:
    """value as a Python int: an integer, or a float with an integral finite value; ValueError naming
    `name` otherwise (bools, NaN, inf, fractions, strings)."""
    if isinstance(value, bool):
        raise ValueError(f"{name} must be an integer, got {value!r}")
    try:
        out = operator.index(value)
    except TypeError:
        if isinstance(value, float) and math.isfinite(value) and value.is_integer():
            out = int(value)
        else:
            raise ValueError(f"{name} must be an integer, got {value!r}") from None
    return out


def check_segment_args(segment_len, T) -> tuple[int, int]:
    """(L, T) as ints after the checks `build_segment_tables` and the one-launch tables share:
    segment_len a positive multiple of 64 within int64, T a token count >= 0 (required)."""
    L = _whole_number(segment_len, "segment_len")
    if L <= 0 or L % CHUNK:
        raise ValueError(f"segment_len must be a positive multiple of {CHUNK}, got {segment_len!r}")
    if L > _INT64_MAX:
        raise ValueError(f"segment_len must fit in int64, got {segment_len!r}")
    if T is None:
        raise ValueError("T (tokens per row, from the inputs' shape) is required")
    T = _whole_number(T, "T")
    if T < 0:
        raise ValueError(f"T must be >= 0 tokens, got {T}")
    if T > _INT64_MAX:
        raise ValueError(f"T must fit in int64, got {T}")
    return L, T


def build_segment_tables(cu_seqlens, segment_len: int, *, T: int | None = None, B: int = 1, device=None) -> SegmentTables:
    """Segment tables for segments of `segment_len` tokens, by torch ops only (no host sync).

    Args:
        cu_seqlens: [N + 1] int32/int64 offsets (non-decreasing, cu[0] == 0), or None for B rows of
            T tokens (offsets b * T, built on `device`).
        segment_len: L, a positive multiple of 64.
        T: tokens per row, from the inputs' shape [B, T, ...] (required: with cu_seqlens the slot
            count floor(T / L) + N bounds the segments because cu[N] <= T).
        B: batch rows when cu_seqlens is None.
    Returns `SegmentTables`. Raises ValueError naming the argument for a segment_len that is not a
    positive multiple of 64 within int64, or a T that is missing, negative or not a whole number.
    """
    L, T = check_segment_args(segment_len, T)
    if cu_seqlens is None:
        dev = torch.device("cpu") if device is None else torch.device(device)
        cu = torch.arange(B + 1, dtype=torch.int64, device=dev) * T
        total, out_dtype = B * T, torch.int64
    else:
        cu, total, out_dtype = cu_seqlens.to(torch.int64), T, cu_seqlens.dtype
        dev = cu.device
    N = cu.shape[0] - 1
    M = num_segment_slots(total, N, L)
    i64 = dict(dtype=torch.int64, device=dev)
    lo, hi = cu[:-1], cu[1:]
    base = torch.div(lo, L, rounding_mode="floor") + torch.arange(N, **i64)  # strictly increasing
    # ceil((hi - lo) / L) without forming hi - lo + L - 1 (L may be close to 2^63)
    nseg = torch.where(hi > lo, torch.div(hi - lo - 1, L, rounding_mode="floor") + 1, torch.zeros_like(lo))
    slot = torch.arange(M, **i64)
    if N > 0:  # a shape, not a value
        n = (torch.searchsorted(base.contiguous(), slot, right=True) - 1).clamp(min=0)
    else:
        n = torch.zeros(M, **i64)
    base_n = base[n] if N > 0 else n
    lo_n = lo[n] if N > 0 else n
    hi_n = hi[n] if N > 0 else n
    nseg_n = nseg[n] if N > 0 else n
    j = slot - base_n
    valid = (j >= 0) & (j < nseg_n)
    # min(lo + j L, hi) without forming lo + j L past the sequence (L may be close to 2^63): j >= nseg
    # means j L >= hi - lo
    start = torch.where(j < nseg_n, lo_n + j * L, hi_n)
    end = torch.where(hi_n - start > L, start + L, hi_n)
    first = valid & (j == 0)
    last = valid & (j == nseg_n - 1)
    neg = torch.full_like(slot, -1)
    pseudo = torch.cat([start, cu[-1:]]).to(out_dtype)
    return SegmentTables(
        cu_seqlens=pseudo,
        seq=n,
        index=j,
        start=start,
        end=end,
        valid=valid,
        first=first,
        last=last,
        prev=torch.where(valid & (j > 0), slot - 1, neg),
        h0_index=torch.where(first, n, neg),
        need_transition=valid & ~first & ~last,
        need_correction=valid & ~first,
        seq_first=base,
        seq_num=nseg,
        seq_last=torch.where(nseg > 0, base + nseg - 1, torch.full_like(base, -1)),
        segment_len=L,
        N=N,
        M=M,
    )

def segment_tables_device(cu_seqlens: torch.Tensor, segment_len: int, T: int | None = None) -> SegmentTables:
    """`build_segment_tables(cu_seqlens, segment_len, T=T)` for packed offsets, in one kernel launch
    (`kernels/sm90/cp_tables.py`) where it applies.

    Args:
        cu_seqlens: [N + 1] int32/int64 offsets (non-decreasing, cu[0] == 0, cu[N] <= T), on a CUDA
            device of compute capability 9.0 for the kernel path.
        segment_len: L, a positive multiple of 64.
        T: tokens of the packed row, from the inputs' shape [1, T, ...] (required).
    Returns:
        `SegmentTables` with M = T // L + N slots, equal field by field (dtype and values) to
        `build_segment_tables`; on the kernel path the fields are contiguous views into three shared
        buffers.

    No host synchronisation and no recompilation for new values or sizes. Falls back to
    `build_segment_tables` (the same tables by torch ops) where the kernel does not apply: N == 0
    (then M = T // L, nothing to search), offsets not on an sm_90 CUDA device (CPU tensors
    included), a dtype other than int32/int64, or L or M + 1 beyond int32.
    Raises ValueError for a segment_len that is not a positive multiple of 64, a missing or negative
    T, or cu_seqlens that is not a 1-D tensor with at least one entry.
    """
    L, T = check_segment_args(segment_len, T)
    if not isinstance(cu_seqlens, torch.Tensor) or cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError("cu_seqlens must be a 1-D tensor of N + 1 >= 1 offsets "
                         "(the fixed-length tables come from build_segment_tables(None, ...))")
    N = cu_seqlens.shape[0] - 1
    M = num_segment_slots(T, N, L)
    if N == 0 or L > cp_tables.INT32_MAX or M + 1 > cp_tables.INT32_MAX or not cp_tables.kernel_supported(cu_seqlens):
        return build_segment_tables(cu_seqlens, L, T=T)
    pseudo, slot_tab, flag_tab, seq_tab = cp_tables.segment_tables(cu_seqlens.contiguous(), L, N, M)
    seq, index, start, end, prev, h0_index = slot_tab.unbind(0)
    valid, first, last, need_transition, need_correction = flag_tab.unbind(0)
    seq_first, seq_num, seq_last = seq_tab.unbind(0)
    return SegmentTables(cu_seqlens=pseudo, seq=seq, index=index, start=start, end=end, valid=valid, first=first,
                         last=last, prev=prev, h0_index=h0_index, need_transition=need_transition,
                         need_correction=need_correction, seq_first=seq_first, seq_num=seq_num, seq_last=seq_last,
                         segment_len=L, N=N, M=M)


def with_extra_row(x: torch.Tensor, fill) -> torch.Tensor:
    """x with one extra row `fill` at index len(x) (the target of "no slot" indices)."""
    return torch.cat([x, torch.full((1, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)])


#: Index tensors of a segmentation that depends on shapes alone (fixed-length input), kept per key.
_LAYOUTS: dict = {}
_LAYOUT_CACHE = 32
#: key -> (the entry's CUDA tensors, the CUDA streams (handles) it has been handed out on): `_mark_stream`
_LAYOUT_STREAMS: dict = {}
#: keys handed out while a CUDA graph was being captured: never evicted (the graph keeps their addresses)
_LAYOUT_PINNED: set = set()


def _tensors_of(value) -> list:
    """The CUDA tensors in a cached entry (a tensor, or a tuple / list / dict / dataclass of them)."""
    if isinstance(value, torch.Tensor):
        return [value] if _is_cuda(value) else []
    if isinstance(value, (tuple, list)):
        return [t for v in value for t in _tensors_of(v)]
    if isinstance(value, dict):
        return [t for v in value.values() for t in _tensors_of(v)]
    if dataclasses.is_dataclass(value):
        return [t for f in dataclasses.fields(value) for t in _tensors_of(getattr(value, f.name))]
    return []


def _is_cuda(t: torch.Tensor) -> bool:
    return t.is_cuda


def _current_stream(device):
    return torch.cuda.current_stream(device)


def _capturing() -> bool:  # asked only for entries holding CUDA tensors
    return torch.cuda.is_current_stream_capturing()


def _mark_stream(key, hit) -> None:
    """Once per (entry, stream): `record_stream` on the entry's CUDA tensors for the current stream, so
    that when the entry is evicted and freed, the caching allocator does not hand its memory out again
    before the work of every stream that used it is done (FlashInfer #4476 was this bug class). The
    entry's own allocation stream needs nothing (record_stream is then a no-op). An entry handed out
    during a CUDA graph capture is pinned: the graph replays its addresses later, so it is never
    evicted."""
    rec = _LAYOUT_STREAMS.get(key)
    if rec is None:
        rec = _LAYOUT_STREAMS[key] = (_tensors_of(hit), set())
    tensors, seen = rec
    if not tensors:
        return
    if key not in _LAYOUT_PINNED and _capturing():
        _LAYOUT_PINNED.add(key)
    stream = _current_stream(tensors[0].device)
    if stream.cuda_stream in seen:
        return
    seen.add(stream.cuda_stream)
    for t in tensors:
        t.record_stream(stream)


def memo_layout(key, fn):
    """fn() once per key (None: no caching). Only shape-determined products are keyed; they are read
    only, so streams may share an entry (`_mark_stream`). At most _LAYOUT_CACHE entries besides those a
    CUDA graph capture used (pinned), least recently used evicted first."""
    if key is None:
        return fn()
    hit = _LAYOUTS.pop(key, None)
    if hit is None:
        hit = fn()
    _LAYOUTS[key] = hit
    _mark_stream(key, hit)
    while len(_LAYOUTS) - len(_LAYOUT_PINNED) > _LAYOUT_CACHE:
        old = next(k for k in _LAYOUTS if k not in _LAYOUT_PINNED)
        _LAYOUTS.pop(old)
        _LAYOUT_STREAMS.pop(old, None)
    return hit


def split_tables(cu_seqlens, L: int, B: int, T: int, device):
    """(SegmentTables, static_key) of the split path for segment length L: for fixed-length input the
    tables depend on shapes alone and are built once per static_key (int32 offsets: the kernels
    packed int32 input uses); packed offsets are read on every call (one launch on sm_90, torch ops
    elsewhere), so a reused, edited cu_seqlens is never stale (static_key None)."""
    if cu_seqlens is None:
        static_key = ("rows", B, T, L, str(device))
        return memo_layout(static_key + ("tables",), lambda: _int32_tables(build_segment_tables(None, L, T=T, B=B, device=device), B * T)), static_key
    return segment_tables_device(cu_seqlens, L, T=T), None


def _int32_tables(tables: SegmentTables, total: int) -> SegmentTables:
    return replace(tables, cu_seqlens=tables.cu_seqlens.to(torch.int32)) if total < 2**31 else tables


def segment_slots_to_sequence_slots(A: torch.Tensor, g_cum_log2: torch.Tensor, tables: SegmentTables, cu_seqlens,
                                    B: int, T: int):
    """The prepare products of a segmented launch in the slot layout of the original sequences.

    A chunk of sequence n at position c lies in segment j = c // (L / 64) at chunk c' = c % (L / 64);
    its rows are identical in both layouts (segments are chunk-aligned), so this is a gather.

    Args:
        A: [HV, S' * 64, 64], g_cum_log2: [HV, S' * 64] in the layout of tables.cu_seqlens;
        tables: `SegmentTables`; cu_seqlens: None (B rows of T tokens) or [N + 1] offsets; B, T: the
        inputs' first two dims.
    Returns:
        (A [HV, S * 64, 64], g_cum_log2 [HV, S * 64]) in the layout of cu_seqlens
        (S = B * ceil(T / 64), or floor(T / 64) + N); slots no chunk uses hold zeros. No host sync.
    """
    if A.is_cuda:  # one launch (cp_relayout.py), the same values
        S = B * (-(-T // CHUNK)) if cu_seqlens is None else T // CHUNK + cu_seqlens.shape[0] - 1
        return relayout_slots(A, g_cum_log2, tables, cu_seqlens, B, T, S, to_segments=False)
    HV = A.shape[0]
    dev = A.device
    L = tables.segment_len
    per = L // CHUNK
    i64 = dict(dtype=torch.int64, device=dev)
    if cu_seqlens is None:
        NT = -(-T // CHUNK)
        S = B * NT
        o_slot = torch.arange(S, **i64)
        n = torch.div(o_slot, max(NT, 1), rounding_mode="floor")
        c = o_slot - n * NT
        length = torch.full((max(B, 0),), T, **i64)
    else:
        cu = cu_seqlens.to(torch.int64)
        N = cu.shape[0] - 1
        S = T // CHUNK + N
        o_slot = torch.arange(S, **i64)
        obase = torch.div(cu[:-1], CHUNK, rounding_mode="floor") + torch.arange(N, **i64)
        if N > 0:
            n = (torch.searchsorted(obase.contiguous(), o_slot, right=True) - 1).clamp(min=0)
        else:
            n = torch.zeros_like(o_slot)
        c = o_slot - (obase[n] if N > 0 else n)
        length = cu[1:] - cu[:-1]
    nchunks = -(-length // CHUNK)
    valid = (c >= 0) & (c < (nchunks[n] if nchunks.numel() else c))
    j = torch.div(c.clamp(min=0), per, rounding_mode="floor")
    p = (tables.seq_first[n] if tables.seq_first.numel() else n) + j
    pbase = torch.div(with_extra_row(tables.start, 0), CHUNK, rounding_mode="floor") + torch.arange(tables.M + 1, **i64)
    src = pbase[p.clamp(0, tables.M)] + (c.clamp(min=0) - j * per)
    Sp = A.shape[1] // CHUNK
    src = torch.where(valid, src, torch.zeros_like(src)).clamp(0, max(Sp - 1, 0))
    A_out = torch.where(valid[None, :, None, None], A.view(HV, Sp, CHUNK, CHUNK)[:, src], A.new_zeros(()))
    G_out = torch.where(valid[None, :, None], g_cum_log2.view(HV, Sp, CHUNK)[:, src], g_cum_log2.new_zeros(()))
    return A_out.reshape(HV, S * CHUNK, CHUNK), G_out.reshape(HV, S * CHUNK)


def sequence_slots_to_segment_slots(A: torch.Tensor, g_cum_log2: torch.Tensor, tables: SegmentTables, cu_seqlens,
                                    B: int, T: int):
    """The inverse of `segment_slots_to_sequence_slots`: prepare products stored in the slot layout of
    the caller's sequences (what autograd saves) laid out for the segments of `tables` (a gather).

    Args: A [HV, S * 64, 64], g_cum_log2 [HV, S * 64] in the layout of cu_seqlens (None: B rows of T
        tokens); tables: `SegmentTables` for the same offsets. Returns (A [HV, S' * 64, 64],
        g_cum_log2 [HV, S' * 64]) with S' = floor(B T / 64) + M; slots no chunk uses hold zeros.
    """
    if A.is_cuda:  # one launch (cp_relayout.py), the same values
        return relayout_slots(A, g_cum_log2, tables, cu_seqlens, B, T, B * T // CHUNK + tables.M, to_segments=True)
    HV = A.shape[0]
    dev = A.device
    L, M = tables.segment_len, tables.M
    per = L // CHUNK
    i64 = dict(dtype=torch.int64, device=dev)
    total = B * T
    Sp = total // CHUNK + M
    p_slot = torch.arange(Sp, **i64)
    pbase = torch.div(tables.start, CHUNK, rounding_mode="floor") + torch.arange(M, **i64)
    s = (torch.searchsorted(pbase.contiguous(), p_slot, right=True) - 1).clamp(min=0) if M else torch.zeros_like(p_slot)
    c_loc = p_slot - (pbase[s] if M else s)
    nch = -(-(tables.end - tables.start) // CHUNK)
    valid = (c_loc >= 0) & (c_loc < (nch[s] if M else c_loc))
    n = tables.seq[s] if M else s
    c = tables.index[s] * per + c_loc if M else c_loc
    if cu_seqlens is None:
        obase = n * (-(-T // CHUNK))
    else:
        cu = cu_seqlens.to(torch.int64)
        N = cu.shape[0] - 1
        ob = torch.div(cu[:-1], CHUNK, rounding_mode="floor") + torch.arange(N, **i64)
        obase = ob[n.clamp(max=max(N - 1, 0))] if N else n
    So = A.shape[1] // CHUNK
    src = torch.where(valid, obase + c, torch.zeros_like(c)).clamp(0, max(So - 1, 0))
    A_out = torch.where(valid[None, :, None, None], A.view(HV, So, CHUNK, CHUNK)[:, src], A.new_zeros(()))
    G_out = torch.where(valid[None, :, None], g_cum_log2.view(HV, So, CHUNK)[:, src], g_cum_log2.new_zeros(()))
    return A_out.reshape(HV, Sp * CHUNK, CHUNK), G_out.reshape(HV, Sp * CHUNK)

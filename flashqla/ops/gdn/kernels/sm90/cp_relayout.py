"""The prepare products (A diag(beta), g_cum_log2) moved between the caller's chunk slots and the
segments' chunk slots, in one launch.

`flashqla.cp.segments.sequence_slots_to_segment_slots` (the split backward, before its kernels) and
`segment_slots_to_sequence_slots` (the split forward for training, after them) express this move as
about fifteen torch ops: slot searches and gathers over small index tensors, a gather of A and of
g_cum_log2 over every slot, and a `torch.where` over the whole of A for the slots no chunk uses (their
cost against this launch: `benchmarks/journal/context-parallel.md`, "The split backward's fixed costs").
`relayout_slots` does the same move with one TileLang launch that reads each used source slot once and
writes each destination slot once, with the same values bit for bit (a copy; zeros where no chunk is).

Kernel (`gdn_cp_relayout`): grid (destination slots, HV), 128 threads. The CTA of destination slot
s finds where its chunk lives:
    to segments (backward): s is a slot of the segments' layout; a binary search over the segment
        offsets (`SegmentTables.cu_seqlens`, as `_common.locate_slot` does over any packed offsets)
        gives segment p and chunk c' in it; the chunk is chunk index[p] L / 64 + c' of sequence
        seq[p], i.e. source slot floor(cu[n] / 64) + n + c (packed) or n ceil(T / 64) + c (B rows);
    to sequences (forward): s is a slot of the caller's layout; the search over cu_seqlens (packed)
        or a division (B rows) gives sequence n and chunk c; the chunk is chunk c - j L / 64 of
        segment p = seq_first[n] + j, j = floor(64 c / L), i.e. source slot floor(start[p] / 64) + p
        + c - j L / 64;
then copies the 64 x 64 tile of A and the 64 gates of its value head, or writes zeros when the slot
holds no chunk (a gap slot, or a slot past a sequence's last chunk). No host synchronisation; every
size is a run-time argument (compile key: HV, A's dtype, the offsets' dtypes, direction, packed).

Checked on the GPU against the torch path bit for bit (`tests/gpu/test_cp_kernels_gpu.py`); the
torch path stays the CPU one and the reference.

The initial states move the same way (`slot_initial_states`, kernel `gdn_cp_slot_h0`): the split
path's runs start first segments from h0[h0_index[slot]] and every other slot from zero. In torch that
is a clamp, an index_select over all M slots and a `torch.where` (3 launches); here one launch, grid
(slots, HV), 128 threads, float4 copies.
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, dummy_cu_seqlens, locate_slot, tl_dtype

__all__ = ["build_relayout_kernel", "build_slot_h0_kernel", "relayout_slots", "slot_initial_states"]

THREADS = 128


def _relayout_prim_func(HV: int, dtype: str, seq_dtype: str, tab_dtype: str, to_segments: bool, varlen: bool):
    import tilelang.language as T

    C = CHUNK
    Si = T.dynamic("Si")  # source slots
    So = T.dynamic("So")  # destination slots
    Np1 = T.dynamic("Np1")  # len(cu_seqlens) (packed) or 1 (placeholder, B rows)
    Mp1 = T.dynamic("Mp1")  # len(segment offsets) = M + 1
    M = T.dynamic("M")
    N = T.dynamic("N")

    @T.prim_func
    def gdn_cp_relayout(
        A_in: T.Tensor((HV, Si * C, C), dtype),
        G_in: T.Tensor((HV, Si * C), "float32"),
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        seg_cu: T.Tensor((Mp1,), tab_dtype),
        seg_seq: T.Tensor((M,), "int64"),
        seg_index: T.Tensor((M,), "int64"),
        seq_first: T.Tensor((N,), "int64"),
        T_row: T.int32,  # tokens per row (B rows; unused when packed)
        per: T.int32,  # L / 64
        A_out: T.Tensor((HV, So * C, C), dtype),
        G_out: T.Tensor((HV, So * C), "float32"),
    ):
        with T.Kernel(So, HV, threads=THREADS) as (s, hv):
            src = T.alloc_var("int32")
            src = -1
            if to_segments:
                p, c_loc, _bos, _len, _b, nvalid, _t0 = locate_slot(s, seg_cu, T_row, Mp1, True)  # packed: T unused
                if nvalid > 0:
                    n = T.cast(seg_seq[p], "int32")
                    c = T.cast(seg_index[p], "int32") * per + c_loc
                    if varlen:
                        src = T.cast(cu_seqlens[n], "int32") // C + n + c
                    else:
                        src = n * T.ceildiv(T_row, C) + c
            else:
                n, c, _bos, _len, _b, nvalid, _t0 = locate_slot(s, cu_seqlens, T_row, Np1, varlen)
                if nvalid > 0:
                    j = c // per
                    p = T.cast(seq_first[n], "int32") + j
                    src = T.cast(seg_cu[p], "int32") // C + p + c - j * per
            if src >= 0 and src < Si:
                for t, d in T.Parallel(C, C):
                    A_out[hv, s * C + t, d] = A_in[hv, src * C + t, d]
                for t in T.Parallel(C):
                    G_out[hv, s * C + t] = G_in[hv, src * C + t]
            else:
                for t, d in T.Parallel(C, C):
                    A_out[hv, s * C + t, d] = T.cast(0, dtype)
                for t in T.Parallel(C):
                    G_out[hv, s * C + t] = T.float32(0)

    return gdn_cp_relayout


@functools.lru_cache(maxsize=None)
def build_relayout_kernel(HV: int, dtype: str, seq_dtype: str, tab_dtype: str, to_segments: bool, varlen: bool):
    """Compiled relayout kernel (cached). Static key: HV, A's dtype, cu_seqlens' and the segment
    offsets' dtypes, the direction, packed or B rows."""
    func = _relayout_prim_func(HV, dtype, seq_dtype, tab_dtype, to_segments, varlen)
    return compile_kernel(func, f"gdn_cp_relayout_HV{HV}_{dtype}_{seq_dtype}_{tab_dtype}_{'seg' if to_segments else 'seq'}_{int(varlen)}")


def relayout_slots(A: torch.Tensor, g_cum_log2: torch.Tensor, tables, cu_seqlens, B: int, T: int, out_slots: int,
                   to_segments: bool):
    """A [HV, S_in * 64, 64] and g_cum_log2 [HV, S_in * 64] moved to the other slot layout:
    `to_segments` True: from the caller's (cu_seqlens, or B rows of T tokens) to the segments' of
    `tables` (`flashqla.cp.segments.SegmentTables`), else back. Returns (A [HV, out_slots * 64, 64],
    g_cum_log2 [HV, out_slots * 64]), zeros in the slots no chunk uses: the values
    `flashqla.cp.segments.sequence_slots_to_segment_slots` / `segment_slots_to_sequence_slots` return.
    CUDA tensors only (the torch functions are the CPU path)."""
    HV = A.shape[0]
    dev = A.device
    A = A.contiguous()
    g_cum_log2 = g_cum_log2.contiguous()
    A_out = torch.empty(HV, out_slots * CHUNK, CHUNK, dtype=A.dtype, device=dev)
    G_out = torch.empty(HV, out_slots * CHUNK, dtype=torch.float32, device=dev)
    if out_slots == 0 or HV == 0:
        return A_out, G_out
    varlen = cu_seqlens is not None
    # B rows: the kernel never reads offsets; the shared cached placeholder (no fill per call)
    cu = cu_seqlens.contiguous() if varlen else dummy_cu_seqlens(dev)
    seg_cu = tables.cu_seqlens.contiguous()
    kernel = build_relayout_kernel(HV, tl_dtype(A.dtype), tl_dtype(cu.dtype), tl_dtype(seg_cu.dtype), bool(to_segments), varlen)
    # chunks per segment, an int32 argument: any value >= the longest sequence's chunk count gives the
    # same slots (one segment per sequence), so a segment_len past 2^37 tokens is clamped, not wrapped
    per = min(tables.segment_len // CHUNK, 2**31 - 1)
    kernel(A, g_cum_log2, cu, seg_cu, tables.seq.contiguous(), tables.index.contiguous(),
           tables.seq_first.contiguous(), int(T), per, A_out, G_out)
    return A_out, G_out


def _slot_h0_prim_func(HV: int, K: int, V: int):
    import tilelang.language as T

    N0 = T.dynamic("N0")
    M = T.dynamic("M")

    @T.prim_func
    def gdn_cp_slot_h0(
        h0: T.Tensor((N0, HV, K, V), "float32"),
        h0_index: T.Tensor((M,), "int64"),
        out: T.Tensor((M, HV, K, V), "float32"),
    ):
        with T.Kernel(M, HV, threads=THREADS) as (s, hv):
            n = T.alloc_var("int64")
            n = h0_index[s]
            if n >= 0:
                for i, j in T.Parallel(K, V):
                    out[s, hv, i, j] = h0[n, hv, i, j]
            else:
                for i, j in T.Parallel(K, V):
                    out[s, hv, i, j] = T.float32(0)

    return gdn_cp_slot_h0


@functools.lru_cache(maxsize=None)
def build_slot_h0_kernel(HV: int, K: int, V: int):
    """Compiled initial-state relayout kernel (cached); static key HV, K, V."""
    return compile_kernel(_slot_h0_prim_func(HV, K, V), f"gdn_cp_slot_h0_HV{HV}_K{K}_V{V}")


def slot_initial_states(h0: torch.Tensor, h0_index: torch.Tensor) -> torch.Tensor:
    """[M, HV, K, V] fp32: h0[h0_index[s]] where h0_index[s] >= 0, else zeros (the split path's run
    states: `SegmentTables.h0_index` is the sequence of a first segment, -1 elsewhere).

    h0: [N, HV, K, V] fp32; h0_index: [M] int64 with values in [-1, N). CUDA tensors on sm_90 (the
    torch expression in `flashqla.cp.forward` is the CPU path and the reference).
    Raises ValueError for an h0 that is not 4-D fp32 or an h0_index that is not 1-D integer."""
    if h0.dim() != 4 or h0.dtype != torch.float32:
        raise ValueError(f"h0 must be [N, HV, K, V] fp32, got shape {tuple(h0.shape)} and {h0.dtype}")
    if h0_index.dim() != 1 or h0_index.dtype.is_floating_point or h0_index.dtype == torch.bool:
        raise ValueError(f"h0_index must be a 1-D integer tensor, got shape {tuple(h0_index.shape)} and {h0_index.dtype}")
    M = h0_index.shape[0]
    _, HV, K, V = h0.shape
    out = torch.empty(M, HV, K, V, dtype=torch.float32, device=h0.device)
    if M == 0 or HV == 0:
        return out
    build_slot_h0_kernel(HV, K, V)(h0.contiguous(), h0_index.to(torch.int64).contiguous(), out)
    return out

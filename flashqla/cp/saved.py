"""What a split training forward keeps for its backward (`CPSaved`), and the checks that decide whether a
backward may use it.
"""

from __future__ import annotations

from typing import NamedTuple

import torch

from flashqla.contract import CHUNK
from flashqla.cp.segments import SegmentTables, segment_slots_to_sequence_slots, split_tables
from flashqla.ops.gdn.kernels.sm90._common import num_slots

__all__ = ["CPSaved", "check_products", "cu_key", "saved_applies", "saved_products_in_sequence_slots"]


class CPSaved(NamedTuple):
    """What a split exact forward keeps so that its backward need not recompute it (all on the device).

    segment_len: L of the forward's plan. cutoff: the transitions' gate-driven cut (natural-log
    decay, `resolve_truncate`; None: whole segments). T, N: tokens (B * T) and sequences.
    has_h0: whether the forward had an initial state. cu_key: (data pointer, version counter) of the
    forward's cu_seqlens, or None for fixed-length input.
    S_in: [M, HV, K, V] (state dtype) the true state entering every segment slot (the initial state
    on first slots). P: [M, HV, K, K] the slots' transitions (0 where the cut dropped them). U:
    [1, T, HV, K] the transition rows of the walked chunks (the rows the backward's E sums read).
    limit: [M, HV] int32 chunks each slot's transition walked. A: [HV, S' * 64, 64] (q's dtype) and
    g_cum_log2: [HV, S' * 64] fp32, the forward's prepare products in the slot layout of its
    segments (`SegmentTables.cu_seqlens` of the forward's tables, S' = floor(T / 64) + M slots), not
    the caller's: the forward that keeps them returns `ChunkGDNForward.A` / `.g_cum_log2` as None,
    and a split backward over the same segments reads them as they are (no move between the two
    layouts); any other backward moves them to the caller's layout first
    (`saved_products_in_sequence_slots`).

    `flashqla.cp.backward.cp_backward(saved=...)` uses them instead of the run-and-transition launch and the combine
    scan, which would recompute the same values from the same inputs (bitwise: the same kernels on
    the same operands). Memory: S_in and P 64 KB each per slot and value head (about 2 * 64 KB / L
    per token and value head: 64 B at L = 2048), U 256 B per token and value head (bf16); A 64 * 2 B
    = 128 B and g_cum_log2 4 B per token and value head (bf16 A; S' exceeds the caller layout's slot
    count by about floor(T / L)), the memory the caller-layout A and g_cum_log2 took, which are not
    kept beside them (not an extra copy).

    Like A and g_cum_log2, it belongs to the forward of the very inputs the backward is given: the
    backward checks what it can without reading values (segmentation, sizes, cut, whether an initial
    state was given, the same unmodified cu_seqlens storage) and recomputes when any differs; it
    cannot tell other q, k, v, g or beta of the same shapes.
    """

    segment_len: int
    cutoff: float | None
    T: int
    N: int
    has_h0: bool
    cu_key: tuple | None
    S_in: torch.Tensor
    P: torch.Tensor
    U: torch.Tensor
    limit: torch.Tensor
    A: torch.Tensor
    g_cum_log2: torch.Tensor


def cu_key(cu_seqlens) -> tuple | None:
    """(data pointer, version counter) of cu_seqlens, or None: how a backward tells the forward's
    offsets, unmodified, from others without reading them."""
    return None if cu_seqlens is None else (cu_seqlens.data_ptr(), cu_seqlens._version)


def saved_applies(saved, tables: SegmentTables, total: int, HV: int, cutoff, has_h0: bool, cu_seqlens) -> bool:
    """Whether a forward's `CPSaved` matches the backward's segmentation (same L, sizes and cut) and
    inputs as far as they can be told apart without reading values (initial state given or not, the
    same cu_seqlens storage at the same version)."""
    return (saved is not None and saved.segment_len == tables.segment_len and saved.T == total
            and saved.N == tables.N and saved.cutoff == cutoff and saved.S_in.shape[0] == tables.M
            and saved.S_in.shape[1] == HV and saved.has_h0 == has_h0 and saved.cu_key == cu_key(cu_seqlens))


def check_products(A, g_cum_log2, cp_saved, q=None, v=None, cu_seqlens=None) -> None:
    """A and g_cum_log2 both given, or both None (with a cp_saved that carries them, or without one: the
    backward then recomputes them, one prepare launch); ValueError naming the argument otherwise. TypeError naming cp_saved when it is neither None nor a `CPSaved`. With q
    and v, given A [HV, S * 64, 64] and g_cum_log2 [HV, S * 64] must have the caller's S =
    `num_slots` of these inputs (a kept forward's `CPSaved.A`, in its segments' layout, has more
    slots), and an fp16 A with bf16 q (a for_backward=False forward's, `flashqla.ops.gdn.fwd.product_dtype`)
    is refused: ValueError naming the argument otherwise."""
    if cp_saved is not None and not isinstance(cp_saved, CPSaved):
        raise TypeError(f"cp_saved must be None or the forward's ChunkGDNForward.cp_saved (a CPSaved), "
                        f"got {type(cp_saved).__name__}")
    if (A is None) != (g_cum_log2 is None):
        missing, given = ("A", "g_cum_log2") if A is None else ("g_cum_log2", "A")
        raise ValueError(f"{missing} is None but {given} is not: pass the forward's A and g_cum_log2 together, "
                         "or both None with its cp_saved")
    if A is not None and q is not None and A.dtype == torch.float16 and q.dtype == torch.bfloat16:
        raise ValueError(f"A must be in q's dtype ({q.dtype}), got {A.dtype}: the backward reads a training forward's "
                         "A (chunk_gated_delta_rule_fwd with for_backward=True); a for_backward=False forward stores "
                         "it in fp16 for bf16 input")
    if A is not None and q is not None and v is not None:
        B, T, HV = q.shape[0], q.shape[1], v.shape[2]
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        rows = num_slots(B, T, N, cu_seqlens is not None) * CHUNK
        for name, x, shape in (("A", A, (HV, rows, CHUNK)), ("g_cum_log2", g_cum_log2, (HV, rows))):
            if tuple(x.shape) != shape:
                raise ValueError(f"{name} must be {list(shape)} (the forward's, in the slot layout of these inputs' "
                                 f"cu_seqlens), got {list(x.shape)}; a kept forward's products travel in its "
                                 "cp_saved: pass A=None and g_cum_log2=None with it")


def saved_products_in_sequence_slots(saved: CPSaved, cu_seqlens, B: int, T: int, HV: int):
    """A and g_cum_log2 of a kept forward (`CPSaved.A`, `.g_cum_log2`, in the slot layout of its
    segments) in the slot layout of the caller's cu_seqlens: what `ChunkGDNForward.A`, `.g_cum_log2`
    would have been without keeping (for a backward that does not use the saved segments: unsplit,
    cp="off", another plan). The forward's tables are rebuilt for `saved.segment_len` as the forward
    built them (`segment_slots_to_sequence_slots`, a gather; one launch on sm_90).

    Args: saved: a `CPSaved`; cu_seqlens: None (B rows of T tokens) or [N + 1] offsets, the ones
        the forward was given; B, T: the inputs' first two dims; HV: value heads.
    Returns (A [HV, S * 64, 64] in saved.A's dtype, g_cum_log2 [HV, S * 64] fp32), S =
        `kernels.sm90._common.num_slots` of these shapes. Offsets edited in place since the forward
        give meaningless values, never a read out of bounds (every source slot is bounded by
        saved.A's).
    Raises ValueError when saved comes from a forward of other sizes (tokens, sequences, value
        heads, fixed-length against packed), whose products cannot be laid out for these inputs.
    """
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    got = (saved.T, saved.N, saved.A.shape[0], saved.cu_key is None)
    want = (B * T, N, HV, cu_seqlens is None)
    if got != want:
        raise ValueError(f"cp_saved was kept by a forward of other sizes (tokens, sequences, value heads, fixed-length: "
                         f"{got}, these inputs {want}): pass that forward's A and g_cum_log2")
    tables, _ = split_tables(cu_seqlens, saved.segment_len, B, T, saved.A.device)
    return segment_slots_to_sequence_slots(saved.A, saved.g_cum_log2, tables, cu_seqlens, B, T)

"""State merge of a segmented run: the combine scan (CP-2) over the planner's segment tables.

`scan_segment_states` is the torch twin of the future combine-scan kernel: per sequence it walks the
segments in slot order, S <- P_j S + Q_j, from the sequence's initial state (or zeros). Its loop
count is ceil(T / L), a bound from shapes alone, and every step is a masked gather / scatter over all
sequences at once, so it needs no host synchronisation either.
"""

from __future__ import annotations

import torch

from flashqla.cp.planner import SegmentTables

__all__ = ["scan_segment_states"]


def scan_segment_states(P: torch.Tensor, Q: torch.Tensor, tables: SegmentTables, T: int, initial_state=None):
    """The exact state entering every segment slot and every sequence's final state.

    Args:
        P: [M, HV, K, K] each slot's transition (any value on slots that need none: it is not read
            there, except that inert slots are skipped by the mask); Q: [M, HV, K, V] each slot's
            zero-start end state; tables: `build_segment_tables`; T: tokens per row (the shape-only
            bound ceil(T / L) on segments per sequence); initial_state: None or [N, HV, K, V].
    Returns:
        (S_start [M, HV, K, V] (zeros on inert slots), final_state [N, HV, K, V]) in Q's dtype.
    """
    M, HV, K, V = Q.shape
    N = tables.N
    S = Q.new_zeros(N, HV, K, V) if initial_state is None else initial_state.to(Q.dtype).clone()
    starts = Q.new_zeros(M + 1, HV, K, V)  # row M collects the writes of inactive sequences
    dummy = torch.full_like(tables.seq_first, M)
    for j in range(tables.max_segments_per_sequence(T)):
        active = j < tables.seq_num  # [N]
        slot = torch.where(active, tables.seq_first + j, dummy)
        starts = starts.index_copy(0, slot, S)
        src = slot.clamp(max=max(M - 1, 0))
        if M:
            S = torch.where(active[:, None, None, None], P[src] @ S + Q[src], S)
    return starts[:M], S

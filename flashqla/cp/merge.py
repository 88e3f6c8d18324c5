"""State merge of a segmented run: the combine scan (CP-2) over the planner's segment tables.

On a CUDA device with fp32 states both scans below run as one launch of the kernel
`flashqla.ops.gdn.kernels.sm90.cp_scan` (one CTA per sequence, value head and slice of value
columns; every step in fp32); the torch code here is the fallback (any device, fp64) and the
kernel's specification.

`scan_segment_states` is the combine scan the CP forward (`flashqla.cp.forward`) runs in torch: per
sequence it walks the segments in slot order, S <- P_j S + Q_j, from the sequence's initial state
(or zeros). Its loop count is ceil(T / L), a bound from shapes alone, and every step is a masked
gather / scatter over all sequences at once, so it needs no host synchronisation either. With one
sequence (N == 1, the case context parallelism is for) segment j sits in slot j, and each step is a
single batched product written in place (`torch.baddbmm(..., out=)`): ceil(T / L) - 1 launches.

`scan_open_states` is the same scan with sequence 0's entering state left symbolic (the composed maps
A_j of its segments next to the zero-start states B_j), for a sequence continued from elsewhere
(`flashqla.cp.forward.cp_forward_open`, the cross-rank op `flashqla.distributed`).

Two launch schemes fit the tables:
  first_from_h0=False  every segment runs from zero; Q_j is its zero-start end state and every valid
                       slot (first ones included, when there is an initial state) is corrected;
  first_from_h0=True   first segments run from h0[h0_index] (their outputs and end state are then
                       exact: Q_j of a first slot IS its end state and its P is never read); only
                       slots with need_correction are corrected, and P is read only where
                       need_transition or for the last segment's final state.
"""

from __future__ import annotations

import torch

from flashqla.cp.segments import SegmentTables
from flashqla.ops.gdn.kernels.sm90._common import on_sm90
from flashqla.ops.gdn.kernels.sm90.cp_scan import cp_scan

__all__ = ["scan_open_states", "scan_segment_grads", "scan_segment_states"]


def _use_kernel(P: torch.Tensor, Q: torch.Tensor) -> bool:
    """The one-launch scan kernel applies: fp32 on an sm_90 device, K a multiple of 8 and V of 16."""
    K, V = Q.shape[2], Q.shape[3]
    return (P.dtype == torch.float32 and Q.dtype == torch.float32 and K % 8 == 0 and V % 16 == 0 and on_sm90(P)
            and on_sm90(Q))


def scan_segment_states(P: torch.Tensor, Q: torch.Tensor, tables: SegmentTables, T: int, initial_state=None,
                        first_from_h0: bool = False, limit: torch.Tensor | None = None):
    """The exact state entering every segment slot and every sequence's final state.

    Args:
        P: [M, HV, K, K] each slot's transition (read only on valid slots, and not on first slots when
            first_from_h0); Q: [M, HV, K, V] each slot's end state from its run (zero start, or h0 for
            first slots when first_from_h0); tables: `build_segment_tables`; T: tokens per row (the
            shape-only bound ceil(T / L) on segments per sequence); initial_state: None or
            [N, HV, K, V]; first_from_h0: see the module docstring; limit: None or
            [M, HV] the chunks each transition walked (`flashqla.cp.forward.transition_limits`): the
            sm_90 scan kernel skips the product of a step whose P the cut set to 0 (`cp_scan`; the
            same values), the torch paths ignore it.
    Returns:
        (S_start [M, HV, K, V] (the entering state of each valid slot, zeros on inert slots),
        final_state [N, HV, K, V] (initial state, or zeros, for an empty sequence)) in Q's dtype.
    """
    M, HV, K, V = Q.shape
    N = tables.N
    if _use_kernel(P, Q):
        h0 = None if initial_state is None else initial_state.to(torch.float32)
        return cp_scan(P, Q, tables.seq_first, tables.seq_num, h0, skip_first=first_from_h0, **_limits(limit, tables))
    if N == 1:
        return _scan_one_sequence(P, Q, tables, T, initial_state, first_from_h0)
    S = Q.new_zeros(N, HV, K, V) if initial_state is None else initial_state.to(Q.dtype).clone()
    starts = Q.new_zeros(M + 1, HV, K, V)  # row M takes the writes of sequences with no segment j
    dummy = torch.full_like(tables.seq_first, M)
    for j in range(tables.max_segments_per_sequence(T) if M else 0):
        active = j < tables.seq_num  # [N]
        slot = torch.where(active, tables.seq_first + j, dummy)
        starts = starts.index_copy(0, slot, S)
        src = slot.clamp(max=M - 1)
        nxt = Q[src] if (first_from_h0 and j == 0) else P[src] @ S + Q[src]
        S = torch.where(active[:, None, None, None], nxt, S)
    return starts[:M], S


def _scan_one_sequence(P, Q, tables: SegmentTables, T: int, initial_state, first_from_h0: bool):
    """`scan_segment_states` for N == 1: segment j in slot j (seq_first[0] = floor(cu[0] / L) = 0),
    at most ceil(T / L) segments; each step one product into the slot's end-state row."""
    M, HV, K, V = Q.shape
    S0 = Q.new_zeros(1, HV, K, V) if initial_state is None else initial_state.to(Q.dtype)
    ends = Q.new_empty(M, HV, K, V)
    S = S0[0]
    for j in range(min(tables.max_segments_per_sequence(T), M)):
        if first_from_h0 and j == 0:
            ends[0] = Q[0]
        else:
            torch.baddbmm(Q[j], P[j], S, out=ends[j])
        S = ends[j]
    starts = torch.cat([S0, ends[: M - 1]]) if M else ends
    starts = torch.where(tables.valid[:, None, None, None], starts, starts.new_zeros(()))
    last = tables.seq_last
    final = torch.where((last >= 0)[:, None, None, None], ends[last.clamp(min=0)] if M else S0, S0)
    return starts, final


def scan_open_states(P: torch.Tensor, Q: torch.Tensor, tables: SegmentTables, T: int, initial_state=None):
    """The combine scan when the state entering sequence 0 is not known yet (an "open" sequence: it
    continues one begun elsewhere, `flashqla.cp.forward.cp_forward_open`): every slot's entering state
    as an affine function of that state S_in.

    Sequence 0's first slot (slot 0) is run from zero and transitioned from I like a non-first slot,
    so segment j of sequence 0 (slot j) is entered with A_j S_in + B_j, where B_j is the entering
    state the scan gives with S_in = 0 and A_0 = I, A_{j+1} = P_j A_j (CP-2 with S_in kept symbolic);
    the sequence leaves with A_m S_in + B_m (m segments). The other sequences scan as
    `scan_segment_states(first_from_h0=True)`. With one sequence the two chains are one: each step is
    a single product P_j [B_j | A_j] + [Q_j | 0] of width V + K.

    Args:
        P: [M, HV, K, K] transitions (read on sequence 0's slots and on valid non-first slots);
            Q: [M, HV, K, V] end states of the run (sequence 0's first slot and the non-first slots from
            zero, other first slots from their initial state); tables: `build_segment_tables`; T: tokens
            per row (the bound ceil(T / L) on segments per sequence); initial_state: None or
            [N, HV, K, V] (row 0 is not read: sequence 0 is entered with S_in).
    Returns:
        (S_start [M, HV, K, V] the entering states with S_in = 0 (zeros on inert slots),
        final [N, HV, K, V] every sequence's final state with S_in = 0 (sequence 0's: B_m),
        A [J, HV, K, K] A_j for slot j < J = min(ceil(T / L), M) (meaningful for j < the segment count
        of sequence 0; mask the rest), P_open [HV, K, K] = A_m, the map of the whole open sequence),
        in Q's dtype (P_open, A in P's dtype promoted with Q's). No host synchronisation.
    """
    M, HV, K, V = Q.shape
    N = tables.N
    J = min(tables.max_segments_per_sequence(T), M) if M else 0
    dt = torch.promote_types(P.dtype, Q.dtype)
    eye = torch.eye(K, dtype=dt, device=Q.device)
    nseg0 = tables.seq_num[:1].clamp(max=J) if N else None
    if N == 1:
        Qa = torch.cat([Q[:J].to(dt), Q.new_zeros(J, HV, K, K, dtype=dt)], dim=-1)
        Z = Q.new_zeros(J + 1, HV, K, V + K, dtype=dt)
        Z[0, :, :, V:] = eye
        for j in range(J):
            torch.baddbmm(Qa[j], P[j].to(dt), Z[j], out=Z[j + 1])
        starts = Q.new_zeros(M, HV, K, V)
        starts[:J] = Z[:J, :, :, :V]
        starts = torch.where(tables.valid[:, None, None, None], starts, starts.new_zeros(()))
        leave = Z.index_select(0, nseg0)[0]
        return starts, leave[None, :, :, :V].to(Q.dtype), Z[:J, :, :, V:], leave[:, :, V:]
    h0 = None
    if initial_state is not None and N:
        h0 = initial_state.clone()
        h0[0] = 0
    starts, final = scan_segment_states(P, Q, tables, T, h0, first_from_h0=True)
    A = Q.new_empty(J + 1, HV, K, K, dtype=dt)
    A[0] = eye
    for j in range(J):
        torch.bmm(P[j].to(dt), A[j], out=A[j + 1])
    P_open = A.index_select(0, nseg0)[0] if N else eye.expand(HV, K, K)
    return starts, final, A[:J], P_open


def _limits(limit, tables: SegmentTables) -> dict:
    """`cp_scan`'s cut arguments: none, or the walked chunks and the slots' token ranges."""
    if limit is None:
        return {}
    return {"limit": limit, "seg_start": tables.start, "seg_end": tables.end}


def scan_segment_grads(P: torch.Tensor, E: torch.Tensor, tables: SegmentTables, T: int, dht=None,
                       limit: torch.Tensor | None = None):
    """The reverse combine scan of the CP backward: the gradient reaching each segment's end state.

    With S_in(j + 1) = P_j S_in(j) + Q_j, the loss's gradient with respect to a segment's entering
    state is dS_in(j) = P_j^T G_j + E_j, E_j the part through the segment's own outputs and G_j the
    gradient reaching its end state; G_j = dS_in(j + 1) and G_last = dht (the final state's
    gradient, or zero). Walks each sequence's segments last to first (ceil(T / L) steps, shapes only;
    one sequence: one product per step, in place).

    Args:
        P: [M, HV, K, K] transitions (read on valid non-first slots); E: [M, HV, K, V] (read on valid
            non-first slots); tables: `build_segment_tables`; T: tokens per row; dht: None or [N, HV, K, V];
            limit: as `scan_segment_states`.
    Returns:
        G [M, HV, K, V] in E's dtype: the gradient reaching each valid slot's end state (zeros on inert
        slots).
    """
    M, HV, K, V = E.shape
    N = tables.N
    if _use_kernel(P, E):
        D0 = None if dht is None else dht.to(torch.float32)
        return cp_scan(P, E, tables.seq_first, tables.seq_num, D0, reverse=True, **_limits(limit, tables))[0]
    J = min(tables.max_segments_per_sequence(T), M) if M else 0
    G = E.new_zeros(M + 1, HV, K, V)
    D = E.new_zeros(N, HV, K, V) if dht is None else dht.to(E.dtype)
    if N == 1 and J:
        # the sequence may end before T (a packed tail): its last segment, slot seq_num - 1, takes
        # dht; slots past it are inert and masked below
        is_last = (tables.seq_num[:1] - 1)[:, None, None]
        G[J - 1] = D[0]
        for j in range(J - 2, -1, -1):
            torch.baddbmm(E[j + 1], P[j + 1].transpose(-1, -2), G[j + 1], out=G[j])
            G[j] = torch.where(is_last == j, D[0], G[j])
        return torch.where(tables.valid[:, None, None, None], G[:M], G.new_zeros(()))
    R = D.clone()
    dummy = torch.full_like(tables.seq_first, M)
    for j in range(J - 1, -1, -1):
        active = j < tables.seq_num
        is_last = (j == tables.seq_num - 1)[:, None, None, None]
        slot = torch.where(active, tables.seq_first + j, dummy)
        nxt = (slot + 1).clamp(max=M - 1)
        step = P[nxt].transpose(-1, -2) @ R + E[nxt]
        R = torch.where(is_last, D, torch.where(active[:, None, None, None], step, R))
        G = G.index_copy(0, slot, R)
    return G[:M]

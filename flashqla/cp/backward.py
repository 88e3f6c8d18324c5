"""The split backward (`cp_backward`) and the backward of an open sequence (`cp_backward_open`).

Exact. The state gradient crosses segments
in reverse: with S_in(j + 1) = P_j S_in(j) + Q_j, dS_in(j) = P_j^T G_j + E_j, where G_j, the gradient
reaching segment j's end state, is dS_in(j + 1) (dht for the last segment), and E_j, the part through
the segment's own outputs, is sum_t U_t do_t^T (o_t = o0_t + S_in^T U_t). So: the forward's run and
transition launches and scan give S_in, P and U; GEMMs give E; a reverse scan gives G; then the
unsplit backward (recompute states, fused chunk backward, finish) runs once over all segments as
sequences, from initial states S_in and terminal gradients G, and yields every token's gradient and
each first segment's dh0 (the sequence's). The forward's A and g_cum_log2 arrive in the caller's
layout (what the custom ops' autograd saves) and are gathered into the segments' layout, or, from a
forward that kept its states over the same segments (`CPSaved.A`, `.g_cum_log2`: what the public
op's eager autograd saves), already in the segments' layout and read as they are.

Open sequence: the gradients of `flashqla.cp.forward.cp_forward_open`, with the gradient reaching the
open sequence's entering state formed before the one backward launch (`cp_backward_open`).

No host synchronisation. Written against a backend (`flashqla.ops.gdn.backend.Backend`), as the
forward.
"""

from __future__ import annotations

import threading

import torch

import flashqla.cp.forward as _fwd
from flashqla.contract import resolve_truncate
from flashqla.cp.forward import (OpenForward, _corrected_slots, _cut, _open_mask, _open_sequence_rows, _run_and_transition, _run_states,
                                 _token_kernels_apply, _token_rows, _transition, flat, transition_limits)
from flashqla.cp.merge import scan_segment_grads, scan_segment_states
from flashqla.cp.saved import CPSaved, saved_applies
from flashqla.cp.segments import SegmentTables, memo_layout
from flashqla.ops.gdn.kernels.sm90.cp_correct import cp_state_grads
from flashqla.ops.gdn.kernels.sm90.launch_order import launch_order

__all__ = ["cp_backward", "cp_backward_open"]


def _state_grads_from_outputs(U, do, tab: SegmentTables, total: int, L: int, one_sequence: bool, key,
                              mask: torch.Tensor | None = None, limit: torch.Tensor | None = None):
    """E [M, HV, K, V]: E_j = sum over segment j's tokens of U_t do_t^T (the gradient reaching the
    segment's entering state through its own outputs, o_t = o0_t + S_in^T U_t), on non-first slots
    (zeros elsewhere), or on the slots of `mask` (need_correction and an open sequence's first slot,
    `cp_backward_open`); computed in U's dtype, returned in fp32 (or U's dtype if wider). limit [M, HV]:
    the chunks each transition walked (`transition_limits`; the kernel reads only those rows, the
    torch paths get U with the other rows already 0, `_run_and_transition`)."""
    first = 1 if mask is None else 0
    HV, K, V = U.shape[2], U.shape[3], do.shape[3]
    M = tab.M
    if _token_kernels_apply(do, U):  # one launch: E per flagged slot, zeros elsewhere
        return cp_state_grads(U.reshape(1, total, HV, K), do.reshape(1, total, HV, V), tab.cu_seqlens,
                              tab.need_correction if mask is None else mask, limit=limit)
    edt = torch.float64 if U.dtype == torch.float64 else torch.float32
    E = torch.zeros(M + 1, HV, K, V, dtype=edt, device=U.device)
    Uf, Df = U.reshape(total, HV, K), do.reshape(total, HV, V)
    nseg = -(-total // L)
    if one_sequence:
        # rows past the sequence's end (a packed tail: cu[1] < total) are not written by the
        # transition launch; they must not enter E
        end = tab.cu_seqlens[-1:].to(torch.int64)
        Df = torch.where((torch.arange(total, device=Df.device) < end)[:, None, None], Df, Df.new_zeros(()))
        Uf = torch.where((torch.arange(total, device=Uf.device) < end)[:, None, None], Uf, Uf.new_zeros(()))
        nfull = total // L
        if nfull > first:
            Ub, Db = Uf[: nfull * L].view(nfull, L, HV, K), Df[: nfull * L].view(nfull, L, HV, V)
            for h in range(HV):
                E[first:nfull, h] = torch.bmm(Ub[first:, :, h].transpose(-1, -2), Db[first:, :, h]).to(edt)
        if total % L and nfull >= first and nseg >= 1 + first:
            Up, Dp = Uf[nfull * L :], Df[nfull * L :]
            for h in range(HV):
                E[nfull, h] = (Up[:, h].transpose(0, 1) @ Dp[:, h]).to(edt)
        return E[:M]
    Mc = total // L + 1 - first
    if Mc == 0:
        return E[:M]
    rows_key = key("rows", L) if mask is None else key("rows", L, "open")
    sel, tok, valid = memo_layout(rows_key, lambda: (lambda s: (s, *_token_rows(tab, s, L)))(_corrected_slots(tab, Mc, mask)))
    t = tok.reshape(-1)
    Ug = torch.where(valid.reshape(-1)[:, None, None], Uf.index_select(0, t), Uf.new_zeros(())).view(Mc, L, HV, K)
    Dg = Df.index_select(0, t).view(Mc, L, HV, V)
    Es = torch.matmul(Ug.permute(0, 2, 3, 1), Dg.permute(0, 2, 1, 3).to(Ug.dtype)).to(edt)  # [Mc, HV, K, V]
    return E.index_copy(0, sel, Es)[:M]


_side_streams = threading.local()


def _overlap_applies(backend, x: torch.Tensor) -> bool:
    """Whether `cp_backward` runs steps 2-3 on a side stream beside the states pass: on CUDA tensors,
    with a backend whose `bwd` takes dht as a callable (its `deferred_dht` attribute: `Sm90Backend`)."""
    return x.is_cuda and bool(getattr(backend, "deferred_dht", False))


def _on_side_stream(fn, like: torch.Tensor, inputs):
    """Runs fn() on this device's side stream (one per thread) after the work queued so far on the
    current stream, and returns a callable that makes the current stream wait for it and returns fn's
    tensor (for `Sm90Backend.bwd`'s dht). The inputs (tensors or None) are marked as in use by the
    side stream, the result as in use by the current one, so the caching allocator reuses neither
    early. If fn raises, the current stream waits for the side stream before the error propagates."""
    dev = like.device
    main = torch.cuda.current_stream(dev)
    # one side stream per device and thread (threads capturing graphs at once fork onto streams of
    # their own), made at the thread's first split backward on the device
    streams = _side_streams.__dict__.setdefault("by_device", {})
    key = dev.index if dev.index is not None else torch.cuda.current_device()
    side = streams.get(key)
    if side is None:
        side = streams[key] = torch.cuda.Stream(device=dev)
    side.wait_stream(main)
    try:
        with torch.cuda.stream(side):
            out = fn()
    except BaseException:
        main.wait_stream(side)
        raise
    for x in inputs:
        if isinstance(x, torch.Tensor):
            x.record_stream(side)

    def join():
        main.wait_stream(side)
        out.record_stream(main)
        return out

    return join


def cp_backward(backend, q, k, v, g, beta, A, g_cum_log2, do, dht, scale: float, initial_state, cu_seqlens,
                tables: SegmentTables, *, block_v: int, static_key=None, truncate=False, saved: CPSaved | None = None,
                longest_first: bool = False, need_dh0: bool = True):
    """Gradients of the forward over the planner's segments (every launch runs all segments at once).

    1. entering states S_in: run (v, h0 on first segments) -> Q; transition (v = 0 from I) -> U, P;
       the combine scan (exactly the forward's steps 1-3; the run's o is not used);
    2. E_j = sum_t U_t do_t^T over segment j (the gradient through its outputs, o = o0 + S_in^T U);
    3. reverse scan G_j = P_{j+1}^T G_{j+1} + E_{j+1}, G_last = dht: the gradient reaching each
       segment's end state (`scan_segment_grads`);
    4. the unsplit backward over the segments as sequences, from initial states S_in and terminal
       gradients G (`backend.bwd`: recompute states, fused chunk backward, finish): every token's
       gradient, and each first segment's dh0, the sequence's.

    With a gate-driven cut (truncate, as `cp_forward`) each transition walks `transition_limits`
    chunks: P_j = 0 where cut (the dropped P_j^T G_j is at most exp(cutoff) ||G_j||_F, record CP-6)
    and E_j sums the walked rows only (each dropped U_t is at most scale ||q_t||
    exp(cutoff) in norm, CP-5).

    With `saved` (a split forward's `CPSaved` over the same segments and cut, `flashqla.cp.saved.saved_applies`) step 1
    is skipped: its entering states, transitions, U rows and limits are what it would recompute.
    On the sm_90 backend steps 2 and 3 run on a side stream while step 4's states pass (which reads
    neither) runs, and its chunk backward waits for them (`_on_side_stream`); under the cut, step 3 skips the products of the transitions it dropped (`cp_scan`).

    Args: as `chunk_gated_delta_rule_bwd`, with A, g_cum_log2 in the slot layout of
    tables.cu_seqlens, and tables, block_v, static_key, truncate as `cp_forward`; saved: None or a
    `CPSaved` (ignored when it does not match); longest_first: the segments' backward launches them
    longest first (`CPPlan.longest_first`; the same results); need_dh0: False when the caller will not
    use dh0 (then None; the backend is told, `Backend.bwd`'s dh0).
    Returns (dq, dk, dv, dg, dbeta, dh0 [N, HV, K, V] or None when initial_state is None or need_dh0 is False).
    """
    B, T = q.shape[0], q.shape[1]
    total = B * T
    tab = tables
    M, N, L = tab.M, tab.N, tab.segment_len
    sd = backend.state_dtype
    pcu = tab.cu_seqlens
    qf, kf, vf, gf, bf, dof = (flat(x) for x in (q, k, v, g, beta, do))
    key = lambda *parts: None if static_key is None else (static_key, *parts)  # noqa: E731
    one_sequence = N == 1 and B == 1 and _fwd.ONE_SEQUENCE_FAST_PATH
    h0 = None if initial_state is None else initial_state.to(sd)
    cutoff = resolve_truncate(truncate)
    if saved_applies(saved, tab, total, v.shape[2], cutoff, h0 is not None, cu_seqlens):
        S_in, P, U, limit = saved.S_in, saved.P, saved.U, saved.limit
    else:
        h0_run = _run_states(h0, tab) if h0 is not None and N > 0 else None
        limit = transition_limits(g_cum_log2, tab, cutoff)
        _, Q, U, P = _run_and_transition(backend, qf, kf, vf, A, g_cum_log2, scale, h0_run, limit, tab, pcu, block_v,
                                         None, cutoff is not None)
        S_in, _ = scan_segment_states(P, Q, tab, T, h0, first_from_h0=True, limit=_cut(limit, cutoff))
    def terminal_grads():  # steps 2 and 3
        E = _state_grads_from_outputs(U, dof, tab, total, L, one_sequence, key, limit=limit)
        D = None if dht is None else dht.to(E.dtype)
        return scan_segment_grads(P.to(E.dtype), E, tab, T, D, limit=_cut(limit, cutoff)).to(sd).contiguous()

    # steps 2 and 3 read neither the states pass's inputs nor its outputs: on a side stream they run
    # while it does (a joined fork, so CUDA graphs capture it); the chunk backward waits for them
    G = _on_side_stream(terminal_grads, qf, (U, dof, P, limit, dht)) if _overlap_applies(backend, qf) else terminal_grads()
    # the segments' start gradients reach an output only as the sequences' dh0
    dq, dk, dv, dg, dbeta, dh0s = backend.bwd(qf, kf, vf, gf, bf, A, g_cum_log2, dof, G, scale,
                                              S_in.to(sd).contiguous(), pcu, order=_segment_order(pcu, N, longest_first),
                                              dh0=initial_state is not None and need_dh0)
    dh0 = None
    if initial_state is not None and need_dh0:
        first = dh0s.index_select(0, tab.seq_first.clamp(0, max(M - 1, 0))) if N > 0 else dh0s[:0]
        empty = dht.to(first.dtype) if dht is not None else first.new_zeros(())
        dh0 = torch.where((tab.seq_num >= 1)[:, None, None, None], first, empty) if N > 0 else first
    shape = lambda x, like: x.reshape(like.shape)  # noqa: E731
    return shape(dq, q), shape(dk, k), shape(dv, v), shape(dg, g), shape(dbeta, beta), dh0


# ------------------------------------------------------------------------------------------------
# an open sequence: local sequence 0 entered with a state known only later (cross-rank CP)
# ------------------------------------------------------------------------------------------------


def cp_backward_open(backend, q, k, v, g, beta, do, dht, scale: float, saved: OpenForward, tables: SegmentTables, *,
                     block_v: int, exchange):
    """Gradients of `cp_forward_open` with ONE backward launch over all slots, and the gradient D
    reaching the open sequence's entering state formed before it, from forward quantities.

    1. transition (v = 0 from I on the corrected slots, the open first slot included) -> U, P
       (recomputed: the forward kept the entering states, not the [T, HV, K] rows U);
    2. E_j = sum_t U_t do_t^T per corrected slot (GEMMs);
    3. D = sum_j A_j^T E_j + P_open^T dht[0] over the open sequence's slots (BWD-dSin; one batched
       product; dht[0] as given: zero where sequence 0's end state continues elsewhere);
    4. X = exchange(D or None): the caller communicates and returns the gradient reaching the last
       sequence's end state from elsewhere ([HV, K, V], added to dht[N - 1]) or None;
    5. reverse scan G (`scan_segment_grads`) with those terminal gradients; the unsplit backward over
       all slots from the forward's entering states S_in and terminal gradients G.
    Launches: one recurrent launch and one backward (its three kernels); no host synchronisation.

    Args: q, k, v, g, beta, do [1, T, ...] as the forward's; dht None or [N, HV, K, V] (the gradient
        at each sequence's end state); scale; saved: the forward's `OpenForward`; tables, block_v as
        the forward's; exchange: callable (D [HV, K, V] or None) -> X [HV, K, V] or None.
    Returns (dq, dk, dv, dg, dbeta, dh0 [N, HV, K, V]): dh0 row n is the gradient at sequence n's
        entering state (for the open sequence: the total one, D plus what reached it through X).
    """
    T = q.shape[1]
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    tab = tables
    M, N, L = tab.M, tab.N, tab.segment_len
    sd = backend.state_dtype
    pcu = tab.cu_seqlens
    if hasattr(backend, "warm"):
        backend.warm(k, beta, q, v, pcu, HV, block_v)
    A, G2 = saved.A, saved.g_cum_log2
    corr, _ = _open_mask(tab, saved.open_first)
    U, P = _transition(backend, q, k, v.dtype, A, G2, scale, corr, pcu, block_v)
    one_sequence = N == 1 and _fwd.ONE_SEQUENCE_FAST_PATH
    E = _state_grads_from_outputs(U, do, tab, T, L, one_sequence, lambda *parts: None,
                                  corr if saved.open_first else None)
    dht_full = E.new_zeros(N, HV, K, V) if dht is None else dht.to(E.dtype).clone()
    D = None
    if saved.open_first:
        J = saved.A_open.shape[0]
        rows = _open_sequence_rows(tab, J)
        Am = torch.where(rows[:, None, None, None], saved.A_open.to(E.dtype), E.new_zeros(()))
        D = torch.einsum("jhkl,jhkv->hlv", Am, E[:J])
        D = torch.baddbmm(D, saved.P_open.to(E.dtype).transpose(-1, -2), dht_full[0]).to(sd)
    X = exchange(D)
    if X is not None and N > 0:
        dht_full[N - 1] += X.to(E.dtype)
    G = scan_segment_grads(P.to(E.dtype), E, tab, T, dht_full).to(sd)
    dq, dk, dv, dg, dbeta, dh0s = backend.bwd(q, k, v, g, beta, A, G2, do, G.contiguous(), scale,
                                              saved.S_in.contiguous(), pcu, order=_segment_order(pcu, N, False))
    first = dh0s.index_select(0, tab.seq_first.clamp(0, max(M - 1, 0))) if N > 0 else dh0s[:0]
    dh0 = torch.where((tab.seq_num >= 1)[:, None, None, None], first, dht_full.to(first.dtype)) if N > 0 else first
    return dq, dk, dv, dg, dbeta, dh0


def _segment_order(pcu, N: int, longest_first: bool):
    """The launch order of the segments' backward (`launch_order.launch_order` on the segments' offsets):
    longest first where the plan says so (`CPPlan.longest_first`, packed batches), else None (token
    order; one sequence's segments are equal but the last)."""
    if N <= 1 or not pcu.is_cuda:
        return None
    return launch_order(pcu, longest_first)

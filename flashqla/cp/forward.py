"""The split forward: the forward's launches orchestrated over segments.

The planner (`flashqla.cp.plan`) cuts every long sequence into segments of L tokens
(L a multiple of 64, from each sequence start) and lays them out as M pseudo sequences
(`build_segment_tables(...).cu_seqlens`, inert empty slots allowed). Segments are chunk-aligned, so
the prepare kernel's per-chunk A diag(beta) and g_cum_log2 do not depend on the cut: one prepare
launch over the pseudo offsets serves every recurrent launch below, and every recurrent launch runs
all segments (and value heads) side by side.

Exact mode (the default), four steps (derivations CP-1, CP-2, CP-3):

    1. run         recurrent(v, h0[h0_index] on first segments, zero elsewhere) -> o, Q
                   o is exact on first segments and O(0) elsewhere; Q_j is slot j's end state
                   (exact on first segments, the zero-start end state elsewhere)
    2. transition  recurrent(v = 0, identity on every non-first segment) -> U, P
                   the recurrence is affine in (S_0, v) (CP-1), so from S_0 = I with v = 0 the end
                   state is the segment's transition P_j [K, K] (K = V = 128: the [K, V] state holds
                   I), and the output is U_t = scale Phi_t^T q_t [K], Phi_t the map from the segment
                   start to token t
    3. scan        S_in(j + 1) = P_j S_in(j) + Q_j per sequence (CP-2; `scan_segment_states`,
                   first segments from h0), also giving every final state P_last S_in + Q_last
    4. correction  o_t += S_in^T U_t on non-first segments (CP-3 in the form o(S) = o(0) + o_{v=0}(S),
                   and o_{v=0}(S)_t = S^T o_{v=0}(I)_t by linearity): one product of the [L, K] rows
                   of U with the segment's [K, V] entering state (torch GEMMs, in o's dtype), or, with
                   correction="rerun", a third recurrent launch from the entering states

On sm_90 steps 1 and 2 are one launch (`chunk_recurrent_dual`: transition CTAs first, then the run's,
in one grid, so short transitions fill the SMs the run leaves idle). Each (segment, value head)
transition is cut where the gates have decayed (the gate-driven cut, `transition_limits`, on by
default; `truncate=False` or $FLASHQLA_CP_EXACT=1 turns it off, `flashqla.contract.resolve_truncate`): it walks chunks only until the summed
log-decay from the segment's start falls below TRUNCATE_LOG_DECAY = ln 2^-24; past that chunk the
entering state's share of every later state and output is at most 2^-24 of its norm (CP-4, CP-5), so
P is taken as 0 and U's later rows are neither written nor corrected from. A head whose gates do not
decay that far within a segment (g == 0 in particular) walks the whole segment: exact. Decided on the
device from g_cum_log2's chunk ends, no host read.

Gate-driven mode (opt-in, `gate_chunks = m`; FlashQLA's truncation, CP-4 / CP-5). Step 2 runs only
over the first m chunks of each non-first segment (gathered into a compact layout; P is not formed),
the entering state of segment j + 1 is taken as Q_j (the zero-start end state of segment j: the
dropped term is P_j S_in(j), ||P_j S||_F <= exp(G_j) ||S||_F with G_j segment j's summed log-decay),
and only those m chunks are corrected (the dropped correction at any later token t is bounded by
scale ||q_t|| exp(G_m) ||S_in||_F, G_m the summed log-decay of the segment's first m chunks). The
final state adds P_last S_in where the last segment has at most m chunks (there the compact pass
covers it entirely) and drops it otherwise. No scan products remain: segments do not wait on one
another. The error is bounded only where the gates decay: a head with g == 0 (or any head whose
decay does not reach the threshold) is NOT exact in this mode, and this cannot be repaired on the
device in this mode (its compact layout gives every head of a segment the same m chunks). Exact
mode's gate-driven cut (above) is the per-(segment, head) form that keeps such heads exact, and is
what runs by default; this mode is a host-side choice kept for comparison with FlashQLA's
truncation: the planner never picks it, and the mode reports on the device, per
(segment slot, value head), the two decays and whether both are below `GATE_THRESHOLD` (info
"gate_ok"), so a caller or a test can check the bound without a synchronisation in the hot path.

Open sequence (`cp_forward_open`, `cp_backward_open`; exact; what `flashqla.distributed` runs per
rank). Local sequence 0 may continue a sequence begun elsewhere: its entering state S_in is known only
after a caller-supplied `exchange`. Its first segment is then treated like a later one: run from zero
and transitioned from I in the same transition launch, so per segment j of it U and P are at hand,
and the scan (`scan_open_states`) gives, next to the zero-start entering states B_j, the composed maps
A_j = P_{j-1} ... P_0 (segment j is entered with A_j S_in + B_j) and the sequence's map
(P_open = A_m, B_m). exchange(P_open, end states) returns S_in; one batched GEMM gives the entering
states, one the end state, and the ordinary correction GEMMs (first segment included) the outputs:
prepare + run + transition, as the plain forward. The backward recomputes the transition launch (U,
P), forms E_j = sum_t U_t do_t^T and D = sum_j A_j^T E_j + P_open^T dht_0 (record BWD-dSin) before
any backward launch, hands D to exchange (which returns the gradient X reaching the last sequence's
end state from elsewhere), runs the reverse scan with it and ONE backward over all segments from the
forward's entering states.

No host synchronisation: every size comes from shapes (M = floor(T / L) + N slots; at most
floor(T / L) non-first segments), every index is computed by torch ops on the device, the scan runs a
shape-bound number of steps. Planning reads static facts only (`flashqla.cp.plan`). For fixed-length
input (no cu_seqlens) the segment tables and every index tensor depend on shapes alone and are built
once per shape (`flashqla.cp.segments.memo_layout`); with cu_seqlens they are rebuilt from its current
values on every call, in one kernel launch on sm_90, and the combine scans are one launch each
(`flashqla.ops.gdn.kernels.sm90.cp_scan`).

Backends. The orchestration is written against `flashqla.ops.gdn.backend.Backend` (prepare,
recurrent, recurrent_dual, bwd, zeros, state_dtype); `Sm90Backend` launches the sm_90 kernels;
`reference.gdn.cp.ReferenceCPBackend` computes the same launches in fp64 on any device, which is how
the CPU tests prove the orchestration exact. The small per-segment launches (tables, limits, scans,
corrections, relayouts) run their sm_90 kernel where the tensors are fp32/bf16 on an sm_90 device and
the torch expression (their reference) elsewhere.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import torch

from flashqla.contract import CHUNK, resolve_truncate
from flashqla.cp.merge import scan_open_states, scan_segment_states
from flashqla.cp.plan import GATE_THRESHOLD
from flashqla.cp.saved import CPSaved, cu_key
from flashqla.cp.segments import SegmentTables, memo_layout, with_extra_row
from flashqla.ops.gdn.kernels.sm90._common import on_sm90
from flashqla.ops.gdn.kernels.sm90.cp_correct import cp_correct
from flashqla.ops.gdn.kernels.sm90.cp_limits import cp_transition_limits
from flashqla.ops.gdn.kernels.sm90.cp_relayout import slot_initial_states

__all__ = ["CORRECTIONS", "CPInfo", "CheckpointParts", "OpenForward", "cp_forward", "cp_forward_open", "flat", "transition_limits"]

#: Output correction of exact mode: "gemm" (step 4 above) or "rerun" (a third recurrent launch).
CORRECTIONS = ("gemm", "rerun")

_LN2 = math.log(2.0)
#: One sequence (N == 1) corrects by in-place GEMMs on views of o and U (no gather); tests turn it off
#: to check it against the general path (the backward reads it too).
ONE_SEQUENCE_FAST_PATH = True


class CheckpointParts(NamedTuple):
    """The split forward's checkpoints before their combination (`cp_forward(checkpoint_positions=...)`,
    record CP-1): CQ [M, HV, K, V] the runs' states at the positions, CP [M, HV, K, K] the transitions'
    (0 on first segments, whose run starts from h0, and past a limit), S_in [slots, HV, K, V] the
    segments' entering states (scan output), seg_end [slots] int64 the segments' ends (non-decreasing
    in slot order), positions [M] as given. `states()` combines them in torch; the serving call's
    sm_90 path stores them with `pool_states.combine_checkpoints` instead (one launch)."""

    CQ: torch.Tensor
    CP: torch.Tensor
    S_in: torch.Tensor
    seg_end: torch.Tensor
    positions: torch.Tensor

    def states(self) -> torch.Tensor:
        """[M, HV, K, V] in CQ's dtype: CQ + CP S_in(j), j the slot holding token p - 1 (the first slot
        whose end is past it). One batched GEMM; no host read."""
        CQ, CP, S_in = self.CQ, self.CP, self.S_in
        M, HV, K, V = CQ.shape
        pos = self.positions.to(device=CQ.device, dtype=torch.int64)
        j = torch.searchsorted(self.seg_end.contiguous(), pos - 1, right=True).clamp(max=max(S_in.shape[0] - 1, 0))
        S_e = S_in.index_select(0, j).to(CQ.dtype)
        return torch.baddbmm(CQ.reshape(M * HV, K, V), CP.reshape(M * HV, K, K), S_e.reshape(M * HV, K, V)).view(M, HV, K, V)


class CPInfo(NamedTuple):
    """What a CP forward did (for tests and benchmarks; tensors stay on the device).

    plan: the `CPPlan`. tables: the `SegmentTables`. mode: "exact" or "gated". S_in: [M, HV, K, V]
    the entering state each slot was corrected from (zeros where not corrected). P: [M, HV, K, K]
    transitions (exact mode; None in gated mode). Q: [M, HV, K, V] end states of the run.
    gate_decay_window, gate_decay_segment: [M, HV] fp64 summed log-decay (natural log) of each slot's
    first min(m, chunks) chunks and of the whole segment (gated mode, else None). gate_ok: [M, HV]
    bool, gated mode: both decays that bound this slot's error are below GATE_THRESHOLD (the window
    of the slot itself when it has more than m chunks, the whole previous segment of its sequence),
    True where nothing was dropped. transition_chunks: [M, HV] int32, exact mode: the chunks each
    slot's transition walked (0 on slots not corrected; fewer than the slot has where the gate-driven
    cut applied, `transition_limits`). saved: the `CPSaved` of `cp_forward(keep_for_backward=True)`,
    else None (the info `cp_forward` builds for that alone, without want_info, leaves S_in None).
    checkpoints: the `CheckpointParts` of `cp_forward(checkpoint_positions=...)` (their `states()`:
    [M_ckpt, HV, K, V] in the backend's state dtype), else None.
    """

    plan: object
    tables: SegmentTables
    mode: str
    S_in: torch.Tensor
    P: torch.Tensor | None
    Q: torch.Tensor
    gate_decay_window: torch.Tensor | None
    gate_decay_segment: torch.Tensor | None
    gate_ok: torch.Tensor | None
    transition_chunks: torch.Tensor | None = None
    saved: CPSaved | None = None
    checkpoints: CheckpointParts | None = None


def flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [1, B * T, ...] (a view of a contiguous tensor)."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def _corrected_slots(tab: SegmentTables, Mc: int, mask: torch.Tensor | None = None) -> torch.Tensor:
    """[Mc] int64: the slots with need_correction (or `mask` [M] bool) in slot order, then M ("none")
    for the rest.

    Mc = floor(total / L) bounds the non-first segments (each follows a full segment of its sequence;
    one more with an open sequence's first slot). A cumsum and one scatter; the dummy row Mc takes the
    writes of the other slots."""
    M = tab.M
    dev = tab.valid.device
    nc = tab.need_correction if mask is None else mask
    rank = torch.cumsum(nc.to(torch.int64), 0) - 1
    dst = torch.where(nc, rank, torch.full_like(rank, Mc))
    sel = torch.full((Mc + 1,), M, dtype=torch.int64, device=dev)
    sel = sel.index_copy(0, dst, torch.arange(M, dtype=torch.int64, device=dev))
    return sel[:Mc]


def _token_rows(tab: SegmentTables, sel: torch.Tensor, width: int):
    """Token index [Mc, width] of the first `width` tokens of each selected slot (0 where past the
    segment's end or for "none"), and the validity mask [Mc, width]."""
    start = with_extra_row(tab.start, 0)[sel]
    length = with_extra_row(tab.end - tab.start, 0)[sel]
    pos = torch.arange(width, dtype=torch.int64, device=sel.device)
    valid = pos[None, :] < length[:, None]
    tok = torch.where(valid, start[:, None] + pos[None, :], torch.zeros((), dtype=torch.int64, device=sel.device))
    return tok, valid


def _run_states(h0: torch.Tensor, tab: SegmentTables) -> torch.Tensor:
    """[M, HV, K, V]: the state each slot's run starts from, h0[h0_index] on first segments and zero
    elsewhere. On sm_90 with fp32 states one launch (`kernels/sm90/cp_relayout.slot_initial_states`),
    else the torch expression (its reference)."""
    if h0.dtype == torch.float32 and on_sm90(h0):
        return slot_initial_states(h0, tab.h0_index)
    return torch.where(tab.first[:, None, None, None], h0.index_select(0, tab.h0_index.clamp(min=0)), h0.new_zeros(()))


def _token_kernels_apply(rows: torch.Tensor, U: torch.Tensor) -> bool:
    """The one-launch correction / segment-gradient kernels (`kernels/sm90/cp_correct.py`) apply: U in
    bf16 or fp16 (`rows`, the forward's o or the backward's do, is cast to U's dtype), rows of width
    K = V = 128, an sm_90 device."""
    return (U.dtype in (torch.bfloat16, torch.float16) and rows.dtype.is_floating_point
            and U.shape[-1] == 128 and rows.shape[-1] == 128 and on_sm90(U) and on_sm90(rows))


def _correct_one_sequence(o, U, S_c, total: int, L: int, first: int = 1) -> None:
    """o += U @ S_c over segment j >= first of a single sequence [0, total) (segment j = slot j = tokens
    [jL, min((j + 1) L, total))), in place, one GEMM per value head per block shape (no copies).
    first = 0 corrects the first segment too (an open sequence, `cp_forward_open`)."""
    nseg = -(-total // L)
    if nseg <= first:
        return
    HV, V, K = o.shape[2], o.shape[3], U.shape[3]
    of, Uf = o.view(total, HV, V), U.view(total, HV, K)
    nfull = total // L
    if nfull > first:
        ob = of[: nfull * L].view(nfull, L, HV, V)
        Ub = Uf[: nfull * L].view(nfull, L, HV, K)
        for h in range(HV):
            ob[first:, :, h].baddbmm_(Ub[first:, :, h], S_c[first:nfull, h])
    if total % L and nfull >= first:
        op, Up = of[nfull * L :], Uf[nfull * L :]
        for h in range(HV):
            op[:, h].addmm_(Up[:, h], S_c[nfull, h])


def _correct_gathered(o, Ug, S_sel, tok, valid) -> None:
    """o[tok] += Ug @ S_sel per selected slot: token rows `tok` [Mc, W] of o, their U rows Ug
    [Mc, W, HV, K], entering states S_sel [Mc, HV, K, V]; rows with valid False add zero. One batched
    GEMM and an index_add (each valid token appears once)."""
    Mc, W = tok.shape
    HV, V = o.shape[2], o.shape[3]
    if Mc == 0:
        return
    of = o.view(-1, HV, V)
    Ug = torch.where(valid[:, :, None, None], Ug, Ug.new_zeros(()))
    R = torch.matmul(Ug.permute(0, 2, 1, 3), S_sel)  # [Mc, HV, W, V]
    of.index_add_(0, tok.reshape(-1), R.permute(0, 2, 1, 3).reshape(Mc * W, HV, V))


def _chunk_end_decay(g_cum_log2: torch.Tensor, slot_rows: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """Sum over the given chunk slots [R, C'] (valid mask) of each chunk's total log-decay (natural
    log, fp64) per value head: [R, HV]. A chunk's total is its g_cum at row 63 (rows past a sequence's
    end repeat the last valid value)."""
    HV = g_cum_log2.shape[0]
    ends = g_cum_log2.view(HV, -1, CHUNK)[:, :, CHUNK - 1].to(torch.float64)  # [HV, S]
    S = ends.shape[1]
    vals = ends[:, slot_rows.clamp(0, max(S - 1, 0)).reshape(-1)].view(HV, *slot_rows.shape)
    vals = torch.where(valid[None], vals, vals.new_zeros(()))
    return (vals.sum(-1) * _LN2).transpose(0, 1)


def transition_limits(g_cum_log2: torch.Tensor, tables: SegmentTables, cutoff: float | None) -> torch.Tensor:
    """[M, HV] int32: how many chunks each slot's transition walks (gate-driven, decided on the device).

    0 on slots that are not corrected (first segments, inert slots). On the others, all the slot's
    chunks when cutoff is None; else the chunks up to and including the first chunk c at which the
    summed log-decay from the slot's start, sum over chunks 0..c of g, falls below `cutoff` (natural
    log), or all of them when it never does (a head with g == 0 always walks its whole segment). The
    sums are of the prepare kernel's fp32 chunk totals in log2 units, compared with cutoff / ln 2: a sum
    within fp32 rounding of the cutoff may count as below (then the dropped terms are at most
    exp(cutoff) up to that rounding).
    Past chunk c every contribution of the entering state S_in to a later state is at most
    exp(cutoff) ||S_in||_F and to an output o_t at most scale ||q_t|| exp(cutoff) ||S_in||_F (records
    CP-4 / CP-5; keys of unit norm and beta in [0, 1]), so the transition P is taken as 0 and U's
    later rows as 0. No host sync.

    g_cum_log2: [HV, S * 64] the prepare kernel's chunk-local cumsum of g in log2 units, slot layout of
    tables.cu_seqlens (a chunk's total is its row 63: rows past a sequence's end repeat the last
    valid value). On sm_90 one kernel launch (`kernels/sm90/cp_limits.py`), else torch ops.
    """
    if g_cum_log2.dtype == torch.float32 and on_sm90(g_cum_log2):  # one launch (`kernels/sm90/cp_limits.py`)
        return cp_transition_limits(g_cum_log2, tables.cu_seqlens, tables.need_correction,
                                    None if cutoff is None else float(cutoff) / _LN2)
    return _transition_limits_torch(g_cum_log2, tables, cutoff)


def _transition_limits_torch(g_cum_log2: torch.Tensor, tables: SegmentTables, cutoff: float | None) -> torch.Tensor:
    """`transition_limits` in torch ops (any device; the kernel's reference)."""
    M = tables.M
    HV = g_cum_log2.shape[0]
    dev = g_cum_log2.device
    nchunks = -(-(tables.end - tables.start) // CHUNK)  # [M]
    corr = tables.need_correction
    if cutoff is None or M == 0:
        lim = torch.where(corr, nchunks, torch.zeros_like(nchunks))[:, None].expand(M, HV)
        return lim.to(torch.int32).contiguous()
    S = g_cum_log2.shape[1] // CHUNK
    nmax = max(-(-tables.segment_len // CHUNK), 1)
    base = torch.div(tables.start, CHUNK, rounding_mode="floor") + torch.arange(M, device=dev)
    pos = torch.arange(nmax, dtype=torch.int64, device=dev)
    idx = (base[:, None] + pos[None, :]).clamp(0, max(S - 1, 0))  # [M, nmax]
    valid = pos[None, :] < nchunks[:, None]
    ends = g_cum_log2.view(HV, S, CHUNK)[:, :, CHUNK - 1]  # [HV, S], log2
    vals = torch.where(valid[None], ends[:, idx], ends.new_zeros(()))  # [HV, M, nmax]
    above = torch.cumsum(vals, -1) >= float(cutoff) / _LN2  # still above the cutoff after chunk c
    before = torch.cumprod(above.to(torch.int32), -1).sum(-1)  # chunks before the first crossing
    lim = torch.minimum(before + 1, nchunks[None, :])
    lim = torch.where(corr[None, :], lim, torch.zeros_like(lim))
    return lim.transpose(0, 1).to(torch.int32).contiguous()


def _keep_rows(tab: SegmentTables, limit: torch.Tensor, total: int) -> torch.Tensor:
    """[total, HV] bool: token rows inside the chunks a slot's transition walked (False elsewhere:
    rows of uncorrected slots, past a limit, past every sequence). Each row finds its slot by a
    search over the pseudo offsets (the last slot starting at or before it, so empty slots are
    skipped); O(total x HV) memory."""
    M, HV = limit.shape
    dev = limit.device
    if M == 0 or total == 0:
        return torch.zeros(total, HV, dtype=torch.bool, device=dev)
    pcu = tab.cu_seqlens.to(torch.int64)
    t = torch.arange(total, dtype=torch.int64, device=dev)
    slot = (torch.searchsorted(pcu.contiguous(), t, right=True) - 1).clamp(0, M - 1)
    inside = (t >= pcu[slot]) & (t < pcu[slot + 1])
    chunk = torch.div(t - pcu[slot], CHUNK, rounding_mode="floor")
    return inside[:, None] & (chunk[:, None] < limit.to(torch.int64)[slot])


def _run_and_transition(backend, qf, kf, vf, A, G2, scale, h0_run, limit, tab: SegmentTables, pcu, block_v, o_buf,
                        truncated: bool, positions=None):
    """Exact mode's steps 1 and 2 with each slot's transition walking `limit` chunks: (o, Q, U, P).

    On the sm_90 kernels one launch (`Sm90Backend.recurrent_dual`); elsewhere the run and a full
    transition launch, then U's rows past the limits and P where a limit cut the walk short set to 0
    (what the dual launch computes; U rows it does not write are never read by the correction
    kernels). Where U goes to a torch consumer instead and a limit may cut, its unwritten rows are set
    to 0 here (without a cut the dual launch writes every row of every corrected slot, the only rows
    the torch consumers read).

    With checkpoint `positions` ([M] global offsets, sorted, each inside a sequence) the backend's
    `recurrent_dual_checkpoints` runs instead (one launch on sm_90) and (o, Q, U, P, CQ, CP) is
    returned: CQ [M, HV, K, V] the run's states there, CP [M, HV, K, K] the transitions' (0 past a
    limit); ValueError when the backend has none."""
    total = qf.shape[1]
    HV, K = G2.shape[0], kf.shape[3]
    extra = ()
    if positions is not None:
        dual_ck = getattr(backend, "recurrent_dual_checkpoints", None)
        out = None if dual_ck is None else dual_ck(qf, kf, vf, A, G2, scale, h0_run, limit, pcu, positions, block_v,
                                                     o_buf)
        if out is None:
            raise ValueError(f"checkpoint_positions on the split path need a backend with recurrent_dual_checkpoints "
                             f"(K == V on the sm_90 kernels); {getattr(backend, 'name', backend)!r} has none here")
        out, extra = out[:4], out[4:]
    else:
        dual = getattr(backend, "recurrent_dual", None)
        out = None if dual is None else dual(qf, kf, vf, A, G2, scale, h0_run, limit, pcu, block_v, o_buf)
    if out is not None:
        o, Q, U, P = out
        if truncated and not _token_kernels_apply(o, U):
            U = torch.where(_keep_rows(tab, limit, total)[None, :, :, None], U, U.new_zeros(()))
        return (o, Q, U, P) + tuple(extra)
    o, Q = _recurrent(backend, qf, kf, vf, A, G2, scale, h0_run, True, pcu, block_v, o_buf)
    sd = backend.state_dtype
    eye = torch.eye(K, dtype=sd, device=qf.device)
    h0_tr = torch.where((limit > 0)[:, :, None, None], eye, torch.zeros((), dtype=sd, device=qf.device)).contiguous()
    vz = backend.zeros((1, total, HV, K), vf.dtype, qf.device)
    U, P = _recurrent(backend, qf, kf, vz, A, G2, scale, h0_tr, True, pcu, block_v, None)
    if truncated:
        nchunks = -(-(tab.end - tab.start) // CHUNK)
        P = torch.where((limit < nchunks[:, None])[:, :, None, None], P.new_zeros(()), P)
        U = torch.where(_keep_rows(tab, limit, total)[None, :, :, None], U, U.new_zeros(()))
    return o, Q, U, P


def _gated_layout(tab: SegmentTables, Mc: int, m: int, S_slots: int):
    """Indices of the gate-driven mode's compact layout (Mc sequences of m chunks, one per non-first
    segment in slot order; compact slot of chunk c of sequence i: i (m + 1) + c)."""
    M = tab.M
    dev = tab.valid.device
    W = m * CHUNK
    sel = _corrected_slots(tab, Mc)
    tok, valid = _token_rows(tab, sel, W)
    prev = with_extra_row(tab.prev, -1)[sel].clamp(0, max(M - 1, 0))  # "none" rows: any slot (they add nothing)
    nchunks = -(-(tab.end - tab.start) // CHUNK)  # [M]
    base = torch.div(tab.start, CHUNK, rounding_mode="floor") + torch.arange(M, device=dev)
    cpos = torch.arange(m, dtype=torch.int64, device=dev)
    src = (with_extra_row(base, 0)[sel][:, None] + cpos[None, :]).clamp(0, max(S_slots - 1, 0))  # [Mc, m] pseudo slots
    cvalid = cpos[None, :] < with_extra_row(nchunks, 0)[sel][:, None]
    last = tab.seq_last.clamp(min=0)
    rank = torch.cumsum(tab.need_correction.to(torch.int64), 0) - 1
    covered = (tab.seq_num >= 2) & (nchunks[last] <= m)
    return dict(sel=sel, tok=tok, valid=valid, prev=prev, nchunks=nchunks, base=base, cpos=cpos, src=src.reshape(-1),
                cvalid=cvalid.reshape(-1), last=last, last_prev=(last - 1).clamp(min=0),
                ri=rank[last].clamp(0, max(Mc - 1, 0)), covered=covered, nonempty=tab.seq_num >= 1)


def cp_forward(backend, q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens,
               tables: SegmentTables, *, block_v: int, gate_chunks: int | None = None, correction: str = "gemm",
               poison_outputs: bool = False, want_info: bool = True, static_key=None, truncate=False,
               keep_for_backward: bool = False, ends_at_T: bool = False, checkpoint_positions=None, a_dtype=None):
    """The CP forward over the planner's segment tables (the steps in the module docstring).

    Args:
        backend: a `CPBackend`. q, k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV] (validated,
            contiguous; g natural log); scale: float; initial_state: None or [N, HV, K, V];
            output_final_state: bool; cu_seqlens: None or [N + 1] (B == 1).
        tables: `build_segment_tables` for these offsets (or B rows of T tokens); its pseudo offsets
            are used as given (their dtype picks the compiled kernel).
        block_v: value-slice width of every recurrent launch. gate_chunks: None (exact) or m >= 1
            (gated mode). correction: "gemm" or "rerun" (exact mode). poison_outputs: fill o with NaN
            before the first launch (every token is written by the run). truncate: exact mode's
            gate-driven cut of each (slot, value head) transition (`resolve_truncate`: False walks
            whole segments; default here False, the public entry points default to
            TRUNCATE_LOG_DECAY). want_info: build the
            `CPInfo` (in gated mode that includes the per-(slot, head) decays and flag: a few dozen
            small launches). keep_for_backward: exact mode: also return the `CPSaved` a backward over
            the same segments can use (`cp_backward(saved=...)`), as the info's `saved` field (the
            info is then built even without want_info). static_key: a hashable key of the static facts when the tables depend on
            shapes alone (fixed-length input): the index tensors are then built once per key.
            ends_at_T: the offsets are known to end at T (`CallPlan.ends_at_T`): o is allocated
            uninitialised (every token is written by the run) instead of the launcher's zero fill.
            checkpoint_positions: None or int32/int64 [M] on the device, sorted global offsets into
            the B * T flattened tokens, each inside a sequence (exact mode only; the backend's
            `recurrent_dual_checkpoints`): the states after the first p tokens, returned as the
            info's `checkpoints`, a `CheckpointParts` (the info is then built even without
            want_info). Segment j holding token p - 1 gives the state as CQ + CP S_in(j) (records
            CP-1, CF-4: the run's state there plus the transition's applied to the entering state;
            `CheckpointParts.states()` forms it, the serving call's sm_90 path stores it in one
            launch), with no pass beyond the run and transition launch; o and the final states
            are those of the call without checkpoints.
            a_dtype: A's dtype for the backend's prepare (None: k's; torch.float16: the inference
            forward's fp16 A_beta product, `flashqla.ops.gdn.fwd.product_dtype`; not with
            keep_for_backward); every launch that reads A follows it.
    Returns:
        (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] in backend.state_dtype or None,
        A, g_cum_log2 (slot layout of tables.cu_seqlens), CPInfo with plan=None, or None).
    Raises:
        ValueError: unknown correction, gate_chunks < 1, checkpoint_positions with gate_chunks or
            with a backend that has no `recurrent_dual_checkpoints`.
    """
    if checkpoint_positions is not None and gate_chunks is not None:
        raise ValueError("checkpoint_positions need exact mode (gate_chunks None)")
    if correction not in CORRECTIONS:
        raise ValueError(f"correction must be one of {CORRECTIONS}, got {correction!r}")
    if gate_chunks is not None and int(gate_chunks) < 1:
        raise ValueError(f"gate_chunks must be a positive number of chunks, got {gate_chunks}")
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    total = B * T
    tab = tables
    M, N, L = tab.M, tab.N, tab.segment_len
    dev = q.device
    sd = backend.state_dtype
    pcu = tab.cu_seqlens
    qf, kf, vf, gf, bf = (flat(x) for x in (q, k, v, g, beta))
    if a_dtype is not None and keep_for_backward:
        raise ValueError("a_dtype: the backward reads A in q's dtype; not with keep_for_backward")
    A, G2 = backend.prepare(kf, gf, bf, pcu, HV, **({} if a_dtype is None else {"a_dtype": a_dtype}))
    key = lambda *parts: None if static_key is None else (static_key, *parts)  # noqa: E731
    mask = lambda b: b[:, None, None, None]  # noqa: E731
    one_sequence = N == 1 and B == 1 and ONE_SEQUENCE_FAST_PATH
    Mc = total // L  # bound on non-first segments

    # 1. run: first segments from h0, the others from zero
    h0_run = None
    h0 = None if initial_state is None else initial_state.to(sd)
    if h0 is not None and N > 0:
        h0_run = _run_states(h0, tab)
    o_buf = torch.full_like(vf, float("nan")) if poison_outputs else (torch.empty_like(vf) if ends_at_T else None)

    info = None
    if gate_chunks is None:
        # 1. run and 2. transition (U, P; one launch on sm_90), each transition cut where its gates
        # have decayed past the cutoff, then 3. scan
        cutoff = resolve_truncate(truncate)
        limit = transition_limits(G2, tab, cutoff)
        ck = _run_and_transition(backend, qf, kf, vf, A, G2, scale, h0_run, limit, tab, pcu, block_v, o_buf,
                                 cutoff is not None, checkpoint_positions)
        o, Q, U, P = ck[:4]
        # (the scan skips the products the cut dropped; exact transitions have none to skip)
        S_in, final = scan_segment_states(P, Q, tab, T, h0, first_from_h0=True, limit=_cut(limit, cutoff))
        # 4. correction
        if correction == "rerun":
            # into o_buf (None: device offsets that may end before T, whose tail `new_output` zeroes)
            o, _ = _recurrent(backend, qf, kf, vf, A, G2, scale, S_in.contiguous(), False, pcu, block_v, o_buf)
        elif _token_kernels_apply(o, U):  # one launch over every corrected slot, the walked chunks only
            cp_correct(o, U, S_in, pcu, limit=limit, max_rows=L)
        elif one_sequence:  # reads slots 1 .. nseg - 1 only
            _correct_one_sequence(o, U, S_in.to(o.dtype), total, L)
        else:
            sel, tok, valid = memo_layout(key("rows", L), lambda: (lambda s: (s, *_token_rows(tab, s, L)))(_corrected_slots(tab, Mc)))
            Ug = U.view(total, HV, K).index_select(0, tok.reshape(-1)).view(Mc, L, HV, K)
            Sx = torch.where(mask(tab.need_correction), S_in, S_in.new_zeros(())).to(o.dtype)
            _correct_gathered(o, Ug, with_extra_row(Sx, 0)[sel], tok, valid)
        ckpt = None if checkpoint_positions is None else CheckpointParts(ck[4], ck[5], S_in, tab.end, checkpoint_positions)
        if want_info or keep_for_backward or ckpt is not None:  # (the masked copy only when the info is wanted)
            S_c = torch.where(mask(tab.need_correction), S_in, S_in.new_zeros(())) if want_info else None
            saved = (CPSaved(L, cutoff, total, N, h0 is not None, cu_key(cu_seqlens), S_in, P, U, limit, A, G2)
                     if keep_for_backward else None)
            info = CPInfo(None, tab, "exact", S_c, P, Q, None, None, None, limit, saved, ckpt)
    else:
        o, Q = _recurrent(backend, qf, kf, vf, A, G2, scale, h0_run, True, pcu, block_v, o_buf)
        m = min(int(gate_chunks), L // CHUNK)  # a segment has at most L / 64 chunks
        W = m * CHUNK
        S_slots = A.shape[1] // CHUNK
        lay = memo_layout(key("gated", m, S_slots), lambda: _gated_layout(tab, Mc, m, S_slots))
        # entering states: the zero-start end state of the previous segment (P dropped, CP-4)
        S_sel = Q.index_select(0, lay["prev"]) if M else Q  # [Mc, HV, K, V]
        X = None
        if Mc > 0:
            # the compact layout: first m chunks of each non-first segment, gap slot i (m + 1) + m unread
            Sc = Mc * (m + 1)
            cv = lay["cvalid"]
            Ac = A.new_empty(HV, Mc, m + 1, CHUNK, CHUNK)
            Ac[:, :, :m] = torch.where(cv[None, :, None, None], A.view(HV, S_slots, CHUNK, CHUNK)[:, lay["src"]],
                                       A.new_zeros(())).view(HV, Mc, m, CHUNK, CHUNK)
            Gc = G2.new_empty(HV, Mc, m + 1, CHUNK)
            Gc[:, :, :m] = torch.where(cv[None, :, None], G2.view(HV, S_slots, CHUNK)[:, lay["src"]],
                                       G2.new_zeros(())).view(HV, Mc, m, CHUNK)
            tok = lay["tok"].reshape(-1)  # rows past a segment's end read token 0: finite, multiplied by 0
            qc = qf[0].index_select(0, tok)[None]
            kc = kf[0].index_select(0, tok)[None]
            vz = backend.zeros((1, Mc * W, HV, K), v.dtype, dev)
            cu_c = memo_layout(("cu_c", Mc, W, pcu.dtype, str(dev)), lambda: torch.arange(Mc + 1, dtype=pcu.dtype, device=dev) * W)
            h0_c = memo_layout(("eye", Mc, HV, K, sd, str(dev)), lambda: torch.eye(K, dtype=sd, device=dev).expand(Mc, HV, K, K).contiguous())
            Uc, X = _recurrent(backend, qc, kc, vz, Ac.view(HV, Sc * CHUNK, CHUNK), Gc.view(HV, Sc * CHUNK), scale,
                               h0_c, True, cu_c, block_v, None)
            if one_sequence:
                _correct_one_sequence_head(o, Uc.view(Mc, W, HV, K), S_sel.to(o.dtype), total, L, W)
            else:
                _correct_gathered(o, Uc.view(Mc, W, HV, K), S_sel.to(o.dtype), lay["tok"], lay["valid"])
        # final states: Q of the last segment, plus P S_in where the compact pass covered it whole
        final = Q.index_select(0, lay["last"]) if N > 0 else Q.new_zeros(0, HV, K, V)
        if X is not None and N > 0:
            extra = X.index_select(0, lay["ri"]) @ Q.index_select(0, lay["last_prev"])
            final = torch.where(mask(lay["covered"]), final + extra, final)
        if N > 0:
            final = torch.where(mask(lay["nonempty"]), final, h0 if h0 is not None else final.new_zeros(()))
        if want_info:
            info = _gated_info(tab, lay, G2, Q, S_sel, m, Mc, sd)

    o = o.view(B, T, HV, V)
    if not output_final_state:
        final = None
    return o, final, A, G2, info


def _correct_one_sequence_head(o, Uc, S_sel, total: int, L: int, W: int) -> None:
    """Gated mode, one sequence: o += Uc @ S over the first W tokens of segments 1 .. nseg - 1
    (compact row block i <- segment i + 1), one in-place GEMM per value head per block shape."""
    HV, V = o.shape[2], o.shape[3]
    of = o.view(total, HV, V)
    nfull = total // L
    if nfull >= 2:
        ob = of[: nfull * L].view(nfull, L, HV, V)[1:, :W]
        for h in range(HV):
            ob[:, :, h].baddbmm_(Uc[: nfull - 1, :, h], S_sel[: nfull - 1, h])
    rem = total - nfull * L
    if rem and nfull >= 1:
        w = min(W, rem)
        op = of[nfull * L : nfull * L + w]
        for h in range(HV):
            op[:, h].addmm_(Uc[nfull - 1, :w, h], S_sel[nfull - 1, h])


def _gated_info(tab, lay, G2, Q, S_sel, m, Mc, sd) -> CPInfo:
    """The gated mode's certificate: summed log-decay of each slot's first min(m, chunks) chunks and of
    the whole segment, and the per-(slot, head) flag (module docstring)."""
    M = tab.M
    dev = G2.device
    HV = G2.shape[0]
    nchunks, base, cpos = lay["nchunks"], lay["base"], lay["cpos"]
    win = _chunk_end_decay(G2, base[:, None] + cpos[None, :], cpos[None, :] < nchunks[:, None])
    nmax = -(-tab.segment_len // CHUNK)
    fpos = torch.arange(nmax, dtype=torch.int64, device=dev)
    seg = _chunk_end_decay(G2, base[:, None] + fpos[None, :], fpos[None, :] < nchunks[:, None])
    thr = GATE_THRESHOLD
    own_ok = (~tab.need_correction | (nchunks <= m))[:, None] | (win < thr)
    prev_seg = with_extra_row(seg, 0.0)[torch.where(tab.prev >= 0, tab.prev, torch.full_like(tab.prev, M))]
    in_ok = ~tab.need_correction[:, None] | (prev_seg < thr)
    ok = own_ok & in_ok | ~tab.valid[:, None]
    K, V = Q.shape[2], Q.shape[3]
    S_full = torch.zeros(M + 1, HV, K, V, dtype=sd, device=dev)
    if Mc > 0:
        S_full = S_full.index_copy(0, lay["sel"], S_sel.to(sd))
    return CPInfo(None, tab, "gated", S_full[:M], None, Q, win, seg, ok)


def _recurrent(backend, q, k, v, A, G2, scale, h0, want_final, cu, block_v, o):
    if o is None:
        return backend.recurrent(q, k, v, A, G2, scale, h0, want_final, cu, block_v)
    return backend.recurrent(q, k, v, A, G2, scale, h0, want_final, cu, block_v, o=o)


class OpenForward(NamedTuple):
    """What `cp_forward_open` keeps for `cp_backward_open` (all on the device).

    A, g_cum_log2: the prepare products in the slot layout of tables.cu_seqlens. S_in [M, HV, K, V]:
    the true entering state of every slot (state dtype). A_open [J, HV, K, K]: the composed maps
    A_j = P_{j-1} ... P_0 of the open sequence's slots j < J (None when not open), P_open [HV, K, K]:
    its whole map A_m (None when not open). open_first: whether local sequence 0 was open.
    """

    A: torch.Tensor
    g_cum_log2: torch.Tensor
    S_in: torch.Tensor
    A_open: torch.Tensor | None
    P_open: torch.Tensor | None
    open_first: bool


def _open_mask(tab: SegmentTables, open_first: bool):
    """(slots corrected [M] bool, slot 0 of an open sequence 0 [M] bool or None)."""
    if not open_first:
        return tab.need_correction, None
    open0 = tab.first & (tab.seq == 0)
    return tab.need_correction | open0, open0


def _transition(backend, qf, kf, vdtype, A, G2, scale, mask, pcu, block_v):
    """The transition launch: v = 0 from I on the slots of `mask` (zero elsewhere): U rows, P."""
    M, HV, K = mask.shape[0], G2.shape[0], kf.shape[3]
    sd = backend.state_dtype
    dev = qf.device
    h0_tr = torch.where(mask[:, None, None, None], torch.eye(K, dtype=sd, device=dev),
                        torch.zeros((), dtype=sd, device=dev)).expand(M, HV, K, K).contiguous()
    vz = backend.zeros((1, qf.shape[1], HV, K), vdtype, dev)
    return _recurrent(backend, qf, kf, vz, A, G2, scale, h0_tr, True, pcu, block_v, None)


def _open_sequence_rows(tab: SegmentTables, J: int) -> torch.Tensor:
    """[J] bool: slot j < J belongs to sequence 0 (slot j is its segment j)."""
    return tab.valid[:J] & (tab.seq[:J] == 0)


def cp_forward_open(backend, q, k, v, g, beta, scale: float, initial_state, tables: SegmentTables, *, block_v: int,
                    exchange, open_first: bool):
    """The exact CP forward over one packed row whose sequence 0 may be "open": entered with a state
    S_in that is known only after `exchange` (the state leaving an earlier rank), with no extra
    recurrent launch for it.

    1. prepare over the segments; run: every first slot from its initial state, sequence 0's from zero
       when open, the others from zero -> o(0), Q;
    2. transition: v = 0 from I on every non-first slot AND on the open sequence's first slot -> U, P
       (one launch, all slots side by side);
    3. scan (`scan_open_states`): entering states B_j with S_in = 0, every final state with S_in = 0,
       and the open sequence's composed maps A_j and whole map P_open = A_m;
    4. S_in = exchange(P_open or None, final): the caller publishes the open sequence's map
       (P_open, final[0]) and/or an end state, communicates, and returns S_in [HV, K, V] (None when
       not open);
    5. entering states S_j = A_j S_in + B_j on the open sequence's slots (one batched GEMM), its final
       state P_open S_in + final[0]; the output correction o_t += S_j^T U_t over every corrected slot
       (the open first slot included), GEMMs as `cp_forward`.
    Launches: prepare, two recurrent launches over all slots; no host synchronisation.

    Args:
        backend: a `CPBackend`. q, k [1, T, H, K]; v [1, T, HV, V]; g, beta [1, T, HV] (contiguous,
            validated); scale: float; initial_state: None or [N, HV, K, V] (row 0 not read when open);
        tables: `build_segment_tables` for the row's offsets; block_v: value-slice width;
        exchange: callable (P_open [HV, K, K] or None, final [N, HV, K, V]) -> S_in [HV, K, V] or None;
        open_first: whether local sequence 0 is open (else this is `cp_forward`'s exact mode, with the
            exchange between scan and correction).
    Returns:
        (o [1, T, HV, V] in v's dtype, final [N, HV, K, V] state dtype (true end states), `OpenForward`).
    """
    T = q.shape[1]
    HV, V = v.shape[2], v.shape[3]
    tab = tables
    M, N, L = tab.M, tab.N, tab.segment_len
    sd = backend.state_dtype
    pcu = tab.cu_seqlens
    if hasattr(backend, "warm"):
        backend.warm(k, beta, q, v, pcu, HV, block_v)
    A, G2 = backend.prepare(k, g, beta, pcu, HV)
    mask4 = lambda b: b[:, None, None, None]  # noqa: E731
    corr, open0 = _open_mask(tab, open_first)
    h0 = None if initial_state is None else initial_state.to(sd)
    h0_run = None
    if h0 is not None and N > 0:
        first = tab.first if open0 is None else tab.first & ~open0
        h0_run = torch.where(mask4(first), h0.index_select(0, tab.h0_index.clamp(min=0)), h0.new_zeros(()))
    o, Q = _recurrent(backend, q, k, v, A, G2, scale, h0_run, True, pcu, block_v, None)
    U, P = _transition(backend, q, k, v.dtype, A, G2, scale, corr, pcu, block_v)
    if open_first:
        S_start, final, A_open, P_open = scan_open_states(P, Q, tab, T, h0)
    else:
        S_start, final = scan_segment_states(P, Q, tab, T, h0, first_from_h0=True)
        A_open = P_open = None
    S_in = exchange(None if P_open is None else P_open.to(sd), final)
    if open_first:
        if S_in is None:
            raise ValueError("exchange returned no entering state for the open sequence")
        S_in = S_in.to(sd)
        J = A_open.shape[0]
        rows = _open_sequence_rows(tab, J)
        add = torch.where(mask4(rows), torch.matmul(A_open.to(sd), S_in), S_start.new_zeros(()))
        S_start = torch.cat([S_start[:J] + add, S_start[J:]]) if J < M else S_start + add
        final = final.clone()
        final[0] = torch.baddbmm(final[0], P_open.to(sd), S_in)
    if _token_kernels_apply(o, U):
        cp_correct(o, U, S_start, tab.cu_seqlens, corr, max_rows=tab.segment_len)
    elif N == 1 and ONE_SEQUENCE_FAST_PATH:
        _correct_one_sequence(o, U, S_start.to(o.dtype), T, L, first=0 if open_first else 1)
    else:
        Mc = T // L + (1 if open_first else 0)
        sel = _corrected_slots(tab, Mc, corr)
        tok, valid = _token_rows(tab, sel, L)
        K = k.shape[3]
        Ug = U.view(T, HV, K).index_select(0, tok.reshape(-1)).view(Mc, L, HV, K)
        Sx = torch.where(mask4(corr), S_start, S_start.new_zeros(())).to(o.dtype)
        _correct_gathered(o, Ug, with_extra_row(Sx, 0)[sel], tok, valid)
    saved = OpenForward(A, G2, S_start.to(sd), A_open, None if P_open is None else P_open.to(sd), bool(open_first))
    return o, final.to(sd), saved


def _cut(limit, cutoff):
    """The limits the combine scans take (`scan_segment_states(limit=...)`): the transitions' walked
    chunks under the gate-driven cut, None for exact transitions (nothing dropped to skip)."""
    return None if cutoff is None else limit

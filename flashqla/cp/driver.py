"""Intra-device context-parallel (CP) forward: the existing sm_90 launches orchestrated over segments.

No new kernel. The planner (`flashqla.cp.planner`) cuts every long sequence into segments of L tokens
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
default; `truncate=False` or $FLASHQLA_CP_EXACT=1 turns it off): it walks chunks only until the summed
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

Backward (`cp_backward`, `chunk_gated_delta_rule_cp_bwd`; exact). The state gradient crosses segments
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

Measured on the H200 (2/8 heads, 1 x 32768 tokens, `tests/gpu/cp_bench.py`, CUDA graphs; before
the shape-keyed index cache and the on-demand certificate below): unsplit 1.58 ms; exact CP
0.68-0.72 ms (prepare 0.115, each recurrent launch 0.111, scan 0.157, correction 0.08-0.09, the
rest small torch launches); correction="rerun" 0.69-0.73 ms; gated mode 0.705 ms, of which ~0.4 ms
were small index and certificate launches (now built once per shape for fixed-length input, and
the certificate only when asked for). FlashQLA: 0.390 ms. Exact mode cannot go below prepare + two
recurrent launches (~0.34 ms) with these kernels.

No host synchronisation: every size comes from shapes (M = floor(T / L) + N slots; at most
floor(T / L) non-first segments), every index is computed by torch ops on the device, the scan runs a
shape-bound number of steps. Planning reads static facts only (`get_cp_plan`). For fixed-length
input (no cu_seqlens) the segment tables and every index tensor depend on shapes alone and are built
once per shape (`_LAYOUTS`); with cu_seqlens they are rebuilt from its current values on every call,
in one kernel launch on sm_90 (`flashqla.cp.tables_kernel`), and the combine scans are one launch
each (`flashqla.ops.gdn.kernels.sm90.cp_scan`).

Backends. The orchestration is written against `CPBackend` (prepare, recurrent, zeros, state_dtype);
`Sm90Backend` launches the sm_90 kernels; `reference.gdn.cp.ReferenceCPBackend` computes the same
launches in fp64 on any device, which is how the CPU tests prove the orchestration exact.
"""

from __future__ import annotations

import math
import os
import threading
from typing import NamedTuple, Protocol

import torch

from flashqla.cp.merge import scan_open_states, scan_segment_grads, scan_segment_states
from flashqla.cp.planner import CHUNK, GATE_THRESHOLD, TRUNCATE_LOG_DECAY, SegmentTables, build_segment_tables, get_cp_plan
from flashqla.cp.tables_kernel import segment_tables_device
from flashqla.ops.gdn.api import CP_ENV as _API_CP_ENV
from flashqla.ops.gdn.api import cp_mode

__all__ = [
    "CP_ENV",
    "CP_MODES",
    "CORRECTIONS",
    "CPBackend",
    "Sm90Backend",
    "CPInfo",
    "CPSaved",
    "cp_forward",
    "cp_backward",
    "cp_forward_open",
    "cp_backward_open",
    "OpenForward",
    "cp_splits",
    "chunk_gated_delta_rule_cp_fwd",
    "chunk_gated_delta_rule_cp_bwd",
    "segment_slots_to_sequence_slots",
    "sequence_slots_to_segment_slots",
    "transition_limits",
    "EXACT_ENV",
    "DUAL_ENV",
]

#: Environment variable with the default `cp` mode (the op's; unset here means "auto").
CP_ENV = _API_CP_ENV
#: "auto": the planner decides (exact mode); "on": always split (the planner's best split, or
#: `segment_len`); "off": never split.
CP_MODES = ("auto", "on", "off")
#: Output correction of exact mode: "gemm" (step 4 above) or "rerun" (a third recurrent launch).
CORRECTIONS = ("gemm", "rerun")
#: Environment variable: "1" makes every transition walk its whole segment (no gate-driven cut; the
#: `truncate=False` of `chunk_gated_delta_rule_cp_fwd` / `_bwd` for every call that does not say).
EXACT_ENV = "FLASHQLA_CP_EXACT"
#: Environment variable: "0" runs the run and transition as two launches on sm_90 instead of one
#: (`chunk_recurrent_dual`); for comparison, the results are bitwise the same.
DUAL_ENV = "FLASHQLA_CP_DUAL"

_LN2 = math.log(2.0)
#: One sequence (N == 1) corrects by in-place GEMMs on views of o and U (no gather); tests turn it off
#: to check it against the general path.
_ONE_SEQUENCE_FAST_PATH = True


class CPBackend(Protocol):
    """The launches the CP forward orchestrates (shapes as the sm_90 launchers).

    state_dtype: dtype of states (fp32 for the kernels).
    prepare(k [1, T, H, K], g [1, T, HV], beta [1, T, HV], cu_seqlens [N + 1], HV)
        -> (A [HV, S * 64, 64], g_cum_log2 [HV, S * 64]) in the slot layout of cu_seqlens
        (S = floor(T / 64) + N; `flashqla.ops.gdn.kernels.sm90._common`).
    recurrent(q, k, v [1, T, HV, V'], A, g_cum_log2, scale, initial_state [N, HV, K, V'] or None,
              output_final_state, cu_seqlens, block_v) -> (o [1, T, HV, V'], final_state or None).
        V' is V for the run and K for the transition pass (K == V on the kernels).
    zeros(shape, dtype, device) -> a zero tensor the launches only read (may be cached).
    bwd(q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens, order=None, dh0=None)
        -> (dq, dk, dv, dg, dbeta, dh0 or None): the unsplit backward from the forward's products
        (`flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd`), needed by `cp_backward` only; order:
        the launch order of the segments (`_common.launch_order`, packed batches), or None (token
        order; the same results); dh0: whether the caller uses the returned dh0 (None: when
        initial_state is given), a hint a backend may ignore (the sm_90 one picks pass 2's build).
    """

    state_dtype: torch.dtype

    def prepare(self, k, g, beta, cu_seqlens, HV: int): ...

    def recurrent(self, q, k, v, A, g_cum_log2, scale, initial_state, output_final_state, cu_seqlens, block_v=None): ...

    def zeros(self, shape, dtype, device): ...


class Sm90Backend:
    """`CPBackend` on the sm_90 kernels (`chunk_prepare_fwd`, `chunk_recurrent_fwd`). Compiles the two
    kernels of a configuration concurrently on first use. `zeros` keeps the last few zero value
    tensors it made (the transition pass reads v = 0; a [1, T, HV, K] bf16 buffer per shape)."""

    name = "sm90"
    state_dtype = torch.float32
    ZERO_CACHE = 4

    def __init__(self):
        self._built: set = set()
        self._zeros: dict = {}

    def warm(self, k, beta, q, v, cu_seqlens, HV: int, block_v, dual: bool = False) -> None:
        """Builds the prepare kernel and the recurrent kernel a call will launch (the dual launch's when
        `dual`) concurrently, once per key."""
        from flashqla.ops.gdn.kernels.sm90 import build_kernels
        from flashqla.ops.gdn.kernels.sm90.prepare import prepare_kernel_args
        from flashqla.ops.gdn.kernels.sm90.recurrent import recurrent_kernel_args

        key = (prepare_kernel_args(k, beta, cu_seqlens, HV), recurrent_kernel_args(q, v, cu_seqlens, block_v, dual=dual))
        if key not in self._built:
            build_kernels([("prepare", key[0]), ("recurrent", key[1])])
            self._built.add(key)

    def prepare(self, k, g, beta, cu_seqlens, HV: int):
        from flashqla.ops.gdn.kernels.sm90.prepare import chunk_prepare_fwd

        return chunk_prepare_fwd(k, g, beta, cu_seqlens, HV)

    def recurrent(self, q, k, v, A, g_cum_log2, scale, initial_state, output_final_state, cu_seqlens, block_v=None, o=None):
        from flashqla.ops.gdn.kernels.sm90.recurrent import chunk_recurrent_fwd

        return chunk_recurrent_fwd(q, k, v, A, g_cum_log2, scale, initial_state, output_final_state, cu_seqlens,
                                   block_v=block_v, o=o)

    def recurrent_dual(self, q, k, v, A, g_cum_log2, scale, initial_state, limit, cu_seqlens, block_v=None, o=None):
        """Run and transition in one launch (`chunk_recurrent_dual`): (o, Q, U, P); None when it does
        not apply (`_dual_applies`)."""
        from flashqla.ops.gdn.kernels.sm90.recurrent import chunk_recurrent_dual

        if not _dual_applies(q, v):
            return None
        return chunk_recurrent_dual(q, k, v, A, g_cum_log2, scale, initial_state, limit, cu_seqlens, block_v=block_v, o=o)

    def bwd(self, q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens, h_dtype=torch.bfloat16,
            order=None, dh0=None):
        """The unsplit backward's launches (`flashqla.ops.gdn.bwd`), called directly so that a CP
        decision placed in `chunk_gated_delta_rule_bwd` is not taken again on the segments; order:
        the segments' launch order (`_common.launch_order`) or None. dht: None, a tensor, or a
        callable returning one, called once the states pass (which does not read dht) is launched:
        `cp_backward` computes the segments' terminal gradients on a side stream meanwhile. dh0:
        whether the caller uses the segments' state gradients (None: when initial_state is given);
        pass 2's build follows it (`chunk_bwd.chunk_fused_bwd`)."""
        from flashqla.ops.gdn.bwd import _build_once
        from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_fused_bwd
        from flashqla.ops.gdn.kernels.sm90.finish_bwd import chunk_finish_bwd
        from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd

        join = dht if callable(dht) else None
        try:
            dh0 = initial_state is not None if dh0 is None else bool(dh0)
            _build_once(q, v, beta, cu_seqlens, h_dtype, dh0)
            q, k, v, beta, do = (x.contiguous() for x in (q, k, v, beta, do))
            h = chunk_states_bwd(k, v, A, g_cum_log2, initial_state, cu_seqlens, h_dtype, order=order)
        finally:  # joined even when a launch above raises (a capture must not end with an open fork)
            if join is not None:
                dht = join()
        dq_hv, dk_hv, dv, dbeta, dG, dS0 = chunk_fused_bwd(q, k, v, beta, A, g_cum_log2, h, do, dht, scale, cu_seqlens,
                                                           order=order, dh0=dh0)
        dq, dk, dg = chunk_finish_bwd(dG, dq_hv, dk_hv, cu_seqlens, q.shape[2], q.dtype)
        return dq, dk, dv, dg, dbeta.to(beta.dtype), (dS0 if initial_state is not None else None)

    def zeros(self, shape, dtype, device):
        key = (tuple(shape), dtype, str(device))
        z = self._zeros.pop(key, None)
        if z is None:
            z = torch.zeros(shape, dtype=dtype, device=device)
        self._zeros[key] = z  # most recent last
        while len(self._zeros) > self.ZERO_CACHE:
            self._zeros.pop(next(iter(self._zeros)))
        return z


def _dual_applies(q, v) -> bool:
    """The sm_90 backend runs the run and the transitions as one launch: K == V and not turned off by
    $FLASHQLA_CP_DUAL=0."""
    return os.environ.get(DUAL_ENV, "1") != "0" and q.shape[-1] == v.shape[-1]


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

    `cp_backward(saved=...)` uses them instead of the run-and-transition launch and the combine
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


def _cu_key(cu_seqlens) -> tuple | None:
    return None if cu_seqlens is None else (cu_seqlens.data_ptr(), cu_seqlens._version)


def _saved_applies(saved, tables: SegmentTables, total: int, HV: int, cutoff, has_h0: bool, cu_seqlens) -> bool:
    """Whether a forward's `CPSaved` matches the backward's segmentation (same L, sizes and cut) and
    inputs as far as they can be told apart without reading values (initial state given or not, the
    same cu_seqlens storage at the same version)."""
    return (saved is not None and saved.segment_len == tables.segment_len and saved.T == total
            and saved.N == tables.N and saved.cutoff == cutoff and saved.S_in.shape[0] == tables.M
            and saved.S_in.shape[1] == HV and saved.has_h0 == has_h0 and saved.cu_key == _cu_key(cu_seqlens))


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [1, B * T, ...] (a view of a contiguous tensor)."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def _ext(x: torch.Tensor, fill) -> torch.Tensor:
    """x with one extra row `fill` at index len(x) (the target of "no slot" indices)."""
    return torch.cat([x, torch.full((1, *x.shape[1:]), fill, dtype=x.dtype, device=x.device)])


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
    start = _ext(tab.start, 0)[sel]
    length = _ext(tab.end - tab.start, 0)[sel]
    pos = torch.arange(width, dtype=torch.int64, device=sel.device)
    valid = pos[None, :] < length[:, None]
    tok = torch.where(valid, start[:, None] + pos[None, :], torch.zeros((), dtype=torch.int64, device=sel.device))
    return tok, valid


def _run_states(h0: torch.Tensor, tab: SegmentTables) -> torch.Tensor:
    """[M, HV, K, V]: the state each slot's run starts from, h0[h0_index] on first segments and zero
    elsewhere. On sm_90 with fp32 states one launch (`kernels/sm90/cp_relayout.slot_initial_states`),
    else the torch expression (its reference)."""
    from flashqla.cp.merge import cp_kernels_enabled
    from flashqla.ops.gdn.kernels.sm90._common import on_sm90

    if cp_kernels_enabled() and h0.dtype == torch.float32 and on_sm90(h0):
        from flashqla.ops.gdn.kernels.sm90.cp_relayout import slot_initial_states

        return slot_initial_states(h0, tab.h0_index)
    return torch.where(tab.first[:, None, None, None], h0.index_select(0, tab.h0_index.clamp(min=0)), h0.new_zeros(()))


def _token_kernels_apply(rows: torch.Tensor, U: torch.Tensor) -> bool:
    """The one-launch correction / segment-gradient kernels (`kernels/sm90/cp_correct.py`) apply: U in
    bf16 or fp16 (`rows`, the forward's o or the backward's do, is cast to U's dtype), rows of width
    K = V = 128, an sm_90 device, the kernels not turned off (`flashqla.cp.merge.cp_kernels_enabled`)."""
    from flashqla.cp.merge import cp_kernels_enabled
    from flashqla.ops.gdn.kernels.sm90._common import on_sm90

    return (cp_kernels_enabled() and U.dtype in (torch.bfloat16, torch.float16) and rows.dtype.is_floating_point
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


#: Values of $FLASHQLA_CP_EXACT (case-insensitive, surrounding blanks ignored): exact, or the default cut.
_EXACT_ON = ("1", "true", "yes", "on")
_EXACT_OFF = ("", "0", "false", "no", "off")


def resolve_truncate(truncate) -> float | None:
    """The natural-log decay cutoff of a call's transitions: None (exact: whole segments) or a
    negative finite float. truncate: None ($FLASHQLA_CP_EXACT: "1", "true", "yes" or "on" means
    exact; unset, "", "0", "false", "no" or "off" the default cut TRUNCATE_LOG_DECAY), False (exact),
    True (TRUNCATE_LOG_DECAY) or a negative finite real number (that cutoff, e.g. FlashQLA's -10).
    Raises ValueError naming truncate (or FLASHQLA_CP_EXACT) for anything else."""
    import numbers

    if truncate is None:
        env = os.environ.get(EXACT_ENV, "").strip().lower()
        if env not in _EXACT_ON + _EXACT_OFF:
            raise ValueError(f"${EXACT_ENV} must be one of {_EXACT_ON} (exact transitions) or {_EXACT_OFF} (the "
                             f"gate-driven cut), got {os.environ.get(EXACT_ENV)!r}")
        truncate = env in _EXACT_OFF
    if truncate is True:
        return TRUNCATE_LOG_DECAY
    if truncate is False:
        return None
    if isinstance(truncate, numbers.Real) and not isinstance(truncate, bool):
        try:
            value = float(truncate)
        except (OverflowError, TypeError, ValueError):
            value = float("nan")
        if math.isfinite(value) and value < 0:
            return value
    raise ValueError(f"truncate must be None, a bool or a negative finite log-decay, got {truncate!r}")


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
    if _limits_kernel_applies(g_cum_log2):  # one launch (`kernels/sm90/cp_limits.py`)
        from flashqla.ops.gdn.kernels.sm90.cp_limits import cp_transition_limits

        return cp_transition_limits(g_cum_log2, tables.cu_seqlens, tables.need_correction,
                                    None if cutoff is None else float(cutoff) / _LN2)
    return _transition_limits_torch(g_cum_log2, tables, cutoff)


def _limits_kernel_applies(g_cum_log2: torch.Tensor) -> bool:
    from flashqla.cp.merge import cp_kernels_enabled
    from flashqla.ops.gdn.kernels.sm90._common import on_sm90

    return cp_kernels_enabled() and g_cum_log2.dtype == torch.float32 and on_sm90(g_cum_log2)


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
                        truncated: bool):
    """Exact mode's steps 1 and 2 with each slot's transition walking `limit` chunks: (o, Q, U, P).

    On the sm_90 kernels one launch (`Sm90Backend.recurrent_dual`); elsewhere the run and a full
    transition launch, then U's rows past the limits and P where a limit cut the walk short set to 0
    (what the dual launch computes; U rows it does not write are never read by the correction
    kernels). Where U goes to a torch consumer instead and a limit may cut, its unwritten rows are set
    to 0 here (without a cut the dual launch writes every row of every corrected slot, the only rows
    the torch consumers read)."""
    total = qf.shape[1]
    HV, K = G2.shape[0], kf.shape[3]
    dual = getattr(backend, "recurrent_dual", None)
    out = None if dual is None else dual(qf, kf, vf, A, G2, scale, h0_run, limit, pcu, block_v, o_buf)
    if out is not None:
        o, Q, U, P = out
        if truncated and not _token_kernels_apply(o, U):
            U = torch.where(_keep_rows(tab, limit, total)[None, :, :, None], U, U.new_zeros(()))
        return o, Q, U, P
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


#: Index tensors of a segmentation that depends on shapes alone (fixed-length input), kept per key.
_LAYOUTS: dict = {}
_LAYOUT_CACHE = 32


def _memo(key, fn):
    """fn() once per key (None: no caching). Only shape-determined products are keyed."""
    if key is None:
        return fn()
    hit = _LAYOUTS.pop(key, None)
    if hit is None:
        hit = fn()
    _LAYOUTS[key] = hit
    while len(_LAYOUTS) > _LAYOUT_CACHE:
        _LAYOUTS.pop(next(iter(_LAYOUTS)))
    return hit


def _gated_layout(tab: SegmentTables, Mc: int, m: int, S_slots: int):
    """Indices of the gate-driven mode's compact layout (Mc sequences of m chunks, one per non-first
    segment in slot order; compact slot of chunk c of sequence i: i (m + 1) + c)."""
    M = tab.M
    dev = tab.valid.device
    W = m * CHUNK
    sel = _corrected_slots(tab, Mc)
    tok, valid = _token_rows(tab, sel, W)
    prev = _ext(tab.prev, -1)[sel].clamp(0, max(M - 1, 0))  # "none" rows: any slot (they add nothing)
    nchunks = -(-(tab.end - tab.start) // CHUNK)  # [M]
    base = torch.div(tab.start, CHUNK, rounding_mode="floor") + torch.arange(M, device=dev)
    cpos = torch.arange(m, dtype=torch.int64, device=dev)
    src = (_ext(base, 0)[sel][:, None] + cpos[None, :]).clamp(0, max(S_slots - 1, 0))  # [Mc, m] pseudo slots
    cvalid = cpos[None, :] < _ext(nchunks, 0)[sel][:, None]
    last = tab.seq_last.clamp(min=0)
    rank = torch.cumsum(tab.need_correction.to(torch.int64), 0) - 1
    covered = (tab.seq_num >= 2) & (nchunks[last] <= m)
    return dict(sel=sel, tok=tok, valid=valid, prev=prev, nchunks=nchunks, base=base, cpos=cpos, src=src.reshape(-1),
                cvalid=cvalid.reshape(-1), last=last, last_prev=(last - 1).clamp(min=0),
                ri=rank[last].clamp(0, max(Mc - 1, 0)), covered=covered, nonempty=tab.seq_num >= 1)


def cp_forward(backend, q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens,
               tables: SegmentTables, *, block_v: int, gate_chunks: int | None = None, correction: str = "gemm",
               poison_outputs: bool = False, want_info: bool = True, static_key=None, truncate=False,
               keep_for_backward: bool = False):
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
    Returns:
        (o [B, T, HV, V] in v's dtype, final_state [N, HV, K, V] in backend.state_dtype or None,
        A, g_cum_log2 (slot layout of tables.cu_seqlens), CPInfo with plan=None, or None).
    Raises:
        ValueError: unknown correction, gate_chunks < 1.
    """
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
    qf, kf, vf, gf, bf = (_flat(x) for x in (q, k, v, g, beta))
    A, G2 = backend.prepare(kf, gf, bf, pcu, HV)
    key = lambda *parts: None if static_key is None else (static_key, *parts)  # noqa: E731
    mask = lambda b: b[:, None, None, None]  # noqa: E731
    one_sequence = N == 1 and B == 1 and _ONE_SEQUENCE_FAST_PATH
    Mc = total // L  # bound on non-first segments

    # 1. run: first segments from h0, the others from zero
    h0_run = None
    h0 = None if initial_state is None else initial_state.to(sd)
    if h0 is not None and N > 0:
        h0_run = _run_states(h0, tab)
    o_buf = torch.full_like(vf, float("nan")) if poison_outputs else None

    info = None
    if gate_chunks is None:
        # 1. run and 2. transition (U, P; one launch on sm_90), each transition cut where its gates
        # have decayed past the cutoff, then 3. scan
        cutoff = resolve_truncate(truncate)
        limit = transition_limits(G2, tab, cutoff)
        o, Q, U, P = _run_and_transition(backend, qf, kf, vf, A, G2, scale, h0_run, limit, tab, pcu, block_v, o_buf,
                                         cutoff is not None)
        # (the scan skips the products the cut dropped; exact transitions have none to skip)
        S_in, final = scan_segment_states(P, Q, tab, T, h0, first_from_h0=True, limit=_cut(limit, cutoff))
        # 4. correction
        if correction == "rerun":
            o, _ = _recurrent(backend, qf, kf, vf, A, G2, scale, S_in.contiguous(), False, pcu, block_v, None)
        elif _token_kernels_apply(o, U):  # one launch over every corrected slot, the walked chunks only
            from flashqla.ops.gdn.kernels.sm90.cp_correct import cp_correct

            cp_correct(o, U, S_in, pcu, limit=limit, max_rows=L)
        elif one_sequence:  # reads slots 1 .. nseg - 1 only
            _correct_one_sequence(o, U, S_in.to(o.dtype), total, L)
        else:
            sel, tok, valid = _memo(key("rows", L), lambda: (lambda s: (s, *_token_rows(tab, s, L)))(_corrected_slots(tab, Mc)))
            Ug = U.view(total, HV, K).index_select(0, tok.reshape(-1)).view(Mc, L, HV, K)
            Sx = torch.where(mask(tab.need_correction), S_in, S_in.new_zeros(())).to(o.dtype)
            _correct_gathered(o, Ug, _ext(Sx, 0)[sel], tok, valid)
        if want_info or keep_for_backward:  # (the masked copy only when the info is wanted)
            S_c = torch.where(mask(tab.need_correction), S_in, S_in.new_zeros(())) if want_info else None
            saved = (CPSaved(L, cutoff, total, N, h0 is not None, _cu_key(cu_seqlens), S_in, P, U, limit, A, G2)
                     if keep_for_backward else None)
            info = CPInfo(None, tab, "exact", S_c, P, Q, None, None, None, limit, saved)
    else:
        o, Q = _recurrent(backend, qf, kf, vf, A, G2, scale, h0_run, True, pcu, block_v, o_buf)
        m = min(int(gate_chunks), L // CHUNK)  # a segment has at most L / 64 chunks
        W = m * CHUNK
        S_slots = A.shape[1] // CHUNK
        lay = _memo(key("gated", m, S_slots), lambda: _gated_layout(tab, Mc, m, S_slots))
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
            cu_c = _memo(("cu_c", Mc, W, pcu.dtype, str(dev)), lambda: torch.arange(Mc + 1, dtype=pcu.dtype, device=dev) * W)
            h0_c = _memo(("eye", Mc, HV, K, sd, str(dev)), lambda: torch.eye(K, dtype=sd, device=dev).expand(Mc, HV, K, K).contiguous())
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
    prev_seg = _ext(seg, 0.0)[torch.where(tab.prev >= 0, tab.prev, torch.full_like(tab.prev, M))]
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
        from flashqla.ops.gdn.kernels.sm90.cp_relayout import relayout_slots

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
    pbase = torch.div(_ext(tables.start, 0), CHUNK, rounding_mode="floor") + torch.arange(tables.M + 1, **i64)
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
        from flashqla.ops.gdn.kernels.sm90.cp_relayout import relayout_slots

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
        from flashqla.ops.gdn.kernels.sm90.cp_correct import cp_state_grads

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
    sel, tok, valid = _memo(rows_key, lambda: (lambda s: (s, *_token_rows(tab, s, L)))(_corrected_slots(tab, Mc, mask)))
    t = tok.reshape(-1)
    Ug = torch.where(valid.reshape(-1)[:, None, None], Uf.index_select(0, t), Uf.new_zeros(())).view(Mc, L, HV, K)
    Dg = Df.index_select(0, t).view(Mc, L, HV, V)
    Es = torch.matmul(Ug.permute(0, 2, 3, 1), Dg.permute(0, 2, 1, 3).to(Ug.dtype)).to(edt)  # [Mc, HV, K, V]
    return E.index_copy(0, sel, Es)[:M]


#: Environment variable: "0" makes the split backward compute the segments' terminal gradients (E and
#: the reverse scan) on the caller's stream before the states pass, instead of on a side stream beside
#: it (the default, "1"; the same results). Read per call.
OVERLAP_ENV = "FLASHQLA_CP_BWD_OVERLAP"
_side_streams = threading.local()


def _cut(limit, cutoff):
    """The limits the combine scans take (`scan_segment_states(limit=...)`): the transitions' walked
    chunks under the gate-driven cut, None for exact transitions (nothing dropped to skip)."""
    return None if cutoff is None else limit


def _overlap_applies(backend, x: torch.Tensor) -> bool:
    """Whether `cp_backward` runs steps 2-3 beside the states pass: on CUDA tensors, with a backend whose
    `bwd` takes dht as a callable (`Sm90Backend`), unless $FLASHQLA_CP_BWD_OVERLAP is "0". ValueError
    naming the variable for a value other than "0" / "1"."""
    want = os.environ.get(OVERLAP_ENV, "1")
    if want not in ("0", "1"):
        raise ValueError(f"${OVERLAP_ENV} must be '0' or '1', got {want!r}")
    return want == "1" and x.is_cuda and isinstance(backend, Sm90Backend)


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

    With `saved` (a split forward's `CPSaved` over the same segments and cut, `_saved_applies`) step 1
    is skipped: its entering states, transitions, U rows and limits are what it would recompute.
    On the sm_90 backend steps 2 and 3 run on a side stream while step 4's states pass (which reads
    neither) runs, and its chunk backward waits for them (`_on_side_stream`; FLASHQLA_CP_BWD_OVERLAP=0:
    in order); under the cut, step 3 skips the products of the transitions it dropped (`cp_scan`).

    Args: as `chunk_gated_delta_rule_bwd`, with A, g_cum_log2 in the slot layout of
    tables.cu_seqlens, and tables, block_v, static_key, truncate as `cp_forward`; saved: None or a
    `CPSaved` (ignored when it does not match); longest_first: the segments' backward launches them
    longest first (`CPPlan.longest_first`; the same results); need_dh0: False when the caller will not
    use dh0 (then None; the backend is told, `CPBackend.bwd`'s dh0).
    Returns (dq, dk, dv, dg, dbeta, dh0 [N, HV, K, V] or None when initial_state is None or need_dh0 is False).
    """
    B, T = q.shape[0], q.shape[1]
    total = B * T
    tab = tables
    M, N, L = tab.M, tab.N, tab.segment_len
    sd = backend.state_dtype
    pcu = tab.cu_seqlens
    qf, kf, vf, gf, bf, dof = (_flat(x) for x in (q, k, v, g, beta, do))
    key = lambda *parts: None if static_key is None else (static_key, *parts)  # noqa: E731
    one_sequence = N == 1 and B == 1 and _ONE_SEQUENCE_FAST_PATH
    h0 = None if initial_state is None else initial_state.to(sd)
    cutoff = resolve_truncate(truncate)
    if _saved_applies(saved, tab, total, v.shape[2], cutoff, h0 is not None, cu_seqlens):
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
        from flashqla.ops.gdn.kernels.sm90.cp_correct import cp_correct

        cp_correct(o, U, S_start, tab.cu_seqlens, corr, max_rows=tab.segment_len)
    elif N == 1 and _ONE_SEQUENCE_FAST_PATH:
        _correct_one_sequence(o, U, S_start.to(o.dtype), T, L, first=0 if open_first else 1)
    else:
        Mc = T // L + (1 if open_first else 0)
        sel = _corrected_slots(tab, Mc, corr)
        tok, valid = _token_rows(tab, sel, L)
        K = k.shape[3]
        Ug = U.view(T, HV, K).index_select(0, tok.reshape(-1)).view(Mc, L, HV, K)
        Sx = torch.where(mask4(corr), S_start, S_start.new_zeros(())).to(o.dtype)
        _correct_gathered(o, Ug, _ext(Sx, 0)[sel], tok, valid)
    saved = OpenForward(A, G2, S_start.to(sd), A_open, None if P_open is None else P_open.to(sd), bool(open_first))
    return o, final.to(sd), saved


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
    one_sequence = N == 1 and _ONE_SEQUENCE_FAST_PATH
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


# ------------------------------------------------------------------------------------------------
# entry points
# ------------------------------------------------------------------------------------------------


def _segment_order(pcu, N: int, longest_first: bool):
    """The launch order of the segments' backward (`_common.launch_order` on the segments' offsets):
    longest first where the plan says so (`CPPlan.longest_first`, packed batches), else None (token
    order; one sequence's segments are equal but the last)."""
    if N <= 1 or not pcu.is_cuda:
        return None
    from flashqla.ops.gdn.kernels.sm90._common import launch_order

    return launch_order(pcu, longest_first)


def _mode(cp) -> str:
    return cp_mode(cp, default="auto")


def _plan(q, v, cu_seqlens, cp, segment_len, gate_chunks, max_seqlen, sm_count, build_tables, backward=False,
          seqlens=None):
    mode = _mode(cp)
    return get_cp_plan(q, v, cu_seqlens, sm_count_override=sm_count, force=mode == "on", disable=mode == "off",
                       exact=gate_chunks is None, segment_len=segment_len, max_seqlen=max_seqlen,
                       gate_chunks=gate_chunks, build_tables=build_tables, backward=backward, seqlens=seqlens)


def cp_splits(q, v, cu_seqlens=None, cp=None, *, segment_len=None, gate_chunks=None, max_seqlen=None,
              sm_count=None, backward=False, seqlens=None) -> bool:
    """Whether `chunk_gated_delta_rule_cp_fwd` (backward=True: `chunk_gated_delta_rule_cp_bwd`, whose
    plan is costed for the backward's launches) would split these inputs (a cached plan lookup on
    static facts: shapes, dtypes, device, SM count, options; no host read of any tensor value).

    q: [B, T, H, K]; v: [B, T, HV, V]; cu_seqlens: None or [N + 1]; cp: None ($FLASHQLA_CP, default
    "auto"), "auto", "on" or "off"; the other options as in `chunk_gated_delta_rule_cp_fwd`.
    Returns False for inputs whose shapes the planner cannot read (the op's checks then report them).
    Raises ValueError for an unknown cp mode, or seqlens that are not the batch's N lengths summing to
    its tokens (`planner.check_seqlens`)."""
    mode = _mode(cp)
    if mode == "off":
        return False
    if seqlens is not None and getattr(q, "dim", lambda: 0)() == 4:
        from flashqla.cp.planner import check_seqlens

        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        seqlens = check_seqlens(seqlens, N, q.shape[0] * q.shape[1])
    try:
        plan, _ = _plan(q, v, cu_seqlens, mode, segment_len, gate_chunks, max_seqlen, sm_count, False, backward=backward,
                        seqlens=seqlens)
    except (AttributeError, TypeError, ValueError, IndexError):
        return False
    return plan.split


def chunk_gated_delta_rule_cp_fwd(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel=False,
    *,
    cp=None,
    segment_len: int | None = None,
    gate_chunks: int | None = None,
    max_seqlen: int | None = None,
    seqlens: tuple[int, ...] | None = None,
    correction: str = "gemm",
    relayout: bool = True,
    block_v: int | None = None,
    poison_outputs: bool = False,
    sm_count: int | None = None,
    backend=None,
    return_info: bool = False,
    truncate=None,
    keep_for_backward: bool = False,
):
    """`flashqla.ops.gdn.api.chunk_gated_delta_rule_fwd` with intra-device context parallelism.

    Computes the same o and final state (FLA's semantics; see `flashqla.chunk_gated_delta_rule`) and
    returns the same `ChunkGDNForward`. When the plan splits (`flashqla.cp.planner.plan_cp`: few value
    heads x sequences, long sequences), sequences are cut into segments run side by side and stitched
    exactly (module docstring; derivations CP-1..CP-3), else the two unsplit launches run.

    Args:
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
        use_qk_l2norm_in_kernel: as `chunk_gated_delta_rule` (q, k [B, T, H, K] bf16/fp16; v
            [B, T, HV, V]; g [B, T, HV] fp32 natural log; beta [B, T, HV]; initial_state
            [N, HV, K, V] fp32; cu_seqlens [N + 1] int32/int64 with B == 1).
        cp: None (environment variable FLASHQLA_CP, default "auto"), "auto" (the planner decides),
            "on" (always split) or "off" (never).
        segment_len: fix the segment length L (a positive multiple of 64) when splitting.
        gate_chunks: None (exact) or m >= 1: gate-driven mode (module docstring; opt-in, not exact
            on heads whose gates do not decay below GATE_THRESHOLD within m chunks).
        max_seqlen: optional host-side bound on the longest sequence (planning hint).
        seqlens: optional host-side lengths of the sequences (a tuple; `flashqla.validation.planning_seqlens`):
            the backward's plan (keep_for_backward) is costed on them (`planner.plan_cp`).
        correction: "gemm" (default) or "rerun" (exact mode's output correction).
        relayout: return A and g_cum_log2 in the slot layout of the caller's cu_seqlens (what a
            backward needs; one gather); False keeps the segments' layout (A, g_cum_log2 then match
            `info.tables.cu_seqlens`, not cu_seqlens). Not used when the forward keeps its states
            (keep_for_backward and the backward's plan splits): A and g_cum_log2 are then None.
        block_v: value-slice width of the recurrent launches (64 or 128; None: the plan's).
        poison_outputs: fill o (and the unsplit path's outputs) with NaN before the launches.
        sm_count: SMs assumed by the planner (None: the device's).
        backend: None (the sm_90 kernels; inputs checked for the fast path and a Hopper GPU) or a
            `CPBackend` (e.g. `reference.gdn.cp.ReferenceCPBackend()`: any device and dtype).
        return_info: also return a `CPInfo` (None when not split).
        truncate: the gate-driven cut of each (segment, value head) transition (`resolve_truncate`):
            None ($FLASHQLA_CP_EXACT=1: none; else at TRUNCATE_LOG_DECAY = ln 2^-24), False (whole
            segments: exact), True, or a negative natural-log decay (e.g. -10, FlashQLA's). Heads
            whose gates do not decay past the cutoff within a segment walk it whole.
        keep_for_backward: training: when the backward's plan (`plan_cp(backward=True)`, the one
            `chunk_gated_delta_rule_cp_bwd` makes for these inputs) splits, split the forward the
            same way (exact mode) and return its `CPSaved` as `ChunkGDNForward.cp_saved`, so that the
            backward skips recomputing the run, the transitions and the combine scan; A and
            g_cum_log2 then travel in it, in the segments' slot layout (`CPSaved.A`, `.g_cum_log2`),
            and the returned A, g_cum_log2 are None (no move to the caller's layout and back).
            Otherwise as without it (cp_saved None). Ignored with gate_chunks or segment_len.

    Returns:
        `ChunkGDNForward(o, final_state, A, g_cum_log2, q, k, cp_saved)` (o [B, T, HV, V] in q's dtype;
        final_state [N, HV, K, V] fp32 or None; A [HV, S * 64, 64] in q's dtype and g_cum_log2
        [HV, S * 64] fp32 as `relayout` says, or both None when cp_saved is set; cp_saved a
        `CPSaved` or None), and the `CPInfo` when return_info.

    Raises:
        TypeError, ValueError, RuntimeError: as `chunk_gated_delta_rule_fwd` (argument checks, the
            fast path's dtypes and head dims, a non-Hopper device); ValueError for an unknown cp
            mode or correction, a bad segment_len or gate_chunks.
    """
    from flashqla.ops.gdn.api import ChunkGDNForward
    from flashqla.validation import check_gdn_inputs

    d = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens)
    if correction not in CORRECTIONS:
        raise ValueError(f"correction must be one of {CORRECTIONS}, got {correction!r}")
    if gate_chunks is not None and (not isinstance(gate_chunks, int) or gate_chunks < 1):
        raise ValueError(f"gate_chunks must be None or a positive int (chunks of 64 tokens), got {gate_chunks!r}")
    cutoff = resolve_truncate(truncate)  # checked on every path, split or not
    if not isinstance(use_qk_l2norm_in_kernel, bool):
        raise TypeError(f"use_qk_l2norm_in_kernel must be a bool, got {type(use_qk_l2norm_in_kernel).__name__}")
    if backend is None:
        from flashqla.ops.gdn.api import _check_device, _check_supported

        _check_supported(q, k, v, g, beta, initial_state)
        _check_device(q)
        backend = _default_backend()
    scale = d.K**-0.5 if scale is None else float(scale)
    q, k, v, g, beta = (x.contiguous() for x in (q, k, v, g, beta))
    if initial_state is not None:
        initial_state = initial_state.contiguous()
    if cu_seqlens is not None:
        cu_seqlens = cu_seqlens.contiguous()
    if use_qk_l2norm_in_kernel:
        from flashqla.ops.gdn.api import _l2norm

        q, k = _l2norm(q), _l2norm(k)

    ms = None if max_seqlen is None else int(max_seqlen)
    keep = keep_for_backward and gate_chunks is None and segment_len is None
    plan = None
    if keep:  # the backward's segmentation, so that its CPSaved applies
        plan, _ = _plan(q, v, cu_seqlens, cp, None, None, ms, sm_count, False, backward=True, seqlens=seqlens)
        keep = plan.split
    if not keep:
        plan, _ = _plan(q, v, cu_seqlens, cp, segment_len, gate_chunks, ms, sm_count, False)
    if not plan.split:
        out = _unsplit(backend, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, block_v,
                       poison_outputs, d)
        return (out, None) if return_info else out

    BV = block_v or plan.BV
    tables, static_key = _split_tables(cu_seqlens, plan.segment_len, d.B, d.T, q.device)
    pcu = tables.cu_seqlens
    if hasattr(backend, "warm"):
        backend.warm(_flat(k), _flat(beta), _flat(q), _flat(v), pcu, d.HV, BV,
                     dual=gate_chunks is None and correction != "rerun" and _dual_applies(q, v))
    o, final, A, G2, info = cp_forward(backend, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                       tables, block_v=BV, gate_chunks=gate_chunks, correction=correction,
                                       poison_outputs=poison_outputs, want_info=return_info, static_key=static_key,
                                       truncate=False if cutoff is None else cutoff, keep_for_backward=keep)
    if keep:  # the products travel in the CPSaved, in the segments' layout (what the backward reads)
        A, G2 = None, None
    elif relayout:
        A, G2 = segment_slots_to_sequence_slots(A, G2, tables, cu_seqlens, d.B, d.T)
    out = ChunkGDNForward(o=o, final_state=final, A=A, g_cum_log2=G2, q=q, k=k,
                          cp_saved=info.saved if keep and info is not None else None)
    return (out, info._replace(plan=plan)) if return_info else out


def _split_tables(cu_seqlens, L: int, B: int, T: int, device):
    """(SegmentTables, static_key) of the split path for segment length L: for fixed-length input the
    tables depend on shapes alone and are built once per static_key (int32 offsets: the kernels
    packed int32 input uses); packed offsets are read on every call (one launch on sm_90, torch ops
    elsewhere), so a reused, edited cu_seqlens is never stale (static_key None)."""
    if cu_seqlens is None:
        static_key = ("rows", B, T, L, str(device))
        return _memo(static_key + ("tables",), lambda: _int32_tables(build_segment_tables(None, L, T=T, B=B, device=device), B * T)), static_key
    return segment_tables_device(cu_seqlens, L, T=T), None


def _check_products(A, g_cum_log2, cp_saved, q=None, v=None, cu_seqlens=None) -> None:
    """A and g_cum_log2 both given, or both None with a cp_saved that carries them; ValueError naming
    the argument otherwise. TypeError naming cp_saved when it is neither None nor a `CPSaved`. With q
    and v, given A [HV, S * 64, 64] and g_cum_log2 [HV, S * 64] must have the caller's S =
    `num_slots` of these inputs (a kept forward's `CPSaved.A`, in its segments' layout, has more
    slots): ValueError naming the argument otherwise."""
    if cp_saved is not None and not isinstance(cp_saved, CPSaved):
        raise TypeError(f"cp_saved must be None or the forward's ChunkGDNForward.cp_saved (a CPSaved), "
                        f"got {type(cp_saved).__name__}")
    if (A is None) != (g_cum_log2 is None):
        missing, given = ("A", "g_cum_log2") if A is None else ("g_cum_log2", "A")
        raise ValueError(f"{missing} is None but {given} is not: pass the forward's A and g_cum_log2 together, "
                         "or both None with its cp_saved")
    if A is None and cp_saved is None:
        raise ValueError("A is None and cp_saved is None: pass the forward's A and g_cum_log2 "
                         "(ChunkGDNForward.A, .g_cum_log2), or its cp_saved when they are None")
    if A is not None and q is not None and v is not None:
        from flashqla.ops.gdn.kernels.sm90._common import CHUNK, num_slots

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
    tables, _ = _split_tables(cu_seqlens, saved.segment_len, B, T, saved.A.device)
    return segment_slots_to_sequence_slots(saved.A, saved.g_cum_log2, tables, cu_seqlens, B, T)


def _int32_tables(tables: SegmentTables, total: int) -> SegmentTables:
    from dataclasses import replace

    return replace(tables, cu_seqlens=tables.cu_seqlens.to(torch.int32)) if total < 2**31 else tables


_BACKEND = None


def _default_backend():
    global _BACKEND
    if _BACKEND is None:
        _BACKEND = Sm90Backend()
    return _BACKEND


def _unsplit(backend, q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, block_v, poison, d):
    """The two launches of the unsplit forward through the backend (the op's own path, without the
    op's CP decision, so that cp="off" is honoured whatever the op's default)."""
    from flashqla.ops.gdn.api import ChunkGDNForward

    if hasattr(backend, "warm") and d.T > 0 and d.N > 0:
        from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v

        block_v = block_v or pick_block_v(d.N, d.HV, d.V)
        backend.warm(k, beta, q, v, cu_seqlens, d.HV, block_v)
    A, G2 = backend.prepare(k, g, beta, cu_seqlens, d.HV)
    h0 = None if initial_state is None else initial_state.to(backend.state_dtype)
    o_buf = torch.full_like(v, float("nan")) if poison else None
    o, final = _recurrent(backend, q, k, v, A, G2, scale, h0, output_final_state, cu_seqlens, block_v, o_buf)
    return ChunkGDNForward(o=o, final_state=final, A=A, g_cum_log2=G2, q=q, k=k)


def chunk_gated_delta_rule_cp_bwd(
    q, k, v, g, beta, A, g_cum_log2, do, dht=None, scale=None, initial_state=None, cu_seqlens=None,
    *, cp=None, segment_len: int | None = None, max_seqlen: int | None = None, seqlens=None, block_v: int | None = None,
    sm_count: int | None = None, backend=None, truncate=None, cp_saved: CPSaved | None = None, need_dh0: bool = True,
):
    """`flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd` with intra-device context parallelism.

    Same arguments and returns (A, g_cum_log2 as the forward returned them, in the slot layout of
    the caller's cu_seqlens, or both None with the cp_saved of a forward that kept its states; q, k
    after any L2 norm). When the plan splits (the forward's planner, exact
    mode, costed for the backward's launches: `plan_cp(backward=True)`), the backward runs over segments (`cp_backward`: the entering states are recomputed by the
    forward's run and transition launches and the combine scan, the state gradient crosses segments
    by the reverse scan with P^T, and one unsplit backward runs all segments side by side); else it
    is the unsplit backward.

    Args: q, k [B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; A [HV, S * 64, 64] and g_cum_log2
        [HV, S * 64] in the caller's slot layout, or both None when cp_saved is given; do
        [B, T, HV, V]; dht None or [N, HV, K, V]; scale; initial_state None or [N, HV, K, V];
        cu_seqlens None or [N + 1]; cp, segment_len, max_seqlen, seqlens, block_v, sm_count,
        backend, truncate as `chunk_gated_delta_rule_cp_fwd`; cp_saved: the forward's
        `ChunkGDNForward.cp_saved` (`keep_for_backward`), used when it matches this plan's segments
        (`_saved_applies`). With A None its A and g_cum_log2 are used: as they are when it matches,
        else moved to the caller's layout first (`saved_products_in_sequence_slots`); need_dh0: as
        `chunk_gated_delta_rule_bwd` (False: dh0 None, the backend told it is not used).
    Returns (dq, dk, dv, dg, dbeta, dh0 or None), the unsplit backward's dtypes.
    Raises TypeError for a need_dh0 that is not a bool; ValueError for an unknown cp mode or a bad segment_len, for exactly one of A, g_cum_log2
    None (naming it), for A None without cp_saved (naming A), for A or g_cum_log2 not of these
    inputs' slot count (naming it), and for A None with a cp_saved of a forward of other sizes;
    TypeError for a cp_saved that is neither None nor a `CPSaved`.
    """
    cutoff = resolve_truncate(truncate)  # checked on every path, split or not
    if not isinstance(need_dh0, bool):
        raise TypeError(f"need_dh0 must be a bool, got {type(need_dh0).__name__}")
    _check_products(A, g_cum_log2, cp_saved, q, v, cu_seqlens)
    if backend is None:
        backend = _default_backend()
    scale = q.shape[-1] ** -0.5 if scale is None else float(scale)
    plan, _ = _plan(q, v, cu_seqlens, cp, segment_len, None, max_seqlen, sm_count, False, backward=True,
                    seqlens=seqlens)
    B, T, HV = q.shape[0], q.shape[1], v.shape[2]
    if not plan.split:
        if A is None:
            A, g_cum_log2 = saved_products_in_sequence_slots(cp_saved, cu_seqlens, B, T, HV)
        *grads, dh0 = backend.bwd(q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens,
                                  dh0=initial_state is not None and need_dh0)
        return (*grads, dh0 if need_dh0 else None)
    q, k, v, g, beta, do = (x.contiguous() for x in (q, k, v, g, beta, do))
    tables, static_key = _split_tables(cu_seqlens, plan.segment_len, B, T, q.device)
    if A is None and _saved_applies(cp_saved, tables, B * T, HV, cutoff, initial_state is not None, cu_seqlens):
        A_p, G_p = cp_saved.A, cp_saved.g_cum_log2  # already in these segments' layout
    else:
        if A is None:
            A, g_cum_log2 = saved_products_in_sequence_slots(cp_saved, cu_seqlens, B, T, HV)
        A_p, G_p = sequence_slots_to_segment_slots(A, g_cum_log2, tables, cu_seqlens, B, T)
    BV = block_v or plan.BV
    if hasattr(backend, "warm"):
        backend.warm(_flat(k), _flat(beta), _flat(q), _flat(v), tables.cu_seqlens, v.shape[2], BV, dual=_dual_applies(q, v))
    return cp_backward(backend, q, k, v, g, beta, A_p, G_p, do, dht, scale, initial_state, cu_seqlens, tables,
                       block_v=BV, static_key=static_key, truncate=False if cutoff is None else cutoff,
                       saved=cp_saved, longest_first=plan.longest_first, need_dh0=need_dh0)

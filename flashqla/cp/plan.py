"""Intra-device context-parallel (CP) planner: whether to split, and where.

The sm_90 recurrent kernel runs one CTA per (value slice, value head, sequence) and walks that
sequence's chunks serially. A few long sequences with few
value heads leave most SMs idle: 2/8 heads, 1 x 32768 tokens launches 16 CTAs (BV = 64) on 132 SMs,
each 512 chunks long. CP cuts every long sequence into segments, runs the segments as independent
sequences, and stitches the states back (derivations CP-1 .. CP-5, `reference/gdn/cp.py`).

This module decides (a pure function of static facts, cached); `flashqla.cp.segments` builds the
tables a segmented launch needs and `flashqla.cp.forward` / `flashqla.cp.backward` run the kernels
over them.

Rule (`plan_cp`)
----------------
Inputs are static facts only: HV, V, N (number of sequences), T (total tokens), the SM count, and
optionally `max_seqlen`, a host-side hint a caller may already know (a serving scheduler does).
Sequence lengths are never read from `cu_seqlens` (that would be a device-to-host sync), so without
the hint the model assumes balanced sequences of ceil(T / N) tokens, the case least favourable to
splitting (an unbalanced mix only gains more from a split; `force` covers a caller who knows).

Cost model, in units of one chunk step of the recurrent kernel at BV = 128, for the launches
`flashqla.cp.forward` makes (the constants are fitted to the timings in
`benchmarks/journal/context-parallel.md`; each constant's comment says to which):

    t(BV)        per-CTA cost of one chunk: t(128) = 1.1, t(64) = 0.9 (CHUNK_COST)
    slots        SMs x CTAs per SM; one CTA per SM at both widths (the role-split recurrent kernel,
                 unsplit and in the dual launch: 156,160 B of shared memory at BV = 64, 229,888 B at
                 BV = 128)
    unsplit      u(BV) * max(ceil(l_max / 64), ceil(NV HV N / slots) * ceil(l_avg / 64)), u = the
                 unsplit launch's costs (UNSPLIT_CHUNK_COST: u(64) = 0.5, the role-split kernel), at
                 the width the unsplit launch runs at (`recurrent.pick_block_v`; the backward: the
                 cheaper width)
    run(L)       t(BV) * ceil(NV HV m / slots) * ceil(min(L, l_max) / 64), m = number of segments
    exact        dual(L) (DUAL_LAUNCH; else PASSES_EXACT * run(L), two launches)
                 + SCAN_STEP_COST * (ceil(l_max / L) - 1)        sequential combine products
                 + CORRECTION_COST * HV * (tokens past first segments) * walked fraction
                 + LAUNCH_COST * EXTRA_LAUNCHES + HEAD_OVERHEAD * HV   small launches, per-head work
    dual(L)      t(BV) * max(ceil(long / slots) * c, (long * c + short * min(CUT_CHUNKS, c)) / slots),
                 c = ceil(min(L, l_max) / 64), long = NV (HV m + F m'), short = NV (HV - F) m',
                 F = min(FULL_TRANSITION_HEADS, HV), m' non-first segments: the runs and the
                 transitions of undecayed heads walk whole segments, the others are cut short;
                 walked fraction = (F + (HV - F) min(64 CUT_CHUNKS, L) / L) / HV
    gated        PASSES_GATED * run(L) + t(BV) ceil(NV HV m' / slots) * gate_chunks   (m' non-first
                 segments, the compact transition launch) + CORRECTION_COST * HV * m' * 64 gate_chunks
                 + LAUNCH_COST * EXTRA_LAUNCHES_GATED (gate_chunks defaults to DEFAULT_GATE_CHUNKS)

The planner evaluates both BV choices (only those dividing V), no split, and every segment length
L = SEGMENT_QUANTUM * j (512 tokens = 8 chunks, as FlashInfer's exact CP; always a multiple of the
64-token chunk) with L < l_max, and splits when the best split is predicted at least MIN_GAIN = 1.2x
(the backward's plan: BWD_MIN_GAIN = 1.05x) faster than the best unsplit launch (among split
candidates within TIE = 3% of the best, the longest L wins: fewer waves, fewer scan steps, less
overhead the model leaves out). The optimum
lands where the segment CTAs fill one or a few whole waves: shorter segments do not shorten the
critical path below total work / slots and add scan steps; longer ones leave SMs idle.
Examples at 132 SMs (exact mode, the dual launch and the cut): 2/8 1x32768 -> split, L = 2560,
BV = 128; 16/32 1x32768 -> split, L = 8192; 16/64 1x32768 -> split, L = 16896; 32/32 1x4096 ->
split, L = 1024; 16/64 1x4096 -> no split; 16/64 4x8192 (256 CTAs unsplit) -> no split.
`disable=True` never splits; `force=True` always splits (the best split, or `segment_len`);
`segment_len` fixes L (a multiple of 64); `exact=True` costs exact mode, `exact=False` the gate-driven
mode with `gate_chunks` chunks. The constants are module-level and named below.

Backward (`backward=True`) and unknown lengths
------------------------------------------------
The backward's plan (`flashqla.cp.backward.cp_backward`) costs its own launches for
one sequence: the forward's run and transition recomputed, the combine scan and the reverse scan,
the states pass over the segments, and the fused chunk backward at BWD_CHUNK_COST forward chunk
steps per chunk with one CTA per (segment, value head) and BWD_WAVE_COST per wave of them. Its
unsplit cost is the states pass plus BWD_CHUNK_COST times the longest chain (and one wave cost per
wave), so one long sequence splits far sooner than in the forward
(16/32 heads x 32768 tokens: forward unsplit, backward L = 8192). A packed
batch (N > 1) is planned the same way (`PACKED_BWD_OWN_PLAN`) since the segment tables and both
scans became one launch each (the forward and the backward plan independently: the backward
recomputes every product it needs from the forward's A and g_cum_log2).
Given every length (`seqlens`, a packed batch), the backward's plan is costed on them instead: the
CTAs in launch order on the SMs (BWD_LEN_TOKEN_COST's comment). Else, without a max_seqlen hint,
lengths are taken as balanced. (Costing a skewed batch too, one sequence
holding all but N - 1 tokens, was measured on the backward grid: its splits lost as often as they won.)
Segment lengths are searched on every quantum up to DENSE_QUANTA quanta, then on a geometric grid.

Cache
-----
`plan_for` keys the plan on static facts only: shapes, dtypes, device, SM count and the flags
(`PlanKey`). It never looks at, hashes or identifies the cu_seqlens tensor (not its values, not its
data pointer), so a caller that reuses a cu_seqlens buffer and edits it in place cannot get a stale
plan; the tables, which do depend on the values, are rebuilt on every call
(`flashqla.cp.segments`, no sync).

Gate-driven shortcut (opt-in; `flashqla.cp.forward`, gate_chunks = m)
---------------------------------------------------------------------
By CP-4 / CP-5 a state carried across a window whose summed log-decay is G contributes at most
exp(G) ||S||_F to every later state and scale ||q|| exp(G) ||S||_F to every later output. The
gate-driven mode drops the transition (the state entering segment j + 1 is taken as the zero-start
end state of segment j: error <= exp(G_j) ||S_in(j)||) and corrects only the first m chunks of each
segment (error <= exp(G_<m) ||S_in||). It is exact only where those decays are negligible; heads with
g == 0 are not. The existing recurrent kernel walks the same chunks for every value head of a
sequence, so a per-(segment, head) fallback decided on the device would still pay the full-length
transition launch: the mode is therefore a host-side choice (never taken by the rule), and the driver
reports the decays and a per-(slot, head) flag on the device. GATE_THRESHOLD (-10, FlashQLA's) is
the level below which the bound is below bf16 resolution (e^-10 ~ 4.5e-5).
"""

from __future__ import annotations

import collections
import functools
import heapq
from dataclasses import dataclass, replace
from typing import NamedTuple

import torch

from flashqla.contract import CHUNK, as_index, check_seqlens, cp_mode, positive_int
from flashqla.cp.segments import num_segment_slots
from flashqla.ops.gdn.kernels.sm90.recurrent import ROLES_STEP_US, pick_block_v

__all__ = ["CPPlan", "CallPlan", "PlanKey", "clear_plan_cache", "cp_splits", "fit_lengths_costs", "plan_call", "plan_cp",
           "plan_for", "plan_key", "sm_count"]

#: Segment lengths the rule picks are multiples of this many tokens (8 chunks).
SEGMENT_QUANTUM = 512
#: Value-slice widths of the recurrent kernel, preferred first on a tie.
BV_CHOICES = (128, 64)
#: Per-CTA cost of one chunk step of the split path's launches (the dual run + transition launch), in
#: the model's chunk units, by value-slice width. Fitted with UNSPLIT_CHUNK_COST, HEAD_OVERHEAD and
#: SCAN_STEP_COST to forward rows timed under the plans they choose between: BV = 64 in
#: `benchmarks/journal/context-parallel.md`, "The split path's fixed costs, again", BV = 128 with
#: UNSPLIT_CHUNK_COST (its comment).
CHUNK_COST = {128: 1.1, 64: 0.9}
#: The same for the unsplit forward launch (the role-split recurrent kernel,
#: `kernels/sm90/recurrent.py`, at the width `recurrent.pick_block_v` picks); the split path's dual
#: launch is priced at CHUNK_COST. Fitted with CHUNK_COST to the recurrent launch's chunk step at both
#: widths and to the forward-grid rows whose plans the pair changes
#: (`benchmarks/journal/forward.md`, "The grid with the staged o store, the planner refit, cold
#: compile and warmup").
UNSPLIT_CHUNK_COST = {128: 1.0, 64: 0.5}
#: Resident CTAs per SM of the recurrent kernel.
CTAS_PER_SM = {128: 1, 64: 1}
#: Full-length recurrent launches over the segments in exact CP: run and transition (the output
#: correction is a GEMM).
PASSES_EXACT = 2.0
#: Same in gate-driven mode: the run (the transition launch covers gate_chunks chunks only).
PASSES_GATED = 1.0
#: Whether exact CP runs the run and the transition as one launch (`chunk_recurrent_dual`: the CTAs
#: of both share the waves; the default on sm_90).
DUAL_LAUNCH = True
#: The gate-driven cut (`flashqla.cp.forward.transition_limits`, on by default) makes most transitions
#: short, but how short depends on g, which the plan cannot read without a host sync. The plan assumes
#: FULL_TRANSITION_HEADS value heads per segment walk the whole segment (gates that do not decay, as the
#: benchmark's g == 0 head) and the others CUT_CHUNKS chunks: the dual launch then takes max(waves of
#: the long CTAs x chunks, all work / CTA slots). CUT_CHUNKS is set from the chunks the cut walked on
#: the benchmark's gates (`benchmarks/journal/context-parallel.md`, "Run and transitions in one
#: launch"). With every head undecayed a plan made this way is at most ~25% slower than the best exact
#: plan (2/8 x 32768: L = 2560, 2 waves of 40 chunks against 64).
FULL_TRANSITION_HEADS = 1
CUT_CHUNKS = 4
#: Fixed cost of a split forward per value head beyond the launches above (limits, scan, correction,
#: their index work), chunk units. Fitted with CHUNK_COST[64] and SCAN_STEP_COST to short few-head
#: rows timed over segment lengths and widths, and checked on the forward-grid rows whose plans the
#: fit changes, each timed under both plans (`benchmarks/journal/context-parallel.md`, "The split path's
#: fixed costs, again").
HEAD_OVERHEAD = 0.25
#: Cost of one combine-scan step (the one-launch scan kernel, `kernels/sm90/cp_scan.py`), chunk units;
#: fitted with HEAD_OVERHEAD (its comment).
SCAN_STEP_COST = 1.0
#: The same in the backward's costs, and BWD_WAVE_COST: a fixed cost per wave of the backward's
#: (segment, value head) CTAs (their first and last chunk, the states pass's and the segment
#: gradients' per-CTA work). Fitted to rows of the backward grid timed unsplit and at several segment
#: lengths (`benchmarks/journal/context-parallel.md`, "The whole backward beside FlashQLA's kernels; the
#: backward planner refitted"). Packed rows whose best L depends on the lengths below the longest,
#: which these costs do not see, are costed on every length when the caller gives them
#: (BWD_LEN_TOKEN_COST).
BWD_SCAN_STEP_COST = 1.5
BWD_WAVE_COST = 20.0
#: Cost of the output correction per corrected token and value head, chunk units (bf16 o, U, o).
CORRECTION_COST = 8e-5
#: Cost of one extra launch in chunk units, and the extra small launches of a CP forward.
LAUNCH_COST = 1.0
EXTRA_LAUNCHES = 6
EXTRA_LAUNCHES_GATED = 12
#: Chunks the gate-driven mode's transition launch covers when the plan is costed without a value.
DEFAULT_GATE_CHUNKS = 4
#: Backward (`backward=True`): per-CTA cost of one chunk of the fused chunk backward (pass 2), in
#: forward chunk units: pass 2's chunk plus the states pass's and the recomputed run's share that
#: scales with chunks, fitted with BWD_SCAN_STEP_COST and BWD_WAVE_COST (their comment).
BWD_CHUNK_COST = 5.0
#: Whether a packed batch's backward (N > 1) is planned with the backward's own costs (True) or takes
#: the forward's plan (False). Read when a plan is made (plans are cached: `clear_plan_cache` after
#: changing it). The own plan was the faster one on the packed rows of the backward grid
#: (`benchmarks/journal/context-parallel.md`, "The split path in one launch per step").
PACKED_BWD_OWN_PLAN = True
#: Split only when the predicted time improves at least this much.
MIN_GAIN = 1.2
#: The same for the backward's plan (`backward=True`), lower than the forward's: the backward's split
#: costs include the recomputed forward run, transitions and combine scan, which a backward on kept
#: states does not launch (its forward does, under the training step). 1.05, not 1.0: a split
#: predicted within the model's noise of the unsplit launch is not taken. Chosen on the backward
#: grid's training steps (`benchmarks/journal/context-parallel.md`, "The backward planner's own split
#: threshold").
BWD_MIN_GAIN = 1.05
#: The backward's plan when the caller gives every sequence's length (`seqlens`, N > 1; from FLA's
#: `cu_seqlens_cpu`): the time of the training step's CP work (the forward keeping its split states and
#: the backward reusing them) is costed per launch order instead of from the longest and mean lengths,
#: in units of one chunk step of a backward CTA:
#:
#:     t(L) = makespan(L) + BWD_LEN_TOKEN_COST * HV * T + BWD_LEN_WAVE_COST * HV * m / SMs
#:            + [split] (BWD_LEN_SPLIT_COST + BWD_LEN_SCAN_STEP_COST * (most segments of a sequence - 1))
#:
#: makespan(L): the CTAs (one per segment, or sequence when unsplit, and value head: m segments) in
#: launch order (segment-major, value heads fastest), each sent to the first SM that is free, each
#: lasting its segment's chunks; the latest finish (`_greedy_makespan`), in the launch order the step
#: used. Fitted by `fit_lengths_costs` (least squares, the makespan's coefficient scaled to 1) to the
#: training steps in `benchmarks/results/h200-cp-train-sweep.json` (packed rows of the backward grid,
#: each unsplit and at several L below its longest sequence, as written by
#: `benchmarks/experiments/cp_train_plan_check.py --lengths`); `tests/test_cp_planner_lengths.py` refits
#: from that file and checks these values. The fit's error and its picks:
#: `benchmarks/journal/context-parallel.md`, "The backward's lengths model refitted".
BWD_LEN_TOKEN_COST = 57.9e-6
BWD_LEN_WAVE_COST = 5.87
BWD_LEN_SPLIT_COST = 7.96
BWD_LEN_SCAN_STEP_COST = 0.518
#: The launch that orders a split backward's segments longest first (`launch_order.launch_order`: one
#: launch of the rank kernel, `kernels/sm90/launch_order.py`), in the same units: the kernel's measured
#: time (`benchmarks/journal/context-parallel.md`, "The current kernels on the GPU"). The order moves
#: CTAs, not arithmetic: the gradients are the same either way.
BWD_LEN_ORDER_COST = 0.2
#: Split candidates within this fraction of the best are ties; the longest segment wins.
TIE = 0.03
#: Summed log-decay below which a carried state is dropped by the gate-driven shortcut (FlashQLA's).
GATE_THRESHOLD = -10.0
#: SM count assumed for a device that is not a CUDA GPU (an H200 / H100 SXM has 132).
DEFAULT_SM_COUNT = 132


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


@dataclass(frozen=True)
class CPPlan:
    """A planning decision (static; hashable).

    split: whether to cut sequences into segments. segment_len: L in tokens (a multiple of 64) when
    split, else None. BV: value-slice width for the recurrent kernel. exact: no gate-driven shortcut.
    sm_count: SMs assumed. est_unsplit, est_split: predicted times in chunk units (est_split None
    when no split candidate exists). reason: one line saying why. longest_first: the split backward
    launches the segments longest first (`launch_order.launch_order`; the lengths-costed plan's choice
    where it predicts a gain above the sort's cost, BWD_LEN_ORDER_COST).
    """

    split: bool
    segment_len: int | None
    BV: int
    exact: bool
    sm_count: int
    est_unsplit: float
    est_split: float | None
    reason: str
    longest_first: bool = False

    def num_slots(self, T: int, N: int) -> int:
        """Segment slots for T total tokens and N sequences (0 when not split)."""
        return num_segment_slots(T, N, self.segment_len) if self.split else 0


def _unsplit_time(BV: int, HV: int, V: int, N: int, l_avg: int, l_max: int, sms: int, cost=None) -> float:
    """The unsplit forward launch (cost: per-chunk costs by BV, default UNSPLIT_CHUNK_COST)."""
    ctas = _cdiv(V, BV) * HV * N
    slots = sms * CTAS_PER_SM[BV]
    return (cost or UNSPLIT_CHUNK_COST)[BV] * max(_cdiv(l_max, CHUNK), _cdiv(ctas, slots) * _cdiv(l_avg, CHUNK))


def _segments(T: int, N: int, L: int, l_avg: int, l_max: int, balanced: bool) -> int:
    if balanced:
        return N * _cdiv(l_avg, L)
    others, rest = N - 1, max(T - l_max, 0)
    return _cdiv(l_max, L) + (others * _cdiv(_cdiv(rest, others), L) if others and rest else 0)


def _first_tokens(T: int, N: int, L: int, l_avg: int, l_max: int, balanced: bool) -> int:
    """Tokens in first segments (never corrected), under the same length model."""
    if balanced:
        return N * min(L, l_avg)
    others, rest = N - 1, max(T - l_max, 0)
    return min(L, l_max) + (min(rest, others * L) if others else 0)


#: The unsplit forward's width is picked on the lengths (`unsplit_block_v`) for batches of 2 to this many
#: sequences: the case it is for is a few sequences of unequal lengths, and the exact makespan's cost on
#: the host grows with N (Graham's bounds decide most batches before it).
LENGTHS_WIDTH_MAX_SEQUENCES = 32


def unsplit_block_v(N: int, HV: int, V: int = 128, sm_count: int = DEFAULT_SM_COUNT, seqlens=None) -> int:
    """The unsplit forward launch's value-slice width. Without `seqlens`, for one sequence or for more
    than LENGTHS_WIDTH_MAX_SEQUENCES: `recurrent.pick_block_v` (the N * HV walks taken as equally
    long). With the host-side lengths of 2 to LENGTHS_WIDTH_MAX_SEQUENCES sequences: the width whose
    greedy makespan is shorter (`_greedy_makespan`: the launch's CTAs in launch order, sequence-major,
    HV * V / BV of them a sequence, each ceil(length / 64) chunk steps of `recurrent.ROLES_STEP_US[BV]`,
    one CTA an SM); for equal lengths that is pick_block_v's width.
    Both widths are compiled under the same keys (`flashqla.warmup` builds both) and give the same
    bits, so the choice adds no compile key and changes no result. Raises ValueError naming the
    argument for an N < 0, an HV, V or sm_count < 1 (or not an int), or seqlens that are not N ints
    >= 0."""
    N, HV, V, sm_count = (_int_arg(x, name) for x, name in ((N, "N"), (HV, "HV"), (V, "V"), (sm_count, "sm_count")))
    if N < 0 or min(HV, V, sm_count) < 1:
        raise ValueError(f"unsplit_block_v: N must be >= 0 and HV, V, sm_count >= 1, got N={N}, HV={HV}, V={V}, "
                         f"sm_count={sm_count}")
    if seqlens is not None:
        try:
            items = list(seqlens)
        except TypeError:
            raise ValueError(f"seqlens must be a sequence of N ints, got {type(seqlens).__name__}") from None
        seqlens = [as_index(n) for n in items]
        if len(seqlens) != N or any(n is None or n < 0 for n in seqlens):
            raise ValueError(f"seqlens must be N = {N} int lengths >= 0, got {items!r}")
    if V < 128 or seqlens is None or not 1 < len(seqlens) <= LENGTHS_WIDTH_MAX_SEQUENCES:
        return pick_block_v(N, HV, V, sm_count)
    runs = {bv: [(_cdiv(n, CHUNK), HV * (V // bv)) for n in seqlens] for bv in (64, 128)}
    # Graham's bounds of a greedy list schedule, max(longest, work / SMs) <= makespan <= work / SMs +
    # longest, decide most batches without the exact makespan (the same answer: only a strict gap is
    # taken as decided)
    longest = max(c for c, _ in runs[64])
    lo, hi = {}, {}
    for bv, rs in runs.items():
        per_sm = sum(c * k for c, k in rs) / sm_count
        lo[bv], hi[bv] = max(longest, per_sm) * ROLES_STEP_US[bv], (per_sm + longest) * ROLES_STEP_US[bv]
    if hi[128] < lo[64]:
        return 128
    if hi[64] < lo[128]:
        return 64
    t = {bv: _greedy_makespan(rs, sm_count) * ROLES_STEP_US[bv] for bv, rs in runs.items()}
    if t[64] == t[128]:  # (empty sequences only) the N * HV rule
        return pick_block_v(N, HV, V, sm_count)
    return 64 if t[64] < t[128] else 128


def _lengths_costed(N: int, HV: int, V: int, seqlens, sm_count: int) -> bool:
    """Whether the forward's unsplit launch is costed on the lengths (`_unsplit_lengths_time`) rather
    than as N walks of the longest length: 2 to LENGTHS_WIDTH_MAX_SEQUENCES sequences given, V >= 128
    (both widths exist), and more CTAs at BV 64 (N * HV * V / 64) than SMs, so that the launch runs
    in more than one wave and the lengths decide its makespan. In one wave the launch takes its longest
    walk, which the walk-of-the-longest-length estimate already is (journal forward.md, "Split or not
    on the lengths where the launch runs in waves")."""
    return (seqlens is not None and V >= 128 and 1 < N <= LENGTHS_WIDTH_MAX_SEQUENCES
            and N * HV * _cdiv(V, 64) > sm_count)


def _unsplit_lengths_time(bv: int, HV: int, V: int, seqlens, sms: int) -> float:
    """The unsplit forward launch on known lengths, in the model's chunk units: the greedy makespan
    (`_greedy_makespan`) of its CTAs in launch order (sequence-major, HV * V / bv a sequence, each
    ceil(length / 64) chunk steps, CTAS_PER_SM[bv] an SM), a step costing UNSPLIT_CHUNK_COST[128] times
    the measured chunk-step ratio `recurrent.ROLES_STEP_US[bv] / ROLES_STEP_US[128]`."""
    steps = _greedy_makespan([(_cdiv(int(n), CHUNK), HV * _cdiv(V, bv)) for n in seqlens], sms * CTAS_PER_SM[bv])
    return UNSPLIT_CHUNK_COST[128] * ROLES_STEP_US[bv] / ROLES_STEP_US[128] * steps


def _greedy_makespan(runs, slots: int) -> int:
    """Latest finish of CTAs sent in order to `slots` SMs, each to the first one free: runs is a list of
    (chunks, count), `count` CTAs of `chunks` steps each, in launch order. Exact for that greedy
    schedule; the work is per distinct finish time (and whole rounds at once while every SM frees at
    the same time), not per CTA."""
    free = {0: slots}  # finish time -> SMs free from then
    times = [0]
    end = 0
    for chunks, count in runs:
        while count:
            if len(times) == 1 and count >= slots:  # all SMs free at once: count // slots whole rounds
                rounds = count // slots
                t2 = times[0] + rounds * chunks
                free, times = {t2: slots}, [t2]
                end = max(end, t2)
                count -= rounds * slots
                continue
            t = times[0]
            n = free[t]
            take = min(n, count)
            if take == n:
                heapq.heappop(times)
                del free[t]
            else:
                free[t] = n - take
            t2 = t + chunks
            if t2 in free:
                free[t2] += take
            else:
                free[t2] = take
                heapq.heappush(times, t2)
            end = max(end, t2)
            count -= take
    return end


#: The lengths-costed backward plan (`seqlens`) is used for batches of at most this many sequences (its
#: cost per candidate L grows with them; planning stays within a few ms), else the mean-and-longest
#: model.
LENGTHS_MAX_SEQUENCES = 256
#: Its candidate segment lengths: every multiple of SEGMENT_QUANTUM up to this many quanta, then a
#: geometric grid of ratio LENGTHS_GRID_RATIO.
LENGTHS_DENSE_QUANTA = 64
LENGTHS_GRID_RATIO = 1.05


def _lengths_runs(seqlens, L: int | None, HV: int, longest_first: bool = False) -> tuple[list, int, int]:
    """The backward's CTAs for these sequence lengths cut at L (None: whole sequences), as
    `_greedy_makespan` runs in launch order (token order, or longest_first: descending chunk counts,
    as `launch_order` sorts the segments), with the segment count and the most segments of one
    sequence. `seqlens`: the lengths in token order, or (longest_first) (length, multiplicity) pairs."""
    runs, segs, most = [], 0, 0
    hist: dict = {}
    items = seqlens if longest_first else ((n, 1) for n in seqlens)
    for n, mult in items:
        if n <= 0:
            continue
        if L is None or n <= L:
            parts = [(_cdiv(n, CHUNK), 1)]
        else:
            full, rest = divmod(n, L)
            parts = [(L // CHUNK, full)] + ([(_cdiv(rest, CHUNK), 1)] if rest else [])
        k = sum(p[1] for p in parts)
        segs += k * mult
        most = max(most, k)
        for chunks, num in parts:
            if longest_first:
                hist[chunks] = hist.get(chunks, 0) + num * mult * HV
            elif runs and runs[-1][0] == chunks:
                runs[-1][1] += num * HV
            else:
                runs.append([chunks, num * HV])
    if longest_first:
        runs = [[c, hist[c]] for c in sorted(hist, reverse=True)]
    return runs, segs, most


def _length_pairs(seqlens) -> tuple:
    """(length, count) pairs of `seqlens`, longest first: the form `_lengths_runs` takes for a
    longest-first launch."""
    return tuple(sorted(collections.Counter(seqlens).items(), reverse=True))


def _bwd_lengths_time(seqlens, L: int | None, HV: int, sms: int, longest_first: bool = False) -> float:
    """The training step's CP work at segment length L (None: unsplit) with every length known
    (BWD_LEN_TOKEN_COST's comment), in backward chunk steps; seqlens and longest_first as
    `_lengths_runs`."""
    runs, segs, most = _lengths_runs(seqlens, L, HV, longest_first)
    tokens = sum(n * m for n, m in seqlens) if longest_first else sum(seqlens)
    t = _greedy_makespan(runs, sms) + BWD_LEN_TOKEN_COST * HV * tokens + BWD_LEN_WAVE_COST * HV * segs / sms
    if L is not None:
        t += BWD_LEN_SPLIT_COST + BWD_LEN_SCAN_STEP_COST * max(most - 1, 0)
    return t


def fit_lengths_costs(samples, sms: int = DEFAULT_SM_COUNT) -> dict:
    """Least-squares fit of the lengths model's costs (BWD_LEN_TOKEN_COST's comment) to measured
    training steps.

    samples: (seqlens, HV, L or None, longest_first, step_ms) per measured step (the sweep written by
    `benchmarks/experiments/cp_train_plan_check.py --lengths`). Returns {"BWD_LEN_TOKEN_COST",
    "BWD_LEN_WAVE_COST", "BWD_LEN_SPLIT_COST", "BWD_LEN_SCAN_STEP_COST"} in makespan units, "unit_ms"
    (the makespan's coefficient) and "rms_ms" (the fit's residual). The order's cost is not fitted
    (BWD_LEN_ORDER_COST, measured on its own).
    """
    rows, y = [], []
    for seqlens, HV, L, longest_first, step_ms in samples:
        seq = _length_pairs(seqlens) if longest_first else tuple(seqlens)
        runs, segs, most = _lengths_runs(seq, L, HV, longest_first)
        split = float(L is not None)
        rows.append([float(_greedy_makespan(runs, sms)), float(HV * sum(seqlens)), HV * segs / sms, split,
                     split * max(most - 1, 0)])
        y.append(float(step_ms))
    if len(rows) < 5:
        raise ValueError(f"fit_lengths_costs needs at least 5 samples, got {len(rows)}")
    X = torch.tensor(rows, dtype=torch.float64)
    Y = torch.tensor(y, dtype=torch.float64)[:, None]
    c = torch.linalg.lstsq(X, Y, driver="gelsd").solution[:, 0]
    rms = float(((X @ c - Y[:, 0]) ** 2).mean().sqrt())
    names = ("BWD_LEN_TOKEN_COST", "BWD_LEN_WAVE_COST", "BWD_LEN_SPLIT_COST", "BWD_LEN_SCAN_STEP_COST")
    return dict({n: float(c[i + 1] / c[0]) for i, n in enumerate(names)}, unit_ms=float(c[0]), rms_ms=rms)


def _unsplit_bwd_time(BV: int, HV: int, V: int, N: int, l_avg: int, l_max: int, sms: int) -> float:
    """The unsplit backward: the states pass (forward-like, NV HV N CTAs) and the fused chunk
    backward (HV N CTAs, one per SM, BWD_CHUNK_COST per chunk)."""
    states = _unsplit_time(BV, HV, V, N, l_avg, l_max, sms, CHUNK_COST)  # pass 1 is not the roles kernel
    waves = _cdiv(HV * N, sms)
    return states + BWD_CHUNK_COST * max(_cdiv(l_max, CHUNK), waves * _cdiv(l_avg, CHUNK)) + BWD_WAVE_COST * waves


def _split_time(BV, HV, V, T, N, L, l_avg, l_max, balanced, sms, exact, gate_chunks, backward=False) -> float:
    NV = _cdiv(V, BV)
    segs = _segments(T, N, L, l_avg, l_max, balanced)
    slots = sms * CTAS_PER_SM[BV]
    chunks = _cdiv(min(L, l_max), CHUNK)
    run = CHUNK_COST[BV] * _cdiv(NV * HV * segs, slots) * chunks
    later = max(segs - N, 0)  # non-first segments
    # the transition launch: only non-first segments do work (the others exit at once)
    transition = CHUNK_COST[BV] * _cdiv(NV * HV * later, slots) * chunks if later else 0.0
    if DUAL_LAUNCH:  # run and transition CTAs in one grid; most transitions cut short
        full = min(FULL_TRANSITION_HEADS, HV)
        long = NV * (HV * segs + full * later)
        short = NV * (HV - full) * later
        work = long * chunks + short * min(CUT_CHUNKS, chunks)
        both = CHUNK_COST[BV] * max(_cdiv(long, slots) * chunks, work / slots)
    else:
        both = run + (PASSES_EXACT - 1) * transition
    scan_steps = max(_cdiv(l_max, L) - 1, 0)  # sequential combine steps of the longest sequence
    if backward:
        # forward run and transition recomputed, combine scan and reverse scan, then the unsplit
        # backward over the segments: states pass (like a run) and the fused chunk backward
        waves = _cdiv(HV * segs, sms)
        bwd = BWD_CHUNK_COST * waves * chunks + BWD_WAVE_COST * waves
        return (both + run + 2 * BWD_SCAN_STEP_COST * scan_steps + bwd
                + LAUNCH_COST * (2 * EXTRA_LAUNCHES + HV))
    if exact:
        corrected = max(T - _first_tokens(T, N, L, l_avg, l_max, balanced), 0)
        if DUAL_LAUNCH:  # the correction reads only the rows the transitions walked
            seg_len = max(min(L, l_max), 1)
            corrected *= (full + (HV - full) * min(CUT_CHUNKS * CHUNK, seg_len) / seg_len) / HV
        return (both + SCAN_STEP_COST * scan_steps + CORRECTION_COST * HV * corrected
                + LAUNCH_COST * EXTRA_LAUNCHES + (HEAD_OVERHEAD * HV if DUAL_LAUNCH else 0.0))
    m = DEFAULT_GATE_CHUNKS if gate_chunks is None else gate_chunks
    compact = CHUNK_COST[BV] * _cdiv(NV * HV * later, slots) * min(m, _cdiv(min(L, l_max), CHUNK)) if later else 0.0
    return (PASSES_GATED * run + compact + CORRECTION_COST * HV * later * CHUNK * m
            + LAUNCH_COST * EXTRA_LAUNCHES_GATED)


#: Segment lengths searched: every multiple of SEGMENT_QUANTUM up to this many quanta, then a
#: geometric grid (ratio LENGTH_GRID_RATIO, rounded to the quantum), so that planning a sequence of
#: billions of tokens stays a few thousand candidates.
DENSE_QUANTA = 1024
LENGTH_GRID_RATIO = 1.02


def _segment_lengths(l_top: int, dense: int = DENSE_QUANTA, ratio: float = LENGTH_GRID_RATIO) -> list[int]:
    """Candidate segment lengths L < l_top (multiples of SEGMENT_QUANTUM): every quantum up to `dense`
    quanta, then a geometric grid of `ratio`."""
    n = _cdiv(l_top, SEGMENT_QUANTUM)  # candidates are j * quantum for 1 <= j < n
    js = list(range(1, min(n, dense + 1)))
    j = float(dense)
    while True:
        j *= ratio
        if int(j) >= n:
            break
        if int(j) > js[-1]:
            js.append(int(j))
    return [SEGMENT_QUANTUM * j for j in js]


def plan_cp(HV: int, N: int, T: int, V: int = 128, sm_count: int = DEFAULT_SM_COUNT, *, seqlens=None, **flags) -> CPPlan:
    """Whether and how to split: `_plan_cp` (its docstring: arguments, returns, errors), cached on the
    arguments, with `seqlens` taken as any sequence of ints (made a tuple here)."""
    HV, N, T, V, sm_count = (_int_arg(x, name) for x, name in ((HV, "HV"), (N, "N"), (T, "T"), (V, "V"),
                                                                 (sm_count, "sm_count")))
    if flags.get("max_seqlen") is not None:
        flags["max_seqlen"] = _int_arg(flags["max_seqlen"], "max_seqlen")
    if seqlens is not None:  # checked here, not in the cached function: 4096.0 == 4096 as a cache key
        seqlens = check_seqlens(seqlens, N, T)
    return _plan_cp(HV, N, T, V, sm_count, seqlens=seqlens, **flags)


def _int_arg(value, name: str) -> int:
    """value as a Python int (numpy and torch integers too); ValueError naming `name` for anything else
    (bools, floats such as 4096.0 or NaN, strings). The sign is checked by `_plan_cp`."""
    out = as_index(value)
    if out is None:
        raise ValueError(f"plan_cp: {name} must be an int, got {value!r}")
    return out


@functools.lru_cache(maxsize=1024)
def _plan_cp(
    HV: int,
    N: int,
    T: int,
    V: int = 128,
    sm_count: int = DEFAULT_SM_COUNT,
    *,
    force: bool = False,
    disable: bool = False,
    exact: bool = False,
    segment_len: int | None = None,
    max_seqlen: int | None = None,
    gate_chunks: int | None = None,
    backward: bool = False,
    seqlens: tuple[int, ...] | None = None,
) -> CPPlan:
    """Whether and how to split (the rule in the module docstring). Pure and cached.

    Args:
        HV: value heads. N: sequences (batch rows, or cu_seqlens.numel() - 1). T: total tokens (B * T).
        V: value head dim. sm_count: SMs of the device.
        force: always split (the best split, or `segment_len`). disable: never split.
        exact: exact mode (no gate-driven shortcut), else the gate-driven mode is costed.
        segment_len: fix L (tokens, positive multiple of 64) instead of searching.
        max_seqlen: optional host-side bound on the longest sequence (else balanced lengths).
        gate_chunks: chunks the gate-driven transition launch covers (None: DEFAULT_GATE_CHUNKS).
        backward: cost the backward's launches (`flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd`,
            exact) instead of the forward's.
        seqlens: optional host-side lengths of the N sequences (a tuple summing to T; FLA's
            cu_seqlens_cpu, `flashqla.contract.planning_seqlens`). With backward and N > 1 the plan
            is costed on them (`_bwd_lengths_time`, BWD_LEN_TOKEN_COST's comment); the forward's
            unsplit launch is costed on them where it runs in more than one wave at BV 64
            (`_lengths_costed`), and otherwise its unsplit width is picked on them
            (`unsplit_block_v`); elsewhere only their maximum is used, as max_seqlen.

    Returns a `CPPlan`. Raises ValueError for non-positive sizes, force with disable, a segment_len
    that is not a positive multiple of 64, a gate_chunks < 1, a V that no width in BV_CHOICES
    divides, or seqlens that are not N lengths >= 0 summing to T.
    """
    if HV <= 0 or N < 0 or T < 0 or V <= 0 or sm_count <= 0:
        raise ValueError(f"plan_cp needs HV, V, sm_count > 0 and N, T >= 0, got HV={HV} N={N} T={T} V={V} sm_count={sm_count}")
    if force and disable:
        raise ValueError("force and disable are exclusive")
    if segment_len is not None and (isinstance(segment_len, bool) or not isinstance(segment_len, int)
                                    or segment_len <= 0 or segment_len % CHUNK):
        raise ValueError(f"segment_len must be a positive multiple of {CHUNK} (an int), got {segment_len!r}")
    if gate_chunks is not None and gate_chunks < 1:
        raise ValueError(f"gate_chunks must be a positive number of chunks, got {gate_chunks}")
    if max_seqlen is not None and int(max_seqlen) < 0:
        raise ValueError(f"max_seqlen must be >= 0 tokens, got {max_seqlen}")
    if seqlens is not None:  # checked by `plan_cp`
        longest = max(seqlens, default=0)
        max_seqlen = longest if max_seqlen is None else min(int(max_seqlen), longest)
    bvs = [bv for bv in BV_CHOICES if V % bv == 0]
    if not bvs:
        raise ValueError(f"no value-slice width in {BV_CHOICES} divides V={V}")
    if backward:
        exact = True  # the backward has no gate-driven mode
    if backward and N > 1 and not PACKED_BWD_OWN_PLAN:
        # PACKED_BWD_OWN_PLAN off: the forward's plan (the rule before the one-launch tables and scan)
        p = plan_cp(HV, N, T, V, sm_count, force=force, disable=disable, exact=True, segment_len=segment_len,
                    max_seqlen=max_seqlen)
        return CPPlan(p.split, p.segment_len, p.BV, p.exact, p.sm_count, p.est_unsplit, p.est_split,
                      p.reason + " (the forward's plan: packed batch)")
    if disable or N == 0 or T == 0:  # nothing to search
        # the forward's unsplit launch runs at `unsplit_block_v`'s width (the op passes the plan's BV)
        bv_u = bvs[0] if backward or N == 0 or T == 0 else unsplit_block_v(N, HV, V, sm_count, seqlens)
        if bv_u not in bvs:
            bv_u = bvs[0]
        t_u = 0.0 if N == 0 or T == 0 else _unsplit_time(bv_u, HV, V, N, _cdiv(T, N), _cdiv(T, N), sm_count)
        return CPPlan(False, None, bv_u, exact, sm_count, t_u, None, "disabled" if disable else "empty input")
    # lengths: the hint bounds the longest sequence; without it every sequence is taken as ceil(T / N)
    # long (the case least favourable to splitting)
    l_avg = _cdiv(T, N)
    balanced = max_seqlen is None
    l_max = l_avg if balanced else min(int(max_seqlen), T)
    l_mean = min(l_avg, l_max)  # a hint bounds the longest sequence, not every one

    def unsplit(bv):
        if backward:
            return _unsplit_bwd_time(bv, HV, V, N, l_mean, l_max, sm_count)
        return _unsplit_time(bv, HV, V, N, l_mean, l_max, sm_count)

    if backward and seqlens is not None and 1 < N <= LENGTHS_MAX_SEQUENCES:  # the launch-order model
        pairs = _length_pairs(seqlens)
        bv_u = bvs[0]
        # the unsplit backward launches in token order; a split one in either (longest first costs
        # one device sort, BWD_LEN_ORDER_COST)
        t_u = _bwd_lengths_time(seqlens, None, HV, sm_count)
        lens = [segment_len] if segment_len is not None else _segment_lengths(l_max, LENGTHS_DENSE_QUANTA,
                                                                               LENGTHS_GRID_RATIO)
        cands = []
        for L in lens:
            options = [(_bwd_lengths_time(seqlens, L, HV, sm_count), L, bv_u, False),
                       (_bwd_lengths_time(pairs, L, HV, sm_count, True) + BWD_LEN_ORDER_COST, L, bv_u, True)]
            cands.append(min(options, key=lambda c: (c[0], c[3])))
        # no TIE: this model separates candidates a few percent apart (the mean-and-longest one does not)
        return _decide(t_u, bv_u, cands, bvs, exact, sm_count, force, segment_len, l_max, backward, tie=0.0)
    lengths_costed = not backward and _lengths_costed(N, HV, V, seqlens, sm_count)
    if backward:
        bv_u = min(bvs, key=lambda bv: (unsplit(bv), bvs.index(bv)))
    elif lengths_costed:  # the unsplit launch on the lengths, at its faster width
        costs = {bv: _unsplit_lengths_time(bv, HV, V, seqlens, sm_count) for bv in bvs}
        bv_u = min(bvs, key=lambda bv: (costs[bv], bvs.index(bv)))
    else:  # the width the unsplit launch runs at without lengths (`recurrent.pick_block_v`)
        bv_u = pick_block_v(N, HV, V, sm_count)
        if bv_u not in bvs:
            bv_u = min(bvs, key=lambda bv: (unsplit(bv), bvs.index(bv)))
    t_u = costs[bv_u] if lengths_costed else unsplit(bv_u)
    lens = [segment_len] if segment_len is not None else _segment_lengths(l_max)
    cands = [(_split_time(bv, HV, V, T, N, L, l_avg, l_max, balanced, sm_count, exact, gate_chunks, backward), L, bv,
              False) for L in lens for bv in bvs]
    plan = _decide(t_u, bv_u, cands, bvs, exact, sm_count, force, segment_len, l_max, backward)
    if balanced and seqlens is None and not cands and not plan.split:  # the length in the reason is T / N
        plan = replace(plan, reason=f"sequences fit one segment (each taken as ceil(T / N) = {l_max} tokens long, "
                                    "exact for equal lengths; pass the lengths for unequal ones)")
    if lengths_costed:
        return replace(plan, reason=plan.reason + " (the unsplit launch costed on the lengths)")
    if backward or plan.split or seqlens is None:
        return plan
    # A launch of one wave at BV 64: split or not is decided at pick_block_v's width, as without
    # lengths, and the lengths pick only an unsplit plan's width (`unsplit_block_v`; journal
    # forward.md "The unsplit width from the lengths" and its correction).
    bv_l = unsplit_block_v(N, HV, V, sm_count, seqlens)
    if bv_l == plan.BV or bv_l not in bvs:
        return plan
    return replace(plan, BV=bv_l, reason=plan.reason + f" (BV {bv_l} from the lengths)")


plan_cp.cache_info = _plan_cp.cache_info
plan_cp.cache_clear = _plan_cp.cache_clear
plan_cp.__wrapped__ = _plan_cp.__wrapped__


def _decide(t_u, bv_u, cands, bvs, exact, sm_count, force, segment_len, l_max, backward, tie=TIE) -> CPPlan:
    """The plan from the unsplit estimate and the split candidates (time, L, BV, longest first);
    candidates within `tie` of the best are ties, the longest L among them wins."""
    if not cands:  # no L shorter than the longest sequence
        if force:
            return CPPlan(True, segment_len or SEGMENT_QUANTUM, bv_u, exact, sm_count, t_u, None,
                          "forced; sequences fit one segment")
        return CPPlan(False, None, bv_u, exact, sm_count, t_u, None, f"sequences of <= {l_max} tokens fit one segment")
    # among near-ties (within TIE), the longest segments: fewest waves and scan steps
    t_min = min(c[0] for c in cands)
    t_s, L, bv_s, lf = max((c for c in cands if c[0] <= t_min * (1 + tie)), key=lambda c: (c[1], -bvs.index(c[2])))
    gain = BWD_MIN_GAIN if backward else MIN_GAIN
    if t_u >= gain * t_s:
        return CPPlan(True, L, bv_s, exact, sm_count, t_u, t_s, f"split predicted {t_u / t_s:.2f}x faster", lf)
    if force:
        return CPPlan(True, L, bv_s, exact, sm_count, t_u, t_s, "forced", lf)
    return CPPlan(False, None, bv_u, exact, sm_count, t_u, t_s, f"split predicted only {t_u / t_s:.2f}x (< {gain})")


@functools.cache
def _cuda_sm_count(index: int) -> int:
    return torch.cuda.get_device_properties(index).multi_processor_count


def sm_count(device) -> int:
    """SMs of `device` (a CUDA device's property, read once per device; no sync), else DEFAULT_SM_COUNT."""
    device = torch.device(device)
    if device.type != "cuda":
        return DEFAULT_SM_COUNT
    return _cuda_sm_count(device.index if device.index is not None else torch.cuda.current_device())


class PlanKey(NamedTuple):
    """The static facts a plan is cached on: shapes, dtypes, device, SM count and flags. It holds no
    tensor and nothing derived from cu_seqlens' values or storage (its dtype and length only)."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int
    dtype: torch.dtype
    cu_dtype: torch.dtype | None
    device: torch.device
    sm_count: int
    force: bool
    disable: bool
    exact: bool
    segment_len: int | None
    max_seqlen: int | None
    gate_chunks: int | None = None
    backward: bool = False
    seqlens: tuple[int, ...] | None = None  # the caller's host-side lengths (backward plans only)


def plan_key(q, v, cu_seqlens=None, *, sm_count_override=None, force=False, disable=False, exact=False,
             segment_len=None, max_seqlen=None, gate_chunks=None, backward=False, seqlens=None) -> PlanKey:
    """`PlanKey` from q [B, T, H, K], v [B, T, HV, V] and cu_seqlens (None or [N + 1]); shapes only,
    and the caller's host-side hints (max_seqlen; seqlens, kept where they change the plan beyond
    their maximum: backward plans, and forward plans of 2 to LENGTHS_WIDTH_MAX_SEQUENCES sequences,
    whose unsplit width is picked on them)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    sms = sm_count(q.device) if sm_count_override is None else int(sm_count_override)
    cu_dtype = None if cu_seqlens is None else cu_seqlens.dtype
    if seqlens is not None and not backward and not 1 < N <= LENGTHS_WIDTH_MAX_SEQUENCES:
        max_seqlen = max(seqlens, default=0) if max_seqlen is None else min(int(max_seqlen), max(seqlens, default=0))
        seqlens = None
    seqlens = tuple(seqlens) if seqlens is not None else None
    return PlanKey(B, T, H, HV, K, V, N, q.dtype, cu_dtype, q.device, sms, bool(force), bool(disable), bool(exact),
                   segment_len, max_seqlen, gate_chunks, bool(backward), seqlens)


@functools.lru_cache(maxsize=256)
def _plan_for_key(key: PlanKey) -> CPPlan:
    return plan_cp(key.HV, key.N, key.B * key.T, key.V, key.sm_count, force=key.force, disable=key.disable,
                   exact=key.exact, segment_len=key.segment_len, max_seqlen=key.max_seqlen,
                   gate_chunks=key.gate_chunks, backward=key.backward, seqlens=key.seqlens)


def plan_for(q, v, cu_seqlens=None, *, sm_count_override=None, force=False, disable=False, exact=False,
             segment_len=None, max_seqlen=None, gate_chunks=None, backward=False, seqlens=None) -> CPPlan:
    """The plan for these inputs (cached on `plan_key`).

    Args: q [B, T, H, K], v [B, T, HV, V] (only shapes, dtype and device are read); cu_seqlens None or
        [N + 1] int32/int64 offsets (B == 1); the flags as in `plan_cp`; sm_count_override replaces
        the device's SM count; backward=True plans the backward's launches (a separate cache entry);
        seqlens: the caller's host-side lengths (a tuple, `plan_cp`), or None.
    """
    key = plan_key(q, v, cu_seqlens, sm_count_override=sm_count_override, force=force, disable=disable,
                   exact=exact, segment_len=segment_len, max_seqlen=max_seqlen, gate_chunks=gate_chunks,
                   backward=backward, seqlens=seqlens)
    return _plan_for_key(key)


class CallPlan(NamedTuple):
    """What one call of the op runs: `forward`, the forward's `CPPlan` (for a training forward that
    keeps its split states: the backward's plan, so that the backward can reuse them), and
    `backward`, the backward's plan (None for a call that will run no backward). `keep`: the forward
    splits as the backward will and keeps its segments' states (`flashqla.cp.saved.CPSaved`).
    `ends_at_T`: the offsets are known to end at T (no cu_seqlens, CPU offsets, or a host length hint,
    all checked to sum to T), so no token lies past cu_seqlens[-1] and o needs no zero fill."""

    forward: CPPlan
    backward: CPPlan | None = None
    keep: bool = False
    ends_at_T: bool = False


def plan_call(q, v, cu_seqlens=None, cp=None, *, training: bool = False, keep_states: bool = False,
              max_seqlen=None, seqlens=None, segment_len=None, gate_chunks=None, sm_count_override=None) -> CallPlan:
    """The plans of one call (the op's only entry into the planner): the forward's, and with
    `training` the backward's. cp: the mode (`flashqla.contract.cp_mode`: None reads $FLASHQLA_CP);
    "off" never splits. With `keep_states` (an eager training forward) and a backward plan that
    splits, the forward takes the backward's segmentation (exact mode) so that the backward reuses
    its states; not with `segment_len` or `gate_chunks` (explicit forward options). Shapes, dtypes,
    the device's SM count and the host-side hints only (no device read; cached plans).
    Raises ValueError for an unknown cp mode, or seqlens that are not the batch's N lengths summing
    to its tokens."""
    mode = cp_mode(cp)
    if seqlens is not None:
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        seqlens = check_seqlens(seqlens, N, q.shape[0] * q.shape[1])
    flags = dict(sm_count_override=sm_count_override, force=mode == "on", disable=mode == "off", max_seqlen=max_seqlen)
    ends = cu_seqlens is None or seqlens is not None or cu_seqlens.device.type == "cpu"
    bwd = plan_for(q, v, cu_seqlens, exact=True, backward=True, seqlens=seqlens, **flags) if training else None
    keep = keep_states and bwd is not None and bwd.split and segment_len is None and gate_chunks is None
    if keep:
        return CallPlan(bwd, bwd, True, ends)
    fwd = plan_for(q, v, cu_seqlens, exact=gate_chunks is None, segment_len=segment_len, gate_chunks=gate_chunks,
                   seqlens=seqlens, **flags)
    return CallPlan(fwd, bwd, False, ends)


def cp_splits(q, v, cu_seqlens=None, cp=None, *, segment_len=None, gate_chunks=None, max_seqlen=None,
              sm_count=None, backward=False, seqlens=None) -> bool:
    """Whether `flashqla.chunk_gated_delta_rule_fwd` (backward=True: `chunk_gated_delta_rule_bwd`, whose
    plan is costed for the backward's launches) would split these inputs (a cached plan lookup on
    static facts: shapes, dtypes, device, SM count, options; no host read of any tensor value).

    q: [B, T, H, K]; v: [B, T, HV, V]; cu_seqlens: None or [N + 1]; cp: None ($FLASHQLA_CP, default
    "auto"), "auto", "on" or "off"; the other options as in `chunk_gated_delta_rule_fwd`.
    Returns False for inputs whose shapes the planner cannot read (the op's checks then report them).
    Raises ValueError for an unknown cp mode, or seqlens that are not the batch's N lengths summing to
    its tokens."""
    mode = cp_mode(cp)
    segment_len = positive_int(segment_len, "segment_len", CHUNK)
    gate_chunks = positive_int(gate_chunks, "gate_chunks", 1)
    if mode == "off":
        return False
    if seqlens is not None and isinstance(q, torch.Tensor) and q.dim() == 4 and (
            cu_seqlens is None or (isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1)):
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        seqlens = check_seqlens(seqlens, N, q.shape[0] * q.shape[1])
        if not backward and max_seqlen is None:  # the forward's plan reads the longest, as the op does
            max_seqlen = -(-max(seqlens, default=0) // CHUNK) * CHUNK
    try:
        plan = plan_for(q, v, cu_seqlens, sm_count_override=sm_count, force=mode == "on", exact=gate_chunks is None,
                        segment_len=segment_len, max_seqlen=max_seqlen, gate_chunks=gate_chunks, backward=backward,
                        seqlens=seqlens)
    except (AttributeError, TypeError, ValueError, IndexError):  # shapes the planner cannot read: the op's checks report them
        return False
    return plan.split


def clear_plan_cache() -> None:
    """Empties both plan caches."""
    _plan_for_key.cache_clear()
    plan_cp.cache_clear()


def plan_cache_info():
    """`functools` cache statistics of the keyed plan cache."""
    return _plan_for_key.cache_info()



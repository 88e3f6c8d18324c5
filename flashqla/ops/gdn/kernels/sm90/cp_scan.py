"""The combine scan of context parallelism in one launch (records CP-2 and BWD-dSin).

The split forward and backward (`flashqla.cp`) chain segment states per sequence:

    forward   S_in(first) = h0 (or 0);  S_in(j + 1) = P_j S_in(j) + Q_j
    backward  G(last) = dht (or 0);     G(j - 1) = P_j^T G(j) + E_j

with P_j [K, K] a segment's transition and Q_j / E_j [K, V] fp32. In torch each step is a batched
product of a few value heads (cuBLAS fills few SMs) plus, for packed batches, a gather, a scatter and
masks (~8 launches a step over ceil(T / L) steps). Here one CTA per (sequence, value head, slice of BS
value columns) walks its sequence's segments with the state slice in shared memory: per step it loads
P_j into shared memory and accumulates Q_j + P_j S (or P_j^T G) with fp32 FMAs (no tensor cores: the
chain stays fp32-exact up to summation order, like the torch products). Columns of the state are
independent, so slices never talk to each other.

Variant "prefetch" (the default) keeps that FMA loop but splits each step's contraction into two
halves of P, copied into shared memory by cp.async one half ahead (the next step's first half and Q
load while this step's second half is summed); a step that needs no P commits an empty copy group.
The sums are the same, in the same order, so both variants give the same bits.

Every size is a run-time value (M slots, N sequences; the loop count is the sequence's segment
count read on the device), so a new sequence mix neither recompiles nor synchronises the host.
Compile key: HV, K, V, direction, variant, value columns a CTA.

Outputs, as `flashqla.cp.merge.scan_segment_states` / `scan_segment_grads`:
    forward  starts[slot] = the state entering each segment slot of a sequence, final[n] = the state
             leaving sequence n (h0 / zeros for an empty sequence);
    backward starts[slot] = the gradient reaching each segment's end state (G), final unused.
Slots that belong to no sequence are not written (the caller zero-fills them).
"""


import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, placeholder

__all__ = ["build_cp_scan_kernel", "cp_scan", "scan_slice_width"]

THREADS = 128


def scan_slice_width(HV: int) -> int:
    """Value columns per CTA: 8 for up to 8 value heads (more CTAs for the few-head shapes context
    parallelism is for), else 16."""
    return 8 if HV <= 8 else 16


def _dropped(limit, seg_start, seg_end, sl, hv):
    """Whether slot sl's transition for value head hv walked fewer chunks than the slot has, i.e. was
    dropped by the gate-driven cut (stored as P = 0; `flashqla.cp.forward.transition_limits`)."""
    import tilelang.language as T

    return limit[sl, hv] * CHUNK < T.cast(seg_end[sl] - seg_start[sl], "int32")


def _cp_scan_prefetch_prim_func(HV: int, K: int, V: int, BS: int, reverse: bool):
    """Variant "prefetch": the FMA loop and thread layout of the module docstring, with P and Q
    copied into shared memory by cp.async one half of P ahead. Each step contracts over k in two
    halves (k < K / 2, then the rest: the same FMA order, so the same bits); half 1 of a step loads
    while half 0 is summed, and half 0 and Q of the next step while half 1 is summed. Two half buffers
    of P (rows padded by one word) keep two CTAs an SM."""
    import tilelang.language as T

    NB = V // BS
    HK = K // 2
    M = T.dynamic("M")
    N = T.dynamic("N")
    N0 = T.dynamic("N0")
    ML = T.dynamic("ML")  # rows of limit / seg_start / seg_end: M, or 1 (placeholders) without a cut
    # a half of P: forward P[:, half] (K rows of HK), reverse P[half, :] (HK rows of K), padded rows
    PR, PC = (HK, K) if reverse else (K, HK)

    def half(P, sl, hv, hb):  # the source region of half hb of slot sl's P
        if reverse:
            return P[sl, hv, hb * HK : (hb + 1) * HK, 0:K]
        return P[sl, hv, 0:K, hb * HK : (hb + 1) * HK]

    @T.prim_func
    def gdn_cp_scan(
        P: T.Tensor((M, HV, K, K), "float32"),
        Q: T.Tensor((M, HV, K, V), "float32"),
        h0: T.Tensor((N0, HV, K, V), "float32"),
        seq_first: T.Tensor((N,), "int64"),
        seq_num: T.Tensor((N,), "int64"),
        use_h0: T.int32,
        skip_first: T.int32,
        starts: T.Tensor((M, HV, K, V), "float32"),
        final: T.Tensor((N, HV, K, V), "float32"),
        limit: T.Tensor((ML, HV), "int32"),
        seg_start: T.Tensor((ML,), "int64"),
        seg_end: T.Tensor((ML,), "int64"),
        use_limit: T.int32,
    ):
        with T.Kernel(NB * HV * N, threads=THREADS) as (bx,):
            ib = bx % NB
            hv = (bx // NB) % HV
            n = bx // (NB * HV)
            c0 = ib * BS
            p_s = T.alloc_shared((2, PR, PC + 1), "float32")
            q_s = T.alloc_shared((K, BS), "float32")
            s_s = T.alloc_shared((K, BS), "float32")
            acc = T.alloc_fragment((K, BS), "float32")
            nseg = T.alloc_var("int32")
            first = T.alloc_var("int32")
            slot = T.alloc_var("int32")
            nxt = T.alloc_var("int32")
            lv = T.alloc_var("int32")  # 1: this step's P is live (not dropped by the cut)
            lvn = T.alloc_var("int32")  # the same for the next step's
            nseg = T.cast(seq_num[n], "int32")
            first = T.cast(seq_first[n], "int32")

            if use_h0 != 0:
                for i, j in T.Parallel(K, BS):
                    s_s[i, j] = h0[n, hv, i, c0 + j]
            else:
                for i, j in T.Parallel(K, BS):
                    s_s[i, j] = T.float32(0)
            # a step that reads no P (the skip step below) commits an empty group instead of its
            # copy, so that the waits count the same groups on every path
            if nseg > 0:
                slot = first + (nseg - 1 if reverse else 0)
                lvn = 1
                if use_limit != 0:
                    if _dropped(limit, seg_start, seg_end, slot, hv):
                        lvn = 0
                if ((nseg > 1) if reverse else (skip_first == 0)) and lvn != 0:
                    T.async_copy(half(P, slot, hv, 0), p_s[0, 0:PR, 0:PC])
                else:
                    T.ptx_commit_group()
                T.async_copy(Q[slot, hv, 0:K, c0 : c0 + BS], q_s)
            for jj in T.serial(nseg):
                slot = first + (nseg - 1 - jj if reverse else jj)
                lv = lvn
                if ((jj == nseg - 1) if reverse else (jj == 0 and skip_first != 0)) or lv == 0:
                    T.ptx_commit_group()
                else:
                    T.async_copy(half(P, slot, hv, 1), p_s[1, 0:PR, 0:PC])
                T.ptx_wait_group(1)  # half 0 and Q of this step
                T.sync_threads()
                for i, j in T.Parallel(K, BS):
                    starts[slot, hv, i, c0 + j] = s_s[i, j]
                # forward: a first segment run from h0 already holds its end state in Q;
                # backward: the gradient leaving the first segment is not needed
                skip = (jj == nseg - 1) if reverse else (jj == 0 and skip_first != 0)
                if not skip:
                    for i, j in T.Parallel(K, BS):
                        acc[i, j] = q_s[i, j]
                    # a transition the gate-driven cut dropped is 0: the step is Q (or E) alone
                    if lv != 0:
                        for kk in T.serial(HK):
                            for i, j in T.Parallel(K, BS):
                                if reverse:
                                    acc[i, j] += p_s[0, kk, i] * s_s[kk, j]
                                else:
                                    acc[i, j] += p_s[0, i, kk] * s_s[kk, j]
                T.sync_threads()  # buffer 0 and q_s read
                if jj + 1 < nseg:
                    nxt = first + (nseg - 2 - jj if reverse else jj + 1)
                    lvn = 1
                    if use_limit != 0:
                        if _dropped(limit, seg_start, seg_end, nxt, hv):
                            lvn = 0
                    if (reverse and jj + 1 == nseg - 1) or lvn == 0:
                        T.ptx_commit_group()
                    else:
                        T.async_copy(half(P, nxt, hv, 0), p_s[0, 0:PR, 0:PC])
                    T.async_copy(Q[nxt, hv, 0:K, c0 : c0 + BS], q_s)
                    T.ptx_wait_group(2)  # half 1 of this step
                else:
                    T.ptx_wait_group(0)
                T.sync_threads()
                if not skip:
                    if lv != 0:
                        for kk in T.serial(HK):
                            for i, j in T.Parallel(K, BS):
                                if reverse:
                                    acc[i, j] += p_s[1, kk, i] * s_s[HK + kk, j]
                                else:
                                    acc[i, j] += p_s[1, i, kk] * s_s[HK + kk, j]
                T.sync_threads()  # every read of s_s and buffer 1 done
                if skip:
                    if not reverse:
                        for i, j in T.Parallel(K, BS):
                            s_s[i, j] = Q[slot, hv, i, c0 + j]
                else:
                    T.copy(acc, s_s)
                T.sync_threads()
            if not reverse:
                for i, j in T.Parallel(K, BS):
                    final[n, hv, i, c0 + j] = s_s[i, j]

    return gdn_cp_scan


def _cp_scan_ahead_prim_func(HV: int, K: int, V: int, BS: int, reverse: bool):
    """Variant "ahead": the FMA loop and thread layout of "prefetch", with the next step's whole P and Q
    copied into shared memory by cp.async while this step sums (two buffers of P with rows padded by
    one word, two of Q: one CTA an SM). Two copy groups a step (P or none, then Q), so every wait
    counts the same groups. The contraction runs over k in order: the same bits as the others."""
    import tilelang.language as T

    NB = V // BS
    M = T.dynamic("M")
    N = T.dynamic("N")
    N0 = T.dynamic("N0")
    ML = T.dynamic("ML")  # rows of limit / seg_start / seg_end: M, or 1 (placeholders) without a cut

    @T.prim_func
    def gdn_cp_scan(
        P: T.Tensor((M, HV, K, K), "float32"),
        Q: T.Tensor((M, HV, K, V), "float32"),
        h0: T.Tensor((N0, HV, K, V), "float32"),
        seq_first: T.Tensor((N,), "int64"),
        seq_num: T.Tensor((N,), "int64"),
        use_h0: T.int32,
        skip_first: T.int32,
        starts: T.Tensor((M, HV, K, V), "float32"),
        final: T.Tensor((N, HV, K, V), "float32"),
        limit: T.Tensor((ML, HV), "int32"),
        seg_start: T.Tensor((ML,), "int64"),
        seg_end: T.Tensor((ML,), "int64"),
        use_limit: T.int32,
    ):
        with T.Kernel(NB * HV * N, threads=THREADS) as (bx,):
            ib = bx % NB
            hv = (bx // NB) % HV
            n = bx // (NB * HV)
            c0 = ib * BS
            p_s = T.alloc_shared((2, K, K + 1), "float32")
            q_s = T.alloc_shared((2, K, BS), "float32")
            s_s = T.alloc_shared((K, BS), "float32")
            acc = T.alloc_fragment((K, BS), "float32")
            nseg = T.alloc_var("int32")
            first = T.alloc_var("int32")
            slot = T.alloc_var("int32")
            nxt = T.alloc_var("int32")
            lv = T.alloc_var("int32")  # 1: this step's P is live (not dropped by the cut)
            lvn = T.alloc_var("int32")  # the same for the next step's
            lim1 = T.alloc_var("int32")  # the next step's walked chunks and slot length, read a step
            len1 = T.alloc_var("int32")  # early so that no step waits on their loads
            nseg = T.cast(seq_num[n], "int32")
            first = T.cast(seq_first[n], "int32")
            lim1 = 0
            len1 = 0

            if use_h0 != 0:
                for i, j in T.Parallel(K, BS):
                    s_s[i, j] = h0[n, hv, i, c0 + j]
            else:
                for i, j in T.Parallel(K, BS):
                    s_s[i, j] = T.float32(0)
            # step 0's P (where it is read) and Q into buffer 0
            lvn = 1
            if nseg > 0:
                slot = first + (nseg - 1 if reverse else 0)
                if use_limit != 0:
                    if _dropped(limit, seg_start, seg_end, slot, hv):
                        lvn = 0
                if ((nseg > 1) if reverse else (skip_first == 0)) and lvn != 0:
                    T.async_copy(P[slot, hv, 0:K, 0:K], p_s[0, 0:K, 0:K])
                else:
                    T.ptx_commit_group()
                T.async_copy(Q[slot, hv, 0:K, c0 : c0 + BS], q_s[0, 0:K, 0:BS])
                if use_limit != 0:
                    if nseg > 1:
                        nxt = first + (nseg - 2 if reverse else 1)
                        lim1 = limit[nxt, hv]
                        len1 = T.cast(seg_end[nxt] - seg_start[nxt], "int32")
            for jj in T.serial(nseg):
                slot = first + (nseg - 1 - jj if reverse else jj)
                lv = lvn
                # the next step's P and Q into the other buffers (read by the step before this one,
                # which ended on a barrier)
                if jj + 1 < nseg:
                    nxt = first + (nseg - 2 - jj if reverse else jj + 1)
                    lvn = 1
                    if use_limit != 0:
                        if lim1 * CHUNK < len1:
                            lvn = 0
                        if jj + 2 < nseg:  # the step after next's, used a step from now
                            lim1 = limit[first + (nseg - 3 - jj if reverse else jj + 2), hv]
                            len1 = T.cast(seg_end[first + (nseg - 3 - jj if reverse else jj + 2)]
                                          - seg_start[first + (nseg - 3 - jj if reverse else jj + 2)], "int32")
                    if (reverse and jj + 1 == nseg - 1) or lvn == 0:
                        T.ptx_commit_group()
                    else:
                        T.async_copy(P[nxt, hv, 0:K, 0:K], p_s[(jj + 1) % 2, 0:K, 0:K])
                    T.async_copy(Q[nxt, hv, 0:K, c0 : c0 + BS], q_s[(jj + 1) % 2, 0:K, 0:BS])
                else:
                    T.ptx_commit_group()
                    T.ptx_commit_group()
                T.ptx_wait_group(2)  # this step's P and Q
                T.sync_threads()
                for i, j in T.Parallel(K, BS):
                    starts[slot, hv, i, c0 + j] = s_s[i, j]
                # forward: a first segment run from h0 already holds its end state in Q;
                # backward: the gradient leaving the first segment is not needed
                skip = (jj == nseg - 1) if reverse else (jj == 0 and skip_first != 0)
                if not skip:
                    for i, j in T.Parallel(K, BS):
                        acc[i, j] = q_s[jj % 2, i, j]
                    # a transition the gate-driven cut dropped is 0: the step is Q (or E) alone
                    if lv != 0:
                        for kk in T.serial(K):
                            for i, j in T.Parallel(K, BS):
                                if reverse:
                                    acc[i, j] += p_s[jj % 2, kk, i] * s_s[kk, j]
                                else:
                                    acc[i, j] += p_s[jj % 2, i, kk] * s_s[kk, j]
                T.sync_threads()  # every read of s_s done
                if skip:
                    if not reverse:
                        for i, j in T.Parallel(K, BS):
                            s_s[i, j] = Q[slot, hv, i, c0 + j]
                else:
                    T.copy(acc, s_s)
                T.sync_threads()
            if not reverse:
                for i, j in T.Parallel(K, BS):
                    final[n, hv, i, c0 + j] = s_s[i, j]

    return gdn_cp_scan


#: Scan kernel variants: "prefetch" (P and Q copied by cp.async half a step ahead; the default) and
#: "ahead" (a whole step ahead, one CTA an SM: `scan_choice` picks it for small grids under the
#: gate-driven cut). Both give the same bits.
VARIANTS = ("prefetch", "ahead")
DEFAULT_VARIANT = "prefetch"


#: With the gate-driven cut, the "ahead" variant with narrow slices runs when its grid has at most this
#: many CTAs (`scan_choice`).
AHEAD_MAX_CTAS = 1024
#: ... and at most this many value heads (the most it was measured with).
AHEAD_MAX_HEADS = 32


def scan_choice(HV: int, N: int, cut: bool, V: int = 128) -> tuple[str, int | None]:
    """(variant, slice width or None for `scan_slice_width`) of a `cp_scan` call that names neither.

    With the gate-driven cut (`cut`: the call passes the transitions' limits) only the few heads whose
    gates do not decay walk a chain of products, one CTA per value slice: "ahead" with 4 value
    columns a CTA up to 16 value heads, 8 above (up to AHEAD_MAX_HEADS), when that grid (V / width x
    HV x N CTAs, one an SM) has at most AHEAD_MAX_CTAS CTAs. Otherwise (exact transitions, larger
    grids) DEFAULT_VARIANT with `scan_slice_width`."""
    width = 4 if HV <= 16 else 8
    if cut and HV <= AHEAD_MAX_HEADS and (V // width) * HV * N <= AHEAD_MAX_CTAS:
        return "ahead", width
    return DEFAULT_VARIANT, None


def _resolve_variant(variant: str | None) -> str:
    variant = DEFAULT_VARIANT if variant is None else variant
    if variant not in VARIANTS:
        raise ValueError(f"variant must be one of {VARIANTS}, got {variant!r}")
    return variant


def build_cp_scan_kernel(HV: int, K: int, V: int, reverse: bool, variant: str | None = None,
                         slice_width: int | None = None):
    """Compiled scan kernel for HV value heads, K x V states, forward or reverse, in `variant` (None:
    DEFAULT_VARIANT) with slice_width value columns a CTA (None: `scan_slice_width(HV)`; the same sums
    in the same order, so the same bits). Cached under the resolved variant and width, so
    `op_kernel_specs`' key (no variant) and `cp_scan`'s launch share one build."""
    BS = scan_slice_width(HV) if slice_width is None else int(slice_width)
    if BS <= 0 or V % BS or K % 8:
        raise ValueError(f"the scan kernel needs V % {BS} == 0 and K % 8 == 0, got K = {K}, V = {V}")
    return _build_cp_scan_kernel(int(HV), int(K), int(V), bool(reverse), _resolve_variant(variant), BS)


@functools.lru_cache(maxsize=None)
def _build_cp_scan_kernel(HV: int, K: int, V: int, reverse: bool, variant: str, BS: int):
    make = {"prefetch": _cp_scan_prefetch_prim_func, "ahead": _cp_scan_ahead_prim_func}[variant]
    func = make(HV, K, V, BS, bool(reverse))
    tag = f"_{variant}"
    if BS != scan_slice_width(HV):
        tag += f"_bs{BS}"
    return compile_kernel(func, f"gdn_cp_scan_HV{HV}_K{K}_V{V}_{'rev' if reverse else 'fwd'}{tag}")


def cp_scan(P: torch.Tensor, Q: torch.Tensor, seq_first: torch.Tensor, seq_num: torch.Tensor, init=None, *,
            reverse: bool = False, skip_first: bool = False, want_final: bool = True, variant: str | None = None,
            limit: torch.Tensor | None = None, seg_start: torch.Tensor | None = None,
            seg_end: torch.Tensor | None = None, slice_width: int | None = None):
    """Launches the scan.

    Args:
        P: [M, HV, K, K] fp32 transitions; Q: [M, HV, K, V] fp32 (end states from zero / h0, or the
            backward's E); seq_first, seq_num: [N] int64 (`SegmentTables`: first slot and segment
            count of each sequence); init: None or [N, HV, K, V] fp32 (h0 forward, dht backward);
            reverse: the backward's transposed, last-to-first scan; skip_first: forward only, the
            first segment of each sequence already ran from h0 (its Q is its end state). variant: a
            name of `VARIANTS` (None, with slice_width None: `scan_choice`; the same results).
        limit: None, or [M, HV] int32, the chunks each slot's transition walked
            (`flashqla.cp.forward.transition_limits`), with seg_start, seg_end [M] int64 (the slots'
            token ranges, `SegmentTables.start` / `.end`): a step whose transition walked fewer chunks
            than its slot has is taken as P = 0 (what the transition launch stored there: records
            CP-4 / CP-6), so it reads no P and sums nothing: the step is Q (E) alone, the same value
            as the full product with a zero P. Where the gates decay, that is every head but the
            few that do not (g == 0 heads walk every chunk).
        slice_width: value columns a CTA, as `build_cp_scan_kernel` (the same results).
    Returns:
        (starts [M, HV, K, V] fp32, zeros on slots of no sequence, final [N, HV, K, V] fp32 or None).
    Raises:
        ValueError: limit without seg_start / seg_end, or of a shape other than [M, HV].
    """
    M, HV, K, V = Q.shape
    N = seq_num.shape[0]
    dev = Q.device
    if variant is None and slice_width is None:
        variant, slice_width = scan_choice(HV, N, limit is not None, V)
    variant = _resolve_variant(variant)
    if limit is not None:
        if seg_start is None or seg_end is None:
            raise ValueError("limit needs seg_start and seg_end (the slots' token ranges)")
        if tuple(limit.shape) != (M, HV):
            raise ValueError(f"limit must have shape {(M, HV)}, got {tuple(limit.shape)}")
        if tuple(seg_start.shape) != (M,) or tuple(seg_end.shape) != (M,):
            raise ValueError(f"seg_start and seg_end must have shape {(M,)}, got {tuple(seg_start.shape)} and "
                             f"{tuple(seg_end.shape)}")
    starts = torch.zeros_like(Q)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if (want_final and not reverse) else None
    if M == 0 or N == 0:
        if final is not None and init is not None:
            final.copy_(init)
        elif final is not None:
            final.zero_()
        return starts, final
    kernel = build_cp_scan_kernel(HV, K, V, bool(reverse), variant, slice_width)
    h0 = init.contiguous() if init is not None else placeholder((1, HV, K, V), torch.float32, dev)
    fin = final if final is not None else torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)  # not written
    if limit is None:
        lim = placeholder((1, HV), torch.int32, dev)
        s0 = e0 = placeholder((1,), torch.int64, dev)
    else:
        lim, s0, e0 = limit.to(torch.int32).contiguous(), seg_start.to(torch.int64), seg_end.to(torch.int64)
    kernel(P.contiguous(), Q.contiguous(), h0, seq_first.contiguous(), seq_num.contiguous(), int(init is not None),
           int(skip_first), starts, fin, lim, s0.contiguous(), e0.contiguous(), int(limit is not None))
    return starts, final

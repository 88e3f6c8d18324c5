"""The combine scan of context parallelism in one launch (records CP-2 and BWD-dSin).

The split forward and backward (`flashqla.cp`) chain segment states per sequence:

    forward   S_in(first) = h0 (or 0);  S_in(j + 1) = P_j S_in(j) + Q_j
    backward  G(last) = dht (or 0);     G(j - 1) = P_j^T G(j) + E_j

with P_j [K, K] a segment's transition and Q_j / E_j [K, V] fp32. In torch each step is a batched
product of a few value heads (cuBLAS fills few SMs: ~10 us a step) plus, for packed batches, a
gather, a scatter and masks (~8 launches a step over ceil(T / L) steps). Here one CTA per (sequence,
value head, slice of BS value columns) walks its sequence's segments with the state slice in shared
memory: per step it loads P_j into shared memory and accumulates Q_j + P_j S (or P_j^T G) with fp32
FMAs (no tensor cores: the chain stays fp32-exact up to summation order, like the torch products).
Columns of the state are independent, so slices never talk to each other.

Every size is a run-time value (M slots, N sequences; the loop count is the sequence's segment
count read on the device), so a new sequence mix neither recompiles nor synchronises the host.
Compile key: HV, K, V, direction.

Outputs, as `flashqla.cp.merge.scan_segment_states` / `scan_segment_grads`:
    forward  starts[slot] = the state entering each segment slot of a sequence, final[n] = the state
             leaving sequence n (h0 / zeros for an empty sequence);
    backward starts[slot] = the gradient reaching each segment's end state (G), final unused.
Slots that belong to no sequence are not written (the caller zero-fills them).
"""


import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import compile_kernel, placeholder

__all__ = ["build_cp_scan_kernel", "cp_scan", "scan_slice_width"]

THREADS = 128


def scan_slice_width(HV: int) -> int:
    """Value columns per CTA: 8 for up to 8 value heads (more CTAs for the few-head shapes context
    parallelism is for), else 16."""
    return 8 if HV <= 8 else 16


def _cp_scan_prim_func(HV: int, K: int, V: int, BS: int, reverse: bool):
    import tilelang.language as T

    NB = V // BS
    M = T.dynamic("M")
    N = T.dynamic("N")
    N0 = T.dynamic("N0")

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
    ):
        with T.Kernel(NB * HV * N, threads=THREADS) as (bx,):
            ib = bx % NB
            hv = (bx // NB) % HV
            n = bx // (NB * HV)
            c0 = ib * BS
            # rows padded by one word: the FMA loop reads a column of P (forward) or a row (reverse)
            # across 16 rows per warp; a stride of K + 1 words puts them in distinct banks
            p_s = T.alloc_shared((K, K + 1), "float32")
            s_s = T.alloc_shared((K, BS), "float32")
            acc = T.alloc_fragment((K, BS), "float32")
            nseg = T.alloc_var("int32")
            first = T.alloc_var("int32")
            nseg = T.cast(seq_num[n], "int32")
            first = T.cast(seq_first[n], "int32")

            if use_h0 != 0:
                for i, j in T.Parallel(K, BS):
                    s_s[i, j] = h0[n, hv, i, c0 + j]
            else:
                for i, j in T.Parallel(K, BS):
                    s_s[i, j] = T.float32(0)
            for jj in T.serial(nseg):
                slot = first + (nseg - 1 - jj if reverse else jj)
                for i, j in T.Parallel(K, BS):
                    starts[slot, hv, i, c0 + j] = s_s[i, j]
                # forward: a first segment run from h0 already holds its end state in Q;
                # backward: the gradient leaving the first segment is not needed
                if (jj == nseg - 1) if reverse else (jj == 0 and skip_first != 0):
                    if not reverse:
                        for i, j in T.Parallel(K, BS):
                            s_s[i, j] = Q[slot, hv, i, c0 + j]
                else:
                    for i, j in T.Parallel(K, K):
                        p_s[i, j] = P[slot, hv, i, j]
                    for i, j in T.Parallel(K, BS):
                        acc[i, j] = Q[slot, hv, i, c0 + j]
                    for kk in T.serial(K):
                        for i, j in T.Parallel(K, BS):
                            if reverse:
                                acc[i, j] += p_s[kk, i] * s_s[kk, j]
                            else:
                                acc[i, j] += p_s[i, kk] * s_s[kk, j]
                    T.copy(acc, s_s)
            if not reverse:
                for i, j in T.Parallel(K, BS):
                    final[n, hv, i, c0 + j] = s_s[i, j]

    return gdn_cp_scan


@functools.lru_cache(maxsize=None)
def build_cp_scan_kernel(HV: int, K: int, V: int, reverse: bool):
    """Compiled scan kernel for HV value heads, K x V states, forward or reverse (cached)."""
    BS = scan_slice_width(HV)
    if V % BS or K % 8:
        raise ValueError(f"the scan kernel needs V % {BS} == 0 and K % 8 == 0, got K = {K}, V = {V}")
    func = _cp_scan_prim_func(HV, K, V, BS, bool(reverse))
    return compile_kernel(func, f"gdn_cp_scan_HV{HV}_K{K}_V{V}_{'rev' if reverse else 'fwd'}")


def cp_scan(P: torch.Tensor, Q: torch.Tensor, seq_first: torch.Tensor, seq_num: torch.Tensor, init=None, *,
            reverse: bool = False, skip_first: bool = False, want_final: bool = True):
    """Launches the scan.

    Args:
        P: [M, HV, K, K] fp32 transitions; Q: [M, HV, K, V] fp32 (end states from zero / h0, or the
            backward's E); seq_first, seq_num: [N] int64 (`SegmentTables`: first slot and segment
            count of each sequence); init: None or [N, HV, K, V] fp32 (h0 forward, dht backward);
            reverse: the backward's transposed, last-to-first scan; skip_first: forward only, the
            first segment of each sequence already ran from h0 (its Q is its end state).
    Returns:
        (starts [M, HV, K, V] fp32, zeros on slots of no sequence, final [N, HV, K, V] fp32 or None).
    """
    M, HV, K, V = Q.shape
    N = seq_num.shape[0]
    dev = Q.device
    starts = torch.zeros_like(Q)
    final = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev) if (want_final and not reverse) else None
    if M == 0 or N == 0:
        if final is not None and init is not None:
            final.copy_(init)
        elif final is not None:
            final.zero_()
        return starts, final
    kernel = build_cp_scan_kernel(HV, K, V, bool(reverse))
    h0 = init.contiguous() if init is not None else placeholder((1, HV, K, V), torch.float32, dev)
    fin = final if final is not None else torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)  # not written
    kernel(P.contiguous(), Q.contiguous(), h0, seq_first.contiguous(), seq_num.contiguous(), int(init is not None),
           int(skip_first), starts, fin)
    return starts, final

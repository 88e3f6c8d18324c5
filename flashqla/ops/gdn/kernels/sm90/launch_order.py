"""The backward's longest-first launch order in one launch.

`launch_order` gives the backward's chain kernels the sequences of a packed batch sorted by length,
longest first, ties in token order: the stable descending argsort of len_n = cu[n + 1] - cu[n]
(torch ops: a subtraction, a radix sort and a cast). `longest_first_order` computes the same
permutation with one TileLang launch.

Kernel (`gdn_launch_order`): every sequence i counts its rank
    r_i = #{j : len_j > len_i} + #{j < i : len_j == len_i},
the position of i in the stable descending order, and writes order[r_i] = i. The keys (len_j, -j) are
distinct and totally ordered, so the ranks are a permutation of [0, N) whatever the offsets hold: every
element of order is written once, and the result is exactly the stable argsort's.

Grid ceil(N / 32) CTAs of THREADS = 512 threads: lane l of every warp works on sequence i = 32 bx + l,
and the CTA's WARPS = 16 warps split the j's between them (warp w counts the blocks of 32 sequences
w, w + 16, ...); at the end warp 0 adds the 16 partial counts (through shared memory) and writes. One
thread per sequence with the whole loop over j leaves the integer compares' latencies exposed and
most SMs idle.

The lengths reach the warps through shared memory, THREADS * PER = 1024 at a time: at step b every
thread stages PER lengths len_j, j = 1024 b + 512 p + tx (lengths past N are padded with the dtype's
minimum, which never counts), then the warps count against the staged lengths. The next step's lengths
are loaded into registers before this step is counted, so the global loads overlap the counting, and two
alternating buffers need one barrier a step. Each block of 32 is counted with a condition simpler than
the full one where it lies wholly before or after the CTA's own block: blocks before it count
len_j >= len_i (every j there is < i), blocks after it len_j > len_i (blocks wholly past N are skipped),
its own block the full condition; LANES partial counts keep the adds independent. The work grows as N^2
over the GPU, so `launch_order` takes this path up to ORDER_KERNEL_MAX sequences.

No host synchronisation: the output size is N = cu.numel() - 1 (a shape), N is a run-time size (a new
N never recompiles; compile key: the offsets' dtype only). Lengths are computed and compared in the
offsets' dtype, as the torch expression does.

Checked on the GPU against torch.argsort(..., stable=True) (`tests/gpu/test_cp_kernels_gpu.py`), and on
the CPU by running the generated source with a thread per GPU thread (`tests/test_launch_order_kernel.py`);
the torch path is the CPU one and the reference.
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import compile_kernel, on_sm90, tl_dtype

__all__ = ["THREADS", "SEQS", "build_launch_order_kernel", "launch_order", "longest_first_order"]

#: Threads per CTA: WARPS warps that share the CTA's SEQS sequences (one a lane) and split the count.
THREADS = 512
#: Sequences per CTA (one per lane of each warp), and the block of the counting below.
SEQS = 32
WARPS = THREADS // SEQS
#: Lengths each thread stages per step: a step stages THREADS * PER lengths, with PER independent loads
#: a thread in flight while the previous step is counted.
PER = 2
#: Independent partial counts per thread (the counting adds form LANES chains, not one).
LANES = 4

_SEQ_DTYPES = ("int32", "int64")


def _launch_order_prim_func(seq_dtype: str):
    import tilelang.language as T

    TH = THREADS
    S = SEQS
    W = WARPS
    STEP = TH * PER
    Np1 = T.dynamic("Np1")  # N + 1 offsets
    N = T.dynamic("N")
    pad = T.min_value(seq_dtype)  # a length no real length is below: never counted

    @T.prim_func
    def gdn_launch_order(
        cu: T.Tensor((Np1,), seq_dtype),
        order: T.Tensor((N,), "int32"),
    ):
        with T.Kernel(T.ceildiv(N, S), threads=TH) as bx:
            tx = T.get_thread_binding()
            lens = T.alloc_shared((2, STEP), seq_dtype)
            part = T.alloc_shared((W, S), "int32")
            nxt = T.alloc_local((PER,), seq_dtype)
            cnt = T.alloc_local((LANES,), "int32")
            i = T.alloc_var("int32")
            j = T.alloc_var("int32")
            kb = T.alloc_var("int32")
            own = T.alloc_var(seq_dtype)

            w = tx // S  # the warp: blocks w, w + W, ... of each step
            lane = tx % S
            i = bx * S + lane
            own = T.if_then_else(i < N, cu[i + 1] - cu[i], pad)
            for k in T.unroll(LANES):
                cnt[k] = 0
            for p in T.unroll(PER):  # step 0's lengths
                j = p * TH + tx
                nxt[p] = T.if_then_else(j < N, cu[j + 1] - cu[j], pad)
            for b in T.serial(T.ceildiv(N, STEP)):
                for p in T.unroll(PER):
                    lens[b % 2, p * TH + tx] = nxt[p]
                T.sync_threads()
                for p in T.unroll(PER):  # the next step's lengths, in flight while this step counts
                    j = (b + 1) * STEP + p * TH + tx
                    nxt[p] = T.if_then_else(j < N, cu[j + 1] - cu[j], pad)
                for q in T.serial(STEP // (S * W)):  # block kb of 32 sequences, staged at lens[b % 2, 32 (W q + w):]
                    kb = b * (STEP // S) + q * W + w
                    if kb < bx:  # every j of the block is < i
                        for e in T.unroll(S // LANES):
                            for k in T.unroll(LANES):
                                cnt[k] = cnt[k] + T.if_then_else(
                                    lens[b % 2, (q * W + w) * S + e * LANES + k] >= own, 1, 0)
                    elif kb * S < N and kb > bx:  # every j of the block is > i
                        for e in T.unroll(S // LANES):
                            for k in T.unroll(LANES):
                                cnt[k] = cnt[k] + T.if_then_else(
                                    lens[b % 2, (q * W + w) * S + e * LANES + k] > own, 1, 0)
                    elif kb == bx:  # the CTA's own block: j < i where e * LANES + k < lane
                        for e in T.unroll(S // LANES):
                            for k in T.unroll(LANES):
                                cnt[k] = cnt[k] + T.if_then_else(
                                    (lens[b % 2, (q * W + w) * S + e * LANES + k] > own)
                                    | ((lens[b % 2, (q * W + w) * S + e * LANES + k] == own) & (e * LANES + k < lane)),
                                    1, 0)
            for k in T.unroll(1, LANES):
                cnt[0] = cnt[0] + cnt[k]
            T.sync_threads()  # every warp is done with the staged lengths (part may reuse their memory)
            part[w, lane] = cnt[0]
            T.sync_threads()
            if tx < S and i < N:  # warp 0: the rank of sequence i, its count plus the other warps'
                for k in T.unroll(1, W):
                    cnt[0] = cnt[0] + part[k, lane]
                order[cnt[0]] = i

    return gdn_launch_order


@functools.lru_cache(maxsize=None)
def build_launch_order_kernel(seq_dtype: str):
    """Compiled launch-order kernel (cached). Static key: the offsets' dtype, "int32" or "int64"
    (ValueError otherwise).

    Call as kernel(cu [N + 1] (seq_dtype), order [N] int32), N >= 1 a run-time size;
    `longest_first_order` allocates the output and launches it."""
    if seq_dtype not in _SEQ_DTYPES:
        raise ValueError(f"seq_dtype must be 'int32' or 'int64', got {seq_dtype!r}")
    return compile_kernel(_launch_order_prim_func(seq_dtype), f"gdn_launch_order_{seq_dtype}")


def longest_first_order(cu_seqlens: torch.Tensor) -> torch.Tensor:
    """int32 [N] permutation of the N sequences of the packed offsets `cu_seqlens` ([N + 1], int32 or
    int64, on a CUDA device of compute capability 9.0): longest first, ties in index order, i.e.
    `torch.argsort(cu[1:] - cu[:-1], descending=True, stable=True)`, in one launch (none when N == 0).
    No host synchronisation. ValueError for offsets that are not 1-D or of another dtype."""
    if cu_seqlens.dim() != 1 or cu_seqlens.numel() == 0:
        raise ValueError(f"cu_seqlens must be 1-D with N + 1 >= 1 offsets, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise ValueError(f"cu_seqlens must be int32 or int64, got {cu_seqlens.dtype}")
    N = cu_seqlens.shape[0] - 1
    order = torch.empty(N, dtype=torch.int32, device=cu_seqlens.device)
    if N == 0:
        return order
    build_launch_order_kernel(tl_dtype(cu_seqlens.dtype))(cu_seqlens.contiguous(), order)
    return order


#: Most sequences for which `launch_order` sorts with the one-launch rank kernel, whose work grows as
#: N^2; past this, the torch sort.
ORDER_KERNEL_MAX = 8192


def launch_order(cu_seqlens, longest_first: bool = False):
    """The order in which the backward's chain kernels take the sequences of `cu_seqlens` ([N + 1],
    on its device): int32 [N], longest first (ties in token order), or None for token order (no
    offsets, N <= 1, or not longest_first). One CTA per (sequence, value head) walks a sequence's
    chunks, and the GPU hands CTAs to free SMs in launch order: longest first, the short ones fill the
    SMs the long ones leave (`flashqla.cp.plan`); the results do not depend on the order.

    The order is the stable descending argsort of the lengths cu[n + 1] - cu[n]. int32/int64 offsets
    on an sm_90 device with N <= ORDER_KERNEL_MAX: one launch of the rank kernel
    (`longest_first_order`); otherwise (more sequences, the CPU, other devices or dtypes)
    `torch.argsort(..., descending=True, stable=True).to(torch.int32)`, the reference. Both give the
    same permutation, with no host synchronisation."""
    if cu_seqlens is None or cu_seqlens.numel() <= 2 or not longest_first:
        return None
    if (cu_seqlens.numel() - 1 <= ORDER_KERNEL_MAX and cu_seqlens.dim() == 1
            and cu_seqlens.dtype in (torch.int32, torch.int64) and on_sm90(cu_seqlens)):
        return longest_first_order(cu_seqlens)
    return torch.argsort(cu_seqlens[1:] - cu_seqlens[:-1], descending=True, stable=True).to(torch.int32)

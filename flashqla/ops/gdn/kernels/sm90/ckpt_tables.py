"""The checkpoint tables of the recurrent kernel's serving build in one launch.

The serving build (`recurrent.build_recurrent_serving_kernel`, record CF-4) stores checkpoint m while
it processes the chunk that holds position p_m: for chunk slot s, the checkpoints m in
[ck_slots[s], ck_slots[s + 1]) end ck_j[m] (1..64) tokens into that chunk. `recurrent.checkpoint_tables`
defines both tables with about twenty small torch ops (searchsorted, gathers, arithmetic); in a CUDA
graph each costs a launch gap (benchmarks/journal/serving.md). `checkpoint_tables_device` computes
the same tables (same values, int32) with one TileLang launch.

No host synchronisation: sizes come from shapes (M positions, S = `_common.num_slots` slots), every
size is a run-time argument (a new batch never recompiles). Compile key: the dtypes of cu_seqlens
and of the positions, and whether the input is packed.

Kernel (`gdn_checkpoint_tables`): ceil(max(S + 1, M) / 128) CTAs of 128 threads; thread i, with no
shared memory and no barrier:
    slot i < S   its sequence n and chunk c (packed: a binary search, 32 halvings, for the largest n
                 in [0, N) with floor(cu[n] / 64) + n <= i, as `_common.locate_slot`; fixed length:
                 i // ceil(T / 64)), then ck_slots[i] = #{m : p_m <= min(bos + 64 c, eos)} by a binary
                 search over the sorted positions (the checkpoints of every earlier chunk slot);
    i == S       ck_slots[S] = M;
    m = i < M    the sequence of p_m (packed: the largest n with cu[n] < p_m; fixed: (p_m - 1) // T),
                 c = (p_m - 1 - bos) // 64 and ck_j[m] = p_m - bos - 64 c.
Positions must be sorted and each inside a sequence (`flashqla.serving.check_serving_args` checks
that on CPU tensors; on device tensors it is the caller's contract, as in the torch definition).
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, num_slots

__all__ = ["THREADS", "build_checkpoint_tables_kernel", "checkpoint_tables_device"]

#: Threads per CTA.
THREADS = 128

_INT_DTYPES = {torch.int32: "int32", torch.int64: "int64"}


def _tables_prim_func(seq_dtype: str, pos_dtype: str, varlen: bool):
    import tilelang.language as T

    i64 = "int64"
    C = CHUNK
    Np1 = T.dynamic("Np1")  # N + 1 offsets (1 for fixed-length input: a placeholder)
    M = T.dynamic("M")  # checkpoints
    S1 = T.dynamic("S1")  # chunk slots + 1

    @T.prim_func
    def gdn_checkpoint_tables(
        cu_seqlens: T.Tensor((Np1,), seq_dtype),
        positions: T.Tensor((M,), pos_dtype),
        Tfix: T.int32,  # tokens per sequence of fixed-length input (unused when packed)
        ck_slots: T.Tensor((S1,), "int32"),
        ck_j: T.Tensor((M,), "int32"),
    ):
        with T.Kernel(T.ceildiv(T.max(S1, M), THREADS), threads=THREADS) as bx:
            tx = T.get_thread_binding()
            lo = T.alloc_var(i64)
            hi = T.alloc_var(i64)
            mid = T.alloc_var(i64)
            i = T.alloc_var(i64)
            n = T.alloc_var(i64)
            c = T.alloc_var(i64)
            bos = T.alloc_var(i64)
            eos = T.alloc_var(i64)
            t = T.alloc_var(i64)
            p = T.alloc_var(i64)

            i = T.cast(bx * THREADS + tx, i64)
            # ---- slot i: the checkpoints of every earlier slot
            if i < T.cast(S1 - 1, i64):
                if varlen:
                    lo = 0
                    hi = T.cast(Np1 - 1, i64)
                    for _ in T.serial(32):
                        if hi - lo > 1:
                            mid = lo + (hi - lo) // 2
                            if T.cast(cu_seqlens[mid], i64) // C + mid <= i:
                                lo = mid
                            else:
                                hi = mid
                    n = lo
                    bos = T.cast(cu_seqlens[n], i64)
                    eos = T.cast(cu_seqlens[n + 1], i64)
                    c = i - (bos // C + n)
                else:
                    n = i // T.cast(T.ceildiv(Tfix, C), i64)
                    c = i % T.cast(T.ceildiv(Tfix, C), i64)
                    bos = n * T.cast(Tfix, i64)
                    eos = bos + T.cast(Tfix, i64)
                t = T.min(bos + c * C, eos)
                # #{m : p_m <= t}: the first m with p_m > t, in [0, M]
                lo = -1
                hi = T.cast(M, i64)
                for _ in T.serial(32):
                    if hi - lo > 1:
                        mid = lo + (hi - lo) // 2
                        if T.cast(positions[mid], i64) <= t:
                            lo = mid
                        else:
                            hi = mid
                ck_slots[i] = T.cast(hi, "int32")
            if i == T.cast(S1 - 1, i64):
                ck_slots[i] = T.cast(M, "int32")
            # ---- checkpoint i: how far into its chunk it ends
            if i < T.cast(M, i64):
                p = T.cast(positions[i], i64)
                if varlen:
                    # the largest n in [0, N) with cu[n] < p
                    lo = 0
                    hi = T.cast(Np1 - 1, i64)
                    for _ in T.serial(32):
                        if hi - lo > 1:
                            mid = lo + (hi - lo) // 2
                            if T.cast(cu_seqlens[mid], i64) < p:
                                lo = mid
                            else:
                                hi = mid
                    bos = T.cast(cu_seqlens[lo], i64)
                else:
                    bos = ((p - 1) // T.cast(Tfix, i64)) * T.cast(Tfix, i64)
                c = T.max(p - 1 - bos, T.int64(0)) // C
                ck_j[i] = T.cast(p - bos - c * C, "int32")

    return gdn_checkpoint_tables


@functools.lru_cache(maxsize=None)
def build_checkpoint_tables_kernel(seq_dtype: str, pos_dtype: str, varlen: bool):
    """Compiled checkpoint-table kernel (cached). Static key: cu_seqlens' dtype ("int32"/"int64"; "int32"
    for fixed-length input), the positions' dtype, whether the input is packed.

    Call as kernel(cu_seqlens [N + 1] (a 1-element placeholder for fixed-length input), positions [M],
    T (int, tokens per sequence of fixed-length input), ck_slots [S + 1] int32, ck_j [M] int32);
    `checkpoint_tables_device` allocates the outputs and launches it."""
    for name, d in (("seq_dtype", seq_dtype), ("pos_dtype", pos_dtype)):
        if d not in ("int32", "int64"):
            raise ValueError(f"{name} must be 'int32' or 'int64', got {d!r}")
    return compile_kernel(_tables_prim_func(seq_dtype, pos_dtype, bool(varlen)),
                          f"gdn_checkpoint_tables_{seq_dtype}_{pos_dtype}_{int(bool(varlen))}")


def checkpoint_tables_device(positions: torch.Tensor, cu_seqlens, B: int, T: int) -> tuple:
    """(ck_slots [S + 1] int32, ck_j [M] int32), the values of `recurrent.checkpoint_tables`, in one
    launch on positions' device (an sm_90 GPU). positions: sorted int32/int64 [M >= 1], each inside a
    sequence; cu_seqlens: [N + 1] int32/int64 or None (B sequences of T tokens). No host read."""
    dev = positions.device
    varlen = cu_seqlens is not None
    N = cu_seqlens.shape[0] - 1 if varlen else B
    S = num_slots(B, T, N, varlen)
    M = positions.shape[0]
    ck_slots = torch.empty(S + 1, dtype=torch.int32, device=dev)
    ck_j = torch.empty(M, dtype=torch.int32, device=dev)
    cu = cu_seqlens.contiguous() if varlen else torch.empty(1, dtype=torch.int32, device=dev)
    kernel = build_checkpoint_tables_kernel(_INT_DTYPES[cu.dtype], _INT_DTYPES[positions.dtype], varlen)
    if dev.index is not None and dev.index != torch.cuda.current_device():
        with torch.cuda.device(dev):
            kernel(cu, positions.contiguous(), int(T), ck_slots, ck_j)
    else:
        kernel(cu, positions.contiguous(), int(T), ck_slots, ck_j)
    return ck_slots, ck_j

"""The token-wise products of context parallelism in one launch each (records CP-3 and BWD-dSin).

Exact CP runs every segment from a zero state and repairs it afterwards with the segment's entering
state S_in [K, V] (`flashqla.cp.forward`, `flashqla.cp.backward`):

    forward   o_t += S_in^T U_t      for every token t of a corrected segment (CP-3; U_t [K] the
                                     transition launch's output row, o_t [V])
    backward  E = sum_t U_t do_t^T   over the segment's tokens: the gradient reaching S_in through
                                     the segment's own outputs (BWD-dSin)

In torch (the CPU path) these are one GEMM per value head on views (one sequence) or, for packed
batches, a gather of every corrected token row, a batched GEMM and an index_add. Here one CTA per
(segment slot, value head) walks its segment's rows in 64-row tiles: TMA loads of U (and o or do), a
wgmma with the entering state (bf16 in shared memory, converted once per CTA) or into the [K, V] fp32
accumulator. Slots are read from the pseudo offsets of the segment tables (a slot's rows are [cu[j],
cu[j + 1]), spread over CTAs of TG tiles each by the correction); a per-(slot, value head) limit says
how many 64-row tiles from the slot's start are used (0: the slot is not corrected; `need_correction` or
an open sequence's mask as a flag gives 0 or all; the gate-driven truncation gives the chunks its
transition walked, `flashqla.cp.forward.transition_limits`: U rows past them are never written and add
nothing). Every size is a run-time value.

`gdn_cp_correct` adds in fp32 and rounds o once (the torch path rounded the product to o's dtype
before adding). Rows of the last tile past the segment's end are computed but not stored.
`gdn_cp_state_grads` zeroes U's rows past the end before the product and writes E only on slots with a
positive limit (the wrapper zero-fills E: TileLang 0.1.15 moves a `T.clear` of the accumulator placed
before the flag test into the flagged branch of the warp-specialised consumer, which would leave
unflagged slots with an uninitialised accumulator; `benchmarks/journal/context-parallel.md`, "The
split path in one launch per step"). Compile key: HV, K, V, the dtype of U / o / do, the dtype of the
offsets.
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, tl_dtype

__all__ = ["build_cp_correct_kernel", "build_cp_state_grads_kernel", "cp_correct", "cp_state_grads"]


#: Pipeline depth of the segment state-gradient kernel: 64-row tiles of U and do in flight (32 KB a
#: stage at K = V = 128). One CTA walks a slot's walked tiles alone, and a head whose gates do not decay
#: walks all L / 64 of them: the walk is bound by the loads' latency, so more stages go faster.
STATE_GRAD_STAGES = 4

#: 64-row tiles of one slot one CTA of the output correction handles (a slot's tiles are spread over
#: ceil(tiles / TG) CTAs, so the launch does not wait on one CTA walking a whole long segment).
TG = 8


def _correct_prim_func(HV: int, K: int, V: int, dtype: str, seq_dtype: str):
    import tilelang.language as T

    C = CHUNK
    Tn = T.dynamic("T")
    M = T.dynamic("M")
    Mp1 = T.dynamic("Mp1")

    @T.prim_func
    def gdn_cp_correct(
        U: T.Tensor((1, Tn, HV, K), dtype),
        S: T.Tensor((M, HV, K, V), "float32"),
        cu: T.Tensor((Mp1,), seq_dtype),
        limit: T.Tensor((M, HV), "int32"),
        ngroups: T.int32,
        o: T.Tensor((1, Tn, HV, V), dtype),
    ):
        # a 2-D grid: the group index is a block index, not a remainder by the run-time ngroups (a
        # 64-bit division that the generated code repeated in every guarded store of the epilogue)
        with T.Kernel(ngroups, M * HV, threads=128) as (bx, by):
            grp = bx  # tiles [TG grp, TG (grp + 1)) of the slot
            slot = by // HV
            hv = by % HV
            s_s = T.alloc_shared((K, V), dtype)
            u_s = T.alloc_shared((C, K), dtype)
            o_s = T.alloc_shared((C, V), dtype)
            acc = T.alloc_fragment((C, V), "float32")
            start = T.alloc_var("int32")
            end = T.alloc_var("int32")
            start = T.cast(cu[slot], "int32")
            end = T.cast(cu[slot + 1], "int32")
            # the test reads no variable: TileLang 0.1.15 moves variable assignments into the
            # warp-specialised branches, after a test placed before the pipelined loop
            if limit[slot, hv] > grp * TG:
                for i, j in T.Parallel(K, V):
                    s_s[i, j] = T.cast(S[slot, hv, i, j], dtype)
                for it in T.Pipelined(T.min(T.min(T.ceildiv(end - start, C), limit[slot, hv]) - grp * TG, TG), num_stages=2):
                    t0 = start + (grp * TG + it) * C
                    T.copy(U[0, t0 : t0 + C, hv, 0:K], u_s)
                    T.copy(o[0, t0 : t0 + C, hv, 0:V], o_s)
                    T.gemm(u_s, s_s, acc, clear_accum=True)
                    for r, j in T.Parallel(C, V):
                        if t0 + r < end:
                            o[0, t0 + r, hv, j] = T.cast(acc[r, j] + T.cast(o_s[r, j], "float32"), dtype)

    return gdn_cp_correct


def _state_grads_prim_func(HV: int, K: int, V: int, dtype: str, seq_dtype: str):
    import tilelang.language as T

    C = CHUNK
    Tn = T.dynamic("T")
    M = T.dynamic("M")
    Mp1 = T.dynamic("Mp1")

    @T.prim_func
    def gdn_cp_state_grads(
        U: T.Tensor((1, Tn, HV, K), dtype),
        do: T.Tensor((1, Tn, HV, V), dtype),
        cu: T.Tensor((Mp1,), seq_dtype),
        limit: T.Tensor((M, HV), "int32"),
        E: T.Tensor((M, HV, K, V), "float32"),
    ):
        with T.Kernel(M * HV, threads=256) as (bx,):
            slot = bx // HV
            hv = bx % HV
            u_s = T.alloc_shared((C, K), dtype)
            d_s = T.alloc_shared((C, V), dtype)
            acc = T.alloc_fragment((K, V), "float32")
            start = T.alloc_var("int32")
            end = T.alloc_var("int32")
            start = T.cast(cu[slot], "int32")
            end = T.cast(cu[slot + 1], "int32")
            # the test reads no variable: TileLang 0.1.15 moves variable assignments into the
            # warp-specialised branches, after a test placed before the pipelined loop
            if limit[slot, hv] > 0:
                T.clear(acc)
                for it in T.Pipelined(T.min(T.ceildiv(end - start, C), limit[slot, hv]), num_stages=STATE_GRAD_STAGES):
                    t0 = start + it * C
                    T.copy(U[0, t0 : t0 + C, hv, 0:K], u_s)
                    T.copy(do[0, t0 : t0 + C, hv, 0:V], d_s)
                    # rows past the segment's end (the next slot's tokens) contribute zero: only a
                    # slot's last tile can hold such rows, so only it is rewritten (the others go
                    # from their TMA load straight to the wgmma)
                    if t0 + C > end:
                        for r, j in T.Parallel(C, K):
                            u_s[r, j] = T.if_then_else(t0 + r < end, u_s[r, j], T.cast(0, dtype))
                        T.fence_proxy_async()
                    T.gemm(u_s, d_s, acc, transpose_A=True)
                for i, j in T.Parallel(K, V):
                    E[slot, hv, i, j] = acc[i, j]

    return gdn_cp_state_grads


@functools.lru_cache(maxsize=None)
def build_cp_correct_kernel(HV: int, K: int, V: int, dtype: str, seq_dtype: str):
    """Compiled output-correction kernel (cached); the arguments are the static key."""
    return compile_kernel(_correct_prim_func(HV, K, V, dtype, seq_dtype), f"gdn_cp_correct_HV{HV}_K{K}_V{V}_{dtype}_{seq_dtype}")


@functools.lru_cache(maxsize=None)
def build_cp_state_grads_kernel(HV: int, K: int, V: int, dtype: str, seq_dtype: str):
    """Compiled segment state-gradient kernel (cached); the arguments are the static key."""
    return compile_kernel(_state_grads_prim_func(HV, K, V, dtype, seq_dtype),
                          f"gdn_cp_state_grads_HV{HV}_K{K}_V{V}_{dtype}_{seq_dtype}")


#: A limit that never binds (more 64-row tiles than any slot has).
_ALL = 2**30
#: Blocks a grid's y dimension holds (CUDA): the correction's (slot, value head) pairs lie there, so
#: `cp_correct` launches once per range of at most MAX_GRID_Y // HV slots.
MAX_GRID_Y = 65535


def _tile_limits(flag: torch.Tensor | None, limit: torch.Tensor | None, M: int, HV: int) -> torch.Tensor:
    """[M, HV] int32 tile limits from a per-slot flag (0 or all) or a given per-(slot, head) limit."""
    if limit is not None:
        if tuple(limit.shape) != (M, HV):
            raise ValueError(f"limit must have shape {(M, HV)}, got {tuple(limit.shape)}")
        return limit.to(torch.int32).contiguous()
    if flag is None:
        raise ValueError("give flag (per slot) or limit (per slot and head)")
    return (flag.to(torch.int32) * _ALL)[:, None].expand(M, HV).contiguous()


def cp_correct(o: torch.Tensor, U: torch.Tensor, S: torch.Tensor, cu: torch.Tensor, flag: torch.Tensor | None = None,
               limit: torch.Tensor | None = None, max_rows: int | None = None) -> torch.Tensor:
    """o[t] += U[t] @ S[slot(t)] in place for the rows of every slot whose flag is set, or for the
    first limit[slot, hv] 64-row tiles of each slot and value head.

    o: [1, T, HV, V] bf16/fp16 contiguous; U: [1, T, HV, K] (o's dtype); S: [M, HV, K, V] fp32
    entering states; cu: [M + 1] int32/int64 pseudo offsets (`SegmentTables.cu_seqlens`); flag: [M]
    bool, or limit: [M, HV] int (tiles; when given, flag is not read); max_rows: a host bound on any slot's rows (the segment
    length; None: T), which sets the CTAs per slot (ceil(max_rows / (64 TG))). More than
    MAX_GRID_Y // HV slots take one launch per range of that many. Returns o."""
    if U.dtype != o.dtype:
        raise ValueError(f"U and o must share a dtype, got {U.dtype} and {o.dtype}")
    M = S.shape[0]
    if M == 0 or o.shape[1] == 0:
        return o
    HV, K, V = U.shape[2], U.shape[3], o.shape[3]
    lim = _tile_limits(flag, limit, M, HV)
    rows = o.shape[1] if max_rows is None else min(int(max_rows), o.shape[1])
    ngroups = max(-(-rows // (CHUNK * TG)), 1)
    kernel = build_cp_correct_kernel(HV, K, V, tl_dtype(o.dtype), tl_dtype(cu.dtype))
    U, S = U.contiguous(), S.contiguous()
    step = max(MAX_GRID_Y // HV, 1)
    if M <= step:
        kernel(U, S, cu, lim, ngroups, o)
        return o
    # grid y is M * HV: more slots than it holds go in launches over consecutive slot ranges (a CTA
    # writes only its own slot's rows; cu keeps absolute token offsets into U and o)
    for m0 in range(0, M, step):
        m1 = min(m0 + step, M)
        kernel(U, S[m0:m1], cu[m0 : m1 + 1], lim[m0:m1], ngroups, o)
    return o


def cp_state_grads(U: torch.Tensor, do: torch.Tensor, cu: torch.Tensor, flag: torch.Tensor | None = None,
                   limit: torch.Tensor | None = None) -> torch.Tensor:
    """E [M, HV, K, V] fp32: E[j] = sum over slot j's rows of U_t do_t^T where flag[j], else 0; or,
    with limit, over the first limit[j, hv] 64-row tiles of slot j.

    U: [1, T, HV, K], do: [1, T, HV, V] (same dtype, bf16/fp16); cu: [M + 1] pseudo offsets; flag: [M]
    bool, or limit: [M, HV] int (tiles; when given, flag is not read)."""
    M = cu.shape[0] - 1
    HV, K, V = U.shape[2], U.shape[3], do.shape[3]
    E = torch.zeros(M, HV, K, V, dtype=torch.float32, device=U.device)  # slots with limit 0 stay zero
    if M == 0 or U.shape[1] == 0:
        return E
    lim = _tile_limits(flag, limit, M, HV)
    kernel = build_cp_state_grads_kernel(HV, K, V, tl_dtype(U.dtype), tl_dtype(cu.dtype))
    kernel(U.contiguous(), do.to(U.dtype).contiguous(), cu, lim, E)
    return E

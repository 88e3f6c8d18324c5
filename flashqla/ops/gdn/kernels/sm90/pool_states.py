"""The serving call's state traffic on the split plan, each in one launch: the pool's rows gathered
into the split forward's initial states, the final states written into their pool rows, and the
checkpoints combined from the split forward's parts and stored in the caller's layout and dtype.

On the split (context-parallel) plan the serving call runs the unchanged split forward, which takes
and returns fp32 per-sequence states in FLA's [.., K, V] layout. In torch the moves around it are
about fifteen small launches (`flashqla.serving.gather_initial_states`, `store_final_states`,
`flashqla.cp.forward.CheckpointParts.states()` and the copy into checkpoint_states: gathers,
masks, strided casts, an argmax and an `index_copy_`, a search and a batched GEMM; their cost:
`benchmarks/journal/serving.md`, "The split serving call profiled"). These kernels do the same with
three launches and the same values: the copies and casts bit for bit (one rounding, at the store);
the checkpoint GEMM in fp32 on the CUDA cores (`torch.baddbmm`'s product, summed in another order).
The torch functions stay the CPU path and the reference.

Layouts: "kv" is [.., K, V] (FLA's), "vk" is [.., V, K] (the engines'); a pool or checkpoint tensor's
trailing two dimensions follow it. Storage dtypes fp32, bf16, fp16; compute and the split forward's
states fp32.

Kernels (CUDA tensors on sm_90; every size but K and V is a run-time value):
- `gdn_pool_gather` (`gather_states`): grid (N, HV, K / 32), 128 threads, 32 rows a CTA.
  out[n, hv] = pool[r, hv] (to [K, V], fp32) with r = state_indices[n] (n itself without indices),
  zeros where r < 0 or has_initial_state[n] is False ("vk": through a padded fp32 tile in shared
  memory, both global sides coalesced).
- `gdn_pool_store` (`store_states`): grid (N, HV, K / 32), 128 threads, 32 rows a CTA.
  pool[r, hv] = final[n, hv] (to the layout, rounded once to the pool's dtype), nothing where r < 0
  (no redirected write, as torch's `index_copy_` needs).
- `gdn_checkpoint_combine` (`combine_checkpoints`): grid (M, HV, V / 32), 128 threads. Checkpoint m
  at global position p (the state after the first p tokens) = CQ[m] + CP[m] S_in[j], j the segment
  holding token p - 1 (the first with end > p - 1, ends non-decreasing; a binary search over the
  segment ends in the kernel, as `torch.searchsorted(end, p - 1, right=True)`), stored into
  checkpoint_states[m] in its layout and dtype. A CTA computes a 128 x 32 column block of the
  product, each thread 8 rows x 4 columns of it (TileLang's layout); CP's rows are staged in shared
  memory with one float of padding (the K loop's column reads conflict-free), S_in's block beside
  them.
Indices are not range-checked: an index >= P reads zeros and writes nothing (TileLang's bounds
guards), where torch's index ops would raise a device assert; the caller validates them.
Derivation: record CP-1 (checkpoint = run state + transition x entering state), CF-4.
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import compile_kernel, tl_dtype

__all__ = [
    "BLOCK_COLS",
    "build_checkpoint_combine_kernel",
    "build_pool_gather_kernel",
    "build_pool_store_kernel",
    "combine_checkpoints",
    "gather_states",
    "store_states",
]

THREADS = 128
#: Rows of a state ([K, V]) that one pool-gather or pool-store CTA moves (K / ROWS CTAs a state)
ROWS = 32
#: Columns of one checkpoint-combine CTA (V / BLOCK_COLS CTAs per checkpoint and value head)
BLOCK_COLS = 32
LAYOUTS = ("kv", "vk")


def _tail(layout: str, K: int, V: int) -> tuple:
    return (K, V) if layout == "kv" else (V, K)


def _pool_gather_prim_func(K: int, V: int, dtype: str, layout: str, idx_dtype: str):
    import tilelang.language as T

    P = T.dynamic("P")
    N = T.dynamic("N")
    HV = T.dynamic("HV")
    Ni = T.dynamic("Ni")  # len(state_indices) (N), or 1 (placeholder) without indices
    Nm = T.dynamic("Nm")  # len(has_initial_state) (N), or 1 (placeholder) without it
    a, b = _tail(layout, K, V)

    @T.prim_func
    def gdn_pool_gather(
        pool: T.Tensor((P, HV, a, b), dtype),
        state_indices: T.Tensor((Ni,), idx_dtype),
        has_initial_state: T.Tensor((Nm,), "uint8"),
        indexed: T.int32,  # 1: row state_indices[n]; 0: row n
        masked: T.int32,  # 1: has_initial_state is read
        out: T.Tensor((N, HV, K, V), "float32"),
    ):
        with T.Kernel(N, HV, K // ROWS, threads=THREADS) as (n, hv, rb):
            i0 = rb * ROWS  # this CTA's rows of out[n, hv] ([K, V])
            r = T.alloc_var("int64")
            r = T.cast(n, "int64")
            if indexed != 0:
                r = T.cast(state_indices[n], "int64")
            if masked != 0:
                if has_initial_state[n] == 0:
                    r = -1
            if r >= 0:
                if layout == "kv":
                    for i, j in T.Parallel(ROWS, V):
                        out[n, hv, i0 + i, j] = T.cast(pool[r, hv, i0 + i, j], "float32")
                else:
                    tile = T.alloc_shared((V, ROWS + 1), "float32")
                    for j, i in T.Parallel(V, ROWS):
                        tile[j, i] = T.cast(pool[r, hv, j, i0 + i], "float32")
                    for i, j in T.Parallel(ROWS, V):
                        out[n, hv, i0 + i, j] = tile[j, i]
            else:
                for i, j in T.Parallel(ROWS, V):
                    out[n, hv, i0 + i, j] = T.float32(0)

    return gdn_pool_gather


def _pool_store_prim_func(K: int, V: int, dtype: str, layout: str, idx_dtype: str):
    import tilelang.language as T

    P = T.dynamic("P")
    N = T.dynamic("N")
    HV = T.dynamic("HV")
    a, b = _tail(layout, K, V)

    @T.prim_func
    def gdn_pool_store(
        final: T.Tensor((N, HV, K, V), "float32"),
        state_indices: T.Tensor((N,), idx_dtype),
        pool: T.Tensor((P, HV, a, b), dtype),
    ):
        with T.Kernel(N, HV, K // ROWS, threads=THREADS) as (n, hv, rb):
            i0 = rb * ROWS  # this CTA's rows of final[n, hv] ([K, V])
            r = T.alloc_var("int64")
            r = T.cast(state_indices[n], "int64")
            if r >= 0:
                if layout == "kv":
                    for i, j in T.Parallel(ROWS, V):
                        pool[r, hv, i0 + i, j] = T.cast(final[n, hv, i0 + i, j], dtype)
                else:
                    tile = T.alloc_shared((ROWS, V + 1), "float32")
                    for i, j in T.Parallel(ROWS, V):
                        tile[i, j] = final[n, hv, i0 + i, j]
                    for j, i in T.Parallel(V, ROWS):
                        pool[r, hv, j, i0 + i] = T.cast(tile[i, j], dtype)

    return gdn_pool_store


def _checkpoint_combine_prim_func(K: int, V: int, dtype: str, layout: str, pos_dtype: str):
    import tilelang.language as T

    BC = BLOCK_COLS
    M = T.dynamic("M")
    Ms = T.dynamic("Ms")  # segments (slots of the split plan)
    HV = T.dynamic("HV")
    a, b = _tail(layout, K, V)

    @T.prim_func
    def gdn_checkpoint_combine(
        CQ: T.Tensor((M, HV, K, V), "float32"),
        CP: T.Tensor((M, HV, K, K), "float32"),
        S_in: T.Tensor((Ms, HV, K, V), "float32"),
        seg_end: T.Tensor((Ms,), "int64"),
        positions: T.Tensor((M,), pos_dtype),
        out: T.Tensor((M, HV, a, b), dtype),
    ):
        with T.Kernel(M, HV, V // BC, threads=THREADS) as (m, hv, cb):
            cp_s = T.alloc_shared((K, K + 1), "float32")
            s_s = T.alloc_shared((K, BC), "float32")
            acc = T.alloc_fragment((K, BC), "float32")
            lo = T.alloc_var("int32")
            hi = T.alloc_var("int32")
            mid = T.alloc_var("int32")
            last = T.alloc_var("int64")
            # j = number of segments whose end <= p - 1 (ends non-decreasing), clamped to Ms - 1
            last = T.cast(positions[m], "int64") - 1
            lo = 0
            hi = Ms
            for _ in T.serial(32):
                if lo < hi:
                    mid = (lo + hi) // 2
                    if seg_end[mid] <= last:
                        lo = mid + 1
                    else:
                        hi = mid
            lo = T.min(lo, Ms - 1)
            for i, k in T.Parallel(K, K):
                cp_s[i, k] = CP[m, hv, i, k]
            for k, c in T.Parallel(K, BC):
                s_s[k, c] = S_in[lo, hv, k, cb * BC + c]
            for i, c in T.Parallel(K, BC):
                acc[i, c] = CQ[m, hv, i, cb * BC + c]
            for k in T.serial(K):
                for i, c in T.Parallel(K, BC):
                    acc[i, c] += cp_s[i, k] * s_s[k, c]
            if layout == "kv":
                for i, c in T.Parallel(K, BC):
                    out[m, hv, i, cb * BC + c] = T.cast(acc[i, c], dtype)
            else:
                for i, c in T.Parallel(K, BC):
                    out[m, hv, cb * BC + c, i] = T.cast(acc[i, c], dtype)

    return gdn_checkpoint_combine


def _check_rows(K: int) -> None:
    if K % ROWS or K <= 0:
        raise ValueError(f"the pool gather and store kernels move {ROWS} rows a CTA: K must be a positive "
                         f"multiple of {ROWS}, got {K}")


def _check_layout(layout: str) -> None:
    if layout not in LAYOUTS:
        raise ValueError(f"layout must be one of {LAYOUTS}, got {layout!r}")


@functools.lru_cache(maxsize=None)
def build_pool_gather_kernel(K: int, V: int, dtype: str, layout: str, idx_dtype: str):
    """Compiled pool-gather kernel (cached). Static key: K, V, the pool's dtype and layout, the
    indices' dtype (int32 without indices); whether indices and has_initial_state are read are
    run-time arguments. Raises ValueError for a K that is not a multiple of ROWS."""
    _check_layout(layout)
    _check_rows(K)
    return compile_kernel(_pool_gather_prim_func(K, V, dtype, layout, idx_dtype),
                          f"gdn_pool_gather_K{K}_V{V}_{dtype}_{layout}_{idx_dtype}")


@functools.lru_cache(maxsize=None)
def build_pool_store_kernel(K: int, V: int, dtype: str, layout: str, idx_dtype: str):
    """Compiled pool-store kernel (cached). Static key: K, V, the pool's dtype and layout, the indices' dtype.
    Raises ValueError for a K that is not a multiple of ROWS."""
    _check_layout(layout)
    _check_rows(K)
    return compile_kernel(_pool_store_prim_func(K, V, dtype, layout, idx_dtype),
                          f"gdn_pool_store_K{K}_V{V}_{dtype}_{layout}_{idx_dtype}")


@functools.lru_cache(maxsize=None)
def build_checkpoint_combine_kernel(K: int, V: int, dtype: str, layout: str, pos_dtype: str):
    """Compiled checkpoint-combine kernel (cached). Static key: K, V (a multiple of BLOCK_COLS), the
    checkpoint tensor's dtype and layout, the positions' dtype."""
    _check_layout(layout)
    if V % BLOCK_COLS:
        raise ValueError(f"the checkpoint-combine kernel needs V divisible by {BLOCK_COLS}, got {V}")
    return compile_kernel(_checkpoint_combine_prim_func(K, V, dtype, layout, pos_dtype),
                          f"gdn_checkpoint_combine_K{K}_V{V}_{dtype}_{layout}_{pos_dtype}")


_placeholders: dict = {}


def _placeholder(dtype: torch.dtype, device) -> torch.Tensor:
    """A cached one-element tensor for an argument the build never reads (no fill per call)."""
    key = (dtype, str(device))
    t = _placeholders.get(key)
    if t is None:
        t = _placeholders[key] = torch.zeros(1, dtype=dtype, device=device)
    return t


def gather_states(pool: torch.Tensor, layout: str, N: int, state_indices=None, has_initial_state=None) -> torch.Tensor:
    """The per-sequence states [N, HV, K, V] fp32 (kv layout, contiguous) a call starts from:
    `flashqla.serving.gather_initial_states(..., torch.float32)` in one launch.

    pool: [P, HV, K, V] ("kv") or [P, HV, V, K] ("vk"), fp32/bf16/fp16, contiguous; with
    state_indices ([N] int32/int64) row state_indices[n] is sequence n's (zeros where negative),
    without it row n (then P == N). has_initial_state: None or [N] bool (False: zeros). CUDA tensors
    on sm_90; indices are not range-checked here (module docstring; the caller validates them)."""
    _check_layout(layout)
    P, HV = pool.shape[0], pool.shape[1]
    K, V = (pool.shape[2], pool.shape[3]) if layout == "kv" else (pool.shape[3], pool.shape[2])
    out = torch.empty(N, HV, K, V, dtype=torch.float32, device=pool.device)
    if N == 0 or HV == 0:
        return out
    if P == 0:
        return out.zero_()
    dev = pool.device
    idx = state_indices.contiguous() if state_indices is not None else _placeholder(torch.int32, dev)
    has = has_initial_state.contiguous().view(torch.uint8) if has_initial_state is not None else _placeholder(torch.uint8, dev)
    kernel = build_pool_gather_kernel(K, V, tl_dtype(pool.dtype), layout, tl_dtype(idx.dtype))
    kernel(pool.contiguous(), idx, has, int(state_indices is not None), int(has_initial_state is not None), out)
    return out


def store_states(final: torch.Tensor, pool: torch.Tensor, layout: str, state_indices: torch.Tensor) -> None:
    """Writes final[n] ([N, HV, K, V] fp32) into pool row state_indices[n] in the pool's layout and
    dtype (rounded once), nothing where the index is negative: `flashqla.serving.store_final_states`
    in one launch. pool contiguous (written in place); CUDA tensors on sm_90."""
    _check_layout(layout)
    N, HV, K, V = final.shape
    if N == 0 or HV == 0 or pool.shape[0] == 0:
        return
    idx = state_indices.contiguous()
    build_pool_store_kernel(K, V, tl_dtype(pool.dtype), layout, tl_dtype(idx.dtype))(final.contiguous(), idx, pool)


def combine_checkpoints(CQ: torch.Tensor, CP: torch.Tensor, S_in: torch.Tensor, seg_end: torch.Tensor,
                        positions: torch.Tensor, out: torch.Tensor, layout: str) -> None:
    """out[m] = CQ[m] + CP[m] S_in[j(m)] in out's layout and dtype (written in place): the split
    forward's checkpoints (`flashqla.cp.forward.CheckpointParts.states()` and the copy into
    checkpoint_states) in one launch.

    CQ [M, HV, K, V], CP [M, HV, K, K], S_in [Ms, HV, K, V] fp32; seg_end [Ms] int64 (non-decreasing);
    positions [M] int32/int64; out [M, HV, K, V] or [M, HV, V, K] ("vk"), fp32/bf16/fp16, contiguous.
    CUDA tensors on sm_90."""
    _check_layout(layout)
    M, HV, K, V = CQ.shape
    if M == 0 or HV == 0:
        return
    kernel = build_checkpoint_combine_kernel(K, V, tl_dtype(out.dtype), layout, tl_dtype(positions.dtype))
    kernel(CQ.contiguous(), CP.contiguous(), S_in.contiguous(), seg_end.to(torch.int64).contiguous(),
           positions.contiguous(), out)

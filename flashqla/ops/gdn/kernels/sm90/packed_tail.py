"""The rows of a packed output that belong to no sequence, set to zero in one launch that finds them
on the device.

A packed call (B = 1, `cu_seqlens` [N + 1] on the device) may end its sequences before the packed
token count: tokens cu_seqlens[N] .. T - 1 belong to no sequence and no forward CTA writes their rows
of o. The op's contract reads them as zeros (`flashqla.ops.gdn.api`; GPU tier
`test_edge_gpu.py::test_packed_tail_output_is_defined`). When the host knows the offsets end at T
(`flashqla.cp.plan.CallPlan.ends_at_T`: a fixed-length batch, CPU offsets, or `cu_seqlens_cpu`) o is
left uninitialised; otherwise zero-filling all of o first writes it twice (a memset of 2 * T * HV * V
bytes: 537 MB at 16/64 heads and 32768 tokens). This kernel writes the tail only.

Kernel `gdn_zero_tail` (`zero_packed_tail`): grid ceil(T / ROWS), THREADS threads. CTA b reads
e = cu_seqlens[N] and returns at once when its rows [b * ROWS, (b + 1) * ROWS) end at or before e;
otherwise, for each value head, it stores zeros into its rows t with e <= t < T ([ROWS, V] a head).
o is [T, HV, V] (the packed [1, T, HV, V] without its batch dimension), contiguous. Static key: V,
o's dtype, the offsets' dtype; T, HV and N are run-time sizes. It reads no input but the one offset,
so it may run before or after the launches that write the sequences' rows (same stream). An offset
cu_seqlens[N] < 0 zeroes every row; one > T none.
No derivation: a store of zeros (the reference twin: `torch.zeros_like(o)` then the sequences' rows).
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import compile_kernel, tl_dtype

__all__ = ["ROWS", "build_zero_tail_kernel", "new_output", "zero_packed_tail"]

THREADS = 128
#: Packed rows (tokens) of o per CTA: ceil(T / ROWS) CTAs, those before the tail returning at once
ROWS = 64


def _zero_tail_prim_func(V: int, dtype: str, cu_dtype: str):
    import tilelang.language as T

    Tn = T.dynamic("T")
    HV = T.dynamic("HV")
    Np1 = T.dynamic("Np1")

    @T.prim_func
    def gdn_zero_tail(
        o: T.Tensor((Tn, HV, V), dtype),
        cu_seqlens: T.Tensor((Np1,), cu_dtype),
    ):
        with T.Kernel(T.ceildiv(Tn, ROWS), threads=THREADS) as b:
            e = T.alloc_var("int64")
            e = T.cast(cu_seqlens[Np1 - 1], "int64")
            t0 = b * ROWS
            if T.cast(t0 + ROWS, "int64") > e:
                for hv in T.serial(HV):
                    for i, j in T.Parallel(ROWS, V):
                        if T.cast(t0 + i, "int64") >= e and t0 + i < Tn:
                            o[t0 + i, hv, j] = T.cast(0, dtype)

    return gdn_zero_tail


@functools.lru_cache(maxsize=None)
def build_zero_tail_kernel(V: int, dtype: str, cu_dtype: str):
    """Compiled tail-zeroing kernel (cached). Static key: V, o's dtype, cu_seqlens' dtype (TileLang
    names: "bfloat16", "int32", ...). Raises ValueError for a V that is not positive."""
    if not isinstance(V, int) or isinstance(V, bool) or V <= 0:
        raise ValueError(f"V must be a positive int, got {V!r}")
    if dtype not in ("bfloat16", "float16", "float32") or cu_dtype not in ("int32", "int64"):
        raise ValueError(f"the tail launch takes o in bfloat16, float16 or float32 and offsets in int32 or int64, "
                         f"got {dtype!r} and {cu_dtype!r}")
    return compile_kernel(_zero_tail_prim_func(V, dtype, cu_dtype), f"gdn_zero_tail_V{V}_{dtype}_{cu_dtype}")


def zero_packed_tail(o: torch.Tensor, cu_seqlens: torch.Tensor) -> torch.Tensor:
    """Sets o[0, t] = 0 for every packed token t >= cu_seqlens[-1] (read on the device; no host sync)
    and returns o. o: [1, T, HV, V] packed output (bf16, fp16 or fp32), contiguous, 16-byte aligned,
    CUDA on sm_90; cu_seqlens: [N + 1] (N >= 0) int32/int64 on o's device. Rows before
    cu_seqlens[-1] are not touched. Raises TypeError / ValueError naming the argument otherwise
    (before any build; an o without rows returns at once)."""
    if not isinstance(o, torch.Tensor) or o.dim() != 4 or o.shape[0] != 1:
        got = tuple(o.shape) if isinstance(o, torch.Tensor) else type(o).__name__
        raise ValueError(f"o must be a packed [1, T, HV, V] tensor, got {got}")
    if not o.is_contiguous():
        raise ValueError("o must be contiguous")
    if o.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        raise TypeError(f"o must be bfloat16, float16 or float32, got {o.dtype}")
    if not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be an int32/int64 tensor [N + 1], got {type(cu_seqlens).__name__}")
    if cu_seqlens.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}")
    if cu_seqlens.dim() != 1 or cu_seqlens.shape[0] < 1:
        raise ValueError(f"cu_seqlens must be 1-D [N + 1] with at least one entry, got shape {tuple(cu_seqlens.shape)}")
    if cu_seqlens.device != o.device:
        raise ValueError(f"cu_seqlens is on {cu_seqlens.device} but o is on {o.device}")
    _, T, HV, V = o.shape
    if T == 0 or HV == 0 or V == 0:
        return o
    if o.device.type != "cuda":
        raise ValueError(f"o must be a CUDA tensor (the tail launch runs on sm_90), got device {o.device}")
    if o.data_ptr() % 16:
        raise ValueError("o must be 16-byte aligned (the tail launch stores 16 bytes at a time)")
    cu = cu_seqlens.contiguous()
    build_zero_tail_kernel(V, tl_dtype(o.dtype), tl_dtype(cu.dtype))(o[0], cu)
    return o


def new_output(v: torch.Tensor, cu_seqlens) -> torch.Tensor:
    """An output like v [B, T, HV, V] for a launch that writes every sequence's rows: uninitialised,
    and for packed input (cu_seqlens given; B == 1) with the rows past cu_seqlens[-1] zeroed on the
    device (`zero_packed_tail`: no host sync, no memset of the whole of o). The sm_90 backend's
    recurrent launches take their o from here (`flashqla.ops.gdn.backend.Sm90Backend`)."""
    o = torch.empty_like(v)
    if cu_seqlens is not None:
        zero_packed_tail(o, cu_seqlens)
    return o

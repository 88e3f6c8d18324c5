"""The gate-driven transition limits of context parallelism in one launch.

`flashqla.cp.forward.transition_limits` decides, per (segment slot, value head), how many chunks the
slot's transition walks: all of them on slots that are corrected, unless the summed log-decay from the
slot's start falls below a cutoff first (then up to and including that chunk; records CP-4 / CP-5). In
torch that is about twenty small ops per call (gathers, a cumsum, a cumprod, masks); here it is one
launch: one thread per (slot, value head) walks the slot's chunk ends g_cum_log2[hv, 64 (base + c) + 63]
(base = floor(start / 64) + slot, the slot layout of `_common.py`) in groups of GROUP independent loads,
summing in fp32 in chunk order (as the torch version's cumsum) and stopping at the first chunk below the
cutoff. Same result as the torch version (`tests/gpu/test_cp_kernels_gpu.py` compares them). Compile
key: HV and the dtype of the pseudo offsets; M, the slot layout's size and the cutoff are run-time
values.
"""

import functools

import torch

from flashqla.ops.gdn.kernels.sm90._common import CHUNK, compile_kernel, tl_dtype

__all__ = ["build_cp_limits_kernel", "cp_transition_limits"]

THREADS = 128
#: Chunk ends loaded together (independent loads) before they are summed in order.
GROUP = 8


def _limits_prim_func(HV: int, seq_dtype: str):
    import tilelang.language as T

    C = CHUNK
    TH = THREADS
    M = T.dynamic("M")
    Mp1 = T.dynamic("Mp1")
    R = T.dynamic("R")

    @T.prim_func
    def gdn_cp_limits(
        g_cum_log2: T.Tensor((HV, R), "float32"),
        cu: T.Tensor((Mp1,), seq_dtype),
        corr: T.Tensor((M,), "uint8"),
        cutoff_log2: T.float32,
        use_cutoff: T.int32,
        limit: T.Tensor((M, HV), "int32"),
    ):
        with T.Kernel(T.ceildiv(M * HV, TH), threads=TH) as bx:
            tx = T.get_thread_binding()
            vals = T.alloc_local((GROUP,), "float32")
            i = T.alloc_var("int64")
            slot = T.alloc_var("int64")
            hv = T.alloc_var("int64")
            a = T.alloc_var("int64")
            b = T.alloc_var("int64")
            nch = T.alloc_var("int64")
            base = T.alloc_var("int64")
            out = T.alloc_var("int64")
            acc = T.alloc_var("float32")
            done = T.alloc_var("bool")

            i = T.cast(bx, "int64") * TH + T.cast(tx, "int64")
            if i < T.cast(M, "int64") * HV:
                slot = i // HV
                hv = i % HV
                a = T.cast(cu[slot], "int64")
                b = T.cast(cu[slot + 1], "int64")
                nch = T.if_then_else(b > a, (b - a + C - 1) // C, T.int64(0))
                base = a // C + slot
                out = 0
                if corr[slot] != 0:
                    out = nch
                    if use_cutoff != 0:
                        acc = T.float32(0)
                        done = False
                        for grp in T.serial((nch + GROUP - 1) // GROUP):
                            if not done:
                                for e in T.unroll(GROUP):
                                    vals[e] = T.if_then_else(
                                        grp * GROUP + e < nch,
                                        g_cum_log2[hv, (base + grp * GROUP + e) * C + C - 1],
                                        T.float32(0),
                                    )
                                for e in T.serial(GROUP):
                                    if not done:
                                        if grp * GROUP + e < nch:
                                            acc = acc + vals[e]
                                            if acc < cutoff_log2:
                                                out = grp * GROUP + e + 1
                                                done = True
                limit[slot, hv] = T.cast(out, "int32")

    return gdn_cp_limits


@functools.lru_cache(maxsize=None)
def build_cp_limits_kernel(HV: int, seq_dtype: str):
    """Compiled limits kernel (cached); the arguments are the static key."""
    return compile_kernel(_limits_prim_func(HV, seq_dtype), f"gdn_cp_limits_HV{HV}_{seq_dtype}")


def cp_transition_limits(g_cum_log2: torch.Tensor, cu: torch.Tensor, need_correction: torch.Tensor,
                         cutoff_log2: float | None) -> torch.Tensor:
    """[M, HV] int32 transition limits (`flashqla.cp.forward.transition_limits`) in one launch.

    g_cum_log2: [HV, S * 64] fp32 (the prepare kernel's, slot layout of cu); cu: [M + 1] int32/int64
    pseudo offsets (`SegmentTables.cu_seqlens`); need_correction: [M] bool; cutoff_log2: the cutoff in
    log2 units, or None (every corrected slot walks all its chunks)."""
    HV = g_cum_log2.shape[0]
    M = cu.shape[0] - 1
    limit = torch.empty(M, HV, dtype=torch.int32, device=g_cum_log2.device)
    if M == 0:
        return limit
    kernel = build_cp_limits_kernel(HV, tl_dtype(cu.dtype))
    use = cutoff_log2 is not None
    kernel(g_cum_log2.contiguous(), cu, need_correction.contiguous().view(torch.uint8),
           float(cutoff_log2) if use else 0.0, int(use), limit)
    return limit

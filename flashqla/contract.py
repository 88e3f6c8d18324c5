"""The op's contract: what the fast path supports, the argument checks shared by the reference
(`reference.chunk_gated_delta_rule`) and the production op (`flashqla.chunk_gated_delta_rule`), the
host-side planning hints, the two user settings read from the environment, and what a forward hands
to its backward (`ChunkGDNForward`). The bottom layer of the package: imports torch only.

Every check runs before any device work and raises `TypeError` (wrong kind of object or dtype) or
`ValueError` (wrong shape or value), naming the argument. Checks that would need to read device
memory (the values of `cu_seqlens`, the sign of `g`) run only where they cost no host
synchronisation: on CPU tensors, or when the caller asks for them (`check_values=True`, which the
fp64 reference always does).

Gates. `g` is a natural-log decay and real models produce `g <= 0` (Qwen3-Next:
`g = -exp(A_log) * softplus(a + dt_bias)`). `g > 0` and NaN are outside the supported domain: with
`check_values=True` (the reference, and any CPU `g`) they are rejected with a `ValueError`; the GPU op
does not read `g` back to the host, so on device they are the caller's responsibility and the
result is undefined (it may overflow). Every path clamps g at `G_FLOOR` = -1000 before its chunk-local
cumsum (`clamp_gates`; why that changes nothing measurable: `G_FLOOR`), so g = -inf is valid
everywhere and means "forget everything", as any g below the floor does.

User settings (read at each call, never at import):
    FLASHQLA_CP        the default context-parallel mode of a call that passes cp=None (`cp_mode`)
    FLASHQLA_CP_EXACT  "1": split calls walk every segment's transition whole (`resolve_truncate`)
"""


from __future__ import annotations

import math
import numbers
import operator
import os
from dataclasses import dataclass
from typing import NamedTuple

import torch

__all__ = [
    "CHUNK",
    "CP_ENV",
    "EXACT_ENV",
    "FLOAT_DTYPES",
    "G_FLOOR",
    "assert_offsets_async",
    "offsets_check_applies",
    "SUPPORTED",
    "TRUNCATE_LOG_DECAY",
    "ChunkGDNForward",
    "GDNDims",
    "as_index",
    "check_cu_seqlens_values",
    "check_device",
    "clamp_gates",
    "check_gate_values",
    "check_gdn_inputs",
    "check_input_values",
    "check_seqlens",
    "check_supported",
    "cp_mode",
    "l2norm",
    "max_seqlen_hint",
    "planning_max_seqlen",
    "planning_seqlens",
    "positive_int",
    "resolve_truncate",
]

FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


@dataclass(frozen=True)
class GDNDims:
    """Problem sizes in FLA's names: B batch, T tokens, H q/k heads, HV value heads, K, V head
    dims, N sequences (B without `cu_seqlens`, `len(cu_seqlens) - 1` with it)."""

    B: int
    T: int
    H: int
    HV: int
    K: int
    V: int
    N: int

    @property
    def group(self) -> int:
        """Value heads per q/k head (GVA ratio HV // H)."""
        return self.HV // self.H


def _tensor(name: str, x, ndim: int, shape_doc: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor of shape {shape_doc}, got {type(x).__name__}")
    if x.dim() != ndim:
        raise ValueError(f"{name} must have {ndim} dimensions {shape_doc}, got shape {tuple(x.shape)}")
    if x.dtype not in FLOAT_DTYPES:
        raise TypeError(f"{name} must be a floating-point tensor (fp16, bf16, fp32 or fp64), got {x.dtype}")
    return x


def _check_readable(name: str, x: torch.Tensor) -> None:
    if x.device.type == "meta":
        raise ValueError(f"{name} is on the meta device, which holds no values: its values cannot be checked")


def _read_values(check_values: bool, x: torch.Tensor) -> bool:
    """Whether the value checks read `x`: asked for, or free (a CPU tensor); never while torch.compile
    or torch.export traces the caller (a traced tensor has no values: reading one is a graph break,
    an error under fullgraph=True)."""
    return (check_values or x.device.type == "cpu") and not torch.compiler.is_compiling()


def check_cu_seqlens_values(cu_seqlens: torch.Tensor, T: int, name: str = "cu_seqlens") -> None:
    """Checks the values of `cu_seqlens` (reads them: call only where a host read is free or wanted).

    Raises ValueError (naming `name`) unless `cu_seqlens[0] == 0`, the entries are non-decreasing
    and `cu_seqlens[-1] == T`.
    """
    _check_readable(name, cu_seqlens)
    cu = cu_seqlens.detach().to("cpu", torch.int64)
    if int(cu[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {name}[0] = {int(cu[0])}")
    if cu.numel() > 1 and bool((cu[1:] < cu[:-1]).any()):
        i = int(torch.nonzero(cu[1:] < cu[:-1])[0, 0])
        raise ValueError(
            f"{name} must be non-decreasing, got {name}[{i}] = {int(cu[i])} > {name}[{i + 1}] = {int(cu[i + 1])}"
        )
    if int(cu[-1]) != T:
        raise ValueError(f"{name} must end at T = {T} (the packed token count), got {name}[-1] = {int(cu[-1])}")


def offsets_check_applies(check_offsets, cu_seqlens) -> bool:
    """Whether `assert_offsets_async` applies to `cu_seqlens`: `check_offsets` True and device offsets,
    outside torch.compile tracing (CPU offsets are read and checked anyway; the op also skips it with
    check_inputs=True, whose host check reads them). Raises TypeError
    unless `check_offsets` is a bool."""
    if not isinstance(check_offsets, bool):
        raise TypeError(f"check_offsets must be a bool, got {type(check_offsets).__name__}")
    return bool(check_offsets and cu_seqlens is not None and cu_seqlens.device.type != "cpu"
                and not torch.compiler.is_compiling())


def assert_offsets_async(cu_seqlens: torch.Tensor, T: int) -> None:
    """Checks the offsets on their device without a host synchronisation: an asynchronous assert
    (`torch._assert_async`) that `cu_seqlens[0] == 0`, the entries are non-decreasing and
    `cu_seqlens[-1] <= T`: the bounds that keep every kernel access inside q, k, v and o (the packed
    tokens after `cu_seqlens[-1]` belong to no sequence: their o and gradients are zero; the host
    check `check_cu_seqlens_values` also wants the end at T). Eight small launches on the caller's stream (their host
    time: README "Valid inputs"). A violation is a
    device-side assert ("Assertion `flashqla: cu_seqlens must start at 0, ...` failed" on stderr) at
    the next synchronisation: on a CUDA device the context is then unusable (CUDA's rule for device
    asserts), so a caller that must survive bad offsets checks them on the host instead
    (`check_inputs=True`, which names the entry).
    On a CPU tensor it raises RuntimeError at once."""
    cu = cu_seqlens.detach()
    steps = torch.diff(cu)  # cu[1:] - cu[:-1]
    ok = (steps.min() >= 0) & (cu[0] == 0) & (cu[-1] <= int(T)) if steps.numel() else cu[0] == 0
    torch._assert_async(ok, "flashqla: cu_seqlens must start at 0, be non-decreasing and end at most at T")


def planning_max_seqlen(cu_seqlens_cpu, cu_seqlens, T: int) -> int | None:
    """The longest sequence of `cu_seqlens_cpu`, a host copy of `cu_seqlens` (FLA's argument of that
    name), rounded up to whole 64-token chunks: the context-parallel planner's length hint
    (`flashqla.cp.plan.plan_cp(max_seqlen=...)`). None when `cu_seqlens_cpu` is None.

    Only host memory is read (no device synchronisation). The hint shapes the plan (whether and
    where long sequences are split), never the results: the segment tables are built on the device
    from `cu_seqlens` itself. A host copy that disagrees with it costs speed, and since a host copy
    ends at T (checked), the op then also takes the device offsets to end at T
    (`flashqla.cp.plan.CallPlan.ends_at_T`): o's rows past device offsets that end earlier are left
    unwritten instead of zeroed.
    Without the hint the planner takes every sequence as ceil(T / N) tokens long.

    While torch.compile or torch.export traces the caller, only the checks that need no values run
    and the result is None (no hint: balanced lengths assumed): the values of a traced tensor are
    not known at trace time, and reading them would break the graph (an error under fullgraph=True).

    Raises TypeError unless `cu_seqlens_cpu` is a dense int32/int64 tensor on the CPU; ValueError when
    `cu_seqlens` is None, when the lengths differ ([N + 1] both), or when its values are not offsets
    of T tokens (starting at 0, non-decreasing, ending at T).
    """
    return max_seqlen_hint(planning_seqlens(cu_seqlens_cpu, cu_seqlens, T))


def max_seqlen_hint(seqlens) -> int | None:
    """The longest of `seqlens` (`planning_seqlens`' tuple, or None) rounded up to whole 64-token
    chunks: `planning_max_seqlen` from lengths already read. None for None."""
    if seqlens is None:
        return None
    return -(-max(seqlens, default=0) // 64) * 64


def planning_seqlens(cu_seqlens_cpu, cu_seqlens, T: int) -> tuple[int, ...] | None:
    """The sequence lengths of `cu_seqlens_cpu` (a host copy of `cu_seqlens`, FLA's argument of that
    name) as a tuple of ints: the backward's context-parallel planner costs its plan on them
    (`flashqla.cp.plan.plan_cp(seqlens=...)`, packed batches), the forward's on their maximum
    (`planning_max_seqlen`), and an unsplit forward of 2 to 32 sequences runs at the value-slice
    width their makespan favours (`flashqla.cp.plan.unsplit_block_v`). None when `cu_seqlens_cpu`
    is None or while torch.compile or torch.export traces the caller; checks and errors as
    `planning_max_seqlen`. The lengths shape the plan, never the results."""
    if cu_seqlens_cpu is None:
        return None
    if not isinstance(cu_seqlens_cpu, torch.Tensor):
        raise TypeError(f"cu_seqlens_cpu must be None or an int32/int64 CPU tensor [N + 1], got {type(cu_seqlens_cpu).__name__}")
    if cu_seqlens_cpu.layout != torch.strided or cu_seqlens_cpu.is_nested:
        raise TypeError(f"cu_seqlens_cpu must be a dense (strided) tensor, got layout {cu_seqlens_cpu.layout}"
                        f"{' (nested)' if cu_seqlens_cpu.is_nested else ''}")
    if cu_seqlens_cpu.dtype not in (torch.int32, torch.int64):
        raise TypeError(f"cu_seqlens_cpu must have dtype int32 or int64, got {cu_seqlens_cpu.dtype}")
    if cu_seqlens_cpu.device.type != "cpu":
        raise TypeError(f"cu_seqlens_cpu must be a CPU tensor (a host copy of cu_seqlens), got device {cu_seqlens_cpu.device}")
    if cu_seqlens is None:
        raise ValueError("cu_seqlens_cpu is given without cu_seqlens: pass the device offsets as cu_seqlens too")
    if cu_seqlens_cpu.dim() != 1 or cu_seqlens_cpu.shape != cu_seqlens.shape:
        raise ValueError(f"cu_seqlens_cpu must have cu_seqlens' shape {tuple(cu_seqlens.shape)}, got {tuple(cu_seqlens_cpu.shape)}")
    if torch.compiler.is_compiling():  # traced: no values to read (see the docstring)
        return None
    check_cu_seqlens_values(cu_seqlens_cpu, T, name="cu_seqlens_cpu")
    cu = cu_seqlens_cpu.to(torch.int64)
    return tuple((cu[1:] - cu[:-1]).tolist())


#: The per-token log-decay floor of every path (the reference, the op, the split and cross-rank paths):
#: g is raised to it before any chunk-local cumsum (`clamp_gates`). Why it changes nothing measurable:
#: a token's decay is exp(g_t), and exp(G_FLOOR) = exp(-1000) is exactly 0 in fp32 (whose smallest
#: subnormal is exp(-103.3)) and in fp64 (exp(-744.4)); the kernels' exp2(-1000 / ln 2) = exp2(-1442.7)
#: likewise. In the chunked form every decay is exp(g_cum_r - g_cum_s) (r >= s, chunk-local sums): a
#: factor that spans a floored token has exponent <= G_FLOOR (the other terms are <= 0), so it is 0
#: with or without the floor, as its recurrence factor exp(g_t) is; a factor that does not span it
#: does not contain it. So g < G_FLOOR already means "forget everything", and g = -inf is accepted
#: and means the same. What the floor prevents: a finite g far below it (-1e30) absorbing the later
#: gates of its chunk in the cumsum (g_cum_r - g_cum_s rounds to 0: decay 1 instead of exp(sum g)),
#: and two fp32 gates of -3e38 summing to -inf, then NaN (-inf - -inf). The one cost: chunk sums
#: after a floored token carry an offset of about -1000, where fp32's spacing is 2^-13 (6e-5 of a
#: unit of log-decay), far below the bf16 rounding of the outputs. The gradient dg of a token below
#: the floor is 0 (the recurrence's too: d exp(g) / dg = exp(g) = 0 there).
G_FLOOR = -1000.0


def clamp_gates(g: torch.Tensor) -> torch.Tensor:
    """max(g, G_FLOOR) elementwise, without a host sync: the gates the kernels' chunk-local cumsums read
    (see `G_FLOOR`; -inf becomes G_FLOOR). One elementwise pass over g ([B, T, HV] fp32: 8 bytes per
    token and value head moved) and a new tensor of g's shape and dtype."""
    return g.clamp_min(G_FLOOR)


#: Byte alignment the kernels need of a tensor's first element (the copy engine's loads and stores,
#: the vector accesses)
KERNEL_ALIGN = 16


def is_dense(x: torch.Tensor) -> bool:
    """Whether the kernels can read or write x in place: contiguous, its first element KERNEL_ALIGN-byte
    aligned (a view at an odd storage offset of a larger buffer, such as `buf[1:].view(...)`, is not)."""
    return x.is_contiguous() and x.data_ptr() % KERNEL_ALIGN == 0


def dense(x: torch.Tensor) -> torch.Tensor:
    """x as the kernels read it (`is_dense`): x itself when it already is, else one contiguous copy
    (a fresh allocation: torch's own are aligned). Differentiable like `contiguous`."""
    return x if is_dense(x) else x.clone(memory_format=torch.contiguous_format)


def check_gate_values(g: torch.Tensor) -> None:
    """Raises ValueError when `g` has a positive (+inf included) or NaN entry (reads `g`: a host sync
    on GPU), or is on the meta device (no values to read). g = -inf is valid: "forget everything"
    (`G_FLOOR`)."""
    _check_readable("g", g)
    g = g.detach()
    if bool(torch.isnan(g).any()):
        raise ValueError("g must not be NaN (natural-log decay per token, g <= 0; -inf means forget everything)")
    if bool((g > 0).any()):
        raise ValueError(f"g must be <= 0 (natural-log decay per token); got max(g) = {float(g.max()):.3g}")


def check_input_values(q, k, v, beta, initial_state=None) -> None:
    """Raises ValueError, naming the argument, when q, k, v, beta or initial_state has a NaN or infinite
    entry or beta has one outside [0, 1] (reads them: a host sync on GPU); on the meta device (no
    values to read). The valid domain the op's numerics assume (README "Valid inputs")."""
    named = [("q", q), ("k", k), ("v", v), ("beta", beta)]
    if initial_state is not None:
        named.append(("initial_state", initial_state))
    for name, x in named:
        _check_readable(name, x)
        x = x.detach()
        bad = ~torch.isfinite(x)
        if bool(bad.any()):
            i = tuple(int(j) for j in torch.nonzero(bad)[0])
            raise ValueError(f"{name} must be finite, got {float(x[i])} at index {i}")
    b = beta.detach()
    if bool(((b < 0) | (b > 1)).any()):
        raise ValueError(f"beta must be in [0, 1] (a write strength, e.g. a sigmoid output), got values in "
                         f"[{float(b.min()):.4g}, {float(b.max()):.4g}]")


def check_gdn_inputs(
    q,
    k,
    v,
    g,
    beta,
    scale=None,
    initial_state=None,
    output_final_state=False,
    cu_seqlens=None,
    *,
    check_values: bool = False,
) -> GDNDims:
    """Validates the arguments of `chunk_gated_delta_rule` (FLA's layout) and returns the sizes.

    Args (FLA's layout; see `flashqla.chunk_gated_delta_rule` for units):
        q, k: [B, T, H, K] floating point, the same shape.
        v: [B, T, HV, V] floating point, HV % H == 0.
        g: [B, T, HV] floating point, natural-log decay per token.
        beta: [B, T, HV] floating point.
        scale: None or a finite real number.
        initial_state: None or [N, HV, K, V] floating point.
        output_final_state: bool.
        cu_seqlens: None or a 1-D int32/int64 tensor [N + 1]; requires B == 1.
        check_values: also read the tensors and check their values (host syncs on GPU): the
            offsets of `cu_seqlens`, g <= 0 and not NaN (-inf allowed), beta in [0, 1], q, k, v,
            beta and initial_state finite. The values of CPU tensors are always checked (that
            costs no sync); nothing is read while torch.compile or torch.export traces.

    Returns:
        GDNDims(B, T, H, HV, K, V, N).

    Raises:
        TypeError: an argument is not a tensor, or has a non-floating dtype (integer dtype for
            cu_seqlens), or q, k, v dtypes differ, or scale is not a real number.
        ValueError: wrong ranks, mismatched shapes, HV % H != 0, empty head dims, tensors on
            different devices, cu_seqlens with B != 1 / not starting at 0 / decreasing / not ending
            at T, initial_state of the wrong shape, and (check_values or CPU tensors) positive or
            NaN g, beta outside [0, 1], a NaN or infinite entry of q, k, v, beta or initial_state;
            a value check asked of a meta tensor (it holds no values).
    """
    q = _tensor("q", q, 4, "[B, T, H, K]")
    k = _tensor("k", k, 4, "[B, T, H, K]")
    v = _tensor("v", v, 4, "[B, T, HV, V]")
    g = _tensor("g", g, 3, "[B, T, HV]")
    beta = _tensor("beta", beta, 3, "[B, T, HV]")
    B, T, H, K = q.shape
    if k.shape != q.shape:
        raise ValueError(f"q and k must have the same shape [B, T, H, K]: q {tuple(q.shape)}, k {tuple(k.shape)}")
    if v.shape[:2] != q.shape[:2]:
        raise ValueError(f"v must be [B, T, HV, V] with B, T = {tuple(q.shape[:2])} as in q, got {tuple(v.shape)}")
    HV, V = v.shape[2], v.shape[3]
    if min(H, K, HV, V) == 0:
        raise ValueError(f"head counts and head dims must be positive: H={H}, K={K}, HV={HV}, V={V}")
    if HV % H != 0:
        raise ValueError(
            f"the value-head count HV = {HV} (v.shape[2]) must be a multiple of the q/k head count H = {H} (q.shape[2])"
        )
    if g.shape != (B, T, HV):
        raise ValueError(f"g must be [B, T, HV] = {(B, T, HV)}, got {tuple(g.shape)}")
    if beta.shape != (B, T, HV):
        raise ValueError(f"beta must be [B, T, HV] = {(B, T, HV)}, got {tuple(beta.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"q, k and v must share one dtype, got q {q.dtype}, k {k.dtype}, v {v.dtype}")
    # the kind of object first: a numpy array has a `device` too ("cpu"), which is no torch.device
    if initial_state is not None:
        _tensor("initial_state", initial_state, 4, "[N, HV, K, V]")
    if cu_seqlens is not None and not isinstance(cu_seqlens, torch.Tensor):
        raise TypeError(f"cu_seqlens must be None or an int32/int64 tensor [N + 1], got {type(cu_seqlens).__name__}")
    devices = {name: x.device for name, x in (("q", q), ("k", k), ("v", v), ("g", g), ("beta", beta))}
    if initial_state is not None:
        devices["initial_state"] = initial_state.device
    if cu_seqlens is not None:
        devices["cu_seqlens"] = cu_seqlens.device
    for name, dev in devices.items():
        if dev != q.device:
            raise ValueError(f"{name} is on {dev} but q is on {q.device}: all tensors must be on one device")

    if scale is not None:
        if isinstance(scale, bool) or not isinstance(scale, numbers.Real):
            raise TypeError(f"scale must be None or a real number, got {type(scale).__name__}")
        try:
            fscale = float(scale)
        except OverflowError:
            raise ValueError(f"scale must be finite, got an {type(scale).__name__} beyond the float range") from None
        if not math.isfinite(fscale):
            raise ValueError(f"scale must be finite, got {scale}")
    if not isinstance(output_final_state, bool):
        raise TypeError(f"output_final_state must be a bool, got {type(output_final_state).__name__}")

    N = B
    if cu_seqlens is not None:
        if not isinstance(cu_seqlens, torch.Tensor):
            raise TypeError(f"cu_seqlens must be None or an int32/int64 tensor [N + 1], got {type(cu_seqlens).__name__}")
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries [N + 1], got shape {tuple(cu_seqlens.shape)}")
        if B != 1:
            raise ValueError(f"cu_seqlens (packed variable-length input) requires B == 1, got B = {B}")
        N = cu_seqlens.numel() - 1
        if _read_values(check_values, cu_seqlens):
            check_cu_seqlens_values(cu_seqlens, T)

    if initial_state is not None:
        if tuple(initial_state.shape) != (N, HV, K, V):
            raise ValueError(
                f"initial_state must be [N, HV, K, V] = {(N, HV, K, V)} (N = number of sequences), "
                f"got {tuple(initial_state.shape)}"
            )
    if _read_values(check_values, g):
        check_gate_values(g)
    if _read_values(check_values, q):
        check_input_values(q, k, v, beta, initial_state)
    return GDNDims(B=B, T=T, H=H, HV=HV, K=K, V=V, N=N)


# ------------------------------------------------------------------------------------------------
# the fast path (the sm_90 kernels)
# ------------------------------------------------------------------------------------------------

#: Chunk length (tokens) of the fast path.
CHUNK = 64

#: What the fast path supports; anything else raises before any device work (`check_supported`).
SUPPORTED = {
    "qkv_dtypes": (torch.bfloat16, torch.float16),
    "g_dtype": torch.float32,
    "state_dtype": torch.float32,
    "K": 128,
    "V": 128,
    "chunk_size": CHUNK,
    "compute_capability": (9, 0),
}


def check_supported(q, k, v, g, beta, initial_state) -> None:
    """Fast-path checks that need no device work (dtypes and head dims); raises TypeError/ValueError
    naming the argument. The CPU path is `reference.chunk_gated_delta_rule` (any float dtype and size)."""
    if q.dtype not in SUPPORTED["qkv_dtypes"]:
        raise TypeError(f"chunk_gated_delta_rule supports q, k, v in bfloat16 or float16, got {q.dtype} "
                        "(flashqla.reference.chunk_gated_delta_rule takes any floating dtype, fp64 included)")
    if g.dtype != torch.float32:
        raise TypeError(f"chunk_gated_delta_rule supports g in float32 (natural-log decay), got {g.dtype}")
    if beta.dtype not in (torch.float32, q.dtype):
        raise TypeError(f"chunk_gated_delta_rule supports beta in float32 or q's dtype ({q.dtype}), got {beta.dtype}")
    K, V = q.shape[-1], v.shape[-1]
    if K != SUPPORTED["K"] or V != SUPPORTED["V"]:
        raise ValueError(f"chunk_gated_delta_rule supports head dims K = V = 128 (chunk size 64), got K = {K}, V = {V} "
                         "(flashqla.reference.chunk_gated_delta_rule takes any head dims)")
    if initial_state is not None and initial_state.dtype != torch.float32:
        raise TypeError(f"chunk_gated_delta_rule supports initial_state in float32, got {initial_state.dtype}")


def check_device(q) -> None:
    """RuntimeError unless q is on a CUDA device of compute capability 9.0 (H100/H200)."""
    if q.device.type != "cuda":
        raise RuntimeError(f"chunk_gated_delta_rule runs on a CUDA device of compute capability 9.0 (Hopper); the "
                           f"inputs are on {q.device}. On the CPU use flashqla.reference.chunk_gated_delta_rule (`reference` in a "
                           "checkout; FLA's signature and the serving arguments, any dtype, fp64 included)")
    cap = torch.cuda.get_device_capability(q.device)
    if tuple(cap) != SUPPORTED["compute_capability"]:
        raise RuntimeError(
            f"chunk_gated_delta_rule needs compute capability 9.0 (H100/H200, sm_90a kernels); {q.device} has {cap[0]}.{cap[1]}"
        )


#: Epsilon of the in-kernel L2 normalisation of q and k (`l2norm`).
L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor) -> torch.Tensor:
    """x * rsqrt(sum(x^2, -1) + L2NORM_EPS) in at least fp32, rounded back to x's dtype
    (differentiable torch ops: autograd carries the gradient through it)."""
    xf = x.to(torch.promote_types(x.dtype, torch.float32))
    return (xf * torch.rsqrt((xf * xf).sum(-1, keepdim=True) + L2NORM_EPS)).to(x.dtype)


class ChunkGDNForward(NamedTuple):
    """What the forward produces and a backward will consume.

    o: [B, T, HV, V] in q's dtype.
    final_state: [N, HV, K, V] fp32, or None.
    A: [HV, S * 64, 64] in q's dtype (fp16 for bf16 q from a forward without gradients,
        `flashqla.ops.gdn.fwd.product_dtype`; the backward refuses that one): per chunk slot, A diag(beta) with A FLA's gated WY inverse
        (I + strictly_lower(diag(beta) (K K^T) * Gamma))^-1 (slot layout: `kernels.sm90._common`).
    g_cum_log2: [HV, S * 64] fp32: chunk-local inclusive cumsum of g in base-2 units (g_cum / ln 2).
        A and g_cum_log2 are None when `chunk_gated_delta_rule_fwd(for_backward=False)` split the
        sequences (context parallelism keeps them in the segments' layout, useless to a backward),
        and when cp_saved is set (they travel in it, `CPSaved.A`, `.g_cum_log2`, in the segments'
        slot layout, which the split backward reads as they are).
    q, k: the q and k the kernels used (L2-normalised when use_qk_l2norm_in_kernel).
    cp_saved: None, or a split forward's `flashqla.cp.saved.CPSaved` (entering states, transitions,
        U rows, A and g_cum_log2 of its segments; `chunk_gated_delta_rule_fwd(keep_cp_states=True)`),
        which `chunk_gated_delta_rule_bwd(A, g_cum_log2, cp_saved=...)` uses instead of recomputing
        (pass A and g_cum_log2 as they are here: None).
    """

    o: torch.Tensor
    final_state: torch.Tensor | None
    A: torch.Tensor | None
    g_cum_log2: torch.Tensor | None
    q: torch.Tensor
    k: torch.Tensor
    cp_saved: object = None


def check_backend(backend, needs: tuple = ("prepare", "recurrent", "zeros")):
    """Raises TypeError naming `backend` unless it is None (the sm_90 kernels) or an object with the
    methods `needs` of `flashqla.ops.gdn.backend.Backend` (e.g. `reference.gdn.cp.ReferenceCPBackend()`).
    A function such as `flashqla.reference.chunk_gated_delta_rule` is not a backend."""
    if backend is None:
        return
    if isinstance(backend, type):
        raise TypeError(f"backend must be a Backend instance, got the class {backend.__name__} (call it: {backend.__name__}())")
    missing = [m for m in needs if not callable(getattr(backend, m, None))]
    if missing:
        raise TypeError(f"backend must be None (the sm_90 kernels) or a flashqla.ops.gdn.backend.Backend with the "
                        f"methods {', '.join(needs)} (e.g. reference.gdn.cp.ReferenceCPBackend()); got a "
                        f"{' '.join([type(backend).__name__] + ([backend.__name__] if hasattr(backend, '__name__') else []))} "
                        f"without {', '.join(missing)}")


# ------------------------------------------------------------------------------------------------
# context parallelism: the user settings and the planning hints
# ------------------------------------------------------------------------------------------------

#: Environment variable with the default context-parallel mode of a call that passes cp=None.
CP_ENV = "FLASHQLA_CP"
#: The context-parallel modes: "auto" (the planner decides), "on" (always split), "off" (never).
CP_MODES = ("auto", "on", "off")


def cp_mode(cp, default: str = "auto") -> str:
    """The intra-device context-parallel mode of a call: "off" (never split), "auto" (the planner of
    `flashqla.cp` splits long sequences with few value heads; the backward has its own plan) or "on"
    (always split); True / False mean "on" / "off"; None reads $FLASHQLA_CP, else `default`. Raises
    ValueError naming `cp` (or the variable) for anything else."""
    mode = os.environ.get(CP_ENV, default) if cp is None else cp
    mode = {True: "on", False: "off"}.get(mode, mode) if isinstance(mode, bool) else mode
    if mode not in CP_MODES:
        raise ValueError(f"cp must be 'off', 'auto', 'on' or None (${CP_ENV}, default {default!r}), got {mode!r}")
    return mode


#: Environment variable: "1" makes every transition of a split call walk its whole segment (no
#: gate-driven cut) where the call does not say (`resolve_truncate`).
EXACT_ENV = "FLASHQLA_CP_EXACT"
#: The gate-driven cut of a split call's transitions: a transition stops at the chunk where the summed
#: log-decay from its segment's start falls below ln 2^-24 (records CP-4, CP-5).
TRUNCATE_LOG_DECAY = -24 * math.log(2.0)
_EXACT_ON = ("1", "true", "yes", "on")
_EXACT_OFF = ("", "0", "false", "no", "off")


def resolve_truncate(truncate) -> float | None:
    """The natural-log decay cutoff of a split call's transitions: None (exact: whole segments) or a
    negative finite float. truncate: None ($FLASHQLA_CP_EXACT: "1", "true", "yes" or "on" means
    exact; unset, "", "0", "false", "no" or "off" the default cut TRUNCATE_LOG_DECAY), False (exact),
    True (TRUNCATE_LOG_DECAY) or a negative finite real number (that cutoff, e.g. -10). Raises
    ValueError naming truncate (or FLASHQLA_CP_EXACT) for anything else."""
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


def check_seqlens(seqlens, N: int, T: int) -> tuple[int, ...]:
    """`seqlens` (any sequence of N ints >= 0 summing to T; numpy and torch integers too) as a tuple of
    Python ints. ValueError naming seqlens otherwise (bools and floats included)."""
    try:
        items = list(seqlens)
    except TypeError:
        raise ValueError(f"seqlens must be a sequence of N = {N} int lengths, got {type(seqlens).__name__}") from None
    out = []
    for n in items:
        if isinstance(n, (bool, float)) or getattr(n, "dtype", None) in (torch.bool,):
            raise ValueError(f"seqlens must hold ints, got {n!r}")
        try:
            out.append(operator.index(n))
        except TypeError:
            raise ValueError(f"seqlens must hold ints, got {n!r}") from None
    if len(out) != N or any(n < 0 for n in out) or sum(out) != T:
        shown = tuple(out) if len(out) <= 8 else str(tuple(out[:8]))[:-1] + ", ...)"
        raise ValueError(f"seqlens must be N = {N} int lengths >= 0 summing to T = {T}, got {shown}")
    return tuple(out)


def as_index(value) -> int | None:
    """value as a Python int when it is an integer (int, numpy or torch integers), else None (bools,
    floats such as 4096.0 or NaN, strings, None)."""
    if isinstance(value, bool):
        return None
    try:
        return operator.index(value)
    except TypeError:
        return None


def positive_int(value, name: str, multiple: int):
    """None, or value as a positive int multiple of `multiple` (numpy / torch integers too); ValueError
    naming `name` otherwise (bools, floats, strings)."""
    if value is None:
        return None
    out = as_index(value)
    if out is None or out <= 0 or out % multiple:
        raise ValueError(f"{name} must be None or a positive multiple of {multiple}, got {value!r}")
    return out

"""Shared pieces of the sm_90 kernels: compile target, pass configs, the compile counter, the base-2
gate scale, and the chunk-slot layout shared by the prepare and recurrent kernels.

Chunk slots. Both kernels address the chunks of all sequences through one flat "slot" index, so that
no host synchronisation is needed to count chunks:

- fixed length (no `cu_seqlens`): sequence n = batch row b, NT = ceil(T / 64) chunks each;
  slot(n, c) = n * NT + c; the slot count is B * NT.
- packed variable length (`cu_seqlens`, B == 1): slot(n, c) = floor(cu[n] / 64) + n + c. Sequence n
  needs ceil(len_n / 64) slots and floor(cu[n+1] / 64) - floor(cu[n] / 64) + 1 >= ceil(len_n / 64)
  are available before the next sequence starts, so the slots never collide, and the slot count
  floor(T / 64) + N is known from shapes alone. A slot maps back to (n, c) by a binary search over
  cu_seqlens inside the kernel (slot_base(n) is strictly increasing in n). Slots that fall in a gap
  (or on an empty sequence) do nothing and are never read.

Inside the kernels, `sequence_span` (one CTA per sequence: its token range and first slot) and
`locate_slot` (one CTA per slot: the binary search back to (n, c)) emit this bookkeeping.

Per-slot intermediates (`A`, `g_cum_log2`) are stored slot-major with all 64 rows written, rows past
the end of the sequence filled with values that make them inert (A rows 0, g_cum_log2 repeating the
last valid value), so the recurrent kernel can load whole 64-row tiles with TMA and mask nothing.
"""

from __future__ import annotations

import functools
import math
import os
import threading

import torch

__all__ = [
    "CHUNK",
    "SM_COUNT",
    "RCP_LN2",
    "to_log2_units",
    "sm90_target",
    "PASS_CONFIGS",
    "compile_count",
    "compile_kernel",
    "find_nvcc",
    "require_nvcc",
    "ptxas_report",
    "num_slots",
    "slot_index",
    "locate_slot",
    "sequence_span",
    "tl_dtype",
]

#: Chunk length (tokens) of the fast path.
CHUNK = 64

#: Number of streaming multiprocessors of the H200/H100 SXM (the grid-shape rules of the prepare
#: and recurrent kernels: `prepare.pick_heads_per_cta`, `recurrent.pick_block_v`).
SM_COUNT = 132

#: 1 / ln 2: multiplies a natural-log gate into base-2 units for exp2.
RCP_LN2 = 1.0 / math.log(2.0)


def to_log2_units(x):
    """Natural-log quantity -> base 2 (`x / ln 2`), so that `exp(x) == exp2(to_log2_units(x))`.

    The one place where the base changes: the prepare kernel applies the same constant `RCP_LN2`
    to the chunk-local cumsum of g it writes as `g_cum_log2`.
    """
    return x * RCP_LN2


def sm90_target() -> dict:
    """The compile target: Hopper with the architecture-specific features (wgmma, setmaxnreg)."""
    return {"kind": "cuda", "arch": "sm_90a"}


def _pass_configs():
    import tilelang

    return {tilelang.PassConfigKey.TL_ENABLE_FAST_MATH: True}


PASS_CONFIGS = None  # filled lazily (importing tilelang is slow; see compile_kernel)

_lock = threading.Lock()
_compiles = 0


def compile_count() -> int:
    """How many kernels this process has compiled so far (cache misses of the kernel builders).

    Tests use it to prove that new sequence lengths and sequence mixes reuse compiled kernels.
    """
    return _compiles


def find_nvcc() -> str | None:
    """The CUDA toolkit's nvcc that TileLang will compile with, or None: $CUDA_HOME/bin/nvcc (or
    $CUDA_PATH's), else `nvcc` on the PATH, else /usr/local/cuda/bin/nvcc (TileLang's own order,
    `tilelang.env`; read at each call)."""
    import shutil

    for var in ("CUDA_HOME", "CUDA_PATH"):
        home = os.environ.get(var)
        if home:
            path = os.path.join(home, "bin", "nvcc")
            return path if os.path.isfile(path) else None
    path = shutil.which("nvcc")
    if path:
        return path
    path = "/usr/local/cuda/bin/nvcc"
    return path if os.path.isfile(path) else None


_nvcc_found = False


def require_nvcc() -> None:
    """Raises RuntimeError at once, saying what to install, when `find_nvcc` finds no nvcc (TileLang
    would fail only after minutes of lowering, with a raw "No such file or directory"). Passes
    without a look once an nvcc has been found in this process."""
    global _nvcc_found
    if _nvcc_found:
        return
    if find_nvcc() is None:
        where = next((f"${v} = {os.environ[v]!r} has no bin/nvcc" for v in ("CUDA_HOME", "CUDA_PATH") if os.environ.get(v)),
                     "no nvcc on the PATH, no $CUDA_HOME, no /usr/local/cuda")
        raise RuntimeError(
            f"flashqla compiles its sm_90 kernels with TileLang, which needs the CUDA toolkit's nvcc (12.8 or newer), "
            f"and none was found ({where}). Install the CUDA toolkit (e.g. the cuda-toolkit-12-8 package, or "
            "`pip install nvidia-cuda-nvcc` >= 13) and put its bin/ on the PATH or set CUDA_HOME to its root.")
    _nvcc_found = True


def compile_kernel(prim_func, name: str):
    """Compiles a TileLang PrimFunc for sm_90a and counts the compile; `name` (the build's key, e.g.
    "gdn_prepare_fwd_H2_HV4_...") is added to the note of an error the compile raises. Raises
    RuntimeError before any TileLang work when no nvcc is found (`require_nvcc`)."""
    global _compiles
    require_nvcc()
    import tilelang

    try:
        kernel = tilelang.compile(prim_func, target=sm90_target(), pass_configs=_pass_configs(), out_idx=None)
    except Exception as exc:
        exc.add_note(f"while compiling {name} for sm_90a (TileLang + nvcc)")
        raise
    with _lock:
        _compiles += 1
    return kernel


def ptxas_report(kernel) -> dict:
    """Resource usage of a compiled kernel as ptxas reports it (CPU only, needs nvcc on PATH).

    Compiles the kernel's generated CUDA source again for sm_90a with TileLang's include paths and
    `--ptxas-options=--verbose`, and reads the dynamic shared-memory size from the launch in the host
    source. Returns {"registers", "spill_stores", "spill_loads", "stack", "static_smem",
    "dynamic_smem"} (bytes, except registers; dynamic_smem None when it cannot be read).
    """
    import re
    import subprocess
    import tempfile

    from tilelang import env

    src = kernel.get_kernel_source()
    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cu")
        with open(path, "w") as f:
            f.write(src)
        cmd = ["nvcc", "-std=c++20", f"-I{env.TILELANG_TEMPLATE_PATH}", f"-I{env.CUTLASS_INCLUDE_DIR}", "--use_fast_math",
               "-gencode", "arch=compute_90a,code=sm_90a", "-cubin", "-o", os.path.join(d, "k.cubin"),
               "--ptxas-options=--verbose", "-w", path]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    text = out.stdout + out.stderr

    def num(pattern, default=0):
        m = re.search(pattern, text)
        return int(m.group(1)) if m else default

    dyn = None
    host = kernel.get_host_source()
    call = host.rfind("_kernel_packed, (TVMFFIAny*)")
    if call > 0:
        vals = re.findall(r"v_int64\) = \(\(int64_t\)(\d+)\);", host[:call])
        dyn = int(vals[-1]) if vals else None
    return {
        "registers": num(r"Used (\d+) registers"),
        "spill_stores": num(r"(\d+) bytes spill stores"),
        "spill_loads": num(r"(\d+) bytes spill loads"),
        "stack": num(r"(\d+) bytes stack frame"),
        "static_smem": num(r"(\d+) bytes smem"),
        "dynamic_smem": dyn,
    }


_placeholders: dict = {}


def placeholder(shape, dtype: torch.dtype, device) -> torch.Tensor:
    """A cached tensor for a kernel argument the launch never reads or writes (an absent initial
    state, final state or cu_seqlens): one allocation per (shape, dtype, device)."""
    key = (tuple(shape), dtype, str(device))
    if key not in _placeholders:
        _placeholders[key] = torch.empty(shape, dtype=dtype, device=device)
    return _placeholders[key]


def dummy_cu_seqlens(device) -> torch.Tensor:
    """A 1-element int32 placeholder for the cu_seqlens argument of fixed-length launches."""
    return placeholder((1,), torch.int32, device)


def order_args(order, device) -> tuple:
    """The (order, use_order) kernel arguments for `launch_order`'s result (None: a placeholder, 0)."""
    if order is None:
        return placeholder((1,), torch.int32, device), 0
    return order, 1


@functools.cache
def _capability(index: int) -> tuple:
    return torch.cuda.get_device_capability(index)


def on_sm90(t: torch.Tensor) -> bool:
    """Whether tensor `t` lives on a CUDA device of compute capability 9.0, the target these kernels
    are built for (the capability is read once per device)."""
    if t.device.type != "cuda":
        return False
    index = t.device.index if t.device.index is not None else torch.cuda.current_device()
    return _capability(index) == (9, 0)


def tl_dtype(dtype: torch.dtype) -> str:
    """TileLang dtype name of a torch dtype."""
    names = {
        torch.bfloat16: "bfloat16",
        torch.float16: "float16",
        torch.float32: "float32",
        torch.int32: "int32",
        torch.int64: "int64",
    }
    if dtype not in names:
        raise TypeError(f"no kernel dtype for {dtype}")
    return names[dtype]


def num_slots(B: int, T: int, N: int, varlen: bool) -> int:
    """Number of chunk slots (see the module docstring): B * ceil(T / 64), or floor(T / 64) + N."""
    if varlen:
        return T // CHUNK + N
    return B * ((T + CHUNK - 1) // CHUNK)


def slot_index(n: int, c: int, T: int, cu_seqlens_host=None) -> int:
    """Slot of chunk c of sequence n (host-side helper for tests and tools; reads cu_seqlens)."""
    if cu_seqlens_host is None:
        return n * ((T + CHUNK - 1) // CHUNK) + c
    return int(cu_seqlens_host[n]) // CHUNK + n + c


# --------------------------------------------------------------------------------------------
# chunk-slot bookkeeping emitted inside kernels (called while a kernel body is traced)
# --------------------------------------------------------------------------------------------


def _int32_vars(*names):
    """One `T.alloc_var("int32")` per name, named as `name = T.alloc_var("int32")` in a kernel body
    names it. The macros below take these as arguments and assign them: a T.macro returns a scalar
    variable's current value, not the variable. Expressions (`n`, `slot`) and tensors reach the macros
    through the closure instead, since binding a macro argument renames a TIR variable after the
    parameter."""
    import tilelang.language as T
    from tvm.script.ir_builder import IRBuilder

    out = []
    for name in names:
        var = T.alloc_var("int32")
        IRBuilder.name(name, var)
        out.append(var)
    return out


def sequence_span(n, cu_seqlens, Tn, varlen: bool):
    """Token range and first slot of sequence `n`, for kernels with one CTA per sequence.

    Call inside a kernel body (`with T.Kernel(...)`): `bos, seqlen, bidx, slot0, nchunks =
    sequence_span(n, cu_seqlens, Tn, varlen)`, `Tn` being the dynamic T dimension. Returns the int32
    variables bos (first token in the batch row), seqlen, bidx (batch row) and slot0 (slot of chunk
    0, see the module docstring), and nchunks = ceil(seqlen / 64).
    """
    import tilelang.language as T

    C = CHUNK
    bos, seqlen, bidx, slot0 = _int32_vars("bos", "seqlen", "bidx", "slot0")

    @T.macro
    def span(bos, seqlen, bidx, slot0):
        if varlen:
            bos = T.cast(cu_seqlens[n], "int32")
            seqlen = T.cast(cu_seqlens[n + 1], "int32") - bos
            bidx = 0
            slot0 = bos // C + n
        else:
            bos = 0
            seqlen = Tn
            bidx = n
            slot0 = n * T.ceildiv(Tn, C)
        nchunks = T.ceildiv(seqlen, C)
        return nchunks

    nchunks = span(bos, seqlen, bidx, slot0)
    return bos, seqlen, bidx, slot0, nchunks


def locate_slot(slot, cu_seqlens, Tn, Np1, varlen: bool, cu_s=None, threads: int = 0):
    """Sequence and chunk of chunk slot `slot`, for kernels with one CTA per slot.

    Call inside a kernel body: `seq, chunk, bos, seqlen, bidx, nvalid, t0 = locate_slot(slot,
    cu_seqlens, Tn, Np1, varlen)`, `Tn` and `Np1` being the dynamic T and len(cu_seqlens)
    dimensions. Packed input: a binary search over cu_seqlens for the largest n in [0, N) with
    floor(cu[n] / 64) + n <= slot (32 halvings, any N < 2^31). Returns the int32 variables seq,
    chunk, bos, seqlen, bidx (as in `sequence_span`) and nvalid = min(seqlen - 64 chunk, 64) (<= 0 for
    a slot in a gap), t0 = bos + 64 chunk.

    cu_s (packed input; a shared int32 buffer of `threads` entries, `threads` the CTA's thread count):
    where len(cu_seqlens) <= threads, every thread loads one offset into cu_s and the CTA counts the
    n with floor(cu[n] / 64) + n <= slot in one barrier (`__syncthreads_count`; that count is
    monotone in n), then reads bos and seqlen from cu_s: one global round trip instead of the search's
    log2(N) + 2. Up to N = (threads - 1) threads sequences, two such rounds (every ceil(N / threads)-th
    offset counted first, then the offsets after the last one counted). Every thread of the CTA must
    call it (the barriers). Longer cu_seqlens: the search.
    """
    import tilelang.language as T

    C = CHUNK
    seq, chunk, bos, seqlen, bidx, lo, hi, mid = _int32_vars("seq", "chunk", "bos", "seqlen", "bidx", "lo", "hi", "mid")

    @T.macro
    def locate(seq, chunk, bos, seqlen, bidx, lo, hi, mid):
        if varlen:
            counted = cu_s is not None  # static: the counting barrier while len(cu_seqlens) <= threads
            if (Np1 <= threads) if counted else False:
                tx = T.get_thread_binding()
                if tx < Np1:
                    cu_s[tx] = T.cast(cu_seqlens[tx], "int32")
                # n in [0, N) with floor(cu[n] / 64) + n <= slot: n = 0 always, so seq = count - 1
                seq = T.call_extern("int32", "__syncthreads_count",
                                    T.cast((tx < Np1 - 1) & (T.if_then_else(tx < Np1, cu_s[T.min(tx, threads - 1)], 0) // C + tx <= slot), "int32")) - 1
                bos = cu_s[seq]
                seqlen = cu_s[seq + 1] - bos
            elif (Np1 - 1 <= (threads - 1) * threads) if counted else False:
                # two rounds: every stride-th offset counted, then the stride offsets after the last one
                tx = T.get_thread_binding()
                stride = T.ceildiv(Np1 - 1, threads)
                n1 = tx * stride
                lo = (T.call_extern("int32", "__syncthreads_count",
                                    T.cast((n1 < Np1 - 1) & (T.if_then_else(n1 < Np1 - 1, T.cast(cu_seqlens[T.min(n1, Np1 - 1)], "int32"), 0) // C + n1 <= slot),
                                           "int32")) - 1) * stride
                if (tx <= stride) & (lo + tx < Np1):
                    cu_s[tx] = T.cast(cu_seqlens[lo + tx], "int32")
                seq = lo + T.call_extern("int32", "__syncthreads_count",
                                         T.cast((tx < stride) & (lo + tx < Np1 - 1)
                                                & (T.if_then_else(tx < stride, cu_s[T.min(tx, threads - 1)], 0) // C + lo + tx <= slot), "int32")) - 1
                bos = cu_s[seq - lo]
                seqlen = cu_s[seq - lo + 1] - bos
            else:
                # largest n in [0, N) with floor(cu[n] / 64) + n <= slot
                lo = 0
                hi = Np1 - 1
                for _ in T.serial(32):
                    if hi - lo > 1:
                        mid = (lo + hi) // 2
                        if T.cast(cu_seqlens[mid], "int32") // C + mid <= slot:
                            lo = mid
                        else:
                            hi = mid
                seq = lo
                if not counted:  # bidx = 0 on both paths; set where each path's generated code has it
                    bidx = 0
                bos = T.cast(cu_seqlens[seq], "int32")
                seqlen = T.cast(cu_seqlens[seq + 1], "int32") - bos
            if counted:
                bidx = 0
            chunk = slot - (bos // C + seq)
        else:
            seq = slot // T.ceildiv(Tn, C)
            chunk = slot % T.ceildiv(Tn, C)
            bidx = seq
            bos = 0
            seqlen = Tn
        nvalid = T.min(seqlen - chunk * C, C)
        t0 = bos + chunk * C
        return nvalid, t0

    nvalid, t0 = locate(seq, chunk, bos, seqlen, bidx, lo, hi, mid)
    return seq, chunk, bos, seqlen, bidx, nvalid, t0


# --------------------------------------------------------------------------------------------
# the backward's pass-1 and pass-2 launches
# --------------------------------------------------------------------------------------------


def launch_states(build, k, v, A, g_cum_log2, initial_state, cu_seqlens, h_dtype: torch.dtype, order=None):
    """Launches the backward's pass-1 kernel (`states_bwd`): h [S * HV, K, V] in h_dtype (q's),
    allocated uninitialised (rows of unused slots are not written). build() returns the
    compiled kernel; the other arguments as `states_bwd.chunk_states_bwd`."""
    B, T, H, K = k.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    S = num_slots(B, T, N, varlen)
    h = torch.empty(S * HV, K, V, dtype=h_dtype, device=k.device)
    if S == 0 or T == 0 or N == 0:
        return h
    h0 = initial_state if initial_state is not None else torch.empty(1, HV, K, V, dtype=torch.float32, device=k.device)
    cu = cu_seqlens if varlen else dummy_cu_seqlens(k.device)
    build()(k, v, A, g_cum_log2, h0, cu, *order_args(order, k.device), int(initial_state is not None), h)
    return h


def launch_pass2(build, q, k, v, beta, A, g_cum_log2, h, do, dht, scale: float, cu_seqlens, order=None):
    """Launches the backward's pass-2 kernel (`chunk_bwd`), whose CTAs write every row of their
    outputs: dq_hv, dk_hv (fp32), dv, dbeta and dh0 allocated uninitialised, dG zeroed; with no CTA to
    run (no slot, token or sequence), zeros and dh0 = dht. build() returns the compiled kernel.
    Arguments and results as `chunk_bwd.chunk_fused_bwd`; order: `launch_order.launch_order`'s
    result, or None for token order (the kernel's launch-order arguments)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    varlen = cu_seqlens is not None
    N = cu_seqlens.numel() - 1 if varlen else B
    S = num_slots(B, T, N, varlen)
    dev = q.device
    dq_hv = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    dk_hv = torch.empty(B, T, HV, K, dtype=torch.float32, device=dev)
    dv = torch.empty_like(v)
    dbeta = torch.empty(B, T, HV, dtype=torch.float32, device=dev)
    dG = torch.zeros(HV, S * CHUNK, dtype=torch.float32, device=dev)
    dh0 = torch.empty(N, HV, K, V, dtype=torch.float32, device=dev)
    if S == 0 or T == 0 or N == 0:  # no CTA would run: nothing but zeros (and dht) to return
        for x in (dq_hv, dk_hv, dv, dbeta, dh0):
            x.zero_()
        if dht is not None:
            dh0.copy_(dht)
        return dq_hv, dk_hv, dv, dbeta, dG, dh0
    dht_arg = dht if dht is not None else torch.empty(1, HV, K, V, dtype=torch.float32, device=dev)
    cu = cu_seqlens if varlen else dummy_cu_seqlens(dev)
    build()(q, k, v, beta, A, g_cum_log2, h, do, dht_arg, cu, *order_args(order, dev), float(scale), int(dht is not None),
            dq_hv, dk_hv, dv, dbeta, dG, dh0)
    return dq_hv, dk_hv, dv, dbeta, dG, dh0

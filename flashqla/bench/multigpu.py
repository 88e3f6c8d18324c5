"""`python -m flashqla.bench --multigpu`: context parallelism across GPUs, strong and weak scaling of
the forward and the training step at 1 to 8 GPUs, ours (`flashqla.distributed`) beside FLA 0.6.0's
KCP and FlashQLA 0.1.3's CP in the same processes.

Status: not yet run on a multi-GPU machine. Everything that needs GPUs (the timings, the memory, the
peers' calls, NCCL) is written from reading the code and has never run; what has run is the CPU path
(gloo, fp64, our op on the reference backend, the gate, the row assembly, the CSV and the page) in
`tests/test_bench_multigpu.py`.

Rows. A configuration "H/HV 1xT" is one sequence of T tokens with H q/k heads and HV value heads,
K = V = 128. For each selected world size W (`--gpus`, default 1,2,4,8; values above
`torch.cuda.device_count()` are skipped with a note):
    strong scaling   the configuration's T split evenly over W ranks (T / W tokens each);
    weak scaling     T / max(--gpus) tokens per rank, so T = W x that (the largest W's row is the
                     strong-scaling row of the same T).
A row is (impl, H/HV, T, W); a row both scalings select is measured once. W = 1 is each
implementation's single-GPU op (ours `flashqla.chunk_gated_delta_rule(cp=--cp)`, FLA's and
FlashQLA's public `chunk_gated_delta_rule` without a CP context); W > 1 is its cross-GPU CP.

Processes. One `torch.multiprocessing.spawn` of W workers per world size, NCCL, file:// rendezvous
in a temporary folder; NCCL_NVLS_ENABLE=0, TORCH_SYMM_MEM_DISABLE_MULTICAST=1 and
NVSHMEM_DISABLE_NVLS=1 are put into os.environ before spawning where unset (NVLink multicast stays
off). Our kernels are built once in the parent first (`precompile`; TileLang's disk cache serves the
ranks; kernels only the CP op uses are built by the ranks at their first call). Each rank draws its
own shard of the global inputs (block-seeded, so that every rank's shard is the same slice of one
global sequence whatever W is, and no rank holds the whole sequence): bf16 q, k L2-normalised, v and
do ~ N(0, 1), fp32 g = logsigmoid(N(0, 1)) / 16 with value head 0 at g == 0 (the state crosses every
rank boundary undecayed), fp32 beta = sigmoid(N(0, 1)).

Gate (per implementation, heads and W, before any timing): on `--gate-tokens` x W tokens of the same
heads every rank runs the implementation on its shard with autograd (forward, then backward with a
fixed do; inputs drawn as below, seeded apart from the timed rows) and compares its o shard, its
gradients dq, dk, dv, dg, dbeta and, where the implementation returns one of the global size, the
final state (on the rank holding the last token) with its slice of the global fp64 result, which
every rank computes itself (`gate.fp64_result`:
`reference.chunk_gated_delta_rule` in fp64 with its hand-written backward, equal to the token
recurrence `reference.recurrent_gated_delta_rule` and to autograd through it to 1e-12, which
tests/test_bench.py checks; the token recurrence itself under autograd would keep one [HV, K, V]
fp64 state per token, tens of GB at this size). Tolerances, relative RMS: o, the final state and
every gradient 1e-2, dg 3e-2 (`--tol` changes the 1e-2). The per-rank errors are all-gathered; the
row keeps the largest per quantity. An implementation that fails is recorded "gate failed" with its
errors and not timed. Ours is gated with its intra-device split forced (cp "on": `KernelBackend(cp="on")`,
or `flashqla.chunk_gated_delta_rule(cp="on")` at W = 1) unless `--cp` is "off", so that the small
instance takes the split path the long rows take (at the gate's size "auto" may not split). FlashQLA
is gated twice on the same instance, with its defaults and with its intra-card split forced
(`force_intra_cp=True`), the larger error per quantity kept: a timed row takes whichever path its
auto_cp picks, and at the gate's size that may not be the long rows' one.

Timing (per row, every rank; wall clock around synchronised launches, not CUDA graphs: the ops run
collectives and host-side checks): `--warmup` untimed calls, then `--iters` iterations, each after
a barrier; per iteration the slowest rank's time (all-reduce MAX), then the median:
    fwd        the forward under torch.no_grad();
    step       forward + backward with a fixed do (output_final_state=False: FLA's CP returns none);
    bwd        step - fwd;
    tokens/s   T / step (and T / fwd);
    peak       torch.cuda.max_memory_allocated after the timed calls (shard inputs, do, gradients
               included), the largest over the ranks, GiB;
    all-gather bytes   sent per rank per step, forward and backward. Ours:
               `flashqla.distributed.exchange_bytes` (HV K (K + V) and HV K V fp32). The peers' from
               reading their sources: FLA `fla/ops/cp/chunk_delta_h.py` gathers [HV, K, V + K] fp32
               in the forward and again in the backward; FlashQLA
               `flash_qla/ops/gated_delta_rule/chunk/cp/preprocess.py` gathers a packed (h [HV, K, V],
               M [HV, K, K]) fp32 buffer in each;
    all-gather ms      the same all-gathers alone, on buffers of those sizes (ours: the op's own
               `_all_gather`; the peers': `torch.distributed.all_gather_into_tensor`, the call their
               comm helpers make), median of `--comm-iters`;
    overlap    ours only: the forward and the step again with the op's two state all-gathers
               replaced by a local copy (`flashqla.distributed.op._all_gather` patched for the
               duration; the op's fingerprint all-gather and backward check-in stay), "local fwd /
               step". The op issues each collective without async_op and uses its result at once
               (no side stream, no work queued beside it), and so, in the code read, do both
               peers: nothing overlaps communication with local work by construction. op - local
               is what the two all-gathers and the wait for the slowest rank at them add.
Speed-up (strong) = the same implementation's W = 1 time at the same T over this row's; parallel
efficiency = speed-up / W. Weak: throughput over W = 1's at the same T per rank, efficiency = W =
1's step time over this row's. They are computed by the page from the CSV.

Failures. A peer that is not installed, or cannot run a row (T not a multiple of W, not CUDA, head
dims), is "n/a: <reason>" (its adapter raises ImportError / RuntimeError before any collective;
the ranks agree on it). A row whose inputs, outputs and gradients alone exceed a device's memory is
"out of memory" without running. An exception inside a call that makes collectives (the gate or the
timing; out of memory included) can leave the other ranks inside a collective, so that rank writes a
marker and exits; the spawn ends
the others, the parent records the row ("out of memory", or "error: ...") and respawns for the rest
(an error in a gate marks that implementation's remaining rows of the same heads and W); a failure
after every rank has finished its rows (teardown) marks no row.

Resuming. Rows go to `<results-dir>/<gpu>-multigpu.csv` one line each as measured (`store.append_row`),
keyed by the environment (GPU, driver, CUDA, torch, NCCL, triton, tilelang, fla, flash_qla), our
commit (with "+cp-<mode>" unless --cp off), W, the implementation, heads and T; a rerun with the same
key skips done rows ("error" rows are retried), `--force` re-measures, `--time-budget S` starts no
new row after S seconds. After every world size the page is rewritten from the CSV:
`<gpu>-multigpu.md` (environment, method, the targets met / not met / not measured with their
numbers, the strong- and weak-scaling tables with all-gather and memory columns, the gate) and
`<gpu>-multigpu.png` (training-step tokens/s against GPUs, log2 x axis, one line per implementation
and configuration, ideal scaling dashed for ours). `--report-only` rebuilds both from the CSV
without a GPU (into benchmarks/out unless --results-dir or --out-dir is given).

    python -m flashqla.bench --multigpu [--gpus 1,2,4,8] [--configs "16/64 1x4194304" ...]
        [--impls ours,fla,flash_qla] [--scaling strong|weak|both] [--time-budget S] [--results-dir DIR]
    python -m flashqla.bench --multigpu --list           # the selected rows (no GPU needed)
    python -m flashqla.bench --multigpu --report-only    # the page from the CSV (no GPU needed)

Targets (issue 47; the page says met / not met / not measured):
    - at 8 GPUs, ours' training step on 16/64 x 4,194,304 tokens >= 6x one GPU's throughput (one
      GPU's on the same T when it fits, else on the T per rank of the 8-GPU row, 524,288 tokens);
    - ours faster than both peers, forward and training step, on every row a peer runs.

The peers' calling patterns (read from their sources, confirmed on no GPU):
    FLA 0.6.0     ctx = `fla.ops.cp.build_cp_context(cu_seqlens_global, group=group)` (contiguous
                  layout: T a multiple of W; the rank's local offsets and neighbours), then
                  `fla.ops.gated_delta_rule.chunk_gated_delta_rule(q_r, k_r, v_r, g_r, beta_r,
                  cp_context=ctx)` with the rank's shard; no initial_state, no final state (it
                  asserts both away under CP).
    FlashQLA 0.1.3 ctx = `flash_qla.ops.gated_delta_rule.chunk.cp.build_cp_context(cu_seqlens_global,
                  enable_inter=True, enable_intra=True, group=group, num_v_heads=HV, chunk_size=64,
                  is_train=...)` (T a multiple of W; is_train must match the step, so a forward-only
                  and a training context; the gate's second instance adds force_intra_cp=True),
                  then `flash_qla.chunk_gated_delta_rule(q_r, ..., output_final_state=...,
                  cp_context=ctx)`; the last rank's final state is the sequence's. Its fused
                  backward gets TileLang's `tl.disable_buffer_init_check` (`impls.patch_flash_qla_bwd`).

Unverified (read from the code only; check on the first multi-GPU run):
    - a rank that raises (or hits a CUDA error) while the others wait in a collective: that the spawn
      ends within seconds (mp.spawn terminates the others once the failing rank has run
      destroy_process_group and exited), not after `Setup.pg_timeout_s` (600 s, a whole call);
    - a clean spawn's teardown (barrier, destroy_process_group) returns; a crash there is logged as
      "failed outside any row" and marks no row;
    - the ranks' first gate JIT-compiles the CP op's kernels in W processes at once into TileLang's
      disk cache: no corrupt cache entry, and no rank later than the op's 120 s backward check-in;
    - ours' backward check-in polls torch.distributed's default store, a FileStore here (file://
      rendezvous): its share of ours' step (one row again with backward_timeout=None to compare);
    - FlashQLA: whether its timed contexts split (`is_intra`) on each row; whether its inter+intra
      backward (`aggregate_card_state`, hopper/cp_fwd.py, not covered by `patch_flash_qla_bwd`)
      compiles without `tl.disable_buffer_init_check`; that its forced split passes the gate;
    - FLA: its backward's `chunk_bwd_dqkwg` raises on Hopper with Triton >= 3.4 and < 3.7.1 unless its
      TileLang `common` backend takes the call (`impls.fla_bwd_dispatch`): check which one ran;
    - the parent's CUDA context and precompiled kernels on GPU 0 beside rank 0 (its peak and OOM rows).
"""

from __future__ import annotations

import argparse
import contextlib
import datetime
import json
import math
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Callable

from flashqla.bench import store as S
from flashqla.bench.config import OUT_DIR, RESULTS_DIR
from flashqla.bench.gate import format_errs
from flashqla.bench.impls import COLORS, LABELS, gpu_slug

__all__ = [
    "IMPLS", "DEFAULT_GPUS", "DEFAULT_CONFIGS", "GATE_NAMES", "ENV_FIELDS", "KEY_FIELDS", "FIELDS", "NCCL_ENV",
    "Point", "Setup", "Job", "RankOp", "parse_config", "parse_gpus", "select_points", "usable_gpus", "row_key",
    "done_keys", "min_bytes_per_rank", "gate_tolerances", "gate_decision", "make_inputs", "ours_cp", "fla_kcp",
    "flash_qla_cp", "ADAPTERS", "run_rank", "assemble_row", "run", "latest_rows", "markdown", "targets",
    "plot_scaling", "write_page", "rebuild_page", "parse_args", "main",
]

#: The implementations, in table order.
IMPLS = ("ours", "fla", "flash_qla")
DEFAULT_GPUS = (1, 2, 4, 8)
#: The issue's head configurations and lengths, the target row first (a time budget measures it first).
DEFAULT_CONFIGS = tuple(f"{h} 1x{t}" for t in (4194304, 1048576, 16777216) for h in ("16/64", "16/32", "2/8"))
#: The target: 8 GPUs, 16/64 heads, 4,194,304 tokens, training step, >= 6x one GPU's throughput.
TARGET = dict(h_qk=16, h_v=64, T=4194304, world_size=8, ratio=6.0)
#: Quantities the gate compares, in report order.
GATE_NAMES = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta")
#: NCCL switches set before spawning where unset: NVLink multicast off.
NCCL_ENV = {"NCCL_NVLS_ENABLE": "0", "TORCH_SYMM_MEM_DISABLE_MULTICAST": "1", "NVSHMEM_DISABLE_NVLS": "1"}
#: The environment part of a row's key.
ENV_FIELDS = ("gpu", "driver", "cuda", "torch", "nccl", "triton", "tilelang", "fla", "flash_qla")
KEY_FIELDS = ENV_FIELDS + ("commit", "world_size", "impl", "h_qk", "h_v", "T")
FIELDS = KEY_FIELDS + (
    "tokens_per_rank", "scaling", "cp", "status", "gate", "gate_tokens", "gate_errs", "fwd_ms", "step_ms", "bwd_ms",
    "fwd_tok_s", "step_tok_s", "peak_gib", "ag_fwd_bytes", "ag_bwd_bytes", "ag_fwd_ms", "ag_bwd_ms", "local_fwd_ms",
    "local_step_ms", "iters", "warmup", "source", "date")
_BLOCK = 16384  # tokens per seeded block of input generation
_GIB = float(1 << 30)


# ---------------------------------------------------------------------------------------- rows


@dataclass(frozen=True)
class Point:
    """One measured configuration: heads, total tokens T, world size W, and which scaling selected it
    ("strong", "weak" or "strong+weak")."""

    h_qk: int
    h_v: int
    T: int
    world_size: int
    scaling: str = "strong"

    @property
    def tokens_per_rank(self) -> int:
        return self.T // self.world_size

    @property
    def label(self) -> str:
        return f"{self.h_qk}/{self.h_v} T={self.T:,} W={self.world_size}"


def parse_config(text: str) -> tuple[int, int, int]:
    """'H/HV 1xT' -> (H, HV, T). Raises ValueError for anything else (one sequence, HV a multiple of
    H, T > 0)."""
    try:
        heads, shape = text.split()
        H, HV = (int(x) for x in heads.split("/"))
        B, T = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise ValueError(f"configuration {text!r} is not 'H/HV 1xT'") from None
    if B != 1 or H <= 0 or HV % H or T <= 0:
        raise ValueError(f"configuration {text!r}: one sequence (1xT), HV a multiple of H, T > 0")
    return H, HV, T


def parse_gpus(text) -> tuple[int, ...]:
    """'1,2,4,8' (or a sequence of ints) -> sorted unique world sizes. ValueError for a value < 1."""
    vals = [int(x) for x in (text.split(",") if isinstance(text, str) else text) if str(x).strip()]
    if not vals or min(vals) < 1:
        raise ValueError(f"--gpus needs world sizes >= 1, got {text!r}")
    return tuple(sorted(set(vals)))


def select_points(configs, gpus, scaling: str = "both") -> list[Point]:
    """The points of the run, in order: per configuration (in the given order) its strong-scaling
    points (T fixed, W ascending), then its weak-scaling points (T / max(gpus) tokens per rank, W
    ascending); a point both select appears once, tagged "strong+weak". Raises ValueError for a
    bad configuration, a scaling other than strong / weak / both, or a T that does not divide
    evenly (every W for strong, max(gpus) for weak: the peers need equal shards)."""
    if scaling not in ("strong", "weak", "both"):
        raise ValueError(f"--scaling must be strong, weak or both, got {scaling!r}")
    gpus = parse_gpus(gpus)
    wmax = max(gpus)
    out: dict[tuple, Point] = {}
    for c in configs:
        H, HV, T = parse_config(c)
        pts = []
        if scaling in ("strong", "both"):
            bad = [W for W in gpus if T % W]
            if bad:
                raise ValueError(f"configuration {c!r}: T = {T} is not a multiple of W = {bad} (strong scaling)")
            pts += [(H, HV, T, W, "strong") for W in gpus]
        if scaling in ("weak", "both"):
            if T % wmax:
                raise ValueError(f"configuration {c!r}: T = {T} is not a multiple of the largest W = {wmax} (weak scaling)")
            pts += [(H, HV, W * (T // wmax), W, "weak") for W in gpus]
        for H_, HV_, T_, W, tag in pts:
            key = (H_, HV_, T_, W)
            if key in out and tag not in out[key].scaling:
                out[key] = replace(out[key], scaling=out[key].scaling + "+" + tag)
            elif key not in out:
                out[key] = Point(H_, HV_, T_, W, tag)
    return list(out.values())


def usable_gpus(gpus, available: int | None) -> tuple[tuple[int, ...], list[str]]:
    """(world sizes this machine can run, notes on the others): values above `available` devices
    are skipped (None: unknown, all kept)."""
    gpus = parse_gpus(gpus)
    if available is None:
        return gpus, []
    keep = tuple(W for W in gpus if W <= available)
    notes = [f"skipping {W} GPUs: this machine has {available} CUDA device(s)" for W in gpus if W > available]
    return keep, notes


def row_key(r: dict) -> tuple[str, ...]:
    """The resume key of a row (a CSV dict or a row being written): `KEY_FIELDS` as strings."""
    return tuple(str(r.get(f, "") if r.get(f) is not None else "") for f in KEY_FIELDS)


def _status_done(status: str) -> bool:
    s = str(status or "").strip()
    return s not in ("", S.DEFERRED) and not s.startswith("error")


def done_keys(rows: list[dict]) -> set[tuple[str, ...]]:
    """Keys of the rows already measured (the last line per key decides): every status but empty,
    "deferred" and "error: ..." (those are measured again)."""
    last = {}
    for r in rows:
        last[row_key(r)] = r
    return {k for k, r in last.items() if _status_done(r.get("status", ""))}


def min_bytes_per_rank(H: int, HV: int, tokens: int, K: int = 128, V: int = 128) -> int:
    """A lower bound on one rank's memory in a training step: its bf16 q, k, v, do, o and the bf16
    gradients dq, dk, dv, fp32 g, beta and their gradients (4 H K + 4 HV V bf16 and 4 HV fp32
    elements per token); the ops' own working memory comes on top."""
    return int(tokens) * (2 * (4 * H * K + 4 * HV * V) + 4 * 4 * HV)


def gate_tolerances(tol: float = 1e-2) -> dict[str, float]:
    """Relative-RMS tolerance per gated quantity: `tol` for all but dg, dg max(3e-2, 3 tol)."""
    return {n: (max(3e-2, 3 * tol) if n == "dg" else tol) for n in GATE_NAMES}


def gate_decision(errs: dict, tol: dict) -> tuple[bool, str]:
    """(passed, text): every quantity in `errs` within `tol` (no quantity: not passed); the text
    names the quantities over their tolerance."""
    if not errs:
        return False, "nothing compared"
    bad = [f"{n} {e:.1e} > {tol[n]:.0e}" for n, e in errs.items() if not e <= tol.get(n, 1e-2)]
    return not bad, ", ".join(bad)


# ---------------------------------------------------------------------------------------- inputs


def make_inputs(H: int, HV: int, lo: int, hi: int, *, device, dtype=None, K: int = 128, V: int = 128,
                seed: int = 0) -> dict:
    """Tokens [lo, hi) of one global sequence: q, k [1, hi - lo, H, K] L2-normalised, v and do
    [1, hi - lo, HV, V] ~ N(0, 1), all in `dtype` (default bf16); g [1, hi - lo, HV] =
    logsigmoid(N(0, 1)) / 16 with value head 0 at 0 and beta = sigmoid(N(0, 1)), in fp32 (fp64 when
    `dtype` is fp64). Drawn per global block of 16,384 tokens from a generator seeded by (seed,
    block), so a shard is the same slice of the global draw whoever draws it."""
    import torch
    import torch.nn.functional as F

    dtype = torch.bfloat16 if dtype is None else dtype
    gdt = torch.float64 if dtype == torch.float64 else torch.float32
    n = hi - lo
    x = dict(q=torch.empty(1, n, H, K, dtype=dtype, device=device), k=torch.empty(1, n, H, K, dtype=dtype, device=device),
             v=torch.empty(1, n, HV, V, dtype=dtype, device=device), g=torch.empty(1, n, HV, dtype=gdt, device=device),
             beta=torch.empty(1, n, HV, dtype=gdt, device=device), do=torch.empty(1, n, HV, V, dtype=dtype, device=device))
    for b in range(lo // _BLOCK, (hi + _BLOCK - 1) // _BLOCK):
        b0, b1 = b * _BLOCK, (b + 1) * _BLOCK
        gen = torch.Generator(device=device).manual_seed(int(seed) * 1_000_003 + b)

        def rnd(*shape):
            return torch.randn(*shape, generator=gen, device=device, dtype=gdt)

        blk = dict(q=F.normalize(rnd(1, _BLOCK, H, K), dim=-1), k=F.normalize(rnd(1, _BLOCK, H, K), dim=-1),
                   v=rnd(1, _BLOCK, HV, V), g=F.logsigmoid(rnd(1, _BLOCK, HV)) / 16, beta=torch.sigmoid(rnd(1, _BLOCK, HV)),
                   do=rnd(1, _BLOCK, HV, V))
        blk["g"][..., 0] = 0.0
        s, e = max(lo, b0), min(hi, b1)
        for name, t in blk.items():
            x[name][:, s - lo:e - lo] = t[:, s - b0:e - b0]
        del blk
    return x


# ---------------------------------------------------------------------------------------- adapters


@dataclass
class Setup:
    """How the ranks compute and time (the command line's flags; the CPU tests pass their own).

    device "cuda" (one GPU per rank) or "cpu"; dist_backend "nccl" or "gloo"; dtype of q, k, v, do
    ("bf16" or "fp64"; g and beta fp32, fp64 with fp64); head_dim K = V; cp: our intra-device mode
    ("off", "auto", "on"); ours_backend: None (the sm_90 kernels) or what `chunk_gated_delta_rule_cp`
    takes as backend= (e.g. the fp64 reference op on CPU, passed by the tests: this module never
    imports the reference); gate_tokens: tokens per rank of the gate; tol: the gate's tolerance;
    pg_timeout_s: the process group's timeout."""

    device: str = "cuda"
    dist_backend: str = "nccl"
    dtype: str = "bf16"
    head_dim: int = 128
    cp: str = "auto"
    iters: int = 5
    warmup: int = 2
    comm_iters: int = 20
    gate_tokens: int = 2048
    tol: float = 1e-2
    seed: int = 0
    ours_backend: object = None
    pg_timeout_s: float = 600.0

    def torch_dtype(self):
        import torch

        return {"bf16": torch.bfloat16, "fp64": torch.float64, "fp16": torch.float16}[self.dtype]


@dataclass
class RankOp:
    """One implementation on one rank for one T and W. `call(q, k, v, g, beta, output_final_state)
    -> (o [1, T_r, HV, V], final state or None)` on this rank's shard (autograd through it);
    `returns_final`: whether a final state comes back (on the rank holding the last token);
    `gathers`: the all-gathers of one training step, ((name, shape, dtype), ...) sent per rank
    ("fwd", "bwd"; none for W = 1); `gather`: how to time one of them alone (buffer -> None);
    `sent`: bytes sent per rank per gather where the implementation states them (ours:
    `exchange_bytes`; otherwise the buffers' sizes); `local`: a context manager factory running the
    op without its state all-gathers (ours only); `source`: the calls, for the page."""

    impl: str
    call: Callable
    source: str
    returns_final: bool = False
    gathers: tuple = ()
    sent: dict = field(default_factory=dict)
    gather: Callable | None = None
    local: Callable | None = None


def _cu(T: int, device):
    import torch

    return torch.tensor([0, T], dtype=torch.int32, device=device)


def _collective_gather(group, world_size: int) -> Callable:
    """All-gather of a flat buffer by `torch.distributed.all_gather_into_tensor` (the peers' call)."""

    def gather(buf):
        import torch.distributed as dist

        out = buf.new_empty((world_size * buf.numel(),))
        dist.all_gather_into_tensor(out, buf.reshape(-1), group=group)

    return gather


@contextlib.contextmanager
def _without_state_gathers():
    """Our op with its two state all-gathers replaced by a local copy of this rank's buffer, W times
    (the work around them unchanged; the values differ, which timing does not read)."""
    from flashqla.distributed import op as cp_op

    real = cp_op._all_gather

    def local(x, ctx):
        return x.unsqueeze(0).expand(ctx.world_size, *x.shape).contiguous()

    cp_op._all_gather = local
    try:
        yield
    finally:
        cp_op._all_gather = real


def ours_cp(H: int, HV: int, T: int, world_size: int, group, setup: Setup, *, cp: str | None = None) -> RankOp:
    """Ours on this rank. W = 1 with the kernels: `flashqla.chunk_gated_delta_rule(cp=mode)`; W > 1
    (or a given `setup.ours_backend`): `flashqla.distributed.chunk_gated_delta_rule_cp` with a
    prebuilt even-split context over `group` and `KernelBackend(cp=mode)` (or that backend). `cp`
    overrides `setup.cp`. Raises RuntimeError when the kernels cannot run here (not CUDA, not
    compute capability 9.0, head dims other than 128)."""
    import torch

    import flashqla
    from flashqla.distributed import KernelBackend, build_cp_context, chunk_gated_delta_rule_cp, exchange_bytes
    from flashqla.distributed.op import _all_gather

    mode = setup.cp if cp is None else cp
    K = V = setup.head_dim
    kernels = setup.ours_backend is None
    if kernels:
        if setup.device != "cuda":
            raise RuntimeError("ours: the sm_90 kernels need CUDA (pass Setup.ours_backend for another device)")
        if torch.cuda.get_device_capability() != (9, 0):
            cap = torch.cuda.get_device_capability()
            raise RuntimeError(f"ours: the kernels need compute capability 9.0, this GPU has {cap}")
        if K != 128:
            raise RuntimeError(f"ours: the kernels run K = V = 128, not {K}")
    dev = torch.device(setup.device, torch.cuda.current_device()) if setup.device == "cuda" else torch.device("cpu")
    if world_size == 1 and kernels:
        cu = _cu(T, dev)

        def call(q, k, v, g, beta, output_final_state=False):
            return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=output_final_state,
                                                   cu_seqlens=cu, cp=mode)

        return RankOp("ours", call, f"`flashqla.chunk_gated_delta_rule(cp={mode!r})`", returns_final=True)
    ctx = build_cp_context([0, T], group) if world_size > 1 else build_cp_context([0, T], rank=0, world_size=1)
    backend = KernelBackend(cp=mode) if kernels else setup.ours_backend

    def call(q, k, v, g, beta, output_final_state=False):
        return chunk_gated_delta_rule_cp(q, k, v, g, beta, output_final_state=output_final_state, cp_context=ctx,
                                         backend=backend)

    be_name = f"KernelBackend(cp={mode!r})" if kernels else getattr(backend, "__qualname__", type(backend).__name__)
    src = f"`flashqla.distributed.chunk_gated_delta_rule_cp(cp_context=build_cp_context([0, T], group), backend={be_name})`"
    if world_size == 1:
        return RankOp("ours", call, src, returns_final=True)
    sdt = torch.float32 if kernels else (torch.float64 if setup.dtype == "fp64" else torch.float32)
    vol = exchange_bytes(HV, K, V, world_size, sdt)
    return RankOp("ours", call, src, returns_final=True,
                  gathers=(("fwd", (HV, K, K + V), sdt), ("bwd", (HV, K, V), sdt)),
                  sent={"fwd": vol["fwd_send"], "bwd": vol["bwd_send"]},
                  gather=lambda buf: _all_gather(buf, ctx), local=_without_state_gathers)


def _import_peer(module: str, label: str):
    """Imports a peer, or raises ImportError naming it (absent) / RuntimeError (present but refusing
    this machine at import, e.g. FlashQLA on a GPU it does not build for)."""
    import importlib
    import importlib.util

    if importlib.util.find_spec(module) is None:
        raise ImportError(f"{label} (`{module}`) is not installed here")
    try:
        return importlib.import_module(module)
    except ImportError as exc:
        raise ImportError(f"{label} (`{module}`) does not import: {exc}") from exc
    except Exception as exc:  # a peer that checks the GPU at import
        raise RuntimeError(f"{label} (`{module}`) does not load here: {type(exc).__name__}: {exc}") from exc


def _peer_checks(label: str, T: int, world_size: int, setup: Setup) -> None:
    if setup.device != "cuda":
        raise RuntimeError(f"{label}'s CP runs on CUDA devices only")
    if setup.dtype not in ("bf16", "fp16"):
        raise RuntimeError(f"{label} runs bf16 / fp16 q, k, v, not {setup.dtype}")
    if T % world_size:
        raise RuntimeError(f"{label}'s CP needs T a multiple of W (T = {T}, W = {world_size})")


def fla_kcp(H: int, HV: int, T: int, world_size: int, group, setup: Setup) -> RankOp:
    """FLA 0.6.0 on this rank: W = 1 its public `fla.ops.gated_delta_rule.chunk_gated_delta_rule`
    (cu_seqlens [0, T]); W > 1 the same with `cp_context=fla.ops.cp.build_cp_context(cu_seqlens_global,
    group=group)` on the rank's shard (no initial state, no final state: FLA asserts them away
    under CP). FLA_FLASH_QLA=0 is set before the import (as `impls` does for the single-GPU peer:
    otherwise FLA hands the op to FlashQLA), and the dispatch target is checked. Raises ImportError
    when FLA is not installed, RuntimeError when it cannot run the row (not CUDA, dtype, T not a
    multiple of W, another dispatch target)."""
    import importlib.util

    if importlib.util.find_spec("fla") is None:
        raise ImportError("FLA (`fla`, package flash-linear-attention / fla-core) is not installed here")
    os.environ["FLA_FLASH_QLA"] = "0"
    _import_peer("fla", "FLA")
    _peer_checks("FLA", T, world_size, setup)
    import torch

    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as op

    from flashqla.bench.impls import fla_dispatch_target

    target = fla_dispatch_target()
    if target not in ("triton", "unknown"):
        raise RuntimeError(f"FLA would dispatch gated_delta_rule to {target}")
    dev = torch.device("cuda", torch.cuda.current_device())
    cu = _cu(T, dev)
    if world_size == 1:
        def call(q, k, v, g, beta, output_final_state=False):
            return op(q, k, v, g, beta, output_final_state=output_final_state, cu_seqlens=cu)

        return RankOp("fla", call, "`fla.ops.gated_delta_rule.chunk_gated_delta_rule(cu_seqlens=[0, T])`",
                      returns_final=True)
    from fla.ops.cp import build_cp_context

    ctx = build_cp_context(cu.long(), group=group)
    K = V = setup.head_dim

    def call(q, k, v, g, beta, output_final_state=False):
        o, _ = op(q, k, v, g, beta, cp_context=ctx)
        return o, None

    buf = (HV, K, V + K)
    return RankOp("fla", call, "`fla.ops.gated_delta_rule.chunk_gated_delta_rule(cp_context=fla.ops.cp.build_cp_context("
                  "cu_seqlens, group=group))`, FLA_FLASH_QLA=0; no final state under CP",
                  returns_final=False, gathers=(("fwd", buf, torch.float32), ("bwd", buf, torch.float32)),
                  gather=_collective_gather(group, world_size))


def flash_qla_cp(H: int, HV: int, T: int, world_size: int, group, setup: Setup, *,
                 force_intra: bool = False) -> RankOp:
    """FlashQLA 0.1.3 on this rank: W = 1 its public `flash_qla.chunk_gated_delta_rule` with its
    defaults (auto_cp: its intra-card CP); W > 1 the same with `cp_context=build_cp_context(
    cu_seqlens_global, enable_inter=True, enable_intra=True, group=group, num_v_heads=HV,
    chunk_size=64, is_train=...)` (`flash_qla.ops.gated_delta_rule.chunk.cp`), one context for
    forward-only calls and one for training steps (its intra split must be decided the same way in
    a step's forward and backward). `force_intra` (the gate's second instance): its intra-card split
    forced (`force_intra_cp=True`, to the public op at W = 1, to `build_cp_context` at W > 1).
    `tl.disable_buffer_init_check` is added to its backward kernels first
    (`impls.patch_flash_qla_bwd`). Raises ImportError when FlashQLA is not installed, RuntimeError
    when it cannot run the row (not CUDA, dtype, head dims, T not a multiple of W)."""
    _import_peer("flash_qla", "FlashQLA")
    _peer_checks("FlashQLA", T, world_size, setup)
    if setup.head_dim != 128:
        raise RuntimeError(f"FlashQLA's Hopper kernels run K = V = 128, not {setup.head_dim}")
    import torch

    import flash_qla

    from flashqla.bench.impls import patch_flash_qla_bwd

    patched = patch_flash_qla_bwd()
    op = flash_qla.chunk_gated_delta_rule
    dev = torch.device("cuda", torch.cuda.current_device())
    cu = _cu(T, dev)
    note = f"`tl.disable_buffer_init_check` on {', '.join(patched) or 'no kernel (modules not found)'}"
    force = bool(force_intra)
    if world_size == 1:
        def call(q, k, v, g, beta, output_final_state=False):
            return op(q, k, v, g, beta, output_final_state=output_final_state, cu_seqlens=cu, force_intra_cp=force)

        how = "force_intra_cp=True" if force else "auto_cp"
        return RankOp("flash_qla", call, f"`flash_qla.chunk_gated_delta_rule(cu_seqlens=[0, T])` ({how}); {note}",
                      returns_final=True)
    from flash_qla.ops.gated_delta_rule.chunk import CHUNK_SIZE
    from flash_qla.ops.gated_delta_rule.chunk.cp import build_cp_context

    ctxs = {}

    def context(train: bool):
        if train not in ctxs:
            ctxs[train] = build_cp_context(cu, enable_inter=True, enable_intra=True, group=group, num_v_heads=HV,
                                           chunk_size=CHUNK_SIZE, is_train=train, force_intra_cp=force)
        return ctxs[train]

    def call(q, k, v, g, beta, output_final_state=False):
        train = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, g, beta))
        return op(q, k, v, g, beta, output_final_state=output_final_state, cp_context=context(train))

    K = V = setup.head_dim
    nbytes = HV * K * (V + K) * 4  # packed h [HV, K, V] and M [HV, K, K], fp32, viewed as bytes
    return RankOp("flash_qla", call, "`flash_qla.chunk_gated_delta_rule(cp_context=build_cp_context(cu_seqlens, "
                  "enable_inter=True, enable_intra=True, group=group, num_v_heads=HV, chunk_size=64, is_train=..."
                  + (", force_intra_cp=True" if force else "") + "))`; " + note, returns_final=True,
                  gathers=(("fwd", (nbytes,), torch.uint8), ("bwd", (nbytes,), torch.uint8)),
                  gather=_collective_gather(group, world_size))


#: impl name -> adapter(H, HV, T, world_size, group, setup) -> RankOp
ADAPTERS = {"ours": ours_cp, "fla": fla_kcp, "flash_qla": flash_qla_cp}


# ---------------------------------------------------------------------------------------- the ranks


@dataclass
class Job:
    """What one spawn does: the (point, impl) pairs of one world size still to measure, in order."""

    world_size: int
    todo: list
    setup: Setup
    csv_path: str
    env: dict
    commit: str
    work_dir: str
    init_file: str
    deadline: float | None = None


class _Rank:
    """This process's place: rank, world size, group, device, and the few collectives the harness
    itself makes (agreement, timing maxima)."""

    def __init__(self, rank: int, world_size: int, setup: Setup):
        import torch
        import torch.distributed as dist

        self.rank, self.W, self.setup = rank, world_size, setup
        self.group = dist.group.WORLD
        self.device = torch.device("cuda", torch.cuda.current_device()) if setup.device == "cuda" else torch.device("cpu")
        self.cuda = setup.device == "cuda"

    def sync(self) -> None:
        if self.cuda:
            import torch

            torch.cuda.synchronize()

    def barrier(self) -> None:
        import torch.distributed as dist

        dist.barrier()

    def objects(self, obj) -> list:
        """Every rank's `obj`, in rank order."""
        import torch.distributed as dist

        out = [None] * self.W
        dist.all_gather_object(out, obj)
        return out

    def first_status(self, status: str | None) -> str | None:
        """The first rank's non-empty status (every rank gets the same), or None."""
        return next((s for s in self.objects(status) if s), None)

    def go(self, deadline: float | None) -> bool:
        """Rank 0's decision whether to start another row, the same on every rank."""
        import torch.distributed as dist

        box = [deadline is None or time.time() < deadline]
        dist.broadcast_object_list(box, src=0)
        return bool(box[0])

    def max_median_ms(self, ts: list) -> float:
        """Median over iterations of the slowest rank's time, ms."""
        import torch
        import torch.distributed as dist

        t = torch.tensor(ts, dtype=torch.float64, device=self.device)
        if self.W > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return 1e3 * statistics.median(t.tolist())

    def max_value(self, x: float) -> float:
        import torch
        import torch.distributed as dist

        t = torch.tensor([x], dtype=torch.float64, device=self.device)
        if self.W > 1:
            dist.all_reduce(t, op=dist.ReduceOp.MAX)
        return float(t)

    def timed(self, fn, iters: int, warmup: int) -> float:
        for _ in range(warmup):
            fn()
        self.sync()
        ts = []
        for _ in range(iters):
            self.barrier()
            self.sync()
            t0 = time.perf_counter()
            fn()
            self.sync()
            ts.append(time.perf_counter() - t0)
        return self.max_median_ms(ts)


def _shard_bounds(T: int, W: int, rank: int) -> tuple[int, int]:
    from flashqla.distributed import even_shard_lens

    lens = even_shard_lens(T, W)
    return sum(lens[:rank]), sum(lens[: rank + 1])


def _leaves(x: dict) -> dict:
    return {n: x[n].detach().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}


def gate_reference(H: int, HV: int, R: _Rank) -> dict:
    """The gate's instance on this rank: its shard of `gate_tokens` x W tokens (seeded apart from the
    timed rows) and its slices of the global fp64 result (o, dq, dk, dv, dg, dbeta; the final state
    on the rank holding the last token), computed by this rank from the whole instance."""
    from types import SimpleNamespace

    from flashqla.bench.gate import fp64_result

    st = R.setup
    K = st.head_dim
    Tg = st.gate_tokens * R.W
    x = make_inputs(H, HV, 0, Tg, device=R.device, dtype=st.torch_dtype(), K=K, V=K, seed=st.seed + 7919)
    ns = SimpleNamespace(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], h0=None, do=x["do"], dht=None,
                         scale=K**-0.5, cu_seqlens=_cu(Tg, R.device), lengths=(Tg,))
    ref = fp64_result(ns, grads=True, max_token_heads=1 << 18)
    lo, hi = _shard_bounds(Tg, R.W, R.rank)
    out = {"T": Tg, "inputs": {n: x[n][:, lo:hi].clone() for n in x},
           "ref": {n: ref[n][:, lo:hi].clone() for n in ("o", "dq", "dk", "dv", "dg", "dbeta")}}
    out["ref"]["ht"] = ref["ht"].clone() if hi == Tg and hi > lo else None
    del x, ref
    return out


def gate_errors(op: RankOp, gref: dict) -> dict[str, float]:
    """This rank's relative RMS errors of `op` on the gate instance: o and the gradients of <o, do>
    on its shard, the final state where `op` returns one and this rank holds the last token."""
    from flashqla.bench.gate import rel_rms

    L = _leaves(gref["inputs"])
    o, ht = op.call(L["q"], L["k"], L["v"], L["g"], L["beta"], output_final_state=op.returns_final)
    o.backward(gref["inputs"]["do"])
    got = {"o": o, **{f"d{n}": L[n].grad for n in ("q", "k", "v", "g", "beta")}}
    errs = {n: rel_rms(got[n], gref["ref"][n]) for n in ("o", "dq", "dk", "dv", "dg", "dbeta")}
    ref_ht = gref["ref"]["ht"]
    if op.returns_final and ht is not None and ref_ht is not None and ht.numel() == ref_ht.numel():
        errs["ht"] = rel_rms(ht.reshape(ref_ht.shape), ref_ht)  # a final state of another size: not compared
    return errs


def _merge_errs(per_rank: list[dict]) -> dict[str, float]:
    """The largest error per quantity over the ranks, in `GATE_NAMES` order."""
    out = {}
    for n in GATE_NAMES:
        vals = [e[n] for e in per_rank if n in e]
        if vals:
            out[n] = max(vals)
    return out


def measure(op: RankOp, x: dict, R: _Rank) -> dict:
    """The timed part of a row on this rank (every rank calls it; see the module docstring):
    fwd_ms, step_ms (slowest rank, median), peak_gib (largest rank), the all-gathers' bytes and
    times, and for ours at W > 1 local_fwd_ms / local_step_ms."""
    import torch

    st = R.setup
    L = _leaves(x)
    do = x["do"]

    def fwd():
        with torch.no_grad():
            op.call(L["q"], L["k"], L["v"], L["g"], L["beta"])

    def step():
        for t in L.values():
            t.grad = None
        o, _ = op.call(L["q"], L["k"], L["v"], L["g"], L["beta"])
        o.backward(do)

    if R.cuda:
        torch.cuda.reset_peak_memory_stats()
    res = {"fwd_ms": R.timed(fwd, st.iters, st.warmup), "step_ms": R.timed(step, st.iters, st.warmup)}
    res["peak_gib"] = R.max_value(torch.cuda.max_memory_allocated() / _GIB) if R.cuda else math.nan
    if op.local is not None:
        with op.local():
            res["local_fwd_ms"] = R.timed(fwd, st.iters, 1)
            res["local_step_ms"] = R.timed(step, st.iters, 1)
    for name, shape, dtype in op.gathers:
        buf = torch.zeros(shape, dtype=dtype, device=R.device)
        res[f"ag_{name}_bytes"] = op.sent.get(name, buf.numel() * buf.element_size())
        res[f"ag_{name}_ms"] = R.timed(lambda b=buf: op.gather(b), st.comm_iters, 2)
    for t in L.values():
        t.grad = None
    return res


def assemble_row(point: Point, impl: str, env: dict, commit: str, setup: Setup, *, status: str,
                 gate: str = "", gate_errs: dict | None = None, gate_tokens: int | None = None,
                 timing: dict | None = None, source: str = "", date: str | None = None) -> dict:
    """One CSV row (`FIELDS`) from a point's measurement: the key, the status, the gate's verdict and
    errors, the times with bwd = step - fwd and tokens/s = T / time, the all-gathers and peak."""
    t = dict(timing or {})
    r = {f: env.get(f, "") for f in ENV_FIELDS}
    r.update(commit=commit, world_size=point.world_size, impl=impl, h_qk=point.h_qk, h_v=point.h_v, T=point.T,
             tokens_per_rank=point.tokens_per_rank, scaling=point.scaling, cp=setup.cp if impl == "ours" else "",
             status=status, gate=gate, gate_tokens=gate_tokens if gate_tokens is not None else "",
             gate_errs=format_errs(gate_errs or {}), iters=setup.iters, warmup=setup.warmup, source=source,
             date=date or S.now_utc())
    for f in ("fwd_ms", "step_ms", "peak_gib", "ag_fwd_bytes", "ag_bwd_bytes", "ag_fwd_ms", "ag_bwd_ms",
              "local_fwd_ms", "local_step_ms"):
        if f in t:
            r[f] = t[f]
    if "fwd_ms" in t and "step_ms" in t:
        r["bwd_ms"] = t["step_ms"] - t["fwd_ms"]
        r["fwd_tok_s"] = point.T / (t["fwd_ms"] / 1e3) if t["fwd_ms"] > 0 else math.nan
        r["step_tok_s"] = point.T / (t["step_ms"] / 1e3) if t["step_ms"] > 0 else math.nan
    return r


def _write(R: _Rank, job: Job, row: dict) -> None:
    if R.rank == 0:
        S.append_row(job.csv_path, row, FIELDS)
        print(console_line(row), flush=True)


def _marker(job: Job, name: str, payload: dict) -> None:
    """Writes a marker file whole (a temporary file, then os.replace): a rank terminated mid-write
    leaves the previous marker or none, never half a JSON for the parent to read."""
    p = Path(job.work_dir) / name
    tmp = p.with_name(f".{name}.{os.getpid()}.tmp")
    tmp.write_text(json.dumps(payload))
    os.replace(tmp, p)


def _failure_status(exc: BaseException) -> str:
    import torch

    if isinstance(exc, torch.cuda.OutOfMemoryError) or "out of memory" in str(exc).lower():
        return "out of memory"
    msg = str(exc).splitlines()[0][:200] if str(exc) else ""
    return f"error: {type(exc).__name__}: {msg}"


def run_rank(rank: int, job: Job) -> None:
    """One rank's part of a spawn, inside an initialised process group. For each point of `job.todo`
    (grouped by point, in order): every implementation's adapter (a failure there is "n/a", agreed by
    the ranks before any collective), the gates not yet run in this spawn (per implementation and
    heads; the fp64 reference is freed before the row's inputs exist), the row's shard inputs (a
    failure there, out of memory included, is agreed too), then per implementation that passed its
    gate the timing. Rank 0 appends each row to the CSV. No row starts after `job.deadline`. An
    exception inside a call that makes collectives (gate or timing) is written to a marker file
    (`fail-<rank>.json`) and re-raised (see the module docstring)."""
    import torch

    R = _Rank(rank, job.world_size, job.setup)
    st = job.setup
    points: dict[Point, list[str]] = {}
    for p, impl in job.todo:
        points.setdefault(p, []).append(impl)
    gates: dict[tuple, tuple] = {}

    def write(p, impl, status, **kw):
        _write(R, job, assemble_row(p, impl, job.env, job.commit, st, status=status, **kw))

    def current(p, impl, phase):
        if rank == 0:
            _marker(job, "current.json", {"point": p.__dict__, "impl": impl, "phase": phase})

    def fail(p, impl, phase, exc):
        _marker(job, f"fail-{rank}.json", {"point": p.__dict__, "impl": impl, "phase": phase,
                                           "status": _failure_status(exc)})

    for p, impls in points.items():
        if not R.go(job.deadline):
            return
        ops = {}
        for impl in impls:
            current(p, impl, "build")
            status = None
            try:
                ops[impl] = ADAPTERS[impl](p.h_qk, p.h_v, p.T, R.W, R.group, st)
            except (ImportError, RuntimeError, ValueError, TypeError) as exc:
                status = f"n/a: {type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}"
            status = R.first_status(status)
            if status is not None:
                ops.pop(impl, None)
                write(p, impl, status)
        gref = None
        for impl in [i for i in ops if (i, p.h_qk, p.h_v) not in gates]:
            current(p, impl, "gate")
            try:
                if gref is None:
                    gref = gate_reference(p.h_qk, p.h_v, R)
                gops = _gate_ops(impl, p, gref["T"], R)
                errs = _merge_errs(R.objects(_merge_errs([gate_errors(g, gref) for g in gops])))
                del gops
            except Exception as exc:
                fail(p, impl, "gate", exc)
                raise
            ok, why = gate_decision(errs, gate_tolerances(st.tol))
            gates[(impl, p.h_qk, p.h_v)] = (ok, why, errs, gref["T"])
        gref = None
        for impl in list(ops):
            ok, why, errs, gT = gates[(impl, p.h_qk, p.h_v)]
            if not ok:
                write(p, impl, f"gate failed: {why}", gate="failed", gate_errs=errs, gate_tokens=gT,
                      source=ops.pop(impl).source)
        if not ops:
            continue
        if R.cuda:
            torch.cuda.empty_cache()
        lo, hi = _shard_bounds(p.T, R.W, rank)
        status, x = None, None
        try:
            x = make_inputs(p.h_qk, p.h_v, lo, hi, device=R.device, dtype=st.torch_dtype(), K=st.head_dim,
                            V=st.head_dim, seed=st.seed)
        except Exception as exc:  # no collective of the row has started: the ranks agree below
            status, x = _failure_status(exc), None
            if R.cuda:
                torch.cuda.empty_cache()
        status = R.first_status(status)
        if status is not None:
            for impl in ops:
                write(p, impl, status)
            continue
        for impl, op in ops.items():
            if not R.go(job.deadline):
                return
            ok, why, errs, gT = gates[(impl, p.h_qk, p.h_v)]
            current(p, impl, "timing")
            try:
                res = measure(op, x, R)
            except Exception as exc:
                fail(p, impl, "timing", exc)
                raise
            write(p, impl, "ok", gate="ok", gate_errs=errs, gate_tokens=gT, timing=res, source=op.source)
            if R.cuda:
                torch.cuda.empty_cache()
        ops, x = {}, None
        if R.cuda:
            torch.cuda.empty_cache()


def _gate_ops(impl: str, p: Point, Tg: int, R: _Rank) -> list[RankOp]:
    """The implementation on the gate's instance, each of these calls gated (the largest error per
    quantity kept): ours with its split forced (cp "on") unless --cp is "off", so that the small
    instance takes the long rows' split path; FlashQLA with its defaults (at the gate's size its
    auto_cp may not split) and again with its intra-card split forced, so that whichever path a
    timed row takes has been gated; FLA as timed."""
    args = (p.h_qk, p.h_v, Tg, R.W, R.group, R.setup)
    if impl == "ours":
        return [ADAPTERS[impl](*args, cp="off" if R.setup.cp == "off" else "on")]
    if impl == "flash_qla":
        return [ADAPTERS[impl](*args), ADAPTERS[impl](*args, force_intra=True)]
    return [ADAPTERS[impl](*args)]


def _worker(rank: int, job: Job) -> None:
    import torch
    import torch.distributed as dist

    if job.setup.device == "cuda":
        torch.cuda.set_device(rank)
    else:
        torch.set_num_threads(1)
    dist.init_process_group(job.setup.dist_backend, init_method=f"file://{job.init_file}", rank=rank,
                            world_size=job.world_size, timeout=datetime.timedelta(seconds=job.setup.pg_timeout_s))
    try:
        run_rank(rank, job)
        dist.barrier()
        if rank == 0:  # every rank is past its last row: a failure from here on (teardown) is no row's
            (Path(job.work_dir) / "current.json").unlink(missing_ok=True)
    finally:
        dist.destroy_process_group()


# ---------------------------------------------------------------------------------------- the parent


def precompile(heads, cp: str = "auto") -> None:
    """Builds ours' kernels for every (H, HV) in this process (TileLang's disk cache then serves the
    ranks): both value-slice widths of the recurrent kernel, a training step in mode `cp`, and a
    training step with the split forced (the gate's path)."""
    import torch

    import flashqla
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    for H, HV in sorted(set(heads)):
        for T, mode in ((256, cp), (4096, "off" if cp == "off" else "on")):
            x = make_inputs(H, HV, 0, T, device="cuda:0", seed=1)
            cu = _cu(T, "cuda:0")
            if T == 256:
                with torch.no_grad():
                    for bv in (64, 128):
                        chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, True, cu,
                                                   block_v=bv)
            L = _leaves(x)
            o, _ = flashqla.chunk_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], cu_seqlens=cu, cp=mode)
            o.backward(x["do"])
    torch.cuda.synchronize()
    torch.cuda.empty_cache()  # rank 0 shares GPU 0 with this process


def _spawn(job: Job) -> None:
    import torch.multiprocessing as mp

    mp.spawn(_worker, args=(job,), nprocs=job.world_size, join=True)


def _crash_rows(job: Job, exc: BaseException) -> list[dict]:
    """The rows a failed spawn leaves: the failing rank's marker (or rank 0's current row, which rank 0
    removes once every rank is past its last row) with its status; an error in a gate also marks that
    implementation's other points of the same heads."""
    wd = Path(job.work_dir)
    fails = [json.loads(p.read_text()) for p in sorted(wd.glob("fail-*.json"))]
    cur = json.loads((wd / "current.json").read_text()) if (wd / "current.json").exists() else None
    info = next((f for f in fails if f["status"] == "out of memory"), fails[0] if fails else None)
    if info is None and cur is None:
        return []
    if info is None:
        first = str(exc).strip().splitlines()
        info = dict(cur, status=f"error: the ranks stopped ({type(exc).__name__}: {first[-1][:160] if first else ''})")
    p = Point(**info["point"])
    targets = [(p, info["impl"])]
    if info.get("phase") == "gate" and info["status"] != "out of memory":
        targets += [(q, i) for q, i in job.todo if i == info["impl"] and (q.h_qk, q.h_v) == (p.h_qk, p.h_v) and q != p]
    status = info["status"] if info.get("phase") != "gate" else f"gate {info['status']}"
    return [assemble_row(q, i, job.env, job.commit, job.setup, status=status) for q, i in targets]


def run(points: list[Point], impls, setup: Setup, env: dict, commit: str, csv_path, *, available: int | None,
        device_bytes: int | None = None, force: bool = False, time_budget: float | None = None,
        spawn: Callable[[Job], None] = _spawn, log=print, after_world_size: Callable[[], object] | None = None) -> dict:
    """Measures `points` x `impls` not yet in `csv_path` (unless `force`), one spawn per world size
    (world sizes above `available` skipped with a note; with `device_bytes`, rows whose lower bound
    `min_bytes_per_rank` exceeds it recorded "out of memory" without running), respawning after a
    failed row, starting nothing after `time_budget` seconds; `after_world_size()` is called after
    each world size (the page's refresh). Returns {"measured": rows appended,
    "deferred": (point, impl) pairs left for the next run, "notes": [...]}."""
    csv_path = Path(csv_path)
    t0 = time.time()
    deadline = None if time_budget is None else t0 + float(time_budget)
    gpus, notes = usable_gpus(sorted({p.world_size for p in points}), available)
    for n in notes:
        log(n)
    measured, attempted = 0, set()

    def pending(W):
        done = set() if force else done_keys(S.read_rows(csv_path))
        out = []
        for p in points:
            if p.world_size != W:
                continue
            for i in impls:
                k = row_key(assemble_row(p, i, env, commit, setup, status=""))
                if k not in done and k not in attempted:
                    out.append((p, i))
        return out

    deferred = []
    for W in gpus:
        todo = pending(W)
        if device_bytes is not None:
            for p, i in [t for t in todo if min_bytes_per_rank(t[0].h_qk, t[0].h_v, t[0].tokens_per_rank,
                                                               setup.head_dim, setup.head_dim) > device_bytes]:
                need = min_bytes_per_rank(p.h_qk, p.h_v, p.tokens_per_rank, setup.head_dim, setup.head_dim)
                row = assemble_row(p, i, env, commit, setup, status=(
                    f"out of memory (inputs, outputs and gradients alone need {need / _GIB:.0f} GiB per rank, the "
                    f"device has {device_bytes / _GIB:.0f} GiB)"))
                S.append_row(csv_path, row, FIELDS)
                attempted.add(row_key(row))
                measured += 1
                log(console_line(row))
            todo = pending(W)
        spawns = 0
        while todo:
            if deadline is not None and time.time() >= deadline:
                break
            if spawns > len(todo) + 1:
                log(f"W = {W}: giving up after {spawns} spawns")
                break
            spawns += 1
            before = len(S.read_rows(csv_path))
            with tempfile.TemporaryDirectory(prefix="flashqla-mgpu-") as wd:
                job = Job(W, todo, setup, str(csv_path), env, commit, wd, os.path.join(wd, f"init-{W}-{spawns}"), deadline)
                crashed = None
                try:
                    spawn(job)
                except Exception as exc:
                    crashed = _crash_rows(job, exc)
                    for row in crashed:
                        S.append_row(csv_path, row, FIELDS)
                        attempted.add(row_key(row))
                        log(console_line(row))
                    if not crashed:
                        log(f"W = {W}: the ranks failed outside any row ({type(exc).__name__}: {exc})")
            rows_now = S.read_rows(csv_path)
            measured += len(rows_now) - before
            attempted |= {row_key(r) for r in rows_now[before:]}
            todo = pending(W)
            if not crashed:  # the ranks returned (all done, or past the deadline) or failed outside any row
                break
        deferred += todo
        if after_world_size is not None:
            after_world_size()
    if deferred:
        log(f"{len(deferred)} row(s) left for the next run (--time-budget or failures): rerun the same command")
    return {"measured": measured, "deferred": deferred, "notes": notes}


def environment(setup: Setup) -> dict:
    """The environment key of this process (`ENV_FIELDS`): `impls.collect_env` and NCCL's version;
    on CPU the GPU column is "cpu (<dist backend>)"."""
    import torch

    from flashqla.bench.impls import collect_env

    env = collect_env()
    try:
        nccl = ".".join(str(v) for v in torch.cuda.nccl.version()) if torch.cuda.is_available() else "none"
    except (AttributeError, RuntimeError):
        nccl = "unknown"
    env["nccl"] = nccl
    if setup.device != "cuda":
        env["gpu"] = f"cpu ({setup.dist_backend})"
    return {f: str(env.get(f, "")) for f in ENV_FIELDS}


# ---------------------------------------------------------------------------------------- the page


def _n(r: dict, f: str) -> float:
    return S.num(r.get(f, ""))


def latest_rows(rows: list[dict], commit: str | None = None) -> tuple[list[dict], dict, str]:
    """(rows, env, commit) of the page: the GPU and commit of the most recent row (of `commit` when
    given), the last line per key."""
    if commit is not None:
        rows = [r for r in rows if r.get("commit", "") == commit]
    if not rows:
        return [], {}, commit or ""
    last = max(rows, key=lambda r: r.get("date", ""))
    gpu, commit = last.get("gpu", ""), last.get("commit", "")
    keep = {}
    for r in rows:
        if r.get("gpu", "") == gpu and r.get("commit", "") == commit:
            keep[row_key(r)] = r
    return list(keep.values()), {f: last.get(f, "") for f in ENV_FIELDS}, commit


def _ok(r: dict | None) -> bool:
    return r is not None and str(r.get("status", "")) == "ok" and _n(r, "step_ms") > 0


def _index(rows: list[dict]) -> dict:
    return {(r["impl"], int(r["h_qk"]), int(r["h_v"]), int(r["T"]), int(r["world_size"])): r for r in rows}


def _ms(v: float, digits: int = 2) -> str:
    return "-" if not (v == v and v > 0) else f"{v:.{digits}f}"


def _x(v: float) -> str:
    return "-" if not (v == v and v > 0) else f"{v:.2f}x"


def _pct(v: float) -> str:
    return "-" if not (v == v and v > 0) else f"{100 * v:.0f}%"


def _kib(v: float) -> str:
    return "-" if not v == v else f"{v / 1024:,.0f}"


def scaling_of(r: dict, idx: dict, kind: str) -> tuple[float, float, float]:
    """(forward speed-up, training-step speed-up, step efficiency) of row `r` against the same
    implementation's W = 1 row: strong at the same T (speed-up = time(1) / time(W), efficiency =
    speed-up / W), weak at the same T per rank (throughput ratio = W time(1) / time(W), efficiency
    = time(1) / time(W)). NaN where either row is not ok."""
    W, T = int(r["world_size"]), int(r["T"])
    T1 = T if kind == "strong" else T // W
    base = idx.get((r["impl"], int(r["h_qk"]), int(r["h_v"]), T1, 1))
    if not (_ok(r) and _ok(base)):
        return math.nan, math.nan, math.nan
    f = _n(base, "fwd_ms") / _n(r, "fwd_ms")
    s = _n(base, "step_ms") / _n(r, "step_ms")
    if kind == "strong":
        return f, s, s / W
    return W * f, W * s, s


def targets(rows: list[dict]) -> list[str]:
    """The issue's two targets, each "met", "not met" or "not measured" with its numbers."""
    idx = _index(rows)
    tg = TARGET
    out = []
    name = (f"ours at {tg['world_size']} GPUs, training step on {tg['h_qk']}/{tg['h_v']} x {tg['T']:,} tokens, "
            f">= {tg['ratio']:.0f}x one GPU's throughput")
    r8 = idx.get(("ours", tg["h_qk"], tg["h_v"], tg["T"], tg["world_size"]))
    base = idx.get(("ours", tg["h_qk"], tg["h_v"], tg["T"], 1))
    if not _ok(base):
        base = idx.get(("ours", tg["h_qk"], tg["h_v"], tg["T"] // tg["world_size"], 1))
    if r8 is None:
        out.append(f"- {name}: **not measured** (no {tg['world_size']}-GPU row)")
    elif not _ok(r8):
        verdict = "not met" if str(r8.get("status", "")).startswith("gate failed") else "not measured"
        out.append(f"- {name}: **{verdict}** ({tg['world_size']}-GPU row: {r8.get('status')})")
    elif not _ok(base):
        out.append(f"- {name}: **not measured** (no one-GPU row of ours at {tg['T']:,} or "
                   f"{tg['T'] // tg['world_size']:,} tokens)")
    else:
        ratio = _n(r8, "step_tok_s") / _n(base, "step_tok_s")
        verdict = "met" if ratio >= tg["ratio"] else "not met"
        out.append(f"- {name}: **{verdict}**: {ratio:.2f}x ({_n(r8, 'step_tok_s') / 1e6:.2f} M tokens/s against "
                   f"{_n(base, 'step_tok_s') / 1e6:.2f} M tokens/s on one GPU at {int(base['T']):,} tokens)")
    name = "ours faster than both peers, forward and training step, on every row they run"
    cmp, losses = 0, []
    for (impl, H, HV, T, W), r in sorted(idx.items()):
        if impl == "ours" or not _ok(r):
            continue
        mine = idx.get(("ours", H, HV, T, W))
        cmp += 1
        label = f"{H}/{HV} x {T:,} at {W} GPU{'s' if W > 1 else ''} vs {LABELS.get(impl, impl)}"
        if not _ok(mine):
            losses.append(f"{label}: ours {mine.get('status') if mine else 'not run'}")
            continue
        slow = [f"{what} {_n(mine, f):.2f} vs {_n(r, f):.2f} ms" for what, f in (("fwd", "fwd_ms"), ("step", "step_ms"))
                if not _n(mine, f) < _n(r, f)]
        if slow:
            losses.append(f"{label}: {', '.join(slow)}")
    if cmp == 0:
        out.append(f"- {name}: **not measured** (no peer row passed its gate and was timed)")
    elif losses:
        out.append(f"- {name}: **not met** on {len(losses)} of {cmp} peer rows: " + "; ".join(losses))
    else:
        out.append(f"- {name}: **met** on all {cmp} peer rows")
    return out


_TABLE_HEAD = ("| heads | T | GPUs | T / rank | impl | fwd ms | step ms | bwd ms | step M tokens/s | fwd x | step x "
               "| efficiency | peak GiB / rank | all-gather KiB / rank fwd + bwd | all-gather ms fwd / bwd "
               "| op - local ms fwd / step | status |")
_TABLE_RULE = "| --- | ---: | ---: | ---: | --- | " + "---: | " * 11 + "--- |"


def _table_line(r: dict, idx: dict, kind: str) -> str:
    f, s, e = scaling_of(r, idx, kind)
    W = int(r["world_size"])
    ok = _ok(r)
    ag = "-" if W == 1 or not ok else f"{_kib(_n(r, 'ag_fwd_bytes'))} + {_kib(_n(r, 'ag_bwd_bytes'))}"
    agt = "-" if W == 1 or not ok else f"{_ms(_n(r, 'ag_fwd_ms'), 3)} / {_ms(_n(r, 'ag_bwd_ms'), 3)}"
    lf, ls = _n(r, "local_fwd_ms"), _n(r, "local_step_ms")
    exposed = ("-" if not (ok and lf == lf and ls == ls)
               else f"{_n(r, 'fwd_ms') - lf:+.2f} / {_n(r, 'step_ms') - ls:+.2f}")
    st = str(r.get("status", ""))
    cells = [f"{r['h_qk']}/{r['h_v']}", f"{int(r['T']):,}", str(W), f"{int(r['T']) // W:,}", LABELS.get(r["impl"], r["impl"]),
             _ms(_n(r, "fwd_ms")) if ok else "-", _ms(_n(r, "step_ms")) if ok else "-", _ms(_n(r, "bwd_ms")) if ok else "-",
             f"{_n(r, 'step_tok_s') / 1e6:.2f}" if ok else "-", _x(f), _x(s), _pct(e),
             f"{_n(r, 'peak_gib'):.1f}" if ok and _n(r, "peak_gib") == _n(r, "peak_gib") else "-", ag, agt, exposed,
             st.replace("|", "/")]
    return "| " + " | ".join(cells) + " |"


def _groups(rows: list[dict], kind: str) -> dict:
    """Rows by (heads, T) (strong) or (heads, T per rank) (weak), only groups with two or more world
    sizes."""
    g: dict[tuple, list] = {}
    for r in rows:
        W, T = int(r["world_size"]), int(r["T"])
        key = (int(r["h_qk"]), int(r["h_v"]), T if kind == "strong" else T // W)
        g.setdefault(key, []).append(r)
    return {k: v for k, v in g.items() if len({int(r["world_size"]) for r in v}) >= 2}


def _sorted(rs: list[dict]) -> list[dict]:
    order = {n: i for i, n in enumerate(IMPLS)}
    return sorted(rs, key=lambda r: (int(r["world_size"]), int(r["T"]), order.get(r["impl"], 9)))


def markdown(rows: list[dict], env: dict, commit: str) -> list[str]:
    """The page (see the module docstring) from the rows of one GPU and commit."""
    idx = _index(rows)
    sizes = sorted({int(r["world_size"]) for r in rows})
    dates = sorted(r.get("date", "") for r in rows)
    L = [f"# Context parallelism across GPUs: ours vs FLA KCP vs FlashQLA CP ({env.get('gpu', '')})", "",
         "| | |", "| --- | --- |"]
    L += [f"| {f} | {env.get(f, '')} |" for f in ENV_FIELDS]
    L += [f"| world sizes | {', '.join(str(w) for w in sizes)} |", f"| our commit | {commit} |",
          f"| date (UTC) | {dates[0]} to {dates[-1]} |" if dates else "| date (UTC) | |", "", "## Method", ""]
    sources = {}
    for r in rows:
        if r.get("source"):
            sources.setdefault((r["impl"], int(r["world_size"]) > 1), r["source"])
    cps = sorted({r.get("cp", "") for r in rows if r["impl"] == "ours" and r.get("cp")})
    iters = sorted({(r.get("iters", ""), r.get("warmup", "")) for r in rows if r.get("iters")})
    L += ["- " + x for x in (
        "Produced by `python -m flashqla.bench --multigpu` (`flashqla.bench.multigpu`, whose docstring has the details); "
        "one sequence per row, K = V = 128, bf16 q/k/v/do, fp32 g and beta, value head 0 at g = 0; NCCL with "
        "NCCL_NVLS_ENABLE=0.",
        "W = 1: each implementation's single-GPU op; W > 1: its cross-GPU CP, T / W tokens per rank. Wall clock around "
        "synchronised calls, a barrier before each iteration, the slowest rank per iteration, median of "
        + (", ".join(f"{i} iterations after {w} warm-up" for i, w in iters) or "the iterations") + ". step = forward + "
        "backward with a fixed do; bwd = step - fwd; tokens/s = T / step.",
        "Strong scaling: the same T on 1..W GPUs, speed-up = time at 1 GPU / time at W, efficiency = speed-up / W. "
        "Weak scaling: the same T per rank, speed-up = throughput at W / throughput at 1, efficiency = time at 1 / "
        "time at W. Both against the same implementation's W = 1 row.",
        "All-gathers: bytes sent per rank per training step (forward + backward); ours from "
        "`flashqla.distributed.exchange_bytes`, the peers' from reading their sources; times of the same all-gathers "
        "alone. op - local: ours' time minus the same call with its two state all-gathers replaced by a local copy. "
        "Every implementation issues its collectives without async_op and uses their results at once (no side "
        "stream), so none overlaps communication with local work; op - local is what the all-gathers and the wait "
        "for the slowest rank add.",
        "Peak: torch.cuda.max_memory_allocated after the timed calls, largest rank (shard inputs, do and gradients "
        "included).",
        "Gate before timing: fp64 reference (`reference.chunk_gated_delta_rule` with its backward, equal to the token "
        "recurrence to 1e-12) on `gate_tokens` x W tokens; every rank's o, gradients and (where returned, on the last "
        "rank) final state; relative RMS <= 1e-2, dg <= 3e-2; a failing implementation is not timed.",
        "Ours' intra-device CP mode: " + (", ".join(cps) or "-") + " (the gate forces the split unless off).",
    )]
    for (impl, multi), src in sorted(sources.items()):
        L.append(f"- {LABELS.get(impl, impl)} ({'W > 1' if multi else 'W = 1'}): {src}")
    L += ["", "## Targets", ""] + targets(rows)
    for kind, title in (("strong", "Strong scaling (fixed T)"), ("weak", "Weak scaling (fixed T per rank)")):
        L += ["", f"## {title}", ""]
        groups = _groups(rows, kind)
        if not groups:
            L.append("No rows yet.")
            continue
        L += [_TABLE_HEAD, _TABLE_RULE]
        for key in sorted(groups, key=lambda k: (k[2], k[1], k[0])):
            L += [_table_line(r, idx, kind) for r in _sorted(groups[key])]
    in_tables = {id(r) for kind in ("strong", "weak") for v in _groups(rows, kind).values() for r in v}
    other = [r for r in rows if id(r) not in in_tables]
    if other:
        L += ["", "## Other rows (one world size only)", "", _TABLE_HEAD, _TABLE_RULE]
        L += [_table_line(r, idx, "strong") for r in _sorted(other)]
    L += ["", "## Gate", "", "| impl | heads | GPUs | gate tokens | verdict | errors (relative RMS, largest rank) |",
          "| --- | --- | ---: | ---: | --- | --- |"]
    seen = set()
    for r in sorted(rows, key=lambda r: (IMPLS.index(r["impl"]) if r["impl"] in IMPLS else 9, int(r["h_v"]),
                                         int(r["h_qk"]), int(r["world_size"]))):
        key = (r["impl"], r["h_qk"], r["h_v"], r["world_size"])
        if key in seen or not r.get("gate"):
            continue
        seen.add(key)
        L.append(f"| {LABELS.get(r['impl'], r['impl'])} | {r['h_qk']}/{r['h_v']} | {r['world_size']} | "
                 f"{r.get('gate_tokens', '')} | {r['gate']} | {r.get('gate_errs', '')} |")
    return L


def plot_scaling(rows: list[dict], path) -> Path | None:
    """Training-step tokens/s against GPUs (log2 x, log y), strong and weak scaling side by side, one
    line per implementation and configuration (colour: implementation), dashed ideal scaling from
    ours' one-GPU point. None when nothing to draw or matplotlib is absent."""
    from flashqla.bench.plots import _save, pyplot

    plt = pyplot()
    if plt is None:
        return None
    idx = _index(rows)
    panels = [(k, _groups(rows, k)) for k in ("strong", "weak")]
    if not any(g for _, g in panels):
        return None
    fig, axes = plt.subplots(1, 2, figsize=(12, 4.6), squeeze=False)
    styles = ("o-", "s-", "^-", "D-", "v-", "P-", "X-", "*-", "h-")
    for ax, (kind, groups) in zip(axes.flat, panels):
        for j, key in enumerate(sorted(groups, key=lambda k: (k[2], k[1], k[0]))):
            H, HV, n = key
            cfg = f"{H}/{HV} {'T' if kind == 'strong' else 'T/rank'}={n:,}"
            for impl in IMPLS:
                pts = sorted((int(r["world_size"]), _n(r, "step_tok_s")) for r in groups[key]
                             if r["impl"] == impl and _ok(r))
                if not pts:
                    continue
                ax.plot([p[0] for p in pts], [p[1] for p in pts], styles[j % len(styles)], color=COLORS.get(impl),
                        label=f"{LABELS.get(impl, impl)} {cfg}", markersize=4)
                base = idx.get((impl, H, HV, n, 1))
                if impl == "ours" and _ok(base):
                    ws = sorted({int(r["world_size"]) for r in groups[key]})
                    ax.plot(ws, [w * _n(base, "step_tok_s") for w in ws], "--", color=COLORS.get(impl), alpha=0.5,
                            linewidth=1)
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("GPUs")
        ax.set_ylabel("training step, tokens/s")
        ax.set_title(f"{kind} scaling" + (" (fixed T)" if kind == "strong" else " (fixed T per rank)")
                     + "; dashed: ideal, ours")
        ax.grid(alpha=0.3, which="both")
        if ax.get_legend_handles_labels()[0]:
            ax.legend(fontsize=6)
    return _save(plt, fig, path)


def write_page(csv_path, md_path, png_path=None, commit: str | None = None) -> list[Path]:
    """The page (and, with `png_path`, the plot) from the CSV's rows of the latest GPU and commit
    (or `commit`). Returns the files written (none when the CSV has no rows)."""
    rows, env, commit = latest_rows(S.read_rows(csv_path), commit)
    if not rows:
        return []
    md = Path(md_path)
    md.parent.mkdir(parents=True, exist_ok=True)
    out = [md]
    lines = markdown(rows, env, commit)
    if png_path is not None:
        png = plot_scaling(rows, png_path)
        if png is not None:
            lines[lines.index("## Targets") - 1:lines.index("## Targets") - 1] = ["", f"![throughput against GPUs]({png.name})"]
            out.append(png)
    md.write_text("\n".join(lines) + "\n")
    return out


def _prefix(results_dir: Path, prefix: str | None) -> str:
    if prefix:
        return prefix
    cands = sorted(p.stem for p in Path(results_dir).glob("*-multigpu.csv"))
    if len(cands) == 1:
        return cands[0]
    if not cands:
        raise SystemExit(f"--multigpu --report-only: no *-multigpu.csv in {results_dir}; run "
                         "`python -m flashqla.bench --multigpu` on a multi-GPU machine first")
    raise SystemExit(f"--multigpu --report-only: several results files in {results_dir}, give --prefix (found: {cands})")


def rebuild_page(results_dir, out_dir, prefix: str | None = None, commit: str | None = None,
                 plot: bool = True) -> list[Path]:
    """`--multigpu --report-only`: `<prefix>.md` (and `.png`) in `out_dir` from `<prefix>.csv` in
    `results_dir` (prefix: the one `*-multigpu.csv` there unless given)."""
    prefix = _prefix(Path(results_dir), prefix)
    out = Path(out_dir)
    return write_page(Path(results_dir) / f"{prefix}.csv", out / f"{prefix}.md",
                      out / f"{prefix}.png" if plot else None, commit)


def console_line(r: dict) -> str:
    """One terminal line per row."""
    head = f"{r['impl']:>9} {r['h_qk']}/{r['h_v']} T={int(r['T']):,} W={r['world_size']}"
    if str(r.get("status")) != "ok":
        return f"{head}: {r.get('status')}"
    return (f"{head}: fwd {float(r['fwd_ms']):.2f} ms, step {float(r['step_ms']):.2f} ms "
            f"({float(r['step_tok_s']) / 1e6:.2f} M tokens/s), peak {S.num(r.get('peak_gib')):.1f} GiB, "
            f"gate {r.get('gate_errs', '')}")


# ---------------------------------------------------------------------------------------- command line


def parse_args(argv=None) -> argparse.Namespace:
    """The `--multigpu` command line (its own flags; `--multigpu` itself is accepted and ignored)."""
    p = argparse.ArgumentParser(prog="python -m flashqla.bench --multigpu",
                                description="context parallelism across GPUs: strong and weak scaling, ours vs FLA "
                                            "KCP vs FlashQLA CP (flashqla.bench.multigpu)")
    p.add_argument("--multigpu", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--gpus", default=",".join(str(w) for w in DEFAULT_GPUS), help="world sizes (default 1,2,4,8)")
    p.add_argument("--configs", nargs="+", default=list(DEFAULT_CONFIGS),
                   help="'H/HV 1xT' rows (default: 16/64, 16/32, 2/8 heads x 4M, 1M, 16M tokens)")
    p.add_argument("--impls", default=",".join(IMPLS), help="comma-separated from ours,fla,flash_qla (default all)")
    p.add_argument("--scaling", choices=("strong", "weak", "both"), default="both")
    p.add_argument("--cp", choices=("off", "auto", "on"), default="auto", help="our intra-device CP mode (default auto)")
    p.add_argument("--iters", type=int, default=5)
    p.add_argument("--warmup", type=int, default=2)
    p.add_argument("--comm-iters", type=int, default=20, help="iterations of the all-gathers timed alone")
    p.add_argument("--gate-tokens", type=int, default=2048, help="tokens per rank of the gate's instance (default 2048)")
    p.add_argument("--tol", type=float, default=1e-2, help="gate tolerance, relative RMS (dg: max(3e-2, 3 tol))")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--time-budget", type=float, default=None, metavar="S", help="start no new row after S seconds")
    p.add_argument("--force", action="store_true", help="re-measure rows already in the CSV")
    p.add_argument("--results-dir", type=Path, default=None, help="folder of the CSV (default benchmarks/results)")
    p.add_argument("--out-dir", type=Path, default=None, help="folder of the page (default: the results folder; "
                   "--report-only without --results-dir: benchmarks/out)")
    p.add_argument("--prefix", default=None, help="file prefix (default <gpu>-multigpu)")
    p.add_argument("--commit", default=None, help="our commit id (default: git); with --report-only the rows' commit")
    p.add_argument("--no-plot", action="store_true")
    p.add_argument("--list", action="store_true", help="print the selected rows and exit")
    p.add_argument("--report-only", action="store_true", help="rebuild the page from the CSV and exit")
    a = p.parse_args(argv)
    for flag, least in (("iters", 1), ("warmup", 0), ("comm_iters", 1), ("gate_tokens", 1)):
        if getattr(a, flag) < least:  # the ranks would all fail the same way, one respawn per row
            p.error(f"--{flag.replace('_', '-')} must be >= {least}, got {getattr(a, flag)}")
    if not a.tol > 0:
        p.error(f"--tol must be > 0, got {a.tol}")
    a.impls = tuple(n.strip() for n in str(a.impls).split(",") if n.strip())
    bad = [n for n in a.impls if n not in IMPLS]
    if bad:
        p.error(f"unknown implementation(s) {bad}; choose from {','.join(IMPLS)}")
    try:
        a.gpus = parse_gpus(a.gpus)
        a.points = select_points(a.configs, a.gpus, a.scaling)
    except ValueError as exc:
        p.error(str(exc))
    return a


def _set_nccl_env() -> None:
    for k, v in NCCL_ENV.items():
        os.environ.setdefault(k, v)


def main(argv=None, commit_of: Callable[[str | None, str], str] | None = None) -> int:
    """`python -m flashqla.bench --multigpu ...` (see the module docstring). `commit_of(explicit,
    mode)`: our commit column (`__main__` passes git's, with "+cp-<mode>"); without it --commit or
    "unknown". Returns 0, 1 when a row of ours failed its gate, 2 without CUDA for a measuring run."""
    start = time.time()
    a = parse_args(argv)
    results = Path(a.results_dir) if a.results_dir is not None else RESULTS_DIR
    if a.list:
        print(f"{len(a.points)} points x {len(a.impls)} implementations ({', '.join(a.impls)})")
        for p in a.points:
            print(f"  {p.h_qk:>3}/{p.h_v:<3} T={p.T:>11,} W={p.world_size} T/rank={p.tokens_per_rank:>11,} {p.scaling}")
        return 0
    if a.report_only:
        out = a.out_dir if a.out_dir is not None else (results if a.results_dir is not None else OUT_DIR)
        written = rebuild_page(results, out, a.prefix, a.commit, plot=not a.no_plot)
        print("wrote " + ", ".join(str(p) for p in written) if written else "no rows in the CSV")
        return 0
    import torch

    if not torch.cuda.is_available():
        print("python -m flashqla.bench --multigpu needs CUDA GPUs (torch.cuda.is_available() is False); use --list "
              "or --report-only", file=sys.stderr)
        return 2
    _set_nccl_env()
    setup = Setup(cp=a.cp, iters=a.iters, warmup=a.warmup, comm_iters=a.comm_iters, gate_tokens=a.gate_tokens,
                  tol=a.tol, seed=a.seed)
    env = environment(setup)
    commit = commit_of(a.commit, a.cp) if commit_of is not None else (a.commit or "unknown")
    prefix = a.prefix or f"{gpu_slug(env['gpu'])}-multigpu"
    csv_path = results / f"{prefix}.csv"
    pages = Path(a.out_dir) if a.out_dir is not None else results
    available = torch.cuda.device_count()
    print(f"# {available} x {env['gpu']} | torch {env['torch']} | NCCL {env['nccl']} | commit {commit} | "
          f"NCCL_NVLS_ENABLE={os.environ.get('NCCL_NVLS_ENABLE')} | {len(a.points)} points x {','.join(a.impls)}")
    if "ours" in a.impls:
        try:
            precompile({(p.h_qk, p.h_v) for p in a.points}, a.cp)
        except Exception as exc:  # the gate will say what is wrong; the peers still run
            print(f"precompile failed ({type(exc).__name__}: {exc}); continuing", file=sys.stderr)
    budget = a.time_budget

    def page():
        return write_page(csv_path, pages / f"{prefix}.md", None if a.no_plot else pages / f"{prefix}.png")

    summary = run(a.points, a.impls, setup, env, commit, csv_path, available=available,
                  device_bytes=torch.cuda.get_device_properties(0).total_memory, force=a.force,
                  time_budget=None if budget is None else max(0.0, budget - (time.time() - start)),
                  after_world_size=page)
    written = page()
    print(f"measured {summary['measured']} row(s); wrote {', '.join(str(p) for p in written) or 'nothing'}")
    rows, _, _ = latest_rows(S.read_rows(csv_path), commit)
    return 1 if any(r["impl"] == "ours" and str(r.get("status", "")).startswith("gate failed") for r in rows) else 0

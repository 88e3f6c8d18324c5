"""The implementations timed side by side (ours and the peers), and the environment that keys them.

`TABLE` holds one `Entry` per implementation; adding a peer is adding an entry:

- `name` (CSV column prefix, and its version's column in the environment key), `label`, `color`;
- availability: its loaders import it and raise (`ImportError`, or `Unavailable` with the reason)
  when it cannot run here; the reason goes to the tables as "n/a" and to the page's method;
- version: `dists`, the distributions whose installed version keys its cached timings (none for
  ours, whose rows are keyed by our commit);
- calls: `forward(cp=...) -> (fn, source)` with `fn(x) -> (o, final_state)` for the forward
  benchmark, and `train(cp=...) -> (fwd, bwd, source)` for the backward benchmark (`fwd(x) ->
  FwdOut(o, final_state, saved)`, `bwd(x, saved) -> (dq, dk, dv, dg, dbeta, dh0)`, the split its own
  autograd function makes); `source` names the calls for the page's method; either may be None
  (the benchmark it serves then lists it as "n/a");
- what it supports beyond that: `supports(row) -> bool` (rows it cannot run are "not supported").

Every call takes the benchmark's packed-varlen inputs (`inputs.RowInputs`: B = 1, `cu_seqlens` int32,
`initial_state` given, final state returned; `do`, `dht` for the backward) and runs under
`torch.no_grad()`. The backward calls use the internal entry points rather than `torch.autograd`,
for all three alike: the same kernels as a training step, without the autograd engine's per-call
bookkeeping (which a CUDA graph would not replay anyway).

- `ours`: forward the public op `chunk_gated_delta_rule` (with the host copy of the offsets, the
  planner's length hint); backward `chunk_gated_delta_rule_fwd(keep_cp_states=True)` then
  `chunk_gated_delta_rule_bwd` with its `cp_saved` (what the op's autograd calls). Both in the
  context-parallel mode `cp` given to the loader. The imports of flashqla's internals are in
  `_ours_forward` and `_ours_train`, nowhere else in the benchmark.
- `fla`: FLA 0.6.0. Forward: its public `chunk_gated_delta_rule` on its Triton kernels; with
  `flash_qla` installed FLA would hand the op to FlashQLA (its `FlashQLABackend` dispatch), so
  `FLA_FLASH_QLA=0` is set before the import and the dispatch target is checked (another target:
  not available). Not under `torch.inference_mode()`, which would let `FLA_INTRACARD_CP` reroute its
  state pass. Backward: `chunk_gated_delta_rule_fwd` / `chunk_gated_delta_rule_bwd` exactly as its
  `ChunkGatedDeltaRuleFunction` calls them (g_cum in log2 units, bf16 A, `chunk_indices` from
  `prepare_chunk_indices`); its dqkwg goes to the first enabled backend of its `common` registry
  (listed in the method).
- `flash_qla`: FlashQLA 0.1.3. Forward: its public `chunk_gated_delta_rule` with its defaults
  (`auto_cp=True`: its intra-card CP plan, cached by tensor identity, so a CUDA graph replays it).
  Backward: `chunk_gated_delta_rule_fwd(auto_cp=True, is_train=True, enable_fwd_cp_cache=True)` /
  `chunk_gated_delta_rule_bwd(auto_cp=True, cp_cache=...)`, as its autograd function calls them in
  training; `tl.disable_buffer_init_check` is added to the pass configs of the TileLang kernels of
  its `fused_bwd` and `cp_bwd` modules first (TileLang 0.1.15's buffer-initialisation check, a
  diagnostic pass, trips on its fused backward).

- `flashinfer`: FlashInfer 0.7.2.post1, forward only (it has no backward). Its public
  `flashinfer.gdn_prefill.chunk_gated_delta_rule` (the sm_90 CuTe-DSL kernel that vLLM and SGLang
  call on Hopper) with `use_cp="auto"` (its own context-parallel kernels where sequences x value
  heads leave SMs idle) and `max_seqlen` = the row's longest sequence (its host-side CP hint, as the
  planner's hint ours gets). Its inputs in its own layout, made once per row outside the timed call
  (what an engine holds already): q/k/v without the batch dimension, alpha = exp(g) fp32 `[T, HV]`,
  beta fp32 `[T, HV]`, the initial state transposed to `[N, HV, V, K]` fp32. Each call allocates its
  final state (`output_state`, which it requires) as ours allocates its own; its outputs go back
  to FLA's layout as views (o[None], the state's last two axes swapped; no copy). It runs K = V = 128 with
  HV a multiple of H, which every row of the grids is.

The environment key (`ENV_FIELDS`): GPU name, driver, CUDA (torch's build), torch, triton, tilelang,
then each peer's version. A result row is keyed by all of it and our commit; a peer's cached timing
by the fields before the peers and that peer's own version (`store.PeerCache`).
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import types
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

__all__ = [
    "Entry", "TABLE", "ENTRIES", "IMPLS", "PEERS", "LABELS", "COLORS", "BASE_ENV_FIELDS", "ENV_FIELDS",
    "FLA_ENV_VARS", "Unavailable", "FwdOut", "Impl", "load_impls", "plan_sources", "collect_env", "dist_version",
    "gpu_slug", "impls_for", "peers_for", "flashinfer_inputs", "fla_dispatch_target", "fla_bwd_dispatch", "patch_flash_qla_bwd", "BUFFER_INIT_CHECK",
]


class Unavailable(RuntimeError):
    """Raised by a loader when its implementation cannot run here; the message is the reason."""


class FwdOut(NamedTuple):
    """A forward's output `o` [1, T, HV, V], final state [N, HV, K, V] fp32, and what its backward
    consumes (`saved`, implementation-specific)."""

    o: Any
    ht: Any
    saved: Any


def _always(row) -> bool:
    return True


@dataclass(frozen=True)
class Entry:
    """One implementation of the table (see the module docstring for each field)."""

    name: str
    label: str
    color: str
    dists: tuple[str, ...] = ()
    module: str | None = None
    forward: Callable[..., tuple] | None = None
    train: Callable[..., tuple] | None = None
    supports: Callable[[Any], bool] = _always

    def version(self) -> str:
        """The installed version of its first distribution found (else the module's `__version__` if
        it is already imported), or "absent"."""
        return dist_version(*self.dists, module=self.module)


# ---------------------------------------------------------------------------------------- ours


def _ours_forward(cp: str = "auto", **_) -> tuple[Callable, str]:
    try:
        from flashqla.ops.gdn.api import chunk_gated_delta_rule as op
    except ImportError as exc:
        raise ImportError(f"flashqla.ops.gdn.api.chunk_gated_delta_rule: {exc}") from exc

    def run(x):  # the host copy of the offsets is the planner's length hint (no device read)
        return op(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0, output_final_state=True, cu_seqlens=x.cu_seqlens,
                  cu_seqlens_cpu=x.cu_seqlens_cpu, cp=cp)

    return run, (f"`flashqla.ops.gdn.api.chunk_gated_delta_rule` with cp={cp!r} (intra-device context parallelism, "
                 "`flashqla.cp`)")


def _ours_train(cp: str = "auto", **_) -> tuple[Callable, Callable, str]:
    from flashqla.contract import max_seqlen_hint, planning_seqlens
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd as bwd_fn
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd as fwd_fn

    def fwd(x):  # the lengths are the planner's host-side hints (no device read), as the public op's
        sl = planning_seqlens(x.cu_seqlens_cpu, x.cu_seqlens, x.q.shape[1])
        ms = max_seqlen_hint(sl)
        f = fwd_fn(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, True, x.cu_seqlens, max_seqlen=ms, keep_cp_states=True,
                   seqlens=sl, cp=cp)
        return FwdOut(f.o, f.final_state, f)

    def bwd(x, f):
        sl = planning_seqlens(x.cu_seqlens_cpu, x.cu_seqlens, x.q.shape[1])
        ms = max_seqlen_hint(sl)
        return tuple(bwd_fn(f.q, f.k, x.v, x.g, x.beta, f.A, f.g_cum_log2, x.do, x.dht, x.scale, x.h0, x.cu_seqlens,
                            max_seqlen=ms, cp_saved=f.cp_saved, seqlens=sl, cp=cp))

    return fwd, bwd, ("forward `flashqla.ops.gdn.fwd.chunk_gated_delta_rule_fwd(keep_cp_states=True)`, backward "
                      "`flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd` with its `cp_saved` (what the public op's "
                      f"autograd does outside torch.compile), intra-device context-parallel mode cp={cp!r} "
                      "(`flashqla.cp`)")


# ---------------------------------------------------------------------------------------- FLA

#: FLA switches that change which kernels it runs; recorded in the page's method.
FLA_ENV_VARS = ("FLA_FLASH_QLA", "FLA_TILELANG", "FLA_DISABLE_BACKEND_DISPATCH", "FLA_INTRACARD_CP")


def _fla_env() -> str:
    return ", ".join(f"{v}={os.environ.get(v, '(unset)')}" for v in FLA_ENV_VARS)


def fla_dispatch_target() -> str:
    """The backend FLA's `gated_delta_rule` dispatch picks first ("triton" when none is enabled;
    "unknown" when FLA's internals differ from 0.6.0's)."""
    try:
        from fla.backends import _load_operation_registry

        active = _load_operation_registry("gated_delta_rule").get_active()
        return "triton" if active is None else active.backend_type
    except Exception:
        return "unknown"


def fla_bwd_dispatch() -> str:
    """The backends FLA's `common` operations would try first, in order, with whether each is
    available and enabled (dqkwg goes to the first that accepts it); 'unknown' when FLA's internals
    differ from 0.6.0's."""
    try:
        from fla.backends import _load_operation_registry

        reg = _load_operation_registry("common")
        parts = []
        for b in reg._get_sorted_backends():
            on = b.is_available() and b.is_enabled()
            parts.append(f"{b.backend_type} ({'on' if on else 'off'})")
        return ", ".join(parts) + ", else triton" if parts else "triton"
    except Exception:
        return "unknown"


def _fla_forward(**_) -> tuple[Callable, str]:
    os.environ["FLA_FLASH_QLA"] = "0"
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as op

    target = fla_dispatch_target()
    if target not in ("triton", "unknown"):
        raise Unavailable(f"FLA would dispatch to {target}")

    def run(x):
        return op(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0, output_final_state=True, cu_seqlens=x.cu_seqlens)

    return run, (f"public `fla.ops.gated_delta_rule.chunk_gated_delta_rule` under `torch.no_grad()`; env {_fla_env()}; "
                 f"gated_delta_rule dispatch target: {target}")


def _fla_train(**_) -> tuple[Callable, Callable, str]:
    os.environ["FLA_FLASH_QLA"] = "0"
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_bwd as fla_bwd
    from fla.ops.gated_delta_rule.chunk import chunk_gated_delta_rule_fwd as fla_fwd
    from fla.ops.utils.index import prepare_chunk_indices

    def fwd(x):
        ci = prepare_chunk_indices(x.cu_seqlens, 64)
        g_cum, o, A, ht, h0, _ = fla_fwd(q=x.q, k=x.k, v=x.v, g=x.g, beta=x.beta, scale=x.scale, initial_state=x.h0,
                                         output_final_state=True, cu_seqlens=x.cu_seqlens, chunk_indices=ci)
        return FwdOut(o, ht, (g_cum, A, h0, ci))

    def bwd(x, saved):
        g_cum, A, h0, ci = saved
        dq, dk, dv, db, dg, dh0 = fla_bwd(q=x.q, k=x.k, v=x.v, g=g_cum, beta=x.beta, A=A, scale=x.scale,
                                          initial_state=h0, do=x.do, dht=x.dht, cu_seqlens=x.cu_seqlens,
                                          chunk_indices=ci)[:6]
        return dq, dk, dv, dg, db, dh0

    return fwd, bwd, ("`fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_fwd` / `chunk_gated_delta_rule_bwd` "
                      f"with `chunk_indices` (what its autograd function calls); env {_fla_env()}; `common` backends "
                      f"in order: {fla_bwd_dispatch()}")


# ---------------------------------------------------------------------------------------- FlashQLA

#: The TileLang pass config that turns the buffer-initialisation check off.
BUFFER_INIT_CHECK = "tl.disable_buffer_init_check"
#: FlashQLA modules whose kernels get that pass config.
FLASH_QLA_BWD_MODULES = (
    "flash_qla.ops.gated_delta_rule.chunk.hopper.fused_bwd",
    "flash_qla.ops.gated_delta_rule.chunk.hopper.cp_bwd",
)


def patch_flash_qla_bwd(modules=FLASH_QLA_BWD_MODULES, key=BUFFER_INIT_CHECK) -> list[str]:
    """Adds `key: True` to the pass configs of every TileLang JIT object (anything with
    `pass_configs` and a `compile` method) in `modules`, before they compile. Returns the patched
    names (`module.attr`); a module that does not import is skipped."""
    patched = []
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        for attr, obj in list(vars(mod).items()):
            if isinstance(obj, (type, types.ModuleType)) or not hasattr(obj, "pass_configs"):
                continue
            if not callable(getattr(obj, "compile", None)):
                continue
            configs = dict(obj.pass_configs or {})
            configs[key] = True
            obj.pass_configs = configs
            patched.append(f"{name.rsplit('.', 1)[-1]}.{attr}")
    return patched


def _flash_qla_forward(**_) -> tuple[Callable, str]:
    import flash_qla

    op = flash_qla.chunk_gated_delta_rule

    def run(x):
        return op(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0, output_final_state=True, cu_seqlens=x.cu_seqlens)

    return run, ("public `flash_qla.chunk_gated_delta_rule` with its defaults (`auto_cp=True`, its intra-card "
                 "context parallelism)")


def _flash_qla_train(**_) -> tuple[Callable, Callable, str]:
    from flash_qla import chunk_gated_delta_rule_bwd as qla_bwd
    from flash_qla import chunk_gated_delta_rule_fwd as qla_fwd

    patched = patch_flash_qla_bwd()

    def fwd(x):
        g_cum, A, o, _h, ht, cp_cache = qla_fwd(x.q, x.k, x.v, x.g, x.beta, scale=x.scale, initial_state=x.h0,
                                                cu_seqlens=x.cu_seqlens, output_final_state=True, output_h=False,
                                                auto_cp=True, enable_fwd_cp_cache=True, is_train=True)
        return FwdOut(o, ht, (g_cum, A, cp_cache))

    def bwd(x, saved):
        g_cum, A, cp_cache = saved
        dq, dk, dv, db, dg, dh0 = qla_bwd(x.q, x.k, x.v, g_cum, x.beta, A, x.do, x.dht, scale=x.scale,
                                          initial_state=x.h0, cu_seqlens=x.cu_seqlens, auto_cp=True,
                                          cp_cache=cp_cache)
        return dq, dk, dv, dg, db, dh0

    return fwd, bwd, ("`flash_qla.chunk_gated_delta_rule_fwd(auto_cp=True, is_train=True, enable_fwd_cp_cache=True)` / "
                      "`flash_qla.chunk_gated_delta_rule_bwd(auto_cp=True, cp_cache=...)`; "
                      f"`{BUFFER_INIT_CHECK}` added to {', '.join(patched) or 'no kernel (modules not found)'}")


# ---------------------------------------------------------------------------------------- FlashInfer


def flashinfer_inputs(x) -> dict:
    """FlashInfer's arguments for row `x` (an `inputs.RowInputs`, FLA layout): q/k/v `[T, *, 128]`,
    `g` = alpha = exp(g) fp32 `[T, HV]` (its gate is the decay factor, not its log), beta fp32
    `[T, HV]`, `initial_state` `[N, HV, V, K]` fp32, `cu_seqlens`, `max_seqlen` (host int)."""
    return dict(q=x.q[0], k=x.k[0], v=x.v[0], g=x.g[0].float().exp().contiguous(),
                beta=x.beta[0].float().contiguous(), initial_state=x.h0.transpose(-1, -2).contiguous(),
                cu_seqlens=x.cu_seqlens, max_seqlen=max(max(x.lengths), 1), scale=x.scale)


def _flashinfer_forward(**_) -> tuple[Callable, str]:
    try:
        from flashinfer.gdn_prefill import chunk_gated_delta_rule as op
    except ImportError as exc:
        raise ImportError(f"flashinfer.gdn_prefill: {exc}") from exc
    import torch

    last: dict = {}  # the latest row's converted inputs (the runner calls one row at a time)

    def run(x):
        if last.get("x") is not x:
            last.clear()
            last.update(x=x, args=flashinfer_inputs(x))
        a = last["args"]
        h0 = a["initial_state"]
        ht = torch.empty_like(h0)
        o, ht = op(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=a["scale"], initial_state=h0,
                   output_final_state=True, cu_seqlens=a["cu_seqlens"], output_state=ht, use_cp="auto",
                   max_seqlen=a["max_seqlen"])
        return o.unsqueeze(0), ht.transpose(-1, -2)

    return run, ("public `flashinfer.gdn_prefill.chunk_gated_delta_rule(use_cp=\"auto\", max_seqlen=<longest sequence>)` "
                 "on its inputs in its own layout (alpha = exp(g), state [N, HV, V, K], made once per row outside "
                 "the timed call), its final state allocated per call")


# ---------------------------------------------------------------------------------------- the table

#: Every implementation, in table order (ours first).
TABLE: tuple[Entry, ...] = (
    Entry("ours", "ours", "tab:red", forward=_ours_forward, train=_ours_train),
    Entry("fla", "FLA", "tab:blue", dists=("fla-core", "flash-linear-attention"), module="fla",
          forward=_fla_forward, train=_fla_train),
    Entry("flash_qla", "FlashQLA", "tab:green", dists=("flash-qla", "flash_qla"), module="flash_qla",
          forward=_flash_qla_forward, train=_flash_qla_train),
    Entry("flashinfer", "FlashInfer", "tab:purple", dists=("flashinfer-python", "flashinfer"), module="flashinfer",
          forward=_flashinfer_forward),
)
ENTRIES = {e.name: e for e in TABLE}
#: Implementation names (CSV column prefixes), in table order; the peers are all but ours.
IMPLS = tuple(e.name for e in TABLE)
PEERS = tuple(e.name for e in TABLE if e.name != "ours")
LABELS = {e.name: e.label for e in TABLE}
COLORS = {e.name: e.color for e in TABLE}


def impls_for(direction: str) -> tuple[str, ...]:
    """The implementations with a call for `direction` ("fwd": a forward, "bwd": a backward), in table
    order: the columns of that benchmark's CSV and pages."""
    if direction not in ("fwd", "bwd"):
        raise ValueError(f"direction must be 'fwd' or 'bwd', got {direction!r}")
    return tuple(e.name for e in TABLE if (e.forward if direction == "fwd" else e.train) is not None)


def peers_for(direction: str) -> tuple[str, ...]:
    """`impls_for(direction)` less ours."""
    return tuple(n for n in impls_for(direction) if n != "ours")


#: The environment key: the platform, then one version column per peer, in CSV order.
BASE_ENV_FIELDS = ("gpu", "driver", "cuda", "torch", "triton", "tilelang")
ENV_FIELDS = BASE_ENV_FIELDS + PEERS


@dataclass
class Impl:
    """One loaded implementation: `fn(x) -> (o, final_state)` (forward benchmark) or `fwd`/`bwd`
    (backward benchmark, see the module docstring); with none of them, `reason` says why. `source`
    names the calls."""

    name: str
    label: str
    fn: Callable | None = None
    fwd: Callable | None = None
    bwd: Callable | None = None
    reason: str | None = None
    source: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def available(self) -> bool:
        return self.fn is not None or (self.fwd is not None and self.bwd is not None)

    def step(self, x):
        """One training step: forward, then backward on its products; returns the gradients."""
        return self.bwd(x, self.fwd(x).saved)


def load_impls(names=IMPLS, direction: str = "fwd", **opts) -> dict[str, Impl]:
    """Loads the named implementations for the forward (`direction` "fwd") or backward ("bwd")
    benchmark, passing `opts` (e.g. `cp="auto"`) to the loaders; one that fails to load is kept with
    its reason ("not available (...)")."""
    out = {}
    for n in names:
        e = ENTRIES[n]
        impl = Impl(n, e.label)
        loader = e.forward if direction == "fwd" else e.train
        try:
            if loader is None:
                raise Unavailable(f"no {'forward' if direction == 'fwd' else 'backward'} in the benchmark's table")
            if direction == "fwd":
                impl.fn, impl.source = loader(**opts)
            else:
                impl.fwd, impl.bwd, impl.source = loader(**opts)
        except Unavailable as exc:
            impl.reason = f"not available ({exc})"
        except Exception as exc:  # ImportError, or a peer refusing this GPU at import
            msg = str(exc).splitlines()[0] if str(exc) else ""
            impl.reason = f"not available ({type(exc).__name__}: {msg})"
        out[n] = impl
    return out


def plan_sources(impls: dict, row, peers: str, cache=None, names=IMPLS) -> dict[str, str]:
    """Where each implementation's result for `row` (a `grid.Row`) comes from: "live" (timed now;
    ours always), "cached" (from `cache`, a `store.PeerCache`, or None when the cache is not used;
    also for a peer not selected in `impls` when the cache has it), "skip" (not selected and not
    cached), "n/a" (not loadable), "unsupported" (its entry's `supports(row)` is False) or
    "not cached" (`peers` == "cached" and no cached result).
    `peers` is the --peers mode: "live", "cached", "auto" (cached when there, else live) or "none";
    `names`: the implementations of the benchmark (`impls_for(direction)`; default all)."""
    plan = {}
    key = row.key
    for name in names:
        impl = impls.get(name)
        if impl is None:  # not selected (--impls): its cached result is still shown when the cache is used
            plan[name] = "cached" if (name != "ours" and cache is not None and cache.get(name, key) is not None) else "skip"
        elif not impl.available:
            plan[name] = "n/a"
        elif not ENTRIES[name].supports(row):
            plan[name] = "unsupported"
        elif name == "ours" or peers == "live":
            plan[name] = "live"
        elif cache is not None and cache.get(name, key) is not None:
            plan[name] = "cached"
        elif peers == "auto":
            plan[name] = "live"
        else:
            plan[name] = "not cached"
    return plan


# ---------------------------------------------------------------------------------------- environment


def dist_version(*names: str, module: str | None = None) -> str:
    """Installed version of the first distribution found among `names` (else `module.__version__`
    if it is already imported), or "absent"."""
    from importlib import metadata

    for n in names:
        try:
            return metadata.version(n)
        except metadata.PackageNotFoundError:
            continue
    if module and module in sys.modules:
        return str(getattr(sys.modules[module], "__version__", "unknown"))
    return "absent"


def _driver_version() -> str:
    try:
        out = subprocess.run(
            ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
            capture_output=True, text=True, timeout=20,
        )
        line = out.stdout.strip().splitlines()
        if out.returncode == 0 and line:
            return line[0].strip()
    except (OSError, subprocess.SubprocessError):
        pass
    return "unknown"


def collect_env() -> dict[str, str]:
    """The environment key of this process (`ENV_FIELDS`; needs CUDA for the GPU name)."""
    import torch

    env = {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "driver": _driver_version(),
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "triton": dist_version("triton", module="triton"),
        "tilelang": dist_version("tilelang", module="tilelang"),
    }
    return env | {name: ENTRIES[name].version() for name in PEERS}


def gpu_slug(name: str) -> str:
    """File-name slug of a GPU name: "NVIDIA H200" -> "h200"."""
    words = [w for w in "".join(c if c.isalnum() else " " for c in name.lower()).split() if w != "nvidia"]
    return "-".join(words) or "gpu"

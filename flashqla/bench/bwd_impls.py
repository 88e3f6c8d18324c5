"""The backward implementations timed side by side, each as a forward and a backward call.

Every implementation is split the way its own autograd function splits a training step: `fwd(x)`
runs the forward and returns `FwdOut(o, final_state, saved)` with what its backward consumes;
`bwd(x, saved)` returns the gradients `(dq, dk, dv, dg, dbeta, dh0)` of
L = <o, do> + <final_state, dht> (dg with respect to the raw per-token gate, after the reverse
chunk-local cumsum). The benchmark times `bwd` alone on one forward's products (the backward
column) and `bwd(x, fwd(x).saved)` (the training-step column), each in a CUDA graph, under
`torch.no_grad()`. The internal entry points are called directly rather than through
`torch.autograd`, for all three alike: the same kernels as a training step, without the autograd
engine's per-call bookkeeping (which a CUDA graph would not replay anyway) and without its
stream rules inside graph capture. Inputs: packed varlen (B = 1, `cu_seqlens` int32),
`initial_state` given, final state returned, `dht` given.

- `ours`: forward `flashqla.ops.gdn.api.chunk_gated_delta_rule_fwd(keep_cp_states=True)` (its `A`,
  `g_cum_log2`, `q`, `k` and `cp_saved` are the saved products; A and g_cum_log2 are None when the
  split forward keeps them in cp_saved, in its segments' layout); backward
  `flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd` (what the op's autograd calls).
- `fla`: FLA 0.6.0's `fla.ops.gated_delta_rule.chunk.chunk_gated_delta_rule_fwd` /
  `chunk_gated_delta_rule_bwd`, exactly as its `ChunkGatedDeltaRuleFunction` calls them (the
  forward's chunk-local cumsum of g in log2 units, its bf16 A, and `chunk_indices` from
  `fla.ops.utils.index.prepare_chunk_indices`, which the autograd function also hands to both).
  Its backward recomputes w, u and h, then runs dv_local, the dh recursion, dqkwg (dispatched to
  FLA's TileLang kernel on Hopper with Triton < 3.7.1, the only path FLA allows there) and the
  WY backward. `FLA_FLASH_QLA=0` is set as in the forward benchmark (the direct calls do not go
  through FLA's `gated_delta_rule` dispatch anyway).
- `flash_qla`: FlashQLA 0.1.3's `flash_qla.chunk_gated_delta_rule_fwd` /
  `chunk_gated_delta_rule_bwd` as its autograd function calls them in training: `auto_cp=True`,
  `is_train=True`, `enable_fwd_cp_cache=True` (the forward caches its context-parallel warm-up
  and corrected states, `cp_cache`, for the backward, which then runs 3 to 5 launches instead of
  recomputing them) and the CP plan that both derive from `cu_seqlens` and the head count
  (cached by tensor identity). Before its backward compiles, `tl.disable_buffer_init_check` is added
  to the pass configs of the TileLang kernels of its `fused_bwd` and `cp_bwd` modules: TileLang
  0.1.15's buffer-initialisation check trips on its fused backward (a diagnostic pass, not a code
  transformation).
"""

from __future__ import annotations

import importlib
import importlib.util
import os
import types
from dataclasses import dataclass, field
from typing import Any, Callable, NamedTuple

from flashqla.bench.peers import IMPLS, LABELS

__all__ = ["FwdOut", "BwdImpl", "load_bwd_impls", "patch_flash_qla_bwd", "ours_bwd_source", "fla_bwd_dispatch",
           "BUFFER_INIT_CHECK"]

#: Where our backward lives (what the op's autograd calls).
OURS_BWD_MODULE = "flashqla.ops.gdn.bwd"
#: The TileLang pass config that turns the buffer-initialisation check off.
BUFFER_INIT_CHECK = "tl.disable_buffer_init_check"
#: FlashQLA modules whose kernels get that pass config.
FLASH_QLA_BWD_MODULES = (
    "flash_qla.ops.gated_delta_rule.chunk.hopper.fused_bwd",
    "flash_qla.ops.gated_delta_rule.chunk.hopper.cp_bwd",
)


class FwdOut(NamedTuple):
    """A forward's output `o` [1, T, HV, V], final state [N, HV, K, V] fp32, and what its backward
    consumes (`saved`, implementation-specific)."""

    o: Any
    ht: Any
    saved: Any


@dataclass
class BwdImpl:
    """One implementation: `fwd(x) -> FwdOut`, `bwd(x, saved) -> (dq, dk, dv, dg, dbeta, dh0)`;
    both None and `reason` set when it could not be loaded. `source` names the calls."""

    name: str
    label: str
    fwd: Callable | None = None
    bwd: Callable | None = None
    reason: str | None = None
    source: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def available(self) -> bool:
        return self.fwd is not None and self.bwd is not None

    def step(self, x):
        """One training step: forward, then backward on its products; returns the gradients."""
        return self.bwd(x, self.fwd(x).saved)


def ours_bwd_source(module: str = OURS_BWD_MODULE) -> tuple[Callable, dict, str]:
    """Our backward: `chunk_gated_delta_rule_bwd` of `module`. Returns (function, extra keyword
    arguments (none), dotted name); ImportError when the module does not have it."""
    try:
        fn = importlib.import_module(module).chunk_gated_delta_rule_bwd
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"no chunk_gated_delta_rule_bwd in {module}: {exc}") from exc
    return fn, {}, f"{module}.chunk_gated_delta_rule_bwd"


def _load_ours() -> tuple[Callable, Callable, str]:
    fwd_fn = importlib.import_module("flashqla.ops.gdn.api").chunk_gated_delta_rule_fwd
    bwd_fn, extra, name = ours_bwd_source()

    from flashqla.contract import max_seqlen_hint, planning_seqlens

    def fwd(x):  # the lengths are the planner's host-side hints (no device read), as the public op's
        sl = planning_seqlens(x.cu_seqlens_cpu, x.cu_seqlens, x.q.shape[1])
        ms = max_seqlen_hint(sl)
        f = fwd_fn(x.q, x.k, x.v, x.g, x.beta, x.scale, x.h0, True, x.cu_seqlens, max_seqlen=ms, keep_cp_states=True,
                   seqlens=sl)
        return FwdOut(f.o, f.final_state, f)

    def bwd(x, f):
        sl = planning_seqlens(x.cu_seqlens_cpu, x.cu_seqlens, x.q.shape[1])
        ms = max_seqlen_hint(sl)
        return tuple(bwd_fn(f.q, f.k, x.v, x.g, x.beta, f.A, f.g_cum_log2, x.do, x.dht, x.scale, x.h0, x.cu_seqlens,
                            max_seqlen=ms, cp_saved=f.cp_saved, seqlens=sl, **extra))

    return fwd, bwd, (f"forward `flashqla.ops.gdn.api.chunk_gated_delta_rule_fwd(keep_cp_states=True)`, backward `{name}`"
                      " with its `cp_saved` (what the public op's autograd does outside torch.compile)")


def _load_fla() -> tuple[Callable, Callable, str]:
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
                      "with `chunk_indices` (what its autograd function calls)")


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


def _load_flash_qla() -> tuple[Callable, Callable, str]:
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


_LOADERS = {"ours": _load_ours, "fla": _load_fla, "flash_qla": _load_flash_qla}


def load_bwd_impls(names=IMPLS) -> dict[str, BwdImpl]:
    """Loads the named implementations; one that fails to import keeps its reason."""
    out = {}
    for n in names:
        impl = BwdImpl(n, LABELS[n])
        try:
            impl.fwd, impl.bwd, impl.source = _LOADERS[n]()
        except Exception as exc:  # ImportError, or a peer refusing this GPU at import
            msg = str(exc).splitlines()[0] if str(exc) else ""
            impl.fwd = impl.bwd = None
            impl.reason = f"not available ({type(exc).__name__}: {msg})"
        out[n] = impl
    return out


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

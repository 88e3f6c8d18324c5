"""The implementations timed side by side, and the environment that keys their timings.

Every implementation is called through FLA's signature on the same packed-varlen inputs
(B = 1, `cu_seqlens` int32, `initial_state` given, `output_final_state=True`) under
`torch.no_grad()`, and returns `(o [1, T, HV, V], final_state [N, HV, K, V] fp32)`:

- `ours`: `flashqla.ops.gdn.api.chunk_gated_delta_rule` (imported lazily; absent -> "not available").
- `fla`: FLA 0.6.0's public `fla.ops.gated_delta_rule.chunk_gated_delta_rule` on its own Triton
  kernels. With `flash_qla` installed FLA would hand the whole op to FlashQLA (its `FlashQLABackend`
  dispatch, priority 3), so `FLA_FLASH_QLA=0` is forced before the call and the dispatch target is
  checked. Not under `torch.inference_mode()`, which would let `FLA_INTRACARD_CP` reroute its state
  pass.
- `flash_qla`: FlashQLA 0.1.3's public `flash_qla.chunk_gated_delta_rule` with its defaults
  (`auto_cp=True`: its gate-free intra-card CP plan, decided per call from `cu_seqlens` and the
  head count; the plan is cached by tensor identity, so a CUDA graph replays it).

The environment key (`ENV_FIELDS`): GPU name, driver, CUDA (torch's build), torch, triton,
tilelang, fla and flash_qla versions. A peer timing is valid for one key; our timings are keyed by
the environment and our commit.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
from dataclasses import dataclass, field
from typing import Callable

__all__ = [
    "ENV_FIELDS",
    "IMPLS",
    "PEERS",
    "Impl",
    "collect_env",
    "dist_version",
    "gpu_slug",
    "load_impls",
    "plan_sources",
    "fla_dispatch_target",
    "FLA_ENV_VARS",
]

#: Columns of the environment key, in CSV order.
ENV_FIELDS = ("gpu", "driver", "cuda", "torch", "triton", "tilelang", "fla", "flash_qla")
#: Implementation names (CSV column prefixes), in table order.
IMPLS = ("ours", "fla", "flash_qla")
PEERS = ("fla", "flash_qla")
#: FLA switches that change which kernels its forward runs; recorded in the report.
FLA_ENV_VARS = ("FLA_FLASH_QLA", "FLA_TILELANG", "FLA_DISABLE_BACKEND_DISPATCH", "FLA_INTRACARD_CP")

LABELS = {"ours": "ours", "fla": "FLA", "flash_qla": "FlashQLA"}


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
    """The environment key of this process (needs CUDA for the GPU name)."""
    import torch

    return {
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else "none",
        "driver": _driver_version(),
        "cuda": str(torch.version.cuda),
        "torch": torch.__version__,
        "triton": dist_version("triton", module="triton"),
        "tilelang": dist_version("tilelang", module="tilelang"),
        "fla": dist_version("fla-core", "flash-linear-attention", module="fla"),
        "flash_qla": dist_version("flash-qla", "flash_qla", module="flash_qla"),
    }


def gpu_slug(name: str) -> str:
    """File-name slug of a GPU name: "NVIDIA H200" -> "h200"."""
    words = [w for w in "".join(c if c.isalnum() else " " for c in name.lower()).split() if w != "nvidia"]
    return "-".join(words) or "gpu"


@dataclass
class Impl:
    """One implementation: `fn(x)` runs it on a `RowInputs` and returns (o, final_state);
    `fn` is None and `reason` says why when it could not be loaded."""

    name: str
    label: str
    fn: Callable | None = None
    reason: str | None = None
    version: str = ""
    notes: list[str] = field(default_factory=list)

    @property
    def available(self) -> bool:
        return self.fn is not None


def _load_ours() -> Callable:
    try:
        op = importlib.import_module("flashqla.ops.gdn.api").chunk_gated_delta_rule
    except (ImportError, AttributeError) as exc:
        raise ImportError(f"flashqla.ops.gdn.api.chunk_gated_delta_rule: {exc}") from exc

    def run(x):  # the host copy of the offsets is the planner's length hint (no device read)
        return op(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0, output_final_state=True, cu_seqlens=x.cu_seqlens,
                  cu_seqlens_cpu=x.cu_seqlens_cpu)

    return run


def _load_fla() -> Callable:
    os.environ["FLA_FLASH_QLA"] = "0"
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as op

    def run(x):
        return op(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0, output_final_state=True, cu_seqlens=x.cu_seqlens)

    return run


def _load_flash_qla() -> Callable:
    import flash_qla

    op = flash_qla.chunk_gated_delta_rule

    def run(x):
        return op(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0, output_final_state=True, cu_seqlens=x.cu_seqlens)

    return run


_LOADERS = {"ours": _load_ours, "fla": _load_fla, "flash_qla": _load_flash_qla}


def plan_sources(impls: dict, key, peers: str, cache=None) -> dict[str, str]:
    """Where each implementation's result for row `key` comes from: "live" (timed now; ours always),
    "cached" (from `cache`, a `store.PeerCache`, or None when the cache is not used; also for a peer
    not selected in `impls` when the cache has it), "skip" (not selected and not cached), "n/a" (not
    importable) or "not cached" (`peers` == "cached" and no cached result).
    `peers` is the --peers mode: "live", "cached", "auto" (cached when there, else live) or "none"."""
    plan = {}
    for name in IMPLS:
        impl = impls.get(name)
        if impl is None:  # not selected (--impls): its cached result is still shown when the cache is used
            plan[name] = "cached" if (name != "ours" and cache is not None and cache.get(name, key) is not None) else "skip"
        elif not impl.available:
            plan[name] = "n/a"
        elif name == "ours" or peers == "live":
            plan[name] = "live"
        elif cache is not None and cache.get(name, key) is not None:
            plan[name] = "cached"
        elif peers == "auto":
            plan[name] = "live"
        else:
            plan[name] = "not cached"
    return plan


def load_impls(names=IMPLS) -> dict[str, Impl]:
    """Loads the named implementations; one that fails to import is kept with its reason."""
    out = {}
    for n in names:
        impl = Impl(n, LABELS[n])
        try:
            impl.fn = _LOADERS[n]()
        except Exception as exc:  # ImportError, or a peer refusing this GPU at import
            impl.reason = f"not available ({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''})"
        out[n] = impl
    return out


def fla_dispatch_target() -> str:
    """The backend FLA's `gated_delta_rule` dispatch picks first ("triton" when none is enabled;
    "unknown" when FLA's internals differ from 0.6.0's)."""
    try:
        from fla.backends import _load_operation_registry

        active = _load_operation_registry("gated_delta_rule").get_active()
        return "triton" if active is None else active.backend_type
    except Exception:
        return "unknown"

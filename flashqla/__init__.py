"""flashqla: Gated DeltaNet chunked prefill for NVIDIA Hopper.

Public ops only. Importing this package never needs a GPU and does not import TileLang: the ops are
resolved on first attribute access and kernels are built at their first launch.

    from flashqla import chunk_gated_delta_rule
    o, final_state = chunk_gated_delta_rule(q, k, v, g, beta, output_final_state=True)
"""

__version__ = "0.1.0"

__all__ = ["__version__", "chunk_gated_delta_rule", "chunk_gated_delta_rule_bwd", "chunk_gated_delta_rule_fwd", "warmup"]

_LAZY = {
    "chunk_gated_delta_rule": "flashqla.ops.gdn.api",
    "chunk_gated_delta_rule_fwd": "flashqla.ops.gdn.fwd",
    "chunk_gated_delta_rule_bwd": "flashqla.ops.gdn.bwd",
    "warmup": "flashqla.ops.gdn.api",
}


#: Subpackages reachable as attributes after `import flashqla` alone (imported on first access), so
#: that e.g. `backend=flashqla.reference.chunk_gated_delta_rule` works without importing them first.
_SUBMODULES = ("reference", "distributed", "integrations", "serving", "testing", "contract", "bench", "verify")


def __getattr__(name):
    import importlib

    if name in _LAZY:
        value = getattr(importlib.import_module(_LAZY[name]), name)
        globals()[name] = value
        return value
    if name in _SUBMODULES:
        try:
            if name == "reference":  # the checkout's top-level package where it is the one beside this flashqla
                from flashqla.faces import face

                return face(name)
            return importlib.import_module(f"flashqla.{name}")
        except ImportError as e:
            raise AttributeError(f"module 'flashqla' has no attribute {name!r} ({e})") from e
    raise AttributeError(f"module 'flashqla' has no attribute {name!r}")


def __dir__():
    return sorted(set(globals()) | set(_LAZY) | set(_SUBMODULES))

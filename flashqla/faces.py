"""The repository's other faces as this process sees them: `reference` (the fp64 PyTorch reference) and
`derivations` (the SymPy-proved rewrites).

An installed flashqla carries them as `flashqla.reference` and `flashqla.derivations` (names that cannot
collide with other packages). In a checkout they are the top-level folders `reference/` and
`derivations/`, imported as `reference` and `derivations` by the tests, the notebooks and the GPU
machine's PYTHONPATH. `face(name)` returns the checkout's top-level package when it is importable and
lies beside this flashqla (so that one process holds one copy of it), else `flashqla.<name>`. Only the
tools import them (`flashqla verify`, the benchmark's fp64 gate, the integrations' CPU path): the op
and its kernels never do.
"""

from __future__ import annotations

import importlib
import importlib.util
import pathlib

__all__ = ["face"]

_FACES = ("reference", "derivations")


def face(name: str):
    """The module of face `name` ("reference" or "derivations"). ValueError for another name;
    ModuleNotFoundError when neither form is importable. A top-level package of that name elsewhere
    (another project's, a plain folder in the working directory) is never imported."""
    if name not in _FACES:
        raise ValueError(f"name must be one of {_FACES}, got {name!r}")
    checkout = pathlib.Path(__file__).resolve().parents[1] / name
    try:
        spec = importlib.util.find_spec(name)
    except (ImportError, ValueError):
        spec = None
    locations = list(spec.submodule_search_locations or []) if spec is not None else []
    if any(pathlib.Path(loc).resolve() == checkout for loc in locations) and spec.origin is not None:
        return importlib.import_module(name)
    return importlib.import_module(f"flashqla.{name}")

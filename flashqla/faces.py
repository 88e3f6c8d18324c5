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
import pathlib

__all__ = ["face"]

_FACES = ("reference", "derivations")


def face(name: str):
    """The module of face `name` ("reference" or "derivations"). ValueError for another name;
    ModuleNotFoundError when neither form is importable."""
    if name not in _FACES:
        raise ValueError(f"name must be one of {_FACES}, got {name!r}")
    checkout = pathlib.Path(__file__).resolve().parents[1] / name
    try:
        mod = importlib.import_module(name)
    except ModuleNotFoundError as exc:
        if exc.name != name:
            raise
    else:
        if pathlib.Path(mod.__file__).resolve().parent == checkout:
            return mod
    return importlib.import_module(f"flashqla.{name}")

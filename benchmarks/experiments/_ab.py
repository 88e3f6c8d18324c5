"""Helpers shared by this folder's same-process A/B scripts (`prepare_ab.py`, `recurrent_ab.py`,
`bwd_ab.py`; not a script): kernel modules of several commits written into variant folders on the CPU
machine (whose checkout has git history) and loaded side by side under names of their own, so that
their kernels compile or load from TileLang's cache in one process."""

from __future__ import annotations

import argparse
import importlib.util
import os
import subprocess
import sys

__all__ = ["KERNEL_PKG", "ab_parser", "extract", "load_variant", "ragged_lengths", "variants"]

#: the folder of the kernel modules, relative to the repository root
KERNEL_PKG = "flashqla/ops/gdn/kernels/sm90"


def ragged_lengths(rng, n: int) -> list[int]:
    """n sequence lengths for a packed batch: every seventh from the edge cases 0, 1, 63, 64, 65, the
    others uniform in [0, 300] (`rng`: a `random.Random`)."""
    return [rng.choice([0, 1, 63, 64, 65]) if i % 7 == 0 else rng.randint(0, 300) for i in range(n)]


def extract(commit: str, folder: str, files: tuple[str, ...]) -> None:
    """Writes `files` (names inside `KERNEL_PKG`) as they are at `commit` into `folder` (git show)."""
    os.makedirs(folder, exist_ok=True)
    for name in files:
        src = subprocess.run(["git", "show", f"{commit}:{KERNEL_PKG}/{name}"], check=True, capture_output=True, text=True).stdout
        with open(os.path.join(folder, name), "w") as f:
            f.write(src)


def _load(mod_name: str, path: str):
    spec = importlib.util.spec_from_file_location(mod_name, path)
    mod = importlib.util.module_from_spec(spec)
    sys.modules[mod_name] = mod
    spec.loader.exec_module(mod)
    return mod


def load_variant(name: str, folder: str, stems: tuple[str, ...]) -> tuple:
    """The modules `stems` (e.g. ("recurrent",)) of the variant in `folder`, each with its `_common`
    import pointed at the folder's `_common.py`; module names are prefixed by the variant's name, and
    each rewritten module is written into the folder (a file: TileLang reads a kernel's source back)."""
    common_name = f"_ab_{name}_common"
    _load(common_name, os.path.join(folder, "_common.py"))
    mods = []
    for stem in stems:
        with open(os.path.join(folder, f"{stem}.py")) as f:
            src = f.read().replace("from flashqla.ops.gdn.kernels.sm90._common import", f"from {common_name} import")
        mod_name = f"_ab_{name}_{stem}"
        path = os.path.join(folder, f"{mod_name}.py")
        with open(path, "w") as f:
            f.write(src)
        mods.append(_load(mod_name, path))
    return tuple(mods)


def ab_parser(doc: str, files: tuple[str, ...]) -> argparse.ArgumentParser:
    """The A/B scripts' common options: --variant NAME=DIR (repeated; the first is the base),
    --extract COMMIT DIR (write `files` of COMMIT into DIR and exit), --precompile-only (build every
    variant's kernels on the CPU machine and exit), --rows I,J (0-based indices of the script's rows)."""
    ap = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    ap.add_argument("--variant", action="append", default=[], metavar="NAME=DIR", help="a variant (the first is the base)")
    ap.add_argument("--extract", nargs=2, metavar=("COMMIT", "DIR"), help=f"write COMMIT's {', '.join(files)} into DIR and exit")
    ap.add_argument("--precompile-only", action="store_true", help="build every variant's kernels (CPU machine) and exit")
    ap.add_argument("--rows", default=None, metavar="I,J", help="only these rows of the script's `rows()` (0-based indices)")
    return ap


def variants(ap: argparse.ArgumentParser, args, files: tuple[str, ...], stems: tuple[str, ...]) -> dict | None:
    """After `ab_parser`'s parse: None once --extract has written its folder (the script then returns),
    else {name: the modules `stems` of that variant} (`load_variant`); at least two variants or an
    argparse error."""
    if args.extract:
        extract(*args.extract, files)
        return None
    mods = {}
    for v in args.variant:
        name, folder = v.split("=", 1)
        mods[name] = load_variant(name, folder, stems)
    if len(mods) < 2:
        ap.error("give at least two --variant NAME=DIR")
    return mods

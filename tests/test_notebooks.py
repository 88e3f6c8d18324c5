"""Executes every notebook in notebooks/ headless (jupytext -> nbclient), at the small size.

A notebook states its claims as asserts, so "it ran" means "its claims hold". The size is picked by
the environment variable FLASHQLA_NB_SIZE (small by default); GPU sections skip themselves on a
machine without a Hopper GPU and say why.
"""

from __future__ import annotations

import os
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
NOTEBOOKS = sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.py"))


@pytest.mark.parametrize("path", NOTEBOOKS, ids=[p.stem for p in NOTEBOOKS])
def test_notebook_executes(path, tmp_path, monkeypatch):
    jupytext = pytest.importorskip("jupytext")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.setenv("FLASHQLA_NB_SIZE", os.environ.get("FLASHQLA_NB_SIZE", "small"))
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("FLASHQLA_NB_FIGURES", str(tmp_path))  # never rewrite the committed figures
    # the kernel starts in notebooks/: it imports this checkout's packages, not an installed copy's
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])))
    nb = jupytext.read(path)
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    client = nbclient.NotebookClient(nb, timeout=600, kernel_name="python3", resources={"metadata": {"path": str(ROOT / "notebooks")}})
    client.execute()
    if "\nfig.savefig(" in path.read_text():  # unconditional figures went to FLASHQLA_NB_FIGURES
        assert any(tmp_path.glob("*.png")), f"{path.name} wrote no figure under FLASHQLA_NB_FIGURES"


def test_there_are_notebooks():
    assert NOTEBOOKS, "notebooks/ holds no NN_name.py notebooks"

"""CPU tests of the committed benchmark pages: they regenerate byte for byte from the committed CSVs
with the commands benchmarks/README.md gives, and neither those commands nor notebook 70 change a
tracked file (they write to the ignored benchmarks/out/ unless asked), whatever the working
directory. The plots are checked for being produced (a PNG each), not for their bytes."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
#: The committed pages and the commands that rebuild them (benchmarks/README.md).
PAGES = ("h200-fwd.md", "h200-cp.md", "h200-bwd.md", "h100-80gb-hbm3-fwd.md", "h100-80gb-hbm3-cp.md",
         "h100-80gb-hbm3-bwd.md")
PLOTS = ("h200-fwd.png", "h200-cp.png", "h200-bwd.png", "h100-80gb-hbm3-fwd.png", "h100-80gb-hbm3-cp.png",
         "h100-80gb-hbm3-bwd.png")
COMMANDS = (("--report-only", "--prefix", "h200-fwd", "--also-commits", "270a0ff+cp-auto"),
            ("--bwd", "--report-only", "--prefix", "h200-bwd"),
            ("--report-only", "--prefix", "h100-80gb-hbm3-fwd", "--also-commits", "a029fcefa6e0+cp-auto"),
            ("--bwd", "--report-only", "--prefix", "h100-80gb-hbm3-bwd"))
NOTEBOOK_FIGURES = ("h200-fwd-times.png", "h200-fwd-roofline.png", "h200-fwd-breakdown.png")


def _bench(args, cwd) -> subprocess.CompletedProcess:
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", *args], capture_output=True, text=True, cwd=cwd)
    assert out.returncode == 0, out.stderr
    return out


def _is_png(path: Path) -> bool:
    return path.is_file() and path.stat().st_size > 10_000 and path.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"


def _tracked_state(repo: Path) -> dict:
    """Every tracked file's (size, mtime): a rewrite with the same bytes shows here, not in git status."""
    return {name: ((repo / name).stat().st_size, (repo / name).stat().st_mtime_ns)
            for name in filter(None, _git(["ls-files", "-z"], repo).split("\0"))}


def _git(args, cwd) -> str:
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, check=True).stdout


@pytest.mark.parametrize("order", [(0, 1, 2, 3), (1, 0, 3, 2)], ids=["fwd-then-bwd", "bwd-then-fwd"])
def test_committed_pages_regenerate_byte_identically(tmp_path, order):
    """Every committed page, rebuilt from the committed CSVs into a fresh folder by the README's
    commands (in either order: the CP page carries both benchmarks' sections), equals the committed
    bytes; every committed plot is drawn again; the committed results are not touched."""
    before = {p.name: p.read_bytes() for p in RESULTS.iterdir() if p.is_file()}
    for i in order:
        _bench([*COMMANDS[i], "--out-dir", str(tmp_path)], ROOT)
    for page in PAGES:
        assert (tmp_path / page).read_bytes() == (RESULTS / page).read_bytes(), page
    for plot in PLOTS:
        assert _is_png(tmp_path / plot), plot
    assert {p.name: p.read_bytes() for p in RESULTS.iterdir() if p.is_file()} == before


@pytest.fixture(scope="module")
def repo_copy(tmp_path_factory) -> Path:
    """The working tree's files (tracked and untracked, less the ignored ones) in a fresh git
    repository with one commit: a checkout whose `git status` the tests can watch."""
    dst = tmp_path_factory.mktemp("repo")
    listed = _git(["ls-files", "-z", "--cached", "--others", "--exclude-standard"], ROOT).split("\0")
    for name in filter(None, listed):
        src = ROOT / name
        if src.is_file():  # a file deleted in the working tree is still listed by --cached
            (dst / name).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(src, dst / name)
    _git(["init", "-q"], dst)
    _git(["add", "-A"], dst)
    _git(["-c", "user.name=test", "-c", "user.email=test@example.com", "commit", "-qm", "copy"], dst)
    assert _git(["status", "--porcelain"], dst) == ""
    return dst


def test_report_commands_leave_the_checkout_clean(repo_copy):
    """The README's rebuild commands, run as given (no folder flags) in a checkout, write the pages to
    the ignored benchmarks/out/ of that checkout (the same bytes as the committed pages) and leave
    `git status --porcelain` empty."""
    out_dir = repo_copy / "benchmarks" / "out"
    shutil.rmtree(out_dir, ignore_errors=True)
    before = _tracked_state(repo_copy)
    for args in COMMANDS:
        printed = _bench(args, repo_copy).stdout
        assert str(out_dir) in printed, printed  # the checkout's own package ran
    assert _git(["status", "--porcelain", "--untracked-files=all"], repo_copy) == ""
    assert _tracked_state(repo_copy) == before  # no committed file rewritten, not even with its own bytes
    for page in PAGES:
        assert (out_dir / page).read_bytes() == (RESULTS / page).read_bytes(), page
    for plot in PLOTS:
        assert _is_png(out_dir / plot), plot


def test_notebook_70_runs_from_anywhere_and_leaves_the_checkout_clean(repo_copy, tmp_path, monkeypatch):
    """Notebook 70 executed with its working directory outside the checkout finds the committed CSVs
    through the package, writes its figures to the checkout's ignored benchmarks/out/, creates nothing
    in the working directory, and leaves `git status --porcelain` empty."""
    jupytext = pytest.importorskip("jupytext")
    nbclient = pytest.importorskip("nbclient")
    monkeypatch.delenv("FLASHQLA_NB_FIGURES", raising=False)
    monkeypatch.setenv("MPLBACKEND", "Agg")
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join(filter(None, [str(repo_copy), os.environ.get("PYTHONPATH")])))
    out_dir = repo_copy / "benchmarks" / "out"
    for name in NOTEBOOK_FIGURES:
        (out_dir / name).unlink(missing_ok=True)
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    before = _tracked_state(repo_copy)
    nb = jupytext.read(repo_copy / "notebooks" / "70_benchmarks.py")
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbclient.NotebookClient(nb, timeout=600, kernel_name="python3",
                            resources={"metadata": {"path": str(elsewhere)}}).execute()
    assert list(elsewhere.iterdir()) == []
    for name in NOTEBOOK_FIGURES:
        assert _is_png(out_dir / name), name
    assert _git(["status", "--porcelain", "--untracked-files=all"], repo_copy) == ""
    assert _tracked_state(repo_copy) == before


def test_notebook_70_names_the_missing_csv(tmp_path):
    """Without the results CSV the notebook's loader fails naming the file it looked for."""
    from flashqla.bench import plots

    with pytest.raises(FileNotFoundError, match=str(tmp_path / "h200-fwd.csv")):
        plots.load(tmp_path, "h200-fwd")

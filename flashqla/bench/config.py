"""The benchmark's options: one frozen dataclass, built by the command line (`__main__.parse_args`)
or directly, and read by the runner and the report.

Folders: the data (results CSVs, the peers' caches, the breakdown) live in `results_dir` (default
`benchmarks/results/`, the committed files); a measuring run appends its rows there. Pages (markdown
and PNG) go to `out_dir`; without it, a measuring run writes them beside its data, and a rebuild
(`report_only`) writes them to `benchmarks/out/` (ignored by git) unless `results_dir` is given, so
rebuilding the pages leaves the committed files alone unless asked (`--results-dir
benchmarks/results`, or `--out-dir benchmarks/results`).
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

from flashqla.bench.gate import GATE_TOL, REF_BATCH
from flashqla.bench.impls import IMPLS
from flashqla.bench.timing import DEFAULTS

__all__ = ["Options", "REPO_ROOT", "RESULTS_DIR", "OUT_DIR"]

#: The repository holding this package (the benchmark is run from a checkout).
REPO_ROOT = Path(__file__).resolve().parents[2]
#: The committed results.
RESULTS_DIR = REPO_ROOT / "benchmarks" / "results"
#: Where rebuilt pages go by default (in .gitignore).
OUT_DIR = REPO_ROOT / "benchmarks" / "out"


@dataclass(frozen=True)
class Options:
    """What to run and how (the command line's flags of the same names; see `python -m flashqla.bench
    --help`). `bwd`: the backward benchmark instead of the forward one; `plot` / `step` are the
    negations of `--no-plot` / `--no-step`, `list_only` is `--list`; `cp`: our context-parallel mode
    ("off", "auto", "on")."""

    bwd: bool = False
    quick: bool = False
    cp_grid: bool = False
    heads: tuple[str, ...] = ()
    mixes: tuple[str, ...] = ()
    peers: str = "auto"
    retime: int = 3
    impls: tuple[str, ...] = IMPLS
    cp: str = "auto"
    breakdown: bool = False
    force: bool = False
    time_budget: float | None = None
    tol: float | None = None
    warmup: int = DEFAULTS["warmup"]
    replays: int = DEFAULTS["replays"]
    target_ms: float = DEFAULTS["target_ms"]
    max_launches: int = DEFAULTS["max_launches"]
    seed: int = 0
    results_dir: Path | None = None
    out_dir: Path | None = None
    prefix: str | None = None
    commit: str | None = None
    plot: bool = True
    list_only: bool = False
    report_only: bool = False
    also_commits: tuple[str, ...] = ()
    verbose: bool = False
    ref: str = "fp64"
    ref_limit: int = 0
    ref_batch: int | None = None
    step: bool = True
    serving: bool = False
    state_dtype: str = "bf16"

    @property
    def direction(self) -> str:
        """"bwd" for the backward benchmark, else "fwd"."""
        return "bwd" if self.bwd else "fwd"

    @property
    def data_dir(self) -> Path:
        """The folder of the CSVs."""
        return Path(self.results_dir) if self.results_dir is not None else RESULTS_DIR

    @property
    def pages_dir(self) -> Path:
        """The folder the pages are written to (see the module docstring)."""
        if self.out_dir is not None:
            return Path(self.out_dir)
        if self.report_only and self.results_dir is None:
            return OUT_DIR
        return self.data_dir

    @property
    def timer(self) -> dict:
        """Keyword arguments of `timing.time_cuda_graph`."""
        return dict(warmup=self.warmup, replays=self.replays, target_ms=self.target_ms, max_launches=self.max_launches)

    @property
    def tolerances(self) -> dict[str, float]:
        """The gate's tolerance per quantity: `tol` for all, else `gate.GATE_TOL`."""
        base = GATE_TOL[self.direction]
        return dict(base) if self.tol is None else {n: float(self.tol) for n in base}

    @property
    def max_token_heads(self) -> int:
        """Token-heads per batch of value heads of the fp64 result (`gate.fp64_result`)."""
        return int(self.ref_batch or REF_BATCH[self.direction])

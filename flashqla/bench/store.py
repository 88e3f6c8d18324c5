"""The CSV files of the benchmark: results (resumable), the peers' cache, the breakdown; file names.

All plain CSV with a header, appended one row at a time as soon as a row is measured (a run killed
at its time limit keeps everything it finished). When the columns of a file differ from the columns
being written (a newer harness, a new peer), the file is rewritten once with the union of both.

- results (`<gpu>-fwd.csv`, `<gpu>-bwd.csv`): one line per (environment key, commit, row), columns
  `SCHEMAS[direction].result_fields`; a rerun with the same key skips the rows already done
  (`done_keys`). A row whose peers came from the cache and were timed again to check it
  (`--retime`, peers column "cached (re-timed)") keeps the live timing in `<peer>_retime_<field>`
  (the last columns; empty on rows written before them) next to the cached one: the pages' Drift
  sections are built from them.
- peers (`peers-<gpu>-fwd.csv`, `peers-<gpu>-bwd.csv`): one line per (environment key,
  implementation, row); the last line for a key wins (`PeerCache`). A peer's line is keyed by the
  platform fields and that peer's own version (`impls.BASE_ENV_FIELDS` + its version column), so a
  new peer in the table does not invalidate the others' cached timings.
- breakdown (`<gpu>-fwd-breakdown.csv`, `--breakdown`): FLA's forward kernel by kernel.
"""

from __future__ import annotations

import csv
import math
import os
from dataclasses import dataclass
from datetime import datetime, timezone
from pathlib import Path

from flashqla.bench import grid as G
from flashqla.bench.impls import BASE_ENV_FIELDS, ENV_FIELDS, PEERS, gpu_slug, impls_for

__all__ = [
    "ROW_FIELDS", "Schema", "SCHEMAS", "BREAKDOWN_FIELDS", "NOT_DONE", "DEFERRED", "read_rows", "append_row", "fmt",
    "env_key", "row_key", "rows_for_key", "rows_for_commits", "done_keys", "latest_key", "PeerCache", "pick_retime",
    "find_prefix", "files", "now_utc", "num", "is_ok", "is_cp", "grid_order", "row_name",
]

ROW_FIELDS = ("h_qk", "h_v", "mix", "T", "N")


@dataclass(frozen=True)
class Schema:
    """The columns of one benchmark's results CSV: the environment key, the commit, the row, `extra`
    row columns, `<impl>_<field>` for every implementation and `impl_fields`, the `pair` columns,
    peers source and date, then `<peer>_retime_<field>` for `retime_fields` (last, so that a file of
    the older schema gains them as its last columns). `timed`: the time columns of an
    implementation as (field, FLOP kind of `grid.flop`, title), the first being the one the tables
    show first and the drift messages compare."""

    impl_fields: tuple[str, ...]
    extra: tuple[str, ...]
    retime_fields: tuple[str, ...]
    timed: tuple[tuple[str, str, str], ...]
    impls: tuple[str, ...]
    pairs: bool = False

    @property
    def peers(self) -> tuple[str, ...]:
        """`impls` less ours."""
        return tuple(i for i in self.impls if i != "ours")

    @property
    def pair_names(self) -> tuple[tuple[str, str], ...]:
        """Every pair (a, b) of implementations, a before b, when the schema has pair columns."""
        return tuple((a, b) for i, a in enumerate(self.impls) for b in self.impls[i + 1:]) if self.pairs else ()

    @property
    def pair_fields(self) -> tuple[str, ...]:
        """`pair_<a>_<b>` for `pair_names`."""
        return tuple(f"pair_{a}_{b}" for a, b in self.pair_names)

    @property
    def result_fields(self) -> tuple[str, ...]:
        return (ENV_FIELDS + ("commit",) + ROW_FIELDS + self.extra
                + tuple(f"{i}_{f}" for i in self.impls for f in self.impl_fields) + self.pair_fields
                + ("peers_source", "date") + tuple(f"{p}_retime_{f}" for p in self.peers for f in self.retime_fields))

    @property
    def peer_fields(self) -> tuple[str, ...]:
        return ENV_FIELDS + ("impl",) + ROW_FIELDS + self.impl_fields + ("date",)


#: The two benchmarks' schemas. Forward: `ms`, gate errors of o and the final state, the graph's
#: launches and the replays' spread. Backward: the backward alone and the training step, the gate's
#: worst error and every quantity's (`gate.format_errs`), launches and spread of both, the row's
#: short name and gate ("fp64" or "pairwise"), and the pairwise agreement of the implementations.
SCHEMAS = {
    "fwd": Schema(impl_fields=("ms", "status", "err_o", "err_ht", "launches", "spread"),
                  extra=("cp_row", "parallelism"), retime_fields=("ms", "status"), timed=(("ms", "fwd", "forward"),),
                  impls=impls_for("fwd")),
    "bwd": Schema(impl_fields=("bwd_ms", "step_ms", "status", "err", "errs", "bwd_launches", "bwd_spread",
                               "step_launches", "step_spread"),
                  extra=("name", "parallelism", "gate"), retime_fields=("bwd_ms", "step_ms", "status"),
                  timed=(("bwd_ms", "bwd", "backward"), ("step_ms", "step", "training step (forward + backward)")),
                  impls=impls_for("bwd"), pairs=True),
}
BREAKDOWN_FIELDS = (ENV_FIELDS + ("commit",) + ROW_FIELDS
                    + ("step", "ms", "inputs_read", "inter_read", "inter_written", "out_written", "note", "date"))
#: Status of a peer left for the next run by --time-budget.
DEFERRED = "deferred"
#: Statuses that leave a row to be measured again by the next run with the same key.
NOT_DONE = ("", "not cached", DEFERRED)


def now_utc() -> str:
    """The date column's format: UTC, to the second (`2026-01-01T00:00:00Z`)."""
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def read_rows(path) -> list[dict[str, str]]:
    """All rows of a CSV file as dicts (empty list when the file does not exist)."""
    p = Path(path)
    if not p.exists():
        return []
    with p.open(newline="") as f:
        return list(csv.DictReader(f))


def fmt(x) -> str:
    """A CSV cell: floats in 6 significant digits, NaN empty, anything else `str`."""
    if isinstance(x, float):
        return "" if x != x else f"{x:.6g}"
    return str(x)


def append_row(path, row: dict, fields) -> None:
    """Appends `row` to the CSV at `path` (creating its folder), writing the header first for a new
    file. Unknown keys of `row` are an error; a file with other columns is rewritten with the union
    of columns."""
    p = Path(path)
    fields = list(fields)
    extra = set(row) - set(fields)
    if extra:
        raise ValueError(f"row has columns not in the schema: {sorted(extra)}")
    p.parent.mkdir(parents=True, exist_ok=True)
    if p.exists() and p.stat().st_size > 0:
        with p.open(newline="") as f:
            header = next(csv.reader(f), [])
        if header != fields:
            old = read_rows(p)
            union = fields + [c for c in header if c not in fields]
            tmp = p.with_suffix(p.suffix + ".tmp")
            with tmp.open("w", newline="") as f:
                w = csv.DictWriter(f, fieldnames=union)
                w.writeheader()
                for r in old:
                    w.writerow({c: r.get(c, "") for c in union})
            os.replace(tmp, p)
            fields = union
        with p.open("a", newline="") as f:
            csv.DictWriter(f, fieldnames=fields).writerow({c: fmt(row.get(c, "")) for c in fields})
    else:
        with p.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerow({c: fmt(row.get(c, "")) for c in fields})


def num(x) -> float:
    """A CSV cell (or a number) as float; empty or unparsable -> NaN."""
    if isinstance(x, (int, float)):
        return float(x)
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def is_ok(r: dict, impl: str, field: str = "ms") -> bool:
    """True when `impl` passed the gate on row `r` and has a time in `<impl>_<field>`."""
    return str(r.get(f"{impl}_status", "")) == "ok" and num(r.get(f"{impl}_{field}")) > 0


def is_cp(r: dict) -> bool:
    """The forward row's `cp_row` flag (`grid.is_cp_row` when it was measured)."""
    return str(r.get("cp_row", "")).lower() in ("1", "true", "yes", "cp")


def _lengths(r: dict) -> tuple[int, ...]:
    try:
        return G.parse_mix(str(r["mix"])).lengths
    except ValueError:
        return ()


def grid_order(r: dict, direction: str = "fwd") -> tuple:
    """Sort key of a row: its grid's head-config order, then its mix order (the backward: then T and
    the sequence count); rows outside the grid last."""
    heads = [(h.h_qk, h.h_v) for h in (G.BWD_HEADS if direction == "bwd" else G.FWD_HEADS)]
    mixes = [m.lengths for m in (G.bwd_mixes() if direction == "bwd" else G.FWD_MIXES)]
    hk = (int(r["h_qk"]), int(r["h_v"]))
    ml = _lengths(r)
    key = (heads.index(hk) if hk in heads else len(heads), hk, mixes.index(ml) if ml in mixes else len(mixes))
    return key + ((sum(ml), len(ml)) if direction == "bwd" else ()) + (str(r["mix"]),)


def row_name(r: dict) -> str:
    """The short name (`8k_4seq`) of a backward row."""
    return str(r.get("name") or G.short_name(_lengths(r) or (int(r.get("T", 0) or 0),)))


def env_key(d: dict, fields=ENV_FIELDS) -> tuple[str, ...]:
    """The environment part of a row's key (`fields`: the whole key by default)."""
    return tuple(str(d.get(f, "") or "") for f in fields)


def row_key(d: dict) -> tuple[int, int, str]:
    """(h_qk, h_v, mix) of a CSV row, matching `grid.Row.key`."""
    return (int(d["h_qk"]), int(d["h_v"]), str(d["mix"]))


def rows_for_key(rows: list[dict], env: dict, commit: str) -> list[dict]:
    """Rows of one environment key and commit; a row measured twice keeps its last line."""
    key = env_key(env)
    out = {}
    for r in rows:
        if env_key(r) == key and r.get("commit", "") == commit:
            out[row_key(r)] = r
    return list(out.values())


def rows_for_commits(rows: list[dict], env: dict, commits) -> list[dict]:
    """Rows of one environment key, each row key from the first of `commits` that measured it (so a
    page can show a grid whose rows were measured at several commits of the same code); every row
    keeps its own `commit` field. The first commit's rows match the whole key; the later commits' match
    its platform fields (`BASE_ENV_FIELDS`: GPU, driver, CUDA, torch, Triton, TileLang) and the
    version of every peer `env` has installed (a peer "absent" in `env` may differ: such rows keep
    that peer's results from a run that had it)."""
    out = {}
    commits = list(commits)
    fields = BASE_ENV_FIELDS + tuple(p for p in PEERS if env.get(p) != "absent")
    for c in reversed(commits):
        if c == commits[0]:
            out.update({row_key(r): r for r in rows_for_key(rows, env, c)})
        else:
            out.update({row_key(r): r for r in rows if r.get("commit", "") == c and env_key(r, fields) == env_key(env, fields)})
    return list(out.values())


def done_keys(rows: list[dict], env: dict, commit: str, need=("ours",)) -> set[tuple[int, int, str]]:
    """Row keys measured under this environment key and commit for every implementation in `need`
    (skipped on a rerun): a row where one of them has no status, was not cached or was deferred
    (`NOT_DONE`) is measured again."""
    return {row_key(r) for r in rows_for_key(rows, env, commit)
            if all(str(r.get(f"{i}_status", "")).strip() not in NOT_DONE for i in need)}


def latest_key(rows: list[dict], commit: str | None = None) -> tuple[dict, str] | None:
    """(environment dict, commit) of the most recently dated row (of `commit`'s rows when given), or
    None for no such rows."""
    if commit is not None:
        rows = [r for r in rows if r.get("commit", "") == commit]
    if not rows:
        return None
    last = max(rows, key=lambda r: r.get("date", ""))
    return {f: last.get(f, "") or "" for f in ENV_FIELDS}, last.get("commit", "")


class PeerCache:
    """Peer timings for one environment, read from the peers CSV: `get(impl, row_key)`.

    A line counts for `impl` when its platform fields and `impl`'s own version column equal `env`'s.
    With `any_version` (the pages, `report.write_pages`; never the measuring run's plan, where a peer
    whose version reads "absent" may still be importable and run live), a peer whose version in `env`
    is "absent" takes its result lines of any version on the same platform, the last one of each row
    winning (error lines skipped); `versions[impl]` names the versions so used. `impl_fields`: the
    per-implementation columns (`SCHEMAS[direction].impl_fields`; the forward's by default)."""

    def __init__(self, path, env: dict, impl_fields=SCHEMAS["fwd"].impl_fields, any_version: bool = False):
        self.path = Path(path)
        self.env = dict(env)
        self.impl_fields = tuple(impl_fields)
        self.fields = ENV_FIELDS + ("impl",) + ROW_FIELDS + self.impl_fields + ("date",)
        self._rows: dict[tuple, dict] = {}
        self.versions: dict[str, set] = {}
        relaxed = {i for i in PEERS if any_version and self.env.get(i) == "absent"}
        for r in read_rows(self.path):
            impl = r.get("impl", "")
            if impl not in PEERS:
                continue
            fields = BASE_ENV_FIELDS + (() if impl in relaxed else (impl,))
            if env_key(r, fields) != env_key(self.env, fields):
                continue
            if impl in relaxed and (str(r.get("status", "")).startswith("error") or r.get(impl, "") == "absent"):
                continue  # another version's crash does not hide its results; no line of an unknown version
            self._rows[(impl,) + row_key(r)] = r
        for impl in relaxed:
            self.versions[impl] = {r.get(impl, "") for (i, *_), r in self._rows.items() if i == impl}

    def get(self, impl: str, key: tuple[int, int, str], include_errors: bool = False) -> dict | None:
        """The last cached line of `impl` on row `key`; a line whose status is an error (a crash or
        an out-of-memory, not a result) counts as missing unless `include_errors`."""
        r = self._rows.get((impl,) + tuple(key))
        if r is not None and not include_errors and str(r.get("status", "")).startswith("error"):
            return None
        return r

    def has_row(self, key: tuple[int, int, str], impls=PEERS) -> bool:
        """True when every peer in `impls` has a cached line for this row."""
        return all(self.get(i, key) is not None for i in impls)

    def put(self, impl: str, row_fields: dict, result: dict, date: str) -> None:
        """Appends one peer line to the CSV and to this cache."""
        line = {**{f: self.env[f] for f in ENV_FIELDS}, "impl": impl, **{f: row_fields[f] for f in ROW_FIELDS},
                **{f: result.get(f, "") for f in self.impl_fields}, "date": date}
        append_row(self.path, line, self.fields)
        self._rows[(impl,) + row_key(line)] = {k: fmt(v) for k, v in line.items()}

    def __len__(self) -> int:
        return len(self._rows)


def pick_retime(keys: list, n: int) -> list:
    """`n` keys spread evenly over `keys` (first and last included when n >= 2)."""
    if n <= 0 or not keys:
        return []
    if n >= len(keys):
        return list(keys)
    if n == 1:
        return [keys[len(keys) // 2]]
    step = (len(keys) - 1) / (n - 1)
    return [keys[round(i * step)] for i in range(n)]


def find_prefix(direction: str, results_dir, prefix: str | None = None, env: dict | None = None) -> str:
    """The file prefix of a benchmark: `prefix`, else `<gpu slug>-<direction>` from `env`, else the
    one `*-<direction>.csv` in `results_dir`. Raises SystemExit naming the folder when there is none
    or several."""
    if prefix:
        return prefix
    if env is not None:
        return f"{gpu_slug(env['gpu'])}-{direction}"
    results_dir = Path(results_dir)
    cands = sorted(p.stem for p in results_dir.glob(f"*-{direction}.csv") if not p.stem.startswith("peers-"))
    if len(cands) == 1:
        return cands[0]
    what = "--report-only" + (" --bwd" if direction == "bwd" else "")
    if not cands:
        raise SystemExit(f"{what}: no {'backward' if direction == 'bwd' else 'forward'} results in {results_dir} "
                         f"(no *-{direction}.csv); run `python -m flashqla.bench"
                         f"{' --bwd' if direction == 'bwd' else ''}` on a Hopper GPU first")
    raise SystemExit(f"{what}: several results files in {results_dir}, give --prefix (found: {cands})")


def files(results_dir, prefix: str, out_dir=None) -> dict[str, Path]:
    """The files of one benchmark: its data in `results_dir` ("csv", "peers", "breakdown") and its
    pages in `out_dir` (default `results_dir`): "md", "png", "cp_md", "cp_png" (the context-parallel
    page, `<gpu>-cp.md`, shared by both benchmarks); "src_md" and "src_cp_md" are the pages of the
    same names in `results_dir` (the measuring run's, whose method and sections a rebuild keeps)."""
    d, o = Path(results_dir), Path(out_dir if out_dir is not None else results_dir)
    stem = prefix.rsplit("-", 1)[0] if prefix.endswith(("-fwd", "-bwd")) else prefix
    return {"csv": d / f"{prefix}.csv", "peers": d / f"peers-{prefix}.csv", "breakdown": d / f"{prefix}-breakdown.csv",
            "md": o / f"{prefix}.md", "png": o / f"{prefix}.png", "cp_md": o / f"{stem}-cp.md",
            "cp_png": o / f"{stem}-cp.png", "src_md": d / f"{prefix}.md", "src_cp_md": d / f"{stem}-cp.md"}

"""CSV files of the harness: results (ours + peers per row, resumable) and the peers' cache.

Both are plain CSV with a header, appended one row at a time as soon as a row is measured (a run
killed at its time limit keeps everything it finished). When the columns of a file differ from
the columns being written (a newer harness), the file is rewritten once with the union of both.

- results (`<slug>-fwd.csv`): one line per (environment key, commit, row); a rerun with the same
  key skips the rows already present (`done_keys`). A row whose peers came from the cache and were
  timed again to check it (`--retime`, peers_source "cached (re-timed)") keeps that live timing in
  `<peer>_retime_ms` / `<peer>_retime_status` (the last columns; empty on rows written before them),
  next to the cached one in `<peer>_ms`: the report's Drift section is built from them.
- peers (`peers-<slug>-fwd.csv`, committed): one line per (environment key, implementation, row);
  the last line for a key wins (`PeerCache`).
"""

from __future__ import annotations

import csv
import os
from pathlib import Path

from flashqla.bench.peers import ENV_FIELDS, IMPLS, PEERS

__all__ = [
    "RESULT_FIELDS",
    "RETIME_FIELDS",
    "PEER_FIELDS",
    "read_rows",
    "append_row",
    "row_key",
    "env_key",
    "done_keys",
    "rows_for_key",
    "latest_key",
    "PeerCache",
]

ROW_FIELDS = ("h_qk", "h_v", "mix", "T", "N")
IMPL_FIELDS = ("ms", "status", "err_o", "err_ht", "launches", "spread")
#: A cached peer's live re-timing on a row (`--retime`), as `<peer>_retime_<field>` columns.
RETIME_FIELDS = ("ms", "status")
RESULT_FIELDS = (
    ENV_FIELDS
    + ("commit",)
    + ROW_FIELDS
    + ("cp_row", "parallelism")
    + tuple(f"{i}_{f}" for i in IMPLS for f in IMPL_FIELDS)
    + ("peers_source", "date")
    # added after `date`, so that a file of the older schema gains them as its last columns
    + tuple(f"{p}_retime_{f}" for p in PEERS for f in RETIME_FIELDS)
)
PEER_FIELDS = ENV_FIELDS + ("impl",) + ROW_FIELDS + IMPL_FIELDS + ("date",)


def read_rows(path) -> list[dict[str, str]]:
    """All rows of a CSV file as dicts (empty list when the file does not exist)."""
    p = Path(path)
    if not p.exists():
        return []
    with p.open(newline="") as f:
        return list(csv.DictReader(f))


def append_row(path, row: dict, fields) -> None:
    """Appends `row` to the CSV at `path`, writing the header first for a new file. Unknown keys of
    `row` are an error; a file with other columns is rewritten with the union of columns."""
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
            csv.DictWriter(f, fieldnames=fields).writerow({c: _fmt(row.get(c, "")) for c in fields})
    else:
        with p.open("w", newline="") as f:
            w = csv.DictWriter(f, fieldnames=fields)
            w.writeheader()
            w.writerow({c: _fmt(row.get(c, "")) for c in fields})


def _fmt(x) -> str:
    if isinstance(x, float):
        return "" if x != x else f"{x:.6g}"
    return str(x)


def env_key(d: dict) -> tuple[str, ...]:
    """The environment part of a row's key."""
    return tuple(str(d.get(f, "")) for f in ENV_FIELDS)


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
    report can show a grid whose rows were measured at several commits of the same code); every row
    keeps its own `commit` field."""
    out = {}
    for c in reversed(list(commits)):
        out.update({row_key(r): r for r in rows_for_key(rows, env, c)})
    return list(out.values())


def done_keys(rows: list[dict], env: dict, commit: str, need=("ours",)) -> set[tuple[int, int, str]]:
    """Row keys already measured under this environment key and commit (skipped on a rerun).

    A row counts only when every implementation in `need` has a status there (a row written by a
    peers-only run is not done for a run that measures ours)."""
    return {row_key(r) for r in rows_for_key(rows, env, commit)
            if all(str(r.get(f"{i}_status", "")).strip() for i in need)}


def latest_key(rows: list[dict], commit: str | None = None) -> tuple[dict, str] | None:
    """(environment dict, commit) of the most recently dated row (of `commit`'s rows when given), or
    None for no such rows."""
    if commit is not None:
        rows = [r for r in rows if r.get("commit", "") == commit]
    if not rows:
        return None
    last = max(rows, key=lambda r: r.get("date", ""))
    return {f: last.get(f, "") for f in ENV_FIELDS}, last.get("commit", "")


class PeerCache:
    """Peer timings of one environment key, read from the peers CSV: `get(impl, row_key)`.

    `impl_fields`: the per-implementation columns (the forward's `IMPL_FIELDS` by default; the
    backward benchmark passes its own)."""

    def __init__(self, path, env: dict, impl_fields=IMPL_FIELDS):
        self.path = Path(path)
        self.env = dict(env)
        self.impl_fields = tuple(impl_fields)
        self.fields = ENV_FIELDS + ("impl",) + ROW_FIELDS + self.impl_fields + ("date",)
        key = env_key(env)
        self._rows: dict[tuple, dict] = {}
        for r in read_rows(self.path):
            if env_key(r) == key:
                self._rows[(r["impl"],) + row_key(r)] = r

    def get(self, impl: str, key: tuple[int, int, str], include_errors: bool = False) -> dict | None:
        """The last cached line of `impl` on row `key`; a line whose status is an error (a crash or
        an out-of-memory, not a result) counts as missing unless `include_errors`."""
        r = self._rows.get((impl,) + tuple(key))
        if r is not None and not include_errors and str(r.get("status", "")).startswith("error"):
            return None
        return r

    def has_row(self, key: tuple[int, int, str], impls=("fla", "flash_qla")) -> bool:
        """True when every peer in `impls` has a cached line for this row."""
        return all(self.get(i, key) is not None for i in impls)

    def put(self, impl: str, row_fields: dict, result: dict, date: str) -> None:
        """Appends one peer line to the CSV and to this cache."""
        line = {**{f: self.env[f] for f in ENV_FIELDS}, "impl": impl, **{f: row_fields[f] for f in ROW_FIELDS},
                **{f: result.get(f, "") for f in self.impl_fields}, "date": date}
        append_row(self.path, line, self.fields)
        self._rows[(impl,) + row_key(line)] = {k: _fmt(v) for k, v in line.items()}

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


__all__.append("pick_retime")

"""Figures and derived numbers of the committed benchmark results (for notebooks/70_benchmarks.py).

Reads what `python -m flashqla.bench` writes to `benchmarks/results/` (`<prefix>.csv`, one line per
row with `ours_*`, `fla_*`, `flash_qla_*` columns; `<prefix>-breakdown.csv`, FLA's forward step by
step) and draws, with matplotlib's Agg backend:

    plot_times       ms per row, ours / FLA / FlashQLA side by side
    plot_roofline    achieved TFLOP/s against the row's arithmetic intensity under the H200's two roofs,
                     and the share of that roofline per row
    plot_breakdown   FLA's five kernels stacked, against FlashQLA's and our whole forward

Any implementation or column may be missing (an implementation not timed yet, an older harness): the
functions plot what exists and `coverage` says what does not. Roofline: the FLOP count of
`grid.fwd_flop` (163,840 per token and value head) over the bytes a fused forward cannot avoid
(`grid.fwd_min_bytes`), against the 726 TFLOP/s bf16 GEMM rate and the 4.0 TB/s copy rate measured
on our H200 (DESIGN.md section 6): attainable = min(726, intensity x 4.0) TFLOP/s.
"""

from __future__ import annotations

import math
from pathlib import Path

from flashqla.bench.breakdown import COPY_TBPS, STEP_NAMES
from flashqla.bench.grid import PEAK_TFLOPS, fwd_flop, fwd_min_bytes, tflops
from flashqla.bench.peers import IMPLS, LABELS
from flashqla.bench.report import grid_order, is_ok, num
from flashqla.bench.store import read_rows, row_key

__all__ = [
    "COLORS",
    "load",
    "coverage",
    "row_label",
    "intensity",
    "attainable_tflops",
    "roofline_pct",
    "plot_times",
    "plot_roofline",
    "plot_breakdown",
]

COLORS = {"ours": "tab:red", "fla": "tab:blue", "flash_qla": "tab:green"}


def load(results_dir, prefix: str = "h200-fwd") -> tuple[list[dict], list[dict]]:
    """(result rows, breakdown rows) of `<results_dir>/<prefix>.csv` and `<prefix>-breakdown.csv`.

    A row (h_qk, h_v, mix) measured more than once (another commit or environment) keeps its most
    recently dated line; result rows come in the published grid's order, each with its own `commit`
    and environment columns. Missing files give empty lists."""
    d = Path(results_dir)
    latest: dict[tuple, dict] = {}
    for r in read_rows(d / f"{prefix}.csv"):
        k = row_key(r)
        if k not in latest or str(r.get("date", "")) >= str(latest[k].get("date", "")):
            latest[k] = r
    return sorted(latest.values(), key=grid_order), read_rows(d / f"{prefix}-breakdown.csv")


def coverage(rows: list[dict]) -> dict[str, dict]:
    """Per implementation: `ok` (rows with a passing, timed result), `failed` (rows marked FAIL or error),
    `untimed` (rows without a result) and `has_columns` (the CSV has its `<impl>_ms` column)."""
    out = {}
    for impl in IMPLS:
        col = f"{impl}_ms"
        st = [str(r.get(f"{impl}_status", "") or "") for r in rows]
        out[impl] = dict(
            has_columns=any(col in r for r in rows),
            ok=sum(is_ok(r, impl) for r in rows),
            failed=sum(s == "FAIL" or s.startswith("error") for s in st),
            untimed=sum(not is_ok(r, impl) and not (s == "FAIL" or s.startswith("error")) for r, s in zip(rows, st)),
        )
    return out


def row_label(r: dict) -> str:
    """`h_qk/h_v mix`, as the markdown report writes a row."""
    return f"{r['h_qk']}/{r['h_v']} {r['mix']}"


def intensity(r: dict) -> float:
    """Arithmetic intensity of a row, FLOP per unavoidable HBM byte."""
    T, N, hq, hv = int(r["T"]), int(r["N"]), int(r["h_qk"]), int(r["h_v"])
    return fwd_flop(T, hv) / fwd_min_bytes(T, N, hq, hv)


def attainable_tflops(r: dict, peak: float = PEAK_TFLOPS, copy_tbps: float = COPY_TBPS) -> float:
    """The roofline of a row: min(peak, intensity x copy rate), TFLOP/s."""
    return min(peak, intensity(r) * copy_tbps)


def roofline_pct(r: dict, impl: str) -> float:
    """Achieved TFLOP/s of `impl` on row r as a percentage of the row's roofline; NaN when not timed."""
    if not is_ok(r, impl):
        return math.nan
    return 100.0 * tflops(num(r[f"{impl}_ms"]), int(r["T"]), int(r["h_v"])) / attainable_tflops(r)


def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


def _save(fig, path) -> Path:
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    return p


def plot_times(rows: list[dict], path) -> Path | None:
    """Grouped bars: ms per row for every implementation (no bar where it was not timed or failed,
    which the tick label marks with the missing implementations). Returns the PNG path, or None when
    there are no rows."""
    if not rows:
        return None
    plt = _plt()
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(rows) + 2), 3.8))
    width = 0.8 / len(IMPLS)
    for j, impl in enumerate(IMPLS):
        xs = [i + (j - (len(IMPLS) - 1) / 2) * width for i, r in enumerate(rows) if is_ok(r, impl)]
        ys = [num(r[f"{impl}_ms"]) for r in rows if is_ok(r, impl)]
        if not xs:
            ax.bar([0], [0], 0, color=COLORS[impl], label=f"{LABELS[impl]} (not timed)")
            continue
        ax.bar(xs, ys, width, color=COLORS[impl], label=LABELS[impl])
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6)
    ticks = []
    for r in rows:
        missing = [LABELS[i] for i in IMPLS if not is_ok(r, i)]
        ticks.append(row_label(r) + (f"\n(no {', '.join(missing)})" if missing else ""))
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(ticks, fontsize=7)
    ax.set_ylabel("forward, ms (median, CUDA graph)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    gpu = rows[0].get("gpu", "")
    ax.set_title(f"GDN forward time per row ({gpu})", fontsize=10)
    fig.tight_layout()
    p = _save(fig, path)
    plt.close(fig)
    return p


def plot_roofline(rows: list[dict], path, peak: float = PEAK_TFLOPS, copy_tbps: float = COPY_TBPS) -> Path | None:
    """Two panels. Left, the roofline chart: each timed (row, implementation) at (intensity, achieved
    TFLOP/s) under the compute roof (`peak`) and the bandwidth roof (intensity x `copy_tbps`). Right,
    the percentage of its row's roof each implementation reaches (`roofline_pct`), per row. Returns the
    path, or None when nothing is timed."""
    pts = [(impl, r) for r in rows for impl in IMPLS if is_ok(r, impl)]
    if not pts:
        return None
    plt = _plt()
    from matplotlib.ticker import NullFormatter

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(6.0 + 0.45 * len(rows) + 2, 4.4),
                                 gridspec_kw=dict(width_ratios=[6.0, 0.45 * len(rows) + 2]))
    ai = [intensity(r) for _, r in pts]
    lo, hi = min(ai + [peak / copy_tbps]) / 4, max(ai + [peak / copy_tbps]) * 4
    xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    ax.loglog(xs, [min(peak, x * copy_tbps) for x in xs], "k-", lw=1.2, label=f"roof: min({peak:.0f}, {copy_tbps:.1f} TB/s x intensity)")
    for impl in IMPLS:
        sel = [r for i, r in pts if i == impl]
        if sel:
            ax.loglog([intensity(r) for r in sel], [tflops(num(r[f"{impl}_ms"]), int(r["T"]), int(r["h_v"])) for r in sel],
                      "o", color=COLORS[impl], label=LABELS[impl])
    if len(pts) <= 24:  # label the points while they stay readable
        for impl, r in pts:
            ax.annotate(row_label(r), (intensity(r), tflops(num(r[f"{impl}_ms"]), int(r["T"]), int(r["h_v"]))),
                        fontsize=6, xytext=(5, -2), textcoords="offset points")
    missing = [LABELS[i] for i in IMPLS if not any(j == i for j, _ in pts)]
    if missing:
        ax.plot([], [], " ", label=f"not timed: {', '.join(missing)}")
    ax.set_xlabel("arithmetic intensity, FLOP per unavoidable HBM byte")
    ax.set_ylabel("TFLOP/s (163,840 FLOP per token-head)")
    ax.set_title("forward against the H200 roofline", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    ax.xaxis.set_minor_formatter(NullFormatter())

    width = 0.8 / len(IMPLS)
    for j, impl in enumerate(IMPLS):
        idx = [i for i, r in enumerate(rows) if is_ok(r, impl)]
        bx.bar([i + (j - (len(IMPLS) - 1) / 2) * width for i in idx], [roofline_pct(rows[i], impl) for i in idx], width,
               color=COLORS[impl], label=LABELS[impl])
    bx.set_xticks(range(len(rows)))
    bx.set_xticklabels([row_label(r) for r in rows], rotation=60, ha="right", fontsize=7)
    bx.set_ylabel("% of the row's roofline")
    bx.set_title("share of the roofline per row", fontsize=10)
    bx.grid(axis="y", alpha=0.3)
    fig.tight_layout()
    p = _save(fig, path)
    plt.close(fig)
    return p


def _row_key(r: dict) -> tuple:
    return (str(r["h_qk"]), str(r["h_v"]), str(r["mix"]))


def plot_breakdown(brows: list[dict], rows: list[dict], path) -> Path | None:
    """Per row of the breakdown: FLA's five kernels stacked (ms), beside FLA's whole forward, FlashQLA's
    and ours (each where timed; a missing one is marked 'not timed'). Returns the path, or None when
    the breakdown has no FLA step."""
    keys = []
    for b in brows:
        if b.get("step") in STEP_NAMES and _row_key(b) not in keys:
            keys.append(_row_key(b))
    if not keys:
        return None
    plt = _plt()
    whole = {_row_key(r): r for r in rows}
    fig, axes = plt.subplots(1, len(keys), figsize=(4.2 * len(keys), 4.0), squeeze=False)
    cmap = plt.get_cmap("Blues")
    for ax, key in zip(axes[0], keys):
        steps = {b["step"]: num(b["ms"]) for b in brows if _row_key(b) == key}
        bottom = 0.0
        for i, s in enumerate(STEP_NAMES):
            if s in steps:
                ax.bar(0, steps[s], 0.6, bottom=bottom, color=cmap(0.3 + 0.6 * i / len(STEP_NAMES)), edgecolor="white",
                       label=s)
                bottom += steps[s]
        r = whole.get(key, {})
        names = ["FLA steps"]
        for j, impl in enumerate(IMPLS, start=1):
            names.append(f"{LABELS[impl]}\nwhole")
            if r and is_ok(r, impl):
                ms = num(r[f"{impl}_ms"])
                ax.bar(j, ms, 0.6, color=COLORS[impl])
                ax.text(j, ms, f"{ms:.3f}", ha="center", va="bottom", fontsize=7)
            else:
                ax.text(j, 0, "not timed", ha="center", va="bottom", fontsize=7, rotation=90)
        ax.text(0, bottom, f"{bottom:.3f}", ha="center", va="bottom", fontsize=7)
        ax.set_xticks(range(len(names)))
        ax.set_xticklabels(names, fontsize=7)
        ax.set_title(f"{key[0]}/{key[1]} {key[2]}", fontsize=9)
        ax.set_ylabel("ms")
        ax.grid(axis="y", alpha=0.3)
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), fontsize=7, frameon=False)
    fig.suptitle("FLA's forward kernel by kernel against whole fused forwards", fontsize=10)
    fig.tight_layout(rect=(0, 0.07, 1, 1))
    p = _save(fig, path)
    plt.close(fig)
    return p

"""Every figure of the benchmark (matplotlib, Agg backend), from the results CSVs' rows.

Pages (written by `report.write_pages` beside the markdown):

    plot_fwd        TFLOP/s per row and implementation, one panel per head configuration (`<gpu>-fwd.png`)
    plot_vs_T       ms against T (log-log), the context-parallel grid's rows (`<gpu>-cp.png`)
    plot_bwd        backward and training-step TFLOP/s per row, one column per head configuration (`<gpu>-bwd.png`)

Notebook figures (`notebooks/70_benchmarks.py`), with the numbers they are drawn from:

    load            the forward rows of `<prefix>.csv` (latest line per row) and `<prefix>-breakdown.csv`
    coverage        which implementations are timed on how many rows
    plot_times      ms per row, ours / FLA / FlashQLA side by side
    plot_roofline   achieved TFLOP/s against the row's arithmetic intensity under the H200's two roofs,
                    and the share of that roofline per row
    plot_breakdown  FLA's five kernels stacked, against FlashQLA's and our whole forward

Any implementation or column may be missing (not timed yet, an older harness): the functions plot
what exists. Roofline: `grid.flop` (163,840 per token and value head) over the bytes a fused forward
cannot avoid (`grid.fwd_min_bytes`), against the 726 TFLOP/s bf16 GEMM rate and the 4.0 TB/s copy
rate measured on our H200 (DESIGN.md section 6): attainable = min(726, intensity x 4.0) TFLOP/s.
Each plot function writes one PNG (creating its folder) and returns its path, or None when there
is nothing to draw or matplotlib is not installed.
"""

from __future__ import annotations

import math
from pathlib import Path

from flashqla.bench.breakdown import COPY_TBPS, STEP_NAMES
from flashqla.bench.grid import PEAK_TFLOPS, flop, fwd_min_bytes, peak_tflops, tflops
from flashqla.bench.impls import COLORS, LABELS, impls_for
from flashqla.bench.store import SCHEMAS, grid_order, is_cp, is_ok, num, read_rows, row_key, row_name

__all__ = [
    "COLORS", "STEP_NAMES", "pyplot", "plot_fwd", "plot_vs_T", "plot_bwd", "load", "coverage", "row_label",
    "intensity", "attainable_tflops", "roofline_pct", "plot_times", "plot_roofline", "plot_breakdown",
]

#: The implementations of each benchmark's plots (FlashInfer has no backward).
FWD_IMPLS, BWD_IMPLS = impls_for("fwd"), impls_for("bwd")


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def _save(plt, fig, path, tight: bool = True) -> Path:
    """Lays out `fig` (when `tight`), writes it as a PNG to `path` (creating its folder), closes it."""
    if tight:
        fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def _heads_in_order(rows: list[dict]) -> list[tuple[int, int]]:
    """The (h_qk, h_v) head configurations of `rows`, in the order they first appear."""
    return list(dict.fromkeys((int(r["h_qk"]), int(r["h_v"])) for r in rows))


def _offset(j: int, width: float, n: int) -> float:
    """The bar offset of the j-th of `n` implementations, the bars centred on the tick."""
    return (j - (n - 1) / 2) * width


# ---------------------------------------------------------------------------------------- pages


def plot_fwd(rows: list[dict], path) -> Path | None:
    """TFLOP/s per row and implementation, one panel per head configuration (CP rows marked *)."""
    plt = pyplot()
    if plt is None:
        return None
    rows = sorted(rows, key=grid_order)
    heads = _heads_in_order(rows)
    if not heads:
        return None
    ncol = min(3, len(heads))
    nrow = math.ceil(len(heads) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 3.8 * nrow), squeeze=False)
    width = 0.8 / len(FWD_IMPLS)
    for ax, h in zip(axes.flat, heads):
        rs = [r for r in rows if (int(r["h_qk"]), int(r["h_v"])) == h]
        xs = range(len(rs))
        for j, i in enumerate(FWD_IMPLS):
            ys = [tflops(num(r[f"{i}_ms"]), int(r["T"]), int(r["h_v"])) if is_ok(r, i) else 0.0 for r in rs]
            ax.bar([x + _offset(j, width, len(FWD_IMPLS)) for x in xs], ys, width, label=LABELS[i], color=COLORS[i])
        ax.set_xticks(list(xs))
        ax.set_xticklabels([("*" if is_cp(r) else "") + str(r["mix"]) for r in rs], rotation=60, ha="right", fontsize=7)
        ax.set_title(f"h_qk/h_v = {h[0]}/{h[1]}")
        ax.set_ylabel("TFLOP/s")
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(heads):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    peak = peak_tflops(rows[0].get("gpu", ""))
    rate = f"bf16 GEMM rate {peak:.0f}; " if peak else ""
    fig.suptitle(f"GDN forward, TFLOP/s on 163,840 FLOP per token-head\n({rate}* = CP row)",
                 fontsize=10)
    return _save(plt, fig, path)


def plot_vs_T(rows: list[dict], path) -> Path | None:
    """Milliseconds against T (log-log) per implementation, one panel per head configuration: the
    context-parallel grid's plot (single-sequence rows)."""
    plt = pyplot()
    if plt is None:
        return None
    heads = _heads_in_order(sorted(rows, key=grid_order))
    if not heads:
        return None
    ncol = min(2, len(heads))
    nrow = math.ceil(len(heads) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.0 * ncol, 4.0 * nrow), squeeze=False)
    for ax, h in zip(axes.flat, heads):
        rs = sorted((r for r in rows if (int(r["h_qk"]), int(r["h_v"])) == h), key=lambda r: int(r["T"]))
        for i in FWD_IMPLS:
            pts = [(int(r["T"]), num(r[f"{i}_ms"])) for r in rs if is_ok(r, i)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=LABELS[i], color=COLORS[i])
        ax.set_xscale("log", base=2)
        ax.set_yscale("log")
        ax.set_xlabel("T (one sequence)")
        ax.set_ylabel("ms")
        ax.set_title(f"h_qk/h_v = {h[0]}/{h[1]}")
        ax.grid(alpha=0.3, which="both")
    for ax in list(axes.flat)[len(heads):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle("GDN forward, one long sequence: time against T", fontsize=10)
    return _save(plt, fig, path)


def plot_bwd(rows: list[dict], path) -> Path | None:
    """TFLOP/s per row and implementation: one column of panels per head configuration, the backward
    on top, the training step below (no bar: not timed or failed the gate)."""
    plt = pyplot()
    if plt is None:
        return None
    rows = sorted(rows, key=lambda r: grid_order(r, "bwd"))
    heads = _heads_in_order(rows)
    if not heads:
        return None
    fig, axes = plt.subplots(2, len(heads), figsize=(4.6 * len(heads), 7.0), squeeze=False)
    width = 0.8 / len(BWD_IMPLS)
    peak = peak_tflops(rows[0].get("gpu", ""))
    rate = f"bf16 GEMM rate {peak:.0f}; " if peak else ""
    for col, h in enumerate(heads):
        rs = [r for r in rows if (int(r["h_qk"]), int(r["h_v"])) == h]
        for row_i, (field, kind, title) in enumerate(SCHEMAS["bwd"].timed):
            ax = axes[row_i][col]
            for j, i in enumerate(BWD_IMPLS):
                ys = [tflops(num(r[f"{i}_{field}"]), int(r["T"]), int(r["h_v"]), kind) if is_ok(r, i, field) else 0.0
                      for r in rs]
                ax.bar([x + _offset(j, width, len(BWD_IMPLS)) for x in range(len(rs))], ys, width, label=LABELS[i],
                       color=COLORS[i])
            ax.set_xticks(list(range(len(rs))))
            ax.set_xticklabels([row_name(r) for r in rs], rotation=45, ha="right", fontsize=7)
            ax.set_title(f"{title.split(' (')[0]}, h_qk/h_v = {h[0]}/{h[1]}", fontsize=9)
            ax.set_ylabel("TFLOP/s")
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("GDN backward (491,520 FLOP per token-head) and training step (655,360), TFLOP/s\n"
                 f"({rate}no bar: not timed or failed the gate)", fontsize=10)
    return _save(plt, fig, path)


# ---------------------------------------------------------------------------------------- notebook


def load(results_dir, prefix: str = "h200-fwd") -> tuple[list[dict], list[dict]]:
    """(result rows, breakdown rows) of `<results_dir>/<prefix>.csv` and `<prefix>-breakdown.csv`.

    A row (h_qk, h_v, mix) measured more than once (another commit or environment) keeps its most
    recently dated line; result rows come in the published grid's order, each with its own `commit`
    and environment columns. Raises FileNotFoundError naming the results CSV when it is missing
    (a missing breakdown CSV gives no breakdown rows)."""
    d = Path(results_dir)
    csv_path = d / f"{prefix}.csv"
    if not csv_path.is_file():
        raise FileNotFoundError(f"no benchmark results at {csv_path} (written by `python -m flashqla.bench` on a "
                                "Hopper GPU; committed under benchmarks/results/)")
    latest: dict[tuple, dict] = {}
    for r in read_rows(csv_path):
        k = row_key(r)
        if k not in latest or str(r.get("date", "")) >= str(latest[k].get("date", "")):
            latest[k] = r
    return sorted(latest.values(), key=grid_order), read_rows(d / f"{prefix}-breakdown.csv")


def coverage(rows: list[dict]) -> dict[str, dict]:
    """Per implementation: `ok` (rows with a passing, timed result), `failed` (rows marked FAIL or error),
    `untimed` (rows without a result) and `has_columns` (the CSV has its `<impl>_ms` column)."""
    out = {}
    for impl in FWD_IMPLS:
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
    return flop(T, hv) / fwd_min_bytes(T, N, hq, hv)


def attainable_tflops(r: dict, peak: float = PEAK_TFLOPS, copy_tbps: float = COPY_TBPS) -> float:
    """The roofline of a row: min(peak, intensity x copy rate), TFLOP/s."""
    return min(peak, intensity(r) * copy_tbps)


def roofline_pct(r: dict, impl: str) -> float:
    """Achieved TFLOP/s of `impl` on row r as a percentage of the row's roofline; NaN when not timed."""
    if not is_ok(r, impl):
        return math.nan
    return 100.0 * tflops(num(r[f"{impl}_ms"]), int(r["T"]), int(r["h_v"])) / attainable_tflops(r)


def plot_times(rows: list[dict], path) -> Path | None:
    """Grouped bars: ms per row for every implementation (no bar where it was not timed or failed,
    which the tick label marks with the missing implementations)."""
    plt = pyplot()
    if not rows or plt is None:
        return None
    fig, ax = plt.subplots(figsize=(max(5.0, 1.3 * len(rows) + 2), 3.8))
    width = 0.8 / len(FWD_IMPLS)
    for j, impl in enumerate(FWD_IMPLS):
        xs = [i + _offset(j, width, len(FWD_IMPLS)) for i, r in enumerate(rows) if is_ok(r, impl)]
        ys = [num(r[f"{impl}_ms"]) for r in rows if is_ok(r, impl)]
        if not xs:
            ax.bar([0], [0], 0, color=COLORS[impl], label=f"{LABELS[impl]} (not timed)")
            continue
        ax.bar(xs, ys, width, color=COLORS[impl], label=LABELS[impl])
        for x, y in zip(xs, ys):
            ax.text(x, y, f"{y:.2f}", ha="center", va="bottom", fontsize=6)
    ticks = []
    for r in rows:
        missing = [LABELS[i] for i in FWD_IMPLS if not is_ok(r, i)]
        ticks.append(row_label(r) + (f"\n(no {', '.join(missing)})" if missing else ""))
    ax.set_xticks(range(len(rows)))
    ax.set_xticklabels(ticks, fontsize=7)
    ax.set_ylabel("forward, ms (median, CUDA graph)")
    ax.grid(axis="y", alpha=0.3)
    ax.legend(fontsize=8)
    gpu = rows[0].get("gpu", "")
    ax.set_title(f"GDN forward time per row ({gpu})", fontsize=10)
    return _save(plt, fig, path)


def plot_roofline(rows: list[dict], path, peak: float = PEAK_TFLOPS, copy_tbps: float = COPY_TBPS) -> Path | None:
    """Two panels. Left, the roofline chart: each timed (row, implementation) at (intensity, achieved
    TFLOP/s) under the compute roof (`peak`) and the bandwidth roof (intensity x `copy_tbps`). Right,
    the percentage of its row's roof each implementation reaches (`roofline_pct`), per row."""
    pts = [(impl, r) for r in rows for impl in FWD_IMPLS if is_ok(r, impl)]
    plt = pyplot()
    if not pts or plt is None:
        return None
    from matplotlib.ticker import NullFormatter

    fig, (ax, bx) = plt.subplots(1, 2, figsize=(6.0 + 0.45 * len(rows) + 2, 4.4),
                                 gridspec_kw=dict(width_ratios=[6.0, 0.45 * len(rows) + 2]))
    ai = [intensity(r) for _, r in pts]
    lo, hi = min(ai + [peak / copy_tbps]) / 4, max(ai + [peak / copy_tbps]) * 4
    xs = [lo * (hi / lo) ** (i / 100) for i in range(101)]
    ax.loglog(xs, [min(peak, x * copy_tbps) for x in xs], "k-", lw=1.2, label=f"roof: min({peak:.0f}, {copy_tbps:.1f} TB/s x intensity)")
    for impl in FWD_IMPLS:
        sel = [r for i, r in pts if i == impl]
        if sel:
            ax.loglog([intensity(r) for r in sel], [tflops(num(r[f"{impl}_ms"]), int(r["T"]), int(r["h_v"])) for r in sel],
                      "o", color=COLORS[impl], label=LABELS[impl])
    if len(pts) <= 24:  # label the points while they stay readable
        for impl, r in pts:
            ax.annotate(row_label(r), (intensity(r), tflops(num(r[f"{impl}_ms"]), int(r["T"]), int(r["h_v"]))),
                        fontsize=6, xytext=(5, -2), textcoords="offset points")
    missing = [LABELS[i] for i in FWD_IMPLS if not any(j == i for j, _ in pts)]
    if missing:
        ax.plot([], [], " ", label=f"not timed: {', '.join(missing)}")
    ax.set_xlabel("arithmetic intensity, FLOP per unavoidable HBM byte")
    ax.set_ylabel("TFLOP/s (163,840 FLOP per token-head)")
    ax.set_title("forward against the H200 roofline", fontsize=10)
    ax.grid(alpha=0.3, which="both")
    ax.legend(fontsize=7, loc="upper left")
    ax.xaxis.set_minor_formatter(NullFormatter())

    width = 0.8 / len(FWD_IMPLS)
    for j, impl in enumerate(FWD_IMPLS):
        idx = [i for i, r in enumerate(rows) if is_ok(r, impl)]
        bx.bar([i + _offset(j, width, len(FWD_IMPLS)) for i in idx], [roofline_pct(rows[i], impl) for i in idx], width,
               color=COLORS[impl], label=LABELS[impl])
    bx.set_xticks(range(len(rows)))
    bx.set_xticklabels([row_label(r) for r in rows], rotation=60, ha="right", fontsize=7)
    bx.set_ylabel("% of the row's roofline")
    bx.set_title("share of the roofline per row", fontsize=10)
    bx.grid(axis="y", alpha=0.3)
    return _save(plt, fig, path)


def _row_key(r: dict) -> tuple:
    return (str(r["h_qk"]), str(r["h_v"]), str(r["mix"]))


def plot_breakdown(brows: list[dict], rows: list[dict], path) -> Path | None:
    """Per row of the breakdown: FLA's five kernels stacked (ms), beside FLA's whole forward, FlashQLA's
    and ours (each where timed; a missing one is marked 'not timed'). None when the breakdown has no
    FLA step."""
    keys = []
    for b in brows:
        if b.get("step") in STEP_NAMES and _row_key(b) not in keys:
            keys.append(_row_key(b))
    plt = pyplot()
    if not keys or plt is None:
        return None
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
        for j, impl in enumerate(FWD_IMPLS, start=1):
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
    return _save(plt, fig, path, tight=False)

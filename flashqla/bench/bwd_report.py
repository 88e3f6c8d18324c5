"""Formatting of the backward results: CSV schema, console lines, the markdown page, the plot.

Two timed columns per implementation: `bwd` (the backward alone, on one forward's products) and
`step` (a training step: forward + backward). Speed-up of ours over a peer = peer ms / our ms, on
rows where both passed the gate. TFLOP/s on DESIGN.md section 6's counts (491,520 FLOP per token
and value head for the backward, 655,360 for the step) and as a percentage of the 726 TFLOP/s bf16
GEMM rate of our H200.
"""

from __future__ import annotations

import math
from pathlib import Path

from flashqla.bench.bwd_grid import BWD_HEADS, bwd_mixes, bwd_tflops, short_name, step_tflops
from flashqla.bench.bwd_runner import CHECKED, GATE_TOL_BWD, parse_errs, worst
from flashqla.bench.grid import PEAK_TFLOPS, parse_mix, pct_of_peak
from flashqla.bench.peers import ENV_FIELDS, IMPLS, LABELS, PEERS
from flashqla.bench.report import drift_section, fmt_x, geomean, heads_in_order, num, pyplot, save_figure
from flashqla.bench.store import ROW_FIELDS

__all__ = [
    "IMPL_FIELDS_BWD",
    "PAIR_FIELDS",
    "RETIME_FIELDS_BWD",
    "RESULT_FIELDS_BWD",
    "KINDS",
    "is_ok",
    "speedup",
    "grid_order",
    "cell_ms",
    "console_line",
    "geomean_table",
    "markdown",
    "cp_section",
    "plot",
]

#: Per-implementation columns of the backward CSVs (results: prefixed `<impl>_`; peers cache: as is).
IMPL_FIELDS_BWD = ("bwd_ms", "step_ms", "status", "err", "errs", "bwd_launches", "bwd_spread", "step_launches",
                   "step_spread")
#: Pairwise agreement columns: the largest relative RMS over o, final state and gradients.
PAIR_FIELDS = tuple(f"pair_{a}_{b}" for i, a in enumerate(IMPLS) for b in IMPLS[i + 1:])
#: A cached peer's live re-timing on a row (`--retime`), as `<peer>_retime_<field>` columns: the
#: cached timing stays in `<peer>_bwd_ms` / `<peer>_step_ms`; the page's Drift section sets them side by side.
RETIME_FIELDS_BWD = ("bwd_ms", "step_ms", "status")
RESULT_FIELDS_BWD = (
    ENV_FIELDS
    + ("commit",)
    + ROW_FIELDS
    + ("name", "parallelism", "gate")
    + tuple(f"{i}_{f}" for i in IMPLS for f in IMPL_FIELDS_BWD)
    + PAIR_FIELDS
    + ("peers_source", "date")
    # added after `date`, so that a file of the older schema gains them as its last columns
    + tuple(f"{p}_retime_{f}" for p in PEERS for f in RETIME_FIELDS_BWD)
)
#: The timed columns: key, title, TFLOP/s function.
KINDS = (("bwd", "backward", bwd_tflops), ("step", "training step (forward + backward)", step_tflops))


def is_ok(r: dict, impl: str, kind: str = "bwd") -> bool:
    """True when `impl` passed the gate on row r and has a `kind` ("bwd" or "step") time."""
    return str(r.get(f"{impl}_status", "")) == "ok" and num(r.get(f"{impl}_{kind}_ms")) > 0


def speedup(r: dict, a: str = "ours", b: str = "fla", kind: str = "bwd") -> float:
    """b's time over a's on row r for `kind`; NaN unless both are ok."""
    if not (is_ok(r, a, kind) and is_ok(r, b, kind)):
        return math.nan
    return num(r[f"{b}_{kind}_ms"]) / num(r[f"{a}_{kind}_ms"])


def _lengths(r: dict) -> tuple[int, ...]:
    try:
        return parse_mix(str(r["mix"])).lengths
    except ValueError:
        return ()


def grid_order(r: dict) -> tuple:
    """Sort key: the grid's head-config order, then its mix order (8k before 32k, by count); extras last."""
    heads = [(h.h_qk, h.h_v) for h in BWD_HEADS]
    hk = (int(r["h_qk"]), int(r["h_v"]))
    mixes = [m.lengths for m in bwd_mixes()]
    ml = _lengths(r)
    return (heads.index(hk) if hk in heads else len(heads), hk,
            mixes.index(ml) if ml in mixes else len(mixes), sum(ml), len(ml), str(r["mix"]))


def row_name(r: dict) -> str:
    """The short name (`8k_4seq`) of a row."""
    return str(r.get("name") or short_name(_lengths(r) or (int(r.get("T", 0) or 0),)))


def cell_ms(r: dict, impl: str, kind: str = "bwd") -> str:
    """Table cell: ms, FAIL (worst error), unchecked, n/a, error, or '-'."""
    st = str(r.get(f"{impl}_status", ""))
    if st == "ok":
        ms = num(r.get(f"{impl}_{kind}_ms"))
        return f"{ms:.3f}" if ms > 0 else "-"
    if st == "FAIL":
        name, e = worst(parse_errs(r.get(f"{impl}_errs", "")), GATE_TOL_BWD)
        return f"FAIL ({name} {e:.1e})" if name else "FAIL"
    if st == "unchecked":
        return "unchecked"
    if st.startswith("error"):
        return "error"
    if st.startswith("not available") or st == "n/a":
        return "n/a"
    return "-"


def _tf_cell(r: dict, impl: str, kind: str, fn) -> str:
    if not is_ok(r, impl, kind):
        return "-"
    tf = fn(num(r[f"{impl}_{kind}_ms"]), int(r["T"]), int(r["h_v"]))
    return f"{tf:.0f} ({pct_of_peak(tf):.1f}%)"


def console_line(r: dict) -> str:
    """One line per finished row for the terminal."""
    parts = [f"{str(r['h_qk']) + '/' + str(r['h_v']):<5} {row_name(r):<8}"]
    for i in IMPLS:
        st = str(r.get(f"{i}_status", ""))
        if st == "ok":
            times = "/".join(f"{num(r.get(f'{i}_{k}_ms')):.3f}" if num(r.get(f"{i}_{k}_ms")) > 0 else "-"
                             for k, _, _ in KINDS)
            parts.append(f"{LABELS[i]} {times} ms (err {num(r.get(f'{i}_err')):.1e})")
        elif st == "FAIL":
            parts.append(f"{LABELS[i]} FAIL ({r.get(f'{i}_errs', '')})")
        elif st:
            parts.append(f"{LABELS[i]} {st}")
    for p in ("fla", "flash_qla"):
        s = [speedup(r, "ours", p, k) for k, _, _ in KINDS]
        if not all(math.isnan(x) for x in s):
            parts.append(f"vs {LABELS[p]} " + "/".join(fmt_x(x) for x in s))
    return " | ".join(parts)


def geomean_table(rows: list[dict]) -> list[str]:
    """Markdown lines: geometric-mean speed-ups for the backward and the training step, over all
    rows, the 8192-token rows and the 32768-token rows."""
    pairs = [("ours", "fla"), ("ours", "flash_qla"), ("flash_qla", "fla")]
    totals = sorted({int(r["T"]) for r in rows})
    subsets = [("all rows", rows)] + [(f"T = {t}", [r for r in rows if int(r["T"]) == t]) for t in totals]
    out = ["| speed-up (geometric mean) | " + " | ".join(s for s, _ in subsets) + " |",
           "| --- | " + " | ".join("---" for _ in subsets) + " |"]
    for kind, title, _ in KINDS:
        for a, b in pairs:
            cells = []
            for _, rs in subsets:
                xs = [x for x in (speedup(r, a, b, kind) for r in rs) if not math.isnan(x)]
                cells.append(f"{fmt_x(geomean(xs))} (n={len(xs)})" if xs else "- (n=0)")
            out.append(f"| {title.split(' (')[0]}: {LABELS[a]} over {LABELS[b]} | " + " | ".join(cells) + " |")
    return out


def _table(rows: list[dict], kind: str, fn) -> list[str]:
    head = ["heads", "mix", "lengths", "T", "N", "ours ms", "FLA ms", "FlashQLA ms", "ours vs FLA", "ours vs FlashQLA",
            "ours TFLOP/s (% of 726)", "FLA TFLOP/s", "FlashQLA TFLOP/s", "peers"]
    L = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for r in rows:
        cells = [f"{r['h_qk']}/{r['h_v']}", row_name(r), str(r["mix"]).replace("1x", "", 1) if int(r["N"]) == 1
                 else str(r["mix"]), str(r["T"]), str(r["N"]),
                 cell_ms(r, "ours", kind), cell_ms(r, "fla", kind), cell_ms(r, "flash_qla", kind),
                 fmt_x(speedup(r, "ours", "fla", kind)), fmt_x(speedup(r, "ours", "flash_qla", kind)),
                 _tf_cell(r, "ours", kind, fn), _tf_cell(r, "fla", kind, fn), _tf_cell(r, "flash_qla", kind, fn),
                 str(r.get("peers_source", ""))]
        L.append("| " + " | ".join(cells) + " |")
    return L


def _gate_table(rows: list[dict]) -> list[str]:
    head = ["heads", "mix", "gate"] + [f"{LABELS[i]} worst" for i in IMPLS] + [
        f.replace("pair_", "").replace("flash_qla", "FlashQLA").replace("fla", "FLA").replace("_", " ~ ", 1)
        for f in PAIR_FIELDS]
    L = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for r in rows:
        cells = [f"{r['h_qk']}/{r['h_v']}", row_name(r), str(r.get("gate", ""))]
        for i in IMPLS:
            name, e = worst(parse_errs(r.get(f"{i}_errs", "")), GATE_TOL_BWD)
            st = str(r.get(f"{i}_status", ""))
            cells.append(f"{name} {e:.1e}" + (" FAIL" if st == "FAIL" else "") if name else "-")
        for f in PAIR_FIELDS:
            v = num(r.get(f))
            cells.append("-" if math.isnan(v) else f"{v:.1e}")
        L.append("| " + " | ".join(cells) + " |")
    return L


def markdown(rows: list[dict], env: dict, commit: str, meta: dict) -> str:
    """The backward results page: header, method, geometric means, the two tables, the gate, the
    drift of the re-timed cached peers (from the rows' re-timed columns)."""
    rows = sorted(rows, key=grid_order)
    L = ["# GDN chunked prefill, backward and training step: ours vs FLA vs FlashQLA", ""]
    L += ["| | |", "| --- | --- |"]
    names = {"gpu": "GPU", "driver": "driver", "cuda": "CUDA (torch build)", "torch": "torch", "triton": "triton",
             "tilelang": "tilelang", "fla": "fla", "flash_qla": "flash_qla"}
    for f in ENV_FIELDS:
        L.append(f"| {names[f]} | {env.get(f, '')} |")
    L.append(f"| our commit | {commit} |")
    L.append(f"| date (UTC) | {meta.get('date', '')} |")
    L += ["", "## Method", ""]
    L += [f"- {line}" for line in meta.get("method", [])]
    L += ["", "## Geometric-mean speed-ups", ""]
    L += geomean_table(rows)
    for kind, title, fn in KINDS:
        L += ["", f"## {title[0].upper() + title[1:]}, per row", ""]
        L += _table(rows, kind, fn)
    L += ["", "## Correctness gate", "",
          "Worst quantity of each implementation (relative RMS against the fp64 result, or against the agreeing "
          "implementation when the row's gate is `pairwise`; the quantity nearest its tolerance: "
          + ", ".join(f"{n} {GATE_TOL_BWD[n]:g}" for n in CHECKED)
          + "), and the largest relative RMS between two implementations over all of o, final state and gradients.",
          ""]
    L += _gate_table(rows)
    L.append("")
    L += drift_section(rows, kinds=(("bwd ", "bwd_ms"), ("step ", "step_ms")), mix_of=row_name)
    return "\n".join(L) + "\n"


def cp_section(rows: list[dict], commit: str, page: str, env: dict | None = None) -> list[str]:
    """The context-parallel page's backward section (`report.CP_BWD_HEADING`): the one-sequence rows of
    `rows` (the backward page's), their geometric-mean speed-ups and the backward and training-step
    tables; `commit`: the rows' commit label; `page`: the backward page's file name, where the method,
    the gate and the drift are; `env`: the rows' environment key, named in the section (the page's
    header is the forward run's). [] without one-sequence rows."""
    from flashqla.bench.report import CP_BWD_HEADING

    one = sorted((r for r in rows if int(r["N"]) == 1), key=grid_order)
    if not one:
        return []
    L = [CP_BWD_HEADING, "",
         f"The one-sequence rows of the backward grid, from `{page}` (its method, correctness gate and drift "
         f"section apply; our commit: {commit}). Ours splits the sequence where the backward's plan predicts a "
         "gain (cp='auto'); FlashQLA runs its own intra-card context parallelism (`auto_cp=True`)."
         + ("" if not env else " Environment: " + ", ".join(f"{f} {env.get(f, '')}" for f in ENV_FIELDS) + "."), ""]
    L += geomean_table(one)
    for kind, title, fn in KINDS:
        L += ["", f"### {title[0].upper() + title[1:]}", ""]
        L += _table(one, kind, fn)
    return L


def plot(rows: list[dict], path) -> Path | None:
    """TFLOP/s per row and implementation: one column of panels per head configuration, the backward
    on top, the training step below. Returns the path, or None without matplotlib or rows."""
    plt = pyplot()
    if plt is None:
        return None
    rows = sorted(rows, key=grid_order)
    heads = heads_in_order(rows)
    if not heads:
        return None
    fig, axes = plt.subplots(2, len(heads), figsize=(4.6 * len(heads), 7.0), squeeze=False)
    colors = {"ours": "tab:red", "fla": "tab:blue", "flash_qla": "tab:green"}
    width = 0.8 / len(IMPLS)
    for col, h in enumerate(heads):
        rs = [r for r in rows if (int(r["h_qk"]), int(r["h_v"])) == h]
        for row_i, (kind, title, fn) in enumerate(KINDS):
            ax = axes[row_i][col]
            for j, i in enumerate(IMPLS):
                ys = [fn(num(r[f"{i}_{kind}_ms"]), int(r["T"]), int(r["h_v"])) if is_ok(r, i, kind) else 0.0
                      for r in rs]
                ax.bar([x + (j - (len(IMPLS) - 1) / 2) * width for x in range(len(rs))], ys, width, label=LABELS[i],
                       color=colors[i])
            ax.set_xticks(list(range(len(rs))))
            ax.set_xticklabels([row_name(r) for r in rs], rotation=45, ha="right", fontsize=7)
            ax.set_title(f"{title.split(' (')[0]}, h_qk/h_v = {h[0]}/{h[1]}", fontsize=9)
            ax.set_ylabel("TFLOP/s")
            ax.grid(axis="y", alpha=0.3)
    axes[0][0].legend(fontsize=8)
    fig.suptitle("GDN backward (491,520 FLOP per token-head) and training step (655,360), TFLOP/s\n"
                 f"(bf16 GEMM rate {PEAK_TFLOPS:.0f}; no bar: not timed or failed the gate)", fontsize=10)
    return save_figure(plt, fig, path)

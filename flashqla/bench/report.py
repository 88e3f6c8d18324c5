"""Formatting of the results: console lines, the markdown table, geometric means, the plot.

Speed-up of ours over a peer = peer ms / our ms (above 1: ours is faster), on rows where both
passed the gate. TFLOP/s on DESIGN.md section 6's count (163,840 FLOP per token and value head)
and as a percentage of the 726 TFLOP/s bf16 GEMM rate of our H200.
"""

from __future__ import annotations

import math
from pathlib import Path

from flashqla.bench.breakdown import COPY_TBPS, STEP_NAMES
from flashqla.bench.grid import FWD_HEADS, FWD_MIXES, PEAK_TFLOPS, parse_mix, pct_of_peak, tflops
from flashqla.bench.peers import ENV_FIELDS, IMPLS, LABELS, PEERS

__all__ = [
    "num",
    "is_ok",
    "speedup",
    "geomean",
    "grid_order",
    "cell_ms",
    "console_line",
    "geomean_table",
    "markdown",
    "method_from_markdown",
    "PEERS_METHOD",
    "with_current_peers_method",
    "drift_section",
    "CP_BWD_HEADING",
    "splice_section",
    "kept_section",
    "plot",
]

#: The Method bullet on the peers column, the same on every page (forward, CP, backward); a page
#: rebuilt from the CSV (--report-only) gets it in place of the one its earlier version had.
PEERS_METHOD = (
    "Peers column: `live` = timed in this process on the same inputs; `cached` = read from the peers CSV of this "
    "environment key; `cached (re-timed)` = cached, and timed again live by the measuring run to check the cache "
    "(`--retime`): the Drift section lists these rows, with the live time and its difference from the cached one "
    "where the results CSV keeps them (its `<peer>_retime_*` columns; rows re-timed before those columns existed "
    "are named without them).")


def num(x) -> float:
    """A CSV cell (or a number) as float; empty or unparsable -> NaN."""
    if isinstance(x, (int, float)):
        return float(x)
    try:
        return float(x)
    except (TypeError, ValueError):
        return math.nan


def is_ok(r: dict, impl: str) -> bool:
    """True when `impl` passed the gate on row `r` and has a time."""
    ms = num(r.get(f"{impl}_ms"))
    return str(r.get(f"{impl}_status", "")) == "ok" and ms > 0


def speedup(r: dict, a: str = "ours", b: str = "fla") -> float:
    """b's time over a's time on row r (how many times faster a is); NaN unless both are ok."""
    if not (is_ok(r, a) and is_ok(r, b)):
        return math.nan
    return num(r[f"{b}_ms"]) / num(r[f"{a}_ms"])


def geomean(xs) -> float:
    """Geometric mean of the finite positive values of xs (NaN when there are none)."""
    v = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    if not v:
        return math.nan
    return math.exp(sum(math.log(x) for x in v) / len(v))


def _is_cp(r: dict) -> bool:
    return str(r.get("cp_row", "")).lower() in ("1", "true", "yes", "cp")


def grid_order(r: dict) -> tuple:
    """Sort key: the published grid's head-config order, then its mix order; extras last."""
    heads = [(h.h_qk, h.h_v) for h in FWD_HEADS]
    hk = (int(r["h_qk"]), int(r["h_v"]))
    mixes = [m.lengths for m in FWD_MIXES]
    try:
        ml = parse_mix(str(r["mix"])).lengths
    except ValueError:
        ml = ()
    return (heads.index(hk) if hk in heads else len(heads), hk,
            mixes.index(ml) if ml in mixes else len(mixes), str(r["mix"]))


def cell_ms(r: dict, impl: str) -> str:
    """Table cell of one implementation's time: ms, FAIL (with the error), n/a, error, or '-'."""
    st = str(r.get(f"{impl}_status", ""))
    if st == "ok":
        return f"{num(r[f'{impl}_ms']):.3f}"
    if st == "FAIL":
        errs = [num(r.get(f"{impl}_err_o")), num(r.get(f"{impl}_err_ht"))]
        e = max((x for x in errs if not math.isnan(x)), default=math.nan)
        return f"FAIL ({e:.1e})" if not math.isnan(e) else "FAIL"
    if st.startswith("error"):
        return "error"
    if st.startswith("not available") or st == "n/a":
        return "n/a"
    return "-"


def _tf_cell(r: dict, impl: str) -> str:
    if not is_ok(r, impl):
        return "-"
    tf = tflops(num(r[f"{impl}_ms"]), int(r["T"]), int(r["h_v"]))
    return f"{tf:.0f} ({pct_of_peak(tf):.1f}%)"


def fmt_x(v: float) -> str:
    """A speed-up cell: `1.23x`, or '-' when undefined (NaN)."""
    return "-" if math.isnan(v) else f"{v:.2f}x"


def console_line(r: dict) -> str:
    """One line per finished row for the terminal."""
    parts = [f"{r['h_qk']}/{r['h_v']:<3} {r['mix']:<12}"]
    for i in IMPLS:
        st = str(r.get(f"{i}_status", ""))
        if st == "ok":
            parts.append(f"{LABELS[i]} {num(r[f'{i}_ms']):.3f} ms (err {num(r.get(f'{i}_err_o')):.1e})")
        elif st == "FAIL":
            parts.append(f"{LABELS[i]} FAIL (err o {num(r.get(f'{i}_err_o')):.1e}, ht {num(r.get(f'{i}_err_ht')):.1e})")
        elif st:
            parts.append(f"{LABELS[i]} {st}")
    for p in ("fla", "flash_qla"):
        s = speedup(r, "ours", p)
        if not math.isnan(s):
            parts.append(f"vs {LABELS[p]} {s:.2f}x")
    return " | ".join(parts)


def geomean_table(rows: list[dict]) -> list[str]:
    """Markdown lines: geometric-mean speed-ups over all rows, CP rows and the other rows."""
    pairs = [("ours", "fla"), ("ours", "flash_qla"), ("flash_qla", "fla")]
    subsets = [("all rows", rows), ("CP rows", [r for r in rows if _is_cp(r)]),
               ("other rows", [r for r in rows if not _is_cp(r)])]
    out = ["| speed-up (geometric mean) | " + " | ".join(s for s, _ in subsets) + " |",
           "| --- | " + " | ".join("---" for _ in subsets) + " |"]
    for a, b in pairs:
        cells = []
        for _, rs in subsets:
            xs = [speedup(r, a, b) for r in rs]
            xs = [x for x in xs if not math.isnan(x)]
            cells.append(f"{fmt_x(geomean(xs))} (n={len(xs)})" if xs else "- (n=0)")
        out.append(f"| {LABELS[a]} over {LABELS[b]} | " + " | ".join(cells) + " |")
    return out


#: The heading of the context-parallel page's backward section (`bwd_report.cp_section`): the backward
#: benchmark writes it, the forward one keeps it when it rewrites the page.
CP_BWD_HEADING = "## Backward and training step, one sequence"


def splice_section(text: str, heading: str, lines: list[str]) -> str:
    """`text` with the section that starts at the line `heading` (to the end: it is the last section)
    replaced by `lines`, or `lines` appended when there is none; empty `lines` removes the section."""
    cut = _section_start(text, heading)
    head = (text if cut < 0 else text[:cut]).rstrip("\n")
    head = head + "\n\n" if head else ""
    return (head + "\n".join(lines) + "\n") if lines else (head[:-1] if head else "")


def _section_start(text: str, heading: str) -> int:
    """Offset of the line `heading` in `text` (at the start, or after a newline; the line may end the
    text), or -1."""
    i = text.find(heading)
    while i >= 0:
        end = i + len(heading)
        if (i == 0 or text[i - 1] == "\n") and (end == len(text) or text[end] == "\n"):
            return i
        i = text.find(heading, i + 1)
    return -1


def kept_section(path, heading: str = CP_BWD_HEADING) -> list[str]:
    """The lines of the section `heading` (the page's last) of the file at `path`, or [] when the file or
    the section is not there."""
    path = Path(path)
    if not path.exists():
        return []
    text = path.read_text()
    cut = _section_start(text, heading)
    return [] if cut < 0 else text[cut:].rstrip("\n").split("\n")


def markdown(rows: list[dict], env: dict, commit: str, meta: dict, breakdown_rows: list[dict] | None = None,
             title: str = "GDN chunked prefill, forward: ours vs FLA vs FlashQLA") -> str:
    """The results page: header, method, geometric means, the table, drift (from the rows' re-timed
    columns) and breakdown."""
    rows = sorted(rows, key=grid_order)
    L = [f"# {title}", ""]
    L += ["| | |", "| --- | --- |"]
    names = {"gpu": "GPU", "driver": "driver", "cuda": "CUDA (torch build)", "torch": "torch", "triton": "triton",
             "tilelang": "tilelang", "fla": "fla", "flash_qla": "flash_qla"}
    for f in ENV_FIELDS:
        L.append(f"| {names[f]} | {env.get(f, '')} |")
    L.append(f"| our commit | {commit} |")
    L.append(f"| date (UTC) | {meta.get('date', '')} |")
    L.append("")
    L.append("## Method")
    L.append("")
    for line in meta.get("method", []):
        L.append(f"- {line}")
    L.append("")
    L.append("## Geometric-mean speed-ups")
    L.append("")
    L += geomean_table(rows)
    L.append("")
    L.append("CP rows (marked `CP` below) are the single-sequence few-head rows: the longest sequence holds at "
             "least 3/4 of the tokens and the effective parallelism `par` = h_v x T / max length is below half "
             "the SM count, so a kernel walking each (sequence, head) chunk chain on one SM leaves most SMs idle. "
             "They belong to the context-parallel work; the other rows measure the fused kernel itself.")
    L.append("")
    L.append("## Forward, per row")
    L.append("")
    head = ["heads", "mix", "T", "N", "par", "CP", "ours ms", "FLA ms", "FlashQLA ms", "ours vs FLA",
            "ours vs FlashQLA", "ours TFLOP/s (% of 726)", "FLA TFLOP/s", "FlashQLA TFLOP/s", "peers"]
    L.append("| " + " | ".join(head) + " |")
    L.append("|" + "|".join(" --- " for _ in head) + "|")
    for r in rows:
        cells = [f"{r['h_qk']}/{r['h_v']}", str(r["mix"]), str(r["T"]), str(r["N"]),
                 f"{num(r.get('parallelism')):.0f}", "CP" if _is_cp(r) else "",
                 cell_ms(r, "ours"), cell_ms(r, "fla"), cell_ms(r, "flash_qla"),
                 fmt_x(speedup(r, "ours", "fla")), fmt_x(speedup(r, "ours", "flash_qla")),
                 _tf_cell(r, "ours"), _tf_cell(r, "fla"), _tf_cell(r, "flash_qla"), str(r.get("peers_source", ""))]
        L.append("| " + " | ".join(cells) + " |")
    L.append("")
    errs = []
    for i in IMPLS:
        e = [max(num(r.get(f"{i}_err_o")), num(r.get(f"{i}_err_ht"))) for r in rows if is_ok(r, i)]
        e = [x for x in e if not math.isnan(x)]
        if e:
            errs.append(f"{LABELS[i]} max {max(e):.1e}")
    if errs:
        L.append("Gate errors (relative RMS of o and final state against the fp64 result, worst over the passing "
                 "rows): " + "; ".join(errs) + ".")
        L.append("")
    L += drift_section(rows)
    if breakdown_rows:
        L += breakdown_markdown(breakdown_rows, rows)
    return "\n".join(L) + "\n"


def method_from_markdown(md: str) -> list[str]:
    """The bullet lines of the '## Method' section of an earlier page (for --report-only)."""
    out, inside = [], False
    for line in md.splitlines():
        if line.startswith("## "):
            inside = line.strip() == "## Method"
            continue
        if inside and line.startswith("- "):
            out.append(line[2:])
    return out


def with_current_peers_method(lines: list[str]) -> list[str]:
    """Method lines (of an earlier page, for --report-only) with the peers-column bullet replaced by
    `PEERS_METHOD`, the one that says what the page's Drift section shows."""
    return [PEERS_METHOD if line.startswith("Peers column:") else line for line in lines]


def _timed_cell(ms: float, status: str) -> str:
    return f"{ms:.3f}" if str(status) == "ok" and ms > 0 else (str(status) or "-")


def drift_section(rows: list[dict], kinds=(("", "ms"),), mix_of=None) -> list[str]:
    """Markdown lines of the '## Drift' section, from the rows as the results CSV keeps them: each
    cached peer that the measuring run timed again (`<peer>_retime_status` filled) with the cached
    time (`<peer>_<field>`, the one the tables show), the live one (`<peer>_retime_<field>`) and the
    difference live / cached - 1, per timed `field` of `kinds` ((label, field) pairs: the forward's
    "ms", the backward's "bwd_ms" and "step_ms"); then the rows marked re-timed in the peers column
    whose live times the CSV does not keep (written before the re-timed columns existed), by name
    only. Nothing is computed that the rows do not hold. `mix_of(row)`: the mix cell (default the
    `mix` column)."""
    mix_of = mix_of or (lambda r: str(r["mix"]))
    recorded, unrecorded = [], []
    for r in rows:
        peers = [p for p in PEERS if str(r.get(f"{p}_retime_status", "")).strip()]
        recorded += [(r, p) for p in peers]
        if not peers and "re-timed" in str(r.get("peers_source", "")):
            unrecorded.append(r)
    L = ["## Drift of the cached peer timings", ""]
    if recorded:
        L += ["Cached peer timings that the measuring run timed again live (`--retime`; peers column "
              "`cached (re-timed)`), as the results CSV keeps them: the cached time (the one in the tables above), "
              "the live one, and the difference live / cached - 1.", ""]
        head = ["heads", "mix", "impl"]
        for label, _ in kinds:
            head += [f"cached {label}ms", f"re-timed {label}ms", f"{label}difference"]
        head.append("our commit")
        L += ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
        for r, p in recorded:
            cells = [f"{r['h_qk']}/{r['h_v']}", mix_of(r), LABELS[p]]
            for _, field in kinds:
                cached, live = num(r.get(f"{p}_{field}")), num(r.get(f"{p}_retime_{field}"))
                cached_st, live_st = str(r.get(f"{p}_status", "")), str(r.get(f"{p}_retime_status", ""))
                ok = cached_st == "ok" and live_st == "ok" and cached > 0 and live > 0
                cells += [_timed_cell(cached, cached_st), _timed_cell(live, live_st),
                          f"{100 * (live / cached - 1):+.1f}%" if ok else "-"]
            cells.append(str(r.get("commit", "")))
            L.append("| " + " | ".join(cells) + " |")
        L.append("")
    if unrecorded:
        names = "; ".join(f"{r['h_qk']}/{r['h_v']} {mix_of(r)} at {r.get('commit', '')}" for r in unrecorded)
        L.append(("Also re-timed, live times not recorded" if recorded else "No re-timed rows recorded")
                 + f": the rows marked `cached (re-timed)` in the peers column ({names}) were re-timed by runs "
                   "that predate the results CSV's re-timed columns (`<peer>_retime_*`); their live times went "
                   "to those runs' logs only.")
        L.append("")
    elif not recorded:
        L += ["No re-timed rows recorded.", ""]
    return L


def breakdown_markdown(brows: list[dict], rows: list[dict]) -> list[str]:
    """Markdown lines of the FLA step breakdown, one table per row."""
    from collections import OrderedDict

    L = ["## FLA's forward, kernel by kernel", "",
         "Each FLA step timed alone (same CUDA-graph timer) on the previous steps' outputs. Bytes from shapes and "
         "dtypes: inputs read once each (a lower bound), intermediates written to HBM by one step and read back by "
         f"a later one, outputs. Round trip at the measured copy rate of {COPY_TBPS:.1f} TB/s.", ""]
    by_row: dict = OrderedDict()
    for b in sorted(brows, key=grid_order):
        by_row.setdefault((b["h_qk"], b["h_v"], b["mix"]), {})[b["step"]] = b
    res = {(str(r["h_qk"]), str(r["h_v"]), str(r["mix"])): r for r in rows}
    MB = 1e6
    for key, steps in by_row.items():
        h_qk, h_v, mix = key
        L.append(f"### {h_qk}/{h_v} {mix}")
        L.append("")
        L.append("| step | ms | share | inputs read MB | intermediates read MB | intermediates written MB | outputs MB | GB/s |")
        L.append("| --- | --- | --- | --- | --- | --- | --- | --- |")
        total = sum(num(steps[s]["ms"]) for s in STEP_NAMES if s in steps)
        inter = 0.0
        for s in STEP_NAMES:
            if s not in steps:
                continue
            b = steps[s]
            ms = num(b["ms"])
            nbytes = sum(num(b[f]) for f in ("inputs_read", "inter_read", "inter_written", "out_written"))
            inter += num(b["inter_read"]) + num(b["inter_written"])
            L.append(f"| {s}{' (' + b['note'] + ')' if b.get('note') else ''} | {ms:.3f} | {100 * ms / total:.0f}% | "
                     f"{num(b['inputs_read']) / MB:.1f} | {num(b['inter_read']) / MB:.1f} | "
                     f"{num(b['inter_written']) / MB:.1f} | {num(b['out_written']) / MB:.1f} | "
                     f"{nbytes / (ms * 1e-3) / 1e9:.0f} |")
        L.append("")
        whole = res.get(key, {})
        fla_ms = num(whole.get("fla_ms")) if is_ok(whole, "fla") else math.nan
        rt_ms = inter / (COPY_TBPS * 1e12) * 1e3
        L.append(f"- sum of the five steps: {total:.3f} ms; FLA's whole forward in one graph: "
                 + (f"{fla_ms:.3f} ms" if fla_ms > 0 else "-"))
        if "intra" in steps:
            L.append(f"- `chunk_gated_delta_rule_fwd_intra` (kkt_solve + recompute_w_u_fwd in 0.6.0): {num(steps['intra']['ms']):.3f} ms")
        L.append(f"- intermediates' HBM round trip (g_cum, A, w, u, h, v_new written and read back): "
                 f"{inter / MB:.1f} MB = {rt_ms:.3f} ms at {COPY_TBPS:.1f} TB/s"
                 + (f" ({100 * rt_ms / fla_ms:.0f}% of FLA's forward)" if fla_ms > 0 else ""))
        for i in ("ours", "flash_qla"):
            L.append(f"- {LABELS[i]} (whole forward): " + (f"{num(whole[f'{i}_ms']):.3f} ms" if is_ok(whole, i) else cell_ms(whole, i) if whole else "-"))
        L.append("")
    return L


def pyplot():
    """matplotlib.pyplot on the Agg backend, or None when matplotlib is not installed."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return None
    return plt


def save_figure(plt, fig, path) -> Path:
    """Lays out `fig`, writes it as a PNG to `path` (creating its folder) and closes it."""
    fig.tight_layout()
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(p, dpi=110)
    plt.close(fig)
    return p


def heads_in_order(rows: list[dict]) -> list[tuple[int, int]]:
    """The (h_qk, h_v) head configurations of `rows`, in the order they first appear."""
    return list(dict.fromkeys((int(r["h_qk"]), int(r["h_v"])) for r in rows))


def plot(rows: list[dict], path) -> Path | None:
    """TFLOP/s per row and implementation, one panel per head configuration; writes a PNG.

    Returns the path, or None when matplotlib is missing or there is nothing to plot."""
    plt = pyplot()
    if plt is None:
        return None
    rows = sorted(rows, key=grid_order)
    heads = heads_in_order(rows)
    if not heads:
        return None
    ncol = min(3, len(heads))
    nrow = math.ceil(len(heads) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.5 * ncol, 3.8 * nrow), squeeze=False)
    colors = {"ours": "tab:red", "fla": "tab:blue", "flash_qla": "tab:green"}
    width = 0.27
    for ax, h in zip(axes.flat, heads):
        rs = [r for r in rows if (int(r["h_qk"]), int(r["h_v"])) == h]
        xs = range(len(rs))
        for j, i in enumerate(IMPLS):
            ys = [tflops(num(r[f"{i}_ms"]), int(r["T"]), int(r["h_v"])) if is_ok(r, i) else 0.0 for r in rs]
            ax.bar([x + (j - 1) * width for x in xs], ys, width, label=LABELS[i], color=colors[i])
        ax.set_xticks(list(xs))
        ax.set_xticklabels([("*" if _is_cp(r) else "") + str(r["mix"]) for r in rs], rotation=60, ha="right", fontsize=7)
        ax.set_title(f"h_qk/h_v = {h[0]}/{h[1]}")
        ax.set_ylabel("TFLOP/s")
        ax.grid(axis="y", alpha=0.3)
    for ax in list(axes.flat)[len(heads):]:
        ax.axis("off")
    axes.flat[0].legend(fontsize=8)
    fig.suptitle(f"GDN forward, TFLOP/s on 163,840 FLOP per token-head\n(bf16 GEMM rate {PEAK_TFLOPS:.0f}; * = CP row)",
                 fontsize=10)
    return save_figure(plt, fig, path)


def plot_vs_T(rows: list[dict], path) -> Path | None:
    """Milliseconds against T (log-log) per implementation, one panel per head configuration: the
    context-parallel benchmark's plot (single-sequence rows). Returns the path, or None when
    matplotlib is missing or there is nothing to plot."""
    plt = pyplot()
    if plt is None:
        return None
    heads = heads_in_order(sorted(rows, key=grid_order))
    if not heads:
        return None
    ncol = min(2, len(heads))
    nrow = math.ceil(len(heads) / ncol)
    fig, axes = plt.subplots(nrow, ncol, figsize=(6.0 * ncol, 4.0 * nrow), squeeze=False)
    colors = {"ours": "tab:red", "fla": "tab:blue", "flash_qla": "tab:green"}
    for ax, h in zip(axes.flat, heads):
        rs = sorted((r for r in rows if (int(r["h_qk"]), int(r["h_v"])) == h), key=lambda r: int(r["T"]))
        for i in IMPLS:
            pts = [(int(r["T"]), num(r[f"{i}_ms"])) for r in rs if is_ok(r, i)]
            if pts:
                ax.plot([p[0] for p in pts], [p[1] for p in pts], "o-", label=LABELS[i], color=colors[i])
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
    return save_figure(plt, fig, path)

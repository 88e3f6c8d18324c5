"""The pages of the benchmark: markdown from the results CSVs (and the plots, `plots`).

Pages (`<gpu>` e.g. `h200`):

- `<gpu>-fwd.md`: environment, method, geometric-mean speed-ups (all rows, CP rows, other rows),
  the per-row table (ms, speed-ups, TFLOP/s and % of 726), gate errors, drift, FLA's breakdown;
- `<gpu>-cp.md`: the same for the rows of the context-parallel grid, then the backward's
  one-sequence rows as its last section (`CP_BWD_HEADING`: written by the backward's pages, kept by
  the forward's);
- `<gpu>-bwd.md`: environment, method, geometric-mean speed-ups (all rows and per total T) of the
  backward and the training step, one table each, the correctness gate, drift.

Speed-up of ours over a peer = peer ms / our ms (above 1: ours is faster), on rows where both passed
the gate. TFLOP/s on DESIGN.md section 6's counts (`grid.FLOP_PER_TOKEN_HEAD`) and as a percentage of
the 726 TFLOP/s bf16 GEMM rate of our H200.

`write_pages` writes a benchmark's pages (and plots) from its CSVs; `rebuild` is `--report-only`:
the pages of the latest commit's rows (with `also` commits filling the rows it lacks), keeping the
Method lines of the page in the results folder (the measuring run's) and writing to the pages folder.
"""

from __future__ import annotations

import math
import sys
from pathlib import Path

from flashqla.bench import grid as G
from flashqla.bench import plots
from flashqla.bench import store as S
from flashqla.bench.breakdown import COPY_TBPS, STEP_NAMES
from flashqla.bench.gate import CHECKED, GATE_TOL, parse_errs, worst
from flashqla.bench.impls import BASE_ENV_FIELDS, LABELS, impls_for, peers_for
from flashqla.bench.store import grid_order, is_cp, is_ok, num, row_name
from flashqla.bench.timing import DEFAULTS

__all__ = [
    "speedup", "geomean", "fmt_x", "cell_ms", "console_line",
    "geomean_table", "markdown", "cp_section", "breakdown_markdown", "drift_section", "method_from_markdown",
    "with_current_peers_method", "method_lines", "pairs_for", "env_fields", "PEERS_METHOD", "CP_BWD_HEADING", "splice_section", "kept_section",
    "commit_label", "fill_cached_peers", "write_pages", "rebuild",
]

#: The Method bullet on the peers column, the same on every page (forward, CP, backward); a page
#: rebuilt from the CSV (--report-only) gets it in place of the one its earlier version had.
PEERS_METHOD = (
    "Peers column: `live` = timed in this process on the same inputs; `cached` = read from the peers CSV of this "
    "environment key; `cached (re-timed)` = cached, and timed again live by the measuring run to check the cache "
    "(`--retime`): the Drift section lists these rows, with the live time and its difference from the cached one "
    "where the results CSV keeps them (its `<peer>_retime_*` columns; rows re-timed before those columns existed "
    "are named without them).")
#: The heading of the context-parallel page's backward section (`cp_section`): the backward's pages
#: write it, the forward's keep it when they rewrite the page.
CP_BWD_HEADING = "## Backward and training step, one sequence"


def pairs_for(direction: str) -> list[tuple[str, str]]:
    """Speed-up pairs of the geometric means: ours over each peer of `direction`'s benchmark, then
    each peer over the ones before it."""
    peers = peers_for(direction)
    return [("ours", p) for p in peers] + [(b, a) for i, a in enumerate(peers) for b in peers[i + 1:]]


def env_fields(direction: str) -> tuple[str, ...]:
    """The environment fields a page of `direction` shows: the platform, then its peers' versions."""
    return BASE_ENV_FIELDS + peers_for(direction)
_ENV_NAMES = {"gpu": "GPU", "cuda": "CUDA (torch build)"}


def speedup(r: dict, a: str = "ours", b: str = "fla", field: str = "ms") -> float:
    """b's time over a's time on row r (how many times faster a is); NaN unless both are ok."""
    if not (is_ok(r, a, field) and is_ok(r, b, field)):
        return math.nan
    return num(r[f"{b}_{field}"]) / num(r[f"{a}_{field}"])


def geomean(xs) -> float:
    """Geometric mean of the finite positive values of xs (NaN when there are none)."""
    v = [x for x in xs if x is not None and x > 0 and math.isfinite(x)]
    if not v:
        return math.nan
    return math.exp(sum(math.log(x) for x in v) / len(v))


def fmt_x(v: float) -> str:
    """A speed-up cell: `1.23x`, or '-' when undefined (NaN)."""
    return "-" if math.isnan(v) else f"{v:.2f}x"


def _fail_detail(direction: str, r: dict, impl: str) -> str:
    if direction == "bwd":
        name, e = worst(parse_errs(r.get(f"{impl}_errs", "")), GATE_TOL["bwd"])
        return f"{name} {e:.1e}" if name else ""
    errs = [num(r.get(f"{impl}_err_o")), num(r.get(f"{impl}_err_ht"))]
    e = max((x for x in errs if not math.isnan(x)), default=math.nan)
    return "" if math.isnan(e) else f"{e:.1e}"


def cell_ms(r: dict, impl: str, direction: str = "fwd", field: str | None = None) -> str:
    """Table cell of one implementation's time in `<impl>_<field>` (default: the benchmark's first
    timed column): ms, FAIL (with the worst error), unchecked, n/a, error, or '-'."""
    field = field or S.SCHEMAS[direction].timed[0][0]
    st = str(r.get(f"{impl}_status", ""))
    if st == "ok":
        ms = num(r.get(f"{impl}_{field}"))
        return f"{ms:.3f}" if ms > 0 else "-"
    if st == "FAIL":
        detail = _fail_detail(direction, r, impl)
        return f"FAIL ({detail})" if detail else "FAIL"
    if st == "unchecked":
        return "unchecked"
    if st.startswith("error"):
        return "error"
    if st.startswith(("not available", "not supported")) or st == "n/a":
        return "n/a"
    return "-"


def _tf_cell(r: dict, impl: str, field: str, kind: str) -> str:
    if not is_ok(r, impl, field):
        return "-"
    tf = G.tflops(num(r[f"{impl}_{field}"]), int(r["T"]), int(r["h_v"]), kind)
    peak = G.peak_tflops(r.get("gpu", ""))
    return f"{tf:.0f}" if peak is None else f"{tf:.0f} ({G.pct_of_peak(tf, peak):.1f}%)"


def console_line(direction: str, r: dict) -> str:
    """One line per finished row for the terminal: each implementation's times (the backward:
    backward/step) and error, then the speed-ups of ours over each peer."""
    timed = S.SCHEMAS[direction].timed
    name = row_name(r) if direction == "bwd" else str(r["mix"])
    parts = [f"{str(r['h_qk']) + '/' + str(r['h_v']):<5} {name:<12}"]
    for i in impls_for(direction):
        st = str(r.get(f"{i}_status", ""))
        if st == "ok":
            times = "/".join(f"{num(r.get(f'{i}_{f}')):.3f}" if num(r.get(f"{i}_{f}")) > 0 else "-" for f, _, _ in timed)
            err = num(r.get(f"{i}_err" if direction == "bwd" else f"{i}_err_o"))
            parts.append(f"{LABELS[i]} {times} ms (err {err:.1e})")
        elif st == "FAIL":
            errs = (r.get(f"{i}_errs", "") if direction == "bwd"
                    else f"err o {num(r.get(f'{i}_err_o')):.1e}, ht {num(r.get(f'{i}_err_ht')):.1e}")
            parts.append(f"{LABELS[i]} FAIL ({errs})")
        elif st:
            parts.append(f"{LABELS[i]} {st}")
    for p in peers_for(direction):
        s = [speedup(r, "ours", p, f) for f, _, _ in timed]
        if not all(math.isnan(x) for x in s):
            parts.append(f"vs {LABELS[p]} " + "/".join(fmt_x(x) for x in s))
    return " | ".join(parts)


# ---------------------------------------------------------------------------------------- tables


def geomean_table(direction: str, rows: list[dict]) -> list[str]:
    """Markdown lines: geometric-mean speed-ups per timed column and pair (`pairs_for`), over all rows
    and subsets (the forward: CP rows and the other rows; the backward: each total T)."""
    if direction == "bwd":
        subsets = [("all rows", rows)] + [(f"T = {t}", [r for r in rows if int(r["T"]) == t])
                                          for t in sorted({int(r["T"]) for r in rows})]
    else:
        subsets = [("all rows", rows), ("CP rows", [r for r in rows if is_cp(r)]),
                   ("other rows", [r for r in rows if not is_cp(r)])]
    timed = S.SCHEMAS[direction].timed
    out = ["| speed-up (geometric mean) | " + " | ".join(s for s, _ in subsets) + " |",
           "| --- | " + " | ".join("---" for _ in subsets) + " |"]
    for field, _, title in timed:
        prefix = f"{title.split(' (')[0]}: " if len(timed) > 1 else ""
        for a, b in pairs_for(direction):
            cells = []
            for _, rs in subsets:
                xs = [x for x in (speedup(r, a, b, field) for r in rs) if not math.isnan(x)]
                cells.append(f"{fmt_x(geomean(xs))} (n={len(xs)})" if xs else "- (n=0)")
            out.append(f"| {prefix}{LABELS[a]} over {LABELS[b]} | " + " | ".join(cells) + " |")
    return out


def _lead_columns(direction: str) -> list[tuple[str, object]]:
    """The per-row table's first columns: the row itself."""
    heads = ("heads", lambda r: f"{r['h_qk']}/{r['h_v']}")
    if direction == "bwd":
        return [heads, ("mix", row_name),
                ("lengths", lambda r: str(r["mix"]).replace("1x", "", 1) if int(r["N"]) == 1 else str(r["mix"])),
                ("T", lambda r: str(r["T"])), ("N", lambda r: str(r["N"]))]
    return [heads, ("mix", lambda r: str(r["mix"])), ("T", lambda r: str(r["T"])), ("N", lambda r: str(r["N"])),
            ("par", lambda r: f"{num(r.get('parallelism')):.0f}"), ("CP", lambda r: "CP" if is_cp(r) else "")]


def _table(direction: str, rows: list[dict], field: str, kind: str) -> list[str]:
    """The per-row table of one timed column: the row, each implementation's ms, ours over each peer,
    each implementation's TFLOP/s, the peers' source."""
    lead = _lead_columns(direction)
    impls, peers = impls_for(direction), peers_for(direction)
    peak = G.peak_tflops(rows[0].get("gpu", "")) if rows else None
    head = ([h for h, _ in lead] + [f"{LABELS[i]} ms" for i in impls] + [f"ours vs {LABELS[p]}" for p in peers]
            + [f"{LABELS[i]} TFLOP/s" + (f" (% of {peak:.0f})" if i == "ours" and peak else "") for i in impls]
            + ["peers"])
    L = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for r in rows:
        cells = ([fn(r) for _, fn in lead] + [cell_ms(r, i, direction, field) for i in impls]
                 + [fmt_x(speedup(r, "ours", p, field)) for p in peers]
                 + [_tf_cell(r, i, field, kind) for i in impls] + [str(r.get("peers_source", ""))])
        L.append("| " + " | ".join(cells) + " |")
    return L


def _header(title: str, env: dict, commit: str, meta: dict, direction: str = "fwd") -> list[str]:
    """A page's title, environment table (`env_fields(direction)`), commit, date and Method section."""
    L = [f"# {title}", "", "| | |", "| --- | --- |"]
    L += [f"| {_ENV_NAMES.get(f, f)} | {env.get(f, '')} |" for f in env_fields(direction)]
    L += [f"| our commit | {commit} |", f"| date (UTC) | {meta.get('date', '')} |", "", "## Method", ""]
    L += [f"- {line}" for line in meta.get("method", [])]
    return L + [""]


def _timed_cell(ms: float, status: str) -> str:
    return f"{ms:.3f}" if str(status) == "ok" and ms > 0 else (str(status) or "-")


def drift_section(rows: list[dict], kinds=(("", "ms"),), mix_of=None, direction: str = "fwd") -> list[str]:
    """Markdown lines of the '## Drift' section, from the rows as the results CSV keeps them: each
    cached peer that the measuring run timed again (`<peer>_retime_status` filled) with the cached
    time (`<peer>_<field>`, the one the tables show), the live one (`<peer>_retime_<field>`) and the
    difference live / cached - 1, per timed `field` of `kinds` ((label, field) pairs: the forward's
    "ms", the backward's "bwd_ms" and "step_ms"); then the rows marked re-timed in the peers column
    whose live times the CSV does not keep (written before the re-timed columns existed), by name
    only. Nothing is computed that the rows do not hold. `mix_of(row)`: the mix cell (default the
    `mix` column); `direction`: whose peers are listed."""
    mix_of = mix_of or (lambda r: str(r["mix"]))
    recorded, unrecorded = [], []
    for r in rows:
        peers = [p for p in peers_for(direction) if str(r.get(f"{p}_retime_status", "")).strip()]
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


# ---------------------------------------------------------------------------------------- pages

FWD_TITLE = "GDN chunked prefill, forward"
CP_TITLE = "GDN chunked prefill, one long sequence (context parallelism)"
BWD_TITLE = "GDN chunked prefill, backward and training step"


def page_title(prefix: str, direction: str, rows: list[dict]) -> str:
    """A page's title: `prefix`, then ours and each peer of `direction` that has a gated time on at
    least one of the page's rows ("ours vs FLA vs ..."); a peer never timed on this GPU is left out
    of the title (its columns stay, empty)."""
    field = "bwd_ms" if direction == "bwd" else "ms"
    shown = [i for i in impls_for(direction) if i == "ours" or any(is_ok(r, i, field) for r in rows)]
    return f"{prefix}: " + " vs ".join(LABELS[i] for i in shown)


def markdown(direction: str, rows: list[dict], env: dict, commit: str, meta: dict,
             breakdown_rows: list[dict] | None = None, title: str | None = None) -> str:
    """The results page of `rows` (see the module docstring): `commit` is the header's commit cell,
    `meta` holds "date" and the "method" lines; the forward's `breakdown_rows` add FLA's breakdown;
    `title` (default the benchmark's)."""
    rows = sorted(rows, key=lambda r: grid_order(r, direction))
    L = _header(page_title(title or (BWD_TITLE if direction == "bwd" else FWD_TITLE), direction, rows), env, commit, meta,
                direction)
    L += ["## Geometric-mean speed-ups", ""] + geomean_table(direction, rows)
    if direction == "bwd":
        for field, kind, title in S.SCHEMAS["bwd"].timed:
            L += ["", f"## {title[0].upper() + title[1:]}, per row", ""] + _table("bwd", rows, field, kind)
        L += ["", "## Correctness gate", "",
              "Worst quantity of each implementation (relative RMS against the fp64 result, or against the agreeing "
              "implementation when the row's gate is `pairwise`; the quantity nearest its tolerance: "
              + ", ".join(f"{n} {GATE_TOL['bwd'][n]:g}" for n in CHECKED["bwd"])
              + "), and the largest relative RMS between two implementations over all of o, final state and "
                "gradients.", ""]
        L += _gate_table(rows) + [""]
        L += drift_section(rows, kinds=(("bwd ", "bwd_ms"), ("step ", "step_ms")), mix_of=row_name, direction="bwd")
        return "\n".join(L) + "\n"
    L += ["", "CP rows (marked `CP` below) are the single-sequence few-head rows: the longest sequence holds at "
          "least 3/4 of the tokens and the effective parallelism `par` = h_v x T / max length is below half "
          "the SM count, so a kernel walking each (sequence, head) chunk chain on one SM leaves most SMs idle. "
          "They belong to the context-parallel work; the other rows measure the fused kernel itself.", "",
          "## Forward, per row", ""]
    L += _table("fwd", rows, "ms", "fwd") + [""]
    errs = []
    for i in impls_for("fwd"):
        e = [max(num(r.get(f"{i}_err_o")), num(r.get(f"{i}_err_ht"))) for r in rows if is_ok(r, i)]
        e = [x for x in e if not math.isnan(x)]
        if e:
            errs.append(f"{LABELS[i]} max {max(e):.1e}")
    if errs:
        L += ["Gate errors (relative RMS of o and final state against the fp64 result, worst over the passing "
              "rows): " + "; ".join(errs) + ".", ""]
    L += drift_section(rows)
    if breakdown_rows:
        L += breakdown_markdown(breakdown_rows, rows)
    return "\n".join(L) + "\n"


def _gate_table(rows: list[dict]) -> list[str]:
    pairs = S.SCHEMAS["bwd"].pair_names
    impls = impls_for("bwd")
    head = (["heads", "mix", "gate"] + [f"{LABELS[i]} worst" for i in impls]
            + [f"{LABELS[a]} ~ {LABELS[b]}" for a, b in pairs])
    L = ["| " + " | ".join(head) + " |", "|" + "|".join(" --- " for _ in head) + "|"]
    for r in rows:
        cells = [f"{r['h_qk']}/{r['h_v']}", row_name(r), str(r.get("gate", ""))]
        for i in impls:
            name, e = worst(parse_errs(r.get(f"{i}_errs", "")), GATE_TOL["bwd"])
            st = str(r.get(f"{i}_status", ""))
            cells.append(f"{name} {e:.1e}" + (" FAIL" if st == "FAIL" else "") if name else "-")
        for a, b in pairs:
            v = num(r.get(f"pair_{a}_{b}"))
            cells.append("-" if math.isnan(v) else f"{v:.1e}")
        L.append("| " + " | ".join(cells) + " |")
    return L


def cp_section(rows: list[dict], commit: str, page: str, env: dict | None = None) -> list[str]:
    """The context-parallel page's backward section (`CP_BWD_HEADING`): the one-sequence rows of
    `rows` (the backward page's), their geometric-mean speed-ups and the backward and training-step
    tables; `commit`: the rows' commit label; `page`: the backward page's file name, where the method,
    the gate and the drift are; `env`: the rows' environment key, named in the section (the page's
    header is the forward run's). [] without one-sequence rows."""
    one = sorted((r for r in rows if int(r["N"]) == 1), key=lambda r: grid_order(r, "bwd"))
    if not one:
        return []
    L = [CP_BWD_HEADING, "",
         f"The one-sequence rows of the backward grid, from `{page}` (its method, correctness gate and drift "
         f"section apply; our commit: {commit}). Ours splits the sequence where the backward's plan predicts a "
         "gain (cp='auto'); FlashQLA runs its own intra-card context parallelism (`auto_cp=True`)."
         + ("" if not env else " Environment: " + ", ".join(f"{f} {env.get(f, '')}" for f in env_fields("bwd")) + "."), ""]
    L += geomean_table("bwd", one)
    for field, kind, title in S.SCHEMAS["bwd"].timed:
        L += ["", f"### {title[0].upper() + title[1:]}", ""] + _table("bwd", one, field, kind)
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
        for i in impls_for("fwd"):
            if i == "fla":
                continue
            L.append(f"- {LABELS[i]} (whole forward): " + (f"{num(whole[f'{i}_ms']):.3f} ms" if is_ok(whole, i) else cell_ms(whole, i) if whole else "-"))
        L.append("")
    return L


# ---------------------------------------------------------------------------------------- method


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


def rate_clause(gpu: str | None) -> str:
    """The end of the Method's FLOP bullet: which bf16 GEMM rate the percentages use (`grid.peak_tflops`
    of `gpu`; the H200's when None), or that none is measured on this GPU."""
    peak = G.PEAK_TFLOPS if gpu is None else G.peak_tflops(gpu)
    where = "on our H200" if gpu is None else "on this GPU through torch (8192^3)"
    return ((f"; TFLOP/s on that count, % of the {peak:.0f} TFLOP/s bf16 GEMM rate measured {where}. " if peak else
             "; TFLOP/s on that count (no bf16 GEMM rate measured on this GPU yet: no percentage). ")
            + "Speed-up = peer ms / our ms.")


def with_current_peers_method(lines: list[str], gpu: str | None = None) -> list[str]:
    """Method lines (of an earlier page, for --report-only) with the peers-column bullet replaced by
    `PEERS_METHOD`, the one that says what the page's Drift section shows, and, given the page's `gpu`,
    the FLOP bullet's GEMM-rate clause brought up to date (`rate_clause`)."""
    out = []
    for line in lines:
        if line.startswith("Peers column:"):
            line = PEERS_METHOD
        elif gpu is not None and line.startswith("FLOP:") and "; TFLOP/s on that count" in line:
            line = line[:line.index("; TFLOP/s on that count")] + rate_clause(gpu)
        out.append(line)
    return out


def method_lines(opts, impls: dict, gpu: str | None = None) -> list[str]:
    """The Method bullets of a measuring run's pages: timer, inputs, gate, FLOP count, how each
    implementation was called (`impls.Impl.source`, or why not), the peers column. `opts`: the
    run's `config.Options`; `gpu`: the GPU's name (its measured GEMM rate, `grid.peak_tflops`)."""
    bwd = opts.direction == "bwd"
    t = DEFAULTS | opts.timer
    tol = opts.tolerances
    timer = (f"Timer (one function for every implementation, `flashqla.bench.timing.time_cuda_graph`): {t['warmup']} "
             f"eager warm-up calls; the calls of one graph sized for about {t['target_ms']:g} ms per replay "
             f"({t['min_launches']} to {t['max_launches']} calls, captured back to back); one untimed replay; "
             f"{t['replays']} timed replays; reported: the median per-call time. Host overhead stays outside the graph "
             "(as in FlashQLA's own benchmark); inputs are not rotated between calls.")
    if bwd:
        timer += (" Two timings per implementation: the backward alone (on the saved products of one forward, called "
                  "again and again) and the training step (forward + backward).")
    inputs = ("Inputs: `flashqla.testing.make_gdn_inputs` (L2-normalised q and k, v ~ N(0, 1), Qwen3-Next gate, "
              f"beta = sigmoid, value head 0 with g = 0, last value head with g = -30; seed {opts.seed}), "
              + ("bf16 q/k/v/do" if bwd else "bf16 q/k/v") + ", fp32 g/beta, K = V = 128, packed varlen (B = 1, "
              "`cu_seqlens` int32) for every row as FlashQLA benchmarks it, `initial_state` ~ N(0, 1) fp32 given"
              + (", `dht` ~ N(0, 1) fp32 given and do ~ N(0, 1); sequence lengths: FlashQLA's backward grid (random "
                 "cut points, seed 42), listed per row" if bwd else "")
              + "; the final state returned by every implementation.")
    fp64 = ("the fp64 result computed on the GPU from the same inputs (`reference.chunk_gated_delta_rule` in fp64, "
            "its chunked forward" + (" and its hand-written chunked backward" if bwd else "")
            + ", in batches of value heads; equal to the token recurrence"
            + (" and to autograd through it" if bwd else "") + " to fp64 rounding, "
            + ("tests/test_bench_bwd.py)" if bwd else "tests/test_bench.py)"))
    if bwd:
        limit = opts.ref_limit
        gate = ("Correctness gate before any timing: one forward and one backward per implementation; o, final state, "
                "dq, dk, dv, dg (raw gate), dbeta and dh0 against "
                + (fp64 + (f" on rows of at most {limit} chunk-padded token-heads, pairwise above" if limit else "")
                   if opts.ref == "fp64" else
                   "each other (pairwise: an implementation passes when it agrees with another one)")
                + "; relative RMS within " + ", ".join(f"{n} {v:g}" for n, v in tol.items())
                + "; an implementation above it is marked FAIL and not timed. Pairwise agreement is recorded for "
                  "every row.")
        flop = ("FLOP: 491,520 per token and value head for the backward, 655,360 for the training step (DESIGN.md "
                "section 6)")
    else:
        gate = (f"Correctness gate before any timing: o and final state against {fp64}; relative RMS <= {tol['o']:g} "
                f"(o) and {tol['ht']:g} (final state); an implementation above it is marked FAIL and not timed.")
        flop = "FLOP: 163,840 per token and value head (DESIGN.md section 6)"
    flop += rate_clause(gpu)
    calls = []
    for name in impls_for(opts.direction):
        impl = impls.get(name)
        if impl is None:
            what = ("not run in the call that wrote this page (--impls); its columns, where filled, come from earlier "
                    "calls or the peers cache (see the commit and peers columns)")
        elif impl.available:
            what = impl.source
        else:
            what = (f"{impl.reason or 'not available'} in the call that wrote this page; its columns, where filled, "
                    "come from the peers cache (see the header's versions and the peers column)")
        calls.append(f"{LABELS[name]}: {what}.")
    return [timer, inputs, gate, flop, *calls, PEERS_METHOD]


# ---------------------------------------------------------------------------------------- writing


def commit_label(rows: list[dict], commit: str, also=()) -> str:
    """The header's commit cell of a page showing `rows`: `commit`, or with `also` the commits that
    gave these rows, each with how many ("abc (4 rows); def (20 rows)"), counted over `rows` only."""
    if not also:
        return commit
    counts = {c: sum(r.get("commit") == c for r in rows) for c in [commit, *also]}
    return "; ".join(f"{c} ({n} rows)" for c, n in counts.items() if n)


def fill_cached_peers(rows: list[dict], cache: S.PeerCache, peers=peers_for("fwd")) -> list[dict]:
    """Rows whose peer columns are empty (a run with `--impls ours`), or say the peer was "not
    available" (asked for but not importable in that run), get the peers' cached results for the same
    row, and `peers_source` "cached"; rows with a peer result (or error) keep theirs. Returns new
    dicts (the CSV is not rewritten). `peers`: the benchmark's peers (`peers_for(direction)`)."""
    out = []
    for r in rows:
        r = dict(r)
        used = False
        for name in peers:
            absent = str(r.get(f"{name}_status", "")).startswith("not available")
            if not absent and any(str(r.get(f"{name}_{f}", "")).strip() for f in ("status",) + cache.impl_fields[:1]):
                continue
            c = cache.get(name, S.row_key(r))
            if c is None:
                continue
            for f in cache.impl_fields:
                r[f"{name}_{f}"] = c.get(f, "")
            used = True
        src = str(r.get("peers_source", "")).strip()
        if used and not src:
            r["peers_source"] = "cached"
        elif used and "cached" not in src:  # live peers beside cached ones (a peer not installed in that run)
            r["peers_source"] = "+".join(sorted({*src.split("+"), "cached"}))
        out.append(r)
    return out


def write_pages(direction: str, paths: dict, env: dict, commit: str, meta: dict, plot: bool, also=()) -> list[Path]:
    """Writes the pages of one benchmark (`paths`: `store.files`) from the CSV rows of (env, commit),
    and for rows not measured at `commit` those of the commits in `also` (first match wins; the header
    counts the rows each commit gave). Forward: `<gpu>-fwd.md`, and when some rows belong to the
    context-parallel grid `<gpu>-cp.md` from those alone (keeping its backward section), with their
    plots. Backward: `<gpu>-bwd.md` and its plot, and its one-sequence rows as the context-parallel
    page's last section (`cp_section`) when that page exists (in the pages folder, else the results
    folder's) and these rows include one-sequence rows (else the section stays as it is). Returns the
    files written."""
    schema = S.SCHEMAS[direction]
    rows = S.rows_for_commits(S.read_rows(paths["csv"]), env, [commit, *also])
    cache = S.PeerCache(paths["peers"], env, schema.impl_fields, any_version=True)
    rows = fill_cached_peers(rows, cache, schema.peers)
    # a peer not installed in the measuring run: its cached lines' versions in the header
    shown = {**env, **{i: ", ".join(sorted(v)) + " (cached results)" for i, v in cache.versions.items() if v}}
    paths["md"].parent.mkdir(parents=True, exist_ok=True)
    cp_base = paths["cp_md"] if paths["cp_md"].exists() else paths.get("src_cp_md", paths["cp_md"])
    written = []
    if direction == "bwd":
        paths["md"].write_text(markdown("bwd", rows, shown, commit_label(rows, commit, also), meta))
        written.append(paths["md"])
        one = [r for r in rows if int(r["N"]) == 1]
        if cp_base.exists() and one:  # a run without one-sequence rows leaves the section
            paths["cp_md"].write_text(splice_section(cp_base.read_text(), CP_BWD_HEADING,
                                                     cp_section(rows, commit_label(one, commit, also),
                                                                paths["md"].name, shown)))
            written.append(paths["cp_md"])
        if plot and rows and plots.plot_bwd(rows, paths["png"]):
            written.append(paths["png"])
        return written
    brows = [b for b in S.read_rows(paths["breakdown"]) if S.env_key(b) == S.env_key(env) and b.get("commit") == commit]
    paths["md"].write_text(markdown("fwd", rows, shown, commit_label(rows, commit, also), meta, brows))
    written.append(paths["md"])
    cp_rows = [r for r in rows if G.is_cp_grid_row(int(r["h_qk"]), int(r["h_v"]), r["mix"])]
    if cp_rows:
        kept = kept_section(cp_base)  # the backward's one-sequence section is the backward's to write
        page = markdown("fwd", cp_rows, shown, commit_label(cp_rows, commit, also), meta, [], title=CP_TITLE)
        paths["cp_md"].write_text(splice_section(page, CP_BWD_HEADING, kept))
        written.append(paths["cp_md"])
    if plot and rows and plots.plot_fwd(rows, paths["png"]):
        written.append(paths["png"])
    if plot and cp_rows and plots.plot_vs_T(cp_rows, paths["cp_png"]):
        written.append(paths["cp_png"])
    return written


def rebuild(direction: str, results_dir, out_dir=None, prefix: str | None = None, commit: str | None = None,
            also=(), plot: bool = True) -> int:
    """`--report-only`: the pages of one benchmark rebuilt from the CSVs in `results_dir`, written to
    `out_dir` (default `results_dir`): the rows of `commit` (default: the most recently measured one),
    rows it lacks from the commits in `also`, the Method lines of the page of the same name in
    `results_dir` (the measuring run's; its peers bullet brought up to date). Returns the exit
    status: 1 when the CSV has no such rows (nothing written), else 0."""
    prefix = S.find_prefix(direction, results_dir, prefix)
    paths = S.files(results_dir, prefix, out_dir)
    rows = S.read_rows(paths["csv"])
    key = S.latest_key(rows, commit)
    if key is None:
        print(f"no results in {paths['csv']}" + (f" for commit {commit}" if commit else ""), file=sys.stderr)
        return 1
    env, commit = key
    method = with_current_peers_method(method_from_markdown(paths["src_md"].read_text() if paths["src_md"].exists()
                                                            else ""), env.get("gpu") or None)
    dates = [r.get("date", "") for r in S.rows_for_key(rows, env, commit)]
    meta = {"date": max(dates, default=S.now_utc()),
            "method": method or ["Rebuilt from the CSV (--report-only); method of the measuring run unknown."]}
    written = write_pages(direction, paths, env, commit, meta, plot, also)
    print("wrote " + ", ".join(str(p) for p in written))
    return 0


# ---------------------------------------------------------------------------------------- sections


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

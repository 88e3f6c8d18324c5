"""`python -m flashqla.bench`: GDN forward, ours vs FLA 0.6.0 vs FlashQLA 0.1.3, on FlashQLA's grid.

    python -m flashqla.bench                       # the whole grid (resumable: rerun to continue)
    python -m flashqla.bench --quick               # four development rows
    python -m flashqla.bench --heads 16/32 --mixes 1x8192,8192x4
    python -m flashqla.bench --peers live          # time the peers on every row, refresh their cache
    python -m flashqla.bench --peers cached --retime 3
    python -m flashqla.bench --breakdown --quick   # FLA's five forward kernels one by one
    python -m flashqla.bench --time-budget 500     # start no new row after 500 s (fits a 10-min slot)
    python -m flashqla.bench --list                # the selected rows (no GPU needed)
    python -m flashqla.bench --report-only         # rebuild the markdown and plot from the CSVs
    python -m flashqla.bench --bwd [--quick] ...   # backward and training step (bwd_main.py)

Per row: inputs from `make_gdn_inputs` (bf16, packed varlen, h0 given, final state returned), the
fp64 chunked result on the GPU, then for each implementation a correctness gate (relative RMS of o
and final state) and, if it passes, a CUDA-graph timing (median of replays). Each finished row is
appended at once to `benchmarks/results/<gpu>-fwd.csv` (keyed by GPU, driver, CUDA, torch, triton,
tilelang, fla, flash_qla versions and our commit; a rerun skips rows already there), peer timings
to `benchmarks/results/peers-<gpu>-fwd.csv`, and `<gpu>-fwd.md` / `<gpu>-fwd.png` are rewritten.

Peers (`--peers`): `live` times them on every row and appends to the peers CSV; `cached` reads
them from it (rows without a cached line show '-') and re-times `--retime` rows to check it
(the live times go to the results CSV's `<peer>_retime_*` columns and the page's Drift section);
`auto` (default) uses the cache where it has the row and times live otherwise; `none` times ours
only. Needs a CUDA GPU (except `--list` and `--report-only`): without one it exits 2.
"""

from __future__ import annotations

import argparse
import math
import os
import subprocess
import sys
import time
from datetime import datetime, timezone
from pathlib import Path

from flashqla.bench import grid as G
from flashqla.bench import report as R
from flashqla.bench import store as S
from flashqla.bench.breakdown import step_bytes
from flashqla.bench.peers import ENV_FIELDS, FLA_ENV_VARS, IMPLS, LABELS, PEERS, collect_env, gpu_slug, plan_sources
from flashqla.bench.timing import DEFAULTS

REPO_ROOT = Path(__file__).resolve().parents[2]
BREAKDOWN_FIELDS = (ENV_FIELDS + ("commit",) + S.ROW_FIELDS
                    + ("step", "ms", "inputs_read", "inter_read", "inter_written", "out_written", "note", "date"))


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="python -m flashqla.bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a handful of development rows")
    p.add_argument("--cp-grid", action="store_true",
                   help="the context-parallel rows (one sequence of 2048 to 32768 tokens for 2/8, 4/16, 8/32, 16/64 "
                        "heads, and 131072 and 1048576 for 2/8 and 4/16); they go to the forward CSV like any row, and "
                        "<gpu>-cp.md with a plot of time against T is written from them")
    p.add_argument("--heads", action="append", help="head configs h_qk/h_v, comma-separated or repeated (e.g. 16/32)")
    p.add_argument("--mixes", action="append", help="sequence mixes, comma-separated or repeated (e.g. 1x8192,8192x4)")
    p.add_argument("--peers", choices=("auto", "live", "cached", "none"), default="auto", help="where peer timings come from")
    p.add_argument("--retime", type=int, default=3,
                   help="cached peer rows re-timed to show drift (default 3; kept in the CSV, listed under Drift)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help="implementations to run, comma-separated from ours,fla,flash_qla (default all)")
    p.add_argument("--cp", choices=("off", "auto", "on"), default=None,
                   help="our intra-device context-parallel mode (sets $FLASHQLA_CP for ours; default: $FLASHQLA_CP, "
                        "else auto); a mode other than off is recorded in the commit column as +cp-<mode>")
    p.add_argument("--breakdown", action="store_true", help="also time FLA's forward kernel by kernel")
    p.add_argument("--force", action="store_true", help="re-measure rows already in the results CSV")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="start no new row after S seconds (--bwd: nor a live peer within a row)")
    p.add_argument("--tol", type=float, default=None,
                   help="gate tolerance (relative RMS) for o and final state (default 2e-2); with --bwd for every "
                        "quantity (default 2e-2, dg 3e-2)")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="eager warm-up calls before capture")
    p.add_argument("--replays", type=int, default=DEFAULTS["replays"], help="timed graph replays (median taken)")
    p.add_argument("--target-ms", type=float, default=DEFAULTS["target_ms"], help="device time of one replay")
    p.add_argument("--max-launches", type=int, default=DEFAULTS["max_launches"], help="most calls in one graph")
    p.add_argument("--seed", type=int, default=0, help="input seed")
    p.add_argument("--results-dir", type=Path, default=REPO_ROOT / "benchmarks" / "results")
    p.add_argument("--prefix", default=None, help="file prefix (default <gpu>-fwd, e.g. h200-fwd)")
    p.add_argument("--commit", default=None, help="our commit id (default: git, or $FLASHQLA_COMMIT); with --report-only, "
                   "the commit whose rows make the page, as written in the CSV (default: the latest measured)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNG")
    p.add_argument("--list", action="store_true", help="print the selected rows and exit")
    p.add_argument("--report-only", action="store_true", help="rebuild markdown and plot from the CSVs and exit")
    p.add_argument("--also-commits", metavar="C1,C2",
                   help="with --report-only (forward or --bwd): rows not measured at the latest commit are taken from these commits "
                        "(CSV commit ids such as abc1234+cp-auto, first match wins) and shown as they were measured "
                        "there, older code included, not re-measured; the header counts the rows each commit gave, "
                        "the CSV's commit column names each row's")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing implementations")
    b = p.add_argument_group("backward (--bwd)")
    b.add_argument("--bwd", action="store_true",
                   help="the backward and training-step benchmark (FlashQLA's backward grid; `--mixes` also takes "
                        "names such as 8k_4seq); see flashqla/bench/bwd_main.py")
    b.add_argument("--ref", choices=("fp64", "pairwise"), default="fp64",
                   help="gate against the fp64 gradients (default) or only between implementations")
    b.add_argument("--ref-limit", type=int, default=0, metavar="N",
                   help="rows above N padded token-heads use the pairwise gate (default 0: none)")
    b.add_argument("--ref-batch", type=int, default=None, metavar="N",
                   help="padded token-heads per batch of value heads of the fp64 gradients (default 2^20, ~30 GB)")
    b.add_argument("--no-step", action="store_true", help="time the backward only, not the training step")
    return p.parse_args(argv)


def apply_cp_mode(mode: str | None) -> str:
    """Our context-parallel mode for this call: `mode`, else $FLASHQLA_CP, else "auto" (the
    planner splits the rows that need it, as a user would run it); exported as $FLASHQLA_CP so that
    ours (`flashqla.chunk_gated_delta_rule`, cp=None) runs in it."""
    mode = mode or os.environ.get("FLASHQLA_CP") or "auto"
    os.environ["FLASHQLA_CP"] = mode
    return mode


def commit_with_cp(commit: str, mode: str) -> str:
    """The commit column: our commit, with "+cp-<mode>" unless the mode is off or the commit already
    ends with it (a --commit given with the suffix) (rows timed in different modes never mix under
    one key)."""
    if mode == "off" or commit.endswith(f"+cp-{mode}"):
        return commit
    return f"{commit}+cp-{mode}"


def our_commit(explicit: str | None = None) -> str:
    """Our commit: --commit, else $FLASHQLA_COMMIT, else `git rev-parse` (+ '+dirty' when files of
    the package outside the harness differ from it), else 'unknown'."""
    if explicit:
        return explicit
    if os.environ.get("FLASHQLA_COMMIT"):
        return os.environ["FLASHQLA_COMMIT"]
    try:
        rev = subprocess.run(["git", "-C", str(REPO_ROOT), "rev-parse", "--short=12", "HEAD"],
                             capture_output=True, text=True, timeout=20)
        if rev.returncode != 0:
            return "unknown"
        dirty = subprocess.run(["git", "-C", str(REPO_ROOT), "status", "--porcelain", "--", "flashqla",
                                ":(exclude)flashqla/bench"], capture_output=True, text=True, timeout=20)
        return rev.stdout.strip() + ("+dirty" if dirty.stdout.strip() else "")
    except (OSError, subprocess.SubprocessError):
        return "unknown"


def selected_impls(args) -> tuple[str, ...]:
    """Implementations to load: --impls, less the peers when --peers none. Raises SystemExit on
    an unknown name."""
    names = tuple(n.strip() for n in str(args.impls).split(",") if n.strip())
    bad = [n for n in names if n not in IMPLS]
    if bad:
        raise SystemExit(f"error: unknown implementation(s) {bad}; choose from {','.join(IMPLS)}")
    return tuple(n for n in IMPLS if n in names and (n == "ours" or args.peers != "none"))


def drift_text(cached_ms: float, cached_status: str, live: dict) -> str:
    """'cached 0.472 ms, now 0.480 ms (+1.7%)', or the statuses when either side has no time."""
    c = f"{cached_ms:.3f} ms" if cached_ms > 0 else str(cached_status or "-")
    n = f"{live['ms']:.3f} ms" if live.get("status") == "ok" else str(live.get("status", "-"))
    tail = f" ({100 * (live['ms'] / cached_ms - 1):+.1f}%)" if live.get("status") == "ok" and cached_ms > 0 else ""
    return f"cached {c}, now {n}{tail}"


def now_utc() -> str:
    return datetime.now(timezone.utc).strftime("%Y-%m-%dT%H:%M:%SZ")


def list_rows(rows) -> None:
    print(f"{len(rows)} rows")
    print(f"{'heads':>6} {'mix':<12} {'T':>6} {'N':>2} {'par':>5} {'CP':>3} {'GFLOP':>7} {'min MB':>7}")
    for r in rows:
        m, h = r.mix, r.heads
        print(f"{h.label:>6} {m.label:<12} {m.T:>6} {m.N:>2} {G.effective_parallelism(m.lengths, h.h_v):>5.0f} "
              f"{'CP' if G.is_cp_row(m.lengths, h.h_v) else '':>3} {G.fwd_flop(m.T, h.h_v) / 1e9:>7.1f} "
              f"{G.fwd_min_bytes(m.T, m.N, h.h_qk, h.h_v) / 1e6:>7.1f}")


def method_lines(args, impls: dict, fla_target: str, tol: dict) -> list[str]:
    t = DEFAULTS | dict(warmup=args.warmup, replays=args.replays, target_ms=args.target_ms, max_launches=args.max_launches)
    out = [
        f"Timer (one function for every implementation, `flashqla.bench.timing.time_cuda_graph`): {t['warmup']} eager "
        f"warm-up calls; the calls of one graph sized for about {t['target_ms']:g} ms per replay "
        f"({t['min_launches']} to {t['max_launches']} calls, captured back to back); one untimed replay; "
        f"{t['replays']} timed replays; reported: the median per-call time. Host overhead stays outside the graph "
        "(as in FlashQLA's own benchmark); inputs are not rotated between calls.",
        "Inputs: `flashqla.testing.make_gdn_inputs` (L2-normalised q and k, v ~ N(0, 1), Qwen3-Next gate, "
        f"beta = sigmoid, value head 0 with g = 0, last value head with g = -30; seed {args.seed}), bf16 q/k/v, fp32 "
        "g/beta, K = V = 128, packed varlen (B = 1, `cu_seqlens` int32) for every row as FlashQLA benchmarks it, "
        "`initial_state` ~ N(0, 1) fp32 given and the final state returned by every implementation.",
        "Correctness gate before any timing: o and final state against the fp64 chunked result computed on the GPU "
        "from the same inputs (`flashqla.bench.trusted.chunk_gdn_fp64`, checked against the fp64 token recurrence "
        f"in tests/test_bench.py); relative RMS <= {tol['o']:g} (o) and {tol['ht']:g} (final state); an "
        "implementation above it is marked FAIL and not timed.",
        "FLOP: 163,840 per token and value head (DESIGN.md section 6); TFLOP/s on that count, % of the 726 TFLOP/s "
        "bf16 GEMM rate measured on our H200. Speed-up = peer ms / our ms.",
        "FLA: public `fla.ops.gated_delta_rule.chunk_gated_delta_rule` under `torch.no_grad()`; env "
        + ", ".join(f"{v}={os.environ.get(v, '(unset)')}" for v in FLA_ENV_VARS)
        + f"; gated_delta_rule dispatch target: {fla_target}.",
        "FlashQLA: public `flash_qla.chunk_gated_delta_rule` with its defaults (`auto_cp=True`, its intra-card "
        "context parallelism).",
        "ours: " + ("not run in this call (--impls); its rows come from earlier calls (see the commit column)" if "ours" not in impls else
                    f"`flashqla.ops.gdn.api.chunk_gated_delta_rule` with cp={os.environ.get('FLASHQLA_CP', 'auto')!r} "
                    "(intra-device context parallelism, `flashqla.cp`)" if impls["ours"].available
                    else (impls["ours"].reason or "not available")) + ".",
        R.PEERS_METHOD,
    ]
    return out


def find_prefix(args, env: dict | None) -> str:
    if args.prefix:
        return args.prefix
    if env is not None:
        return f"{gpu_slug(env['gpu'])}-fwd"
    cands = sorted(p.stem for p in args.results_dir.glob("*-fwd.csv") if not p.stem.startswith("peers-"))
    if len(cands) == 1:
        return cands[0]
    if not cands:
        raise SystemExit(f"--report-only: no forward results in {args.results_dir} yet (no *-fwd.csv); "
                         "run `python -m flashqla.bench` on a Hopper GPU first")
    raise SystemExit(f"--report-only: several results files, give --prefix (found: {cands})")


def fill_cached_peers(rows: list[dict], cache) -> list[dict]:
    """Rows whose peer columns are empty (a run with `--impls ours`) get the peers' cached results
    for the same environment key and row, and `peers_source` "cached"; rows with a peer result keep
    theirs. Returns new dicts (the CSV is not rewritten)."""
    out = []
    for r in rows:
        r = dict(r)
        used = False
        for name in PEERS:
            if str(r.get(f"{name}_status", "")).strip() or str(r.get(f"{name}_ms", "")).strip():
                continue
            c = cache.get(name, S.row_key(r))
            if c is None:
                continue
            for f in S.IMPL_FIELDS:
                r[f"{name}_{f}"] = c.get(f, "")
            used = True
        if used and not str(r.get("peers_source", "")).strip():
            r["peers_source"] = "cached"
        out.append(r)
    return out


def commit_label(rows: list[dict], commit: str, also=()) -> str:
    """The header's commit cell of a page showing `rows`: `commit`, or with `also` the commits that
    gave these rows, each with how many ("abc (4 rows); def (20 rows)"), counted over `rows` only."""
    if not also:
        return commit
    counts = {c: sum(r.get("commit") == c for r in rows) for c in [commit, *also]}
    return "; ".join(f"{c} ({n} rows)" for c, n in counts.items() if n)


def write_outputs(paths: dict, env: dict, commit: str, meta: dict, plot: bool, also=()) -> None:
    """The forward report (markdown, plot) from the CSV rows of (env, commit), and for rows not
    measured at `commit` those of the commits in `also` (first match wins; the header lists how many
    rows each commit gave); and, when some of them are rows of the context-parallel benchmark
    (`--cp-grid`), its own page `<gpu>-cp.md` with a plot of time against T (its header counts its
    own rows). Each page's Drift section comes from its rows' re-timed columns."""
    rows = fill_cached_peers(S.rows_for_commits(S.read_rows(paths["csv"]), env, [commit, *also]), S.PeerCache(paths["peers"], env))
    brows = [b for b in S.read_rows(paths["breakdown"]) if S.env_key(b) == S.env_key(env) and b.get("commit") == commit]
    paths["md"].write_text(R.markdown(rows, env, commit_label(rows, commit, also), meta, brows))
    if plot and rows:
        R.plot(rows, paths["png"])
    cp_rows = [r for r in rows if G.is_cp_grid_row(int(r["h_qk"]), int(r["h_v"]), r["mix"])]
    if cp_rows:
        # the backward's one-sequence section is the backward benchmark's to write: kept as it is
        kept = R.kept_section(paths["cp_md"])
        page = R.markdown(cp_rows, env, commit_label(cp_rows, commit, also), meta, [],
                          title="GDN chunked prefill, one long sequence (context parallelism): ours vs FLA vs "
                                "FlashQLA")
        paths["cp_md"].write_text(R.splice_section(page, R.CP_BWD_HEADING, kept))
        if plot:
            R.plot_vs_T(cp_rows, paths["cp_png"])


def main(argv=None) -> int:
    args = parse_args(argv)
    if args.bwd:
        from flashqla.bench.bwd_main import main_bwd

        return main_bwd(args)
    try:
        rows = G.cp_grid_rows(args.heads, args.mixes) if args.cp_grid else G.select_rows(args.heads, args.mixes, args.quick)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        list_rows(rows)
        return 0
    if args.report_only:
        prefix = find_prefix(args, None)
        paths = _paths(args.results_dir, prefix)
        key = S.latest_key(S.read_rows(paths["csv"]), args.commit)
        if key is None:
            print(f"no results in {paths['csv']}" + (f" for commit {args.commit}" if args.commit else ""), file=sys.stderr)
            return 1
        env, commit = key
        pages = {k: paths[k].read_text() if paths[k].exists() else "" for k in ("md", "cp_md")}
        method = R.with_current_peers_method(R.method_from_markdown(pages["md"]))
        dates = [r.get("date", "") for r in S.rows_for_key(S.read_rows(paths["csv"]), env, commit)]
        meta = {"date": max(dates, default=now_utc()), "method": method or ["Rebuilt from the CSV (--report-only); method of the measuring run unknown."]}
        started = time.time()
        also = [c.strip() for c in (args.also_commits or "").split(",") if c.strip()]
        write_outputs(paths, env, commit, meta, not args.no_plot, also)
        written = [paths[k] for k in ("md", "cp_md", "png", "cp_png") if paths[k].exists() and paths[k].stat().st_mtime >= started - 1]
        print("wrote " + ", ".join(str(p) for p in written))
        return 0

    import torch

    if not torch.cuda.is_available():
        print("python -m flashqla.bench needs a CUDA GPU (torch.cuda.is_available() is False on this machine); "
              "use --list to see the rows or --report-only to rebuild the report from the CSVs.", file=sys.stderr)
        return 2
    if not rows:
        print("no rows selected", file=sys.stderr)
        return 2

    from flashqla.bench.peers import fla_dispatch_target, load_impls

    impls = load_impls(selected_impls(args))
    env = collect_env()
    fla_target = fla_dispatch_target() if "fla" in impls and impls["fla"].available else "n/a"
    if fla_target not in ("triton", "n/a", "unknown"):
        impls["fla"].fn, impls["fla"].reason = None, f"not available (FLA would dispatch to {fla_target})"
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    return run_rows(rows, args, impls, env, commit_with_cp(our_commit(args.commit), apply_cp_mode(args.cp)),
                    device="cuda", sm_count=sm_count, fla_target=fla_target)


def run_rows(rows, args, impls: dict, env: dict, commit: str, device="cuda", sm_count: int = G.H200_SMS,
             fla_target: str = "n/a", time_fn=None) -> int:
    """The measuring loop: resume, plan each implementation's source, gate, time, append, report.

    `impls`: name -> `peers.Impl` (missing names are not run); `env`: the environment key;
    `time_fn`: the timer (default the CUDA-graph one). Returns the exit status (0).
    """
    import torch
    from tqdm import tqdm

    from flashqla.bench.runner import GATE_TOL, InputFactory, measure, reference_for

    t_start = time.perf_counter()
    tol = dict(GATE_TOL) if args.tol is None else {"o": args.tol, "ht": args.tol}
    timer = dict(warmup=args.warmup, replays=args.replays, target_ms=args.target_ms, max_launches=args.max_launches)
    prefix = find_prefix(args, env)
    paths = _paths(args.results_dir, prefix)
    print("env: " + ", ".join(f"{f}={env[f]}" for f in ENV_FIELDS) + f", commit={commit}")
    for name, impl in impls.items():
        print(f"{LABELS[name]}: " + ("loaded" if impl.available else str(impl.reason)))

    need = ("ours",) if "ours" in impls else ()
    done = set() if args.force else S.done_keys(S.read_rows(paths["csv"]), env, commit, need)
    todo = [r for r in rows if r.key not in done]
    if len(todo) < len(rows):
        print(f"resuming: {len(rows) - len(todo)} of {len(rows)} rows already in {paths['csv'].name} for this key")
    cache = S.PeerCache(paths["peers"], env)
    use_cache = args.peers in ("cached", "auto")
    live_peers = [p for p in PEERS if impls.get(p) is not None and impls[p].available]
    retime = set()
    if use_cache and args.retime > 0 and live_peers:
        retime = set(S.pick_retime([r.key for r in todo if cache.has_row(r.key, live_peers)], args.retime))
    meta = {"date": now_utc(), "method": method_lines(args, impls, fla_target, tol)}
    factory = InputFactory(device, max(r.mix.T for r in todo) if todo else 0, seed=args.seed)

    bar = tqdm(todo, desc="rows", unit="row", dynamic_ncols=True)
    stopped = False
    for i, row in enumerate(bar):
        if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
            stopped = True
            tqdm.write(f"time budget of {args.time_budget:g} s spent: {len(todo) - i} rows left for the next run")
            break
        bar.set_postfix_str(row.label)
        x = factory.get(row)
        row_fields = {"h_qk": row.heads.h_qk, "h_v": row.heads.h_v, "mix": row.mix.label, "T": row.mix.T, "N": row.mix.N}
        plan = plan_sources(impls, row.key, args.peers, cache if use_cache else None)
        retimed = row.key in retime
        need_ref = any(v == "live" for v in plan.values()) or retimed or args.breakdown
        ref = reference_for(x) if need_ref else None
        res, retimes = {}, {}
        for name in IMPLS:
            how = plan[name]
            if how == "live":
                res[name] = measure(impls[name].fn, x, ref, tol, timer, args.verbose, time_fn)
                if name in PEERS:
                    cache.put(name, row_fields, res[name], now_utc())
            elif how == "cached":
                c = cache.get(name, row.key)
                res[name] = {f: c.get(f, "") for f in S.IMPL_FIELDS}
                if retimed and name in impls:
                    live = measure(impls[name].fn, x, ref, tol, timer, args.verbose, time_fn)
                    cached_ms = R.num(c.get("ms"))
                    retimes.update({f"{name}_retime_{f}": live.get(f, "") for f in S.RETIME_FIELDS})
                    tqdm.write(f"drift {LABELS[name]} {row.label}: " + drift_text(cached_ms, c.get("status", ""), live))
            elif how == "n/a":
                res[name] = {"status": impls[name].reason or "not available"}
            elif how == "not cached":
                res[name] = {"status": "not cached"}
            else:
                res[name] = {"status": ""}
        sources = sorted({plan[p] for p in PEERS if plan[p] in ("live", "cached")})
        line = {**{f: env[f] for f in ENV_FIELDS}, "commit": commit, **row_fields,
                "cp_row": int(G.is_cp_row(row.mix.lengths, row.heads.h_v, sm_count)),
                "parallelism": G.effective_parallelism(row.mix.lengths, row.heads.h_v),
                "peers_source": "+".join(sources) + (" (re-timed)" if retimes else ""),
                "date": now_utc(), **retimes}
        for name in IMPLS:
            for f in S.IMPL_FIELDS:
                line[f"{name}_{f}"] = res[name].get(f, "")
        S.append_row(paths["csv"], line, S.RESULT_FIELDS)
        tqdm.write(R.console_line(line))
        if args.breakdown:
            _breakdown(x, ref, row, row_fields, env, commit, paths, timer)
        del x, ref
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        write_outputs(paths, env, commit, meta, plot=not args.no_plot and (i % 10 == 9))
    bar.close()
    factory.release()
    write_outputs(paths, env, commit, meta, plot=not args.no_plot)
    all_rows = S.rows_for_key(S.read_rows(paths["csv"]), env, commit)
    print("\n".join(R.geomean_table(all_rows)))
    print(f"wrote {paths['csv']}, {paths['md']}" + ("" if args.no_plot else f", {paths['png']}")
          + f"; peers cache {paths['peers']} ({len(cache)} lines for this key)"
          + (" -- stopped early, rerun to continue" if stopped else ""))
    print(f"elapsed {time.perf_counter() - t_start:.0f} s")
    return 0


def _paths(results_dir: Path, prefix: str) -> dict:
    d = Path(results_dir)
    cp = prefix[: -len("-fwd")] + "-cp" if prefix.endswith("-fwd") else f"{prefix}-cp"
    return {"csv": d / f"{prefix}.csv", "md": d / f"{prefix}.md", "png": d / f"{prefix}.png",
            "peers": d / f"peers-{prefix}.csv", "breakdown": d / f"{prefix}-breakdown.csv",
            "cp_md": d / f"{cp}.md", "cp_png": d / f"{cp}.png"}


def _breakdown(x, ref, row, row_fields, env, commit, paths, timer) -> None:
    from tqdm import tqdm

    from flashqla.bench.breakdown import run_fla_breakdown

    try:
        bd = run_fla_breakdown(x, timer, ref)
    except Exception as exc:
        tqdm.write(f"breakdown {row.label}: {type(exc).__name__}: {exc}")
        return
    sb = {b.step: b for b in step_bytes(row.mix.T, row.mix.N, bd["NT"], row.heads.h_qk, row.heads.h_v)}
    date = now_utc()
    base = {**{f: env[f] for f in ENV_FIELDS}, "commit": commit, **row_fields, "date": date}
    parts = []
    for name, ms in bd["steps"]:
        b = sb[name]
        note = ("from intra - w_u" if name == "kkt_solve" and bd["kkt_source"] != "kernel" else "")
        S.append_row(paths["breakdown"], {**base, "step": name, "ms": ms, "inputs_read": b.inputs_read,
                                          "inter_read": b.inter_read, "inter_written": b.inter_written,
                                          "out_written": b.out_written, "note": note}, BREAKDOWN_FIELDS)
        parts.append(f"{name} {ms:.3f}")
    S.append_row(paths["breakdown"], {**base, "step": "intra", "ms": bd["intra_ms"], "note": "fwd_intra"}, BREAKDOWN_FIELDS)
    total = sum(ms for _, ms in bd["steps"] if not math.isnan(ms))
    tqdm.write(f"breakdown {row.label}: " + ", ".join(parts) + f" | sum {total:.3f} ms | chained o err {bd['err_o']:.1e}")


if __name__ == "__main__":
    sys.exit(main())

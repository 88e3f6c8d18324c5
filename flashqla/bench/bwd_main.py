"""`python -m flashqla.bench --bwd`: GDN backward and training step, ours vs FLA 0.6.0 vs FlashQLA 0.1.3.

    python -m flashqla.bench --bwd                      # the whole grid (32 rows; resumable: rerun to continue)
    python -m flashqla.bench --bwd --quick              # three development rows, two head configurations
    python -m flashqla.bench --bwd --heads 16/32 --mixes 8k_8seq,32k_1seq
    python -m flashqla.bench --bwd --peers live --impls fla,flash_qla --heads 2/4   # fill the peers' cache
    python -m flashqla.bench --bwd --peers cached       # time ours against the cached peers
    python -m flashqla.bench --bwd --time-budget 300    # after 300 s start no row, nor a live peer in a row
    python -m flashqla.bench --bwd --list               # the selected rows with their lengths (no GPU)
    python -m flashqla.bench --bwd --report-only        # rebuild the markdown and plot from the CSVs

Grid: `bwd_grid` (FlashQLA's backward table: 4 head configurations x 8192 and 32768 tokens in 1, 2,
4 and 8 random sequences). Per row: inputs (`bwd_runner.BwdInputFactory`), the fp64 result
(`trusted.chunk_gdn_fp64_grads`), then per implementation one forward + backward for the gate
(o, final state and dq dk dv dg dbeta dh0 against fp64; pairwise agreement recorded) and, if it
passes, two CUDA-graph timings: the backward alone and the training step (`bwd_impls` says how
each implementation is called). Files (`<gpu>` e.g. `h200`): `<gpu>-bwd.csv` (one line per row,
keyed by the environment and our commit; a rerun skips the rows already there), `<gpu>-bwd.md`,
`<gpu>-bwd.png`, and the peers' cache `peers-<gpu>-bwd.csv` (keyed by GPU, driver, CUDA, torch,
triton, tilelang, fla and flash_qla versions; one line per peer as soon as it is measured).
`--peers` as in the forward benchmark: `auto` (default: cached where the row is cached, live
otherwise), `live`, `cached`, `none`.

Resuming: a row counts as done for this key when every selected implementation has a result on it
(ok, FAIL, an error, or not available); a row where a peer was deferred by `--time-budget` (FlashQLA
compiles its backward for minutes per head configuration), not cached, or not selected is
measured again by the next run, peers coming from their cache when they are there. So one command
rerun until it reports no row left fills the table within 10-minute slots. With `--ref pairwise`
only implementations run in this process take part in the gate (a cached peer does not).
"""

from __future__ import annotations

import os
import sys
import time
from pathlib import Path

from flashqla.bench import bwd_grid as BG
from flashqla.bench import bwd_report as BR
from flashqla.bench import store as S
from flashqla.bench.grid import effective_parallelism
from flashqla.bench.peers import ENV_FIELDS, FLA_ENV_VARS, IMPLS, LABELS, PEERS, collect_env, gpu_slug, plan_sources
from flashqla.bench.report import PEERS_METHOD
from flashqla.bench.timing import DEFAULTS

__all__ = ["main_bwd", "run_bwd_rows", "select_rows", "list_rows", "paths_for", "method_lines", "done_keys",
           "DEFERRED"]

#: Default padded token-heads per batch of value heads in the fp64 gradient computation.
REF_BATCH = 1 << 20


#: Status of a peer left for the next run by --time-budget.
DEFERRED = "deferred"
#: Statuses that leave a row to be measured again by the next run with the same key.
NOT_DONE = ("", "not cached", DEFERRED)


def done_keys(rows: list[dict], env: dict, commit: str, need) -> set:
    """Row keys measured under this environment key and commit for every implementation in `need`
    (a row where one of them has no status, was not cached or was deferred is measured again)."""
    return {S.row_key(r) for r in S.rows_for_key(rows, env, commit)
            if all(str(r.get(f"{i}_status", "")).strip() not in NOT_DONE for i in need)}


def select_rows(args):
    return BG.select_bwd_rows(args.heads, args.mixes, args.quick)


def list_rows(rows) -> None:
    print(f"{len(rows)} rows")
    print(f"{'heads':>6} {'mix':<9} {'T':>6} {'N':>2} {'par':>5} {'bwd GFLOP':>9} {'padded':>7}  lengths")
    for r in rows:
        m, h = r.mix, r.heads
        print(f"{h.label:>6} {BG.short_name(m.lengths):<9} {m.T:>6} {m.N:>2} "
              f"{effective_parallelism(m.lengths, h.h_v):>5.0f} {BG.bwd_flop(m.T, h.h_v) / 1e9:>9.1f} "
              f"{BG.padded_tokens(m.lengths):>7}  {'+'.join(str(x) for x in m.lengths)}")


def paths_for(results_dir: Path, prefix: str) -> dict:
    d = Path(results_dir)
    cp = prefix[: -len("-bwd")] + "-cp" if prefix.endswith("-bwd") else f"{prefix}-cp"
    return {"csv": d / f"{prefix}.csv", "md": d / f"{prefix}.md", "png": d / f"{prefix}.png",
            "peers": d / f"peers-{prefix}.csv", "cp_md": d / f"{cp}.md"}


def find_prefix(args, env: dict | None) -> str:
    if args.prefix:
        return args.prefix
    if env is not None:
        return f"{gpu_slug(env['gpu'])}-bwd"
    cands = sorted(p.stem for p in Path(args.results_dir).glob("*-bwd.csv") if not p.stem.startswith("peers-"))
    if len(cands) == 1:
        return cands[0]
    if not cands:
        raise SystemExit(f"--report-only --bwd: no backward results in {args.results_dir} yet (no *-bwd.csv); "
                         "run `python -m flashqla.bench --bwd` on a Hopper GPU first")
    raise SystemExit(f"--report-only --bwd: several results files, give --prefix (found: {cands})")


def tolerances(args) -> dict:
    from flashqla.bench.bwd_runner import GATE_TOL_BWD

    return dict(GATE_TOL_BWD) if args.tol is None else {n: float(args.tol) for n in GATE_TOL_BWD}


def method_lines(args, impls: dict, tol: dict, fla_dispatch: str = "n/a") -> list[str]:
    t = DEFAULTS | dict(warmup=args.warmup, replays=args.replays, target_ms=args.target_ms,
                        max_launches=args.max_launches)
    ref = ("fp64" if args.ref == "fp64" else "pairwise")
    limit = getattr(args, "ref_limit", 0) or 0
    src = {n: (impls[n].source if n in impls and impls[n].available else
               (impls[n].reason if n in impls else
                "not run in the call that wrote this report (--impls); its columns, where filled, come from "
                "earlier calls or the peers cache (see the peers column)")) for n in IMPLS}
    return [
        f"Timer (`flashqla.bench.timing.time_cuda_graph`, the forward benchmark's): {t['warmup']} eager warm-up calls; "
        f"the calls of one graph sized for about {t['target_ms']:g} ms per replay ({t['min_launches']} to "
        f"{t['max_launches']} calls); one untimed replay; {t['replays']} timed replays; reported: the median per-call "
        "time. Two timings per implementation: the backward alone (on the saved products of one forward, called "
        "again and again) and the training step (forward + backward). Host overhead stays outside the graph.",
        "Inputs: `flashqla.testing.make_gdn_inputs` (L2-normalised q and k, v ~ N(0, 1), Qwen3-Next gate, "
        f"beta = sigmoid, value head 0 with g = 0, last value head with g = -30; seed {args.seed}), bf16 q/k/v/do, "
        "fp32 g/beta, K = V = 128, packed varlen (B = 1, `cu_seqlens` int32), `initial_state` ~ N(0, 1) and "
        "`dht` ~ N(0, 1) fp32 given, final state returned, do ~ N(0, 1). Sequence lengths: FlashQLA's backward "
        "grid (random cut points, seed 42), listed per row.",
        "Correctness gate before any timing: one forward and one backward per implementation; o, final state, dq, "
        "dk, dv, dg (raw gate), dbeta and dh0 against "
        + ("the fp64 result from the same inputs (`flashqla.bench.trusted.chunk_gdn_fp64_grads`: autograd of the "
           "fp64 chunked forward on the GPU, checked against autograd of the fp64 token recurrence in "
           "tests/test_bench_bwd.py)" + (f" on rows of at most {limit} padded token-heads, pairwise above" if limit
                                         else "")
           if ref == "fp64" else "each other (pairwise: an implementation passes when it agrees with another one)")
        + "; relative RMS within " + ", ".join(f"{n} {v:g}" for n, v in tol.items())
        + "; an implementation above it is marked FAIL and not timed. Pairwise agreement is recorded for every row.",
        "FLOP: 491,520 per token and value head for the backward, 655,360 for the training step (DESIGN.md "
        "section 6); TFLOP/s on that count, % of the 726 TFLOP/s bf16 GEMM rate measured on our H200. "
        "Speed-up = peer ms / our ms.",
        f"ours: {src['ours']}, intra-device context-parallel mode cp={os.environ.get('FLASHQLA_CP', 'auto')!r} (`flashqla.cp`).",
        f"FLA: {src['fla']}; env " + ", ".join(f"{v}={os.environ.get(v, '(unset)')}" for v in FLA_ENV_VARS)
        + f"; `common` backends in order: {fla_dispatch}.",
        f"FlashQLA: {src['flash_qla']}.",
        PEERS_METHOD,
    ]


def write_outputs(paths: dict, env: dict, commit: str, meta: dict, plot: bool, also=()) -> None:
    """The backward page (markdown, plot) from the CSV rows of (env, commit), and for rows not measured
    at `commit` those of the commits in `also` (first match wins; the header counts the rows each
    commit gave, as the forward page's `--also-commits`); and the one-sequence rows as the last section
    of the context-parallel page `<gpu>-cp.md` (`bwd_report.cp_section`, with its own environment line)
    when that page exists and these rows include one-sequence rows (else the section stays as it is)."""
    from flashqla.bench.__main__ import commit_label
    from flashqla.bench.report import CP_BWD_HEADING, splice_section

    rows = S.rows_for_commits(S.read_rows(paths["csv"]), env, [commit, *also])
    label = commit_label(rows, commit, also)
    paths["md"].write_text(BR.markdown(rows, env, label, meta))
    cp_md = paths.get("cp_md")
    one = [r for r in rows if int(r["N"]) == 1]
    if cp_md is not None and cp_md.exists() and one:  # a run without one-sequence rows leaves the section
        cp_md.write_text(splice_section(cp_md.read_text(), CP_BWD_HEADING,
                                        BR.cp_section(rows, commit_label(one, commit, also), paths["md"].name, env)))
    if plot and rows:
        BR.plot(rows, paths["png"])


def report_only(args) -> int:
    from flashqla.bench.report import method_from_markdown, with_current_peers_method
    from flashqla.bench.__main__ import now_utc

    prefix = find_prefix(args, None)
    paths = paths_for(args.results_dir, prefix)
    rows = S.read_rows(paths["csv"])
    key = S.latest_key(rows, args.commit)
    if key is None:
        print(f"no results in {paths['csv']}" + (f" for commit {args.commit}" if args.commit else ""), file=sys.stderr)
        return 1
    env, commit = key
    old_md = paths["md"].read_text() if paths["md"].exists() else ""
    method = with_current_peers_method(method_from_markdown(old_md))
    dates = [r.get("date", "") for r in S.rows_for_key(rows, env, commit)]
    meta = {"date": max(dates, default=now_utc()),
            "method": method or ["Rebuilt from the CSV (--report-only); method of the measuring run unknown."]}
    also = [c.strip() for c in (getattr(args, "also_commits", None) or "").split(",") if c.strip()]
    write_outputs(paths, env, commit, meta, not args.no_plot, also)
    print(f"wrote {paths['md']}" + ("" if args.no_plot else f", {paths['png']}"))
    return 0


def main_bwd(args) -> int:
    """The backward benchmark's entry point (`args` from `flashqla.bench.__main__.parse_args`)."""
    from flashqla.bench.__main__ import apply_cp_mode, commit_with_cp, our_commit, selected_impls

    if args.breakdown:
        print("error: --breakdown is for the forward benchmark", file=sys.stderr)
        return 2
    try:
        rows = select_rows(args)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if args.list:
        list_rows(rows)
        return 0
    if args.report_only:
        return report_only(args)

    import torch

    if not torch.cuda.is_available():
        print("python -m flashqla.bench --bwd needs a CUDA GPU (torch.cuda.is_available() is False on this machine); "
              "use --list to see the rows or --report-only to rebuild the report from the CSVs.", file=sys.stderr)
        return 2
    if not rows:
        print("no rows selected", file=sys.stderr)
        return 2

    from flashqla.bench.bwd_impls import fla_bwd_dispatch, load_bwd_impls

    impls = load_bwd_impls(selected_impls(args))
    env = collect_env()
    dispatch = fla_bwd_dispatch() if "fla" in impls and impls["fla"].available else "n/a"
    # ours runs in the same intra-device context-parallel mode as the forward benchmark (default auto,
    # $FLASHQLA_CP, read by both our forward and backward when cp=None), recorded in the commit column
    commit = commit_with_cp(our_commit(args.commit), apply_cp_mode(getattr(args, "cp", None)))
    return run_bwd_rows(rows, args, impls, env, commit, device="cuda", fla_dispatch=dispatch)


def run_bwd_rows(rows, args, impls: dict, env: dict, commit: str, device="cuda", fla_dispatch: str = "n/a",
                 time_fn=None, ref_fn=None) -> int:
    """The measuring loop: resume, plan each implementation's source, fp64 result, gate, time,
    append, report.

    `impls`: name -> `bwd_impls.BwdImpl` (missing names are not run); `time_fn`: the timer (default
    the CUDA-graph one); `ref_fn(x)`: the fp64 result (default `bwd_runner.reference_grads`).
    Returns the exit status (0)."""
    import torch
    from tqdm import tqdm

    from flashqla.bench import bwd_runner as BRun
    from flashqla.bench.__main__ import drift_text, now_utc
    from flashqla.bench.runner import _recover, _short

    t_start = time.perf_counter()
    tol = tolerances(args)
    timer = dict(warmup=args.warmup, replays=args.replays, target_ms=args.target_ms, max_launches=args.max_launches)
    ref_batch = int(getattr(args, "ref_batch", None) or REF_BATCH)
    ref_limit = int(getattr(args, "ref_limit", 0) or 0)
    if ref_fn is None:
        def ref_fn(x):
            return BRun.reference_grads(x, ref_batch)
    prefix = find_prefix(args, env)
    paths = paths_for(args.results_dir, prefix)
    print("env: " + ", ".join(f"{f}={env[f]}" for f in ENV_FIELDS) + f", commit={commit}")
    for name, impl in impls.items():
        print(f"{LABELS[name]}: " + (impl.source if impl.available else str(impl.reason)))

    done = set() if args.force else done_keys(S.read_rows(paths["csv"]), env, commit, tuple(impls))
    todo = [r for r in rows if r.key not in done]
    if len(todo) < len(rows):
        print(f"resuming: {len(rows) - len(todo)} of {len(rows)} rows already in {paths['csv'].name} for this key")
    cache = S.PeerCache(paths["peers"], env, BR.IMPL_FIELDS_BWD)
    use_cache = args.peers in ("cached", "auto")
    live_peers = [p for p in PEERS if impls.get(p) is not None and impls[p].available]
    retime = set()
    if use_cache and args.retime > 0 and live_peers:
        retime = set(S.pick_retime([r.key for r in todo if cache.has_row(r.key, live_peers)], args.retime))
    meta = {"date": now_utc(), "method": method_lines(args, impls, tol, fla_dispatch)}
    factory = BRun.BwdInputFactory(device, max(r.mix.T for r in todo) if todo else 0, seed=args.seed)

    bar = tqdm(todo, desc="rows", unit="row", dynamic_ncols=True)
    stopped = False
    for i, row in enumerate(bar):
        if args.time_budget is not None and time.perf_counter() - t_start > args.time_budget:
            stopped = True
            tqdm.write(f"time budget of {args.time_budget:g} s spent: {len(todo) - i} rows left for the next run")
            break
        bar.set_postfix_str(f"{row.heads.label} {BG.short_name(row.mix.lengths)}")
        x = factory.get(row)
        row_fields = {"h_qk": row.heads.h_qk, "h_v": row.heads.h_v, "mix": row.mix.label, "T": row.mix.T,
                      "N": row.mix.N}
        plan = plan_sources(impls, row.key, args.peers, cache if use_cache else None)
        retimed = row.key in retime
        runs = [n for n in IMPLS if plan[n] == "live" or (plan[n] == "cached" and retimed and n in impls)]

        ref, gate = None, ""
        if runs:
            gate = "pairwise"
            padded = BG.padded_tokens(row.mix.lengths) * row.heads.h_v
            if args.ref == "fp64" and (ref_limit <= 0 or padded <= ref_limit):
                try:
                    ref = ref_fn(x)
                    gate = "fp64"
                except Exception as exc:
                    tqdm.write(f"fp64 result {row.label}: {_short(exc)}; this row's gate is pairwise")
                    ref = None
                    _recover()

        got, res = {}, {}
        ref_errs = {} if ref is not None else None

        def finish(name, saved, x):
            """Gate decided: time a passing implementation, cache a live peer."""
            if res[name]["status"] == "ok":
                res[name].update(BRun.time_impl(impls[name], x, saved, timer, time_fn, step=not args.no_step,
                                                verbose=args.verbose))
            if name in PEERS and plan[name] == "live":
                cache.put(name, row_fields, res[name], now_utc())

        pending = {}
        for name in runs:
            if (name in PEERS and args.time_budget is not None
                    and time.perf_counter() - t_start > args.time_budget):
                # a peer may compile for minutes: leave it to the next run (the row stays not done)
                if plan[name] == "live":
                    res[name] = {"status": DEFERRED}
                    tqdm.write(f"time budget of {args.time_budget:g} s spent: {LABELS[name]} deferred on {row.label}")
                continue
            try:
                got[name], saved = BRun.run_once(impls[name], x)
                if ref is not None:
                    ref_errs[name] = BRun.errors(got[name], ref)
            except Exception as exc:
                if args.verbose:
                    import traceback

                    traceback.print_exc()
                got.pop(name, None)
                res[name] = {"status": "error: " + _short(exc)}
                if name in PEERS and plan[name] == "live":
                    cache.put(name, row_fields, res[name], now_utc())
                _recover()
                continue
            if ref is not None:
                st = BRun.decide([name], {name: ref_errs[name]}, {}, tol)[name]
                e = ref_errs[name]
                res[name] = {"status": st, "err": max(e.values()) if e else "", "errs": BRun.format_errs(e)}
                finish(name, saved, x)
                del saved
            else:
                pending[name] = saved
        pairs = BRun.pairwise(got)
        if ref is None and pending:
            status = BRun.decide(list(got), None, pairs, tol)
            for name, saved in pending.items():
                best = min((pairs.get((name, m), pairs.get((m, name), {})) for m in got if m != name),
                           key=lambda e: max(e.values()) if e else float("inf"), default={})
                res[name] = {"status": status[name], "err": max(best.values()) if best else "",
                             "errs": BRun.format_errs(best)}
                finish(name, saved, x)
            pending.clear()
        del got, ref

        sources = sorted({plan[p] for p in PEERS if plan[p] in ("live", "cached")})
        # the cached peers timed again on this row (one left to the next run by --time-budget is not)
        retimed_peers = [n for n in PEERS if retimed and plan[n] == "cached" and n in res]
        line = {**{f: env[f] for f in ENV_FIELDS}, "commit": commit, **row_fields,
                "name": BG.short_name(row.mix.lengths),
                "parallelism": effective_parallelism(row.mix.lengths, row.heads.h_v), "gate": gate,
                "peers_source": "+".join(sources) + (" (re-timed)" if retimed_peers else ""), "date": now_utc()}
        for name in IMPLS:
            how = plan[name]
            if how == "live":
                r = res.get(name, {"status": "error: not run"})
            elif how == "cached":
                r = cache.get(name, row.key)
                if name in retimed_peers:
                    live = res[name]
                    cached_ms = BR.num(r.get("bwd_ms"))
                    now = {"status": live.get("status"), "ms": live.get("bwd_ms", float("nan"))}
                    line.update({f"{name}_retime_{f}": live.get(f, "") for f in BR.RETIME_FIELDS_BWD})
                    tqdm.write(f"drift {LABELS[name]} {row.heads.label} {BG.short_name(row.mix.lengths)}: "
                               + drift_text(cached_ms, r.get("status", ""), now))
            elif how == "n/a":
                r = {"status": impls[name].reason or "not available"}
            elif how == "not cached":
                r = {"status": "not cached"}
            else:
                r = {"status": ""}
            for f in BR.IMPL_FIELDS_BWD:
                line[f"{name}_{f}"] = r.get(f, "")
        for (a, b), e in pairs.items():
            col = f"pair_{a}_{b}"
            if col in BR.PAIR_FIELDS and e:
                line[col] = max(e.values())
        S.append_row(paths["csv"], line, BR.RESULT_FIELDS_BWD)
        tqdm.write(BR.console_line({k: S._fmt(v) for k, v in line.items()}))
        del x
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        write_outputs(paths, env, commit, meta, plot=not args.no_plot and (i % 8 == 7))
    bar.close()
    factory.release()
    write_outputs(paths, env, commit, meta, plot=not args.no_plot)
    all_rows = S.rows_for_key(S.read_rows(paths["csv"]), env, commit)
    print("\n".join(BR.geomean_table(all_rows)))
    print(f"wrote {paths['csv']}, {paths['md']}" + ("" if args.no_plot else f", {paths['png']}")
          + f"; peers cache {paths['peers']} ({len(cache)} lines for this key)"
          + (" -- stopped early, rerun to continue" if stopped else ""))
    print(f"elapsed {time.perf_counter() - t_start:.0f} s")
    return 0

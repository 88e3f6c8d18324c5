"""`python -m flashqla.bench`: GDN forward and backward, ours vs FLA 0.6.0 vs FlashQLA 0.1.3, on FlashQLA's grids.

    python -m flashqla.bench                       # the forward grid (resumable: rerun to continue)
    python -m flashqla.bench --quick               # four development rows
    python -m flashqla.bench --heads 16/32 --mixes 1x8192,8192x4
    python -m flashqla.bench --cp-grid             # the context-parallel rows, and <gpu>-cp.md
    python -m flashqla.bench --peers live          # time the peers on every row, refresh their cache
    python -m flashqla.bench --peers cached --retime 3
    python -m flashqla.bench --breakdown --quick   # FLA's five forward kernels one by one
    python -m flashqla.bench --time-budget 500     # start no new row after 500 s (fits a 10-min slot)
    python -m flashqla.bench --list                # the selected rows (no GPU needed)
    python -m flashqla.bench --report-only         # rebuild the pages from the CSVs into benchmarks/out/
    python -m flashqla.bench --bwd [--quick] ...   # the backward grid: backward alone and training step
    python -m flashqla.bench --serving             # pooled states + checkpoints vs plain, ours and FlashInfer
    python -m flashqla.bench --serving --report-only   # rebuild the serving page from its CSV
    python -m flashqla.bench --multigpu [--gpus 1,2,4,8]  # CP across GPUs, strong/weak scaling, vs FLA KCP, FlashQLA CP

A measuring run needs a CUDA GPU (without one it exits 2): per row the fp64 result, then for each
implementation the correctness gate and, if it passes, the CUDA-graph timing (`flashqla.bench.runner`).
Its rows are appended to `<results-dir>/<gpu>-fwd.csv` (`-bwd.csv`), live peer timings to
`peers-<gpu>-fwd.csv` (`-bwd.csv`), and the pages (`<gpu>-fwd.md`, `.png`, `<gpu>-cp.md`, `-bwd.md`
...) are written beside them unless `--out-dir` is given. `--report-only` rebuilds the pages from
the CSVs and writes them to `benchmarks/out/` (ignored by git), or to `--results-dir` when that is
given, or to `--out-dir`: the committed pages are refreshed only when asked.

Peers (`--peers`): `live` times them on every row and appends to the peers CSV; `cached` reads
them from it (rows without a cached line show '-') and re-times `--retime` rows to check it (the
live times go to the results CSV's `<peer>_retime_*` columns and the page's Drift section); `auto`
(default) uses the cache where it has the row and times live otherwise; `none` times ours only.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from pathlib import Path

from flashqla.bench import grid as G
from flashqla.bench.config import REPO_ROOT, Options
from flashqla.bench.impls import IMPLS, impls_for
from flashqla.bench.timing import DEFAULTS

__all__ = ["parse_args", "main", "our_commit", "commit_with_cp", "selected_impls", "list_lines"]


def parse_args(argv=None) -> Options:
    """The command line as `config.Options`. `--cp` defaults to $FLASHQLA_CP, else "auto" (read
    here, when the command line is parsed)."""
    p = argparse.ArgumentParser(prog="python -m flashqla.bench", description=__doc__.splitlines()[0],
                                formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--quick", action="store_true", help="a handful of development rows")
    p.add_argument("--cp-grid", action="store_true",
                   help="the context-parallel rows (one sequence of 2048 to 32768 tokens for 2/8, 4/16, 8/32, 16/64 "
                        "heads, and 131072 and 1048576 for 2/8 and 4/16); they go to the forward CSV like any row, and "
                        "<gpu>-cp.md with a plot of time against T is written from them")
    p.add_argument("--heads", action="append", help="head configs h_qk/h_v, comma-separated or repeated (e.g. 16/32)")
    p.add_argument("--mixes", action="append",
                   help="sequence mixes, comma-separated or repeated (e.g. 1x8192,8192x4; with --bwd also 8k_4seq)")
    p.add_argument("--peers", choices=("auto", "live", "cached", "none"), default="auto", help="where peer timings come from")
    p.add_argument("--retime", type=int, default=3,
                   help="cached peer rows re-timed to show drift (default 3; kept in the CSV, listed under Drift)")
    p.add_argument("--impls", default=",".join(IMPLS),
                   help=f"implementations to run, comma-separated from {','.join(IMPLS)} (default all)")
    p.add_argument("--cp", choices=("off", "auto", "on"), default=None,
                   help="our intra-device context-parallel mode (default: $FLASHQLA_CP, else auto); a mode other than "
                        "off is recorded in the commit column as +cp-<mode>")
    p.add_argument("--breakdown", action="store_true", help="also time FLA's forward kernel by kernel")
    p.add_argument("--force", action="store_true", help="re-measure rows already in the results CSV")
    p.add_argument("--time-budget", type=float, default=None, metavar="S",
                   help="start no new row after S seconds (--bwd: nor a live peer within a row)")
    p.add_argument("--tol", type=float, default=None,
                   help="gate tolerance (relative RMS) for every quantity (default 2e-2; --bwd: dg 3e-2)")
    p.add_argument("--warmup", type=int, default=DEFAULTS["warmup"], help="eager warm-up calls before capture")
    p.add_argument("--replays", type=int, default=DEFAULTS["replays"], help="timed graph replays (median taken)")
    p.add_argument("--target-ms", type=float, default=DEFAULTS["target_ms"], help="device time of one replay")
    p.add_argument("--max-launches", type=int, default=DEFAULTS["max_launches"], help="most calls in one graph")
    p.add_argument("--seed", type=int, default=0, help="input seed")
    p.add_argument("--results-dir", type=Path, default=None,
                   help="folder of the CSVs (default benchmarks/results, the committed ones); given, the pages go "
                        "there too (--report-only included)")
    p.add_argument("--out-dir", type=Path, default=None,
                   help="folder of the pages (default: the results folder; --report-only without --results-dir: "
                        "benchmarks/out, ignored by git)")
    p.add_argument("--prefix", default=None, help="file prefix (default <gpu>-fwd or <gpu>-bwd, e.g. h200-fwd)")
    p.add_argument("--commit", default=None,
                   help="our commit id (default: git; pass it where the checkout has no .git, e.g. the GPU machine); with --report-only, the commit whose "
                        "rows make the page, as written in the CSV (default: the latest measured)")
    p.add_argument("--no-plot", action="store_true", help="skip the PNGs")
    p.add_argument("--list", action="store_true", help="print the selected rows and exit")
    p.add_argument("--report-only", action="store_true", help="rebuild the pages from the CSVs and exit")
    p.add_argument("--also-commits", metavar="C1,C2",
                   help="with --report-only: rows not measured at the latest commit are taken from these commits "
                        "(CSV commit ids such as abc1234+cp-auto, first match wins) and shown as they were measured "
                        "there, not re-measured; the header counts the rows each commit gave")
    p.add_argument("--verbose", action="store_true", help="print tracebacks of failing implementations")
    b = p.add_argument_group("backward (--bwd)")
    b.add_argument("--bwd", action="store_true",
                   help="the backward and training-step benchmark (FlashQLA's backward grid)")
    b.add_argument("--ref", choices=("fp64", "pairwise"), default="fp64",
                   help="gate against the fp64 gradients (default) or only between implementations")
    b.add_argument("--ref-limit", type=int, default=0, metavar="N",
                   help="rows above N token-heads (chunk-padded) use the pairwise gate (default 0: none)")
    b.add_argument("--ref-batch", type=int, default=None, metavar="N",
                   help="token-heads per batch of value heads of the fp64 result (default 2^20 with --bwd, ~32 GB; "
                        "2^21 forward, ~23 GB)")
    b.add_argument("--no-step", action="store_true", help="time the backward only, not the training step")
    sv = p.add_argument_group("serving (--serving)")
    sv.add_argument("--serving", action="store_true",
                    help="the serving contract's cost: a state pool (vk) with 4 checkpoints per sequence against the "
                         "plain call, ours and FlashInfer (`flashqla.bench.serving`; rows: --heads/--mixes/--quick, "
                         "else its own selection); writes <gpu>-serving.csv and .md")
    sv.add_argument("--state-dtype", choices=("fp32", "bf16", "fp16"), default="bf16", help="the pool's dtype")
    p.add_argument_group("multi-GPU (--multigpu)").add_argument(
        "--multigpu", action="store_true",
        help="context parallelism across the GPUs of one host, strong and weak scaling beside FLA's and FlashQLA's "
             "(`flashqla.bench.multigpu`; its own options: python -m flashqla.bench --multigpu --help); writes "
             "<gpu>-multigpu.csv and .md")
    a = p.parse_args(argv)
    if a.serving and (a.bwd or a.cp_grid or a.breakdown):
        p.error("--serving runs alone (not with --bwd, --cp-grid or --breakdown)")
    return Options(
        bwd=a.bwd, quick=a.quick, cp_grid=a.cp_grid, heads=tuple(a.heads or ()), mixes=tuple(a.mixes or ()),
        peers=a.peers, retime=a.retime, impls=tuple(n.strip() for n in str(a.impls).split(",") if n.strip()),
        cp=a.cp or os.environ.get("FLASHQLA_CP") or "auto", breakdown=a.breakdown, force=a.force,
        time_budget=a.time_budget, tol=a.tol, warmup=a.warmup, replays=a.replays, target_ms=a.target_ms,
        max_launches=a.max_launches, seed=a.seed, results_dir=a.results_dir, out_dir=a.out_dir, prefix=a.prefix,
        commit=a.commit, plot=not a.no_plot, list_only=a.list, report_only=a.report_only,
        also_commits=tuple(c.strip() for c in (a.also_commits or "").split(",") if c.strip()), verbose=a.verbose,
        ref=a.ref, ref_limit=a.ref_limit, ref_batch=a.ref_batch, step=not a.no_step, serving=a.serving,
        state_dtype=a.state_dtype,
    )


def commit_with_cp(commit: str, mode: str) -> str:
    """The commit column: our commit, with "+cp-<mode>" unless the mode is off or the commit already
    ends with it (a --commit given with the suffix) (rows timed in different modes never mix under
    one key)."""
    if mode == "off" or commit.endswith(f"+cp-{mode}"):
        return commit
    return f"{commit}+cp-{mode}"


def our_commit(explicit: str | None = None) -> str:
    """Our commit: `explicit` (--commit), else `git rev-parse` (+ '+dirty' when files of the package
    outside the harness differ from it), else 'unknown'."""
    if explicit:
        return explicit
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


def selected_impls(opts: Options) -> tuple[str, ...]:
    """Implementations to load: `opts.impls` that have a call for the run's direction (FlashInfer has no
    backward), less the peers when `--peers none`, in table order. Raises SystemExit on an unknown name."""
    bad = [n for n in opts.impls if n not in IMPLS]
    if bad:
        raise SystemExit(f"error: unknown implementation(s) {bad}; choose from {','.join(IMPLS)}")
    return tuple(n for n in impls_for(opts.direction) if n in opts.impls and (n == "ours" or opts.peers != "none"))


def list_lines(direction: str, rows) -> list[str]:
    """`--list`: the selected rows with their T, sequence count, effective parallelism and work (the
    forward: CP flag, GFLOP and unavoidable MB; the backward: GFLOP, chunk-padded tokens, lengths)."""
    out = [f"{len(rows)} rows"]
    if direction == "bwd":
        out.append(f"{'heads':>6} {'mix':<9} {'T':>6} {'N':>2} {'par':>5} {'bwd GFLOP':>9} {'padded':>7}  lengths")
        for r in rows:
            m, h = r.mix, r.heads
            out.append(f"{h.label:>6} {G.short_name(m.lengths):<9} {m.T:>6} {m.N:>2} "
                       f"{G.effective_parallelism(m.lengths, h.h_v):>5.0f} {G.flop(m.T, h.h_v, 'bwd') / 1e9:>9.1f} "
                       f"{G.padded_tokens(m.lengths):>7}  {'+'.join(str(x) for x in m.lengths)}")
        return out
    out.append(f"{'heads':>6} {'mix':<12} {'T':>6} {'N':>2} {'par':>5} {'CP':>3} {'GFLOP':>7} {'min MB':>7}")
    for r in rows:
        m, h = r.mix, r.heads
        out.append(f"{h.label:>6} {m.label:<12} {m.T:>6} {m.N:>2} {G.effective_parallelism(m.lengths, h.h_v):>5.0f} "
                   f"{'CP' if G.is_cp_row(m.lengths, h.h_v) else '':>3} {G.flop(m.T, h.h_v) / 1e9:>7.1f} "
                   f"{G.fwd_min_bytes(m.T, m.N, h.h_qk, h.h_v) / 1e6:>7.1f}")
    return out


def main(argv=None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    if "--multigpu" in argv:  # its own flags (`flashqla.bench.multigpu`)
        from flashqla.bench.multigpu import main as multigpu_main

        return multigpu_main(argv, commit_of=lambda explicit, mode: commit_with_cp(our_commit(explicit), mode))
    opts = parse_args(argv)
    direction = opts.direction
    if opts.bwd and opts.breakdown:
        print("error: --breakdown is for the forward benchmark", file=sys.stderr)
        return 2
    try:
        if opts.serving:
            from flashqla.bench.serving import serving_rows

            rows = serving_rows(opts.heads, opts.mixes, opts.quick)
        else:
            rows = G.rows_for(direction, opts.heads, opts.mixes, opts.quick, opts.cp_grid)
    except ValueError as exc:
        print(f"error: {exc}", file=sys.stderr)
        return 2
    if opts.list_only:
        print("\n".join(list_lines(direction, rows)))
        return 0
    if opts.report_only and opts.serving:
        from flashqla.bench.serving import rebuild_serving

        return rebuild_serving(opts.data_dir, opts.pages_dir, opts.prefix, opts.commit)
    if opts.report_only:
        from flashqla.bench.report import rebuild

        return rebuild(direction, opts.data_dir, opts.pages_dir, opts.prefix, opts.commit, opts.also_commits,
                       opts.plot)

    import torch

    if not torch.cuda.is_available():
        print(f"python -m flashqla.bench{' --bwd' if opts.bwd else ''} needs a CUDA GPU (torch.cuda.is_available() is "
              "False on this machine); use --list to see the rows or --report-only to rebuild the pages from the "
              "CSVs.", file=sys.stderr)
        return 2
    if not rows:
        print("no rows selected", file=sys.stderr)
        return 2

    from flashqla.bench.impls import collect_env, load_impls
    from flashqla.bench.runner import run_rows

    if opts.serving:
        from flashqla.bench.serving import run_serving

        return run_serving(rows, opts, collect_env(), our_commit(opts.commit), opts.state_dtype)

    impls = load_impls(selected_impls(opts), direction, cp=opts.cp)
    env = collect_env()
    sm_count = torch.cuda.get_device_properties(0).multi_processor_count
    return run_rows(rows, opts, impls, env, commit_with_cp(our_commit(opts.commit), opts.cp), device="cuda",
                    sm_count=sm_count)


if __name__ == "__main__":
    sys.exit(main())

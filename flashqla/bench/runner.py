"""The measuring loop of both benchmarks: resume, plan, fp64 result, gate, time, append, report.

Per row (`run_rows`): inputs (`inputs.InputFactory`), where each implementation's result comes from
(`impls.plan_sources`: live, cached, ...), the fp64 result when something runs live
(`gate.fp64_result`), then per implementation the gate and, if it passes, the timing (the same
CUDA-graph timer, `timing.time_cuda_graph`, for every implementation). The row is appended to the
results CSV at once (a peer timed live also to the peers' cache) and the pages are rewritten every
few rows and at the end. What differs between the two benchmarks is one function each:

- forward (`_measure_fwd_row`, `measure`): each implementation runs once; o and the final state are
  compared with the fp64 result; a passing implementation is timed (its whole forward).
- backward (`_measure_bwd_row`, `run_once`, `time_impl`): each implementation runs one forward and
  one backward; o, final state and the six gradients are compared with the fp64 result, or, without
  it (`--ref pairwise`, a row above `--ref-limit`, the fp64 result failing), with each other
  (`gate.decide`); a passing implementation is timed twice: its backward alone on the products of
  one forward, and its training step (forward + backward). With `--time-budget` a peer that would
  start after the budget is left to the next run ("deferred": the row is measured again).

Resuming: a row counts as done for this environment key and commit when ours has a result there
(the backward: every selected implementation, not deferred and not "not cached").
"""

from __future__ import annotations

import math
import time
import traceback
from dataclasses import dataclass

import torch

from flashqla.bench import gate as GT
from flashqla.bench import grid as G
from flashqla.bench import report as R
from flashqla.bench import store as S
from flashqla.bench.config import Options
from flashqla.bench.impls import ENV_FIELDS, LABELS, Impl, plan_sources
from flashqla.bench.inputs import InputFactory, RowInputs
from flashqla.bench.timing import time_cuda_graph

__all__ = ["run_rows", "measure", "run_once", "time_impl", "drift_text"]

#: Pages (and the plot) are rewritten after every this many rows.
REPORT_EVERY = {"fwd": 10, "bwd": 8}


def _short(exc: BaseException) -> str:
    msg = str(exc).strip().splitlines()
    return f"{type(exc).__name__}: {msg[0][:160] if msg else ''}"


def _sync() -> None:
    if torch.cuda.is_available() and torch.cuda.is_initialized():
        torch.cuda.synchronize()


def _recover() -> None:
    try:
        _sync()
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
    except Exception:
        pass


def drift_text(cached_ms: float, cached_status: str, live: dict) -> str:
    """'cached 0.472 ms, now 0.480 ms (+1.7%)', or the statuses when either side has no time."""
    c = f"{cached_ms:.3f} ms" if cached_ms > 0 else str(cached_status or "-")
    n = f"{live['ms']:.3f} ms" if live.get("status") == "ok" else str(live.get("status", "-"))
    tail = f" ({100 * (live['ms'] / cached_ms - 1):+.1f}%)" if live.get("status") == "ok" and cached_ms > 0 else ""
    return f"cached {c}, now {n}{tail}"


def row_label(direction: str, row) -> str:
    """How the console names a row: `16/32 8192x4`, the backward `16/32 8k_4seq`."""
    return f"{row.heads.label} {G.short_name(row.mix.lengths)}" if direction == "bwd" else row.label


# ---------------------------------------------------------------------------------------- forward


def measure(fn, x: RowInputs, ref: dict, tol: dict | None = None, timer: dict | None = None, verbose: bool = False,
            time_fn=None) -> dict:
    """Gate then time one forward implementation `fn(x) -> (o, final_state)` on one row, against
    `ref` (`gate.fp64_result`). `time_fn(callable, **timer) -> Timing` is the timer (default
    `timing.time_cuda_graph`; tests pass a host-clock one).

    Returns a dict with `status` ("ok", "FAIL" or "error: ..."), `err_o`, `err_ht` (relative RMS,
    NaN when not computed), `ms` (median per-call time, NaN unless ok), `launches` and `spread`.
    """
    tol = tol or GT.GATE_TOL["fwd"]
    out = {"status": "", "err_o": math.nan, "err_ht": math.nan, "ms": math.nan, "launches": "", "spread": math.nan}
    try:
        with torch.no_grad():
            o, ht = fn(x)
            _sync()
            out["err_o"] = GT.rel_rms(o, ref["o"])
            out["err_ht"] = GT.rel_rms(ht, ref["ht"]) if ht is not None else math.inf
            del o, ht
    except Exception as exc:
        if verbose:
            traceback.print_exc()
        out["status"] = "error: " + _short(exc)
        _recover()
        return out
    if not (out["err_o"] <= tol["o"] and out["err_ht"] <= tol["ht"]):
        out["status"] = "FAIL"
        return out
    try:
        with torch.no_grad():
            t = (time_fn or time_cuda_graph)(lambda: fn(x), **(timer or {}))
    except Exception as exc:
        if verbose:
            traceback.print_exc()
        out["status"] = "error: timing: " + _short(exc)
        _recover()
        return out
    out.update(status="ok", ms=t.ms, launches=t.launches, spread=t.spread)
    return out


# ---------------------------------------------------------------------------------------- backward


def run_once(impl: Impl, x: RowInputs) -> tuple[dict, object]:
    """One forward and one backward of `impl` (untimed). Returns ({o, ht, dq, ..., dh0}, saved
    forward products). Exceptions propagate."""
    with torch.no_grad():
        f = impl.fwd(x)
        grads = impl.bwd(x, f.saved)
    _sync()
    if len(grads) != len(GT.GRAD_NAMES):
        raise RuntimeError(f"{impl.name}: backward returned {len(grads)} tensors, expected {len(GT.GRAD_NAMES)}")
    return {"o": f.o, "ht": f.ht, **dict(zip(GT.GRAD_NAMES, grads))}, f.saved


def time_impl(impl: Impl, x: RowInputs, saved, timer: dict | None = None, time_fn=None, step: bool = True,
              verbose: bool = False) -> dict:
    """Times `impl`'s backward alone on one forward's `saved` products, then (when `step`) its
    training step, with the CUDA-graph timer (or `time_fn`). Returns the fields `bwd_ms`,
    `bwd_launches`, `bwd_spread`, `step_ms`, `step_launches`, `step_spread` and `status` ("ok" or
    "error: timing ...")."""
    timer = timer or {}
    time_fn = time_fn or time_cuda_graph
    out = {"status": "ok"}
    jobs = [("bwd", lambda: impl.bwd(x, saved))]
    if step:
        jobs.append(("step", lambda: impl.step(x)))
    for key, fn in jobs:
        try:
            with torch.no_grad():
                t = time_fn(fn, **timer)
        except Exception as exc:
            if verbose:
                traceback.print_exc()
            out["status"] = f"error: timing {key}: " + _short(exc)
            _recover()
            return out
        out.update({f"{key}_ms": t.ms, f"{key}_launches": t.launches, f"{key}_spread": t.spread})
    return out


# ---------------------------------------------------------------------------------------- one row


@dataclass
class _Ctx:
    """What the per-row functions need besides the row: options, implementations, plan inputs."""

    opts: Options
    impls: dict
    cache: S.PeerCache
    tol: dict
    timer: dict
    time_fn: object
    ref_fn: object
    t_start: float


def _measure_fwd_row(ctx: _Ctx, row, x, row_fields, plan, retimed) -> tuple[dict, dict, dict | None]:
    """The forward's gate and timing on one row: (results of what ran here, by implementation; extra
    columns (none); the fp64 result, for the breakdown)."""
    need_ref = any(v == "live" for v in plan.values()) or retimed or ctx.opts.breakdown
    ref = ctx.ref_fn(x) if need_ref else None
    live = {}
    for name in S.SCHEMAS["fwd"].impls:
        how = plan[name]
        if how == "live" or (how == "cached" and retimed and name in ctx.impls):
            live[name] = measure(ctx.impls[name].fn, x, ref, ctx.tol, ctx.timer, ctx.opts.verbose, ctx.time_fn)
            if how == "live" and name != "ours":
                ctx.cache.put(name, row_fields, live[name], S.now_utc())
    return live, {}, ref


def _measure_bwd_row(ctx: _Ctx, row, x, row_fields, plan, retimed) -> tuple[dict, dict, None]:
    """The backward's gate and timing on one row: (results of what ran here, by implementation; the
    row's `gate` and pairwise-agreement columns; None)."""
    from tqdm import tqdm

    opts, impls = ctx.opts, ctx.impls
    peers = S.SCHEMAS["bwd"].peers
    runs = [n for n in S.SCHEMAS["bwd"].impls if plan[n] == "live" or (plan[n] == "cached" and retimed and n in impls)]
    ref, gate = None, ""
    if runs:
        gate = "pairwise"
        padded = G.padded_tokens(row.mix.lengths) * row.heads.h_v
        if opts.ref == "fp64" and (opts.ref_limit <= 0 or padded <= opts.ref_limit):
            try:
                ref = ctx.ref_fn(x)
                gate = "fp64"
            except Exception as exc:
                tqdm.write(f"fp64 result {row.label}: {_short(exc)}; this row's gate is pairwise")
                ref = None
                _recover()

    got, res = {}, {}
    ref_errs = {} if ref is not None else None

    def finish(name, saved):
        """Gate decided: time a passing implementation, cache a live peer."""
        if res[name]["status"] == "ok":
            res[name].update(time_impl(impls[name], x, saved, ctx.timer, ctx.time_fn, step=opts.step,
                                       verbose=opts.verbose))
        if name in peers and plan[name] == "live":
            ctx.cache.put(name, row_fields, res[name], S.now_utc())

    pending = {}
    for name in runs:
        if (name in peers and opts.time_budget is not None
                and time.perf_counter() - ctx.t_start > opts.time_budget):
            # a peer may compile for minutes: leave it to the next run (the row stays not done)
            if plan[name] == "live":
                res[name] = {"status": S.DEFERRED}
                tqdm.write(f"time budget of {opts.time_budget:g} s spent: {LABELS[name]} deferred on {row.label}")
            continue
        try:
            got[name], saved = run_once(impls[name], x)
            if ref is not None:
                ref_errs[name] = GT.errors(got[name], ref)
        except Exception as exc:
            if opts.verbose:
                traceback.print_exc()
            got.pop(name, None)
            res[name] = {"status": "error: " + _short(exc)}
            if name in peers and plan[name] == "live":
                ctx.cache.put(name, row_fields, res[name], S.now_utc())
            _recover()
            continue
        if ref is not None:
            st = GT.decide([name], {name: ref_errs[name]}, {}, ctx.tol)[name]
            e = ref_errs[name]
            res[name] = {"status": st, "err": max(e.values()) if e else "", "errs": GT.format_errs(e)}
            finish(name, saved)
            del saved
        else:
            pending[name] = saved
    pairs = GT.pairwise(got)
    if ref is None and pending:
        status = GT.decide(list(got), None, pairs, ctx.tol)
        for name, saved in pending.items():
            best = min((pairs.get((name, m), pairs.get((m, name), {})) for m in got if m != name),
                       key=lambda e: max(e.values()) if e else float("inf"), default={})
            res[name] = {"status": status[name], "err": max(best.values()) if best else "",
                         "errs": GT.format_errs(best)}
            finish(name, saved)
        pending.clear()
    del got, ref
    extra = {"gate": gate}
    pair_fields = S.SCHEMAS["bwd"].pair_fields
    for (a, b), e in pairs.items():
        if f"pair_{a}_{b}" in pair_fields and e:
            extra[f"pair_{a}_{b}"] = max(e.values())
    return res, extra, None


_MEASURE_ROW = {"fwd": _measure_fwd_row, "bwd": _measure_bwd_row}


def _row_columns(direction: str, row, sm_count: int) -> dict:
    """The row's own columns besides its key: the forward's CP flag, the backward's short name, and
    both benchmarks' effective parallelism."""
    par = G.effective_parallelism(row.mix.lengths, row.heads.h_v)
    if direction == "bwd":
        return {"name": G.short_name(row.mix.lengths), "parallelism": par}
    return {"cp_row": int(G.is_cp_row(row.mix.lengths, row.heads.h_v, sm_count)), "parallelism": par}


# ---------------------------------------------------------------------------------------- the loop


def run_rows(rows, opts: Options, impls: dict, env: dict, commit: str, device="cuda", sm_count: int = G.H200_SMS,
             time_fn=None, ref_fn=None) -> int:
    """The measuring loop of the benchmark `opts.direction` over `rows` (see the module docstring).

    `impls`: name -> `impls.Impl` (names missing are not run; cached peers are still shown);
    `env`: the environment key; `commit`: our commit column; `time_fn`: the timer (default the
    CUDA-graph one); `ref_fn(x)`: the fp64 result (default `gate.fp64_result`). Writes the results
    CSV, the peers' cache and the pages (`store.files` of `opts.data_dir` / `opts.pages_dir`);
    returns the exit status (0)."""
    from tqdm import tqdm

    direction = opts.direction
    schema = S.SCHEMAS[direction]
    t_start = time.perf_counter()
    if ref_fn is None:
        def ref_fn(x):
            return GT.fp64_result(x, grads=direction == "bwd", max_token_heads=opts.max_token_heads)
    paths = S.files(opts.data_dir, S.find_prefix(direction, opts.data_dir, opts.prefix, env), opts.pages_dir)
    print("env: " + ", ".join(f"{f}={env[f]}" for f in ENV_FIELDS) + f", commit={commit}")
    for name, impl in impls.items():
        print(f"{LABELS[name]}: " + (impl.source if impl.available else str(impl.reason)))

    need = tuple(impls) if direction == "bwd" else (("ours",) if "ours" in impls else ())
    done = set() if opts.force else S.done_keys(S.read_rows(paths["csv"]), env, commit, need)
    todo = [r for r in rows if r.key not in done]
    if len(todo) < len(rows):
        print(f"resuming: {len(rows) - len(todo)} of {len(rows)} rows already in {paths['csv'].name} for this key")
    cache = S.PeerCache(paths["peers"], env, schema.impl_fields)
    use_cache = opts.peers in ("cached", "auto")
    peers = schema.peers
    live_peers = [p for p in peers if impls.get(p) is not None and impls[p].available]
    retime = set()
    if use_cache and opts.retime > 0 and live_peers:
        retime = set(S.pick_retime([r.key for r in todo if any(cache.get(p, r.key) is not None for p in live_peers)],
                                   opts.retime))
    meta = {"date": S.now_utc(), "method": R.method_lines(opts, impls, env.get("gpu"))}
    factory = InputFactory(device, max(r.mix.T for r in todo) if todo else 0, seed=opts.seed, grads=direction == "bwd")
    ctx = _Ctx(opts, impls, cache, opts.tolerances, opts.timer, time_fn, ref_fn, t_start)
    primary = schema.timed[0][0]  # the time column the drift messages compare

    bar = tqdm(todo, desc="rows", unit="row", dynamic_ncols=True)
    stopped = False
    for i, row in enumerate(bar):
        if opts.time_budget is not None and time.perf_counter() - t_start > opts.time_budget:
            stopped = True
            tqdm.write(f"time budget of {opts.time_budget:g} s spent: {len(todo) - i} rows left for the next run")
            break
        bar.set_postfix_str(row_label(direction, row))
        x = factory.get(row)
        row_fields = {"h_qk": row.heads.h_qk, "h_v": row.heads.h_v, "mix": row.mix.label, "T": row.mix.T, "N": row.mix.N}
        plan = plan_sources(impls, row, opts.peers, cache if use_cache else None, names=schema.impls)
        retimed = row.key in retime
        live, extra, ref = _MEASURE_ROW[direction](ctx, row, x, row_fields, plan, retimed)

        sources = sorted({plan[p] for p in peers if plan[p] in ("live", "cached")})
        # the cached peers timed again on this row (one left to the next run by --time-budget is not)
        retimed_peers = [n for n in peers if plan[n] == "cached" and n in live]
        line = {**{f: env[f] for f in ENV_FIELDS}, "commit": commit, **row_fields,
                **_row_columns(direction, row, sm_count), **extra,
                "peers_source": "+".join(sources) + (" (re-timed)" if retimed_peers else ""), "date": S.now_utc()}
        for name in schema.impls:
            how = plan[name]
            if how == "live":
                r = live.get(name, {"status": "error: not run"})
            elif how == "cached":
                r = cache.get(name, row.key)
                if name in retimed_peers:
                    now = live[name]
                    line.update({f"{name}_retime_{f}": now.get(f, "") for f in schema.retime_fields})
                    tqdm.write(f"drift {LABELS[name]} {row_label(direction, row)}: "
                               + drift_text(S.num(r.get(primary)), r.get("status", ""),
                                            {"status": now.get("status"), "ms": now.get(primary, math.nan)}))
            elif how == "n/a":
                r = {"status": impls[name].reason or "not available"}
            elif how == "unsupported":
                r = {"status": "not supported"}
            elif how == "not cached":
                r = {"status": "not cached"}
            else:
                r = {"status": ""}
            for f in schema.impl_fields:
                line[f"{name}_{f}"] = r.get(f, "")
        S.append_row(paths["csv"], line, schema.result_fields)
        tqdm.write(R.console_line(direction, {k: S.fmt(v) for k, v in line.items()}))
        if direction == "fwd" and opts.breakdown:
            _breakdown(x, ref, row, row_fields, env, commit, paths, opts.timer)
        del x, ref
        if torch.cuda.is_available():
            torch.cuda.empty_cache()
        every = REPORT_EVERY[direction]
        R.write_pages(direction, paths, env, commit, meta, plot=opts.plot and (i % every == every - 1))
    bar.close()
    factory.release()
    R.write_pages(direction, paths, env, commit, meta, plot=opts.plot)
    all_rows = S.rows_for_key(S.read_rows(paths["csv"]), env, commit)
    print("\n".join(R.geomean_table(direction, all_rows)))
    print(f"wrote {paths['csv']}, {paths['md']}" + ("" if not opts.plot else f", {paths['png']}")
          + f"; peers cache {paths['peers']} ({len(cache)} lines for this key)"
          + (" -- stopped early, rerun to continue" if stopped else ""))
    print(f"elapsed {time.perf_counter() - t_start:.0f} s")
    return 0


def _breakdown(x, ref, row, row_fields, env, commit, paths, timer) -> None:
    """`--breakdown`: FLA's forward kernel by kernel on this row, appended to the breakdown CSV."""
    from tqdm import tqdm

    from flashqla.bench.breakdown import run_fla_breakdown, step_bytes

    try:
        bd = run_fla_breakdown(x, timer, ref)
    except Exception as exc:
        tqdm.write(f"breakdown {row.label}: {type(exc).__name__}: {exc}")
        return
    sb = {b.step: b for b in step_bytes(row.mix.T, row.mix.N, bd["NT"], row.heads.h_qk, row.heads.h_v)}
    date = S.now_utc()
    base = {**{f: env[f] for f in ENV_FIELDS}, "commit": commit, **row_fields, "date": date}
    parts = []
    for name, ms in bd["steps"]:
        b = sb[name]
        note = ("from intra - w_u" if name == "kkt_solve" and bd["kkt_source"] != "kernel" else "")
        S.append_row(paths["breakdown"], {**base, "step": name, "ms": ms, "inputs_read": b.inputs_read,
                                          "inter_read": b.inter_read, "inter_written": b.inter_written,
                                          "out_written": b.out_written, "note": note}, S.BREAKDOWN_FIELDS)
        parts.append(f"{name} {ms:.3f}")
    S.append_row(paths["breakdown"], {**base, "step": "intra", "ms": bd["intra_ms"], "note": "fwd_intra"},
                 S.BREAKDOWN_FIELDS)
    total = sum(ms for _, ms in bd["steps"] if not math.isnan(ms))
    tqdm.write(f"breakdown {row.label}: " + ", ".join(parts) + f" | sum {total:.3f} ms | chained o err {bd['err_o']:.1e}")

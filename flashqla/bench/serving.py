"""`python -m flashqla.bench --serving`: what the serving contract costs, ours beside FlashInfer.

Per row (a head configuration and a sequence mix of the forward grid; default `SERVING_ROWS`), on
the benchmark's inputs (`inputs.InputFactory`: bf16 q/k/v, Qwen3-Next gates with a g == 0 and a
strong-decay head, fp32 beta, packed int32 offsets), six calls, each CUDA-graph timed
(`timing.time_cuda_graph`, median of replays):

- `plain`: ours, per-sequence fp32 initial states `[N, HV, K, V]` in, final states out (the forward
  benchmark's call);
- `serving`: ours with a state pool `[2N, HV, V, K]` ("vk") in the pool dtype (default bf16),
  sequences at shuffled rows (`state_indices`), final states written back in place, and 4
  checkpoints per sequence at its quarter points (`checkpoint_positions`, any token);
- `serving_fi`: ours as `serving`, at FlashInfer's checkpoint positions (below) instead;
- `serving_inv`: ours as `serving` with `batch_invariant=True` (its plan: no context-parallel split):
  the cost of batch invariance against the default plan;
- `fi_plain`: FlashInfer 0.7.2.post1's `chunk_gated_delta_rule` as in the forward benchmark
  (`impls._flashinfer_forward`);
- `fi_serving`: FlashInfer with the same pool (`state_indices`, `output_state` = the pool) and its
  checkpoints: every `n` tokens, n = the largest multiple of 64 not above a quarter of the longest
  sequence, at least 64 (so that sequence gets about 4: exactly 4 when a quarter of it is a multiple
  of 64; `checkpoint_every_n_tokens` must be a multiple of 64), with
  `checkpoint_cu_starts` from the lengths.

Gates before timing (relative RMS): ours `serving` o against `plain` on the pool's (rounded) start
states under the same plan (<= 1e-3; `plain` with cp="off" where `serving` takes the unsplit kernel
path, since its own plan may split there and round differently), each sequence's last-token
checkpoint against its written pool row (<= 1e-2), FlashInfer's o and checkpoints against ours at the same positions (<= the forward gate, 2e-2),
`serving_inv`'s o against `serving`'s (<= the forward gate, 2e-2: where the default plan splits, the
invariant plan does not, and the two round differently). Batch invariance itself is checked, not assumed: the
row's last sequence, moved behind a 77-token padding sequence in a batch of two, must give bitwise
the o, final state and checkpoints it gets inside the row's batch (`inv_bitwise`). A
row whose gate fails is recorded with its errors and not timed.

Results: `<results-dir>/<gpu>-serving.csv` (one line per row and run) and the page
`<gpu>-serving.md` (header: GPU, versions, commit, date; the overhead of `serving` over `plain`,
the issue's goal being <= 3%; FlashInfer's serving time over ours at the same checkpoints).
"""

from __future__ import annotations

import math
import sys
from itertools import accumulate
from pathlib import Path

from flashqla.bench import grid as G
from flashqla.bench import store as S
from flashqla.bench.impls import BASE_ENV_FIELDS
from flashqla.bench.report import geomean

__all__ = ["SERVING_ROWS", "FIELDS", "serving_rows", "positions_quarter", "fi_every_n", "positions_every",
           "run_serving", "serving_markdown"]

#: Default rows: few and many heads; one long sequence, two unequal ones, equal batches.
SERVING_ROWS: tuple[tuple[str, str], ...] = tuple(
    (h, m) for h in ("2/8", "8/32", "16/32", "16/64", "32/32")
    for m in ("1x32768", "1x8192", "28672+4096", "8192x4", "1024x8")
)

TIMED = ("plain", "serving", "serving_fi", "serving_inv", "fi_plain", "fi_serving")
FIELDS = (BASE_ENV_FIELDS + ("flashinfer", "commit", "h_qk", "h_v", "mix", "T", "N", "state_dtype", "every_n",
                                "ckpt_ours", "ckpt_fi", "path", "path_fi", "path_inv")
          + tuple(f"{t}_ms" for t in TIMED)
          + ("err_o", "err_ckpt_end", "err_o_fi", "err_ckpt_fi", "err_o_inv", "inv_bitwise", "status", "date"))


def serving_rows(heads=(), mixes=(), quick: bool = False) -> list:
    """The rows of `--serving`: the forward grid's selection when heads or mixes are given (or
    `quick`), else `SERVING_ROWS`."""
    if heads or mixes or quick:
        return G.rows_for("fwd", heads, mixes, quick)
    return [G.Row(G.parse_heads(h), G.parse_mix(m)) for h, m in SERVING_ROWS]


def positions_quarter(lengths) -> list[int]:
    """4 checkpoint positions per sequence (global offsets): its quarter points ceil(j * L / 4),
    j = 1..4, deduplicated for L < 4; none for an empty sequence."""
    out, bos = [], 0
    for L in lengths:
        out += sorted({bos + -(-j * L // 4) for j in range(1, 5) if L > 0})
        bos += L
    return out


def fi_every_n(lengths) -> int:
    """FlashInfer's checkpoint period for a row: the largest multiple of 64 not above a quarter of
    the longest sequence (at least 64)."""
    return max(64, (max(lengths) // 4) // 64 * 64)


def positions_every(lengths, n: int) -> list[int]:
    """The positions FlashInfer's every-n checkpoints stand for: bos + j * n, j = 1 .. L // n."""
    out, bos = [], 0
    for L in lengths:
        out += [bos + j * n for j in range(1, L // n + 1)]
        bos += L
    return out


def _rel(a, b) -> float:
    from flashqla.testing import rel_rms

    return float(rel_rms(a, b))


def _path(last: dict) -> str:
    """The serving path a call took, as the page names it: "kernel", or "torch/<checkpoint method>"."""
    return last["path"] + (f"/{last['checkpoints']}" if last.get("checkpoints") else "")


def _one_row(row, x, timer: dict, state_dtype, fi_op) -> dict:
    import torch

    import flashqla
    from flashqla.bench.timing import time_cuda_graph
    from flashqla.bench.impls import flashinfer_inputs
    from flashqla.ops.gdn import serving as op_serving

    dev = x.q.device
    N, HV = row.mix.N, row.heads.h_v
    lengths = list(row.mix.lengths)
    gen = torch.Generator(device="cpu").manual_seed(N * 7 + HV)
    rows = torch.randperm(2 * N, generator=gen)[:N].to(dev)
    pool0 = torch.zeros(2 * N, HV, G.V_DIM, G.K_DIM, device=dev, dtype=state_dtype)
    pool0[rows] = x.h0.transpose(-1, -2).to(state_dtype)
    h0_r = pool0[rows].float().transpose(-1, -2).contiguous()  # the start states the pool holds, kv, fp32
    p4 = positions_quarter(lengths)
    n_fi = fi_every_n(lengths)
    pfi = positions_every(lengths, n_fi)
    cs = torch.tensor([0] + list(accumulate(L // n_fi for L in lengths)), dtype=torch.int32, device=dev)
    r = {"h_qk": row.heads.h_qk, "h_v": HV, "mix": row.mix.label, "T": row.mix.T, "N": N,
         "state_dtype": str(state_dtype).replace("torch.", ""), "every_n": n_fi, "ckpt_ours": len(p4),
         "ckpt_fi": len(pfi)}

    def ours_plain(h0, cp=None):
        return flashqla.chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=h0, output_final_state=True,
                                               cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu, cp=cp)

    def ours_serving(pool, pos, cks, invariant=False):
        return flashqla.chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, output_final_state=True,
                                               cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu,
                                               state_indices=rows, state_layout="vk", checkpoint_positions=pos,
                                               checkpoint_states=cks, batch_invariant=invariant)

    pos4 = torch.tensor(p4, dtype=torch.int64, device=dev)
    posfi = torch.tensor(pfi, dtype=torch.int64, device=dev)
    ck_shape = (HV, G.V_DIM, G.K_DIM)
    with torch.no_grad():
        pa, ca = pool0.clone(), torch.empty(len(p4), *ck_shape, device=dev, dtype=state_dtype)
        o_serv, _ = ours_serving(pa, pos4, ca)
        r["path"] = _path(op_serving.LAST_PATH)
        # the plain call under the serving call's plan: the kernel path is unsplit, where the plain
        # call's own plan may split (and round differently)
        o_plain, _ = ours_plain(h0_r, cp="off" if r["path"] == "kernel" else None)
        pb, cb = pool0.clone(), torch.empty(len(pfi), *ck_shape, device=dev, dtype=state_dtype)
        ours_serving(pb, posfi, cb)
        r["path_fi"] = _path(op_serving.LAST_PATH)
        pi, ci = pool0.clone(), torch.empty(len(p4), *ck_shape, device=dev, dtype=state_dtype)
        o_inv, _ = ours_serving(pi, pos4, ci, invariant=True)
        r["path_inv"] = _path(op_serving.LAST_PATH)
        r["err_o"] = _rel(o_serv, o_plain)
        r["err_o_inv"] = _rel(o_inv, o_serv)
        r["inv_bitwise"] = _moved_bitwise(x, rows, pool0, lengths, p4, o_inv, pi, ci)
        ends = [(p4.index(e), n) for n, (L, e) in enumerate(zip(lengths, accumulate(lengths))) if L > 0]
        r["err_ckpt_end"] = max((_rel(ca[m].float(), pa[rows[n]].float()) for m, n in ends), default=0.0)
        a = flashinfer_inputs(x) if fi_op is not None else None
        if a is not None:
            def fi_serving(pool, cks):
                return fi_op(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=a["scale"], initial_state=pool,
                             output_final_state=True, cu_seqlens=a["cu_seqlens"], output_state=pool,
                             state_indices=rows, state_checkpoints=cks, checkpoint_cu_starts=cs,
                             checkpoint_every_n_tokens=n_fi, use_cp="auto", max_seqlen=a["max_seqlen"])

            def fi_plain():
                ht = torch.empty_like(a["initial_state"])
                return fi_op(a["q"], a["k"], a["v"], a["g"], a["beta"], scale=a["scale"],
                             initial_state=a["initial_state"], output_final_state=True, cu_seqlens=a["cu_seqlens"],
                             output_state=ht, use_cp="auto", max_seqlen=a["max_seqlen"])

            pc, cc = pool0.clone(), torch.empty(len(pfi), *ck_shape, device=dev, dtype=state_dtype)
            o_fi = fi_serving(pc, cc)
            o_fi = o_fi[0] if isinstance(o_fi, tuple) else o_fi
            r["err_o_fi"] = _rel(o_fi.unsqueeze(0), o_serv)
            r["err_ckpt_fi"] = _rel(cc.float(), cb.float()) if len(pfi) else 0.0
        torch.cuda.synchronize()
    bad = [f"{k} {r[k]:.2e}" for k, tol in (("err_o", 1e-3), ("err_ckpt_end", 1e-2), ("err_o_fi", 2e-2),
                                           ("err_ckpt_fi", 2e-2), ("err_o_inv", 2e-2)) if k in r and not (r[k] <= tol)]
    if not r["inv_bitwise"]:
        bad.append("batch_invariant: the last sequence, moved to another batch, differs bitwise")
    if bad:
        r["status"] = "gate failed: " + ", ".join(bad)
        return r
    # timing: each call on its own pool copy (the in-place writes change values, not work)
    pools = {t: pool0.clone() for t in ("serving", "serving_fi", "serving_inv", "fi_serving")}
    cks = {"serving": torch.empty(len(p4), *ck_shape, device=dev, dtype=state_dtype),
           "serving_inv": torch.empty(len(p4), *ck_shape, device=dev, dtype=state_dtype),
           "serving_fi": torch.empty(len(pfi), *ck_shape, device=dev, dtype=state_dtype),
           "fi_serving": torch.empty(len(pfi), *ck_shape, device=dev, dtype=state_dtype)}
    calls = {"plain": lambda: ours_plain(x.h0),
             "serving": lambda: ours_serving(pools["serving"], pos4, cks["serving"]),
             "serving_fi": lambda: ours_serving(pools["serving_fi"], posfi, cks["serving_fi"]),
             "serving_inv": lambda: ours_serving(pools["serving_inv"], pos4, cks["serving_inv"], invariant=True)}
    if p4 == pfi:
        calls.pop("serving_fi")
    if a is not None:
        calls["fi_plain"] = fi_plain
        calls["fi_serving"] = lambda: fi_serving(pools["fi_serving"], cks["fi_serving"])
    with torch.no_grad():
        for t, fn in calls.items():
            r[f"{t}_ms"] = time_cuda_graph(fn, **timer).ms
    if p4 == pfi:
        r["serving_fi_ms"] = r["serving_ms"]
    r["status"] = "ok"
    return r


def _moved_bitwise(x, rows, pool0, lengths, p4, o_inv, pool_inv, ck_inv, filler: int = 77) -> bool:
    """Whether the batch's last non-empty sequence, moved into another batch with batch_invariant=True,
    gives bitwise the o, pool row and checkpoints it got inside the row's batched call (`o_inv`,
    `pool_inv`, `ck_inv`). The other batch: a padding sequence of the row's first `filler` tokens
    (state index -1: no read, no write), then that sequence at token offset `filler` (not a multiple
    of the chunk), from its own pool row in a fresh copy of the starting pool, with its own
    checkpoints."""
    import torch

    import flashqla

    ends = list(accumulate(lengths))
    n = max(i for i, L in enumerate(lengths) if L > 0)
    s0, s1 = ends[n] - lengths[n], ends[n]
    mine = [m for m, p in enumerate(p4) if s0 < p <= s1]
    dev = x.q.device
    pool = pool0.clone()
    cks = torch.empty(len(mine), *ck_inv.shape[1:], device=dev, dtype=ck_inv.dtype)
    pos = torch.tensor([p4[m] - s0 + filler for m in mine], dtype=torch.int64, device=dev)
    cu = torch.tensor([0, filler, filler + s1 - s0], dtype=x.cu_seqlens.dtype, device=dev)
    idx = torch.cat([torch.full((1,), -1, dtype=rows.dtype, device=dev), rows[n:n + 1]])
    q, k, v, g, beta = (torch.cat([t[:, :filler], t[:, s0:s1]], dim=1) for t in (x.q, x.k, x.v, x.g, x.beta))
    o, _ = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=pool, output_final_state=True,
                                           cu_seqlens=cu, state_indices=idx, state_layout="vk",
                                           checkpoint_positions=pos, checkpoint_states=cks, batch_invariant=True)
    r = int(rows[n])
    return _same_bits(o[:, filler:], o_inv[:, s0:s1]) and _same_bits(pool[r], pool_inv[r]) and _same_bits(cks, ck_inv[mine])


def _same_bits(a, b) -> bool:
    """Whether a and b (same shape and dtype) hold the same bit patterns (-0.0 and +0.0 differ)."""
    import torch

    ints = {4: torch.int32, 2: torch.int16}[a.element_size()]
    return a.dtype == b.dtype and bool(torch.equal(a.contiguous().view(ints), b.contiguous().view(ints)))


def run_serving(rows, opts, env: dict, commit: str, state_dtype: str = "bf16") -> int:
    """Measures `rows` (see the module docstring), appends to `<gpu>-serving.csv` in the results
    folder and writes the page beside it (or to --out-dir). Returns 0, or 1 when a row's gate failed."""
    import torch

    from flashqla.bench.impls import gpu_slug
    from flashqla.bench.inputs import InputFactory

    sdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[state_dtype]
    try:
        from flashinfer.gdn_prefill import chunk_gated_delta_rule as fi_op
    except ImportError as exc:
        print(f"FlashInfer not importable ({exc}): its columns stay empty")
        fi_op = None
    prefix = opts.prefix or f"{gpu_slug(env['gpu'])}-serving"
    csv_path = Path(opts.data_dir) / f"{prefix}.csv"
    factory = InputFactory("cuda", max(r.mix.T for r in rows), seed=opts.seed)
    failed = 0
    print(f"# {env['gpu']} | serving contract ({state_dtype} vk pool, 4 checkpoints / sequence) vs plain, "
          f"FlashInfer {env.get('flashinfer', '-')} | CUDA graphs, median")
    for row in rows:
        x = factory.get(row)
        try:
            r = _one_row(row, x, opts.timer, sdt, fi_op)
        except Exception as exc:  # a failing call is a row's result, not the run's end
            r = {"h_qk": row.heads.h_qk, "h_v": row.heads.h_v, "mix": row.mix.label, "T": row.mix.T,
                 "N": row.mix.N, "status": f"error: {type(exc).__name__}: {str(exc).splitlines()[0][:160]}"}
        r.update({f: env.get(f, "") for f in BASE_ENV_FIELDS + ("flashinfer",)}, commit=commit, date=S.now_utc())
        failed += r["status"] != "ok"
        S.append_row(csv_path, r, FIELDS)
        print(console_line(r), flush=True)
    pages = Path(opts.pages_dir)
    all_rows = [r for r in S.read_rows(csv_path) if r.get("commit") == commit and r.get("gpu") == env["gpu"]]
    md = pages / f"{prefix}.md"
    md.parent.mkdir(parents=True, exist_ok=True)
    md.write_text("\n".join(serving_markdown(all_rows, env, commit)) + "\n")
    print(f"wrote {csv_path} and {md}")
    return 1 if failed else 0


def _f(r, k) -> float:
    return S.num(r.get(k, ""))


def _ms(v: float) -> str:
    return "-" if v != v else f"{v:.3f}"


def console_line(r: dict) -> str:
    p, s = _f(r, "plain_ms"), _f(r, "serving_ms")
    over = f"{100 * (s / p - 1):+.1f}%" if p == p and s == s else "-"
    return (f"{r['h_qk']:>3}/{r['h_v']:<3} {r['mix']:<12} plain {_ms(p)} serving {_ms(s)} ({over}, {r.get('path', '-')}) "
            f"@fi {_ms(_f(r, 'serving_fi_ms'))} invariant {_ms(_f(r, 'serving_inv_ms'))} | FlashInfer plain {_ms(_f(r, 'fi_plain_ms'))} serving "
            f"{_ms(_f(r, 'fi_serving_ms'))} | {r.get('status')}")


def serving_markdown(rows: list[dict], env: dict, commit: str, method: list[str] | None = None) -> list[str]:
    """The `--serving` page: header, method, summary and one table row per benchmark row. `method`:
    the Method bullets to print (a rebuild keeps the measuring run's, `rebuild_serving`), else this
    code's."""
    L = [f"# Serving contract: ours vs FlashInfer ({env.get('gpu', '')})", "", "| | |", "| --- | --- |"]
    L += [f"| {f} | {env.get(f, '')} |" for f in BASE_ENV_FIELDS + ("flashinfer",)]
    dates = sorted(r.get("date", "") for r in rows)
    L += [f"| our commit | {commit} |", f"| date (UTC) | {dates[-1] if dates else ''} |", "", "## Method", ""]
    L += ["- " + line for line in method or (
        "Produced by `python -m flashqla.bench --serving` (`flashqla.bench.serving`); CUDA graphs, median of replays, "
        "after the gates.",
        "plain: ours with per-sequence fp32 states [N, HV, K, V]; serving: ours with a pool [2N, HV, V, K] in "
        f"{next((r['state_dtype'] for r in rows if r.get('state_dtype')), '')} (shuffled rows, `state_indices`, written in place) and "
        "4 checkpoints per sequence at its quarter points; @FI: ours at FlashInfer's checkpoint positions.",
        "FlashInfer: `chunk_gated_delta_rule(use_cp=\"auto\")`, plain as in the forward benchmark; serving with the "
        "same pool (`state_indices`, `output_state` = pool) and `checkpoint_every_n_tokens` = n (the largest multiple "
        "of 64 not above a quarter of the longest sequence; FlashInfer's period must be a multiple of 64).",
        "path: which of our serving paths ran (kernel: the recurrent kernel's serving build, one launch with the "
        "checkpoints; torch/split: the split plan around the plain split forward, whose run and transition launch "
        "stores each checkpoint's two parts; on sm_90 the pool's rows gathered, the two parts combined and stored, and "
        "the final states written back by one launch each (`kernels/sm90/pool_states.py`); torch/segments or "
        "torch/pieces: the checkpoints by extra forwards).",
        "batch_invariant: ours as serving with `batch_invariant=True` (no context-parallel split); "
        "its cost is its time over serving's. Gate: the row's last sequence, moved behind a 77-token padding sequence "
        "into a batch of two, gives bitwise the o, final state and checkpoints it gets in the row's batch.",
    )]
    ok = [r for r in rows if r.get("status") == "ok"]
    over = [_f(r, "serving_ms") / _f(r, "plain_ms") for r in ok]
    vs_fi = [_f(r, "fi_serving_ms") / _f(r, "serving_fi_ms") for r in ok if _f(r, "fi_serving_ms") > 0]
    kern = [_f(r, "serving_ms") / _f(r, "plain_ms") for r in ok if r.get("path") == "kernel"]
    L += ["", "## Summary", ""]
    if over:
        L.append(f"- serving over plain, geometric mean {100 * (geomean(over) - 1):+.1f}% over {len(over)} rows "
                 f"(worst {100 * (max(over) - 1):+.1f}%); {sum(o <= 1.03 for o in over)} of {len(over)} within the 3% goal")
    if kern:
        L.append(f"- rows on the kernel path: {len(kern)}, geometric mean {100 * (geomean(kern) - 1):+.1f}% "
                 f"(worst {100 * (max(kern) - 1):+.1f}%)")
    other = [_f(r, "serving_ms") / _f(r, "plain_ms") for r in ok if r.get("path") != "kernel"]
    if other:
        L.append(f"- rows on the torch path (the split plan): {len(other)}, geometric mean "
                 f"{100 * (geomean(other) - 1):+.1f}% (worst {100 * (max(other) - 1):+.1f}%)")
    inv = [(_f(r, "serving_inv_ms") / _f(r, "serving_ms"), r.get("path") == "kernel") for r in ok
           if _f(r, "serving_inv_ms") > 0]
    if inv:
        allr = [c for c, _ in inv]
        parts = [f"{name} {100 * (geomean(cs) - 1):+.1f}% over {len(cs)}" for name, cs in
                 (("kernel-path rows", [c for c, k in inv if k]), ("split-plan rows", [c for c, k in inv if not k]))
                 if cs]
        checked = sum(str(r.get("inv_bitwise")) == "True" for r in ok)
        L.append(f"- batch_invariant=True over the default serving call: geometric mean {100 * (geomean(allr) - 1):+.1f}% "
                 f"over {len(allr)} rows (worst {100 * (max(allr) - 1):+.1f}%; {'; '.join(parts)}); bitwise the same "
                 f"sequence moved to another batch on {checked} of {len(ok)} rows")
    if vs_fi:
        L.append(f"- FlashInfer serving / ours at the same checkpoints: geometric mean {geomean(vs_fi):.2f}x over "
                 f"{len(vs_fi)} rows (min {min(vs_fi):.2f}x, max {max(vs_fi):.2f}x; above 1: ours faster)")
    bad = [r for r in rows if r.get("status") != "ok"]
    if bad:
        L.append(f"- rows not timed: {len(bad)} ({'; '.join(r['h_qk'] + '/' + r['h_v'] + ' ' + r['mix'] + ': ' + r['status'] for r in bad)})")
    L += ["", "## Rows (ms)", "",
          "| heads | mix | plain | serving | overhead | path | ckpts ours / FI | serving @FI | batch_invariant | "
          "its cost | FlashInfer plain | FlashInfer serving | FI serving / ours @FI | err o | err ckpt vs FI |",
          "| --- | --- | ---: | ---: | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |"]
    for r in sorted(rows, key=lambda r: (int(r["h_v"]), int(r["h_qk"]), -int(r.get("N") or 0), r["mix"])):
        p, s, sf, si, fp, fs = (_f(r, f"{t}_ms") for t in TIMED)
        L.append(f"| {r['h_qk']}/{r['h_v']} | {r['mix']} | {_ms(p)} | {_ms(s)} | "
                 f"{(f'{100 * (s / p - 1):+.1f}%' if p == p and s == s else '-')} | {r.get('path', '')} | "
                 f"{r.get('ckpt_ours', '')} / {r.get('ckpt_fi', '')} | {_ms(sf)} | {_ms(si)} | "
                 f"{(f'{100 * (si / s - 1):+.1f}%' if si == si and s == s else '-')} | {_ms(fp)} | {_ms(fs)} | "
                 f"{(f'{fs / sf:.2f}x' if fs == fs and sf == sf else '-')} | {_e(r, 'err_o')} | {_e(r, 'err_ckpt_fi')} |")
    return L


def _e(r, k) -> str:
    v = _f(r, k)
    return "-" if v != v else f"{v:.1e}"


def rebuild_serving(results_dir, out_dir, prefix: str | None = None, commit: str | None = None) -> int:
    """`--serving --report-only`: the serving page rebuilt from `<prefix>.csv` in `results_dir` into
    `out_dir`: the rows of `commit` (default: the most recently measured one) on that row's GPU, with
    the Method bullets of the page of the same name in `results_dir` (the measuring run's; this code's
    when there is none). Returns 1 when the CSV has no such rows (nothing written), else 0."""
    from flashqla.bench.report import method_from_markdown

    results_dir, out_dir = Path(results_dir), Path(out_dir)
    if prefix is None:
        cands = sorted(p.stem for p in results_dir.glob("*-serving.csv"))
        if len(cands) != 1:
            raise SystemExit(f"--serving --report-only: {len(cands)} *-serving.csv in {results_dir} "
                             f"({', '.join(cands) or 'none'}); name one with --prefix")
        prefix = cands[0]
    rows = S.read_rows(results_dir / f"{prefix}.csv")
    key = S.latest_key(rows, commit)
    if key is None:
        print(f"no serving results in {results_dir / (prefix + '.csv')}" + (f" for commit {commit}" if commit else ""),
              file=sys.stderr)
        return 1
    env, commit = key
    rows = [r for r in rows if r.get("commit") == commit and r.get("gpu") == env["gpu"]]
    src = results_dir / f"{prefix}.md"
    method = method_from_markdown(src.read_text()) if src.exists() else None
    out_dir.mkdir(parents=True, exist_ok=True)
    md = out_dir / f"{prefix}.md"
    md.write_text("\n".join(serving_markdown(rows, env, commit, method or None)) + "\n")
    print(f"wrote {md}")
    return 0

# %% [markdown]
# # 70 · Benchmarks
#
# What `python -m flashqla.bench` measured on the H200 and committed to `benchmarks/results/`: our forward
# against FLA 0.6.0 and FlashQLA 0.1.3, timed in the same process on the same inputs with CUDA graphs, each
# implementation gated on its error against fp64 before it is timed (the method is in the results'
# markdown, printed below). This notebook reads whatever rows exist, says which implementations have not
# been timed yet, and draws three figures:
#
# 1. time per row, ours / FLA / FlashQLA;
# 2. each forward against the H200's roofline: the FLOP count of DESIGN.md section 6 (163,840 per token and
#    value head) over the bytes a fused forward cannot avoid (bf16 q, k, v, o; fp32 g, beta, states),
#    under the 726 TFLOP/s bf16 GEMM roof and the 4.0 TB/s copy roof;
# 3. FLA's forward kernel by kernel (its five launches, each timed alone on the previous ones' outputs)
#    against the whole fused forwards: where a five-kernel chain spends its time, and what fusion buys.
#
# Nothing here needs a GPU: it reads the committed CSVs (found from the repository, whatever the working
# directory) and writes its figures to `benchmarks/out/` (ignored by git). To refresh the committed
# figures, run it with `FLASHQLA_NB_FIGURES=benchmarks/results` (a folder, relative to the repository or
# absolute: the figures go there).
#
# reviewed: 2026-12-05 · `flashqla.bench.plots`, `flashqla.bench.report`, `benchmarks/results/`

# %%
import math
import os
import pathlib

import matplotlib

matplotlib.use("Agg")
from IPython.display import Image, Markdown, display

from flashqla.bench import plots
from flashqla.bench.config import OUT_DIR, REPO_ROOT, RESULTS_DIR
from flashqla.bench.grid import PEAK_TFLOPS, tflops
from flashqla.bench.impls import IMPLS, LABELS
from flashqla.bench.report import breakdown_markdown, geomean, method_from_markdown, speedup
from flashqla.bench.store import is_ok, num

RESULTS = RESULTS_DIR  # benchmarks/results of the repository this package is imported from
FIGURES = REPO_ROOT / pathlib.Path(os.environ.get("FLASHQLA_NB_FIGURES") or OUT_DIR)  # absolute stays absolute
FIGURES.mkdir(parents=True, exist_ok=True)
PREFIX = "h200-fwd"
rows, brows = plots.load(RESULTS, PREFIX)  # FileNotFoundError naming the CSV when it is missing
print(f"{RESULTS / (PREFIX + '.csv')}: {len(rows)} rows; breakdown: {len(brows)} step rows; figures go to {FIGURES}")
assert rows, f"{RESULTS / (PREFIX + '.csv')} has no benchmark rows: run python -m flashqla.bench on a Hopper GPU first"

# %% [markdown]
# ## What was measured, and what was not

# %%
md = RESULTS / f"{PREFIX}.md"
if md.exists():
    display(Markdown("\n".join(method_from_markdown(md.read_text()))))
else:
    print(f"{md} is missing: no method to show (it is written beside the CSV by the measuring run)")
runs = {}
for r in rows:  # one line per (environment, our commit) the rows come from
    env = tuple(r.get(k, "?") for k in ("gpu", "driver", "cuda", "torch", "triton", "tilelang", "fla", "flash_qla", "commit"))
    runs.setdefault(env, []).append(r.get("date", "?"))
for env, dates in runs.items():
    print("gpu {} (driver {}, CUDA {}), torch {}, triton {}, tilelang {}, fla {}, flash_qla {}; our commit {}: ".format(*env)
          + f"{len(dates)} rows, {min(dates)} .. {max(dates)}")

cov = plots.coverage(rows)
for impl, c in cov.items():
    if not c["has_columns"]:
        print(f"{LABELS[impl]:>9}: no columns in the CSV (this harness version did not measure it)")
    else:
        print(f"{LABELS[impl]:>9}: {c['ok']} rows timed, {c['failed']} failed the accuracy gate, {c['untimed']} not timed")
if cov["ours"]["ok"] == 0:
    print("\nOur forward has not been timed by the harness yet: every 'ours' column is empty, so the figures show "
          "the peers only and the speed-ups below are undefined.")

# %%
def fmt_ms(r, impl):
    return f"{num(r[f'{impl}_ms']):.3f}" if is_ok(r, impl) else (r.get(f"{impl}_status") or "not timed")


lines = ["| row | commit | T | N | " + " | ".join(f"{LABELS[i]} ms" for i in IMPLS) + " | "
         + " | ".join(f"{LABELS[i]} % of roofline" for i in IMPLS) + " | FlashQLA over FLA |",
         "|" + " --- |" * (4 + 2 * len(IMPLS) + 1)]
for r in rows:
    pct = [plots.roofline_pct(r, i) for i in IMPLS]
    s = speedup(r, "flash_qla", "fla")
    lines.append(f"| {plots.row_label(r)} | {r.get('commit', '?')} | {r['T']} | {r['N']} | " + " | ".join(fmt_ms(r, i) for i in IMPLS) + " | "
                 + " | ".join("-" if math.isnan(p) else f"{p:.1f}%" for p in pct) + " | "
                 + ("-" if math.isnan(s) else f"{s:.2f}x") + " |")
display(Markdown("\n".join(lines)))

# %% [markdown]
# ## Time per row

# %%
p_times = plots.plot_times(rows, FIGURES / f"{PREFIX}-times.png")
display(Image(p_times))

# %% [markdown]
# ## Against the roofline
# Every row sits near the ridge point (726 / 4.0 = 181 FLOP per byte): a fused forward that only moves its
# inputs and outputs could be compute bound. What each implementation reaches of its row's roof:

# %%
p_roof = plots.plot_roofline(rows, FIGURES / f"{PREFIX}-roofline.png")
if p_roof is None:
    print("no implementation timed on any row: no roofline to draw")
else:
    display(Image(p_roof))
for impl in IMPLS:
    pcts = [plots.roofline_pct(r, impl) for r in rows if is_ok(r, impl)]
    if pcts:
        print(f"{LABELS[impl]:>9}: {min(pcts):.1f} .. {max(pcts):.1f}% of the roofline over {len(pcts)} rows")
    else:
        print(f"{LABELS[impl]:>9}: not timed")

# %% [markdown]
# ## FLA's five kernels against fused forwards

# %%
p_break = plots.plot_breakdown(brows, rows, FIGURES / f"{PREFIX}-breakdown.png")
if p_break is None:
    print(f"no FLA breakdown in {RESULTS / (PREFIX + '-breakdown.csv')}")
else:
    display(Image(p_break))
    display(Markdown("\n".join(breakdown_markdown(brows, rows))))

# %% [markdown]
# ## Claims on the measured rows

# %%
# every timed result passed the accuracy gate first (the harness never times a failing implementation)
for r in rows:
    for impl in IMPLS:
        if is_ok(r, impl):
            assert num(r[f"{impl}_err_o"]) <= 0.02 and num(r[f"{impl}_err_ht"]) <= 0.02, (plots.row_label(r), impl)
# no implementation beats the roofline (the FLOP and byte counts are lower bounds of the real work)
for r in rows:
    for impl in IMPLS:
        if is_ok(r, impl):
            assert plots.roofline_pct(r, impl) <= 100.0, (plots.row_label(r), impl)
            assert tflops(num(r[f"{impl}_ms"]), int(r["T"]), int(r["h_v"])) <= PEAK_TFLOPS
# FLA's five steps, each timed alone, add up to its whole forward (a serial chain, within 10%)
for key in {(b["h_qk"], b["h_v"], b["mix"]) for b in brows}:
    steps = sum(num(b["ms"]) for b in brows if (b["h_qk"], b["h_v"], b["mix"]) == key and b["step"] in plots.STEP_NAMES)
    r = next((r for r in rows if (r["h_qk"], r["h_v"], r["mix"]) == key), None)
    if r is not None and is_ok(r, "fla"):
        assert abs(steps - num(r["fla_ms"])) <= 0.1 * num(r["fla_ms"]), (key, steps, r["fla_ms"])
# speed-ups are reported only where both sides were timed
fq = [speedup(r, "flash_qla", "fla") for r in rows]
print(f"FlashQLA over FLA, geometric mean over {sum(not math.isnan(s) for s in fq)} rows: {geomean(fq):.2f}x")
ours = [speedup(r, "ours", "fla") for r in rows]
if any(not math.isnan(s) for s in ours):
    print(f"ours over FLA: {geomean(ours):.2f}x; ours over FlashQLA: {geomean([speedup(r, 'ours', 'flash_qla') for r in rows]):.2f}x")
else:
    print("ours over FLA / FlashQLA: not measured yet (no timed 'ours' row)")
assert all(math.isnan(s) for r, s in zip(rows, ours) if not is_ok(r, "ours"))

# %% [markdown]
# ## Conclusions (asserted above, on whatever rows exist)
# - Every timed result passed the fp64 accuracy gate before it was timed; no timing exceeds its row's
#   roofline (both counts are lower bounds of the real work, so a point above the roof would be a
#   measurement error).
# - FLA's forward is a serial chain: its five kernels, timed alone, add up to its whole forward within 10%.
#   The breakdown table above shows how much of that is the HBM round trip of intermediates that a fused
#   kernel keeps on chip.
# - Speed-ups are printed only over rows where both implementations were timed; rows where ours has not
#   been timed are named in the coverage lines and marked "no ours" in the figures. Rerun this notebook
#   after `python -m flashqla.bench` adds rows.

"""Question: how many SM clock cycles does each phase of one prepare CTA take (locate_slot, the k
tile's load, the cumsum, K K^T, then per value head L, the wait for the previous head's A store, the
forward substitution, product phases 1-3, the store issue), and how many CTAs share an SM while it
runs? Nsight Compute says the kernel is latency-bound (35% issue slots busy, stalls on CTA barriers
and fixed latency); this is the per-phase budget a redesign starts from.

Per row, on the same packed inputs (`_gpu.gen_inputs`: bf16 k, fp32 beta, int32 offsets, gates
clamped as the op does), the shipped prepare build and its phase-clock build
(`prepare.build_prepare_kernel_clocked`, the same static key `prepare_kernel_args` picks, one value
head a CTA where `pick_heads_per_cta` says so):

1. both once: A and g_cum_log2 must be equal bit for bit (the instrumentation changes no result);
2. the CUDA-graph time of each (`flashqla.bench.timing.time_cuda_graph`, median; L2 flushed);
3. the clocked build `--warmup` times, then `--reps` times, each after a 256 MB memset that evicts
   the L2 and with its `clocks` output reset to -1; per phase (the interval between two stamps,
   `prepare.clock_stamps`; `*`: both ends right after a CTA barrier, `prepare.CLOCK_ALIGNED`, the
   others end at thread 0's own progress) the median and p90 in cycles over the CTAs of all reps
   that have work (empty slots only locate themselves). Head phases: value head 0, and heads 1.. pooled;
   the tail is the last store issue to the end (the final store wait and the g_cum_log2 stores);
4. residency, from each SM's own clock (`%smid`; clock64 is not comparable across SMs): the share of
   SM busy time with 1, 2, 3, 4.. CTAs resident, and per CTA the number of CTAs on its SM whose
   [start, end] overlaps its own (itself included; median); the SM clock in GHz (clock64 cycles over
   `%globaltimer` ns per SM busy span) and the kernel span by globaltimer.

    python benchmarks/experiments/prepare_phase_clock.py [--rows "16/32 4x8192,2/8 1x8192"] [--reps 5]

On a machine without a GPU, `--precompile-only` builds both kernels of every row into TileLang's
disk cache (worker processes, nvcc for sm_90a), to be packed for the GPU machine:

    TILELANG_CACHE_DIR=/tmp/tlcache python benchmarks/experiments/prepare_phase_clock.py --precompile-only
    TILELANG_CACHE_DIR=/tmp/tlcache python tests/gpu/precompile.py --pack .device/tilelang-cache.tar.xz

Rows: "h_qk/h_v COUNTxLENGTH" (this folder's notation, `_gpu.parse_row`). Prints one section per row,
then a compact markdown table (medians in cycles). Writes no file.
"""

from __future__ import annotations

import argparse
import os
import sys
import time

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

from _gpu import gen_inputs, parse_row  # noqa: E402

ROWS = "16/32 4x8192,32/32 8x1024,16/64 4x8192,2/8 1x8192"


def row_key(H: int, HV: int, lengths: list) -> tuple:
    """The prepare kernel's static key (`prepare.prepare_kernel_args`) for packed bf16 input of these
    lengths, from shapes only (meta tensors: no GPU)."""
    from flashqla.ops.gdn.kernels.sm90.prepare import prepare_kernel_args

    T = sum(lengths)
    k = torch.empty(1, T, H, 128, dtype=torch.bfloat16, device="meta")
    beta = torch.empty(1, T, HV, dtype=torch.float32, device="meta")
    cu = torch.empty(len(lengths) + 1, dtype=torch.int32, device="meta")
    return prepare_kernel_args(k, beta, cu, HV)


def heads_per_cta(key: tuple) -> int:
    """Value heads one CTA of the build with this key takes (the key's eighth entry is 1 for one
    value head a CTA, else all HV / H)."""
    return 1 if len(key) > 7 and key[7] == 1 else key[1] // key[0]


def _build(spec) -> str:
    """Worker of --precompile-only: builds ("default" | "clocked", key) into the disk cache."""
    from flashqla.ops.gdn.kernels.sm90 import prepare as P

    which, key = spec
    (P.build_prepare_kernel_clocked if which == "clocked" else P.build_prepare_kernel)(*key)
    return f"{which} {key}"


def precompile(rows: list, workers: int) -> None:
    """Builds the default and the clocked prepare kernel of every row, in `workers` processes."""
    import multiprocessing as mp
    from concurrent.futures import ProcessPoolExecutor

    specs = list(dict.fromkeys((which, row_key(*parse_row(r))) for r in rows for which in ("default", "clocked")))
    t = time.time()
    with ProcessPoolExecutor(max(1, min(workers, len(specs))), mp_context=mp.get_context("spawn")) as ex:
        for done in ex.map(_build, specs):
            print(f"built {done} ({time.time() - t:.0f} s)", flush=True)
    from tilelang import env

    print(f"precompiled {len(specs)} kernels in {time.time() - t:.0f} s into "
          f"{os.environ.get('TILELANG_CACHE_DIR') or env.TILELANG_CACHE_DIR}")


def phases(P: int) -> list:
    """[(label, from stamp, to stamp, head group)] in a CTA's order; head group None (once a CTA),
    0 (value head 0) or 1 (heads 1 .. P - 1, pooled). A label ends with * where both stamps are
    barrier-aligned."""
    from flashqla.ops.gdn.kernels.sm90.prepare import CLOCK_ALIGNED, CLOCK_HEAD

    def label(name, a, b):
        return name + ("*" if a.split(".")[-1] in CLOCK_ALIGNED and b.split(".")[-1] in CLOCK_ALIGNED else "")

    out = [(label(n, a, b), a, b, None) for n, a, b in (("locate", "start", "located"), ("k_ready", "located", "k_ready"),
                                                        ("cumsum", "k_ready", "cumsum"), ("kkt", "cumsum", "kkt"))]
    for j in range(P):
        prev = "kkt" if j == 0 else f"h{j - 1}.store_issue"
        for name in CLOCK_HEAD:
            out.append((label(name, prev, name), prev, f"h{j}.{name}", min(j, 1)))
            prev = f"h{j}.{name}"
    out.append(("tail", f"h{P - 1}.store_issue", "end", None))
    out.append(("lifetime", "start", "end", None))
    return out


def phase_stats(runs: list, P: int) -> list:
    """[(label, group, median, p90, count)] over the CTAs with work of every run (each [CTAs, stamps]
    int64; a CTA with work has its k_ready stamp)."""
    import numpy as np

    from flashqla.ops.gdn.kernels.sm90.prepare import clock_stamps

    idx = {n: i for i, n in enumerate(clock_stamps(P))}
    c = np.concatenate(runs)
    c = c[c[:, idx["k_ready"]] >= 0]
    pooled: dict = {}
    for lab, a, b, grp in phases(P):
        d = (c[:, idx[b]] - c[:, idx[a]]).astype(np.float64)
        pooled.setdefault((lab, grp), []).append(d)
    out = []
    for (lab, grp), ds in pooled.items():
        d = np.concatenate(ds)
        out.append((lab, grp, float(np.median(d)), float(np.percentile(d, 90)), len(d)))
    return out


def residency(runs: list, P: int) -> dict:
    """Per SM (its own clock64): the share of busy time with n CTAs resident ({n: fraction}), the
    median over CTAs of the CTAs overlapping it on its SM, the SM clock (GHz, busy cycles over busy
    globaltimer ns, median over SMs) and the kernel span by globaltimer (us, median over runs)."""
    import numpy as np

    from flashqla.ops.gdn.kernels.sm90.prepare import clock_stamps

    idx = {n: i for i, n in enumerate(clock_stamps(P))}
    busy: dict = {}
    overlap, ghz, spans = [], [], []
    for c in runs:
        spans.append((c[:, idx["gt_end"]].max() - c[:, idx["gt_start"]].min()) / 1e3)
        for sm in np.unique(c[:, idx["smid"]]):
            s = c[c[:, idx["smid"]] == sm]
            st, en = s[:, idx["start"]], s[:, idx["end"]]
            # CTAs overlapping each CTA's [start, end] on this SM (itself included)
            overlap += list(((st[None, :] <= en[:, None]) & (en[None, :] >= st[:, None])).sum(1))
            ev = sorted([(t, 1) for t in st] + [(t, -1) for t in en])
            level, last = 0, ev[0][0]
            for t, step in ev:
                if level > 0:
                    busy[level] = busy.get(level, 0) + (t - last)
                level, last = level + step, t
            ns = s[:, idx["gt_end"]].max() - s[:, idx["gt_start"]].min()
            if ns > 0:
                ghz.append((en.max() - st.min()) / ns)
    total = sum(busy.values()) or 1
    return dict(share={n: busy[n] / total for n in sorted(busy)}, overlap=float(np.median(overlap)),
                ghz=float(np.median(ghz)) if ghz else float("nan"), span_us=float(np.median(spans)))


def run_row(row: str, reps: int, warmup: int) -> dict:
    """Builds, checks, times and clocks one row; prints its section; returns its summary."""
    import numpy as np

    from flashqla.bench.timing import time_cuda_graph
    from flashqla.contract import clamp_gates
    from flashqla.ops.gdn.kernels.sm90 import prepare as P
    from flashqla.ops.gdn.kernels.sm90._common import CHUNK, num_slots

    H, HV, lengths = parse_row(row)
    x = gen_inputs(H, HV, lengths, varlen=True, h0=False)
    k, beta, cu = x["k"], x["beta"], x["cu_seqlens"]
    g = clamp_gates(x["g"])
    del x
    key = row_key(H, HV, lengths)
    Ph = heads_per_cta(key)
    kd, kc = P.build_prepare_kernel(*key), P.build_prepare_kernel_clocked(*key)
    S = num_slots(1, k.shape[1], len(lengths), True)
    out = [(torch.zeros(HV, S * CHUNK, CHUNK, dtype=k.dtype, device="cuda"),
            torch.zeros(HV, S * CHUNK, dtype=torch.float32, device="cuda")) for _ in range(2)]
    clocks = torch.full((S, HV // Ph, len(P.clock_stamps(Ph))), -1, dtype=torch.int64, device="cuda")
    kd(k, g, beta, cu, *out[0])
    kc(k, g, beta, cu, *out[1], clocks)
    torch.cuda.synchronize()
    same = all(torch.equal(a.view(torch.int16 if a.element_size() == 2 else torch.int32),
                           b.view(torch.int16 if b.element_size() == 2 else torch.int32)) for a, b in zip(*out))
    assert same, f"{row}: the clocked build's A or g_cum_log2 differs from the default build's"
    ms_d = time_cuda_graph(lambda: kd(k, g, beta, cu, *out[0])).ms
    ms_c = time_cuda_graph(lambda: kc(k, g, beta, cu, *out[1], clocks)).ms

    flush = torch.empty(256 * 2**20, dtype=torch.uint8, device="cuda")
    for _ in range(warmup):
        kc(k, g, beta, cu, *out[1], clocks)
    runs = []
    for _ in range(reps):
        flush.zero_()
        clocks.fill_(-1)
        kc(k, g, beta, cu, *out[1], clocks)
        torch.cuda.synchronize()
        runs.append(clocks.view(-1, clocks.shape[-1]).cpu().numpy())
    stats = phase_stats(runs, Ph)
    res = residency(runs, Ph)
    worked = int((runs[0][:, P.clock_stamps(Ph).index("k_ready")] >= 0).sum())

    print(f"\n## {row}: key {key}, {Ph} value head(s) a CTA, {S * (HV // Ph)} CTAs ({worked} with work), "
          f"A and g_cum_log2 bitwise equal")
    print(f"default {ms_d * 1e3:.1f} us, clocked {ms_c * 1e3:.1f} us (CUDA graph); clocked span by globaltimer "
          f"{res['span_us']:.1f} us (L2 flushed); SM clock {res['ghz']:.3f} GHz")
    print("resident CTAs, share of SM busy time: " + ", ".join(f"{n}: {f:.1%}" for n, f in res["share"].items())
          + f"; CTAs overlapping a CTA on its SM (median) {res['overlap']:g}")
    print("| phase | heads | median cyc | p90 cyc | samples |")
    print("| --- | --- | ---: | ---: | ---: |")
    for lab, grp, med, p90, n in stats:
        heads = "" if grp is None else ("h0" if grp == 0 else f"h1..h{Ph - 1}")
        print(f"| {lab} | {heads} | {med:.0f} | {p90:.0f} | {n} |")
    med = {(lab.rstrip("*"), grp): m for lab, grp, m, _, _ in stats}
    return dict(row=row, P=Ph, ctas=S * (HV // Ph), ms_d=ms_d, ms_c=ms_c, med=med, res=res)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default=ROWS)
    ap.add_argument("--reps", type=int, default=5, help="clocked launches whose stamps are pooled")
    ap.add_argument("--warmup", type=int, default=3, help="clocked launches before them")
    ap.add_argument("--precompile-only", action="store_true", help="build both kernels of every row (no GPU) and exit")
    ap.add_argument("--workers", type=int, default=2, help="with --precompile-only: worker processes")
    a = ap.parse_args(argv)
    rows = [r.strip() for r in a.rows.split(",") if r.strip()]
    if a.precompile_only:
        precompile(rows, a.workers)
        return 0
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("needs a CUDA GPU of compute capability 9.0 (Hopper); --precompile-only builds without one", file=sys.stderr)
        return 1
    from flashqla.ops.gdn.kernels.sm90.prepare import CLOCK_HEAD

    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | reps {a.reps}")
    done = [run_row(r, a.reps, a.warmup) for r in rows]

    cols = ["locate", "k_ready", "cumsum", "kkt"] + list(CLOCK_HEAD) + ["tail", "lifetime"]
    print("\n## summary: median cycles over CTAs (head phases: value head 0 / heads 1.. where a CTA has several)")
    print("| row | heads/CTA | CTAs | default us | clocked us | GHz | resident (med) | " + " | ".join(cols) + " |")
    print("| --- | ---: | ---: | ---: | ---: | ---: | ---: | " + " | ".join("---:" for _ in cols) + " |")
    for d in done:
        cells = []
        for c in cols:
            if c in CLOCK_HEAD:
                v = [d["med"].get((c, grp)) for grp in (0, 1)]
                cells.append(" / ".join(f"{x:.0f}" for x in v if x is not None))
            else:
                cells.append(f"{d['med'][(c, None)]:.0f}")
        print(f"| {d['row']} | {d['P']} | {d['ctas']} | {d['ms_d'] * 1e3:.1f} | {d['ms_c'] * 1e3:.1f} | "
              f"{d['res']['ghz']:.2f} | {d['res']['overlap']:g} | " + " | ".join(cells) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())

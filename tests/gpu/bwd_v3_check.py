"""One call on the GPU machine: pass 2 of the backward, variant "v3" (pass 2a `kernels/sm90/dh_bwd.py`,
the state-gradient chain; pass 2b `kernels/sm90/chunk_bwd_v3.py`, every other gradient chunk-parallel),
against the default "v2", for correctness and speed.

    python tests/gpu/bwd_v3_check.py [--precompile] [--cases NAME ...] [--rows ROW ...] [--cpc N ...] [--out DIR]

1. --precompile builds the kernels used below in worker processes first (TileLang's disk cache).
2. Correctness, per case of `bwd_v2_check.CASES` (try/except: a failing case is printed and the run
   goes on): the forward, pass 1, pass 2 with v2, and twice with v3 on NaN-filled outputs (dh, dh0
   and every gradient: an element v3 fails to write shows up), each time with a different number
   of chunks per CTA (the first of --cpc, then 1); pass 3 on each. Per gradient: v3 against v2
   (relative RMS, bitwise), v3 repeatable across the two chunk groupings (bitwise), all finite,
   both against the fp64 reference; the packed-tail case checks that the tail's gradients are 0.
3. Speed, per row: CUDA-graph medians of pass 2 alone (v2; v3 = 2a + 2b with each --cpc; 2a and
   2b alone) and of the whole backward with cp off and cp auto, v2 against v3 (best cpc).
A compact table is printed last; everything goes to bwd_v3_check.json in --out. Not collected by
pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from flashqla.testing import rel_rms  # noqa: E402
from tests.gpu.bwd_v2_check import CASES, NAMES, SCALE, _case, _reference  # noqa: E402
from tests.gpu.device_check import gen_inputs, time_graph  # noqa: E402


def _rows():
    from flashqla.bench.bwd_grid import bwd_mix

    return {  # name: (H, HV, lengths, packed)
        "4/8 8k_8seq": (4, 8, list(bwd_mix(8192, 8).lengths), True),
        "8/16 8k_4seq": (8, 16, list(bwd_mix(8192, 4).lengths), True),
        "16/32 8k_8seq": (16, 32, list(bwd_mix(8192, 8).lengths), True),
        "16/32 4x8192": (16, 32, [8192] * 4, False),
        "2/4 1x32768": (2, 4, [32768], False),
        "16/32 1x32768": (16, 32, [32768], False),
    }


def _pass2_v3_poisoned(q, k, v, beta, A, gcl, h, do, dht, cu, cpc):
    """Pass 2a and 2b launched on NaN-filled outputs (dG too: pass 3 reads only rows 2b writes)."""
    from flashqla.ops.gdn.kernels.sm90._common import CHUNK, num_slots
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_bwd_kernel_args
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v3 import build_chunk_bwd_v3_kernel
    from flashqla.ops.gdn.kernels.sm90.dh_bwd import build_dh_kernel, dh_kernel_args
    from flashqla.ops.gdn.kernels.sm90.prepare import dummy_cu_seqlens

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu.numel() - 1 if cu is not None else B
    S = num_slots(B, T, N, cu is not None)
    nan = float("nan")
    dev = dict(device="cuda")
    dh = torch.full((S * HV, K, V), nan, dtype=q.dtype, **dev)
    dh0 = torch.full((N, HV, K, V), nan, **dev)
    cuk = cu if cu is not None else dummy_cu_seqlens("cuda")
    dht_arg = dht if dht is not None else torch.empty(1, HV, K, V, **dev)
    build_dh_kernel(*dh_kernel_args(q, v, cu))(q, k, do, A, gcl, dht_arg, cuk, float(SCALE), int(dht is not None), dh, dh0)
    dq_hv = torch.full((B, T, HV, K), nan, **dev)
    dk_hv = torch.full((B, T, HV, K), nan, **dev)
    dv = torch.full_like(v, nan)
    dbeta = torch.full((B, T, HV), nan, **dev)
    dG = torch.full((HV, S * CHUNK), nan, **dev)
    build_chunk_bwd_v3_kernel(*chunk_bwd_kernel_args(q, v, beta, h, cu))(
        q, k, v, beta, A, gcl, h, do, dh, cuk, float(SCALE), int(cpc), dq_hv, dk_hv, dv, dbeta, dG)
    return dq_hv, dk_hv, dv, dbeta, dG, dh0


def _backward(xd, f, h, variant, cpc=None):
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_fused_bwd
    from flashqla.ops.gdn.kernels.sm90.finish_bwd import chunk_finish_bwd

    args = (f.q, f.k, xd["v"], xd["beta"], f.A, f.g_cum_log2, h, xd["do"], xd["dht"])
    if variant == "v3":
        p2 = _pass2_v3_poisoned(*args, xd["cu_seqlens"], cpc)
    else:
        p2 = chunk_fused_bwd(*args, SCALE, xd["cu_seqlens"], variant=variant)
    dq_hv, dk_hv, dv, dbeta, dG, dh0 = p2
    dq, dk, dg = chunk_finish_bwd(dG, dq_hv, dk_hv, xd["cu_seqlens"], f.q.shape[2], f.q.dtype)
    return dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dh0=dh0)


def check_case(name, kw, seed, cpc):
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd

    xd, h_dtype, t_end = _case(seed, **kw)
    f = chunk_gated_delta_rule_fwd(xd["q"], xd["k"], xd["v"], xd["g"], xd["beta"], SCALE, xd["initial_state"], True,
                                   xd["cu_seqlens"])
    h = chunk_states_bwd(f.k, xd["v"], f.A, f.g_cum_log2, xd["initial_state"], xd["cu_seqlens"], h_dtype)
    g2 = _backward(xd, f, h, "v2")
    g3 = _backward(xd, f, h, "v3", cpc)
    g3b = _backward(xd, f, h, "v3", 1)
    torch.cuda.synchronize()
    ref = _reference(xd, t_end)
    row = {"case": name}
    for n in NAMES:
        a, b, c = g2[n], g3[n], g3b[n]
        row[f"{n}_finite"] = bool(torch.isfinite(b.float()).all()) and bool(torch.isfinite(c.float()).all())
        row[f"{n}_bitwise_v2"] = bool(torch.equal(a, b))
        row[f"{n}_repeat"] = bool(torch.equal(b, c))
        row[f"{n}_rel_v2"] = rel_rms(b, a) if a.numel() and bool(a.double().abs().max() > 0) else 0.0
        r = ref[n]
        if t_end is not None and n != "dh0":
            a, b = a[:, :t_end], b[:, :t_end]
            tail = g3[n][:, t_end:]
            row[f"{n}_tail_zero"] = bool(torch.isfinite(tail.float()).all()) and not bool(tail.any())
        row[f"{n}_ref_v2"] = rel_rms(a, r) if r is not None and bool(r.abs().max() > 0) else None
        row[f"{n}_ref_v3"] = rel_rms(b, r) if r is not None and bool(r.abs().max() > 0) else None
    return row


def time_eager(fn, reps=10):
    """Median ms of `reps` eager calls, each synchronised (CUDA events), after two warm calls."""
    fn()
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        fn()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b))
    times.sort()
    return times[len(times) // 2]


def time_row(name, H, HV, lengths, packed, cpcs, time_graph=time_graph):
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
    from flashqla.ops.gdn.kernels.sm90 import chunk_bwd, chunk_bwd_v3
    from flashqla.ops.gdn.kernels.sm90.dh_bwd import chunk_dh_bwd
    from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd

    x = gen_inputs(H, HV, lengths, packed)
    gen = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(x["v"].shape, device="cuda", generator=gen).to(x["v"].dtype)
    N = len(lengths) if packed else x["v"].shape[0]
    dht = torch.randn(N, HV, 128, 128, device="cuda", generator=gen)
    f = chunk_gated_delta_rule_fwd(**x, output_final_state=True)
    h = chunk_states_bwd(f.k, x["v"], f.A, f.g_cum_log2, x["initial_state"], x["cu_seqlens"], torch.bfloat16)
    cu = x["cu_seqlens"]
    args = (f.q, f.k, x["v"], x["beta"], f.A, f.g_cum_log2, h, do, dht, SCALE, cu)
    row = {"row": name}
    row["t_states"] = time_graph(lambda: chunk_states_bwd(f.k, x["v"], f.A, f.g_cum_log2, x["initial_state"], cu, torch.bfloat16))
    row["t_p2_v2"] = time_graph(lambda: chunk_bwd.chunk_fused_bwd(*args, variant="v2"))
    row["t_p2a"] = time_graph(lambda: chunk_dh_bwd(f.q, f.k, do, f.A, f.g_cum_log2, dht, SCALE, cu))
    dh, _ = chunk_dh_bwd(f.q, f.k, do, f.A, f.g_cum_log2, dht, SCALE, cu)
    best = None
    for cpc in cpcs:
        t = time_graph(lambda: chunk_bwd_v3.chunk_grads_v3(f.q, f.k, x["v"], x["beta"], f.A, f.g_cum_log2, h, dh, do, SCALE,
                                                           cu, cpc))
        row[f"t_p2b_cpc{cpc}"] = t
        if best is None or t < row[f"t_p2b_cpc{best}"]:
            best = cpc
    row["best_cpc"] = best
    saved_v, saved_c = chunk_bwd.DEFAULT_VARIANT, chunk_bwd_v3.DEFAULT_CPC
    try:
        chunk_bwd_v3.DEFAULT_CPC = best
        for variant in ("v2", "v3"):
            chunk_bwd.DEFAULT_VARIANT = variant
            for cp in ("off", "auto"):
                row[f"t_bwd_{variant}_{cp}"] = time_graph(lambda: chunk_gated_delta_rule_bwd(
                    f.q, f.k, x["v"], x["g"], x["beta"], f.A, f.g_cum_log2, do, dht, SCALE, x["initial_state"], cu, cp=cp,
                    max_seqlen=max(lengths)))
    finally:
        chunk_bwd.DEFAULT_VARIANT, chunk_bwd_v3.DEFAULT_CPC = saved_v, saved_c
    row["ctas_v2"] = N * HV
    row["chunks"] = sum((t + 63) // 64 for t in lengths) * HV
    return row


def precompile(rows, cases):
    from flashqla.ops.gdn.kernels.sm90 import op_kernel_specs
    from flashqla.ops.gdn.kernels.sm90 import precompile as pc

    configs = set()
    for H, HV, lengths, packed in rows.values():
        configs.add((H, HV, len(lengths), packed, "bfloat16"))
    for kw in cases.values():
        packed = "lengths" in kw
        N = len(kw["lengths"]) if packed else kw.get("B", 1)
        hd = "float32" if kw.get("h_dtype") is torch.float32 else "bfloat16"
        configs.add((kw["H"], kw["HV"], N, packed, hd))
    specs = []
    for H, HV, N, packed, hd in sorted(configs):
        s = op_kernel_specs(H, HV, N=N, varlen=packed, h_dtype=hd)
        specs += s
        specs += [(kind, args + (v,)) for kind, args in s if kind == "chunk_bwd" for v in ("v2", "v3")]
    t = time.time()
    pc(specs, max_workers=min(len(set(specs)), os.cpu_count() or 8))
    dt = time.time() - t
    print(f"precompiled {len(set(specs))} kernels in {dt:.1f} s", flush=True)
    return dt


def _dump(out, d):
    with open(os.path.join(d, "bwd_v3_check.json"), "w") as fh:
        json.dump(out, fh, indent=1)


def _fmt(v, f="{:.1e}"):
    return "-" if v is None else (f.format(v) if isinstance(v, float) else str(v))


def main():
    rows_all = _rows()
    ap = argparse.ArgumentParser()
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--rows", nargs="*", default=list(rows_all))
    ap.add_argument("--cpc", nargs="*", type=int, default=[1, 2, 4, 8])
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--eager", action="store_true", help="time eager synchronised calls instead of CUDA graphs")
    a = ap.parse_args()
    import faulthandler

    faulthandler.dump_traceback_later(float(os.environ.get("HANG_S", "120")), repeat=True)
    t_start = time.time()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "cases": [], "rows": [], "errors": []}
    rows = {r: rows_all[r] for r in a.rows}
    cases = {c: CASES[c] for c in a.cases}
    if a.precompile:
        try:
            out["precompile_s"] = precompile(rows, cases)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            out["errors"].append(f"precompile: {type(exc).__name__}: {exc}")

    cpc0 = a.cpc[-1] if a.cpc[-1] != 1 else 2
    for i, (name, kw) in enumerate(cases.items()):
        try:
            r = check_case(name, kw, seed=100 + i, cpc=cpc0)
            out["cases"].append(r)
            print(name, "done", flush=True)
            _dump(out, a.out)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            out["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()

    for name, (H, HV, lengths, packed) in rows.items():
        try:
            r = time_row(name, H, HV, lengths, packed, a.cpc, **(dict(time_graph=time_eager) if a.eager else {}))
            out["rows"].append(r)
            _dump(out, a.out)
            print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            out["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        torch.cuda.empty_cache()

    out["wall_s"] = time.time() - t_start
    with open(os.path.join(a.out, "bwd_v3_check.json"), "w") as fh:
        json.dump(out, fh, indent=1)

    print(f"\n== v3 (cpc {cpc0}, repeat with cpc 1) against v2 (rel RMS; '=' bitwise) and fp64 (v2 / v3 rel RMS); "
          "ok = finite, repeatable, tail zero")
    print(f"{'case':30s} " + " ".join(f"{n:>21s}" for n in NAMES) + "  ok")
    for r in out["cases"]:
        cells = []
        for n in NAMES:
            vs = "=" if r[f"{n}_bitwise_v2"] else _fmt(r[f"{n}_rel_v2"])
            cells.append(f"{vs:>7s} {_fmt(r[f'{n}_ref_v2']):>6s}/{_fmt(r[f'{n}_ref_v3']):>6s}")
        ok = all(r[f"{n}_finite"] and r[f"{n}_repeat"] and r.get(f"{n}_tail_zero", True) for n in NAMES)
        print(f"{r['case'][:30]:30s} " + " ".join(f"{c:>21s}" for c in cells) + f"  {ok}")
    print("\n== ms, CUDA graphs, median: pass 1; pass 2 (v2; v3 = 2a + 2b at the best cpc); whole backward cp off / auto")
    print(f"{'row':15s} {'p1':>6s} {'p2 v2':>7s} {'2a':>6s} {'2b':>6s} {'cpc':>3s} {'p2 v3':>6s} "
          f"{'bwd v2 off':>10s} {'v3 off':>7s} {'v2 auto':>8s} {'v3 auto':>8s}")
    for r in out["rows"]:
        b = r[f"t_p2b_cpc{r['best_cpc']}"]
        print(f"{r['row']:15s} {r['t_states']:6.3f} {r['t_p2_v2']:7.3f} {r['t_p2a']:6.3f} {b:6.3f} {r['best_cpc']:3d} "
              f"{r['t_p2a'] + b:6.3f} {r['t_bwd_v2_off']:10.3f} {r['t_bwd_v3_off']:7.3f} {r['t_bwd_v2_auto']:8.3f} "
              f"{r['t_bwd_v3_auto']:8.3f}")
    for e in out["errors"]:
        print("ERROR", e[:300])


if __name__ == "__main__":
    main()

"""One call on the GPU machine: pass 2 of the backward, variant "v2" (`kernels/sm90/chunk_bwd_v2.py`),
against the default "v1" (`chunk_bwd.py`), for correctness and speed.

    python tests/gpu/bwd_v2_check.py [--precompile] [--cases NAME ...] [--rows ROW ...] [--out DIR]

1. --precompile builds every kernel used below (v1 and v2 of pass 2, the forward, passes 1 and 3)
   in worker processes first (TileLang's disk cache).
2. Correctness, per case (try/except: a failing case is printed and the run goes on): the forward
   once, pass 1 once, then pass 2 with v1 (its own zero-filled outputs) and twice with v2 on
   outputs filled with NaN (every element v2 fails to write shows up), pass 3 on each. Printed
   per gradient (dq dk dv dg dbeta dh0): v2 against v1 (max |diff|, relative RMS, bitwise equal),
   v2 bitwise repeatable, all finite, and both against the fp64 reference (relative RMS; as
   tests/gpu/test_bwd_gpu.py `_reference`). The packed-tail case also checks that every gradient
   of the tokens past cu_seqlens[-1] is exactly zero.
3. Speed, per row: CUDA-graph medians of pass 2 alone (each variant with its own output
   allocation: v1 zero-fills, v2 does not) and of the whole backward
   (`flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd`, h bf16), v1 against v2.
A compact table is printed last; everything goes to bwd_v2_check.json in --out. Not collected by
pytest.

--base V --new W compare other pass-2 variants the same way (e.g. `--base v2 --new v5` for a new
kernel added to `chunk_bwd.VARIANTS`): the columns and JSON keys keep the names v1 (base) and v2
(new). Each case and row runs under a watchdog (HANG_S seconds, default 120; faulthandler dumps the
stacks and exits) and the JSON is rewritten after each.
"""

from __future__ import annotations

import argparse
import faulthandler
import json
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from flashqla.testing import add_cotangents, make_gdn_inputs, rel_rms  # noqa: E402
from tests.gpu.device_check import gen_inputs, time_graph  # noqa: E402

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
#: The variants compared (--base, --new); results are keyed _v1 (base) and _v2 (new).
BASE, NEW = "v1", "v2"
SCALE = 128**-0.5
#: seconds one step (a case, a row) may take before the process dumps its stacks and exits
HANG_S = float(os.environ.get("HANG_S", "120"))


def _rows():
    from flashqla.bench.bwd_grid import bwd_mix

    return {  # name: (H, HV, lengths, packed)
        "16/32 8k_8seq": (16, 32, list(bwd_mix(8192, 8).lengths), True),
        "16/32 4x8192": (16, 32, [8192] * 4, False),
        "2/4 1x32768": (2, 4, [32768], False),
        "16/32 1x32768": (16, 32, [32768], False),
        "16/32 4x8192 packed": (16, 32, [8192] * 4, True),
        "8/16 7212+25556": (8, 16, [7212, 25556], True),
    }


#: H200 medians, ms, of the whole backward: (FlashQLA, FLA, ours with v1 at its first timing)
PEERS = {
    "16/32 8k_8seq": (0.747, 1.638, 1.596),
    "16/32 4x8192": (None, None, None),
    "2/4 1x32768": (0.649, 2.348, 13.71),
    "16/32 1x32768": (2.96, 6.28, 14.45),
}

#: correctness cases: name -> keyword arguments of `_case` (make_gdn_inputs: value head 0 has g == 0,
#: the last value head g = -30 per token)
CASES = {
    "T=1 2/4": dict(B=1, T=1, H=2, HV=4),
    "T=63 2/4": dict(B=1, T=63, H=2, HV=4),
    "T=64 2/4": dict(B=1, T=64, H=2, HV=4),
    "T=65 2/4": dict(B=1, T=65, H=2, HV=4),
    "T=1000 2/4": dict(B=1, T=1000, H=2, HV=4),
    "varlen 5,0,63,1,64,130 h0": dict(lengths=[5, 0, 63, 1, 64, 130], H=2, HV=4),
    "varlen 5,0,63,1,64,130 no-h0": dict(lengths=[5, 0, 63, 1, 64, 130], H=2, HV=4, h0=False),
    "varlen 0,65,64,1,63,0 h0": dict(lengths=[0, 65, 64, 1, 63, 0], H=2, HV=4),
    "varlen 0,0,200 no-h0": dict(lengths=[0, 0, 200], H=2, HV=4, h0=False),
    "packed tail 50 past 100,130,70": dict(lengths=[100, 130, 70], tail=50, H=1, HV=2),
    "GVA1 4/4 B=2 T=700": dict(B=2, T=700, H=4, HV=4),
    "GVA2 2/4 B=2 T=700": dict(B=2, T=700, H=2, HV=4),
    "GVA4 1/4 B=2 T=700": dict(B=2, T=700, H=1, HV=4),
    "h fp32 T=500 2/4": dict(B=1, T=500, H=2, HV=4, h_dtype=torch.float32),
    "g==0 / g=-30 heads T=300 2/4": dict(B=1, T=300, H=2, HV=4),
}


# ----------------------------------------------------------------------------------------------
# inputs, runs
# ----------------------------------------------------------------------------------------------


def _case(seed, B=1, T=None, H=2, HV=4, lengths=None, tail=0, h0=True, h_dtype=torch.bfloat16):
    """Device inputs (bf16 q, k, v, do; fp32 g, beta, states) with do and dht. `tail` tokens past
    cu_seqlens[-1] (packed only) carry nonzero inputs and cotangents."""
    seqlens = None
    if lengths is not None:
        seqlens = list(lengths) + ([tail] if tail else [])
        T = sum(seqlens)
    x = make_gdn_inputs(B=B, T=T, H=H, HV=HV, K=128, V=128, seqlens=seqlens, initial_state=h0, seed=seed)
    cu = x["cu_seqlens"]
    if tail:
        cu = cu[:-1].clone()
        if x["initial_state"] is not None:
            x["initial_state"] = x["initial_state"][:-1].clone()
    x["cu_seqlens"] = cu
    add_cotangents(x, seed + 1)
    xd = {}
    for n, t in x.items():
        if t is None:
            xd[n] = None
        elif n in ("q", "k", "v", "do"):
            xd[n] = t.to("cuda", torch.bfloat16)
        elif n == "cu_seqlens":
            xd[n] = t.to("cuda", torch.int32)
        else:
            xd[n] = t.to("cuda", torch.float32)
    return xd, h_dtype, (sum(lengths) if tail else None)


def _reference(xd, t_end=None):
    """fp64 gradients on the rounded device inputs (tests/gpu/test_bwd_gpu.py `_reference`); with
    t_end, of the tokens before it (the packed tail's run without the tail)."""
    from reference.gdn import fused_bwd as fb

    x = {n: (None if t is None else (t.detach().cpu().double() if t.is_floating_point() else t.cpu())) for n, t in xd.items()}
    if t_end is not None:
        for n in ("q", "k", "v", "g", "beta", "do"):
            x[n] = x[n][:, :t_end].contiguous()
    Ab, G2 = fb.forward_slot_products(x["k"], x["g"], x["beta"], x["v"].shape[2], x["cu_seqlens"])
    out = fb.fused_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["beta"], Ab, G2, SCALE, x["initial_state"], x["do"],
                                        x["dht"], x["cu_seqlens"], g=x["g"])
    return dict(zip(NAMES, out))


def _pass2_poisoned(variant, q, k, v, beta, A, gcl, h, do, dht, cu):
    """Pass 2 launched on NaN-filled outputs (dG too: pass 3 reads only the rows the kernel writes)."""
    from flashqla.ops.gdn.kernels.sm90._common import CHUNK, num_slots
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import build_chunk_bwd_kernel, chunk_bwd_kernel_args
    from flashqla.ops.gdn.kernels.sm90.prepare import dummy_cu_seqlens

    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu.numel() - 1 if cu is not None else B
    S = num_slots(B, T, N, cu is not None)
    nan = dict(device="cuda")
    from flashqla.ops.gdn.kernels.sm90._common import tl_dtype
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v5 import qk_store_dtype

    # v5 stores dq / dk in fp32, or in q's dtype under $FLASHQLA_BWD_QK_DTYPE=input
    qk = dict(nan, dtype=getattr(torch, qk_store_dtype(tl_dtype(q.dtype))) if variant.startswith("v5") else torch.float32)
    dq_hv = torch.full((B, T, HV, K), float("nan"), **qk)
    dk_hv = torch.full((B, T, HV, K), float("nan"), **qk)
    dv = torch.full_like(v, float("nan"))
    dbeta = torch.full((B, T, HV), float("nan"), **nan)
    dG = torch.full((HV, S * CHUNK), float("nan"), **nan)
    dh0 = torch.full((N, HV, K, V), float("nan"), **nan)
    kern = build_chunk_bwd_kernel(*chunk_bwd_kernel_args(q, v, beta, h, cu), variant)
    from flashqla.ops.gdn.kernels.sm90._common import order_args

    extra = order_args(None, "cuda") if variant.startswith("v5") else ()  # v5 takes the launch order (token order here)
    kern(q, k, v, beta, A, gcl, h, do, dht, cu if cu is not None else dummy_cu_seqlens("cuda"), *extra, float(SCALE), 1,
         dq_hv, dk_hv, dv, dbeta, dG, dh0)
    return dq_hv, dk_hv, dv, dbeta, dG, dh0


def _backward(xd, f, h, variant, poison):
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_fused_bwd
    from flashqla.ops.gdn.kernels.sm90.finish_bwd import chunk_finish_bwd

    args = (f.q, f.k, xd["v"], xd["beta"], f.A, f.g_cum_log2, h, xd["do"], xd["dht"])
    if poison:
        p2 = _pass2_poisoned(variant, *args, xd["cu_seqlens"])
    else:
        p2 = chunk_fused_bwd(*args, SCALE, xd["cu_seqlens"], variant=variant)
    dq_hv, dk_hv, dv, dbeta, dG, dh0 = p2
    dq, dk, dg = chunk_finish_bwd(dG, dq_hv, dk_hv, xd["cu_seqlens"], f.q.shape[2], f.q.dtype)
    return dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dh0=dh0)


def check_case(name, kw, seed):
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd

    xd, h_dtype, t_end = _case(seed, **kw)
    f = chunk_gated_delta_rule_fwd(xd["q"], xd["k"], xd["v"], xd["g"], xd["beta"], SCALE, xd["initial_state"], True,
                                   xd["cu_seqlens"])
    h = chunk_states_bwd(f.k, xd["v"], f.A, f.g_cum_log2, xd["initial_state"], xd["cu_seqlens"], h_dtype)
    g1 = _backward(xd, f, h, BASE, poison=False)
    g2 = _backward(xd, f, h, NEW, poison=True)
    g2b = _backward(xd, f, h, NEW, poison=True)
    torch.cuda.synchronize()
    ref = _reference(xd, t_end)
    row = {"case": name}
    for n in NAMES:
        a, b, c = g1[n], g2[n], g2b[n]
        row[f"{n}_finite"] = bool(torch.isfinite(b.float()).all())
        row[f"{n}_bitwise_v1"] = bool(torch.equal(a, b))
        row[f"{n}_repeat"] = bool(torch.equal(b, c))
        d = (b.double() - a.double()).abs()
        row[f"{n}_max_abs_v1"] = float(d.max()) if d.numel() else 0.0
        row[f"{n}_rel_v1"] = rel_rms(b, a) if a.numel() and bool(a.double().abs().max() > 0) else 0.0
        r = ref[n]
        if t_end is not None and n != "dh0":
            a, b = a[:, :t_end], b[:, :t_end]
            tail = g2[n][:, t_end:]
            row[f"{n}_tail_zero"] = bool(torch.isfinite(tail.float()).all()) and not bool(tail.any())
        row[f"{n}_ref_v1"] = rel_rms(a, r) if r is not None and bool(r.abs().max() > 0) else None
        row[f"{n}_ref_v2"] = rel_rms(b, r) if r is not None and bool(r.abs().max() > 0) else None
    return row


# ----------------------------------------------------------------------------------------------
# timing
# ----------------------------------------------------------------------------------------------


def row_inputs(H, HV, lengths, packed):
    """A timing row's inputs (`device_check.gen_inputs`), its do and dht (seed 7) and one forward:
    (x, do, dht, f). Shared by the timing scripts of the backward."""
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd

    x = gen_inputs(H, HV, lengths, packed)
    gen = torch.Generator(device="cuda").manual_seed(7)
    do = torch.randn(x["v"].shape, device="cuda", generator=gen).to(x["v"].dtype)
    N = len(lengths) if packed else x["v"].shape[0]
    dht = torch.randn(N, HV, 128, 128, device="cuda", generator=gen)
    return x, do, dht, chunk_gated_delta_rule_fwd(**x, output_final_state=True)


def time_row(name, H, HV, lengths, packed):
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
    from flashqla.ops.gdn.kernels.sm90 import chunk_bwd
    from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd

    x, do, dht, f = row_inputs(H, HV, lengths, packed)
    h = chunk_states_bwd(f.k, x["v"], f.A, f.g_cum_log2, x["initial_state"], x["cu_seqlens"], torch.bfloat16)
    row = {"row": name}
    for key, variant in (("v1", BASE), ("v2", NEW)):
        row[f"t_pass2_{key}"] = time_graph(lambda: chunk_bwd.chunk_fused_bwd(
            f.q, f.k, x["v"], x["beta"], f.A, f.g_cum_log2, h, do, dht, SCALE, x["cu_seqlens"], variant=variant))
        saved = chunk_bwd.DEFAULT_VARIANT
        chunk_bwd.DEFAULT_VARIANT = variant
        try:
            row[f"t_bwd_{key}"] = time_graph(lambda: chunk_gated_delta_rule_bwd(
                f.q, f.k, x["v"], x["g"], x["beta"], f.A, f.g_cum_log2, do, dht, SCALE, x["initial_state"], x["cu_seqlens"]))
        finally:
            chunk_bwd.DEFAULT_VARIANT = saved
    nch = sum((t + 63) // 64 for t in lengths)  # chunks of the longest-running CTAs' sequences, all heads
    row["chunks_per_cta_max"] = max((t + 63) // 64 for t in lengths)
    row["ctas"] = dht.shape[0] * HV
    row["chunks"] = nch * HV
    return row


# ----------------------------------------------------------------------------------------------
# main
# ----------------------------------------------------------------------------------------------


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
        specs += [(kind, args[:-1] + (v,)) for kind, args in s if kind == "chunk_bwd" for v in {BASE, NEW}]
    t = time.time()
    pc(specs, max_workers=min(len(set(specs)), os.cpu_count() or 8))
    dt = time.time() - t
    print(f"precompiled {len(set(specs))} kernels in {dt:.1f} s", flush=True)
    return dt


def _fmt(v, f="{:.1e}"):
    return "-" if v is None else (f.format(v) if isinstance(v, float) else str(v))


def main():
    rows_all = _rows()
    ap = argparse.ArgumentParser()
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--cases", nargs="*", default=list(CASES))
    ap.add_argument("--rows", nargs="*", default=list(rows_all))
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--base", default="v1", help="pass-2 variant compared against (columns v1)")
    ap.add_argument("--new", default="v2", help="pass-2 variant checked (columns v2, NaN-poisoned outputs)")
    a = ap.parse_args()
    global BASE, NEW
    BASE, NEW = a.base, a.new
    print(f"base (columns v1) = {BASE}, new (columns v2) = {NEW}", flush=True)
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

    path = os.path.join(a.out, "bwd_v2_check.json")

    def dump():
        out["wall_s"] = time.time() - t_start
        with open(path, "w") as fh:
            json.dump(out, fh, indent=1)

    for i, (name, kw) in enumerate(cases.items()):
        print(f"case {name} ...", flush=True)
        faulthandler.dump_traceback_later(HANG_S, exit=True)
        try:
            r = check_case(name, kw, seed=100 + i)
            out["cases"].append(r)
            print(name, {k: v for k, v in r.items() if k.endswith(("_rel_v1", "_ref_v2", "_bitwise_v1"))}, flush=True)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            out["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        faulthandler.cancel_dump_traceback_later()
        torch.cuda.empty_cache()
        dump()

    for name, (H, HV, lengths, packed) in rows.items():
        print(f"row {name} ...", flush=True)
        faulthandler.dump_traceback_later(HANG_S, exit=True)
        try:
            r = time_row(name, H, HV, lengths, packed)
            out["rows"].append(r)
            print(name, {k: (round(v, 4) if isinstance(v, float) else v) for k, v in r.items()}, flush=True)
        except Exception as exc:  # noqa: BLE001
            traceback.print_exc()
            out["errors"].append(f"{name}: {type(exc).__name__}: {exc}")
        faulthandler.cancel_dump_traceback_later()
        torch.cuda.empty_cache()
        dump()

    print("\n== v2 against v1 (rel RMS; '=' bitwise equal) and against fp64 (v1 / v2 rel RMS); ok = finite, repeatable, tail zero")
    print(f"{'case':32s} " + " ".join(f"{n:>21s}" for n in NAMES) + "  ok")
    for r in out["cases"]:
        cells = []
        for n in NAMES:
            vs = "=" if r[f"{n}_bitwise_v1"] else _fmt(r[f"{n}_rel_v1"])
            cells.append(f"{vs:>7s} {_fmt(r[f'{n}_ref_v1']):>6s}/{_fmt(r[f'{n}_ref_v2']):>6s}")
        ok = all(r[f"{n}_finite"] and r[f"{n}_repeat"] and r.get(f"{n}_tail_zero", True) for n in NAMES)
        print(f"{r['case'][:32]:32s} " + " ".join(f"{c:>21s}" for c in cells) + f"  {ok}")
    print("\n== ms, CUDA graphs, median: pass 2 alone and the whole backward (h bf16), v1 / v2; peers: whole backward")
    print(f"{'row':16s} {'p2 v1':>7s} {'p2 v2':>7s} {'x':>5s} {'bwd v1':>7s} {'bwd v2':>7s} {'x':>5s} {'us/chunk v1':>11s} {'v2':>6s}  FlashQLA / FLA")
    for r in out["rows"]:
        fq, fla, _ = PEERS.get(r["row"], (None, None, None))
        # per chunk per CTA: pass-2 time over the chunks one CTA walks, scaled by the waves (132 SMs, 1 CTA/SM)
        waves = max(1.0, r["ctas"] / 132)
        per = [1e3 * r[f"t_pass2_{v}"] / (r["chunks_per_cta_max"] * waves) for v in ("v1", "v2")]
        print(f"{r['row']:16s} {r['t_pass2_v1']:7.3f} {r['t_pass2_v2']:7.3f} {r['t_pass2_v1'] / r['t_pass2_v2']:5.2f} "
              f"{r['t_bwd_v1']:7.3f} {r['t_bwd_v2']:7.3f} {r['t_bwd_v1'] / r['t_bwd_v2']:5.2f} {per[0]:11.1f} {per[1]:6.1f}"
              f"  {_fmt(fq, '{:.3f}')} / {_fmt(fla, '{:.3f}')}")
    if out["errors"]:
        print("\n== errors")
        for e in out["errors"]:
            print(" ", e)
    print(f"\nwall {out['wall_s']:.0f} s")


if __name__ == "__main__":
    main()

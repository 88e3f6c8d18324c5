"""One call on the GPU machine: the prepare kernel's variant "v3" (block-recursive inverse,
`kernels/sm90/prepare_v3.py`) against the default "v2", on the benchmark rows and on edge cases.

    python tests/gpu/prepare_v3_check.py --precompile [--base V --new W] [--rows ROW ...] [--no-cases] [--no-op] [--out DIR]

(--base / --new compare other prepare variants the same way, e.g. `--base v2 --new v3 --rows "32/32
8x4096" "16/32 8x4096" "8/24 8x4096"`; the columns and JSON keys keep the names v2 (base) and v3
(new). A variant that computes v3's products in v3's order should give bitwise v3's A and g_cum_log2.)

(`--precompile-only` builds the kernels and exits without touching a GPU: run it on the CPU machine
with TILELANG_CACHE_DIR set and ship the cache, as tests/gpu/precompile.py does.)

Per row (inputs of `device_check.gen_inputs`) and per extra case (packed sequences of 0, 1, 63, 64,
65 tokens; GVA 8; fp16 q/k/v with fp16 beta and int64 offsets), with NaN-poisoned outputs:
- v3 against v2 on every used slot row: A diag(beta) relative RMS and max |diff|, g_cum_log2 max
  |diff|, every used row written and finite, the upper triangle and the rows past each sequence's
  end exactly zero, v3 bitwise repeatable;
- v2 and v3 against the fp64 stage twin (`reference.gdn.fused.prepare_group`) on up to 48 sampled
  slots: both round the inverse's products to tf32 in different places, so v3 - v2 is of the
  order of either one's distance to fp64 (CPU emulation of both generated kernels: ~1.5e-4 relative
  RMS for bf16 A), and the fp64 columns say whether v3 is as accurate as v2;
- benchmark rows only: CUDA-graph median times of the prepare launch (v2, v3) and of the whole
  forward `chunk_gated_delta_rule_fwd(..., cp="off")` with each (`prepare.DEFAULT_VARIANT` switched).
A failing row or case is printed with its traceback and the run goes on. Prints a table last and
writes prepare_v3_check.json to --out (rewritten after every row). Not collected by pytest.
--precompile builds every kernel first in worker processes (TileLang's disk cache).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.device_check import BENCH_ROWS, PEERS, gen_inputs, time_graph  # noqa: E402

#: rows of few value heads per q/k head (G = 1, 2, 3), where a slot's shared part (k, K K^T, the
#: gates) weighs most, besides device_check's benchmark rows
SMALL_G_ROWS = {"32/32 8x4096": (32, 32, [4096] * 8), "16/32 8x4096": (16, 32, [4096] * 8), "8/24 8x4096": (8, 24, [4096] * 8)}
BENCH_ROWS = {**BENCH_ROWS, **SMALL_G_ROWS}
DEFAULT_ROWS = ["16/64 4x8192", "16/32 4x8192", "16/64 8x1024", "32/32 1x4096", "2/8 1x32768"]
#: name: (H, HV, lengths, packed, q/k/v dtype, beta dtype, offsets dtype)
CASES = {
    "varlen 0,1,63,64,65,0,130,5,0 2/8": (2, 8, [0, 1, 63, 64, 65, 0, 130, 5, 0], True, torch.bfloat16, torch.float32, torch.int32),
    "GVA-8 2/16 1000+333": (2, 16, [1000, 333], True, torch.bfloat16, torch.float32, torch.int32),
    "fp16 int64 fp16-beta 2/4 70,1,200": (2, 4, [70, 1, 200], True, torch.float16, torch.float16, torch.int64),
    # G = 1 and 3: gap slots, empty and 1-token sequences next to one another
    "G1 1/1 0,1,63,64,65,0,130,5,0,300": (1, 1, [0, 1, 63, 64, 65, 0, 130, 5, 0, 300], True, torch.bfloat16, torch.float32, torch.int32),
    "G3 2/6 130,1,0,64,257": (2, 6, [130, 1, 0, 64, 257], True, torch.bfloat16, torch.float32, torch.int32),
    "G1 fp16 int64 3/3 70,1,200": (3, 3, [70, 1, 200], True, torch.float16, torch.float16, torch.int64),
}
REF_SLOTS = 48
TL = {torch.bfloat16: "bfloat16", torch.float16: "float16", torch.float32: "float32", torch.int32: "int32", torch.int64: "int64"}


#: the variants compared (--base, --new): results are keyed v2 (base) and v3 (new)
BASE, NEW = "v2", "v3"


def specs_for(rows, cases) -> list:
    from flashqla.ops.gdn.kernels.sm90.recurrent import DEFAULT_SCHEDULE, pick_block_v

    specs = []
    for name in rows:
        H, HV, lengths = BENCH_ROWS[name]
        for variant in (BASE, NEW):
            specs.append(("prepare", (H, HV, 128, "bfloat16", "float32", "int32", False, variant)))
        specs.append(("recurrent", (H, HV, 128, 128, pick_block_v(len(lengths), HV), "bfloat16", "int32", False, DEFAULT_SCHEDULE)))
    for name in cases:
        H, HV, _, packed, dt, bt, st = CASES[name]
        for variant in (BASE, NEW):
            specs.append(("prepare", (H, HV, 128, TL[dt], TL[bt], TL[st], packed, variant)))
    return list(dict.fromkeys(specs))


def precompile(specs) -> float:
    from flashqla.ops.gdn.kernels.sm90 import precompile as pc

    t = time.time()
    pc(specs, max_workers=min(len(specs), os.cpu_count() or 8))
    dt = time.time() - t
    print(f"precompiled {len(specs)} kernels in {dt:.1f} s", flush=True)
    return dt


def case_inputs(name):
    """Inputs of an extra case: gen_inputs, then the case's dtypes."""
    H, HV, lengths, packed, dt, bt, st = CASES[name]
    x = gen_inputs(H, HV, lengths, packed, seed=len(name))
    x["q"], x["k"], x["v"] = (x[n].to(dt) for n in "qkv")
    x["beta"] = x["beta"].to(bt)
    if x["cu_seqlens"] is not None:
        x["cu_seqlens"] = x["cu_seqlens"].to(st)
    return x


def slot_table(B, T, lengths, packed):
    """[(slot, batch row, first token, valid rows)] of every used chunk slot."""
    from flashqla.ops.gdn.kernels.sm90._common import slot_index

    out = []
    if packed:
        cu = [0]
        for n in lengths:
            cu.append(cu[-1] + n)
        for n, L in enumerate(lengths):
            for c in range((L + 63) // 64):
                out.append((slot_index(n, c, T, cu), 0, cu[n] + 64 * c, min(64, L - 64 * c)))
    else:
        for b in range(B):
            for c in range((T + 63) // 64):
                out.append((slot_index(b, c, T), b, 64 * c, min(64, T - 64 * c)))
    return out


def run_prepare(x, HV, variant):
    from flashqla.ops.gdn.kernels.sm90._common import num_slots
    from flashqla.ops.gdn.kernels.sm90.prepare import chunk_prepare_fwd

    k = x["k"]
    B, T = k.shape[:2]
    cu = x["cu_seqlens"]
    N = cu.numel() - 1 if cu is not None else B
    S = num_slots(B, T, N, cu is not None)
    A = torch.full((HV, S * 64, 64), float("nan"), dtype=k.dtype, device=k.device)
    gcl = torch.full((HV, S * 64), float("nan"), dtype=torch.float32, device=k.device)
    chunk_prepare_fwd(k, x["g"], x["beta"], cu, HV, A=A, g_cum_log2=gcl, variant=variant)
    return A, gcl


def compare(x, H, HV, lengths, packed) -> dict:
    """v3 against v2 and both against fp64 on sampled slots (see the module docstring)."""
    from reference.gdn.fused import prepare_group

    out_v2 = run_prepare(x, HV, BASE)
    out_v3 = run_prepare(x, HV, NEW)
    out_v3b = run_prepare(x, HV, NEW)
    torch.cuda.synchronize()
    k = x["k"]
    B, T = k.shape[:2]
    slots = slot_table(B, T, lengths, packed)
    rows = torch.cat([torch.arange(s * 64, s * 64 + 64) for s, *_ in slots]).to(k.device) if slots else torch.zeros(0, dtype=torch.long, device=k.device)
    (A2, g2), (A3, g3), (A3b, g3b) = out_v2, out_v3, out_v3b
    a2, a3 = A2[:, rows].double(), A3[:, rows].double()
    d = a3 - a2
    r = {
        "slots": len(slots),
        "finite": bool(torch.isfinite(a3).all() and torch.isfinite(g3[:, rows]).all()),
        "v2_finite": bool(torch.isfinite(a2).all()),
        "A_rel_rms": float(d.pow(2).mean().sqrt() / a2.pow(2).mean().sqrt().clamp_min(1e-30)),
        "A_max_diff": float(d.abs().max()) if d.numel() else 0.0,
        "g_max_diff": float((g3[:, rows] - g2[:, rows]).abs().max()) if rows.numel() else 0.0,
        "repeat_bitwise": bool(torch.equal(A3[:, rows], A3b[:, rows]) and torch.equal(g3[:, rows], g3b[:, rows])),
        "triu_zero": bool((torch.triu(a3.view(HV, -1, 64, 64), 1) == 0).all()),
    }
    tail_ok = True
    for s, _, _, nv in slots:
        if nv < 64:
            tail_ok &= bool((A3[:, s * 64 + nv : s * 64 + 64] == 0).all())
    r["tail_zero"] = tail_ok
    # fp64 reference on sampled slots
    G = HV // H
    gen = torch.Generator().manual_seed(0)
    pick = slots if len(slots) <= REF_SLOTS else [slots[i] for i in torch.randperm(len(slots), generator=gen)[:REF_SLOTS].tolist()]
    e2 = e3 = ref2 = 0.0
    kd, gd, bd = k.double(), x["g"].double(), x["beta"].double()
    for s, b, t0, nv in pick:
        kt = torch.zeros(64, H, k.shape[3], dtype=torch.float64, device=k.device)
        te = min(t0 + 64, T)
        kt[: te - t0] = kd[b, t0:te]  # past a packed sequence's end: the next sequence's keys (masked)
        gt = torch.zeros(64, HV, dtype=torch.float64, device=k.device)
        bt = torch.zeros(64, HV, dtype=torch.float64, device=k.device)
        gt[:nv], bt[:nv] = gd[b, t0 : t0 + nv], bd[b, t0 : t0 + nv]
        _, ref = prepare_group(kt.permute(1, 0, 2), gt.T.reshape(H, G, 64), bt.T.reshape(H, G, 64), nv)  # [H, G, 64, 64]
        ref = ref.reshape(HV, 64, 64)
        e2 += float((A2[:, s * 64 : s * 64 + 64].double() - ref).pow(2).sum())
        e3 += float((A3[:, s * 64 : s * 64 + 64].double() - ref).pow(2).sum())
        ref2 += float(ref.pow(2).sum())
    r["v2_vs_fp64"] = math.sqrt(e2 / ref2) if ref2 else 0.0
    r["v3_vs_fp64"] = math.sqrt(e3 / ref2) if ref2 else 0.0
    ok = (r["finite"] and r["repeat_bitwise"] and r["triu_zero"] and r["tail_zero"] and r["g_max_diff"] == 0.0
          and r["A_rel_rms"] < 1e-3 and r["v3_vs_fp64"] <= 1.25 * r["v2_vs_fp64"] + 1e-5)
    r["ok"] = bool(ok)
    return r


def time_row(x, H, HV) -> dict:
    from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel, dummy_cu_seqlens

    k, g, beta = x["k"], x["g"], x["beta"]
    A, gcl = run_prepare(x, HV, BASE)
    cu = dummy_cu_seqlens(k.device)
    t = {}
    for key, variant in (("v2", BASE), ("v3", NEW)):
        kern = build_prepare_kernel(H, HV, 128, "bfloat16", "float32", "int32", False, variant)
        t[f"t_{key}"] = time_graph(lambda: kern(k, g, beta, cu, A, gcl))
    return t


def time_op(x) -> dict:
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90 import prepare as P

    saved = P.DEFAULT_VARIANT
    t = {}
    try:
        for key, variant in (("v2", BASE), ("v3", NEW)):
            P.DEFAULT_VARIANT = variant
            t[f"t_op_{key}"] = time_graph(lambda: chunk_gated_delta_rule_fwd(**x, output_final_state=True, cp="off"))
    finally:
        P.DEFAULT_VARIANT = saved
    return t


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--precompile-only", action="store_true", help="build the kernels (no GPU needed) and exit")
    ap.add_argument("--rows", nargs="*", default=DEFAULT_ROWS)
    ap.add_argument("--no-cases", action="store_true")
    ap.add_argument("--no-op", action="store_true", help="skip the whole-forward timings")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--base", default="v2", help="prepare variant compared against (columns v2)")
    ap.add_argument("--new", default="v3", help="prepare variant checked (columns v3)")
    a = ap.parse_args()
    global BASE, NEW
    BASE, NEW = a.base, a.new
    print(f"base (columns v2) = {BASE}, new (columns v3) = {NEW}", flush=True)
    cases = [] if a.no_cases else list(CASES)
    if a.precompile_only:
        precompile(specs_for(a.rows, cases))
        return
    t_start = time.time()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": [], "cases": [], "errors": []}
    path = os.path.join(a.out, "prepare_v3_check.json")

    def dump():
        with open(path, "w") as f:
            json.dump(out, f, indent=1)

    if a.precompile:
        try:
            out["precompile_s"] = precompile(specs_for(a.rows, cases))
        except Exception:  # noqa: BLE001 - report and go on: the first calls compile what is missing
            out["errors"].append(("precompile", traceback.format_exc()))
            traceback.print_exc()
    for name in a.rows:
        row = {"row": name}
        try:
            H, HV, lengths = BENCH_ROWS[name]
            x = gen_inputs(H, HV, lengths, False)
            row.update(compare(x, H, HV, lengths, False))
            print(name, {q: row[q] for q in ("ok", "finite", "A_rel_rms", "A_max_diff", "g_max_diff", "repeat_bitwise",
                                             "v2_vs_fp64", "v3_vs_fp64")}, flush=True)
            row.update(time_row(x, H, HV))
            if not a.no_op:
                row.update(time_op(x))
            print(name, {q: round(v, 4) for q, v in row.items() if q.startswith("t_")}, flush=True)
            del x
        except Exception:  # noqa: BLE001
            row["error"] = traceback.format_exc()
            print(f"{name}: FAILED\n{row['error']}", flush=True)
        out["rows"].append(row)
        torch.cuda.empty_cache()
        dump()
    for name in cases:
        case = {"case": name}
        try:
            H, HV, lengths, packed, *_ = CASES[name]
            case.update(compare(case_inputs(name), H, HV, lengths, packed))
            print(name, {q: case[q] for q in ("ok", "finite", "A_rel_rms", "A_max_diff", "g_max_diff", "repeat_bitwise",
                                              "triu_zero", "tail_zero", "v2_vs_fp64", "v3_vs_fp64")}, flush=True)
        except Exception:  # noqa: BLE001
            case["error"] = traceback.format_exc()
            print(f"{name}: FAILED\n{case['error']}", flush=True)
        out["cases"].append(case)
        dump()
    out["wall_s"] = time.time() - t_start
    dump()

    def f(v, fmt):
        return format(v, fmt) if isinstance(v, (int, float)) else "-"

    print(f"\n== prepare v3 vs v2 (ms, CUDA graphs, median; op = chunk_gated_delta_rule_fwd, cp off); wall {out['wall_s']:.0f} s")
    print(f"{'row':14s} {'prep v2':>7s} {'prep v3':>7s} {'x':>5s} {'op v2':>6s} {'op v3':>6s} {'FlashQLA':>8s}  "
          f"ok  A rel  A max   g max  v2~fp64 v3~fp64 finite repeat")
    for r in out["rows"]:
        if "error" in r:
            print(f"{r['row']:14s} ERROR (see above / JSON)")
            continue
        sp = r.get("t_v2", float("nan")) / r.get("t_v3", float("nan")) if r.get("t_v3") else float("nan")
        print(f"{r['row']:14s} {f(r.get('t_v2'), '7.3f')} {f(r.get('t_v3'), '7.3f')} {sp:5.2f} {f(r.get('t_op_v2'), '6.3f')} "
              f"{f(r.get('t_op_v3'), '6.3f')} {PEERS.get(r['row'], ('-',))[0]:>8}  {'OK' if r['ok'] else 'NO':3s} "
              f"{r['A_rel_rms']:.1e} {r['A_max_diff']:.1e} {r['g_max_diff']:.1e} {r['v2_vs_fp64']:.1e} {r['v3_vs_fp64']:.1e} "
              f"{r['finite']} {r['repeat_bitwise']}")
    for c in out["cases"]:
        if "error" in c:
            print(f"{c['case']}: ERROR (see above / JSON)")
            continue
        print(f"{c['case']:36s} {'OK' if c['ok'] else 'NO':3s} A rel {c['A_rel_rms']:.1e} max {c['A_max_diff']:.1e} g {c['g_max_diff']:.1e} "
              f"fp64 v2 {c['v2_vs_fp64']:.1e} v3 {c['v3_vs_fp64']:.1e} finite {c['finite']} repeat {c['repeat_bitwise']} "
              f"triu0 {c['triu_zero']} tail0 {c['tail_zero']}")
    bad = [r.get("row", r.get("case")) for r in out["rows"] + out["cases"] if "error" in r or not r.get("ok")]
    print("all checks passed" if not bad else f"FAILED or not ok: {bad}")
    sys.exit(1 if bad else 0)


if __name__ == "__main__":
    main()

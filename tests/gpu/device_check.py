"""One-call check on the GPU machine: build, correctness table, timings against FLA, cold compile.

    python tests/gpu/device_check.py [--precompile] [--correct] [--bench ROWS] [--cold] [--out DIR]

Prints a short table last. Not collected by pytest (the tests are in test_fwd_gpu.py).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from flashqla.testing import make_gdn_inputs, rel_rms  # noqa: E402

BENCH_ROWS = {  # name: (H, HV, lengths)
    "16/64 4x8192": (16, 64, [8192] * 4),
    "16/32 4x8192": (16, 32, [8192] * 4),
    "16/64 8x1024": (16, 64, [1024] * 8),
    "32/32 1x4096": (32, 32, [4096]),
    "2/8 1x32768": (2, 8, [32768]),
    "8/32 4x8192": (8, 32, [8192] * 4),
    "4/16 8x4096": (4, 16, [4096] * 8),
}
PEERS = {  # H200, ms, FlashQLA / FLA forward (shared/device/README.md)
    "16/64 4x8192": (1.225, 3.491),
    "16/32 4x8192": (0.623, 1.759),
    "16/64 8x1024": (0.345, 0.874),
    "32/32 1x4096": (0.158, 0.260),
    "2/8 1x32768": (0.390, 0.922),
    "8/32 4x8192": (0.633, 1.943),  # packed rows of benchmarks/results/h200-fwd.md
    "4/16 8x4096": (0.325, 0.967),
}


def parse_row(row: str) -> tuple[int, int, list[int]]:
    """"h_qk/h_v MIX" -> (H, HV, lengths), MIX either COUNTxLENGTH ("1x32768": one sequence; the
    benchmark's own notation is LENGTHxCOUNT) or "a+b+..." (the GPU scripts' row notation)."""
    heads, mix = row.split()
    H, HV = (int(n) for n in heads.split("/"))
    if "x" in mix:
        count, length = mix.split("x")
        return H, HV, [int(length)] * int(count)
    return H, HV, [int(n) for n in mix.split("+")]


def gen_inputs(H, HV, lengths, varlen, dtype=torch.bfloat16, seed=0, h0=True):
    """Valid-domain inputs made on the GPU (q, k L2-normalised, logsigmoid/16 gate)."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)
    B, Tb = (1, T) if varlen else (len(lengths), lengths[0])
    K = V = 128
    q = torch.nn.functional.normalize(torch.randn(B, Tb, H, K, device="cuda", generator=g), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, Tb, H, K, device="cuda", generator=g), dim=-1).to(dtype)
    v = torch.randn(B, Tb, HV, V, device="cuda", generator=g).to(dtype)
    gg = torch.nn.functional.logsigmoid(torch.randn(B, Tb, HV, device="cuda", generator=g)) / 16
    beta = torch.sigmoid(torch.randn(B, Tb, HV, device="cuda", generator=g))
    N = len(lengths) if varlen else B
    h0t = torch.randn(N, HV, K, V, device="cuda", generator=g) if h0 else None
    cu = None
    if varlen:
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    return dict(q=q, k=k, v=v, g=gg, beta=beta, initial_state=h0t, cu_seqlens=cu)


def precompile(out, tests_only=False):
    """Compiles (in parallel worker processes) the kernels the GPU tests and the bench rows use."""
    from flashqla.ops.gdn.kernels.sm90 import precompile as pc

    bf, f32, i32 = "bfloat16", "float32", "int32"
    specs = []
    for (H, HV), varlens, bvs in [
        ((2, 4), (False, True), (64, 128)),  # tests
        ((4, 4), (False,), (64,)),
        ((1, 4), (False,), (64,)),
        ((1, 2), (False, True), (64,)),
        ((32, 32), (False,), (64, 128)),  # block_v comparison row
    ] + ([] if tests_only else [
        ((16, 64), (False,), (128,)),  # bench rows
        ((16, 32), (False,), (128,)),
        ((32, 32), (False,), (64,)),
        ((2, 8), (False,), (64,)),
        ((16, 64), (False,), (64,)),
    ]):
        for varlen in varlens:
            specs.append(("prepare", (H, HV, 128, bf, f32, i32, varlen)))
            for BV in bvs:
                specs.append(("recurrent", (H, HV, 128, 128, BV, bf, i32, varlen)))
    specs += [("prepare", (1, 2, 128, "float16", "float16", "int64", True)), ("recurrent", (1, 2, 128, 128, 64, "float16", "int64", True))]
    t = time.time()
    pc(specs, max_workers=min(len(specs), os.cpu_count() or 8))
    dt = time.time() - t
    print(f"precompiled {len(specs)} kernels in {dt:.1f} s", flush=True)
    out["precompile_s"] = dt


def correct(out):
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from reference.gdn.recurrent import recurrent_gated_delta_rule

    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
    except Exception as exc:  # noqa: BLE001
        print("fla not importable:", exc)
        fla = None
    cases = [
        ("T=1000 2/4", dict(B=1, T=1000, H=2, HV=4)),
        ("B=2 T=700 4/4", dict(B=2, T=700, H=4, HV=4)),
        ("varlen 5,0,63,1,64,130", dict(B=1, T=263, H=2, HV=4, cu_seqlens=[5, 0, 63, 1, 64, 130])),
        ("T=8192 1/4", dict(B=1, T=8192, H=1, HV=4)),
    ]
    rows = []
    for name, kw in cases:
        for bv in (64, 128):
            x = make_gdn_inputs(**kw, seed=len(name))
            xd = {n: (t.cuda() if t is not None else None) for n, t in x.items()}
            for n in "qkv":
                xd[n] = xd[n].to(torch.bfloat16)
            for n in ("g", "beta", "initial_state"):
                xd[n] = xd[n].float()
            x64 = {n: (t.cpu().double() if t is not None and t.is_floating_point() else (t.cpu() if t is not None else None)) for n, t in xd.items()}
            ref_o, ref_ht = recurrent_gated_delta_rule(**x64, output_final_state=True)
            r = chunk_gated_delta_rule_fwd(**xd, output_final_state=True, block_v=bv, poison_outputs=True)
            torch.cuda.synchronize()
            e = (rel_rms(r.o, ref_o), rel_rms(r.final_state, ref_ht))
            fe = ("-", "-")
            if fla is not None and bv == 64:
                try:
                    fo, fh = fla(**xd, output_final_state=True)
                    fe = (f"{rel_rms(fo, ref_o):.2e}", f"{rel_rms(fh, ref_ht):.2e}")
                except Exception as exc:  # noqa: BLE001
                    fe = (f"err {type(exc).__name__}", "-")
            rows.append((name, bv, f"{e[0]:.2e}", f"{e[1]:.2e}", *fe))
            print(rows[-1], flush=True)
            out["max_err"] = max(out.get("max_err", 0.0), *e)
    out["correct"] = rows


def time_graph(fn, reps=20, iters=5):
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / iters)
    times.sort()
    return times[len(times) // 2]


def bench(out, rows, with_fla=True, fla_rows=None, block_vs=(None,)):
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd

    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla
    except Exception:  # noqa: BLE001
        fla = None
    res = []
    for name in rows:
        H, HV, lengths = BENCH_ROWS[name]
        for varlen in (False,) if len(set(lengths)) == 1 else (True,):
            x = gen_inputs(H, HV, lengths, varlen)
            for bv in block_vs:
                ours = time_graph(lambda: chunk_gated_delta_rule_fwd(**x, output_final_state=True, block_v=bv))
                print(name, "block_v", bv, f"{ours:.3f} ms", flush=True)
                out.setdefault("bench_bv", []).append((name, bv, round(ours, 4)))
            f = float("nan")
            if fla is not None and with_fla and (not fla_rows or name in fla_rows):
                try:
                    f = time_graph(lambda: fla(**x, output_final_state=True))
                except Exception as exc:  # noqa: BLE001
                    print("fla failed", exc)
            tokheads = sum(lengths) * HV
            tflops = 163840 * tokheads / (ours * 1e-3) / 1e12
            res.append((name, f"{ours:.3f}", f"{f:.3f}", PEERS[name][0], PEERS[name][1], f"{tflops:.0f}"))
            print(res[-1], flush=True)
            del x
            torch.cuda.empty_cache()
    out["bench"] = res


def cold(out):
    """Cold compile of one forward (fresh TileLang cache, new process): the first call's time."""
    code = (
        "import time, torch, sys; sys.path.insert(0, %r)\n"
        "from tests.gpu.device_check import gen_inputs\n"
        "x = gen_inputs(16, 64, [1024] * 4, False)\n"
        "from flashqla import chunk_gated_delta_rule\n"
        "torch.cuda.synchronize(); t = time.time(); chunk_gated_delta_rule(**x, output_final_state=True); torch.cuda.synchronize()\n"
        "print('COLD', time.time() - t)\n"
    ) % ROOT
    env = dict(os.environ, TILELANG_CACHE_DIR=f"/tmp/tl-cold-{time.time()}")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, cwd=ROOT, timeout=300)
    line = [ln for ln in r.stdout.splitlines() if ln.startswith("COLD")]
    out["cold_s"] = float(line[0].split()[1]) if line else None
    print("cold compile + first call:", out["cold_s"], r.stderr[-2000:] if not line else "", flush=True)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--precompile", action="store_true")
    ap.add_argument("--precompile-tests", action="store_true")
    ap.add_argument("--correct", action="store_true")
    ap.add_argument("--bench", nargs="*", default=None)
    ap.add_argument("--no-fla", action="store_true")
    ap.add_argument("--fla-rows", nargs="*", default=None)
    ap.add_argument("--block-v", nargs="*", type=int, default=None)
    ap.add_argument("--cold", action="store_true")
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args()
    out = {"device": torch.cuda.get_device_name(), "torch": torch.__version__}
    if a.cold:
        cold(out)
    if a.precompile or a.precompile_tests:
        precompile(out, tests_only=a.precompile_tests)
    if a.correct:
        correct(out)
    if a.bench is not None:
        bench(out, a.bench or list(BENCH_ROWS), with_fla=not a.no_fla, fla_rows=a.fla_rows,
              block_vs=tuple(a.block_v) if a.block_v else (None,))
    with open(os.path.join(a.out, "device_check.json"), "w") as f:
        json.dump(out, f, indent=1, default=str)
    print("\n== summary")
    for k, v in out.items():
        if isinstance(v, list):
            print(k)
            for row in v:
                print("  ", row)
        else:
            print(k, v)
    if a.correct and not out.get("max_err", 1.0) < 0.05:
        sys.exit(1)


if __name__ == "__main__":
    main()

"""One call on the GPU machine: pass 2 (v5) summing dq and dk over the value-head groups itself
(`chunk_bwd_v5.FUSED_GVA_ENV`, the default) against the separate GVA launch of pass 3.

    python tests/gpu/bwd_gva_check.py [--cases NAME ...] [--rows ROW ...] [--repeat N]

1. Correctness, per case of tests/gpu/bwd_v2_check.py (fixed-length and packed batches with empty,
   1-token and partial sequences, a packed tail, one, two and four value heads per q/k head) and
   two split backwards (context parallelism on): the whole backward
   (`flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd`) with $FLASHQLA_BWD_FUSED_GVA=0 and then =1,
   N times: every gradient bitwise equal between the two and across the repeats, finite, and the
   tokens past cu_seqlens[-1] exactly zero.
2. Speed, per benchmark row: the backward as the benchmark times it (our forward keeping its split
   states, then the backward; CUDA graphs) both ways.
A table is printed last; bwd_gva_check.json goes to --out. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.bwd_v2_check import CASES, NAMES, SCALE, _case  # noqa: E402

ENV = "FLASHQLA_BWD_FUSED_GVA"
ROWS = ("16/32 8k_1seq", "16/32 8k_8seq", "8/16 32k_2seq", "4/8 32k_1seq", "2/4 8k_1seq", "4/8 8k_4seq")
SPLIT_CASES = {  # name: (H, HV, lengths); cp="on" splits the long sequences
    "split 2/4 1x8192": (2, 4, [8192]),
    "split 1/4 3000+77+5000": (1, 4, [3000, 77, 5000]),
}


def _grads(xd, cp: str, fused: str):
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd

    os.environ[ENV] = fused
    f = chunk_gated_delta_rule_fwd(xd["q"], xd["k"], xd["v"], xd["g"], xd["beta"], SCALE, xd["initial_state"], True,
                                   xd["cu_seqlens"], cp=cp)
    out = chunk_gated_delta_rule_bwd(f.q, f.k, xd["v"], xd["g"], xd["beta"], f.A, f.g_cum_log2, xd["do"], xd["dht"],
                                     SCALE, xd["initial_state"], xd["cu_seqlens"], cp=cp)
    torch.cuda.synchronize()
    return dict(zip(NAMES, out))


def _check(name, xd, t_end, cp, repeat):
    base = _grads(xd, cp, "0")
    runs = [_grads(xd, cp, "1") for _ in range(repeat)]
    row = {"case": name}
    ok = True
    for n in NAMES:
        if base[n] is None:
            continue
        same = all(torch.equal(r[n], base[n]) for r in runs)
        fin = all(bool(torch.isfinite(r[n]).all()) for r in runs)
        tail = True
        if t_end is not None and n != "dh0":
            tail = all(bool((r[n][:, t_end:] == 0).all()) for r in runs)
        row[n] = {"bitwise": same, "finite": fin, "tail_zero": tail}
        ok = ok and same and fin and tail
    row["ok"] = ok
    return row


def main(argv=None) -> int:
    from flashqla.testing import add_cotangents, make_gdn_inputs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--cases", nargs="*", default=None)
    ap.add_argument("--rows", nargs="*", default=list(ROWS))
    ap.add_argument("--repeat", type=int, default=3)
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    a = ap.parse_args(argv)
    results = {"cases": [], "rows": []}
    names = a.cases if a.cases is not None else list(CASES) + list(SPLIT_CASES)
    for i, name in enumerate(names):
        try:
            if name in SPLIT_CASES:
                H, HV, lengths = SPLIT_CASES[name]
                x = make_gdn_inputs(B=1, T=sum(lengths), H=H, HV=HV, K=128, V=128, seqlens=lengths, initial_state=True,
                                    seed=7 + i)
                add_cotangents(x, 8 + i)
                xd = {n: (None if t is None else t.to("cuda", torch.bfloat16 if n in ("q", "k", "v", "do") else
                                                        torch.int32 if n == "cu_seqlens" else torch.float32))
                      for n, t in x.items()}
                row = _check(name, xd, None, "on", a.repeat)
            else:
                xd, _h_dtype, t_end = _case(100 + i, **CASES[name])
                row = _check(name, xd, t_end, "auto", a.repeat)
        except Exception as e:  # noqa: BLE001 - a failing case is reported, the run goes on
            row = {"case": name, "ok": False, "error": f"{type(e).__name__}: {e}"}
        results["cases"].append(row)
        print(f"{name}: {'ok' if row['ok'] else 'FAIL ' + json.dumps(row)}", flush=True)

    from flashqla.bench.bwd_grid import select_bwd_rows
    from flashqla.bench.bwd_impls import load_bwd_impls
    from flashqla.bench.bwd_runner import BwdInputFactory
    from flashqla.bench.timing import time_cuda_graph

    impl = load_bwd_impls(("ours",))["ours"]
    fac = BwdInputFactory("cuda", 32768)
    for text in a.rows:
        heads, mix = text.split()
        (r,) = select_bwd_rows([heads], [mix])
        x = fac.get(r)
        t = {}
        for fused in ("0", "1"):
            os.environ[ENV] = fused
            f = impl.fwd(x)
            impl.bwd(x, f.saved)
            t[fused] = time_cuda_graph(lambda: impl.bwd(x, f.saved)).ms
        results["rows"].append({"row": text, "bwd_ms_separate": t["0"], "bwd_ms_fused": t["1"]})
        print(f"{text}: separate {t['0']:.3f} ms, fused {t['1']:.3f} ms, x{t['0'] / t['1']:.3f}", flush=True)
    os.environ[ENV] = "1"
    with open(os.path.join(a.out, "bwd_gva_check.json"), "w") as fh:
        json.dump(results, fh, indent=1)
    print("\n| case | result |\n|---|---|")
    for row in results["cases"]:
        print(f"| {row['case']} | {'bitwise, finite, tail zero' if row['ok'] else 'FAIL'} |")
    print("\n| row | backward, separate GVA launch (ms) | fused in pass 2 (ms) | x |\n|---|---|---|---|")
    for row in results["rows"]:
        print(f"| {row['row']} | {row['bwd_ms_separate']:.3f} | {row['bwd_ms_fused']:.3f} | "
              f"{row['bwd_ms_separate'] / row['bwd_ms_fused']:.3f} |")
    return 0 if all(r["ok"] for r in results["cases"]) else 1


if __name__ == "__main__":
    sys.exit(main())

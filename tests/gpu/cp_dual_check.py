"""One call on the GPU machine: the split path's dual launch and the gate-driven transition cut.

    python tests/gpu/cp_dual_check.py [--out DIR] [--skip-timing]

1. Dual launch against two launches (exact transitions, $FLASHQLA_CP_DUAL=0 vs 1): o, the final
   state and, from `CPInfo`, P, Q and the entering states must be bitwise equal (the run CTAs are
   the plain kernel's code; the transition CTAs read v as 0 instead of a zero tensor).
2. The cut (default ln 2^-24, and FlashQLA's -10) against exact transitions and against the fp64
   chunked result (`flashqla.bench.trusted`): o and the final state; at ln 2^-24 the cut may not move
   o by more than 1e-4 relative (a few bf16 roundings may flip) nor the fp32 final state by more
   than 1e-5, and never further from fp64 than exact mode + 1e-5; g == 0 heads (value head 0) must
   be bitwise equal to exact mode. Reports the chunks walked.
3. The backward with the cut against exact transitions (within 1e-4 relative at ln 2^-24) and fp64
   (never further than exact + 1e-5): dq, dk, dv, dg, dbeta, dh0.
5. Sweeps of the segment length (exact and cut) for planner calibration.
4. Timing (CUDA graphs, median): the forward and the backward of the single-sequence benchmark rows,
   two launches + exact, dual + exact, dual + cut at ln 2^-24, dual + cut at -10, unsplit.

Inputs: `make_gdn_inputs` with the Qwen3-Next gate, value head 0 with g == 0 and the last with g = -30
(the benchmark's). Prints a table last; writes DIR/cp_dual_check.json. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.device_check import time_graph  # noqa: E402

CASES = [  # (name, H, HV, lengths, segment_len or None (plan), block_v or None, offsets dtype)
    ("2/8 1x32768", 2, 8, [32768], None, None, torch.int32),
    ("2/8 28672+4096 L1024 BV64", 2, 8, [28672, 4096], 1024, 64, torch.int32),
    ("4/16 varlen short+empty L512", 4, 16, [5000, 0, 63, 3000, 1, 2100], 512, None, torch.int64),
    ("16/32 1x16384 L2048", 16, 32, [16384], 2048, None, torch.int32),
    ("2/8 28672+4096 L2048 BV128", 2, 8, [28672, 4096], 2048, 128, torch.int32),
]
TIMING_ROWS = ["2/8 1x4096", "2/8 1x8192", "2/8 1x16384", "2/8 1x32768", "2/8 28672+4096", "2/8 4096+4096",
               "4/16 1x32768", "8/32 1x32768", "16/32 1x32768", "16/64 1x32768", "16/64 1x8192", "32/32 1x32768",
               "32/32 1x4096", "16/16 8192x4", "16/32 1x8192", "2/8 1x131072"]
BWD_ROWS = ["2/4 1x32768", "16/32 1x32768", "2/4 1x8192"]


def _rel(a, b):
    a, b = a.double(), b.double()
    return float((a - b).norm() / b.norm().clamp_min(1e-300))


def _inputs(H, HV, lengths, dtype=torch.int32, seed=0):
    from flashqla.testing import make_gdn_inputs

    x = make_gdn_inputs(1, sum(lengths), H, HV, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda",
                        gate="qwen3next", special_heads=True, initial_state=True, seed=seed)
    x["cu_seqlens"] = x["cu_seqlens"].to(dtype)
    return x


def _fwd(x, env, **kw):
    from flashqla.cp.driver import chunk_gated_delta_rule_cp_fwd

    old = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    try:
        return chunk_gated_delta_rule_cp_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True,
                                             x["cu_seqlens"], relayout=False, return_info=True, **kw)
    finally:
        for k, v in old.items():
            os.environ.pop(k) if v is None else os.environ.__setitem__(k, v)


def check_case(name, H, HV, lengths, L, BV, cdt):
    from flashqla.bench.trusted import chunk_gdn_fp64

    x = _inputs(H, HV, lengths, cdt)
    kw = dict(cp="on", segment_len=L, block_v=BV)
    (two, i2) = _fwd(x, {"FLASHQLA_CP_DUAL": "0"}, truncate=False, **kw)
    (one, i1) = _fwd(x, {"FLASHQLA_CP_DUAL": "1"}, truncate=False, **kw)
    bit = {n: bool(torch.equal(a, b)) for n, a, b in (("o", two.o, one.o), ("final", two.final_state, one.final_state),
                                                      ("P", i2.P, i1.P), ("Q", i2.Q, i1.Q), ("S_in", i2.S_in, i1.S_in))}
    ref_o, ref_ht = chunk_gdn_fp64(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], x["cu_seqlens"])
    row = dict(case=name, bitwise=bit, finite=bool(torch.isfinite(one.o).all() and torch.isfinite(one.final_state).all()),
               exact_o=_rel(one.o, ref_o), exact_ht=_rel(one.final_state, ref_ht))
    for tag, cut in (("cut24", True), ("cut10", -10.0)):
        (tr, it) = _fwd(x, {}, truncate=cut, **kw)
        lim = it.transition_chunks
        nch = -(-(it.tables.end - it.tables.start) // 64)
        corr = it.tables.need_correction
        walked = float(lim[corr].sum()) / max(float((nch[corr, None].expand(-1, HV)).sum()), 1.0)
        row[tag] = dict(o_vs_exact=_rel(tr.o, one.o), ht_vs_exact=_rel(tr.final_state, one.final_state),
                        o=_rel(tr.o, ref_o), ht=_rel(tr.final_state, ref_ht), walked=walked,
                        head0_bitwise=bool(torch.equal(tr.o[..., 0, :], one.o[..., 0, :])),
                        finite=bool(torch.isfinite(tr.o).all() and torch.isfinite(tr.final_state).all()))
    row["limits"] = _limits_compare(x, it.tables)
    c = row["cut24"]
    row["ok"] = (row["limits"]["ok"] and all(bit.values()) and row["finite"] and c["finite"] and c["head0_bitwise"] and row["cut10"]["head0_bitwise"]
                 and c["o_vs_exact"] < 1e-4 and c["ht_vs_exact"] < 1e-5
                 and c["o"] <= row["exact_o"] + 1e-5 and c["ht"] <= row["exact_ht"] + 1e-5)
    return row


def _limits_compare(x, tables):
    """The limits kernel against the torch version on this case's g_cum_log2 (fp32 sums in another
    order may put the crossing one chunk apart exactly at the cutoff: allowed on <= 0.1% of entries)."""
    from flashqla.cp.driver import _flat, _transition_limits_torch, transition_limits
    from flashqla.cp.planner import TRUNCATE_LOG_DECAY
    from flashqla.ops.gdn.kernels.sm90.prepare import chunk_prepare_fwd

    HV = x["v"].shape[2]
    _, G2 = chunk_prepare_fwd(_flat(x["k"]), _flat(x["g"]), _flat(x["beta"]), tables.cu_seqlens, HV)
    out = dict(ok=True)
    for name, cut in (("exact", None), ("cut24", TRUNCATE_LOG_DECAY), ("cut10", -10.0)):
        a = transition_limits(G2, tables, cut).long()
        b = _transition_limits_torch(G2, tables, cut).long()
        diff = (a - b).abs()
        out[name] = int((diff > 0).sum())
        out["ok"] &= bool(diff.max() <= 1) and int((diff > 0).sum()) <= max(1, a.numel() // 1000)
    return out


def check_bwd(name, H, HV, lengths, L):
    from flashqla.bench.trusted import chunk_gdn_fp64_grads
    from flashqla.cp.driver import chunk_gated_delta_rule_cp_bwd, chunk_gated_delta_rule_cp_fwd

    x = _inputs(H, HV, lengths)
    gen = torch.Generator(device="cuda").manual_seed(1)
    do = torch.randn(x["v"].shape, generator=gen, device="cuda").to(torch.bfloat16)
    dht = torch.randn(x["initial_state"].shape, generator=gen, device="cuda")
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    f = chunk_gated_delta_rule_cp_fwd(*args, None, x["initial_state"], True, x["cu_seqlens"], cp="off")
    out = {}
    for tag, cut in (("exact", False), ("cut24", True), ("cut10", -10.0)):
        out[tag] = chunk_gated_delta_rule_cp_bwd(f.q, f.k, x["v"], x["g"], x["beta"], f.A, f.g_cum_log2, do, dht, None,
                                                 x["initial_state"], x["cu_seqlens"], cp="on", segment_len=L, truncate=cut)
    ref = chunk_gdn_fp64_grads(*args, do, dht, None, x["initial_state"], x["cu_seqlens"])
    names = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
    row = dict(case=name)
    for tag in out:
        row[tag] = {n: _rel(out[tag][i], ref[n]) for i, n in enumerate(names)}
        if tag != "exact":
            row[tag + "_vs_exact"] = {n: _rel(out[tag][i], out["exact"][i]) for i, n in enumerate(names)}
    row["ok"] = all(row["cut24_vs_exact"][n] < 1e-4 for n in names) and all(
        row["cut24"][n] <= row["exact"][n] + 1e-5 for n in names)
    return row


def _parse(row):
    heads, mix = row.split()
    H, HV = (int(v) for v in heads.split("/"))
    if "x" in mix:  # the grid's notation: 1xT is one sequence of T tokens, LxN is N sequences of L
        a, b = (int(v) for v in mix.split("x"))
        lengths = [b] if a == 1 else [a] * b
    else:
        lengths = [int(v) for v in mix.split("+")]
    return H, HV, lengths


def timing(rows, bwd_rows, cp="auto"):
    from flashqla.cp.driver import chunk_gated_delta_rule_cp_bwd, chunk_gated_delta_rule_cp_fwd
    from flashqla.ops.gdn.api import chunk_gated_delta_rule

    table = []
    variants = [("two+exact", {"FLASHQLA_CP_DUAL": "0", "FLASHQLA_CP_EXACT": "1"}),
                ("dual+exact", {"FLASHQLA_CP_DUAL": "1", "FLASHQLA_CP_EXACT": "1"}),
                ("dual+cut24", {"FLASHQLA_CP_DUAL": "1", "FLASHQLA_CP_EXACT": "0"})]
    for row in rows:
        H, HV, lengths = _parse(row)
        x = _inputs(H, HV, lengths)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True, x["cu_seqlens"])
        res = {}
        with torch.no_grad():
            res["unsplit"] = time_graph(lambda: chunk_gated_delta_rule(*args, cp="off"))
            for tag, env in variants:
                os.environ.update(env)
                res[tag] = time_graph(lambda: chunk_gated_delta_rule(*args, cp=cp))
            res["dual+cut10"] = time_graph(lambda: chunk_gated_delta_rule_cp_fwd(*args, cp=cp, truncate=-10.0,
                                                                                 relayout=False))
        os.environ["FLASHQLA_CP_EXACT"] = "0"
        table.append(("fwd " + row, res))
        print(table[-1], flush=True)
    for row in bwd_rows:
        H, HV, lengths = _parse(row)
        x = _inputs(H, HV, lengths)
        do = torch.randn_like(x["v"])
        f = chunk_gated_delta_rule_cp_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True,
                                          x["cu_seqlens"], cp="off")
        bargs = (f.q, f.k, x["v"], x["g"], x["beta"], f.A, f.g_cum_log2, do, None, None, x["initial_state"], x["cu_seqlens"])
        res = {"unsplit": time_graph(lambda: chunk_gated_delta_rule_cp_bwd(*bargs, cp="off"))}
        for tag, env in variants:
            os.environ.update(env)
            res[tag] = time_graph(lambda: chunk_gated_delta_rule_cp_bwd(*bargs, cp="auto"))
        res["dual+cut10"] = time_graph(lambda: chunk_gated_delta_rule_cp_bwd(*bargs, cp="auto", truncate=-10.0))
        os.environ["FLASHQLA_CP_EXACT"] = "0"
        table.append(("bwd " + row, res))
        print(table[-1], flush=True)
    return table


SWEEPS = ["2/8 1x32768:2048,2560,3072,4096", "16/64 1x32768:8192,16896", "16/32 1x32768:4096,5120,8192"]


def sweep(specs):
    """Forward ms at given segment lengths (dual launch; exact transitions and the default cut)."""
    from flashqla.cp.driver import chunk_gated_delta_rule_cp_fwd

    table = []
    for spec in specs:
        row, Ls = spec.split(":")
        H, HV, lengths = _parse(row)
        x = _inputs(H, HV, lengths)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True, x["cu_seqlens"])
        res = {}
        with torch.no_grad():
            for L in (int(v) for v in Ls.split(",")):
                for tag, cut in (("exact", False), ("cut24", True)):
                    res[f"L{L} {tag}"] = time_graph(lambda: chunk_gated_delta_rule_cp_fwd(
                        *args, cp="on", segment_len=L, truncate=cut, relayout=False))
        table.append(("sweep " + row, res))
        print(table[-1], flush=True)
    return table


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=".")
    ap.add_argument("--skip-timing", action="store_true")
    ap.add_argument("--rows", nargs="*", default=TIMING_ROWS)
    ap.add_argument("--bwd-rows", nargs="*", default=BWD_ROWS)
    ap.add_argument("--sweeps", nargs="*", default=SWEEPS)
    ap.add_argument("--cp", default="auto", help="the split variants' cp mode (on: the planner's best split)")
    ap.add_argument("--skip-checks", action="store_true")
    a = ap.parse_args(argv)
    result = dict(cases=[], bwd=[], timing=[], errors=[])
    for case in [] if a.skip_checks else CASES:
        try:
            result["cases"].append(check_case(*case))
            print(result["cases"][-1], flush=True)
        except Exception as e:  # noqa: BLE001 - reported, the other cases still run
            result["errors"].append(f"{case[0]}: {type(e).__name__}: {e}")
            print("ERROR", result["errors"][-1], flush=True)
    bwd_cases = (("2/8 1x8192 L1024", 2, 8, [8192], 1024), ("4/16 3000+0+5000 L512", 4, 16, [3000, 0, 5000], 512))
    for case in [] if a.skip_checks else bwd_cases:
        try:
            result["bwd"].append(check_bwd(*case))
            print(result["bwd"][-1], flush=True)
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"bwd {case[0]}: {type(e).__name__}: {e}")
            print("ERROR", result["errors"][-1], flush=True)
    if not a.skip_timing:
        try:
            result["timing"] = timing(a.rows, a.bwd_rows, a.cp)
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"timing: {type(e).__name__}: {e}")
            print("ERROR", result["errors"][-1], flush=True)
    if a.sweeps:
        try:
            result["timing"] += sweep(a.sweeps)
        except Exception as e:  # noqa: BLE001
            result["errors"].append(f"sweep: {type(e).__name__}: {e}")
            print("ERROR", result["errors"][-1], flush=True)
    with open(os.path.join(a.out, "cp_dual_check.json"), "w") as f:
        json.dump(result, f, indent=1, default=str)
    print("\n== checks")
    for r in result["cases"]:
        print(f"  {r['case']:32s} ok={r['ok']} bitwise={all(r['bitwise'].values())} exact o/ht {r['exact_o']:.2e}/{r['exact_ht']:.2e}"
              f" cut24 dvs-exact {r['cut24']['o_vs_exact']:.1e}/{r['cut24']['ht_vs_exact']:.1e} walked {r['cut24']['walked']:.2f}"
              f" cut10 o/ht {r['cut10']['o']:.2e}/{r['cut10']['ht']:.2e} walked {r['cut10']['walked']:.2f}")
    for r in result["bwd"]:
        print(f"  bwd {r['case']:28s} ok={r['ok']} exact {r['exact']} cut24-exact {r['cut24_vs_exact']} cut10 {r['cut10']}")
    print("== ms (CUDA graphs)")
    for name, res in result["timing"]:
        print(f"  {name:22s} " + "  ".join(f"{k} {v:.3f}" for k, v in res.items()))
    for e in result["errors"]:
        print("  ERROR", e)
    return 0 if not result["errors"] and all(r["ok"] for r in result["cases"] + result["bwd"]) else 1


if __name__ == "__main__":
    sys.exit(main())

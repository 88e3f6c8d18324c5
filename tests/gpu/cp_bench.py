"""Context-parallel forward timings on a Hopper GPU: unsplit vs CP (exact, both corrections, and the
gate-driven mode) on single long sequences.

    python tests/gpu/cp_bench.py [--rows 2/8 4/16 8/32 16/64] [--lengths 8192 32768] [--gate-chunks 4]
                                 [--breakdown [--profile]] [--bwd] [--out DIR]

Times with CUDA graphs (`tests/gpu/device_check.py` time_graph: warm-up, capture of several calls,
median of replays). Inputs: `device_check.gen_inputs` (q, k L2-normalised, logsigmoid / 16 gates on
every head, as FlashQLA's benchmark; an initial state), one sequence of T tokens, fixed length.
Before timing, every CP variant is compared with the unsplit output (relative RMS, bf16 vs bf16) and
a variant that disagrees by more than 2e-2 is reported as failed instead of timed. `--breakdown`
also times the pieces of one exact CP call (prepare over the segments, one recurrent launch over the
segments, the combine scan, the output correction). Prints a short table last; writes
cp_bench.json to --out. All forward configurations compile first, concurrently in worker processes.
`--bwd` also times the backward from the forward's products: the unsplit backward vs the CP backward
(`chunk_gated_delta_rule_cp_bwd`, exact), after checking every gradient agrees within 2e-2.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

from device_check import PEERS, gen_inputs, time_graph  # noqa: E402

from flashqla.testing import rel_rms  # noqa: E402

HEADS = {"2/8": (2, 8), "4/16": (4, 16), "8/32": (8, 32), "16/64": (16, 64)}
AGREE = 2e-2


def _specs(rows, lengths):
    """The kernel configurations the run uses (unsplit fixed length, CP over int32 pseudo offsets)."""
    from flashqla.cp import plan_cp
    from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v

    bf, f32, i32 = "bfloat16", "float32", "int32"
    specs = []
    for name in rows:
        H, HV = HEADS[name]
        specs += [("prepare", (H, HV, 128, bf, f32, i32, False)), ("prepare", (H, HV, 128, bf, f32, i32, True))]
        specs.append(("recurrent", (H, HV, 128, 128, pick_block_v(1, HV), bf, i32, False)))
        for T in lengths:
            for exact in (True, False):
                p = plan_cp(HV, 1, T, 128, torch.cuda.get_device_properties(0).multi_processor_count, exact=exact,
                            force=True)
                specs.append(("recurrent", (H, HV, 128, 128, p.BV, bf, i32, True)))
    return list(dict.fromkeys(specs))


def _breakdown(x, plan, tables):
    """Times of the pieces of one exact CP call (ms)."""
    from flashqla.cp import scan_segment_states
    from flashqla.cp.driver import _correct_one_sequence, _flat
    from flashqla.ops.gdn.kernels.sm90.prepare import chunk_prepare_fwd
    from flashqla.ops.gdn.kernels.sm90.recurrent import chunk_recurrent_fwd

    q, k, v, g, beta = (_flat(x[n]) for n in ("q", "k", "v", "g", "beta"))
    HV, K = v.shape[2], k.shape[3]
    pcu = tables.cu_seqlens.to(torch.int32)
    A, G2 = chunk_prepare_fwd(k, g, beta, pcu, HV)
    M = tables.M
    h0 = torch.zeros(M, HV, K, K, device="cuda")
    out = {"prepare": time_graph(lambda: chunk_prepare_fwd(k, g, beta, pcu, HV))}
    out["recurrent"] = time_graph(lambda: chunk_recurrent_fwd(q, k, v, A, G2, 1.0, h0, True, pcu, block_v=plan.BV))
    P = torch.randn(M, HV, K, K, device="cuda") / K
    Q = torch.randn(M, HV, K, K, device="cuda")
    T = q.shape[1]
    for rb in (None, 32, 16):
        out[f"scan_rb{rb}"] = time_graph(lambda rb=rb: scan_segment_states(P, Q, tables, T, None, first_from_h0=True, row_block=rb))
    o = torch.zeros_like(v)
    U = torch.randn_like(v)
    S = Q.to(v.dtype)
    out["correction"] = time_graph(lambda: _correct_one_sequence(o, U, S, T, tables.segment_len))
    return out


def _bwd_times(x, row):
    """Backward from the forward's products: unsplit vs CP (ms), after an agreement check."""
    from flashqla.cp import chunk_gated_delta_rule_cp_bwd
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd

    out = {}
    try:
        f = chunk_gated_delta_rule_fwd(**x, output_final_state=True)
        gen = torch.Generator(device="cuda").manual_seed(1)
        do = torch.randn(x["v"].shape, device="cuda", generator=gen).to(x["v"].dtype)
        dht = torch.randn(f.final_state.shape, device="cuda", generator=gen)
        args = (f.q, f.k, x["v"], x["g"], x["beta"], f.A, f.g_cum_log2, do, dht, None, x["initial_state"], x["cu_seqlens"])
        base = chunk_gated_delta_rule_bwd(*args)
        cp = chunk_gated_delta_rule_cp_bwd(*args, cp="on")
        torch.cuda.synchronize()
        agree = max(rel_rms(a, b) for a, b in zip(cp, base) if b is not None)
        out["agree"] = agree
        if not agree <= AGREE:
            out["failed"] = f"CP backward disagrees with unsplit: {agree:.2e}"
        else:
            out["unsplit_ms"] = time_graph(lambda: chunk_gated_delta_rule_bwd(*args))
            out["cp_ms"] = time_graph(lambda: chunk_gated_delta_rule_cp_bwd(*args, cp="on"))
    except Exception as exc:  # noqa: BLE001 - report and go on
        out["failed"] = f"{type(exc).__name__}: {exc}"
    print(row, "backward", out, flush=True)
    return out


def _profile(x, gate_chunks):
    """CUDA kernel time per kernel name of one exact and one gated CP call (torch.profiler)."""
    from torch.profiler import ProfilerActivity, profile

    from flashqla.cp import chunk_gated_delta_rule_cp_fwd

    for kw in (dict(cp="on"), dict(cp="on", gate_chunks=gate_chunks)):
        chunk_gated_delta_rule_cp_fwd(**x, output_final_state=True, relayout=False, **kw)
        torch.cuda.synchronize()
        with profile(activities=[ProfilerActivity.CUDA]) as prof:
            chunk_gated_delta_rule_cp_fwd(**x, output_final_state=True, relayout=False, **kw)
            torch.cuda.synchronize()
        print(kw)
        print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=14, max_name_column_width=60))


def main():
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--rows", nargs="+", default=list(HEADS), choices=list(HEADS))
    ap.add_argument("--lengths", nargs="+", type=int, default=[8192, 32768])
    ap.add_argument("--gate-chunks", type=int, default=4)
    ap.add_argument("--breakdown", action="store_true")
    ap.add_argument("--profile", action="store_true", help="with --breakdown: per-kernel CUDA times of one call")
    ap.add_argument("--no-precompile", action="store_true")
    ap.add_argument("--bwd", action="store_true", help="also time the backward, unsplit vs CP")
    ap.add_argument("--out", default=".")
    args = ap.parse_args()
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("needs a CUDA GPU of compute capability 9.0 (Hopper)")
        return 2
    from flashqla.cp import chunk_gated_delta_rule_cp_fwd, get_cp_plan
    from flashqla.ops.gdn.kernels.sm90 import precompile

    res = {"device": torch.cuda.get_device_name(), "torch": torch.__version__, "rows": []}
    if not args.no_precompile:
        t = time.time()
        specs = _specs(args.rows, args.lengths)
        precompile(specs, max_workers=min(len(specs), os.cpu_count() or 8))
        res["precompile_s"] = time.time() - t
        print(f"precompiled {len(specs)} kernels in {res['precompile_s']:.1f} s", flush=True)
    os.makedirs(args.out, exist_ok=True)
    lines = []
    for name in args.rows:
        H, HV = HEADS[name]
        for T in args.lengths:
            row = f"{name} 1x{T}"
            x = gen_inputs(H, HV, [T], varlen=False)
            variants = {
                "unsplit": dict(cp="off"),
                "cp-auto": dict(cp="auto"),
                "cp-exact": dict(cp="on"),
                "cp-rerun": dict(cp="on", correction="rerun"),
                "cp-gated": dict(cp="on", gate_chunks=args.gate_chunks),
            }
            base = chunk_gated_delta_rule_cp_fwd(**x, output_final_state=True, cp="off")
            entry = {"row": row, "H": H, "HV": HV, "T": T}
            for vname, kw in variants.items():
                plan, tables = get_cp_plan(x["q"], x["v"], None, force=kw["cp"] == "on", disable=kw["cp"] == "off",
                                           exact="gate_chunks" not in kw, gate_chunks=kw.get("gate_chunks"))
                fn = lambda kw=kw: chunk_gated_delta_rule_cp_fwd(**x, output_final_state=True, relayout=False, **kw)  # noqa: E731
                try:
                    out = fn()
                    torch.cuda.synchronize()
                    agree = (rel_rms(out.o, base.o), rel_rms(out.final_state, base.final_state))
                    if not max(agree) <= AGREE:
                        entry[vname] = {"failed": f"disagrees with unsplit: o {agree[0]:.2e} ht {agree[1]:.2e}"}
                        print(row, vname, entry[vname], flush=True)
                        continue
                    ms = time_graph(fn)
                except Exception as exc:  # noqa: BLE001 - report and go on
                    entry[vname] = {"failed": f"{type(exc).__name__}: {exc}"}
                    print(row, vname, entry[vname], flush=True)
                    continue
                entry[vname] = {"ms": ms, "split": plan.split, "L": plan.segment_len, "BV": plan.BV,
                                "predicted_x": (plan.est_unsplit / plan.est_split) if plan.est_split else None,
                                "agree_o": agree[0], "agree_ht": agree[1]}
                print(row, vname, f"{ms:.3f} ms", plan.reason, f"o vs unsplit {agree[0]:.1e}", flush=True)
            if args.bwd:
                entry["bwd"] = _bwd_times(x, row)
            if args.breakdown:
                plan, tables = get_cp_plan(x["q"], x["v"], None, force=True, exact=True)
                try:
                    entry["breakdown"] = _breakdown(x, plan, tables)
                    print(row, "breakdown (ms)", {k: round(v, 4) for k, v in entry["breakdown"].items()}, flush=True)
                    if args.profile:
                        _profile(x, args.gate_chunks)
                except Exception as exc:  # noqa: BLE001
                    entry["breakdown"] = {"failed": f"{type(exc).__name__}: {exc}"}
            res["rows"].append(entry)
            peer = PEERS.get(row, (None, None))[0]

            def cell(v):
                e = entry.get(v, {})
                return f"{e['ms']:.3f}" if "ms" in e else "fail"

            u = entry["unsplit"].get("ms")
            best = min((entry[v]["ms"] for v in ("cp-exact", "cp-rerun") if "ms" in entry.get(v, {})), default=None)
            sp = f"{u / best:.2f}x" if u and best else "-"
            lines.append(f"{row:<14} {cell('unsplit'):>8} {cell('cp-auto'):>8} {cell('cp-exact'):>8} {cell('cp-rerun'):>8} "
                         f"{cell('cp-gated'):>8} {sp:>7} {peer if peer else '-':>9}")
    with open(os.path.join(args.out, "cp_bench.json"), "w") as f:
        json.dump(res, f, indent=1)
    print()
    print("ms (CUDA graphs)  unsplit  cp-auto cp-exact cp-rerun cp-gated  exact-x  FlashQLA")
    for line in lines:
        print(line)
    if args.bwd:
        print("backward ms    unsplit       cp")
        for e in res["rows"]:
            b = e.get("bwd", {})
            cells = [f"{b[k]:.3f}" if k in b else "fail" for k in ("unsplit_ms", "cp_ms")]
            print(f"{e['row']:<14} {cells[0]:>8} {cells[1]:>8}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

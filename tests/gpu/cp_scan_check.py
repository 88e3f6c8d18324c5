"""One call on the GPU machine: the context-parallel scan kernel (`kernels/sm90/cp_scan.py`) against
the torch scans it replaces (`flashqla.cp.merge`, FLASHQLA_CP_SCAN=torch), the token kernels, and
what they save (FLASHQLA_CP_SCAN=torch turns the scans and the token kernels off together).

    python tests/gpu/cp_scan_check.py [--out DIR] [--no-op]

1. Values: for packed mixes (one sequence, two, a ragged mix with empty and 1-token sequences, 300
   short ones, one sequence ending before T), forward (with and without h0, first segments from h0
   or not) and reverse (with and without dht): kernel and torch fp32 against the fp64 torch scan,
   relative Frobenius error per output; a case fails above 1e-5 or when the kernel is more than 4x
   the torch fp32 error (+1e-7). Slots of no sequence must be exactly zero.
   The output-correction and state-gradient kernels (`kernels/sm90/cp_correct.py`) against fp64 on
   the same tables: o within 8e-3 (one bf16 rounding), E within 1e-3, rows of no corrected slot
   untouched, E zero on unflagged slots.
   The scan kernel's variants (`cp_scan.VARIANTS`) against the default one: every output bit for
   bit, forward and reverse, and each one's time. The scan given the gate-driven cut's limits
   (skipping the products of dropped transitions) against the same scan reading the zero P: bit
   for bit.
2. Times (CUDA graphs, median): the scan alone, kernel and torch, on the benchmark's split shapes;
   and, unless --no-op, the forward and backward (`chunk_gated_delta_rule_fwd` / `_bwd`, cp auto)
   with each scan.
Prints a table last, writes cp_scan_check.json to --out. Exit status 1 on any failed case.
Not collected by pytest.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.device_check import time_graph  # noqa: E402

ENV = "FLASHQLA_CP_SCAN"
#: name: (HV, lengths or None for one row, T, L)
CASES = {
    "1 seq 32768 L2048 HV8": (8, [32768], 32768, 2048),
    "1 seq 32768 L4096 HV32": (32, [32768], 32768, 4096),
    "28672+4096 L2048 HV8": (8, [28672, 4096], 32768, 2048),
    "ragged L512 HV4": (4, [500, 0, 1, 3000, 64, 4097, 0], 7662, 512),
    "300 short L256 HV2": (2, None, 30000, 256),
    "one seq ends before T L1024 HV8": (8, [5000], 9000, 1024),
}


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _bitwise(got, base) -> bool:
    """Whether two `cp_scan` results (tuples with None for an output not made) are bit for bit equal."""
    return all((a is None and b is None) or torch.equal(a, b) for a, b in zip(got, base))


def _tables(lengths, T, L, dev, gen):
    from flashqla.cp.planner import build_segment_tables

    if lengths is None:
        cuts = torch.randint(1, T, (299,), generator=gen).sort().values
        cu = torch.cat([torch.tensor([0]), cuts, torch.tensor([T])])
    else:
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)))
    return build_segment_tables(cu.to(torch.int32).to(dev), L, T=T)


def _scans(P, Q, tab, T, h0, first_from_h0, D, which):
    from flashqla.cp.merge import scan_segment_grads, scan_segment_states

    os.environ[ENV] = which
    try:
        S, fin = scan_segment_states(P, Q, tab, T, h0, first_from_h0=first_from_h0)
        G = scan_segment_grads(P, Q, tab, T, D)
    finally:
        os.environ.pop(ENV, None)
    return S, fin, G


def check_values(out):
    dev = "cuda"
    gen = torch.Generator().manual_seed(0)
    rows, ok = [], True
    for name, (HV, lengths, T, L) in CASES.items():
        for h0_on, ffh in ((False, False), (True, True), (True, False)):
            try:
                tab = _tables(lengths, T, L, dev, gen)
                M, N, K = tab.M, tab.N, 128
                P = (torch.randn(M, HV, K, K, generator=gen, dtype=torch.float64) * (0.9 / K**0.5)).to(dev)
                Q = torch.randn(M, HV, K, K, generator=gen, dtype=torch.float64).to(dev)
                h0 = torch.randn(N, HV, K, K, generator=gen, dtype=torch.float64).to(dev) if h0_on else None
                D = torch.randn(N, HV, K, K, generator=gen, dtype=torch.float64).to(dev) if h0_on else None
                ref = _scans(P, Q, tab, T, h0, ffh, D, "torch")
                f32 = lambda x: None if x is None else x.float()  # noqa: E731
                tor = _scans(f32(P), f32(Q), tab, T, f32(h0), ffh, f32(D), "torch")
                ker = _scans(f32(P), f32(Q), tab, T, f32(h0), ffh, f32(D), "kernel")
                errs = []
                for nm, r, t, k in zip(("starts", "final", "G"), ref, tor, ker):
                    ek, et = _rel(k, r), _rel(t, r)
                    errs.append(f"{nm} {ek:.1e} (torch {et:.1e})")
                    if not (ek <= 1e-5 and ek <= 4 * et + 1e-7) or not torch.isfinite(k).all():
                        ok = False
                        errs[-1] += " FAIL"
                inert = ~tab.valid
                if ker[0][inert].abs().max().item() if inert.any() else 0.0:
                    ok = False
                    errs.append("inert slots not zero FAIL")
                if ker[2][inert].abs().max().item() if inert.any() else 0.0:
                    ok = False
                    errs.append("inert G not zero FAIL")
                rows.append((name, f"h0={int(h0_on)} ffh={int(ffh)}", "; ".join(errs)))
            except Exception:
                ok = False
                rows.append((name, f"h0={int(h0_on)} ffh={int(ffh)}", "ERROR " + traceback.format_exc(limit=3)))
            print(rows[-1], flush=True)
    out["values"] = rows
    out["values_ok"] = ok
    return ok


def check_token_kernels(out):
    """cp_correct / cp_state_grads against fp64 torch on the same tables (random U, S, o, do in bf16)."""
    from flashqla.ops.gdn.kernels.sm90.cp_correct import cp_correct, cp_state_grads

    dev = "cuda"
    gen = torch.Generator().manual_seed(2)
    rows, ok = [], True
    for name, (HV, lengths, T, L) in CASES.items():
        try:
            tab = _tables(lengths, T, L, dev, gen)
            M, K = tab.M, 128
            U = torch.randn(1, T, HV, K, generator=gen).to(dev, torch.bfloat16)
            o = torch.randn(1, T, HV, K, generator=gen).to(dev, torch.bfloat16)
            do = torch.randn(1, T, HV, K, generator=gen).to(dev, torch.bfloat16)
            S = (torch.randn(M, HV, K, K, generator=gen) / K**0.5).to(dev)
            flag = tab.need_correction
            # fp64 reference (on the device), slot by slot over rows [start, end)
            st, en, fl = tab.start.tolist(), tab.end.tolist(), flag.tolist()
            want_o = o[0].double().clone()
            want_E = torch.zeros(M, HV, K, K, dtype=torch.float64, device=dev)
            sel = torch.zeros(T, dtype=torch.bool, device=dev)
            for j in range(M):
                if fl[j] and en[j] > st[j]:
                    r = slice(st[j], en[j])
                    Ur = U[0, r].double()
                    want_o[r] += torch.einsum("thk,hkv->thv", Ur, S[j].double())
                    want_E[j] = torch.einsum("thk,thv->hkv", Ur, do[0, r].double())
                    sel[r] = True
            got_o = cp_correct(o.clone(), U, S, tab.cu_seqlens, flag)
            got_E = cp_state_grads(U, do, tab.cu_seqlens, flag)
            eo = _rel(got_o[0], want_o)
            untouched = bool(torch.equal(got_o[0][~sel], o[0][~sel]))
            eE = _rel(got_E, want_E)
            zeros = bool((got_E[~flag] == 0).all())
            good = eo < 8e-3 and eE < 1e-3 and untouched and zeros and bool(torch.isfinite(got_o).all())
            ok &= good
            rows.append((name, f"o {eo:.1e} (bf16 rounding ~4e-3), rows outside untouched {untouched}; E {eE:.1e}, "
                               f"unflagged zero {zeros}" + ("" if good else " FAIL")))
        except Exception:
            ok = False
            rows.append((name, "ERROR " + traceback.format_exc(limit=3)))
        print(rows[-1], flush=True)
    out["token_kernels"] = rows
    return ok


def compare_variants(out):
    """Every scan variant against the default one: outputs bit for bit, and the time of each."""
    from flashqla.ops.gdn.kernels.sm90.cp_scan import DEFAULT_VARIANT, VARIANTS, cp_scan

    dev = "cuda"
    gen = torch.Generator().manual_seed(3)
    rows, ok = [], True
    for name, (HV, lengths, T, L) in CASES.items():
        tab = _tables(lengths, T, L, dev, gen)
        M, N, K = tab.M, tab.N, 128
        P = (torch.randn(M, HV, K, K, generator=gen) * (0.9 / K**0.5)).to(dev)
        Q = torch.randn(M, HV, K, K, generator=gen).to(dev)
        h0 = torch.randn(N, HV, K, K, generator=gen).to(dev)
        for label, kw in (("fwd h0 skip", dict(init=h0, skip_first=True)), ("fwd", dict()),
                          ("rev dht", dict(init=h0, reverse=True))):
            call = lambda v, kw=kw: cp_scan(P, Q, tab.seq_first, tab.seq_num, variant=v, **kw)  # noqa: E731
            base = call(DEFAULT_VARIANT)
            cells = []
            for v in VARIANTS:
                got = call(v)
                same = _bitwise(got, base)
                ok &= same
                cells.append(f"{v} {time_graph(lambda v=v: call(v)) * 1e3:.1f} us" + ("" if same else " DIFFERS"))
            rows.append((name, label, ", ".join(cells)))
            print(rows[-1], flush=True)
    out["variants"] = rows
    return ok


def compare_cut(out):
    """The scan told which transitions the gate-driven cut dropped (`cp_scan(limit=...)`: it skips their
    products) against the scan reading those zero P: every output bit for bit, in every variant,
    forward (h0 with and without first segments from it, none) and reverse (dht, none), with limits
    that cut some slots, none (exact walks) and every one; and the time of each."""
    from flashqla.ops.gdn.kernels.sm90.cp_scan import VARIANTS, cp_scan

    dev = "cuda"
    gen = torch.Generator().manual_seed(4)
    rows, ok = [], True
    for name, (HV, lengths, T, L) in CASES.items():
        tab = _tables(lengths, T, L, dev, gen)
        M, N, K = tab.M, tab.N, 128
        nchunks = ((tab.end - tab.start + 63) // 64).cpu()
        for cut in ("some", "none", "all"):
            if cut == "some":  # a random number of walked chunks, 0 .. all, per (slot, head)
                lim = (torch.rand(M, HV, generator=gen) * (nchunks[:, None] + 1).double()).floor().to(torch.int32)
            elif cut == "none":
                lim = nchunks[:, None].expand(M, HV).to(torch.int32)
            else:
                lim = torch.zeros(M, HV, dtype=torch.int32)
            lim = lim.to(dev).contiguous()
            live = lim.to(torch.int64) >= ((tab.end - tab.start + 63) // 64)[:, None]
            P = (torch.randn(M, HV, K, K, generator=gen) * (0.9 / K**0.5)).to(dev)
            P = torch.where(live[:, :, None, None], P, P.new_zeros(()))  # what the transition launch stores
            Q = torch.randn(M, HV, K, K, generator=gen).to(dev)
            h0 = torch.randn(N, HV, K, K, generator=gen).to(dev)
            cells = []
            for label, kw in (("fwd h0 skip", dict(init=h0, skip_first=True)), ("fwd h0", dict(init=h0)),
                              ("fwd", dict()), ("rev dht", dict(init=h0, reverse=True)), ("rev", dict(reverse=True))):
                for v in VARIANTS:
                    base = cp_scan(P, Q, tab.seq_first, tab.seq_num, variant=v, **kw)
                    got = cp_scan(P, Q, tab.seq_first, tab.seq_num, variant=v, limit=lim, seg_start=tab.start,
                                  seg_end=tab.end, **kw)
                    same = _bitwise(got, base)
                    ok &= same
                    if not same:
                        cells.append(f"{label} {v} DIFFERS")
            call = lambda lim=lim: cp_scan(P, Q, tab.seq_first, tab.seq_num, reverse=True, init=h0,  # noqa: E731
                                           **({} if lim is None else dict(limit=lim, seg_start=tab.start, seg_end=tab.end)))
            cells.append(f"rev us: {time_graph(lambda: call(None)) * 1e3:.1f} without, "
                         f"{time_graph(lambda: call(lim)) * 1e3:.1f} with the limits; live {int(live.sum())}/{M * HV}")
            rows.append((name, f"cut {cut}", "; ".join(cells)))
            print(rows[-1], flush=True)
    out["cut"] = rows
    return ok


#: (variant, value columns a CTA) of the scan measured by `compare_shapes` (None: the default width)
SHAPES = (("prefetch", None), ("smem", None), ("ahead", None), ("ahead", 8), ("ahead", 4))


#: name: (HV, T, L) of `live_head_case`: one sequence split as the backward's plan splits it
LIVE_HEAD_CASES = {"4/8 1x8192 L512": (8, 8192, 512), "4/8 1x32768 L2048": (8, 32768, 2048),
                   "8/16 1x8192 L1024": (16, 8192, 1024), "16/32 1x8192 L2048": (32, 8192, 2048)}


def live_head_case(HV: int, T: int, L: int, gen, dev: str = "cuda"):
    """A scan as the gate-driven cut leaves it on one sequence of T tokens in segments of L: value head
    0 (g == 0) walks every chunk, the others are cut after one (their P stored as 0). Returns (tables,
    P, Q, h0, the cut's keyword arguments of `cp_scan`)."""
    tab = _tables([T], T, L, dev, gen)
    M, N, K = tab.M, tab.N, 128
    nch = ((tab.end - tab.start + 63) // 64).to(torch.int32)
    lim = torch.zeros(M, HV, dtype=torch.int32, device=dev)
    lim[:, 0] = nch
    lim[:, 1:] = torch.clamp(nch, max=1)[:, None]
    lim = torch.where(tab.need_correction[:, None], lim, torch.zeros_like(lim)).contiguous()
    live = lim.to(torch.int64) >= ((tab.end - tab.start + 63) // 64)[:, None]
    P = (torch.randn(M, HV, K, K, generator=gen) * (0.9 / K**0.5)).to(dev)
    P = torch.where(live[:, :, None, None], P, P.new_zeros(()))
    Q = torch.randn(M, HV, K, K, generator=gen).to(dev)
    h0 = torch.randn(N, HV, K, K, generator=gen).to(dev)
    return tab, P, Q, h0, dict(limit=lim, seg_start=tab.start, seg_end=tab.end)


def compare_shapes(out):
    """The scan's variants and CTA widths (`SHAPES`: value columns a CTA) on the split backward's
    situation: one sequence, the gate-driven cut leaving only value head 0 (g == 0) live, forward and
    reverse: bitwise the default shape's outputs, and each one's time (CUDA graphs)."""
    from flashqla.ops.gdn.kernels.sm90.cp_scan import cp_scan, scan_slice_width

    gen = torch.Generator().manual_seed(5)
    rows, ok = [], True
    for name, (HV, T, L) in LIVE_HEAD_CASES.items():
        tab, P, Q, h0, cut = live_head_case(HV, T, L, gen)
        for label, kw in (("fwd", dict(init=h0, skip_first=True)), ("rev", dict(init=h0, reverse=True))):
            base = cp_scan(P, Q, tab.seq_first, tab.seq_num, **cut, **kw)
            cells = []
            for var, bs in SHAPES:
                if bs is not None and bs == scan_slice_width(HV):
                    continue
                call = lambda var=var, bs=bs: cp_scan(P, Q, tab.seq_first, tab.seq_num, variant=var,  # noqa: E731
                                                      slice_width=bs, **cut, **kw)
                same = _bitwise(call(), base)
                ok &= same
                cells.append(f"{var}/bs{bs or scan_slice_width(HV)} {time_graph(call) * 1e3:.1f}" + ("" if same else " DIFFERS"))
            rows.append((name, label, ", ".join(cells)))
            print(rows[-1], flush=True)
    out["shapes"] = rows
    return ok


def time_scans(out):
    dev = "cuda"
    gen = torch.Generator().manual_seed(1)
    rows = []
    for name in ("1 seq 32768 L2048 HV8", "1 seq 32768 L4096 HV32", "28672+4096 L2048 HV8", "300 short L256 HV2"):
        HV, lengths, T, L = CASES[name]
        tab = _tables(lengths, T, L, dev, gen)
        M, N, K = tab.M, tab.N, 128
        P = (torch.randn(M, HV, K, K, generator=gen) * (0.9 / K**0.5)).to(dev)
        Q = torch.randn(M, HV, K, K, generator=gen).to(dev)
        h0 = torch.randn(N, HV, K, K, generator=gen).to(dev)
        t = {}
        for which in ("torch", "kernel"):
            os.environ[ENV] = which
            from flashqla.cp.merge import scan_segment_grads, scan_segment_states

            t[which + " fwd"] = time_graph(lambda: scan_segment_states(P, Q, tab, T, h0, first_from_h0=True))
            t[which + " rev"] = time_graph(lambda: scan_segment_grads(P, Q, tab, T, h0))
            os.environ.pop(ENV, None)
        rows.append((name, *(f"{t[k] * 1e3:.1f}" for k in ("torch fwd", "kernel fwd", "torch rev", "kernel rev"))))
        print(rows[-1], flush=True)
    out["scan_us"] = rows


def time_op(out):
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
    from flashqla.testing import make_gdn_inputs

    rows = []
    for name, H, HV, lengths, bwd in (("2/8 1x32768", 2, 8, [32768], True), ("2/8 28672+4096", 2, 8, [28672, 4096], True),
                                      ("2/8 1x8192", 2, 8, [8192], False), ("16/32 1x32768", 16, 32, [32768], True)):
        T = sum(lengths)
        x = make_gdn_inputs(1, T, H, HV, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda",
                            gate="qwen3next", special_heads=True, seed=0)
        q, k, v, g, beta, cu = x["q"], x["k"], x["v"], x["g"], x["beta"], x["cu_seqlens"]
        scale = 128**-0.5
        t = {}
        for which in ("torch", "kernel"):
            os.environ[ENV] = which
            t[which + " fwd"] = time_graph(lambda: chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, None, True, cu))
            if bwd:
                f = chunk_gated_delta_rule_fwd(q, k, v, g, beta, scale, None, True, cu)
                do, dht = torch.randn_like(f.o), torch.randn_like(f.final_state)
                t[which + " bwd"] = time_graph(lambda: chunk_gated_delta_rule_bwd(f.q, f.k, v, g, beta, f.A, f.g_cum_log2,
                                                                                   do, dht, scale, None, cu), reps=10, iters=2)
            os.environ.pop(ENV, None)
        rows.append((name, *(f"{t.get(k, float('nan')):.3f}" for k in ("torch fwd", "kernel fwd", "torch bwd", "kernel bwd"))))
        print(rows[-1], flush=True)
    out["op_ms"] = rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--out", default=os.environ.get("OUT", "."))
    ap.add_argument("--no-op", action="store_true")
    a = ap.parse_args(argv)
    out = {}
    ok = check_values(out)
    ok &= check_token_kernels(out)
    ok &= compare_variants(out)
    ok &= compare_cut(out)
    ok &= compare_shapes(out)
    time_scans(out)
    if not a.no_op:
        time_op(out)
    with open(os.path.join(a.out, "cp_scan_check.json"), "w") as f:
        json.dump(out, f, indent=1)
    print("\nscan (us; CUDA graphs)   torch fwd | kernel fwd | torch rev | kernel rev")
    for r in out["scan_us"]:
        print("  ", " | ".join(r))
    if "op_ms" in out:
        print("op, cp auto (ms)         torch fwd | kernel fwd | torch bwd | kernel bwd")
        for r in out["op_ms"]:
            print("  ", " | ".join(r))
    for r in out["token_kernels"]:
        print("  ", " | ".join(r))
    print("scan with the cut's limits (DIFFERS: not bitwise the scan reading the zero P)")
    for r in out["cut"]:
        print("  ", " | ".join(r))
    print("scan variants and CTA shapes, value head 0 live (us; DIFFERS: not bitwise the default call's)")
    for r in out["shapes"]:
        print("  ", " | ".join(r))
    print("scan variants (CUDA graphs, median; DIFFERS: not bitwise the default)")
    for r in out["variants"]:
        print("  ", " | ".join(r))
    print(f"values: {'all passed' if ok else 'FAILED'} ({len(out['values'])} scan cases, {len(out['token_kernels'])} token-kernel cases)")
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())

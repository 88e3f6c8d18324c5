"""Question (issue 42's accuracy target, o and final state <= 0.8x FLA's error): does the A_beta
product in fp16 (A diag(beta) stored in fp16 by the prepare kernel, W^T and the output product's
Pg, vn^T in fp16; `build_prepare_kernel(a_dtype=)`, `build_recurrent_kernel(op_dtype=)`) lower the
forward's error against fp64 as the CPU rounding model predicts (o 0.73x, final state 0.64x of the
all-bf16 kernels; `benchmarks/journal/accuracy.md`), at the same speed? And what happens where |v|
is large (fp16's range: the plain build scales each row of W^T by a power of two first)?

Per row, the unsplit forward (prepare + recurrent, the block width the op picks) in both builds on
the same bf16 inputs (`_gpu.gen_inputs`, value head 0 with g == 0 and the last with g = -30, an
initial state), o and the final state against `reference.chunk_gated_delta_rule` in fp64 on the GPU
(relative RMS, whole tensors and the two special heads), FLA's public op on the same inputs where
`fla` is importable (its o and final-state errors, and ours over FLA's), then the CUDA-graph time of each
(`flashqla.bench.timing.time_cuda_graph`, median); then v scaled by 2^8 and 2^12 (errors and
finiteness of the fp16 build).

    python benchmarks/experiments/fp16_abeta_ab.py [--rows "16/32 4x8192,2/8 1x8192"] [--scales 1] [--repeats 3] [--no-fla]
        [--rev REV]

`--rev REV`: also the fp16 build of `kernels/sm90/recurrent.py` as it was at git revision REV (read
with `git show` where the checkout has its history, else from `--rev-file`, that file saved
beforehand: `git show REV:flashqla/ops/gdn/kernels/sm90/recurrent.py > FILE`), with this checkout's
prepare kernel, in the same alternation ("fp16 at REV" rows; its o and final state compared bitwise
with this checkout's fp16 build).

`--scales`: the v scales to run (timed at scale 1 only); `--repeats`: timings of the two builds taken
alternately this many times (bf16, fp16, bf16, ...), every one printed and the median of each build's
used for the ratio.

Rows: "h_qk/h_v COUNTxLENGTH" (this folder's notation, `_gpu.parse_row`). Prints one table.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

from _gpu import gen_inputs, parse_row  # noqa: E402


def recurrent_at(rev: str, rev_file: str | None):
    """The module `kernels/sm90/recurrent.py` as it was at git revision `rev` (or read from `rev_file`),
    loaded beside this checkout's (its imports resolve to this checkout's package)."""
    import importlib.util
    import subprocess
    import tempfile

    if rev_file is None:
        src = subprocess.run(["git", "show", f"{rev}:flashqla/ops/gdn/kernels/sm90/recurrent.py"], check=True,
                             capture_output=True, text=True).stdout
        rev_file = os.path.join(tempfile.mkdtemp(), "recurrent_rev.py")
        with open(rev_file, "w") as f:
            f.write(src)
    spec = importlib.util.spec_from_file_location("flashqla.ops.gdn.kernels.sm90.recurrent_rev", rev_file)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def run_forward(x, a_dtype, block_v, R=None):
    """prepare + recurrent on the unsplit path with the given A_beta product dtype (None: shipped);
    R: the recurrent kernel's module (default: this checkout's)."""
    from flashqla.contract import clamp_gates
    from flashqla.ops.gdn.kernels.sm90 import prepare as P
    from flashqla.ops.gdn.kernels.sm90._common import num_slots, placeholder

    if R is None:
        from flashqla.ops.gdn.kernels.sm90 import recurrent as R

    q, k, v, beta, cu, h0 = x["q"], x["k"], x["v"], x["beta"], x["cu_seqlens"], x["initial_state"]
    g = clamp_gates(x["g"])
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    N = cu.numel() - 1
    kp = P.build_prepare_kernel(*P.prepare_kernel_args(k, beta, cu, HV), a_dtype=a_dtype)
    kr = R.build_recurrent_kernel(*R.recurrent_kernel_args(q, v, cu, block_v), op_dtype=a_dtype)
    S = num_slots(B, T, N, True)
    adt = torch.float16 if a_dtype == "float16" else k.dtype
    A = torch.empty(HV, S * 64, 64, dtype=adt, device=q.device)
    G2 = torch.empty(HV, S * 64, dtype=torch.float32, device=q.device)
    o = torch.zeros_like(v)
    ht = torch.empty(N, HV, K, V, dtype=torch.float32, device=q.device)
    u, pt, lim = (placeholder((1,), dt, q.device) for dt in (q.dtype, torch.float32, torch.int32))

    def call():
        kp(k, g, beta, cu, A, G2)
        kr(q, k, v, A, G2, h0, cu, float(K ** -0.5), 1, 1, o, ht, u, pt, lim)
        return o, ht

    return call


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", default="16/32 4x8192,2/8 1x8192,32/32 8x1024,16/64 4x8192")
    ap.add_argument("--scales", default="1,256,4096", help="v scales, comma separated")
    ap.add_argument("--repeats", type=int, default=1, help="alternating timings of the two builds")
    ap.add_argument("--no-fla", action="store_true", help="leave FLA out (its columns nan)")
    ap.add_argument("--rev", default=None, help="also the fp16 recurrent build at this git revision")
    ap.add_argument("--rev-file", default=None, help="with --rev: that revision's recurrent.py, saved")
    a = ap.parse_args(argv)
    R_rev = recurrent_at(a.rev, a.rev_file) if a.rev else None
    scales = [float(x) for x in a.scales.split(",")]
    import reference
    from flashqla.bench.timing import time_cuda_graph
    from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v
    from flashqla.testing import rel_rms

    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__}")
    try:
        if a.no_fla:
            raise ImportError("--no-fla")
        os.environ["FLA_FLASH_QLA"] = "0"
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_op
    except Exception:  # noqa: BLE001 - FLA is optional here
        fla_op = None
    print(f"# FLA: {'not importable' if fla_op is None else 'fla.ops.gated_delta_rule.chunk_gated_delta_rule'}")
    print("| row | v scale | build | o err | ht err | o g=0 head | o g=-30 head | ms | o / shipped | ht / shipped "
          "| o / FLA | ht / FLA |")
    print("| --- | ---: | --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for row in a.rows.split(","):
        H, HV, lengths = parse_row(row.strip())
        for vs in scales:
            x = gen_inputs(H, HV, lengths, varlen=True)
            x["g"][..., 0] = 0.0
            x["g"][..., -1] = -30.0
            x["v"] = (x["v"].float() * vs).to(x["v"].dtype)
            ref_o, ref_h = reference.chunk_gated_delta_rule(
                *(x[n].double() for n in ("q", "k", "v", "g", "beta")), initial_state=x["initial_state"].double(),
                output_final_state=True, cu_seqlens=x["cu_seqlens"])
            bv = pick_block_v(len(lengths), HV)
            fla = (float("nan"), float("nan"))
            if fla_op is not None:
                with torch.no_grad():
                    fo, fh = fla_op(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                    output_final_state=True, cu_seqlens=x["cu_seqlens"])
                fla = (rel_rms(fo, ref_o), rel_rms(fh, ref_h))
                print(f"| {row.strip()} | {vs:g} | FLA | {fla[0]:.3e} | {fla[1]:.3e} | "
                      f"{rel_rms(fo[:, :, 0], ref_o[:, :, 0]):.3e} | {rel_rms(fo[:, :, -1], ref_o[:, :, -1]):.3e} | "
                      "| | | | |")
                del fo, fh
            res, calls, outs = {}, {}, {}
            for build in (None, "float16") + (("rev",) if R_rev is not None else ()):
                if build == "rev":
                    calls[build] = call = run_forward(x, "float16", bv, R_rev)
                else:
                    calls[build] = call = run_forward(x, build, bv)
                o, ht = call()
                torch.cuda.synchronize()
                outs[build] = (o.clone(), ht.clone())
                res[build] = [rel_rms(o, ref_o), rel_rms(ht, ref_h), rel_rms(o[:, :, 0], ref_o[:, :, 0]),
                              rel_rms(o[:, :, -1], ref_o[:, :, -1]), float("nan"), bool(torch.isfinite(o).all())]
            if "rev" in outs:
                same = all(torch.equal(a_, b_) for a_, b_ in zip(outs["rev"], outs["float16"]))
                print(f"# {row.strip()} scale {vs:g}: fp16 at {a.rev} and here bitwise equal (o, final state): {same}")
            if vs == 1.0:
                times = {b: [] for b in calls}
                for _ in range(a.repeats):
                    for b, call in calls.items():
                        times[b].append(time_cuda_graph(call).ms)
                for b in calls:
                    res[b][4] = sorted(times[b])[len(times[b]) // 2]
                label = {None: "bf16", "float16": "fp16", "rev": f"fp16 at {a.rev}"}
                print(f"# {row.strip()} timings (ms, alternating): " + "; ".join(
                    f"{label[b]} " + " ".join(f"{t:.4f}" for t in ts) for b, ts in times.items()))
            for build, r in res.items():
                base = res[None]
                name = {None: "bf16 (shipped)", "float16": "fp16 A_beta product", "rev": f"fp16 at {a.rev}"}[build]
                fin = "" if r[5] else " NONFINITE"
                print(f"| {row.strip()} | {vs:g} | {name}{fin} | {r[0]:.3e} | {r[1]:.3e} | {r[2]:.3e} | {r[3]:.3e} | "
                      f"{r[4]:.4f} | {r[0] / base[0]:.3f} | {r[1] / base[1]:.3f} | {r[0] / fla[0]:.3f} | {r[1] / fla[1]:.3f} |")
            del x, ref_o, ref_h
            torch.cuda.empty_cache()
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Do the kernels read or write memory out of bounds, misaligned, or racily? Forward and backward of
`flashqla.chunk_gated_delta_rule` (autograd) on tiny edge shapes, checked against the fp64 reference,
as a driver for NVIDIA's compute sanitizer: memcheck (out-of-bounds and misaligned global / shared
memory accesses) and racecheck (shared-memory races).

Run on the GPU machine (`source .device/on-device.sh` first), from the repository root:

    python benchmarks/experiments/sanitize.py            # plain run first: compiles the kernels into
                                                         # TileLang's disk cache (nvcc is slow under
                                                         # the sanitizer)
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 600 compute-sanitizer --tool memcheck --error-exitcode 3 \
        python benchmarks/experiments/sanitize.py
    PYTORCH_NO_CUDA_MEMORY_CACHING=1 timeout 600 compute-sanitizer --tool racecheck --error-exitcode 3 \
        python benchmarks/experiments/sanitize.py --tiny
    python benchmarks/experiments/sanitize.py --list     # the cases; --cases NAME,NAME runs some of them

PYTORCH_NO_CUDA_MEMORY_CACHING=1 gives every tensor its own cudaMalloc, so an access past the end of
a tensor is caught instead of landing in the caching allocator's neighbouring block. racecheck
tracks every shared-memory access and is slow: --tiny runs one small packed case (a chunk tail and
an empty sequence). `--tool initcheck` (reads of global memory never written) can be run the same way.
`SANITIZE=1 bash tests/gpu/run_device.sh` runs the plain pass, memcheck and racecheck after the GPU
tier (`SANITIZE=only`: nothing else).

Every case: GVA 2 (1 q/k head, 2 value heads), bf16 (one case fp16), with an initial state and a
final-state gradient; o, the final state and dq, dk, dv, dg, dbeta, dh0 against autograd of
`reference.chunk_gated_delta_rule` in fp64 on the same rounded inputs (relative RMS, budgets of
tests/gpu/test_autograd_gpu.py), every result finite, an all-zero reference matched exactly, empty
sequences' final states and dh0 exactly their initial states and dht, gradients of a packed tail past
cu_seqlens[-1] exactly zero.

Writes no file: prints one row per case (errors per quantity) and a verdict. Exit status: 0 when
every case passes, 1 on any mismatch or exception (the sanitizer's own status, 3 above, when it
reports an error).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from flashqla.testing import add_cotangents, make_gdn_inputs, rel_rms  # noqa: E402

F64 = torch.float64
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
GRAD = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}
OUTS = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")
BUDGET = {"o": 1e-2, "ht": 1e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "dg": 3e-2, "dbeta": 2e-2, "dh0": 2e-2}
TOKEN_Q = ("o", "dq", "dk", "dv", "dg", "dbeta")

#: name: case options (B, T or lengths, tail, cu_dtype, dtype, gate, special_heads, state_scale,
#: strong = g of the last value head, beta = a constant beta, tiny_dht = dht of 1e-30 (keeps dk inside
#: fp16's range next to a large state), views = transposed q, k, v, g, beta)
CASES = {
    "T=1": dict(B=1, T=1),
    "T=63 B=2": dict(B=2, T=63),
    "T=65": dict(B=1, T=65),
    "T=0 B=2": dict(B=2, T=0),
    "all-short": dict(lengths=[3, 2, 1, 5]),
    "empty-first": dict(lengths=[0, 5, 70]),
    "empty-middle": dict(lengths=[5, 0, 70]),
    "empty-last": dict(lengths=[5, 70, 0]),
    "all-empty": dict(lengths=[0, 0]),
    "int64 offsets": dict(lengths=[64, 0, 65, 1], cu_dtype=torch.int64),
    "packed tail": dict(lengths=[70, 0, 20], tail=30),
    "g == 0": dict(B=1, T=100, gate="zero", special_heads=False),
    "g = -300 head": dict(B=1, T=100, strong=-300.0),
    "beta == 0": dict(B=1, T=100, beta=0.0),
    "beta == 1": dict(B=1, T=100, beta=1.0),
    "fp16 |h0| 3e3": dict(B=1, T=100, dtype=torch.float16, state_scale=3e3, tiny_dht=True),
    "transposed views": dict(lengths=[70, 0, 60], views=True),
}
#: the one case of --tiny (racecheck)
TINY = "empty-middle"


def make_case(seed: int, B: int = 1, T: int | None = None, lengths=None, tail: int = 0, cu_dtype=torch.int32,
              dtype=torch.bfloat16, strong: float | None = None, beta: float | None = None, tiny_dht: bool = False,
              views: bool = False, **kw) -> dict:
    """Host inputs and cotangents (fp64 holding the values the device gets: q, k, v, do rounded to
    `dtype`, the rest to fp32)."""
    seqlens = None
    if lengths is not None:
        seqlens = list(lengths) + ([tail] if tail else [])
        T = sum(seqlens)
    x = make_gdn_inputs(B=B, T=T, H=1, HV=2, K=128, V=128, seqlens=seqlens, seed=seed, **kw)
    if tail:
        x["cu_seqlens"] = x["cu_seqlens"][:-1]
        x["initial_state"] = x["initial_state"][:-1]
    if x["cu_seqlens"] is not None:
        x["cu_seqlens"] = x["cu_seqlens"].to(cu_dtype)
    if strong is not None:
        x["g"][..., -1] = strong
    if beta is not None:
        x["beta"].fill_(beta)
    add_cotangents(x, seed + 1)
    if tiny_dht:
        x["dht"] = torch.full_like(x["dht"], 1e-30)
    for n in ("q", "k", "v", "do", "g", "beta", "initial_state", "dht"):
        x[n] = x[n].to(dtype if n in ("q", "k", "v", "do") else torch.float32).to(F64)
    x.update(dtype=dtype, views=views, lengths=lengths, T_valid=T - tail)
    return x


def _autograd(op, leaves, cu, do, dht) -> dict:
    o, ht = op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["initial_state"],
               output_final_state=True, cu_seqlens=cu)
    grads = torch.autograd.grad((o, ht), [leaves[n] for n in NAMES], (do, dht), allow_unused=True)
    out = {"o": o.detach(), "ht": ht.detach()}
    for n, d in zip(NAMES, grads):
        out[GRAD[n]] = torch.zeros_like(leaves[n]) if d is None else d
    return out


def run_ours(c: dict) -> dict:
    import flashqla

    dev = {}
    for n in NAMES + ("do", "dht"):
        t = c[n].to("cuda", c["dtype"] if n in ("q", "k", "v", "do") else torch.float32)
        if c["views"] and n in ("q", "k", "v", "g", "beta"):  # tokens and heads swapped in memory
            t = t.transpose(1, 2).contiguous().transpose(1, 2)
        dev[n] = t
    leaves = {n: dev[n].detach().requires_grad_(True) for n in NAMES}
    cu = None if c["cu_seqlens"] is None else c["cu_seqlens"].to("cuda")
    out = _autograd(flashqla.chunk_gated_delta_rule, leaves, cu, dev["do"], dev["dht"])
    torch.cuda.synchronize()
    return out


def run_reference(c: dict) -> dict:
    import reference

    Tv = c["T_valid"]
    leaves = {n: (c[n][:, :Tv] if n in ("q", "k", "v", "g", "beta") else c[n]).clone().requires_grad_(True) for n in NAMES}
    return _autograd(reference.chunk_gated_delta_rule, leaves, c["cu_seqlens"], c["do"][:, :Tv], c["dht"])


def check(c: dict, got: dict, ref: dict) -> tuple[dict, list[str]]:
    """Errors per quantity and the list of failures."""
    errs, bad = {}, []
    Tv = c["T_valid"]
    for n in OUTS:
        x, r = got[n], ref[n]
        if n in TOKEN_Q:
            tail, x = x[:, Tv:], x[:, :Tv]
            if n != "o" and tail.numel() and (not bool(torch.isfinite(tail).all()) or bool(tail.any())):
                bad.append(f"{n} of the packed tail not exactly 0")
        if tuple(x.shape) != tuple(r.shape):
            bad.append(f"{n} shape {tuple(x.shape)} vs {tuple(r.shape)}")
            continue
        if x.numel() == 0:
            continue
        if not bool(torch.isfinite(x).all()):
            errs[n] = float("inf")
            bad.append(f"{n} not finite")
        elif not bool(r.any()):
            errs[n] = float(x.abs().max())
            if errs[n] != 0.0:
                bad.append(f"{n}: reference exactly 0, got max {errs[n]:.2e}")
        else:
            errs[n] = rel_rms(x, r)
            if not errs[n] <= BUDGET[n]:
                bad.append(f"{n} {errs[n]:.2e} > {BUDGET[n]:.0e}")
    for i, length in enumerate(c["lengths"] or []):
        if length == 0:
            if not torch.equal(got["ht"][i].cpu().double(), c["initial_state"][i]):
                bad.append(f"final state of empty sequence {i} is not its initial state")
            if not torch.equal(got["dh0"][i].cpu().double(), c["dht"][i]):
                bad.append(f"dh0 of empty sequence {i} is not its dht")
    return errs, bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help=f"only the case {TINY!r} (for racecheck)")
    ap.add_argument("--cases", help="comma-separated case names (see --list)")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    names = [TINY] if args.tiny else (args.cases.split(",") if args.cases else list(CASES))
    unknown = [n for n in names if n not in CASES]
    if unknown:
        print(f"unknown cases {unknown}; --list shows them", file=sys.stderr)
        return 2
    if not (torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)):
        print("needs a CUDA GPU of compute capability 9.0 (Hopper)", file=sys.stderr)
        return 1
    torch.set_num_threads(min(8, torch.get_num_threads()))
    rows, failed = [], 0
    start = time.time()
    for i, name in enumerate(names):
        t0 = time.time()
        try:
            c = make_case(seed=1 + i + 10 * list(CASES).index(name), **CASES[name])
            got, ref = run_ours(c), run_reference(c)
            errs, bad = check(c, got, ref)
        except Exception:  # noqa: BLE001 - report and go on with the other cases
            errs, bad = {}, ["exception: " + traceback.format_exc().strip().splitlines()[-1]]
            traceback.print_exc()
        failed += bool(bad)
        rows.append((name, errs, bad, time.time() - t0))
        print(f"{name}: {'ok' if not bad else 'FAILED: ' + '; '.join(bad)} ({time.time() - t0:.1f} s)", flush=True)
    print()
    print(f"{'case':<18}" + "".join(f"{n:>9}" for n in OUTS) + "  result")
    for name, errs, bad, _ in rows:
        cells = "".join(f"{errs[n]:>9.1e}" if n in errs else f"{'-':>9}" for n in OUTS)
        print(f"{name:<18}{cells}  {'ok' if not bad else 'FAILED'}")
    print(f"{len(rows) - failed}/{len(rows)} cases passed in {time.time() - start:.0f} s")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())

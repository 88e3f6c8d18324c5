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
an empty sequence); --race runs the few small cases that together launch every shipped kernel kind
(`flashqla.ops.gdn.kernels.sm90.registry.BUILDERS`: plain and split path, training and inference
forward, the serving build with checkpoints, both value slice widths, fp16). Every run prints the
kernel kinds it launched and, for --race and the full list, fails when a kind was never launched.
--long runs one long sequence (T = 2^21, 2 q/k and 8 value heads, cp="on", forward and backward):
every result finite, and with --long-compare o, the final state and every gradient against the same
call with cp="off" (the split path's transition chain against the unsplit recurrence; the long
sequence is too long for the fp64 reference). `--tool initcheck` (reads of global memory never
written) can be run the same way.
`SANITIZE=1 bash tests/gpu/run_device.sh` runs the plain pass, memcheck and racecheck after the GPU
tier (`SANITIZE=only`: nothing else).

Every case but --long: GVA 2 (1 q/k head, 2 value heads), bf16 (one case fp16), with an initial state and a
final-state gradient; o, the final state and dq, dk, dv, dg, dbeta, dh0 against autograd of
`reference.chunk_gated_delta_rule` in fp64 on the same rounded inputs (relative RMS, budgets of
tests/gpu/test_autograd_gpu.py), every result finite, an all-zero reference matched exactly, empty
sequences' final states and dh0 exactly their initial states and dht, gradients of a packed tail past
cu_seqlens[-1] exactly zero. Forward-only cases (no autograd: the inference path) check o and the
final state; the serving cases (a bf16 "vk" pool by `state_indices` with a padding sequence and a
row without prior state, checkpoints at tokens 1, 63, 64, 65 and a sequence's last token; unsplit on
the serving build, and split with cp="on", whose checkpoints come from the segments) check o, the
pool rows written, the rows left alone (bitwise) and the checkpoints against the fp64 reference
given the same arguments.

Writes no file: prints one row per case (errors per quantity) and a verdict. Exit status: 0 when
every case passes, 1 on any mismatch or exception (the sanitizer's own status, 3 above, when it
reports an error).
"""
from __future__ import annotations

import argparse
import functools
import importlib
import math
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
    "cp on": dict(lengths=[300, 0, 700], cp="on"),
    "cp on, inference": dict(lengths=[300, 0, 700], cp="on", grad=False),
    "cp on, fixed length": dict(B=2, T=600, cp="on"),
    "many short (BV 128)": dict(lengths=[1 + (7 * i) % 9 for i in range(40)]),
    "fp16 cp on": dict(lengths=[200, 0, 600], dtype=torch.float16, cp="on"),
    "serving": dict(lengths=[70, 0, 65, 5, 130], serving=True),
    "serving cp on": dict(lengths=[2000, 0, 65, 5, 4100], serving=True, cp="on"),
    "serving cp on, small": dict(lengths=[300, 0, 65, 5, 700], serving=True, cp="on"),
    "fwd unsplit, bwd split": dict(lengths=[700, 0, 130, 300], functional=("off", "on")),
    "fwd split kept, bwd unsplit": dict(lengths=[700, 0, 130, 300], functional=("on", "off")),
}
#: the one case of --tiny (racecheck)
TINY = "empty-middle"
#: --race: small cases that together launch every kernel kind (racecheck)
RACE = ("empty-middle", "cp on", "cp on, inference", "cp on, fixed length", "many short (BV 128)", "fp16 cp on", "serving",
        "serving cp on, small", "fwd unsplit, bwd split", "fwd split kept, bwd unsplit")
#: --long: one long sequence at 2 q/k and 8 value heads, split path (FLA #733, #740)
LONG = dict(T=2**21, H=2, HV=8)


def make_case(seed: int, B: int = 1, T: int | None = None, lengths=None, tail: int = 0, cu_dtype=torch.int32,
              dtype=torch.bfloat16, strong: float | None = None, beta: float | None = None, tiny_dht: bool = False,
              views: bool = False, cp: str | None = None, grad: bool = True, serving: bool = False, functional=None,
              **kw) -> dict:
    """Host inputs and cotangents (fp64 holding the values the device gets: q, k, v, do rounded to
    `dtype`, the rest to fp32). cp: the op's cp mode (None: its default); grad: through autograd
    (False: the forward alone, under no_grad); serving: the pooled call of `serving_arguments`;
    functional: (forward cp, backward cp) through `chunk_gated_delta_rule_fwd` / `_bwd` instead of
    autograd (`run_functional`)."""
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
    x.update(dtype=dtype, views=views, lengths=lengths, T_valid=T - tail, cp=cp, grad=grad and not serving,
             functional=functional,
             serving=serving_arguments(x, seed + 2) if serving else None)
    return x


def serving_arguments(x: dict, seed: int) -> dict:
    """The serving case's pooled call (`flashqla.serving`): a bf16 "vk" pool of N + 3 rows (random
    states), sequence n on row (3 n + 1) mod P, the third sequence padding (-1), the fourth without
    prior state, checkpoints at tokens 1, 63, 64, 65 and the last token of every sequence that is
    not padding (global offsets), bf16 checkpoint states."""
    cu = x["cu_seqlens"].tolist()
    N, HV = len(cu) - 1, x["v"].shape[2]
    K, V = x["q"].shape[-1], x["v"].shape[-1]
    P = N + 3
    gen = torch.Generator().manual_seed(seed)
    pool = (torch.randn(P, HV, V, K, generator=gen) * 0.3).to(torch.bfloat16).to(F64)
    idx = [(3 * n + 1) % P for n in range(N)]
    idx[2] = -1
    has = [n != 3 for n in range(N)]
    pos = sorted({cu[n] + j for n in range(N) if idx[n] >= 0 for j in (1, 63, 64, 65, cu[n + 1] - cu[n])
                  if 1 <= j <= cu[n + 1] - cu[n]})
    return dict(pool=pool, state_indices=torch.tensor(idx, dtype=torch.int32),
                has_initial_state=torch.tensor(has), checkpoint_positions=torch.tensor(pos, dtype=torch.int64))


def _autograd(op, leaves, cu, do, dht) -> dict:
    o, ht = op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["initial_state"],
               output_final_state=True, cu_seqlens=cu)
    grads = torch.autograd.grad((o, ht), [leaves[n] for n in NAMES], (do, dht), allow_unused=True)
    out = {"o": o.detach(), "ht": ht.detach()}
    for n, d in zip(NAMES, grads):
        out[GRAD[n]] = torch.zeros_like(leaves[n]) if d is None else d
    return out


def _forward(op, t: dict, cu, cp_kw: dict, want_final: bool = True) -> dict:
    """The forward alone under no_grad: o and the final state."""
    with torch.no_grad():
        o, ht = op(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=t["initial_state"],
                   output_final_state=want_final, cu_seqlens=cu, **cp_kw)
    return {"o": o, "ht": ht}


def _serve(op, t: dict, cu, sv: dict, device, state_dtype) -> dict:
    """The pooled call: o, the pool after the call and the checkpoint states."""
    pool = sv["pool"].to(device, state_dtype)
    M, HV, V, K = len(sv["checkpoint_positions"]), *pool.shape[1:]
    cks = torch.full((M, HV, V, K), float("nan"), dtype=state_dtype, device=device)
    with torch.no_grad():
        o, ret = op(t["q"], t["k"], t["v"], t["g"], t["beta"], initial_state=pool, output_final_state=True,
                    cu_seqlens=cu, state_indices=sv["state_indices"].to(device),
                    has_initial_state=sv["has_initial_state"].to(device), state_layout="vk",
                    checkpoint_positions=sv["checkpoint_positions"].to(device), checkpoint_states=cks)
    assert ret is pool, "with state_indices the op returns the pool itself"
    return {"o": o, "pool": pool, "ckpt": cks}


def run_functional(dev: dict, cu, cps: tuple) -> dict:
    """Forward and backward through the functional API with different cp modes: ("off", "on") keeps A
    and g_cum_log2 in the caller's slots and splits the backward longest first (the relayout to the
    segments' slots and the launch-order kernel); ("on", "off") keeps the split forward's states and
    runs the backward unsplit (the relayout back to the caller's slots)."""
    import dataclasses

    import flashqla
    from flashqla.cp.plan import plan_for

    f = flashqla.chunk_gated_delta_rule_fwd(dev["q"], dev["k"], dev["v"], dev["g"], dev["beta"],
                                            initial_state=dev["initial_state"], output_final_state=True, cu_seqlens=cu,
                                            cp=cps[0], keep_cp_states=cps[0] == "on")
    kw = {}
    if cps[1] == "on":
        plan = plan_for(dev["q"], dev["v"], cu, force=True, exact=True, backward=True)
        kw["plan"] = dataclasses.replace(plan, longest_first=True)
    else:
        kw["cp"] = "off"
    grads = flashqla.chunk_gated_delta_rule_bwd(f.q, f.k, dev["v"], dev["g"], dev["beta"], f.A, f.g_cum_log2, dev["do"],
                                                dev["dht"], None, dev["initial_state"], cu, cp_saved=f.cp_saved, **kw)
    return {"o": f.o, "ht": f.final_state, **dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), grads))}


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
    op = flashqla.chunk_gated_delta_rule
    if c["cp"] is not None:
        op = functools.partial(op, cp=c["cp"])
    if c["functional"] is not None:
        out = run_functional(dev, cu, c["functional"])
    elif c["serving"] is not None:
        from flashqla.ops.gdn import serving as op_serving

        out = _serve(op, dev, cu, c["serving"], "cuda", torch.bfloat16)
        print(f"  serving path: {op_serving.LAST_PATH}", flush=True)
    elif not c["grad"]:
        out = _forward(op, dev, cu, {})
    else:
        out = _autograd(op, leaves, cu, dev["do"], dev["dht"])
    torch.cuda.synchronize()
    return out


def run_reference(c: dict) -> dict:
    import reference

    Tv = c["T_valid"]
    leaves = {n: (c[n][:, :Tv] if n in ("q", "k", "v", "g", "beta") else c[n]).clone().requires_grad_(True) for n in NAMES}
    if c["serving"] is not None:
        return _serve(reference.chunk_gated_delta_rule, leaves, c["cu_seqlens"], c["serving"], "cpu", F64)
    if not c["grad"]:
        return _forward(reference.chunk_gated_delta_rule, leaves, c["cu_seqlens"], {})
    return _autograd(reference.chunk_gated_delta_rule, leaves, c["cu_seqlens"], c["do"][:, :Tv], c["dht"])


def check_serving(c: dict, got: dict, ref: dict) -> tuple[dict, list[str]]:
    """The serving case: o, the pool rows written and the checkpoints against the fp64 reference
    (budget of o); rows no sequence names and the padding sequence's row bitwise unchanged."""
    errs, bad = {}, []
    sv = c["serving"]
    written = sorted(int(i) for i in sv["state_indices"] if int(i) >= 0)
    untouched = [r for r in range(sv["pool"].shape[0]) if r not in written]
    pool = got["pool"].cpu().double()
    if not torch.equal(pool[untouched], sv["pool"][untouched]):
        bad.append(f"pool rows {untouched} (no sequence writes them) changed")
    pairs = {"o": (got["o"], ref["o"]), "pool": (pool[written], ref["pool"][written]), "ckpt": (got["ckpt"], ref["ckpt"])}
    for n, (x, r) in pairs.items():
        x = x.cpu().double()
        if not bool(torch.isfinite(x).all()):
            errs[n] = float("inf")
            bad.append(f"{n} not finite")
            continue
        errs[n] = rel_rms(x, r)
        if not errs[n] <= BUDGET["o"]:
            bad.append(f"{n} {errs[n]:.2e} > {BUDGET['o']:.0e}")
    return errs, bad


def check(c: dict, got: dict, ref: dict) -> tuple[dict, list[str]]:
    """Errors per quantity and the list of failures (forward-only cases: o and the final state)."""
    if c["serving"] is not None:
        return check_serving(c, got, ref)
    errs, bad = {}, []
    Tv = c["T_valid"]
    for n in OUTS:
        if n not in got:
            continue
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
            if c["grad"] and not torch.equal(got["dh0"][i].cpu().double(), c["dht"][i]):
                bad.append(f"dh0 of empty sequence {i} is not its dht")
    return errs, bad


class LaunchRecorder:
    """Records which kernel kinds (`registry.BUILDERS`) launch while it is installed: each kind's
    builder is wrapped in its module (the op looks builders up there at every launch) so that the
    kernel it returns records its kind when called. The recurrent kernel's serving build
    (indexed=True) and its split-path build (dual=True) are told apart from the plain one."""

    def __init__(self):
        from flashqla.ops.gdn.kernels.sm90 import registry

        self.kinds = registry.BUILDERS
        self.launched: dict[str, int] = {}
        self._saved = []
        for kind, (module, name) in self.kinds.items():
            mod = importlib.import_module(f"{registry._PKG}.{module}")
            orig = getattr(mod, name)
            if kind == "recurrent_serving" or any(orig is o for _, _, o in self._saved):
                continue  # the serving build goes through build_recurrent_kernel(..., indexed=True)
            self._saved.append((mod, name, orig))
            setattr(mod, name, self._wrap(kind, orig))

    def _wrap(self, kind, orig):
        rec = self

        class Recorded:
            def __init__(self, kernel, label):
                self._kernel, self._label = kernel, label

            def __call__(self, *a, **kw):
                rec.launched[self._label] = rec.launched.get(self._label, 0) + 1
                return self._kernel(*a, **kw)

            def __getattr__(self, attr):
                return getattr(self._kernel, attr)

        @functools.wraps(orig)
        def build(*a, **kw):
            label = kind
            if kind == "recurrent" and kw.get("indexed"):
                label = "recurrent_serving"
            elif kind == "recurrent" and (kw.get("dual") or (len(a) > 8 and a[8])):
                label = "recurrent (dual)"
            return Recorded(orig(*a, **kw), label)

        return build

    def missing(self) -> list[str]:
        want = set(self.kinds) | {"recurrent (dual)"}
        return sorted(want - set(self.launched))

    def close(self) -> None:
        for mod, name, orig in self._saved:
            setattr(mod, name, orig)


def long_inputs(T: int, H: int, HV: int, K: int = 128, V: int = 128, seed: int = 7) -> dict:
    """`make_gdn_inputs`' domain drawn on the GPU (fp64 on the host would take 16 GB for v alone):
    q, k L2-normalised, v ~ N(0, 1) in bf16; Qwen3-Next gates with value head 0 at g == 0 and the
    last at STRONG_DECAY_G; beta = sigmoid(N(0, 1)); an initial state and the cotangents do, dht."""
    from flashqla.testing import STRONG_DECAY_G, qwen3next_gate

    gen = torch.Generator(device="cuda").manual_seed(seed)

    def randn(*shape):
        return torch.randn(*shape, generator=gen, device="cuda", dtype=torch.float32)

    x = {"q": torch.nn.functional.normalize(randn(1, T, H, K), dim=-1).bfloat16(),
         "k": torch.nn.functional.normalize(randn(1, T, H, K), dim=-1).bfloat16(),
         "v": randn(1, T, HV, V).bfloat16(), "beta": torch.sigmoid(randn(1, T, HV))}
    A_log = torch.log(torch.linspace(1, 16, HV, device="cuda"))
    dt = torch.exp(torch.linspace(math.log(1e-3), math.log(1e-1), HV, device="cuda"))
    x["g"] = qwen3next_gate(randn(1, T, HV), A_log, dt + torch.log(-torch.expm1(-dt))).float()
    x["g"][..., 0] = 0.0
    x["g"][..., -1] = STRONG_DECAY_G
    x["initial_state"] = randn(1, HV, K, V)
    x["do"] = randn(1, T, HV, V).bfloat16()
    x["dht"] = randn(1, HV, K, V)
    return x


def run_long(compare: bool) -> tuple[dict, list[str]]:
    """--long: T = 2^21 tokens of one sequence, 2 q/k and 8 value heads, bf16, cp="on", forward and
    backward through autograd. Every result finite; with `compare`, each quantity against the same
    call with cp="off" (relative RMS; budget of that quantity against fp64, since both sides carry
    their own bf16 rounding)."""
    import flashqla

    dev = long_inputs(**LONG)
    runs = {}
    for cp in (("on", "off") if compare else ("on",)):
        leaves = {n: dev[n].detach().requires_grad_(True) for n in NAMES}
        t0 = time.time()
        runs[cp] = _autograd(functools.partial(flashqla.chunk_gated_delta_rule, cp=cp), leaves, None, dev["do"], dev["dht"])
        torch.cuda.synchronize()
        print(f"long T={LONG['T']} {LONG['H']}/{LONG['HV']} cp={cp}: {time.time() - t0:.1f} s", flush=True)
    errs, bad = {}, []
    for n in OUTS:
        x = runs["on"][n]
        if not bool(torch.isfinite(x).all()):
            errs[n] = float("inf")
            bad.append(f"{n} not finite (cp on)")
        elif compare:
            errs[n] = rel_rms(x, runs["off"][n])
            if not errs[n] <= BUDGET[n]:
                bad.append(f"{n}: cp on vs off {errs[n]:.2e} > {BUDGET[n]:.0e}")
    return errs, bad


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0], formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--tiny", action="store_true", help=f"only the case {TINY!r}")
    ap.add_argument("--race", action="store_true", help="the small cases that launch every kernel kind (for racecheck)")
    ap.add_argument("--long", action="store_true", help=f"only the long case (T = {LONG['T']}, cp on)")
    ap.add_argument("--long-compare", action="store_true", help="with --long: also cp off, and compare")
    ap.add_argument("--cases", help="comma-separated case names (see --list)")
    ap.add_argument("--list", action="store_true", help="print the case names and exit")
    args = ap.parse_args(argv)
    if args.list:
        print("\n".join(CASES))
        return 0
    names = [TINY] if args.tiny else list(RACE) if args.race else (args.cases.split(",") if args.cases else list(CASES))
    names = [] if args.long else names
    whole = args.race or not (args.tiny or args.cases or args.long)  # must launch every kernel kind
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
    recorder = LaunchRecorder()
    if args.long:
        t0 = time.time()
        try:
            errs, bad = run_long(args.long_compare)
        except Exception:  # noqa: BLE001
            errs, bad = {}, ["exception: " + traceback.format_exc().strip().splitlines()[-1]]
            traceback.print_exc()
        failed += bool(bad)
        rows.append(("long" + (" (cp on vs off)" if args.long_compare else ""), errs, bad, time.time() - t0))
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
    recorder.close()
    print()
    cols = OUTS + ("pool", "ckpt")
    print(f"{'case':<22}" + "".join(f"{n:>9}" for n in cols) + "  result")
    for name, errs, bad, _ in rows:
        cells = "".join(f"{errs[n]:>9.1e}" if n in errs else f"{'-':>9}" for n in cols)
        print(f"{name:<22}{cells}  {'ok' if not bad else 'FAILED'}")
    print("kernels launched: " + ", ".join(f"{k} x{n}" for k, n in sorted(recorder.launched.items())))
    missing = recorder.missing()
    if missing:
        print(f"kernel kinds never launched: {', '.join(missing)}" + (" (FAILED: this run must launch every kind)" if whole else ""))
    failed_cover = whole and bool(missing)
    print(f"{len(rows) - failed}/{len(rows)} cases passed in {time.time() - start:.0f} s")
    return 1 if failed or failed_cover else 0


if __name__ == "__main__":
    sys.exit(main())

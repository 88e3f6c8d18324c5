"""GPU tier (slow): `flashqla.chunk_gated_delta_rule` is deterministic, forward and backward.

- Repeated runs: the public op with autograd (o, final state, dq, dk, dv, dg, dbeta, dh0), run
  REPEATS times on the same inputs, gives bitwise the same results every time. Before each run the
  CUDA caching allocator is refilled with a different value (NaN, 0, 1e30, -1, ...), so that a read
  of memory no kernel wrote would change the results (or make them non-finite).
- CUDA graph: one graph captures the forward and the backward (torch.autograd.grad); its replays
  give bitwise the eager results, on the captured inputs and on new data copied into them (with a
  new sequence mix, same shapes, for packed input).

Fixed length (B = 2) and packed sequences (with an empty and a one-token sequence), GVA 2 (H = 2,
HV = 4), bf16 q, k, v. The kernels use no atomics and no split reductions, so bitwise equality is
the contract, not a tolerance.

Run on the GPU machine: `pytest -m slow tests/gpu/test_determinism_gpu.py -v -s`. Skips cleanly
without a Hopper GPU.
"""

from __future__ import annotations

import math

import pytest
import torch

from flashqla.testing import add_cotangents, make_gdn_inputs

pytestmark = [pytest.mark.gpu, pytest.mark.slow]

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not HOPPER:
    pytest.skip("needs a CUDA GPU of compute capability 9.0 (Hopper)", allow_module_level=True)

import flashqla  # noqa: E402

DEV = "cuda"
OP = flashqla.chunk_gated_delta_rule
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
OUTS = ("o", "ht", "dq", "dk", "dv", "dg", "dbeta", "dh0")
REPEATS = 5
POISON = (math.nan, 0.0, 1e30, -1.0, math.inf)

CASES = {  # id: (B, T, packed lengths or None)
    "fixed": (2, 1000, None),
    "varlen": (1, None, [300, 0, 1, 64, 700, 129, 900]),
}
#: the graph's second input: same shapes, another sequence mix (same count), other values
NEW_MIX = {"fixed": None, "varlen": [1000, 93, 0, 500, 1, 300, 200]}


def _inputs(name: str, seed: int, lengths=None) -> dict:
    """Device inputs and cotangents of a case (bf16 q, k, v, do; fp32 g, beta, states)."""
    B, T, default = CASES[name]
    lengths = default if lengths is None else lengths
    if lengths is not None:
        T = sum(lengths)
    x = add_cotangents(make_gdn_inputs(B=B, T=T, H=2, HV=4, K=128, V=128, seqlens=lengths, seed=seed), seed + 1)
    out = {}
    for n, t in x.items():
        if t is None or n == "cu_seqlens":
            out[n] = None if t is None else t.to(DEV)
        else:
            out[n] = t.to(DEV, torch.bfloat16 if n in ("q", "k", "v", "do") else torch.float32)
    return out


def _poison_allocator(value: float, mib: int = 512) -> None:
    """Refills the caching allocator's free memory (a large block and small segments) with `value`."""
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    big = torch.full((mib << 18,), value, dtype=torch.float32, device=DEV)
    small = [torch.full((1 << 18,), value, dtype=torch.float32, device=DEV) for _ in range(32)]
    torch.cuda.synchronize()
    del big, small


def _step(leaves: dict, x: dict) -> tuple:
    """Forward and backward through the public op: (o, ht, dq, dk, dv, dg, dbeta, dh0)."""
    o, ht = OP(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["initial_state"],
               output_final_state=True, cu_seqlens=x["cu_seqlens"])
    grads = torch.autograd.grad((o, ht), [leaves[n] for n in NAMES], (x["do"], x["dht"]))
    return (o.detach(), ht.detach()) + tuple(grads)


def _leaves(x: dict) -> dict:
    return {n: x[n].detach().clone().requires_grad_(True) for n in NAMES}


def _eager(x: dict) -> dict:
    out = _step(_leaves(x), x)
    torch.cuda.synchronize()
    return {n: t.clone() for n, t in zip(OUTS, out)}


def _differences(a: dict, b: dict) -> list[str]:
    return [n for n in OUTS if not torch.equal(a[n], b[n])]


@pytest.mark.parametrize("name", list(CASES))
def test_repeated_runs_are_bitwise_identical(name):
    x = _inputs(name, seed=11)
    runs = []
    for i in range(REPEATS):
        _poison_allocator(POISON[i % len(POISON)])
        runs.append(_eager(x))
    for n in OUTS:
        assert bool(torch.isfinite(runs[0][n]).all()), f"{name}: {n} not finite"
    bad = {i: _differences(runs[0], r) for i, r in enumerate(runs[1:], 1)}
    bad = {i: d for i, d in bad.items() if d}
    print(f"{name}: {REPEATS} runs, differing from the first: {bad or 'none'}")
    assert not bad, f"{name}: runs differ from the first in {bad}"


@pytest.mark.parametrize("name", list(CASES))
def test_cuda_graph_replay_is_bitwise_the_eager_result(name):
    """One CUDA graph of forward + backward: replays equal eager runs bitwise, on the captured data
    and after new data (and, packed, a new sequence mix) is copied into the graph's inputs."""
    xa, xb = _inputs(name, seed=21), _inputs(name, seed=22, lengths=NEW_MIX[name])
    eager_a, eager_b = _eager(xa), _eager(xb)

    static = {n: (None if t is None else t.clone()) for n, t in xa.items()}
    leaves = _leaves(static)
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):  # warm up off the default stream, as graph capture wants
        for _ in range(3):
            _step(leaves, static)
    torch.cuda.current_stream().wait_stream(side)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        captured = _step(leaves, static)
    out = dict(zip(OUTS, captured))

    bad = []
    for replay in range(3):
        graph.replay()
        torch.cuda.synchronize()
        d = _differences(out, eager_a)
        if d:
            bad.append(f"replay {replay} on the captured data: {d}")
    with torch.no_grad():
        for n in NAMES:
            leaves[n].copy_(xb[n])
        for n in ("do", "dht", "cu_seqlens"):
            if static[n] is not None:
                static[n].copy_(xb[n])
    for replay in range(2):
        graph.replay()
        torch.cuda.synchronize()
        d = _differences(out, eager_b)
        if d:
            bad.append(f"replay {replay} on new data: {d}")
    for n in OUTS:
        assert bool(torch.isfinite(out[n]).all()), f"{name}: {n} not finite after replay"
    print(f"{name}: graph replays vs eager: {bad or 'all bitwise equal'}")
    assert not bad, f"{name}: " + "; ".join(bad)


@pytest.mark.parametrize("H,HV,lengths", [(16, 32, [8192] * 4), (8, 32, [8192] * 4), (16, 64, [8192] * 2)],
                         ids=["16-32-4x8192", "8-32-4x8192", "16-64-2x8192"])
def test_prepare_with_several_value_heads_a_cta_is_bitwise_repeatable(H, HV, lengths):
    """The prepare kernel where a CTA takes all G = HV / H value heads of its chunk (the grid is large
    enough, `prepare.pick_heads_per_cta`; the op's small cases above take one head a CTA), launched 20
    times back to back into buffers of their own: A and g_cum_log2 bitwise the same every time. Each
    head's A tile goes out of one shared staging tile by TMA store while the next head writes it: a
    missing barrier there (journal `reliability.md`, "A race in the prepare kernel") lets A differ from launch to launch; the serving page's
    gates at such shapes saw o off by 1e-3 to 1e-2 relative and batch invariance broken."""
    from flashqla.ops.gdn.kernels.sm90.prepare import chunk_prepare_fwd, pick_heads_per_cta
    from flashqla.ops.gdn.kernels.sm90._common import num_slots

    x = make_gdn_inputs(B=1, T=sum(lengths), H=H, HV=HV, K=128, V=128, seqlens=lengths, seed=3)
    k = x["k"].to(DEV, torch.bfloat16)
    g, beta = x["g"].to(DEV, torch.float32), x["beta"].to(DEV, torch.float32)
    cu = x["cu_seqlens"].to(DEV, torch.int32)
    S = num_slots(1, sum(lengths), len(lengths), True)
    assert pick_heads_per_cta(S, H, HV) is None, "the case must take several value heads a CTA"
    # outputs filled with a constant first: the spare slots past the last sequence (`num_slots` rounds
    # up) are not written by the kernel, and torch.empty would leave whatever the allocator had there
    runs = [chunk_prepare_fwd(k, g, beta, cu, HV, A=torch.full((HV, S * 64, 64), 7.0, dtype=k.dtype, device=DEV),
                              g_cum_log2=torch.full((HV, S * 64), 7.0, dtype=torch.float32, device=DEV))
            for _ in range(20)]
    torch.cuda.synchronize()
    bad = [i for i, (A, gc) in enumerate(runs[1:], 1) if not (torch.equal(A, runs[0][0]) and torch.equal(gc, runs[0][1]))]
    print(f"{H}/{HV} {len(lengths)}x{lengths[0]}: 20 launches, differing from the first: {bad or 'none'}")
    assert not bad, f"prepare launches {bad} differ bitwise from the first"

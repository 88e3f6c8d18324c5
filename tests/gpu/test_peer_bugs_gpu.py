"""GPU tier: the peers' public bug reports, pinned as tests of our op (none of them is a bug of ours
that we know of; each test makes sure it never becomes one).

- Empty segments in the middle of a batch (FlashQLA 7fd5525; vllm-ascend #11807): packed batches
  with empty sequences between, before and after others, the caching allocator refilled with NaN,
  intra-device context parallelism off and forced on, forward and every gradient against fp64.
- o scaled over the wrong slice (FlashQLA 2ef89a7): scale = 0.3 at both value-slice widths (the
  forward launchers' `block_v` 64 and 128), o and the final state against fp64.
- dh0 written only when the final state's gradient is given (FlashQLA 596ece2): an initial state
  that requires grad, `output_final_state=False`, the allocator refilled with NaN: dh0 against fp64.
- Two CUDA streams sharing the op at once (FlashInfer #4476, scratch buffers shared across streams):
  two different batches launched back to back on two streams, forward and backward, many rounds,
  bitwise equal to each batch run alone on the default stream.

(The missing-fence report, FlashQLA c4d7234, is covered by `SANITIZE=1 tests/gpu/run_device.sh`:
compute-sanitizer's racecheck on every shipped kernel.)

Run on the GPU machine: `pytest tests/gpu/test_peer_bugs_gpu.py -v -s`. Skips without a Hopper GPU.
"""

from __future__ import annotations

import pytest
import torch

pytestmark = pytest.mark.gpu

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not HOPPER:
    pytest.skip("needs a CUDA GPU of compute capability 9.0 (Hopper)", allow_module_level=True)

import flashqla  # noqa: E402
import reference  # noqa: E402
from flashqla.testing import make_gdn_inputs, rel_rms  # noqa: E402
from test_edge_gpu import BUDGET, NAMES, _autograd, _case, _compare, _poison_allocator, _ref  # noqa: E402

DEV = "cuda"
OP = flashqla.chunk_gated_delta_rule


def _device_leaves(c: dict) -> tuple[dict, dict]:
    """The case's tensors on the GPU (q, k, v, do in its dtype; the rest fp32) and the leaves that
    require grad."""
    dev = {}
    for n in NAMES + ("do", "dht", "cu_seqlens"):
        t = c[n]
        if t is not None:
            t = t.to(DEV) if n == "cu_seqlens" else t.to(DEV, c["dtype"] if n in ("q", "k", "v", "do") else torch.float32)
        dev[n] = t
    leaves = {n: (None if dev[n] is None else dev[n].detach().requires_grad_(True)) for n in NAMES}
    return dev, leaves


#: lengths of the packed batches: the issue's offsets [0, 128, 128, 256] and sequence lists, and
#: one long sequence among empty ones (so that cp="on" has a sequence to split)
EMPTY_MID = {
    "128-0-128": [128, 0, 128],
    "5-0-63-0-64-130": [5, 0, 63, 0, 64, 130],
    "0-0-70": [0, 0, 70],
    "70-0-0": [70, 0, 0],
    "0-0-4096-0-5": [0, 0, 4096, 0, 5],
}


@pytest.mark.parametrize("cp", ["off", "on"])
@pytest.mark.parametrize("name", list(EMPTY_MID))
def test_empty_segments_in_the_middle(name, cp):
    """Empty sequences anywhere in a packed batch, cp off and forced on, allocator poisoned: o, the
    final state and every gradient against fp64; an empty sequence's final state is its initial
    state and its dh0 is its dht, exactly."""
    lengths = EMPTY_MID[name]
    c = _case(seed=700 + len(lengths), lengths=lengths)
    dev, leaves = _device_leaves(c)
    _poison_allocator()
    got = _autograd(OP, leaves, dev["cu_seqlens"], dev["do"], dev["dht"], cp=cp)
    torch.cuda.synchronize()
    _compare(f"{name} cp={cp}", got, _ref(c))
    for n, length in enumerate(lengths):
        if length == 0:
            assert torch.equal(got["ht"][n], dev["initial_state"][n]), f"final state of empty sequence {n}"
            assert torch.equal(got["dh0"][n], dev["dht"][n]), f"dh0 of empty sequence {n}"


@pytest.mark.parametrize("block_v", [64, 128])
def test_scale_applies_to_every_value_slice(block_v):
    """scale = 0.3 at value-slice width 64 and 128: o and the final state against fp64 (a scale
    applied to one slice only leaves the other off by 1/0.3 - 1)."""
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    x = make_gdn_inputs(B=1, T=777, H=2, HV=4, cu_seqlens=[100, 677], seed=31)
    xd = {n: (None if t is None else t.to(DEV) if n == "cu_seqlens" else
              t.to(DEV, torch.bfloat16 if n in ("q", "k", "v") else torch.float32)) for n, t in x.items()}
    out = chunk_gated_delta_rule_fwd(**xd, scale=0.3, output_final_state=True, block_v=block_v, poison_outputs=True)
    x64 = {n: (None if t is None else t.cpu() if n == "cu_seqlens" else t.detach().cpu().double()) for n, t in xd.items()}
    ro, rht = reference.recurrent_gated_delta_rule(**x64, scale=0.3, output_final_state=True)
    eo, eht = rel_rms(out.o, ro), rel_rms(out.final_state, rht)
    print(f"scale 0.3, block_v {block_v}: o {eo:.2e} ht {eht:.2e}")
    assert eo <= BUDGET["o"] and eht <= BUDGET["ht"]


@pytest.mark.parametrize("cp", ["off", "on"])
def test_dh0_without_the_final_state(cp):
    """An initial state that requires grad and output_final_state=False (no dht), allocator poisoned:
    dh0, dq, dk, dv, dg, dbeta against fp64 of the same loss <o, do>."""
    c = _case(seed=811, lengths=[300, 0, 1000, 7])
    dev, leaves = _device_leaves(c)
    _poison_allocator()
    o = OP(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["initial_state"],
           output_final_state=False, cu_seqlens=dev["cu_seqlens"], cp=cp)
    o = o[0] if isinstance(o, tuple) else o
    grads = torch.autograd.grad(o, [leaves[n] for n in NAMES], dev["do"])
    torch.cuda.synchronize()
    got = {"o": o.detach()} | {"d" + ("h0" if n == "initial_state" else n): d for n, d in zip(NAMES, grads)}
    ref_leaves = {n: c[n].detach().double().requires_grad_(True) for n in NAMES}
    ro = reference.chunk_gated_delta_rule(*(ref_leaves[n] for n in NAMES[:5]), initial_state=ref_leaves["initial_state"],
                                          output_final_state=False, cu_seqlens=c["cu_seqlens"].cpu())
    ro = ro[0] if isinstance(ro, tuple) else ro
    rgrads = torch.autograd.grad(ro, [ref_leaves[n] for n in NAMES], c["do"].double())
    ref = {"o": ro.detach()} | {"d" + ("h0" if n == "initial_state" else n): d for n, d in zip(NAMES, rgrads)}
    _compare(f"no final state, cp={cp}", got, ref)


def test_two_streams_are_bitwise_one_stream():
    """Two different batches (different lengths, heads and value-slice widths) run at once on two
    streams, forward and backward, 8 rounds launched without synchronising: every result bitwise
    equal to the batch run alone on the default stream."""
    cases = [_case(seed=900, lengths=[5000, 64, 1, 3000], H=2, HV=8), _case(seed=901, lengths=[700, 0, 9000], H=4, HV=4)]
    devs = [_device_leaves(c) for c in cases]

    def run(dev, leaves):
        return _autograd(OP, leaves, dev["cu_seqlens"], dev["do"], dev["dht"])

    alone = [run(*d) for d in devs]
    torch.cuda.synchronize()
    streams = [torch.cuda.Stream(), torch.cuda.Stream()]
    for s in streams:
        s.wait_stream(torch.cuda.current_stream())
    results = [[], []]
    for _ in range(8):
        for i, s in enumerate(streams):
            with torch.cuda.stream(s):
                results[i].append(run(*devs[i]))
    torch.cuda.synchronize()
    for i in range(2):
        for r, got in enumerate(results[i]):
            bad = [n for n in alone[i] if not torch.equal(got[n], alone[i][n])]
            assert not bad, f"batch {i}, round {r}: {bad} differ from the single-stream run"


# ------------------------------------------------------------------ device offsets checked without a sync (issue 44, finding 2)

_BAD_OFFSETS_SCRIPT = r"""
import sys, torch, flashqla
from flashqla.testing import make_gdn_inputs
x = make_gdn_inputs(B=1, T=256, H=2, HV=4, seqlens=[100, 156], seed=0)
d = {n: x[n].to("cuda", torch.bfloat16 if n in ("q", "k", "v") else torch.float32) for n in ("q", "k", "v", "g", "beta")}
cu = torch.tensor(eval(sys.argv[1]), dtype=torch.int32, device="cuda")
o, _ = flashqla.chunk_gated_delta_rule(**d, cu_seqlens=cu, cp=sys.argv[2], check_offsets=True)
torch.cuda.synchronize()
print("finished", float(o.float().abs().max()))
"""


@pytest.mark.parametrize("cu,cp", [("[0, 156, 100, 256]", "off"), ("[0, 100, 300]", "off"), ("[8, 100, 256]", "off"),
                                   ("[0, 156, 100, 256]", "on")], ids=["decreasing", "past-T", "not-from-0", "decreasing-cp-on"])
def test_bad_device_offsets_end_in_a_device_assert(cu, cp):
    """Device offsets that decrease, pass T or do not start at 0, with check_offsets=True: the asynchronous
    check ends the process's CUDA work with a device-side assert naming cu_seqlens (run in a subprocess: the
    context is unusable after it), never a result."""
    import os
    import subprocess
    import sys

    r = subprocess.run([sys.executable, "-c", _BAD_OFFSETS_SCRIPT, cu, cp], capture_output=True, text=True,
                       timeout=300, env={**os.environ, "CUDA_LAUNCH_BLOCKING": "0"})
    assert r.returncode != 0 and "finished" not in r.stdout, r.stdout[-500:]
    assert "flashqla: cu_seqlens must start at 0" in r.stderr, r.stderr[-800:]


def test_offsets_check_leaves_results_and_graph_capture_alone():
    """check_offsets=True changes no output bit, and a CUDA-graph capture of the op with it replays to
    the same o."""
    x = make_gdn_inputs(B=1, T=300, H=2, HV=4, seqlens=[100, 0, 200], seed=1)
    d = {n: x[n].to(DEV, torch.bfloat16 if n in ("q", "k", "v") else torch.float32) for n in ("q", "k", "v", "g", "beta")}
    cu = x["cu_seqlens"].to(DEV, torch.int32)
    with torch.no_grad():
        o_on, _ = flashqla.chunk_gated_delta_rule(**d, cu_seqlens=cu, cp="off", check_offsets=True)
        o_off, _ = flashqla.chunk_gated_delta_rule(**d, cu_seqlens=cu, cp="off")
        torch.cuda.synchronize()
        assert torch.equal(o_on, o_off)
        side = torch.cuda.Stream()
        side.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(side):
            flashqla.chunk_gated_delta_rule(**d, cu_seqlens=cu, cp="off", check_offsets=True)
        torch.cuda.current_stream().wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            o_g, _ = flashqla.chunk_gated_delta_rule(**d, cu_seqlens=cu, cp="off", check_offsets=True)
        graph.replay()
        torch.cuda.synchronize()
    assert torch.equal(o_g, o_on)

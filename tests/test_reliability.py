"""Regression tests of issue 44 ("Reliability"), the CPU-visible findings; each docstring says what the
code did before the fix.

- finding 6: a numpy cu_seqlens / initial_state, the planner's NaN / float sizes, torch.compile on CPU
  tensors, a missing nvcc, the backend's zero-buffer cache shared between streams;
- finding 3: one gate floor (`flashqla.contract.G_FLOOR`) on every path, g = -inf as "forget everything";
- finding 4: the valid input domain (beta in [0, 1], finite inputs) checked where it costs no sync,
  and with `check_inputs=True`;
- finding 2: cu_seqlens ending before T on CPU offsets; o's tail never uninitialised memory;
- finding 1: `flashqla.distributed` ranks that disagree fail fast, with one error on every rank; a rank
  that never backpropagates makes the others fail fast at the backward's check-in.
"""

from __future__ import annotations

import dataclasses
import math
import time

import numpy as np
import pytest
import torch

import flashqla
import reference
from flashqla.contract import check_gdn_inputs
from flashqla.testing import make_gdn_inputs


def _small(**kw):
    kw = {**dict(B=1, T=40, H=1, HV=2, K=8, V=8, seqlens=[15, 25]), **kw}
    return make_gdn_inputs(**kw)


def _kernel_dtypes(x: dict) -> dict:
    """The fast path's dtypes and head dims (K = V = 128) on CPU: the op's checks pass up to its device check."""
    x = dict(x)
    for n in ("q", "k", "v"):
        x[n] = x[n].to(torch.bfloat16)
    for n in ("g", "beta", "initial_state"):
        x[n] = x[n].float()
    return x


# ------------------------------------------------------------------------------------------------
# finding 6
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cu_seqlens", "initial_state"])
def test_numpy_argument_is_a_type_error_naming_it(name):
    """Regression: a numpy array has `.device == "cpu"`, and the device check ran first: "cu_seqlens is
    on cpu but q is on cpu" (a ValueError naming no type)."""
    x = _small()
    x[name] = x[name].numpy()
    for entry in (check_gdn_inputs, reference.chunk_gated_delta_rule, reference.recurrent_gated_delta_rule):
        with pytest.raises(TypeError, match=rf"^{name} must be"):
            entry(**x)
    with pytest.raises(TypeError, match=rf"^{name} must be"):
        flashqla.chunk_gated_delta_rule(**_kernel_dtypes(_small(K=128, V=128)) | {name: x[name]})


@pytest.mark.parametrize("kw, name", [(dict(T=100.5), "T"), (dict(T=4096.0), "T"), (dict(max_seqlen=math.nan), "max_seqlen"),
                                      (dict(max_seqlen=1.5), "max_seqlen"), (dict(HV=True), "HV"), (dict(N="2"), "N")])
def test_planner_names_a_non_integer_argument(kw, name):
    """Regression: plan_cp(T=100.5) raised "'float' object cannot be interpreted as an integer" and
    max_seqlen=NaN "cannot convert float NaN to integer" (no argument named)."""
    from flashqla.cp.plan import plan_cp

    args = {**dict(HV=4, N=1, T=4096), **kw}
    with pytest.raises(ValueError, match=rf"{name} must be an int"):
        plan_cp(**args)


def test_torch_compile_on_cpu_tensors_reaches_the_clear_error():
    """Regression: under torch.compile(fullgraph=True) the CPU value checks read cu_seqlens while
    tracing: a dynamo guard error ("Could not guard on data-dependent expression") instead of the op's
    own error. Value checks are skipped while compiling; what surfaces is the device error."""
    x = _kernel_dtypes(_small(K=128, V=128))
    torch._dynamo.reset()
    f = torch.compile(flashqla.chunk_gated_delta_rule, fullgraph=True, backend="eager")
    with pytest.raises(Exception) as info:
        f(**x)
    text = str(info.value) + repr(info.value.__cause__)
    assert "data-dependent" not in text, text[:500]
    assert "runs on a CUDA device of compute capability 9.0" in text, text[:500]
    torch._dynamo.reset()
    g = torch.compile(flashqla.chunk_gated_delta_rule, backend="eager")
    with pytest.raises(RuntimeError, match="runs on a CUDA device of compute capability 9.0"):
        g(**x)
    torch._dynamo.reset()


# ------------------------------------------------------------------------------------------------
# finding 3: one gate floor
# ------------------------------------------------------------------------------------------------

from flashqla.contract import G_FLOOR  # noqa: E402
from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd  # noqa: E402
from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd  # noqa: E402
from reference.gdn.cp import ReferenceCPBackend  # noqa: E402


class _GateRecorder(ReferenceCPBackend):
    """The fp64 launch-level stand-in, recording the smallest g each launch is handed; its bwd returns
    dg = 1 everywhere unless `honest` (a backend, like the sm_90 kernels, that does not know the floor)."""

    def __init__(self, honest=True):
        super().__init__()
        self.g_min, self.honest = [], honest

    def prepare(self, k, g, beta, cu_seqlens, HV):
        self.g_min.append(float(g.min()))
        return super().prepare(k, g, beta, cu_seqlens, HV)

    def bwd(self, q, k, v, g, beta, *args, **kw):
        self.g_min.append(float(g.min()))
        out = super().bwd(q, k, v, g, beta, *args, **kw)
        return out if self.honest else (out[0], out[1], out[2], torch.ones_like(out[3]), *out[4:])


def test_floor_value_changes_no_decay():
    """The derivation of `flashqla.contract.G_FLOOR`: exp of the floor is exactly 0 in fp32 and fp64
    (and in base 2 for the kernels), so a factor spanning a floored token is 0 either way."""
    for dt in (torch.float32, torch.float64):
        assert float(torch.exp(torch.tensor(G_FLOOR, dtype=dt))) == 0.0
        assert float(torch.exp2(torch.tensor(G_FLOOR / math.log(2), dtype=dt))) == 0.0
    assert float(torch.tensor(G_FLOOR, dtype=torch.float32)) == G_FLOOR


@pytest.mark.parametrize("cp", ["off", "on"])
@pytest.mark.parametrize("gate", [-1e30, -3e38, -math.inf])
def test_op_driver_hands_the_kernels_floored_gates(cp, gate):
    """Regression: the op's drivers passed g unclamped to the launches; the sm_90 kernels' cumsum then
    let one g = -1e30 swallow the later gates of its chunk and two -3e38 give -inf, then NaN (the
    reference floored at -1000, the kernels did not). Every launch now gets g >= G_FLOOR; o equals the
    recurrence's, and dg of the floored tokens is 0 even from a backend that does not know the floor."""
    x = _small(T=150, K=64, V=64, seqlens=[70, 80], dtype=torch.float64, seed=3)
    x["g"][:, 10] = gate
    x["g"][:, 11] = gate
    be = _GateRecorder(honest=False)
    f = chunk_gated_delta_rule_fwd(**x, output_final_state=True, backend=be, cp=cp, segment_len=64 if cp == "on" else None)
    assert min(be.g_min) >= G_FLOOR, be.g_min
    o_ref, ht_ref = reference.recurrent_gated_delta_rule(**x, output_final_state=True)
    assert bool(torch.isfinite(f.o).all())
    torch.testing.assert_close(f.o, o_ref, rtol=1e-9, atol=1e-9)
    torch.testing.assert_close(f.final_state, ht_ref, rtol=1e-9, atol=1e-9)
    do = torch.randn_like(f.o)
    grads = chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], f.A, f.g_cum_log2, do,
                                       initial_state=x["initial_state"], cu_seqlens=x["cu_seqlens"], backend=be, cp="off")
    assert min(be.g_min) >= G_FLOOR, be.g_min
    dg = grads[3]
    assert bool((dg[:, 10:12] == 0).all()), "dg of floored tokens"
    assert bool((dg[:, 12:] == 1).all()), "dg elsewhere is the backend's"


@pytest.mark.parametrize("entry", ["reference", "recurrence", "check"])
def test_minus_inf_gate_is_forget_everything(entry):
    """Regression: g = -inf was rejected on CPU ("g must be finite") while the GPU op let it through
    (NaN in its cumsum). Now it is valid everywhere and means what the floor means: the state is
    forgotten at that token (the result equals g = G_FLOOR's, finite), and its dg is 0."""
    x = _small(T=100, seqlens=[60, 40], dtype=torch.float64, seed=4)
    if entry == "check":
        x["g"][:, 5] = -math.inf
        check_gdn_inputs(**x, check_values=True)
        return
    fn = reference.chunk_gated_delta_rule if entry == "reference" else reference.recurrent_gated_delta_rule
    outs = []
    for gate in (-math.inf, G_FLOOR):
        y = {n: (t.clone() if isinstance(t, torch.Tensor) else t) for n, t in x.items()}
        y["g"][:, 5] = gate
        y["g"].requires_grad_(True)
        o, ht = fn(**y, output_final_state=True)
        (dg,) = torch.autograd.grad((o * o).sum() + ht.sum(), [y["g"]])
        assert bool(torch.isfinite(o).all()) and bool(torch.isfinite(dg).all())
        if gate == -math.inf:
            assert bool((dg[:, 5] == 0).all())
        outs.append((o.detach(), ht.detach(), torch.cat([dg[:, :5], dg[:, 6:]], 1)))
    for a, b in zip(outs[0], outs[1]):
        torch.testing.assert_close(a, b, rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------------------------
# finding 4: the valid input domain
# ------------------------------------------------------------------------------------------------

def _bad(name, value):
    def change(x):
        t = x[name].clone()
        t.view(-1)[3] = value
        return {name: t}
    return change


DOMAIN_CASES = [
    ("beta", 3.0, r"^beta must be in \[0, 1\]"),
    ("beta", -0.5, r"^beta must be in \[0, 1\]"),
    ("beta", math.nan, r"^beta must be finite"),
    ("q", math.nan, r"^q must be finite"),
    ("k", math.inf, r"^k must be finite"),
    ("v", -math.inf, r"^v must be finite"),
    ("initial_state", math.nan, r"^initial_state must be finite"),
]


@pytest.mark.parametrize("name, value, pattern", DOMAIN_CASES)
def test_values_outside_the_domain_rejected_on_cpu(name, value, pattern):
    """Regression: beta = 3 was accepted and blew o up (2e6); NaN or inf in q, k, v, beta or the initial
    state passed silently. CPU tensors are now checked by the shared checks: the reference, the
    recurrence, the drivers and the op (before its device error)."""
    x = _small(dtype=torch.float64)
    x.update(_bad(name, value)(x))
    for entry in (reference.chunk_gated_delta_rule, reference.recurrent_gated_delta_rule):
        with pytest.raises(ValueError, match=pattern):
            entry(**x)
    with pytest.raises(ValueError, match=pattern):
        chunk_gated_delta_rule_fwd(**x, backend=ReferenceCPBackend())
    y = _kernel_dtypes(_small(K=128, V=128))
    y.update(_bad(name, value)(y))
    with pytest.raises(ValueError, match=pattern):
        flashqla.chunk_gated_delta_rule(**y)


def test_domain_edges_accepted():
    """beta exactly 0 and 1, g exactly 0 and -inf: valid."""
    x = _small(dtype=torch.float64)
    x["beta"][:, :5] = 0.0
    x["beta"][:, 5:10] = 1.0
    x["g"][:, :3] = 0.0
    x["g"][:, 3] = -math.inf
    o, _ = reference.chunk_gated_delta_rule(**x)
    assert bool(torch.isfinite(o).all())


def test_check_inputs_asks_for_the_value_checks(monkeypatch):
    """`check_inputs=True` makes the op read device values (`check_values=True`: the one switch that
    also reads GPU tensors); off by default (no host sync); not a bool: a TypeError naming it."""
    import flashqla.ops.gdn.api as api

    seen = []

    def spy(*args, check_values=False, **kw):
        seen.append(check_values)
        return check_gdn_inputs(*args, check_values=check_values, **kw)

    monkeypatch.setattr(api, "check_gdn_inputs", spy)
    x = _kernel_dtypes(_small(K=128, V=128))
    for flag in (False, True):
        with pytest.raises(RuntimeError, match="runs on a CUDA device"):
            api.chunk_gated_delta_rule(**x, check_inputs=flag)
    assert seen == [False, True]
    with pytest.raises(TypeError, match=r"^check_inputs must be a bool"):
        api.chunk_gated_delta_rule(**x, check_inputs=1)


def test_missing_nvcc_is_a_clear_error_at_once(monkeypatch):
    """Regression: without nvcc the first call lowered for minutes, then failed with a raw "No such file
    or directory". compile_kernel now looks for nvcc first and says what to install."""
    import time

    from flashqla.ops.gdn.kernels.sm90 import _common

    monkeypatch.setattr(_common, "_nvcc_found", False)
    monkeypatch.setattr(_common, "find_nvcc", lambda: None)
    t0 = time.perf_counter()
    with pytest.raises(RuntimeError, match=r"needs the CUDA toolkit's nvcc.*Install the CUDA toolkit"):
        _common.compile_kernel(object(), "gdn_test_build")
    assert time.perf_counter() - t0 < 1.0
    monkeypatch.undo()  # the real lookup, with a CUDA_HOME that holds no nvcc
    monkeypatch.setattr(_common, "_nvcc_found", False)
    monkeypatch.setenv("CUDA_HOME", "/nonexistent/cuda")
    assert _common.find_nvcc() is None
    with pytest.raises(RuntimeError, match=r"\$CUDA_HOME = '/nonexistent/cuda' has no bin/nvcc"):
        _common.require_nvcc()


def test_zero_buffers_are_never_shared_between_streams(monkeypatch):
    """Regression (FlashInfer #4476's bug class): `Sm90Backend.zeros` cached its buffers by (shape, dtype,
    device) only, so two streams got the same scratch buffer and an evicted one was freed with no
    `record_stream` while the other stream could still read it. The key now holds the current stream:
    each stream gets its own buffer, and a buffer is freed only by the stream it was made on."""
    from flashqla.ops.gdn import backend as be_mod

    assert be_mod.current_stream_id(torch.device("cpu")) is None
    stream = {"id": 1}
    monkeypatch.setattr(be_mod, "current_stream_id", lambda device: stream["id"])
    be = be_mod.Sm90Backend()
    a = be.zeros((1, 4, 2, 8), torch.float32, "cpu")
    assert be.zeros((1, 4, 2, 8), torch.float32, "cpu") is a  # cached on one stream
    stream["id"] = 2
    b = be.zeros((1, 4, 2, 8), torch.float32, "cpu")
    assert b is not a and b.data_ptr() != a.data_ptr()
    assert all(key[-1] in (1, 2) for key in be._zeros), list(be._zeros)


def test_layout_cache_entries_are_recorded_on_every_stream_that_uses_them(monkeypatch):
    """Regression (finding 6, FlashInfer #4476's bug class): the split path's cache of shape-determined
    index tensors (`flashqla.cp.segments.memo_layout`) handed one entry to every stream and freed an
    evicted entry with no `record_stream`, so its memory could be reused while another stream still
    read it. Now each stream that gets an entry is recorded on its tensors once (the allocation's own
    stream too, where record_stream is a no-op), and eviction forgets the streams with the entry."""
    from flashqla.cp import segments as seg

    class Stream:
        def __init__(self, handle):
            self.cuda_stream = handle

    class FakeCudaTensor:
        device = "cuda:0"

        def __init__(self):
            self.recorded = []

        def record_stream(self, stream):
            self.recorded.append(stream.cuda_stream)

    assert seg._tensors_of((torch.zeros(2), [torch.ones(1)])) == []  # CPU entries: nothing to record
    current = {"s": Stream(11)}
    made = []

    def build():
        made.append((FakeCudaTensor(), FakeCudaTensor()))
        return made[-1]

    monkeypatch.setattr(seg, "_current_stream", lambda device: current["s"])
    monkeypatch.setattr(seg, "_tensors_of", lambda value: list(value) if isinstance(value, tuple) else [])
    monkeypatch.setattr(seg, "_LAYOUTS", {})
    monkeypatch.setattr(seg, "_LAYOUT_STREAMS", {})
    monkeypatch.setattr(seg, "_LAYOUT_PINNED", set())
    monkeypatch.setattr(seg, "_capturing", lambda: False)
    a = seg.memo_layout(("k", 1), build)
    assert seg.memo_layout(("k", 1), build) is a and len(made) == 1  # a hit, on the same stream
    assert [t.recorded for t in a] == [[11], [11]]  # recorded once per stream, not per call
    current["s"] = Stream(22)
    assert seg.memo_layout(("k", 1), build) is a
    assert [t.recorded for t in a] == [[11, 22], [11, 22]]
    for i in range(seg._LAYOUT_CACHE):  # evict ("k", 1)
        seg.memo_layout(("other", i), build)
    assert ("k", 1) not in seg._LAYOUTS and ("k", 1) not in seg._LAYOUT_STREAMS
    # an entry handed out during a CUDA graph capture is never evicted (the graph replays its addresses)
    monkeypatch.setattr(seg, "_capturing", lambda: True)
    g = seg.memo_layout(("graph", 0), build)
    monkeypatch.setattr(seg, "_capturing", lambda: False)
    for i in range(2 * seg._LAYOUT_CACHE):
        seg.memo_layout(("more", i), build)
    assert seg._LAYOUTS.get(("graph", 0)) is g
    assert len(seg._LAYOUTS) == seg._LAYOUT_CACHE + 1


def test_layout_cache_finds_the_tensors_of_every_entry_shape(monkeypatch):
    """`_tensors_of` walks tensors, tuples, lists, dicts (the gated mode's layout) and dataclasses (the
    `SegmentTables` of a fixed-length split), skipping other values (CPU tensors stand in for CUDA ones)."""
    from flashqla.cp import segments as seg

    monkeypatch.setattr(seg, "_is_cuda", lambda t: True)
    a, b, c, d = (torch.zeros(1) for _ in range(4))
    tables = seg.build_segment_tables(torch.tensor([0, 100, 300]), 128, T=300)
    found = seg._tensors_of(({"x": a, "y": [b, 3]}, c, "name", None, (d,)))
    assert [id(t) for t in found] == [id(a), id(b), id(c), id(d)]
    got = seg._tensors_of(tables)
    want = [getattr(tables, f.name) for f in dataclasses.fields(tables) if isinstance(getattr(tables, f.name), torch.Tensor)]
    assert len(got) == len(want) >= 10 and all(x is y for x, y in zip(got, want))


# ------------------------------------------------------------------------------------------------
# finding 1: ranks that disagree fail fast, with one error on every rank
# ------------------------------------------------------------------------------------------------

def _disagreeing_rank(rank: int, case: str):
    """One rank's call of a disagreement case (W = 2, fp64 reference backend); returns (kind, message)."""
    from flashqla.distributed import build_cp_context, chunk_gated_delta_rule_cp

    HV = 4 if (case == "HV" and rank == 1) else 2
    x = make_gdn_inputs(B=1, T=100, H=1, HV=HV, K=16, V=16, seqlens=[40, 60], seed=5)
    cu = x["cu_seqlens"] if not (case == "cu_seqlens" and rank == 1) else torch.tensor([0, 70, 100])
    lo, hi = 50 * rank, 50 * (rank + 1)
    local = {n: x[n][:, lo:hi].clone() for n in ("q", "k", "v", "g", "beta")}
    if case == "beta" and rank == 1:
        local["beta"][0, 3, 0] = 3.0
    grad = not (case == "backward" and rank == 0)
    for t in local.values():
        t.requires_grad_(grad)
    kw = dict(backend=reference.chunk_gated_delta_rule, initial_state=x["initial_state"])
    if case == "calls" and rank == 1:  # as if this rank had counted a call the other never did
        from flashqla.distributed import op as cp_op

        for record in list(cp_op._GROUPS.values()):
            record.calls += 1
    if case in ("cu_seqlens", "ok", "calls"):
        kw["cu_seqlens"] = cu  # the op builds the shard table (no second collective)
    else:
        kw["cp_context"] = build_cp_context(cu)
    try:
        o, _ = chunk_gated_delta_rule_cp(*(local[n] for n in ("q", "k", "v", "g", "beta")), **kw)
        if grad:
            o.sum().backward()
        return ("ok", "")
    except Exception as exc:  # noqa: BLE001 - the test compares what each rank raised
        return (type(exc).__name__, str(exc) + " | " + " | ".join(getattr(exc, "__notes__", [])))


DISAGREEMENTS = ("cu_seqlens", "HV", "beta", "backward", "ok", "calls")


def _disagreement_worker(rank: int, init_file: str, out_dir: str) -> None:
    import datetime
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.save({case: _disagreeing_rank(rank, case) for case in DISAGREEMENTS}, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


def test_ranks_that_disagree_fail_fast_with_one_error(tmp_path):
    """Regression: flashqla.distributed never compared the ranks. Different global cu_seqlens: rank 1's
    o off by 0.50 relative, nothing raised; HV differing: the other rank died with SIGABRT (gloo size
    mismatch); one rank's input rejected, or one rank not running the backward: the others blocked
    until the group's timeout. Now one all-gather of a fingerprint comes before the first collective,
    and every rank raises, naming the argument and the ranks, within seconds (the whole spawn, six
    cases on two ranks, must end well inside the 30 s group timeout). The fingerprint also carries the
    group's count of calls that ran a backward (the check-ins' numbering): a rank whose count differs
    fails at the forward instead of every later backward check-in aborting."""
    import os
    import time

    import torch.multiprocessing as mp

    t0 = time.perf_counter()
    mp.spawn(_disagreement_worker, args=(os.path.join(tmp_path, "init"), str(tmp_path)), nprocs=2, join=True)
    elapsed = time.perf_counter() - t0
    ranks = [torch.load(os.path.join(tmp_path, f"rank{r}.pt")) for r in range(2)]
    expect = {
        "cu_seqlens": (r"disagree on cu_seqlens", ("ValueError", "ValueError")),
        "HV": (r"disagree on HV \(v.shape\[2\]\): ranks \[0\] have 2; ranks \[1\] have 4", ("ValueError", "ValueError")),
        "beta": (r"arguments of rank\(s\) \[1\] were rejected \(rank 1: beta\)", ("ValueError", "ValueError")),
        "backward": (r"ranks \[1\] will run the backward, ranks \[0\] will not", ("ValueError", "ValueError")),
        # after "ok" (one call with a backward on both ranks), rank 1 counts one more
        "calls": (r"disagree on calls on this group that ran a backward so far.*ranks \[0\] have 1; ranks \[1\] have 2",
                  ("ValueError", "ValueError")),
    }
    import re

    for case, (pattern, kinds) in expect.items():
        for r in range(2):
            kind, msg = ranks[r][case]
            assert kind == kinds[r], (case, r, kind, msg)
            assert re.search(pattern, msg), (case, r, msg)
    assert "beta must be in [0, 1]" in ranks[1]["beta"][1]  # the rejecting rank raises its own error
    assert ranks[0]["ok"] == ranks[1]["ok"] == ("ok", ""), [r["ok"] for r in ranks]
    assert elapsed < 25, f"{elapsed:.1f} s: a rank waited for the group timeout"


# the backward check-in (`flashqla.distributed.op._check_in`): a rank that ran the forward with grad
# and never backpropagates makes the others raise within backward_timeout instead of hanging. One
# spawn of 2 gloo ranks (file store) runs every scenario; the tests below read its results.
# Measured cost (2 gloo ranks on a 2-core CPU machine, torch 2.13, T_r = 64, HV = 2, K = V = 8, fp64
# reference backend, backwards with backward_timeout=120 and None interleaved, medians): the first
# version (a store wait) 0.2-0.45 ms per backward (about 9 ms) with the file and TCP stores, 0.31 /
# 0.68 ms in a later run; its file store's own wait (10 ms between looks) had cost 7.8 ms before it
# polled first. The polling version (check every 0.1 ms for 5 ms, then backing off; no store wait,
# which holds a TCP client's lock) 0.51 ms (file) / 0.86 ms (TCP) in the same conditions, and with the
# machine loaded by a test run 0.9 / 1.4 ms against the store wait's 4.5 / 3.3 ms.

CHECKIN_T, CHECKIN_ITERS = 60, 5


def _timed_backward(loss) -> tuple:
    """(exception type name or "ok", message, seconds) of loss.backward()."""
    t0 = time.perf_counter()
    try:
        loss.backward()
        return ("ok", "", time.perf_counter() - t0)
    except Exception as exc:  # noqa: BLE001 - the tests compare what each rank raised
        return (type(exc).__name__, str(exc), time.perf_counter() - t0)


def _checkin_inputs(i: int) -> dict:
    """Iteration i's global inputs of a two-layer chain (layer 2's v is layer 1's o) and loss weights."""
    x1 = make_gdn_inputs(B=1, T=CHECKIN_T, H=1, HV=2, K=8, V=8, seqlens=[25, 35], initial_state=False, seed=100 + i)
    x2 = make_gdn_inputs(B=1, T=CHECKIN_T, H=1, HV=2, K=8, V=8, seqlens=[25, 35], initial_state=False, seed=200 + i)
    w = torch.randn(x1["v"].shape, generator=torch.Generator().manual_seed(300 + i), dtype=torch.float64)
    leaves = {f"{n}1": x1[n] for n in ("q", "k", "v", "g", "beta")}
    leaves.update({f"{n}2": x2[n] for n in ("q", "k", "g", "beta")})
    return dict(leaves=leaves, cu=x1["cu_seqlens"], w=w)


def _chain(leaves: dict, op, w, **kw):
    """loss = sum(w * o2), o2 = op(q2, k2, o1, g2, beta2), o1 = op(q1, k1, v1, g1, beta1)."""
    o1, _ = op(leaves["q1"], leaves["k1"], leaves["v1"], leaves["g1"], leaves["beta1"], **kw)
    o2, _ = op(leaves["q2"], leaves["k2"], o1, leaves["g2"], leaves["beta2"], **kw)
    return (o2 * w).sum()


class _CountingStore:
    """A store proxy counting the calls made through it."""

    def __init__(self, store):
        self.store, self.calls = store, 0

    def __getattr__(self, name):
        attr = getattr(self.store, name)

        def counted(*args, **kwargs):
            self.calls += 1
            return attr(*args, **kwargs)

        return counted


def _checkin_rank(rank: int) -> dict:
    """Every scenario on one rank of 2 (inside an initialised gloo group); returns what the tests check."""
    import time

    import torch.distributed as dist

    from flashqla.distributed import build_cp_context, chunk_gated_delta_rule_cp
    from flashqla.distributed import op as cp_op

    world = dist.group.WORLD
    store = dist.distributed_c10d._get_default_store()
    prefix = f"flashqla/cp/{dist.distributed_c10d._get_process_group_name(world)}/"
    record = cp_op._group_calls(world)
    lo, hi = 30 * rank, 30 * (rank + 1)
    out = dict(grads=[], present=[], num_keys=[])

    def step(i, **kw):
        x = _checkin_inputs(i)
        ctx = build_cp_context(x["cu"])
        leaves = {n: t[:, lo:hi].clone().requires_grad_(True) for n, t in x["leaves"].items()}
        loss = _chain(leaves, chunk_gated_delta_rule_cp, x["w"][:, lo:hi], cp_context=ctx,
                      backend=reference.chunk_gated_delta_rule, **kw)
        loss.backward()
        return {n: t.grad for n, t in leaves.items()}

    def keys(call):
        return [f"{prefix}{call}.0/{s}" for s in range(2)] + [f"{prefix}{call}.0/decision"]

    # (2) training steps: two calls per step, their backwards in reverse order (call 2i + 1, then 2i)
    base = record.calls
    for i in range(CHECKIN_ITERS):
        out["grads"].append(step(i))
        dist.barrier()  # both ranks done with step i
        out["present"].append([[store.check([k]) for k in keys(base + c)] for c in range(2 * i + 2)])
        out["num_keys"].append(store.num_keys())
        dist.barrier()

    # (3) backward_timeout=None: no store call; a number: store calls; None on one rank only: the forward fails
    counting = record.store = _CountingStore(record.store)
    try:
        step(0, backward_timeout=None)
        out["calls_none"] = counting.calls
        step(0, backward_timeout=30)
        out["calls_30"] = counting.calls - out["calls_none"]
    finally:
        record.store = counting.store
    try:
        step(0, backward_timeout=None if rank == 0 else 5.0)
        out["mixed"] = ("ok", "")
    except Exception as exc:  # noqa: BLE001 - the test reads what each rank raised
        out["mixed"] = (type(exc).__name__, str(exc))

    # (1) rank 1 runs the forward with grad and never backpropagates; rank 0 backpropagates
    x = _checkin_inputs(0)
    ctx = build_cp_context(x["cu"])
    leaves = {n: t[:, lo:hi].clone().requires_grad_(True) for n, t in x["leaves"].items()}
    skipped = record.calls
    loss = _chain(leaves, chunk_gated_delta_rule_cp, x["w"][:, lo:hi], cp_context=ctx,
                  backend=reference.chunk_gated_delta_rule, backward_timeout=2)
    if rank == 0:
        out["skip"] = _timed_backward(loss)
    del loss
    dist.barrier()  # rank 1 waits here (the group's timeout is 30 s) until rank 0 has raised

    # a rank that checks in after another has given up raises too (it must not enter the collective)
    leaves = {n: t[:, lo:hi].clone().requires_grad_(True) for n, t in x["leaves"].items()}
    loss = _chain(leaves, chunk_gated_delta_rule_cp, x["w"][:, lo:hi], cp_context=ctx,
                  backend=reference.chunk_gated_delta_rule, backward_timeout=0.5 if rank == 0 else 60)
    if rank == 1:
        time.sleep(2.5)  # well past rank 0's timeout
    out["late"] = _timed_backward(loss)
    del loss
    dist.barrier()

    # and the group goes on: a normal step after both failures, the failed calls' keys then deleted
    out["after"] = step(1)
    dist.barrier()
    out["after_present"] = [store.check([k]) for c in range(skipped, skipped + 6) for k in keys(c)]
    return out


def _checkin_worker(rank: int, init_file: str, out_dir: str) -> None:
    import datetime
    import os

    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=2,
                            timeout=datetime.timedelta(seconds=30))
    try:
        torch.save(_checkin_rank(rank), os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


_CHECKIN: list = []


def _checkin_results() -> list:
    """The two ranks' results of `_checkin_rank`, from one spawn (a failed spawn is not retried)."""
    if not _CHECKIN:
        import os
        import tempfile

        import torch.multiprocessing as mp

        with tempfile.TemporaryDirectory() as tmp:
            try:
                mp.spawn(_checkin_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=2, join=True)
                _CHECKIN.append([torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(2)])
            except Exception as exc:  # noqa: BLE001 - every test of the spawn reports it
                _CHECKIN.append(exc)
    if isinstance(_CHECKIN[0], Exception):
        raise RuntimeError("the check-in spawn failed") from _CHECKIN[0]
    return _CHECKIN[0]


def test_rank_that_never_backpropagates_makes_the_others_fail_fast():
    """Regression: a rank that ran the forward with grad and never backpropagated (here rank 1, which
    only waits at a barrier) left rank 0 blocked in the backward's all-gather until the group's
    timeout (30 s here; 30 min by default). Now rank 0 raises RuntimeError naming rank 1, the call
    and the timeout after backward_timeout = 2 s. A rank
    that checks in after another has given up raises too, instead of entering the collective alone."""
    import re

    r0, r1 = _checkin_results()
    kind, msg, elapsed = r0["skip"]
    assert kind == "RuntimeError", (kind, msg)
    assert re.search(r"rank\(s\) \[1\] did not reach it within backward_timeout=2 s", msg), msg
    assert "never backpropagated through o" in msg and "backward_timeout=None" in msg, msg
    assert re.search(r"backward of call \d+ \(counting from 0 .*\) on process group .0.", msg), msg
    assert 2.0 <= elapsed < 10, f"{elapsed:.1f} s (timeout 2 s, group timeout 30 s)"
    kind0, msg0, _ = r0["late"]
    kind1, msg1, elapsed1 = r1["late"]
    assert kind0 == kind1 == "RuntimeError", (r0["late"], r1["late"])
    assert "rank(s) [1] did not reach it within backward_timeout=0.5 s" in msg0, msg0
    assert "reached it after rank 0 had stopped waiting" in msg1, msg1
    assert elapsed1 < 5, f"the late rank took {elapsed1:.1f} s to raise"


def test_backward_checkin_keeps_training_right_and_the_store_bounded():
    """Five steps of a two-layer chain (layer 2's v is layer 1's o; the backwards run in reverse call
    order) on 2 ranks: the gradients match the single-process reference op on the whole batch, and
    after every step the store holds only the keys of the step's last check-in (call 2i: both ranks'
    keys and its decision), every earlier call's keys deleted. After the two failed check-ins (above)
    a normal step still runs, and deletes their keys."""
    from flashqla.testing import rel_rms

    ranks = _checkin_results()
    for i in range(CHECKIN_ITERS):
        x = _checkin_inputs(i)
        leaves = {n: t.clone().requires_grad_(True) for n, t in x["leaves"].items()}
        _chain(leaves, reference.chunk_gated_delta_rule, x["w"], cu_seqlens=x["cu"]).backward()
        step = [r["grads"][i] for r in ranks]
        for n, t in leaves.items():
            got = torch.cat([s[n] for s in step], dim=1)
            assert rel_rms(got, t.grad) <= 1e-12, (i, n, rel_rms(got, t.grad))
        if i == 1:
            after = [r["after"] for r in ranks]
            for n, t in leaves.items():
                assert rel_rms(torch.cat([s[n] for s in after], dim=1), t.grad) <= 1e-12, n
        for r in ranks:
            present = r["present"][i]
            expect = [[c == 2 * i] * 3 for c in range(2 * i + 2)]
            assert present == expect, (i, present)
    assert len(set(ranks[0]["num_keys"][1:])) == 1, ranks[0]["num_keys"]
    for r in ranks:  # the keys of the failed check-ins deleted; of the last step, its first call's kept
        assert r["after_present"] == [False] * 12 + [True] * 3 + [False] * 3, r["after_present"]


def test_backward_timeout_none_makes_no_checkin():
    """backward_timeout=None: the backward makes no store call (a counting store proxy sees none, and
    does see the check-in's calls with backward_timeout=30); None on one rank and a number on the
    other fails at the forward on both ranks (the check-in would wait for a rank that never checks in)."""
    for r in _checkin_results():
        assert r["calls_none"] == 0, r["calls_none"]
        assert r["calls_30"] >= 2 * 3, r["calls_30"]  # two calls: set, wait, compare_set each (and deletes)
        kind, msg = r["mixed"]
        assert kind == "ValueError" and "disagree on backward_timeout: ranks [0] pass None" in msg, r["mixed"]


@pytest.mark.parametrize("value, exc", [(0, ValueError), (-1.0, ValueError), (math.nan, ValueError), (math.inf, ValueError),
                                        (1e10, ValueError), ("5", TypeError), (True, TypeError)])
def test_bad_backward_timeout_rejected_naming_it(value, exc):
    """backward_timeout must be None or a number of seconds in (0, 1e9]: anything else raises before any
    collective, naming the argument (on several ranks the fingerprint publishes it as the others' error)."""
    from flashqla.distributed import build_cp_context, chunk_gated_delta_rule_cp

    x = make_gdn_inputs(B=1, T=50, H=1, HV=2, K=8, V=8, initial_state=False)
    ctx = build_cp_context(torch.tensor([0, 100]), rank=0, world_size=2)
    with pytest.raises(exc, match=r"^backward_timeout must be"):
        chunk_gated_delta_rule_cp(*(x[n] for n in ("q", "k", "v", "g", "beta")), cp_context=ctx,
                                  backend=reference.chunk_gated_delta_rule, backward_timeout=value)


# ------------------------------------------------------------------------------------------------
# finding 2 (CPU-visible part): offsets ending before T
# ------------------------------------------------------------------------------------------------

def test_cpu_offsets_ending_before_T_rejected():
    """cu_seqlens[-1] < T on CPU offsets: a clear error naming cu_seqlens on every entry point (it was
    already so; kept by this test)."""
    x = _small(dtype=torch.float64)
    x["cu_seqlens"] = torch.tensor([0, 15, 30])
    for entry in (reference.chunk_gated_delta_rule, lambda **y: chunk_gated_delta_rule_fwd(**y, backend=ReferenceCPBackend())):
        with pytest.raises(ValueError, match=r"^cu_seqlens must end at T = 40"):
            entry(**x)
    y = _kernel_dtypes(_small(K=128, V=128))
    y["cu_seqlens"] = torch.tensor([0, 15, 30])
    with pytest.raises(ValueError, match=r"^cu_seqlens must end at T = 40"):
        flashqla.chunk_gated_delta_rule(**y)


@pytest.mark.parametrize("launcher", ["chunk_recurrent_fwd", "chunk_recurrent_dual"])
def test_packed_output_tail_is_never_stale_memory(monkeypatch, launcher):
    """Regression: the recurrent launchers allocated o with torch.empty_like, and no CTA writes the rows
    past a device cu_seqlens[-1] < T: those rows were whatever the allocator held. Here the kernel is
    a stand-in that writes nothing and fresh memory is poisoned with NaN: o must come back zero."""
    from flashqla.ops.gdn.kernels.sm90 import recurrent

    monkeypatch.setattr(recurrent, "build_recurrent_kernel", lambda *a, **kw: (lambda *args: None))
    monkeypatch.setattr(recurrent, "recurrent_kernel_args", lambda *a, **kw: ())
    real_empty_like = torch.empty_like
    monkeypatch.setattr(torch, "empty_like", lambda x, **kw: real_empty_like(x, **kw).fill_(math.nan))
    T, HV, K = 40, 2, 128
    q = torch.zeros(1, T, 1, K, dtype=torch.bfloat16)
    v = torch.zeros(1, T, HV, K, dtype=torch.bfloat16)
    cu = torch.tensor([0, 15, 30], dtype=torch.int32)  # ends before T, as a device tensor might
    A, G = torch.zeros(HV, 64 * 2, 64, dtype=torch.bfloat16), torch.zeros(HV, 64 * 2)
    if launcher == "chunk_recurrent_fwd":
        o, _ = recurrent.chunk_recurrent_fwd(q, q, v, A, G, 1.0, None, False, cu, block_v=64)
    else:
        limit = torch.zeros(2, HV, dtype=torch.int32)
        o = recurrent.chunk_recurrent_dual(q, q, v, A, G, 1.0, None, limit, cu, block_v=64)[0]
    assert bool((o[:, 30:] == 0).all()), "the tail past cu_seqlens[-1]"


def test_o_is_zero_filled_only_when_the_offsets_may_end_before_T(monkeypatch):
    """The zero fill of packed o (one memset of o, `test_packed_output_tail_is_never_stale_memory`)
    is paid only where a tail can exist: device offsets without a host length hint. Offsets known to
    end at T (none, CPU offsets, or a host hint, all checked to sum to T: `CallPlan.ends_at_T`) get o
    allocated uninitialised by the driver."""
    from flashqla.cp.plan import plan_call
    from flashqla.ops.gdn import fwd as fwd_mod
    from reference.gdn.cp import ReferenceCPBackend

    q = torch.zeros(1, 70, 1, 64)
    v = torch.zeros(1, 70, 2, 64)
    cu = torch.tensor([0, 30, 70], dtype=torch.int32)
    assert plan_call(q, v, None, "off").ends_at_T and plan_call(q, v, cu, "off").ends_at_T
    seen = []
    backend = ReferenceCPBackend()
    real = backend.recurrent

    def recurrent(*a, o=None, **kw):
        seen.append(o)
        return real(*a, o=o, **kw)

    monkeypatch.setattr(backend, "recurrent", recurrent)
    from flashqla.testing import make_gdn_inputs

    x = make_gdn_inputs(B=1, T=70, H=1, HV=2, K=64, V=64, seqlens=[30, 40], seed=1)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 64 ** -0.5, None, False, x["cu_seqlens"])
    fwd_mod.forward(*args, plan=plan_call(x["q"], x["v"], x["cu_seqlens"], "off"), backend=backend)
    fwd_mod.forward(*args, plan=plan_call(x["q"], x["v"], x["cu_seqlens"], "off")._replace(ends_at_T=False),
                    backend=backend)
    assert seen[0] is not None and seen[1] is None  # preallocated uninitialised / left to the launcher's zero fill


# ------------------------------------------------------------------ finding 2: device offsets checked without a sync


@pytest.mark.parametrize("cu,T", [([0, 5, 3, 10], 10), ([1, 3, 10], 10), ([0, 3, 12], 10), ([0, -2, 10], 10)])
def test_async_offsets_check_rejects_bad_offsets(cu, T):
    """`assert_offsets_async` (what the op enqueues on device offsets) fails on decreasing offsets, a
    start other than 0, and an end past T; on a CPU tensor the assert raises at once."""
    from flashqla.contract import assert_offsets_async

    with pytest.raises(RuntimeError, match="cu_seqlens must start at 0"):
        assert_offsets_async(torch.tensor(cu, dtype=torch.int32), T)


@pytest.mark.parametrize("cu,T", [([0, 3, 3, 10], 10), ([0, 0, 0], 0), ([0, 10], 10), ([0, 3, 8], 10)])
def test_async_offsets_check_accepts_valid_offsets(cu, T):
    """Valid offsets pass, also one that ends before T (a packed tail of no sequence: o zero there)."""
    from flashqla.contract import assert_offsets_async

    assert_offsets_async(torch.tensor(cu, dtype=torch.int64), T)


def test_offsets_check_applies_where_documented():
    """Off by default, on when asked for device offsets, never for CPU ones (their values are read
    anyway); a non-bool is a TypeError naming check_offsets."""
    from flashqla.contract import offsets_check_applies

    meta = torch.zeros(3, dtype=torch.int32, device="meta")
    assert offsets_check_applies(True, meta)
    assert not offsets_check_applies(False, meta)
    assert not offsets_check_applies(True, torch.zeros(3, dtype=torch.int32))
    assert not offsets_check_applies(True, None)
    for bad in (None, 1, "yes"):
        with pytest.raises(TypeError, match="check_offsets"):
            offsets_check_applies(bad, meta)


def test_op_rejects_a_bad_check_offsets_before_anything_else():
    x = make_gdn_inputs(B=1, T=16, H=1, HV=1, seqlens=[10, 6], seed=0)
    with pytest.raises(TypeError, match="check_offsets"):
        flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x["cu_seqlens"],
                                        check_offsets=1)

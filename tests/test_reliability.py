"""Regression tests of issue 44 ("Reliability"), the CPU-visible findings; each docstring says what the
code did before the fix.

- finding 6: a numpy cu_seqlens / initial_state, the planner's NaN / float sizes, torch.compile on CPU
  tensors, a missing nvcc, the backend's zero-buffer cache shared between streams;
- finding 3: one gate floor (`flashqla.contract.G_FLOOR`) on every path, g = -inf as "forget everything";
- finding 4: the valid input domain (beta in [0, 1], finite inputs) checked where it costs no sync,
  and with `check_inputs=True`;
- finding 2: cu_seqlens ending before T on CPU offsets; o's tail never uninitialised memory;
- finding 1: `flashqla.distributed` ranks that disagree fail fast, with one error on every rank.
"""

from __future__ import annotations

import math

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
    if case in ("cu_seqlens", "ok"):
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


DISAGREEMENTS = ("cu_seqlens", "HV", "beta", "backward", "ok")


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
    and every rank raises, naming the argument and the ranks, within seconds (the whole spawn, five
    cases on two ranks, must end well inside the 30 s group timeout)."""
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

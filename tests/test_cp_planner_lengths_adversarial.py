"""Awkward inputs for the backward planner costed on every sequence's length
(`flashqla.cp.plan.plan_cp(seqlens=...)`, `flashqla.contract.planning_seqlens`) and its plumbing:
invalid lengths that must not silently turn `cp="on"` off, and a backward given other lengths than its
forward (correct, the kept states not reused). (Planning cost and cache-independent checks:
tests/test_cp_planner_lengths.py.) CPU only (the fp64 stand-in backend of
tests/test_cp_public_op.py)."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashqla.cp.backward as cp_backward_mod
import flashqla.ops.gdn.fwd as fwd_mod
from flashqla.cp import plan as P
from flashqla.testing import make_gdn_inputs, rel_rms
from tests.test_cp_public_op import cpu_backend, small_gpu  # noqa: F401 (fixtures)


@pytest.fixture
def fwd_gates_lifted(monkeypatch):
    """The forward driver's device / dtype gates (bound in `flashqla.ops.gdn.fwd` at import), lifted as
    `cpu_backend` lifts the public op's: its fp64 CPU inputs reach the stand-in backend."""
    monkeypatch.setattr(fwd_mod, "check_device", lambda q: None)
    monkeypatch.setattr(fwd_mod, "check_supported", lambda *a: None)


@pytest.fixture
def fresh_plans():
    P.clear_plan_cache()
    yield
    P.clear_plan_cache()


class _UnsplitRan(Exception):
    pass


@pytest.mark.parametrize(
    "seqlens",
    [(512, 512, 7000), (1024, 7168), tuple(np.array([512, 512, 7168]))],
    ids=["sum-not-T", "not-N", "numpy-ints"],
)
def test_cp_on_backward_never_silently_drops_the_split(small_gpu, monkeypatch, fresh_plans, seqlens):
    """`chunk_gated_delta_rule_bwd(cp="on", seqlens=...)`: lengths the planner rejects were swallowed by
    `cp_splits` (False), so the backward ran unsplit although cp="on" means always split. Either the
    lengths are usable (the split backward runs) or the call is a ValueError naming seqlens."""
    from flashqla.ops.gdn import bwd as bwd_mod

    lens = [512, 512, 7168]
    x = make_gdn_inputs(B=1, T=sum(lens), H=1, HV=2, K=128, V=128, seqlens=lens, seed=41)
    split_ran = []

    def split(*a, **kw):  # the split backward's stand-in: recorded, placeholder gradients
        split_ran.append(1)
        return tuple(torch.zeros(1) for _ in range(6))

    monkeypatch.setattr(bwd_mod, "cp_backward", split)

    def unsplit(*a, **kw):
        raise _UnsplitRan

    monkeypatch.setattr(small_gpu, "bwd", unsplit)  # the unsplit backward's launch (the default backend's)
    # placeholder products of the caller's slot shape (checked before planning; never read here)
    S = sum(lens) // 64 + len(lens)
    A, G = torch.zeros(2, S * 64, 64, dtype=x["q"].dtype), torch.zeros(2, S * 64)
    try:
        bwd_mod.chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], A, G, x["v"],
                                           cu_seqlens=x["cu_seqlens"], cp="on", seqlens=seqlens)
    except ValueError as e:
        assert "seqlens" in str(e)
    except _UnsplitRan:
        pytest.fail(f"cp='on' with seqlens={seqlens!r}: the backward ran unsplit without a word")
    else:
        assert split_ran


def test_backward_with_other_lengths_than_its_forward(small_gpu, fwd_gates_lifted, monkeypatch, fresh_plans):
    """The forward keeps its split states for the lengths it was given; a backward given other lengths
    (a plan with another L) does not use them, and its gradients are those of the matching backward."""
    from flashqla.ops.gdn import bwd as bwd_mod
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    applied = []
    real = cp_backward_mod.saved_applies

    def recorded(saved, tab, *a):
        applied.append((tab.segment_len, real(saved, tab, *a)))
        return applied[-1][1]

    # the backward driver and cp_backward each bind it at import
    monkeypatch.setattr(bwd_mod, "saved_applies", recorded)
    monkeypatch.setattr(cp_backward_mod, "saved_applies", recorded)
    lens = (6849, 661, 682)
    x = make_gdn_inputs(B=1, T=sum(lens), H=1, HV=2, K=128, V=128, seqlens=list(lens), seed=42)
    f = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, x["initial_state"], True,
                                   x["cu_seqlens"], cp="on", keep_cp_states=True, seqlens=lens)
    assert f.cp_saved is not None
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(f.o.shape, generator=gen, dtype=f.o.dtype)
    dht = torch.randn(f.final_state.shape, generator=gen, dtype=f.final_state.dtype)
    grads = {}
    for bwd_lens in (lens, (1225, 118, 6849)):  # L = 1536, then L = 1024 (16 SMs, cp="on")
        grads[bwd_lens] = chunk_gated_delta_rule_bwd(f.q, f.k, x["v"], x["g"], x["beta"], f.A, f.g_cum_log2, do, dht,
                                                     None, x["initial_state"], x["cu_seqlens"], cp="on",
                                                     cp_saved=f.cp_saved, seqlens=bwd_lens)
    assert f.cp_saved.segment_len == 1536
    # each backward asks once in the driver (whether to read the kept A as it is) and once in cp_backward
    assert list(dict.fromkeys(applied)) == [(1536, True), (1024, False)], applied
    for a, b in zip(*grads.values()):
        assert rel_rms(b, a) < 1e-10

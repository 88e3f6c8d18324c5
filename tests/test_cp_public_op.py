"""The public op's context-parallel wiring end to end on CPU: `flashqla.chunk_gated_delta_rule(...,
cp="on")` -> custom op `flashqla::gdn_fwd` -> `flashqla.cp.driver` (forward) and, through autograd,
`flashqla::gdn_bwd` -> `chunk_gated_delta_rule_bwd(cp=...)` -> the driver's split backward, with the
driver's backend replaced by the fp64 stand-in of the kernels (`reference.gdn.cp.ReferenceCPBackend`)
and the device / dtype gates of the fast path lifted. Outputs, final state and every gradient
against autograd of the fp64 reference op."""

from __future__ import annotations

import pytest
import torch

import flashqla
import reference
from flashqla.cp import driver
from flashqla.ops.gdn import api
from flashqla.testing import make_gdn_inputs, rel_rms
from reference.gdn.cp import ReferenceCPBackend

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.fixture
def cpu_backend(monkeypatch):
    backend = ReferenceCPBackend()
    monkeypatch.setattr(driver, "_BACKEND", backend)
    monkeypatch.setattr(api, "_check_device", lambda q: None)
    monkeypatch.setattr(api, "_check_supported", lambda *a: None)
    return backend


def _run(op, x, **kw):
    leaves = {n: x[n].clone().requires_grad_(True) for n in NAMES if x[n] is not None}
    o, ht = op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
               initial_state=leaves.get("initial_state"), output_final_state=True, cu_seqlens=x["cu_seqlens"], **kw)
    gen = torch.Generator().manual_seed(5)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum() + (ht * torch.randn(ht.shape, generator=gen, dtype=ht.dtype)).sum()
    loss.backward()
    return o.detach(), ht.detach(), {n: t.grad for n, t in leaves.items()}


@pytest.mark.parametrize("seqlens", [None, [700, 0, 1, 300]], ids=["one-sequence", "varlen"])
def test_public_op_cp_on_equals_reference(cpu_backend, seqlens):
    T = 1000 if seqlens is None else sum(seqlens)
    x = make_gdn_inputs(B=1, T=T, H=1, HV=2, K=128, V=128, seqlens=seqlens, seed=21)
    o, ht, grads = _run(flashqla.chunk_gated_delta_rule, x, cp="on")
    o_ref, ht_ref, g_ref = _run(reference.chunk_gated_delta_rule, x)
    kinds = {k for k, _ in cpu_backend.launches}
    assert {"prepare", "recurrent", "bwd"} <= kinds, cpu_backend.launches
    N = 1 if seqlens is None else len(seqlens)
    assert max(n for k, n in cpu_backend.launches if k == "recurrent") > N, "the forward did not split"
    assert max(n for k, n in cpu_backend.launches if k == "bwd") > N, "the backward did not split"
    assert rel_rms(o, o_ref) < 1e-12 and rel_rms(ht, ht_ref) < 1e-12
    for n in g_ref:
        assert g_ref[n].abs().sum() > 0, n
        assert rel_rms(grads[n], g_ref[n]) < 1e-10, (n, rel_rms(grads[n], g_ref[n]))


# --- the host copy of the offsets (FLA's `cu_seqlens_cpu`) as the planner's length hint -------------

UNBALANCED = [64, 1984]  # at 16 SMs and 2 value heads: unsplit when taken as 2 x 1024, split at L = 512 when known


@pytest.fixture
def small_gpu(cpu_backend, monkeypatch):
    """The planner sees 16 SMs (a CPU tensor's device reports DEFAULT_SM_COUNT), and prices the unsplit
    launch at BV = 64 as the split path's (CHUNK_COST): these tests check how the hint reaches the
    plans, on a mix chosen for those costs (UNSPLIT_CHUNK_COST's cheaper BV = 64 keeps it unsplit)."""
    from flashqla.cp import planner

    monkeypatch.setattr(planner, "DEFAULT_SM_COUNT", 16)
    monkeypatch.setattr(planner, "UNSPLIT_CHUNK_COST", dict(planner.CHUNK_COST))
    planner.clear_plan_cache()  # both caches: plans made under other costs must not leak in or out
    yield cpu_backend
    planner.clear_plan_cache()


def _forward_split(backend, N) -> bool:
    return max(n for k, n in backend.launches if k == "recurrent") > N


def test_without_the_hint_lengths_are_taken_balanced(small_gpu):
    x = make_gdn_inputs(B=1, T=sum(UNBALANCED), H=1, HV=2, K=128, V=128, seqlens=UNBALANCED, seed=23)
    assert not driver.cp_splits(x["q"], x["v"], x["cu_seqlens"], "auto")
    assert driver.cp_splits(x["q"], x["v"], x["cu_seqlens"], "auto", max_seqlen=1984)


@pytest.mark.parametrize("hint", [UNBALANCED, [1984, 64], [16, 2032]], ids=["true-lengths", "swapped", "wrong-longest"])
def test_cu_seqlens_cpu_plans_only(small_gpu, hint):
    """With the hint the unbalanced batch is split; whatever the hint says (here it may disagree with
    cu_seqlens), the outputs and every gradient equal the fp64 reference op's: the segment tables come
    from cu_seqlens."""
    x = make_gdn_inputs(B=1, T=sum(UNBALANCED), H=1, HV=2, K=128, V=128, seqlens=UNBALANCED, seed=23)
    o, ht, grads = _run(flashqla.chunk_gated_delta_rule, x, cp="auto",
                        cu_seqlens_cpu=torch.tensor([0, hint[0], hint[0] + hint[1]]))
    o_ref, ht_ref, g_ref = _run(reference.chunk_gated_delta_rule, x)
    assert _forward_split(small_gpu, 2), small_gpu.launches
    assert rel_rms(o, o_ref) < 1e-12 and rel_rms(ht, ht_ref) < 1e-12
    for n in g_ref:
        assert g_ref[n].abs().sum() > 0, n
        assert rel_rms(grads[n], g_ref[n]) < 1e-10, (n, rel_rms(grads[n], g_ref[n]))


@pytest.fixture
def spy(small_gpu, monkeypatch):
    """Records (backward, max_seqlen) of every plan lookup of the forward and the backward."""
    seen = []
    real = driver.cp_splits

    def cp_splits(*a, **kw):
        seen.append((kw.get("backward", False), kw.get("max_seqlen")))
        return real(*a, **kw)

    monkeypatch.setattr(driver, "cp_splits", cp_splits)
    return seen


def test_cu_seqlens_cpu_reaches_the_backward_plan(spy):
    """The autograd backward plans with the same hint as the forward (which, keeping its split states
    for the backward, asks the backward's plan first and stops there when that splits)."""
    x = make_gdn_inputs(B=1, T=sum(UNBALANCED), H=1, HV=2, K=128, V=128, seqlens=UNBALANCED, seed=24)
    _run(flashqla.chunk_gated_delta_rule, x, cp="auto", cu_seqlens_cpu=torch.tensor([0, 64, 2048], dtype=torch.int32))
    assert len(spy) >= 2 and all(ms == 1984 for _, ms in spy) and (True, 1984) in spy, spy

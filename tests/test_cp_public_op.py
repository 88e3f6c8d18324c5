"""The public op's context-parallel wiring end to end on CPU: `flashqla.chunk_gated_delta_rule(...,
cp="on")` plans once (`flashqla.cp.plan.plan_call`) -> `autograd.GDNEagerFunction` -> the forward driver
(`flashqla.ops.gdn.fwd.forward`, `flashqla.cp.forward`) and, through autograd,
`chunk_gated_delta_rule_bwd(plan=...)` -> the split backward (`flashqla.cp.backward`), with the
default backend replaced by the fp64 stand-in of the kernels (`reference.gdn.cp.ReferenceCPBackend`)
and the device / dtype gates of the fast path lifted. Outputs, final state and every gradient
against autograd of the fp64 reference op."""

from __future__ import annotations

import pytest
import torch

import flashqla
import flashqla.cp.plan as cp_plan
import flashqla.ops.gdn.autograd as autograd_mod
import flashqla.ops.gdn.bwd as bwd_mod
import flashqla.ops.gdn.backend as backend_mod
import reference
from flashqla.ops.gdn import api
from flashqla.testing import make_gdn_inputs, rel_rms
from reference.gdn.cp import ReferenceCPBackend

NAMES = ("q", "k", "v", "g", "beta", "initial_state")


@pytest.fixture
def cpu_backend(monkeypatch):
    backend = ReferenceCPBackend()
    monkeypatch.setattr(backend_mod, "_DEFAULT", backend)
    for mod in (api, autograd_mod, bwd_mod):  # the public op's checks and the custom ops' own
        monkeypatch.setattr(mod, "check_device", lambda q: None)
        monkeypatch.setattr(mod, "check_supported", lambda *a: None)
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
    monkeypatch.setattr(cp_plan, "DEFAULT_SM_COUNT", 16)
    monkeypatch.setattr(cp_plan, "UNSPLIT_CHUNK_COST", dict(cp_plan.CHUNK_COST))
    cp_plan.clear_plan_cache()  # both caches: plans made under other costs must not leak in or out
    yield cpu_backend
    cp_plan.clear_plan_cache()


def _forward_split(backend, N) -> bool:
    return max(n for k, n in backend.launches if k == "recurrent") > N


def test_without_the_hint_lengths_are_taken_balanced(small_gpu):
    x = make_gdn_inputs(B=1, T=sum(UNBALANCED), H=1, HV=2, K=128, V=128, seqlens=UNBALANCED, seed=23)
    assert not cp_plan.cp_splits(x["q"], x["v"], x["cu_seqlens"], "auto")
    assert cp_plan.cp_splits(x["q"], x["v"], x["cu_seqlens"], "auto", max_seqlen=1984)


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
    """Records (backward, max_seqlen) of every plan lookup of the forward and the backward: the op plans
    once (`plan_call` -> `plan_for`, recorded there) and hands the backward its plan, recorded when the
    autograd backward runs on it as the lookup that made it ((True, None) for a plan from no lookup)."""
    seen = []
    made = []  # (plan, backward, max_seqlen) of every lookup
    real_plan_for = cp_plan.plan_for

    def plan_for(*a, **kw):
        plan = real_plan_for(*a, **kw)
        seen.append((kw.get("backward", False), kw.get("max_seqlen")))
        made.append((plan, kw.get("backward", False), kw.get("max_seqlen")))
        return plan

    real_bwd = autograd_mod.backward

    def chunk_gated_delta_rule_bwd(*a, plan=None, **kw):
        if plan is None:  # the backward plans for itself (through plan_for, recorded there)
            return real_bwd(*a, plan=plan, **kw)
        seen.append(next(((True, ms) for p, bwd, ms in made if p is plan and bwd), (True, None)))
        return real_bwd(*a, plan=plan, **kw)

    monkeypatch.setattr(cp_plan, "plan_for", plan_for)
    monkeypatch.setattr(bwd_mod, "plan_for", plan_for)  # the backward's own lookup (the custom ops')
    monkeypatch.setattr(autograd_mod, "backward", chunk_gated_delta_rule_bwd)
    return seen


def test_cu_seqlens_cpu_reaches_the_backward_plan(spy):
    """The autograd backward runs on a plan made with the same hint as the forward's (the op plans once:
    keeping its split states for the backward, it asks the backward's plan first and stops there when
    that splits, and hands that plan to the backward)."""
    x = make_gdn_inputs(B=1, T=sum(UNBALANCED), H=1, HV=2, K=128, V=128, seqlens=UNBALANCED, seed=24)
    _run(flashqla.chunk_gated_delta_rule, x, cp="auto", cu_seqlens_cpu=torch.tensor([0, 64, 2048], dtype=torch.int32))
    assert len(spy) >= 2 and all(ms == 1984 for _, ms in spy) and (True, 1984) in spy, spy

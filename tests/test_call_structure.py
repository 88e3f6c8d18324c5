"""The public op's structure, on the CPU with the kernels' fp64 stand-in
(`reference.gdn.cp.ReferenceCPBackend`): one call validates its inputs once and plans once, and passes
the plan down (the backward of a training call does not plan again); the package's modules import no
circle."""

from __future__ import annotations

import ast
import pathlib
import sys

import pytest

import flashqla
import flashqla.contract
import flashqla.cp.plan
import flashqla.ops.gdn.backend as backend_mod
from flashqla.ops.gdn import api
from flashqla.ops.gdn import autograd as autograd_mod
from flashqla.ops.gdn import bwd as bwd_mod
from flashqla.testing import make_gdn_inputs
from reference.gdn.cp import ReferenceCPBackend

ROOT = pathlib.Path(__file__).resolve().parents[1]


def _count(monkeypatch, module, name: str) -> list:
    """Replaces `module.name` by a counting wrapper in every flashqla module that holds it by name;
    returns the list that grows by one per call."""
    calls = []
    original = getattr(module, name)

    def counted(*args, **kwargs):
        calls.append(name)
        return original(*args, **kwargs)

    for mod in list(sys.modules.values()):
        if getattr(mod, "__name__", "").startswith("flashqla") and getattr(mod, name, None) is original:
            monkeypatch.setattr(mod, name, counted)
    return calls


@pytest.fixture
def counters(monkeypatch):
    monkeypatch.setattr(backend_mod, "_DEFAULT", ReferenceCPBackend())
    for mod in (api, autograd_mod, bwd_mod):  # the public op's checks and the custom ops' own
        monkeypatch.setattr(mod, "check_device", lambda q: None)
        monkeypatch.setattr(mod, "check_supported", lambda *a: None)
    return {name: _count(monkeypatch, mod, name) for mod, name in (
        (flashqla.contract, "check_gdn_inputs"), (flashqla.cp.plan, "plan_call"), (flashqla.cp.plan, "plan_for"))}


@pytest.mark.parametrize("cp", ["off", "on"])
@pytest.mark.parametrize("training", [False, True])
def test_one_validation_and_one_plan_per_call(counters, cp, training):
    x = make_gdn_inputs(B=1, T=300, H=1, HV=2, K=128, V=128, seqlens=[200, 100], seed=3)
    leaves = {n: x[n].clone().requires_grad_(training) for n in ("q", "k", "v", "g", "beta", "initial_state")}
    o, ht = flashqla.chunk_gated_delta_rule(**leaves, output_final_state=True, cu_seqlens=x["cu_seqlens"], cp=cp)
    assert counters["check_gdn_inputs"] == ["check_gdn_inputs"]
    assert counters["plan_call"] == ["plan_call"]
    # the forward's plan, and in training the backward's, each made once; a training forward that keeps
    # its split states runs the backward's plan (cp="on": it splits), so it makes that one only
    assert len(counters["plan_for"]) == (2 if training and cp == "off" else 1)
    if training:
        before = len(counters["plan_for"])
        (o.sum() + ht.sum()).backward()
        assert counters["check_gdn_inputs"] == ["check_gdn_inputs"] and counters["plan_call"] == ["plan_call"]
        assert len(counters["plan_for"]) == before, "the backward planned again"
        assert all(leaves[n].grad is not None for n in leaves)


def _flashqla_import_graph():
    """{module: {flashqla modules it imports, at module level or inside functions}}."""
    mods = {}
    for p in (ROOT / "flashqla").rglob("*.py"):
        rel = p.relative_to(ROOT).with_suffix("")
        mods[".".join(rel.parts[:-1] if rel.name == "__init__" else rel.parts)] = p

    def resolve(name):
        while name and name not in mods:
            name = name.rpartition(".")[0]
        return name or None

    graph = {m: set() for m in mods}
    for m, p in mods.items():
        for node in ast.walk(ast.parse(p.read_text())):
            targets = []
            if isinstance(node, ast.Import):
                targets = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and node.module and node.level == 0:
                targets = [f"{node.module}.{a.name}" if f"{node.module}.{a.name}" in mods else node.module for a in node.names]
            for t in targets:
                r = resolve(t) if t.startswith("flashqla") else None
                if r and r != m:
                    graph[m].add(r)
    return graph


def test_no_import_circles():
    """No module of the package reaches itself through imports (module level or deferred)."""
    graph = _flashqla_import_graph()
    state, cycles = {}, []

    def visit(m, stack):
        state[m] = 1
        stack.append(m)
        for n in sorted(graph[m]):
            if state.get(n) == 1:
                cycles.append(stack[stack.index(n):] + [n])
            elif n not in state:
                visit(n, stack)
        stack.pop()
        state[m] = 2

    for m in sorted(graph):
        if m not in state:
            visit(m, [])
    assert not cycles, cycles


def test_kernel_modules_import_only_their_common_module():
    graph = _flashqla_import_graph()
    pkg = "flashqla.ops.gdn.kernels.sm90"
    for m, deps in graph.items():
        if m.startswith(pkg + ".") and m not in (pkg + ".registry",):
            assert deps <= {pkg + "._common"}, (m, deps)

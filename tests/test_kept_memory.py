"""What the op's training forward keeps for its backward, per token, whatever the sequence mix
(issue: memory that grows with the number of sequences). A and g_cum_log2 are laid out in chunk
slots (every sequence padded to whole chunks of 64 rows), so batches of short sequences have up to
64 rows per token; the forward keeps them only while they hold at most `KEEP_ROWS_PER_TOKEN` rows per
token (`flashqla.ops.gdn.autograd.keeps_products`), else the backward recomputes them (one prepare
launch) and gives the same gradients, bitwise. On CPU with the fp64 stand-in of the kernels
(`reference.gdn.cp.ReferenceCPBackend`): the bytes autograd saves are counted with a saved-tensors
hook, for the eager path (`GDNEagerFunction`) and the custom ops `torch.compile` uses."""

from __future__ import annotations

import pytest
import torch

import flashqla
import flashqla.ops.gdn.autograd as autograd_mod
import flashqla.ops.gdn.backend as backend_mod
import flashqla.ops.gdn.bwd as bwd_mod
import reference
from flashqla.ops.gdn import api
from flashqla.testing import make_gdn_inputs, rel_rms
from reference.gdn.cp import ReferenceCPBackend

NAMES = ("q", "k", "v", "g", "beta", "initial_state")
H, HV, K = 1, 2, 64


@pytest.fixture
def cpu_backend(monkeypatch):
    backend = ReferenceCPBackend()
    monkeypatch.setattr(backend_mod, "_DEFAULT", backend)
    for mod in (api, autograd_mod, bwd_mod):
        monkeypatch.setattr(mod, "check_device", lambda q: None)
        monkeypatch.setattr(mod, "check_supported", lambda *a: None)
    return backend


def _train(x, op=None, **kw):
    """o, final state, the gradients, and the bytes of every tensor autograd saved that is not an
    input of the call (what the forward adds to memory until the backward)."""
    op = op or flashqla.chunk_gated_delta_rule
    leaves = {n: x[n].clone().requires_grad_(True) for n in NAMES if x[n] is not None}
    inputs = {t.data_ptr() for t in leaves.values()} | {x["cu_seqlens"].data_ptr()}
    saved = []

    def pack(t):
        if t.data_ptr() not in inputs and t.numel():
            saved.append(t.numel() * t.element_size())
        return t

    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        o, ht = op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                   initial_state=leaves["initial_state"], output_final_state=True, cu_seqlens=x["cu_seqlens"], **kw)
    gen = torch.Generator().manual_seed(5)
    loss = (o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
    loss = loss + (ht * torch.randn(ht.shape, generator=gen, dtype=ht.dtype)).sum()
    loss.backward()
    return o.detach(), ht.detach(), {n: t.grad for n, t in leaves.items()}, sum(saved)


def _inputs(lengths, seed=3):
    return make_gdn_inputs(B=1, T=sum(lengths), H=H, HV=HV, K=K, V=K, seqlens=lengths, seed=seed)


def test_keeps_products_is_a_bound_on_rows_per_token():
    q = torch.empty(1, 640, H, K)
    cu = lambda n: torch.zeros(n + 1, dtype=torch.int32)  # noqa: E731 - only its shape is read
    assert autograd_mod.keeps_products(q, cu(1))          # 11 slots = 704 rows for 640 tokens
    assert autograd_mod.keeps_products(q, cu(10))         # 20 slots = 1280 rows = 2 per token
    assert not autograd_mod.keeps_products(q, cu(11))     # 21 slots: above 2 rows per token
    assert not autograd_mod.keeps_products(q, cu(640))    # one-token sequences: 65 rows per token
    assert not autograd_mod.keeps_products(torch.empty(3, 1, H, K), None)  # fixed length: 3 one-token rows
    assert autograd_mod.keeps_products(torch.empty(4, 640, H, K), None)


@pytest.mark.parametrize("cp", ["off", "auto"])
def test_short_sequences_keep_nothing_slot_sized(cpu_backend, cp, monkeypatch):
    """One- to three-token sequences (200 of them, 400 tokens): the forward keeps no A or g_cum_log2
    (saved bytes under a bound that does not grow with the number of sequences), the backward
    recomputes them, and o, the final states and every gradient are bitwise those of a run that kept
    them, and equal the fp64 reference's."""
    lengths = [1 + i % 3 for i in range(200)]
    x = _inputs(lengths)
    T = sum(lengths)
    o, ht, grads, kept = _train(x, cp=cp)
    prepares = sum(kind == "prepare" for kind, _ in cpu_backend.launches)
    assert prepares == 2, cpu_backend.launches  # the forward's and the backward's recompute
    per_token_head = kept / (T * HV)
    assert per_token_head <= 2 * 64 * 8 + 64 * 8, per_token_head  # what the slot layout would be is 64x more
    monkeypatch.setattr(autograd_mod, "KEEP_ROWS_PER_TOKEN", 10**9)
    o2, ht2, grads2, kept2 = _train(x, cp=cp)
    assert kept2 > 10 * kept  # keeping would hold the slot-sized A (fp64 here: 207 slots x 64 rows)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    for n in grads:
        assert torch.equal(grads[n], grads2[n]), n
    o_ref, ht_ref, g_ref, _ = _train(x, op=reference.chunk_gated_delta_rule)
    assert rel_rms(o, o_ref) < 1e-12 and rel_rms(ht, ht_ref) < 1e-12
    for n in g_ref:
        assert rel_rms(grads[n], g_ref[n]) < 1e-10, n


def test_long_sequences_keep_their_products(cpu_backend):
    """Sequences of 64 tokens and more keep A and g_cum_log2 (no prepare in the backward)."""
    x = _inputs([300, 0, 200, 130])
    _train(x, cp="off")
    assert sum(kind == "prepare" for kind, _ in cpu_backend.launches) == 1, cpu_backend.launches


def test_custom_ops_return_empty_products_when_not_kept(cpu_backend):
    """gdn_fwd (the ops torch.compile calls) returns empty A / g_cum_log2 for short sequences, its fake
    implementation the same shapes, and gdn_bwd recomputes them: the gradients equal the eager path's."""
    lengths = [1, 2, 3, 1] * 20
    x = _inputs(lengths, seed=4)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"], K ** -0.5, x["initial_state"], True, x["cu_seqlens"], "off", None)
    o, ht, A, G = autograd_mod.gdn_fwd(*args)
    assert A.shape == (0,) and G.shape == (0,)
    fake = autograd_mod._gdn_fwd_fake(*args)
    assert [tuple(t.shape) for t in fake] == [tuple(t.shape) for t in (o, ht, A, G)]
    do = torch.randn_like(x["v"])
    grads = autograd_mod.gdn_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], A, G, do, None, K ** -0.5,
                                 x["initial_state"], x["cu_seqlens"], "off", None, True)
    f = bwd_mod.chunk_gated_delta_rule_bwd
    A2, G2 = cpu_backend.prepare(x["k"], x["g"], x["beta"], x["cu_seqlens"], HV)
    want = f(x["q"], x["k"], x["v"], x["g"], x["beta"], A2, G2, do, None, K ** -0.5, x["initial_state"],
             x["cu_seqlens"], cp="off")
    for a, b in zip(grads, want):
        assert torch.equal(a, b)

"""FLA's hand-written chunked backward (reference.gdn.chunk_bwd, through reference.chunk_gated_delta_rule)
against autograd of the fp64 token recurrence, end to end and stage by stage (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from flashqla.testing import BUDGETS, assert_close_rel, make_gdn_inputs, rel_rms
from reference import chunk_gated_delta_rule, recurrent_gated_delta_rule
from reference.gdn.chunk import chunk_fwd_h, chunk_gated_delta_rule_fwd, recompute_w_u
from reference.gdn.chunk_bwd import (
    chunk_bwd_dhu,
    chunk_bwd_dqkwg,
    chunk_bwd_dv_local,
    chunk_gated_delta_rule_bwd,
    prepare_wy_repr_bwd,
)
from reference.gdn.recurrent import seq_bounds

BUDGET = BUDGETS["reference_fp64"]
F64 = torch.float64
GRAD_INPUTS = ("q", "k", "v", "g", "beta", "initial_state")
GRAD_NAMES = dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta", initial_state="dh0")


def _inputs(**kw):
    kw.setdefault("K", 16)
    kw.setdefault("V", 8)
    return make_gdn_inputs(**kw)


def _cotangents(x: dict, seed: int = 0):
    """Random do [B, T, HV, V] and dht [N, HV, K, V]."""
    gen = torch.Generator().manual_seed(1000 + seed)
    B, T, HV, V = x["v"].shape
    K = x["k"].shape[-1]
    N = B if x["cu_seqlens"] is None else x["cu_seqlens"].numel() - 1
    return torch.randn(B, T, HV, V, generator=gen, dtype=F64), torch.randn(N, HV, K, V, generator=gen, dtype=F64)


def _grads(fn, x: dict, do, dht, **kw) -> dict:
    """Gradients of <o, do> (+ <final_state, dht> when dht is not None) for every float input."""
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in GRAD_INPUTS if x[n] is not None}
    args = {**x, **leaves}
    o, ht = fn(**args, output_final_state=dht is not None, **kw)
    loss = (o * do.to(o.dtype)).sum()
    if dht is not None:
        loss = loss + (ht * dht.to(ht.dtype)).sum()
    loss.backward()
    return {GRAD_NAMES[n]: t.grad for n, t in leaves.items()}


def _check_grads(x: dict, seed: int = 0, use_final_state: bool = True, chunk_size: int = 64, exact_zero=(), **kw) -> dict:
    """Every gradient of the reference op == autograd of the recurrence (relative RMS, fp64).
    Names in `exact_zero` must be identically zero in both (a gradient the inputs make vanish)."""
    do, dht = _cotangents(x, seed)
    dht = dht if use_final_state else None
    ref = _grads(recurrent_gated_delta_rule, x, do, dht, **kw)
    got = _grads(chunk_gated_delta_rule, x, do, dht, chunk_size=chunk_size, **kw)
    assert ref.keys() == got.keys()
    for name in ref:
        assert got[name].dtype == ref[name].dtype, name
        if name in exact_zero:
            assert torch.count_nonzero(ref[name]) == 0 and torch.count_nonzero(got[name]) == 0, name
        else:
            assert_close_rel(name, got[name], ref[name], BUDGET[name])
    return got


# ---------------------------------------------------------------------------------------------
# End to end: hand-written backward == autograd through the recurrence
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 63, 65, 130])
def test_grads_match_recurrence_over_T(T):
    _check_grads(_inputs(B=2, T=T, H=2, HV=4, seed=T), seed=T)


@pytest.mark.parametrize("HV", [2, 8])
def test_grads_match_recurrence_gva(HV):
    _check_grads(_inputs(B=1, T=90, H=2, HV=HV, seed=HV), seed=HV)


@pytest.mark.parametrize(
    "lengths",
    [[0, 5, 70, 33, 0, 20, 0], [1, 2, 17, 64]],
    ids=["empty-first-middle-last", "short-and-aligned"],
)
def test_grads_match_recurrence_varlen(lengths):
    _check_grads(_inputs(B=1, T=sum(lengths), H=2, HV=4, cu_seqlens=lengths, seed=len(lengths)), seed=1)


def test_grads_without_initial_state_or_final_state():
    x = _inputs(B=2, T=80, H=1, HV=2, initial_state=False, seed=2)
    got = _check_grads(x, seed=2, use_final_state=False)
    assert "dh0" not in got
    # final state returned but unused: dht is None inside the backward
    do, _ = _cotangents(x, 2)
    ref = _grads(recurrent_gated_delta_rule, x, do, None)
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    o, ht = chunk_gated_delta_rule(**{**x, **leaves}, output_final_state=True)
    (o * do).sum().backward()
    for n, t in leaves.items():
        assert_close_rel(GRAD_NAMES[n], t.grad, ref[GRAD_NAMES[n]], BUDGET[GRAD_NAMES[n]])


def test_grads_through_final_state_only():
    """Only final_state enters the loss: do is None inside the backward."""
    x = _inputs(B=1, T=100, H=2, HV=4, cu_seqlens=[40, 60], seed=3)
    _, dht = _cotangents(x, 3)
    grads = {}
    for fn in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
        leaves = {n: x[n].detach().clone().requires_grad_(True) for n in GRAD_INPUTS}
        _, ht = fn(**{**x, **leaves}, output_final_state=True)
        (ht * dht).sum().backward()
        grads[fn] = {GRAD_NAMES[n]: t.grad for n, t in leaves.items()}
    for name, ref in grads[recurrent_gated_delta_rule].items():
        got = grads[chunk_gated_delta_rule][name]
        if name == "dq":  # q does not reach the final state: autograd leaves no gradient
            assert ref is None and got is not None and torch.count_nonzero(got) == 0
        else:
            assert_close_rel(name, got, ref, BUDGET[name])


@pytest.mark.parametrize("gate", ["zero", "logsigmoid", -30.0, -300.0])
def test_grads_gates(gate):
    x = _inputs(B=1, T=100, H=2, HV=4, gate=gate, special_heads=False, seed=4)
    got = _check_grads(x, seed=4)
    assert all(bool(torch.isfinite(t).all()) for t in got.values())


@pytest.mark.parametrize("beta_value", [0.0, 1.0])
def test_grads_beta_extremes(beta_value):
    x = _inputs(B=1, T=90, H=2, HV=4, seed=5)
    x["beta"] = torch.full_like(x["beta"], beta_value)
    # beta == 0: nothing is written, so k and v have no effect at all
    _check_grads(x, seed=5, exact_zero=("dk", "dv") if beta_value == 0 else ())


def test_grads_l2norm_in_kernel_and_scale():
    x = _inputs(B=1, T=80, H=2, HV=4, cu_seqlens=[30, 50], seed=6)
    gen = torch.Generator().manual_seed(6)
    x["q"] = 2.0 * torch.randn(x["q"].shape, generator=gen, dtype=F64)
    x["k"] = 0.7 * torch.randn(x["k"].shape, generator=gen, dtype=F64)
    _check_grads(x, seed=6, use_qk_l2norm_in_kernel=True, scale=0.37)


def test_grads_other_chunk_size():
    x = _inputs(B=1, T=60, H=2, HV=4, cu_seqlens=[13, 0, 47], seed=7)
    _check_grads(x, seed=7, chunk_size=16)


def test_grads_k128():
    x = make_gdn_inputs(B=1, T=80, H=1, HV=2, K=128, V=128, seed=8)
    _check_grads(x, seed=8)


def test_gradcheck_tiny():
    """Finite differences on the reference op itself (varlen, GVA, L2 norm, h0 and final state)."""
    x = make_gdn_inputs(B=1, T=11, H=1, HV=2, K=4, V=3, cu_seqlens=[4, 0, 7], gate="logsigmoid", special_heads=False, seed=9)
    # g strictly negative, so that finite-difference steps never leave the valid domain g <= 0
    x["g"] = x["g"].clamp(max=-0.05)
    leaves = [x[n].detach().clone().requires_grad_(True) for n in GRAD_INPUTS]

    def fn(q, k, v, g, beta, h0):
        return chunk_gated_delta_rule(
            q, k, v, g, beta, 0.8, h0, True, x["cu_seqlens"], use_qk_l2norm_in_kernel=True, chunk_size=4
        )

    assert torch.autograd.gradcheck(fn, leaves, eps=1e-6, atol=1e-8, rtol=1e-6)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grad_dtypes_low_precision(dtype):
    """Gradients come back in each input's dtype and stay close to the fp64 recurrence's."""
    x = _inputs(B=1, T=70, H=2, HV=4, dtype=dtype, seed=10)
    do, dht = _cotangents(x, 10)
    got = _grads(chunk_gated_delta_rule, x, do, dht)
    x64 = {n: (t.to(F64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()}
    ref = _grads(recurrent_gated_delta_rule, x64, do, dht)
    tol = 1e-5 if dtype == torch.float32 else 2e-2
    for n in GRAD_INPUTS:
        name = GRAD_NAMES[n]
        assert got[name].dtype == x[n].dtype, name
        assert_close_rel(name, got[name], ref[name], tol)


# ---------------------------------------------------------------------------------------------
# Composition: two calls == one call; varlen == each sequence alone (gradients)
# ---------------------------------------------------------------------------------------------


def test_two_calls_equal_one_grads():
    x = _inputs(B=2, T=150, H=2, HV=4, seed=11)
    do, dht = _cotangents(x, 11)
    one = _grads(chunk_gated_delta_rule, x, do, dht)

    split = 70
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in GRAD_INPUTS}
    part = lambda sl: {n: leaves[n][:, sl] for n in ("q", "k", "v", "g", "beta")}  # noqa: E731
    o1, ht1 = chunk_gated_delta_rule(**part(slice(0, split)), initial_state=leaves["initial_state"], output_final_state=True)
    o2, ht2 = chunk_gated_delta_rule(**part(slice(split, None)), initial_state=ht1, output_final_state=True)
    loss = (torch.cat([o1, o2], 1) * do).sum() + (ht2 * dht).sum()
    loss.backward()
    for n, t in leaves.items():
        name = GRAD_NAMES[n]
        assert_close_rel(f"{name} (two calls)", t.grad, one[name], BUDGET[name])


def test_varlen_equals_each_sequence_alone_grads():
    lengths = [50, 0, 7, 80]
    x = _inputs(B=1, T=sum(lengths), H=2, HV=4, cu_seqlens=lengths, seed=12)
    do, dht = _cotangents(x, 12)
    packed = _grads(chunk_gated_delta_rule, x, do, dht)
    cu = x["cu_seqlens"].tolist()
    for n in range(len(lengths)):
        bos, eos = cu[n], cu[n + 1]
        alone = {m: x[m][:, bos:eos] for m in ("q", "k", "v", "g", "beta")}
        alone.update(initial_state=x["initial_state"][n : n + 1], cu_seqlens=None)
        g_n = _grads(chunk_gated_delta_rule, alone, do[:, bos:eos], dht[n : n + 1])
        assert_close_rel(f"dh0[seq {n}]", g_n["dh0"][0], packed["dh0"][n], BUDGET["dh0"])
        if eos > bos:
            for name in ("dq", "dk", "dv", "dg", "dbeta"):
                assert_close_rel(f"{name}[seq {n}]", g_n[name], packed[name][:, bos:eos], BUDGET[name])
    assert torch.equal(packed["dh0"][1], dht[1])  # the empty sequence passes dht straight through


# ---------------------------------------------------------------------------------------------
# Stage by stage: each hand-written step against autograd of a small, independent per-chunk
# formula (explicit torch.linalg.inv, explicit masks), as FLA's per-kernel tests do
# ---------------------------------------------------------------------------------------------

C_STAGE = 16


def _chunk_list(x: dict, C: int):
    B, T = x["q"].shape[:2]
    out = []
    for n, (b, bos, eos) in enumerate(seq_bounds(B, T, x["cu_seqlens"])):
        out += [(n, b, s, min(s + C, eos), s == bos) for s in range(bos, eos, C)]
    return out


def _gamma_matrix(G: torch.Tensor, strict: bool) -> torch.Tensor:
    """[HV, n, n]: exp(G_r - G_s) on r >= s (r > s when strict), 0 elsewhere; exponent masked first."""
    n = G.shape[-1]
    keep = torch.ones(n, n, dtype=torch.bool).tril(-1 if strict else 0)
    diff = G[:, :, None] - G[:, None, :]
    return torch.where(keep, diff, torch.full_like(diff, -math.inf)).exp()


@pytest.fixture(params=["fixed", "varlen"])
def stage(request):
    if request.param == "fixed":
        x = _inputs(B=2, T=45, H=2, HV=4, seed=13)
    else:
        x = _inputs(B=1, T=80, H=2, HV=4, cu_seqlens=[20, 0, 33, 1, 26], seed=13)
    g_cum, o, A, ht, h, v_new = chunk_gated_delta_rule_fwd(**x, output_final_state=True, chunk_size=C_STAGE)
    do, dht = _cotangents(x, 13)
    return x, g_cum, A, do, dht


def test_stage_prepare_wy_repr_bwd(stage):
    x, g_cum, A, _, _ = stage
    cs = dict(chunk_size=C_STAGE, cu_seqlens=x["cu_seqlens"])
    k, v, beta = x["k"], x["v"], x["beta"]
    H, HV = k.shape[2], v.shape[2]
    gen = torch.Generator().manual_seed(14)
    dw = torch.randn(*v.shape[:3], k.shape[3], generator=gen, dtype=F64)
    du = torch.randn(v.shape, generator=gen, dtype=F64)
    dk, dv, dbeta, dg = prepare_wy_repr_bwd(k, v, beta, g_cum, A, dw, du, **cs)

    ref = {n: torch.zeros_like(t) for n, t in dict(dk=dk, dv=dv, dbeta=dbeta, dg=dg).items()}
    for _, b, s, e, _ in _chunk_list(x, C_STAGE):
        kc = k[b, s:e].transpose(0, 1).clone().requires_grad_(True)  # [H, n, K]
        vc = v[b, s:e].transpose(0, 1).clone().requires_grad_(True)  # [HV, n, V]
        bc = beta[b, s:e].T.clone().requires_grad_(True)  # [HV, n]
        G = g_cum[b, s:e].T.clone().requires_grad_(True)
        ke = kc.repeat_interleave(HV // H, dim=0)
        L = bc[..., None] * (ke @ ke.transpose(1, 2)) * _gamma_matrix(G, strict=True)
        Ai = torch.linalg.inv(torch.eye(e - s, dtype=F64) + L)
        w = Ai @ ((bc * G.exp())[..., None] * ke)
        u = Ai @ (bc[..., None] * vc)
        ((w * dw[b, s:e].transpose(0, 1)).sum() + (u * du[b, s:e].transpose(0, 1)).sum()).backward()
        ref["dk"][b, s:e] = kc.grad.transpose(0, 1)
        ref["dv"][b, s:e] = vc.grad.transpose(0, 1)
        ref["dbeta"][b, s:e] = bc.grad.T
        ref["dg"][b, s:e] = G.grad.T
    for name, t in dict(dk=dk, dv=dv, dbeta=dbeta, dg=dg).items():
        assert_close_rel(f"prepare_wy_repr_bwd {name}", t, ref[name], 1e-12)


def test_stage_dv_local_dhu_dqkwg(stage):
    """Per chunk, with S0 = h[n] and D = dh[n] (the chunk-end gradient), autograd of
    <o, do> + <S_end, D> through o = scale (diag(gamma) Q S0 + (Q K^T * Gamma) v_new),
    S_end = gamma_l S0 + K^T diag(E) v_new, v_new = u - w S0 gives dv2 (= du), dw, dq, dk, the
    per-chunk dg, and dL/dS0 = the previous chunk's dh (dh0 for a sequence's first chunk)."""
    x, g_cum, A, do, dht = stage
    cs = dict(chunk_size=C_STAGE, cu_seqlens=x["cu_seqlens"])
    q, k, v, beta, h0 = x["q"], x["k"], x["v"], x["beta"], x["initial_state"]
    H, HV = k.shape[2], v.shape[2]
    scale = 0.6
    w, u = recompute_w_u(k, v, beta, A, g_cum, **cs)
    h, v_new, _ = chunk_fwd_h(k, w, u, g_cum, h0, False, **cs)
    dv_local = chunk_bwd_dv_local(q, k, do, g_cum, scale, **cs)
    dh, dh0, dv2 = chunk_bwd_dhu(q, k, w, g_cum, h0, dht, do, dv_local, scale, **cs)
    dq, dk, dw, dg = chunk_bwd_dqkwg(q, k, v_new, w, g_cum, h, dv2, do, dh, scale, **cs)

    chunks = _chunk_list(x, C_STAGE)
    h_flat, dh_flat = h.reshape(len(chunks), *h.shape[2:]), dh.reshape(len(chunks), *dh.shape[2:])
    ref = {n: torch.zeros_like(t) for n, t in dict(dv_local=dv_local, dv2=dv2, dq=dq, dk=dk, dw=dw, dg=dg).items()}
    dS0_checked = 0
    for c, (n, b, s, e, first) in enumerate(chunks):
        qc = q[b, s:e].transpose(0, 1).clone().requires_grad_(True)  # [H, n, K]
        kc = k[b, s:e].transpose(0, 1).clone().requires_grad_(True)
        uc = u[b, s:e].transpose(0, 1).clone().requires_grad_(True)  # [HV, n, V]
        wc = w[b, s:e].transpose(0, 1).clone().requires_grad_(True)  # [HV, n, K]
        G = g_cum[b, s:e].T.clone().requires_grad_(True)  # [HV, n]
        S0 = h_flat[c].clone().requires_grad_(True)  # [HV, K, V]
        qe, ke = qc.repeat_interleave(HV // H, dim=0), kc.repeat_interleave(HV // H, dim=0)
        vn = uc - wc @ S0
        o = scale * (G.exp()[..., None] * (qe @ S0) + ((qe @ ke.transpose(1, 2)) * _gamma_matrix(G, False)) @ vn)
        E = (G[:, -1:] - G).exp()
        S_end = G[:, -1].exp()[:, None, None] * S0 + ke.transpose(1, 2) @ (E[..., None] * vn)
        doc = do[b, s:e].transpose(0, 1)
        # intra-chunk part of dL/dv_new alone (chunk_bwd_dv_local)
        (dvn_local,) = torch.autograd.grad((o * doc).sum(), vn, retain_graph=True)
        ref["dv_local"][b, s:e] = dvn_local.transpose(0, 1)
        ((o * doc).sum() + (S_end * dh_flat[c]).sum()).backward()
        ref["dv2"][b, s:e] = uc.grad.transpose(0, 1)
        ref["dw"][b, s:e] = wc.grad.transpose(0, 1)
        ref["dq"][b, s:e] = qc.grad.transpose(0, 1)
        ref["dk"][b, s:e] = kc.grad.transpose(0, 1)
        ref["dg"][b, s:e] = G.grad.T
        prev = dh0[n] if first else dh_flat[c - 1]
        assert_close_rel(f"dS0 of chunk {c}", prev, S0.grad, 1e-12)
        dS0_checked += 1
    assert dS0_checked == len(chunks)
    # dk here is the part through o and the state update; w's dependence on k is prepare_wy_repr_bwd's
    for name, t in dict(dv_local=dv_local, dv2=dv2, dq=dq, dk=dk, dw=dw, dg=dg).items():
        assert_close_rel(f"{name}", t, ref[name], 1e-12)
    # the last chunk of each sequence starts from dht; an empty sequence passes dht through as dh0
    last = {}
    for c, (n, *_rest) in enumerate(chunks):
        last[n] = c
    for n, c in last.items():
        assert torch.equal(dh_flat[c], dht[n])
    N = dht.shape[0]
    for n in set(range(N)) - set(last):
        assert torch.equal(dh0[n], dht[n])


def test_stage_full_bwd_function(stage):
    """chunk_gated_delta_rule_bwd == autograd of the recurrence (the op's path, called directly)."""
    x, g_cum, A, do, dht = stage
    dq, dk, dv, dg, dbeta, dh0 = chunk_gated_delta_rule_bwd(
        x["q"], x["k"], x["v"], g_cum, x["beta"], A, x["k"].shape[-1] ** -0.5, x["initial_state"], do, dht,
        cu_seqlens=x["cu_seqlens"], chunk_size=C_STAGE,
    )
    ref = _grads(recurrent_gated_delta_rule, x, do, dht)
    for name, t in dict(dq=dq, dk=dk, dv=dv, dg=dg, dbeta=dbeta, dh0=dh0).items():
        assert_close_rel(name, t, ref[name], BUDGET[name])
    none = chunk_gated_delta_rule_bwd(
        x["q"], x["k"], x["v"], g_cum, x["beta"], A, 0.25, None, do, None, cu_seqlens=x["cu_seqlens"], chunk_size=C_STAGE
    )
    assert none[5] is None


def test_l2norm_in_kernel_with_bf16_inputs():
    """bf16 q/k/v with the in-kernel L2 norm: q and k are normalised in the compute dtype and v
    joins them (it used to raise "q, k and v must share one dtype"); outputs and gradients keep the
    input dtypes and agree with the fp64 run on the same rounded values."""
    x = make_gdn_inputs(B=1, T=70, H=1, HV=2, K=16, V=16, seed=3)
    q, k, v = (x[n].to(torch.bfloat16) for n in "qkv")
    args = (x["g"].float(), x["beta"].float())
    leaves = [t.clone().requires_grad_(True) for t in (q, k, v)]
    o, _ = chunk_gated_delta_rule(*leaves, *args, use_qk_l2norm_in_kernel=True)
    o.float().sum().backward()
    leaves64 = [t.double().requires_grad_(True) for t in (q, k, v)]
    o64, _ = chunk_gated_delta_rule(*leaves64, x["g"], x["beta"], use_qk_l2norm_in_kernel=True)
    o64.sum().backward()
    assert o.dtype == torch.bfloat16 and all(t.grad.dtype == torch.bfloat16 for t in leaves)
    assert rel_rms(o, o64) < 1e-2
    for a, b in zip(leaves, leaves64):
        assert b.grad.abs().sum() > 0 and rel_rms(a.grad, b.grad) < 2e-2

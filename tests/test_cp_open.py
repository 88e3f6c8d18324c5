"""flashqla.cp.forward / .backward with an open sequence (`cp_forward_open`, `cp_backward_open`, and
the scan `flashqla.cp.merge.scan_open_states`) on CPU, on the fp64 launch-level reference
(`reference.gdn.cp.ReferenceCPBackend`), without processes: the exchange that the cross-rank op runs
(all-gather and scan over ranks) is simulated by a callable that records what it is given and hands
back a known state S_in (forward) and a known gradient X (backward).

Against the fp64 token recurrence of the same row entered with S_in on sequence 0 (autograd for the
gradients), to 1e-12: outputs, final states, every gradient, the total gradient at S_in; the map
the forward publishes (P_open is sequence 0's transition, P_open S_in + final[0] its true end
state) and the gradient D the backward publishes (the gradient at S_in without what reaches it
through X). Cases: one sequence (the in-place GEMM path and the general path), varlen rows with
empty and 1-token sequences, sequence 0 shorter than one segment, K != V, GVA; every input has a
g == 0 head and a g = -30 head. Launches: prepare and two recurrent launches forward, one recurrent
launch and one backward backward, all over every slot; with open_first=False the results equal
`cp_forward` / `cp_backward`.
"""

from __future__ import annotations

import pytest
import torch

import flashqla.cp.forward as cp_fwd_mod
from flashqla.cp import build_segment_tables, cp_backward, cp_forward
from flashqla.cp.backward import cp_backward_open
from flashqla.cp.forward import cp_forward_open
from flashqla.cp.merge import scan_open_states
from flashqla.testing import make_gdn_inputs
from reference.gdn.cp import ReferenceCPBackend, segment_maps
from reference.gdn.recurrent import recurrent_gated_delta_rule

TOL = 1e-12
GRADS = ("dq", "dk", "dv", "dg", "dbeta")


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _row(T, seqlens, H=1, HV=2, K=32, V=16, seed=0):
    """One packed row (fp64) with an initial state for every sequence, S_in for sequence 0, and the
    cotangents: do, dht (the last sequence's row zero: its gradient arrives as X) and X."""
    d = make_gdn_inputs(1, T, H, HV, K, V, seqlens=seqlens, dtype=torch.float64, seed=seed)
    if d["cu_seqlens"] is None:
        d["cu_seqlens"] = torch.tensor([0, T], dtype=torch.int64)
    N = d["cu_seqlens"].numel() - 1
    gen = torch.Generator().manual_seed(seed + 1)
    rnd = lambda *s: torch.randn(*s, generator=gen, dtype=torch.float64)  # noqa: E731
    d["S_in"] = rnd(HV, K, V)
    d["do"] = rnd(1, T, HV, V)
    d["dht"] = rnd(N, HV, K, V)
    d["dht"][-1] = 0.0
    d["X"] = rnd(HV, K, V)
    return d


def _truth(d, with_x=True):
    """The recurrence entered with S_in on sequence 0: (o, final, grads incl. dh0 [N, ...])."""
    h0 = d["initial_state"].clone()
    h0[0] = d["S_in"]
    leaves = {n: d[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    h0 = h0.requires_grad_(True)
    o, ht = recurrent_gated_delta_rule(**leaves, scale=d["q"].shape[-1] ** -0.5, initial_state=h0,
                                       output_final_state=True, cu_seqlens=d["cu_seqlens"])
    dht = d["dht"].clone()
    if with_x:
        dht[-1] += d["X"]
    torch.autograd.backward([o, ht], [d["do"], dht])
    grads = {f"d{n}": leaves[n].grad for n in leaves}
    grads["dh0"] = h0.grad
    return o.detach(), ht.detach(), grads


CASES = [  # (T, seqlens, L)
    (700, None, 128),  # one sequence: several segments, a short last one
    (512, None, 64),  # one sequence, every segment full
    (700, [300, 0, 1, 250, 149], 128),  # varlen: sequence 0 open and split, an empty and a 1-token one
    (400, [50, 350], 128),  # sequence 0 shorter than one segment (its only slot is open)
    (263, [64, 1, 198], 64),  # sequence 0 exactly one segment
]


def _run(d, L, open_first=True, one_sequence_fast_path=True, monkeypatch=None):
    T = d["q"].shape[1]
    if monkeypatch is not None:
        monkeypatch.setattr(cp_fwd_mod, "ONE_SEQUENCE_FAST_PATH", one_sequence_fast_path)
    tab = build_segment_tables(d["cu_seqlens"], L, T=T)
    be = ReferenceCPBackend()
    seen = {}

    def fwd_exchange(P_open, ends):
        seen["P_open"], seen["ends"] = P_open, ends.clone()
        return d["S_in"] if open_first else None

    def bwd_exchange(D):
        seen["D"] = D
        return d["X"]

    h0 = d["initial_state"].clone()
    h0[0] = float("nan") if open_first else h0[0]  # row 0 of an open sequence is not read
    scale = d["q"].shape[-1] ** -0.5
    o, final, saved = cp_forward_open(be, d["q"], d["k"], d["v"], d["g"], d["beta"], scale, h0, tab, block_v=None,
                                      exchange=fwd_exchange, open_first=open_first)
    n_fwd = len(be.launches)
    grads = cp_backward_open(be, d["q"], d["k"], d["v"], d["g"], d["beta"], d["do"], d["dht"], scale, saved, tab,
                             block_v=None, exchange=bwd_exchange)
    return o, final, dict(zip(GRADS + ("dh0",), grads)), seen, be.launches, n_fwd, tab


@pytest.mark.parametrize("fast", [True, False], ids=["fast-path", "general-path"])
@pytest.mark.parametrize("T,seqlens,L", CASES)
def test_open_sequence_equals_recurrence(T, seqlens, L, fast, monkeypatch):
    d = _row(T, seqlens, seed=T + L)
    o_ref, ht_ref, g_ref = _truth(d)
    o, final, grads, seen, launches, n_fwd, tab = _run(d, L, one_sequence_fast_path=fast, monkeypatch=monkeypatch)
    assert _rel(o, o_ref) <= TOL, ("o", _rel(o, o_ref))
    assert _rel(final, ht_ref) <= TOL, ("final", _rel(final, ht_ref))
    for n in GRADS + ("dh0",):
        assert _rel(grads[n], g_ref[n]) <= TOL, (n, _rel(grads[n], g_ref[n]))
    # what the forward publishes: sequence 0's map, P_open S_in + final(S_in = 0)[0] = its true end state
    n0 = int(d["cu_seqlens"][1])
    P_ref, _ = segment_maps(d["k"][:, :n0], d["v"][:, :n0], d["g"][:, :n0], d["beta"][:, :n0])
    assert _rel(seen["P_open"], P_ref[0]) <= TOL
    assert _rel(seen["P_open"] @ d["S_in"] + seen["ends"][0], ht_ref[0]) <= TOL
    # what the backward publishes: the gradient at S_in without the part through X
    _, _, g_nox = _truth(d, with_x=False)
    assert _rel(seen["D"], g_nox["dh0"][0]) <= TOL, ("D", _rel(seen["D"], g_nox["dh0"][0]))
    # launches: prepare, run, transition | transition, one backward; all over every slot
    assert launches == [("prepare", tab.M), ("recurrent", tab.M), ("recurrent", tab.M), ("recurrent", tab.M),
                        ("bwd", tab.M)], launches
    assert n_fwd == 3


@pytest.mark.parametrize("H,HV,K,V", [(2, 4, 16, 16), (1, 2, 24, 40)])
def test_open_sequence_gva_and_head_dims(H, HV, K, V):
    d = _row(777, [400, 377], H=H, HV=HV, K=K, V=V, seed=H * HV)
    o_ref, ht_ref, g_ref = _truth(d)
    o, final, grads, *_ = _run(d, 128)
    assert _rel(o, o_ref) <= TOL and _rel(final, ht_ref) <= TOL
    for n in GRADS + ("dh0",):
        assert _rel(grads[n], g_ref[n]) <= TOL, n


@pytest.mark.parametrize("T,seqlens,L", CASES[:3])
def test_not_open_equals_cp_forward_and_backward(T, seqlens, L):
    """open_first=False: the exact mode of cp_forward / cp_backward (the exchange between scan and
    correction, given None)."""
    d = _row(T, seqlens, seed=3)
    d["X"] = torch.zeros_like(d["X"])
    o, final, grads, seen, *_ = _run(d, L, open_first=False)
    assert seen["P_open"] is None and seen["D"] is None
    tab = build_segment_tables(d["cu_seqlens"], L, T=T)
    be = ReferenceCPBackend()
    scale = d["q"].shape[-1] ** -0.5
    o2, ht2, A, G2, _ = cp_forward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], scale, d["initial_state"], True,
                                   d["cu_seqlens"], tab, block_v=None)
    assert _rel(o, o2) <= TOL and _rel(final, ht2) <= TOL
    want = cp_backward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], A, G2, d["do"], d["dht"], scale,
                       d["initial_state"], d["cu_seqlens"], tab, block_v=None)
    for n, a, b in zip(GRADS + ("dh0",), [grads[n] for n in GRADS + ("dh0",)], want):
        assert _rel(a, b) <= TOL, n


def test_scan_open_states_one_sequence_equals_general_path():
    """The fused one-sequence chain P_j [B_j | A_j] + [Q_j | 0] against the general path (the same
    sequence followed by an empty one) and against products by hand."""
    tab1 = build_segment_tables(torch.tensor([0, 1000]), 128, T=1000)
    tab2 = build_segment_tables(torch.tensor([0, 1000, 1000]), 128, T=1000)
    gen = torch.Generator().manual_seed(0)
    P = torch.randn(tab2.M, 2, 8, 8, generator=gen, dtype=torch.float64) / 4
    Q = torch.randn(tab2.M, 2, 8, 5, generator=gen, dtype=torch.float64)
    h0 = torch.randn(2, 2, 8, 5, generator=gen, dtype=torch.float64)
    s1, f1, A1, P1 = scan_open_states(P[: tab1.M], Q[: tab1.M], tab1, 1000, h0[:1])
    s2, f2, A2, P2 = scan_open_states(P, Q, tab2, 1000, h0)
    n = int(tab1.seq_num[0])
    assert torch.allclose(s1, s2[: tab1.M], rtol=1e-13, atol=1e-13)
    assert torch.allclose(f1[0], f2[0], rtol=1e-13, atol=1e-13) and torch.equal(f2[1], h0[1])
    assert torch.allclose(A1[:n], A2[:n], rtol=1e-13, atol=1e-13) and torch.allclose(P1, P2, rtol=1e-13, atol=1e-13)
    B, A = torch.zeros(2, 8, 5, dtype=torch.float64), torch.eye(8, dtype=torch.float64).expand(2, 8, 8)
    for j in range(n):
        assert torch.allclose(s1[j], B, rtol=1e-13, atol=1e-13) and torch.allclose(A1[j], A, rtol=1e-13, atol=1e-13)
        B, A = P[j] @ B + Q[j], P[j] @ A
    assert torch.allclose(f1[0], B, rtol=1e-13, atol=1e-13) and torch.allclose(P1, A, rtol=1e-13, atol=1e-13)


def test_open_forward_reads_no_tensor_value():
    """No host synchronisation: the open forward and backward on meta tensors under the guard of
    tests/test_cp_driver.py (the exchange returns a meta state)."""
    from test_cp_backward import _MetaBwdBackend
    from test_cp_driver import _no_host_reads

    meta = dict(device="meta")
    T, N = 1000, 3
    q = torch.empty(1, T, 2, 128, dtype=torch.bfloat16, **meta)
    v = torch.empty(1, T, 4, 128, dtype=torch.bfloat16, **meta)
    g = torch.empty(1, T, 4, **meta)
    h0 = torch.empty(N, 4, 128, 128, **meta)
    cu = torch.empty(N + 1, dtype=torch.int32, **meta)
    be = _MetaBwdBackend()
    with _no_host_reads():
        tab = build_segment_tables(cu, 256, T=T)
        o, final, saved = cp_forward_open(be, q, q, v, g, g, 0.1, h0, tab, block_v=None,
                                          exchange=lambda P, E: torch.empty(4, 128, 128, **meta), open_first=True)
        out = cp_backward_open(be, q, q, v, g, g, v, h0, 0.1, saved, tab, block_v=None,
                               exchange=lambda D: torch.empty(4, 128, 128, **meta))
    assert o.shape == v.shape and final.shape == h0.shape and out[0].shape == q.shape and out[5].shape == h0.shape
    assert be.launches == ["prepare", "recurrent", "recurrent", "recurrent", "bwd"]

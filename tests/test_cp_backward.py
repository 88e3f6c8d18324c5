"""flashqla.cp.backward on CPU: `cp_backward` / `chunk_gated_delta_rule_bwd` run on the fp64
reference backend (`reference.gdn.cp.ReferenceCPBackend`: the forward launches and the unsplit
backward on the kernels' slot layout), every gradient (dq, dk, dv, dg, dbeta, dh0) to 1e-12 against
the unsplit fp64 backward (`reference.gdn.fused_bwd`, itself equal to autograd of the recurrence to
1e-12 in tests/test_fused_bwd.py) and, on small inputs, against autograd of the fp64 token recurrence
directly: fixed length, batch rows, varlen mixes where only some sequences split (empty and 1-token
ones), GVA, K != V, initial state and final-state gradient on and off; every input has a g == 0 head
and a g = -30 head. Also: the two slot relayouts are inverse
gathers, and the backward reads no tensor value (meta tensors under a guard).
"""

from __future__ import annotations

import pytest
import torch

from flashqla.cp import build_segment_tables, cp_backward, scan_segment_grads
from flashqla.cp.segments import segment_slots_to_sequence_slots, sequence_slots_to_segment_slots
from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd
from flashqla.testing import make_gdn_inputs
from reference.gdn.cp import ReferenceCPBackend
from reference.gdn.fused_bwd import forward_slot_products
from reference.gdn.recurrent import recurrent_gated_delta_rule
from test_cp_driver import _MetaBackend, _no_host_reads

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _autograd(d, with_dht, seed=0):
    """Gradients of sum(o * do) + sum(ht * dht) through the fp64 recurrence, and (do, dht)."""
    x = {n: (t.clone().requires_grad_(True) if t is not None and t.is_floating_point() else t) for n, t in d.items()}
    o, ht = recurrent_gated_delta_rule(**x, output_final_state=True)
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(o.shape, generator=gen, dtype=o.dtype)
    dht = torch.randn(ht.shape, generator=gen, dtype=ht.dtype) if with_dht else None
    loss = (o * do).sum() + ((ht * dht).sum() if with_dht else 0)
    wrt = [x[n] for n in ("q", "k", "v", "g", "beta")] + ([x["initial_state"]] if d["initial_state"] is not None else [])
    grads = list(torch.autograd.grad(loss, wrt))
    if d["initial_state"] is None:
        grads.append(None)
    return grads, do, dht


def _unsplit(d, do, dht):
    """The unsplit fp64 backward over the caller's layout, and its (do, dht)."""
    be = ReferenceCPBackend()
    A, G2 = be.prepare(d["k"], d["g"], d["beta"], d["cu_seqlens"], d["v"].shape[2])
    return list(be.bwd(d["q"], d["k"], d["v"], d["g"], d["beta"], A, G2, do, dht, d["q"].shape[-1] ** -0.5,
                       d["initial_state"], d["cu_seqlens"]))


def _cotangents(d, with_dht, seed=0):
    gen = torch.Generator().manual_seed(seed)
    do = torch.randn(d["v"].shape, generator=gen, dtype=torch.float64)
    N, HV = (d["q"].shape[0] if d["cu_seqlens"] is None else d["cu_seqlens"].numel() - 1), d["v"].shape[2]
    dht = torch.randn(N, HV, d["k"].shape[3], d["v"].shape[3], generator=gen, dtype=torch.float64) if with_dht else None
    return do, dht


def _check(got, want, tol=1e-12):
    for name, a, b in zip(NAMES, got, want):
        if b is None:
            assert a is None, name
            continue
        assert _rel(a, b) <= tol, (name, _rel(a, b))


CASES = [  # (B, T, seqlens, L)
    (1, 1000, None, 128),  # T not a multiple of L, a partial last chunk
    (1, 1024, None, 256),  # every segment full
    (1, 200, None, 64),  # one-chunk segments
    (2, 300, None, 128),  # batch rows
    (1, 1300, [500, 0, 1, 130, 669], 128),  # only some sequences split; empty and 1-token ones
    (1, 263, [5, 0, 63, 1, 64, 130], 64),
    (1, 190, [0, 0, 190], 64),
]
H0_DHT = [(True, True), (False, False), (True, False), (False, True)]


def _cp_bwd(d, L, do, dht):
    B, T = d["q"].shape[:2]
    K, HV = d["k"].shape[3], d["v"].shape[2]
    tab = build_segment_tables(d["cu_seqlens"], L, T=T, B=B)
    be = ReferenceCPBackend()
    flat = lambda x: x.reshape(1, B * T, *x.shape[2:])  # noqa: E731
    A, G2 = be.prepare(flat(d["k"]), flat(d["g"]), flat(d["beta"]), tab.cu_seqlens, HV)
    got = cp_backward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], A, G2, do, dht, K**-0.5, d["initial_state"],
                      d["cu_seqlens"], tab, block_v=None)
    return got, be, tab


# every case with an initial state and a final-state gradient; the other combinations on two cases
MATRIX = [(*c, True, True) for c in CASES] + [(*c, h0, dht) for c in (CASES[0], CASES[4]) for h0, dht in H0_DHT[1:]]


@pytest.mark.parametrize("B,T,seqlens,L,h0,dht", MATRIX)
def test_cp_backward_equals_unsplit_backward(B, T, seqlens, L, h0, dht):
    d = make_gdn_inputs(B, T, 1, 2, 32, 16, seqlens=seqlens, initial_state=h0, dtype=torch.float64, seed=T + L)
    do, dht_t = _cotangents(d, dht, seed=T)
    got, be, tab = _cp_bwd(d, L, do, dht_t)
    _check(got, _unsplit(d, do, dht_t))
    # launches: the run, the transition, one backward over all segments
    assert [k for k, _ in be.launches] == ["prepare", "recurrent", "recurrent", "bwd"]
    assert all(n == tab.M for _, n in be.launches)


@pytest.mark.parametrize("B,T,seqlens,L", [(1, 300, None, 64), (1, 260, [100, 0, 1, 159], 64), (2, 150, None, 64)])
def test_cp_backward_equals_autograd(B, T, seqlens, L):
    d = make_gdn_inputs(B, T, 1, 2, 16, 8, seqlens=seqlens, dtype=torch.float64, seed=T + L)
    want, do, dht_t = _autograd(d, True, seed=T)
    tab = build_segment_tables(d["cu_seqlens"], L, T=T, B=B)
    be = ReferenceCPBackend()
    A, G2 = be.prepare(d["k"].reshape(1, B * T, 1, 16), d["g"].reshape(1, B * T, 2), d["beta"].reshape(1, B * T, 2),
                       tab.cu_seqlens, 2)
    got = cp_backward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], A, G2, do, dht_t, 16**-0.5, d["initial_state"],
                      d["cu_seqlens"], tab, block_v=None)
    _check(got, want, 1e-11)


@pytest.mark.parametrize("H,HV,K,V", [(2, 4, 16, 16), (1, 4, 24, 40)])
def test_cp_backward_gva_and_head_dims(H, HV, K, V):
    d = make_gdn_inputs(1, 777, H, HV, K, V, seqlens=[400, 377], dtype=torch.float64, seed=H * HV)
    do, dht = _cotangents(d, True)
    got, _, _ = _cp_bwd(d, 128, do, dht)
    _check(got, _unsplit(d, do, dht))


@pytest.mark.parametrize("cp,seqlens,B,T", [("on", None, 1, 700), ("on", [300, 0, 1, 399], 1, 700), ("on", None, 2, 330),
                                            ("off", [400, 300], 1, 700)])
def test_entry_point_after_cp_forward(cp, seqlens, B, T):
    """What autograd does: the forward's saved A, g_cum_log2 (caller's layout) into the backward."""
    d = make_gdn_inputs(B, T, 1, 2, 128, 128, seqlens=seqlens, dtype=torch.float64, seed=B + T)
    do, dht = _cotangents(d, True)
    want = _unsplit(d, do, dht)
    be = ReferenceCPBackend()
    f = chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp=cp, segment_len=128, backend=be)
    got = chunk_gated_delta_rule_bwd(f.q, f.k, d["v"], d["g"], d["beta"], f.A, f.g_cum_log2, do, dht, None,
                                     d["initial_state"], d["cu_seqlens"], cp=cp, segment_len=128, backend=be)
    _check(got, want)
    assert ("recurrent" in [k for k, _ in be.launches[2:]]) == (cp == "on")  # the unsplit backward launches no recurrent


@pytest.mark.parametrize("B,T,seqlens,L", CASES)
def test_slot_relayouts_are_inverse_gathers(B, T, seqlens, L):
    d = make_gdn_inputs(B, T, 1, 2, 32, 16, seqlens=seqlens, dtype=torch.float64, seed=1)
    cu = d["cu_seqlens"]
    tab = build_segment_tables(cu, L, T=T, B=B)
    flat = lambda x: x.reshape(1, B * T, *x.shape[2:])  # noqa: E731
    Ap, Gp = forward_slot_products(flat(d["k"]), flat(d["g"]), flat(d["beta"]), 2, tab.cu_seqlens)
    Ao, Go = forward_slot_products(d["k"], d["g"], d["beta"], 2, cu)
    A1, G1 = sequence_slots_to_segment_slots(Ao, Go, tab, cu, B, T)
    assert A1.shape == Ap.shape and torch.allclose(A1, Ap, rtol=0, atol=1e-13) and torch.allclose(G1, Gp, rtol=0, atol=1e-13)
    A2, G2 = segment_slots_to_sequence_slots(A1, G1, tab, cu, B, T)
    assert torch.allclose(A2, Ao, rtol=0, atol=1e-13) and torch.allclose(G2, Go, rtol=0, atol=1e-13)


def test_reverse_scan_one_sequence_equals_general_path():
    tab1 = build_segment_tables(torch.tensor([0, 1000]), 128, T=1000)
    tab2 = build_segment_tables(torch.tensor([0, 1000, 1000]), 128, T=1000)
    g = torch.Generator().manual_seed(0)
    P = torch.randn(tab2.M, 2, 8, 8, generator=g, dtype=torch.float64) / 4
    E = torch.randn(tab2.M, 2, 8, 5, generator=g, dtype=torch.float64)
    D = torch.randn(2, 2, 8, 5, generator=g, dtype=torch.float64)
    G1 = scan_segment_grads(P[: tab1.M], E[: tab1.M], tab1, 1000, D[:1])
    G2 = scan_segment_grads(P, E, tab2, 1000, D)
    assert torch.allclose(G1, G2[: tab1.M], rtol=1e-13, atol=1e-13)
    # by hand: G_last = dht, G_j = P_{j+1}^T G_{j+1} + E_{j+1}
    n = int(tab1.seq_num[0])
    want = D[0]
    for j in range(n - 1, -1, -1):
        if j < n - 1:
            want = P[j + 1].transpose(-1, -2) @ want + E[j + 1]
        assert torch.allclose(G1[j], want, rtol=1e-13, atol=1e-13)


@pytest.mark.parametrize("T,end,L", [(1000, 600, 128), (700, 300, 64), (1000, 1000, 128)])
def test_one_packed_sequence_ending_before_T(T, end, L):
    """One packed sequence over [0, end) of T rows (a tail after it) with a final-state gradient: the
    reverse scan must hand dht to the sequence's own last segment, not to slot ceil(T / L) - 1
    (before the fix dk, dv, dg, dbeta were 0.7-0.9 relative off whenever end < T)."""
    d = make_gdn_inputs(1, T, 1, 2, 32, 16, initial_state=True, dtype=torch.float64, seed=end)
    d["cu_seqlens"] = torch.tensor([0, end], dtype=torch.int32)
    d["initial_state"] = d["initial_state"][:1]
    do, dht = _cotangents(d, True, seed=1)
    got, _, tab = _cp_bwd(d, L, do, dht)
    assert int(tab.seq_num[0]) < tab.max_segments_per_sequence(T) or end == T
    _check(got, _unsplit(d, do, dht))
    # and the reverse scan alone, by hand
    g = torch.Generator().manual_seed(3)
    P = torch.randn(tab.M, 2, 8, 8, generator=g, dtype=torch.float64) / 4
    E = torch.randn(tab.M, 2, 8, 5, generator=g, dtype=torch.float64)
    D = torch.randn(1, 2, 8, 5, generator=g, dtype=torch.float64)
    G = scan_segment_grads(P, E, tab, T, D)
    n = int(tab.seq_num[0])
    want = D[0]
    for j in range(n - 1, -1, -1):
        if j < n - 1:
            want = P[j + 1].transpose(-1, -2) @ want + E[j + 1]
        assert torch.allclose(G[j], want, rtol=1e-13, atol=1e-13), j
    assert not G[n:].any()


class _MetaBwdBackend(_MetaBackend):
    def bwd(self, q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens, order=None, dh0=None):
        self.launches.append("bwd")
        dh0 = None if initial_state is None else torch.empty_like(initial_state)
        return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), torch.empty_like(g), torch.empty_like(beta), dh0


@pytest.mark.parametrize("seqlens", [None, [700, 0, 300, 24]], ids=["one-sequence", "varlen"])
def test_backward_reads_no_tensor_value(seqlens):
    meta = dict(device="meta")
    T = 1024 if seqlens is None else sum(seqlens)
    N = 1 if seqlens is None else len(seqlens)
    q = torch.empty(1, T, 2, 128, dtype=torch.bfloat16, **meta)
    v = torch.empty(1, T, 4, 128, dtype=torch.bfloat16, **meta)
    g = torch.empty(1, T, 4, **meta)
    h0 = torch.empty(N, 4, 128, 128, **meta)
    cu = None if seqlens is None else torch.empty(N + 1, dtype=torch.int32, **meta)
    S = (T // 64 + N) if seqlens is not None else -(-T // 64)
    A = torch.empty(4, S * 64, 64, dtype=torch.bfloat16, **meta)
    G = torch.empty(4, S * 64, **meta)
    be = _MetaBwdBackend()
    with _no_host_reads():
        out = chunk_gated_delta_rule_bwd(q, q, v, g, g, A, G, v, h0, None, h0, cu, cp="on", segment_len=256, backend=be)
    assert out[0].shape == q.shape and out[5].shape == h0.shape
    assert be.launches == ["recurrent", "recurrent", "bwd"]


class _DH0Recorder(ReferenceCPBackend):
    """The reference backend, recording the dh0 hint `cp_backward` passes to each backward launch."""

    def __init__(self):
        super().__init__()
        self.dh0_hints = []

    def bwd(self, *args, order=None, dh0=None):
        self.dh0_hints.append(dh0)
        return super().bwd(*args, order=order, dh0=dh0)


@pytest.mark.parametrize("cp", ["on", "off"])
def test_need_dh0_false_drops_dh0_only(cp):
    """need_dh0=False (autograd: an initial_state that does not require grad): dh0 is None, the backend
    is told it is not used (the sm_90 one then builds pass 2 without its dh0-only option), and the other
    gradients are those of need_dh0=True, split or not."""
    d = make_gdn_inputs(1, 700, 1, 2, 128, 128, seqlens=[300, 0, 1, 399], dtype=torch.float64, seed=7)
    do, dht = _cotangents(d, True)
    be = ReferenceCPBackend()
    f = chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp=cp, segment_len=128, backend=be)
    got = {}
    for need in (True, False):
        rec = _DH0Recorder()
        got[need] = chunk_gated_delta_rule_bwd(f.q, f.k, d["v"], d["g"], d["beta"], f.A, f.g_cum_log2, do, dht, None,
                                               d["initial_state"], d["cu_seqlens"], cp=cp, segment_len=128,
                                               backend=rec, need_dh0=need)
        assert rec.dh0_hints == [need], rec.dh0_hints
    assert got[True][5] is not None and got[False][5] is None
    for name, a, b in zip(NAMES[:5], got[False][:5], got[True][:5]):
        assert torch.equal(a, b), name
    # without an initial state there is no dh0 either way, and the hint says so
    rec = _DH0Recorder()
    out = chunk_gated_delta_rule_bwd(f.q, f.k, d["v"], d["g"], d["beta"], f.A, f.g_cum_log2, do, dht, None, None,
                                     d["cu_seqlens"], cp=cp, segment_len=128, backend=rec)
    assert out[5] is None and rec.dh0_hints == [False]
    for bad in (None, 1, "no"):  # a bool only, before any launch
        rec = _DH0Recorder()
        with pytest.raises(TypeError, match="need_dh0"):
            chunk_gated_delta_rule_bwd(f.q, f.k, d["v"], d["g"], d["beta"], f.A, f.g_cum_log2, do, dht, None,
                                       d["initial_state"], d["cu_seqlens"], cp=cp, segment_len=128, backend=rec,
                                       need_dh0=bad)
        assert rec.launches == []

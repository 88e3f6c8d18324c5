"""The split path's gate-driven transition cut on CPU (fp64 reference backend).

Each (segment, value head) transition walks only the chunks up to the first one at which the summed
log-decay from the segment's start falls below a cutoff (`flashqla.cp.forward.transition_limits`);
past it P is taken as 0 and U's rows as 0. Checked here against a brute-force count of the limits,
against exact transitions within the CP-4 / CP-5 bound per token and per final state (with FlashQLA's
cutoff of -10, where the cut is large enough to see), bitwise on the g == 0 head (which never cuts),
for the backward too, and for the argument's validation. The sm_90 dual launch is compared with the
two-launch path bitwise on the GPU (tests/gpu/test_cp_kernels_gpu.py).
"""

from __future__ import annotations

import math

import pytest
import torch

from flashqla.contract import EXACT_ENV, TRUNCATE_LOG_DECAY, resolve_truncate
from flashqla.cp import build_segment_tables, cp_backward, cp_forward, transition_limits
from flashqla.testing import make_gdn_inputs
from reference.gdn.cp import ReferenceCPBackend

CASES = [  # (B, T, seqlens, L)
    (1, 2048, None, 256),
    (1, 1300, [500, 0, 1, 130, 669], 128),
    (2, 700, None, 192),
]


def _inputs(B, T, seqlens, HV=4, seed=0):
    return make_gdn_inputs(B, T, 1, HV, 32, 16, seqlens=seqlens, initial_state=True, gate="qwen3next",
                           dtype=torch.float64, seed=seed)


def _tables(d, L):
    B, T = d["q"].shape[:2]
    return build_segment_tables(d["cu_seqlens"], L, T=T, B=B)


def _forward(d, L, truncate):
    tab = _tables(d, L)
    scale = d["q"].shape[-1] ** -0.5
    return cp_forward(ReferenceCPBackend(), d["q"], d["k"], d["v"], d["g"], d["beta"], scale, d["initial_state"], True,
                      d["cu_seqlens"], tab, block_v=None, truncate=truncate)


def _brute_limits(d, tab, cutoff):
    """Per slot and head: walk the slot's tokens chunk by chunk, summing g in fp64."""
    g = d["g"].reshape(-1, d["g"].shape[-1])
    out = torch.zeros(tab.M, g.shape[1], dtype=torch.int64)
    for j in range(tab.M):
        if not bool(tab.need_correction[j]):
            continue
        a, b = int(tab.start[j]), int(tab.end[j])
        n = -(-(b - a) // 64)
        for h in range(g.shape[1]):
            total, lim = 0.0, n
            for c in range(n):
                total += float(g[a + 64 * c : min(a + 64 * (c + 1), b), h].sum())
                if cutoff is not None and total < cutoff:
                    lim = c + 1
                    break
            out[j, h] = lim
    return out


@pytest.mark.parametrize("B,T,seqlens,L", CASES)
@pytest.mark.parametrize("cutoff", [None, -10.0, TRUNCATE_LOG_DECAY])
def test_limits_equal_a_brute_force_count(B, T, seqlens, L, cutoff):
    d = _inputs(B, T, seqlens)
    tab = _tables(d, L)
    _, _, _, G2, _ = _forward(d, L, False)
    got = transition_limits(G2, tab, cutoff)
    assert got.dtype == torch.int32 and tuple(got.shape) == (tab.M, 4)
    want = _brute_limits(d, tab, cutoff)
    assert torch.equal(got.to(torch.int64), want)
    corr = tab.need_correction
    nch = -(-(tab.end - tab.start) // 64)
    assert torch.equal(got[corr, 0].to(torch.int64), nch[corr])  # g == 0: always the whole segment
    assert bool((got[~corr] == 0).all())
    if cutoff is not None:
        assert bool((got[corr, -1] == 1).all())  # g = -30 per token: the first chunk passes any cutoff


def _max_entering_norm(info):
    return float(info.S_in.double().flatten(2).norm(dim=-1).max())


@pytest.mark.parametrize("B,T,seqlens,L", CASES)
def test_cut_within_its_bound_and_exact_on_the_undecayed_head(B, T, seqlens, L):
    """With cutoff G the entering state of segment j is off by at most exp(G) max_i ||S_in(i)||_F (one
    dropped term P S_in at the last cut, carried by transitions of norm <= 1, CP-4), so every output
    moves by at most 2 scale ||q_t|| exp(G) max ||S_in||_F (that, plus the dropped rows of U, CP-5),
    and every final state by exp(G) max ||S_in||_F."""
    d = _inputs(B, T, seqlens)
    G = -10.0
    o_x, ht_x, _, _, info_x = _forward(d, L, False)
    o_t, ht_t, _, _, info_t = _forward(d, L, G)
    tab = info_t.tables
    nch = -(-(tab.end - tab.start) // 64)
    cut = info_t.transition_chunks < nch[:, None]
    assert bool(cut[tab.need_correction].any()), "the inputs should make some transition stop early"
    smax = max(_max_entering_norm(info_x), 1e-30)
    scale = d["q"].shape[-1] ** -0.5
    qn = d["q"].double().norm(dim=-1).repeat_interleave(4, dim=-1)  # [B, T, HV] (1 q/k head)
    dev = (o_t - o_x).double().norm(dim=-1)
    assert bool((dev <= 2 * scale * qn * math.exp(G) * smax * (1 + 1e-9) + 1e-13).all())
    assert bool(((ht_t - ht_x).double().flatten(2).norm(dim=-1) <= math.exp(G) * smax * (1 + 1e-9) + 1e-13).all())
    if (B, T, seqlens, L) == CASES[0]:  # a head of moderate decay is cut where fp64 sees the dropped terms
        assert bool(cut[tab.need_correction][:, 1:-1].any()) and float((o_t - o_x).abs().max()) > 0
    assert torch.equal(o_t[..., 0, :], o_x[..., 0, :]) and torch.equal(ht_t[:, 0], ht_x[:, 0])
    # the default cutoff (ln 2^-24) stays within fp32 rounding of the exact result
    o_d, ht_d, _, _, _ = _forward(d, L, True)
    assert float((o_d - o_x).abs().max()) <= 2 * math.exp(TRUNCATE_LOG_DECAY) * smax + 1e-13


@pytest.mark.parametrize("B,T,seqlens,L", CASES[:2])
def test_backward_with_the_cut(B, T, seqlens, L):
    d = _inputs(B, T, seqlens, seed=3)
    tab = _tables(d, L)
    be = ReferenceCPBackend()
    scale = d["q"].shape[-1] ** -0.5
    _, _, A, G2, _ = cp_forward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], scale, d["initial_state"], True,
                                d["cu_seqlens"], tab, block_v=None)
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(d["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(d["initial_state"].shape, generator=gen, dtype=torch.float64)
    args = (be, d["q"], d["k"], d["v"], d["g"], d["beta"], A, G2, do, dht, scale, d["initial_state"], d["cu_seqlens"], tab)
    exact = cp_backward(*args, block_v=None, truncate=False)
    for cutoff, tol in ((-10.0, 1e-3), (TRUNCATE_LOG_DECAY, 1e-7)):
        got = cp_backward(*args, block_v=None, truncate=cutoff)
        for name, a, b in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), got, exact):
            rel = float((a - b).norm() / b.norm())
            assert rel < tol, (cutoff, name, rel)
        # per value head quantities of the g == 0 head: that head's transitions are never cut
        assert torch.equal(got[2][..., 0, :], exact[2][..., 0, :]) and torch.equal(got[4][..., 0], exact[4][..., 0])


def test_truncate_argument(monkeypatch):
    monkeypatch.delenv(EXACT_ENV, raising=False)
    assert resolve_truncate(None) == TRUNCATE_LOG_DECAY == resolve_truncate(True)
    assert resolve_truncate(False) is None and resolve_truncate(-10) == -10.0
    monkeypatch.setenv(EXACT_ENV, "1")
    assert resolve_truncate(None) is None and resolve_truncate(-3.5) == -3.5
    for bad in (0, 1.0, float("nan"), float("-inf"), "yes"):
        with pytest.raises(ValueError, match="truncate"):
            resolve_truncate(bad)
    assert abs(TRUNCATE_LOG_DECAY - math.log(2.0**-24)) < 1e-12

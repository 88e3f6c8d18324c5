"""flashqla.cp.forward on CPU: the CP forward's orchestration of the two sm_90 launches, run on the
fp64 reference backend (`reference.gdn.cp.ReferenceCPBackend`, the same launches in plain PyTorch on
the kernels' slot layout), against the fp64 token recurrence.

Exact mode (both output corrections) equals the unsplit recurrence to 1e-12: fixed length (T a
multiple of L or not, a single segment), batch rows, varlen mixes where only some sequences split,
empty and 1-token sequences, GVA, K != V, initial state on/off, output_final_state on/off, and every
input has a g == 0 head and a g = -30 head. The gate-driven mode is held to its CP-4 / CP-5 bound per
token and per final state, and is exact on the strongly decaying head. No host reads anywhere in the
driver (meta tensors under a guard); A and g_cum_log2 relaid out to the caller's layout equal the
unsplit prepare's.
"""

from __future__ import annotations

import contextlib
import math

import pytest
import torch

import flashqla.cp.forward as cp_fwd_mod
import flashqla.cp.segments as segments
from flashqla.contract import CP_ENV
from flashqla.cp import CPInfo, build_segment_tables, clear_plan_cache, cp_forward, scan_segment_states
from flashqla.cp.plan import cp_splits
from flashqla.cp.segments import num_segment_slots, segment_slots_to_sequence_slots
from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd
from flashqla.ops.gdn.kernels.sm90._common import num_slots
from flashqla.testing import make_gdn_inputs
from reference.gdn.cp import ReferenceCPBackend
from reference.gdn.fused_bwd import forward_slot_products
from reference.gdn.recurrent import recurrent_gated_delta_rule


def _rel(a, b):
    return float((a.double() - b.double()).norm() / b.double().norm().clamp_min(1e-300))


def _inputs(B, T, H=1, HV=2, K=32, V=16, seqlens=None, h0=True, gate="qwen3next", seed=0):
    return make_gdn_inputs(B, T, H, HV, K, V, seqlens=seqlens, initial_state=h0, gate=gate, dtype=torch.float64, seed=seed)


def _run(d, L, *, gate_chunks=None, correction="gemm", final=True, backend=None):
    B, T = d["q"].shape[:2]
    tab = build_segment_tables(d["cu_seqlens"], L, T=T, B=B)
    be = backend or ReferenceCPBackend()
    scale = d["q"].shape[-1] ** -0.5
    o, ht, A, G2, info = cp_forward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], scale, d["initial_state"], final,
                                    d["cu_seqlens"], tab, block_v=None, gate_chunks=gate_chunks, correction=correction)
    return o, ht, A, G2, info, be


def _truth(d):
    return recurrent_gated_delta_rule(d["q"], d["k"], d["v"], d["g"], d["beta"], d["q"].shape[-1] ** -0.5,
                                      d["initial_state"], True, d["cu_seqlens"])


CASES = [  # (B, T, seqlens, L)
    (1, 1000, None, 128),  # T not a multiple of L (a short last segment, a partial last chunk)
    (1, 1024, None, 256),  # T a multiple of L: every segment full
    (1, 200, None, 64),  # one-chunk segments
    (1, 100, None, 128),  # a single segment (forced split, nothing to stitch)
    (2, 300, None, 128),  # batch rows
    (1, 1300, [500, 0, 1, 130, 669], 128),  # only some sequences split; empty and 1-token ones
    (1, 263, [5, 0, 63, 1, 64, 130], 64),  # the last two split
    (1, 190, [0, 0, 190], 64),  # leading empties
    (1, 700, [700], 192),  # one sequence given by offsets
]


@pytest.mark.parametrize("B,T,seqlens,L", CASES)
@pytest.mark.parametrize("correction", ["gemm", "rerun"])
@pytest.mark.parametrize("h0", [True, False], ids=["h0", "no-h0"])
def test_exact_mode_equals_recurrence(B, T, seqlens, L, correction, h0):
    d = _inputs(B, T, seqlens=seqlens, h0=h0, seed=T + L)
    o_ref, ht_ref = _truth(d)
    o, ht, _, _, info, be = _run(d, L, correction=correction)
    assert _rel(o, o_ref) <= 1e-12, ("o", _rel(o, o_ref))
    assert _rel(ht, ht_ref) <= 1e-12, ("final_state", _rel(ht, ht_ref))
    assert info.mode == "exact" and info.P is not None
    # launches: one prepare over the segments, the run, the transition, (the rerun)
    kinds = [k for k, _ in be.launches]
    assert kinds == ["prepare", "recurrent", "recurrent"] + (["recurrent"] if correction == "rerun" else [])
    assert all(n == info.tables.M for _, n in be.launches)


@pytest.mark.parametrize("H,HV,K,V", [(2, 4, 16, 16), (1, 4, 24, 40), (2, 2, 32, 16)])
def test_exact_mode_gva_and_head_dims(H, HV, K, V):
    d = make_gdn_inputs(1, 777, H, HV, K, V, seqlens=[400, 377], dtype=torch.float64, seed=H * HV)
    o_ref, ht_ref = _truth(d)
    o, ht, *_ = _run(d, 128)
    assert _rel(o, o_ref) <= 1e-12 and _rel(ht, ht_ref) <= 1e-12


def test_no_final_state_and_strong_decay():
    d = _inputs(1, 640, gate=-30.0)  # g = -30 on every head but head 0 (g == 0)
    o_ref, _ = _truth(d)
    o, ht, *_ = _run(d, 128, final=False)
    assert ht is None and _rel(o, o_ref) <= 1e-12


def test_g_zero_heads_everywhere_exact():
    d = _inputs(1, 900, gate="zero", seed=4)
    o_ref, ht_ref = _truth(d)
    for corr in ("gemm", "rerun"):
        o, ht, *_ = _run(d, 128, correction=corr)
        assert _rel(o, o_ref) <= 1e-12 and _rel(ht, ht_ref) <= 1e-12


def test_one_sequence_fast_path_equals_gathered_path(monkeypatch):
    """N == 1 corrects by in-place GEMMs on views; the general path (gather, GEMM, index_add) must
    agree, and so must the scan's one-sequence path and its general path."""
    d = _inputs(1, 1000, seed=9)
    o1, ht1, *_ = _run(d, 128)
    g1 = [_run(d, 128, gate_chunks=m)[:2] for m in (1, 3)]  # the gated mode's view path too
    monkeypatch.setattr(cp_fwd_mod, "ONE_SEQUENCE_FAST_PATH", False)
    o2, ht2, *_ = _run(d, 128)
    assert _rel(o1, o2) <= 1e-14 and _rel(ht1, ht2) <= 1e-14
    for m, (og, hg) in zip((1, 3), g1):
        og2, hg2, *_ = _run(d, 128, gate_chunks=m)
        assert _rel(og, og2) <= 1e-14 and _rel(hg, hg2) <= 1e-14
    # scan: one sequence vs the same sequence followed by an empty one (general path)
    tab1 = build_segment_tables(torch.tensor([0, 1000]), 128, T=1000)
    tab2 = build_segment_tables(torch.tensor([0, 1000, 1000]), 128, T=1000)
    g = torch.Generator().manual_seed(0)
    P = torch.randn(tab2.M, 2, 8, 8, generator=g, dtype=torch.float64) / 4
    Q = torch.randn(tab2.M, 2, 8, 5, generator=g, dtype=torch.float64)
    h0 = torch.randn(2, 2, 8, 5, generator=g, dtype=torch.float64)
    for ffh in (False, True):
        s1, f1 = scan_segment_states(P[: tab1.M], Q[: tab1.M], tab1, 1000, h0[:1], first_from_h0=ffh)
        s2, f2 = scan_segment_states(P, Q, tab2, 1000, h0, first_from_h0=ffh)
        v = tab1.valid
        assert torch.allclose(s1[v], s2[: tab1.M][v], rtol=1e-13, atol=1e-13) and torch.allclose(f1, f2[:1], rtol=1e-13, atol=1e-13)
        assert (s1[~v] == 0).all()


# ------------------------------------------------------------------------------------- gated mode


def _true_entering_states(d, info, L):
    """Exact entering state of every slot (first slots: h0 or zero) from an exact-mode run."""
    B, T = d["q"].shape[:2]
    _, _, _, _, ex, _ = _run(d, L)
    S, _ = scan_segment_states(ex.P, ex.Q, ex.tables, T, d["initial_state"], first_from_h0=True)
    return S


@pytest.mark.parametrize("B,T,seqlens,L,m", [(1, 1000, None, 256, 1), (1, 1000, None, 256, 2), (1, 1300, [500, 0, 1, 130, 669], 128, 1),
                                             (2, 300, None, 128, 3), (1, 520, None, 128, 2)])
def test_gated_mode_within_cp4_cp5_bound(B, T, seqlens, L, m):
    """Per token of a corrected segment s (scale ||q_t|| times):
         first m chunks: exp(G(prev segment)) ||S_true(prev)||_F   (dropped transition, CP-4)
         later chunks:   exp(G(first m chunks of s)) ||S_true(s)||_F   (dropped correction, CP-5)
    first segments exact; per final state: exp(G(last)) ||S_true(last)|| or, when the last segment has
    at most m chunks, exp(G(prev)) ||S_true(prev)||. Heads: g == 0, two with the real gate scaled to
    reach the threshold within the window or not, and g = -30 (exact)."""
    d = _inputs(B, T, HV=4, seqlens=seqlens, gate="logsigmoid", seed=T + m)
    d["g"][..., 1] *= 0.05  # a slowly decaying head (bound not met: the flag must say so)
    o_ref, ht_ref = _truth(d)
    o, ht, _, _, info, be = _run(d, L, gate_chunks=m)
    assert info.mode == "gated" and [k for k, _ in be.launches] == ["prepare", "recurrent", "recurrent"]
    tab = info.tables
    S_true = _true_entering_states(d, info, L)
    scale = d["q"].shape[-1] ** -0.5
    HV = d["v"].shape[2]
    qn = d["q"].reshape(B * T, -1, d["q"].shape[-1]).norm(dim=-1).repeat_interleave(HV // d["q"].shape[2], dim=1)  # [BT, HV]
    err = (o - o_ref).reshape(B * T, HV, -1).norm(dim=-1)
    Sn = S_true.flatten(2).norm(dim=-1)  # [M, HV]
    win, seg = info.gate_decay_window, info.gate_decay_segment
    for s in range(tab.M):
        a, b = int(tab.start[s]), int(tab.end[s])
        if b <= a:
            continue
        if not bool(tab.need_correction[s]):
            assert float(err[a:b].max()) <= 1e-12 * float(o_ref.abs().max()) + 1e-13
            continue
        p = int(tab.prev[s])
        head = slice(a, min(b, a + 64 * m))
        bound_in = scale * qn[head] * (seg[p].exp() * Sn[p])[None]
        assert (err[head] <= bound_in * (1 + 1e-9) + 1e-12).all()
        if b > a + 64 * m:
            tail = slice(a + 64 * m, b)
            bound_out = scale * qn[tail] * (win[s].exp() * Sn[s])[None]
            assert (err[tail] <= bound_out * (1 + 1e-9) + 1e-12).all()
    fe = (ht - ht_ref).flatten(2).norm(dim=-1)  # [N, HV]
    for n in range(tab.N):
        last = int(tab.seq_last[n])
        if last < 0 or int(tab.seq_num[n]) < 2:
            assert float(fe[n].max()) <= 1e-12 * float(ht_ref.abs().max()) + 1e-13
            continue
        nch = -(-(int(tab.end[last]) - int(tab.start[last])) // 64)
        p = last - 1
        bound = seg[p].exp() * Sn[p] if nch <= m else seg[last].exp() * Sn[last]
        assert (fe[n] <= bound * (1 + 1e-9) + 1e-12).all()
    # the flag: g == 0 and the slow head fail wherever something was dropped; g = -30 passes and is exact
    dropped = tab.need_correction
    assert not info.gate_ok[dropped, 0].any() and not info.gate_ok[dropped, 1].any()
    assert info.gate_ok[:, 3].all() and info.gate_ok[~dropped].all()  # nothing dropped on first segments
    assert _rel(o[..., 3, :], o_ref[..., 3, :]) <= 1e-12 and _rel(ht[:, 3], ht_ref[:, 3]) <= 1e-12
    # where the flag holds the error is below the threshold's factor (bf16 resolution and beyond)
    ok_heads = [h for h in range(HV) if bool(info.gate_ok[:, h].all())]
    for h in ok_heads:
        assert _rel(o[..., h, :], o_ref[..., h, :]) <= 10 * math.exp(-10)


def test_gated_mode_decays_match_the_gates():
    d = _inputs(1, 700, HV=3, seqlens=[700], gate="logsigmoid", seed=2)
    *_, info, _ = _run(d, 256, gate_chunks=2)
    g = d["g"][0]
    tab = info.tables
    for s in range(tab.M):
        a, b = int(tab.start[s]), int(tab.end[s])
        if b <= a:
            continue
        assert torch.allclose(info.gate_decay_segment[s], g[a:b].sum(0), rtol=1e-12, atol=1e-12)
        assert torch.allclose(info.gate_decay_window[s], g[a : min(b, a + 128)].sum(0), rtol=1e-12, atol=1e-12)


# ------------------------------------------------------------------------------- relayout, entry


@pytest.mark.parametrize("B,T,seqlens,L", [(1, 1000, None, 128), (2, 300, None, 128), (1, 1300, [500, 0, 1, 130, 669], 128),
                                           (1, 263, [5, 0, 63, 1, 64, 130], 64)])
def test_relayout_equals_unsplit_prepare(B, T, seqlens, L):
    d = _inputs(B, T, seqlens=seqlens, seed=1)
    _, _, A, G2, info, _ = _run(d, L)
    A2, G22 = segment_slots_to_sequence_slots(A, G2, info.tables, d["cu_seqlens"], B, T)
    Ar, Gr = forward_slot_products(d["k"], d["g"], d["beta"], d["v"].shape[2], d["cu_seqlens"])
    assert A2.shape == Ar.shape and G22.shape == Gr.shape
    N = B if seqlens is None else len(seqlens)
    assert A2.shape[1] == 64 * num_slots(B, T, N, seqlens is not None)
    assert torch.allclose(A2, Ar, rtol=0, atol=1e-13) and torch.allclose(G22, Gr, rtol=0, atol=1e-13)


def _big(B=1, T=1100, seqlens=None, h0=True, seed=0):
    """K = V = 128 (the planner's value-slice widths need V divisible by 64)."""
    return make_gdn_inputs(B, T, 1, 2, 128, 128, seqlens=seqlens, initial_state=h0, dtype=torch.float64, seed=seed)


@pytest.mark.parametrize("cp,split", [("on", True), ("off", False), ("auto", False)])
def test_entry_point_modes(cp, split, monkeypatch):
    clear_plan_cache()
    d = _big(seqlens=[900, 200])
    o_ref, ht_ref = _truth(d)
    be = ReferenceCPBackend()
    out, info = chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp=cp, segment_len=256, backend=be,
                                           return_info=True, poison_outputs=True)
    assert (info is not None) == split and isinstance(info, (CPInfo, type(None)))
    assert _rel(out.o, o_ref) <= 1e-12 and _rel(out.final_state, ht_ref) <= 1e-12
    assert out.A.shape[1] == 64 * num_slots(1, 1100, 2, True)  # the caller's layout (for_backward=True)
    Ar, Gr = forward_slot_products(d["k"], d["g"], d["beta"], 2, d["cu_seqlens"])
    assert torch.allclose(out.A, Ar, atol=1e-13, rtol=0) and torch.allclose(out.g_cum_log2, Gr, atol=1e-13, rtol=0)
    assert cp_splits(d["q"], d["v"], d["cu_seqlens"], cp, segment_len=256) == split
    monkeypatch.setenv(CP_ENV, cp)
    assert cp_splits(d["q"], d["v"], d["cu_seqlens"], segment_len=256) == split


def test_entry_point_shape_cache_serves_new_values():
    """Fixed-length input: the segmentation's index tensors are built once per shape; a second call
    with other values (same shapes) is exact too, in both modes, as is a batch of two rows."""
    for B, T in [(1, 1000), (1, 1000), (2, 600), (2, 600)]:
        d = _big(B=B, T=T, seed=B * T + len(segments._LAYOUTS))
        o_ref, ht_ref = _truth(d)
        out = chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="on", segment_len=256, backend=ReferenceCPBackend())
        assert _rel(out.o, o_ref) <= 1e-12 and _rel(out.final_state, ht_ref) <= 1e-12
        out = chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="on", segment_len=256, gate_chunks=1,
                                         backend=ReferenceCPBackend())
        assert _rel(out.o[..., 1, :], o_ref[..., 1, :]) <= 1e-12  # the g = -30 head


def test_entry_point_fixed_length_l2norm_inference():
    d = _big(B=1, T=1000, seed=3)
    d["q"] = d["q"] * 3
    d["k"] = d["k"] * 0.5
    o_ref, ht_ref = recurrent_gated_delta_rule(**d, output_final_state=True, use_qk_l2norm_in_kernel=True)
    out, info = chunk_gated_delta_rule_fwd(**d, output_final_state=True, use_qk_l2norm_in_kernel=True, cp="on",
                                           segment_len=256, backend=ReferenceCPBackend(), for_backward=False,
                                           return_info=True)
    assert _rel(out.o, o_ref) <= 1e-5 and _rel(out.final_state, ht_ref) <= 1e-5  # the op's L2 norm has eps 1e-6
    assert info.tables.cu_seqlens.dtype == torch.int32  # fixed length: int32 pseudo offsets
    assert out.A is None and out.g_cum_log2 is None  # inference: nothing kept for a backward


def test_entry_point_gated_and_errors():
    d = _big(T=1100, seed=5)
    o_ref, _ = _truth(d)
    out, info = chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="on", segment_len=256, gate_chunks=2,
                                           backend=ReferenceCPBackend(), return_info=True)
    assert info.mode == "gated" and info.plan.split and not info.plan.exact
    assert _rel(out.o[..., 1, :], o_ref[..., 1, :]) <= 1e-12  # the g = -30 head
    be = ReferenceCPBackend()
    for bad, exc in [(dict(cp="sometimes"), ValueError), (dict(correction="fast"), ValueError), (dict(gate_chunks=0), ValueError),
                     (dict(cp="on", segment_len=100), ValueError), (dict(use_qk_l2norm_in_kernel=1), TypeError)]:
        with pytest.raises(exc):
            chunk_gated_delta_rule_fwd(**d, backend=be, **bad)
    # the kernels' path checks the fast path before any device work
    x = make_gdn_inputs(1, 64, 1, 2, 128, 128, dtype=torch.bfloat16)
    x["g"], x["beta"], x["initial_state"] = x["g"].float(), x["beta"].float(), x["initial_state"].float()
    with pytest.raises(RuntimeError, match="CUDA"):
        chunk_gated_delta_rule_fwd(**x, cp="on")
    with pytest.raises(TypeError):
        chunk_gated_delta_rule_fwd(**_big(T=64), cp="on")  # fp64 is not a kernel dtype
    assert not cp_splits(torch.zeros(3), torch.zeros(3), None, "on")  # unreadable shapes: the op's checks report them


def test_empty_inputs_take_the_unsplit_path():
    for T, seqlens in [(0, None), (0, [0, 0])]:
        d = _big(T=T, seqlens=seqlens)
        out, info = chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="on", backend=ReferenceCPBackend(),
                                               return_info=True)
        assert info is None and out.o.shape == d["v"].shape
        assert torch.equal(out.final_state, d["initial_state"])


# --------------------------------------------------------------------------------------- no host sync

_GUARDED = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__", "__len__", "__iter__")


@contextlib.contextmanager
def _no_host_reads():
    saved = {name: getattr(torch.Tensor, name) for name in _GUARDED}

    def deny(name):
        def f(self, *a, **k):
            raise RuntimeError(f"host read of a tensor value: Tensor.{name}")

        return f

    try:
        for name in _GUARDED:
            setattr(torch.Tensor, name, deny(name))
        yield
    finally:
        for name, f in saved.items():
            setattr(torch.Tensor, name, f)


class _MetaBackend:
    """Shapes only: what the kernels' launchers allocate, on the meta device."""

    state_dtype = torch.float32

    def __init__(self):
        self.launches = []

    def prepare(self, k, g, beta, cu_seqlens, HV):
        B, T = k.shape[:2]
        N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
        S = num_slots(B, T, N, cu_seqlens is not None)
        self.launches.append("prepare")
        return torch.empty(HV, S * 64, 64, dtype=k.dtype, device=k.device), torch.empty(HV, S * 64, device=k.device)

    def recurrent(self, q, k, v, A, g_cum_log2, scale, initial_state, output_final_state, cu_seqlens, block_v=None, o=None):
        N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
        if initial_state is not None:
            assert initial_state.shape == (N, v.shape[2], k.shape[3], v.shape[3])
        self.launches.append("recurrent")
        ht = torch.empty(N, v.shape[2], k.shape[3], v.shape[3], device=q.device) if output_final_state else None
        return (torch.empty_like(v) if o is None else o), ht

    def zeros(self, shape, dtype, device):
        return torch.zeros(shape, dtype=dtype, device=device)


@pytest.mark.parametrize("seqlens", [None, [700, 0, 300, 24]], ids=["one-sequence", "varlen"])
@pytest.mark.parametrize("mode", [dict(correction="gemm"), dict(correction="rerun"), dict(gate_chunks=2)], ids=["gemm", "rerun", "gated"])
def test_driver_reads_no_tensor_value(seqlens, mode):
    """The whole driver (tables, launches, scan, corrections, relayout) on meta tensors under a guard
    that fails on any host read: nothing depends on a value."""
    meta = dict(device="meta")
    T = 1024 if seqlens is None else sum(seqlens)
    N = 1 if seqlens is None else len(seqlens)
    q = torch.empty(1, T, 2, 128, dtype=torch.bfloat16, **meta)
    v = torch.empty(1, T, 4, 128, dtype=torch.bfloat16, **meta)
    g = torch.empty(1, T, 4, **meta)
    h0 = torch.empty(N, 4, 128, 128, **meta)
    cu = None if seqlens is None else torch.empty(N + 1, dtype=torch.int32, **meta)
    be = _MetaBackend()
    with _no_host_reads():
        out, info = chunk_gated_delta_rule_fwd(q, q, v, g, g, None, h0, True, cu, cp="on", segment_len=256,
                                               backend=be, return_info=True, **mode)
        assert cp_splits(q, v, cu, "on", segment_len=256)
    assert out.o.shape == v.shape and out.final_state.shape == h0.shape
    assert info.tables.M == num_segment_slots(T, N, 256)
    assert be.launches[0] == "prepare" and len(be.launches) == (4 if mode.get("correction") == "rerun" else 3)


def test_backward_side_stream_applies():
    """The split backward's side stream (`flashqla.cp.backward._overlap_applies`): never for CPU tensors,
    nor for a backend whose bwd takes dht as a tensor only (the overlap itself is checked bitwise on
    the GPU, tests/gpu/test_cp_gpu.py)."""
    from types import SimpleNamespace

    from flashqla.cp.backward import _overlap_applies
    from flashqla.ops.gdn.backend import Sm90Backend

    x = torch.zeros(1)
    be = Sm90Backend()
    assert not _overlap_applies(be, x)  # a CPU tensor

    class OtherBackend:  # a backend whose bwd takes dht as a tensor only
        pass

    assert not _overlap_applies(OtherBackend(), x)
    cuda_like = SimpleNamespace(is_cuda=True)  # (no GPU here: only the attribute is read)
    assert not _overlap_applies(OtherBackend(), cuda_like)
    assert _overlap_applies(be, cuda_like)


def test_sm90_backward_joins_the_fork_when_a_launch_raises(monkeypatch):
    """`Sm90Backend.bwd` calls a callable dht (the side stream's join) even when a launch before it
    raises, and the error still reaches the caller: a graph capture never ends with an open fork."""
    from flashqla.ops.gdn.backend import Sm90Backend

    def boom(*a, **k):
        raise RuntimeError("launch failed")

    monkeypatch.setattr(Sm90Backend, "_build_bwd", boom)
    joined = []
    x = torch.zeros(1, 1, 1, 1)
    with pytest.raises(RuntimeError, match="launch failed"):
        Sm90Backend().bwd(x, x, x, x, x, x, x, x, lambda: joined.append(1), 1.0, None, None)
    assert joined == [1]

"""The split forward's kept states (`flashqla.cp.saved.CPSaved`) reused by the split backward, on CPU
with the fp64 reference backend (`reference.gdn.cp.ReferenceCPBackend`).

A forward with `keep_for_backward=True` (`keep_cp_states=True` at the entry point) returns its
segments' entering states, transitions, U rows and limits; `cp_backward(saved=...)` over the same
segments then launches no run or transition and gives bitwise the gradients of the backward that recomputes them (the same values from the same
inputs), for every case of `tests/test_cp_backward.py`'s matrix shape (fixed length, batch rows,
varlen mixes with empty and 1-token sequences, GVA, initial state and dht on and off, the gate-driven
cut on and off). A CPSaved that does not match (another L, another cut, other sizes) is ignored.
The entry points plan the forward with the backward's plan when asked, and the backward reports the
same gradients with and without the cache.
"""

from __future__ import annotations

import pytest
import torch

from flashqla.cp import build_segment_tables, cp_backward, cp_forward
from flashqla.cp.plan import clear_plan_cache, plan_cp
from flashqla.cp.saved import CPSaved, saved_products_in_sequence_slots
from flashqla.cp.segments import segment_slots_to_sequence_slots
from flashqla.ops.gdn.bwd import backward, chunk_gated_delta_rule_bwd
from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd
from flashqla.testing import make_gdn_inputs
from reference.gdn.cp import ReferenceCPBackend
from test_cp_public_op import cpu_backend  # noqa: F401 - the fixture: the public op on the fp64 reference backend

CASES = [  # (B, T, seqlens, L, H, HV)
    (1, 1000, None, 128, 1, 2),
    (2, 300, None, 128, 1, 2),
    (1, 1300, [500, 0, 1, 130, 669], 128, 1, 2),
    (1, 263, [5, 0, 63, 1, 64, 130], 64, 2, 4),
]


def _inputs(B, T, seqlens, H, HV, h0, seed, K=32, V=16):
    d = make_gdn_inputs(B, T, H, HV, K, V, seqlens=seqlens, initial_state=h0, dtype=torch.float64, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    do = torch.randn(d["v"].shape, generator=gen, dtype=torch.float64)
    N = B if seqlens is None else len(seqlens)
    dht = torch.randn(N, HV, K, V, generator=gen, dtype=torch.float64)
    return d, do, dht


def _forward(d, L, truncate):
    """cp_forward with kept states; returns (tables, A, G2 in the segments' layout, CPSaved, backend)."""
    B, T = d["q"].shape[:2]
    tab = build_segment_tables(d["cu_seqlens"], L, T=T, B=B)
    be = ReferenceCPBackend()
    _, _, A, G2, info = cp_forward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], 32**-0.5, d["initial_state"], True,
                                   d["cu_seqlens"], tab, block_v=None, want_info=False, truncate=truncate,
                                   keep_for_backward=True)
    return tab, A, G2, info.saved, be


def _backward(d, do, dht, tab, A, G2, truncate, saved):
    be = ReferenceCPBackend()
    got = cp_backward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], A, G2, do, dht, 32**-0.5, d["initial_state"],
                      d["cu_seqlens"], tab, block_v=None, truncate=truncate, saved=saved)
    return got, [k for k, _ in be.launches]


def _same(a, b):
    for x, y in zip(a, b):
        assert (x is None) == (y is None)
        if x is not None:
            assert torch.equal(x, y)


@pytest.mark.parametrize("B,T,seqlens,L,H,HV", CASES)
@pytest.mark.parametrize("h0", [True, False])
@pytest.mark.parametrize("truncate", [False, -10.0])
def test_saved_backward_is_bitwise_the_recomputing_one(B, T, seqlens, L, H, HV, h0, truncate):
    d, do, dht = _inputs(B, T, seqlens, H, HV, h0, seed=T + L)
    tab, A, G2, saved, _ = _forward(d, L, truncate)
    assert isinstance(saved, CPSaved) and saved.segment_len == L and saved.S_in.shape[0] == tab.M
    want, launches_recompute = _backward(d, do, dht, tab, A, G2, truncate, None)
    got, launches_saved = _backward(d, do, dht, tab, A, G2, truncate, saved)
    _same(got, want)
    # the recomputing backward runs the run and the transition; the one with the saved states only the backward
    assert launches_recompute == ["recurrent", "recurrent", "bwd"]
    assert launches_saved == ["bwd"]


def test_saved_states_that_do_not_match_are_ignored():
    """Kept states whose segmentation, sizes, cut, initial-state flag or cu_seqlens storage differ from
    the backward's are not used (the backward recomputes: its launches say so); with them used by
    mistake the gradients would be wrong (the h0 case below: checked against the recomputing
    backward of the same call)."""
    d, do, dht = _inputs(1, 1300, [500, 0, 1, 130, 669], 1, 2, True, seed=3)
    tab, A, G2, saved, _ = _forward(d, 128, False)
    want, _ = _backward(d, do, dht, tab, A, G2, False, None)
    for bad in (saved._replace(segment_len=256), saved._replace(cutoff=-10.0), saved._replace(T=999),
                saved._replace(N=2), saved._replace(S_in=saved.S_in[:-1]), saved._replace(has_h0=False),
                saved._replace(cu_key=(0, 0))):
        got, launches = _backward(d, do, dht, tab, A, G2, False, bad)
        assert launches == ["recurrent", "recurrent", "bwd"], bad[:6]  # recomputed
        _same(got, want)
    # the backward without an initial state, handed the states of a forward that had one
    d0 = dict(d, initial_state=None)
    want0, _ = _backward(d0, do, dht, tab, A, G2, False, None)
    got0, launches = _backward(d0, do, dht, tab, A, G2, False, saved)
    assert launches == ["recurrent", "recurrent", "bwd"]
    _same(got0, want0)
    # other offsets of the same sizes (same N, T and slot count): another tensor, so not used
    cu2 = torch.tensor([0, 400, 500, 501, 631, 1300], dtype=d["cu_seqlens"].dtype)
    tab2 = build_segment_tables(cu2, 128, T=1300, B=1)
    assert tab2.M == tab.M
    d2 = dict(d, cu_seqlens=cu2)
    be = ReferenceCPBackend()
    A2, G22 = be.prepare(d["k"], d["g"], d["beta"], tab2.cu_seqlens, 2)
    _, launches = _backward(d2, do, dht, tab2, A2, G22, False, saved)
    assert launches == ["recurrent", "recurrent", "bwd"]
    # the same cu_seqlens tensor edited in place after the forward (same values put back: a new version)
    d["cu_seqlens"].add_(0)
    _, launches = _backward(d, do, dht, tab, A, G2, False, saved)
    assert launches == ["recurrent", "recurrent", "bwd"]


def test_kept_states_are_the_true_entering_states():
    """S_in of every slot equals the recurrence's state at that slot's first token (the initial
    state on first slots)."""
    from reference.gdn.recurrent import recurrent_gated_delta_rule

    d, _, _ = _inputs(1, 700, [300, 0, 400], 1, 2, True, seed=5)
    tab, _, _, saved, _ = _forward(d, 128, False)
    start = tab.start.tolist()
    seq = tab.seq.tolist()
    valid = tab.valid.tolist()
    cu = d["cu_seqlens"].tolist()
    for j in range(tab.M):
        if not valid[j]:
            continue
        n, s0 = seq[j], cu[seq[j]]
        if start[j] == s0:
            want = d["initial_state"][n]
        else:
            x = {k: (v[:, s0:start[j]] if k in ("q", "k", "v", "g", "beta") else v) for k, v in d.items()
                 if k not in ("cu_seqlens", "initial_state")}
            _, want = recurrent_gated_delta_rule(**x, initial_state=d["initial_state"][n:n + 1], output_final_state=True)
            want = want[0]
        assert torch.allclose(saved.S_in[j], want, rtol=1e-10, atol=1e-10), j


def test_entry_points_plan_the_forward_for_the_backward():
    """`chunk_gated_delta_rule_fwd(keep_cp_states=True)` splits with the backward's plan where the
    forward's own plan would not split (2 value heads x 2048 tokens at K = V = 64: the forward stays
    whole, the backward splits at L = 512), with the same outputs; the backward given its cp_saved
    returns bitwise the gradients of the one that recomputes, without the run and transition launches."""
    clear_plan_cache()
    B, T, HV, K = 1, 2048, 2, 64
    d, do, dht = _inputs(B, T, [T], 1, HV, True, seed=7, K=K, V=K)
    assert not plan_cp(HV, 1, T, K, 132, exact=True, max_seqlen=T).split
    bwd_plan = plan_cp(HV, 1, T, K, 132, exact=True, max_seqlen=T, backward=True)
    assert bwd_plan.split
    args = (d["q"], d["k"], d["v"], d["g"], d["beta"], K**-0.5, d["initial_state"], True, d["cu_seqlens"])
    f = chunk_gated_delta_rule_fwd(*args, backend=ReferenceCPBackend(), sm_count=132, max_seqlen=T,
                                   keep_cp_states=True)
    assert f.cp_saved is not None and f.cp_saved.segment_len == bwd_plan.segment_len
    plain = chunk_gated_delta_rule_fwd(*args, backend=ReferenceCPBackend(), sm_count=132, max_seqlen=T)
    assert plain.cp_saved is None
    assert torch.allclose(f.o, plain.o, rtol=1e-10, atol=1e-10)
    assert torch.allclose(f.final_state, plain.final_state, rtol=1e-10, atol=1e-10)
    assert f.A is None and f.g_cum_log2 is None  # they travel in cp_saved
    A_seq, G_seq = saved_products_in_sequence_slots(f.cp_saved, d["cu_seqlens"], B, T, HV)
    head = (f.q, f.k, d["v"], d["g"], d["beta"])
    tail = (do, dht, K**-0.5, d["initial_state"], d["cu_seqlens"])
    be_saved, be_plain = ReferenceCPBackend(), ReferenceCPBackend()
    got = chunk_gated_delta_rule_bwd(*head, f.A, f.g_cum_log2, *tail, backend=be_saved, sm_count=132, max_seqlen=T,
                                     cp_saved=f.cp_saved)
    want = chunk_gated_delta_rule_bwd(*head, A_seq, G_seq, *tail, backend=be_plain, sm_count=132, max_seqlen=T)
    _same(got, want)
    assert [k for k, _ in be_saved.launches].count("recurrent") == 0
    assert [k for k, _ in be_plain.launches].count("recurrent") == 2


def test_public_op_backward_reuses_the_forward_states(cpu_backend):
    """`flashqla.chunk_gated_delta_rule` under autograd (eager): the split forward keeps its states and
    the backward launches no recurrent pass (2 recurrent launches in all: the forward's run and
    transition; 4 when the backward recomputes them, as under torch.compile's custom ops), with the
    gradients of the reference op."""
    import flashqla
    import reference
    from flashqla.testing import rel_rms

    backend = cpu_backend
    x = make_gdn_inputs(B=1, T=1000, H=1, HV=2, K=128, V=128, seqlens=[700, 300], seed=21)
    names = ("q", "k", "v", "g", "beta", "initial_state")

    def run(op, **kw):
        leaves = {n: x[n].clone().requires_grad_(True) for n in names}
        o, ht = op(*(leaves[n] for n in names[:5]), initial_state=leaves["initial_state"], output_final_state=True,
                   cu_seqlens=x["cu_seqlens"], **kw)
        gen = torch.Generator().manual_seed(5)
        ((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
         + (ht * torch.randn(ht.shape, generator=gen, dtype=ht.dtype)).sum()).backward()
        return {n: t.grad for n, t in leaves.items()}

    got = run(flashqla.chunk_gated_delta_rule, cp="on")
    kinds = [k for k, _ in backend.launches]
    assert kinds.count("recurrent") == 2 and kinds.count("bwd") == 1, kinds
    want = run(reference.chunk_gated_delta_rule)
    for n in names:
        assert want[n].abs().sum() > 0, n
        assert rel_rms(got[n], want[n]) < 1e-10, (n, rel_rms(got[n], want[n]))


def test_public_op_is_differentiable_once(cpu_backend):
    """As the custom ops: a double backward through the op raises instead of returning gradients
    without their second-order terms."""
    import flashqla

    x = make_gdn_inputs(B=1, T=1000, H=1, HV=2, K=128, V=128, seqlens=[700, 300], seed=22)
    q = x["q"].clone().requires_grad_(True)
    o, _ = flashqla.chunk_gated_delta_rule(q, x["k"], x["v"], x["g"], x["beta"], cu_seqlens=x["cu_seqlens"], cp="on")
    (gq,) = torch.autograd.grad(o.square().sum(), q, create_graph=True)
    with pytest.raises(RuntimeError, match="once_differentiable|differentiate twice"):
        gq.sum().backward()


def test_public_op_under_activation_checkpointing(cpu_backend):
    """Non-reentrant activation checkpointing: the kept states go through the saved-tensor hooks (none
    is held by the graph after the forward, they are regenerated by the recomputed forward) and the
    gradients equal those without checkpointing."""
    import flashqla
    from torch.utils.checkpoint import checkpoint

    backend = cpu_backend
    x = make_gdn_inputs(B=1, T=1000, H=1, HV=2, K=128, V=128, seqlens=[700, 300], seed=23)
    names = ("q", "k", "v", "g", "beta")

    def f(q, k, v, g, beta):
        o, ht = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, cu_seqlens=x["cu_seqlens"], output_final_state=True,
                                                cp="on")
        return o.square().sum() + ht.sum()

    def grads(ckpt):
        leaves = [x[n].clone().requires_grad_(True) for n in names]
        packed = []
        with torch.autograd.graph.saved_tensors_hooks(lambda t: packed.append(t.shape) or t, lambda t: t):
            loss = checkpoint(f, *leaves, use_reentrant=False) if ckpt else f(*leaves)
        loss.backward()
        return [t.grad for t in leaves], packed

    plain, packed_plain = grads(False)
    backend.launches.clear()
    ckpt, _ = grads(True)
    kinds = [k for k, _ in backend.launches]
    # the forward, its recomputation under checkpointing (run + transition each), the backward from
    # the kept states (no recurrent launch of its own)
    assert kinds.count("recurrent") == 4 and kinds.count("bwd") == 1, kinds
    for a, b in zip(ckpt, plain):
        assert torch.equal(a, b)
    # without checkpointing the hooks saw the kept tensors: U [1, T, HV, K] among them
    assert torch.Size([1, 1000, 2, 128]) in packed_plain, packed_plain


def test_bad_arguments_are_refused():
    """keep_cp_states must be a bool and cp_saved a CPSaved (or None): a clear TypeError naming the
    argument, raised before any device work."""
    x = make_gdn_inputs(B=1, T=128, H=1, HV=2, K=128, V=128, dtype=torch.bfloat16, seed=1)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(TypeError, match="keep_cp_states must be a bool"):
        chunk_gated_delta_rule_fwd(*args, keep_cp_states="yes")
    A = torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    G = torch.zeros(2, 128)
    with pytest.raises(TypeError, match="cp_saved must be None or"):
        chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], A, G, torch.zeros_like(x["v"]),
                                   cp_saved={"S_in": None})


# --- A and g_cum_log2 travel in the CPSaved, in the segments' layout ----------------------------------

KEPT_CASES = [  # (B, T, seqlens), K = V = 64: a packed varlen mix with an empty and a 1-token sequence; fixed-length rows
    (1, 1300, [500, 0, 1, 130, 669]),
    (2, 700, None),
]


def _kept_forward(d):
    """The split forward keeping its states (cp="on": the backward's plan splits); (ChunkGDNForward, CPInfo)."""
    return chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="on", backend=ReferenceCPBackend(),
                                      keep_cp_states=True, return_info=True)


def _cp_bwd(f, d, do, dht, A, G2, saved, cp="on", **kw):
    be = ReferenceCPBackend()
    got = chunk_gated_delta_rule_bwd(f.q, f.k, d["v"], d["g"], d["beta"], A, G2, do, dht, None, d["initial_state"],
                                     d["cu_seqlens"], cp=cp, backend=be, cp_saved=saved, **kw)
    return got, [k for k, _ in be.launches]


def _count_moves(monkeypatch):
    """Records every call of the two slot relayouts in the drivers (the forward's and the backward's, and
    the kept products' move to the caller's layout), wherever they are called by name."""
    import flashqla.cp.saved
    import flashqla.cp.segments
    import flashqla.ops.gdn.bwd
    import flashqla.ops.gdn.fwd

    moves = []
    for name in ("segment_slots_to_sequence_slots", "sequence_slots_to_segment_slots"):
        real = getattr(flashqla.cp.segments, name)
        spy = lambda *a, _n=name, _r=real: moves.append(_n) or _r(*a)  # noqa: E731
        for mod in (flashqla.cp.segments, flashqla.cp.saved, flashqla.ops.gdn.fwd, flashqla.ops.gdn.bwd):
            if hasattr(mod, name):
                monkeypatch.setattr(mod, name, spy)
    return moves


@pytest.mark.parametrize("B,T,seqlens", KEPT_CASES)
def test_kept_forward_returns_its_products_in_cp_saved(B, T, seqlens, monkeypatch):
    """Keeping, the forward returns A and g_cum_log2 None and moves nothing: they are cp_saved's, in the
    slot layout of its segments; laid out for the caller they are what the forward that does not keep
    returns at the same L."""
    d, _, _ = _inputs(B, T, seqlens, 1, 2, True, seed=11, K=64, V=64)
    moves = _count_moves(monkeypatch)
    f, info = _kept_forward(d)
    assert moves == []
    saved = f.cp_saved
    assert saved is not None and f.A is None and f.g_cum_log2 is None
    S_seg = B * T // 64 + info.tables.M
    assert saved.A.shape == (2, S_seg * 64, 64) and saved.g_cum_log2.shape == (2, S_seg * 64)
    plain = chunk_gated_delta_rule_fwd(**d, output_final_state=True, cp="on", segment_len=saved.segment_len,
                                       backend=ReferenceCPBackend())
    assert plain.cp_saved is None and plain.A is not None  # not keeping: the caller's layout, as before
    A_seq, G_seq = segment_slots_to_sequence_slots(saved.A, saved.g_cum_log2, info.tables, d["cu_seqlens"], B, T)
    assert torch.equal(A_seq, plain.A) and torch.equal(G_seq, plain.g_cum_log2)
    A2, G2 = saved_products_in_sequence_slots(saved, d["cu_seqlens"], B, T, 2)  # the forward's tables rebuilt
    assert torch.equal(A2, plain.A) and torch.equal(G2, plain.g_cum_log2)


@pytest.mark.parametrize("B,T,seqlens", KEPT_CASES)
def test_backward_reads_the_kept_products_as_they_are(B, T, seqlens, monkeypatch, cpu_backend):
    """The backward given A = g_cum_log2 = None and the cp_saved: bitwise the gradients of the old
    path (A moved to the caller's layout after the forward, back to the segments' in the backward),
    with no relayout and no recurrent launch; the same through `chunk_gated_delta_rule_bwd`."""
    d, do, dht = _inputs(B, T, seqlens, 1, 2, True, seed=12, K=64, V=64)
    f, info = _kept_forward(d)
    saved = f.cp_saved
    A_seq, G_seq = segment_slots_to_sequence_slots(saved.A, saved.g_cum_log2, info.tables, d["cu_seqlens"], B, T)
    want, old_launches = _cp_bwd(f, d, do, dht, A_seq, G_seq, saved)
    assert old_launches == ["bwd"]  # the old path used the kept states too
    moves = _count_moves(monkeypatch)
    got, launches = _cp_bwd(f, d, do, dht, f.A, f.g_cum_log2, saved)
    _same(got, want)
    assert moves == [] and launches == ["bwd"]
    public = chunk_gated_delta_rule_bwd(f.q, f.k, d["v"], d["g"], d["beta"], f.A, f.g_cum_log2, do, dht, None,
                                        d["initial_state"], d["cu_seqlens"], cp="on", cp_saved=saved)
    _same(public, want)
    assert moves == [] and [k for k, _ in cpu_backend.launches] == ["bwd"]


@pytest.mark.parametrize("B,T,seqlens", KEPT_CASES)
def test_backward_that_does_not_use_the_kept_segments(B, T, seqlens):
    """A backward that does not run the kept segments (cp="off", another L) lays the kept A and
    g_cum_log2 out for the caller first: the gradients of the unsplit fp64 backward, and bitwise those
    of the same backward given the caller-layout products."""
    d, do, dht = _inputs(B, T, seqlens, 1, 2, True, seed=13, K=64, V=64)
    f, info = _kept_forward(d)
    saved = f.cp_saved
    be = ReferenceCPBackend()
    A_ref, G_ref = be.prepare(d["k"], d["g"], d["beta"], d["cu_seqlens"], 2)
    ref = be.bwd(d["q"], d["k"], d["v"], d["g"], d["beta"], A_ref, G_ref, do, dht, 64**-0.5, d["initial_state"],
                 d["cu_seqlens"])
    A_seq, G_seq = segment_slots_to_sequence_slots(saved.A, saved.g_cum_log2, info.tables, d["cu_seqlens"], B, T)
    other_L = 256 if saved.segment_len != 256 else 128
    for kw in (dict(cp="off"), dict(cp="on", segment_len=other_L)):
        got, launches = _cp_bwd(f, d, do, dht, None, None, saved, **kw)
        assert launches.count("recurrent") == (0 if kw["cp"] == "off" else 2), (kw, launches)  # saved not used
        want, _ = _cp_bwd(f, d, do, dht, A_seq, G_seq, saved, **kw)
        _same(got, want)
        for a, b in zip(got, ref):
            assert float((a - b).norm() / b.norm()) < 1e-10, kw


def test_backward_after_cu_seqlens_edited_in_place():
    """Offsets edited in place after the forward (the results are then meaningless, as with the
    caller-layout A): the backward from the kept products runs without an error or an index out of
    range (torch's indexing would raise), split or not, with the gradients' shapes."""
    d, do, dht = _inputs(1, 1300, [500, 0, 1, 130, 669], 1, 2, True, seed=14, K=64, V=64)
    f, _ = _kept_forward(d)
    cu = d["cu_seqlens"]
    for new in ([0, 1300, 1300, 1300, 1300, 1300], [0, 64, 64, 65, 700, 1300], [0, 0, 0, 0, 0, 0]):
        cu.copy_(torch.tensor(new, dtype=cu.dtype))
        for kw in (dict(cp="on"), dict(cp="off")):
            # the driver autograd runs (it does not read the offsets back, as on a GPU); the checked
            # entry point refuses CPU offsets that no longer end at T
            got = backward(f.q, f.k, d["v"], d["g"], d["beta"], None, None, do, dht, None, d["initial_state"],
                           cu, backend=ReferenceCPBackend(), cp_saved=f.cp_saved, **kw)
            assert [t.shape for t in got] == [d[n].shape for n in ("q", "k", "v", "g", "beta", "initial_state")]
        if cu[-1] != 1300:
            with pytest.raises(ValueError, match="cu_seqlens must end at T"):
                _cp_bwd(f, d, do, dht, None, None, f.cp_saved)


def test_missing_products_are_refused():
    """Exactly one of A, g_cum_log2 None, or a cp_saved of a forward of other sizes, is a ValueError
    naming what is wrong (before any device work); both None without a cp_saved is a recompute
    (tests/test_kept_memory.py)."""
    x = make_gdn_inputs(B=1, T=128, H=1, HV=2, K=128, V=128, dtype=torch.bfloat16, seed=1)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    A = torch.zeros(2, 128, 64, dtype=torch.bfloat16)
    G = torch.zeros(2, 128)
    do = torch.zeros_like(x["v"])
    for fn in (chunk_gated_delta_rule_bwd,
               lambda *a, **k: chunk_gated_delta_rule_bwd(*a, backend=ReferenceCPBackend(), **k)):
        with pytest.raises(ValueError, match="^g_cum_log2 is None but A is not"):
            fn(*args, A, None, do)
        with pytest.raises(ValueError, match="^A is None but g_cum_log2 is not"):
            fn(*args, None, G, do)
    d, do, dht = _inputs(1, 1300, [500, 0, 1, 130, 669], 1, 2, True, seed=15, K=64, V=64)
    f, _ = _kept_forward(d)
    for bad in (f.cp_saved._replace(T=1299), f.cp_saved._replace(N=4), f.cp_saved._replace(cu_key=None)):
        for cp in ("on", "off"):
            with pytest.raises(ValueError, match="cp_saved was kept by a forward of other sizes"):
                _cp_bwd(f, d, do, dht, None, None, bad, cp=cp)


# --- awkward uses of the kept products ----------------------------------------------------------------


def test_bwd_with_a_backend_refuses_a_cp_saved_that_is_not_one():
    """`chunk_gated_delta_rule_bwd` (with a backend, as the split path's tests call it) names cp_saved when it is not a CPSaved,
    with A None (where the kept products would be read from it) or given, before any device work."""
    x = make_gdn_inputs(B=1, T=128, H=1, HV=2, K=64, V=64, seed=1)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    A = torch.zeros(2, 128, 64, dtype=torch.float64)
    G = torch.zeros(2, 128, dtype=torch.float64)
    do = torch.zeros_like(x["v"])
    for prods in ((None, None), (A, G)):
        for cp in ("on", "off"):
            with pytest.raises(TypeError, match="^cp_saved must be None or"):
                chunk_gated_delta_rule_bwd(*args, *prods, do, cp=cp, backend=ReferenceCPBackend(),
                                           cp_saved={"A": A})


def test_saved_products_with_a_packed_tail():
    """Offsets ending before T (a packed tail: tokens of no sequence, as a device cu_seqlens may have):
    the kept A and g_cum_log2 laid out for the caller are the backend's prepare products on those
    offsets, and the split backward reading them as they are gives the unsplit fp64 gradients."""
    T, K, L = 700, 32, 128
    d = make_gdn_inputs(1, T, 1, 2, K, K, dtype=torch.float64, seed=31)
    cu = torch.tensor([0, 300, 300, 301, 600], dtype=torch.int32)
    gen = torch.Generator().manual_seed(32)
    h0 = torch.randn(4, 2, K, K, generator=gen, dtype=torch.float64)
    do = torch.randn(d["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(4, 2, K, K, generator=gen, dtype=torch.float64)
    tab = build_segment_tables(cu, L, T=T)
    be = ReferenceCPBackend()
    _, _, _, _, info = cp_forward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], K**-0.5, h0, True, cu, tab,
                                  block_v=None, want_info=False, keep_for_backward=True)
    saved = info.saved
    A_ref, G_ref = be.prepare(d["k"], d["g"], d["beta"], cu, 2)
    A_seq, G_seq = saved_products_in_sequence_slots(saved, cu, 1, T, 2)
    assert torch.equal(A_seq, A_ref) and torch.equal(G_seq, G_ref)
    got = cp_backward(be, d["q"], d["k"], d["v"], d["g"], d["beta"], saved.A, saved.g_cum_log2, do, dht, K**-0.5, h0,
                      cu, tab, block_v=None, saved=saved)
    want = be.bwd(d["q"], d["k"], d["v"], d["g"], d["beta"], A_ref, G_ref, do, dht, K**-0.5, h0, cu)
    for a, b in zip(got, want):
        assert float((a - b).norm() / b.norm()) < 1e-12
    for t in got[:5]:  # the tail's tokens belong to no sequence: zero gradients
        assert not t[:, 600:].any()


def _public_grads(x, hooks=None, edit=None, retain=False):
    """Gradients of every input through `flashqla.chunk_gated_delta_rule(cp="on")`, under the given
    saved-tensor hooks; edit(cu_seqlens) runs between the forward and the backward."""
    import contextlib

    import flashqla

    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = {n: x[n].clone().requires_grad_(True) for n in names}
    cu = x["cu_seqlens"].clone()
    with torch.autograd.graph.saved_tensors_hooks(*hooks) if hooks else contextlib.nullcontext():
        o, ht = flashqla.chunk_gated_delta_rule(*(leaves[n] for n in names[:5]), initial_state=leaves["initial_state"],
                                                output_final_state=True, cu_seqlens=cu, cp="on")
    gen = torch.Generator().manual_seed(5)
    loss = ((o * torch.randn(o.shape, generator=gen, dtype=o.dtype)).sum()
            + (ht * torch.randn(ht.shape, generator=gen, dtype=ht.dtype)).sum())
    if edit is not None:
        edit(cu)
    if retain:
        first = torch.autograd.grad(loss, [leaves[n] for n in names], retain_graph=True)
        second = torch.autograd.grad(loss, [leaves[n] for n in names])
        return dict(zip(names, first)), dict(zip(names, second))
    loss.backward()
    return {n: t.grad for n, t in leaves.items()}


def test_public_op_kept_states_under_copying_hooks(cpu_backend):
    """Saved-tensor hooks that hand back copies (CPU offloading, `torch.autograd.graph.save_on_cpu` on
    device tensors, does) give the backward a copy of cu_seqlens: the kept states are still used (no
    recurrent launch in the backward) while the caller's offsets are unmodified since the forward,
    with bitwise the gradients without hooks. Offsets edited in place after the forward are not
    trusted: the backward then recomputes (here from the forward's offsets, which the hook copied)."""
    x = make_gdn_inputs(B=1, T=400, H=1, HV=2, K=64, V=64, seqlens=[1, 0, 200, 199], seed=33)
    plain = _public_grads(x)
    assert [k for k, _ in cpu_backend.launches].count("recurrent") == 2
    copying = (lambda t: t.clone(), lambda t: t.clone())
    cpu_backend.launches.clear()
    hooked = _public_grads(x, copying)
    kinds = [k for k, _ in cpu_backend.launches]
    assert kinds.count("recurrent") == 2 and kinds.count("bwd") == 1, kinds
    for n in plain:
        assert torch.equal(hooked[n], plain[n]), n
    cpu_backend.launches.clear()
    edited = _public_grads(x, copying, edit=lambda cu: cu.add_(0))  # the same values, a new version
    assert [k for k, _ in cpu_backend.launches].count("recurrent") == 4
    from flashqla.testing import rel_rms

    for n in plain:
        assert rel_rms(edited[n], plain[n]) < 1e-12, n


def test_public_op_retain_graph_reads_the_kept_products_twice(cpu_backend):
    """The split backward reads the kept A and g_cum_log2 as they are (no fresh gather a backward):
    a second backward over the retained graph gives bitwise the first one's gradients."""
    x = make_gdn_inputs(B=1, T=400, H=1, HV=2, K=64, V=64, seqlens=[1, 0, 200, 199], seed=34)
    first, second = _public_grads(x, retain=True)
    kinds = [k for k, _ in cpu_backend.launches]
    assert kinds.count("recurrent") == 2 and kinds.count("bwd") == 2, kinds
    for n in first:
        assert torch.equal(first[n], second[n]), n


def test_backward_names_products_of_another_layout():
    """A and g_cum_log2 must have the caller's slot count (what the forward returns without keeping):
    a kept forward's `CPSaved.A`, laid out over its segments (more slots), passed as A is refused
    naming the argument, by the backward with a backend (split) and without (unsplit), before any work."""

    x = make_gdn_inputs(B=1, T=128, H=1, HV=2, K=64, V=64, seed=1)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    do = torch.zeros_like(x["v"])
    good_A, good_G = torch.zeros(2, 128, 64, dtype=torch.float64), torch.zeros(2, 128, dtype=torch.float64)
    bad_A, bad_G = torch.zeros(2, 192, 64, dtype=torch.float64), torch.zeros(2, 192, dtype=torch.float64)
    for A, G, name in ((bad_A, good_G, "A"), (good_A, bad_G, "g_cum_log2")):
        with pytest.raises(ValueError, match=f"^{name} must be"):
            chunk_gated_delta_rule_bwd(*args, A, G, do, cp="on", backend=ReferenceCPBackend())
        with pytest.raises(ValueError, match=f"^{name} must be"):
            chunk_gated_delta_rule_bwd(*args, A, G, do, cp="off")


def test_backward_refuses_an_fp16_A_for_bf16_inputs():
    """A forward without gradients stores A in fp16 for bf16 input (`flashqla.ops.gdn.fwd.product_dtype`);
    the backward reads A in q's dtype and refuses another, naming A, before any launch."""
    from flashqla.cp.saved import check_products

    q = torch.zeros(1, 100, 2, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, 100, 4, 128, dtype=torch.bfloat16)
    A = torch.zeros(4, 128, 64, dtype=torch.float16)
    G = torch.zeros(4, 128)
    with pytest.raises(ValueError, match="A must be in q's dtype"):
        check_products(A, G, None, q, v, None)
    check_products(A.to(torch.bfloat16), G, None, q, v, None)


def test_fp16_products_is_an_opt_in_of_no_grad_bf16_forwards():
    """`product_dtype`: fp16 A only for bf16 q, without gradients, on a backend with fp16_products on
    (off by default); a bad flag is a TypeError naming it."""
    from flashqla.ops.gdn.backend import Sm90Backend, default_backend
    from flashqla.ops.gdn.fwd import product_dtype
    from reference.gdn.cp import ReferenceCPBackend

    q = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16)
    on, off = Sm90Backend(fp16_products=True), Sm90Backend()
    assert default_backend().fp16_products is False and off.fp16_products is False
    assert product_dtype(q, False, on) == torch.float16
    assert product_dtype(q, True, on) is None  # training
    assert product_dtype(q, False, off) is None
    assert product_dtype(q.half(), False, on) is None  # fp16 input: fp16 throughout anyway
    assert product_dtype(q, False, ReferenceCPBackend()) is None
    with pytest.raises(TypeError, match="fp16_products"):
        Sm90Backend(fp16_products=1)
    with pytest.raises(TypeError, match="fp16_products"):
        off.fp16_products = "yes"
    assert off.fp16_products is False

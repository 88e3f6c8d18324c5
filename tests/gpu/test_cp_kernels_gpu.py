"""GPU tier: the split path's one-launch kernels, as regression tests (the value parts of the check
scripts that first validated them on the H200):

- the segment tables (`flashqla.cp.tables_kernel`) equal the torch tables field by field, also
  across CUDA-graph replays with cu_seqlens edited in place (tests/gpu/segment_tables_check.py);
- the combine scans (`kernels/sm90/cp_scan.py`) against the fp64 torch scans, and the output
  correction and segment-gradient kernels (`kernels/sm90/cp_correct.py`) against fp64
  (tests/gpu/cp_scan_check.py);
- the open-sequence forward and backward (what `flashqla.distributed` runs per rank) on the kernels
  against fp64 and the torch paths (tests/gpu/cp_open_check.py);
- the dual run + transition launch and the gate-driven transition cut (tests/gpu/cp_dual_check.py);
- the backward's longest-first launch order (`kernels/sm90/launch_order.py`) against the stable torch
  argsort, also across CUDA-graph replays with the offsets edited in place.
"""

from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not HOPPER:
    pytest.skip("needs a CUDA GPU of compute capability 9.0 (Hopper)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.gpu import cp_dual_check, cp_open_check, cp_scan_check, segment_tables_check  # noqa: E402


def test_segment_tables_equal_torch_tables_and_survive_graph_replays():
    counter = segment_tables_check.Counter()
    args = argparse.Namespace(cases=200, replays=5, reps=10, seed=0, no_timing=True)
    dev = torch.device("cuda")
    segment_tables_check.check_values(counter, args, dev)
    segment_tables_check.check_graphs(counter, args, dev)
    assert counter.total > 0 and not counter.failed, counter.failed[:10]


def test_scans_against_fp64():
    out = {}
    assert cp_scan_check.check_values(out), [r for r in out["values"] if "FAIL" in r[2] or "ERROR" in r[2]]


def test_correction_and_segment_gradients_against_fp64():
    out = {}
    assert cp_scan_check.check_token_kernels(out), [r for r in out["token_kernels"] if "FAIL" in r[1] or "ERROR" in r[1]]


def test_open_sequence_on_the_kernels():
    assert cp_open_check.main() == 0


@pytest.mark.parametrize("case", cp_dual_check.CASES, ids=[c[0] for c in cp_dual_check.CASES])
def test_dual_launch_and_transition_cut(case):
    """The run + transition launch is bitwise the two launches; the default cut (ln 2^-24) moves o by < 1e-4
    and the final state by < 1e-5 relative, never further from fp64 than exact mode, and nothing on
    the g == 0 head (tests/gpu/cp_dual_check.py)."""
    row = cp_dual_check.check_case(*case)
    assert row["ok"], row


def test_backward_with_the_transition_cut():
    row = cp_dual_check.check_bwd("2/8 1x8192 L1024", 2, 8, [8192], 1024)
    assert row["ok"], row


# (lengths or None for B rows, B, T, L, HV): empty and 1-token sequences, lengths at and off chunk
# multiples, a segment length of one chunk, B rows with a partial last chunk
RELAYOUT_CASES = [
    ([161, 1928, 3157, 563, 1244, 229, 177, 733], 1, 8192, 512, 4),
    ([0, 1, 63, 64, 65, 0, 130, 5, 0], 1, 328, 64, 2),
    ([700, 0, 64, 1], 1, 765, 128, 3),
    (None, 2, 1000, 512, 2),
    (None, 3, 64, 64, 1),
]


@pytest.mark.parametrize("case", RELAYOUT_CASES, ids=[f"case{i}" for i in range(len(RELAYOUT_CASES))])
def test_relayout_kernel_equals_the_torch_gathers(case):
    """`kernels/sm90/cp_relayout.py` (A and g_cum_log2 between the caller's chunk slots and the
    segments', one launch) against the torch gathers it replaces (`sequence_slots_to_segment_slots`,
    `segment_slots_to_sequence_slots` on CPU tensors), bit for bit, both directions, with outputs of
    random values everywhere (every slot written, zeros where no chunk is), and inside a CUDA graph."""
    from flashqla.cp.driver import segment_slots_to_sequence_slots, sequence_slots_to_segment_slots
    from flashqla.cp.planner import build_segment_tables

    lengths, B, T, L, HV = case
    gen = torch.Generator().manual_seed(len(RELAYOUT_CASES) + T)
    if lengths is None:
        cu = None
        S = B * -(-T // 64)
        tab = build_segment_tables(None, L, T=T, B=B)
        tab = type(tab)(**{**tab.__dict__, "cu_seqlens": tab.cu_seqlens.to(torch.int32)})
    else:
        assert sum(lengths) == T
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
        S = T // 64 + len(lengths)
        tab = build_segment_tables(cu, L, T=T)
    Sp = B * T // 64 + tab.M
    A = torch.randn(HV, S * 64, 64, generator=gen).to(torch.bfloat16)
    G = torch.randn(HV, S * 64, generator=gen)
    Ap, Gp = sequence_slots_to_segment_slots(A, G, tab, cu, B, T)  # torch path (CPU)
    A2, G2 = segment_slots_to_sequence_slots(Ap, Gp, tab, cu, B, T)
    assert Ap.shape == (HV, Sp * 64, 64) and A2.shape == A.shape

    def dev_tables(t):
        return type(t)(**{k: (v.cuda() if isinstance(v, torch.Tensor) else v) for k, v in t.__dict__.items()})

    tab_d, cu_d = dev_tables(tab), (None if cu is None else cu.cuda())
    Ap_d, Gp_d = sequence_slots_to_segment_slots(A.cuda(), G.cuda(), tab_d, cu_d, B, T)  # the kernel
    assert torch.equal(Ap_d.cpu(), Ap) and torch.equal(Gp_d.cpu(), Gp)
    A2_d, G2_d = segment_slots_to_sequence_slots(Ap.cuda(), Gp.cuda(), tab_d, cu_d, B, T)
    assert torch.equal(A2_d.cpu(), A2) and torch.equal(G2_d.cpu(), G2)
    # the round trip keeps every used slot and zeroes the rest
    assert torch.count_nonzero(A2) > 0 and torch.count_nonzero(Ap) > 0
    # in a CUDA graph, on fresh inputs copied in before each replay
    A_in, G_in = A.cuda(), G.cuda()
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = sequence_slots_to_segment_slots(A_in, G_in, tab_d, cu_d, B, T)
    for seed in (1, 2):
        A_new = torch.randn(HV, S * 64, 64, generator=torch.Generator().manual_seed(seed)).to(torch.bfloat16)
        A_in.copy_(A_new.cuda())
        graph.replay()
        torch.cuda.synchronize()
        want, _ = sequence_slots_to_segment_slots(A_new, G, tab, cu, B, T)
        assert torch.equal(out[0].cpu(), want)


@pytest.mark.parametrize("case", RELAYOUT_CASES[:3], ids=[f"case{i}" for i in range(3)])
def test_slot_initial_states_equal_the_torch_expression(case):
    """`cp_relayout.slot_initial_states` (the runs' initial states, one launch) against the torch
    expression it replaces (h0[h0_index] on first segments, zero elsewhere), bit for bit, on tables
    with empty and 1-token sequences; the output buffer is poisoned first, so every slot is written."""
    from flashqla.cp.driver import _run_states
    from flashqla.cp.planner import build_segment_tables
    from flashqla.ops.gdn.kernels.sm90.cp_relayout import slot_initial_states

    lengths, _, T, L, HV = case
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    tab = build_segment_tables(cu, L, T=T)
    h0 = torch.randn(len(lengths), HV, 128, 128, generator=torch.Generator().manual_seed(T))
    want = _run_states(h0, tab)  # CPU: the torch expression
    assert bool((want != 0).any()) and bool((want == 0).all(dim=(1, 2, 3)).any())
    poison = torch.full((tab.M * HV * 128 * 128,), float("nan"), device="cuda")
    del poison  # the allocator hands the NaN block to the kernel's output
    got = slot_initial_states(h0.cuda(), tab.h0_index.cuda())
    assert torch.equal(got.cpu(), want)


def test_scan_variants_bitwise_equal():
    """Every scan variant (`cp_scan.VARIANTS`) gives the default's bits, forward and reverse, on the
    check script's packed mixes (tests/gpu/cp_scan_check.py)."""
    out = {}
    assert cp_scan_check.compare_variants(out), [r for r in out["variants"] if "DIFFERS" in r[2]]


def test_scan_with_cut_limits_bitwise_equal():
    """The scan told which transitions the gate-driven cut dropped skips their products and gives the
    bits of the scan reading the zero P, in every variant, forward and reverse, with some, none and
    every transition cut (tests/gpu/cp_scan_check.py `compare_cut`)."""
    out = {}
    assert cp_scan_check.compare_cut(out), [r for r in out["cut"] if "DIFFERS" in r[2]]


def test_scan_shapes_bitwise_equal():
    """The scan a cut call over one sequence launches (`cp_scan.scan_choice`: "ahead" with narrow
    value slices) against every other variant and CTA shape, only value head 0 live, 4/8 to 16/32
    heads, forward and reverse: bit for bit (tests/gpu/cp_scan_check.py `compare_shapes`)."""
    out = {}
    assert cp_scan_check.compare_shapes(out), [r for r in out["shapes"] if "DIFFERS" in r[2]]


def test_correction_over_slot_ranges_equals_one_launch(monkeypatch):
    """`cp_correct` launches once per range of slots when M * HV passes the grid's y limit: with the
    limit lowered (so that a small case takes 2-7 launches) the result is bitwise the one launch's,
    with a per-(slot, head) tile limit and with a flag; and at the real limit a case of 64 value heads
    and 1100 slots (two launches) against fp64 on its corrected rows."""
    from flashqla.ops.gdn.kernels.sm90 import cp_correct as cc
    from flashqla.cp.planner import build_segment_tables

    gen = torch.Generator().manual_seed(11)
    lengths = [700, 0, 64, 1, 2000, 130, 1]
    T, L, HV, K = sum(lengths), 128, 3, 128
    cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0)), dtype=torch.int32)
    tab = build_segment_tables(cu, L, T=T)
    cu_p, M = tab.cu_seqlens.cuda(), tab.M
    U = torch.randn(1, T, HV, K, generator=gen).to("cuda", torch.bfloat16)
    o = torch.randn(1, T, HV, K, generator=gen).to("cuda", torch.bfloat16)
    S = (torch.randn(M, HV, K, K, generator=gen) / K**0.5).cuda()
    flag = tab.need_correction.cuda()
    limit = torch.randint(0, 3, (M, HV), generator=gen, dtype=torch.int32).cuda()
    one_f = cc.cp_correct(o.clone(), U, S, cu_p, flag, max_rows=L)
    one_l = cc.cp_correct(o.clone(), U, S, cu_p, limit=limit, max_rows=L)
    assert not torch.equal(one_f, o) and not torch.equal(one_l, o)
    for y in (HV, 4 * HV + 1, (M // 2) * HV):
        monkeypatch.setattr(cc, "MAX_GRID_Y", y)
        assert torch.equal(cc.cp_correct(o.clone(), U, S, cu_p, flag, max_rows=L), one_f), y
        assert torch.equal(cc.cp_correct(o.clone(), U, S, cu_p, limit=limit, max_rows=L), one_l), y
    monkeypatch.undo()

    # the real limit: 64 value heads x 1100 slots = 70,400 > 65,535 (two launches)
    HV, L = 64, 64
    T = 1100 * L
    tab = build_segment_tables(torch.tensor([0, T], dtype=torch.int32), L, T=T)
    M = tab.M
    assert M * HV > cc.MAX_GRID_Y
    U = (torch.randn(1, T, HV, K, generator=gen) * 0.1).to("cuda", torch.bfloat16)
    o = torch.randn(1, T, HV, K, generator=gen).to("cuda", torch.bfloat16)
    S = (torch.randn(M, HV, K, K, generator=gen) / K**0.5).cuda()
    got = cc.cp_correct(o.clone(), U, S, tab.cu_seqlens.cuda(), tab.need_correction.cuda(), max_rows=L)
    st, fl = tab.start.tolist(), tab.need_correction.tolist()
    step = cc.MAX_GRID_Y // HV  # slots of the first launch
    for j in (1, step - 1, step, M - 2):  # slots on both sides of the launches' boundary
        assert fl[j]
        r = slice(st[j], st[j] + L)
        want = o[0, r].double() + torch.einsum("thk,hkv->thv", U[0, r].double(), S[j].double())
        err = ((got[0, r].double() - want).norm() / want.norm()).item()
        assert err < 8e-3, (j, err)
    assert torch.equal(got[0, :L], o[0, :L])  # the first segment is not corrected


# ----------------------------------------------------------------------------------------------
# the backward's launch order (`kernels/sm90/launch_order.py`, `_common.launch_order`)
# ----------------------------------------------------------------------------------------------

LAUNCH_ORDER_NS = (2, 3, 31, 32, 33, 127, 128, 129, 1000, 1024, 1025, 4096, 8192)


def _launch_order_offsets(gen, N, hi, dtype):
    lens = torch.randint(0, hi, (N,), generator=gen)
    return torch.cat([torch.zeros(1, dtype=torch.int64), lens.cumsum(0)]).to(dtype)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_launch_order_kernel_equals_stable_argsort(dtype, monkeypatch):
    """`launch_order.longest_first_order` (one launch) against torch.argsort(cu[1:] - cu[:-1],
    descending=True, stable=True) on random and tie-heavy offsets (a few distinct lengths: ties within
    and across the CTAs' 32-sequence blocks and the 1024-length staging steps), empty and equal
    sequences, N up to ORDER_KERNEL_MAX; the output poisoned first (every element written);
    `_common.launch_order` takes the kernel up to ORDER_KERNEL_MAX and the torch sort past it; a new N
    builds nothing."""
    from flashqla.ops.gdn.kernels.sm90 import _common
    from flashqla.ops.gdn.kernels.sm90 import launch_order as lo

    gen = torch.Generator().manual_seed(7 if dtype == torch.int32 else 8)
    lo.longest_first_order(torch.tensor([0, 1, 3], dtype=dtype, device="cuda"))  # the one build of this dtype
    built = _common.compile_count()
    launched = []
    real_builder = lo.build_launch_order_kernel
    monkeypatch.setattr(lo, "build_launch_order_kernel", lambda dt: launched.append(dt) or real_builder(dt))
    monkeypatch.setenv("FLASHQLA_BWD_ORDER", "longest")
    for N in LAUNCH_ORDER_NS:
        for hi in (1, 2, 5, 64, 1 << 20):
            cu = _launch_order_offsets(gen, N, hi, dtype).cuda()
            want = torch.argsort(cu[1:] - cu[:-1], descending=True, stable=True).to(torch.int32)
            poison = torch.full((N,), -5, dtype=torch.int32, device="cuda")
            del poison  # the allocator hands the poisoned block to the kernel's output
            got = lo.longest_first_order(cu)
            assert got.dtype == torch.int32 and got.shape == (N,)
            assert torch.equal(got, want), (N, hi, (got != want).nonzero()[:5].flatten().tolist())
            n = len(launched)
            assert torch.equal(_common.launch_order(cu), want) and len(launched) == n + 1, (N, hi)
    # equal lengths everywhere, and sequences past 2^31 tokens in all (int64)
    for N in LAUNCH_ORDER_NS:
        cu = (torch.arange(N + 1, dtype=torch.int64) * (3 if dtype == torch.int32 else (1 << 31) + 1)).to(dtype).cuda()
        assert torch.equal(lo.longest_first_order(cu), torch.arange(N, dtype=torch.int32, device="cuda")), N
    assert _common.compile_count() == built, "a new N recompiled"
    # past the limit: the torch sort
    cu = _launch_order_offsets(gen, _common.ORDER_KERNEL_MAX + 1, 7, dtype).cuda()
    n = len(launched)
    want = torch.argsort(cu[1:] - cu[:-1], descending=True, stable=True).to(torch.int32)
    assert torch.equal(_common.launch_order(cu), want) and len(launched) == n


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_launch_order_kernel_in_a_cuda_graph(dtype):
    """Captured once, replayed with the offsets edited in place: each replay's order is the stable
    argsort of the new lengths (nothing read on the host at capture)."""
    from flashqla.ops.gdn.kernels.sm90 import launch_order as lo

    gen = torch.Generator().manual_seed(21)
    N = 1000
    cu = _launch_order_offsets(gen, N, 9, dtype).cuda()
    lo.longest_first_order(cu)  # built outside the capture
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = lo.longest_first_order(cu)
    for hi in (1, 3, 9, 1 << 16):
        cu.copy_(_launch_order_offsets(gen, N, hi, dtype).cuda())
        graph.replay()
        torch.cuda.synchronize()
        want = torch.argsort(cu[1:] - cu[:-1], descending=True, stable=True).to(torch.int32)
        assert torch.equal(out, want), hi

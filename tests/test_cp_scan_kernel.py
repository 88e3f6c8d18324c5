"""CPU tier of the context-parallel scan kernel (`flashqla.ops.gdn.kernels.sm90.cp_scan`, both variants): it compiles
for sm_90a in both directions, its FMA loop reads P from bank-conflict-free padded rows and keeps the
chain on CUDA cores in fp32 (no tensor-core instruction), no spills; the torch scans it replaces are
what runs off CUDA. Its values are checked against those torch scans on the GPU
(tests/gpu/test_cp_kernels_gpu.py and, end to end, tests/gpu/test_cp_gpu.py)."""

from __future__ import annotations

import shutil

import pytest
import torch

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="compiling for sm_90a needs nvcc")


@needs_nvcc
@pytest.mark.parametrize("HV,reverse", [(8, False), pytest.param(8, True, marks=pytest.mark.compile_all),
                                        pytest.param(32, False, marks=pytest.mark.compile_all), (32, True)])
def test_cp_scan_prefetch_variant_compiles(HV, reverse):
    """Variant "prefetch" (the default): P's halves and Q reach shared memory by cp.async a half step
    ahead (the waits count groups: every path commits the same number), an FMA loop on padded rows
    (CUDA cores: the chain stays fp32), the loop count the sequence's segment count, two CTAs an SM at
    least, no spills."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.cp_scan import build_cp_scan_kernel, scan_slice_width

    kernel = build_cp_scan_kernel(HV, 128, 128, reverse, "prefetch")
    src = kernel.get_kernel_source()
    assert scan_slice_width(HV) == (8 if HV <= 8 else 16)
    assert "cp_async_gs_conditional<4>" in src and "cp_async_wait<1>" in src and "cp_async_wait<2>" in src
    assert "* 65)" in src or "* 129)" in src, "P's shared rows should be padded by one word"
    assert "mma" not in src
    rep = ptxas_report(kernel)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert rep["dynamic_smem"] <= 227 * 1024 // 2, rep


@needs_nvcc
def test_slot_h0_kernel_compiles():
    """The runs' initial states in one launch (`cp_relayout.slot_initial_states`): float4 copies, a
    zero fill for slots with h0_index < 0, no spills."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.cp_relayout import build_slot_h0_kernel

    kernel = build_slot_h0_kernel(8, 128, 128)
    src = kernel.get_kernel_source()
    assert "float4" in src and "h0_index[" in src
    rep = ptxas_report(kernel)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep


def test_slot_initial_states_rejects_bad_arguments():
    """The one-launch initial states name a wrong h0 or h0_index before any device work."""
    from flashqla.ops.gdn.kernels.sm90.cp_relayout import slot_initial_states

    idx = torch.tensor([0, -1])
    with pytest.raises(ValueError, match="h0 must be"):
        slot_initial_states(torch.zeros(1, 2, 4, 4, dtype=torch.float64), idx)
    with pytest.raises(ValueError, match="h0 must be"):
        slot_initial_states(torch.zeros(2, 4, 4), idx)
    with pytest.raises(ValueError, match="h0_index must be"):
        slot_initial_states(torch.zeros(1, 2, 4, 4), idx.float())
    with pytest.raises(ValueError, match="h0_index must be"):
        slot_initial_states(torch.zeros(1, 2, 4, 4), idx[None])


def test_run_states_torch_path():
    """Off sm_90 the runs' initial states are the torch expression: h0 of the sequence on first
    segments, zeros elsewhere."""
    from flashqla.cp.forward import _run_states
    from flashqla.cp.segments import build_segment_tables

    cu = torch.tensor([0, 100, 100, 300], dtype=torch.int32)
    tab = build_segment_tables(cu, 128, T=300)
    h0 = torch.randn(3, 2, 4, 4)
    got = _run_states(h0, tab)
    for s in range(tab.M):
        n = int(tab.h0_index[s])
        want = h0[n] if n >= 0 else torch.zeros(2, 4, 4)
        assert torch.equal(got[s], want)
    assert int((tab.h0_index >= 0).sum()) == 2  # the empty sequence has no segment


def test_scan_builds_share_one_key(monkeypatch):
    """`op_kernel_specs` lists the scan without a variant, `cp_scan` launches the resolved default:
    both reach one cached build (not a second compile of the same kernel on the op's first split
    call). A bad variant name is refused by name, empty inputs included."""
    from flashqla.ops.gdn.kernels.sm90 import cp_scan as cs
    from flashqla.ops.gdn.kernels.sm90.registry import build

    built = []
    monkeypatch.setattr(cs, "compile_kernel", lambda func, name: built.append(name) or object())
    monkeypatch.setattr(cs, "_cp_scan_ahead_prim_func", lambda *a: None)
    monkeypatch.setattr(cs, "_cp_scan_prefetch_prim_func", lambda *a: None)
    k = build("cp_scan", (3, 8, 8, False))  # a shape no other test builds: the fake stays apart
    assert cs.build_cp_scan_kernel(3, 8, 8, False, cs.DEFAULT_VARIANT) is k
    assert cs.build_cp_scan_kernel(3, 8, 8, 0, None) is k and len(built) == 1, built
    other = [v for v in cs.VARIANTS if v != cs.DEFAULT_VARIANT][0]
    assert cs.build_cp_scan_kernel(3, 8, 8, False, other) is not k and len(built) == 2
    P, Q = torch.zeros(0, 1, 8, 8), torch.zeros(0, 1, 8, 8)
    idx = torch.zeros(0, dtype=torch.int64)
    for bad in ("bogus", ""):
        with pytest.raises(ValueError, match=f"variant.*got {bad!r}"):
            cs.cp_scan(P, Q, idx, idx, variant=bad)
        with pytest.raises(ValueError, match="variant"):
            cs.build_cp_scan_kernel(3, 8, 8, False, bad)
    assert cs.cp_scan(P, Q, idx, idx, variant=other)[0].shape == (0, 1, 8, 8)


def test_correction_launches_fit_the_grid(monkeypatch):
    """The correction's grid is (groups, M * HV) and a grid's y dimension holds at most 65535 blocks
    (CUDA): with more (slot, value head) pairs `cp_correct` launches over slot ranges, each a valid
    grid, and the rows come out as from one launch (the kernel emulated on the CPU)."""
    from flashqla.ops.gdn.kernels.sm90 import cp_correct as cc

    launches = []

    def kernel(U, S, cu, lim, ngroups, o):  # gdn_cp_correct on the CPU: o[rows of slot] += U S
        M, HV = S.shape[:2]
        assert 1 <= ngroups <= 2**31 - 1 and M * HV <= 65535, (ngroups, M, HV)
        assert cu.shape[0] == M + 1 and tuple(lim.shape) == (M, HV)
        launches.append(M)
        tiles = lim.clamp(max=ngroups * cc.TG).to(torch.int64)
        for s in range(M):
            a, b = int(cu[s]), int(cu[s + 1])
            rows = torch.arange(a, b)[:, None] < a + 64 * tiles[s]  # [rows, HV]
            o[0, a:b] += torch.einsum("thk,hkv->thv", U[0, a:b], S[s]) * rows[..., None]

    monkeypatch.setattr(cc, "build_cp_correct_kernel", lambda *a: kernel)
    gen = torch.Generator().manual_seed(0)
    HV, K, V = 64, 4, 4
    for M, want in ((1023, [1023]), (1024, [1023, 1]), (2100, [1023, 1023, 54])):
        cu = torch.arange(M + 1, dtype=torch.int64) * 2
        cu[M // 2:] += 1  # one slot of 3 rows
        T = int(cu[-1])
        U = torch.randn(1, T, HV, K, generator=gen)
        S = torch.randn(M, HV, K, V, generator=gen)
        flag = torch.rand(M, generator=gen) < 0.8
        o0 = torch.randn(1, T, HV, V, generator=gen)
        launches.clear()
        got = cc.cp_correct(o0.clone(), U, S, cu, flag, max_rows=3)
        assert launches == want
        want_o = o0.clone()
        for s in range(M):
            if flag[s]:
                a, b = int(cu[s]), int(cu[s + 1])
                want_o[0, a:b] += torch.einsum("thk,hkv->thv", U[0, a:b], S[s])
        assert torch.allclose(got, want_o, atol=1e-5, rtol=1e-5)


def test_kernel_only_for_fp32_cuda(monkeypatch):
    from flashqla.cp import merge

    P = torch.zeros(2, 1, 8, 8)
    Q = torch.zeros(2, 1, 8, 16)
    assert not merge._use_kernel(P, Q)  # CPU tensors: the torch scan
    assert not merge._use_kernel(P.double(), Q.double())


def test_specs_name_both_directions():
    from flashqla.ops.gdn.kernels.sm90.registry import op_kernel_specs

    fwd = op_kernel_specs(2, 8, backward=False)
    both = op_kernel_specs(2, 8)
    assert ("cp_scan", (8, 128, 128, False)) in fwd and ("cp_scan", (8, 128, 128, True)) not in fwd
    assert ("cp_scan", (8, 128, 128, True)) in both


def test_rejects_unsupported_width():
    from flashqla.ops.gdn.kernels.sm90.cp_scan import build_cp_scan_kernel

    with pytest.raises(ValueError, match="V %"):
        build_cp_scan_kernel(32, 128, 40, False)


@needs_nvcc
@pytest.mark.parametrize("dtype,seq_dtype", [("bfloat16", "int32"),
                                             pytest.param("float16", "int64", marks=pytest.mark.compile_all)])
def test_cp_token_kernels_compile(dtype, seq_dtype):
    """The output-correction and state-gradient kernels (`cp_correct.py`) compile: TMA tile loads, a
    wgmma per tile, no spills; the state-gradient kernel masks U's rows past the segment's end only
    after the tile's TMA load has landed (the mask reads the tile, so the pipeliner waits first)."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.cp_correct import build_cp_correct_kernel, build_cp_state_grads_kernel

    for build in (build_cp_correct_kernel, build_cp_state_grads_kernel):
        kernel = build(8, 128, 128, dtype, seq_dtype)
        src = kernel.get_kernel_source()
        assert "tma_load" in src and "wgmma" in src
        rep = ptxas_report(kernel)
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
        # the slot test reads the limit itself: a variable assigned before it would be moved into
        # the warp-specialised branches by TileLang, after the test (found on the H200)
        head = src[: src.index("for (int it")]
        assert "limit[" in head and "bool if_condition" not in head
    # the correction's tile group is a block index: a remainder by the run-time group count was a
    # 64-bit division that the generated code repeated in each of the epilogue's guarded stores
    # (42.7 us at 2/8 2x4096 under Nsight Compute, 21 us without it)
    src = build_cp_correct_kernel(8, 128, 128, dtype, seq_dtype).get_kernel_source()
    assert "% ngroups" not in src and "/ ngroups" not in src and "blockIdx.y" in src
    src = build_cp_state_grads_kernel(8, 128, 128, dtype, seq_dtype).get_kernel_source()
    loop = src[src.index("for (int it_1"):]
    assert loop.index(".wait(") < loop.index("condval"), "the mask must follow the wait for the tile's load"


def test_token_kernels_off_cpu():
    from flashqla.cp.forward import _token_kernels_apply

    x = torch.zeros(1, 4, 2, 128, dtype=torch.bfloat16)
    assert not _token_kernels_apply(x, x)


@needs_nvcc
@pytest.mark.parametrize("seq_dtype", ["int32", "int64"])
def test_cp_limits_kernel_compiles(seq_dtype):
    """The transition-limits kernel (`cp_limits.py`) compiles: one thread per (slot, head), GROUP
    independent chunk-end loads per step, no spills."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.cp_limits import GROUP, build_cp_limits_kernel

    kernel = build_cp_limits_kernel(8, seq_dtype)
    src = kernel.get_kernel_source()
    assert f"vals[{GROUP}]" in src and "limit[" in src
    rep = ptxas_report(kernel)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep


@needs_nvcc
@pytest.mark.parametrize("to_segments", [True, False], ids=["to-segments", "to-sequences"])
@pytest.mark.parametrize("varlen,seq_dtype", [(True, "int32"), (True, "int64"), (False, "int32")], ids=["packed", "packed-int64", "rows"])
def test_cp_relayout_kernel_compiles(to_segments, varlen, seq_dtype):
    """The slot relayout of A and g_cum_log2 (`kernels/sm90/cp_relayout.py`): one CTA per (destination
    slot, value head), 16-byte vector copies of A, a zero fill where no chunk is, no host sync (its
    values are checked against the torch gathers on the GPU: tests/gpu/test_cp_kernels_gpu.py)."""
    from flashqla.ops.gdn.kernels.sm90.cp_relayout import build_relayout_kernel

    src = build_relayout_kernel(4, "bfloat16", seq_dtype, seq_dtype, to_segments, varlen).get_kernel_source()
    assert "uint4" in src, "A should be copied in 16-byte vectors"
    assert "blockIdx.y" in src and "__launch_bounds__(128" in src
    if to_segments or varlen:
        assert "seg_cu" in src or "cu_seqlens" in src


def test_cp_relayout_specs_and_cpu_path():
    """op_kernel_specs names the relayout in both directions for the split path; on CPU tensors the
    driver keeps the torch gathers (the reference the kernel is checked against)."""
    from flashqla.cp.segments import build_segment_tables, segment_slots_to_sequence_slots, sequence_slots_to_segment_slots
    from flashqla.ops.gdn.kernels.sm90.registry import op_kernel_specs

    specs = [a for k, a in op_kernel_specs(2, 8, N=3, varlen=True) if k == "cp_relayout"]
    assert sorted(a[4] for a in specs) == [False, True]
    assert [a for k, a in op_kernel_specs(2, 8, N=3, varlen=True, backward=False) if k == "cp_relayout"] == \
        [(8, "bfloat16", "int32", "int32", False, True)]
    cu = torch.tensor([0, 100, 100, 300], dtype=torch.int32)
    tab = build_segment_tables(cu, 128, T=300)
    A = torch.randn(2, (300 // 64 + 3) * 64, 64)
    G = torch.randn(2, (300 // 64 + 3) * 64)
    Ap, Gp = sequence_slots_to_segment_slots(A, G, tab, cu, 1, 300)
    A2, G2 = segment_slots_to_sequence_slots(Ap, Gp, tab, cu, 1, 300)
    # the chunks of the two non-empty sequences survive the round trip; the slot after each is zero
    for base, n in ((0, 2), (100 // 64 + 2, 4)):
        assert torch.equal(A2[:, base * 64:(base + n) * 64], A[:, base * 64:(base + n) * 64])
    assert not A2[:, 2 * 64:3 * 64].any()


def test_scan_limit_arguments_checked():
    """`cp_scan(limit=...)` needs the slots' token ranges and a [M, HV] limit; each mistake is a
    ValueError naming what is wrong, raised before anything is built or launched."""
    from flashqla.ops.gdn.kernels.sm90.cp_scan import cp_scan

    M, HV, K = 3, 2, 8
    P, Q = torch.zeros(M, HV, K, K), torch.zeros(M, HV, K, K)
    first, num = torch.zeros(1, dtype=torch.int64), torch.full((1,), M, dtype=torch.int64)
    start, end = torch.tensor([0, 64, 128]), torch.tensor([64, 128, 150])
    with pytest.raises(ValueError, match="seg_start and seg_end"):
        cp_scan(P, Q, first, num, limit=torch.zeros(M, HV, dtype=torch.int32))
    with pytest.raises(ValueError, match="limit must have shape"):
        cp_scan(P, Q, first, num, limit=torch.zeros(M, 1, dtype=torch.int32), seg_start=start, seg_end=end)
    with pytest.raises(ValueError, match="seg_start and seg_end must have shape"):
        cp_scan(P, Q, first, num, limit=torch.zeros(M, HV, dtype=torch.int32), seg_start=start[:2], seg_end=end)


@needs_nvcc
@pytest.mark.parametrize("HV,reverse,width", [(8, False, 4), pytest.param(8, True, 4, marks=pytest.mark.compile_all),
                                              pytest.param(32, False, 8, marks=pytest.mark.compile_all), (32, True, 8)])
def test_cp_scan_ahead_variant_compiles(HV, reverse, width):
    """Variant "ahead": the next step's whole P (padded rows) and Q reach shared memory by cp.async
    while a step sums, one copy group each a step (the wait leaves the next step's two pending);
    CUDA cores only, no spills, within one CTA's shared memory."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.cp_scan import build_cp_scan_kernel

    kernel = build_cp_scan_kernel(HV, 128, 128, reverse, "ahead", width)
    src = kernel.get_kernel_source()
    assert "cp_async_wait<2>" in src and "* 129)" in src
    assert "mma" not in src
    rep = ptxas_report(kernel)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert rep["dynamic_smem"] <= 227 * 1024, rep


def test_scan_choice_and_specs(monkeypatch):
    """`scan_choice`: "ahead" with narrow slices only for a cut whose grid stays within AHEAD_MAX_CTAS
    (4 value columns up to 16 value heads, 8 above), the default otherwise; the op's kernel list builds
    the scans a cut call launches, both directions."""
    from flashqla.ops.gdn.kernels.sm90.registry import op_kernel_specs
    from flashqla.ops.gdn.kernels.sm90 import cp_scan as cs

    assert cs.scan_choice(8, 1, True) == ("ahead", 4)
    assert cs.scan_choice(16, 2, True) == ("ahead", 4)  # 32 x 16 x 2 = 1024 CTAs
    assert cs.scan_choice(32, 2, True) == ("ahead", 8)
    assert cs.scan_choice(64, 1, True) == (cs.DEFAULT_VARIANT, None)  # more heads than measured
    assert cs.scan_choice(8, 1, False) == (cs.DEFAULT_VARIANT, None)
    assert cs.scan_choice(16, 4, True) == (cs.DEFAULT_VARIANT, None)  # 2048 CTAs
    assert cs.scan_choice(8, 8, True) == (cs.DEFAULT_VARIANT, None)
    scans = [a for k, a in op_kernel_specs(4, 8, backward=True) if k == "cp_scan"]
    assert (8, 128, 128, False, "ahead", 4) in scans and (8, 128, 128, True, "ahead", 4) in scans, scans
    # the listed build is the one a cut call launches, for the V it is given
    for HV, V in ((64, 256), (8, 64), (32, 128)):
        variant, width = cs.scan_choice(HV, 1, True, V)
        listed = [a for k, a in op_kernel_specs(HV // 2, HV, backward=True, K=V, V=V) if k == "cp_scan" and len(a) > 4]
        assert listed == [(HV, V, V, False, variant, width), (HV, V, V, True, variant, width)], listed

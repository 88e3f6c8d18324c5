"""GPU tier: context parallelism on the sm_90 kernels, CP on vs CP off vs fp64.

Forward (`flashqla.ops.gdn.fwd.chunk_gated_delta_rule_fwd` with cp="on"), o and the final state
against the fp64 token recurrence: 2/8 heads 1 x 8192 with a forced split (8 segments), varlen
[5000, 100, 3000] (the two long sequences split, the short one not), both output corrections, the
gate-driven mode; every input has a g == 0 head and a g = -30 head
(`make_gdn_inputs(special_heads=True)`) and an initial state. Also: no recompile for new lengths,
poisoned outputs all written, CUDA graph replay equals eager.

Backward (`flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd` with cp="on"), every gradient (dq dk dv
dg dbeta dh0) against the fp64 reference backward (`reference.gdn.fused_bwd`, equal to autograd of the
recurrence to 1e-12) and against the unsplit sm_90 backward, on 1 x 4096 and on a varlen mix
[2500, 100, 1500], with dht.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_cp_gpu.py`. Skips cleanly without a Hopper GPU.
The forward tests ran in 31-44 s on the H200 (five kernel configurations compiled concurrently
first); the backward adds its four kernels for the segments' int32 offsets.
"""

from __future__ import annotations

import pytest
import torch

from flashqla.testing import BUDGETS, make_gdn_inputs, rel_rms

pytestmark = pytest.mark.gpu

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not HOPPER:
    pytest.skip("needs a CUDA GPU of compute capability 9.0 (Hopper)", allow_module_level=True)

from reference.gdn.recurrent import recurrent_gated_delta_rule  # noqa: E402

DEV = "cuda"
#: CP may add a few bf16 roundings over the unsplit op (U stored in bf16, the correction added to o):
#: its error against fp64 may exceed CP off's by this factor plus this slack, and stays in budget.
CP_FACTOR = 1.5
CP_SLACK = 2e-3


def _budget(q):
    return BUDGETS["sm90_fwd_bf16"][q]


def _to_device(x: dict) -> dict:
    out = {}
    for name, t in x.items():
        if t is None:
            out[name] = None
        elif name in ("q", "k", "v"):
            out[name] = t.to(DEV, torch.bfloat16)
        elif name == "cu_seqlens":
            out[name] = t.to(DEV)
        else:
            out[name] = t.to(DEV, torch.float32)
    return out


def _reference(xd: dict):
    x64 = {n: (t.detach().cpu().double() if t is not None and t.is_floating_point() else (t.cpu() if t is not None else None)) for n, t in xd.items()}
    return recurrent_gated_delta_rule(**x64, output_final_state=True)


def _cp(xd, **kw):
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    out, info = chunk_gated_delta_rule_fwd(**xd, output_final_state=True, poison_outputs=True, return_info=True, **kw)
    torch.cuda.synchronize()
    assert torch.isfinite(out.o.float()).all(), "o has unwritten (NaN) or non-finite elements"
    assert torch.isfinite(out.final_state).all(), "final_state has non-finite elements"
    return out, info


_WARM = {}


@pytest.fixture(scope="module", autouse=True)
def _precompile():
    """Compile every configuration the module uses at once (threads overlap the compiler runs)."""
    from flashqla.ops.gdn.kernels.sm90.registry import build_kernels

    bf, f32, i32 = "bfloat16", "float32", "int32"
    specs = [
        ("prepare", (2, 8, 128, bf, f32, i32, False)),  # CP off, 1 x 8192
        ("prepare", (2, 8, 128, bf, f32, i32, False, 1)),  # ... whose 128 slots take one value head a CTA
        ("recurrent", (2, 8, 128, 128, 64, bf, i32, False)),
        ("prepare", (2, 8, 128, bf, f32, i32, True)),  # CP on (int32 pseudo offsets), varlen CP off
        ("recurrent", (2, 8, 128, 128, 64, bf, i32, True)),
        ("recurrent", (2, 8, 128, 128, 128, bf, i32, True)),
    ]
    build_kernels(specs)
    yield


def _compare(name, xd, **kw):
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    ref_o, ref_ht = _reference(xd)
    off = chunk_gated_delta_rule_fwd(**xd, output_final_state=True, poison_outputs=True)
    on, info = _cp(xd, cp="on", **kw)
    assert info is not None and info.plan.split, "the forced plan must split"
    e_off = {"o": rel_rms(off.o, ref_o), "ht": rel_rms(off.final_state, ref_ht)}
    e_on = {"o": rel_rms(on.o, ref_o), "ht": rel_rms(on.final_state, ref_ht)}
    diff = {"o": rel_rms(on.o, off.o), "ht": rel_rms(on.final_state, off.final_state)}
    print(f"{name}: CP on {e_on}, CP off {e_off}, on vs off {diff}, L={info.tables.segment_len} M={info.tables.M}")
    for q in ("o", "ht"):
        assert e_on[q] <= _budget(q), f"{name} {q}: CP error {e_on[q]:.3e} exceeds budget {_budget(q):.1e}"
        assert e_on[q] <= CP_FACTOR * e_off[q] + CP_SLACK, f"{name} {q}: CP {e_on[q]:.3e} vs unsplit {e_off[q]:.3e}"
    return e_on, e_off, info, on


@pytest.mark.parametrize("correction", ["gemm", "rerun"])
def test_one_long_sequence_forced_split(correction):
    x = make_gdn_inputs(B=1, T=8192, H=2, HV=8, seed=1)
    _compare(f"2/8 1x8192 {correction}", _to_device(x), segment_len=1024, correction=correction)


@pytest.mark.parametrize("h0", [True, False], ids=["h0", "no-h0"])
def test_varlen_partly_split(h0):
    x = make_gdn_inputs(B=1, T=8100, H=2, HV=8, cu_seqlens=[5000, 100, 3000], initial_state=h0, seed=2)
    _, _, info, _ = _compare("varlen 5000,100,3000", _to_device(x), segment_len=1024, block_v=64)
    assert int(info.tables.seq_num.cpu()[1]) == 1 and int(info.tables.seq_num.cpu()[0]) == 5


def test_strong_decay_and_no_decay_heads_exact_mode():
    """Per head: the g == 0 head (0) and the g = -30 head (7) are as accurate with CP as without."""
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    xd = _to_device(make_gdn_inputs(B=1, T=4096, H=2, HV=8, seed=3))
    ref_o, ref_ht = _reference(xd)
    off = chunk_gated_delta_rule_fwd(**xd, output_final_state=True)
    on, _ = _cp(xd, cp="on", segment_len=512)
    for h in (0, 7):
        e_on = rel_rms(on.o[:, :, h], ref_o[:, :, h])
        e_off = rel_rms(off.o[:, :, h], ref_o[:, :, h])
        print(f"head {h}: o CP on {e_on:.3e} off {e_off:.3e}")
        assert e_on <= CP_FACTOR * e_off + CP_SLACK


def test_gated_mode():
    """Decaying gates (logsigmoid / 16 on every head but the special ones): the gate-driven mode stays
    within the exact mode's error on every head its flag accepts, and flags the g == 0 head."""
    xd = _to_device(make_gdn_inputs(B=1, T=8192, H=2, HV=8, gate="logsigmoid", seed=4))
    ref_o, ref_ht = _reference(xd)
    ex, _ = _cp(xd, cp="on", segment_len=1024)
    ga, info = _cp(xd, cp="on", segment_len=1024, gate_chunks=4)
    ok = info.gate_ok.all(0).cpu()
    assert not bool(ok[0]) and bool(ok[7]), ok
    for h in range(8):
        if bool(ok[h]):
            e_g, e_x = rel_rms(ga.o[:, :, h], ref_o[:, :, h]), rel_rms(ex.o[:, :, h], ref_o[:, :, h])
            print(f"head {h}: gated {e_g:.3e} exact {e_x:.3e}")
            assert e_g <= CP_FACTOR * e_x + CP_SLACK


def _capture(fn):
    """fn called once on a side stream (warm-up), then one call captured in a CUDA graph: (graph, that
    call's result)."""
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        out = fn()
    return graph, out


def test_no_recompile_poison_and_graph_replay():
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90._common import compile_count

    xd = _to_device(make_gdn_inputs(B=1, T=6000, H=2, HV=8, cu_seqlens=[3000, 3000], seed=5))
    _cp(xd, cp="on", segment_len=1024, block_v=64)
    n = compile_count()
    xd2 = _to_device(make_gdn_inputs(B=1, T=7000, H=2, HV=8, cu_seqlens=[100, 6900], seed=6))
    _cp(xd2, cp="on", segment_len=1024, block_v=64)
    assert compile_count() == n, "a new sequence mix must not recompile"

    def fn():
        return chunk_gated_delta_rule_fwd(**xd2, output_final_state=True, cp="on", segment_len=1024, block_v=64)

    eager = fn()
    graph, captured = _capture(fn)
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(captured.o, eager.o) and torch.equal(captured.final_state, eager.final_state)


# ------------------------------------------------------------------------------------------ backward

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
#: the unsplit backward's budgets against fp64 (tests/gpu/test_bwd_gpu.py)
BWD_BUDGET = {"dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "dg": 3e-2, "dbeta": 2e-2, "dh0": 2e-2}


def _bwd_case(name, x, segment_len):
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd
    from reference.gdn import fused_bwd as fb

    gen = torch.Generator().manual_seed(7)
    N = x["v"].shape[0] if x["cu_seqlens"] is None else x["cu_seqlens"].numel() - 1
    do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(N, x["v"].shape[2], 128, 128, generator=gen, dtype=torch.float64)
    xd = _to_device(x)
    do_d, dht_d = do.to(DEV, torch.bfloat16), dht.to(DEV, torch.float32)
    scale = 128**-0.5
    x64 = {n: (t.detach().cpu().double() if t is not None and t.is_floating_point() else (t.cpu() if t is not None else None)) for n, t in xd.items()}
    Ab, G2 = fb.forward_slot_products(x64["k"], x64["g"], x64["beta"], x64["v"].shape[2], x64["cu_seqlens"])
    ref = fb.fused_gated_delta_rule_bwd(x64["q"], x64["k"], x64["v"], x64["beta"], Ab, G2, scale, x64["initial_state"],
                                        do_d.cpu().double(), dht_d.cpu().double(), x64["cu_seqlens"], g=x64["g"])
    f = chunk_gated_delta_rule_fwd(**xd, output_final_state=True)
    args = (f.q, f.k, xd["v"], xd["g"], xd["beta"], f.A, f.g_cum_log2, do_d, dht_d, scale, xd["initial_state"], xd["cu_seqlens"])
    off = chunk_gated_delta_rule_bwd(*args)
    on = chunk_gated_delta_rule_bwd(*args, cp="on", segment_len=segment_len)
    torch.cuda.synchronize()
    for n, a, b, r in zip(NAMES, on, off, ref):
        e_on, e_off = rel_rms(a, r), rel_rms(b, r)
        print(f"{name} {n}: CP on {e_on:.3e} off {e_off:.3e} on vs off {rel_rms(a, b):.3e}")
        assert torch.isfinite(a.float()).all(), f"{n}: non-finite"
        assert e_on <= BWD_BUDGET[n], f"{name} {n}: CP error {e_on:.3e} exceeds budget {BWD_BUDGET[n]:.1e}"
        assert e_on <= CP_FACTOR * e_off + CP_SLACK, f"{name} {n}: CP {e_on:.3e} vs unsplit {e_off:.3e}"


def test_backward_one_long_sequence():
    _bwd_case("bwd 2/8 1x4096", make_gdn_inputs(B=1, T=4096, H=2, HV=8, seed=11), 512)


def test_backward_varlen_partly_split():
    _bwd_case("bwd varlen 2500,100,1500", make_gdn_inputs(B=1, T=4100, H=2, HV=8, cu_seqlens=[2500, 100, 1500], seed=12), 512)


def test_backward_side_stream_bitwise_and_graph_capture(monkeypatch):
    """The split backward's terminal gradients (E and the reverse scan) run on a side stream beside the
    states pass (on a backend with `deferred_dht`, `Sm90Backend`): every gradient bit for bit the
    serial order's (the same kernels on a backend without `deferred_dht`), eagerly and replayed from a
    CUDA graph captured with the fork, on a varlen mix whose long sequence is split and whose short
    one is not, with an initial state and dht."""
    from flashqla.cp import backward as cp_bwd
    from flashqla.ops.gdn.backend import Sm90Backend
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    class SerialBackend(Sm90Backend):  # dht computed before the states pass, on the current stream
        deferred_dht = False

    forks = []
    real = cp_bwd._on_side_stream
    monkeypatch.setattr(cp_bwd, "_on_side_stream", lambda *a: forks.append(1) or real(*a))
    xd = _to_device(make_gdn_inputs(B=1, T=5100, H=2, HV=8, cu_seqlens=[3500, 100, 1500], seed=13))
    f = chunk_gated_delta_rule_fwd(**xd, output_final_state=True)
    gen = torch.Generator().manual_seed(8)
    do = torch.randn(xd["v"].shape, generator=gen).to(DEV, torch.bfloat16)
    dht = torch.randn(3, 8, 128, 128, generator=gen).to(DEV)
    args = (f.q, f.k, xd["v"], xd["g"], xd["beta"], f.A, f.g_cum_log2, do, dht, 128**-0.5, xd["initial_state"],
            xd["cu_seqlens"])

    def run(backend=None):
        return chunk_gated_delta_rule_bwd(*args, cp="on", segment_len=512, backend=backend)

    serial = run(SerialBackend())
    assert not forks
    side = run()
    assert len(forks) == 1, "the split backward did not fork"
    graph, captured = _capture(run)  # a warm-up call, then the captured one
    assert len(forks) == 3, "the captured call did not fork"
    for _ in range(2):
        graph.replay()
    torch.cuda.synchronize()
    for n, a, b, c in zip(NAMES, serial, side, captured):
        assert a is not None and bool(a.abs().sum() > 0), f"{n}: zero"
        assert torch.equal(a, b), f"{n}: side stream differs from the serial order"
        assert torch.equal(a, c), f"{n}: graph replay differs"

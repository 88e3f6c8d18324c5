"""Awkward inputs for `cu_seqlens_cpu`, the host copy of the packed offsets that the public op reads
as the context-parallel planner's length hint (`flashqla.contract.planning_max_seqlen`), on CPU.

The kernels are replaced by the fp64 stand-in (`reference.gdn.cp.ReferenceCPBackend`, fixtures of
tests/test_cp_public_op.py) and the planner sees 16 SMs. The contract checked here: a bad hint is a
TypeError / ValueError naming `cu_seqlens_cpu` before any device work; a valid one never crashes and
changes only the plan (outputs, final states and every gradient equal the fp64 reference op's);
the forward and the backward plan with the same hint; torch.compile(fullgraph=True) and
torch.export trace a call that passes the hint (the hint is then checked statically and unused);
the custom ops take `max_seqlen` (fake implementations, opcheck); the benchmark's loaders pass it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import flashqla
import reference
import flashqla.ops.gdn.backend as backend_mod
from flashqla import contract
from flashqla.contract import planning_max_seqlen
from flashqla.cp import plan as planner
from flashqla.cp.plan import cp_splits
from flashqla.testing import make_gdn_inputs, rel_rms
from tests.test_cp_public_op import UNBALANCED, NAMES, _run, cpu_backend, small_gpu, spy  # noqa: F401 (fixtures)


def _inputs(seqlens, seed=31, **kw):
    T = sum(seqlens)
    return make_gdn_inputs(B=1, T=T, H=1, HV=2, K=128, V=128, seqlens=seqlens, seed=seed, **kw)


def _offsets(lengths, dtype=torch.int64):
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return torch.tensor(out, dtype=dtype)


def _assert_equals_reference(x, o, ht, grads, tol=1e-10):
    o_ref, ht_ref, g_ref = _run(reference.chunk_gated_delta_rule, x)
    assert rel_rms(o, o_ref) < 1e-12 and rel_rms(ht, ht_ref) < 1e-12
    for n in g_ref:
        assert rel_rms(grads[n], g_ref[n]) < tol, (n, rel_rms(grads[n], g_ref[n]))


# --- planning_max_seqlen on its own ------------------------------------------------------------------


@pytest.mark.parametrize(
    "hint, match",
    [
        (np.array([0, 5, 300]), "got ndarray"),
        ([0, 5, 300], "got list"),
        ((0, 5, 300), "got tuple"),
        (300, "got int"),
        (torch.tensor([False, True, True]), "dtype int32 or int64, got torch.bool"),
        (torch.tensor([0, 5, 300], dtype=torch.int16), "dtype int32 or int64, got torch.int16"),
        (torch.tensor([0, 5, 255], dtype=torch.uint8), "dtype int32 or int64, got torch.uint8"),
        (torch.tensor([0, 5, 300]).to_sparse(), "dense"),  # was NotImplementedError from aten::as_strided
    ],
    ids=["numpy", "list", "tuple", "int", "bool", "int16", "uint8", "sparse"],
)
def test_not_a_dense_integer_tensor_is_a_type_error(hint, match):
    with pytest.raises(TypeError, match=f"cu_seqlens_cpu .*{match}"):
        planning_max_seqlen(hint, torch.tensor([0, 5, 300]), 300)


def test_nested_tensor_is_a_type_error():
    """Was RuntimeError 'Internal error: NestedTensorImpl doesn't support sizes'."""
    with pytest.warns(UserWarning):  # torch: nested tensors are a prototype
        nt = torch.nested.nested_tensor([torch.tensor([0, 5, 300])])
    with pytest.raises(TypeError, match="cu_seqlens_cpu must be a dense"):
        planning_max_seqlen(nt, torch.tensor([0, 5, 300]), 300)


@pytest.mark.parametrize("hint", [torch.tensor(300), torch.tensor([[0, 5, 300]]), torch.tensor([0, 300])],
                         ids=["0-d", "2-D", "N-differs"])
def test_wrong_shape_is_a_value_error(hint):
    with pytest.raises(ValueError, match="cu_seqlens_cpu must have cu_seqlens' shape"):
        planning_max_seqlen(hint, torch.tensor([0, 5, 300]), 300)


@pytest.mark.parametrize(
    "hint, cu, T, expected",
    [
        (torch.tensor([0, 9, 5, 9, 300, 9])[::2], [0, 5, 300], 300, 320),  # strided view
        (torch.tensor([0, 5, 300], dtype=torch.int32), [0, 5, 300], 300, 320),  # int32 hint, int64 offsets
        (torch.tensor([0]).expand(3), [0, 0, 0], 0, 0),  # stride 0, every sequence empty
        (torch.tensor([0, 0]), [0, 0], 0, 0),  # N = 1, T = 0
        (torch.tensor([0, 0, 0, 65, 65]), [0, 0, 0, 65, 65], 65, 128),  # all empty but one
        (torch.tensor([0, 64]), [0, 64], 64, 64),  # a single sequence of whole chunks
        (torch.tensor([0, 2**31 - 1]), [0, 2**31 - 1], 2**31 - 1, 2**31),  # int32 offsets' largest T
        (torch.tensor([0, 1, 2**40]), [0, 1, 2**40], 2**40, 2**40),  # beyond int32
    ],
    ids=["strided", "int32", "stride-0-empty", "T0-N1", "one-nonempty", "single", "int32-max", "int64"],
)
def test_valid_hints_round_the_longest_up_to_chunks(hint, cu, T, expected):
    assert planning_max_seqlen(hint, torch.tensor(cu), T) == expected


def test_hint_is_read_from_host_memory_only():
    """The device offsets are not read (a meta cu_seqlens, whose values do not exist, is accepted);
    the hint itself may not be a meta tensor."""
    assert planning_max_seqlen(torch.tensor([0, 5, 300]), torch.empty(3, dtype=torch.int64, device="meta"), 300) == 320
    with pytest.raises(TypeError, match="cu_seqlens_cpu must be a CPU tensor"):
        planning_max_seqlen(torch.empty(3, dtype=torch.int64, device="meta"), torch.tensor([0, 5, 300]), 300)


# --- the public op: errors before the device, results independent of the hint -----------------------


def test_public_op_rejects_bad_hints_before_the_device_check():
    """On a CPU machine the fast path ends in the Hopper RuntimeError; a bad hint is reported first,
    naming cu_seqlens_cpu, whatever cp says (cp="off" still checks it)."""
    x = _inputs([30, 40], dtype=torch.bfloat16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    for cp in ("off", "auto", "on"):
        with pytest.raises(TypeError, match="cu_seqlens_cpu must be None or an int32/int64 CPU tensor"):
            flashqla.chunk_gated_delta_rule(*args, cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=np.array([0, 30, 70]), cp=cp)
        with pytest.raises(TypeError, match="cu_seqlens_cpu must be a dense"):
            flashqla.chunk_gated_delta_rule(*args, cu_seqlens=x["cu_seqlens"],
                                            cu_seqlens_cpu=torch.tensor([0, 30, 70]).to_sparse(), cp=cp)
        with pytest.raises(ValueError, match="cu_seqlens_cpu is given without cu_seqlens"):
            flashqla.chunk_gated_delta_rule(*args, cu_seqlens_cpu=torch.tensor([0, 70]), cp=cp)
        with pytest.raises(ValueError, match="cu_seqlens_cpu must be non-decreasing"):
            flashqla.chunk_gated_delta_rule(*args, cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=torch.tensor([0, 71, 70]),
                                            cp=cp)
    with pytest.raises(TypeError):  # keyword-only: an 11th positional argument is refused
        flashqla.chunk_gated_delta_rule(*args, None, None, False, x["cu_seqlens"], False, torch.tensor([0, 30, 70]))


@pytest.mark.parametrize(
    "seqlens, hint, cu_dtype, hint_dtype",
    [
        (UNBALANCED, [64, 1984], torch.int64, torch.int32),
        (UNBALANCED, [64, 1984], torch.int32, torch.int64),
        (UNBALANCED, [1024, 1024], torch.int64, torch.int64),  # claims a shorter longest sequence
        ([64, 960], [512, 512], torch.int64, torch.int64),  # no L below 512: cp="on" forces L = 512
        ([0, 700, 0, 1, 0, 300], [0, 700, 0, 1, 0, 300], torch.int32, torch.int32),  # empty sequences
        ([0, 0, 1000, 0], [0, 0, 1000, 0], torch.int64, torch.int64),  # all empty but one
        ([1000], [1000], torch.int64, torch.int32),  # a single sequence
    ],
    ids=["int32-hint", "int32-offsets", "hint-shorter", "forced-512", "empties", "one-nonempty", "single"],
)
def test_any_valid_hint_gives_the_reference_results(spy, small_gpu, seqlens, hint, cu_dtype, hint_dtype):
    """cp="on": the forward and the backward split and plan with the hint (its longest sequence, in
    whole chunks; the forward, keeping its split states for the backward, asks the backward's plan),
    and the results equal the fp64 reference op's even where the hint disagrees with cu_seqlens."""
    x = _inputs(seqlens)
    x["cu_seqlens"] = x["cu_seqlens"].to(cu_dtype)
    o, ht, grads = _run(flashqla.chunk_gated_delta_rule, x, cp="on", cu_seqlens_cpu=_offsets(hint, hint_dtype))
    ms = -(-max(hint) // 64) * 64
    assert spy == [(True, ms), (True, ms)], spy
    assert {"prepare", "recurrent", "bwd"} <= {k for k, _ in small_gpu.launches}, small_gpu.launches
    _assert_equals_reference(x, o, ht, grads)


def test_hint_changes_the_segment_length_not_the_results(small_gpu):
    """The same inputs under two hints that lead to different segment lengths: different launches,
    results equal to each other and to the reference."""
    x = _inputs([6849, 661, 682], seed=33)
    runs = {}
    # L 1024 and 1536 (cp="on", 16 SMs; the backward's plan, costed on the hinted lengths, which a
    # forward keeping its states takes): the same longest sequence, the others' lengths decide
    for hint in ([1225, 118, 6849], [6849, 661, 682]):
        small_gpu.launches.clear()
        runs[tuple(hint)] = (_run(flashqla.chunk_gated_delta_rule, x, cp="on", cu_seqlens_cpu=_offsets(hint)),
                             list(small_gpu.launches))
    (a, la), (b, lb) = runs.values()
    assert la != lb, (la, lb)
    assert rel_rms(a[0], b[0]) < 1e-12 and rel_rms(a[1], b[1]) < 1e-12
    for n in a[2]:
        assert rel_rms(a[2][n], b[2][n]) < 1e-10, n
    _assert_equals_reference(x, *a)


def test_cu_seqlens_on_the_host_too(spy, small_gpu):
    """cu_seqlens itself a CPU tensor (both host copies; the very same tensor as the hint): cp="auto"
    splits the unbalanced batch."""
    x = _inputs(UNBALANCED, seed=34)
    o, ht, grads = _run(flashqla.chunk_gated_delta_rule, x, cp="auto", cu_seqlens_cpu=x["cu_seqlens"])
    # the forward keeps its split states for the backward: it asks the backward's plan (which splits)
    assert spy == [(True, 1984), (True, 1984)], spy
    assert max(n for k, n in small_gpu.launches if k == "recurrent") > 2, small_gpu.launches  # split
    _assert_equals_reference(x, o, ht, grads)


def test_empty_input_with_a_hint(small_gpu):
    """N = 1, T = 0: the plan is 'empty input'; o is empty and the final state is the initial one."""
    x = _inputs([0], seed=35)
    h0 = x["initial_state"]
    outs = [flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0,
                                            output_final_state=True, cu_seqlens=x["cu_seqlens"],
                                            cu_seqlens_cpu=hint, cp="on")
            for hint in (torch.tensor([0, 0], dtype=torch.int32), None)]
    (o, ht), (o_none, ht_none) = outs
    assert o.shape == x["v"].shape and o.numel() == 0
    assert torch.equal(ht, ht_none)
    torch.testing.assert_close(ht.to(h0.dtype), h0, rtol=1e-6, atol=1e-6)  # the stand-in returns it in fp32 here


def test_inference_path_receives_the_hint(spy):
    """No input requires a gradient: flashqla::gdn_fwd_inference plans with the hint too."""
    x = _inputs(UNBALANCED, seed=36)
    with torch.no_grad():
        o, ht = flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                                output_final_state=True, cu_seqlens=x["cu_seqlens"],
                                                cu_seqlens_cpu=_offsets(UNBALANCED), cp="auto")
    assert spy == [(False, 1984)], spy
    o_ref, ht_ref = reference.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"],
                                                     initial_state=x["initial_state"], output_final_state=True,
                                                     cu_seqlens=x["cu_seqlens"])
    assert rel_rms(o, o_ref) < 1e-12 and rel_rms(ht, ht_ref) < 1e-12


def test_backward_twice_with_retain_graph(spy):
    """A retained graph backpropagated twice plans both backwards with the saved hint and
    accumulates exactly twice the reference gradients."""
    x = _inputs(UNBALANCED, seed=37)
    leaves = {n: x[n].clone().requires_grad_(True) for n in NAMES}
    o, ht = flashqla.chunk_gated_delta_rule(*(leaves[n] for n in ("q", "k", "v", "g", "beta")),
                                            initial_state=leaves["initial_state"], output_final_state=True,
                                            cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=_offsets(UNBALANCED), cp="auto")
    loss = (o * o).sum() + ht.sum()
    loss.backward(retain_graph=True)
    first = {n: t.grad.clone() for n, t in leaves.items()}
    loss.backward()
    assert spy == [(True, 1984), (True, 1984), (True, 1984)], spy  # the forward asks the backward's plan
    ref = {n: x[n].clone().requires_grad_(True) for n in NAMES}
    o_r, ht_r = reference.chunk_gated_delta_rule(*(ref[n] for n in ("q", "k", "v", "g", "beta")),
                                                 initial_state=ref["initial_state"], output_final_state=True,
                                                 cu_seqlens=x["cu_seqlens"])
    ((o_r * o_r).sum() + ht_r.sum()).backward()
    for n in NAMES:
        assert rel_rms(first[n], ref[n].grad) < 1e-10, n
        assert rel_rms(leaves[n].grad, 2 * ref[n].grad) < 1e-10, n


# --- the plan cache -----------------------------------------------------------------------------------


def test_plan_cache_stays_bounded_over_many_hints(small_gpu):
    """Every chunk-rounded longest sequence of a 2-sequence batch of 65536 tokens (1024 hints, each a
    cache entry forward and backward): both caches stay within their bounds, a hint never leaks into
    the plan of a call without one, and the result of each lookup is what plan_cp says."""
    T = 65536
    q = torch.empty(1, T, 1, 128)
    v = torch.empty(1, T, 2, 128)
    cu = torch.tensor([0, T // 2, T])
    for longest in range(T // 2, T + 1, 32):
        ms = planning_max_seqlen(torch.tensor([0, longest, T]) if longest < T else torch.tensor([0, 0, T]), cu, T)
        for backward in (False, True):
            split = cp_splits(q, v, cu, "auto", max_seqlen=ms, backward=backward)
            assert split == planner.plan_cp(2, 2, T, 128, 16, exact=True, max_seqlen=ms, backward=backward).split
    info = planner.plan_cache_info()
    assert info.currsize <= info.maxsize == 256
    assert planner.plan_cp.cache_info().currsize <= 1024
    splits_with = cp_splits(q, v, cu, "auto", max_seqlen=T)
    assert cp_splits(q, v, cu, "auto") == planner.plan_cp(2, 2, T, 128, 16, exact=True).split
    assert splits_with == planner.plan_cp(2, 2, T, 128, 16, exact=True, max_seqlen=T).split


# --- custom ops, torch.compile, torch.export -------------------------------------------------------


def test_fake_implementations_take_max_seqlen():
    import flashqla.ops.gdn.autograd  # noqa: F401 - registers the ops

    m = dict(device="meta")
    q = torch.empty(1, 300, 2, 128, dtype=torch.bfloat16, **m)
    v = torch.empty(1, 300, 4, 128, dtype=torch.bfloat16, **m)
    g = torch.empty(1, 300, 4, **m)
    h0 = torch.empty(3, 4, 128, 128, **m)
    cu = torch.empty(4, dtype=torch.int32, **m)
    for ms in (None, 0, 64, 2**40):
        o, ht, A, gc = torch.ops.flashqla.gdn_fwd(q, q, v, g, g, 0.1, h0, True, cu, "auto", ms)
        assert o.shape == v.shape and ht.shape == h0.shape and A.shape == (4, (300 // 64 + 3) * 64, 64)
        o2, ht2 = torch.ops.flashqla.gdn_fwd_inference(q, q, v, g, g, 0.1, h0, True, cu, "auto", ms)
        assert o2.shape == o.shape and ht2.shape == ht.shape
        dq, dk, dv, dg, db, dh0 = torch.ops.flashqla.gdn_bwd(q, q, v, g, g, A, gc, v, h0, 0.1, h0, cu, "auto", ms)
        assert dq.shape == q.shape and dv.shape == v.shape and dh0.shape == h0.shape


def test_custom_ops_opcheck_with_max_seqlen(small_gpu, monkeypatch):
    """torch.library.opcheck of the three ops with a max_seqlen (the stand-in's dtypes differ from the
    kernels' in A and the gradients, so test_faketensor runs for the inference op only)."""
    from reference.gdn.cp import ReferenceCPBackend

    monkeypatch.setattr(backend_mod, "_DEFAULT", ReferenceCPBackend(state_dtype=torch.float32))
    x = _inputs([64, 128], seed=38)
    q, k, v = (x[n].to(torch.bfloat16) for n in "qkv")
    g, beta, h0 = (x[n].float() for n in ("g", "beta", "initial_state"))
    args = (q, k, v, g, beta, 0.1, h0, True, x["cu_seqlens"], "on", 128)
    no_fake = ("test_schema", "test_autograd_registration", "test_aot_dispatch_dynamic")
    torch.library.opcheck(torch.ops.flashqla.gdn_fwd_inference, args)
    torch.library.opcheck(torch.ops.flashqla.gdn_fwd, args, test_utils=no_fake)
    o, ht, A, G = torch.ops.flashqla.gdn_fwd(*args)
    bargs = (q, k, v, g, beta, A, G, torch.randn_like(o), torch.randn_like(ht), 0.1, h0, x["cu_seqlens"], "on", 128)
    torch.library.opcheck(torch.ops.flashqla.gdn_bwd, bargs, test_utils=no_fake)


@pytest.fixture
def device_like_values(monkeypatch):
    """As on a GPU, the values of cu_seqlens and g are not read by the op's checks (they would be
    device tensors); those of cu_seqlens_cpu still are."""
    real = contract.check_cu_seqlens_values
    monkeypatch.setattr(contract, "check_gate_values", lambda g: None)
    monkeypatch.setattr(contract, "check_cu_seqlens_values",
                        lambda cu, T, name="cu_seqlens": None if name == "cu_seqlens" else real(cu, T, name))


def test_torch_compile_fullgraph_with_the_hint(spy, device_like_values):
    """Regression: torch.compile(fullgraph=True) of a function passing cu_seqlens_cpu failed
    ("Could not guard on data-dependent expression", from reading the hint's values while tracing).
    Traced, the hint is checked statically and not used (plans without it); results and gradients
    equal eager's; a hint of the wrong shape is still refused while tracing."""
    x = _inputs(UNBALANCED, seed=39)
    cu = x["cu_seqlens"]

    def step(q, k, v, g, beta, h0, hint):
        o, ht = flashqla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                cu_seqlens=cu, cu_seqlens_cpu=hint, cp="on")
        return (o * o).sum() + ht.sum()

    def run(fn, hint):
        leaves = {n: x[n].clone().requires_grad_(True) for n in NAMES}
        loss = fn(*(leaves[n] for n in NAMES), hint)
        loss.backward()
        return loss.detach(), {n: t.grad for n, t in leaves.items()}

    loss_e, g_e = run(step, _offsets(UNBALANCED))
    assert spy == [(True, 1984), (True, 1984)], spy  # eager: the forward asks the backward's plan
    spy.clear()
    torch._dynamo.reset()
    compiled = torch.compile(step, backend="aot_eager", fullgraph=True)
    loss_c, g_c = run(compiled, _offsets(UNBALANCED))
    assert spy == [(False, None), (True, None)], spy
    assert rel_rms(loss_c, loss_e) < 1e-12
    for n in NAMES:
        assert rel_rms(g_c[n], g_e[n]) < 1e-10, n
    torch._dynamo.reset()
    # fullgraph: Dynamo reports the op's ValueError as Unsupported("Observed exception"), message included
    with pytest.raises((ValueError, torch._dynamo.exc.Unsupported), match="cu_seqlens_cpu must have cu_seqlens. shape"):
        torch.compile(step, backend="aot_eager", fullgraph=True)(*(x[n] for n in NAMES), torch.tensor([0, 2048]))
    torch._dynamo.reset()


@pytest.mark.parametrize("strict", [True, False], ids=["strict", "non-strict"])
def test_torch_export_with_the_hint(small_gpu, device_like_values, strict):
    """Regression: torch.export of a module passing cu_seqlens_cpu failed in both modes (a
    data-dependent guard on the hint's values); the exported program gives eager's results."""
    x = _inputs([64, 192], seed=40)

    class M(torch.nn.Module):
        def forward(self, q, k, v, g, beta, h0, cu, hint):
            return flashqla.chunk_gated_delta_rule(q, k, v, g, beta, initial_state=h0, output_final_state=True,
                                                   cu_seqlens=cu, cu_seqlens_cpu=hint, cp="on")

    args = tuple(x[n] for n in NAMES) + (x["cu_seqlens"], _offsets([64, 192]))
    ep = torch.export.export(M(), args, strict=strict)
    o, ht = ep.module()(*args)
    o_e, ht_e = M()(*args)
    assert rel_rms(o, o_e) < 1e-12 and rel_rms(ht, ht_e) < 1e-12


# --- the benchmark's loaders -----------------------------------------------------------------------


def test_bench_rows_host_offsets_match_their_device_offsets():
    """Every mix of the forward, backward and context-parallel grids: RowInputs.cu_seqlens_cpu is
    cu_seqlens on the host (int64) and a valid hint for it."""
    from flashqla.bench.grid import CP_GRID_LONG, CP_GRID_MIXES, FWD_MIXES, bwd_mixes, parse_mix
    from flashqla.bench.inputs import RowInputs

    mixes = list(FWD_MIXES) + list(bwd_mixes()) + [parse_mix(m) for m in CP_GRID_MIXES] + \
        [parse_mix(m) for _, m in CP_GRID_LONG]
    assert len(mixes) > 20
    for mix in mixes:
        cu = torch.tensor(mix.cu_seqlens, dtype=torch.int32)
        e = torch.empty(0)
        x = RowInputs(e, e, e, e, e, e, cu, mix.lengths)
        host = x.cu_seqlens_cpu
        assert host.dtype == torch.int64 and host.device.type == "cpu"
        assert torch.equal(host, cu.to(torch.int64)), mix.label
        assert planning_max_seqlen(host, cu, mix.T) == -(-max(mix.lengths) // 64) * 64, mix.label


def test_bench_bwd_ours_loader_passes_the_hint(spy, monkeypatch):
    """`flashqla.bench.impls` ours (forward and backward entry points called directly, as the
    backward benchmark does) plans with the rows' host offsets and matches the fp64 reference."""
    import flashqla.ops.gdn.fwd as fwd_mod
    from flashqla.bench.impls import _ours_train
    from flashqla.bench.inputs import RowInputs as BwdInputs

    # the forward driver's own device / dtype gates (it binds them at import), lifted as `cpu_backend` lifts the op's
    monkeypatch.setattr(fwd_mod, "check_device", lambda q: None)
    monkeypatch.setattr(fwd_mod, "check_supported", lambda *a: None)
    x = _inputs(UNBALANCED, seed=41)
    gen = torch.Generator().manual_seed(42)
    do = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    dht = torch.randn(x["initial_state"].shape, generator=gen, dtype=torch.float64)
    row = BwdInputs(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], x["cu_seqlens"].to(torch.int32),
                    tuple(UNBALANCED), do=do, dht=dht, scale=128**-0.5)
    fwd, bwd, _ = _ours_train(cp="auto")
    f = fwd(row)
    grads = bwd(row, f.saved)
    assert spy == [(True, 1984), (True, 1984)], spy  # the forward keeps its split states: the backward's plan
    leaves = {n: x[n].clone().requires_grad_(True) for n in NAMES}
    o_r, ht_r = reference.chunk_gated_delta_rule(*(leaves[n] for n in ("q", "k", "v", "g", "beta")),
                                                 initial_state=leaves["initial_state"], output_final_state=True,
                                                 cu_seqlens=x["cu_seqlens"])
    ((o_r * do).sum() + (ht_r * dht).sum()).backward()
    assert rel_rms(f.o, o_r.detach()) < 1e-12 and rel_rms(f.ht, ht_r.detach()) < 1e-12
    for n, gr in zip(NAMES, grads):
        assert rel_rms(gr, leaves[n].grad) < 1e-10, n

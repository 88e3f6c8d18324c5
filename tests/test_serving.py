"""The serving contract (issue 43; `flashqla.serving`): state pools by index with padding and
has_initial_state, the "vk" layout, bf16/fp16 state storage, checkpoints at any token, out=,
batch_invariant, the argument checks and the autograd policy, on the reference
(`reference.chunk_gated_delta_rule`) and on the public op's serving path
(`flashqla.ops.gdn.serving`, run on CPU through `reference.gdn.cp.ReferenceCPBackend`), each quantity
(o, final states, checkpoint states) against the fp64 token recurrence.

The batch: 5 sequences of 130, 0, 1, 70 and 64 tokens (an empty and a 1-token one), value head 0
with g == 0 and the last with a very strong decay (`make_gdn_inputs`' special heads); sequence 3 is
a padding sequence (index -1), sequence 2 starts from zeros (has_initial_state False); checkpoints
at positions 1, 63, 64, 65 and the last token of sequence 0, the 1-token sequence's token, inside
the padding sequence, and 63 tokens into and at the end of the last sequence.
"""

from __future__ import annotations

import pytest
import torch

import flashqla
import reference
from flashqla.ops.gdn import api
from flashqla.ops.gdn import backend as backend_mod
from flashqla.testing import make_gdn_inputs, rel_rms
from reference.gdn.cp import ReferenceCPBackend

SEQLENS = [130, 0, 1, 70, 64]
CU = [0, 130, 130, 131, 201, 265]
INDICES = [5, 1, 2, -1, 0]
HAS = [True, True, False, True, True]
POSITIONS = [1, 63, 64, 65, 130, 131, 195, 264, 265]
P_ROWS = 8


def _inputs(dtype=torch.float64, K=128, V=128, seed=0):
    x = make_gdn_inputs(B=1, T=sum(SEQLENS), H=1, HV=3, K=K, V=V, seqlens=SEQLENS, dtype=dtype, seed=seed)
    gen = torch.Generator().manual_seed(seed + 1)
    pool = torch.randn(P_ROWS, 3, K, V, generator=gen, dtype=torch.float64)  # kv layout, fp64 master copy
    return x, pool


def _truth(x, pool64, *, positions=POSITIONS, indices=INDICES, has=HAS):
    """fp64 token recurrence per sequence: o [1, T, HV, V], final [N, HV, K, V], checkpoints [M, HV, K, V]."""
    q, k, v, g, beta = (x[n].to(torch.float64) for n in ("q", "k", "v", "g", "beta"))
    HV, K, V = v.shape[2], q.shape[3], v.shape[3]
    o = torch.zeros_like(v)
    finals, h0s = [], []
    for n in range(len(SEQLENS)):
        a, e = CU[n], CU[n + 1]
        h0 = pool64[indices[n]] if indices[n] >= 0 and has[n] else torch.zeros(HV, K, V, dtype=torch.float64)
        h0s.append(h0)
        sl = [t[:, a:e] for t in (q, k, v, g, beta)]
        o_n, f_n = reference.recurrent_gated_delta_rule(*sl, initial_state=h0[None], output_final_state=True)
        o[:, a:e] = o_n
        finals.append(f_n[0])
    ckpts = []
    for p in positions:
        n = next(i for i in range(len(SEQLENS)) if CU[i] < p <= CU[i + 1])
        sl = [t[:, CU[n]:p] for t in (q, k, v, g, beta)]
        ckpts.append(reference.recurrent_gated_delta_rule(*sl, initial_state=h0s[n][None], output_final_state=True)[1][0])
    return o, torch.stack(finals), torch.stack(ckpts)


def _layout(x, layout):
    return x if layout == "kv" else x.transpose(-1, -2)


@pytest.fixture
def op_on_cpu(monkeypatch):
    """The public op on CPU: the reference backend in place of the sm_90 kernels (as tests/test_call_structure.py)."""
    monkeypatch.setattr(backend_mod, "_DEFAULT", ReferenceCPBackend())
    monkeypatch.setattr(api, "check_device", lambda q: None)
    monkeypatch.setattr(api, "check_supported", lambda *a: None)
    return flashqla.chunk_gated_delta_rule


class _NoSplitCheckpoints(ReferenceCPBackend):
    """The reference backend without `recurrent_dual_checkpoints`: a backend on which the split path
    falls back to the segment or pieces method for checkpoints."""

    recurrent_dual_checkpoints = None


@pytest.fixture(params=["split", "segments"])
def split_op(request, monkeypatch):
    """The public op on CPU as `op_on_cpu`, with the reference backend ("split": checkpoints inside the
    split forward) or one without `recurrent_dual_checkpoints` ("segments"); returns (op, method)."""
    be = ReferenceCPBackend() if request.param == "split" else _NoSplitCheckpoints()
    monkeypatch.setattr(backend_mod, "_DEFAULT", be)
    monkeypatch.setattr(api, "check_device", lambda q: None)
    monkeypatch.setattr(api, "check_supported", lambda *a: None)
    return flashqla.chunk_gated_delta_rule, request.param


def _call(op, x, pool, layout, *, state_dtype, positions=POSITIONS, **kw):
    cu = torch.tensor(CU, dtype=torch.int32)
    pool_s = _layout(pool, layout).to(state_dtype).contiguous().clone()
    before = pool_s.clone()
    M = len(positions)
    shape = (M, 3, 128, 128)
    ck = torch.full(shape, float("nan"), dtype=state_dtype)
    out = torch.full_like(x["v"], float("nan"))
    o, ret = op(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool_s, output_final_state=True, cu_seqlens=cu,
                state_indices=torch.tensor(INDICES, dtype=torch.int64), has_initial_state=torch.tensor(HAS),
                state_layout=layout, checkpoint_positions=torch.tensor(positions, dtype=torch.int32),
                checkpoint_states=ck, out=out, **kw)
    assert o is out and ret is pool_s, "o must be out= and the final state the pool (written in place)"
    return o, pool_s, before, ck


def _errors(x, pool, o, pool_after, before, ck, layout):
    o_ref, f_ref, c_ref = _truth(x, pool.to(before.dtype).to(torch.float64))
    kv_after = _layout(pool_after, layout).to(torch.float64)
    written = [INDICES[n] for n in range(len(SEQLENS)) if INDICES[n] >= 0]
    untouched = [r for r in range(P_ROWS) if r not in written]
    assert torch.equal(pool_after[untouched], before[untouched]), "rows of padding / absent sequences must stay as they were"
    real = [n for n in range(len(SEQLENS)) if INDICES[n] >= 0 and SEQLENS[n] > 0]
    errs = {
        "o": rel_rms(o, o_ref),
        "final": rel_rms(kv_after[[INDICES[n] for n in real]], f_ref[real]),
        "checkpoints": rel_rms(_layout(ck, layout), c_ref),
    }
    empty = SEQLENS.index(0)  # an empty sequence's final state is its initial state
    assert torch.equal(kv_after[INDICES[empty]], _layout(before, layout)[INDICES[empty]].to(torch.float64))
    for m, p in enumerate(POSITIONS):
        assert torch.isfinite(ck[m]).all(), f"checkpoint {m} (position {p}) not written"
    return errs


STATE_BUDGET = {torch.float64: 1e-12, torch.float32: 1e-6, torch.bfloat16: 1e-2, torch.float16: 2e-3}


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("state_dtype", [torch.float64, torch.float32, torch.bfloat16])
def test_reference_pool_checkpoints_against_recurrence(layout, state_dtype):
    x, pool = _inputs()
    o, after, before, ck = _call(reference.chunk_gated_delta_rule, x, pool, layout, state_dtype=state_dtype)
    errs = _errors(x, pool, o, after, before, ck, layout)
    print(f"reference fp64, {state_dtype} pool, {layout}: " + ", ".join(f"{k} {e:.2e}" for k, e in errs.items()))
    assert errs["o"] < 1e-12, errs  # compute is fp64; the pool's rows are read exactly
    assert errs["final"] < STATE_BUDGET[state_dtype] and errs["checkpoints"] < STATE_BUDGET[state_dtype], errs


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16, torch.float16])
def test_op_serving_path_against_recurrence(op_on_cpu, layout, state_dtype):
    """The op's torch-around-the-kernels path (gather, scatter, transposes, casts, the pieces-and-scan
    checkpoints), with the reference backend in the kernels' place."""
    x, pool = _inputs()
    o, after, before, ck = _call(op_on_cpu, x, pool, layout, state_dtype=state_dtype, cp="off")
    errs = _errors(x, pool, o, after, before, ck, layout)
    print(f"op (reference backend), {state_dtype} pool, {layout}: " + ", ".join(f"{k} {e:.2e}" for k, e in errs.items()))
    assert errs["o"] < 1e-6, errs  # initial states enter in fp32 (as on the GPU)
    budget = max(STATE_BUDGET[state_dtype], 1e-6)
    assert errs["final"] < budget and errs["checkpoints"] < budget, errs


def test_op_checkpoints_do_not_change_o_or_final(op_on_cpu):
    x, pool = _inputs()
    o1, after1, _, _ = _call(op_on_cpu, x, pool, "kv", state_dtype=torch.float32, cp="off")
    o2, after2 = torch.empty_like(o1), pool.float().clone()
    op_on_cpu(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=after2, output_final_state=True,
              cu_seqlens=torch.tensor(CU, dtype=torch.int32), state_indices=torch.tensor(INDICES),
              has_initial_state=torch.tensor(HAS), out=o2, cp="off")
    assert torch.equal(o1, o2) and torch.equal(after1, after2)


def test_bf16_state_is_rounded_once_at_the_store():
    """A bf16 pool row equals the fp64 final state rounded once to bf16 (no double rounding)."""
    x, pool = _inputs()
    _, after, _, ck = _call(reference.chunk_gated_delta_rule, x, pool, "kv", state_dtype=torch.bfloat16)
    _, f_ref, c_ref = _truth(x, pool.to(torch.bfloat16).to(torch.float64))
    _, f64, _, ck64 = _call(reference.chunk_gated_delta_rule, x, pool.to(torch.bfloat16).double(), "kv",
                            state_dtype=torch.float64)
    assert torch.equal(after[0], f64[0].to(torch.bfloat16))
    assert torch.equal(ck, ck64.to(torch.bfloat16))


def test_reference_checkpoints_equal_the_chunked_split():
    """A checkpoint at p equals the final state of the sequence cut at p (chunked reference, fp64)."""
    x, pool = _inputs()
    _, _, _, ck = _call(reference.chunk_gated_delta_rule, x, pool, "kv", state_dtype=torch.float64)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    for m, p in enumerate([1, 63, 64, 65, 130]):  # sequence 0, from pool row 5
        _, f = reference.chunk_gated_delta_rule(*(t[:, :p] for t in (q, k, v, g, beta)), initial_state=pool[5][None],
                                                output_final_state=True)
        torch.testing.assert_close(ck[m], f[0], rtol=0, atol=1e-12)


def _batch_invariance(op, **kw):
    """Sequence 'a' alone and inside two different batches: o, final state, checkpoints bitwise equal."""
    a = make_gdn_inputs(B=1, T=150, H=1, HV=2, seqlens=[150], seed=4)
    others = [make_gdn_inputs(B=1, T=t, H=1, HV=2, seqlens=[t], seed=5 + t) for t in (1, 200)]

    def run(parts):
        cat = {n: torch.cat([p[n] for p in parts], dim=1) for n in ("q", "k", "v", "g", "beta")}
        lens = [p["q"].shape[1] for p in parts]
        cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int64)
        i = next(j for j, p in enumerate(parts) if p is a)
        pool = torch.cat([p["initial_state"] for p in parts]).float()  # fp32: a storage dtype of both ops
        ck = torch.zeros(2, 2, 128, 128, dtype=torch.float32)
        pos = torch.tensor([int(cu[i]) + 70, int(cu[i]) + 150])
        with torch.no_grad():
            o, pool = op(**cat, initial_state=pool, output_final_state=True, cu_seqlens=cu,
                         state_indices=torch.arange(len(parts)), checkpoint_positions=pos, checkpoint_states=ck,
                         batch_invariant=True, **kw)
        return o[:, int(cu[i]):int(cu[i + 1])].clone(), pool[i].clone(), ck
    alone = run([a])
    for batch in ([others[0], a], [others[1], a, others[0]]):
        got = run(batch)
        for name, x, y in zip(("o", "final", "checkpoints"), alone, got):
            assert torch.equal(x, y), f"{name} of the sequence changed with the batch"


def test_reference_batch_invariant():
    _batch_invariance(reference.chunk_gated_delta_rule)


def test_op_batch_invariant_plan(op_on_cpu, monkeypatch):
    """batch_invariant on the op: cp off, the plan's value-slice width (`cp.plan.unsplit_block_v`; both
    widths give the same bits on sm_90: `flashqla.ops.gdn.serving`); with the reference backend the
    sequence's results are bitwise the same in every batch."""
    seen = []
    import flashqla.ops.gdn.serving as serving_mod
    real_forward = serving_mod.forward

    def spy(*args, **kw):
        seen.append((kw["plan"].forward.split, kw["plan"].forward.BV))
        return real_forward(*args, **kw)
    monkeypatch.setattr(serving_mod, "forward", spy)
    _batch_invariance(op_on_cpu, cp="on")
    assert seen and all(split is False and bv in (64, 128) for split, bv in seen), seen


def test_no_pool_vk_layout_and_has_initial_state():
    """Per-sequence states in the "vk" layout, with has_initial_state, through both ops' twins."""
    x = make_gdn_inputs(B=2, T=70, H=1, HV=2, seed=9)
    h0 = x["initial_state"]
    has = torch.tensor([False, True])
    o, f = reference.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0.transpose(-1, -2),
                                            output_final_state=True, state_layout="vk", has_initial_state=has)
    h0_ref = h0.clone()
    h0_ref[0] = 0
    o_ref, f_ref = reference.recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=h0_ref,
                                                        output_final_state=True)
    assert rel_rms(o, o_ref) < 1e-12 and rel_rms(f.transpose(-1, -2), f_ref) < 1e-12
    assert f.shape == (2, 2, 128, 128) and f.is_contiguous()


def test_checkpoints_without_cu_seqlens(op_on_cpu):
    """B rows of T tokens: positions are global offsets b * T + t."""
    x = make_gdn_inputs(B=2, T=80, H=1, HV=2, seed=11)
    pos = torch.tensor([1, 64, 80, 81, 145, 160])
    truth = []
    for p in pos.tolist():
        b, t = (p - 1) // 80, (p - 1) % 80 + 1
        truth.append(reference.recurrent_gated_delta_rule(*(x[n][b:b + 1, :t] for n in ("q", "k", "v", "g", "beta")),
                                                          initial_state=x["initial_state"][b:b + 1],
                                                          output_final_state=True)[1][0])
    truth = torch.stack(truth)
    for op, budget in ((reference.chunk_gated_delta_rule, 1e-6), (op_on_cpu, 1e-6)):  # fp32 initial states, fp32 storage
        ck = torch.zeros(6, 2, 128, 128, dtype=torch.float32)
        op(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"].float(), checkpoint_positions=pos,
           checkpoint_states=ck)
        assert rel_rms(ck, truth) < budget


def test_padding_only_batch_leaves_the_pool(op_on_cpu):
    x = make_gdn_inputs(B=1, T=10, H=1, HV=2, seqlens=[4, 6], seed=2)
    for op in (reference.chunk_gated_delta_rule, op_on_cpu):
        pool = torch.randn(3, 2, 128, 128, dtype=torch.float32)
        before = pool.clone()
        op(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=pool, output_final_state=True,
           cu_seqlens=x["cu_seqlens"], state_indices=torch.tensor([-1, -3]))
        assert torch.equal(pool, before)


# ------------------------------------------------------------------------------------------------
# argument checks: before any work, naming the argument, on both ops
# ------------------------------------------------------------------------------------------------

def _bad_calls():
    x = make_gdn_inputs(B=1, T=20, H=1, HV=2, seqlens=[8, 12], seed=1)
    base = {n: x[n] for n in ("q", "k", "v", "g", "beta")} | {"cu_seqlens": x["cu_seqlens"]}
    pool = torch.zeros(4, 2, 128, 128, dtype=torch.float32)
    idx = torch.tensor([0, 1])
    ck = torch.zeros(2, 2, 128, 128, dtype=torch.float32)
    pos = torch.tensor([3, 20])
    P = dict(initial_state=pool, state_indices=idx, output_final_state=True)
    return base, [
        ("state_layout", TypeError if False else ValueError, dict(state_layout="KV")),
        ("state_layout", ValueError, dict(state_layout=None)),
        ("state_indices", TypeError, dict(P, state_indices=torch.tensor([0.0, 1.0]))),
        ("state_indices", ValueError, dict(P, state_indices=torch.tensor([0, 1, 2]))),
        ("state_indices", ValueError, dict(P, state_indices=torch.tensor([0, 4]))),
        ("state_indices", ValueError, dict(P, state_indices=torch.tensor([2, 2]))),
        ("state_indices needs initial_state", ValueError, dict(state_indices=idx)),
        ("initial_state", ValueError, dict(P, state_layout="vk", initial_state=torch.zeros(4, 2, 128, 64))),
        ("initial_state", TypeError, dict(P, initial_state=pool.to(torch.int32))),
        ("has_initial_state", TypeError, dict(P, has_initial_state=torch.tensor([1, 0]))),
        ("has_initial_state", ValueError, dict(P, has_initial_state=torch.tensor([True]))),
        ("checkpoint_states", ValueError, dict(checkpoint_positions=pos)),
        ("checkpoint_positions", ValueError, dict(checkpoint_states=ck)),
        ("checkpoint_positions", ValueError, dict(checkpoint_positions=torch.tensor([20, 3]), checkpoint_states=ck)),
        ("checkpoint_positions", ValueError, dict(checkpoint_positions=torch.tensor([0, 3]), checkpoint_states=ck)),
        ("checkpoint_positions", ValueError, dict(checkpoint_positions=torch.tensor([3, 21]), checkpoint_states=ck)),
        ("checkpoint_positions", TypeError, dict(checkpoint_positions=torch.tensor([3.0, 4.0]), checkpoint_states=ck)),
        ("checkpoint_states", ValueError, dict(checkpoint_positions=pos, checkpoint_states=ck[:1])),
        ("checkpoint_states", ValueError, dict(checkpoint_positions=pos, checkpoint_states=ck, state_layout="vk",
                                               initial_state=None) | {"checkpoint_states": torch.zeros(2, 2, 128, 64)}),
        ("out", TypeError, dict(out=torch.zeros(1, 20, 2, 128, dtype=torch.float32))),
        ("out", ValueError, dict(out=torch.zeros(1, 20, 2, 64, dtype=torch.float64))),
        ("batch_invariant", TypeError, dict(batch_invariant=1)),
        ("device", ValueError, dict(P, state_indices=torch.tensor([0, 1], device="meta"))),
    ]


@pytest.mark.parametrize("case", range(len(_bad_calls()[1])))
@pytest.mark.parametrize("which", ["reference", "op"])
def test_bad_serving_arguments_raise_naming_them(op_on_cpu, monkeypatch, case, which):
    base, cases = _bad_calls()
    name, exc, kw = cases[case]
    op = reference.chunk_gated_delta_rule if which == "reference" else op_on_cpu
    launched = []
    monkeypatch.setattr(ReferenceCPBackend, "prepare", lambda *a, **k: launched.append(1))
    with pytest.raises(exc, match=name.split()[0] if name != "device" else "on meta"):
        op(**base, **kw)
    assert not launched, "a kernel launched before the arguments were checked"


def test_op_on_gpu_refuses_with_the_cpu_hint():
    """Without a Hopper GPU the op still checks the serving arguments first, then says where to go."""
    x = make_gdn_inputs(B=1, T=8, H=1, HV=2, seqlens=[8], dtype=torch.bfloat16, seed=1)
    with pytest.raises(ValueError, match="state_layout"):
        flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"].float(), x["beta"].float(), state_layout="xx")
    with pytest.raises(RuntimeError, match="reference"):
        flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"].float(), x["beta"].float(), state_layout="vk")
    with pytest.raises(TypeError, match="initial_state"):  # the fast path stores states in fp32/bf16/fp16 only
        flashqla.chunk_gated_delta_rule(x["q"], x["k"], x["v"], x["g"].float(), x["beta"].float(),
                                        initial_state=torch.zeros(2, 2, 128, 128, dtype=torch.float64),
                                        state_indices=torch.tensor([0]), cu_seqlens=x["cu_seqlens"])


# ------------------------------------------------------------------------------------------------
# autograd
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("which", ["reference", "op"])
def test_autograd_policy(op_on_cpu, which):
    """o stays differentiable with a pool (its rows are constants); a pool that requires grad, out=
    under autograd and checkpoint_states that require grad are refused; a per-sequence initial_state
    in the "vk" layout gets its gradient."""
    op = reference.chunk_gated_delta_rule if which == "reference" else op_on_cpu
    x = make_gdn_inputs(B=1, T=40, H=1, HV=2, seqlens=[30, 10], seed=6)
    leaves = {n: x[n].clone().requires_grad_() for n in ("q", "k", "v", "g", "beta")}
    cu = x["cu_seqlens"]
    pool = torch.randn(3, 2, 128, 128, dtype=torch.float32)
    o, _ = op(**leaves, initial_state=pool, state_indices=torch.tensor([2, 0]), output_final_state=True, cu_seqlens=cu)
    o.sum().backward()
    assert all(t.grad is not None and torch.isfinite(t.grad).all() for t in leaves.values())
    with pytest.raises(ValueError, match="pool"):
        op(**leaves, initial_state=pool.clone().requires_grad_(), state_indices=torch.tensor([2, 0]), cu_seqlens=cu)
    with pytest.raises(ValueError, match="out="):
        op(**leaves, cu_seqlens=cu, out=torch.empty_like(x["v"]))
    with pytest.raises(ValueError, match="checkpoint_states"):
        op(**leaves, cu_seqlens=cu, checkpoint_positions=torch.tensor([5]),
           checkpoint_states=torch.zeros(1, 2, 128, 128, dtype=torch.float32, requires_grad=True))
    h0 = x["initial_state"].float().transpose(-1, -2).contiguous().requires_grad_()
    o, f = op(**{n: x[n] for n in ("q", "k", "v", "g", "beta")}, initial_state=h0, state_layout="vk",
              output_final_state=True, cu_seqlens=cu)
    (o.sum() + f.sum()).backward()
    h0r = x["initial_state"].clone().requires_grad_()
    o_r, f_r = reference.recurrent_gated_delta_rule(**{n: x[n] for n in ("q", "k", "v", "g", "beta")}, initial_state=h0r,
                                                    output_final_state=True, cu_seqlens=cu)
    (o_r.sum() + f_r.sum()).backward()
    assert rel_rms(h0.grad.transpose(-1, -2), h0r.grad) < 1e-6


# ------------------------------------------------------------------ no host read on the device-side helpers


class _HostReads(torch.utils._python_dispatch.TorchDispatchMode):
    """Records every aten op that reads a tensor value on the host (`.item()`, `int(t)`, indexing with
    a 0-d tensor: `aten._local_scalar_dense`; on a GPU each is a synchronisation, which breaks CUDA-graph
    capture), also on CPU tensors."""

    def __init__(self):
        super().__init__()
        self.reads = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if func is torch.ops.aten._local_scalar_dense.default or "nonzero" in str(func):
            import traceback

            self.reads.append((str(func), "".join(traceback.format_stack(limit=6)[:-1])))
        return func(*args, **(kwargs or {}))


def test_serving_helpers_read_no_value_on_the_host():
    """The torch steps of a serving call that runs on the device (the pool's gather and write-back, the
    checkpoint pieces and their scan) issue no host read of a
    tensor value: a regression test for `store_final_states`' idx[j] with a device j (it broke graph
    capture on the split path)."""
    from flashqla.serving import (ServingArgs, checkpoint_pieces, gather_initial_states, scan_pieces,
                                  store_final_states)

    N, HV, K, V, P = 3, 2, 4, 4, 6
    idx = torch.tensor([4, -1, 1])
    has = torch.tensor([True, True, False])
    pos = torch.tensor([3, 64, 65, 130, 200])
    cu = torch.tensor([0, 130, 130, 200])
    s = ServingArgs(state_indices=idx, has_initial_state=has, state_layout="vk", checkpoint_positions=pos,
                    checkpoint_states=None, out=None, batch_invariant=False, pool=True, pool_rows=P)
    pool = torch.randn(P, HV, V, K)
    with _HostReads() as mode:
        h0 = gather_initial_states(pool, s, N, torch.float32)
        store_final_states(pool, torch.randn(N, HV, K, V), s)
        pieces_cu, first, seq, ends = checkpoint_pieces(cu, pos)
        L = pieces_cu.shape[0] - 1
        scan_pieces(torch.randn(L, HV, K, K), torch.randn(L, HV, K, V), first)
    assert h0.shape == (N, HV, K, V)
    assert not mode.reads, "host reads:\n" + "\n".join(f"{f}\n{st}" for f, st in mode.reads)


def test_split_plan_checkpoints(split_op):
    """An inference call whose plan splits takes its checkpoints inside the split forward ("split":
    the run's and the transitions' states at the positions, combined with the segments' entering
    states after the scan, `cp_forward(checkpoint_positions=)`) or, on a backend without that launch,
    from the split forward's segment entering states ("segments": `segment_checkpoint_states`, one
    extra forward over the checkpoints' pieces). Checkpoints at a sequence's first token, on a
    segment's last token (p = 512 = L), one token into the second segment (its scanned entering
    state), at sequence ends and deep in later segments, a padding sequence beside them; a g == 0
    head and a strong-decay head (whose transitions the gate-driven cut shortens); o, pool rows and
    checkpoints against the fp64 recurrence."""
    from flashqla.ops.gdn import serving as serving_mod

    op_on_cpu, method = split_op
    seqlens = [1300, 0, 70, 700, 2000]
    cu = [0, 1300, 1300, 1370, 2070, 4070]
    indices, has = [3, 0, -1, 1, 4], [True, True, True, False, True]
    positions = [1, 512, 513, 1300, 1970, 2071, 3095]
    x = make_gdn_inputs(B=1, T=sum(seqlens), H=1, HV=2, K=64, V=64, seqlens=seqlens, seed=7)
    pool = torch.randn(6, 2, 64, 64, generator=torch.Generator().manual_seed(8), dtype=torch.float64)
    q, k, v, g, beta = (x[n] for n in ("q", "k", "v", "g", "beta"))
    pool_s = pool.float().clone()
    ck = torch.full((len(positions), 2, 64, 64), float("nan"), dtype=torch.float32)
    o, ret = op_on_cpu(q, k, v, g, beta, initial_state=pool_s, output_final_state=True,
                       cu_seqlens=torch.tensor(cu, dtype=torch.int32), state_indices=torch.tensor(indices),
                       has_initial_state=torch.tensor(has), checkpoint_positions=torch.tensor(positions),
                       checkpoint_states=ck, cp="on")
    assert serving_mod.LAST_PATH["checkpoints"] == method
    o_ref = torch.zeros_like(v)
    h0s, ck_ref = [], []
    for n in range(len(seqlens)):
        a, e = cu[n], cu[n + 1]
        h0 = pool[indices[n]] if indices[n] >= 0 and has[n] else torch.zeros(2, 64, 64, dtype=torch.float64)
        h0s.append(h0)
        sl = [t[:, a:e] for t in (q, k, v, g, beta)]
        o_ref[:, a:e], f = reference.recurrent_gated_delta_rule(*sl, initial_state=h0[None], output_final_state=True)
        if indices[n] >= 0 and e > a:
            assert rel_rms(ret[indices[n]].double(), f[0]) < 1e-5, f"final state of sequence {n}"
    for m, p in enumerate(positions):
        n = next(i for i in range(len(seqlens)) if cu[i] < p <= cu[i + 1])
        sl = [t[:, cu[n]:p] for t in (q, k, v, g, beta)]
        ck_ref.append(reference.recurrent_gated_delta_rule(*sl, initial_state=h0s[n][None], output_final_state=True)[1][0])
    errs = [rel_rms(ck[m].double(), ck_ref[m]) for m in range(len(positions))]
    print(f"split-plan checkpoints ({method}) vs fp64:", " ".join(f"{e:.1e}" for e in errs), f"o {rel_rms(o, o_ref):.1e}")
    assert rel_rms(o, o_ref) < 1e-5
    assert max(errs) < 1e-5, errs


def test_split_plan_checkpoints_fall_back_when_pieces_would_cost_more(split_op):
    """More checkpoints than the batch has segments' worth of tokens (M * L > B * T): inside the split
    forward where the backend can, else the pieces-and-scan method, with the same results."""
    from flashqla.ops.gdn import serving as serving_mod

    op_on_cpu, method = split_op
    x = make_gdn_inputs(B=1, T=1100, H=1, HV=2, K=64, V=64, seqlens=[1100], seed=9)
    positions = torch.tensor([1, 100, 511, 512, 513, 1100])
    ck = torch.zeros(6, 2, 64, 64)
    op_on_cpu(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"].float(),
              output_final_state=True, cu_seqlens=torch.tensor([0, 1100]), checkpoint_positions=positions,
              checkpoint_states=ck, cp="on")
    assert serving_mod.LAST_PATH["checkpoints"] == ("split" if method == "split" else "pieces")
    h0 = x["initial_state"]
    for m, p in enumerate(positions.tolist()):
        sl = [x[n][:, :p] for n in ("q", "k", "v", "g", "beta")]
        _, want = reference.recurrent_gated_delta_rule(*sl, initial_state=h0, output_final_state=True)
        assert rel_rms(ck[m].double(), want[0]) < 1e-5, p


def test_split_plan_checkpoints_fixed_length_batch(split_op):
    """The split and segment methods on a fixed-length batch (no cu_seqlens: positions are b * T + t
    over the flattened rows, the segment tables' token offsets likewise)."""
    from flashqla.ops.gdn import serving as serving_mod

    op_on_cpu, method = split_op
    B, T = 2, 1300
    x = make_gdn_inputs(B=B, T=T, H=1, HV=2, K=64, V=64, seed=3)
    positions = [513, 1300, 1301, 2000]
    ck = torch.zeros(len(positions), 2, 64, 64)
    op_on_cpu(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"].float(),
              output_final_state=True, checkpoint_positions=torch.tensor(positions), checkpoint_states=ck, cp="on")
    assert serving_mod.LAST_PATH["checkpoints"] == method
    for m, p in enumerate(positions):
        b, t = divmod(p - 1, T)
        sl = [x[n][b:b + 1, :t + 1] for n in ("q", "k", "v", "g", "beta")]
        _, want = reference.recurrent_gated_delta_rule(*sl, initial_state=x["initial_state"][b:b + 1],
                                                       output_final_state=True)
        assert rel_rms(ck[m].double(), want[0]) < 1e-5, p


@pytest.mark.parametrize("H, HV, lengths, split", [
    # the H100 serving page's split rows (811dd04): split kept where the split serving call was faster
    # than the unsplit one (its batch_invariant column), unsplit where it was slower or within 1%
    # (16/64 28672+4096 no longer splits as a plain call: `cp.plan._lengths_costed`)
    (2, 8, (32768,), True), (2, 8, (8192,), True), (2, 8, (28672, 4096), True),
    (8, 32, (32768,), True), (16, 32, (32768,), True), (32, 32, (32768,), True),
    (8, 32, (28672, 4096), False), (16, 32, (28672, 4096), False), (32, 32, (28672, 4096), False),
])
def test_serving_plan_with_checkpoints(H, HV, lengths, split):
    """`serving_plan`: an inference call with checkpoints under cp="auto" splits only where the split is
    predicted SERVING_CHECKPOINT_MIN_GAIN times faster; without checkpoints, under training, with cp="on"
    or with an empty positions tensor it is the op's plan; batch_invariant is cp="off"."""
    import itertools

    from flashqla.cp import plan as P
    from flashqla.ops.gdn.serving import SERVING_CHECKPOINT_MIN_GAIN, serving_plan
    from flashqla.serving import ServingArgs

    T = sum(lengths)
    q, v = torch.empty(1, T, H, 128, device="meta"), torch.empty(1, T, HV, 128, device="meta")
    cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32)
    hint = dict(max_seqlen=max(lengths), seqlens=lengths)

    def args(positions=torch.tensor([5, 9]), inv=False):
        return ServingArgs(None, None, "kv", positions, None, None, inv, False, 0)
    P.clear_plan_cache()
    plain = P.plan_call(q, v, cu, "auto", **hint).forward
    assert plain.split  # every row here splits as a plain call
    got = serving_plan(q, v, cu, args(), cp="auto", **hint).forward
    assert got.split == split == (plain.est_unsplit >= SERVING_CHECKPOINT_MIN_GAIN * plain.est_split)
    if not split:
        assert got == P.plan_call(q, v, cu, "off", **hint).forward
    for same in (serving_plan(q, v, cu, args(None), cp="auto", **hint),
                 serving_plan(q, v, cu, args(torch.tensor([], dtype=torch.int64)), cp="auto", **hint),
                 serving_plan(q, v, cu, args(), cp="on", **hint)):
        assert same.forward.split
    assert not serving_plan(q, v, cu, args(inv=True), cp="on", **hint).forward.split
    kept = serving_plan(q, v, cu, args(), cp="auto", on_kernel_path=lambda p: False, **hint)
    assert kept.forward.split  # off the kernel path an unsplit call's checkpoints cost more forwards
    trained = serving_plan(q, v, cu, args(), cp="auto", training=True, **hint)
    assert trained == P.plan_call(q, v, cu, "auto", training=True, keep_states=True, **hint)

"""Edge cases of the reference ops, the shared validation and the production op's pre-device checks (CPU).

For valid input the ops never crash, hang or return NaN, and match the fp64 token recurrence (or an
explicit independent computation) in the forward and in every gradient; invalid input gets an error
that names the argument. Regression tests for faults found this way are marked "regression" in their
docstrings, with what the code did before the fix.
"""

from __future__ import annotations

import math

import pytest
import torch

import flashqla
from flashqla.testing import BUDGETS, assert_close_rel, make_gdn_inputs, rel_rms
from flashqla.contract import check_gdn_inputs
from reference import chunk_gated_delta_rule, recurrent_gated_delta_rule
from reference.gdn.chunk import G_FLOOR
from reference.gdn.cp import cp_gated_delta_rule_fwd
from reference.gdn.fused import fused_gated_delta_rule_fwd

BUDGET = BUDGETS["reference_fp64"]
F64 = torch.float64
INPUTS = ("q", "k", "v", "g", "beta", "initial_state")
GRAD = dict(q="dq", k="dk", v="dv", g="dg", beta="dbeta", initial_state="dh0")
SIZES = dict(H=2, HV=4, K=8, V=6)


@pytest.fixture(autouse=True, scope="module")
def _one_thread():
    """These problems are tiny: one intra-op thread is faster, and far faster on a loaded machine
    (idle threads spin against other processes). Restored afterwards."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def _inputs(**kw) -> dict:
    for key, val in SIZES.items():
        kw.setdefault(key, val)
    return make_gdn_inputs(**kw)


def _f64(x: dict) -> dict:
    return {n: (t.to(F64) if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()}


def _cotangents(x: dict, seed: int = 0):
    gen = torch.Generator().manual_seed(100 + seed)
    B, T, HV, V = x["v"].shape
    N = B if x["cu_seqlens"] is None else x["cu_seqlens"].numel() - 1
    return torch.randn(B, T, HV, V, generator=gen, dtype=F64), torch.randn(N, HV, x["k"].shape[-1], V, generator=gen, dtype=F64)


def _run(fn, x: dict, do=None, dht=None, wrt=INPUTS, **kw) -> dict:
    """o, ht and the gradients of <o, do> + <ht, dht> with respect to `wrt` (autograd)."""
    leaves = {n: x[n].detach().requires_grad_(True) for n in wrt if x.get(n) is not None}  # strides kept
    o, ht = fn(**{**x, **leaves}, output_final_state=True, **kw)
    out = dict(o=o.detach(), ht=ht.detach())
    if do is not None:
        loss = (o * do.to(o.dtype)).sum() + (ht * dht.to(ht.dtype)).sum()
        if loss.requires_grad:
            grads = torch.autograd.grad(loss, list(leaves.values()), allow_unused=True)
        else:  # nothing to differentiate (the recurrence on an empty batch builds no graph)
            grads = [None] * len(leaves)
        for (n, leaf), d in zip(leaves.items(), grads):
            out[GRAD[n]] = torch.zeros_like(leaf) if d is None else d
    return out


def _check(got: dict, ref: dict, budget=BUDGET, what: str = "") -> None:
    """Every quantity finite and within `budget` (relative RMS; a float, or a dict per quantity as
    BUDGETS) of the reference; empty or all-zero references must be matched exactly."""
    for name, r in ref.items():
        x = got[name]
        assert x.shape == r.shape, f"{name}{what}: shape {tuple(x.shape)} vs {tuple(r.shape)}"
        assert bool(torch.isfinite(x).all()), f"{name}{what} is not finite"
        if r.numel() == 0 or not bool(r.any()):
            assert torch.equal(x.to(F64), r.to(F64)), f"{name}{what}: reference is zero, got max |x| = {x.abs().max()}"
        else:
            assert_close_rel(name + what, x, r, budget[name] if isinstance(budget, dict) else budget)


def _against_recurrence(x: dict, seed: int = 0, budget=BUDGET, **kw) -> dict:
    """The reference op vs autograd of the fp64 recurrence: o, ht and every gradient."""
    do, dht = _cotangents(x, seed)
    got = _run(chunk_gated_delta_rule, x, do, dht, **kw)
    ref = _run(recurrent_gated_delta_rule, _f64(x), do, dht, **kw)
    _check(got, ref, budget)
    return got


def _delta_rule_ungated(q, k, v, beta, scale, initial_state, cu_seqlens):
    """The ungated delta rule written independently of the project's code (fp64, token by token):
    S <- S + beta k (v - S^T k)^T, o = scale S^T q; value head h reads q/k head h // (HV // H)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cu = [0, T] if cu_seqlens is None else cu_seqlens.tolist()
    rows = [(b, cu[n], cu[n + 1], b if cu_seqlens is None else n) for b in range(B) for n in range(len(cu) - 1)]
    o = [[None] * T for _ in range(B)]
    finals = [None] * (B if cu_seqlens is None else len(cu) - 1)
    for b, s, e, n in rows:
        S = [initial_state[n, h] for h in range(HV)]
        for t in range(s, e):
            oh = []
            for h in range(HV):
                kt, qt = k[b, t, h // (HV // H)], q[b, t, h // (HV // H)]
                S[h] = S[h] + beta[b, t, h] * torch.outer(kt, v[b, t, h] - S[h].T @ kt)
                oh.append(scale * (S[h].T @ qt))
            o[b][t] = torch.stack(oh)
        finals[n] = torch.stack(S)
    zero = torch.zeros(HV, V, dtype=F64)
    return torch.stack([torch.stack([o[b][t] if o[b][t] is not None else zero for t in range(T)]) for b in range(B)]), torch.stack(finals)


# ----------------------------------------------------------------------------------------------
# Sequence shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [0, 1, 5, 63, 65, 130])
def test_lengths_not_a_multiple_of_the_chunk(T):
    """T = 0 (valid: empty output, final state = initial state, dh0 = dht), shorter than a chunk,
    and not a multiple of 64: forward and every gradient equal the recurrence's."""
    got = _against_recurrence(_inputs(B=2, T=T, seed=T))
    if T == 0:
        x = _inputs(B=2, T=0, seed=0)
        _, dht = _cotangents(x)
        assert torch.equal(got["ht"], x["initial_state"]) and torch.equal(got["dh0"], dht)


def test_empty_batch_b0():
    """B = 0 (no sequence): empty outputs from both ops. Regression: the recurrence raised
    'stack expects a non-empty TensorList' for its final state."""
    for T in (0, 10):
        x = _inputs(B=0, T=T)
        for fn in (recurrent_gated_delta_rule, chunk_gated_delta_rule):
            o, ht = fn(**x, output_final_state=True)
            assert o.shape == (0, T, 4, 6) and ht.shape == (0, 4, 8, 6)
        _against_recurrence(x)


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64])
@pytest.mark.parametrize(
    "lengths",
    [[3, 2, 1, 5], [0, 5, 70], [5, 0, 70], [5, 70, 0], [0, 0, 0], [0], [64, 0, 65, 1]],
    ids=["all-short", "empty-first", "empty-middle", "empty-last", "all-empty", "one-empty", "mixed"],
)
def test_varlen_edge_batches(lengths, cu_dtype):
    """Varlen with every sequence shorter than a chunk and with zero-length sequences first, middle,
    last and everywhere; cu_seqlens int32 and int64. An empty sequence's final state is its initial
    state and its dh0 is its dht (exactly)."""
    x = _inputs(B=1, T=sum(lengths), cu_seqlens=lengths, seed=len(lengths))
    x["cu_seqlens"] = x["cu_seqlens"].to(cu_dtype)
    got = _against_recurrence(x)
    _, dht = _cotangents(x)
    for n, length in enumerate(lengths):
        if length == 0:
            assert torch.equal(got["ht"][n], x["initial_state"][n]), f"final state of empty sequence {n}"
            assert torch.equal(got["dh0"][n], dht[n]), f"dh0 of empty sequence {n} is not its dht"


def test_packed_gradients_equal_each_sequence_alone():
    """Every output and gradient of a packed batch equals that of each sequence run alone."""
    lengths = [5, 0, 70, 64, 1]
    x = _inputs(B=1, T=sum(lengths), cu_seqlens=lengths, seed=3)
    do, dht = _cotangents(x)
    packed = _run(chunk_gated_delta_rule, x, do, dht)
    cu = x["cu_seqlens"].tolist()
    for n in range(len(lengths)):
        s, e = cu[n], cu[n + 1]
        alone = {m: x[m][:, s:e] for m in ("q", "k", "v", "g", "beta")}
        alone.update(initial_state=x["initial_state"][n : n + 1], cu_seqlens=None)
        got = _run(chunk_gated_delta_rule, alone, do[:, s:e], dht[n : n + 1])
        for name, t in got.items():
            ref = packed[name][n : n + 1] if name in ("ht", "dh0") else packed[name][:, s:e]
            assert torch.allclose(t, ref, rtol=1e-12, atol=1e-13), f"{name} of sequence {n} (length {e - s})"


# ----------------------------------------------------------------------------------------------
# Gates and beta
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("varlen", [False, True])
def test_zero_gate_is_the_ungated_delta_rule(varlen):
    """g == 0 everywhere equals the ungated delta rule, computed independently (forward, and every
    gradient by autograd of that computation)."""
    if varlen:
        x = _inputs(B=1, T=75, cu_seqlens=[5, 0, 70], gate="zero", special_heads=False, seed=4)
    else:
        x = _inputs(B=1, T=70, gate="zero", special_heads=False, seed=4)
    do, dht = _cotangents(x)
    got = _run(chunk_gated_delta_rule, x, do, dht)
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "beta", "initial_state")}
    o, ht = _delta_rule_ungated(**leaves, scale=8**-0.5, cu_seqlens=x["cu_seqlens"])
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), list(leaves.values()))
    ref = dict(o=o.detach(), ht=ht.detach(), **{GRAD[n]: d for n, d in zip(leaves, grads)})
    _check({n: got[n] for n in ref}, ref)
    assert bool(torch.isfinite(got["dg"]).all())
    _against_recurrence(x)  # dg too


def test_zero_gates_mixed_with_normal_gates():
    x = _inputs(B=1, T=130, seed=7)
    x["g"][:, ::3] = 0.0
    _against_recurrence(x)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gate", [-20.0, -70.0, -300.0])
def test_strong_per_token_gates(gate, dtype):
    """Per-token g of -20, -70, -300 (chunk cumulative exponents down to -19200, far below fp32's exp
    range): finite forward and gradients. fp64 within the fp64 budget; fp32 within 1e-5 wherever the
    true value is representable in fp32 (at -300, dg and dh0 are ~1e-130: they must flush to ~0)."""
    x = _inputs(B=1, T=130, gate=gate, special_heads=False, dtype=dtype, seed=8)
    if dtype == F64:
        _against_recurrence(x)
        return
    do, dht = _cotangents(x)
    got = _run(chunk_gated_delta_rule, x, do, dht)
    ref = _run(recurrent_gated_delta_rule, _f64(x), do, dht)
    for name, r in ref.items():
        assert bool(torch.isfinite(got[name]).all()), f"{name} not finite at g = {gate} (fp32)"
        if float(r.abs().max()) > 1e-30:
            assert_close_rel(f"{name} (fp32, g = {gate})", got[name], r, 1e-5)
        else:
            assert float(got[name].abs().max()) <= 1e-30, f"{name} should underflow to ~0 at g = {gate}"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
@pytest.mark.parametrize("gate", [-1e4, -1e30, -3e38])
def test_huge_negative_gate_token(gate, dtype):
    """One token with a finite g far below any exp range, amid normal gates; and (fp32) every token at
    -3e38. Regression: the chunk-local cumsum absorbed every later gate of the chunk (g = -1e30: decay
    1 instead of exp(sum g), o off by 44% even in fp64) or overflowed to -inf (two fp32 tokens of
    -3e38: NaN everywhere). Gates are now floored at G_FLOOR (exp(G_FLOOR) == 0 in fp64) before the
    cumsum; dg of a floored token is exactly 0, as the recurrence's."""
    x = _inputs(B=1, T=130, gate="logsigmoid", dtype=dtype, seed=9)
    x["g"][:, 10] = gate
    budget = BUDGET if dtype == F64 else 1e-4  # fp32: |g_cum| ~ 1000 costs ~1e-5 (FLA's algorithm)
    got = _against_recurrence(x, budget=budget)
    assert bool((got["dg"][:, 10] == 0).all()), "dg of a floored token"
    if dtype == torch.float32 and gate == -3e38:
        x = _inputs(B=1, T=130, gate=gate, special_heads=False, dtype=dtype, seed=9)
        do, dht = _cotangents(x)
        got = _run(chunk_gated_delta_rule, x, do, dht)
        ref = _run(recurrent_gated_delta_rule, _f64(x), do, dht)
        _check(got, ref, budget=1e-5)


def test_huge_negative_gate_token_fused_and_cp():
    """The same fault in the rewritten forward and the context-parallel simulation (regression: o off
    by 33% at one g = -1e30 token)."""
    x = _inputs(B=1, T=200, seed=10)
    x["g"][:, 10] = -1e30
    o_ref, ht_ref = recurrent_gated_delta_rule(**x, output_final_state=True)
    for state_update in ("direct", "xy"):
        _, o, _, ht, _, _ = fused_gated_delta_rule_fwd(**x, output_final_state=True, state_update=state_update)
        assert_close_rel(f"o (fused, {state_update})", o, o_ref, BUDGET["o"])
        assert_close_rel(f"ht (fused, {state_update})", ht, ht_ref, BUDGET["ht"])
    o, ht = cp_gated_delta_rule_fwd(**x, output_final_state=True, segment_len=128)
    assert_close_rel("o (cp)", o, o_ref, BUDGET["o"])
    assert_close_rel("ht (cp)", ht, ht_ref, BUDGET["ht"])
    assert G_FLOOR < -745.2 and math.exp(G_FLOOR) == 0.0  # the floor changes no decay in fp64


def test_beta_zero_is_pure_decay():
    """beta == 0: nothing is written; o_t = scale exp(G_t) S0^T q_t with G_t the cumulative g from the
    sequence start, final = exp(G_T) S0 (closed form). Gradients against the recurrence."""
    x = _inputs(B=2, T=70, seed=11)
    x["beta"].zero_()
    o, ht = chunk_gated_delta_rule(**x, output_final_state=True)
    G = x["g"].cumsum(1)  # [B, T, HV]
    qe = x["q"].repeat_interleave(2, dim=2)
    o_ref = 8**-0.5 * G.exp()[..., None] * torch.einsum("bhkv,bthk->bthv", x["initial_state"], qe)
    _check(dict(o=o, ht=ht), dict(o=o_ref, ht=G[:, -1].exp()[..., None, None] * x["initial_state"]))
    _against_recurrence(x)


def test_beta_one_and_mixed():
    x = _inputs(B=2, T=130, seed=12)
    x["beta"].fill_(1.0)
    _against_recurrence(x)
    x["beta"][:, ::2] = 0.0
    _against_recurrence(x)
    x = _inputs(B=1, T=70, gate="zero", special_heads=False, seed=13)  # beta 1, one repeated key: I - k k^T
    x["beta"].fill_(1.0)
    x["k"][:] = x["k"][:, :1]
    _against_recurrence(x)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_inputs_large_state_tiny_dht(dtype):
    """16-bit q, k, v with an initial state of scale 1e4 (o and dq stay inside fp16's range) and a
    dht of 1e-30: no inf, no NaN; o and the fp32 final state as accurate as the rounding allows."""
    x = _inputs(B=2, T=70, dtype=dtype, state_scale=1e4, seed=14)
    do, _ = _cotangents(x)
    _, dht = _cotangents(x)
    dht = torch.full_like(dht, 1e-30)
    got = _run(chunk_gated_delta_rule, x, do, dht)
    ref = _run(recurrent_gated_delta_rule, _f64(x), do.to(dtype).to(F64), dht)
    for name, t in got.items():
        assert bool(torch.isfinite(t).all()), f"{name} not finite ({dtype})"
    assert_close_rel("o", got["o"], ref["o"], 1e-2)
    assert_close_rel("ht", got["ht"], ref["ht"], 1e-5)
    assert_close_rel("dh0", got["dh0"], ref["dh0"], 1e-5)


# ----------------------------------------------------------------------------------------------
# Layout, devices, dtypes, head dims, scale
# ----------------------------------------------------------------------------------------------


def _views(x: dict, mode: str) -> dict:
    """The same values as x through non-contiguous views."""
    y = dict(x)
    if mode == "transposed":
        for n in ("q", "k", "v", "g"):
            y[n] = x[n].transpose(1, 2).contiguous().transpose(1, 2)
        y["beta"] = x["beta"].transpose(0, 2).contiguous().transpose(0, 2)
        y["initial_state"] = x["initial_state"].transpose(-1, -2).contiguous().transpose(-1, -2)
    elif mode == "sliced":
        for n in ("q", "k", "v", "g", "beta"):
            big = torch.zeros(x[n].shape[0], 2 * x[n].shape[1], *x[n].shape[2:], dtype=x[n].dtype)
            big[:, 1::2] = x[n]
            y[n] = big[:, 1::2]
    else:  # expanded: stride 0 along a dimension
        y["q"] = x["q"][:1].expand_as(x["q"])
        y["v"] = x["v"][:, :, :1].expand_as(x["v"])
        y["g"] = x["g"][:, :1].expand_as(x["g"])
        y["beta"] = x["beta"][:1, :1].expand_as(x["beta"])
        y["initial_state"] = x["initial_state"][:1].expand_as(x["initial_state"])
    return y


@pytest.mark.parametrize("mode", ["transposed", "sliced", "expanded"])
def test_non_contiguous_inputs_give_the_contiguous_result(mode):
    """Views give bit for bit the result of their contiguous copies, forward and gradients (also for
    an expanded do, as o.sum() gives). Regression (transposed): the state pass cloned a transposed
    initial_state with its strides and the products took other BLAS paths, o and dq ~1e-16 apart in
    fp64; the op now makes its inputs contiguous first."""
    x = _inputs(B=2, T=70, seed=15)
    y = _views(x, mode)
    assert not all(t.is_contiguous() for t in y.values() if isinstance(t, torch.Tensor))
    yc = {n: (t.contiguous() if isinstance(t, torch.Tensor) else t) for n, t in y.items()}
    do, dht = _cotangents(x)
    a, b = _run(chunk_gated_delta_rule, y, do, dht), _run(chunk_gated_delta_rule, yc, do, dht)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} depends on the memory layout ({mode})"
    do_expanded = do[:1, :1].expand_as(do)
    a, b = _run(chunk_gated_delta_rule, y, do_expanded, dht), _run(chunk_gated_delta_rule, yc, do_expanded.contiguous(), dht)
    for name in a:
        assert torch.equal(a[name], b[name]), f"{name} depends on the layout of do ({mode})"
    _check(a, _run(recurrent_gated_delta_rule, yc, do_expanded, dht))


def _small(varlen: bool = False) -> dict:
    x = _inputs(B=1, T=8, cu_seqlens=[3, 0, 5], seed=0) if varlen else _inputs(B=2, T=8, seed=0)
    return x


def _shared(**x):
    return check_gdn_inputs(*(x.get(n) for n in ("q", "k", "v", "g", "beta", "scale", "initial_state")), check_values=True)


REFERENCE_ENTRIES = {"check_gdn_inputs": _shared, "chunk": chunk_gated_delta_rule, "recurrent": recurrent_gated_delta_rule}


@pytest.mark.parametrize("entry", list(REFERENCE_ENTRIES))
@pytest.mark.parametrize("dtype", [torch.int32, torch.bool, torch.complex64])
@pytest.mark.parametrize("name", INPUTS)
def test_wrong_dtype_named(name, dtype, entry):
    x = _small()
    x[name] = x[name].to(dtype)
    with pytest.raises(TypeError, match=rf"^{name} must be a floating-point tensor"):
        REFERENCE_ENTRIES[entry](**x)


@pytest.mark.parametrize("entry", list(REFERENCE_ENTRIES))
def test_all_tensors_on_meta_clear_error(entry):
    """Every tensor on the meta device (one device, no values) where values are checked. Regression:
    'Tensor.item() cannot be called on meta tensors' (naming nothing)."""
    x = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in _small().items()}
    with pytest.raises(ValueError, match=r"^g is on the meta device, which holds no values"):
        REFERENCE_ENTRIES[entry](**x)
    y = {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in _small(varlen=True).items()}
    with pytest.raises(ValueError, match=r"^cu_seqlens is on the meta device, which holds no values"):
        check_gdn_inputs(*(y[n] for n in ("q", "k", "v", "g", "beta")), cu_seqlens=y["cu_seqlens"], check_values=True)


@pytest.mark.parametrize("name", INPUTS)
def test_one_tensor_on_another_device_named(name):
    x = _small()
    x[name] = x[name].to("meta")
    with pytest.raises(ValueError, match=rf"\b{name} is on meta|{name} is on cpu but q is on meta"):
        chunk_gated_delta_rule(**x)


@pytest.mark.parametrize("H, HV", [(4, 2), (8, 4), (3, 4)])
def test_value_heads_must_be_a_multiple_of_qk_heads(H, HV):
    q = torch.randn(1, 8, H, 8, dtype=F64)
    x = _inputs(B=1, T=8, H=1, HV=HV)
    x.update(q=q, k=q.clone())
    with pytest.raises(ValueError, match=rf"value-head count HV = {HV} \(v\.shape\[2\]\) must be a multiple of the q/k head count H = {H}"):
        chunk_gated_delta_rule(**x)


@pytest.mark.parametrize("K, V", [(1, 1), (3, 200), (1, 5), (200, 1)])
def test_head_dims_outside_the_fast_path(K, V):
    """The reference handles any K, V (with and without the in-kernel L2 norm)."""
    x = _inputs(B=1, T=40, H=1, HV=2, K=K, V=V, seed=K + V)
    _against_recurrence(x)
    _against_recurrence(x, use_qk_l2norm_in_kernel=True)


@pytest.mark.parametrize(
    "scale, exc, pattern",
    [
        (torch.tensor(0.5), TypeError, r"^scale must be None or a real number, got Tensor"),
        (True, TypeError, r"^scale must be None or a real number, got bool"),
        (math.nan, ValueError, r"^scale must be finite, got nan"),
        (-math.inf, ValueError, r"^scale must be finite, got -inf"),
        (10**400, ValueError, r"^scale must be finite, got an int beyond the float range"),
    ],
    ids=["tensor", "bool", "nan", "-inf", "huge-int"],
)
def test_bad_scale_named(scale, exc, pattern):
    """Regression (huge-int): float(10**400) raised a bare OverflowError naming nothing."""
    for entry in (chunk_gated_delta_rule, recurrent_gated_delta_rule):
        with pytest.raises(exc, match=pattern):
            entry(**_small(), scale=scale)


def test_valid_scales_accepted():
    x = _small()
    o, _ = chunk_gated_delta_rule(**x, scale=0)
    assert not bool(o.any())
    for s in (2, -0.25, 1e-30):
        o, _ = chunk_gated_delta_rule(**x, scale=s)
        assert_close_rel(f"o (scale {s})", o, recurrent_gated_delta_rule(**x, scale=s)[0], BUDGET["o"])


# ----------------------------------------------------------------------------------------------
# The production op: rejected before any device work
# ----------------------------------------------------------------------------------------------


@pytest.fixture
def no_device_work(monkeypatch):
    """Makes any kernel build or launch fail loudly: the checks must come first."""
    import flashqla.ops.gdn.backend as backend
    import flashqla.ops.gdn.kernels.sm90.prepare as prepare
    import flashqla.ops.gdn.kernels.sm90.recurrent as recurrent
    import flashqla.ops.gdn.kernels.sm90.registry as registry

    def boom(*a, **k):
        raise AssertionError("device work started before the argument checks")

    monkeypatch.setattr(registry, "build", boom)
    monkeypatch.setattr(registry, "build_kernels", boom)
    monkeypatch.setattr(prepare, "chunk_prepare_fwd", boom)
    monkeypatch.setattr(recurrent, "chunk_recurrent_fwd", boom)
    # the backend binds the launchers at import: patch its names too
    monkeypatch.setattr(backend, "chunk_prepare_fwd", boom)
    monkeypatch.setattr(backend, "chunk_recurrent_fwd", boom)
    monkeypatch.setattr(backend, "chunk_recurrent_dual", boom)


def _prod(**kw):
    d = dict(B=2, T=8, H=2, HV=4, K=128, V=128, dtype=torch.bfloat16, seed=0)
    d.update(kw)
    return make_gdn_inputs(**d)


def _with(x: dict, **changes) -> dict:
    return {**x, **changes}


PROD_CASES = [
    ("K=1 V=1", lambda: _prod(K=1, V=1), ValueError, r"supports head dims K = V = 128 \(chunk size 64\), got K = 1, V = 1"),
    ("K=3 V=200", lambda: _prod(K=3, V=200), ValueError, r"supports head dims K = V = 128.*got K = 3, V = 200"),
    ("K=64", lambda: _prod(K=64), ValueError, r"supports head dims K = V = 128.*got K = 64, V = 128"),
    ("q fp32", lambda: _prod(dtype=torch.float32), TypeError, r"supports q, k, v in bfloat16 or float16, got torch\.float32"),
    ("q fp64", lambda: _prod(dtype=F64), TypeError, r"supports q, k, v in bfloat16 or float16, got torch\.float64"),
    ("g bf16", lambda: (lambda x: _with(x, g=x["g"].bfloat16()))(_prod()), TypeError, r"supports g in float32"),
    ("beta fp64", lambda: (lambda x: _with(x, beta=x["beta"].double()))(_prod()), TypeError, r"supports beta in float32 or q's dtype"),
    ("h0 bf16", lambda: (lambda x: _with(x, initial_state=x["initial_state"].bfloat16()))(_prod()), TypeError, r"supports initial_state in float32"),
    ("q int", lambda: (lambda x: _with(x, q=x["q"].int()))(_prod()), TypeError, r"^q must be a floating-point tensor"),
    ("HV % H", lambda: (lambda x: _with(x, q=x["q"][:, :, :1].repeat(1, 1, 3, 1), k=x["k"][:, :, :1].repeat(1, 1, 3, 1)))(_prod()), ValueError, r"must be a multiple of the q/k head count H = 3"),
    ("g positive (CPU)", lambda: (lambda x: _with(x, g=x["g"].abs() + 0.5))(_prod()), ValueError, r"^g must be <= 0"),
    ("g nan (CPU)", lambda: (lambda x: _with(x, g=x["g"].fill_(math.nan)))(_prod()), ValueError, r"^g must not be NaN"),
    ("g on meta", lambda: (lambda x: _with(x, g=x["g"].to("meta")))(_prod()), ValueError, r"^g is on meta but q is on cpu"),
    ("scale bool", lambda: _with(_prod(), scale=True), TypeError, r"^scale must be None or a real number"),
    ("cu_seqlens end", lambda: _with(_prod(B=1, T=8, cu_seqlens=[3, 5]), cu_seqlens=torch.tensor([0, 3, 9], dtype=torch.int32)), ValueError, r"^cu_seqlens must end at T = 8"),
    ("CPU tensors", lambda: _prod(), RuntimeError, r"runs on a CUDA device of compute capability 9\.0 \(Hopper\); the inputs are on cpu"),
    ("CPU, T = 0", lambda: _prod(T=0), RuntimeError, r"runs on a CUDA device of compute capability 9\.0"),
    ("CPU varlen int64", lambda: (lambda x: _with(x, cu_seqlens=x["cu_seqlens"].long()))(_prod(B=1, T=8, cu_seqlens=[0, 8, 0])), RuntimeError, r"runs on a CUDA device"),
    ("all on meta", lambda: {n: (t.to("meta") if isinstance(t, torch.Tensor) else t) for n, t in _prod().items()}, RuntimeError, r"runs on a CUDA device.*the inputs are on meta"),
]


@pytest.mark.parametrize("case", PROD_CASES, ids=[c[0] for c in PROD_CASES])
def test_production_op_rejects_before_device_work(case, no_device_work):
    _, make, exc, pattern = case
    x = make()
    with torch.no_grad():
        with pytest.raises(exc, match=pattern):
            flashqla.chunk_gated_delta_rule(**x)
        with pytest.raises(exc, match=pattern):
            flashqla.ops.gdn.fwd.chunk_gated_delta_rule_fwd(**x)


def test_production_op_grad_request_on_cpu_gets_the_device_error(no_device_work):
    x = _prod()
    x["q"].requires_grad_(True)
    with pytest.raises(RuntimeError, match=r"CUDA device of compute capability 9.0"):
        flashqla.chunk_gated_delta_rule(**x)


# ----------------------------------------------------------------------------------------------
# Gradients
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("wrt", [("q",), ("g",), ("initial_state",), ("k", "beta"), ("v", "g", "initial_state")])
def test_requires_grad_on_some_inputs(wrt):
    x = _inputs(B=1, T=70, seed=16)
    do, dht = _cotangents(x)
    full = _run(chunk_gated_delta_rule, x, do, dht)
    some = _run(chunk_gated_delta_rule, x, do, dht, wrt=wrt)
    for n in wrt:
        assert torch.equal(some[GRAD[n]], full[GRAD[n]]), GRAD[n]


def test_only_one_output_used():
    x = _inputs(B=2, T=70, seed=17)
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in INPUTS}
    o, ht = chunk_gated_delta_rule(**{**x, **leaves}, output_final_state=True)
    ht.sum().backward()  # do is None
    assert not bool(leaves["q"].grad.any()) and bool(leaves["initial_state"].grad.any())
    leaves2 = {n: x[n].detach().clone().requires_grad_(True) for n in INPUTS}
    o, ht = chunk_gated_delta_rule(**{**x, **leaves2}, output_final_state=False)
    assert ht is None
    o.sum().backward()
    for n in INPUTS:
        assert bool(torch.isfinite(leaves2[n].grad).all())


def test_second_derivative_raises_never_silent():
    """Double backward is not supported; every way of asking for it must raise, never return None
    or zeros. Regression: with once_differentiable, torch.autograd.grad(dk, k, allow_unused=True)
    returned None and materialize_grads=True returned zeros (the recurrence gives a nonzero value)."""
    x = _inputs(B=1, T=20, H=1, HV=2, K=4, V=3, gate="logsigmoid", special_heads=False, seed=18)
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in INPUTS}
    o, _ = chunk_gated_delta_rule(**{**x, **leaves})
    dk = torch.autograd.grad((o**2).sum(), leaves["k"], create_graph=True)[0]
    for n in ("k", "q", "g"):
        with pytest.raises(NotImplementedError, match=r"has no second derivative"):
            torch.autograd.grad(dk.sum(), leaves[n], allow_unused=True)
        with pytest.raises(NotImplementedError, match=r"has no second derivative"):
            torch.autograd.grad(dk.sum(), leaves[n], materialize_grads=True)
    with pytest.raises(NotImplementedError, match=r"has no second derivative"):
        dk.sum().backward()
    # a mixed derivative through the cotangent alone (an expanded leaf w, o.sum()-style do)
    w = torch.randn(1, 1, 2, 3, dtype=F64).expand(o.shape).detach().requires_grad_(True)
    o, _ = chunk_gated_delta_rule(**{**x, **leaves})
    dq = torch.autograd.grad((o * w).sum(), leaves["q"], create_graph=True)[0]
    with pytest.raises(NotImplementedError, match=r"has no second derivative"):
        torch.autograd.grad(dq.sum(), w, allow_unused=True)
    # the recurrence's second derivative is not zero: None or 0 above would have been wrong
    rl = {n: x[n].detach().clone().requires_grad_(True) for n in INPUTS}
    o_r, _ = recurrent_gated_delta_rule(**{**x, **rl})
    dk_r = torch.autograd.grad((o_r**2).sum(), rl["k"], create_graph=True)[0]
    assert float(torch.autograd.grad(dk_r.sum(), rl["k"])[0].abs().max()) > 1e-3
    # first-order gradients built with create_graph=True are still right
    assert_close_rel("dk (create_graph=True)", dk, dk_r, BUDGET["dk"])


def test_first_order_with_create_graph_and_constant_cotangent():
    """create_graph=True with a cotangent that needs no grad (so the backward sees no grad-requiring
    do): first-order gradients equal the plain backward's."""
    x = _inputs(B=2, T=70, seed=19)
    do, dht = _cotangents(x)
    plain = _run(chunk_gated_delta_rule, x, do, dht)
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in INPUTS}
    o, ht = chunk_gated_delta_rule(**{**x, **leaves}, output_final_state=True)
    grads = torch.autograd.grad((o * do).sum() + (ht * dht).sum(), list(leaves.values()), create_graph=True)
    for n, d in zip(leaves, grads):
        assert torch.equal(d.detach(), plain[GRAD[n]]), GRAD[n]


def test_positive_and_non_finite_gates_rejected_with_grad():
    """Documented in flashqla/contract.py: g > 0 (+inf included) and NaN g are rejected (before any
    graph); g = -inf is valid ("forget everything", tests/test_reliability.py)."""
    x = _small()
    for bad, pattern in ((0.25, r"^g must be <= 0"), (math.nan, r"^g must not be NaN"), (math.inf, r"^g must be <= 0")):
        g = x["g"].clone()
        g[0, 3, 1] = bad
        g.requires_grad_(True)
        for entry in (chunk_gated_delta_rule, recurrent_gated_delta_rule, fused_gated_delta_rule_fwd, cp_gated_delta_rule_fwd):
            with pytest.raises(ValueError, match=pattern):
                entry(**{**x, "g": g})

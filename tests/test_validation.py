"""Every error raised by flashqla.contract, through the shared check and through the reference ops;
each message names the offending argument (CPU)."""

from __future__ import annotations

import math

import pytest
import torch

from flashqla.testing import make_gdn_inputs
from flashqla.contract import check_gdn_inputs
from reference import chunk_gated_delta_rule, recurrent_gated_delta_rule
from reference.gdn.chunk import chunk_gated_delta_rule_fwd

ARGS = ("q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens")


def _base(varlen: bool = False) -> dict:
    """Valid inputs: B=1 (or 2 without varlen), T=8, H=2, HV=4, K=4, V=3."""
    if varlen:
        x = make_gdn_inputs(B=1, T=8, H=2, HV=4, K=4, V=3, cu_seqlens=[3, 0, 5], seed=0)
    else:
        x = make_gdn_inputs(B=2, T=8, H=2, HV=4, K=4, V=3, seed=0)
    x["scale"] = None
    x["output_final_state"] = True
    return x


def _cu(values, dtype=torch.int32):
    return torch.tensor(values, dtype=dtype)


# (id, varlen base, {argument: new value} or a function of the base dict, exception, message regex)
CASES = [
    # object kind, rank and dtype (flashqla.contract._tensor)
    ("q-not-tensor", False, lambda x: {"q": x["q"].tolist()}, TypeError, r"^q must be a torch\.Tensor"),
    ("k-rank", False, lambda x: {"k": x["k"][0]}, ValueError, r"^k must have 4 dimensions"),
    ("v-int-dtype", False, lambda x: {"v": x["v"].to(torch.int32)}, TypeError, r"^v must be a floating-point tensor"),
    ("g-rank", False, lambda x: {"g": x["g"][..., 0]}, ValueError, r"^g must have 3 dimensions"),
    ("beta-not-tensor", False, lambda x: {"beta": 0.5}, TypeError, r"^beta must be a torch\.Tensor"),
    # shapes
    ("k-shape", False, lambda x: {"k": x["k"][..., :3]}, ValueError, r"^q and k must have the same shape"),
    ("v-batch-time", False, lambda x: {"v": x["v"][:, :5]}, ValueError, r"^v must be \[B, T, HV, V\]"),
    ("zero-head-dim", False, lambda x: {"q": x["q"][..., :0], "k": x["k"][..., :0]}, ValueError, r"head counts and head dims must be positive: H=2, K=0"),
    ("hv-not-multiple-of-h", False, lambda x: {"v": x["v"][:, :, :3], "g": x["g"][..., :3], "beta": x["beta"][..., :3]}, ValueError, r"value-head count HV = 3 \(v\.shape\[2\]\) must be a multiple of the q/k head count H = 2"),
    ("g-shape", False, lambda x: {"g": x["g"][..., :2]}, ValueError, r"^g must be \[B, T, HV\]"),
    ("beta-shape", False, lambda x: {"beta": x["beta"][:, :7]}, ValueError, r"^beta must be \[B, T, HV\]"),
    ("qkv-dtypes", False, lambda x: {"v": x["v"].float()}, TypeError, r"^q, k and v must share one dtype"),
    # devices
    ("g-device", False, lambda x: {"g": x["g"].to("meta")}, ValueError, r"^g is on meta but q is on cpu"),
    ("initial_state-device", False, lambda x: {"initial_state": x["initial_state"].to("meta")}, ValueError, r"^initial_state is on meta"),
    ("cu_seqlens-device", True, lambda x: {"cu_seqlens": x["cu_seqlens"].to("meta")}, ValueError, r"^cu_seqlens is on meta"),
    # scale and output_final_state
    ("scale-str", False, {"scale": "0.5"}, TypeError, r"^scale must be None or a real number, got str"),
    ("scale-bool", False, {"scale": True}, TypeError, r"^scale must be None or a real number, got bool"),
    ("scale-tensor", False, {"scale": torch.tensor(0.5)}, TypeError, r"^scale must be None or a real number, got Tensor"),
    ("scale-inf", False, {"scale": math.inf}, ValueError, r"^scale must be finite"),
    ("scale-nan", False, {"scale": math.nan}, ValueError, r"^scale must be finite"),
    ("output_final_state-int", False, {"output_final_state": 1}, TypeError, r"^output_final_state must be a bool, got int"),
    # cu_seqlens
    ("cu_seqlens-list", True, {"cu_seqlens": [0, 3, 3, 8]}, TypeError, r"^cu_seqlens must be None or an int32/int64 tensor"),
    ("cu_seqlens-float", True, {"cu_seqlens": torch.tensor([0.0, 3.0, 3.0, 8.0])}, TypeError, r"^cu_seqlens must have dtype int32 or int64"),
    ("cu_seqlens-2d", True, {"cu_seqlens": _cu([[0, 8]])}, ValueError, r"^cu_seqlens must be 1-D with at least 2 entries"),
    ("cu_seqlens-one-entry", True, {"cu_seqlens": _cu([0])}, ValueError, r"^cu_seqlens must be 1-D with at least 2 entries"),
    ("cu_seqlens-batch", False, {"cu_seqlens": _cu([0, 3, 8]), "initial_state": None}, ValueError, r"^cu_seqlens \(packed variable-length input\) requires B == 1, got B = 2"),
    ("cu_seqlens-start", True, {"cu_seqlens": _cu([1, 3, 3, 8])}, ValueError, r"^cu_seqlens must start at 0, got cu_seqlens\[0\] = 1"),
    ("cu_seqlens-decreasing", True, {"cu_seqlens": _cu([0, 5, 3, 8], torch.int64)}, ValueError, r"^cu_seqlens must be non-decreasing, got cu_seqlens\[1\] = 5 > cu_seqlens\[2\] = 3"),
    ("cu_seqlens-end", True, {"cu_seqlens": _cu([0, 3, 3, 7])}, ValueError, r"^cu_seqlens must end at T = 8"),
    # initial_state
    ("initial_state-not-tensor", False, lambda x: {"initial_state": x["initial_state"].tolist()}, TypeError, r"^initial_state must be a torch\.Tensor"),
    ("initial_state-rank", False, lambda x: {"initial_state": x["initial_state"][0]}, ValueError, r"^initial_state must have 4 dimensions"),
    ("initial_state-int-dtype", False, lambda x: {"initial_state": x["initial_state"].to(torch.int64)}, TypeError, r"^initial_state must be a floating-point tensor"),
    ("initial_state-count", True, lambda x: {"initial_state": x["initial_state"][:2]}, ValueError, r"^initial_state must be \[N, HV, K, V\] = \(3, 4, 4, 3\) \(N = number of sequences\)"),
    ("initial_state-dims", False, lambda x: {"initial_state": x["initial_state"].transpose(-1, -2)}, ValueError, r"^initial_state must be \[N, HV, K, V\] = \(2, 4, 4, 3\)"),
    # gate values (check_values=True; always for a CPU g)
    ("g-positive", False, lambda x: {"g": x["g"].index_fill(1, torch.tensor([3]), 0.25)}, ValueError, r"^g must be <= 0 \(natural-log decay per token\); got max\(g\) = 0\.25"),
    ("g-nan", False, lambda x: {"g": x["g"].index_fill(1, torch.tensor([3]), math.nan)}, ValueError, r"^g must not be NaN"),
    # g = -inf is valid ("forget everything", flashqla.contract.G_FLOOR; tests/test_reliability.py); +inf is g > 0
    ("g-pos-inf", False, lambda x: {"g": x["g"].index_fill(1, torch.tensor([0]), math.inf)}, ValueError, r"^g must be <= 0"),
]


def _apply(case):
    _, varlen, change, _, _ = case
    x = _base(varlen)
    x.update(change(x) if callable(change) else change)
    return x


def _shared_check(**x):
    return check_gdn_inputs(*(x[n] for n in ARGS), check_values=True)


ENTRY_POINTS = {
    "check_gdn_inputs": _shared_check,
    "chunk_gated_delta_rule": chunk_gated_delta_rule,
    "chunk_gated_delta_rule_fwd": chunk_gated_delta_rule_fwd,
    "recurrent_gated_delta_rule": recurrent_gated_delta_rule,
}


@pytest.mark.parametrize("entry", list(ENTRY_POINTS))
@pytest.mark.parametrize("case", CASES, ids=[c[0] for c in CASES])
def test_each_error_names_its_argument(case, entry):
    _, _, _, exc, pattern = case
    x = _apply(case)
    with pytest.raises(exc, match=pattern):
        ENTRY_POINTS[entry](**x)


@pytest.mark.parametrize("varlen", [False, True])
def test_valid_base_passes(varlen):
    """The base inputs of the table are valid: every failure above comes from the one change."""
    x = _base(varlen)
    d = _shared_check(**x)
    assert (d.B, d.T, d.H, d.HV, d.K, d.V, d.N) == ((1, 8, 2, 4, 4, 3, 3) if varlen else (2, 8, 2, 4, 4, 3, 2))
    assert d.group == 2
    o, ht = chunk_gated_delta_rule(**x)
    assert o.shape == (d.B, 8, 4, 3) and ht.shape == (d.N, 4, 4, 3)


def test_positive_g_rejected_by_the_reference_before_any_work():
    """Positive g is outside the domain: the reference op rejects it (checks run before any work,
    so no gradient graph is built)."""
    x = _base()
    x["g"] = x["g"].abs() + 1e-3
    q = x["q"].clone().requires_grad_(True)
    with pytest.raises(ValueError, match=r"^g must be <= 0"):
        chunk_gated_delta_rule(**{**x, "q": q})
    assert q.grad is None
    # a CPU g is checked even without check_values (reading it costs no sync)
    with pytest.raises(ValueError, match=r"^g must be <= 0"):
        check_gdn_inputs(*(x[n] for n in ARGS))
    # g == 0 everywhere is valid (no decay)
    x["g"] = torch.zeros_like(x["g"])
    chunk_gated_delta_rule(**x)


def test_cpu_cu_seqlens_values_checked_without_check_values():
    x = _base(varlen=True)
    x["cu_seqlens"] = _cu([0, 3, 3, 9])
    with pytest.raises(ValueError, match=r"^cu_seqlens must end at T = 8"):
        check_gdn_inputs(*(x[n] for n in ARGS))


def test_reference_op_own_arguments():
    x = _base()
    with pytest.raises(TypeError, match=r"^use_qk_l2norm_in_kernel must be a bool"):
        chunk_gated_delta_rule(**x, use_qk_l2norm_in_kernel=1)
    for bad in (0, -16, 16.0, True):
        with pytest.raises(ValueError, match=r"^chunk_size must be a positive int"):
            chunk_gated_delta_rule(**x, chunk_size=bad)


def test_recorded_fla_errors_cover_the_gpu_cases_by_node_id(monkeypatch):
    # the GPU tests fall back to FLA's recorded errors when FLA is not run: the keys must be the
    # tests' node ids, and every entry a positive error per quantity the test checks
    import re

    from flashqla.testing import FLA_ERRORS, fla_errors_for

    fwd = {"o", "ht"}
    bwd = {"dq", "dk", "dv", "dg", "dbeta", "dh0"}
    for key, errs in FLA_ERRORS.items():
        m = re.fullmatch(r"tests/gpu/(test_fwd_gpu|test_bwd_gpu)\.py::test_lengths\[(\d+)\]", key)
        assert m, key
        assert set(errs) == (fwd if m.group(1) == "test_fwd_gpu" else bwd), key
        assert all(0 < e < 2e-2 for e in errs.values()), key  # FLA dg at T = 4096: 1.2e-2
    monkeypatch.setenv("PYTEST_CURRENT_TEST", "tests/gpu/test_bwd_gpu.py::test_lengths[63] (call)")
    assert fla_errors_for()["dg"] == FLA_ERRORS["tests/gpu/test_bwd_gpu.py::test_lengths[63]"]["dg"]
    assert fla_errors_for("tests/gpu/test_bwd_gpu.py::test_varlen[h0-single]") is None



def test_recorded_fla_sweep_errors_cover_the_gpu_sweep():
    # tests/gpu/test_bwd_gpu.py::test_against_fla_over_seeds fails on a case missing from the table
    # (SWEEP_LENGTHS x SWEEP_SEEDS there, seed 1000 i + T): every key present, every error positive,
    # and the seed-T cases agree with the per-test table
    from flashqla.testing import FLA_BWD_SWEEP_ERRORS, FLA_ERRORS

    from pathlib import Path

    src = (Path(__file__).resolve().parent / "gpu" / "test_bwd_gpu.py").read_text()
    assert "SWEEP_LENGTHS = (63, 64, 65, 4096)" in src and "SWEEP_SEEDS = 5" in src
    assert set(FLA_BWD_SWEEP_ERRORS) == {(T, 1000 * i + T) for T in (63, 64, 65, 4096) for i in range(5)}
    for key, errs in FLA_BWD_SWEEP_ERRORS.items():
        assert set(errs) == {"dq", "dk", "dv", "dg", "dbeta", "dh0"} and all(0 < e < 2e-2 for e in errs.values()), key
    for T in (63, 64, 65, 4096):
        per_test = FLA_ERRORS[f"tests/gpu/test_bwd_gpu.py::test_lengths[{T}]"]
        assert all(abs(FLA_BWD_SWEEP_ERRORS[(T, T)][n] / per_test[n] - 1) < 1e-3 for n in per_test), T

def test_add_cotangents_shapes_and_seed():
    from flashqla.testing import add_cotangents, make_gdn_inputs

    x = add_cotangents(make_gdn_inputs(B=1, T=70, H=1, HV=2, K=16, V=8, seqlens=[30, 0, 40], seed=3), 4)
    assert x["do"].shape == (1, 70, 2, 8) and x["dht"].shape == (3, 2, 16, 8)
    gen = torch.Generator().manual_seed(4)  # drawn in this order from this seed
    assert torch.equal(x["do"], torch.randn(1, 70, 2, 8, generator=gen, dtype=torch.float64))
    assert torch.equal(x["dht"], torch.randn(3, 2, 16, 8, generator=gen, dtype=torch.float64))


# --- planning_max_seqlen: the host copy of cu_seqlens (FLA's cu_seqlens_cpu) ----------------------


def test_planning_max_seqlen_rounds_the_longest_sequence_up_to_chunks():
    from flashqla.contract import planning_max_seqlen

    cu = torch.tensor([0, 5, 5, 200, 300])
    assert planning_max_seqlen(None, cu, 300) is None
    assert planning_max_seqlen(cu, cu, 300) == 256  # 195 tokens -> 4 chunks
    assert planning_max_seqlen(torch.tensor([0, 64], dtype=torch.int32), torch.tensor([0, 64]), 64) == 64


@pytest.mark.parametrize(
    "hint, err, match",
    [
        ([0, 5, 300], TypeError, "CPU tensor"),  # a list, not a tensor
        ("float", TypeError, "int32 or int64"),
        ("meta", TypeError, "CPU tensor"),
        ("no-cu", ValueError, "without cu_seqlens"),
        ("short", ValueError, "shape"),
        ("start", ValueError, "cu_seqlens_cpu must start at 0"),
        ("decreasing", ValueError, "cu_seqlens_cpu must be non-decreasing"),
        ("end", ValueError, "cu_seqlens_cpu must end at T = 300"),
    ],
)
def test_planning_max_seqlen_rejects(hint, err, match):
    from flashqla.contract import planning_max_seqlen

    cu = torch.tensor([0, 5, 300])
    bad = {
        "float": torch.tensor([0.0, 5.0, 300.0]),
        "meta": torch.empty(3, dtype=torch.int64, device="meta"),
        "no-cu": cu,
        "short": torch.tensor([0, 300]),
        "start": torch.tensor([1, 5, 300]),
        "decreasing": torch.tensor([0, 301, 300]),
        "end": torch.tensor([0, 5, 299]),
    }.get(hint, hint) if isinstance(hint, str) else hint
    with pytest.raises(err, match=match):
        planning_max_seqlen(bad, None if hint == "no-cu" else cu, 300)


def test_public_op_checks_cu_seqlens_cpu_before_the_device():
    """A bad host copy is reported (naming it) before the fast path's device check."""
    import flashqla
    from flashqla.testing import make_gdn_inputs

    x = make_gdn_inputs(B=1, T=70, H=1, HV=1, K=128, V=128, seqlens=[30, 40], seed=1, dtype=torch.bfloat16)
    args = (x["q"], x["k"], x["v"], x["g"], x["beta"])
    with pytest.raises(ValueError, match="cu_seqlens_cpu must end at T = 70"):
        flashqla.chunk_gated_delta_rule(*args, cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=torch.tensor([0, 30, 71]))
    with pytest.raises(TypeError, match="cu_seqlens_cpu must have dtype"):
        flashqla.chunk_gated_delta_rule(*args, cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=torch.tensor([0.0, 30.0, 70.0]))
    with pytest.raises(RuntimeError):  # a valid hint gets as far as the device check on a CPU machine
        flashqla.chunk_gated_delta_rule(*args, cu_seqlens=x["cu_seqlens"], cu_seqlens_cpu=torch.tensor([0, 30, 70]))


def test_dense_copies_only_misaligned_or_strided_tensors():
    """`flashqla.contract.dense` (what every kernel launch reads): an aligned contiguous tensor is
    returned as is; a contiguous view one element into a larger buffer (first element 2 to 8 bytes off
    16-byte alignment) and a strided view come back as aligned contiguous copies with the same
    values; `is_dense` says which tensors the kernels may touch in place (state pools that fail take
    torch's copies)."""
    from flashqla.contract import KERNEL_ALIGN, dense, is_dense

    for dtype in (torch.bfloat16, torch.float32, torch.int32, torch.int64):
        x = torch.arange(48).to(dtype).view(4, 12)
        assert x.data_ptr() % KERNEL_ALIGN == 0 and dense(x) is x and is_dense(x)
        buf = torch.zeros(49, dtype=dtype)
        view = buf[1:].view(4, 12)
        view.copy_(x)
        assert view.is_contiguous() and view.data_ptr() % KERNEL_ALIGN != 0 and not is_dense(view)
        d = dense(view)
        assert d is not view and d.is_contiguous() and d.data_ptr() % KERNEL_ALIGN == 0 and torch.equal(d, x)
        t = x.t()
        assert not is_dense(t) and torch.equal(dense(t), t) and dense(t).is_contiguous()

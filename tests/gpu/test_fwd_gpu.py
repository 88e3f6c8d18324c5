"""GPU tier: the sm_90 forward against the fp64 token recurrence, per quantity, and against FLA's own
error on the same inputs when `fla` is importable: the default forward within FLA_MARGIN of FLA's
error; the opt-in fp16 A_beta product (`for_backward=False` on `Sm90Backend(fp16_products=True)`,
bf16 input, `flashqla.ops.gdn.fwd.product_dtype`) no worse than the default forward on every case, and within INFERENCE_VS_FLA of FLA's error on the long cases of
`test_inference_forward_error_target` (at a few dozen tokens o's error is the stored o's and the
bf16 state copy's, which that product does not touch). Intermediates (g_cum, A) stage by stage against
the chunked reference when it is importable. Outputs are poisoned with NaN before each launch.

Run on the GPU machine: `pytest -m gpu tests/gpu`. Skips cleanly without a Hopper GPU.
"""

from __future__ import annotations

import math
import os

import pytest
import torch

from flashqla.testing import BUDGETS, fla_errors_for, make_gdn_inputs, rel_rms

pytestmark = pytest.mark.gpu

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not HOPPER:
    pytest.skip("needs a CUDA GPU of compute capability 9.0 (Hopper)", allow_module_level=True)

from reference.gdn.recurrent import recurrent_gated_delta_rule  # noqa: E402

try:
    from fla.ops.gated_delta_rule import chunk_gated_delta_rule as fla_chunk_gated_delta_rule
except Exception:  # noqa: BLE001 - fla is optional
    fla_chunk_gated_delta_rule = None
if os.environ.get("FLASHQLA_TEST_WITH_FLA", "1") == "0":  # quick runs: skip the peer comparison
    fla_chunk_gated_delta_rule = None

#: ours may exceed FLA's error on the same inputs by at most this factor (rounding noise) ...
FLA_MARGIN = 1.10
#: ... plus this absolute slack, 1/40 of bf16's unit roundoff (2^-8): below it both errors sit at the
#: input-rounding floor. Needed at T = 1, where the final state's error is one or two roundings of a
#: single v_new row: ours rounds beta into the stored bf16 A diag(beta) and rounds W, FLA rounds
#: beta * v once (seen on the H200: the strict ratio failed at T = 1 only; 16 other cases passed it).
FLA_FLOOR = 1e-4
#: the fp16 A_beta product on bf16 input, long cases: at most this factor of FLA's error (issue 42's
#: target), with the same absolute slack
INFERENCE_VS_FLA = 0.8

DEV = "cuda"


def _budget(q: str) -> float:
    return BUDGETS["sm90_fwd_bf16"][q]


def _to_device(x: dict, dtype=torch.bfloat16, beta_dtype=torch.float32) -> dict:
    out = {}
    for name, t in x.items():
        if t is None:
            out[name] = None
        elif name in ("q", "k", "v"):
            out[name] = t.to(DEV, dtype)
        elif name == "beta":
            out[name] = t.to(DEV, beta_dtype)
        elif name == "cu_seqlens":
            out[name] = t.to(DEV)
        else:
            out[name] = t.to(DEV, torch.float32)
    return out


def _reference(xd: dict, l2norm: bool = False):
    """fp64 recurrence on the (rounded) device inputs."""
    x64 = {n: (t.detach().cpu().double() if t is not None and t.is_floating_point() else (t.cpu() if t is not None else None)) for n, t in xd.items()}
    return recurrent_gated_delta_rule(**x64, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)


def _ours(xd: dict, block_v=None, l2norm=False, fp16_products=False):
    """The op through its launchers with NaN-poisoned outputs; checks every element was written.
    fp16_products: the forward without gradients on `Sm90Backend(fp16_products=True)`."""
    from flashqla.ops.gdn.backend import Sm90Backend
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    kw = dict(for_backward=False, backend=Sm90Backend(fp16_products=True)) if fp16_products else {}
    out = chunk_gated_delta_rule_fwd(**xd, output_final_state=True, block_v=block_v, use_qk_l2norm_in_kernel=l2norm,
                                     poison_outputs=True, **kw)
    assert torch.isfinite(out.o.float()).all(), "o has unwritten (NaN) or non-finite elements"
    assert torch.isfinite(out.final_state).all(), "final_state has unwritten or non-finite elements"
    return out


def _fla(xd: dict, l2norm=False):
    if fla_chunk_gated_delta_rule is None:
        return None
    try:
        return fla_chunk_gated_delta_rule(**xd, output_final_state=True, use_qk_l2norm_in_kernel=l2norm)
    except Exception as exc:  # noqa: BLE001 - FLA does not cover every case (e.g. empty sequences)
        return exc


def _check(xd: dict, block_v=None, l2norm=False, record=None, inference_vs_fla=None):
    ref_o, ref_ht = _reference(xd, l2norm)
    out = _ours(xd, block_v=block_v, l2norm=l2norm)
    errs = {"o": rel_rms(out.o, ref_o), "ht": rel_rms(out.final_state, ref_ht)}
    fla = _fla(xd, l2norm)
    fla_errs = None
    if fla is not None and not isinstance(fla, Exception):
        fla_errs = {"o": rel_rms(fla[0], ref_o), "ht": rel_rms(fla[1], ref_ht)}
    elif fla is None:  # FLA not run here: its error recorded on the H200 for this case, if any
        fla_errs = fla_errors_for()
    if record is not None:
        record.append((errs, fla_errs))
    print(f"errors vs fp64: ours {errs}, FLA {fla_errs}")
    for q in ("o", "ht"):
        assert errs[q] <= _budget(q), f"{q}: relative RMS error {errs[q]:.3e} exceeds budget {_budget(q):.1e} (FLA: {fla_errs})"
        if fla_errs is not None and q in fla_errs:
            assert errs[q] <= FLA_MARGIN * fla_errs[q] + FLA_FLOOR, f"{q}: ours {errs[q]:.3e} worse than FLA's {fla_errs[q]:.3e}"
    # the opt-in fp16 A_beta product (bf16 input) on the same inputs
    inf = _ours(xd, block_v=block_v, l2norm=l2norm, fp16_products=True)
    ierrs = {"o": rel_rms(inf.o, ref_o), "ht": rel_rms(inf.final_state, ref_ht)}
    print(f"fp16 A_beta product errors vs fp64: {ierrs}")
    bf16 = xd["q"].dtype == torch.bfloat16
    for q in ("o", "ht"):
        assert ierrs[q] <= _budget(q), f"inference {q}: relative RMS error {ierrs[q]:.3e} exceeds budget {_budget(q):.1e}"
        if not bf16:
            assert torch.equal(inf.o, out.o) and torch.equal(inf.final_state, out.final_state)  # one build for fp16
            continue
        assert ierrs[q] <= 1.02 * errs[q] + 1e-5, f"inference {q}: {ierrs[q]:.3e} above the training forward's {errs[q]:.3e}"
        if inference_vs_fla is not None:
            assert fla_errs is not None and q in fla_errs, "FLA's error is needed for this check"
            assert ierrs[q] <= inference_vs_fla * fla_errs[q] + FLA_FLOOR, (
                f"inference {q}: ours {ierrs[q]:.3e} above {inference_vs_fla} x FLA's {fla_errs[q]:.3e}")
    return errs, fla_errs, out


# --------------------------------------------------------------------------------------------
# outputs and final state against the fp64 recurrence
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [1, 63, 64, 65, 1000, 8192])
def test_lengths(T):
    xd = _to_device(make_gdn_inputs(B=1, T=T, H=2, HV=4, seed=T))
    _check(xd)


@pytest.mark.parametrize("H,HV", [(4, 4), (2, 4), (1, 4)], ids=["gva1", "gva2", "gva4"])
def test_gva_batched(H, HV):
    xd = _to_device(make_gdn_inputs(B=2, T=700, H=H, HV=HV, seed=HV + H))
    _check(xd)


@pytest.mark.parametrize(
    "lengths",
    [[5, 0, 63, 1, 64, 130], [3000, 7], [0, 0, 200], [1000]],
    ids=["short-and-empty", "long-short", "leading-empty", "single"],
)
@pytest.mark.parametrize("h0", [True, False], ids=["h0", "no-h0"])
def test_varlen(lengths, h0):
    x = make_gdn_inputs(B=1, T=sum(lengths), H=2, HV=4, cu_seqlens=lengths, initial_state=h0, seed=len(lengths))
    _check(_to_device(x))


def test_no_initial_state_fixed_length():
    _check(_to_device(make_gdn_inputs(B=2, T=333, H=1, HV=2, initial_state=False, seed=3)))


@pytest.mark.parametrize("case", ["T8192", "B2-T2000-gva2", "varlen-3000-7-1000"])
def test_inference_forward_error_target(case):
    """The opt-in fp16 A_beta product on long bf16 cases: o and the final state within
    INFERENCE_VS_FLA of FLA 0.6.0's error on the same inputs (issue 42's target), g == 0 and strong
    decay heads included (`make_gdn_inputs`)."""
    if fla_chunk_gated_delta_rule is None:
        pytest.skip("needs FLA (the target is relative to its error)")
    kw = {"T8192": dict(B=1, T=8192, H=2, HV=4, seed=81),
          "B2-T2000-gva2": dict(B=2, T=2000, H=2, HV=4, seed=82),
          "varlen-3000-7-1000": dict(B=1, T=4007, H=2, HV=4, cu_seqlens=[3000, 7, 1000], seed=83)}[case]
    _check(_to_device(make_gdn_inputs(**kw)), inference_vs_fla=INFERENCE_VS_FLA)


@pytest.mark.parametrize("block_v", [64, 128])
def test_value_slice_widths(block_v):
    xd = _to_device(make_gdn_inputs(B=1, T=777, H=2, HV=4, cu_seqlens=[100, 677], seed=11))
    _check(xd, block_v=block_v)


def test_fp16_and_int64_offsets_and_beta_in_input_dtype():
    x = make_gdn_inputs(B=1, T=500, H=1, HV=2, cu_seqlens=[250, 0, 250], seed=5)
    x["cu_seqlens"] = x["cu_seqlens"].long()
    xd = _to_device(x, dtype=torch.float16, beta_dtype=torch.float16)
    _check(xd)


def test_l2norm_in_kernel():
    x = make_gdn_inputs(B=1, T=300, H=2, HV=4, seed=8)
    g = torch.Generator().manual_seed(1)
    x["q"] = x["q"] * (1 + 3 * torch.rand(x["q"].shape[:-1] + (1,), generator=g, dtype=torch.float64))
    x["k"] = x["k"] * (1 + 3 * torch.rand(x["k"].shape[:-1] + (1,), generator=g, dtype=torch.float64))
    _check(_to_device(x), l2norm=True)


def test_public_op_matches_fwd():
    from flashqla import chunk_gated_delta_rule

    xd = _to_device(make_gdn_inputs(B=1, T=200, H=2, HV=4, seed=2))
    o, ht = chunk_gated_delta_rule(**xd, output_final_state=True)
    o2, ht2 = chunk_gated_delta_rule(**xd)
    assert ht2 is None
    assert o.dtype == xd["q"].dtype and ht.dtype == torch.float32
    assert torch.equal(o, o2)


def test_public_op_width_from_the_lengths():
    """The public op given `cu_seqlens_cpu` on two unequal sequences at 48 value heads: the unsplit
    plan's width comes from the lengths (`cp.plan.unsplit_block_v`: 64, where `pick_block_v` takes 128
    without them); o and the final state equal the call without the host copy bit for bit (the two
    widths give the same bits) and meet the fp64 budget."""
    from flashqla import chunk_gated_delta_rule
    from flashqla.cp import plan as P

    x = make_gdn_inputs(B=1, T=2048, H=4, HV=48, seqlens=[1536, 512], seed=5)
    xd = _to_device(x)
    P.clear_plan_cache()
    plans = [P.plan_call(xd["q"], xd["v"], xd["cu_seqlens"], "auto", seqlens=s, max_seqlen=m).forward
             for s, m in (((1536, 512), 1536), (None, None))]
    assert [(p.split, p.BV) for p in plans] == [(False, 64), (False, 128)], plans
    o, ht = chunk_gated_delta_rule(**xd, output_final_state=True, cu_seqlens_cpu=x["cu_seqlens"].cpu())
    o2, ht2 = chunk_gated_delta_rule(**xd, output_final_state=True)
    assert torch.equal(o, o2) and torch.equal(ht, ht2)
    ref_o, ref_ht = _reference(xd)
    assert rel_rms(o, ref_o) <= _budget("o") and rel_rms(ht, ref_ht) <= _budget("ht")


# --------------------------------------------------------------------------------------------
# stage by stage: g_cum and A against the chunked reference
# --------------------------------------------------------------------------------------------


def _token_slots(B, T, cu):
    """Per token (in [B, T] order): its slot row, batch row, chunk start and chunk length."""
    from flashqla.ops.gdn.kernels.sm90._common import CHUNK

    out = []
    if cu is None:
        NT = (T + CHUNK - 1) // CHUNK
        for b in range(B):
            for t in range(T):
                c = t // CHUNK
                out.append(((b * NT + c) * CHUNK + t % CHUNK, b, c * CHUNK, min(CHUNK, T - c * CHUNK)))
    else:
        cu = cu.cpu().tolist()
        for n in range(len(cu) - 1):
            for t in range(cu[n], cu[n + 1]):
                c = (t - cu[n]) // CHUNK
                s0 = cu[n] + c * CHUNK
                out.append(((cu[n] // CHUNK + n + c) * CHUNK + (t - s0), 0, s0, min(CHUNK, cu[n + 1] - s0)))
    return out


@pytest.mark.parametrize("lengths", [None, [70, 0, 129, 1]], ids=["fixed", "varlen"])
def test_stages_g_cum_and_A(lengths):
    chunk_ref = pytest.importorskip("reference.gdn.chunk")
    T = 200 if lengths is None else sum(lengths)
    B = 2 if lengths is None else 1
    HV = 2
    x = make_gdn_inputs(B=B, T=T, H=1, HV=HV, cu_seqlens=lengths, seed=21)
    xd = _to_device(x)
    out = _ours(xd)
    x64 = {n: (t.detach().cpu().double() if t is not None and t.is_floating_point() else (t.cpu() if t is not None else None)) for n, t in xd.items()}
    cu = x64["cu_seqlens"]
    g_cum = chunk_ref.chunk_local_cumsum(x64["g"], cu_seqlens=cu)
    A_ref = chunk_ref.solve_tril(chunk_ref.chunk_scaled_dot_kkt(x64["k"], x64["beta"], g_cum, cu_seqlens=cu), cu_seqlens=cu)
    info = _token_slots(B, T, cu)
    rows = torch.tensor([r for r, _, _, _ in info])
    ours_gc = (out.g_cum_log2.cpu().double()[:, rows] * math.log(2.0)).T.reshape(B, T, HV)
    err_gc = rel_rms(ours_gc, g_cum)
    assert err_gc <= _budget("g_cum"), f"g_cum error {err_gc:.2e}"
    A_ours = out.A.cpu().double()[:, rows].permute(1, 0, 2).reshape(B, T, HV, 64)
    beta_cols = torch.zeros(B, T, HV, 64, dtype=torch.float64)
    for i, (_, b, s0, m) in enumerate(info):
        beta_cols[i // T, i % T, :, :m] = x64["beta"][b, s0 : s0 + m, :].T
    err_A = rel_rms(A_ours, A_ref * beta_cols)
    assert err_A <= _budget("A"), f"A diag(beta) error {err_A:.2e}"


# --------------------------------------------------------------------------------------------
# no recompiles, CUDA graphs
# --------------------------------------------------------------------------------------------


def test_new_lengths_and_mixes_do_not_recompile():
    """After `flashqla.warmup`, no length or sequence mix compiles a kernel, forward or backward: packed
    and fixed-length batches, empty sequences, both value-slice widths (N * HV walks on either side of
    `pick_block_v`'s switch) and lengths the planner splits. Each mode is warmed up on its own before
    its runs: varlen=False alone covers fixed-length batches (whose split path runs on packed int32
    segment offsets), varlen=True the packed ones."""
    import flashqla
    from flashqla.cp.plan import cp_splits, plan_cp
    from flashqla.ops.gdn.kernels.sm90._common import compile_count
    from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v

    H, HV = 2, 4

    def run(T, lengths, train=False, B=1):
        xd = _to_device(make_gdn_inputs(B=B, T=T, H=H, HV=HV, cu_seqlens=lengths, seed=T))
        if train:
            for name in ("q", "k", "v", "beta"):
                xd[name].requires_grad_(True)
        o, ht = flashqla.chunk_gated_delta_rule(**xd, output_final_state=True)
        if train:
            (o.float().square().sum() + ht.square().sum()).backward()
        assert torch.isfinite(o).all()

    # the paths these runs take differ (else the test would prove less than it says)
    assert plan_cp(HV, 1, 4000, 128, 132).split and not plan_cp(HV, 2, 300, 128, 132).split

    def splits(T, lengths, backward=False):
        x = _to_device(make_gdn_inputs(B=1, T=T, H=H, HV=HV, cu_seqlens=lengths, seed=T))
        return cp_splits(x["q"], x["v"], x["cu_seqlens"], backward=backward)

    assert splits(4000, None, True) and splits(4000, [4000]) and splits(4000, [1000, 3000], True)
    assert pick_block_v(2, HV) == 64 and pick_block_v(20, HV) == 128
    flashqla.warmup(H, HV, varlen=False)
    n = compile_count()
    assert flashqla.warmup(H, HV, varlen=False) == 0  # everything built: nothing to do
    run(300, None)
    run(4000, None)  # split
    run(65, None, B=20)  # 80 walks: BV = 128
    run(300, None, train=True)
    run(4000, None, train=True)  # the split backward
    assert compile_count() == n, f"{compile_count() - n} kernels compiled after warmup(varlen=False)"
    flashqla.warmup(H, HV, varlen=True)
    n = compile_count()
    run(300, [100, 200])
    run(1234, [1000, 0, 234])
    run(77, [7, 70])
    run(1000, [50] * 20)  # 80 walks: BV = 128
    run(4000, [4000])  # split
    run(777, [700, 0, 77], train=True)
    run(4000, [1000, 3000], train=True)  # the split backward
    assert compile_count() == n, f"{compile_count() - n} kernels compiled after warmup(varlen=True)"


def test_same_path_new_lengths_do_not_recompile():
    """Without warmup: once a path is built, new lengths and mixes on it compile nothing (unsplit,
    BV = 64, packed)."""
    from flashqla import chunk_gated_delta_rule
    from flashqla.ops.gdn.kernels.sm90._common import compile_count

    def run(T, lengths):
        xd = _to_device(make_gdn_inputs(B=1, T=T, H=1, HV=2, cu_seqlens=lengths, seed=T))
        chunk_gated_delta_rule(**xd, output_final_state=True, cp="off")

    run(300, [100, 200])
    n = compile_count()
    run(1234, [1000, 0, 234])
    run(77, [7, 70])
    run(65, [65])
    run(2049, [1, 2048])
    assert compile_count() == n, "a new T or sequence mix recompiled a kernel"


def test_cuda_graph_replay_with_new_data():
    from flashqla import chunk_gated_delta_rule

    lengths = [300, 0, 129, 600]
    xa = _to_device(make_gdn_inputs(B=1, T=sum(lengths), H=2, HV=4, cu_seqlens=lengths, seed=31))
    xb = _to_device(make_gdn_inputs(B=1, T=sum(lengths), H=2, HV=4, cu_seqlens=[500, 529, 0, 0], seed=32))
    static = {n: (t.clone() if t is not None else None) for n, t in xa.items()}
    chunk_gated_delta_rule(**static, output_final_state=True)  # build and warm up
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        chunk_gated_delta_rule(**static, output_final_state=True)
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        o_g, ht_g = chunk_gated_delta_rule(**static, output_final_state=True)
    for n, t in xb.items():  # new data, new sequence mix, same shapes
        if t is not None:
            static[n].copy_(t)
    graph.replay()
    torch.cuda.synchronize()
    o_b, ht_b = chunk_gated_delta_rule(**xb, output_final_state=True)
    assert torch.equal(o_g, o_b) and torch.equal(ht_g, ht_b), "graph replay with new data differs from an eager call"
    ref_o, ref_ht = _reference(xb)
    assert rel_rms(o_g, ref_o) <= _budget("o")


@pytest.mark.skipif(os.environ.get("FLASHQLA_DETERMINISM") is None, reason="set FLASHQLA_DETERMINISM=1 to run")
def test_bitwise_repeat():
    from flashqla import chunk_gated_delta_rule

    xd = _to_device(make_gdn_inputs(B=1, T=3000, H=2, HV=4, seed=41))
    a = chunk_gated_delta_rule(**xd, output_final_state=True)
    b = chunk_gated_delta_rule(**xd, output_final_state=True)
    assert torch.equal(a[0], b[0]) and torch.equal(a[1], b[1])


# --------------------------------------------------------------------------------------------
# prepare kernel: one value head a CTA against all G value heads of a q/k head a CTA
# --------------------------------------------------------------------------------------------

PREPARE_CASES = {  # id: (B, T or lengths, H, HV, dtype, beta dtype, int64 offsets)
    "fixed-gva2": (2, 200, 1, 2, torch.bfloat16, torch.float32, False),
    "varlen-gva4": (1, [70, 0, 129, 1], 1, 4, torch.bfloat16, torch.float32, False),
    "varlen-gva4-h2": (1, [1000, 63, 64, 65], 2, 8, torch.bfloat16, torch.float32, False),
    "fp16-int64-beta16": (1, [250, 0, 250], 1, 2, torch.float16, torch.float16, True),
}


def _prepare_case(name):
    B, TL, H, HV, dtype, beta_dtype, i64 = PREPARE_CASES[name]
    lengths = TL if isinstance(TL, list) else None
    T = sum(lengths) if lengths else TL
    x = make_gdn_inputs(B=B, T=T, H=H, HV=HV, cu_seqlens=lengths, seed=len(name))
    if i64:
        x["cu_seqlens"] = x["cu_seqlens"].long()
    return _to_device(x, dtype=dtype, beta_dtype=beta_dtype), B, T, HV


def _used_slots(B, T, cu):
    """Slots holding at least one token (all 64 rows of each are written, tails inert)."""
    return sorted({r // 64 for r, _, _, _ in _token_slots(B, T, cu)})


@pytest.mark.parametrize("name", ["fixed-gva2", "varlen-gva4", "varlen-gva4-h2", "fp16-int64-beta16"])
def test_one_head_prepare_matches_g_head_build(name):
    """The prepare kernel with one value head a CTA (`prepare.pick_heads_per_cta`) against the build
    with all G value heads of a q/k head a CTA: every row of every used slot written by both (outputs
    NaN-poisoned), A diag(beta) and g_cum_log2 bitwise equal (the same products per value head; only
    the grid differs)."""
    from flashqla.ops.gdn.kernels.sm90._common import CHUNK, num_slots
    from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel, prepare_kernel_args

    xd, B, T, HV = _prepare_case(name)
    cu = xd["cu_seqlens"]
    N = cu.numel() - 1 if cu is not None else B
    S = num_slots(B, T, N, cu is not None)
    key = prepare_kernel_args(xd["k"], xd["beta"], cu, HV)[:7]
    cu_arg = cu if cu is not None else torch.zeros(1, dtype=torch.int32, device=DEV)
    outs = []
    for heads in (None, 1):
        A = torch.full((HV, S * CHUNK, CHUNK), float("nan"), dtype=xd["k"].dtype, device=DEV)
        gcl = torch.full((HV, S * CHUNK), float("nan"), dtype=torch.float32, device=DEV)
        build_prepare_kernel(*key, heads)(xd["k"], xd["g"], xd["beta"], cu_arg, A, gcl)
        outs.append((A, gcl))
    torch.cuda.synchronize()
    slots = torch.tensor(_used_slots(B, T, cu.cpu() if cu is not None else None), device=DEV)
    rows = (slots[:, None] * CHUNK + torch.arange(CHUNK, device=DEV)).reshape(-1)
    (A_g, g_g), (A_1, g_1) = ((A[:, rows], g[:, rows]) for A, g in outs)
    assert torch.isfinite(A_1).all() and torch.isfinite(g_1).all(), "the one-head build left rows of a used slot unwritten"
    assert torch.isfinite(A_g).all() and torch.isfinite(g_g).all()
    assert torch.equal(A_1, A_g) and torch.equal(g_1, g_g)

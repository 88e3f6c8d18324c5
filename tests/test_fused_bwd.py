"""CPU, fp64: the backward our sm_90 kernels compute (`reference.gdn.fused_bwd`), from the forward's
slot-major A diag(beta) and g_cum_log2, against autograd of the token recurrence and FLA's
hand-written backward (`reference.gdn.chunk_bwd`); strong decay (g = -30), g == 0 heads, varlen with
empty and 1-token sequences, GVA, no initial state / no dht, a two-call state hand-off, and what
storing the recomputed states in bf16 costs."""

from __future__ import annotations

import functools

import pytest
import torch

from flashqla.testing import add_cotangents, make_gdn_inputs, rel_rms
from reference.gdn import chunk, chunk_bwd, fused
from reference.gdn import fused_bwd as fb
from reference.gdn.chunk import prepare_chunk_layout
from reference.gdn.recurrent import recurrent_gated_delta_rule

NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")
TOL = 1e-12
SCALE = 128**-0.5

CASES = {
    # special heads: value head 0 has g == 0, the last value head g == -30 per token
    "B2-T200-H2-HV4": dict(B=2, T=200, H=2, HV=4),
    "varlen-130+0+1+64+105-H1-HV2": dict(B=1, T=300, H=1, HV=2, cu_seqlens=[130, 0, 1, 64, 105]),
    "strong-decay-B1-T150-H1-HV2": dict(B=1, T=150, H=1, HV=2, gate=-30.0),
    "no-h0-B1-T70-H1-HV1": dict(B=1, T=70, H=1, HV=1, initial_state=False),
}


@functools.lru_cache(maxsize=None)
def case(name: str, with_dht: bool = True):
    kw = dict(CASES[name])
    x = make_gdn_inputs(K=128, V=128, seed=13, **kw)
    gen = torch.Generator().manual_seed(17)
    x["do"] = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    N = x["v"].shape[0] if x["cu_seqlens"] is None else x["cu_seqlens"].numel() - 1
    x["dht"] = torch.randn(N, x["v"].shape[2], 128, 128, generator=gen, dtype=torch.float64) if with_dht else None
    leaves = {n: x[n].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    h0 = x["initial_state"]
    if h0 is not None:
        leaves["initial_state"] = h0.clone().requires_grad_(True)
    o, ht = recurrent_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], SCALE,
                                       leaves.get("initial_state"), True, x["cu_seqlens"])
    outs, cots = [o], [x["do"]]
    if x["dht"] is not None:
        outs.append(ht)
        cots.append(x["dht"])
    torch.autograd.backward(outs, cots)
    ref = {f"d{n}": leaves[n].grad for n in ("q", "k", "v", "g", "beta")}
    ref["dh0"] = leaves["initial_state"].grad if h0 is not None else None
    return x, ref


def ours(x, **kw):
    HV = x["v"].shape[2]
    Ab, G2 = fb.forward_slot_products(x["k"], x["g"], x["beta"], HV, x["cu_seqlens"])
    out = fb.fused_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["beta"], Ab, G2, SCALE, x["initial_state"],
                                        x["do"], x["dht"], x["cu_seqlens"], g=x["g"], **kw)
    return dict(zip(NAMES, out))


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("log2", [True, False], ids=["exp2", "exp"])
def test_against_autograd_of_recurrence(name, log2):
    x, ref = case(name)
    got = ours(x, log2=log2)
    for n in NAMES:
        if ref[n] is None:
            assert got[n] is None, n
            continue
        assert got[n].dtype == torch.float64 and got[n].shape == ref[n].shape, n
        assert rel_rms(got[n], ref[n]) < TOL, (n, rel_rms(got[n], ref[n]))


def test_without_dht():
    x, ref = case("varlen-130+0+1+64+105-H1-HV2", with_dht=False)
    got = ours(x)
    for n in NAMES:
        assert rel_rms(got[n], ref[n]) < TOL, n


def test_strong_decay_per_head():
    # dg and dbeta on the g == -30 head are tiny; relative to their own size they stay exact in fp64
    for name in ("B2-T200-H2-HV4", "strong-decay-B1-T150-H1-HV2"):
        x, ref = case(name)
        got = ours(x)
        for hv in (0, x["v"].shape[2] - 1):  # g == 0 head and g == -30 head
            for n in ("dg", "dbeta", "dv"):
                assert rel_rms(got[n][..., hv], ref[n][..., hv]) < TOL, (name, hv, n)


def test_matches_fla_handwritten_backward():
    name = "B2-T200-H2-HV4"
    x, _ = case(name)
    g_cum, _, A, _, _, _ = chunk.chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], SCALE,
                                                            x["initial_state"], True, x["cu_seqlens"])
    fla = chunk_bwd.chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], g_cum, x["beta"], A, SCALE, x["initial_state"],
                                               x["do"], x["dht"], x["cu_seqlens"])
    got = ours(x)
    for n, f in zip(NAMES, fla):
        assert rel_rms(got[n], f) < TOL, n


def test_slot_layout_roundtrip_and_inert_rows():
    x, _ = case("varlen-130+0+1+64+105-H1-HV2")
    lay = prepare_chunk_layout(1, 300, x["cu_seqlens"], 64)
    Ab, G2 = fb.forward_slot_products(x["k"], x["g"], x["beta"], 2, x["cu_seqlens"])
    from flashqla.ops.gdn.kernels.sm90._common import num_slots

    assert Ab.shape == (2, num_slots(1, 300, 5, True) * 64, 64) and G2.shape == Ab.shape[:2]
    Abc = fb.slots_to_chunks(Ab, lay, x["cu_seqlens"])
    assert torch.equal(fb.chunks_to_slots(Abc, lay, x["cu_seqlens"]), Ab)
    # rows past a sequence end are zero; g_cum_log2 repeats the last valid value there
    assert (Abc.abs().sum(-1)[~lay.valid[:, None, :].expand(-1, 2, -1)] == 0).all()
    Gc = fb.slots_to_chunks(G2, lay, x["cu_seqlens"])
    assert torch.equal(fused.pad_g_cum(Gc, lay), Gc)
    # the kernels' gather helper agrees with ours
    from flashqla.testing import kernel_chunks

    assert torch.equal(kernel_chunks(Ab, lay.seq, lay.pos, 300, x["cu_seqlens"]), Abc)


def test_a_from_a_beta():
    x, _ = case("B2-T200-H2-HV4")
    lay = prepare_chunk_layout(2, 200, None, 64)
    Ab, G2 = fb.forward_slot_products(x["k"], x["g"], x["beta"], 4)
    Abc, Gc = fb.slots_to_chunks(Ab, lay), fb.slots_to_chunks(G2, lay)
    kc, bc = fused.to_chunks(x["k"], lay, 4), fused.to_chunks(x["beta"], lay)
    A = fb.a_from_a_beta(Abc, kc, Gc, log2=True)
    A_fla = fused.regate(fused.kkt_solve(kc, bc), Gc, log2=True)
    assert rel_rms(A, A_fla) < TOL
    assert torch.allclose(A * bc[..., None, :], Abc, rtol=0, atol=1e-13)


def test_two_call_state_handoff():
    # backward of a sequence split in two calls: the second call's dh0 is the first call's dht
    x, ref = case("B2-T200-H2-HV4")
    Tc = 130
    first = {n: x[n][:, :Tc] for n in ("q", "k", "v", "g", "beta", "do")}
    second = {n: x[n][:, Tc:] for n in ("q", "k", "v", "g", "beta", "do")}
    ht1 = recurrent_gated_delta_rule(first["q"], first["k"], first["v"], first["g"], first["beta"], SCALE,
                                     x["initial_state"], True)[1]
    x2 = dict(second, initial_state=ht1, dht=x["dht"], cu_seqlens=None)
    g2 = ours(x2)
    x1 = dict(first, initial_state=x["initial_state"], dht=g2["dh0"], cu_seqlens=None)
    g1 = ours(x1)
    for n in ("dq", "dk", "dv", "dg", "dbeta"):
        assert rel_rms(torch.cat([g1[n], g2[n]], 1), ref[n]) < TOL, n
    assert rel_rms(g1["dh0"], ref["dh0"]) < TOL


def test_low_precision_storage_cost():
    """h stored in bf16 (pass 1) and dS fed to products in bf16 (pass 2), with exact everything else:
    the relative error this alone adds (numbers quoted in NOTES-bwd.md; the bound is loose)."""
    x, ref = case("B2-T200-H2-HV4")
    errs = {}
    for label, kw in {"h-fp32": dict(h_dtype=torch.float32), "h-bf16": dict(h_dtype=torch.bfloat16),
                      "dS-bf16": dict(ds_dtype=torch.bfloat16)}.items():
        got = ours(x, **kw)
        errs[label] = {n: rel_rms(got[n], ref[n]) for n in NAMES}
    print({k: {n: f"{e:.1e}" for n, e in v.items()} for k, v in errs.items()})
    assert max(errs["h-fp32"].values()) < 1e-6
    assert max(errs["h-bf16"].values()) < 2e-2
    assert max(errs["dS-bf16"].values()) < 2e-2


def test_kernel_rounding_model():
    """The sm_90 kernels' roundings, modelled: bf16 q/k/v/do and A diag(beta) (its diagonal restored
    to beta in dv's product, as the kernels do: `exact_diagonal`), fp32 arithmetic, h stored in bf16, every
    shared-memory product operand in bf16 (`operand_dtype`, `ds_dtype`); the relative error against
    fp64 on the same rounded inputs is what the GPU tier should see (printed; quoted in NOTES-bwd.md),
    and must sit under its provisional budgets."""
    x, _ = case("B2-T200-H2-HV4")
    bf = torch.bfloat16
    xr = dict(x)
    for n in ("q", "k", "v", "do"):
        xr[n] = x[n].to(bf).double()
    HV = 4
    Ab64, G2 = fb.forward_slot_products(xr["k"], xr["g"], xr["beta"], HV)
    exact = fb.fused_gated_delta_rule_bwd(xr["q"], xr["k"], xr["v"], xr["beta"], Ab64, G2, SCALE, xr["initial_state"],
                                          xr["do"], xr["dht"])
    f32 = {n: (t.float() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in xr.items()}
    Ab, G2f = fb.forward_slot_products(f32["k"], f32["g"], f32["beta"], HV, dtype=bf)
    model = fb.fused_gated_delta_rule_bwd(f32["q"], f32["k"], f32["v"], f32["beta"], Ab, G2f, SCALE, f32["initial_state"],
                                          f32["do"], f32["dht"], h_dtype=bf, ds_dtype=bf, operand_dtype=bf,
                                          exact_diagonal=True, dog_pair=True)  # an initial state given: "l"
    errs = {n: rel_rms(m, e) for n, m, e in zip(NAMES, model, exact)}
    print("kernel rounding model vs fp64:", {n: f"{e:.1e}" for n, e in errs.items()})
    budget = {"dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "dg": 3e-2, "dbeta": 2e-2, "dh0": 2e-2}  # tests/gpu/test_bwd_gpu.py
    for n, e in errs.items():
        assert e < budget[n], (n, e)


def _gpu_tier_inputs(T: int) -> dict:
    """The inputs of tests/gpu/test_bwd_gpu.py::test_lengths[T] (seed T, 2/4 heads), rounded as there:
    q, k, v, do to bf16, g, beta, h0, dht to fp32; returned in fp64."""
    x = add_cotangents(make_gdn_inputs(B=1, T=T, H=2, HV=4, K=128, V=128, seed=T), T + 1)
    for n in ("q", "k", "v", "do"):
        x[n] = x[n].to(torch.bfloat16).double()
    for n in ("g", "beta", "initial_state", "dht"):
        x[n] = x[n].float().double()
    return x


def _rounding_model(T: int):
    """For test_lengths[T]'s inputs: a function of the kernels' modelled options (`exact_diagonal`,
    `dog_pair`) giving each gradient's relative error against fp64 on the same rounded inputs, with
    the model's bf16 roundings (h, the state gradient and every product operand)."""
    bf = torch.bfloat16
    x = _gpu_tier_inputs(T)
    Ab64, G2 = fb.forward_slot_products(x["k"], x["g"], x["beta"], 4)
    exact = fb.fused_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["beta"], Ab64, G2, SCALE, x["initial_state"], x["do"],
                                          x["dht"], g=x["g"])
    f32 = {n: (t.float() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    Ab, G2f = fb.forward_slot_products(f32["k"], f32["g"], f32["beta"], 4, dtype=bf)

    def model(**options):
        m = fb.fused_gated_delta_rule_bwd(f32["q"], f32["k"], f32["v"], f32["beta"], Ab, G2f, SCALE, f32["initial_state"],
                                          f32["do"], f32["dht"], g=f32["g"], h_dtype=bf, ds_dtype=bf, operand_dtype=bf,
                                          **options)
        return {n: rel_rms(a, e) for n, a, e in zip(NAMES, m, exact)}

    return model


@pytest.mark.parametrize("T", [63, 64])
def test_exact_diagonal_model_against_fla_recorded(T):
    """Where our gradient error exceeded FLA's on the H200 (dg, dv, dbeta; FLA_ERRORS) with the
    stored bf16 diagonal of A diag(beta) (beta rounded): the model of the kernels' roundings
    reproduces it, and beta itself on that diagonal in dv's product (`exact_diagonal`, what the
    kernels now compute) brings dv and dbeta within FLA's recorded error (x1.1 + 1e-4, the GPU
    tier's rule). dg stays above FLA's on these two inputs and moves either way (here lower at
    T = 63, higher at T = 64; on the H200 too, with its spread over seeds in NOTES-bwd.md, "The
    exact diagonal"), so the test pins dv's improvement and dg's budget, not a pass against FLA."""
    from flashqla.testing import fla_errors_for

    model = _rounding_model(T)
    now, fixed = model(exact_diagonal=False), model(exact_diagonal=True)
    fla = fla_errors_for(f"tests/gpu/test_bwd_gpu.py::test_lengths[{T}]")
    print(f"T={T} model now {now}\n      exact diagonal {fixed}\n      FLA (H200) {fla}")
    assert now["dg"] > 1.1 * fla["dg"] + 1e-4  # the gap seen on the H200 is in the model
    for n in ("dv", "dbeta"):
        assert fixed[n] <= 1.1 * fla[n] + 1e-4, (n, fixed[n], fla[n])
    assert fixed["dv"] < 0.9 * now["dv"]
    assert fixed["dg"] < 3e-2  # the GPU tier's budget (tests/gpu/test_bwd_gpu.py)


def test_dh0_at_long_t_needs_the_scaled_do_pair():
    """test_lengths[4096]'s inputs: in the model of the kernels' roundings, dh0's error sits above FLA's
    recorded one (by ~1.15x, as v5 measured on the H200 with the scaled dO rounded once to bf16) and
    below it with the pair hi + lo (`dog_pair`, v5's option "l", the op's build when it returns dh0;
    H200: 2.72e-3 -> 2.06e-3 here, FLA 2.33e-3; NOTES-bwd.md, "dh0 at long T"). The other gradients do
    not see the pair beyond a few percent: their state-gradient operand is its bf16 copy D."""
    from flashqla.testing import fla_errors_for

    model = _rounding_model(4096)
    once, pair = model(exact_diagonal=True, dog_pair=False), model(exact_diagonal=True, dog_pair=True)
    fla = fla_errors_for("tests/gpu/test_bwd_gpu.py::test_lengths[4096]")
    print(f"T=4096 model, dO rounded once {once}\n      pair {pair}\n      FLA (H200) {fla}")
    assert once["dh0"] > 1.1 * fla["dh0"]
    assert pair["dh0"] < 0.9 * fla["dh0"] and pair["dh0"] < 0.8 * once["dh0"]
    for n in ("dq", "dk", "dv", "dbeta"):
        assert pair[n] <= 1.02 * once[n], (n, pair[n], once[n])


@pytest.mark.parametrize("T", [63, 64, 65])
def test_dbeta_above_fla_comes_from_w_rounding(T):
    """test_lengths[T]'s inputs: dbeta's error sits above FLA's recorded one in the model of the kernels'
    roundings (as on the H200: 1.05-1.08x FLA by geometric mean over seeds), and below it when dbeta's
    rows rowsum(X * W) take W in fp32 (`exact_w`; v_new's product keeps W's bf16 copy), every other
    gradient unchanged. v5 built that ("w", H200: dbeta 0.954x FLA over the tier's 20 seeds) at 2.5-4.7%
    of the backward's time and does not keep it (NOTES-bwd.md, "dbeta with W in fp32")."""
    from flashqla.testing import fla_errors_for

    model = _rounding_model(T)
    kept, exact_w = model(exact_diagonal=True, dog_pair=True), model(exact_diagonal=True, dog_pair=True, exact_w=True)
    fla = fla_errors_for(f"tests/gpu/test_bwd_gpu.py::test_lengths[{T}]")
    print(f"T={T} dbeta: model {kept['dbeta']:.3e}, with W in fp32 {exact_w['dbeta']:.3e}, FLA (H200) {fla['dbeta']:.3e}")
    assert kept["dbeta"] > fla["dbeta"]
    assert exact_w["dbeta"] < fla["dbeta"] and exact_w["dbeta"] < 0.95 * kept["dbeta"]
    for n in ("dq", "dk", "dv", "dg", "dh0"):
        assert exact_w[n] == kept[n], n


def test_fp16_operands_need_a_scale_per_tile():
    """Pass 2's shared-memory operands in fp16 (the model of issue 45's accuracy route): at the
    gradients' natural size they beat bf16's on every gradient, but without a scale of their own they
    lose that where a loss scale moves do and dht out of fp16's range (2^-30: underflow; 2^20:
    overflow to inf); with a power-of-two scale per operand tile (`operand_scale`) every gradient's
    relative error is the same at any such scale, bit for bit, and stays below bf16's."""
    bf, fp = torch.bfloat16, torch.float16
    x = _gpu_tier_inputs(64)
    Ab64, G2 = fb.forward_slot_products(x["k"], x["g"], x["beta"], 4)
    f32 = {n: (t.float() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    Ab, G2f = fb.forward_slot_products(f32["k"], f32["g"], f32["beta"], 4, dtype=bf)

    def errors(factor, op, **kw):
        do, dht = x["do"] * factor, x["dht"] * factor
        exact = fb.fused_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["beta"], Ab64, G2, SCALE, x["initial_state"], do,
                                              dht)
        m = fb.fused_gated_delta_rule_bwd(f32["q"], f32["k"], f32["v"], f32["beta"], Ab, G2f, SCALE, f32["initial_state"],
                                          do.float(), dht.float(), h_dtype=bf, ds_dtype=op, operand_dtype=op,
                                          exact_diagonal=True, dog_pair=True, **kw)
        return {n: rel_rms(a, e) for n, a, e in zip(NAMES, m, exact)}

    shipped = errors(1.0, bf)
    scaled = {f: errors(f, fp, operand_scale=True) for f in (1.0, 2.0**-30, 2.0**20)}
    plain_small, plain_large = errors(2.0**-30, fp), errors(2.0**20, fp)
    for n in NAMES:
        assert scaled[1.0][n] < shipped[n], (n, scaled[1.0][n], shipped[n])
        assert scaled[2.0**-30][n] == scaled[1.0][n] == scaled[2.0**20][n], n
        assert plain_small[n] > 10 * shipped[n], (n, plain_small[n], shipped[n])
        assert not plain_large[n] < 1.0, (n, plain_large[n])  # inf or nan


def test_pair_dtype_splits_the_operand_rounding_consistently():
    """`pair_dtype` (the products of two computed operands in their own dtype) only re-routes the
    operand roundings: pair_dtype equal to operand_dtype (and a_beta_pairs, whose products then take
    that same dtype) gives bit for bit the gradients of the plain model; pair_dtype fp16 gives others."""
    bf = torch.bfloat16
    x = _gpu_tier_inputs(64)
    f32 = {n: (t.float() if torch.is_tensor(t) and t.is_floating_point() else t) for n, t in x.items()}
    Ab, G2f = fb.forward_slot_products(f32["k"], f32["g"], f32["beta"], 4, dtype=bf)

    def run(**kw):
        return fb.fused_gated_delta_rule_bwd(f32["q"], f32["k"], f32["v"], f32["beta"], Ab, G2f, SCALE, f32["initial_state"],
                                             f32["do"], f32["dht"], h_dtype=bf, ds_dtype=bf, operand_dtype=bf,
                                             exact_diagonal=True, dog_pair=True, **kw)

    plain = run()
    for kw in (dict(pair_dtype=bf), dict(pair_dtype=bf, a_beta_pairs=True), dict(a_beta_pairs=True)):
        for n, a, b in zip(NAMES, plain, run(**kw)):
            assert torch.equal(a, b), (kw, n)
    fp = run(pair_dtype=torch.float16, operand_scale=True)
    assert any(not torch.equal(a, b) for a, b in zip(plain, fp))
    assert all(torch.isfinite(t).all() for t in fp)

"""`reference.gdn.numerics.forward_rounding_model`: the forward's storage and operand roundings,
point by point (the accuracy study of `benchmarks/journal/accuracy.md`, "Where o's error comes from")."""

from __future__ import annotations

import pytest
import torch

from flashqla.testing import make_gdn_inputs, rel_rms
from reference import recurrent_gated_delta_rule
from reference.gdn import numerics as nm


@pytest.fixture(scope="module")
def x():
    # a g == 0 head and a strong-decay head (special_heads), an initial state
    return nm.to_fp64(nm.round_inputs(make_gdn_inputs(B=2, T=256, H=2, HV=4, seed=3)))


@pytest.fixture(scope="module")
def truth(x):
    return recurrent_gated_delta_rule(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                      output_final_state=True)


@pytest.mark.parametrize("structure", ["ours", "fla"])
def test_without_rounding_is_the_recurrence(x, truth, structure):
    m = nm.forward_rounding_model(x, None, structure)
    assert rel_rms(m["o"], truth[0]) < 1e-13
    assert rel_rms(m["final_state"], truth[1]) < 1e-13


def test_output_rounding_alone_is_the_rounded_truth(x, truth):
    """Rounding only the stored o: o's error is exactly the bf16 rounding of the true o, the final state
    is untouched."""
    m = nm.forward_rounding_model(x, {"o": torch.bfloat16})
    floor = rel_rms(truth[0].to(torch.bfloat16).double(), truth[0])
    assert abs(rel_rms(m["o"], truth[0]) - floor) < 1e-3 * floor
    assert rel_rms(m["final_state"], truth[1]) < 1e-13


def test_kernel_roundings_match_fla_and_fp16_operands_beat_it(x):
    """ours with every point in bf16 sits within 10% of FLA's structure in bf16 (the GPU measured
    ours / FLA about 1.0 on o); A_beta and W in fp16 (or tf32) take o's error below 0.9x FLA's; every
    point in fp16 but the stored o reaches within 10% of the o-only floor."""
    cfg = {"fla": ("fla", nm.kernel_roundings("fla")), "ours": ("ours", nm.kernel_roundings("ours")),
           "floor": ("ours", {"o": torch.bfloat16})}
    for name, dt in (("fp16", torch.float16), ("tf32", "tf32")):
        d = nm.kernel_roundings("ours")
        d.update(A_beta=dt, W=dt)
        cfg[f"aw_{name}"] = ("ours", d)
    d = nm.kernel_roundings("ours", torch.float16)
    d["o"] = torch.bfloat16
    cfg["all_fp16"] = ("ours", d)
    e = {r["config"]: r for r in nm.forward_rounding_errors(x, cfg)}
    assert 0.9 < e["ours"]["o"] / e["fla"]["o"] < 1.1
    assert 0.85 < e["ours"]["final_state"] / e["fla"]["final_state"] < 1.15
    for name in ("aw_fp16", "aw_tf32"):
        assert e[name]["o"] < 0.9 * e["fla"]["o"], (name, e[name]["o"], e["fla"]["o"])
        assert e[name]["final_state"] < 0.8 * e["fla"]["final_state"]
    assert e["all_fp16"]["o"] < 1.1 * e["floor"]["o"]
    assert len(e["ours"]["o_head"]) == 4


def test_bad_arguments_name_themselves(x):
    with pytest.raises(ValueError, match="structure"):
        nm.forward_rounding_model(x, None, "flashinfer")
    with pytest.raises(ValueError, match="structure"):
        nm.kernel_roundings("flashinfer")
    with pytest.raises(ValueError, match="unknown rounding points.*'w'"):
        nm.forward_rounding_model(x, {"w": torch.bfloat16}, "ours")
    with pytest.raises(ValueError, match="torch dtype, 'tf32' or None"):
        nm.forward_rounding_model(x, {"o": "fp16"})
    with pytest.raises(ValueError, match="multiple of chunk_size"):
        nm.forward_rounding_model({**x, **{n: x[n][:, :100] for n in ("q", "k", "v", "g", "beta")}})
    with pytest.raises(ValueError, match="cu_seqlens"):
        nm.forward_rounding_model({**x, "cu_seqlens": torch.tensor([0, 256])})

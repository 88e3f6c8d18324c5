"""What a newcomer following the README on a CPU machine ran into (a walkthrough of the README,
2026-12-07), each pinned: the serving example runs as printed, `flashqla.reference` is reachable after
`import flashqla` alone, `backend=` and `cp=` mistakes are named before anything else, shape and
length mistakes name the argument given, and the reference's `batch_invariant` runs under
torch.compile with inductor."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest
import torch

import flashqla
from flashqla.testing import make_gdn_inputs, rel_rms

ROOT = Path(__file__).resolve().parents[1]


def _readme_block(starts_with: str) -> str:
    """The README's python code block whose first line is `starts_with`."""
    text = (ROOT / "README.md").read_text()
    i = text.index("```python\n" + starts_with) + len("```python\n")
    return text[i:text.index("```", i)]


def test_subpackages_reachable_after_import_flashqla():
    """Before: `backend=flashqla.reference.chunk_gated_delta_rule` (README, across GPUs) raised
    AttributeError unless `flashqla.reference` had been imported by name. Fresh interpreter: the
    attribute works after `import flashqla` alone, and TileLang is still not imported."""
    code = ("import sys, flashqla; f = flashqla.reference.chunk_gated_delta_rule; "
            "assert callable(f) and callable(flashqla.testing.make_gdn_inputs); "
            "assert hasattr(flashqla.distributed, 'chunk_gated_delta_rule_cp'); "
            "assert 'tilelang' not in sys.modules; "
            "assert 'reference' in dir(flashqla); print('ok')")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, timeout=120)
    assert out.returncode == 0 and out.stdout.strip() == "ok", out.stderr[-2000:]
    with pytest.raises(AttributeError, match="no attribute 'nonexistent'"):
        flashqla.nonexistent  # noqa: B018


def test_readme_serving_example_runs_as_printed():
    """Before: the Serving block used names it only described in a comment. It now runs as printed
    (on CPU through the reference): o is the preallocated buffer, the returned pool is the pool
    passed in, its rows 5 and 2 hold the two sequences' final states ("vk", bf16) and the checkpoints
    the states after their positions, each against the token recurrence in fp64; rows not indexed
    stay zero."""
    from reference import recurrent_gated_delta_rule

    env: dict = {}
    exec(compile(_readme_block("import torch, flashqla\nfrom flashqla.testing"), "README serving", "exec"), env)
    o, o_buf, pool, ckpt, x = env["o"], env["o_buf"], env["pool"], env["ckpt"], env["x"]
    assert o is o_buf and o.dtype == torch.bfloat16
    assert pool.dtype == torch.bfloat16 and pool.shape == (8, 4, 128, 128)
    cu = x["cu_seqlens"].tolist()
    x64 = {n: x[n].double() for n in ("q", "k", "v", "g", "beta")}

    def truth(bos, eos):
        sl = {n: t[:, bos:eos] for n, t in x64.items()}
        o_t, h_t = recurrent_gated_delta_rule(**sl, output_final_state=True)
        return o_t, h_t[0].transpose(-1, -2)  # [HV, V, K]

    for n, row in enumerate((5, 2)):
        o_t, h_t = truth(cu[n], cu[n + 1])
        assert rel_rms(o[:, cu[n]:cu[n + 1]].double(), o_t) < 1e-2
        assert rel_rms(pool[row].double(), h_t) < 1e-2
    for i, (p, n) in enumerate(((64, 0), (100, 0), (250, 1))):
        assert rel_rms(ckpt[i].double(), truth(cu[n], p)[1]) < 1e-2
    untouched = [r for r in range(8) if r not in (5, 2)]
    assert pool[untouched].abs().sum() == 0


def test_backend_must_be_a_backend_object():
    """Before: `chunk_gated_delta_rule_fwd(backend="reference")` or `backend=<function>` failed with
    "'str' object has no attribute 'prepare'". Now a TypeError names `backend` and what it takes, on
    the forward and the backward; a Backend object still runs."""
    from reference.gdn.cp import ReferenceCPBackend

    x = make_gdn_inputs(T=130, H=2, HV=4)
    for bad in ("reference", flashqla.reference.chunk_gated_delta_rule, object()):
        with pytest.raises(TypeError, match="backend must be None .* or a flashqla.ops.gdn.backend.Backend"):
            flashqla.chunk_gated_delta_rule_fwd(**x, backend=bad)
    with pytest.raises(TypeError, match="backend must be a Backend instance, got the class ReferenceCPBackend"):
        flashqla.chunk_gated_delta_rule_fwd(**x, backend=ReferenceCPBackend)
    fwd = flashqla.chunk_gated_delta_rule_fwd(**x, output_final_state=True, backend=ReferenceCPBackend())
    assert torch.isfinite(fwd.o).all()
    do = torch.randn_like(x["v"])
    with pytest.raises(TypeError, match="backend must be None"):
        flashqla.chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], fwd.A, fwd.g_cum_log2, do,
                                            initial_state=x["initial_state"], backend="reference")

    class BwdOnly:  # the backward may re-run the forward's launches (prepare, recurrent): all four are needed
        def bwd(self, *a):
            raise AssertionError("not reached")

        zeros = bwd

    with pytest.raises(TypeError, match="without prepare, recurrent"):
        flashqla.chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], fwd.A, fwd.g_cum_log2, do,
                                            initial_state=x["initial_state"], backend=BwdOnly())
    with pytest.raises(ValueError, match="cp must be 'off', 'auto', 'on' or None"):
        flashqla.chunk_gated_delta_rule_bwd(x["q"], x["k"], x["v"], x["g"], x["beta"], fwd.A, fwd.g_cum_log2, do,
                                            initial_state=x["initial_state"], cp="of")


def test_cp_named_before_the_device():
    """Before: `chunk_gated_delta_rule_fwd(cp="of")` on CPU tensors reported the device first (the op
    named cp). Now the bad mode is named first on the forward, as on the op."""
    x = make_gdn_inputs(T=130, H=2, HV=4, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="cp must be 'off', 'auto', 'on' or None"):
        flashqla.chunk_gated_delta_rule_fwd(**x, cp="of")


def test_q_k_shape_mismatch_names_both():
    """Before: q with more heads than k got "k must have the shape of q", as if k alone were wrong."""
    x = make_gdn_inputs(T=130, H=2, HV=4)
    x["q"] = torch.cat([x["q"], x["q"]], dim=2)
    with pytest.raises(ValueError, match=r"q and k must have the same shape \[B, T, H, K\]: q \(1, 130, 4, 128\), k \(1, 130, 2, 128\)"):
        flashqla.reference.chunk_gated_delta_rule(**x)


def test_make_gdn_inputs_names_seqlens():
    """Before: lengths passed as `seqlens` that do not sum to T were reported as "cu_seqlens given as
    lengths"."""
    with pytest.raises(ValueError, match=r"seqlens needs B == 1 and sum\(lengths\) == T: B = 1, T = 1000, sum = 900"):
        make_gdn_inputs(T=1000, seqlens=[300, 600])
    with pytest.raises(ValueError, match="cu_seqlens given as lengths needs"):
        make_gdn_inputs(T=1000, cu_seqlens=[300, 600])


def test_plan_reason_says_when_lengths_are_estimated():
    """Before: offsets [0, 80, 200] without the lengths gave the reason "sequences of <= 100 tokens fit
    one segment" (100 = T / N, while the longest is 120). The reason now says the length is T / N;
    with the lengths it gives the longest; a forced split keeps its own reason."""
    from flashqla.cp import plan_call

    x = make_gdn_inputs(T=200, HV=4, seqlens=[80, 120], dtype=torch.bfloat16)
    r = plan_call(x["q"], x["v"], x["cu_seqlens"], "auto").forward.reason
    assert r == ("sequences fit one segment (each taken as ceil(T / N) = 100 tokens long, exact for equal lengths; "
                 "pass the lengths for unequal ones)")
    forced = plan_call(x["q"], x["v"], x["cu_seqlens"], "on").forward
    assert forced.split and "forced" in forced.reason
    r = plan_call(x["q"], x["v"], x["cu_seqlens"], "auto", seqlens=(80, 120)).forward.reason
    assert r == "sequences of <= 120 tokens fit one segment"


@pytest.mark.compile_all
def test_reference_batch_invariant_under_inductor():
    """Before: `torch.compile(flashqla.reference.chunk_gated_delta_rule)` with `batch_invariant=True`
    failed in inductor (DynamicOutputShapeException on aten.nonzero, from the chunk layout's index of
    chunks by position); the README says it is allowed. Now it runs and matches eager. About 2 min of
    inductor compiles on 2 cores: in the `--compile-all` tier."""
    x = make_gdn_inputs(T=20, H=1, HV=1, K=8, V=8, seqlens=[7, 13])
    torch._dynamo.reset()
    f = torch.compile(flashqla.reference.chunk_gated_delta_rule)
    with torch.no_grad():
        o, h = f(**x, output_final_state=True, batch_invariant=True)
        o_e, h_e = flashqla.reference.chunk_gated_delta_rule(**x, output_final_state=True, batch_invariant=True)
    torch._dynamo.reset()
    torch.testing.assert_close(o, o_e)
    torch.testing.assert_close(h, h_e)

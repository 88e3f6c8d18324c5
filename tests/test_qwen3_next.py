"""A real client on CPU: transformers' Qwen3-Next gated-delta-net layer running the reference op.

`flashqla.integrations.qwen3_next.enable(model)` attaches the op through transformers' own kernel
mapping where the installed transformers has one ("kernels": transformers >= 5.15 with a `kernels`
it accepts; always from 5.25), else through the older call sites ("adapter"); on CPU its default
backend runs `reference.chunk_gated_delta_rule`. A one-layer Qwen3-Next causal LM (2 key heads,
4 value heads, head dims 128, one head strongly decaying) computes its language-modelling loss and
the gradient of every parameter, A_log and dt_bias included, with the layer's own pure-torch
chunked gated delta rule and with the op attached:

- fp64 throughout (`keep_float64`: the layer otherwise casts its torch path, gates, norms and loss
  to fp32): budgets 1e-10 relative RMS per gradient, 1e-9 per head of A_log and dt_bias, 1e-12 on
  the loss (measured: <= 1.2e-14 per gradient, <= 8.9e-14 per head, 0 on the loss).
- the stock layer in an fp64 model (its torch path in fp32): budgets 2e-4, 1e-3 and 2e-6
  (measured: <= 1.8e-5, <= 1.4e-4 and <= 1.6e-7).
- greedy decoding with transformers' cache: the prefill's final state feeds three decoding steps
  and then a second multi-token prefill (which from transformers 5.14 on starts from the cached
  state); the same tokens, logits within 1e-12 (measured: <= 1.3e-15); a transposed state would be
  off by order 1.
- transformers' own lifecycle: a model from `from_pretrained` (kernelized by transformers on the
  "kernels" path), `model.train()` and `model.eval()` (transformers re-kernelizes for each mode)
  keep the op; closing the attachment restores transformers' function.

Measured with transformers 4.57.6 and 5.14.0 ("adapter", instance attribute), 5.24.0 without a
matching kernels ("adapter", module global), 5.15.0 + kernels 0.16.2, 5.20.0 + kernels 0.17.2,
5.24.0 + kernels 0.18.3 and 5.25.0 + kernels 0.19.1 ("kernels"). Every test fails, none skips, when
transformers is installed but the op cannot be attached; the module skips only when transformers
is not installed.
"""

from __future__ import annotations

import importlib.util
import inspect
import os

import pytest
import torch

if importlib.util.find_spec("transformers") is None:
    pytest.skip("transformers is not installed (the dev extra installs it)", allow_module_level=True)

import transformers  # noqa: E402
from packaging.version import Version  # noqa: E402

import reference  # noqa: E402
from flashqla.integrations import qwen3_next as qn  # noqa: E402
from flashqla.testing import rel_rms  # noqa: E402

B, T = 2, 200  # T is not a multiple of the chunk size 64: the torch path pads, the reference does not
PER_HEAD = ("linear_attn.A_log", "linear_attn.dt_bias")
TF = Version(transformers.__version__)


def expected_path() -> str:
    """The path the module docstring promises for the installed versions, decided from versions."""
    if TF >= Version("5.25"):
        return "kernels"  # kernels is a required dependency; the decorators always apply
    if TF < Version("5.15"):
        return "adapter"
    from transformers.utils.import_utils import is_kernels_available

    switched_off = os.environ.get("USE_HUB_KERNELS", "YES").upper() in ("0", "OFF", "NO", "FALSE")
    return "kernels" if is_kernels_available() and not switched_off else "adapter"


class Spy:
    """Counts the calls of a function and keeps the last call's arguments (tensors detached)."""

    def __init__(self, fn):
        self.fn, self.calls, self.args, self.kwargs = fn, 0, None, None

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.args = [a.detach() if isinstance(a, torch.Tensor) else a for a in args]
        self.kwargs = {k: (v.detach() if isinstance(v, torch.Tensor) else v) for k, v in kwargs.items()}
        return self.fn(*args, **kwargs)


@pytest.fixture
def ref_spy(monkeypatch):
    """`reference.chunk_gated_delta_rule` counted: the op the "auto" backend runs on CPU."""
    spy = Spy(reference.chunk_gated_delta_rule)
    monkeypatch.setattr(reference, "chunk_gated_delta_rule", spy)
    return spy


@pytest.fixture(scope="module")
def setup():
    config = qn.tiny_qwen3_next_config()
    model = qn.build_model(config, seed=0, dtype=torch.float64)
    ids = qn.make_input_ids(config, B, T, seed=1)
    return config, model, ids


def test_integration_path_for_the_installed_versions():
    assert qn.integration_path() == expected_path(), (transformers.__version__, expected_path())


def test_enable_attaches_the_reference_op_with_the_layers_call(setup, ref_spy):
    config, model, ids = setup
    x = ids[:, :70]
    with torch.no_grad():
        model(input_ids=x, use_cache=False)
        assert ref_spy.calls == 0, "the stock layer must not run the reference op"
        with qn.enable(model) as att:
            assert att.path == expected_path() and len(att.layers) == 1
            model(input_ids=x, use_cache=False)
        assert ref_spy.calls == 1, "enable(model) did not make the layer call reference.chunk_gated_delta_rule"
        model(input_ids=x, use_cache=False)
    assert ref_spy.calls == 1, "closing the attachment did not restore the layer's own function"
    q, k, v, g, beta = ref_spy.args
    kw = ref_spy.kwargs
    # the layer's call convention, as the module docstring states it
    HV, K = config.linear_num_value_heads, config.linear_key_head_dim
    Hq = config.linear_num_key_heads if TF >= Version("5.23") else HV  # up to 5.22 the layer repeats q/k heads
    assert q.shape == k.shape == (B, 70, Hq, K) and v.shape == (B, 70, HV, config.linear_value_head_dim)
    assert g.shape == beta.shape == (B, 70, HV) and (g <= 0).all()
    assert g.dtype == torch.float64  # fp32 gate math, promoted by the fp64 dt_bias of this fp64 model
    assert ((beta > 0) & (beta < 1)).all()  # already sigmoided
    assert (q.norm(dim=-1) - 1).abs().max() > 0.1, "q arrived normalised"
    assert kw["use_qk_l2norm_in_kernel"] is True and kw["output_final_state"] is False
    assert kw["scale"] is None and kw["initial_state"] is None and kw["cu_seqlens"] is None


def _compare(model, ids, ref_spy, float64):
    torch_spy = Spy(qn.torch_chunk_path())
    loss_t, grads_t = qn.loss_and_grads(model, ids, torch_spy, float64=float64)
    with qn.enable(model):
        loss_r, grads_r = qn.loss_and_grads(model, ids, float64=float64)
    assert torch_spy.calls == 1 and ref_spy.calls == 1, "the attached function was not the one the layer called"
    return loss_t, grads_t, loss_r, grads_r


def _check_nonzero(grads):
    for name, gr in grads.items():
        assert torch.isfinite(gr).all(), name
        assert gr.abs().sum() > 0, f"{name}: zero gradient"
        if name.endswith(PER_HEAD):
            assert (gr != 0).all(), f"{name}: a head has a zero gradient: {gr.tolist()}"


def _check_close(loss_t, grads_t, loss_r, grads_r, loss_budget, grad_budget, head_budget):
    loss_err = abs(loss_r.item() - loss_t.item()) / abs(loss_t.item())
    assert loss_err <= loss_budget, (loss_r.item(), loss_t.item())
    errs = {n: rel_rms(grads_r[n], grads_t[n]) for n in grads_t}
    bad = {n: e for n, e in errs.items() if not e <= grad_budget}
    assert not bad, f"relative RMS over budget {grad_budget:g}: {bad}"
    head_max = 0.0
    for name in grads_t:
        if name.endswith(PER_HEAD):  # per head, so that a small head's gradient is not hidden in the RMS
            rel = ((grads_r[name].double() - grads_t[name].double()) / grads_t[name].double()).abs()
            assert (rel <= head_budget).all(), f"{name}: per-head relative error {rel.tolist()}"
            head_max = max(head_max, rel.max().item())
    print(f"loss {loss_err:.1e}, gradients <= {max(errs.values()):.1e} rel RMS, per head <= {head_max:.1e}")
    return errs


def test_every_parameter_gradient_fp64(setup, ref_spy):
    _, model, ids = setup
    loss_t, grads_t, loss_r, grads_r = _compare(model, ids, ref_spy, float64=True)
    assert loss_t.dtype == torch.float64 and all(g.dtype == torch.float64 for g in grads_t.values())
    names = set(grads_t)
    assert any(n.endswith("linear_attn.A_log") for n in names) and any(n.endswith("linear_attn.dt_bias") for n in names)
    assert len(names) == sum(1 for _ in model.parameters())
    _check_nonzero(grads_t)
    _check_nonzero(grads_r)
    # gates: the last value head decays strongly (exp(g) ~ 2e-4 per token on average), the first barely
    g_mean = ref_spy.args[3].mean(dim=(0, 1))
    assert g_mean[-1] < -4.0 and g_mean[0] > -0.1, g_mean.tolist()
    _check_close(loss_t, grads_t, loss_r, grads_r, loss_budget=1e-12, grad_budget=1e-10, head_budget=1e-9)
    if importlib.util.find_spec("fla") is None:  # then the stock model runs the same torch path
        loss_s, grads_s = qn.loss_and_grads(model, ids, float64=True)
        assert loss_s == loss_t and all(torch.equal(grads_s[n], grads_t[n]) for n in grads_t)


def test_every_parameter_gradient_stock_layer(setup, ref_spy):
    """Without `keep_float64` the layer runs its torch path (and the loss) in fp32 even in an fp64 model."""
    _, model, ids = setup
    loss_t, grads_t, loss_r, grads_r = _compare(model, ids, ref_spy, float64=False)
    _check_nonzero(grads_t)
    errs = _check_close(loss_t, grads_t, loss_r, grads_r, loss_budget=2e-6, grad_budget=2e-4, head_budget=1e-3)
    assert max(errs.values()) > 1e-9, "expected the fp32 torch path to differ from the fp64 reference"


def _decode_and_continue(model, ids, more):
    """Greedy decoding (3 steps), then a multi-token prefill of `more` from the cache; no gradients."""
    with qn.keep_float64(), torch.no_grad():
        out = model.generate(
            ids,
            max_new_tokens=3,
            min_new_tokens=3,
            do_sample=False,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
        cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # renamed in 5.25
        cont = model(input_ids=more, use_cache=True, **{cache_kw: out.past_key_values}).logits
    return out.sequences, torch.stack(out.logits), cont


def test_greedy_decoding_from_the_cached_state(ref_spy):
    config = qn.tiny_qwen3_next_config(layer_types=("linear_attention", "full_attention"))
    model = qn.build_model(config, seed=2, dtype=torch.float64)
    ids = qn.make_input_ids(config, B, 100, seed=3)
    more = qn.make_input_ids(config, B, 20, seed=4)
    torch_spy = Spy(qn.torch_chunk_path())
    with qn.swap_chunk_gated_delta_rule(model, torch_spy):
        seq_t, logits_t, cont_t = _decode_and_continue(model, ids, more)
    with qn.enable(model):
        seq_r, logits_r, cont_r = _decode_and_continue(model, ids, more)
    # the prompt's prefill, then the continuation's; decoding steps run the layer's recurrent path
    assert torch_spy.calls == ref_spy.calls == 2
    assert torch.equal(seq_t, seq_r)
    errs = [rel_rms(logits_r[s], logits_t[s]) for s in range(3)] + [rel_rms(cont_r, cont_t)]
    print("logits rel RMS per decoding step, then the continuation:", [f"{e:.1e}" for e in errs])
    assert max(errs) <= 1e-12, errs  # step 0 from the prefill, 1 and 2 from its cached final state
    assert ref_spy.kwargs["output_final_state"] is True
    if TF >= Version("5.14"):  # from 5.14 on a prefill with a cache starts from its recurrent state
        assert ref_spy.kwargs["initial_state"] is not None and torch_spy.kwargs["initial_state"] is not None


def test_transformers_lifecycle_keeps_the_op(tmp_path, ref_spy):
    """from_pretrained, then train() / eval(): transformers re-kernelizes on the "kernels" path."""
    config = qn.tiny_qwen3_next_config()
    qn.build_model(config, seed=5, dtype=torch.float32).save_pretrained(tmp_path)
    m = qn.qwen3_next_modeling()
    kernels_path = qn.integration_path() == "kernels"
    model = m.Qwen3NextForCausalLM.from_pretrained(tmp_path, **({"use_kernels": True} if kernels_path else {}))
    assert not model.training and getattr(model, "use_kernels", False) == kernels_path
    ids = qn.make_input_ids(config, 1, 40, seed=6)
    with qn.enable(model):
        model.train()  # transformers re-kernelizes in Mode.TRAINING when it manages the model's kernels
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
        assert ref_spy.calls == 1
        assert all(p.grad is not None and torch.isfinite(p.grad).all() for p in model.parameters())
        model.eval()  # and in Mode.INFERENCE
        with torch.no_grad():
            model(input_ids=ids, use_cache=False)
        assert ref_spy.calls == 2
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert ref_spy.calls == 2, "closing did not restore transformers' function"
    if kernels_path:
        from kernels import Mode

        for mode in (Mode.TRAINING, Mode.INFERENCE):
            with qn.enable(model, mode=mode), torch.no_grad():
                model(input_ids=ids, use_cache=False)
        assert ref_spy.calls == 4


def test_attachments_nest_and_unwind(setup):
    _, model, ids = setup
    spy_in, spy_out = Spy(qn.torch_chunk_path()), Spy(qn.torch_chunk_path())
    x = ids[:, :16]
    with torch.no_grad():
        with qn.swap_chunk_gated_delta_rule(model, spy_in):
            model(input_ids=x, use_cache=False)
        assert spy_in.calls == 1
        with qn.swap_chunk_gated_delta_rule(model, spy_out):
            with qn.swap_chunk_gated_delta_rule(model, spy_in):  # nested: the inner one wins, then unwinds
                model(input_ids=x, use_cache=False)
            model(input_ids=x, use_cache=False)
        assert (spy_in.calls, spy_out.calls) == (2, 1)
        model(input_ids=x, use_cache=False)  # after the blocks: neither spy
        assert (spy_in.calls, spy_out.calls) == (2, 1)
    outer = qn.enable(model)
    inner = qn.enable(model, backend="reference")
    with pytest.raises(RuntimeError, match="reverse order"):
        outer.close()
    inner.close()
    outer.close()
    outer.close()  # a second close is a no-op
    assert outer.closed and inner.closed


def test_bad_arguments(setup):
    model = setup[1]
    with pytest.raises(ValueError, match="backend must be one of"):
        qn.enable(model, backend="fast")
    with pytest.raises(ValueError, match="backend='flashqla'.*reference"):
        qn.enable(model, backend="flashqla")  # the model is on CPU
    with pytest.raises(TypeError, match="qkv_dtype"):
        qn.enable(model, qkv_dtype="bf16")
    with pytest.raises(ValueError, match="no Qwen3NextGatedDeltaNet"):
        qn.enable(torch.nn.Linear(2, 2))
    with pytest.raises(TypeError, match="impl must be callable"):
        with qn.swap_chunk_gated_delta_rule(model, None):
            pass
    if qn.integration_path() == "kernels":
        from kernels import Mode

        with pytest.raises(TypeError, match="mode"):
            qn.enable(model, mode="training")
        with pytest.raises(ValueError, match="mode"):
            qn.enable(model, mode=Mode.TRAINING | Mode.TORCH_COMPILE)
    assert not qn._OPEN, "a failed enable left an attachment open"


def test_kernel_mapping_by_hand(ref_spy):
    """`kernel_mapping()` with kernels' own calls, as a user would write them on the "kernels" path."""
    config = qn.tiny_qwen3_next_config()
    model = qn.build_model(config, seed=7, dtype=torch.float32)
    ids = qn.make_input_ids(config, 1, 30, seed=8)
    layer = qn.gdn_layers(model)[0]
    funcs = [f for f in getattr(layer, "_kernel_funcs", {}).values() if getattr(type(f), "kernel_layer_name", None) == qn.KERNEL_NAME]
    if qn.integration_path() == "adapter":  # the reason the mapping cannot apply there
        assert not funcs
        return
    from kernels import Mode, kernelize, use_kernel_mapping

    with use_kernel_mapping(qn.kernel_mapping()):
        kernelize(model, mode=Mode.TRAINING, device="cpu")
        model(input_ids=ids, labels=ids, use_cache=False).loss.backward()
    assert ref_spy.calls == 1 and torch.isfinite(layer.A_log.grad).all()
    kernelize(model, mode=Mode.TRAINING, device="cpu")  # outside the mapping: transformers' function again
    with torch.no_grad():
        model(input_ids=ids, use_cache=False)
    assert ref_spy.calls == 1


def test_keep_float64():
    x = torch.randn(3, 4, dtype=torch.float64, requires_grad=True)
    h = torch.randn(3, dtype=torch.float16)
    with qn.keep_float64():
        a, b, c = x.float(), x.to(torch.float32), x.to(dtype=torch.float32, copy=True)
        f = x.to("cpu", torch.float32)
        e, i, z = h.to(torch.float32), torch.arange(3).float(), torch.zeros(2, dtype=torch.float32)
        d = x.to(torch.bfloat16)
    assert a.dtype == b.dtype == c.dtype == f.dtype == e.dtype == i.dtype == z.dtype == torch.float64
    assert d.dtype == torch.bfloat16  # other dtypes are untouched
    (a.sum() + 2 * b.sum() + 3 * c.sum() + 4 * f.sum()).backward()
    assert torch.equal(x.grad, torch.full_like(x, 10.0))
    assert x.float().dtype == torch.float32  # outside the block, fp32 is fp32 again

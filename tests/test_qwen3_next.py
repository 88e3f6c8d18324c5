"""A real client on CPU: transformers' Qwen3-Next gated-delta-net layer calling the reference op.

A one-layer Qwen3-Next causal LM (2 key heads, 4 value heads, head dims 128, one head strongly
decaying; `flashqla.integrations.qwen3_next`) computes its language-modelling loss and the gradient
of every parameter, A_log and dt_bias included, twice: with the layer's own pure-torch chunked
gated delta rule, and with `reference.chunk_gated_delta_rule` swapped in through the layer's call
(q, k not normalised, `use_qk_l2norm_in_kernel=True`, fp32/fp64 g, beta = sigmoid(b)).

- fp64 throughout (`keep_float64`: the layer otherwise casts its torch path, gates, norms and loss
  to fp32): measured <= 1.3e-14 relative RMS per gradient (<= 9e-14 per head of A_log and dt_bias),
  0 on the loss; budgets 1e-10 and 1e-9.
- the stock layer in an fp64 model (its torch path, and in 5.21 and 5.24 the loss, in fp32): measured
  <= 1.8e-5 relative RMS per gradient (A_log and dt_bias, whose gradients sum over every token, are
  the largest; <= 1.5e-4 per head), <= 1.6e-7 on the loss; budgets 2e-4, 1e-3 and 2e-6.
- prefill with output_final_state=True, then three greedy decoding steps from the cached final state
  (a second, full-attention layer makes transformers' cache work): logits agree to <= 1.4e-15
  (budget 1e-12); a transposed state would be off by order 1.

Measured with transformers 4.57.6, 5.0.0, 5.14.0, 5.21.0 and 5.24.0 (which covers both places the
layer finds the function and both q/k head layouts; `flashqla.integrations.qwen3_next`).
Skips when transformers or its Qwen3-Next model code is not importable.
"""

from __future__ import annotations

import pytest
import torch

from flashqla.integrations import qwen3_next as qn
from flashqla.testing import rel_rms

try:
    qn.qwen3_next_modeling()
except qn.Qwen3NextUnavailable as e:
    pytest.skip(f"Qwen3-Next model code not available: {e}", allow_module_level=True)

import reference  # noqa: E402

B, T = 2, 200  # T is not a multiple of the chunk size 64: the torch path pads, the reference does not
PER_HEAD = ("linear_attn.A_log", "linear_attn.dt_bias")


class Spy:
    """Counts the calls of a chunked gated delta rule and keeps the last g it was given."""

    def __init__(self, fn):
        self.fn, self.calls, self.g, self.kwargs = fn, 0, None, None

    def __call__(self, *args, **kwargs):
        self.calls += 1
        self.g = kwargs["g"].detach()
        self.kwargs = {k: v for k, v in kwargs.items() if not isinstance(v, torch.Tensor)}
        return self.fn(*args, **kwargs)


@pytest.fixture(scope="module")
def setup():
    config = qn.tiny_qwen3_next_config()
    model = qn.build_model(config, seed=0, dtype=torch.float64)
    ids = qn.make_input_ids(config, B, T, seed=1)
    return config, model, ids


def _compare(model, ids, float64):
    torch_spy = Spy(qn.torch_chunk_path())
    ref_spy = Spy(qn.adapt_fla_op(reference.chunk_gated_delta_rule))
    loss_t, grads_t = qn.loss_and_grads(model, ids, torch_spy, float64=float64)
    loss_r, grads_r = qn.loss_and_grads(model, ids, ref_spy, float64=float64)
    assert torch_spy.calls == 1 and ref_spy.calls == 1, "the swapped function was not the one the layer called"
    return loss_t, grads_t, loss_r, grads_r, ref_spy


def _check_nonzero(grads):
    for name, gr in grads.items():
        assert torch.isfinite(gr).all(), name
        assert gr.abs().sum() > 0, f"{name}: zero gradient"
        if name.endswith(PER_HEAD):
            assert (gr != 0).all(), f"{name}: a head has a zero gradient: {gr.tolist()}"


def _check_close(loss_t, grads_t, loss_r, grads_r, loss_budget, grad_budget, head_budget):
    assert abs(loss_r.item() - loss_t.item()) <= loss_budget * abs(loss_t.item()), (loss_r.item(), loss_t.item())
    errs = {n: rel_rms(grads_r[n], grads_t[n]) for n in grads_t}
    bad = {n: e for n, e in errs.items() if not e <= grad_budget}
    assert not bad, f"relative RMS over budget {grad_budget:g}: {bad}"
    for name in grads_t:
        if name.endswith(PER_HEAD):  # per head, so that a small head's gradient is not hidden in the RMS
            rel = ((grads_r[name].double() - grads_t[name].double()) / grads_t[name].double()).abs()
            assert (rel <= head_budget).all(), f"{name}: per-head relative error {rel.tolist()}"
    return errs


def test_every_parameter_gradient_fp64(setup):
    config, model, ids = setup
    loss_t, grads_t, loss_r, grads_r, spy = _compare(model, ids, float64=True)
    assert loss_t.dtype == torch.float64 and all(g.dtype == torch.float64 for g in grads_t.values())
    names = set(grads_t)
    assert any(n.endswith("linear_attn.A_log") for n in names) and any(n.endswith("linear_attn.dt_bias") for n in names)
    assert len(names) == sum(1 for _ in model.parameters())
    _check_nonzero(grads_t)
    _check_nonzero(grads_r)
    # the layer's call convention, as the module docstring states it
    assert spy.kwargs["use_qk_l2norm_in_kernel"] is True and spy.kwargs["output_final_state"] is False
    # gates: the last value head decays strongly (exp(g) ~ 2e-4 per token on average), the first barely
    g_mean = spy.g.mean(dim=(0, 1))
    assert g_mean[-1] < -4.0 and g_mean[0] > -0.1, g_mean.tolist()
    _check_close(loss_t, grads_t, loss_r, grads_r, loss_budget=1e-12, grad_budget=1e-10, head_budget=1e-9)


def test_every_parameter_gradient_stock_layer(setup):
    """Without `keep_float64` the layer runs its torch path (and the loss) in fp32 even in an fp64 model."""
    config, model, ids = setup
    loss_t, grads_t, loss_r, grads_r, _ = _compare(model, ids, float64=False)
    _check_nonzero(grads_t)
    errs = _check_close(loss_t, grads_t, loss_r, grads_r, loss_budget=2e-6, grad_budget=2e-4, head_budget=1e-3)
    assert max(errs.values()) > 1e-9, "expected the fp32 torch path to differ from the fp64 reference"


def test_final_state_feeds_decoding():
    """Prefill through the swapped op (output_final_state=True), then decode from its cached state."""
    config = qn.tiny_qwen3_next_config(layer_types=("linear_attention", "full_attention"))
    model = qn.build_model(config, seed=2, dtype=torch.float64)
    ids = qn.make_input_ids(config, B, 100, seed=3)
    torch_spy = Spy(qn.torch_chunk_path())
    ref_spy = Spy(qn.adapt_fla_op(reference.chunk_gated_delta_rule))
    seq_t, logits_t = qn.prefill_and_decode(model, ids, torch_spy, new_tokens=3, float64=True)
    seq_r, logits_r = qn.prefill_and_decode(model, ids, ref_spy, new_tokens=3, float64=True)
    assert torch_spy.calls == ref_spy.calls == 1 and ref_spy.kwargs["output_final_state"] is True
    assert torch.equal(seq_t, seq_r)
    for step in range(3):  # step 0 from the prefill, steps 1 and 2 from the cached final state
        assert rel_rms(logits_r[step], logits_t[step]) <= 1e-12, step


def test_swap_is_undone_and_reaches_every_layer(setup):
    config, model, ids = setup
    spy_in, spy_out = Spy(qn.torch_chunk_path()), Spy(qn.torch_chunk_path())
    with torch.no_grad():
        with qn.swap_chunk_gated_delta_rule(model, spy_in):
            model(input_ids=ids[:, :16], use_cache=False)
        assert spy_in.calls == 1
        with qn.swap_chunk_gated_delta_rule(model, spy_out):
            with qn.swap_chunk_gated_delta_rule(model, spy_in):  # nested: the inner one wins, then unwinds
                model(input_ids=ids[:, :16], use_cache=False)
            model(input_ids=ids[:, :16], use_cache=False)
        assert (spy_in.calls, spy_out.calls) == (2, 1)
        model(input_ids=ids[:, :16], use_cache=False)  # after the blocks: neither spy
        assert (spy_in.calls, spy_out.calls) == (2, 1)
    with pytest.raises(ValueError, match="no Qwen3NextGatedDeltaNet"):
        with qn.swap_chunk_gated_delta_rule(torch.nn.Linear(2, 2), spy_in):
            pass


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

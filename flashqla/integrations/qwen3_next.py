"""transformers' Qwen3-Next gated-delta-net layer with a chosen chunked gated delta rule.

A "real client" of `chunk_gated_delta_rule`: the linear-attention layer of Qwen3-Next
(`transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet`) calls a chunked
gated-delta-rule function during prefill and training. This module

- builds a small random Qwen3-Next causal LM whose one decoder layer is a linear-attention layer
  (`tiny_qwen3_next_config`, `build_model`, `make_input_ids`),
- swaps the function that the layer calls for another implementation, adapted to the layer's call
  (`swap_chunk_gated_delta_rule`, `adapt_fla_op`, `torch_chunk_path`),
- runs forward and backward of the model's language-modelling loss and returns the loss and the
  gradient of every parameter (`loss_and_grads`),
- runs the whole model, the layer's own torch path included, in fp64 (`keep_float64`).

How the layer calls the function (read from transformers 4.57 to 5.24):

- positionally `query, key, value`, then keywords `g=`, `beta=`, `initial_state=`,
  `output_final_state=`, `use_qk_l2norm_in_kernel=True`, and from 5.10 on `cu_seqlens=` (the
  packed-sequence offsets `cu_seq_lens_q`, None for ordinary batches), plus whatever keyword
  arguments the decoder layer forwards (for example `use_cache`), which an implementation ignores.
- query, key `[B, T, Hq, K]` and value `[B, T, HV, V]` in the model's dtype, straight from the
  causal convolution: NOT L2-normalised, the layer asks the function to do it
  (`use_qk_l2norm_in_kernel=True`). Hq == HV up to 5.22 (the layer repeats each q/k head
  HV // H times with `repeat_interleave` before the call); from 5.23 on Hq is the number of key
  heads and the function does that repeat (value head hv reads q/k head hv // (HV // H), FLA's and
  flashqla's convention).
- g `[B, T, HV]` natural-log decay `-exp(A_log) * softplus(a + dt_bias)`, fp32 for a bf16/fp16/fp32
  model (fp64 in an fp64 model); beta `[B, T, HV]` = sigmoid(b) in the model's dtype.
- scale is not passed: K ** -0.5, the default of FLA's op, flashqla's op and the torch path.
- initial_state is None and output_final_state False when the model runs without a cache.
- returns `(o [B, T, HV, V] in query's dtype, final_state [B, HV, K, V] fp32 or None)`.

Where the function lives (found by `swap_chunk_gated_delta_rule`): up to 5.14, the instance
attribute `layer.chunk_gated_delta_rule` (FLA's op when `fla` is importable, else the torch path);
from 5.15 on, the module global `torch_chunk_gated_delta_rule` that `forward` looks up at call time
(a wrapper that hands over to FLA's op when `fla` is importable). `torch_chunk_path` returns the
layer's own pure-PyTorch function in either case. Only this function is swapped: the causal
convolution, the gated norm (FLA's fused one up to 5.14 when `fla` is importable) and the
single-token decoding step stay whatever the installed transformers picks.

Importing this module does not import transformers; every function that needs it raises
`Qwen3NextUnavailable` (an ImportError) with the reason when it cannot be imported.

Source: transformers `models/qwen3_next/modeling_qwen3_next.py` (`Qwen3NextGatedDeltaNet.forward`,
`torch_chunk_gated_delta_rule`) and `configuration_qwen3_next.py`, versions 4.57.0 to 5.24.0
(the tests ran with 4.57.6, 5.0.0, 5.14.0, 5.21.0 and 5.24.0).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch
from torch.overrides import TorchFunctionMode

__all__ = [
    "Qwen3NextUnavailable",
    "qwen3_next_modeling",
    "tiny_qwen3_next_config",
    "build_model",
    "cast_model",
    "make_input_ids",
    "adapt_fla_op",
    "torch_chunk_path",
    "swap_chunk_gated_delta_rule",
    "keep_float64",
    "loss_and_grads",
    "prefill_and_decode",
    "gdn_layers",
]

#: Name of the layer's chunked gated delta rule: instance attribute (transformers <= 5.14) and
#: module-level pure-torch function (all versions).
_ATTR = "chunk_gated_delta_rule"
_TORCH_FN = "torch_chunk_gated_delta_rule"
_LAYER_CLASS = "Qwen3NextGatedDeltaNet"
#: The pure-torch function per modeling module, taken at first import (a swap may replace the global).
_TORCH_PATH: dict[str, Callable] = {}


class Qwen3NextUnavailable(ImportError):
    """transformers, or its Qwen3-Next model code in a form this module understands, is not there."""


def qwen3_next_modeling():
    """Import and return `transformers.models.qwen3_next.modeling_qwen3_next`.

    Raises:
        Qwen3NextUnavailable: transformers is not installed, has no Qwen3-Next model (it appeared in
            4.57), or its layer has no chunked gated delta rule this module can find.
    """
    try:
        import transformers
    except Exception as e:  # noqa: BLE001 - any import failure means "not usable here"
        raise Qwen3NextUnavailable(f"transformers is not importable ({type(e).__name__}: {e})") from e
    try:
        from transformers.models.qwen3_next import modeling_qwen3_next as m
    except Exception as e:  # noqa: BLE001
        raise Qwen3NextUnavailable(
            f"transformers {transformers.__version__} has no usable Qwen3-Next model code "
            f"(needs >= 4.57; {type(e).__name__}: {e})"
        ) from e
    for name in (_LAYER_CLASS, _TORCH_FN, "Qwen3NextForCausalLM"):
        if not hasattr(m, name):
            raise Qwen3NextUnavailable(f"transformers {transformers.__version__}: modeling_qwen3_next has no {name}")
    if m.__name__ not in _TORCH_PATH:  # first use, before any swap touches the module global
        fn = inspect.unwrap(getattr(m, _TORCH_FN))
        code = getattr(fn, "__code__", None)
        if getattr(fn, "__name__", None) != _TORCH_FN or code is None or code.co_filename != m.__file__:
            raise Qwen3NextUnavailable(
                f"transformers {transformers.__version__}: cannot find the pure-torch {_TORCH_FN} under its wrappers (found {fn!r})"
            )
        _TORCH_PATH[m.__name__] = fn
    return m


def tiny_qwen3_next_config(
    *,
    num_k_heads: int = 2,
    num_v_heads: int = 4,
    head_k_dim: int = 128,
    head_v_dim: int = 128,
    hidden_size: int = 64,
    intermediate_size: int = 96,
    vocab_size: int = 64,
    conv_kernel: int = 4,
    layer_types: Sequence[str] = ("linear_attention",),
):
    """A small Qwen3-Next config; by default one decoder layer, a linear-attention (GDN) layer.

    Defaults: 2 key heads and 4 value heads (GVA 2), head dims 128 (flashqla's fast path), hidden
    size 64, a dense MLP in every layer (no mixture of experts, whose discrete top-k routing could
    flip between two precisions and make gradients incomparable), vocabulary 64, `use_cache=False`.
    `layer_types` lists "linear_attention" / "full_attention" per layer (transformers' cache for
    generation needs at least one full-attention layer; its attention has 2 heads of dim 32).
    Returns a `transformers.Qwen3NextConfig`.
    """
    m = qwen3_next_modeling()
    return m.Qwen3NextConfig(
        vocab_size=vocab_size,
        hidden_size=hidden_size,
        intermediate_size=intermediate_size,
        num_hidden_layers=len(layer_types),
        layer_types=list(layer_types),
        mlp_only_layers=list(range(len(layer_types))),
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=32,
        linear_conv_kernel_dim=conv_kernel,
        linear_key_head_dim=head_k_dim,
        linear_value_head_dim=head_v_dim,
        linear_num_key_heads=num_k_heads,
        linear_num_value_heads=num_v_heads,
        num_experts=4,
        num_experts_per_tok=2,
        moe_intermediate_size=32,
        shared_expert_intermediate_size=32,
        use_cache=False,
        tie_word_embeddings=False,
        # read by transformers <= 5.14 when `fla` is importable (its fused gated norm is built in it)
        dtype=torch.float32,
    )


def default_decay(num_v_heads: int) -> tuple[list[float], list[float]]:
    """Per value head (A, dt_bias), from long memory to strong decay.

    A runs geometrically from 0.05 to 8 and dt_bias linearly from -2 to 0.5, so that with a ~ N(0, 1)
    the gate g = -A softplus(a + dt_bias) is about -0.006 per token on the first head (memory over
    hundreds of tokens) and about -8 on the last (exp(g) ~ 3e-4: the state forgets within a token or
    two, yet every gradient stays far from underflow).
    """
    if num_v_heads == 1:
        return [1.0], [0.0]
    A = [0.05 * (8.0 / 0.05) ** (i / (num_v_heads - 1)) for i in range(num_v_heads)]
    dt = [-2.0 + 2.5 * i / (num_v_heads - 1) for i in range(num_v_heads)]
    return A, dt


def build_model(
    config=None,
    *,
    seed: int = 0,
    A: Sequence[float] | None = None,
    dt_bias: Sequence[float] | None = None,
    dtype: torch.dtype = torch.float64,
    device: str | torch.device = "cpu",
):
    """A `Qwen3NextForCausalLM` with seeded random weights, in eval mode.

    Every parameter is set here from a CPU generator seeded with `seed` (transformers' own init and
    the global RNG play no part, so the weights are the same across transformers versions): linear
    and LM-head weights N(0, 1 / fan_in), the embedding N(0, 1), the depthwise convolution
    N(0, 1 / kernel), every norm weight 1 + N(0, 0.1^2), `A_log = log(A)` and `dt_bias` per value
    head from `A`, `dt_bias` (default `default_decay`: one head strongly decaying). Weights are drawn
    in fp64, then cast to `dtype` and moved to `device`.

    Args:
        config: a `Qwen3NextConfig` (default `tiny_qwen3_next_config()`).
        A, dt_bias: per value head, length `config.linear_num_value_heads`; A > 0.
    """
    m = qwen3_next_modeling()
    config = tiny_qwen3_next_config() if config is None else config
    HV = config.linear_num_value_heads
    dA, ddt = default_decay(HV)
    A = dA if A is None else list(A)
    dt_bias = ddt if dt_bias is None else list(dt_bias)
    if len(A) != HV or len(dt_bias) != HV or min(A) <= 0:
        raise ValueError(f"A and dt_bias need {HV} entries each and A > 0; got A={A}, dt_bias={dt_bias}")
    with torch.device("cpu"):
        model = m.Qwen3NextForCausalLM(config)
    gen = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            leaf = name.rsplit(".", 1)[-1]
            if leaf == "A_log":
                w = torch.tensor(A, dtype=torch.float64).log()
            elif leaf == "dt_bias":
                w = torch.tensor(dt_bias, dtype=torch.float64)
            elif "norm" in name.lower():
                w = 1.0 + 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            elif "embed" in name:
                w = torch.randn(p.shape, generator=gen, dtype=torch.float64)
            elif "conv1d" in name:
                w = torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p.shape[-1])
            elif p.dim() == 2:
                w = torch.randn(p.shape, generator=gen, dtype=torch.float64) / math.sqrt(p.shape[1])
            else:
                w = 0.1 * torch.randn(p.shape, generator=gen, dtype=torch.float64)
            p.copy_(w.to(p.dtype))
    return model.to(device=device, dtype=dtype).eval()


def cast_model(model, dtype: torch.dtype | None = None, device: str | torch.device | None = None):
    """A deep copy of `model` cast to `dtype` and moved to `device` (the original is untouched)."""
    kw = {k: v for k, v in (("dtype", dtype), ("device", device)) if v is not None}
    return copy.deepcopy(model).to(**kw)


def make_input_ids(config, batch: int, seq_len: int, *, seed: int = 1, device: str | torch.device = "cpu") -> torch.Tensor:
    """Random token ids `[batch, seq_len]` int64 in `[0, config.vocab_size)`, from a seeded generator."""
    gen = torch.Generator().manual_seed(seed)
    return torch.randint(0, config.vocab_size, (batch, seq_len), generator=gen).to(device)


def gdn_layers(model) -> list:
    """Every `Qwen3NextGatedDeltaNet` module of `model` (or `[model]` when it is one)."""
    m = qwen3_next_modeling()
    return [mod for mod in model.modules() if isinstance(mod, m.Qwen3NextGatedDeltaNet)]


def adapt_fla_op(op: Callable, *, qkv_dtype: torch.dtype | None = None) -> Callable:
    """Wrap an op with FLA's signature so that the Qwen3-Next layer can call it.

    `op(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    use_qk_l2norm_in_kernel=False)` is `flashqla.chunk_gated_delta_rule` or
    `reference.chunk_gated_delta_rule`. The returned function takes the torch path's arguments
    (`query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, cu_seqlens=None, **kwargs`) and passes them on unchanged: layout,
    dtypes and the L2-norm flag already follow FLA's convention (the module docstring says how the
    layer calls). scale stays at its default K ** -0.5, as in the torch path; `chunk_size` is
    ignored (the result does not depend on it; FLA's op fixes it too), and so is any other keyword
    the layer forwards. Returns `op`'s `(o, final_state)`.

    Args:
        qkv_dtype: when given, q, k, v are cast to it before the call and o back to the query's
            dtype after it (for example bf16 for flashqla's op inside an fp32 model); g, beta and
            the states are left as they are. None (default): no cast at all.
    """

    def chunk_gated_delta_rule(
        query,
        key,
        value,
        g,
        beta,
        chunk_size: int = 64,
        initial_state=None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        cu_seqlens=None,
        **unused: Any,
    ):
        out_dtype = query.dtype
        if qkv_dtype is not None:
            query, key, value = (x.to(qkv_dtype) for x in (query, key, value))
        o, final_state = op(
            query,
            key,
            value,
            g,
            beta,
            initial_state=initial_state,
            output_final_state=bool(output_final_state),
            cu_seqlens=cu_seqlens,
            use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
        )
        if qkv_dtype is not None:
            o = o.to(out_dtype)
        return o, final_state

    chunk_gated_delta_rule.wrapped_op = op
    return chunk_gated_delta_rule


def torch_chunk_path() -> Callable:
    """The layer's own pure-PyTorch chunked gated delta rule (`torch_chunk_gated_delta_rule`).

    In transformers >= 5.15 the module attribute is a wrapper that hands over to FLA when `fla` is
    importable; this returns the function underneath (followed through `__wrapped__`), so the
    comparison is always against the torch path, whatever else is installed. Note that it computes
    in fp32 whatever the model dtype (it casts q, k, v, g, beta to fp32), unless run under
    `keep_float64`.
    """
    m = qwen3_next_modeling()
    return _TORCH_PATH[m.__name__]


def _call_site(layer) -> tuple[str, Any]:
    """Where `layer.forward` finds its chunked gated delta rule: ("attribute", layer) or ("global", dict)."""
    if _ATTR in vars(layer):
        return "attribute", layer
    fwd = inspect.unwrap(type(layer).forward)
    if _TORCH_FN in fwd.__code__.co_names:
        return "global", fwd.__globals__
    import transformers

    raise Qwen3NextUnavailable(
        f"transformers {transformers.__version__}: {type(layer).__name__}.forward calls neither "
        f"self.{_ATTR} nor {_TORCH_FN}; this version's call convention is not supported"
    )


@contextlib.contextmanager
def swap_chunk_gated_delta_rule(model, impl: Callable) -> Iterator[None]:
    """Within the block, every Qwen3-Next GDN layer of `model` calls `impl` for its chunked prefill.

    `impl` takes the layer's call (see the module docstring): use `torch_chunk_path()`, or
    `adapt_fla_op(op)` for an op with FLA's signature. Up to transformers 5.14 the layers' instance
    attribute is replaced; from 5.15 the module global the layers' forward looks up (so the swap
    reaches every Qwen3-Next layer of the process while the block runs: not thread-safe). Restored
    on exit. The single-token decoding path (a cache and one token) is not swapped.

    Raises:
        Qwen3NextUnavailable: the layer's call convention is not recognised.
        ValueError: `model` has no Qwen3-Next GDN layer.
    """
    layers = gdn_layers(model)
    if not layers:
        raise ValueError("the model has no Qwen3NextGatedDeltaNet layer")
    undo: list[Callable[[], None]] = []
    patched_globals: set[int] = set()
    try:
        for layer in layers:
            kind, where = _call_site(layer)
            if kind == "attribute":
                old = where.__dict__[_ATTR]
                setattr(where, _ATTR, impl)
                undo.append(lambda w=where, o=old: setattr(w, _ATTR, o))
            elif id(where) not in patched_globals:  # one module dict, shared by its layers
                patched_globals.add(id(where))
                old = where[_TORCH_FN]
                where[_TORCH_FN] = impl
                undo.append(lambda w=where, o=old: w.__setitem__(_TORCH_FN, o))
        yield
    finally:
        for u in reversed(undo):
            u()


class _KeepFloat64(TorchFunctionMode):
    """Replaces the dtype torch.float32 by torch.float64 in every torch call, and `.float()` by `.double()`."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = {} if kwargs is None else kwargs
        if func is torch.Tensor.float:
            return torch.Tensor.double(*args, **kwargs)
        args = tuple(torch.float64 if a is torch.float32 else a for a in args)
        kwargs = {k: (torch.float64 if v is torch.float32 else v) for k, v in kwargs.items()}
        return func(*args, **kwargs)


@contextlib.contextmanager
def keep_float64() -> Iterator[None]:
    """Within the block, torch calls that ask for fp32 get fp64: `.float()`, `.to(torch.float32)`,
    `dtype=torch.float32`.

    The Qwen3-Next layer computes its torch path, its gates and its norms in fp32 whatever the model
    dtype (explicit `.float()` / `.to(torch.float32)` casts), and transformers' loss casts the logits
    to fp32. Under this mode an fp64 model runs in fp64 throughout, so the layer's torch path becomes
    an fp64 reference of the layer's own definition. A torch function mode: it sees only dtype
    arguments passed directly to a torch function or tensor method (not inside lists); other dtypes
    are untouched; the backward of a cast that did not happen is the identity.
    """
    with _KeepFloat64():
        yield


def loss_and_grads(
    model,
    input_ids: torch.Tensor,
    impl: Callable | None = None,
    *,
    float64: bool = False,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Forward and backward of the causal-LM loss; returns the loss and every parameter's gradient.

    The loss is transformers' mean next-token cross entropy with `labels=input_ids`, run without a
    cache (no final state). With `impl` the GDN layers call it (`swap_chunk_gated_delta_rule`);
    without, whatever the installed transformers picks (FLA when importable, else the torch path).
    `float64=True` runs under `keep_float64` (for an fp64 model: fp64 throughout).

    Args:
        model: a `Qwen3NextForCausalLM` (for example from `build_model`); its gradients are reset.
        input_ids: `[B, T]` int64 token ids on the model's device.

    Returns:
        (loss, grads): the detached scalar loss (fp32 for a bf16/fp16 model, the model's dtype
        otherwise) and `{parameter name: gradient}` (detached clones, each in its parameter's dtype).

    Raises:
        RuntimeError: a parameter received no gradient.
    """
    model.zero_grad(set_to_none=True)
    swap = contextlib.nullcontext() if impl is None else swap_chunk_gated_delta_rule(model, impl)
    prec = keep_float64() if float64 else contextlib.nullcontext()
    with swap, prec, torch.enable_grad():
        out = model(input_ids=input_ids, labels=input_ids, use_cache=False)
        out.loss.backward()
    grads = {}
    for name, p in model.named_parameters():
        if p.grad is None:
            raise RuntimeError(f"parameter {name} received no gradient")
        grads[name] = p.grad.detach().clone()
    model.zero_grad(set_to_none=True)
    return out.loss.detach(), grads


def prefill_and_decode(
    model,
    input_ids: torch.Tensor,
    impl: Callable | None = None,
    *,
    new_tokens: int = 3,
    float64: bool = False,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy generation with a cache: the prefill's final state feeds the decoding steps.

    The prompt runs through the chunked gated delta rule (`impl` when given) with
    `output_final_state=True`; its final state `[B, HV, K, V]` goes into transformers' cache and
    each new token runs the layer's single-token recurrent path from it (not swapped). So the
    logits of steps 2, 3, ... check the final state's values and layout. The model needs a
    full-attention layer for transformers' cache (`tiny_qwen3_next_config(layer_types=...)`).

    Args:
        model: a `Qwen3NextForCausalLM`; input_ids: `[B, T]` int64 on its device.
        float64: run under `keep_float64` (an fp64 model then decodes in fp64 throughout).

    Returns:
        (sequences, logits): `[B, T + new_tokens]` token ids and `[new_tokens, B, vocab]` logits
        (step 1 from the prefill, later steps from the cached state), no gradients.
    """
    swap = contextlib.nullcontext() if impl is None else swap_chunk_gated_delta_rule(model, impl)
    prec = keep_float64() if float64 else contextlib.nullcontext()
    with swap, prec, torch.no_grad():
        out = model.generate(
            input_ids,
            max_new_tokens=new_tokens,
            min_new_tokens=new_tokens,
            do_sample=False,
            use_cache=True,
            output_logits=True,
            return_dict_in_generate=True,
            pad_token_id=0,
        )
    return out.sequences, torch.stack(out.logits)

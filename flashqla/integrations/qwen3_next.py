"""transformers' Qwen3-Next gated-delta-net layer running flashqla's chunked gated delta rule.

The linear-attention layer of Qwen3-Next
(`transformers.models.qwen3_next.modeling_qwen3_next.Qwen3NextGatedDeltaNet`) calls a chunked
gated-delta-rule function during prefill and training. `enable` makes every such layer of a model
call ours instead:

    from flashqla.integrations import qwen3_next

    att = qwen3_next.enable(model)        # until att.close()
    with qwen3_next.enable(model):        # or for a block
        ...

The op (`backend`, the one way to choose it):

- "auto" (default): by the device of the layer's tensors at each call: on a CUDA GPU of compute
  capability 9.x `flashqla.chunk_gated_delta_rule` (q, k, v in bf16 or fp16: a bf16/fp16 model, or
  pass `qkv_dtype`), on CPU `reference.chunk_gated_delta_rule` (any float dtype, fp64 included);
  any other device is an error.
- "flashqla": `flashqla.chunk_gated_delta_rule` only (a Hopper GPU).
- "reference": `reference.chunk_gated_delta_rule` on any device.

How it attaches depends on what the installed transformers exposes (`integration_path()` says which,
found by inspecting the installed code, not from version numbers):

- "kernels", transformers' own mechanism for replacing this function: transformers >= 5.15 with the
  `kernels` package installed in the version range that transformers accepts (5.25 requires
  kernels >= 0.19.1, < 0.20; 5.15 to 5.24 take it from their optional `kernels` extra, for example
  0.16.x for 5.15 and 0.18.x for 5.24, and only while USE_HUB_KERNELS does not switch it off).
  There the module global `torch_chunk_gated_delta_rule` is decorated with
  `use_kernel_func_from_hub_with_fallback("chunk_gated_delta_rule", "fla")`, which turns it into a
  `kernels` function layer named "chunk_gated_delta_rule", and `use_kernelized_func` attaches that
  layer to each Qwen3NextGatedDeltaNet. `enable` puts a kernel mapping in force
  (`kernels.use_kernel_mapping`) from "chunk_gated_delta_rule", for the model's device (a CUDA
  device by its exact compute capability) and for Mode.TRAINING and Mode.INFERENCE alike (not
  Mode.TORCH_COMPILE: a model kernelized for torch.compile keeps transformers' function), to a
  local repository whose stateless layer calls our op (`kernel_mapping` builds the same mapping
  for `kernels.register_kernel_mapping`), then runs `kernels.kernelize` on the GDN layers' chunk
  functions only: the convolution, the gated norm and the single-token decoding step keep whatever
  they had. The mapping stays in force until `close()`, so transformers' own re-kernelization
  (`model.train()` / `model.eval()` of a model kernelized by transformers, as `from_pretrained`
  does by default from 5.25 on, earlier with `use_kernels=True`) keeps our op. With kernels < 0.18
  (for example transformers 5.15 with kernels 0.16, 5.20 with 0.17) one function layer is shared by
  every model of the process, so the replacement is process-wide; from kernels 0.18 on each layer
  has its own.
- "adapter", for the versions without that mechanism: transformers 4.57 to 5.14 (the instance
  attribute `layer.chunk_gated_delta_rule`, FLA's op when `fla` is importable, else the torch
  path, is replaced on each layer), and 5.15 to 5.24 without a matching `kernels` (the module
  global `torch_chunk_gated_delta_rule`, then a plain wrapper that hands over to FLA's op when
  `fla` is importable, is replaced: process-wide while attached).

Either way `close()` puts back exactly what was there before `enable`; attachments close in the
reverse order of opening.

How the layer calls the function (read from transformers 4.57 to 5.25):

- positionally `query, key, value`, then keywords `g=`, `beta=`, `initial_state=`,
  `output_final_state=`, `use_qk_l2norm_in_kernel=True`, and from 5.10 on `cu_seqlens=` (the
  packed-sequence offsets `cu_seq_lens_q`, None for ordinary batches), plus whatever keyword
  arguments the decoder layer forwards (for example `use_cache`), which are ignored.
- query, key `[B, T, Hq, K]` and value `[B, T, HV, V]` in the model's dtype, straight from the
  causal convolution: NOT L2-normalised, the layer asks the function to do it
  (`use_qk_l2norm_in_kernel=True`). Hq == HV up to 5.22 (the layer repeats each q/k head
  HV // H times with `repeat_interleave` before the call); from 5.23 on Hq is the number of key
  heads and the function does that repeat (value head hv reads q/k head hv // (HV // H), FLA's and
  flashqla's convention).
- g `[B, T, HV]` natural-log decay `-exp(A_log) * softplus(a + dt_bias)`, fp32 for a bf16/fp16/fp32
  model (fp64 in an fp64 model, whose dt_bias promotes it); beta `[B, T, HV]` = sigmoid(b) in the
  model's dtype.
- scale is not passed: K ** -0.5, the default of FLA's op, of ours and of the torch path (a `scale=`
  keyword, should a version pass one, is handed on to the op).
- initial_state: 4.57 always passes None; 5.14 and later pass the cache's recurrent state when the
  cache holds one (a prefill that continues a cached sequence), else None. output_final_state is
  True exactly when the model runs with a cache.
- returns `(o [B, T, HV, V] in query's dtype, final_state [B, HV, K, V] fp32 or None)`.

Importing this module imports neither transformers nor kernels; a function that needs transformers
raises `Qwen3NextUnavailable` (an ImportError) when it cannot be imported, and `IntegrationError`
(a RuntimeError) when transformers is there but the op cannot be attached.

The rest of the module serves the tests: a small random Qwen3-Next causal LM
(`tiny_qwen3_next_config`, `build_model`, `make_input_ids`), the layer's own pure-PyTorch function
(`torch_chunk_path`), any function with the layer's call swapped in for a block
(`swap_chunk_gated_delta_rule`, through the same two mechanisms), the loss and every parameter
gradient (`loss_and_grads`), greedy decoding from the prefill's cached state (`prefill_and_decode`)
and an fp64 run of the whole model (`keep_float64`).

Source: transformers `models/qwen3_next/modeling_qwen3_next.py`, `integrations/hub_kernels.py` and
`utils/kernel_config.py`, kernels `layer/` (`kernelize`, `use_kernel_mapping`, `use_kernelized_func`).
The tests ran with transformers 4.57.6, 5.14.0, 5.15.0 (kernels 0.16.2), 5.20.0 (kernels 0.17.2),
5.24.0 (with kernels 0.18.3 and without a matching kernels) and 5.25.0 (kernels 0.19.1).
"""

from __future__ import annotations

import contextlib
import copy
import inspect
import math
import os
from collections.abc import Callable, Iterator, Sequence
from typing import Any

import torch

from flashqla.faces import face
from torch.overrides import TorchFunctionMode

__all__ = [
    "Qwen3NextUnavailable",
    "IntegrationError",
    "BACKENDS",
    "KERNEL_NAME",
    "qwen3_next_modeling",
    "integration_path",
    "select_op",
    "enable",
    "Attachment",
    "kernel_mapping",
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
    "PooledPrefill",
    "gdn_layers",
]

#: The name under which transformers (>= 5.15) exposes the function to `kernels`' mappings.
KERNEL_NAME = "chunk_gated_delta_rule"
#: The choices of `enable`'s `backend` (see the module docstring).
BACKENDS = ("auto", "flashqla", "reference")
#: Instance attribute (transformers <= 5.14) and module-level function (all versions).
_ATTR = "chunk_gated_delta_rule"
_TORCH_FN = "torch_chunk_gated_delta_rule"
_LAYER_CLASS = "Qwen3NextGatedDeltaNet"
#: The pure-torch function per modeling module, found at first import (before any swap).
_TORCH_PATH: dict[str, Callable | str] = {}


class Qwen3NextUnavailable(ImportError):
    """transformers, or its Qwen3-Next model code (transformers >= 4.57), cannot be imported."""


class IntegrationError(RuntimeError):
    """transformers is installed but flashqla's op cannot be attached to its Qwen3-Next layer."""


def qwen3_next_modeling():
    """Import and return `transformers.models.qwen3_next.modeling_qwen3_next`.

    Raises:
        Qwen3NextUnavailable: transformers is not installed, or has no Qwen3-Next model (it appeared
            in 4.57).
        IntegrationError: the model code lacks a name this module relies on
            (`Qwen3NextGatedDeltaNet`, `torch_chunk_gated_delta_rule`, `Qwen3NextForCausalLM`).
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
            raise IntegrationError(f"transformers {transformers.__version__}: modeling_qwen3_next has no {name}")
    if m.__name__ not in _TORCH_PATH:  # first use, before any swap touches the module global
        _TORCH_PATH[m.__name__] = _find_torch_path(m, transformers.__version__)
    return m


def _is_kernels_function(fn) -> bool:
    """True when `fn` is a `kernels` function layer registered under KERNEL_NAME."""
    return isinstance(fn, torch.nn.Module) and getattr(type(fn), "kernel_layer_name", None) == KERNEL_NAME


def _find_torch_path(m, version: str) -> Callable | str:
    """The pure-torch function under the module global's wrappers, or a message saying why not."""
    fn = getattr(m, _TORCH_FN)
    if _is_kernels_function(fn):
        # a `kernels` function layer keeps the function it was made from in its forward's closure
        fn = inspect.getclosurevars(type(fn).forward).nonlocals.get("func", fn)
    fn = inspect.unwrap(fn)
    code = getattr(fn, "__code__", None)
    if getattr(fn, "__name__", None) != _TORCH_FN or code is None or code.co_filename != m.__file__:
        return f"transformers {version}: cannot find the pure-torch {_TORCH_FN} under its wrappers (found {fn!r})"
    return fn


def integration_path() -> str:
    """How `enable` attaches with the installed transformers: "kernels" or "adapter".

    "kernels" when `modeling_qwen3_next.torch_chunk_gated_delta_rule` is a `kernels` function layer
    named "chunk_gated_delta_rule" (transformers >= 5.15 with a `kernels` it accepts), "adapter"
    otherwise; the module docstring says what each does.

    Raises:
        Qwen3NextUnavailable: transformers or its Qwen3-Next model code cannot be imported.
    """
    m = qwen3_next_modeling()
    return "kernels" if _is_kernels_function(getattr(m, _TORCH_FN)) else "adapter"


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


# ---------------------------------------------------------------------------------------------
# The op and the layer's call convention
# ---------------------------------------------------------------------------------------------


def _check_backend(backend) -> str:
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}")
    return backend


def _check_qkv_dtype(qkv_dtype) -> torch.dtype | None:
    if qkv_dtype is not None and not (isinstance(qkv_dtype, torch.dtype) and qkv_dtype.is_floating_point):
        raise TypeError(f"qkv_dtype must be None or a floating torch.dtype, got {qkv_dtype!r}")
    return qkv_dtype


def select_op(backend: str, device: torch.device | str) -> Callable:
    """The op with FLA's signature that `backend` runs for tensors on `device`.

    "auto": `flashqla.chunk_gated_delta_rule` on a CUDA device of compute capability 9.x,
    `reference.chunk_gated_delta_rule` on CPU; "flashqla" and "reference" as named. The op is
    looked up in its module at each call (so a patched module attribute is honoured).

    Raises:
        ValueError: `backend` is not one of BACKENDS, or it cannot run on `device` ("auto" on a
            device that is neither CPU nor a 9.x CUDA GPU, "flashqla" off such a GPU).
    """
    _check_backend(backend)
    device = torch.device(device)
    if backend == "reference" or (backend == "auto" and device.type == "cpu"):
        return face("reference").chunk_gated_delta_rule
    on_hopper = device.type == "cuda" and torch.version.hip is None and torch.cuda.get_device_capability(device)[0] == 9
    if not on_hopper:
        raise ValueError(
            f"backend={backend!r}: flashqla's kernels need a CUDA GPU of compute capability 9.x (Hopper) and the "
            f"layer's tensors are on {device}; backend='reference' (reference.chunk_gated_delta_rule) runs on any device"
        )
    import flashqla

    return flashqla.chunk_gated_delta_rule


def host_offsets_kwargs(op: Callable, cu_seqlens_cpu, q, cu_seqlens) -> dict:
    """The keyword arguments that hand an engine's host copy of its offsets to `op`: `{"cu_seqlens_cpu":
    cu_seqlens_cpu}` for flashqla's op (its planner costs the plan and the value-slice width on the
    lengths and knows that the offsets end at T: `flashqla.contract.planning_seqlens`; the op checks
    the copy after its own arguments), `{}` for the reference op, which has no planner, after the same
    check of the copy (so that a bad copy raises on every backend; skipped where q or cu_seqlens is
    malformed, which the reference op then reports itself). None: `{}`. Raises TypeError /
    ValueError naming `cu_seqlens_cpu` (not an int32/int64 CPU tensor of cu_seqlens' shape, values
    that do not start at 0, decrease or end other than at T, or given without cu_seqlens)."""
    if cu_seqlens_cpu is None:
        return {}
    if op is not face("reference").chunk_gated_delta_rule:
        return {"cu_seqlens_cpu": cu_seqlens_cpu}
    from flashqla.contract import planning_seqlens

    q_ok = isinstance(q, torch.Tensor) and q.dim() == 4 and q.shape[0] == 1
    cu_ok = isinstance(cu_seqlens, torch.Tensor) and cu_seqlens.dim() == 1 and cu_seqlens.shape[0] >= 2
    if cu_seqlens is None or (q_ok and cu_ok):
        planning_seqlens(cu_seqlens_cpu, cu_seqlens, q.shape[1] if q_ok else 0)
    return {}


def rename_offsets(exc: Exception, names: tuple[str, str]) -> Exception:
    """`exc` (a TypeError or ValueError of the op) with flashqla's offset argument names replaced by an
    engine's: `names` = (host copy, device offsets), e.g. SGLang's ("query_start_loc_cpu",
    "query_start_loc"); the same exception type (the caller chains it: `raise ... from exc`)."""
    msg = str(exc).replace("cu_seqlens_cpu", "\0").replace("cu_seqlens' ", names[1] + "'s ")
    return type(exc)(msg.replace("cu_seqlens", names[1]).replace("\0", names[0]))


def _call_op(op, qkv_dtype, query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, kwargs):
    """Call `op` (FLA's signature) with the layer's arguments; see `adapt_fla_op`."""
    out_dtype = query.dtype
    if qkv_dtype is not None:
        query, key, value = (x.to(qkv_dtype) for x in (query, key, value))
    o, final_state = op(
        query,
        key,
        value,
        g,
        beta,
        scale=kwargs.get("scale"),
        initial_state=initial_state,
        output_final_state=bool(output_final_state),
        cu_seqlens=kwargs.get("cu_seqlens"),
        use_qk_l2norm_in_kernel=bool(use_qk_l2norm_in_kernel),
    )
    if qkv_dtype is not None:
        o = o.to(out_dtype)
    return o, final_state


def adapt_fla_op(op: Callable, *, qkv_dtype: torch.dtype | None = None) -> Callable:
    """Wrap an op with FLA's signature so that the Qwen3-Next layer can call it.

    `op(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    use_qk_l2norm_in_kernel=False)` is `flashqla.chunk_gated_delta_rule` or
    `reference.chunk_gated_delta_rule`. The returned function takes the torch path's arguments
    (`query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
    use_qk_l2norm_in_kernel=False, **kwargs`) and passes them on unchanged: layout, dtypes and the
    L2-norm flag already follow FLA's convention (the module docstring says how the layer calls).
    Of the keywords only `cu_seqlens` and `scale` reach the op (scale None: K ** -0.5, as in the
    torch path); `chunk_size` is ignored (the result does not depend on it; FLA's op fixes it too),
    and so is any other keyword the layer forwards. Returns `op`'s `(o, final_state)`.

    Args:
        qkv_dtype: when given, q, k, v are cast to it before the call and o back to the query's
            dtype after it (for example bf16 for flashqla's op inside an fp32 model); g, beta and
            the states are left as they are. None (default): no cast at all.
    """
    qkv_dtype = _check_qkv_dtype(qkv_dtype)

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
        **kwargs: Any,
    ):
        return _call_op(op, qkv_dtype, query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, kwargs)

    chunk_gated_delta_rule.wrapped_op = op
    return chunk_gated_delta_rule


class _BackendCall:
    """The layer's call convention, running `select_op(backend, query.device)` at each call."""

    def __init__(self, backend: str, qkv_dtype: torch.dtype | None):
        self.backend, self.qkv_dtype = _check_backend(backend), _check_qkv_dtype(qkv_dtype)

    def __call__(
        self,
        query,
        key,
        value,
        g,
        beta,
        chunk_size: int = 64,
        initial_state=None,
        output_final_state: bool = False,
        use_qk_l2norm_in_kernel: bool = False,
        **kwargs: Any,
    ):
        op = select_op(self.backend, query.device)
        return _call_op(op, self.qkv_dtype, query, key, value, g, beta, initial_state, output_final_state, use_qk_l2norm_in_kernel, kwargs)

    def __eq__(self, other):
        return isinstance(other, _BackendCall) and (self.backend, self.qkv_dtype) == (other.backend, other.qkv_dtype)

    def __hash__(self):
        return hash((_BackendCall, self.backend, self.qkv_dtype))

    def __repr__(self):
        return f"flashqla backend {self.backend!r}" + ("" if self.qkv_dtype is None else f" (q, k, v in {self.qkv_dtype})")


def torch_chunk_path() -> Callable:
    """The layer's own pure-PyTorch chunked gated delta rule (`torch_chunk_gated_delta_rule`).

    From transformers 5.15 on the module attribute is a wrapper that hands over to FLA when `fla` is
    importable (and, with `kernels`, a `kernels` function layer around that wrapper); this returns
    the function underneath, so that a comparison is always against the torch path, whatever else
    is installed. Note that it computes in fp32 whatever the model dtype (it casts q, k, v, g, beta
    to fp32), unless run under `keep_float64`.

    Raises:
        Qwen3NextUnavailable: transformers or its Qwen3-Next model code cannot be imported.
        IntegrationError: the function cannot be found under its wrappers.
    """
    m = qwen3_next_modeling()
    fn = _TORCH_PATH[m.__name__]
    if isinstance(fn, str):
        raise IntegrationError(fn)
    return fn


# ---------------------------------------------------------------------------------------------
# Attaching: transformers' kernel mapping ("kernels") or the older call sites ("adapter")
# ---------------------------------------------------------------------------------------------


def _layer_class(impl: Callable) -> type:
    """A stateless `torch.nn.Module` class whose forward has the torch path's signature and calls `impl`.

    `kernels.kernelize` accepts a replacement only if it has no constructor, no members beyond
    `forward`, `has_backward` and `can_torch_compile`, and a forward whose parameters match the
    replaced function's in number and kind; it then binds this forward to the function layer, so
    `self` is not an instance of this class and `impl` lives in the closure.
    """

    class FlashQLAChunkGatedDeltaRule(torch.nn.Module):
        has_backward = True
        can_torch_compile = False

        def forward(
            self,
            query,
            key,
            value,
            g,
            beta,
            chunk_size=64,
            initial_state=None,
            output_final_state=False,
            use_qk_l2norm_in_kernel=False,
            **kwargs,
        ):
            return impl(
                query,
                key,
                value,
                g=g,
                beta=beta,
                chunk_size=chunk_size,
                initial_state=initial_state,
                output_final_state=output_final_state,
                use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                **kwargs,
            )

    FlashQLAChunkGatedDeltaRule.forward.flashqla_impl = impl
    return FlashQLAChunkGatedDeltaRule


class _LocalRepository:
    """A `kernels` repository (its protocol: `load()` returns the layer class) for a local function.

    Equal (and hashing alike) for equal functions, so that `kernels`' cache of loaded layers serves
    one class per function; deep copies (`kernels.use_kernel_mapping` copies the mapping in force)
    return the same object, so the function stays the one given.
    """

    def __init__(self, impl: Callable):
        self.impl = impl
        self._layer = _layer_class(impl)

    def load(self) -> type:
        return self._layer

    def __eq__(self, other):
        return isinstance(other, _LocalRepository) and self.impl == other.impl

    def __hash__(self):
        return hash((_LocalRepository, self.impl))

    def __deepcopy__(self, memo):
        return self

    def __str__(self):
        return f"local function {self.impl!r}"


def _modes():
    from kernels import Mode

    return (Mode.TRAINING, Mode.INFERENCE)


def kernel_mapping(backend: str = "auto", *, qkv_dtype: torch.dtype | None = None) -> dict:
    """A `kernels` mapping from "chunk_gated_delta_rule" to `backend`'s op, for every device it runs on.

    For `kernels.register_kernel_mapping` (process-wide) or `kernels.use_kernel_mapping` (a block),
    followed by `kernels.kernelize(model, mode=..., device=...)` or transformers'
    `model.set_use_kernels(True)`: the "kernels" path of the module docstring done by hand
    (`enable` does it for one model and checks the result). Entries, each for Mode.TRAINING and
    Mode.INFERENCE: "auto": CUDA of compute capability 9.x -> flashqla, CPU -> reference;
    "flashqla": CUDA 9.x only; "reference": CPU and CUDA (any capability). The 9.x entries are
    narrower than transformers' own CUDA entry (every capability), so `kernels` picks them on a
    Hopper GPU whichever was registered last; "reference"'s CUDA entry covers every capability like
    transformers' own, and the one registered last wins.

    Raises:
        ValueError: unknown backend. TypeError: qkv_dtype not None or a floating dtype.
        ImportError: `kernels` is not installed.
    """
    from kernels import CUDAProperties, Device

    impl = _BackendCall(backend, qkv_dtype)
    repo = _LocalRepository(impl)
    per_mode = dict.fromkeys(_modes(), repo)
    hopper = Device(type="cuda", properties=CUDAProperties(min_capability=90, max_capability=99))
    devices = {
        "auto": [hopper, Device(type="cpu")],
        "flashqla": [hopper],
        "reference": [Device(type="cpu"), Device(type="cuda")],
    }[backend]
    return {KERNEL_NAME: {d: dict(per_mode) for d in devices}}


def _layers_device(layers) -> torch.device:
    devices = {p.device for layer in layers for p in layer.parameters()}
    if len(devices) != 1:
        raise ValueError(f"model: its {_LAYER_CLASS} layers must hold parameters on one device, found {sorted(map(str, devices))}")
    return devices.pop()


def _kernels_device(device: torch.device):
    """The `kernels` device key for exactly `device` (a CUDA device: its compute capability)."""
    from kernels import CUDAProperties, Device

    if device.type == "cuda" and torch.version.hip is None:
        major, minor = torch.cuda.get_device_capability(device)
        cap = 10 * major + minor
        return Device(type="cuda", properties=CUDAProperties(min_capability=cap, max_capability=cap))
    return Device(type=device.type)


def _check_mode(model, mode):
    from kernels import Mode

    if mode is None:
        return Mode.TRAINING if model.training else Mode.INFERENCE
    if not isinstance(mode, Mode):
        raise TypeError(f"mode must be None or a kernels.Mode, got {mode!r}")
    if (Mode.TRAINING not in mode and Mode.INFERENCE not in mode) or Mode.TORCH_COMPILE in mode:
        raise ValueError(f"mode must be Mode.TRAINING or Mode.INFERENCE (flashqla's op is not mapped for torch.compile), got {mode}")
    return mode


def _chunk_functions(layers) -> list:
    """The `kernels` function layers named KERNEL_NAME that `layers` call (deduplicated)."""
    funcs: dict[int, Any] = {}
    for layer in layers:
        found = [f for f in getattr(layer, "_kernel_funcs", {}).values() if _is_kernels_function(f)]
        if not found:
            raise IntegrationError(
                f"{type(layer).__name__} carries no kernels function layer named {KERNEL_NAME!r} "
                "(transformers' use_kernelized_func did not attach it); this version's layout is not supported"
            )
        funcs.update((id(f), f) for f in found)
    return list(funcs.values())


def _saved_forward(f) -> dict:
    return {k: f.__dict__[k] for k in ("forward", "_kernel_repo") if k in f.__dict__}


def _restore_forward(f, saved: dict) -> None:
    for k in ("forward", "_kernel_repo"):
        if k in saved:
            f.__dict__[k] = saved[k]
        else:
            f.__dict__.pop(k, None)


def _attach_kernels(model, layers, impl: Callable, mode) -> Callable[[], None]:
    from kernels import kernelize, use_kernel_mapping

    mode = _check_mode(model, mode)
    device = _layers_device(layers)
    funcs = _chunk_functions(layers)
    repo = _LocalRepository(impl)
    mapping = {KERNEL_NAME: {_kernels_device(device): dict.fromkeys(_modes(), repo)}}
    saved = [(f, _saved_forward(f)) for f in funcs]
    scope = use_kernel_mapping(mapping)  # inherits the mapping in force; ours wins for this name and device
    scope.__enter__()

    def undo():
        scope.__exit__(None, None, None)
        for f, s in saved:
            _restore_forward(f, s)

    try:
        holder = torch.nn.Module()  # kernelize these function layers, nothing else of the model
        holder.__dict__["_kernel_funcs"] = {str(i): f for i, f in enumerate(funcs)}
        try:
            kernelize(holder, mode=mode, device=device, use_fallback=False)
        except (ValueError, TypeError) as e:
            raise IntegrationError(f"kernels.kernelize did not map {KERNEL_NAME!r} to {impl!r} on {device}: {e}") from e
        missing = [f for f in funcs if getattr(getattr(f.forward, "__func__", None), "flashqla_impl", None) != impl]
        if missing:
            hint = " (DISABLE_KERNEL_MAPPING is set)" if os.environ.get("DISABLE_KERNEL_MAPPING", "0") not in ("", "0") else ""
            raise IntegrationError(
                f"kernels.kernelize left {len(missing)} of {len(funcs)} {KERNEL_NAME!r} function layers without {impl!r}{hint}"
            )
    except BaseException:
        undo()
        raise
    return undo


def _call_site(layer) -> tuple[str, Any]:
    """Where `layer.forward` finds its chunked gated delta rule: ("attribute", layer) or ("global", dict)."""
    if _ATTR in vars(layer):
        return "attribute", layer
    fwd = inspect.unwrap(type(layer).forward)
    if _TORCH_FN in fwd.__code__.co_names:
        return "global", fwd.__globals__
    import transformers

    raise IntegrationError(
        f"transformers {transformers.__version__}: {type(layer).__name__}.forward calls neither "
        f"self.{_ATTR} nor {_TORCH_FN}; this version's call convention is not supported"
    )


def _attach_adapter(layers, impl: Callable) -> Callable[[], None]:
    undo: list[Callable[[], None]] = []
    patched_globals: set[int] = set()

    def undo_all():
        for u in reversed(undo):
            u()

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
    except BaseException:
        undo_all()
        raise
    return undo_all


#: Attachments not yet closed, oldest first (they must close in reverse order).
_OPEN: list[Attachment] = []


class Attachment:
    """What `enable` (or `swap_chunk_gated_delta_rule`) attached; `close()` puts back what was there.

    Attributes:
        path: "kernels" or "adapter" (module docstring).
        impl: the function the layers now call (the layer's call convention).
        layers: the Qwen3NextGatedDeltaNet modules it reaches.

    A context manager: leaving the `with` block closes it. Closing twice is a no-op.
    """

    def __init__(self, path: str, impl: Callable, layers: list, undo: Callable[[], None]):
        self.path, self.impl, self.layers, self._undo = path, impl, layers, undo
        _OPEN.append(self)

    @property
    def closed(self) -> bool:
        return self._undo is None

    def close(self) -> None:
        """Restore the layers' previous function.

        Raises:
            RuntimeError: a later attachment is still open (close in reverse order of opening).
        """
        if self._undo is None:
            return
        if _OPEN[-1] is not self:
            raise RuntimeError("close attachments in the reverse order of opening: a later one is still open")
        undo, self._undo = self._undo, None
        _OPEN.pop()
        undo()

    def __enter__(self) -> Attachment:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def __repr__(self):
        state = "closed" if self.closed else "open"
        return f"<Attachment {self.path} {self.impl!r} on {len(self.layers)} layer(s), {state}>"


def _attach(model, impl: Callable, mode) -> Attachment:
    if not callable(impl):
        raise TypeError(f"impl must be callable, got {impl!r}")
    layers = gdn_layers(model)
    if not layers:
        raise ValueError(f"model: no {_LAYER_CLASS} layer in {type(model).__name__}")
    path = integration_path()
    if path == "kernels":
        undo = _attach_kernels(model, layers, impl, mode)
    else:  # no kernel mapping on this path, so no mode either
        undo = _attach_adapter(layers, impl)
    return Attachment(path, impl, layers, undo)


def enable(model, backend: str = "auto", *, mode=None, qkv_dtype: torch.dtype | None = None) -> Attachment:
    """Make every Qwen3-Next GDN layer of `model` run flashqla's chunked gated delta rule.

    Attaches through transformers' kernel mapping where the installed transformers has one, else
    through the older call sites (module docstring: which versions take which path). The op is
    chosen per call by `select_op(backend, device)`. Prefill and training go through it; the
    single-token decoding step stays transformers' own.

    Args:
        model: a module containing `Qwen3NextGatedDeltaNet` layers (for example a
            `Qwen3NextForCausalLM`), all on one device.
        backend: "auto" (default), "flashqla" or "reference" (module docstring).
        mode: a `kernels.Mode`, Mode.TRAINING or Mode.INFERENCE, for `kernels.kernelize`; default
            from `model.training`. The op is mapped for both modes, so it stays in place when
            transformers re-kernelizes the model for the other one. Ignored on the "adapter" path.
        qkv_dtype: cast q, k, v to this dtype for the op and o back (for example torch.bfloat16 to
            run flashqla's op inside an fp32 model); None (default) casts nothing.

    Returns:
        An `Attachment`: `close()` (or leaving `with enable(model): ...`) restores the previous
        function.

    Raises:
        ValueError: unknown backend; a backend that cannot run on the layers' device; no
            Qwen3NextGatedDeltaNet in `model`; layers on several devices; a mode with
            Mode.TORCH_COMPILE.
        TypeError: qkv_dtype or mode of the wrong type.
        Qwen3NextUnavailable: transformers or its Qwen3-Next model code cannot be imported.
        IntegrationError: transformers is there but the op could not be attached.
    """
    impl = _BackendCall(backend, qkv_dtype)
    layers = gdn_layers(model)
    if layers:
        select_op(backend, _layers_device(layers))  # fail now, not at the first forward
    return _attach(model, impl, mode)


@contextlib.contextmanager
def swap_chunk_gated_delta_rule(model, impl: Callable, *, mode=None) -> Iterator[Attachment]:
    """Within the block, every Qwen3-Next GDN layer of `model` calls `impl` for its chunked prefill.

    `impl` takes the layer's call (module docstring): `torch_chunk_path()`, `adapt_fla_op(op)` for an
    op with FLA's signature, or any function of that form. Attaches like `enable` (the "kernels" or
    the "adapter" path); restored on exit, nested blocks unwind in order. The single-token decoding
    path (a cache and one token) is not swapped. Yields the `Attachment`.

    Raises:
        ValueError: `model` has no Qwen3-Next GDN layer, or its layers sit on several devices.
        TypeError: impl not callable.
        IntegrationError: the function could not be attached.
    """
    with _attach(model, impl, mode) as att:
        yield att


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
    without, whatever they call now (what `enable` attached, else transformers' own choice: FLA
    when importable and the device suits it, else the torch path).
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

    The prompt runs through the chunked gated delta rule (`impl` when given, else whatever the
    layers call now) with
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


class PooledPrefill:
    """The GDN layer's prefill call (`adapt_fla_op`'s convention) on an op that keeps states in a pool,
    as a serving engine does: each call starts from pool row `slot` (zeros unless `resume`), writes its
    final state back into that row and, on the request's first call, saves checkpoints. transformers'
    cache gets the row back as `[1, HV, K, V]` for its decoding steps.

    Args:
        op: `flashqla.chunk_gated_delta_rule` or `reference.chunk_gated_delta_rule` (or a wrapper of
            either with their signature).
        pool: `[P, HV, V, K]` ("vk") state pool on the model's device, any state dtype the op takes.
        state_dtype: dtype of the state handed to transformers' cache (None: the pool's, copied).

    Set between requests: `slot` (int row), `resume` (bool), `positions` (list of global positions,
    or None) and `checkpoints` (`[M, HV, V, K]` in the pool's dtype). `calls` lists each call's T.
    One request per call (batch 1); raises AssertionError otherwise."""

    def __init__(self, op: Callable, pool: torch.Tensor, *, state_dtype: torch.dtype | None = None):
        self.op, self.pool, self.state_dtype, self.calls = op, pool, state_dtype, []
        self.slot, self.resume, self.positions, self.checkpoints = 0, False, None, None

    def __call__(self, query, key, value, g, beta, chunk_size=64, initial_state=None, output_final_state=False,
                 use_qk_l2norm_in_kernel=False, **kwargs):
        assert query.shape[0] == 1, "one request per call here"
        dev, T = query.device, query.shape[1]
        self.calls.append(T)
        ck = {}
        if self.positions is not None:
            ck = dict(checkpoint_positions=torch.tensor(self.positions, device=dev), checkpoint_states=self.checkpoints)
            self.positions = None  # the first prefill of the request only
        o, pool = self.op(
            query, key, value, g, beta, initial_state=self.pool, output_final_state=True,
            cu_seqlens=torch.tensor([0, T], dtype=torch.int32, device=dev),
            use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, state_indices=torch.tensor([self.slot], device=dev),
            has_initial_state=torch.tensor([self.resume], device=dev), state_layout="vk", **ck)
        self.resume = True  # a later prefill of this request continues from its row
        state = pool[self.slot:self.slot + 1].transpose(-1, -2)
        return o, state.clone() if self.state_dtype is None else state.to(self.state_dtype)


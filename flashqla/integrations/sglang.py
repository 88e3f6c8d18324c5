"""SGLang's GDN prefill ("extend") kernel call mapped onto flashqla's `chunk_gated_delta_rule`.

SGLang's GDN attention backend (`python/sglang/srt/layers/attention/linear/gdn_backend.py`,
`GDNAttnBackend.forward_extend`, at commit 0051ebf, and `linear/kernels/gdn_triton.py`,
`TritonGDNKernel.extend`, at commit 0a48af3, as read in public sgl-project/sglang snapshots) calls
its prefill kernel as

    core_attn_out, last_recurrent_state, h = kernel.extend(q, k, v, g, beta, ssm_states=ssm_states,
                                                           cache_indices=cache_indices,
                                                           query_start_loc=query_start_loc)

with q, k `[1, T, H, K]`, v `[1, T, HV, V]` (packed), g, beta from `fused_gdn_gating` (g the
log-space decay `-exp(A_log) * softplus(a + dt_bias)`, beta `sigmoid(b)`), q and k normalised by the
kernel (`use_qk_l2norm_in_kernel=True`), `ssm_states` the layer's pool `[slots, HV, V, K]` (the
"vk" layout) updated in place at rows `cache_indices` (the Triton kernel's `initial_state_indices`),
and `last_recurrent_state` None when the kernel wrote the pool itself (the backend copies a returned
state into the pool otherwise). `h` holds chunk states for SGLang's prefix-cache tracking, None when
not kept.

- `extend`: that call; returns `(o, None, None)` with the pool written in place. SGLang zeroes a
  new request's pool row on allocation; `has_initial_state` (optional, SGLang's
  `extend_prefix_lens > 0`) makes a row start from zeros without that. Checkpoints at any token
  (`checkpoint_positions`, `checkpoint_states`) take the place of `h` for prefix caching.
- `FlashQLAGDNKernel`: an object with that `extend` method, for SGLang's kernel dispatcher.

The op: backend "auto" (flashqla's kernels on a Hopper GPU, the reference on CPU), "flashqla" or
"reference" (`flashqla.integrations.qwen3_next.select_op`). No SGLang import.
"""

from __future__ import annotations

import torch

from flashqla.integrations.qwen3_next import host_offsets_kwargs, rename_offsets, select_op

#: flashqla's names of the offsets and their host copy, and SGLang's, in errors raised through `extend`
_NAMES = ("query_start_loc_cpu", "query_start_loc")

__all__ = ["extend", "FlashQLAGDNKernel"]


def extend(q, k, v, g, beta, *, ssm_states: torch.Tensor, cache_indices: torch.Tensor,
           query_start_loc: torch.Tensor, has_initial_state: torch.Tensor | None = None, state_layout: str = "vk",
           use_qk_l2norm_in_kernel: bool = True, scale=None, checkpoint_positions=None, checkpoint_states=None,
           out=None, query_start_loc_cpu: torch.Tensor | None = None, backend: str = "auto", **kwargs):
    """SGLang's `extend(q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kwargs)`
    (module docstring) on `backend`'s op: sequence n (offsets query_start_loc) starts from
    ssm_states[cache_indices[n]] (a negative index: padding, no read or write) and its final state
    is written into that row in place, rounded once to the pool's dtype.

    Args: as the module docstring; ssm_states [slots, HV, V, K] (state_layout "vk", the default) or
    [slots, HV, K, V] ("kv"), fp32/bf16/fp16; has_initial_state bool [N] or None; the other keyword
    arguments SGLang passes (e.g. `inplace_update=True`) are accepted; `inplace_update=False`
    raises ValueError (not supported). query_start_loc_cpu: optional host copy of query_start_loc
    ending at T (flashqla's `cu_seqlens_cpu`: the plan and the value-slice width chosen on the
    lengths, o not zero-filled past the last offset; checked, then unused, by the reference).

    Returns: (o [1, T, HV, V] in q's dtype, None, None). Raises what the op raises, with the
    offsets named as SGLang names them (query_start_loc, query_start_loc_cpu), and TypeError for
    flashqla's name `cu_seqlens_cpu` (which `**kwargs` would otherwise swallow)."""
    if kwargs.get("inplace_update", True) is not True:
        raise ValueError("inplace_update=False (SGLang's multi-item scoring) is not supported: the pool is written in place")
    if "cu_seqlens_cpu" in kwargs:
        raise TypeError("extend takes the host copy of query_start_loc as query_start_loc_cpu, not cu_seqlens_cpu")
    op = select_op(backend, q.device)
    try:
        host = host_offsets_kwargs(op, query_start_loc_cpu, q, query_start_loc)
        o, _ = op(q, k, v, g, beta, scale=scale, initial_state=ssm_states, output_final_state=True,
                  cu_seqlens=query_start_loc, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                  state_indices=cache_indices, has_initial_state=has_initial_state, state_layout=state_layout,
                  checkpoint_positions=checkpoint_positions, checkpoint_states=checkpoint_states, out=out, **host)
    except (TypeError, ValueError) as exc:  # the offsets by SGLang's names
        raise rename_offsets(exc, _NAMES) from exc
    return o, None, None


class FlashQLAGDNKernel:
    """SGLang's prefill kernel interface (`extend`) on flashqla (`backend` as `extend`'s)."""

    def __init__(self, backend: str = "auto", state_layout: str = "vk"):
        self.backend, self.state_layout = backend, state_layout

    def extend(self, q, k, v, g, beta, *, ssm_states, cache_indices, query_start_loc, **kwargs):
        """`extend` with this object's backend and state layout (either may be overridden per call)."""
        kwargs.setdefault("state_layout", self.state_layout)
        kwargs.setdefault("backend", self.backend)
        return extend(q, k, v, g, beta, ssm_states=ssm_states, cache_indices=cache_indices,
                      query_start_loc=query_start_loc, **kwargs)

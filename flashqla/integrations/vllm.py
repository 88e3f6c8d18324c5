"""vLLM's GDN prefill calls mapped onto flashqla's `chunk_gated_delta_rule` (thin functions).

vLLM's Qwen3-Next GDN layer (`vllm/model_executor/models/qwen3_next.py`,
`Qwen3NextGatedDeltaNet._forward_core`, the non-speculative prefill branch, as read in a public
vllm-project/vllm snapshot of late 2025 (exact release not pinned here; later trees move the layer to
`vllm/model_executor/layers/mamba/gdn_linear_attn.py` with the same pattern)) runs, with its FLA copy
`vllm.model_executor.layers.fla.ops.chunk_gated_delta_rule`:

    initial_state = ssm_state[non_spec_state_indices_tensor].contiguous()
    initial_state[~has_initial_state, ...] = 0
    o, last_state = chunk_gated_delta_rule(q=..., k=..., v=..., g=..., beta=..., initial_state=initial_state,
                                           output_final_state=True, cu_seqlens=non_spec_query_start_loc,
                                           head_first=False, use_qk_l2norm_in_kernel=True)
    ssm_state[non_spec_state_indices_tensor] = last_state.to(ssm_state.dtype)

with q, k `[1, T, H, K]`, v `[1, T, HV, V]` (packed, B == 1), g `[1, T, HV]` the log-space decay
`-exp(A_log) * softplus(a + dt_bias)` (fp32), beta `sigmoid(b)`, q and k not yet normalised (the flag
asks the op to), and `ssm_state` the layer's state pool `[slots, HV, K, V]` in that release (the
"kv" layout; pass state_layout="vk" for a pool stored `[slots, HV, V, K]`).

- `chunk_gated_delta_rule`: that call's signature (FLA's, with `head_first`), a drop-in for the
  function vLLM imports; it returns `(o, final_state)`.
- `gdn_prefill`: the four lines above as one call: the pool is read by index (zeros where
  has_initial_state is False, padding for a negative index) and written in place, no gather
  copy and no scatter in the caller; returns o. Pass the host copy of the offsets where the engine
  has one (`cu_seqlens_cpu`): without it the plan takes every sequence as T / N tokens long.
  Checkpoints (`checkpoint_positions`, `checkpoint_states`, e.g. for prefix caching at block
  boundaries) pass through.

The op: backend "auto" (flashqla's kernels on a Hopper GPU, the reference on CPU), "flashqla" or
"reference" (`flashqla.integrations.qwen3_next.select_op`). No vLLM import.
"""

from __future__ import annotations

import torch

from flashqla.integrations.qwen3_next import host_offsets_kwargs, select_op

__all__ = ["chunk_gated_delta_rule", "gdn_prefill"]


def chunk_gated_delta_rule(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False,
                           cu_seqlens=None, head_first=False, use_qk_l2norm_in_kernel=False, *, backend="auto",
                           **serving):
    """vLLM's FLA `chunk_gated_delta_rule` call (q, k, v, g, beta, scale, initial_state,
    output_final_state, cu_seqlens, head_first, use_qk_l2norm_in_kernel; FLA's shapes, module
    docstring) on `backend`'s op; keyword `serving` arguments (state_indices, has_initial_state,
    state_layout, checkpoint_positions, checkpoint_states, out, batch_invariant) pass through, and
    `cu_seqlens_cpu` (a host copy of cu_seqlens ending at T, e.g. vLLM's `query_start_loc_cpu`) goes
    to flashqla's planner (`host_offsets_kwargs`; checked, then unused, by the reference).

    Returns the op's (o, final_state). Raises ValueError for head_first=True (FLA's deprecated
    head-first layout, which vLLM's layer never passes) and whatever the op raises."""
    if head_first is not False:
        raise ValueError("head_first must be False: flashqla takes FLA's [B, T, H, K] layout (vLLM passes head_first=False)")
    op = select_op(backend, q.device)
    host = host_offsets_kwargs(op, serving.pop("cu_seqlens_cpu", None), q, cu_seqlens)
    return op(q, k, v, g, beta, scale=scale, initial_state=initial_state, output_final_state=output_final_state,
              cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel, **host, **serving)


def gdn_prefill(q, k, v, g, beta, *, ssm_state: torch.Tensor, state_indices: torch.Tensor,
                has_initial_state: torch.Tensor | None, cu_seqlens: torch.Tensor, use_qk_l2norm_in_kernel: bool = True,
                state_layout: str = "kv", scale=None, checkpoint_positions=None, checkpoint_states=None, out=None,
                cu_seqlens_cpu: torch.Tensor | None = None, backend: str = "auto") -> torch.Tensor:
    """vLLM's pooled prefill (module docstring) in one call: sequence n starts from
    ssm_state[state_indices[n]] (zeros where has_initial_state[n] is False; no read or write for a
    negative index) and its final state is written back into that row, rounded once to ssm_state's
    dtype.

    Args:
        q, k: [1, T, H, K]; v: [1, T, HV, V]; g: [1, T, HV] fp32 log decay; beta: [1, T, HV].
        ssm_state: the pool [slots, HV, K, V] ("kv") or [slots, HV, V, K] ("vk"), fp32/bf16/fp16.
        state_indices: int32/int64 [N]; has_initial_state: bool [N] or None; cu_seqlens: [N + 1].
        checkpoint_positions, checkpoint_states, out: as `flashqla.chunk_gated_delta_rule`.
        cu_seqlens_cpu: optional host copy of cu_seqlens (vLLM's `query_start_loc_cpu` sliced as
            cu_seqlens is), ending at T: the plan and the value-slice width are then chosen on the
            lengths, and o is not zero-filled past the last offset (None with padding tokens after it).

    Returns: o [1, T, HV, V] in q's dtype. Raises what the op raises (ValueError / TypeError naming
    the argument)."""
    o, _ = chunk_gated_delta_rule(q, k, v, g, beta, scale=scale, initial_state=ssm_state, output_final_state=True,
                                  cu_seqlens=cu_seqlens, use_qk_l2norm_in_kernel=use_qk_l2norm_in_kernel,
                                  backend=backend, state_indices=state_indices, has_initial_state=has_initial_state,
                                  state_layout=state_layout, checkpoint_positions=checkpoint_positions,
                                  checkpoint_states=checkpoint_states, out=out, cu_seqlens_cpu=cu_seqlens_cpu)
    return o

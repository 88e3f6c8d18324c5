"""The public op's serving path (`flashqla.chunk_gated_delta_rule` with any serving argument of
`flashqla.serving`): state pools by index, the "vk" layout, bf16/fp16 state storage, checkpoints at
any token, `out=`, `batch_invariant`.

For now this is done in torch around the existing kernels, whose generated sources are unchanged:

- pooled / masked / transposed initial states: a gather (`index_select`), a `torch.where` and a
  transpose into a contiguous fp32 `[N, HV, K, V]`, which the recurrent kernel reads as its
  initial_state; the final states come back fp32 and are transposed, rounded once to the pool's
  dtype and scattered into the pool (`index_copy_`, no host read: `flashqla.serving.store_final_states`).
- checkpoints: the batch is cut at the sequence starts and at the positions (`checkpoint_pieces`,
  a device sort), and two more forwards run on those pieces: one from each piece's own start (the
  sequence's initial state on its first piece, zeros elsewhere) gives R_j, one with v = 0 from the
  identity gives the transition P_j [K, K] of each piece (the recurrence is linear in its state:
  S_end = P_j S_start + R_j); a parallel scan of the affine maps (`scan_pieces`) then chains the
  pieces of each sequence. No host read; about two extra forwards and O((N + M) log(N + M)) K x K
  products. The main call, and so o and the final state, is not changed by checkpoints.
- out=: o is copied into it (one extra copy).
- batch_invariant: the plan is cp="off" (no context-parallel split, which depends on the batch) and
  the value-slice width is fixed at 64 (the recurrent kernel otherwise picks it from N * HV);
  every launch then computes a (sequence, value head, value slice) from that sequence's tokens
  only. Inference only (a call under autograd with batch_invariant raises).

Later, on the GPU: the recurrent kernel reading and writing pool rows by index (in its state's
dtype and layout) and storing checkpoints in-kernel at any token, which removes the gather/scatter,
the transposes and the two checkpoint forwards.

Public designs followed (not copied): vLLM's GDN layer (`vllm/model_executor/models/qwen3_next.py`,
`Qwen3NextGatedDeltaNet._forward_core`: gather `ssm_state[indices]`, zero rows without an initial
state, FLA's `chunk_gated_delta_rule`, scatter `.to(ssm_state.dtype)`), SGLang's
`layers/attention/linear/gdn_backend.py` and `kernels/gdn_triton.py` (`TritonGDNKernel.extend`:
`initial_state_indices`, pools [slots, HV, V, K] updated in place).
"""

from __future__ import annotations

import torch

from flashqla.cp.plan import plan_call
from flashqla.ops.gdn.autograd import GDNEagerFunction
from flashqla.ops.gdn.fwd import forward
from flashqla.serving import ServingArgs, checkpoint_pieces, gather_initial_states, scan_pieces, write_back

__all__ = ["serve", "BATCH_INVARIANT_BLOCK_V"]

#: The recurrent kernel's value-slice width under batch_invariant (fixed, not picked from N * HV).
BATCH_INVARIANT_BLOCK_V = 64


def serve(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens, s: ServingArgs, *,
          cp: str, max_seqlen=None, seqlens=None, training: bool = False, backend=None):
    """Runs the op with validated serving arguments `s` (q, k after any L2 norm; scale a float).

    Returns (o, final_state): o [B, T, HV, V] (`s.out` when given); final_state the pool (written in
    place) with state_indices, else [N, HV, K, V] / [N, HV, V, K] fp32, or None without
    output_final_state. Raises ValueError for a pool or checkpoint_states that requires grad, out=
    or batch_invariant under autograd (module docstring)."""
    if training:
        if s.pool and initial_state.requires_grad:
            raise ValueError("initial_state is a state pool (state_indices given) that requires grad: pooled states "
                             "are read and written in place without autograd; pass a per-sequence initial_state to "
                             "train through it")
        if s.out is not None:
            raise ValueError("out= is not differentiable (o is written in place): call without out under autograd")
        if s.batch_invariant:
            raise ValueError("batch_invariant is an inference option: call it without autograd (torch.no_grad())")
    if torch.is_grad_enabled() and s.checkpoint_states is not None and s.checkpoint_states.requires_grad:
        raise ValueError("checkpoint_states requires grad: checkpoints are written in place without autograd")
    B, T, HV, V = v.shape
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    h0 = gather_initial_states(initial_state, s, N, torch.float32)
    mode = "off" if s.batch_invariant else cp
    block_v = BATCH_INVARIANT_BLOCK_V if s.batch_invariant else None
    plan = plan_call(q, v, cu_seqlens, mode, training=training, keep_states=training, max_seqlen=max_seqlen,
                     seqlens=seqlens)
    if training:
        o, final = GDNEagerFunction.apply(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, plan)
    else:
        f = forward(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, plan=plan, backend=backend,
                    for_backward=False, block_v=block_v)
        o, final = f.o, f.final_state
    ckpt = None
    if s.checkpoint_positions is not None:
        with torch.no_grad():
            ckpt = checkpoint_states(q, k, v, g, beta, scale, h0, cu_seqlens, s.checkpoint_positions, mode=mode,
                                     block_v=block_v, backend=backend)
    return write_back(o, final, ckpt, s, initial_state, output_final_state)


def checkpoint_states(q, k, v, g, beta, scale: float, h0, cu_seqlens, positions, *, mode: str = "auto",
                      block_v=None, backend=None) -> torch.Tensor:
    """The state after the first p tokens of the packed batch for every p of `positions` ([M], sorted,
    each inside a sequence), [M, HV, K, V] in the backend's state dtype (fp32 on the GPU), by the
    pieces-and-scan method of the module docstring (two forwards on the batch cut at the sequence
    starts and the positions; no host read). h0: [N, HV, K, V] or None (zeros)."""
    B, T, H, K = q.shape
    HV = v.shape[2]
    if cu_seqlens is None:  # B rows of T tokens: one packed batch of B sequences (global offsets b * T + t)
        cu_seqlens = torch.arange(B + 1, dtype=torch.int32, device=q.device) * T
        q, k, v, g, beta = (x.reshape(1, B * T, *x.shape[2:]) for x in (q, k, v, g, beta))
    N = cu_seqlens.shape[0] - 1
    pieces_cu, first, seq, ends = checkpoint_pieces(cu_seqlens, positions)
    L = pieces_cu.shape[0] - 1

    def run(vv, start):
        plan = plan_call(q, vv, pieces_cu, mode)
        f = forward(q, k, vv, g, beta, scale, start, True, pieces_cu, plan=plan, backend=backend, for_backward=False,
                    block_v=block_v)
        return f.final_state

    if h0 is None:
        h0 = torch.zeros(N, HV, K, v.shape[3], dtype=torch.float32, device=q.device)
    start = torch.where(first[:, None, None, None], h0[seq], torch.zeros((), dtype=h0.dtype, device=h0.device))
    R = run(v, start.contiguous())
    eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(L, HV, K, K).contiguous()
    P = run(torch.zeros(*v.shape[:3], K, dtype=v.dtype, device=v.device), eye)
    S = scan_pieces(P.to(R.dtype), R, first)
    return S[ends]

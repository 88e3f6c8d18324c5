"""The public op's serving path (`flashqla.chunk_gated_delta_rule` with any serving argument of
`flashqla.serving`): state pools by index, the "vk" layout, bf16/fp16 state storage, checkpoints at
any token, `out=`, `batch_invariant`.

The kernel path (inference on the sm_90 kernels, an unsplit plan, at least one token and sequence,
and the state tensors in one storage dtype: the pool and checkpoint_states, or a per-sequence
initial_state, the fp32 final states and checkpoint_states): the prepare kernel, then the recurrent
kernel's serving build (`recurrent.chunk_recurrent_serving`, key `recurrent_serving_args`), which reads
pool rows by index (zeros where the index is negative or has_initial_state is False) in the pool's
layout and dtype, writes the final states into their rows (none for a negative index) rounded once at
the store, stores the checkpoints in-kernel from each chunk's own products (record CF-4; o does not
depend on them) and writes o into `out` when it is contiguous. No gather, scatter, transpose, cast or
second launch: the kernel reads the indices, has_initial_state and the positions as given (no table
launch, no host read), so the call is the plain call's two launches.

The torch path (everything else: training, the split / context-parallel plan, other backends such
as the CPU tests' reference stand-in, T == 0, a pool of 0 rows, mixed state dtypes) runs the unchanged
kernels with torch around them:

- pooled / masked / transposed initial states: gathered into a contiguous fp32 `[N, HV, K, V]`, which
  the recurrent kernel reads as its initial_state; the final states come back fp32 and are
  transposed, rounded once to the pool's dtype and written into their pool rows. On sm_90 for
  inference (`state_kernels_apply`) one launch each (`kernels/sm90/pool_states.py`: `gather_states`,
  `store_states`); otherwise torch's `index_select`, `torch.where`, transposed casts and `index_copy_`
  (`flashqla.serving.gather_initial_states`, `store_final_states`; no host read either way).
- checkpoints, on a split inference plan (`split_checkpoints_apply`: K == V and a backend with
  `recurrent_dual_checkpoints`, the sm_90 kernels included): inside the split forward. Its run and
  transition launch also stores, at each position, the run's state (from the segment's start) and
  the transition's (the product of the per-token maps since the segment's start), and after the
  scan checkpoint = run state + transition state x the segment's entering state (records CP-1,
  CF-4; `flashqla.cp.forward.CheckpointParts`), combined and stored into checkpoint_states by one
  launch on sm_90 (`pool_states.combine_checkpoints`), by one batched GEMM and a copy otherwise. No
  extra forward, no gather of the tokens.
- checkpoints, on a split inference plan otherwise (`segment_checkpoints_apply`: M pieces of at most
  L tokens hold no more than the batch): from the split forward's segment entering states, one more
  forward over each checkpoint's piece of its segment (`segment_checkpoint_states`).
- checkpoints, otherwise: the batch is cut at the sequence starts and at the positions (`checkpoint_pieces`,
  a device sort), and two more forwards run on those pieces: one from each piece's own start (the
  sequence's initial state on its first piece, zeros elsewhere) gives R_j, one with v = 0 from the
  identity gives the transition P_j [K, K] of each piece (the recurrence is linear in its state:
  S_end = P_j S_start + R_j); a parallel scan of the affine maps (`scan_pieces`) then chains the
  pieces of each sequence. No host read; about two extra forwards and O((N + M) log(N + M)) K x K
  products. The main call, and so o and the final state, is not changed by checkpoints.
- out=: o is copied into it (one extra copy).

batch_invariant (both paths): the plan is cp="off" (no context-parallel split, which depends on the
batch); every launch then computes a (sequence, value head, value slice) from that sequence's tokens
only. The value-slice width is still picked from the batch (`cp.plan.unsplit_block_v`): the recurrent
kernel and its serving build give the same bits at BV = 64 and 128 (the widths differ in how the value
rows are split over warpgroups; no product reduces over the value dimension; measured on the H100 for
o, final states, a bf16 "vk" pool and checkpoints, `benchmarks/experiments/width_bitwise.py`; the GPU
test `test_batch_invariant_bitwise_across_batches` runs the sequence in batches of either width).
Inference only (a call under autograd with batch_invariant raises).

`serve` records which path ran in `LAST_PATH` ("path": "kernel" or "torch"; on the torch path with
checkpoints, "checkpoints": "split", "segments" or "pieces"), for the tests.

Public designs followed (not copied): vLLM's GDN layer (`vllm/model_executor/models/qwen3_next.py`,
`Qwen3NextGatedDeltaNet._forward_core`: gather `ssm_state[indices]`, zero rows without an initial
state, FLA's `chunk_gated_delta_rule`, scatter `.to(ssm_state.dtype)`), SGLang's
`layers/attention/linear/gdn_backend.py` and `kernels/gdn_triton.py` (`TritonGDNKernel.extend`:
`initial_state_indices`, pools [slots, HV, V, K] updated in place).
"""

from __future__ import annotations

import torch

from flashqla.contract import clamp_gates, cp_mode, dense, is_dense
from flashqla.cp.plan import plan_call
from flashqla.ops.gdn.autograd import GDNEagerFunction
from flashqla.ops.gdn.fwd import forward
from flashqla.serving import ServingArgs, checkpoint_pieces, gather_initial_states, scan_pieces, write_back

__all__ = ["serve", "serving_plan", "kernel_path_applies", "state_kernels_apply", "LAST_PATH",
           "SERVING_CHECKPOINT_MIN_GAIN"]

#: An inference call with checkpoints under cp="auto" splits only where the plan predicts the split at
#: least this much faster than the unsplit launch (`CPPlan.est_unsplit / est_split`; the plain call's
#: threshold is `cp.plan.MIN_GAIN`). On the split plan the pool's rows, the checkpoints' two parts and
#: the final states move in three more launches, where the unsplit serving build writes them from its
#: chain, so a split gains less for a serving call than for a plain one. Set from the serving page's
#: split rows, each timed split and unsplit (journal serving.md, "The split threshold of serving calls
#: with checkpoints").
SERVING_CHECKPOINT_MIN_GAIN = 1.45

#: The path the last `serve` call took: "kernel" (the serving build) or "torch" (for tests and tools).
LAST_PATH = {"path": None, "checkpoints": None}


def serving_plan(q, v, cu_seqlens, s: ServingArgs, *, cp, training: bool = False, max_seqlen=None, seqlens=None,
                 on_kernel_path=None):
    """The `cp.plan.CallPlan` of a serving call: cp="off" under batch_invariant (module docstring);
    otherwise the op's plan, except that an inference call with checkpoints under cp="auto" (None:
    $FLASHQLA_CP, "auto" by default) takes the unsplit plan where the split is predicted less than
    SERVING_CHECKPOINT_MIN_GAIN times faster (its comment) and that unsplit plan runs on the kernel
    path: `on_kernel_path(plan) -> bool` (None: taken as True), since elsewhere an unsplit call's
    checkpoints cost more forwards. Shapes and host hints only (q [B, T, H, K], v [B, T, HV, V],
    cu_seqlens None or [N + 1]; no device read)."""
    mode = "off" if s.batch_invariant else cp
    plan = plan_call(q, v, cu_seqlens, mode, training=training, keep_states=training, max_seqlen=max_seqlen,
                     seqlens=seqlens)
    f = plan.forward
    ckpts = s.checkpoint_positions is not None and s.checkpoint_positions.numel() > 0
    if (not training and ckpts and f.split and f.est_split and cp_mode(mode) == "auto"
            and f.est_unsplit < SERVING_CHECKPOINT_MIN_GAIN * f.est_split):
        unsplit = plan_call(q, v, cu_seqlens, "off", max_seqlen=max_seqlen, seqlens=seqlens)
        if on_kernel_path is None or on_kernel_path(unsplit):
            return unsplit
    return plan


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
    mode = "off" if s.batch_invariant else cp

    def on_kernel_path(p) -> bool:
        return kernel_path_applies(q, v, initial_state, output_final_state, cu_seqlens, s, p, training=training,
                                   backend=backend)
    plan = serving_plan(q, v, cu_seqlens, s, cp=cp, training=training, max_seqlen=max_seqlen, seqlens=seqlens,
                        on_kernel_path=on_kernel_path)
    if on_kernel_path(plan):
        LAST_PATH["path"] = "kernel"
        LAST_PATH["checkpoints"] = None
        # at the plan's width (`cp.plan.unsplit_block_v`, on the lengths when known), batch_invariant too
        # (module docstring: both widths give the same bits); the torch path's forward uses it too
        return _serve_kernel(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, s,
                             plan.forward.BV, ends_at_T=plan.ends_at_T)
    LAST_PATH["path"] = "torch"
    LAST_PATH["checkpoints"] = None
    kernels = state_kernels_apply(q, s, training=training, backend=backend)
    h0 = _gather(initial_state, s, N, kernels)
    info = None
    split = False
    if training:
        o, final = GDNEagerFunction.apply(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, plan)
    else:
        split = s.checkpoint_positions is not None and split_checkpoints_apply(plan, s.checkpoint_positions, q, v,
                                                                                backend)
        seg = (not split and s.checkpoint_positions is not None
               and segment_checkpoints_apply(plan, s.checkpoint_positions, q))
        f = forward(q, k, v, g, beta, scale, h0, output_final_state, cu_seqlens, plan=plan, backend=backend,
                    for_backward=False, return_info=seg or split,
                    checkpoint_positions=s.checkpoint_positions if split else None)
        if seg or split:
            f, info = f
        o, final = f.o, f.final_state
    ckpt = None
    if split:
        LAST_PATH["checkpoints"] = "split"
        if kernels:
            return _write_back_kernels(o, final, info.checkpoints, s, initial_state, output_final_state)
        ckpt = info.checkpoints.states()
    elif s.checkpoint_positions is not None:
        with torch.no_grad():
            if info is not None and info.mode == "exact":
                LAST_PATH["checkpoints"] = "segments"
                ckpt = segment_checkpoint_states(q, k, v, g, beta, scale, h0, s.checkpoint_positions, info.tables,
                                                 info.S_in, backend=backend)
            else:
                LAST_PATH["checkpoints"] = "pieces"
                ckpt = checkpoint_states(q, k, v, g, beta, scale, h0, cu_seqlens, s.checkpoint_positions, mode=mode,
                                         backend=backend, training=training)
    if kernels:
        return _write_back_kernels(o, final, ckpt, s, initial_state, output_final_state)
    return write_back(o, final, ckpt, s, initial_state, output_final_state)


def state_kernels_apply(q, s: ServingArgs, *, training: bool = False, backend=None) -> bool:
    """Whether the torch path moves its states with the `pool_states` kernels (the pool's rows
    gathered into the forward's initial states, the final states stored into their rows, the split
    forward's checkpoints combined and stored, one launch each; module docstring) rather than torch
    ops: inference on the sm_90 kernels (backend None or an Sm90Backend) on an sm_90 device, K <= 128
    a multiple of 32 (the gather and store move 32 rows a CTA) and the checkpoints' K and V multiples of
    32. Shapes only, no host read."""
    from flashqla.ops.gdn.backend import Sm90Backend
    from flashqla.ops.gdn.kernels.sm90._common import on_sm90
    from flashqla.ops.gdn.kernels.sm90.pool_states import BLOCK_COLS, ROWS

    if training or not (backend is None or isinstance(backend, Sm90Backend)) or not on_sm90(q):
        return False
    c = s.checkpoint_states
    return (q.shape[-1] <= 128 and q.shape[-1] % ROWS == 0
            and (c is None or (c.shape[-1] % BLOCK_COLS == 0 and c.shape[-2] % BLOCK_COLS == 0)))


def _gather(initial_state, s: ServingArgs, N: int, kernels: bool):
    """The forward's initial states [N, HV, K, V] fp32 (`gather_initial_states`), by one launch of
    `pool_states.gather_states` where `kernels`, the states are contiguous and they need a gather, a
    mask, a transpose or a cast (a plain fp32 "kv" initial_state is passed through; None stays None)."""
    if initial_state is None:
        return None
    plain = not s.pool and s.has_initial_state is None and s.state_layout == "kv" and initial_state.dtype == torch.float32
    # a pool with padded rows (a view of a larger cache) would be copied whole by the kernel's
    # contiguous read: torch's gather reads only the N rows; a misaligned one: torch's as well
    if not kernels or plain or not is_dense(initial_state):
        return gather_initial_states(initial_state, s, N, torch.float32)
    from flashqla.ops.gdn.kernels.sm90.pool_states import gather_states

    return gather_states(initial_state, s.state_layout, N, s.state_indices if s.pool else None, s.has_initial_state)


def _write_back_kernels(o, final_kv, checkpoints, s: ServingArgs, initial_state, output_final_state: bool):
    """`flashqla.serving.write_back` with the `pool_states` kernels doing what they can first: the
    split forward's `CheckpointParts` combined and stored into a contiguous checkpoint_states, the
    final states stored into a contiguous pool's rows, one launch each; the rest (a checkpoint
    tensor from the other methods, a non-contiguous target, out=, the returned final states) is
    `write_back`'s."""
    from flashqla.cp.forward import CheckpointParts
    from flashqla.ops.gdn.kernels.sm90.pool_states import combine_checkpoints, store_states

    with torch.no_grad():
        if isinstance(checkpoints, CheckpointParts):
            if is_dense(s.checkpoint_states):
                combine_checkpoints(*checkpoints, out=s.checkpoint_states, layout=s.state_layout)
                checkpoints = None
            else:
                checkpoints = checkpoints.states()
        if output_final_state and s.pool and is_dense(initial_state):
            store_states(final_kv.detach(), initial_state, s.state_layout, s.state_indices)
            o, _ = write_back(o, None, checkpoints, s, initial_state, False)
            return o, initial_state
    return write_back(o, final_kv, checkpoints, s, initial_state, output_final_state)


def split_checkpoints_apply(plan, positions, q, v, backend) -> bool:
    """Whether an inference call on a split plan takes its checkpoints inside the split forward
    (`flashqla.cp.forward.cp_forward(checkpoint_positions=...)`: the run and transition launch stores
    the run's and the transitions' states at the positions, one batched GEMM after the scan combines
    them with the segments' entering states; no extra forward): the plan splits, at least one
    position, K == V, and a backend with `recurrent_dual_checkpoints` (the sm_90 kernels, the
    reference). Shapes only, no host read."""
    from flashqla.ops.gdn.backend import default_backend

    be = default_backend() if backend is None else backend
    return (plan.forward.split and positions.shape[0] > 0 and q.shape[-1] == v.shape[-1]
            and getattr(be, "recurrent_dual_checkpoints", None) is not None)


def segment_checkpoints_apply(plan, positions, q) -> bool:
    """Whether an inference call on a split plan takes its checkpoints from the split forward's segment
    entering states (`segment_checkpoint_states`): the forward splits, and the M checkpoints' pieces
    (at most one segment, L tokens, each) hold no more tokens than the batch (M * L <= B * T), so that
    the extra forward costs less than the pieces-and-scan method's two. Shapes only, no host read."""
    p = plan.forward
    if not p.split or p.segment_len is None:
        return False
    M = positions.shape[0]
    return 0 < M and M * p.segment_len <= q.shape[0] * q.shape[1]


def segment_checkpoint_states(q, k, v, g, beta, scale: float, h0, positions, tables, S_in, *, block_v=None,
                              backend=None) -> torch.Tensor:
    """The state after the first p tokens for every p of `positions` ([M], sorted global offsets, each
    inside a sequence), [M, HV, K, V] in the backend's state dtype, from a split forward's segments.

    The split forward (`flashqla.cp.forward.cp_forward`, exact mode) knows each segment's entering
    state: h0 of its sequence for a first segment, the scanned S_in for the others (`CPInfo.S_in`,
    zeros on first segments). Token p - 1 lies in the segment j with start_j <= p - 1 < end_j, so the
    checkpoint is that entering state carried through the tokens [start_j, p): at most L of them. One
    more forward runs all M pieces as a fixed-length batch of M rows of L tokens, each row its
    piece's tokens followed by padding tokens with k = v = 0, g = 0 and beta = 0, which leave the
    state unchanged (S <- exp(0) (I - 0) S + 0), from the entering states; its final states are the
    checkpoints. No host read; about M * L tokens of prepare and recurrent work in one wave of
    M * HV walks (not split). Exact as the split forward's entering states are (its transitions' cut,
    `flashqla.contract.resolve_truncate`, included).

    q, k: [B, T, H, K] (after any L2 norm); v: [B, T, HV, V]; g, beta: [B, T, HV]; h0: [N, HV, K, V] or
    None (zeros); tables: the forward's `SegmentTables` (token offsets over the B * T flattened tokens);
    S_in: [M_slots, HV, K, V] (`CPInfo.S_in`)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    L = tables.segment_len
    dev = q.device
    pos = positions.to(device=dev, dtype=torch.int64)
    M = pos.shape[0]
    # the segment holding token p - 1: the first slot whose end is past it (ends are non-decreasing in
    # slot order; inert slots have start == end)
    j = torch.searchsorted(tables.end.contiguous(), pos - 1, right=True).clamp(max=tables.M - 1)
    start = tables.start.index_select(0, j)
    first = tables.first.index_select(0, j)
    seq = tables.seq.index_select(0, j)
    if h0 is None:
        entering = torch.where(first[:, None, None, None], torch.zeros((), dtype=S_in.dtype, device=dev),
                               S_in.index_select(0, j))
    else:
        entering = torch.where(first[:, None, None, None], h0.to(S_in.dtype).index_select(0, seq.clamp(min=0)),
                               S_in.index_select(0, j))
    # piece m: tokens start_m .. p_m - 1, then padding up to L
    offs = torch.arange(L, dtype=torch.int64, device=dev)
    tok = start[:, None] + offs[None, :]  # [M, L]
    real = tok < pos[:, None]
    tok = torch.where(real, tok, torch.zeros((), dtype=tok.dtype, device=dev)).reshape(-1)

    def take(x):
        flat = x.reshape(B * T, *x.shape[2:]).index_select(0, tok).view(M, L, *x.shape[2:])
        keep = real.view(M, L, *([1] * (x.dim() - 2)))
        return torch.where(keep, flat, torch.zeros((), dtype=x.dtype, device=dev))

    qp, kp, vp, gp, bp = (take(x) for x in (q, k, v, g, beta))
    plan = plan_call(qp, vp, None, "off")
    f = forward(qp, kp, vp, gp, bp, scale, entering.contiguous(), True, None, plan=plan, backend=backend,
                for_backward=False, block_v=block_v)
    return f.final_state


def _state_tensors(initial_state, output_final_state: bool, s: ServingArgs) -> list:
    """The state tensors the serving build would read or write (their dtypes must agree)."""
    out = [initial_state] if initial_state is not None else []
    if output_final_state and not s.pool:
        out.append(None)  # the fp32 final states the op returns
    if s.checkpoint_states is not None:
        out.append(s.checkpoint_states)
    return out


def kernel_path_applies(q, v, initial_state, output_final_state: bool, cu_seqlens, s: ServingArgs, plan, *,
                        training: bool = False, backend=None) -> bool:
    """Whether the call runs on the recurrent kernel's serving build (module docstring): inference, the
    sm_90 kernels (backend None or an Sm90Backend) on a CUDA device, an unsplit plan, at least one
    token and one sequence, a pool with rows, and every state tensor in one storage dtype,
    contiguous and 16-byte aligned (`flashqla.contract.is_dense`)."""
    from flashqla.ops.gdn.backend import Sm90Backend

    if training or not (backend is None or isinstance(backend, Sm90Backend)) or q.device.type != "cuda":
        return False
    if plan.forward.split or q.shape[0] * q.shape[1] == 0:
        return False
    N = q.shape[0] if cu_seqlens is None else cu_seqlens.shape[0] - 1
    if N == 0 or (s.pool and s.pool_rows == 0):
        return False
    tensors = _state_tensors(initial_state, output_final_state, s)
    dtypes = {torch.float32 if x is None else x.dtype for x in tensors}
    return len(dtypes) <= 1 and all(x is None or is_dense(x) for x in tensors)


def _serve_kernel(q, k, v, g, beta, scale: float, initial_state, output_final_state: bool, cu_seqlens, s: ServingArgs,
                  block_v: int, *, ends_at_T: bool = True):
    """The kernel path (module docstring): the gate floor, prepare, then the serving build of the
    recurrent kernel. ends_at_T False (device offsets with no host hint): the packed tokens after
    cu_seqlens[-1] (no CTA writes them) are zeroed by the tail launch (`packed_tail.zero_packed_tail`),
    so that they read 0, as on every other path."""
    from flashqla.ops.gdn.backend import default_backend
    from flashqla.ops.gdn.kernels.sm90 import registry
    from flashqla.ops.gdn.kernels.sm90.prepare import prepare_kernel_args
    from flashqla.ops.gdn.fwd import product_dtype
    from flashqla.ops.gdn.kernels.sm90.packed_tail import new_output, zero_packed_tail
    from flashqla.ops.gdn.kernels.sm90.recurrent import chunk_recurrent_serving, recurrent_serving_args, serving_spec_args

    g = clamp_gates(g)  # the one gate floor of every path (`flashqla.contract.G_FLOOR`)
    q, k, v, g, beta = (dense(x) for x in (q, k, v, g, beta))
    B, T, HV, V = v.shape
    K = q.shape[-1]
    N = B if cu_seqlens is None else cu_seqlens.shape[0] - 1
    cu_seqlens = None if cu_seqlens is None else dense(cu_seqlens)
    tensors = [x for x in _state_tensors(initial_state, output_final_state, s) if x is not None]
    sdtype = tensors[0].dtype if tensors else torch.float32
    ckpt = s.checkpoint_positions is not None and s.checkpoint_positions.numel() > 0
    backend = default_backend()
    a_dtype = product_dtype(q, False, backend)  # the fp16 A_beta product for bf16 input
    args, kw = recurrent_serving_args(q, v, cu_seqlens, sdtype, s.state_layout, ckpt, block_v, a_dtype)
    specs = [("prepare", prepare_kernel_args(k, beta, cu_seqlens, HV, a_dtype)),
             ("recurrent_serving", serving_spec_args(args, kw))]
    registry.build_once(tuple(specs), specs)
    A, G2 = backend.prepare(k, g, beta, cu_seqlens, HV, a_dtype=a_dtype)
    dev = q.device
    if s.pool:
        final = initial_state if output_final_state else None
    else:
        tail = (K, V) if s.state_layout == "kv" else (V, K)
        final = torch.empty(N, HV, *tail, dtype=torch.float32, device=dev) if output_final_state else None
    out = s.out
    direct = out is not None and out.is_contiguous() and out.data_ptr() % 16 == 0
    zero_tail = cu_seqlens is not None and not ends_at_T
    if direct and zero_tail:
        zero_packed_tail(out, cu_seqlens)
    o_buf = out if direct else (new_output(v, cu_seqlens) if zero_tail else None)
    o = chunk_recurrent_serving(q, k, v, A, G2, scale, initial_state, final, s.state_indices if s.pool else None,
                                s.has_initial_state, cu_seqlens, state_layout=s.state_layout,
                                checkpoint_positions=s.checkpoint_positions, checkpoint_states=s.checkpoint_states,
                                block_v=block_v, o=o_buf)
    if out is not None and not direct:
        out.copy_(o)
        o = out
    return o, final


def checkpoint_states(q, k, v, g, beta, scale: float, h0, cu_seqlens, positions, *, mode: str = "auto",
                      block_v=None, backend=None, training: bool = False) -> torch.Tensor:
    """The state after the first p tokens of the packed batch for every p of `positions` ([M], sorted,
    each inside a sequence), [M, HV, K, V] in the backend's state dtype (fp32 on the GPU), by the
    pieces-and-scan method of the module docstring (two forwards on the batch cut at the sequence
    starts and the positions; no host read). h0: [N, HV, K, V] or None (zeros). training: a training
    call's checkpoints (its forwards then take the training forward's precision, as its o does:
    `flashqla.ops.gdn.fwd.product_dtype`)."""
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
                    block_v=block_v, training=training)
        return f.final_state

    if h0 is None:
        h0 = torch.zeros(N, HV, K, v.shape[3], dtype=torch.float32, device=q.device)
    start = torch.where(first[:, None, None, None], h0[seq], torch.zeros((), dtype=h0.dtype, device=h0.device))
    R = run(v, start.contiguous())
    eye = torch.eye(K, dtype=torch.float32, device=q.device).expand(L, HV, K, K).contiguous()
    P = run(torch.zeros(*v.shape[:3], K, dtype=v.dtype, device=v.device), eye)
    S = scan_pieces(P.to(R.dtype), R, first)
    return S[ends]

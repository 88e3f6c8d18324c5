"""The serving contract of `chunk_gated_delta_rule` (issue 43): state pools addressed by index, the
state layout, state storage dtypes, checkpoints at any token, a preallocated output, batch
invariance. Shared by the reference (`reference.chunk_gated_delta_rule`) and the public op
(`flashqla.chunk_gated_delta_rule`): the argument checks (`check_serving_args`) and the torch
helpers that move states between a pool and the per-sequence `[N, HV, K, V]` fp32/fp64 states the
chunked algorithm runs on. Imports torch and `flashqla.contract` only (a bottom layer).

The arguments (keyword-only on both ops; FLA's names for the rest):

    state_indices       int32/int64 [N] on q's device, or None. With it, `initial_state` is a pool
                        [P, HV, K, V] ("kv") or [P, HV, V, K] ("vk"): sequence n starts from
                        initial_state[state_indices[n]], and with output_final_state=True its final
                        state is written into that row (the op returns the pool itself as
                        final_state). A negative index marks a padding sequence: its row is neither
                        read nor written (it starts from zeros; its o is computed and meaningless).
    has_initial_state   bool [N] on q's device, or None (all True). False: sequence n starts from
                        zeros (its pool row is still written). vLLM's `has_initial_state`.
    state_layout        "kv" (default, FLA's [.., K, V]) or "vk" ([.., V, K], vLLM's / SGLang's /
                        FlashInfer's pools): for the pool, initial_state, the final state and the
                        checkpoints alike.
    checkpoint_positions int32/int64 [M] on q's device, sorted (non-decreasing), global offsets into
                        the packed batch (b * T + t without cu_seqlens): position p saves the state
                        after the first p tokens of the batch, and must lie inside a sequence,
                        cu_seqlens[n] < p <= cu_seqlens[n + 1] (p == cu_seqlens[n + 1]: that
                        sequence's final state). Any token, not only multiples of 64.
    checkpoint_states   [M, HV, K, V] ("kv") or [M, HV, V, K] ("vk"), fp32 / bf16 / fp16 (fp64 on
                        the reference), preallocated, written in place (required with positions).
    out                 [B, T, HV, V] in q's dtype, preallocated: o is written into it and returned.
    batch_invariant     bool: a sequence's o, final state and checkpoints are bitwise the same
                        whatever else is in the batch (see each op for how).

Storage dtypes: a pool, initial_state and checkpoint_states may be fp32, bf16 or fp16; the
arithmetic stays fp32 (fp64 on the fp64 reference) and each stored state is rounded once, at the
store. Reading a bf16/fp16 row is exact.

Host reads: none on a device. The values of `state_indices` (range: -1 <= i < P, no row written
twice), `checkpoint_positions` (inside a sequence, sorted) and `cu_seqlens` are checked when they
are CPU tensors (or with check_values=True, as the reference does); on a GPU an out-of-range index
is the caller's responsibility (undefined, as an out-of-range index in torch's index ops).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashqla.contract import FLOAT_DTYPES, GDNDims

__all__ = [
    "STATE_LAYOUTS",
    "STATE_STORAGE_DTYPES",
    "ServingArgs",
    "check_serving_args",
    "checkpoint_pieces",
    "from_kv",
    "gather_initial_states",
    "scan_pieces",
    "serving_requested",
    "store_final_states",
    "to_kv",
    "write_back",
]

#: The state layouts: "kv" = FLA's [.., K, V]; "vk" = [.., V, K] (vLLM, SGLang, FlashInfer).
STATE_LAYOUTS = ("kv", "vk")
#: Storage dtypes of pools, initial states and checkpoints on the fast path (the reference takes fp64 too).
STATE_STORAGE_DTYPES = (torch.float32, torch.bfloat16, torch.float16)


def serving_requested(state_indices=None, has_initial_state=None, state_layout="kv", checkpoint_positions=None,
                      checkpoint_states=None, out=None, batch_invariant=False) -> bool:
    """True when any serving argument differs from its default (the call then takes the serving path)."""
    return not (state_indices is None and has_initial_state is None and isinstance(state_layout, str)
                and state_layout == "kv" and checkpoint_positions is None and checkpoint_states is None
                and out is None and batch_invariant is False)


@dataclass(frozen=True)
class ServingArgs:
    """The checked serving arguments of one call (`check_serving_args`); `pool` is True with
    state_indices (initial_state is then a pool of `pool_rows` rows)."""

    state_indices: torch.Tensor | None
    has_initial_state: torch.Tensor | None
    state_layout: str
    checkpoint_positions: torch.Tensor | None
    checkpoint_states: torch.Tensor | None
    out: torch.Tensor | None
    batch_invariant: bool
    pool: bool
    pool_rows: int


def _index_tensor(name: str, x, shape: tuple, device, dtypes, dtype_doc: str) -> torch.Tensor:
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be None or a {dtype_doc} tensor {list(shape)}, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have dtype {dtype_doc}, got {x.dtype}")
    if x.dim() != 1 or (shape[0] is not None and x.shape[0] != shape[0]):
        want = f"[{shape[0]}]" if shape[0] is not None else "1-D"
        raise ValueError(f"{name} must be {want} (one entry per {'sequence' if shape[0] is not None else 'checkpoint'}), "
                         f"got shape {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}: all tensors must be on one device")
    return x


def _state_tensor(name: str, x, rows_doc: str, rows, HV: int, K: int, V: int, layout: str, device, dtypes) -> torch.Tensor:
    tail = (K, V) if layout == "kv" else (V, K)
    doc = f"[{rows_doc}, HV, {'K, V' if layout == 'kv' else 'V, K'}]"
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"{name} must be a torch.Tensor {doc}, got {type(x).__name__}")
    if x.dtype not in dtypes:
        raise TypeError(f"{name} must have a state storage dtype ({', '.join(str(d) for d in dtypes)}), got {x.dtype}")
    if x.dim() != 4 or tuple(x.shape[1:]) != (HV, *tail) or (rows is not None and x.shape[0] != rows):
        want = (rows_doc if rows is None else rows, HV, *tail)
        raise ValueError(f"{name} must be {doc} = {want} (state_layout={layout!r}), got {tuple(x.shape)}")
    if x.device != device:
        raise ValueError(f"{name} is on {x.device} but q is on {device}: all tensors must be on one device")
    return x


def _readable(x: torch.Tensor, check_values: bool) -> bool:
    return x.device.type != "meta" and (check_values or x.device.type == "cpu")


def check_serving_args(d: GDNDims, q, initial_state, output_final_state: bool, cu_seqlens, *, state_indices=None,
                       has_initial_state=None, state_layout="kv", checkpoint_positions=None, checkpoint_states=None,
                       out=None, batch_invariant=False, check_values: bool = False,
                       state_dtypes=FLOAT_DTYPES) -> ServingArgs:
    """Validates the serving arguments (module docstring) against sizes `d` from
    `flashqla.contract.check_gdn_inputs` (called with initial_state=None: its shape is checked here).

    Args:
        d: the call's GDNDims; q: the query (its device and dtype); initial_state: None, the
            per-sequence states [N, HV, ...] or, with state_indices, the pool [P, HV, ...] (layout
            by state_layout); output_final_state, cu_seqlens: as the op's.
        check_values: read device tensors to check their values (the reference); CPU tensors are
            always checked (no sync).
        state_dtypes: the storage dtypes accepted (the fast path: `STATE_STORAGE_DTYPES`).

    Returns: ServingArgs.

    Raises (each naming the argument, before any kernel launch):
        TypeError: a non-tensor, a wrong dtype (indices not int32/int64, has_initial_state not
            bool, a state not a storage dtype, out not q's dtype), batch_invariant not a bool.
        ValueError: state_layout not "kv"/"vk"; wrong shapes or devices; state_indices or
            has_initial_state without initial_state; checkpoint_positions without checkpoint_states
            or the reverse. On readable (CPU) tensors: an index >= P (a negative index is padding), a
            pool row written by two sequences, positions unsorted or outside every
            sequence.
    """
    if not isinstance(state_layout, str) or state_layout not in STATE_LAYOUTS:
        raise ValueError(f"state_layout must be 'kv' (FLA's [.., K, V]) or 'vk' ([.., V, K]), got {state_layout!r}")
    if not isinstance(batch_invariant, bool):
        raise TypeError(f"batch_invariant must be a bool, got {type(batch_invariant).__name__}")
    dev, N, HV, K, V = q.device, d.N, d.HV, d.K, d.V
    pool = state_indices is not None
    if pool:
        _index_tensor("state_indices", state_indices, (N,), dev, (torch.int32, torch.int64), "int32 or int64")
        if initial_state is None:
            raise ValueError("state_indices needs initial_state: the state pool [P, HV, K, V] (or [P, HV, V, K]) it indexes")
        _state_tensor("initial_state", initial_state, "P", None, HV, K, V, state_layout, dev, state_dtypes)
    elif initial_state is not None:
        _state_tensor("initial_state", initial_state, "N", N, HV, K, V, state_layout, dev, state_dtypes)
    P = initial_state.shape[0] if pool else 0
    if has_initial_state is not None:
        _index_tensor("has_initial_state", has_initial_state, (N,), dev, (torch.bool,), "bool")
        if initial_state is None:
            raise ValueError("has_initial_state needs initial_state (the states, or the pool with state_indices)")
    if pool and _readable(state_indices, check_values):
        idx = state_indices.detach().to("cpu", torch.int64)
        if bool((idx >= P).any()):
            n = int(torch.nonzero(idx >= P)[0, 0])
            raise ValueError(f"state_indices[{n}] = {int(idx[n])} is out of range for the pool initial_state of "
                             f"P = {P} rows (negative indices mark padding sequences)")
        real = idx[idx >= 0]
        if output_final_state and real.unique().numel() != real.numel():
            raise ValueError("state_indices names one pool row for two sequences: both would write it "
                             f"(indices {real.tolist()[:16]})")
    if (checkpoint_positions is None) != (checkpoint_states is None):
        given, missing = (("checkpoint_positions", "checkpoint_states") if checkpoint_states is None
                          else ("checkpoint_states", "checkpoint_positions"))
        raise ValueError(f"{given} is given without {missing}: pass both (positions [M] and the preallocated states [M, HV, ...])")
    if checkpoint_positions is not None:
        _index_tensor("checkpoint_positions", checkpoint_positions, (None,), dev, (torch.int32, torch.int64), "int32 or int64")
        M = checkpoint_positions.shape[0]
        _state_tensor("checkpoint_states", checkpoint_states, "M", M, HV, K, V, state_layout, dev, state_dtypes)
        if _readable(checkpoint_positions, check_values):
            _check_positions(checkpoint_positions, cu_seqlens, d)
    if out is not None:
        if not isinstance(out, torch.Tensor):
            raise TypeError(f"out must be None or a tensor [B, T, HV, V], got {type(out).__name__}")
        if out.dtype != q.dtype:
            raise TypeError(f"out must have q's dtype {q.dtype}, got {out.dtype}")
        if tuple(out.shape) != (d.B, d.T, HV, V):
            raise ValueError(f"out must be [B, T, HV, V] = {(d.B, d.T, HV, V)}, got {tuple(out.shape)}")
        if out.device != dev:
            raise ValueError(f"out is on {out.device} but q is on {dev}: all tensors must be on one device")
    return ServingArgs(state_indices, has_initial_state, state_layout, checkpoint_positions, checkpoint_states, out,
                       batch_invariant, pool, P)


def _check_positions(positions: torch.Tensor, cu_seqlens, d: GDNDims) -> None:
    pos = positions.detach().to("cpu", torch.int64)
    if pos.numel() > 1 and bool((pos[1:] < pos[:-1]).any()):
        i = int(torch.nonzero(pos[1:] < pos[:-1])[0, 0])
        raise ValueError(f"checkpoint_positions must be sorted (non-decreasing), got checkpoint_positions[{i}] = "
                         f"{int(pos[i])} > checkpoint_positions[{i + 1}] = {int(pos[i + 1])}")
    cu = (torch.arange(d.B + 1, dtype=torch.int64) * d.T if cu_seqlens is None
          else cu_seqlens.detach().to("cpu", torch.int64))
    # sequence n holds p when cu[n] < p <= cu[n + 1]: the first n with cu[n + 1] >= p must also have cu[n] < p
    n = torch.searchsorted(cu[1:], pos, side="left")
    bad = (pos <= 0) | (pos > cu[-1]) | (n >= cu.numel() - 1)
    if not bool(bad.any()):
        bad = cu[n] >= pos
    if bool(bad.any()):
        i = int(torch.nonzero(bad)[0, 0])
        raise ValueError(f"checkpoint_positions[{i}] = {int(pos[i])} lies inside no sequence: a position p must satisfy "
                         f"cu_seqlens[n] < p <= cu_seqlens[n + 1] for some sequence n (p saves the state after the "
                         f"first p tokens of the packed batch)")


def to_kv(x: torch.Tensor | None, layout: str) -> torch.Tensor | None:
    """A state tensor [.., K, V] from `layout` ("vk": the last two dims swapped; a view)."""
    return x if x is None or layout == "kv" else x.transpose(-1, -2)


def from_kv(x: torch.Tensor | None, layout: str) -> torch.Tensor | None:
    """A [.., K, V] state tensor in `layout` (a view; the inverse of `to_kv`)."""
    return to_kv(x, layout)


def gather_initial_states(initial_state, s: ServingArgs, N: int, dtype: torch.dtype) -> torch.Tensor | None:
    """The states [N, HV, K, V] (kv layout, `dtype`, contiguous) the sequences start from, or None
    (all zeros) when there is no initial_state.

    With a pool: row state_indices[n] (a gather, no host read), zeros where the index is negative or
    has_initial_state[n] is False. Without: initial_state itself (has_initial_state zeroing rows).
    Differentiable with respect to a per-sequence initial_state (torch.where / transpose)."""
    if initial_state is None:
        return None
    keep = None
    if s.pool:
        idx = s.state_indices.to(torch.int64)
        keep = idx >= 0
        if s.pool_rows == 0:  # every sequence must be padding (checked on CPU); nothing to read
            HV, a, b = initial_state.shape[1:]
            rows = initial_state.new_zeros((N, HV, a, b))
        else:
            rows = initial_state.index_select(0, idx.clamp(min=0))
    else:
        rows = initial_state
    if s.has_initial_state is not None:
        keep = s.has_initial_state if keep is None else keep & s.has_initial_state
    h0 = to_kv(rows, s.state_layout).to(dtype)
    if keep is not None:
        h0 = torch.where(keep[:, None, None, None], h0, torch.zeros((), dtype=dtype, device=h0.device))
    return h0.contiguous()


@torch.no_grad()
def store_final_states(pool: torch.Tensor, final_kv: torch.Tensor, s: ServingArgs) -> None:
    """Writes sequence n's final state (kv layout, any float dtype) into pool row state_indices[n],
    in the pool's layout and dtype (rounded once, here), skipping negative indices. No host read:
    a padding sequence is redirected to the row of the sequence with the largest index, with that
    sequence's own value (a duplicate write of identical bytes), or, when every sequence is padding,
    to row 0 with its current value."""
    N = final_kv.shape[0]
    if N == 0 or s.pool_rows == 0:
        return
    idx = s.state_indices.to(torch.int64)
    valid = idx >= 0
    src = from_kv(final_kv, s.state_layout).to(pool.dtype)
    # the sequence with the largest index, as a 1-element index tensor: indexing with a 0-d device
    # tensor (idx[j]) would read it on the host, a synchronisation that breaks CUDA-graph capture
    j = torch.argmax(idx).reshape(1)
    top = idx.index_select(0, j)  # [1]
    fallback_row = top.clamp(min=0)
    fallback = torch.where((top >= 0)[:, None, None, None], src.index_select(0, j), pool.index_select(0, fallback_row))
    target = torch.where(valid, idx, fallback_row)
    src = torch.where(valid[:, None, None, None], src, fallback)
    pool.index_copy_(0, target, src)


def write_back(o, final_kv, checkpoints_kv, s: "ServingArgs", initial_state, output_final_state: bool):
    """The serving call's outputs, written where its arguments say (the reference op's and the public
    op's shared last step): checkpoints_kv [M, HV, K, V] (or None) into `s.checkpoint_states` in its
    layout, o into `s.out` when given, and the final states [N, HV, K, V] into the pool's rows
    (`store_final_states`) when `s.pool`. Returns the call's (o, final_state): the pool itself with
    state_indices, else the final states in `s.state_layout` (None without output_final_state)."""
    with torch.no_grad():
        if checkpoints_kv is not None:
            s.checkpoint_states.copy_(from_kv(checkpoints_kv, s.state_layout))
        if s.out is not None:
            s.out.copy_(o)
            o = s.out
    if not output_final_state:
        return o, None
    if s.pool:
        store_final_states(initial_state, final_kv.detach(), s)
        return o, initial_state
    return o, from_kv(final_kv, s.state_layout).contiguous()


def checkpoint_pieces(cu_seqlens: torch.Tensor, positions: torch.Tensor):
    """Cuts the packed batch at the sequence starts and the checkpoint positions (on the device, no
    host read).

    Args: cu_seqlens [N + 1] (starting at 0, ending at T), positions [M] sorted, each inside a sequence.
    Returns (pieces_cu [N + M + 1] in cu_seqlens' dtype, first [N + M] bool: the piece starts a
    sequence, seq [N + M] int64: the sequence of each piece, ends [M] int64: the piece that ends at
    each position). Ties: a position equal to cu_seqlens[n + 1] ends sequence n's last piece, before
    the (empty) piece boundary of sequence n + 1 begins.
    """
    N1 = cu_seqlens.shape[0]
    keys = torch.cat([cu_seqlens.to(torch.int64) * 2 + 1, positions.to(torch.int64) * 2])
    sorted_keys, order = torch.sort(keys, stable=True)
    pieces_cu = (sorted_keys // 2).to(cu_seqlens.dtype)
    is_cu = (sorted_keys % 2) == 1
    first = is_cu[:-1]
    seq = torch.cumsum(is_cu.to(torch.int64), 0)[:-1] - 1
    rank = torch.empty_like(order)
    rank[order] = torch.arange(order.numel(), device=order.device)
    ends = rank[N1:] - 1
    return pieces_cu, first, seq, ends


def scan_pieces(P: torch.Tensor, R: torch.Tensor, first: torch.Tensor) -> torch.Tensor:
    """The states at the end of every piece: S_j = R_j where piece j starts a sequence, else
    S_j = P_j S_{j-1} + R_j, by a parallel (Hillis-Steele) scan of the affine maps (P_j, R_j), in
    ceil(log2 L) rounds of batched matmuls (no host read).

    Args: P [L, HV, K, K] the pieces' transitions (the state after the piece from a start S is
    P S + R); R [L, HV, K, V] the pieces' ends from their own start (zeros, or the sequence's
    initial state on its first piece); first [L] bool. Returns S [L, HV, K, V] in R's dtype."""
    L = R.shape[0]
    P = torch.where(first[:, None, None, None], torch.zeros((), dtype=P.dtype, device=P.device), P)
    d = 1
    while d < L:
        P_prev, R_prev = P[:-d], R[:-d]
        R = torch.cat([R[:d], P[d:] @ R_prev + R[d:]])
        P = torch.cat([P[:d], P[d:] @ P_prev])
        d *= 2
    return R

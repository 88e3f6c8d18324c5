"""`chunk_gated_delta_rule_cp`: Gated DeltaNet over a packed batch sharded across the ranks of a
process group, forward and backward (autograd), exchanging only state-sized summaries.

Per rank (plan: `flashqla.distributed.context`; compute: a `flashqla.distributed.backends` backend;
`n` local pieces, piece 0 possibly continuing a sequence from an earlier rank, piece n - 1 possibly
continuing on a later one). Two paths compute the same thing; every rank makes the same two
collectives (one all-gather forward, one backward) whichever it takes.

Segmented path (a backend with `segment_plan`, e.g. `KernelBackend(cp="auto")`, whose plan splits the
rank's pieces; `flashqla.cp.forward.cp_forward_open` / `flashqla.cp.backward.cp_backward_open`): the rank's pieces are ONE
intra-device CP pass over its T_r tokens, segments of L tokens run side by side, a continuing piece 0
treated as an "open" sequence (its entering state S_in is known only after the exchange):

  Forward
    1. prepare         once over the segments
    2. run             every segment: first segments from their initial state, piece 0's first
                       segment (when it continues) and every later segment from zero -> o(0), Q
    3. transition      one launch, v = 0 from I on every later segment AND on a continuing piece 0's
                       first segment -> U rows, per-segment transitions P (CP-1)
    4. local scan      B_j (entering states with S_in = 0) and every end state (CP-2); for piece 0
                       also the composed maps A_j = P_{j-1} ... P_0 (segment j entered with
                       A_j S_in + B_j) and its whole map P_piece = A_m (`scan_open_states`)
    5. publish         (P_piece, E_piece = B_m) when the shard lies inside one sequence; (0, E_{n-1})
                       when the last piece starts here; (I, 0) for an empty shard; zeros otherwise
    6. all-gather      one buffer [HV, K, K + V] per rank, state dtype
    7. scan            S_in = the state entering piece 0, over the ranks (CP-2)
    8. correct         entering states A_j S_in + B_j on piece 0's segments (one batched GEMM), its
                       end state P_piece S_in + E_piece; o_t += S_j^T U_t on every corrected
                       segment (CP-3; GEMMs in o's dtype). No further recurrent launch.
  Backward
    1. transition      recomputed (U rows, P; the forward kept the segments' entering states, not U)
    2. E, D            E_j = sum_t U_t do_t^T per corrected segment (GEMMs); the gradient reaching
                       S_in, D = sum_j A_j^T E_j + P_piece^T dht_0 over piece 0's segments (BWD-dSin;
                       dht_0 the final-state gradient when piece 0 ends its sequence here, else 0)
    3. all-gather      D, one buffer [HV, K, V] per rank (after the backward check-in: the op's
                       docstring)
    4. reverse scan    X = the gradient of the state leaving the last piece: from the rank holding
                       the sequence's last token, X <- D_r + P_r^T X over the ranks in between
    5. backward        the reverse segment scan with terminal gradients (X on a continuing last
                       piece), then ONE unsplit backward over all segments from their true entering
                       states and terminal gradients (`flashqla.ops.gdn.backend.Backend.bwd`)
  Launches per rank: forward prepare + 2 recurrent; backward 1 recurrent + 1 backward (its kernels).

Per-piece path (any other backend, e.g. `FunctionBackend` around an FLA-signature op, a plan that does
not split, an empty shard):

  Forward
    1. main run        every piece from its own initial state (piece 0 from zero when it continues):
                       outputs o(0), end states E (exact for every piece but a continuing piece 0)
    2. transition run  if piece 0 continues: piece 0 again with v = 0 from S_0 = I (a [K, K] state,
                       value width K): end state P_0 and outputs U (CP-1: the recurrence is affine in
                       (S_0, v), so P_0 is the piece's transition and U_t = scale Phi_t^T q_t)
    3. publish, 4. all-gather, 5. scan as above
    6. correct         o_t += S_in^T U_t on piece 0 (CP-3 in the form o(S) = o(0) + o_{v=0}(S) and
                       o_{v=0}(S)_t = S^T o_{v=0}(I)_t by linearity), E_0 <- P_0 S_in + E_0
  Backward (the VJP is linear in the cotangents (do, dht); the adjoint of S -> P S + Q is X -> P^T X)
    1. D               if piece 0 continues, without a backward pass: o_t = o0_t + S_in^T U_t and
                       end state P_0 S_in + E_0, so D = sum_t U_t do_t^T + P_0^T dht_0 (BWD-dSin with
                       one segment); U recomputed by the transition run, P_0 kept from the forward
    2. all-gather      D (after the check-in); 3. reverse scan X as above
    4. local backward  ONE backward over all pieces with their true entering states (S_in for piece
                       0), the cotangent do, and dht = the final-state gradient on pieces that end
                       their sequence here, X on a last piece that continues

Exchanged volume per call, independent of T: the forward sends HV * K * (K + V) and the backward
HV * K * V elements of the state dtype per rank (fp32 with the kernels: 4 MiB and 2 MiB per rank at
HV = 32, K = V = 128), and each rank receives W times that. Work per rank: on the segmented path one
intra-device CP forward over T_r tokens (what the single-device op does with the same mode over T
tokens) and a backward of one recurrent launch plus one backward over the segments; on the per-piece
path a continuing piece 0 gets one transition run (a forward pass with v = 0) in the forward and one
in the backward; no piece is backpropagated twice on either path.

Measured on two GPUs: `benchmarks/results/h200-2gpu.md`; the per-rank algorithm before the
segmented path: `benchmarks/journal/multi-gpu.md`.

Derivations: CP-1 (affine map of a segment), CP-2 (composition, the scan), CP-3 (output correction),
BWD-dSin (the gradient at an entering state from forward quantities) in `derivations/cp.py`; the
simulated single-device form is `reference.gdn.cp`, the intra-device passes `flashqla.cp.forward` / `flashqla.cp.backward`.
"""

from __future__ import annotations

import hashlib
import math
import numbers
import threading
import time
import weakref
from dataclasses import dataclass

import torch

from flashqla.distributed.backends import resolve_backend
from flashqla.distributed.context import CPContext, _as_offsets, _process_group, build_cp_context
from flashqla.contract import FLOAT_DTYPES, check_gdn_inputs, check_input_values, clamp_gates, dense, l2norm
from flashqla.cp.backward import cp_backward_open
from flashqla.cp.forward import cp_forward_open
from flashqla.cp.segments import build_segment_tables

__all__ = ["chunk_gated_delta_rule_cp", "exchange_bytes"]

#: Tokens per block of the forward's output correction (bounds its fp32 temporaries).
_CORRECTION_BLOCK = 32768


def exchange_bytes(HV: int, K: int, V: int, world_size: int, state_dtype: torch.dtype = torch.float32) -> dict:
    """Bytes moved by one call: {"fwd_send", "bwd_send"} per rank and {"fwd_recv", "bwd_recv"} per
    rank (all-gathers: each rank receives world_size buffers, its own included)."""
    e = torch.empty((), dtype=state_dtype).element_size()
    f, b = HV * K * (K + V) * e, HV * K * V * e
    return dict(fwd_send=f, bwd_send=b, fwd_recv=world_size * f, bwd_recv=world_size * b)


def _all_gather(x: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """[W, *x.shape]: every rank's x, by one all-gather over ctx.group (no communication for W == 1)."""
    if ctx.world_size == 1:
        return x.unsqueeze(0)
    import torch.distributed as dist

    x = x.contiguous()
    out = x.new_empty((ctx.world_size * x.shape[0], *x.shape[1:]))  # rank-major concatenation (gloo and NCCL)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=ctx.group)
    return out.view(ctx.world_size, *x.shape)


def _acc_dtype(dt: torch.dtype) -> torch.dtype:
    return torch.promote_types(dt, torch.float32)


def _add_rows(dst: torch.Tensor, lo: int, src: torch.Tensor) -> None:
    """dst[:, lo:] += src, accumulated in at least fp32."""
    acc = _acc_dtype(dst.dtype)
    part = dst[:, lo:]
    part.copy_((part.to(acc) + src.to(acc)).to(dst.dtype))


@dataclass(eq=False)
class _Run:
    ctx: CPContext
    backend: object
    scale: float
    output_final_state: bool
    state_dtype: torch.dtype
    shape: tuple = ()  # (HV, K, V)
    checkin: _CheckIn | None = None  # the backward's check-in (None: none, see `_register_call`)


# ------------------------------------------------------------------------------------------------
# the backward check-in: a bounded rendezvous through the store before the backward's collective
# ------------------------------------------------------------------------------------------------

#: The largest backward_timeout accepted, in seconds (None is the way to wait without a bound).
_MAX_BACKWARD_TIMEOUT = 1e9
#: The check-in's pauses between two looks at the store, in seconds: _CHECKIN_PAUSE_S for the first
#: _CHECKIN_FAST_S (ranks mostly arrive within a millisecond of each other), then doubling up to
#: _CHECKIN_MAX_PAUSE_S.
_CHECKIN_PAUSE_S = 1e-4
_CHECKIN_FAST_S = 0.005
_CHECKIN_MAX_PAUSE_S = 0.01


def _check_backward_timeout(t):
    """backward_timeout as a float, or None. Raises TypeError / ValueError naming it."""
    if t is None:
        return None
    if isinstance(t, bool) or not isinstance(t, numbers.Real):
        raise TypeError(f"backward_timeout must be None or a number of seconds, got {type(t).__name__}")
    t = float(t)
    if not (math.isfinite(t) and 0 < t <= _MAX_BACKWARD_TIMEOUT):
        raise ValueError(f"backward_timeout must be None or a number of seconds in (0, {_MAX_BACKWARD_TIMEOUT:g}], "
                         f"got {t!r}")
    return t


def _checkin_store(group):
    """(store, key prefix, the group's global ranks) of the check-in on `group`, or
    (None, None, None) when they cannot be had (a group that
    torch.distributed does not know, a torch without these helpers): then the backward makes no
    check-in. The store is torch.distributed's default store, which every group of the world shares
    (c10d builds each group's own store as a prefix of it); the prefix holds the group's name, which
    c10d makes the same on every rank and unique among the world's groups."""
    if group is None:
        return None, None, None
    try:
        import torch.distributed as dist
        from torch.distributed import distributed_c10d as c10d

        store = c10d._get_default_store()
        ranks = tuple(int(r) for r in dist.get_process_group_ranks(group))
        name = c10d._get_process_group_name(group)
    except (AttributeError, ImportError, KeyError, RuntimeError, ValueError):
        return None, None, None
    return store, f"flashqla/cp/{name}/", ranks


class _GroupCalls:
    """This process's record of one process group: `calls`, the number of calls so far that will run
    the backward (the next call's number; the same on every rank, since every rank makes the same
    calls in the same order, which the fingerprint checks call by call), the check-in store
    (`_checkin_store`; None: no check-in) and `pending`, this rank's check-in keys still in the
    store, oldest first (`_check_in` deletes them)."""

    def __init__(self, group):
        self.lock = threading.Lock()
        self.calls = 0
        self.pending = []
        self.store, self.prefix, self.ranks = _checkin_store(group)


#: process group -> its `_GroupCalls` (weak: a destroyed group's record goes with it).
_GROUPS = weakref.WeakKeyDictionary()
_GROUPS_LOCK = threading.Lock()


def _group_calls(group) -> _GroupCalls:
    with _GROUPS_LOCK:
        try:
            calls = _GROUPS.get(group)
            if calls is None:
                calls = _GROUPS[group] = _GroupCalls(group)
        except TypeError:  # a group object that takes no weak reference: no record, no check-in
            return _GroupCalls(None)
    return calls


@dataclass(eq=False)
class _CheckIn:
    """One call's backward check-in: its group record, its call number, this rank and the group's size,
    the timeout in seconds, and how many backwards of the call this rank has begun (retain_graph)."""

    group: _GroupCalls
    call: int
    rank: int
    world_size: int
    timeout: float
    attempts: int = 0


def _register_call(ctx: CPContext, requires_grad: bool, timeout) -> _CheckIn | None:
    """Number a call that will run the backward on more than one rank (every such call counts, whatever
    backward_timeout, so that the numbers stay the same on every rank); its check-in, or None (no
    backward, one rank, backward_timeout None, or no store)."""
    if not requires_grad or ctx.world_size == 1 or ctx.group is None:
        return None
    calls = _group_calls(ctx.group)
    with calls.lock:
        call = calls.calls
        calls.calls += 1
    if timeout is None or calls.store is None:
        return None
    return _CheckIn(calls, call, ctx.rank, ctx.world_size, timeout)


def _check_in(ci: _CheckIn) -> None:
    """The check-in of one backward, before its collective. Returns when every rank of the group has
    checked in; raises RuntimeError on every rank that checked in when one rank has not within the
    timeout, so that no rank of the group enters this backward's collective.

    Keys, under the group's prefix, for backward `a` (0, then 1, ... with retain_graph) of call `c`:
    "c.a/<rank>" (set by each rank as it arrives) and "c.a/decision" (written once, by compare_set,
    by the first rank to decide: "go", or "abort <rank> <timeout> <missing ranks>").

    1. set my key; wait (bounded) for every rank's key, polling the store with `check` (0.1 ms pauses
       for the first 5 ms, then doubling to 10 ms).
    2. The wait returned: decide "go". It timed out: the ranks whose key is missing; none (they came
       just after the timeout): "go"; else "abort ...".
    3. compare_set the decision (it sets only if no rank has decided yet) and follow the value it
       returns, whoever wrote it: go on, or raise.
    So the ranks never split: "go" is written only once every key is there (every rank has arrived
    and will read the decision), and a rank that arrives after another has written "abort" reads it
    and raises too; a rank that never arrives raises nothing here (it is elsewhere).

    Clean-up (the store does not grow): after reading "go" for backward X, this rank deletes every key
    it set at earlier check-ins (group rank 0 also their decision keys); X's keys stay until its next
    "go". Safe: "go" for X means every rank has set its key of X, which a rank does at its check-in
    for X, after its check-ins for all earlier backwards are over (each waits, decides and reads in
    order), so no rank reads an earlier key again. The ranks run the backwards in one order (the
    backward's collectives need that already). Each call's number is fixed at its forward, so this
    holds whatever order the backwards take (reverse layer order, as a model's backward does). Left in
    the store: W keys and one decision per group, plus the decision of an aborted check-in that group
    rank 0 never reached."""
    calls, r, W = ci.group, ci.rank, ci.world_size
    store = calls.store
    base = f"{calls.prefix}{ci.call}.{ci.attempts}/"
    ci.attempts += 1
    keys = [f"{base}{s}" for s in range(W)]
    decision = base + "decision"
    store.set(keys[r], b"1")
    with calls.lock:
        calls.pending.append(keys[r])
        if r == 0:
            calls.pending.append(decision)
    # poll with `check` (one short request each; 0.1 ms pauses for 5 ms, then doubling to 10 ms): a store's own
    # wait would hold a TCP client's lock for the whole wait (other users of the default store on this
    # rank would wait too), a file store's wait sleeps 10 ms between looks, and a c10d wait cut into
    # slices logs a warning per slice
    start, pause = time.perf_counter(), _CHECKIN_PAUSE_S
    arrived = store.check(keys)
    while not arrived and (waited := time.perf_counter() - start) < ci.timeout:
        time.sleep(pause)
        if waited > _CHECKIN_FAST_S:
            pause = min(2 * pause, _CHECKIN_MAX_PAUSE_S)
        arrived = store.check(keys)
    missing = [] if arrived else [s for s in range(W) if not store.check([keys[s]])]
    mine = "go" if not missing else f"abort {r} {ci.timeout!r} {','.join(map(str, missing))}"
    verdict = store.compare_set(decision, "", mine)
    verdict = verdict.decode() if isinstance(verdict, bytes) else str(verdict)
    if verdict == "go":
        with calls.lock:
            i = calls.pending.index(keys[r])
            old = calls.pending[:i]
            del calls.pending[:i]
        for key in old:
            store.delete_key(key)
        return
    raise RuntimeError(_abort_message(ci, verdict))


def _abort_message(ci: _CheckIn, verdict: str) -> str:
    _, setter, timeout, missing = verdict.split(" ", 3)
    setter, missing = int(setter), [int(s) for s in missing.split(",")]
    calls, r = ci.group, ci.rank
    where = f"call {ci.call} (counting from 0 this process's calls with grad on the group)"
    where += f", backward {ci.attempts} of it" if ci.attempts > 1 else ""
    glob = ""
    if calls.ranks is not None and calls.ranks != tuple(range(ci.world_size)):
        glob = f" (global ranks {[calls.ranks[s] for s in missing]})"
    whose = "this rank's" if setter == r else f"rank {setter}'s"
    late = (f" This rank reached it after rank {setter} had stopped waiting." if r in missing and setter != r else "")
    return (f"chunk_gated_delta_rule_cp: the backward of {where} on process group {calls.prefix.split('/')[2]!r}: "
            f"rank(s) {missing}{glob} did not reach it within backward_timeout={float(timeout):g} s ({whose}), "
            f"so rank {r} stops here and no rank of the group enters this backward's collective.{late} Likely "
            "cause: those ranks ran the forward with grad and never backpropagated through o: an exception on "
            "that rank or a loss that does not use o. Every rank must backpropagate through every call it made "
            "with grad (or make the call under torch.no_grad()). If a rank can be later than that, pass a "
            "larger backward_timeout= (seconds), or backward_timeout=None to wait for the process group's "
            "timeout instead.")


def _backward_all_gather(D: torch.Tensor, run: _Run) -> torch.Tensor:
    """The backward's all-gather of D, after the check-in (`_check_in`) when the call has one."""
    if run.checkin is not None:
        _check_in(run.checkin)
    return _all_gather(D, run.ctx)


def _entering_states(run: _Run, h0, S_in, device):
    """[n, HV, K, V] entering states of the local pieces (S_in, or zero when None, on a continuing
    piece 0; initial_state rows elsewhere), or None when all are zero."""
    ctx = run.ctx
    if h0 is None and S_in is None:
        return None
    if h0 is not None:
        rows = h0.index_select(0, ctx._tensor("piece_seqs", ctx.piece_seqs, device)).clone()
    else:
        HV, K, V = S_in.shape
        rows = S_in.new_zeros(ctx.num_pieces, HV, K, V)
    if ctx.first_continues:
        if S_in is None:
            rows[0].zero_()
        else:
            rows[0] = S_in.to(rows.dtype)
    return rows


def _transition_run(run: _Run, q, k, g, beta):
    """Piece 0 (tokens [0, T0)) run with v = 0 from S_0 = I ([K, K] state, value width K): its
    outputs U [1, T0, HV, K] (U_t = scale Phi_t^T q_t) and end state P_0 [HV, K, K] (CP-1)."""
    ctx, be, sdt = run.ctx, run.backend, run.state_dtype
    dev = q.device
    HV, K = g.shape[2], k.shape[3]
    T0 = ctx.local_offsets[1]
    cu0 = ctx._tensor("first_piece", (0, T0), dev, torch.int32)
    eye = torch.eye(K, dtype=sdt, device=dev).expand(1, HV, K, K).contiguous()
    v0 = q.new_zeros((1, T0, HV, K))
    U, P0, _ = be.forward(q[:, :T0], k[:, :T0], v0, g[:, :T0], beta[:, :T0], run.scale, eye, cu0)
    return U, P0[0].to(sdt)


def _scan_entering(maps: torch.Tensor, ctx: CPContext, K: int) -> torch.Tensor:
    """The state entering this rank's piece 0: C <- P_r C + Q_r over the gathered maps [W, HV, K, K + V]
    of the ranks from the one where the sequence starts up to this one (CP-2)."""
    C = maps[ctx.start_rank, :, :, K:]
    for r in range(ctx.start_rank + 1, ctx.rank):
        C = torch.baddbmm(maps[r, :, :, K:], maps[r, :, :, :K], C)
    return C.clone()


def _scan_leaving_grad(dS: torch.Tensor, P_between: torch.Tensor, ctx: CPContext) -> torch.Tensor:
    """The gradient of the state leaving this rank's last piece: X <- D_r + P_r^T X over the gathered
    gradients [W, HV, K, V], from the rank holding the sequence's last token back to rank + 1
    (the adjoint of the forward scan; P of the ranks in between from the forward's all-gather)."""
    X = dS[ctx.end_rank]
    for i in range(P_between.shape[0] - 1, -1, -1):  # ranks end_rank - 1 .. rank + 1
        X = torch.baddbmm(dS[ctx.rank + 1 + i], P_between[i].transpose(-1, -2), X)
    return X


def _segment_plan(run: _Run, q, v):
    """The backend's split plan for this rank's pieces (a `CPPlan`), or None: the per-piece path."""
    ctx = run.ctx
    plan_fn = getattr(run.backend, "segment_plan", None)
    if plan_fn is None or ctx.num_pieces == 0:
        return None
    cu = ctx._tensor("local_offsets", ctx.local_offsets, q.device, torch.int32)
    longest = max(b - a for a, b in zip(ctx.local_offsets[:-1], ctx.local_offsets[1:]))
    return plan_fn(q, v, cu, longest)


def _cp_forward(run: _Run, q, k, v, g, beta, h0):
    plan = _segment_plan(run, q, v)
    if plan is not None:
        return _cp_forward_segments(run, plan, q, k, v, g, beta, h0)
    ctx, be, sdt = run.ctx, run.backend, run.state_dtype
    dev = q.device
    HV, V, K = v.shape[2], v.shape[3], k.shape[3]
    n = ctx.num_pieces
    keep = dict(path="pieces", saved_main=None, S_in=None, P0=None, P_between=None)
    E = P0 = U = None
    if n:
        cu = ctx._tensor("local_offsets", ctx.local_offsets, dev, torch.int32)
        o, E, keep["saved_main"] = be.forward(q, k, v, g, beta, run.scale, _entering_states(run, h0, None, dev), cu)
        E = E.to(sdt)
    else:
        o = torch.empty((1, 0, HV, V), dtype=q.dtype, device=dev)
    if ctx.first_continues:
        U, P0 = _transition_run(run, q, k, g, beta)
        keep["P0"] = P0

    send = torch.zeros(HV, K, K + V, dtype=sdt, device=dev)
    if n == 0:
        send[:, :, :K] = torch.eye(K, dtype=sdt, device=dev)
    elif ctx.last_continues:
        if ctx.first_continues and n == 1:
            send[:, :, :K] = P0
        send[:, :, K:] = E[-1]
    maps = _all_gather(send, ctx)  # [W, HV, K, K + V]

    if ctx.first_continues:
        S_in = _scan_entering(maps, ctx, K)
        keep["S_in"] = S_in
        T0 = ctx.local_offsets[1]
        for lo in range(0, T0, _CORRECTION_BLOCK):
            hi = min(T0, lo + _CORRECTION_BLOCK)
            corr = torch.einsum("bthk,hkv->bthv", U[:, lo:hi].to(sdt), S_in)
            o[:, lo:hi] = (o[:, lo:hi].to(_acc_dtype(o.dtype)) + corr).to(o.dtype)
        E[0] = torch.baddbmm(E[0], P0, S_in)
    if ctx.last_continues:
        keep["P_between"] = maps[ctx.rank + 1 : ctx.end_rank, :, :, :K].clone()

    return o, _final_states(run, E, h0, dev), keep


def _final_states(run: _Run, E, h0, dev):
    """The op's final_state [N, HV, K, V] (or None): the end states E [n, ...] of the pieces that end
    their sequence here, the initial state of the empty sequences this rank owns, zeros elsewhere."""
    if not run.output_final_state:
        return None
    ctx = run.ctx
    HV, K, V = run.shape
    final = torch.zeros(ctx.N, HV, K, V, dtype=run.state_dtype, device=dev)
    n = ctx.num_pieces
    ends_here = n - 1 if ctx.last_continues else n
    if ends_here:
        seqs = ctx._tensor("final_seqs", ctx.piece_seqs[:ends_here], dev)
        final.index_copy_(0, seqs, E[:ends_here].to(run.state_dtype))
    if ctx.empty_seqs and h0 is not None:
        idx = ctx._tensor("empty_seqs", ctx.empty_seqs, dev)
        final.index_copy_(0, idx, h0.index_select(0, idx).to(run.state_dtype))
    return final


def _cp_forward_segments(run: _Run, plan, q, k, v, g, beta, h0):
    """The segmented path: the rank's pieces as one intra-device CP pass (`cp_forward_open`), piece 0
    an open sequence when it continues (transitioned from I in the same launch as the other segments,
    corrected with A_j S_in + B_j after the exchange)."""

    ctx, be, sdt = run.ctx, run.backend, run.state_dtype
    dev = q.device
    HV, K, V = run.shape
    n = ctx.num_pieces
    cu = ctx._tensor("local_offsets", ctx.local_offsets, dev, torch.int32)
    tkey = ("segment_tables", plan.segment_len, str(dev))
    tables = ctx._device_cache.get(tkey)
    if tables is None:  # the context's offsets are fixed: built once per (context, L, device)
        tables = ctx._device_cache[tkey] = build_segment_tables(cu, plan.segment_len, T=ctx.local_len)
    keep = dict(path="segments", plan=plan, tables=tables, saved=None, P_between=None)

    def exchange(P_open, ends):
        send = torch.zeros(HV, K, K + V, dtype=sdt, device=dev)
        if ctx.last_continues:
            if ctx.first_continues and n == 1:
                send[:, :, :K] = P_open
            send[:, :, K:] = ends[-1]
        maps = _all_gather(send, ctx)  # [W, HV, K, K + V]
        if ctx.last_continues:
            keep["P_between"] = maps[ctx.rank + 1 : ctx.end_rank, :, :, :K].clone()
        return _scan_entering(maps, ctx, K) if ctx.first_continues else None

    o, E, keep["saved"] = cp_forward_open(be.cp_backend, q, k, v, g, beta, run.scale, _entering_states(run, h0, None, dev),
                                          tables, block_v=plan.BV, exchange=exchange, open_first=ctx.first_continues)
    return o, _final_states(run, E, h0, dev), keep


def _cp_backward_segments(run: _Run, keep, q, k, v, g, beta, h0, do, dfinal):
    """The segmented path's backward (`cp_backward_open`): D from forward quantities before the
    all-gather, then one backward over all segments."""

    ctx, sdt = run.ctx, run.state_dtype
    dev = q.device
    HV, K, V = run.shape
    dht = _terminal_grads(run, dfinal, dev)

    def exchange(D):
        dS = _backward_all_gather(D if D is not None else torch.zeros(HV, K, V, dtype=sdt, device=dev), run)
        return _scan_leaving_grad(dS, keep["P_between"], ctx) if ctx.last_continues else None

    *grads, dh0_loc = cp_backward_open(run.backend.cp_backend, q, k, v, g, beta, do, dht, run.scale, keep["saved"],
                                       keep["tables"], block_v=keep["plan"].BV, exchange=exchange)
    return (*grads, _initial_state_grad(run, dh0_loc, h0, dfinal, dev))


def _terminal_grads(run: _Run, dfinal, dev):
    """[n, HV, K, V] gradient reaching each local piece's end state, or None when all are zero: the
    final state's gradient on pieces that end their sequence here, zero on a last piece that
    continues (its gradient, X, comes from the later ranks)."""
    ctx = run.ctx
    if dfinal is None:
        if not ctx.last_continues:
            return None
        HV, K, V = run.shape
        return torch.zeros(ctx.num_pieces, HV, K, V, dtype=run.state_dtype, device=dev)
    dht = dfinal.index_select(0, ctx._tensor("piece_seqs", ctx.piece_seqs, dev)).to(run.state_dtype)
    if ctx.last_continues:
        dht[-1].zero_()
    return dht


def _entering_grad(run: _Run, keep, q, k, g, beta, do, dht):
    """D [HV, K, V]: the gradient reaching piece 0's entering state S_in through this rank's outputs
    and piece 0's end state (not through a continuing end state: the reverse scan adds P_0^T X),
    without a backward pass: o_t = o0_t + S_in^T U_t on piece 0 and its end state is P_0 S_in + E_0,
    so D = sum_t U_t do_t^T + P_0^T dht_0 (BWD-dSin with one segment). U is recomputed by the transition
    run (v = 0 from I over piece 0; the forward's P_0 is kept)."""
    sdt = run.state_dtype
    U, _ = _transition_run(run, q, k, g, beta)
    T0 = U.shape[1]
    D = torch.zeros(keep["P0"].shape[0], U.shape[3], do.shape[3], dtype=sdt, device=q.device)
    for lo in range(0, T0, _CORRECTION_BLOCK):
        hi = min(T0, lo + _CORRECTION_BLOCK)
        D += torch.einsum("bthk,bthv->hkv", U[:, lo:hi].to(sdt), do[:, lo:hi].to(sdt))
    if dht is not None:
        D = torch.baddbmm(D, keep["P0"].transpose(-1, -2), dht[0])
    return D


def _cp_backward(run: _Run, keep, q, k, v, g, beta, h0, do, dfinal):
    ctx, be, sdt = run.ctx, run.backend, run.state_dtype
    dev = q.device
    HV, V, K = v.shape[2], v.shape[3], k.shape[3]
    n = ctx.num_pieces
    if not run.output_final_state:
        dfinal = None
    do = torch.zeros(v.shape, dtype=q.dtype, device=dev) if do is None else do.contiguous()
    if keep["path"] == "segments":
        return _cp_backward_segments(run, keep, q, k, v, g, beta, h0, do, dfinal)
    dht = _terminal_grads(run, dfinal, dev) if n else None
    D = _entering_grad(run, keep, q, k, g, beta, do, dht) if ctx.first_continues else torch.zeros(HV, K, V, dtype=sdt, device=dev)
    dS = _backward_all_gather(D, run)  # [W, HV, K, V]
    if ctx.last_continues:
        dht[-1] = _scan_leaving_grad(dS, keep["P_between"], ctx)

    dh0_loc = None
    if n:  # the one local backward: true entering states and terminal gradients
        cu = ctx._tensor("local_offsets", ctx.local_offsets, dev, torch.int32)
        h_in = _entering_states(run, h0, keep["S_in"], dev)
        *grads, dh0_loc = be.backward(q, k, v, g, beta, run.scale, h_in, cu, do, dht, keep["saved_main"])
    else:  # empty shard: empty gradients
        grads = [torch.zeros_like(x) for x in (q, k, v, g, beta)]

    return (*grads, _initial_state_grad(run, dh0_loc, h0, dfinal, dev))


def _initial_state_grad(run: _Run, dh0_loc, h0, dfinal, dev):
    """d initial_state [N, HV, K, V] (None without an initial state): the local backward's entering-state
    gradients dh0_loc [n, ...] on the pieces that start their sequence here, the final-state gradient
    on the empty sequences this rank owns, zeros elsewhere."""
    if h0 is None:
        return None
    ctx = run.ctx
    n = ctx.num_pieces
    dh0 = torch.zeros_like(h0)
    lo = 1 if ctx.first_continues else 0
    if n > lo:
        seqs = ctx._tensor("start_seqs", ctx.piece_seqs[lo:], dev)
        dh0.index_copy_(0, seqs, dh0_loc[lo:].to(dh0.dtype))
    if ctx.empty_seqs and dfinal is not None:
        idx = ctx._tensor("empty_seqs", ctx.empty_seqs, dev)
        dh0.index_copy_(0, idx, dfinal.index_select(0, idx).to(dh0.dtype))
    return dh0


class _CPFunction(torch.autograd.Function):
    """Autograd wiring of the cross-rank CP op (wiring only: `_cp_forward`, `_cp_backward`). Its
    backward runs one collective: every rank of the group must backpropagate through the op. First
    order only (a second derivative raises)."""

    @staticmethod
    def forward(fctx, q, k, v, g, beta, initial_state, run):
        o, final, keep = _cp_forward(run, q, k, v, g, beta, initial_state)
        fctx.run, fctx.keep = run, keep
        fctx.save_for_backward(q, k, v, g, beta, initial_state)
        fctx.set_materialize_grads(False)
        if final is None:
            final = o.new_empty((0,), dtype=run.state_dtype)
            fctx.mark_non_differentiable(final)
        return o, final

    @staticmethod
    @torch.autograd.function.once_differentiable
    def backward(fctx, do, dfinal):
        q, k, v, g, beta, h0 = fctx.saved_tensors
        dq, dk, dv, dg, dbeta, dh0 = _cp_backward(fctx.run, fctx.keep, q, k, v, g, beta, h0, do, dfinal)
        return dq, dk, dv, dg, dbeta, dh0, None


def _check_local(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, use_qk_l2norm_in_kernel,
                 cp_context, group, backend, backward_timeout):
    """The checks of one rank's arguments that need no collective: (dims, backend, global offsets
    or None). Raises TypeError / ValueError / RuntimeError naming the argument."""
    if cp_context is not None:
        if not isinstance(cp_context, CPContext):
            raise TypeError(f"cp_context must be a CPContext from build_cp_context, got {type(cp_context).__name__}")
        if cu_seqlens is not None:
            raise ValueError("cu_seqlens must be None when cp_context is given (the context holds the global offsets)")
        if group is not None:
            raise ValueError("give cp_context or group, not both (the context holds its group)")
    d = check_gdn_inputs(q, k, v, g, beta, scale, None, output_final_state, None)
    _check_backward_timeout(backward_timeout)
    if d.B != 1:
        raise ValueError(f"q: context parallelism takes one packed batch row, B == 1 (pack sequences with cu_seqlens), got B = {d.B}")
    if not isinstance(use_qk_l2norm_in_kernel, bool):
        raise TypeError(f"use_qk_l2norm_in_kernel must be a bool, got {type(use_qk_l2norm_in_kernel).__name__}")
    if initial_state is not None:
        if not isinstance(initial_state, torch.Tensor) or initial_state.dtype not in FLOAT_DTYPES:
            raise TypeError("initial_state must be None or a floating-point tensor [N, HV, K, V] (global N)")
        if initial_state.device != q.device:
            raise ValueError(f"initial_state is on {initial_state.device} but q is on {q.device}: all tensors must be on one device")
        if initial_state.device.type == "cpu":
            check_input_values(q[:, :0], k[:, :0], v[:, :0], beta[:, :0], initial_state)
    cu = None if cp_context is not None or cu_seqlens is None else _as_offsets(cu_seqlens)
    N = cp_context.N if cp_context is not None else (1 if cu is None else len(cu) - 1)
    if initial_state is not None and tuple(initial_state.shape) != (N, d.HV, d.K, d.V):
        raise ValueError(
            f"initial_state must be the global [N, HV, K, V] = {(N, d.HV, d.K, d.V)} (N = sequences of the whole "
            f"batch), got {tuple(initial_state.shape)}"
        )
    if cp_context is not None:
        ctx = cp_context
        if d.T != ctx.local_len:
            raise ValueError(
                f"q holds T = {d.T} tokens but this rank's shard (rank {ctx.rank} of {ctx.world_size}) is tokens "
                f"[{ctx.start}, {ctx.end}) of the global batch ({ctx.local_len} tokens; shard_lens {list(ctx.shard_lens)})"
            )
    be = resolve_backend(backend, q)
    be.check(q, k, v, g, beta, initial_state)
    if cp_context is not None and cp_context.group is None and cp_context.world_size > 1:
        raise RuntimeError("cp_context was built without a process group (rank=, world_size=): it cannot run across ranks")
    return d, be, cu


#: What the ranks must agree on, in the order of the fingerprint (after "ok", the argument code,
#: "will run backward", "local_len"): name in the error, how to read it.
_FIELDS = ("cu_seqlens (the global offsets)", "the shard table (shard_lens)", "H (q.shape[2])", "K (q.shape[3])",
           "HV (v.shape[2])", "V (v.shape[3])", "q's dtype", "g's dtype", "beta's dtype",
           "initial_state (None, or its dtype and shape)", "output_final_state", "use_qk_l2norm_in_kernel", "scale",
           "backward_timeout (None on some ranks, a number on others)",
           "calls on this group that ran a backward so far (a rank that failed a call after the others had "
           "counted it)")
#: The arguments a rank's rejected input is reported by (the first word of its error, else "an argument").
_ARGS = ("an argument", "q", "k", "v", "g", "beta", "scale", "initial_state", "output_final_state", "cu_seqlens",
         "use_qk_l2norm_in_kernel", "cp_context", "group", "backend", "backward_timeout")


def _digest(value) -> int:
    """A 62-bit digest of `value`'s repr, the same in every process (unlike hash() of a str)."""
    return int.from_bytes(hashlib.blake2b(repr(value).encode(), digest_size=8).digest(), "little") >> 2


def _dtype_code(dt) -> int:
    return FLOAT_DTYPES.index(dt) + 1 if dt in FLOAT_DTYPES else 0


def _agree(q, v, g, beta, scale, initial_state, output_final_state, use_l2, cp_context, cu, d, requires_grad, error,
           group_info, checks_in=False):
    """Before the call's first collective: one all-gather of a small int64 fingerprint per rank ("my
    checks passed", which argument failed, "I will run the backward", my shard length, a digest of
    the global cu_seqlens and of the shard table, the head counts and dims, the dtypes, the flags, the
    scale, whether the backward will check in, `checks_in`, and the group's count of calls that ran a
    backward, which numbers the check-ins). Raises on every rank, naming the
    argument and the ranks, when a rank's checks failed (that rank re-raises its own error, with a
    note) or the ranks disagree; returns the shard lengths of every rank (a context-free call's shard
    table)."""
    if error is not None and group_info is None:
        raise error
    group, rank, W = group_info
    if W == 1 or group is None:
        if error is not None:
            raise error
        return (int(q.shape[1]) if isinstance(q, torch.Tensor) and q.dim() > 1 else 0,)
    import torch.distributed as dist

    ok = error is None
    arg = 0
    if not ok:
        first = str(error).split(" ", 1)[0].rstrip(":,")
        arg = _ARGS.index(first) if first in _ARGS else 0
    ctx = cp_context if isinstance(cp_context, CPContext) else None
    if ok:
        offsets = ctx.cu_seqlens if ctx is not None else (cu if cu is not None else "one sequence")
        fields = [_digest(offsets), _digest(ctx.shard_lens) if ctx is not None else 0, d.H, d.K, d.HV, d.V,
                  _dtype_code(q.dtype), _dtype_code(g.dtype), _dtype_code(beta.dtype),
                  -1 if initial_state is None else _digest((str(initial_state.dtype), tuple(initial_state.shape))),
                  int(bool(output_final_state)),
                  int(use_l2), _digest(None if scale is None else float(scale)), int(bool(checks_in)),
                  _group_calls(group).calls]
        local_len = d.T
    else:
        fields, local_len = [0] * len(_FIELDS), 0
    mine = torch.tensor([int(ok), arg, int(requires_grad), local_len, *fields], dtype=torch.int64)
    device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    mine = mine.to(device)
    every = torch.empty(W * mine.numel(), dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(every, mine, group=group)
    table = every.view(W, -1).cpu().tolist()
    bad = [r for r in range(W) if not table[r][0]]
    if bad:
        what = ", ".join(f"rank {r}: {_ARGS[table[r][1]]}" for r in bad)
        msg = (f"chunk_gated_delta_rule_cp: the arguments of rank(s) {bad} were rejected ({what}); every rank of the "
               "group stops here")
        if error is not None:
            error.add_note(msg)
            raise error
        raise ValueError(msg + " (see that rank's error)")
    for i, name in enumerate(("will run the backward (a grad-requiring input under grad mode)",) + _FIELDS):
        col = [table[r][2 if i == 0 else 3 + i] for r in range(W)]
        if len(set(col)) > 1:
            groups = {}
            for r, c in enumerate(col):
                groups.setdefault(c, []).append(r)
            if i == 0:
                detail = f"ranks {groups.get(1, [])} will run the backward, ranks {groups.get(0, [])} will not"
                raise ValueError(f"chunk_gated_delta_rule_cp: the ranks disagree on whether they will run the backward: "
                                 f"{detail}; the backward is a collective, so every rank must backpropagate through "
                                 "the op or none (pass inputs that require grad on every rank, or run every rank "
                                 "under torch.no_grad())")
            if name.startswith("backward_timeout"):
                raise ValueError(f"chunk_gated_delta_rule_cp: the ranks disagree on backward_timeout: ranks "
                                 f"{groups.get(0, [])} pass None (no backward check-in), ranks {groups.get(1, [])} a "
                                 "number of seconds; the check-in waits for every rank, so backward_timeout must be "
                                 "None on every rank or on none (the numbers may differ)")
            shown = "; ".join(f"ranks {rs}" + ("" if name.split(" ")[0] in ("cu_seqlens", "the", "scale", "initial_state") else
                                                f" have {c}") for c, rs in groups.items())
            raise ValueError(f"chunk_gated_delta_rule_cp: the ranks disagree on {name}: {shown} (every rank must pass "
                             "the same global cu_seqlens, shard table, head counts, head dims, dtypes and flags)")
    return tuple(int(table[r][3]) for r in range(W))


def chunk_gated_delta_rule_cp(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens=None,
    use_qk_l2norm_in_kernel: bool = False,
    *,
    cp_context: CPContext | None = None,
    group=None,
    backend=None,
    backward_timeout: float | None = 120.0,
):
    """Gated DeltaNet chunked prefill with the tokens of one packed batch sharded across the ranks of a
    torch.distributed process group (context parallelism), forward and backward (autograd).

    Computes exactly what `flashqla.chunk_gated_delta_rule` computes on the whole batch (per sequence
    and value head: S_t = exp(g_t) (I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T,
    o_t = scale S_t^T q_t), each rank holding a contiguous token shard; sequences may cross ranks.
    Algorithm and exchanged volume: this module's docstring (derivations CP-1, CP-2, CP-3, BWD-dSin). Every
    rank of the group must call it with the same global cu_seqlens and shapes, and must
    backpropagate through it (its backward runs a collective).

    Agreement (on more than one rank): before its first collective a call all-gathers one small
    int64 fingerprint per rank (whether its argument checks passed and which argument failed,
    whether it will run the backward, its shard length, digests of the global cu_seqlens, the
    shard table, initial_state's dtype and shape and the scale, H, K, HV, V, the dtypes, the flags,
    whether backward_timeout is None, and the group's count of calls that ran a backward, which
    numbers the backward check-ins). A rank whose checks failed raises its own error, with a
    note naming the ranks; every other rank raises ValueError naming the ranks and the argument;
    ranks that disagree all raise ValueError naming the field and which ranks have which value. So
    no rank computes on mismatched plans and none waits for the group's timeout. "Will run the
    backward" is grad mode with an input that requires grad: ranks that differ there fail at the
    forward. Without cp_context the fingerprint carries the shard lengths (no separate gather of
    them). Cost per call: that all-gather and a host synchronisation (the fingerprints are compared
    on the host).

    Backward check-in (on more than one rank, backward_timeout not None): a rank that takes the grad
    path and then never backpropagates through o (an exception, a loss without o) cannot be seen at
    the forward. So every call that will run the backward gets a number, the same on every rank
    (the count of such calls on the group in this process), and its backward, before its
    collective, checks in through torch.distributed's default store (on the host, whatever the
    backend, gloo or NCCL): the rank sets its key for the call, waits at most backward_timeout
    seconds for every rank's key, then reads the call's decision, which the first rank to decide
    writes once ("go" only when every rank has checked in). When a rank has not checked in in time,
    every rank that has raises RuntimeError naming the missing ranks, the call and the timeout, and
    no rank enters that backward's collective; a rank that checks in later reads the decision and
    raises too. A rank deletes its keys of a call at its next successful check-in, so the store
    holds about W + 1 keys per group. Cost per backward: a few store round trips (set, the polls of
    the wait, compare-and-set, delete of the rank's previous key; group rank 0 also deletes the
    previous decision), the wait a host-side rendezvous of the ranks (`check` every 0.1 ms for 5 ms,
    then at pauses doubling to 10 ms).
    backward_timeout=None: no check-in, and a rank that does not backpropagate leaves the others in
    the backward's collective until the group's timeout (`init_process_group(timeout=...)`), as does
    a group torch.distributed cannot name (no store, no ranks: no check-in).

    Args (FLA's layout; each rank passes ITS OWN SHARD, tokens [start, end) of the global batch):
        q, k: [1, T_r, H, K]; v: [1, T_r, HV, V]; g: [1, T_r, HV] natural-log decay (<= 0);
            beta: [1, T_r, HV]. T_r = this rank's shard length (may be 0). Dtypes as the backend
            needs: the kernels take bf16/fp16 q, k, v, fp32 g, fp32 or q's dtype beta, K = V = 128.
        scale: default K ** -0.5.
        initial_state: None or the GLOBAL [N, HV, K, V] (the same tensor on every rank, fp32 for the
            kernels); a rank reads the rows of the sequences whose first token it holds.
        output_final_state: also return the global final states (see Returns).
        cu_seqlens: the GLOBAL offsets [0, ..., T] (int32/int64, any device; read on the host), or
            None for a single sequence. Not allowed together with cp_context (which holds them).
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first (x * rsqrt(sum x^2 + 1e-6),
            differentiable torch ops).
        cp_context: a `build_cp_context` plan (reuse it across calls and layers). Without it the op
            builds one from cu_seqlens and group with this rank's T_r, taking the ranks' shard
            lengths from the fingerprint's all-gather (see Agreement).
        group: the process group (default: the world) when cp_context is None.
        backend: per-rank compute (`flashqla.distributed.backends.resolve_backend`): None (the
            sm_90 kernels for CUDA inputs, with their own intra-device context parallelism in
            mode $FLASHQLA_CP, default "auto"), "kernels" (the same), a backend object such as
            `KernelBackend(cp="off" | "auto" | "on")`, or any op with FLA's signature and autograd
            (for instance reference.chunk_gated_delta_rule on CPU).
        backward_timeout: seconds, a number in (0, 1e9], that the backward waits at its check-in
            for the other ranks (see Backward check-in), or None: no check-in. The ranks may pass
            different numbers, but None on every rank or on none (the fingerprint checks it).

    Returns:
        (o, final_state): o [1, T_r, HV, V] in q's dtype, this rank's tokens. final_state: None
        unless output_final_state; else [N, HV, K, V] in the backend's state dtype (fp32 for the
        kernels) holding the final state of every sequence whose last token this rank holds (and of
        the empty sequences it owns, `CPContext.empty_seqs`), zeros in the other rows: the sum over
        the ranks (torch.distributed.all_reduce) is the full tensor. Gradients: dq, dk, dv, dg, dbeta
        of this rank's tokens; d initial_state nonzero on the rows this rank reads, so that the sum
        over the ranks is the full gradient (as data parallelism sums a replicated parameter's).

    Raises:
        TypeError, ValueError: (on every rank, see Agreement) `flashqla.contract.check_gdn_inputs` on the local tensors; B != 1
            (q); T_r != the context's shard length (q); initial_state not [N, HV, K, V] with the
            global N; cu_seqlens given with cp_context; cp_context and group both given; cu_seqlens
            or shard lengths invalid (`build_cp_context`); backend unknown or None on a non-CUDA
            device; the backend's own checks (dtypes, head dims); backward_timeout not None or a
            number in (0, 1e9] (TypeError for a non-number).
        RuntimeError: torch.distributed not initialized (no cp_context), a context without a process
            group on more than one rank, the kernels' device check. In the backward: a rank of the
            group not at the check-in within backward_timeout (see Backward check-in).

    Source: FLA's context parallelism (`fla.ops.cp`: per-rank transition and zero-start state,
    all-gather, merge; its `build_cp_context` / `cp_context=` API shape); algorithm here by derivation
    records CP-1..CP-3 and BWD-dSin.
    """
    requires_grad = torch.is_grad_enabled() and any(
        isinstance(t, torch.Tensor) and t.requires_grad for t in (q, k, v, g, beta, initial_state))
    error, d, be, cu, group_info = None, None, None, None, None
    try:  # every local check; a failure is published to the other ranks before it is raised
        d, be, cu = _check_local(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens,
                                 use_qk_l2norm_in_kernel, cp_context, group, backend, backward_timeout)
    except (TypeError, ValueError, RuntimeError) as exc:
        error = exc
    if isinstance(cp_context, CPContext):
        group_info = (cp_context.group, cp_context.rank, cp_context.world_size)
    elif cp_context is None:
        try:
            group_info = _process_group(group)
        except (RuntimeError, ValueError):  # no group to tell: this rank's own error first
            if error is not None:
                raise error from None
            raise
    lens = _agree(q, v, g, beta, scale, initial_state, output_final_state, use_qk_l2norm_in_kernel, cp_context, cu, d,
                  requires_grad, error, group_info, requires_grad and backward_timeout is not None)
    if cp_context is None:
        cp_context = build_cp_context(cu, group_info[0], shard_lens=lens)
    ctx = cp_context
    scale = d.K**-0.5 if scale is None else float(scale)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q), l2norm(k)
    g = clamp_gates(g)  # the one gate floor (`flashqla.contract.G_FLOOR`); autograd zeroes dg below it
    q, k, v, g, beta = (dense(x) for x in (q, k, v, g, beta))  # contiguous, 16-byte aligned
    if initial_state is not None:
        initial_state = dense(initial_state)
    checkin = _register_call(ctx, requires_grad, _check_backward_timeout(backward_timeout))
    run = _Run(ctx, be, scale, bool(output_final_state), be.state_dtype(q, g, beta, initial_state), (d.HV, d.K, d.V),
               checkin)
    o, final = _CPFunction.apply(q, k, v, g, beta, initial_state, run)
    return o, (final if output_final_state else None)

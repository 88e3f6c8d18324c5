"""Context parallelism simulated on one device: a long sequence split into segments (plain PyTorch).

The algebra (derivations CP-1 .. CP-5, research/flashqla-design.md section 4, FLA `fla/ops/cp`):

    segment_maps       each segment's affine state map S_end = P S_start + Q: Q from a zero-start run,
                       P the product of its chunk transitions gamma_C I - T_c               (CP-1)
    combine            (P2, Q2) o (P1, Q1) = (P2 P1, P2 Q1 + Q2), associative                 (CP-2)
    scan_states        the state entering every segment, from the maps and the sequence's h0
    output_correction  O(S) - O(0) = scale D R P_<c S per chunk, so segments run from zero and
                       are corrected afterwards                                               (CP-3)
    warmup_states      the truncated variant: the state entering segment j + 1 approximated by a
                       zero-start run over the last n chunks of segment j; the error is P_w S_w,
                       ||P_w S_w||_F <= exp(G_w) ||S_w||_F with G_w the window's summed log-decay
                       (CP-4, CP-5)
    cp_gated_delta_rule_fwd   the whole simulated CP forward
    entering_state_grad the gradient reaching a sequence's entering state, from forward quantities
                       only: sum_j A_j^T E_j + A_m^T dht, E_j = sum_t U_t do_t^T over segment j,
                       A_j = P_{j-1} ... P_0 (BWD-dSin)
    ReferenceCPBackend the two sm_90 forward launches (prepare, recurrent) in fp64 on the kernels'
                       slot layout, so that `flashqla.cp.forward` / `flashqla.cp.backward` (which
                       orchestrate those launches over segments) run on CPU against this file's
                       algebra

Segments are sub-sequences: `plan_segments` cuts every sequence (each batch row, or each
`cu_seqlens` span) into consecutive pieces of `segment_len` tokens (a multiple of the chunk size, so
chunk boundaries and g's chunk-local cumsum are unchanged), and every per-segment computation is a
varlen call over the flattened tokens with the segments' own `cu_seqlens`. Shapes follow FLA (q, k
[B, T, H, K]; v [B, T, HV, V]; g, beta [B, T, HV]; states [N, HV, K, V]); maps are P [M, HV, K, K]
and Q [M, HV, K, V] for M segments. g is natural log. Any float dtype; the tests run fp64.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashqla.contract import check_gdn_inputs
from .chunk import floor_gates, prepare_chunk_layout
from .fused import (
    chunk_transition,
    decay_mask,
    fused_chunk_fwd,
    from_chunks,
    gate_cumsum,
    gate_vectors,
    kkt_solve,
    to_chunks,
)
from .fused_bwd import forward_slot_products, fused_gated_delta_rule_bwd, slots_to_chunks
from .recurrent import compute_dtype, seq_bounds

__all__ = [
    "SegmentPlan",
    "plan_segments",
    "segment_maps",
    "combine",
    "apply_map",
    "scan_states",
    "output_correction",
    "window_decay",
    "warmup_states",
    "cp_gated_delta_rule_fwd",
    "entering_state_grad",
    "recurrent_from_slots",
    "ReferenceCPBackend",
]


@dataclass(frozen=True)
class SegmentPlan:
    """How the sequences are cut.

    cu_seqlens: [M + 1] int64 offsets of the M segments in the flattened B * T tokens.
    seq: [M] sequence index n of each segment; first, last: [M] bool, first / last segment of its
    sequence. N: number of sequences. B, T: the input's batch rows and tokens per row.
    """

    cu_seqlens: torch.Tensor
    seq: torch.Tensor
    first: torch.Tensor
    last: torch.Tensor
    N: int
    B: int
    T: int

    @property
    def M(self) -> int:
        return int(self.seq.numel())


def plan_segments(B: int, T: int, cu_seqlens: torch.Tensor | None, segment_len: int, chunk_size: int = 64) -> SegmentPlan:
    """Cuts each sequence into consecutive segments of `segment_len` tokens (the last one shorter).

    Raises ValueError unless segment_len is a positive multiple of chunk_size. Empty sequences get
    no segment (their final state is their initial state)."""
    if segment_len <= 0 or segment_len % chunk_size:
        raise ValueError(f"segment_len must be a positive multiple of chunk_size={chunk_size}, got {segment_len}")
    cu, seq, first, last = [0], [], [], []
    for n, (b, bos, eos) in enumerate(seq_bounds(B, T, cu_seqlens)):
        starts = list(range(bos, eos, segment_len))
        for i, s in enumerate(starts):
            cu.append(b * T + min(s + segment_len, eos))
            seq.append(n)
            first.append(i == 0)
            last.append(i == len(starts) - 1)
    N = B if cu_seqlens is None else cu_seqlens.numel() - 1
    i64 = dict(dtype=torch.int64)
    return SegmentPlan(torch.tensor(cu, **i64), torch.tensor(seq, **i64), torch.tensor(first), torch.tensor(last), N, B, T)


def _flat(x: torch.Tensor) -> torch.Tensor:
    """[B, T, ...] -> [1, B * T, ...] (segments are varlen sequences of the flattened tokens)."""
    return x.reshape(1, x.shape[0] * x.shape[1], *x.shape[2:])


def segment_maps(k, v, g, beta, cu_seqlens=None, chunk_size: int = 64):
    """The affine state map of every sequence of the batch: S_end = P S_start + Q (CP-1).

    Args:
        k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; cu_seqlens: None or [N + 1] (the
            sequences are the segments); chunk_size: C.

    Returns:
        (P [N, HV, K, K], Q [N, HV, K, V]): Q the end state of a zero-start run (`fused_chunk_fwd`),
        P = M_{last} ... M_0 with M_c = gamma_C I - T_c (`chunk_transition`); an empty sequence has
        (I, 0). Compute dtype.
    """
    B, T, HV, V = v.shape
    K = k.shape[3]
    cdt = compute_dtype(k, v, g, beta)
    lay = prepare_chunk_layout(B, T, cu_seqlens, chunk_size, k.device)
    kc, bc = to_chunks(k, lay, HV, cdt), to_chunks(beta, lay, dtype=cdt)
    G = gate_cumsum(to_chunks(g, lay, dtype=cdt))
    T_c, gamma_C = chunk_transition(kc, bc, kkt_solve(kc, bc), G)
    eye = torch.eye(K, dtype=cdt, device=k.device)
    M = gamma_C[..., None, None] * eye - T_c
    P = eye.expand(lay.N, HV, K, K).clone()
    for ids in lay.chunks_at:
        sq = lay.seq[ids]
        P = P.index_copy(0, sq, M[ids] @ P[sq])
    q0 = torch.zeros_like(k)
    g_cum = from_chunks(G, lay)
    Q = fused_chunk_fwd(q0, k, v, g_cum, beta, 1.0, None, cu_seqlens, chunk_size)["final_state"]
    return P, Q


def combine(first, second):
    """Composition of two affine state maps, `first` applied first: (P2 P1, P2 Q1 + Q2) (CP-2).

    first, second: (P [..., K, K], Q [..., K, V]) with matching batch dims. Returns (P, Q)."""
    (P1, Q1), (P2, Q2) = first, second
    return P2 @ P1, P2 @ Q1 + Q2


def apply_map(PQ, S: torch.Tensor) -> torch.Tensor:
    """P S + Q for PQ = (P [..., K, K], Q [..., K, V]) and S [..., K, V]."""
    P, Q = PQ
    return P @ S + Q


def scan_states(P, Q, plan: SegmentPlan, initial_state=None):
    """The exact state entering every segment, by a sequential scan S_{j+1} = P_j S_j + Q_j within
    each sequence (S of a sequence's first segment: its initial_state, or zeros).

    P: [M, HV, K, K]; Q: [M, HV, K, V]; plan: `plan_segments`; initial_state: None or [N, HV, K, V].
    Returns (S_start [M, HV, K, V], final_state [N, HV, K, V])."""
    M, HV, K, V = Q.shape
    h0 = initial_state.to(Q.dtype) if initial_state is not None else Q.new_zeros(plan.N, HV, K, V)
    final = h0.clone()
    starts = []
    for j in range(M):
        n = int(plan.seq[j])
        S = h0[n] if bool(plan.first[j]) else apply_map((P[j - 1], Q[j - 1]), starts[-1])
        starts.append(S)
        if bool(plan.last[j]):
            final[n] = apply_map((P[j], Q[j]), S)
    return (torch.stack(starts) if starts else Q.new_zeros(0, HV, K, V)), final


def output_correction(q, k, g, beta, S_start, scale: float, cu_seqlens=None, chunk_size: int = 64):
    """O(S) - O(0) for every sequence entered with state S_start (CP-3).

    Per chunk c of a sequence, with P_<c the product of the earlier chunks' transitions:
        O_c(S) - O_c(0) = scale D_c R_c P_<c S,   R_c = Q_c - tril_0(Q_c K_c^T) A_c diag(beta_c) K_c
    (A gate-free; no C x C decay mask).

    Args:
        q, k: [B, T, H, K]; g, beta: [B, T, HV] (ln); S_start: [N, HV, K, V]; scale: float;
        cu_seqlens: None or [N + 1]; chunk_size: C.
    Returns:
        [B, T, HV, V] in the compute dtype.
    """
    HV = g.shape[2]
    K = k.shape[3]
    cdt = compute_dtype(q, k, g, beta, S_start)
    lay = prepare_chunk_layout(q.shape[0], q.shape[1], cu_seqlens, chunk_size, q.device)
    qc, kc, bc = to_chunks(q, lay, HV, cdt), to_chunks(k, lay, HV, cdt), to_chunks(beta, lay, dtype=cdt)
    G = gate_cumsum(to_chunks(g, lay, dtype=cdt))
    A = kkt_solve(kc, bc)
    gamma, _, _ = gate_vectors(G)
    R = qc - torch.tril(qc @ kc.transpose(-1, -2)) @ (A @ (bc[..., None] * kc))
    T_c, gamma_C = chunk_transition(kc, bc, A, G)
    M = gamma_C[..., None, None] * torch.eye(K, dtype=cdt, device=q.device) - T_c
    X = S_start.to(cdt).clone()  # P_<c S, per sequence
    dO = torch.zeros(lay.NC, HV, lay.C, S_start.shape[-1], dtype=cdt, device=q.device)
    for ids in lay.chunks_at:
        sq = lay.seq[ids]
        dO = dO.index_copy(0, ids, scale * gamma[ids][..., None] * (R[ids] @ X[sq]))
        X = X.index_copy(0, sq, M[ids] @ X[sq])
    return from_chunks(dO, lay)


def window_decay(g, plan: SegmentPlan, warmup_chunks: int, chunk_size: int = 64) -> torch.Tensor:
    """G_w [M, HV]: the summed log-decay of each segment's warm-up window (its last `warmup_chunks`
    chunks, or the whole segment when shorter). g: [B, T, HV] (ln)."""
    gf = _flat(g)[0]
    out = []
    for j in range(plan.M):
        lo, hi = int(plan.cu_seqlens[j]), int(plan.cu_seqlens[j + 1])
        out.append(gf[_window_start(lo, hi, warmup_chunks, chunk_size) : hi].sum(0))
    return torch.stack(out) if out else gf.new_zeros(0, g.shape[2])


def _window_start(lo: int, hi: int, n: int, C: int) -> int:
    nchunks = -(-(hi - lo) // C)
    return lo + max(0, nchunks - n) * C


def warmup_states(k, v, g, beta, plan: SegmentPlan, warmup_chunks: int, chunk_size: int = 64):
    """The truncated estimate of every segment's end state: a zero-start run over its last
    `warmup_chunks` chunks only (the state entering that window, S_w, is dropped; CP-4).

    k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; plan: `plan_segments`.
    Returns [M, HV, K, V] in the compute dtype (exact when the window covers the whole segment)."""
    cu = [0]
    pieces = []
    for j in range(plan.M):
        lo, hi = int(plan.cu_seqlens[j]), int(plan.cu_seqlens[j + 1])
        s = _window_start(lo, hi, warmup_chunks, chunk_size)
        pieces.append((s, hi))
        cu.append(cu[-1] + hi - s)
    idx = torch.cat([torch.arange(s, e) for s, e in pieces]) if pieces else torch.zeros(0, dtype=torch.int64)
    sel = lambda x: _flat(x)[:, idx]  # noqa: E731
    cu_w = torch.tensor(cu, dtype=torch.int64)
    _, Q = segment_maps(sel(k), sel(v), sel(g), sel(beta), cu_w, chunk_size)
    return Q


def cp_gated_delta_rule_fwd(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    segment_len: int = 256, warmup_chunks: int | None = None, fallback_threshold: float | None = None,
    chunk_size: int = 64, return_info: bool = False,
):
    """The context-parallel forward simulated on one device; equals the unsplit forward (exactly
    without truncation, within CP-4/CP-5's bounds with it).

    1. `plan_segments`: cut every sequence into segments of `segment_len` tokens.
    2. In parallel over segments: a zero-start run (outputs O(0)) and the map (P, Q) (`segment_maps`).
    3. Entering states: exact, `scan_states`; or, with `warmup_chunks`, the truncated estimate
       `warmup_states` of the previous segment's end (no dependence across segments). With
       `fallback_threshold` (FlashQLA uses -10), a (segment, head) whose window decay G_w is not below
       the threshold takes the exact state instead.
    4. Outputs O(0) + `output_correction`; final state P S + Q of the last segment.

    Args:
        q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens: FLA's (g natural log).
        segment_len: tokens per segment, a multiple of chunk_size.
        warmup_chunks: None (exact) or the warm-up window in chunks.
        fallback_threshold: None or a log-decay threshold (see 3).
        chunk_size: C. return_info: also return a dict (plan, S_start used, S_start exact, G_w).

    Returns:
        (o [B, T, HV, V], final_state [N, HV, K, V] or None[, info]) in the compute dtype.

    Raises:
        TypeError, ValueError: `check_gdn_inputs`; ValueError for a bad segment_len.
    """
    d = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, check_values=True)
    scale = d.K**-0.5 if scale is None else float(scale)
    g = floor_gates(g)  # every stage below cumsums g chunk-locally (see reference.gdn.chunk.G_FLOOR)
    plan = plan_segments(d.B, d.T, cu_seqlens, segment_len, chunk_size)
    qf, kf, vf, gf, bf = (_flat(x) for x in (q, k, v, g, beta))
    cdt = compute_dtype(q, k, v, g, beta, initial_state)
    lay = prepare_chunk_layout(1, d.B * d.T, plan.cu_seqlens, chunk_size, q.device)
    gf_cum = from_chunks(gate_cumsum(to_chunks(gf, lay, dtype=cdt)), lay)
    o0 = fused_chunk_fwd(qf, kf, vf, gf_cum, bf, scale, None, plan.cu_seqlens, chunk_size)["o"]
    P, Q = segment_maps(kf, vf, gf, bf, plan.cu_seqlens, chunk_size)
    S_exact, final = scan_states(P, Q, plan, initial_state)
    S_start, G_w = S_exact, None
    if warmup_chunks is not None:
        S_start = S_exact.clone()
        W = warmup_states(kf, vf, gf, bf, plan, warmup_chunks, chunk_size)
        G_w = window_decay(g, plan, warmup_chunks, chunk_size)
        for j in range(1, plan.M):
            if bool(plan.first[j]):
                continue
            use = torch.ones(d.HV, dtype=torch.bool)
            if fallback_threshold is not None:
                use = G_w[j - 1] < fallback_threshold
            S_start[j] = torch.where(use[:, None, None], W[j - 1], S_exact[j])
        for j in range(plan.M):
            if bool(plan.last[j]):
                final[int(plan.seq[j])] = apply_map((P[j], Q[j]), S_start[j])
    o = o0 + output_correction(qf, kf, gf, bf, S_start, scale, plan.cu_seqlens, chunk_size)
    o = o.reshape(d.B, d.T, d.HV, d.V)
    out = (o, final if output_final_state else None)
    if return_info:
        return (*out, dict(plan=plan, S_start=S_start, S_start_exact=S_exact, G_w=G_w, P=P, Q=Q))
    return out


def entering_state_grad(q, k, g, beta, do, dht=None, scale=None, cu_seqlens=None, segment_len: int = 64,
                        chunk_size: int = 64):
    """The gradient of <do, o> + <dht, final_state> with respect to each sequence's initial state,
    from forward quantities only (no backward pass; BWD-dSin).

    Every sequence is cut into segments of `segment_len` tokens (`plan_segments`). Per segment j:
    its transition P_j (`segment_maps`), the rows U_t = scale Phi_t^T q_t of the run from S = I with
    v = 0 (`output_correction` of the identity: O(I) - O(0) = U), and E_j = sum_t U_t do_t^T. With
    the composed maps A_0 = I, A_{j+1} = P_j A_j (segment j is entered with A_j S_in + B_j), the
    outputs of segment j are o0_t + (A_j S_in + B_j)^T U_t and the final state is A_m S_in + B_m, so

        d/dS_in = sum_j A_j^T E_j + A_m^T dht      (m segments; an empty sequence gives dht)

    Args:
        q, k: [B, T, H, K]; g, beta: [B, T, HV] (ln); do: [B, T, HV, V]; dht: None or [N, HV, K, V];
        scale: default K ** -0.5; cu_seqlens: None or [N + 1]; segment_len: a multiple of chunk_size.
    Returns:
        [N, HV, K, V] in the compute dtype.
    """
    B, T, HV, V = do.shape
    K = k.shape[3]
    scale = K**-0.5 if scale is None else float(scale)
    g = floor_gates(g)
    cdt = compute_dtype(q, k, g, beta, do)
    plan = plan_segments(B, T, cu_seqlens, segment_len, chunk_size)
    qf, kf, gf, bf, dof = (_flat(x) for x in (q, k, g, beta, do))
    vz = torch.zeros(1, B * T, HV, 1, dtype=cdt, device=q.device)
    P, _ = segment_maps(kf, vz, gf, bf, plan.cu_seqlens, chunk_size)
    eye = torch.eye(K, dtype=cdt, device=q.device).expand(plan.M, HV, K, K)
    U = output_correction(qf, kf, gf, bf, eye, scale, plan.cu_seqlens, chunk_size)[0]  # [B * T, HV, K]
    zero = torch.zeros(plan.N, HV, K, V, dtype=cdt, device=q.device)
    dht = zero if dht is None else dht.to(cdt)
    out = dht.clone()  # an empty sequence (no segment): its final state is its initial state
    eye = torch.eye(K, dtype=cdt, device=q.device).expand(HV, K, K)
    A = eye
    for j in range(plan.M):
        n = int(plan.seq[j])
        lo, hi = int(plan.cu_seqlens[j]), int(plan.cu_seqlens[j + 1])
        if bool(plan.first[j]):
            A, out[n] = eye, 0.0
        E = torch.einsum("thk,thv->hkv", U[lo:hi].to(cdt), dof[0, lo:hi].to(cdt))
        out[n] += A.transpose(-1, -2) @ E
        A = P[j] @ A  # A_{j+1}
        if bool(plan.last[j]):
            out[n] += A.transpose(-1, -2) @ dht[n]
    return out


# ----------------------------------------------------------------------------------------------
# The sm_90 forward's two launches on the kernels' slot layout (a backend for flashqla.cp)
# ----------------------------------------------------------------------------------------------


def recurrent_from_slots(q, k, v, A_beta, g_cum_log2, scale: float, initial_state=None, cu_seqlens=None,
                         chunk_size: int = 64, positions=None):
    """What the sm_90 recurrent kernel computes, from the prepare kernel's slot-major products.

    Per chunk (RW-2, CF-1..CF-3, RW-4; `flashqla/ops/gdn/kernels/sm90/recurrent.py`):
        v_new = A_beta (V - diag(gamma) K S),   o = scale (diag(gamma) Q S + (Q K^T * Gamma) v_new),
        S'    = gamma_C S + K^T diag(r) v_new,  gamma = exp2(g_cum_log2), r = exp2(g_last - g_cum_log2).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V'] (any value width V'); A_beta: [HV, S * C, C] and
        g_cum_log2: [HV, S * C] in the slot layout of `cu_seqlens` (`reference.gdn.fused_bwd.
        forward_slot_products`); scale: float; initial_state: None or [N, HV, K, V'];
        cu_seqlens: None or [N + 1] offsets (read on the host); chunk_size: C.
        positions: None or ints (a list or tensor, read on the host): global offsets b * T + t, each
            inside a sequence; the state after token p - 1 of its sequence is then also returned, cut
            from its chunk's update after r = p - (the chunk's first token) tokens (record CF-4):
            S_p = gamma_{r-1} S + K_{<r}^T diag(exp2(g_{r-1} - g_i)) v_new_{<r}.
    Returns:
        (o [B, T, HV, V'], final_state [N, HV, K, V']) in the compute dtype, and with positions the
        checkpoint states [M, HV, K, V'].
    """
    HV, Vw, K = v.shape[2], v.shape[3], k.shape[3]
    cdt = compute_dtype(q, k, v, A_beta, g_cum_log2, initial_state)
    lay = prepare_chunk_layout(q.shape[0], q.shape[1], cu_seqlens, chunk_size, q.device)
    S = torch.zeros(lay.N, HV, K, Vw, dtype=cdt, device=q.device)
    if initial_state is not None:
        S = initial_state.to(cdt).clone()
    pos = None if positions is None else [int(p) for p in (positions.tolist() if torch.is_tensor(positions) else positions)]
    ck = None if pos is None else torch.zeros(len(pos), HV, K, Vw, dtype=cdt, device=q.device)
    if lay.NC == 0:
        o0 = torch.zeros(v.shape, dtype=cdt, device=q.device)
        return (o0, S) if pos is None else (o0, S, ck)
    starts = lay.index[:, 0].tolist()  # first global token of each chunk
    at = {}  # chunk -> [(m, r)]
    for m, p in enumerate(pos or ()):
        c = next((c for c, (s0, ln) in enumerate(zip(starts, lay.length.tolist())) if s0 < p <= s0 + ln), None)
        if c is None:
            raise ValueError(f"checkpoint position {p} is inside no sequence")
        at.setdefault(c, []).append((m, p - starts[c]))
    Ab = slots_to_chunks(A_beta, lay, cu_seqlens).to(cdt)
    G2 = slots_to_chunks(g_cum_log2, lay, cu_seqlens).to(cdt)
    qc, kc, vc = to_chunks(q, lay, HV, cdt), to_chunks(k, lay, HV, cdt), to_chunks(v, lay, dtype=cdt)
    gamma, gamma_C, r = gate_vectors(G2, log2=True)
    Pg = scale * (qc @ kc.transpose(-1, -2)) * decay_mask(G2, log2=True)
    o = torch.zeros(lay.NC, HV, lay.C, Vw, dtype=cdt, device=q.device)
    for ids in lay.chunks_at:
        sq = lay.seq[ids]
        S0 = S[sq]
        vn = Ab[ids] @ (vc[ids] - gamma[ids][..., None] * (kc[ids] @ S0))
        o = o.index_copy(0, ids, scale * gamma[ids][..., None] * (qc[ids] @ S0) + Pg[ids] @ vn)
        for i, c in enumerate(ids.tolist()):
            for m, rr in at.get(c, ()):
                g_last = G2[c, :, rr - 1]  # [HV]
                w = torch.exp2(g_last[:, None] - G2[c, :, :rr])  # [HV, rr]
                ck[m] = (torch.exp2(g_last)[:, None, None] * S0[i]
                         + kc[c, :, :rr].transpose(-1, -2) @ (w[..., None] * vn[i, :, :rr]))
        S = S.index_copy(0, sq, gamma_C[ids][..., None, None] * S0 + kc[ids].transpose(-1, -2) @ (r[ids][..., None] * vn))
    return (from_chunks(o, lay), S) if pos is None else (from_chunks(o, lay), S, ck)


class ReferenceCPBackend:
    """The sm_90 forward's launches in plain PyTorch (any device, fp64 when the inputs are fp64), with
    the interface `flashqla.cp` orchestrates (see `flashqla.ops.gdn.backend.Backend`).

    prepare(k, g, beta, cu_seqlens, HV) -> (A_beta [HV, S * 64, 64], g_cum_log2 [HV, S * 64]) in the
        slot layout of cu_seqlens (`forward_slot_products`, gates floored as the op does).
    recurrent(q, k, v, A, g_cum_log2, scale, initial_state, output_final_state, cu_seqlens, block_v, o=None)
        -> (o, final_state or None) (`recurrent_from_slots`; written into `o` when given).
    bwd(q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens)
        -> (dq, dk, dv, dg, dbeta, dh0 or None) (`reference.gdn.fused_bwd.fused_gated_delta_rule_bwd`).
    Counts its launches in `launches` (a list of (kind, number of sequences)) for tests.
    """

    name = "reference"

    def __init__(self, state_dtype: torch.dtype = torch.float64):
        self.state_dtype = state_dtype
        self.launches: list = []

    def prepare(self, k, g, beta, cu_seqlens, HV: int):
        self.launches.append(("prepare", k.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1))
        return forward_slot_products(k, g, beta, HV, cu_seqlens)

    def recurrent(self, q, k, v, A, g_cum_log2, scale, initial_state, output_final_state, cu_seqlens, block_v=None,
                  o=None):
        self.launches.append(("recurrent", q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1))
        out, S = recurrent_from_slots(q, k, v, A, g_cum_log2, scale, initial_state, cu_seqlens)
        out = out.to(v.dtype) if o is None else o.copy_(out)
        return out, (S.to(self.state_dtype) if output_final_state else None)

    def bwd(self, q, k, v, g, beta, A, g_cum_log2, do, dht, scale, initial_state, cu_seqlens, order=None, dh0=None):
        del order, dh0  # the kernels' launch order and build choice; here sequences are independent, fp64
        self.launches.append(("bwd", q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1))
        return fused_gated_delta_rule_bwd(q, k, v, beta, A, g_cum_log2, scale, initial_state, do, dht, cu_seqlens, g=g)

    def recurrent_dual_checkpoints(self, q, k, v, A, g_cum_log2, scale, initial_state, limit, cu_seqlens, positions,
                                   block_v=None, o=None):
        """What `Sm90Backend.recurrent_dual_checkpoints` computes, in the compute dtype: the run (from
        initial_state) and the transitions (from I where limit > 0, else 0, with v = 0, walked
        limit[n, hv] chunks) over the pseudo sequences of cu_seqlens, with each one's states at
        `positions`: (o, Q, U, P, CQ, CP). Past a transition's limit U's rows, P and CP are 0."""
        self.launches.append(("recurrent_dual_checkpoints", q.shape[0] if cu_seqlens is None else cu_seqlens.numel() - 1))
        B, T, H, K = q.shape
        HV = v.shape[2]
        out, Q, CQ = recurrent_from_slots(q, k, v, A, g_cum_log2, scale, initial_state, cu_seqlens, positions=positions)
        sd = self.state_dtype
        N = Q.shape[0]
        eye = torch.eye(K, dtype=sd, device=q.device)
        lim = limit.to(torch.int64)
        h0_tr = torch.where((lim > 0)[:, :, None, None], eye, torch.zeros((), dtype=sd, device=q.device))
        U, P, CP = recurrent_from_slots(q, k, torch.zeros(B, T, HV, K, dtype=v.dtype, device=q.device), A, g_cum_log2,
                                        scale, h0_tr, cu_seqlens, positions=positions)
        bounds = seq_bounds(B, T, cu_seqlens)
        nchunks = torch.tensor([-(-(e - s) // 64) for _, s, e in bounds], dtype=torch.int64, device=q.device)
        P = torch.where((lim < nchunks[:, None])[:, :, None, None], torch.zeros((), dtype=P.dtype, device=q.device), P)
        # token rows and checkpoints past each limit: 0 (the kernel does not walk there)
        keep_t = torch.zeros(B * T, HV, dtype=torch.bool, device=q.device)
        for n, (b, s, e) in enumerate(bounds):
            for hv in range(HV):
                keep_t[b * T + s:b * T + min(e, s + 64 * int(lim[n, hv])), hv] = True
        U = torch.where(keep_t.view(B, T, HV, 1), U, torch.zeros((), dtype=U.dtype, device=q.device))
        pos = [int(p) for p in (positions.tolist() if torch.is_tensor(positions) else positions)]
        for m, p in enumerate(pos):
            CP[m] = torch.where(keep_t[p - 1][:, None, None], CP[m], torch.zeros((), dtype=CP.dtype, device=q.device))
        out = out.to(v.dtype) if o is None else o.copy_(out)
        return out, Q.to(sd), U.to(q.dtype), P.to(sd), CQ.to(sd), CP.to(sd)

    def zeros(self, shape, dtype, device):
        return torch.zeros(shape, dtype=dtype, device=device)

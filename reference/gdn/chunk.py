"""FLA's chunked Gated DeltaNet prefill, forward, one function per FLA step (plain PyTorch).

Pipeline (FLA `chunk_gated_delta_rule_fwd`), per sequence and value head, chunks of C tokens:

    g_cum = chunk_local_cumsum(g)                   G_r = g_{nC} + ... + g_{nC+r}       (natural log)
    L     = chunk_scaled_dot_kkt(k, beta, g_cum)    L_rs = beta_r (k_r . k_s) exp(G_r - G_s), r > s
    A     = solve_tril(L)                           A = (I + L)^-1
    w, u  = recompute_w_u(k, v, beta, A, g_cum)     w = A diag(beta exp(G)) K,  u = A diag(beta) V
    h, v_new, final_state = chunk_fwd_h(k, w, u, g_cum, initial_state)
                                                    h[n] = S at the start of chunk n; v_new = u - w S
                                                    S' = exp(G_l) S + K^T diag(exp(G_l - G)) v_new
    o     = chunk_fwd_o(q, k, v_new, h, g_cum, scale)
                                                    o = scale (diag(exp(G)) Q S + ((Q K^T) * Gamma) v_new)

with Gamma_rs = exp(G_r - G_s) for r >= s (0 above the diagonal) and l the last valid position of the
chunk. Every exponent is masked *before* `exp` (only differences that are <= 0 for g <= 0 are ever
exponentiated), so per-token gates down to -300 and beyond stay finite. Per-token gates below
`G_FLOOR` are raised to it before the cumsum (`floor_gates`): their decay exp(g) is exactly 0 either
way, and the cumsum stays finite and keeps the gates after them.

Layout and units follow FLA (research/fla-gdn.md sections 2 and 5), except that the cumulative gate
is kept in natural log (`g_cum`) instead of FLA's base-2 `g * RCP_LN2`. All arithmetic runs in fp64
when any input is fp64 and in fp32 otherwise; intermediates are returned in that dtype (no rounding
to 16-bit, unlike FLA's kernels).

Implementation: a per-chunk index (sequence, start, length) is built on the host from `cu_seqlens`;
tokens are gathered into zero-padded [NC, HV, C, ...] tensors (NC = total number of chunks) with a
validity mask, every chunk is computed at once by batched matmuls, and results are scattered back.
Only `chunk_fwd_h` (and the backward state pass) loops, over the chunk position inside a sequence,
advancing all sequences together.

Source: FLA `fla/ops/gated_delta_rule/chunk.py` (`chunk_gated_delta_rule_fwd`), `fla/ops/utils/cumsum.py`,
`fla/ops/common/chunk_scaled_dot_kkt.py`, `fla/ops/utils/solve_tril.py`, `fla/ops/gated_delta_rule/wy_fast.py`,
`fla/ops/common/chunk_delta_h.py`, `fla/ops/common/chunk_o.py`.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashqla.contract import G_FLOOR as CONTRACT_G_FLOOR
from flashqla.contract import check_gdn_inputs
from .recurrent import compute_dtype, seq_bounds

__all__ = [
    "G_FLOOR",
    "floor_gates",
    "ChunkLayout",
    "prepare_chunk_layout",
    "layout_like",
    "chunk_local_cumsum",
    "chunk_scaled_dot_kkt",
    "solve_tril",
    "unit_lower_inverse",
    "recompute_w_u",
    "chunk_fwd_h",
    "chunk_fwd_o",
    "chunk_gated_delta_rule_fwd",
    "chunk_checkpoint_states",
]


#: Per-token log-decay floor applied before any chunk-local cumsum: the op's (`flashqla.contract.G_FLOOR`,
#: where the reason is derived). exp(G_FLOOR) == 0 exactly in fp64 and fp32, so a token's decay is
#: the same with or without it. Without it a finite g absorbs the gates after it in its chunk
#: (g = -1e30: g_cum_r - g_cum_s == 0, decay 1 instead of exp(sum g)) or overflows the cumsum (two
#: fp32 tokens of -3e38: -inf, then NaN). g = -inf is floored too: "forget everything".
G_FLOOR = CONTRACT_G_FLOOR


def floor_gates(g: torch.Tensor) -> torch.Tensor:
    """`max(g, G_FLOOR)` per token: the gate that enters the chunk-local cumsum (see `G_FLOOR`).

    Under autograd its gradient is 0 below the floor, as the recurrence's (d exp(g) / dg = exp(g) == 0
    there). Returns a tensor of g's shape and dtype (g itself when no entry is below the floor).
    """
    return g.clamp(min=G_FLOOR) if bool((g < G_FLOOR).any()) else g


# ----------------------------------------------------------------------------------------------
# Chunk index, gather / scatter, gate factors
# ----------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class ChunkLayout:
    """Where every chunk lives (built on the host by `prepare_chunk_layout`).

    Chunks are numbered 0 .. NC-1 in FLA's order: by sequence, then by position in the sequence.
    Without `cu_seqlens` that is `b * NT + j` (B rows of NT = ceil(T / C) chunks); with `cu_seqlens`
    (B == 1) NT == NC, the total count over all sequences. `h` [B, NT, ...] is the [NC, ...] chunk
    tensor reshaped.

    Fields:
        B, T, C, N, NT: sizes (N sequences).
        seq: [NC] int64, the sequence n of each chunk.
        pos: [NC] int64, the chunk's index inside its sequence.
        length: [NC] int64, valid tokens in the chunk (1 .. C).
        index: [NC, C] int64, flat token index b * T + t of each slot; B * T for padding slots.
        valid: [NC, C] bool, slot holds a real token.
        chunks_at: one [n_j] int64 tensor per position j: the chunks with pos == j.
    """

    B: int
    T: int
    C: int
    N: int
    NT: int
    seq: torch.Tensor
    pos: torch.Tensor
    length: torch.Tensor
    index: torch.Tensor
    valid: torch.Tensor
    chunks_at: tuple

    @property
    def NC(self) -> int:
        return int(self.seq.numel())

    @property
    def dense(self) -> bool:
        """No partial chunk: the chunks tile the B * T tokens in order (gather is a reshape)."""
        return self.NC * self.C == self.B * self.T

    def causal_mask(self, strict: bool) -> torch.Tensor:
        """[NC, 1, C, C] bool: r >= s (r > s when strict), both slots valid."""
        r = torch.arange(self.C, device=self.valid.device)
        tri = r[:, None] > r[None, :] if strict else r[:, None] >= r[None, :]
        return (tri & self.valid[:, :, None] & self.valid[:, None, :])[:, None]

    def last(self) -> torch.Tensor:
        """[NC] int64: position l of the last valid token of each chunk."""
        return self.length - 1


def check_chunk_size(chunk_size) -> int:
    """Returns chunk_size; raises ValueError unless it is a positive int."""
    if isinstance(chunk_size, bool) or not isinstance(chunk_size, int) or chunk_size < 1:
        raise ValueError(f"chunk_size must be a positive int, got {chunk_size!r}")
    return chunk_size


def prepare_chunk_layout(B: int, T: int, cu_seqlens: torch.Tensor | None, chunk_size: int = 64, device=None) -> ChunkLayout:
    """Per-chunk index of a batch (reads `cu_seqlens` on the host).

    Args:
        B, T: batch rows and tokens per row (B == 1 with cu_seqlens).
        cu_seqlens: None or [N + 1] int offsets; chunking restarts at every sequence start, and an
            empty sequence has no chunk.
        chunk_size: C, a positive int.
        device: where the index tensors live.

    Returns:
        ChunkLayout. Raises ValueError for a non-positive chunk_size.

    Source: FLA `prepare_chunk_indices` / `prepare_chunk_offsets` (fla/ops/utils/index.py).
    """
    C = check_chunk_size(chunk_size)
    bounds = seq_bounds(B, T, cu_seqlens)
    seq, pos, first, length = [], [], [], []
    for n, (b, bos, eos) in enumerate(bounds):
        for j, s in enumerate(range(bos, eos, C)):
            seq.append(n)
            pos.append(j)
            first.append(b * T + s)
            length.append(min(C, eos - s))
    NC = len(seq)
    NT = NC if cu_seqlens is not None else -(-T // C)
    i64 = dict(dtype=torch.int64, device=device)
    seq_t, pos_t = torch.tensor(seq, **i64), torch.tensor(pos, **i64)
    length_t, first_t = torch.tensor(length, **i64), torch.tensor(first, **i64)
    slot = torch.arange(C, **i64)
    valid = slot[None, :] < length_t[:, None]
    index = torch.where(valid, first_t[:, None] + slot[None, :], torch.full_like(valid, B * T, dtype=torch.int64))
    max_pos = max(pos) + 1 if pos else 0
    # from the host lists in one pass (no nonzero: its data-dependent shape fails under torch.compile's inductor)
    at = [[] for _ in range(max_pos)]
    for i, p in enumerate(pos):
        at[p].append(i)
    chunks_at = tuple(torch.tensor(ix, **i64) for ix in at)
    return ChunkLayout(B, T, C, len(bounds), NT, seq_t, pos_t, length_t, index.reshape(NC, C), valid.reshape(NC, C), chunks_at)


def layout_like(x: torch.Tensor, cu_seqlens, chunk_size) -> ChunkLayout:
    """`prepare_chunk_layout` for a [B, T, ...] tensor x, on x's device."""
    return prepare_chunk_layout(x.shape[0], x.shape[1], cu_seqlens, chunk_size, x.device)


def gather_chunks(x: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    """[B, T, *rest] -> [NC, C, *rest], padding slots zero (a view when no chunk is partial)."""
    flat = x.reshape(lay.B * lay.T, *x.shape[2:])
    if lay.dense:
        return flat.view(lay.NC, lay.C, *x.shape[2:])
    flat = torch.cat([flat, flat.new_zeros((1, *flat.shape[1:]))])
    return flat[lay.index]


def scatter_chunks(y: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    """[NC, C, *rest] -> [B, T, *rest] (inverse of `gather_chunks` on valid slots)."""
    if lay.dense:
        return y.reshape(lay.B, lay.T, *y.shape[2:])
    out = y.new_zeros((lay.B * lay.T, *y.shape[2:]))
    out[lay.index[lay.valid]] = y[lay.valid]
    return out.view(lay.B, lay.T, *y.shape[2:])


def heads_first(x: torch.Tensor, lay: ChunkLayout, dtype: torch.dtype, HV: int | None = None) -> torch.Tensor:
    """Gathers [B, T, Hx, D] into [NC, HV, C, D] in `dtype`, repeating each of Hx heads HV // Hx times
    (GVA: value head hv reads head hv // (HV // Hx))."""
    xc = gather_chunks(x.to(dtype), lay)
    if HV is not None and HV != x.shape[2]:
        xc = xc.repeat_interleave(HV // x.shape[2], dim=2)
    return xc.transpose(1, 2)


def gate_first(x: torch.Tensor, lay: ChunkLayout, dtype: torch.dtype) -> torch.Tensor:
    """Gathers a per-token, per-head [B, T, HV] tensor into [NC, HV, C] in `dtype`."""
    return gather_chunks(x.to(dtype), lay).transpose(1, 2)


def scatter_heads(y: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    """[NC, HV, C, *rest] -> [B, T, HV, *rest]."""
    return scatter_chunks(y.transpose(1, 2), lay)


def sum_groups(x: torch.Tensor, H: int) -> torch.Tensor:
    """[B, T, HV, D] -> [B, T, H, D], summing each group of HV // H value heads (GVA backward)."""
    B, T, HV, D = x.shape
    return x.view(B, T, H, HV // H, D).sum(3)


def masked_exp(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """exp(x) where mask, exactly 0 elsewhere; the exponent is masked before exp (never inf * 0)."""
    return torch.where(mask, x, torch.full_like(x, float("-inf"))).exp()


def decay_matrix(G: torch.Tensor, lay: ChunkLayout, strict: bool) -> torch.Tensor:
    """Gamma [NC, HV, C, C]: exp(G_r - G_s) for r >= s (r > s when strict) on valid slots, else 0."""
    return masked_exp(G[..., :, None] - G[..., None, :], lay.causal_mask(strict))


def gate_factors(G: torch.Tensor, lay: ChunkLayout):
    """From G [NC, HV, C]: gamma = exp(G) [NC, HV, C], gamma_last = exp(G_l) [NC, HV] and
    E = exp(G_l - G) [NC, HV, C] (0 on padding slots), l the last valid position."""
    valid = lay.valid[:, None, :]
    G_last = G.gather(-1, lay.last()[:, None, None].expand(-1, G.shape[1], 1))  # [NC, HV, 1]
    gamma = masked_exp(G, valid)
    E = masked_exp(G_last - G, valid)
    return gamma, G_last.squeeze(-1).exp(), E


# ----------------------------------------------------------------------------------------------
# FLA's forward steps
# ----------------------------------------------------------------------------------------------


def chunk_local_cumsum(
    g: torch.Tensor, chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None, reverse: bool = False
) -> torch.Tensor:
    """Chunk-local cumulative sum of a per-token quantity (FLA step F1; B6 with reverse=True).

    Forward: g_cum[t] = sum of g[s] for s <= t in t's chunk (restarting at every chunk of every
    sequence). reverse=True: the suffix sum, sum of g[s] for s >= t in t's chunk (FLA's reverse
    cumsum that turns dL/dg_cum into dL/dg).

    Args:
        g: [B, T, HV] (or [B, T, ...]), natural-log decay per token (or a gradient for reverse).
        chunk_size: C.
        cu_seqlens: None or [N + 1] offsets of packed sequences (B == 1).
        reverse: suffix sum instead of prefix sum.

    Returns:
        g_cum with g's shape, natural log (not FLA's base 2), fp64 if g is fp64 else fp32.

    Raises:
        ValueError: chunk_size not a positive int.

    Source: FLA `chunk_local_cumsum` (fla/ops/utils/cumsum.py), without its `scale=RCP_LN2`.
    """
    lay = layout_like(g, cu_seqlens, chunk_size)
    x = gather_chunks(g.to(compute_dtype(g)), lay)
    y = x.flip(1).cumsum(1).flip(1) if reverse else x.cumsum(1)
    return scatter_chunks(y, lay)


def chunk_scaled_dot_kkt(
    k: torch.Tensor, beta: torch.Tensor, g_cum: torch.Tensor, chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None
) -> torch.Tensor:
    """The strictly lower gated, beta-scaled key Gram matrix of every chunk (FLA step F2, first half).

    L_rs = beta_r (k_r . k_s) exp(g_cum_r - g_cum_s) for r > s inside a chunk, 0 otherwise.

    Args:
        k: [B, T, H, K]. beta: [B, T, HV] (HV % H == 0; value head hv reads k head hv // (HV // H)).
        g_cum: [B, T, HV], natural-log chunk-local cumsum of g (`chunk_local_cumsum`).
        chunk_size, cu_seqlens: as `chunk_local_cumsum`.

    Returns:
        L: [B, T, HV, C]; row t holds row (t - chunk start) of its chunk's C x C matrix (columns past
        a partial chunk's end are 0). Compute dtype (fp64 if any input is fp64, else fp32).

    Raises:
        ValueError: chunk_size not a positive int. Shapes are not checked here (a stage, fed by
            the validated entry points).

    Source: FLA `chunk_scaled_dot_kkt_fwd` (fla/ops/common/chunk_scaled_dot_kkt.py).
    """
    HV = beta.shape[2]
    cdt = compute_dtype(k, beta, g_cum)
    lay = layout_like(k, cu_seqlens, chunk_size)
    kc = heads_first(k, lay, cdt, HV)
    bc, G = gate_first(beta, lay, cdt), gate_first(g_cum, lay, cdt)
    L = bc[..., None] * (kc @ kc.transpose(-1, -2)) * decay_matrix(G, lay, strict=True)
    return scatter_heads(L, lay)


def solve_tril(L: torch.Tensor, chunk_size: int = 64, cu_seqlens: torch.Tensor | None = None) -> torch.Tensor:
    """A = (I + L)^-1 per chunk (FLA step F2, second half).

    Args:
        L: [B, T, HV, C], strictly lower per chunk (`chunk_scaled_dot_kkt`); entries on or above the
            diagonal and columns past a partial chunk's end are ignored.
        chunk_size, cu_seqlens: as `chunk_local_cumsum`.

    Returns:
        A: [B, T, HV, C], unit lower triangular per chunk (a partial chunk uses only its valid rows and
        columns; the rest of its columns are 0). fp64 for fp64 L, else fp32.

    Raises:
        ValueError: chunk_size not a positive int. Shapes are not checked here (a stage, fed by
            the validated entry points).

    Source: FLA `solve_tril` (fla/ops/utils/solve_tril.py): 16 x 16 diagonal blocks by forward
    substitution, then block rows (`unit_lower_inverse`).
    """
    cdt = compute_dtype(L)
    lay = layout_like(L, cu_seqlens, chunk_size)
    Lc = gather_chunks(L.to(cdt), lay).transpose(1, 2)  # [NC, HV, C, C]
    Lc = torch.where(lay.causal_mask(strict=True), Lc, torch.zeros((), dtype=cdt, device=L.device))
    return scatter_heads(unit_lower_inverse(Lc), lay)


def unit_lower_inverse(L: torch.Tensor, block: int = 16) -> torch.Tensor:
    """(I + L)^-1 for a batch of strictly lower triangular [..., C, C] matrices L.

    Blocked forward substitution, as FLA's `solve_tril`: each `block` x `block` diagonal block is
    inverted row by row (X_i = e_i - sum_{m<i} L_im X_m), then the block rows below are filled by
    A_i,: = -A_ii sum_{j<i} L_ij A_j,:. Exact up to rounding (no series truncation). A batched
    `torch.linalg.solve_triangular` gives the same result but is several times slower on CPU for
    thousands of 64 x 64 systems.
    """
    C = L.shape[-1]
    bs = block if C % block == 0 else C
    nb = C // bs
    batch = L.shape[:-2]
    # diagonal blocks, [..., nb, bs, bs]
    D = L.reshape(*batch, nb, bs, nb, bs).diagonal(dim1=-4, dim2=-2).movedim(-1, -3)
    X = torch.zeros_like(D)
    X[..., 0, 0] = 1
    for i in range(1, bs):
        X[..., i, :i] = -(D[..., i : i + 1, :i] @ X[..., :i, :i]).squeeze(-2)
        X[..., i, i] = 1
    A = torch.zeros_like(L)
    for i in range(nb):
        r = slice(i * bs, (i + 1) * bs)
        A[..., r, r] = X[..., i, :, :]
        if i:
            A[..., r, : i * bs] = -X[..., i, :, :] @ (L[..., r, : i * bs] @ A[..., : i * bs, : i * bs])
    return A


def recompute_w_u(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    g_cum: torch.Tensor,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
):
    """The WY factors of every chunk (FLA step F3).

    w = A diag(beta exp(g_cum)) K  (w carries the decay), u = A diag(beta) V, per chunk.

    Args:
        k: [B, T, H, K]; v: [B, T, HV, V]; beta: [B, T, HV]; A: [B, T, HV, C] (`solve_tril`);
        g_cum: [B, T, HV] natural-log chunk-local cumsum. chunk_size, cu_seqlens as above.

    Returns:
        (w [B, T, HV, K], u [B, T, HV, V]) in the compute dtype.

    Raises:
        ValueError: chunk_size not a positive int. Shapes are not checked here (a stage, fed by
            the validated entry points).

    Source: FLA `recompute_w_u_fwd` (fla/ops/gated_delta_rule/wy_fast.py).
    """
    HV = v.shape[2]
    cdt = compute_dtype(k, v, beta, A, g_cum)
    lay = layout_like(k, cu_seqlens, chunk_size)
    kc, vc = heads_first(k, lay, cdt, HV), heads_first(v, lay, cdt)
    Ac = heads_first(A, lay, cdt)  # [NC, HV, C, C]
    bc, G = gate_first(beta, lay, cdt), gate_first(g_cum, lay, cdt)
    gamma, _, _ = gate_factors(G, lay)
    w = Ac @ ((bc * gamma)[..., None] * kc)
    u = Ac @ (bc[..., None] * vc)
    return scatter_heads(w, lay), scatter_heads(u, lay)


def chunk_fwd_h(
    k: torch.Tensor,
    w: torch.Tensor,
    u: torch.Tensor,
    g_cum: torch.Tensor,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
):
    """The inter-chunk state pass (FLA step F4), sequential over chunks.

    Per chunk n with incoming state S = h[n]: v_new = u - w S (the recurrence's corrected values
    u~_t, ungated), then S <- exp(G_l) S + K^T diag(exp(G_l - G)) v_new, l the chunk's last valid
    position.

    Args:
        k: [B, T, H, K]; w: [B, T, HV, K]; u: [B, T, HV, V]; g_cum: [B, T, HV] natural-log
        chunk-local cumsum; initial_state: None (zeros) or [N, HV, K, V]; output_final_state: bool.
        chunk_size, cu_seqlens as above.

    Returns:
        h: [B, NT, HV, K, V], the state at the START of each chunk (varlen: B = 1, NT = total chunks
            of all sequences, in sequence order: FLA's layout).
        v_new: [B, T, HV, V].
        final_state: [N, HV, K, V] (an empty sequence returns its initial state), or None.
        All in the compute dtype.

    Raises:
        ValueError: chunk_size not a positive int. Shapes are not checked here (a stage, fed by
            the validated entry points).

    Source: FLA `chunk_gated_delta_rule_fwd_h` (fla/ops/common/chunk_delta_h.py).
    """
    HV, K, V = u.shape[2], k.shape[3], u.shape[3]
    cdt = compute_dtype(k, w, u, g_cum, initial_state)
    lay = layout_like(k, cu_seqlens, chunk_size)
    kc, wc, uc = heads_first(k, lay, cdt, HV), heads_first(w, lay, cdt), heads_first(u, lay, cdt)
    _, gamma_last, E = gate_factors(gate_first(g_cum, lay, cdt), lay)
    if initial_state is not None:
        S = initial_state.to(cdt).clone()
    else:
        S = torch.zeros(lay.N, HV, K, V, dtype=cdt, device=k.device)
    h = torch.empty(lay.NC, HV, K, V, dtype=cdt, device=k.device)
    v_new = torch.empty_like(uc)
    for ids in lay.chunks_at:
        sq = lay.seq[ids]
        S0 = S[sq]
        vn = uc[ids] - wc[ids] @ S0
        h[ids] = S0
        v_new[ids] = vn
        S[sq] = gamma_last[ids][..., None, None] * S0 + kc[ids].transpose(-1, -2) @ (E[ids][..., None] * vn)
    h = h.view(lay.B, lay.NT, HV, K, V)
    return h, scatter_heads(v_new, lay), (S if output_final_state else None)


def chunk_fwd_o(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    g_cum: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The output of every chunk (FLA step F5).

    o_r = scale (exp(G_r) q_r^T h[n] + sum_{s <= r} (q_r . k_s) exp(G_r - G_s) v_new_s), diagonal
    included.

    Args:
        q, k: [B, T, H, K]; v_new: [B, T, HV, V]; h: [B, NT, HV, K, V] chunk-start states
        (`chunk_fwd_h`); g_cum: [B, T, HV] natural-log chunk-local cumsum; scale: float.
        chunk_size, cu_seqlens as above.

    Returns:
        o: [B, T, HV, V] in the compute dtype.

    Raises:
        ValueError: chunk_size not a positive int. Shapes are not checked here (a stage, fed by
            the validated entry points).

    Source: FLA `chunk_fwd_o` (fla/ops/common/chunk_o.py).
    """
    HV, K, V = v_new.shape[2], q.shape[3], v_new.shape[3]
    cdt = compute_dtype(q, k, v_new, h, g_cum)
    lay = layout_like(q, cu_seqlens, chunk_size)
    qc, kc, vn = heads_first(q, lay, cdt, HV), heads_first(k, lay, cdt, HV), heads_first(v_new, lay, cdt)
    hc = h.to(cdt).reshape(lay.NC, HV, K, V)
    G = gate_first(g_cum, lay, cdt)
    gamma, _, _ = gate_factors(G, lay)
    P = (qc @ kc.transpose(-1, -2)) * decay_matrix(G, lay, strict=False)
    o = scale * (gamma[..., None] * (qc @ hc) + P @ vn)
    return scatter_heads(o, lay)


def chunk_gated_delta_rule_fwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
):
    """FLA's chunked forward, chaining the steps above.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] natural-log decay per token (<= 0);
        beta: [B, T, HV]; scale: default K ** -0.5; initial_state: None or [N, HV, K, V];
        output_final_state: bool; cu_seqlens: None or [N + 1] offsets (B == 1); chunk_size: C.
        q and k are used as given (no L2 norm here; see `reference.chunk_gated_delta_rule`).

    Returns:
        (g_cum [B, T, HV], o [B, T, HV, V], A [B, T, HV, C], final_state [N, HV, K, V] or None,
        h [B, NT, HV, K, V], v_new [B, T, HV, V]), all in the compute dtype (fp64 if any input is
        fp64, else fp32).

    Raises:
        TypeError, ValueError: `flashqla.contract.check_gdn_inputs(..., check_values=True)`
        (positive or non-finite g included); ValueError for a non-positive chunk_size.

    Gates below `G_FLOOR` are raised to it before the cumsum (`floor_gates`; g_cum is of the floored g).

    Source: FLA `chunk_gated_delta_rule_fwd` (fla/ops/gated_delta_rule/chunk.py).
    """
    d = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, check_values=True)
    check_chunk_size(chunk_size)
    scale = d.K**-0.5 if scale is None else float(scale)
    cs = dict(chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    g_cum = chunk_local_cumsum(floor_gates(g.to(compute_dtype(q, k, v, g, beta, initial_state))), **cs)
    A = solve_tril(chunk_scaled_dot_kkt(k, beta, g_cum, **cs), **cs)
    w, u = recompute_w_u(k, v, beta, A, g_cum, **cs)
    h, v_new, final_state = chunk_fwd_h(k, w, u, g_cum, initial_state, output_final_state, **cs)
    o = chunk_fwd_o(q, k, v_new, h, g_cum, scale, **cs)
    return g_cum, o, A, final_state, h, v_new


def chunk_checkpoint_states(
    k: torch.Tensor,
    v_new: torch.Tensor,
    h: torch.Tensor,
    g_cum: torch.Tensor,
    positions,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """The state after the first p tokens of the packed batch, for every p of `positions`, from the
    chunked forward's products (no second pass over the sequence).

    p lies in sequence n (bos < p <= eos) and in its chunk c = (p - 1 - bos) // C, which starts at
    s = bos + c C; with r = p - s tokens of that chunk done and G the chunk-local cumulative gate:

        S_p = exp(G_{r-1}) h[c] + sum_{i < r} exp(G_{r-1} - G_i) k_i v_new_i^T

    which is the chunk-state update `chunk_fwd_h` applies at the chunk's end (r = C), cut after r
    tokens: exact because v_new_i = u_i - w_i h[c] depends only on the tokens <= i of the chunk (A is
    lower triangular), so the first r rows of the full chunk's v_new are the r-token chunk's.

    Args:
        k: [B, T, H, K] (after any L2 norm); v_new: [B, T, HV, V]; h: [B, NT, HV, K, V] chunk-start
        states; g_cum: [B, T, HV] natural-log chunk-local cumsum (from `chunk_gated_delta_rule_fwd`);
        positions: ints (a list or a tensor, read on the host), global offsets b * T + t without
        cu_seqlens, each inside a sequence; chunk_size, cu_seqlens as there.

    Returns: [M, HV, K, V] in the compute dtype. Raises ValueError for a position inside no sequence.
    """
    B, T, H, K = k.shape
    HV, V = v_new.shape[2], v_new.shape[3]
    C = check_chunk_size(chunk_size)
    cdt = compute_dtype(k, v_new, h, g_cum)
    pos = [int(p) for p in (positions.tolist() if isinstance(positions, torch.Tensor) else positions)]
    bounds = seq_bounds(B, T, cu_seqlens)
    first_chunk, total = [], 0
    for n, (b, bos, eos) in enumerate(bounds):
        first_chunk.append(b * (-(-T // C)) if cu_seqlens is None else total)
        total += -(-(eos - bos) // C)
    hc = h.to(cdt).reshape(-1, HV, K, V)
    group = HV // H
    out = torch.empty(len(pos), HV, K, V, dtype=cdt, device=k.device)
    for m, p in enumerate(pos):
        hit = [n for n, (b, bos, eos) in enumerate(bounds) if b * T + bos < p <= b * T + eos]
        if not hit:
            raise ValueError(f"checkpoint position {p} lies inside no sequence")
        n = hit[0]
        b, bos, _ = bounds[n]
        t = p - b * T  # tokens of row b done
        c = (t - 1 - bos) // C
        s = bos + c * C
        kk = k[b, s:t].to(cdt).repeat_interleave(group, dim=1)  # [r, HV, K]
        vn = v_new[b, s:t].to(cdt)  # [r, HV, V]
        G = g_cum[b, s:t].to(cdt)  # [r, HV], G[-1] is the last done token's
        decay = (G[-1:] - G).exp()  # <= 1: differences of a non-increasing cumsum
        out[m] = G[-1].exp()[:, None, None] * hc[first_chunk[n] + c] + torch.einsum("rhk,rh,rhv->hkv", kk, decay, vn)
    return out

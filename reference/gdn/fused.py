"""Our rewritten chunked algorithm, stage by stage: what the fused kernels compute (plain PyTorch).

Each stage is the right-hand side of a derivation record (`derivations/`), so a kernel can be compared
with it stage by stage and the stage with FLA's formulation (`reference.gdn.chunk`):

    g_cum      = gate_cumsum(g)                         chunk-local cumsum, natural log
    g_cum_log2 = g_cum_to_log2(g_cum)                   the one 1 / ln 2 rescale       (RW-4)
    A          = kkt_solve(k, beta)                     gate-free (I + tril_-1(diag(beta) K K^T))^-1,
                                                        16 x 16 diagonal blocks, then merged (WY-3, WY-4)
    A_g        = regate(A, g_cum)                       Gamma * A = FLA's gated A         (RW-1)
    v_new      = chunk_v_new(k, v, beta, A_g, g_cum, h) A_g diag(beta) (V - D (K S))     (RW-2)
    S'         = chunk_state_update(h, k, v_new, g_cum) gamma_C S + K^T (diag(r) v_new)
               = (gamma_C I - T_c) S + B_c              chunk_transition, chunk_state_input (RW-3)
               = gamma_C S + X^T Y                      chunk_state_update_xy             (RW-5)
    o          = chunk_output(q, k, v_new, h, g_cum, scale)
                                                        scale D (Q S) + (scale Gamma * Q K^T) v_new
    dS         = chunk_state_grad(...)                  M_c^T dS' + scale (D R)^T dO      (RW-6)

Layout: stage functions take **chunk tensors**, heads first: [NC, HV, C, ...] with NC the total
number of chunks (FLA's order: by sequence, then by position; `to_chunks` gathers them from FLA's
[B, T, HV, ...] layout with `reference.gdn.chunk.prepare_chunk_layout`, `from_chunks` scatters back).
Matrices over a chunk are [NC, HV, C, C] (row, column); states [NC, HV, K, V] (the state entering
each chunk, FLA's `h`). q and k are expanded to the HV value heads (GVA) by `to_chunks`.

Padding (a partial last chunk): q, k, v, beta are zero and g is zero on padding slots, so g_cum
there repeats the last valid value, gamma_C = exp(g_cum[..., -1]) is the true decay of the chunk, and
every padding row of A is e_i^T and of v_new zero: padding changes no valid result (FlashQLA's
convention, research/flashqla-design.md section 1.4). `pad_g_cum` restores that convention for a
g_cum gathered from FLA's layout.

Gates and units: `g_cum` is natural log. Every stage with gates takes `log2=False`; with `log2=True`
its gate argument is `g_cum_log2` (base 2) and every exponential is `exp2` (what the kernels do).
Only differences that are <= 0 are exponentiated, masked before the exp (DESIGN.md section 1).

dtype: any float; the tests run fp64 on CPU. Everything is differentiable by autograd.

Source: FlashQLA `hopper/kkt_solve.py`, `fused_fwd.py`, `prepare_h.py`, `cp_bwd.py` as described in
research/flashqla-design.md sections 1-3; FLA `solve_tril` (blockwise inverse).
"""

from __future__ import annotations

import math

import torch

from flashqla.contract import check_gdn_inputs
from .chunk import ChunkLayout, floor_gates, gather_chunks, prepare_chunk_layout, scatter_chunks
from .recurrent import compute_dtype, seq_bounds

__all__ = [
    "LOG2_E",
    "to_chunks",
    "from_chunks",
    "pad_g_cum",
    "gate_cumsum",
    "g_cum_to_log2",
    "decay_mask",
    "decay_mask_exp2",
    "gate_vectors",
    "solve_tril_diagonal_blocks",
    "solve_tril_block_product",
    "solve_tril_blocks",
    "kkt_solve",
    "regate",
    "chunk_v_new",
    "chunk_state_update",
    "chunk_transition",
    "chunk_state_input",
    "chunk_state_update_xy",
    "chunk_output",
    "chunk_v_new_output",
    "chunk_v_new_output_row_scaled",
    "row_scales_pow2",
    "chunk_transition_rank1",
    "chunk_transition_wy",
    "chunk_state_input_rank1",
    "chunk_state_input_wy",
    "chunk_state_grad",
    "fused_chunk_fwd",
    "fused_gated_delta_rule_fwd",
    "fused_state_grad",
    "recurrent_deltas",
]

#: 1 / ln 2 = log2(e), in fp64. exp(x) == exp2(x * LOG2_E).
LOG2_E = 1.0 / math.log(2.0)


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


# ----------------------------------------------------------------------------------------------
# Layout
# ----------------------------------------------------------------------------------------------


def to_chunks(x: torch.Tensor, lay: ChunkLayout, HV: int | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """FLA layout -> chunk tensor, padding slots zero.

    x: [B, T, Hx, D] (q, k, v, w, u, ...) -> [NC, HV, C, D], head h repeated HV // Hx times (GVA);
       [B, T, HV] (g, beta, g_cum) -> [NC, HV, C]; [B, T, HV, C] (A, L) -> [NC, HV, C, C].
    lay: `reference.gdn.chunk.prepare_chunk_layout(B, T, cu_seqlens, chunk_size)`.
    dtype: cast first (default: keep).
    """
    xc = gather_chunks(x if dtype is None else x.to(dtype), lay)  # [NC, C, Hx, ...]
    if HV is not None and xc.shape[2] != HV:
        xc = xc.repeat_interleave(HV // xc.shape[2], dim=2)
    return xc.transpose(1, 2)


def from_chunks(y: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    """Chunk tensor [NC, HV, C, ...] -> FLA layout [B, T, HV, ...] (valid slots only)."""
    return scatter_chunks(y.transpose(1, 2), lay)


def pad_g_cum(g_cum: torch.Tensor, lay: ChunkLayout) -> torch.Tensor:
    """g_cum [NC, HV, C] with every padding slot set to its chunk's last valid value (the value
    `gate_cumsum` of zero-padded g gives); valid slots unchanged."""
    last = g_cum.gather(-1, (lay.length - 1)[:, None, None].expand(-1, g_cum.shape[1], 1))
    return torch.where(lay.valid[:, None, :], g_cum, last)


# ----------------------------------------------------------------------------------------------
# Gates
# ----------------------------------------------------------------------------------------------


def gate_cumsum(g: torch.Tensor) -> torch.Tensor:
    """Chunk-local inclusive cumsum: g [NC, HV, C] (ln, per token) -> g_cum [NC, HV, C] (ln).

    Source: FLA `chunk_local_cumsum` (without its RCP_LN2 scale; see `g_cum_to_log2`)."""
    return g.cumsum(-1)


def g_cum_to_log2(g_cum: torch.Tensor) -> torch.Tensor:
    """g_cum (natural log) -> g_cum_log2 = g_cum / ln 2 (base 2), so exp(x) == exp2(x / ln 2).

    The one place the base changes (RW-4). FLA folds it into the cumsum (`scale=RCP_LN2`); the kernels
    then use exp2 everywhere."""
    return g_cum * LOG2_E


def _exp(x: torch.Tensor, log2: bool) -> torch.Tensor:
    return torch.exp2(x) if log2 else torch.exp(x)


def _causal(C: int, strict: bool, device) -> torch.Tensor:
    r = torch.arange(C, device=device)
    return r[:, None] > r[None, :] if strict else r[:, None] >= r[None, :]


def decay_mask(g_cum: torch.Tensor, strict: bool = False, *, log2: bool = False) -> torch.Tensor:
    """Gamma [..., C, C]: exp(g_cum_i - g_cum_j) for i >= j (i > j when strict), 0 elsewhere.

    g_cum: [..., C] natural log (base 2 when log2=True, then exp2). The exponent is masked to -inf
    before the exp, so no inf is ever formed. Left side of RW-4."""
    diff = g_cum[..., :, None] - g_cum[..., None, :]
    mask = _causal(g_cum.shape[-1], strict, g_cum.device)
    return _exp(torch.where(mask, diff, torch.full_like(diff, -math.inf)), log2)


def decay_mask_exp2(g_cum_log2: torch.Tensor, strict: bool = False) -> torch.Tensor:
    """Gamma from the base-2 cumsum: exp2(g_cum_log2_i - g_cum_log2_j), i >= j. Right side of RW-4."""
    return decay_mask(g_cum_log2, strict, log2=True)


def gate_vectors(g_cum: torch.Tensor, *, log2: bool = False):
    """(gamma [..., C] = exp(g_cum), gamma_C [...] = exp(g_cum_last), r [..., C] = exp(g_cum_last - g_cum)).

    g_cum: [..., C] with padding slots holding the last valid value (see the module docstring), natural
    log (base 2 when log2=True). Every exponent is <= 0 for g <= 0."""
    last = g_cum[..., -1:]
    return _exp(g_cum, log2), _exp(last[..., 0], log2), _exp(last - g_cum, log2)


# ----------------------------------------------------------------------------------------------
# kkt_solve: the gate-free inverse, blockwise
# ----------------------------------------------------------------------------------------------


def solve_tril_diagonal_blocks(L: torch.Tensor, block: int = 16) -> torch.Tensor:
    """Inverses of the diagonal blocks of I + L, by FLA's row recursion (WY-3).

    L: [..., n, n], strictly lower (entries on and above the diagonal are ignored); n % block == 0.
    Per block: X = -L_ii, then row by row X_i = a + sum_{m<i} a_m X_m with a = -L_ii[i, :i], then + I.
    Returns [..., n, n], block diagonal (zero off the diagonal blocks): the diagonal blocks of
    (I + L)^-1. Raises ValueError when n % block != 0.

    Source: FLA `solve_tril_16x16_kernel` (research/fla-gdn.md section 5.3).
    """
    n = L.shape[-1]
    if n % block:
        raise ValueError(f"matrix size {n} is not a multiple of the block size {block}")
    out = torch.zeros_like(L)
    tri = _causal(block, True, L.device)
    for b in range(n // block):
        s = slice(b * block, (b + 1) * block)
        Lb = torch.where(tri, L[..., s, s], torch.zeros((), dtype=L.dtype, device=L.device))
        X = -Lb.clone()
        for i in range(1, block):
            a = -Lb[..., i, :i]  # [..., i]
            X[..., i, :] = X[..., i, :] + (a[..., :, None] * X[..., :i, :]).sum(-2)
        out[..., s, s] = X + torch.eye(block, dtype=L.dtype, device=L.device)
    return out


def solve_tril_blocks(L: torch.Tensor, block: int = 16) -> torch.Tensor:
    """(I + L)^-1 for strictly lower L [..., n, n]: diagonal-block inverses (WY-3), then FLA's merge
    Ai_ij = -Ai_ii sum_{m=j}^{i-1} L_im Ai_mj, block diagonal by block diagonal (WY-4).

    With n = 64 and block = 16 this is FLA's `merge_16x16_to_64x64_inverse` (and the fused kkt+solve
    kernel's merge). Entries on and above the diagonal of L are ignored. Returns [..., n, n], unit
    lower triangular. Raises ValueError when n % block != 0.
    """
    n = L.shape[-1]
    L = torch.where(_causal(n, True, L.device), L, torch.zeros((), dtype=L.dtype, device=L.device))
    A = solve_tril_diagonal_blocks(L, block)
    nb = n // block
    sl = [slice(b * block, (b + 1) * block) for b in range(nb)]
    for d in range(1, nb):
        for j in range(nb - d):
            i = j + d
            acc = sum(L[..., sl[i], sl[m]] @ A[..., sl[m], sl[j]] for m in range(j, i))
            A[..., sl[i], sl[j]] = -A[..., sl[i], sl[i]] @ acc
    return A


def kkt_solve(k: torch.Tensor, beta: torch.Tensor, block: int = 16) -> torch.Tensor:
    """The gate-free UT inverse A = (I + tril_-1(diag(beta) K K^T))^-1 per chunk (no exp, no g).

    k: [NC, HV, C, K]; beta: [NC, HV, C]. Returns A [NC, HV, C, C], unit lower triangular, computed by
    `solve_tril_blocks` (block must divide C; C itself when it does not).

    Source: FlashQLA `kkt_solve` (research/flashqla-design.md 2.2, rewrite R1)."""
    C = k.shape[-2]
    L = beta[..., None] * (k @ _t(k))
    return solve_tril_blocks(L, block if C % block == 0 else C)


def regate(A: torch.Tensor, g_cum: torch.Tensor, *, log2: bool = False) -> torch.Tensor:
    """A_g = Gamma * A: the gate-free inverse re-gated elementwise, equal to FLA's gated
    (I + tril_-1(diag(beta)(K K^T * Gamma)))^-1 (RW-1: Gamma * X = D X D^-1 for lower X).

    A: [NC, HV, C, C] (`kkt_solve`); g_cum: [NC, HV, C]. Returns [NC, HV, C, C]."""
    return decay_mask(g_cum, log2=log2) * A


# ----------------------------------------------------------------------------------------------
# Forward stages
# ----------------------------------------------------------------------------------------------


def chunk_v_new(k, v, beta, A_g, g_cum, h, *, log2: bool = False) -> torch.Tensor:
    """v_new = A_g diag(beta) (V - D (K S)): FLA's u - w S in one product (RW-2).

    k: [NC, HV, C, K]; v: [NC, HV, C, V]; beta: [NC, HV, C]; A_g: [NC, HV, C, C] (`regate`);
    g_cum: [NC, HV, C]; h: [NC, HV, K, V] the state entering each chunk. Returns [NC, HV, C, V]."""
    gamma, _, _ = gate_vectors(g_cum, log2=log2)
    W = v - gamma[..., None] * (k @ h)
    return A_g @ (beta[..., None] * W)


def chunk_state_update(h, k, v_new, g_cum, *, log2: bool = False) -> torch.Tensor:
    """S' = gamma_C S + K^T (diag(r) v_new): the chunk-end state (r applied to the C x V operand).

    h: [NC, HV, K, V]; k: [NC, HV, C, K]; v_new: [NC, HV, C, V]; g_cum: [NC, HV, C]. Returns [NC, HV, K, V]."""
    _, gamma_C, r = gate_vectors(g_cum, log2=log2)
    return gamma_C[..., None, None] * h + _t(k) @ (r[..., None] * v_new)


def chunk_transition(k, beta, A, g_cum, *, log2: bool = False):
    """The homogeneous part of the chunk's affine state map S' = (gamma_C I - T_c) S + B_c (RW-3).

    T_c = gamma_C K^T A diag(beta) K, with A gate-free (`kkt_solve`): gate-free apart from the scalar.
    k: [NC, HV, C, K]; beta: [NC, HV, C]; A: [NC, HV, C, C]; g_cum: [NC, HV, C].
    Returns (T_c [NC, HV, K, K], gamma_C [NC, HV]); M_c = gamma_C I - T_c is the chunk's transition matrix.

    Source: FlashQLA prepare_h / CP fallback M (research/flashqla-design.md 1.2, R4, R6)."""
    _, gamma_C, _ = gate_vectors(g_cum, log2=log2)
    return gamma_C[..., None, None] * (_t(k) @ (A @ (beta[..., None] * k))), gamma_C


def chunk_state_input(k, v, beta, A, g_cum, *, log2: bool = False) -> torch.Tensor:
    """B_c = K^T A diag(beta) diag(r) V: the chunk-end state from a zero entering state (RW-3).

    Shapes as `chunk_transition`, v: [NC, HV, C, V]. Returns [NC, HV, K, V]."""
    _, _, r = gate_vectors(g_cum, log2=log2)
    return _t(k) @ (A @ ((beta * r)[..., None] * v))


def chunk_state_update_xy(h, k, v, beta, A, g_cum, *, log2: bool = False) -> torch.Tensor:
    """S' = gamma_C S + X^T Y, X = -diag(beta) A^T K, Y = gamma_C K S - diag(r) V (RW-5): the state
    update with no C x C decay mask (FlashQLA's prepare_h; used for recompute and CP warm-up).

    Shapes as `chunk_state_update` / `chunk_transition`. Returns [NC, HV, K, V]."""
    _, gamma_C, r = gate_vectors(g_cum, log2=log2)
    X = -beta[..., None] * (_t(A) @ k)
    Y = gamma_C[..., None, None] * (k @ h) - r[..., None] * v
    return gamma_C[..., None, None] * h + _t(X) @ Y


def chunk_output(q, k, v_new, h, g_cum, scale: float, *, log2: bool = False) -> torch.Tensor:
    """o = scale D (Q S) + Pg v_new, Pg = scale Gamma * (Q K^T) (one decay mask per chunk).

    q, k: [NC, HV, C, K]; v_new: [NC, HV, C, V]; h: [NC, HV, K, V]; g_cum: [NC, HV, C]; scale: float.
    Returns [NC, HV, C, V]. Source: FlashQLA fused_gdr_fwd (rewrite R5)."""
    gamma, _, _ = gate_vectors(g_cum, log2=log2)
    Pg = scale * decay_mask(g_cum, log2=log2) * (q @ _t(k))
    return scale * gamma[..., None] * (q @ h) + Pg @ v_new


def chunk_v_new_output(q, k, v, beta, A_g, g_cum, h, scale: float, *, log2: bool = False):
    """(v_new, o) of one chunk step: `chunk_v_new` then `chunk_output` (RW-7's left side).
    Shapes as those two. Returns ([NC, HV, C, V], [NC, HV, C, V])."""
    v_new = chunk_v_new(k, v, beta, A_g, g_cum, h, log2=log2)
    return v_new, chunk_output(q, k, v_new, h, g_cum, scale, log2=log2)


def row_scales_pow2(W: torch.Tensor, lo: int = 7, span: int = 30) -> torch.Tensor:
    """The sm_90 recurrent kernel's fp16 operand scales: per value column of W [..., C, V], the power
    of two 2^e that puts the column's largest magnitude in [2^lo, 2^(lo + 1)), e clamped to
    [-span, span] (an all-zero column takes 2^span). Returns [..., V], W's dtype."""
    amax = W.abs().amax(dim=-2).clamp_min(1e-30)
    e = (lo + 1 - torch.floor(torch.log2(amax)) - 1).clamp(-span, span)
    return torch.exp2(e)


def chunk_v_new_output_row_scaled(q, k, v, beta, A_g, g_cum, h, scale: float, *, log2: bool = False):
    """(v_new, o) in the inference forward's fp16 A_beta product order (RW-7's right side): W = V - D
    (K S) with each value column scaled by s = `row_scales_pow2`(W) (diag(s) W^T: a row of the
    kernel's W^T), v_new' = A_g diag(beta) (W diag(s)), v_new = v_new' diag(s)^-1 (what the state
    update reads), o = (scale D (Q S) diag(s) + Pg v_new') diag(s)^-1 (the output role's columns
    scaled around its product). Exact in real arithmetic for any invertible diag(s); with powers of
    two the scalings are exact in floating point too. Shapes as `chunk_v_new_output`."""
    gamma, _, _ = gate_vectors(g_cum, log2=log2)
    W = v - gamma[..., None] * (k @ h)
    sc = row_scales_pow2(W)[..., None, :]
    vn_s = A_g @ (beta[..., None] * (W * sc))
    Pg = scale * decay_mask(g_cum, log2=log2) * (q @ _t(k))
    o = (scale * gamma[..., None] * (q @ h) * sc + Pg @ vn_s) / sc
    return vn_s / sc, o


# ----------------------------------------------------------------------------------------------
# The chunk's affine map, literally and in WY form (WY-1, WY-2)
# ----------------------------------------------------------------------------------------------


def _token_gates(g_cum: torch.Tensor) -> torch.Tensor:
    """Per-token g from the chunk-local cumsum (g_t = g_cum_t - g_cum_{t-1})."""
    return torch.diff(g_cum, dim=-1, prepend=torch.zeros_like(g_cum[..., :1]))


def chunk_transition_rank1(k, beta, g_cum) -> torch.Tensor:
    """M = prod_{t = C-1 .. 0} a_t (I - beta_t k_t k_t^T), a_t = exp(g_t): the chunk's transition
    matrix as the literal product of its gated rank-1 factors (left side of WY-1).

    k: [NC, HV, C, K]; beta: [NC, HV, C]; g_cum: [NC, HV, C] (ln). Returns [NC, HV, K, K].
    Padding slots (k = 0, g = 0) are identity factors."""
    a = _token_gates(g_cum).exp()
    K = k.shape[-1]
    M = torch.eye(K, dtype=k.dtype, device=k.device).expand(*k.shape[:-2], K, K).clone()
    for t in range(k.shape[-2]):
        kt = k[..., t, :]
        M = a[..., t, None, None] * (M - beta[..., t, None, None] * kt[..., :, None] * (kt[..., None, :] @ M))
    return M


def chunk_transition_wy(k, w, g_cum) -> torch.Tensor:
    """M = gamma_C I - K^T diag(r) w with FLA's w = A_g diag(beta gamma) K (right side of WY-1).

    k, w: [NC, HV, C, K]; g_cum: [NC, HV, C]. Returns [NC, HV, K, K]."""
    _, gamma_C, r = gate_vectors(g_cum)
    eye = torch.eye(k.shape[-1], dtype=k.dtype, device=k.device)
    return gamma_C[..., None, None] * eye - _t(k) @ (r[..., None] * w)


def chunk_state_input_rank1(k, v, beta, g_cum) -> torch.Tensor:
    """F = sum_t [prod_{s > t} a_s (I - beta_s k_s k_s^T)] beta_t k_t v_t^T: the chunk's writes carried
    to its end, token by token from a zero state (left side of WY-2). Returns [NC, HV, K, V]."""
    a = _token_gates(g_cum).exp()
    S = torch.zeros(*k.shape[:-2], k.shape[-1], v.shape[-1], dtype=k.dtype, device=k.device)
    for t in range(k.shape[-2]):
        kt, vt, bt = k[..., t, :], v[..., t, :], beta[..., t, None, None]
        S = a[..., t, None, None] * (S - bt * kt[..., :, None] * (kt[..., None, :] @ S)) + bt * kt[..., :, None] * vt[..., None, :]
    return S


def chunk_state_input_wy(k, u, g_cum) -> torch.Tensor:
    """F = K^T diag(r) u with FLA's u = A_g diag(beta) V (right side of WY-2). Returns [NC, HV, K, V]."""
    _, _, r = gate_vectors(g_cum)
    return _t(k) @ (r[..., None] * u)


# ----------------------------------------------------------------------------------------------
# Backward: the state gradient in gate-light form (RW-6)
# ----------------------------------------------------------------------------------------------


def chunk_state_grad(dh_next, q, k, beta, A, g_cum, do, scale: float, *, log2: bool = False) -> torch.Tensor:
    """dS = M_c^T dS' + scale (D R)^T dO with R = Q - tril_0(Q K^T) A diag(beta) K (RW-6): the gradient
    of the state entering the chunk from that of the state leaving it, with no C x C decay mask.

    dh_next: [NC, HV, K, V] (dS', gradient of the chunk-end state); q, k: [NC, HV, C, K];
    beta: [NC, HV, C]; A: [NC, HV, C, C] gate-free; g_cum: [NC, HV, C]; do: [NC, HV, C, V].
    Returns [NC, HV, K, V]. Source: FlashQLA cp_bwd (research/flashqla-design.md 1.3, R7)."""
    gamma, gamma_C, _ = gate_vectors(g_cum, log2=log2)
    T_c, _ = chunk_transition(k, beta, A, g_cum, log2=log2)
    M = gamma_C[..., None, None] * torch.eye(k.shape[-1], dtype=k.dtype, device=k.device) - T_c
    QK = torch.tril(q @ _t(k))
    R = q - QK @ (A @ (beta[..., None] * k))
    return _t(M) @ dh_next + scale * _t(gamma[..., None] * R) @ do


# ----------------------------------------------------------------------------------------------
# Whole passes
# ----------------------------------------------------------------------------------------------


def _initial(initial_state, N, HV, K, V, dtype, device):
    if initial_state is not None:
        return initial_state.to(dtype).clone()
    return torch.zeros(N, HV, K, V, dtype=dtype, device=device)


def fused_chunk_fwd(
    q, k, v, g_cum, beta, scale: float, initial_state=None, cu_seqlens=None, chunk_size: int = 64,
    state_update: str = "direct", use_exp2: bool = False,
):
    """The rewritten forward from a given chunk-local cumsum (differentiable in every input, g_cum
    included; the BWD-dG twin differentiates it with respect to g_cum).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g_cum: [B, T, HV] natural-log chunk-local cumsum;
        beta: [B, T, HV]; scale: float; initial_state: None or [N, HV, K, V]; cu_seqlens: None or
        [N + 1] offsets (B == 1); chunk_size: C.
        state_update: "direct" (`chunk_state_update`), "transition" ((gamma_C I - T_c) S + B_c, RW-3)
            or "xy" (`chunk_state_update_xy`, RW-5).
        use_exp2: run every stage on g_cum_log2 = g_cum_to_log2(g_cum) with exp2 (RW-4).

    Returns:
        dict of FLA-layout tensors in the compute dtype: o [B, T, HV, V], final_state [N, HV, K, V],
        A [B, T, HV, C] (gate-free), A_g [B, T, HV, C] (re-gated), h [B, NT, HV, K, V] (state entering
        each chunk), v_new [B, T, HV, V]; and `layout`, the ChunkLayout.
    Raises ValueError for an unknown state_update.
    """
    if state_update not in ("direct", "transition", "xy"):
        raise ValueError(f"state_update must be 'direct', 'transition' or 'xy', got {state_update!r}")
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    cdt = compute_dtype(q, k, v, g_cum, beta, initial_state)
    lay = prepare_chunk_layout(q.shape[0], q.shape[1], cu_seqlens, chunk_size, q.device)
    qc, kc = to_chunks(q, lay, HV, cdt), to_chunks(k, lay, HV, cdt)
    vc, bc = to_chunks(v, lay, dtype=cdt), to_chunks(beta, lay, dtype=cdt)
    G = pad_g_cum(to_chunks(g_cum, lay, dtype=cdt), lay)
    if use_exp2:
        G = g_cum_to_log2(G)
    gk = dict(log2=use_exp2)

    A = kkt_solve(kc, bc)
    A_g = regate(A, G, **gk)
    if state_update == "transition":
        T_c, gamma_C = chunk_transition(kc, bc, A, G, **gk)
        M = gamma_C[..., None, None] * torch.eye(K, dtype=cdt, device=q.device) - T_c
        B_c = chunk_state_input(kc, vc, bc, A, G, **gk)

    S = _initial(initial_state, lay.N, HV, K, V, cdt, q.device)
    h = torch.zeros(lay.NC, HV, K, V, dtype=cdt, device=q.device)
    for ids in lay.chunks_at:
        sq = lay.seq[ids]
        S0 = S[sq]
        h = h.index_copy(0, ids, S0)
        if state_update == "direct":
            vn = chunk_v_new(kc[ids], vc[ids], bc[ids], A_g[ids], G[ids], S0, **gk)
            S1 = chunk_state_update(S0, kc[ids], vn, G[ids], **gk)
        elif state_update == "transition":
            S1 = M[ids] @ S0 + B_c[ids]
        else:
            S1 = chunk_state_update_xy(S0, kc[ids], vc[ids], bc[ids], A[ids], G[ids], **gk)
        S = S.index_copy(0, sq, S1)
    v_new = chunk_v_new(kc, vc, bc, A_g, G, h, **gk)
    o = chunk_output(qc, kc, v_new, h, G, scale, **gk)
    return dict(
        o=from_chunks(o, lay),
        final_state=S,
        A=from_chunks(A, lay),
        A_g=from_chunks(A_g, lay),
        h=h.view(lay.B, lay.NT, HV, K, V),
        v_new=from_chunks(v_new, lay),
        layout=lay,
    )


def fused_gated_delta_rule_fwd(
    q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
    chunk_size: int = 64, state_update: str = "direct", use_exp2: bool = False,
):
    """The rewritten chunked forward, end to end (what the fused kernels compute), FLA's signature.

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V]; g: [B, T, HV] natural-log decay per token (<= 0);
        beta: [B, T, HV]; scale: default K ** -0.5; initial_state: None or [N, HV, K, V];
        output_final_state: bool; cu_seqlens: None or [N + 1] offsets (B == 1); chunk_size: C;
        state_update, use_exp2: see `fused_chunk_fwd`.

    Returns:
        (g_cum [B, T, HV], o [B, T, HV, V], A [B, T, HV, C] gate-free, final_state [N, HV, K, V] or
        None, h [B, NT, HV, K, V], v_new [B, T, HV, V]): FLA's tuple, except that A is the gate-free
        inverse (FLA's gated A is `regate(A, g_cum)`), in the compute dtype.

    Raises:
        TypeError, ValueError: `flashqla.contract.check_gdn_inputs(..., check_values=True)`.

    g is floored at `reference.gdn.chunk.G_FLOOR` before the cumsum (`floor_gates`).
    """
    d = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, check_values=True)
    scale = d.K**-0.5 if scale is None else float(scale)
    cdt = compute_dtype(q, k, v, g, beta, initial_state)
    lay = prepare_chunk_layout(d.B, d.T, cu_seqlens, chunk_size, q.device)
    g_cum = from_chunks(gate_cumsum(to_chunks(floor_gates(g), lay, dtype=cdt)), lay)
    out = fused_chunk_fwd(q, k, v, g_cum, beta, scale, initial_state, cu_seqlens, chunk_size, state_update, use_exp2)
    final = out["final_state"] if output_final_state else None
    return g_cum, out["o"], out["A"], final, out["h"], out["v_new"]


def fused_state_grad(q, k, g, beta, scale, do, dht=None, cu_seqlens=None, chunk_size: int = 64):
    """The reverse state-gradient pass in gate-light form (RW-6), sequential over chunks.

    Args:
        q, k: [B, T, H, K]; g: [B, T, HV] (ln, per token; floored at G_FLOOR as in the forward);
        beta: [B, T, HV]; scale: float; do: [B, T, HV, V] gradient of o; dht: None (0) or
        [N, HV, K, V] gradient of the final state; cu_seqlens, chunk_size: as the forward.

    Returns:
        (dh [B, NT, HV, K, V] gradient of the state at the END of each chunk (FLA's `dh`),
         dh0 [N, HV, K, V] gradient of the initial state).
    """
    HV, K, V = do.shape[2], k.shape[3], do.shape[3]
    cdt = compute_dtype(q, k, g, beta, do, dht)
    lay = prepare_chunk_layout(q.shape[0], q.shape[1], cu_seqlens, chunk_size, q.device)
    qc, kc = to_chunks(q, lay, HV, cdt), to_chunks(k, lay, HV, cdt)
    bc, doc = to_chunks(beta, lay, dtype=cdt), to_chunks(do, lay, dtype=cdt)
    G = gate_cumsum(to_chunks(floor_gates(g), lay, dtype=cdt))
    A = kkt_solve(kc, bc)
    D = _initial(dht, lay.N, HV, K, V, cdt, q.device)
    dh = torch.zeros(lay.NC, HV, K, V, dtype=cdt, device=q.device)
    for ids in reversed(lay.chunks_at):
        sq = lay.seq[ids]
        dh = dh.index_copy(0, ids, D[sq])
        D = D.index_copy(0, sq, chunk_state_grad(D[sq], qc[ids], kc[ids], bc[ids], A[ids], G[ids], doc[ids], scale))
    return dh.view(lay.B, lay.NT, HV, K, V), D


def recurrent_deltas(k, v, g, beta, initial_state=None, cu_seqlens=None):
    """The token recurrence's per-token writes u_t = beta_t (v_t - a_t S_{t-1}^T k_t), a_t = exp(g_t)
    (the delta form S_t = a_t S_{t-1} + k_t u_t^T); left side of CF-3, equal to FLA's v_new.

    k: [B, T, H, K]; v: [B, T, HV, V]; g, beta: [B, T, HV]; initial_state: None or [N, HV, K, V];
    cu_seqlens: None or [N + 1]. Returns u [B, T, HV, V] in the compute dtype. Token by token (slow:
    for tests)."""
    B, T, HV, V = v.shape
    K = k.shape[3]
    cdt = compute_dtype(k, v, g, beta, initial_state)
    ke = k.to(cdt).repeat_interleave(HV // k.shape[2], dim=2)
    ve, ge, be = v.to(cdt), g.to(cdt), beta.to(cdt)
    out = torch.zeros(B, T, HV, V, dtype=cdt, device=v.device)
    for n, (b, bos, eos) in enumerate(seq_bounds(B, T, cu_seqlens)):
        S = initial_state[n].to(cdt) if initial_state is not None else torch.zeros(HV, K, V, dtype=cdt, device=v.device)
        for t in range(bos, eos):
            S = ge[b, t].exp()[:, None, None] * S
            u = be[b, t][:, None] * (ve[b, t] - torch.einsum("hkv,hk->hv", S, ke[b, t]))
            S = S + ke[b, t][:, :, None] * u[:, None, :]
            out[b, t] = u
    return out


# ----------------------------------------------------------------------------------------------
# The product form of the block inverse (an earlier form of the sm_90 prepare kernel's inverse;
# record WY-5):
#     (I + L)^-1 = (I - F)(I + F^2) D^-1,   D = blockdiag(I + L_ii),  E = L - blocks(L_ii),  F = D^-1 E,
# exact because F is strictly block-lower with 4 blocks (F^4 = 0), so (I + F)^-1 = I - F + F^2 - F^3.
# Twins: this function and `solve_tril_blocks` (WY-4).
# ----------------------------------------------------------------------------------------------


def solve_tril_nilpotent(L: torch.Tensor, block: int = 16) -> torch.Tensor:
    """(I + L)^-1 for strictly lower L [..., n, n] with n == 4 * block, in the product form (an earlier
    form of the sm_90 prepare kernel's inverse): D^-1 by forward substitution in the diagonal blocks
    (WY-3), then four n x n products F = D^-1 E, X = I + F F, G = X - F X, A = G D^-1 (record WY-5:
    (I + F)^-1 = (I - F)(I + F^2) when F^4 = 0).

    Entries on and above the diagonal of L are ignored. Returns [..., n, n], unit lower triangular.
    Raises ValueError unless n == 4 * block.
    """
    n = L.shape[-1]
    if n != 4 * block:
        raise ValueError(f"solve_tril_nilpotent needs n == 4 * block, got n = {n}, block = {block}")
    L = torch.where(_causal(n, True, L.device), L, torch.zeros((), dtype=L.dtype, device=L.device))
    Dinv = solve_tril_diagonal_blocks(L, block)
    blk = torch.arange(n, device=L.device) // block
    E = torch.where(blk[:, None] > blk[None, :], L, torch.zeros((), dtype=L.dtype, device=L.device))
    F = Dinv @ E
    X = torch.eye(n, dtype=L.dtype, device=L.device) + F @ F
    return (X - F @ X) @ Dinv


# ----------------------------------------------------------------------------------------------
# The grouped prepare stage: one chunk of one q/k head for all G value heads of its group, K K^T
# formed once, each value head's inverse by WY-5's four products (the sm_90 prepare kernel,
# flashqla/ops/gdn/kernels/sm90/prepare.py, forms it by recursive doubling: `prepare_group_recursive` below).
# Records: CF-1..CF-3 (FLA's gated A), WY-3 (diagonal blocks), WY-5 ((I - F)(I + F^2) D^-1, with
# G = (I - F) X taken literally as one product), RW-2 (beta folded into the stored columns), RW-4
# (base 2). No new record: sharing K K^T is the op's GVA definition.
# Twins: `solve_tril_nilpotent` (same inverse) and reference.gdn.chunk's chunk_local_cumsum,
# chunk_scaled_dot_kkt, solve_tril (FLA's stages).
# ----------------------------------------------------------------------------------------------


def _group_gated_L(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, nvalid: int | None):
    """The part `prepare_group` and `prepare_group_recursive` share: g and beta masked past `nvalid`,
    g_cum_log2 [..., G, C], and L = strictly_lower(diag(beta) (K K^T) * Gamma) [..., G, C, C] over the
    valid rows, K K^T formed once for the group. Returns (g_cum_log2, masked beta, L)."""
    C = k.shape[-2]
    nvalid = C if nvalid is None else int(nvalid)
    t = torch.arange(C, device=k.device)
    valid = t < nvalid
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    g = torch.where(valid, g, zero)
    beta = torch.where(valid, beta, zero)
    gcl = g_cum_to_log2(torch.cumsum(g, dim=-1))  # [..., G, C]
    kk = (k @ _t(k)).unsqueeze(-3)  # [..., 1, C, C]: once for the group
    strict = (t[:, None] > t[None, :]) & valid[:, None]
    expo = torch.where(strict, gcl[..., :, None] - gcl[..., None, :], zero)
    L = torch.where(strict, beta[..., :, None] * kk * torch.exp2(expo), zero)  # [..., G, C, C]
    return gcl, beta, L


def prepare_group(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, nvalid: int | None = None, block: int = 16):
    """The grouped prepare stage for one chunk of one q/k head and its G value heads, the inverse in
    WY-5's nilpotent form.

    Args:
        k: [..., C, K], the chunk of the q/k head (rows past `nvalid` may hold anything finite: they
            are masked, as the kernel masks the next sequence's keys it loads).
        g: [..., G, C], natural-log per-token gates of the G value heads (hv = hk * G + j).
        beta: [..., G, C].
        nvalid: number of valid rows (None: C); g and beta past it are treated as 0.
        block: diagonal block size (C == 4 * block).

    Returns:
        g_cum_log2 [..., G, C]: chunk-local cumsum of g / ln 2 (rows past nvalid repeat the last value);
        A_beta [..., G, C, C]: A diag(beta) with A = (I + L)^-1, L = strictly_lower(diag(beta)
        (K K^T) * Gamma) restricted to the valid rows, by D^-1 (WY-3) and, in order, F = D^-1 E,
        X = I + F F, G = (I - F) X, A = G D^-1 (WY-5); rows past nvalid are 0.
    """
    C = k.shape[-2]
    if C != 4 * block:
        raise ValueError(f"prepare_group needs C == 4 * block, got C = {C}, block = {block}")
    gcl, beta, L = _group_gated_L(k, g, beta, nvalid)
    t = torch.arange(C, device=k.device)
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    Dinv = solve_tril_diagonal_blocks(L, block)
    blk = t // block
    E = torch.where(blk[:, None] > blk[None, :], L, zero)
    eye = torch.eye(C, dtype=L.dtype, device=L.device)
    F = Dinv @ E
    X = eye + F @ F
    Gm = (eye - F) @ X
    A = Gm @ Dinv
    A_beta = torch.where(t[:, None] >= t[None, :], A * beta[..., None, :], zero)
    return gcl, A_beta


# ----------------------------------------------------------------------------------------------
# The stage twin of the sm_90 prepare kernel (flashqla/ops/gdn/kernels/sm90/prepare.py):
# the same chunk-of-a-group computation as `prepare_group`, with the inverse formed by recursive
# doubling in the kernel's order of products (`solve_tril_doubling`: 8 x 8 diagonal blocks, then
# 16-, 32- and 64-blocks). Records: WY-3 (the diagonal blocks) and WY-4 with two blocks, applied at
# each level (the off-diagonal block of a 2 x 2 block-lower inverse from its diagonal-block inverses;
# no new identity; the kernel's earlier order, 16-blocks by forward substitution and three product
# phases, is in git history). Twins: `solve_tril_blocks` / `solve_tril_nilpotent`
# (same inverse), `prepare_group`.
# ----------------------------------------------------------------------------------------------


def solve_tril_block_product(L: torch.Tensor, block: int = 8, storage: torch.dtype | None = None) -> torch.Tensor:
    """Inverses of the diagonal block x block blocks of I + L by the nilpotent product (record WY-6):
    with L_b strictly lower, L_b^block = 0, so for block <= 8

        (I + L_b)^-1 = (I - L_b)(I + L_b^2)(I + L_b^4)

    formed as an mma level of the sm_90 kernels' inverse would form it (`prepare.diagonal_blocks_8x8_mma`):
    L2 = L_b L_b, X2 = X1 + X1 L2 with X1 = I - L_b, L4 = L2 L2, X3 = X2 + X2 L4, each product an
    accumulation onto its fp32 left term.

    L: [..., n, n], strictly lower (entries on and above the diagonal are ignored); n % block == 0,
    block <= 8. storage: None (exact, in L's dtype) or the dtype of the kernel's mma operands
    (torch.float16): L rounded to it; L2 and L4 enter their products as a pair hi + lo of that dtype
    (hi = L2 rounded, lo = the remainder rounded; L4 = hi hi + hi lo + lo hi), since a single rounding
    of them loses accuracy on strongly correlated keys (`benchmarks/journal/forward.md`, "The inverse's
    first level by products"); X2 enters the last product rounded, its fp32 accumulator kept
    for the sum. The result is fp32, not yet rounded. Returns [..., n, n], block diagonal (zero off the
    diagonal blocks): the diagonal blocks of (I + L)^-1. Raises ValueError when n % block != 0 or block > 8.
    """
    n = L.shape[-1]
    if n % block or block > 8:
        raise ValueError(f"solve_tril_block_product needs block <= 8 dividing n, got n = {n}, block = {block}")
    exact = storage is None
    rnd = (lambda x: x) if exact else (lambda x: x.to(storage).float())  # noqa: E731
    Lw = L if exact else rnd(L)
    out = torch.zeros_like(Lw)
    tri = _causal(block, True, L.device)
    eye = torch.eye(block, dtype=Lw.dtype, device=L.device)

    def pair(x):
        hi = rnd(x)
        return hi, (x - hi if exact else rnd(x - hi))

    for b in range(n // block):
        sl = slice(b * block, (b + 1) * block)
        Lb = torch.where(tri, Lw[..., sl, sl], torch.zeros((), dtype=Lw.dtype, device=L.device))
        h2, l2 = pair(Lb @ Lb)
        X1 = eye - Lb
        X2 = X1 + X1 @ h2 + X1 @ l2
        h4, l4 = pair(h2 @ h2 + h2 @ l2 + l2 @ h2)
        X2r = rnd(X2)
        out[..., sl, sl] = X2 + X2r @ h4 + X2r @ l4
    return out


def solve_tril_doubling(L: torch.Tensor, block: int = 8, storage: torch.dtype | None = None,
                        level1: str = "substitution") -> torch.Tensor:
    """(I + L)^-1 for strictly lower L [..., n, n] by recursive doubling, as the sm_90 prepare kernel
    forms it (n == 8 * block: three doublings):

        level 1  the diagonal block x block blocks, each inverted on its own (WY-3)
        level 2+ for each pair of neighbouring inverted blocks P^-1, Q^-1 of size m (m = block, 2 block,
                 4 block): the off-diagonal block of [[P, 0], [C, Q]]^-1, -Q^-1 C P^-1, as the two
                 products Y = Q^-1 C, then -Y P^-1 (WY-4 with two blocks)

    storage: None (every value in L's dtype, the exact form) or a dtype the kernel stores between steps
    (torch.float16): L rounded to it first, each level's blocks and the intermediate Y rounded to it,
    the products and level 1 computed in fp32 from the rounded values (mma.sync with fp32 accumulation).
    level1: "substitution" (WY-3, the shipped kernels' shuffle elimination, exact in fp32) or "product"
    (WY-6, `solve_tril_block_product`, the mma form with its own operand roundings; block <= 8).
    Entries on and above the diagonal of L are ignored. Returns [..., n, n] unit lower triangular (fp32
    with storage given, else L's dtype). Raises ValueError unless n == 8 * block, or for another level1.
    """
    n = L.shape[-1]
    if n != 8 * block:
        raise ValueError(f"solve_tril_doubling needs n == 8 * block, got n = {n}, block = {block}")
    L = torch.where(_causal(n, True, L.device), L, torch.zeros((), dtype=L.dtype, device=L.device))
    if storage is None:
        rnd = lambda x: x  # noqa: E731
    else:
        rnd = lambda x: x.to(storage).float()  # noqa: E731
        L = rnd(L)
    if level1 == "substitution":
        A = rnd(solve_tril_diagonal_blocks(L, block))
    elif level1 == "product":
        A = rnd(solve_tril_block_product(L, block, storage))
    else:
        raise ValueError(f"level1 must be 'substitution' or 'product', got {level1!r}")
    m = block
    while m < n:
        for b in range(n // (2 * m)):
            p = slice(2 * m * b, 2 * m * b + m)
            q = slice(2 * m * b + m, 2 * m * (b + 1))
            Y = rnd(A[..., q, q] @ L[..., q, p])
            A[..., q, p] = rnd(-(Y @ A[..., p, p]))
        m *= 2
    return A


def prepare_group_recursive(k: torch.Tensor, g: torch.Tensor, beta: torch.Tensor, nvalid: int | None = None,
                            block: int = 8, storage: torch.dtype | None = None):
    """What the sm_90 prepare kernel computes for one chunk of one q/k head and its G value heads:
    `prepare_group`'s inputs and outputs, with A = (I + L)^-1 by `solve_tril_doubling` instead of
    WY-5's four products.

    Args:
        k: [..., C, K], the chunk of the q/k head (rows past `nvalid` may hold anything finite).
        g: [..., G, C], natural-log per-token gates of the G value heads (hv = hk * G + j).
        beta: [..., G, C].
        nvalid: number of valid rows (None: C); g and beta past it are treated as 0.
        block: the doubling's first block size (C == 8 * block).
        storage: `solve_tril_doubling`'s (None: exact in k's dtype; torch.float16: the kernel's roundings
            of the inverse's steps; A diag(beta) is then fp32 of those values, not yet rounded to A's dtype).

    Returns:
        g_cum_log2 [..., G, C] and A_beta [..., G, C, C] = A diag(beta), lower triangular, rows past
        nvalid 0 (as `prepare_group`).
    """
    C = k.shape[-2]
    if C != 8 * block:
        raise ValueError(f"prepare_group_recursive needs C == 8 * block, got C = {C}, block = {block}")
    gcl, beta, L = _group_gated_L(k, g, beta, nvalid)
    t = torch.arange(C, device=k.device)
    zero = torch.zeros((), dtype=g.dtype, device=g.device)
    A = solve_tril_doubling(L, block, storage).to(L.dtype)
    A_beta = torch.where(t[:, None] >= t[None, :], A * beta[..., None, :], zero)
    return gcl, A_beta

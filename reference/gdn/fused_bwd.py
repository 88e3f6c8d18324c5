"""The backward our sm_90 kernels compute, stage by stage, from what the sm_90 forward leaves behind.

The forward (`flashqla.ops.gdn.api.chunk_gated_delta_rule_fwd`) returns, besides o and the final
state, two slot-major intermediates (`flashqla.ops.gdn.kernels.sm90._common`):
    A_beta      [HV, S * 64, 64]  A diag(beta), A = FLA's gated (I + L)^-1, in q's dtype (bf16)
    g_cum_log2  [HV, S * 64]      chunk-local inclusive cumsum of g / ln 2, fp32
No state is kept. The backward is three passes (three launches on the GPU):

    1. h      = recompute_states(k, v, A_beta, g_cum, h0)        per (sequence, value head), forward
               S' = gamma_C S + K^T diag(r) v_new,  v_new = A_beta (V - D K S)   (RW-2, CF-2)
       stores the chunk-start states h (dtype `h_dtype`: fp32, or bf16 to halve the traffic).
    2. grads  = chunk_bwd_fused(...) per chunk, chunks of one (sequence, value head) in reverse order,
               the state gradient dS (FLA's dh) carried in fp32:
       recompute  Kg = (K K^T) * Gamma_strict,  A = I - A_beta Kg  (BWD-Abeta),  U = K S0,
                  W = V - D U,  v_new = A_beta W
       dv_new = scale (K Q^T * Gamma^T) dO + diag(r) K dS'
       X      = A^T dv_new,   dv = A_beta^T dv_new = diag(beta) X
       dS     = gamma_C dS' + scale Q^T D dO - K^T D dv                    (BWD-dh0)
       M      = (dO v_new^T) * Gamma
       dq     = scale (D dO S0^T + M K)                                    (BWD-dq)
       dL     = -tril_-1(X v_new^T),  dLk = dL * Gamma_strict              (BWD-fused)
       dk     = diag(r) v_new dS'^T + scale M^T Q - D dv S0^T
                + diag(beta) dLk K + dLk^T diag(beta) K                    (BWD-fused)
       dbeta  = rowsum(X * W) + rowsum((dLk K) * K)                        (BWD-fused)
       dG     = dL/dg_cum per position (BWD-dG, in the cancellation-free form of
                `reference.gdn.chunk_bwd.chunk_bwd_dqkwg`):
                scale (rowsum(D dO S0^T * Q) + rowsum(Z) - colsum(Z)),  Z = M * (Q K^T) strict
                - rowsum(diag(r) v_new dS'^T * K) at every position but the last
                - rowsum(dv * D U) + rowsum(dL * L) - colsum(dL * L),   L = diag(beta) Kg
                + at the last position: gamma_C <S0, dS'> + the r-terms left out above
       dq and dk stay per value head here (the kernel writes them per value head).
    3. finish: dg = reverse chunk-local cumsum of dG (BWD-dg); dq, dk summed over each GVA group.

The only new algebra is BWD-Abeta (the gated A from the stored A diag(beta), one 64 x 64 x 64 product,
no inverse) and BWD-fused (FLA's dA, dk and dbeta through w and u collapse to X = A^T dv_new and v_new:
A^T dA A^T = X v_new^T); both are derivation records (`derivations.backward_fused`; in the BWD family
because only the backward uses them).

Layout: stage functions take chunk tensors [NC, HV, C, ...] (`reference.gdn.fused.to_chunks`), with
padding slots zero (q, k, v, beta, do) and g_cum repeating the last valid value; A_beta rows past the
end of a sequence are zero (what the prepare kernel writes), so v_new is zero there, and every
gradient at a padding slot is discarded. Gates: natural log with log2=False; with log2=True the gate
argument is g_cum_log2 and every exponential is exp2 (what the kernels do). Gradients with respect to
g_cum are the same in either base (they are c d loss / d c with c = exp(g_cum)).

dtype: any float; the tests run fp64 on CPU. `state_dtype` / `h_dtype` arguments round a quantity
to a lower precision (and back) where a kernel would store or feed it to a tensor-core product, to
measure what that costs.

Source: FlashQLA `hopper/prepare_h.py`, `fused_bwd.py` (research/flashqla-design.md 1.3, 2.3, 2.5);
FLA `chunk_gated_delta_rule_bwd` (research/fla-gdn.md 3) for the formulas before the rewrites.
"""

from __future__ import annotations

import torch

from .chunk import G_FLOOR, ChunkLayout, floor_gates, prepare_chunk_layout
from .fused import (
    LOG2_E,
    decay_mask,
    from_chunks,
    gate_cumsum,
    gate_vectors,
    pad_g_cum,
    to_chunks,
)
from .recurrent import compute_dtype

__all__ = [
    "slot_indices",
    "chunks_to_slots",
    "slots_to_chunks",
    "forward_slot_products",
    "a_from_a_beta",
    "recompute_states",
    "chunk_bwd_fused",
    "reverse_chunk_cumsum",
    "fused_gated_delta_rule_bwd",
]

def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def _round(x: torch.Tensor, dtype) -> torch.Tensor:
    """x rounded to `dtype` and back (None: unchanged)."""
    return x if dtype is None else x.to(dtype).to(x.dtype)


def _round_tile_scaled(x: torch.Tensor, dtype) -> torch.Tensor:
    """x rounded to `dtype` and back after a power-of-two scale per tile (the last two dimensions) that
    puts the tile's largest magnitude in [2^14, 2^15), undone after the rounding (None: unchanged). A
    power of two scales exactly, so only the rounding at the target's full precision remains, at
    any magnitude of x: the model of an fp16 operand tile stored with its own exponent (a
    max-reduction and a multiply per tile in a kernel; derivation RW-7's argument for the forward's
    row scales). Zero tiles stay zero."""
    if dtype is None:
        return x
    amax = x.abs().amax(dim=(-2, -1), keepdim=True)
    e = torch.floor(torch.log2(torch.where(amax > 0, amax, torch.ones_like(amax))))  # a zero tile: e = 0
    s = torch.exp2(14 - e)
    return (x * s).to(dtype).to(x.dtype) / s


# ----------------------------------------------------------------------------------------------
# Slot layout of the sm_90 forward's intermediates
# ----------------------------------------------------------------------------------------------


def slot_indices(lay: ChunkLayout, cu_seqlens=None) -> torch.Tensor:
    """[NC] int64: the kernel slot of every reference chunk (slot(n, c) = n * NT + c, or
    floor(cu[n] / 64) + n + c packed; `flashqla.ops.gdn.kernels.sm90._common`). Reads cu_seqlens on
    the host (a reference helper)."""
    if cu_seqlens is None:
        return lay.seq * lay.NT + lay.pos
    cu = cu_seqlens.to("cpu", torch.int64)
    return (cu[lay.seq] // lay.C + lay.seq + lay.pos).to(lay.seq.device)


def _num_slots(lay: ChunkLayout, cu_seqlens) -> int:
    return lay.T // lay.C + lay.N if cu_seqlens is not None else lay.B * lay.NT


def chunks_to_slots(xc: torch.Tensor, lay: ChunkLayout, cu_seqlens=None, fill: float = 0.0) -> torch.Tensor:
    """Chunk tensor [NC, HV, C, ...] -> slot-major [HV, S * C, ...]; slots no chunk uses hold `fill`."""
    S = _num_slots(lay, cu_seqlens)
    out = torch.full((S, *xc.shape[1:]), fill, dtype=xc.dtype, device=xc.device)
    out[slot_indices(lay, cu_seqlens)] = xc
    out = out.transpose(0, 1)  # [HV, S, C, ...]
    return out.reshape(out.shape[0], S * lay.C, *out.shape[3:])


def slots_to_chunks(xs: torch.Tensor, lay: ChunkLayout, cu_seqlens=None) -> torch.Tensor:
    """Slot-major [HV, S * C, ...] -> chunk tensor [NC, HV, C, ...] (the reference's chunk order)."""
    HV = xs.shape[0]
    x = xs.reshape(HV, xs.shape[1] // lay.C, lay.C, *xs.shape[2:])
    return x[:, slot_indices(lay, cu_seqlens)].transpose(0, 1)


def forward_slot_products(k, g, beta, HV: int, cu_seqlens=None, chunk_size: int = 64, dtype=None):
    """What the sm_90 prepare kernel stores, from the reference: (A_beta [HV, S*C, C], g_cum_log2 [HV, S*C]).

    A_beta = A diag(beta) with FLA's gated A (`reference.gdn.chunk.solve_tril`), rows past a
    sequence's end zero; g_cum_log2 = chunk-local cumsum of the floored g, / ln 2, repeating the last
    valid value past the end. Computed in the compute dtype of the inputs; `dtype` rounds A_beta to
    that dtype (the kernel stores it in q's dtype; g_cum_log2 stays in the compute dtype).

    k: [B, T, H, K]; g, beta: [B, T, HV]; cu_seqlens: None or [N + 1] offsets.
    """
    cdt = compute_dtype(k, g, beta)
    lay = prepare_chunk_layout(k.shape[0], k.shape[1], cu_seqlens, chunk_size, k.device)
    gc = gate_cumsum(to_chunks(floor_gates(g), lay, dtype=cdt))  # padding g = 0: repeats the last value
    kc, bc = to_chunks(k, lay, HV, cdt), to_chunks(beta, lay, dtype=cdt)
    Lg = bc[..., None] * (kc @ _t(kc)) * decay_mask(gc, strict=True)
    eye = torch.eye(lay.C, dtype=cdt, device=k.device)
    A = torch.linalg.solve_triangular(eye + Lg, eye.expand_as(Lg), upper=False, unitriangular=True)
    A_beta = torch.where(lay.valid[:, None, :, None], A * bc[..., None, :], torch.zeros((), dtype=cdt))
    A_beta = _round(A_beta, dtype)
    return chunks_to_slots(A_beta, lay, cu_seqlens), chunks_to_slots(gc * LOG2_E, lay, cu_seqlens)


# ----------------------------------------------------------------------------------------------
# Stages
# ----------------------------------------------------------------------------------------------


def a_from_a_beta(A_beta: torch.Tensor, k: torch.Tensor, g_cum: torch.Tensor, *, log2: bool = False) -> torch.Tensor:
    """FLA's gated A = (I + L)^-1 from the stored A diag(beta): A = I - A_beta Kg, Kg = (K K^T) * Gamma_strict
    (BWD-Abeta: A (I + diag(beta) Kg) = I). One product, no inverse, no division by beta (beta may be 0).

    A_beta: [NC, HV, C, C]; k: [NC, HV, C, K]; g_cum: [NC, HV, C]. Returns [NC, HV, C, C]."""
    Kg = (k @ _t(k)) * decay_mask(g_cum, strict=True, log2=log2)
    return torch.eye(k.shape[-2], dtype=k.dtype, device=k.device) - A_beta @ Kg


def recompute_states(k, v, A_beta, g_cum, h0, lay: ChunkLayout, *, log2: bool = False, h_dtype=None):
    """Pass 1: the chunk-start states h [NC, HV, K, V] (FLA's h), sequential per (sequence, value head).

    S' = gamma_C S + K^T diag(r) v_new with v_new = A_beta (V - D K S) (RW-2, CF-2), in the compute
    dtype; the stored h (and only the stored h: the carried state stays exact) is rounded to `h_dtype`.
    k: [NC, HV, C, K]; v: [NC, HV, C, V]; A_beta: [NC, HV, C, C]; g_cum: [NC, HV, C];
    h0: [N, HV, K, V] (zeros for no initial state). Returns h [NC, HV, K, V].
    """
    gamma, gamma_C, r = gate_vectors(g_cum, log2=log2)
    S = h0.clone()
    h = torch.zeros(lay.NC, *h0.shape[1:], dtype=h0.dtype, device=h0.device)
    for ids in lay.chunks_at:
        sq = lay.seq[ids]
        S0 = S[sq]
        h[ids] = _round(S0, h_dtype)
        vn = A_beta[ids] @ (v[ids] - gamma[ids][..., None] * (k[ids] @ S0))
        S[sq] = gamma_C[ids][..., None, None] * S0 + _t(k[ids]) @ (r[ids][..., None] * vn)
    return h


def chunk_bwd_fused(q, k, v, beta, A_beta, g_cum, h, dh, do, scale: float, *, last=None, log2: bool = False,
                    ds_dtype=None, operand_dtype=None, A_beta_vd=None, dog_pair: bool = False,
                    exact_w: bool = False, operand_scale: bool = False, pair_dtype=None,
                    a_beta_pairs: bool = False) -> dict:
    """Pass 2, one chunk (all chunks at once here; the kernel walks them in reverse): every gradient of
    the chunk from its chunk-start state h and the gradient dh of its chunk-end state.

    Args:
        q, k: [NC, HV, C, K] (per value head); v, do: [NC, HV, C, V]; beta: [NC, HV, C];
        A_beta: [NC, HV, C, C] the forward's A diag(beta); g_cum: [NC, HV, C] (base 2 with log2=True);
        h: [NC, HV, K, V] chunk-start states; dh: [NC, HV, K, V] gradient of the chunk-end state;
        scale: float. last: None (C - 1) or [NC] int64, the last valid position of each chunk: the
        terms of dG that belong to the chunk end go there, so that in a partial chunk they do not
        cancel O(1) terms across the padding slots (2.6e-4 relative error in dg on a g = -30 head,
        fp64, when placed at C - 1). ds_dtype: rounds dh where it is a product operand (the
        kernel's bf16 copy). operand_dtype: rounds every other operand the sm_90 kernel
        (`flashqla/ops/gdn/kernels/sm90/chunk_bwd.py`) feeds to a tensor-core product from shared
        memory (Kg, A, Pg, W, v_new, dv_new, X, dLk, diag(beta) dLk, -D dv, scale M, scale D dO):
        a model of the kernel's roundings (None: exact). A_beta_vd: None (A_beta) or the A diag(beta)
        that dv = A_beta^T dv_new uses (the kernels' exact diagonal: beta on it, while v_new and
        A = I - A_beta Kg keep the stored one). dog_pair: in dh_prev, the scaled dO as the pair of
        its operand rounding and the rounding of the remainder (the sm_90 kernel's option "l",
        `chunk_bwd.OPTS`), instead of its operand rounding alone. exact_w: dbeta's rows
        rowsum(X * W) take W as computed (the compute dtype) instead of its operand rounding, which
        v_new's product keeps (no kernel builds it: `benchmarks/journal/backward.md`, "dbeta with W
        in fp32"). operand_scale: each operand rounding (operand_dtype, and ds_dtype for dh) takes a
        power-of-two scale per [rows, columns] tile first (`_round_tile_scaled`: fp16 operands that
        keep their precision at any magnitude of do and dht; no kernel builds it,
        `benchmarks/journal/accuracy.md`, "fp16 operands with a scale per tile").
        pair_dtype: None (every product as above), or the dtype of the products whose two operands the
        kernel computes (X = A^T dv_new, v_new D^T, X v_new^T), each such operand rounded to it for
        those products and to operand_dtype (ds_dtype for D) for the others: a wgmma takes both
        operands in one dtype, and the other products read a tile that arrives in the input's dtype.
        a_beta_pairs: A_beta is stored in pair_dtype (the forward's `a_dtype`), so its three products
        (A_beta Kg, A_beta W, A_beta^T dv_new) take their other operand in pair_dtype too.

    Returns dict of chunk tensors: dq, dk [NC, HV, C, K] (per value head, before the GVA sum);
    dv [NC, HV, C, V]; dbeta [NC, HV, C]; dG [NC, HV, C] (dL/dg_cum per position, before the
    reverse cumsum); dh_prev [NC, HV, K, V] (gradient of the chunk-start state); v_new [NC, HV, C, V].
    """
    C = k.shape[-2]
    cdt = k.dtype
    gamma, gamma_C, r = gate_vectors(g_cum, log2=log2)
    Gam = decay_mask(g_cum, log2=log2)
    Gs = decay_mask(g_cum, strict=True, log2=log2)
    D = dh
    rnd = _round_tile_scaled if operand_scale else _round
    Dop = rnd(D, ds_dtype)
    o_ = lambda x: rnd(x, operand_dtype)  # noqa: E731
    p_ = o_ if pair_dtype is None else (lambda x: rnd(x, pair_dtype))  # noqa: E731
    a_ = p_ if a_beta_pairs else o_  # the other operand of A_beta's products
    Dp = Dop if pair_dtype is None else rnd(D, pair_dtype)

    KK = k @ _t(k)
    Kg = KK * Gs
    Kg_r = a_(Kg)
    A = p_(torch.eye(C, dtype=cdt, device=k.device) - A_beta @ Kg_r)  # BWD-Abeta
    Avd = A_beta if A_beta_vd is None else A_beta_vd
    U = k @ h
    W = v - gamma[..., None] * U
    W_r = a_(W)
    v_new_x = A_beta @ W_r
    v_new, v_new_p = o_(v_new_x), p_(v_new_x)

    dv_new_x = o_(scale * ((q @ _t(k)) * Gam)).transpose(-1, -2) @ do + r[..., None] * (k @ Dop)
    X = _t(A) @ p_(dv_new_x)
    dv = _t(Avd) @ a_(dv_new_x)
    dvg = o_(-gamma[..., None] * dv)
    dog_x = scale * gamma[..., None] * do
    dog = o_(dog_x)
    dog_s = dog + o_(dog_x - dog) if dog_pair else dog  # hi + lo (two products in the kernel)
    dh_prev = gamma_C[..., None, None] * D + _t(q) @ dog_s + _t(k) @ dvg

    M = (do @ _t(v_new)) * Gam
    sM = o_(scale * M)
    dq_state = (dog @ _t(h)) / scale
    dq = scale * dq_state + sM @ k
    dk_state = r[..., None] * (v_new_p @ _t(Dp))
    dL = -torch.tril(p_(X) @ _t(v_new_p), -1)  # BWD-fused
    dLk = o_(dL * Gs)
    dLk_K = dLk @ k
    dk = dk_state + _t(sM) @ q + dvg @ _t(h) + beta[..., None] * dLk_K + _t(o_(beta[..., None] * dLk)) @ k
    dbeta = (X * (W if exact_w else W_r)).sum(-1) + (dLk_K * k).sum(-1)

    # dG, with the exactly-cancelling terms left out (see reference.gdn.chunk_bwd.chunk_bwd_dqkwg)
    Z = M * (q @ _t(k)) * torch.tril(torch.ones(C, C, dtype=torch.bool, device=k.device), -1)
    s = (dk_state * k).sum(-1)
    if last is None:
        last = torch.full(k.shape[:1], C - 1, dtype=torch.long, device=k.device)
    not_last = torch.arange(C, device=k.device) != last[:, None, None]  # [NC, 1, C]
    s_nl = torch.where(not_last, s, torch.zeros((), dtype=cdt))
    dLL = dL * (beta[..., None] * Kg_r)
    dG = (
        scale * ((dq_state * q).sum(-1) + Z.sum(-1) - Z.sum(-2))
        - s_nl
        - (dv * (gamma[..., None] * U)).sum(-1)
        + dLL.sum(-1)
        - dLL.sum(-2)
    )
    at_last = gamma_C * (h * D).sum((-2, -1)) + s_nl.sum(-1)
    dG = dG + torch.where(not_last, torch.zeros((), dtype=cdt), at_last[..., None])
    return dict(dq=dq, dk=dk, dv=dv, dbeta=dbeta, dG=dG, dh_prev=dh_prev, v_new=v_new)


def reverse_chunk_cumsum(dG: torch.Tensor) -> torch.Tensor:
    """Pass 3: dg_t = sum_{i >= t in the chunk} dG_i (BWD-dg). dG: [..., C] -> [..., C]."""
    return dG.flip(-1).cumsum(-1).flip(-1)


# ----------------------------------------------------------------------------------------------
# The whole backward
# ----------------------------------------------------------------------------------------------


def fused_gated_delta_rule_bwd(
    q, k, v, beta, A_beta, g_cum_log2, scale: float, initial_state, do, dht, cu_seqlens=None,
    *, g=None, chunk_size: int = 64, h_dtype=None, ds_dtype=None, operand_dtype=None, log2: bool = True,
    exact_diagonal: bool = False, dog_pair: bool = False, exact_w: bool = False, operand_scale: bool = False,
    pair_dtype=None, a_beta_pairs: bool = False,
):
    """The backward our kernels compute, end to end, from the sm_90 forward's slot-major products.

    Args:
        q, k: [B, T, H, K] as the forward used them (after any L2 norm); v: [B, T, HV, V];
        beta: [B, T, HV]; A_beta: [HV, S * C, C] (the forward's `A`, A diag(beta));
        g_cum_log2: [HV, S * C] (the forward's); scale: float; initial_state: None or [N, HV, K, V];
        do: [B, T, HV, V]; dht: None (0) or [N, HV, K, V]; cu_seqlens: None or [N + 1] offsets.
        h_dtype: storage dtype of the recomputed states (None: exact); ds_dtype: operand dtype of
        the state gradient in products (None: exact); operand_dtype: see `chunk_bwd_fused`. log2: run the stages in base 2 (the kernels).
        g: None, or the forward's per-token g [B, T, HV]: tokens with g < G_FLOOR (floored in the
        forward) get dg = 0, as `reference.gdn.op`.
        exact_diagonal: in dv = A_beta^T dv_new of pass 2, use beta itself (the compute dtype) on the
        diagonal of A diag(beta) instead of the stored value, as the sm_90 backward kernels do (the
        diagonal of (I + L)^-1 is exactly 1, so the stored diagonal is beta rounded to q's dtype;
        the kernels add diag(beta - stored) dv_new in fp32); pass 1, v_new and A = I - A_beta Kg
        keep the stored one (`benchmarks/journal/accuracy.md`, "The exact diagonal").
        dog_pair: see `chunk_bwd_fused` (the sm_90 kernel's option "l", built where dh0 is returned).
        operand_scale, pair_dtype, a_beta_pairs: see `chunk_bwd_fused` (a model only).
        exact_w: see `chunk_bwd_fused` (no kernel builds it).

    Returns:
        (dq [B, T, H, K], dk [B, T, H, K], dv [B, T, HV, V], dg [B, T, HV] (per token, natural log),
        dbeta [B, T, HV], dh0 [N, HV, K, V] or None when initial_state is None), in the compute dtype
        (fp64 if any input is fp64, else fp32). Gradients at padding slots are never formed in the
        output (from_chunks drops them).
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    cdt = compute_dtype(q, k, v, beta, g_cum_log2, initial_state, do, dht)
    lay = prepare_chunk_layout(B, T, cu_seqlens, chunk_size, q.device)
    qc, kc = to_chunks(q, lay, HV, cdt), to_chunks(k, lay, HV, cdt)
    vc, bc, doc = to_chunks(v, lay, dtype=cdt), to_chunks(beta, lay, dtype=cdt), to_chunks(do, lay, dtype=cdt)
    Ab = slots_to_chunks(A_beta, lay, cu_seqlens).to(cdt)
    Ab_vd = None
    if exact_diagonal:
        eye = torch.eye(Ab.shape[-1], dtype=torch.bool, device=Ab.device)
        Ab_vd = torch.where(eye, torch.diag_embed(bc), Ab)
    G2 = slots_to_chunks(g_cum_log2, lay, cu_seqlens).to(cdt)
    G = G2 if log2 else G2 / LOG2_E
    gk = dict(log2=log2)

    h0 = initial_state.to(cdt) if initial_state is not None else torch.zeros(lay.N, HV, K, V, dtype=cdt, device=q.device)
    h = recompute_states(kc, vc, Ab, G, h0, lay, h_dtype=h_dtype, **gk)

    Dn = dht.to(cdt).clone() if dht is not None else torch.zeros(lay.N, HV, K, V, dtype=cdt, device=q.device)
    names = ("dq", "dk", "dv", "dbeta", "dG")
    acc = {n: None for n in names}
    for ids in reversed(lay.chunks_at):
        sq = lay.seq[ids]
        out = chunk_bwd_fused(qc[ids], kc[ids], vc[ids], bc[ids], Ab[ids], G[ids], h[ids], Dn[sq], doc[ids], scale,
                              last=lay.length[ids] - 1, ds_dtype=ds_dtype, operand_dtype=operand_dtype,
                              A_beta_vd=None if Ab_vd is None else Ab_vd[ids], dog_pair=dog_pair, exact_w=exact_w,
                              operand_scale=operand_scale, pair_dtype=pair_dtype, a_beta_pairs=a_beta_pairs, **gk)
        for n in names:
            if acc[n] is None:
                acc[n] = torch.zeros(lay.NC, *out[n].shape[1:], dtype=cdt, device=q.device)
            acc[n][ids] = out[n]
        Dn[sq] = out["dh_prev"]
    if lay.NC == 0:  # no chunk at all (every sequence empty, or T == 0): zero token gradients
        shapes = {"dq": (HV, chunk_size, K), "dk": (HV, chunk_size, K), "dv": (HV, chunk_size, V),
                  "dbeta": (HV, chunk_size), "dG": (HV, chunk_size)}
        acc = {n: torch.zeros(0, *shapes[n], dtype=cdt, device=q.device) for n in names}
    dg = reverse_chunk_cumsum(acc["dG"])

    def gva(x):  # [B, T, HV, K] -> [B, T, H, K]
        return x.reshape(B, T, H, HV // H, x.shape[-1]).sum(3)

    dq = gva(from_chunks(acc["dq"], lay))
    dk = gva(from_chunks(acc["dk"], lay))
    dv = from_chunks(acc["dv"], lay)
    dgt = from_chunks(dg[..., None], lay).squeeze(-1)
    dbeta = from_chunks(acc["dbeta"][..., None], lay).squeeze(-1)
    if g is not None:  # a token whose g was floored has zero gradient in g (as the reference op)
        dgt = torch.where(g.to(cdt) < G_FLOOR, torch.zeros((), dtype=cdt), dgt)
    return dq, dk, dv, dgt, dbeta, (Dn if initial_state is not None else None)

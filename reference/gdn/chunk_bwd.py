"""FLA's chunked Gated DeltaNet backward, written out by hand, one function per FLA step.

Pipeline (FLA `chunk_gated_delta_rule_bwd`), per sequence and value head, chunks of C tokens, with
G = g_cum (natural log), gamma = exp(G), Gamma_rs = exp(G_r - G_s) (r >= s), E = exp(G_l - G), l the
last valid position of the chunk, S0 = h[n] (state at the chunk start), D = dh[n] (gradient of the
state at the chunk END):

    w, u              = recompute_w_u(...)                      (B0, recomputed from the saved A)
    h, v_new          = chunk_fwd_h(...)                         (B1, recomputed)
    dv                = chunk_bwd_dv_local(q, k, do, g_cum)      (B2) scale (K Q^T * Gamma^T) dO
    dh, dh0, dv2      = chunk_bwd_dhu(...)                       (B3) reverse state pass:
                          dv2 = dv + diag(E) K D;  D <- exp(G_l) D + scale Q^T diag(gamma) dO - W^T dv2
    dq, dk, dw, dg    = chunk_bwd_dqkwg(...)                     (B4) gradients through o and the state update
    dk2, dv, db, dg2  = prepare_wy_repr_bwd(..., dw, du=dv2)     (B5) gradients through w, u and A = (I + L)^-1
    dg                = chunk_local_cumsum(dg + dg2, reverse=True)  (B6) dL/dg from dL/dg_cum

The formulas are those of research/fla-gdn.md section 3.1 (checked there against finite differences,
and here against autograd of the fp64 recurrence). Gate exponents are masked before `exp`, as in the
forward. Every quantity is computed in fp64 when any input is fp64, else fp32. GVA: dq and dk are
summed over each group of HV // H value heads; everything else stays per value head.

Source: FLA `fla/ops/gated_delta_rule/chunk.py` (`chunk_gated_delta_rule_bwd`),
`fla/ops/common/chunk_o.py` (`chunk_bwd_dv_local`, `chunk_bwd_dqkwg`),
`fla/ops/common/chunk_delta_h.py` (`chunk_gated_delta_rule_bwd_dhu`),
`fla/ops/gated_delta_rule/wy_fast.py` (`prepare_wy_repr_bwd`).
"""

from __future__ import annotations

import torch

from .chunk import (
    layout_like,
    chunk_fwd_h,
    chunk_local_cumsum,
    decay_matrix,
    gate_factors,
    gate_first,
    heads_first,
    recompute_w_u,
    scatter_heads,
    sum_groups,
)
from .recurrent import compute_dtype

__all__ = [
    "chunk_bwd_dv_local",
    "chunk_bwd_dhu",
    "chunk_bwd_dqkwg",
    "prepare_wy_repr_bwd",
    "chunk_gated_delta_rule_bwd",
]


def _t(x: torch.Tensor) -> torch.Tensor:
    return x.transpose(-1, -2)


def chunk_bwd_dv_local(
    q: torch.Tensor,
    k: torch.Tensor,
    do: torch.Tensor,
    g_cum: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
) -> torch.Tensor:
    """Intra-chunk part of dL/dv_new (FLA step B2).

    dv_s = scale * sum_{r >= s in s's chunk} (k_s . q_r) exp(G_r - G_s) do_r.

    Args:
        q, k: [B, T, H, K]; do: [B, T, HV, V] (gradient of o); g_cum: [B, T, HV] natural-log
        chunk-local cumsum; scale: the forward's output scale. chunk_size, cu_seqlens as the forward.

    Returns:
        dv: [B, T, HV, V] in the compute dtype (fp64 if any input is fp64, else fp32).

    Raises:
        ValueError: chunk_size not a positive int. Shapes are not checked here (a stage, fed by
            the validated entry points).

    Source: FLA `chunk_bwd_dv_local` (fla/ops/common/chunk_o.py).
    """
    HV = do.shape[2]
    cdt = compute_dtype(q, k, do, g_cum)
    lay = layout_like(q, cu_seqlens, chunk_size)
    qc, kc, doc = heads_first(q, lay, cdt, HV), heads_first(k, lay, cdt, HV), heads_first(do, lay, cdt)
    G = gate_first(g_cum, lay, cdt)
    P = (kc @ _t(qc)) * _t(decay_matrix(G, lay, strict=False))  # [NC, HV, C(s), C(r)]
    return scatter_heads(scale * (P @ doc), lay)


def chunk_bwd_dhu(
    q: torch.Tensor,
    k: torch.Tensor,
    w: torch.Tensor,
    g_cum: torch.Tensor,
    initial_state: torch.Tensor | None,
    dht: torch.Tensor | None,
    do: torch.Tensor,
    dv: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
):
    """The reverse inter-chunk pass (FLA step B3), sequential over chunks from last to first.

    With D = dL/d(state at the end of the chunk), starting from dht (or 0) at each sequence's end:
        dh[n] = D;  dv2 = dv + diag(E) K D;  D <- exp(G_l) D + scale Q^T diag(exp(G)) dO - W^T dv2.
    After a sequence's first chunk D is dL/d(initial_state).

    Args:
        q, k: [B, T, H, K]; w: [B, T, HV, K] (`recompute_w_u`); g_cum: [B, T, HV];
        initial_state: None or [N, HV, K, V] (only decides whether dh0 is returned);
        dht: None (0) or [N, HV, K, V], gradient of the final state; do: [B, T, HV, V];
        dv: [B, T, HV, V] from `chunk_bwd_dv_local`; scale: float. chunk_size, cu_seqlens as the
        forward.

    Returns:
        dh: [B, NT, HV, K, V], the state gradient at the END of each chunk (FLA's layout as `h`);
        dh0: [N, HV, K, V] or None when initial_state is None (an empty sequence passes dht through);
        dv2: [B, T, HV, V], the total dL/dv_new.
        All in the compute dtype.

    Raises:
        ValueError: chunk_size not a positive int. Shapes are not checked here (a stage, fed by
            the validated entry points).

    Source: FLA `chunk_gated_delta_rule_bwd_dhu` (fla/ops/common/chunk_delta_h.py).
    """
    HV, K, V = w.shape[2], q.shape[3], do.shape[3]
    cdt = compute_dtype(q, k, w, g_cum, initial_state, dht, do, dv)
    lay = layout_like(q, cu_seqlens, chunk_size)
    qc, kc, wc = heads_first(q, lay, cdt, HV), heads_first(k, lay, cdt, HV), heads_first(w, lay, cdt)
    doc, dvc = heads_first(do, lay, cdt), heads_first(dv, lay, cdt)
    gamma, gamma_last, E = gate_factors(gate_first(g_cum, lay, cdt), lay)
    qg = _t(qc) @ (gamma[..., None] * doc)  # [NC, HV, K, V]: Q^T diag(gamma) dO
    if dht is not None:
        D = dht.to(cdt).clone()
    else:
        D = torch.zeros(lay.N, HV, K, V, dtype=cdt, device=q.device)
    dh = torch.empty(lay.NC, HV, K, V, dtype=cdt, device=q.device)
    dv2 = torch.empty_like(dvc)
    for ids in reversed(lay.chunks_at):
        sq = lay.seq[ids]
        Dj = D[sq]
        dv2j = dvc[ids] + E[ids][..., None] * (kc[ids] @ Dj)
        dh[ids] = Dj
        dv2[ids] = dv2j
        D[sq] = gamma_last[ids][..., None, None] * Dj + scale * qg[ids] - _t(wc[ids]) @ dv2j
    dh = dh.view(lay.B, lay.NT, HV, K, V)
    return dh, (D if initial_state is not None else None), scatter_heads(dv2, lay)


def chunk_bwd_dqkwg(
    q: torch.Tensor,
    k: torch.Tensor,
    v_new: torch.Tensor,
    w: torch.Tensor,
    g_cum: torch.Tensor,
    h: torch.Tensor,
    dv: torch.Tensor,
    do: torch.Tensor,
    dh: torch.Tensor,
    scale: float,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
):
    """Gradients through the output and the state update (FLA step B4).

    Per chunk, S0 = h[n], D = dh[n], M = (dO v_new^T) * Gamma (causal, diagonal included):
        dw = -dv S0^T                                      (FLA writes it with the minus sign)
        dq = scale (diag(gamma) dO S0^T + M K)
        dk = diag(E) v_new D^T + scale M^T Q
        dg = rowsum(dq * Q) - rowsum(dk * K), plus at l: gamma_l <S0, D> + sum(diag(E) v_new D^T * K)
    (dg is dL/dg_cum through o and the state update; dq, dk per value head before the GVA sum).
    The dg terms that cancel exactly in that form (the diagonal of Gamma, and E at r == l, are 1
    and do not depend on G) are left out: the same value up to rounding, but accurate to the last
    digits where dg is tiny (strong decay), where FLA's form loses it to cancellation.

    Args:
        q, k: [B, T, H, K]; v_new: [B, T, HV, V]; w: [B, T, HV, K]; g_cum: [B, T, HV];
        h: [B, NT, HV, K, V] chunk-start states; dv: [B, T, HV, V] the total dL/dv_new (dv2 of
        `chunk_bwd_dhu`); do: [B, T, HV, V]; dh: [B, NT, HV, K, V] chunk-end state gradients;
        scale: float. chunk_size, cu_seqlens as the forward.

    Returns:
        (dq [B, T, H, K], dk [B, T, H, K], dw [B, T, HV, K], dg [B, T, HV]) in the compute dtype;
        dq and dk summed over each GVA group.

    Raises:
        ValueError: chunk_size not a positive int. Shapes are not checked here (a stage, fed by
            the validated entry points).

    Source: FLA `chunk_bwd_dqkwg` (fla/ops/common/chunk_o.py); its dg is in natural units already.
    """
    H, K = q.shape[2], q.shape[3]
    HV, V = v_new.shape[2], v_new.shape[3]
    cdt = compute_dtype(q, k, v_new, w, g_cum, h, dv, do, dh)
    lay = layout_like(q, cu_seqlens, chunk_size)
    qc, kc = heads_first(q, lay, cdt, HV), heads_first(k, lay, cdt, HV)
    vn, dvc, doc = heads_first(v_new, lay, cdt), heads_first(dv, lay, cdt), heads_first(do, lay, cdt)
    S0 = h.to(cdt).reshape(lay.NC, HV, K, V)
    D = dh.to(cdt).reshape(lay.NC, HV, K, V)
    G = gate_first(g_cum, lay, cdt)
    gamma, gamma_last, E = gate_factors(G, lay)

    M = (doc @ _t(vn)) * decay_matrix(G, lay, strict=False)
    dw = -(dvc @ _t(S0))
    dq_state = gamma[..., None] * (doc @ _t(S0))
    dq = scale * (dq_state + M @ kc)
    dk_state = E[..., None] * (vn @ _t(D))
    dk = dk_state + scale * (_t(M) @ qc)

    # dg = rowsum(dq * Q) - rowsum(dk * K) + at l: gamma_l <S0, D> + sum(dk_state * K), written with
    # the terms that cancel exactly left out: the diagonal of Gamma (r == s) and E at r == l are 1 and
    # do not depend on G, yet FLA's form adds and subtracts their O(1) products. Leaving them out
    # changes only rounding, and keeps dg accurate where it is tiny (strong decay).
    last = lay.last()[:, None, None].expand(-1, HV, 1)
    not_last = lay.valid[:, None, :] & (torch.arange(lay.C, device=q.device) != last)
    Z = M * (qc @ _t(kc)) * lay.causal_mask(strict=True)  # off-diagonal pair terms
    s = torch.where(not_last, (dk_state * kc).sum(-1), torch.zeros((), dtype=cdt, device=q.device))
    dg = scale * ((dq_state * qc).sum(-1) + Z.sum(-1) - Z.sum(-2)) - s
    at_last = gamma_last * (S0 * D).sum((-2, -1)) + s.sum(-1)  # [NC, HV]
    dg = dg.scatter_add(-1, last, at_last[..., None])
    return (
        sum_groups(scatter_heads(dq, lay), H),
        sum_groups(scatter_heads(dk, lay), H),
        scatter_heads(dw, lay),
        scatter_heads(dg[..., None], lay).squeeze(-1),
    )


def prepare_wy_repr_bwd(
    k: torch.Tensor,
    v: torch.Tensor,
    beta: torch.Tensor,
    g_cum: torch.Tensor,
    A: torch.Tensor,
    dw: torch.Tensor,
    du: torch.Tensor,
    chunk_size: int = 64,
    cu_seqlens: torch.Tensor | None = None,
):
    """Gradients through w = A diag(beta gamma) K, u = A diag(beta) V and A = (I + L)^-1 (FLA step B5).

    With Kbg = diag(beta gamma) K, Vb = diag(beta) V:
        dA = dw Kbg^T + du Vb^T;  dKbg = A^T dw;  dVb = A^T du
        dL = -strictly_lower(A^T dA A^T);  dLk = dL * Gamma_strict
        dk = diag(beta gamma) dKbg + diag(beta) dLk K + dLk^T diag(beta) K
        dv = diag(beta) dVb
        dbeta = gamma * rowsum(dKbg * K) + rowsum(dVb * V) + rowsum((dLk K) * K)
        dg = rowsum(dKbg * Kbg) + rowsum(dL * L) - colsum(dL * L)

    Args:
        k: [B, T, H, K]; v: [B, T, HV, V]; beta: [B, T, HV]; g_cum: [B, T, HV]; A: [B, T, HV, C]
        from the forward; dw: [B, T, HV, K]; du: [B, T, HV, V] (dv2 of `chunk_bwd_dhu`).
        chunk_size, cu_seqlens as the forward.

    Returns:
        (dk [B, T, H, K] summed over GVA groups, dv [B, T, HV, V], dbeta [B, T, HV],
        dg [B, T, HV] = dL/dg_cum through w and A) in the compute dtype.

    Raises:
        ValueError: chunk_size not a positive int. Shapes are not checked here (a stage, fed by
            the validated entry points).

    Source: FLA `prepare_wy_repr_bwd` (fla/ops/gated_delta_rule/wy_fast.py).
    """
    H = k.shape[2]
    HV = v.shape[2]
    cdt = compute_dtype(k, v, beta, g_cum, A, dw, du)
    lay = layout_like(k, cu_seqlens, chunk_size)
    kc, vc = heads_first(k, lay, cdt, HV), heads_first(v, lay, cdt)
    Ac, dwc, duc = heads_first(A, lay, cdt), heads_first(dw, lay, cdt), heads_first(du, lay, cdt)
    bc, G = gate_first(beta, lay, cdt), gate_first(g_cum, lay, cdt)
    gamma, _, _ = gate_factors(G, lay)
    Gam = decay_matrix(G, lay, strict=True)

    bg = bc * gamma
    Kbg, Kb, Vb = bg[..., None] * kc, bc[..., None] * kc, bc[..., None] * vc
    dKbg, dVb = _t(Ac) @ dwc, _t(Ac) @ duc
    dA = dwc @ _t(Kbg) + duc @ _t(Vb)
    strict = lay.causal_mask(strict=True)
    dL = torch.where(strict, -(_t(Ac) @ dA @ _t(Ac)), torch.zeros((), dtype=cdt, device=k.device))
    dLk = dL * Gam
    dLk_K = dLk @ kc
    dk = bg[..., None] * dKbg + bc[..., None] * dLk_K + _t(dLk) @ Kb
    dv = bc[..., None] * dVb
    dbeta = gamma * (dKbg * kc).sum(-1) + (dVb * vc).sum(-1) + (dLk_K * kc).sum(-1)
    dLL = dL * ((Kb @ _t(kc)) * Gam)  # dL * L
    dg = (dKbg * Kbg).sum(-1) + dLL.sum(-1) - dLL.sum(-2)
    return (
        sum_groups(scatter_heads(dk, lay), H),
        scatter_heads(dv, lay),
        scatter_heads(dbeta[..., None], lay).squeeze(-1),
        scatter_heads(dg[..., None], lay).squeeze(-1),
    )


def chunk_gated_delta_rule_bwd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g_cum: torch.Tensor,
    beta: torch.Tensor,
    A: torch.Tensor,
    scale: float,
    initial_state: torch.Tensor | None,
    do: torch.Tensor,
    dht: torch.Tensor | None,
    cu_seqlens: torch.Tensor | None = None,
    chunk_size: int = 64,
):
    """FLA's chunked backward: recomputes w, u, h, v_new from the saved A, then steps B2-B6.

    Args:
        q, k: [B, T, H, K] as used by the forward (after any L2 norm); v: [B, T, HV, V];
        g_cum: [B, T, HV] natural-log chunk-local cumsum (the forward's); beta: [B, T, HV];
        A: [B, T, HV, C] (the forward's); scale: float; initial_state: None or [N, HV, K, V];
        do: [B, T, HV, V] gradient of o; dht: None (0) or [N, HV, K, V] gradient of final_state;
        cu_seqlens: None or [N + 1] offsets (B == 1); chunk_size: C (the forward's).

    Returns:
        (dq [B, T, H, K], dk [B, T, H, K], dv [B, T, HV, V], dg [B, T, HV] (dL/dg, per token, natural
        log), dbeta [B, T, HV], dh0 [N, HV, K, V] or None when initial_state is None), in the compute
        dtype (fp64 if any input is fp64, else fp32). No argument checks: inputs come from the forward.

    Source: FLA `chunk_gated_delta_rule_bwd` (fla/ops/gated_delta_rule/chunk.py).
    """
    cs = dict(chunk_size=chunk_size, cu_seqlens=cu_seqlens)
    w, u = recompute_w_u(k, v, beta, A, g_cum, **cs)
    h, v_new, _ = chunk_fwd_h(k, w, u, g_cum, initial_state, False, **cs)
    dv_local = chunk_bwd_dv_local(q, k, do, g_cum, scale, **cs)
    dh, dh0, dv2 = chunk_bwd_dhu(q, k, w, g_cum, initial_state, dht, do, dv_local, scale, **cs)
    dq, dk, dw, dg = chunk_bwd_dqkwg(q, k, v_new, w, g_cum, h, dv2, do, dh, scale, **cs)
    dk2, dv, dbeta, dg2 = prepare_wy_repr_bwd(k, v, beta, g_cum, A, dw, dv2, **cs)
    dg = chunk_local_cumsum(dg + dg2, reverse=True, **cs)
    return dq, dk + dk2, dv, dg, dbeta, dh0

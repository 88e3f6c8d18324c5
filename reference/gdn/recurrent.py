"""The token-by-token Gated DeltaNet recurrence: the ground truth every other face is checked against.

Per sequence, per value head hv (q/k head hv // (HV // H)), per token t:

    S_t = exp(g_t) S_{t-1}
    u_t = beta_t (v_t - S_t^T k_t)
    S_t = S_t + k_t u_t^T                  (so S_t = exp(g_t)(I - beta_t k_t k_t^T) S_{t-1} + beta_t k_t v_t^T)
    o_t = scale * S_t^T q_t                (inclusive of token t)

This is FLA's `naive_recurrent_gated_delta_rule` ordering ("forget before error"). Plain PyTorch,
differentiable by autograd, any floating dtype; computed in fp64 when the inputs are fp64 and in
fp32 otherwise.
"""

from __future__ import annotations

import torch

from flashqla.contract import check_gdn_inputs

__all__ = ["recurrent_gated_delta_rule", "l2norm", "compute_dtype", "seq_bounds"]

L2NORM_EPS = 1e-6


def l2norm(x: torch.Tensor, eps: float = L2NORM_EPS) -> torch.Tensor:
    """`x / sqrt(sum(x^2) + eps)` over the last dimension (FLA's in-kernel L2 norm)."""
    return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + eps)


def compute_dtype(*xs: torch.Tensor) -> torch.dtype:
    """fp64 if any input is fp64, else fp32: the arithmetic dtype of the reference."""
    return torch.float64 if any(x is not None and x.dtype == torch.float64 for x in xs) else torch.float32


def seq_bounds(B: int, T: int, cu_seqlens: torch.Tensor | None) -> list[tuple[int, int, int]]:
    """(batch index, start, end) of each sequence: B rows of [0, T), or the spans of cu_seqlens."""
    if cu_seqlens is None:
        return [(b, 0, T) for b in range(B)]
    cu = cu_seqlens.detach().to("cpu", torch.int64).tolist()
    return [(0, cu[n], cu[n + 1]) for n in range(len(cu) - 1)]


def recurrent_gated_delta_rule(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    output_final_state: bool = False,
    cu_seqlens: torch.Tensor | None = None,
    use_qk_l2norm_in_kernel: bool = False,
):
    """Gated DeltaNet by the token recurrence (ground truth).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0); any float dtype, one dtype.
        g: [B, T, HV], natural-log decay per token, <= 0.
        beta: [B, T, HV], the write strength (sigmoid output, in [0, 1]).
        scale: output scale, default K ** -0.5.
        initial_state: [N, HV, K, V] or None (zeros).
        output_final_state: also return the state after each sequence's last token.
        cu_seqlens: [N + 1] int32/int64 offsets of packed sequences (B == 1), or None.
        use_qk_l2norm_in_kernel: L2-normalise q and k per head first (eps 1e-6 inside the sqrt).

    Returns:
        (o, final_state): o [B, T, HV, V] in q's dtype; final_state [N, HV, K, V] in the compute
        dtype (fp64 for fp64 inputs, else fp32), or None.

    Raises:
        TypeError, ValueError: see `flashqla.contract.check_gdn_inputs` (values are checked,
        positive g included).

    Source: FLA `naive_recurrent_gated_delta_rule`; DESIGN.md section 1.
    """
    d = check_gdn_inputs(q, k, v, g, beta, scale, initial_state, output_final_state, cu_seqlens, check_values=True)
    scale = d.K**-0.5 if scale is None else float(scale)
    cdt = compute_dtype(q, initial_state)
    if use_qk_l2norm_in_kernel:
        q, k = l2norm(q.to(cdt)), l2norm(k.to(cdt))
    qe = q.to(cdt).repeat_interleave(d.group, dim=2)  # [B, T, HV, K]
    ke = k.to(cdt).repeat_interleave(d.group, dim=2)
    ve, ge, be = v.to(cdt), g.to(cdt), beta.to(cdt)

    outs, finals = [], []
    for n, (b, bos, eos) in enumerate(seq_bounds(d.B, d.T, cu_seqlens)):
        if initial_state is not None:
            S = initial_state[n].to(cdt)
        else:
            S = torch.zeros(d.HV, d.K, d.V, dtype=cdt, device=q.device)
        for t in range(bos, eos):
            S = S * ge[b, t].exp()[:, None, None]
            kt = ke[b, t]
            u = be[b, t][:, None] * (ve[b, t] - torch.einsum("hkv,hk->hv", S, kt))
            S = S + kt[:, :, None] * u[:, None, :]
            outs.append((b, t, scale * torch.einsum("hkv,hk->hv", S, qe[b, t])))
        finals.append(S)
    if outs:
        o = torch.stack([x for _, _, x in outs]).reshape(len(outs), d.HV, d.V)
        index = [b * d.T + t for b, t, _ in outs]
        o_full = torch.zeros(d.B * d.T, d.HV, d.V, dtype=cdt, device=q.device)
        o_full = o_full.index_copy(0, torch.tensor(index, device=q.device), o)
        o = o_full.view(d.B, d.T, d.HV, d.V)
    else:
        o = torch.zeros(d.B, d.T, d.HV, d.V, dtype=cdt, device=q.device)
    if output_final_state:
        final = torch.stack(finals) if finals else torch.zeros(0, d.HV, d.K, d.V, dtype=cdt, device=q.device)
    else:
        final = None
    return o.to(q.dtype), final

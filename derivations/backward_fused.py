"""BWD-Abeta, BWD-fused: the backward in the form the sm_90 backward kernel computes it (`reference.gdn.fused_bwd`).

The forward keeps A_beta = A diag(beta) (FLA's gated A with beta folded into its columns) and no
state; the backward recovers A and collapses FLA's gradients through w, u and A:

    BWD-Abeta  A = I - A_beta Kg,   Kg = tril_-1(K K^T * Gamma)
          (A (I + diag(beta) Kg) = I: one product recovers A from the stored operand, no inverse and
          no division by beta, which may be 0)
    BWD-fused  with U = K S, W = V - D U, v_new = A_beta W, X = A^T dv_new:
          dv = A_beta^T dv_new
          dS = gamma_C dS' + scale Q^T D dO - K^T D dv
          dL = -tril_-1(X v_new^T)  (FLA's -tril_-1(A^T dA A^T): dA = dv_new W^T diag(beta))
          dk = diag(r) v_new dS'^T + scale M^T Q - D dv S^T + diag(beta) dLk K + dLk^T diag(beta) K
          dbeta = rowsum(X * W) + rowsum((dLk K) * K)
          dG = scale (rowsum(D dO S^T * Q) + rowsum(Z) - colsum(Z)) - rowsum(diag(r) v_new dS'^T * K)
               - rowsum(dv * D U) + rowsum(dL * L) - colsum(dL * L)
               + e_last [gamma_C <S, dS'> + sum(diag(r) v_new dS'^T * K)]
          with M = (dO v_new^T) * Gamma, Z = tril_-1(M * (Q K^T)), dLk = dL * Gamma, L = diag(beta) Kg
          (the form written with the exactly-cancelling r-term at the last position left out is the
          same expression; `reference.gdn.fused_bwd.chunk_bwd_fused`).

Each side of BWD-fused is checked against `sympy.diff` of the chunk's loss <dO, O> + <dS', S'> through
the token recurrence (the ground truth of the BWD records), with the cumulative gates c_i = exp(g_cum_i)
as symbols, so dG is c_i d loss / d c_i.
"""

from __future__ import annotations

import sympy as sp

from derivations._chunk import Chunk, cols_sum, hadamard, mat, rows_sum, tril
from derivations._core import Identity, register
from derivations.backward import _setup


def _kg(ch: Chunk) -> sp.Matrix:
    return tril(hadamard(ch.k * ch.k.T, ch.Gamma()), -1)


def _a_from_a_beta(C, K):
    ch = Chunk(C, K, 1)
    A = ch.A_gated()
    return A, sp.eye(C) - (A * ch.B) * _kg(ch)


def fused_backward(ch: Chunk, S: sp.Matrix, dO: sp.Matrix, dSn: sp.Matrix, scale) -> dict:
    """The per-chunk gradients of `reference.gdn.fused_bwd.chunk_bwd_fused` as SymPy matrices."""
    Q, K, V, D = ch.q, ch.k, ch.v, ch.D
    Gam, Kg = ch.Gamma(), _kg(ch)
    R = sp.diag(*ch.r)
    A_beta = ch.A_gated() * ch.B
    A = sp.eye(ch.C) - A_beta * Kg  # BWD-Abeta
    U = K * S
    W = V - D * U
    v_new = A_beta * W
    dv_new = scale * hadamard(K * Q.T, Gam.T) * dO + R * K * dSn
    X = A.T * dv_new
    dv = A_beta.T * dv_new
    dS = ch.gamma_C * dSn + scale * Q.T * D * dO - K.T * D * dv
    M = hadamard(dO * v_new.T, Gam)
    dq_state = D * dO * S.T
    dk_state = R * v_new * dSn.T
    dL = -tril(X * v_new.T, -1)
    dLk = hadamard(dL, Gam)
    dk = dk_state + scale * M.T * Q - D * dv * S.T + ch.B * dLk * K + dLk.T * ch.B * K
    dbeta = rows_sum(hadamard(X, W)) + rows_sum(hadamard(dLk * K, K))
    Z = tril(hadamard(M, Q * K.T), -1)
    dLL = hadamard(dL, ch.B * Kg)
    s = rows_sum(hadamard(dk_state, K))
    dG = (
        scale * (rows_sum(hadamard(dq_state, Q)) + rows_sum(Z) - cols_sum(Z))
        - s
        - rows_sum(hadamard(dv, D * U))
        + rows_sum(dLL)
        - cols_sum(dLL)
    )
    dG[ch.C - 1] += ch.gamma_C * sum(hadamard(S, dSn)) + sum(s)
    return dict(dv=dv, dS=dS, dk=dk, dbeta=dbeta, dG=dG)


def _fused_grads(C, K, V):
    ch, S, dO, dSn, scale, loss = _setup(C, K, V, gates="cumulative")
    ours = fused_backward(ch, S, dO, dSn, scale)
    g = lambda X: X.applyfunc(lambda x: sp.diff(loss, x))  # noqa: E731
    auto = (
        g(ch.v),
        g(S),
        g(ch.k),
        sp.Matrix([sp.diff(loss, b) for b in ch.beta]),
        sp.Matrix([c * sp.diff(loss, c) for c in ch.c]),
    )
    return auto, tuple(ours[n] for n in ("dv", "dS", "dk", "dbeta", "dG"))


register(Identity(
    id="BWD-Abeta",
    statement="gated A from the stored A diag(beta): A = I - A_beta tril_-1(K K^T * Gamma)",
    latex=r"A = I - (A B)\, \operatorname{tril}_{-1}(K K^\top \odot \Gamma)",
    build=_a_from_a_beta,
    sizes=((4, 2),),
    size_names=("C", "K"),
    twins=("reference.gdn.fused.regate", "reference.gdn.fused_bwd.a_from_a_beta"),
    source="ours (the sm_90 forward stores A diag(beta)); A (I + L) = I",
))

register(Identity(
    id="BWD-fused",
    statement="fused backward through v_new = A_beta W: dv, dS, dk, dbeta, dG with X = A^T dv_new and v_new (no w, u)",
    latex=r"dL = -\operatorname{tril}_{-1}(A^\top d\tilde V\, \tilde V^\top),\ dV = (AB)^\top d\tilde V,\ "
    r"d\beta = \operatorname{rowsum}(A^\top d\tilde V \odot W) + \operatorname{rowsum}(dL_k K \odot K)",
    build=_fused_grads,
    sizes=((3, 2, 2),),
    twins=("reference.gdn.recurrent.recurrent_gated_delta_rule", "reference.gdn.fused_bwd.fused_gated_delta_rule_bwd"),
    source="FLA chunk_gated_delta_rule_bwd (research/fla-gdn.md 3.1) rewritten; FlashQLA fused_bwd (research/flashqla-design.md 1.3)",
))

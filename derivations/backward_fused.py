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
          with M = (dO v_new^T) * Gamma, Z = tril_-1(M * (Q K^T)) = tril_-1(M) * (Q K^T), dLk = dL * Gamma,
          L = diag(beta) Kg
          (the form written with the exactly-cancelling r-term at the last position left out is the
          same expression; `reference.gdn.fused_bwd.chunk_bwd_fused`).

Each side of BWD-fused is checked against `sympy.diff` of the chunk's loss <dO, O> + <dS', S'> through
the token recurrence (the ground truth of the BWD records), with the cumulative gates c_i = exp(g_cum_i)
as symbols, so dG is c_i d loss / d c_i.

General proofs (every C, K, V): BWD-Abeta reduces A - (I - A_beta Kg) to zero with A (I + L_gated) = I
(Kg = D tril_-1(K K^T) D^-1 [L-gate]); BWD-fused compares `fused_backward` on the symbolic chunk with the
gradients derived at symbolic sizes (`derivations.backward.derived_gradients`), part by part.
"""

from __future__ import annotations

import sympy as sp

from ._chunk import Chunk, chunk_form, mat
from ._core import Identity, register
from .backward import BWD_USES, _setup, derived_gradients


def _kg(ch) -> sp.Matrix:
    """Kg = tril_-1(K K^T * Gamma)."""
    return ch.tril(ch.gate(ch.k * ch.k.T), -1)


def a_from_a_beta(ch):
    """A recovered from A_beta = A diag(beta): I - A_beta Kg."""
    return ch.eye(ch.C) - (ch.A_gated() * ch.B) * _kg(ch)


def _a_from_a_beta(C, K, form=a_from_a_beta):
    ch = Chunk(C, K, 1)
    return ch.A_gated(), form(ch)


def fused_backward(ch, S, dO, dSn, scale, dL_diagonal: int = -1) -> dict:
    """The per-chunk gradients of `reference.gdn.fused_bwd.chunk_bwd_fused`, for a concrete `Chunk` or a
    symbolic `derivations._symbolic.GChunk` (one code for both proofs). dL_diagonal: the mask of dL (-1;
    the tests shift it)."""
    Q, K, V, D = ch.q, ch.k, ch.v, ch.D
    Kg = _kg(ch)
    R = ch.Dr
    A_beta = ch.A_gated() * ch.B
    A = a_from_a_beta(ch)  # BWD-Abeta
    U = K * S
    W = V - D * U
    v_new = A_beta * W
    dv_new = scale * ch.gate_T(K * Q.T) * dO + R * K * dSn
    X = A.T * dv_new
    dv = A_beta.T * dv_new
    dS = ch.gamma_C * dSn + scale * Q.T * D * dO - K.T * D * dv
    M = ch.gate(dO * v_new.T)
    dq_state = D * dO * S.T
    dk_state = R * v_new * dSn.T
    dL = -ch.tril(X * v_new.T, dL_diagonal)
    dLk = ch.gate(dL)
    dk = dk_state + scale * M.T * Q - D * dv * S.T + ch.B * dLk * K + dLk.T * ch.B * K
    dbeta = ch.rowsum_had(X, W) + ch.rowsum_had(dLk * K, K)
    # Z = tril_-1(M * (Q K^T)): its rowsum and colsum, with tril_-1(M * Y) = tril_-1(M) * Y
    Mz, QK = ch.tril(M, -1), Q * K.T
    L = ch.B * Kg
    s_vec = ch.rowsum_had(dk_state, K)
    dG = (
        scale * (ch.rowsum_had(dq_state, Q) + ch.rowsum_had(Mz, QK) - ch.colsum_had(Mz, QK))
        - s_vec
        - ch.rowsum_had(dv, D * U)
        + ch.rowsum_had(dL, L)
        - ch.colsum_had(dL, L)
    )
    dG = ch.add_last(dG, ch.gamma_C * ch.sum_had(S, dSn) + ch.sum_had(dk_state, K))
    return dict(dv=dv, dS=dS, dk=dk, dbeta=dbeta, dG=dG)


def _fused_grads(C, K, V, dL_diagonal=-1):
    ch, S, dO, dSn, scale, loss = _setup(C, K, V, gates="cumulative")
    ours = fused_backward(ch, S, dO, dSn, scale, dL_diagonal)
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
    sizes=((4, 2), (8, 2)),
    size_names=("C", "K"),
    twins=("reference.gdn.fused.regate", "reference.gdn.fused_bwd.a_from_a_beta"),
    source="ours (the sm_90 forward stores A diag(beta)); A (I + L) = I",
    general=lambda: _general_a_beta(),
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
    general=lambda: _general_fused(),
))


# ------------------------------------------------------------------------------------------------
# general proofs
# ------------------------------------------------------------------------------------------------


def _general_a_beta(form=a_from_a_beta):
    from ._proof import Eq, Proof
    from ._symbolic import GChunk

    ch = GChunk()
    return Proof(
        claim="for every C, K: A_gated = I - (A_gated B) tril_-1(K K^T * Gamma), since A (I + B Kg) = I",
        method="L_gated = B Kg with Kg = D tril_-1(K K^T) D^-1 (L-gate); non-commutative reduction with A (I + L_gated) = I",
        uses=("L-gate", "L-ut"),
        steps=[Eq("A = I - A_beta Kg", ch.A_gated(), form(ch), ch.rules("gated"))],
    )


def _general_fused(dL_diagonal: int = -1):
    from ._nc import sym
    from ._proof import Eq, Proof
    from ._symbolic import GChunk, Ksym, Vsym

    ch = GChunk()
    S, dO, dSn = sym("S", Ksym, Vsym), sym("dO", ch.C, Vsym), sym("dSn", Ksym, Vsym)
    scale = sp.Symbol("scale", positive=True)
    ours = fused_backward(ch, S, dO, dSn, scale, dL_diagonal)
    auto = derived_gradients(ch, S, dO, dSn, scale, ["dv", "dh0", "dk", "dbeta", "dG"])
    rules = ch.rules("gated")
    return Proof(
        claim="for every C, K, V: the fused backward's dv, dS, dk, dbeta, dG equal the gradients of "
              "<dO, O> + <dS', S'> (dG with respect to the log cumulative gates)",
        method="the derived gradients of the BWD records (loss through the chunk form, CF-1 and CF-2; adjoints; "
               "dA = -A dL A); non-commutative reduction of fused minus derived with A (I + L_gated) = I, "
               "tril_0(A) = A, and A recovered from A diag(beta) (BWD-Abeta)",
        uses=BWD_USES + ("L-logdiag", "BWD-Abeta"),
        steps=[Eq(f"fused {n} = derived", ours[n], auto[m], rules)
               for n, m in (("dv", "dv"), ("dS", "dh0"), ("dk", "dk"), ("dbeta", "dbeta"), ("dG", "dG"))],
    )

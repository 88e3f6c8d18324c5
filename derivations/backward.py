"""BWD: the hand-written gradients of one chunk equal `sympy.diff` of the loss.

The loss of one chunk entered with state S (= h, FLA's state at the chunk start):

    loss = <dO, O> + <dS', S'>,     O, S' from the token recurrence (the ground truth)

with dO (C x V) and dS' (K x V, FLA's dht / dh of the next chunk) symbolic. The hand-written
gradients are FLA's per-chunk formulas (research/fla-gdn.md section 3.1), written with FLA's gated
A = (I + L)^-1, L = tril_-1(diag(beta)(K K^T * Gamma)), v_new = u - w S, E = r = gamma_C / gamma:

    dv_new = scale (K Q^T * Gamma^T) dO + diag(r) K dS'
    dh0    = gamma_C dS' + scale Q^T D dO - W^T dv_new
    M      = (dO v_new^T) * Gamma
    dq     = scale D dO S^T + scale M K
    dw     = -dv_new S^T,     dA = dw (diag(beta gamma) K)^T + dv_new (diag(beta) V)^T
    dL     = -tril_-1(A^T dA A^T),   dLk = dL * Gamma
    dk     = diag(r) v_new dS'^T + scale M^T Q + diag(beta gamma) A^T dw + diag(beta) dLk K + dLk^T diag(beta) K
    dv     = diag(beta) A^T dv_new
    dbeta  = gamma * rowsum((A^T dw) * K) + rowsum((A^T dv_new) * V) + rowsum((dLk K) * K)
    dG     = rowsum(dq * Q) - rowsum(dk_a * K) + rowsum((A^T dw) * diag(beta gamma) K)
             + rowsum(dL * L) - colsum(dL * L) + e_last [gamma_C <S, dS'> + sum(dk_s * K)]
             with dk_a = diag(r) v_new dS'^T + scale M^T Q, dk_s = diag(r) v_new dS'^T
    dg     = reverse cumsum of dG within the chunk

dG is the gradient with respect to the chunk-local cumulative gate g_cum (ln): with the cumulative
gates c_i = exp(g_cum_i) as independent symbols it is c_i d loss / d c_i (BWD-dG). With the token gates
a_t = exp(g_t), d loss / d g_t = a_t d loss / d a_t = sum_{i >= t} dG_i (BWD-dg).

Numeric twins: FLA's hand-written backward (`reference.gdn.chunk_bwd`) against torch.autograd through
the token recurrence; for BWD-dG, the per-position dL/dg_cum of `chunk_bwd_dqkwg` plus
`prepare_wy_repr_bwd` against torch.autograd through `reference.gdn.fused.fused_chunk_fwd` in g_cum.
"""

from __future__ import annotations

import sympy as sp

from derivations._chunk import Chunk, cols_sum, hadamard, mat, rows_sum, tril
from derivations._core import Identity, register

TWINS = ("reference.gdn.chunk_bwd.chunk_gated_delta_rule_bwd", "reference.gdn.recurrent.recurrent_gated_delta_rule")


def handwritten(ch: Chunk, S: sp.Matrix, dO: sp.Matrix, dSn: sp.Matrix, scale) -> dict:
    """FLA's per-chunk backward formulas (module docstring) as SymPy matrices."""
    fwd = ch.chunk_form(S, scale=1)
    A, w, v_new = fwd["A"], fwd["w"], fwd["v_new"]
    K, Q, V, B, D = ch.k, ch.q, ch.v, ch.B, ch.D
    Gam = ch.Gamma()
    R = sp.diag(*ch.r)
    bg = sp.diag(*[b * g for b, g in zip(ch.beta, ch.gamma)])
    L = ch.L_gated

    dv_new = scale * hadamard(K * Q.T, Gam.T) * dO + R * K * dSn
    dh0 = ch.gamma_C * dSn + scale * Q.T * D * dO - w.T * dv_new
    M = hadamard(dO * v_new.T, Gam)
    dq = scale * D * dO * S.T + scale * M * K
    dw = -dv_new * S.T
    dA = dw * (bg * K).T + dv_new * (B * V).T
    dL = -tril(A.T * dA * A.T, -1)
    dLk = hadamard(dL, Gam)
    dk_s = R * v_new * dSn.T
    dk_a = dk_s + scale * M.T * Q
    Atdw = A.T * dw
    dk = dk_a + bg * Atdw + B * dLk * K + dLk.T * B * K
    dv = B * A.T * dv_new
    gam = sp.Matrix(ch.gamma)
    dbeta = hadamard(gam, rows_sum(hadamard(Atdw, K))) + rows_sum(hadamard(A.T * dv_new, V)) + rows_sum(hadamard(dLk * K, K))
    dG = (
        rows_sum(hadamard(dq, Q))
        - rows_sum(hadamard(dk_a, K))
        + rows_sum(hadamard(Atdw, bg * K))
        + rows_sum(hadamard(dL, L))
        - cols_sum(hadamard(dL, L))
    )
    dG[ch.C - 1] += ch.gamma_C * sum(hadamard(S, dSn)) + sum(hadamard(dk_s, K))
    dg = sp.Matrix([sum(dG[t:]) for t in range(ch.C)])
    return dict(dq=dq, dk=dk, dv=dv, dbeta=dbeta, dG=dG, dg=dg, dh0=dh0)


def _setup(C, K, V, gates="token"):
    ch = Chunk(C, K, V, gates=gates)
    S = mat("s", K, V)
    dO, dSn = mat("dO", C, V), mat("dSn", K, V)
    scale = sp.Symbol("scale", positive=True)
    O, S_end, _ = ch.recurrence(S, scale)
    loss = sum(hadamard(dO, O)) + sum(hadamard(dSn, S_end))
    return ch, S, dO, dSn, scale, loss


def _grad(loss, X: sp.Matrix) -> sp.Matrix:
    return X.applyfunc(lambda x: sp.diff(loss, x))


def _builder(name: str):
    def build(C, K, V):
        gates = "cumulative" if name == "dG" else "token"
        ch, S, dO, dSn, scale, loss = _setup(C, K, V, gates)
        hand = handwritten(ch, S, dO, dSn, scale)[name]
        if name == "dq":
            auto = _grad(loss, ch.q)
        elif name == "dk":
            auto = _grad(loss, ch.k)
        elif name == "dv":
            auto = _grad(loss, ch.v)
        elif name == "dbeta":
            auto = sp.Matrix([sp.diff(loss, b) for b in ch.beta])
        elif name == "dh0":
            auto = _grad(loss, S)
        elif name == "dG":
            auto = sp.Matrix([c * sp.diff(loss, c) for c in ch.c])
        elif name == "dg":
            auto = sp.Matrix([a * sp.diff(loss, a) for a in ch.a])
        else:
            raise ValueError(name)
        return hand, auto

    build.__name__ = f"build_{name}"
    return build


_RECORDS = {
    "dq": ("dq = scale D dO S^T + scale ((dO v_new^T) * Gamma) K equals d loss / dq", r"dQ = \mathrm{scale}\,(D\, dO\, S^\top + ((dO\, \tilde V^\top) \odot \Gamma) K)"),
    "dk": ("hand-written dk (state, intra, WY and inverse terms) equals d loss / dk", r"dK = \operatorname{diag}(r) \tilde V dS'^\top + \mathrm{scale}\, M^\top Q + \operatorname{diag}(\beta\gamma) A^\top dW + B\, dL_k K + dL_k^\top B K"),
    "dv": ("dv = diag(beta) A^T dv_new equals d loss / dv", r"dV = B A^\top d\tilde V"),
    "dbeta": ("hand-written dbeta (W, U and inverse terms) equals d loss / dbeta", r"d\beta = \gamma \odot \operatorname{rowsum}((A^\top dW) \odot K) + \operatorname{rowsum}((A^\top d\tilde V) \odot V) + \operatorname{rowsum}((dL_k K) \odot K)"),
    "dh0": ("dh0 = gamma_C dS' + scale Q^T D dO - W^T dv_new equals d loss / dS", r"dS = \gamma_C dS' + \mathrm{scale}\, Q^\top D\, dO - W^\top d\tilde V"),
    "dG": ("hand-written gradient w.r.t. the cumulative gate g_cum equals c_i d loss / d c_i", r"dG_i = c_i \,\partial \mathcal{L} / \partial c_i,\quad c = e^{g_{cum}}"),
    "dg": ("per-token dg is the reverse chunk-local cumsum of dG: a_t d loss / d a_t = sum_{i>=t} dG_i", r"dg_t = a_t \,\partial \mathcal{L} / \partial a_t = \sum_{i \ge t} dG_i"),
}

TWINS_DG = ("reference.gdn.chunk_bwd.chunk_bwd_dqkwg", "reference.gdn.fused.fused_chunk_fwd")

for _name, (_statement, _latex) in _RECORDS.items():
    register(Identity(
        id=f"BWD-{_name}",
        statement=_statement,
        latex=_latex,
        build=_builder(_name),
        sizes=((3, 2, 2), (4, 2, 1)),
        twins=TWINS_DG if _name == "dG" else TWINS,
        source="FLA chunk_gated_delta_rule_bwd (chunk_bwd_dqkwg, prepare_wy_repr_bwd, bwd_dhu); research/fla-gdn.md 3.1",
    ))

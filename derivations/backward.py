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

General proofs (every C, K, V): `handwritten` is one code for the concrete chunk and the symbolic one
(`derivations._symbolic.GChunk`). The loss through the chunk form equals the loss through the recurrence
for every size (CF-1, CF-2), so their gradients agree; `derived_gradients` differentiates it at symbolic
sizes (`derivations._nc.grad`: the product rule, adjoints moved onto the variable [L-adjoint],
dA = -A dL A [L-dinv], log-gates D = diag(exp(eps)) [L-logdiag]), and hand-written minus derived reduces
to zero with (I + L_gated) A = I and tril_0(A) = A as rewrite rules. rowsum(X * Y) = dg(X Y^T),
colsum(X * Y) = dg(X^T Y), sum(X * Y) = tr(X^T Y) [L-adjoint]. BWD-dg: the chain rule through
gamma_i = prod_{s<=i} a_s [L-chain-gates] and the reverse cumsum as an indicator sum [L-sum-range], with
dG from BWD-dG.
"""

from __future__ import annotations

import sympy as sp

from ._chunk import Chunk, chunk_form, hadamard, mat
from ._core import Identity, register

TWINS = ("reference.gdn.chunk_bwd.chunk_gated_delta_rule_bwd", "reference.gdn.recurrent.recurrent_gated_delta_rule")


def handwritten(ch, S, dO, dSn, scale, dL_diagonal: int = -1) -> dict:
    """FLA's per-chunk backward formulas (module docstring), for a concrete `Chunk` (SymPy matrices) or a
    symbolic `derivations._symbolic.GChunk` (the general proofs): one code for both. dL_diagonal: the
    mask of dL (-1; the tests shift it to check that both proofs reject it). dg (the reverse cumsum of
    dG) only for a concrete chunk."""
    fwd = chunk_form(ch, S, scale=1)
    A, w, v_new = fwd["A"], fwd["w"], fwd["v_new"]
    K, Q, V, B, D = ch.k, ch.q, ch.v, ch.B, ch.D
    R = ch.Dr
    bg = B * D
    L = ch.L_gated

    dv_new = scale * ch.gate_T(K * Q.T) * dO + R * K * dSn
    dh0 = ch.gamma_C * dSn + scale * Q.T * D * dO - w.T * dv_new
    M = ch.gate(dO * v_new.T)
    dq = scale * D * dO * S.T + scale * M * K
    dw = -dv_new * S.T
    dA = dw * (bg * K).T + dv_new * (B * V).T
    dL = -ch.tril(A.T * dA * A.T, dL_diagonal)
    dLk = ch.gate(dL)
    dk_s = R * v_new * dSn.T
    dk_a = dk_s + scale * M.T * Q
    Atdw = A.T * dw
    dk = dk_a + bg * Atdw + B * dLk * K + dLk.T * B * K
    dv = B * A.T * dv_new
    dbeta = D * ch.rowsum_had(Atdw, K) + ch.rowsum_had(A.T * dv_new, V) + ch.rowsum_had(dLk * K, K)
    dG = (
        ch.rowsum_had(dq, Q)
        - ch.rowsum_had(dk_a, K)
        + ch.rowsum_had(Atdw, bg * K)
        + ch.rowsum_had(dL, L)
        - ch.colsum_had(dL, L)
    )
    dG = ch.add_last(dG, ch.gamma_C * ch.sum_had(S, dSn) + ch.sum_had(dk_s, K))
    out = dict(dq=dq, dk=dk, dv=dv, dbeta=dbeta, dG=dG, dh0=dh0)
    if isinstance(ch, Chunk):
        out["dg"] = sp.Matrix([sum(dG[t:]) for t in range(ch.C)])
    return out


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


def _builder(name: str, dL_diagonal: int = -1):
    def build(C, K, V):
        gates = "cumulative" if name == "dG" else "token"
        ch, S, dO, dSn, scale, loss = _setup(C, K, V, gates)
        hand = handwritten(ch, S, dO, dSn, scale, dL_diagonal)[name]
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


# ------------------------------------------------------------------------------------------------
# general proofs
# ------------------------------------------------------------------------------------------------

#: what every BWD general proof rests on: the loss through the chunk form equals the loss through the
#: recurrence for every size (CF-1, CF-2), gradients by adjoints, the inverse's differential, the gates
#: as diagonal matrices
BWD_USES = ("CF-1", "CF-2", "L-adjoint", "L-dinv", "L-gate", "L-gamma", "L-ut")


def derived_gradients(ch, S, dO, dSn, scale, names) -> dict:
    """The gradients of loss = <dO, O> + <dS', S'> (O, S' by the chunk form of the symbolic chunk ``ch``)
    derived by `derivations._nc.grad`: the product rule, the adjoints, dA = -A dL A for the gated inverse
    (its L depends on K, beta and the gates), and for dG the log-gates D = diag(exp(eps)) [L-logdiag]."""
    from . import _nc

    cf = chunk_form(ch, S, scale)
    pairs = [(dO, cf["o"]), (dSn, cf["S_end"])]
    inv = {ch.Ag: ch.L_gated}
    wrt = dict(dq=ch.q, dk=ch.k, dv=ch.v, dbeta=ch.B, dh0=S)
    out = {}
    for name in names:
        if name == "dG":
            out[name] = _nc.grad(pairs, None, inverses=inv, logdiag=(ch.D, ch.Dinv, ch.gamma_C, ch.e_last))
        else:
            out[name] = _nc.grad(pairs, wrt[name], inverses=inv)
    return out


def _general(name: str, dL_diagonal: int = -1):
    from ._nc import sym
    from ._proof import Eq, Proof
    from ._symbolic import GChunk, Ksym, Vsym

    ch = GChunk()
    S, dO, dSn = sym("S", Ksym, Vsym), sym("dO", ch.C, Vsym), sym("dSn", Ksym, Vsym)
    scale = sp.Symbol("scale", positive=True)
    hand = handwritten(ch, S, dO, dSn, scale, dL_diagonal)[name]
    auto = derived_gradients(ch, S, dO, dSn, scale, [name])[name]
    wrt = {"dG": "the log cumulative gates g_cum (c_i d/dc_i)", "dbeta": "beta", "dh0": "the entering state S"}.get(name, name[1:])
    return Proof(
        claim=f"for every C, K, V: FLA's hand-written {name} equals the gradient of <dO, O> + <dS', S'> with respect to {wrt}",
        method="differentiate the loss through the chunk form (equal to the recurrence's for every size, CF-1 and CF-2): "
               "product rule, adjoints moved onto the variable, dA = -A dL A; reduce hand-written minus derived "
               "with (I + L_gated) A = I and tril_0(A) = A as rewrite rules",
        uses=BWD_USES + (("L-logdiag",) if name == "dG" else ()),
        steps=[Eq(f"hand-written {name} = derived", hand, auto, ch.rules("gated"))],
    )


def _general_dg() -> "Proof":
    from ._proof import Entry, Proof

    t, i = sp.symbols("t i", integer=True, nonnegative=True)
    C = sp.Symbol("C", integer=True, positive=True)
    k = sp.Symbol("k", integer=True)
    dG = sp.Function("dG")
    p, q, s_, _ = sp.symbols("p_ q_ s_ t_", integer=True, nonnegative=True)
    # a_t dL/da_t = sum_i (a_t d log gamma_i / d a_t) gamma_i dL/dgamma_i = sum_i [i >= t] dG_i (L-chain-gates),
    # and that is the reverse cumsum sum_{i=t}^{C-1} dG_i the hand-written dg computes (L-sum-range)
    chain = sp.Sum(sp.Piecewise((dG(k), k >= t), (0, True)), (k, 0, C - 1))
    return Proof(
        claim="for every C: a_t d loss / d a_t = sum_{i >= t} dG_i with dG the gradient of BWD-dG (every size)",
        method="the chain rule through gamma_i = prod_{s<=i} a_s (L-chain-gates), the indicator sum as the reverse "
               "cumulative sum (L-sum-range), dG by BWD-dG",
        uses=("BWD-dG", "L-chain-gates", "L-sum-range"),
        steps=[Entry("sum_k [k >= t] dG_k = sum_{k=t}^{C-1} dG_k (split at t, every summand below t zero)",
                     sp.Sum(sp.Piecewise((dG(k), k >= t), (0, True)), (k, 0, t - 1))
                     + sp.Sum(sp.Piecewise((dG(k), k >= t), (0, True)), (k, t, C - 1)) - chain,
                     [{t: p, C: p + 1 + q}]),
               Entry("below t", sp.Piecewise((dG(k), k >= t), (0, True)).subs(k, t - 1 - s_), [{}]),
               Entry("from t on", (sp.Piecewise((dG(k), k >= t), (0, True)) - dG(k)).subs(k, t + s_), [{}])],
    )

for _name, (_statement, _latex) in _RECORDS.items():
    register(Identity(
        id=f"BWD-{_name}",
        statement=_statement,
        latex=_latex,
        build=_builder(_name),
        sizes=((3, 2, 2), (4, 2, 1)),
        twins=TWINS_DG if _name == "dG" else TWINS,
        source="FLA chunk_gated_delta_rule_bwd (chunk_bwd_dqkwg, prepare_wy_repr_bwd, bwd_dhu); research/fla-gdn.md 3.1",
        general=(lambda: _general_dg()) if _name == "dg" else (lambda n=_name: _general(n)),
    ))

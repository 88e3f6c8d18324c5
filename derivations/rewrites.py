"""RW: the hardware-friendly rewrites the production kernels adopt, as before/after pairs.

Each record's left side is FLA's formulation, its right side the form a fused kernel computes
(research/flashqla-design.md section 3). Notation as in `derivations._chunk`; A_free is the gate-free
inverse (I + tril_-1(diag(beta) K K^T))^-1, A_gated FLA's (I + tril_-1(diag(beta)(K K^T * Gamma)))^-1.

    RW-1  A_gated = Gamma * A_free                     (Gamma * X = D X D^-1 for lower-triangular X)
    RW-2  u - w S = (Gamma * A_free) diag(beta) (V - D (K S))
    RW-3  S' = (gamma_C I - T_c) S + B_c,   T_c = gamma_C K^T A_free diag(beta) K,
                                            B_c = K^T A_free diag(beta) diag(r) V
    RW-4  exp(g_cum_i - g_cum_j) = exp2(g_cum_log2_i - g_cum_log2_j),  g_cum_log2 = g_cum / ln 2
    RW-5  S' = gamma_C S + X^T Y,  X = -diag(beta) A_free^T K,  Y = gamma_C K S - diag(r) V
    RW-6  dS = M_c^T dS' + scale (D R)^T dO,  M_c = gamma_C I - T_c,  R = Q - tril_0(Q K^T) A_free diag(beta) K
    RW-7  v_new = (A_b (W S_d)) S_d^-1,  O + Pg v_new = (O S_d + Pg (A_b (W S_d))) S_d^-1  (S_d invertible diagonal)

General proofs (every C, K, V), at symbolic sizes with the chunk of `derivations._symbolic.GChunk`:
- RW-1: Gamma * X = D tril_0(X) D^-1 [L-gate] turns the re-gating into D A D^-1, and
  (I + L_gated) D A D^-1 = D A D^-1 (I + L_gated) = I by the relations (I + L) A = A (I + L) = I and
  tril_0(A) = A [L-ut]; a two-sided inverse is the inverse.
- RW-2, RW-3, RW-5: the chunk form's side reduced with A_gated -> D A D^-1 (RW-1) and
  diag(r) = gamma_C D^-1 [L-gamma].
- RW-4: the (i, j) entry with symbolic indices and an arbitrary real g_cum, three cases.
- RW-6: the loss through the chunk form (CF-1, CF-2), its gradient in S by adjoints [L-adjoint].
- RW-7: non-commutative reduction with S_d S_d^-1 = I (a diagonal pair); the inference forward's fp16
  operands scale W's value columns by powers of two (exact in floating point), into fp16's range.
The right-hand sides are one code for both proofs (`regated_form`, `v_new_form`, `transition_form`,
`xy_form`, `state_grad_form`); the tests pass broken versions and check that both proofs reject them.
"""

from __future__ import annotations

import sympy as sp

from . import _nc
from ._chunk import Chunk, chunk_form, mat, transition
from ._core import Identity, register
from ._nc import diag_pair, eye, sym
from ._proof import Entry, Eq, Proof, REGIONS
from ._symbolic import GChunk, Ksym, Vsym

# ------------------------------------------------------------------------------------------------
# the right-hand sides, one code for the concrete chunk (`_chunk.Chunk`) and the symbolic one
# (`_symbolic.GChunk`); the tests pass broken versions to check that both proofs reject them
# ------------------------------------------------------------------------------------------------


def regated_form(ch, diagonal: int = 0):
    """Gamma_diagonal * A_free."""
    return ch.gate(ch.A_free(), diagonal)


def v_new_form(ch, S):
    """(Gamma * A_free) diag(beta) (V - D (K S))."""
    return regated_form(ch) * ch.B * (ch.v - ch.D * (ch.k * S))


def transition_form(ch, S):
    """(gamma_C I - T_c) S + B_c."""
    T_c, B_c = transition(ch)
    return (ch.gamma_C * ch.eye(ch.K) - T_c) * S + B_c


def xy_form(ch, S):
    """gamma_C S + X^T Y, X = -diag(beta) A_free^T K, Y = gamma_C K S - diag(r) V."""
    A = ch.A_free()
    X = -ch.B * A.T * ch.k
    Y = ch.gamma_C * ch.k * S - ch.Dr * ch.v
    return ch.gamma_C * S + X.T * Y


def state_grad_form(ch, dO, dSn, scale, diagonal: int = 0):
    """M_c^T dS' + scale (D R)^T dO, M_c = gamma_C I - T_c, R = Q - tril_diagonal(Q K^T) A_free diag(beta) K."""
    A = ch.A_free()
    T_c, _ = transition(ch, A)
    M_c = ch.gamma_C * ch.eye(ch.K) - T_c
    R = ch.q - ch.tril(ch.q * ch.k.T, diagonal) * A * ch.B * ch.k
    return M_c.T * dSn + scale * (ch.D * R).T * dO


# ------------------------------------------------------------------------------------------------
# concrete builders
# ------------------------------------------------------------------------------------------------


def _regate(C, K, form=regated_form):
    ch = Chunk(C, K, 1)
    return ch.A_gated(), form(ch)


def _v_new(C, K, V, form=v_new_form):
    ch, S = Chunk(C, K, V), mat("s", K, V)
    return ch.chunk_form(S)["v_new"], form(ch, S)


def _transition(C, K, V, form=transition_form):
    ch, S = Chunk(C, K, V), mat("s", K, V)
    return ch.chunk_form(S)["S_end"], form(ch, S)


def _exp2(C, to_log2=None):
    to_log2 = (lambda x: x / sp.log(2)) if to_log2 is None else to_log2
    g = [sp.Symbol(f"g_{t}", nonpositive=True) for t in range(C)]
    g_cum = [sum(g[: i + 1]) for i in range(C)]
    g_cum_log2 = [to_log2(x) for x in g_cum]
    lhs = sp.Matrix(C, C, lambda i, j: sp.exp(g_cum[i] - g_cum[j]) if i >= j else 0)
    # unevaluated, so that the checker proves it rather than SymPy folding it when it is built
    rhs = sp.Matrix(C, C, lambda i, j: sp.Pow(2, g_cum_log2[i] - g_cum_log2[j], evaluate=False) if i >= j else 0)
    return lhs, rhs


def _xy(C, K, V, form=xy_form):
    ch, S = Chunk(C, K, V), mat("s", K, V)
    return ch.chunk_form(S)["S_end"], form(ch, S)


def _state_grad(C, K, V, form=state_grad_form):
    # Gradient of <dO, O> + <dS', S'> with respect to the entering state S, through the recurrence,
    # against the gate-light closed form (no C x C exp mask).
    ch, S = Chunk(C, K, V), mat("s", K, V)
    scale = sp.Symbol("scale", positive=True)
    dO, dSn = mat("dO", C, V), mat("dSn", K, V)
    O, S_end, _ = ch.recurrence(S, scale)
    loss = sum(_hadamard(dO, O)) + sum(_hadamard(dSn, S_end))
    lhs = sp.Matrix(K, V, lambda i, j: sp.diff(loss, S[i, j]))
    return lhs, form(ch, dO, dSn, scale)


def row_scaled_form(Ab, W, O, Pg, Sd, Sinv):
    """[v_new; O'] with W's columns scaled by Sd: ((A_b (W Sd)) Sd^-1; (O Sd + Pg (A_b (W Sd))) Sd^-1)."""
    vn_s = Ab * (W * Sd)
    return vn_s * Sinv, (O * Sd + Pg * vn_s) * Sinv


def _row_scaled(C, V, form=row_scaled_form):
    Ab, W, O, Pg = mat("a", C, C), mat("w", C, V), mat("o", C, V), mat("p", C, C)
    s = [sp.Symbol(f"s_{i}", positive=True) for i in range(V)]
    Sd, Sinv = sp.diag(*s), sp.diag(*[1 / x for x in s])
    vn, o = form(Ab, W, O, Pg, Sd, Sinv)
    return (Ab * W).col_join(O + Pg * Ab * W), vn.col_join(o)


def _hadamard(X, Y):
    return X.multiply_elementwise(Y)


# ------------------------------------------------------------------------------------------------
# general proofs
# ------------------------------------------------------------------------------------------------


def _general_regate(form=regated_form) -> Proof:
    ch = GChunk()
    I = eye(ch.C)
    X = form(ch)
    rules = ch.rules("free")
    return Proof(
        claim="for every C, K: Gamma * A_free is a two-sided inverse of I + L_gated, so it is A_gated (inverses are unique)",
        method="Gamma * X = D tril_0(X) D^-1 and L_gated = B D tril_-1(K K^T) D^-1 as matrix statements; "
               "non-commutative reduction with (I + L_free) A = A (I + L_free) = I and tril_0(A) = A",
        uses=("L-gate", "L-ut"),
        steps=[Eq("(I + L_gated)(Gamma * A_free) = I", (I + ch.L_gated) * X, I, rules),
               Eq("(Gamma * A_free)(I + L_gated) = I", X * (I + ch.L_gated), I, rules)],
    )


def _general_rewrite(part: str, form) -> Proof:
    """RW-2 (v_new), RW-3 / RW-5 (S_end): the chunk form's side against the rewritten form, with
    A_gated = D A_free D^-1 (RW-1)."""
    ch, S = GChunk(), sym("S", Ksym, Vsym)
    lhs = chunk_form(ch, S)[part]
    return Proof(
        claim=f"for every C, K, V and S: the chunk form's {part} equals the rewritten form",
        method="non-commutative reduction with A_gated -> D A_free D^-1 (RW-1), diag(r) = gamma_C D^-1, "
               "the inverse's relations and tril_0(A) = A",
        uses=("RW-1", "L-gate", "L-gamma", "L-ut"),
        steps=[Eq(f"{part} = rewritten", lhs, form(ch, S), ch.rules("free") + ch.regate_rule())],
    )


def _general_exp2(to_log2=None) -> Proof:
    """to_log2: g_cum -> g_cum_log2 (default g_cum / ln 2; the tests pass a wrong one)."""
    to_log2 = (lambda x: x / sp.log(2)) if to_log2 is None else to_log2
    n = sp.Symbol("n", integer=True, positive=True)
    i, j = sp.symbols("i j", integer=True, nonnegative=True)
    G = sp.Function("G", real=True)  # g_cum, any real values
    lhs = sp.Piecewise((sp.exp(G(i) - G(j)), i >= j), (0, True))
    # unevaluated, so that the step is checked, not folded by SymPy when it is built
    rhs = sp.Piecewise((sp.Pow(2, to_log2(G(i)) - to_log2(G(j)), evaluate=False), i >= j), (0, True))
    return Proof(
        claim="for every C, every entry and every real g_cum: the masked exp equals the masked exp2 of g_cum / ln 2",
        method="entry (i, j) with symbolic i, j, C and g_cum an arbitrary real function; cases i > j, i = j, i < j",
        steps=[Entry("exp(G_i - G_j) = 2^(G_i / ln 2 - G_j / ln 2)", lhs - rhs, REGIONS["ij"](i, j, n))],
    )


def _general_row_scaled(form=row_scaled_form) -> Proof:
    C = sp.Symbol("C", integer=True, positive=True)
    Ab, W, O, Pg = sym("Ab", C, C), sym("W", C, Vsym), sym("O", C, Vsym), sym("Pg", C, C)
    Sd, Sinv = diag_pair("Sd", "Sdinv", Vsym)
    vn, o = form(Ab, W, O, Pg, Sd, Sinv)
    return Proof(
        claim="for every C, V and invertible diagonal S_d: the row-scaled products equal v_new = A_b W and O + Pg v_new",
        method="non-commutative reduction; S_d S_d^-1 = I cancels (a declared inverse pair of diagonal generators)",
        steps=[Eq("v_new = (A_b (W S_d)) S_d^-1", Ab * W, vn, []),
               Eq("O + Pg v_new = (O S_d + Pg A_b W S_d) S_d^-1", O + Pg * Ab * W, o, [])],
    )


def _general_state_grad(form=state_grad_form) -> Proof:
    ch, S = GChunk(), sym("S", Ksym, Vsym)
    scale = sp.Symbol("scale", positive=True)
    dO, dSn = sym("dO", ch.C, Vsym), sym("dSn", Ksym, Vsym)
    cf = chunk_form(ch, S, scale)
    derived = _nc.grad([(dO, cf["o"]), (dSn, cf["S_end"])], S)
    return Proof(
        claim="for every C, K, V: the gradient of <dO, O> + <dS', S'> with respect to the entering state S "
              "(through the recurrence: CF-1, CF-2) equals M_c^T dS' + scale (D R)^T dO",
        method="the loss through the chunk form (CF-1, CF-2: equal to the recurrence's for every size); its "
               "gradient by adjoints (L-adjoint); non-commutative reduction with A_gated -> D A_free D^-1 (RW-1)",
        uses=("CF-1", "CF-2", "L-adjoint", "RW-1", "L-gate", "L-gamma", "L-ut"),
        steps=[Eq("d loss / dS = M_c^T dS' + scale (D R)^T dO", derived, form(ch, dO, dSn, scale),
                  ch.rules("free") + ch.regate_rule())],
    )


RW_1 = register(Identity(
    id="RW-1",
    statement="gate-free inverse re-gated: (I + tril_-1(B (Gamma*KK^T)))^-1 = Gamma * (I + tril_-1(B KK^T))^-1",
    latex=r"(I + \operatorname{tril}_{-1}(B(\Gamma \odot K K^\top)))^{-1} = \Gamma \odot (I + \operatorname{tril}_{-1}(B K K^\top))^{-1}",
    build=_regate,
    sizes=((4, 2), (5, 2), (8, 2)),
    size_names=("C", "K"),
    twins=("reference.gdn.chunk.solve_tril", "reference.gdn.fused.regate"),
    source="FlashQLA kkt_solve + fused_gdr_fwd; research/flashqla-design.md 3 R1",
    general=lambda: _general_regate(),
))

RW_2 = register(Identity(
    id="RW-2",
    statement="merged v_new: u - w S = A_gated diag(beta) (V - diag(gamma) K S)",
    latex=r"A_g B V - A_g B D K S = (\Gamma \odot A) B\,(V - D (K S))",
    build=_v_new,
    sizes=((3, 2, 2), (4, 2, 1), (6, 2, 1)),
    twins=("reference.gdn.chunk.chunk_fwd_h", "reference.gdn.fused.chunk_v_new"),
    source="FlashQLA fused_gdr_fwd; research/flashqla-design.md 3 R2",
    general=lambda: _general_rewrite("v_new", v_new_form),
))

RW_3 = register(Identity(
    id="RW-3",
    statement="transition form: S' = (gamma_C I - T_c) S + B_c with gate-free T_c/gamma_C = K^T A B K",
    latex=r"S' = (\gamma_C I - T_c) S + B_c,\quad T_c = \gamma_C K^\top A B K,\quad B_c = K^\top A B \operatorname{diag}(r) V",
    build=_transition,
    sizes=((3, 2, 2), (4, 2, 1)),
    twins=("reference.gdn.chunk.chunk_fwd_h", "reference.gdn.fused.chunk_transition"),
    source="FlashQLA prepare_h / cp_fwd (M_c); research/flashqla-design.md 1.2, 3 R4, R6",
    general=lambda: _general_rewrite("S_end", transition_form),
))

RW_4 = register(Identity(
    id="RW-4",
    statement="base-2 gates: exp(g_cum_i - g_cum_j) = exp2(g_cum_log2_i - g_cum_log2_j), g_cum_log2 = g_cum / ln 2",
    latex=r"e^{G_i - G_j} = 2^{\hat G_i - \hat G_j},\quad \hat G = G / \ln 2",
    build=_exp2,
    sizes=((4,), (8,)),
    size_names=("C",),
    twins=("reference.gdn.fused.decay_mask", "reference.gdn.fused.decay_mask_exp2"),
    source="FLA chunk_local_cumsum(scale=RCP_LN2); research/fla-gdn.md 5.1",
    general=lambda: _general_exp2(),
))

RW_5 = register(Identity(
    id="RW-5",
    statement="state update without a C x C mask: S' = gamma_C S + X^T Y, X = -B A^T K, Y = gamma_C K S - diag(r) V",
    latex=r"S' = \gamma_C S + X^\top Y,\quad X = -B A^\top K,\quad Y = \gamma_C K S - \operatorname{diag}(r) V",
    build=_xy,
    sizes=((3, 2, 2), (4, 2, 1), (6, 2, 1)),
    twins=("reference.gdn.chunk.chunk_fwd_h", "reference.gdn.fused.chunk_state_update_xy"),
    source="FlashQLA prepare_h (fused_gdr_h); research/flashqla-design.md 1.2, 3 R4",
    general=lambda: _general_rewrite("S_end", xy_form),
))

RW_6 = register(Identity(
    id="RW-6",
    statement="state gradient, gate-light: dS = M_c^T dS' + scale (D R)^T dO, R = Q - tril_0(QK^T) A B K",
    latex=r"\frac{\partial \mathcal{L}}{\partial S} = (\gamma_C I - T_c)^\top dS' + \mathrm{scale}\,(D R)^\top dO,"
    r"\quad R = Q - \operatorname{tril}_0(Q K^\top) A B K",
    build=_state_grad,
    sizes=((3, 2, 2), (4, 2, 1)),
    twins=("reference.gdn.chunk_bwd.chunk_gated_delta_rule_bwd", "reference.gdn.fused.chunk_state_grad"),
    source="FlashQLA cp_bwd (fused_gdr_dh); research/flashqla-design.md 1.3, 3 R7",
    general=lambda: _general_state_grad(),
))

RW_7 = register(Identity(
    id="RW-7",
    statement="row-scaled fp16 products: v_new = (A_b (W S_d)) S_d^-1, O + Pg v_new = (O S_d + Pg A_b W S_d) S_d^-1",
    latex=r"A_b W = (A_b (W S_d)) S_d^{-1},\quad O + P_g A_b W = (O S_d + P_g A_b (W S_d)) S_d^{-1}",
    build=_row_scaled,
    sizes=((3, 2), (4, 3)),
    size_names=("C", "V"),
    twins=("reference.gdn.fused.chunk_v_new_output", "reference.gdn.fused.chunk_v_new_output_row_scaled"),
    source="the inference forward's fp16 A_beta product (flashqla.ops.gdn.fwd.product_dtype)",
    general=lambda: _general_row_scaled(),
))

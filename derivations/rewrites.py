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
"""

from __future__ import annotations

import sympy as sp

from derivations._chunk import Chunk, hadamard, mat, tril
from derivations._core import Identity, register


def _regate(C, K):
    ch = Chunk(C, K, 1)
    return ch.A_gated(), hadamard(ch.Gamma(), ch.A_free())


def _v_new(C, K, V):
    ch, S = Chunk(C, K, V), mat("s", K, V)
    lhs = ch.chunk_form(S)["v_new"]
    rhs = hadamard(ch.Gamma(), ch.A_free()) * ch.B * (ch.v - ch.D * (ch.k * S))
    return lhs, rhs


def _transition(C, K, V):
    ch, S = Chunk(C, K, V), mat("s", K, V)
    T_c, B_c = ch.transition()
    return ch.chunk_form(S)["S_end"], (ch.gamma_C * sp.eye(K) - T_c) * S + B_c


def _exp2(C):
    g = [sp.Symbol(f"g_{t}", nonpositive=True) for t in range(C)]
    g_cum = [sum(g[: i + 1]) for i in range(C)]
    g_cum_log2 = [x / sp.log(2) for x in g_cum]
    lhs = sp.Matrix(C, C, lambda i, j: sp.exp(g_cum[i] - g_cum[j]) if i >= j else 0)
    rhs = sp.Matrix(C, C, lambda i, j: sp.Integer(2) ** (g_cum_log2[i] - g_cum_log2[j]) if i >= j else 0)
    return lhs, rhs


def _xy(C, K, V):
    ch, S = Chunk(C, K, V), mat("s", K, V)
    A = ch.A_free()
    X = -ch.B * A.T * ch.k
    Y = ch.gamma_C * ch.k * S - sp.diag(*ch.r) * ch.v
    return ch.chunk_form(S)["S_end"], ch.gamma_C * S + X.T * Y


def _state_grad(C, K, V):
    # Gradient of <dO, O> + <dS', S'> with respect to the entering state S, through the recurrence,
    # against the gate-light closed form (no C x C exp mask).
    ch, S = Chunk(C, K, V), mat("s", K, V)
    scale = sp.Symbol("scale", positive=True)
    dO, dSn = mat("dO", C, V), mat("dSn", K, V)
    O, S_end, _ = ch.recurrence(S, scale)
    loss = sum(hadamard(dO, O)) + sum(hadamard(dSn, S_end))
    lhs = sp.Matrix(K, V, lambda i, j: sp.diff(loss, S[i, j]))
    A = ch.A_free()
    T_c, _ = ch.transition(A)
    M_c = ch.gamma_C * sp.eye(K) - T_c
    R = ch.q - tril(ch.q * ch.k.T) * A * ch.B * ch.k
    return lhs, M_c.T * dSn + scale * (ch.D * R).T * dO


RW_1 = register(Identity(
    id="RW-1",
    statement="gate-free inverse re-gated: (I + tril_-1(B (Gamma*KK^T)))^-1 = Gamma * (I + tril_-1(B KK^T))^-1",
    latex=r"(I + \operatorname{tril}_{-1}(B(\Gamma \odot K K^\top)))^{-1} = \Gamma \odot (I + \operatorname{tril}_{-1}(B K K^\top))^{-1}",
    build=_regate,
    sizes=((4, 2), (5, 2)),
    size_names=("C", "K"),
    twins=("reference.gdn.chunk.solve_tril", "reference.gdn.fused.regate"),
    source="FlashQLA kkt_solve + fused_gdr_fwd; research/flashqla-design.md 3 R1",
))

RW_2 = register(Identity(
    id="RW-2",
    statement="merged v_new: u - w S = A_gated diag(beta) (V - diag(gamma) K S)",
    latex=r"A_g B V - A_g B D K S = (\Gamma \odot A) B\,(V - D (K S))",
    build=_v_new,
    sizes=((3, 2, 2), (4, 2, 1)),
    twins=("reference.gdn.chunk.chunk_fwd_h", "reference.gdn.fused.chunk_v_new"),
    source="FlashQLA fused_gdr_fwd; research/flashqla-design.md 3 R2",
))

RW_3 = register(Identity(
    id="RW-3",
    statement="transition form: S' = (gamma_C I - T_c) S + B_c with gate-free T_c/gamma_C = K^T A B K",
    latex=r"S' = (\gamma_C I - T_c) S + B_c,\quad T_c = \gamma_C K^\top A B K,\quad B_c = K^\top A B \operatorname{diag}(r) V",
    build=_transition,
    sizes=((3, 2, 2), (4, 2, 1)),
    twins=("reference.gdn.chunk.chunk_fwd_h", "reference.gdn.fused.chunk_transition"),
    source="FlashQLA prepare_h / cp_fwd (M_c); research/flashqla-design.md 1.2, 3 R4, R6",
))

RW_4 = register(Identity(
    id="RW-4",
    statement="base-2 gates: exp(g_cum_i - g_cum_j) = exp2(g_cum_log2_i - g_cum_log2_j), g_cum_log2 = g_cum / ln 2",
    latex=r"e^{G_i - G_j} = 2^{\hat G_i - \hat G_j},\quad \hat G = G / \ln 2",
    build=_exp2,
    sizes=((4,),),
    size_names=("C",),
    twins=("reference.gdn.fused.decay_mask", "reference.gdn.fused.decay_mask_exp2"),
    source="FLA chunk_local_cumsum(scale=RCP_LN2); research/fla-gdn.md 5.1",
))

RW_5 = register(Identity(
    id="RW-5",
    statement="state update without a C x C mask: S' = gamma_C S + X^T Y, X = -B A^T K, Y = gamma_C K S - diag(r) V",
    latex=r"S' = \gamma_C S + X^\top Y,\quad X = -B A^\top K,\quad Y = \gamma_C K S - \operatorname{diag}(r) V",
    build=_xy,
    sizes=((3, 2, 2), (4, 2, 1)),
    twins=("reference.gdn.chunk.chunk_fwd_h", "reference.gdn.fused.chunk_state_update_xy"),
    source="FlashQLA prepare_h (fused_gdr_h); research/flashqla-design.md 1.2, 3 R4",
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
))

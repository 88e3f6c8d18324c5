"""CF: the chunk form equals the token recurrence (outputs and chunk-end state).

A chunk entered with a non-zero state S: the C rank-1 updates of the recurrence collapse into the
WY/UT form with FLA's gated A = (I + tril_-1(diag(beta) (K K^T * Gamma)))^-1 (research/fla-gdn.md
section 2.2):

    w = A diag(beta gamma) K,   u = A diag(beta) V,   v_new = u - w S
    O = scale (D Q S + (Q K^T * Gamma_causal) v_new)
    S' = gamma_C S + K^T diag(r) v_new

CF-4 (checkpoints at any token): the state after the first j tokens of the chunk (1 <= j <= C) is the
end-state formula of CF-2 on those j tokens, read from the WHOLE chunk's v_new:

    S_j = gamma_{j-1} S + K_j^T diag(m_j) v_new_j,   m_j,i = exp(g_cum_{j-1} - g_cum_i) (i < j)

with K_j, v_new_j the first j rows: v_new is causal (A is lower triangular), so its first j rows do not
depend on the tokens after j. The kernels store checkpoints with it from the chunk's own products
(`flashqla.ops.gdn.kernels.sm90.recurrent`, twin `reference.gdn.chunk.chunk_checkpoint_states`).

General proofs (every C, K, V): induction on the chunk length C. Base C = 1 (one token: every C x C
quantity is 1 x 1, A = 1). Step C -> C + 1: the chunk of C + 1 tokens is the chunk of C tokens and one
more token, as block matrices split C + 1 (`derivations._symbolic.Ext`); the new row of the gated L is
beta a k^T K^T diag(r) [L-gate, L-gamma, L-mask-blocks], the gated inverse extends as
[[A, 0], [-l A, 1]] [L-blockinv] (checked as a step), and the chunk form at C + 1, reduced with the
C-token relations (I + L) A = I and the induction hypothesis (the C-token recurrence equals the C-token
chunk form, a rewrite rule), equals one more recurrence step. The formulas are the ones the concrete
check uses (`derivations._chunk.chunk_form` on a `derivations._symbolic` chunk).
"""

from __future__ import annotations

import sympy as sp

from ._chunk import Chunk, chunk_form, mat
from ._core import Identity, register
from ._nc import Block, rules_from, sym, zeros
from ._proof import Eq, Proof
from ._symbolic import Csym, Ext, GChunk, Ksym, One, Vsym

TWINS = ("reference.gdn.recurrent.recurrent_gated_delta_rule", "reference.gdn.chunk.chunk_gated_delta_rule_fwd")


def _outputs(C, K, V, out_diagonal=0):
    ch, S0, scale = Chunk(C, K, V), mat("s", K, V), sp.Symbol("scale", positive=True)
    O_rec, _, _ = ch.recurrence(S0, scale)
    return O_rec, ch.chunk_form(S0, scale, out_diagonal=out_diagonal)["o"]


def _state(C, K, V):
    ch, S0 = Chunk(C, K, V), mat("s", K, V)
    _, S_rec, _ = ch.recurrence(S0)
    return S_rec, ch.chunk_form(S0)["S_end"]


def _deltas(C, K, V):
    ch, S0 = Chunk(C, K, V), mat("s", K, V)
    _, _, states = ch.recurrence(S0)
    # the per-token write u_t = beta_t (v_t - a_t S_{t-1}^T k_t) of the delta form
    rows = [ch.beta[t] * (ch.v[t, :] - ch.a[t] * ch.k[t, :] * states[t]) for t in range(C)]
    return sp.Matrix.vstack(*rows), ch.chunk_form(S0)["v_new"]


#: the lemmas every CF induction step rests on
CF_LEMMAS = ("L-gate", "L-gamma", "L-ut", "L-blockinv")


def _induction(part: str, out_diagonal: int = 0) -> Proof:
    """Induction on C for one part of the chunk form: "S_end" (CF-2), "o" (CF-1), "v_new" (CF-3)."""
    one, ch = One(), GChunk()
    ext = Ext(ch)
    S = sym("S", Ksym, Vsym)
    scale = sp.Symbol("scale", positive=True)
    S_C = sym("S_C", Ksym, Vsym)  # the recurrence's state after C tokens
    cf_C = chunk_form(ch, S, scale, out_diagonal=out_diagonal)
    cf_1 = chunk_form(one, S, scale, out_diagonal=out_diagonal)
    cf_E = chunk_form(ext, S, scale, out_diagonal=out_diagonal)
    S1, o1, w1 = one.recurrence(S)
    Sn, on, wn = ext.recurrence(S_C)
    state = rules_from(S_C, cf_C["S_end"], "hyp" if part == "S_end" else "CF-2", transpose=False)
    steps = [Eq("base: L_gated = 0 at C = 1, so A = (I + 0)^-1 = 1", one.L_gated, zeros(1, 1)),
             *ext.inverse_steps("gated")]
    rules = ch.rules("gated") + state
    if part == "S_end":
        steps += [Eq("base: S_1", cf_1["S_end"], S1), Eq("step: S_{C+1}", cf_E["S_end"], Sn, rules)]
    elif part == "o":
        O_C = sym("O_C", Csym, Vsym)  # the recurrence's first C outputs (causal: the new token does not change them)
        hyp = rules_from(O_C, cf_C["o"], "hyp", transpose=False)
        steps += [Eq("base: o_1", cf_1["o"], scale * o1),
                  Eq("step: O_{C+1} = [O_C; scale q^T S_{C+1}]", cf_E["o"], Block([[O_C], [scale * on]]), rules + hyp)]
    else:
        U_C = sym("U_C", Csym, Vsym)  # the recurrence's first C writes
        hyp = rules_from(U_C, cf_C["v_new"], "hyp", transpose=False)
        steps += [Eq("base: write 1", cf_1["v_new"], w1),
                  Eq("step: [U_C; beta (v^T - a k^T S_C)]", cf_E["v_new"], Block([[U_C], [wn]]), rules + hyp)]
    what = {"S_end": "the end state", "o": "the outputs", "v_new": "v_new (the per-token writes)"}[part]
    return Proof(
        claim=f"for every C >= 1, K, V and entering state S: {what} of the chunk form equal the token recurrence's",
        method="induction on C: base C = 1; step C -> C + 1 appends one token (2 x 2 block matrices), "
               "non-commutative reduction with (I + L_gated) A = I, tril(A) = A and the hypothesis as rewrite rules",
        uses=CF_LEMMAS + (() if part == "S_end" else ("CF-2",)),
        steps=steps,
    )


CF_1 = register(Identity(
    id="CF-1",
    statement="chunk-form outputs equal the token recurrence's, for a chunk entered with a state S",
    latex=r"o_t = \mathrm{scale}\, S_t^\top q_t \;\Longleftrightarrow\; O = \mathrm{scale}\,(D Q S + (Q K^\top \odot \Gamma)(U - W S))",
    build=_outputs,
    sizes=((3, 2, 2), (4, 2, 1), (4, 3, 2)),
    twins=TWINS,
    source="FLA chunk_gated_delta_rule_fwd; research/fla-gdn.md 2.2",
    general=lambda: _induction("o"),
))

CF_2 = register(Identity(
    id="CF-2",
    statement="chunk-form end state equals the token recurrence's, for a chunk entered with a state S",
    latex=r"S_C = \gamma_C S + K^\top \operatorname{diag}(r)\,(U - W S)",
    build=_state,
    sizes=((3, 2, 2), (4, 2, 1), (6, 2, 1)),
    twins=TWINS,
    source="FLA chunk_gated_delta_rule_fwd_h; research/fla-gdn.md 2.2",
    general=lambda: _induction("S_end"),
))

CF_3 = register(Identity(
    id="CF-3",
    statement="v_new = u - w S is the recurrence's per-token write beta_t (v_t - a_t S_{t-1}^T k_t)",
    latex=r"(U - W S)_t = \beta_t\,(v_t - a_t S_{t-1}^\top k_t)",
    build=_deltas,
    sizes=((3, 2, 2), (4, 2, 1), (6, 2, 1)),
    twins=("reference.gdn.fused.recurrent_deltas", "reference.gdn.chunk.chunk_fwd_h"),
    source="research/fla-gdn.md 2.2 step 5",
    general=lambda: _induction("v_new"),
))


# ------------------------------------------------------------------------------------------------
# CF-4: checkpoints inside a chunk
# ------------------------------------------------------------------------------------------------


def checkpoint_form(pre, S, v_new_rows):
    """The state after the tokens of ``pre`` (the first j tokens of a chunk: gamma_C = gamma_{j-1},
    K_j, diag(r) = diag(exp(g_cum_{j-1} - g_cum_i))), from ``v_new_rows`` = the first j rows of the
    whole chunk's v_new: gamma_{j-1} S + K_j^T diag(r_j) v_new_rows. One code for the concrete check
    (`_Prefix`) and the general proof (a `GChunk` inside an `Ext`)."""
    return pre.gamma_C * S + pre.k.T * pre.Dr * v_new_rows


class _Prefix:
    """The first j tokens of a concrete `Chunk`, with the attributes `checkpoint_form` reads."""

    def __init__(self, ch: Chunk, j: int):
        self.gamma_C = ch.gamma[j - 1]
        self.k = ch.k[:j, :]
        self.Dr = sp.diag(*[ch.Gam(j - 1, i) for i in range(j)])


def _checkpoints(C, K, V, form=checkpoint_form):
    ch, S0 = Chunk(C, K, V), mat("s", K, V)
    _, _, states = ch.recurrence(S0)
    v_new = ch.chunk_form(S0)["v_new"]
    lhs = tuple(states[j] for j in range(1, C + 1))
    rhs = tuple(form(_Prefix(ch, j), S0, v_new[:j, :]) for j in range(1, C + 1))
    return lhs, rhs


def _checkpoint_proof(form=checkpoint_form) -> Proof:
    """CF-4 for every C, K, V and checkpoint j: induction on the number m of tokens the chunk holds after
    the checkpoint (the chunk has j + m tokens)."""
    ch = GChunk()
    ext = Ext(ch)
    S = sym("S", Ksym, Vsym)
    S_C = sym("S_C", Ksym, Vsym)  # the recurrence's state after the first C tokens
    cf_C = chunk_form(ch, S)
    cf_E = chunk_form(ext, S)
    top = cf_E["v_new"].grid[0][0]  # the first C rows of the (C + 1)-token chunk's v_new
    state = rules_from(S_C, cf_C["S_end"], "CF-2", transpose=False)
    rules = ch.rules("gated")
    return Proof(
        claim="for every C >= 1, K, V, entering state S and 1 <= j <= C: gamma_{j-1} S + K_j^T diag(r_j) "
              "v_new[:j] (the first j rows of the whole chunk's v_new) is the recurrence's state after j tokens",
        method="induction on the number m of tokens after the checkpoint: base m = 0 is CF-2 on the first j "
               "tokens; step m -> m + 1: appending one token to a chunk leaves the first rows of its v_new "
               "unchanged (the gated inverse extends as [[Ag, 0], [-l Ag, 1]] [L-blockinv]), so the first j "
               "rows of the longer chunk's v_new are the j-token chunk's",
        uses=CF_LEMMAS + ("CF-2",),
        steps=[
            Eq("base: m = 0, the checkpoint at the chunk's end is CF-2's end state", form(ch, S, cf_C["v_new"]), S_C, state),
            *ext.inverse_steps("gated"),
            Eq("step: the first C rows of the (C + 1)-token chunk's v_new are the C-token chunk's v_new", top, cf_C["v_new"],
               rules),
            Eq("step: the checkpoint after C tokens read from the (C + 1)-token chunk's v_new is S_C", form(ch, S, top), S_C,
               rules + state),
        ],
    )


CF_4 = register(Identity(
    id="CF-4",
    statement="a checkpoint after the first j tokens of a chunk is the masked end-state update with the whole chunk's v_new",
    latex=r"S_j = \gamma_{j-1} S + K_{:j}^\top \operatorname{diag}(e^{g_{j-1} - g_i})_{i<j}\, (U - W S)_{:j}",
    build=_checkpoints,
    sizes=((3, 2, 2), (4, 2, 1), (5, 1, 1)),
    twins=("reference.gdn.recurrent.recurrent_gated_delta_rule", "reference.gdn.chunk.chunk_checkpoint_states"),
    source="issue 43 (serving checkpoints at any token); research/fla-gdn.md 2.2",
    general=lambda: _checkpoint_proof(),
))

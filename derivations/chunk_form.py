"""CF: the chunk form equals the token recurrence (outputs and chunk-end state).

A chunk entered with a non-zero state S: the C rank-1 updates of the recurrence collapse into the
WY/UT form with FLA's gated A = (I + tril_-1(diag(beta) (K K^T * Gamma)))^-1 (research/fla-gdn.md
section 2.2):

    w = A diag(beta gamma) K,   u = A diag(beta) V,   v_new = u - w S
    O = scale (D Q S + (Q K^T * Gamma_causal) v_new)
    S' = gamma_C S + K^T diag(r) v_new
"""

from __future__ import annotations

from derivations._chunk import Chunk, mat
from derivations._core import Identity, register

import sympy as sp

TWINS = ("reference.gdn.recurrent.recurrent_gated_delta_rule", "reference.gdn.chunk.chunk_gated_delta_rule_fwd")


def _outputs(C, K, V):
    ch, S0, scale = Chunk(C, K, V), mat("s", K, V), sp.Symbol("scale", positive=True)
    O_rec, _, _ = ch.recurrence(S0, scale)
    return O_rec, ch.chunk_form(S0, scale)["o"]


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


CF_1 = register(Identity(
    id="CF-1",
    statement="chunk-form outputs equal the token recurrence's, for a chunk entered with a state S",
    latex=r"o_t = \mathrm{scale}\, S_t^\top q_t \;\Longleftrightarrow\; O = \mathrm{scale}\,(D Q S + (Q K^\top \odot \Gamma)(U - W S))",
    build=_outputs,
    sizes=((3, 2, 2), (4, 2, 1), (4, 3, 2)),
    twins=TWINS,
    source="FLA chunk_gated_delta_rule_fwd; research/fla-gdn.md 2.2",
))

CF_2 = register(Identity(
    id="CF-2",
    statement="chunk-form end state equals the token recurrence's, for a chunk entered with a state S",
    latex=r"S_C = \gamma_C S + K^\top \operatorname{diag}(r)\,(U - W S)",
    build=_state,
    sizes=((3, 2, 2), (4, 2, 1)),
    twins=TWINS,
    source="FLA chunk_gated_delta_rule_fwd_h; research/fla-gdn.md 2.2",
))

CF_3 = register(Identity(
    id="CF-3",
    statement="v_new = u - w S is the recurrence's per-token write beta_t (v_t - a_t S_{t-1}^T k_t)",
    latex=r"(U - W S)_t = \beta_t\,(v_t - a_t S_{t-1}^\top k_t)",
    build=_deltas,
    sizes=((3, 2, 2), (4, 2, 1)),
    twins=("reference.gdn.fused.recurrent_deltas", "reference.gdn.chunk.chunk_fwd_h"),
    source="research/fla-gdn.md 2.2 step 5",
))

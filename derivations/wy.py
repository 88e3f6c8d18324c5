"""WY: the WY/UT representation of a chunk's C gated rank-1 updates, and FLA's blockwise solve.

The chunk maps its entering state affinely, S' = M S + F, with M the product of the gated rank-1
factors a_t (I - beta_t k_t k_t^T) and F the sum of the writes carried to the chunk end. The WY/UT
form writes both with one C x C unit lower-triangular matrix, FLA's gated
A = (I + tril_-1(diag(beta) (K K^T * Gamma)))^-1:

    M = gamma_C I - K^T diag(r) W,   W = A diag(beta gamma) K            (WY-1)
    F = K^T diag(r) U,               U = A diag(beta) V                   (WY-2)

`solve_tril` computes A blockwise (research/fla-gdn.md section 5.3): forward substitution inside each
diagonal block (WY-3), then the off-diagonal blocks of the inverse from the diagonal ones (WY-4):

    Ai_ii = (I + L_ii)^-1,   Ai_ij = -Ai_ii sum_{m=j}^{i-1} L_im Ai_mj   (i > j)

The sm_90 prepare kernel merges the four diagonal-block inverses with four dense n x n products
instead (WY-5): with D the block-diagonal part of I + L and E the strictly block-lower part,
I + L = D (I + F), F = D^-1 E, and F^4 = 0 for four blocks, so

    (I + L)^-1 = (I - F + F^2 - F^3) D^-1 = (I - F)(I + F^2) D^-1          (WY-5)
"""

from __future__ import annotations

import sympy as sp

from derivations._chunk import Chunk, mat, prod
from derivations._core import Identity, register


def _factor(ch: Chunk, t: int) -> sp.Matrix:
    kt = ch.k[t, :].T
    return ch.a[t] * (sp.eye(ch.K) - ch.beta[t] * kt * kt.T)


def _product(C, K):
    ch = Chunk(C, K, 1)
    lhs = prod(_factor(ch, t) for t in reversed(range(C))) if C else sp.eye(K)
    w = ch.chunk_form(sp.zeros(K, 1))["w"]
    rhs = ch.gamma_C * sp.eye(K) - ch.k.T * sp.diag(*ch.r) * w
    return lhs, rhs


def _writes(C, K, V):
    ch = Chunk(C, K, V)
    lhs = sp.zeros(K, V)
    for t in range(C):
        carry = sp.eye(K)
        for s in range(t + 1, C):
            carry = _factor(ch, s) * carry
        lhs += carry * ch.beta[t] * ch.k[t, :].T * ch.v[t, :]
    u = ch.chunk_form(sp.zeros(K, V))["u"]
    return lhs, ch.k.T * sp.diag(*ch.r) * u


def forward_substitution(L: sp.Matrix) -> sp.Matrix:
    """(I + L)^-1 of a strictly lower L as FLA's diagonal-block kernel computes it: X = -L, then row by
    row X_i = a + sum_{m<i} a_m X_m with a = -L[i, :i], then add I."""
    n = L.rows
    X = -L
    for i in range(1, n):
        a = -L[i, :i]
        row = a.row_join(sp.zeros(1, n - i))
        for m in range(i):
            row += a[m] * X[m, :]
        X[i, :] = row
    return X + sp.eye(n)


def _strictly_lower(n: int) -> sp.Matrix:
    l = mat("l", n, n)
    return sp.Matrix(n, n, lambda i, j: l[i, j] if i > j else 0)


def _diagonal_block(n):
    L = _strictly_lower(n)
    return (sp.eye(n) + L) * forward_substitution(L), sp.eye(n)


def block_merge(L: sp.Matrix, block: int) -> sp.Matrix:
    """(I + L)^-1 from the inverses of its diagonal blocks (FLA's merge_16x16_to_64x64 pattern)."""
    nb = L.rows // block
    Lb = lambda i, j: L[i * block : (i + 1) * block, j * block : (j + 1) * block]  # noqa: E731
    Ai = {(i, i): forward_substitution(Lb(i, i)) for i in range(nb)}
    for d in range(1, nb):
        for j in range(nb - d):
            i = j + d
            acc = sp.zeros(block, block)
            for m in range(j, i):
                acc += Lb(i, m) * Ai[(m, j)]
            Ai[(i, j)] = -Ai[(i, i)] * acc
    out = sp.zeros(L.rows, L.rows)
    for (i, j), X in Ai.items():
        out[i * block : (i + 1) * block, j * block : (j + 1) * block] = X
    return out


def _merge(nblocks, block):
    n = nblocks * block
    L = _strictly_lower(n)
    return (sp.eye(n) + L) * block_merge(L, block), sp.eye(n)


WY_1 = register(Identity(
    id="WY-1",
    statement="product of a chunk's gated rank-1 factors = gamma_C I - K^T diag(r) W, W = A diag(beta gamma) K",
    latex=r"\prod_{t=C-1}^{0} a_t (I - \beta_t k_t k_t^\top) = \gamma_C I - K^\top \operatorname{diag}(r)\, A\, \operatorname{diag}(\beta\gamma) K,"
    r"\quad A = (I + \operatorname{tril}_{-1}(\operatorname{diag}(\beta)(K K^\top \odot \Gamma)))^{-1}",
    build=_product,
    sizes=((3, 2), (4, 3)),
    size_names=("C", "K"),
    twins=("reference.gdn.fused.chunk_transition_rank1", "reference.gdn.fused.chunk_transition_wy"),
    source="Yang et al., Gated Delta Networks (2024); FLA recompute_w_u_fwd",
))

WY_2 = register(Identity(
    id="WY-2",
    statement="the chunk's writes carried to its end = K^T diag(r) U, U = A diag(beta) V",
    latex=r"\sum_t \Big[\prod_{s>t} a_s (I - \beta_s k_s k_s^\top)\Big] \beta_t k_t v_t^\top = K^\top \operatorname{diag}(r)\, A \operatorname{diag}(\beta) V",
    build=_writes,
    sizes=((3, 2, 2), (4, 2, 1)),
    twins=("reference.gdn.fused.chunk_state_input_rank1", "reference.gdn.fused.chunk_state_input_wy"),
    source="FLA recompute_w_u_fwd, chunk_gated_delta_rule_fwd_h (zero entering state)",
))

WY_3 = register(Identity(
    id="WY-3",
    statement="forward substitution in a diagonal block (FLA's row recursion) inverts I + L_ii",
    latex=r"X = -L,\; X_{i,:} = a + \textstyle\sum_{m<i} a_m X_{m,:},\; a = -L_{i,:i} \;\Rightarrow\; (I + L)(X + I) = I",
    build=_diagonal_block,
    sizes=((4,), (6,)),
    size_names=("n",),
    twins=("reference.gdn.fused.solve_tril_diagonal_blocks", "reference.gdn.chunk.solve_tril"),
    source="FLA solve_tril_16x16_kernel; research/fla-gdn.md 5.3",
))

WY_4 = register(Identity(
    id="WY-4",
    statement="solve_tril block merge: Ai_ij = -Ai_ii sum_m L_im Ai_mj from diagonal-block inverses gives (I+L)^-1",
    latex=r"A_{ij} = -A_{ii} \sum_{m=j}^{i-1} L_{im} A_{mj}\ (i>j),\ A_{ii} = (I + L_{ii})^{-1} \;\Rightarrow\; (I + L) A = I",
    build=_merge,
    sizes=((4, 2), (3, 3), (4, 1)),
    size_names=("blocks", "block"),
    twins=("reference.gdn.fused.solve_tril_blocks", "reference.gdn.chunk.solve_tril"),
    source="FLA merge_16x16_to_64x64_inverse_kernel, fused kkt+solve kernel; research/fla-gdn.md 5.3",
))


def nilpotent_merge(L: sp.Matrix, block: int) -> sp.Matrix:
    """(I + L)^-1 as the sm_90 prepare kernel forms it from the diagonal-block inverses D^-1:
    F = D^-1 E (E the strictly block-lower part of L), then (I - F)(I + F^2) D^-1 (needs 4 blocks)."""
    n = L.rows
    Dinv = sp.zeros(n, n)
    E = sp.zeros(n, n)
    for i in range(n // block):
        sl = slice(i * block, (i + 1) * block)
        Dinv[sl, sl] = forward_substitution(L[sl, sl])
    for r in range(n):
        for c in range(n):
            if r // block > c // block:
                E[r, c] = L[r, c]
    F = Dinv * E
    return (sp.eye(n) - F) * (sp.eye(n) + F * F) * Dinv


def _nilpotent(block):
    n = 4 * block
    L = _strictly_lower(n)
    return (sp.eye(n) + L) * nilpotent_merge(L, block), sp.eye(n)


WY_5 = register(Identity(
    id="WY-5",
    statement="4-block inverse by a nilpotent series: (I+L)^-1 = (I-F)(I+F^2) D^-1, F = D^-1 E, F^4 = 0",
    latex=r"I + L = D (I + F),\ F = D^{-1} E,\ F^4 = 0 \;\Rightarrow\; (I + L)^{-1} = (I - F)(I + F^2) D^{-1}",
    build=_nilpotent,
    sizes=((1,), (2,)),
    size_names=("block",),
    twins=("reference.gdn.fused.solve_tril_nilpotent", "reference.gdn.chunk.solve_tril"),
    source="flashqla sm_90 prepare kernel (flashqla/ops/gdn/kernels/sm90/prepare.py)",
))

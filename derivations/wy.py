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

A product form merges the four diagonal-block inverses with four dense n x n products instead
(WY-5; an earlier form of the sm_90 prepare kernel's inverse, which now applies WY-4 with two blocks
recursively from 8 x 8 diagonal blocks): with D the block-diagonal part of I + L and E the strictly block-lower part,
I + L = D (I + F), F = D^-1 E, and F^4 = 0 for four blocks, so

    (I + L)^-1 = (I - F + F^2 - F^3) D^-1 = (I - F)(I + F^2) D^-1          (WY-5)

General proofs (every size):
- WY-1, WY-2: induction on the chunk length C, as the CF records (`derivations.chunk_form`): the product
  of C + 1 factors is one factor times the product of C, the chunk quantities at C + 1 are block matrices
  [L-gate, L-gamma, L-mask-blocks], the gated inverse extends by [L-blockinv].
- WY-3: induction on the row i: after rows < i, X + I is the inverse of the leading i x i block; the
  recursion's row i is a (I + X) = -l (I + X) (a = -l, l = L[i, :i]), the last row of the block inverse
  [[I + L_i, 0], [l, 1]]^-1 [L-blockinv].
- WY-4: induction on the number of blocks m, any block size n: the merge's block row m is
  -A_mm sum_{k=j}^{m-1} L_mk A_kj = -A_mm (R A^(m))_j [L-sum-range: A^(m) is block lower triangular], the
  last block row of [[I + L^(m), 0], [R, I + L_mm]]^-1 [L-blockinv].
- WY-5: the four-block product at any block size n (4 x 4 block matrices of n x n generators):
  D + E = D (I + F), F^4 = 0 by block multiplication, and (D + E)(I - F)(I + F^2) D^-1 = I.
- WY-6: a diagonal block of size n <= 8 inverted by products alone (the first level of the sm_90
  kernels' inverse as mma.sync products, instead of WY-3's row recursion): L strictly lower, L^8 = 0,
  (I + L)(I - L)(I + L^2)(I + L^4) = I - L^8 = I (a telescoping product; non-commutative reduction
  with L^8 = 0).
"""

from __future__ import annotations

import sympy as sp

from . import _nc
from ._chunk import Chunk, chunk_form, mat, prod
from ._core import Identity, register
from ._nc import Block, eye, rules_from, sym, zeros
from ._proof import Entry, Eq, Proof
from ._symbolic import Csym, Ext, GChunk, Ksym, One, Vsym


def _factor(ch: Chunk, t: int) -> sp.Matrix:
    kt = ch.k[t, :].T
    return ch.a[t] * (sp.eye(ch.K) - ch.beta[t] * kt * kt.T)


def product_form(ch, I_K):
    """gamma_C I - K^T diag(r) W, W = A diag(beta gamma) K (concrete or symbolic chunk)."""
    w = chunk_form(ch, _zero_state(ch), 1)["w"]
    return ch.gamma_C * I_K - ch.k.T * ch.Dr * w


def writes_form(ch):
    """K^T diag(r) U, U = A diag(beta) V (concrete or symbolic chunk)."""
    u = chunk_form(ch, _zero_state(ch), 1)["u"]
    return ch.k.T * ch.Dr * u


def _zero_state(ch):
    return sp.zeros(ch.K, ch.V) if isinstance(ch, Chunk) else zeros(ch.K, ch.V)


def _product(C, K):
    ch = Chunk(C, K, 1)
    lhs = prod(_factor(ch, t) for t in reversed(range(C))) if C else sp.eye(K)
    return lhs, product_form(ch, sp.eye(K))


def _writes(C, K, V):
    ch = Chunk(C, K, V)
    lhs = sp.zeros(K, V)
    for t in range(C):
        carry = sp.eye(K)
        for s in range(t + 1, C):
            carry = _factor(ch, s) * carry
        lhs += carry * ch.beta[t] * ch.k[t, :].T * ch.v[t, :]
    return lhs, writes_form(ch)


def forward_substitution(L: sp.Matrix) -> sp.Matrix:
    """(I + L)^-1 of a strictly lower L as FLA's diagonal-block kernel computes it: X = -L, then row by
    row X_i = a + sum_{m<i} a_m X_m with a = -L[i, :i], then add I."""
    n = L.rows
    X = -L
    for i in range(1, n):
        a = -L[i, :i]
        # sum_{m<i} a_m X_m is the row a times the rows X[:i] (zero from column i on)
        row = fs_row(a, X[:i, :i])
        X[i, :] = row.row_join(sp.zeros(1, n - i))
    return X + sp.eye(n)


def fs_row(a, X_prev):
    """Row i of forward substitution, columns < i: a + sum_{m<i} a_m X_m = a + a X_prev (a = -L[i, :i],
    X_prev the rows and columns < i of X); one code for the concrete and the general proof."""
    return a + a * X_prev


def _strictly_lower(n: int) -> sp.Matrix:
    l = mat("l", n, n)
    return sp.Matrix(n, n, lambda i, j: l[i, j] if i > j else 0)


def _diagonal_block(n):
    L = _strictly_lower(n)
    return (sp.eye(n) + L) * forward_substitution(L), sp.eye(n)


#: the merge's sum over m starts at j + MERGE_START (0; the tests shift it to check that a broken merge
#: fails both its concrete check and its general proof)
MERGE_START = 0


def block_merge(L: sp.Matrix, block: int) -> sp.Matrix:
    """(I + L)^-1 from the inverses of its diagonal blocks (FLA's merge_16x16_to_64x64 pattern)."""
    nb = L.rows // block
    Lb = lambda i, j: L[i * block : (i + 1) * block, j * block : (j + 1) * block]  # noqa: E731
    Ai = {(i, i): forward_substitution(Lb(i, i)) for i in range(nb)}
    for d in range(1, nb):
        for j in range(nb - d):
            i = j + d
            acc = sp.zeros(block, block)
            for m in range(j + MERGE_START, i):
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
    sizes=((3, 2), (4, 3), (6, 2)),
    size_names=("C", "K"),
    twins=("reference.gdn.fused.chunk_transition_rank1", "reference.gdn.fused.chunk_transition_wy"),
    source="Yang et al., Gated Delta Networks (2024); FLA recompute_w_u_fwd",
    general=lambda: _general_chunk("product"),
))

WY_2 = register(Identity(
    id="WY-2",
    statement="the chunk's writes carried to its end = K^T diag(r) U, U = A diag(beta) V",
    latex=r"\sum_t \Big[\prod_{s>t} a_s (I - \beta_s k_s k_s^\top)\Big] \beta_t k_t v_t^\top = K^\top \operatorname{diag}(r)\, A \operatorname{diag}(\beta) V",
    build=_writes,
    sizes=((3, 2, 2), (4, 2, 1), (6, 2, 1)),
    twins=("reference.gdn.fused.chunk_state_input_rank1", "reference.gdn.fused.chunk_state_input_wy"),
    source="FLA recompute_w_u_fwd, chunk_gated_delta_rule_fwd_h (zero entering state)",
    general=lambda: _general_chunk("writes"),
))

WY_3 = register(Identity(
    id="WY-3",
    statement="forward substitution in a diagonal block (FLA's row recursion) inverts I + L_ii",
    latex=r"X = -L,\; X_{i,:} = a + \textstyle\sum_{m<i} a_m X_{m,:},\; a = -L_{i,:i} \;\Rightarrow\; (I + L)(X + I) = I",
    build=_diagonal_block,
    sizes=((4,), (6,), (8,)),
    size_names=("n",),
    twins=("reference.gdn.fused.solve_tril_diagonal_blocks", "reference.gdn.chunk.solve_tril"),
    source="FLA solve_tril_16x16_kernel; research/fla-gdn.md 5.3",
    general=lambda: _general_forward_substitution(),
))

WY_4 = register(Identity(
    id="WY-4",
    statement="solve_tril block merge: Ai_ij = -Ai_ii sum_m L_im Ai_mj from diagonal-block inverses gives (I+L)^-1",
    latex=r"A_{ij} = -A_{ii} \sum_{m=j}^{i-1} L_{im} A_{mj}\ (i>j),\ A_{ii} = (I + L_{ii})^{-1} \;\Rightarrow\; (I + L) A = I",
    build=_merge,
    sizes=((4, 2), (3, 3), (4, 1), (4, 3)),
    size_names=("blocks", "block"),
    twins=("reference.gdn.fused.solve_tril_blocks", "reference.gdn.chunk.solve_tril"),
    source="FLA merge_16x16_to_64x64_inverse_kernel, fused kkt+solve kernel; research/fla-gdn.md 5.3",
    general=lambda: _general_merge(),
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
    return nilpotent_series(F, sp.eye(n)) * Dinv


def nilpotent_series(F, I):
    """(I + F)^-1 for F^4 = 0, as the kernel multiplies it: (I - F)(I + F^2) (= I - F + F^2 - F^3);
    one code for the concrete and the general proof."""
    return (I - F) * (I + F * F)


def _nilpotent(block):
    n = 4 * block
    L = _strictly_lower(n)
    return (sp.eye(n) + L) * nilpotent_merge(L, block), sp.eye(n)


WY_5 = register(Identity(
    id="WY-5",
    statement="4-block inverse by a nilpotent series: (I+L)^-1 = (I-F)(I+F^2) D^-1, F = D^-1 E, F^4 = 0",
    latex=r"I + L = D (I + F),\ F = D^{-1} E,\ F^4 = 0 \;\Rightarrow\; (I + L)^{-1} = (I - F)(I + F^2) D^{-1}",
    build=_nilpotent,
    sizes=((1,), (2,), (3,)),
    size_names=("block",),
    twins=("reference.gdn.fused.solve_tril_nilpotent", "reference.gdn.chunk.solve_tril"),
    source="flashqla sm_90 prepare kernel (flashqla/ops/gdn/kernels/sm90/prepare.py)",
    general=lambda: _general_nilpotent(),
))


def block_product_inverse(L, I):
    """(I + L)^-1 for a strictly lower L of size <= 8 by products alone, as the mma level multiplies
    it: X2 = (I - L)(I + L^2), then X2 (I + L^4); one code for the concrete and the general proof."""
    L2 = L * L
    X2 = (I - L) * (I + L2)
    return X2 * (I + L2 * L2)


def _block_product(n):
    L = _strictly_lower(n)
    return (sp.eye(n) + L) * block_product_inverse(L, sp.eye(n)), sp.eye(n)


def _general_block_product() -> Proof:
    n = sp.Symbol("n", integer=True, positive=True)
    L = sym("L", n, n)
    I = eye(n)
    L8 = L * L * L * L * L * L * L * L
    rules = rules_from(L8, zeros(n, n), "def")  # the claim's premise, L^8 = 0
    return Proof(
        claim="for every n x n L with L^8 = 0 (every strictly lower L of size n <= 8): "
              "(I + L)(I - L)(I + L^2)(I + L^4) = I",
        method="non-commutative reduction with L^8 = 0 (the product telescopes to I - L^8)",
        uses=(),
        steps=[Eq("(I + L)(I - L)(I + L^2)(I + L^4) = I", (I + L) * block_product_inverse(L, I), I, rules)],
    )


WY_6 = register(Identity(
    id="WY-6",
    statement="a diagonal block of size <= 8 by products: (I+L)^-1 = (I-L)(I+L^2)(I+L^4), L strictly lower",
    latex=r"L^8 = 0 \;\Rightarrow\; (I + L)^{-1} = (I - L)(I + L^2)(I + L^4)",
    build=_block_product,
    sizes=((2,), (4,), (8,)),
    size_names=("n",),
    twins=("reference.gdn.fused.solve_tril_block_product", "reference.gdn.fused.solve_tril_diagonal_blocks"),
    source="flashqla sm_90 inverse, first level by mma (flashqla/ops/gdn/kernels/sm90/prepare.py, diagonal_blocks_8x8_mma)",
    general=lambda: _general_block_product(),
))


# ------------------------------------------------------------------------------------------------
# general proofs
# ------------------------------------------------------------------------------------------------


def _general_chunk(which: str) -> Proof:
    """WY-1 ("product") or WY-2 ("writes") by induction on C."""
    one, ch = One(), GChunk()
    ext = Ext(ch)
    t1, tn = one.tok, ext.tok
    I_K = eye(Ksym)

    def factor(t):
        return t["a"] * (I_K - t["beta"] * t["k"] * t["k"].T)

    P_C = sym("P_C", Ksym, Ksym) if which == "product" else sym("F_C", Ksym, Vsym)
    if which == "product":
        base = (product_form(one, I_K), factor(t1))
        hyp = rules_from(P_C, product_form(ch, I_K), "hyp", transpose=False)
        step = (product_form(ext, I_K), factor(tn) * P_C)
        what = "the product of the C gated rank-1 factors equals gamma_C I - K^T diag(r) W"
    else:
        base = (writes_form(one), t1["beta"] * t1["k"] * t1["v"].T)
        hyp = rules_from(P_C, writes_form(ch), "hyp", transpose=False)
        step = (writes_form(ext), factor(tn) * P_C + tn["beta"] * tn["k"] * tn["v"].T)
        what = "the C writes carried to the chunk end equal K^T diag(r) U"
    return Proof(
        claim=f"for every C >= 1, K (and V): {what}",
        method="induction on C: base C = 1; step C -> C + 1 multiplies by the new token's factor "
               "(F_{C+1} = a (I - beta k k^T) F_C + beta k v^T); block matrices split C + 1",
        uses=("L-gate", "L-gamma", "L-ut", "L-blockinv"),
        steps=[Eq("base: L_gated = 0 at C = 1, so A = 1", one.L_gated, zeros(1, 1)),
               Eq("base", *base),
               *ext.inverse_steps("gated"),
               Eq("step", step[0], step[1], ch.rules("gated") + hyp)],
    )


def _general_forward_substitution() -> Proof:
    n = sp.Symbol("i", integer=True, positive=True)  # rows already done
    Ln, X = sym("L_i", n, n), sym("X_i", n, n)  # leading strictly lower block; X after rows < i
    ell = sym("l", 1, n)  # L[i, :i]
    I = eye(n)
    hyp = rules_from(Ln * X, -Ln - X, "hyp") + rules_from(X * Ln, -Ln - X, "hyp")  # (I + L_i)(I + X_i) = I, both sides
    row = fs_row(-ell, X)
    T = Block([[I + Ln, zeros(n, 1)], [ell, eye(1)]])
    Xn = Block([[I + X, zeros(n, 1)], [row, eye(1)]])
    return Proof(
        claim="for every n: the row recursion's X satisfies (I + L)(X + I) = I",
        method="induction on the row i (i = 1: X = 0, the 1 x 1 block); step: rows < i done, "
               "the new row a + a X_i = -l (I + X_i) is the last row of the block inverse",
        uses=("L-blockinv",),
        steps=[Eq("base: X = 0 inverts the 1 x 1 block", eye(1) * eye(1), eye(1)),
               Eq("step: the new row is -l (I + X_i)", row, -(ell * (I + X))),
               Eq("step: [[I + L_i, 0], [l, 1]] [[I + X_i, 0], [row, 1]] = I", T * Xn, Block.eye(n, 1), hyp),
               Eq("step: [[I + X_i, 0], [row, 1]] [[I + L_i, 0], [l, 1]] = I", Xn * T, Block.eye(n, 1), hyp)],
    )


def _merge_sum_check(start: int):
    """The merge's sum_{k=j+start}^{m-1} L_mk A_kj against the block row product sum_{k=0}^{m-1} L_mk A_kj
    with A block lower triangular (A_kj = 0 for k < j) [L-sum-range]."""
    k = sp.Symbol("k", integer=True)
    p, q, s, t = sp.symbols("p_ q_ s_ t_", integer=True, nonnegative=True)
    Lmk, Akj = sp.Function("Lm"), sp.Function("A")
    j, m = p, p + 1 + q  # 0 <= j < m
    full = sp.Piecewise((Lmk(k) * Akj(k, j), k >= j), (0, True))  # A^(m) block lower triangular
    merge_lo = j + start

    def check():
        # split the full product at j; below j every summand is zero, from j on it is L_mk A_kj
        split = sp.simplify(sp.Sum(full, (k, 0, j - 1)) + sp.Sum(full, (k, j, m - 1)) - sp.Sum(full, (k, 0, m - 1)))
        if split != 0:
            return f"split: {split}"
        if sp.simplify(full.subs(k, j - 1 - s)) != 0:
            return "a summand below j is not zero"
        if sp.simplify(merge_lo - j) != 0:
            return f"the merge sums from k = {merge_lo}, the block row product from k = j"
        if sp.simplify((full - Lmk(k) * Akj(k, j)).subs(k, j + s)) != 0:
            return "summands differ from j on"
        return ""

    return check


def _general_merge(start: int | None = None) -> Proof:
    from ._proof import Check

    start = MERGE_START if start is None else start
    P, n = sp.Symbol("P", integer=True, positive=True), sp.Symbol("n", integer=True, positive=True)
    Mm, Am = sym("M", P, P), sym("Ai_m", P, P)  # I + L^(m) and its merged inverse (first m blocks, P = m n)
    R = sym("R", n, P)  # block row m of L, left of the diagonal
    Nn, An = sym("N", n, n), sym("Ai_mm", n, n)  # I + L_mm and its inverse (forward substitution, WY-3)
    rules = rules_from(Mm * Am, eye(P), "hyp") + rules_from(Am * Mm, eye(P), "hyp")
    rules += rules_from(Nn * An, eye(n), "WY-3") + rules_from(An * Nn, eye(n), "WY-3")
    row = -(An * (R * Am))  # the merge's block row m, by the sum check
    T = Block([[Mm, zeros(P, n)], [R, Nn]])
    X = Block([[Am, zeros(P, n)], [row, An]])
    return Proof(
        claim="for every number of blocks and every block size n: the merged blocks form (I + L)^-1",
        method="induction on the number of blocks m (m = 1: the diagonal block's inverse, WY-3); step: "
               "block row m of the merge is -A_mm R A^(m), the last block row of the block inverse",
        uses=("WY-3", "L-blockinv", "L-sum-range", "L-ut"),
        steps=[Check("step: the merge's sum is the block row product (A^(m) block lower triangular)", _merge_sum_check(start)),
               Eq("step: [[M, 0], [R, N]] [[A^(m), 0], [row, A_mm]] = I", T * X, Block.eye(P, n), rules),
               Eq("step: [[A^(m), 0], [row, A_mm]] [[M, 0], [R, N]] = I", X * T, Block.eye(P, n), rules)],
    )


def _general_nilpotent(series=None) -> Proof:
    series = nilpotent_series if series is None else series
    n = sp.Symbol("n", integer=True, positive=True)
    nb = 4
    Dd = [sym(f"D{i}", n, n) for i in range(nb)]  # I + L_ii
    Di = [sym(f"Dinv{i}", n, n) for i in range(nb)]  # their inverses (forward substitution, WY-3)
    rules = []
    for a, b in zip(Dd, Di):
        rules += rules_from(a * b, eye(n), "WY-3") + rules_from(b * a, eye(n), "WY-3")
    Z = lambda: zeros(n, n)  # noqa: E731
    E = Block([[sym(f"E{r}{c}", n, n) if r > c else Z() for c in range(nb)] for r in range(nb)])
    D = Block([[Dd[r] if r == c else Z() for c in range(nb)] for r in range(nb)])
    Dinv = Block([[Di[r] if r == c else Z() for c in range(nb)] for r in range(nb)])
    I = Block.eye(*([n] * nb))
    F = Dinv * E
    F4 = F * F * F * F
    zero = Block([[Z() for _ in range(nb)] for _ in range(nb)])
    return Proof(
        claim="for every block size n: with D the diagonal blocks of I + L and E its strictly block-lower part, "
              "(I + L) (I - F)(I + F^2) D^-1 = I, F = D^-1 E",
        method="4 x 4 block matrices of n x n generators; non-commutative reduction with D_i D_i^-1 = D_i^-1 D_i = I",
        uses=("WY-3",),
        steps=[Eq("D (I + F) = D + E = I + L", D * (I + F), D + E, rules),
               Eq("F^4 = 0 (strictly block lower, four blocks)", F4, zero, rules),
               Eq("(I + L) (I - F)(I + F^2) D^-1 = I", (D + E) * series(F, I) * Dinv, I, rules)],
    )

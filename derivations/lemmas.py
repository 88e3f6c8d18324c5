"""The lemmas of the general (all-sizes) proofs, each proved for every size.

Entry-level lemmas (masks, gates, diagonals, traces) are proved on the (i, j) entry with symbolic indices
and a symbolic size n: SymPy computes the entry of a product with diagonal matrices as a sum with
Kronecker deltas (``(DiagMatrix(p) X DiagMatrix(q))[i, j]``), masks are `Piecewise` in ``j - i``, and the
difference of the two sides must vanish on each region of the complete case split i > j, i = j, i < j
(`derivations._proof.REGIONS`). Matrix-level lemmas (inverses of unit lower-triangular and block
lower-triangular matrices, the differential of an inverse) are proved in the non-commutative algebra of
`derivations._nc`, by induction where the size grows.

    L-diag-commute    diagonal matrices commute; diag(x) diag(1/x) = I
    L-mask-diag       tril_d(P X Q) = P tril_d(X) Q for diagonal P, Q; tril_d(P) = P (d >= 0) or 0 (d < 0); triu alike
    L-mask-nested     tril_d(tril_e(X)) = tril_min(d,e)(X); triu_d(triu_e(X)) = triu_max(d,e)(X)
    L-mask-transpose  tril_d(X)^T = triu_-d(X^T)
    L-mask-blocks     tril_d [[X, Y], [Z, W]] = [[tril_d X, 0], [Z, tril_d W]] (d in {0, -1}, any split m + n)
    L-gate            Gamma * X = D tril_0(X) D^-1, Gamma_ij = gamma_i / gamma_j (i >= j) else 0, D = diag(gamma)
    L-gamma           prod_{s=j+1}^{i} a_s = gamma_i / gamma_j; r = gamma_{C-1} / gamma; gamma_C = a_C gamma_{C-1}
    L-diagpart        tril_0(X) = tril_-1(X) + diag(dg(X)), triu_0(X) = triu_1(X) + diag(dg(X)); diag(dg(X)) 1 = dg(X)
    L-scalar          a 1 x 1 matrix x^T y is a scalar and equals y^T x
    L-dg              dg(P X Q) = P Q dg(X), dg(X^T) = dg(X), dg(I) = 1, dg(tril_d X) = dg(X) (d >= 0) or 0
    L-dg-mask         a mask at either end of a dg moves onto the rest: dg(tril_d(x) R) = dg(x triu_-d(R)),
                      dg(R tril_d(x)) = dg(triu_-d(R) x) (triu alike)
    L-trace           tr(X Y) = tr(Y X), tr(X^T) = tr(X)
    L-adjoint         <H, X dY Z> = <X^T H Z^T, dY>, <H, dY^T> = <H^T, dY>, <H, tril_d dY> = <tril_d H, dY>,
                      <H, diag(y)> = <dg(H), y>; rowsum(X * Y) = dg(X Y^T), colsum(X * Y) = dg(X^T Y),
                      sum(X * Y) = tr(X^T Y), x * v = diag(x) v
    L-logdiag         D = diag(exp(eps)): dD = D diag(d eps), d(D^-1) = -diag(d eps) D^-1, d gamma_{C-1} = gamma_{C-1} d eps_{C-1}
    L-chain-gates     a_t d/da_t log gamma_i = [i >= t]  (gamma_i = prod_{s<=i} a_s)
    L-sum-range       sum_{k=0}^{m-1} [k >= j] f(k) = sum_{k=j}^{m-1} f(k)
    L-ut              (I + L)^-1 of a strictly lower L is unit lower triangular: tril_0(A) = A, tril_-1(A) = A - I
    L-blockinv        [[M, 0], [R, N]]^-1 = [[M^-1, 0], [-N^-1 R M^-1, N^-1]]
    L-dinv            A = (I + L)^-1  =>  dA = -A dL A
"""

from __future__ import annotations

import sympy as sp
from sympy.matrices.expressions.matexpr import MatrixElement

from . import _nc
from ._nc import Block, diag, eye, rules_from, sym, zeros
from ._proof import Check, Entry, Eq, Proof, REGIONS, lemma, region_vars

n = sp.Symbol("n", integer=True, positive=True)
i, j = sp.symbols("i j", integer=True, nonnegative=True)


def _mat(name, r=n, c=n):
    return sp.MatrixSymbol(name, r, c)


def _vec(name):
    return sp.MatrixSymbol(name, n, 1)


def _entry(expr, a=i, b=j):
    """Entry (a, b) of a SymPy matrix expression, sums over Kronecker deltas carried out."""
    return sp.sympify(expr[a, b]).doit()


def _mask(kind, x, d, a=i, b=j):
    cond = (b - a <= d) if kind == "tril" else (b - a >= d)
    return sp.Piecewise((x, cond), (0, True))


def _ij():
    return REGIONS["ij"](i, j, n)


def _subs_vec(expr, vec, fn):
    """Replaces every entry vec[a, 0] of a SymPy vector by fn(a)."""
    return expr.replace(lambda e: isinstance(e, MatrixElement) and e.parent == vec, lambda e: fn(e.i))


def _tr_sum(X):
    """tr(X) by its definition, sum_a X_aa (the entry of a product carried out as a sum)."""
    a = sp.Symbol("a_tr", integer=True, nonnegative=True)
    return sp.Sum(_entry(X, a, a), (a, 0, X.shape[0] - 1))


def _same_sums(a, b) -> str:
    """"" when two (nested) sums agree after renaming b's summation variables to a's and exchanging the
    order of b's sums where their bounds allow (finite sums)."""
    def flat(e):
        fn, lims = e, []
        while isinstance(fn, sp.Sum):
            lims = list(fn.limits) + lims
            fn = fn.function
        return fn, lims

    fa, la = flat(a)
    fb, lb = flat(b)
    if len(la) != len(lb):
        return f"{len(la)} vs {len(lb)} sums"
    import itertools

    for perm in itertools.permutations(range(len(lb))):
        lbp = [lb[k] for k in perm]
        if any(sp.simplify(x[1] - y[1]) != 0 or sp.simplify(x[2] - y[2]) != 0 for x, y in zip(la, lbp)):
            continue
        ren = {y[0]: x[0] for x, y in zip(la, lbp)}
        if sp.simplify(fa - fb.xreplace(ren)) == 0:
            return ""
    return f"{a} != {b}"


# ------------------------------------------------------------------------------------------------
# diagonals and masks
# ------------------------------------------------------------------------------------------------


@lemma("L-diag-commute", "diagonal matrices commute; diag(x) diag(1/x) = I")
def _diag_commute():
    p, q = _vec("p"), _vec("q")
    P, Q = sp.DiagMatrix(p), sp.DiagMatrix(q)
    inv = _subs_vec(_entry(P * sp.DiagMatrix(_vec("pinv"))), _vec("pinv"), lambda a: 1 / p[a, 0])
    return Proof(
        claim="P Q = Q P for diagonal P, Q (any n); diag(x) diag(1/x) = I",
        method="entry (i, j) with symbolic i, j, n; cases i > j, i = j, i < j",
        steps=[
            Entry("PQ = QP", _entry(P * Q) - _entry(Q * P), _ij()),
            Entry("diag(x) diag(1/x) = I", inv - sp.KroneckerDelta(i, j), _ij()),
        ],
    )


@lemma("L-mask-diag", "masks commute with diagonal factors: tril_d(P X Q) = P tril_d(X) Q; a masked diagonal is itself (diagonal kept) or 0")
def _mask_diag():
    P, Q, X, Y = sp.DiagMatrix(_vec("p")), sp.DiagMatrix(_vec("q")), _mat("X"), _mat("Y")
    steps = []
    for kind, ds in (("tril", (0, -1)), ("triu", (0, 1))):
        for d in ds:
            lhs = _mask(kind, _entry(P * X * Q), d)
            rhs = _entry(P * Y * Q).xreplace({Y[i, j]: _mask(kind, X[i, j], d)})
            steps.append(Entry(f"{kind}_{d}(P X Q) = P {kind}_{d}(X) Q", lhs - rhs, _ij()))
            kept = (d >= 0) if kind == "tril" else (d <= 0)
            steps.append(Entry(f"{kind}_{d}(P) = {'P' if kept else '0'}", _mask(kind, _entry(P), d) - (_entry(P) if kept else 0), _ij()))
    return Proof(claim="for d in {0, -1} (tril) and {0, 1} (triu), every n", method="entry (i, j), three cases", steps=steps)


@lemma("L-mask-nested", "tril_d(tril_e(X)) = tril_min(d,e)(X), triu_d(triu_e(X)) = triu_max(d,e)(X)")
def _mask_nested():
    X = _mat("X")
    steps = []
    for kind, ds in (("tril", (0, -1)), ("triu", (0, 1))):
        for d in ds:
            for e in ds:
                inner = _mask(kind, X[i, j], e)
                dd = min(d, e) if kind == "tril" else max(d, e)
                steps.append(Entry(f"{kind}_{d}({kind}_{e})", _mask(kind, inner, d) - _mask(kind, X[i, j], dd), _ij()))
    return Proof(claim="nested masks of one kind keep the stricter", method="entry (i, j), three cases", steps=steps)


@lemma("L-mask-transpose", "tril_d(X)^T = triu_-d(X^T)")
def _mask_transpose():
    X = _mat("X")
    steps = []
    for d in (0, -1, 1):
        lhs = _mask("tril", X[j, i], d, a=j, b=i)  # (tril_d X)^T at (i, j) = (tril_d X)_(j, i)
        rhs = _mask("triu", X.T[i, j], -d)
        steps.append(Entry(f"tril_{d}(X)^T = triu_{-d}(X^T)", lhs - rhs, _ij()))
    return Proof(claim="for d in {-1, 0, 1}, every n", method="entry (i, j), three cases", steps=steps)


@lemma("L-mask-blocks", "tril_d of a 2 x 2 block matrix (square diagonal blocks m, n): [[tril_d X, 0], [Z, tril_d W]], d in {0, -1}")
def _mask_blocks():
    m = sp.Symbol("m", integer=True, positive=True)
    p, q, s, t = region_vars()
    f = sp.Function("f")  # the entries of the whole (m + n) x (m + n) matrix
    steps = []
    for d in (0, -1):
        whole = lambda a, b: _mask("tril", f(a, b), d, a=a, b=b)  # noqa: E731
        # top-left: rows, cols < m keep their indices, so it is tril_d of X by definition
        # top-right: i < m <= j: zero
        steps.append(Entry(f"d={d} top-right", whole(p, m + q).subs(m, p + 1 + s), [{}]))
        # bottom-left: j < m <= i: Z itself
        steps.append(Entry(f"d={d} bottom-left", (whole(m + q, p) - f(m + q, p)).subs(m, p + 1 + s), [{}]))
        # bottom-right: i, j >= m, local (i - m, j - m): tril_d of W, same j - i
        a, b = m + i, m + j
        for reg in REGIONS["ij"](i, j, n):
            steps.append(Entry(f"d={d} bottom-right", (whole(a, b) - _mask("tril", f(a, b), d, a=i, b=j)).subs(reg), [{}]))
        # a 1 x 1 block (i = j = 0) is its own diagonal
        steps.append(Entry(f"d={d} 1x1", _mask("tril", f(0, 0), d, a=0, b=0) - (f(0, 0) if d >= 0 else 0), [{}]))
    return Proof(claim="for every split m + n and d in {0, -1}", method="entry (i, j) in each block, three cases where both indices range", steps=steps)


# ------------------------------------------------------------------------------------------------
# gates
# ------------------------------------------------------------------------------------------------


@lemma("L-gate", "Gamma * X = D tril_0(X) D^-1 for every X, Gamma_ij = gamma_i / gamma_j (i >= j) else 0, D = diag(gamma)")
def _gate():
    g, ginv, X, Y = _vec("gamma"), _vec("gammainv"), _mat("X"), _mat("Y")
    rhs = _entry(sp.DiagMatrix(g) * Y * sp.DiagMatrix(ginv)).xreplace({Y[i, j]: _mask("tril", X[i, j], 0)})
    rhs = _subs_vec(rhs, ginv, lambda a: 1 / g[a, 0])
    gam = sp.Piecewise((g[i, 0] / g[j, 0], i >= j), (0, True))
    # the strict mask of the same gates: Gamma_-1 * X = D tril_-1(X) D^-1
    rhs_s = _entry(sp.DiagMatrix(g) * Y * sp.DiagMatrix(ginv)).xreplace({Y[i, j]: _mask("tril", X[i, j], -1)})
    rhs_s = _subs_vec(rhs_s, ginv, lambda a: 1 / g[a, 0])
    gam_s = sp.Piecewise((g[i, 0] / g[j, 0], i > j), (0, True))
    return Proof(
        claim="the gated mask as a matrix statement, every n (and its strict version)",
        method="entry (i, j) with symbolic i, j, n; cases i > j, i = j, i < j",
        steps=[
            Entry("Gamma * X = D tril_0(X) D^-1", gam * X[i, j] - rhs, _ij()),
            Entry("Gamma_-1 * X = D tril_-1(X) D^-1", gam_s * X[i, j] - rhs_s, _ij()),
        ],
    )


@lemma("L-gamma", "token gates to cumulative gates: prod_{s=j+1}^{i} a_s = gamma_i / gamma_j, r_i = gamma_{C-1} / gamma_i, gamma_C = a_C gamma_{C-1}")
def _gamma():
    s_ = sp.Symbol("s", integer=True)
    la = sp.Function("log_a")  # log a_s: products become sums
    p, q, _, _ = region_vars()
    jj, ii = p, p + q  # j <= i
    lg = lambda a: sp.Sum(la(s_), (s_, 0, a))  # noqa: E731  log gamma_a
    return Proof(
        claim="for all 0 <= j <= i: log prod_{s=j+1}^{i} a_s = log gamma_i - log gamma_j, and gamma_{i+1} = a_{i+1} gamma_i",
        method="sums of log a_s with symbolic bounds (adjacent ranges combine)",
        steps=[
            Entry("Gamma_ij = gamma_i / gamma_j", sp.Sum(la(s_), (s_, jj + 1, ii)) + lg(jj) - lg(ii), [{}]),
            Entry("gamma_{i+1} = a_{i+1} gamma_i", lg(ii) + sp.Sum(la(s_), (s_, ii + 1, ii + 1)) - lg(ii + 1), [{}]),
            Entry("the single-term sum", sp.Sum(la(s_), (s_, ii + 1, ii + 1)).doit() - la(ii + 1), [{}]),
        ],
    )


@lemma("L-chain-gates", "a_t d/da_t log gamma_i = [i >= t] (gamma_i = prod_{s<=i} a_s)")
def _chain_gates():
    a = sp.IndexedBase("a", positive=True)
    s_, t = sp.Symbol("s", integer=True), sp.Symbol("t", integer=True, nonnegative=True)
    ii = sp.Symbol("i", integer=True, nonnegative=True)
    expr = (a[t] * sp.diff(sp.Sum(sp.log(a[s_]), (s_, 0, ii)), a[t])).doit()
    p, q, _, _ = region_vars()
    ind = sp.Piecewise((1, ii >= t), (0, True))
    return Proof(
        claim="for all i, t: a_t d log(gamma_i) / d a_t = 1 if t <= i else 0, so a_t dL/da_t = sum_{i >= t} gamma_i dL/dgamma_i",
        method="SymPy derivative of a symbolic sum, cases t <= i and t > i",
        steps=[Entry("a_t d/da_t log gamma_i", expr - ind, [{ii: t + p}, {t: ii + 1 + p}])],
    )


@lemma("L-logdiag", "D = diag(exp(eps)): dD = D diag(d eps), d(D^-1) = -diag(d eps) D^-1, d gamma_{C-1} = gamma_{C-1} d eps_{C-1}")
def _logdiag():
    e = sp.Symbol("eps", real=True)
    return Proof(
        claim="entrywise: d exp(eps) / d eps = exp(eps), d exp(-eps) / d eps = -exp(-eps)",
        method="SymPy derivative of one entry (diagonal matrices act entrywise)",
        steps=[
            Entry("d exp(eps)", sp.diff(sp.exp(e), e) - sp.exp(e), [{}]),
            Entry("d exp(-eps)", sp.diff(sp.exp(-e), e) + sp.exp(-e), [{}]),
        ],
    )


# ------------------------------------------------------------------------------------------------
# diagonals of products, traces, adjoints
# ------------------------------------------------------------------------------------------------


@lemma("L-dg", "dg(P X Q) = P Q dg(X), dg(X^T) = dg(X), dg(I) = 1, dg(tril_d X) = dg(X) (diagonal kept) or 0")
def _dg():
    P, Q, X = sp.DiagMatrix(_vec("p")), sp.DiagMatrix(_vec("q")), _mat("X")
    p, q = _vec("p"), _vec("q")
    steps = [
        Entry("dg(P X Q)_i = p_i q_i X_ii", _entry(P * X * Q, i, i) - p[i, 0] * q[i, 0] * X[i, i], [{n: i + 1 + sp.Symbol("s_", integer=True, nonnegative=True)}]),
        Entry("dg(X^T) = dg(X)", X.T[i, i] - X[i, i], [{}]),
        Entry("dg(I) = 1", sp.Identity(n)[i, i] - 1, [{}]),
    ]
    for kind, d in (("tril", 0), ("tril", -1), ("triu", 0), ("triu", 1)):
        kept = (d >= 0) if kind == "tril" else (d <= 0)
        steps.append(Entry(f"dg({kind}_{d} X)", _mask(kind, X[i, i], d, a=i, b=i) - (X[i, i] if kept else 0), [{}]))
    return Proof(claim="every n", method="entry (i, i)", steps=steps)


@lemma("L-diagpart", "tril_0(X) = tril_-1(X) + diag(dg(X)), triu_0(X) = triu_1(X) + diag(dg(X)); diag(dg(X)) 1 = dg(X)")
def _diagpart():
    X = _mat("X")
    dpart = sp.KroneckerDelta(i, j) * X[i, i]
    one = sp.Symbol("s_", integer=True, nonnegative=True)
    return Proof(
        claim="every n",
        method="entry (i, j), three cases; the row sum of diag(dg(X))",
        steps=[
            Entry("tril_0 = tril_-1 + diagonal part", _mask("tril", X[i, j], 0) - _mask("tril", X[i, j], -1) - dpart, _ij()),
            Entry("triu_0 = triu_1 + diagonal part", _mask("triu", X[i, j], 0) - _mask("triu", X[i, j], 1) - dpart, _ij()),
            Entry("diag(dg(X)) 1 = dg(X)", sp.Sum(sp.KroneckerDelta(i, j) * X[i, i], (j, 0, n - 1)).doit() - X[i, i],
                  [{n: i + 1 + one}]),
        ],
    )


@lemma("L-scalar", "a 1 x 1 product x^T y (x, y n x 1) equals its transpose y^T x")
def _scalar():
    x, y = sp.MatrixSymbol("x", n, 1), sp.MatrixSymbol("y", n, 1)
    return Proof(
        claim="every n (a 1 x 1 matrix is a scalar: it commutes with every matrix as a scalar multiple)",
        method="the single entry as a sum",
        steps=[Check("x^T y = y^T x", lambda: _same_sums(_entry(x.T * y, 0, 0), _entry(y.T * x, 0, 0)))],
    )


@lemma("L-dg-mask", "a mask at either end of a dg moves onto the rest: dg(tril_d(x) R) = dg(x triu_-d(R)), dg(R tril_d(x)) = dg(triu_-d(R) x), and triu alike")
def _dg_mask():
    # dg(M(x) R)_i = sum_j M(x)_ij R_ji and dg(x M'(R))_i = sum_j x_ij M'(R)_ji: the summands agree for every j
    # when M' keeps (j, i) exactly when M keeps (i, j); mirrored, dg(R M(x))_i = sum_j R_ij M(x)_ji
    x, R = sp.Function("x"), sp.Function("R")
    steps = []
    for kind, d in (("tril", 0), ("tril", -1), ("tril", 1), ("triu", 0), ("triu", 1), ("triu", -1)):
        other = "triu" if kind == "tril" else "tril"
        front = _mask(kind, x(i, j), d) * R(j, i) - x(i, j) * _mask(other, R(j, i), -d, a=j, b=i)
        back = R(i, j) * _mask(kind, x(j, i), d, a=j, b=i) - _mask(other, R(i, j), -d) * x(j, i)
        steps.append(Entry(f"front {kind}_{d} -> {other}_{-d}: summand", front, _ij()))
        steps.append(Entry(f"back {kind}_{d} -> {other}_{-d}: summand", back, _ij()))
    return Proof(claim="the summands of the i-th diagonal entry agree for every j, so the sums agree (every n)",
                 method="summand (i, j), three cases", steps=steps)


@lemma("L-trace", "tr(X Y) = tr(Y X), tr(X^T) = tr(X)")
def _trace_lemma():
    m = sp.Symbol("m", integer=True, positive=True)
    X, Y = sp.MatrixSymbol("X", n, m), sp.MatrixSymbol("Y", m, n)

    def cyclic():
        return _same_sums(_tr_sum(X * Y).doit(), _tr_sum(Y * X).doit())

    Z = sp.MatrixSymbol("Z", n, n)
    return Proof(
        claim="every n, m",
        method="the double sums, exchanged",
        steps=[Check("tr(XY) = tr(YX)", cyclic), Entry("tr(Z^T) = tr(Z)", _tr_sum(Z.T) - _tr_sum(Z), [{}])],
    )


@lemma("L-adjoint", "adjoints of products, transposes, masks and diagonals under <X, Y> = tr(X^T Y); rowsum/colsum/sum of X * Y as dg / tr")
def _adjoint():
    m, k = sp.symbols("m k", integer=True, positive=True)
    H, X, Z = sp.MatrixSymbol("H", n, m), sp.MatrixSymbol("X", n, k), sp.MatrixSymbol("Z", k, m)
    Yk = sp.MatrixSymbol("Yk", k, k)
    Hn, Yn = _mat("Hn"), _mat("Yn")

    def product():
        got = sp.diff(sp.Trace(H.T * X * Yk * Z), Yk)
        want = X.T * H * Z.T
        return "" if sp.simplify(got - want) == sp.ZeroMatrix(k, k) or got == want else f"{got} != {want}"

    def transpose():
        got = sp.diff(sp.Trace(Hn.T * Yn.T), Yn)
        return "" if got == Hn.T or sp.simplify(got - Hn.T) == sp.ZeroMatrix(n, n) else f"{got} != H^T"

    A, B = sp.MatrixSymbol("A", n, m), sp.MatrixSymbol("B", n, m)
    kk = sp.Symbol("kk", integer=True)
    y = _vec("y")
    steps = [
        Check("d<H, X Y Z>/dY = X^T H Z^T", product),
        Check("d<H, Y^T>/dY = H^T", transpose),
    ]
    for kind, d in (("tril", 0), ("tril", -1), ("triu", 0), ("triu", 1)):
        # summand (i, j) of <H, mask(dY)> and of <mask(H), dY>
        steps.append(Entry(f"<H, {kind}_{d} dY> = <{kind}_{d} H, dY>", Hn[i, j] * _mask(kind, Yn[i, j], d) - _mask(kind, Hn[i, j], d) * Yn[i, j], _ij()))
    steps += [
        Entry("<H, diag(y)> summand = dg(H)_i y_i [i = j]", Hn[i, j] * _entry(sp.DiagMatrix(y)) - sp.KroneckerDelta(i, j) * Hn[i, i] * y[i, 0], _ij()),
        Check("rowsum(A * B) = dg(A B^T)", lambda: _same_sums(_entry(A * B.T, i, i), sp.Sum(A[i, kk] * B[i, kk], (kk, 0, m - 1)))),
        Check("colsum(A * B) = dg(A^T B)", lambda: _same_sums(_entry(A.T * B, i, i), sp.Sum(A[kk, i] * B[kk, i], (kk, 0, n - 1)))),
    ]

    def total():
        return _same_sums(_tr_sum(A.T * B).doit(), sp.Sum(A[i, kk] * B[i, kk], (kk, 0, m - 1), (i, 0, n - 1)))

    steps.append(Check("sum(A * B) = tr(A^T B)", total))
    return Proof(claim="every shape", method="SymPy's matrix derivative of a trace; entries and summands with symbolic indices", steps=steps)


@lemma("L-sum-range", "sum_{k=0}^{m-1} [k >= j] f(k) = sum_{k=j}^{m-1} f(k)  (0 <= j <= m)")
def _sum_range():
    k = sp.Symbol("k", integer=True)
    p, q, s, _ = region_vars()
    f = sp.Function("f")
    jj, mm = p, p + q
    pw = sp.Piecewise((f(k), k >= jj), (0, True))
    return Proof(
        claim="for all 0 <= j <= m",
        method="split the range at j; every summand below j is zero",
        steps=[
            Entry("split", sp.Sum(pw, (k, 0, jj - 1)) + sp.Sum(pw, (k, jj, mm - 1)) - sp.Sum(pw, (k, 0, mm - 1)), [{}]),
            Entry("below j the summand is 0", pw.subs(k, jj - 1 - s), [{}]),
            Entry("from j on the summand is f(k)", (pw - f(k)).subs(k, jj + s), [{}]),
        ],
    )


# ------------------------------------------------------------------------------------------------
# inverses
# ------------------------------------------------------------------------------------------------

C = sp.Symbol("C", integer=True, positive=True)


def _inverse_rules(Mx, Mi, by):
    I = eye(Mx.shape[0])
    return rules_from(Mx * Mi, I, by) + rules_from(Mi * Mx, I, by)


@lemma("L-blockinv", "[[M, 0], [R, N]]^-1 = [[M^-1, 0], [-N^-1 R M^-1, N^-1]] for invertible M, N (any sizes)")
def _blockinv():
    m = sp.Symbol("m", integer=True, positive=True)
    Mx, Mi = sym("M", m, m), sym("Minv", m, m)
    Nx, Ni = sym("N", n, n), sym("Ninv", n, n)
    R = sym("R", n, m)
    T = Block([[Mx, zeros(m, n)], [R, Nx]])
    X = Block([[Mi, zeros(m, n)], [-(Ni * R * Mi), Ni]])
    rules = _inverse_rules(Mx, Mi, "def") + _inverse_rules(Nx, Ni, "def")
    return Proof(
        claim="both products are the identity, so the block matrix is the inverse (any block sizes m, n)",
        method="block multiplication, non-commutative reduction with M M^-1 = M^-1 M = I, N N^-1 = N^-1 N = I",
        steps=[Eq("T X = I", T * X, Block.eye(m, n), rules), Eq("X T = I", X * T, Block.eye(m, n), rules)],
    )


@lemma("L-ut", "the inverse A of I + L (L strictly lower triangular) is unit lower triangular: tril_0(A) = A, tril_-1(A) = A - I")
def _ut():
    # induction on the size: [[I + L, 0], [l, 1]]^-1 = [[A, 0], [-l A, 1]]
    Lc, A = sym("L", C, C), sym("A", C, C)
    l = sym("l", 1, C)
    I = eye(C)
    rules = rules_from(Lc * A, I - A, "def") + rules_from(A * Lc, I - A, "def")
    T = Block([[I + Lc, zeros(C, 1)], [l, eye(1)]])
    X = Block([[A, zeros(C, 1)], [-(l * A), eye(1)]])

    def shape_of_X():
        # the extended inverse: zero above the diagonal block, 1 on the new diagonal entry; with A unit
        # lower triangular (hypothesis) it is unit lower triangular
        if not X.grid[0][1].is_zero():
            return "top-right block not zero"
        if X.grid[1][1].terms != {(): 1}:
            return "new diagonal entry not 1"
        return ""

    return Proof(
        claim="for every C: (I + L)^-1 exists and is unit lower triangular",
        method="induction on C (C = 1: (1)^-1 = 1); step C -> C + 1 by the block inverse",
        uses=("L-blockinv",),
        steps=[
            Eq("step: T X = I", T * X, Block.eye(C, 1), rules),
            Eq("step: X T = I", X * T, Block.eye(C, 1), rules),
            Check("step: X unit lower triangular given A is", shape_of_X),
        ],
    )


@lemma("L-dinv", "A = (I + L)^-1  =>  dA = -A dL A")
def _dinv():
    Lc, A, dA, dL = sym("L", C, C), sym("A", C, C), sym("dA", C, C), sym("dL", C, C)
    I = eye(C)
    rules = rules_from(Lc * A, I - A, "def") + rules_from(A * Lc, I - A, "def")
    # differentiating A (I + L) = I: dA (I + L) + A dL = 0; multiply on the right by A
    hyp = rules_from(dA * Lc, -dA - A * dL, "def")  # dA (I + L) = -A dL, solved for its L term
    return Proof(
        claim="every C",
        method="differentiate A (I + L) = I and multiply by A = (I + L)^-1 on the right",
        steps=[Eq("dA = dA (I + L) A = -A dL A", dA * (I + Lc) * A, -(A * dL * A), hyp + rules),
               Eq("dA (I + L) A = dA", dA * (I + Lc) * A, dA, rules)],
    )

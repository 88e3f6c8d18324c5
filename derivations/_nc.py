"""Non-commutative matrix algebra at symbolic sizes: the engine of the general (all-sizes) proofs.

A matrix expression (`M`) is a linear combination of words: products of atoms, each atom a matrix of
symbolic shape (rows and columns are SymPy expressions such as ``C``, ``K``, ``C + 1`` or ``1``), with
commutative SymPy coefficients (the scalars: gates a, beta, gamma, scale). Atoms:

- `Sym`: a generator, a named matrix of symbolic shape (`sym`), optionally diagonal (`diag`, then
  symmetric and commuting with every other diagonal generator), optionally transposed.
- `Mask`: ``tril_d(w)`` (entries with j - i <= d kept) or ``triu_e(w)`` (entries with j - i >= e kept) of a
  word ``w``.
- `Dg`: the column vector of the diagonal of a square word, ``dg(w)_i = w_ii``.
- `Dp`: the diagonal part diag(dg(w)) of a square word, a diagonal atom.
Traces ``tr(w)`` and 1 x 1 stretches of words are scalars: each canonical one becomes a commutative SymPy
symbol (opaque: rules do not reach inside it, and `grad` refuses to differentiate through it).

What the engine takes as given (the axioms of the proofs, all standard matrix algebra): matrix product
is associative and distributes over sums; scalars commute with matrices; transposition reverses products
((XY)^T = Y^T X^T, (X^T)^T = X); block matrices add, multiply and transpose blockwise. Everything else is
a stated fact: every normalisation below is a lemma of `derivations.lemmas`, proved there at the entry
level for all sizes (its id in brackets), and every rewrite rule (`Rule`) names the lemma, definition or
induction hypothesis it comes from.

Normal form (`nf`):
- ``tril_0(w) = tril_-1(w) + diag(dg(w))`` and ``triu_0(w) = triu_1(w) + diag(dg(w))``: masks are kept
  strict, diagonal parts become diagonal atoms `Dp` (normalised like ``dg``) [L-diagpart];
- runs of adjacent diagonal atoms are sorted and ``X X^-1`` pairs of declared inverses cancel
  [L-diag-commute]; a 1 x 1 stretch of a word (a row times a column) becomes a commutative scalar
  symbol, the same for the stretch and its transpose [L-scalar];
- a mask of a sum is the sum of the masks; diagonal factors at either end of a masked word move out,
  ``tril_d(P w Q) = P tril_d(w) Q`` for diagonal P, Q [L-mask-diag]; a masked diagonal is itself (d >= 0)
  or zero (d < 0) [L-mask-diag]; a mask of a 1 x 1 block is itself (d >= 0) or zero [L-mask-blocks];
  nested lower masks keep the stricter one [L-mask-nested];
  ``tril_d(w)^T = triu_{-d}(w^T)`` [L-mask-transpose];
- ``dg`` is linear, ``dg(P w Q) = P Q dg(w)`` for diagonal P, Q, ``dg(w) = dg(w^T)``, ``dg(I) = 1``
  [L-dg]; ``dg(tril_d(w)) = dg(w)`` for d >= 0 and 0 for d < 0 [L-dg]; a mask at either end moves
  onto the rest of the word, ``dg(tril_d(x) R) = dg(x triu_-d(R))``, ``dg(R tril_d(x)) = dg(triu_-d(R) x)``
  (both sum x_ij R_ji over the same j) [L-dg-mask]; of all the words reached this way the least is kept;
- ``tr`` is linear, invariant under rotation and transposition [L-trace].

`nf` then rewrites with the rules until none applies: a rule ``lhs -> rhs`` replaces an occurrence of
the word ``lhs`` (diagonal atoms at the rule's ends are matched up to commutation with the word's
adjacent diagonal atoms [L-diag-commute]; every rule also comes without the invertible diagonal factors
at its ends, their inverses moved to the other side); inside a mask, dg or diagonal part the rules apply
to the inner word, with the diagonal factors the normal form moved out put back in (and for dg, on every
word of its orbit). Every rule and every normalisation is an equality, so reaching zero proves
``lhs - rhs == 0``; failing to reach zero proves nothing, and the checker reports the remainder.

`grad` differentiates a loss sum <G, F> at symbolic sizes: the product rule over the atoms of each word,
adjoints moved onto the variable, dA = -A dL A for generators declared inverses of I + L [L-adjoint,
L-dinv].
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import Iterable

import sympy as sp

__all__ = [
    "Sym", "Mask", "Dg", "Dp", "diagpart", "M", "Rule", "Block",
    "sym", "diag_pair", "diag", "eye", "zeros", "ones", "scalar_block",
    "tril", "triu", "dg", "tr", "nf", "is_zero_nc", "rules_from", "grad", "NotReduced",
]


def _same(a, b) -> bool:
    return a == b or sp.simplify(sp.sympify(a) - sp.sympify(b)) == 0


# ------------------------------------------------------------------------------------------------
# atoms
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Sym:
    """A generator: a named matrix of symbolic shape. ``t``: transposed. ``diag``: diagonal (square,
    symmetric, commutes with the other diagonal generators). ``inv``: name of its declared inverse
    (diagonal generators only: X X^-1 = X^-1 X = I)."""

    name: str
    rows: sp.Expr
    cols: sp.Expr
    t: bool = False
    diag: bool = False
    inv: str | None = None

    @property
    def shape(self):
        return (self.cols, self.rows) if self.t else (self.rows, self.cols)

    @property
    def T(self) -> "Sym":
        if self.diag:
            return self
        return Sym(self.name, self.rows, self.cols, not self.t, False, None)

    @property
    def key(self) -> str:
        return self.name + ("'" if self.t else "")

    def __repr__(self):
        return self.key


@dataclass(frozen=True)
class Mask:
    """``tril_d(w)`` (kind "tril": entries with j - i <= d) or ``triu_d(w)`` (kind "triu": j - i >= d)."""

    kind: str
    d: int
    word: tuple
    n: sp.Expr
    diag = False

    @property
    def shape(self):
        return (self.n, self.n)

    @property
    def T(self) -> "Mask":
        return Mask("triu" if self.kind == "tril" else "tril", -self.d, _canon_word(_word_T(self.word)), self.n)

    @property
    def key(self) -> str:
        return f"{self.kind}{self.d}[{_wkey(self.word)}]"

    def __repr__(self):
        return self.key


@dataclass(frozen=True)
class Dg:
    """The column vector of the diagonal of the square word ``w`` (shape n x 1)."""

    word: tuple
    n: sp.Expr
    diag = False

    @property
    def shape(self):
        return (self.n, sp.Integer(1))

    @property
    def T(self):
        return _RowOf(self)

    @property
    def key(self) -> str:
        return f"dg[{_wkey(self.word)}]"

    def __repr__(self):
        return self.key


@dataclass(frozen=True)
class Dp:
    """diag(dg(w)): the diagonal part of the square word ``w``, a diagonal matrix (it commutes with the
    other diagonal atoms) [L-diagpart]."""

    word: tuple
    n: sp.Expr
    diag = True
    inv = None

    @property
    def shape(self):
        return (self.n, self.n)

    @property
    def T(self):
        return self

    @property
    def key(self) -> str:
        return f"diagpart[{_wkey(self.word)}]"

    @property
    def name(self) -> str:
        return self.key

    def __repr__(self):
        return self.key


@dataclass(frozen=True)
class _RowOf:
    """dg(w)^T (a row); only so that transposing a vector expression is defined."""

    of: Dg
    diag = False

    @property
    def shape(self):
        return (sp.Integer(1), self.of.n)

    @property
    def T(self):
        return self.of

    @property
    def key(self) -> str:
        return self.of.key + "'"


def _wkey(word) -> str:
    return " ".join(a.key for a in word) if word else "I"


def _word_T(word) -> tuple:
    return tuple(a.T for a in reversed(word))


# ------------------------------------------------------------------------------------------------
# expressions
# ------------------------------------------------------------------------------------------------


class M:
    """A matrix expression: ``{word: coefficient}`` of one shape. Build with `sym`, `diag`, `eye`, then
    ``+ - *``, scalar multiples and ``.T``."""

    __slots__ = ("terms", "shape")

    def __init__(self, terms: dict, shape):
        self.terms = {w: c for w, c in terms.items() if c != 0}
        self.shape = (sp.sympify(shape[0]), sp.sympify(shape[1]))

    # -- arithmetic
    def _coerce(self, other) -> "M":
        if isinstance(other, M):
            return other
        raise TypeError(f"cannot combine a matrix expression with {type(other).__name__}")

    def __add__(self, other):
        if isinstance(other, Block):
            return NotImplemented
        other = self._coerce(other)
        if not (_same(self.shape[0], other.shape[0]) and _same(self.shape[1], other.shape[1])):
            raise ValueError(f"shape mismatch in a sum: {self.shape} + {other.shape}")
        out = dict(self.terms)
        for w, c in other.terms.items():
            out[w] = sp.expand(out.get(w, 0) + c)
        return M(out, self.shape)

    def __neg__(self):
        return M({w: -c for w, c in self.terms.items()}, self.shape)

    def __sub__(self, other):
        if isinstance(other, Block):
            return NotImplemented
        return self + (-self._coerce(other))

    def __mul__(self, other):
        if isinstance(other, Block):
            return NotImplemented
        if not isinstance(other, M):
            c = sp.sympify(other)
            if c.has(sp.Float):
                raise TypeError(f"a floating-point coefficient ({c}) in an exact proof")
            return M({w: sp.expand(v * c) for w, v in self.terms.items()}, self.shape)
        if not _same(self.shape[1], other.shape[0]):
            raise ValueError(f"shape mismatch in a product: {self.shape} * {other.shape}")
        out: dict = {}
        for w1, c1 in self.terms.items():
            for w2, c2 in other.terms.items():
                for w, c in _canon(w1 + w2).items():
                    out[w] = sp.expand(out.get(w, 0) + c1 * c2 * c)
        return M(out, (self.shape[0], other.shape[1]))

    def __rmul__(self, other):
        return self * other

    @property
    def T(self) -> "M":
        out: dict = {}
        for w, c in self.terms.items():
            for w2, c2 in _canon(_word_T(w)).items():
                out[w2] = sp.expand(out.get(w2, 0) + c * c2)
        return M(out, (self.shape[1], self.shape[0]))

    def is_zero(self) -> bool:
        return not self.terms

    def __repr__(self):
        if not self.terms:
            return f"0[{self.shape[0]}x{self.shape[1]}]"
        return " + ".join(f"({c})*{_wkey(w)}" for w, c in sorted(self.terms.items(), key=lambda t: _wkey(t[0])))


def sym(name: str, rows, cols) -> M:
    """A generator of shape rows x cols."""
    return M({(Sym(name, sp.sympify(rows), sp.sympify(cols)),): 1}, (rows, cols))


def diag_pair(name: str, inv_name: str, n) -> tuple[M, M]:
    """Two diagonal n x n generators declared inverse to each other (X X^-1 = I)."""
    n = sp.sympify(n)
    a = Sym(name, n, n, diag=True, inv=inv_name)
    b = Sym(inv_name, n, n, diag=True, inv=name)
    return M({(a,): 1}, (n, n)), M({(b,): 1}, (n, n))


def diag(name: str, n) -> M:
    """A diagonal n x n generator."""
    n = sp.sympify(n)
    return M({(Sym(name, n, n, diag=True),): 1}, (n, n))


def eye(n) -> M:
    return M({(): 1}, (n, n))


def zeros(r, c) -> M:
    return M({}, (r, c))


def ones(n) -> M:
    """The all-ones column vector (dg(I))."""
    n = sp.sympify(n)
    return M({(Sym("1", n, sp.Integer(1)),): 1}, (n, 1))


# ------------------------------------------------------------------------------------------------
# canonical words: diagonal runs sorted, inverse pairs cancelled, scalar (1 x 1) atoms none
# ------------------------------------------------------------------------------------------------


def _canon_word(word: tuple) -> tuple:
    """The word with every run of adjacent diagonal atoms sorted and declared inverse pairs cancelled
    [L-diag-commute]."""
    out, run = [], []

    def flush():
        if not run:
            return
        cnt = Counter(a for a in run)
        for a in list(cnt):
            if getattr(a, "inv", None) is not None:
                partner = Sym(a.inv, a.rows, a.cols, diag=True, inv=a.name)
                k = min(cnt[a], cnt.get(partner, 0))
                if k:
                    cnt[a] -= k
                    cnt[partner] -= k
        out.extend(sorted(cnt.elements(), key=lambda s: s.name))
        run.clear()

    for a in word:
        if getattr(a, "diag", False):
            run.append(a)
        else:
            flush()
            out.append(a)
    flush()
    return tuple(out)


_SCALARS: dict = {}


def _scalar_symbol(seg: tuple) -> sp.Symbol:
    """A 1 x 1 word as a commutative real symbol, the same for the word and its transpose [L-scalar];
    nonnegative when the word is u^T u (a squared norm)."""
    t = _canon_word(_word_T(seg))
    key = min(_wkey(seg), _wkey(t))
    if key not in _SCALARS:
        half = len(seg) // 2
        square = len(seg) % 2 == 0 and seg[:half] == _word_T(seg[half:])
        _SCALARS[key] = sp.Symbol(f"<{key}>", real=True, nonnegative=True) if square else sp.Symbol(f"<{key}>", real=True)
    return _SCALARS[key]


def _canon(word: tuple) -> dict:
    """``{word: coefficient}``: `_canon_word`, then every 1 x 1 stretch of the word between two places
    where the inner dimension is 1 taken out as a commutative scalar (a 1 x 1 matrix is a scalar and
    equals its transpose [L-scalar])."""
    word = _canon_word(word)
    cuts = [p + 1 for p in range(len(word) - 1) if _is_one(word[p].shape[1])]
    if not cuts:
        if word and _is_one(word[0].shape[0]) and _is_one(word[-1].shape[1]):
            return {(): _scalar_symbol(word)}
        return {word: 1}
    bounds = [0] + cuts + [len(word)]
    segs = [word[a:b] for a, b in zip(bounds[:-1], bounds[1:])]
    coeff, keep = sp.Integer(1), []
    for k, seg in enumerate(segs):
        shape = (seg[0].shape[0], seg[-1].shape[1])
        if _is_one(shape[0]) and _is_one(shape[1]):
            coeff = coeff * _scalar_symbol(seg)
        else:
            keep.append(seg)
    return {_canon_word(tuple(a for seg in keep for a in seg)): coeff}


def _strip_diag(word: tuple):
    """(leading diagonal atoms, rest, trailing diagonal atoms)."""
    i = 0
    while i < len(word) and word[i].diag:
        i += 1
    j = len(word)
    while j > i and word[j - 1].diag:
        j -= 1
    return word[:i], word[i:j], word[j:]


def _is_one(x) -> bool:
    return sp.sympify(x) == 1


def tril(X: M, d: int = 0) -> M:
    """``tril_d(X)``: entries with j - i <= d (d = 0: lower with the diagonal, d = -1: strictly lower)."""
    return _mask("tril", X, d)


def triu(X: M, d: int = 0) -> M:
    """``triu_d(X)``: entries with j - i >= d."""
    return _mask("triu", X, d)


def _keeps_diagonal(kind: str, d: int) -> bool:
    return d >= 0 if kind == "tril" else d <= 0


def _mask(kind: str, X: M, d: int) -> M:
    n = X.shape[0]
    if not _same(n, X.shape[1]):
        raise ValueError(f"{kind} of a non-square {X.shape}")
    if d == 0 and not _is_one(n):  # tril_0(X) = tril_-1(X) + diag(dg(X)), triu alike [L-diagpart]
        return _mask(kind, X, -1 if kind == "tril" else 1) + diagpart(X)
    if not _is_one(n) and d != (-1 if kind == "tril" else 1):
        raise ValueError(f"only the masks tril_0, tril_-1, triu_0, triu_1 are supported, got {kind}_{d}")
    out: dict = {}

    def add(word, c):
        out[word] = sp.expand(out.get(word, 0) + c)

    for w, c in X.terms.items():
        if _is_one(n):  # a 1 x 1 block is its own diagonal [L-mask-blocks]
            if _keeps_diagonal(kind, d):
                add(w, c)
            continue
        pre, rest, post = _strip_diag(w)
        if not rest:  # a diagonal matrix [L-mask-diag]
            if _keeps_diagonal(kind, d):
                add(w, c)
            continue
        if len(rest) == 1 and isinstance(rest[0], Mask) and rest[0].kind == kind:
            inner = rest[0]  # nested masks of one kind: the stricter [L-mask-nested]
            dd = min(d, inner.d) if kind == "tril" else max(d, inner.d)
            atom = Mask(kind, dd, inner.word, n)
        else:
            atom = Mask(kind, d, rest, n)
        for w2, c2 in _canon(pre + (atom,) + post).items():
            add(w2, c * c2)
    return M(out, X.shape)


def _transfer_mask(kind: str, d: int):
    """The mask a dg moves onto the other factor: dg(tril_d(x) R) = dg(x triu_-d(R)),
    dg(triu_d(x) R) = dg(x tril_-d(R)), and mirrored at the end [L-dg-mask]."""
    return ("triu", -d) if kind == "tril" else ("tril", -d)


def _dg_moves(core: tuple):
    """The words dg(core) equals (with extra diagonal factors): (facs, word) pairs, word None for zero.
    Moves: transpose [L-dg]; a mask at the front or the back moves onto the rest [L-dg-mask]."""
    out = [((), _canon_word(_word_T(core)))]
    for front in (True, False):
        a = core[0] if front else core[-1]
        if not isinstance(a, Mask) or len(core) < 2:
            continue
        rest = core[1:] if front else core[:-1]
        kind, d = _transfer_mask(a.kind, a.d)
        rest_shape = (rest[0].shape[0], rest[-1].shape[1])
        moved = _mask(kind, M({rest: 1}, rest_shape), d)
        if not moved.terms:
            out.append(((), None))
            continue
        (w2, c2), = moved.terms.items()
        word = a.word + w2 if front else w2 + a.word
        word = _canon_word(word)
        pre, mid, post = _strip_diag(word)
        out.append((pre + post, mid))
    return out


def _dg_word(word: tuple):
    """dg of one word as (diagonal factors, core word) with dg(word) = factors * dg(core), core None when
    dg(word) = 0, core () when dg(word) = dg(I) = 1. Diagonal factors at the ends move out, a
    diagonal-keeping mask around the whole word is unwrapped and a diagonal-free one gives zero [L-dg];
    then the canonical one (least key) of the words reached by transposing and by moving a mask at
    either end onto the rest [L-dg, L-dg-mask]."""
    pre, rest, post = _strip_diag(word)
    facs = pre + post
    while len(rest) == 1 and isinstance(rest[0], Mask):
        m = rest[0]
        if not _keeps_diagonal(m.kind, m.d):
            return facs, None
        p2, rest, q2 = _strip_diag(m.word)
        facs = facs + p2 + q2
    if not rest:
        return facs, ()
    seen = {rest: ()}
    todo = [rest]
    while todo:
        w = todo.pop()
        for extra, w2 in _dg_moves(w):
            if w2 is None:
                return facs, None
            if not w2:
                return facs + seen[w] + extra, ()
            if len(w2) == 1 and isinstance(w2[0], Mask):
                sub_facs, sub = _dg_word(w2)
                if sub is None:
                    return facs, None
                return facs + seen[w] + extra + sub_facs, sub
            if w2 not in seen:
                seen[w2] = seen[w] + extra
                todo.append(w2)
            if len(seen) > 64:
                raise NotReduced(f"dg orbit of {_wkey(rest)} too large")
    best = min(seen, key=_wkey)
    return facs + seen[best], best


def dg(X: M) -> M:
    """The diagonal of a square expression as a column vector."""
    n = X.shape[0]
    if not _same(n, X.shape[1]):
        raise ValueError(f"dg of a non-square {X.shape}")
    out: dict = {}
    for w, c in X.terms.items():
        facs, core = _dg_word(w)
        if core is None:
            continue
        if core == ():
            dps = [f for f in facs if isinstance(f, Dp)]
            if dps:  # diag(dg(u)) 1 = dg(u) [L-diagpart]
                rest = list(facs)
                rest.remove(dps[0])
                facs, vec = tuple(rest), (Dg(dps[0].word, n),)
            else:
                vec = (Sym("1", n, sp.Integer(1)),)
        else:
            vec = (Dg(core, n),)
        for w2, c2 in _canon(facs + vec).items():
            out[w2] = sp.expand(out.get(w2, 0) + c * c2)
    return M(out, (n, 1))


def diagpart(X: M) -> M:
    """diag(dg(X)): the diagonal part of a square expression, as diagonal atoms [L-diagpart]."""
    n = X.shape[0]
    if not _same(n, X.shape[1]):
        raise ValueError(f"diagpart of a non-square {X.shape}")
    out: dict = {}
    for w, c in X.terms.items():
        if _is_one(n):
            out[w] = sp.expand(out.get(w, 0) + c)
            continue
        facs, core = _dg_word(w)
        if core is None:
            continue
        word = facs if core == () else facs + (Dp(core, n),)
        for w2, c2 in _canon(word).items():
            out[w2] = sp.expand(out.get(w2, 0) + c * c2)
    return M(out, X.shape)


_TRACES: dict = {}


def tr(X: M) -> sp.Expr:
    """The trace of a square expression: a SymPy scalar (each canonical trace word a commutative
    symbol), invariant under rotation and transposition [L-trace]."""
    if not _same(X.shape[0], X.shape[1]):
        raise ValueError(f"trace of a non-square {X.shape}")
    total = sp.Integer(0)
    for w, c in X.terms.items():
        if not w:
            total += c * X.shape[0]
            continue
        cands = []
        for base in (w, _word_T(w)):
            for p in range(len(base)):
                rot = base[p:] + base[:p]
                cands.append(_canon_word(rot))
        best = min(cands, key=_wkey)
        key = _wkey(best)
        if key not in _TRACES:
            _TRACES[key] = sp.Symbol(f"tr[{key}]")
        total += c * _TRACES[key]
    return sp.expand(total)


# ------------------------------------------------------------------------------------------------
# rewrite rules and the normal form
# ------------------------------------------------------------------------------------------------


@dataclass(frozen=True)
class Rule:
    """``lhs -> rhs``: lhs one canonical word, rhs an expression; ``by``: the lemma, definition or
    hypothesis that makes it an equality."""

    lhs: tuple
    rhs: M
    by: str

    def __repr__(self):
        return f"{_wkey(self.lhs)} -> {self.rhs!r}  [{self.by}]"


def rules_from(lhs: M, rhs: M, by: str, transpose: bool = True) -> list[Rule]:
    """The rule ``lhs -> rhs`` (lhs a single word with coefficient 1, or c * word: then rhs / c), and with
    ``transpose`` its transpose ``lhs^T -> rhs^T`` (an equality transposes into one). Each rule also comes
    without the invertible diagonal factors at its word's ends, their inverses moved to the other side
    (P w = r  =>  w = P^-1 r): a normal form may have cancelled such a factor against its inverse."""
    if len(lhs.terms) != 1:
        raise ValueError(f"a rule's left side is one word, got {lhs!r}")
    out = []
    sides = [lhs, rhs] + ([lhs.T, rhs.T] if transpose else [])
    for L, R in zip(sides[0::2], sides[1::2]):
        (w, c), = L.terms.items()
        R = R * (sp.Integer(1) / c)
        for rule in _strip_invertible(w, R, by):
            if all(rule.lhs != r.lhs for r in out):
                out.append(rule)
    return out


def _inverse_of(a: Sym) -> Sym:
    return Sym(a.inv, a.rows, a.cols, diag=True, inv=a.name)


def _strip_invertible(w: tuple, R: M, by: str) -> list[Rule]:
    out = [Rule(w, R, by)]
    pre, core, post = _strip_diag(w)
    if not core:
        return out
    inv_pre = [a for a in pre if a.inv is not None]
    inv_post = [a for a in post if a.inv is not None]
    for strip_pre in ([], inv_pre) if inv_pre else ([],):
        for strip_post in ([], inv_post) if inv_post else ([],):
            if not strip_pre and not strip_post:
                continue
            p2, q2 = list(pre), list(post)
            left, right = eye(R.shape[0]) if not strip_pre else None, None
            for a in strip_pre:
                p2.remove(a)
                f = M({(_inverse_of(a),): 1}, a.shape)
                left = f if left is None else left * f
            for a in strip_post:
                q2.remove(a)
                f = M({(_inverse_of(a),): 1}, a.shape)
                right = f if right is None else right * f
            R2 = (left if left is not None else eye(R.shape[0])) * R
            if right is not None:
                R2 = R2 * right
            out.append(Rule(tuple(p2) + core + tuple(q2), R2, by))
    return out


def _segments(word: tuple):
    """[run0, x1, run1, ..., xk, runk]: runs of diagonal atoms (Counters) between the other atoms."""
    segs, run = [], Counter()
    for a in word:
        if a.diag:
            run[a] += 1
        else:
            segs.append(run)
            segs.append(a)
            run = Counter()
    segs.append(run)
    return segs


def _contains(big: Counter, small: Counter) -> bool:
    return all(big[k] >= v for k, v in small.items())


def _match(word: tuple, lhs: tuple):
    """First occurrence of the rule word ``lhs`` in ``word``: (prefix word, suffix word), or None.
    Diagonal atoms at the rule's two ends are taken out of the word's adjacent diagonal runs."""
    ws, ls = _segments(word), _segments(lhs)
    xs = ls[1::2]
    k = len(xs)
    if k == 0:  # a product of diagonal atoms: inside one run
        for p in range(0, len(ws), 2):
            if _contains(ws[p], ls[0]):
                rest = ws[p] - ls[0]
                pre = _flatten(ws[:p]) + tuple(sorted(rest.elements(), key=lambda s: s.name))
                return pre, _flatten(ws[p + 1 :])
        return None
    ys = ws[1::2]
    for p in range(len(ys) - k + 1):
        if tuple(ys[p : p + k]) != tuple(xs):
            continue
        # interior runs equal; end runs contain
        ok = all(ws[2 * (p + q) + 2] == ls[2 * q + 2] for q in range(k - 1))
        if not ok:
            continue
        left, right = ws[2 * p], ws[2 * (p + k)]
        if not (_contains(left, ls[0]) and _contains(right, ls[-1])):
            continue
        pre = _flatten(ws[: 2 * p]) + tuple(sorted((left - ls[0]).elements(), key=lambda s: s.name))
        post = tuple(sorted((right - ls[-1]).elements(), key=lambda s: s.name)) + _flatten(ws[2 * (p + k) + 1 :])
        return pre, post
    return None


def _flatten(segs) -> tuple:
    out = []
    for s in segs:
        if isinstance(s, Counter):
            out.extend(sorted(s.elements(), key=lambda a: a.name))
        else:
            out.append(s)
    return tuple(out)


class NotReduced(RuntimeError):
    pass


def _rebuild_atom(a, rules, memo, n, left=(), right=()) -> M:
    """An atom with its inner word brought to normal form (masks and dg rebuilt linearly). For a mask,
    the diagonal runs ``left`` and ``right`` next to it in the outer word go inside first
    (P tril_d(w) Q = tril_d(P w Q) [L-mask-diag]), so that a rule whose word starts or ends with a
    diagonal factor the mask's normal form had moved out still applies inside."""
    if isinstance(a, Mask):
        inner_word = _canon_word(tuple(left) + a.word + tuple(right))
        inner = _nf(M({inner_word: 1}, (a.n, a.n)), rules, memo, n)
        return _mask(a.kind, inner, a.d)
    if isinstance(a, (Dg, Dp)):
        return _rebuild_dg(a, tuple(left), rules, memo, n)
    return M({(a,): 1}, a.shape)


def _dg_orbit(core: tuple) -> dict:
    """{word: extra diagonal factors} of the words dg(core) equals (`_dg_moves`); {} when it is zero."""
    seen = {core: ()}
    todo = [core]
    while todo:
        w = todo.pop()
        for extra, w2 in _dg_moves(w):
            if w2 is None:
                return {}
            if w2 and w2 not in seen and not (len(w2) == 1 and isinstance(w2[0], Mask)):
                seen[w2] = seen[w] + extra
                todo.append(w2)
        if len(seen) > 64:
            break
    return seen


def _rebuild_dg(a, left: tuple, rules, memo, n) -> M:
    """left * dg(core) with the rules tried on every word of the dg's orbit, the diagonal factors
    ``left`` (moved out of the dg by its normal form) put back at either end (dg(P w) = dg(w P) = P dg(w)
    [L-dg]): the first word a rule reduces gives dg of its normal form; else the inner word's normal form.
    The same for a diagonal part (`Dp`)."""
    make = dg if isinstance(a, Dg) else diagpart
    for w, extra in _dg_orbit(a.word).items():
        facs = tuple(left) + tuple(extra)
        for cand in (facs + w, w + facs):
            cand = _canon_word(cand)
            red = _nf(M({cand: 1}, (a.n, a.n)), rules, memo, n)
            if set(red.terms) != {cand}:
                return make(red)
    inner = _nf(M({a.word: 1}, (a.n, a.n)), rules, memo, n)
    out = make(inner)
    for f in reversed(left):
        out = M({(f,): 1}, f.shape) * out
    return out


def _rebuild(word: tuple, rules, memo, n) -> M:
    """The word with every mask and dg atom rebuilt (`_rebuild_atom`); a mask takes in the diagonal runs
    on either side of it."""
    parts, i = [], 0
    while i < len(word):
        a = word[i]
        if isinstance(a, Mask):
            left = []
            while parts and not isinstance(parts[-1], M) and parts[-1].diag:
                left.insert(0, parts.pop())
            j = i + 1
            while j < len(word) and word[j].diag:
                j += 1
            parts.append(_rebuild_atom(a, rules, memo, n, left, word[i + 1 : j]))
            i = j
            continue
        if isinstance(a, Dg):
            left = []
            while parts and not isinstance(parts[-1], M) and parts[-1].diag:
                left.insert(0, parts.pop())
            parts.append(_rebuild_atom(a, rules, memo, n, left))
        elif isinstance(a, Dp):
            x = _rebuild_atom(a, rules, memo, n)
            parts.append(a if x.terms == {(a,): 1} else x)
        else:
            parts.append(a)
        i += 1
    acc = None
    for p in parts:
        x = p if isinstance(p, M) else M({(p,): 1}, p.shape)
        acc = x if acc is None else acc * x
    return acc


def _word_shape(word):
    return word[0].shape[0], word[-1].shape[1]


def _nf_word(word: tuple, shape, rules, memo, n) -> M:
    key = (word, shape)
    if key in memo:
        return memo[key]
    if n[0] > 20000:
        raise NotReduced("rewriting did not terminate (more than 20000 steps)")
    n[0] += 1
    # inner words first
    if any(isinstance(a, (Mask, Dg, Dp)) for a in word):
        rebuilt = _rebuild(word, rules, memo, n)
        if set(rebuilt.terms) != {word} or rebuilt.terms[word] != 1:
            out = _nf(rebuilt, rules, memo, n)
            memo[key] = out
            return out
    for r in rules:
        hit = _match(word, r.lhs)
        if hit is None:
            continue
        pre, post = hit
        left = M({pre: 1}, (shape[0], r.rhs.shape[0])) if pre else eye(shape[0])
        right = M({post: 1}, (r.rhs.shape[1], shape[1])) if post else eye(shape[1])
        out = _nf(left * r.rhs * right, rules, memo, n)
        memo[key] = out
        return out
    out = M({word: 1}, shape)
    memo[key] = out
    return out


def _nf(X: M, rules, memo, n) -> M:
    out = M({}, X.shape)
    for w, c in X.terms.items():
        out = out + _nf_word(w, X.shape, rules, memo, n) * c
    return out


def nf(X: M, rules: Iterable[Rule] = ()) -> M:
    """The normal form of X under `rules` (and the normalisations of the module docstring)."""
    return _nf(X, list(rules), {}, [0])


def is_zero_nc(X: M, rules: Iterable[Rule] = ()) -> str:
    """"" when X reduces to zero under the rules, else the remainder (a short text)."""
    try:
        R = nf(X, rules)
    except NotReduced as exc:
        return str(exc)
    # coefficients are SymPy scalars: exact zero test
    left = {w: c for w, c in R.terms.items() if sp.simplify(c) != 0}
    if not left:
        return ""
    text = repr(M(left, R.shape))
    return "remainder " + (text if len(text) < 400 else text[:400] + "...")


# ------------------------------------------------------------------------------------------------
# block matrices
# ------------------------------------------------------------------------------------------------


class Block:
    """A block matrix: a grid of `M` with row sizes ``rows`` and column sizes ``cols``."""

    def __init__(self, grid):
        self.grid = [list(r) for r in grid]
        self.rows = [r[0].shape[0] for r in self.grid]
        self.cols = [x.shape[1] for x in self.grid[0]]
        for i, r in enumerate(self.grid):
            for j, x in enumerate(r):
                if not (_same(x.shape[0], self.rows[i]) and _same(x.shape[1], self.cols[j])):
                    raise ValueError(f"block ({i},{j}) has shape {x.shape}, expected ({self.rows[i]}, {self.cols[j]})")

    def __mul__(self, other):
        if isinstance(other, M):
            other = Block([[other]])
        if not isinstance(other, Block):
            return Block([[x * other for x in r] for r in self.grid])
        n = len(self.cols)
        if n != len(other.rows):
            raise ValueError("block partitions do not conform")
        out = []
        for i in range(len(self.rows)):
            row = []
            for j in range(len(other.cols)):
                acc = zeros(self.rows[i], other.cols[j])
                for k in range(n):
                    acc = acc + self.grid[i][k] * other.grid[k][j]
                row.append(acc)
            out.append(row)
        return Block(out)

    def __rmul__(self, other):
        if isinstance(other, M):
            return Block([[other]]) * self
        return self * other

    def __add__(self, other):
        if isinstance(other, M):
            other = Block([[other]])
        if len(self.grid) != len(other.grid) or len(self.grid[0]) != len(other.grid[0]):
            raise ValueError("block partitions do not conform in a sum")
        return Block([[a + b for a, b in zip(r1, r2)] for r1, r2 in zip(self.grid, other.grid)])

    def __radd__(self, other):
        return self + other

    def __neg__(self):
        return Block([[-x for x in r] for r in self.grid])

    def __sub__(self, other):
        return self + (-other)

    def __rsub__(self, other):
        return (-self) + other

    @property
    def T(self):
        return Block([[self.grid[i][j].T for i in range(len(self.rows))] for j in range(len(self.cols))])

    def tril(self, d: int) -> "Block":
        """tril_d of a block matrix with square diagonal blocks, d in {0, -1}: the diagonal blocks masked,
        the blocks below kept, the blocks above zero [L-mask-blocks]."""
        if d not in (0, -1):
            raise ValueError("block masks are proved for d in {0, -1}")
        g = []
        for i in range(len(self.rows)):
            row = []
            for j in range(len(self.cols)):
                x = self.grid[i][j]
                row.append(tril(x, d) if i == j else x if i > j else zeros(*x.shape))
            g.append(row)
        return Block(g)

    @staticmethod
    def diag(*blocks: M) -> "Block":
        n = len(blocks)
        return Block([[blocks[i] if i == j else zeros(blocks[i].shape[0], blocks[j].shape[1]) for j in range(n)] for i in range(n)])

    @staticmethod
    def eye(*sizes) -> "Block":
        return Block.diag(*[eye(s) for s in sizes])


def scalar_block(c) -> M:
    """A 1 x 1 block holding the scalar c."""
    return eye(1) * c


def block_zero(X: Block, rules: Iterable[Rule] = ()) -> str:
    """"" when every block reduces to zero, else the first remainder."""
    rules = list(rules)
    for i, r in enumerate(X.grid):
        for j, x in enumerate(r):
            why = is_zero_nc(x, rules)
            if why:
                return f"block ({i},{j}): {why}"
    return ""


# ------------------------------------------------------------------------------------------------
# gradients: the differential of a loss sum_i <G_i, F_i>, with the adjoint moved onto the variable
# ------------------------------------------------------------------------------------------------


def grad(pairs, wrt, inverses=None, logdiag=None, scalar=None) -> M:
    """Gradient of ``loss = sum <G, F>`` over ``pairs`` [(G, F)], with respect to:

    - a generator ``wrt`` (an `M` holding one `Sym`): the matrix d loss / d X;
    - a diagonal generator ``wrt`` (diag(x)): the vector d loss / d x = dg(cotangent) [L-adjoint];
    - ``logdiag=(D, Dinv, gamma, e_last)``: the vector d loss / d eps for D = diag(exp(eps)),
      Dinv = D^-1, gamma = exp(eps_last) a scalar symbol, e_last the last unit vector: dD = D E,
      dDinv = -E Dinv, d gamma = gamma eps_last (E = diag(d eps)).

    ``inverses``: ``{A: L}`` for generators defined as A = (I + L)^-1: dA = -A dL A [L-dinv].
    The differential of each word is the sum over its atoms (the product rule); an atom's contribution
    is moved off the variation by the adjoints <H, X dY Z> = <X^T H Z^T, dY>, <H, dY^T> = <H^T, dY>,
    <H, tril_d(dY)> = <tril_d(H), dY>, <H, diag(dg(dY))> = <diag(dg(H)), dY>, <H, diag(dy)> = <dg(H), dy>
    [L-adjoint]."""
    inverses = inverses or {}
    inv_atoms = {next(iter(A.terms))[0]: L for A, L in inverses.items()}
    if logdiag is not None:
        D, Di, gamma, e_last = logdiag
        d_atom = next(iter(D.terms))[0]
        di_atom = next(iter(Di.terms))[0]
        target = ("log", d_atom, di_atom)
        n = D.shape[0]
        out = zeros(n, 1)
    else:
        atom = next(iter(wrt.terms))[0]
        target = ("diag", atom) if atom.diag else ("mat", atom)
        n = atom.shape[0]
        out = zeros(n, 1) if atom.diag else zeros(*atom.shape)

    def contrib(a, H: M) -> M:
        # <H, d a>
        if isinstance(a, Sym):
            if target[0] == "mat":
                if a.name == target[1].name and not a.diag:
                    return H if a.t == target[1].t else H.T
            elif target[0] == "diag":
                if a == target[1]:
                    return dg(H)
            else:
                if a == target[1]:
                    return dg(M({(a,): 1}, a.shape) * H)
                if a == target[2]:
                    return -dg(H * M({(a,): 1}, a.shape))
            base = Sym(a.name, a.rows, a.cols, False, a.diag, a.inv)
            if base in inv_atoms:
                Aexpr = M({(base,): 1}, base.shape)
                Hh = H if not a.t else H.T
                return walk([(-(Aexpr.T * Hh * Aexpr.T), inv_atoms[base])])
            return None
        if isinstance(a, Mask):
            masked = _mask(a.kind, H, a.d)
            return walk([(masked, M({a.word: 1}, (a.n, a.n)))])
        if isinstance(a, Dp):  # <H, diag(dg(dw))> = <diag(dg(H)), dw>
            return walk([(diagpart(H), M({a.word: 1}, (a.n, a.n)))])
        return None

    hidden = set(_SCALARS.values()) | set(_TRACES.values())

    def walk(ps) -> M | None:
        acc = None
        for G, F in ps:
            for w, c in F.terms.items():
                if sp.sympify(c).free_symbols & hidden:
                    # a 1 x 1 or trace scalar would hide its matrix factors from the product rule
                    raise ValueError(f"grad: a scalar made of matrices in the coefficient {c}")
                for p, a in enumerate(w):
                    left = M({w[:p]: 1}, (F.shape[0], a.shape[0])) if p else eye(F.shape[0])
                    right = M({w[p + 1 :]: 1}, (a.shape[1], F.shape[1])) if p + 1 < len(w) else eye(F.shape[1])
                    H = left.T * G * right.T * c
                    r = contrib(a, H)
                    if r is not None:
                        acc = r if acc is None else acc + r
        return acc

    r = walk(pairs)
    if r is not None:
        out = out + r
    if logdiag is not None and gamma is not None:
        s = sp.Integer(0)
        for G, F in pairs:
            for w, c in F.terms.items():
                dc = sp.expand(gamma * sp.diff(c, gamma))
                if dc != 0:
                    s += dc * tr(G.T * M({w: 1}, F.shape))
        if s != 0:
            out = out + e_last * s
    return out

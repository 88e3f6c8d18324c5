"""Identity records, the checker that proves them, and the registry.

A record (`Identity`) names one algebraic step of the chunked algorithm: an id (`CF-1`, `WY-2`,
`RW-3`, `BWD-dk`, `CP-4`, ...), a one-line statement, its LaTeX form, its kind, a builder of SymPy
objects at tiny concrete sizes, and the dotted names of the two numeric twins in `reference/` that
compute its left and right sides at full size (tests/test_twins.py runs them in fp64).

Kinds and what the checker proves:

- ``exact``: the builder returns ``(lhs, rhs)``, each a SymPy matrix or a tuple of matrices of the same
  shapes. The checker proves ``lhs - rhs == 0`` entry by entry: a polynomial or Laurent-polynomial entry
  is converted exactly into a sparse polynomial over QQ (`sympy.polys.rings`, the inverse of a symbol a
  second generator, monomials grouped by net exponent) and compared with zero; any other entry is
  expanded, and if that is not already zero, put over a common denominator with its numerator expanded
  (gates are written multiplicatively, ``a_t = exp(g_t)`` as positive symbols, so every entry is a polynomial or a
  rational function and this decides zero exactly). Entries with transcendental functions left
  (the exp2 rescaling) fall back to ``sympy.simplify``.
- ``bounded``: the builder returns a `Bound` claiming ``small <= large`` (two scalar expressions) with a
  certificate: terms ``(coef, base)`` and condition multipliers ``(m, h)`` such that
  ``large - small == sum(coef * base**2) + sum(m * h)`` identically, where every ``coef`` is
  nonnegative by SymPy's assumptions (products and sums of positive symbols and squares of real
  symbols, after substituting the record's `domain`, e.g. beta = 1 / (1 + p) with p >= 0 for beta in
  (0, 1]) and ``h == 0`` is the stated condition (``1 - k^T k`` for a unit key). The equality is proved
  like an exact identity, so the inequality is proved under the condition, not sampled.

General proofs (every size): an exact record also carries ``general``, a callable returning a
`derivations._proof.Proof`: the same identity at symbolic sizes (C, K, V symbols, matrices as
non-commutative generators of `derivations._nc`), with its steps (non-commutative reductions under stated
rewrite rules, entry-level case splits, inductions on the chunk length or the number of blocks or
chunks) and the lemmas and records it cites (`derivations.lemmas`). The checker proves the cited lemmas and
records, refuses a rule whose justification is not cited, and checks every step. A record proved this way
holds for all sizes, and its row says so ("holds for: all sizes"); a record without one says why not in
``general_note`` and its row gives the concrete sizes. The concrete check stays beside the general proof:
the two are built by the same formula code (`derivations._chunk.chunk_form` and friends take a concrete
`Chunk` or a symbolic `derivations._symbolic.GChunk`), so a broken formula fails both.

Adding a record is a few lines in one of the family modules (or a new module imported by
`derivations/__init__.py`), with the symbols of `derivations._chunk`:

    def _build(C, K):
        ch = Chunk(C, K, 1)
        return ch.A_gated(), hadamard(ch.Gamma(), ch.A_free())

    register(Identity(id="RW-1", statement="...", latex=r"...", build=_build, sizes=((4, 2),),
                      size_names=("C", "K"), twins=("reference.gdn.chunk.solve_tril",
                      "reference.gdn.fused.regate"), source="..."))

then a driver for its twins in tests/test_twins.py (a test fails while one is missing).
"""

from __future__ import annotations

import importlib
import time
from dataclasses import dataclass, field
from typing import Callable, Sequence

import sympy as sp

__all__ = [
    "Identity",
    "Bound",
    "Result",
    "register",
    "registry",
    "get",
    "check",
    "is_zero",
    "run_all",
    "run_lemmas",
    "check_general",
    "explain",
    "format_table",
]


@dataclass(frozen=True)
class Bound:
    """The claim ``small <= large`` with a sum-of-squares certificate.

    small, large: scalar SymPy expressions.
    terms: ``[(coef, base), ...]``, every ``coef`` >= 0 and every ``base`` real.
    conditions: ``[(multiplier, h), ...]`` where ``h == 0`` is the record's condition (for example
        ``1 - k^T k`` for a unit key).
    domain: ``{symbol: expr}``, the range of a symbol as the image of ``expr`` over its own symbols'
        assumptions (``beta: 1 / (1 + p)`` with ``p >= 0`` says beta in (0, 1]); used only to decide the
        sign of the coefficients, so the identity itself stays polynomial.
    Certificate: ``large - small == sum(coef * base**2) + sum(multiplier * h)`` identically, so under the
    condition (every ``h == 0``) ``large - small`` is a sum of nonnegative terms.
    """

    small: sp.Expr
    large: sp.Expr
    terms: Sequence[tuple[sp.Expr, sp.Expr]]
    conditions: Sequence[tuple[sp.Expr, sp.Expr]] = ()
    domain: dict = field(default_factory=dict)


@dataclass(frozen=True)
class Identity:
    """One algebraic step, proved symbolically at tiny sizes and for every size (its general proof), and
    matched numerically at full size.

    id: short stable name, ``<FAMILY>-<n>`` or ``BWD-<grad>`` (CF chunk form, WY the WY/UT
        representation, RW hardware-friendly rewrites, BWD backward, CP context parallelism).
    statement: one line, plain text.
    latex: the identity in LaTeX (no surrounding ``$``).
    build: ``build(*size)`` returns ``(lhs, rhs)`` (exact) or a `Bound` (bounded).
    sizes: the tiny sizes the checker proves it at, each a tuple passed to ``build``.
    size_names: names of the entries of a size tuple, for the table (``C K V`` by default).
    twins: dotted names of the reference functions computing the left and the right side.
    general: ``general()`` returns the `derivations._proof.Proof` of the identity for every size, or None.
    general_note: when there is no general proof, why not (the table shows the concrete sizes then).
    kind: ``"exact"`` or ``"bounded"``.
    bound: for bounded records, the bound in words or LaTeX.
    condition: for bounded records, when the bound holds.
    source: where the step comes from (paper, FLA / FlashQLA function, research note).
    """

    id: str
    statement: str
    latex: str
    build: Callable
    sizes: tuple[tuple[int, ...], ...]
    twins: tuple[str, str]
    kind: str = "exact"
    bound: str | None = None
    condition: str | None = None
    size_names: tuple[str, ...] = ("C", "K", "V")
    source: str = ""
    general: Callable | None = None
    general_note: str = ""

    def __post_init__(self):
        if self.kind not in ("exact", "bounded"):
            raise ValueError(f"{self.id}: kind must be 'exact' or 'bounded', got {self.kind!r}")
        if self.kind == "bounded" and not (self.bound and self.condition):
            raise ValueError(f"{self.id}: a bounded record states its bound and its condition")
        if len(self.twins) != 2 or not all(t.startswith("reference.") for t in self.twins):
            raise ValueError(f"{self.id}: twins are two dotted names under reference/, got {self.twins}")
        if not self.sizes:
            raise ValueError(f"{self.id}: give at least one size to prove it at")
        if self.general is None and not self.general_note:
            raise ValueError(f"{self.id}: give a general proof, or say in general_note why there is none")

    def size_str(self, size: tuple[int, ...]) -> str:
        return ",".join(f"{n}={s}" for n, s in zip(self.size_names, size))


@dataclass
class Result:
    """One row of the table: a record proved at all of its sizes and, where it has one, by its general
    proof (or the first failure). holds_for: "all sizes" when the general proof holds, else the sizes
    checked."""

    id: str
    statement: str
    kind: str
    sizes: str
    seconds: float
    status: str
    detail: str = ""
    holds_for: str = ""

    @property
    def ok(self) -> bool:
        return self.status == "proved"


_REGISTRY: dict[str, Identity] = {}


def register(identity: Identity) -> Identity:
    """Adds a record to the registry (ids are unique). Returns it, so modules can keep a handle."""
    if identity.id in _REGISTRY and _REGISTRY[identity.id] is not identity:
        raise ValueError(f"duplicate identity id {identity.id}")
    _REGISTRY[identity.id] = identity
    return identity


def registry() -> list[Identity]:
    """All registered records, in registration order."""
    return list(_REGISTRY.values())


def get(id: str) -> Identity:
    """The record with this id. Raises KeyError naming the known ids."""
    try:
        return _REGISTRY[id]
    except KeyError:
        raise KeyError(f"no identity {id!r}; known: {', '.join(_REGISTRY)}") from None


def _rational_zero(e: sp.Expr) -> bool:
    e = sp.expand(e)
    if e == 0:
        return True
    num, _ = sp.fraction(sp.together(e))
    return sp.expand(num) == 0


def is_zero(e) -> bool:
    """Exact zero test of one scalar SymPy expression (see the module docstring)."""
    e = sp.sympify(e)
    if e == 0:
        return True
    if e.is_rational_function():
        return _rational_zero(e)
    return sp.simplify(e) == 0


def _as_tuple(x) -> tuple:
    return tuple(x) if isinstance(x, (tuple, list)) else (x,)


def _check_exact(lhs, rhs) -> str:
    lhs, rhs = _as_tuple(lhs), _as_tuple(rhs)
    if len(lhs) != len(rhs):
        return f"{len(lhs)} left-hand parts vs {len(rhs)} right-hand parts"
    diffs = []
    for p, (L, R) in enumerate(zip(lhs, rhs)):
        L, R = sp.Matrix(L), sp.Matrix(R)
        if L.shape != R.shape:
            return f"part {p}: shape {L.shape} vs {R.shape}"
        diffs += [((p, i, j), sp.sympify(L[i, j] - R[i, j])) for i in range(L.rows) for j in range(L.cols)]
    # polynomial and Laurent-polynomial entries: exact arithmetic in a sparse polynomial ring (the same
    # decision as expanding, much faster); anything else (other rational functions, exp): `is_zero`
    laurent = _Laurent([e for _, e in diffs])
    for (p, i, j), e in diffs:
        if e == 0:
            continue
        zero = laurent.is_zero(e)
        if zero is None:
            zero = is_zero(e)
        if not zero:
            return f"part {p} entry ({i},{j}) differs"
    return ""


class _Laurent:
    """Exact zero test of Laurent polynomials (polynomials in the symbols and their inverses, as the
    cumulative gates c_i / c_j make them): each s^-k becomes u_s^k, the entry a polynomial over QQ in the
    s and u_s (`sympy.polys.rings`), and its monomials are grouped by the net exponent of each s
    (s u_s = 1). ``is_zero`` returns None for anything else."""

    def __init__(self, entries):
        syms = sorted(set().union(*[e.free_symbols for e in entries]), key=str) if entries else []
        self.syms = syms
        self.inv = {x: sp.Dummy(f"inv_{x}") for x in syms}
        self.ring = _poly_ring_of(syms + [self.inv[x] for x in syms]) if syms else None

    def is_zero(self, e):
        if self.ring is None:
            return None
        inv = self.inv
        e = e.replace(lambda t: t.is_Pow and t.base in inv and t.exp.is_Integer and t.exp < 0,
                      lambda t: inv[t.base] ** (-t.exp))
        try:
            poly = self.ring.from_expr(e)
        except (ValueError, TypeError, sp.PolynomialError, sp.CoercionFailed):
            return None
        n = len(self.syms)
        net: dict = {}
        for monom, coeff in poly.terms():
            key = tuple(monom[k] - monom[n + k] for k in range(n))
            net[key] = net.get(key, 0) + coeff
        return all(c == 0 for c in net.values())


def _poly_ring_of(gens):
    from sympy.polys.domains import QQ
    from sympy.polys.rings import ring

    return ring(gens, QQ)[0]


def _check_bound(b: Bound) -> str:
    for n, (coef, base) in enumerate(b.terms):
        coef = sp.factor(sp.together(sp.sympify(coef).subs(b.domain)))
        if coef.is_nonnegative is not True:
            return f"term {n}: coefficient not provably nonnegative: {coef}"
        if sp.sympify(base).is_extended_real is not True:
            return f"term {n}: base not provably real"
    sos = sp.Add(*[c * s**2 for c, s in b.terms])
    ideal = sp.Add(*[m * h for m, h in b.conditions])
    if not is_zero(b.large - b.small - sos - ideal):
        return "large - small != certificate"
    return ""


def check(identity: Identity, size: tuple[int, ...]) -> str:
    """Proves `identity` at one size. Returns "" when proved, else why not (it never raises for a
    false identity; an exception in a builder propagates)."""
    built = identity.build(*size)
    if identity.kind == "exact":
        if isinstance(built, Bound):
            return "exact record built a Bound"
        lhs, rhs = built
        return _check_exact(lhs, rhs)
    if not isinstance(built, Bound):
        return "bounded record must build a Bound"
    return _check_bound(built)


def check_general(identity: Identity) -> str:
    """Checks the record's general proof (every size). Returns "" when proved, else why not; "no general
    proof" when the record has none. Never raises for a false proof (an exception in the proof's
    builder is reported as its failure)."""
    from ._proof import check_proof

    if identity.general is None:
        return "no general proof"
    try:
        proof = identity.general()
    except Exception as exc:
        return f"building the general proof: {type(exc).__name__}: {exc}"
    return check_proof(proof)


def run_one(identity: Identity, sizes: Sequence[tuple[int, ...]] | None = None, general: bool = True) -> Result:
    """Proves one record at its sizes (or the given ones) and, with ``general``, by its general proof;
    times both."""
    sizes = tuple(sizes or identity.sizes)
    t0 = time.perf_counter()
    status, detail, done = "proved", "", []
    for size in sizes:
        try:
            why = check(identity, size)
        except Exception as exc:  # a broken builder is a failure of that record, not of the run
            status, detail = "ERROR", f"{identity.size_str(size)}: {type(exc).__name__}: {exc}"
            break
        if why:
            status, detail = "FAIL", f"{identity.size_str(size)}: {why}"
            break
        done.append(identity.size_str(size))
    sizes_str = "; ".join(done) if done else "-"
    holds_for = sizes_str
    if identity.general is not None and general and status == "proved":
        why = check_general(identity)
        if why:
            status, detail = "FAIL", f"general proof: {why}"
        else:
            holds_for = "all sizes"
    return Result(
        id=identity.id,
        statement=identity.statement,
        kind=identity.kind,
        sizes=sizes_str,
        seconds=time.perf_counter() - t0,
        status=status,
        detail=detail,
        holds_for=holds_for if status == "proved" else "-",
    )


def run_lemmas() -> list[Result]:
    """Proves every lemma of `derivations.lemmas` (each once per process); one `Result` row per lemma
    (kind "lemma", holds for "all sizes" when proved)."""
    from ._proof import ENGINE_LEMMAS, check_proof, lemmas

    from . import lemmas as _lemmas  # noqa: F401  (registers the lemmas)

    rows = []
    for lm in lemmas():
        t0 = time.perf_counter()
        try:
            why = check_proof(lm.proof(), engine=lm.id not in ENGINE_LEMMAS)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        rows.append(Result(id=lm.id, statement=lm.statement, kind="lemma", sizes="-", seconds=time.perf_counter() - t0,
                           status="proved" if not why else "FAIL", detail=why, holds_for="all sizes" if not why else "-"))
    return rows


def explain(identity: Identity) -> str:
    """What the record's general proof proves and how: claim, method, cited lemmas and records, and each
    step with the rewrite rules it uses (what `python -m derivations --explain ID` prints)."""
    if identity.general is None:
        return f"{identity.id}: no general proof ({identity.general_note}); concrete sizes {identity.sizes}"
    p = identity.general()
    lines = [f"{identity.id}: {identity.statement}", f"  claim:  {p.claim}", f"  method: {p.method}",
             f"  cites:  {', '.join(p.uses) or '-'} (and the engine's lemmas)"]
    for st in p.steps:
        kind = type(st).__name__
        lines.append(f"  [{kind}] {st.name}")
        for r in getattr(st, "rules", ()):
            lines.append(f"      rule {r!r}")
    return "\n".join(lines)


def _run_one_by_id(id: str) -> Result:
    importlib.import_module(__package__)  # registers every record in the worker process

    return run_one(get(id))


def run_all(ids: Sequence[str] | None = None, processes: int = 1) -> list[Result]:
    """Proves every registered record (or those in `ids`); one `Result` row per record, in
    registration order. Raises KeyError for an unknown id.

    processes: worker processes (1: in this process). The records are independent, so a pool
    shortens the wall time where the cores are real; the default is serial because on a shared
    2-core machine a pool measured no faster.
    """
    return run_records_and_lemmas(ids, processes, lemmas=False)[0]


def run_records_and_lemmas(ids: Sequence[str] | None = None, processes: int = 1, lemmas: bool = True):
    """(record rows, lemma rows): `run_all` and, with ``lemmas``, `run_lemmas`, the lemmas proved in this
    process while the workers prove the records."""
    ids = list(ids) if ids is not None else [r.id for r in registry()]
    for i in ids:
        get(i)
    if processes <= 1 or len(ids) <= 1:
        rows = [run_one(get(i)) for i in ids]
        return rows, (run_lemmas() if lemmas else [])
    import multiprocessing as mp

    with mp.get_context("spawn").Pool(processes) as pool:
        pending = pool.map_async(_run_one_by_id, ids, chunksize=1)
        lemma_rows = run_lemmas() if lemmas else []
        return pending.get(), lemma_rows


def format_table(rows: Sequence[Result], width: int = 72) -> str:
    """The table printed by ``python -m derivations`` and ``flashqla verify``: id, statement, kind,
    holds for ("all sizes" when the general proof holds, else the sizes checked), the concrete sizes
    checked, seconds, status (failures add a detail line)."""
    header = ("id", "statement", "kind", "holds for", "concrete sizes", "s", "status")

    def clip(s: str) -> str:
        return s if len(s) <= width else s[: width - 3] + "..."

    def holds(r: Result) -> str:
        return r.holds_for or r.sizes

    body = [(r.id, clip(r.statement), r.kind, holds(r), r.sizes, f"{r.seconds:.2f}", r.status) for r in rows]
    widths = [max(len(str(x)) for x in col) for col in zip(header, *body)]
    lines = ["  ".join(h.ljust(w) for h, w in zip(header, widths))]
    lines.append("  ".join("-" * w for w in widths))
    for r, b in zip(rows, body):
        lines.append("  ".join(str(x).ljust(w) for x, w in zip(b, widths)).rstrip())
        if r.detail:
            lines.append(" " * (widths[0] + 2) + "-> " + r.detail)
    return "\n".join(lines)

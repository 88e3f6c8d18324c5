"""General (all-sizes) proofs: steps, lemmas, and the checker.

A `Proof` states a claim for every size and lists its steps. A step is one of

- `Eq`: two matrix expressions (`derivations._nc.M`, or block matrices `Block`) whose difference
  reduces to zero under the step's rewrite rules (non-commutative algebra at symbolic sizes);
- `Entry`: a scalar expression in symbolic indices and sizes that must vanish on every region of a
  complete case split of the indices (`REGIONS`), for entry-level facts (masks, gates, diagonals);
- `Check`: any other mechanical check (a callable returning "" when it holds, else why not), for the
  few facts proved with SymPy's own matrix calculus or sums;
- `Cert`: an inequality step of a bounded record: ``large - small`` equals a sum of nonnegative terms
  ``coef * q`` plus multiples of conditions ``h`` (zero under the record's condition), with every
  ``coef`` nonnegative by SymPy's assumptions on the stated domain and every ``q`` nonnegative by
  construction: a squared Frobenius norm tr(Z^T Z) built by the checker from ``Z``, or the induction
  hypothesis.

The normal form of `derivations._nc` applies a few lemmas implicitly (diagonal factors commute and move
through masks, nested masks, transposed masks, masks of block matrices, diagonals of products, traces):
those, `ENGINE_LEMMAS`, are proved for every proof that is checked. Every rule of an `Eq` step names what makes it an equality (`Rule.by`): ``def`` (a definition of the
objects of the claim), ``hyp`` (the induction hypothesis, in the inductive step only), or the id of a
lemma or record listed in the proof's ``uses``. The checker (`check_proof`) proves every cited lemma
and record first (each once per process), refuses a rule citing something not in ``uses``, then checks
every step. An induction is written as its base-case steps and its inductive-step steps (names starting
``base`` and ``step``), and the proof's ``method`` says over what it inducts.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import sympy as sp

from . import _nc
from ._nc import Block, M, Rule

__all__ = ["ENGINE_LEMMAS", "Eq", "Entry", "Check", "Cert", "Proof", "Lemma", "lemma", "lemmas", "get_lemma", "check_proof",
           "prove_cited", "REGIONS", "region_vars"]


@dataclass
class Eq:
    """``lhs == rhs`` because ``lhs - rhs`` reduces to zero under ``rules``."""

    name: str
    lhs: object
    rhs: object
    rules: Sequence[Rule] = ()


@dataclass
class Entry:
    """``expr == 0`` for every index in range: ``expr`` is checked on each region (a substitution of
    the index and size symbols by nonnegative-integer parametrisations, together covering every case)."""

    name: str
    expr: sp.Expr
    regions: Sequence[dict]


@dataclass
class Check:
    """A mechanical check: ``fn()`` returns "" when the fact holds, else why not."""

    name: str
    fn: Callable[[], str]


@dataclass
class Cert:
    """``large - small == sum(coef * q) + sum(m * h)`` identically, every coef >= 0 on ``domain``;
    terms: ``[(coef, Z)]`` with q = tr(Z^T Z) (Z an `M`), ``[(coef, ("hyp", q))]`` with q the induction
    hypothesis' nonnegative quantity (inductive steps only), or ``[(coef, ("cited", id, q))]`` with q >= 0
    the conclusion of a cited record; conditions: ``[(m, h)]``, h == 0 the condition."""

    name: str
    small: sp.Expr
    large: sp.Expr
    terms: Sequence = ()
    conditions: Sequence = ()
    domain: dict = field(default_factory=dict)


@dataclass
class Proof:
    """claim: what holds for all sizes; method: how (e.g. "induction on C"); uses: lemma and record ids;
    steps: `Eq`, `Entry`, `Check` and `Cert` steps; conclusion: for a bounded record, the scalar proved
    nonnegative, which a `Cert` of another proof may cite."""

    claim: str
    method: str
    uses: tuple = ()
    steps: list = field(default_factory=list)
    conclusion: object = None  # bounded records: the quantity proved >= 0 (large - small), for `Cert` citations


@dataclass(frozen=True)
class Lemma:
    """A fact used by general proofs: id (``L-...``), statement, and ``proof()`` returning a `Proof`."""

    id: str
    statement: str
    proof: Callable[[], Proof]


_LEMMAS: dict[str, Lemma] = {}

#: the lemmas behind the normalisations of `derivations._nc` (proved before every proof is checked)
ENGINE_LEMMAS = ("L-diag-commute", "L-mask-diag", "L-mask-nested", "L-mask-transpose", "L-mask-blocks",
                 "L-diagpart", "L-dg", "L-dg-mask", "L-trace", "L-scalar")


def lemma(id: str, statement: str):
    """Decorator registering ``fn() -> Proof`` as the proof of lemma ``id``."""

    def deco(fn):
        _LEMMAS[id] = Lemma(id, statement, fn)
        return fn

    return deco


def lemmas() -> list[Lemma]:
    return list(_LEMMAS.values())


def get_lemma(id: str) -> Lemma:
    try:
        return _LEMMAS[id]
    except KeyError:
        raise KeyError(f"no lemma {id!r}; known: {', '.join(_LEMMAS)}") from None


# ------------------------------------------------------------------------------------------------
# regions: complete case splits of indices
# ------------------------------------------------------------------------------------------------

_p, _q, _s, _t = sp.symbols("p_ q_ s_ t_", integer=True, nonnegative=True)


def region_vars():
    """The nonnegative integer parameters of the regions."""
    return _p, _q, _s, _t


def _regions_ij(i, j, n):
    """(i, j) in [0, n)^2 split into i > j, i = j, i < j (n the size)."""
    p, q, s, _ = region_vars()
    return [
        {j: p, i: p + 1 + q, n: p + 2 + q + s},
        {i: p, j: p, n: p + 1 + s},
        {i: p, j: p + 1 + q, n: p + 2 + q + s},
    ]


REGIONS = {"ij": _regions_ij}


# ------------------------------------------------------------------------------------------------
# the checker
# ------------------------------------------------------------------------------------------------

_PROVED: dict[str, str] = {}
_IN_PROGRESS: set = set()


def _check_step(step, allowed=()) -> str:
    if isinstance(step, Eq):
        lhs, rhs = step.lhs, step.rhs
        if isinstance(lhs, Block) or isinstance(rhs, Block):
            lhs = lhs if isinstance(lhs, Block) else Block([[lhs]])
            rhs = rhs if isinstance(rhs, Block) else Block([[rhs]])
            try:
                diff = lhs - rhs
            except ValueError as exc:
                return f"shapes: {exc}"
            return _nc.block_zero(diff, step.rules)
        try:
            diff = lhs - rhs
        except ValueError as exc:
            return f"shapes: {exc}"
        return _nc.is_zero_nc(diff, step.rules)
    if isinstance(step, Entry):
        for reg in step.regions:
            e = sp.piecewise_fold(sp.sympify(step.expr).subs(reg))
            e = sp.simplify(e)
            if e != 0:
                return f"nonzero on region {reg}: {e}"
        return ""
    if isinstance(step, Check):
        return step.fn()
    if isinstance(step, Cert):
        total = sp.Integer(0)
        for n, (coef, q) in enumerate(step.terms):
            c = sp.factor(sp.together(sp.sympify(coef).subs(step.domain)))
            if c.is_nonnegative is not True:
                return f"term {n}: coefficient not provably nonnegative: {c}"
            if isinstance(q, M):
                q = _nc.tr(q.T * q)
            elif isinstance(q, tuple) and q[0] == "hyp" and step.name.startswith("step"):
                q = q[1]
            elif isinstance(q, tuple) and q[0] == "cited" and q[1] in allowed:
                from ._core import get

                concl = get(q[1]).general().conclusion
                if concl is None or sp.expand(sp.sympify(q[2]) - concl) != 0:
                    return f"term {n}: {q[2]} is not the conclusion of {q[1]} ({concl})"
                q = q[2]
            else:
                return f"term {n}: not a squared norm or the induction hypothesis"
            total += coef * q
        for m, h in step.conditions:
            total += m * h
        diff = sp.expand(sp.sympify(step.large) - sp.sympify(step.small) - total)
        if diff != 0 and sp.simplify(diff) != 0:
            return f"large - small != certificate: {diff}"
        return ""
    return f"unknown step type {type(step).__name__}"


def prove_cited(id: str) -> str:
    """Proves a cited lemma (``L-...``) or record's general proof, once per process. "" when proved."""
    if id in _PROVED:
        return _PROVED[id]
    if id in _IN_PROGRESS:
        return f"circular citation of {id}"
    _IN_PROGRESS.add(id)
    try:
        if id in _LEMMAS:
            # the engine's own lemmas are entry-level (no `Eq` step), so they do not need the engine
            why = check_proof(_LEMMAS[id].proof(), engine=id not in ENGINE_LEMMAS)
        else:
            from ._core import get

            rec = get(id)
            if rec.general is None:
                why = f"{id} has no general proof"
            else:
                why = check_proof(rec.general())
    except Exception as exc:  # a broken proof builder is a failure of that proof
        why = f"{type(exc).__name__}: {exc}"
    finally:
        _IN_PROGRESS.discard(id)
    _PROVED[id] = why
    return why


def check_proof(proof: Proof, engine: bool = True) -> str:
    """"" when every cited lemma / record is proved, every rule cites something allowed and every step
    holds; else the first reason it does not. engine: prove `ENGINE_LEMMAS` first (a proof without `Eq`
    steps does not need them)."""
    from . import lemmas  # noqa: F401  (registers the lemmas)

    allowed = {"def", "hyp", *proof.uses}
    if not engine and any(isinstance(s, Eq) for s in proof.steps):
        return "a proof of an engine lemma may not use the engine (it has an Eq step)"
    for u in ((*ENGINE_LEMMAS, *proof.uses) if engine else proof.uses):
        why = prove_cited(u)
        if why:
            return f"cited {u}: {why}"
    for step in proof.steps:
        for r in getattr(step, "rules", ()):
            if r.by not in allowed:
                return f"step {step.name!r}: rule {r!r} cites {r.by!r}, not among {sorted(allowed)}"
            if r.by == "hyp" and not step.name.startswith("step"):
                return f"step {step.name!r}: the induction hypothesis is used outside an inductive step"
        try:
            why = _check_step(step, allowed)
        except Exception as exc:
            why = f"{type(exc).__name__}: {exc}"
        if why:
            return f"step {step.name!r}: {why}"
    return ""

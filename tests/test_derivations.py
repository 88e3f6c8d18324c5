"""The derivation records, proved symbolically (one test per record and size, named by its id), and
the checker itself: it must reject false identities and false bounds."""

from __future__ import annotations

import re
import subprocess
import sys

import pytest
import sympy as sp

import derivations
from derivations import _core
from derivations._chunk import Chunk, mat

RECORDS = derivations.registry()
CASES = [pytest.param(r, s, id=f"{r.id}[{r.size_str(s)}]") for r in RECORDS for s in r.sizes]


@pytest.mark.parametrize("record,size", CASES)
def test_record_proved(record, size):
    why = derivations.check(record, size)
    assert why == "", f"{record.id} ({record.statement}) at {record.size_str(size)}: {why}"


def test_required_families_present():
    ids = {r.id for r in RECORDS}
    for family in ("CF-", "WY-", "RW-", "BWD-", "CP-"):
        assert any(i.startswith(family) for i in ids), f"no {family} record"
    for grad in ("dq", "dk", "dv", "dbeta", "dg", "dG", "dh0"):
        assert f"BWD-{grad}" in ids
    assert any(r.kind == "bounded" for r in RECORDS)


@pytest.mark.parametrize("record", RECORDS, ids=[r.id for r in RECORDS])
def test_record_metadata(record):
    assert re.fullmatch(r"(CF|WY|RW|CP)-\d+|BWD-\w+", record.id)
    assert record.statement and "\n" not in record.statement
    assert record.latex and record.source
    assert all(len(s) == len(record.size_names) for s in record.sizes)
    if record.kind == "bounded":
        assert record.bound and record.condition


# ------------------------------------------------------------------------------------------------
# The checker rejects what is false
# ------------------------------------------------------------------------------------------------


def _identity(build, kind="exact", **kw):
    return _core.Identity(
        id="XX-1", statement="test", latex="x", build=build, sizes=((3, 2, 2),), kind=kind,
        twins=("reference.a.b", "reference.c.d"), **kw,
    )


def test_checker_rejects_a_wrong_chunk_form():
    def build(C, K, V):
        ch, S = Chunk(C, K, V), mat("s", K, V)
        fwd = ch.chunk_form(S)
        # drop the decay of the entering state in the output: true only when every a_t == 1
        wrong = fwd["o"] - ch.D * ch.q * S + ch.q * S
        return ch.recurrence(S)[0], wrong

    assert "differs" in _core.check(_identity(build), (3, 2, 2))


def test_checker_rejects_an_ungated_inverse():
    # the gate-free A is not FLA's gated A (RW-1 needs the re-gating)
    def build(C, K, V):
        ch = Chunk(C, K, 1)
        return ch.A_gated(), ch.A_free()

    assert "differs" in _core.check(_identity(build), (3, 2, 2))


def test_checker_rejects_shape_mismatch():
    assert "shape" in _core.check(_identity(lambda *s: (sp.zeros(2, 2), sp.zeros(2, 3))), (3, 2, 2))


def test_checker_rejects_false_bounds():
    x, y = sp.symbols("x y", real=True)
    b = sp.Symbol("b", positive=True)
    # wrong certificate: (x + y)^2 - x^2 != y^2
    bad_sum = _core.Bound(small=x**2, large=(x + y) ** 2, terms=[(1, y)])
    assert "certificate" in _core._check_bound(bad_sum)
    # negative coefficient: x^2 - 2 x^2 = -x^2 is not a sum of squares
    neg = _core.Bound(small=2 * x**2, large=x**2, terms=[(-1, x)])
    assert "nonnegative" in _core._check_bound(neg)
    # beta (2 - beta) is nonnegative only on the stated domain
    undecided = _core.Bound(small=0, large=b * (2 - b) * x**2, terms=[(b * (2 - b), x)])
    assert "nonnegative" in _core._check_bound(undecided)
    ok = _core.Bound(small=0, large=b * (2 - b) * x**2, terms=[(b * (2 - b), x)],
                     domain={b: 1 / (1 + sp.Symbol("p", nonnegative=True))})
    assert _core._check_bound(ok) == ""


def test_bound_needs_its_condition():
    # CP-4 without the unit-key condition multipliers is not an identity: the certificate must fail
    b = derivations.get("CP-4").build(2, 2)
    stripped = _core.Bound(small=b.small, large=b.large, terms=b.terms, domain=b.domain)
    assert "certificate" in _core._check_bound(stripped)


def test_is_zero():
    a = sp.Symbol("a", positive=True)
    g = sp.Symbol("g", real=True)
    assert _core.is_zero((a**2 - 1) / (a - 1) - a - 1)
    assert not _core.is_zero(a / (a + 1) - 1)
    assert _core.is_zero(sp.Integer(2) ** (g / sp.log(2)) - sp.exp(g))


def test_identity_validation():
    with pytest.raises(ValueError):
        _identity(lambda: None, kind="approximate")
    with pytest.raises(ValueError):
        _identity(lambda: None, kind="bounded")  # no bound / condition
    with pytest.raises(ValueError):
        _core.Identity(id="X", statement="s", latex="l", build=lambda: 0, sizes=((1,),), twins=("torch.a", "reference.b"))


# ------------------------------------------------------------------------------------------------
# run_all, the table, the command line
# ------------------------------------------------------------------------------------------------


def test_run_all_rows_and_table():
    rows = derivations.run_all(["WY-3", "RW-4"])
    assert [r.id for r in rows] == ["WY-3", "RW-4"]
    assert all(r.ok and r.status == "proved" and r.seconds >= 0 for r in rows)
    table = derivations.format_table(rows)
    for word in ("id", "statement", "kind", "sizes proved", "status", "WY-3", "RW-4", "n=4"):
        assert word in table
    with pytest.raises(KeyError):
        derivations.run_all(["NOPE-1"])


def test_main_fails_on_a_false_record(monkeypatch, capsys):
    false = _core.Identity(
        id="XX-9", statement="a false identity", latex="1 = 2", build=lambda n: (sp.Matrix([1]), sp.Matrix([2])),
        sizes=((1,),), size_names=("n",), twins=("reference.a.b", "reference.c.d"),
    )
    monkeypatch.setitem(_core._REGISTRY, "XX-9", false)
    assert derivations.main(["XX-9", "WY-3"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "XX-9" in out and "1/2 proved" in out


def test_main_reports_builder_errors(monkeypatch, capsys):
    def boom(n):
        raise RuntimeError("builder broke")

    broken = _core.Identity(id="XX-8", statement="broken", latex="-", build=boom, sizes=((1,),),
                            size_names=("n",), twins=("reference.a.b", "reference.c.d"))
    monkeypatch.setitem(_core._REGISTRY, "XX-8", broken)
    rows = derivations.run_all(["XX-8"])
    assert rows[0].status == "ERROR" and "builder broke" in rows[0].detail and not rows[0].ok


def test_cli_subset():
    out = subprocess.run([sys.executable, "-m", "derivations", "WY-3", "WY-4"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2/2 proved" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "derivations", "NOPE-1"], capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown record" in bad.stderr

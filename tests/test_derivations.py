"""The derivation records, proved symbolically (one test per record and size, and one per record for its
general proof, named by its id), the lemmas, and the checkers themselves: they must reject false
identities, false bounds, and deliberately broken rewrites (a mask shifted by one, a wrong transpose),
in the concrete check and in the general proof alike."""

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
    kw.setdefault("general_note", "a test record")
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
        _core.Identity(id="X", statement="s", latex="l", build=lambda: 0, sizes=((1,),), twins=("torch.a", "reference.b"),
                       general_note="n")
    with pytest.raises(ValueError, match="general"):
        _core.Identity(id="X", statement="s", latex="l", build=lambda: 0, sizes=((1,),), twins=("reference.a", "reference.b"))


# ------------------------------------------------------------------------------------------------
# run_all, the table, the command line
# ------------------------------------------------------------------------------------------------


def test_run_all_rows_and_table():
    rows = derivations.run_all(["WY-3", "RW-4"])
    assert [r.id for r in rows] == ["WY-3", "RW-4"]
    assert all(r.ok and r.status == "proved" and r.seconds >= 0 for r in rows)
    assert all(r.holds_for == "all sizes" for r in rows)
    table = derivations.format_table(rows)
    for word in ("id", "statement", "kind", "holds for", "all sizes", "concrete sizes", "status", "WY-3", "RW-4", "n=4"):
        assert word in table
    with pytest.raises(KeyError):
        derivations.run_all(["NOPE-1"])


def test_main_fails_on_a_false_record(monkeypatch, capsys):
    false = _core.Identity(
        id="XX-9", statement="a false identity", latex="1 = 2", build=lambda n: (sp.Matrix([1]), sp.Matrix([2])),
        sizes=((1,),), size_names=("n",), twins=("reference.a.b", "reference.c.d"), general_note="a test record",
    )
    monkeypatch.setitem(_core._REGISTRY, "XX-9", false)
    assert derivations.main(["XX-9", "WY-3"]) == 1
    out = capsys.readouterr().out
    assert "FAIL" in out and "XX-9" in out and "1/2 proved" in out


def test_main_reports_builder_errors(monkeypatch, capsys):
    def boom(n):
        raise RuntimeError("builder broke")

    broken = _core.Identity(id="XX-8", statement="broken", latex="-", build=boom, sizes=((1,),),
                            size_names=("n",), twins=("reference.a.b", "reference.c.d"), general_note="a test record")
    monkeypatch.setitem(_core._REGISTRY, "XX-8", broken)
    rows = derivations.run_all(["XX-8"])
    assert rows[0].status == "ERROR" and "builder broke" in rows[0].detail and not rows[0].ok


def test_cli_subset():
    out = subprocess.run([sys.executable, "-m", "derivations", "WY-3", "WY-4"], capture_output=True, text=True)
    assert out.returncode == 0, out.stdout + out.stderr
    assert "2/2 proved (2 for all sizes)" in out.stdout and "holds for" in out.stdout
    exp = subprocess.run([sys.executable, "-m", "derivations", "--explain", "WY-4"], capture_output=True, text=True)
    assert exp.returncode == 0, exp.stdout + exp.stderr
    for word in ("claim:", "method:", "induction on the number of blocks", "cites:", "L-blockinv", "rule "):
        assert word in exp.stdout
    bad = subprocess.run([sys.executable, "-m", "derivations", "NOPE-1"], capture_output=True, text=True)
    assert bad.returncode != 0 and "unknown record" in bad.stderr


# ------------------------------------------------------------------------------------------------
# general proofs: every record for every size, every lemma
# ------------------------------------------------------------------------------------------------

from derivations import _nc, _proof  # noqa: E402
from derivations._nc import eye, rules_from, sym, tril  # noqa: E402


@pytest.mark.parametrize("record", RECORDS, ids=[r.id for r in RECORDS])
def test_record_general_proof(record):
    assert record.general is not None, f"{record.id} has no general proof: {record.general_note}"
    why = derivations.check_general(record)
    assert why == "", f"{record.id} general proof: {why}"


@pytest.mark.parametrize("record", RECORDS, ids=[r.id for r in RECORDS])
def test_general_proof_is_symbolic(record):
    """A general proof that re-ran a concrete size would be a defect: every one states a claim and a
    method, cites what it uses, and works at symbolic sizes (a size symbol in the shapes of its matrix
    steps, or symbolic indices in its entry steps)."""
    p = record.general()
    assert p.claim and p.method and p.steps

    def symbolic(x):
        if isinstance(x, _nc.Block):
            return any(symbolic(b) for row in x.grid for b in row)
        if isinstance(x, _nc.M):
            return any(sp.sympify(d).free_symbols for d in x.shape)
        return False

    assert any(
        (isinstance(st, _proof.Eq) and (symbolic(st.lhs) or symbolic(st.rhs)))
        or (isinstance(st, _proof.Entry) and sp.sympify(st.expr).free_symbols)
        or isinstance(st, (_proof.Check, _proof.Cert))
        for st in p.steps
    ), f"{record.id}: no step at symbolic sizes"
    for u in p.uses:
        assert u.startswith("L-") or u in {r.id for r in RECORDS}, f"{record.id} cites unknown {u}"


def test_every_exact_record_holds_for_all_sizes():
    rows = derivations.run_all(["WY-5", "RW-1", "CP-2"])
    assert [r.holds_for for r in rows] == ["all sizes"] * 3


LEMMAS = _proof.lemmas()


@pytest.mark.parametrize("lemma", LEMMAS, ids=[lm.id for lm in LEMMAS])
def test_lemma_proved(lemma):
    why = _proof.check_proof(lemma.proof(), engine=lemma.id not in _proof.ENGINE_LEMMAS)
    assert why == "", f"{lemma.id}: {why}"


def test_run_lemmas_rows():
    rows = derivations.run_lemmas()
    assert {r.id for r in rows} >= set(_proof.ENGINE_LEMMAS) | {"L-gate", "L-ut", "L-blockinv", "L-dinv"}
    assert all(r.ok and r.holds_for == "all sizes" for r in rows)


# ------------------------------------------------------------------------------------------------
# broken rewrites fail both the concrete check and the general proof
# ------------------------------------------------------------------------------------------------

from derivations import backward, backward_fused, chunk_form, cp, rewrites, wy  # noqa: E402


def _both_fail(concrete, general):
    """concrete: (lhs, rhs) built at a tiny size; general: a Proof. Both must be rejected."""
    why_c = _core._check_exact(*concrete)
    why_g = _proof.check_proof(general)
    assert why_c, "the concrete check accepted a broken rewrite"
    assert why_g, "the general proof accepted a broken rewrite"
    return why_c, why_g


def test_broken_output_mask_fails_both():
    # CF-1 with the output mask shifted by one (token t no longer sees itself)
    _, why = _both_fail(chunk_form._outputs(3, 2, 2, out_diagonal=-1), chunk_form._induction("o", out_diagonal=-1))
    assert "step" in why


def test_broken_checkpoint_fails_both():
    # CF-4 without the decay of the entering state (gamma_{j-1} S -> S)
    form = lambda pre, S, v_new_rows: S + pre.k.T * pre.Dr * v_new_rows  # noqa: E731
    _both_fail(chunk_form._checkpoints(3, 2, 2, form=form), chunk_form._checkpoint_proof(form=form))


def test_broken_regate_mask_fails_both():
    # RW-1 with the strict decay mask: the re-gated inverse loses its unit diagonal
    form = lambda ch: rewrites.regated_form(ch, -1)  # noqa: E731
    _both_fail(rewrites._regate(4, 2, form=form), rewrites._general_regate(form=form))


def test_broken_state_gradient_mask_fails_both():
    # RW-6 with R = Q - tril_-1(Q K^T) A B K (mask shifted by one)
    form = lambda ch, dO, dSn, scale: rewrites.state_grad_form(ch, dO, dSn, scale, diagonal=-1)  # noqa: E731
    _both_fail(rewrites._state_grad(3, 2, 2, form=form), rewrites._general_state_grad(form=form))


def test_broken_output_correction_mask_fails_both():
    # CP-3 with the strict mask in R
    _both_fail(cp._outputs(2, 2, 2, 2, diagonal=-1), cp._general_outputs(diagonal=-1))


def test_broken_dL_mask_fails_both():
    # BWD-dk and BWD-fused with dL = -tril_0(...) instead of tril_-1 (mask shifted by one)
    _both_fail(backward._builder("dk", dL_diagonal=0)(3, 2, 2), backward._general("dk", dL_diagonal=0))
    _both_fail(backward_fused._fused_grads(3, 2, 2, dL_diagonal=0), backward_fused._general_fused(dL_diagonal=0))


def test_broken_merge_range_fails_both(monkeypatch):
    # WY-4 with the merge's sum starting one block late
    monkeypatch.setattr(wy, "MERGE_START", 1)
    _both_fail(wy._merge(3, 2), wy._general_merge())


def test_wrong_transpose_fails_both():
    # RW-5 with X = -B A K (A not transposed)
    def xy_wrong(ch, S):
        A = ch.A_free()
        X = -ch.B * A * ch.k
        Y = ch.gamma_C * ch.k * S - ch.Dr * ch.v
        return ch.gamma_C * S + X.T * Y

    _, why = _both_fail(rewrites._xy(3, 2, 2, form=xy_wrong), rewrites._general_rewrite("S_end", xy_wrong))
    assert "remainder" in why

    # RW-6 with M_c instead of M_c^T
    def grad_wrong(ch, dO, dSn, scale):
        A = ch.A_free()
        T_c, _ = rewrites.transition(ch, A)
        M_c = ch.gamma_C * ch.eye(ch.K) - T_c
        R = ch.q - ch.tril(ch.q * ch.k.T, 0) * A * ch.B * ch.k
        return M_c * dSn + scale * (ch.D * R).T * dO

    _both_fail(rewrites._state_grad(3, 2, 2, form=grad_wrong), rewrites._general_state_grad(form=grad_wrong))


def test_broken_block_inverse_fails_both(monkeypatch):
    # WY-5 with the series cut short, and WY-3 with the row update's sign flipped
    short = lambda F, I: (I - F) * (I + F)  # noqa: E731
    monkeypatch.setattr(wy, "nilpotent_series", short)
    _both_fail(wy._nilpotent(1), wy._general_nilpotent(short))
    monkeypatch.undo()
    monkeypatch.setattr(wy, "fs_row", lambda a, X: a - a * X)
    _both_fail(wy._diagonal_block(4), wy._general_forward_substitution())
    monkeypatch.undo()
    # WY-6 without its last factor (I + L^4): exact only for n <= 4, so n = 8 and the general proof fail
    monkeypatch.setattr(wy, "block_product_inverse", lambda L, I: (I - L) * (I + L * L))
    _both_fail(wy._block_product(8), wy._general_block_product())


def test_broken_base_change_fails_both():
    # RW-4 with g_cum_log2 = g_cum * ln 2 (the base change the wrong way round)
    wrong = lambda x: x * sp.log(2)  # noqa: E731
    _both_fail(rewrites._exp2(3, to_log2=wrong), rewrites._general_exp2(to_log2=wrong))


def test_broken_abeta_fails_both():
    # BWD-Abeta with Kg's mask shifted by one (tril_0 instead of tril_-1)
    form = lambda ch: ch.eye(ch.C) - (ch.A_gated() * ch.B) * ch.tril(ch.gate(ch.k * ch.k.T), 0)  # noqa: E731
    _both_fail(backward_fused._a_from_a_beta(4, 2, form=form), backward_fused._general_a_beta(form=form))


# ------------------------------------------------------------------------------------------------
# the general-proof checker rejects what is not proved
# ------------------------------------------------------------------------------------------------

_C = sp.Symbol("C", integer=True, positive=True)


def test_nc_false_identity_leaves_a_remainder():
    X, Y = sym("X", _C, _C), sym("Y", _C, _C)
    assert _nc.is_zero_nc(X * Y - Y * X) != ""  # matrices do not commute
    assert _nc.is_zero_nc((X * Y).T - X.T * Y.T) != ""  # (XY)^T = Y^T X^T, not X^T Y^T
    assert _nc.is_zero_nc((X * Y).T - Y.T * X.T) == ""
    assert _nc.is_zero_nc(tril(X, 0) - tril(X, -1)) != ""  # a mask shifted by one
    with pytest.raises(ValueError):
        X * sym("Z", _C + 1, _C)  # shapes are checked
    with pytest.raises(TypeError):
        X * 0.5  # no floating point in an exact proof


def test_checker_refuses_uncited_rules_and_misplaced_hypotheses():
    A, L = sym("A", _C, _C), sym("L", _C, _C)
    I = eye(_C)
    rules = rules_from(L * A, I - A, "L-ut")
    p = _proof.Proof(claim="c", method="m", uses=(), steps=[_proof.Eq("e", (I + L) * A, I, rules)])
    assert "cites 'L-ut'" in _proof.check_proof(p)
    p.uses = ("L-ut",)
    assert _proof.check_proof(p) == ""
    hyp = rules_from(L * A, I - A, "hyp")
    p2 = _proof.Proof(claim="c", method="m", steps=[_proof.Eq("base", (I + L) * A, I, hyp)])
    assert "hypothesis" in _proof.check_proof(p2)
    p3 = _proof.Proof(claim="c", method="m", uses=("L-nope",), steps=[])
    assert "L-nope" in _proof.check_proof(p3)


def test_checker_rejects_false_entries_and_certificates():
    i, j = sp.symbols("i j", integer=True, nonnegative=True)
    n = sp.Symbol("n", integer=True, positive=True)
    f = sp.Function("f")
    # a mask shifted by one is not the causal mask: fails on the diagonal region
    wrong = sp.Piecewise((f(i, j), i >= j), (0, True)) - sp.Piecewise((f(i, j), i > j), (0, True))
    why = _proof._check_step(_proof.Entry("shifted", wrong, _proof.REGIONS["ij"](i, j, n)))
    assert "nonzero on region" in why
    x = sym("x", _C, 1)
    b = sp.Symbol("b", positive=True)
    nx = _nc.tr(x.T * x)
    bad = _proof.Cert("c", small=0, large=b * (2 - b) * nx, terms=[(b * (2 - b), x)])
    assert "nonnegative" in _proof._check_step(bad)
    ok = _proof.Cert("c", small=0, large=b * (2 - b) * nx, terms=[(b * (2 - b), x)],
                     domain={b: 1 / (1 + sp.Symbol("p", nonnegative=True))})
    assert _proof._check_step(ok) == ""
    wrong_sum = _proof.Cert("c", small=0, large=2 * nx, terms=[(1, x)])
    assert "certificate" in _proof._check_step(wrong_sum)
    hyp_in_base = _proof.Cert("base", small=0, large=nx, terms=[(1, ("hyp", nx))])
    assert "hypothesis" in _proof._check_step(hyp_in_base)


def test_a_broken_lemma_breaks_the_records_citing_it(monkeypatch):
    # replace L-blockinv's proof by a false block inverse (the off-diagonal block's sign flipped): the
    # lemma fails, and so does every record that cites it
    m = sp.Symbol("m", integer=True, positive=True)

    def false_blockinv():
        Mx, Mi, Nx, Ni, R = sym("M", m, m), sym("Minv", m, m), sym("N", _C, _C), sym("Ninv", _C, _C), sym("R", _C, m)
        T = _nc.Block([[Mx, _nc.zeros(m, _C)], [R, Nx]])
        X = _nc.Block([[Mi, _nc.zeros(m, _C)], [Ni * R * Mi, Ni]])
        rules = rules_from(Mx * Mi, eye(m), "def") + rules_from(Nx * Ni, eye(_C), "def")
        return _proof.Proof(claim="false", method="m", steps=[_proof.Eq("T X = I", T * X, _nc.Block.eye(m, _C), rules)])

    monkeypatch.setitem(_proof._LEMMAS, "L-blockinv", _proof.Lemma("L-blockinv", "false", false_blockinv))
    monkeypatch.setattr(_proof, "_PROVED", {})
    assert "cited L-blockinv" in derivations.check_general(derivations.get("WY-3"))
    assert "cited" in derivations.check_general(derivations.get("CF-2"))


def test_cert_citation_must_match_the_cited_conclusion():
    # a bound may cite another bounded record's conclusion only as that record proved it
    x = sym("x", _C, 1)
    nx = _nc.tr(x.T * x)
    p = _proof.Proof(claim="c", method="m", uses=("CP-4",),
                     steps=[_proof.Cert("c", small=0, large=nx, terms=[(1, ("cited", "CP-4", nx))])])
    assert "not the conclusion of CP-4" in _proof.check_proof(p)


def test_grad_refuses_hidden_matrix_factors():
    # a 1 x 1 stretch becomes a scalar symbol; differentiating through it would miss its matrix factors
    k, S = sym("k", _C, 1), sym("S", _C, _C)
    (scalar,) = (k.T * S * k).terms.values()  # k^T S k, a scalar symbol
    F = S * scalar
    with pytest.raises(ValueError, match="scalar made of matrices"):
        _nc.grad([(sym("G", _C, _C), F)], S)


def test_unscaled_output_column_fails_both():
    # RW-7 with O's columns not scaled before the product (the scales applied to Pg v_new' only)
    def scaled_wrong(Ab, W, O, Pg, Sd, Sinv):
        vn_s = Ab * (W * Sd)
        return vn_s * Sinv, (O + Pg * vn_s) * Sinv

    _both_fail(rewrites._row_scaled(3, 2, form=scaled_wrong), rewrites._general_row_scaled(form=scaled_wrong))

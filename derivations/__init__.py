"""SymPy-checked algebra behind the chunked Gated DeltaNet kernels.

Each algebraic step is an `Identity` record (derivations/_core.py) with an id, a statement, its LaTeX,
its kind (exact, or bounded with its bound and condition), a builder of SymPy matrices at tiny sizes
and the names of its two numeric twins in `reference/`. Families:

    CF   derivations/chunk_form.py  chunk form == token recurrence (outputs, end state, v_new)
    WY   derivations/wy.py          WY/UT representation; solve_tril's blockwise inverse
    RW   derivations/rewrites.py    the hardware-friendly rewrites of the fused kernels
    BWD  derivations/backward.py    hand-written chunk gradients == sympy.diff of the loss
    CP   derivations/cp.py          affine segment maps, composition, output correction, truncation bounds

The general proofs rest on:

    derivations/_nc.py        non-commutative matrix algebra at symbolic sizes: generators, masks, dg,
                              traces, block matrices, rewrite rules, gradients by adjoints
    derivations/_proof.py     proofs (steps Eq / Entry / Check / Cert), lemmas, the checker
    derivations/lemmas.py     the lemmas (L-...), each proved for every size
    derivations/_symbolic.py  one chunk at symbolic sizes (GChunk), one token more (Ext), one token (One)

Every record is proved twice: entry by entry at tiny concrete sizes, and for every size by its general
proof (`Identity.general`, a `derivations._proof.Proof`: non-commutative matrix algebra at symbolic sizes
with stated rewrite rules, entry-level case splits, inductions), citing the lemmas of
`derivations.lemmas` (each proved for every size) and other records. The table's "holds for" column says
"all sizes" when the general proof holds.

    python -m derivations            proves every record and lemma, prints both tables, exit status 1 on a failure
    python -m derivations --explain ID   the record's general proof: claim, method, citations, steps and rules
    derivations.run_all()            the rows (`Result`: id, statement, kind, holds_for, sizes, seconds, status, ok)
    derivations.run_lemmas()         the lemmas' rows
    derivations.format_table(rows)   the table as text
"""

from ._core import (Bound, Identity, Result, check, check_general, explain, format_table, get, is_zero, register,
                               registry, run_all, run_lemmas, run_one)
from . import lemmas  # noqa: E402,F401  (registers the lemmas)
from . import chunk_form, wy, rewrites, backward, backward_fused, cp  # noqa: E402,F401  (registers the records)

__all__ = [
    "Identity",
    "Bound",
    "Result",
    "register",
    "registry",
    "get",
    "check",
    "check_general",
    "explain",
    "run_lemmas",
    "is_zero",
    "run_one",
    "run_all",
    "format_table",
    "main",
]


def main(argv=None) -> int:
    """``python -m derivations [-j N] [ID ...]`` (installed: ``python -m flashqla.derivations``): prove
    the records, print the table, return the exit status (0 when every record is proved)."""
    import argparse
    import time

    prog = "python -m flashqla.derivations" if __name__.startswith("flashqla.") else "python -m derivations"
    parser = argparse.ArgumentParser(prog=prog, description="prove the identity records")
    parser.add_argument("ids", nargs="*", help="record ids (default: all)")
    parser.add_argument("-j", "--processes", type=int, default=1, help="worker processes (default 1)")
    parser.add_argument("--explain", action="store_true", help="print the general proof of each given record instead")
    args = parser.parse_args(argv)
    known = {r.id for r in registry()}
    unknown = [i for i in args.ids if i not in known]
    if unknown:
        parser.error(f"unknown record id(s) {', '.join(unknown)}; known: {', '.join(sorted(known))}")
    if args.explain:
        for i in args.ids or sorted(known):
            print(explain(get(i)))
        return 0
    from ._core import run_records_and_lemmas

    t0 = time.perf_counter()
    rows, lemma_rows = run_records_and_lemmas(args.ids or None, processes=args.processes, lemmas=not args.ids)
    print(format_table(rows))
    if lemma_rows:
        print("\nlemmas (cited by the general proofs)")
        print(format_table(lemma_rows))
    n_ok = sum(r.ok for r in rows)
    n_all = sum(r.holds_for == "all sizes" for r in rows)
    n_lem = sum(r.ok for r in lemma_rows)
    lem = f"; {n_lem}/{len(lemma_rows)} lemmas proved" if lemma_rows else ""
    print(f"{n_ok}/{len(rows)} proved ({n_all} for all sizes){lem} in {time.perf_counter() - t0:.1f} s")
    return 0 if n_ok == len(rows) and n_lem == len(lemma_rows) else 1

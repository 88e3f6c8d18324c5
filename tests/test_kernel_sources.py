"""The generated CUDA source of the shipped kernels is the recorded one (`tests/kernel_sources.py`):
a change to Python code around the kernels (a move, a rename, a removed variant) that changes what a
kernel compiles to fails here, on the CPU, without a GPU. Lowering needs TileLang only (no nvcc).

After a deliberate kernel change, rewrite the record: `python tests/kernel_sources.py --write` (with
`--configs NAME[,NAME]` only those configurations)."""

from __future__ import annotations

import json

import pytest

import kernel_sources as ks


def test_one_build_of_each_kind_is_recorded():
    """One build of each kernel kind of the quick configuration lowers to a source recorded for it."""
    got = [tuple(r) for r in ks._run_one(ks.QUICK, one_per_kind=True, parts=2)]  # two processes: the CI's two cores
    recorded = {tuple(r) for r in json.loads(ks.RECORD.read_text())[ks.QUICK]}
    kinds = {sym for sym, _ in got}
    assert len(kinds) >= 14, kinds  # every family: prepare, recurrent, passes 1-3, the split path's kernels
    missing = [r for r in got if r not in recorded]
    assert not missing, f"kernel sources changed: {missing}"


@pytest.mark.compile_all
def test_every_build_is_recorded():
    """Every build of every recorded configuration, in processes of their own (a few minutes)."""
    got = ks.collect(list(ks.CONFIGS), jobs=2)
    assert not ks.compare(got, json.loads(ks.RECORD.read_text()))


def test_compare_names_what_changed():
    rec = {"c": [["k", "aa"], ["k", "bb"]]}
    assert ks.compare({"c": [["k", "bb"], ["k", "aa"]]}, rec) == []
    bad = ks.compare({"c": [["k", "aa"], ["k", "cc"]]}, rec)
    assert len(bad) == 1 and "cc" in bad[0] and "bb" in bad[0]
    assert "not in the record" in ks.compare({"d": []}, rec)[0]


def test_write_keeps_the_configurations_not_named(tmp_path, monkeypatch):
    """`--write --configs NAME` rewrites NAME's digests only; the other configurations keep theirs."""
    rec = tmp_path / "record.json"
    rec.write_text(json.dumps({name: [["k", "aa"]] for name in ks.CONFIGS}))
    monkeypatch.setattr(ks, "RECORD", rec)
    monkeypatch.setattr(ks, "collect", lambda names, jobs=2: {n: [["k", "bb"]] for n in names})
    first, second = list(ks.CONFIGS)[:2]
    assert ks.main(["--write", "--configs", first]) == 0
    got = json.loads(rec.read_text())
    assert set(got) == set(ks.CONFIGS) and got[first] == [["k", "bb"]] and got[second] == [["k", "aa"]]


def test_async_store_hazards_finds_a_tile_rewritten_after_the_wait():
    """`async_store_hazards`: a TMA-stored tile written after `tma_store_wait` with no barrier between
    is named; a CTA barrier or an mbarrier arrive in between, or a write to another buffer, is not."""
    store = "tl::tma_store(A_desc, (&(((bfloat16_t*)ka_s)[0])), 0, 0, 0);"
    racy = "\n".join([store, "tl::tma_store_wait<0, true>();", "x = 1;", "((bfloat16_t*)ka_s)[tid] = v;"])
    assert len(ks.async_store_hazards(racy)) == 1 and "ka_s" in ks.async_store_hazards(racy)[0]
    for ordering in ("__syncthreads();", "s_empty[0].arrive();"):
        ok = "\n".join([store, "tl::tma_store_wait<0, true>();", ordering, "((bfloat16_t*)ka_s)[tid] = v;"])
        assert ks.async_store_hazards(ok) == []
    other = "\n".join([store, "tl::tma_store_wait<0, true>();", "g_cum_log2[i] = ((float*)gc_s)[i];"])
    assert ks.async_store_hazards(other) == []


"""CPU tests of the benchmark harness (forward, and what both benchmarks share): grid, FLOP counts,
CP rows, the fp64 result of the gate (`reference/`) against the token recurrence, CSV resume and the
peers' cache, the implementation table, report formatting, the measuring loop with stand-in
implementations, and the command line. No GPU, no peer package needed."""

from __future__ import annotations

import dataclasses
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from flashqla.bench import grid as G
from flashqla.bench import impls as I
from flashqla.bench import plots
from flashqla.bench import report as R
from flashqla.bench import store as S
from flashqla.bench.breakdown import STEP_NAMES, step_bytes
from flashqla.bench.gate import fp64_result, rel_rms
from flashqla.bench.impls import ENV_FIELDS, Impl, gpu_slug
from flashqla.bench.inputs import RowInputs
from flashqla.bench.timing import Timing, launches_for
from flashqla.testing import make_gdn_inputs
from flashqla.testing import rel_rms as rel_rms_host

ROOT = Path(__file__).resolve().parents[1]
FWD = S.SCHEMAS["fwd"]
ENV = dict(gpu="Test GPU", driver="1.0", cuda="12.8", torch="2.x", triton="3.x", tilelang="0.1.15",
           fla="0.6.0", flash_qla="0.1.3", flashinfer="0.7.2.post1")


# ---------------------------------------------------------------- grid


def test_grid_is_flashqlas_published_table():
    rows = G.fwd_rows()
    assert len(G.FWD_HEADS) == 9 and len(G.FWD_MIXES) == 19 and len(rows) == 171
    assert [h.label for h in G.FWD_HEADS] == ["2/8", "4/16", "8/32", "16/64", "16/32", "8/24", "16/48", "16/16", "32/32"]
    assert len({r.key for r in rows}) == 171
    assert all(m.T in (2048, 4096, 8192, 16384, 32768) for m in G.FWD_MIXES)


@pytest.mark.parametrize("text, lengths", [
    ("1x32768", (32768,)),
    ("8192x4", (8192,) * 4),
    ("1024x8", (1024,) * 8),
    ("28672+4096", (28672, 4096)),
    ("1024+7168", (1024, 7168)),
    (" 64 + 100 + 3 ", (64, 100, 3)),
    ("2048", (2048,)),
])
def test_parse_mix(text, lengths):
    m = G.parse_mix(text)
    assert m.lengths == lengths
    assert m.T == sum(lengths) and m.N == len(lengths)
    assert m.cu_seqlens[0] == 0 and m.cu_seqlens[-1] == m.T and len(m.cu_seqlens) == m.N + 1


@pytest.mark.parametrize("bad", ["", "x", "8192x", "0x4", "4x0", "10+0", "1e3", "8192*4", "8192x4x2"])
def test_parse_mix_rejects(bad):
    with pytest.raises(ValueError):
        G.parse_mix(bad)


def test_parse_heads():
    assert G.parse_heads("16/32") == G.HeadConfig(16, 32)
    assert G.parse_heads(" 2 / 8 ").label == "2/8"
    for bad in ("16", "16/33", "0/8", "a/b", "16-32"):
        with pytest.raises(ValueError):
            G.parse_heads(bad)


def test_select_rows_quick_and_filters():
    quick = G.select_rows(quick=True)
    assert [r.label for r in quick] == ["16/32 1x8192", "16/32 8192x4", "2/8 1x32768", "16/64 1024x8"]
    assert [r.label for r in G.select_rows(["16/32"], quick=True)] == ["16/32 1x8192", "16/32 8192x4"]
    rows = G.select_rows(["16/32,2/8"], ["1x8192", "8192x4"])
    assert [r.label for r in rows] == ["2/8 1x8192", "2/8 8192x4", "16/32 1x8192", "16/32 8192x4"]  # grid order
    assert len(G.select_rows(["16/64"])) == 19
    assert len(G.select_rows(mixes=["1024x8"])) == 9
    extra = G.select_rows(["1/2"], ["64+100"])
    assert [r.label for r in extra] == ["1/2 64+100"]


def test_flop_count_and_tflops():
    assert G.FLOP_PER_TOKEN_HEAD == {"fwd": 163_840, "bwd": 491_520, "step": 655_360}
    assert G.flop(32768, 64) == 163_840 * 32768 * 64 and G.flop(10, 2, "step") == 655_360 * 20
    # 16/64 1x32768 in 1.0 ms: 343.6 TFLOP/s, 47.3 % of 726
    tf = G.tflops(1.0, 32768, 64)
    assert tf == pytest.approx(343.597383680, rel=1e-9)
    assert G.pct_of_peak(tf) == pytest.approx(100 * 343.597383680 / 726, rel=1e-9)
    # 1,032 B per token-head for MHA; state term N*HV*131,072
    assert G.fwd_min_bytes(1000, 1, 4, 4) == 1000 * 4 * 1032 + 4 * 131_072


def test_cp_rows():
    cp = lambda h, m: G.is_cp_row(G.parse_mix(m).lengths, G.parse_heads(h).h_v)  # noqa: E731
    assert cp("2/8", "1x32768") and cp("16/64", "1x32768") and cp("32/32", "28672+4096")
    assert not cp("16/64", "28672+4096")      # 73 busy pairs: more than half the SMs
    assert not cp("2/8", "8192x4")            # no dominant sequence
    assert not cp("16/32", "16384+16384") and not cp("32/32", "1024x8")
    assert G.effective_parallelism((28672, 4096), 64) == pytest.approx(64 * 32768 / 28672)
    assert sum(G.is_cp_row(r.mix.lengths, r.heads.h_v) for r in G.fwd_rows()) == 109


# ---------------------------------------------------------------- the gate's fp64 result, metric


def row_inputs(x: dict, lengths, do=None, dht=None) -> RowInputs:
    """A `make_gdn_inputs` dict (B = 1, packed) as the benchmark's row inputs."""
    return RowInputs(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], x["cu_seqlens"], tuple(lengths),
                     do=do, dht=dht, scale=x["q"].shape[-1] ** -0.5)


@pytest.mark.parametrize("lengths, H, HV, initial_state, batch", [
    ([37, 1, 90], 2, 4, True, None),        # varlen with a 1-token sequence, GVA 2, all heads at once
    ([37, 1, 90], 2, 4, True, 1),           # one value head per batch
    ([64, 128, 70], 1, 4, False, 640),      # GVA 4, two value heads per batch (320 chunk-padded tokens), no h0
    ([150], 3, 6, True, 400),               # one sequence, 3 q/k heads, two value heads per batch
])
def test_fp64_result_is_the_token_recurrence(lengths, H, HV, initial_state, batch):
    """The gate's forward result (`reference.chunk_gated_delta_rule` in fp64, in batches of value
    heads) equals the fp64 token recurrence, whatever the batching."""
    from reference.gdn.recurrent import recurrent_gated_delta_rule

    x = make_gdn_inputs(B=1, T=sum(lengths), H=H, HV=HV, K=16, V=8, seqlens=lengths, initial_state=initial_state,
                        seed=len(lengths))
    o_ref, ht_ref = recurrent_gated_delta_rule(**x, output_final_state=True)
    got = fp64_result(row_inputs(x, lengths), max_token_heads=batch)
    assert set(got) == {"o", "ht"}
    assert got["o"].dtype == torch.float64 and got["o"].shape == o_ref.shape and got["ht"].shape == ht_ref.shape
    assert rel_rms(got["o"], o_ref) < 1e-12
    assert rel_rms(got["ht"], ht_ref) < 1e-12


def test_fp64_result_from_bf16_inputs_without_state():
    """From the rounded inputs the kernels get (bf16 q/k/v, fp32 g/beta): the recurrence on the same
    rounded values, in fp64."""
    from reference.gdn.recurrent import recurrent_gated_delta_rule

    x = make_gdn_inputs(T=60, H=1, HV=2, K=32, V=16, seqlens=[20, 40], dtype=torch.bfloat16,
                        beta_dtype=torch.float32, initial_state=False)
    up = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in x.items()}
    o_ref, ht_ref = recurrent_gated_delta_rule(**up, output_final_state=True)
    got = fp64_result(row_inputs(x, [20, 40]))
    assert rel_rms(got["o"], o_ref) < 1e-12 and rel_rms(got["ht"], ht_ref) < 1e-12


def test_fp64_batches_follow_the_token_head_budget(monkeypatch):
    """Value heads go to the reference in batches of max_token_heads // chunk-padded tokens (at least
    one head), each batch with its own q/k heads."""
    import reference

    calls = []
    real = reference.chunk_gated_delta_rule

    def spy(q, k, v, *args, **kw):
        calls.append((q.shape[2], v.shape[2]))
        return real(q, k, v, *args, **kw)

    monkeypatch.setattr(reference, "chunk_gated_delta_rule", spy)
    lengths = [100, 1]                                   # 2 + 1 chunks: 192 padded tokens
    assert G.padded_tokens(lengths) == 192
    x = row_inputs(make_gdn_inputs(B=1, T=101, H=2, HV=6, K=16, V=8, seqlens=lengths), lengths)
    for budget, sizes in ((None, [6]), (192 * 4, [4, 2]), (192 * 2 + 1, [2, 2, 2]), (1, [1] * 6)):
        calls.clear()
        fp64_result(x, max_token_heads=budget)
        assert [hv for _, hv in calls] == sizes and all(h == hv for h, hv in calls), (budget, calls)


def test_device_rel_rms_is_the_testing_metric():
    gen = torch.Generator().manual_seed(1)
    ref = torch.randn(3, 50, generator=gen, dtype=torch.float64)
    x = (ref + 1e-3 * torch.randn(3, 50, generator=gen, dtype=torch.float64)).to(torch.bfloat16)
    assert rel_rms(x, ref) == pytest.approx(rel_rms_host(x, ref), rel=1e-12)
    assert rel_rms(torch.full_like(ref, math.nan), ref) == math.inf
    with pytest.raises(ValueError):
        rel_rms(ref, torch.zeros_like(ref))
    with pytest.raises(ValueError):
        rel_rms(ref[:2], ref)


# ---------------------------------------------------------------- timing helpers


def test_launches_for():
    assert launches_for(0.1, 25.0, 3, 200) == 200
    assert launches_for(1.0, 25.0, 3, 200) == 25
    assert launches_for(50.0, 25.0, 3, 200) == 3
    assert launches_for(0.0, 25.0, 3, 200) == 200
    t = Timing(ms=2.0, replays_ms=[1.9, 2.0, 2.2], launches=10)
    assert t.spread == pytest.approx(0.15)


def test_timer_refuses_without_cuda():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    from flashqla.bench.timing import time_cuda_graph

    with pytest.raises(RuntimeError, match="CUDA"):
        time_cuda_graph(lambda: None)


# ---------------------------------------------------------------- CSV store


def _result_line(env, commit, h_qk, h_v, mix, ours_ms=1.0, status="ok", date="2026-01-01T00:00:00Z"):
    m = G.parse_mix(mix)
    line = {**{f: env[f] for f in ENV_FIELDS}, "commit": commit, "h_qk": h_qk, "h_v": h_v, "mix": m.label,
            "T": m.T, "N": m.N, "cp_row": int(G.is_cp_row(m.lengths, h_v)),
            "parallelism": G.effective_parallelism(m.lengths, h_v), "date": date,
            "ours_ms": ours_ms if status == "ok" else "", "ours_status": status, "ours_err_o": 1e-3, "ours_err_ht": 2e-3}
    return line


def test_csv_append_and_resume_keys(tmp_path):
    p = tmp_path / "r.csv"
    S.append_row(p, _result_line(ENV, "c1", 16, 32, "1x8192"), FWD.result_fields)
    S.append_row(p, _result_line(ENV, "c1", 16, 32, "8192x4"), FWD.result_fields)
    S.append_row(p, _result_line(ENV, "c2", 2, 8, "1x32768"), FWD.result_fields)
    other = dict(ENV, driver="2.0")
    S.append_row(p, _result_line(other, "c1", 16, 64, "1024x8"), FWD.result_fields)
    rows = S.read_rows(p)
    assert len(rows) == 4
    assert S.done_keys(rows, ENV, "c1") == {(16, 32, "1x8192"), (16, 32, "8192x4")}
    assert S.done_keys(rows, ENV, "c2") == {(2, 8, "1x32768")}
    assert S.done_keys(rows, other, "c1") == {(16, 64, "1024x8")}
    assert S.done_keys(rows, ENV, "c3") == set()
    peers_only = _result_line(ENV, "c1", 8, 32, "1x2048")
    peers_only["ours_status"] = ""
    S.append_row(p, peers_only, FWD.result_fields)
    assert (8, 32, "1x2048") not in S.done_keys(S.read_rows(p), ENV, "c1")
    assert (8, 32, "1x2048") in S.done_keys(S.read_rows(p), ENV, "c1", need=())
    # a row measured again keeps its last line
    S.append_row(p, _result_line(ENV, "c1", 16, 32, "1x8192", ours_ms=0.5), FWD.result_fields)
    got = [r for r in S.rows_for_key(S.read_rows(p), ENV, "c1") if r["ours_status"]]
    assert len(got) == 2 and {S.num(r["ours_ms"]) for r in got} == {0.5, 1.0}
    env, commit = S.latest_key(S.read_rows(p))
    assert commit == "c1" and env == ENV
    # --report-only --commit: that commit's rows, whatever was measured later
    assert S.latest_key(S.read_rows(p), "c2") == (ENV, "c2") and S.latest_key(S.read_rows(p), "c9") is None
    # rows of several commits: each row key from the first commit that has it, other envs never
    S.append_row(p, _result_line(ENV, "c2", 16, 32, "1x8192", ours_ms=0.25), FWD.result_fields)
    merged = {(r["h_qk"], r["mix"]): r for r in S.rows_for_commits(S.read_rows(p), ENV, ["c2", "c1"])}
    assert merged[("16", "1x8192")]["commit"] == "c2" and S.num(merged[("16", "1x8192")]["ours_ms"]) == 0.25
    assert merged[("16", "8192x4")]["commit"] == "c1" and merged[("2", "1x32768")]["commit"] == "c2"
    assert ("16", "1024x8") not in merged
    assert {r["commit"] for r in S.rows_for_commits(S.read_rows(p), ENV, ["c1"])} == {"c1"}
    with pytest.raises(ValueError):
        S.append_row(p, {"bogus": 1}, FWD.result_fields)


def test_csv_schema_change_rewrites_with_union(tmp_path):
    p = tmp_path / "r.csv"
    S.append_row(p, {"a": 1, "b": 2}, ["a", "b"])
    S.append_row(p, {"a": 3, "c": 4}, ["a", "c"])
    rows = S.read_rows(p)
    assert rows == [{"a": "1", "c": "", "b": "2"}, {"a": "3", "c": "4", "b": ""}]


def test_peer_cache(tmp_path):
    p = tmp_path / "peers.csv"
    c = S.PeerCache(p, ENV)
    rf = {"h_qk": 16, "h_v": 32, "mix": "1x8192", "T": 8192, "N": 1}
    c.put("fla", rf, {"ms": 0.472, "status": "ok", "err_o": 3e-3, "err_ht": 1e-3}, "d1")
    c.put("flash_qla", rf, {"ms": 0.28, "status": "ok"}, "d1")
    c.put("fla", dict(rf, mix="8192x4", T=32768, N=4), {"status": "error: OutOfMemoryError: x"}, "d1")
    c2 = S.PeerCache(p, ENV)
    assert len(c2) == 3
    assert S.num(c2.get("fla", (16, 32, "1x8192"))["ms"]) == pytest.approx(0.472)
    assert c2.has_row((16, 32, "1x8192"), ("fla", "flash_qla")) and not c2.has_row((16, 32, "1x8192"))
    assert c2.get("fla", (16, 32, "8192x4")) is None                       # errors are not results
    assert c2.get("fla", (16, 32, "8192x4"), include_errors=True) is not None
    assert not c2.has_row((16, 32, "8192x4"))
    newer = S.PeerCache(p, dict(ENV, flash_qla="0.1.4"))                    # keyed by each peer's version
    assert newer.get("flash_qla", (16, 32, "1x8192")) is None and newer.get("fla", (16, 32, "1x8192")) is not None
    # the last line of a key wins
    c2.put("fla", rf, {"ms": 0.5, "status": "ok"}, "d2")
    assert S.num(S.PeerCache(p, ENV).get("fla", (16, 32, "1x8192"))["ms"]) == pytest.approx(0.5)


def test_pick_retime():
    keys = list(range(10))
    assert S.pick_retime(keys, 3) == [0, 4, 9] or S.pick_retime(keys, 3) == [0, 5, 9]
    assert S.pick_retime(keys, 0) == [] and S.pick_retime([], 3) == []
    assert S.pick_retime(keys[:2], 5) == [0, 1]
    assert S.pick_retime(keys, 1) == [5]


def test_gpu_slug():
    assert gpu_slug("NVIDIA H200") == "h200"
    assert gpu_slug("NVIDIA H100 80GB HBM3") == "h100-80gb-hbm3"


# ---------------------------------------------------------------- report


def _row(h_qk, h_v, mix, ours, fla, fq, fla_status="ok"):
    line = _result_line(ENV, "c", h_qk, h_v, mix, ours_ms=ours)
    line.update({"fla_ms": fla if fla_status == "ok" else "", "fla_status": fla_status, "fla_err_o": 0.05 if fla_status == "FAIL" else 1e-3,
                 "flash_qla_ms": fq, "flash_qla_status": "ok", "flash_qla_err_o": 2e-3, "flash_qla_err_ht": 1e-3,
                 "peers_source": "live"})
    return {k: S.fmt(v) for k, v in line.items()}


def test_speedup_and_geomean():
    r = _row(16, 32, "8192x4", 0.5, 1.9, 0.6)
    assert R.speedup(r, "ours", "fla") == pytest.approx(3.8)
    assert R.speedup(r, "ours", "flash_qla") == pytest.approx(1.2)
    assert R.geomean([2.0, 8.0]) == pytest.approx(4.0)
    assert math.isnan(R.geomean([]))
    assert R.geomean([4.0, math.nan, -1.0]) == pytest.approx(4.0)
    failed = _row(16, 32, "8192x4", 0.5, 1.9, 0.6, fla_status="FAIL")
    assert math.isnan(R.speedup(failed, "ours", "fla"))
    assert R.cell_ms(failed, "fla") == "FAIL (5.0e-02)"
    assert R.cell_ms({"ours_status": "not available (ImportError: x)"}, "ours") == "n/a"
    assert R.cell_ms({"ours_status": "error: timing: RuntimeError"}, "ours") == "error"
    assert R.cell_ms({}, "ours") == "-"


def test_markdown_report(tmp_path):
    rows = [_row(16, 32, "8192x4", 0.5, 2.0, 0.5), _row(2, 8, "1x32768", 0.4, 0.9, 0.3),
            _row(16, 32, "1x8192", 0.25, 0.5, 0.3, fla_status="FAIL"),
            {**_row(16, 64, "1024x8", 1.0, 1.0, 1.0), "ours_status": "not available (ImportError: no op)", "ours_ms": ""}]
    # the first row's peers came from the cache and were re-timed: FLA 2.0 ms cached, 2.1 ms live; FlashQLA's
    # live run failed its gate
    rows[0].update({"peers_source": "cached (re-timed)", "fla_retime_ms": "2.1", "fla_retime_status": "ok",
                    "flash_qla_retime_ms": "", "flash_qla_retime_status": "FAIL"})
    meta = {"date": "2026-11-29T00:00:00Z", "method": ["timer line"]}
    md = R.markdown("fwd", rows, ENV, "abc123", meta)
    for needle in ("| GPU | Test GPU |", "| driver | 1.0 |", "| CUDA (torch build) | 12.8 |", "| triton | 3.x |",
                   "| tilelang | 0.1.15 |", "| fla | 0.6.0 |", "| flash_qla | 0.1.3 |", "| our commit | abc123 |",
                   "2026-11-29", "- timer line", "FAIL (5.0e-02)", "| n/a |", "+5.0%", "single-sequence few-head"):
        assert needle in md, needle
    # grid order: 2/8 before 16/64 before 16/32 (FlashQLA's head order), 1x8192 before 8192x4
    body = md[md.index("## Forward, per row"):]
    assert body.index("| 2/8 | 1x32768") < body.index("| 16/64 | 1024x8") < body.index("| 16/32 | 1x8192") < body.index("| 16/32 | 8192x4")
    # geometric means: ours over FLA on the two passing rows = sqrt(4 * 2.25) = 3.0; CP row 2/8 1x32768 alone 2.25
    gm = md[md.index("## Geometric-mean"):md.index("## Forward, per row")]
    assert "| ours over FLA | 3.00x (n=2) | 2.25x (n=1) | 4.00x (n=1) |" in gm
    assert "| FlashQLA over FLA |" in gm
    # the CP column and TFLOP/s: 2/8 1x32768 at 0.4 ms = 107 TFLOP/s = 14.8 %
    line = [ln for ln in md.splitlines() if ln.startswith("| 2/8 | 1x32768")][0]
    assert "| CP |" in line and "| 107 |" in line  # no measured GEMM rate for "Test GPU": no percentage
    assert G.peak_tflops("NVIDIA H200") == 726.0 and G.peak_tflops("Test GPU") is None
    assert G.peak_tflops("NVIDIA H100 80GB HBM3") == 733.0 and G.peak_tflops("NVIDIA H200 NVL") == 726.0
    h200 = R.markdown("fwd", [dict(r, gpu="NVIDIA H200") for r in rows], dict(ENV, gpu="NVIDIA H200"), "abc123",
                      {"date": "d", "method": []})
    assert "107 (14.8%)" in h200 and "ours TFLOP/s (% of 726)" in h200
    assert "Gate errors" in md
    drift = md[md.index("## Drift"):]
    assert "| 16/32 | 8192x4 | FLA | 2.000 | 2.100 | +5.0% | c |" in drift
    assert "| 16/32 | 8192x4 | FlashQLA | 0.500 | FAIL | - | c |" in drift
    assert "No re-timed rows recorded" not in drift and "not recorded" not in drift


def test_drift_section_from_the_csv_columns_only():
    """The Drift section lists what the rows keep: re-timed columns when filled; a row marked
    re-timed without them (written before they existed) by name, with no number; else nothing."""
    plain = _row(16, 32, "8192x4", 0.5, 2.0, 0.5)
    assert R.drift_section([plain])[2] == "No re-timed rows recorded."
    legacy = {**_row(2, 8, "1x32768", 0.4, 0.9, 0.3), "peers_source": "cached (re-timed)"}
    text = "\n".join(R.drift_section([plain, legacy]))
    assert text.startswith("## Drift") and "No re-timed rows recorded: " in text and "2/8 1x32768 at c" in text
    assert "| " not in text and "0.900" not in text and "%" not in text           # no number is made up
    new = {**_row(16, 32, "1x8192", 0.25, 0.5, 0.3), "peers_source": "cached (re-timed)",
           "fla_retime_ms": "0.45", "fla_retime_status": "ok"}
    text = "\n".join(R.drift_section([plain, legacy, new]))
    assert "| 16/32 | 1x8192 | FLA | 0.500 | 0.450 | -10.0% | c |" in text and "FlashQLA" not in text
    assert "Also re-timed, live times not recorded: " in text and "2/8 1x32768 at c" in text


def test_every_page_that_names_drift_has_the_section():
    """The committed pages: a Method that points at the Drift section is backed by one; and the CP
    page's header counts its own rows (it shows a subset of the forward CSV's rows)."""
    import re

    pages = {name: (ROOT / "benchmarks" / "results" / name).read_text() for name in ("h200-fwd.md", "h200-cp.md", "h200-bwd.md")}
    for name, md in pages.items():
        assert "Drift" in md[md.index("## Method"):md.index("## Geometric-mean")], name
        assert "\n## Drift of the cached peer timings\n" in md, name
        assert "listed under Drift" not in md, name
    cp = pages["h200-cp.md"]
    table = cp[cp.index("## Forward, per row"):]
    table = table[:table.index("\n## ", 1)]  # the per-row table alone (the Drift table lists rows too)
    shown = [ln for ln in table.splitlines() if re.match(r"\| \d+/\d+ \|", ln)]
    header = [ln for ln in cp.splitlines() if ln.startswith("| our commit |")][0]
    counts = [int(n) for n in re.findall(r"\((\d+) rows\)", header)]
    assert counts and sum(counts) == len(shown) == 24


def test_breakdown_bytes_and_markdown():
    T, N, NT, H, HV = 8192, 4, 128, 16, 32
    sb = step_bytes(T, N, NT, H, HV)
    assert [s.step for s in sb] == list(STEP_NAMES)
    by = {s.step: s for s in sb}
    assert by["chunk_local_cumsum"].inter_written == 4 * T * HV
    assert by["kkt_solve"].inter_written == 2 * 2 * T * HV * 64
    assert by["recompute_w_u_fwd"].inter_written == 2 * 2 * T * HV * 128
    assert by["chunk_gated_delta_rule_fwd_h"].inter_written == 2 * NT * HV * 128 * 128 + 2 * T * HV * 128
    assert by["chunk_fwd_o"].out_written == 2 * T * HV * 128
    # every intermediate written is read back at least once
    written = sum(s.inter_written for s in sb) - by["kkt_solve"].inter_written // 2  # A's zero fill is not read
    read = sum(s.inter_read for s in sb)
    assert read >= written
    base = {**ENV, "commit": "c", "h_qk": str(H), "h_v": str(HV), "mix": "8192", "T": str(T), "N": str(N)}
    brows = [{**base, "step": s.step, "ms": "0.1", "inputs_read": str(s.inputs_read), "inter_read": str(s.inter_read),
              "inter_written": str(s.inter_written), "out_written": str(s.out_written), "note": ""} for s in sb]
    brows.append({**base, "step": "intra", "ms": "0.15", "inputs_read": "", "inter_read": "", "inter_written": "",
                  "out_written": "", "note": "fwd_intra"})
    rows = [{**_row(16, 32, "8192", 0.3, 0.6, 0.4)}]
    md = "\n".join(R.breakdown_markdown(brows, rows))
    assert "### 16/32 8192" in md and "sum of the five steps: 0.500 ms" in md
    assert "FLA's whole forward in one graph: 0.600 ms" in md and "round trip" in md
    assert "ours (whole forward): 0.300 ms" in md


def test_plot_writes_png(tmp_path):
    pytest.importorskip("matplotlib")
    rows = [_row(16, 32, "8192x4", 0.5, 2.0, 0.5), _row(2, 8, "1x32768", 0.4, 0.9, 0.3)]
    out = plots.plot_fwd(rows, tmp_path / "p.png")
    assert out is not None and out.stat().st_size > 1000


# ---------------------------------------------------------------- the measuring loop, on CPU


def _good(x):
    ref = fp64_result(x)
    return ref["o"].to(torch.bfloat16), ref["ht"].float()


def _wrong(x):
    o, ht = _good(x)
    return o, ht * 1.5


def _broken(x):
    raise RuntimeError("kernel exploded")


def _host_timer(counter):
    def time_fn(fn, **kw):
        fn()
        counter.append(1)
        return Timing(ms=1.0 + 0.25 * len(counter), replays_ms=[1.0], launches=3)
    return time_fn


def _run(tmp_path, argv, impls, commit="c1"):
    from flashqla.bench.__main__ import parse_args
    from flashqla.bench.runner import run_rows

    opts = parse_args(argv + ["--results-dir", str(tmp_path), "--no-plot"])
    rows = G.select_rows(opts.heads, opts.mixes, opts.quick)
    calls = []
    rc = run_rows(rows, opts, impls, ENV, commit, device="cpu", time_fn=_host_timer(calls))
    return rc, calls


def test_loop_gate_resume_cache_and_drift(tmp_path, capsys):
    impls = {"ours": Impl("ours", "ours", fn=_good), "fla": Impl("fla", "FLA", fn=_wrong),
             "flash_qla": Impl("flash_qla", "FlashQLA", fn=_good)}
    argv = ["--heads", "1/2", "--mixes", "16+20,9x2", "--peers", "live"]
    rc, calls = _run(tmp_path, argv, impls)
    assert rc == 0 and len(calls) == 4            # ours and FlashQLA timed on 2 rows; FLA failed its gate
    res = S.rows_for_key(S.read_rows(tmp_path / "test-gpu-fwd.csv"), ENV, "c1")
    assert len(res) == 2
    for r in res:
        assert r["ours_status"] == "ok" and r["flash_qla_status"] == "ok"
        assert r["fla_status"] == "FAIL" and r["fla_ms"] == ""
        assert S.num(r["ours_err_o"]) < 1e-2 and S.num(r["fla_err_ht"]) > 0.1
    peers = S.read_rows(tmp_path / "peers-test-gpu-fwd.csv")
    assert len(peers) == 4 and {p["impl"] for p in peers} == {"fla", "flash_qla"}
    md = (tmp_path / "test-gpu-fwd.md").read_text()
    assert "| 1/2 | 16+20 |" in md and "FAIL" in md

    # rerun, same key: everything skipped
    rc, calls = _run(tmp_path, argv, impls)
    assert rc == 0 and calls == []
    assert "resuming: 2 of 2 rows" in capsys.readouterr().out

    # new commit, cached peers, one re-timed row, one extra row without cache (cached mode: '-')
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "16+20,9x2,1x5", "--peers", "cached", "--retime", "1"],
                     impls, commit="c2")
    out = capsys.readouterr().out
    res = {r["mix"]: r for r in S.rows_for_key(S.read_rows(tmp_path / "test-gpu-fwd.csv"), ENV, "c2")}
    assert set(res) == {"16+20", "9x2", "1x5"}
    assert res["1x5"]["fla_status"] == "not cached" and res["1x5"]["flash_qla_status"] == "not cached"
    assert res["16+20"]["peers_source"].startswith("cached")
    retimed = [m for m, r in res.items() if "re-timed" in r["peers_source"]]
    assert len(retimed) == 1
    assert "drift FlashQLA 1/2 " + retimed[0] in out and "drift FLA" in out
    assert len(S.read_rows(tmp_path / "peers-test-gpu-fwd.csv")) == 4   # cached mode appends nothing
    # the live re-timing is kept in the results CSV beside the cached timing, and the page lists it
    r = res[retimed[0]]
    assert r["flash_qla_status"] == "ok" and r["flash_qla_retime_status"] == "ok"
    cached, live = S.num(r["flash_qla_ms"]), S.num(r["flash_qla_retime_ms"])
    assert cached > 0 and live > 0 and cached != live                    # the host timer's times grow per call
    assert (f"drift FlashQLA 1/2 {retimed[0]}: cached {cached:.3f} ms, now {live:.3f} ms "
            f"({100 * (live / cached - 1):+.1f}%)") in out
    assert r["fla_status"] == "FAIL" and r["fla_retime_status"] == "FAIL" and r["fla_retime_ms"] == ""
    assert all(not o[f"{p}_retime_status"] for m, o in res.items() if m != retimed[0] for p in ("fla", "flash_qla"))
    md = (tmp_path / "test-gpu-fwd.md").read_text()
    drift = md[md.index("## Drift"):]
    assert (f"| 1/2 | {retimed[0]} | FlashQLA | {cached:.3f} | {live:.3f} | {100 * (live / cached - 1):+.1f}% | c2 |"
            in drift)
    assert f"| 1/2 | {retimed[0]} | FLA | FAIL | FAIL | - | c2 |" in drift
    assert R.PEERS_METHOD in md and "listed under Drift" not in md


def test_retime_columns_append_to_an_older_csv(tmp_path):
    """A results CSV written before the re-timed columns: a new row appends them as the last columns
    (the old columns keep their places), the old rows still load (empty re-timed cells), and the page
    names the old re-timed row without numbers and lists the new one with them."""
    import csv

    p = tmp_path / "test-gpu-fwd.csv"
    old_fields = [f for f in FWD.result_fields if "_retime_" not in f]
    assert list(FWD.result_fields[:len(old_fields)]) == old_fields               # the new columns come last
    old = {**_row(2, 8, "1x32768", 0.4, 0.9, 0.3), "peers_source": "cached (re-timed)"}
    S.append_row(p, old, old_fields)
    new = {**_row(16, 32, "8192x4", 0.5, 2.0, 0.5), "peers_source": "cached (re-timed)", "fla_retime_ms": "2.2",
           "fla_retime_status": "ok", "flash_qla_retime_ms": "0.5", "flash_qla_retime_status": "ok"}
    S.append_row(p, new, FWD.result_fields)
    with p.open(newline="") as f:
        assert next(csv.reader(f)) == list(FWD.result_fields)
    rows = {r["mix"]: r for r in S.read_rows(p)}
    assert rows["1x32768"]["fla_ms"] == "0.9" and rows["1x32768"]["fla_retime_ms"] == ""
    md = R.markdown("fwd", list(rows.values()), ENV, "c", {"method": []})
    drift = md[md.index("## Drift"):]
    assert "| 16/32 | 8192x4 | FLA | 2.000 | 2.200 | +10.0% | c |" in drift
    assert "| 16/32 | 8192x4 | FlashQLA | 0.500 | 0.500 | +0.0% | c |" in drift
    assert "Also re-timed, live times not recorded: " in drift and "2/8 1x32768 at c" in drift


def test_loop_unavailable_and_crashing(tmp_path):
    impls = {"ours": Impl("ours", "ours", reason="not available (ModuleNotFoundError: No module named 'x')"),
             "fla": Impl("fla", "FLA", fn=_broken), "flash_qla": Impl("flash_qla", "FlashQLA", fn=_good)}
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "65", "--peers", "auto"], impls)
    assert rc == 0 and len(calls) == 1
    r = S.read_rows(tmp_path / "test-gpu-fwd.csv")[0]
    assert r["ours_status"].startswith("not available")
    assert r["fla_status"].startswith("error: RuntimeError: kernel exploded")
    assert r["flash_qla_status"] == "ok"
    # auto mode: the cached error counts as missing, so FLA is tried again on the next run
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "65", "--peers", "auto", "--force"], impls)
    assert len(S.read_rows(tmp_path / "peers-test-gpu-fwd.csv")) == 3


def test_time_budget_stops_early(tmp_path, capsys):
    impls = {"ours": Impl("ours", "ours", fn=_good)}
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "64,65", "--peers", "none", "--time-budget", "0"], impls)
    assert rc == 0 and calls == []
    assert "time budget" in capsys.readouterr().out


# ---------------------------------------------------------------- command line


def test_cli_without_cuda_exits_nonzero():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", "--quick"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    assert "needs a CUDA GPU" in out.stderr


def test_cli_list_and_bad_filters():
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", "--list"], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0 and out.stdout.startswith("171 rows")
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", "--list", "--heads", "3/8"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2 and "3/8" in out.stderr


def test_cli_report_only(tmp_path):
    p = tmp_path / "test-gpu-fwd.csv"
    for r in (_row(16, 32, "8192x4", 0.5, 2.0, 0.5), _row(2, 8, "1x32768", 0.4, 0.9, 0.3)):
        S.append_row(p, r, FWD.result_fields)
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", "--report-only", "--no-plot",
                          "--results-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / "test-gpu-fwd.md").read_text()
    assert "| 16/32 | 8192x4 |" in md and "4.00x" in md
    # a rebuild keeps the method lines of the page it replaces
    (tmp_path / "test-gpu-fwd.md").write_text(md.replace("method of the measuring run unknown", "timer X"))
    subprocess.run([sys.executable, "-m", "flashqla.bench", "--report-only", "--no-plot", "--results-dir", str(tmp_path)],
                   capture_output=True, text=True, cwd=ROOT, check=True)
    assert "- Rebuilt from the CSV (--report-only); timer X." in (tmp_path / "test-gpu-fwd.md").read_text()


def test_impl_selection_and_missing_peers():
    from flashqla.bench.__main__ import parse_args, selected_impls

    assert selected_impls(parse_args([])) == ("ours", "fla", "flash_qla", "flashinfer")
    assert selected_impls(parse_args(["--bwd"])) == ("ours", "fla", "flash_qla")  # FlashInfer: no backward
    assert selected_impls(parse_args(["--peers", "none"])) == ("ours",)
    assert selected_impls(parse_args(["--impls", "flashinfer,flash_qla,fla"])) == ("fla", "flash_qla", "flashinfer")
    with pytest.raises(SystemExit):
        selected_impls(parse_args(["--impls", "cudnn"]))
    for name in ("fla", "flash_qla"):
        if __import__("importlib").util.find_spec(name) is None:
            for direction in ("fwd", "bwd"):
                impl = I.load_impls((name,), direction)[name]
                assert not impl.available and impl.reason.startswith("not available ("), (name, direction)


def test_importing_the_harness_needs_no_peer():
    code = ("import sys, flashqla.bench, flashqla.bench.__main__, flashqla.bench.report, flashqla.bench.runner, "
            "flashqla.bench.plots, flashqla.bench.impls, flashqla.bench.gate; "
            "print(any(m in sys.modules for m in ('fla', 'flash_qla', 'tilelang', 'triton', 'matplotlib', 'reference')))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, cwd=ROOT, check=True)
    assert out.stdout.strip() == "False"


def test_one_import_site_of_reference_and_no_import_circle():
    """`reference` is reached in one place of the harness (`gate.fp64_result`, through
    `flashqla.faces.face`), and no module of the harness imports one that imports it back (module level
    or inside a function)."""
    import ast
    import re

    bench = ROOT / "flashqla" / "bench"
    deps, sites = {}, []
    for path in sorted(bench.glob("*.py")):
        tree = ast.parse(path.read_text())
        names = set()
        for node in ast.walk(tree):
            mods = ([a.name for a in node.names] if isinstance(node, ast.Import)
                    else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            for m in mods:
                if m == "reference" or m.startswith("reference.") or m == "flashqla.faces":
                    sites.append((path.name, node.lineno))
                if m.startswith("flashqla.bench."):
                    names.add(m.split(".")[2])
                elif m == "flashqla.bench" and isinstance(node, ast.ImportFrom):
                    names |= {a.name for a in node.names}
        deps[path.stem] = names - {path.stem}
    assert len(sites) == 1 and sites[0][0] == "gate.py", sites
    assert not any(re.search(r"\bimport_module\(\s*['\"]reference", p.read_text()) for p in bench.glob("*.py"))
    assert sum(p.read_text().count('face("reference")') for p in bench.glob("*.py")) == 1

    def reaches(a, b, seen=()):
        return any(d == b or (d not in seen and reaches(d, b, seen + (d,))) for d in deps.get(a, ()))

    circles = sorted(m for m in deps if reaches(m, m))
    assert circles == [], {m: deps[m] for m in circles}


def test_cp_mode_reaches_ours_and_the_commit_column(monkeypatch):
    """--cp (default $FLASHQLA_CP, else auto, read when the command line is parsed) is passed to our
    op as `cp=` by the loaders, forward and backward alike, and names the commit column."""
    import flashqla.ops.gdn.api as api
    import flashqla.ops.gdn.bwd as bwd
    import flashqla.ops.gdn.fwd as fwd
    from flashqla.bench.__main__ import commit_with_cp, parse_args

    monkeypatch.delenv("FLASHQLA_CP", raising=False)
    assert parse_args([]).cp == "auto" and parse_args(["--cp", "off"]).cp == "off"
    monkeypatch.setenv("FLASHQLA_CP", "on")
    assert parse_args([]).cp == "on" and parse_args(["--cp", "auto"]).cp == "auto"
    assert commit_with_cp("abc123", "off") == "abc123" and commit_with_cp("abc123", "auto") == "abc123+cp-auto"
    assert commit_with_cp("abc123+cp-auto", "auto") == "abc123+cp-auto"  # never twice

    seen = []

    class Fwd:
        o, final_state, q, k, A, g_cum_log2, cp_saved = "o", "ht", None, None, None, None, None

    monkeypatch.setattr(api, "chunk_gated_delta_rule", lambda *a, **kw: seen.append(("op", kw["cp"])) or ("o", "ht"))
    monkeypatch.setattr(fwd, "chunk_gated_delta_rule_fwd", lambda *a, **kw: seen.append(("fwd", kw["cp"])) or Fwd())
    monkeypatch.setattr(bwd, "chunk_gated_delta_rule_bwd", lambda *a, **kw: seen.append(("bwd", kw["cp"])) or (0,) * 6)
    lengths = [20, 12]
    x = row_inputs(make_gdn_inputs(B=1, T=32, H=1, HV=2, K=16, V=8, seqlens=lengths), lengths, do=0, dht=0)
    I.load_impls(("ours",), "fwd", cp="off")["ours"].fn(x)
    assert os.environ["FLASHQLA_CP"] == "on"                             # the harness never writes it
    ours = I.load_impls(("ours",), "bwd", cp="auto")["ours"]
    assert "cp='auto'" in ours.source
    ours.step(x)
    assert seen == [("op", "off"), ("fwd", "auto"), ("bwd", "auto")]
    assert os.environ["FLASHQLA_CP"] == "on"


def _stub_impls():
    return {"ours": Impl("ours", "ours", fn=lambda x: x), "fla": Impl("fla", "FLA", fn=lambda x: x),
            "flash_qla": Impl("flash_qla", "FlashQLA")}


ROW = G.Row(G.parse_heads("16/32"), G.parse_mix("1x8192"))
OTHER = G.Row(G.parse_heads("16/32"), G.parse_mix("8192x4"))


def test_plan_sources_per_peers_mode():
    impls = _stub_impls()

    class Cache:
        def get(self, name, key):
            return 1.0 if (name, key) == ("fla", ROW.key) else None

    assert I.plan_sources(impls, ROW, "live", Cache()) == {"ours": "live", "fla": "live", "flash_qla": "n/a",
                                                           "flashinfer": "skip"}
    assert I.plan_sources(impls, ROW, "live", Cache(), names=I.impls_for("bwd")) == {
        "ours": "live", "fla": "live", "flash_qla": "n/a"}
    assert I.plan_sources(impls, ROW, "cached", Cache())["fla"] == "cached"
    assert I.plan_sources(impls, OTHER, "cached", Cache())["fla"] == "not cached"
    assert I.plan_sources(impls, OTHER, "auto", Cache())["fla"] == "live"
    assert I.plan_sources(impls, ROW, "auto", None)["fla"] == "live"
    assert I.plan_sources({"ours": impls["ours"]}, ROW, "none", None) == {"ours": "live", "fla": "skip", "flash_qla": "skip",
                                                                          "flashinfer": "skip"}


def test_unselected_peers_come_from_the_cache():
    # `--impls ours --peers cached`: ours is timed, a cached peer is still reported (not re-timed)
    ours = {"ours": Impl("ours", "ours", fn=lambda x: x)}

    class Cache:
        def get(self, name, key):
            return {"ms": "1.0"} if (name, key) == ("fla", ROW.key) else None

    assert I.plan_sources(ours, ROW, "cached", Cache()) == {"ours": "live", "fla": "cached", "flash_qla": "skip",
                                                            "flashinfer": "skip"}
    assert I.plan_sources(ours, ROW, "auto", Cache())["fla"] == "cached"
    assert I.plan_sources(ours, OTHER, "cached", Cache())["fla"] == "skip"
    assert I.plan_sources(ours, ROW, "cached", None)["fla"] == "skip"


def test_the_table_entry_says_what_a_peer_supports(monkeypatch, tmp_path):
    """A peer's entry decides what it runs: a row its `supports` refuses is "not supported" (an
    "n/a" cell, never timed), and a benchmark it has no call for leaves it "not available"."""
    entry = I.ENTRIES["flash_qla"]
    monkeypatch.setitem(I.ENTRIES, "flash_qla", dataclasses.replace(entry, supports=lambda row: row.mix.N > 1,
                                                                     train=None))
    impls = {"ours": Impl("ours", "ours", fn=_good), "flash_qla": Impl("flash_qla", "FlashQLA", fn=_good)}
    assert I.plan_sources(impls, ROW, "live", None)["flash_qla"] == "unsupported"
    assert I.plan_sources(impls, OTHER, "live", None)["flash_qla"] == "live"
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "40,20+20", "--peers", "live"], impls)
    res = {r["mix"]: r for r in S.read_rows(tmp_path / "test-gpu-fwd.csv")}
    assert res["40"]["flash_qla_status"] == "not supported" and res["20+20"]["flash_qla_status"] == "ok"
    assert len(calls) == 3 and R.cell_ms(res["40"], "flash_qla") == "n/a"
    bwd = I.load_impls(("flash_qla",), "bwd")["flash_qla"]
    assert not bwd.available and bwd.reason == "not available (no backward in the benchmark's table)"


def test_peer_cache_keys_each_peer_by_its_own_version(tmp_path):
    """A peer's cached line is keyed by the platform and its own version: another peer's version
    changing (or a peer added to the table) leaves it valid; its own version or the platform does not."""
    p = tmp_path / "peers.csv"
    rf = {"h_qk": 16, "h_v": 32, "mix": "1x8192", "T": 8192, "N": 1}
    S.PeerCache(p, ENV).put("fla", rf, {"ms": 0.5, "status": "ok"}, "d")
    assert S.PeerCache(p, dict(ENV, flash_qla="0.2.0")).get("fla", (16, 32, "1x8192")) is not None
    assert S.PeerCache(p, dict(ENV, fla="0.7.0")).get("fla", (16, 32, "1x8192")) is None
    assert S.PeerCache(p, dict(ENV, driver="2.0")).get("fla", (16, 32, "1x8192")) is None
    assert I.ENV_FIELDS == I.BASE_ENV_FIELDS + I.PEERS and I.PEERS == ("fla", "flash_qla", "flashinfer")
    assert I.impls_for("fwd") == I.IMPLS and I.impls_for("bwd") == ("ours", "fla", "flash_qla")


def test_peer_not_installed_reads_its_cached_lines_of_any_version(tmp_path):
    """A peer "absent" from the asking process (not installed there) takes its cached lines of any
    version on the same platform, the last line of a row winning, and names the versions used; a
    platform change still hides them."""
    p = tmp_path / "peers.csv"
    rf = {"h_qk": 16, "h_v": 32, "mix": "1x8192", "T": 8192, "N": 1}
    S.PeerCache(p, dict(ENV, flashinfer="0.7.1")).put("flashinfer", rf, {"ms": 0.30, "status": "ok"}, "d1")
    S.PeerCache(p, dict(ENV, flashinfer="0.7.2")).put("flashinfer", rf, {"ms": 0.25, "status": "ok"}, "d2")
    c = S.PeerCache(p, dict(ENV, flashinfer="absent"), any_version=True)
    assert S.num(c.get("flashinfer", (16, 32, "1x8192"))["ms"]) == pytest.approx(0.25)
    assert c.versions == {"flashinfer": {"0.7.2"}}
    assert S.PeerCache(p, dict(ENV, flashinfer="0.7.3"), any_version=True).get("flashinfer", (16, 32, "1x8192")) is None
    assert S.PeerCache(p, dict(ENV, flashinfer="absent", driver="2.0"),
                       any_version=True).get("flashinfer", (16, 32, "1x8192")) is None
    # the measuring run's plan never takes another version ("absent" may be an importable peer run live)
    assert S.PeerCache(p, dict(ENV, flashinfer="absent")).get("flashinfer", (16, 32, "1x8192")) is None
    # a newer version's crash does not hide an older result, and is not named
    S.PeerCache(p, dict(ENV, flashinfer="0.7.3")).put("flashinfer", rf, {"status": "error: OutOfMemoryError"}, "d3")
    c = S.PeerCache(p, dict(ENV, flashinfer="absent"), any_version=True)
    assert S.num(c.get("flashinfer", (16, 32, "1x8192"))["ms"]) == pytest.approx(0.25)
    assert c.versions == {"flashinfer": {"0.7.2"}}


def test_also_commits_match_on_the_platform(tmp_path):
    """`rows_for_commits`: the first commit's rows match the whole environment key; a later commit's
    rows fill the rows it lacks when the platform matches, whatever peers that run had installed."""
    a = _result_line(dict(ENV, flashinfer="absent"), "new", 16, 32, "1x8192", ours_ms=0.2)
    b = _result_line(dict(ENV, flashinfer="0.7.2"), "old", 16, 32, "1x1048576", ours_ms=5.0)
    c = _result_line(dict(ENV, flashinfer="0.7.2", driver="2.0"), "old", 16, 32, "1x131072", ours_ms=0.7)
    d = _result_line(dict(ENV, flashinfer="0.7.2"), "new", 16, 32, "1x2048", ours_ms=0.1)
    e = _result_line(dict(ENV, flashinfer="0.7.2", fla="0.4.0"), "old", 16, 32, "1x4096", ours_ms=0.1)
    rows = [{k: str(v) for k, v in r.items()} for r in (a, b, c, d, e)]
    got = S.rows_for_commits(rows, dict(ENV, flashinfer="absent"), ["new", "old"])
    # d: the first commit needs the whole key; e: an installed peer (FLA) of another version
    assert sorted(r["mix"] for r in got) == ["1x1048576", "1x8192"]
    assert sorted(r["mix"] for r in S.rows_for_commits(rows, dict(ENV, flashinfer="absent"), ["new", "new"])) == ["1x8192"]


def test_report_fills_empty_peer_columns_from_the_cache(tmp_path):
    env = {f: f"v-{f}" for f in ENV_FIELDS}
    cache = S.PeerCache(tmp_path / "peers.csv", env)
    row_fields = {"h_qk": 2, "h_v": 8, "mix": "1x32768", "T": 32768, "N": 1}
    cache.put("fla", row_fields, {"ms": 0.929, "status": "ok"}, "2026-01-01")
    base = {**env, "commit": "abc", **{k: str(v) for k, v in row_fields.items()}, "ours_ms": "0.876", "ours_status": "ok"}
    live = {**base, "fla_ms": "0.95", "fla_status": "ok", "peers_source": "live"}
    empty = dict(base)
    other = {**base, "mix": "1x8192", "T": "8192"}
    got = R.fill_cached_peers([live, empty, other], cache)
    assert got[0]["fla_ms"] == "0.95" and got[0]["peers_source"] == "live"  # a measured peer is kept
    assert float(got[1]["fla_ms"]) == 0.929 and got[1]["fla_status"] == "ok" and got[1]["peers_source"] == "cached"
    assert not got[2].get("fla_ms") and not got[2].get("peers_source")  # nothing cached for that row
    assert "fla_ms" not in empty  # the input rows are not modified


def test_cp_grid_rows_and_page(tmp_path):
    rows = G.cp_grid_rows()
    labels = [(r.heads.label, r.mix.label) for r in rows]
    assert len(rows) == 24 and len(set(labels)) == 24
    assert labels[:5] == [("2/8", f"1x{t}") for t in (2048, 4096, 8192, 16384, 32768)]
    assert ("2/8", "1x1048576") in labels and ("4/16", "1x131072") in labels and ("8/32", "1x131072") not in labels
    assert all(r.mix.N == 1 for r in rows)
    assert [r.mix.label for r in G.cp_grid_rows(["16/64"], ["1x4096,1x2048"])] == ["1x2048", "1x4096"]
    assert G.is_cp_grid_row(4, 16, "1x1048576") and not G.is_cp_grid_row(16, 32, "1x8192")
    # the forward report writes the CP page from the CP rows only, with its plot of time against T
    p = tmp_path / "test-gpu-fwd.csv"
    for r in (_row(2, 8, "1x2048", 0.1, 0.2, 0.05), _row(2, 8, "1x32768", 0.9, 0.9, 0.4), _row(16, 32, "8192x4", 0.5, 2.0, 0.5)):
        S.append_row(p, r, FWD.result_fields)
    paths = S.files(tmp_path, "test-gpu-fwd")
    assert paths["cp_md"].name == "test-gpu-cp.md"
    R.write_pages("fwd", paths, ENV, "c", {"date": "d", "method": ["m"]}, plot=plots.pyplot() is not None)
    md = paths["cp_md"].read_text()
    assert "one long sequence" in md and "| 2/8 | 1x2048 |" in md and "| 2/8 | 1x32768 |" in md
    assert "8192x4" not in md and "8192x4" in paths["md"].read_text()
    if plots.pyplot() is not None:
        assert paths["cp_png"].stat().st_size > 0


def test_cp_page_header_counts_its_own_rows(tmp_path):
    """With --also-commits each page's header counts the rows it shows: the CP page only its CP rows,
    not every row of the forward CSV."""
    p = tmp_path / "test-gpu-fwd.csv"
    for commit, rows in (("new", [_row(2, 8, "1x2048", 0.1, 0.2, 0.05), _row(16, 32, "8192x4", 0.5, 2.0, 0.5)]),
                         ("old", [_row(2, 8, "1x32768", 0.9, 0.9, 0.4), _row(2, 8, "1x4096", 0.2, 0.3, 0.1),
                                  _row(16, 32, "1024x8", 0.2, 0.5, 0.2), _row(16, 64, "8192x4", 0.5, 2.0, 0.5)])):
        for r in rows:
            S.append_row(p, {**r, "commit": commit}, FWD.result_fields)
    paths = S.files(tmp_path, "test-gpu-fwd")
    R.write_pages("fwd", paths, ENV, "new", {"date": "d", "method": ["m"]}, plot=False, also=["old"])
    assert "| our commit | new (2 rows); old (4 rows) |" in paths["md"].read_text()
    assert "| our commit | new (1 rows); old (2 rows) |" in paths["cp_md"].read_text()
    R.write_pages("fwd", paths, ENV, "new", {"date": "d", "method": ["m"]}, plot=False)
    assert "| our commit | new |" in paths["cp_md"].read_text()


def test_report_only_renders_drift_from_the_csv_and_updates_the_peers_method(tmp_path):
    """--report-only builds the Drift section from the CSV's re-timed columns (and the CP page's from
    its own rows), and replaces an earlier page's peers-column bullet (which claimed a Drift section
    the page did not have) by the current one; the other method bullets are kept."""
    p = tmp_path / "test-gpu-fwd.csv"
    retimed = {**_row(2, 8, "1x32768", 0.4, 0.9, 0.3), "peers_source": "cached (re-timed)", "fla_retime_ms": "0.99",
               "fla_retime_status": "ok"}
    for r in (_row(16, 32, "8192x4", 0.5, 2.0, 0.5), retimed):
        S.append_row(p, r, FWD.result_fields)
    old_peers = ("Peers column: `live` = timed in this process on the same inputs; `cached` = read from the peers "
                 "CSV of this environment key (re-timed rows are listed under Drift).")
    (tmp_path / "test-gpu-fwd.md").write_text(f"# old\n\n## Method\n\n- timer X.\n- {old_peers}\n\n## Rest\n")
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", "--report-only", "--no-plot",
                          "--results-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    for page in ("test-gpu-fwd.md", "test-gpu-cp.md"):
        md = (tmp_path / page).read_text()
        assert "- timer X." in md and f"- {R.PEERS_METHOD}" in md and old_peers not in md, page
        assert "| 2/8 | 1x32768 | FLA | 0.900 | 0.990 | +10.0% | c |" in md[md.index("## Drift"):], page


def test_flashinfer_entry_maps_fla_layout_both_ways(monkeypatch):
    """The FlashInfer entry hands FlashInfer its own contract (q/k/v without the batch axis, alpha =
    exp(g), fp32 beta, the state as [N, HV, V, K], a preallocated output_state, cu_seqlens and a host
    max_seqlen) and maps its outputs back to FLA's layout: a stand-in module that enforces that
    contract and computes with the reference in FlashInfer's layout gives the reference's o and final
    state to fp64 rounding; a wrong mapping (the state untransposed, g passed as its log) would not."""
    import types

    from reference import chunk_gated_delta_rule as ref_op

    calls = []

    def fake(q, k, v, g, beta, scale=None, initial_state=None, output_final_state=False, cu_seqlens=None,
             output_state=None, use_cp="auto", max_seqlen=None, **kw):
        assert q.dim() == 3 and k.dim() == 3 and v.dim() == 3 and not kw
        assert g.dtype == beta.dtype == torch.float32 and bool((g > 0).all() and (g <= 1).all())  # alpha
        assert output_final_state and output_state is not None and output_state.shape == initial_state.shape
        assert isinstance(max_seqlen, int) and use_cp == "auto"
        calls.append(max_seqlen)
        o, ht = ref_op(q[None].double(), k[None].double(), v[None].double(), g.double().log()[None],
                       beta.double()[None], scale=scale, initial_state=initial_state.transpose(-1, -2).double(),
                       output_final_state=True, cu_seqlens=cu_seqlens.long())
        output_state.copy_(ht.transpose(-1, -2))
        return o[0], output_state

    pkg, mod = types.ModuleType("flashinfer"), types.ModuleType("flashinfer.gdn_prefill")
    mod.chunk_gated_delta_rule = fake
    pkg.gdn_prefill = mod
    monkeypatch.setitem(sys.modules, "flashinfer", pkg)
    monkeypatch.setitem(sys.modules, "flashinfer.gdn_prefill", mod)
    impl = I.load_impls(("flashinfer",), "fwd")["flashinfer"]
    assert impl.available, impl.reason
    assert I.load_impls(("flashinfer",), "bwd")["flashinfer"].reason == \
        "not available (no backward in the benchmark's table)"

    lengths = (5, 0, 70, 1)
    T, H, HV = sum(lengths), 1, 2
    cu = torch.tensor([0, 5, 5, 75, 76], dtype=torch.int32)
    b = make_gdn_inputs(B=1, T=T, H=H, HV=HV, K=128, V=128, dtype=torch.float32, gate="qwen3next",
                        special_heads=True, initial_state=False, beta_dtype=torch.float32, seed=3)
    h0 = torch.randn(len(lengths), HV, 128, 128, dtype=torch.float32, generator=torch.Generator().manual_seed(1))
    x = RowInputs(b["q"], b["k"], b["v"], b["g"], b["beta"], h0, cu, lengths)
    o, ht = impl.fn(x)
    assert o.shape == (1, T, HV, 128) and ht.shape == (len(lengths), HV, 128, 128) and calls == [70]
    ro, rht = ref_op(x.q.double(), x.k.double(), x.v.double(), x.g.double(), x.beta.double(), scale=x.scale,
                     initial_state=h0.double(), output_final_state=True, cu_seqlens=cu.long())
    assert rel_rms(o, ro) < 1e-6 and rel_rms(ht, rht) < 1e-6
    assert rel_rms(ht.transpose(-1, -2), rht) > 0.5  # the layout matters: the check can fail
    x2 = RowInputs(b["q"], b["k"], b["v"], b["g"], b["beta"], h0.clone(), cu, lengths)  # a new row: fresh inputs
    x2.h0.zero_()
    _, ht2 = impl.fn(x2)
    assert rel_rms(ht2, rht) > 1e-3 and len(calls) == 2


def test_pages_fill_a_peer_that_was_not_importable_from_the_cache(tmp_path):
    """A peer asked for but not importable in the measuring run (status "not available (...)") shows
    its cached result on the pages, as a peer left out of --impls does; a peer's own error stays."""
    p = tmp_path / "peers.csv"
    rf = {"h_qk": 16, "h_v": 32, "mix": "1x8192", "T": 8192, "N": 1}
    S.PeerCache(p, dict(ENV, flashinfer="0.7.2")).put("flashinfer", rf, {"ms": 0.25, "status": "ok"}, "d")
    cache = S.PeerCache(p, dict(ENV, flashinfer="absent"), any_version=True)
    row = {k: str(v) for k, v in _result_line(dict(ENV, flashinfer="absent"), "c", 16, 32, "1x8192", ours_ms=0.3).items()}
    gone = dict(row, flashinfer_status="not available (ImportError: No module named 'flashinfer')")
    crashed = dict(row, flashinfer_status="error: RuntimeError")
    filled, kept = R.fill_cached_peers([gone, crashed], cache, ("flashinfer",))
    assert S.num(filled["flashinfer_ms"]) == pytest.approx(0.25) and filled["flashinfer_status"] == "ok"
    assert filled["peers_source"] == "cached"
    assert kept["flashinfer_status"] == "error: RuntimeError" and not kept.get("flashinfer_ms")


def test_page_title_names_only_peers_timed_on_the_page():
    """A page's title lists ours and the peers with a gated time on at least one of its rows: a peer
    never timed on that GPU (FlashInfer on the H200 pages) is not announced (its columns stay)."""
    from flashqla.bench.report import FWD_TITLE, page_title

    rows = [{"ours_status": "ok", "ours_ms": "1.0", "fla_status": "ok", "fla_ms": "2.0", "flash_qla_status": "failed",
             "flash_qla_ms": "1.5", "flashinfer_status": "", "flashinfer_ms": ""},
            {"ours_status": "ok", "ours_ms": "1.0", "flash_qla_status": "ok", "flash_qla_ms": "1.2"}]
    assert page_title(FWD_TITLE, "fwd", rows) == "GDN chunked prefill, forward: ours vs FLA vs FlashQLA"
    assert page_title(FWD_TITLE, "fwd", rows[:1]) == "GDN chunked prefill, forward: ours vs FLA"
    rows[1].update(flashinfer_status="ok", flashinfer_ms="0.9")
    assert page_title(FWD_TITLE, "fwd", rows).endswith("ours vs FLA vs FlashQLA vs FlashInfer")

"""CPU tests of the backward benchmark (`python -m flashqla.bench --bwd`): grid and row keys, the
gate's fp64 gradients (`reference/`'s hand-written backward) against autograd of the token
recurrence, the gate's decisions, the peers' cache keying, the report, the measuring loop with
stand-in implementations (resume, cached peers, drift, pairwise gate, failures) and the command
line. No GPU, no peer package."""

from __future__ import annotations

import importlib.util
import math
import subprocess
import sys
import types
from pathlib import Path

import pytest
import torch

from flashqla.bench import gate as GT
from flashqla.bench import grid as G
from flashqla.bench import impls as I
from flashqla.bench import plots
from flashqla.bench import report as R
from flashqla.bench import store as S
from flashqla.bench.gate import GRAD_NAMES, fp64_result, rel_rms
from flashqla.bench.impls import ENV_FIELDS, FwdOut, Impl, patch_flash_qla_bwd
from flashqla.bench.inputs import InputFactory, RowInputs
from flashqla.bench.report import PEERS_METHOD
from flashqla.bench.timing import Timing
from flashqla.testing import make_gdn_inputs

ROOT = Path(__file__).resolve().parents[1]
ENV = dict(gpu="Test GPU", driver="1.0", cuda="12.8", torch="2.x", triton="3.x", tilelang="0.1.15",
           fla="0.6.0", flash_qla="0.1.3", flashinfer="0.7.2.post1")
PREFIX = "test-gpu-bwd"
BWD = S.SCHEMAS["bwd"]


# ---------------------------------------------------------------- grid and row keys


def test_grid_is_flashqlas_backward_table():
    rows = G.bwd_rows()
    assert len(rows) == 32 and len({r.key for r in rows}) == 32
    assert [h.label for h in G.BWD_HEADS] == ["16/32", "8/16", "4/8", "2/4"]
    names = [G.short_name(m.lengths) for m in G.bwd_mixes()]
    assert names == ["8k_1seq", "8k_2seq", "8k_4seq", "8k_8seq", "32k_1seq", "32k_2seq", "32k_4seq", "32k_8seq"]
    for m in G.bwd_mixes():
        assert m.T in (8192, 32768) and m.N in (1, 2, 4, 8) and min(m.lengths) > 0
        # the key carries the lengths: the label parses back to them
        assert G.parse_mix(m.label).lengths == m.lengths
    assert rows[0].key == (16, 32, "1x8192")
    assert rows[3].key == (16, 32, "161+1928+3157+563+1244+229+177+733")


@pytest.mark.parametrize("T, n", sorted(G.BWD_SPLITS))
def test_random_split_reproduces_the_pinned_lengths(T, n):
    got = G.random_split(T, n, G.BWD_SEED)
    assert got == G.BWD_SPLITS[(T, n)]
    assert sum(got) == T and len(got) == n and min(got) > 0


def test_random_split_is_seeded_and_checked():
    assert G.random_split(1000, 5, 1) == G.random_split(1000, 5, 1)
    assert G.random_split(1000, 5, 1) != G.random_split(1000, 5, 2)
    assert G.random_split(3, 3) == (1, 1, 1)
    for bad in ((10, 0), (3, 4)):
        with pytest.raises(ValueError):
            G.random_split(*bad)
    assert G.bwd_mix(8192, 4, seed=7).lengths == G.random_split(8192, 4, 7)


def test_parse_bwd_mix_and_select():
    assert G.parse_bwd_mix("8k_4seq").lengths == (5809, 1244, 406, 733)
    assert G.parse_bwd_mix("32k_1seq").label == "1x32768"
    assert G.parse_bwd_mix("5000+3192").label == "5000+3192"
    assert G.parse_bwd_mix("8192x2").label == "8192+8192"
    for bad in ("8k_0seq", "x", "0k_1seq"):
        with pytest.raises(ValueError):
            G.parse_bwd_mix(bad)
    quick = G.select_bwd_rows(quick=True)
    assert [(r.heads.label, G.short_name(r.mix.lengths)) for r in quick] == [
        ("16/32", "32k_1seq"), ("16/32", "8k_8seq"), ("2/4", "32k_1seq")]
    assert len({r.heads for r in quick}) == 2
    assert len(G.select_bwd_rows(["2/4"])) == 8
    rows = G.select_bwd_rows(["2/4,16/32"], ["32k_1seq", "8k_2seq"])
    assert [(r.heads.label, r.mix.label) for r in rows] == [
        ("16/32", "7053+1139"), ("16/32", "1x32768"), ("2/4", "7053+1139"), ("2/4", "1x32768")]
    extra = G.select_bwd_rows(["1/2"], ["64+100"])
    assert [r.label for r in extra] == ["1/2 64+100"]


def test_flop_counts():
    assert G.FLOP_PER_TOKEN_HEAD["bwd"] == 491_520 and G.FLOP_PER_TOKEN_HEAD["step"] == 655_360
    # 16/32 1x32768 backward in 2.515 ms (FlashQLA's published row): 205 TFLOP/s, 28.2 % of 726
    tf = G.tflops(2.515, 32768, 32, "bwd")
    assert tf == pytest.approx(491_520 * 32768 * 32 / 2.515e-3 / 1e12)
    assert 204 < tf < 206
    assert G.tflops(1.0, 1000, 2, "step") == pytest.approx(655_360 * 2000 / 1e-3 / 1e12)
    assert G.padded_tokens((8192,)) == 8192 and G.padded_tokens((100, 1)) == 128 + 64
    assert G.mix_name(8192, 4) == "8k_4seq" and G.mix_name(1000, 2) == "1000_2seq"


# ---------------------------------------------------------------- fp64 gradients


def _recurrence_grads(x, do, dht):
    from reference.gdn.recurrent import recurrent_gated_delta_rule

    names = ("q", "k", "v", "g", "beta", "initial_state")
    leaves = {n: x[n].clone().requires_grad_() for n in names if x[n] is not None}
    o, ht = recurrent_gated_delta_rule(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"],
                                       initial_state=leaves.get("initial_state"), output_final_state=True,
                                       cu_seqlens=x["cu_seqlens"])
    outs, gouts = [o], [do]
    if dht is not None:
        outs.append(ht)
        gouts.append(dht)
    torch.autograd.backward(outs, gouts)
    grads = {f"d{n}": leaves[n].grad for n in ("q", "k", "v", "g", "beta")}
    grads["dh0"] = leaves["initial_state"].grad if "initial_state" in leaves else None
    return o.detach(), ht.detach(), grads


def _rows_inputs(x, lengths, do, dht):
    return RowInputs(x["q"], x["k"], x["v"], x["g"], x["beta"], x["initial_state"], x["cu_seqlens"], tuple(lengths),
                     do=do, dht=dht, scale=x["q"].shape[-1] ** -0.5)


@pytest.mark.parametrize("lengths, H, HV, h0, with_dht, batch", [
    ([37, 1, 90, 22], 2, 4, True, True, None),      # varlen with a 1-token sequence, GVA 2, one batch of heads
    ([37, 1, 90, 22], 2, 4, True, True, 1),         # one value head per batch
    ([70, 50], 1, 4, False, True, 400),             # GVA 4, two heads per batch (192 chunk-padded tokens), no h0
    ([65], 2, 2, True, False, 1),                    # no dht
])
def test_fp64_grads_match_autograd_of_the_recurrence(lengths, H, HV, h0, with_dht, batch):
    """The gate's gradients (the reference's hand-written chunked backward in fp64, in batches of value
    heads) equal autograd through the fp64 token recurrence."""
    T = sum(lengths)
    x = make_gdn_inputs(B=1, T=T, H=H, HV=HV, K=16, V=8, seqlens=lengths, initial_state=h0, seed=len(lengths))
    gen = torch.Generator().manual_seed(5)
    do = torch.randn(1, T, HV, 8, generator=gen, dtype=torch.float64)
    dht = torch.randn(len(lengths), HV, 16, 8, generator=gen, dtype=torch.float64) if with_dht else None
    o, ht, ref = _recurrence_grads(x, do, dht)
    got = fp64_result(_rows_inputs(x, lengths, do, dht), grads=True, max_token_heads=batch)
    assert set(got) == {"o", "ht", *GRAD_NAMES}
    assert rel_rms(got["o"], o) < 1e-12 and rel_rms(got["ht"], ht) < 1e-12
    for n in GRAD_NAMES:
        if ref[n] is None:
            assert got[n] is None
            continue
        assert got[n].dtype == torch.float64 and got[n].shape == ref[n].shape, n
        assert rel_rms(got[n], ref[n]) < 1e-12, n


def test_fp64_grads_from_bf16_inputs():
    # the gate's situation: rounded inputs, fp64 arithmetic; equal to the recurrence on the same rounded values
    x = make_gdn_inputs(T=80, H=1, HV=2, K=32, V=16, seqlens=[30, 50], dtype=torch.bfloat16, beta_dtype=torch.float32)
    gen = torch.Generator().manual_seed(2)
    do = torch.randn(1, 80, 2, 16, generator=gen).to(torch.bfloat16)
    dht = torch.randn(2, 2, 32, 16, generator=gen)
    up = {k: (v.double() if isinstance(v, torch.Tensor) and v.is_floating_point() else v) for k, v in x.items()}
    o, ht, ref = _recurrence_grads(up, do.double(), dht.double())
    got = fp64_result(_rows_inputs(x, [30, 50], do, dht), grads=True)
    for n in GRAD_NAMES:
        assert rel_rms(got[n], ref[n]) < 1e-12, n


# ---------------------------------------------------------------- gate


def test_decide_against_fp64():
    tol = GT.GATE_TOL["bwd"]
    ok = {"o": 4e-3, "dq": 5e-3, "dg": 2.5e-2}
    bad = {"o": 4e-3, "dg": 3.5e-2}
    st = GT.decide(["ours", "fla"], {"ours": ok, "fla": bad}, {}, tol)
    assert st == {"ours": "ok", "fla": "FAIL"}
    assert GT.decide(["ours"], {"ours": {}}, {}, tol) == {"ours": "FAIL"}           # nothing compared
    assert GT.decide(["ours"], {"ours": {"dv": math.inf}}, {}, tol) == {"ours": "FAIL"}


def test_decide_pairwise():
    tol = GT.GATE_TOL["bwd"]
    good, far = {"dq": 6e-3, "dg": 1e-2}, {"dq": 0.4}
    # FLA disagrees with both others, which agree with each other: FLA fails
    pairs = {("ours", "fla"): far, ("ours", "flash_qla"): good, ("fla", "flash_qla"): far}
    st = GT.decide(["ours", "fla", "flash_qla"], None, pairs, tol)
    assert st == {"ours": "ok", "fla": "FAIL", "flash_qla": "ok"}
    # two that disagree: neither can be trusted
    assert GT.decide(["ours", "fla"], None, {("ours", "fla"): far}, tol) == {"ours": "FAIL", "fla": "FAIL"}
    assert GT.decide(["ours"], None, {}, tol) == {"ours": "unchecked"}


def test_errs_text_and_worst():
    errs = {"dg": 2.5e-2, "o": 3.9e-3, "dq": 1e-2}
    text = GT.format_errs(errs)
    assert text == "o=3.9e-03 dq=1.0e-02 dg=2.5e-02"                  # report order
    assert GT.parse_errs(text) == pytest.approx(errs, rel=1e-2)
    assert GT.parse_errs("junk dq=x o=1e-3") == {"o": 1e-3}
    assert GT.worst(errs, GT.GATE_TOL["bwd"])[0] == "dg"              # 2.5e-2 / 3e-2 is the nearest
    assert GT.worst({}, GT.GATE_TOL["bwd"])[0] == ""


def test_errors_and_pairwise_on_tensors():
    a = {"o": torch.ones(4), "dq": torch.ones(3), "dh0": None}
    b = {"o": torch.ones(4) * 1.01, "dq": torch.ones(3)}
    e = GT.errors(a, b)
    assert set(e) == {"o", "dq"} and e["o"] == pytest.approx(1 / 101, rel=1e-6) and e["dq"] == 0
    pairs = GT.pairwise({"ours": a, "fla": b, "flash_qla": b})
    assert set(pairs) == {("ours", "fla"), ("ours", "flash_qla"), ("fla", "flash_qla")}
    with pytest.raises(ValueError):
        GT.errors({"o": torch.ones(3)}, {"o": torch.ones(4)})


# ---------------------------------------------------------------- peers' cache and adapters


def test_bwd_peer_cache_keying(tmp_path):
    p = tmp_path / "peers.csv"
    c = S.PeerCache(p, ENV, BWD.impl_fields)
    rf = {"h_qk": 16, "h_v": 32, "mix": "7053+1139", "T": 8192, "N": 2}
    c.put("flash_qla", rf, {"bwd_ms": 0.75, "step_ms": 1.1, "status": "ok", "err": 4e-3, "errs": "dq=4.0e-03"}, "d1")
    c.put("fla", rf, {"status": "error: OutOfMemoryError: x"}, "d1")
    header = p.read_text().splitlines()[0].split(",")
    assert header == list(ENV_FIELDS) + ["impl", "h_qk", "h_v", "mix", "T", "N"] + list(BWD.impl_fields) + ["date"]
    c2 = S.PeerCache(p, ENV, BWD.impl_fields)
    line = c2.get("flash_qla", (16, 32, "7053+1139"))
    assert S.num(line["bwd_ms"]) == 0.75 and line["errs"] == "dq=4.0e-03"
    assert c2.get("fla", (16, 32, "7053+1139")) is None                      # an error is not a result
    assert c2.get("flash_qla", (16, 32, "1x8192")) is None                   # the lengths are the key
    for field in I.BASE_ENV_FIELDS:                                          # keyed by GPU and the platform
        assert len(S.PeerCache(p, dict(ENV, **{field: "other"}), BWD.impl_fields)) == 0
    other = S.PeerCache(p, dict(ENV, fla="other"), BWD.impl_fields)         # and by the peer's own version
    assert other.get("fla", (16, 32, "7053+1139"), include_errors=True) is None
    assert other.get("flash_qla", (16, 32, "7053+1139")) is not None
    # the forward's cache is unchanged
    assert S.PeerCache(tmp_path / "fwd.csv", ENV).fields == S.SCHEMAS["fwd"].peer_fields


def test_patch_flash_qla_bwd_adds_the_pass_config(monkeypatch):
    class FakeJit:
        def __init__(self, configs):
            self.pass_configs = configs

        def compile(self):
            return None

    mod = types.ModuleType("fake_fused_bwd")
    mod.kernel = FakeJit({"tl.enable_fast_math": True})
    mod.bare = FakeJit(None)
    mod.other = object()
    mod.torch = torch
    monkeypatch.setitem(sys.modules, "fake_fused_bwd", mod)
    patched = patch_flash_qla_bwd(("fake_fused_bwd", "no_such_module_xyz"))
    assert sorted(patched) == ["fake_fused_bwd.bare", "fake_fused_bwd.kernel"]
    assert mod.kernel.pass_configs == {"tl.enable_fast_math": True, "tl.disable_buffer_init_check": True}
    assert mod.bare.pass_configs == {"tl.disable_buffer_init_check": True}


def test_missing_peers_are_not_available():
    for name in ("fla", "flash_qla"):
        if importlib.util.find_spec(name) is None:
            impl = I.load_impls((name,), "bwd")[name]
            assert not impl.available and impl.reason.startswith("not available (")
    ours = I.load_impls(("ours",), "bwd")["ours"]
    assert ours.available and ours.fn is None and "chunk_gated_delta_rule_fwd" in ours.source
    assert "flashqla.ops.gdn.bwd.chunk_gated_delta_rule_bwd" in ours.source


# ---------------------------------------------------------------- report


def _line(h_qk, h_v, name, ours, fla, fq, commit="c", fla_status="ok", date="2026-12-01T00:00:00Z"):
    m = G.parse_bwd_mix(name)
    line = {**ENV, "commit": commit, "h_qk": h_qk, "h_v": h_v, "mix": m.label, "T": m.T, "N": m.N,
            "name": G.short_name(m.lengths), "parallelism": G.effective_parallelism(m.lengths, h_v), "gate": "fp64",
            "peers_source": "live", "date": date}
    for impl, (bwd, step), st in (("ours", ours, "ok"), ("fla", fla, fla_status), ("flash_qla", fq, "ok")):
        line.update({f"{impl}_status": st, f"{impl}_bwd_ms": bwd if st == "ok" else "",
                     f"{impl}_step_ms": step if st == "ok" else "",
                     f"{impl}_err": 5e-2 if st == "FAIL" else 4e-3,
                     f"{impl}_errs": "o=4.0e-03 dg=5.0e-02" if st == "FAIL" else "o=4.0e-03 dq=3.0e-03"})
    line["pair_ours_fla"] = 6e-3
    return {k: S.fmt(v) for k, v in line.items()}


def test_markdown_report():
    rows = [_line(16, 32, "32k_1seq", (2.0, 2.8), (6.0, 9.0), (3.0, 4.0)),
            _line(2, 4, "8k_4seq", (0.5, 0.7), (1.0, 1.4), (0.5, 0.6)),
            _line(16, 32, "8k_8seq", (0.6, 0.9), (1.6, 2.5), (0.75, 1.0), fla_status="FAIL")]
    # FLA cached on the first row and re-timed: 6.0 / 9.0 ms cached, 6.3 / 9.9 ms live
    rows[0].update({"peers_source": "cached (re-timed)", "fla_retime_bwd_ms": "6.3", "fla_retime_step_ms": "9.9",
                    "fla_retime_status": "ok"})
    meta = {"date": "2026-12-01T00:00:00Z", "method": ["timer line"]}
    md = R.markdown("bwd", rows, ENV, "abc123", meta)
    for needle in ("| GPU | Test GPU |", "| driver | 1.0 |", "| CUDA (torch build) | 12.8 |", "| torch | 2.x |",
                   "| tilelang | 0.1.15 |", "| fla | 0.6.0 |", "| flash_qla | 0.1.3 |", "| our commit | abc123 |",
                   "2026-12-01", "- timer line", "## Backward, per row",
                   "## Training step (forward + backward), per row",
                   "## Correctness gate", "FAIL (dg 5.0e-02)", "+5.0%", "| ours ~ FLA |"):
        assert needle in md, needle
    bwd = md[md.index("## Backward, per row"):md.index("## Training step")]
    # grid order: 16/32 8k_8seq before 16/32 32k_1seq before 2/4
    assert bwd.index("| 16/32 | 8k_8seq |") < bwd.index("| 16/32 | 32k_1seq |") < bwd.index("| 2/4 | 8k_4seq |")
    row = [ln for ln in bwd.splitlines() if ln.startswith("| 16/32 | 32k_1seq |")][0]
    # 491,520 x 32768 x 32 FLOP in 2.0 ms = 257.7 TFLOP/s = 35.5 % of 726; ours 3.00x FLA, 1.50x FlashQLA
    assert "| 32768 |" in row and "| 3.00x | 1.50x |" in row and "| 258 |" in row
    step = md[md.index("## Training step"):md.index("## Correctness gate")]
    row = [ln for ln in step.splitlines() if ln.startswith("| 16/32 | 32k_1seq |")][0]
    assert "| 2.800 |" in row and "| 3.21x | 1.43x |" in row
    gm = md[md.index("## Geometric-mean"):md.index("## Backward, per row")]
    # ours over FLA, backward, on the two passing rows: sqrt(3 * 2) = 2.449
    assert "| backward: ours over FLA | 2.45x (n=2) |" in gm
    assert "| training step: ours over FlashQLA |" in gm
    gate = md[md.index("## Correctness gate"):md.index("## Drift")]
    assert "dg 5.0e-02 FAIL" in gate and "6.0e-03" in gate
    drift = md[md.index("## Drift"):]
    assert ("| heads | mix | impl | cached bwd ms | re-timed bwd ms | bwd difference | cached step ms | "
            "re-timed step ms | step difference | our commit |") in drift
    assert "| 16/32 | 32k_1seq | FLA | 6.000 | 6.300 | +5.0% | 9.000 | 9.900 | +10.0% | c |" in drift
    assert "FlashQLA" not in drift and "not recorded" not in drift
    # rows written before the re-timed columns: named, no number
    legacy = _line(2, 4, "8k_1seq", (0.5, 0.7), (1.0, 1.4), (0.5, 0.6))
    legacy["peers_source"] = "cached (re-timed)"
    drift = R.markdown("bwd", [legacy], ENV, "abc123", meta).split("## Drift")[1]
    assert "No re-timed rows recorded: " in drift and "2/4 8k_1seq at c" in drift and "|" not in drift
    assert "No re-timed rows recorded." in R.markdown("bwd", rows[1:], ENV, "abc123", meta)


def test_console_line_and_plot(tmp_path):
    r = _line(16, 32, "32k_1seq", (2.0, 2.8), (6.0, 9.0), (3.0, 4.0))
    text = R.console_line("bwd", r)
    assert text.startswith("16/32 32k_1seq ") and "ours 2.000/2.800 ms" in text and "vs FLA 3.00x/3.21x" in text
    pytest.importorskip("matplotlib")
    out = plots.plot_bwd([r, _line(2, 4, "8k_4seq", (0.5, 0.7), (1.0, 1.4), (0.5, 0.6))], tmp_path / "p.png")
    assert out is not None and out.stat().st_size > 1000


# ---------------------------------------------------------------- the measuring loop, on CPU


def _reference(x):
    return fp64_result(x, grads=True)


def _stand_in(name, scale_dg=1.0, broken=False, calls=None):
    """An implementation built on the fp64 result, rounded like a kernel's outputs."""

    def fwd(x):
        if broken:
            raise RuntimeError("kernel exploded")
        ref = _reference(x)
        if calls is not None:
            calls.append((name, "fwd"))
        return FwdOut(ref["o"].to(torch.bfloat16), ref["ht"].float(), ref)

    def bwd(x, ref):
        return (ref["dq"].to(torch.bfloat16), ref["dk"].to(torch.bfloat16), ref["dv"].to(torch.bfloat16),
                ref["dg"].float() * scale_dg, ref["dbeta"].float(), ref["dh0"].float())

    return Impl(name, name, fwd=fwd, bwd=bwd, source=f"stand-in {name}")


def _host_timer(counter):
    def time_fn(fn, **kw):
        fn()
        counter.append(1)
        return Timing(ms=1.0 + 0.25 * len(counter), replays_ms=[1.0], launches=3)
    return time_fn


def _run(tmp_path, argv, impls, commit="c1"):
    from flashqla.bench.__main__ import parse_args
    from flashqla.bench.runner import run_rows

    opts = parse_args(["--bwd"] + argv + ["--results-dir", str(tmp_path), "--no-plot"])
    calls = []
    rows = G.rows_for("bwd", opts.heads, opts.mixes, opts.quick)
    rc = run_rows(rows, opts, impls, ENV, commit, device="cpu", time_fn=_host_timer(calls))
    return rc, calls


def _rows(tmp_path, commit="c1"):
    return {r["mix"]: r for r in S.rows_for_key(S.read_rows(tmp_path / f"{PREFIX}.csv"), ENV, commit)}


def test_loop_gate_resume_cache_and_drift(tmp_path, capsys):
    impls = {"ours": _stand_in("ours"), "fla": _stand_in("fla", scale_dg=1.5), "flash_qla": _stand_in("flash_qla")}
    argv = ["--heads", "1/2", "--mixes", "40+30,1x65", "--peers", "live"]
    rc, calls = _run(tmp_path, argv, impls)
    assert rc == 0 and len(calls) == 8            # ours and FlashQLA: backward + step on 2 rows; FLA failed its gate
    res = _rows(tmp_path)
    assert set(res) == {"40+30", "1x65"}
    for r in res.values():
        assert r["gate"] == "fp64" and r["name"] in ("70_2seq", "65_1seq")
        for i in ("ours", "flash_qla"):
            assert r[f"{i}_status"] == "ok" and S.num(r[f"{i}_bwd_ms"]) > 0 and S.num(r[f"{i}_step_ms"]) > 0
            assert S.num(r[f"{i}_err"]) < 1e-2 and "dg=" in r[f"{i}_errs"]
        assert r["fla_status"] == "FAIL" and r["fla_bwd_ms"] == "" and GT.parse_errs(r["fla_errs"])["dg"] > 0.4
        assert S.num(r["pair_ours_flash_qla"]) < 1e-2 and S.num(r["pair_ours_fla"]) > 0.3
    peers = S.read_rows(tmp_path / f"peers-{PREFIX}.csv")
    assert len(peers) == 4 and {p["impl"] for p in peers} == {"fla", "flash_qla"}
    md = (tmp_path / f"{PREFIX}.md").read_text()
    assert "| 1/2 | 70_2seq | 40+30 |" in md and "FAIL (dg" in md

    # rerun, same key: everything skipped
    rc, calls = _run(tmp_path, argv, impls)
    assert rc == 0 and calls == []
    assert "resuming: 2 of 2 rows" in capsys.readouterr().out

    # new commit: cached peers, one row re-timed (drift), an extra row without cache ('not cached')
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "40+30,1x65,1x20", "--peers", "cached", "--retime", "1"],
                     impls, commit="c2")
    out = capsys.readouterr().out
    res = _rows(tmp_path, "c2")
    assert set(res) == {"40+30", "1x65", "1x20"}
    assert res["1x20"]["fla_status"] == "not cached" and res["1x20"]["flash_qla_status"] == "not cached"
    assert res["1x20"]["ours_status"] == "ok"
    retimed = [m for m, r in res.items() if "re-timed" in r["peers_source"]]
    assert len(retimed) == 1 and "drift FlashQLA 1/2 " in out and "drift FLA" in out
    assert res["40+30"]["flash_qla_status"] == "ok" and res["40+30"]["peers_source"].startswith("cached")
    assert len(S.read_rows(tmp_path / f"peers-{PREFIX}.csv")) == 4      # cached mode appends nothing
    # the live re-timing is kept in the results CSV beside the cached timing, and the page lists it
    r = res[retimed[0]]
    assert r["flash_qla_retime_status"] == "ok" and r["fla_retime_status"] == "FAIL" and r["fla_retime_bwd_ms"] == ""
    cached = [S.num(r[f"flash_qla_{k}_ms"]) for k in ("bwd", "step")]
    live = [S.num(r[f"flash_qla_retime_{k}_ms"]) for k in ("bwd", "step")]
    assert min(cached + live) > 0 and cached != live
    assert (f"drift FlashQLA 1/2 {S.row_name(r)}: cached {cached[0]:.3f} ms, now {live[0]:.3f} ms "
            f"({100 * (live[0] / cached[0] - 1):+.1f}%)") in out              # the backward's time compared
    assert all(not o[f"{p}_retime_status"] for m, o in res.items() if m != retimed[0] for p in ("fla", "flash_qla"))
    md = (tmp_path / f"{PREFIX}.md").read_text()
    cells = " | ".join(f"{c:.3f} | {v:.3f} | {100 * (v / c - 1):+.1f}%" for c, v in zip(cached, live))
    assert f"| 1/2 | {S.row_name(r)} | FlashQLA | {cells} | c2 |" in md[md.index("## Drift"):]
    assert "listed under Drift" not in md


def test_retime_columns_append_to_an_older_bwd_csv(tmp_path):
    """A backward CSV written before the re-timed columns still loads after a row with them is
    appended (they become its last columns), and the page names its re-timed row without numbers."""
    p = tmp_path / f"{PREFIX}.csv"
    old_fields = [f for f in BWD.result_fields if "_retime_" not in f]
    assert list(BWD.result_fields[:len(old_fields)]) == old_fields
    old = _line(2, 4, "8k_1seq", (0.5, 0.7), (1.0, 1.4), (0.5, 0.6))
    old["peers_source"] = "cached (re-timed)"
    S.append_row(p, old, old_fields)
    new = _line(2, 4, "8k_2seq", (0.5, 0.7), (1.0, 1.4), (0.5, 0.6))
    new.update({"peers_source": "cached (re-timed)", "fla_retime_bwd_ms": "1.1", "fla_retime_step_ms": "1.4",
                "fla_retime_status": "ok"})
    S.append_row(p, new, BWD.result_fields)
    rows = S.read_rows(p)
    assert [r["name"] for r in rows] == ["8k_1seq", "8k_2seq"] and rows[0]["fla_retime_bwd_ms"] == ""
    drift = R.markdown("bwd", rows, ENV, "c", {"method": []}).split("## Drift")[1]
    assert "| 2/4 | 8k_2seq | FLA | 1.000 | 1.100 | +10.0% | 1.400 | 1.400 | +0.0% | c |" in drift
    assert "Also re-timed, live times not recorded: " in drift and "2/4 8k_1seq at c" in drift


def test_loop_pairwise_gate_and_failures(tmp_path):
    impls = {"ours": _stand_in("ours"), "fla": _stand_in("fla", broken=True), "flash_qla": _stand_in("flash_qla")}
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "33", "--peers", "live", "--ref", "pairwise", "--no-step"],
                     impls)
    assert rc == 0 and len(calls) == 2                                   # backward only, ours and FlashQLA
    r = _rows(tmp_path)["1x33"]
    assert r["gate"] == "pairwise"
    assert r["ours_status"] == "ok" and r["flash_qla_status"] == "ok" and r["ours_step_ms"] == ""
    assert r["fla_status"].startswith("error: RuntimeError: kernel exploded")
    assert S.num(r["ours_err"]) < 1e-2 and r["pair_fla_flash_qla"] == ""
    # alone under the pairwise gate: unchecked, not timed
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "34", "--peers", "none", "--ref", "pairwise"],
                     {"ours": _stand_in("ours")})
    assert calls == [] and _rows(tmp_path)["1x34"]["ours_status"] == "unchecked"
    # --ref-limit: a row above it uses the pairwise gate
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "35", "--peers", "none", "--ref-limit", "10"],
                     {"ours": _stand_in("ours"), "fla": _stand_in("fla")})
    assert _rows(tmp_path)["1x35"]["gate"] == "pairwise" and _rows(tmp_path)["1x35"]["ours_status"] == "unchecked"


def test_loop_peers_only_then_ours(tmp_path):
    # fill the peers' cache alone, then time ours against it: the peers-only rows do not count as done
    peers = {"fla": _stand_in("fla"), "flash_qla": _stand_in("flash_qla")}
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "20+20", "--peers", "live", "--impls", "fla,flash_qla"],
                     peers)
    assert len(calls) == 4 and _rows(tmp_path)["20+20"]["ours_status"] == ""
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "20+20", "--peers", "cached", "--retime", "0"],
                     {"ours": _stand_in("ours"), **peers})
    r = _rows(tmp_path)["20+20"]
    assert len(calls) == 2 and r["ours_status"] == "ok" and r["fla_status"] == "ok" and r["peers_source"] == "cached"
    assert R.speedup(r, "ours", "fla", "bwd_ms") > 0


def test_time_budget_defers_peers_to_the_next_run(tmp_path, capsys):
    import time as _time

    slow = _stand_in("ours")
    fwd = slow.fwd
    slow.fwd = lambda x: (_time.sleep(0.6), fwd(x))[1]
    impls = {"ours": slow, "fla": _stand_in("fla"), "flash_qla": _stand_in("flash_qla")}
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "20,21", "--time-budget", "0.3"], impls)
    out = capsys.readouterr().out
    r = _rows(tmp_path)["1x20"]
    assert r["ours_status"] == "ok" and r["fla_status"] == "deferred" and r["flash_qla_status"] == "deferred"
    assert "1x21" not in _rows(tmp_path) and "FLA deferred" in out and len(calls) == 2
    # the next run measures the deferred peers on that row and the row left over
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "20,21"], impls)
    res = _rows(tmp_path)
    assert all(res[m][f"{i}_status"] == "ok" for m in ("1x20", "1x21") for i in ("ours", "fla", "flash_qla"))
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "20,21"], impls)
    assert calls == []


def test_a_retime_left_to_the_time_budget_is_not_marked(tmp_path, capsys):
    """A row picked for re-timing whose cached peers are not run (the time budget spent by ours) is
    not marked re-timed: the peers column and the Drift section claim only what was timed."""
    import time as _time

    peers = {"fla": _stand_in("fla"), "flash_qla": _stand_in("flash_qla")}
    _run(tmp_path, ["--heads", "1/2", "--mixes", "20", "--peers", "live", "--impls", "fla,flash_qla"], peers)
    slow = _stand_in("ours")
    fwd = slow.fwd
    slow.fwd = lambda x: (_time.sleep(0.6), fwd(x))[1]
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "20", "--peers", "cached", "--retime", "1",
                                "--time-budget", "0.3"], {"ours": slow, **peers}, commit="c2")
    r = _rows(tmp_path, "c2")["1x20"]
    assert r["ours_status"] == "ok" and r["fla_status"] == "ok" and len(calls) == 2   # ours only: bwd + step
    assert r["peers_source"] == "cached" and not r["fla_retime_status"] and not r["flash_qla_retime_status"]
    assert "No re-timed rows recorded." in (tmp_path / f"{PREFIX}.md").read_text()


def test_time_budget_stops_early(tmp_path, capsys):
    rc, calls = _run(tmp_path, ["--heads", "1/2", "--mixes", "20,21", "--peers", "none", "--time-budget", "0"],
                     {"ours": _stand_in("ours")})
    assert rc == 0 and calls == [] and "time budget" in capsys.readouterr().out


def test_inputs_are_seeded_and_sliced():
    rows = G.select_bwd_rows(["1/2"], ["30+20", "50"])
    f1 = InputFactory("cpu", 50, seed=3, grads=True)
    a, b = f1.get(rows[0]), f1.get(rows[1])
    assert a.do.shape == (1, 50, 2, 128) and a.do.dtype == torch.bfloat16 and a.dht.shape == (2, 2, 128, 128)
    assert torch.equal(a.do, b.do) and torch.equal(a.q, b.q)             # one draw per head config, first T tokens
    assert a.cu_seqlens.tolist() == [0, 30, 50] and a.scale == 128**-0.5
    again = InputFactory("cpu", 50, seed=3, grads=True).get(rows[0])
    assert torch.equal(again.dht, a.dht) and torch.equal(again.do, a.do)


# ---------------------------------------------------------------- command line


def test_cli_bwd_list_and_errors():
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", "--bwd", "--list"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 0 and out.stdout.startswith("32 rows")
    assert "161+1928+3157+563+1244+229+177+733" in out.stdout
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", "--bwd", "--list", "--mixes", "8k_0seq"],
                         capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 2
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", "--bwd", "--breakdown"], capture_output=True,
                         text=True, cwd=ROOT)
    assert out.returncode == 2 and "forward" in out.stderr


def test_cli_bwd_without_cuda_exits_nonzero():
    if torch.cuda.is_available():
        pytest.skip("CUDA present")
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", "--bwd", "--quick"], capture_output=True, text=True,
                         cwd=ROOT)
    assert out.returncode == 2 and "needs a CUDA GPU" in out.stderr


def test_cli_bwd_report_only(tmp_path):
    p = tmp_path / f"{PREFIX}.csv"
    for r in (_line(16, 32, "32k_1seq", (2.0, 2.8), (6.0, 9.0), (3.0, 4.0)),
              _line(2, 4, "8k_4seq", (0.5, 0.7), (1.0, 1.4), (0.5, 0.6))):
        S.append_row(p, r, BWD.result_fields)
    S.append_row(tmp_path / "test-gpu-fwd.csv", {"gpu": "x"}, ["gpu"])    # a forward file beside it is ignored
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", "--bwd", "--report-only", "--no-plot",
                          "--results-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 0, out.stderr
    md = (tmp_path / f"{PREFIX}.md").read_text()
    assert "| 16/32 | 32k_1seq |" in md and "3.00x" in md and "Rebuilt from the CSV" in md
    assert "## Drift" in md and "No re-timed rows recorded." in md
    # --commit picks the rows of one commit: one the CSV does not have is an error naming it
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", "--bwd", "--report-only", "--no-plot", "--commit",
                          "nope", "--results-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT)
    assert out.returncode == 1 and "for commit nope" in out.stderr
    assert (tmp_path / f"{PREFIX}.md").read_text() == md
    # a rebuild keeps the method bullets of the page it replaces, but not a peers bullet that claimed
    # more than the page shows
    old = ("- Peers column: `live` = timed in this process on the same inputs; `cached` = read from the peers CSV of "
           "this environment key (re-timed rows are listed under Drift).")
    (tmp_path / f"{PREFIX}.md").write_text("## Method\n\n- timer X.\n" + old + "\n")
    subprocess.run([sys.executable, "-m", "flashqla.bench", "--bwd", "--report-only", "--no-plot",
                    "--results-dir", str(tmp_path)], capture_output=True, text=True, cwd=ROOT, check=True)
    md = (tmp_path / f"{PREFIX}.md").read_text()
    assert "- timer X." in md and old not in md and f"- {PEERS_METHOD}" in md


def test_cli_bwd_report_only_also_commits(tmp_path):
    """`--bwd --report-only --also-commits`: rows the latest commit did not measure come from the named
    commit; the header counts each commit's rows; a row both measured shows the latest's."""
    p = tmp_path / f"{PREFIX}.csv"
    for r in (_line(16, 32, "32k_1seq", (2.0, 2.8), (6.0, 9.0), (3.0, 4.0), commit="old", date="2026-12-01T00:00:00Z"),
              _line(2, 4, "8k_4seq", (0.9, 1.1), (1.0, 1.4), (0.5, 0.6), commit="old", date="2026-12-01T00:00:00Z"),
              _line(2, 4, "8k_4seq", (0.5, 0.7), (1.0, 1.4), (0.5, 0.6), commit="new", date="2026-12-01T01:00:00Z")):
        S.append_row(p, r, BWD.result_fields)
    run = lambda *extra: subprocess.run([sys.executable, "-m", "flashqla.bench", "--bwd", "--report-only", "--no-plot",  # noqa: E731
                                         "--results-dir", str(tmp_path), *extra], capture_output=True, text=True, cwd=ROOT)
    out = run()
    assert out.returncode == 0, out.stderr
    md = (tmp_path / f"{PREFIX}.md").read_text()
    assert "| our commit | new |" in md and "| 16/32 | 32k_1seq |" not in md
    out = run("--also-commits", "old")
    assert out.returncode == 0, out.stderr
    md = (tmp_path / f"{PREFIX}.md").read_text()
    assert "| our commit | new (1 rows); old (1 rows) |" in md
    assert "| 16/32 | 32k_1seq |" in md
    assert "| 2/4 | 8k_4seq |" in md and "| 0.500 |" in md and "| 0.900 |" not in md


def test_cp_page_gets_the_backward_one_sequence_rows(tmp_path):
    """The backward report writes its one-sequence rows as the last section of an existing CP page
    (replacing, not repeating, it on every rebuild), and the forward report keeps that section when it
    rewrites the page; no CP page, none written."""
    from tests.test_bench import _row

    p = tmp_path / f"{PREFIX}.csv"
    for r in (_line(16, 32, "32k_1seq", (2.0, 2.8), (6.0, 9.0), (3.0, 4.0)),
              _line(2, 4, "8k_4seq", (0.5, 0.7), (1.0, 1.4), (0.5, 0.6))):
        S.append_row(p, r, BWD.result_fields)
    paths = S.files(tmp_path, PREFIX)
    assert paths["cp_md"].name == PREFIX.replace("-bwd", "-cp") + ".md"
    meta = {"date": "d", "method": ["m"]}
    R.write_pages("bwd", paths, ENV, "c", meta, plot=False)
    assert not paths["cp_md"].exists()
    # the forward benchmark writes the CP page from its CP rows
    S.append_row(tmp_path / "test-gpu-fwd.csv", _row(2, 8, "1x2048", 0.1, 0.2, 0.05), S.SCHEMAS["fwd"].result_fields)
    fwd_paths = S.files(tmp_path, "test-gpu-fwd")
    assert fwd_paths["cp_md"] == paths["cp_md"]
    R.write_pages("fwd", fwd_paths, ENV, "c", meta, plot=False)
    assert R.CP_BWD_HEADING not in paths["cp_md"].read_text()
    for _ in range(2):
        R.write_pages("bwd", paths, ENV, "c", meta, plot=False)
        md = paths["cp_md"].read_text()
        assert md.count(R.CP_BWD_HEADING) == 1 and md.index("| 2/8 | 1x2048 |") < md.index(R.CP_BWD_HEADING)
        section = md[md.index(R.CP_BWD_HEADING):]
        assert "| 16/32 | 32k_1seq | 32768 |" in section and "8k_4seq" not in section  # one sequence only
        assert "| backward: ours over FLA | 3.00x (n=1) |" in section and "our commit: c)" in section
        assert "| backward: ours over FlashQLA | 1.50x (n=1) |" in section
    # the forward report keeps the backward's section as it is
    R.write_pages("fwd", fwd_paths, ENV, "c", meta, plot=False)
    assert paths["cp_md"].read_text() == md
    assert "Environment: gpu Test GPU, driver 1.0, cuda 12.8," in md
    # a later backward run without one-sequence rows leaves the section as it is
    S.append_row(p, _line(2, 4, "8k_4seq", (0.4, 0.6), (1.0, 1.4), (0.5, 0.6), commit="c2"), BWD.result_fields)
    R.write_pages("bwd", paths, ENV, "c2", meta, plot=False)
    assert paths["cp_md"].read_text() == md
    h = R.CP_BWD_HEADING
    assert R.splice_section("a\n" + h + "\nx\n", h, []) == "a\n"
    assert R.splice_section(h + "\nx\n", h, [h, "y"]) == h + "\ny\n"            # the heading first in the file
    assert R.splice_section("a\n\n" + h, h, [h, "y"]) == "a\n\n" + h + "\ny\n"    # last, without a newline
    assert R.splice_section("a\n" + h + "x\n", h, [h]) == "a\n" + h + "x\n\n" + h + "\n"  # a longer heading is another
    assert R.kept_section(tmp_path / "none.md") == []

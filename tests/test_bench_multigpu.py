"""`python -m flashqla.bench --multigpu` without a GPU: row selection (strong / weak, world sizes above
the machine's skipped), the results CSV's resume key, the lower-bound memory check, the respawn after
a failed row, the page and plot from hand-made rows (targets met / not met, speed-up and efficiency
arithmetic), the peer adapters without the peers installed, the block-seeded shard inputs, and one
end-to-end run of the ranks on CPU (gloo, W = 2, our op on the fp64 reference backend): the gate and
the row assembly."""

from __future__ import annotations

import importlib.util
import json
import math
import os
from pathlib import Path

import pytest
import torch

from flashqla.bench import multigpu as M
from flashqla.bench import store as S
from flashqla.bench.__main__ import main as bench_main
from flashqla.bench.gate import parse_errs

ENV = {f: "v" for f in M.ENV_FIELDS} | {"gpu": "NVIDIA H100 80GB HBM3"}


def _setup(**kw) -> M.Setup:
    return M.Setup(**({"device": "cpu", "dist_backend": "gloo", "dtype": "fp64", "head_dim": 16, "gate_tokens": 64,
                       "iters": 1, "warmup": 0, "comm_iters": 1, "pg_timeout_s": 60} | kw))


# ---------------------------------------------------------------------------------------- selection


def test_points_strong_weak_and_both():
    strong = M.select_points(["16/64 1x4194304"], "1,2,4,8", "strong")
    assert [(p.T, p.world_size, p.tokens_per_rank) for p in strong] == [
        (4194304, 1, 4194304), (4194304, 2, 2097152), (4194304, 4, 1048576), (4194304, 8, 524288)]
    weak = M.select_points(["16/64 1x4194304"], (8, 1, 2, 4), "weak")  # T / max(W) tokens per rank
    assert [(p.T, p.world_size) for p in weak] == [(524288, 1), (1048576, 2), (2097152, 4), (4194304, 8)]
    assert {p.tokens_per_rank for p in weak} == {524288}
    both = M.select_points(["16/64 1x4194304", "2/8 1x1048576"], "1,2", "both")
    # per configuration strong then weak; the shared point (T, max W) once, tagged with both
    assert [(p.h_qk, p.T, p.world_size, p.scaling) for p in both] == [
        (16, 4194304, 1, "strong"), (16, 4194304, 2, "strong+weak"), (16, 2097152, 1, "weak"),
        (2, 1048576, 1, "strong"), (2, 1048576, 2, "strong+weak"), (2, 524288, 1, "weak")]
    assert M.DEFAULT_CONFIGS[0] == "16/64 1x4194304"  # the target row comes first
    with pytest.raises(ValueError, match="multiple of W"):
        M.select_points(["2/8 1x1000"], "1,3", "strong")
    with pytest.raises(ValueError, match="largest W"):
        M.select_points(["2/8 1x1000"], "1,3", "weak")
    with pytest.raises(ValueError, match="one sequence"):
        M.select_points(["2/8 2x1024"], "1,2")
    with pytest.raises(ValueError, match="H/HV 1xT"):
        M.select_points(["2/8 1024"], "1,2")
    with pytest.raises(ValueError):
        M.parse_gpus("0,2")


def test_world_sizes_above_the_machine_are_skipped(tmp_path):
    assert M.usable_gpus("1,2,4,8", 4) == ((1, 2, 4), ["skipping 8 GPUs: this machine has 4 CUDA device(s)"])
    assert M.usable_gpus("2,4", None) == ((2, 4), [])
    jobs, logs = [], []

    def spawn(job):
        jobs.append((job.world_size, [(p.T, i) for p, i in job.todo]))

    pts = M.select_points(["2/8 1x4096"], "1,2,4,8", "strong")
    pages = []
    out = M.run(pts, ("ours",), _setup(), ENV, "c1", tmp_path / "x.csv", available=2, spawn=spawn, log=logs.append,
                after_world_size=lambda: pages.append(len(jobs)))
    assert [w for w, _ in jobs] == [1, 2]  # nothing spawned for 4 and 8
    assert pages == [1, 2]  # the page is refreshed after each world size
    assert out["notes"] == [f"skipping {W} GPUs: this machine has 2 CUDA device(s)" for W in (4, 8)]
    assert any("skipping 8 GPUs" in line for line in logs)


def test_command_line():
    a = M.parse_args(["--multigpu", "--gpus", "8,2", "--configs", "16/64 1x4194304", "--impls", "ours,fla",
                      "--scaling", "weak", "--time-budget", "480", "--results-dir", "/tmp/r"])
    assert a.gpus == (2, 8) and a.impls == ("ours", "fla") and a.time_budget == 480.0
    assert [(p.T, p.world_size) for p in a.points] == [(1048576, 2), (4194304, 8)]
    with pytest.raises(SystemExit):
        M.parse_args(["--impls", "ours,flashinfer"])
    with pytest.raises(SystemExit):
        M.parse_args(["--gpus", "1,3", "--configs", "2/8 1x1024"])
    for bad in (["--iters", "0"], ["--comm-iters", "0"], ["--warmup", "-1"], ["--gate-tokens", "0"], ["--tol", "0"]):
        with pytest.raises(SystemExit):  # every rank would fail alike, one respawn per row
            M.parse_args(["--configs", "2/8 1x1024", *bad])
    assert bench_main(["--multigpu", "--list", "--gpus", "1,2", "--configs", "2/8 1x1024"]) == 0
    if not torch.cuda.is_available():  # a measuring run needs CUDA; the early branch reaches the module
        assert bench_main(["--multigpu", "--gpus", "1,2", "--configs", "2/8 1x1024"]) == 2


# ---------------------------------------------------------------------------------------- CSV and runs


def _row(impl, H, HV, T, W, status="ok", fwd=None, step=None, commit="c1", env=ENV, **kw):
    p = M.Point(H, HV, T, W)
    timing = {} if fwd is None else {"fwd_ms": fwd, "step_ms": step, "peak_gib": 50.0}
    r = M.assemble_row(p, impl, env, commit, M.Setup(), status=status, gate="ok" if status == "ok" else "",
                       gate_errs={"o": 4e-3, "dg": 6e-3} if status == "ok" else None, gate_tokens=2048 * W,
                       timing=timing, date=kw.pop("date", "2026-12-06T00:00:00Z"))
    r.update(kw)
    return {k: S.fmt(v) for k, v in r.items()}


def test_resume_key_and_done_statuses(tmp_path):
    csv = tmp_path / "h-multigpu.csv"
    rows = [_row("ours", 2, 8, 4096, 2, fwd=1.0, step=3.0), _row("fla", 2, 8, 4096, 2, status="n/a: ImportError: x"),
            _row("flash_qla", 2, 8, 4096, 2, status="gate failed: o 2e-2 > 1e-2"),
            _row("ours", 2, 8, 8192, 2, status="out of memory"), _row("ours", 2, 8, 8192, 1, status="error: Boom"),
            _row("fla", 2, 8, 8192, 1, status="deferred")]
    for r in rows:
        S.append_row(csv, r, M.FIELDS)
    done = M.done_keys(S.read_rows(csv))
    assert done == {M.row_key(r) for r in rows[:4]}
    # the key: environment, commit, W, impl, heads, T (not the date, not the scaling tag)
    k = M.row_key(rows[0])
    assert k == tuple(str(rows[0][f]) for f in M.KEY_FIELDS) and "2026" not in "".join(k)
    assert M.row_key(_row("ours", 2, 8, 4096, 2, fwd=9.0, step=9.0, scaling="weak")) == k
    assert M.row_key(_row("ours", 2, 8, 4096, 2, commit="c2")) != k
    assert M.row_key(_row("ours", 2, 8, 4096, 2, env=ENV | {"nccl": "2.28.9"})) != k
    assert M.row_key(_row("ours", 2, 8, 4096, 4)) != k
    # the last line of a key decides: an error after an ok row makes it pending again
    S.append_row(csv, _row("ours", 2, 8, 4096, 2, status="error: later"), M.FIELDS)
    assert M.row_key(rows[0]) not in M.done_keys(S.read_rows(csv))


def test_rerun_skips_done_rows_and_force_does_not(tmp_path):
    csv = tmp_path / "h-multigpu.csv"
    S.append_row(csv, _row("ours", 2, 8, 4096, 2, fwd=1.0, step=3.0), M.FIELDS)
    seen = []
    pts = M.select_points(["2/8 1x4096"], "2", "strong")
    M.run(pts, ("ours", "fla"), M.Setup(), ENV, "c1", csv, available=8, spawn=lambda j: seen.append(j.todo), log=lambda s: None)
    assert [[i for _, i in todo] for todo in seen] == [["fla"]]
    seen.clear()
    M.run(pts, ("ours", "fla"), M.Setup(), ENV, "c1", csv, available=8, force=True, spawn=lambda j: seen.append(j.todo),
          log=lambda s: None)
    assert [[i for _, i in todo] for todo in seen] == [["ours", "fla"]]
    seen.clear()  # a passed time budget starts nothing and leaves the rows for the next run
    out = M.run(pts, ("ours", "fla"), M.Setup(), ENV, "c1", csv, available=8, time_budget=0.0,
                spawn=lambda j: seen.append(j.todo), log=lambda s: None)
    assert seen == [] and [i for _, i in out["deferred"]] == ["fla"]


def test_lower_bound_memory_rows_are_recorded_without_running(tmp_path):
    # 16/64 x 4M tokens on one rank: 4M x (2 (4 16 128 + 4 64 128) + 16 64) bytes = 324 GiB
    assert M.min_bytes_per_rank(16, 64, 4194304) == 4194304 * (2 * (4 * 16 * 128 + 4 * 64 * 128) + 16 * 64)
    assert M.min_bytes_per_rank(16, 64, 4194304) / 2**30 == pytest.approx(324, abs=1)
    csv = tmp_path / "h-multigpu.csv"
    seen = []
    pts = M.select_points(["16/64 1x4194304"], "1,8", "strong")
    M.run(pts, ("ours",), M.Setup(), ENV, "c1", csv, available=8, device_bytes=80 << 30,
          spawn=lambda j: seen.append([(p.world_size, i) for p, i in j.todo]), log=lambda s: None)
    rows = S.read_rows(csv)
    assert [(r["world_size"], r["status"][:13]) for r in rows] == [("1", "out of memory")]
    assert "324 GiB per rank" in rows[0]["status"] and "80 GiB" in rows[0]["status"]
    assert seen == [[(8, "ours")]]  # 512K tokens per rank passes the bound and runs


def test_a_failed_row_is_recorded_and_the_rest_respawned(tmp_path):
    csv = tmp_path / "h-multigpu.csv"
    pts = M.select_points(["2/8 1x4096", "16/32 1x4096"], "2", "strong")
    calls = []

    def spawn(job):
        calls.append([(p.h_qk, i) for p, i in job.todo])
        first_p, first_i = job.todo[0]
        if len(calls) == 1:  # ours' timing runs out of memory on rank 1
            Path(job.work_dir, "fail-1.json").write_text(json.dumps(
                {"point": first_p.__dict__, "impl": first_i, "phase": "timing", "status": "out of memory"}))
            raise RuntimeError("process 1 terminated with exit code 1")
        if len(calls) == 2:  # FLA's gate raises: its other rows of the same heads go with it
            Path(job.work_dir, "current.json").write_text(json.dumps(
                {"point": first_p.__dict__, "impl": first_i, "phase": "gate"}))
            Path(job.work_dir, "fail-0.json").write_text(json.dumps(
                {"point": first_p.__dict__, "impl": first_i, "phase": "gate", "status": "error: AssertionError: x"}))
            raise RuntimeError("process 0 terminated with exit code 1")
        for p, i in job.todo:
            S.append_row(job.csv_path, M.assemble_row(p, i, job.env, job.commit, job.setup, status="ok"), M.FIELDS)

    out = M.run(pts, ("ours", "fla"), M.Setup(), ENV, "c1", csv, available=2, spawn=spawn, log=lambda s: None)
    assert calls == [[(2, "ours"), (2, "fla"), (16, "ours"), (16, "fla")], [(2, "fla"), (16, "ours"), (16, "fla")],
                     [(16, "ours"), (16, "fla")]]
    got = {(r["h_qk"], r["impl"]): r["status"] for r in S.read_rows(csv)}
    assert got == {("2", "ours"): "out of memory", ("2", "fla"): "gate error: AssertionError: x",
                   ("16", "ours"): "ok", ("16", "fla"): "ok"}
    assert out["deferred"] == []


# ---------------------------------------------------------------------------------------- page


def _page_rows(step8: float, fla8: float = 30.0) -> list[dict]:
    T, Tr = 4194304, 524288
    return [
        _row("ours", 16, 64, T, 1, status="out of memory (inputs ... alone need 324 GiB per rank)"),
        _row("ours", 16, 64, Tr, 1, fwd=20.0, step=100.0),
        _row("ours", 16, 64, 2 * Tr, 2, fwd=11.0, step=110.0, ag_fwd_bytes=8 << 20, ag_bwd_bytes=4 << 20,
             ag_fwd_ms=0.1, ag_bwd_ms=0.09, local_fwd_ms=10.5, local_step_ms=109.0),
        _row("ours", 16, 64, T, 8, fwd=25.0, step=step8),
        _row("fla", 16, 64, T, 8, fwd=40.0, step=fla8),
        _row("flash_qla", 16, 64, T, 8, status="gate failed: dq 2.0e-02 > 1e-02"),
        _row("ours", 2, 8, 1048576, 1, fwd=10.0, step=100.0),
        _row("ours", 2, 8, 1048576, 2, fwd=6.0, step=60.0),
        _row("flash_qla", 2, 8, 1048576, 2, fwd=7.0, step=70.0),
    ]


def test_page_targets_and_arithmetic(tmp_path):
    # 8 GPUs: 4M tokens in 120 ms against one GPU's 512K in 100 ms: (4194304 / 0.12) / (524288 / 0.1) = 6.67x
    rows = _page_rows(step8=120.0)
    t = M.targets(rows)
    assert t[0].startswith("- ours at 8 GPUs") and "**met**: 6.67x" in t[0] and "524,288 tokens" in t[0]
    assert "**not met** on 1 of 2 peer rows" in t[1] and "vs FLA: step 120.00 vs 30.00 ms" in t[1]
    t = M.targets(_page_rows(step8=140.0, fla8=200.0))  # 5.71x; ours now faster than FLA everywhere
    assert "**not met**: 5.71x" in t[0] and "**met** on all 2 peer rows" in t[1]
    assert "**not measured** (no 8-GPU row)" in M.targets(rows[:3])[0]
    assert "**not measured** (no peer row" in M.targets(rows[:4])[1]
    oom8 = rows[:3] + [_row("ours", 16, 64, 4194304, 8, status="out of memory")]
    assert "**not measured** (8-GPU row: out of memory)" in M.targets(oom8)[0]

    idx = M._index(rows)
    r = next(r for r in rows if r["h_qk"] == "2" and r["world_size"] == "2" and r["impl"] == "ours")
    f, s, e = M.scaling_of(r, idx, "strong")  # 100 / 60 ms, over 2 GPUs
    assert (f, s, e) == pytest.approx((10 / 6, 100 / 60, 100 / 120))
    r = next(r for r in rows if r["T"] == "1048576" and r["h_qk"] == "16")
    f, s, e = M.scaling_of(r, idx, "weak")  # 524,288 tokens per rank: 100 ms at 1 GPU, 110 ms at 2
    assert (f, s, e) == pytest.approx((2 * 20 / 11, 2 * 100 / 110, 100 / 110))
    assert all(math.isnan(v) for v in M.scaling_of(r, idx, "strong"))  # no 1-GPU row at 1M for 16/64

    md = "\n".join(M.markdown(rows, ENV, "c1"))
    assert "| GPU |" not in md and "| gpu | NVIDIA H100 80GB HBM3 |" in md and "| our commit | c1 |" in md
    assert "## Strong scaling (fixed T)" in md and "## Weak scaling (fixed T per rank)" in md
    strong = md.split("## Strong scaling")[1].split("## Weak scaling")[0]
    weak = md.split("## Weak scaling")[1].split("## Gate")[0]
    assert "| 2/8 | 1,048,576 | 2 | 524,288 | ours | 6.00 | 60.00 | 54.00 | 17.48 | 1.67x | 1.67x | 83% |" in strong
    assert "| 16/64 | 1,048,576 | 2 | 524,288 | ours | 11.00 | 110.00 | 99.00 | 9.53 | 3.64x | 1.82x | 91% | 50.0 | " \
           "8,192 + 4,096 | 0.100 / 0.090 | +0.50 / +1.00 | ok |" in weak
    assert "gate failed: dq 2.0e-02 > 1e-02" in strong and "out of memory (inputs" in strong
    assert "| ours | 16/64 | 2 | 4096 | ok | o=4.0e-03 dg=6.0e-03 |" in md

    csv = tmp_path / "h100-80gb-hbm3-multigpu.csv"
    for r in rows + [_row("ours", 2, 8, 1048576, 2, fwd=1.0, step=1.0, commit="old", date="2026-01-01T00:00:00Z")]:
        S.append_row(csv, r, M.FIELDS)
    written = M.write_page(csv, tmp_path / "p.md", tmp_path / "p.png")
    assert [p.name for p in written] == ["p.md", "p.png"]
    assert (tmp_path / "p.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    text = (tmp_path / "p.md").read_text()
    assert "![throughput against GPUs](p.png)" in text and "| our commit | c1 |" in text  # the latest commit's rows
    out = tmp_path / "out"
    assert bench_main(["--multigpu", "--report-only", "--results-dir", str(tmp_path), "--out-dir", str(out)]) == 0
    assert (out / "h100-80gb-hbm3-multigpu.md").read_text() == text.replace("p.png", "h100-80gb-hbm3-multigpu.png")
    assert (out / "h100-80gb-hbm3-multigpu.png").exists()


# ---------------------------------------------------------------------------------------- adapters, inputs


def test_peer_adapters_raise_import_error_without_the_peers():
    had = os.environ.get("FLA_FLASH_QLA")
    for name, adapter, what in (("fla", M.fla_kcp, "FLA"), ("flash_qla", M.flash_qla_cp, "FlashQLA")):
        if importlib.util.find_spec(name) is not None:
            pytest.skip(f"{name} is installed here")
        with pytest.raises(ImportError, match=f"{what} .* is not installed"):
            adapter(2, 8, 4096, 2, None, M.Setup())
    if importlib.util.find_spec("flash_qla") is None:  # the gate's forced-split instance takes the same path
        with pytest.raises(ImportError, match="FlashQLA .* is not installed"):
            M.flash_qla_cp(2, 8, 4096, 2, None, M.Setup(), force_intra=True)
    assert os.environ.get("FLA_FLASH_QLA") == had  # nothing set for a peer that is not there
    with pytest.raises(RuntimeError, match="need CUDA"):  # ours' kernels on a CPU setup
        M.ours_cp(2, 8, 4096, 2, None, _setup())


def test_shard_inputs_are_slices_of_one_global_draw():
    kw = dict(device="cpu", dtype=torch.float64, K=4, V=4, seed=3)
    T = 2 * M._BLOCK + 100
    full = M.make_inputs(1, 2, 0, T, **kw)
    for lo, hi in ((0, 5), (M._BLOCK - 7, M._BLOCK + 9), (T - 33, T)):
        part = M.make_inputs(1, 2, lo, hi, **kw)
        for n in full:
            assert torch.equal(part[n], full[n][:, lo:hi]), (n, lo, hi)
    one = torch.ones((), dtype=torch.float64)
    assert torch.allclose(full["q"].norm(dim=-1), one) and torch.allclose(full["k"].norm(dim=-1), one)
    g, beta = full["g"], full["beta"]
    assert bool((g[..., 0] == 0).all()) and bool((g <= 0).all()) and bool((g[..., 1] < 0).all())
    assert bool(((beta > 0) & (beta < 1)).all())
    bf = M.make_inputs(2, 4, 0, 64, device="cpu", K=8, V=8)
    assert bf["q"].dtype == bf["v"].dtype == bf["do"].dtype == torch.bfloat16 and bf["g"].dtype == torch.float32


def test_gate_instances_per_implementation(monkeypatch, tmp_path):
    """Ours is gated with its split forced (unless --cp off), FlashQLA with its defaults and with its
    intra-card split forced (whichever path a timed row takes is gated), FLA as timed; the largest
    error per quantity over the instances is kept."""
    from types import SimpleNamespace

    calls = []

    def fake(name):
        def adapter(H, HV, T, W, group, setup, **kw):
            calls.append((name, T, W, kw))
            return name
        return adapter

    for n in M.IMPLS:
        monkeypatch.setitem(M.ADAPTERS, n, fake(n))
    p = M.Point(2, 8, 4096, 2)
    R = SimpleNamespace(W=2, group=None, setup=_setup(cp="auto"))
    assert M._gate_ops("flash_qla", p, 256, R) == ["flash_qla", "flash_qla"]
    assert calls == [("flash_qla", 256, 2, {}), ("flash_qla", 256, 2, {"force_intra": True})]
    calls.clear()
    assert M._gate_ops("ours", p, 256, R) == ["ours"] and calls == [("ours", 256, 2, {"cp": "on"})]
    calls.clear()
    R.setup = _setup(cp="off")
    assert M._gate_ops("ours", p, 256, R) == ["ours"] and calls == [("ours", 256, 2, {"cp": "off"})]
    calls.clear()
    assert M._gate_ops("fla", p, 256, R) == ["fla"] and calls == [("fla", 256, 2, {})]
    assert M._merge_errs([{"o": 1e-3, "dg": 5e-3}, {"o": 2e-3, "dg": 1e-3, "ht": 1e-3}]) == {
        "o": 2e-3, "ht": 1e-3, "dg": 5e-3}
    job = SimpleNamespace(work_dir=str(tmp_path))  # markers are written whole: no temporary file stays
    M._marker(job, "fail-0.json", {"status": "out of memory"})
    assert [f.name for f in tmp_path.iterdir()] == ["fail-0.json"]
    assert json.loads((tmp_path / "fail-0.json").read_text()) == {"status": "out of memory"}


def test_gate_tolerances_and_decision():
    tol = M.gate_tolerances()
    assert tol["dg"] == 3e-2 and all(tol[n] == 1e-2 for n in M.GATE_NAMES if n != "dg")
    assert M.gate_tolerances(2e-2)["dg"] == pytest.approx(6e-2)
    assert M.gate_decision({"o": 5e-3, "dg": 2.9e-2}, tol) == (True, "")
    ok, why = M.gate_decision({"o": 5e-3, "dq": 1.5e-2, "dg": math.inf}, tol)
    assert not ok and why == "dq 1.5e-02 > 1e-02, dg inf > 3e-02"
    assert M.gate_decision({}, tol) == (False, "nothing compared")
    assert M._merge_errs([{"o": 1e-3, "ht": 2e-3}, {"o": 4e-3}]) == {"o": 4e-3, "ht": 2e-3}


# ---------------------------------------------------------------------------------------- end to end, CPU


def test_ranks_end_to_end_on_cpu(tmp_path):
    """Two gloo ranks, fp64, our op on the reference backend: the gate passes at fp64 rounding and the
    row carries every field (times on CPU mean nothing); FLA is reported n/a, not a crash."""
    import reference
    from flashqla.distributed import exchange_bytes

    setup = _setup(ours_backend=reference.chunk_gated_delta_rule)
    env = M.environment(setup)
    assert env["gpu"] == "cpu (gloo)" and set(env) == set(M.ENV_FIELDS)
    csv = tmp_path / "cpu-gloo-multigpu.csv"
    pts = M.select_points(["1/2 1x256"], "2", "strong")
    left, logs = [], []

    def torn_down(job):  # the real ranks, then a crash at teardown, after every row was written
        M._spawn(job)
        left.append({f.name for f in Path(job.work_dir).iterdir()})
        raise RuntimeError("process 1 terminated with signal SIGSEGV")

    out = M.run(pts, ("ours", "fla"), setup, env, "c1", csv, available=2, spawn=torn_down, log=logs.append)
    assert out["deferred"] == [] and out["measured"] == 2
    # rank 0 removed its current-row marker once every rank was done: the crash marks no row
    assert len(left) == 1 and "current.json" not in left[0] and not any(n.startswith("fail-") for n in left[0])
    assert any("failed outside any row" in line for line in logs) and len(S.read_rows(csv)) == 2
    rows = {r["impl"]: r for r in S.read_rows(csv)}
    ours, fla = rows["ours"], rows["fla"]
    assert fla["impl"] == "fla" and fla["status"].startswith("n/a: ImportError: FLA")
    assert ours["status"] == "ok" and ours["gate"] == "ok" and ours["world_size"] == "2" and ours["tokens_per_rank"] == "128"
    errs = parse_errs(ours["gate_errs"])
    assert set(errs) == {"o", "ht", "dq", "dk", "dv", "dg", "dbeta"} and max(errs.values()) < 1e-10
    assert ours["gate_tokens"] == "128"
    f, s = float(ours["fwd_ms"]), float(ours["step_ms"])
    assert f > 0 and s > 0 and float(ours["bwd_ms"]) == pytest.approx(s - f, rel=1e-5)
    assert float(ours["step_tok_s"]) == pytest.approx(256 / (s / 1e3), rel=1e-5)
    vol = exchange_bytes(2, 16, 16, 2, torch.float64)
    assert (int(ours["ag_fwd_bytes"]), int(ours["ag_bwd_bytes"])) == (vol["fwd_send"], vol["bwd_send"])
    assert all(float(ours[k]) > 0 for k in ("ag_fwd_ms", "ag_bwd_ms", "local_fwd_ms", "local_step_ms"))
    assert ours["peak_gib"] == ""  # no CUDA memory statistics on CPU
    assert "chunk_gated_delta_rule_cp" in ours["source"]
    md = "\n".join(M.markdown(S.read_rows(csv), env, "c1"))
    assert "| ours | 1/2 | 2 | 128 | ok |" in md


def test_local_variant_replaces_the_ops_state_gathers_and_restores_them():
    from flashqla.distributed import build_cp_context
    from flashqla.distributed import op as cp_op

    real = cp_op._all_gather
    ctx = build_cp_context([0, 8], rank=1, world_size=4)  # planning only: no process group needed
    x = torch.arange(6.0).view(2, 3)
    with M._without_state_gathers():
        assert cp_op._all_gather is not real
        got = cp_op._all_gather(x, ctx)  # what the op's forward and backward exchanges now call
        assert got.shape == (4, 2, 3) and all(torch.equal(g, x) for g in got)
    assert cp_op._all_gather is real

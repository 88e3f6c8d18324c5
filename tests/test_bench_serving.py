"""`python -m flashqla.bench --serving` without a GPU: the checkpoint positions it gives ours and
FlashInfer, the row selection, the command line, and the page built from CSV rows."""

from __future__ import annotations

import pytest

import flashqla

from flashqla.bench import serving as SV
from flashqla.bench.__main__ import main, parse_args


def test_quarter_positions_lie_inside_their_sequences():
    lengths = [5, 0, 3, 8192, 1]
    pos = SV.positions_quarter(lengths)
    cu = [0, 5, 5, 8, 8200, 8201]
    assert pos == sorted(pos) and len(set(pos)) == len(pos)
    for p in pos:
        assert any(cu[n] < p <= cu[n + 1] for n in range(len(lengths))), p
    # 4 per sequence of at least 4 tokens, the last one at its end; fewer (deduplicated) below
    assert [p for p in pos if 8 < p <= 8200] == [8 + 2048, 8 + 4096, 8 + 6144, 8200]
    assert [p for p in pos if p <= 5] == [2, 3, 4, 5]
    assert [p for p in pos if 5 < p <= 8] == [6, 7, 8]
    assert pos[-1] == 8201


def test_flashinfer_period_and_positions():
    assert SV.fi_every_n([8192] * 4) == 2048
    assert SV.fi_every_n([28672, 4096]) == 7168
    assert SV.fi_every_n([100]) == 64  # at least one chunk
    assert SV.fi_every_n([1000]) == 192  # 250 rounded down to a multiple of 64
    # equal sequences of a multiple of 256 tokens: the same positions as the quarter points
    assert SV.positions_every([8192] * 4, 2048) == SV.positions_quarter([8192] * 4)
    assert SV.positions_every([28672, 4096], 7168) == [7168, 14336, 21504, 28672]
    assert SV.positions_every([300, 0, 1000], 256) == [256, 556, 812, 1068]


def test_rows_and_command_line():
    assert len(SV.serving_rows()) == len(SV.SERVING_ROWS)
    assert [r.label for r in SV.serving_rows(heads=("16/32",), mixes=("8192x4",))] == ["16/32 8192x4"]
    o = parse_args(["--serving", "--state-dtype", "fp32", "--quick"])
    assert o.serving and o.state_dtype == "fp32" and o.quick
    with pytest.raises(SystemExit):
        parse_args(["--serving", "--bwd"])
    assert main(["--serving", "--list"]) == 0


def _row(h, m, plain, serv, fi_p, fi_s, path="kernel", status="ok", **kw):
    r = {"gpu": "NVIDIA H100 80GB HBM3", "commit": "abc", "h_qk": str(h[0]), "h_v": str(h[1]), "mix": m, "N": "4",
         "state_dtype": "bfloat16", "ckpt_ours": "16", "ckpt_fi": "16", "path": path, "plain_ms": str(plain),
         "serving_ms": str(serv), "serving_fi_ms": str(serv), "fi_plain_ms": str(fi_p), "fi_serving_ms": str(fi_s),
         "err_o": "0", "err_ckpt_fi": "3e-3", "status": status, "date": "2026-12-05T00:00:00Z"}
    r.update(kw)
    return r


def test_page_summary_counts_the_goal_and_the_peer():
    rows = [_row((16, 32), "8192x4", 1.0, 1.02, 0.8, 0.9), _row((2, 8), "1x32768", 2.0, 3.0, 2.2, 2.4, path="torch"),
            _row((16, 64), "1024x8", 1.0, 1.0, 1.0, 1.0, status="gate failed: err_o 1e-2")]
    md = "\n".join(SV.serving_markdown(rows, {"gpu": "NVIDIA H100 80GB HBM3", "flashinfer": "0.7.2.post1"}, "abc"))
    assert "| our commit | abc |" in md and "NVIDIA H100 80GB HBM3" in md
    assert "1 of 2 within the 3% goal" in md  # +2% and +50%
    assert "rows on the kernel path: 1" in md
    assert "rows on the torch path (the split plan): 1, geometric mean +50.0%" in md
    assert "over 2 rows" in md and "rows not timed: 1" in md
    assert "| 16/32 | 8192x4 | 1.000 | 1.020 | +2.0% | kernel |" in md
    assert "batch_invariant" not in md.split("## Summary")[1].split("## Rows")[0]  # no such times: no line
    # FlashInfer's serving time over ours at the same checkpoints: 0.9 / 1.02 and 2.4 / 3.0
    assert "| 0.88x |" in md and "| 0.80x |" in md and "geometric mean 0.84x over 2 rows" in md


def test_page_reports_the_cost_of_batch_invariant():
    rows = [_row((16, 32), "8192x4", 1.0, 1.0, 0.8, 0.9, serving_inv_ms="1.1", inv_bitwise="True"),
            _row((2, 8), "1x32768", 1.0, 2.0, 2.2, 2.4, path="torch", serving_inv_ms="4.0", inv_bitwise="False")]
    md = "\n".join(SV.serving_markdown(rows, {"gpu": "NVIDIA H100 80GB HBM3", "flashinfer": "0.7.2.post1"}, "abc"))
    # 1.1 / 1.0 on the kernel path, 4.0 / 2.0 on the split plan: geometric mean sqrt(1.1 * 2) = 1.483
    assert ("batch_invariant=True over the default serving call: geometric mean +48.3% over 2 rows (worst +100.0%; "
            "kernel-path rows +10.0% over 1; split-plan rows +100.0% over 1); bitwise the same sequence moved to "
            "another batch on 1 of 2 rows") in md
    assert "| 1.100 | +10.0% |" in md and "| 4.000 | +100.0% |" in md


def test_moved_bitwise_check_detects_a_difference(monkeypatch):
    """The bench's batch-invariance gate (`_moved_bitwise`) on CPU, the reference backend in the
    kernels' place: True for the op's own batched result, False once o, the pool row or a checkpoint
    of the moved sequence differs by one ulp-sized step."""
    from types import SimpleNamespace

    import torch

    from flashqla.ops.gdn import api
    from flashqla.ops.gdn import backend as backend_mod
    from flashqla.testing import make_gdn_inputs
    from reference.gdn.cp import ReferenceCPBackend

    monkeypatch.setattr(backend_mod, "_DEFAULT", ReferenceCPBackend())
    monkeypatch.setattr(api, "check_device", lambda q: None)
    monkeypatch.setattr(api, "check_supported", lambda *a: None)
    lengths = [90, 0, 130, 70]
    d = make_gdn_inputs(T=sum(lengths), H=1, HV=2, seqlens=lengths, dtype=torch.float32, initial_state=False)
    x = SimpleNamespace(**{k: d[k] for k in ("q", "k", "v", "g", "beta", "cu_seqlens")})
    rows = torch.tensor([5, 1, 6, 2])
    pool0 = torch.randn(8, 2, 128, 128, generator=torch.Generator().manual_seed(1))
    p4 = SV.positions_quarter(lengths)
    pool, ck = pool0.clone(), torch.empty(len(p4), 2, 128, 128)
    with torch.no_grad():
        o, _ = flashqla.chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, output_final_state=True,
                                               cu_seqlens=x.cu_seqlens, state_indices=rows, state_layout="vk",
                                               checkpoint_positions=torch.tensor(p4), checkpoint_states=ck,
                                               batch_invariant=True)
        assert SV._moved_bitwise(x, rows, pool0, lengths, p4, o, pool, ck)
        for t, i in ((o, (0, sum(lengths) - 1, 1, 5)), (pool, (2, 0, 3, 4)), (ck, (len(p4) - 2, 1, 7, 7))):
            t2 = t.clone()
            t2[i] = torch.nextafter(t2[i], t2[i] + 1)
            args = {"o": o, "pool": pool, "ck": ck}
            args.update({k: t2 for k, v in args.items() if v is t})
            assert not SV._moved_bitwise(x, rows, pool0, lengths, p4, args["o"], args["pool"], args["ck"])


def test_report_only_rebuilds_the_h100_serving_page(tmp_path):
    """`--serving --report-only` rebuilds the committed H100 serving page from its CSV byte for byte
    (the measuring run's Method bullets kept), and says so when a folder has no serving CSV."""
    import subprocess
    import sys
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    res = root / "benchmarks" / "results"
    out = subprocess.run([sys.executable, "-m", "flashqla.bench", "--serving", "--report-only", "--prefix",
                          "h100-80gb-hbm3-serving", "--out-dir", str(tmp_path)], capture_output=True, text=True, cwd=root)
    assert out.returncode == 0, out.stderr
    page = "h100-80gb-hbm3-serving.md"
    assert (tmp_path / page).read_bytes() == (res / page).read_bytes()
    from flashqla.bench.serving import rebuild_serving
    with pytest.raises(SystemExit, match="serving.csv"):
        rebuild_serving(tmp_path, tmp_path / "out")

"""The checks of the redesigned entry points, found by trying awkward inputs: the backward checks its
inputs before any kernel is built, the environment settings are checked on every call, `cp_splits`
answers as the op plans, and `flashqla.faces` never imports an unrelated top-level package."""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

import flashqla
import flashqla.ops.gdn.autograd  # noqa: F401 (registers the custom ops)
from flashqla.cp.plan import cp_splits, plan_call
from flashqla.ops.gdn.kernels.sm90 import registry
from flashqla.testing import make_gdn_inputs


@pytest.fixture
def no_build(monkeypatch):
    def refuse(*a, **k):
        raise AssertionError(f"a kernel was built: {a}")

    monkeypatch.setattr(registry, "build", refuse)
    monkeypatch.setattr(registry, "build_kernels", refuse)


def _bwd_args(dtype=torch.bfloat16, **kw):
    x = make_gdn_inputs(B=1, T=70, H=1, HV=2, K=128, V=128, dtype=dtype, seqlens=[30, 40])
    A = torch.zeros(2, (70 // 64 + 2) * 64, 64, dtype=dtype)
    G = torch.zeros(2, (70 // 64 + 2) * 64)
    args = dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"].float(), beta=x["beta"].float(), A=A, g_cum_log2=G,
                do=torch.zeros_like(x["v"]), dht=None, initial_state=x["initial_state"].float(), cu_seqlens=x["cu_seqlens"])
    args.update(kw)
    return args


def test_backward_checks_before_building(no_build):
    with pytest.raises(RuntimeError, match="compute capability 9.0"):
        flashqla.chunk_gated_delta_rule_bwd(**_bwd_args())
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        flashqla.chunk_gated_delta_rule_bwd(**_bwd_args(dtype=torch.float32))
    args = _bwd_args()
    with pytest.raises(ValueError, match="^dht must be None or"):
        flashqla.chunk_gated_delta_rule_bwd(**dict(args, dht=torch.zeros(1, 2, 128, 128)))
    with pytest.raises(ValueError, match="^do must be"):
        flashqla.chunk_gated_delta_rule_bwd(**dict(args, do=args["do"][:, :10]))
    bad = torch.tensor([0, 40, 30, 70], dtype=torch.int32)
    with pytest.raises(ValueError, match="cu_seqlens must be non-decreasing"):
        flashqla.chunk_gated_delta_rule_bwd(**dict(args, cu_seqlens=bad))
    a = _bwd_args()
    with pytest.raises(RuntimeError, match="compute capability 9.0"):  # the custom op checks as well
        torch.ops.flashqla.gdn_bwd(a["q"], a["k"], a["v"], a["g"], a["beta"], a["A"], a["g_cum_log2"], a["do"], None,
                                   0.1, a["initial_state"], a["cu_seqlens"])


def test_cp_exact_setting_is_checked_on_every_call(monkeypatch, no_build):
    x = torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, 8, 1)
    monkeypatch.setenv("FLASHQLA_CP_EXACT", "junk")
    for cp in ("off", "auto", "on"):
        with pytest.raises(ValueError, match="FLASHQLA_CP_EXACT"):
            flashqla.chunk_gated_delta_rule(x, x, x, g, g, cp=cp)


def test_cp_splits_answers_as_the_op_plans():
    """With the lengths given, the forward's answer uses their longest, as the op's plan does (a batch
    whose one long sequence the equal-length assumption hides)."""
    lens = [30720, 512, 512, 1024]
    q = torch.empty(1, sum(lens), 2, 128, dtype=torch.bfloat16)
    v = torch.empty(1, sum(lens), 8, 128, dtype=torch.bfloat16)
    cu = torch.tensor([0, 30720, 31232, 31744, 32768])
    op = plan_call(q, v, cu, "auto", max_seqlen=30720).forward.split
    assert cp_splits(q, v, cu, "auto", seqlens=lens) == op
    assert cp_splits(q, v, cu, "auto", seqlens=lens) != cp_splits(q, v, cu, "auto") or op is False
    import numpy as np

    assert cp_splits(q, v, cu, "on", segment_len=np.int64(1024)) is True
    for bad in (100, 0, True, 1.5, "1024"):
        with pytest.raises(ValueError, match="segment_len"):
            cp_splits(q, v, cu, "on", segment_len=bad)
    with pytest.raises(ValueError, match="gate_chunks"):
        cp_splits(q, v, cu, "on", gate_chunks=0)
    assert cp_splits(torch.zeros(3), torch.zeros(3), None, "on") is False  # unreadable shapes: the op reports them


def test_faces_ignore_an_unrelated_top_level_package(tmp_path):
    """A plain `reference/` folder (or another project's package) in the working directory is never
    imported in place of ours."""
    (tmp_path / "reference").mkdir()
    (tmp_path / "derivations").mkdir()
    (tmp_path / "derivations" / "__init__.py").write_text("raise ImportError('a decoy was imported')\n")
    code = "from flashqla.faces import face; print(face('reference').__name__, face('derivations').__name__)"
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    out = subprocess.run([sys.executable, "-c", code], cwd=tmp_path, capture_output=True, text=True, env=env)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split() == ["flashqla.reference", "flashqla.derivations"]

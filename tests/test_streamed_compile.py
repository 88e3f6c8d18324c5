"""The streamed forward (`flashqla.ops.gdn.kernels.sm90.streamed`) on the CPU: the plain kernels are
untouched by the option, the streamed pair compiles for sm_90a, and the hand-over sits where the
memory model needs it (GPU behaviour: tests/gpu/streamed_check.py)."""

from __future__ import annotations

import re
import shutil

import pytest

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="compiling for sm_90a needs nvcc on PATH")


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_plain_kernels_have_no_streamed_code(varlen):
    """Without the option the kernels' TIR (TileLang's compile-cache key) carries no flag argument, no
    dependent-launch call and no foreign device code; with it, all three appear."""
    from flashqla.ops.gdn.kernels.sm90.prepare_v3 import prepare_v3_prim_func
    from flashqla.ops.gdn.kernels.sm90.recurrent_roles import recurrent_roles_prim_func

    for make in (lambda pdl: prepare_v3_prim_func(2, 8, 128, "bfloat16", "float32", "int32", varlen, pdl=pdl),
                 lambda pdl: recurrent_roles_prim_func(2, 8, 128, 128, "bfloat16", "int32", varlen, False, 64, pdl=pdl)):
        plain, streamed = make(False).script(), make(True).script()
        for marker in ("ready", "pdl_", "flashqla_", "pragma_import_c"):
            assert marker not in plain, marker
            assert marker in streamed, marker
        assert len(make(False).params) + 1 == len(make(True).params)


def test_streamed_recurrent_refuses_the_dual_launch():
    from flashqla.ops.gdn.kernels.sm90.recurrent_roles import recurrent_roles_prim_func

    with pytest.raises(ValueError, match="dual"):
        recurrent_roles_prim_func(2, 8, 128, 128, "bfloat16", "int32", True, True, 64, pdl=True)


def test_streamed_builds_are_checked():
    from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel
    from flashqla.ops.gdn.kernels.sm90.recurrent import build_recurrent_kernel

    with pytest.raises(ValueError, match="v3"):
        build_prepare_kernel(2, 8, 128, "bfloat16", "float32", "int32", False, "v2", True)
    with pytest.raises(ValueError, match="roles"):
        build_recurrent_kernel(2, 8, 128, 128, 64, "bfloat16", "int32", False, "overlap", False, True)


def test_streamed_keys():
    import torch

    from flashqla.ops.gdn.kernels.sm90.prepare import prepare_kernel_args
    from flashqla.ops.gdn.kernels.sm90.recurrent import recurrent_kernel_args

    k = torch.zeros(1, 100, 2, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, 100, 8, 128, dtype=torch.bfloat16)
    beta = torch.zeros(1, 100, 8)
    cu = torch.tensor([0, 40, 100], dtype=torch.int32)
    assert prepare_kernel_args(k, beta, cu, 8, streamed=True) == prepare_kernel_args(k, beta, cu, 8) + (True,)
    plain = recurrent_kernel_args(k, v, cu)
    assert recurrent_kernel_args(k, v, cu, streamed=True) == plain + (False, True)


def test_streamed_env_is_checked(monkeypatch):
    from flashqla.ops.gdn.api import STREAMED_ENV, STREAMED_MAX_CTAS, STREAMED_MAX_PREPARE_CTAS, streamed_launch

    monkeypatch.setenv(STREAMED_ENV, "yes")
    with pytest.raises(ValueError, match=STREAMED_ENV):
        streamed_launch()
    monkeypatch.setenv(STREAMED_ENV, "0")
    assert streamed_launch(1, 8, 64) is False
    monkeypatch.setenv(STREAMED_ENV, "1")
    assert streamed_launch(64, 64, 64) is True
    monkeypatch.delenv(STREAMED_ENV)  # auto: by the recurrent and the streamed prepare grids' CTAs
    assert streamed_launch(1, STREAMED_MAX_CTAS // 2, 64, S=1) is True
    assert streamed_launch(1, STREAMED_MAX_CTAS // 2 + 1, 64, S=1) is False
    assert streamed_launch(1, STREAMED_MAX_CTAS, 128, S=1) is True
    assert streamed_launch(1, 8, 64, S=STREAMED_MAX_PREPARE_CTAS // 8) is True
    assert streamed_launch(1, 8, 64, S=STREAMED_MAX_PREPARE_CTAS // 8 + 1) is False


@needs_nvcc
@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_streamed_pair_compiles_and_orders_the_hand_over(varlen):
    """Prepare: the dependent-launch trigger before any work; the slot published after the g_cum_log2
    stores, by a release store behind the full bulk-store wait, the proxy fence and a CTA barrier.
    Recurrent: the producer acquires a slot's flag after the q/k/v loads are issued and before A's and
    g_cum_log2's; the kernel ends with the grid-dependency wait. Both without spills."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel
    from flashqla.ops.gdn.kernels.sm90.recurrent import build_recurrent_kernel

    kp = build_prepare_kernel(2, 8, 128, "bfloat16", "float32", "int32", varlen, "v3", True)
    src = kp.get_kernel_source()
    body = src[src.index("__global__ void __launch_bounds__"):]
    trig = body.index("cudaTriggerProgrammaticLaunchCompletion();")
    assert trig < body.index("tma_load") and trig < body.index("tma_store")
    pub = body.index("flashqla_publish(")
    assert body.rindex("g_cum_log2[", 0, pub) < body.rindex("flashqla_writes_done();", 0, pub) < body.rindex("__syncthreads();", 0, pub)
    assert re.search(r"if \(\(\(int\)threadIdx\.x\) == 0\) \{\s*(if \([^\n]*\) \{\s*)?flashqla_publish", body)
    head = src[:src.index("__global__")]
    assert "cp.async.bulk.wait_group 0;" in head and "fence.proxy.async.global;" in head and "st.release.gpu" in head
    rep = ptxas_report(kp)
    assert rep["spill_stores"] == 0, rep

    for BV in (64, 128):
        kr = build_recurrent_kernel(2, 8, 128, 128, BV, "bfloat16", "int32", varlen, "roles", False, True)
        src = kr.get_kernel_source()
        body = src[src.index("__global__ void __launch_bounds__"):]
        wait = body.index("flashqla_wait_ready(")
        assert body.rindex("v_desc", 0, wait) < wait < body.index("A_desc", wait) < body.index("g_cum_log2_desc", wait)
        assert body.count("flashqla_wait_ready(") == 1
        assert body.rstrip().endswith("cudaGridDependencySynchronize();\n}") or \
            body.rindex("cudaGridDependencySynchronize();") > body.rindex("tma_load")
        head = src[:src.index("__global__")]
        assert "ld.acquire.gpu" in head and "__trap()" in head
        rep = ptxas_report(kr)
        assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep

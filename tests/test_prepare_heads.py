"""The prepare kernel with one value head a CTA (`prepare.pick_heads_per_cta`), on the CPU: the rule,
the keys, the builds and the kernel lists. GPU: tests/gpu/test_fwd_gpu.py (A and g_cum_log2 bitwise
equal to the G-head build, `test_one_head_prepare_matches_g_head_build`) and the forward tier, whose
short inputs take it."""

from __future__ import annotations

import shutil

import pytest
import torch

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="compiling for sm_90a needs nvcc on PATH")


#: sha256 of the default build's TIR (TileLang's compile-cache key), TileLang 0.1.15: (H, HV, varlen)
#: -> digest. First recorded before the option existed (the option left the default build's TIR as
#: it was); re-recorded at each deliberate change of the kernel (the journal's entries name them; the
#: latest: the inverse by recursive doubling in fp16).
DEFAULT_TIR_SHA256 = {
    (2, 8, True): "722534fa1e060fa25ceafb2e7f3322a92f0e6e84f73fefa7544a654e7ac1c4d3",
    (1, 2, False): "945d19efa23bde72ae845b12f2a364636ad426dda7a8f010868c6aefed10d5d5",
}


def test_default_build_tir_is_the_one_before_the_option():
    import hashlib

    import tilelang

    from flashqla.ops.gdn.kernels.sm90.prepare import _prepare_prim_func

    if tilelang.__version__ != "0.1.15":
        pytest.skip(f"digests recorded with TileLang 0.1.15, found {tilelang.__version__}")
    for (H, HV, varlen), digest in DEFAULT_TIR_SHA256.items():
        for heads in (None, HV // H):
            script = _prepare_prim_func(H, HV, 128, "bfloat16", "float32", "int32", varlen, heads_per_cta=heads).script()
            assert hashlib.sha256(script.encode()).hexdigest() == digest, (H, HV, varlen, heads)


def test_default_build_is_unchanged_and_one_head_differs():
    """heads_per_cta None or G gives the same TIR; 1 gives a grid of HV rows whose k loads read q/k
    head hb // G."""
    from flashqla.ops.gdn.kernels.sm90.prepare import _prepare_prim_func

    for varlen in (False, True):
        base = _prepare_prim_func(2, 8, 128, "bfloat16", "float32", "int32", varlen).script()
        assert _prepare_prim_func(2, 8, 128, "bfloat16", "float32", "int32", varlen, heads_per_cta=4).script() == base
        one = _prepare_prim_func(2, 8, 128, "bfloat16", "float32", "int32", varlen, heads_per_cta=1).script()
        assert one != base
        assert 'T.thread_binding(8, thread="blockIdx.y")' in one and 'T.thread_binding(2, thread="blockIdx.y")' in base
        assert "k[bidx[0], t0, by // 4, 0]" in one and "k[bidx[0], t0, by, 0]" in base
    with pytest.raises(ValueError, match="heads_per_cta"):
        _prepare_prim_func(2, 8, 128, "bfloat16", "float32", "int32", True, heads_per_cta=3)


@pytest.mark.parametrize("S,H,HV,want", [
    (33, 2, 8, 1),      # 2/8 x 2048 tokens: 66 CTAs of 4 heads -> 264 of one
    (33, 4, 16, 1),     # 4/16 x 2048: 132 -> 528
    (132, 2, 8, 1),     # 2/8 x 4 x 2048: 264 -> 1056 (the rule's edge, measured faster)
    (133, 2, 8, None),  # one slot more
    (33, 16, 32, None),  # 16/32 x 2048: 528 CTAs already, measured slower with one head
    (4, 16, 16, None),  # G == 1: nothing to split
])
def test_pick_heads_per_cta(S, H, HV, want):
    from flashqla.ops.gdn.kernels.sm90.prepare import pick_heads_per_cta

    assert pick_heads_per_cta(S, H, HV) == want


def test_keys_follow_the_slot_count():
    from flashqla.ops.gdn.kernels.sm90.prepare import prepare_kernel_args

    def key(T, cu=None, B=1, H=2, HV=8):
        k = torch.zeros(B, T, H, 128, dtype=torch.bfloat16)
        beta = torch.zeros(B, T, HV)
        return prepare_kernel_args(k, beta, cu, HV)

    short = key(2048, torch.tensor([0, 2048], dtype=torch.int32))
    assert short[-1] == 1 and len(short) == 8
    long = key(32768, torch.tensor([0, 32768], dtype=torch.int32))
    assert long == (2, 8, 128, "bfloat16", "float32", "int32", True) and short == long + (1,)
    assert key(1000, B=3)[-1] == 1  # fixed length: 3 x 16 slots x 2 q/k heads
    assert len(key(1000, B=3, H=8, HV=8)) == 7  # G == 1


def test_build_arguments_are_checked():
    from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel

    with pytest.raises(ValueError, match="heads_per_cta"):
        build_prepare_kernel(2, 8, 128, "bfloat16", "float32", "int32", True, 2)


def test_kernel_lists():
    """op_kernel_specs lists the one-head build (the call's offsets and the segments' packed int32
    ones) for G > 1 only; the backward's first use does not build it (the forward's own first use
    builds the build its slot count picks)."""
    from flashqla.ops.gdn.kernels.sm90.registry import op_kernel_specs

    for varlen, sd in ((False, "int32"), (True, "int64")):
        specs = op_kernel_specs(2, 8, varlen=varlen, seq_dtype=sd)
        one = [a for kind, a in specs if kind == "prepare" and len(a) == 8]
        # the split path runs on packed offsets in the caller's dtype (int32 for a fixed-length batch)
        assert {(a[5], a[6]) for a in one} == {(sd, varlen), (sd, True)} and all(a[-1] == 1 for a in one)
        assert not [a for kind, a in op_kernel_specs(8, 8, varlen=varlen, seq_dtype=sd) if kind == "prepare" and len(a) == 8]
        assert not [a for kind, a in op_kernel_specs(2, 8, varlen=varlen, seq_dtype=sd, one_head_prepare=False)
                    if kind == "prepare" and len(a) == 8]


def test_warmup_lists_the_one_head_build(monkeypatch):
    import flashqla
    import flashqla.ops.gdn.api as api

    seen = []
    monkeypatch.setattr(api, "build_kernels", lambda specs: seen.extend(specs))  # warmup's builder (from registry)
    flashqla.warmup(2, 8, varlen=True, backward=False)
    assert ("prepare", (2, 8, 128, "bfloat16", "float32", "int32", True, 1)) in seen


@needs_nvcc
@pytest.mark.parametrize("H,HV,varlen", [(2, 8, True), pytest.param(1, 2, False, marks=pytest.mark.compile_all),
                                         pytest.param(16, 48, True, marks=pytest.mark.compile_all)])
def test_one_head_kernel_compiles(H, HV, varlen):
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel

    kern = build_prepare_kernel(H, HV, 128, "bfloat16", "float32", "int32", varlen, 1)
    src = kern.get_kernel_source()
    assert "tma_load" in src and "tma_store" in src
    rep = ptxas_report(kern)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep

"""CPU tier: the sm_90 backward kernels lower and compile for sm_90a without a GPU (TileLang + nvcc),
with the resources and code shapes they were designed for; the kernel lists and the custom ops' fake
shapes."""

from __future__ import annotations

import shutil

import pytest
import torch

HAVE_NVCC = shutil.which("nvcc") is not None
needs_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="compiling for sm_90a needs nvcc (the CUDA toolkit) on PATH")
_all = pytest.mark.compile_all

#: Hopper's dynamic shared memory per block (227 KB).
SMEM_LIMIT = 232448


@needs_nvcc
@pytest.mark.parametrize(
    "H,HV,K,dtype,seq_dtype,varlen",
    [(2, 4, 128, "bfloat16", "int32", True), (2, 4, 128, "float16", "int32", True),
     pytest.param(1, 2, 64, "float16", "int64", False, marks=_all)],
    ids=["bf16-K128-varlen", "fp16-K128-varlen", "fp16-K64-fixed"],
)
def test_states_kernel_compiles(H, HV, K, dtype, seq_dtype, varlen):
    """Pass 1: 512 threads, the chain's two warpgroups take registers from the producer (setmaxnreg),
    k / v / A / gates by TMA, h stored by TMA from a shared tile in the inputs' dtype (fp16 inputs:
    fp16 h, the op's path), within Hopper's shared memory, no spills."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.states_bwd import NREG, build_states_kernel

    kernel = build_states_kernel(H, HV, K, 128, dtype, seq_dtype, varlen)
    src = kernel.get_kernel_source()
    assert "gdn_states_roles_bwd" in src and "__launch_bounds__(512, 1)" in src
    assert 2 * NREG["chain"] + NREG["store"] + NREG["producer"] == 512
    assert "warpgroup_reg_dealloc<24>" in src and f"warpgroup_reg_alloc<{NREG['chain']}>" in src
    for tile in ("k_desc", "v_desc", "A_desc", "g_cum_log2_desc", "h_desc"):
        assert tile in src, tile
    assert "tma_store" in src and "wgmma" in src
    # the TMA store is issued by one elected lane of a whole warp (elect.sync under a one-thread guard
    # hung the kernel on the H200)
    assert "tl_shuffle_elect<1>" not in src and "tl_shuffle_elect<32>" in src
    assert ("order[" in src) == varlen
    # every 16-bit tile, h's (sb_s, TMA-stored) included, in the inputs' dtype: fp16 inputs store fp16 h
    c_type, other = {"bfloat16": ("bfloat16_t", "half_t"), "float16": ("half_t", "bfloat16_t")}[dtype]
    assert f"{c_type} st_b[" in src and other not in src
    r = ptxas_report(kernel)
    assert r["dynamic_smem"] + r["static_smem"] <= SMEM_LIMIT and r["spill_stores"] == 0, r
    with pytest.raises(ValueError, match="states kernel needs"):
        build_states_kernel(H, HV, K, 64, dtype, seq_dtype, varlen)
    with pytest.raises(ValueError, match="states kernel needs"):
        build_states_kernel(H, HV, K, 128, "float32", seq_dtype, varlen)


@needs_nvcc
def test_finish_kernels_compile():
    from flashqla.ops.gdn.kernels.sm90.finish_bwd import build_dg_cumsum_kernel, build_gva_reduce_kernel

    assert "dg" in build_dg_cumsum_kernel(4, "int32", True).get_kernel_source()
    assert "dg" in build_dg_cumsum_kernel(4, "int64", False).get_kernel_source()
    src = build_gva_reduce_kernel(2, 4, 128, "bfloat16").get_kernel_source()
    assert "dq_hv" in src
    # 16-byte loads of the per-value-head sums and 8-byte stores of four bf16 (scalar loads, 64 rows a
    # CTA, streamed at a fraction of the memory's rate)
    assert "float4" in src and "uint2" in src, "the GVA reduction should move vectors"
    src = build_gva_reduce_kernel(2, 6, 128, "float16").get_kernel_source()
    assert src.count("*(float4*)(dq_hv") == 3, "G = 3: three loads summed per vector"


def test_registry_knows_every_kind():
    from flashqla.ops.gdn.kernels.sm90 import registry

    with pytest.raises(ValueError, match="unknown kernel kind"):
        registry.build("bogus", ())
    import importlib

    for kind, (module, name) in registry.BUILDERS.items():
        assert callable(getattr(importlib.import_module(f"flashqla.ops.gdn.kernels.sm90.{module}"), name)), kind


@pytest.mark.parametrize("dtype,beta_dtype", [("bfloat16", "float32"), ("float16", "float32"), ("float16", "float16")])
def test_bwd_specs_are_the_main_kernels_for_both_dtypes(dtype, beta_dtype):
    """bf16 and fp16 inputs run the same pass-1 / pass-2 kernels (`states_bwd`, `chunk_bwd`, h in q's
    dtype): the backward's list names them with the inputs' dtype and nothing else for passes 1 and 2."""
    from flashqla.ops.gdn.kernels.sm90 import registry

    specs = registry.bwd_specs(2, 4, 128, 128, dtype, beta_dtype, "int64", True)
    assert specs == [("states_bwd", (2, 4, 128, 128, dtype, "int64", True)),
                     ("chunk_bwd", (2, 4, 128, 128, dtype, beta_dtype, "int64", True, True)),
                     ("chunk_bwd", (2, 4, 128, 128, dtype, beta_dtype, "int64", True, False)),
                     ("dg_cumsum", (4, "int64", True))]
    assert set(registry.BUILDERS) >= {"states_bwd", "chunk_bwd"}
    assert not any("fp16" in kind for kind in registry.BUILDERS), "a per-dtype kernel kind is back"


def test_chunk_fused_bwd_checks_h_dtype():
    """Pass 2 takes h in q's dtype only (what pass 1 stores): another dtype raises before any launch."""
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_fused_bwd

    q = torch.zeros(1, 64, 1, 128, dtype=torch.float16)
    v = torch.zeros(1, 64, 2, 128, dtype=torch.float16)
    beta, g = torch.zeros(1, 64, 2), torch.zeros(2, 64)
    A = torch.zeros(2, 64, 64, dtype=torch.float16)
    h = torch.zeros(2, 128, 128, dtype=torch.bfloat16)
    with pytest.raises(TypeError, match="h must be in q's dtype"):
        chunk_fused_bwd(q, q, v, beta, A, g, h, v, None, 0.1, None)


@pytest.mark.parametrize("dtype,beta_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float32),
                                              (torch.float16, torch.float16)], ids=["bf16", "fp16", "fp16-beta16"])
def test_backward_launches_the_main_kernels_for_both_dtypes(dtype, beta_dtype, monkeypatch):
    """`Sm90Backend.bwd` (the unsplit backward, the split one's per-segment launches too) runs pass 1
    on `states_bwd` and pass 2 on `chunk_bwd` for bf16 and fp16 inputs alike, built for the inputs'
    dtype, h handed from pass 1 to pass 2 in that dtype; the builds it requests are those kernels'.
    The builders are replaced by recorders (no TileLang, no GPU)."""
    from flashqla.ops.gdn import backend as be
    from flashqla.ops.gdn.kernels.sm90 import chunk_bwd, registry, states_bwd

    calls, requested = [], []
    monkeypatch.setattr(registry, "build_once", lambda key, specs: requested.extend(specs))

    def recorder(kind):
        def builder(*key):
            return lambda *args: calls.append((kind, key, [a for a in args if isinstance(a, torch.Tensor)]))
        return builder

    monkeypatch.setattr(states_bwd, "build_states_kernel", recorder("states_bwd"))
    monkeypatch.setattr(chunk_bwd, "build_chunk_bwd_kernel", recorder("chunk_bwd"))
    monkeypatch.setattr(be, "chunk_finish_bwd", lambda dG, dq_hv, dk_hv, cu, H, dt: (dq_hv, dk_hv, dG))
    T, H, HV = 130, 2, 4
    cu = torch.tensor([0, 70, 130], dtype=torch.int32)
    S = T // 64 + 2
    q = torch.zeros(1, T, H, 128, dtype=dtype)
    v = torch.zeros(1, T, HV, 128, dtype=dtype)
    g, beta = torch.zeros(1, T, HV), torch.zeros(1, T, HV, dtype=beta_dtype)
    A, gc = torch.zeros(HV, S * 64, 64, dtype=dtype), torch.zeros(HV, S * 64)
    h0 = torch.zeros(2, HV, 128, 128)
    be.Sm90Backend().bwd(q, q, v, g, beta, A, gc, v, None, 0.1, h0, cu)
    dt, bdt = {torch.bfloat16: "bfloat16", torch.float16: "float16"}[dtype], str(beta_dtype).split(".")[1]
    assert [c[0] for c in calls] == ["states_bwd", "chunk_bwd"]
    (_, skey, sargs), (_, ckey, cargs) = calls
    assert skey == (H, HV, 128, 128, dt, "int32", True)
    assert ckey == (H, HV, 128, 128, dt, bdt, "int32", True, True)
    h = sargs[-1]  # pass 1's output, pass 2's seventh tensor
    assert h.dtype == dtype and h.shape == (S * HV, 128, 128) and cargs[6] is h
    assert {k for k, _ in requested} == {"states_bwd", "chunk_bwd", "dg_cumsum", "gva_reduce"}
    assert ("states_bwd", skey) in requested and ("chunk_bwd", ckey) in requested


def test_custom_ops_fake_shapes_on_meta():
    """The torch.library fake implementations (what torch.compile traces) give the kernels' output
    shapes and dtypes: fixed length and packed, with and without states."""
    import flashqla.ops.gdn.autograd  # noqa: F401 - registers flashqla::gdn_fwd / gdn_bwd

    m = dict(device="meta")
    for B, T, cu, N in ((2, 130, None, 2), (1, 300, torch.tensor([0, 5, 5, 300], **m), 3)):
        q = torch.empty(B, T, 2, 128, dtype=torch.bfloat16, **m)
        v = torch.empty(B, T, 4, 128, dtype=torch.bfloat16, **m)
        g = torch.empty(B, T, 4, **m)
        h0 = torch.empty(N, 4, 128, 128, **m)
        S = B * 3 if cu is None else 300 // 64 + 3
        o, ht, A, gc = torch.ops.flashqla.gdn_fwd(q, q, v, g, g, 0.1, h0, True, cu)
        assert o.shape == v.shape and o.dtype == torch.bfloat16
        assert ht.shape == (N, 4, 128, 128) and ht.dtype == torch.float32
        assert A.shape == (4, S * 64, 64) and A.dtype == torch.bfloat16
        assert gc.shape == (4, S * 64) and gc.dtype == torch.float32
        _, ht, _, _ = torch.ops.flashqla.gdn_fwd(q, q, v, g, g, 0.1, None, False, cu)
        assert ht.numel() == 0
        dq, dk, dv, dg, dbeta, dh0 = torch.ops.flashqla.gdn_bwd(q, q, v, g, g, A, gc, v, h0, 0.1, h0, cu)
        assert dq.shape == q.shape and dv.shape == v.shape and dg.dtype == torch.float32
        assert dbeta.shape == g.shape and dh0.shape == h0.shape
        # an initial state whose gradient autograd does not need: no dh0
        *_, dh0 = torch.ops.flashqla.gdn_bwd(q, q, v, g, g, A, gc, v, h0, 0.1, h0, cu, "off", None, False)
        assert dh0.numel() == 0


def test_public_op_with_gradients_needs_a_hopper_gpu():
    import flashqla

    x = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16, requires_grad=True)
    g = torch.zeros(1, 4, 1)
    with pytest.raises(RuntimeError, match="CUDA device of compute capability 9.0"):
        flashqla.chunk_gated_delta_rule(x, x, x, g, g)


@pytest.mark.parametrize("varlen", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_op_kernel_specs_match_the_launch_keys(varlen, dtype):
    """`op_kernel_specs` (what warmup and precompiling use) names exactly the kernels a call builds."""
    from flashqla.ops.gdn.kernels.sm90._common import tl_dtype
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_bwd_kernel_args
    from flashqla.ops.gdn.kernels.sm90.prepare import prepare_kernel_args
    from flashqla.ops.gdn.kernels.sm90.recurrent import recurrent_kernel_args
    from flashqla.ops.gdn.kernels.sm90.registry import op_kernel_specs
    from flashqla.ops.gdn.kernels.sm90.states_bwd import states_kernel_args

    q = torch.empty(1, 10, 2, 128, dtype=dtype)
    v = torch.empty(1, 10, 4, 128, dtype=dtype)
    beta = torch.empty(1, 10, 4)
    cu = torch.tensor([0, 3, 10]) if varlen else None
    N = 2 if varlen else 1
    dt = tl_dtype(dtype)
    listed = op_kernel_specs(2, 4, N=N, varlen=varlen, dtype=dt, seq_dtype="int64" if varlen else "int32")
    specs = dict(s for s in listed if not (s[0] == "recurrent" and len(s[1]) != 8))  # the plain launch's key
    assert ("prepare", prepare_kernel_args(q, beta, cu, 4)) in listed
    assert specs["recurrent"] == recurrent_kernel_args(q, v, cu)
    # the split path on the segments' packed offsets (int32 for a fixed-length batch): the prepare
    # kernel and the dual launch at both value slice widths
    pcu = torch.tensor([0, 3, 10], dtype=torch.int64 if varlen else torch.int32)
    assert ("prepare", prepare_kernel_args(q, beta, pcu, 4)) in listed
    for bv in (64, 128):
        assert ("recurrent", recurrent_kernel_args(q, v, pcu, bv, dual=True)) in listed
    # passes 1 and 2 on the input's offsets and (split path) on the segments' packed offsets, for a call
    # returning dh0 and for one that does not; bf16 and fp16 alike (h in q's dtype)
    for offsets in (cu, pcu):
        sd = "int32" if offsets is None else tl_dtype(offsets.dtype)
        assert ("states_bwd", states_kernel_args(q, v, offsets)) in listed
        assert states_kernel_args(q, v, offsets)[4] == dt
        for dh0 in (True, False):
            assert ("chunk_bwd", chunk_bwd_kernel_args(q, v, beta, offsets, dh0)) in listed
        assert ("dg_cumsum", (4, sd, offsets is not None)) in listed
    assert specs["gva_reduce"] == (2, 4, 128, dt)
    assert ("gva_reduce", (4, 4, 128, dt)) in op_kernel_specs(4, 4, N=N, varlen=varlen, dtype=dt)
    # the opt-in fp16 A_beta product (bf16 input only): prepare, the plain launch and the dual launch at
    # both widths, on the input's and the segments' offsets; not listed by default
    assert not [s for s in listed if s[1][-1] == "float16" and s[0] in ("prepare", "recurrent") and dtype == torch.bfloat16]
    listed = op_kernel_specs(2, 4, N=N, varlen=varlen, dtype=dt, seq_dtype="int64" if varlen else "int32",
                             fp16_products=True)
    f16 = [s for s in listed if s[1][-1] == "float16" and s[0] in ("prepare", "recurrent")]
    if dtype == torch.bfloat16:
        a16 = torch.float16
        for offsets in (cu, pcu):
            assert ("prepare", prepare_kernel_args(q, beta, offsets, 4, a16)) in listed
        assert ("recurrent", recurrent_kernel_args(q, v, cu, a_dtype=a16)) in listed
        for bv in (64, 128):
            assert ("recurrent", recurrent_kernel_args(q, v, pcu, bv, dual=True, a_dtype=a16)) in listed
        # the one-value-head prepare builds (G = 2 here) in fp16 too
        assert {s[1][7] for s in f16 if s[0] == "prepare"} == {None, 1}
    else:
        assert not f16


def test_cp_mode_is_checked_before_device_work(monkeypatch):
    import flashqla
    from flashqla.contract import CP_ENV, cp_mode

    monkeypatch.delenv(CP_ENV, raising=False)
    assert cp_mode(None) == "auto" and cp_mode("off") == "off"
    monkeypatch.setenv(CP_ENV, "on")
    assert cp_mode(None) == "on"
    x = torch.zeros(1, 4, 1, 128, dtype=torch.bfloat16)
    g = torch.zeros(1, 4, 1)
    with pytest.raises(ValueError, match="cp must be"):
        flashqla.chunk_gated_delta_rule(x, x, x, g, g, cp="sometimes")
    monkeypatch.setenv(CP_ENV, "bogus")
    with pytest.raises(ValueError, match="cp must be"):
        flashqla.chunk_gated_delta_rule(x, x, x, g, g)


def _ptxas_log(kernel) -> str:
    """ptxas's verbose output (warnings included) for a kernel's generated source, sm_90a; the same
    command as `_common.ptxas_report`."""
    import os
    import subprocess
    import tempfile

    from tilelang import env

    with tempfile.TemporaryDirectory() as d:
        path = os.path.join(d, "k.cu")
        with open(path, "w") as f:
            f.write(kernel.get_kernel_source())
        cmd = ["nvcc", "-std=c++20", f"-I{env.TILELANG_TEMPLATE_PATH}", f"-I{env.CUTLASS_INCLUDE_DIR}", "--use_fast_math",
               "-gencode", "arch=compute_90a,code=sm_90a", "-cubin", "-o", os.path.join(d, "k.cubin"),
               "--ptxas-options=--verbose", "-w", path]
        out = subprocess.run(cmd, capture_output=True, text=True, check=True)
    return out.stdout + out.stderr


# ----------------------------------------------------------------------------------------------
# pass 2 (`chunk_bwd.py`): role warpgroups and a TMA producer warp
# ----------------------------------------------------------------------------------------------

#: spill bytes of pass 2 allowed (ptxas, sm_90a, this test's H = 1, HV = 2 builds): a budget, not a
#: target (C751x, wgmma serialised for want of registers, is what costs time, and is checked apart)
CHUNK_BWD_SPILL_BUDGET = 256


@needs_nvcc
@pytest.mark.parametrize("dtype,beta_dtype,seq_dtype,varlen,dh0", [
    ("bfloat16", "float32", "int32", True, True), pytest.param("bfloat16", "float32", "int32", True, False, marks=_all),
    pytest.param("bfloat16", "float32", "int32", False, True, marks=_all),
    pytest.param("bfloat16", "float32", "int32", False, False, marks=_all),
    pytest.param("float16", "float32", "int32", True, True, marks=_all),
    pytest.param("float16", "float16", "int64", False, True, marks=_all),
], ids=["packed-dh0", "packed", "fixed-dh0", "fixed", "fp16-packed-dh0", "fp16-beta16-i64-fixed-dh0"])
def test_chunk_bwd_kernel_compiles(dtype, beta_dtype, seq_dtype, varlen, dh0):
    """Pass 2 lowers and compiles for sm_90a: 512 threads, the producer gives back registers
    (setmaxnreg dec 24) and the three roles take them (packed builds K 176 / A 152, fixed-length ones
    184 / 144), the four counts summing to the launch's 4 x 128; every tile by TMA after the first
    (masked) chunk, h included (in q's dtype: bf16 and fp16 inputs run this kernel); within Hopper's
    shared memory; no wgmma serialisation; spills within budget; the rows of no sequence zeroed
    in-kernel for packed input; dq and dk per value head in fp32."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import NREG_BY_VARLEN, build_chunk_bwd_kernel

    NREG = NREG_BY_VARLEN[varlen]
    kernel = build_chunk_bwd_kernel(1, 2, 128, 128, dtype, beta_dtype, seq_dtype, varlen, dh0)
    src = kernel.get_kernel_source()
    assert "gdn_chunk_bwd_v5" in src and "__launch_bounds__(512, 1)" in src
    assert sum(NREG.values()) == 512 and NREG["P"] == 24
    assert "warpgroup_reg_dealloc<24>" in src
    for role in ("S", "K", "A"):
        assert f"warpgroup_reg_alloc<{NREG[role]}>" in src
    for tile in ("q_desc", "k_desc", "v_desc", "do_desc", "h_desc", "A_desc", "g_cum_log2_desc"):
        assert tile in src, tile
    assert "wgmma" in src
    assert ("s_done" in src) == varlen, "packed builds publish D early (option d), guarded by s_done"
    if varlen:
        assert "(Np1 - 2)" in src and "cu_seqlens[0]" in src, "rows of no sequence must be zeroed in-kernel"
        assert "order[" in src and "use_order" in src, "the launch order (`launch_order.launch_order`) is read"
    assert "float* __restrict__ dq_hv" in src and "float* __restrict__ dk_hv" in src
    r = ptxas_report(kernel)
    log = _ptxas_log(kernel)
    assert "C751" not in log, "ptxas serialised wgmma: " + log
    assert r["dynamic_smem"] is not None and r["dynamic_smem"] + r["static_smem"] <= SMEM_LIMIT, r
    assert r["spill_stores"] <= CHUNK_BWD_SPILL_BUDGET, r


def test_chunk_bwd_options():
    """The per-build options (packed "dag", fixed-length none, and "l" added when the call returns
    dh0), the key's dh0, and the prim func's own check of its options; each option changes the TIR."""
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import DEFAULT_OPTS, DH0_OPTS, OPTS, _chunk_bwd_prim_func, build_options

    assert OPTS == "dagl" and DEFAULT_OPTS == {True: "dag", False: ""} and DH0_OPTS == "l"
    assert build_options(True, True) == "dagl" and build_options(True, False) == "dag"
    assert build_options(False, True) == "l" and build_options(False, False) == ""
    key = (1, 2, 128, 128, "bfloat16", "float32", "int32", True)
    for bad in ("x", "g", "dg", "p"):
        with pytest.raises(ValueError, match="options"):
            _chunk_bwd_prim_func(*key, opts=bad)
    with pytest.raises(ValueError, match="K = V = 128"):
        _chunk_bwd_prim_func(1, 2, 64, 128, "bfloat16", "float32", "int32", True, opts="")
    # the options change the kernel: D published early (a second d_ready arrival site) and S's reads of
    # the partial rows awaited before K and A write the next chunk's (s_done), async wgmma in K
    plain, ag, dag = (_chunk_bwd_prim_func(*key, opts=o).script() for o in ("", "ag", "dag"))
    assert plain.count("wait_wgmma") == 0 and ag.count("wait_wgmma") >= 3
    assert dag.count("d_ready") > plain.count("d_ready") and ag.count("d_ready") == plain.count("d_ready")
    assert "s_done" in dag and "s_done" not in ag and "s_done" not in plain
    # "l": S's Q^T (scale diag(gamma) dO) twice over w_s (hi, then the remainder), both before dog_read
    lo = _chunk_bwd_prim_func(*key, opts="l").script()
    q_w = "T.region(q_s[0, 0], 1, 64, 128), T.region(w_s[0, 0]"
    assert lo.count(q_w) == 2 and plain.count(q_w) == dag.count(q_w) == 1
    # S frees g_s (e_g: the producer then loads the next chunk's g there) after its last read of it:
    # with "l" that is the remainder's loop, after the first product; without, before the product
    e_g = "T.ptx_arrive_barrier(e_g"
    first = lo.index(q_w)
    s_arrive = lo.rindex(e_g, 0, lo.index(q_w, first + 1))
    assert first < s_arrive and "g_s[" in lo[first:s_arrive]
    assert "g_s[" not in lo[s_arrive:lo.index(q_w, first + 1)]
    assert plain.rindex(e_g, 0, plain.index(q_w)) > plain.rindex("g_s[", 0, plain.index(q_w))

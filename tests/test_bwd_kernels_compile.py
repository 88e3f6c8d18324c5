"""CPU tier: the sm_90 backward kernels (experimental; `flashqla/ops/gdn/kernels/sm90/NOTES-bwd.md`)
lower and compile for sm_90a without a GPU (TileLang + nvcc), and the experimental backward refuses
to run unless opted in."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

HAVE_NVCC = shutil.which("nvcc") is not None
needs_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="compiling for sm_90a needs nvcc (the CUDA toolkit) on PATH")

#: Hopper's dynamic shared memory per block (227 KB).
SMEM_LIMIT = 232448


def _smem_high_water(src: str) -> int:
    """Largest byte offset into the dynamic shared-memory buffer in the generated source (a lower
    bound of the kernel's dynamic shared memory; the last buffer's size is not added)."""
    offs = [int(m) for m in re.findall(r"buf_dyn_shmem \+ (\d+)", src)]
    offs += [int(m) for m in re.findall(r"\(\(uchar\*\)buf_dyn_shmem\)\[(\d+)\]", src)]
    return max(offs, default=0)


@needs_nvcc
@pytest.mark.parametrize(
    "h_dtype,seq_dtype,varlen", [("bfloat16", "int32", True), ("float32", "int32", False)], ids=["h-bf16-varlen", "h-fp32-fixed"]
)
def test_states_kernel_compiles(h_dtype, seq_dtype, varlen):
    from flashqla.ops.gdn.kernels.sm90.states_bwd import build_states_kernel

    src = build_states_kernel(2, 4, 128, 128, "bfloat16", h_dtype, seq_dtype, varlen).get_kernel_source()
    assert "wgmma" in src and "exp2" in src
    # packed batches: the sequence of a CTA comes from the launch order when one is given
    assert ("order[" in src) == varlen


@needs_nvcc
@pytest.mark.parametrize(
    "H,HV,K,dtype,seq_dtype,varlen",
    [(2, 4, 128, "bfloat16", "int32", True), (1, 2, 64, "float16", "int64", False)],
    ids=["bf16-K128-varlen", "fp16-K64-fixed"],
)
def test_states_roles_kernel_compiles(H, HV, K, dtype, seq_dtype, varlen):
    """The role-split states kernel (the default schedule where it applies): 512 threads, the chain's two
    warpgroups take registers from the producer (setmaxnreg), k / v / A / gates by TMA, h stored by TMA
    from a shared tile, within Hopper's shared memory, no spills; the serial schedule stays selectable."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.states_bwd import build_states_kernel, resolve_schedule
    from flashqla.ops.gdn.kernels.sm90.states_roles import NREG

    assert resolve_schedule("roles", K, 128, dtype, dtype) == "roles"
    kernel = build_states_kernel(H, HV, K, 128, dtype, dtype, seq_dtype, varlen, "roles")
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
    r = ptxas_report(kernel)
    assert r["dynamic_smem"] + r["static_smem"] <= SMEM_LIMIT and r["spill_stores"] == 0, r
    serial = build_states_kernel(H, HV, K, 128, dtype, dtype, seq_dtype, varlen, "serial").get_kernel_source()
    assert "gdn_states_bwd" in serial and "roles" not in serial
    if resolve_schedule(None, K, 128, dtype, dtype) == "roles":  # the default (no FLASHQLA_STATES_SCHEDULE)
        assert build_states_kernel(H, HV, K, 128, dtype, dtype, seq_dtype, varlen).get_kernel_source() == src


def test_states_schedule_resolution():
    from flashqla.ops.gdn.kernels.sm90.states_bwd import resolve_schedule

    assert resolve_schedule("roles", 128, 128, "bfloat16", "float32") == "serial"  # h fp32: serial kernel
    assert resolve_schedule("roles", 128, 64, "bfloat16", "bfloat16") == "serial"  # V = 64
    assert resolve_schedule("serial", 128, 128, "bfloat16", "bfloat16") == "serial"
    with pytest.raises(ValueError, match="FLASHQLA_STATES_SCHEDULE"):
        resolve_schedule("fast", 128, 128, "bfloat16", "bfloat16")


def test_states_kernel_rejects_h_dtype():
    from flashqla.ops.gdn.kernels.sm90.states_bwd import build_states_kernel

    with pytest.raises(ValueError, match="h_dtype"):
        build_states_kernel(2, 4, 128, 128, "bfloat16", "int32", "int32", False)


@needs_nvcc
@pytest.mark.parametrize(
    "dtype,h_dtype,beta_dtype,seq_dtype,varlen",
    [("bfloat16", "bfloat16", "float32", "int32", True), ("float16", "float32", "float16", "int64", False)],
    ids=["bf16-hbf16-varlen", "fp16-hfp32-fixed"],
)
def test_chunk_bwd_kernel_compiles(dtype, h_dtype, beta_dtype, seq_dtype, varlen):
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import build_chunk_bwd_kernel

    src = build_chunk_bwd_kernel(1, 2, 128, 128, dtype, h_dtype, beta_dtype, seq_dtype, varlen).get_kernel_source()
    assert "wgmma" in src and "exp2" in src
    assert _smem_high_water(src) < SMEM_LIMIT, "shared memory over Hopper's 227 KB per block"


@needs_nvcc
def test_finish_kernels_compile():
    from flashqla.ops.gdn.kernels.sm90.finish_bwd import build_dg_cumsum_kernel, build_gva_reduce_kernel

    assert "dg" in build_dg_cumsum_kernel(4, "int32", True).get_kernel_source()
    assert "dg" in build_dg_cumsum_kernel(4, "int64", False).get_kernel_source()
    src = build_gva_reduce_kernel(2, 4, 128, "bfloat16").get_kernel_source()
    assert "dq_hv" in src
    # 16-byte loads of the per-value-head sums and 8-byte stores of four bf16 (scalar loads, 64 rows a
    # CTA, streamed at ~0.9 TB/s at 2/4 heads on the H200)
    assert "float4" in src and "uint2" in src, "the GVA reduction should move vectors"
    src = build_gva_reduce_kernel(2, 6, 128, "float16").get_kernel_source()
    assert src.count("*(float4*)(dq_hv") == 3, "G = 3: three loads summed per vector"
    # from pass-2 v5's per-value-head dq / dk in q's dtype: vector loads of bf16, summed in fp32
    src = build_gva_reduce_kernel(2, 4, 128, "bfloat16", "bfloat16").get_kernel_source()
    assert "bfloat16_t* __restrict__ dq_hv" in src or "bfloat16_t* dq_hv" in src, src[:2000]
    assert "float4" in src or "uint4" in src or "uint2" in src, "the GVA reduction should move vectors"


def test_build_kernels_knows_the_backward_kinds():
    from flashqla.ops.gdn.kernels import sm90

    with pytest.raises(ValueError, match="unknown kernel kind"):
        sm90._build("bogus", ())


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
def test_op_kernel_specs_match_the_launch_keys(varlen):
    """`op_kernel_specs` (what precompiling uses) names exactly the kernels a call builds."""
    from flashqla.ops.gdn.kernels.sm90 import op_kernel_specs
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import chunk_bwd_kernel_args
    from flashqla.ops.gdn.kernels.sm90.prepare import prepare_kernel_args
    from flashqla.ops.gdn.kernels.sm90.recurrent import recurrent_kernel_args
    from flashqla.ops.gdn.kernels.sm90.states_bwd import states_kernel_args

    q = torch.empty(1, 10, 2, 128, dtype=torch.bfloat16)
    v = torch.empty(1, 10, 4, 128, dtype=torch.bfloat16)
    beta = torch.empty(1, 10, 4)
    cu = torch.tensor([0, 3, 10]) if varlen else None
    h = torch.empty(1, dtype=torch.bfloat16)
    N = 2 if varlen else 1
    listed = op_kernel_specs(2, 4, N=N, varlen=varlen, seq_dtype="int64" if varlen else "int32")
    specs = dict(s for s in listed if not (s[0] == "recurrent" and len(s[1]) == 10))  # the plain launch's key
    assert ("prepare", prepare_kernel_args(q, beta, cu, 4)) in listed
    assert specs["recurrent"] == recurrent_kernel_args(q, v, cu)
    # the split path on the segments' packed offsets (int32 for a fixed-length batch): the prepare
    # kernel and the dual launch at both value slice widths
    pcu = torch.tensor([0, 3, 10], dtype=torch.int64 if varlen else torch.int32)
    assert ("prepare", prepare_kernel_args(q, beta, pcu, 4)) in listed
    for bv in (64, 128):
        assert ("recurrent", recurrent_kernel_args(q, v, pcu, bv, dual=True)) in listed
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import DEFAULT_VARIANT, pass2_variant

    # passes 1 and 2 on the input's offsets and (split path) on the segments' packed offsets, pass 2 in
    # the variant the op runs (a spec without it built "v1", which the op never launched), for a call
    # returning dh0 and for one that does not
    for offsets in (cu, pcu):
        assert ("states_bwd", states_kernel_args(q, v, offsets, torch.bfloat16)) in listed
        for dh0 in (True, False):
            variant = pass2_variant(offsets is not None, dh0)
            assert ("chunk_bwd", chunk_bwd_kernel_args(q, v, beta, h, offsets) + (variant,)) in listed
        assert ("dg_cumsum", (4, "int64" if varlen else "int32", offsets is not None)) in listed
    assert specs["gva_reduce"] == (2, 4, 128, "bfloat16")
    # v5 under $FLASHQLA_BWD_QK_DTYPE=input hands over dq / dk per value head in q's dtype: the GVA sum
    # reads bf16; with HV == H nothing is reduced (pass 2's outputs are dq and dk)
    with pytest.MonkeyPatch.context() as mp:
        mp.setenv("FLASHQLA_BWD_QK_DTYPE", "input")
        listed = dict(op_kernel_specs(2, 4, N=N, varlen=varlen, seq_dtype="int64" if varlen else "int32"))
        same = dict(op_kernel_specs(4, 4, N=N, varlen=varlen, seq_dtype="int64" if varlen else "int32"))
    if DEFAULT_VARIANT.startswith("v5"):
        assert listed["gva_reduce"] == (2, 4, 128, "bfloat16", "bfloat16") and "gva_reduce" not in same
    assert "gva_reduce" in dict(op_kernel_specs(4, 4, N=N, varlen=varlen))


def test_cp_mode_is_checked_before_device_work(monkeypatch):
    import flashqla
    from flashqla.ops.gdn.api import CP_ENV, cp_mode

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


# ----------------------------------------------------------------------------------------------
# pass 2, variant v2 (`chunk_bwd_v2.py`; the default for h stored in fp32, where v5 does not apply)
# ----------------------------------------------------------------------------------------------

#: measured spill bytes of v2 (ptxas, sm_90a, this test's H = 1, HV = 2 build): 16 B (four
#: loop-invariant scalars) until the gates moved into per-chunk register fragments (g at the rows and
#: columns of the [64, 64] accumulator, beta, gamma and r at the rows of the [64, 128] ones): 52 B
#: since, and that build ran bitwise equal to the previous one and 1.10-1.18x faster on the H200
#: (NOTES-bwd.md, "Gates in registers"). With h stored fp32 the consumers' h load and rounding add
#: more (204 B before, 280 B since). The exact diagonal of A diag(beta) in dv (delta = beta - beta
#: rounded, at the rows of the [64, 128] accumulators; compiled out when beta is in q's dtype, as in
#: the fp16 build) raised the bf16 build's to 80 B; with fp32 h and fp32 beta (the diagonal compiled
#: in) 432 B, measured when that build joined this test. Forming each shared term once (v2b, folded
#: into v2) took the bf16 build to 52 B and the fp16 / fp32-h one from 280 to 320 B. A budget, not a
#: target: the test fails if the schedule's register pressure grows further.
V2_SPILL_BUDGET = {"bf16-hbf16-varlen": 80, "fp16-hfp32-fixed": 320, "bf16-hfp32-fixed": 432}


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


@needs_nvcc
@pytest.mark.parametrize(
    "dtype,h_dtype,beta_dtype,seq_dtype,varlen",
    [("bfloat16", "bfloat16", "float32", "int32", True), ("float16", "float32", "float16", "int64", False),
     ("bfloat16", "float32", "float32", "int32", False)],
    ids=["bf16-hbf16-varlen", "fp16-hfp32-fixed", "bf16-hfp32-fixed"],
)
def test_chunk_bwd_v2_kernel_compiles(dtype, h_dtype, beta_dtype, seq_dtype, varlen):
    """v2 lowers and compiles for sm_90a: TMA loads by a producer warpgroup (setmaxnreg 24 / 240),
    wgmma issued without an implicit wait, within Hopper's shared memory, no wgmma serialisation
    (C751x), spills within the measured budget; the tiles the consumers zero past a sequence end
    are written only after their TMA loads were waited for."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import build_chunk_bwd_kernel

    kernel = build_chunk_bwd_kernel(1, 2, 128, 128, dtype, h_dtype, beta_dtype, seq_dtype, varlen, "v2")
    src = kernel.get_kernel_source()
    assert "tma_load" in src and "wgmma" in src and "exp2" in src
    assert "warpgroup_reg_dealloc<24>" in src and "warpgroup_reg_alloc<240>" in src
    assert ("h_desc" in src) == (h_dtype == dtype), "h comes by TMA exactly when it is stored in q's dtype"
    assert src.count("wait_wgmma<") >= 15, "the products should be issued asynchronously and waited explicitly"
    assert "AllReduce" in src and "run_batch" in src
    # the pipeliner waits for a tile's TMA before the first statement that reads it and does not count
    # the consumers' zeroing of rows past a sequence end as a use: each zeroing must follow a wait
    consumer = src[src.index("warpgroup_reg_alloc<240>"):]
    first_mask = consumer.index("if (nvalid < 64)")
    assert consumer[:first_mask].count(".wait(") >= 3, "rows zeroed before the q / k tiles arrived"
    # the consumers are threads 128-383: a statement guarded by `threadIdx.x < 256` runs in the first
    # consumer warpgroup only (TileLang 0.1.15 emitted that guard for a fully replicated reducer's
    # per-thread init, so the second warpgroup's partials of dG's chunk-end scalars were never cleared)
    assert "threadIdx.x) < 256)" not in consumer, "per-thread state initialised by one consumer warpgroup only"
    if varlen:
        # the last sequence's CTA zeroes the rows past cu_seqlens[-1], the first one's those before cu_seqlens[0]
        assert "(Np1 - 2)" in src and "cu_seqlens[0]" in src, "rows of no sequence must be zeroed in-kernel"
    r = ptxas_report(kernel)
    log = _ptxas_log(kernel)
    assert "C751" not in log, "ptxas serialised wgmma: " + log
    assert r["dynamic_smem"] is not None and r["dynamic_smem"] + r["static_smem"] <= SMEM_LIMIT
    build = f"{'bf16' if dtype == 'bfloat16' else 'fp16'}-h{'bf16' if h_dtype == 'bfloat16' else 'fp32'}-{'varlen' if varlen else 'fixed'}"
    assert r["spill_stores"] <= V2_SPILL_BUDGET[build], r


def test_chunk_bwd_variant_is_checked():
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import DEFAULT_VARIANT, VARIANTS, build_chunk_bwd_kernel, chunk_fused_bwd

    assert VARIANTS == ("v1", "v2", "v5")
    assert DEFAULT_VARIANT == "v5" or __import__("os").environ.get("FLASHQLA_BWD_VARIANT")  # v5 since its H200 check
    with pytest.raises(ValueError, match="variant"):
        build_chunk_bwd_kernel(1, 2, 128, 128, "bfloat16", "bfloat16", "float32", "int32", True, "v9")
    x = torch.zeros(1, 1, 1, 128)
    with pytest.raises(ValueError, match="variant"):
        chunk_fused_bwd(x, x, x, x, x, x, x, x, None, 1.0, None, variant="v9")
    # v5 with build options: letters of chunk_bwd_v5.OPTS, "g" only with "a"
    for bad in ("v5:x", "v5:g", "v5:dg", "v5:p"):
        with pytest.raises(ValueError, match="variant"):
            build_chunk_bwd_kernel(1, 2, 128, 128, "bfloat16", "bfloat16", "float32", "int32", True, bad)


def test_chunk_bwd_v5_options():
    """The per-build default options (packed "dag", fixed-length none, and "l" added when the call
    returns dh0: measured on the H200), the option names in the compile key, the variant names the op's
    kernel lists resolve to, and the prim func's own check of its options."""
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import _v5_opts, _variant
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v5 import DEFAULT_OPTS, OPTS, _chunk_bwd_v5_prim_func, canonical_opts

    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import DEFAULT_VARIANT, pass2_variant
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v5 import DH0_OPTS

    assert OPTS == "dagl" and DEFAULT_OPTS == {True: "dag", False: ""} and DH0_OPTS == "l"
    assert pass2_variant(True, True) == "v5:dagl" and pass2_variant(True, False) == "v5:dag"
    assert pass2_variant(False, True) == "v5:l" and pass2_variant(False, False) == "v5:"
    assert pass2_variant(True, True, "v2") == "v2" and pass2_variant(False, False, "v5:a") == "v5:a"
    assert _v5_opts("v5") is None and _v5_opts("v5:") == "" and _v5_opts("v5:da") == "da"
    assert _variant("v5:dag") == "v5:dag" and _variant("v5:") == "v5:"
    # one compiled name per kernel: defaults resolved, letters once each in OPTS order
    assert canonical_opts(None, True) == "dagl" and canonical_opts(None, False) == "l"  # dh0 returned
    assert canonical_opts(None, True, dh0=False) == "dag" and canonical_opts(None, False, dh0=False) == ""
    assert canonical_opts("gad", True) == canonical_opts("ddag", False) == "dag" and canonical_opts("ga", True) == "ag"
    assert canonical_opts("lgad", True) == "dagl" and canonical_opts("l", False) == "l"
    with pytest.raises(ValueError, match="options"):
        _chunk_bwd_v5_prim_func(1, 2, 128, 128, "bfloat16", "bfloat16", "float32", "int32", True, opts="g")
    # the options change the kernel: D published early (a second d_ready arrival site) and S's reads of
    # the partial rows awaited before K and A write the next chunk's (s_done), async wgmma in K
    key = (1, 2, 128, 128, "bfloat16", "bfloat16", "float32", "int32", True)
    plain, ag, dag = (_chunk_bwd_v5_prim_func(*key, opts=o).script() for o in ("", "ag", "dag"))
    assert plain.count("wait_wgmma") == 0 and ag.count("wait_wgmma") >= 3
    assert dag.count("d_ready") > plain.count("d_ready") and ag.count("d_ready") == plain.count("d_ready")
    assert "s_done" in dag and "s_done" not in ag and "s_done" not in plain
    # "l": S's Q^T (scale diag(gamma) dO) twice over w_s (hi, then the remainder), both before dog_read
    lo = _chunk_bwd_v5_prim_func(*key, opts="l").script()
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


@needs_nvcc
def test_chunk_bwd_v2_forms_each_shared_term_once():
    """Pass 2 (v2): the three element loops that add one term to two sums (dG's rows and columns of
    dL * L and of Z; the r-terms of dG and their chunk-end total) form it once. Written as two
    updates, the generated code formed the product twice, with two swizzled reads of k, Kg or Pg
    (before, this build read k_s 14, Kg 6 and Pg 7 times; NOTES-bwd.md, "Pass-2 variant v2b": bitwise the same
    gradients on the H200, pass 2 1.01-1.05x faster)."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import build_chunk_bwd_kernel

    key = (1, 2, 128, 128, "bfloat16", "bfloat16", "float32", "int32", True)
    src = build_chunk_bwd_kernel(*key, "v2").get_kernel_source()
    reads = {tile: src.count(f"((bfloat16_t*)({tile}") + src.count(f"((bfloat16_t*){tile})") for tile in ("k_s", "kg_s", "pg_s")}
    assert reads["k_s"] <= 13 and reads["kg_s"] <= 5 and reads["pg_s"] <= 6, reads
    r = ptxas_report(build_chunk_bwd_kernel(*key, "v2"))
    assert r["spill_stores"] <= 60, r


# ----------------------------------------------------------------------------------------------
# pass 2, variant v5 (`chunk_bwd_v5.py`, the default): role warpgroups and a TMA producer warp
# ----------------------------------------------------------------------------------------------

#: measured spill bytes of v5 (ptxas, sm_90a, this test's H = 1, HV = 2 builds): 44-68 B for bf16 packed,
#: 132 B for fp16 with int64 offsets (fixed length) at an earlier register split; a budget, not a target
#: (C751x, wgmma serialised for want of registers, is what costs time, and is checked apart)
V5_SPILL_BUDGET = 256


@needs_nvcc
@pytest.mark.parametrize(
    "dtype,beta_dtype,seq_dtype,varlen",
    [("bfloat16", "float32", "int32", True), ("float16", "float16", "int64", False)],
    ids=["bf16-varlen", "fp16-fixed"],
)
def test_chunk_bwd_v5_kernel_compiles(dtype, beta_dtype, seq_dtype, varlen):
    """v5 lowers and compiles for sm_90a: 512 threads, the producer gives back registers (setmaxnreg
    dec 24) and the three roles take them (inc: packed builds K 176 / A 152, fixed-length ones 184 /
    144), the four counts summing to the launch's 4 x 128; every
    tile by TMA after the first (masked) chunk; within Hopper's shared memory; no wgmma serialisation;
    spills within budget; the rows of no sequence zeroed in-kernel for packed input."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import build_chunk_bwd_kernel
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v5 import NREG_BY_VARLEN

    NREG = NREG_BY_VARLEN[varlen]
    kernel = build_chunk_bwd_kernel(1, 2, 128, 128, dtype, dtype, beta_dtype, seq_dtype, varlen, "v5")
    src = kernel.get_kernel_source()
    assert "gdn_chunk_bwd_v5" in src and "__launch_bounds__(512, 1)" in src
    assert sum(NREG.values()) == 512 and NREG["P"] == 24
    assert "warpgroup_reg_dealloc<24>" in src
    for role in ("S", "K", "A"):
        assert f"warpgroup_reg_alloc<{NREG[role]}>" in src
    for tile in ("q_desc", "k_desc", "v_desc", "do_desc", "h_desc", "A_desc", "g_cum_log2_desc"):
        assert tile in src, tile
    assert "wgmma" in src
    if varlen:
        assert "(Np1 - 2)" in src and "cu_seqlens[0]" in src, "rows of no sequence must be zeroed in-kernel"
        assert "order[" in src and "use_order" in src, "the launch order (`_common.launch_order`) is read"
    # dq and dk per value head are stored in fp32 (the GVA sum rounds once), or in q's dtype on request
    assert "float* __restrict__ dq_hv" in src and "float* __restrict__ dk_hv" in src
    if varlen:
        from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v5 import build_chunk_bwd_v5_kernel

        src = build_chunk_bwd_v5_kernel(1, 2, 128, 128, dtype, dtype, beta_dtype, seq_dtype, varlen, dtype).get_kernel_source()
        assert "bfloat16_t* __restrict__ dq_hv" in src and "bfloat16_t* __restrict__ dk_hv" in src
    r = ptxas_report(kernel)
    log = _ptxas_log(kernel)
    assert "C751" not in log, "ptxas serialised wgmma: " + log
    assert r["dynamic_smem"] is not None and r["dynamic_smem"] + r["static_smem"] <= SMEM_LIMIT, r
    assert r["spill_stores"] <= V5_SPILL_BUDGET, r


@needs_nvcc
def test_chunk_bwd_v5_all_options_compile():
    """v5 with every build option ("dagl": "d" adds a barrier, the last shared bytes) still fits Hopper's
    shared memory, and ptxas does not serialise its wgmma."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd import build_chunk_bwd_kernel

    kernel = build_chunk_bwd_kernel(1, 2, 128, 128, "bfloat16", "bfloat16", "float32", "int32", True, "v5:dagl")
    assert "s_done" in kernel.get_kernel_source()
    r = ptxas_report(kernel)
    log = _ptxas_log(kernel)
    assert "C751" not in log, "ptxas serialised wgmma: " + log
    assert r["dynamic_smem"] is not None and r["dynamic_smem"] + r["static_smem"] <= SMEM_LIMIT, r
    assert r["spill_stores"] <= V5_SPILL_BUDGET, r


def test_chunk_bwd_v5_applies_to_its_configurations_only():
    """v5 needs K = V = 128 and h in q's dtype (TMA); elsewhere the variant runs v2's kernel."""
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v5 import v5_applies

    assert v5_applies(128, 128, "bfloat16", "bfloat16") and v5_applies(128, 128, "float16", "float16")
    assert not v5_applies(128, 128, "bfloat16", "float32")
    assert not v5_applies(64, 128, "bfloat16", "bfloat16") and not v5_applies(128, 64, "bfloat16", "bfloat16")


def test_finish_skips_the_gva_sum_when_pass2_wrote_dq_and_dk(monkeypatch):
    """Pass 3 on pass-2 outputs in q's dtype (v5): with one value head per q/k head dq_hv, dk_hv are
    returned as dq, dk (no launch); with a group of two the sum is built for bf16 inputs; fp32 inputs
    keep the fp32 build, under the very key `op_kernel_specs` lists (so a warmed-up call builds nothing)."""
    from flashqla.ops.gdn.kernels.sm90 import finish_bwd

    built = []

    def fake_reduce(*key):
        built.append(key)
        H, K = key[0], key[2]
        return lambda dq_hv, dk_hv, dq, dk: (dq.copy_(dq_hv.view(*dq.shape[:2], H, -1, K).float().sum(3)),
                                             dk.copy_(dk_hv.view(*dk.shape[:2], H, -1, K).float().sum(3)))

    monkeypatch.setattr(finish_bwd, "build_gva_reduce_kernel", fake_reduce)
    monkeypatch.setattr(finish_bwd, "build_dg_cumsum_kernel", lambda *a: (lambda *b: None))
    B, T, K = 1, 5, 128
    dG = torch.zeros(2, 64)
    dq_hv = torch.randn(B, T, 2, K).to(torch.bfloat16)
    dk_hv = torch.randn(B, T, 2, K).to(torch.bfloat16)
    dq, dk, dg = finish_bwd.chunk_finish_bwd(dG, dq_hv, dk_hv, None, 2, torch.bfloat16)
    assert dq is dq_hv and dk is dk_hv and built == [] and dg.shape == (B, T, 2)
    dq, dk, _ = finish_bwd.chunk_finish_bwd(dG, dq_hv, dk_hv, None, 1, torch.bfloat16)
    assert built == [(1, 2, K, "bfloat16", "bfloat16")] and dq.shape == (B, T, 1, K)
    torch.testing.assert_close(dq[:, :, 0].float(), dq_hv.float().sum(2), rtol=1e-2, atol=1e-2)
    built.clear()
    dq, _, _ = finish_bwd.chunk_finish_bwd(dG, dq_hv.float(), dk_hv.float(), None, 2, torch.bfloat16)
    assert built == [(2, 2, K, "bfloat16")] and dq.dtype == torch.bfloat16 and dq is not dq_hv
    from flashqla.ops.gdn.kernels.sm90 import op_kernel_specs

    assert ("gva_reduce", built[0]) in op_kernel_specs(2, 2)


def test_qk_store_dtype_reads_its_variable(monkeypatch):
    from flashqla.ops.gdn.kernels.sm90.chunk_bwd_v5 import QK_DTYPE_ENV, qk_store_dtype

    monkeypatch.delenv(QK_DTYPE_ENV, raising=False)
    assert qk_store_dtype("bfloat16") == "float32"
    monkeypatch.setenv(QK_DTYPE_ENV, "input")
    assert qk_store_dtype("bfloat16") == "bfloat16" and qk_store_dtype("float16") == "float16"
    monkeypatch.setenv(QK_DTYPE_ENV, "bf16")
    with pytest.raises(ValueError, match=QK_DTYPE_ENV):
        qk_store_dtype("bfloat16")

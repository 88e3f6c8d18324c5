"""CPU tier: every sm_90 kernel lowers and compiles for sm_90a without a GPU (TileLang + nvcc), and
the public op rejects unsupported inputs before any device work (and before building a kernel)."""

from __future__ import annotations

import shutil
import subprocess
import sys

import pytest
import torch

from flashqla.testing import make_gdn_inputs

HAVE_NVCC = shutil.which("nvcc") is not None
needs_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="compiling for sm_90a needs nvcc (the CUDA toolkit) on PATH")


# --------------------------------------------------------------------------------------------
# kernels lower and compile
# --------------------------------------------------------------------------------------------


def test_prepare_key_and_heads_per_cta_are_checked():
    """`prepare_kernel_args` gives the static key from shapes (one value head a CTA for few chunk
    slots: the key ends with 1); `build_prepare_kernel` refuses a heads_per_cta other than None, 1 or
    HV / H by name."""
    from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel, prepare_kernel_args

    k = torch.zeros(1, 8, 1, 128, dtype=torch.bfloat16)
    beta = torch.zeros(1, 8, 2)
    assert prepare_kernel_args(k, beta, None, 2) == (1, 2, 128, "bfloat16", "float32", "int32", False, 1)
    assert prepare_kernel_args(k, beta, None, 1) == (1, 1, 128, "bfloat16", "float32", "int32", False)
    with pytest.raises(ValueError, match="heads_per_cta"):
        build_prepare_kernel(1, 8, 128, "bfloat16", "float32", "int32", False, 2)


def _group_case(seed: int, nvalid: int):
    """One chunk (C = 64) of 2 q/k heads and 8 value heads in fp64, for the prepare stage twins: keys
    past `nvalid` are the next sequence's (large, unnormalised), FLA's stages give g_cum and A.
    Returns (H, G, k, g, beta, g_cum, A)."""
    from reference.gdn import chunk as cr

    gen = torch.Generator().manual_seed(seed)
    H, HV, C, K = 2, 8, 64, 16
    k = torch.nn.functional.normalize(torch.randn(1, C, H, K, dtype=torch.float64, generator=gen), dim=-1)
    k[:, nvalid:] = 3 * torch.randn(1, C - nvalid, H, K, dtype=torch.float64, generator=gen)  # next sequence's keys
    g = 2 * torch.nn.functional.logsigmoid(torch.randn(1, C, HV, dtype=torch.float64, generator=gen))
    beta = torch.rand(1, C, HV, dtype=torch.float64, generator=gen)
    cu = torch.tensor([0, nvalid, C]) if nvalid < C else None
    g_cum = cr.chunk_local_cumsum(g, cu_seqlens=cu)
    A = cr.solve_tril(cr.chunk_scaled_dot_kkt(k, beta, g_cum, cu_seqlens=cu), cu_seqlens=cu)
    return H, HV // H, k, g, beta, g_cum, A


@pytest.mark.parametrize("nvalid", [64, 37, 1])
def test_prepare_group_stage_matches_chunk_reference(nvalid):
    """The stage twin of the inverse in its nilpotent form (`reference.gdn.fused.prepare_group`: K K^T
    once per q/k head, the inverse as WY-5) equals FLA's stages in fp64, masked rows included."""
    import math

    from reference.gdn.fused import prepare_group

    H, G, k, g, beta, g_cum, A = _group_case(nvalid, nvalid)
    for hk in range(H):
        heads = slice(hk * G, (hk + 1) * G)
        gcl, A_beta = prepare_group(k[0, :, hk], g[0, :, heads].T, beta[0, :, heads].T, nvalid)
        ref = A[0, :nvalid, heads, :nvalid].permute(1, 0, 2) * beta[0, :nvalid, heads].T[:, None, :]
        torch.testing.assert_close(A_beta[:, :nvalid, :nvalid], ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(gcl[:, :nvalid] * math.log(2.0), g_cum[0, :nvalid, heads].T, rtol=0, atol=1e-12)
        assert (A_beta[:, nvalid:] == 0).all() and (A_beta[:, :, nvalid:] == 0).all()
        assert (gcl[:, nvalid:] == gcl[:, nvalid - 1 : nvalid]).all()


def _head_loop_body(src: str) -> str:
    """The generated source of the value-head loop (`for (int j = 0; ...) { ... }`)."""
    i = src.index("for (int j = 0;")
    depth, start = 0, src.index("{", i)
    for pos in range(start, len(src)):
        depth += {"{": 1, "}": -1}.get(src[pos], 0)
        if depth == 0:
            return src[start : pos + 1]
    raise AssertionError("unbalanced head loop")


def _assert_store_wait_then_barrier(body: str) -> None:
    """In the value-head loop, the wait for the previous head's A tile store is followed by a CTA
    barrier before the staging tile (`ka_s`) is written again (`kernel_sources.async_store_hazards`):
    only the thread that issued the TMA store has a bulk group to wait for, so without the barrier the
    other threads write head j's A over the tile the copy engine may still be reading for head j - 1
    (the cause found for the serving page's failed gates on the H100: o 1e-3 to 1e-2 off, batch
    invariance broken)."""
    import kernel_sources as ks

    assert "tl::tma_store_wait<" in body, "no wait for the previous head's A tile store in the value-head loop"
    hazards = ks.async_store_hazards(body)
    assert not hazards, hazards


@needs_nvcc
@pytest.mark.parametrize(
    "H,HV,dtype,beta_dtype,seq_dtype,varlen",
    [
        (2, 4, "bfloat16", "float32", "int32", True),
        pytest.param(1, 1, "float16", "float16", "int64", False, marks=pytest.mark.compile_all),
        pytest.param(2, 8, "bfloat16", "float32", "int32", False, marks=pytest.mark.compile_all),
        pytest.param(2, 16, "bfloat16", "float32", "int32", True, marks=pytest.mark.compile_all),
    ],
    ids=["gva2-bf16-varlen", "gva1-fp16-int64-fixed", "gva4-bf16-fixed", "gva8-bf16-varlen"],
)
def test_prepare_kernel_compiles(H, HV, dtype, beta_dtype, seq_dtype, varlen):
    """TMA load of k and store of A, wgmma K K^T, the block-recursive inverse in tf32 mma.sync on
    32-row tiles (no 64 x 64 fp32 tile), at most ten barriers per value head, shared memory for five
    CTAs per SM up to G = 4 (<= 56 KB at G = 8) and 96 registers without spills."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel

    kernel = build_prepare_kernel(H, HV, 128, dtype, beta_dtype, seq_dtype, varlen)
    src = kernel.get_kernel_source()
    assert "tma_load" in src and "tma_store" in src, "k should be loaded and A stored by the copy engine"
    assert "wgmma" in src and "kTensorFloat32" not in src
    assert "__launch_bounds__(128, 5)" in src
    # the inverse's products: two m16n8k8 (level 2), three m16n8k16 (level 3), four in level 4's loops
    f16 = "tl::DataType::kFloat16, tl::DataType::kFloat16, tl::DataType::kFloat32, 16, 8, "
    assert src.count(f16 + "8, false, true>") == 2 and src.count(f16 + "16, false, true>") == 7
    assert src.count("mma_sync<") == 9
    assert "ldmatrix_x4_trans" in src and "__shfl_sync" in src
    assert "tma_store_wait<0, true>" in src, "the A tile's store must be waited for before the tile is rewritten"
    if HV // H > 1:
        body = _head_loop_body(src)
        # the explicit barrier after the wait for the previous head's A store (before the L tile's
        # stores), and those TileLang's barrier pass adds: after the L tile's stores, before and after
        # the stores of levels 2 and 3, around A diag(beta)'s staging stores, before the TMA store:
        # ten; an in-place update of a shared tile once put one in each iteration of an unrolled
        # element loop
        assert body.count("__syncthreads") <= 10, "a barrier came into the value-head loop"
        _assert_store_wait_then_barrier(body)
    r = ptxas_report(kernel)
    print(r)
    assert r["registers"] <= 96
    assert r["dynamic_smem"] is not None and r["dynamic_smem"] + r["static_smem"] <= 56 * 1024
    if HV // H <= 4:  # five CTAs of 128 threads: 228 KB an SM, 1 KB of it reserved per CTA
        assert 5 * (r["dynamic_smem"] + r["static_smem"] + 1024) <= 228 * 1024
    # TVM's launcher raises the dynamic shared-memory limit only from 48 KB of dynamic memory on:
    # below that, static + dynamic must fit in 48 KB or the launch fails (only on a GPU)
    assert r["dynamic_smem"] >= 48 * 1024 or r["dynamic_smem"] + r["static_smem"] <= 48 * 1024
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0


@needs_nvcc
def test_level1_mma_macro_lowers():
    """The inverse's first level by products (`prepare.diagonal_blocks_8x8_mma`, record WY-6; used by the
    fused forward experiment's builds "2m" / "2hm") lowers for sm_90a in a probe kernel: movmatrix from its
    prelude, eight m16n8k16 products a warp, no shuffle, no spill."""
    from _level1_probe import level1_mma_probe

    from flashqla.ops.gdn.kernels.sm90._common import compile_kernel, ptxas_report

    kernel = compile_kernel(level1_mma_probe(), "level1_mma_probe")
    src = kernel.get_kernel_source()
    f16 = "tl::DataType::kFloat16, tl::DataType::kFloat16, tl::DataType::kFloat32, 16, 8, 16, false, true>"
    assert "movmatrix.sync.aligned.m8n8.trans.b16" in src and src.count("flashqla_movtrans((") == 8
    assert src.count(f16) == 8 and "__shfl_sync" not in src
    assert "ptx_ldmatrix_x4(" in src and "ptx_ldmatrix_x2_trans(" in src
    r = ptxas_report(kernel)
    print(r)
    assert r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0


def test_level1_mma_fragment_plan_inverts_the_diagonal_blocks():
    """`diagonal_blocks_8x8_mma`'s fragment plan, emulated lane by lane with PTX's layouts (ldmatrix x4
    and x2.trans, m16n8k16 A / B / C fragments, movmatrix.trans) in fp16 with fp32 accumulation: each
    warp's two 8 x 8 diagonal blocks come out as WY-6's fp16 model (`solve_tril_block_product`) to
    fp32 summation order, within fp16 rounding of the exact inverse, and the blocks below them (level
    2's C) untouched."""
    import numpy as np

    from reference.gdn import numerics
    from reference.gdn.fused import solve_tril_block_product

    h = np.float16

    def frag(M, t):
        return (M[t >> 2, 2 * (t % 4)], M[t >> 2, 2 * (t % 4) + 1])

    def ldmatrix(ms, addr, num, trans):
        out = [[None] * num for _ in range(32)]
        for i in range(num):
            M = np.array([[ms[addr(8 * i + r)[0], addr(8 * i + r)[1] + c] for c in range(8)] for r in range(8)])
            for t in range(32):
                out[t][i] = frag(M.T if trans else M, t)
        return out

    def movtrans(pairs):
        M = np.zeros((8, 8), dtype=np.float16)
        for t in range(32):
            M[t >> 2, 2 * (t % 4)], M[t >> 2, 2 * (t % 4) + 1] = pairs[t]
        return [frag(M.T, t) for t in range(32)]

    def mma(a, b, c):
        A, B, Cm = np.zeros((16, 16), np.float32), np.zeros((16, 8), np.float32), np.zeros((16, 8), np.float32)
        for t in range(32):
            g, q = t >> 2, 2 * (t % 4)
            for e in range(2):
                A[g, q + e], A[g + 8, q + e], A[g, q + 8 + e], A[g + 8, q + 8 + e] = a[t][e], a[t][2 + e], a[t][4 + e], a[t][6 + e]
                B[q + e, g], B[q + 8 + e, g] = b[t][e], b[t][2 + e]
                Cm[g, q + e], Cm[g + 8, q + e] = c[t][e], c[t][2 + e]
        D = A @ B + Cm
        return [[*frag(D, t), *frag(D[8:], t)] for t in range(32)]

    def warp(ms, w):
        r0 = 16 * w
        a4 = ldmatrix(ms, lambda l: (r0 + l % 16, r0 + (l // 16) * 8), 4, False)
        b2 = ldmatrix(ms, lambda l: (r0 + l % 16, r0 + ((l % 16) // 8) * 8), 2, True)
        aL = [[*a4[t][0], h(0), h(0), h(0), h(0), *a4[t][3]] for t in range(32)]
        bL = [[*b2[t][0], *b2[t][1]] for t in range(32)]
        xa = [[h(0)] * 8 for _ in range(32)]
        x = [[0.0] * 4 for _ in range(32)]
        for t in range(32):
            g, c2 = t // 4, (t % 4) * 2
            for e in range(2):
                xa[t][e] = h((g == c2 + e) - np.float32(aL[t][e]))
                xa[t][6 + e] = h((g == c2 + e) - np.float32(aL[t][6 + e]))
                x[t][e], x[t][2 + e] = np.float32(xa[t][e]), np.float32(xa[t][6 + e])

        def pairs(z):
            ha = [[h(z[t][0]), h(z[t][1]), h(0), h(0), h(0), h(0), h(z[t][2]), h(z[t][3])] for t in range(32)]
            la = [[h(z[t][i] - np.float32(ha[t][j])) if j in (0, 1, 6, 7) else h(0)
                   for j, i in zip(range(8), (0, 1, 0, 0, 0, 0, 2, 3))] for t in range(32)]
            hb = [[*p, *q] for p, q in zip(movtrans([(a[0], a[1]) for a in ha]), movtrans([(a[6], a[7]) for a in ha]))]
            lb = [[*p, *q] for p, q in zip(movtrans([(a[0], a[1]) for a in la]), movtrans([(a[6], a[7]) for a in la]))]
            return ha, la, hb, lb

        ha, la, hb, lb = pairs(mma(aL, bL, [[0.0] * 4] * 32))
        x = mma(xa, lb, mma(xa, hb, x))
        _, _, hb, lb = pairs(mma(la, hb, mma(ha, lb, mma(ha, hb, [[0.0] * 4] * 32))))
        xa = [[h(x[t][0]), h(x[t][1]), h(0), h(0), h(0), h(0), h(x[t][2]), h(x[t][3])] for t in range(32)]
        x = mma(xa, lb, mma(xa, hb, x))
        out = ms.copy()
        for t in range(32):
            g, c2 = t // 4, (t % 4) * 2
            for e in range(2):
                out[r0 + g, r0 + c2 + e], out[r0 + 8 + g, r0 + 8 + c2 + e] = h(x[t][e]), h(x[t][2 + e])
        return out

    blk = np.kron(np.eye(8), np.ones((8, 8))).astype(bool)
    below = np.kron(np.eye(4), np.ones((16, 16))).astype(bool) & ~blk
    for rho in (0.0, 0.9):
        L = numerics.kkt_matrix(numerics.unit_keys(1, 64, 128, rho=rho, seed=2), 1.0)[0]
        ms = torch.tril(L, -1).to(torch.float16).numpy()
        out = ms.copy()
        for w in range(4):
            out[16 * w:16 * w + 16, 16 * w:16 * w + 16] = warp(ms, w)[16 * w:16 * w + 16, 16 * w:16 * w + 16]
        model = solve_tril_block_product(L[None].float(), 8, storage=torch.float16)[0].to(torch.float16).double().numpy()
        exact = solve_tril_block_product(L[None], 8)[0].numpy()
        got = out.astype(np.float64)
        assert np.abs(got[blk] - model[blk]).max() <= 2.0**-10 * np.abs(model[blk]).max()
        assert np.abs(got[blk] - exact[blk]).max() <= 2.0**-8 * np.abs(exact[blk]).max()
        assert np.array_equal(out[below], ms[below])


@needs_nvcc
@pytest.mark.compile_all
def test_prepare_phase_clock_build_compiles():
    """The phase-clock build (`build_prepare_kernel_clocked`, a measurement tool) compiles: thread 0
    writes every stamp of `prepare.clock_stamps` (clock64, %globaltimer, %smid) into the extra int64 argument,
    with the default build's barriers (no barrier added: the barrier-aligned stamps follow the ones
    TileLang places anyway) and 96 registers without spills; the default build's source stays the
    recorded one (`tests/data/kernel_sources.json`)."""
    import json
    import re

    from kernel_sources import QUICK, RECORD, digest

    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.prepare import (CLOCK_FIRST, CLOCK_HEAD, CLOCK_LAST, build_prepare_kernel,
                                                       build_prepare_kernel_clocked)

    key = (2, 4, 128, "bfloat16", "float32", "int32", True)
    plain = build_prepare_kernel(*key).get_kernel_source()
    assert digest(plain) in {d for _, d in json.loads(RECORD.read_text())[QUICK]}
    kernel = build_prepare_kernel_clocked(*key)
    src = kernel.get_kernel_source()
    assert "int64_t* __restrict__ clocks" in src and "flashqla_smid()" in src and "flashqla_globaltimer()" in src
    stamps = re.findall(r"clocks\[[^\]]*\] = ", src)
    assert len(stamps) == len(CLOCK_FIRST) + len(CLOCK_LAST) + len(CLOCK_HEAD)  # the head loop's once
    assert src.count("__syncthreads") == plain.count("__syncthreads")
    assert _head_loop_body(src).count("__syncthreads") == _head_loop_body(plain).count("__syncthreads")
    r = ptxas_report(kernel)
    print(r)
    assert r["registers"] <= 96 and r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0


@pytest.mark.parametrize("block", [1, 2, 8])
def test_solve_tril_doubling_matches_blockwise_inverse(block):
    """The prepare kernel's inverse order (`solve_tril_doubling`: WY-3 on the diagonal blocks, WY-4 with
    two blocks at three doublings) equals FLA's blockwise merge in fp64; with the kernel's fp16 storage
    its error on valid-domain L (unit keys, beta in (0, 1]) stays within a few fp16 roundings."""
    from reference.gdn import numerics
    from reference.gdn.fused import solve_tril_blocks, solve_tril_doubling

    gen = torch.Generator().manual_seed(block)
    n = 8 * block
    L = 0.4 * torch.randn(3, n, n, dtype=torch.float64, generator=gen)
    A = solve_tril_doubling(L, block)
    torch.testing.assert_close(A, solve_tril_blocks(L, min(block, 16)), rtol=0, atol=1e-12)
    eye = torch.eye(n, dtype=torch.float64)
    torch.testing.assert_close((eye + torch.tril(L, -1)) @ A, eye.expand(3, n, n), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="8 \\* block"):
        solve_tril_doubling(L[:, :-1, :-1], block)
    if n == 64:
        k = numerics.unit_keys(8, 64, 128, rho=0.9, seed=block)
        Lv = numerics.kkt_matrix(k, torch.rand(8, 64, generator=gen, dtype=torch.float64))
        err = numerics.inverse_error(Lv, "fp16 mma", "doubling")
        assert bool((err < 4 * numerics.UNIT_ROUNDOFF["fp16 mma"]).all()), err
        assert solve_tril_doubling(Lv, block, storage=torch.float16).dtype == torch.float32


def test_block_product_first_level_matches_substitution():
    """The inverse's first level by products (WY-6, `solve_tril_block_product`: (I - L)(I + L^2)(I + L^4)
    on 8 x 8 blocks) equals WY-3's substitution in fp64; in the kernel's fp16 model, with L^2 and L^4 as
    hi + lo pairs, the whole doubling inverse's error equals the substitution's on valid-domain L up to
    strongly correlated keys, where one rounding of L^2 and L^4 would double it."""
    from reference.gdn import numerics
    from reference.gdn.fused import solve_tril_block_product, solve_tril_diagonal_blocks, solve_tril_doubling

    gen = torch.Generator().manual_seed(3)
    L = 0.4 * torch.randn(3, 64, 64, dtype=torch.float64, generator=gen)
    torch.testing.assert_close(solve_tril_block_product(L, 8), solve_tril_diagonal_blocks(torch.tril(L, -1), 8),
                               rtol=0, atol=1e-13)
    torch.testing.assert_close(solve_tril_doubling(L, 8, level1="product"), solve_tril_doubling(L, 8), rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="block <= 8"):
        solve_tril_block_product(torch.zeros(2, 32, 32), 16)
    with pytest.raises(ValueError, match="level1"):
        solve_tril_doubling(L, 8, level1="shuffle")
    for rho, beta in ((0.0, 1.0), (0.9, 1.0)):
        Lv = numerics.kkt_matrix(numerics.unit_keys(8, 64, 128, rho=rho, seed=1), beta)
        sub = numerics.inverse_error(Lv, "fp16 mma", "doubling")
        prod = numerics.inverse_error(Lv, "fp16 mma", "doubling product")
        ratio = float((prod.log().mean() - sub.log().mean()).exp())
        assert 0.95 < ratio < 1.05, (rho, beta, ratio)


@pytest.mark.parametrize("nvalid", [64, 37, 1])
def test_prepare_group_recursive_matches_nilpotent_twin_and_chunk_reference(nvalid):
    """The prepare kernel's stage twin (`reference.gdn.fused.prepare_group_recursive`) equals FLA's
    stages and the nilpotent form's twin (`prepare_group`) in fp64, masked rows and next-sequence keys
    included."""
    import math

    from reference.gdn.fused import prepare_group, prepare_group_recursive

    H, G, k, g, beta, g_cum, A = _group_case(100 + nvalid, nvalid)
    for hk in range(H):
        heads = slice(hk * G, (hk + 1) * G)
        args = (k[0, :, hk], g[0, :, heads].T, beta[0, :, heads].T, nvalid)
        gcl, A_beta = prepare_group_recursive(*args)
        gcl2, A_beta2 = prepare_group(*args)
        ref = A[0, :nvalid, heads, :nvalid].permute(1, 0, 2) * beta[0, :nvalid, heads].T[:, None, :]
        torch.testing.assert_close(A_beta[:, :nvalid, :nvalid], ref, rtol=0, atol=1e-12)
        torch.testing.assert_close(A_beta, A_beta2, rtol=0, atol=1e-12)
        torch.testing.assert_close(gcl, gcl2, rtol=0, atol=0)
        torch.testing.assert_close(gcl[:, :nvalid] * math.log(2.0), g_cum[0, :nvalid, heads].T, rtol=0, atol=1e-12)
        assert (A_beta[:, nvalid:] == 0).all() and (A_beta[:, :, nvalid:] == 0).all()
        assert (A_beta.triu(1) == 0).all()


def test_recurrent_build_is_checked():
    from flashqla.ops.gdn.kernels.sm90.recurrent import build_recurrent_kernel

    with pytest.raises(ValueError, match="value slice width BV must be 64 or 128"):
        build_recurrent_kernel(1, 2, 128, 128, 32, "bfloat16", "int32", False)
    with pytest.raises(ValueError, match="K == V"):
        build_recurrent_kernel(1, 2, 128, 64, 64, "bfloat16", "int32", True, True)


_all = pytest.mark.compile_all


@needs_nvcc
@pytest.mark.parametrize("BV,varlen,dual", [(64, False, False), pytest.param(64, True, False, marks=_all),
                                            pytest.param(64, True, True, marks=_all), pytest.param(128, False, False, marks=_all),
                                            pytest.param(128, True, False, marks=_all), (128, True, True)])
def test_recurrent_kernel_compiles(BV, varlen, dual):
    """The recurrent kernel (BV = 64: one chain warpgroup; BV = 128: two, 512 threads):
    warpgroups whose setmaxnreg counts fit the CTA's launch registers (an `inc` past them waits
    forever: the first build hung on the H200), mbarrier hand-offs between the roles, wgmma with the
    state from registers on the chain, TMA loads by one producer warp, no spills, no CTA-wide barrier
    inside the role branches, and the chain warpgroups' barriers counting all of their threads."""
    import re

    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.recurrent import NREG, build_recurrent_kernel, reg_budget, roles_threads

    kern = build_recurrent_kernel(2, 8, 128, 128, BV, "bfloat16", "int32", varlen, dual)
    src = kern.get_kernel_source()
    if dual:  # the run + transition launch: limits read, transitions to u and pt, cut-short ones 0
        assert "limit[" in src and "pt[" in src and "(u + " in src and "min(nchunks, lim)" in src
    else:  # the plain launch has none of the dual launch's code
        assert "min(nchunks, lim)" not in src
    rep = ptxas_report(kern)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert rep["dynamic_smem"] is None or rep["dynamic_smem"] + rep["static_smem"] <= 232448, rep
    launch_regs = rep["registers"]
    n_chain = BV // 64
    nreg = NREG[BV]
    wgs = roles_threads(BV) // 128
    assert launch_regs == (65536 // roles_threads(BV)) // 8 * 8
    alloc = [int(x) for x in re.findall(r"warpgroup_reg_alloc<(\d+)>", src)]
    dealloc = [int(x) for x in re.findall(r"warpgroup_reg_dealloc<(\d+)>", src)]
    assert sorted(alloc) == sorted([nreg["chain"], nreg["output"]]) and dealloc == [nreg["producer"]]
    assert n_chain * nreg["chain"] + nreg["output"] + nreg["producer"] <= wgs * launch_regs == reg_budget(BV), (alloc, dealloc, launch_regs)
    assert all(r >= launch_regs for r in alloc) and all(r <= launch_regs for r in dealloc)
    assert src.count("wgmma_rs") >= 4 and "wgmma_ss" in src and "tma_load" in src
    body = src[src.index("warpgroup_reg_alloc"):]
    assert "__syncthreads" not in body  # only partial (one-warpgroup) barriers inside the roles
    # named barriers inside the roles span one role's threads (the chain's: all its warpgroups, the
    # output role's: its own 128, around the staged o tile), each role with its own barrier id
    counts = {}
    for bid, n in re.findall(r"__sync_thread_partial\((\d+), (\d+)\)", body):
        counts.setdefault(int(bid), set()).add(int(n))
    assert len(counts) == 2 and all(len(n) == 1 for n in counts.values()), counts
    assert sorted(n for (n,) in counts.values()) == sorted([128 * n_chain, 128]), counts
    # the staged o store: 16-byte vector stores of o (and of u in the dual launch); the single o tile
    # is guarded by the output role's own barrier before its writes (the previous chunk's reads) and
    # between its writes and the reads (TileLang inserts both: a change there would race silently)
    assert "*(uint4*)(o + " in src and (not dual or "*(uint4*)(u + " in src)
    out_id = next(b for b, n in counts.items() if n == {128} and (n_chain > 1 or b != min(counts)))
    out = body[body.index(f"warpgroup_reg_alloc<{nreg['output']}>"):]
    sync = f"__sync_thread_partial({out_id}, 128)"
    first_w = out.index("((bfloat16_t*)o_s) + ")
    last_w = out.index("*(uint4*)(o + ")
    assert sync in out[out.rindex("empty[", 0, first_w):first_w], "no barrier before the o tile's writes"
    assert sync in out[first_w:last_w], "no barrier between the o tile's writes and reads"
    for bar in ("full", "empty", "s_full", "s_empty", "n_full", "n_empty"):
        assert f"{bar}[(" in body, bar


def test_preallocated_o_is_checked():
    """A caller's o for the recurrent launch: v's shape, dtype and device, contiguous and on a 16-byte
    boundary (the role-split kernel stores it with 16-byte vectors), refused by name otherwise."""
    from flashqla.ops.gdn.kernels.sm90.recurrent import _check_out

    v = torch.zeros(1, 8, 2, 128, dtype=torch.bfloat16)
    o = torch.empty_like(v)
    assert _check_out(o, v) is o
    shifted = torch.empty(v.numel() + 1, dtype=torch.bfloat16)[1:].view(v.shape)
    with pytest.raises(ValueError, match="o must start on a 16-byte boundary"):
        _check_out(shifted, v)
    for bad in (torch.empty(1, 8, 2, 128), torch.empty(1, 8, 2, 64, dtype=torch.bfloat16),
                torch.empty(1, 8, 128, 2, dtype=torch.bfloat16).transpose(2, 3)):
        with pytest.raises(ValueError, match="^o must be a contiguous"):
            _check_out(bad, v)


@needs_nvcc
def test_compile_cache_hit_does_not_recompile():
    from flashqla.ops.gdn.kernels.sm90._common import compile_count
    from flashqla.ops.gdn.kernels.sm90.recurrent import build_recurrent_kernel

    build_recurrent_kernel(2, 8, 128, 128, 64, "bfloat16", "int32", False)
    n = compile_count()
    build_recurrent_kernel(2, 8, 128, 128, 64, "bfloat16", "int32", False)
    assert compile_count() == n


def test_block_v_heuristic():
    from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v

    assert pick_block_v(4, 64) == 128  # 256 walks: two waves at 128 against four at 64
    assert pick_block_v(1, 8) == 64
    assert pick_block_v(1, 66) == 64 and pick_block_v(1, 67) == 128  # 2 x 66 CTAs fill one wave
    assert pick_block_v(2, 46) == 128  # 92 CTAs, one wave, against two at BV = 64
    assert pick_block_v(4, 48) == 64  # 192 walks: three waves at 64 (5.7 us) against two at 128 (6.2)
    assert pick_block_v(8, 24) == 64 and pick_block_v(8, 32) == 128
    assert pick_block_v(1, 8, V=64) == 64
    assert pick_block_v(4, 48, sm_count=264) == 128  # one wave of 192 at 128 against two at 64


def test_slot_count_is_an_upper_bound():
    from flashqla.ops.gdn.kernels.sm90._common import CHUNK, num_slots

    g = torch.Generator().manual_seed(0)
    for _ in range(200):
        lens = torch.randint(0, 300, (int(torch.randint(1, 9, (1,), generator=g)),), generator=g).tolist()
        cu = [0]
        for n in lens:
            cu.append(cu[-1] + n)
        S = num_slots(1, cu[-1], len(lens), True)
        end = 0
        for n, L in enumerate(lens):
            first = cu[n] // CHUNK + n
            assert first >= end, "slots of consecutive sequences overlap"
            end = first + (L + CHUNK - 1) // CHUNK
        assert end <= S


# --------------------------------------------------------------------------------------------
# validation fires before device work
# --------------------------------------------------------------------------------------------


def _inputs(**kw):
    x = make_gdn_inputs(B=1, T=8, H=1, HV=2, dtype=torch.bfloat16, **kw)
    return x


def _call(x, **kw):
    from flashqla import chunk_gated_delta_rule

    args = dict(x)
    args.update(kw)
    return chunk_gated_delta_rule(**args)


def _no_compile(fn):
    from flashqla.ops.gdn.kernels.sm90._common import compile_count

    n = compile_count()
    fn()
    assert compile_count() == n, "a kernel was built before the argument checks"


@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_rejects_unsupported_qkv_dtype(dtype):
    x = make_gdn_inputs(B=1, T=8, H=1, HV=2, dtype=dtype)
    with pytest.raises(TypeError, match="bfloat16 or float16"):
        _no_compile(lambda: _call(x))


def test_rejects_head_dim_other_than_128():
    x = make_gdn_inputs(B=1, T=8, H=1, HV=2, K=64, V=64, dtype=torch.bfloat16)
    with pytest.raises(ValueError, match="K = V = 128"):
        _no_compile(lambda: _call(x))


def test_rejects_g_not_fp32():
    x = _inputs()
    x["g"] = x["g"].to(torch.bfloat16)
    with pytest.raises(TypeError, match="g in float32"):
        _no_compile(lambda: _call(x))


def test_rejects_beta_dtype():
    x = _inputs()
    x["beta"] = x["beta"].to(torch.float16)
    with pytest.raises(TypeError, match="beta"):
        _no_compile(lambda: _call(x))


def test_rejects_initial_state_dtype():
    x = _inputs()
    x["initial_state"] = x["initial_state"].to(torch.bfloat16)
    with pytest.raises(TypeError, match="initial_state in float32"):
        _no_compile(lambda: _call(x))


def test_shape_errors_come_from_shared_validation():
    x = make_gdn_inputs(B=1, T=8, H=2, HV=3, dtype=torch.bfloat16, special_heads=False)
    with pytest.raises(ValueError, match="multiple of the q/k head count"):
        _no_compile(lambda: _call(x))


def test_valid_inputs_off_gpu_raise_device_error_without_building():
    x = _inputs()
    with pytest.raises(RuntimeError, match="compute capability 9.0"):
        _no_compile(lambda: _call(x, output_final_state=True))


def test_gradient_request_off_hopper_fails_before_any_compile():
    x = _inputs()
    x["q"] = x["q"].requires_grad_()
    with pytest.raises(RuntimeError, match="compute capability"):
        _no_compile(lambda: _call(x))
    with torch.no_grad():
        with pytest.raises(RuntimeError, match="compute capability"):
            _no_compile(lambda: _call(x))


def test_import_does_not_load_tilelang():
    code = "import flashqla, sys; flashqla.chunk_gated_delta_rule; print('tilelang' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

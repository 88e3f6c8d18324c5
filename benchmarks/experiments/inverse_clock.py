"""Question: how many SM cycles does the 64 x 64 inverse A = (I + L)^-1 take when formed by recursive
doubling in fp16 with warp-level mma.sync, against the prepare kernel's forward substitution plus its
three tf32 product phases (4,850-5,230 cycles a value head, journal `forward.md`, entry "The prepare
kernel's L tile formed in registers"), and what does it cost in accuracy?

An experiment, not the package's code (journal `forward.md`, "Next on the GPU" item 3(b), and the
entry "How FlashInfer inverts the 64 x 64 tile"). One CTA of 128 threads (one warpgroup, as the fused
forward's aux role) inverts one chunk after another, in a 64 x 72 fp16 shared tile M (row-major,
8 halves of padding a row: the ldmatrix row addresses of 8 consecutive rows fall in 8 distinct bank
groups). M holds I + L on and below the diagonal, zeros above; the levels overwrite it in place with
the inverse's blocks ([[P, 0], [C, Q]]^-1 = [[P^-1, 0], [-Q^-1 C P^-1, Q^-1]] at each level):

  level 1  8 x 8 diagonal blocks: warp w, lanes 0-15, one row each of rows 16 w .. 16 w + 15, Gauss
           elimination by columns (7 steps, shuffles inside each group of 8 lanes, fp32 in registers):
           the prepare kernel's own macro (`prepare.diagonal_blocks_8x8`)
  level 2  16 x 16 blocks: warp w's block, two m16n8k8 fp16 mma.sync (Y = Q^-1 C in fp32, re-packed in
           registers as the second product's A operand, then Y P^-1); after __syncwarp only
  level 3  32 x 32 blocks: warps 0 and 2, the same at m16n8k16 (two n-tiles a product); after a CTA barrier
  level 4  64 x 64: each warp a 16 x 16 tile of -B1^-1 C B0^-1 (8 + 4 m16n8k16), stored after a barrier

Per CTA and level, thread 0's clock64 intervals summed over the CTA's chunks (stamps: `STAMPS`); the
kernel time by CUDA events over all chunks. Inputs: L = beta K K^T * Gamma, strictly lower
(`reference.gdn.numerics.unit_keys` / `kkt_matrix`, with decays), fp32. Accuracy: relative RMS of
the inverse against the fp64 inverse, beside `doubling_model` (the same levels on the CPU: fp16
storage between levels, fp32 products of fp16 operands) and the earlier kernel's tf32 product form
(`numerics.inverse_error(L, "tf32", "nilpotent")`). The kernel's level 3 runs on warps 0 and 2 alone
here (TileLang's pass splits the branch around its barrier in this build); the shipped kernel's runs on
all four warps (a draft of it with a __syncwarp before the stores inside that branch got a CTA
barrier inside it, one the other warps never reach).

    python benchmarks/experiments/inverse_clock.py [--chunks-per-cta 64] [--ctas-per-sm 1,4]
    TILELANG_CACHE_DIR=/tmp/tlc python benchmarks/experiments/inverse_clock.py --precompile-only
"""

import argparse
import math
import os
import sys

import torch

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE)), HERE]

C = 64
PAD = 72  # halves a row of M
#: clock stamps a chunk (thread 0): after the load and its barrier, after each level (levels 3 and 4
#: end with a CTA barrier, level 2 with one too: level 3 reads two warps' blocks)
STAMPS = ("load", "level1", "level2", "level3", "level4")


def _inverse_prim_func(n: int, ctas: int, manual: bool = False):
    import tilelang.language as T

    from flashqla.ops.gdn.kernels.sm90.prepare import diagonal_blocks_8x8

    per_cta = n // ctas
    NS = len(STAMPS)
    f16, f32 = "float16", "float32"

    @T.prim_func
    def inverse_doubling(
        L: T.Tensor((n, C, C), f32),
        X: T.Tensor((n, C, C), f32),
        clocks: T.Tensor((ctas, NS), "int64"),
    ):
        with T.Kernel(ctas, threads=128) as bx:
            M = T.alloc_shared((C, PAD), f16)
            fh = T.alloc_local((8,), f16)
            f = T.alloc_local((8,), f32)
            sc = T.alloc_local((1,), f32)
            a8 = T.alloc_local((4,), f16)
            b8 = T.alloc_local((2,), f16)
            y8 = T.alloc_local((4,), f32)
            a16 = T.alloc_local((8,), f16)
            b16 = T.alloc_local((8,), f16)
            y16 = T.alloc_local((16,), f32)
            o16 = T.alloc_local((8,), f32)
            acc = T.alloc_local((NS,), "int64")
            t0 = T.alloc_local((1,), "int64")
            tx = T.get_thread_binding()
            w = tx // 32
            lane = tx % 32
            g = lane // 4
            c2 = (lane % 4) * 2
            for i in T.unroll(NS):
                acc[i] = T.int64(0)

            for it in T.serial(per_cta):
                ch = bx * per_cta + it
                for i, j in T.Parallel(C, C):
                    M[i, j] = T.if_then_else(j < i, T.cast(L[ch, i, j], f16), T.cast(0, f16))
                T.sync_threads()
                t0[0] = T.call_extern("int64", "clock64")

                # level 1: the kernel's own (`prepare.diagonal_blocks_8x8`)
                diagonal_blocks_8x8(T, M, dict(fh=fh, f=f, sc=sc), w, lane)()
                T.sync_warp()
                if tx == 0:
                    t1 = T.call_extern("int64", "clock64")
                    acc[0] = acc[0] + (t1 - t0[0])
                    t0[0] = t1

                # level 2: warp w's 16-block at base = 16 w: -Q^-1 C P^-1 into C's place (rows 8-15 of
                # the m16 operands repeat rows 0-7)
                base = 16 * w
                T.ptx_ldmatrix(T.bool(False), 2, T.access_ptr(M[base + 8 + lane % 8, base + 8], "r", extent=8),
                               T.access_ptr(a8[0], "w", extent=4))
                T.ptx_ldmatrix(T.bool(True), 1, T.access_ptr(M[base + 8 + lane % 8, base], "r", extent=8),
                               T.access_ptr(b8[0], "w", extent=2))
                for i in T.unroll(4):
                    y8[i] = T.float32(0)
                T.ptx_mma(f32, "m16n8k8", "row", "col", "fp16", "fp16", "fp32", a8.data, 0, b8.data, 0, y8.data, 0, T.bool(False))
                for i in T.unroll(4):
                    a8[i] = T.cast(y8[i], f16)
                    y8[i] = T.float32(0)
                T.ptx_ldmatrix(T.bool(True), 1, T.access_ptr(M[base + lane % 8, base], "r", extent=8),
                               T.access_ptr(b8[0], "w", extent=2))
                T.ptx_mma(f32, "m16n8k8", "row", "col", "fp16", "fp16", "fp32", a8.data, 0, b8.data, 0, y8.data, 0, T.bool(False))
                if manual:
                    T.sync_warp()
                M[base + 8 + g, base + c2] = T.cast(-y8[0], f16)
                M[base + 8 + g, base + c2 + 1] = T.cast(-y8[1], f16)
                T.sync_threads()
                if tx == 0:
                    t1 = T.call_extern("int64", "clock64")
                    acc[1] = acc[1] + (t1 - t0[0])
                    t0[0] = t1

                # level 3: warps 0 and 2, the 32-block at base3 = 32 (w // 2)
                if w % 2 == 0:
                    base3 = 32 * (w // 2)
                    T.ptx_ldmatrix(T.bool(False), 4, T.access_ptr(M[base3 + 16 + lane % 16, base3 + 16 + (lane // 16) * 8], "r", extent=8),
                                   T.access_ptr(a16[0], "w", extent=8))
                    T.ptx_ldmatrix(T.bool(True), 4, T.access_ptr(M[base3 + 16 + lane % 16, base3 + (lane // 16) * 8], "r", extent=8),
                                   T.access_ptr(b16[0], "w", extent=8))
                    for i in T.unroll(8):
                        y16[i] = T.float32(0)
                    T.ptx_mma(f32, "m16n8k16", "row", "col", "fp16", "fp16", "fp32", a16.data, 0, b16.data, 0, y16.data, 0, T.bool(False))
                    T.ptx_mma(f32, "m16n8k16", "row", "col", "fp16", "fp16", "fp32", a16.data, 0, b16.data, 4, y16.data, 4, T.bool(False))
                    for i in T.unroll(8):
                        a16[i] = T.cast(y16[i], f16)
                        o16[i] = T.float32(0)
                    T.ptx_ldmatrix(T.bool(True), 4, T.access_ptr(M[base3 + lane % 16, base3 + (lane // 16) * 8], "r", extent=8),
                                   T.access_ptr(b16[0], "w", extent=8))
                    T.ptx_mma(f32, "m16n8k16", "row", "col", "fp16", "fp16", "fp32", a16.data, 0, b16.data, 0, o16.data, 0, T.bool(False))
                    T.ptx_mma(f32, "m16n8k16", "row", "col", "fp16", "fp16", "fp32", a16.data, 0, b16.data, 4, o16.data, 4, T.bool(False))
                    if manual:
                        T.sync_warp()
                    for nt in T.unroll(2):
                        for h in T.unroll(2):
                            M[base3 + 16 + g + 8 * h, base3 + 8 * nt + c2] = T.cast(-o16[4 * nt + 2 * h], f16)
                            M[base3 + 16 + g + 8 * h, base3 + 8 * nt + c2 + 1] = T.cast(-o16[4 * nt + 2 * h + 1], f16)
                T.sync_threads()
                if tx == 0:
                    t1 = T.call_extern("int64", "clock64")
                    acc[2] = acc[2] + (t1 - t0[0])
                    t0[0] = t1

                # level 4: warp w, rows 32 + 16 rb, columns 16 cq of -B1^-1 Cb B0^-1
                rb = w // 2
                cq = w % 2
                for i in T.unroll(16):
                    y16[i] = T.float32(0)
                for s in T.unroll(2):
                    T.ptx_ldmatrix(T.bool(False), 4, T.access_ptr(M[32 + 16 * rb + lane % 16, 32 + 16 * s + (lane // 16) * 8], "r", extent=8),
                                   T.access_ptr(a16[0], "w", extent=8))
                    for p in T.unroll(2):
                        T.ptx_ldmatrix(T.bool(True), 4, T.access_ptr(M[32 + 16 * s + lane % 16, 16 * p + (lane // 16) * 8], "r", extent=8),
                                       T.access_ptr(b16[0], "w", extent=8))
                        T.ptx_mma(f32, "m16n8k16", "row", "col", "fp16", "fp16", "fp32", a16.data, 0, b16.data, 0, y16.data, 8 * p, T.bool(False))
                        T.ptx_mma(f32, "m16n8k16", "row", "col", "fp16", "fp16", "fp32", a16.data, 0, b16.data, 4, y16.data, 8 * p + 4, T.bool(False))
                for i in T.unroll(8):
                    o16[i] = T.float32(0)
                for s in T.unroll(2):
                    for i in T.unroll(8):
                        a16[i] = T.cast(y16[8 * s + i], f16)
                    T.ptx_ldmatrix(T.bool(True), 4, T.access_ptr(M[16 * s + lane % 16, 16 * cq + (lane // 16) * 8], "r", extent=8),
                                   T.access_ptr(b16[0], "w", extent=8))
                    T.ptx_mma(f32, "m16n8k16", "row", "col", "fp16", "fp16", "fp32", a16.data, 0, b16.data, 0, o16.data, 0, T.bool(False))
                    T.ptx_mma(f32, "m16n8k16", "row", "col", "fp16", "fp16", "fp32", a16.data, 0, b16.data, 4, o16.data, 4, T.bool(False))
                T.sync_threads()
                for nt in T.unroll(2):
                    for h in T.unroll(2):
                        M[32 + 16 * rb + g + 8 * h, 16 * cq + 8 * nt + c2] = T.cast(-o16[4 * nt + 2 * h], f16)
                        M[32 + 16 * rb + g + 8 * h, 16 * cq + 8 * nt + c2 + 1] = T.cast(-o16[4 * nt + 2 * h + 1], f16)
                T.sync_threads()
                if tx == 0:
                    t1 = T.call_extern("int64", "clock64")
                    acc[3] = acc[3] + (t1 - t0[0])
                    t0[0] = t1

                for i, j in T.Parallel(C, C):
                    X[ch, i, j] = T.cast(M[i, j], f32)
                T.sync_threads()
            if tx == 0:
                acc[4] = acc[0] + acc[1] + acc[2] + acc[3]
                for i in T.unroll(NS):
                    clocks[bx, i] = acc[i]

    return inverse_doubling


#: the builds: "auto" (TileLang's barrier pass adds CTA barriers wherever a thread reads what another
#: wrote: it cannot see that levels 1 and 2 stay inside a warp), "manual" (that pass off, the
#: barriers written: __syncwarp inside a warp's levels, CTA barriers only before levels 3 and 4 and
#: around level 4's stores)
SYNCS = ("auto", "manual")


def build(n: int, ctas: int, sync: str = "auto"):
    """The compiled kernel for n chunks on ctas CTAs, with `sync` one of SYNCS."""
    import tilelang

    from flashqla.ops.gdn.kernels.sm90._common import _pass_configs, require_nvcc, sm90_target

    require_nvcc()
    cfg = dict(_pass_configs())
    if sync == "manual":
        cfg[tilelang.PassConfigKey.TL_DISABLE_THREAD_STORAGE_SYNC] = True
    return tilelang.compile(_inverse_prim_func(n, ctas, sync == "manual"), target=sm90_target(), pass_configs=cfg, out_idx=None)


def doubling_model(L: torch.Tensor) -> torch.Tensor:
    """The kernel's levels on the CPU (`reference.gdn.fused.solve_tril_doubling` with fp16 storage:
    L and each stored step in fp16, products of fp16 operands accumulated in fp32). L: [..., 64, 64]
    strictly lower. Returns the inverse [..., 64, 64] in fp32."""
    from reference.gdn.fused import solve_tril_doubling

    return solve_tril_doubling(L.float(), C // 8, storage=torch.float16)


def make_inputs(n: int, seed: int = 0):
    """n strictly lower L [n, 64, 64] fp32: a quarter each of independent keys (rho 0), correlated keys
    (rho 0.5, 0.9), and rho 0.9 with no decay and beta 1 (the hardest case for the inverse); the rest
    with per-chunk gates from -0.05 to -1 a token (ln) and beta in (0, 1)."""
    from reference.gdn import numerics

    gen = torch.Generator().manual_seed(seed)
    parts = []
    q = n // 4
    for i, rho in enumerate((0.0, 0.5, 0.9, 0.9)):
        m = q if i < 3 else n - 3 * q
        k = numerics.unit_keys(m, C, 128, rho=rho, seed=seed + i)
        if i == 3:
            beta = torch.ones(m, C, dtype=torch.float64)
            gc = None
        else:
            beta = torch.sigmoid(torch.randn(m, C, generator=gen, dtype=torch.float64))
            rate = -torch.exp(torch.empty(m, 1, dtype=torch.float64).uniform_(math.log(0.05), 0.0, generator=gen))
            gc = torch.cumsum(rate.expand(m, C) * torch.rand(m, C, generator=gen, dtype=torch.float64) * 2, -1)
        parts.append(numerics.kkt_matrix(k, beta, gc))
    return torch.cat(parts).float()


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> torch.Tensor:
    return torch.linalg.matrix_norm(x.double() - ref) / torch.linalg.matrix_norm(ref)


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--chunks-per-cta", type=int, default=64)
    ap.add_argument("--ctas-per-sm", default="1,4", help="comma-separated CTAs an SM (the grid is this times the SM count)")
    ap.add_argument("--sms", type=int, default=132, help="SM count (the GPU's, read from the device when there is one)")
    ap.add_argument("--precompile-only", action="store_true", help="build the kernels (CPU machine) and exit")
    args = ap.parse_args()

    sms = torch.cuda.get_device_properties(0).multi_processor_count if torch.cuda.is_available() else args.sms
    per_sm = [int(x) for x in args.ctas_per_sm.split(",")]
    shapes = [(sms * m * args.chunks_per_cta, sms * m) for m in per_sm]
    if args.precompile_only:
        for n, ctas in shapes:
            for sync in SYNCS:
                build(n, ctas, sync)
                print(f"built n={n} ctas={ctas} sync={sync}", flush=True)
        return

    from reference.gdn import fused, numerics
    from flashqla.bench.timing import time_cuda_graph

    gm = lambda e: math.exp(e.clamp_min(1e-30).log().mean().item())  # noqa: E731
    gpu = torch.cuda.get_device_name(0)
    print(f"# {gpu}, {sms} SMs, {args.chunks_per_cta} chunks a CTA")
    rows = []
    for (n, ctas), m in zip(shapes, per_sm):
        L = make_inputs(n)
        Lg = L.cuda()
        idx = torch.arange(0, n, max(1, n // 512))  # accuracy on a sample (fp64 on the CPU is slow)
        Ls = L[idx]
        ref = fused.solve_tril_blocks(Ls.double(), 16)
        model = doubling_model(Ls)
        err_m = rel_rms(model, ref)
        err_tf32 = numerics.inverse_error(Ls, "tf32", "nilpotent")
        for sync in SYNCS:
            kern = build(n, ctas, sync)
            X = torch.full_like(Lg, float("nan"))
            clocks = torch.zeros(ctas, len(STAMPS), dtype=torch.int64, device="cuda")
            kern(Lg, X, clocks)
            torch.cuda.synchronize()
            Xs = X[idx].cpu()
            err_k = rel_rms(Xs, ref)
            gap = (Xs.double() - model.double()).abs().max().item()
            finite = bool(torch.isfinite(X).all())
            cyc = clocks.double().median(0).values / args.chunks_per_cta
            ms = time_cuda_graph(lambda: kern(Lg, X, clocks)).ms
            rows.append((m, sync, cyc, ms, n, err_k, err_m, err_tf32, gap, finite))
            print(f"ctas/SM {m} sync {sync}: cycles a chunk (median CTA) "
                  + ", ".join(f"{s} {c:.0f}" for s, c in zip(STAMPS[1:], cyc[:4].tolist()))
                  + f", total {cyc[4].item():.0f}; kernel {ms:.3f} ms ({ms * 1e6 * sms / n:.0f} ns a chunk an SM, load and store included)")
            print(f"  error vs fp64 (geo mean over {len(idx)} of {n}; quarters rho 0 / 0.5 / 0.9 / 0.9 gate-free beta 1): kernel "
                  + " / ".join(f"{gm(e):.2e}" for e in err_k.chunk(4)) + ", model " + " / ".join(f"{gm(e):.2e}" for e in err_m.chunk(4))
                  + ", tf32 kernel model " + " / ".join(f"{gm(e):.2e}" for e in err_tf32.chunk(4))
                  + f"; max |kernel - model| {gap:.3e}; all finite {finite}")
    print(f"\n| GPU | CTAs/SM | sync | level 1 | level 2 | level 3 | level 4 | total (cycles a chunk) | ns a chunk an SM | err kernel | err model | err tf32 |")
    print("|---|---|---|---|---|---|---|---|---|---|---|---|")
    for m, sync, cyc, ms, n, ek, em, et, gap, fin in rows:
        print(f"| {gpu} | {m} | {sync} | " + " | ".join(f"{c:.0f}" for c in cyc.tolist())
              + f" | {ms * 1e6 * sms / n:.0f} | {gm(ek):.2e} | {gm(em):.2e} | {gm(et):.2e} |")


if __name__ == "__main__":
    main()

"""Builds the kernels of the GPU tier and of the benchmarks into TileLang's disk cache, in worker
processes, and optionally packs the cache for the GPU machine. Needs no GPU: kernels compile for
sm_90a with the local nvcc, and a cache built here loads on the GPU machine (same TileLang version,
same keys), so a GPU call spends its time on tests and timings instead of compiles.

    TILELANG_CACHE_DIR=/tmp/tlcache python tests/gpu/precompile.py --tier --bench --pack .device/tilelang-cache.tar.xz

(`.device/on-device.sh` unpacks .device/tilelang-cache.tar.xz on a fresh GPU machine.) On the GPU
machine `tests/gpu/run_device.sh` calls `--tier` first (16 cores there). Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

#: (H, HV) of the GPU tier's tests
TIER_HEADS = ((1, 2), (1, 4), (2, 2), (2, 4), (4, 4), (2, 8))
#: (H, HV) whose backward the multi-GPU benchmark runs besides the backward grid's (`python -m flashqla.bench --multigpu`)
EXTRA_BWD_HEADS = ((2, 8),)


def tier_specs() -> list:
    """The kernels the GPU tier's tests build (bf16 / fp32 beta / int32 offsets and the fp16, bf16-beta
    and int64 variants the tests use)."""
    from flashqla.ops.gdn.kernels.sm90.registry import op_kernel_specs

    specs = []
    for H, HV in TIER_HEADS:
        for N in (1, 2, 3, 5, 6):
            for varlen in (False, True):
                # with the opt-in fp16 A_beta product's builds (test_fwd_gpu.py's _check runs it on every case)
                specs += op_kernel_specs(H, HV, N=N, varlen=varlen, fp16_products=True)
    for H, HV in ((4, 4), (2, 4), (1, 2), (1, 4)):
        specs += op_kernel_specs(H, HV, N=2, beta_dtype="bfloat16")
        for varlen in (False, True):
            specs += op_kernel_specs(H, HV, varlen=varlen, dtype="float16", beta_dtype="float16", seq_dtype="int64")
            specs += op_kernel_specs(H, HV, varlen=varlen, seq_dtype="int64")
            # fp16 with fp32 beta (test_bwd_gpu.py's test_fp16, test_autograd_gpu.py, test_edge_gpu.py)
            for sd in ("int32", "int64"):
                specs += op_kernel_specs(H, HV, varlen=varlen, dtype="float16", seq_dtype=sd)
    for varlen in (False, True):  # flashqla.warmup(2, 4, varlen=...): both widths (test_fwd_gpu's no-recompile test)
        for bv in (64, 128):
            specs += op_kernel_specs(2, 4, varlen=varlen, block_v=bv)
    specs += op_kernel_specs(16, 32, varlen=True, seq_dtype="int64", block_v=128)
    specs += op_kernel_specs(16, 32, varlen=True, block_v=128)
    specs += op_kernel_specs(4, 16, varlen=True, seq_dtype="int64")  # test_cp_kernels_gpu.py's dual-launch cases
    specs += op_kernel_specs(4, 16, varlen=True)
    # test_determinism_gpu.py's prepare repeats (several value heads a CTA)
    specs += [("prepare", (H, HV, 128, "bfloat16", "float32", "int32", True)) for H, HV in ((16, 32), (8, 32), (16, 64))]
    return list(dict.fromkeys(specs + serving_tier_specs()))


def serving_tier_specs() -> list:
    """The serving builds (and the plain kernels beside them) of tests/gpu/test_serving_gpu.py."""
    from flashqla.ops.gdn.kernels.sm90.registry import op_kernel_specs, serving_kernel_specs

    every = ("float32", "bfloat16", "float16")
    specs = []
    for bv in (64, 128):  # test_pool_layout_dtype_checkpoints: 6 sequences, both widths forced
        specs += serving_kernel_specs(2, 4, N=6, varlen=True, block_v=bv, state_dtypes=every, checkpoints=(True,))
    specs += serving_kernel_specs(2, 4, N=4, varlen=True, state_dtypes=("float32",), checkpoints=(False, True),
                                  split=True)  # test_split_plan_checkpoints (split)
    specs += serving_kernel_specs(2, 4, N=2, varlen=True, state_dtypes=("float32", "bfloat16"), state_layouts=("kv",),
                                  checkpoints=(True,))
    specs += serving_kernel_specs(2, 4, N=2, varlen=False, state_dtypes=("float32",), state_layouts=("kv",),
                                  checkpoints=(True,))
    for N in (2, 4, 6):
        specs += op_kernel_specs(2, 4, N=N, varlen=True, backward=False)
    # test_state_moves_match_torch: the state-move kernels in every storage dtype, layout and index dtype
    specs += [(kind, (128, 128, sd, lay, it)) for kind in ("pool_gather", "pool_store", "checkpoint_combine")
              for sd in every for lay in ("kv", "vk") for it in ("int32", "int64")]
    return specs + op_kernel_specs(2, 4, N=2, varlen=False, backward=False)


def bench_specs(backward: bool = True) -> list:
    """The kernels of the benchmark grids: every head configuration, packed and fixed, both value
    slice widths, the backward's kernels for the backward grid (`backward=False`: the forward grid's
    kernels only)."""
    from flashqla.bench.grid import BWD_HEADS, FWD_HEADS
    from flashqla.ops.gdn.kernels.sm90.registry import op_kernel_specs

    fwd_heads = [(h.h_qk, h.h_v) for h in FWD_HEADS]
    bwd_heads = list(dict.fromkeys([(h.h_qk, h.h_v) for h in BWD_HEADS] + list(EXTRA_BWD_HEADS)))
    specs = []
    for H, HV in fwd_heads:
        for varlen in (False, True):
            for bv in (64, 128):
                specs += op_kernel_specs(H, HV, varlen=varlen, block_v=bv, backward=False)
    for H, HV in bwd_heads if backward else ():
        for varlen in (False, True):
            for bv in (64, 128):
                specs += op_kernel_specs(H, HV, varlen=varlen, block_v=bv)
    return list(dict.fromkeys(specs))


def serving_bench_specs() -> list:
    """The serving builds of `python -m flashqla.bench --serving`'s default rows (bf16 "vk" pool,
    checkpoints), at every width their sequence counts pick (batch_invariant's too)."""
    from flashqla.bench.grid import parse_heads
    from flashqla.bench.serving import SERVING_ROWS
    from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v
    from flashqla.ops.gdn.kernels.sm90.registry import serving_kernel_specs

    specs = []
    for h in dict.fromkeys(h for h, _ in SERVING_ROWS):
        hc = parse_heads(h)
        for bv in sorted({pick_block_v(N, hc.h_v, 128) for N in (1, 2, 4, 8)}):
            specs += serving_kernel_specs(hc.h_qk, hc.h_v, varlen=True, block_v=bv, state_dtypes=("bfloat16",),
                                          state_layouts=("vk",), checkpoints=(True,), split=True)
    return specs


def sanitize_specs() -> list:
    """The kernels of benchmarks/experiments/sanitize.py: its cases at 1 q/k and 2 value heads (plain,
    split, fixed-length and packed, bf16 and fp16, int32 and int64 offsets, both value slice widths,
    the serving build with checkpoints) and its --long case at 2/8 heads."""
    from flashqla.ops.gdn.kernels.sm90.registry import op_kernel_specs, serving_kernel_specs

    specs = []
    for N in (1, 2, 3, 4, 5, 40):
        for varlen in (False, True):
            for dtype, seqs in (("bfloat16", ("int32", "int64")), ("float16", ("int32",))):
                for sd in seqs:
                    specs += op_kernel_specs(1, 2, N=N, varlen=varlen, dtype=dtype, seq_dtype=sd)
    specs += serving_kernel_specs(1, 2, N=5, varlen=True, state_dtypes=("bfloat16",), state_layouts=("vk",),
                                  checkpoints=(True,))
    specs += op_kernel_specs(2, 8, N=1)
    return list(dict.fromkeys(specs))


def pack(cache_dir: str, out: str, limit_mb: float = 24.0) -> None:
    """tar.xz of the whole cache directory (TileLang keeps the host wrappers under
    `<version>/linux-x86_64/kernels/` and the cubins under `<version>/cuda-binaries/`: both are needed).
    xz -9: its 64 MiB window spans many kernels' near-identical files (about 4x smaller than -3)."""
    tmp = out + ".tmp"
    with open(tmp, "wb") as f:
        tar = subprocess.Popen(["tar", "-cf", "-", "-C", cache_dir, "."], stdout=subprocess.PIPE)
        subprocess.run(["xz", "-T0", "-9"], stdin=tar.stdout, stdout=f, check=True)
        if tar.wait() != 0:
            raise SystemExit("tar failed")
    size = os.path.getsize(tmp) / 2**20
    if size > limit_mb:
        os.remove(tmp)
        raise SystemExit(f"packed cache is {size:.1f} MiB > {limit_mb} MiB: not written")
    if os.path.exists(out):
        os.chmod(out, 0o644)
    os.replace(tmp, out)
    print(f"wrote {out} ({size:.1f} MiB)")


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--tier", action="store_true", help="the GPU tier's kernels")
    ap.add_argument("--bench", action="store_true", help="the benchmark grids' kernels")
    ap.add_argument("--serving", action="store_true", help="the serving benchmark's builds (`flashqla.bench --serving`)")
    ap.add_argument("--sanitize", action="store_true", help="benchmarks/experiments/sanitize.py's kernels")
    ap.add_argument("--fwd-only", action="store_true", help="with --bench: the forward grid's kernels only")
    ap.add_argument("--workers", type=int, default=None, help="worker processes (default: CPU count)")
    ap.add_argument("--pack", metavar="FILE", help="write the cache directory as FILE (tar.xz) afterwards")
    ap.add_argument("--list", action="store_true", help="print the kernel specs and exit")
    args = ap.parse_args(argv)
    specs = (tier_specs() if args.tier else []) + (bench_specs(not args.fwd_only) if args.bench else [])
    specs += serving_bench_specs() if args.serving else []
    specs += sanitize_specs() if args.sanitize else []
    specs = list(dict.fromkeys(specs))
    if args.list:
        for s in specs:
            print(s)
        print(f"{len(specs)} kernels")
        return 0
    if specs:
        from flashqla.ops.gdn.kernels.sm90.registry import precompile

        t = time.time()
        precompile(specs, max_workers=args.workers)
        print(f"precompiled {len(specs)} kernels in {time.time() - t:.0f} s", flush=True)
    if args.pack:
        from tilelang import env

        pack(os.environ.get("TILELANG_CACHE_DIR") or env.TILELANG_CACHE_DIR, args.pack)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Build our sm_90 kernels on the CPU machine into a TileLang disk cache that the GPU machine loads
instead of compiling them (about 13 s a kernel there, one at a time as the benchmark meets them).

    TILELANG_CACHE_DIR=/tmp/tlc-fwd python benchmarks/experiments/precompile_ours.py \\
        --heads grid --pack .device/tlc-fwd.tar.xz [--bwd] [--fp16-products] [--seqlens-dtype int32]

`--heads grid`: every head configuration of the forward grid (`flashqla.bench`'s); else
"h_qk/h_v,...". Per head configuration it calls `flashqla.warmup` (packed input, both value-slice
widths, the split path's kernels; `--bwd` adds the backward's, `--fp16-products` the opt-in fp16
A_beta product's builds), which needs TileLang and nvcc, no GPU. `--pack` writes the cache folder as
tar.xz; on the GPU machine unpack it into `$TILELANG_CACHE_DIR` after `source .device/on-device.sh`:

    mkdir -p $TILELANG_CACHE_DIR && tar -xJf .device/tlc-fwd.tar.xz -C $TILELANG_CACHE_DIR

The cache key holds the kernel's script, target (sm_90a), pass configs and TileLang's version, none
of them read off a device, so the GPU machine's lookups hit (`precompile_flashqla.py` gives the key).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path[:0] = [os.path.dirname(os.path.dirname(HERE))]


def grid_heads() -> list[tuple[int, int]]:
    from flashqla.bench.grid import FWD_HEADS  # noqa: PLC0415

    return [(h.h_qk, h.h_v) for h in FWD_HEADS]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--heads", default="grid", help='"grid" or "h_qk/h_v,..."')
    ap.add_argument("--bwd", action="store_true", help="also the backward's kernels")
    ap.add_argument("--fp16-products", action="store_true", help="also the fp16 A_beta product's builds")
    ap.add_argument("--seqlens-dtype", default="int32", choices=("int32", "int64"))
    ap.add_argument("--pack", default=None, help="write the cache folder to this tar.xz")
    a = ap.parse_args()
    if not os.environ.get("TILELANG_CACHE_DIR"):
        sys.exit("set TILELANG_CACHE_DIR to the cache folder to fill")
    import torch

    import flashqla

    heads = grid_heads() if a.heads == "grid" else [tuple(int(x) for x in h.split("/")) for h in a.heads.split(",")]
    sd = torch.int32 if a.seqlens_dtype == "int32" else torch.int64
    t0 = time.time()
    for H, HV in heads:
        t = time.time()
        n = flashqla.warmup(H, HV, varlen=True, seqlens_dtype=sd, backward=a.bwd, fp16_products=a.fp16_products)
        print(f"{H}/{HV}: {n} kernels compiled, {time.time() - t:.0f} s", flush=True)
    print(f"all: {time.time() - t0:.0f} s")
    if a.pack:
        cache = os.environ["TILELANG_CACHE_DIR"]
        with open(a.pack, "wb") as f:
            tar = subprocess.Popen(["tar", "-cf", "-", "-C", cache, "."], stdout=subprocess.PIPE)
            subprocess.run(["xz", "-T0", "-6"], stdin=tar.stdout, stdout=f, check=True)
            tar.wait()
        print(f"{a.pack}: {os.path.getsize(a.pack) / 2**20:.2f} MiB")


if __name__ == "__main__":
    main()

"""Question: can the recurrent kernel load only the three lower 32 x 32 blocks of a chunk's A diag(beta)
tile (its upper 32 x 32 block is zero) by TMA into the shared tile its chain's wgmma reads, so that
the prepare kernel need not write that quarter of A and the recurrent kernel need not read it?

An experiment on the CPU (TileLang 0.1.15 lowering for sm_90a; no GPU needed), for the journal
`forward.md`, "Next on the GPU" item 2. A TMA box lands densely in shared memory. With the 128-byte
swizzle TileLang picks for a [64, 64] bf16 tile (rows of 64 halves), a 32-column box cannot land in
it. With the 64-byte swizzle (`make_half_bank_swizzled_layout`) the tile is two [64, 32] column
atoms, so the lower blocks are two boxes: A00 and A10 as one [64 x 32] box into atom 0, A11 as a
[32 x 32] box into the lower half of atom 1 (its upper half to be zeroed once a stage; this kernel
leaves it unset, so its O would be wrong: it checks lowering only). The script builds a small
warp-specialised kernel both ways (whole tile; the two boxes) with the tile as wgmma's transposed B
operand, and prints the generated TMA loads, their shared-memory offsets and the wgmma descriptor
of the tile, and their mbarrier byte counts follow the boxes (4,096 + 2,048 bytes for A instead of
8,192). Speed, and the wgmma's cost with the 64-byte swizzle, need the GPU.

    python benchmarks/experiments/a_blocks_tma.py [--out DIR]   # writes the generated CUDA there
"""

import argparse
import os
import re
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)


def build(blocks: bool):
    """The kernel: 64 CTAs of 256 threads; threads 128-159 load a chunk's A (whole, or its three lower
    blocks) and V by TMA onto one mbarrier, threads 0-127 wait and form O = V A^T by wgmma (fp32)."""
    import tilelang.language as T
    from tilelang.layout import make_half_bank_swizzled_layout

    @T.prim_func
    def a_blocks(A: T.Tensor((4096, 64), "bfloat16"), V: T.Tensor((4096, 64), "bfloat16"),
                 O: T.Tensor((4096, 64), "float32")):
        with T.Kernel(64, threads=256) as bx:
            tx = T.get_thread_binding()
            a_s = T.alloc_shared((64, 64), "bfloat16")
            v_s = T.alloc_shared((64, 64), "bfloat16")
            acc = T.alloc_fragment((64, 64), "float32")
            full = T.alloc_barrier(arrive_count=[32])
            if blocks:
                T.annotate_layout({a_s: make_half_bank_swizzled_layout(a_s)})
            if tx >= 128:
                if tx < 160:
                    if blocks:
                        T.tma_copy(A[bx * 64 : bx * 64 + 64, 0:32], a_s[0:64, 0:32], barrier=full[0])
                        T.tma_copy(A[bx * 64 + 32 : bx * 64 + 64, 32:64], a_s[32:64, 32:64], barrier=full[0])
                    else:
                        T.tma_copy(A[bx * 64 : bx * 64 + 64, 0:64], a_s, barrier=full[0])
                    T.tma_copy(V[bx * 64 : bx * 64 + 64, 0:64], v_s, barrier=full[0])
                    T.barrier_arrive(full[0])
            else:
                T.barrier_wait(full[0], 0)
                T.wgmma_gemm(v_s, a_s, acc, transpose_B=True, clear_accum=True)
                T.copy(acc, O[bx * 64 : bx * 64 + 64, 0:64])

    return a_blocks


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", default=None, help="folder for the generated CUDA sources (default: none written)")
    args = ap.parse_args(argv)
    import tilelang

    from flashqla.ops.gdn.kernels.sm90._common import _pass_configs, sm90_target

    for blocks in (False, True):
        ker = tilelang.compile(build(blocks), target=sm90_target(), pass_configs=_pass_configs(), out_idx=None)
        src = ker.get_kernel_source()
        name = "three lower blocks" if blocks else "whole tile"
        if args.out:
            os.makedirs(args.out, exist_ok=True)
            with open(os.path.join(args.out, f"a_blocks_{int(blocks)}.cu"), "w") as f:
                f.write(src)
        print(f"{name}:")
        for line in re.findall(r"tl::tma_load\([^;]*;", src):
            print("  " + line)
        for line in re.findall(r"initialize_wgmma_descriptor<[^>]*>\(desc_b[^;]*;", src):
            print("  " + line)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""A kernel's generated CUDA source run on the host, for the CPU tier's checks of small integer kernels
(tests/test_segment_tables_kernel.py, tests/test_launch_order_kernel.py, the serving build's checkpoint
ranges in tests/test_serving_kernels_compile.py). Not collected by pytest.

`HostKernel(src, workdir, tag)` strips the includes of TileLang's generated source, puts a prelude in
front (blockIdx / threadIdx per host thread, `__syncthreads()` as a `std::barrier`, the one dynamic
shared buffer as a static array, min / max, and `__ballot_sync` / `__popcll` for kernels of one warp) and a runner behind it, builds a shared library with the
host C++ compiler and binds it with ctypes. `launch(grid, tensors, sizes)` runs the launch grid CTA
after CTA, each CTA as `threads` host threads (the kernel's launch bounds) that meet where the source
has a barrier, with the arguments a TileLang launch binds: tensors by parameter name (pointers), the
other parameters from `sizes` (int, or int64 where the source declares int64_t). Kernels with no
barrier and no shared memory run the same way.
"""

import ctypes
import os
import re
import shutil
import subprocess

import pytest

HAVE_NVCC = shutil.which("nvcc") is not None
needs_nvcc = pytest.mark.skipif(not HAVE_NVCC, reason="compiling for sm_90a needs nvcc (the CUDA toolkit) on PATH")
CXX = shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
needs_cxx = pytest.mark.skipif(CXX is None, reason="running the generated source on the host needs a C++ compiler")

_PRELUDE = r"""
#include <atomic>
#include <barrier>
#include <cstdint>
#include <thread>
#include <type_traits>
#include <vector>
typedef unsigned char uchar;
struct tl_host_dim3 { unsigned int x, y, z; };
static thread_local tl_host_dim3 blockIdx, threadIdx;
static std::barrier<>* tl_host_bar;
alignas(1024) static unsigned char tl_host_smem[48 * 1024];
#define __global__
#define __launch_bounds__(...)
#define __restrict__
#define __syncthreads() tl_host_bar->arrive_and_wait()
// warp votes, for kernels of one warp (the CTA's threads are its lanes): every lane's bit, then all
// lanes read the word before any lane clears it for the next vote
static std::atomic<unsigned> tl_host_vote{0};
static inline unsigned __ballot_sync(unsigned, int pred) {
  tl_host_bar->arrive_and_wait();
  if (threadIdx.x == 0) tl_host_vote.store(0);
  tl_host_bar->arrive_and_wait();
  if (pred) tl_host_vote.fetch_or(1u << (threadIdx.x % 32));
  tl_host_bar->arrive_and_wait();
  unsigned bits = tl_host_vote.load();
  tl_host_bar->arrive_and_wait();
  return bits;
}
static inline int __popcll(unsigned long long x) { return __builtin_popcountll(x); }
template <class A, class B> static inline typename std::common_type<A, B>::type min(A a, B b) { return a < b ? a : b; }
template <class A, class B> static inline typename std::common_type<A, B>::type max(A a, B b) { return a < b ? b : a; }
"""


class HostKernel:
    """The kernel's generated CUDA source built for the host (see the module docstring). `threads`:
    its launch bounds; `params`: (name, is pointer, is int64) per parameter; `launches`: calls so far."""

    def __init__(self, src: str, workdir: str, tag: str):
        m = re.search(r"__launch_bounds__\((\d+), \d+\) (\w+)\(([^)]*)\)\s*\{", src)
        assert m, "kernel definition not found"
        self.threads, name, params = int(m.group(1)), m.group(2), m.group(3)
        self.params = []
        for p in params.split(","):
            p = p.strip()
            self.params.append((re.findall(r"\w+", p)[-1], "*" in p, "int64_t" in p and "*" not in p))
        body = "\n".join(line for line in src.splitlines() if not line.lstrip().startswith("#include"))
        body, n = re.subn(r"extern __shared__ __align__\(\d+\) (\w+) (\w+)\[\];",
                          r"\1* \2 = reinterpret_cast<\1*>(tl_host_smem);", body)
        assert n <= 1, "at most one dynamic shared buffer expected"
        names = ", ".join(p[0] for p in self.params)
        runner = (f'\nextern "C" void tl_host_run(unsigned int grid, unsigned int block, {params}) {{\n'
                  "  std::barrier<> bar(block);\n  tl_host_bar = &bar;\n  std::vector<std::thread> threads;\n"
                  "  for (unsigned int t = 0; t < block; ++t)\n    threads.emplace_back([&, t] {\n"
                  "      for (unsigned int b = 0; b < grid; ++b) {\n"
                  f"        blockIdx.x = b; threadIdx.x = t; {name}({names});\n"
                  "        bar.arrive_and_wait();  // the CTA ends before the next one takes the buffer\n"
                  "      }\n    });\n  for (auto& th : threads) th.join();\n}\n")
        cpp = os.path.join(workdir, f"{tag}.cpp")
        so = os.path.join(workdir, f"{tag}.so")
        with open(cpp, "w") as f:
            f.write(_PRELUDE + body + runner)
        subprocess.run([CXX, "-std=c++20", "-O1", "-pthread", "-shared", "-fPIC", "-w", "-o", so, cpp], check=True,
                       capture_output=True, text=True)
        self.lib = ctypes.CDLL(so)
        self.fn = self.lib.tl_host_run
        self.fn.argtypes = [ctypes.c_uint, ctypes.c_uint] + [
            ctypes.c_void_p if ptr else (ctypes.c_int64 if wide else ctypes.c_int) for _, ptr, wide in self.params]
        self.fn.restype = None
        self.launches = 0

    def launch(self, grid: int, tensors: dict, sizes: dict) -> None:
        """Runs `grid` CTAs with the tensors (CPU, contiguous) and sizes named by the parameters."""
        for t in tensors.values():
            assert t.is_contiguous() and t.device.type == "cpu"
        args = [tensors[n].data_ptr() if ptr else sizes[n] for n, ptr, _ in self.params]
        self.fn(grid, self.threads, *args)
        self.launches += 1

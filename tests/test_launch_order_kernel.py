"""CPU tier: the backward's launch order (`launch_order.launch_order`) and its one-launch rank kernel
(`flashqla/ops/gdn/kernels/sm90/launch_order.py`).

- the torch path (CPU, and the reference) is the stable descending sort of the lengths, checked against
  Python's `sorted` on awkward offsets; the None returns (token order unless longest_first) as before;
- the kernel compiles for sm_90a for int32 and int64 offsets; N is a run-time size (one build per
  dtype); its source has one barrier a step (and two around the warps' partial counts), no atomics and
  no host synchronisation; no spills;
- the generated CUDA source itself, built for the host with one host thread per GPU thread of a CTA
  and a real barrier for `__syncthreads` (so the shared-memory staging and the partial counts run as
  on the GPU), gives torch.argsort(..., descending=True, stable=True) on random, tie-heavy and edge
  offsets, every output element written (a missing barrier or a wrong condition fails these);
- `launch_order` takes the kernel for int32/int64 offsets on an sm_90 device up to ORDER_KERNEL_MAX
  sequences and the torch sort otherwise, reading no device value on the host.
The same comparison on an H200: tests/gpu/test_cp_kernels_gpu.py (test_launch_order_kernel_*).
"""

import re
import tempfile

import pytest
import torch

from flashqla.ops.gdn.kernels.sm90 import _common
from flashqla.ops.gdn.kernels.sm90 import launch_order as lo

from tests import host_cuda
from tests.host_cuda import CXX, HAVE_NVCC, needs_cxx, needs_nvcc


def offsets(lengths, dtype=torch.int64, lead=0):
    cu = [lead]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=dtype)


def python_order(cu) -> list:
    """Longest first, ties in index order: Python's sort is stable."""
    c = [int(x) for x in cu]
    lens = [c[i + 1] - c[i] for i in range(len(c) - 1)]
    return sorted(range(len(lens)), key=lambda i: -lens[i])


def torch_order(cu) -> torch.Tensor:
    return torch.argsort(cu[1:] - cu[:-1], descending=True, stable=True).to(torch.int32)


# lengths: empty sequences, all equal, one, two, ties across block boundaries (128), one long among
# many short, strictly increasing and decreasing, 1-token sequences
AWKWARD = [
    [0, 0],
    [5, 5],
    [0, 7],
    [7, 0],
    [0, 0, 0, 0, 0],
    [3, 0, 3, 0, 3],
    [64] * 130,
    [1] * 300,
    [0] * 129 + [1],
    [1] + [0] * 200,
    [0, 1, 63, 64, 65, 0, 130, 5, 0],
    list(range(200)),
    list(range(200, 0, -1)),
    [2, 1] * 140,
    [8192, 1, 8192, 1, 8192, 0, 0, 8192],
]


# --------------------------------------------------------------------------------------------
# launch_order: the torch path (CPU), its None returns
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("case", range(len(AWKWARD)))
def test_torch_path_is_the_stable_descending_sort(dtype, case):
    for lead in (0, 77):
        cu = offsets(AWKWARD[case], dtype, lead)
        got = lo.launch_order(cu, longest_first=True)
        assert got.dtype == torch.int32 and got.shape == (cu.numel() - 1,) and got.device == cu.device
        assert got.tolist() == python_order(cu)


def test_torch_path_random_offsets():
    gen = torch.Generator().manual_seed(5)
    for c in range(60):
        N = int(torch.randint(2, 600, (1,), generator=gen))
        hi = [2, 5, 64, 10000][c % 4]  # few distinct lengths (many ties) to many
        lens = torch.randint(0, hi, (N,), generator=gen).tolist()
        cu = offsets(lens, torch.int32 if c % 2 else torch.int64)
        assert lo.launch_order(cu, longest_first=True).tolist() == python_order(cu)


def test_none_returns():
    """Token order (None) unless the caller (the plan's `longest_first`) asks; no offsets, N <= 1: None."""
    cu = offsets([3, 9, 1])
    one = offsets([7])
    assert lo.launch_order(cu) is None
    assert lo.launch_order(cu, longest_first=False) is None
    assert lo.launch_order(cu, longest_first=True).tolist() == [1, 0, 2]
    assert lo.launch_order(None, True) is None
    assert lo.launch_order(one, True) is None  # N == 1: numel 2
    assert lo.launch_order(torch.zeros(1, dtype=torch.int32), True) is None  # N == 0
    assert lo.launch_order(torch.zeros(0, dtype=torch.int32), True) is None


# --------------------------------------------------------------------------------------------
# the kernel compiles; its source
# --------------------------------------------------------------------------------------------


@needs_nvcc
@pytest.mark.parametrize("seq_dtype", ["int32", "int64"])
def test_kernel_compiles_one_build_per_dtype(seq_dtype):
    kernel = lo.build_launch_order_kernel(seq_dtype)
    n = _common.compile_count()
    assert lo.build_launch_order_kernel(seq_dtype) is kernel and _common.compile_count() == n
    src = kernel.get_kernel_source()
    ctype = "int" if seq_dtype == "int32" else "int64_t"
    # N and the offsets' length are run-time arguments (a new N does not recompile)
    assert re.search(rf"__launch_bounds__\({lo.THREADS}, 1\) gdn_launch_order_kernel\(const {ctype}\* __restrict__ cu, "
                     r"int\* __restrict__ order, int N, int Np1\)", src), src[:2000]
    body = src[src.index("__launch_bounds__"):]
    # the staged lengths: two buffers, one barrier a step; then the warps' counts summed and
    # order[rank] = i (the partial counts may share the staging buffer: a barrier before they are written)
    assert body.count("extern __shared__") == 1 and "lens" in body and "part" in body
    step = lo.THREADS * lo.PER
    loop = f"for (int b = 0; b < ((N + {step - 1}) >> {step.bit_length() - 1}); ++b)"
    assert loop in body
    steps, tail = body.split(loop)[1].split("part)[((int)threadIdx.x)] = cnt[0];")
    assert steps.count("__syncthreads()") == 2, "one barrier a step, one before the partial counts"
    assert steps.endswith("__syncthreads();\n  ((int*)")  # all reads of the staged lengths are done
    assert tail.count("__syncthreads()") == 1 and re.search(r"order\[cnt\[[^\]]*0\]\] = i;", tail)
    for construct in ("atomic", "__threadfence", "printf", "while", "cudaDeviceSynchronize", "asm", "__nanosleep",
                      "__syncwarp"):
        assert construct not in body, construct
    host = kernel.get_host_source()
    assert "Synchronize" not in host and "cudaMemcpy" not in host
    # the launch grid: ceil(N / SEQS) CTAs (what the host run below launches)
    assert f"((int64_t)((N + {lo.SEQS - 1}) >> {lo.SEQS.bit_length() - 1}))" in host
    r = _common.ptxas_report(kernel)
    print(seq_dtype, r)
    assert r["registers"] <= 96 and r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0
    assert r["static_smem"] == 0
    assert r["dynamic_smem"] in (None, 2 * step * (4 if seq_dtype == "int32" else 8))


@needs_nvcc
def test_kernel_rejects_other_dtypes():
    with pytest.raises(ValueError, match="seq_dtype"):
        lo.build_launch_order_kernel("int16")


def test_registered_for_precompilation(monkeypatch):
    """`op_kernel_specs` lists the kernel for what the backward launches it on: a packed batch's offsets,
    and the split path's packed segment offsets (int32 for a fixed-length batch); `registry.build` knows it."""
    from flashqla.ops.gdn.kernels.sm90 import registry

    def listed(**kw):
        return [a for k, a in registry.op_kernel_specs(2, 4, **kw) if k == "launch_order"]

    assert listed(varlen=True, seq_dtype="int64") == [("int64",)]
    assert listed(varlen=True, seq_dtype="int32") == [("int32",)]
    assert listed(varlen=False) == [("int32",)]  # the segments' packed offsets
    assert listed(varlen=True, seq_dtype="int64", K=128, V=64) == [("int64",)]  # no split path
    assert listed(varlen=False, K=128, V=64) == []
    assert listed(varlen=True, backward=False) == []
    built = []
    monkeypatch.setattr(lo, "build_launch_order_kernel", lambda *a: built.append(a) or "kernel")
    assert registry.build("launch_order", ("int64",)) == "kernel" and built == [("int64",)]


# --------------------------------------------------------------------------------------------
# the generated source run on the host
# --------------------------------------------------------------------------------------------

class HostKernel(host_cuda.HostKernel):
    """The rank kernel's generated source on the host: CTA after CTA, each CTA as host threads meeting
    at a real barrier where the source has `__syncthreads()`, so the staging and its barriers run as on
    the GPU; the output poisoned first (every element must be written)."""

    def __call__(self, cu, order):
        assert order.dtype == torch.int32 and order.shape[0] == cu.shape[0] - 1 >= 1
        order.fill_(-7)
        # the launch grid: ceil(N / SEQS) CTAs
        self.launch(-(-order.shape[0] // lo.SEQS), dict(cu=cu, order=order), dict(N=order.shape[0], Np1=cu.shape[0]))


@pytest.fixture(scope="module")
def host_kernels():
    if not HAVE_NVCC or CXX is None:
        pytest.skip("needs nvcc (to generate the kernel) and a host C++ compiler")
    with tempfile.TemporaryDirectory() as d:
        yield {dt: HostKernel(lo.build_launch_order_kernel(dt).get_kernel_source(), d, dt) for dt in ("int32", "int64")}


def run_host(host_kernels, cu, monkeypatch):
    """`launch_order` on a CPU tensor, forced onto the kernel path with the host build (the launcher
    itself past ORDER_KERNEL_MAX, where `launch_order` takes the torch sort)."""
    monkeypatch.setattr(lo, "on_sm90", lambda t: True)
    monkeypatch.setattr(lo, "build_launch_order_kernel", lambda dt: host_kernels[dt])
    hk = host_kernels[_common.tl_dtype(cu.dtype)]
    before = hk.launches
    N = cu.numel() - 1
    got = lo.launch_order(cu, longest_first=True) if N <= lo.ORDER_KERNEL_MAX else lo.longest_first_order(cu)
    assert hk.launches == before + 1, "one launch per call"
    assert got.dtype == torch.int32 and got.shape == (cu.numel() - 1,)
    return got


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_generated_source_awkward_offsets(host_kernels, monkeypatch, dtype):
    for lens in AWKWARD:
        for lead in (0, 77):
            cu = offsets(lens, dtype, lead)
            got = run_host(host_kernels, cu, monkeypatch)
            assert torch.equal(got, torch_order(cu)), f"{lens[:20]} lead={lead}: {got.tolist()[:20]}"


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_generated_source_random_and_tie_heavy(host_kernels, monkeypatch, dtype):
    """N at and around the block size (the thread's own block, blocks before and after it, a partial
    last block), lengths from a few distinct values (ties everywhere) to many."""
    gen = torch.Generator().manual_seed(11 if dtype == torch.int32 else 13)
    # every block boundary with int32 offsets; with int64 (the same code at another width) one N on
    # each side of each boundary (the CPU suite's time bound)
    sizes = (2, 3, 127, 128, 129, 255, 256, 257, 1000, 1023, 1024, 1025, 2049, 4096, 5000)
    for N in sizes if dtype == torch.int32 else (2, 127, 129, 256, 1023, 1025, 5000):
        for hi in (1, 3, 64, 1 << 18):
            lens = torch.randint(0, hi, (N,), generator=gen).tolist()
            cu = offsets(lens, dtype)
            got = run_host(host_kernels, cu, monkeypatch)
            assert torch.equal(got, torch_order(cu)), f"N={N} hi={hi}"


@needs_cxx
def test_generated_source_wide_and_unordered_offsets(host_kernels, monkeypatch):
    """int64 lengths past 2^32 (compared in 64 bits: lengths equal in their low 32 bits stay distinct);
    offsets outside the contract (decreasing: negative lengths) still give the torch sort."""
    big = 1 << 32
    cu = offsets([big + 5, 5, big + 5, 2 * big, 0, 2 * big + 1] * 30, torch.int64)
    assert torch.equal(run_host(host_kernels, cu, monkeypatch), torch_order(cu))
    gen = torch.Generator().manual_seed(3)
    for dtype in (torch.int32, torch.int64):
        cu = torch.randint(-1000, 1000, (300,), generator=gen).to(dtype)
        assert torch.equal(run_host(host_kernels, cu, monkeypatch), torch_order(cu))


# --------------------------------------------------------------------------------------------
# launch_order's choice of path; the launcher
# --------------------------------------------------------------------------------------------


class _Recorder:
    """A stand-in kernel that records its arguments and writes nothing."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def test_path_choice_and_no_host_sync(monkeypatch):
    """Kernel for int32/int64 offsets on an sm_90 device with N <= ORDER_KERNEL_MAX, one launch with
    the offsets and an int32 [N] output, nothing read on the host; the torch sort above the limit, for
    other dtypes, and off sm_90."""
    rec = _Recorder()
    builds = []
    monkeypatch.setattr(lo, "build_launch_order_kernel", lambda dt: builds.append(dt) or rec)
    cu = offsets([5, 0, 300, 64], torch.int32)
    assert lo.launch_order(cu, True).tolist() == [2, 3, 0, 1]  # CPU: the torch sort
    assert rec.calls == []

    monkeypatch.setattr(lo, "on_sm90", lambda t: True)

    def refuse(*a, **k):
        raise AssertionError("host synchronisation on the launch path")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    out = lo.launch_order(cu, True)
    wide = lo.launch_order(cu.to(torch.int64), True)
    assert lo.launch_order(offsets([9], torch.int32), True) is None  # N <= 1: token order, no launch
    assert lo.launch_order(torch.zeros(1, dtype=torch.int32), True) is None
    limit = lo.launch_order(torch.zeros(lo.ORDER_KERNEL_MAX + 1, dtype=torch.int64), True)
    monkeypatch.undo()
    assert builds == ["int32", "int64", "int64"] and len(rec.calls) == 3
    kcu, korder = rec.calls[0]
    assert kcu is cu and korder is out and out.dtype == torch.int32 and out.shape == (4,)
    assert limit.shape == (lo.ORDER_KERNEL_MAX,) and rec.calls[2][1] is limit
    assert wide.shape == (4,)

    # past the limit, or int16 offsets: the torch sort, no launch
    monkeypatch.setattr(lo, "on_sm90", lambda t: True)
    monkeypatch.setattr(lo, "build_launch_order_kernel", lambda dt: builds.append(dt) or rec)
    lens = [1, 2] * ((lo.ORDER_KERNEL_MAX + 2) // 2)
    cu = offsets(lens, torch.int64)
    assert lo.launch_order(cu, True).tolist() == python_order(cu)
    cu16 = offsets([3, 9, 1], torch.int16)
    assert lo.launch_order(cu16, True).tolist() == [1, 0, 2]
    assert len(rec.calls) == 3


def test_launcher_arguments():
    with pytest.raises(ValueError, match="1-D"):
        lo.longest_first_order(torch.zeros(2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="1-D"):
        lo.longest_first_order(torch.zeros(0, dtype=torch.int32))
    with pytest.raises(ValueError, match="int32 or int64"):
        lo.longest_first_order(torch.zeros(3, dtype=torch.int16))
    empty = lo.longest_first_order(torch.zeros(1, dtype=torch.int64))  # N == 0: no launch
    assert empty.shape == (0,) and empty.dtype == torch.int32


def test_module_has_no_host_sync_calls():
    """The module never reads device values on the host: no call of a reading method anywhere in it. Its
    one `.to` (`launch_order`'s torch path, moved here from `_common`) is a cast to a dtype on the same
    device: every `.to` call takes exactly one `torch.<dtype>` argument (no device, no keywords)."""
    import ast
    import inspect

    tree = ast.parse(inspect.getsource(lo))
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)]
    called = {node.func.attr for node in calls}
    assert not called & {"item", "tolist", "cpu", "numpy", "synchronize"}, called
    for node in calls:
        if node.func.attr == "to":
            assert not node.keywords and len(node.args) == 1, ast.unparse(node)
            arg = node.args[0]
            assert (isinstance(arg, ast.Attribute) and isinstance(arg.value, ast.Name) and arg.value.id == "torch"
                    and isinstance(getattr(torch, arg.attr, None), torch.dtype)), ast.unparse(node)

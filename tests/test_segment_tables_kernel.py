"""CPU tier: the one-launch segment-table kernel (`flashqla.ops.gdn.kernels.sm90.cp_tables`) and its
wrapper (`flashqla.cp.segments.segment_tables_device`).

- the kernel compiles for sm_90a for int32 and int64 offsets, and its generated source is plain
  per-thread scalar code (no shared memory, barrier, atomic, spin loop or printf; every thread's
  locals initialised unconditionally);
- the generated CUDA source itself, compiled for the host with the C++ compiler and run thread by
  thread over the same grid (it has no shared memory and no barrier, so a sequential run is the
  parallel one), fills the wrapper's buffers with tables equal to `build_segment_tables` field by
  field, on random packed mixes and edge cases, every output element written over a poison;
- the wrapper: argument checks, the N == 0 / M == 0 and CPU-tensor fallbacks, buffer layout, and no
  host synchronisation on the launch path.
The same comparison on an H200, and across CUDA-graph replays: tests/gpu/test_cp_kernels_gpu.py.
"""

import tempfile

import pytest
import torch

from flashqla.cp import segments
from flashqla.cp.segments import SegmentTables, build_segment_tables
from flashqla.ops.gdn.kernels.sm90 import cp_tables as tk

from tests import host_cuda
from tests.host_cuda import CXX, HAVE_NVCC, needs_cxx, needs_nvcc

FIELDS = ("cu_seqlens", "seq", "index", "start", "end", "valid", "first", "last", "prev", "h0_index",
          "need_transition", "need_correction", "seq_first", "seq_num", "seq_last")


def assert_tables_equal(got: SegmentTables, ref: SegmentTables, what=""):
    assert (got.segment_len, got.N, got.M) == (ref.segment_len, ref.N, ref.M), what
    for f in FIELDS:
        a, b = getattr(got, f), getattr(ref, f)
        assert a.dtype == b.dtype, f"{what} {f}: dtype {a.dtype} != {b.dtype}"
        assert a.shape == b.shape, f"{what} {f}: shape {tuple(a.shape)} != {tuple(b.shape)}"
        assert torch.equal(a, b), f"{what} {f}: {a.tolist()[:40]} != {b.tolist()[:40]}"


def offsets(lengths, dtype=torch.int64, lead=0):
    cu = [lead]
    for n in lengths:
        cu.append(cu[-1] + n)
    return torch.tensor(cu, dtype=dtype)


def random_mix(gen, L):
    """Sequence lengths of a random packed mix: empty, 1-token, shorter than L, multiples of 64 and
    of L, off by one, several segments long."""
    N = int(torch.randint(1, 301, (1,), generator=gen)) if torch.rand(1, generator=gen) < 0.5 else \
        int(torch.randint(1, 9, (1,), generator=gen))
    lens = []
    for _ in range(N):
        r = int(torch.randint(0, 9, (1,), generator=gen))
        k = int(torch.randint(1, 5, (1,), generator=gen))
        lens.append([0, 1, int(torch.randint(2, 64, (1,), generator=gen)), 64 * k, 64 * k + 1, L, L - 1, L + 1,
                     int(torch.randint(1, 4 * L, (1,), generator=gen))][r])
    return lens


# --------------------------------------------------------------------------------------------
# the kernel compiles; its source is plain per-thread code
# --------------------------------------------------------------------------------------------


@needs_nvcc
@pytest.mark.parametrize("seq_dtype", ["int32", "int64"])
def test_kernel_compiles_plain_per_thread_code(seq_dtype):
    from flashqla.ops.gdn.kernels.sm90._common import compile_count, ptxas_report

    kernel = tk.build_segment_tables_kernel(seq_dtype)
    n = compile_count()
    assert tk.build_segment_tables_kernel(seq_dtype) is kernel and compile_count() == n
    src = kernel.get_kernel_source()
    assert f"__launch_bounds__({tk.THREADS}, 1) cp_segment_tables_kernel(" in src
    ctype = "int" if seq_dtype == "int32" else "int64_t"
    assert f"const {ctype}* __restrict__ cu_seqlens" in src and f"{ctype}* __restrict__ pseudo" in src
    body = src[src.index("__launch_bounds__") :]
    # one independent pass per thread: nothing waits on another thread or on the host
    for construct in ("__shared__", "__syncthreads", "__syncwarp", "atomic", "__threadfence", "printf",
                      "while", "cudaDeviceSynchronize", "asm", "__nanosleep"):
        assert construct not in body, construct
    # every thread initialises its locals itself (no initialisation under a thread-index condition)
    prologue = body[body.index("{") : body.index("if (")].splitlines()
    assert [ln for ln in prologue if "threadIdx" in ln and not ln.strip().startswith("i = ")] == []
    assert sum("threadIdx" in ln for ln in prologue) == 1, "slot index i = blockIdx.x * 128 + threadIdx.x"
    # int64 arithmetic: the search compares in 64 bits, slot i is a 64-bit index
    assert "int64_t i = (int64_t)0;" in body and "* Lw)" in body
    r = ptxas_report(kernel)
    print(seq_dtype, r)
    assert r["registers"] <= 64 and r["spill_stores"] == 0 and r["spill_loads"] == 0 and r["stack"] == 0
    assert r["static_smem"] == 0


@needs_nvcc
def test_kernel_rejects_other_dtypes():
    with pytest.raises(ValueError, match="seq_dtype"):
        tk.build_segment_tables_kernel("int16")


# --------------------------------------------------------------------------------------------
# the generated source run on the host
# --------------------------------------------------------------------------------------------

class HostKernel(host_cuda.HostKernel):
    """The tables kernel's generated source on the host, with the arguments a TileLang launch would
    bind (tensor pointers and the dynamic sizes read from the shapes); every buffer poisoned first."""

    def __call__(self, cu, L, pseudo, slot_tab, flag_tab, seq_tab):
        tensors = dict(cu_seqlens=cu, pseudo=pseudo, slot_tab=slot_tab, flag_tab=flag_tab, seq_tab=seq_tab)
        assert pseudo.dtype == cu.dtype and slot_tab.dtype == seq_tab.dtype == torch.int64 and flag_tab.dtype == torch.uint8
        assert slot_tab.shape[0] == 6 and flag_tab.shape == (5, slot_tab.shape[1]) and seq_tab.shape[0] == 3
        assert slot_tab.shape[1] >= pseudo.shape[0] - 1 and seq_tab.shape[1] >= cu.shape[0] - 1
        # poison: every element the tables expose must be written by the kernel
        pseudo.fill_(-0x5A5A5A5)
        slot_tab.fill_(-0x77777777)
        flag_tab.fill_(0xA5)
        seq_tab.fill_(-0x66666666)
        sizes = dict(L=int(L), Np1=cu.shape[0], Mp1=pseudo.shape[0], MS=slot_tab.shape[1], NS=seq_tab.shape[1])
        self.launch(-(-pseudo.shape[0] // self.threads), tensors, sizes)


@pytest.fixture(scope="module")
def host_kernels():
    if not HAVE_NVCC or CXX is None:
        pytest.skip("needs nvcc (to generate the kernel) and a host C++ compiler")
    with tempfile.TemporaryDirectory() as d:
        yield {dt: HostKernel(tk.build_segment_tables_kernel(dt).get_kernel_source(), d, dt) for dt in ("int32", "int64")}


def run_host(host_kernels, cu, L, T, monkeypatch):
    """`segment_tables_device` on a CPU tensor, forced onto the kernel path with the host build."""
    monkeypatch.setattr(tk, "kernel_supported", lambda cu: cu.dtype in (torch.int32, torch.int64))
    monkeypatch.setattr(tk, "build_segment_tables_kernel", lambda dt: host_kernels[dt])
    hk = host_kernels[tk._SEQ_DTYPES[cu.dtype]]
    before = hk.launches
    got = segments.segment_tables_device(cu, L, T)
    assert hk.launches == before + (1 if cu.shape[0] > 1 else 0), "one launch per call (none when N == 0)"
    return got


EDGE_CASES = [
    # (lengths, L, tail)
    ([0], 64, 0),
    ([0], 64, 200),
    ([1], 64, 0),
    ([64], 64, 0),
    ([65], 64, 63),
    ([0, 0, 0], 128, 0),
    ([0, 1, 63, 64, 65, 0, 130, 5, 0], 64, 0),
    ([0, 1, 63, 64, 65, 0, 130, 5, 0], 128, 77),
    ([4096], 1024, 0),
    ([4097, 1, 4095], 1024, 1),
    ([32768], 2048, 0),
    ([8192, 0, 8191, 8193], 4096, 5000),
    ([1] * 300, 64, 0),
    ([0] * 299 + [70000], 2048, 3),
    ([127] * 129, 64, 0),
]


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("case", range(len(EDGE_CASES)))
def test_generated_source_matches_torch_tables_edge_cases(host_kernels, monkeypatch, dtype, case):
    lens, L, tail = EDGE_CASES[case]
    cu = offsets(lens, dtype)
    T = int(cu[-1]) + tail
    assert_tables_equal(run_host(host_kernels, cu, L, T, monkeypatch), build_segment_tables(cu, L, T=T), f"{lens} L={L}")


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_generated_source_matches_torch_tables_random_mixes(host_kernels, monkeypatch, dtype):
    gen = torch.Generator().manual_seed(17 if dtype == torch.int32 else 23)
    for c in range(150):
        L = [64, 128, 1024, 2048, 4096][c % 5]
        lens = random_mix(gen, L)
        cu = offsets(lens, dtype)
        tail = [0, 0, 1, 63, L, 3 * L + 5][c % 6]
        T = int(cu[-1]) + tail
        assert_tables_equal(run_host(host_kernels, cu, L, T, monkeypatch), build_segment_tables(cu, L, T=T),
                            f"case {c} L={L} T={T} lens={lens[:12]}")


@needs_cxx
def test_generated_source_large_offsets(host_kernels, monkeypatch):
    """Offsets past 2^31 (int64; the int64 arithmetic) and int32 offsets up to 2^31 - 1."""
    big = [2**30, 2**30 + 12345, 0, 1, 3 * 2**20 + 7]
    cu = offsets(big, torch.int64)
    T = int(cu[-1]) + 999
    assert T > 2**31
    assert_tables_equal(run_host(host_kernels, cu, 2**20, T, monkeypatch), build_segment_tables(cu, 2**20, T=T))
    cu = offsets([2**31 - 2 - 4096 * 3, 1, 4096 * 3], torch.int32)
    T = 2**31 - 1
    assert_tables_equal(run_host(host_kernels, cu, 4096, T, monkeypatch), build_segment_tables(cu, 4096, T=T))


@needs_cxx
@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_generated_source_leading_offset(host_kernels, monkeypatch, dtype):
    """Outside the documented contract (cu[0] > 0, slots before the first sequence): still the torch
    tables, the search clamping to sequence 0 as the torch code's searchsorted does."""
    for lead, L in ((5, 64), (130, 64), (5000, 1024)):
        cu = offsets([70, 0, 200], dtype, lead=lead)
        T = int(cu[-1]) + 10
        assert_tables_equal(run_host(host_kernels, cu, L, T, monkeypatch), build_segment_tables(cu, L, T=T))


# --------------------------------------------------------------------------------------------
# the wrapper
# --------------------------------------------------------------------------------------------


@pytest.mark.parametrize("L", [0, -64, 32, 100, True, 64.5])
def test_rejects_bad_segment_len(L):
    with pytest.raises(ValueError, match="segment_len"):
        segments.segment_tables_device(torch.tensor([0, 10]), L, 10)


def test_rejects_missing_or_negative_T_and_bad_offsets():
    with pytest.raises(ValueError, match="T .*required"):
        segments.segment_tables_device(torch.tensor([0, 10]), 64)
    with pytest.raises(ValueError, match="T must be >= 0"):
        segments.segment_tables_device(torch.tensor([0, 10]), 64, -1)
    with pytest.raises(ValueError, match="1-D"):
        segments.segment_tables_device(torch.zeros(0, dtype=torch.int32), 64, 10)
    with pytest.raises(ValueError, match="1-D"):
        segments.segment_tables_device(torch.zeros(2, 2, dtype=torch.int32), 64, 10)
    with pytest.raises(ValueError, match="1-D"):
        segments.segment_tables_device(None, 64, 10)


@pytest.mark.parametrize("dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("T,L", [(0, 64), (63, 64), (300, 64), (5000, 1024)])
def test_no_sequences(dtype, T, L):
    """N == 0 (M = T // L, 0 when T < L): torch ops, no kernel, the torch tables."""
    cu = torch.zeros(1, dtype=dtype)
    got = segments.segment_tables_device(cu, L, T)
    assert got.N == 0 and got.M == T // L
    assert_tables_equal(got, build_segment_tables(cu, L, T=T))


def test_cpu_offsets_fall_back_to_torch_ops(monkeypatch):
    """Offsets not on an sm_90 device (here CPU) take `build_segment_tables`; no kernel is built."""
    def no_build(dt):
        raise AssertionError("no kernel for CPU offsets")

    monkeypatch.setattr(tk, "build_segment_tables_kernel", no_build)
    cu = offsets([0, 1, 63, 64, 65, 0, 130], torch.int32)
    assert not tk.kernel_supported(cu)
    assert_tables_equal(segments.segment_tables_device(cu, 64, 500), build_segment_tables(cu, 64, T=500))
    cu16 = offsets([3, 70], torch.int16)
    assert_tables_equal(segments.segment_tables_device(cu16, 64, 80), build_segment_tables(cu16, 64, T=80))


class _Recorder:
    """A stand-in kernel that records its arguments and writes nothing."""

    def __init__(self):
        self.calls = []

    def __call__(self, *args):
        self.calls.append(args)


def test_launch_layout_and_no_host_sync(monkeypatch):
    """One launch with the argument order and shapes of the kernel; every field a contiguous 1-D view
    of its table's size and dtype, rows 64-byte aligned; nothing on the path reads a tensor value."""
    cu = offsets([5, 0, 300, 64], torch.int32)
    N, L, T = 4, 64, 500
    M = T // L + N
    rec = _Recorder()

    def refuse(*a, **k):
        raise AssertionError("host synchronisation on the launch path")

    for name in ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__index__", "__float__"):
        monkeypatch.setattr(torch.Tensor, name, refuse)
    monkeypatch.setattr(tk, "kernel_supported", lambda cu: True)
    monkeypatch.setattr(tk, "build_segment_tables_kernel", lambda dt: rec)
    tab = segments.segment_tables_device(cu, L, T)
    monkeypatch.undo()

    assert len(rec.calls) == 1
    kcu, kL, pseudo, slot_tab, flag_tab, seq_tab = rec.calls[0]
    assert kcu is cu and kL == L and isinstance(kL, int)
    assert pseudo.shape == (M + 1,) and pseudo.dtype == torch.int32
    assert slot_tab.shape == (6, 64) and slot_tab.dtype == torch.int64
    assert flag_tab.shape == (5, 64) and flag_tab.dtype == torch.uint8
    assert seq_tab.shape == (3, 64) and seq_tab.dtype == torch.int64
    assert (tab.N, tab.M, tab.segment_len) == (N, M, L)
    assert tab.cu_seqlens is pseudo
    for f, (dt, n) in {"seq": (torch.int64, M), "index": (torch.int64, M), "start": (torch.int64, M),
                       "end": (torch.int64, M), "prev": (torch.int64, M), "h0_index": (torch.int64, M),
                       "valid": (torch.bool, M), "first": (torch.bool, M), "last": (torch.bool, M),
                       "need_transition": (torch.bool, M), "need_correction": (torch.bool, M),
                       "seq_first": (torch.int64, N), "seq_num": (torch.int64, N), "seq_last": (torch.int64, N)}.items():
        t = getattr(tab, f)
        assert t.dtype == dt and t.shape == (n,) and t.is_contiguous(), f
        assert t.data_ptr() % 64 == 0, f
    # the fields are disjoint rows of the three buffers
    assert tab.index.data_ptr() - tab.seq.data_ptr() == 64 * 8
    assert tab.first.data_ptr() - tab.valid.data_ptr() == 64


def test_module_has_no_host_sync_calls():
    """The kernel module and the wrapper never read device values on the host: no call of a reading
    method anywhere in them."""
    import ast
    import inspect
    import textwrap

    for src in (inspect.getsource(tk), textwrap.dedent(inspect.getsource(segments.segment_tables_device))):
        tree = ast.parse(src)
        called = {node.func.attr for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)}
        assert not called & {"item", "tolist", "cpu", "numpy", "synchronize", "to"}, called

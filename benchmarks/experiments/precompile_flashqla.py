"""Build FlashQLA 0.1.3's TileLang kernels on the CPU machine into a TileLang disk cache that the GPU
machine then loads instead of compiling them (75-290 s per head configuration there).

Run here (no GPU; nvcc and TileLang 0.1.15 installed). FlashQLA comes from a folder of its own, not
the system python (its wheel is the same file as the one in `.device/site.tar.xz`; that bundle's
tvm_ffi is built for Python 3.12 and does not load under this machine's 3.11, so only FlashQLA goes
on the path):

    python -m pip install --no-deps --target /tmp/fqla flash-qla==0.1.3
    python benchmarks/experiments/precompile_flashqla.py --site /tmp/fqla --bwd \\
        --heads 16/32,8/16,4/8,2/4 --mixes all --cache-dir /tmp/fqla-cache --pack /tmp/fqla-cache.tar.xz

and on the GPU machine, before the benchmark (seconds, nothing compiled, nothing launched):

    python benchmarks/experiments/precompile_flashqla.py --bwd --check   # exit 1 if a kernel is missing

How. With no GPU, it fakes one for torch (capability 9.0, `--sm-count` multiprocessors, default 132
as the H100 SXM and H200 report) before FlashQLA is imported, so that FlashQLA picks its Hopper
kernels and sizes its plans as on the GPU, and TileLang's target auto-detection returns what it
returns on an H100: `{"kind": "cuda", "arch": "sm_90a"}` (host "c", execution backend tvm_ffi).
Then it calls FlashQLA exactly as `flashqla.bench.impls` does (its `_flash_qla_train` /
`_flash_qla_forward`, so `patch_flash_qla_bwd`'s `tl.disable_buffer_init_check` is applied the
same way) on CPU tensors made with torch.empty (shapes, dtypes and cu_seqlens of the row), with
every JIT call of FlashQLA recorded and answered with a kernel that launches nothing. Each distinct
call is then elaborated and compiled with the JIT object's own settings through
`tilelang.jit.compile`, the path `JITImpl.compile` takes, so the cache key is the one the GPU
computes. `--jobs` compiles that many kernels at once (threads; nvcc runs as a subprocess).

What is built. Per head configuration of the backward grid (`--bwd`, the calls of a training
step: forward with its CP cache, then backward): 12 kernels when FlashQLA's intra-card CP plan
splits the row (every row of the grid except 16/32 8k_8seq), plus the unsplit forward kernel where
it does not (16/32 8k_8seq: 1 more); 49 kernels for the grid's 4 head configurations. Measured here
(2 cores, nvcc 13.0, `--jobs 2`): the whole backward grid in 3 min (303 s of compile summed over
kernels, 165 s wall), 31.7 MB in the cache, 0.88 MB as tar.xz (the cubins inside the kernel
libraries and in `cuda-binaries/` compress together); per head configuration 60 s of compile (16/32:
90 s), of which the fused backward 21-34 s; one head configuration alone 0.42 MB packed. The
forward grid (`--fwd`, inference calls of the public op): 65 kernels over its 9 head configurations
(not built here). `flashqla.bench.multigpu`'s FlashQLA calls (inter-card CP) are not covered.

What depends on the sequence mix. Only through FlashQLA's host-side choices: (1) whether the
intra-card CP split happens (its calibrated sm90 model on the lengths, the value heads, the SM
count and training vs inference), which decides whether the CP kernels (warm-up chunk counts,
prepare_h with is_cp, correct_h0, prepare_dh) and the is_cp variant of the forward kernel are
called; (2) the forward kernel's `block_DV` (32/64/128 from parts x value heads against 0.7 x SMs).
The number of parts, the lengths, T and cu_seqlens' values are runtime arguments, not in the key.
cu_seqlens' dtype (int32 here), the q/k/v dtype, g and beta's dtype (fp32) and scale are in it.

The cache key (TileLang 0.1.15, `tilelang/cache/kernel_cache.py`, `KernelCache._generate_key`):
sha256 of the PrimFunc's `script(show_meta=True)`, out_idx, str(target) (the JSON above, no field
read off a device), target_host, execution backend, the normalized pass configs, compile flags,
TileLang's version and platform.machine(); no nvcc version, no path, no torch version (torch only
on macOS), no library hash unless TILELANG_KERNEL_CACHE_USE_LIB_STAMP is set. Checked here: the
keys are the same across PYTHONHASHSEED values, with TileLang and FlashQLA installed under other
folders, and with TILELANG_ENABLE_IR_SPAN=0; without the buffer-init patch the fused backward's and
prepare_dh's keys change (so the patch must be applied on both sides, as here). Python 3.12 (the
GPU image has 3.12.3): the 25 kernels of 2/4 and 16/32 computed the same keys under Python 3.12.1
with the GPU bundle's own tvm_ffi and TileLang (torch replaced by a stand-in there: no CPU torch
for 3.12 here). Not checked: a load on the GPU machine itself: run `--check` there first.

Limits. Keys differ (a miss, then a normal compile there) if on either side: the SM count differs
from `--sm-count` (plans and block_DV change: an H100 PCIe has 114), TILELANG_DEFAULT_TARGET (other
than {"kind": "cuda", "arch": "sm_90a"}, which gives the same keys), TILELANG_EXECUTION_BACKEND,
TILELANG_LAYOUT_COST_MODEL or TILELANG_KERNEL_CACHE_USE_LIB_STAMP is set, the TileLang or FlashQLA
version differs, or FlashQLA is called otherwise than `flashqla.bench.impls` calls it (another
dtype, no initial state, dense inputs, another `state_v_first`). The kernel library is portable
(it needs libc's GLIBC_2.2.5 symbols and TVM-FFI's, resolved at load); its cubin is nvcc 13.0's
(the GPU machine's driver 580 runs CUDA 13.0 code). The cache's `cuda-binaries/` entries (nvcc
outputs) are keyed with TileLang's absolute include paths and do not hit on the GPU unless TileLang
sits at the same path; they are not needed for a hit on the kernel entries
(`<version>/linux-x86_64/kernels/`). `.device/on-device.sh` unpacks one
`.device/tilelang-cache.tar.xz`: build FlashQLA's kernels into the same cache folder as ours before
packing (or unpack both archives into TILELANG_CACHE_DIR).
"""
from __future__ import annotations

import argparse
import contextlib
import os
import sys
import tarfile
import time
import types
from concurrent.futures import ThreadPoolExecutor

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
H100_SMS = 132


def fake_hopper(sm_count: int = H100_SMS, capability: tuple[int, int] = (9, 0)) -> None:
    """Makes torch report one CUDA device of `capability` with `sm_count` multiprocessors, and
    TileLang's no-target compute-version query answer it (FlashQLA asks at import)."""
    import torch

    props = types.SimpleNamespace(multi_processor_count=sm_count, major=capability[0], minor=capability[1],
                                  name="faked Hopper", total_memory=80 << 30)
    torch.cuda.is_available = lambda: True
    torch.cuda.device_count = lambda: 1
    torch.cuda.current_device = lambda: 0
    torch.cuda.get_device_capability = lambda device=None: capability
    torch.cuda.get_device_properties = lambda device=None: props
    torch.cuda.is_current_stream_capturing = lambda: False
    torch.cuda.device = lambda index=None: contextlib.nullcontext()   # FlashQLA's input_guard

    from tilelang.contrib import nvcc
    from tvm.target import Target

    original = nvcc.get_target_compute_version

    def get_target_compute_version(target=None):
        if target is None and Target.current(allow_none=True) is None:
            return f"{capability[0]}.{capability[1]}"
        return original(target)

    nvcc.get_target_compute_version = get_target_compute_version


class Recorder:
    """Replaces FlashQLA's JIT calls by a recorder (returns a kernel that launches nothing) and
    TileLang kernel launches by no-ops."""

    def __init__(self):
        from tilelang.jit import JITImpl
        from tilelang.jit.kernel import JITKernel

        self.calls: dict[str, tuple] = {}   # repr of the call -> (jit object, name, args, kwargs)
        JITKernel.__call__ = lambda self, *a, **k: None
        calls = self.calls

        def record(jit, *args, **kwargs):
            name = getattr(getattr(jit, "func", None), "orig_func", jit).__name__
            key = repr((name, args, sorted(kwargs.items())))
            calls.setdefault(key, (jit, name, args, kwargs))
            return lambda *a, **k: None

        JITImpl.__call__ = record


def describe(name, args, kwargs) -> str:
    text = ",".join(map(str, args)) + " " + " ".join(f"{k}={v}" for k, v in kwargs.items())
    return f"{name.removeprefix('tilelang_')}({text.strip()})".replace("torch.", "")


def row_inputs(H: int, HV: int, lengths, grads: bool):
    """The benchmark's RowInputs (flashqla.bench.inputs) with torch.empty CPU tensors of its shapes
    and dtypes: bf16 q/k/v/do, fp32 g/beta/h0/dht, int32 cu_seqlens."""
    import torch
    from flashqla.bench.inputs import RowInputs

    T, N = sum(lengths), len(lengths)
    e = torch.empty
    cu = [0]
    for n in lengths:
        cu.append(cu[-1] + n)
    x = RowInputs(e(1, T, H, 128, dtype=torch.bfloat16), e(1, T, H, 128, dtype=torch.bfloat16),
                  e(1, T, HV, 128, dtype=torch.bfloat16), e(1, T, HV, dtype=torch.float32),
                  e(1, T, HV, dtype=torch.float32), e(N, HV, 128, 128, dtype=torch.float32),
                  torch.tensor(cu, dtype=torch.int32), tuple(lengths))
    if grads:
        x.do = e(1, T, HV, 128, dtype=torch.bfloat16)
        x.dht = e(N, HV, 128, 128, dtype=torch.float32)
    return x


def cp_plan(x, is_train: bool) -> str:
    from flash_qla.ops.gated_delta_rule.chunk import CHUNK_SIZE, _auto_intra_cp_context

    ctx = _auto_intra_cp_context(x.k, x.v, x.cu_seqlens, CHUNK_SIZE, True, is_train)
    return f"CP split, {ctx.intra_cp_cu_seqlens.numel() - 1} parts" if ctx.is_intra else "no CP split"


def record_rows(rows, direction: str, rec: Recorder, quiet: bool = False) -> None:
    import torch
    from flashqla.bench import impls
    from flashqla.bench.runner import row_label

    if direction == "bwd":
        fwd, bwd, _ = impls._flash_qla_train()
    else:
        run, _ = impls._flash_qla_forward()
    for row in rows:
        x = row_inputs(row.heads.h_qk, row.heads.h_v, row.mix.lengths, grads=direction == "bwd")
        n0 = len(rec.calls)
        with torch.no_grad():
            if direction == "bwd":
                bwd(x, fwd(x).saved)
            else:
                run(x)
        if not quiet:
            print(f"{direction} {row_label(direction, row):28s} {cp_plan(x, direction == 'bwd'):20s} "
                  f"{len(rec.calls) - n0} new kernels ({len(rec.calls)} so far)", flush=True)


def cache_key(jit, tir) -> tuple[str, str]:
    """(key, cache entry path) of `tir` compiled with `jit`'s settings, as `tilelang.jit.compile`
    computes them, without compiling."""
    from tilelang.cache.kernel_cache import KernelCache
    from tilelang.jit import compile as tl_compile

    class _Key(Exception):
        pass

    original = KernelCache._generate_key

    def generate(self, *a, **k):
        raise _Key(original(self, *a, **k), self)

    KernelCache._generate_key = generate
    try:
        tl_compile(tir, out_idx=jit.out_idx, execution_backend=jit.execution_backend, target=jit.target,
                             target_host=jit.target_host, verbose=jit.verbose, pass_configs=jit.pass_configs,
                             compile_flags=jit.compile_flags)
    except _Key as k:
        key, cache = k.args
        return key, cache._get_cache_path(key)
    finally:
        KernelCache._generate_key = original
    raise RuntimeError("TileLang compiled without computing a cache key (cache disabled?)")


def build(calls, jobs: int) -> list[tuple[str, float, bool]]:
    """Elaborates each call in this thread, then compiles `jobs` at a time; returns
    (description, seconds, was in the cache already) per kernel."""
    from tilelang.jit import compile as tl_compile

    todo = []
    for jit, name, args, kwargs in calls:
        tir = jit.get_tir(*args, **kwargs)
        _, path = cache_key(jit, tir)
        todo.append((jit, describe(name, args, kwargs), tir, os.path.isdir(path)))

    def one(item):
        jit, text, tir, cached = item
        t = time.time()
        tl_compile(tir, out_idx=jit.out_idx, execution_backend=jit.execution_backend, target=jit.target,
                             target_host=jit.target_host, verbose=jit.verbose, pass_configs=jit.pass_configs,
                             compile_flags=jit.compile_flags)
        dt = time.time() - t
        print(f"  {'cached' if cached else 'built '} {dt:6.1f} s  {text}", flush=True)
        return text, dt, cached

    with ThreadPoolExecutor(max(1, jobs)) as ex:
        return list(ex.map(one, todo))


def pack(cache_dir: str, out: str) -> int:
    """Writes cache_dir's contents (no staging folders) to `out` as tar.xz; returns its size."""
    def keep(info):
        return None if "/.staging" in "/" + info.name else info

    os.makedirs(os.path.dirname(os.path.abspath(out)), exist_ok=True)
    with tarfile.open(out, "w:xz", preset=6) as tar:
        for name in sorted(os.listdir(cache_dir)):
            tar.add(os.path.join(cache_dir, name), arcname=name, filter=keep)
    return os.path.getsize(out)


def du(path: str) -> int:
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(path) for f in fs)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--heads", default="all", help="head configs h_qk/h_v, comma-separated (default: the grid's)")
    ap.add_argument("--mixes", default="all", help="mixes (8k_1seq, 1x8192, 5000+3192...), comma-separated")
    ap.add_argument("--bwd", action="store_true", help="the backward benchmark's calls (default)")
    ap.add_argument("--fwd", action="store_true", help="the forward benchmark's calls")
    ap.add_argument("--cp-grid", action="store_true", help="--fwd on the context-parallel grid's rows")
    ap.add_argument("--cache-dir", default=None, help="TileLang cache folder (default $TILELANG_CACHE_DIR)")
    ap.add_argument("--pack", metavar="FILE", help="write the cache folder to FILE (tar.xz) afterwards")
    ap.add_argument("--jobs", type=int, default=os.cpu_count() or 1, help="kernels compiled at once")
    ap.add_argument("--list", action="store_true", help="list the kernels the rows call; compile nothing")
    ap.add_argument("--check", action="store_true",
                    help="compute the cache keys only; list the kernels missing from the cache (exit 1 if any)")
    ap.add_argument("--sm-count", type=int, default=H100_SMS, help="SM count of the faked GPU (default 132)")
    ap.add_argument("--site", action="append", default=[], help="folder to put first on sys.path (FlashQLA's)")
    ap.add_argument("--fake", choices=("auto", "yes", "no"), default="auto",
                    help="fake a Hopper GPU (auto: only when torch sees none)")
    a = ap.parse_args(argv)
    directions = [d for d, on in (("fwd", a.fwd), ("bwd", a.bwd or not a.fwd)) if on]

    if a.cache_dir:
        os.environ["TILELANG_CACHE_DIR"] = os.path.abspath(a.cache_dir)
    for p in reversed(a.site):
        sys.path.insert(0, os.path.abspath(p))
    sys.path.insert(0, ROOT)

    import torch

    faked = a.fake == "yes" or (a.fake == "auto" and not torch.cuda.is_available())
    if faked:
        fake_hopper(a.sm_count)
    try:
        import flash_qla
    except ImportError as exc:
        print(f"FlashQLA does not import ({exc}): install it into a folder of its own "
              "(python -m pip install --no-deps --target DIR flash-qla==0.1.3) and pass --site DIR", file=sys.stderr)
        return 2
    import tilelang
    from tilelang import env as tl_env
    from flashqla.bench import grid

    print(f"flash_qla {flash_qla.__version__} ({os.path.dirname(flash_qla.__file__)}), tilelang {tilelang.__version__}, "
          f"torch {torch.__version__}, python {sys.version.split()[0]}; "
          f"{'faked Hopper, %d SMs' % a.sm_count if faked else torch.cuda.get_device_name()}; "
          f"cache {tl_env.TILELANG_CACHE_DIR}", flush=True)
    rec = Recorder()
    t0 = time.time()
    heads = None if a.heads == "all" else a.heads.split(",")
    mixes = None if a.mixes == "all" else a.mixes.split(",")
    for d in directions:
        record_rows(grid.rows_for(d, heads, mixes, cp_grid=a.cp_grid and d == "fwd"), d, rec)
    calls = list(rec.calls.values())
    print(f"{len(calls)} distinct kernels ({time.time() - t0:.1f} s)", flush=True)

    if a.list:
        for jit, name, args, kwargs in calls:
            print("  " + describe(name, args, kwargs))
        return 0
    if a.check:
        missing = 0
        for jit, name, args, kwargs in calls:
            key, path = cache_key(jit, jit.get_tir(*args, **kwargs))
            ok = os.path.isdir(path)
            missing += not ok
            print(f"  {'present' if ok else 'MISSING'} {key[:16]}  {describe(name, args, kwargs)}", flush=True)
        print(f"{len(calls) - missing} of {len(calls)} kernels in the cache ({time.time() - t0:.1f} s)")
        return 1 if missing else 0

    results = build(calls, a.jobs)
    built = [r for r in results if not r[2]]
    print(f"{len(built)} kernels built ({sum(r[1] for r in built):.0f} s of compile), "
          f"{len(results) - len(built)} already cached; {time.time() - t0:.0f} s wall; "
          f"cache {du(tl_env.TILELANG_CACHE_DIR) / 1e6:.1f} MB", flush=True)
    if a.pack:
        size = pack(tl_env.TILELANG_CACHE_DIR, a.pack)
        print(f"packed {a.pack}: {size / 1e6:.2f} MB", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())

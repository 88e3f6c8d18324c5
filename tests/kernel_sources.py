"""Digests of the CUDA source TileLang generates for every kernel `flashqla.warmup` builds (with
`fp16_products=True`: the opt-in fp16 A_beta product's builds too).

A refactor that must not change any kernel (moving code, renaming Python functions, removing dead
variants) is checked by lowering every build of a set of head configurations for sm_90a on the CPU
(TileLang's lowering only: no nvcc, no GPU) and comparing the SHA-256 of each generated source with
the committed record `tests/data/kernel_sources.json`.

    python tests/kernel_sources.py --check [-j 2]     # compare with the record (exit 1 on a change)
    python tests/kernel_sources.py --write [-j 2]     # rewrite the record (after a deliberate change)
    python tests/kernel_sources.py --write --configs NAME[,NAME]   # rewrite those configurations only

`tests/test_kernel_sources.py` checks one build of each kind of one configuration in the CPU tier, and
every build of every configuration under the `compile_all` marker. Every lowered source is also
scanned by `async_store_hazards` (a TMA-stored tile rewritten with no barrier after the store wait):
a hit fails the lowering.
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import subprocess
import sys
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

RECORD = Path(__file__).resolve().parent / "data" / "kernel_sources.json"

#: warmup() arguments whose builds are recorded: every kernel family, both dtypes, both beta dtypes,
#: packed and fixed-length batches, both offset dtypes, G = HV / H of 1, 2, 4 and 8.
CONFIGS = {
    "2-4-bf16-f32-varlen-i32": dict(H=2, HV=4, dtype="bfloat16", beta_dtype="float32", varlen=True, seqlens_dtype="int32"),
    "2-4-bf16-f32-fixed": dict(H=2, HV=4, dtype="bfloat16", beta_dtype="float32", varlen=False, seqlens_dtype="int32"),
    "4-16-bf16-bf16-varlen-i64": dict(H=4, HV=16, dtype="bfloat16", beta_dtype="bfloat16", varlen=True, seqlens_dtype="int64"),
    "8-8-fp16-f32-varlen-i32": dict(H=8, HV=8, dtype="float16", beta_dtype="float32", varlen=True, seqlens_dtype="int32"),
    "8-8-bf16-f32-fixed": dict(H=8, HV=8, dtype="bfloat16", beta_dtype="float32", varlen=False, seqlens_dtype="int32"),
    "2-16-fp16-fp16-fixed": dict(H=2, HV=16, dtype="float16", beta_dtype="float16", varlen=False, seqlens_dtype="int32"),
}

#: The configuration the CPU tier checks on every run (the others: marker `compile_all`).
QUICK = "2-4-bf16-f32-varlen-i32"


def digest(source: str) -> str:
    return hashlib.sha256(source.encode()).hexdigest()


#: what orders the other threads after one thread's `tma_store_wait` in TileLang's generated CUDA: a CTA
#: barrier, a partial (named) barrier, or an mbarrier arrive (whose count includes the issuing thread)
_ORDERING = ("__syncthreads", "tl::__sync_thread_partial", ".arrive(")


def async_store_hazards(source: str) -> list:
    """Places in a generated CUDA source where a shared-memory tile stored by TMA store
    (`tl::tma_store(desc, &tile[...], ...)`) is written again by threads after a `tl::tma_store_wait`
    with no barrier or mbarrier arrive in between. Only the thread that issued a TMA store has a bulk
    group to wait for (the other threads' wait returns at once), so without the barrier they can
    overwrite the tile while the copy engine still reads it; TileLang's barrier pass does not model
    the copy engine. Scans forward from each wait in text order (a loop's next iteration starts
    textually at the loop's top: the prepare kernel waits at the top of its value-head loop for the
    store issued at its bottom). Returns one line per hazard (empty: none)."""
    import re

    lines = source.splitlines()
    tiles = set(re.findall(r"tl::tma_store\([^,]+,\s*\(&\(\(\([\w ]+\*\)(\w+)\)", source))
    bad = []
    for i, ln in enumerate(lines):
        if "tl::tma_store_wait<" not in ln:
            continue
        for j in range(i + 1, len(lines)):
            cur = lines[j]
            if any(o in cur for o in _ORDERING):
                break
            lhs = cur.split(" = ", 1)[0] if " = " in cur else ""
            hit = next((t for t in tiles if re.search(rf"\b{t}\b", lhs)), None)
            if hit:
                bad.append(f"line {i + 1}: tma_store_wait, then line {j + 1} writes {hit} with no barrier between: "
                           f"{cur.strip()[:120]}")
                break
    return bad


def config_sources(name: str, one_per_kind: bool = False, part: tuple[int, int] = (0, 1)) -> list:
    """[(kernel symbol, sha256 of its CUDA source), ...] of every kernel warmup(**CONFIGS[name]) builds,
    sorted; lowers each PrimFunc for sm_90a in this process instead of compiling it. one_per_kind:
    only the first build of each kind in warmup's list (`registry.op_kernel_specs`), a sample; part
    (i, n): of that sample, the kinds i, i + n, i + 2n, ... only."""
    import threading

    import tilelang
    import torch
    from tilelang import tvm

    import flashqla

    found, lock = [], threading.Lock()

    class _Lowered:
        def __init__(self, source):
            self.source = source

        def get_kernel_source(self):
            return self.source

    def lower_only(func, target=None, pass_configs=None, out_idx=None, **_):
        # one lowering at a time: warmup builds in threads, and concurrent lowerings are not
        # guaranteed to give the same source as sequential ones
        with lock, tvm.transform.PassContext(config=pass_configs or {}), tvm.target.Target(target):
            src = tilelang.lower(func, target=target).kernel_source
            found.append((str(func.attrs["global_symbol"]), digest(src)))
        hazards = async_store_hazards(src)
        if hazards:
            raise RuntimeError(f"{func.attrs['global_symbol']}: a TMA-stored tile rewritten without a barrier after "
                               f"the store wait: {hazards}")
        return _Lowered(src)

    tilelang.compile = lower_only
    # one build at a time: warmup builds in threads, and TileLang's tracing and lowering of one
    # PrimFunc in two threads at once can emit equivalent sources that differ in names
    import concurrent.futures

    concurrent.futures.ThreadPoolExecutor = lambda *a, **k: concurrent.futures.thread.ThreadPoolExecutor(1)
    cfg = dict(CONFIGS[name])
    if one_per_kind:
        from flashqla.ops.gdn.kernels.sm90 import registry

        specs = {}
        for bv in (64, 128):
            for kind, args in registry.op_kernel_specs(cfg["H"], cfg["HV"], varlen=cfg["varlen"], dtype=cfg["dtype"],
                                                       beta_dtype=cfg["beta_dtype"], block_v=bv,
                                                       seq_dtype=cfg["seqlens_dtype"] if cfg["varlen"] else "int32"):
                specs.setdefault(kind, args)
        i, n = part
        for kind, args in list(specs.items())[i::n]:
            registry.build(kind, args)
        return sorted(found)
    for key in ("dtype", "beta_dtype", "seqlens_dtype"):
        cfg[key] = getattr(torch, cfg[key])
    flashqla.warmup(**cfg, backward=True, fp16_products=True)  # the opt-in fp16 A_beta builds recorded too
    return sorted(found)


def _run_one(name: str, one_per_kind: bool = False, parts: int = 1) -> list:
    """`config_sources(name, one_per_kind)` in a process of its own (the lowering patches TileLang's
    compile and the builders' caches keep what it returns: nothing of it may stay in the caller);
    with one_per_kind, the sample split over `parts` processes run side by side."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FLASHQLA_")}
    n = parts if one_per_kind else 1
    cmds = [[sys.executable, __file__, "--one", name] + (["--one-per-kind", "--part", f"{i}/{n}"] if one_per_kind else [])
            for i in range(n)]
    procs = [subprocess.Popen(c, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env,
                              cwd=Path(__file__).resolve().parents[1]) for c in cmds]
    outs = [proc.communicate() for proc in procs]  # every process waited for before any error is raised
    found = []
    for proc, (stdout, stderr) in zip(procs, outs):
        if proc.returncode:
            raise RuntimeError(f"lowering {name} failed:\n{stderr[-4000:]}")
        found += json.loads(stdout.strip().splitlines()[-1])
    return sorted(found)


def collect(names, jobs: int = 2) -> dict:
    """{config name: [[symbol, sha256], ...]} for `names`, each in its own process."""
    with ThreadPoolExecutor(jobs) as ex:
        return dict(zip(names, (list(map(list, r)) for r in ex.map(_run_one, names))))


def compare(got: dict, want: dict) -> list:
    """Lines naming every configuration whose sources differ from the record (empty: identical)."""
    bad = []
    for name, rows in got.items():
        ref = want.get(name)
        if ref is None:
            bad.append(f"{name}: not in the record")
            continue
        if sorted(map(tuple, rows)) != sorted(map(tuple, ref)):
            new = sorted(set(map(tuple, rows)) - set(map(tuple, ref)))
            gone = sorted(set(map(tuple, ref)) - set(map(tuple, rows)))
            bad.append(f"{name}: {len(rows)} builds against {len(ref)} recorded; new {new}; missing {gone}")
    return bad


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--write", action="store_true")
    p.add_argument("--check", action="store_true")
    p.add_argument("--one", help=argparse.SUPPRESS)
    p.add_argument("--one-per-kind", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--part", default="0/1", help=argparse.SUPPRESS)
    p.add_argument("-j", "--jobs", type=int, default=2)
    p.add_argument("--configs", default=",".join(CONFIGS))
    a = p.parse_args(argv)
    if a.one:
        i, n = (int(x) for x in a.part.split("/"))
        print(json.dumps(config_sources(a.one, a.one_per_kind, (i, n))))
        return 0
    names = a.configs.split(",")
    got = collect(names, a.jobs)
    if a.write:  # the configurations not named keep their recorded digests
        RECORD.parent.mkdir(parents=True, exist_ok=True)
        record = json.loads(RECORD.read_text()) if RECORD.exists() else {}
        record = {n: r for n, r in record.items() if n in CONFIGS}
        record.update(got)
        RECORD.write_text(json.dumps(record, indent=1, sort_keys=True) + "\n")
        print(f"wrote {RECORD}: {sum(map(len, got.values()))} builds in {len(got)} configurations "
              f"({len(record)} recorded)")
        return 0
    bad = compare(got, json.loads(RECORD.read_text()))
    print("\n".join(bad) or f"identical: {sum(map(len, got.values()))} builds in {len(got)} configurations")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

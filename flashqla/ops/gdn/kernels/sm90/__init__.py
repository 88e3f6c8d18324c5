"""TileLang kernels for Hopper (sm_90a), one module per fused kernel.

Forward (two launches):
    prepare.py    `chunk_prepare_fwd`:   chunk-local cumsum of g, K K^T, the gated WY inverse A (x beta)
    recurrent.py  `chunk_recurrent_fwd`: the state recurrence and the output, state on chip

`build_kernels` compiles the kernels of one configuration concurrently; `precompile` fills TileLang's
disk cache for many configurations in worker processes (a warm start for test suites and servers).
Nothing here imports TileLang until a kernel is built.
"""

from __future__ import annotations

__all__ = ["build_kernels", "precompile"]


def _build(kind: str, args: tuple):
    if kind == "prepare":
        from flashqla.ops.gdn.kernels.sm90.prepare import build_prepare_kernel

        return build_prepare_kernel(*args)
    if kind == "recurrent":
        from flashqla.ops.gdn.kernels.sm90.recurrent import build_recurrent_kernel

        return build_recurrent_kernel(*args)
    raise ValueError(f"unknown kernel kind {kind!r}")


def _build_in_worker(spec) -> str:
    _build(*spec)
    return spec[0]


def build_kernels(specs) -> list:
    """Builds (or fetches from cache) the kernels [(kind, args), ...] concurrently in threads.

    kind is "prepare" (args of `build_prepare_kernel`) or "recurrent" (`build_recurrent_kernel`).
    Threads overlap the external compiler runs; the first call of the op uses this for its two
    kernels.
    """
    from concurrent.futures import ThreadPoolExecutor

    specs = list(specs)
    if len(specs) <= 1:
        return [_build(*s) for s in specs]
    with ThreadPoolExecutor(len(specs)) as ex:
        return list(ex.map(lambda s: _build(*s), specs))


def precompile(specs, max_workers: int | None = None) -> None:
    """Compiles [(kind, args), ...] in worker processes into TileLang's disk cache, then loads them
    into this process (each load is a cache hit). Needs no GPU."""
    import multiprocessing as mp
    import os
    from concurrent.futures import ProcessPoolExecutor

    specs = list(dict.fromkeys(specs))
    workers = max_workers or min(len(specs), os.cpu_count() or 1)
    if workers > 1 and len(specs) > 1:
        with ProcessPoolExecutor(workers, mp_context=mp.get_context("spawn")) as ex:
            list(ex.map(_build_in_worker, specs))
    for s in specs:
        _build(*s)

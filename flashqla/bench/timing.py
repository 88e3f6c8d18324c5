"""One timer for every implementation: CUDA-graph replay, median over replays.

`time_cuda_graph(fn)`:

1. warm-up: `warmup` eager calls on a side stream (JIT compilation, autotuning, host-side caches
   keyed on tensor identity such as FLA's `chunk_indices` and FlashQLA's CP plan are filled here,
   so that nothing synchronises the device during capture);
2. one eager call timed with CUDA events sizes the graph: `launches = ceil(target_ms / eager_ms)`,
   clamped to [min_launches, max_launches];
3. capture `launches` back-to-back calls into one CUDA graph; replay it once untimed;
4. replay it `replays` times, each bracketed by CUDA events and preceded by a 256 MB memset that
   evicts the L2 (as tilelang's cudagraph timer does); the per-call time of a replay is its elapsed
   time over `launches`; the result is the median of the replays.

Host overhead (Python, argument checks, CP planning) is outside the graph and is not measured, as
in FlashQLA's benchmark (`tilelang.profiler.do_bench(..., backend="cudagraph")`). Inputs are not
rotated: the smallest rows fit in the 60 MB L2, the same as in the published table.
"""

from __future__ import annotations

import math
import statistics
from dataclasses import dataclass, field

__all__ = ["Timing", "time_cuda_graph", "launches_for", "DEFAULTS"]

#: Default timer settings (overridable from the command line).
DEFAULTS = dict(warmup=3, replays=7, target_ms=25.0, min_launches=3, max_launches=200)


@dataclass
class Timing:
    """Median per-call time `ms` (milliseconds) and what it came from."""

    ms: float
    replays_ms: list[float] = field(default_factory=list)
    launches: int = 0
    eager_ms: float = math.nan

    @property
    def spread(self) -> float:
        """(max - min) / median over the replays: the run-to-run noise of this measurement."""
        if not self.replays_ms or self.ms <= 0:
            return math.nan
        return (max(self.replays_ms) - min(self.replays_ms)) / self.ms


def launches_for(eager_ms: float, target_ms: float, min_launches: int, max_launches: int) -> int:
    """Calls per graph so that one replay lasts about `target_ms` (eager time overestimates the
    device time, so the replay comes out no longer than that)."""
    if not (eager_ms > 0) or math.isinf(eager_ms):
        return max_launches
    return int(min(max_launches, max(min_launches, math.ceil(target_ms / eager_ms))))


def time_cuda_graph(
    fn,
    *,
    warmup: int = DEFAULTS["warmup"],
    replays: int = DEFAULTS["replays"],
    target_ms: float = DEFAULTS["target_ms"],
    min_launches: int = DEFAULTS["min_launches"],
    max_launches: int = DEFAULTS["max_launches"],
) -> Timing:
    """Times `fn()` (no arguments; its return value is dropped) by CUDA-graph replay.

    Returns a `Timing` whose `ms` is the median over `replays` replays of the per-call time.
    Raises RuntimeError when CUDA is not available; errors of `fn` or of the capture propagate.
    """
    import torch

    if not torch.cuda.is_available():
        raise RuntimeError("time_cuda_graph needs a CUDA device")
    side = torch.cuda.Stream()
    side.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(side):
        for _ in range(max(1, warmup)):
            fn()
    torch.cuda.current_stream().wait_stream(side)
    torch.cuda.synchronize()

    start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
    start.record()
    fn()
    end.record()
    end.synchronize()
    eager_ms = start.elapsed_time(end)
    n = launches_for(eager_ms, target_ms, min_launches, max_launches)

    flush = torch.empty(256 * 1024 * 1024, dtype=torch.int8, device="cuda")
    graph = torch.cuda.CUDAGraph()
    try:
        with torch.cuda.graph(graph):
            for _ in range(n):
                fn()
        graph.replay()
        torch.cuda.synchronize()
        times = []
        for _ in range(max(1, replays)):
            flush.zero_()
            start.record()
            graph.replay()
            end.record()
            end.synchronize()
            times.append(start.elapsed_time(end) / n)
    finally:
        del graph, flush
    return Timing(ms=statistics.median(times), replays_ms=times, launches=n, eager_ms=eager_ms)

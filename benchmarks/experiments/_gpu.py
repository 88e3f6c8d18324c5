"""Helpers shared by the experiment scripts of this folder (not a script): inputs made on the GPU, a
CUDA-graph timer, and the scripts' row notation. Import from a script of this folder, whose own
directory is on sys.path (`python benchmarks/experiments/<script>.py`)."""

from __future__ import annotations

import torch

__all__ = ["gen_inputs", "parse_row", "time_graph"]


def parse_row(row: str) -> tuple[int, int, list[int]]:
    """"h_qk/h_v MIX" -> (H, HV, lengths), MIX either COUNTxLENGTH ("1x32768": one sequence; the
    benchmark's own notation, `flashqla.bench.grid.parse_mix`, is LENGTHxCOUNT) or "a+b+..."."""
    heads, mix = row.split()
    H, HV = (int(n) for n in heads.split("/"))
    if "x" in mix:
        count, length = mix.split("x")
        return H, HV, [int(length)] * int(count)
    return H, HV, [int(n) for n in mix.split("+")]


def gen_inputs(H, HV, lengths, varlen, dtype=torch.bfloat16, seed=0, h0=True):
    """Valid-domain inputs made on the GPU (q, k L2-normalised, logsigmoid/16 gate): packed (B = 1,
    int32 cu_seqlens) when `varlen`, else a batch of len(lengths) rows of lengths[0] tokens."""
    g = torch.Generator(device="cuda").manual_seed(seed)
    T = sum(lengths)
    B, Tb = (1, T) if varlen else (len(lengths), lengths[0])
    K = V = 128
    q = torch.nn.functional.normalize(torch.randn(B, Tb, H, K, device="cuda", generator=g), dim=-1).to(dtype)
    k = torch.nn.functional.normalize(torch.randn(B, Tb, H, K, device="cuda", generator=g), dim=-1).to(dtype)
    v = torch.randn(B, Tb, HV, V, device="cuda", generator=g).to(dtype)
    gg = torch.nn.functional.logsigmoid(torch.randn(B, Tb, HV, device="cuda", generator=g)) / 16
    beta = torch.sigmoid(torch.randn(B, Tb, HV, device="cuda", generator=g))
    N = len(lengths) if varlen else B
    h0t = torch.randn(N, HV, K, V, device="cuda", generator=g) if h0 else None
    cu = None
    if varlen:
        cu = torch.tensor([0] + list(torch.tensor(lengths).cumsum(0).tolist()), dtype=torch.int32, device="cuda")
    return dict(q=q, k=k, v=v, g=gg, beta=beta, initial_state=h0t, cu_seqlens=cu)


def time_graph(fn, reps=20, iters=5):
    """Median time of one fn() call in ms: `iters` calls captured in one CUDA graph (after an eager
    call and one on a side stream), replayed `reps` times, each replay timed with CUDA events (no L2
    flush between replays)."""
    fn()
    torch.cuda.synchronize()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        fn()
    torch.cuda.current_stream().wait_stream(s)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for _ in range(iters):
            fn()
    graph.replay()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        a.record()
        graph.replay()
        b.record()
        torch.cuda.synchronize()
        times.append(a.elapsed_time(b) / iters)
    times.sort()
    return times[len(times) // 2]

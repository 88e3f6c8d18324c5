"""One call on the GPU machine: the one-launch segment tables (`flashqla.cp.tables_kernel`) against the
torch-op tables (`flashqla.cp.planner.build_segment_tables`).

    python tests/gpu/segment_tables_check.py [--cases 1500] [--seed 0] [--reps 200]

1. equality, field by field (torch.equal and dtype), of `segment_tables_device(cu, L, T)` and
   `build_segment_tables(cu, L, T=T)`: edge cases (empty and 1-token sequences, one sequence, N == 0,
   lengths off a multiple of 64 by one, offsets past 2^31 in int64, int32 offsets up to 2^31 - 1,
   a view into a larger buffer, a strided view), then random packed mixes (N from 1 to 300, L in
   64 / 128 / 1024 / 2048 / 4096, T up to 2^20, packed tails cu[-1] < T), int32 and int64 offsets;
   each random case is also launched once with its outputs poisoned first (every exposed element
   must be written);
2. CUDA graphs: the wrapper captured once per configuration, cu_seqlens' values rewritten in place
   (same N) between replays, the tables compared after every replay (no stale result);
3. no recompilation: the compile count after the first two builds does not grow;
4. timings, CUDA graph median per call (and eager), torch ops vs the kernel, N = 1, 2, 8, 256.
Exits non-zero on any mismatch. Last line: "segment tables: X/Y cases equal". Not collected by pytest.
"""

import argparse
import os
import sys
import time
import traceback

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from flashqla.cp import tables_kernel as tk  # noqa: E402
from flashqla.cp.planner import build_segment_tables  # noqa: E402

FIELDS = ("cu_seqlens", "seq", "index", "start", "end", "valid", "first", "last", "prev", "h0_index",
          "need_transition", "need_correction", "seq_first", "seq_num", "seq_last")
LS = (64, 128, 1024, 2048, 4096)
T_MAX = 2**20


def mismatches(got, ref) -> list:
    """Names of the fields (and sizes) that differ; empty when the tables are equal."""
    bad = [k for k in ("segment_len", "N", "M") if getattr(got, k) != getattr(ref, k)]
    for f in FIELDS:
        a, b = getattr(got, f), getattr(ref, f)
        if a.dtype != b.dtype or a.shape != b.shape or a.device != b.device or not torch.equal(a, b):
            bad.append(f)
    return bad


def describe(got, ref, f) -> str:
    a, b = getattr(got, f), getattr(ref, f)
    if a.dtype != b.dtype or a.shape != b.shape:
        return f"{f}: {a.dtype} {tuple(a.shape)} vs {b.dtype} {tuple(b.shape)}"
    idx = (a != b).nonzero().flatten()[:8].tolist()
    return f"{f}: first differing indices {idx}: kernel {a[idx].tolist()} torch {b[idx].tolist()}"


def offsets(lengths, dtype, device, lead=0):
    cu = torch.tensor([lead] + list(lengths), dtype=torch.int64).cumsum(0)
    return cu.to(dtype=dtype, device=device)


def random_lengths(gen, L, n_max=300):
    """A random packed mix: empty, 1-token, shorter than L, multiples of 64 and of L, off by one, and
    several segments long; scaled down to at most T_MAX tokens."""
    N = int(torch.randint(1, n_max + 1, (1,), generator=gen)) if torch.rand(1, generator=gen) < 0.6 else \
        int(torch.randint(1, 9, (1,), generator=gen))
    lens = []
    for _ in range(N):
        k = int(torch.randint(1, 9, (1,), generator=gen))
        lens.append([0, 1, int(torch.randint(2, 64, (1,), generator=gen)), 64 * k, 64 * k - 1, 64 * k + 1, L, L - 1,
                     L + 1, int(torch.randint(1, 8 * L, (1,), generator=gen)),
                     int(torch.randint(1, 70000, (1,), generator=gen))][int(torch.randint(0, 11, (1,), generator=gen))])
    total = sum(lens)
    if total > T_MAX - 8 * L:
        f = (T_MAX - 8 * L) / total
        lens = [int(x * f) for x in lens]
    return lens


class Counter:
    def __init__(self):
        self.ok = 0
        self.total = 0
        self.failed = []

    def check(self, name, got, ref):
        self.total += 1
        bad = mismatches(got, ref)
        if bad:
            self.failed.append(name)
            print(f"MISMATCH {name}: " + "; ".join(describe(got, ref, f) if f in FIELDS else f for f in bad), flush=True)
        else:
            self.ok += 1
        return not bad


def poisoned(kernel):
    """The kernel, with every output buffer filled with a poison first."""
    def run(cu, L, pseudo, slot_tab, flag_tab, seq_tab):
        pseudo.fill_(-0x5A5A5A5)
        slot_tab.fill_(-0x77777777)
        flag_tab.fill_(0xA5)
        seq_tab.fill_(-0x66666666)
        kernel(cu, L, pseudo, slot_tab, flag_tab, seq_tab)
    return run


def edge_cases(dev):
    """(name, cu, L, T) outside the random mixes."""
    out = []
    for dt in (torch.int32, torch.int64):
        d = str(dt).split(".")[-1]
        for lens, L, tail in (([0], 64, 0), ([0], 64, 500), ([1], 64, 0), ([64], 64, 0), ([65], 64, 63),
                              ([0, 0, 0], 128, 0), ([0, 1, 63, 64, 65, 0, 130, 5, 0], 64, 0),
                              ([0, 1, 63, 64, 65, 0, 130, 5, 0], 128, 77), ([4097, 1, 4095], 1024, 1),
                              ([32768], 2048, 0), ([8192, 0, 8191, 8193], 4096, 5000), ([1] * 300, 64, 0),
                              ([0] * 299 + [70000], 2048, 3), ([T_MAX], 64, 0), ([T_MAX - 1], 4096, 1)):
            cu = offsets(lens, dt, dev)
            out.append((f"{d} {lens[:6]}{'...' if len(lens) > 6 else ''} N={len(lens)} L={L} tail={tail}", cu, L,
                        int(cu[-1]) + tail))
        out.append((f"{d} N=0 T=300", torch.zeros(1, dtype=dt, device=dev), 64, 300))
        out.append((f"{d} N=0 T=0", torch.zeros(1, dtype=dt, device=dev), 64, 0))
        out.append((f"{d} N=1 T=0", torch.zeros(2, dtype=dt, device=dev), 64, 0))
        buf = offsets([7, 70, 0, 300, 64, 1], dt, dev)
        out.append((f"{d} view at offset 2", buf[2:], 64, 1000))
        out.append((f"{d} strided view", offsets([3, 70, 4, 200, 9], dt, dev)[::2], 128, 1000))
        out.append((f"{d} leading offset (cu[0] > 0)", offsets([70, 0, 200], dt, dev, lead=130), 64, 500))
    big = offsets([2**30, 2**30 + 12345, 0, 1, 3 * 2**20 + 7], torch.int64, dev)
    out.append(("int64 offsets past 2^31, L = 2^20", big, 2**20, int(big[-1]) + 999))
    near = offsets([2**31 - 2 - 4096 * 3, 1, 4096 * 3], torch.int32, dev)
    out.append(("int32 offsets up to 2^31 - 1, L = 4096", near, 4096, 2**31 - 1))
    return out


def check_values(counter, args, dev):
    gen = torch.Generator().manual_seed(args.seed)
    for name, cu, L, T in edge_cases(dev):
        counter.check(name, tk.segment_tables_device(cu, L, T), build_segment_tables(cu, L, T=T))
    for c in range(args.cases):
        dt = (torch.int32, torch.int64)[c % 2]
        L = LS[(c // 2) % len(LS)]
        lens = random_lengths(gen, L)
        cu = offsets(lens, dt, dev)
        tail = [0, 0, 1, 63, 64, L, 3 * L + 5][int(torch.randint(0, 7, (1,), generator=gen))]
        T = int(cu[-1]) + tail
        name = f"random {c}: {str(dt)[6:]} N={len(lens)} L={L} T={T}"
        ref = build_segment_tables(cu, L, T=T)
        counter.check(name, tk.segment_tables_device(cu, L, T), ref)
        kernel = poisoned(tk.build_segment_tables_kernel(tk._SEQ_DTYPES[dt]))
        counter.check(name + " (poisoned outputs)", tk._launch(kernel, cu, L, len(lens), ref.M), ref)


def check_graphs(counter, args, dev):
    """Capture the wrapper once, rewrite cu_seqlens in place between replays, compare each time."""
    gen = torch.Generator().manual_seed(args.seed + 1)
    configs = [(torch.int32, 1, 2048, 32768), (torch.int32, 8, 128, 65536), (torch.int64, 300, 64, T_MAX),
               (torch.int64, 2, 4096, 40000), (torch.int32, 257, 1024, 300000)]
    for dt, N, L, T in configs:
        cu = torch.zeros(N + 1, dtype=dt, device=dev)

        def fill():
            # N random lengths summing to at most T (cuts of [0, T]), some empty
            cuts = torch.randint(0, T + 1, (N,), generator=gen).sort().values
            if torch.rand(1, generator=gen) < 0.5:
                cuts[: N // 3] = cuts[0]
            new = torch.cat([torch.zeros(1, dtype=torch.int64), cuts])
            cu.copy_(new.to(dtype=dt, device=dev))

        fill()
        tk.segment_tables_device(cu, L, T)  # build the kernel outside the capture
        s = torch.cuda.Stream()
        s.wait_stream(torch.cuda.current_stream())
        with torch.cuda.stream(s):
            tk.segment_tables_device(cu, L, T)
        torch.cuda.current_stream().wait_stream(s)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            tabs = tk.segment_tables_device(cu, L, T)
        for r in range(args.replays):
            fill()
            graph.replay()
            torch.cuda.synchronize()
            counter.check(f"graph {str(dt)[6:]} N={N} L={L} T={T} replay {r}", tabs, build_segment_tables(cu, L, T=T))


def time_graph_us(fn, reps, iters=20):
    """CUDA-graph median per call, in us (`device_check.time_graph`)."""
    from tests.gpu.device_check import time_graph

    return time_graph(fn, reps=reps, iters=iters) * 1e3


def time_eager_us(fn, reps, iters=20):
    fn()
    torch.cuda.synchronize()
    times = []
    for _ in range(reps // 4 + 1):
        t0 = time.perf_counter()
        for _ in range(iters):
            fn()
        torch.cuda.synchronize()
        times.append((time.perf_counter() - t0) * 1e6 / iters)
    times.sort()
    return times[len(times) // 2]


def timings(args, dev):
    gen = torch.Generator().manual_seed(args.seed + 2)
    rows = []
    for N, L, T in ((1, 2048, 32768), (2, 2048, 65536), (8, 2048, 65536), (256, 2048, 65536), (256, 64, T_MAX)):
        cuts = torch.randint(0, T + 1, (N - 1,), generator=gen).sort().values
        cu = torch.cat([torch.zeros(1, dtype=torch.int64), cuts, torch.tensor([T])]).to(dtype=torch.int32, device=dev)
        M = T // L + N
        t_torch = time_graph_us(lambda: build_segment_tables(cu, L, T=T), args.reps)
        t_kern = time_graph_us(lambda: tk.segment_tables_device(cu, L, T), args.reps)
        e_torch = time_eager_us(lambda: build_segment_tables(cu, L, T=T), args.reps)
        e_kern = time_eager_us(lambda: tk.segment_tables_device(cu, L, T), args.reps)
        rows.append((N, L, T, M, t_torch, t_kern, e_torch, e_kern))
    print(f"\n{'N':>4} {'L':>5} {'T':>8} {'M':>6} | {'graph torch us':>14} {'graph kernel us':>15} {'x':>6} | "
          f"{'eager torch us':>14} {'eager kernel us':>15}")
    for N, L, T, M, a, b, c, d in rows:
        print(f"{N:>4} {L:>5} {T:>8} {M:>6} | {a:>14.2f} {b:>15.2f} {a / b:>6.1f} | {c:>14.1f} {d:>15.1f}")


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--cases", type=int, default=1500, help="random packed mixes (alternating int32 / int64)")
    ap.add_argument("--replays", type=int, default=20, help="value rewrites per captured graph")
    ap.add_argument("--reps", type=int, default=200, help="graph replays per timing")
    ap.add_argument("--seed", type=int, default=0)
    ap.add_argument("--no-timing", action="store_true")
    args = ap.parse_args()

    from flashqla.ops.gdn.kernels.sm90._common import compile_count

    dev = torch.device("cuda")
    probe = torch.zeros(2, dtype=torch.int32, device=dev)
    print(torch.cuda.get_device_name(), "kernel path:", tk.kernel_supported(probe), flush=True)
    counter = Counter()
    ok = tk.kernel_supported(probe)
    if not ok:
        print("FAIL: the kernel path is not taken on this device (not compute capability 9.0?)")
    t0 = time.time()
    for dt in ("int32", "int64"):
        tk.build_segment_tables_kernel(dt)
    compiles = compile_count()
    print(f"kernels built in {time.time() - t0:.1f} s", flush=True)
    for step in (check_values, check_graphs):
        try:
            step(counter, args, dev)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            counter.total += 1
            counter.failed.append(step.__name__ + " raised")
    if compile_count() != compiles:
        print(f"FAIL: {compile_count() - compiles} recompilation(s) for new sizes or values")
        ok = False
    if not args.no_timing:
        try:
            timings(args, dev)
        except Exception:  # noqa: BLE001
            traceback.print_exc()
            ok = False
    if counter.failed:
        print("failed:", *counter.failed[:20], sep="\n  ")
    print(f"segment tables: {counter.ok}/{counter.total} cases equal")
    sys.exit(0 if ok and counter.ok == counter.total else 1)


if __name__ == "__main__":
    main()

"""How much faster is a long sequence on 2 GPUs than on 1? `flashqla.distributed.chunk_gated_delta_rule_cp`
on two GPUs (NCCL) against the single-GPU op `flashqla.chunk_gated_delta_rule` on the whole sequence,
forward and training step.

Run on a GPU machine with 2 Hopper GPUs (`source .device/on-device.sh` first: it sets
NCCL_NVLS_ENABLE=0, which the script also sets when it is unset):

    python benchmarks/experiments/multigpu_bench.py --out FILE.md [--cp auto|on|off] [--configs "2/8 1x262144" ...]

For each configuration "H/HV 1xT" (one sequence of T tokens, K = V = 128, bf16 q/k/v, fp32 g and
beta, value head 0 with g == 0 so that the state crosses the rank boundary undecayed):
    1 GPU    forward (no grad) and training step (forward + backward with a fixed random do) on GPU 0,
             `flashqla.chunk_gated_delta_rule(..., cp=MODE)`
    2 GPUs   the same through the CP op with `KernelBackend(cp=MODE)`, each rank holding T / 2 tokens
             (a prebuilt context: no length gather); a barrier before each iteration, the
             per-iteration maximum over ranks
MODE is --cp (intra-device context parallelism, default "auto"): both sides run with the same mode,
so that the comparison is between one device splitting T tokens and two devices splitting T / 2
each; the mode is printed in the table's header.
    comm     the op's two all-gathers alone on buffers of the same size ([HV, K, K + V] and
             [HV, K, V] fp32 per rank)
The table also gives each side's intra-device plan ("split 1 GPU / rank": the segment length L, or
"unsplit"; a rank that splits runs its shard as one intra-device CP pass, `flashqla.distributed.op`).
Times are medians over --iters iterations after --warmup (wall clock around synchronised launches;
not CUDA graphs: the op runs collectives). Backward time = training step - forward. Before a row is
written the CP outputs are checked against the single-GPU op (o, dv, dg relative RMS <= 1e-2, 1e-2,
3e-2); a failing row is reported as failing, without speedups.

Writes the table as markdown to --out (the H200 run is committed as benchmarks/results/h200-2gpu.md)
and prints it; one JSON line per configuration while it runs.
"""
from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")

import argparse  # noqa: E402
import datetime  # noqa: E402
import json  # noqa: E402
import statistics  # noqa: E402
import subprocess  # noqa: E402
import tempfile  # noqa: E402
import time  # noqa: E402

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

WORLD = 2
K = V = 128
DEFAULT_CONFIGS = ("2/8 1x262144", "2/8 1x1048576", "16/32 1x262144", "16/32 1x1048576")
GATE = {"o": 1e-2, "dv": 1e-2, "dg": 3e-2}
_BLOCK = 16384  # tokens per block of input generation and error sums


def parse_config(text: str) -> tuple[int, int, int]:
    """'H/HV 1xT' -> (H, HV, T). Raises ValueError for anything else (one sequence only)."""
    try:
        heads, shape = text.split()
        H, HV = (int(x) for x in heads.split("/"))
        B, T = (int(x) for x in shape.lower().split("x"))
    except ValueError:
        raise ValueError(f"configuration {text!r} is not 'H/HV 1xT'") from None
    if B != 1 or HV % H or T <= 0:
        raise ValueError(f"configuration {text!r}: one sequence (1xT), HV a multiple of H, T > 0")
    return H, HV, T


def make_inputs(H: int, HV: int, T: int, device, seed: int = 0) -> dict:
    """Global inputs on `device`, generated block by block (small temporaries): q, k L2-normalised,
    v and do ~ N(0, 1) in bf16; g = logsigmoid(N(0, 1)) / 16 with value head 0 at 0; beta = sigmoid."""
    gen = torch.Generator(device=device).manual_seed(seed)
    bf = dict(dtype=torch.bfloat16, device=device)
    x = dict(q=torch.empty(1, T, H, K, **bf), k=torch.empty(1, T, H, K, **bf), v=torch.empty(1, T, HV, V, **bf),
             g=torch.empty(1, T, HV, dtype=torch.float32, device=device),
             beta=torch.empty(1, T, HV, dtype=torch.float32, device=device), do=torch.empty(1, T, HV, V, **bf))
    for s in range(0, T, _BLOCK):
        n = min(T, s + _BLOCK) - s

        def rnd(*shape):
            return torch.randn(*shape, generator=gen, device=device)

        x["q"][:, s : s + n] = F.normalize(rnd(1, n, H, K), dim=-1)
        x["k"][:, s : s + n] = F.normalize(rnd(1, n, H, K), dim=-1)
        x["v"][:, s : s + n] = rnd(1, n, HV, V)
        gg = F.logsigmoid(rnd(1, n, HV)) / 16
        gg[..., 0] = 0.0
        x["g"][:, s : s + n] = gg
        x["beta"][:, s : s + n] = torch.sigmoid(rnd(1, n, HV))
        x["do"][:, s : s + n] = rnd(1, n, HV, V)
    return x


def rel_rms_blocks(x: torch.Tensor, ref: torch.Tensor) -> float:
    """||x - ref|| / ||ref|| in fp64, summed over token blocks (no full-size fp64 temporaries)."""
    num = torch.zeros((), dtype=torch.float64, device=ref.device)
    den = torch.zeros((), dtype=torch.float64, device=ref.device)
    for s in range(0, ref.shape[1], _BLOCK):
        a, b = x[:, s : s + _BLOCK].double(), ref[:, s : s + _BLOCK].double()
        num += (a - b).square().sum()
        den += b.square().sum()
    return float((num / den).sqrt()) if float(den) > 0 else float("nan")


def _leaves(x: dict, lo: int | None = None, hi: int | None = None) -> dict:
    out = {}
    for n in ("q", "k", "v", "g", "beta"):
        t = x[n] if lo is None else x[n][:, lo:hi]
        out[n] = t.detach().contiguous().requires_grad_(True)
    return out


def _time(fn, iters: int, warmup: int, barrier=None) -> list:
    for _ in range(warmup):
        fn()
    torch.cuda.synchronize()
    ts = []
    for _ in range(iters):
        if barrier is not None:
            barrier()
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        fn()
        torch.cuda.synchronize()
        ts.append(time.perf_counter() - t0)
    return ts


def _max_over_ranks(ts: list) -> float:
    """Median over iterations of the slowest rank's time, in ms."""
    import torch.distributed as dist

    t = torch.tensor(ts, dtype=torch.float64, device="cuda")
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return 1e3 * statistics.median(t.tolist())


def _single_gpu(x: dict, T: int, iters: int, warmup: int, cp: str) -> dict:
    import flashqla

    cu = torch.tensor([0, T], dtype=torch.int32, device="cuda")
    L = _leaves(x)

    def fwd():
        with torch.no_grad():
            flashqla.chunk_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], cu_seqlens=cu, cp=cp)

    def step():
        for t in L.values():
            t.grad = None
        o, _ = flashqla.chunk_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], cu_seqlens=cu, cp=cp)
        o.backward(x["do"])

    torch.cuda.reset_peak_memory_stats()
    res = dict(fwd=1e3 * statistics.median(_time(fwd, iters, warmup)), step=1e3 * statistics.median(_time(step, iters, warmup)))
    res["peak_gib"] = torch.cuda.max_memory_allocated() / 2**30
    step()
    with torch.no_grad():
        o, _ = flashqla.chunk_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], cu_seqlens=cu, cp=cp)
    res["ref"] = dict(o=o, dv=L["v"].grad.detach(), dg=L["g"].grad.detach())
    return res


def _cp(x: dict, T: int, iters: int, warmup: int, rank: int, cp: str) -> dict:
    import torch.distributed as dist

    from flashqla.distributed import KernelBackend, build_cp_context, chunk_gated_delta_rule_cp
    from flashqla.distributed.op import _all_gather

    ctx = build_cp_context([0, T])
    L = x["shard"]
    do = x["do_shard"]
    be = KernelBackend(cp=cp)

    def fwd():
        with torch.no_grad():
            chunk_gated_delta_rule_cp(L["q"], L["k"], L["v"], L["g"], L["beta"], cp_context=ctx, backend=be)

    def step():
        for t in L.values():
            t.grad = None
        o, _ = chunk_gated_delta_rule_cp(L["q"], L["k"], L["v"], L["g"], L["beta"], cp_context=ctx, backend=be)
        o.backward(do)

    HV = L["v"].shape[2]
    buf_f = torch.randn(HV, K, K + V, device="cuda")
    buf_b = torch.randn(HV, K, V, device="cuda")
    torch.cuda.reset_peak_memory_stats()
    res = dict(
        fwd=_max_over_ranks(_time(fwd, iters, warmup, dist.barrier)),
        step=_max_over_ranks(_time(step, iters, warmup, dist.barrier)),
        comm_fwd=_max_over_ranks(_time(lambda: _all_gather(buf_f, ctx), 5 * iters, warmup, dist.barrier)),
        comm_bwd=_max_over_ranks(_time(lambda: _all_gather(buf_b, ctx), 5 * iters, warmup, dist.barrier)),
    )
    peak = torch.tensor([torch.cuda.max_memory_allocated() / 2**30], device="cuda")
    dist.all_reduce(peak, op=dist.ReduceOp.MAX)
    res["peak_gib"] = float(peak)
    step()
    with torch.no_grad():
        o, _ = chunk_gated_delta_rule_cp(L["q"], L["k"], L["v"], L["g"], L["beta"], cp_context=ctx, backend=be)
    res["out"] = dict(o=o, dv=L["v"].grad.detach(), dg=L["g"].grad.detach())
    res["ctx"] = ctx
    res["plan"] = _plan_str(be.segment_plan(L["q"], L["v"], torch.tensor([0, ctx.local_len], dtype=torch.int32, device="cuda"),
                                            ctx.local_len))
    return res


def _plan_str(plan) -> str:
    """'L=<segment_len>' for a plan that splits, 'unsplit' for None or one that does not."""
    return f"L={plan.segment_len}" if plan is not None and plan.split else "unsplit"


def _single_plan(H: int, HV: int, T: int, cp: str) -> str:
    """The 1-GPU op's intra-device plan for one sequence of T tokens in mode cp (static facts only)."""
    from flashqla.cp.plan import plan_for

    if cp == "off":
        return "unsplit"
    q = torch.empty(1, T, H, K, dtype=torch.bfloat16, device="meta")
    v = torch.empty(1, T, HV, V, dtype=torch.bfloat16, device="meta")
    cu = torch.empty(2, dtype=torch.int32, device="meta")
    plan = plan_for(q, v, cu, sm_count_override=torch.cuda.get_device_properties(0).multi_processor_count,
                    force=cp == "on", exact=True)
    return _plan_str(plan)


def _gather_to_rank0(t: torch.Tensor, ctx, rank: int):
    """Concatenates every rank's token shard of t (dim 1) on rank 0 (None elsewhere)."""
    import torch.distributed as dist

    if rank != 0:
        dist.send(t.contiguous(), dst=0)
        return None
    parts = [t]
    for r in range(1, WORLD):
        buf = t.new_empty((t.shape[0], ctx.shard_lens[r], *t.shape[2:]))
        dist.recv(buf, src=r)
        parts.append(buf)
    return torch.cat(parts, dim=1)


def _row(cfg: str, args, rank: int) -> dict | None:
    import torch.distributed as dist

    from flashqla.distributed import even_shard_lens, exchange_bytes

    H, HV, T = parse_config(cfg)
    x = make_inputs(H, HV, T, "cuda", seed=0) if rank == 0 else None
    if rank != 0:  # rank 0's inputs, broadcast: every rank holds the same global values
        bf = dict(dtype=torch.bfloat16, device="cuda")
        x = dict(q=torch.empty(1, T, H, K, **bf), k=torch.empty(1, T, H, K, **bf), v=torch.empty(1, T, HV, V, **bf),
                 g=torch.empty(1, T, HV, dtype=torch.float32, device="cuda"),
                 beta=torch.empty(1, T, HV, dtype=torch.float32, device="cuda"), do=torch.empty(1, T, HV, V, **bf))
    for n in ("q", "k", "v", "g", "beta", "do"):
        dist.broadcast(x[n], src=0)
    lens = even_shard_lens(T, WORLD)
    lo, hi = sum(lens[:rank]), sum(lens[: rank + 1])

    single = None
    ok = torch.ones(1, device="cuda")
    if rank == 0:
        try:
            single = _single_gpu(x, T, args.iters, args.warmup, args.cp)
        except torch.cuda.OutOfMemoryError:
            ok.zero_()
        torch.cuda.empty_cache()
    dist.all_reduce(ok, op=dist.ReduceOp.MIN)  # the other ranks wait here for the 1-GPU run

    # copies of this rank's tokens; the global tensors are freed before the CP runs
    x = dict(shard={n: x[n][:, lo:hi].clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")},
             do_shard=x["do"][:, lo:hi].clone())
    torch.cuda.empty_cache()
    cp = _cp(x, T, args.iters, args.warmup, rank, args.cp)
    ctx = cp["ctx"]
    full = {n: _gather_to_rank0(t, ctx, rank) for n, t in cp["out"].items()}
    if rank != 0:
        return None
    vol = exchange_bytes(HV, K, V, WORLD)
    row = dict(config=cfg, H=H, HV=HV, T=T, cp_mode=args.cp, rank_plan=cp["plan"], gpu1_plan=_single_plan(H, HV, T, args.cp),
               cp_fwd_ms=cp["fwd"], cp_step_ms=cp["step"], cp_bwd_ms=cp["step"] - cp["fwd"],
               comm_fwd_ms=cp["comm_fwd"], comm_bwd_ms=cp["comm_bwd"], cp_peak_gib=cp["peak_gib"],
               send_fwd_kib=vol["fwd_send"] / 1024, send_bwd_kib=vol["bwd_send"] / 1024)
    if not bool(ok):
        row.update(single="out of memory", passed=False)
        return row
    errs = {n: rel_rms_blocks(full[n], single["ref"][n]) for n in GATE}
    passed = all(errs[n] <= GATE[n] for n in GATE)
    row.update(gpu1_fwd_ms=single["fwd"], gpu1_step_ms=single["step"], gpu1_bwd_ms=single["step"] - single["fwd"],
               gpu1_peak_gib=single["peak_gib"], errors=errs, passed=passed)
    return row


def _worker(rank: int, args, out_file: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{out_file}.init", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(minutes=30))
    rows = []
    try:
        for cfg in args.configs:
            row = _row(cfg, args, rank)
            if rank == 0:
                rows.append(row)
                print(json.dumps(row), flush=True)
                with open(out_file, "w") as f:
                    json.dump(rows, f)
            torch.cuda.empty_cache()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _precompile(configs, cp: str = "off") -> None:
    """Builds every kernel the runs need in this process (TileLang's cache then serves the ranks):
    both value-slice widths of the recurrent kernel and the backward, int32 offsets (the segmented
    launches of intra-device CP use the same kernels on int32 pseudo offsets)."""
    import flashqla
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    for H, HV in sorted({parse_config(c)[:2] for c in configs}):
        x = make_inputs(H, HV, 256, "cuda:0", seed=1)
        cu = torch.tensor([0, 256], dtype=torch.int32, device="cuda:0")
        with torch.no_grad():
            for bv in (64, 128):
                chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], None, None, True, cu, block_v=bv)
        L = _leaves(x)
        o, _ = flashqla.chunk_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], cu_seqlens=cu, cp=cp)
        o.backward(x["do"])
    torch.cuda.synchronize()


def _git_commit() -> str:
    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def markdown(rows: list, meta: dict) -> str:
    mode = meta.get("intra_device_cp", "?")
    lines = [
        "# Context parallelism across 2 GPUs: `flashqla.distributed.chunk_gated_delta_rule_cp`",
        "",
        ", ".join(f"{k}: {v}" for k, v in meta.items()),
        "",
        f"**Intra-device context parallelism: cp = \"{mode}\" on both sides** (1 GPU: "
        f"`flashqla.chunk_gated_delta_rule(..., cp=\"{mode}\")`; 2 GPUs: `KernelBackend(cp=\"{mode}\")` on every rank).",
        "",
        "One sequence per row, K = V = 128, bf16. 1 GPU: `flashqla.chunk_gated_delta_rule` on the whole sequence; "
        "2 GPUs: the CP op, T / 2 tokens per rank (slowest rank per iteration). Step = forward + backward; "
        "bwd = step - fwd. all-gather: the op's two collectives alone (forward [HV, K, K + V], backward [HV, K, V] "
        "fp32 per rank). Errors: CP against the 1-GPU op (relative RMS). Medians, ms.",
        "",
        f"| heads H/HV | tokens | fwd 1 GPU (cp={mode}) | fwd 2 GPUs (cp={mode}) | x | step 1 GPU | step 2 GPUs | x "
        "| bwd 1 GPU | bwd 2 GPUs "
        "| all-gather fwd / bwd | sent per rank fwd / bwd | peak GiB 1 GPU / rank | o / dv / dg error "
        "| split 1 GPU / rank |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | --- |",
    ]
    for r in rows:
        head = f"| {r['H']}/{r['HV']} | {r['T']:,} |"
        split = f" {r.get('gpu1_plan', '?')} / {r.get('rank_plan', '?')} |"
        comm = f"{r['comm_fwd_ms']:.3f} / {r['comm_bwd_ms']:.3f}"
        sent = f"{r['send_fwd_kib']:,.0f} / {r['send_bwd_kib']:,.0f} KiB"
        if "gpu1_fwd_ms" not in r:
            lines.append(f"{head} {r.get('single', 'n/a')} | {r['cp_fwd_ms']:.2f} | | | {r['cp_step_ms']:.2f} | | | "
                         f"{r['cp_bwd_ms']:.2f} | {comm} | {sent} | - / {r['cp_peak_gib']:.1f} | not checked |" + split)
            continue
        e = r["errors"]
        err = f"{e['o']:.1e} / {e['dv']:.1e} / {e['dg']:.1e}"
        if not r["passed"]:
            lines.append(f"{head} FAILED: CP differs from the 1-GPU op ({err}); no timing reported | | | | | | | | | | | | {err} |"
                         + split)
            continue
        lines.append(
            f"{head} {r['gpu1_fwd_ms']:.2f} | {r['cp_fwd_ms']:.2f} | {r['gpu1_fwd_ms'] / r['cp_fwd_ms']:.2f} | "
            f"{r['gpu1_step_ms']:.2f} | {r['cp_step_ms']:.2f} | {r['gpu1_step_ms'] / r['cp_step_ms']:.2f} | "
            f"{r['gpu1_bwd_ms']:.2f} | {r['cp_bwd_ms']:.2f} | {comm} | {sent} | "
            f"{r['gpu1_peak_gib']:.1f} / {r['cp_peak_gib']:.1f} | {err} |" + split
        )
    return "\n".join(lines) + "\n"


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", required=True, help="markdown file to write")
    ap.add_argument("--configs", nargs="*", default=list(DEFAULT_CONFIGS), help="'H/HV 1xT' rows")
    ap.add_argument("--iters", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2)
    ap.add_argument("--cp", choices=("off", "auto", "on"), default="auto",
                    help="intra-device context-parallel mode of both the 1-GPU op and every rank (default auto)")
    args = ap.parse_args(argv)
    for c in args.configs:
        parse_config(c)
    if torch.cuda.device_count() < WORLD or any(torch.cuda.get_device_capability(i) != (9, 0) for i in range(WORLD)):
        print(f"needs {WORLD} CUDA GPUs of compute capability 9.0 (Hopper)")
        return 2
    import torch.multiprocessing as mp

    _precompile(args.configs, args.cp)
    with tempfile.TemporaryDirectory() as tmp:
        out_json = os.path.join(tmp, "rows.json")
        mp.spawn(_worker, args=(args, out_json), nprocs=WORLD, join=True)
        with open(out_json) as f:
            rows = json.load(f)
    meta = dict(
        gpu=f"{WORLD} x {torch.cuda.get_device_name(0)}", torch=torch.__version__,
        nccl=".".join(str(v) for v in torch.cuda.nccl.version()), commit=_git_commit(),
        date=datetime.date.today().isoformat(), NCCL_NVLS_ENABLE=os.environ.get("NCCL_NVLS_ENABLE"),
        intra_device_cp=args.cp,
    )
    text = markdown(rows, meta)
    with open(args.out, "w") as f:
        f.write(text)
    print(text)
    return 0 if all(r.get("passed") for r in rows) else 1


if __name__ == "__main__":
    raise SystemExit(main())

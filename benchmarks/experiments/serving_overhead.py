"""Question: what does the serving contract cost on the kernels? The plain call (per-sequence fp32
kv initial states in, final states out) against the same call with a pooled "vk" state pool (read and
written by index in the recurrent kernel's serving build) plus 4 checkpoints per sequence (stored
in-kernel, record CF-4). Goal (issue 43): <= 3% slower. Result file: none yet (the lead engineer runs it
on the GPU and records the table in benchmarks/journal/).

    python benchmarks/experiments/serving_overhead.py [--rows 16/32:8192x4,2/8:1x32768] [--state-dtype bf16]

Rows are H/HV:TxN (N sequences of T tokens, packed with cu_seqlens). Columns: the plain call, the
pooled call without checkpoints ("pool"), the pooled call with them ("serving"), and the overheads
of the latter two over plain. Timing: CUDA graphs
(`flashqla.bench.timing.time_cuda_graph`), median of replays, after warm-up, on random valid-domain
inputs. Before timing, each row checks that the serving call took the kernel path and that its o is
bitwise the plain call's (the checkpoints must not change o). Prints one table.
"""

from __future__ import annotations

import argparse
import sys

import torch

DEFAULT_ROWS = "16/32:8192x4,2/8:1x32768,16/64:2048x8"


def parse_rows(text: str) -> list:
    rows = []
    for item in text.split(","):
        heads, shape = item.split(":")
        H, HV = map(int, heads.split("/"))
        T, N = map(int, shape.split("x"))
        rows.append((H, HV, T, N))
    return rows


def make(H, HV, T, N, state_dtype, device="cuda"):
    """Inputs of one row: bf16 q, k, v (q, k L2-normalised), fp32 g (Qwen3-Next's gate) and beta,
    cu_seqlens of N sequences of T tokens, fp32 initial states, a vk pool of 2N rows in state_dtype
    with the sequences at shuffled rows, and 4 checkpoint positions per sequence."""
    from flashqla.testing import make_gdn_inputs

    K = V = 128
    x = make_gdn_inputs(B=1, T=T * N, H=H, HV=HV, seqlens=[T] * N, dtype=torch.bfloat16, device=device, seed=0)
    x = {k: v for k, v in x.items()}
    cu = x["cu_seqlens"].to(device, torch.int32)
    h0 = (torch.randn(N, HV, K, V, device=device) * 0.05).float()
    rows = torch.randperm(2 * N, device=device)[:N]
    pool = torch.zeros(2 * N, HV, V, K, device=device, dtype=state_dtype)
    pool[rows] = h0.transpose(-1, -2).to(state_dtype)
    starts = cu[:-1].long()
    offs = torch.tensor([T // 4, T // 2, (3 * T) // 4, T], device=device).clamp(min=1)
    pos = (starts[:, None] + offs[None]).reshape(-1)
    cks = torch.empty(pos.numel(), HV, V, K, device=device, dtype=state_dtype)
    xd = {n: x[n] for n in ("q", "k", "v", "g", "beta")}
    xd["g"], xd["beta"] = xd["g"].float(), xd["beta"].float()
    return xd, cu, h0, pool, rows, pos, cks


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--rows", default=DEFAULT_ROWS)
    p.add_argument("--state-dtype", default="bf16", choices=["fp32", "bf16", "fp16"])
    a = p.parse_args(argv)
    if not torch.cuda.is_available() or torch.cuda.get_device_capability() != (9, 0):
        print("serving_overhead: needs a Hopper GPU (compute capability 9.0); nothing timed")
        return 0
    import flashqla
    from flashqla.bench.timing import time_cuda_graph
    from flashqla.ops.gdn import serving as op_serving

    sdt = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[a.state_dtype]
    print(f"# {torch.cuda.get_device_name()} | torch {torch.__version__} | state storage {a.state_dtype}, layout vk, "
          f"4 checkpoints / sequence | CUDA graphs, median")
    print(f"{'H/HV':>7} {'T x N':>10} {'plain ms':>10} {'pool ms':>9} {'serving ms':>11} {'pool only':>10} {'overhead':>9}  path")
    bad = 0
    for H, HV, T, N in parse_rows(a.rows):
        xd, cu, h0, pool, rows, pos, cks = make(H, HV, T, N, sdt)

        def plain():
            return flashqla.chunk_gated_delta_rule(**xd, initial_state=h0, output_final_state=True, cu_seqlens=cu)

        def serving():
            return flashqla.chunk_gated_delta_rule(**xd, initial_state=pool, output_final_state=True, cu_seqlens=cu,
                                                   state_indices=rows, state_layout="vk", checkpoint_positions=pos,
                                                   checkpoint_states=cks)

        def pool_only():  # the pool without checkpoints: what the checkpoints add is serving - pool_only
            return flashqla.chunk_gated_delta_rule(**xd, initial_state=pool, output_final_state=True, cu_seqlens=cu,
                                                   state_indices=rows, state_layout="vk")

        with torch.no_grad():
            o_plain, _ = plain()
            pool_copy = pool.clone()
            o_serv, _ = serving()
            path = op_serving.LAST_PATH["path"]
            pool.copy_(pool_copy)  # the timed replays start from the same rows (their values do not change the time)
            same_o = torch.equal(o_plain, o_serv) if sdt == torch.float32 else None
            t_plain = time_cuda_graph(plain).ms
            t_serv = time_cuda_graph(serving).ms
            t_pool = time_cuda_graph(pool_only).ms
        over = t_serv / t_plain - 1.0
        note = "" if same_o is not False else "  o differs from the plain call's!"
        bad += same_o is False or path != "kernel"
        print(f"{H:>3}/{HV:<3} {T:>5} x {N:<3} {t_plain:>10.3f} {t_pool:>9.3f} {t_serv:>11.3f} "
              f"{100 * (t_pool / t_plain - 1):>9.1f}% {100 * over:>8.1f}%  {path}{note}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())

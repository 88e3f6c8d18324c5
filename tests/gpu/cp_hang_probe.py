"""One call on the GPU machine: the split forward on one row and plan, each configuration in its own
process under a watchdog, eagerly then CUDA-graph timed (--blocking: kernels launched synchronously, CUDA_LAUNCH_BLOCKING=1), so that a hang
names the launch it is stuck in (faulthandler traceback) instead of eating the call's time box.

    python tests/gpu/cp_hang_probe.py [--row "8/24 4096x8"] [--configs 1024:128 1024:128:exact ...] [--timeout S]

A configuration is L:BV[:exact] (exact: truncate=False, no gate-driven cut). Prints one line per
configuration: ok with the o error against the unsplit forward, or the traceback of the stuck call.
Not collected by pytest.
"""

from __future__ import annotations

import argparse
import faulthandler
import os
import subprocess
import sys

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)


def child(row: str, cfg: str, timeout: float) -> None:
    import torch

    from flashqla.bench.grid import Row, parse_heads, parse_mix
    from flashqla.bench.runner import InputFactory
    from flashqla.cp.driver import chunk_gated_delta_rule_cp_fwd

    faulthandler.dump_traceback_later(timeout, exit=True)
    heads, mix = row.split()
    r = Row(parse_heads(heads), parse_mix(mix))
    x = InputFactory("cuda", r.mix.T).get(r)
    parts = cfg.split(":")
    L, BV, exact = int(parts[0]), int(parts[1]), len(parts) > 2
    args = (x.q, x.k, x.v, x.g, x.beta, 128**-0.5, x.h0, True, x.cu_seqlens)
    ref = chunk_gated_delta_rule_cp_fwd(*args, cp="off", relayout=False).o.double()
    torch.cuda.synchronize()
    print("unsplit done", flush=True)
    out, info = chunk_gated_delta_rule_cp_fwd(*args, cp="on", segment_len=L, block_v=BV, max_seqlen=max(r.mix.lengths),
                                              relayout=False, return_info=True, truncate=False if exact else None)
    torch.cuda.synchronize()
    err = float((out.o.double() - ref).norm() / ref.norm())
    print(f"eager ok o_vs_unsplit={err:.2e}", flush=True)
    from flashqla.bench.timing import time_cuda_graph

    ms = time_cuda_graph(lambda: chunk_gated_delta_rule_cp_fwd(*args, cp="on", segment_len=L, block_v=BV,
                                                               max_seqlen=max(r.mix.lengths), relayout=False,
                                                               truncate=False if exact else None)).ms
    print(f"RESULT ok o_vs_unsplit={err:.2e} segments={int(info.tables.cu_seqlens.numel()) - 1} graph_ms={ms:.3f}", flush=True)


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--row", default="8/24 4096x8")
    ap.add_argument("--configs", nargs="+", default=["1024:128", "1024:128:exact", "2048:128", "1024:64"])
    ap.add_argument("--timeout", type=float, default=45.0)
    ap.add_argument("--child", default=None)
    ap.add_argument("--blocking", action="store_true", help="CUDA_LAUNCH_BLOCKING=1 (not with graph timing)")
    a = ap.parse_args()
    if a.child:
        child(a.row, a.child, a.timeout)
        return 0
    env = dict(os.environ, CUDA_LAUNCH_BLOCKING="1") if a.blocking else dict(os.environ)
    lines = []
    for cfg in a.configs:
        try:
            p = subprocess.run([sys.executable, __file__, "--row", a.row, "--child", cfg, "--timeout", str(a.timeout)],
                               env=env, capture_output=True, text=True, timeout=a.timeout + 60)
            text = p.stdout + p.stderr
        except subprocess.TimeoutExpired as exc:
            text = f"killed after {a.timeout + 60} s\n{exc.stdout or ''}{exc.stderr or ''}"
        res = [ln for ln in text.splitlines() if ln.startswith("RESULT")]
        if res:
            lines.append(f"{a.row} {cfg}: {res[0]}")
        else:
            tb = [ln for ln in text.splitlines() if ln.strip().startswith("File") or "Timeout" in ln or "Error" in ln]
            lines.append(f"{a.row} {cfg}: NO RESULT\n    " + "\n    ".join(tb[-14:]))
        print(lines[-1], flush=True)
    print("\n== summary")
    print("\n".join(lines))
    return 0


if __name__ == "__main__":
    sys.exit(main())

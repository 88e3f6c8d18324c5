"""Which part of a serving call on the split (torch) path breaks CUDA-graph capture? One row (default
2/8 heads, 1 x 8192 tokens: the plan splits it), a bf16 "vk" pool and 4 checkpoints: the call eagerly
under `torch.cuda.set_sync_debug_mode("error")` (a host synchronisation raises, with its traceback),
then a capture of the plain call and of the serving call, each reported separately.

    python benchmarks/experiments/serving_capture_check.py [--heads 2/8] [--mix 1x8192]
"""
from __future__ import annotations

import argparse
import traceback

import torch


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--heads", default="2/8")
    p.add_argument("--mix", default="1x8192")
    a = p.parse_args(argv)
    import flashqla
    from flashqla.bench import grid as G
    from flashqla.bench.inputs import InputFactory
    from flashqla.bench.serving import positions_quarter
    from flashqla.ops.gdn import serving as op_serving

    row = G.Row(G.parse_heads(a.heads), G.parse_mix(a.mix))
    x = InputFactory("cuda", row.mix.T).get(row)
    N, HV = row.mix.N, row.heads.h_v
    rows = torch.arange(N, device="cuda")
    pool = torch.zeros(2 * N, HV, 128, 128, device="cuda", dtype=torch.bfloat16)
    pos = torch.tensor(positions_quarter(row.mix.lengths), device="cuda")
    cks = torch.empty(pos.numel(), HV, 128, 128, device="cuda", dtype=torch.bfloat16)

    def plain():
        return flashqla.chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=x.h0, output_final_state=True,
                                               cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu)

    def serving():
        return flashqla.chunk_gated_delta_rule(x.q, x.k, x.v, x.g, x.beta, initial_state=pool, output_final_state=True,
                                               cu_seqlens=x.cu_seqlens, cu_seqlens_cpu=x.cu_seqlens_cpu,
                                               state_indices=rows, state_layout="vk", checkpoint_positions=pos,
                                               checkpoint_states=cks)

    with torch.no_grad():
        plain(), serving()
        torch.cuda.synchronize()
        print("serving path:", op_serving.LAST_PATH["path"])
        for name, fn in (("plain", plain), ("serving", serving)):
            torch.cuda.set_sync_debug_mode("error")
            try:
                fn()
                print(f"{name}: no host sync")
            except Exception:
                print(f"{name}: host sync\n" + "".join(traceback.format_exc().splitlines(True)[-14:]))
            finally:
                torch.cuda.set_sync_debug_mode("default")
            torch.cuda.synchronize()
        for name, fn in (("plain", plain), ("serving", serving)):
            g = torch.cuda.CUDAGraph()
            try:
                with torch.cuda.graph(g):
                    fn()
                g.replay()
                torch.cuda.synchronize()
                print(f"capture {name}: ok")
            except Exception:
                print(f"capture {name}: FAILED\n" + "".join(traceback.format_exc().splitlines(True)[-14:]))
                return 1
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

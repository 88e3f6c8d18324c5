"""One call on the GPU machine: backward pass 1 (`states_bwd.chunk_states_bwd`), schedule "roles"
(`states_roles.py`, the default) against "serial" (on request), on NaN-filled outputs: h compared slot
by slot (the same products and roundings, so a case passes only when h is bitwise equal; also the
relative RMS, every written row finite, the same rows written), then both CUDA-graph timed. Run it
under `timeout` (a kernel that hangs would hold the GPU).

    python tests/gpu/states_roles_check.py [--rows "16/32 7212+7072+13725+4759" ...]

Cases: packed rows with empty and 1-token sequences and a partial last chunk, a fixed-length batch,
fp16, an initial state on and off; inputs `flashqla.testing.make_gdn_inputs` (Qwen3-Next
gates with the g == 0 and g = -30 heads). A and g_cum_log2 from the unsplit forward (cp="off").
Prints a table last. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

CASES = [  # name, H, HV, K, lengths (None: fixed-length batch of B x T), B, T, dtype, h0
    ("packed, empty + 1-token + partial", 1, 2, 128, [63, 1, 0, 200, 64], 1, None, torch.bfloat16, True),
    ("fixed batch 2 x 1000, no h0", 2, 4, 128, None, 2, 1000, torch.bfloat16, False),
    ("fp16, packed", 1, 2, 128, [130, 700], 1, None, torch.float16, True),
    ("GVA 4, packed", 1, 4, 128, [333, 1024], 1, None, torch.bfloat16, True),
]
ROWS = ["16/32 7212+7072+13725+4759", "8/16 161+1928+3157+563+1244+229+177+733", "16/32 1x8192"]


def _launch(schedule, k, v, A, gcl, h0, cu, h_dtype):
    from flashqla.ops.gdn.kernels.sm90._common import num_slots, order_args
    from flashqla.ops.gdn.kernels.sm90.prepare import dummy_cu_seqlens
    from flashqla.ops.gdn.kernels.sm90.states_bwd import build_states_kernel, states_kernel_args

    B, T = k.shape[0], k.shape[1]
    HV, K, V = v.shape[2], k.shape[3], v.shape[3]
    N = cu.numel() - 1 if cu is not None else B
    S = num_slots(B, T, N, cu is not None)
    h = torch.full((S * HV, K, V), float("nan"), dtype=h_dtype, device="cuda")
    kern = build_states_kernel(*states_kernel_args(k, v, cu, h_dtype), schedule)
    h0a = h0 if h0 is not None else torch.empty(1, HV, K, V, dtype=torch.float32, device="cuda")
    kern(k, v, A, gcl, h0a, cu if cu is not None else dummy_cu_seqlens("cuda"), *order_args(None, "cuda"),
         int(h0 is not None), h)
    return h


def main(argv=None) -> int:
    from flashqla.bench.timing import time_cuda_graph
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.kernels.sm90.states_bwd import chunk_states_bwd
    from flashqla.testing import make_gdn_inputs, rel_rms
    from tests.gpu.device_check import parse_row

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=ROWS)
    a = ap.parse_args(argv)
    out, ok_all = [], True
    for name, H, HV, K, lengths, B, T, dtype, h0 in CASES:
        if lengths is not None:
            x = make_gdn_inputs(1, sum(lengths), H, HV, K, 128, seqlens=lengths, dtype=dtype, device="cuda", seed=3)
        else:
            x = make_gdn_inputs(B, T, H, HV, K, 128, dtype=dtype, device="cuda", seed=3)
        cu = x.get("cu_seqlens")
        hz = x["initial_state"] if h0 else None
        f = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], K**-0.5, hz, False, cu, cp="off")
        hr = _launch("roles", f.k, x["v"], f.A, f.g_cum_log2, hz, cu, dtype)
        hs = _launch("serial", f.k, x["v"], f.A, f.g_cum_log2, hz, cu, dtype)
        wr, ws = ~torch.isnan(hr), ~torch.isnan(hs)
        same_rows = bool(torch.equal(wr, ws))
        finite = bool(torch.isfinite(hr[wr]).all()) if wr.any() else True
        eq = float((hr[wr] == hs[wr]).float().mean()) if wr.any() else 1.0
        err = rel_rms(hr[wr].float(), hs[wr].float()) if wr.any() else 0.0
        ok = same_rows and finite and eq == 1.0 and int(wr.sum()) > 0
        ok_all &= ok
        out.append((name, int(wr.sum()) // (K * 128), eq, err, same_rows, finite, ok))
        print(out[-1], flush=True)
    times = []
    for row in a.rows:
        H, HV, lengths = parse_row(row)
        x = make_gdn_inputs(1, sum(lengths), H, HV, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda", seed=0)
        cu = x["cu_seqlens"]
        f = chunk_gated_delta_rule_fwd(x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5, x["initial_state"], False, cu, cp="off")
        t = {}
        for sched in ("serial", "roles"):
            fn = lambda s=sched: chunk_states_bwd(f.k, x["v"], f.A, f.g_cum_log2, x["initial_state"], cu, torch.bfloat16, s)  # noqa: E731
            fn()
            t[sched] = time_cuda_graph(fn).ms
        times.append((row, t["serial"], t["roles"]))
        print(times[-1], flush=True)
    print("\n| case | h tiles written | bitwise equal | rel RMS vs serial | same rows | finite | ok |")
    print("|---|---|---|---|---|---|---|")
    for r in out:
        print(f"| {r[0]} | {r[1]} | {r[2]:.4f} | {r[3]:.1e} | {r[4]} | {r[5]} | {'ok' if r[6] else 'FAIL'} |")
    print("\n| row (unsplit, h0 given) | pass 1 serial ms | roles ms | speed-up |")
    print("|---|---|---|---|")
    for row, s, r in times:
        print(f"| {row} | {s:.3f} | {r:.3f} | {s / r:.2f}x |")
    return 0 if ok_all else 1


if __name__ == "__main__":
    sys.exit(main())

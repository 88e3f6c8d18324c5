"""One call on the GPU machine: the split backward with the forward's kept states (`cp_saved`) against
the one that recomputes them, bitwise, and both timed.

    python tests/gpu/cp_saved_check.py [--rows "16/32 1x8192" "4/8 3274+1029+..." ...]

Per row (the backward benchmark's inputs, length hint given): the forward with
`keep_cp_states=True` and without; the backward with its `cp_saved` (A, g_cum_log2 None: the kept
ones, in the segments' layout) and without (A, g_cum_log2 moved to the caller's layout from the kept
ones, `saved_products_in_sequence_slots`, what the forward returned before it kept them); every gradient
compared bitwise (and NaN-free); then CUDA-graph times (median, ms) of both forwards and both
backwards. Prints a table last. Not collected by pytest.
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.device_check import parse_row, time_graph  # noqa: E402

ROWS = ["16/32 1x8192", "4/8 3274+1029+2909+5061+2011+3793+9932+4759", "2/4 1x32768"]


def main(argv=None) -> int:
    from flashqla.cp.driver import saved_products_in_sequence_slots
    from flashqla.ops.gdn.api import chunk_gated_delta_rule_fwd
    from flashqla.ops.gdn.bwd import chunk_gated_delta_rule_bwd
    from flashqla.testing import make_gdn_inputs

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--rows", nargs="+", default=ROWS)
    a = ap.parse_args(argv)
    table = []
    for row in a.rows:
        H, HV, lengths = parse_row(row)
        T, ms = sum(lengths), max(lengths)
        x = make_gdn_inputs(1, T, H, HV, 128, 128, seqlens=lengths, dtype=torch.bfloat16, device="cuda",
                            gate="qwen3next", special_heads=True, initial_state=True, seed=0)
        args = (x["q"], x["k"], x["v"], x["g"], x["beta"], 128**-0.5, x["initial_state"], True, x["cu_seqlens"])
        fwd_keep = lambda: chunk_gated_delta_rule_fwd(*args, max_seqlen=ms, keep_cp_states=True)  # noqa: E731
        fwd_plain = lambda: chunk_gated_delta_rule_fwd(*args, max_seqlen=ms)  # noqa: E731
        f, p = fwd_keep(), fwd_plain()
        gen = torch.Generator(device="cuda").manual_seed(1)
        do = torch.randn(f.o.shape, device="cuda", generator=gen).to(f.o.dtype)
        dht = torch.randn(f.final_state.shape, device="cuda", generator=gen)

        def bwd(fo, A, G, saved):
            return chunk_gated_delta_rule_bwd(fo.q, fo.k, x["v"], x["g"], x["beta"], A, G, do, dht,
                                              128**-0.5, x["initial_state"], x["cu_seqlens"], max_seqlen=ms,
                                              cp_saved=saved)

        A_seq, G_seq = (f.A, f.g_cum_log2) if f.cp_saved is None else saved_products_in_sequence_slots(
            f.cp_saved, x["cu_seqlens"], 1, T, HV)
        got, want = bwd(f, f.A, f.g_cum_log2, f.cp_saved), bwd(f, A_seq, G_seq, None)
        bitwise = all(torch.equal(a_, b_) for a_, b_ in zip(got, want))
        finite = all(bool(torch.isfinite(t).all()) for t in got)
        o_diff = float((f.o.float() - p.o.float()).norm() / p.o.float().norm())
        L = None if f.cp_saved is None else f.cp_saved.segment_len
        t = [time_graph(fwd_plain), time_graph(fwd_keep), time_graph(lambda: bwd(f, A_seq, G_seq, None)),
             time_graph(lambda: bwd(f, f.A, f.g_cum_log2, f.cp_saved))]
        table.append((row, L, bitwise, finite, o_diff, *t))
        print(table[-1], flush=True)
    print("\n== kept forward states: forward (own plan / the backward's, keeping), backward (recomputing / with cp_saved), ms")
    print(f"{'row':24s} {'L':>6s} {'bitwise':>7s} {'finite':>6s} {'o vs own':>9s} {'fwd':>7s} {'fwd keep':>8s} "
          f"{'bwd':>7s} {'bwd saved':>9s} {'step':>7s} {'step keep':>9s}")
    for r in table:
        print(f"{r[0][:24]:24s} {str(r[1]):>6s} {str(r[2]):>7s} {str(r[3]):>6s} {r[4]:9.1e} {r[5]:7.3f} {r[6]:8.3f} "
              f"{r[7]:7.3f} {r[8]:9.3f} {r[5] + r[7]:7.3f} {r[6] + r[8]:9.3f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())

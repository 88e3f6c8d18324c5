"""Nsight Compute driver for the combine scan (`kernels/sm90/cp_scan.py`): one scan as the
gate-driven cut leaves it on one sequence (`cp_scan_check.live_head_case`: value head 0 walks every
chunk, the others are cut), warm-up outside the profiled range, then `--calls` calls inside
`cudaProfilerStart/Stop`, so that

    ncu --clock-control none --profile-from-start off -k regex:gdn_cp_scan \\
        --section WarpStateStats --section SourceCounters -o rep \\
        python tests/gpu/ncu_scan.py --case "4/8 1x8192 L512" --variant ahead --width 4

collects only the profiled scans (`tests/gpu/sass_stalls.py` then sums the stall samples by code
region). What bounds a step of the live head's chain (~3.5 us, of which the FMAs are a fraction) is
the open question (NOTES-bwd.md, "The split backward's terminal gradients"). Not collected by pytest.

    python tests/gpu/ncu_scan.py [--case NAME] [--variant V] [--width W] [--forward] [--calls N]
"""

from __future__ import annotations

import argparse
import os
import sys

import torch

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, ROOT)

from tests.gpu.cp_scan_check import LIVE_HEAD_CASES, live_head_case  # noqa: E402
from tests.gpu.ncu_fwd import profiled  # noqa: E402


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--case", default="4/8 1x8192 L512", choices=sorted(LIVE_HEAD_CASES))
    ap.add_argument("--variant", default=None, help="a cp_scan variant (default: scan_choice's)")
    ap.add_argument("--width", type=int, default=None, help="value columns a CTA (default: the variant's)")
    ap.add_argument("--forward", action="store_true", help="the forward scan (default: the reverse one)")
    ap.add_argument("--calls", type=int, default=1)
    a = ap.parse_args(argv)
    from flashqla.ops.gdn.kernels.sm90.cp_scan import cp_scan

    tab, P, Q, h0, cut = live_head_case(*LIVE_HEAD_CASES[a.case], torch.Generator().manual_seed(5))
    kw = dict(init=h0, skip_first=True) if a.forward else dict(init=h0, reverse=True)

    def call():
        return cp_scan(P, Q, tab.seq_first, tab.seq_num, variant=a.variant, slice_width=a.width, **cut, **kw)

    ms = profiled(call, a.calls)
    print(f"{a.case} {'forward' if a.forward else 'reverse'} scan, variant {a.variant or 'scan_choice'}, width "
          f"{a.width or 'default'}: {a.calls} call(s), {ms:.3f} ms wall (profiled)")
    return 0


if __name__ == "__main__":
    sys.exit(main())

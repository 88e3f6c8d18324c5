"""GPU tier: the split path's one-launch kernels, as regression tests (the value parts of the check
scripts that first validated them on the H200):

- the segment tables (`flashqla.cp.tables_kernel`) equal the torch tables field by field, also
  across CUDA-graph replays with cu_seqlens edited in place (tests/gpu/segment_tables_check.py);
- the combine scans (`kernels/sm90/cp_scan.py`) against the fp64 torch scans, and the output
  correction and segment-gradient kernels (`kernels/sm90/cp_correct.py`) against fp64
  (tests/gpu/cp_scan_check.py);
- the open-sequence forward and backward (what `flashqla.distributed` runs per rank) on the kernels
  against fp64 and the torch paths (tests/gpu/cp_open_check.py);
- the dual run + transition launch and the gate-driven transition cut (tests/gpu/cp_dual_check.py).
"""

from __future__ import annotations

import argparse
import os
import sys

import pytest
import torch

pytestmark = pytest.mark.gpu

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not HOPPER:
    pytest.skip("needs a CUDA GPU of compute capability 9.0 (Hopper)", allow_module_level=True)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
if ROOT not in sys.path:
    sys.path.insert(0, ROOT)

from tests.gpu import cp_dual_check, cp_open_check, cp_scan_check, segment_tables_check  # noqa: E402


def test_segment_tables_equal_torch_tables_and_survive_graph_replays():
    counter = segment_tables_check.Counter()
    args = argparse.Namespace(cases=200, replays=5, reps=10, seed=0, no_timing=True)
    dev = torch.device("cuda")
    segment_tables_check.check_values(counter, args, dev)
    segment_tables_check.check_graphs(counter, args, dev)
    assert counter.total > 0 and not counter.failed, counter.failed[:10]


def test_scans_against_fp64():
    out = {}
    assert cp_scan_check.check_values(out), [r for r in out["values"] if "FAIL" in r[2] or "ERROR" in r[2]]


def test_correction_and_segment_gradients_against_fp64():
    out = {}
    assert cp_scan_check.check_token_kernels(out), [r for r in out["token_kernels"] if "FAIL" in r[1] or "ERROR" in r[1]]


def test_open_sequence_on_the_kernels():
    assert cp_open_check.main() == 0


@pytest.mark.parametrize("case", cp_dual_check.CASES, ids=[c[0] for c in cp_dual_check.CASES])
def test_dual_launch_and_transition_cut(case):
    """The run + transition launch is bitwise the two launches; the default cut (ln 2^-24) moves o by < 1e-4
    and the final state by < 1e-5 relative, never further from fp64 than exact mode, and nothing on
    the g == 0 head (tests/gpu/cp_dual_check.py)."""
    row = cp_dual_check.check_case(*case)
    assert row["ok"], row


def test_backward_with_the_transition_cut():
    row = cp_dual_check.check_bwd("2/8 1x8192 L1024", 2, 8, [8192], 1024)
    assert row["ok"], row

"""CPU tier of the context-parallel scan kernel (`flashqla.ops.gdn.kernels.sm90.cp_scan`): it compiles
for sm_90a in both directions, its FMA loop reads P from bank-conflict-free padded rows and keeps the
chain on CUDA cores in fp32 (no tensor-core instruction), no spills; the torch scans it replaces are
what runs off CUDA. Its values are checked against those torch scans on the GPU
(tests/gpu/cp_scan_check.py and, end to end, tests/gpu/test_cp_gpu.py)."""

from __future__ import annotations

import shutil

import pytest
import torch

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="compiling for sm_90a needs nvcc")


@needs_nvcc
@pytest.mark.parametrize("HV,reverse", [(8, False), (8, True), (32, False), (32, True)])
def test_cp_scan_kernel_compiles(HV, reverse):
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report
    from flashqla.ops.gdn.kernels.sm90.cp_scan import build_cp_scan_kernel, scan_slice_width

    kernel = build_cp_scan_kernel(HV, 128, 128, reverse)
    src = kernel.get_kernel_source()
    assert "* 129)" in src, "P's shared rows should be padded to K + 1 words"
    assert "mma" not in src and "wgmma" not in src, "the chain must stay fp32 on CUDA cores"
    assert "for (int jj = 0; jj < nseg; ++jj)" in src, "the loop count is the sequence's segment count"
    rep = ptxas_report(kernel)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep
    assert scan_slice_width(HV) == (8 if HV <= 8 else 16)


def test_kernel_only_for_fp32_cuda(monkeypatch):
    from flashqla.cp import merge

    P = torch.zeros(2, 1, 8, 8)
    Q = torch.zeros(2, 1, 8, 16)
    assert not merge._use_kernel(P, Q)  # CPU tensors: the torch scan
    assert not merge._use_kernel(P.double(), Q.double())


def test_specs_name_both_directions():
    from flashqla.ops.gdn.kernels.sm90 import op_kernel_specs

    fwd = op_kernel_specs(2, 8, backward=False)
    both = op_kernel_specs(2, 8)
    assert ("cp_scan", (8, 128, 128, False)) in fwd and ("cp_scan", (8, 128, 128, True)) not in fwd
    assert ("cp_scan", (8, 128, 128, True)) in both


def test_rejects_unsupported_width():
    from flashqla.ops.gdn.kernels.sm90.cp_scan import build_cp_scan_kernel

    with pytest.raises(ValueError, match="V %"):
        build_cp_scan_kernel(32, 128, 40, False)

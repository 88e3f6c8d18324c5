"""CPU tier of the packed-tail launch (`flashqla.ops.gdn.kernels.sm90.packed_tail`): it compiles for
sm_90a with 16-byte stores and 64-bit row offsets, reads only the last offset, is listed for packed
calls only, and refuses a non-packed or non-contiguous o. Its values (the tail exactly zero, the
sequences' rows untouched) are checked on the GPU: tests/gpu/test_edge_gpu.py
(`test_packed_tail_output_is_defined`, `test_packed_tail_is_written_by_the_tail_launch`) and
tests/gpu/test_serving_gpu.py (`test_kernel_path_gate_floor_and_packed_tail`)."""

from __future__ import annotations

import re
import shutil

import pytest
import torch

from flashqla.ops.gdn.kernels.sm90 import packed_tail, registry

needs_nvcc = pytest.mark.skipif(shutil.which("nvcc") is None, reason="compiling for sm_90a needs nvcc")


@needs_nvcc
@pytest.mark.parametrize("dtype, cu_dtype", [("bfloat16", "int32"),
                                             pytest.param("float32", "int64", marks=pytest.mark.compile_all)])
def test_zero_tail_kernel_compiles(dtype, cu_dtype):
    """One offset read (cu_seqlens[Np1 - 1]), an early exit for CTAs before the tail, vector stores of
    zeros with 64-bit row offsets (T * HV * V may pass 2^31), no loads of o, no spills."""
    from flashqla.ops.gdn.kernels.sm90._common import ptxas_report

    kernel = packed_tail.build_zero_tail_kernel(128, dtype, cu_dtype)
    src = kernel.get_kernel_source()
    body = src[src.index("gdn_zero_tail_kernel("):]
    assert "cu_seqlens[(((int64_t)Np1) - (int64_t)1)]" in body, "the last offset is not what the kernel reads"
    assert len(re.findall(r"cu_seqlens\[", body)) == 1, "the kernel reads more offsets than the last"
    assert "*(uint4*)(o + " in body, "the stores are not 16 bytes wide"
    assert "o[" not in body and body.count("(o + ") == body.count("*(uint4*)(o + "), "o is read"
    rep = ptxas_report(kernel)
    assert rep["spill_stores"] == 0 and rep["spill_loads"] == 0, rep


def test_listed_for_packed_calls_only():
    """`op_kernel_specs` (warmup's list) names the tail launch for packed input, in o's dtype and the
    offsets' dtype, and not for a fixed-length batch (no offsets: no tail)."""
    packed = registry.op_kernel_specs(2, 4, N=3, varlen=True, dtype="float16", seq_dtype="int64")
    fixed = registry.op_kernel_specs(2, 4, N=3, varlen=False)
    assert ("zero_tail", (128, "float16", "int64")) in packed
    assert not any(kind == "zero_tail" for kind, _ in fixed)
    assert registry.BUILDERS["zero_tail"] == ("packed_tail", "build_zero_tail_kernel")


def test_bad_outputs_are_refused_before_any_build():
    cu = torch.tensor([0, 5], dtype=torch.int32)
    with pytest.raises(ValueError, match=r"packed \[1, T, HV, V\]"):
        packed_tail.zero_packed_tail(torch.zeros(2, 8, 2, 128), cu)
    with pytest.raises(ValueError, match="contiguous"):
        packed_tail.zero_packed_tail(torch.zeros(1, 8, 128, 2).transpose(2, 3), cu)
    with pytest.raises(ValueError, match="V must be a positive int"):
        packed_tail.build_zero_tail_kernel(0, "bfloat16", "int32")
    with pytest.raises(ValueError, match="V must be a positive int"):
        packed_tail.build_zero_tail_kernel(64.5, "bfloat16", "int32")
    with pytest.raises(ValueError, match="int32 or int64"):
        packed_tail.build_zero_tail_kernel(128, "bfloat16", "float32")
    o = torch.zeros(1, 8, 2, 128)
    with pytest.raises(TypeError, match="o must be bfloat16"):
        packed_tail.zero_packed_tail(o.int(), cu)
    for bad, err, name in ((None, TypeError, "cu_seqlens must be an int32"), (cu.float(), TypeError, "dtype int32"),
                           (cu[:0], ValueError, "at least one entry"), (cu[None], ValueError, "1-D"),
                           (cu.to("meta"), ValueError, "cu_seqlens is on meta")):
        with pytest.raises(err, match=name):
            packed_tail.zero_packed_tail(o, bad)
    with pytest.raises(ValueError, match="CUDA tensor"):
        packed_tail.zero_packed_tail(o, cu)
    empty = torch.zeros(1, 0, 2, 128)
    assert packed_tail.zero_packed_tail(empty, cu) is empty  # no rows: nothing to launch

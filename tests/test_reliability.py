"""Regression tests of issue 44 ("Reliability"), the CPU-visible findings; each docstring says what the
code did before the fix.

- finding 6: a numpy cu_seqlens / initial_state, the planner's NaN / float sizes, torch.compile on CPU
  tensors, a missing nvcc, the backend's zero-buffer cache shared between streams;
- finding 3: one gate floor (`flashqla.contract.G_FLOOR`) on every path, g = -inf as "forget everything";
- finding 4: the valid input domain (beta in [0, 1], finite inputs) checked where it costs no sync,
  and with `check_inputs=True`;
- finding 2: cu_seqlens ending before T on CPU offsets; o's tail never uninitialised memory;
- finding 1: `flashqla.distributed` ranks that disagree fail fast, with one error on every rank.
"""

from __future__ import annotations

import math

import numpy as np
import pytest
import torch

import flashqla
import reference
from flashqla.contract import check_gdn_inputs
from flashqla.testing import make_gdn_inputs


def _small(**kw):
    kw = {**dict(B=1, T=40, H=1, HV=2, K=8, V=8, seqlens=[15, 25]), **kw}
    return make_gdn_inputs(**kw)


def _kernel_dtypes(x: dict) -> dict:
    """The fast path's dtypes and head dims (K = V = 128) on CPU: the op's checks pass up to its device check."""
    x = dict(x)
    for n in ("q", "k", "v"):
        x[n] = x[n].to(torch.bfloat16)
    for n in ("g", "beta", "initial_state"):
        x[n] = x[n].float()
    return x


# ------------------------------------------------------------------------------------------------
# finding 6
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ["cu_seqlens", "initial_state"])
def test_numpy_argument_is_a_type_error_naming_it(name):
    """Regression: a numpy array has `.device == "cpu"`, and the device check ran first: "cu_seqlens is
    on cpu but q is on cpu" (a ValueError naming no type)."""
    x = _small()
    x[name] = x[name].numpy()
    for entry in (check_gdn_inputs, reference.chunk_gated_delta_rule, reference.recurrent_gated_delta_rule):
        with pytest.raises(TypeError, match=rf"^{name} must be"):
            entry(**x)
    with pytest.raises(TypeError, match=rf"^{name} must be"):
        flashqla.chunk_gated_delta_rule(**_kernel_dtypes(_small(K=128, V=128)) | {name: x[name]})


@pytest.mark.parametrize("kw, name", [(dict(T=100.5), "T"), (dict(T=4096.0), "T"), (dict(max_seqlen=math.nan), "max_seqlen"),
                                      (dict(max_seqlen=1.5), "max_seqlen"), (dict(HV=True), "HV"), (dict(N="2"), "N")])
def test_planner_names_a_non_integer_argument(kw, name):
    """Regression: plan_cp(T=100.5) raised "'float' object cannot be interpreted as an integer" and
    max_seqlen=NaN "cannot convert float NaN to integer" (no argument named)."""
    from flashqla.cp.plan import plan_cp

    args = {**dict(HV=4, N=1, T=4096), **kw}
    with pytest.raises(ValueError, match=rf"{name} must be an int"):
        plan_cp(**args)


def test_torch_compile_on_cpu_tensors_reaches_the_clear_error():
    """Regression: under torch.compile(fullgraph=True) the CPU value checks read cu_seqlens while
    tracing: a dynamo guard error ("Could not guard on data-dependent expression") instead of the op's
    own error. Value checks are skipped while compiling; what surfaces is the device error."""
    x = _kernel_dtypes(_small(K=128, V=128))
    torch._dynamo.reset()
    f = torch.compile(flashqla.chunk_gated_delta_rule, fullgraph=True, backend="eager")
    with pytest.raises(Exception) as info:
        f(**x)
    text = str(info.value) + repr(info.value.__cause__)
    assert "data-dependent" not in text, text[:500]
    assert "runs on a CUDA device of compute capability 9.0" in text, text[:500]
    torch._dynamo.reset()
    g = torch.compile(flashqla.chunk_gated_delta_rule, backend="eager")
    with pytest.raises(RuntimeError, match="runs on a CUDA device of compute capability 9.0"):
        g(**x)
    torch._dynamo.reset()

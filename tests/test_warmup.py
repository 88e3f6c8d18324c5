"""`flashqla.warmup`: what it builds and how it rejects bad arguments (CPU; the GPU tier's
`test_new_lengths_and_mixes_do_not_recompile` shows that no call compiles after it)."""

import pytest
import torch

import flashqla


@pytest.fixture
def recorded(monkeypatch):
    """build_kernels replaced by a recorder: the specs warmup asks for, nothing compiled."""
    import flashqla.ops.gdn.kernels.sm90 as sm90

    calls = []
    monkeypatch.setattr(sm90, "build_kernels", lambda specs: calls.append(list(specs)))
    return calls


def _kinds(specs):
    return [kind for kind, _ in specs]


def test_builds_both_widths_the_split_path_and_the_backward(recorded):
    from flashqla.ops.gdn.kernels.sm90 import op_kernel_specs

    assert flashqla.warmup(2, 4) == 0  # the recorder compiles nothing
    (specs,) = recorded
    assert len(specs) == len(set(specs))
    plain = [a for k, a in specs if k == "recurrent" and len(a) == 9]
    dual = [a for k, a in specs if k == "recurrent" and len(a) == 10 and a[-1] is True]
    assert sorted(a[4] for a in plain) == [64, 128]  # BV of the unsplit launch, both widths
    assert sorted(a[4] for a in dual) == [64, 128]
    for kind in ("prepare", "cp_scan", "cp_correct", "cp_limits", "cp_tables", "cp_slot_h0", "cp_relayout",
                 "states_bwd", "chunk_bwd", "dg_cumsum", "gva_reduce", "cp_state_grads"):
        assert kind in _kinds(specs), kind
    # exactly what the op's own first uses would build, at either width
    want = set(op_kernel_specs(2, 4, varlen=True, block_v=64)) | set(op_kernel_specs(2, 4, varlen=True, block_v=128))
    assert set(specs) == want


def test_forward_only_and_dtypes(recorded):
    flashqla.warmup(4, 8, dtype=torch.float16, beta_dtype=torch.float16, varlen=False, backward=False)
    (specs,) = recorded
    kinds = _kinds(specs)
    assert "chunk_bwd" not in kinds and "cp_tables" not in kinds  # fixed length: tables by torch ops
    prepare = [a for k, a in specs if k == "prepare"]
    assert prepare and all(a[3] == "float16" and a[4] == "float16" and a[6] is False for a in prepare)
    flashqla.warmup(4, 8, seqlens_dtype=torch.int64, backward=False)
    assert all(a[5] == "int64" for k, a in recorded[1] if k == "prepare")


@pytest.mark.parametrize("kwargs, name", [
    (dict(H=0, HV=4), "H"),
    (dict(H=2, HV=4.0), "HV"),
    (dict(H=3, HV=4), "HV"),
    (dict(H=2, HV=4, K=64), "K"),
    (dict(H=2, HV=4, dtype=torch.float32), "dtype"),
    (dict(H=2, HV=4, beta_dtype=torch.float64), "beta_dtype"),
    (dict(H=2, HV=4, seqlens_dtype=torch.int16), "seqlens_dtype"),
    (dict(H=2, HV=4, varlen=1), "varlen"),
    (dict(H=2, HV=4, backward="yes"), "backward"),
])
def test_bad_arguments_name_the_argument(recorded, kwargs, name):
    with pytest.raises(ValueError, match=rf"\b{name}\b"):
        flashqla.warmup(**kwargs)
    assert recorded == []

"""`flashqla.warmup`: what it builds and how it rejects bad arguments (CPU; the GPU tier's
`test_new_lengths_and_mixes_do_not_recompile` shows that no call compiles after it)."""

import pytest
import torch

import flashqla


@pytest.fixture
def recorded(monkeypatch):
    """build_kernels replaced by a recorder (warmup's and the first-use builds'): the specs asked for,
    nothing compiled."""
    from flashqla.ops.gdn import api
    from flashqla.ops.gdn.kernels.sm90 import registry

    calls = []
    record = lambda specs: calls.append(list(specs))  # noqa: E731
    monkeypatch.setattr(api, "build_kernels", record)
    monkeypatch.setattr(registry, "build_kernels", record)
    monkeypatch.setattr(registry, "_BUILT", set())
    return calls


def _kinds(specs):
    return [kind for kind, _ in specs]


def test_builds_both_widths_the_split_path_and_the_backward(recorded):
    from flashqla.ops.gdn.kernels.sm90.registry import op_kernel_specs

    assert flashqla.warmup(2, 4) == 0  # the recorder compiles nothing
    (specs,) = recorded
    assert len(specs) == len(set(specs))
    plain = [a for k, a in specs if k == "recurrent" and len(a) == 8]
    dual = [a for k, a in specs if k == "recurrent" and len(a) == 9 and a[-1] is True]
    assert sorted(a[4] for a in plain) == [64, 128]  # BV of the unsplit launch, both widths
    assert sorted(a[4] for a in dual) == [64, 128]
    for kind in ("prepare", "cp_scan", "cp_correct", "cp_limits", "cp_tables", "cp_slot_h0", "cp_relayout",
                 "states_bwd", "chunk_bwd", "dg_cumsum", "gva_reduce", "cp_state_grads", "launch_order"):
        assert kind in _kinds(specs), kind
    # exactly what the op's own first uses would build, at either width
    want = set(op_kernel_specs(2, 4, varlen=True, block_v=64)) | set(op_kernel_specs(2, 4, varlen=True, block_v=128))
    assert set(specs) == want


def test_pass2_build_follows_whether_dh0_is_returned(recorded, monkeypatch):
    """Pass 2 builds with "l" (`chunk_bwd.DH0_OPTS`, the more precise state gradient) for a call that
    returns dh0 and without it for one that does not; a first use builds only its own, warmup both."""
    from flashqla.ops.gdn.backend import Sm90Backend
    from flashqla.ops.gdn.kernels.sm90 import registry

    pass2 = lambda specs: sorted((a[-2], a[-1]) for k, a in specs if k == "chunk_bwd")  # noqa: E731  (varlen, dh0)
    flashqla.warmup(2, 4)
    assert pass2(recorded[0]) == [(True, False), (True, True)]  # packed input (and the split path's segments)
    flashqla.warmup(2, 4, varlen=False)
    assert pass2(recorded[1]) == [(False, False), (False, True), (True, False), (True, True)]  # and its packed segments
    q, v, beta = torch.zeros(1, 128, 2, 128), torch.zeros(1, 128, 4, 128), torch.zeros(1, 128, 4)
    cu = torch.tensor([0, 128], dtype=torch.int32)
    for dh0 in (True, False):
        monkeypatch.setattr(registry, "_BUILT", set())
        recorded.clear()
        Sm90Backend()._build_bwd(q.bfloat16(), v.bfloat16(), beta, cu, dh0)
        assert pass2(recorded[0]) == [(True, dh0)], dh0


def test_forward_only_and_dtypes(recorded):
    flashqla.warmup(4, 8, dtype=torch.float16, beta_dtype=torch.float16, varlen=False, backward=False)
    (specs,) = recorded
    kinds = _kinds(specs)
    assert "chunk_bwd" not in kinds and "cp_tables" not in kinds  # fixed length: tables by torch ops
    prepare = [a for k, a in specs if k == "prepare"]
    assert all(a[3] == "float16" and a[4] == "float16" for a in prepare)
    # the caller's rows, and the split path's packed int32 segment offsets, each with all G value
    # heads a CTA and with one (`prepare.pick_heads_per_cta`, for few chunk slots)
    assert sorted((a[5], a[6], a[7] if len(a) > 7 else 0) for a in prepare) == [
        ("int32", False, 0), ("int32", False, 1), ("int32", True, 0), ("int32", True, 1)]
    flashqla.warmup(4, 8, seqlens_dtype=torch.int64, backward=False)
    assert all(a[5] == "int64" for k, a in recorded[1] if k == "prepare")


@pytest.mark.parametrize("dtype, beta_dtype", [(torch.bfloat16, torch.float32), (torch.float16, torch.float16)])
def test_fixed_length_covers_the_split_path(recorded, monkeypatch, dtype, beta_dtype):
    """A fixed-length batch splits on packed int32 offsets of its segments (`flashqla.cp.segments`):
    warmup with varlen=False builds what that path builds on them, keys taken from the op's own first
    uses (the backend's warm of the split forward and of the backward's recompute, the segments'
    backward `Sm90Backend._build_bwd`, the slot relayouts both ways)."""
    import flashqla.cp.segments as segments
    from flashqla.cp.forward import flat
    from flashqla.ops.gdn.backend import Sm90Backend
    from flashqla.ops.gdn.kernels.sm90 import registry

    H, HV, B, T = 2, 4, 3, 3000
    flashqla.warmup(H, HV, dtype=dtype, beta_dtype=beta_dtype, varlen=False)
    (warm,) = recorded
    recorded.clear()

    q = torch.zeros(B, T, H, 128, dtype=dtype)
    v = torch.zeros(B, T, HV, 128, dtype=dtype)
    beta = torch.zeros(B, T, HV, dtype=beta_dtype)
    tables, _ = segments.split_tables(None, 512, B, T, "cpu")
    pcu = tables.cu_seqlens
    assert pcu.dtype == torch.int32
    qf, vf, bf = flat(q), flat(v), flat(beta)
    for bv in (64, 128):  # either width the planner picks
        Sm90Backend().warm(qf, bf, qf, vf, pcu, HV, bv, dual=True)
    monkeypatch.setattr(registry, "_BUILT", set())
    for dh0 in (True, False):
        Sm90Backend()._build_bwd(qf, vf, bf, pcu, dh0)
    relayouts = []
    import flashqla.ops.gdn.kernels.sm90.cp_relayout as cp_relayout

    monkeypatch.setattr(cp_relayout, "build_relayout_kernel",
                        lambda *args: relayouts.append(("cp_relayout", args)) or (lambda *a: None))
    A, G = torch.zeros(HV, 64, 64, dtype=dtype), torch.zeros(HV, 64)
    for to_segments in (False, True):
        cp_relayout.relayout_slots(A, G, tables, None, B, T, 1, to_segments)
    want = {s for call in recorded for s in call} | set(relayouts)
    assert {k for k, _ in want} >= {"prepare", "recurrent", "cp_relayout", "states_bwd", "chunk_bwd"}
    assert want <= set(warm), f"not warmed up: {sorted(want - set(warm))}"


@pytest.mark.parametrize("kwargs, name", [
    (dict(H=0, HV=4), "H"),
    (dict(H=2, HV=4.0), "HV"),
    (dict(H=3, HV=4), "HV"),
    (dict(H=2, HV=4, K=64), "K"),
    (dict(H=2, HV=4, K=128.0), "K"),
    (dict(H=2, HV=4, V=128.0), "V"),
    (dict(H=2, HV=4, K=True), "K"),
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


def test_seqlens_dtype_is_checked_without_varlen(recorded):
    """Validated always, used only with varlen (the split path's offsets are int32 either way)."""
    with pytest.raises(ValueError, match=r"\bseqlens_dtype\b"):
        flashqla.warmup(2, 4, varlen=False, seqlens_dtype=torch.int16)
    assert recorded == []
    flashqla.warmup(2, 4, varlen=False, seqlens_dtype=torch.int32)
    flashqla.warmup(2, 4, varlen=False, seqlens_dtype=torch.int64)
    assert recorded[0] == recorded[1] and "int64" not in str(recorded[1])


def test_split_checkpoint_warm_spec_binds_to_its_builder(monkeypatch):
    """`Sm90Backend.warm(dual=True, checkpoints=True)` names the split path's checkpoint build with
    arguments its registry builder accepts and that build the same key the launcher uses (a spec of
    the wrong length raised TypeError only on the GPU)."""
    import inspect

    from flashqla.cp.forward import flat
    from flashqla.ops.gdn.backend import Sm90Backend
    from flashqla.ops.gdn.kernels.sm90 import recurrent as rec
    from flashqla.ops.gdn.kernels.sm90 import registry

    recorded = []
    monkeypatch.setattr(registry, "build_once", lambda key, specs: recorded.append(list(specs)))
    q = torch.zeros(1, 2048, 2, 128, dtype=torch.bfloat16)
    v = torch.zeros(1, 2048, 8, 128, dtype=torch.bfloat16)
    beta = torch.zeros(1, 2048, 8)
    pcu = torch.tensor([0, 512, 1024, 1536, 2048], dtype=torch.int32)
    for bv in (64, 128):
        Sm90Backend().warm(flat(q), flat(beta), flat(q), flat(v), pcu, 8, bv, dual=True, checkpoints=True)
    specs = [s for call in recorded for s in call if s[0] == "recurrent_serving"]
    assert len(specs) == 2
    for kind, args in specs:
        module, name = registry.BUILDERS[kind]
        bound = inspect.signature(getattr(rec, name)).bind(*args)
        assert bound.arguments["dual"] is True and bound.arguments["checkpoints"] is True
        assert args[:8] == rec.recurrent_kernel_args(q, v, pcu, args[4])

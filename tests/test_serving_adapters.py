"""The engine adapters (`flashqla.integrations.vllm`, `flashqla.integrations.sglang`) driven with
the engines' calling pattern on CPU through the reference backend: a state pool, per-request slot
indices (one padding slot), has_initial_state, log-space g = -exp(A_log) softplus(a + dt_bias), beta
= sigmoid(b), raw q/k normalised in the op (use_qk_l2norm_in_kernel=True), packed offsets. Each
result is checked against the engine's own four-line pattern (gather, zero, op, scatter) run on the
fp64 token recurrence, and a second prefill continues the first (chunked prefill of one request)."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

import reference
from flashqla.integrations import sglang, vllm
from flashqla.testing import rel_rms

H, HV, K, V = 1, 3, 128, 128


def _engine_inputs(lens, seed):
    gen = torch.Generator().manual_seed(seed)
    T = sum(lens)
    q = torch.randn(1, T, H, K, generator=gen, dtype=torch.float64)
    k = torch.randn(1, T, H, K, generator=gen, dtype=torch.float64)
    v = torch.randn(1, T, HV, V, generator=gen, dtype=torch.float64)
    A_log = torch.tensor([-30.0, 0.0, 2.0], dtype=torch.float64)  # g ~ 0 head, an ordinary head, a strong-decay head
    a = torch.randn(1, T, HV, generator=gen, dtype=torch.float64)
    b = torch.randn(1, T, HV, generator=gen, dtype=torch.float64)
    g = -A_log.exp() * F.softplus(a + 0.5)
    beta = b.sigmoid()
    cu = torch.tensor([0] + torch.tensor(lens).cumsum(0).tolist(), dtype=torch.int32)
    return dict(q=q, k=k, v=v, g=g, beta=beta), cu


def _engine_truth(x, cu, pool_kv, idx, has):
    """vLLM's pattern on the fp64 recurrence: gather, zero rows without a state, run, scatter."""
    h0 = torch.stack([pool_kv[i] if i >= 0 and h else torch.zeros(HV, K, V, dtype=torch.float64)
                      for i, h in zip(idx.tolist(), has.tolist())])
    o, f = reference.recurrent_gated_delta_rule(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                                use_qk_l2norm_in_kernel=True)
    after = pool_kv.clone()
    for n, i in enumerate(idx.tolist()):
        if i >= 0:
            after[i] = f[n]
    return o, after


@pytest.mark.parametrize("engine", ["vllm", "sglang"])
@pytest.mark.parametrize("state_dtype", [torch.float32, torch.bfloat16])
def test_engine_pattern_two_chunked_prefills(engine, state_dtype):
    layout = "kv" if engine == "vllm" else "vk"
    gen = torch.Generator().manual_seed(0)
    pool_kv = torch.randn(6, HV, K, V, generator=gen, dtype=torch.float64).to(state_dtype).double()
    idx = torch.tensor([4, -1, 0, 2])
    steps = [([70, 5, 1, 64], torch.tensor([False, False, True, False])),  # new requests (row 0 has a prefix)
             ([33, 5, 129, 1], torch.tensor([True, True, True, True]))]  # their next prefill chunks
    pool = (pool_kv if layout == "kv" else pool_kv.transpose(-1, -2)).to(state_dtype).contiguous()
    truth_pool = pool_kv.clone()
    for step, (lens, has) in enumerate(steps):
        x, cu = _engine_inputs(lens, seed=10 + step)
        o_ref, truth_pool = _engine_truth(x, cu, truth_pool, idx, has)
        if engine == "vllm":
            o = vllm.gdn_prefill(**x, ssm_state=pool, state_indices=idx, has_initial_state=has, cu_seqlens=cu,
                                 backend="reference")
        else:
            o, last, h = sglang.FlashQLAGDNKernel(backend="reference").extend(
                **x, ssm_states=pool, cache_indices=idx, query_start_loc=cu, has_initial_state=has)
            assert last is None and h is None
        real = torch.cat([torch.arange(int(cu[n]), int(cu[n + 1])) for n in range(len(lens)) if idx[n] >= 0])
        got = (pool if layout == "kv" else pool.transpose(-1, -2)).double()
        rows = sorted(i for i in idx.tolist() if i >= 0)
        e_o, e_s = rel_rms(o[:, real], o_ref[:, real]), rel_rms(got[rows], truth_pool[rows])
        budget = 1e-6 if state_dtype == torch.float32 else 1e-2
        assert e_o < (1e-12 if step == 0 or state_dtype == torch.float32 else budget) and e_s < budget, (step, e_o, e_s)
        assert torch.equal(got[[1, 3, 5]], pool_kv[[1, 3, 5]]), "rows of no request changed"
        truth_pool[rows] = got[rows]  # the engine continues from what its pool holds (bf16-rounded)


def test_vllm_drop_in_signature():
    x, cu = _engine_inputs([20, 30], seed=1)
    h0 = torch.randn(2, HV, K, V, dtype=torch.float64)
    o, f = vllm.chunk_gated_delta_rule(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu, head_first=False,
                                       use_qk_l2norm_in_kernel=True, backend="reference")
    o_r, f_r = reference.recurrent_gated_delta_rule(**x, initial_state=h0, output_final_state=True, cu_seqlens=cu,
                                                    use_qk_l2norm_in_kernel=True)
    assert rel_rms(o, o_r) < 1e-12 and rel_rms(f, f_r) < 1e-12
    with pytest.raises(ValueError, match="head_first"):
        vllm.chunk_gated_delta_rule(**x, cu_seqlens=cu, head_first=True, backend="reference")


def test_adapters_report_bad_arguments_by_name():
    x, cu = _engine_inputs([20, 30], seed=2)
    pool = torch.zeros(3, HV, V, K)
    with pytest.raises(ValueError, match="state_indices"):
        sglang.extend(**x, ssm_states=pool, cache_indices=torch.tensor([0, 3]), query_start_loc=cu, backend="reference")
    with pytest.raises(ValueError, match="initial_state"):  # a "kv" pool given where "vk" is expected: V != K here
        sglang.extend(**{n: t[..., :64] if n in ("q", "k") else t for n, t in x.items()},
                      ssm_states=torch.zeros(3, HV, 64, V), cache_indices=torch.tensor([0, 1]), query_start_loc=cu,
                      backend="reference")
    with pytest.raises(ValueError, match="inplace_update"):
        sglang.extend(**x, ssm_states=pool, cache_indices=torch.tensor([0, 1]), query_start_loc=cu, backend="reference",
                      inplace_update=False)
    with pytest.raises(ValueError, match="backend"):
        vllm.gdn_prefill(**x, ssm_state=pool, state_indices=torch.tensor([0, 1]), has_initial_state=None, cu_seqlens=cu,
                         backend="flashqla")  # no Hopper GPU here


def test_host_offsets_reach_flashqlas_planner_only(monkeypatch):
    """The engines' host copy of the offsets (vLLM `cu_seqlens_cpu`, SGLang `query_start_loc_cpu`)
    reaches flashqla's op as `cu_seqlens_cpu` and is checked then dropped for the reference op (which
    has no planner); a copy that does not match is refused by name on either backend."""
    from flashqla.integrations import qwen3_next

    x, cu = _engine_inputs([20, 30], seed=3)
    seen = []

    def op(*args, **kw):  # stands for flashqla.chunk_gated_delta_rule (no Hopper GPU here)
        seen.append(kw.get("cu_seqlens_cpu"))
        return reference.chunk_gated_delta_rule(*args, **{n: v for n, v in kw.items() if n != "cu_seqlens_cpu"})
    monkeypatch.setattr(qwen3_next, "select_op", lambda backend, device: op)
    monkeypatch.setattr(vllm, "select_op", lambda backend, device: op)
    monkeypatch.setattr(sglang, "select_op", lambda backend, device: op)
    pool = torch.zeros(3, HV, K, V, dtype=torch.float64)
    vllm.gdn_prefill(**x, ssm_state=pool, state_indices=torch.tensor([0, 1]), has_initial_state=None, cu_seqlens=cu,
                     cu_seqlens_cpu=cu.clone())
    vllm.chunk_gated_delta_rule(**x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone())
    sglang.extend(**x, ssm_states=pool.transpose(-1, -2).contiguous(), cache_indices=torch.tensor([0, 1]),
                  query_start_loc=cu, query_start_loc_cpu=cu.clone())
    vllm.chunk_gated_delta_rule(**x, cu_seqlens=cu)
    assert [s is not None and torch.equal(s, cu) for s in seen] == [True, True, True, False]
    monkeypatch.undo()
    ref = qwen3_next.select_op("reference", "cpu")
    assert qwen3_next.host_offsets_kwargs(ref, cu.clone(), x["q"], cu) == {}
    o, _ = vllm.chunk_gated_delta_rule(**x, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), backend="reference")
    assert torch.isfinite(o).all()
    for bad, err in ((cu[:-1].clone(), ValueError), (cu.float(), TypeError), (torch.tensor([0, 20, 49]), ValueError)):
        with pytest.raises(err, match="cu_seqlens_cpu"):
            vllm.gdn_prefill(**x, ssm_state=pool, state_indices=torch.tensor([0, 1]), has_initial_state=None,
                             cu_seqlens=cu, cu_seqlens_cpu=bad, backend="reference")
        with pytest.raises(err, match="query_start_loc_cpu") as info:
            sglang.extend(**x, ssm_states=pool.transpose(-1, -2).contiguous(), cache_indices=torch.tensor([0, 1]),
                          query_start_loc=cu, query_start_loc_cpu=bad, backend="reference")
        assert "cu_seqlens" not in str(info.value)


def test_adapter_errors_come_in_the_ops_order_and_the_engines_names():
    """A correct host copy never hides the op's own error (B != 1, a 3-D q, empty offsets, offsets as a
    list); SGLang's errors name query_start_loc / query_start_loc_cpu, never cu_seqlens; flashqla's
    name for the host copy is refused by SGLang's `extend` instead of being swallowed; the kernel
    object's backend can be overridden per call."""
    x, cu = _engine_inputs([20, 30], seed=4)
    pool = torch.zeros(3, HV, V, K, dtype=torch.float64)
    idx = torch.tensor([0, 1])
    xb = {n: t.reshape(2, 25, *t.shape[2:]) for n, t in x.items()}
    with pytest.raises(ValueError, match="B == 1"):
        vllm.chunk_gated_delta_rule(**xb, cu_seqlens=cu, cu_seqlens_cpu=cu.clone(), backend="reference")
    with pytest.raises(ValueError, match="q must have 4"):
        vllm.chunk_gated_delta_rule(x["q"][0], x["k"], x["v"], x["g"], x["beta"], cu_seqlens=cu, cu_seqlens_cpu=cu.clone(),
                                    backend="reference")
    with pytest.raises(TypeError, match="cu_seqlens"):
        vllm.chunk_gated_delta_rule(**x, cu_seqlens=cu.tolist(), cu_seqlens_cpu=cu, backend="reference")
    with pytest.raises(ValueError, match="given without cu_seqlens"):
        vllm.chunk_gated_delta_rule(**x, cu_seqlens_cpu=cu, backend="reference")
    for bad, err in ((cu.float(), TypeError), (cu[:-1].clone() - 0, ValueError)):
        with pytest.raises(err, match="query_start_loc") as info:
            sglang.extend(**x, ssm_states=pool, cache_indices=idx, query_start_loc=bad, backend="reference")
        assert "cu_seqlens" not in str(info.value)
    with pytest.raises(TypeError, match="query_start_loc_cpu, not cu_seqlens_cpu"):
        sglang.extend(**x, ssm_states=pool, cache_indices=idx, query_start_loc=cu, cu_seqlens_cpu=cu, backend="reference")
    kernel = sglang.FlashQLAGDNKernel(backend="flashqla")  # no Hopper GPU here: the per-call backend wins
    o, _, _ = kernel.extend(**x, ssm_states=pool, cache_indices=idx, query_start_loc=cu, backend="reference")
    assert torch.isfinite(o).all()

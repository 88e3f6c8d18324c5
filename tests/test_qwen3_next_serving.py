"""A real client of the serving contract: transformers' Qwen3-Next (a small random fp64 model, one GDN
layer and one full-attention layer), greedy `generate()`, every GDN prefill run by
`reference.chunk_gated_delta_rule` with a state pool (the "vk" layout, as the engines keep it),
slot indices and a checkpoint in the middle of the prompt (position 70: not a chunk boundary).
A second request sharing the first 70 tokens resumes from that checkpoint (copied into its own
pool row, as a prefix cache hit would) and prefills only its own tokens. Tokens and logits of both
requests match transformers' own torch path run on the whole prompts (fp64 throughout,
`keep_float64`)."""

from __future__ import annotations

import inspect

import pytest
import torch

qn = pytest.importorskip("flashqla.integrations.qwen3_next")
try:
    qn.qwen3_next_modeling()
except qn.Qwen3NextUnavailable as e:  # pragma: no cover - transformers is a dev dependency
    pytest.skip(str(e), allow_module_level=True)

import reference
from flashqla.testing import rel_rms

PREFIX, NEW = 70, 3


def test_pooled_prefill_with_checkpoint_and_prefix_resume():
    config = qn.tiny_qwen3_next_config(layer_types=("linear_attention", "full_attention"))
    model = qn.build_model(config, seed=2, dtype=torch.float64)
    HV, K, V = config.linear_num_value_heads, config.linear_key_head_dim, config.linear_value_head_dim
    # no token 0: `prefill_and_decode` passes pad_token_id=0, and generate() would mask it out of the
    # whole prompt, where the prefix prefill of request 2 (a plain forward) does not
    prompt1 = qn.make_input_ids(config, 1, 100, seed=3) % (config.vocab_size - 1) + 1
    prompt2 = torch.cat([prompt1[:, :PREFIX], qn.make_input_ids(config, 1, 37, seed=5) % (config.vocab_size - 1) + 1], dim=1)

    def torch_generate(ids):
        return qn.prefill_and_decode(model, ids, qn.torch_chunk_path(), new_tokens=NEW, float64=True)

    seq1_t, logits1_t = torch_generate(prompt1)
    seq2_t, logits2_t = torch_generate(prompt2)  # 107 tokens

    pool = torch.full((4, HV, V, K), float("nan"), dtype=torch.float64)  # rows are written before they are read
    impl = qn.PooledPrefill(reference.chunk_gated_delta_rule, pool)
    checkpoints = torch.full((1, HV, V, K), float("nan"), dtype=torch.float64)
    # request 1: slot 1, a checkpoint after the 70th prompt token
    impl.slot, impl.resume, impl.positions, impl.checkpoints = 1, False, [PREFIX], checkpoints
    seq1, logits1 = qn.prefill_and_decode(model, prompt1, impl, new_tokens=NEW, float64=True)
    assert impl.calls == [100] and torch.isfinite(checkpoints).all()

    # request 2 shares the first 70 tokens: the convolution and attention caches of the prefix come
    # from a prefill of the prefix, whose recurrent state is then thrown away (NaN) and replaced by
    # request 1's checkpoint, copied into the new request's pool row (a prefix cache hit)
    impl.slot, impl.resume = 2, False
    with qn.swap_chunk_gated_delta_rule(model, impl), qn.keep_float64(), torch.no_grad():
        cache = model(input_ids=prompt2[:, :PREFIX], use_cache=True).past_key_values
    gdn = next(i for i, t in enumerate(config.layer_types) if t == "linear_attention")
    cache.layers[gdn].recurrent_states[0].fill_(float("nan"))
    pool[2] = float("nan")
    pool[2] = checkpoints[0]
    impl.resume = True
    cache_kw = "cache" if "cache" in inspect.signature(model.forward).parameters else "past_key_values"  # renamed in 5.25
    with qn.swap_chunk_gated_delta_rule(model, impl), qn.keep_float64(), torch.no_grad():
        out = model.generate(prompt2, **{cache_kw: cache}, max_new_tokens=NEW, min_new_tokens=NEW, do_sample=False,
                             use_cache=True, output_logits=True, return_dict_in_generate=True, pad_token_id=0)
    seq2, logits2 = out.sequences, torch.stack(out.logits)
    assert impl.calls == [100, PREFIX, 107 - PREFIX], impl.calls  # request 2 prefilled only its own 37 tokens

    errs = [rel_rms(logits1, logits1_t), rel_rms(logits2, logits2_t)]
    assert torch.equal(seq1, seq1_t) and torch.equal(seq2, seq2_t)
    print("logits rel RMS vs transformers' torch path: request 1 %.1e, request 2 (resumed) %.1e" % tuple(errs))
    assert max(errs) < 1e-10, errs
    # the checkpoint is the recurrence's state after 70 tokens (the layer's own torch path on the prefix)
    assert not torch.equal(pool[1], pool[2])

# %% [markdown]
# # 00 · A tour of flashqla
#
# One algorithm, Gated DeltaNet (GDN) chunked prefill, with four faces that share their names:
#
# | folder | role |
# | --- | --- |
# | `reference/` | plain PyTorch in fp64: the token recurrence (ground truth), FLA's chunked steps, our rewrites, CP simulated |
# | `derivations/` | SymPy proofs of every algebraic step, each with two numeric twins in `reference/` |
# | `flashqla/` | the production op: TileLang kernels for Hopper (sm_90) |
# | `notebooks/` | these narrations; every claim is an `assert` |
#
# This notebook walks the ladder at toy size: derivations -> reference -> kernels.
# The size is picked by `FLASHQLA_NB_SIZE` (`small` by default, `full` on the GPU machine).

# %%
import os

import torch

import reference
from flashqla.testing import make_gdn_inputs, rel_rms

SIZE = os.environ.get("FLASHQLA_NB_SIZE", "small")
K = V = 16 if SIZE == "small" else 128
print(f"size: {SIZE}, K = V = {K}")

# %% [markdown]
# ## The recurrence
# Per value head and token: $S_t = e^{g_t}(I - \beta_t k_t k_t^\top) S_{t-1} + \beta_t k_t v_t^\top$,
# $o_t = \text{scale}\, S_t^\top q_t$. Inputs come from the valid domain: L2-normalised q and k,
# Qwen3-Next's gate, sigmoid beta; head 0 never decays (g = 0) and the last head decays very strongly.

# %%
x = make_gdn_inputs(B=1, T=150, H=2, HV=4, K=K, V=V, cu_seqlens=[20, 0, 130])
print({n: tuple(t.shape) for n, t in x.items() if t is not None})
assert float(x["g"][..., 0].abs().max()) == 0.0 and float(x["g"][..., -1].max()) <= -30.0
o_rec, ht_rec = reference.recurrent_gated_delta_rule(**x, output_final_state=True)

# %% [markdown]
# ## Chunked prefill (FLA's five steps) equals the recurrence
# The chunked form groups 64 tokens, turns their rank-1 updates into a few matrix products (the
# WY/UT representation) and carries the state only between chunks.

# %%
o_chk, ht_chk = reference.chunk_gated_delta_rule(**x, output_final_state=True)
err_o, err_ht = rel_rms(o_chk, o_rec), rel_rms(ht_chk, ht_rec)
print(f"o: {err_o:.1e}   final state: {err_ht:.1e}   (relative RMS, fp64)")
assert err_o < 1e-12 and err_ht < 1e-12

# %% [markdown]
# ## The derivations behind it
# Each algebraic step is a record proved by SymPy at tiny sizes. Here is the chunk-form record;
# `python -m derivations` proves them all.

# %%
import derivations

rows = derivations.run_all(ids=["CF-1"], processes=1)
print(derivations.format_table(rows))
assert all(r.ok for r in rows)

# %% [markdown]
# ## Kernels
# The TileLang kernels need a Hopper GPU (compute capability 9.0); `60_kernels` compares them with the
# reference stage by stage.

# %%
if torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0):
    import flashqla

    xd = make_gdn_inputs(B=1, T=150, H=2, HV=4, K=128, V=128, cu_seqlens=[20, 0, 130], dtype=torch.bfloat16, device="cuda")
    o_k, ht_k = flashqla.chunk_gated_delta_rule(**xd, output_final_state=True)
    xr = {n: (t.double().cpu() if t is not None and t.is_floating_point() else t) for n, t in xd.items()}
    xr["cu_seqlens"] = xd["cu_seqlens"].cpu()
    o_r, ht_r = reference.recurrent_gated_delta_rule(**xr, output_final_state=True)
    print(f"kernel o: {rel_rms(o_k, o_r):.1e}   final state: {rel_rms(ht_k, ht_r):.1e}")
    assert rel_rms(o_k, o_r) < 1e-2 and rel_rms(ht_k, ht_r) < 1e-2
else:
    print("skipped: the kernels need a CUDA GPU of compute capability 9.0 (Hopper); none here")

# %% [markdown]
# ## Where next
# Each numbered notebook narrates one step and asserts its claims:
#
# | notebook | what it shows |
# | --- | --- |
# | `10_recurrence_to_chunks` | the chunk-form records (CF) rendered and proved, their twins in fp64, fp32 per token |
# | `20_wy_representation` | the WY/UT records, conditioning of $I + L$, the inverse's error in fp32, bf16, tf32 and the kernel's fp16 doubling |
# | `30_rewrites` | every hardware-friendly rewrite (RW): proved, and no less accurate than FLA's form in bf16/fp32 |
# | `40_backward` | the hand-written backward (BWD) against autograd of the recurrence, per gradient, fp64 and fp32 |
# | `50_context_parallel` | segment maps (CP) and the truncation bound against the measured error |
# | `60_kernels` | the sm_90 kernels against the reference stage by stage (GPU) |
# | `70_benchmarks` | the committed H200 timings: ours, FLA, FlashQLA, roofline, FLA's kernels one by one |

# %% [markdown]
# # 40 · The backward pass
#
# The loss of one chunk entered with state $S$ is $\mathcal{L} = \langle dO, O\rangle + \langle dS', S'\rangle$:
# $dO$ the gradient of the chunk's outputs, $dS'$ that of the state it hands on. FLA differentiates the
# chunk form by hand (research/fla-gdn.md section 3.1). With FLA's gated
# $A = (I + L)^{-1}$, $L = \operatorname{tril}_{-1}(B(KK^\top \odot \Gamma))$, $W = ABDK$,
# $\tilde V = U - WS$ and $r = \gamma_C / \gamma$:
#
# $$d\tilde V = \text{scale}\,(K Q^\top \odot \Gamma^\top)\, dO + \operatorname{diag}(r) K\, dS', \qquad
#   dS = \gamma_C\, dS' + \text{scale}\, Q^\top D\, dO - W^\top d\tilde V,$$
# $$M = (dO\, \tilde V^\top) \odot \Gamma, \qquad dQ = \text{scale}\,(D\, dO\, S^\top + M K), \qquad dV = B A^\top d\tilde V,$$
# $$dW = -d\tilde V S^\top, \quad dA = dW (BDK)^\top + d\tilde V (BV)^\top, \quad dL = -\operatorname{tril}_{-1}(A^\top dA\, A^\top), \quad dL_k = dL \odot \Gamma,$$
#
# and $dK$, $d\beta$ and the gate gradient collect the terms through $o$, the state update, $W$, $U$ and the
# inverse. The gate gradient is first taken with respect to the chunk-local cumulative gate $G$ (BWD-dG),
# then turned into the per-token $dg$ by a reverse cumulative sum (BWD-dg).
#
# Each formula is a record in `derivations/backward.py`, proved against `sympy.diff` of the loss through the
# token recurrence. Numerically, the hand-written backward (`reference.gdn.chunk_bwd`, wired into the
# reference op's `autograd.Function`) is compared, gradient by gradient, with torch's autograd through the
# token recurrence: in fp64 (equal to rounding) and in fp32 (as accurate).
#
# reviewed: 2026-11-29 · records BWD-dq, -dk, -dv, -dbeta, -dh0, -dG, -dg · `reference.gdn.chunk_bwd`,
# `reference.chunk_gated_delta_rule`, `reference.gdn.numerics.gradients`

# %%
import os

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt
import torch
from IPython.display import Image, Math, display

import derivations
from flashqla.testing import BUDGETS, make_gdn_inputs, notebook_figure_dir, rel_rms
from reference.gdn import numerics, twins

SIZE = os.environ.get("FLASHQLA_NB_SIZE", "small")
if SIZE == "small":
    torch.set_num_threads(1)  # tiny tensors on a shared CPU: threads cost more than they give
K = V = 16 if SIZE == "small" else 128
T = 200 if SIZE == "small" else 600
# figures go to notebooks/out/ (not committed); FLASHQLA_NB_FIGURES=notebooks/figures refreshes the committed ones
FIG = notebook_figure_dir()
BWD = [r.id for r in derivations.registry() if r.id.startswith("BWD-")]
print(f"size: {SIZE}, K = V = {K}, T = {T}; records: {', '.join(BWD)}")
assert {f"BWD-{n}" for n in ("dq", "dk", "dv", "dbeta", "dh0", "dG", "dg")} <= set(BWD)

# %% [markdown]
# ## The records and their proofs
# Each builder differentiates the recurrence's loss with `sympy.diff` (for BWD-dG with respect to the
# cumulative gates $c_i = e^{G_i}$ as independent symbols, $dG_i = c_i\,\partial\mathcal{L}/\partial c_i$) and
# compares it with the hand-written matrix. At the small size each record is proved at its first size.

# %%
for rid in BWD:
    rec = derivations.get(rid)
    print(f"{rid}: {rec.statement}")
    display(Math(rec.latex))
rows = [derivations.run_one(derivations.get(i), sizes=derivations.get(i).sizes[:1] if SIZE == "small" else None) for i in BWD]
print(derivations.format_table(rows))
assert all(r.ok for r in rows), [r.detail for r in rows if not r.ok]

# %% [markdown]
# ## Twins in fp64
# The records' twins (`twins.pairs`): FLA's per-step backward against autograd of the recurrence, and for
# BWD-dG the per-position $\partial\mathcal{L}/\partial G$ against autograd of the chunk form in $G$. Inputs:
# varlen with a one-token sequence and partial chunks, grouped heads, a $g = 0$ and a $g = -30$ head, an
# initial state, random $dO$ and $dS'$.

# %%
x = twins.with_cotangents(make_gdn_inputs(B=1, T=300, H=2, HV=4, K=K, V=V, cu_seqlens=[130, 1, 64, 105], seed=7))
for rid, ps in twins.pairs_many(BWD, x).items():
    for p in ps:
        err = rel_rms(p.lhs, p.rhs)
        print(f"{rid:<10} [{p.quantity}]  {err:.1e}")
        assert err <= 1e-12, f"{rid}: {err:.2e}"

# %% [markdown]
# ## Gradient checks of the reference op
# The public reference op `reference.chunk_gated_delta_rule` runs FLA's chunked forward and, under
# autograd, the hand-written backward. Against torch's autograd through the token recurrence, per
# gradient, on three input sets, held to the project's fp64 budgets (`flashqla.testing.BUDGETS`).

# %%
CASES = {
    "varlen 130+1+64+105, GVA 2/4, h0": dict(B=1, T=300, H=2, HV=4, cu_seqlens=[130, 1, 64, 105]),
    "batch 2 x 150, GVA 1/2, no h0": dict(B=2, T=150, H=1, HV=2, initial_state=False),
    "every head g = -30": dict(B=1, T=200, H=2, HV=2, gate=-30.0, special_heads=False),
}
budget = BUDGETS["reference_fp64"]
for name, kw in CASES.items():
    xc = twins.with_cotangents(make_gdn_inputs(K=K, V=V, seed=5, **kw))
    hand, auto = numerics.gradients(xc, "chunk"), numerics.gradients(xc, "recurrent")
    errs = {n: rel_rms(hand[n], auto[n]) for n in auto}
    print(f"{name:<34} " + "  ".join(f"{n} {e:.1e}" for n, e in errs.items()))
    for n, e in errs.items():
        assert e <= budget[n], f"{name}: {n} {e:.2e} > {budget[n]:.0e}"
    assert ("dh0" in errs) == (xc["initial_state"] is not None)

# %% [markdown]
# ## In fp32
# The kernels will run the backward in fp32 arithmetic from bf16 q, k, v and $dO$. Both backward paths,
# the hand-written chunked one and autograd through the token loop, in fp32 from the same bf16-rounded
# inputs, against fp64 on those inputs (`numerics.gradient_error_sweep`), over gate strengths from none to
# very strong. Errors in units of $u = 2^{-24}$.

# %%
GATES = ["qwen3next", 0.0, -0.01, -0.1, -1.0, -30.0]
U32 = numerics.UNIT_ROUNDOFF[torch.float32]
sweep = numerics.gradient_error_sweep(GATES, torch.bfloat16, seed=3, B=1, T=T, H=2, HV=4, K=K, V=V)
GRADS = list(dict.fromkeys(r["grad"] for r in sweep))
labels = ["Qwen3-Next" if g == "qwen3next" else f"g = {g}" for g in GATES]

fig, axes = plt.subplots(2, 3, figsize=(11, 5.6), sharex=True, sharey=True)
for ax, n in zip(axes.flat, GRADS):
    rs = [next(r for r in sweep if r["grad"] == n and r["gate"] == g) for g in GATES]
    ax.plot(range(len(GATES)), [r["chunk"] / U32 for r in rs], "o-", label="hand-written chunked backward")
    ax.plot(range(len(GATES)), [r["recurrent"] / U32 for r in rs], "s--", label="autograd through the recurrence")
    ax.set_title(n, fontsize=9)
    ax.set_xticks(range(len(GATES)))
    ax.set_xticklabels(labels, rotation=35, ha="right", fontsize=7)
    ax.grid(alpha=0.3)
for ax in axes[:, 0]:
    ax.set_ylabel("relative error / u (fp32)")
axes.flat[0].legend(fontsize=7)
fig.suptitle(f"gradients in fp32 from bf16 q/k/v/dO, against fp64 (K = V = {K}, T = {T})", fontsize=9)
fig.tight_layout()
fig.savefig(FIG / "40_gradients_fp32.png", dpi=110)
plt.close(fig)
display(Image(FIG / "40_gradients_fp32.png"))

worst_chunk = max(r["chunk"] for r in sweep) / U32
worst_ratio = max(r["chunk"] / r["recurrent"] for r in sweep)
worst_at = max(sweep, key=lambda r: r["chunk"] / r["recurrent"])
print(f"worst chunked-backward error {worst_chunk:.1f} u; worst ratio to the recurrence's {worst_ratio:.1f} "
      f"({worst_at['grad']} at gate {worst_at['gate']})")
# every gradient of the hand-written backward is within 16 u of fp64 in fp32, at every gate strength,
# the strong-decay head included ...
assert worst_chunk <= 16
# ... and within a factor 8 of what autograd through the token loop achieves in the same precision
assert worst_ratio <= 8

# %% [markdown]
# ## Conclusions (asserted above)
# - BWD-dq, -dk, -dv, -dbeta, -dh0, -dG, -dg are proved against `sympy.diff` of the recurrence's loss, and
#   their twins agree to $\le 10^{-12}$ in fp64.
# - The reference op's hand-written backward matches autograd through the recurrence for every gradient
#   within the fp64 budgets (varlen, grouped heads, with and without an initial state, every head at
#   $g = -30$).
# - In fp32 from bf16 inputs every gradient stays within $16u$ of fp64 at every gate strength, within a
#   factor 8 of the token loop's own error. The gate gradient is where the chunked form loses most (a few
#   times the recurrence's error at the small size), still at the level of fp32 rounding.

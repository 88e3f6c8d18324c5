"""Numerical studies of the chunked algorithm (plain PyTorch): conditioning of the WY inverse, errors of
the rewrites in low precision, and the truncation error of the context-parallel warm-up against its
bound. The notebooks plot these; the functions return plain numbers and tensors.

    round_inputs            bf16 (or fp16) rounding of q, k, v, do; fp32 elsewhere (the kernels' precisions)
    unit_keys               L2-normalised keys with a tunable mutual correlation
    kkt_matrix              L = tril_-1(diag(beta) K K^T) (optionally gated): the matrix solve_tril inverts
    conditioning            2-norm condition number of I + L and the norm of its inverse
    inverse_error           (I + L)^-1 computed in low precision (fp32, bf16, the kernel's tf32 GEMMs) against fp64
    solve_tril_sweep        both of the above over write strengths and key correlations
    rewrite_errors          each side of a rewrite record in low precision against fp64
    rewrite_error_sweep     the same over gate strengths and key correlations
    gradients               the hand-written chunked backward or autograd of the recurrence, per input
    gradient_errors         both in fp32 against the fp64 recurrence, per gradient
    gradient_error_sweep    the same over gate strengths
    truncation_errors       CP warm-up: measured state / output error against the CP-4 / CP-5 bounds
    truncation_sweep        the same over gate strengths
    segment_contraction     ||P||_2 of each segment's state map against exp(summed log-decay)
    forward_rounding_model  the chunked forward in fp64 with a rounding at each named point (ours / FLA's)
    forward_rounding_errors o's and the final state's error of that model under named configurations

Errors are relative RMS (`flashqla.testing.rel_rms`), computed in fp64. Shapes follow
`reference.gdn.fused` (chunk tensors [..., C, K]) and FLA (input dicts as `flashqla.testing.make_gdn_inputs`).
"""

from __future__ import annotations

import math

import numpy as np
import torch
import torch.nn.functional as F

from flashqla.testing import rel_rms
from . import chunk, cp, fused, fused_bwd, twins
from .chunk import prepare_chunk_layout
from .recurrent import recurrent_gated_delta_rule

__all__ = [
    "UNIT_ROUNDOFF",
    "round_inputs",
    "to_fp64",
    "unit_keys",
    "kkt_matrix",
    "conditioning",
    "round_tf32",
    "INVERSE_METHODS",
    "inverse_error",
    "SWEEP_PRECISIONS",
    "solve_tril_sweep",
    "rewrite_errors",
    "correlate_keys",
    "rewrite_error_sweep",
    "GRAD_NAMES",
    "gradients",
    "gradient_errors",
    "gradient_error_sweep",
    "truncation_errors",
    "truncation_sweep",
    "segment_contraction",
    "FWD_ROUNDING_POINTS",
    "kernel_roundings",
    "forward_rounding_model",
    "forward_rounding_errors",
]

#: Unit roundoff u = 2^-p (p = stored mantissa bits + 1) of the dtypes studied.
UNIT_ROUNDOFF = {torch.float64: 2.0**-53, torch.float32: 2.0**-24, "tf32": 2.0**-11, torch.bfloat16: 2.0**-8, torch.float16: 2.0**-11,
                 "fp16 mma": 2.0**-11}

_ROUNDED = ("q", "k", "v", "do")  # stored in the input dtype by the kernels
_FP32 = ("g", "beta", "initial_state", "dht")  # kept in fp32


def round_inputs(x: dict, dtype: torch.dtype = torch.bfloat16, compute: torch.dtype = torch.float32) -> dict:
    """The inputs as a kernel sees them: q, k, v (and the cotangent do) rounded to `dtype`, then held in
    `compute`; g, beta, initial_state, dht cast to `compute` (fp32 in the kernels). Other keys are
    passed through. Reference functions fed the result compute in `compute` (fp32 arithmetic)."""
    out = dict(x)
    for n in _ROUNDED:
        if x.get(n) is not None:
            out[n] = x[n].to(dtype).to(compute)
    for n in _FP32:
        if x.get(n) is not None:
            out[n] = x[n].to(compute)
    return out


def to_fp64(x: dict) -> dict:
    """Every floating tensor of an input dict in fp64 (other entries passed through)."""
    return {n: (t.double() if isinstance(t, torch.Tensor) and t.is_floating_point() else t) for n, t in x.items()}


def unit_keys(n: int, C: int, K: int, rho: float = 0.0, seed: int = 0, dtype=torch.float64) -> torch.Tensor:
    """[n, C, K] L2-normalised keys k_t = normalize(sqrt(rho) s + sqrt(1 - rho) z_t) with one shared
    random direction s per matrix and z_t ~ N(0, I / K): the expected cosine between two keys is
    about rho (rho = 0: independent, nearly orthogonal keys; rho -> 1: all keys alike)."""
    gen = torch.Generator().manual_seed(seed)
    s = F.normalize(torch.randn(n, 1, K, generator=gen, dtype=torch.float64), dim=-1)
    z = torch.randn(n, C, K, generator=gen, dtype=torch.float64) / math.sqrt(K)
    return F.normalize(math.sqrt(rho) * s + math.sqrt(1.0 - rho) * z, dim=-1).to(dtype)


def kkt_matrix(k: torch.Tensor, beta, g_cum: torch.Tensor | None = None) -> torch.Tensor:
    """L = tril_-1(diag(beta) (K K^T * Gamma)) for keys k [..., C, K], beta a float or [..., C], and
    optionally the chunk-local cumulative gates g_cum [..., C] (ln; None: gate-free, FlashQLA's
    kkt_solve input). Computed in k's dtype; strictly lower."""
    beta = torch.as_tensor(beta, dtype=k.dtype)
    if beta.dim() == 0:
        beta = beta.expand(k.shape[:-1])
    L = beta[..., None] * (k @ k.transpose(-1, -2))
    if g_cum is not None:
        L = L * fused.decay_mask(g_cum.to(k.dtype), strict=True)
    return torch.tril(L, -1)


def conditioning(L: torch.Tensor) -> dict:
    """For a batch of strictly lower L [..., C, C], in fp64: `cond` = ||I + L||_2 ||(I + L)^-1||_2,
    `inv_norm` = ||(I + L)^-1||_2 and `inv_max` = max |(I + L)^-1| entry, each a tensor of the batch
    shape."""
    Ld = L.double()
    M = torch.eye(L.shape[-1], dtype=torch.float64) + Ld
    A = fused.solve_tril_blocks(Ld, _block(L.shape[-1]))
    inv_norm = _spectral_norm(A)
    return dict(cond=_spectral_norm(M) * inv_norm, inv_norm=inv_norm, inv_max=A.abs().amax((-1, -2)))


def _spectral_norm(X: torch.Tensor) -> torch.Tensor:
    # numpy's batched SVD: torch's multithreaded CPU svdvals is two orders slower on small shared hosts
    return torch.from_numpy(np.linalg.svd(X.detach().cpu().double().numpy(), compute_uv=False)[..., 0].copy())


def _block(C: int) -> int:
    return 16 if C % 16 == 0 else C


def round_tf32(x: torch.Tensor) -> torch.Tensor:
    """fp32 x rounded to TF32 (10 stored mantissa bits, round to nearest): what a tf32 tensor-core
    GEMM reads of an fp32 operand. Returns fp32."""
    bits = x.float().contiguous().view(torch.int32)
    return ((bits + 0x1000) & ~0x1FFF).view(torch.float32)


def _nilpotent_tf32(L: torch.Tensor, block: int) -> torch.Tensor:
    """`fused.solve_tril_nilpotent` with L and D^-1 (forward substitution in the diagonal blocks) in
    fp32 and the four n x n GEMMs with tf32 operands and fp32 accumulation (an earlier form of the
    sm_90 prepare kernel's inverse)."""
    n = L.shape[-1]
    L = torch.tril(L.float(), -1)
    Dinv = fused.solve_tril_diagonal_blocks(L, block)
    blk = torch.arange(n) // block
    E = torch.where(blk[:, None] > blk[None, :], L, torch.zeros((), dtype=L.dtype))
    mm = lambda a, b: round_tf32(a) @ round_tf32(b)  # noqa: E731
    F = mm(Dinv, E)
    X = torch.eye(n) + mm(F, F)
    return mm(X - mm(F, X), Dinv)


#: The inverse algorithms `inverse_error` can run: FLA's blockwise merge (WY-3, WY-4), the product
#: form (I - F)(I + F^2) D^-1 (WY-5) and the sm_90 prepare kernel's recursive doubling
#: (`fused.solve_tril_doubling`: WY-3 on 8 x 8 blocks, WY-4 with two blocks at 16, 32, 64).
INVERSE_METHODS = ("blocks", "nilpotent", "doubling", "doubling product")


def inverse_error(L: torch.Tensor, precision, method: str = "blocks") -> torch.Tensor:
    """Relative RMS error, per matrix, of (I + L)^-1 computed in low precision against the fp64
    inverse of the uncast L.

    Args:
        L: [..., C, C] strictly lower (any float dtype; the truth is computed from it in fp64).
        precision: a torch dtype (L cast to it and every operation run in it: fp32, bf16, fp16),
            "tf32" (L in fp32, GEMM operands rounded to tf32, fp32 accumulation; only with method
            "nilpotent") or "fp16 mma" (L and every stored step rounded to fp16, products of fp16
            operands accumulated in fp32: the prepare kernel's mma.sync; only with method "doubling" or
            "doubling product").
        method: "blocks" (`fused.solve_tril_blocks`, FLA's merge), "nilpotent"
            (`fused.solve_tril_nilpotent`, needs C == 64 with 16-wide blocks), "doubling"
            (`fused.solve_tril_doubling`, 8-wide first blocks, needs C == 64) or "doubling product" (the
            same with its first level by the nilpotent product, WY-6: `level1="product"`).

    Returns:
        float64 tensor of the batch shape. Raises ValueError for an unknown method or precision.
    """
    if method not in INVERSE_METHODS:
        raise ValueError(f"method must be one of {INVERSE_METHODS}, got {method!r}")
    block = _block(L.shape[-1])
    ref = fused.solve_tril_blocks(L.double(), block)
    if precision == "tf32":
        if method != "nilpotent":
            raise ValueError("precision 'tf32' models the earlier kernel's GEMMs: use method='nilpotent'")
        low = _nilpotent_tf32(L, block)
    elif precision == "fp16 mma":
        if not method.startswith("doubling"):
            raise ValueError("precision 'fp16 mma' models the kernel's doubling: use method='doubling' or 'doubling product'")
        low = fused.solve_tril_doubling(L.float(), L.shape[-1] // 8, storage=torch.float16,
                                        level1="product" if method == "doubling product" else "substitution")
    elif isinstance(precision, torch.dtype):
        fn = {"blocks": fused.solve_tril_blocks, "nilpotent": fused.solve_tril_nilpotent,
              "doubling": lambda x, b: fused.solve_tril_doubling(x, x.shape[-1] // 8),
              "doubling product": lambda x, b: fused.solve_tril_doubling(x, x.shape[-1] // 8, level1="product")}[method]
        low = fn(L.to(precision), block)
    else:
        raise ValueError(f"precision must be a torch dtype, 'tf32' or 'fp16 mma', got {precision!r}")
    return torch.linalg.matrix_norm(low.double() - ref) / torch.linalg.matrix_norm(ref)


#: The precisions `solve_tril_sweep` measures: (label, precision, method) for `inverse_error`.
SWEEP_PRECISIONS = (
    ("fp32", torch.float32, "blocks"),
    ("bf16", torch.bfloat16, "blocks"),
    ("tf32 product form", "tf32", "nilpotent"),
    ("kernel (fp16 mma.sync)", "fp16 mma", "doubling"),
    ("kernel, level 1 by mma (WY-6)", "fp16 mma", "doubling product"),
)


def solve_tril_sweep(betas, rhos, n: int = 8, C: int = 64, K: int = 128, g: float | None = None, seed: int = 0) -> list[dict]:
    """Conditioning and low-precision inverse error of I + L over write strengths and key correlations.

    For every rho in `rhos` and beta in `betas`: n key sets `unit_keys(n, C, K, rho)` (the same keys for
    every beta), L = `kkt_matrix(k, beta)` (gate-free, or gated by a constant per-token g when given),
    `conditioning(L)` and `inverse_error(L, ...)` for each of `SWEEP_PRECISIONS`.

    Returns one dict per matrix: rho, beta, sample, cond, inv_norm, inv_max and one error per
    precision label (relative RMS against fp64).
    """
    betas, rhos = [float(b) for b in betas], [float(r) for r in rhos]
    g_cum = None if g is None else torch.full((n, C), float(g), dtype=torch.float64).cumsum(-1)
    k = torch.stack([unit_keys(n, C, K, rho=rho, seed=seed) for rho in rhos])  # [R, n, C, K]
    L = torch.stack([kkt_matrix(k, beta, g_cum) for beta in betas], dim=1)  # [R, nb, n, C, C]
    c = conditioning(L)
    errs = {label: inverse_error(L, p, m) for label, p, m in SWEEP_PRECISIONS}
    rows = []
    for a, rho in enumerate(rhos):
        for b, beta in enumerate(betas):
            for i in range(n):
                at = (a, b, i)
                row = dict(rho=rho, beta=beta, sample=i, cond=float(c["cond"][at]),
                           inv_norm=float(c["inv_norm"][at]), inv_max=float(c["inv_max"][at]))
                row.update({label: float(e[at]) for label, e in errs.items()})
                rows.append(row)
    return rows


def rewrite_errors(record_id: str, x: dict, dtype: torch.dtype = torch.bfloat16, chunk_size: int = 64) -> list[dict]:
    """Both sides of a record (FLA's formulation on the left, the rewrite on the right) in low precision,
    each against the fp64 truth.

    The inputs are rounded as the kernels store them (`round_inputs`: q, k, v, do in `dtype`, the rest
    fp32) and both sides computed in fp32 by `reference.gdn.twins.pairs`; the truth is the fp64 left
    side on the unrounded inputs (in fp64 both sides agree to ~1e-15). Per quantity, two errors:
    `lhs` / `rhs`, the total error a user sees (input rounding included), and `lhs_arith` /
    `rhs_arith`, against fp64 on the *rounded* inputs: the error the fp32 arithmetic of the formulation
    adds.

    Args:
        record_id: an exact record with a twin driver (`twins.has_driver`).
        x: fp64 input dict (with `do`, `dht` for RW-6 / BWD records).
        dtype: the storage dtype of q, k, v (bf16 or fp16).
        chunk_size: C.

    Returns:
        list of dicts (record, quantity, lhs, rhs, lhs_arith, rhs_arith), one per compared quantity.
    """
    truth = twins.pairs(record_id, x, chunk_size)
    xl = round_inputs(x, dtype)
    low = twins.pairs(record_id, xl, chunk_size)
    truth_r = twins.pairs(record_id, to_fp64(xl), chunk_size)
    rows = []
    for t, lo, tr in zip(truth, low, truth_r):
        rows.append(dict(
            record=record_id, quantity=t.quantity,
            lhs=rel_rms(lo.lhs, t.lhs), rhs=rel_rms(lo.rhs, t.lhs),
            lhs_arith=rel_rms(lo.lhs, tr.lhs), rhs_arith=rel_rms(lo.rhs, tr.lhs),
        ))
    return rows


def correlate_keys(x: dict, rho: float, seed: int = 0) -> dict:
    """x with its keys replaced by unit keys of mutual correlation about rho: per q/k head h,
    k_t = normalize(sqrt(rho) s_h + sqrt(1 - rho) z_t), s_h one random unit direction, z_t ~ N(0, I / K)
    (as `unit_keys`). Correlated keys make I + L worse conditioned (notebook 20). Other entries are
    passed through; k keeps its dtype."""
    B, T, H, K = x["k"].shape
    gen = torch.Generator().manual_seed(seed)
    s = F.normalize(torch.randn(1, 1, H, K, generator=gen, dtype=torch.float64), dim=-1)
    z = torch.randn(B, T, H, K, generator=gen, dtype=torch.float64) / math.sqrt(K)
    return {**x, "k": F.normalize(math.sqrt(rho) * s + math.sqrt(1.0 - rho) * z, dim=-1).to(x["k"].dtype)}


def rewrite_error_sweep(record_ids, gates, rhos=(0.0,), dtype: torch.dtype = torch.bfloat16, chunk_size: int = 64,
                        seed: int = 0, **input_kw) -> list[dict]:
    """`rewrite_errors` for every record over gate strengths and key correlations.

    For each gate in `gates` (a `make_gdn_inputs` gate: "qwen3next" with its g = 0 and g = -30 heads, or
    a constant per-token g on every head) and each rho in `rhos` (`correlate_keys`; 0 keeps the
    independent keys), inputs `make_gdn_inputs(**input_kw, gate=gate, seed=seed)` in fp64 with
    cotangents (`twins.with_cotangents`). Returns the rows of `rewrite_errors` with `gate` and `rho` added.
    """
    from flashqla.testing import make_gdn_inputs

    rows = []
    for gate in gates:
        base = make_gdn_inputs(**input_kw, gate=gate, special_heads=(gate == "qwen3next"), seed=seed)
        for rho in rhos:
            x = twins.with_cotangents(correlate_keys(base, rho, seed) if rho else base)
            for rid in record_ids:
                for r in rewrite_errors(rid, x, dtype, chunk_size):
                    rows.append({**r, "gate": gate, "rho": float(rho)})
    return rows


GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def gradients(x: dict, op: str = "chunk") -> dict:
    """The gradients of <do, o> + <dht, final_state> with respect to q, k, v, g, beta, initial_state.

    op: "chunk" (the reference op `reference.chunk_gated_delta_rule`: FLA's hand-written chunked
    backward) or "recurrent" (torch.autograd through the token recurrence). Computed in x's dtype
    (fp64 or fp32); x needs `do` and `dht` (`twins.with_cotangents`). Returns {name: tensor} for
    `GRAD_NAMES` (dh0 only when x has an initial state)."""
    from .. import chunk_gated_delta_rule, recurrent_gated_delta_rule as recurrent

    fn = {"chunk": chunk_gated_delta_rule, "recurrent": recurrent}[op]
    names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if x.get(n) is not None]
    leaves = {n: x[n].detach().clone().requires_grad_(True) for n in names}
    with torch.enable_grad():
        o, ht = fn(**leaves, scale=x.get("scale"), cu_seqlens=x.get("cu_seqlens"), output_final_state=True)
        outs, cots = [o], [x["do"].to(o.dtype)]
        if x.get("dht") is not None:
            outs.append(ht)
            cots.append(x["dht"].to(ht.dtype))
        torch.autograd.backward(outs, cots)
    return {("dh0" if n == "initial_state" else f"d{n}"): leaves[n].grad for n in names}


def gradient_errors(x: dict, dtype: torch.dtype | None = torch.bfloat16) -> dict:
    """Per gradient, the relative RMS error in fp32 of the hand-written chunked backward (`chunk`) and of
    autograd through the token recurrence (`recurrent`), both against the fp64 recurrence's gradients.

    x: fp64 inputs with cotangents. dtype: None (inputs cast to fp32 only) or the storage dtype that q, k,
    v, do are rounded to first (`round_inputs`). The truth uses the same (rounded) inputs in fp64, so
    the errors are those of the fp32 arithmetic. Returns {grad: {"chunk": err, "recurrent": err}}."""
    xl = round_inputs(x, dtype) if dtype is not None else round_inputs(x, torch.float32)
    truth = gradients(to_fp64(xl), "recurrent")
    out = {}
    low = {op: gradients(xl, op) for op in ("chunk", "recurrent")}
    for n, ref in truth.items():
        out[n] = {op: rel_rms(low[op][n], ref) for op in low}
    return out


def gradient_error_sweep(gates, dtype: torch.dtype | None = torch.bfloat16, seed: int = 0, **input_kw) -> list[dict]:
    """`gradient_errors` over gate strengths: for each gate of `gates` ("qwen3next" with its g = 0 and
    g = -30 heads, or a constant per-token g on every head), fp64 inputs
    `make_gdn_inputs(**input_kw, gate=gate, seed=seed)` with cotangents. Returns one dict per
    (gate, gradient): gate, grad, chunk, recurrent."""
    from flashqla.testing import make_gdn_inputs

    rows = []
    for gate in gates:
        x = twins.with_cotangents(make_gdn_inputs(**input_kw, gate=gate, special_heads=(gate == "qwen3next"), seed=seed))
        for n, e in gradient_errors(x, dtype).items():
            rows.append(dict(gate=gate, grad=n, **e))
    return rows


def truncation_errors(x: dict, segment_len: int, warmup_chunks: int, chunk_size: int = 64) -> list[dict]:
    """The context-parallel warm-up shortcut measured against its bounds (CP-4 states, CP-5 outputs).

    Runs `cp.cp_gated_delta_rule_fwd` with `warmup_chunks` (every segment after a sequence's first
    starts from the zero-start run over the previous segment's last `warmup_chunks` chunks; the state
    S_w entering that window is dropped) and the exact token recurrence. For every segment boundary
    j -> j + 1 inside a sequence and every value head:

        state_err  = ||S_trunc - S_exact||_F at the start of segment j + 1
        state_bound = exp(G_w) ||S_w||_F                                    (CP-4)
        out_ratio  = max over the tokens t of segment j + 1 of ||o_t,trunc - o_t,exact||_2 / (scale ||q_t||_2),
        out_bound  = exp(G_w) ||S_w||_F                                     (CP-5, divided by scale ||q_t||)

    with G_w the window's summed log-decay. Tokens further on decay more, so these are the worst case
    of each segment. Returns one dict per (boundary, head): segment (j + 1), head, G_w, S_w_norm,
    state_err, state_bound, out_ratio, out_bound, state_norm (||S_exact||_F, for a rounding floor).

    x: fp64 input dict (q, k unit-norm; beta in [0, 1]: the bounds' condition). segment_len: a
    multiple of chunk_size.
    """
    args = {n: x.get(n) for n in ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens")}
    scale = float(x["scale"]) if x.get("scale") is not None else x["q"].shape[-1] ** -0.5
    o, _, info = cp.cp_gated_delta_rule_fwd(**args, scale=scale, segment_len=segment_len, warmup_chunks=warmup_chunks,
                                            chunk_size=chunk_size, return_info=True)
    o_ref, _ = recurrent_gated_delta_rule(**args, scale=scale)
    _, _, _, _, h, _ = chunk.chunk_gated_delta_rule_fwd(**args, scale=scale, chunk_size=chunk_size)
    plan = info["plan"]
    B, T, HV = x["v"].shape[:3]
    lay = prepare_chunk_layout(B, T, x.get("cu_seqlens"), chunk_size)
    h = h.reshape(lay.NC, *h.shape[2:])
    first_token = lay.index[:, 0].tolist()  # flat index b * T + t of each chunk's first token
    qf = x["q"].reshape(B * T, *x["q"].shape[2:]).repeat_interleave(HV // x["q"].shape[2], dim=1)  # [BT, HV, K]
    of, of_ref = o.reshape(B * T, HV, -1), o_ref.reshape(B * T, HV, -1)
    rows = []
    for j in range(plan.M - 1):
        if bool(plan.last[j]):
            continue
        hi = int(plan.cu_seqlens[j + 1])
        # the window: the segment's last warmup_chunks chunks (a segment that is not its sequence's
        # last holds whole chunks); when it covers the segment, S_w is the state entering it
        lo_w = max(int(plan.cu_seqlens[j]), hi - warmup_chunks * chunk_size)
        S_w = h[first_token.index(lo_w)]  # [HV, K, V], exact state entering the window
        lo, end = int(plan.cu_seqlens[j + 1]), int(plan.cu_seqlens[j + 2])
        d_state = torch.linalg.matrix_norm(info["S_start"][j + 1] - info["S_start_exact"][j + 1])
        d_out = torch.linalg.vector_norm(of[lo:end] - of_ref[lo:end], dim=-1) / (scale * torch.linalg.vector_norm(qf[lo:end], dim=-1))
        S_norm = torch.linalg.matrix_norm(S_w)
        for hv in range(HV):
            G = float(info["G_w"][j, hv])
            rows.append(dict(
                segment=j + 1, head=hv, G_w=G, S_w_norm=float(S_norm[hv]),
                state_err=float(d_state[hv]), state_bound=math.exp(G) * float(S_norm[hv]),
                out_ratio=float(d_out[:, hv].max()), out_bound=math.exp(G) * float(S_norm[hv]),
                state_norm=float(torch.linalg.matrix_norm(info["S_start_exact"][j + 1][hv])),
            ))
    return rows


def truncation_sweep(gates, segment_len: int, warmup_chunks: int, chunk_size: int = 64, seed: int = 0, **input_kw) -> list[dict]:
    """`truncation_errors` over gate strengths: for each constant per-token g in `gates` (every head),
    fp64 inputs `make_gdn_inputs(**input_kw, gate=g, special_heads=False, seed=seed)`. Returns the rows
    of `truncation_errors` with `gate` added."""
    from flashqla.testing import make_gdn_inputs

    rows = []
    for g in gates:
        x = make_gdn_inputs(**input_kw, gate=float(g), special_heads=False, seed=seed)
        rows += [{**r, "gate": float(g)} for r in truncation_errors(x, segment_len, warmup_chunks, chunk_size)]
    return rows


def segment_contraction(x: dict, segment_len: int, chunk_size: int = 64) -> list[dict]:
    """How much each segment's state map P shrinks the state that enters it.

    Cuts every sequence into segments (`cp.plan_segments`), computes each segment's map S_end = P S + Q
    (`cp.segment_maps`, CP-1) and returns one dict per (segment, head): segment, head, G (the segment's
    summed log-decay), P_norm (||P||_2) and exp_G. With unit keys and beta in [0, 1] every factor
    a_t (I - beta_t k_t k_t^T) has norm <= a_t, so ||P||_2 <= exp(G): the fact CP-4 rests on."""
    B, T = x["q"].shape[:2]
    plan = cp.plan_segments(B, T, x.get("cu_seqlens"), segment_len, chunk_size)
    flat = lambda t: t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
    P, _ = cp.segment_maps(flat(x["k"]), flat(x["v"]), flat(x["g"]), flat(x["beta"]), plan.cu_seqlens, chunk_size)
    norms = _spectral_norm(P)  # [M, HV]
    gf = flat(x["g"])[0].double()
    rows = []
    for j in range(plan.M):
        G = gf[int(plan.cu_seqlens[j]) : int(plan.cu_seqlens[j + 1])].sum(0)
        for hv in range(P.shape[1]):
            rows.append(dict(segment=j, head=hv, G=float(G[hv]), P_norm=float(norms[j, hv]), exp_G=math.exp(float(G[hv]))))
    return rows



# ----------------------------------------------------------------------------------------------
# The forward kernels' roundings, point by point
# ----------------------------------------------------------------------------------------------

#: The points where a chunked forward rounds an intermediate to a storage or operand dtype, by
#: structure. "ours" (the sm_90 prepare + recurrent kernels, `reference.gdn.fused`): A_beta = A diag(beta)
#: as stored by the prepare kernel; S, the state's copy read by K S and Q S; W = V - diag(gamma) K S, the
#: A_beta product's operand; v_new, read by the output product; v_new_r = diag(r) v_new, read by the state
#: update; P = scale (Q K^T * Gamma) causal, the output product's operand; o, the stored output. "fla"
#: (FLA's chunk_fwd pipeline, `reference.gdn.chunk`): A stored; k_beta = diag(beta gamma) K and
#: v_beta = diag(beta) V, the operands of w = A k_beta and u = A v_beta, both stored; h, the stored
#: chunk-start state read by w h and Q h; v_new = u - w h stored; v_new_r; P = Q K^T * Gamma; o.
FWD_ROUNDING_POINTS = {
    "ours": ("A_beta", "S", "W", "v_new", "v_new_r", "P", "o"),
    "fla": ("A", "k_beta", "v_beta", "w", "u", "h", "v_new", "v_new_r", "P", "o"),
}


def kernel_roundings(structure: str = "ours", dtype: torch.dtype = torch.bfloat16) -> dict:
    """Every rounding point of `structure` ("ours" or "fla") in `dtype`: what the kernels do with bf16
    (or fp16) inputs. Raises ValueError for another structure."""
    if structure not in FWD_ROUNDING_POINTS:
        raise ValueError(f"structure must be one of {tuple(FWD_ROUNDING_POINTS)}, got {structure!r}")
    return {p: dtype for p in FWD_ROUNDING_POINTS[structure]}


def _rnd(x: torch.Tensor, dt) -> torch.Tensor:
    """x (fp64) rounded to dt (a torch dtype or "tf32") and held in fp64; dt None: unchanged."""
    return round_tf32(x).double() if dt == "tf32" else fused_bwd._round(x, dt)


def forward_rounding_model(x: dict, roundings: dict | None = None, structure: str = "ours",
                           chunk_size: int = 64) -> dict:
    """The chunked forward in fp64 with a rounding at each named point (`FWD_ROUNDING_POINTS`): a model
    of what the kernels' storage and operand dtypes cost o and the final state.

    Every product accumulates exactly (fp64; the kernels accumulate in fp32, whose error is ~2^16 times
    smaller than a bf16 rounding), the inverse (I + L)^-1 is exact (the prepare kernel's tf32 products
    are ~2^-11 relative, below A_beta's own rounding), and the gates are exact. With no rounding the
    result equals the token recurrence to fp64 accuracy (CF-1..CF-3, RW-2).

    Args:
        x: inputs (`flashqla.testing.make_gdn_inputs`, fixed length: no cu_seqlens): q, k [B, T, H, K],
            v [B, T, HV, V], g, beta [B, T, HV], optional initial_state [B, HV, K, V] and scale. Used in
            fp64 as given (round them first, `round_inputs`, to model bf16 inputs).
        roundings: {point: dtype, "tf32" or None}; points left out are exact. None: no rounding.
        structure: "ours" or "fla" (the order of products; see `FWD_ROUNDING_POINTS`).
        chunk_size: C; T must be a multiple of it.

    Returns:
        dict(o [B, T, HV, V], final_state [B, HV, K, V]) in fp64.

    Raises:
        ValueError: unknown structure or point, a rounding that is not a dtype / "tf32" / None, packed
            input, or T not a multiple of chunk_size.
    """
    if structure not in FWD_ROUNDING_POINTS:
        raise ValueError(f"structure must be one of {tuple(FWD_ROUNDING_POINTS)}, got {structure!r}")
    rd = dict(roundings or {})
    bad = set(rd) - set(FWD_ROUNDING_POINTS[structure])
    if bad:
        raise ValueError(f"unknown rounding points for {structure!r}: {sorted(bad)}; "
                         f"known: {FWD_ROUNDING_POINTS[structure]}")
    bad_dt = {p: d for p, d in rd.items() if not (d is None or d == "tf32" or isinstance(d, torch.dtype))}
    if bad_dt:
        raise ValueError(f"roundings take a torch dtype, 'tf32' or None per point, got {bad_dt}")
    if x.get("cu_seqlens") is not None:
        raise ValueError("forward_rounding_model takes fixed-length input (cu_seqlens None)")
    q, k, v = (x[n].double() for n in ("q", "k", "v"))
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    C = chunk_size
    if T % C:
        raise ValueError(f"T = {T} must be a multiple of chunk_size = {C}")
    G = HV // H
    NC = T // C
    scale = x.get("scale") or K ** -0.5
    r = lambda t, p: _rnd(t, rd.get(p))  # noqa: E731

    def chunks(t, d):  # [B, T, HV, d] -> [B, HV, NC, C, d]
        return t.reshape(B, NC, C, HV, d).permute(0, 3, 1, 2, 4)

    qc = chunks(q.repeat_interleave(G, dim=2), K)
    kc = chunks(k.repeat_interleave(G, dim=2), K)
    vc = chunks(v, V)
    gc = x["g"].double().reshape(B, NC, C, HV).permute(0, 3, 1, 2).cumsum(-1)  # [B, HV, NC, C]
    bc = x["beta"].double().reshape(B, NC, C, HV).permute(0, 3, 1, 2)
    gamma, gamma_C, rr = fused.gate_vectors(gc)
    Gam = fused.decay_mask(gc)  # i >= j
    A = fused.solve_tril_blocks(kkt_matrix(kc, bc, gc), _block(C))  # (I + L)^-1, exact in fp64
    QK = (qc @ kc.transpose(-1, -2)) * Gam
    if structure == "ours":
        A_beta = r(A * bc[..., None, :], "A_beta")
        P = r(scale * QK, "P")
    else:
        A_r = r(A, "A")
        w = r(A_r @ r((bc * gamma)[..., None] * kc, "k_beta"), "w")
        u = r(A_r @ r(bc[..., None] * vc, "v_beta"), "u")
        P = r(QK, "P")
    S = torch.zeros(B, HV, K, V, dtype=torch.float64)
    if x.get("initial_state") is not None:
        S = x["initial_state"].double().clone()
    o = torch.empty(B, HV, NC, C, V, dtype=torch.float64)
    for c in range(NC):
        kk, qq, gm, rc = kc[:, :, c], qc[:, :, c], gamma[:, :, c, :, None], rr[:, :, c, :, None]
        if structure == "ours":
            Sb = r(S, "S")
            W = r(vc[:, :, c] - gm * (kk @ Sb), "W")
            vn = A_beta[:, :, c] @ W
            O = scale * gm * (qq @ Sb) + P[:, :, c] @ r(vn, "v_new")
        else:
            Sb = r(S, "h")
            vn = u[:, :, c] - w[:, :, c] @ Sb
            O = scale * (gm * (qq @ Sb) + P[:, :, c] @ r(vn, "v_new"))
        o[:, :, c] = r(O, "o")
        S = gamma_C[:, :, c, None, None] * S + kk.transpose(-1, -2) @ r(rc * vn, "v_new_r")
    return dict(o=o.permute(0, 2, 3, 1, 4).reshape(B, T, HV, V), final_state=S)


def forward_rounding_errors(x: dict, configs: dict, in_dtype: torch.dtype = torch.bfloat16,
                            chunk_size: int = 64) -> list[dict]:
    """o's and the final state's relative RMS error of `forward_rounding_model` under each named
    configuration, against the fp64 token recurrence on the same rounded inputs (`round_inputs` to
    `in_dtype`): the arithmetic's error, as the GPU tier measures it. Also per value head (o_head,
    final_head: lists), so that the g == 0 and strong-decay heads of `make_gdn_inputs` show apart.

    configs: {name: (structure, roundings)}. Returns one dict per configuration: config, structure,
    o, final_state, o_head, final_head."""
    xr = to_fp64(round_inputs(x, in_dtype))
    o_t, s_t = recurrent_gated_delta_rule(xr["q"], xr["k"], xr["v"], xr["g"], xr["beta"], scale=xr.get("scale"),
                                          initial_state=xr.get("initial_state"), output_final_state=True)
    HV = o_t.shape[2]
    rows = []
    for name, (structure, rnd) in configs.items():
        m = forward_rounding_model(xr, rnd, structure, chunk_size)
        rows.append(dict(config=name, structure=structure, o=rel_rms(m["o"], o_t),
                         final_state=rel_rms(m["final_state"], s_t),
                         o_head=[rel_rms(m["o"][:, :, h], o_t[:, :, h]) for h in range(HV)],
                         final_head=[rel_rms(m["final_state"][:, h], s_t[:, h]) for h in range(HV)]))
    return rows

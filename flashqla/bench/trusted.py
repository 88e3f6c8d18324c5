"""The trusted result of the correctness gate: GDN chunked prefill in fp64, on the inputs' device.

`chunk_gdn_fp64` computes the chunked form of DESIGN.md section 1 (FLA's forward, research
fla-gdn.md section 2.2) entirely in fp64 from the same (bf16 / fp32) inputs the kernels get:

    gc = chunk-local cumsum of g;  Gamma_rs = exp(gc_r - gc_s) for r >= s (exponent masked first)
    A = (I + strictly_lower(diag(beta) (K K^T) * Gamma))^-1
    w = A diag(beta exp(gc)) K;  u = A diag(beta) V
    per chunk, in order:  v_new = u - w S
                          o = scale (exp(gc) * (Q S) + ((Q K^T) * Gamma) v_new)
                          S = exp(gc_last) S + K^T (exp(gc_last - gc) * v_new)

Sequences are padded to whole chunks with k = v = beta = g = 0: a padded token changes nothing
(its row of A is the unit row, its w, u and v_new rows are zero, and gc stays at the last real
token), so all sequences advance together chunk by chunk ([N, NT_max] layout), with one batched
fp64 step per chunk index. It is exact algebra (rounding ~1e-15 relative), checked on CPU against
the token recurrence in tests/test_bench.py; on an H200 the largest grid row takes well under a
second and about 30 GB of device memory.

`chunk_gdn_fp64_grads` is the trusted result of the backward gate: the gradients of the same fp64
chunked forward by torch autograd (exact gradients of exact algebra), value heads in batches so
that device memory stays bounded on the largest rows; checked on CPU against autograd of the
token recurrence in tests/test_bench_bwd.py.

`rel_rms` is `flashqla.testing.rel_rms` (||x - ref|| / ||ref||, fp64) computed on the tensors'
device, so multi-GB outputs need not travel to the host.
"""

from __future__ import annotations

import math

import torch

__all__ = ["chunk_gdn_fp64", "chunk_gdn_fp64_autograd", "chunk_gdn_fp64_grads", "GRAD_NAMES", "rel_rms"]


def rel_rms(x: torch.Tensor, ref: torch.Tensor) -> float:
    """Relative RMS error `||x - ref||_2 / ||ref||_2` in fp64 on `ref`'s device; `inf` when `x`
    has a NaN or inf. Raises ValueError on a shape mismatch or an all-zero reference."""
    if tuple(x.shape) != tuple(ref.shape):
        raise ValueError(f"shape mismatch: {tuple(x.shape)} vs reference {tuple(ref.shape)}")
    rd = ref.detach().to(torch.float64)
    den = float(torch.linalg.vector_norm(rd))
    if den == 0:
        raise ValueError("reference is identically zero: a comparison on zeros proves nothing")
    xd = x.detach().to(rd.device, torch.float64)
    if not bool(torch.isfinite(xd).all()):
        return math.inf
    return float(torch.linalg.vector_norm(xd - rd)) / den


@torch.no_grad()
def chunk_gdn_fp64(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens=None,
    chunk_size: int = 64,
    max_bytes: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN forward in fp64 by the chunked algorithm (the trusted result of the benchmark gate).
    Arguments and return as `chunk_gdn_fp64_autograd`, without autograd.

    max_bytes: the fp64 working set allowed at once (default FP64_GROUP_BYTES). The value heads are
    independent, so above it the result is computed one group of q/k heads (with their value heads)
    at a time and concatenated, each group on the same algorithm (4 x 2^20 tokens at 16 value heads
    needs ~190 GiB in one piece)."""
    B, T, H = q.shape[:3]
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"HV={HV} is not a multiple of H={H}")
    G = HV // H
    n_seq = (len(cu_seqlens) - 1) if cu_seqlens is not None else B
    per_value_head = FP64_BYTES_PER_TOKEN_HEAD * (B * T + n_seq * chunk_size)
    hg = max(1, min(H, int((max_bytes or FP64_GROUP_BYTES) // max(per_value_head * G, 1))))
    if hg >= H:
        return chunk_gdn_fp64_autograd(q, k, v, g, beta, scale, initial_state, cu_seqlens, chunk_size)
    outs, states = [], []
    for h0 in range(0, H, hg):
        h1 = min(H, h0 + hg)
        vs = slice(h0 * G, h1 * G)
        o, S = chunk_gdn_fp64_autograd(q[:, :, h0:h1], k[:, :, h0:h1], v[:, :, vs], g[:, :, vs], beta[:, :, vs], scale,
                                       None if initial_state is None else initial_state[:, vs], cu_seqlens, chunk_size)
        outs.append(o)
        states.append(S)
    return torch.cat(outs, 2), torch.cat(states, 1)


#: Bytes of the fp64 chunked forward's working set per (padded token, value head), an upper estimate
#: (q, k, v, w, u, o and the output gathered in fp64, four [C, C] matrices per chunk, with C = 64).
FP64_BYTES_PER_TOKEN_HEAD = 12 * 1024
#: The working set `chunk_gdn_fp64` computes in one piece (above it: groups of q/k heads).
FP64_GROUP_BYTES = 48 * 2**30


def chunk_gdn_fp64_autograd(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens=None,
    chunk_size: int = 64,
) -> tuple[torch.Tensor, torch.Tensor]:
    """GDN forward in fp64 by the chunked algorithm, differentiable by torch autograd when its fp64
    inputs require grad (every step is a plain torch op; exponents are masked before `exp`, so
    no inf enters a product whose gradient is taken).

    Args:
        q, k: [B, T, H, K]; v: [B, T, HV, V] (HV % H == 0), any float dtype.
        g: [B, T, HV] natural-log decay per token (<= 0); beta: [B, T, HV].
        scale: output scale, default K ** -0.5.
        initial_state: [N, HV, K, V] or None (zeros).
        cu_seqlens: None (B sequences of T tokens), a tensor or a list of offsets [N + 1] (B == 1).
        chunk_size: C, any positive integer (the result does not depend on it beyond rounding).

    Returns:
        (o, final_state): o [B, T, HV, V] fp64, final_state [N, HV, K, V] fp64, on q's device.
    """
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    if HV % H:
        raise ValueError(f"HV={HV} is not a multiple of H={H}")
    dev, f64, C = q.device, torch.float64, int(chunk_size)
    scale = K**-0.5 if scale is None else float(scale)
    if cu_seqlens is None:
        spans = [(b * T, T) for b in range(B)]
    else:
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        if B != 1:
            raise ValueError("cu_seqlens needs B == 1")
        spans = [(int(cu[n]), int(cu[n + 1]) - int(cu[n])) for n in range(len(cu) - 1)]
    N = len(spans)
    NT = max(1, max(math.ceil(n / C) for _, n in spans))
    L = NT * C

    pos = torch.arange(L, device=dev)
    starts = torch.tensor([s for s, _ in spans], device=dev)
    lens = torch.tensor([n for _, n in spans], device=dev)
    valid = pos[None, :] < lens[:, None]                                    # [N, L]
    idx = torch.where(valid, starts[:, None] + pos[None, :], torch.zeros_like(pos)[None, :])
    head_of = torch.arange(HV, device=dev) // (HV // H)

    def gather(x, heads):  # [B, T, h, ...] -> [N, NT, HV, C, ...] fp64, zero past each sequence
        flat = x.reshape(B * T, *x.shape[2:])
        if heads is not None:
            flat = flat.index_select(1, heads)
        y = flat.index_select(0, idx.reshape(-1)).to(f64).reshape(N, L, *flat.shape[1:])
        y = y * valid.reshape(N, L, *([1] * (y.dim() - 2)))
        y = y.reshape(N, NT, C, *y.shape[2:])
        return y.transpose(2, 3).contiguous()

    qc, kc, vc = gather(q, head_of), gather(k, head_of), gather(v, None)   # [N, NT, HV, C, D]
    gc = gather(g, None).cumsum(-1)                                          # [N, NT, HV, C]
    bc = gather(beta, None)

    causal = torch.ones(C, C, dtype=torch.bool, device=dev).tril()
    strict = causal.tril(-1)
    diff = gc[..., :, None] - gc[..., None, :]
    gamma = torch.exp(diff.masked_fill(~causal, -math.inf))                 # exponent masked first
    del diff
    kk = (kc @ kc.transpose(-1, -2)) * gamma
    lower = (bc[..., :, None] * kk).masked_fill(~strict, 0.0)
    del kk
    eye = torch.eye(C, dtype=f64, device=dev)
    A = torch.linalg.solve_triangular(eye + lower, eye.expand_as(lower), upper=False, unitriangular=True)
    del lower
    w = A @ ((bc * gc.exp())[..., None] * kc)
    u = A @ (bc[..., None] * vc)
    del A
    qk = (qc @ kc.transpose(-1, -2)) * gamma                               # causal, diagonal kept
    del gamma
    g_last = gc[..., -1]                                                    # [N, NT, HV]
    decay_to_last = torch.exp(g_last[..., None] - gc)                       # exponent <= 0

    if initial_state is None:
        S = torch.zeros(N, HV, K, V, dtype=f64, device=dev)
    else:
        S = initial_state.to(dev, f64).clone()
    o = torch.empty(N, NT, HV, C, V, dtype=f64, device=dev)
    for j in range(NT):
        v_new = u[:, j] - w[:, j] @ S
        o[:, j] = scale * (gc[:, j].exp()[..., None] * (qc[:, j] @ S) + qk[:, j] @ v_new)
        S = g_last[:, j].exp()[..., None, None] * S + kc[:, j].transpose(-1, -2) @ (decay_to_last[:, j][..., None] * v_new)

    o = o.transpose(2, 3).reshape(N, L, HV, V)
    out = torch.zeros(B * T, HV, V, dtype=f64, device=dev)
    out[idx[valid]] = o[valid]
    return out.reshape(B, T, HV, V), S


#: Gradient names in the order every backward of the benchmark returns them.
GRAD_NAMES = ("dq", "dk", "dv", "dg", "dbeta", "dh0")


def chunk_gdn_fp64_grads(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    g: torch.Tensor,
    beta: torch.Tensor,
    do: torch.Tensor,
    dht: torch.Tensor | None = None,
    scale: float | None = None,
    initial_state: torch.Tensor | None = None,
    cu_seqlens=None,
    chunk_size: int = 64,
    max_token_heads: int = 1 << 20,
) -> dict[str, torch.Tensor | None]:
    """The trusted gradients of the backward gate: autograd of `chunk_gdn_fp64_autograd` in fp64.

    Computes o, the final state and the gradients of L = <o, do> + <final_state, dht> with respect
    to q, k, v, g (the per-token natural-log gate, through the chunk-local cumsum), beta and
    initial_state, all in fp64 from the same (bf16 / fp32) inputs the kernels get. Value heads are
    independent except for the q/k head they share, so they are processed in batches of value
    heads (each batch reads its q/k heads through an index, whose gradient autograd sums back):
    a batch holds at most `max_token_heads` padded token-heads (every sequence padded to the
    longest one's chunks), which bounds device memory (about 1 GB per 32768 padded token-heads, so
    about 30 GB at the default 2^20).

    Args:
        q, k: [B, T, H, K]; v, do: [B, T, HV, V]; g, beta: [B, T, HV]; dht: [N, HV, K, V] or None;
        scale (default K ** -0.5), initial_state ([N, HV, K, V] or None), cu_seqlens and
        chunk_size as in `chunk_gdn_fp64`.
        max_token_heads: padded token-heads per batch of value heads (at least one head per batch).

    Returns:
        dict with `o` [B, T, HV, V], `ht` [N, HV, K, V], `dq`, `dk` [B, T, H, K], `dv`
        [B, T, HV, V], `dg`, `dbeta` [B, T, HV] and `dh0` ([N, HV, K, V], None without
        initial_state), fp64 on q's device.
    """
    B, T, H, K = q.shape
    HV = v.shape[2]
    if HV % H:
        raise ValueError(f"HV={HV} is not a multiple of H={H}")
    f64, dev = torch.float64, q.device
    scale = K**-0.5 if scale is None else float(scale)
    if cu_seqlens is None:
        lengths = [T] * B
    else:
        cu = cu_seqlens.tolist() if isinstance(cu_seqlens, torch.Tensor) else list(cu_seqlens)
        lengths = [int(b) - int(a) for a, b in zip(cu[:-1], cu[1:])]
        cu_seqlens = [int(c) for c in cu]
    C = int(chunk_size)
    padded = len(lengths) * max(1, max(math.ceil(n / C) for n in lengths)) * C
    per_batch = max(1, min(HV, int(max_token_heads) // max(1, padded)))
    group = HV // H

    with torch.enable_grad():
        q64 = q.detach().to(f64).requires_grad_(True)
        k64 = k.detach().to(f64).requires_grad_(True)
        out = {
            "o": torch.empty(v.shape, dtype=f64, device=dev),
            "ht": None,
            "dq": torch.zeros(q.shape, dtype=f64, device=dev),
            "dk": torch.zeros(k.shape, dtype=f64, device=dev),
            "dv": torch.empty(v.shape, dtype=f64, device=dev),
            "dg": torch.empty(g.shape, dtype=f64, device=dev),
            "dbeta": torch.empty(beta.shape, dtype=f64, device=dev),
            "dh0": None if initial_state is None else torch.empty(initial_state.shape, dtype=f64, device=dev),
        }
        for a in range(0, HV, per_batch):
            b = min(HV, a + per_batch)
            heads = torch.arange(a, b, device=dev) // group
            leaves = {
                "v": v[:, :, a:b].detach().to(f64).requires_grad_(True),
                "g": g[:, :, a:b].detach().to(f64).requires_grad_(True),
                "beta": beta[:, :, a:b].detach().to(f64).requires_grad_(True),
            }
            if initial_state is not None:
                leaves["h0"] = initial_state[:, a:b].detach().to(f64).requires_grad_(True)
            o, ht = chunk_gdn_fp64_autograd(
                q64.index_select(2, heads), k64.index_select(2, heads), leaves["v"], leaves["g"], leaves["beta"],
                scale, leaves.get("h0"), cu_seqlens, C,
            )
            outputs, grad_outputs = [o], [do[:, :, a:b].detach().to(f64)]
            if dht is not None:
                outputs.append(ht)
                grad_outputs.append(dht[:, a:b].detach().to(f64))
            inputs = [q64, k64] + list(leaves.values())
            grads = torch.autograd.grad(outputs, inputs, grad_outputs, allow_unused=True)
            gq, gk, gv, gg, gb = grads[:5]
            for name, gr in (("dq", gq), ("dk", gk)):
                if gr is not None:
                    out[name] += gr
            out["dv"][:, :, a:b] = gv if gv is not None else 0
            out["dg"][:, :, a:b] = gg if gg is not None else 0
            out["dbeta"][:, :, a:b] = gb if gb is not None else 0
            if initial_state is not None:
                out["dh0"][:, a:b] = grads[5] if grads[5] is not None else 0
            out["o"][:, :, a:b] = o.detach()
            if out["ht"] is None:
                out["ht"] = torch.empty((ht.shape[0], HV) + tuple(ht.shape[2:]), dtype=f64, device=dev)
            out["ht"][:, a:b] = ht.detach()
            del o, ht, grads, leaves, outputs, grad_outputs
    return out

"""The numeric twins of the derivation records, evaluated on one set of inputs (plain PyTorch).

Every record in `derivations` names the reference functions computing its left and its right side
(`Identity.twins`, dotted names under `reference.`). The functions take different arguments (whole
ops, FLA-layout stages, chunk tensors), so each record has a small driver here that prepares the
inputs of both sides from one input dict, calls them, and returns the pairs to compare:

    pairs("RW-2", x)  ->  [TwinPair(quantity="v_new", lhs=..., rhs=...)]

`x` is a dict as made by `flashqla.testing.make_gdn_inputs` (q, k, v, g, beta, initial_state,
cu_seqlens), plus `do` and `dht` (cotangents of o and of the final state, needed by the BWD, RW-6
records; `with_cotangents` adds them) and optionally `scale` (default K ** -0.5). The
drivers follow the dtype of x: fp64 inputs give fp64 sides (the twin check: both sides agree to
rounding), fp32 inputs (for example bf16-rounded, see `reference.gdn.numerics`) give fp32 sides
computed by the same formulas in fp32, which is how a rewrite's accuracy is compared with the
formulation it replaces. Upstream stages that both sides share (FLA's g_cum, its chain of states h)
are computed once, in the same dtype, so a pair differs only by the step the record is about.

Bounded records (CP-4, CP-5) have no pair: `reference.gdn.numerics.truncation_errors` measures them
against their bound.

Source: the records of derivations/ (chunk_form, wy, rewrites, backward, cp); FLA's and our stage
functions in reference.gdn.{recurrent, chunk, chunk_bwd, fused, cp}.
"""

from __future__ import annotations

import importlib
from dataclasses import dataclass
from functools import cached_property
from typing import Callable

import torch

from . import chunk, chunk_bwd, cp, fused
from .chunk import prepare_chunk_layout
from .recurrent import compute_dtype, recurrent_gated_delta_rule

__all__ = ["TwinPair", "resolve", "twin_functions", "pairs", "pairs_many", "has_driver", "with_cotangents", "INPUT_NAMES"]

#: The keys of an input dict the drivers read.
INPUT_NAMES = ("q", "k", "v", "g", "beta", "initial_state", "cu_seqlens", "do", "dht", "scale")


@dataclass
class TwinPair:
    """One compared quantity of a record: its name and the left / right side (same shape)."""

    quantity: str
    lhs: torch.Tensor
    rhs: torch.Tensor


#: The name this package is imported under: "reference" in a checkout, "flashqla.reference" installed.
_ROOT = __name__.rsplit(".gdn.", 1)[0]


def resolve(name: str) -> Callable:
    """The function behind a dotted name such as ``reference.gdn.chunk.solve_tril`` (the records' names;
    "reference" stands for this package, whatever it is imported as).

    Raises ImportError / AttributeError when the module or the attribute does not exist."""
    module, _, attr = name.rpartition(".")
    if module == "reference" or module.startswith("reference."):
        module = _ROOT + module[len("reference"):]
    return getattr(importlib.import_module(module), attr)


def twin_functions(record) -> tuple[Callable, Callable]:
    """(left, right) twin functions of a derivation record (an `Identity`), imported by name."""
    return resolve(record.twins[0]), resolve(record.twins[1])


def with_cotangents(x: dict, seed: int = 11) -> dict:
    """x plus `do` ~ N(0, 1) [B, T, HV, V] and `dht` ~ N(0, 1) [N, HV, K, V] (when x has an
    initial_state; else None), drawn on CPU in fp64 and cast to v's / the state's dtype."""
    gen = torch.Generator().manual_seed(seed)
    out = dict(x)
    out["do"] = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64).to(x["v"].dtype)
    h0 = x.get("initial_state")
    out["dht"] = None if h0 is None else torch.randn(h0.shape, generator=gen, dtype=torch.float64).to(h0.dtype)
    return out


class _Inputs:
    """Shared, lazily computed upstream quantities of one input dict (in its compute dtype)."""

    def __init__(self, x: dict, chunk_size: int):
        self.x = x
        self.C = chunk_size
        self.cu = x.get("cu_seqlens")
        self.dtype = compute_dtype(*(x[n] for n in ("q", "k", "v", "g", "beta")), x.get("initial_state"))
        self.K = x["q"].shape[-1]
        self.HV = x["v"].shape[2]
        self.scale = float(x["scale"]) if x.get("scale") is not None else self.K**-0.5
        self.cs = dict(chunk_size=chunk_size, cu_seqlens=self.cu)

    def fwd_args(self) -> dict:
        x = self.x
        return dict(q=x["q"], k=x["k"], v=x["v"], g=x["g"], beta=x["beta"], scale=self.scale,
                    initial_state=x.get("initial_state"), cu_seqlens=self.cu)

    @cached_property
    def fla_fwd(self):
        """FLA's chunked forward: (g_cum, o, A, final_state, h, v_new)."""
        return chunk.chunk_gated_delta_rule_fwd(**self.fwd_args(), output_final_state=True, chunk_size=self.C)

    @cached_property
    def L_fla(self):
        return chunk.chunk_scaled_dot_kkt(self.x["k"], self.x["beta"], self.fla_fwd[0], **self.cs)

    @cached_property
    def recurrence(self):
        """(o, final_state) of the token recurrence and, when x has cotangents, the autograd gradients
        dq dk dv dg dbeta (dh0 too when x has an initial state) of <do, o> + <dht, final_state>."""
        x = self.x
        names = [n for n in ("q", "k", "v", "g", "beta", "initial_state") if x.get(n) is not None]
        leaves = {n: x[n].detach().clone().requires_grad_(x.get("do") is not None) for n in names}
        args = {**self.fwd_args(), **leaves}
        with torch.set_grad_enabled(x.get("do") is not None):
            o, ht = recurrent_gated_delta_rule(**args, output_final_state=True)
        grads = {}
        if x.get("do") is not None:
            outs, cots = [o], [x["do"].to(o.dtype)]
            if x.get("dht") is not None:
                outs.append(ht)
                cots.append(x["dht"].to(ht.dtype))
            torch.autograd.backward(outs, cots)
            grads = {("dh0" if n == "initial_state" else f"d{n}"): leaves[n].grad for n in names}
        return o.detach(), ht.detach(), grads

    @cached_property
    def fla_bwd(self):
        """The hand-written backward (reference.gdn.chunk_bwd): dict dq dk dv dg dbeta dh0."""
        x = self.x
        g_cum, _, A, _, _, _ = self.fla_fwd
        out = chunk_bwd.chunk_gated_delta_rule_bwd(
            x["q"], x["k"], x["v"], g_cum, x["beta"], A, self.scale, x.get("initial_state"), x["do"], x.get("dht"),
            self.cu, self.C,
        )
        return dict(zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), out))

    @cached_property
    def lay(self):
        return prepare_chunk_layout(self.x["q"].shape[0], self.x["q"].shape[1], self.cu, self.C)

    @cached_property
    def chunks(self) -> dict:
        """Chunk tensors [NC, HV, C, ...] in the compute dtype; g_cum padded with the last valid value."""
        x, lay, dt = self.x, self.lay, self.dtype
        return dict(
            q=fused.to_chunks(x["q"], lay, self.HV, dt),
            k=fused.to_chunks(x["k"], lay, self.HV, dt),
            v=fused.to_chunks(x["v"], lay, dtype=dt),
            beta=fused.to_chunks(x["beta"], lay, dtype=dt),
            g_cum=fused.pad_g_cum(fused.to_chunks(self.fla_fwd[0], lay, dtype=dt), lay),
        )

    def h_chunks(self) -> torch.Tensor:
        """FLA's states entering every chunk, [NC, HV, K, V]."""
        h = self.fla_fwd[4]
        return h.reshape(self.lay.NC, *h.shape[2:])

    def on_valid(self, A: torch.Tensor) -> torch.Tensor:
        """A [NC, HV, C, C] with entries outside a partial chunk's valid square set to 0."""
        lay = self.lay
        sq = (lay.valid[:, :, None] & lay.valid[:, None, :])[:, None]
        return torch.where(sq, A, torch.zeros((), dtype=A.dtype))

    def fused_chain(self, state_update: str, use_exp2: bool = False) -> dict:
        x = self.x
        return fused.fused_chunk_fwd(
            x["q"], x["k"], x["v"], self.fla_fwd[0], x["beta"], self.scale, x.get("initial_state"), self.cu, self.C,
            state_update=state_update, use_exp2=use_exp2,
        )


_DRIVERS: dict[str, Callable[[_Inputs, Callable, Callable], list[TwinPair]]] = {}


def _driver(*ids):
    def deco(fn):
        for i in ids:
            _DRIVERS[i] = fn
        return fn

    return deco


# ---- CF: chunk form == recurrence ---------------------------------------------------------------


@_driver("CF-1")
def _cf1(s, lhs_fn, rhs_fn):
    o_rec, _ = lhs_fn(**s.fwd_args())
    return [TwinPair("o", o_rec, rhs_fn(**s.fwd_args(), chunk_size=s.C)[1])]


@_driver("CF-2")
def _cf2(s, lhs_fn, rhs_fn):
    _, ht_rec = lhs_fn(**s.fwd_args(), output_final_state=True)
    return [TwinPair("final_state", ht_rec, rhs_fn(**s.fwd_args(), output_final_state=True, chunk_size=s.C)[3])]


@_driver("CF-3")
def _cf3(s, lhs_fn, rhs_fn):
    x = s.x
    u = lhs_fn(x["k"], x["v"], x["g"], x["beta"], x.get("initial_state"), s.cu)
    g_cum, _, A, _, _, _ = s.fla_fwd
    w, uu = chunk.recompute_w_u(x["k"], x["v"], x["beta"], A, g_cum, **s.cs)
    _, v_new, _ = rhs_fn(x["k"], w, uu, g_cum, x.get("initial_state"), False, **s.cs)
    return [TwinPair("v_new", u, v_new)]


def checkpoint_positions_for(B: int, T: int, cu) -> list[int]:
    """The checkpoint positions the CF-4 twins test: tokens 1, 63, 64, 65 and the last of every
    sequence (those inside it), as global offsets into the packed batch (b * T + t without cu)."""
    bounds = ([(int(cu[n]), int(cu[n + 1])) for n in range(cu.numel() - 1)] if cu is not None
              else [(b * T, (b + 1) * T) for b in range(B)])
    out = []
    for bos, eos in bounds:
        out += sorted({bos + j for j in (1, 63, 64, 65, eos - bos) if 1 <= j <= eos - bos})
    return out


@_driver("CF-4")
def _cf4(s, lhs_fn, rhs_fn):
    x = s.x
    B, T = x["q"].shape[:2]
    pos = checkpoint_positions_for(B, T, s.cu)
    # left: the recurrence run on each checkpoint's prefix of its sequence (a packed batch of prefixes)
    bounds = ([(0, int(s.cu[n]), int(s.cu[n + 1])) for n in range(s.cu.numel() - 1)] if s.cu is not None
              else [(b, 0, T) for b in range(B)])
    rows, h0, lens = {n: [] for n in ("q", "k", "v", "g", "beta")}, [], [0]
    for p in pos:
        n = next(i for i, (b, bos, eos) in enumerate(bounds) if b * T + bos < p <= b * T + eos)
        b, bos, _ = bounds[n]
        for name in rows:
            rows[name].append(x[name][b, bos : p - b * T])
        if x.get("initial_state") is not None:
            h0.append(x["initial_state"][n])
        lens.append(lens[-1] + p - b * T - bos)
    packed = {name: torch.cat(r)[None] for name, r in rows.items()}
    _, S_rec = lhs_fn(**packed, scale=s.scale, initial_state=torch.stack(h0) if h0 else None, output_final_state=True,
                      cu_seqlens=torch.tensor(lens, dtype=torch.int64))
    g_cum, _, _, _, h, v_new = s.fla_fwd
    return [TwinPair("checkpoint_states", S_rec, rhs_fn(x["k"], v_new, h, g_cum, pos, s.C, s.cu))]


# ---- WY: the WY/UT representation and the blockwise inverse -------------------------------------


@_driver("WY-1")
def _wy1(s, lhs_fn, rhs_fn):
    x, c = s.x, s.chunks
    g_cum, _, A, _, _, _ = s.fla_fwd
    w, _ = chunk.recompute_w_u(x["k"], x["v"], x["beta"], A, g_cum, **s.cs)
    return [TwinPair("M", lhs_fn(c["k"], c["beta"], c["g_cum"]), rhs_fn(c["k"], fused.to_chunks(w, s.lay), c["g_cum"]))]


@_driver("WY-2")
def _wy2(s, lhs_fn, rhs_fn):
    x, c = s.x, s.chunks
    g_cum, _, A, _, _, _ = s.fla_fwd
    _, u = chunk.recompute_w_u(x["k"], x["v"], x["beta"], A, g_cum, **s.cs)
    return [TwinPair("F", lhs_fn(c["k"], c["v"], c["beta"], c["g_cum"]), rhs_fn(c["k"], fused.to_chunks(u, s.lay), c["g_cum"]))]


@_driver("WY-3")
def _wy3(s, lhs_fn, rhs_fn):
    block = 16 if s.C % 16 == 0 else s.C
    nb = s.C // block
    L = fused.to_chunks(s.L_fla, s.lay)
    A = fused.to_chunks(rhs_fn(s.L_fla, **s.cs), s.lay)
    blockdiag = torch.block_diag(*[torch.ones(block, block, dtype=torch.bool)] * nb)
    A_blocks = torch.where(blockdiag, A, torch.zeros((), dtype=A.dtype))
    return [TwinPair("diagonal blocks of A", s.on_valid(lhs_fn(L, block)), s.on_valid(A_blocks))]


@_driver("WY-4")
def _wy4(s, lhs_fn, rhs_fn):
    block = 16 if s.C % 16 == 0 else s.C
    L = fused.to_chunks(s.L_fla, s.lay)
    A = fused.to_chunks(rhs_fn(s.L_fla, **s.cs), s.lay)
    pairs = [TwinPair("A", s.on_valid(lhs_fn(L, block)), s.on_valid(A))]
    if s.C % 8 == 0:
        # WY-4 with two blocks applied recursively from 8-wide diagonal blocks (the sm_90 prepare kernel's order)
        pairs.append(TwinPair("A (recursive doubling)", s.on_valid(fused.solve_tril_doubling(L, s.C // 8)), s.on_valid(A)))
    return pairs


@_driver("WY-5")
def _wy5(s, lhs_fn, rhs_fn):
    # the product form needs four blocks: block = C / 4
    L = fused.to_chunks(s.L_fla, s.lay)
    A = fused.to_chunks(rhs_fn(s.L_fla, **s.cs), s.lay)
    return [TwinPair("A", s.on_valid(lhs_fn(L, s.C // 4)), s.on_valid(A))]


@_driver("WY-6")
def _wy6(s, lhs_fn, rhs_fn):
    # the 8-wide diagonal blocks by products (lhs) against WY-3's substitution (rhs), and the whole inverse
    # by recursive doubling from them against FLA's
    L = fused.to_chunks(s.L_fla, s.lay)
    A = fused.to_chunks(chunk.solve_tril(s.L_fla, **s.cs), s.lay)
    block = 8 if s.C % 8 == 0 else s.C
    pairs = [TwinPair("8-wide diagonal blocks", s.on_valid(lhs_fn(L, block)), s.on_valid(rhs_fn(L, block)))]
    if s.C % 8 == 0:
        pairs.append(TwinPair("A (recursive doubling, first level by products)",
                              s.on_valid(fused.solve_tril_doubling(L, s.C // 8, level1="product")), s.on_valid(A)))
    return pairs


# ---- RW: the rewrites (left: FLA's formulation, right: ours) ------------------------------------


@_driver("RW-1")
def _rw1(s, lhs_fn, rhs_fn):
    c = s.chunks
    A_gated = fused.to_chunks(lhs_fn(s.L_fla, **s.cs), s.lay)
    A_g = rhs_fn(fused.kkt_solve(c["k"], c["beta"]), c["g_cum"])
    return [TwinPair("A (gated)", s.on_valid(A_gated), s.on_valid(A_g))]


@_driver("RW-2")
def _rw2(s, lhs_fn, rhs_fn):
    x, c = s.x, s.chunks
    g_cum, _, A, _, _, _ = s.fla_fwd
    w, u = chunk.recompute_w_u(x["k"], x["v"], x["beta"], A, g_cum, **s.cs)
    _, v_new, _ = lhs_fn(x["k"], w, u, g_cum, x.get("initial_state"), False, **s.cs)
    A_g = fused.regate(fused.kkt_solve(c["k"], c["beta"]), c["g_cum"])
    rhs = fused.from_chunks(rhs_fn(c["k"], c["v"], c["beta"], A_g, c["g_cum"], s.h_chunks()), s.lay)
    return [TwinPair("v_new", v_new, rhs)]


def _state_chain(s, lhs_fn, state_update: str, use_exp2: bool = False) -> list[TwinPair]:
    """FLA's inter-chunk state pass (lhs_fn = chunk.chunk_fwd_h) against our chain with the given
    state update: states entering every chunk and the final state."""
    x = s.x
    g_cum, _, A, _, _, _ = s.fla_fwd
    w, u = chunk.recompute_w_u(x["k"], x["v"], x["beta"], A, g_cum, **s.cs)
    h, _, ht = lhs_fn(x["k"], w, u, g_cum, x.get("initial_state"), True, **s.cs)
    out = s.fused_chain(state_update, use_exp2)
    return [TwinPair("h", h, out["h"]), TwinPair("final_state", ht, out["final_state"])]


@_driver("RW-3")
def _rw3(s, lhs_fn, rhs_fn):
    c = s.chunks
    hc = s.h_chunks()
    A = fused.kkt_solve(c["k"], c["beta"])
    T_c, gamma_C = rhs_fn(c["k"], c["beta"], A, c["g_cum"])
    B_c = fused.chunk_state_input(c["k"], c["v"], c["beta"], A, c["g_cum"])
    eye = torch.eye(s.K, dtype=s.dtype)
    one_step = (gamma_C[..., None, None] * eye - T_c) @ hc + B_c
    lhs = fused.chunk_state_update(hc, c["k"], fused.to_chunks(s.fla_fwd[5], s.lay, dtype=s.dtype), c["g_cum"])
    return [TwinPair("S' (one chunk)", lhs, one_step)] + _state_chain(s, chunk.chunk_fwd_h, "transition")


@_driver("RW-4")
def _rw4(s, lhs_fn, rhs_fn):
    G = s.chunks["g_cum"]
    pair = TwinPair("Gamma", lhs_fn(G), rhs_fn(fused.g_cum_to_log2(G)))
    out = s.fused_chain("direct", use_exp2=True)
    ref = s.fused_chain("direct", use_exp2=False)
    return [pair, TwinPair("o", ref["o"], out["o"]), TwinPair("final_state", ref["final_state"], out["final_state"])]


@_driver("RW-5")
def _rw5(s, lhs_fn, rhs_fn):
    return _state_chain(s, lhs_fn, "xy")


@_driver("RW-7")
def _rw7(s, lhs_fn, rhs_fn):
    c = s.chunks
    A_g = fused.regate(fused.kkt_solve(c["k"], c["beta"]), c["g_cum"])
    args = (c["q"], c["k"], c["v"], c["beta"], A_g, c["g_cum"], s.h_chunks(), s.scale)
    (vn, o), (vn_s, o_s) = lhs_fn(*args), rhs_fn(*args)
    return [TwinPair("v_new", vn, vn_s), TwinPair("o", o, o_s)]


@_driver("RW-6")
def _rw6(s, lhs_fn, rhs_fn):
    # left: FLA's hand-written backward (its dh0); right: the gate-light pass built on
    # chunk_state_grad (fused.fused_state_grad applies rhs_fn chunk by chunk, last to first)
    x = s.x
    _, dh0 = fused.fused_state_grad(x["q"], x["k"], x["g"], x["beta"], s.scale, x["do"], x.get("dht"), s.cu, s.C)
    return [TwinPair("dh0", s.fla_bwd["dh0"], dh0)]


# ---- BWD: hand-written gradients == autograd of the recurrence ----------------------------------


def _bwd(name):
    def run(s, lhs_fn, rhs_fn):
        return [TwinPair(name, s.fla_bwd[name], s.recurrence[2][name])]

    return run


for _n in ("dq", "dk", "dv", "dbeta", "dh0", "dg"):
    _DRIVERS[f"BWD-{_n}"] = _bwd(_n)


@_driver("BWD-Abeta")
def _bwd_abeta(s, lhs_fn, rhs_fn):
    # left: FLA's gated A as the regated gate-free inverse; right: A from the stored A diag(beta)
    c = s.chunks
    A = lhs_fn(fused.kkt_solve(c["k"], c["beta"]), c["g_cum"])
    return [TwinPair("A", A, rhs_fn(A * c["beta"][..., None, :], c["k"], c["g_cum"]))]


@_driver("BWD-fused")
def _bwd_fused(s, lhs_fn, rhs_fn):
    # left: autograd of the recurrence (lhs_fn); right: the kernels' backward (rhs_fn) from the
    # sm_90 forward's slot-major A diag(beta) and g_cum_log2, computed by the reference
    from . import fused_bwd

    x = s.x
    Ab, G2 = fused_bwd.forward_slot_products(x["k"], x["g"], x["beta"], s.HV, s.cu, s.C)
    out = rhs_fn(x["q"], x["k"], x["v"], x["beta"], Ab, G2, s.scale, x.get("initial_state"), x["do"], x.get("dht"),
                 s.cu, g=x["g"], chunk_size=s.C)
    ref = s.recurrence[2]
    return [TwinPair(n, ref[n], o) for n, o in zip(("dq", "dk", "dv", "dg", "dbeta", "dh0"), out) if n in ref]


@_driver("BWD-dG")
def _bwd_dG(s, lhs_fn, rhs_fn):
    # hand-written dL/dg_cum (before the reverse cumsum; lhs_fn = chunk_bwd_dqkwg plus the WY part)
    # against autograd of the chunk form in g_cum (rhs_fn = fused_chunk_fwd)
    x, cs = s.x, s.cs
    g_cum, _, A, _, _, _ = s.fla_fwd
    h0 = x.get("initial_state")
    w, u = chunk.recompute_w_u(x["k"], x["v"], x["beta"], A, g_cum, **cs)
    h, v_new, _ = chunk.chunk_fwd_h(x["k"], w, u, g_cum, h0, False, **cs)
    dv_local = chunk_bwd.chunk_bwd_dv_local(x["q"], x["k"], x["do"], g_cum, s.scale, **cs)
    dh, _, dv2 = chunk_bwd.chunk_bwd_dhu(x["q"], x["k"], w, g_cum, h0, x.get("dht"), x["do"], dv_local, s.scale, **cs)
    _, _, dw, dg1 = lhs_fn(x["q"], x["k"], v_new, w, g_cum, h, dv2, x["do"], dh, s.scale, **cs)
    _, _, _, dg2 = chunk_bwd.prepare_wy_repr_bwd(x["k"], x["v"], x["beta"], g_cum, A, dw, dv2, **cs)
    G = g_cum.detach().clone().requires_grad_(True)
    with torch.enable_grad():
        out = rhs_fn(x["q"], x["k"], x["v"], G, x["beta"], s.scale, h0, s.cu, s.C)
        outs, cots = [out["o"]], [x["do"].to(out["o"].dtype)]
        if x.get("dht") is not None:
            outs.append(out["final_state"])
            cots.append(x["dht"].to(out["final_state"].dtype))
        torch.autograd.backward(outs, cots)
    return [TwinPair("dG", dg1 + dg2, G.grad)]


# ---- CP: segment maps ------------------------------------------------------------------------------


def _h0(s) -> torch.Tensor:
    x = s.x
    if x.get("initial_state") is not None:
        return x["initial_state"].to(s.dtype)
    N = x["q"].shape[0] if s.cu is None else s.cu.numel() - 1
    return torch.zeros(N, s.HV, s.K, x["v"].shape[3], dtype=s.dtype)


@_driver("CP-1")
def _cp1(s, lhs_fn, rhs_fn):
    x = s.x
    P, Q = rhs_fn(x["k"], x["v"], x["g"], x["beta"], s.cu, s.C)
    _, ht = lhs_fn(**s.fwd_args(), output_final_state=True)
    return [TwinPair("S_end", ht, cp.apply_map((P, Q), _h0(s)))]


@_driver("CP-2")
def _cp2(s, lhs_fn, rhs_fn):
    # every sequence cut into one-chunk segments; their maps folded from the left and from the right
    # (rhs_fn = cp.combine) against the map of the whole sequence (lhs_fn = cp.segment_maps)
    x = s.x
    B, T = x["q"].shape[:2]
    P_all, Q_all = lhs_fn(x["k"], x["v"], x["g"], x["beta"], s.cu, s.C)
    plan = cp.plan_segments(B, T, s.cu, s.C, s.C)
    flat = lambda t: t.reshape(1, B * T, *t.shape[2:])  # noqa: E731
    P, Q = lhs_fn(flat(x["k"]), flat(x["v"]), flat(x["g"]), flat(x["beta"]), plan.cu_seqlens, s.C)
    left, right, keep = [], [], []
    for n in range(plan.N):
        maps = [(P[j], Q[j]) for j in range(plan.M) if int(plan.seq[j]) == n]
        if not maps:
            continue
        keep.append(n)
        acc = maps[0]
        for m in maps[1:]:
            acc = rhs_fn(acc, m)
        left.append(acc)
        acc = maps[-1]
        for m in reversed(maps[:-1]):
            acc = rhs_fn(m, acc)
        right.append(acc)
    stack = lambda ms, i: torch.stack([m[i] for m in ms])  # noqa: E731
    idx = torch.tensor(keep)
    return [
        TwinPair("P (left fold)", P_all[idx], stack(left, 0)),
        TwinPair("Q (left fold)", Q_all[idx], stack(left, 1)),
        TwinPair("P (right fold)", P_all[idx], stack(right, 0)),
        TwinPair("Q (right fold)", Q_all[idx], stack(right, 1)),
    ]


@_driver("CP-3")
def _cp3(s, lhs_fn, rhs_fn):
    x = s.x
    o, _ = lhs_fn(**s.fwd_args())
    o0, _ = lhs_fn(**{**s.fwd_args(), "initial_state": None})
    corr = rhs_fn(x["q"], x["k"], x["g"], x["beta"], _h0(s), s.scale, s.cu, s.C)
    return [TwinPair("o", o, o0.to(corr.dtype) + corr)]


@_driver("BWD-dSin")
def _bwd_dsin(s, lhs_fn, rhs_fn):
    # the initial state's gradient by autograd through the recurrence (lhs_fn) against the one formed
    # from forward quantities over segments of two chunks (rhs_fn = cp.entering_state_grad)
    x = s.x
    h0 = _h0(s).detach().clone().requires_grad_(True)
    dht = x.get("dht")
    with torch.enable_grad():
        o, ht = lhs_fn(**{**s.fwd_args(), "initial_state": h0}, output_final_state=True)
        dht = torch.randn(ht.shape, generator=torch.Generator().manual_seed(3), dtype=ht.dtype) if dht is None else dht
        torch.autograd.backward([o, ht], [x["do"].to(o.dtype), dht.to(ht.dtype)])
    rhs = rhs_fn(x["q"], x["k"], x["g"], x["beta"], x["do"], dht, s.scale, s.cu, segment_len=2 * s.C, chunk_size=s.C)
    return [TwinPair("dS_in", h0.grad, rhs)]


# ---- entry points ----------------------------------------------------------------------------------


def has_driver(record_id: str) -> bool:
    """True when `pairs` can evaluate the record (every exact record; not the bounded ones)."""
    return record_id in _DRIVERS


def pairs(record_id: str, x: dict, chunk_size: int = 64) -> list[TwinPair]:
    """Evaluates the two twins of a record on the inputs x (see the module docstring).

    Args:
        record_id: a derivation record id (``CF-1``, ``RW-3``, ``BWD-dk``, ...).
        x: input dict (q, k, v, g, beta, initial_state, cu_seqlens; do and dht for BWD-* and RW-6;
            optional scale). Any float dtype; the sides come back in the compute dtype (fp64 when
            any input is fp64, else fp32).
        chunk_size: C (a multiple of 16 exercises the 16 x 16 blocks of the inverse).

    Returns:
        list of `TwinPair` (quantity, lhs, rhs), lhs computed by the record's first twin (or the
        pass built on it), rhs by its second.

    Raises:
        KeyError: unknown record, or a record without a driver (the bounded CP-4, CP-5).
        ValueError: BWD-* / RW-6 without `do` in x.
    """
    return pairs_many([record_id], x, chunk_size)[record_id]


def pairs_many(record_ids, x: dict, chunk_size: int = 64) -> dict[str, list[TwinPair]]:
    """`pairs` for several records on the same inputs, sharing the upstream stages (FLA's forward and
    backward, the recurrence and its autograd gradients) between them. Returns {record_id: pairs}.
    Raises as `pairs`."""
    derivations = importlib.import_module(_ROOT.rpartition("reference")[0] + "derivations")

    shared = _Inputs(x, chunk_size)
    out = {}
    for record_id in record_ids:
        record = derivations.get(record_id)
        if record_id not in _DRIVERS:
            raise KeyError(f"{record_id} has no twin driver (bounded records are measured by reference.gdn.numerics)")
        if (record_id.startswith("BWD-") or record_id == "RW-6") and x.get("do") is None:
            raise ValueError(f"{record_id} needs the cotangent `do` in x (see with_cotangents)")
        lhs_fn, rhs_fn = twin_functions(record)
        out[record_id] = _DRIVERS[record_id](shared, lhs_fn, rhs_fn)
    return out

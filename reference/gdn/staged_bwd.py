"""The role-specialised pass 2 of the backward as a checked schedule, without a producer warpgroup:
a plan for a role-split kernel with short per-role instruction streams. (The kernel built from it was
correct but slower than the shipped pass 2 and is not kept: `benchmarks/journal/backward.md`; the
shipped pass 2, `flashqla/ops/gdn/kernels/sm90/chunk_bwd.py`, splits the roles differently, with a TMA
producer warp.)

One chunk of `reference.gdn.fused_bwd.chunk_bwd_fused` (records BWD-Abeta, BWD-fused, BWD-dq,
BWD-dG) split over the three warpgroup roles of a 384-thread CTA, six barrier stages
(`benchmarks/journal/backward.md`, "Plan: pass 2 with role-specialised consumer warpgroups"):

    S  owns the state gradient D [K, V] in registers: <S0, D>, D's operand copy, D' (the chain's end)
    K  the chain and dk: K D, Pg^T dO, A_beta^T dv_new, -D dv, then every dk product
    A  the off-chain products: Q K^T, K K^T, A, U, W, v_new, X, M, dL, dq

A stage ends at a barrier every role passes. `SCHEDULE` lists, per stage, each role's operations
with the shared-memory tiles they read and write. `check_schedule` proves the properties a kernel
built from it needs:
  1. no shared tile is written by one role and read or written by another in the same stage (the
     stage's barrier is the only ordering between roles);
  2. every tile is written before it is read (each chunk's loads come first, at stage -1; g and
     beta are read from global memory, size-0 "tiles");
  3. tiles that share a shared-memory region (aliases, to fit 227 KB) never overlap in lifetime;
  4. register values ("r:" names) are read only by the role that made them;
  5. the regions fit Hopper's shared memory per block with the static mbarriers;
and reports, per loaded tile, the last stage that reads its region (after which the next chunk's
copy may be loaded).
`run_chunk` executes the schedule (fp64 or fp32) and must equal `chunk_bwd_fused` on the same chunk
(`tests/test_staged_bwd.py`): the schedule computes exactly the fused stage's math.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import torch

from .fused import decay_mask, gate_vectors

__all__ = ["Op", "TILES", "SCHEDULE", "LOADED", "check_schedule", "run_chunk", "SMEM_LIMIT", "STATIC_SMEM"]

C, K, V = 64, 128, 128
#: Hopper's shared memory per block (dynamic + static), bytes.
SMEM_LIMIT = 232448
#: Static shared memory of a TileLang kernel with mbarriers (1024 B).
STATIC_SMEM = 1024

#: Shared-memory tiles: name -> (region, bytes). Tiles with the same region alias one buffer.
TILES: dict[str, tuple[str, int]] = {
    # loaded by the producer (bf16 unless noted)
    "q": ("q", C * K * 2), "k": ("k", C * K * 2), "v": ("v", C * V * 2), "do": ("do", C * V * 2),
    "Ab": ("Ab", C * C * 2), "h": ("h", K * V * 2),
    # read from global memory where needed (no shared memory left for them)
    "g": ("global g", 0), "beta": ("global beta", 0),
    # written by the consumers
    "Ds": ("Ds", K * V * 2),  # D in bf16 (the chain's operand)
    "dog": ("dog", C * V * 2),  # scale diag(gamma) dO
    "Pg": ("Pg", C * C * 2), "sM": ("Pg", C * C * 2),  # scale (Q K^T) * Gamma; later scale M
    "Kg": ("Kg", C * C * 2), "Bdlk": ("Kg", C * C * 2),  # (K K^T) * Gamma_strict; later diag(beta) dLk
    "Am": ("Am", C * C * 2), "dLk": ("Am", C * C * 2),  # A = I - A_beta Kg; later dL * Gamma_strict
    "W": ("W", C * V * 2),  # V - D U
    "vn": ("vn", C * V * 2),
    "dvn": ("dvn", C * V * 2),
    "dvg": ("Ds", C * V * 2),  # -diag(gamma) dv: rows 0..63 of D's region, once K's last read of Ds is done
    "X": ("v", C * V * 2),  # A^T dv_new, over V
    # per-role partials (fp32): A's dG rows, dG columns and dbeta rows; K's rowsum(dvg U); S's four
    # per-warp <S0, D>; K's r-term rows and dbeta rows go to dG and dbeta in global memory
    "redA": ("redA", 3 * C * 4), "redKu": ("redKu", C * 4), "redS": ("redS", 4 * 4),
    "gKr": ("global dG", 0), "gKb": ("global dbeta", 0),
}

#: Tiles the producer loads each chunk (before stage 0 of the chunk, once their region is free).
LOADED = ("q", "k", "v", "do", "Ab", "h", "g", "beta")


@dataclass(frozen=True)
class Op:
    """One operation of a role in a stage: reads and writes name shared tiles (plain names) and
    role-local registers ("r:name"); fn(env) computes the writes from the reads."""

    role: str
    what: str
    reads: tuple[str, ...]
    writes: tuple[str, ...]
    fn: Callable = field(compare=False)


def _t(x):
    return x.transpose(-1, -2)


def _ops():
    """The schedule's stages: a list of lists of Op (roles interleaved; order within a role is
    program order)."""
    st = []
    # stage 0: S publishes D; A forms Pg
    st.append([
        Op("S", "<S0, D>", ("h", "r:D"), ("r:sc0",), lambda e: {"r:sc0": (e["h"] * e["r:D"]).sum()}),
        Op("S", "Ds = D (operand copy)", ("r:D",), ("Ds",), lambda e: {"Ds": e["r:D"].clone()}),
        Op("S", "D *= gamma_C", ("r:D", "g"), ("r:D",), lambda e: {"r:D": e["gC"] * e["r:D"]}),
        Op("S", "dog = scale gamma dO", ("do", "g"), ("dog",), lambda e: {"dog": e["scale"] * e["gamma"][:, None] * e["do"]}),
        Op("A", "Pg = scale (Q K^T) * Gamma", ("q", "k", "g"), ("Pg",),
           lambda e: {"Pg": e["scale"] * (e["q"] @ _t(e["k"])) * e["Gam"]}),
    ])
    # stage 1: K starts the chain; A builds A, U, W, v_new
    st.append([
        Op("K", "dv_new = r K Ds + Pg^T dO", ("k", "Ds", "Pg", "do", "g"), ("dvn",),
           lambda e: {"dvn": _t(e["Pg"]) @ e["do"] + e["r"][:, None] * (e["k"] @ e["Ds"])}),
        Op("A", "Kg = (K K^T) * Gamma_strict", ("k", "g"), ("Kg",), lambda e: {"Kg": (e["k"] @ _t(e["k"])) * e["Gs"]}),
        Op("A", "A = I - A_beta Kg", ("Ab", "Kg"), ("Am",),
           lambda e: {"Am": torch.eye(C, dtype=e["k"].dtype) - e["Ab"] @ e["Kg"]}),
        Op("A", "U = K S0", ("k", "h"), ("r:U",), lambda e: {"r:U": e["k"] @ e["h"]}),
        Op("A", "W = V - gamma U", ("v", "r:U", "g"), ("W",), lambda e: {"W": e["v"] - e["gamma"][:, None] * e["r:U"]}),
        Op("A", "v_new = A_beta W", ("Ab", "W"), ("vn",), lambda e: {"vn": e["Ab"] @ e["W"]}),
    ])
    # stage 2: K: dv, dk_state, then -gamma dv over Ds (dv's registers are then free for the dk
    # products' row sums); A: X (over V), dbeta's first term, M; S: D += Q^T dog
    st.append([
        Op("K", "dv = A_beta^T dv_new (stored)", ("Ab", "dvn"), ("r:dv", "out:dv"),
           lambda e: {"r:dv": _t(e["Ab"]) @ e["dvn"], "out:dv": _t(e["Ab"]) @ e["dvn"]}),
        Op("K", "dk = r v_new Ds^T; r-terms of dG (into dG)", ("vn", "Ds", "g", "k"), ("r:dk", "gKr"), _k_state),
        Op("K", "dvg = -gamma dv (over Ds: its last reader was the line above)", ("r:dv", "g"), ("dvg",),
           lambda e: {"dvg": -e["gamma"][:, None] * e["r:dv"]}),
        Op("A", "X = A^T dv_new; dbeta += rowsum(X W); X over V", ("Am", "dvn", "W"), ("X", "r:rbA"),
           lambda e: (lambda X: {"X": X, "r:rbA": (X * e["W"]).sum(-1)})(_t(e["Am"]) @ e["dvn"])),
        Op("S", "D += Q^T dog", ("q", "dog", "r:D"), ("r:D",), lambda e: {"r:D": e["r:D"] + _t(e["q"]) @ e["dog"]}),
    ])
    # stage 3: S ends the chain; K: dk += dvg S0^T; A: dG terms, dL, dLk, diag(beta) dLk, sM, dq
    st.append([
        Op("S", "D += K^T dvg (D of the previous chunk)", ("k", "dvg", "r:D"), ("r:D", "out:dh_prev"),
           lambda e: (lambda D: {"r:D": D, "out:dh_prev": D})(e["r:D"] + _t(e["k"]) @ e["dvg"])),
        Op("K", "P = dvg S0^T: dk += P; rowsum(P K) (= rowsum(dvg U), U = K S0)", ("dvg", "h", "k", "r:dk"),
           ("r:dk", "redKu"),
           lambda e: (lambda P: {"r:dk": e["r:dk"] + P, "redKu": (P * e["k"]).sum(-1)})(e["dvg"] @ _t(e["h"]))),
        Op("A", "dL = -tril(X v_new^T); dG rows; columns from dL^T = -triu(v_new X^T); dLk, diag(beta) dLk",
           ("X", "vn", "Kg", "beta", "g"), ("dLk", "Bdlk", "r:rgA", "r:cgA"), _dl),
        Op("A", "M = dO v_new^T", ("do", "vn"), ("r:M",), lambda e: {"r:M": e["do"] @ _t(e["vn"])}),
        Op("A", "Z rows (M) and columns (M^T = v_new dO^T); sM = scale M * Gamma over Pg",
           ("r:M", "Pg", "g", "r:rgA", "r:cgA", "vn", "do"), ("sM", "r:rgA", "r:cgA"), _zm),
        Op("A", "dq = dog S0^T (formed again in stage 4); dG += rowsum(dq Q)", ("dog", "h", "q", "r:rgA"), ("r:rgA",),
           lambda e: {"r:rgA": e["r:rgA"] + ((e["dog"] @ _t(e["h"])) * e["q"]).sum(-1)}),
    ])
    # stage 4: A: dq += sM K; K: the dLk products and the rest of dk
    st.append([
        Op("A", "dq = dog S0^T + sM K (stored); partials", ("dog", "h", "sM", "k", "r:rgA", "r:cgA", "r:rbA"),
           ("out:dq", "redA"),
           lambda e: {"out:dq": e["dog"] @ _t(e["h"]) + e["sM"] @ e["k"],
                      "redA": torch.stack([e["r:rgA"], e["r:cgA"], e["r:rbA"]])}),
        Op("K", "dLk K; dbeta rows (into dbeta); dk += beta dLk K + (diag(beta) dLk)^T K + sM^T Q (stored)",
           ("dLk", "Bdlk", "sM", "k", "q", "beta", "r:dk"), ("out:dk", "gKb"), _dk_rest),
        Op("S", "partial <S0, D>", ("r:sc0",), ("redS",), lambda e: {"redS": e["r:sc0"]}),
        # read a stage before S updates dG in place: within S, a thread's stage-5 update of a row
        # must not precede another thread's read of it (global memory has no automatic sync)
        Op("S", "sum of K's r-term rows", ("gKr",), ("r:sc1",), lambda e: {"r:sc1": -e["gKr"].sum()}),
    ])
    # stage 5: one role sums the partials into dbeta and the dG row
    st.append([
        Op("S", "dbeta, dG (chunk-end terms at the last valid row)", ("redA", "redKu", "redS", "gKr", "gKb", "g", "r:sc1"),
           ("out:dbeta", "out:dG"), _final),
    ])
    return st


def _k_state(e):
    dk = e["r"][:, None] * (e["vn"] @ _t(e["Ds"]))
    s = (dk * e["k"]).sum(-1)
    nl = torch.arange(C) != e["last"]
    return {"r:dk": dk, "gKr": -torch.where(nl, s, torch.zeros_like(s))}


def _dl(e):
    dL = -torch.tril(e["X"] @ _t(e["vn"]), -1)
    bKg = e["beta"][:, None] * e["Kg"]
    dLt = -torch.triu(e["vn"] @ _t(e["X"]), 1)  # dL^T, its own product: column sums as row sums
    dLk = dL * e["Gs"]
    return {"dLk": dLk, "Bdlk": e["beta"][:, None] * dLk, "r:rgA": (dL * bKg).sum(-1), "r:cgA": -(dLt * _t(bKg)).sum(-1)}


def _zm(e):
    strict = torch.tril(torch.ones(C, C, dtype=torch.bool), -1)
    Z = torch.where(strict, e["r:M"] * e["Pg"], torch.zeros((), dtype=e["Pg"].dtype))  # scale M (Q K^T) Gamma
    Zt = torch.where(_t(strict), _t(e["r:M"]) * _t(e["Pg"]), torch.zeros((), dtype=e["Pg"].dtype))  # from M^T = v_new dO^T
    return {"r:rgA": e["r:rgA"] + Z.sum(-1), "r:cgA": e["r:cgA"] - Zt.sum(-1), "sM": e["scale"] * e["r:M"] * e["Gam"]}


def _dk_rest(e):
    t = e["dLk"] @ e["k"]
    dk = e["r:dk"] + e["beta"][:, None] * t + _t(e["Bdlk"]) @ e["k"] + _t(e["sM"]) @ e["q"]
    return {"out:dk": dk, "gKb": (t * e["k"]).sum(-1)}


def _final(e):
    rgA, cgA, rbA = e["redA"]
    dG = rgA + cgA + e["gKr"] + e["redKu"]
    at_last = e["gC"] * e["redS"] + e["r:sc1"]  # gKr holds -s_t for every row but the last valid one
    dG = torch.where(torch.arange(C) == e["last"], dG + at_last, dG)
    return {"out:dbeta": rbA + e["gKb"], "out:dG": dG}


SCHEDULE = _ops()


def check_schedule(schedule=None) -> dict:
    """Checks properties 1-5 of the module docstring; raises AssertionError naming the first
    violation. Returns {"smem": bytes (dynamic + static), "release": {loaded tile: last stage that
    reads it}, "stages": n}."""
    schedule = SCHEDULE if schedule is None else schedule
    written = {t: -1 for t in LOADED}  # tile -> stage of its last write
    owner = {"r:D": "S"}  # register -> role (D enters in S's registers)
    region_of = {t: r for t, (r, _) in TILES.items()}
    last_read = {}
    live = {}  # region -> tile currently held
    for t in LOADED:
        live[region_of[t]] = t
    # last read stage of every tile (for the alias check and the release report)
    for s, ops in enumerate(schedule):
        for op in ops:
            for x in op.reads:
                if not x.startswith("r:"):
                    last_read[x] = s
    for s, ops in enumerate(schedule):
        by_role_w, by_role_r = {}, {}
        for op in ops:
            for x in op.reads:
                if x.startswith("r:"):
                    assert x in owner, f"stage {s}: {op.what}: {x} read before written"
                    assert owner[x] == op.role, f"stage {s}: {op.role} reads {owner[x]}'s register {x}"
                else:
                    assert x in written, f"stage {s}: {op.what}: tile {x} read before it is written"
                    ws = written[x]
                    wrole = by_role_w.get(region_of[x])
                    assert ws < s or wrole == op.role, f"stage {s}: {op.what} reads {x} written this stage by {wrole}"
                    assert live.get(region_of[x]) == x, f"stage {s}: {op.what} reads {x} but region {region_of[x]} holds {live.get(region_of[x])}"
                    by_role_r.setdefault(region_of[x], set()).add(op.role)
            for x in op.writes:
                if x.startswith("r:"):
                    assert owner.setdefault(x, op.role) == op.role, f"{x} written by two roles"
                elif x.startswith("out:"):
                    continue
                else:
                    reg = region_of[x]
                    prev = live.get(reg)
                    if prev is not None and prev != x:
                        assert last_read.get(prev, -2) < s or (last_read.get(prev) == s and all(
                            o.role == op.role for o in ops if prev in o.reads)), \
                            f"stage {s}: {op.what} writes {x} over {prev} (region {reg}), still read at stage {last_read.get(prev)}"
                    other = by_role_r.get(reg, set()) - {op.role}
                    assert not other, f"stage {s}: {op.role} writes {x} while {other} read region {reg}"
                    assert by_role_w.setdefault(reg, op.role) == op.role, f"stage {s}: two roles write region {reg}"
                    live[reg] = x
                    written[x] = s
        # a region read by one role must not be written later in the same stage by another
        for op in ops:
            for x in op.writes:
                if not x.startswith(("r:", "out:")):
                    readers = {o.role for o in ops if any(region_of.get(y) == region_of[x] for y in o.reads if not y.startswith("r:"))}
                    assert readers <= {op.role}, f"stage {s}: region {region_of[x]} written by {op.role} and read by {readers - {op.role}}"
    regions = {}
    for r, b in TILES.values():
        regions[r] = max(regions.get(r, 0), b)
    smem = sum(regions.values()) + STATIC_SMEM
    assert smem <= SMEM_LIMIT, f"shared memory {smem} B over {SMEM_LIMIT}"
    # a loaded tile's region is free for the next chunk's copy after the last read of any tile in it
    release = {t: max(last_read.get(y, -1) for y, (r, _) in TILES.items() if r == region_of[t]) for t in LOADED}
    return {"smem": smem, "release": release, "stages": len(schedule)}


def run_chunk(q, k, v, beta, A_beta, g_cum, h, D, do, scale: float, *, last: int | None = None, log2: bool = False):
    """One chunk through `SCHEDULE` (shapes as `chunk_bwd_fused` without the leading [NC, HV]:
    q, k [C, K]; v, do [C, V]; beta, g_cum [C]; A_beta [C, C]; h, D [K, V]). Returns the dict of
    `chunk_bwd_fused` (dq, dk, dv, dbeta, dG, dh_prev)."""
    gamma, gC, r = gate_vectors(g_cum, log2=log2)
    env = dict(q=q, k=k, v=v, do=do, Ab=A_beta, h=h, g=g_cum, beta=beta, scale=scale, gamma=gamma, gC=gC, r=r,
               Gam=decay_mask(g_cum, log2=log2), Gs=decay_mask(g_cum, strict=True, log2=log2),
               last=C - 1 if last is None else int(last))
    env["r:D"] = D
    for ops in SCHEDULE:
        for op in ops:
            env.update(op.fn(env))
    return {n: env[f"out:{n}"] for n in ("dq", "dk", "dv", "dbeta", "dG", "dh_prev")}

"""flashqla.distributed on CPU: context parallelism across processes (torch.distributed, gloo) with
fp64 per-rank backends, against the single-process fp64 reference op.

One spawn per world size (2 and 3 ranks) runs every case; each rank passes its own token shard and
backpropagates a loss over its outputs and its rows of the final state. The parent compares the
concatenated outputs and token gradients, and the rank sums of final_state and d initial_state,
with `reference.chunk_gated_delta_rule` on the whole batch: o, final state, dq, dk, dv, dg, dbeta,
dh0 within 1e-12 relative RMS.

Two per-rank paths (`flashqla.distributed.op`):
- per-piece (backend: the fp64 reference op behind `FunctionBackend`, its calls counted): one forward
  over the pieces, the transition run of a continuing piece 0 in the forward and again in the
  backward (for D), ONE backward over all pieces;
- segmented (backend: `SegmentedBackend` over the fp64 launch-level `ReferenceCPBackend`, split
  forced at L = 64 or 128 tokens, so every rank with tokens cuts its pieces into several segments):
  one intra-device CP pass per rank, a continuing piece 0 as an open sequence. Its launches are
  counted per rank: prepare + 2 recurrent forward, 1 recurrent + 1 backward backward, each over all
  segment slots; a third recurrent launch, a second prepare or a second backward fails the case, and
  so does taking the per-piece path.
Cases: one long sequence (several segments per rank), varlen mixes with sequences crossing rank
boundaries, a sequence spanning every rank, boundaries on sequence ends, empty sequences (on a
boundary and at the end), empty shards (fewer tokens than ranks, an empty first or middle rank),
uneven shards through the op's own shard-length gather, initial state on/off, final state on/off,
g == 0 and g = -30 heads (every input has one of each; plus all-zero and all -30 gates), mild
gates, GVA, the in-op L2 norm, K != V. Three cases run the kernels' dtypes (bf16 q, k, v; fp32
states; budget 1e-2: bf16 rounding), two through a backend that checks the kernel backend's
contract for reusing the forward's saved products. Plan and argument checks run without processes.
"""

from __future__ import annotations

import datetime
import os
import tempfile

import pytest
import torch
import torch.multiprocessing as mp

import reference
from flashqla.distributed import (
    CPContext,
    FunctionBackend,
    KernelBackend,
    SegmentedBackend,
    build_cp_context,
    chunk_gated_delta_rule_cp,
    even_shard_lens,
    exchange_bytes,
    resolve_backend,
)
from flashqla.testing import make_gdn_inputs, rel_rms
from reference.gdn.cp import ReferenceCPBackend

TOL = 1e-12
K = V = 16

#: name -> inputs (make_gdn_inputs kwargs), flags, and per world size shard_lens (None: even split)
CASES = {
    "one_sequence": dict(inp=dict(T=150, H=1, HV=2)),
    "varlen_crossing": dict(inp=dict(T=160, H=1, HV=2, seqlens=[30, 0, 45, 1, 64, 20])),
    "spans_every_rank": dict(inp=dict(T=180, H=1, HV=2, seqlens=[10, 150, 20])),
    "no_h0_no_final": dict(inp=dict(T=160, H=1, HV=2, seqlens=[70, 90], initial_state=False), final=False),
    "h0_no_final": dict(inp=dict(T=160, H=1, HV=2, seqlens=[100, 60]), final=False),
    "final_no_h0": dict(inp=dict(T=130, H=1, HV=2, initial_state=False)),
    "fewer_tokens_than_ranks": dict(inp=dict(T=2, H=1, HV=2, seqlens=[1, 1])),
    "one_token": dict(inp=dict(T=1, H=1, HV=2)),
    "empty_middle_shard": dict(inp=dict(T=100, H=1, HV=2), shards={2: [0, 100], 3: [50, 0, 50]}),
    "uneven_gathered": dict(inp=dict(T=101, H=1, HV=2, seqlens=[20, 60, 21]), shards={2: [37, 64], 3: [64, 1, 36]},
                            path="gather"),
    "boundaries_on_ends": dict(inp=dict(T=120, H=1, HV=2, seqlens=[60, 60]), shards={3: [40, 20, 60]}),
    "empty_sequences_on_boundary": dict(inp=dict(T=100, H=1, HV=2, seqlens=[50, 0, 50, 0])),
    "gva_mild_gates": dict(inp=dict(T=200, H=2, HV=4, gate="logsigmoid", seqlens=[130, 70])),
    "strong_decay_everywhere": dict(inp=dict(T=90, H=1, HV=2, gate=-30.0, special_heads=False)),
    "zero_gate_everywhere": dict(inp=dict(T=90, H=1, HV=2, gate="zero", special_heads=False)),
    "l2norm_in_op": dict(inp=dict(T=120, H=1, HV=2, seqlens=[33, 87]), l2norm=True),
    "one_sequence_no_cu": dict(inp=dict(T=97, H=1, HV=2), path="no_cu"),
    "k_wider_than_v": dict(inp=dict(T=150, H=1, HV=2, K=24, V=16, seqlens=[20, 130])),
    # the kernels' dtypes (bf16 q, k, v; fp32 g, beta, states) through a backend that hands out saved
    # products as the kernel backend does and checks they come back only for the same pieces
    "bf16_saved_products": dict(inp=dict(T=300, H=1, HV=2, seqlens=[40, 200, 60]), shards={2: [120, 180], 3: [100, 100, 100]},
                                dtype=torch.bfloat16, backend="checking", tol=1e-2),
    "bf16_one_sequence": dict(inp=dict(T=200, H=1, HV=2), dtype=torch.bfloat16, backend="checking", tol=1e-2),
    # the segmented path (backend "segmented": `SegmentedBackend` over the fp64 launch-level reference
    # `ReferenceCPBackend`, forced split, L = 64): every rank's pieces in one intra-device CP pass, a
    # continuing piece 0 as an open sequence; launches counted per rank
    "seg_one_long_sequence": dict(inp=dict(T=700, H=1, HV=2), backend="segmented"),
    "seg_one_long_sequence_no_h0": dict(inp=dict(T=641, H=1, HV=2, initial_state=False), backend="segmented"),
    "seg_varlen_crossing": dict(inp=dict(T=701, H=1, HV=2, seqlens=[130, 0, 300, 1, 200, 70]), backend="segmented"),
    "seg_spans_every_rank": dict(inp=dict(T=630, H=1, HV=2, seqlens=[10, 600, 20]), backend="segmented"),
    "seg_empty_shards": dict(inp=dict(T=300, H=1, HV=2, seqlens=[100, 200]), shards={2: [0, 300], 3: [150, 0, 150]},
                             backend="segmented"),
    "seg_fewer_tokens_than_ranks": dict(inp=dict(T=2, H=1, HV=2, seqlens=[1, 1]), backend="segmented"),
    "seg_zero_gates": dict(inp=dict(T=500, H=1, HV=2, gate="zero", special_heads=False), backend="segmented"),
    "seg_strong_decay": dict(inp=dict(T=500, H=1, HV=2, gate=-30.0, special_heads=False), backend="segmented"),
    "seg_no_h0_no_final": dict(inp=dict(T=520, H=1, HV=2, seqlens=[300, 220], initial_state=False), final=False,
                               backend="segmented"),
    "seg_h0_no_final": dict(inp=dict(T=520, H=1, HV=2, seqlens=[200, 320]), final=False, backend="segmented"),
    "seg_uneven_gathered": dict(inp=dict(T=600, H=1, HV=2, seqlens=[50, 400, 150]), shards={2: [150, 450], 3: [64, 300, 236]},
                                path="gather", backend="segmented"),
    "seg_boundaries_on_ends": dict(inp=dict(T=384, H=1, HV=2, seqlens=[128, 256]), shards={2: [128, 256], 3: [128, 128, 128]},
                                   backend="segmented", L=128),
    "seg_gva_k_wider_than_v": dict(inp=dict(T=450, H=2, HV=4, K=24, V=16, gate="logsigmoid", seqlens=[70, 380]),
                                   backend="segmented"),
    "seg_l2norm_no_cu": dict(inp=dict(T=333, H=1, HV=2), l2norm=True, path="no_cu", backend="segmented", L=128),
    "seg_bf16_states_fp32": dict(inp=dict(T=600, H=1, HV=2, seqlens=[250, 350]), dtype=torch.bfloat16, backend="segmented",
                                 tol=1e-2),
}
WORLDS = (2, 3)


def _case_inputs(name: str) -> dict:
    spec = CASES[name]
    inp = dict(dict(K=K, V=V), **spec["inp"])
    x = make_gdn_inputs(B=1, dtype=torch.float64, seed=list(CASES).index(name), **inp)
    if x["cu_seqlens"] is None:
        x["cu_seqlens"] = torch.tensor([0, x["q"].shape[1]], dtype=torch.int64)
    if spec.get("dtype") == torch.bfloat16:  # q, k, v hold bf16 values; the reference reads them in fp64
        for n in ("q", "k", "v"):
            x[n] = x[n].to(torch.bfloat16).double()
    if spec.get("l2norm"):
        x["q"] = x["q"] * 3.0
        x["k"] = x["k"] * 0.5
    gen = torch.Generator().manual_seed(7)
    N = x["cu_seqlens"].numel() - 1
    x["w_o"] = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    x["w_h"] = torch.randn(N, x["v"].shape[2], x["k"].shape[3], x["v"].shape[3], generator=gen, dtype=torch.float64)
    return x


def _leaves(x: dict) -> dict:
    out = {n: x[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "g", "beta")}
    out["initial_state"] = None if x["initial_state"] is None else x["initial_state"].detach().clone().requires_grad_(True)
    return out


def _reference(name: str) -> dict:
    spec, x = CASES[name], _case_inputs(name)
    final = spec.get("final", True)
    L = _leaves(x)
    o, ht = reference.chunk_gated_delta_rule(L["q"], L["k"], L["v"], L["g"], L["beta"], initial_state=L["initial_state"],
                                             output_final_state=final, cu_seqlens=x["cu_seqlens"],
                                             use_qk_l2norm_in_kernel=bool(spec.get("l2norm")))
    loss = (o * x["w_o"]).sum() + ((ht * x["w_h"]).sum() if final else 0.0)
    loss.backward()
    out = dict(o=o.detach(), final=None if ht is None else ht.detach())
    out.update({f"d{n}": L[n].grad for n in ("q", "k", "v", "g", "beta")})
    out["dh0"] = None if L["initial_state"] is None else L["initial_state"].grad
    return out


class CountingBackend(FunctionBackend):
    """The fp64 reference op, counting its calls: forward runs (value width, tokens) and backward
    runs (tokens), so that a case can check which launches the op made."""

    def __init__(self):
        super().__init__(reference.chunk_gated_delta_rule)
        self.forwards, self.backwards = [], []

    def forward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens):
        self.forwards.append((v.shape[3], q.shape[1]))
        return super().forward(q, k, v, g, beta, scale, initial_state, cu_seqlens)

    def backward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, saved):
        self.backwards.append(q.shape[1])
        return super().backward(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, saved)


class CheckingBackend(CountingBackend):
    """The fp64 reference behind the kernel backend's contract: the forward hands out `saved`
    products tied to its (k, g, beta, cu_seqlens), and a backward given them must be for the same."""

    def __init__(self):
        super().__init__()
        self.reused = 0

    def forward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens):
        o, ht, _ = super().forward(q, k, v, g, beta, scale, initial_state, cu_seqlens)
        assert o.dtype == q.dtype and cu_seqlens.dtype == torch.int32
        return o, ht, (k.clone(), g.clone(), beta.clone(), cu_seqlens.clone())

    def backward(self, q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, saved):
        if saved is not None:
            k0, g0, b0, cu0 = saved
            assert torch.equal(k0, k) and torch.equal(g0, g) and torch.equal(b0, beta) and torch.equal(cu0, cu_seqlens)
            self.reused += 1
        return super().backward(q, k, v, g, beta, scale, initial_state, cu_seqlens, do, dht, None)


def _segmented(spec: dict):
    """The segmented backend of a case: the driver over the fp64 (or, for bf16 inputs, fp32-state)
    launch-level reference, split forced at L tokens."""
    sd = torch.float32 if spec.get("dtype") == torch.bfloat16 else torch.float64
    return SegmentedBackend(ReferenceCPBackend(state_dtype=sd), cp="on", segment_len=spec.get("L", 64))


def _check_segment_launches(be: SegmentedBackend, ctx: CPContext, n_fwd: int, L: int) -> None:
    """The segmented path's launches on one rank: prepare and two recurrent launches (run, transition)
    in the forward, one recurrent launch (transition, for U) and ONE backward in the backward, every
    one over all M = floor(T_r / L) + n slots; none on an empty shard. A continuing piece 0 adds no
    launch: a third recurrent launch, a second prepare or a second backward fails here."""
    launches = be.cp_backend.launches
    if ctx.num_pieces == 0:
        assert launches == [], launches
        return
    M = ctx.local_len // L + ctx.num_pieces
    assert launches[:n_fwd] == [("prepare", M), ("recurrent", M), ("recurrent", M)], launches
    assert launches[n_fwd:] == [("recurrent", M), ("bwd", M)], launches


def _check_piece_calls(be: CountingBackend, ctx: CPContext) -> None:
    """The per-piece path's calls on one rank: one forward over the pieces, the transition run of a
    continuing piece 0 (v = 0, value width K) in the forward and again in the backward (for D), and
    ONE backward over all pieces (no second backward over a continuing last piece)."""
    n, T0 = ctx.num_pieces, ctx.local_offsets[1] if ctx.num_pieces else 0
    assert len(be.backwards) == (1 if n else 0), be.backwards
    assert be.backwards == [ctx.local_len] * len(be.backwards)
    main = [ctx.local_len] if n else []
    trans = [T0] if ctx.first_continues else []
    assert [t for _, t in be.forwards] == main + trans + trans, (be.forwards, main, trans)


def _rank_run(name: str, W: int, rank: int) -> dict:
    """One rank's part of a case (inside an initialised gloo group)."""
    spec, x = CASES[name], _case_inputs(name)
    final = spec.get("final", True)
    shard_lens = spec.get("shards", {}).get(W)
    lens = list(shard_lens) if shard_lens is not None else list(even_shard_lens(x["q"].shape[1], W))
    lo, hi = sum(lens[:rank]), sum(lens[: rank + 1])
    local = {n: (x[n][:, lo:hi] if n in ("q", "k", "v", "g", "beta") else x[n]) for n in ("q", "k", "v", "g", "beta", "initial_state")}
    if spec.get("dtype") == torch.bfloat16:
        local = {n: (None if t is None else t.to(torch.bfloat16 if n in ("q", "k", "v") else torch.float32)) for n, t in local.items()}
    L = _leaves(local)
    backend = dict(checking=CheckingBackend, segmented=lambda: _segmented(spec)).get(spec.get("backend"), CountingBackend)()
    kw = dict(initial_state=L["initial_state"], output_final_state=final, use_qk_l2norm_in_kernel=bool(spec.get("l2norm")),
              backend=backend)
    path = spec.get("path", "context")
    ctx = build_cp_context(x["cu_seqlens"], shard_lens=lens)  # the plan the op follows (also without a context)
    assert (ctx.start, ctx.end) == (lo, hi)
    if path == "context":
        kw["cp_context"] = build_cp_context(x["cu_seqlens"], shard_lens=shard_lens)
    elif path == "gather":
        kw["cu_seqlens"] = x["cu_seqlens"]  # the op gathers every rank's shard length itself
    else:
        assert path == "no_cu"  # one sequence, T from the gathered shard lengths
    o, ht = chunk_gated_delta_rule_cp(L["q"], L["k"], L["v"], L["g"], L["beta"], **kw)
    n_fwd = len(backend.cp_backend.launches) if isinstance(backend, SegmentedBackend) else None
    loss = (o.double() * x["w_o"][:, lo:hi]).sum() + ((ht.double() * x["w_h"]).sum() if final else 0.0)
    loss.backward()
    if isinstance(backend, CheckingBackend):
        assert backend.reused, "no saved products were reused"
    if isinstance(backend, SegmentedBackend):
        _check_segment_launches(backend, ctx, n_fwd, spec.get("L", 64))
    else:
        _check_piece_calls(backend, ctx)
    out = dict(o=o.detach(), final=None if ht is None else ht.detach())
    out.update({f"d{n}": L[n].grad for n in ("q", "k", "v", "g", "beta")})
    out["dh0"] = None if L["initial_state"] is None else L["initial_state"].grad
    return out


def _worker(rank: int, W: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=W,
                            timeout=datetime.timedelta(seconds=60))
    try:
        results = {name: _rank_run(name, W, rank) for name in CASES}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
    finally:
        dist.destroy_process_group()


_RESULTS: dict = {}


def _results(W: int) -> list:
    if W not in _RESULTS:
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(W, os.path.join(tmp, "init"), tmp), nprocs=W, join=True)
            _RESULTS[W] = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(W)]
    return _RESULTS[W]


_REFS: dict = {}


def _ref(name: str) -> dict:
    if name not in _REFS:
        _REFS[name] = _reference(name)
    return _REFS[name]


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("W", WORLDS)
def test_matches_single_process_reference(W, name):
    ranks = [res[name] for res in _results(W)]
    ref = _ref(name)
    got = {q: torch.cat([r[q] for r in ranks], dim=1) for q in ("o", "dq", "dk", "dv", "dg", "dbeta")}
    if ref["final"] is not None:
        got["final"] = sum(r["final"] for r in ranks)
        nonzero = torch.stack([r["final"].flatten(1).abs().amax(1) > 0 for r in ranks]).sum(0)
        assert int(nonzero.max()) <= 1, "a final-state row is filled on more than one rank"
    if ref["dh0"] is not None:
        got["dh0"] = sum(r["dh0"] for r in ranks)
    errors = {}
    for q, x in got.items():
        if float(ref[q].norm()) == 0.0:
            assert float(x.norm()) == 0.0, f"{q}: reference is zero, CP is not"
            continue
        errors[q] = rel_rms(x, ref[q])
    tol = CASES[name].get("tol", TOL)
    bad = {q: e for q, e in errors.items() if not e <= tol}
    assert not bad, f"W={W} {name}: relative RMS above {tol:g}: {bad} (all: {errors})"
    if CASES[name].get("backend") == "checking":  # the kernels' output dtypes
        assert got["o"].dtype == got["dq"].dtype == torch.bfloat16 and got["dg"].dtype == torch.float32


# ------------------------------------------------------------------------------------------------
# the plan (no processes)
# ------------------------------------------------------------------------------------------------


def _plans(cu, W, shard_lens=None):
    return [build_cp_context(cu, rank=r, world_size=W, shard_lens=shard_lens) for r in range(W)]


@pytest.mark.parametrize("cu,W,shards", [
    ([0, 30, 30, 45, 46, 110, 130], 3, None),
    ([0, 10, 160, 180], 3, None),
    ([0, 1, 2], 5, None),
    ([0, 100], 3, [50, 0, 50]),
    ([0, 50, 50, 100, 100], 2, None),
    ([0, 0, 0], 2, None),
])
def test_plan_tiles_and_owns_each_row_once(cu, W, shards):
    plans = _plans(cu, W, shards)
    N = len(cu) - 1
    assert [p.start for p in plans] == [sum(plans[0].shard_lens[:r]) for r in range(W)]
    assert plans[-1].end == cu[-1]
    starts, finals = [0] * N, [0] * N
    for p in plans:
        assert p.local_offsets[0] == 0 and p.local_offsets[-1] == p.local_len
        assert len(p.local_offsets) == p.num_pieces + 1
        for j, n in enumerate(p.piece_seqs):
            lo, hi = p.local_offsets[j] + p.start, p.local_offsets[j + 1] + p.start
            assert cu[n] <= lo < hi <= cu[n + 1]
            starts[n] += lo == cu[n]
            finals[n] += hi == cu[n + 1]
        for n in p.empty_seqs:
            starts[n] += 1
            finals[n] += 1
        if p.first_continues:
            assert plans[p.start_rank].last_continues and p.start_rank < p.rank
        if p.last_continues:
            assert plans[p.end_rank].first_continues and p.end_rank > p.rank
            for r in range(p.rank + 1, p.end_rank):  # ranks in between lie inside the sequence (or are empty)
                q = plans[r]
                assert q.num_pieces == 0 or (q.num_pieces == 1 and q.first_continues and q.last_continues)
    assert starts == [1] * N and finals == [1] * N


def test_even_shard_lens():
    assert even_shard_lens(10, 3) == (4, 3, 3)
    assert even_shard_lens(2, 4) == (1, 1, 0, 0)
    assert even_shard_lens(0, 2) == (0, 0)


def test_context_shard_and_local_offsets():
    ctx = build_cp_context(torch.tensor([0, 30, 100], dtype=torch.int32), rank=1, world_size=2)
    assert (ctx.start, ctx.end, ctx.piece_seqs, ctx.local_offsets) == (50, 100, (1,), (0, 50))
    assert ctx.first_continues and not ctx.last_continues and ctx.start_rank == 0
    x = torch.arange(100).view(1, 100)
    assert torch.equal(ctx.shard(x), x[:, 50:])
    assert torch.equal(ctx.local_cu_seqlens, torch.tensor([0, 50]))


def test_exchange_is_state_sized():
    b = exchange_bytes(HV=32, K=128, V=128, world_size=2)
    assert b["fwd_send"] == 32 * 128 * 256 * 4 and b["bwd_send"] == 32 * 128 * 128 * 4
    assert b["fwd_recv"] == 2 * b["fwd_send"]


def test_single_rank_context_runs_without_a_group():
    x = make_gdn_inputs(T=90, H=1, HV=2, K=K, V=V, seqlens=[40, 0, 50])
    ctx = build_cp_context(x["cu_seqlens"], rank=0, world_size=1)
    o, ht = chunk_gated_delta_rule_cp(x["q"], x["k"], x["v"], x["g"], x["beta"], initial_state=x["initial_state"],
                                      output_final_state=True, cp_context=ctx, backend=reference.chunk_gated_delta_rule)
    ro, rht = reference.chunk_gated_delta_rule(**x, output_final_state=True)
    assert rel_rms(o, ro) <= TOL and rel_rms(ht, rht) <= TOL


# ------------------------------------------------------------------------------------------------
# argument checks (no processes: they raise before any collective)
# ------------------------------------------------------------------------------------------------


def _shard_args(T_local=50, H=1, HV=2, B=1):
    x = make_gdn_inputs(B=B, T=T_local, H=H, HV=HV, K=K, V=V, initial_state=False)
    return [x[n] for n in ("q", "k", "v", "g", "beta")]


REF = reference.chunk_gated_delta_rule


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(cu_seqlens=torch.tensor([0, 100])), ValueError, "cu_seqlens must be None when cp_context"),
    (dict(group=object()), ValueError, "cp_context or group"),
    (dict(initial_state=torch.zeros(2, 2, K, V, dtype=torch.float64)), ValueError, "initial_state must be the global"),
    (dict(backend=None), ValueError, "backend"),
    (dict(backend="triton"), ValueError, "backend: unknown name"),
    (dict(backend=3), TypeError, "backend must be"),
    (dict(use_qk_l2norm_in_kernel=1), TypeError, "use_qk_l2norm_in_kernel"),
])
def test_op_argument_errors(kwargs, exc, match):
    ctx = build_cp_context(torch.tensor([0, 100]), rank=0, world_size=2)
    kw = dict(backend=REF, cp_context=ctx)
    kw.update(kwargs)
    with pytest.raises(exc, match=match):
        chunk_gated_delta_rule_cp(*_shard_args(), **kw)


def test_op_rejects_a_shard_of_the_wrong_length():
    ctx = build_cp_context(torch.tensor([0, 101]), rank=1, world_size=2)  # rank 1 holds [51, 101): 50 tokens
    chunk_args = _shard_args(T_local=51)
    with pytest.raises(ValueError, match=r"q holds T = 51 tokens but this rank's shard .* \[51, 101\)"):
        chunk_gated_delta_rule_cp(*chunk_args, cp_context=ctx, backend=REF)


def test_op_rejects_batch_rows():
    ctx = build_cp_context(torch.tensor([0, 100]), rank=0, world_size=2)
    with pytest.raises(ValueError, match="B == 1"):
        chunk_gated_delta_rule_cp(*_shard_args(B=2), cp_context=ctx, backend=REF)


def test_op_needs_a_group_on_several_ranks():
    ctx = build_cp_context(torch.tensor([0, 100]), rank=0, world_size=2)
    with pytest.raises(RuntimeError, match="without a process group"):
        chunk_gated_delta_rule_cp(*_shard_args(), cp_context=ctx, backend=REF)


def test_op_without_context_needs_torch_distributed():
    import torch.distributed as dist

    if dist.is_initialized():
        pytest.skip("a process group is initialised in this process")
    with pytest.raises(RuntimeError, match="not initialized"):
        chunk_gated_delta_rule_cp(*_shard_args(), cu_seqlens=torch.tensor([0, 100]), backend=REF)


def test_op_rejects_a_foreign_context():
    with pytest.raises(TypeError, match="cp_context must be a CPContext"):
        chunk_gated_delta_rule_cp(*_shard_args(), cp_context=dict(rank=0), backend=REF)


@pytest.mark.parametrize("kwargs,exc,match", [
    (dict(cu_seqlens=torch.tensor([1, 100]), rank=0, world_size=2), ValueError, "start at 0"),
    (dict(cu_seqlens=torch.tensor([0, 60, 50, 100]), rank=0, world_size=2), ValueError, "non-decreasing"),
    (dict(cu_seqlens=torch.tensor([0.0, 100.0]), rank=0, world_size=2), TypeError, "int32 or int64"),
    (dict(cu_seqlens=torch.tensor([0, 100]), rank=0, world_size=2, shard_lens=[50, 40]), ValueError, "sum to 90"),
    (dict(cu_seqlens=torch.tensor([0, 100]), rank=0, world_size=2, shard_lens=[100]), ValueError, "one length per rank"),
    (dict(cu_seqlens=torch.tensor([0, 100]), rank=0, world_size=2, shard_lens=[-1, 101]), ValueError, r"shard_lens\[0\]"),
    (dict(cu_seqlens=torch.tensor([0, 100]), rank=0, world_size=2, shard_lens=[50, 50], local_len=50), ValueError, "not both"),
    (dict(cu_seqlens=torch.tensor([0, 100]), rank=0, world_size=2, local_len=50), ValueError, "needs a process group"),
    (dict(cu_seqlens=None, rank=0, world_size=2), ValueError, "cu_seqlens is None"),
    (dict(cu_seqlens=torch.tensor([0, 100]), rank=2, world_size=2), ValueError, "rank must be in"),
    (dict(cu_seqlens=torch.tensor([0, 100]), rank=0), ValueError, "together"),
    (dict(cu_seqlens="0,100", rank=0, world_size=2), TypeError, "cu_seqlens must be"),
])
def test_context_argument_errors(kwargs, exc, match):
    cu = kwargs.pop("cu_seqlens")
    with pytest.raises(exc, match=match):
        build_cp_context(cu, **kwargs)


def test_backend_resolution(monkeypatch):
    monkeypatch.delenv("FLASHQLA_CP", raising=False)
    q = torch.zeros(1)
    assert isinstance(resolve_backend(REF, q), FunctionBackend)
    assert isinstance(resolve_backend("kernels", q), KernelBackend)
    # the kernels' own intra-device CP per rank: default "auto" (or $FLASHQLA_CP), validated
    assert resolve_backend("kernels", q).cp == "auto" and KernelBackend().cp == "auto"
    assert KernelBackend(cp="off").cp == "off" and KernelBackend(cp="on").cp == "on"
    monkeypatch.setenv("FLASHQLA_CP", "off")
    assert resolve_backend("kernels", q).cp == "off" and KernelBackend(None).cp == "off"
    with pytest.raises(ValueError, match="cp must be"):
        KernelBackend(cp="sometimes")


def test_segmented_backend_plans():
    """`segment_plan`: None with cp="off" or when the planner keeps the pieces whole, a split plan
    when forced; segment_len validated; the state dtype is the launch-level backend's."""
    q = torch.zeros(1, 4096, 2, 128, dtype=torch.bfloat16, device="meta")
    v = torch.zeros(1, 4096, 8, 128, dtype=torch.bfloat16, device="meta")
    cu = torch.zeros(2, dtype=torch.int32, device="meta")
    ref = ReferenceCPBackend()
    assert SegmentedBackend(ref, cp="off").segment_plan(q, v, cu, 4096) is None
    plan = SegmentedBackend(ref, cp="on", segment_len=512).segment_plan(q, v, cu, 4096)
    assert plan.split and plan.segment_len == 512
    assert KernelBackend(cp="auto", sm_count=132).segment_plan(q[:, :64], v[:, :64], cu, 64) is None  # one chunk
    assert SegmentedBackend(ref, cp="on", segment_len=64).segment_plan(q[..., :16], v[..., :16], cu, 4096).segment_len == 64
    assert SegmentedBackend(ref, cp="auto").segment_plan(q[..., :16], v[..., :16], cu, 4096) is None  # V = 16: not costed
    assert SegmentedBackend(ref).state_dtype(q, None, None, None) == torch.float64
    for bad in (100, 0, -64, True):
        with pytest.raises(ValueError, match="segment_len"):
            SegmentedBackend(ref, segment_len=bad)
    be = FunctionBackend(REF)
    assert resolve_backend(be, q) is be
    assert isinstance(build_cp_context([0, 4], rank=0, world_size=1), CPContext)


def test_import_does_not_load_tilelang():
    import subprocess
    import sys

    out = subprocess.run([sys.executable, "-c", "import flashqla.distributed, sys; print('tilelang' in sys.modules)"],
                         capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"

"""multigpu tier: `flashqla.distributed.chunk_gated_delta_rule_cp` over 2 GPUs (NCCL, sm_90 kernels)
against the single-GPU op `flashqla.chunk_gated_delta_rule` on the whole batch and against the fp64
reference (`reference.chunk_gated_delta_rule` on CPU, same bf16-rounded inputs), with the kernel
backend in each intra-device mode: `KernelBackend(cp="auto")` (the default), `cp="on"` with 512-token
segments (every rank with tokens takes the segmented path: its pieces as one intra-device CP pass, a
continuing first piece as an open sequence; its sm_90 launches are counted and must be prepare + 2
recurrent forward, 1 recurrent + 1 backward backward) and `cp="off"` (the per-piece path: never the
segmented one, every forward launch pair an unsplit prepare + recurrent).

One spawn of 2 ranks runs every case in every mode; each rank passes its own shard and backpropagates
a loss over its outputs and final-state rows. The parent compares the concatenated outputs and token gradients
and the rank sums of final_state and d initial_state: relative RMS within the budgets of
`tests/gpu/test_autograd_gpu.py` (o, final state 1e-2; dq, dk, dv, dbeta, dh0 2e-2; dg 3e-2), both
against the single-GPU op and against fp64. Cases: one sequence with an odd split, a varlen mix
crossing the boundary (empty and 1-token sequences), uneven shards through the op's length gather, an
empty first shard, fewer tokens than ranks, no initial / final state, a boundary on a sequence end;
every input has a g == 0 head and a g = -30 head.

Run on a machine with >= 2 Hopper GPUs (NCCL_NVLS_ENABLE=0; tests/gpu/... from the repository root):
    python -m pytest tests/gpu/test_multigpu.py -m multigpu -q -rA
"""

from __future__ import annotations

import os

os.environ.setdefault("NCCL_NVLS_ENABLE", "0")  # NVLink multicast stays off (before any NCCL init)

import datetime  # noqa: E402
import tempfile  # noqa: E402

import pytest  # noqa: E402
import torch  # noqa: E402

from flashqla.testing import make_gdn_inputs, rel_rms  # noqa: E402

pytestmark = pytest.mark.multigpu

WORLD = 2
_HOPPERS = torch.cuda.is_available() and torch.cuda.device_count() >= WORLD and all(
    torch.cuda.get_device_capability(i) == (9, 0) for i in range(WORLD)
)
if not _HOPPERS:
    pytest.skip(f"needs {WORLD} CUDA GPUs of compute capability 9.0 (Hopper)", allow_module_level=True)

import torch.multiprocessing as mp  # noqa: E402

import flashqla  # noqa: E402
import reference  # noqa: E402
from flashqla.distributed import KernelBackend, build_cp_context, chunk_gated_delta_rule_cp, even_shard_lens  # noqa: E402

BUDGET = {"o": 1e-2, "final": 1e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "dg": 3e-2, "dbeta": 2e-2, "dh0": 2e-2}
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
#: intra-device mode of the kernel backend per rank -> KernelBackend keyword arguments
MODES = {"auto": dict(cp="auto"), "on": dict(cp="on", segment_len=512), "off": dict(cp="off")}


class _CountingLaunches:
    """The sm_90 launches (`flashqla.ops.gdn.backend.Sm90Backend`, without the dual launch), recording
    the kind of each launch, so that a case can tell which path ran."""

    def __init__(self):
        from flashqla.ops.gdn.backend import Sm90Backend

        self.inner = Sm90Backend()
        self.state_dtype = self.inner.state_dtype
        self.launches = []

    def warm(self, *args, **kw):
        return self.inner.warm(*args, **kw)

    def zeros(self, *args):
        return self.inner.zeros(*args)

    def prepare(self, *args, **kw):
        self.launches.append("prepare")
        return self.inner.prepare(*args, **kw)

    def recurrent(self, *args, **kw):
        self.launches.append("recurrent")
        return self.inner.recurrent(*args, **kw)

    def bwd(self, *args, **kw):
        self.launches.append("bwd")
        return self.inner.bwd(*args, **kw)

CASES = {
    "one_sequence_odd_split": dict(inp=dict(T=3001)),
    "varlen_crossing": dict(inp=dict(T=4096, seqlens=[1000, 0, 3000, 1, 95])),
    "uneven_gathered": dict(inp=dict(T=3000, seqlens=[700, 2300]), shards=[1000, 2000], path="gather"),
    "empty_first_shard": dict(inp=dict(T=1500), shards=[0, 1500]),
    "fewer_tokens_than_ranks": dict(inp=dict(T=1)),
    "no_h0_no_final": dict(inp=dict(T=4000, seqlens=[2500, 1500], initial_state=False), final=False),
    "boundary_on_end": dict(inp=dict(T=4096, seqlens=[2048, 2048])),
}


def _inputs(name: str) -> dict:
    """fp64 inputs on CPU whose q, k, v are exactly bf16 values (both sides start from the same
    numbers), loss weights, global cu_seqlens (int32)."""
    spec = CASES[name]
    x = make_gdn_inputs(B=1, H=2, HV=4, K=128, V=128, seed=100 + list(CASES).index(name), **spec["inp"])
    for n in ("q", "k", "v"):
        x[n] = x[n].to(torch.bfloat16).double()
    if x["cu_seqlens"] is None:
        x["cu_seqlens"] = torch.tensor([0, x["q"].shape[1]], dtype=torch.int32)
    x["cu_seqlens"] = x["cu_seqlens"].to(torch.int32)
    gen = torch.Generator().manual_seed(7)
    N = x["cu_seqlens"].numel() - 1
    x["w_o"] = torch.randn(x["v"].shape, generator=gen, dtype=torch.float64)
    x["w_h"] = torch.randn(N, 4, 128, 128, generator=gen, dtype=torch.float64)
    return x


def _leaves(x: dict, device, lo=None, hi=None) -> dict:
    out = {}
    for n in NAMES:
        t = x[n]
        if t is None:
            out[n] = None
            continue
        if n != "initial_state" and lo is not None:
            t = t[:, lo:hi]
        if device == "cpu":
            t = t.to(torch.float64)
        else:
            t = t.to(device, torch.bfloat16 if n in ("q", "k", "v") else torch.float32)
        out[n] = t.detach().contiguous().clone().requires_grad_(True)
    return out


def _collect(o, ht, L) -> dict:
    out = dict(o=o.detach().cpu(), final=None if ht is None else ht.detach().cpu())
    for n in NAMES:
        key = "dh0" if n == "initial_state" else f"d{n}"
        out[key] = None if L[n] is None else L[n].grad.detach().cpu()
    return out


def _whole(name: str, fn, device) -> dict:
    """The single-process run: fn = flashqla.chunk_gated_delta_rule on one GPU, or the fp64 reference."""
    x, final = _inputs(name), CASES[name].get("final", True)
    L = _leaves(x, device)
    o, ht = fn(L["q"], L["k"], L["v"], L["g"], L["beta"], initial_state=L["initial_state"], output_final_state=final,
               cu_seqlens=x["cu_seqlens"].to(device))
    loss = (o.double() * x["w_o"].to(device)).sum() + ((ht.double() * x["w_h"].to(device)).sum() if final else 0.0)
    loss.backward()
    return _collect(o, ht, L)


def _rank_run(name: str, rank: int, mode: str) -> dict:
    spec, x = CASES[name], _inputs(name)
    final = spec.get("final", True)
    lens = spec.get("shards") or list(even_shard_lens(x["q"].shape[1], WORLD))
    lo, hi = sum(lens[:rank]), sum(lens[: rank + 1])
    dev = torch.device("cuda", rank)
    L = _leaves(x, dev, lo, hi)
    be = KernelBackend(**MODES[mode])
    be._cp_backend = counter = _CountingLaunches()
    kw = dict(initial_state=L["initial_state"], output_final_state=final, backend=be)
    ctx = build_cp_context(x["cu_seqlens"], shard_lens=lens)
    if spec.get("path") == "gather":
        kw["cu_seqlens"] = x["cu_seqlens"].to(dev)
    else:
        kw["cp_context"] = build_cp_context(x["cu_seqlens"], shard_lens=spec.get("shards"))
    from flashqla.distributed import op as dist_op

    segmented = []  # calls of the segmented path's forward (`cp_forward_open`)
    real_open = dist_op.cp_forward_open
    dist_op.cp_forward_open = lambda *a, **k: segmented.append(1) or real_open(*a, **k)
    try:
        o, ht = chunk_gated_delta_rule_cp(L["q"], L["k"], L["v"], L["g"], L["beta"], **kw)
    finally:
        dist_op.cp_forward_open = real_open
    n_fwd = len(counter.launches)
    loss = (o.double() * x["w_o"][:, lo:hi].to(dev)).sum() + ((ht.double() * x["w_h"].to(dev)).sum() if final else 0.0)
    loss.backward()
    torch.cuda.synchronize(dev)
    out = _collect(o, ht, L)
    out["segmented"] = bool(segmented)
    out["launches_ok"] = True
    if mode == "on" and ctx.num_pieces:  # the segmented path, no extra launch for a continuing piece
        out["launches_ok"] = (counter.launches[:n_fwd] == ["prepare", "recurrent", "recurrent"]
                              and counter.launches[n_fwd:] == ["recurrent", "bwd"])
    if mode == "off":  # the per-piece path: unsplit forwards through the backend, never the segmented one
        out["launches_ok"] = not segmented and n_fwd % 2 == 0 and counter.launches[:n_fwd] == ["prepare", "recurrent"] * (n_fwd // 2)
    out["launches"] = list(counter.launches)
    return out


def _worker(rank: int, init_file: str, out_dir: str) -> None:
    import torch.distributed as dist

    os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
    torch.cuda.set_device(rank)
    dist.init_process_group("nccl", init_method=f"file://{init_file}", rank=rank, world_size=WORLD,
                            timeout=datetime.timedelta(seconds=600))
    try:
        results = {(mode, name): _rank_run(name, rank, mode) for mode in MODES for name in CASES}
        torch.save(results, os.path.join(out_dir, f"rank{rank}.pt"))
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _precompile() -> None:
    """Builds the kernels the ranks will launch (both value-slice widths of the recurrent kernel, the
    backward) in this process first, so that the ranks find them in TileLang's cache."""
    from flashqla.ops.gdn.fwd import chunk_gated_delta_rule_fwd

    x = _inputs("one_sequence_odd_split")
    L = _leaves(x, "cuda:0", 0, 200)
    cu = torch.tensor([0, 200], dtype=torch.int32, device="cuda:0")
    with torch.no_grad():
        for bv in (64, 128):
            chunk_gated_delta_rule_fwd(L["q"], L["k"], L["v"], L["g"], L["beta"], None, L["initial_state"], True, cu,
                                       block_v=bv)
    torch.cuda.synchronize()


_STATE: dict = {}


def _results() -> dict:
    if not _STATE:
        _precompile()
        _STATE["gpu"] = {name: _whole(name, flashqla.chunk_gated_delta_rule, "cuda:0") for name in CASES}
        _STATE["fp64"] = {name: _whole(name, reference.chunk_gated_delta_rule, "cpu") for name in CASES}
        with tempfile.TemporaryDirectory() as tmp:
            mp.spawn(_worker, args=(os.path.join(tmp, "init"), tmp), nprocs=WORLD, join=True)
            _STATE["cp"] = [torch.load(os.path.join(tmp, f"rank{r}.pt")) for r in range(WORLD)]
    return _STATE


def _assemble(ranks: list) -> dict:
    got = {q: torch.cat([r[q] for r in ranks], dim=1) for q in ("o", "dq", "dk", "dv", "dg", "dbeta")}
    if ranks[0]["final"] is not None:
        got["final"] = sum(r["final"].double() for r in ranks)
    if ranks[0]["dh0"] is not None:
        got["dh0"] = sum(r["dh0"].double() for r in ranks)
    return got


@pytest.mark.parametrize("name", list(CASES))
@pytest.mark.parametrize("mode", list(MODES))
def test_cp_two_gpus(mode, name):
    st = _results()
    ranks = [res[(mode, name)] for res in st["cp"]]
    assert all(r["launches_ok"] for r in ranks), f"{mode} {name}: launches per rank {[r['launches'] for r in ranks]}"
    got = _assemble(ranks)
    report = {}
    for against in ("gpu", "fp64"):
        ref = st[against][name]
        for q, x in got.items():
            if ref[q] is None:
                continue
            if float(ref[q].double().norm()) == 0.0:
                assert float(x.double().norm()) == 0.0, f"{q}: reference ({against}) is zero, CP is not"
                continue
            report[f"{q} vs {against}"] = rel_rms(x, ref[q])
    path = "/".join("segmented" if r["segmented"] else "per-piece" for r in ranks)
    print(f"cp={mode} {name} ({path}): " + ", ".join(f"{k} {v:.2e}" for k, v in report.items()))
    bad = {k: v for k, v in report.items() if not v <= BUDGET[k.split()[0]]}
    assert not bad, f"{name}: over budget {bad}"
    assert got["o"].dtype == torch.bfloat16 and got["dg"].dtype == torch.float32

"""GPU tier: the serving contract on the recurrent kernel's serving build (`flashqla.ops.gdn.serving`,
kernel path), every feature against the fp64 token recurrence per quantity: o, the final pool rows,
the checkpoint states. State pools by index (padding sequences, has_initial_state), the "vk" layout,
bf16 / fp16 state storage (its error printed beside fp32's), checkpoints at tokens 1, 63, 64, 65 and
the last of a sequence (record CF-4), varlen with empty and 1-token sequences, a g == 0 head and a
strong-decay head (`make_gdn_inputs(special_heads=True)`). Also: the kernel path is the one taken (no
gather of the pool: `LAST_PATH`, and `index_select` is never called), o is bitwise the same with and
without checkpoints, untouched pool rows keep their bytes.

Run on the GPU machine: `pytest -m gpu tests/gpu/test_serving_gpu.py -s`. Skips without a Hopper GPU.
"""

from __future__ import annotations

import pytest
import torch

from flashqla.testing import BUDGETS, make_gdn_inputs, rel_rms

pytestmark = pytest.mark.gpu

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not HOPPER:
    pytest.skip("needs a CUDA GPU of compute capability 9.0 (Hopper)", allow_module_level=True)

import flashqla  # noqa: E402
from flashqla.ops.gdn import serving as op_serving  # noqa: E402
from reference.gdn.recurrent import recurrent_gated_delta_rule  # noqa: E402

DEV = "cuda"
#: relative RMS budgets: fp32 storage as the plain forward's; bf16 / fp16 storage add one rounding
#: of every stored state (bf16 unit roundoff 2^-8, about 2.3e-3 relative RMS for a uniform error)
BUDGET = {torch.float32: BUDGETS["sm90_fwd_bf16"]["ht"], torch.bfloat16: 1.5e-2, torch.float16: 1.2e-2}


def _positions(cu: list) -> list:
    """Checkpoint positions: tokens 1, 63, 64, 65 and the last of every non-empty sequence."""
    out = []
    for bos, eos in zip(cu[:-1], cu[1:]):
        out += sorted({bos + j for j in (1, 63, 64, 65, eos - bos) if 1 <= j <= eos - bos})
    return out


def _case(lengths, HV=4, H=2, seed=0):
    """Packed inputs on the device (bf16 q, k, v; fp32 g, beta) with a g == 0 head and a strong-decay
    head, their fp64 copies, cu_seqlens, and per-sequence fp32 initial states."""
    T = sum(lengths)
    x = make_gdn_inputs(B=1, T=T, H=H, HV=HV, seqlens=list(lengths), special_heads=True, seed=seed)
    xd = {n: (x[n].to(DEV, torch.bfloat16) if n in ("q", "k", "v") else x[n].to(DEV, torch.float32))
          for n in ("q", "k", "v", "g", "beta")}
    x64 = {n: t.detach().cpu().double() for n, t in xd.items()}
    cu = x["cu_seqlens"].to(DEV, torch.int32)
    return xd, x64, cu, x["initial_state"].float()


def _truth(x64, cu_list, h0_kv, positions):
    """fp64 token recurrence: o, the final states [N, HV, K, V] and the states after each position
    (the recurrence run on each position's prefix of its sequence)."""
    cu = torch.tensor(cu_list, dtype=torch.int64)
    o, ht = recurrent_gated_delta_rule(**x64, scale=x64["q"].shape[-1] ** -0.5, initial_state=h0_kv,
                                       output_final_state=True, cu_seqlens=cu)
    ck = []
    for p in positions:
        n = max(i for i in range(len(cu_list) - 1) if cu_list[i] < p <= cu_list[i + 1])
        bos = cu_list[n]
        pre = {k: t[:, bos:p] for k, t in x64.items()}
        _, s = recurrent_gated_delta_rule(**pre, scale=x64["q"].shape[-1] ** -0.5, initial_state=h0_kv[n : n + 1],
                                          output_final_state=True)
        ck.append(s[0])
    return o, ht, (torch.stack(ck) if ck else None)


def _kv(x, layout):
    return x if layout == "kv" else x.transpose(-1, -2)


def _run(xd, cu, pool, idx, has, layout, positions, ckpt_dtype, **kw):
    """One pooled call through the public op (no autograd); returns (o, checkpoint_states, path)."""
    M = 0 if positions is None else len(positions)
    tail = pool.shape[2:]
    pos = torch.tensor(positions, dtype=torch.int64, device=DEV) if positions is not None else None
    cks = torch.full((M, pool.shape[1], *tail), float("nan"), dtype=ckpt_dtype, device=DEV) if positions is not None else None
    with torch.no_grad():
        o, ret = flashqla.chunk_gated_delta_rule(**xd, initial_state=pool, output_final_state=True, cu_seqlens=cu,
                                                 state_indices=idx, has_initial_state=has, state_layout=layout,
                                                 checkpoint_positions=pos, checkpoint_states=cks, cp="off", **kw)
    torch.cuda.synchronize()
    assert ret is pool, "with state_indices the op returns the pool itself"
    return o, cks, op_serving.LAST_PATH["path"]


LENGTHS = {
    "mixed": [130, 1, 0, 64, 300, 65],
    "long": [1000, 63],
}


@pytest.mark.parametrize("case", list(LENGTHS))
@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("block_v", [64, 128])
def test_pool_layout_dtype_checkpoints(case, layout, sdtype, block_v, monkeypatch):
    """o, the written pool rows and the checkpoints against the fp64 recurrence; a padding sequence
    (index -1) neither reads nor writes; has_initial_state False starts from zeros and still writes;
    rows named by no sequence keep their bytes; every checkpoint element is written."""
    lengths = LENGTHS[case]
    N = len(lengths)
    xd, x64, cu, h0 = _case(lengths, seed=len(lengths) + block_v)
    HV, K, V = h0.shape[1], h0.shape[2], h0.shape[3]
    P = N + 3
    rows = torch.randperm(P, generator=torch.Generator().manual_seed(1))[:N]
    idx = rows.clone()
    idx[1] = -1  # a padding sequence
    has = torch.ones(N, dtype=torch.bool)
    has[-1] = False  # starts from zeros, still written
    pool_kv = torch.randn(P, HV, K, V, generator=torch.Generator().manual_seed(2)) * 0.1
    pool_kv[rows] = h0
    pool = _kv(pool_kv, layout).contiguous().to(DEV, sdtype)
    before = pool.clone()
    # the start states the recurrence sees: the stored (rounded) rows, zeros for padding / no initial state
    start = _kv(pool.cpu().double(), layout).clone()[rows.clamp(min=0)]
    start[(idx < 0) | ~has] = 0
    cu_list = cu.tolist()
    positions = _positions(cu_list)
    o_ref, ht_ref, ck_ref = _truth(x64, cu_list, start, positions)

    def no_gather(*a, **k):
        raise AssertionError("the pool was gathered (index_select): the torch path ran")

    monkeypatch.setattr(torch.Tensor, "index_select", no_gather)
    import flashqla.ops.gdn.kernels.sm90.recurrent as rec
    monkeypatch.setattr(rec, "pick_block_v", lambda *a, **k: block_v)
    o, cks, path = _run(xd, cu, pool, idx.to(DEV), has.to(DEV), layout, positions, sdtype)
    monkeypatch.undo()
    assert path == "kernel", f"the serving call took the {path} path"
    assert torch.isfinite(o.float()).all() and torch.isfinite(cks.float()).all(), "unwritten (NaN) elements"
    real = (idx >= 0).nonzero().flatten()
    got_ht = _kv(pool.cpu().double(), layout)[idx[real]]
    errs = {"o": rel_rms(o, o_ref), "ht": rel_rms(got_ht, ht_ref[real]), "checkpoints": rel_rms(_kv(cks.cpu().double(), layout), ck_ref)}
    print(f"[{case} {layout} {sdtype} BV={block_v}] errors vs fp64: {errs}")
    assert errs["o"] <= BUDGETS["sm90_fwd_bf16"]["o"], f"o: {errs['o']:.3e}"
    assert errs["ht"] <= BUDGET[sdtype], f"final pool rows ({sdtype}): {errs['ht']:.3e} > {BUDGET[sdtype]:.1e}"
    assert errs["checkpoints"] <= BUDGET[sdtype], f"checkpoints ({sdtype}): {errs['checkpoints']:.3e} > {BUDGET[sdtype]:.1e}"
    untouched = torch.ones(P, dtype=torch.bool)
    untouched[idx[real]] = False
    assert torch.equal(pool[untouched.to(DEV)], before[untouched.to(DEV)]), "a row no sequence names was written"
    # the checkpoint at a sequence's last token is its final state (the same rounding)
    last = [positions.index(e) for b, e in zip(cu_list[:-1], cu_list[1:]) if e > b]
    seqs = [n for n in range(N) if cu_list[n + 1] > cu_list[n]]
    for m, n in zip(last, seqs):
        if idx[n] >= 0:
            err = rel_rms(cks[m].double(), pool[idx[n]].double())
            assert err <= 1e-2, f"checkpoint at the end of sequence {n} differs from its final row: {err:.2e}"


@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16], ids=["f32", "bf16"])
def test_bf16_error_beside_fp32(sdtype):
    """Prints the checkpoint and final-state errors of bf16 storage beside fp32's on one input (the
    storage rounding is the only difference: the arithmetic is fp32 in both)."""
    lengths = [700, 129]
    xd, x64, cu, h0 = _case(lengths, seed=3)
    cu_list = cu.tolist()
    positions = _positions(cu_list)
    o_ref, ht_ref, ck_ref = _truth(x64, cu_list, h0.double().to(sdtype).double(), positions)
    pool = h0.to(DEV, sdtype).contiguous()
    idx = torch.arange(len(lengths), device=DEV)
    o, cks, path = _run(xd, cu, pool, idx, None, "kv", positions, sdtype)
    assert path == "kernel"
    e = {"o": rel_rms(o, o_ref), "ht": rel_rms(pool.double().cpu(), ht_ref), "checkpoints": rel_rms(cks.double().cpu(), ck_ref)}
    print(f"storage {sdtype}: {e}")
    assert e["ht"] <= BUDGET[sdtype] and e["checkpoints"] <= BUDGET[sdtype], e


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_o_bitwise_with_and_without_checkpoints(layout):
    """o (and the final pool rows) are bitwise the same with and without checkpoints, and the same as
    the plain call's o on the same start states (fp32 kv pool)."""
    lengths = [300, 64, 1, 517]
    xd, _, cu, h0 = _case(lengths, seed=5)
    pool0 = _kv(h0, layout).contiguous().to(DEV)
    idx = torch.arange(len(lengths), device=DEV)
    positions = _positions(cu.tolist())
    pa = pool0.clone()
    o_a, _, path_a = _run(xd, cu, pa, idx, None, layout, None, torch.float32)
    pb = pool0.clone()
    o_b, _, path_b = _run(xd, cu, pb, idx, None, layout, positions, torch.float32)
    assert path_a == path_b == "kernel"
    assert torch.equal(o_a, o_b), "o changed with checkpoints"
    assert torch.equal(pa, pb), "the final states changed with checkpoints"
    with torch.no_grad():
        o_plain, ht_plain = flashqla.chunk_gated_delta_rule(**xd, initial_state=h0.to(DEV), output_final_state=True,
                                                            cu_seqlens=cu, cp="off")
    assert torch.equal(o_plain, o_a), "the serving build's o differs from the plain call's"
    assert torch.equal(_kv(ht_plain, layout), pa), "the serving build's final states differ from the plain call's"


def test_out_and_fixed_length_batch():
    """out= is written in place (the kernel writes it directly) on a fixed-length batch with
    checkpoints at global offsets b * T + t."""
    B, T = 2, 200
    x = make_gdn_inputs(B=B, T=T, H=2, HV=4, special_heads=True, seed=9)
    xd = {n: (x[n].to(DEV, torch.bfloat16) if n in ("q", "k", "v") else x[n].to(DEV, torch.float32))
          for n in ("q", "k", "v", "g", "beta")}
    x64 = {n: t.cpu().double() for n, t in xd.items()}
    h0 = x["initial_state"].float()
    positions = [1, 63, 64, 65, 200, 201, 264, 400]
    flat = {n: t.reshape(1, B * T, *t.shape[2:]) for n, t in x64.items()}
    o_ref, ht_ref, ck_ref = _truth(flat, [0, T, 2 * T], h0.double(), positions)
    out = torch.full_like(xd["v"], float("nan"))
    cks = torch.full((len(positions), 4, 128, 128), float("nan"), device=DEV)
    with torch.no_grad():
        o, ht = flashqla.chunk_gated_delta_rule(**xd, initial_state=h0.to(DEV), output_final_state=True, out=out,
                                                checkpoint_positions=torch.tensor(positions, device=DEV),
                                                checkpoint_states=cks, cp="off")
    assert op_serving.LAST_PATH["path"] == "kernel"
    assert o is out
    e = {"o": rel_rms(o.reshape(1, B * T, 4, 128), o_ref), "ht": rel_rms(ht, ht_ref), "checkpoints": rel_rms(cks, ck_ref)}
    print(e)
    assert max(e.values()) <= BUDGETS["sm90_fwd_bf16"]["o"], e


def test_mixed_dtypes_fall_back_to_torch():
    """A bf16 pool with fp32 checkpoint_states is outside the serving build (one storage dtype): the
    torch path runs, with the same results up to the storage rounding."""
    lengths = [130, 70]
    xd, x64, cu, h0 = _case(lengths, seed=4)
    pool = h0.to(DEV, torch.bfloat16)
    idx = torch.arange(2, device=DEV)
    positions = _positions(cu.tolist())
    o_ref, _, ck_ref = _truth(x64, cu.tolist(), pool.double().cpu(), positions)
    o, cks, path = _run(xd, cu, pool, idx, None, "kv", positions, torch.float32)
    assert path == "torch"
    assert rel_rms(cks.double().cpu(), ck_ref) <= BUDGETS["sm90_fwd_bf16"]["ht"]


def _states_after_every_token(x64, bounds, h0_kv):
    """fp64 recurrence, token by token: {global position p: the state after the first p tokens of its
    sequence} for every p inside a sequence, bounds the sequences' (bos, eos)."""
    scale = x64["q"].shape[-1] ** -0.5
    out = {}
    for n, (bos, eos) in enumerate(bounds):
        s = h0_kv[n : n + 1]
        for t in range(bos, eos):
            tok = {k: v[:, t : t + 1] for k, v in x64.items()}
            _, s = recurrent_gated_delta_rule(**tok, scale=scale, initial_state=s, output_final_state=True)
            out[t + 1] = s[0]
    return out


@pytest.mark.parametrize("seed", range(4))
def test_checkpoint_ranges_found_in_kernel(seed):
    """The serving build finds each chunk's checkpoints from the positions themselves (the producer
    warp's 32-wide search and ballots, no table launch): M > 1024 (three search rounds), every token of
    one chunk (64 in one chunk: several ballot rounds), one position repeated 1000 times, an empty
    and a 1-token sequence, int32 and int64 positions and indices (a padding sequence by -1, and by
    -2^32 in int64: no read, no write), has_initial_state, packed and fixed-length batches. Every
    checkpoint against the fp64 recurrence (fp32 storage); every element written."""
    g = torch.Generator().manual_seed(seed)
    packed = seed % 2 == 0
    if packed:
        lengths = torch.randint(0, 260, (int(torch.randint(3, 8, (1,), generator=g)),), generator=g).tolist()
        lengths[0], lengths[1], lengths[2] = 200, 1, 0
        B, T = 1, sum(lengths)
        bounds = []
        for L in lengths:
            b = bounds[-1][1] if bounds else 0
            bounds.append((b, b + L))
    else:
        B, T = 3, 150
        bounds = [(b * T, (b + 1) * T) for b in range(B)]
    N = len(bounds)
    HV, H = 2, 1
    x = make_gdn_inputs(B=B, T=T, H=H, HV=HV, seqlens=[e - b for b, e in bounds] if packed else None,
                        special_heads=True, seed=seed)
    xd = {n: (x[n].to(DEV, torch.bfloat16) if n in ("q", "k", "v") else x[n].to(DEV, torch.float32))
          for n in ("q", "k", "v", "g", "beta")}
    x64 = {n: t.detach().cpu().double().reshape(1, B * T, *t.shape[2:]) for n, t in xd.items()}
    cu = x["cu_seqlens"].to(DEV, torch.int32) if packed else None
    h0 = x["initial_state"].float()
    has = torch.ones(N, dtype=torch.bool)
    has[-1] = False
    pad = N - 2 if N > 2 else None  # a padding sequence: starts from zeros, its row untouched
    start = h0.double().clone()
    start[~has] = 0
    if pad is not None:
        start[pad] = 0
    truth = _states_after_every_token(x64, bounds, start)
    b0, e0 = bounds[0]
    pos = list(range(b0 + 65, b0 + 129))  # every token of the first sequence's second chunk
    pos += [b0 + 1] * 1000  # one position repeated: M > 1024
    pos += [b + int(j) for b, e in bounds for j in torch.randint(1, max(e - b, 1) + 1, (6,), generator=g) if 1 <= j <= e - b]
    pos += [e for b, e in bounds if e > b]
    pos = sorted(pos)
    P = N + 2
    rows = torch.randperm(P, generator=g)[:N]
    for pdt, idt in ((torch.int64, torch.int32), (torch.int32, torch.int64)):
        pool = torch.zeros(P, HV, 128, 128, device=DEV)
        pool[rows.to(DEV)] = h0.to(DEV)
        p = torch.tensor(pos, dtype=pdt, device=DEV)
        idx = rows.to(idt, copy=True)
        if pad is not None:
            idx[pad] = -(2**32) if idt == torch.int64 else -1
        before = pool.clone()
        cks = torch.full((len(pos), HV, 128, 128), float("nan"), device=DEV)
        with torch.no_grad():
            flashqla.chunk_gated_delta_rule(**xd, initial_state=pool, output_final_state=True, cu_seqlens=cu,
                                            state_indices=idx.to(DEV), has_initial_state=has.to(DEV),
                                            checkpoint_positions=p, checkpoint_states=cks, cp="off")
        torch.cuda.synchronize()
        assert op_serving.LAST_PATH["path"] == "kernel"
        assert torch.isfinite(cks).all(), f"unwritten checkpoints ({pdt}, {idt})"
        want = torch.stack([truth[q] for q in pos])
        err = rel_rms(cks.cpu().double(), want)
        print(f"[seed {seed} {'packed' if packed else 'fixed'} M={len(pos)} {pdt} {idt}] checkpoints vs fp64: {err:.2e}")
        assert err <= BUDGET[torch.float32], f"checkpoints: {err:.3e}"
        worst = max(rel_rms(cks[m].cpu().double(), truth[q]) for m, q in enumerate(pos))
        assert worst <= 3 * BUDGET[torch.float32], f"the worst single checkpoint: {worst:.3e}"
        if pad is not None:
            assert torch.equal(pool[rows[pad]], before[rows[pad]]), "the padding sequence's row was written"


def test_kernel_path_gate_floor_and_packed_tail():
    """The kernel path clamps g at the gate floor like every other path (a g = -inf token gives finite
    results equal to the plain call's), and with device offsets ending before T (no host hint) the tail
    of o is zeros, also in a preallocated out= that held garbage."""
    lengths = [100, 70]
    xd, _, cu, h0 = _case(lengths, seed=11)
    xd["g"][0, 5, :] = float("-inf")
    T = sum(lengths)
    pad = {n: torch.cat([t, t[:, :28]], dim=1) for n, t in xd.items()}  # 28 packed tokens of no sequence
    pool = h0.to(DEV).contiguous()
    idx = torch.arange(2, device=DEV)
    out = torch.full_like(pad["v"], float("nan"))
    with torch.no_grad():
        o, _ = flashqla.chunk_gated_delta_rule(**pad, initial_state=pool.clone(), output_final_state=True, cu_seqlens=cu,
                                               state_indices=idx, out=out, cp="off")
        assert op_serving.LAST_PATH["path"] == "kernel"
        o_plain, _ = flashqla.chunk_gated_delta_rule(**xd, initial_state=h0.to(DEV), output_final_state=True,
                                                     cu_seqlens=cu, cp="off")
    torch.cuda.synchronize()
    assert torch.isfinite(o.float()).all()
    assert torch.equal(o[:, T:], torch.zeros_like(o[:, T:])), "the packed tail of o is not zero"
    assert torch.equal(o[:, :T], o_plain), "the kernel path differs from the plain call with a -inf gate"


@pytest.mark.parametrize("method", ["split", "segments"])
def test_split_plan_checkpoints(method, monkeypatch):
    """A serving call whose plan splits (cp="on", one long and two shorter sequences, a vk bf16 pool)
    takes its checkpoints inside the split forward ("split": the dual launch's serving build stores
    the run's and the transitions' states at the positions, one GEMM after the scan combines them) or,
    with that launch hidden from the backend, from the split forward's segment entering states
    ("segments": one more forward over the checkpoints' pieces): checkpoints (each), o and pool rows
    against the fp64 recurrence, and a CUDA graph of the call replays to the same checkpoints (no host
    read)."""
    from flashqla.ops.gdn.backend import default_backend

    if method == "segments":
        monkeypatch.setattr(default_backend(), "recurrent_dual_checkpoints", None)
    lengths = [3000, 70, 1100]  # 4170 tokens: 8 checkpoints x L = 512 fit (segment_checkpoints_apply)
    xd, x64, cu, h0 = _case(lengths, HV=4, H=2, seed=21)
    cu_list = [0, 3000, 3070, 4170]
    positions = [1, 511, 512, 513, 2000, 3000, 3070, 3071 + 600]
    pool = torch.zeros(6, 4, 128, 128, dtype=torch.bfloat16, device=DEV)
    idx = torch.tensor([4, 0, 2], device=DEV)
    pool[idx] = h0.to(DEV).transpose(-1, -2).to(torch.bfloat16)
    h0_kv = pool[idx].transpose(-1, -2).double().cpu()  # the rounded states the call starts from
    pos = torch.tensor(positions, device=DEV)
    cks = torch.full((len(positions), 4, 128, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
    from flashqla.cp.plan import plan_call

    assert method == "split" or op_serving.segment_checkpoints_apply(plan_call(xd["q"], xd["v"], cu, "on"), pos, xd["q"]), \
        "the case no longer takes the segment method (the plan's L changed?): adjust lengths or positions"

    def call(p):
        return flashqla.chunk_gated_delta_rule(**xd, initial_state=p, output_final_state=True, cu_seqlens=cu,
                                               state_indices=idx, state_layout="vk", checkpoint_positions=pos,
                                               checkpoint_states=cks, cp="on")

    with torch.no_grad():
        o, _ = call(pool_run := pool.clone())
    torch.cuda.synchronize()
    assert op_serving.LAST_PATH == {"path": "torch", "checkpoints": method}, op_serving.LAST_PATH
    o_ref, ht_ref, ck_ref = _truth(x64, cu_list, h0_kv, positions)
    e_o = rel_rms(o.double().cpu(), o_ref)
    e_pool = rel_rms(pool_run[idx].transpose(-1, -2).double().cpu(), ht_ref)
    e_ck = rel_rms(cks.transpose(-1, -2).double().cpu(), ck_ref)
    each = [rel_rms(cks[m].transpose(-1, -2).double().cpu(), ck_ref[m]) for m in range(len(positions))]
    print(f"split plan ({method}), vk bf16 pool: o {e_o:.2e}, pool rows {e_pool:.2e}, checkpoints {e_ck:.2e} "
          f"(each {max(each):.2e} at most)")
    assert e_o < BUDGETS["sm90_fwd_bf16"]["o"] and e_pool < 1e-2 and e_ck < 1e-2 and max(each) < 1e-2, each
    first = cks.clone()
    graph = torch.cuda.CUDAGraph()
    with torch.no_grad():
        call(pool.clone())  # warm-up on this stream
        cks.fill_(float("nan"))
        with torch.cuda.graph(graph):
            call(pool_graph := pool.clone())
    graph.replay()
    torch.cuda.synchronize()
    assert torch.equal(cks, first), "the captured call's checkpoints differ from the eager call's"


@pytest.mark.parametrize("layout", ["kv", "vk"])
@pytest.mark.parametrize("sdtype", [torch.float32, torch.bfloat16, torch.float16], ids=["f32", "bf16", "f16"])
@pytest.mark.parametrize("idx_dtype", [torch.int32, torch.int64], ids=["i32", "i64"])
def test_state_moves_match_torch(layout, sdtype, idx_dtype):
    """The torch path's state moves in one launch each (`kernels/sm90/pool_states.py`) against the
    torch functions they replace: the pool gather (indices with a padding sequence, has_initial_state
    False on one) and the pool store bit for bit (rows of padding sequences and rows no sequence
    names keep their bytes), the checkpoint combine within fp32 summation order of
    `CheckpointParts.states()` (fp32 storage) or one storage rounding (bf16 / fp16)."""
    from flashqla.cp.forward import CheckpointParts
    from flashqla.ops.gdn.kernels.sm90.pool_states import combine_checkpoints, gather_states, store_states
    from flashqla.serving import ServingArgs, from_kv, gather_initial_states, store_final_states

    gen = torch.Generator(device=DEV).manual_seed(3)
    P, N, HV, K = 7, 5, 3, 128
    tail = (K, K)
    pool = torch.randn(P, HV, *tail, device=DEV, generator=gen).to(sdtype)
    idx = torch.tensor([4, -1, 0, 6, 2], dtype=idx_dtype, device=DEV)
    has = torch.tensor([True, True, False, True, True], device=DEV)
    s = ServingArgs(idx, has, layout, None, None, None, False, True, P)
    assert torch.equal(gather_states(pool, layout, N, idx, has), gather_initial_states(pool, s, N, torch.float32))
    s_nomask = ServingArgs(idx, None, layout, None, None, None, False, True, P)
    assert torch.equal(gather_states(pool, layout, N, idx, None), gather_initial_states(pool, s_nomask, N, torch.float32))
    final = torch.randn(N, HV, K, K, device=DEV, generator=gen)
    want, got = pool.clone(), pool.clone()
    store_final_states(want, final, s)
    store_states(final, got, layout, idx)
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3, 5]], pool[[1, 3, 5]]), "rows no valid sequence names must keep their bytes"
    # checkpoints: 6 positions over 4 segments ending at 100, 250, 250, 400; p - 1 picks the segment
    M, Ms = 6, 4
    CQ = torch.randn(M, HV, K, K, device=DEV, generator=gen)
    CP = torch.randn(M, HV, K, K, device=DEV, generator=gen) / K ** 0.5
    S_in = torch.randn(Ms, HV, K, K, device=DEV, generator=gen)
    seg_end = torch.tensor([100, 250, 250, 400], device=DEV)
    pos = torch.tensor([1, 100, 101, 250, 251, 400], dtype=idx_dtype, device=DEV)
    parts = CheckpointParts(CQ, CP, S_in, seg_end, pos)
    ref = parts.states().double()
    out = torch.full((M, HV, *tail), float("nan"), dtype=sdtype, device=DEV)
    combine_checkpoints(*parts, out=out, layout=layout)
    got = out.double() if layout == "kv" else out.transpose(-1, -2).double()
    tol = 2e-5 if sdtype == torch.float32 else (2 ** -8 if sdtype == torch.bfloat16 else 2 ** -11)
    err = ((got - ref).abs() / ref.abs().clamp(min=1.0)).max().item()
    assert err <= tol, (err, tol)
    assert torch.isfinite(out).all()


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_split_plan_state_moves_kernels_against_torch(layout, monkeypatch):
    """The split plan's serving call with the state-move kernels (the default on sm_90) against the
    same call with torch's moves (`state_kernels_apply` patched off): o bitwise, pool rows bitwise,
    checkpoints within the combine's fp32 summation order and one bf16 rounding."""
    lengths = [3000, 70, 1100]
    xd, _, cu, h0 = _case(lengths, HV=4, H=2, seed=22)
    pool = torch.randn(6, 4, 128, 128, device=DEV).to(torch.bfloat16)
    idx = torch.tensor([4, -1, 2], device=DEV)
    has = torch.tensor([True, True, False], device=DEV)
    pos = torch.tensor([1, 511, 512, 513, 2000, 3000, 3070, 3071 + 600], device=DEV)

    def call():
        p = pool.clone()
        cks = torch.full((pos.numel(), 4, 128, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
        with torch.no_grad():
            o, _ = flashqla.chunk_gated_delta_rule(**xd, initial_state=p, output_final_state=True, cu_seqlens=cu,
                                                   state_indices=idx, has_initial_state=has, state_layout=layout,
                                                   checkpoint_positions=pos, checkpoint_states=cks, cp="on")
        return o, p, cks

    o1, p1, c1 = call()
    assert op_serving.LAST_PATH == {"path": "torch", "checkpoints": "split"}, op_serving.LAST_PATH
    monkeypatch.setattr(op_serving, "state_kernels_apply", lambda *a, **k: False)
    o2, p2, c2 = call()
    torch.cuda.synchronize()
    assert torch.equal(o1, o2)
    assert torch.equal(p1, p2)
    d = (c1.double() - c2.double()).abs() / c2.double().abs().clamp(min=1.0)
    assert d.max().item() <= 2 ** -7, d.max().item()


def test_split_plan_vk_without_initial_state():
    """A "vk" call with no initial_state on the split plan (torch path, the state-move kernels on):
    starts from zeros, returns the final states in "vk" and the checkpoints, against the fp64
    recurrence (a review found this path reaching the gather kernel with None)."""
    lengths = [3000, 70]
    xd, x64, cu, _ = _case(lengths, HV=4, H=2, seed=23)
    pos = torch.tensor([1, 64, 2999, 3070], device=DEV)
    cks = torch.full((4, 4, 128, 128), float("nan"), dtype=torch.float32, device=DEV)
    with torch.no_grad():
        o, ht = flashqla.chunk_gated_delta_rule(**xd, output_final_state=True, cu_seqlens=cu, state_layout="vk",
                                                checkpoint_positions=pos, checkpoint_states=cks, cp="on")
    assert op_serving.LAST_PATH["path"] == "torch", op_serving.LAST_PATH
    o_ref, ht_ref, ck_ref = _truth(x64, [0, 3000, 3070], torch.zeros(2, 4, 128, 128, dtype=torch.float64),
                                   pos.tolist())
    assert rel_rms(o.double().cpu(), o_ref) < BUDGETS["sm90_fwd_bf16"]["o"]
    assert rel_rms(ht.transpose(-1, -2).double().cpu(), ht_ref) < BUDGETS["sm90_fwd_bf16"]["ht"]
    assert rel_rms(cks.transpose(-1, -2).double().cpu(), ck_ref) < BUDGETS["sm90_fwd_bf16"]["ht"]


@pytest.mark.parametrize("layout", ["kv", "vk"])
def test_misaligned_pool_and_checkpoints(layout):
    """A pool and checkpoint_states that are contiguous views one element past the start of a larger
    buffer (first element not 16-byte aligned, which the kernels' vector accesses need): the call
    takes torch's moves instead of crashing, and o, the pool rows and the checkpoints match the same
    call on aligned copies."""
    lengths = [300, 1, 129]
    xd, x64, cu, h0 = _case(lengths, seed=31)
    N, HV = len(lengths), 4
    idx = torch.tensor([4, 0, 2], device=DEV)
    positions = _positions(cu.tolist())
    results = {}
    for aligned in (True, False):
        buf = torch.zeros(2 * N * HV * 128 * 128 + 1, dtype=torch.bfloat16, device=DEV)
        pool = (buf[:-1] if aligned else buf[1:]).view(2 * N, HV, 128, 128)
        pool[idx] = _kv(h0.to(DEV), layout).to(torch.bfloat16)
        cbuf = torch.full((len(positions) * HV * 128 * 128 + 1,), float("nan"), dtype=torch.bfloat16, device=DEV)
        cks = (cbuf[:-1] if aligned else cbuf[1:]).view(len(positions), HV, 128, 128)
        assert (pool.data_ptr() % 16 == 0) == aligned and (cks.data_ptr() % 16 == 0) == aligned
        pos = torch.tensor(positions, dtype=torch.int64, device=DEV)
        with torch.no_grad():
            o, ret = flashqla.chunk_gated_delta_rule(**xd, initial_state=pool, output_final_state=True, cu_seqlens=cu,
                                                     state_indices=idx, state_layout=layout, checkpoint_positions=pos,
                                                     checkpoint_states=cks, cp="off")
        torch.cuda.synchronize()
        assert ret is pool
        results[aligned] = (o, pool.clone(), cks.clone(), op_serving.LAST_PATH["path"])
    assert results[True][3] == "kernel" and results[False][3] == "torch", (results[True][3], results[False][3])
    o_ref, ht_ref, ck_ref = _truth(x64, cu.tolist(), h0.double(), positions)
    for aligned, (o, pool, cks, _) in results.items():
        assert bool(torch.isfinite(cks).all()), f"aligned={aligned}: a checkpoint not written"
        assert rel_rms(o.double().cpu(), o_ref) < BUDGETS["sm90_fwd_bf16"]["o"]
        assert rel_rms(_kv(pool[idx], layout).double().cpu(), ht_ref) < BUDGET[torch.bfloat16]
        assert rel_rms(_kv(cks, layout).double().cpu(), ck_ref) < BUDGET[torch.bfloat16]
    # the same kernels' arithmetic on both paths: o bitwise, the stored states within one bf16 rounding
    assert torch.equal(results[True][0], results[False][0])
    for k in (1, 2):
        a, b = results[True][k].float(), results[False][k].float()
        assert rel_rms(b.double().cpu(), a.double().cpu()) < 4e-3


def _bits(x: torch.Tensor) -> torch.Tensor:
    """x's bit patterns (so that -0.0 and +0.0, or two NaN payloads, count as different)."""
    return x.contiguous().view({4: torch.int32, 2: torch.int16}[x.element_size()])


@pytest.mark.parametrize("L", [9000, 2000])
@pytest.mark.parametrize("layout,sdtype", [("vk", torch.bfloat16), ("kv", torch.float32)], ids=["vk-bf16", "kv-f32"])
def test_batch_invariant_bitwise_across_batches(layout, sdtype, L):
    """batch_invariant=True: one sequence (L tokens, not a multiple of the chunk) gives bit for bit the
    same o, final pool row and checkpoints alone (value slices of 64, and alone the default plan would
    split), behind short and empty sequences at an offset that is not a multiple of the chunk, among
    24 other sequences (25 x 4 walks: value slices of 128, `pick_block_v`) and among 40 (64 again),
    and on a repeat call; and the same o and final row
    without checkpoints of its own while its neighbours have some (the call then runs a build with
    checkpoints). Alone, its o, final state and checkpoints are also checked against the fp64
    recurrence. Records the path each call took (`LAST_PATH`) and asserts it is one path throughout."""
    HV, H = 4, 2
    xd, x64, _, _ = _case([L], HV=HV, H=H, seed=31)
    rel = sorted(p for p in {1, 64, 65, 2048, 2049, L // 2, L} if p <= L)  # checkpoint positions inside it
    pool0 = _kv(torch.randn(50, HV, 128, 128, generator=torch.Generator().manual_seed(3)) * 0.1, layout)
    pool0 = pool0.contiguous().to(DEV, sdtype)
    row = 7
    others = make_gdn_inputs(B=1, T=40 * 300, H=H, HV=HV, seqlens=[300] * 40, special_heads=True, seed=32)
    paths = set()

    def call(before: list, after: list, mine: bool = True, theirs: bool = False):
        """The sequence between `before` and `after` (lengths of other sequences, their tokens taken
        from `others`); checkpoints at `rel` in it (mine) and at the last token of each later
        sequence (theirs). Returns its o, its final pool row and its checkpoints (None without)."""
        lens = before + [L] + after
        parts, off = {n: [] for n in xd}, 0
        for i, n_tok in enumerate(lens):
            for n in xd:
                parts[n].append(xd[n] if i == len(before) else others[n][:, off:off + n_tok].to(DEV, xd[n].dtype))
            off += 0 if i == len(before) else n_tok
        x = {n: torch.cat(parts[n], dim=1).contiguous() for n in xd}
        ends = [sum(lens[:i + 1]) for i in range(len(lens))]
        cu = torch.tensor([0] + ends, dtype=torch.int32, device=DEV)
        s0 = sum(before)
        idx = torch.tensor([-1] * len(before) + [row] + [10 + i for i in range(len(after))], device=DEV)
        pos = ([s0 + p for p in rel] if mine else []) + ([e for e in ends[len(before) + 1:]] if theirs else [])
        pool = pool0.clone()
        pos_t = torch.tensor(pos, dtype=torch.int64, device=DEV) if pos else None
        cks = torch.full((len(pos), HV, 128, 128), float("nan"), dtype=sdtype, device=DEV) if pos else None
        with torch.no_grad():
            o, _ = flashqla.chunk_gated_delta_rule(**x, initial_state=pool, output_final_state=True, cu_seqlens=cu,
                                                   state_indices=idx, state_layout=layout, checkpoint_positions=pos_t,
                                                   checkpoint_states=cks, batch_invariant=True)
        torch.cuda.synchronize()
        paths.add(op_serving.LAST_PATH["path"])
        return o[:, s0:s0 + L], pool[row], (cks[:len(rel)] if mine else None)

    o_a, st_a, ck_a = call([], [])
    h0_kv = _kv(pool0[row].float().cpu(), layout).double()[None]
    o_ref, ht_ref, ck_ref = _truth(x64, [0, L], h0_kv, rel)
    assert rel_rms(o_a.double().cpu(), o_ref) < BUDGETS["sm90_fwd_bf16"]["o"]
    assert rel_rms(_kv(st_a.double().cpu(), layout), ht_ref[0]) < BUDGET[sdtype]
    assert rel_rms(_kv(ck_a.double().cpu(), layout), ck_ref) < BUDGET[sdtype]
    from flashqla.ops.gdn.kernels.sm90.recurrent import pick_block_v
    assert pick_block_v(1, HV) == 64 and pick_block_v(25, HV) == 128  # the batches below run both widths
    cases = [(([77, 0, 1], [5]), True, False), (([300] * 12, [300] * 12), True, False),
             (([300] * 20, [300] * 20), True, False), (([], []), True, False),
             (([77, 0, 1], [300] * 3), False, True), (([], [300]), False, False)]
    for (before, after), mine, theirs in cases:
        o_b, st_b, ck_b = call(before, after, mine, theirs)
        where = f"before {len(before)} / after {len(after)} sequences, own checkpoints {mine}, others' {theirs}"
        assert torch.equal(_bits(o_b), _bits(o_a)), f"o differs ({where})"
        assert torch.equal(_bits(st_b), _bits(st_a)), f"the final pool row differs ({where})"
        if mine:
            assert torch.equal(_bits(ck_b), _bits(ck_a)), f"the checkpoints differ ({where})"
    print(f"batch_invariant L={L} {layout} {sdtype}: paths {sorted(paths)}")
    assert len(paths) == 1, f"the calls took different paths: {paths}"


@pytest.mark.parametrize("cp", ["off", "on"])
def test_fp16_product_serving_at_width_128(cp, monkeypatch):
    """The opt-in fp16 A_beta product (`default_backend().fp16_products`) on a pooled call with
    checkpoints at value slice width 128: the serving build (`recurrent.NREG_SERVING_FP16`'s register
    split) on the kernel path (cp="off") and the split path's dual build (cp="on"). o, the pool rows
    and every checkpoint against the fp64 recurrence within the bf16 kernels' budgets, no element left
    unwritten, and o no worse than the shipped bf16 product's on the same call."""
    from flashqla.ops.gdn.backend import default_backend
    import flashqla.ops.gdn.kernels.sm90.recurrent as rec

    lengths = [3000, 70, 1100]
    xd, x64, cu, h0 = _case(lengths, HV=4, H=2, seed=31)
    cu_list = [0, 3000, 3070, 4170]
    positions = [1, 63, 64, 65, 2000, 3000, 3070, 3071 + 600, 4170]
    idx = torch.tensor([4, 0, 2], device=DEV)
    base = torch.zeros(6, 4, 128, 128, dtype=torch.bfloat16, device=DEV)
    base[idx] = h0.to(DEV).transpose(-1, -2).to(torch.bfloat16)
    h0_kv = base[idx].transpose(-1, -2).double().cpu()
    o_ref, ht_ref, ck_ref = _truth(x64, cu_list, h0_kv, positions)
    pos = torch.tensor(positions, device=DEV)
    monkeypatch.setattr(rec, "pick_block_v", lambda *a, **k: 128)
    be = default_backend()
    errs = {}
    for fp16 in (False, True):
        pool = base.clone()
        cks = torch.full((len(positions), 4, 128, 128), float("nan"), dtype=torch.bfloat16, device=DEV)
        monkeypatch.setattr(be, "fp16_products", fp16)
        with torch.no_grad():
            o, _ = flashqla.chunk_gated_delta_rule(**xd, initial_state=pool, output_final_state=True, cu_seqlens=cu,
                                                   state_indices=idx, state_layout="vk", checkpoint_positions=pos,
                                                   checkpoint_states=cks, cp=cp)
        torch.cuda.synchronize()
        assert torch.isfinite(o.float()).all() and torch.isfinite(cks.float()).all(), "unwritten (NaN) elements"
        errs[fp16] = {"o": rel_rms(o.double().cpu(), o_ref),
                      "ht": rel_rms(pool[idx].transpose(-1, -2).double().cpu(), ht_ref),
                      "checkpoints": rel_rms(cks.transpose(-1, -2).double().cpu(), ck_ref)}
    print(f"[cp={cp} {op_serving.LAST_PATH}] errors vs fp64, bf16 product: {errs[False]}, fp16 product: {errs[True]}")
    e = errs[True]
    assert e["o"] <= BUDGETS["sm90_fwd_bf16"]["o"], f"o: {e['o']:.3e}"
    assert e["ht"] <= BUDGET[torch.bfloat16] and e["checkpoints"] <= BUDGET[torch.bfloat16], e
    assert e["o"] <= 1.02 * errs[False]["o"] + 1e-5, f"fp16 product o {e['o']:.3e} above the bf16 product's {errs[False]['o']:.3e}"

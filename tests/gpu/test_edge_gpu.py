"""GPU tier: edge cases of the public op `flashqla.chunk_gated_delta_rule`, forward and every gradient
(the device side of tests/test_edge_cases.py).

Each case runs the op with autograd on bf16 (or fp16) q, k, v and fp32 g, beta, states, and compares
o, the final state and dq, dk, dv, dg, dbeta, dh0 per quantity with autograd of the fp64 reference op
(`reference.chunk_gated_delta_rule`) on the same rounded inputs and cotangents, within the budgets of
tests/gpu/test_autograd_gpu.py (relative RMS). An all-zero reference quantity must come back exactly
zero. Where the reference would cost too much (thousands of sequences, 2^18 and more tokens) the op
is compared with itself run on the same sequences in pieces, and with the fp64 reference on a few
of the sequences (the last ones of the pack, where the offsets are largest).

The public op cannot be handed NaN-poisoned outputs, so before each call the CUDA caching allocator
is refilled with NaN (`_poison_allocator`): an element the kernels fail to write then reads as NaN,
and every result must be finite.

Sections: sequence shapes (T % 64 != 0, T < 64, every sequence shorter than a chunk, empty sequences
first / middle / last / all, a packed tail past cu_seqlens[-1], int32 and int64 offsets); scale (3000
short sequences; marked `slow` as well: 2^18+ tokens with 32 value heads, 2^19+ tokens with int64
offsets, 1M tokens forward); gates and beta (g == 0 against the ungated delta rule written here,
g = -20 / -70 / -300, beta 0 and 1, fp16 with a large initial state and a tiny dht); layout
(non-contiguous inputs and cotangents give bitwise the results of their contiguous copies).

Run on the GPU machine: `pytest -m "gpu and not slow" tests/gpu/test_edge_gpu.py -v -s` (about the
size of test_autograd_gpu.py), `pytest -m slow tests/gpu/test_edge_gpu.py -v -s` for the large
cases (each tens of GiB of GPU memory). Skips cleanly without a Hopper GPU.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F

from flashqla.testing import make_gdn_inputs, qwen3next_gate, random_cu_seqlens, rel_rms

pytestmark = pytest.mark.gpu

HOPPER = torch.cuda.is_available() and torch.cuda.get_device_capability() == (9, 0)
if not HOPPER:
    pytest.skip("needs a CUDA GPU of compute capability 9.0 (Hopper)", allow_module_level=True)

import flashqla  # noqa: E402
import reference  # noqa: E402

DEV = "cuda"
OP = flashqla.chunk_gated_delta_rule
F64 = torch.float64
NAMES = ("q", "k", "v", "g", "beta", "initial_state")
GRAD = {"q": "dq", "k": "dk", "v": "dv", "g": "dg", "beta": "dbeta", "initial_state": "dh0"}
#: relative RMS against fp64 per quantity, as tests/gpu/test_autograd_gpu.py
BUDGET = {"o": 1e-2, "ht": 1e-2, "dq": 2e-2, "dk": 2e-2, "dv": 2e-2, "dg": 3e-2, "dbeta": 2e-2, "dh0": 2e-2}
#: per-token quantities ([B, T, ...]); the others (ht, dh0) are per sequence ([N, ...])
TOKEN_Q = ("o", "dq", "dk", "dv", "dg", "dbeta")
#: the op against itself on the same sequences run in pieces: the same kernels on the same values,
#: bitwise equal where the value slice width (N * HV) matches; an indexing fault gives O(1)
PIECES_TOL = 1e-3
#: the split (cp="auto") and unsplit results of the same long sequence: two bf16 computations, each
#: ~4.5e-3 from fp64 (the GPU tier), so up to ~1e-2 apart; measured 4.3e-3 on the H200 (split whole
#: against split pieces)
CP_VS_UNSPLIT_TOL = 1e-2


# ----------------------------------------------------------------------------------------------
# cases, runs, comparisons
# ----------------------------------------------------------------------------------------------


def _round(c: dict) -> dict:
    """Every float of the case rounded to what the device holds (q, k, v, do in c["dtype"]; g, beta,
    states, dht in fp32), kept in its own dtype (fp64 for host cases): the reference starts from the
    values the kernels read."""
    for n in ("q", "k", "v", "do", "g", "beta", "initial_state", "dht"):
        t = c.get(n)
        if t is not None:
            rd = c["dtype"] if n in ("q", "k", "v", "do") else torch.float32
            c[n] = t.to(rd).to(t.dtype)
    return c


def _case(seed: int, *, B: int = 1, T: int | None = None, lengths=None, tail: int = 0, H: int = 2, HV: int = 4,
          dtype=torch.bfloat16, cu_dtype=torch.int32, h0: bool = True, **kw) -> dict:
    """Host (fp64) inputs of one case, with cotangents do [B, T, HV, V] and dht [N, HV, K, V].

    lengths: packed sequence lengths (B = 1); tail: tokens past cu_seqlens[-1] (packed only);
    kw: gate / special_heads / state_scale of `make_gdn_inputs`."""
    seqlens = None
    if lengths is not None:
        seqlens = list(lengths) + ([tail] if tail else [])
        T = sum(seqlens)
    x = make_gdn_inputs(B=B, T=T, H=H, HV=HV, K=128, V=128, seqlens=seqlens, initial_state=h0, seed=seed, **kw)
    if tail:  # the tail's tokens belong to no sequence: drop its offset and its state row
        x["cu_seqlens"] = x["cu_seqlens"][:-1]
        if x["initial_state"] is not None:
            x["initial_state"] = x["initial_state"][:-1]
    if x["cu_seqlens"] is not None:
        x["cu_seqlens"] = x["cu_seqlens"].to(cu_dtype)
    N = B if x["cu_seqlens"] is None else x["cu_seqlens"].numel() - 1
    gen = torch.Generator().manual_seed(seed + 7919)
    x["do"] = torch.randn(x["v"].shape, generator=gen, dtype=F64)
    x["dht"] = torch.randn(N, HV, 128, 128, generator=gen, dtype=F64)
    x["dtype"] = dtype
    return _round(x)


def _poison_allocator(value: float = math.nan, mib: int = 512) -> None:
    """Refills the caching allocator's free memory with `value`: a large block (requests over 1 MiB
    are cut from it) and small 2 MiB segments (requests up to 1 MiB), so that the op's outputs,
    which it allocates uninitialised, start as `value`. No-op off CUDA."""
    if DEV != "cuda":
        return
    torch.cuda.synchronize()
    torch.cuda.empty_cache()
    big = torch.full((mib << 18,), value, dtype=torch.float32, device=DEV)
    small = [torch.full((1 << 18,), value, dtype=torch.float32, device=DEV) for _ in range(32)]
    torch.cuda.synchronize()
    del big, small


def _sync() -> None:
    if DEV == "cuda":
        torch.cuda.synchronize()


def _autograd(op, leaves: dict, cu, do, dht, **kw) -> dict:
    """o, ht and the gradients of <o, do> + <ht, dht> with respect to every leaf (autograd)."""
    o, ht = op(leaves["q"], leaves["k"], leaves["v"], leaves["g"], leaves["beta"], initial_state=leaves["initial_state"],
               output_final_state=True, cu_seqlens=cu, **kw)
    names = [n for n in NAMES if leaves[n] is not None]
    grads = torch.autograd.grad((o, ht), [leaves[n] for n in names], (do, dht), allow_unused=True)
    out = {"o": o.detach(), "ht": ht.detach()}
    for n, d in zip(names, grads):
        assert d is not None or leaves[n].numel() == 0, f"no gradient for {n}"
        out[GRAD[n]] = torch.zeros_like(leaves[n]) if d is None else d
    return out


def _ours(c: dict, view=None, contiguous_views: bool = False, poison: bool = True) -> dict:
    """The public op on DEV with autograd. `view(name, tensor) -> tensor` rewrites the device
    tensors (q ... initial_state, cu_seqlens, do, dht) first, e.g. into non-contiguous views;
    contiguous_views: the same values, then copied into a fresh (contiguous, aligned) tensor."""
    dev = {}
    for n in NAMES + ("do", "dht", "cu_seqlens"):
        t = c[n]
        if t is not None:
            if n == "cu_seqlens":
                t = t.to(DEV)
            else:
                t = t.to(DEV, c["dtype"] if n in ("q", "k", "v", "do") else torch.float32)
            if view is not None:
                t = view(n, t)
                if contiguous_views:
                    t = t.clone(memory_format=torch.contiguous_format)
        dev[n] = t
    leaves = {n: (None if dev[n] is None else dev[n].detach().requires_grad_(True)) for n in NAMES}
    if poison:
        _poison_allocator()
    out = _autograd(OP, leaves, dev["cu_seqlens"], dev["do"], dev["dht"])
    _sync()
    return out


def _ref(c: dict) -> dict:
    """Autograd of the fp64 reference op on the host (same values as `_ours`)."""
    leaves = {n: (None if c[n] is None else c[n].detach().to("cpu", F64).requires_grad_(True)) for n in NAMES}
    cu = None if c["cu_seqlens"] is None else c["cu_seqlens"].cpu()
    return _autograd(reference.chunk_gated_delta_rule, leaves, cu, c["do"].detach().to("cpu", F64), c["dht"].detach().to("cpu", F64))


def _compare(label: str, got: dict, ref: dict, budget: dict = BUDGET) -> dict:
    """Every quantity of `ref`: same shape, finite, relative RMS within budget; an all-zero
    reference must be matched exactly. Prints the errors; one AssertionError lists every failure."""
    errs, bad = {}, []
    for n, r in ref.items():
        x = got[n]
        if tuple(x.shape) != tuple(r.shape):
            bad.append(f"{n}: shape {tuple(x.shape)} vs {tuple(r.shape)}")
            continue
        if x.numel() == 0:
            continue
        if not bool(torch.isfinite(x).all()):
            bad.append(f"{n}: {int((~torch.isfinite(x)).sum())} non-finite elements")
            continue
        if not bool(r.any()):
            errs[n] = float(x.abs().max())
            if errs[n] != 0.0:
                bad.append(f"{n}: the reference is exactly zero, got max |x| = {errs[n]:.3e}")
            continue
        errs[n] = rel_rms(x, r)
        if not errs[n] <= budget[n]:
            bad.append(f"{n}: relative RMS {errs[n]:.3e} > {budget[n]:.0e}")
    print(f"{label}: " + " ".join(f"{n} {e:.2e}" for n, e in errs.items()))
    assert not bad, f"{label}: " + "; ".join(bad)
    return errs


def _check(label: str, c: dict, **kw) -> tuple[dict, dict]:
    got, ref = _ours(c, **kw), _ref(c)
    _compare(label, got, ref)
    return got, ref


def _assert_empty_sequences_exact(c: dict, got: dict, lengths) -> None:
    """An empty sequence's final state is its initial state and its dh0 is its dht, exactly."""
    for n, length in enumerate(lengths):
        if length == 0:
            h0 = c["initial_state"][n].to(DEV, torch.float32)
            assert torch.equal(got["ht"][n], h0), f"final state of empty sequence {n} is not its initial state"
            assert torch.equal(got["dh0"][n], c["dht"][n].to(DEV, torch.float32)), f"dh0 of empty sequence {n} is not its dht"


# ----------------------------------------------------------------------------------------------
# pieces: the op on a subset of the sequences of a packed case
# ----------------------------------------------------------------------------------------------


def _sub(c: dict, a: int, b: int) -> tuple[dict, int, int]:
    """Sequences a .. b-1 of a packed case as a packed case of their own (offsets rebased, same dtype
    and device); returns it and its token range [s, e) in the whole."""
    cu = c["cu_seqlens"]
    s, e = int(cu[a]), int(cu[b])
    out = dict(c)
    for n in ("q", "k", "v", "g", "beta", "do"):
        out[n] = c[n][:, s:e]
    out["cu_seqlens"] = cu[a : b + 1] - cu[a]
    out["initial_state"] = None if c["initial_state"] is None else c["initial_state"][a:b]
    out["dht"] = c["dht"][a:b]
    return out, s, e


def _slice(out: dict, s: int, e: int, a: int, b: int) -> dict:
    return {n: (t[:, s:e] if n in TOKEN_Q else t[a:b]) for n, t in out.items()}


def _rel_err(x: torch.Tensor, ref: torch.Tensor, block: int = 1 << 26) -> float:
    """||x - ref|| / ||ref|| accumulated in fp64 on x's device block by block (nothing of the size of
    x leaves the device); inf when x has a non-finite entry or ref is zero and x is not; 0 when both
    are zero."""
    xf = x.detach().reshape(-1)
    rf = ref.detach().to(x.device).reshape(-1)
    assert xf.numel() == rf.numel(), f"sizes {tuple(x.shape)} vs {tuple(ref.shape)}"
    num = torch.zeros((), dtype=F64, device=x.device)
    den = torch.zeros((), dtype=F64, device=x.device)
    finite = torch.ones((), dtype=torch.bool, device=x.device)
    for i in range(0, xf.numel(), block):
        a, r = xf[i : i + block].to(F64), rf[i : i + block].to(F64)
        finite &= torch.isfinite(a).all()
        num += (a - r).square().sum()
        den += r.square().sum()
    if not bool(finite):
        return math.inf
    num, den = float(num), float(den)
    if den == 0.0:
        return 0.0 if num == 0.0 else math.inf
    return math.sqrt(num / den)


def _against_pieces(label: str, c: dict, whole: dict, groups) -> None:
    """The op on each group of sequences [(a, b), ...] alone against the slices of the whole run."""
    worst, bitwise, bad = {}, {}, []
    for a, b in groups:
        sub, s, e = _sub(c, a, b)
        part = _ours(sub, poison=False)
        ref = _slice(whole, s, e, a, b)
        for n, t in part.items():
            err = _rel_err(t, ref[n])
            worst[n] = max(worst.get(n, 0.0), err)
            bitwise[n] = bitwise.get(n, True) and torch.equal(t, ref[n])
            if not err <= PIECES_TOL:
                bad.append(f"{n} of sequences {a}..{b - 1}: {err:.3e} from the whole run")
        del part
    print(f"{label} against pieces {list(groups)}: " + " ".join(f"{n} {worst[n]:.1e}{'=' if bitwise[n] else ''}" for n in worst)
          + "  (= bitwise)")
    assert not bad, f"{label}: " + "; ".join(bad)


def _host64(c: dict) -> dict:
    out = dict(c)
    for n in NAMES + ("do", "dht", "cu_seqlens"):
        t = c[n]
        if t is not None:
            out[n] = t.detach().cpu() if n == "cu_seqlens" else t.detach().to("cpu", F64)
    return out


def _against_reference_on(label: str, c: dict, whole: dict, a: int, b: int) -> None:
    """Sequences a .. b-1 of the whole run against the fp64 reference run on them alone."""
    sub, s, e = _sub(c, a, b)
    _compare(f"{label}, sequences {a}..{b - 1} vs fp64", _slice(whole, s, e, a, b), _ref(_host64(sub)))


# ----------------------------------------------------------------------------------------------
# sequence shapes
# ----------------------------------------------------------------------------------------------


@pytest.mark.parametrize("T", [0, 1, 5, 63, 65, 130, 200])
def test_lengths_not_a_multiple_of_the_chunk(T):
    """B = 2, T = 0 (final state = initial state, dh0 = dht), T < 64 and T % 64 != 0."""
    c = _case(seed=100 + T, B=2, T=T)
    got, _ = _check(f"T={T}", c)
    if T == 0:
        _assert_empty_sequences_exact(c, got, [0, 0])


VARLEN = {
    "all-short": [3, 2, 1, 5, 40, 63],
    "empty-first": [0, 5, 70],
    "empty-middle": [5, 0, 70],
    "empty-last": [5, 70, 0],
    "all-empty": [0, 0, 0],
    "one-empty": [0],
    "mixed": [64, 0, 65, 1, 0, 130],
}


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("name", list(VARLEN))
def test_varlen_edge_batches(name, cu_dtype):
    """Packed sequences all shorter than a chunk, and empty sequences first, middle, last and
    everywhere (total T = 0 included); offsets int32 and int64. Empty sequences: final state =
    initial state and dh0 = dht, exactly; every gradient finite."""
    lengths = VARLEN[name]
    c = _case(seed=200 + len(lengths), lengths=lengths, cu_dtype=cu_dtype)
    got, _ = _check(f"{name} {cu_dtype}", c)
    _assert_empty_sequences_exact(c, got, lengths)


@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
@pytest.mark.parametrize("lengths,tail", [([70, 0, 130], 50), ([64, 1, 0], 64)], ids=["mid-chunk", "after-empty"])
def test_packed_tail_beyond_the_last_offset(lengths, tail, cu_dtype):
    """Tokens past cu_seqlens[-1] (T > cu_seqlens[-1], allowed for device offsets) with nonzero
    cotangents: the sequences' outputs and gradients equal those of the run without the tail and
    the fp64 reference's; every gradient of a tail token is exactly zero."""
    c = _case(seed=300 + tail, lengths=lengths, tail=tail, cu_dtype=cu_dtype)
    Tv = sum(lengths)
    got = _ours(c)
    trunc = dict(c)
    for n in ("q", "k", "v", "g", "beta", "do"):
        trunc[n] = c[n][:, :Tv]
    without = _ours(trunc)
    for n in ("dq", "dk", "dv", "dg", "dbeta"):
        t = got[n][:, Tv:]
        assert bool(torch.isfinite(t).all()) and not bool(t.any()), f"{n} of the tail is not exactly zero: max {t.abs().max():.3e}"
    inside = {n: (t[:, :Tv] if n in TOKEN_Q else t) for n, t in got.items()}
    diffs = {n: _rel_err(inside[n], without[n]) for n in without}
    print(f"tail {tail} after {lengths}: vs the run without it " + " ".join(f"{n} {e:.1e}" for n, e in diffs.items()))
    assert all(e <= 1e-5 for e in diffs.values()), f"the tail changes the sequences' results: {diffs}"
    _compare(f"tail {tail} after {lengths} vs fp64", inside, _ref(trunc))
    _assert_empty_sequences_exact(c, got, lengths)


def test_packed_tail_output_is_defined():
    """o of the tail tokens is exactly zero (with the allocator refilled with NaN before the call): the op
    zero-fills o where the device offsets may end before T (issue 44, finding 2)."""
    c = _case(seed=310, lengths=[70, 0, 130], tail=2000)  # o over 1 MiB: cut from the poisoned block
    got = _ours(c)
    tail = got["o"][:, 200:]
    assert bool(torch.isfinite(tail).all()), "o of the packed tail holds NaN (unwritten memory)"
    assert not bool(tail.any()), "o of the packed tail is not zero"


@pytest.mark.parametrize("cp", ["off", "on"])
@pytest.mark.parametrize("cu_dtype", [torch.int32, torch.int64], ids=["int32", "int64"])
def test_packed_tail_is_written_by_the_tail_launch(cp, cu_dtype):
    """Without the grad and without a host copy of the offsets, o is allocated uninitialised and its
    tail (rows past cu_seqlens[-1]) zeroed by the tail launch (`packed_tail.zero_packed_tail`), on the
    unsplit and on the split path: the tail is exactly zero although the allocator hands back memory
    filled with NaN, the sequences' rows equal the call on the tokens before the tail (to the split
    plan's difference, which depends on T) and the fp64 budget; the launch alone zeroes the tail of a
    NaN-filled o and leaves the other rows bitwise as they were."""
    from flashqla.ops.gdn.kernels.sm90.packed_tail import zero_packed_tail

    lengths, tail = [300, 1000, 77], 900
    x = make_gdn_inputs(B=1, T=sum(lengths) + tail, H=2, HV=4, seqlens=lengths + [tail], seed=321)
    Tv = sum(lengths)
    xd = {n: t.to(DEV, torch.bfloat16 if n in ("q", "k", "v") else torch.float32) for n, t in x.items()
          if n in NAMES and t is not None}
    xd["initial_state"] = xd["initial_state"][:len(lengths)]
    cu = x["cu_seqlens"][:-1].to(DEV, cu_dtype)
    with torch.no_grad():
        junk = torch.full_like(xd["v"], float("nan"))  # the block o is cut from next
        del junk
        o, ht = OP(**xd, cu_seqlens=cu, output_final_state=True, cp=cp)
        cut = {n: (t[:, :Tv] if n != "initial_state" else t) for n, t in xd.items()}
        o2, ht2 = OP(**cut, cu_seqlens=cu, output_final_state=True, cp=cp)
    torch.cuda.synchronize()
    assert bool(torch.isfinite(o.float()).all()), "o holds NaN (unwritten rows)"
    assert not bool(o[:, Tv:].any()), "o of the packed tail is not zero"
    assert rel_rms(o[:, :Tv], o2) <= 1e-3 and rel_rms(ht, ht2) <= 1e-3
    ref = reference.recurrent_gated_delta_rule(*(cut[n].cpu().double() for n in ("q", "k", "v", "g", "beta")),
                                               initial_state=cut["initial_state"].cpu().double(),
                                               output_final_state=True, cu_seqlens=cu.cpu())
    assert rel_rms(o[:, :Tv], ref[0]) <= BUDGET["o"] and rel_rms(ht, ref[1]) <= BUDGET["ht"]
    poisoned = torch.full_like(o, float("nan"))
    poisoned[:, :Tv] = o[:, :Tv]
    zero_packed_tail(poisoned, cu)
    assert torch.equal(poisoned[:, :Tv], o[:, :Tv]) and not bool(poisoned[:, Tv:].any())


# ----------------------------------------------------------------------------------------------
# scale
# ----------------------------------------------------------------------------------------------

#: sizes of the scale tests (module constants, so the file's logic can be exercised at small sizes)
SHORT_SEQS = dict(n=3000, max_len=40, group=500)
#: 2^18 + 222 tokens, 32 value heads, int32 offsets; the pieces are compared within PIECES_TOL (the
#: second piece, 5 x 32 walks, runs at BV = 64, the whole at 128: `recurrent.pick_block_v`); the last
#: four sequences (296 tokens) go to fp64
LENGTHS_2_18 = [87000, 7, 87000, 63, 88000, 65, 1, 130, 100]
GROUPS_2_18 = [(0, 4), (4, 9)]
#: 2^19 + 619 tokens, int64 offsets; every piece under 2^18 tokens; the last three (270 tokens) to fp64
LENGTHS_2_19 = [104900, 1, 104900, 64, 104900, 65, 104900, 7, 104900, 130, 100, 40]
GROUPS_2_19 = [(0, 3), (3, 6), (6, 9), (9, 12)]
MILLION = 1 << 20
MILLION_PIECES = 4
THRESHOLDS = {"2^18": 1 << 18, "2^19": 1 << 19}


def test_thousands_of_short_sequences():
    """3000 packed sequences of 1..40 tokens (2/4 heads, ~61k tokens): the whole batch against the
    op on groups of 500 sequences, and the first, middle and last sequences against fp64."""
    n, group = SHORT_SEQS["n"], SHORT_SEQS["group"]
    gen = torch.Generator().manual_seed(400)
    lengths = torch.randint(1, SHORT_SEQS["max_len"] + 1, (n,), generator=gen).tolist()
    c = _case(seed=401, lengths=lengths)
    whole = _ours(c)
    for name, t in whole.items():
        assert bool(torch.isfinite(t).all()), f"{name} not finite"
    _against_pieces(f"{n} short sequences", c, whole, [(a, min(a + group, n)) for a in range(0, n, group)])
    for a in (0, n // 2 - 4, n - 8):
        _against_reference_on(f"{n} short sequences", c, whole, a, a + 8)


def _device_case(seed: int, *, lengths=None, B: int = 1, T: int | None = None, H: int, HV: int, cu_dtype=torch.int32,
                 dtype=torch.bfloat16, grads: bool = True) -> dict:
    """Inputs drawn on DEV itself (the host copies of a 2^19-token fp64 case would be tens of GiB):
    q, k L2-normalised, v ~ N(0, 1), beta = sigmoid(N(0, 1)), Qwen3-Next gates with value head 0 at
    g == 0 and the last at g = -30 per token, h0 ~ N(0, 1); do, dht ~ N(0, 1) when `grads`."""
    gen = torch.Generator(device=DEV).manual_seed(seed)

    def randn(*shape, dt=torch.float32):
        return torch.randn(*shape, generator=gen, device=DEV, dtype=dt)

    if lengths is not None:
        T = sum(lengths)
    N = B if lengths is None else len(lengths)
    c = dict(dtype=dtype)
    c["q"] = F.normalize(randn(B, T, H, 128, dt=dtype), dim=-1)
    c["k"] = F.normalize(randn(B, T, H, 128, dt=dtype), dim=-1)
    c["v"] = randn(B, T, HV, 128, dt=dtype)
    A_log = torch.linspace(0.0, math.log(16.0), HV, device=DEV)
    dt_bias = torch.linspace(-6.0, -2.0, HV, device=DEV)
    c["g"] = qwen3next_gate(randn(B, T, HV), A_log, dt_bias)
    c["g"][..., 0] = 0.0
    c["g"][..., -1] = -30.0
    c["beta"] = torch.sigmoid(randn(B, T, HV))
    c["initial_state"] = randn(N, HV, 128, 128)
    c["cu_seqlens"] = None if lengths is None else random_cu_seqlens(lengths, device=DEV, dtype=cu_dtype)
    c["do"] = randn(B, T, HV, 128, dt=dtype) if grads else None
    c["dht"] = randn(N, HV, 128, 128) if grads else None
    return c


def _large_packed(label: str, lengths, groups, cu_dtype, threshold: int, fp64_last: int) -> None:
    assert sum(lengths) > threshold, f"{label}: {sum(lengths)} tokens"
    c = _device_case(seed=500 + len(lengths), lengths=lengths, H=16, HV=32, cu_dtype=cu_dtype)
    whole = _ours(c, poison=False)
    for name, t in whole.items():
        assert bool(torch.isfinite(t).all()), f"{label}: {name} not finite"
    _against_pieces(label, c, whole, groups)
    n = len(lengths)
    _against_reference_on(label, c, whole, n - fp64_last, n)  # the largest offsets of the pack


@pytest.mark.slow
def test_tokens_past_2_18_with_32_value_heads(monkeypatch):
    """2^18 + 222 packed tokens, 16/32 heads, int32 offsets (recomputed states h: S * HV * K * V past
    2^31 elements; o, v past 2^31 bytes): the whole batch against the op on two pieces, the last four
    sequences against fp64. Context parallelism off ($FLASHQLA_CP): the planner may split the whole
    batch and not a piece (or the reverse), and a split and an unsplit run of the same sequences are
    two bf16 computations ~4e-3 apart (seen on the H200: o 3.6e-3 whole against pieces), where the
    pieces' tolerance is for the same kernels at other offsets. Large offsets on the split path: the
    million-token test."""
    monkeypatch.setenv("FLASHQLA_CP", "off")
    _large_packed("2^18+ tokens, 16/32 heads, int32", LENGTHS_2_18, GROUPS_2_18, torch.int32, THRESHOLDS["2^18"], 4)


@pytest.mark.slow
def test_tokens_past_2_19_with_int64_offsets(monkeypatch):
    """2^19 + 619 packed tokens, 16/32 heads, int64 offsets (v, o, dv, do past 2^31 elements): the
    whole batch against the op on four pieces of three sequences, the last three against fp64.
    Context parallelism off, as the 2^18 test (there: why)."""
    monkeypatch.setenv("FLASHQLA_CP", "off")
    _large_packed("2^19+ tokens, 16/32 heads, int64", LENGTHS_2_19, GROUPS_2_19, torch.int64, THRESHOLDS["2^19"], 3)


@pytest.mark.slow
def test_million_tokens_forward():
    """One sequence of 2^20 tokens, 2/8 heads, forward only: o and the final state of the unsplit
    kernels (cp="off": one CTA walks 16384 chunks, offsets past 2^24 elements) against the op run in
    MILLION_PIECES pieces (chunk-aligned, cp="off"), each starting from the previous piece's final
    state; then the default (cp="auto" splits this sequence) against the unsplit result, within
    CP_VS_UNSPLIT_TOL (two bf16 computations of the same outputs, each ~4.5e-3 from fp64)."""
    c = _device_case(seed=600, B=1, T=MILLION, H=2, HV=8, grads=False)
    with torch.no_grad():
        o, ht = OP(c["q"], c["k"], c["v"], c["g"], c["beta"], initial_state=c["initial_state"], output_final_state=True,
                   cp="off")
        _sync()
        assert bool(torch.isfinite(ht).all()), "final state not finite"
        step = MILLION // MILLION_PIECES
        assert step % 64 == 0
        state, errs, bitwise = c["initial_state"], [], True
        for s in range(0, MILLION, step):
            e = s + step
            o_p, state = OP(c["q"][:, s:e], c["k"][:, s:e], c["v"][:, s:e], c["g"][:, s:e], c["beta"][:, s:e],
                            initial_state=state, output_final_state=True, cp="off")
            errs.append(_rel_err(o_p, o[:, s:e]))
            bitwise = bitwise and torch.equal(o_p, o[:, s:e])
        err_ht = _rel_err(state, ht)
        o_cp, ht_cp = OP(c["q"], c["k"], c["v"], c["g"], c["beta"], initial_state=c["initial_state"],
                         output_final_state=True)
        _sync()
        err_cp, err_cp_ht = _rel_err(o_cp, o), _rel_err(ht_cp, ht)
    print(f"1M tokens, 2/8 heads: o vs pieces {max(errs):.1e}, final state {err_ht:.1e}, bitwise {bitwise and torch.equal(state, ht)}; "
          f"default (split) vs unsplit: o {err_cp:.1e}, final state {err_cp_ht:.1e}")
    assert max(errs) <= PIECES_TOL, f"o differs from the pieces' by {errs}"
    assert err_ht <= PIECES_TOL, f"final state differs from the pieces' by {err_ht:.3e}"
    assert bool(torch.isfinite(o_cp).all()) and bool(torch.isfinite(ht_cp).all())
    assert err_cp <= CP_VS_UNSPLIT_TOL and err_cp_ht <= CP_VS_UNSPLIT_TOL, (err_cp, err_cp_ht)


# ----------------------------------------------------------------------------------------------
# gates and beta
# ----------------------------------------------------------------------------------------------


def _ungated_delta_rule(q, k, v, beta, initial_state, cu_seqlens, scale):
    """The delta rule without a gate, written out token by token (fp64, vectorised over heads only):
    S <- S + beta k (v - S^T k)^T, o = scale S^T q; value head hv reads q/k head hv // (HV // H)."""
    B, T, H, K = q.shape
    HV, V = v.shape[2], v.shape[3]
    qe, ke = q.repeat_interleave(HV // H, dim=2), k.repeat_interleave(HV // H, dim=2)
    if cu_seqlens is None:
        spans = [(b, 0, T, b) for b in range(B)]
    else:
        cu = cu_seqlens.tolist()
        spans = [(0, cu[n], cu[n + 1], n) for n in range(len(cu) - 1)]
    rows = [[None] * T for _ in range(B)]
    finals = []
    for b, s, e, n in spans:
        S = initial_state[n] if initial_state is not None else q.new_zeros(HV, K, V)
        for t in range(s, e):
            err = v[b, t] - torch.einsum("hkv,hk->hv", S, ke[b, t])
            S = S + beta[b, t][:, None, None] * ke[b, t][:, :, None] * err[:, None, :]
            rows[b][t] = scale * torch.einsum("hkv,hk->hv", S, qe[b, t])
        finals.append(S)
    o = torch.stack([torch.stack(r) for r in rows])
    return o, torch.stack(finals)


@pytest.mark.parametrize("varlen", [False, True], ids=["fixed", "varlen"])
def test_zero_gate_everywhere_is_the_ungated_delta_rule(varlen):
    """g == 0 for every token and head: o, the final state and dq, dk, dv, dbeta, dh0 against the
    ungated delta rule (autograd of `_ungated_delta_rule`), dg against the fp64 reference op."""
    if varlen:
        c = _case(seed=700, lengths=[5, 0, 70, 64], gate="zero", special_heads=False)
    else:
        c = _case(seed=701, B=2, T=130, gate="zero", special_heads=False)
    got, ref = _check(f"g == 0 {'varlen' if varlen else 'fixed'} vs fp64 reference", c)
    leaves = {n: c[n].detach().clone().requires_grad_(True) for n in ("q", "k", "v", "beta", "initial_state")}
    o, ht = _ungated_delta_rule(**leaves, cu_seqlens=c["cu_seqlens"], scale=128**-0.5)
    grads = torch.autograd.grad((o, ht), list(leaves.values()), (c["do"], c["dht"]))
    ungated = {"o": o.detach(), "ht": ht.detach(), **{GRAD[n]: d for n, d in zip(leaves, grads)}}
    for n, r in ungated.items():  # the two fp64 computations agree first
        assert rel_rms(ref[n], r) <= 1e-10, f"reference vs ungated rule: {n}"
    _compare("g == 0 vs the ungated delta rule", got, ungated)


#: tokens at the strong gate in every head (not the first ones: dh0 must stay representable)
STRONG_TOKENS = (10, 63, 64, 100, 129)


@pytest.mark.parametrize("gate", [-20.0, -70.0, -300.0])
def test_strong_gates(gate):
    """The last value head at g = gate for every token (cumulative exponents down to 64 * gate within a
    chunk), and tokens STRONG_TOKENS at g = gate in every head amid Qwen3-Next gates (head 0 g == 0
    elsewhere). All quantities within budget; the strong head's o, final state, dv and dbeta within
    budget of their own size; its dg and dh0 (about exp(gate) of the others') within budget of their
    own size plus 1e-6 of the whole quantity's."""
    c = _case(seed=800 + int(-gate), B=2, T=130)
    c["g"][..., -1] = gate
    c["g"][:, list(STRONG_TOKENS), :] = gate
    got, ref = _check(f"g = {gate}", _round(c))
    hv = c["v"].shape[2] - 1
    per_head = {
        "o": lambda t: t[:, :, hv], "ht": lambda t: t[:, hv], "dv": lambda t: t[:, :, hv], "dbeta": lambda t: t[..., hv],
        "dg": lambda t: t[..., hv], "dh0": lambda t: t[:, hv],
    }
    for n, pick in per_head.items():
        x, r = pick(got[n]).cpu().double(), pick(ref[n]).double()
        err = float(torch.linalg.vector_norm(x - r))
        floor = 1e-6 * float(torch.linalg.vector_norm(ref[n])) if n in ("dg", "dh0") else 0.0
        bound = BUDGET[n] * float(torch.linalg.vector_norm(r)) + floor
        print(f"g = {gate}, head {hv}, {n}: |error| {err:.2e}, bound {bound:.2e}, |reference| {float(torch.linalg.vector_norm(r)):.2e}")
        assert err <= bound, f"head {hv} {n}: |error| {err:.3e} > {bound:.3e}"


@pytest.mark.parametrize("mode", ["zero", "one", "alternating", "one-repeated-key"])
def test_beta_exactly_zero_and_one(mode):
    """beta == 0 (nothing written: dk, dv exactly 0, the reference's too), beta == 1, beta 0 and 1 on
    alternate tokens, and beta == 1 with g == 0 and one key repeated (I - k k^T is singular; the
    chunk's WY matrix is all ones below its diagonal)."""
    if mode == "one-repeated-key":
        c = _case(seed=900, lengths=[70, 0, 65], gate="zero", special_heads=False)
        c["k"][:] = c["k"][:, :1]
    else:
        c = _case(seed=901, B=2, T=130)
    if mode == "zero":
        c["beta"].zero_()
    elif mode == "alternating":
        c["beta"][:, ::2] = 0.0
        c["beta"][:, 1::2] = 1.0
    else:
        c["beta"].fill_(1.0)
    got, ref = _check(f"beta {mode}", c)
    if mode == "zero":
        assert not bool(ref["dk"].any()) and not bool(ref["dv"].any()), "the reference's dk, dv at beta == 0"


def test_fp16_large_initial_state_tiny_dht():
    """fp16 q, k, v with an initial state of scale 3e3 (o, dq, dk up to ~1e4: inside fp16's range with
    a factor 5 to spare; the fp16 copies of the state inside the kernels too, the backward's stored
    chunk-start states h included: fp16 inputs run `states_bwd` / `chunk_bwd` with h in fp16) and
    dht = 1e-30: no inf, no NaN, every quantity within budget."""
    c = _case(seed=1000, B=2, T=100, dtype=torch.float16, state_scale=3e3)
    c["dht"] = torch.full_like(c["dht"], 1e-30)
    got, ref = _check("fp16, |h0| ~ 3e3, dht = 1e-30", _round(c))
    peaks = {n: float(ref[n].abs().max()) for n in ("o", "dq", "dk", "dv")}
    print(f"fp16 reference peaks: {peaks}")
    assert max(peaks.values()) < 3e4, "the case itself would leave fp16's range"


# ----------------------------------------------------------------------------------------------
# layout
# ----------------------------------------------------------------------------------------------


STATE_LIKE = ("initial_state", "dht")


def _transposed(n: str, t: torch.Tensor) -> torch.Tensor:
    """The same values through a non-contiguous view: tokens and heads (K and V for states) swapped in
    memory."""
    a, b = (2, 3) if n in STATE_LIKE else (1, 2)
    return t.transpose(a, b).contiguous().transpose(a, b)


def _strided(n: str, t: torch.Tensor) -> torch.Tensor:
    """The same values at every other position of a buffer twice as long along the token dim (the
    sequence dim for states, the only dim for offsets)."""
    d = 0 if n in STATE_LIKE or t.dim() == 1 else 1
    shape = list(t.shape)
    shape[d] *= 2
    big = torch.zeros(shape, dtype=t.dtype, device=t.device)
    idx = [slice(None)] * t.dim()
    idx[d] = slice(1, None, 2)
    big[tuple(idx)] = t
    return big[tuple(idx)]


def _misaligned(n: str, t: torch.Tensor) -> torch.Tensor:
    """The same values, contiguous, one element past the start of a larger buffer: the first element
    not 16-byte aligned (2 or 4 bytes off, 4 or 8 for int32 / int64 offsets)."""
    buf = torch.zeros(t.numel() + 1, dtype=t.dtype, device=t.device)
    view = buf[1:].view(t.shape)
    view.copy_(t)
    return view


def _expanded(n: str, t: torch.Tensor) -> torch.Tensor:
    """New values: the first token's (the first sequence's for states) repeated by a stride-0 view."""
    d = 0 if n in STATE_LIKE else 1
    return t.narrow(d, 0, 1).expand_as(t)


NON_CONTIGUOUS = {  # id: (names rewritten, how)
    "q-transposed": (("q",), _transposed),
    "k-sliced": (("k",), _strided),
    "v-transposed": (("v",), _transposed),
    "g-transposed": (("g",), _transposed),
    "beta-sliced": (("beta",), _strided),
    "initial_state-transposed": (("initial_state",), _transposed),
    "initial_state-expanded": (("initial_state",), _expanded),
    "cu_seqlens-strided": (("cu_seqlens",), _strided),
    "do-transposed": (("do",), _transposed),
    "do-expanded": (("do",), _expanded),
    "dht-transposed": (("dht",), _transposed),
    "dht-expanded": (("dht",), _expanded),
    "all-transposed": (("q", "k", "v", "g", "beta", "initial_state", "do", "dht"), _transposed),
    "all-sliced": (("q", "k", "v", "g", "beta", "initial_state", "do", "dht", "cu_seqlens"), _strided),
    "qkv-expanded": (("q", "k", "v", "g"), _expanded),
    "all-misaligned": (("q", "k", "v", "g", "beta", "initial_state", "do", "dht", "cu_seqlens"), _misaligned),
}


@pytest.mark.parametrize("name", list(NON_CONTIGUOUS))
def test_non_contiguous_inputs_give_the_contiguous_result(name):
    """Inputs, offsets or cotangents as non-contiguous views (transposed in memory, every other
    element of a larger buffer, stride-0 expansions as o.sum() / ht.sum() make) or as contiguous
    views whose first element is not 16-byte aligned (the copy engine's loads need it): o, the final
    state and every gradient bitwise those of fresh contiguous copies (packed 70, 0, 129, 1)."""
    names, how = NON_CONTIGUOUS[name]
    c = _case(seed=1100, lengths=[70, 0, 129, 1])

    def view(n, t):
        return how(n, t) if n in names else t

    # the views are really non-contiguous (or misaligned)
    probe = {n: view(n, c[n].to(DEV)) for n in names}
    assert not any(t.is_contiguous() and t.data_ptr() % 16 == 0 for t in probe.values()), name
    got = _ours(c, view=view)
    want = _ours(c, view=view, contiguous_views=True)
    diff = [n for n in want if not torch.equal(got[n], want[n])]
    for n, t in got.items():
        assert bool(torch.isfinite(t).all()), f"{name}: {n} not finite"
    assert not diff, f"{name}: {diff} depend on the memory layout"
    if name in ("all-transposed", "all-misaligned"):  # and the numbers are right
        _compare(name, got, _ref(c))

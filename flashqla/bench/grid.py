"""The benchmark rows (forward, context-parallel and backward grids) and the work of one row.

Forward grid: FlashQLA's published H200 forward table (`benchmark/bench_gated_delta_rule.py` of
QwenLM/FlashQLA, `FWD_MODEL_CONFIGS` x `FWD_SEQLEN_CONFIGS`): 9 head configurations (h_qk / h_v,
Qwen3.5/3.6 models under tensor parallelism) x 19 sequence mixes = 171 rows.

Context-parallel grid (`--cp-grid`): the single-sequence rows of the four few-head configurations,
plus 131072 and 1048576 tokens for the two fewest; they are forward rows like any other.

Backward grid: FlashQLA's published H200 backward table: 4 head configurations x 2 totals (8192 and
32768 tokens) x 1, 2, 4 and 8 sequences = 32 rows. A total of T tokens in n sequences is cut at
n - 1 distinct random points of 1..T-1 (`random_split`: the first n - 1 entries of a seeded random
permutation on torch's CPU generator, sorted); with seed 42 this gives the lengths of FlashQLA's
table, pinned in `BWD_SPLITS` so that every machine and torch version benchmarks the same rows. Its
short names (`8k_4seq`) are for the tables; a row's key carries the lengths themselves.

Every row: K = V = 128, bf16 q/k/v (and do), fp32 g/beta/states, packed varlen (B = 1 with
`cu_seqlens`, also for a single sequence).

A sequence mix is written the way FlashQLA labels it: `1x32768` (one sequence of 32768 tokens),
`28672+4096` (two sequences, in this order), `8192x4` (four sequences of 8192 tokens). `AxB` reads
"one sequence of B tokens" when A is 1, and "B sequences of A tokens" otherwise; `parse_mix` never
guesses beyond that.

Work (DESIGN.md section 6), per token and value head at K = V = 128, C = 64: forward 163,840 FLOP
(6 d^2 + 8 C d: three state GEMMs and four intra-chunk GEMMs per chunk), backward 491,520
(16 d^2 + 28 C d), training step 655,360. TFLOP/s are reported on these counts and as a share of
the 726 TFLOP/s bf16 GEMM rate measured on our H200.
"""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

__all__ = [
    "HeadConfig", "Mix", "Row", "K_DIM", "V_DIM", "CHUNK", "PEAK_TFLOPS", "PEAK_TFLOPS_BY_GPU", "peak_tflops", "H200_SMS",
    "FLOP_PER_TOKEN_HEAD", "FWD_HEADS", "FWD_MIXES", "QUICK_ROWS", "CP_GRID_HEADS", "CP_GRID_MIXES",
    "CP_GRID_LONG", "BWD_HEADS", "BWD_TOTALS", "BWD_COUNTS", "BWD_SEED", "BWD_SPLITS", "BWD_QUICK_ROWS",
    "parse_heads", "parse_mix", "parse_bwd_mix", "filter_rows", "fwd_rows", "select_rows", "cp_grid_rows",
    "is_cp_grid_row", "random_split", "mix_name", "short_name", "bwd_mix", "bwd_mixes", "bwd_rows",
    "select_bwd_rows", "rows_for", "flop", "tflops", "pct_of_peak", "fwd_min_bytes", "effective_parallelism",
    "is_cp_row", "padded_tokens",
]

#: Head dimensions of the grid (FlashQLA asserts K = V = 128).
K_DIM = 128
V_DIM = 128
#: Chunk length of every implementation on Hopper (and of the fp64 reference's layout).
CHUNK = 64
#: FLOP per token and value head at K = V = 128, C = 64: forward, backward, training step.
FLOP_PER_TOKEN_HEAD = {
    "fwd": 6 * K_DIM * V_DIM + 8 * CHUNK * K_DIM,
    "bwd": 16 * K_DIM * V_DIM + 28 * CHUNK * K_DIM,
}
FLOP_PER_TOKEN_HEAD["step"] = FLOP_PER_TOKEN_HEAD["fwd"] + FLOP_PER_TOKEN_HEAD["bwd"]
assert FLOP_PER_TOKEN_HEAD == {"fwd": 163_840, "bwd": 491_520, "step": 655_360}
#: bf16 dense GEMM rate measured on our H200 through torch (8192^3), TFLOP/s.
PEAK_TFLOPS = 726.0
#: The measured bf16 GEMM rate per GPU (a word of the GPU's name -> TFLOP/s; `benchmarks/experiments/
#: gemm_rate.py`, the best 8192^3 round); a GPU not listed has no percentage column in the pages.
PEAK_TFLOPS_BY_GPU = {"H200": PEAK_TFLOPS, "H100": 733.0}
#: Streaming multiprocessors of an H200 SXM (used when no GPU is at hand).
H200_SMS = 132


@dataclass(frozen=True, order=True)
class HeadConfig:
    """Query/key heads `h_qk` (FLA's H) and value heads `h_v` (FLA's HV); label `h_qk/h_v`."""

    h_qk: int
    h_v: int

    def __post_init__(self):
        if self.h_qk <= 0 or self.h_v <= 0 or self.h_v % self.h_qk:
            raise ValueError(f"head config {self.h_qk}/{self.h_v}: need h_v a positive multiple of h_qk")

    @property
    def label(self) -> str:
        return f"{self.h_qk}/{self.h_v}"


@dataclass(frozen=True)
class Mix:
    """A packed sequence mix: `lengths` in tokens, in packing order; `label` as FlashQLA writes it."""

    label: str
    lengths: tuple[int, ...]

    @property
    def T(self) -> int:
        """Total tokens."""
        return sum(self.lengths)

    @property
    def N(self) -> int:
        """Number of sequences."""
        return len(self.lengths)

    @property
    def cu_seqlens(self) -> list[int]:
        """FlashAttention-style offsets `[0, l1, l1 + l2, ..., T]`."""
        out = [0]
        for n in self.lengths:
            out.append(out[-1] + n)
        return out


@dataclass(frozen=True)
class Row:
    """One benchmark row: a head configuration and a sequence mix."""

    heads: HeadConfig
    mix: Mix

    @property
    def key(self) -> tuple[int, int, str]:
        """(h_qk, h_v, mix label): identifies the row inside one environment key."""
        return (self.heads.h_qk, self.heads.h_v, self.mix.label)

    @property
    def label(self) -> str:
        return f"{self.heads.label} {self.mix.label}"


def parse_heads(text: str) -> HeadConfig:
    """`"16/32"` -> HeadConfig(16, 32). Raises ValueError on anything else."""
    m = re.fullmatch(r"\s*(\d+)\s*/\s*(\d+)\s*", text)
    if not m:
        raise ValueError(f"head config {text!r}: expected h_qk/h_v, e.g. 16/32")
    return HeadConfig(int(m.group(1)), int(m.group(2)))


def parse_mix(text: str) -> Mix:
    """A sequence-mix label -> Mix. Accepts `1x32768`, `8192x4`, `28672+4096`, `1024+7168+...`.

    `AxB`: with A == 1 one sequence of B tokens; otherwise B sequences of A tokens (FlashQLA's
    `8192x4`). Raises ValueError for empty, zero-length or malformed mixes.
    """
    s = text.strip().replace(" ", "")
    if re.fullmatch(r"\d+(\+\d+)*", s):
        lengths = tuple(int(x) for x in s.split("+"))
    else:
        m = re.fullmatch(r"(\d+)x(\d+)", s)
        if not m:
            raise ValueError(f"sequence mix {text!r}: expected e.g. 1x32768, 8192x4 or 28672+4096")
        a, b = int(m.group(1)), int(m.group(2))
        lengths = (b,) if a == 1 else (a,) * b
    if not lengths or min(lengths) <= 0:
        raise ValueError(f"sequence mix {text!r}: every sequence needs at least one token")
    return Mix(s, lengths)


def _split(items) -> list[str]:
    return [x.strip() for it in items or [] for x in it.split(",") if x.strip()]


def filter_rows(heads, mixes, quick: bool, grid_heads, grid_mixes, quick_rows, parse_mix_fn) -> list[Row]:
    """Selection in a grid: the quick rows (`quick_rows`, pairs of labels) or `grid_heads` x
    `grid_mixes`, filtered by the head labels `heads` and the mix labels `mixes` (lists of strings,
    comma-separated entries split; `parse_mix_fn` reads a mix label). A selected head config or mix
    outside the grid becomes an extra row, after the grid's. Raises ValueError on a bad label."""
    head_sel = [parse_heads(h) for h in _split(heads)]
    mix_sel = [parse_mix_fn(m) for m in _split(mixes)]
    wanted = {m.lengths for m in mix_sel}
    if quick:
        rows = [Row(parse_heads(h), parse_mix_fn(m)) for h, m in quick_rows]
        return [r for r in rows if (not head_sel or r.heads in head_sel) and (not wanted or r.mix.lengths in wanted)]
    hs = list(grid_heads) + [h for h in head_sel if h not in grid_heads]
    if head_sel:
        hs = [h for h in hs if h in head_sel]
    known = {m.lengths for m in grid_mixes}
    ms = list(grid_mixes) + [m for m in mix_sel if m.lengths not in known]
    if wanted:
        ms = [m for m in ms if m.lengths in wanted]
    return [Row(h, m) for h in hs for m in ms]


# ---------------------------------------------------------------------------------------- forward

#: FlashQLA's forward head configurations, in its table's order.
FWD_HEADS: tuple[HeadConfig, ...] = tuple(
    parse_heads(h) for h in ("2/8", "4/16", "8/32", "16/64", "16/32", "8/24", "16/48", "16/16", "32/32")
)

#: FlashQLA's forward sequence mixes, in its table's order.
FWD_MIXES: tuple[Mix, ...] = tuple(
    parse_mix(m)
    for m in (
        "1x32768", "1x16384", "1x8192", "1x4096", "1x2048",
        "28672+4096", "24576+8192", "16384+16384", "8192+24576", "4096+28672",
        "12288+4096", "6144+2048", "4096+4096", "2048+6144", "1024+7168",
        "8192x4", "4096x8", "2048x4", "1024x8",
    )
)

#: Forward development rows: two shapes of the 35B model, the long few-head row, the
#: many-short-sequences row at the most heads.
QUICK_ROWS: tuple[tuple[str, str], ...] = (
    ("16/32", "1x8192"),
    ("16/32", "8192x4"),
    ("2/8", "1x32768"),
    ("16/64", "1024x8"),
)

#: The context-parallel grid: the single-sequence rows of the few-head configurations, plus two long
#: sequences for the fewest heads.
CP_GRID_HEADS: tuple[str, ...] = ("2/8", "4/16", "8/32", "16/64")
CP_GRID_MIXES: tuple[str, ...] = ("1x2048", "1x4096", "1x8192", "1x16384", "1x32768")
CP_GRID_LONG: tuple[tuple[str, str], ...] = (
    ("2/8", "1x131072"), ("2/8", "1x1048576"), ("4/16", "1x131072"), ("4/16", "1x1048576"),
)


def fwd_rows() -> list[Row]:
    """The full forward grid, head configuration major (so a peer compiles once per config)."""
    return [Row(h, m) for h in FWD_HEADS for m in FWD_MIXES]


def select_rows(heads: list[str] | None = None, mixes: list[str] | None = None, quick: bool = False) -> list[Row]:
    """Forward rows to run: the quick set or the full grid, filtered by head and mix labels
    (`filter_rows`; e.g. `16/32`, `8192x4`). Order: grid order first, extras after, head config major."""
    return filter_rows(heads, mixes, quick, FWD_HEADS, FWD_MIXES, QUICK_ROWS, parse_mix)


def cp_grid_rows(heads: list[str] | None = None, mixes: list[str] | None = None) -> list[Row]:
    """The rows of the context-parallel grid, head configuration major, ascending T, filtered by head
    and mix labels like `select_rows` (no extras)."""
    hs, ms = {parse_heads(h) for h in _split(heads)}, {parse_mix(m).lengths for m in _split(mixes)}
    pairs = [(h, m) for h in CP_GRID_HEADS for m in CP_GRID_MIXES] + list(CP_GRID_LONG)
    rows = [Row(parse_heads(h), parse_mix(m)) for h, m in pairs]
    rows = [r for r in rows if (not hs or r.heads in hs) and (not ms or r.mix.lengths in ms)]
    return sorted(rows, key=lambda r: ([parse_heads(h) for h in CP_GRID_HEADS].index(r.heads), r.mix.T))


def is_cp_grid_row(h_qk: int, h_v: int, mix: str) -> bool:
    """True for a row of the context-parallel grid (`cp_grid_rows`)."""
    return any(r.heads.h_qk == h_qk and r.heads.h_v == h_v and r.mix.label == mix for r in cp_grid_rows())


# ---------------------------------------------------------------------------------------- backward

#: FlashQLA's backward head configurations, in its table's order.
BWD_HEADS: tuple[HeadConfig, ...] = tuple(parse_heads(h) for h in ("16/32", "8/16", "4/8", "2/4"))
#: Total tokens of the backward rows, and the numbers of sequences they are split into.
BWD_TOTALS: tuple[int, ...] = (8192, 32768)
BWD_COUNTS: tuple[int, ...] = (1, 2, 4, 8)
#: Seed of the random splits (FlashQLA's).
BWD_SEED = 42

#: `random_split(T, n, 42)` for every (T, n) of the grid, pinned (see the module docstring).
BWD_SPLITS: dict[tuple[int, int], tuple[int, ...]] = {
    (8192, 1): (8192,),
    (8192, 2): (7053, 1139),
    (8192, 4): (5809, 1244, 406, 733),
    (8192, 8): (161, 1928, 3157, 563, 1244, 229, 177, 733),
    (32768, 1): (32768,),
    (32768, 2): (7212, 25556),
    (32768, 4): (7212, 7072, 13725, 4759),
    (32768, 8): (3274, 1029, 2909, 5061, 2011, 3793, 9932, 4759),
}

#: Backward development rows: two head configurations only (FlashQLA compiles its backward per head
#: configuration): the 35B model's one long and eight short sequences, and the fewest-heads long
#: sequence.
BWD_QUICK_ROWS: tuple[tuple[str, str], ...] = (
    ("16/32", "32k_1seq"),
    ("16/32", "8k_8seq"),
    ("2/4", "32k_1seq"),
)

_NAME = re.compile(r"\s*(\d+)k_(\d+)seqs?\s*")


def random_split(total: int, n: int, seed: int = BWD_SEED) -> tuple[int, ...]:
    """`n` positive lengths summing to `total`, cut at n - 1 distinct uniform random points of
    1..total-1 (torch CPU generator seeded with `seed`). Raises ValueError unless 1 <= n <= total."""
    import torch

    if not 1 <= n <= total:
        raise ValueError(f"cannot split {total} tokens into {n} non-empty sequences")
    if n == 1:
        return (int(total),)
    gen = torch.Generator().manual_seed(int(seed))
    cuts = sorted(int(c) + 1 for c in torch.randperm(total - 1, generator=gen)[: n - 1].tolist())
    bounds = [0] + cuts + [int(total)]
    return tuple(b - a for a, b in zip(bounds[:-1], bounds[1:]))


def mix_name(T: int, n: int) -> str:
    """FlashQLA's short name of a backward mix: `8k_4seq`, `32k_1seq` (`1000_2seq` off the kilo)."""
    return f"{T // 1024}k_{n}seq" if T % 1024 == 0 else f"{T}_{n}seq"


def short_name(lengths) -> str:
    """The short name of any mix from its lengths: T and the sequence count (`8k_4seq`)."""
    lengths = tuple(int(x) for x in lengths)
    return mix_name(sum(lengths), len(lengths))


def _label(lengths) -> str:
    lengths = tuple(int(x) for x in lengths)
    return f"1x{lengths[0]}" if len(lengths) == 1 else "+".join(str(x) for x in lengths)


def bwd_mix(T: int, n: int, seed: int = BWD_SEED) -> Mix:
    """The mix of T tokens in n random sequences (pinned lengths for the grid's own (T, n, 42)),
    labelled `1xT` for one sequence and `l1+l2+...` otherwise."""
    lengths = BWD_SPLITS.get((T, n)) if seed == BWD_SEED else None
    if lengths is None:
        lengths = random_split(T, n, seed)
    return Mix(_label(lengths), tuple(lengths))


def parse_bwd_mix(text: str) -> Mix:
    """A backward mix from a short name (`8k_4seq`: 8192 tokens in 4 random sequences) or from a
    mix label (`1x8192`, `5000+3192`, `8192x4`; see `parse_mix`). Raises ValueError."""
    m = _NAME.fullmatch(text)
    if m:
        return bwd_mix(int(m.group(1)) * 1024, int(m.group(2)))
    mix = parse_mix(text)
    return Mix(_label(mix.lengths), mix.lengths)


def bwd_mixes() -> tuple[Mix, ...]:
    """The 8 mixes of the backward grid, 8k before 32k, then by sequence count."""
    return tuple(bwd_mix(T, n) for T in BWD_TOTALS for n in BWD_COUNTS)


def bwd_rows() -> list[Row]:
    """The whole backward grid (32 rows), head configuration major."""
    return [Row(h, m) for h in BWD_HEADS for m in bwd_mixes()]


def select_bwd_rows(heads: list[str] | None = None, mixes: list[str] | None = None, quick: bool = False) -> list[Row]:
    """Backward rows to run: the quick set or the whole grid, filtered by head configs and mixes
    (short names such as `8k_4seq` or mix labels). Order as `select_rows`."""
    return filter_rows(heads, mixes, quick, BWD_HEADS, bwd_mixes(), BWD_QUICK_ROWS, parse_bwd_mix)


def rows_for(direction: str, heads=None, mixes=None, quick: bool = False, cp_grid: bool = False) -> list[Row]:
    """The rows of one benchmark: `direction` "fwd" (the forward grid, or with `cp_grid` the
    context-parallel grid) or "bwd" (the backward grid). Raises ValueError on a bad label."""
    if direction == "bwd":
        return select_bwd_rows(heads, mixes, quick)
    return cp_grid_rows(heads, mixes) if cp_grid else select_rows(heads, mixes, quick)


# ---------------------------------------------------------------------------------------- work


def flop(T: int, h_v: int, kind: str = "fwd") -> float:
    """FLOP of one call on T tokens and h_v value heads; `kind` "fwd", "bwd" or "step"."""
    return float(FLOP_PER_TOKEN_HEAD[kind]) * T * h_v


def tflops(ms: float, T: int, h_v: int, kind: str = "fwd") -> float:
    """TFLOP/s of a call of `ms` milliseconds (`kind` as in `flop`)."""
    return flop(T, h_v, kind) / (ms * 1e-3) / 1e12


def peak_tflops(gpu: str) -> float | None:
    """The measured bf16 GEMM rate of the GPU named `gpu` (`PEAK_TFLOPS_BY_GPU`), None if unmeasured."""
    words = str(gpu).upper().replace("-", " ").split()
    return next((v for k, v in PEAK_TFLOPS_BY_GPU.items() if k in words), None)


def pct_of_peak(tf: float, peak: float = PEAK_TFLOPS) -> float:
    """Percentage of the measured bf16 GEMM rate."""
    return 100.0 * tf / peak


def fwd_min_bytes(T: int, N: int, h_qk: int, h_v: int, K: int = K_DIM, V: int = V_DIM) -> int:
    """HBM bytes a fused forward cannot avoid: bf16 q, k (per qk head), v, o (per value head),
    fp32 g and beta, fp32 initial and final state."""
    return T * (2 * 2 * h_qk * K + 2 * 2 * h_v * V + 2 * 4 * h_v) + 2 * 4 * N * h_v * K * V


def effective_parallelism(lengths, h_v: int) -> float:
    """Busy (sequence, value head) pairs, weighted by sequence length over the longest one.

    Without context parallelism one (sequence, head) pair walks its chunks serially on one SM, so
    the longest sequence sets the critical path and the work of the others fills
    `h_v * sum(len) / max(len)` SMs on average over that path.
    """
    lengths = list(lengths)
    return h_v * sum(lengths) / max(lengths)


def is_cp_row(lengths, h_v: int, sm_count: int = H200_SMS) -> bool:
    """A single-sequence few-head row: it belongs to the context-parallel work.

    Both must hold: one sequence dominates (the longest holds at least 3/4 of the tokens) and the
    effective parallelism is below half the SM count, so a kernel that walks each
    (sequence, head) chunk chain serially on one SM leaves most SMs idle whatever it does per chunk.
    """
    lengths = list(lengths)
    dominated = 4 * max(lengths) >= 3 * sum(lengths)
    return dominated and 2 * effective_parallelism(lengths, h_v) < sm_count


def padded_tokens(lengths, chunk: int = CHUNK) -> int:
    """Tokens of the fp64 reference's chunk layout: every sequence padded to whole chunks."""
    return sum(max(1, math.ceil(int(n) / chunk)) for n in lengths) * chunk

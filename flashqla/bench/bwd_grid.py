"""The backward benchmark grid, and the work of one backward and of one training step.

The grid is FlashQLA's published H200 backward table (`benchmark/bench_gated_delta_rule.py` of
QwenLM/FlashQLA, its backward head and sequence configurations): 4 head configurations (h_qk / h_v
16/32, 8/16, 4/8, 2/4) x 2 totals (8192 and 32768 tokens) x 4 sequence counts (1, 2, 4, 8) = 32
rows, K = V = 128, bf16 q/k/v/do, fp32 g/beta/states, packed varlen (B = 1, `cu_seqlens`).

Sequence lengths: a total of T tokens in n sequences is cut at n - 1 distinct random points drawn
uniformly from 1..T-1 (`random_split`: the first n - 1 entries of a seeded random permutation of
1..T-1 on torch's CPU generator, sorted). With seed 42 this reproduces the lengths of FlashQLA's
table; `BWD_SPLITS` holds them as constants so that every machine and torch version benchmarks the
same rows (tests/test_bench_bwd.py checks that `random_split` still gives them). A row's key
carries the lengths themselves: its mix label is `1x8192` for one sequence and `l1+l2+...`
otherwise (`grid.parse_mix` reads both); the short name (`8k_4seq`) is for the tables.

Work (DESIGN.md section 6): a backward counts 491,520 FLOP per token and value head at
K = V = 128, C = 64 ((16 d^2 + 28 C d): 8 state-class GEMMs and about 14 intra-chunk GEMMs); a
training step (forward + backward) counts 163,840 + 491,520 = 655,360. TFLOP/s are reported on
these counts and as a share of the 726 TFLOP/s bf16 GEMM rate measured on our H200.
"""

from __future__ import annotations

import math
import re

from flashqla.bench.grid import (
    CHUNK,
    FWD_FLOP_PER_TOKEN_HEAD,
    K_DIM,
    V_DIM,
    HeadConfig,
    Mix,
    Row,
    filter_rows,
    parse_heads,
    parse_mix,
)

__all__ = [
    "BWD_FLOP_PER_TOKEN_HEAD",
    "STEP_FLOP_PER_TOKEN_HEAD",
    "BWD_HEADS",
    "BWD_TOTALS",
    "BWD_COUNTS",
    "BWD_SEED",
    "BWD_SPLITS",
    "BWD_QUICK_ROWS",
    "random_split",
    "bwd_mix",
    "parse_bwd_mix",
    "bwd_mixes",
    "bwd_rows",
    "select_bwd_rows",
    "mix_name",
    "short_name",
    "bwd_flop",
    "step_flop",
    "bwd_tflops",
    "step_tflops",
    "padded_tokens",
]

#: Backward FLOP per token and value head at K = V = 128, C = 64 (DESIGN.md section 6).
BWD_FLOP_PER_TOKEN_HEAD = 16 * K_DIM * V_DIM + 28 * CHUNK * K_DIM
assert BWD_FLOP_PER_TOKEN_HEAD == 491_520
#: Training step (forward + backward) FLOP per token and value head.
STEP_FLOP_PER_TOKEN_HEAD = FWD_FLOP_PER_TOKEN_HEAD + BWD_FLOP_PER_TOKEN_HEAD
assert STEP_FLOP_PER_TOKEN_HEAD == 655_360

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

#: Development rows: two head configurations only (FlashQLA compiles its backward per head
#: configuration, 100 to 290 s each): the 35B model's one long and eight short sequences, and the
#: fewest-heads long sequence.
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
    """FlashQLA's short name of a backward mix: `8k_4seq`, `32k_1seq`."""
    return f"{T // 1024}k_{n}seq" if T % 1024 == 0 else f"{T}_{n}seq"


def _label(lengths) -> str:
    lengths = tuple(int(x) for x in lengths)
    return f"1x{lengths[0]}" if len(lengths) == 1 else "+".join(str(x) for x in lengths)


def bwd_mix(T: int, n: int, seed: int = BWD_SEED) -> Mix:
    """The mix of T tokens in n random sequences (pinned lengths for the grid's own (T, n, 42))."""
    lengths = BWD_SPLITS.get((T, n)) if seed == BWD_SEED else None
    if lengths is None:
        lengths = random_split(T, n, seed)
    return Mix(_label(lengths), tuple(lengths))


def parse_bwd_mix(text: str) -> Mix:
    """A backward mix from a short name (`8k_4seq`: 8192 tokens in 4 random sequences) or from an
    explicit mix label (`1x8192`, `5000+3192`, `8192x4`; see `grid.parse_mix`). Raises ValueError."""
    m = _NAME.fullmatch(text)
    if m:
        return bwd_mix(int(m.group(1)) * 1024, int(m.group(2)))
    mix = parse_mix(text)
    return Mix(_label(mix.lengths), mix.lengths)


def bwd_mixes() -> tuple[Mix, ...]:
    """The 8 mixes of the grid, 8k before 32k, then by sequence count."""
    return tuple(bwd_mix(T, n) for T in BWD_TOTALS for n in BWD_COUNTS)


def bwd_rows() -> list[Row]:
    """The whole backward grid (32 rows), head configuration major (a peer compiles once per config)."""
    return [Row(h, m) for h in BWD_HEADS for m in bwd_mixes()]


def select_bwd_rows(heads: list[str] | None = None, mixes: list[str] | None = None, quick: bool = False) -> list[Row]:
    """Rows to run: the quick set or the whole grid, filtered by head configs and mixes.

    `heads`: labels such as `16/32`; `mixes`: short names (`8k_4seq`) or explicit labels
    (comma-separated strings are split). A head config or mix outside the grid is an extra row.
    Order: grid order first, extras after, head configuration major.
    """
    return filter_rows(heads, mixes, quick, BWD_HEADS, bwd_mixes(), BWD_QUICK_ROWS, parse_bwd_mix)


def short_name(lengths) -> str:
    """`8k_4seq` for a grid mix (any mix: T and the sequence count)."""
    lengths = tuple(int(x) for x in lengths)
    return mix_name(sum(lengths), len(lengths))


def bwd_flop(T: int, h_v: int) -> float:
    """Backward FLOP of one call: 491,520 per token and value head."""
    return float(BWD_FLOP_PER_TOKEN_HEAD) * T * h_v


def step_flop(T: int, h_v: int) -> float:
    """Forward + backward FLOP: 655,360 per token and value head."""
    return float(STEP_FLOP_PER_TOKEN_HEAD) * T * h_v


def bwd_tflops(ms: float, T: int, h_v: int) -> float:
    """TFLOP/s of a backward of `ms` milliseconds."""
    return bwd_flop(T, h_v) / (ms * 1e-3) / 1e12


def step_tflops(ms: float, T: int, h_v: int) -> float:
    """TFLOP/s of a training step (forward + backward) of `ms` milliseconds."""
    return step_flop(T, h_v) / (ms * 1e-3) / 1e12


def padded_tokens(lengths, chunk: int = CHUNK) -> int:
    """Tokens of the fp64 reference's layout: every sequence padded to the longest one's chunks."""
    lengths = [int(x) for x in lengths]
    return len(lengths) * max(1, max(math.ceil(n / chunk) for n in lengths)) * chunk

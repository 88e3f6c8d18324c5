"""The forward benchmark grid, and the work and byte counts of one row.

The grid is FlashQLA's published H200 forward table (`benchmark/bench_gated_delta_rule.py` of
QwenLM/FlashQLA, the `FWD_MODEL_CONFIGS` x `FWD_SEQLEN_CONFIGS` product): 9 head configurations
(h_qk / h_v, Qwen3.5/3.6 models under tensor parallelism) x 19 sequence mixes = 171 rows, with
K = V = 128, bf16 q/k/v, fp32 g/beta/states, always packed varlen (B = 1 with `cu_seqlens`, also
for a single sequence).

A sequence mix is written the way FlashQLA labels it: `1x32768` (one sequence of 32768 tokens),
`28672+4096` (two sequences, in this order), `8192x4` (four sequences of 8192 tokens). `AxB` reads
"A sequences of B tokens" when A is 1, and "sequences of A tokens, B of them" otherwise, exactly as
in FlashQLA's labels (`1x32768` and `8192x4`); `parse_mix` accepts both and never guesses: the
count is the side that is not a plausible length (`1` on the left, or the smaller side on the
right).

Work (DESIGN.md section 6): the forward counts 163,840 FLOP per token and value head (K = V = 128,
C = 64: three state GEMMs of 2 C K V and four intra-chunk GEMMs of 2 C^2 K per chunk). TFLOP/s are
reported on that count and as a share of the 726 TFLOP/s bf16 GEMM rate measured on our H200.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

__all__ = [
    "HeadConfig",
    "Mix",
    "Row",
    "FWD_HEADS",
    "FWD_MIXES",
    "QUICK_ROWS",
    "K_DIM",
    "V_DIM",
    "CHUNK",
    "FWD_FLOP_PER_TOKEN_HEAD",
    "PEAK_TFLOPS",
    "H200_SMS",
    "parse_heads",
    "parse_mix",
    "fwd_rows",
    "select_rows",
    "filter_rows",
    "fwd_flop",
    "tflops",
    "pct_of_peak",
    "fwd_min_bytes",
    "effective_parallelism",
    "is_cp_row",
]

#: Head dimensions of the grid (FlashQLA asserts K = V = 128).
K_DIM = 128
V_DIM = 128
#: Chunk length of every implementation on Hopper.
CHUNK = 64
#: Forward FLOP per token and value head at K = V = 128, C = 64 (DESIGN.md section 6):
#: (6 d^2 + 8 C d) with d = 128.
FWD_FLOP_PER_TOKEN_HEAD = 6 * K_DIM * V_DIM + 8 * CHUNK * K_DIM
assert FWD_FLOP_PER_TOKEN_HEAD == 163_840
#: bf16 dense GEMM rate measured on our H200 through torch (8192^3), TFLOP/s.
PEAK_TFLOPS = 726.0
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

#: A handful of rows for development: two shapes of the 35B model, the long few-head row, the
#: many-short-sequences row at the most heads.
QUICK_ROWS: tuple[tuple[str, str], ...] = (
    ("16/32", "1x8192"),
    ("16/32", "8192x4"),
    ("2/8", "1x32768"),
    ("16/64", "1024x8"),
)


#: The context-parallel benchmark (`--cp-grid`): the grid's single-sequence rows for the few-head
#: configurations, plus two long sequences for the fewest heads (memory permitting).
CP_GRID_HEADS: tuple[str, ...] = ("2/8", "4/16", "8/32", "16/64")
CP_GRID_MIXES: tuple[str, ...] = ("1x2048", "1x4096", "1x8192", "1x16384", "1x32768")
CP_GRID_LONG: tuple[tuple[str, str], ...] = (
    ("2/8", "1x131072"), ("2/8", "1x1048576"), ("4/16", "1x131072"), ("4/16", "1x1048576"),
)


def cp_grid_rows(heads: list[str] | None = None, mixes: list[str] | None = None) -> list[Row]:
    """The rows of the context-parallel benchmark, head configuration major, ascending T, filtered
    by head and mix labels like `select_rows`."""
    def split(items):
        return [x.strip() for it in items or [] for x in it.split(",") if x.strip()]

    hs, ms = {parse_heads(h) for h in split(heads)}, {parse_mix(m).lengths for m in split(mixes)}
    pairs = [(h, m) for h in CP_GRID_HEADS for m in CP_GRID_MIXES] + list(CP_GRID_LONG)
    rows = [Row(parse_heads(h), parse_mix(m)) for h, m in pairs]
    rows = [r for r in rows if (not hs or r.heads in hs) and (not ms or r.mix.lengths in ms)]
    return sorted(rows, key=lambda r: ([parse_heads(h) for h in CP_GRID_HEADS].index(r.heads), r.mix.T))


def is_cp_grid_row(h_qk: int, h_v: int, mix: str) -> bool:
    """True for a row of the context-parallel benchmark (`cp_grid_rows`)."""
    return any(r.heads.h_qk == h_qk and r.heads.h_v == h_v and r.mix.label == mix for r in cp_grid_rows())


def fwd_rows() -> list[Row]:
    """The full forward grid, head configuration major (so a peer compiles once per config)."""
    return [Row(h, m) for h in FWD_HEADS for m in FWD_MIXES]


def select_rows(heads: list[str] | None = None, mixes: list[str] | None = None, quick: bool = False) -> list[Row]:
    """Rows to run: the quick set or the full grid, filtered by head and mix labels.

    `heads` / `mixes`: labels such as `16/32` and `8192x4` (comma-separated strings are split).
    A head config or mix outside the published grid is allowed (an extra row), so new shapes can be
    timed with the same harness. Order: grid order first, extras after, head config major.
    """
    return filter_rows(heads, mixes, quick, FWD_HEADS, FWD_MIXES, QUICK_ROWS, parse_mix)


def filter_rows(heads, mixes, quick: bool, grid_heads, grid_mixes, quick_rows, parse_mix_fn) -> list[Row]:
    """Shared selection of the forward and backward grids: the quick rows (`quick_rows`, pairs of
    labels) or the grid `grid_heads` x `grid_mixes`, filtered by the head labels `heads` and the mix
    labels `mixes` (lists of strings, comma-separated entries split; `parse_mix_fn` reads a mix
    label). A selected head config or mix outside the grid becomes an extra row, after the grid's."""
    def split(items):
        out = []
        for it in items or []:
            out += [x for x in it.split(",") if x.strip()]
        return out

    head_sel = [parse_heads(h) for h in split(heads)]
    mix_sel = [parse_mix_fn(m) for m in split(mixes)]
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


def fwd_flop(T: int, h_v: int) -> float:
    """Forward FLOP of one call: 163,840 per token and value head."""
    return float(FWD_FLOP_PER_TOKEN_HEAD) * T * h_v


def tflops(ms: float, T: int, h_v: int) -> float:
    """TFLOP/s achieved by a forward of `ms` milliseconds on T tokens and h_v value heads."""
    return fwd_flop(T, h_v) / (ms * 1e-3) / 1e12


def pct_of_peak(tf: float, peak: float = PEAK_TFLOPS) -> float:
    """Percentage of the measured bf16 GEMM rate."""
    return 100.0 * tf / peak


def fwd_min_bytes(T: int, N: int, h_qk: int, h_v: int, K: int = K_DIM, V: int = V_DIM) -> int:
    """HBM bytes a fused forward cannot avoid: bf16 q, k (per qk head), v, o (per value head),
    fp32 g and beta, fp32 initial and final state (peers.md section 7)."""
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

"""Who holds which tokens: the shard plan of context parallelism across ranks (`CPContext`).

A packed batch (B = 1) of N sequences with global offsets `cu_seqlens` [0, ..., T] is cut into W
contiguous token shards, one per rank of a process group: rank r holds tokens [start_r, end_r) with
end_r - start_r = shard_lens[r] (zero allowed). Sequences may cross shard boundaries. On rank r the
shard is a packed batch of its own: the "pieces" are the non-empty intersections of the global
sequences with [start_r, end_r), in order, with rank-local offsets `local_cu_seqlens`. Only the first
piece can continue a sequence begun on an earlier rank (`first_continues`) and only the last piece can
continue on a later rank (`last_continues`).

Ownership (each global sequence row of `initial_state` / `final_state` belongs to exactly one rank):
the rank holding a sequence's first token reads its initial state and returns its d initial_state;
the rank holding its last token returns its final state. An empty sequence (length 0) at offset p
belongs to the rank whose shard contains token p (the last rank when p == T).

Building a context reads `cu_seqlens` on the host once (a GPU tensor costs one synchronisation); with
`local_len` it also all-gathers one int64 per rank (the shard lengths). Everything else is plain
Python on host integers.
"""

from __future__ import annotations

import bisect
import numbers
from dataclasses import dataclass, field

import torch

__all__ = ["CPContext", "build_cp_context", "even_shard_lens"]


def even_shard_lens(total: int, world_size: int) -> tuple[int, ...]:
    """The default split of `total` tokens over `world_size` ranks, `torch.tensor_split`'s rule:
    every rank gets total // world_size tokens and the first total % world_size ranks one more (ranks
    past `total` get none when total < world_size). Returns a tuple of world_size ints."""
    base, extra = divmod(int(total), int(world_size))
    return tuple(base + (1 if r < extra else 0) for r in range(int(world_size)))


@dataclass(frozen=True, eq=False)
class CPContext:
    """The shard plan of one rank (build it with `build_cp_context`).

    Attributes (global):
        group: the torch.distributed process group the op exchanges over (None: a context built from
            explicit rank / world_size, which can plan and slice but runs the op only when
            world_size == 1).
        rank, world_size: this process's rank in `group` and the group's size W.
        cu_seqlens: tuple of N + 1 ints, the global offsets [0, ..., T].
        shard_lens: tuple of W ints, tokens per rank (sum T).
    Attributes (this rank):
        start, end: the shard's global token range [start, end).
        piece_seqs: global sequence index of every local piece (tuple of n ints; empty sequences
            never form a piece).
        local_offsets: tuple of n + 1 ints, the pieces' rank-local offsets [0, ..., end - start].
        first_continues / last_continues: the first / last piece's sequence starts on an earlier /
            ends on a later rank.
        start_rank: rank holding the first token of the first piece's sequence (== rank unless
            first_continues); end_rank: rank holding the last token of the last piece's sequence.
        empty_seqs: the empty sequences this rank owns (their final state is their initial state).
    """

    group: object | None
    rank: int
    world_size: int
    cu_seqlens: tuple
    shard_lens: tuple
    start: int
    end: int
    piece_seqs: tuple
    local_offsets: tuple
    first_continues: bool
    last_continues: bool
    start_rank: int
    end_rank: int
    empty_seqs: tuple
    _device_cache: dict = field(default_factory=dict, repr=False, compare=False)

    @property
    def N(self) -> int:
        """Number of global sequences."""
        return len(self.cu_seqlens) - 1

    @property
    def total_len(self) -> int:
        """T, the global packed token count."""
        return self.cu_seqlens[-1]

    @property
    def local_len(self) -> int:
        """Tokens on this rank (end - start)."""
        return self.end - self.start

    @property
    def num_pieces(self) -> int:
        """n, the number of local pieces."""
        return len(self.piece_seqs)

    @property
    def local_cu_seqlens(self) -> torch.Tensor:
        """[n + 1] int64 CPU tensor of the pieces' rank-local offsets (FLA's rank-local cu_seqlens)."""
        return torch.tensor(self.local_offsets, dtype=torch.int64)

    def shard(self, x: torch.Tensor, dim: int = 1) -> torch.Tensor:
        """This rank's slice [start, end) of a global tensor along `dim` (tokens; default 1, FLA's
        [B, T, ...] layout). A view. Raises ValueError when x.shape[dim] != T."""
        if x.shape[dim] != self.total_len:
            raise ValueError(f"x has {x.shape[dim]} tokens along dim {dim}, the context's global T is {self.total_len}")
        return x.narrow(dim, self.start, self.local_len)

    def _tensor(self, key: str, values, device, dtype=torch.int64) -> torch.Tensor:
        """A small index tensor on `device`, built once per (key, device, dtype)."""
        ck = (key, str(device), dtype)
        t = self._device_cache.get(ck)
        if t is None:
            t = torch.tensor(list(values), dtype=dtype, device=device)
            self._device_cache[ck] = t
        return t


def _as_offsets(cu_seqlens) -> tuple:
    if isinstance(cu_seqlens, torch.Tensor):
        if cu_seqlens.dtype not in (torch.int32, torch.int64):
            raise TypeError(f"cu_seqlens must have dtype int32 or int64, got {cu_seqlens.dtype}")
        if cu_seqlens.dim() != 1 or cu_seqlens.numel() < 2:
            raise ValueError(f"cu_seqlens must be 1-D with at least 2 entries [N + 1], got shape {tuple(cu_seqlens.shape)}")
        if cu_seqlens.device.type == "meta":
            raise ValueError("cu_seqlens is on the meta device, which holds no values: the shard plan needs them")
        cu = tuple(int(c) for c in cu_seqlens.detach().to("cpu", torch.int64).tolist())
    elif isinstance(cu_seqlens, (list, tuple)):
        if len(cu_seqlens) < 2 or not all(isinstance(c, numbers.Integral) and not isinstance(c, bool) for c in cu_seqlens):
            raise TypeError("cu_seqlens given as a sequence must hold at least 2 ints [0, ..., T]")
        cu = tuple(int(c) for c in cu_seqlens)
    else:
        raise TypeError(f"cu_seqlens must be None, an int32/int64 tensor [N + 1] or a list of ints, got {type(cu_seqlens).__name__}")
    if cu[0] != 0:
        raise ValueError(f"cu_seqlens must start at 0, got cu_seqlens[0] = {cu[0]}")
    for i in range(len(cu) - 1):
        if cu[i + 1] < cu[i]:
            raise ValueError(f"cu_seqlens must be non-decreasing, got cu_seqlens[{i}] = {cu[i]} > cu_seqlens[{i + 1}] = {cu[i + 1]}")
    return cu


def _check_shard_lens(shard_lens, world_size: int) -> tuple:
    if isinstance(shard_lens, torch.Tensor):
        shard_lens = shard_lens.tolist()
    if not isinstance(shard_lens, (list, tuple)):
        raise TypeError(f"shard_lens must be a list of {world_size} ints, got {type(shard_lens).__name__}")
    if len(shard_lens) != world_size:
        raise ValueError(f"shard_lens must hold one length per rank ({world_size}), got {len(shard_lens)}")
    out = []
    for r, n in enumerate(shard_lens):
        if isinstance(n, bool) or not isinstance(n, numbers.Integral) or n < 0:
            raise ValueError(f"shard_lens[{r}] must be a non-negative int, got {n!r}")
        out.append(int(n))
    return tuple(out)


def _process_group(group):
    import torch.distributed as dist

    if not dist.is_available():
        raise RuntimeError("torch.distributed is not available in this PyTorch build")
    if not dist.is_initialized():
        raise RuntimeError(
            "torch.distributed is not initialized: call torch.distributed.init_process_group first, or pass "
            "rank= and world_size= to build a context that only plans"
        )
    if group is None:
        group = dist.group.WORLD
    rank = dist.get_rank(group)
    if rank < 0:
        raise ValueError("group: this process is not a member of the given process group")
    return group, rank, dist.get_world_size(group)


def _gather_lengths(local_len: int, group, world_size: int, device) -> tuple:
    import torch.distributed as dist

    if device is None:
        device = torch.device("cuda", torch.cuda.current_device()) if dist.get_backend(group) == "nccl" else torch.device("cpu")
    x = torch.tensor([int(local_len)], dtype=torch.int64, device=device)
    out = torch.empty(world_size, dtype=torch.int64, device=device)
    gather = getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor
    gather(out, x, group=group)
    return tuple(int(n) for n in out.tolist())


def _owner(ends: tuple, p: int) -> int:
    """Rank whose shard holds token p (the last rank for p == T)."""
    return min(bisect.bisect_right(ends, p), len(ends) - 1)


def _plan(cu: tuple, lens: tuple, rank: int) -> dict:
    ends = tuple(sum(lens[: r + 1]) for r in range(len(lens)))
    start, end = ends[rank] - lens[rank], ends[rank]
    N = len(cu) - 1
    empty = tuple(n for n in range(N) if cu[n] == cu[n + 1] and _owner(ends, cu[n]) == rank)
    plan = dict(start=start, end=end, empty_seqs=empty, piece_seqs=(), local_offsets=(0,), first_continues=False,
                last_continues=False, start_rank=rank, end_rank=rank)
    if start == end:
        return plan
    lo = bisect.bisect_right(cu, start) - 1  # sequence holding token `start` (cu[lo] <= start < cu[lo + 1])
    hi = bisect.bisect_right(cu, end - 1) - 1  # sequence holding token end - 1
    seqs = tuple(n for n in range(lo, hi + 1) if cu[n + 1] > cu[n])
    plan.update(
        piece_seqs=seqs,
        local_offsets=(0, *(min(cu[n + 1], end) - start for n in seqs)),
        first_continues=cu[lo] < start,
        last_continues=cu[hi + 1] > end,
        start_rank=_owner(ends, cu[lo]),
        end_rank=_owner(ends, cu[hi + 1] - 1),
    )
    return plan


def build_cp_context(
    cu_seqlens=None,
    group=None,
    *,
    shard_lens=None,
    local_len: int | None = None,
    rank: int | None = None,
    world_size: int | None = None,
    device=None,
) -> CPContext:
    """The shard plan of this rank for a packed batch split over a process group.

    Args:
        cu_seqlens: the GLOBAL offsets [0, l1, l1 + l2, ..., T] of the packed batch before sharding
            (int32/int64 tensor on any device, read once on the host, or a list of ints), or None for
            one sequence of all T tokens (T then comes from shard_lens or local_len).
        group: torch.distributed process group (None: the default group). Ignored with rank= /
            world_size=.
        shard_lens: W non-negative ints, tokens held by each rank in rank order (sum T). Default: the
            even split `even_shard_lens(T, W)` (torch.tensor_split's rule; T % W need not be 0 and
            ranks may hold no token when T < W).
        local_len: this rank's token count; the lengths of all ranks are then all-gathered (one int64
            per rank over `group`, on `device` or, by default, the current CUDA device for NCCL and
            the CPU otherwise). Give shard_lens or local_len, not both.
        rank, world_size: build without torch.distributed (planning, slicing, tests); the context
            then has no group and the op runs on it only when world_size == 1.

    Returns:
        CPContext.

    Raises:
        TypeError: cu_seqlens / shard_lens of the wrong kind or dtype.
        ValueError: cu_seqlens not starting at 0 or decreasing; shard_lens of the wrong length,
            negative, or not summing to cu_seqlens[-1]; both shard_lens and local_len; neither
            cu_seqlens nor a way to know T; rank / world_size out of range or only one of them;
            this process not in `group`.
        RuntimeError: torch.distributed unavailable or not initialized (without rank= / world_size=).

    Source: the shape of FLA's `fla.ops.cp.build_cp_context` (global cu_seqlens and a group in,
    rank-local offsets out), with per-rank shard lengths and owned state rows added.
    """
    if (rank is None) != (world_size is None):
        raise ValueError("rank and world_size must be given together (or neither, to take them from the process group)")
    if rank is not None:
        for name, x in (("rank", rank), ("world_size", world_size)):
            if isinstance(x, bool) or not isinstance(x, numbers.Integral):
                raise TypeError(f"{name} must be an int, got {type(x).__name__}")
        if world_size < 1 or not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, world_size) with world_size >= 1, got rank={rank}, world_size={world_size}")
        group, rank, world_size = None, int(rank), int(world_size)
    else:
        group, rank, world_size = _process_group(group)
    if shard_lens is not None and local_len is not None:
        raise ValueError("give shard_lens (every rank's length) or local_len (this rank's, gathered), not both")
    cu = None if cu_seqlens is None else _as_offsets(cu_seqlens)
    if local_len is not None:
        if isinstance(local_len, bool) or not isinstance(local_len, numbers.Integral) or local_len < 0:
            raise ValueError(f"local_len must be a non-negative int, got {local_len!r}")
        if group is None:
            if world_size != 1:
                raise ValueError("local_len needs a process group to gather the other ranks' lengths; pass shard_lens")
            lens = (int(local_len),)
        else:
            lens = _gather_lengths(local_len, group, world_size, device)
    elif shard_lens is not None:
        lens = _check_shard_lens(shard_lens, world_size)
    else:
        if cu is None:
            raise ValueError("cu_seqlens is None: give cu_seqlens, shard_lens or local_len so that T is known")
        lens = even_shard_lens(cu[-1], world_size)
    if cu is None:
        cu = (0, sum(lens))
    if sum(lens) != cu[-1]:
        raise ValueError(
            f"the shard lengths {list(lens)} sum to {sum(lens)} tokens but cu_seqlens[-1] = {cu[-1]} (the global T)"
        )
    return CPContext(group=group, rank=rank, world_size=world_size, cu_seqlens=cu, shard_lens=lens, **_plan(cu, lens, rank))

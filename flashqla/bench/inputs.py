"""The inputs of a benchmark row, seeded and drawn once per head configuration.

`InputFactory(device, t_max, seed, grads)` draws with `flashqla.testing.make_gdn_inputs` (the valid
domain: L2-normalised q and k, v ~ N(0, 1), Qwen3-Next's gate, beta = sigmoid, value head 0 with
g = 0 and the last value head with g = -30) bf16 q/k/v and fp32 g/beta at `t_max` tokens, once per
head configuration; a row takes the first T tokens of that draw, packs them with its `cu_seqlens`
(int32) and gets `initial_state` ~ N(0, 1) fp32 [N, HV, K, V] from a generator seeded by the row.
With `grads` (the backward benchmark) also the output gradients: `do` ~ N(0, 1) bf16 [1, T, HV, V]
(one draw per head configuration, first T tokens) and `dht` ~ N(0, 1) fp32 [N, HV, K, V] (seeded
per row). scale = K ** -0.5.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from flashqla.bench.grid import K_DIM, V_DIM, HeadConfig, Row

__all__ = ["RowInputs", "InputFactory"]


def _offsets(lengths) -> list[int]:
    out = [0]
    for n in lengths:
        out.append(out[-1] + n)
    return out


@dataclass
class RowInputs:
    """The tensors of one row (FLA layout, packed varlen, B = 1); `do` and `dht` for the backward."""

    q: torch.Tensor           # [1, T, H, K] bf16
    k: torch.Tensor           # [1, T, H, K] bf16
    v: torch.Tensor           # [1, T, HV, V] bf16
    g: torch.Tensor           # [1, T, HV] fp32, natural-log decay per token
    beta: torch.Tensor        # [1, T, HV] fp32
    h0: torch.Tensor          # [N, HV, K, V] fp32
    cu_seqlens: torch.Tensor  # [N + 1] int32
    lengths: tuple[int, ...]
    do: torch.Tensor | None = None   # [1, T, HV, V] bf16
    dht: torch.Tensor | None = None  # [N, HV, K, V] fp32
    scale: float = K_DIM**-0.5

    @property
    def cu_seqlens_cpu(self) -> torch.Tensor:
        """A host copy of `cu_seqlens` (int64, from `lengths`; no device read): the context-parallel
        planner's length hint that ours takes, as FLA's argument of that name."""
        return torch.tensor(_offsets(self.lengths), dtype=torch.int64)


class InputFactory:
    """Inputs per row (see the module docstring); `grads` adds `do` and `dht`."""

    def __init__(self, device, t_max: int, seed: int = 0, grads: bool = False):
        self.device, self.t_max, self.seed, self.grads = device, int(t_max), int(seed), bool(grads)
        self._heads: HeadConfig | None = None
        self._base: dict | None = None
        self._do_key = None
        self._do = None

    def get(self, row: Row) -> RowInputs:
        from flashqla.testing import make_gdn_inputs

        T, N, HV = row.mix.T, row.mix.N, row.heads.h_v
        if self._heads != row.heads or self._base is None or self._base["q"].shape[1] < T:
            self._base = None
            if torch.cuda.is_available():
                torch.cuda.empty_cache()
            self._base = make_gdn_inputs(
                B=1, T=max(self.t_max, T), H=row.heads.h_qk, HV=HV, K=K_DIM, V=V_DIM,
                dtype=torch.bfloat16, device=self.device, gate="qwen3next", special_heads=True,
                initial_state=False, beta_dtype=torch.float32, seed=self.seed,
            )
            self._heads = row.heads
        b = self._base

        def head(x):
            return x[:, :T].contiguous()

        gen = torch.Generator(device=self.device).manual_seed(self.seed + 7919 * N + T)
        h0 = torch.randn(N, HV, K_DIM, V_DIM, generator=gen, device=self.device, dtype=torch.float32)
        cu = torch.tensor(row.mix.cu_seqlens, dtype=torch.int32, device=self.device)
        x = RowInputs(head(b["q"]), head(b["k"]), head(b["v"]), head(b["g"]), head(b["beta"]), h0, cu, row.mix.lengths)
        if self.grads:
            if self._do_key != row.heads or self._do is None or self._do.shape[1] < T:
                self._do = None
                gen = torch.Generator(device=self.device).manual_seed(self.seed + 104_729 + HV)
                self._do = torch.randn(1, max(self.t_max, T), HV, V_DIM, generator=gen, device=self.device,
                                       dtype=torch.float32).to(torch.bfloat16)
                self._do_key = row.heads
            gen = torch.Generator(device=self.device).manual_seed(self.seed + 15_485_863 + 7919 * N + T)
            x.dht = torch.randn(N, HV, K_DIM, V_DIM, generator=gen, device=self.device, dtype=torch.float32)
            x.do = self._do[:, :T].contiguous()
        return x

    def release(self) -> None:
        self._base = None
        self._heads = None
        self._do = None
        self._do_key = None

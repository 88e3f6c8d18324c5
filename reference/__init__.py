"""Plain-PyTorch reference of Gated DeltaNet chunked prefill (fp64-capable, runs on CPU).

- `reference.gdn.recurrent`: the token recurrence, ground truth.
- `reference.gdn.chunk` / `reference.gdn.chunk_bwd`: FLA's per-step chunked forward and backward.
- `reference.gdn.op`: `chunk_gated_delta_rule`, the public op (FLA's signature) built on them.
"""

from .gdn.op import chunk_gated_delta_rule
from .gdn.recurrent import recurrent_gated_delta_rule

__all__ = ["chunk_gated_delta_rule", "recurrent_gated_delta_rule"]

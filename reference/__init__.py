"""Plain-PyTorch reference of Gated DeltaNet chunked prefill (fp64-capable, runs on CPU).

- `reference.gdn.recurrent`: the token recurrence, ground truth.
- `reference.gdn.chunk` / `reference.gdn.chunk_bwd`: FLA's per-step chunked forward and backward.
"""

from reference.gdn.recurrent import recurrent_gated_delta_rule

__all__ = ["recurrent_gated_delta_rule"]

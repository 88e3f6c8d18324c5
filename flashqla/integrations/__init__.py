"""Adapters that plug `flashqla.chunk_gated_delta_rule` into model code of other libraries.

- `flashqla.integrations.qwen3_next`: transformers' Qwen3-Next gated-delta-net layer (swap the
  layer's chunked gated delta rule; build a small random model; loss and every gradient).

Nothing here is imported by `import flashqla`; each module imports its library on first use.
"""

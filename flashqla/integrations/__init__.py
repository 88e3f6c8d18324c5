"""Adapters that plug `flashqla.chunk_gated_delta_rule` into model code of other libraries.

- `flashqla.integrations.qwen3_next`: transformers' Qwen3-Next gated-delta-net layer.
  `qwen3_next.enable(model)` attaches the op through transformers' kernel mapping (`kernels`) where
  the installed transformers has one, else through the layer's older call sites; the module also
  builds a small random model and returns the loss and every gradient for the tests.

Nothing here is imported by `import flashqla`; each module imports its library on first use.
"""

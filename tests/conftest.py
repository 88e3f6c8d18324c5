"""Shared pytest hooks. Markers are declared in pyproject.toml; this file only skips `gpu` tests
where no CUDA GPU of compute capability 9.0 (Hopper) is present."""

from __future__ import annotations

import functools

import pytest
import torch

GPU_SKIP_REASON = "needs a CUDA GPU of compute capability 9.0"


@functools.cache
def _has_sm90() -> bool:
    if not torch.cuda.is_available():
        return False
    return any(torch.cuda.get_device_capability(i) == (9, 0) for i in range(torch.cuda.device_count()))


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not _has_sm90():
        pytest.skip(GPU_SKIP_REASON)

"""Shared pytest hooks. Markers are declared in pyproject.toml; this file skips `gpu` tests where no
CUDA GPU of compute capability 9.0 (Hopper) is present, deselects the `compile_all` tests unless asked
for, and restores the environment variables the
benchmark harness sets for its own process (FLASHQLA_CP) after every test."""

from __future__ import annotations

import functools
import os

import pytest
import torch

GPU_SKIP_REASON = "needs a CUDA GPU of compute capability 9.0"


@functools.cache
def _has_sm90() -> bool:
    if not torch.cuda.is_available():
        return False
    return any(torch.cuda.get_device_capability(i) == (9, 0) for i in range(torch.cuda.device_count()))


def pytest_addoption(parser) -> None:
    parser.addoption("--compile-all", action="store_true", default=False,
                     help="also run the tests marked compile_all (every kernel build of the compile tier)")


def pytest_collection_modifyitems(config, items) -> None:
    """Deselects the `compile_all` tests unless asked for (`--compile-all`, or a -m expression that
    names compile_all): the default run compiles each kernel family once."""
    if config.getoption("--compile-all") or "compile_all" in (config.getoption("-m") or ""):
        return
    keep = [it for it in items if it.get_closest_marker("compile_all") is None]
    if len(keep) != len(items):
        config.hook.pytest_deselected(items=[it for it in items if it.get_closest_marker("compile_all") is not None])
        items[:] = keep


def pytest_runtest_setup(item: pytest.Item) -> None:
    if item.get_closest_marker("gpu") is not None and not _has_sm90():
        pytest.skip(GPU_SKIP_REASON)


#: variables the code under test may set in os.environ itself (`flashqla.bench`'s apply_cp_mode)
_RESTORED_ENV = ("FLASHQLA_CP",)


@pytest.fixture(autouse=True)
def _restore_env():
    saved = {k: os.environ.get(k) for k in _RESTORED_ENV}
    yield
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v

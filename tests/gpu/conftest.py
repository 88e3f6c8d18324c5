"""GPU tier hooks. Under pytest-xdist (`-n W`) each worker gets cpu_count // W torch threads: the
fp64 reference runs on the host, and W workers with a full thread pool each oversubscribe the
cores (a first parallel run of this tier spent most of its time that way)."""

from __future__ import annotations

import os

import torch


def pytest_configure(config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))

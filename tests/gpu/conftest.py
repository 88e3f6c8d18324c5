"""GPU tier hooks. Under pytest-xdist (`-n W`) each worker gets cpu_count // W torch threads: the
fp64 reference runs on the host, and W workers with a full thread pool each oversubscribe the
cores (a first parallel run of this tier spent most of its time that way). With output capture off
(`-s`, as `run_device.sh` runs the tier) each test's duration is printed as it ends: pytest's own
per-test times (console_output_style "times") are not shown then, and a file cut by its time box
never reaches --durations' summary."""

from __future__ import annotations

import os

import torch


#: set at configure time: whether output capture is off (`-s`)
_CAPTURE_OFF = [False]


def pytest_configure(config) -> None:
    workers = os.environ.get("PYTEST_XDIST_WORKER_COUNT")
    if workers:
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // int(workers)))
    _CAPTURE_OFF[0] = config.getoption("capture") == "no"


def pytest_runtest_logreport(report) -> None:
    if report.when == "call" and _CAPTURE_OFF[0]:
        print(f" [{report.duration:.1f} s]", flush=True)

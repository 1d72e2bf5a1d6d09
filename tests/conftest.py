"""Shared fixtures: the `accel` fixture runs one test body on every available device, and on
the CPU both ways: gathers aliasing host homes (the default) and copying them, as on a GPU;
`swap` is a swap store in the test's own directory, closed (and removed) after it."""

from __future__ import annotations

import logging
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from infinity.accelerator import CpuAccelerator
from infinity.swap.store import SwapStore

_KINDS = ["cpu", "cpu_copy", "cuda"]


@pytest.fixture(params=_KINDS)
def accel(request):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("CUDA is not available on this machine")
        from infinity.accelerator.cuda import CudaAccelerator

        return CudaAccelerator()
    return CpuAccelerator(alias_host=request.param == "cpu")


@pytest.fixture
def quiet_root_logger():
    """`infinity.cli.main` configures logging once per process; for tests that call it
    in-process, keep it from binding a handler to one test's captured stderr."""
    root = logging.getLogger()
    saved = root.handlers[:]
    root.handlers = [logging.NullHandler()]
    yield
    root.handlers = saved


@pytest.fixture
def swap(tmp_path):
    with SwapStore(tmp_path, run_id="t") as store:
        yield store


@pytest.fixture
def run_bench():
    """Runs a benchmark as its command line does (`run_bench("-m", "benchmarks.x", *args)` or
    `run_bench("benchmarks/x.py", *args)`) from the repository root, with the root on
    PYTHONPATH and `env` added to the environment; returns the finished process, its output
    as text."""
    root = Path(__file__).resolve().parents[1]

    def run(*argv: str, timeout: float = 120, **env: str) -> subprocess.CompletedProcess:
        return subprocess.run(
            [sys.executable, *argv],
            capture_output=True,
            text=True,
            timeout=timeout,
            cwd=root,
            env=dict(os.environ, PYTHONPATH=str(root), **env),
        )

    return run

"""Shared fixtures: the `accel` fixture runs one test body on every available device, and on
the CPU both ways: gathers aliasing host homes (the default) and copying them, as on a GPU."""

from __future__ import annotations

import pytest
import torch

from infinity.accelerator import CpuAccelerator

_KINDS = ["cpu", "cpu_copy", "cuda"]


@pytest.fixture(params=_KINDS)
def accel(request):
    if request.param == "cuda":
        if not torch.cuda.is_available():
            pytest.skip("CUDA is not available on this machine")
        from infinity.accelerator.cuda import CudaAccelerator

        return CudaAccelerator()
    return CpuAccelerator(alias_host=request.param == "cpu")

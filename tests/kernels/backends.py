"""Backend parameters for the shared correctness grid: each compiled backend skips, with its reason, where it cannot run."""

from __future__ import annotations

import pytest

from orchard.kernels.backends import cpu_kernel_available, cuda_available, metal_available

REFERENCE = pytest.param("reference", id="reference")
CPU = pytest.param(
    "cpu",
    id="cpu",
    marks=[pytest.mark.skipif(not cpu_kernel_available(),
                              reason="the CPU attention extension is not built here (python -m orchard.kernels.cpu.build)")],
)
METAL = pytest.param(
    "metal",
    id="metal",
    marks=[pytest.mark.metal, pytest.mark.skipif(not metal_available(), reason="Metal kernels need an Apple GPU (macOS)")],
)
CUDA = pytest.param(
    "cuda",
    id="cuda",
    marks=[pytest.mark.cuda, pytest.mark.skipif(not cuda_available(), reason="MLX has no CUDA device here")],
)
ALL_BACKENDS = [REFERENCE, CPU, METAL, CUDA]
#: the backends that take values of another head dim than keys
HOST_PLANNED = [REFERENCE, CPU]

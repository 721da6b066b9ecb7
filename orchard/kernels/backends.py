"""Which attention backend runs: Metal on a Mac, CUDA where MLX drives an NVIDIA GPU, the CPU kernel
where MLX runs on the CPU and it is built (orchard/kernels/cpu), else the reference.

An argument beats the environment variable, which beats the device's default, so a test
or a benchmark can pin a backend without touching the engine. Only names here: the plan and
the dispatch both ask which backend runs, and neither needs the other to know.
"""

from __future__ import annotations

import os

import mlx.core as mx

from orchard.kernels.errors import BackendUnavailable, UnknownBackend

ENV_VAR = "ORCHARD_ATTENTION_BACKEND"
BACKENDS = ("reference", "metal", "cuda", "cpu")
#: Backends planned on the host, step by step, as MLX ops (the reference's gathers and SDPA, or the CPU
#: kernel's one primitive): any value head dim, no compiled launch plan, no traced decode graphs.
HOST_PLANNED = ("reference", "cpu")


def metal_available() -> bool:
    return mx.metal.is_available()


def cuda_available() -> bool:
    return hasattr(mx, "cuda") and mx.cuda.is_available()


def cpu_kernel_available() -> bool:
    """The CPU extension is built and MLX computes on the CPU by default (no GPU to prefer)."""
    from orchard.kernels.cpu import loaded

    return loaded() and mx.default_device() == mx.cpu


def available_backends() -> list[str]:
    """Backends that can run here, best first; "reference" is always last and always present."""
    checks = (("metal", metal_available), ("cuda", cuda_available), ("cpu", cpu_kernel_available))
    return [name for name, ok in checks if ok()] + ["reference"]


def default_backend() -> str:
    """The environment's choice when it names one, else the best backend this machine has."""
    requested = os.environ.get(ENV_VAR, "").strip().lower()
    if requested:
        return _checked(requested)
    return available_backends()[0]


def resolve_backend(name: str | None) -> str:
    return default_backend() if name is None else _checked(name.strip().lower())


def _checked(name: str) -> str:
    if name not in BACKENDS:
        raise UnknownBackend(f"unknown attention backend {name!r}; expected one of {BACKENDS}")
    if name not in available_backends():
        raise BackendUnavailable(f"attention backend {name!r} cannot run here; available: {available_backends()}")
    return name

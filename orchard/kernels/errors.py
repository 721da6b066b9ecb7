"""Named failures of the attention kernels, so callers can tell a bad request from a missing device."""

from __future__ import annotations


class KernelError(Exception):
    """Base of every error the kernels package raises."""


class InvalidAttentionMetadata(KernelError, ValueError):
    """Block tables, lengths or query offsets that disagree with each other or with the tensors."""


class UnknownBackend(KernelError, ValueError):
    """A backend name that is none of "reference", "metal", "cuda", "cpu"."""


class BackendUnavailable(KernelError, RuntimeError):
    """A backend that exists but cannot run on this machine (no Metal on Linux, no CUDA device)."""


class UnsupportedAttentionShape(KernelError, ValueError):
    """A head size, block size or dtype a compiled kernel was not written for."""

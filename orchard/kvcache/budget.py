"""How many KV blocks a pool may have, and how models in one process share that memory.

A pool is sized once, when its model loads: from an explicit block count, an explicit
size in GiB, or a fraction of the memory still free after the weights are in. Two
models in one process each get a quota of one `MemoryBudget`; each sizes its own pool
within its quota, so neither can ever evict the other's blocks.
"""

from __future__ import annotations

import logging
import os
import sys
import threading

from orchard.kvcache.errors import QuotaExceeded
from orchard.kvcache.geometry import KVGeometry

log = logging.getLogger(__name__)

GIB = 1 << 30
MIN_BLOCKS = 2  # the null block and one usable block
DEFAULT_MEMORY_FRACTION = 0.5


def num_blocks_for(geometry: KVGeometry, config, *, budget: MemoryBudget | None = None,
                   model_name: str | None = None) -> int:
    """Blocks for a pool of `geometry` under `config` (fields num_blocks, kv_memory_gb,
    memory_fraction, block_size), capped by `model_name`'s unreserved quota in `budget`."""
    _check_block_size(geometry, config)
    explicit = getattr(config, "num_blocks", None)
    if explicit is not None:
        if explicit < MIN_BLOCKS:
            raise ValueError(f"num_blocks must be at least {MIN_BLOCKS}, got {explicit}")
        blocks = int(explicit)
    else:
        blocks = max(MIN_BLOCKS, _memory_for_kv(config) // geometry.bytes_per_block)
    if budget is None:
        return blocks
    if model_name is None:
        raise ValueError("a budget needs the model_name whose quota sizes the pool")
    return _capped_by_quota(blocks, geometry, budget, model_name)


def _check_block_size(geometry: KVGeometry, config) -> None:
    block_size = getattr(config, "block_size", None)
    if block_size is not None and block_size != geometry.block_size:
        raise ValueError(f"config.block_size {block_size} disagrees with the geometry's {geometry.block_size}")


def _memory_for_kv(config) -> int:
    """Bytes for KV: an explicit size when the config has one, else a fraction of free memory."""
    gigabytes = getattr(config, "kv_memory_gb", None)
    if gigabytes is not None:
        if gigabytes <= 0:
            raise ValueError(f"kv_memory_gb must be positive, got {gigabytes}")
        return int(gigabytes * GIB)
    fraction = getattr(config, "memory_fraction", None)
    fraction = DEFAULT_MEMORY_FRACTION if fraction is None else fraction
    if not 0 < fraction <= 1:
        raise ValueError(f"memory_fraction must be in (0, 1], got {fraction}")
    return int(fraction * free_memory_bytes())


def _capped_by_quota(blocks: int, geometry: KVGeometry, budget: MemoryBudget, model_name: str) -> int:
    affordable = budget.available(model_name) // geometry.bytes_per_block
    if affordable < MIN_BLOCKS:
        raise QuotaExceeded(
            f"model {model_name!r} has {budget.available(model_name)} bytes of KV quota left; "
            f"a pool needs at least {MIN_BLOCKS * geometry.bytes_per_block}"
        )
    return min(blocks, affordable)


def free_memory_bytes() -> int:
    """Memory a new KV pool may still take: the GPU working set on macOS, else the OS's view."""
    if sys.platform == "darwin":
        metal = _metal_headroom()
        if metal is not None:
            return metal
    for probe in (_meminfo_available, _sysconf_available):
        found = probe()
        if found is not None:
            return found
    raise RuntimeError("cannot tell how much memory is free; set kv_memory_gb or num_blocks")


def _metal_headroom() -> int | None:
    """Recommended working set minus what MLX holds already (the weights, mostly)."""
    try:
        import mlx.core as mx

        info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
        recommended = int(info["max_recommended_working_set_size"])
        return max(0, recommended - int(mx.get_active_memory()))
    except Exception as err:  # no Metal device, or an MLX without these calls
        log.debug("no Metal working-set figure: %s", err)
        return None


def _meminfo_available() -> int | None:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        return None
    return None


def _sysconf_available() -> int | None:
    try:
        return os.sysconf("SC_AVPHYS_PAGES") * os.sysconf("SC_PAGE_SIZE")
    except (ValueError, OSError, AttributeError):
        return None


class MemoryBudget:
    """Bytes of KV memory shared by the models of one process, split by explicit quotas.

    A quota is a hard wall: a model's reservations never exceed its own quota and never
    touch another's, so one model's load cannot shrink the other's cache.
    """

    def __init__(self, total_bytes: int):
        if total_bytes <= 0:
            raise ValueError(f"total_bytes must be positive, got {total_bytes}")
        self.total_bytes = int(total_bytes)
        self._quotas: dict[str, int] = {}
        self._reserved: dict[str, int] = {}
        self._lock = threading.Lock()

    def set_quota(self, model_name: str, nbytes: int) -> None:
        """Give `model_name` a quota; all quotas together may not exceed the total."""
        if nbytes < 0:
            raise ValueError(f"a quota cannot be negative, got {nbytes}")
        with self._lock:
            others = sum(q for name, q in self._quotas.items() if name != model_name)
            if others + nbytes > self.total_bytes:
                raise ValueError(
                    f"quota {nbytes} for {model_name!r} exceeds the budget: {self.total_bytes - others} "
                    f"of {self.total_bytes} bytes are not assigned to other models"
                )
            if nbytes < self._reserved.get(model_name, 0):
                raise ValueError(
                    f"quota {nbytes} for {model_name!r} is below the {self._reserved[model_name]} bytes it holds"
                )
            self._quotas[model_name] = int(nbytes)

    def reserve(self, model_name: str, nbytes: int) -> None:
        """Take `nbytes` of `model_name`'s quota, or raise QuotaExceeded and take nothing."""
        if nbytes < 0:
            raise ValueError(f"cannot reserve a negative amount, got {nbytes}")
        with self._lock:
            held = self._reserved.get(model_name, 0)
            quota = self._quotas.get(model_name, 0)
            if held + nbytes > quota:
                raise QuotaExceeded(
                    f"model {model_name!r} asked for {nbytes} bytes with {held} of its {quota}-byte quota in use"
                )
            self._reserved[model_name] = held + int(nbytes)

    def release(self, model_name: str, nbytes: int) -> None:
        """Give back `nbytes` that `model_name` reserved earlier."""
        with self._lock:
            held = self._reserved.get(model_name, 0)
            if not 0 <= nbytes <= held:
                raise ValueError(f"model {model_name!r} cannot release {nbytes} bytes; it holds {held}")
            self._reserved[model_name] = held - int(nbytes)

    def quota(self, model_name: str) -> int:
        """The model's quota in bytes; 0 for a model that was never given one."""
        return self._quotas.get(model_name, 0)

    def reserved(self, model_name: str) -> int:
        return self._reserved.get(model_name, 0)

    def available(self, model_name: str) -> int:
        """Bytes of the model's quota not reserved yet."""
        return self.quota(model_name) - self.reserved(model_name)

    @property
    def unassigned(self) -> int:
        """Bytes of the total that no quota covers yet."""
        return self.total_bytes - sum(self._quotas.values())

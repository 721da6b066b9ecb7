"""What a node says about its machine: the chip and how much memory it has.

The dashboard and `orchard status` show it, and routing across mixed Macs starts from it.
On a Mac MLX's device info names the chip (e.g. "Apple M4 Max") and its unified memory;
elsewhere the CPU model from /proc/cpuinfo and the RAM the OS reports stand in.
"""

from __future__ import annotations

import os
import platform


def _mlx_device_info() -> dict:
    try:
        import mlx.core as mx

        if mx.metal.is_available():
            return dict(mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info())
    except Exception:  # MLX missing or without a GPU: fall back to the OS
        pass
    return {}


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _ram_bytes() -> int:
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):
        return 0


def describe_machine() -> dict:
    """{"chip": name, "memory_bytes": total memory} of this machine."""
    info = _mlx_device_info()
    return {
        "chip": str(info.get("device_name") or _cpu_model()),
        "memory_bytes": int(info.get("memory_size") or _ram_bytes()),
    }

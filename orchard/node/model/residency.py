"""Keep the weights and the KV pool wired on a Mac, so the OS never pages them out mid-step.

Unified memory is shared with everything else on the machine; without a wired limit,
macOS may compress or page out parts of a large pool under pressure and a decode step
then stalls on page faults. The limit covers weights plus pool, never more than the
GPU's recommended working set. Elsewhere (Linux, CUDA) this does nothing.
"""

from __future__ import annotations

import logging

import mlx.core as mx
from mlx.utils import tree_flatten

log = logging.getLogger(__name__)


def model_nbytes(model) -> int:
    return sum(v.nbytes for _, v in tree_flatten(model.parameters()))


def wire_model_and_pool(model, pool_nbytes: int) -> int | None:
    """Set MLX's wired limit to weights + pool (capped); returns the limit set, or None."""
    if not mx.metal.is_available():
        return None
    info = mx.device_info() if hasattr(mx, "device_info") else mx.metal.device_info()
    cap = int(info.get("max_recommended_working_set_size", 0))
    need = model_nbytes(model) + int(pool_nbytes)
    limit = min(need, cap) if cap else need
    mx.set_wired_limit(limit)
    if cap and need > cap:
        log.warning("weights + KV pool (%.1f GB) exceed the recommended working set (%.1f GB)", need / 1e9, cap / 1e9)
    return limit

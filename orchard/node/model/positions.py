"""Per-token rotary positions for packed batches, slipped under mlx-lm's own attention modules.

A packed step holds decode tokens and prefill chunks of many sequences, each token at its
own position, and runs as a batch of one-token rows `[total_tokens, 1]` (node.model.runner):
mlx-lm's attention calls `self.rope(x, offset=cache.offset)` with `x` as `[T, H, 1, D]`, and
`mx.fast.rope` takes one offset per batch row, so per-token positions need no reshaping.
The paged cache hands out a `PackedPositions` as its `offset`; any other offset (an int from
mlx-lm's own caches) passes through untouched, so the same model object still runs
`mlx_lm.generate` for reference.

On MLX's CPU build `mx.fast.rope` is made of ops: every call computes the cosines and sines of its
rows' angles and then rotates, for the queries and again for the keys of every layer. For the
ropes whose call hands `x` to `mx.fast.rope` as it is (`TABLED_ROPES`), a step's tables are taken
once from the model's own rope, which rotates a probe of ones and zeros into exactly its cosines
and sines, and every layer rotates with them in one pass (`kernels.cpu.rotate_rows`): the same
products and differences, so the same bits.
"""

from __future__ import annotations

import hashlib
from dataclasses import dataclass, field

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.rope_utils import Llama3RoPE

from orchard.kernels import cpu as cpu_kernels
from orchard.node.model.layers import attention_layers, attention_of

#: rope classes whose `__call__` passes `x` to `mx.fast.rope` unscaled, with its `dims`, `traditional`,
#: `base`, `scale` and `_freqs` as they are: their rotation is the probe's cosines and sines
TABLED_ROPES = (nn.RoPE, Llama3RoPE)


@dataclass(frozen=True)
class PackedPositions:
    """Absolute position of every token of a packed step, int32 `[total_tokens]`; and the step's
    rotation tables, made on first use and shared by every layer whose rope has the same key."""

    array: mx.array
    tables: dict[str, tuple[mx.array, mx.array]] = field(default_factory=dict, compare=False, hash=False, repr=False)

    def rotation(self, rope: nn.Module, key: str) -> tuple[mx.array, mx.array]:
        """(cos, sin) `[T, rope.dims / 2]` of `rope` at these positions: `rope` rotating rows of ones then zeros."""
        if key not in self.tables:
            rows, width = self.array.shape[0], rope.dims
            half = width // 2
            probe = mx.concatenate([mx.ones((rows, 1, 1, half)), mx.zeros((rows, 1, 1, half))], axis=-1)
            both = rope(probe, offset=self.array).reshape(rows, width)
            self.tables[key] = (both[:, :half], both[:, half:])
        return self.tables[key]


class PositionalRoPE(nn.Module):
    """Wraps an attention module's rope; applies per-token positions when given `PackedPositions`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        # a string, so not a parameter of the module; None where the CPU kernels do not serve (a GPU)
        self.table_key = table_key(inner) if cpu_kernels.elementwise_serve_here() else None

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if not isinstance(offset, PackedPositions):
            return self.inner(x, offset=offset)
        if x.shape[2] != 1 or x.shape[0] != offset.array.shape[0]:
            raise ValueError(f"packed positions need one token per batch row, [{offset.array.shape[0]}, H, 1, D]; "
                             f"got {tuple(x.shape)}")
        if self.table_key is not None and x.dtype == cpu_kernels.ELEMENTWISE_DTYPE and x.shape[-1] == self.inner.dims:
            cos, sin = offset.rotation(self.inner, self.table_key)
            return cpu_kernels.rotate_rows(x, cos, sin)
        return self.inner(x, offset=offset.array)


def table_key(rope: nn.Module) -> str | None:
    """What makes two ropes' tables the same, for a `TABLED_ROPES` rope that rotates halves; else None."""
    if type(rope) not in TABLED_ROPES or getattr(rope, "traditional", True):
        return None
    freqs = getattr(rope, "_freqs", None)
    digest = "" if freqs is None else hashlib.sha1(np.array(freqs.astype(mx.float32)).tobytes()).hexdigest()
    return f"{type(rope).__name__}|{rope.dims}|{getattr(rope, 'base', None)}|{getattr(rope, 'scale', None)}|{digest}"


def install_positional_rope(model: nn.Module) -> int:
    """Wrap the rope of every attention layer once; returns how many were wrapped now."""
    wrapped = 0
    for _, layer in attention_layers(model):
        attention = attention_of(layer)
        if not isinstance(attention.rope, PositionalRoPE):
            attention.rope = PositionalRoPE(attention.rope)
            wrapped += 1
    return wrapped

"""Per-token rotary positions for packed batches, slipped under mlx-lm's own attention modules.

A packed step holds decode tokens and prefill chunks of many sequences, each token at its
own position, and runs as a batch of one-token rows `[total_tokens, 1]` (node.model.runner):
mlx-lm's attention calls `self.rope(x, offset=cache.offset)` with `x` as `[T, H, 1, D]`, and
`mx.fast.rope` takes one offset per batch row, so per-token positions need no reshaping.
The paged cache hands out a `PackedPositions` as its `offset`; any other offset (an int from
mlx-lm's own caches) passes through untouched, so the same model object still runs
`mlx_lm.generate` for reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from orchard.node.model.layers import attention_layers, attention_of


@dataclass(frozen=True)
class PackedPositions:
    """Absolute position of every token of a packed step, int32 `[total_tokens]`."""

    array: mx.array


class PositionalRoPE(nn.Module):
    """Wraps an attention module's rope; applies per-token positions when given `PackedPositions`."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner

    def __call__(self, x: mx.array, offset=0) -> mx.array:
        if not isinstance(offset, PackedPositions):
            return self.inner(x, offset=offset)
        if x.shape[2] != 1 or x.shape[0] != offset.array.shape[0]:
            raise ValueError(f"packed positions need one token per batch row, [{offset.array.shape[0]}, H, 1, D]; "
                             f"got {tuple(x.shape)}")
        return self.inner(x, offset=offset.array)


def install_positional_rope(model: nn.Module) -> int:
    """Wrap the rope of every attention layer once; returns how many were wrapped now."""
    wrapped = 0
    for _, layer in attention_layers(model):
        attention = attention_of(layer)
        if not isinstance(attention.rope, PositionalRoPE):
            attention.rope = PositionalRoPE(attention.rope)
            wrapped += 1
    return wrapped

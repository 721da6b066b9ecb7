"""Per-token rotary positions for packed batches, slipped under mlx-lm's own attention modules.

A packed step is one row `[1, total_tokens]` holding decode tokens and prefill chunks of
many sequences, so each token has its own position. mlx-lm's attention calls
`self.rope(x, offset=cache.offset)`, and `mx.fast.rope` accepts one offset per batch row
but not per token. Reshaping `[1, H, T, D]` to `[T, H, 1, D]` turns every token into its
own batch row, which rope does accept. The paged cache hands out a `PackedPositions` as
its `offset`; any other offset (an int from mlx-lm's own caches) passes through untouched,
so the same model object still runs `mlx_lm.generate` for reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import mlx.nn as nn

from node.layers import attention_of


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
        if x.shape[0] != 1:
            raise ValueError(f"packed positions need a batch of one row, got {x.shape[0]}")
        # Swapping the batch and token axes is one strided view each way: [1,H,T,D] <-> [T,H,1,D].
        rotated = self.inner(mx.swapaxes(x, 0, 2), offset=offset.array)
        return mx.swapaxes(rotated, 0, 2)


def install_positional_rope(model: nn.Module) -> int:
    """Wrap the rope of every attention layer once; returns how many were wrapped now."""
    wrapped = 0
    for layer in model.layers:
        attention = attention_of(layer)
        if not isinstance(attention.rope, PositionalRoPE):
            attention.rope = PositionalRoPE(attention.rope)
            wrapped += 1
    return wrapped

"""What one layer adds to causal softmax attention: a sliding window, attention sinks, soft-capped scores.

Layers of one model differ (Gemma 3 has five windowed layers to one global, gpt-oss
alternates), while a step's plan is shared by every layer; so these travel with each
attention call, never with the plan. Their values reach the compiled kernels as run-time
inputs (one compiled variant serves every window); only whether a layer has each of them
is a template constant (`LayerInputs.template`), so plain layers compile without their code.

- window W: the query at position p sees the keys at positions (p - W, p], itself included,
  as mlx-lm's `create_causal_mask(window_size=W)` and its `RotatingKVCache(max_size=W)` do;
- sinks: one learned logit per query head that joins the softmax denominator only
  (gpt-oss), exactly what `mx.fast.scaled_dot_product_attention(sinks=)` computes;
- softcap c: scaled scores s become c * tanh(s / c) before the softmax (Gemma 2).
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx

from orchard.kernels.errors import InvalidAttentionMetadata
from orchard.kernels.source import NO_SINK

LOG2E = 1.4426950408889634


@dataclass(frozen=True)
class LayerAttention:
    """One layer's additions to causal attention; the default adds nothing."""

    window: int | None = None
    softcap: float | None = None
    sinks: mx.array | None = None  # [num_heads]

    def __post_init__(self):
        if self.window is not None and (int(self.window) != self.window or self.window < 1):
            raise InvalidAttentionMetadata(f"a sliding window holds at least one key, got {self.window!r}")
        if self.softcap is not None and not self.softcap > 0:
            raise InvalidAttentionMetadata(f"a soft cap must be positive, got {self.softcap!r}")
        if self.sinks is not None and self.sinks.ndim != 1:
            raise InvalidAttentionMetadata(f"sinks hold one logit per query head, got shape {self.sinks.shape}")

    @property
    def window_or_zero(self) -> int:
        """The window as the kernels read it: 0 for none."""
        return 0 if self.window is None else int(self.window)

    @property
    def softcap_base2(self) -> float:
        """The cap in the kernels' base-2 score units (0 for none): c * tanh(s / c) scaled by log2(e)."""
        return 0.0 if self.softcap is None else float(self.softcap) * LOG2E

    def check_heads(self, num_heads: int) -> None:
        if self.sinks is not None and self.sinks.shape[0] != num_heads:
            raise InvalidAttentionMetadata(f"{self.sinks.shape[0]} sinks for {num_heads} query heads")


PLAIN = LayerAttention()


def layer_attention(window: int | None = None, softcap: float | None = None, sinks: mx.array | None = None) -> LayerAttention:
    """The public entries' keywords as one value; PLAIN when none is given."""
    if window is None and softcap is None and sinks is None:
        return PLAIN
    return LayerAttention(window, softcap, sinks)


@dataclass(frozen=True)
class LayerInputs:
    """A layer's additions as the compiled kernels' inputs (orchard/kernels/source.py names them)."""

    scale: mx.array  # float32 [2]: the softmax scale, the soft cap in base-2 units (0: none)
    window: mx.array  # int32 [1]: keys a query sees (0: all)
    sinks: mx.array  # float32 [num_heads]: base-2 sink logits, NO_SINK where the layer has none
    capped: bool = False  # the layer soft-caps: the kernels' SOFTCAP template constant
    windowed: bool = False  # WINDOWED
    sunk: bool = False  # the layer has sinks: SINKS

    @property
    def template(self) -> list:
        """Which additions the layer has, as the kernels' template constants: plain layers compile without them."""
        return [("SOFTCAP", int(self.capped)), ("WINDOWED", int(self.windowed)), ("SINKS", int(self.sunk))]


class LayerInputCache:
    """Device arrays of the layers' additions, made once per distinct value: every value is a
    model's constant (48 layers use two windows and one scale), so one cache serves every step
    and no step uploads them again (`layer_inputs`)."""

    def __init__(self, num_heads: int):
        self.num_heads = num_heads
        self._arrays: dict = {}

    def __call__(self, scale: float, layer: LayerAttention) -> LayerInputs:
        return LayerInputs(
            self._get(("scale", scale, layer.softcap_base2), lambda: mx.array([scale, layer.softcap_base2], dtype=mx.float32)),
            self._get(("window", layer.window_or_zero), lambda: mx.array([layer.window_or_zero], dtype=mx.int32)),
            self._sinks(layer.sinks),
            capped=layer.softcap is not None, windowed=layer.window is not None, sunk=layer.sinks is not None,
        )

    def _sinks(self, sinks: mx.array | None) -> mx.array:
        if sinks is None:
            return self._get(("no sinks",), lambda: mx.full((self.num_heads,), NO_SINK, dtype=mx.float32))
        # Keyed by identity: a model's sinks are one array per layer; the entry keeps it alive, so the id stays its own.
        key = ("sinks", id(sinks))
        if key not in self._arrays:
            self._arrays[key] = (sinks, sinks.astype(mx.float32) * LOG2E)
        return self._arrays[key][1]

    def _get(self, key, make):
        if key not in self._arrays:
            self._arrays[key] = make()
        return self._arrays[key]


_SHARED: dict[int, LayerInputCache] = {}


def layer_inputs(num_heads: int, scale: float, layer: LayerAttention) -> LayerInputs:
    """A layer's additions as kernel inputs, from the one process-wide cache for `num_heads`."""
    if num_heads not in _SHARED:
        _SHARED[num_heads] = LayerInputCache(num_heads)
    return _SHARED[num_heads](scale, layer)

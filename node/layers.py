"""Where a decoder layer of an mlx-lm model keeps its attention module.

Most families name it `self_attn`; InternLM2 names it `attention`, others `attn`. The
engine looks for the child that holds a rope under those names, so one rule serves every
place that reaches into a layer (the loader's checks, the rope wrapper, the KV geometry).
"""

from __future__ import annotations

ATTENTION_NAMES = ("self_attn", "attention", "attn")


def attention_of(layer):
    """The layer's attention module (the first of ATTENTION_NAMES holding a rope), or None."""
    for name in ATTENTION_NAMES:
        module = getattr(layer, name, None)
        if module is not None and "rope" in module:
            return module
    return None

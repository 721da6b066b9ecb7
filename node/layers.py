"""Where an mlx-lm model keeps its text model, and a decoder layer its attention module.

Most families name the attention `self_attn`; InternLM2 names it `attention`, others
`attn`. The engine looks for the child that holds a rope under those names, so one rule
serves every place that reaches into a layer (the loader's checks, the rope wrapper, the KV
geometry). Multimodal wrappers (Mistral 3, Gemma 3) hold the text model as
`language_model` and only delegate to it; the engine drives that text model itself.
"""

from __future__ import annotations

ATTENTION_NAMES = ("self_attn", "attention", "attn")


def text_model(model):
    """The model the engine drives: a wrapper's `language_model`, else the model itself."""
    inner = getattr(model, "language_model", None)
    return inner if inner is not None and not hasattr(model, "model") else model


def text_config(config: dict) -> dict:
    """The text model's config: a wrapper's `text_config`, else the config itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and inner.get("model_type") else config


def attention_of(layer):
    """The layer's attention module (the first of ATTENTION_NAMES holding a rope), or None."""
    for name in ATTENTION_NAMES:
        module = getattr(layer, name, None)
        if module is not None and "rope" in module:
            return module
    return None

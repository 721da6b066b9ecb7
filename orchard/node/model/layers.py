"""Where an mlx-lm model keeps its text model, its decoder stack, and a layer its attention module.

Most families name the attention `self_attn`; InternLM2 names it `attention`, others
`attn` (EXAONE one level deeper, `attn.attention`). The engine looks for the module that
holds a rope under those names, so one rule serves every place that reaches into a layer
(the loader's checks, the rope wrapper, the KV geometry). The decoder stack is `model`
(`transformer` in EXAONE), its final norm `norm` (`ln_f`). Multimodal wrappers (Mistral 3,
Gemma 3) hold the text model as `language_model` and only delegate to it; the engine drives
that text model itself.
"""

from __future__ import annotations

ATTENTION_NAMES = ("self_attn", "attention", "attn")
STACK_NAMES = ("model", "transformer")
FINAL_NORM_NAMES = ("norm", "ln_f")


def text_model(model):
    """The model the engine drives: a wrapper's `language_model`, else the model itself."""
    inner = getattr(model, "language_model", None)
    if inner is None:
        return model
    # Qwen3.5's wrapper also exposes the text stack as `model`, a property that delegates to it
    delegated = getattr(model, "model", None)
    return inner if delegated is None or delegated is getattr(inner, "model", None) else model


def text_config(config: dict) -> dict:
    """The text model's config: a wrapper's `text_config`, else the config itself."""
    inner = config.get("text_config")
    return inner if isinstance(inner, dict) and inner.get("model_type") else config


def stack_name(model) -> str:
    """The attribute holding the model's decoder stack (the one its `__call__` runs)."""
    for name in STACK_NAMES:
        if getattr(model, name, None) is not None:
            return name
    raise AttributeError(f"{type(model).__qualname__} has no decoder stack at {' or '.join(STACK_NAMES)}")


def text_stack(model):
    return getattr(model, stack_name(model))


def final_norm(stack):
    """The stack's last norm (never quantized, so its weight tells the activations' dtype)."""
    for name in FINAL_NORM_NAMES:
        if getattr(stack, name, None) is not None:
            return getattr(stack, name)
    raise AttributeError(f"{type(stack).__qualname__} has no final norm at {' or '.join(FINAL_NORM_NAMES)}")


def attention_of(layer, depth: int = 2):
    """The layer's attention module: the first module under ATTENTION_NAMES holding a rope,
    looked for down to `depth` levels; None when there is none."""
    for name in ATTENTION_NAMES:
        module = getattr(layer, name, None)
        if module is None:
            continue
        if "rope" in module:
            return module
        inner = attention_of(module, depth - 1) if depth > 1 else None
        if inner is not None:
            return inner
    return None


def attention_layers(model) -> list:
    """`(index, layer)` of the layers that attend over KV: all but a hybrid model's recurrent-state
    layers (node.model.state_layers), which keep no KV and have no rope."""
    from orchard.node.model.state_layers import state_module_of

    return [(i, layer) for i, layer in enumerate(model.layers) if state_module_of(layer) is None]

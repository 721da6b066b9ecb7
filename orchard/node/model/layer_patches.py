"""Two families whose layers reach past the three seams, patched into the shape the seams expect.

The engine pages a model through its layers' KV caches, their ropes and their module's
`scaled_dot_product_attention` (node.model.runner). Two mlx-lm families do one more thing:

- Gemma 2's attention multiplies queries and keys itself, to soft-cap the scores, so there
  is no attention call to route. Its class's `__call__` is wrapped: over the engine's
  caches it runs Gemma 2's projections, rope and K/V store as written, then the module's
  attention call with `softcap=` (which the paged kernels apply); over any other cache it
  runs mlx-lm's own code untouched.
- Ministral 3 scales queries by position outside the rope (Llama 4's attention scaling,
  computed from `cache.offset`). Handed the positions as an array `[T]`, mlx-lm's function
  already gives each one-token row its own scale `[T, 1, 1, 1]`; it is only handed the
  array that `PackedPositions` holds.

Each patch is made once per mlx-lm module, by the first model that needs it, and changes
nothing for caches other than the engine's, so `mlx_lm.generate` runs mlx-lm's own code.
"""

from __future__ import annotations

import sys

from orchard.node.model.layers import attention_layers, attention_of
from orchard.node.model.positions import PackedPositions

_PATCHED_MARK = "_orchard_layer_patch"


def install_layer_patches(model) -> None:
    """Patch every family of `model`'s attention layers that needs it; idempotent."""
    for module_name in dict.fromkeys(type(attention_of(layer)).__module__ for _, layer in attention_layers(model)):
        patch = _PATCHES.get(module_name)
        if patch is not None and not getattr(sys.modules[module_name], _PATCHED_MARK, False):
            patch(sys.modules[module_name])
            setattr(sys.modules[module_name], _PATCHED_MARK, True)


def calls_attention(attention) -> bool:
    """Whether the layer's attention goes through its module's attention call, once patched."""
    module_name = type(attention).__module__
    return module_name in _PATCHES or hasattr(sys.modules[module_name], "scaled_dot_product_attention")


def _is_engine_cache(cache) -> bool:
    """The engine's caches (paged or probe) carry one position per token; mlx-lm's carry an int or per-row array."""
    return cache is not None and isinstance(cache.offset, PackedPositions)


# ---------------------------------------------------------------- Gemma 2


def _patch_gemma2(module) -> None:
    original = module.Attention.__call__

    def __call__(self, x, mask=None, cache=None):
        if not _is_engine_cache(cache):
            return original(self, x, mask, cache)
        return _gemma2_attention(self, module, x, mask, cache)

    module.Attention.__call__ = __call__
    module.scaled_dot_product_attention = _engine_caches_only


def _gemma2_attention(attention, module, x, mask, cache):
    """mlx-lm's Gemma 2 attention up to its scores, then the module's attention call with its soft cap."""
    B, L, _ = x.shape
    queries = attention.q_proj(x).reshape(B, L, attention.n_heads, -1).transpose(0, 2, 1, 3)
    keys = attention.k_proj(x).reshape(B, L, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
    values = attention.v_proj(x).reshape(B, L, attention.n_kv_heads, -1).transpose(0, 2, 1, 3)
    queries = attention.rope(queries, offset=cache.offset)
    keys = attention.rope(keys, offset=cache.offset)
    keys, values = cache.update_and_fetch(keys, values)
    output = module.scaled_dot_product_attention(
        queries, keys, values, cache=cache, scale=attention.scale, mask=mask,
        softcap=attention.attn_logit_softcapping,
    )
    return attention.o_proj(output.transpose(0, 2, 1, 3).reshape(B, L, -1))


def _engine_caches_only(queries, keys, values, cache, scale, mask, **kwargs):
    """The attention call a patched Gemma 2 layer makes: only the engine's caches reach it, and
    the engine's own call (paged or probing) answers those before this one."""
    raise TypeError(f"a patched Gemma 2 layer attends through the engine's caches only, not {type(cache).__name__}")


# ---------------------------------------------------------------- Ministral 3


def _patch_ministral3(module) -> None:
    original = module._get_llama_4_attn_scale

    def _get_llama_4_attn_scale(size, offset, beta, max_position_embeddings):
        if isinstance(offset, PackedPositions):
            offset = offset.array
        return original(size, offset, beta, max_position_embeddings)

    module._get_llama_4_attn_scale = _get_llama_4_attn_scale


_PATCHES = {
    "mlx_lm.models.gemma2": _patch_gemma2,
    "mlx_lm.models.ministral3": _patch_ministral3,
}

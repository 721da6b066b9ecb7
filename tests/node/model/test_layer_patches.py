"""The patches that bring Gemma 2 and Ministral 3 under the engine's seams (orchard/node/model/layer_patches.py).

Their engine-level exactness against mlx-lm is tests/node/test_families.py; these pin what
each patch claims on its own.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from orchard.node.model.layer_patches import calls_attention, install_layer_patches
from orchard.node.model.positions import PackedPositions
from tests.node.tiny_models import TINY_CONFIGS


def skeleton(name: str):
    from mlx_lm.utils import _get_classes

    config = dict(TINY_CONFIGS[name], vocab_size=256)
    model_class, args_class = _get_classes(config)
    return model_class(args_class.from_dict(config))


def test_ministral3_scales_each_packed_row_as_mlx_lm_scales_its_position_alone():
    from mlx_lm.models import ministral3

    install_layer_patches(skeleton("ministral3"))
    positions = [9, 0, 3, 4, 17, 8]  # out of order, as in a packed step; Llama 4's scale steps every 4
    packed = ministral3._get_llama_4_attn_scale(1, PackedPositions(mx.array(positions, dtype=mx.int32)), 0.5, 4)
    alone = [ministral3._get_llama_4_attn_scale(1, p, 0.5, 4) for p in positions]
    assert packed.shape == (len(positions), 1, 1, 1)  # one scale per one-token row, broadcast over heads
    np.testing.assert_array_equal(np.array(packed).ravel(), np.array(mx.concatenate(alone)).ravel())
    assert len(set(np.array(packed).ravel().tolist())) == 4  # positions 0-3, 4-7, 8-11, 16-19


def test_gemma2_gets_an_attention_call_that_only_the_engine_s_caches_reach():
    from mlx_lm.models import gemma2
    from mlx_lm.models.cache import make_prompt_cache

    model = skeleton("gemma2")
    install_layer_patches(model)
    assert calls_attention(model.layers[0].self_attn)
    tokens = mx.array([[5, 9, 2, 7]])
    # mlx-lm's own caches (and none) still run mlx-lm's code, which never reaches the new call.
    np.testing.assert_allclose(np.array(model(tokens, cache=make_prompt_cache(model))), np.array(model(tokens)),
                               atol=1e-6, rtol=0)
    with pytest.raises(TypeError, match="engine's caches only"):
        gemma2.scaled_dot_product_attention(tokens, tokens, tokens, cache=None, scale=1.0, mask=None)

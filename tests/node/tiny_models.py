"""Tiny random-weight checkpoints of the supported architectures, written in Hugging Face layout.

They borrow the demo model's tokenizer so `mlx_lm.load` takes them as it takes any model;
weights come from MLX's default initialisation under a fixed seed, in float32.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")

_COMMON = dict(hidden_size=64, num_hidden_layers=2, intermediate_size=128, num_attention_heads=4,
               max_position_embeddings=2048, torch_dtype="float32")

TINY_CONFIGS = {
    "qwen3": dict(_COMMON, model_type="qwen3", num_key_value_heads=2, head_dim=32, rms_norm_eps=1e-6,
                  rope_theta=1_000_000.0, tie_word_embeddings=True),
    "mistral": dict(_COMMON, model_type="mistral", num_key_value_heads=1, head_dim=16, rms_norm_eps=1e-5,
                    rope_theta=10_000.0, tie_word_embeddings=False, sliding_window=None),
    "qwen2": dict(_COMMON, model_type="qwen2", num_key_value_heads=2, rms_norm_eps=1e-6, rope_theta=1_000_000.0,
                  tie_word_embeddings=True, use_sliding_window=False, sliding_window=2048),
}


def write_tiny_model(folder: Path, model_type: str, tokenizer_from: Path, seed: int = 7) -> Path:
    """Write TINY_CONFIGS[model_type] with random weights into `folder`; returns it."""
    import mlx.core as mx
    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    folder.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((tokenizer_from / "config.json").read_text())["vocab_size"]
    config = dict(TINY_CONFIGS[model_type], vocab_size=vocab)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, folder / name)
    return folder

"""Models for node tests: the demo model, and random-weight qwen3 / mistral made here.

The random models reuse the demo model's tokenizer so mlx-lm's real loader can open
them; their weights come from a fixed seed so failures reproduce.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

import mlx.core as mx
import pytest
from mlx.utils import tree_flatten

from node.demo_model import write_demo_model

_TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def _random_config(model_type: str, vocab_size: int) -> dict:
    common = dict(
        model_type=model_type,
        hidden_size=128,
        num_hidden_layers=2,
        intermediate_size=256,
        num_attention_heads=4,
        num_key_value_heads=2,
        rms_norm_eps=1e-5,
        vocab_size=vocab_size,
        max_position_embeddings=2048,
        rope_theta=10000.0,
        tie_word_embeddings=False,
    )
    if model_type == "qwen3":
        common.update(head_dim=32)
    return common


def write_random_model(path: Path, model_type: str, tokenizer_dir: Path, seed: int = 7) -> Path:
    """A tiny random-weight model of `model_type` in Hugging Face layout."""
    from mlx_lm.utils import _get_classes as get_model_classes

    path.mkdir(parents=True, exist_ok=True)
    vocab = json.loads((tokenizer_dir / "config.json").read_text())["vocab_size"]
    config = _random_config(model_type, vocab)
    model_cls, args_cls = get_model_classes(config)
    mx.random.seed(seed)
    model = model_cls(args_cls.from_dict(config))
    weights = {k: (v * 2.0 if v.ndim == 2 else v) for k, v in tree_flatten(model.parameters())}
    mx.save_safetensors(str(path / "model.safetensors"), weights)
    (path / "config.json").write_text(json.dumps(config))
    for name in _TOKENIZER_FILES:
        if (tokenizer_dir / name).exists():
            shutil.copy(tokenizer_dir / name, path / name)
    return path


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, demo_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("random-models")
    return {
        "demo": demo_model_dir,
        "qwen3": write_random_model(root / "qwen3", "qwen3", demo_model_dir),
        "mistral": write_random_model(root / "mistral", "mistral", demo_model_dir),
    }

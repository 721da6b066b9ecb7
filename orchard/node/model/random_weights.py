"""Random-weight Llamas of real shapes, built in memory, for benchmarks on an accelerator.

Speed depends on shapes, not on trained values, and downloading an 8B checkpoint is not
possible on every machine. So `orchard bench engine --shape 8b` builds mlx-lm's own Llama
class with the published Llama 3.x dimensions, casts its random initial weights to
bfloat16 and pairs it with the demo model's tokenizer (token ids beyond that tokenizer's
vocabulary decode to nothing, which is all a benchmark needs of text).
"""

from __future__ import annotations

from pathlib import Path

import mlx.core as mx

from orchard.node.model.loader import LoadedModel

_LLAMA3 = {
    "model_type": "llama",
    "vocab_size": 128256,
    "rms_norm_eps": 1e-5,
    "rope_theta": 500000.0,
    "max_position_embeddings": 8192,
    "attention_bias": False,
    "mlp_bias": False,
}

#: The published dimensions of Llama-3.2-1B, Llama-3.2-3B and Llama-3.1-8B.
SHAPES = {
    "1b": {**_LLAMA3, "hidden_size": 2048, "num_hidden_layers": 16, "intermediate_size": 8192,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 64, "tie_word_embeddings": True},
    "3b": {**_LLAMA3, "hidden_size": 3072, "num_hidden_layers": 28, "intermediate_size": 8192,
           "num_attention_heads": 24, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": True},
    "8b": {**_LLAMA3, "hidden_size": 4096, "num_hidden_layers": 32, "intermediate_size": 14336,
           "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128, "tie_word_embeddings": False},
}


class UnknownShape(ValueError):
    """A shape name outside `SHAPES`."""


def shape_config(name: str, *, num_layers: int | None = None) -> dict:
    """The config of a shape; `num_layers` shrinks it for a quick test of the same code path."""
    if name not in SHAPES:
        raise UnknownShape(f"unknown shape {name!r}; choose from {', '.join(SHAPES)}")
    config = dict(SHAPES[name])
    if num_layers is not None:
        config["num_hidden_layers"] = num_layers
    return config


def random_llama(name: str, *, dtype=mx.bfloat16, num_layers: int | None = None, seed: int = 0) -> LoadedModel:
    """mlx-lm's Llama with the shape's dimensions and random weights, evaluated on the default device."""
    config = shape_config(name, num_layers=num_layers)
    return random_model(config, f"random-llama-{name}", dtype=dtype, seed=seed)


def write_random_checkpoint(folder: Path, config: dict, tokenizer_from: Path, seed: int = 7,
                            randomize: tuple[str, ...] = ()) -> Path:
    """`config` with random weights (MLX's default initialisation under `seed`) written in Hugging
    Face layout into `folder`, with the tokenizer of the checkpoint at `tokenizer_from`, so
    `mlx_lm.load` and `orchard serve` take it as any model. Parameters whose names end with one of
    `randomize` (built as zeros, trained in real checkpoints) get random values."""
    import json
    import shutil

    from mlx.utils import tree_flatten
    from mlx_lm.utils import _get_classes

    folder.mkdir(parents=True, exist_ok=True)
    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    weights = dict(tree_flatten(model.parameters()))
    for name in weights:
        if randomize and name.endswith(randomize):
            weights[name] = mx.random.normal(weights[name].shape) * 2.0
    mx.save_safetensors(str(folder / "model.safetensors"), weights)
    (folder / "config.json").write_text(json.dumps(config, indent=2))
    for name in TOKENIZER_FILES:
        shutil.copy(tokenizer_from / name, folder / name)
    return folder


#: The files of a checkpoint's tokenizer (Hugging Face layout).
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json")


def random_model(config: dict, name: str, *, dtype=mx.bfloat16, seed: int = 0) -> LoadedModel:
    """mlx-lm's model class for `config` with random weights and the demo tokenizer, evaluated on the default device."""
    from mlx_lm.utils import _get_classes, load_tokenizer

    from orchard.node.model.demo import default_demo_model_path

    model_class, args_class = _get_classes(config)
    mx.random.seed(seed)
    model = model_class(args_class.from_dict(config))
    model.set_dtype(dtype)
    mx.eval(model.parameters())
    demo = Path(default_demo_model_path())
    tokenizer = load_tokenizer(demo)
    return LoadedModel(
        name=name,
        path=demo,
        model=model,
        tokenizer=tokenizer,
        config=config,
        model_type=config["model_type"],
        fingerprint=f"{name}-{config['num_hidden_layers']}-{dtype}-seed{seed}",
        eos_token_ids=frozenset(int(t) for t in tokenizer.eos_token_ids),
        max_context_length=int(config["max_position_embeddings"]),
    )

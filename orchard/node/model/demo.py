"""The bundled demo model: a small Llama network the project generates instead of downloading.

Hubs are out of reach on many machines (CI, air-gapped labs), yet every test and the default
`orchard serve` need a real model that mlx-lm's own loader accepts. So we write one in Hugging
Face layout: fixed-seed random weights and a byte-level BPE tokenizer trained on prose shipped
in `orchard/node/model/data/`. Its text is gibberish; its bytes are identical on every machine, so token-exact
tests and block hashes agree everywhere.

Determinism rests on three choices: weights are drawn from numpy's PCG64 `random()` (pure
integer and bit operations, no libm), each tensor from its own seed derived from its name (the
write order cannot matter), and `tokenizers`' BPE trainer, which breaks ties deterministically.
"""

from __future__ import annotations

import functools
import json
import os
import shutil
import tempfile
import zlib
from dataclasses import asdict, dataclass, replace
from importlib import resources
from pathlib import Path

import numpy as np

#: Bump when anything below changes the written bytes, so cached copies are not reused.
DEMO_MODEL_VERSION = 2

BOS_TOKEN = "<|endoftext|>"
EOS_TOKEN = "<|endoftext|>"
SPECIAL_TOKENS = ("<|endoftext|>", "<|im_start|>", "<|im_end|>")
#: Generation stops at either: plain text ends with <|endoftext|>, a chat turn with <|im_end|>.
EOS_TOKENS = ("<|endoftext|>", "<|im_end|>")

_CORPUS_FILES = ("orchard_prose.txt",)


@dataclass(frozen=True)
class DemoModelConfig:
    """Shape of a demo network; `vocab_size` is the BPE trainer's target, not a promise."""

    size: str = "small"
    num_hidden_layers: int = 4
    hidden_size: int = 256
    num_attention_heads: int = 4
    num_key_value_heads: int = 2
    head_dim: int = 64
    intermediate_size: int = 512
    #: long enough for a prefix of 8,192 tokens and its prompt's tail (migration benches' router cases)
    max_position_embeddings: int = 16384
    vocab_size: int = 3072
    rope_theta: float = 10000.0
    rms_norm_eps: float = 1e-5
    seed: int = 20_24_06_11
    #: Uniform init with this standard deviation for the projections.
    init_std: float = 0.02
    #: Queries and keys get a larger scale so attention is sharp and position dependent;
    #: with the small scale every head averages its context and greedy output stalls.
    qk_init_std: float = 0.08
    embed_init_std: float = 1.0


DEMO_CONFIG = DemoModelConfig()
#: For benchmarks: big enough that the forward pass, not Python, dominates a step.
LARGE_DEMO_CONFIG = replace(
    DEMO_CONFIG,
    size="large",
    num_hidden_layers=8,
    hidden_size=1024,
    num_attention_heads=16,
    num_key_value_heads=4,
    head_dim=64,
    intermediate_size=2816,
    qk_init_std=0.04,
)
DEMO_CONFIGS = {"small": DEMO_CONFIG, "large": LARGE_DEMO_CONFIG}


class UnknownDemoSize(ValueError):
    """`size` names no demo configuration."""


def demo_config(size: str) -> DemoModelConfig:
    try:
        return DEMO_CONFIGS[size]
    except KeyError:
        raise UnknownDemoSize(f"unknown demo model size {size!r}; expected one of {sorted(DEMO_CONFIGS)}") from None


# ---------------------------------------------------------------- tokenizer


def corpus_text() -> str:
    """The shipped training prose, read from the installed package."""
    data = resources.files("orchard.node.model") / "data"
    return "\n".join((data / name).read_text(encoding="utf-8") for name in _CORPUS_FILES)


@functools.lru_cache(maxsize=4)
def train_tokenizer_json(vocab_size: int) -> str:
    """Train the byte-level BPE once per process and return its `tokenizer.json` text."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=list(SPECIAL_TOKENS),
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    paragraphs = [p for p in corpus_text().split("\n\n") if p.strip()]
    tokenizer.train_from_iterator(paragraphs, trainer=trainer)
    return tokenizer.to_str(pretty=True)


def _token_ids(tokenizer_json: str) -> tuple[int, dict[str, int]]:
    """Vocabulary size and the ids of the special tokens, read back from the JSON."""
    spec = json.loads(tokenizer_json)
    special = {t["content"]: t["id"] for t in spec["added_tokens"]}
    highest = max(max(spec["model"]["vocab"].values()), max(special.values()))
    return highest + 1, special


# ---------------------------------------------------------------- weights


def _uniform(name: str, shape: tuple[int, ...], std: float, seed: int) -> np.ndarray:
    """Zero-mean uniform noise with standard deviation `std`, seeded by the tensor's name."""
    rng = np.random.Generator(np.random.PCG64([seed, zlib.crc32(name.encode())]))
    bound = np.float32(std * np.sqrt(3.0))
    return ((rng.random(shape, dtype=np.float32) * np.float32(2.0) - np.float32(1.0)) * bound).astype(np.float32)


def _layer_weights(cfg: DemoModelConfig, i: int) -> dict[str, np.ndarray]:
    h, d = cfg.hidden_size, cfg.head_dim
    q_out, kv_out = cfg.num_attention_heads * d, cfg.num_key_value_heads * d
    p = f"model.layers.{i}."
    shapes = {
        "self_attn.q_proj.weight": ((q_out, h), cfg.qk_init_std),
        "self_attn.k_proj.weight": ((kv_out, h), cfg.qk_init_std),
        "self_attn.v_proj.weight": ((kv_out, h), cfg.init_std),
        "self_attn.o_proj.weight": ((h, q_out), cfg.init_std),
        "mlp.gate_proj.weight": ((cfg.intermediate_size, h), cfg.init_std),
        "mlp.up_proj.weight": ((cfg.intermediate_size, h), cfg.init_std),
        "mlp.down_proj.weight": ((h, cfg.intermediate_size), cfg.init_std),
    }
    out = {p + k: _uniform(p + k, shape, std, cfg.seed) for k, (shape, std) in shapes.items()}
    out[p + "input_layernorm.weight"] = np.ones(h, np.float32)
    out[p + "post_attention_layernorm.weight"] = np.ones(h, np.float32)
    return out


def demo_weights(cfg: DemoModelConfig, vocab_size: int) -> dict[str, np.ndarray]:
    """Every tensor of the network, named as Hugging Face Llama checkpoints name them."""
    weights = {
        "model.embed_tokens.weight": _uniform(
            "model.embed_tokens.weight", (vocab_size, cfg.hidden_size), cfg.embed_init_std, cfg.seed
        ),
        "model.norm.weight": np.ones(cfg.hidden_size, np.float32),
        "lm_head.weight": _uniform("lm_head.weight", (vocab_size, cfg.hidden_size), cfg.init_std, cfg.seed),
    }
    for i in range(cfg.num_hidden_layers):
        weights.update(_layer_weights(cfg, i))
    return weights


# ---------------------------------------------------------------- files


def _hf_config(cfg: DemoModelConfig, vocab_size: int, special: dict[str, int]) -> dict:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_act": "silu",
        "hidden_size": cfg.hidden_size,
        "intermediate_size": cfg.intermediate_size,
        "num_hidden_layers": cfg.num_hidden_layers,
        "num_attention_heads": cfg.num_attention_heads,
        "num_key_value_heads": cfg.num_key_value_heads,
        "head_dim": cfg.head_dim,
        "max_position_embeddings": cfg.max_position_embeddings,
        "rms_norm_eps": cfg.rms_norm_eps,
        "rope_theta": cfg.rope_theta,
        "attention_bias": False,
        "mlp_bias": False,
        "tie_word_embeddings": False,
        "vocab_size": vocab_size,
        "bos_token_id": special[BOS_TOKEN],
        "eos_token_id": special[EOS_TOKEN],
        "torch_dtype": "float32",
        "orchard_demo_model": {"version": DEMO_MODEL_VERSION, **asdict(cfg)},
    }


def _tokenizer_config(max_length: int, special: dict[str, int]) -> dict:
    # No chat_template on purpose: the gateway supplies its ChatML-style fallback.
    return {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": BOS_TOKEN,
        "eos_token": EOS_TOKEN,
        "pad_token": EOS_TOKEN,
        "unk_token": None,
        "add_bos_token": False,
        "add_eos_token": False,
        "clean_up_tokenization_spaces": False,
        "model_max_length": max_length,
        "added_tokens_decoder": {
            str(i): {"content": t, "special": True, "lstrip": False, "rstrip": False,
                     "normalized": False, "single_word": False}
            for t, i in sorted(special.items(), key=lambda kv: kv[1])
        },
    }


def _write_json(path: Path, obj: dict) -> None:
    path.write_text(json.dumps(obj, indent=2, sort_keys=True) + "\n", encoding="utf-8")


def write_demo_model(path: str | os.PathLike, config: DemoModelConfig | None = None, *, size: str = "small") -> Path:
    """Write the demo model into folder `path` (created if missing) and return it.

    `config` wins over `size`; `size` picks one of `DEMO_CONFIGS` ("small", "large").
    """
    from safetensors.numpy import save_file

    cfg = config if config is not None else demo_config(size)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer_json = train_tokenizer_json(cfg.vocab_size)
    vocab_size, special = _token_ids(tokenizer_json)
    (out / "tokenizer.json").write_text(tokenizer_json, encoding="utf-8")
    _write_json(out / "config.json", _hf_config(cfg, vocab_size, special))
    _write_json(out / "tokenizer_config.json", _tokenizer_config(cfg.max_position_embeddings, special))
    _write_json(out / "special_tokens_map.json",
                {"bos_token": BOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN})
    _write_json(out / "generation_config.json",
                {"bos_token_id": special[BOS_TOKEN], "eos_token_id": [special[t] for t in EOS_TOKENS]})
    save_file(demo_weights(cfg, vocab_size), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


# ---------------------------------------------------------------- the user's cache


def cache_dir() -> Path:
    """ORCHARD_CACHE_DIR, else $XDG_CACHE_HOME/mlx-orchard, else ~/.cache/mlx-orchard."""
    if explicit := os.environ.get("ORCHARD_CACHE_DIR"):
        return Path(explicit).expanduser()
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "mlx-orchard"


def default_demo_model_path(size: str = "small") -> Path:
    """The demo model in the user's cache, written once on first use.

    Concurrent first uses are safe: each process writes a private temporary folder next to
    the final one and renames it into place; a loser of the race discards its copy.
    """
    cfg = demo_config(size)
    name = f"demo-model-v{DEMO_MODEL_VERSION}" if size == "small" else f"demo-model-{size}-v{DEMO_MODEL_VERSION}"
    final = cache_dir() / name
    if (final / "config.json").exists():
        return final
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{name}.tmp-", dir=final.parent))
    try:
        write_demo_model(tmp, cfg)
        os.rename(tmp, final)
    except OSError:
        if not (final / "config.json").exists():
            raise
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    return final

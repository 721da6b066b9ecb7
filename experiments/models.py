"""Model shapes the experiments reason about, and the two model timings they all need.

KV bytes per token follow from a config alone (2 x layers x KV heads x head dim x item
size), so public models' shapes are listed from their published config.json files; only
the bundled demo model is run here (hubs are out of reach), for the measured prefill
(recompute) and decode rates.
"""

from __future__ import annotations

import time
from dataclasses import dataclass

import numpy as np

from orchard.kvcache.geometry import KVGeometry


@dataclass(frozen=True)
class ModelShape:
    name: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    dtype: str = "bfloat16"
    source: str = ""

    def geometry(self, block_size: int = 16) -> KVGeometry:
        return KVGeometry(f"shape/{self.name}", self.num_layers, self.num_kv_heads, self.head_dim, block_size, self.dtype)

    @property
    def kv_bytes_per_token(self) -> int:
        return self.geometry().bytes_per_token


#: From each model's config.json on its Hugging Face page (num_hidden_layers, num_key_value_heads, head size).
PUBLIC_SHAPES = (
    ModelShape("Qwen2.5-0.5B", 24, 2, 64, source="huggingface.co/Qwen/Qwen2.5-0.5B-Instruct/blob/main/config.json"),
    ModelShape("Qwen2.5-7B", 28, 4, 128, source="huggingface.co/Qwen/Qwen2.5-7B-Instruct/blob/main/config.json"),
    ModelShape("Llama-3.1-8B", 32, 8, 128, source="huggingface.co/meta-llama/Llama-3.1-8B/blob/main/config.json"),
    ModelShape("Llama-3.1-70B", 80, 8, 128, source="huggingface.co/meta-llama/Llama-3.1-70B/blob/main/config.json"),
)
#: The bundled "large" demo model (orchard/node/model/demo.py), float32 like its weights.
DEMO_LARGE = ModelShape("orchard-demo-large", 8, 4, 64, dtype="float32", source="orchard/node/model/demo.py LARGE_DEMO_CONFIG")
DEMO_SMALL = ModelShape("orchard-demo-small", 4, 2, 64, dtype="float32", source="orchard/node/model/demo.py DEMO_CONFIG")
DEMO_SHAPES = {"large": DEMO_LARGE, "small": DEMO_SMALL}


def load_demo(size: str = "large"):
    """The bundled demo model through mlx-lm's own loader (written to the user cache once)."""
    from mlx_lm import load

    from orchard.node.model.demo import default_demo_model_path

    model, _ = load(str(default_demo_model_path(size)))
    return model


def prefill_seconds(model, num_tokens: int, repeats: int = 3, seed: int = 0) -> tuple[float, list]:
    """Best-of-`repeats` time of a fresh prefill of `num_tokens` random tokens, and the last KV cache."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    vocab = model.args.vocab_size
    tokens = mx.array(np.random.default_rng(seed).integers(0, vocab, num_tokens))[None]
    cache = None

    def run():
        nonlocal cache
        cache = make_prompt_cache(model)
        mx.eval(model.model(tokens, cache=cache), *[c.state for c in cache])

    run()
    times = []
    for _ in range(repeats):
        start = time.perf_counter()
        run()
        times.append(time.perf_counter() - start)
    return float(min(times)), cache


def decode_tokens_per_s(model, batch: int, context: int, steps: int = 8) -> float:
    """Decode throughput (tokens/s over the batch) with mlx-lm's own cache at `context` tokens."""
    import mlx.core as mx
    from mlx_lm.models.cache import make_prompt_cache

    vocab = model.args.vocab_size
    rng = np.random.default_rng(0)
    cache = make_prompt_cache(model)
    prompt = mx.array(rng.integers(0, vocab, (batch, context)))
    mx.eval(model(prompt, cache=cache))
    token = mx.array(rng.integers(0, vocab, (batch, 1)))
    mx.eval(model(token, cache=cache))  # warm-up step
    start = time.perf_counter()
    for _ in range(steps):
        logits = model(token, cache=cache)
        token = mx.argmax(logits[:, -1:], axis=-1)
        mx.eval(token)
    return batch * steps / (time.perf_counter() - start)


def cache_to_blocks(cache, geometry: KVGeometry, num_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """mlx-lm's per-layer `[1, heads, T, dim]` K/V as the pool's `[layers, blocks, block, heads, dim]`."""
    n_blocks = num_tokens // geometry.block_size

    def blocks(arrays):
        stacked = np.stack([np.array(a[0, :, :n_blocks * geometry.block_size]) for a in arrays])
        stacked = stacked.transpose(0, 2, 1, 3)
        return np.ascontiguousarray(stacked.reshape(geometry.num_layers, n_blocks, *geometry.block_shape))

    return blocks([c.keys for c in cache]), blocks([c.values for c in cache])

"""Loading: mlx-lm's loader, refusal of architectures the paged engine cannot serve, fingerprints."""

from __future__ import annotations

import json
import shutil
import sys
import threading
import types

import mlx.core as mx
import pytest

from orchard.node.model.capability import architecture_reason
from orchard.node.model.demo import write_demo_model
from orchard.node.model.fingerprint import model_fingerprint
from orchard.node.model.loader import (
    DEMO_MODEL_NAME,
    ModelNotFound,
    UnsupportedModel,
    evaluate_held_arrays,
    load_model,
    served_context_length,
    unsupported_reason,
)
from tests.node.tiny_models import TINY_CONFIGS, write_quantized_model, write_tiny_model


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo"))


def write_config(folder, **config):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "config.json").write_text(json.dumps(config))
    return folder


def test_no_model_means_the_demo_model_created_in_the_cache(monkeypatch, tmp_path, demo_path):
    monkeypatch.setenv("ORCHARD_CACHE_DIR", str(tmp_path))
    loaded = load_model(None)
    assert loaded.name == DEMO_MODEL_NAME
    assert loaded.path.parent == tmp_path
    assert loaded.model_type == "llama"
    assert loaded.fingerprint == model_fingerprint(demo_path)  # same bytes, same fingerprint
    assert loaded.eos_token_ids == frozenset({0, 2})
    assert loaded.max_context_length == 16384


def test_geometry_follows_the_model_and_its_weights_dtype(demo_path):
    loaded = load_model(str(demo_path))
    geometry = loaded.geometry(16)
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (4, 2, 64)
    assert (geometry.block_size, geometry.dtype) == (16, "float32")
    assert geometry.model_fingerprint == loaded.fingerprint
    assert loaded.geometry(8, dtype="bfloat16").dtype == "bfloat16"


@pytest.mark.parametrize("model_type,head_dim,kv_heads", [
    ("qwen3", 32, 2), ("mistral", 16, 1), ("qwen2", 16, 2), ("llama3", 16, 2), ("qwen3_moe", 16, 2),
    ("qwen2_moe", 16, 2), ("gemma", 32, 1), ("phi3", 16, 2), ("olmo2", 16, 2), ("glm4", 16, 2),
    ("starcoder2", 16, 2), ("hunyuan", 16, 2), ("granite", 16, 2), ("cohere", 16, 2), ("mixtral", 16, 2),
])
def test_supported_architectures_load_with_their_head_layout(model_type, head_dim, kv_heads, demo_path, tmp_path):
    loaded = load_model(str(write_tiny_model(tmp_path / model_type, model_type, demo_path)))
    assert loaded.model_type == TINY_CONFIGS[model_type]["model_type"]
    geometry = loaded.geometry(4)
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim) == (2, kv_heads, head_dim)
    assert loaded.max_context_length == TINY_CONFIGS[model_type]["max_position_embeddings"]


def test_a_model_loaded_in_one_thread_generates_in_another(demo_path, tmp_path):
    # Llama 3's rope builds its frequencies lazily at construction; the engine steps in its own thread.
    from mlx_lm.generate import generate_step

    loaded = load_model(str(write_tiny_model(tmp_path / "llama3", "llama3", demo_path)))
    prompt = mx.array(loaded.tokenizer.encode("The orchard on the hill"))
    results = {}

    def generate(into: str) -> None:
        results[into] = [int(t) for t, _ in generate_step(prompt, loaded.model, max_tokens=6)]

    worker = threading.Thread(target=generate, args=("other thread",))
    worker.start()  # first, so nothing in this thread has evaluated the model's arrays yet
    worker.join()
    generate("loading thread")
    assert results["other thread"] == results["loading thread"]
    assert len(results["other thread"]) == 6


def full_config(tiny: str, **overrides) -> dict:
    """A tiny config mlx-lm's classes can build (vocabulary included), with some fields changed."""
    return {**TINY_CONFIGS[tiny], "vocab_size": 256, **overrides}


#: Llama 4's text model attends within chunks of `attention_chunk_size` on most layers.
LLAMA4 = dict(model_type="llama4", text_config=dict(model_type="llama4_text", attention_chunk_size=8192, vocab_size=256,
                                                    hidden_size=64, num_hidden_layers=2))

MAMBA = dict(model_type="mamba", vocab_size=256, hidden_size=64, intermediate_size=128, state_size=16,
             num_hidden_layers=2, conv_kernel=4, use_bias=False, use_conv_bias=True, time_step_rank=4)


@pytest.mark.parametrize("config,named", [
    (MAMBA, "ArraysCache"),
    # A config naming linear-attention layers for a class that builds none (Qwen3-Next's are served).
    (full_config("qwen3", layer_types=["linear_attention", "full_attention"]), "linear_attention"),
    ({"model_type": "no_such_architecture"}, "no model class"),
    (LLAMA4, "chunked local attention"),
])
def test_unsupported_models_fail_at_load_naming_type_and_reason(config, named, tmp_path):
    # The folder holds no weights: refusal must come from the config, before any loading.
    folder = write_config(tmp_path / "m", **config)
    with pytest.raises(UnsupportedModel) as info:
        load_model(str(folder))
    message = str(info.value)
    assert config["model_type"] in message and named in message
    assert info.value.model_type == config["model_type"]


@pytest.mark.parametrize("name,named", [
    ("llama_dynamic_ntk", "DynamicNTKScalingRoPE"),  # takes its base from one offset for the whole row
    ("deepseek_v3", "latent cache"),  # attends over keys and values other than those it stores
])
def test_models_whose_layers_cannot_page_are_refused_after_loading(name, named, demo_path, tmp_path):
    folder = write_tiny_model(tmp_path / name, name, demo_path)
    assert unsupported_reason(json.loads((folder / "config.json").read_text())) is None
    with pytest.raises(UnsupportedModel, match=named):
        load_model(str(folder))


def test_layers_that_compute_attention_themselves_are_refused(monkeypatch):
    from mlx_lm.models import llama

    module = types.ModuleType("self_attending")  # a model file with no scaled_dot_product_attention to route
    monkeypatch.setitem(sys.modules, module.__name__, module)
    attention_class = type("Attention", (llama.Attention,), {"__module__": module.__name__})
    model = llama.Model(llama.ModelArgs.from_dict(full_config("llama3")))
    for layer in model.layers:
        layer.self_attn = attention_class(model.args)
    assert "its layers compute attention themselves" in architecture_reason(model)


def test_a_forward_that_reads_token_ids_beyond_the_text_stack_is_refused(demo_path, tmp_path):
    from mlx_lm.models import qwen3

    class Model(qwen3.Model):
        def __call__(self, inputs, cache=None):
            return self.model.embed_tokens.as_linear(self.model(inputs, cache)) + inputs.shape[1]

    Model.__module__ = qwen3.__name__  # its layers are qwen3's own, so only the head differs
    skeleton = Model(qwen3.ModelArgs.from_dict(full_config("qwen3")))
    assert "its forward does more than apply a head" in architecture_reason(skeleton)
    assert architecture_reason(qwen3.Model(qwen3.ModelArgs.from_dict(full_config("qwen3")))) is None


def test_a_bfloat16_quantized_checkpoint_keeps_its_kv_in_bfloat16(demo_path, tmp_path):
    source = write_tiny_model(tmp_path / "qwen3", "qwen3", demo_path)
    loaded = load_model(str(write_quantized_model(tmp_path / "q4", source, bits=4, group_size=64, dtype="bfloat16")))
    assert type(loaded.model.model.embed_tokens).__name__ == "QuantizedEmbedding"
    assert (loaded.dtype, loaded.num_kv_heads, loaded.head_dim) == ("bfloat16", 2, 32)


@pytest.mark.parametrize("tiny,windows", [
    ("gemma3_text", [6, None, 6, None]),  # sliding_window_pattern 2
    ("gpt_oss", [5, None, 5]),  # layer_types
    ("llama_swa", [7, None, 7]),
    ("olmo3", [6, 6, 6, None]),
    ("ministral3", [5, None, 5]),  # layer_types
    ("gemma2", [None, None, None]),  # mlx-lm does not window Gemma 2 (its context is capped instead)
    ("llama3", [None, None]),
])
def test_each_layer_s_window_is_read_from_the_caches_the_model_makes(tiny, windows):
    from mlx_lm.utils import _get_classes

    from orchard.node.model.capability import layer_windows

    config = full_config(tiny)
    model_class, args_class = _get_classes(config)
    assert unsupported_reason(config) is None
    assert layer_windows(model_class(args_class.from_dict(config))) == windows


def test_a_cache_that_keeps_sink_tokens_is_refused(monkeypatch):
    from mlx_lm.models import gemma3_text
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    monkeypatch.setattr(gemma3_text.Model, "make_cache", lambda self: [RotatingKVCache(max_size=6, keep=4), KVCache()] * 2)
    assert "RotatingKVCache" in unsupported_reason(full_config("gemma3_text"))


def test_a_layer_masked_with_another_window_than_its_cache_is_refused(demo_path, tmp_path, monkeypatch):
    from mlx_lm.models import gemma3_text
    from mlx_lm.models.cache import KVCache, RotatingKVCache

    folder = write_tiny_model(tmp_path / "gemma3_text", "gemma3_text", demo_path)
    monkeypatch.setattr(gemma3_text.Model, "make_cache", lambda self: [RotatingKVCache(max_size=9), KVCache()] * 2)
    with pytest.raises(UnsupportedModel, match="cache of window 9 but is masked with window"):
        load_model(str(folder))


@pytest.mark.parametrize("config,context", [
    (full_config("mistral", sliding_window=4096, max_position_embeddings=32768), 4096),  # Mistral 7B v0.1
    (full_config("qwen2", use_sliding_window=True, sliding_window=1024), 1024),
    (full_config("qwen2", use_sliding_window=False, sliding_window=64), 2048),  # the flag is off
    (full_config("gemma2"), 40),
    (full_config("gemma3_text"), 2048),  # mlx-lm windows its layers, and so do the kernels
])
def test_a_window_mlx_lm_does_not_apply_caps_the_context_instead_of_refusing(config, context):
    from mlx_lm.utils import _get_classes

    model_class, args_class = _get_classes(config)
    assert unsupported_reason(config) is None
    assert served_context_length(config, model_class(args_class.from_dict(config))) == context


def test_gemma2_loads_with_its_context_capped_at_its_window(demo_path, tmp_path):
    loaded = load_model(str(write_tiny_model(tmp_path / "gemma2", "gemma2", demo_path)))
    assert loaded.max_context_length == TINY_CONFIGS["gemma2"]["sliding_window"] == 40
    assert (loaded.num_kv_heads, loaded.head_dim) == (2, 32)


def test_unused_sliding_window_fields_are_accepted():
    assert unsupported_reason(full_config("qwen2", use_sliding_window=False, sliding_window=64)) is None
    assert unsupported_reason(full_config("mistral", sliding_window=None)) is None
    assert unsupported_reason(full_config("mistral", sliding_window=2048)) is None  # the whole context


def test_fingerprint_is_stable_across_copies_and_changes_with_config_or_weights(demo_path, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(demo_path, copy)
    assert model_fingerprint(copy) == model_fingerprint(demo_path)
    assert len(model_fingerprint(copy)) == 32

    config = json.loads((copy / "config.json").read_text())
    (copy / "config.json").write_text(json.dumps(dict(config, rms_norm_eps=1e-6)))
    assert model_fingerprint(copy) != model_fingerprint(demo_path)

    shutil.copy(demo_path / "config.json", copy / "config.json")
    weights = bytearray((copy / "model.safetensors").read_bytes())
    weights[-1] ^= 0x01  # one bit of the last tensor
    (copy / "model.safetensors").write_bytes(bytes(weights))
    assert model_fingerprint(copy) != model_fingerprint(demo_path)


def test_a_missing_local_path_is_reported_as_not_found(tmp_path):
    missing = str(tmp_path / "no-such-model")
    with pytest.raises(ModelNotFound, match="no-such-model"):
        load_model(missing)


def test_a_hub_model_is_refused_after_fetching_only_its_json_files(monkeypatch, tmp_path):
    import mlx_lm.utils

    snapshot = write_config(tmp_path / "snapshot", model_type="mamba")
    fetched = []

    def fake_download(repo, revision=None, allow_patterns=None):
        fetched.append((repo, allow_patterns))
        return snapshot

    monkeypatch.setattr(mlx_lm.utils, "_download", fake_download)
    with pytest.raises(UnsupportedModel, match="mamba"):
        load_model("someone/some-mamba")
    assert fetched == [("someone/some-mamba", ["*.json"])]


def test_arrays_a_model_computes_at_construction_are_evaluated_for_other_threads():
    import mlx.nn as nn

    class Rope(nn.Module):
        def __init__(self):
            super().__init__()
            self._freqs = mx.arange(4, dtype=mx.float32) * 2  # private: parameters() skips it
            object.__setattr__(self, "table", mx.arange(3) + 1)  # past Module's attribute handling

    model = nn.Sequential(nn.Linear(2, 2), Rope())
    evaluate_held_arrays(model)
    seen = {}

    def read() -> None:
        try:
            seen["values"] = (model.layers[1]._freqs.tolist(), model.layers[1].table.tolist())
        except RuntimeError as error:  # no stream of the creating thread here
            seen["error"] = error

    worker = threading.Thread(target=read)
    worker.start()
    worker.join()
    assert seen == {"values": ([0.0, 2.0, 4.0, 6.0], [1, 2, 3])}


def test_deepseek_v2_loads_with_keys_and_values_of_their_own_head_dims(demo_path, tmp_path):
    # 16 nope + 8 rope dims of keys, repeated over all 4 heads; values of 12
    loaded = load_model(str(write_tiny_model(tmp_path / "deepseek_v2", "deepseek_v2", demo_path)))
    geometry = loaded.geometry(4)
    assert (geometry.num_layers, geometry.num_kv_heads, geometry.head_dim, geometry.value_dim) == (3, 4, 24, 12)

"""Fused projections: fewer primitives per layer, the same logits, the weights held once."""

from __future__ import annotations

import collections
import gc
import io
import re

import mlx.core as mx
import mlx.nn as nn
import numpy as np
import pytest
from mlx_lm import load
from mlx_lm.models.cache import make_prompt_cache

from orchard.kernels import cpu as cpu_kernels
from orchard.node.model import fused_layers
from orchard.node.model.fused_layers import fuse_stack
from orchard.node.model.layers import text_stack
from orchard.node.model.loader import load_model
from orchard.node.model.runner import ModelRunner, SequenceChunk, pack_step
from tests.node.model.test_runner import BLOCK_SIZE, make_pool, scattered_tables
from tests.node.tiny_models import write_quantized_model, write_tiny_model


def census(*outputs) -> int:
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return sum(collections.Counter(re.findall(r'label ="?([A-Za-z_]+)[^"]*"?, shape=rectangle', dot.getvalue())).values())


def decode_step(loaded, batch: int = 4):
    tables = scattered_tables([str(i) for i in range(batch)])
    chunks = [SequenceChunk([5 + i], 3, tables[str(i)]) for i in range(batch)]
    return pack_step(chunks, BLOCK_SIZE)


def test_a_fused_layer_has_20_fewer_primitives_than_mlx_lms_wiring(demo_model_dir):
    loaded = load_model(demo_model_dir)
    step = decode_step(loaded)
    plain = ModelRunner(loaded, make_pool(loaded), fused_layers=False, compiled_decode=False)
    unfused = census(plain.forward(step))
    fused_runner = ModelRunner(loaded, make_pool(loaded), compiled_decode=False)
    assert fused_runner._fused is not None
    fused = census(fused_runner.forward(step))
    layers = len(loaded.model.layers)
    # per layer: seven flatten/transpose/unflatten triples become views or vanish, three matmuls go
    assert unfused - fused >= 20 * layers, (unfused, fused)


#: float32 logits of the two wirings: equal to rounding on the CPU; on a GPU the stacked matmul
#: reduces in another order than three narrower ones (1.8e-4 apart on the H200)
LOGIT_ATOL = 1e-5 if mx.default_device().type == mx.DeviceType.cpu else 1e-3


def test_fused_and_mlx_lm_wiring_give_the_same_logits(demo_model_dir):
    loaded = load_model(demo_model_dir)
    tables = scattered_tables(["a", "b"])
    prompt = pack_step([SequenceChunk(list(range(3, 14)), 0, tables["a"]), SequenceChunk(list(range(20, 27)), 0, tables["b"])],
                       BLOCK_SIZE)
    logits = {}
    for fused in (False, True):
        runner = ModelRunner(loaded, make_pool(loaded), fused_layers=fused, compiled_decode=False)
        first = runner.forward(prompt)
        decode = pack_step([SequenceChunk([9], 11, tables["a"]), SequenceChunk([4], 7, tables["b"])], BLOCK_SIZE)
        logits[fused] = (np.array(first), np.array(runner.forward(decode)))
    for plain, fused in zip(logits[False], logits[True]):
        np.testing.assert_allclose(fused, plain, atol=LOGIT_ATOL, rtol=0)


def test_fusing_keeps_one_copy_of_the_weights_and_mlx_lm_generation_unchanged(demo_model_dir):
    model, _ = load(str(demo_model_dir))
    tokens = mx.array([[3, 17, 29, 5, 8, 41]])
    before = np.array(model(tokens, cache=make_prompt_cache(model)))
    mx.clear_cache()
    held = mx.get_active_memory()
    assert fuse_stack(text_stack(model)) is not None
    gc.collect()
    weights = sum(v.nbytes for _, v in nn.utils.tree_flatten(model.parameters()) if v.ndim == 2)
    assert mx.get_active_memory() - held < 0.05 * weights  # the stacked matrices replaced the modules' own
    after = np.array(model(tokens, cache=make_prompt_cache(model)))
    np.testing.assert_array_equal(after, before)
    layer = text_stack(model).layers[0].self_attn
    stacked = fuse_stack(text_stack(model))  # once per stack: the second call hands back the first
    assert stacked is fuse_stack(text_stack(model))
    np.testing.assert_array_equal(np.array(stacked.layers[0].qkv.weight_t.T[: layer.q_proj.weight.shape[0]]),
                                  np.array(layer.q_proj.weight))


@pytest.mark.parametrize("family, fuses", [("qwen3", True), ("qwen2", True), ("llama3", True), ("gemma", False),
                                           ("phi3", False), ("qwen3_moe", False)])
def test_only_the_plain_families_fuse(family, fuses, tmp_path, demo_model_dir):
    model, _ = load(str(write_tiny_model(tmp_path / family, family, demo_model_dir)))
    assert (fuse_stack(text_stack(model)) is not None) is fuses


def quantized_matmul_is_sound(layer: nn.QuantizedLinear, rows: int) -> bool:
    """Whether this device's quantized matmul gives the dequantized weights' product. MLX 0.32.4's CUDA
    kernel does not when the input has one group of 64 (the tiny models' width) and more than one row: it
    read NaN or stale memory on the H200, where the CPU, and every wider input, agreed to 1e-6
    (docs/benchmarks.md, "A quantized matmul of one group on CUDA")."""
    x = mx.random.normal((1, rows, layer.scales.shape[-1] * layer.group_size), key=mx.random.key(0))
    dense = mx.dequantize(layer.weight, layer.scales, layer.biases, layer.group_size, layer.bits)
    return bool(mx.allclose(layer(x), x @ dense.T, atol=1e-3).item())


def test_quantized_projections_fuse_and_a_mixed_layer_does_not(tmp_path, demo_model_dir):
    folder = write_quantized_model(tmp_path / "q", write_tiny_model(tmp_path / "f", "qwen3", demo_model_dir), 4, 64)
    model, _ = load(str(folder))
    tokens = mx.array([[3, 17, 29, 5]])
    if not quantized_matmul_is_sound(text_stack(model).layers[0].self_attn.q_proj, tokens.shape[1]):
        pytest.skip("this device's quantized matmul is wrong for the tiny model's width (MLX, not fusing)")
    before = np.array(model(tokens, cache=make_prompt_cache(model)))
    fused = fuse_stack(text_stack(model))
    assert fused is not None and fused.layers[0].qkv.quantized is not None
    np.testing.assert_array_equal(np.array(model(tokens, cache=make_prompt_cache(model))), before)
    mixed, _ = load(str(write_tiny_model(tmp_path / "m", "qwen3", demo_model_dir)))
    layer = text_stack(mixed).layers[1].self_attn
    layer.k_proj = nn.QuantizedLinear.from_linear(layer.k_proj, group_size=32, bits=4)
    assert fuse_stack(text_stack(mixed)) is None


@pytest.mark.skipif(not cpu_kernels.loaded() or mx.default_device() != mx.cpu, reason="no CPU kernels extension here")
def test_a_float32_model_fused_on_the_cpu_runs_the_kernels_swiglu_and_a_bfloat16_one_mlx_lms(demo_model_dir):
    model, _ = load(str(demo_model_dir))  # the demo model is float32
    assert {layer.activation for layer in fuse_stack(text_stack(model)).layers} == {cpu_kernels.swiglu}
    half, _ = load(str(demo_model_dir))
    half.set_dtype(mx.bfloat16)
    assert {layer.activation for layer in fuse_stack(text_stack(half)).layers} == {fused_layers._mlx_lm_swiglu}

"""The paged forward pass gives the logits of mlx-lm's own contiguous-cache forward.

Every comparison runs the same model object twice: once through `ModelRunner` over a KV
pool whose blocks are scattered on purpose, once through `mlx_lm.models.cache.make_prompt_cache`.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from orchard.node.model.demo import write_demo_model
from orchard.node.model.loader import load_model
from orchard.node.model.positions import PositionalRoPE
from orchard.node.model.runner import (
    InvalidStep,
    ModelRunner,
    SequenceChunk,
    StepInput,
    install_paged_attention,
    pack_step,
)
from tests.node.tiny_models import write_tiny_model

BLOCK_SIZE = 4
NUM_BLOCKS = 48
BLOCKS_PER_SEQ = 12
ATOL = 1e-4
PROMPTS = {
    "a": "The orchard on the hill is old and the trees lean toward the south",
    "b": "Why does the baker never sleep enough?",
    "c": "In the kitchen of the stone house there is a shelf of jars that grows longer every autumn",
}


class Pool:
    """Stand-in with the `keys` / `values` lists the adapter reads and replaces."""

    def __init__(self, geometry, num_blocks):
        dtype = getattr(mx, geometry.dtype)
        shape = (num_blocks, geometry.block_size, geometry.num_kv_heads, geometry.head_dim)
        self.keys = [mx.zeros(shape, dtype) for _ in range(geometry.num_layers)]
        self.values = [mx.zeros(shape, dtype) for _ in range(geometry.num_layers)]


def make_pool(loaded):
    geometry = loaded.geometry(BLOCK_SIZE)
    try:
        from orchard.kvcache.pool import KVPool
    except ImportError:
        return Pool(geometry, NUM_BLOCKS)
    return KVPool(geometry, NUM_BLOCKS)


def scattered_tables(names):
    """Each sequence gets blocks from a fixed shuffle of 1..NUM_BLOCKS-1, so none are adjacent."""
    order = np.random.default_rng(3).permutation(np.arange(1, NUM_BLOCKS))
    return {name: order[i * BLOCKS_PER_SEQ:(i + 1) * BLOCKS_PER_SEQ].tolist() for i, name in enumerate(names)}


class Harness:
    """Drives both paths in lockstep: `step({seq: new_tokens})` returns (paged, reference) logits per seq."""

    def __init__(self, loaded):
        from mlx_lm.models.cache import make_prompt_cache

        self.loaded = loaded
        self.runner = ModelRunner(loaded, make_pool(loaded))
        self.tables = scattered_tables(PROMPTS)
        self.lengths = {name: 0 for name in PROMPTS}
        self.caches = {name: make_prompt_cache(loaded.model) for name in PROMPTS}

    def encode(self, name):
        return self.loaded.tokenizer.encode(PROMPTS[name])

    def step(self, new_tokens: dict[str, list[int]]):
        chunks = [SequenceChunk(tokens, self.lengths[name], self.tables[name]) for name, tokens in new_tokens.items()]
        paged = self.runner.forward(pack_step(chunks, BLOCK_SIZE))
        mx.eval(paged)
        result = {}
        for row, (name, tokens) in enumerate(new_tokens.items()):
            reference = self.loaded.model(mx.array(tokens)[None], cache=self.caches[name])[0, -1]
            result[name] = (paged[row], reference)
            self.lengths[name] += len(tokens)
        return result


def assert_close(pairs):
    for name, (paged, reference) in pairs.items():
        assert paged.shape == reference.shape
        np.testing.assert_allclose(np.array(paged), np.array(reference), atol=ATOL, rtol=0, err_msg=name)


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory):
    return write_demo_model(tmp_path_factory.mktemp("demo"))


@pytest.fixture(scope="module", params=["demo", "qwen3", "mistral", "qwen2"])
def loaded(request, demo_path, tmp_path_factory):
    if request.param == "demo":
        return load_model(str(demo_path))
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, demo_path)
    return load_model(str(folder))


def test_single_prompt_in_one_chunk_matches_mlx_lm(loaded):
    h = Harness(loaded)
    assert_close(h.step({"a": h.encode("a")}))


def test_prompt_in_chunks_across_steps_matches_mlx_lm(loaded):
    h = Harness(loaded)
    prompt = h.encode("c")
    # Chunk edges fall inside blocks and across them.
    for lo, hi in [(0, 5), (5, 8), (8, 15), (15, len(prompt))]:
        assert_close(h.step({"c": prompt[lo:hi]}))


def test_decode_steps_after_prefill_match_mlx_lm(loaded):
    h = Harness(loaded)
    _, reference = h.step({"b": h.encode("b")})["b"]
    for _ in range(6):
        pairs = h.step({"b": [int(mx.argmax(reference))]})
        assert_close(pairs)
        _, reference = pairs["b"]


def test_packed_step_mixing_decode_rows_and_a_prefill_chunk_matches_mlx_lm(loaded):
    h = Harness(loaded)
    prompt_c = h.encode("c")
    first = h.step({"a": h.encode("a"), "b": h.encode("b"), "c": prompt_c[:6]})  # three prefills in one step
    assert_close(first)
    mixed = h.step({
        "a": [int(mx.argmax(first["a"][1]))],
        "c": prompt_c[6:],
        "b": [int(mx.argmax(first["b"][1]))],
    })
    assert_close(mixed)
    assert_close(h.step({name: [int(mx.argmax(ref))] for name, (_, ref) in mixed.items()}))


def test_greedy_loop_over_the_adapter_matches_mlx_lm_stream_generate(demo_path):
    from mlx_lm.generate import stream_generate

    loaded = load_model(str(demo_path))
    prompt = loaded.tokenizer.encode(PROMPTS["c"])
    expected = [r.token for r in stream_generate(loaded.model, loaded.tokenizer, prompt, max_tokens=20)]
    runner = ModelRunner(loaded, make_pool(loaded))
    table, length, produced = scattered_tables(["only"])["only"], 0, []
    for tokens in (prompt[:7], prompt[7:]):  # chunked prefill, then decode
        logits = runner.forward(pack_step([SequenceChunk(tokens, length, table)], BLOCK_SIZE))
        length += len(tokens)
    while len(produced) < len(expected):
        produced.append(int(mx.argmax(logits[0])))
        logits = runner.forward(pack_step([SequenceChunk(produced[-1:], length, table)], BLOCK_SIZE))
        length += 1
    assert produced == expected
    assert len(set(produced)) > 5


def test_adapter_leaves_mlx_lm_forward_unchanged_and_installs_once(demo_path):
    from mlx_lm.models.cache import make_prompt_cache

    loaded = load_model(str(demo_path))
    tokens = mx.array(loaded.tokenizer.encode(PROMPTS["a"]))[None]
    before = loaded.model(tokens, cache=make_prompt_cache(loaded.model))
    ModelRunner(loaded, make_pool(loaded))
    ModelRunner(loaded, make_pool(loaded))
    after = loaded.model(tokens, cache=make_prompt_cache(loaded.model))
    assert mx.array_equal(before, after)
    rope = loaded.model.layers[0].self_attn.rope
    assert isinstance(rope, PositionalRoPE) and not isinstance(rope.inner, PositionalRoPE)
    assert install_paged_attention(loaded.model) is False


def test_pack_step_derives_positions_slots_offsets_and_padded_tables():
    step = pack_step([SequenceChunk([11], 5, [3, 9]), SequenceChunk([21, 22, 23], 2, [4, 1, 7])], block_size=4)
    assert step.token_ids == [11, 21, 22, 23]
    assert step.positions == [5, 2, 3, 4]
    assert step.slot_mapping == [9 * 4 + 1, 4 * 4 + 2, 4 * 4 + 3, 1 * 4 + 0]
    assert step.query_start_loc == [0, 1, 4]
    assert step.context_lens == [6, 5]
    assert step.block_tables.tolist() == [[3, 9, 0], [4, 1, 7]]


def test_pack_step_refuses_tokens_beyond_the_block_table():
    with pytest.raises(InvalidStep, match="beyond"):
        pack_step([SequenceChunk([1, 2, 3], 6, [5, 6])], block_size=4)


def test_forward_refuses_offsets_that_do_not_cover_the_tokens(demo_path):
    loaded = load_model(str(demo_path))
    runner = ModelRunner(loaded, make_pool(loaded))
    step = StepInput(token_ids=[1, 2, 3], positions=[0, 1, 2], slot_mapping=[4, 5, 6],
                     block_tables=[[1]], query_start_loc=[0, 2], context_lens=[3])
    with pytest.raises(InvalidStep, match="query_start_loc"):
        runner.forward(step)


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_half_precision_models_get_a_pool_of_their_dtype_and_matching_logits(dtype, demo_path):
    loaded = load_model(str(demo_path))
    loaded.model.set_dtype(getattr(mx, dtype))
    assert loaded.geometry(BLOCK_SIZE).dtype == dtype
    h = Harness(loaded)
    prompt = h.encode("a")
    h.step({"a": prompt[:6]})
    pairs = h.step({"a": prompt[6:]})
    paged, reference = pairs["a"]
    assert paged.dtype == getattr(mx, dtype)
    np.testing.assert_allclose(np.array(paged.astype(mx.float32)), np.array(reference.astype(mx.float32)), atol=2e-2)
    assert int(mx.argmax(paged)) == int(mx.argmax(reference))


def test_a_model_whose_values_are_narrower_than_its_keys_attends_on_the_reference(demo_path, tmp_path, monkeypatch):
    """Chosen once for the model, wherever a compiled backend would be the default."""
    from orchard import kernels

    monkeypatch.setattr(kernels.backends, "available_backends", lambda: ["cuda", "reference"])
    split = load_model(str(write_tiny_model(tmp_path / "deepseek_v2", "deepseek_v2", demo_path)))
    runner = ModelRunner(split, make_pool(split))
    assert (runner.attention_backend, runner.compiled_decode) == ("reference", None)
    one_width = load_model(str(write_tiny_model(tmp_path / "qwen3", "qwen3", demo_path))).geometry(BLOCK_SIZE)
    assert kernels.backend_for_head_dims(None, one_width.head_dim, one_width.value_dim) == "cuda"


def test_a_decode_step_packs_as_the_general_packer_packs_it():
    from orchard.node.model.runner import pack_decode

    tables = [[3, 9, 4], [7], [12, 5]]
    positions = [40, 3, 17]
    tokens = [11, 22, 33]
    general = pack_step([SequenceChunk([t], p, table) for t, p, table in zip(tokens, positions, tables)], 16)
    fast = pack_decode(tokens, positions, tables, 16)
    for name in ("token_ids", "positions", "slot_mapping", "query_start_loc", "context_lens"):
        assert list(getattr(fast, name)) == list(getattr(general, name)), name
    np.testing.assert_array_equal(fast.block_tables, general.block_tables)
    with pytest.raises(InvalidStep, match="beyond the 1 blocks"):
        pack_decode([1], [16], [[7]], 16)

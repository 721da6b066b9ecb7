"""Hybrid models' KV blocks migrate between engines with the recurrent state after the last of them.

Two engines of the same tiny hybrid checkpoint (`tiny_models.HYBRID_CONFIGS`): the target resumes
a migrated prompt from the imported state snapshot exactly as from one it computed itself (tokens
and top-5 log-probs of mlx-lm, the state bit for bit, the prompt's blocks a prefix hit), over the
plain payload, the Ray path's mover and the direct link. Payloads that are damaged, cut off, for
another state pool, without a state or with a state of another block are refused and leave nothing.
"""

from __future__ import annotations

import asyncio
import dataclasses
import threading

import numpy as np
import pytest
from mlx_lm import load

from orchard.kvcache.errors import CorruptKVPayload, IncompatibleKVPayload
from orchard.kvcache.events import MEMORY, STATE, BlockStored
from orchard.kvcache.geometry import StateArray, StateGeometry
from orchard.kvcache.wire import StateSnapshotData, decode_payload, encode_blocks
from orchard.node.async_engine import AsyncEngine
from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.serving import kv_link
from orchard.node.serving import link_auth as auth
from orchard.node.serving.direct_path import DirectPath
from orchard.node.serving.kv_link import KVLinkConfig
from orchard.node.serving.migration import BlockMover, MigrationConfig
from orchard.node.types import SamplingParams
from tests.node.test_families import MAX_TOKENS, assert_matches_mlx_lm, prompts, reference, run
from tests.node.test_hybrid import state_after_prefill
from tests.node.tiny_models import HYBRID_CONFIGS, write_tiny_model

BS = 4
PROMPT_LENGTH = 13  # three full blocks and one token: the prompt's state is snapshotted at 12


def hybrid_engine(folder, **overrides) -> LLMEngine:
    return LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=BS, **overrides))


@pytest.fixture(scope="module", params=sorted(HYBRID_CONFIGS))
def hybrid(request, tmp_path_factory, demo_model_dir):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, demo_model_dir)
    reference_model, _ = load(str(folder))
    return folder, reference_model


@pytest.fixture(scope="module")
def qwen3_next(tmp_path_factory, demo_model_dir):
    return write_tiny_model(tmp_path_factory.mktemp("qwen3_next"), "qwen3_next", demo_model_dir)


@pytest.fixture(scope="module")
def exported(qwen3_next):
    """A source engine that served one prompt, and the payload of the prompt's three blocks."""
    source = hybrid_engine(qwen3_next)
    prompt = prompts(source.model.vocab_size, [PROMPT_LENGTH], offset=5)[0]
    run(source, [prompt], prefix="source")
    return source, source.export_blocks(source.kv.block_hashes(prompt))


def assert_nothing_imported(engine: LLMEngine) -> None:
    assert engine.kv.manager.num_cached == 0 and len(engine.kv.snapshots) == 0
    assert not [e for e in engine.drain_kv_events() if isinstance(e, BlockStored)]


# ---- the payload between two engines ----------------------------------------------------------


def test_a_migrated_prompt_resumes_on_the_target_as_mlx_lm_computes_it(hybrid):
    folder, model = hybrid
    source, target = hybrid_engine(folder), hybrid_engine(folder)
    prompt = prompts(source.model.vocab_size, [PROMPT_LENGTH], offset=3)[0]
    on_source = run(source, [prompt], prefix="source")
    hashes = source.kv.block_hashes(prompt)
    assert target.import_blocks(source.export_blocks(hashes)) == 3
    events = [e for e in target.drain_kv_events() if isinstance(e, BlockStored)]
    stored, states = ([e.block_hash for e in events if e.tier == tier] for tier in (MEMORY, STATE))
    assert stored == hashes and states == [hashes[-1]] and target.kv.snapshots.hashes() == [hashes[-1]]
    on_target = run(target, [prompt], prefix="target")
    assert on_target[0][0].num_cached_tokens == 12 and target.kv.snapshots.restored == 1
    assert_matches_mlx_lm(model, [prompt, prompt], on_source + on_target)


def test_the_imported_state_resumes_bit_for_bit_as_a_prefill_of_the_same_tokens(hybrid):
    folder, _ = hybrid
    source, target = hybrid_engine(folder), hybrid_engine(folder)
    prompt = prompts(source.model.vocab_size, [PROMPT_LENGTH], offset=1)[0]
    run(source, [prompt], prefix="warm")
    target.import_blocks(source.export_blocks(source.kv.block_hashes(prompt)))
    resumed = state_after_prefill(target, "resumed", prompt)
    assert target.kv.snapshots.restored == 1
    fresh = state_after_prefill(hybrid_engine(folder, enable_prefix_caching=False), "fresh", prompt)
    for mine, theirs in zip(resumed, fresh, strict=True):
        for a, b in zip(mine, theirs, strict=True):
            assert np.array_equal(a, b)


def exported_run(source: LLMEngine, hashes) -> tuple[list, bytes | None]:
    decoded = decode_payload(source.export_blocks(hashes), source.kv.geometry, source.kv.state_geometry)
    return [b.block_hash for b in decoded.blocks], decoded.state and decoded.state.block_hash


def test_an_export_stops_at_the_last_block_with_a_state_snapshot(qwen3_next):
    """The source holds the five full blocks of prompt and answer, with states after the prompt's
    last (3) and the answer's (5); a hint for blocks past those, or without a state at its end,
    gets the run up to the last state it has."""
    source = hybrid_engine(qwen3_next)
    prompt = prompts(source.model.vocab_size, [PROMPT_LENGTH], offset=5)[0]
    (final, _), = run(source, [prompt])
    answered = prompt + final.outputs[0].token_ids
    hashes = source.kv.block_hashes(answered)
    assert len(hashes) == 5 and set(source.kv.snapshots.hashes()) == {hashes[2], hashes[4]}
    assert exported_run(source, hashes + source.kv.block_hashes(answered + [3] * 8)[5:]) == (hashes, hashes[4])
    assert exported_run(source, hashes[:4]) == (hashes[:3], hashes[2])
    source.kv.snapshots.drop(hashes[4])
    assert exported_run(source, hashes) == (hashes[:3], hashes[2])
    source.kv.snapshots.drop(hashes[2])
    assert exported_run(source, hashes) == ([], None)  # no state here: nothing worth sending


def foreign_state(payload: bytes, engine: LLMEngine) -> bytes:
    """The payload with its state's last array one element wider: another state pool's state."""
    decoded = decode_payload(payload, engine.kv.geometry, engine.kv.state_geometry)
    layers = [list(layer) for layer in decoded.state.geometry.layers]
    last = layers[-1][-1]
    layers[-1][-1] = StateArray((*last.shape[:-1], last.shape[-1] + 1), last.dtype)
    arrays = [list(layer) for layer in decoded.state.arrays]
    arrays[-1][-1] = np.zeros(layers[-1][-1].shape, dtype=last.numpy_storage_dtype)
    geometry = StateGeometry(tuple(tuple(layer) for layer in layers))
    return encode_blocks(engine.kv.geometry, decoded.blocks, StateSnapshotData(decoded.state.block_hash, geometry, arrays))


@pytest.mark.parametrize("damage", ["corrupted", "truncated", "foreign state", "without state"])
def test_a_damaged_or_unfitting_payload_is_refused_and_leaves_nothing(exported, qwen3_next, damage):
    source, payload = exported
    if damage == "corrupted":
        broken = bytearray(payload)
        broken[len(broken) // 2] ^= 0x10
        payload, error = bytes(broken), CorruptKVPayload
    elif damage == "truncated":
        payload, error = payload[: len(payload) - 64], CorruptKVPayload
    elif damage == "foreign state":
        payload, error = foreign_state(payload, source), IncompatibleKVPayload
    else:
        blocks = decode_payload(payload, source.kv.geometry, source.kv.state_geometry).blocks
        payload, error = encode_blocks(source.kv.geometry, blocks), IncompatibleKVPayload
    target = hybrid_engine(qwen3_next)
    target.drain_kv_events()
    with pytest.raises(error):
        target.import_blocks(payload)
    assert_nothing_imported(target)


def test_a_state_of_another_block_or_of_none_is_refused_and_leaves_nothing(exported, qwen3_next):
    source, payload = exported
    decoded = decode_payload(payload, source.kv.geometry, source.kv.state_geometry)
    target = hybrid_engine(qwen3_next)
    target.drain_kv_events()
    misplaced = dataclasses.replace(decoded.state, block_hash=decoded.blocks[0].block_hash)
    for blocks, state in ((decoded.blocks, misplaced), (decoded.blocks, None), ([], decoded.state)):
        with pytest.raises(IncompatibleKVPayload):
            target.kv.import_decoded(blocks, state)
    assert_nothing_imported(target)


# ---- pulls between two running engines (the Ray path's mover, the direct link) -----------------

GREEDY = SamplingParams(temperature=0.0, max_tokens=MAX_TOKENS, ignore_eos=True)
KEY = auth.link_key("a-cluster-token-of-at-least-32-characters")


async def generate(engine: AsyncEngine, request_id: str, tokens: list[int]):
    last = None
    async for out in engine.generate(request_id, tokens, GREEDY):
        last = out
    return last.outputs[0].token_ids, last.num_cached_tokens


@pytest.fixture
def running(qwen3_next):
    """Source and target engines on their own threads, and the mlx-lm reference of the checkpoint."""
    engines = [AsyncEngine(hybrid_engine(qwen3_next, max_num_batched_tokens=8)) for _ in range(2)]
    yield engines, load(str(qwen3_next))[0]
    for engine in engines:
        engine.shutdown()


def test_a_pull_through_the_mover_is_one_payload_and_resumes_exactly(running):
    (source, target), model = running
    prompt = prompts(source.engine.model.vocab_size, [PROMPT_LENGTH], offset=7)[0]
    hashes = source.engine.kv.block_hashes(prompt)

    async def go():
        await generate(source, "warm", prompt)
        mover = BlockMover(target, MigrationConfig(chunk_bytes=source.engine.kv.geometry.bytes_per_block))
        result = await mover.pull(BlockMover(source).export, "a", hashes)
        return result, await generate(target, "migrated", prompt)

    result, (tokens, hit) = asyncio.run(go())
    assert (result.ok, result.requested, result.imported) == (True, 3, 3)
    assert (tokens, hit) == (reference(model, prompt)[0], 12)


@pytest.mark.parametrize("compress", ["never", "always"])
def test_a_direct_pull_carries_the_state_and_resumes_exactly(running, monkeypatch, compress):
    (source, target), model = running
    layered = []  # a hybrid run travels in version 2, whose payload carries the state
    monkeypatch.setattr(kv_link, "layer_pieces", lambda *a: layered.append(a) or pytest.fail("layer-major for a hybrid model"))
    exported_on = []  # its state is copied out through MLX: on the engine thread, never on an idle engine's caller
    real_export = source.engine.kv.pin_export
    monkeypatch.setattr(source.engine.kv, "pin_export", lambda hashes: exported_on.append(threading.current_thread().name)
                        or real_export(hashes))
    config = KVLinkConfig(chunk_bytes=source.engine.kv.geometry.bytes_per_block, handshake_timeout_s=2.0, compress=compress)
    paths = {name: DirectPath(BlockMover(e), name, KEY, config) for name, e in zip("ab", (source, target))}
    for path in paths.values():
        path.start()
    prompt = prompts(source.engine.model.vocab_size, [PROMPT_LENGTH], offset=9)[0]

    async def resolve(_peer):
        return paths["a"].address

    async def go():
        await generate(source, "warm", prompt)
        result = await paths["b"].pull("a", source.engine.kv.block_hashes(prompt), resolve)
        return result, await generate(target, "migrated", prompt)

    try:
        result, (tokens, hit) = asyncio.run(go())
    finally:
        for path in paths.values():
            path.close()
    assert (result.ok, result.via, result.requested, result.imported) == (True, "direct", 3, 3), result.error
    assert (result.wire_bytes < result.bytes) == (compress == "always")  # the state inside the frame too
    assert (tokens, hit) == (reference(model, prompt)[0], 12)
    assert layered == [] and source.engine.kv.pin_layer_export(source.engine.kv.block_hashes(prompt)) is None
    assert exported_on == ["orchard-engine"]

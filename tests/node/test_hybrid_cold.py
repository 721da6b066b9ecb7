"""A hybrid model's cached prefixes on disk: blocks spill to the cold tier with their state
snapshots (kvcache.cold_states), and a prompt whose blocks left memory resumes from disk,
token-exact against mlx-lm, also after the engine restarts on the same cold tier."""

from __future__ import annotations

import pytest
from mlx_lm import load

from orchard.kvcache.events import STATE, BlockRemoved, BlockStored
from orchard.node.engine import EngineConfig, LLMEngine
from tests.node.test_families import assert_matches_mlx_lm, prompts, run
from tests.node.tiny_models import write_tiny_model


@pytest.fixture(scope="module", params=["qwen3_next", "qwen3_5"])
def hybrid(request, tmp_path_factory, demo_model_dir):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, demo_model_dir)
    reference_model, _ = load(str(folder))
    return folder, reference_model


def cold_engine(folder, cold_dir) -> LLMEngine:
    # 12 blocks of 4 tokens (11 usable): a second prompt of 36 tokens and its 8 outputs take all 11
    return LLMEngine(EngineConfig(model=str(folder), num_blocks=12, block_size=4, cold_tier_dir=str(cold_dir),
                                  cold_tier_gb=0.01))


def spill_first_prompt(engine: LLMEngine) -> list[int]:
    vocab = engine.model.vocab_size
    first = prompts(vocab, [13], offset=5)[0]
    run(engine, [first], prefix="a")  # its last full block (12 tokens) gets a snapshot
    run(engine, prompts(vocab, [36], offset=40), prefix="b")
    return first


def test_a_spilled_prompt_resumes_from_its_blocks_and_snapshot_on_disk(hybrid, tmp_path):
    folder, model = hybrid
    engine = cold_engine(folder, tmp_path / "cold")
    first = spill_first_prompt(engine)
    boundary = engine.kv.block_hashes(first)[-1]
    assert boundary not in engine.kv.snapshots and boundary in engine.kv.cold_states  # left memory with its block
    assert engine.kv.manager.cached_block(boundary) is None
    again = run(engine, [first], prefix="c")
    assert again[0][0].num_cached_tokens == 12
    assert engine.kv.stats().cold_tier_hits == 3  # its three full blocks came back from disk
    assert_matches_mlx_lm(model, [first], again)


def test_a_restarted_engine_resumes_from_the_cold_tier(hybrid, tmp_path):
    folder, model = hybrid
    engine = cold_engine(folder, tmp_path / "cold")
    first = spill_first_prompt(engine)
    engine.kv.close()
    restarted = cold_engine(folder, tmp_path / "cold")
    assert engine.kv.block_hashes(first)[-1] in restarted.kv.cold_states
    again = run(restarted, [first], prefix="c")
    assert again[0][0].num_cached_tokens == 12
    assert_matches_mlx_lm(model, [first], again)


def test_a_damaged_snapshot_on_disk_is_recomputed_not_restored(hybrid, tmp_path):
    folder, model = hybrid
    engine = cold_engine(folder, tmp_path / "cold")
    first = spill_first_prompt(engine)
    store = engine.kv.cold_states
    boundary = engine.kv.block_hashes(first)[-1]
    store._mm[store._offset(store._index[boundary]) + 100] ^= 0xFF  # a flipped byte in its arrays
    again = run(engine, [first], prefix="c")
    assert again[0][0].num_cached_tokens == 0 and boundary not in store
    assert_matches_mlx_lm(model, [first], again)


def test_the_states_a_resume_can_use_are_announced_while_held(hybrid, tmp_path):
    """A STATE-tier store when a snapshot is kept, none while it moves to disk with its block,
    a STATE-tier removal when it is gone; a restart announces what its cold tier still holds."""
    folder, _ = hybrid
    engine = cold_engine(folder, tmp_path / "cold")
    vocab = engine.model.vocab_size
    first = prompts(vocab, [13], offset=5)[0]
    boundary = engine.kv.block_hashes(first)[-1]
    run(engine, [first], prefix="a")
    assert boundary in {e.block_hash for e in engine.kv.drain_events() if isinstance(e, BlockStored) and e.tier == STATE}
    run(engine, prompts(vocab, [36], offset=40), prefix="b")  # spills `first` with its snapshot
    assert boundary in engine.kv.cold_states and boundary not in engine.kv.snapshots
    assert boundary not in {e.block_hash for e in engine.kv.drain_events() if isinstance(e, BlockRemoved) and e.tier == STATE}
    assert BlockStored.state(engine.kv.events.next_seq, boundary) in engine.kv.snapshot()
    engine.kv.close()
    restarted = cold_engine(folder, tmp_path / "cold")
    assert boundary in {e.block_hash for e in restarted.kv.drain_events() if isinstance(e, BlockStored) and e.tier == STATE}
    forgetful = LLMEngine(EngineConfig(model=str(folder), num_blocks=12, block_size=4))  # no cold tier
    run(forgetful, [first], prefix="a")
    run(forgetful, prompts(vocab, [36], offset=40), prefix="b")
    removed = [e for e in forgetful.kv.drain_events() if isinstance(e, BlockRemoved) and e.tier == STATE]
    assert boundary in {e.block_hash for e in removed}
    assert not any(isinstance(e, BlockStored) and e.tier == STATE and e.block_hash == boundary for e in forgetful.kv.snapshot())


def test_a_block_aligned_prompt_resumes_from_an_earlier_snapshot_on_disk(hybrid, tmp_path):
    """Snapshots on disk at blocks 3 and 5 of one run; a 20-token prompt along it may reuse 4 blocks
    (its last token is always computed), so it resumes from block 3's, which must be the one read."""
    folder, model = hybrid
    engine = cold_engine(folder, tmp_path / "cold")
    vocab = engine.model.vocab_size
    first = prompts(vocab, [13], offset=5)[0]
    answered = first + run(engine, [first], prefix="a")[0][0].outputs[0].token_ids  # 21 tokens: snapshots at 12 and 20
    run(engine, prompts(vocab, [36], offset=40), prefix="b")
    hashes = engine.kv.block_hashes(answered)
    assert hashes[2] in engine.kv.cold_states and hashes[4] in engine.kv.cold_states
    assert hashes[2] not in engine.kv.snapshots and hashes[4] not in engine.kv.snapshots
    again = run(engine, [answered[:20]], prefix="c")
    assert again[0][0].num_cached_tokens == 12
    assert_matches_mlx_lm(model, [answered[:20]], again)


def test_a_snapshot_read_back_from_disk_is_not_written_again_when_its_block_leaves(hybrid, tmp_path, monkeypatch):
    folder, _ = hybrid
    engine = cold_engine(folder, tmp_path / "cold")
    first = spill_first_prompt(engine)
    boundary = engine.kv.block_hashes(first)[-1]
    run(engine, [first], prefix="c")  # reads it back from disk, where it stays
    store = engine.kv.cold_states
    assert boundary in engine.kv.snapshots and boundary in store
    written, real_put = [], store.put
    monkeypatch.setattr(store, "put", lambda key, arrays: written.append(key) or real_put(key, arrays))
    run(engine, prompts(engine.model.vocab_size, [36], offset=80), prefix="d")  # its blocks leave memory again
    assert boundary not in engine.kv.snapshots and boundary in store
    assert boundary not in written

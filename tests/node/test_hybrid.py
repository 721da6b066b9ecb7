"""Hybrid models (Gated DeltaNet layers beside full attention: Qwen3-Next, Qwen3.5), token-exact
against mlx-lm over the paged KV pool and the state pool.

Tiny random checkpoints built with mlx-lm's own classes (`tiny_models.HYBRID_CONFIGS`). The
engine's greedy tokens equal mlx-lm's `generate_step` and its top-5 log-probs agree to 1e-5 in
float32: whole and chunked prefill in a packed batch beside decodes, `n > 1` forks, preemption,
and prefixes resumed from state snapshots at block boundaries (a next turn, a resent prompt).
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.types import SamplingParams
from tests.node.test_families import assert_matches_mlx_lm, prompts, reference, run
from tests.node.tiny_models import HYBRID_CONFIGS, write_tiny_model


@pytest.fixture(scope="module", params=sorted(HYBRID_CONFIGS))
def hybrid(request, tmp_path_factory, demo_model_dir):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, demo_model_dir)
    reference_model, _ = load(str(folder))
    return folder, reference_model


def state_after_prefill(engine: LLMEngine, name: str, prompt: list[int]) -> list[list[np.ndarray]]:
    """The sequence's state slot once its prompt is computed (the request then runs to its end)."""
    engine.add_request(name, prompt, SamplingParams(temperature=0.0, max_tokens=2, ignore_eos=True))
    seq = engine.requests[name].sequences[0]
    while seq.num_computed < len(prompt):
        engine.step()
    mx.eval(engine.kv.states.arrays)
    slot = engine.kv.states.slot(seq.seq_id)
    state = [[np.array(pool[slot]) for pool in layer] for layer in engine.kv.states.arrays]
    while engine.has_unfinished:
        engine.step()
    return state


def test_whole_prompts_in_one_batch_match_mlx_lm(hybrid):
    folder, model = hybrid
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4))
    assert engine.kv.states is not None and engine.kv.states.layer_shapes
    batch = prompts(engine.model.vocab_size, [5, 17, 1, 11])
    assert_matches_mlx_lm(model, batch, run(engine, batch))
    assert engine.kv.states.num_free == engine.kv.states.num_slots - 1  # every slot back


def test_chunked_prefill_beside_decodes_matches_mlx_lm(hybrid):
    folder, model = hybrid
    # Chunks of 7 tokens: a long prompt's chunks continue its state while shorter ones decode.
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4, max_num_batched_tokens=7))
    batch = prompts(engine.model.vocab_size, [5, 23, 1, 11])
    assert_matches_mlx_lm(model, batch, run(engine, batch))


def test_preempted_sequences_recompute_their_state(hybrid):
    folder, model = hybrid
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=10, block_size=4, preemption="swap"))
    batch = prompts(engine.model.vocab_size, [9, 13, 6])
    results = run(engine, batch)
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_swaps == 0  # recomputed from a snapshot
    assert_matches_mlx_lm(model, batch, results)


def test_forks_copy_the_state_and_continue_alike(hybrid):
    folder, model = hybrid
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4))
    prompt = prompts(engine.model.vocab_size, [10])[0]
    engine.add_request("n3", prompt, SamplingParams(temperature=0.0, max_tokens=6, ignore_eos=True, n=3))
    final = None
    while engine.has_unfinished:
        for out in engine.step():
            final = out if out.finished else final
    tokens, _ = reference(model, prompt)
    assert [o.token_ids for o in final.outputs] == [tokens[:6]] * 3


def test_a_next_turn_resumes_from_the_last_boundary_of_the_previous_one(hybrid):
    """Turn 2 resends turn 1's prompt and answer plus a new message: it resumes at the last block
    boundary turn 1 computed (its state snapshotted at finish) and matches mlx-lm from scratch."""
    folder, model = hybrid
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4))
    vocab = engine.model.vocab_size
    turn1 = prompts(vocab, [13], offset=5)[0]
    (final1, tops1), = run(engine, [turn1], prefix="turn1")
    turn2 = turn1 + final1.outputs[0].token_ids + prompts(vocab, [5], offset=9)[0]
    (final2, tops2), = run(engine, [turn2], prefix="turn2")
    computed = len(turn1) + len(final1.outputs[0].token_ids) - 1  # the last answer token is never fed back
    assert final2.num_cached_tokens == computed - computed % 4
    assert_matches_mlx_lm(model, [turn1, turn2], [(final1, tops1), (final2, tops2)])


def test_a_resent_prompt_resumes_at_its_last_full_block(hybrid):
    folder, model = hybrid
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4, max_num_batched_tokens=6))
    prompt = prompts(engine.model.vocab_size, [14], offset=3)[0]
    first = run(engine, [prompt], prefix="a")
    second = run(engine, [prompt], prefix="b")
    assert second[0][0].num_cached_tokens == 12
    assert engine.kv.snapshots.restored == 1
    assert_matches_mlx_lm(model, [prompt, prompt], first + second)


def test_a_restored_state_equals_the_prefilled_one_bit_for_bit(hybrid):
    folder, _ = hybrid
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4))
    prompt = prompts(engine.model.vocab_size, [13], offset=1)[0]
    run(engine, [prompt], prefix="warm")
    resumed = state_after_prefill(engine, "resumed", prompt)
    assert engine.kv.snapshots.restored == 1
    cold = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4, enable_prefix_caching=False))
    fresh = state_after_prefill(cold, "fresh", prompt)
    assert cold.kv.snapshots.restored == 0
    for mine, theirs in zip(resumed, fresh):
        for a, b in zip(mine, theirs):
            assert np.array_equal(a, b)


@pytest.mark.parametrize("overlap", [False, True], ids=["step-by-step", "overlapped"])
def test_snapshots_go_with_their_blocks_and_no_block_leaves(hybrid, overlap):
    folder, _ = hybrid
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=12, block_size=4, async_scheduling=overlap))
    vocab = engine.model.vocab_size
    run(engine, prompts(vocab, [13], offset=2), prefix="a")
    assert len(engine.kv.snapshots) == 2  # the prompt's last full block, the answer's last boundary
    run(engine, prompts(vocab, [30], offset=40), prefix="b")  # needs the cached blocks back
    assert engine.kv.manager.stats().evictions > 0 and len(engine.kv.snapshots) <= 2
    assert all(engine.kv.manager.cached_block(h) is not None for h in engine.kv.snapshots.hashes())  # none outlives its block


def test_state_pool_slots_hold_the_state_mlx_lm_computes(hybrid):
    """The state a prefill leaves in a sequence's slot is the one mlx-lm's own cache holds."""
    folder, model = hybrid
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4, max_num_batched_tokens=5))
    prompt = prompts(engine.model.vocab_size, [13])[0]
    engine.add_request("s", prompt, SamplingParams(temperature=0.0, max_tokens=4, ignore_eos=True))
    seq = engine.requests["s"].sequences[0]
    while seq.num_computed < len(prompt):
        engine.step()
    mx.eval(engine.kv.states.arrays)
    slot = engine.kv.states.slot(seq.seq_id)
    cache = model.make_cache()
    model(mx.array(prompt)[None], cache=cache)
    linear = [c for c in cache if type(c).__name__ == "ArraysCache"]
    for layer, theirs in enumerate(linear):
        for kind in range(2):
            np.testing.assert_allclose(np.array(engine.kv.states.arrays[layer][kind][slot]), np.array(theirs[kind][0]),
                                       atol=1e-5, rtol=0)


def test_a_shared_system_prompt_resumes_from_the_interval_snapshot(hybrid):
    """Prompt chunks stop at each snapshot interval (16 blocks of 4 here): another prompt that
    shares the first 64 tokens and nothing more resumes at 64."""
    folder, model = hybrid
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=96, block_size=4))
    vocab = engine.model.vocab_size
    system = prompts(vocab, [64], offset=11)[0]
    batch = [system + tail for tail in prompts(vocab, [6, 9], offset=2)]
    first = run(engine, batch[:1], prefix="first")
    second = run(engine, batch[1:], prefix="second")
    assert second[0][0].num_cached_tokens == 64
    assert_matches_mlx_lm(model, batch, first + second)

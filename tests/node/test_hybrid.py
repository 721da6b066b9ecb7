"""Hybrid models (Gated DeltaNet layers beside full attention: Qwen3-Next, Qwen3.5), token-exact
against mlx-lm over the paged KV pool and the state pool.

Tiny random checkpoints built with mlx-lm's own classes (`tiny_models.HYBRID_CONFIGS`). The
engine's greedy tokens equal mlx-lm's `generate_step` and its top-5 log-probs agree to 1e-5 in
float32: whole and chunked prefill in a packed batch beside decodes, `n > 1` forks, preemption.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest
from mlx_lm import load

from kvcache import StateNotMigratable
from node.engine import EngineConfig, LLMEngine
from node.types import SamplingParams
from tests.node.test_families import assert_matches_mlx_lm, prompts, reference, run
from tests.node.tiny_models import HYBRID_CONFIGS, write_tiny_model


@pytest.fixture(scope="module", params=sorted(HYBRID_CONFIGS))
def hybrid(request, tmp_path_factory, demo_model_dir):
    folder = write_tiny_model(tmp_path_factory.mktemp(request.param), request.param, demo_model_dir)
    reference_model, _ = load(str(folder))
    return folder, reference_model


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
    assert engine.scheduler.num_preemptions > 0 and engine.scheduler.num_swaps == 0  # a state is not on disk
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


def test_no_prefix_is_reused_and_no_block_leaves(hybrid):
    """Until states are snapshotted at block boundaries, KV alone must not resume a hybrid sequence."""
    folder, model = hybrid
    engine = LLMEngine(EngineConfig(model=str(folder), num_blocks=64, block_size=4))
    vocab = engine.model.vocab_size
    system = prompts(vocab, [12], offset=5)[0]
    batch = [system + tail for tail in prompts(vocab, [3, 6])]
    first = run(engine, batch[:1], prefix="first")
    second = run(engine, batch[1:], prefix="second")
    assert second[0][0].num_cached_tokens == 0
    assert_matches_mlx_lm(model, batch, first + second)
    with pytest.raises(StateNotMigratable):
        engine.export_blocks(engine.kv.block_hashes(system))


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

"""Deltas over the wire: what `only_new` drops, `Cumulative` rebuilds exactly, for n > 1 and held-back text."""

from __future__ import annotations

import pickle

from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.serving.stream_delta import Cumulative, only_new
from orchard.node.types import SamplingParams


def test_rebuilt_outputs_equal_the_engines_and_weigh_what_is_new(demo_model_dir):
    engine = LLMEngine(EngineConfig(model=str(demo_model_dir), num_blocks=64, block_size=8))
    prompt = [(7 * j + 3) % 200 + 3 for j in range(150)]
    # Sampled, two continuations, a stop string that holds text back: deltas are uneven.
    params = SamplingParams(max_tokens=40, temperature=0.8, seed=5, n=2, stop=["zzz"], ignore_eos=True)
    engine.add_request("r", prompt, params)
    rebuild, sent, full = Cumulative(prompt), [], []
    while engine.has_unfinished:
        for out in engine.step():
            sent.append(len(pickle.dumps(only_new(out))))
            full.append(len(pickle.dumps(out)))
            rebuilt = rebuild(only_new(out))
            assert rebuilt == out
    assert [len(c.token_ids) for c in rebuilt.outputs] == [40, 40]
    # The engine's own outputs carry the prompt and everything so far; the wire's do not grow.
    assert max(sent[-5:]) < min(sent[:5]) + 100 and min(full) > max(sent), (sent, full)

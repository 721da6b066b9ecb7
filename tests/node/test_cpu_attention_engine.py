"""The engine on this machine's CPU attends on the CPU kernel when it is built, and gives the tokens the
reference backend gives: greedy outputs of mixed prefill and decode steps, token for token."""

from __future__ import annotations

import numpy as np
import pytest

from orchard import kernels
from orchard.kernels import cpu
from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.types import SamplingParams

pytestmark = pytest.mark.skipif(not cpu.loaded(), reason="the CPU attention extension is not built here")


def _greedy(engine: LLMEngine, prompts: list[list[int]]) -> list[list[int]]:
    params = SamplingParams(max_tokens=24, temperature=0.0, ignore_eos=True)
    for i, prompt in enumerate(prompts):
        engine.add_request(f"r{i}", prompt, params)
    tokens: dict[str, list[int]] = {f"r{i}": [] for i in range(len(prompts))}
    while engine.has_unfinished:
        for out in engine.step():
            tokens[out.request_id] += out.outputs[0].token_ids_delta
    return [tokens[f"r{i}"] for i in range(len(prompts))]


def test_the_engine_attends_on_the_cpu_kernel_with_the_reference_tokens(demo_model_dir, monkeypatch):
    rng = np.random.default_rng(11)
    prompts = [rng.integers(5, 500, size=n).tolist() for n in (3, 40, 170, 17, 260, 90)]
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    config = dict(model=str(demo_model_dir), num_blocks=160, block_size=16, max_num_batched_tokens=128)
    engine = LLMEngine(EngineConfig(**config))
    assert engine.runner.attention_backend == "cpu"
    on_kernel = _greedy(engine, prompts)
    monkeypatch.setenv(kernels.ENV_VAR, "reference")
    reference = LLMEngine(EngineConfig(**config))
    assert reference.runner.attention_backend == "reference"
    assert all(len(t) == 24 for t in on_kernel)
    assert on_kernel == _greedy(reference, prompts)

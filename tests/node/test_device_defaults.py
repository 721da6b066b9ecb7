"""What the engine leaves to the device (the step token budget) follows the device the engine
computes on, unless the user names it (EngineConfig, `orchard serve`); overlapped steps are on
wherever it computes, unless turned off."""

from __future__ import annotations

import mlx.core as mx
import pytest

from orchard.cluster.cli.main import build_parser
from orchard.cluster.cli.serve_options import engine_config
from orchard.node import engine as engine_module
from orchard.node.engine import CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET, EngineConfig, LLMEngine
from orchard.node.types import SamplingParams


@pytest.fixture(params=[(mx.cpu, CPU_TOKEN_BUDGET), (mx.gpu, GPU_TOKEN_BUDGET)], ids=["cpu", "gpu"])
def device(request, monkeypatch):
    """The budget expected for the device MLX is said to compute on, whatever this machine has."""
    kind, budget = request.param
    monkeypatch.setattr(engine_module.mx, "default_device", lambda: mx.Device(kind))
    return budget


def test_the_budget_is_the_devices_unless_named_and_steps_overlap_on_every_device(device):
    filled = EngineConfig().for_device()
    assert (filled.max_num_batched_tokens, filled.async_scheduling) == (device, True)
    named = EngineConfig(max_num_batched_tokens=96, async_scheduling=False).for_device()
    assert (named.max_num_batched_tokens, named.async_scheduling) == (96, False)


def test_serve_leaves_them_to_the_device_the_engine_runs_on_unless_a_flag_names_them(device):
    """The config `serve` makes travels to node actors: the node's device decides, not the head's."""
    parser = build_parser()
    left = engine_config(parser.parse_args(["serve"]))
    assert (left.max_num_batched_tokens, left.async_scheduling) == (None, True)
    assert (left.for_device().max_num_batched_tokens, left.for_device().async_scheduling) == (device, True)
    named = engine_config(parser.parse_args(["serve", "--max-num-batched-tokens", "2048", "--no-async-scheduling"]))
    assert (named.for_device().max_num_batched_tokens, named.for_device().async_scheduling) == (2048, False)
    assert engine_config(parser.parse_args(["serve", "--async-scheduling"])).for_device().async_scheduling is True


def _calls_until_first_token(engine: LLMEngine) -> int:
    engine.add_request("a", list(range(3, 40)), SamplingParams(temperature=0.0, max_tokens=3, ignore_eos=True))
    calls = 0
    while True:
        calls += 1
        if any(out.outputs and out.outputs[0].token_ids_delta for out in engine.step()):
            return calls


def test_step_by_step_a_token_comes_out_of_the_step_that_computed_it(model_dirs):
    """Overlapped (the default), the step that computes a token returns it only after the next step was
    launched too; `async_scheduling=False` hands it back a step sooner."""
    config = dict(model=str(model_dirs["demo"]), num_blocks=64)
    assert _calls_until_first_token(LLMEngine(EngineConfig(**config))) == 2
    assert _calls_until_first_token(LLMEngine(EngineConfig(**config, async_scheduling=False))) == 1

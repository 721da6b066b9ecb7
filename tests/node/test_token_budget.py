"""The step token budget follows the device unless the user names one (EngineConfig, `orchard serve`)."""

from __future__ import annotations

import mlx.core as mx
import pytest

from orchard.cluster.cli.main import build_parser
from orchard.cluster.cli.serve_options import engine_config
from orchard.node import engine as engine_module
from orchard.node.engine import CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET, EngineConfig


@pytest.fixture(params=[(mx.cpu, CPU_TOKEN_BUDGET), (mx.gpu, GPU_TOKEN_BUDGET)], ids=["cpu", "gpu"])
def device(request, monkeypatch):
    """(the device MLX is said to compute on, the budget expected for it), whatever this machine has."""
    kind, budget = request.param
    monkeypatch.setattr(engine_module.mx, "default_device", lambda: mx.Device(kind))
    return budget


def test_the_budget_is_the_devices_unless_one_is_named(device):
    assert EngineConfig().max_num_batched_tokens == device
    assert EngineConfig(max_num_batched_tokens=96).max_num_batched_tokens == 96


def test_serve_leaves_the_budget_to_the_device_unless_the_flag_names_one(device):
    parser = build_parser()
    assert engine_config(parser.parse_args(["serve"])).max_num_batched_tokens == device
    assert engine_config(parser.parse_args(["serve", "--max-num-batched-tokens", "2048"])).max_num_batched_tokens == 2048

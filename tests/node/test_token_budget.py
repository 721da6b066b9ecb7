"""The step token budget follows the device unless the user names one (EngineConfig, `orchard serve`)."""

from __future__ import annotations

import mlx.core as mx

from cluster.cli.main import build_parser
from cluster.cli.serve_options import engine_config
from node import engine as engine_module
from node.engine import CPU_TOKEN_BUDGET, GPU_TOKEN_BUDGET, EngineConfig


def test_the_budget_is_the_cpus_here_and_the_gpus_on_a_gpu(monkeypatch):
    assert mx.default_device().type == mx.DeviceType.cpu  # CI's machines compute on the CPU
    assert EngineConfig().max_num_batched_tokens == CPU_TOKEN_BUDGET
    monkeypatch.setattr(engine_module.mx, "default_device", lambda: mx.Device(mx.gpu))
    assert EngineConfig().max_num_batched_tokens == GPU_TOKEN_BUDGET
    assert EngineConfig(max_num_batched_tokens=96).max_num_batched_tokens == 96


def test_serve_leaves_the_budget_to_the_device_unless_the_flag_names_one():
    parser = build_parser()
    assert engine_config(parser.parse_args(["serve"])).max_num_batched_tokens == CPU_TOKEN_BUDGET
    assert engine_config(parser.parse_args(["serve", "--max-num-batched-tokens", "2048"])).max_num_batched_tokens == 2048

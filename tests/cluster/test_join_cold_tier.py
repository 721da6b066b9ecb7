"""`orchard join --cold-tier`: the joined machine's node actor keeps its own private cold tier."""

from __future__ import annotations

from dataclasses import replace

import pytest

from orchard.cluster.cli.join import agent_config
from orchard.cluster.cli.main import build_parser
from orchard.node.engine import EngineConfig
from orchard.node.serving.actor import local_engine_config
from orchard.node.serving.agent import COLD_TIER_DIR_ENV, COLD_TIER_GB_ENV, ray_environment

HEAD_ENGINE = EngineConfig(max_model_len=256, num_blocks=64, max_num_seqs=4)


def join_args(*extra: str):
    return build_parser().parse_args(["join", "--head", "127.0.0.1", *extra])


def test_join_hands_its_cold_tier_to_the_raylet_it_starts(tmp_path):
    config = agent_config(join_args("--cold-tier", str(tmp_path / "cold"), "--cold-tier-gb", "0.01"))
    env = ray_environment("token", base={}, config=config)
    assert env[COLD_TIER_DIR_ENV] == str((tmp_path / "cold").resolve())
    assert float(env[COLD_TIER_GB_ENV]) == 0.01


def test_without_cold_tier_the_heads_settings_stand():
    env = ray_environment("token", base={}, config=agent_config(join_args()))
    assert COLD_TIER_DIR_ENV not in env
    head = replace(HEAD_ENGINE, cold_tier_dir="/srv/head-cold/node-a")
    assert local_engine_config(head, "node-a", env) == head


def test_a_non_positive_size_is_refused():
    with pytest.raises(ValueError, match="cold-tier-gb"):
        agent_config(join_args("--cold-tier", "/tmp/x", "--cold-tier-gb", "0"))


def test_the_joined_nodes_engine_uses_its_local_cold_tier_as_a_private_file(tmp_path):
    from orchard.node.async_engine import AsyncEngine

    cold = tmp_path / "cold"
    env = ray_environment(None, base={}, config=agent_config(join_args("--cold-tier", str(cold), "--cold-tier-gb", "0.01")))
    head = replace(HEAD_ENGINE, cold_tier_dir=str(tmp_path / "head-cold"), cold_tier_gb=1.0)
    engine_config = local_engine_config(head, "node-b", env)
    assert engine_config.cold_tier_dir == str(cold.resolve() / "node-b") and engine_config.cold_tier_gb == 0.01
    engine = AsyncEngine.from_config(engine_config)
    try:
        files = [p for p in (cold / "node-b").iterdir() if p.is_file()]
        assert files, "no cold-tier file was created"
        assert all(p.stat().st_mode & 0o777 == 0o600 for p in files)
        assert (cold / "node-b").stat().st_mode & 0o777 == 0o700
        assert not (tmp_path / "head-cold").exists()  # the head's path is not used on this machine
    finally:
        getattr(engine, "shutdown", lambda: None)()

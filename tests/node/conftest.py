"""Models for engine tests: the demo model and tiny random-weight qwen3 / mistral checkpoints."""

from __future__ import annotations

from pathlib import Path

import pytest

from orchard.node.model.demo import write_demo_model
from tests.node.tiny_models import write_tiny_model


@pytest.fixture(scope="session")
def demo_model_dir(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "model")


@pytest.fixture(scope="session")
def model_dirs(tmp_path_factory, demo_model_dir) -> dict[str, Path]:
    root = tmp_path_factory.mktemp("tiny-models")
    return {
        "demo": demo_model_dir,
        "qwen3": write_tiny_model(root / "qwen3", "qwen3", demo_model_dir),
        "mistral": write_tiny_model(root / "mistral", "mistral", demo_model_dir),
    }

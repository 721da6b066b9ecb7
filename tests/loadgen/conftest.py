"""Shared fixtures for the load generator's tests."""

from __future__ import annotations

import pytest


@pytest.fixture(scope="session")
def demo_model_path():
    """The project's demo model (written once into the user's cache)."""
    from orchard.node.model.demo import default_demo_model_path

    return default_demo_model_path("small")

"""A node names its chip and memory for the dashboard and `orchard status`."""

import os
import sys

import mlx.core as mx
import pytest

from orchard.node.serving.hardware import describe_machine


@pytest.mark.skipif(mx.metal.is_available(), reason="on a Mac the chip comes from MLX's device info")
def test_without_metal_the_cpu_model_and_physical_memory_stand_in():
    machine = describe_machine()
    assert machine["memory_bytes"] == os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    if sys.platform == "linux":
        with open("/proc/cpuinfo") as f:
            names = [line.split(":", 1)[1].strip() for line in f if line.startswith("model name")]
        assert machine["chip"] == names[0]

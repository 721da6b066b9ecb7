"""When requests arrive: a Poisson process at a given rate, or all at once.

A Poisson process has exponentially distributed gaps with mean 1/rate; it is the usual
model of independent users and what vLLM's benchmark uses, so figures line up. An
infinite rate is a burst: every request is due at time zero and only the concurrency
cap spaces them out.
"""

from __future__ import annotations

import math
import random
from collections.abc import Iterator


def is_burst(rate: float) -> bool:
    return math.isinf(rate)


def arrival_offsets(rate: float, seed: int = 0) -> Iterator[float]:
    """Seconds after the start at which each successive request is due (unbounded)."""
    if rate <= 0:
        raise ValueError(f"request rate must be positive, got {rate}")
    rng = random.Random(seed)
    now = 0.0
    while True:  # callers take as many as they need; each step is O(1)
        yield now
        if not is_burst(rate):
            now += rng.expovariate(rate)


def first_offsets(rate: float, count: int, seed: int = 0) -> list[float]:
    """The first `count` arrival offsets, as a list."""
    offsets = arrival_offsets(rate, seed)
    return [next(offsets) for _ in range(count)]

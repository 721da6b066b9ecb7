import math
import statistics

import pytest

from orchard.cluster.bench.loadgen.arrivals import first_offsets


def test_poisson_gaps_have_mean_one_over_rate():
    offsets = first_offsets(rate=8.0, count=20_000, seed=3)
    gaps = [b - a for a, b in zip(offsets, offsets[1:])]
    assert statistics.fmean(gaps) == pytest.approx(1 / 8.0, rel=0.03)
    # exponential gaps: standard deviation equals the mean
    assert statistics.pstdev(gaps) == pytest.approx(1 / 8.0, rel=0.05)


def test_poisson_offsets_start_at_zero_and_increase():
    offsets = first_offsets(rate=2.0, count=50, seed=1)
    assert offsets[0] == 0.0
    assert all(b > a for a, b in zip(offsets, offsets[1:]))


def test_same_seed_gives_same_arrivals_and_other_seed_differs():
    assert first_offsets(5.0, 10, seed=7) == first_offsets(5.0, 10, seed=7)
    assert first_offsets(5.0, 10, seed=7) != first_offsets(5.0, 10, seed=8)


def test_infinite_rate_is_a_burst_at_time_zero():
    assert first_offsets(math.inf, 5) == [0.0] * 5


@pytest.mark.parametrize("rate", [0.0, -1.0])
def test_non_positive_rate_is_refused(rate):
    with pytest.raises(ValueError):
        first_offsets(rate, 1)

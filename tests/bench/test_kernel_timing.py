"""The kernel benches' clock: a kernel and its peer are sampled in turn, neither always first."""

from __future__ import annotations

import mlx.core as mx

from orchard.cluster.bench.kernel_timing import seconds_per_call, seconds_per_call_in_turn


def test_samples_alternate_which_function_goes_first_and_each_gets_its_own_median():
    calls: list[str] = []

    def timed(name: str):
        def fn():
            calls.append(name)
            return mx.ones((4,)) * len(calls)
        return fn

    a, b = seconds_per_call_in_turn([timed("a"), timed("b")], iters=2, repeats=4)
    assert a > 0 and b > 0
    warm, sampled = calls[:2], calls[2:]
    assert warm == ["a", "b"]
    # each repeat queues `iters` calls of one function, then of the other; the order flips every repeat
    firsts = [sampled[i] for i in range(0, len(sampled), 4)]
    assert firsts == ["a", "b", "a", "b"]
    assert sampled.count("a") == sampled.count("b") == 2 * 4


def test_one_function_is_timed_iters_calls_a_sample_after_one_warm_call():
    calls = []

    def fn():
        calls.append(1)
        return mx.ones((4,)) + len(calls)

    assert seconds_per_call(fn, iters=3, repeats=5) > 0
    assert len(calls) == 1 + 3 * 5

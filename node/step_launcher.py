"""Launching a step's graph on a thread of its own, so the engine's host work overlaps it.

On a GPU, `mx.async_eval` does not return until it has encoded every kernel of the step: for a
small model decoding, that launch takes about as long as the device takes to run it (the 1B
shape at batch 64 on the H200: ~3 ms of a 4 ms forward; docs/benchmarks.md). The call releases
the GIL while it encodes, so the engine thread can settle the previous step (its tokens, stop
rules, detokenizing, outputs) at the same time instead of after it.

One thread serves the process: MLX encodes a stream's kernels one graph at a time anyway, and
engines come and go (tests, benchmarks) without owning a thread each. While a launch runs, the
caller must build no graph and evaluate nothing: it reads only arrays the launched graph does
not take as inputs (`DeviceSample.host_tokens`), and waits for the launch before the next step.
"""

from __future__ import annotations

import os
from concurrent.futures import Future, ThreadPoolExecutor

import mlx.core as mx

#: ORCHARD_STEP_LAUNCH_THREAD=0 launches on the engine thread (to compare, or to rule the thread out).
ON_THREAD = os.environ.get("ORCHARD_STEP_LAUNCH_THREAD", "1") != "0"
_launcher: ThreadPoolExecutor | None = None


def _executor() -> ThreadPoolExecutor:
    global _launcher
    if _launcher is None:
        _launcher = ThreadPoolExecutor(max_workers=1, thread_name_prefix="orchard-step-launch")
    return _launcher


def launch(arrays: list[mx.array]) -> Future:
    """Start evaluating `arrays` on the launch thread; the future settles once all are enqueued."""
    if ON_THREAD:
        return _executor().submit(mx.async_eval, *arrays)
    done: Future = Future()
    mx.async_eval(*arrays)
    done.set_result(None)
    return done

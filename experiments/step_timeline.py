"""Where one engine decode step's wall time goes, phase by phase:
`python -m experiments.step_timeline --shape 1b --batch 64`.

Each phase of `LLMEngine._step` is wrapped with a timer (median ms over --steps). `launch
(encode)` is `mx.async_eval`: on a GPU it returns only once every kernel of the step is encoded,
so it is host time the device cannot hide; the rest is the engine's own host work.
"""

from __future__ import annotations

import argparse
import time
from collections import defaultdict

import mlx.core as mx
import numpy as np

from experiments.decode_step_profile import decoding_engine
from node import engine as engine_module
from node import sampling
from node.model.random_weights import random_llama


def _timed(store: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = time.perf_counter()
        try:
            return fn(*args, **kwargs)
        finally:
            store[name].append(time.perf_counter() - t0)
    return wrapper


def instrument(engine, store: dict) -> None:
    engine._schedule = _timed(store, "schedule", engine._schedule)
    engine._device_tokens = _timed(store, "device tokens", engine._device_tokens)
    engine.runner.forward = _timed(store, "forward graph", engine.runner.forward)
    engine._sample_on_device = _timed(store, "sample graph", engine._sample_on_device)
    engine._settle_in_flight = _timed(store, "settle (all)", engine._settle_in_flight)
    engine_module.build_step_input = _timed(store, "pack", engine_module.build_step_input)
    sampling.DeviceSample.resolve = _timed(store, "settle: wait for tokens", sampling.DeviceSample.resolve)
    engine_module.mx = _Patched(mx, async_eval=_timed(store, "launch (encode)", mx.async_eval))


class _Patched:
    """A module seen through a few replaced attributes."""

    def __init__(self, module, **replaced):
        self._module, self._replaced = module, replaced

    def __getattr__(self, name):
        return self._replaced.get(name) or getattr(self._module, name)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="1b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kv-gb", type=float, default=4.0)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a quick CPU run)")
    args = parser.parse_args()
    loaded = random_llama(args.shape, num_layers=args.layers)
    engine = decoding_engine(loaded, args.batch, args.prompt, args.kv_gb)
    engine.config.async_scheduling = True
    for _ in range(5):
        engine.step()
    store: dict = defaultdict(list)
    instrument(engine, store)
    totals = []
    for _ in range(args.steps):
        t0 = time.perf_counter()
        engine.step()
        totals.append(time.perf_counter() - t0)
    print(f"{args.shape} shape, batch {args.batch}, {mx.default_device()}")
    print(f"  {'whole step':32s} {np.median(totals) * 1e3:7.2f} ms")
    for name, times in store.items():
        print(f"  {name:32s} {np.median(times) * 1e3:7.2f} ms  (x{len(times) / len(totals):.0f} per step)")


if __name__ == "__main__":
    main()

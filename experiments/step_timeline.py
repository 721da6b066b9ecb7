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
from orchard.node import engine as engine_module
from orchard.node import sampling
from orchard.node.model.random_weights import random_llama, random_model, shape_config

#: the clock phases are timed by: wall time, or the engine thread's own CPU time (`--clock
#: thread`), which other processes on a shared machine do not inflate
CLOCKS = {"wall": time.perf_counter, "thread": time.thread_time}
_clock = time.perf_counter


def _timed(store: dict, name: str, fn):
    def wrapper(*args, **kwargs):
        t0 = _clock()
        try:
            return fn(*args, **kwargs)
        finally:
            store[name].append(_clock() - t0)
    return wrapper


def instrument(engine, store: dict) -> None:
    engine._schedule = _timed(store, "schedule", engine._schedule)
    engine._device_tokens = _timed(store, "device tokens", engine._device_tokens)
    engine.runner.forward = _timed(store, "forward graph", engine.runner.forward)
    engine._sample_on_device = _timed(store, "sample graph", engine._sample_on_device)
    engine._settle = _timed(store, "settle (all; beside the encode with a settle thread)", engine._settle)
    engine_module.build_step_input = _timed(store, "pack", engine_module.build_step_input)
    sampling.DeviceSample.resolve = _timed(store, "settle: wait for tokens", sampling.DeviceSample.resolve)
    engine_module.mx = _Patched(mx, async_eval=_timed(store, "launch (encode)", mx.async_eval))


class _Patched:
    """A module seen through a few replaced attributes."""

    def __init__(self, module, **replaced):
        self._module, self._replaced = module, replaced

    def __getattr__(self, name):
        return self._replaced.get(name) or getattr(self._module, name)


def host_only_model():
    """A one-layer Llama of width 64 in float32 with the demo tokenizer's vocabulary, so every
    sampled id decodes to real text: on a CPU its forward is a small part of a step."""
    config = {**shape_config("1b", num_layers=1), "hidden_size": 64, "intermediate_size": 128, "num_attention_heads": 4,
              "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 1024}
    return random_model(config, "host-only", dtype=mx.float32)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--shape", default="1b")
    parser.add_argument("--batch", type=int, default=64)
    parser.add_argument("--prompt", type=int, default=128)
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--kv-gb", type=float, default=4.0)
    parser.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a quick CPU run)")
    parser.add_argument("--host-only", action="store_true",
                        help="a model so small its forward is negligible: the step's time is the engine's host work")
    parser.add_argument("--clock", choices=sorted(CLOCKS), default="wall")
    parser.add_argument("--compiled-decode", choices=("auto", "on", "off"), default="auto")
    parser.add_argument("--settle-thread", choices=("auto", "on", "off"), default="auto")
    args = parser.parse_args()
    global _clock
    _clock = CLOCKS[args.clock]
    loaded = host_only_model() if args.host_only else random_llama(args.shape, num_layers=args.layers)
    compiled = {"on": True, "off": False}.get(args.compiled_decode)
    engine = decoding_engine(loaded, args.batch, args.prompt, args.kv_gb, compiled_decode=compiled,
                             settle_in_thread={"on": True, "off": False}.get(args.settle_thread))
    engine.config.async_scheduling = True
    for _ in range(5):
        engine.step()
    store: dict = defaultdict(list)
    instrument(engine, store)
    totals = []
    for _ in range(args.steps):
        t0 = _clock()
        engine.step()
        totals.append(_clock() - t0)
    what = "host-only model" if args.host_only else f"{args.shape} shape"
    print(f"{what}, batch {args.batch}, {mx.default_device()}, {args.clock} clock")
    print(f"  {'whole step':32s} {np.median(totals) * 1e3:7.2f} ms")
    for name, times in store.items():
        print(f"  {name:32s} {np.median(times) * 1e3:7.2f} ms  (x{len(times) / len(totals):.0f} per step)")


if __name__ == "__main__":
    main()

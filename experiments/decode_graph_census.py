"""Primitives of one decode step's graph by kind, per layer: orchard compiled and eager, and mlx-lm.

On a GPU a decode step of a small model is bound by the host, and every primitive (a kernel
launch, or a view that launches none) costs host time to build and to evaluate. Counting them
for one and two layers gives the per-layer cost of each path and shows where the paths differ.

`python -m experiments.decode_graph_census [--shape 1b] [--batch 64]` prints one line per path and layer count.
"""

from __future__ import annotations

import argparse
import collections
import io
import re

import mlx.core as mx
import numpy as np

from experiments.decode_step_profile import decoding_engine
from orchard.node.engine import build_step_input
from orchard.node.model.random_weights import random_llama


def census(*outputs) -> collections.Counter:
    """Primitives behind `outputs`, counted by kind (the labels of MLX's dot export)."""
    dot = io.StringIO()
    mx.export_to_dot(dot, *outputs)
    return collections.Counter(re.findall(r'label ="?([A-Za-z_]+)[^"]*"?, shape=rectangle', dot.getvalue()))


def paths(shape: str, layers: int, batch: int) -> dict[str, collections.Counter]:
    loaded = random_llama(shape, num_layers=layers)
    engine = decoding_engine(loaded, batch, 32, 1.0)
    step = build_step_input(engine.scheduler.schedule().chunks, engine.kv, engine.config.block_size)
    runner = engine.runner
    mx.eval(engine.kv.pool.keys, engine.kv.pool.values)
    counts = {}
    if runner.compiled_decode is not None:
        counts["orchard compiled"] = census(runner.forward(step))
        mx.eval(engine.kv.pool.keys, engine.kv.pool.values)
    runner.compiled_decode = None
    counts["orchard eager"] = census(runner.forward(step))
    from mlx_lm.models.cache import make_prompt_cache

    cache = make_prompt_cache(loaded.model)
    loaded.model(mx.array(np.full((batch, 8), 5, dtype=np.int32)), cache=cache)
    mx.eval([c.state for c in cache])
    counts["mlx-lm"] = census(loaded.model(mx.array(np.full((batch, 1), 7, dtype=np.int32)), cache=cache))
    return counts


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--batch", type=int, default=64)
    args = ap.parse_args(argv)
    one, two = paths(args.shape, 1, args.batch), paths(args.shape, 2, args.batch)
    for name in one:
        per_layer = two[name] - one[name]
        print(f"{name}: {sum(one[name].values())} primitives at 1 layer, {sum(per_layer.values())} more per layer: "
              + ", ".join(f"{k} {v}" for k, v in sorted(per_layer.items())))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

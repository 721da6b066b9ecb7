"""A layer's SwiGLU and rotary embedding on MLX's CPU build: mlx-lm's ops against the CPU kernels' one-pass ops.

`python -m experiments.cpu_elementwise [--rows 32,96,160,512]` prints, per row count of a step (the demo model's
layer: intermediate 512, 4 query and 2 KV heads of 64), the median time of mlx-lm's `swiglu` and of
`kernels.cpu.swiglu`, and of the rotation of one layer's queries and keys by `mx.fast.rope` (cosines and sines made
in each call) and by `kernels.cpu.rotate_rows` (tables made once a step, as orchard/node/model/positions.py does,
their cost shown apart), and whether each pair agrees bit for bit.
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import mlx.nn as nn
import numpy as np
from mlx_lm.models.activations import swiglu

from experiments.common import markdown_table, median_time, print_header, save_results
from orchard.kernels import cpu
from orchard.node.model.positions import PackedPositions

INTERMEDIATE, HEADS, KV_HEADS, WIDTH, BASE = 512, 4, 2, 64, 10_000.0
ROPE = nn.RoPE(WIDTH, traditional=False, base=BASE)


def ms(fn, repeats: int) -> float:
    return 1e3 * median_time(lambda: mx.eval(fn()), repeats, warmup=3)


def same_bits(a: mx.array, b: mx.array) -> bool:
    return bool((np.array(a).view(np.uint32) == np.array(b).view(np.uint32)).all())


def rope(x: mx.array, positions: mx.array) -> mx.array:
    return ROPE(x, offset=positions)


def tables(positions: mx.array) -> tuple[mx.array, mx.array]:
    """A step's tables as the engine makes them (a new step's `PackedPositions` each call)."""
    return PackedPositions(positions).rotation(ROPE, "rope")


def measure(rows: int, repeats: int) -> dict:
    gate_up = mx.random.normal((rows, 2 * INTERMEDIATE)) * 3
    queries, keys = mx.random.normal((rows, HEADS, 1, WIDTH)), mx.random.normal((rows, KV_HEADS, 1, WIDTH))
    positions = mx.array(np.random.default_rng(rows).integers(0, 4096, rows).astype(np.int32))
    cos, sin = tables(positions)
    mx.eval(gate_up, queries, keys, positions, cos, sin)
    gate, up = gate_up[:, :INTERMEDIATE], gate_up[:, INTERMEDIATE:]
    return {
        "rows": rows,
        "swiglu mlx-lm ms": ms(lambda: swiglu(gate, up), repeats),
        "swiglu kernel ms": ms(lambda: cpu.swiglu(gate_up, INTERMEDIATE), repeats),
        "swiglu same bits": same_bits(swiglu(gate, up), cpu.swiglu(gate_up, INTERMEDIATE)),
        "rope q+k mx.fast.rope ms": ms(lambda: [rope(queries, positions), rope(keys, positions)], repeats),
        "rope q+k kernel ms": ms(lambda: [cpu.rotate_rows(queries, cos, sin), cpu.rotate_rows(keys, cos, sin)], repeats),
        "tables once a step ms": ms(lambda: tables(positions), repeats),
        "rope same bits": same_bits(rope(queries, positions), cpu.rotate_rows(queries, cos, sin))
        and same_bits(rope(keys, positions), cpu.rotate_rows(keys, cos, sin)),
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rows", default="32,96,160,512", help="rows of a step (comma-separated)")
    parser.add_argument("--repeats", type=int, default=200)
    args = parser.parse_args(argv)
    if not cpu.loaded():
        print("the CPU kernels extension is not built here (make venv builds it)")
        return 1
    mx.set_default_device(mx.cpu)
    print_header("SwiGLU and rotary embedding on MLX's CPU build: mlx-lm's ops against the CPU kernels'")
    results = [measure(int(rows), args.repeats) for rows in args.rows.split(",")]
    print(markdown_table(list(results[0]), [[f"{v:.3f}" if isinstance(v, float) else v for v in r.values()] for r in results]))
    save_results("cpu_elementwise", {"rows": results})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

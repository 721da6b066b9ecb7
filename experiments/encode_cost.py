"""What MLX spends on the host per primitive, and how its CUDA graph batching moves a decode step.

On a GPU a small model's decode step is bound by the host: MLX evaluates the step's graph one
primitive at a time, and its CUDA backend gathers the kernels it records into CUDA graphs of
`MLX_MAX_OPS_PER_BUFFER` nodes (20 by default) that it instantiates (or updates from a cache of
`MLX_CUDA_GRAPH_CACHE_SIZE` entries) and launches. This asks two questions:

1. What one primitive of each kind costs to evaluate, in a chain of `--chain` on small arrays
   (the device's own time is negligible at these sizes, so the time is the host's).
2. How the graph size moves a whole decode step: the engine's `step()` (compiled decode, batch
   `--batch`) and mlx-lm's decode step on the same model, each setting in a process of its own.

`python -m experiments.encode_cost --shape 1b --batch 64 --ops 20,60,200` prints one table and
saves experiments/results/encode_cost.json.
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import mlx.core as mx
import numpy as np

RESULTS = Path(__file__).parent / "results" / "encode_cost.json"


def _chain_us(make, step, chain: int, repeats: int = 15) -> float:
    """Microseconds per primitive of `step` applied `chain` times to `make()`, evaluated at once."""
    times = []
    for _ in range(repeats + 2):
        x = make()
        mx.eval(x)
        t0 = time.perf_counter()
        for _ in range(chain):
            x = step(x)
        mx.eval(x)
        times.append(time.perf_counter() - t0)
    return float(np.median(times[2:]) / chain * 1e6)


def _copy_kernel():
    source = "unsigned int i = blockIdx.x * blockDim.x + threadIdx.x; if (i < x_shape[0] * x_shape[1]) out[i] = x[i];"
    maker = mx.fast.cuda_kernel if mx.default_device().type == mx.DeviceType.gpu and hasattr(mx.fast, "cuda_kernel") else None
    if maker is None:
        return None
    kernel = maker(name="encode_cost_copy", input_names=["x"], output_names=["out"], source=source)
    return lambda x: kernel(inputs=[x], grid=(x.size, 1, 1), threadgroup=(256, 1, 1),
                            output_shapes=[x.shape], output_dtypes=[x.dtype])[0]


def primitive_costs(chain: int) -> dict[str, float]:
    """Host microseconds per primitive, by kind."""
    dt = mx.bfloat16
    w = mx.random.normal((2048, 2048)).astype(dt)
    small = lambda: mx.random.normal((64, 2048)).astype(dt)  # noqa: E731 - one decode batch's activations
    idx = mx.arange(64)
    costs = {
        "add (elementwise)": _chain_us(small, lambda x: x + 1, chain),
        "matmul 64x2048x2048": _chain_us(small, lambda x: x @ w, chain),
        "rms_norm": _chain_us(small, lambda x: mx.fast.rms_norm(x, None, 1e-5), chain),
        "reshape (a view)": _chain_us(small, lambda x: x.reshape(2048, 64) if x.shape[0] == 64 else x.reshape(64, 2048), chain),
        "slice (a view)": _chain_us(lambda: mx.random.normal((64, 2048 + chain)).astype(dt), lambda x: x[:, 1:], chain),
        "scatter rows": _chain_us(small, lambda x: x.at[idx].add(1), chain),
        "rope (per-row offsets)": _chain_us(lambda: mx.random.normal((64, 32, 1, 64)).astype(dt),
                                            lambda x: mx.fast.rope(x, 64, traditional=False, base=5e5, scale=1.0, offset=idx), chain),
    }
    copy = _copy_kernel()
    if copy is not None:
        costs["custom kernel (copy)"] = _chain_us(small, copy, chain)
    return costs


def decode_steps(shape: str, batch: int, steps: int, layers: int | None = None) -> dict[str, float]:
    """Median ms of the engine's whole decode step and of mlx-lm's decode step on one random model."""
    from experiments.decode_step_profile import _median_ms, decoding_engine, mlx_lm_step
    from orchard.node.model.random_weights import random_llama

    loaded = random_llama(shape, num_layers=layers)
    engine = decoding_engine(loaded, batch, 128, 4.0)
    engine.config.async_scheduling = True
    out = {"orchard engine.step()": _median_ms(engine.step, steps)}
    del engine
    mx.clear_cache()
    out["mlx-lm decode step"] = mlx_lm_step(loaded.model, batch, 128, steps)
    return out


def one_setting(args) -> dict:
    """Everything measured under this process's environment."""
    row = {"ops_per_graph": os.environ.get("MLX_MAX_OPS_PER_BUFFER", "default")}
    row.update(primitive_costs(args.chain))
    if not args.no_model:
        row.update(decode_steps(args.shape, args.batch, args.steps, args.layers))
    return row


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__)
    ap.add_argument("--shape", default="1b")
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--chain", type=int, default=400)
    ap.add_argument("--layers", type=int, default=None, help="fewer layers than the shape (a quick CPU run)")
    ap.add_argument("--ops", default="20,60,200", help="MLX_MAX_OPS_PER_BUFFER settings, each in its own process")
    ap.add_argument("--no-model", action="store_true", help="primitive costs only")
    ap.add_argument("--child", action="store_true", help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.child:
        print(json.dumps(one_setting(args)))
        return 0
    rows = []
    for ops in args.ops.split(","):
        env = {**os.environ, "MLX_MAX_OPS_PER_BUFFER": ops}
        cmd = [sys.executable, "-m", "experiments.encode_cost", "--child", *(argv if argv is not None else sys.argv[1:])]
        done = subprocess.run(cmd, env=env, capture_output=True, text=True)
        if done.returncode:
            print(done.stderr[-3000:], file=sys.stderr)
            return done.returncode
        rows.append(json.loads(done.stdout.strip().splitlines()[-1]))
        print(f"MLX_MAX_OPS_PER_BUFFER={ops}: done", flush=True)
    print(f"{mx.default_device()}, shape {args.shape}, batch {args.batch}; us per primitive, ms per step")
    names = [k for k in rows[0] if k != "ops_per_graph"]
    print("| measure | " + " | ".join(f"{r['ops_per_graph']} ops/graph" for r in rows) + " |")
    print("|---|" + "---|" * len(rows))
    for name in names:
        print(f"| {name} | " + " | ".join(f"{r[name]:.2f}" for r in rows) + " |")
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps(rows, indent=1))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

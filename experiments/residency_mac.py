"""Q4: how should a growing KV cache be kept resident: wired limit, incremental vs batched growth?

On macOS 15+ with Metal (the experiment that settles the question; it must run on a Mac):
grows a Llama-3.1-8B-shaped pool to `--grow-gib` in `--chunk-mib` steps, with the pool
either allocated at once (batched) or chunk by chunk (incremental), and MLX's wired limit
(`mx.set_wired_limit`, which keeps MLX's buffers in a Metal residency set) either left
at 0, set once to the final size, or raised at every growth step. For each, it reports
the total growth time, the worst single growth step, and the latency of one full read of
the pool after `--idle-s` of idleness while `--pressure-gib` of other memory is touched
(does the OS page out or compress KV that is not wired?).

Anywhere else (Linux here) the Metal part cannot run; the script says so and measures
the analogue that does exist: the cost of first-touching new KV memory, batched
(`KVPool` allocates its whole pool up front) against incremental growth by
concatenation (mlx-lm's `KVCache` grows in 256-token steps).

    python -m experiments.residency_mac [--grow-gib 1] [--chunk-mib 64] [--idle-s 5] [--pressure-gib 2]
"""

from __future__ import annotations

import argparse
import sys
import time

import mlx.core as mx
import numpy as np

from experiments.common import markdown_table, print_header, save_results
from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.pool import KVPool

GEOMETRY = KVGeometry("exp/residency", num_layers=32, num_kv_heads=8, head_dim=128, block_size=16, dtype="bfloat16")
WIRED_POLICIES = ("no wired limit", "wired once to final size", "wired raised per step")


def on_metal() -> bool:
    return sys.platform == "darwin" and mx.metal.is_available() and hasattr(mx, "set_wired_limit")


def read_all(arrays: list[mx.array]) -> float:
    start = time.perf_counter()
    mx.eval([a.sum() for a in arrays])
    return time.perf_counter() - start


def grow(total: int, chunk: int, batched: bool, wired: str) -> tuple[list[mx.array], list[float]]:
    """Allocate and touch `total` bytes of KV (one array per chunk); seconds per growth step."""
    steps = []
    if wired == "wired once to final size":
        mx.set_wired_limit(total)
    if batched:
        start = time.perf_counter()
        arrays = [mx.zeros((total // 2,), dtype=mx.bfloat16)]
        mx.eval(arrays)
        return arrays, [time.perf_counter() - start]
    arrays = []
    for k in range(total // chunk):
        start = time.perf_counter()
        if wired == "wired raised per step":
            mx.set_wired_limit((k + 1) * chunk)
        arrays.append(mx.zeros((chunk // 2,), dtype=mx.bfloat16))
        mx.eval(arrays[-1])
        steps.append(time.perf_counter() - start)
    return arrays, steps


def apply_pressure(nbytes: int, idle_s: float) -> None:
    """Touch `nbytes` of ordinary memory, then idle: what another process would do to us."""
    other = np.ones(nbytes, dtype=np.uint8)
    other[:: 4096] = 2
    time.sleep(idle_s)
    del other


def metal_rows(args) -> list[list]:
    info = mx.device_info()
    print(f"# device: {info.get('device_name', '?')}, memory {info['memory_size'] / 2**30:.0f} GiB, "
          f"max recommended working set {info['max_recommended_working_set_size'] / 2**30:.1f} GiB")
    total, chunk = int(args.grow_gib * 2**30), args.chunk_mib << 20
    rows = []
    for batched in (True, False):
        for wired in WIRED_POLICIES:
            if batched and wired == "wired raised per step":
                continue
            mx.set_wired_limit(0)
            mx.clear_cache()
            start = time.perf_counter()
            arrays, steps = grow(total, chunk, batched, wired)
            grow_s = time.perf_counter() - start
            first_read = read_all(arrays)
            apply_pressure(int(args.pressure_gib * 2**30), args.idle_s)
            after_idle = read_all(arrays)
            rows.append(["batched" if batched else f"incremental ({chunk >> 20} MiB)", wired, f"{grow_s * 1e3:.1f}",
                         f"{max(steps) * 1e3:.2f}", f"{first_read * 1e3:.1f}", f"{after_idle * 1e3:.1f}"])
            del arrays
    mx.set_wired_limit(0)
    return rows


def analogue_rows(args) -> list[list]:
    """What runs anywhere: first-touch cost of KV memory, batched vs incremental by concatenation."""
    total = int(args.grow_gib * 2**30)
    rows = []
    blocks = total // GEOMETRY.bytes_per_block
    start = time.perf_counter()
    pool = KVPool(GEOMETRY, blocks)
    batched = time.perf_counter() - start
    again = read_all(pool.keys + pool.values)
    rows.append([f"KVPool up front ({blocks} blocks)", f"{batched * 1e3:.0f}", f"{total / batched / 1e9:.2f}", f"{again * 1e3:.0f}"])
    del pool
    step_tokens = 256  # mlx-lm KVCache growth step
    per_token_layer = GEOMETRY.num_kv_heads * GEOMETRY.head_dim * 2  # bytes of K for one token, one layer
    tokens = total // (2 * GEOMETRY.num_layers * per_token_layer)
    layers = min(GEOMETRY.num_layers, 4)  # the concatenation cost per layer is the same; 4 keep it short
    start = time.perf_counter()
    caches = [mx.zeros((1, GEOMETRY.num_kv_heads, 0, GEOMETRY.head_dim), dtype=mx.bfloat16) for _ in range(2 * layers)]
    for _ in range(tokens // step_tokens):
        grown = mx.zeros((1, GEOMETRY.num_kv_heads, step_tokens, GEOMETRY.head_dim), dtype=mx.bfloat16)
        caches = [mx.concatenate([c, grown], axis=2) for c in caches]
        mx.eval(caches)
    incremental = (time.perf_counter() - start) * GEOMETRY.num_layers / layers
    rows.append([f"grown by concatenation, {step_tokens}-token steps (mlx-lm KVCache), scaled from {layers} layers",
                 f"{incremental * 1e3:.0f}", f"{total / incremental / 1e9:.2f}", "-"])
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.residency_mac", description=__doc__.splitlines()[0])
    ap.add_argument("--grow-gib", type=float, default=1.0)
    ap.add_argument("--chunk-mib", type=int, default=64)
    ap.add_argument("--idle-s", type=float, default=5.0)
    ap.add_argument("--pressure-gib", type=float, default=2.0)
    args = ap.parse_args(argv)
    print_header(__doc__.splitlines()[0])
    result = {"args": vars(args), "metal": on_metal()}
    if on_metal():
        rows = metal_rows(args)
        print(markdown_table(["growth", "wired limit", "grow ms", "worst step ms", "first full read ms",
                              "read after idle + pressure ms"], rows))
        result["metal_rows"] = rows
    else:
        print("# Metal residency part skipped: it needs macOS 15+ with a Metal GPU "
              f"(here: {sys.platform}, metal available: {mx.metal.is_available()}). Running the Linux analogue only.")
    rows = analogue_rows(args)
    print(markdown_table(["first touch of KV memory", "ms", "GB/s", "full read after ms"], rows))
    result["analogue_rows"] = rows
    save_results("residency_mac" if on_metal() else "residency_analogue", result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What the two kernel benchmarks share: a result row, the device-time clock, the copy ceiling, the table.

`orchard.cluster.bench.kernels` (decode rows) and `orchard.cluster.bench.kernels_varlen` (mixed-step rows) both
time with `seconds_per_call` (a kernel and its peer in turn: `seconds_per_call_in_turn`) and print through `format_table`, so their rows line up in one table.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass

import mlx.core as mx


@dataclass
class Row:
    device: str
    backend: str
    problem: str
    paged_ms: float
    dense_ms: float
    kv_tb_per_s: float
    copy_tb_per_s: float | None
    plan_ms: float | None = None  # host time of building the step's plan (varlen rows)

    @property
    def ratio(self) -> float:
        return self.paged_ms / self.dense_ms


def seconds_per_call(fn, iters: int, repeats: int = 5) -> float:
    """Median over repeats of evaluating `iters` queued calls, the clock running only over evaluation.

    Building the lazy graph (Python, metadata checks) happens before the clock starts: an
    engine overlaps it with the device through async_eval, so device time is what counts.
    """
    return seconds_per_call_in_turn([fn], iters, repeats)[0]


def seconds_per_call_in_turn(fns, iters: int, repeats: int = 5) -> list[float]:
    """`seconds_per_call` of each of `fns`, their samples taken in turn (the order reversed every other
    repeat): a kernel and the one it is compared with see the same device, whose clocks and other
    tenants drift over a row's second or so, rather than one of them always going first."""
    for fn in fns:
        mx.eval(fn())
    samples: list[list[float]] = [[] for _ in fns]
    for r in range(repeats):
        order = range(len(fns)) if r % 2 == 0 else reversed(range(len(fns)))
        for i in order:
            outputs = [fns[i]() for _ in range(iters)]
            start = time.perf_counter()
            mx.eval(outputs)
            samples[i].append((time.perf_counter() - start) / iters)
    return [statistics.median(s) for s in samples]


def copy_ceiling_tb_per_s() -> float:
    """An elementwise pass over 1 GiB of float32: bytes read plus written over time."""
    x = mx.zeros((256 * 1024 * 1024,), dtype=mx.float32)
    mx.eval(x)
    return 2 * x.nbytes / seconds_per_call(lambda: x + 1.0, iters=10) / 1e12


def format_table(rows: list[Row]) -> str:
    header = (f"{'device':6} {'backend':22} {'problem':60} {'paged ms':>9} {'dense ms':>9} {'paged/dense':>11} "
              f"{'KV TB/s':>8} {'of copy':>8} {'plan ms':>8}")
    lines = [header, "-" * len(header)]
    for row in rows:
        of_copy = f"{row.kv_tb_per_s / row.copy_tb_per_s:7.0%}" if row.copy_tb_per_s else "      -"
        plan = f"{row.plan_ms:8.3f}" if row.plan_ms is not None else "       -"
        lines.append(
            f"{row.device:6} {row.backend:22} {row.problem:60} {row.paged_ms:9.3f} {row.dense_ms:9.3f} "
            f"{row.ratio:10.2f}x {row.kv_tb_per_s:8.3f} {of_copy:>8} {plan}"
        )
    return "\n".join(lines)

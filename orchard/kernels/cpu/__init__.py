"""CPU kernels as an MLX extension in C++: paged attention that reads the KV pool in place,
and two elementwise ops of a layer, bit for bit MLX's (`swiglu`, `rotate_rows`, at the end).

On MLX's CPU build the reference backend gathers each decode row's context out of the pool
into a padded copy and runs SDPA over it: three passes over the KV bytes where a contiguous
cache needs one, and the larger part of a decode step (docs/benchmarks.md, "What bounds the
CPU ratio"). MLX's Python API offers custom kernels for Metal and CUDA only; a CPU kernel
is a C++ primitive (`paged_rows.cpp`, an `eval_cpu` over the pool's memory), compiled
against the installed MLX by `python -m orchard.kernels.cpu.build`, which `make` runs. Where it was
not built (no compiler, or a Mac, whose GPU backend serves instead), `loaded()` is False and
the "cpu" backend is unavailable: the reference serves the CPU as before.

A whole step runs here in one call a layer: decode rows and the rows of prefill chunks alike, each
row reading its context once, a chunk's rows causal by their own lengths (`RowsPlan`).
Rows of one chunk read the same keys again, from cache; against the reference's gather + SDPA (whose
CPU path builds every chunk's full score matrix) it measured faster at every chunk tried, up to
1,024 x 1,024 and 256 x 2,048 (docs/benchmarks.md, "CPU kernel").

Rows are split across as many threads as the machine has cores (at most 8), the thread MLX runs
the call on among them; ORCHARD_CPU_ATTENTION_THREADS, read once a process, sets another number.
How rows are split never changes what a row computes.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from orchard.kernels.variants import PLAIN, LayerAttention

try:
    from orchard.kernels.cpu import _paged_cpu
except ImportError:  # not built here
    _paged_cpu = None


@dataclass(frozen=True)
class RowsPlan:
    """A step's query rows as the kernel reads them, made once a step for every layer: each row its
    sequence's block table and the keys it sees (its own position + 1), so a prefill chunk's rows
    are causal by their lengths alone; windows are the kernel's, per layer."""

    query_rows: mx.array  # int32 [total_q]: 0..total_q-1, the packed order
    block_tables: mx.array  # int32 [total_q, max_blocks]
    context_lens: mx.array  # int32 [total_q]


def plan_rows(starts: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray) -> RowsPlan:
    """`RowsPlan` of a step's checked host metadata (orchard/kernels/plan.py checks it)."""
    q_lens = np.diff(starts)
    total = int(starts[-1])
    seq_of_row = np.repeat(np.arange(q_lens.size), q_lens)
    offsets = np.arange(total) - np.repeat(starts[:-1], q_lens)
    lengths = (context_lens[seq_of_row] - q_lens[seq_of_row] + 1 + offsets).astype(np.int32)
    return RowsPlan(mx.arange(total, dtype=mx.int32), mx.array(block_tables[seq_of_row]), mx.array(lengths))


def loaded() -> bool:
    """Whether the compiled extension is importable in this process."""
    return _paged_cpu is not None


def attend_rows(queries: mx.array, query_rows: mx.array, key_cache: mx.array, value_cache: mx.array,
                block_tables: mx.array, context_lens: mx.array, scale: float, layer: LayerAttention = PLAIN) -> mx.array:
    """Rows `query_rows` of packed `queries` [N, Hq, D], row i over the first `context_lens[i]` positions of
    its table (the layer's window of them); [n, Hq, Dv] in the queries' dtype, softmax in float32."""
    return _paged_cpu.paged_rows(
        queries, query_rows, key_cache, value_cache, block_tables, context_lens, layer.sinks,
        scale=float(scale), window=layer.window_or_zero, softcap=0.0 if layer.softcap is None else float(layer.softcap),
        stream=mx.cpu,
    )


def paged_decode(queries, key_cache, value_cache, block_tables, context_lens, scale: float,
                 layer: LayerAttention = PLAIN) -> mx.array:
    """`kernels.paged_attention` on this backend: one row per sequence, metadata on the host or as arrays."""
    rows = mx.arange(queries.shape[0], dtype=mx.int32)
    return attend_rows(queries, rows, key_cache, value_cache, _int32(block_tables), _int32(context_lens), scale, layer)


def paged_varlen(queries, key_cache, value_cache, plan, scale: float, layer: LayerAttention = PLAIN) -> mx.array:
    """A whole step, every row of `plan.rows` (packed order), in one call."""
    rows = plan.rows
    return attend_rows(queries, rows.query_rows, key_cache, value_cache, rows.block_tables, rows.context_lens, scale, layer)


def _int32(values) -> mx.array:
    return values.astype(mx.int32) if isinstance(values, mx.array) else mx.array(np.asarray(values, dtype=np.int32))


#: the dtype the elementwise ops compute in: they reproduce MLX's CPU rounding for float32 only
ELEMENTWISE_DTYPE = mx.float32


def elementwise_serve_here() -> bool:
    """Whether `swiglu` and `rotate_rows` serve this process: the extension is built and MLX computes
    on the CPU. Asked once where a model is wired for its device, not per layer call."""
    return _paged_cpu is not None and mx.default_device() == mx.cpu


def swiglu(gate_up: mx.array, intermediate: int) -> mx.array:
    """silu(gate) * up of `gate_up` [rows, 2 * intermediate] (the gate's columns first), float32.

    MLX's x86 CPU build computes a sigmoid one element at a time, calling the C library's `fmaf` six
    times an element: about 2 ms for 160 rows of 512 on the 2-core VM, a fifth of a small model's step.
    This is the same arithmetic, vectorized, equal to mlx-lm's `swiglu` bit for bit (elementwise.cpp)."""
    return _paged_cpu.swiglu(gate_up, intermediate, stream=mx.cpu)


def rotate_rows(x: mx.array, cos: mx.array, sin: mx.array) -> mx.array:
    """`[x1 * cos - x2 * sin, x2 * cos + x1 * sin]` of float32 `x` [T, ..., D] by tables [T, D / 2]: what
    `mx.fast.rope` computes on the CPU once its tables are made, in one pass (elementwise.cpp)."""
    return _paged_cpu.rotate_rows(x, cos, sin, stream=mx.cpu)

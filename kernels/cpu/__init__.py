"""Paged attention on the CPU that reads the KV pool in place: an MLX extension in C++.

On MLX's CPU build the reference backend gathers each decode row's context out of the pool
into a padded copy and runs SDPA over it: three passes over the KV bytes where a contiguous
cache needs one, and the larger part of a decode step (docs/benchmarks.md, "What bounds the
CPU ratio"). MLX's Python API offers custom kernels for Metal and CUDA only; a CPU kernel
is a C++ primitive (`paged_decode.cpp`, an `eval_cpu` over the pool's memory), compiled
against the installed MLX by `python -m kernels.cpu.build`, which `make` runs. Where it was
not built (no compiler, or a Mac, whose GPU backend serves instead), `loaded()` is False and
the "cpu" backend is unavailable: the reference serves the CPU as before.

Only decode rows (one query per sequence) run here: they are memory-bound and are read in one
pass. A step's prefill chunks keep the reference's gather + SDPA, whose matmuls go through BLAS.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np

from kernels import reference
from kernels.variants import PLAIN, LayerAttention

try:
    from kernels.cpu import _paged_cpu
except ImportError:  # not built here
    _paged_cpu = None


def loaded() -> bool:
    """Whether the compiled extension is importable in this process."""
    return _paged_cpu is not None


def decode_rows(queries: mx.array, query_rows: mx.array, key_cache: mx.array, value_cache: mx.array,
                block_tables: mx.array, context_lens: mx.array, scale: float, layer: LayerAttention = PLAIN) -> mx.array:
    """Rows `query_rows` of packed `queries` [N, Hq, D], each over its paged context (the layer's window
    of it); [n, Hq, Dv] in the queries' dtype, softmax in float32."""
    return _paged_cpu.paged_decode(
        queries, query_rows, key_cache, value_cache, block_tables, context_lens, layer.sinks,
        scale=float(scale), window=layer.window_or_zero, softcap=0.0 if layer.softcap is None else float(layer.softcap),
        stream=mx.cpu,
    )


def paged_decode(queries, key_cache, value_cache, block_tables, context_lens, scale: float,
                 layer: LayerAttention = PLAIN) -> mx.array:
    """`kernels.paged_attention` on this backend: one row per sequence, metadata on the host or as arrays."""
    rows = mx.arange(queries.shape[0], dtype=mx.int32)
    return decode_rows(queries, rows, key_cache, value_cache, _int32(block_tables), _int32(context_lens), scale, layer)


def paged_varlen(queries, key_cache, value_cache, plan, scale: float, layer: LayerAttention = PLAIN) -> mx.array:
    """A step through the reference's pieces, its decode rows (one `DecodeRowsPiece`) through the kernel."""
    out = reference.paged_varlen_reference(queries, key_cache, value_cache, plan.reference, scale, layer, _run_piece)
    return out if out.dtype == queries.dtype else out.astype(queries.dtype)


def _run_piece(piece, queries, key_cache, value_cache, scale: float, layer: LayerAttention) -> mx.array:
    if isinstance(piece, reference.DecodeRowsPiece):
        return decode_rows(queries, piece.query_rows, key_cache, value_cache, piece.block_tables, piece.context_lens,
                           scale, layer)
    return reference.run_piece_here(piece, queries, key_cache, value_cache, scale, layer)


def _int32(values) -> mx.array:
    return values.astype(mx.int32) if isinstance(values, mx.array) else mx.array(np.asarray(values, dtype=np.int32))

"""Decode-only steps replayed from compiled graphs, one per batch and table-width bucket.

A decode step's graph is the same from step to step but for its sizes, and on a GPU building
it in Python and launching it primitive by primitive is what bounds decode (docs/benchmarks.md,
"What bounds decode": the device is idle most of the step). `mx.compile` traces the model's
decode once per shape and replays the traced graph afterwards, with its elementwise chains
fused, as vLLM replays a captured CUDA graph per batch size.

Shapes are bucketed so a handful of graphs serve every step: the batch is padded up to the
next of `BATCH_BUCKETS`, the block tables to the next width of 16 blocks times a power of 4.
Tracing a new bucket stalls every sequence of the step (the graph is traced and its fused
kernels compiled), so the buckets are coarse: a padding row costs a host-bound step next to
nothing, a wider table a few bytes (the kernels read each row's blocks up to its own length),
and `warm_up` traces the buckets a node will meet before it serves. A padding row decodes
token 0 at position 0: it writes its K/V to the first slot of the null block (block 0, never
handed to a sequence, so no real row reads it) and attends to that slot alone; its logits
are dropped. Everything the traced graph reads from a step is an input (ids, positions, slots, tables, lengths, the
pool's arrays); everything else it holds depends on the input shapes alone, which is what
the graph is keyed by (the attention kernels' launch plans), or on the model alone (its
weights, each layer's scale, window and sinks), which a runner never changes.

The pool's arrays go in and come back as outputs: the K/V writes are scatters whose output
reuses the input buffer once the pool drops its old reference (orchard/kernels/kv_write.py), so a
compiled step writes in place just as an eager one does.
"""

from __future__ import annotations

import weakref
from bisect import bisect_left
from collections.abc import Callable
from dataclasses import dataclass
from types import SimpleNamespace

import mlx.core as mx
import numpy as np

from orchard.kernels import SlotIndex
from orchard.node.model.positions import PackedPositions

#: batch sizes a graph is traced for; larger batches round up to a multiple of the last step
BATCH_BUCKETS = (1, 2, 4, 8, 16, 32, 48, 64)
_BUCKET_STEP = 16
#: the narrowest traced block table, and the factor between one width and the next
_MIN_WIDTH = 16
_WIDTH_STEP = 4


def batch_bucket(rows: int) -> int:
    """The traced batch size that holds `rows` decode rows."""
    i = bisect_left(BATCH_BUCKETS, rows)
    if i < len(BATCH_BUCKETS):
        return BATCH_BUCKETS[i]
    return -(-rows // _BUCKET_STEP) * _BUCKET_STEP


def width_bucket(blocks: int) -> int:
    """The traced block-table width that holds `blocks` entries: 16, 64, 256, ..."""
    width = _MIN_WIDTH
    while width < blocks:
        width *= _WIDTH_STEP
    return width


def buckets_up_to(rows: int, blocks: int) -> list[tuple[int, int]]:
    """Every (batch, width) bucket a step of at most `rows` rows and `blocks` blocks a row may take."""
    batches = sorted({batch_bucket(n) for n in range(1, rows + 1)})
    widths = sorted({width_bucket(n) for n in range(1, blocks + 1)})
    return [(b, w) for b in batches for w in widths]


@dataclass
class _TracedPool:
    """The pool as the layers of a traced step see it: one array per layer, replaced by each write."""

    keys: list
    values: list


class CompiledDecode:
    """Runs decode-only steps of one model through compiled graphs.

    `make_context(pool, positions, slots, tables, lengths)` builds the per-step context the
    model's layers read (node.model.runner's `StepContext` for a decode step) and
    `run(context, tokens)` runs the stack and the head over it; both are traced, never
    called eagerly from here.
    """

    def __init__(self, num_layers: int, make_context: Callable, run: Callable):
        self._num_layers = num_layers
        self._graphs: dict[tuple[int, int], Callable] = {}
        self.traces = 0  # graphs traced so far: a new bucket traces once
        self.bind(make_context, run)

    def bind(self, make_context: Callable, run: Callable) -> None:
        """Trace future buckets with these (a runner's bound methods, held weakly: graphs shared
        by the runners of one model must not keep a finished engine's KV pool alive)."""
        self._make_context = weakref.WeakMethod(make_context)
        self._run = weakref.WeakMethod(run)

    def __call__(self, pool, step, tokens: mx.array | None) -> mx.array:
        """Logits `[num_seqs, vocab]` of a decode-only `step` (one new token per sequence); the
        pool's per-layer arrays are replaced by the step's outputs."""
        rows = step.num_seqs
        batch, width = batch_bucket(rows), width_bucket(np.shape(step.block_tables)[1])
        outputs = self._replay(batch, width, _inputs(step, tokens, batch, width, pool.keys[0].shape[1]), pool)
        return outputs[0] if rows == batch else outputs[0][:rows]

    def warm_up(self, pool, rows: int, blocks: int) -> int:
        """Trace (and run once, on padding rows alone) every bucket up to `rows` rows of up to
        `blocks` blocks, as vLLM captures its CUDA graphs at start; returns how many were new."""
        new = [bucket for bucket in buckets_up_to(rows, blocks) if bucket not in self._graphs]
        for batch, width in new:
            empty = SimpleNamespace(token_ids=[], positions=[], slot_mapping=[], context_lens=[],
                                    block_tables=np.zeros((0, width), dtype=np.int32))  # a step of no rows
            mx.eval(self._replay(batch, width, _inputs(empty, None, batch, width, pool.keys[0].shape[1]), pool))
        return len(new)

    def _replay(self, batch: int, width: int, inputs: list, pool) -> tuple:
        """Run the bucket's graph (traced at its first use); the pool takes the written arrays."""
        graph = self._graphs.get((batch, width))
        if graph is None:
            graph = self._graphs[(batch, width)] = mx.compile(self._traced)
            self.traces += 1
        outputs = graph(*inputs, *pool.keys, *pool.values)
        layers = self._num_layers
        pool.keys[:] = outputs[1 : 1 + layers]
        pool.values[:] = outputs[1 + layers :]
        return outputs

    def _traced(self, tokens, positions, blocks, offsets, tables, lengths, *kv):
        layers = self._num_layers
        pool = _TracedPool(list(kv[:layers]), list(kv[layers:]))
        context = self._make_context()(pool, PackedPositions(positions), SlotIndex(blocks, offsets), tables, lengths)
        logits = self._run()(context, tokens)
        return (logits, *pool.keys, *pool.values)


class _SharedGraphs:
    """A model's compiled decode graphs, by attention backend: every runner over the model
    replays the same graphs (their constants are the model's weights; the pool is an input)."""

    def __init__(self):
        self.by_backend: dict[str, CompiledDecode] = {}


_SHARED_MARK = "_orchard_compiled_decode"


def shared_compiled_decode(stack, backend: str, num_layers: int, make_context: Callable, run: Callable) -> CompiledDecode:
    """The compiled decode of `stack`'s model on `backend`, made once and bound to the newest
    runner, so a second engine over a loaded model starts with the first one's graphs traced."""
    shared = getattr(stack, _SHARED_MARK, None)
    if shared is None:
        shared = _SharedGraphs()
        setattr(stack, _SHARED_MARK, shared)
    compiled = shared.by_backend.get(backend)
    if compiled is None:
        compiled = shared.by_backend[backend] = CompiledDecode(num_layers, make_context, run)
    else:
        compiled.bind(make_context, run)
    return compiled


def _inputs(step, tokens: mx.array | None, batch: int, width: int, block_size: int) -> list[mx.array]:
    """A graph's step inputs, `step`'s rows followed by padding rows up to `batch` and its block
    tables widened to `width`."""
    tables = np.asarray(step.block_tables, dtype=np.int32)
    padded = np.zeros((batch, width), dtype=np.int32)
    padded[: tables.shape[0], : tables.shape[1]] = tables
    return [
        _padded_ids(tokens, step.token_ids, batch),
        _padded(step.positions, np.zeros(batch)),
        *_padded_slots(step.slot_mapping, batch, block_size),
        mx.array(padded),
        _padded(step.context_lens, np.ones(batch)),
    ]


def _host_padded(values, padding: np.ndarray) -> np.ndarray:
    """`values` in the first rows of `padding` (one entry per traced row), int32."""
    host = np.asarray(values, dtype=np.int32)
    out = padding.astype(np.int32)
    out[: host.size] = host
    return out


def _padded(values, padding: np.ndarray) -> mx.array:
    return mx.array(_host_padded(values, padding))


def _padded_slots(slot_mapping, batch: int, block_size: int) -> tuple[mx.array, mx.array]:
    """(blocks, offsets) of the step's slots; padding rows write the null block's first slot."""
    index = SlotIndex.of(_host_padded(slot_mapping, np.zeros(batch)), block_size)
    return index.blocks, index.offsets


def _padded_ids(tokens: mx.array | None, token_ids, batch: int) -> mx.array:
    """The step's input ids padded with token 0; ids still on the device stay there."""
    if tokens is None:
        return _padded(token_ids, np.zeros(batch))
    if tokens.shape[0] == batch:
        return tokens.astype(mx.int32)
    return mx.concatenate([tokens.astype(mx.int32), mx.zeros((batch - tokens.shape[0],), dtype=mx.int32)])

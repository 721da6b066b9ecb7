"""Paged attention in plain MLX ops: gather the KV rows through the block table, then SDPA.

It runs on every device MLX runs on, so it is the fallback and the yardstick for the
compiled kernels, and the one backend for values narrower or wider than keys (DeepSeek-V2):
outputs take the values' head dim. The gather is per token rather than per block: positions past a
sequence's length are pointed at that sequence's last real token, so padding never
reads unused pool slots (which may hold anything, NaN included) and the boolean mask
then gives those duplicates zero weight. A windowed layer gathers only the keys its
window sees (orchard/kernels/variants.py); a soft-capped one takes the explicit softmax path,
since MLX's fused SDPA has no cap.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from orchard.kernels.errors import InvalidAttentionMetadata
from orchard.kernels.variants import PLAIN, LayerAttention

#: decode(queries, key_cache, value_cache, block_tables, context_lens, scale, layer) -> output
DecodeFn = Callable[[mx.array, mx.array, mx.array, np.ndarray, np.ndarray, float, LayerAttention], mx.array]


def as_host_ints(values, name: str) -> np.ndarray:
    """Metadata arrives as mx arrays, numpy arrays or lists; the planning below wants numpy int32."""
    if isinstance(values, mx.array):
        values = np.array(values)
    array = np.asarray(values)
    if array.size and not np.issubdtype(array.dtype, np.integer):
        raise InvalidAttentionMetadata(f"{name} must hold integers, got dtype {array.dtype}")
    return array.astype(np.int32, copy=False)


def check_decode_metadata(queries: mx.array, key_cache: mx.array, block_tables: np.ndarray, context_lens: np.ndarray) -> None:
    """Refuse metadata that would read outside a sequence's block table or the pool."""
    num_seqs, num_heads, head_dim = queries.shape
    num_kv_heads, cache_head_dim = key_cache.shape[2:]
    if cache_head_dim != head_dim:
        raise InvalidAttentionMetadata(f"queries have head_dim {head_dim}, cache has {cache_head_dim}")
    if num_heads % num_kv_heads:
        raise InvalidAttentionMetadata(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    if block_tables.ndim != 2 or block_tables.shape[0] != num_seqs or context_lens.shape != (num_seqs,):
        raise InvalidAttentionMetadata(
            f"expected block_tables [{num_seqs}, max_blocks] and context_lens [{num_seqs}], "
            f"got {block_tables.shape} and {context_lens.shape}"
        )
    check_table_values(key_cache, block_tables, context_lens)


def check_table_values(key_cache: mx.array, block_tables: np.ndarray, context_lens: np.ndarray) -> None:
    """Every length fits its table's capacity and every block id names a pool block."""
    num_blocks, block_size = key_cache.shape[:2]
    if context_lens.size == 0:
        return
    if context_lens.min() < 1 or context_lens.max() > block_tables.shape[1] * block_size:
        raise InvalidAttentionMetadata(
            f"context_lens must lie in 1..{block_tables.shape[1] * block_size}, "
            f"got {context_lens.min()}..{context_lens.max()}"
        )
    if block_tables.min() < 0 or block_tables.max() >= num_blocks:
        raise InvalidAttentionMetadata(f"block ids must lie in 0..{num_blocks - 1}")


def token_slots(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int, width: int,
                first: np.ndarray | None = None) -> np.ndarray:
    """Pool slot of positions first..first+width-1 of each sequence (first 0 unless given);
    positions past the end repeat the last token."""
    positions = np.arange(width, dtype=np.int32)[None, :] + (0 if first is None else first[:, None])
    positions = np.minimum(positions, context_lens[:, None] - 1)
    blocks = np.take_along_axis(block_tables, positions // block_size, axis=1)
    return blocks * block_size + positions % block_size


def window_starts(context_lens: np.ndarray, window: int | None) -> np.ndarray:
    """First position each sequence's last query sees: 0, or len - window under a window."""
    if window is None:
        return np.zeros_like(context_lens)
    return np.maximum(context_lens - window, 0).astype(np.int32)


def head_major_rows(slots: np.ndarray, num_kv_heads: int) -> np.ndarray:
    """Row of the flattened pool `[num_slots * num_kv_heads, head_dim]` for each (sequence, head, position)."""
    return slots[:, None, :] * num_kv_heads + np.arange(num_kv_heads, dtype=np.int32)[None, :, None]


def gather_rows(cache: mx.array, rows: mx.array) -> mx.array:
    """Rows of one layer's pool at `rows` [B, num_kv_heads, T], as a contiguous [B, num_kv_heads, T, head_dim].

    The head is folded into the row index so the gather writes SDPA's layout directly;
    gathering token rows and transposing afterwards made CPU SDPA ~10x slower (strided K/V).
    Both gathers run on the default stream: on MLX 0.32's CPU backend, a V gather on a second
    stream left one thread behind per layer and step (a serving process grew by thousands of
    threads a minute), and on two busy cores it gained nothing measurable.
    """
    head_dim = cache.shape[3]
    flat = cache.reshape(-1, head_dim)
    if (head_dim * cache.itemsize) % 8 == 0:
        # A gather only moves bytes: as 64-bit words it copies 2-4x fewer elements (CPU gathers per element).
        return mx.take(flat.view(mx.uint64), rows, axis=0).view(cache.dtype)
    return mx.take(flat, rows, axis=0)


def length_groups(context_lens: np.ndarray, max_padding: float = 0.25) -> list[np.ndarray]:
    """Split sequences into groups whose padded width wastes at most `max_padding` of their reads.

    A batched decode pads every sequence to the longest one; with mixed lengths that
    gathers and attends over up to twice the tokens that exist. Groups are cut from the
    lengths sorted longest first, so each group's width is its first member's length.
    """
    order = np.argsort(-context_lens, kind="stable")
    groups: list[list[int]] = []
    width = total = 0
    for seq in order.tolist():
        length = int(context_lens[seq])
        if groups and width * (len(groups[-1]) + 1) <= (1 + max_padding) * (total + length):
            groups[-1].append(seq)
            total += length
        else:
            groups.append([seq])
            width = total = length
    return [np.asarray(g, dtype=np.int64) for g in groups]


def _decode_group(queries, key_cache, value_cache, block_tables, context_lens, scale, layer: LayerAttention) -> mx.array:
    first = window_starts(context_lens, layer.window)
    seen = context_lens - first
    width = int(seen.max())
    slots = token_slots(block_tables, context_lens, key_cache.shape[1], width, first)
    rows = mx.array(head_major_rows(slots, key_cache.shape[2]))  # one index for both gathers
    keys, values = gather_rows(key_cache, rows), gather_rows(value_cache, rows)
    mask = None
    if int(seen.min()) != width:
        mask = mx.array(np.arange(width)[None, :] < seen[:, None])[:, None, None, :]
    q = queries.astype(key_cache.dtype)[:, :, None, :]
    out = attention(q, keys, values, scale, mask, layer)
    return out[:, :, 0, :].astype(queries.dtype)


def paged_decode_reference(
    queries: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    scale: float,
    layer: LayerAttention = PLAIN,
) -> mx.array:
    """One query per sequence against its whole paged context (or its window); lengths may differ.

    Sequences are decoded in groups of similar length (see `length_groups`), then put
    back in their order.
    """
    num_seqs = queries.shape[0]
    if num_seqs == 0:
        return mx.zeros((*queries.shape[:2], value_cache.shape[3]), dtype=queries.dtype)
    groups = length_groups(context_lens - window_starts(context_lens, layer.window))
    if len(groups) == 1:
        return _decode_group(queries, key_cache, value_cache, block_tables, context_lens, scale, layer)
    pieces = [
        _decode_group(queries[mx.array(g)], key_cache, value_cache, block_tables[g], context_lens[g], scale, layer)
        for g in groups
    ]
    order = np.concatenate(groups)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(num_seqs)
    return mx.take(mx.concatenate(pieces, axis=0), mx.array(inverse), axis=0)


@dataclass(frozen=True)
class DecodeGroupPiece:
    """Decode rows of similar context length, attended in one padded SDPA."""

    query_rows: mx.array  # packed query row of each member
    kv_rows: mx.array  # [members, num_kv_heads, width] rows of the flattened pool
    mask: mx.array | None  # [members, 1, 1, width], None when every member fills the width


@dataclass(frozen=True)
class ChunkPiece:
    """A prefill chunk: the last q_len positions of one sequence, causal over its context (or its window)."""

    first_row: int
    stop_row: int
    kv_rows: mx.array  # [1, num_kv_heads, keys]: positions first_key..context_len-1
    mask: mx.array | str  # "causal", or [q_len, keys] where a window hides early keys


@dataclass(frozen=True)
class ReferenceLayout:
    """Pieces of a step for one window, in the order their outputs are concatenated."""

    pieces: tuple  # DecodeGroupPiece and ChunkPiece
    inverse: mx.array | None  # packed row -> row of the concatenation; None when the order is already packed


@dataclass(frozen=True, eq=False)
class ReferencePlan:
    """What the gather + SDPA path needs for a step, computed on the host once and shared by every layer.

    The full-context layout is made with the plan; a window's layout (fewer keys per piece) is
    made by the first layer that asks for it and kept for the step's other layers of that window.
    """

    starts: np.ndarray
    context_lens: np.ndarray
    block_tables: np.ndarray
    block_size: int
    num_kv_heads: int
    layouts: dict = field(default_factory=dict, compare=False, repr=False)

    def layout(self, window: int | None) -> ReferenceLayout:
        if window is not None and window >= int(self.context_lens.max(initial=0)):
            window = None  # no query of this step reaches past the window
        if window not in self.layouts:
            self.layouts[window] = _layout(self, window)
        return self.layouts[window]

    @property
    def pieces(self) -> tuple:
        return self.layout(None).pieces


def plan_reference(
    starts: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray, block_size: int, num_kv_heads: int
) -> ReferencePlan:
    """The step's host metadata, with its full-context layout made now."""
    plan = ReferencePlan(starts, context_lens, block_tables, block_size, num_kv_heads)
    plan.layout(None)
    return plan


def _layout(plan: ReferencePlan, window: int | None) -> ReferenceLayout:
    """Length groups for the q_len == 1 rows, one piece per longer chunk, and the permutation back."""
    starts, context_lens, block_tables = plan.starts, plan.context_lens, plan.block_tables
    q_lens = np.diff(starts)
    decode_seqs = np.nonzero(q_lens == 1)[0]
    pieces, order = [], []
    if decode_seqs.size:
        lengths = context_lens[decode_seqs]
        for group in length_groups(lengths - window_starts(lengths, window)):
            seqs = decode_seqs[group]
            pieces.append(_decode_piece(starts[seqs], block_tables[seqs], context_lens[seqs], plan, window))
            order.append(starts[seqs])
    for seq in np.nonzero(q_lens > 1)[0].tolist():
        pieces.append(_chunk_piece(int(starts[seq]), int(q_lens[seq]), block_tables[seq:seq + 1], int(context_lens[seq]), plan, window))
        order.append(np.arange(starts[seq], starts[seq + 1]))
    return ReferenceLayout(tuple(pieces), _inverse(np.concatenate(order)) if order else None)


def _decode_piece(query_rows, block_tables, context_lens, plan: ReferencePlan, window: int | None) -> DecodeGroupPiece:
    first = window_starts(context_lens, window)
    seen = context_lens - first
    width = int(seen.max())
    slots = token_slots(block_tables, context_lens, plan.block_size, width, first)
    mask = None
    if int(seen.min()) != width:
        mask = mx.array(np.arange(width)[None, :] < seen[:, None])[:, None, None, :]
    return DecodeGroupPiece(mx.array(query_rows.astype(np.int32)), mx.array(head_major_rows(slots, plan.num_kv_heads)), mask)


def _chunk_piece(first_row: int, q_len: int, table: np.ndarray, length: int, plan: ReferencePlan, window: int | None) -> ChunkPiece:
    """Keys from the first one the chunk's first query sees; a window that hides some gets an explicit mask."""
    first_query = length - q_len
    first_key = 0 if window is None else max(first_query - window + 1, 0)
    lengths = np.array([length], dtype=np.int32)
    slots = token_slots(table, lengths, plan.block_size, length - first_key, np.array([first_key], dtype=np.int32))
    mask: mx.array | str = "causal"  # aligns the last query with the last key, which is where the chunk sits
    if window is not None and window < length:
        query = np.arange(first_query, length)[:, None]
        key = np.arange(first_key, length)[None, :]
        mask = mx.array((key <= query) & (key > query - window))
    return ChunkPiece(first_row, first_row + q_len, mx.array(head_major_rows(slots, plan.num_kv_heads)), mask)


def _inverse(order: np.ndarray) -> mx.array | None:
    if np.array_equal(order, np.arange(order.size)):
        return None
    inverse = np.empty_like(order)
    inverse[order] = np.arange(order.size)
    return mx.array(inverse.astype(np.int32))


def paged_varlen_reference(
    queries: mx.array, key_cache: mx.array, value_cache: mx.array, plan: ReferencePlan, scale: float,
    layer: LayerAttention = PLAIN,
) -> mx.array:
    """Run a step's pieces for this layer's window (gather + SDPA each) and put their rows back in packed order."""
    layout = plan.layout(layer.window)
    if not layout.pieces:
        return mx.zeros((*queries.shape[:2], value_cache.shape[3]), dtype=queries.dtype)
    outputs = [_run_piece(piece, queries, key_cache, value_cache, scale, layer) for piece in layout.pieces]
    out = outputs[0] if len(outputs) == 1 else mx.concatenate(outputs, axis=0)
    return out if layout.inverse is None else mx.take(out, layout.inverse, axis=0)


def _run_piece(piece, queries: mx.array, key_cache: mx.array, value_cache: mx.array, scale: float, layer: LayerAttention) -> mx.array:
    keys = gather_rows(key_cache, piece.kv_rows)
    values = gather_rows(value_cache, piece.kv_rows)
    if isinstance(piece, DecodeGroupPiece):
        q = queries[piece.query_rows].astype(key_cache.dtype)[:, :, None, :]
        out = attention(q, keys, values, scale, piece.mask, layer)
        return out[:, :, 0, :].astype(queries.dtype)
    q = queries[piece.first_row:piece.stop_row].astype(key_cache.dtype).transpose(1, 0, 2)[None]
    out = attention(q, keys, values, scale, piece.mask, layer)
    return out[0].transpose(1, 0, 2).astype(queries.dtype)


def attention(q: mx.array, keys: mx.array, values: mx.array, scale: float, mask, layer: LayerAttention) -> mx.array:
    """SDPA with the layer's sinks; a soft-capped layer goes through `capped_attention`."""
    sinks = None if layer.sinks is None else layer.sinks.astype(q.dtype)
    if layer.softcap is None:
        return mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask, sinks=sinks)
    return capped_attention(q, keys, values, scale, mask, layer.softcap, sinks)


def capped_attention(q, keys, values, scale: float, mask, softcap: float, sinks) -> mx.array:
    """q [B, Hq, L, D] over keys [B, Hkv, T, D] and values [B, Hkv, T, Dv]: scores capped as
    c * tanh(s / c), softmax in float32; out [B, Hq, L, Dv]."""
    batch, num_heads, q_len, head_dim = q.shape
    num_kv_heads, keys_len = keys.shape[1], keys.shape[2]
    group = num_heads // num_kv_heads
    grouped = q.astype(mx.float32).reshape(batch, num_kv_heads, group, q_len, head_dim) * scale
    scores = grouped @ keys.astype(mx.float32)[:, :, None].swapaxes(-1, -2)
    scores = mx.tanh(scores / softcap) * softcap
    if isinstance(mask, str):
        mask = mx.arange(keys_len)[None, :] <= mx.arange(keys_len - q_len, keys_len)[:, None]
    if mask is not None:
        mask = mask if mask.ndim < 4 else mask[:, :, None]  # [B, 1, 1, T] -> [B, 1, 1, 1, T]
        scores = mx.where(mask, scores, mx.array(-1e30, mx.float32))
    if sinks is not None:
        column = mx.broadcast_to(sinks.astype(mx.float32).reshape(1, num_kv_heads, group, 1, 1), (*scores.shape[:-1], 1))
        scores = mx.concatenate([scores, column], axis=-1)
    weights = mx.softmax(scores, axis=-1)[..., :keys_len]
    out = weights @ values.astype(mx.float32)[:, :, None]
    return out.reshape(batch, num_heads, q_len, values.shape[-1]).astype(q.dtype)


def paged_decode_on_device(
    queries: mx.array, key_cache: mx.array, value_cache: mx.array, block_tables: mx.array, context_lens: mx.array,
    scale: float, layer: LayerAttention = PLAIN,
) -> mx.array:
    """Decode with its metadata left on the device: no host read, so a traced graph can hold it.

    Every position of the tables' capacity is gathered (past a sequence's length, its last
    real token again, as `token_slots` does) and masked, the layer's window included, so the
    graph depends on shapes only. It pads every row to the capacity, so the host-planned
    `paged_decode_reference` is the faster choice wherever the metadata is on the host.
    """
    num_kv_heads, block_size = key_cache.shape[2], key_cache.shape[1]
    width = block_tables.shape[1] * block_size
    lengths = context_lens.astype(mx.int32)[:, None]
    columns = mx.arange(width, dtype=mx.int32)[None, :]
    positions = mx.minimum(columns, lengths - 1)
    blocks = mx.take_along_axis(block_tables.astype(mx.int32), positions // block_size, axis=1)
    slots = blocks * block_size + positions % block_size
    rows = slots[:, None, :] * num_kv_heads + mx.arange(num_kv_heads, dtype=mx.int32)[None, :, None]
    keys, values = gather_rows(key_cache, rows), gather_rows(value_cache, rows)
    seen = columns < lengths
    if layer.window is not None:
        seen = seen & (columns >= lengths - layer.window)
    q = queries.astype(key_cache.dtype)[:, :, None, :]
    out = attention(q, keys, values, scale, seen[:, None, None, :], layer)
    return out[:, :, 0, :].astype(queries.dtype)

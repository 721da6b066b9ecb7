"""Paged attention in plain MLX ops: gather the KV rows through the block table, then SDPA.

It runs on every device MLX runs on, so it is the fallback and the yardstick for the
compiled kernels. The gather is per token rather than per block: positions past a
sequence's length are pointed at that sequence's last real token, so padding never
reads unused pool slots (which may hold anything, NaN included) and the boolean mask
then gives those duplicates zero weight.
"""

from __future__ import annotations

from typing import Callable

import mlx.core as mx
import numpy as np

from kernels.errors import InvalidAttentionMetadata

#: decode(queries, key_cache, value_cache, block_tables, context_lens, scale) -> output
DecodeFn = Callable[[mx.array, mx.array, mx.array, np.ndarray, np.ndarray, float], mx.array]


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


def token_slots(block_tables: np.ndarray, context_lens: np.ndarray, block_size: int, width: int) -> np.ndarray:
    """Pool slot of each position 0..width-1 of each sequence; positions past the end repeat the last token."""
    positions = np.minimum(np.arange(width, dtype=np.int32)[None, :], context_lens[:, None] - 1)
    blocks = np.take_along_axis(block_tables, positions // block_size, axis=1)
    return blocks * block_size + positions % block_size


_SIDE_STREAMS: dict = {}


def side_stream() -> mx.Stream | None:
    """A second CPU stream, so the K and V gathers run on two cores; GPUs overlap work by themselves."""
    device = mx.default_device()
    if device.type != mx.cpu:
        return None
    if device not in _SIDE_STREAMS:
        _SIDE_STREAMS[device] = mx.new_stream(device)
    return _SIDE_STREAMS[device]


def gather_heads_major(cache: mx.array, slots: np.ndarray, stream: mx.Stream | None = None) -> mx.array:
    """Rows of one layer's pool at `slots` [B, T], as a contiguous [B, num_kv_heads, T, head_dim].

    The head is folded into the row index so the gather writes SDPA's layout directly;
    gathering token rows and transposing afterwards made CPU SDPA ~10x slower (strided K/V).
    Every op of the gather goes on `stream`, so it never queues behind the other gather.
    """
    num_kv_heads, head_dim = cache.shape[2:]
    rows = slots[:, None, :] * num_kv_heads + np.arange(num_kv_heads, dtype=np.int32)[None, :, None]
    with mx.stream(stream or mx.default_stream(mx.default_device())):
        flat = cache.reshape(-1, head_dim)
        if (head_dim * cache.itemsize) % 8 == 0:
            # A gather only moves bytes: as 64-bit words it copies 2-4x fewer elements (CPU gathers per element).
            return mx.take(flat.view(mx.uint64), mx.array(rows), axis=0).view(cache.dtype)
        return mx.take(flat, mx.array(rows), axis=0)


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


def _decode_group(queries, key_cache, value_cache, block_tables, context_lens, scale) -> mx.array:
    width = int(context_lens.max())
    slots = token_slots(block_tables, context_lens, key_cache.shape[1], width)
    keys = gather_heads_major(key_cache, slots)
    values = gather_heads_major(value_cache, slots, side_stream())
    mask = None
    if int(context_lens.min()) != width:
        mask = mx.array(np.arange(width)[None, :] < context_lens[:, None])[:, None, None, :]
    q = queries.astype(key_cache.dtype)[:, :, None, :]
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return out[:, :, 0, :].astype(queries.dtype)


def paged_decode_reference(
    queries: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables: np.ndarray,
    context_lens: np.ndarray,
    scale: float,
) -> mx.array:
    """One query per sequence against its whole paged context; lengths may differ.

    Sequences are decoded in groups of similar length (see `length_groups`), then put
    back in their order.
    """
    num_seqs = queries.shape[0]
    if num_seqs == 0:
        return mx.zeros(queries.shape, dtype=queries.dtype)
    groups = length_groups(context_lens)
    if len(groups) == 1:
        return _decode_group(queries, key_cache, value_cache, block_tables, context_lens, scale)
    pieces = [
        _decode_group(queries[mx.array(g)], key_cache, value_cache, block_tables[g], context_lens[g], scale)
        for g in groups
    ]
    order = np.concatenate(groups)
    inverse = np.empty_like(order)
    inverse[order] = np.arange(num_seqs)
    return mx.take(mx.concatenate(pieces, axis=0), mx.array(inverse), axis=0)


def chunk_attention_reference(
    queries: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_table: np.ndarray,
    context_len: int,
    scale: float,
) -> mx.array:
    """The last q_len positions of one sequence attend causally to its first context_len tokens."""
    q_len = queries.shape[0]
    slots = token_slots(block_table[None, :], np.array([context_len], dtype=np.int32), key_cache.shape[1], context_len)
    keys = gather_heads_major(key_cache, slots)
    values = gather_heads_major(value_cache, slots, side_stream())
    q = queries.astype(key_cache.dtype).transpose(1, 0, 2)[None]
    # "causal" aligns the last query with the last key, which is where the chunk sits.
    mask = "causal" if q_len > 1 else None
    out = mx.fast.scaled_dot_product_attention(q, keys, values, scale=scale, mask=mask)
    return out[0].transpose(1, 0, 2).astype(queries.dtype)


def check_prefill_metadata(
    queries: mx.array, key_cache: mx.array, query_start_loc: np.ndarray, context_lens: np.ndarray, block_tables: np.ndarray
) -> None:
    """Offsets must be cumulative, cover every query row, and fit inside each sequence's length."""
    num_seqs = context_lens.shape[0]
    if query_start_loc.shape != (num_seqs + 1,) or block_tables.shape[:1] != (num_seqs,):
        raise InvalidAttentionMetadata(
            f"expected query_start_loc [{num_seqs + 1}] and block_tables [{num_seqs}, max_blocks], "
            f"got {query_start_loc.shape} and {block_tables.shape}"
        )
    q_lens = np.diff(query_start_loc)
    if query_start_loc[0] != 0 or query_start_loc[-1] != queries.shape[0] or (q_lens < 0).any():
        raise InvalidAttentionMetadata(
            f"query_start_loc must rise from 0 to total_q={queries.shape[0]}, got {query_start_loc.tolist()}"
        )
    if (q_lens > context_lens).any():
        raise InvalidAttentionMetadata("a sequence has more new queries than its context length")
    if queries.shape[2] != key_cache.shape[3] or queries.shape[1] % key_cache.shape[2]:
        raise InvalidAttentionMetadata(
            f"queries {queries.shape} do not fit a cache of {key_cache.shape[2]} kv heads of size {key_cache.shape[3]}"
        )
    check_table_values(key_cache, block_tables, context_lens)


def paged_prefill_with(
    decode: DecodeFn,
    queries: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables,
    query_start_loc,
    context_lens,
    scale: float,
) -> mx.array:
    """Split a packed mix into one batched decode for q_len == 1 rows and one causal SDPA per longer chunk.

    Pieces are concatenated back in sequence order; a run of consecutive decode sequences
    is one slice of the batched decode output, so no permutation is needed.
    """
    tables = as_host_ints(block_tables, "block_tables")
    starts = as_host_ints(query_start_loc, "query_start_loc")
    lengths = as_host_ints(context_lens, "context_lens")
    check_prefill_metadata(queries, key_cache, starts, lengths, tables)
    q_lens = np.diff(starts)
    is_decode = q_lens == 1
    decode_seqs = np.nonzero(is_decode)[0]
    decoded = None
    if decode_seqs.size:
        decoded = decode(
            queries[mx.array(starts[decode_seqs])], key_cache, value_cache,
            tables[decode_seqs], lengths[decode_seqs], scale,
        )
    pieces, decode_cursor, run_start = [], 0, None
    for seq, q_len in enumerate(q_lens):
        if is_decode[seq]:
            run_start = decode_cursor if run_start is None else run_start
            decode_cursor += 1
            continue
        if run_start is not None:
            pieces.append(decoded[run_start:decode_cursor])
            run_start = None
        if q_len:
            chunk = queries[int(starts[seq]):int(starts[seq + 1])]
            pieces.append(chunk_attention_reference(chunk, key_cache, value_cache, tables[seq], int(lengths[seq]), scale))
    if run_start is not None:
        pieces.append(decoded[run_start:decode_cursor])
    if not pieces:
        return mx.zeros(queries.shape, dtype=queries.dtype)
    return pieces[0] if len(pieces) == 1 else mx.concatenate(pieces, axis=0)

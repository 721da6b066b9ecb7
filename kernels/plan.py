"""The attention plan of one step: validated once, uploaded once, read by every layer.

A step's metadata (query offsets, context lengths, block tables) is the same for every
layer, so everything derived from it is built here once per step: for the compiled
backends the varlen kernel's work list and tile shape, as device arrays; for the reference
backend its length groups and pool rows. A layer then only launches: no host checks, no
reads of device arrays back to the host.

Work decomposition of the compiled kernel (see kernels/source.py): each sequence's new
queries are cut into tiles of `q_tokens` tokens (a decode row is a tile of one); each
tile's causal context (positions 0..its last query) is cut into partitions; one unit of
work is one (tile, partition), run by one threadgroup per group of query heads. Units are
listed longest first so the long ones start early and the short ones fill the tail.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import mlx.core as mx
import numpy as np

from kernels import reference, source
from kernels.dispatch import resolve_backend
from kernels.errors import InvalidAttentionMetadata, UnsupportedAttentionShape

WARP = 32
#: bytes of threadgroup memory one threadgroup may declare: CUDA's static __shared__ limit, Metal's threadgroup limit
SHARED_BYTES = {"cuda": 48 * 1024, "metal": 32 * 1024}
KV_TILES = (32, 16, 8)


@dataclass(frozen=True)
class VarlenTuning:
    """Knobs of the varlen kernel; to be measured on the H200 (`python -m kernels.bench --only varlen`)."""

    threads: int = 128
    max_query_tokens: int = 16  # query tokens of one sequence per threadgroup
    partition_size: int = 1024  # context tokens per unit for long contexts
    min_partition_size: int = 256  # small steps split down to this to fill the GPU
    target_threadgroups: int = 512
    merge_threads: int = 128
    kv_tile: int | None = None  # keys loaded per step (32, 16 or 8); None: whichever gives the most query rows


@dataclass(frozen=True)
class TileShape:
    """How many query tokens and heads one threadgroup holds, and how many keys it loads at a time."""

    q_tokens: int
    heads_per_tile: int
    kv_tile: int

    @property
    def rows(self) -> int:
        return self.q_tokens * self.heads_per_tile


@dataclass(frozen=True)
class WorkList:
    """Host copy of the kernel's work: one row per unit and one per query row of a split tile."""

    units: np.ndarray  # int32 [num_units, len(source.UNIT_FIELDS)]
    split_rows: np.ndarray  # int32 [num_split_rows, len(source.SPLIT_ROW_FIELDS)]
    num_partial_rows: int  # query rows of partial outputs (per head) the split units write
    partition_size: int


@dataclass(frozen=True)
class KernelPlan:
    """What the compiled varlen kernel reads: the shape it is compiled for and the step's device arrays."""

    shape: TileShape
    tuning: VarlenTuning
    work: WorkList
    units: mx.array
    split_rows: mx.array | None
    split_query_rows: mx.array | None  # packed rows the merged outputs go back to
    dims: mx.array  # int32 [max_blocks]: the block tables' row stride

    @property
    def num_units(self) -> int:
        return int(self.work.units.shape[0])

    @property
    def num_split_rows(self) -> int:
        return int(self.work.split_rows.shape[0])


@dataclass(frozen=True)
class VarlenPlan:
    """One step's attention metadata for one backend; pass it to `paged_varlen_attention` in every layer."""

    backend: str
    total_q: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    block_tables: mx.array
    kernel: KernelPlan | None  # compiled backends
    reference: reference.ReferencePlan | None  # the reference backend
    _scales: dict = field(default_factory=dict, compare=False, repr=False)

    def scale_array(self, scale: float) -> mx.array:
        """The softmax scale as a device array, made once per step rather than once per layer."""
        if scale not in self._scales:
            self._scales[scale] = mx.array([scale], dtype=mx.float32)
        return self._scales[scale]


def plan_varlen(
    query_start_loc,
    context_lens,
    block_tables,
    *,
    block_size: int,
    num_heads: int,
    num_kv_heads: int,
    head_dim: int,
    backend: str | None = None,
    num_blocks: int | None = None,
    tuning: VarlenTuning | None = None,
) -> VarlenPlan:
    """Check a step's metadata (host numpy arrays) once and build what every layer's attention reads.

    query_start_loc int32 [num_seqs + 1]; context_lens int32 [num_seqs], each sequence's
    tokens after this step (chunk included); block_tables int32 [num_seqs, max_blocks].
    `num_blocks` (the pool's size), when given, bounds the block ids.
    """
    starts = reference.as_host_ints(query_start_loc, "query_start_loc")
    lengths = reference.as_host_ints(context_lens, "context_lens")
    tables = reference.as_host_ints(block_tables, "block_tables")
    check_varlen_metadata(starts, lengths, tables, block_size=block_size, num_heads=num_heads,
                          num_kv_heads=num_kv_heads, num_blocks=num_blocks)
    name = resolve_backend(backend)
    common = dict(backend=name, total_q=int(starts[-1]), num_heads=num_heads, num_kv_heads=num_kv_heads,
                  head_dim=head_dim, block_size=block_size, block_tables=mx.array(tables))
    if name == "reference":
        return VarlenPlan(**common, kernel=None, reference=reference.plan_reference(starts, lengths, tables, block_size, num_kv_heads))
    kernel = plan_kernel(name, starts, lengths, tables.shape[1], num_heads, num_kv_heads, head_dim, tuning or VarlenTuning())
    return VarlenPlan(**common, kernel=kernel, reference=None)


def check_varlen_metadata(
    starts: np.ndarray, lengths: np.ndarray, tables: np.ndarray, *,
    block_size: int, num_heads: int, num_kv_heads: int, num_blocks: int | None = None,
) -> None:
    """Offsets rise from 0 and fit inside each context; contexts fit their tables; block ids name pool blocks."""
    num_seqs = lengths.shape[0] if lengths.ndim == 1 else -1
    if num_seqs < 0 or starts.shape != (num_seqs + 1,) or tables.ndim != 2 or tables.shape[0] != num_seqs:
        raise InvalidAttentionMetadata(
            f"expected query_start_loc [num_seqs + 1], context_lens [num_seqs] and block_tables [num_seqs, max_blocks], "
            f"got {starts.shape}, {lengths.shape} and {tables.shape}"
        )
    if num_kv_heads < 1 or num_heads % num_kv_heads:
        raise InvalidAttentionMetadata(f"num_heads {num_heads} is not a multiple of num_kv_heads {num_kv_heads}")
    q_lens = np.diff(starts)
    if starts[0] != 0 or (q_lens < 0).any():
        raise InvalidAttentionMetadata(f"query_start_loc must rise from 0, got {starts.tolist()}")
    if (q_lens > lengths).any():
        raise InvalidAttentionMetadata("a sequence has more new queries than its context length")
    if num_seqs == 0:
        return
    capacity = tables.shape[1] * block_size
    if lengths.min() < 1 or lengths.max() > capacity:
        raise InvalidAttentionMetadata(f"context_lens must lie in 1..{capacity}, got {lengths.min()}..{lengths.max()}")
    used = tables[np.arange(tables.shape[1])[None, :] < -(-lengths[:, None] // block_size)]
    if used.size and (used.min() < 0 or (num_blocks is not None and used.max() >= num_blocks)):
        raise InvalidAttentionMetadata(f"block ids must lie in 0..{(num_blocks or 1) - 1}")


def plan_kernel(
    dialect: str, starts: np.ndarray, lengths: np.ndarray, max_blocks: int,
    num_heads: int, num_kv_heads: int, head_dim: int, tuning: VarlenTuning,
) -> KernelPlan:
    """Tile shape for this step's longest chunk, the work list, and its upload."""
    q_lens = np.diff(starts)
    longest = int(q_lens.max()) if q_lens.size else 1
    shape = tile_shape_for(num_heads // num_kv_heads, head_dim, max(longest, 1), SHARED_BYTES[dialect] // 4, tuning)
    head_tiles = num_heads // shape.heads_per_tile
    work = work_list(starts, lengths, shape.q_tokens, head_tiles, tuning)
    split = work.split_rows.shape[0] > 0
    return KernelPlan(
        shape=shape, tuning=tuning, work=work, units=mx.array(work.units),
        split_rows=mx.array(work.split_rows) if split else None,
        split_query_rows=mx.array(work.split_rows[:, 0]) if split else None,
        dims=mx.array([max(max_blocks, 1)], dtype=mx.int32),
    )


def shared_words(shape: TileShape, head_dim: int) -> int:
    """float32 words of threadgroup memory the kernel declares for a shape (see VARLEN_BODY)."""
    return shape.rows * head_dim + shape.kv_tile * (2 * head_dim + 1) + shape.rows * shape.kv_tile + 3 * shape.rows


def tile_shape_for(group: int, head_dim: int, longest_query: int, budget_words: int, tuning: VarlenTuning) -> TileShape:
    """The most query rows (tokens x heads of one KV group) that fit the shared-memory budget.

    Heads of a GQA group come first (they share every K/V load at no extra cost to decode
    rows); then tokens, no more than the step's longest chunk needs. Ties go to the wider
    key tile, which keeps a whole warp on one row's keys.
    """
    token_cap = min(tuning.max_query_tokens, 1 << (longest_query - 1).bit_length())
    best = None
    for kv_tile in KV_TILES if tuning.kv_tile is None else (tuning.kv_tile,):
        heads = [h for h in range(group, 0, -1) if group % h == 0 and shared_words(TileShape(1, h, kv_tile), head_dim) <= budget_words]
        if not heads:
            continue
        tokens = token_cap
        while tokens > 1 and shared_words(TileShape(tokens, heads[0], kv_tile), head_dim) > budget_words:
            tokens //= 2
        candidate = TileShape(tokens, heads[0], kv_tile)
        if best is None or candidate.rows > best.rows:
            best = candidate
    if best is None:
        raise UnsupportedAttentionShape(f"head_dim {head_dim} leaves no shared memory for one query row")
    return best


def work_list(starts: np.ndarray, lengths: np.ndarray, q_tokens: int, head_tiles: int, tuning: VarlenTuning) -> WorkList:
    """Tiles of q_tokens queries per sequence, each cut into context partitions, as the kernel's int32 rows."""
    tiles = query_tiles(starts, lengths, q_tokens)
    partition = partition_size_for(tiles["kv_end"], head_tiles, tuning)
    parts = np.maximum(-(-tiles["kv_end"] // partition), 1)
    split = parts > 1
    # Partial rows of a split tile: partition p of a tile of `count` queries holds rows base + p * count + i.
    partial_base = np.zeros(parts.size, dtype=np.int64)
    split_sizes = np.where(split, parts * tiles["count"], 0)
    partial_base[1:] = np.cumsum(split_sizes)[:-1]
    tile_of_unit = np.repeat(np.arange(parts.size), parts)
    part_of_unit = np.arange(tile_of_unit.size) - np.repeat(np.cumsum(parts) - parts, parts)
    kv_start = part_of_unit * partition
    kv_end = np.minimum(kv_start + partition, tiles["kv_end"][tile_of_unit])
    units = np.stack([
        tiles["seq"][tile_of_unit], tiles["query_row"][tile_of_unit], tiles["count"][tile_of_unit],
        tiles["query_position"][tile_of_unit], kv_start, kv_end,
        partial_base[tile_of_unit] + part_of_unit * tiles["count"][tile_of_unit], split[tile_of_unit],
    ], axis=1).astype(np.int32).reshape(-1, len(source.UNIT_FIELDS))
    units = units[np.argsort(-(kv_end - kv_start), kind="stable")]
    return WorkList(units, split_rows_of(tiles, parts, partial_base), int(split_sizes.sum()), partition)


def query_tiles(starts: np.ndarray, lengths: np.ndarray, q_tokens: int) -> dict:
    """Per tile: its sequence, first packed query row, query count, first query's position, context end."""
    q_lens = np.diff(starts).astype(np.int64)
    per_seq = -(-q_lens // q_tokens)
    seq = np.repeat(np.arange(q_lens.size), per_seq)
    first = (np.arange(seq.size) - np.repeat(np.cumsum(per_seq) - per_seq, per_seq)) * q_tokens
    count = np.minimum(q_tokens, q_lens[seq] - first)
    position = lengths[seq].astype(np.int64) - q_lens[seq] + first
    return dict(seq=seq, query_row=starts[seq] + first, count=count, query_position=position, kv_end=position + count)


def partition_size_for(kv_ends: np.ndarray, head_tiles: int, tuning: VarlenTuning) -> int:
    """Halve the partition while the step has too few threadgroups to fill the GPU (decode rows with long contexts)."""
    size = tuning.partition_size
    while size > tuning.min_partition_size and head_tiles * int(np.maximum(-(-kv_ends // size), 1).sum()) < tuning.target_threadgroups:
        size //= 2
    return size


def split_rows_of(tiles: dict, parts: np.ndarray, partial_base: np.ndarray) -> np.ndarray:
    """One row per query of a split tile: where its merged output goes and where its partitions lie."""
    split = np.nonzero(parts > 1)[0]
    counts = tiles["count"][split]
    tile = np.repeat(split, counts)
    offset = np.arange(tile.size) - np.repeat(np.cumsum(counts) - counts, counts)
    rows = np.stack([tiles["query_row"][tile] + offset, partial_base[tile] + offset, tiles["count"][tile], parts[tile]], axis=1)
    return rows.astype(np.int32).reshape(-1, len(source.SPLIT_ROW_FIELDS))

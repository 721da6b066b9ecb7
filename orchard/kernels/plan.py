"""The attention plan of one step: validated once, uploaded once, read by every layer.

A step's metadata (query offsets, context lengths, block tables) is the same for every
layer, so everything derived from it is built here once per step: for the compiled
backends the varlen kernel's work list and tile shape, as device arrays; for the reference
backend its length groups and pool rows; for the CPU kernel each query row's table and length
(orchard/kernels/cpu). A layer then only launches: no host checks, no
reads of device arrays back to the host.

Work decomposition of the compiled kernel (see orchard/kernels/source.py): each chunk's new
queries (q_len > 1) are cut into tiles of `q_tokens` tokens; each tile's causal context
(positions 0..its last query) is cut into partitions; one unit of work is one (tile,
partition), run by one threadgroup per group of query heads. Units are listed longest
first so the long ones start early and the short ones fill the tail. Decode rows (q_len 1)
get a decode-kernel plan of their own and are scattered back into the step's output.

The plan knows nothing of a layer's window, sinks or soft cap (orchard/kernels/variants.py): they
are launch inputs, so layers that differ share the plan. A windowed layer's units that lie
wholly before its window read no keys and add nothing when their partitions are merged.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

from orchard.kernels import cpu, mma_source, reference, source
from orchard.kernels.backends import resolve_backend
from orchard.kernels.errors import InvalidAttentionMetadata, UnsupportedAttentionShape
from orchard.kernels.launch import DecodePlan, KernelTuning, decode_dims, plan_decode
from orchard.kernels.variants import LayerAttention, LayerInputs, layer_inputs

WARP = 32
#: bytes of threadgroup memory one threadgroup may declare: CUDA's static __shared__ limit, Metal's threadgroup limit
SHARED_BYTES = {"cuda": 48 * 1024, "metal": 32 * 1024}
KV_TILES = (32, 16, 8, 4)
#: rows and keys of one thread's register block of scores (SUB in VARLEN_BODY)
SUB = 4
#: bytes per element of the pools the kernel serves: half types, and float32
ITEMSIZES = (2, 4)
MAX_THREADS = 256


@dataclass(frozen=True)
class VarlenTuning:
    """Knobs of the varlen kernel; to be measured on the H200 (`python -m orchard.cluster.bench.kernels --only varlen --sweep`)."""

    max_rows: int = 64  # query rows (tokens x heads of one KV group) per threadgroup
    max_query_tokens: int = 64  # query tokens of one sequence per threadgroup
    partition_size: int = 4096  # context tokens per unit for long contexts
    min_partition_size: int = 256  # small steps split down to this to fill the GPU
    target_threadgroups: int = 1024
    merge_threads: int = 128
    kv_tile: int | None = None  # most keys loaded per step (32, 16, 8 or 4); None: the widest that fits
    decode: KernelTuning = KernelTuning()  # the decode kernel that serves the step's q_len 1 rows
    tensor_cores: bool = True  # CUDA, half pools: chunks through the MMA body (orchard/kernels/mma_source.py)


@dataclass(frozen=True)
class TileShape:
    """Query tokens and heads one threadgroup holds, and keys it loads at a time for 2- and 4-byte pools.

    The rows are fixed by the plan (they shape the work list); the key tile may differ by the
    pool's dtype, since a float32 tile takes twice the threadgroup memory.
    """

    q_tokens: int
    heads_per_tile: int
    kv_tile: int  # float16 / bfloat16 pools
    kv_tile_wide: int  # float32 pools

    @property
    def rows(self) -> int:
        return self.q_tokens * self.heads_per_tile

    def kv_tile_for(self, itemsize: int) -> int:
        return self.kv_tile if itemsize == 2 else self.kv_tile_wide

    def threads_for(self, itemsize: int) -> int:
        return threads_for(self.rows, self.kv_tile_for(itemsize))


def threads_for(rows: int, kv_tile: int) -> int:
    """One thread per SUB x SUB block of scores, rounded up to whole warps (the extra lanes only load)."""
    return -(-rows * kv_tile // (SUB * SUB * WARP)) * WARP


@dataclass(frozen=True)
class WorkList:
    """Host copy of the kernel's work: one row per unit and one per query row of a split tile."""

    units: np.ndarray  # int32 [num_units, len(source.UNIT_FIELDS)]
    split_rows: np.ndarray  # int32 [num_split_rows, len(source.SPLIT_ROW_FIELDS)]
    num_partial_rows: int  # query rows of partial outputs (per head) the split units write
    partition_size: int


@dataclass(frozen=True)
class DecodeRows:
    """The step's q_len 1 rows, served by the decode kernel: a one-token tile is memory-bound and
    that kernel reads K/V at the roofline, where a query tile would compute mostly empty rows."""

    plan: DecodePlan
    tuning: KernelTuning
    host_rows: np.ndarray  # packed query rows, in sequence order
    rows: mx.array
    block_tables: mx.array
    context_lens: mx.array
    dims: mx.array  # int32 [max_blocks, num_partitions]
    every_row: bool  # the step is decode only: the decode output is the whole output


@dataclass(frozen=True)
class KernelPlan:
    """What the compiled kernels read: the varlen kernel's shape and work, and the decode rows."""

    shape: TileShape
    tuning: VarlenTuning
    work: WorkList
    mma_kv_tile: int | None  # keys per tile of the tensor-core body; None: the SIMT body for every pool
    units: mx.array
    split_rows: mx.array | None
    split_query_rows: mx.array | None  # packed rows the merged outputs go back to
    dims: mx.array  # int32 [max_blocks]: the block tables' row stride
    decode: DecodeRows | None

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
    rows: cpu.RowsPlan | None = None  # the CPU kernel: every query row with its table and length

    def layer_inputs(self, scale: float, layer: LayerAttention) -> LayerInputs:
        """A layer's scale, window, soft cap and sinks as device arrays, made once per distinct value."""
        return layer_inputs(self.num_heads, scale, layer)


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
    if name == "cpu":
        return VarlenPlan(**common, kernel=None, reference=None, rows=cpu.plan_rows(starts, lengths, tables))
    if name == "reference":
        return VarlenPlan(**common, kernel=None, reference=reference.plan_reference(starts, lengths, tables, block_size, num_kv_heads))
    kernel = plan_kernel(name, starts, lengths, tables, num_heads, num_kv_heads, head_dim, tuning or VarlenTuning())
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
    dialect: str, starts: np.ndarray, lengths: np.ndarray, tables: np.ndarray,
    num_heads: int, num_kv_heads: int, head_dim: int, tuning: VarlenTuning,
) -> KernelPlan:
    """Tile shape for this step's longest chunk, the work list of its chunks, the decode rows, and their upload."""
    q_lens = np.diff(starts)
    chunked = q_lens > 1
    longest = int(q_lens[chunked].max()) if chunked.any() else 2
    group, budget = num_heads // num_kv_heads, SHARED_BYTES[dialect]
    mma_kv_tile = mma_kv_tile_for(dialect, group, head_dim, tuning)
    if mma_kv_tile is not None:
        shape = mma_tile_shape(group, head_dim, budget, tuning)
    else:
        shape = tile_shape_for(group, head_dim, longest, budget, tuning)
    work = work_list(starts, lengths, shape.q_tokens, num_heads // shape.heads_per_tile, tuning)
    split = work.split_rows.shape[0] > 0
    return KernelPlan(
        shape=shape, tuning=tuning, work=work, mma_kv_tile=mma_kv_tile, units=mx.array(work.units),
        split_rows=mx.array(work.split_rows) if split else None,
        split_query_rows=mx.array(work.split_rows[:, 0]) if split else None,
        dims=mx.array([max(tables.shape[1], 1)], dtype=mx.int32),
        decode=decode_rows(starts, lengths, tables, num_heads, num_kv_heads, head_dim, tuning.decode),
    )


def decode_rows(
    starts: np.ndarray, lengths: np.ndarray, tables: np.ndarray,
    num_heads: int, num_kv_heads: int, head_dim: int, tuning: KernelTuning,
) -> DecodeRows | None:
    """The q_len 1 sequences' rows, tables and lengths, and the decode kernel's split for them."""
    seqs = np.nonzero(np.diff(starts) == 1)[0]
    if seqs.size == 0:
        return None
    plan = plan_decode(int(seqs.size), num_heads, num_kv_heads, head_dim, int(lengths[seqs].max()), tuning)
    host_rows = starts[seqs].astype(np.int32)
    return DecodeRows(
        plan=plan, tuning=tuning, host_rows=host_rows, rows=mx.array(host_rows),
        block_tables=mx.array(np.ascontiguousarray(tables[seqs], dtype=np.int32)),
        context_lens=mx.array(lengths[seqs].astype(np.int32)),
        dims=mx.array(decode_dims(tables.shape[1], plan), dtype=mx.int32),
        every_row=seqs.size == int(starts[-1]),
    )


def shared_bytes(rows: int, kv_tile: int, head_dim: int, itemsize: int) -> int:
    """Threadgroup memory VARLEN_BODY declares: Q, K and V tiles (V rows padded 16 bytes) in the pool's dtype, weights in float32."""
    return itemsize * head_dim * (rows + kv_tile) + kv_tile * (itemsize * head_dim + 16) + 4 * kv_tile * rows


def kv_tile_for(rows: int, head_dim: int, itemsize: int, budget_bytes: int, tuning: VarlenTuning) -> int | None:
    """Widest key tile that fits: it divides the head dim (output dims split evenly over its lanes)."""
    for kv_tile in KV_TILES:
        if tuning.kv_tile is not None and kv_tile > tuning.kv_tile:
            continue
        if head_dim % kv_tile == 0 and threads_for(rows, kv_tile) <= MAX_THREADS \
                and shared_bytes(rows, kv_tile, head_dim, itemsize) <= budget_bytes:
            return kv_tile
    return None


def tile_shape_for(group: int, head_dim: int, longest_query: int, budget_bytes: int, tuning: VarlenTuning) -> TileShape:
    """The most query rows (tokens x heads of one KV group) for which both pool dtypes fit the budget.

    Heads of a GQA group come first (they share every K/V load); then tokens, no more than the
    step's longest chunk needs. Rows come in whole blocks of SUB, so tokens have a floor.
    """
    if head_dim % 8:
        raise UnsupportedAttentionShape(f"head_dim {head_dim} is not a multiple of 8 (16-byte loads of half rows)")
    for heads in (h for h in range(group, 0, -1) if group % h == 0):
        min_tokens = SUB // np.gcd(heads, SUB)
        tokens = max(min(tuning.max_query_tokens, max(tuning.max_rows // heads, 1), 1 << (longest_query - 1).bit_length()), min_tokens)
        while tokens >= min_tokens:
            tiles = [kv_tile_for(tokens * heads, head_dim, size, budget_bytes, tuning) for size in ITEMSIZES]
            if None not in tiles:
                return TileShape(tokens, heads, *tiles)
            tokens //= 2
    raise UnsupportedAttentionShape(f"head_dim {head_dim} leaves no shared memory for one query tile")


def mma_kv_tile_for(dialect: str, group: int, head_dim: int, tuning: VarlenTuning) -> int | None:
    """Key tile of the tensor-core body when it serves this model on this backend, else None."""
    if dialect != "cuda" or not tuning.tensor_cores or not mma_source.supports(head_dim):
        return None
    return mma_source.kv_tile_for(head_dim, SHARED_BYTES[dialect])


def mma_tile_shape(group: int, head_dim: int, budget_bytes: int, tuning: VarlenTuning) -> TileShape:
    """64 rows (four warps of 16) of as many heads of the GQA group as divide 64; float32 pools keep
    the SIMT body on the same rows, so its key tile for them is chosen as `tile_shape_for` would."""
    heads = int(np.gcd(group, mma_source.ROWS))
    wide = kv_tile_for(mma_source.ROWS, head_dim, 4, budget_bytes, tuning)
    if wide is None:
        raise UnsupportedAttentionShape(f"head_dim {head_dim} leaves no shared memory for a 64-row float32 tile")
    return TileShape(mma_source.ROWS // heads, heads, mma_source.kv_tile_for(head_dim, budget_bytes), wide)


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
    """Per tile of a chunk (q_len > 1; decode rows go to the decode kernel): its sequence, first packed
    query row, query count, first query's position, context end."""
    q_lens = np.diff(starts).astype(np.int64)
    per_seq = np.where(q_lens > 1, -(-q_lens // q_tokens), 0)
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

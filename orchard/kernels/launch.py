"""Launch planning and the host side of the compiled decode kernel, shared by Metal and CUDA.

The two backends differ only in how MLX compiles a kernel (`metal_kernel` or
`cuda_kernel`); sizes, template constants, grids and the split-K decision live here so
both launch the same kernel the same way.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from functools import cache

import mlx.core as mx
import numpy as np

from orchard.kernels import mma_decode_source, source
from orchard.kernels.errors import UnsupportedAttentionShape
from orchard.kernels.variants import PLAIN, LayerAttention, LayerInputs, layer_inputs

SUPPORTED_DTYPES = (mx.float16, mx.bfloat16, mx.float32)
WARP = 32
#: float32 words of shared memory the warps' partial outputs may take (16 KiB, half of Metal's 32 KiB)
SHARED_WORDS = 4096
MAX_HEADS_PER_TILE = 8

#: compile(name, input_names, output_names, header, body) -> an MLX custom-kernel callable
KernelCompiler = Callable[[str, list, list, str, str], Callable]


@dataclass(frozen=True)
class KernelTuning:
    """Knobs measured on the H200 (see docs/benchmarks.md); the defaults are the fastest found."""

    threads: int = 64
    unroll: int = 4
    partition_size: int = 8192  # tokens per threadgroup for long contexts
    # Small batches split their contexts down to this to fill the GPU, no further: a split costs a merge
    # launch and partial states, and on the H200 fewer, longer partitions won at every batch of 1 to 32
    # measured (B 1, T 32,768: 0.86-0.89x of dense SDPA against 1.14-1.35x with 512-token partitions;
    # docs/benchmarks.md, "Fewer, longer partitions for small batches").
    min_partition_size: int = 4096
    target_threadgroups: int = 256  # below this many, partitions shrink
    reduce_threads: int = 128
    max_per_lane: int = 8  # elements of a row per lane: more means fewer shuffles, more registers
    tensor_cores: bool = True  # CUDA, half pools: the MMA loop (orchard/kernels/mma_decode_source.py) where it applies
    pipelined: bool = True  # the MMA loop loads the next tile's K and V while this one computes
    # MMA loop, single-pass launches (one partition) of one head tile a threadgroup: registers bounded so this
    # many threadgroups fit an SM (None: the compiler's choice). Split launches, and threadgroups of several
    # head tiles, stay unbounded: there the bound measured slower, or was not measured.
    single_pass_register_blocks: int | None = 8
    # MMA loop: head tiles (a KV head's group of query heads) one threadgroup takes, one warp each, so that its
    # warps read the same pool blocks at once (a token's KV heads lie side by side in its block). On the H200,
    # B 64, four tiles a threadgroup took 0.72-0.74x of dense SDPA's time at T = 4,096 against 0.84-0.85x
    # with one; past 4,096 tokens a threadgroup they were even (32,768 in 8,192-token partitions) or slower
    # (8,192 in one pass), and grids of 32 threadgroups were slower in all but one row (docs/benchmarks.md,
    # "Several KV heads a threadgroup"). Outside those bounds a threadgroup keeps one tile of `threads`.
    mma_tiles_per_threadgroup: int = 4
    mma_tile_threads: int = 32
    mma_min_threadgroups: int = 128
    mma_max_span: int = 4096

    def register_blocks(self, partitioned: bool) -> int | None:
        return None if partitioned else self.single_pass_register_blocks


@dataclass(frozen=True)
class DecodePlan:
    lanes: int  # threads sharing one token's row
    heads_per_tile: int  # query heads of one KV group handled by one threadgroup
    partition_size: int  # tokens one threadgroup reads
    num_partitions: int  # 1 means a single pass without the merge kernel
    span: int  # the most tokens one threadgroup reads: the partition, or a shorter longest context

    @property
    def partitioned(self) -> bool:
        return self.num_partitions > 1


def lanes_for(head_dim: int, max_per_lane: int = 8) -> int:
    """Fewest lanes (a power of two up to a warp) that split a row into at most max_per_lane elements."""
    lanes = 1
    while lanes <= WARP:
        if head_dim % lanes == 0 and head_dim // lanes <= max_per_lane:
            return lanes
        lanes *= 2
    raise UnsupportedAttentionShape(f"head_dim {head_dim} cannot be split over a power-of-two number of lanes")


def heads_per_tile_for(group: int, head_dim: int, threads: int) -> int:
    """Largest divisor of the GQA group whose per-warp partial outputs fit the shared-memory budget."""
    budget = SHARED_WORDS // ((threads // WARP) * head_dim)
    best = max((h for h in range(1, group + 1) if group % h == 0 and h <= min(budget, MAX_HEADS_PER_TILE)), default=0)
    if best == 0:
        raise UnsupportedAttentionShape(f"head_dim {head_dim} leaves no shared memory for {threads} threads")
    return best


def plan_decode(
    num_seqs: int, num_heads: int, num_kv_heads: int, head_dim: int, max_context: int, tuning: KernelTuning
) -> DecodePlan:
    """Split long contexts into partitions; halve the partition while the grid is too small to fill the GPU."""
    heads_per_tile = heads_per_tile_for(num_heads // num_kv_heads, head_dim, tuning.threads)
    groups = num_seqs * num_heads // heads_per_tile
    size = tuning.partition_size
    while size > tuning.min_partition_size and groups * -(-max_context // size) < tuning.target_threadgroups:
        size //= 2
    return DecodePlan(
        lanes=lanes_for(head_dim, tuning.max_per_lane),
        heads_per_tile=heads_per_tile,
        partition_size=size,
        num_partitions=max(-(-max_context // size), 1),
        span=min(size, max_context),
    )


def decode_dims(max_blocks: int, plan: DecodePlan) -> list[int]:
    """The decode kernels' int32 `dims` input: [max_blocks, num_partitions, partition_size].

    The partition size is read at run time, not baked in as a template constant: the planner
    picks it per step from the batch (4,096 or 8,192 tokens by default), and every constant value is one more
    NVRTC compile, measured at 1.8-4.4 s on the H200, landing mid-run on the first step that needs it.
    """
    return [max(max_blocks, 1), plan.num_partitions, plan.partition_size]


def context_bound(block_tables, context_lens, block_size: int) -> int:
    """Longest context, read from host metadata when it is there, else the block tables' capacity."""
    if isinstance(context_lens, np.ndarray) and context_lens.size:
        return int(context_lens.max())
    return block_tables.shape[1] * block_size


def as_device_ints(values) -> mx.array:
    array = values if isinstance(values, mx.array) else mx.array(np.asarray(values, dtype=np.int32))
    return array if array.dtype == mx.int32 else array.astype(mx.int32)


def threadgroup_shape(tuning: KernelTuning, tensor_cores: bool, head_tiles: int, num_seqs: int, plan: DecodePlan) -> tuple[int, int]:
    """(threads, head tiles) of one decode threadgroup: for the MMA loop, several tiles of one warp each where
    no threadgroup reads past `mma_max_span` tokens and the grid keeps `mma_min_threadgroups`; else one
    tile of `tuning.threads`."""
    per_group = tuning.mma_tiles_per_threadgroup
    if (not tensor_cores or per_group <= 1 or head_tiles % per_group or plan.span > tuning.mma_max_span
            or num_seqs * plan.num_partitions * (head_tiles // per_group) < tuning.mma_min_threadgroups):
        return tuning.threads, 1
    return tuning.mma_tile_threads * per_group, per_group


class PagedDecodeKernels:
    """The decode, split-K decode and merge kernels of one dialect, compiled once each."""

    def __init__(self, dialect: str, compile_kernel: KernelCompiler, tuning: KernelTuning = KernelTuning()):
        self.dialect = dialect
        self.compile_kernel = compile_kernel
        self.tuning = tuning

    @cache  # noqa: B019 -- one instance per dialect lives as long as the process
    def _decode_kernel(self, partitioned: bool, tensor_cores: bool = False, pipelined: bool = False,
                       threads: int = 64, register_blocks: int | None = None):
        if tensor_cores:
            header, body = mma_decode_source.render(partitioned, pipelined, threads, register_blocks)
        else:
            header, body = source.render_decode(self.dialect, partitioned)
        outputs = source.PARTITION_OUTPUTS if partitioned else source.SINGLE_OUTPUTS
        # MLX caches a kernel by its name and template, not its text: a bound kernel needs a name of its own
        bounded = f"_regs{threads}x{register_blocks}" if register_blocks else ""
        mode = ("_mma_pipelined" if pipelined else "_mma") + bounded if tensor_cores else ""
        name = "orchard_paged_decode" + mode + ("_split" if partitioned else "")
        return self.compile_kernel(name, source.DECODE_INPUTS, outputs, header, body)

    def uses_tensor_cores(self, plan: DecodePlan, tuning: KernelTuning, num_heads: int, num_kv_heads: int,
                          head_dim: int, dtype) -> bool:
        """Whether a launch runs the MMA loop: CUDA, asked for, and a shape it serves."""
        return (self.dialect == "cuda" and tuning.tensor_cores
                and mma_decode_source.supports(head_dim, num_heads // num_kv_heads, plan.heads_per_tile, dtype.size))

    @cache  # noqa: B019 -- one instance per dialect lives as long as the process
    def _reduce_kernel(self):
        header, body = source.render_reduce(self.dialect)
        return self.compile_kernel("orchard_paged_reduce", source.REDUCE_INPUTS, source.REDUCE_OUTPUTS, header, body)

    def __call__(self, queries, key_cache, value_cache, block_tables, context_lens, scale: float,
                 layer: LayerAttention = PLAIN) -> mx.array:
        num_seqs, num_heads, head_dim = queries.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        if key_cache.dtype not in SUPPORTED_DTYPES or value_cache.dtype != key_cache.dtype:
            raise UnsupportedAttentionShape(f"KV dtypes {key_cache.dtype}/{value_cache.dtype} are not supported")
        if num_seqs == 0:
            return mx.zeros(queries.shape, dtype=queries.dtype)
        tuning = self.tuning
        plan = plan_decode(num_seqs, num_heads, num_kv_heads, head_dim, context_bound(block_tables, context_lens, block_size), tuning)
        tables = as_device_ints(block_tables)
        dims = mx.array(decode_dims(tables.shape[1], plan), dtype=mx.int32)
        inputs = layer_inputs(num_heads, scale, layer)
        return self.launch(queries, key_cache, value_cache, tables, as_device_ints(context_lens), plan, tuning, dims, inputs)

    def launch(self, queries, key_cache, value_cache, tables, lengths, plan: DecodePlan, tuning: KernelTuning,
               dims: mx.array, layer: LayerInputs) -> mx.array:
        """Run a decode plan made beforehand (the varlen plan makes one per step for its decode rows)."""
        num_seqs, num_heads, head_dim = queries.shape
        _, block_size, num_kv_heads, _ = key_cache.shape
        inputs = [
            queries if queries.dtype == key_cache.dtype else queries.astype(key_cache.dtype), key_cache, value_cache, tables, lengths,
            layer.scale, dims, layer.window, layer.sinks,
        ]
        template = [
            ("T", key_cache.dtype), ("HEAD_DIM", head_dim), ("BLOCK_SIZE", block_size),
            ("NUM_KV_HEADS", num_kv_heads), ("GROUP", num_heads // num_kv_heads),
            ("HEADS_PER_TILE", plan.heads_per_tile), ("LANES", plan.lanes),
            ("UNROLL", tuning.unroll), *layer.template,
        ]
        tensor_cores = self.uses_tensor_cores(plan, tuning, num_heads, num_kv_heads, head_dim, key_cache.dtype)
        head_tiles = num_heads // plan.heads_per_tile
        threads, per_group = threadgroup_shape(tuning, tensor_cores, head_tiles, num_seqs, plan)
        template += [("NUM_THREADS", threads), ("TILES_PER_THREADGROUP", per_group)]
        grid = (plan.num_partitions * threads, head_tiles // per_group, num_seqs)
        bound = tuning.register_blocks(plan.partitioned) if tensor_cores and per_group == 1 else None
        kernel = self._decode_kernel(plan.partitioned, tensor_cores, tensor_cores and tuning.pipelined, threads, bound)
        if not plan.partitioned:
            (out,) = kernel(
                inputs=inputs, template=template, grid=grid, threadgroup=(threads, 1, 1),
                output_shapes=[queries.shape], output_dtypes=[key_cache.dtype],
            )
            return out if out.dtype == queries.dtype else out.astype(queries.dtype)
        states = (num_seqs, num_heads, plan.num_partitions)
        part_out, part_max, part_sum = kernel(
            inputs=inputs, template=template, grid=grid, threadgroup=(threads, 1, 1),
            output_shapes=[(*states, head_dim), states, states], output_dtypes=[mx.float32] * 3,
        )
        (out,) = self._reduce_kernel()(
            inputs=[part_out, part_max, part_sum, lengths, dims, layer.window, layer.sinks],
            template=[
                ("T", key_cache.dtype), ("HEAD_DIM", head_dim), ("NUM_HEADS", num_heads),
                ("NUM_THREADS", tuning.reduce_threads), *layer.template,
            ],
            grid=(num_heads * tuning.reduce_threads, num_seqs, 1), threadgroup=(tuning.reduce_threads, 1, 1),
            output_shapes=[queries.shape], output_dtypes=[key_cache.dtype],
        )
        return out if out.dtype == queries.dtype else out.astype(queries.dtype)

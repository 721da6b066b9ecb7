"""Host side of the compiled varlen kernel, shared by Metal and CUDA: compile once per shape, launch from a plan.

Everything that depends on the step's metadata is in the plan (orchard/kernels/plan.py); a call
here only picks the compiled variant for the plan's tile shape and the pool's dtype and
launches it, then the merge kernel when some tiles were split along their context, and
sends the step's decode rows through the decode kernel, scattering them back.
"""

from __future__ import annotations

from functools import cache

import mlx.core as mx

from orchard.kernels import mma_source, source
from orchard.kernels.errors import UnsupportedAttentionShape
from orchard.kernels.launch import SUPPORTED_DTYPES, KernelCompiler, PagedDecodeKernels
from orchard.kernels.plan import VarlenPlan
from orchard.kernels.variants import PLAIN, LayerAttention, LayerInputs


class PagedVarlenKernels:
    """The varlen kernel, its merge kernel and the decode kernels of one dialect, compiled once each."""

    def __init__(self, dialect: str, compile_kernel: KernelCompiler):
        self.dialect = dialect
        self.compile_kernel = compile_kernel
        self.decode_kernels = PagedDecodeKernels(dialect, compile_kernel)

    @cache  # noqa: B019 -- one instance per dialect lives as long as the process
    def _varlen_kernel(self):
        header, body = source.render_varlen(self.dialect)
        return self.compile_kernel("orchard_paged_varlen", source.VARLEN_INPUTS, source.VARLEN_OUTPUTS, header, body)

    @cache  # noqa: B019 -- one instance per dialect lives as long as the process
    def _mma_kernel(self):
        header, body = mma_source.render()
        return self.compile_kernel("orchard_paged_varlen_mma", source.VARLEN_INPUTS, source.VARLEN_OUTPUTS, header, body)

    @cache  # noqa: B019 -- one instance per dialect lives as long as the process
    def _merge_kernel(self):
        header, body = source.render_varlen_merge(self.dialect)
        return self.compile_kernel("orchard_paged_varlen_merge", source.VARLEN_MERGE_INPUTS, source.VARLEN_MERGE_OUTPUTS, header, body)

    def __call__(self, queries: mx.array, key_cache: mx.array, value_cache: mx.array, plan: VarlenPlan, scale: float,
                 layer: LayerAttention = PLAIN) -> mx.array:
        if key_cache.dtype not in SUPPORTED_DTYPES or value_cache.dtype != key_cache.dtype:
            raise UnsupportedAttentionShape(f"KV dtypes {key_cache.dtype}/{value_cache.dtype} are not supported")
        decode, inputs = plan.kernel.decode, plan.layer_inputs(scale, layer)
        if decode is not None and decode.every_row:
            out = self._decode(queries, key_cache, value_cache, plan, inputs)
        else:
            out = self._chunks(queries, key_cache, value_cache, plan, inputs)
            if decode is not None:
                out[decode.rows] = self._decode(queries[decode.rows], key_cache, value_cache, plan, inputs)
        return out if out.dtype == queries.dtype else out.astype(queries.dtype)

    def _decode(self, queries, key_cache, value_cache, plan: VarlenPlan, layer: LayerInputs) -> mx.array:
        rows = plan.kernel.decode
        return self.decode_kernels.launch(queries, key_cache, value_cache, rows.block_tables, rows.context_lens,
                                          rows.plan, rows.tuning, rows.dims, layer)

    def _chunks(self, queries, key_cache, value_cache, plan: VarlenPlan, layer: LayerInputs) -> mx.array:
        """The varlen kernel over the chunks' tiles, then the merge of split tiles; decode rows are left unwritten."""
        kernel = plan.kernel
        if kernel.num_units == 0:
            return mx.zeros(queries.shape, dtype=key_cache.dtype)
        shape, head_dim, itemsize = kernel.shape, plan.head_dim, key_cache.dtype.size
        tensor_cores = kernel.mma_kv_tile is not None and itemsize == 2
        if tensor_cores:
            compiled, threads, kv_tile = self._mma_kernel(), shape.rows // mma_source.ROWS_PER_WARP * 32, kernel.mma_kv_tile
        else:
            compiled, threads, kv_tile = self._varlen_kernel(), shape.threads_for(itemsize), shape.kv_tile_for(itemsize)
        template = [
            ("T", key_cache.dtype), ("HEAD_DIM", head_dim), ("BLOCK_SIZE", plan.block_size),
            ("NUM_KV_HEADS", plan.num_kv_heads), ("GROUP", plan.num_heads // plan.num_kv_heads),
            ("HEADS_PER_TILE", shape.heads_per_tile), ("Q_TOKENS", shape.q_tokens), ("KV_TILE", kv_tile),
            ("NUM_THREADS", threads), *layer.template,
        ]
        partial_rows = max(kernel.work.num_partial_rows, 1)
        out, part_out, part_max, part_sum = compiled(
            inputs=[
                queries if queries.dtype == key_cache.dtype else queries.astype(key_cache.dtype),
                key_cache, value_cache, plan.block_tables, kernel.units, layer.scale, kernel.dims, layer.window, layer.sinks,
            ],
            template=template,
            grid=(kernel.num_units * threads, plan.num_heads // shape.heads_per_tile, 1),
            threadgroup=(threads, 1, 1),
            output_shapes=[queries.shape, (partial_rows, plan.num_heads, head_dim), (partial_rows, plan.num_heads), (partial_rows, plan.num_heads)],
            output_dtypes=[key_cache.dtype, mx.float32, mx.float32, mx.float32],
        )
        if kernel.split_rows is not None:
            (merged,) = self._merge_kernel()(
                inputs=[part_out, part_max, part_sum, kernel.split_rows, layer.sinks],
                template=[("T", key_cache.dtype), ("HEAD_DIM", head_dim), ("NUM_HEADS", plan.num_heads),
                          ("NUM_THREADS", kernel.tuning.merge_threads), *layer.template],
                grid=(plan.num_heads * kernel.tuning.merge_threads, kernel.num_split_rows, 1),
                threadgroup=(kernel.tuning.merge_threads, 1, 1),
                output_shapes=[(kernel.num_split_rows, plan.num_heads, head_dim)], output_dtypes=[key_cache.dtype],
            )
            out[kernel.split_query_rows] = merged
        return out

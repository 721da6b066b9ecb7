"""Attention over a paged KV pool, and the writes that fill it.

Public API: `plan_varlen` + `paged_varlen_attention` (every step: packed prefill chunks
and decode rows, one plan per step shared by every layer), `paged_attention` (decode
only), `paged_prefill_attention` (the varlen pair in one call), `write_kv`,
`available_backends`, `default_backend`. Every attention entry takes a layer's sliding
`window`, `sinks` and `softcap` (orchard/kernels/variants.py) per call, so one plan serves layers
that differ. Backends are
"reference" (pure MLX ops, everywhere), "metal" (Apple GPUs), "cuda" (MLX on NVIDIA) and "cpu"
(MLX on the CPU, every query row read from the pool in place by an extension built with `make`,
orchard/kernels/cpu); pick one with `backend=` or the ORCHARD_ATTENTION_BACKEND environment variable.
"""

from __future__ import annotations

import mlx.core as mx

from orchard.kernels import reference
from orchard.kernels.backends import ENV_VAR, HOST_PLANNED, available_backends, default_backend, resolve_backend
from orchard.kernels.dispatch import backend_for_head_dims, check_head_dims, checked_decode_metadata, decode_function, varlen_function
from orchard.kernels.errors import (
    BackendUnavailable,
    InvalidAttentionMetadata,
    KernelError,
    UnknownBackend,
    UnsupportedAttentionShape,
)
from orchard.kernels.kv_write import SlotIndex, write_kv
from orchard.kernels.plan import VarlenPlan, VarlenTuning, check_varlen_metadata, plan_varlen
from orchard.kernels.variants import LayerAttention, layer_attention

__all__ = [
    "ENV_VAR",
    "HOST_PLANNED",
    "BackendUnavailable",
    "InvalidAttentionMetadata",
    "KernelError",
    "LayerAttention",
    "SlotIndex",
    "UnknownBackend",
    "UnsupportedAttentionShape",
    "VarlenPlan",
    "VarlenTuning",
    "available_backends",
    "backend_for_head_dims",
    "check_varlen_metadata",
    "default_backend",
    "paged_attention",
    "paged_prefill_attention",
    "paged_varlen_attention",
    "plan_varlen",
    "write_kv",
]


def paged_attention(
    queries: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables,
    context_lens,
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    softcap: float | None = None,
    backend: str | None = None,
) -> mx.array:
    """Decode: queries [num_seqs, num_heads, head_dim] against caches [num_blocks, block_size, num_kv_heads, head_dim].

    block_tables int32 [num_seqs, max_blocks] (padding entries point at the null block 0),
    context_lens int32 [num_seqs]. Returns [num_seqs, num_heads, head_dim] in the queries'
    dtype (the value cache's head dim where it differs, on the reference backend only); softmax
    runs in float32. `window` (keys seen, the query's own included), `sinks`
    ([num_heads] logits in the denominator only) and `softcap` as in orchard/kernels/variants.py.
    """
    tables, lengths = checked_decode_metadata(queries, key_cache, block_tables, context_lens)
    layer = layer_attention(window, softcap, sinks)
    layer.check_heads(queries.shape[1])
    name = resolve_backend(backend)
    check_head_dims(name, key_cache, value_cache)
    return decode_function(name)(queries, key_cache, value_cache, tables, lengths, scale, layer)


def paged_varlen_attention(
    queries: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    plan: VarlenPlan,
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    softcap: float | None = None,
    backend: str | None = None,
) -> mx.array:
    """Every query of a step (prefill chunks and decode rows, packed) over its sequence's paged context.

    queries [total_q, num_heads, head_dim]; caches [num_blocks, block_size, num_kv_heads, head_dim]
    (one layer); `plan` from `plan_varlen` for this step, built once and passed to every layer.
    Query j of sequence s sits at position context_lens[s] - q_len_s + j and sees positions up
    to its own (the last `window` of them when given). Returns [total_q, num_heads, head_dim] in
    the queries' dtype (the value cache's head dim where it differs, on the reference backend
    only); softmax in float32. The metadata was checked when the plan was built;
    here only shapes are compared. `window`, `sinks`, `softcap`: this layer's (orchard/kernels/variants.py).
    """
    if backend is not None and resolve_backend(backend) != plan.backend:
        raise InvalidAttentionMetadata(f"the plan was built for backend {plan.backend!r}, not {backend!r}")
    expected = (plan.total_q, plan.num_heads, plan.head_dim)
    if queries.shape != expected or key_cache.shape[1:] != (plan.block_size, plan.num_kv_heads, plan.head_dim):
        raise InvalidAttentionMetadata(
            f"the plan expects queries {expected} and caches [num_blocks, {plan.block_size}, {plan.num_kv_heads}, "
            f"{plan.head_dim}], got {queries.shape} and {key_cache.shape}"
        )
    if value_cache.shape[:3] != key_cache.shape[:3]:
        raise InvalidAttentionMetadata(f"caches differ in more than their head dim: {key_cache.shape} and {value_cache.shape}")
    check_head_dims(plan.backend, key_cache, value_cache)
    layer = layer_attention(window, softcap, sinks)
    layer.check_heads(plan.num_heads)
    if plan.backend == "reference":
        return reference.paged_varlen_reference(queries, key_cache, value_cache, plan.reference, scale, layer)
    return varlen_function(plan.backend)(queries, key_cache, value_cache, plan, scale, layer)


def paged_prefill_attention(
    queries: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables,
    query_start_loc,
    context_lens,
    *,
    scale: float,
    window: int | None = None,
    sinks: mx.array | None = None,
    softcap: float | None = None,
    backend: str | None = None,
) -> mx.array:
    """`plan_varlen` + `paged_varlen_attention` in one call, for callers with a single layer.

    queries [total_q, num_heads, head_dim]; query_start_loc int32 [num_seqs + 1];
    context_lens int32 [num_seqs] counts each sequence's tokens including this chunk.
    A model with many layers should build the plan once per step instead.
    """
    if queries.ndim != 3 or key_cache.ndim != 4 or queries.shape[2] != key_cache.shape[3]:
        raise InvalidAttentionMetadata(f"queries {queries.shape} do not fit a cache of shape {key_cache.shape}")
    plan = plan_varlen(
        query_start_loc, context_lens, block_tables, block_size=key_cache.shape[1], num_heads=queries.shape[1],
        num_kv_heads=key_cache.shape[2], head_dim=queries.shape[2], backend=backend, num_blocks=key_cache.shape[0],
    )
    if plan.total_q != queries.shape[0]:
        raise InvalidAttentionMetadata(f"query_start_loc must rise from 0 to total_q={queries.shape[0]}, ends at {plan.total_q}")
    return paged_varlen_attention(queries, key_cache, value_cache, plan, scale=scale, window=window, sinks=sinks, softcap=softcap)

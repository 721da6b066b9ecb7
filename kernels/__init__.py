"""Attention over a paged KV pool, and the writes that fill it.

Public API: `paged_attention` (decode), `paged_prefill_attention` (packed chunks mixed
with decode rows), `write_kv`, `available_backends`, `default_backend`. Backends are
"reference" (pure MLX ops, everywhere), "metal" (Apple GPUs) and "cuda" (MLX on NVIDIA);
pick one with `backend=` or the ORCHARD_ATTENTION_BACKEND environment variable.
"""

from __future__ import annotations

import mlx.core as mx

from kernels import reference
from kernels.dispatch import ENV_VAR, available_backends, checked_decode_metadata, decode_function, default_backend, resolve_backend
from kernels.errors import (
    BackendUnavailable,
    InvalidAttentionMetadata,
    KernelError,
    UnknownBackend,
    UnsupportedAttentionShape,
)
from kernels.kv_write import write_kv

__all__ = [
    "ENV_VAR",
    "BackendUnavailable",
    "InvalidAttentionMetadata",
    "KernelError",
    "UnknownBackend",
    "UnsupportedAttentionShape",
    "available_backends",
    "default_backend",
    "paged_attention",
    "paged_prefill_attention",
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
    backend: str | None = None,
) -> mx.array:
    """Decode: queries [num_seqs, num_heads, head_dim] against caches [num_blocks, block_size, num_kv_heads, head_dim].

    block_tables int32 [num_seqs, max_blocks] (padding entries point at the null block 0),
    context_lens int32 [num_seqs]. Returns [num_seqs, num_heads, head_dim] in the queries'
    dtype; softmax runs in float32.
    """
    tables, lengths = checked_decode_metadata(queries, key_cache, block_tables, context_lens)
    decode = decode_function(resolve_backend(backend))
    return decode(queries, key_cache, value_cache, tables, lengths, scale)


def paged_prefill_attention(
    queries: mx.array,
    key_cache: mx.array,
    value_cache: mx.array,
    block_tables,
    query_start_loc,
    context_lens,
    *,
    scale: float,
    backend: str | None = None,
) -> mx.array:
    """Packed new tokens of several sequences, each attending causally to its cache (chunk included).

    queries [total_q, num_heads, head_dim]; query_start_loc int32 [num_seqs + 1];
    context_lens int32 [num_seqs] counts each sequence's tokens including this chunk, so
    query j of sequence s sits at position context_lens[s] - q_len_s + j. Rows with
    q_len == 1 go through the backend's decode path in one batch.
    """
    decode = decode_function(resolve_backend(backend))
    return reference.paged_prefill_with(
        decode, queries, key_cache, value_cache, block_tables, query_start_loc, context_lens, scale
    )

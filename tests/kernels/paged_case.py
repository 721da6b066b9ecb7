"""Random paged-KV problems and a float64 numpy oracle, written without the package's MLX code.

Every pool slot that no sequence owns holds NaN (the null block 0 too), so any read of
an unused slot shows up in the output.
"""

from __future__ import annotations

from dataclasses import dataclass

import mlx.core as mx
import numpy as np

DTYPES = {"float32": mx.float32, "float16": mx.float16, "bfloat16": mx.bfloat16}
#: (relative, absolute) error allowed against the float64 oracle, by storage dtype.
TOLERANCE = {"float32": (1e-5, 1e-5), "float16": (1e-2, 1e-2), "bfloat16": (2e-2, 2e-2)}


@dataclass
class PagedCase:
    """One layer's pool, its owners' block tables and lengths, as MLX arrays and float64 copies."""

    key_cache: mx.array
    value_cache: mx.array
    keys64: np.ndarray  # [num_blocks, block_size, num_kv_heads, head_dim], NaN where unowned
    values64: np.ndarray  # as keys64, of the values' head dim
    block_tables: np.ndarray  # int32 [num_seqs, max_blocks], padded with block 0
    context_lens: np.ndarray  # int32 [num_seqs]

    @property
    def block_size(self) -> int:
        return self.keys64.shape[1]


def to_float64(array: mx.array) -> np.ndarray:
    return np.array(array.astype(mx.float32)).astype(np.float64)


def random_stored(rng: np.random.Generator, shape, dtype: str) -> mx.array:
    return mx.array(rng.standard_normal(shape).astype(np.float32)).astype(DTYPES[dtype])


def make_paged_case(
    rng: np.random.Generator,
    context_lens,
    num_kv_heads: int,
    head_dim: int,
    block_size: int,
    dtype: str,
    spare_blocks: int = 3,
    spare_columns: int = 2,
    value_head_dim: int | None = None,
) -> PagedCase:
    """Blocks handed out in shuffled order from 1..num_blocks-1, so tables are non-contiguous;
    values `value_head_dim` wide (DeepSeek-V2's are narrower than its keys), else as keys."""
    lengths = np.asarray(context_lens, dtype=np.int32)
    blocks_per_seq = -(-lengths // block_size)
    num_blocks = 1 + int(blocks_per_seq.sum()) + spare_blocks
    order = rng.permutation(np.arange(1, num_blocks, dtype=np.int32))
    tables = np.zeros((len(lengths), int(blocks_per_seq.max()) + spare_columns), dtype=np.int32)
    owned = np.zeros((num_blocks, block_size), dtype=bool)
    cursor = 0
    for seq, (length, count) in enumerate(zip(lengths, blocks_per_seq)):
        tables[seq, :count] = order[cursor:cursor + count]
        cursor += count
        for position in range(length):
            owned[tables[seq, position // block_size], position % block_size] = True
    shape = (num_blocks, block_size, num_kv_heads, head_dim)
    value_shape = (*shape[:3], value_head_dim or head_dim)
    poison = mx.array(np.where(owned, 0.0, np.nan).astype(np.float32))[:, :, None, None]
    key_cache = random_stored(rng, shape, dtype) + poison.astype(DTYPES[dtype])
    value_cache = random_stored(rng, value_shape, dtype) + poison.astype(DTYPES[dtype])
    mx.eval(key_cache, value_cache)
    return PagedCase(key_cache, value_cache, to_float64(key_cache), to_float64(value_cache), tables, lengths)


def sequence_kv(case: PagedCase, seq: int) -> tuple[np.ndarray, np.ndarray]:
    """[context_len, num_kv_heads, head_dim] keys and values of one sequence, walked block by block."""
    length = int(case.context_lens[seq])
    keys, values = [], []
    for position in range(length):
        block = case.block_tables[seq, position // case.block_size]
        keys.append(case.keys64[block, position % case.block_size])
        values.append(case.values64[block, position % case.block_size])
    return np.stack(keys), np.stack(values)


@dataclass(frozen=True)
class Rules:
    """A layer's window, sinks and soft cap, as the oracle applies them (written from their definitions)."""

    window: int | None = None  # the query at p sees keys (p - window, p]
    softcap: float | None = None  # scaled scores s -> softcap * tanh(s / softcap)
    sinks: np.ndarray | None = None  # [Hq] logits that join the denominator only

    def kwargs(self) -> dict:
        """The same rules as keyword arguments of the kernels' public entries."""
        sinks = None if self.sinks is None else mx.array(self.sinks.astype(np.float32))
        return dict(window=self.window, softcap=self.softcap, sinks=sinks)


PLAIN = Rules()


def oracle_attention(queries64: np.ndarray, keys: np.ndarray, values: np.ndarray, positions, scale: float,
                     rules: Rules = PLAIN) -> np.ndarray:
    """queries [n, Hq, D] at absolute `positions` see keys 0..position (the window's last ones); float64
    softmax; out [n, Hq, Dv] of the values' width."""
    num_heads, num_kv_heads = queries64.shape[1], keys.shape[1]
    kv_head = np.arange(num_heads) // (num_heads // num_kv_heads)
    k = keys[:, kv_head, :]  # [T, Hq, D]
    v = values[:, kv_head, :]
    out = np.empty((*queries64.shape[:2], values.shape[-1]))
    for row, position in enumerate(positions):
        first = 0 if rules.window is None else max(position + 1 - rules.window, 0)
        scores = np.einsum("hd,thd->ht", queries64[row], k[first: position + 1]) * scale
        if rules.softcap is not None:
            scores = rules.softcap * np.tanh(scores / rules.softcap)
        if rules.sinks is not None:
            scores = np.concatenate([scores, rules.sinks.astype(np.float64)[:, None]], axis=1)
        weights = np.exp(scores - scores.max(axis=1, keepdims=True))
        weights /= weights.sum(axis=1, keepdims=True)
        out[row] = np.einsum("ht,thd->hd", weights[:, : position + 1 - first], v[first: position + 1])
    return out


def oracle_decode(case: PagedCase, queries: mx.array, scale: float, rules: Rules = PLAIN) -> np.ndarray:
    q64 = to_float64(queries)
    rows = []
    for seq in range(len(case.context_lens)):
        keys, values = sequence_kv(case, seq)
        rows.append(oracle_attention(q64[seq:seq + 1], keys, values, [len(keys) - 1], scale, rules)[0])
    return np.stack(rows)


def oracle_prefill(case: PagedCase, queries: mx.array, query_start_loc: np.ndarray, scale: float,
                   rules: Rules = PLAIN) -> np.ndarray:
    q64 = to_float64(queries)
    out = np.empty((*q64.shape[:2], case.values64.shape[-1]))
    for seq in range(len(case.context_lens)):
        start, stop = int(query_start_loc[seq]), int(query_start_loc[seq + 1])
        if start == stop:
            continue
        keys, values = sequence_kv(case, seq)
        first = len(keys) - (stop - start)
        out[start:stop] = oracle_attention(q64[start:stop], keys, values, range(first, len(keys)), scale, rules)
    return out


def assert_close(actual: mx.array, expected: np.ndarray, dtype: str) -> None:
    got = to_float64(actual)
    assert got.shape == expected.shape
    assert np.isfinite(got).all(), "NaN or inf leaked into the output"
    rtol, atol = TOLERANCE[dtype]
    np.testing.assert_allclose(got, expected, rtol=rtol, atol=atol)

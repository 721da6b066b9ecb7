"""Varlen rows of `python -m orchard.cluster.bench.kernels`: one mixed or prefill step against dense SDPA over the same contexts.

A step's plan is built once before the clock (an engine builds it once per step and every
layer reuses it); its host time is reported on its own as "plan ms". The dense side is
MLX's SDPA over the same tokens laid out contiguously: one causal call for the chunks,
one for the decode rows. The reference row is the gather + SDPA path that mixed steps
took before the varlen kernel.
"""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass, replace

import mlx.core as mx
import numpy as np

from orchard import kernels
from orchard.cluster.bench.kernel_timing import Row, format_table, seconds_per_call_in_turn


@dataclass(frozen=True)
class VarlenProblem:
    """`chunks` prefill chunks of `chunk_len` ending at `chunk_context`, beside `decodes` rows at `decode_context`."""

    chunks: int
    chunk_len: int
    chunk_context: int
    decodes: int
    decode_context: int
    num_heads: int = 32
    num_kv_heads: int = 8
    head_dim: int = 128
    dtype: str = "float16"
    block_size: int = 16

    @property
    def q_lens(self) -> np.ndarray:
        return np.array([self.chunk_len] * self.chunks + [1] * self.decodes, dtype=np.int32)

    @property
    def context_lens(self) -> np.ndarray:
        return np.array([self.chunk_context] * self.chunks + [self.decode_context] * self.decodes, dtype=np.int32)

    @property
    def kv_bytes(self) -> int:
        itemsize = 4 if self.dtype == "float32" else 2
        return 2 * int(self.context_lens.sum()) * self.num_kv_heads * self.head_dim * itemsize

    def label(self) -> str:
        parts = []
        if self.chunks:
            parts.append(f"{self.chunks}x{self.chunk_len}@{self.chunk_context}")
        if self.decodes:
            parts.append(f"{self.decodes} dec@{self.decode_context}")
        return f"{' + '.join(parts)} Hq={self.num_heads} Hkv={self.num_kv_heads} D={self.head_dim} {self.dtype}"


@dataclass
class VarlenInputs:
    queries: mx.array
    key_cache: mx.array
    value_cache: mx.array
    starts: np.ndarray
    tables: np.ndarray
    dense_chunk: tuple | None  # (queries [B, Hq, L, D], keys, values)
    dense_decode: tuple | None


def build_varlen_inputs(problem: VarlenProblem, seed: int = 0) -> VarlenInputs:
    """A pool whose blocks are handed out shuffled, and the same tokens laid out densely per group."""
    dtype = getattr(mx, problem.dtype)
    lengths, q_lens = problem.context_lens, problem.q_lens
    blocks_per_seq = -(-int(lengths.max()) // problem.block_size)
    num_blocks = lengths.size * blocks_per_seq + 1
    rng = np.random.default_rng(seed)
    tables = (rng.permutation(num_blocks - 1) + 1).astype(np.int32).reshape(lengths.size, blocks_per_seq)
    shape = (num_blocks, problem.block_size, problem.num_kv_heads, problem.head_dim)
    key_cache, value_cache = mx.random.normal(shape).astype(dtype), mx.random.normal(shape).astype(dtype)
    starts = np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)
    queries = mx.random.normal((int(starts[-1]), problem.num_heads, problem.head_dim)).astype(dtype)

    def dense(seqs: np.ndarray, context: int, q_len: int):
        slots = (tables[seqs, :, None] * problem.block_size + np.arange(problem.block_size)).reshape(seqs.size, -1)[:, :context]
        rows = mx.array(slots)
        kv = [mx.contiguous(mx.take(c.reshape(-1, problem.num_kv_heads, problem.head_dim), rows, axis=0).transpose(0, 2, 1, 3))
              for c in (key_cache, value_cache)]
        q = queries[mx.array((starts[seqs][:, None] + np.arange(q_len)).reshape(-1))]
        return (mx.contiguous(q.reshape(seqs.size, q_len, problem.num_heads, problem.head_dim).transpose(0, 2, 1, 3)), *kv)

    chunk_seqs, decode_seqs = np.arange(problem.chunks), np.arange(problem.chunks, lengths.size)
    inputs = VarlenInputs(
        queries, key_cache, value_cache, starts, tables,
        dense(chunk_seqs, problem.chunk_context, problem.chunk_len) if problem.chunks else None,
        dense(decode_seqs, problem.decode_context, 1) if problem.decodes else None,
    )
    mx.eval(queries, key_cache, value_cache, *(inputs.dense_chunk or ()), *(inputs.dense_decode or ()))
    return inputs


def plan_for(problem: VarlenProblem, inputs: VarlenInputs, backend: str, tuning=None) -> kernels.VarlenPlan:
    return kernels.plan_varlen(
        inputs.starts, problem.context_lens, inputs.tables, block_size=problem.block_size, num_heads=problem.num_heads,
        num_kv_heads=problem.num_kv_heads, head_dim=problem.head_dim, backend=backend,
        num_blocks=inputs.key_cache.shape[0], tuning=tuning,
    )


def plan_ms(problem: VarlenProblem, inputs: VarlenInputs, backend: str, tuning=None, repeats: int = 5) -> float:
    """Host time of building one step's plan (validation, work list, uploads)."""
    samples = []
    for _ in range(repeats):
        start = time.perf_counter()
        plan_for(problem, inputs, backend, tuning)
        samples.append(time.perf_counter() - start)
    return statistics.median(samples) * 1e3


def dense_step(inputs: VarlenInputs, scale: float):
    outputs = []
    if inputs.dense_chunk is not None:
        outputs.append(mx.fast.scaled_dot_product_attention(*inputs.dense_chunk, scale=scale, mask="causal"))
    if inputs.dense_decode is not None:
        outputs.append(mx.fast.scaled_dot_product_attention(*inputs.dense_decode, scale=scale))
    return outputs


def measure_varlen(problem: VarlenProblem, backend: str, device: str, iters: int, copy_tb, tuning=None, label=None) -> Row:
    inputs = build_varlen_inputs(problem)
    scale = problem.head_dim ** -0.5
    step_plan = plan_for(problem, inputs, backend, tuning)

    def paged():
        return kernels.paged_varlen_attention(inputs.queries, inputs.key_cache, inputs.value_cache, step_plan, scale=scale)

    paged_s, dense_s = seconds_per_call_in_turn([paged, lambda: dense_step(inputs, scale)], iters)
    row = Row(device, label or f"varlen {backend}", problem.label(), paged_s * 1e3, dense_s * 1e3,
                    problem.kv_bytes / paged_s / 1e12, copy_tb, plan_ms(problem, inputs, backend, tuning))
    inputs = step_plan = None  # frees the arrays; the closures above are not called again
    print(format_table([row]).splitlines()[-1], flush=True)
    return row


def measure_decode_kernel(problem: VarlenProblem, iters: int, copy_tb) -> Row:
    """The decode-only kernel (`paged_attention`) on a decode-only problem, for comparison with the varlen rows."""
    inputs = build_varlen_inputs(problem)
    scale = problem.head_dim ** -0.5
    tables, lengths = mx.array(inputs.tables), mx.array(problem.context_lens)

    def paged():
        return kernels.paged_attention(inputs.queries, inputs.key_cache, inputs.value_cache, tables, lengths, scale=scale, backend="cuda")

    paged_s, dense_s = seconds_per_call_in_turn([paged, lambda: dense_step(inputs, scale)], iters)
    row = Row("gpu", "decode kernel cuda", problem.label(), paged_s * 1e3, dense_s * 1e3, problem.kv_bytes / paged_s / 1e12, copy_tb)
    print(format_table([row]).splitlines()[-1], flush=True)
    return row


MIXED = VarlenProblem(chunks=8, chunk_len=512, chunk_context=4096, decodes=56, decode_context=4096)
PREFILL = VarlenProblem(chunks=16, chunk_len=1024, chunk_context=1024, decodes=0, decode_context=1)
DECODE = VarlenProblem(chunks=0, chunk_len=1, chunk_context=1, decodes=64, decode_context=4096)


def cpu_rows() -> list[Row]:
    problem = VarlenProblem(chunks=2, chunk_len=128, chunk_context=512, decodes=6, decode_context=512,
                            num_heads=8, num_kv_heads=2, head_dim=64, dtype="float32")
    backends = [name for name in ("reference", "cpu") if name in kernels.available_backends()]
    with mx.stream(mx.cpu):
        return [measure_varlen(problem, backend, "cpu", iters=3, copy_tb=None) for backend in backends]


def cuda_rows(copy_tb: float) -> list[Row]:
    rows = []
    for head_dim in (128, 64):
        for problem, iters in ((MIXED, 10), (PREFILL, 10)):
            problem = replace(problem, head_dim=head_dim)
            rows.append(measure_varlen(problem, "cuda", "gpu", iters, copy_tb, label="varlen cuda mma"))
            rows.append(measure_varlen(problem, "cuda", "gpu", iters, copy_tb, kernels.VarlenTuning(tensor_cores=False), "varlen cuda simt"))
            rows.append(measure_varlen(problem, "reference", "gpu", 3, copy_tb))
    rows.append(measure_varlen(DECODE, "cuda", "gpu", 20, copy_tb))
    rows.append(measure_decode_kernel(DECODE, 20, copy_tb))
    return rows


def sweep_rows(copy_tb: float) -> list[Row]:
    """The varlen kernel's knobs on the mixed and prefill steps (D=128)."""
    rows = []
    variants = [dict(kv_tile=k, max_rows=r) for k in (8, 16, 32) for r in (16, 32, 64)]
    variants += [dict(partition_size=1024), dict(partition_size=2048), dict(target_threadgroups=4096)]
    for problem in (MIXED, PREFILL, DECODE):
        for variant in variants:
            label = "varlen " + " ".join(f"{k.split('_')[0][:5]}={v}" for k, v in variant.items())
            rows.append(measure_varlen(problem, "cuda", "gpu", 10, copy_tb, kernels.VarlenTuning(**variant), label))
    return rows

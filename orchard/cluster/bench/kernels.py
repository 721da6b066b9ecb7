"""`python -m orchard.cluster.bench.kernels`: paged attention against dense SDPA over the same tokens, one table.

`--only varlen` runs only the mixed-step rows (orchard/cluster/bench/kernels_varlen.py): the varlen
kernel on a mixed step (8 chunks of 512 + 56 decodes at T=4096), a pure prefill
(16 x 1,024) and a decode-only batch, each against dense SDPA and the gather + SDPA path.

CPU: the reference backend's time over dense SDPA's (target: within 1.3x).
CUDA (when MLX has a CUDA device): the compiled kernel's KV read bandwidth (bytes of K
and V read / time) against a measured copy ceiling and against MLX's dense SDPA, at
B=64, Hq=32, Hkv=8, D=128, fp16, T = 512, 4096 and 32768. `--sweep` also times the
kernel's tuning knobs at T=4096 and 32768 (`--rounds N`: N times, in turn) and the same
kernel over other pool layouts (each sequence's blocks in order; 32-token blocks; one KV head).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
from dataclasses import asdict, dataclass

import mlx.core as mx
import numpy as np

from orchard import kernels
from orchard.cluster.bench import kernels_varlen
from orchard.cluster.bench.kernel_timing import Row, copy_ceiling_tb_per_s, format_table, seconds_per_call_in_turn
from orchard.kernels import backends, dispatch, launch


@dataclass(frozen=True)
class Problem:
    batch: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    context: int
    dtype: str
    block_size: int = 16
    ordered_blocks: bool = False  # a probe of the pool's layout: each sequence's blocks adjacent and in order

    @property
    def kv_bytes(self) -> int:
        itemsize = {"float16": 2, "bfloat16": 2, "float32": 4}[self.dtype]
        return 2 * self.batch * self.context * self.num_kv_heads * self.head_dim * itemsize

    def label(self) -> str:
        order = " ordered" if self.ordered_blocks else ""
        blocks = f" bs={self.block_size}" if self.block_size != 16 else ""
        return f"B={self.batch} Hq={self.num_heads} Hkv={self.num_kv_heads} D={self.head_dim} T={self.context} {self.dtype}{blocks}{order}"


@dataclass
class Inputs:
    queries: mx.array
    key_cache: mx.array
    value_cache: mx.array
    block_tables: mx.array
    context_lens: mx.array
    dense_queries: mx.array
    dense_keys: mx.array
    dense_values: mx.array


def build_inputs(problem: Problem, seed: int = 0) -> Inputs:
    """A pool whose blocks are handed out shuffled (or in order), and the same tokens laid out densely."""
    dtype = getattr(mx, problem.dtype)
    blocks_per_seq = -(-problem.context // problem.block_size)
    num_blocks = problem.batch * blocks_per_seq + 1
    rng = np.random.default_rng(seed)
    order = np.arange(num_blocks - 1) if problem.ordered_blocks else rng.permutation(num_blocks - 1)
    tables = (order + 1).astype(np.int32).reshape(problem.batch, blocks_per_seq)
    shape = (num_blocks, problem.block_size, problem.num_kv_heads, problem.head_dim)
    key_cache = mx.random.normal(shape).astype(dtype)
    value_cache = mx.random.normal(shape).astype(dtype)
    queries = mx.random.normal((problem.batch, problem.num_heads, problem.head_dim)).astype(dtype)
    lengths = np.full(problem.batch, problem.context, dtype=np.int32)
    slots = mx.array((tables[:, :, None] * problem.block_size + np.arange(problem.block_size)).reshape(problem.batch, -1)[:, : problem.context])

    def dense(cache):
        flat = cache.reshape(-1, problem.num_kv_heads, problem.head_dim)
        return mx.contiguous(mx.take(flat, slots, axis=0).transpose(0, 2, 1, 3))

    inputs = Inputs(
        queries, key_cache, value_cache, mx.array(tables), mx.array(lengths),
        queries[:, :, None, :], dense(key_cache), dense(value_cache),
    )
    mx.eval(*asdict(inputs).values())
    return inputs


def measure(problem: Problem, backend: str, device: str, iters: int, copy_tb: float | None, label: str | None = None) -> Row:
    inputs = build_inputs(problem)
    scale = problem.head_dim ** -0.5

    def paged():
        return kernels.paged_attention(
            inputs.queries, inputs.key_cache, inputs.value_cache, inputs.block_tables, inputs.context_lens,
            scale=scale, backend=backend,
        )

    def dense():
        return mx.fast.scaled_dot_product_attention(inputs.dense_queries, inputs.dense_keys, inputs.dense_values, scale=scale)

    paged_s, dense_s = seconds_per_call_in_turn([paged, dense], iters)
    if label is not None:  # a tuning of the sweep: it must still compute the same attention
        error = mx.abs(paged().astype(mx.float32) - dense()[:, :, 0, :].astype(mx.float32)).max().item()
        print(f"  {label}: largest difference from dense SDPA {error:.2e}", flush=True)
    inputs = None  # frees the arrays; the closures above are not called again
    row = Row(device, label or backend, problem.label(), paged_s * 1e3, dense_s * 1e3, problem.kv_bytes / paged_s / 1e12, copy_tb)
    print(format_table([row]).splitlines()[-1], flush=True)
    return row


def openblas_in_use() -> bool:
    return "openblas" in os.environ.get("LD_PRELOAD", "")


def cpu_rows() -> list[Row]:
    """The reference and, where it is built, the CPU kernel (orchard/kernels/cpu): a 7B-like layer at 2,048 tokens,
    and the demo model's layer at a serve load's batch and context (32 x 192)."""
    problems = [(Problem(batch=4, num_heads=32, num_kv_heads=8, head_dim=128, context=2048, dtype="float32"), 3),
                (Problem(batch=32, num_heads=4, num_kv_heads=2, head_dim=64, context=192, dtype="float32"), 50)]
    backends = [name for name in ("reference", "cpu") if name in kernels.available_backends()]
    with mx.stream(mx.cpu):
        return [measure(problem, backend, "cpu", iters=iters, copy_tb=None) for problem, iters in problems for backend in backends]


def cuda_rows(copy_tb: float) -> list[Row]:
    rows = []
    for context, batch, iters in ((512, 64, 50), (4096, 64, 20), (32768, 64, 20), (32768, 1, 50)):
        problem = Problem(batch=batch, num_heads=32, num_kv_heads=8, head_dim=128, context=context, dtype="float16")
        rows.append(measure(problem, "cuda", "gpu", iters, copy_tb))
        rows.append(measure(problem, "reference", "gpu", max(iters // 5, 2), copy_tb))
    return rows


#: tunings the sweep times beside the default: one KV head a threadgroup (two warps taking turns, the default
#: before 2026-12-04), two and eight a threadgroup, 16,384-token partitions, and the SIMT loop
SWEEP_VARIANTS = [dict(mma_tiles_per_threadgroup=1), dict(mma_tiles_per_threadgroup=2), dict(mma_tiles_per_threadgroup=8),
                  dict(partition_size=16384), dict(tensor_cores=False)]


def sweep_rows(context: int, iters: int, rounds: int = 1) -> list[Row]:
    """Time the default and each tuning of SWEEP_VARIANTS on the headline problem, `rounds` times in turn
    (the device's noise moves a row by a few per cent), then the layout probes."""
    rows = []
    default = dispatch.decode_function("cuda")
    problem = Problem(batch=64, num_heads=32, num_kv_heads=8, head_dim=128, context=context, dtype="float16")
    for variant in [{}, *SWEEP_VARIANTS] * rounds:
        default.tuning = launch.KernelTuning(**variant)
        label = "cuda " + (" ".join(f"{''.join(w[0] for w in k.split('_'))}={v}" for k, v in variant.items()) or "default")
        try:
            rows.append(measure(problem, "cuda", "gpu", iters, None, label=label))
        except Exception as error:  # a variant that does not compile is reported, and the sweep goes on
            print(f"  {label}: failed: {error}", flush=True)
    default.tuning = launch.KernelTuning()
    return rows + layout_probe_rows(context, iters)


def layout_probe_rows(context: int, iters: int) -> list[Row]:
    """The default kernel over the same bytes in other pool layouts: each sequence's blocks in order, blocks of
    32 tokens, and one KV head (B=512, Hq=4) so that a head's rows are adjacent. Against the headline row they say how much of the
    gap to dense SDPA is the pool's layout (256-byte rows 2 KiB apart, blocks scattered) and not the kernel."""
    probes = [Problem(64, 32, 8, 128, context, "float16", ordered_blocks=True), Problem(64, 32, 8, 128, context, "float16", 32),
              Problem(512, 4, 1, 128, context, "float16"), Problem(512, 4, 1, 128, context, "float16", ordered_blocks=True)]
    return [measure(p, "cuda", "gpu", iters, None, label="cuda layout probe") for p in probes]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchard.cluster.bench.kernels", description=__doc__.splitlines()[0])
    parser.add_argument("--sweep", action="store_true", help="also time the CUDA kernels' tuning knobs")
    parser.add_argument("--rounds", type=int, default=1, help="times the decode sweep goes over its tunings, in turn")
    parser.add_argument("--only", choices=["decode", "varlen"], help="only the decode rows or only the varlen (mixed-step) rows")
    parser.add_argument("--json", help="write the rows to this file as JSON")
    args = parser.parse_args(argv)

    decode, varlen = args.only in (None, "decode"), args.only in (None, "varlen")
    rows = (cpu_rows() if decode else []) + (kernels_varlen.cpu_rows() if varlen else [])
    if backends.cuda_available():
        copy_tb = copy_ceiling_tb_per_s()
        rows += (cuda_rows(copy_tb) if decode else []) + (kernels_varlen.cuda_rows(copy_tb) if varlen else [])
        if args.sweep:
            sweeps = sweep_rows(4096, 20, args.rounds) + sweep_rows(32768, 20, args.rounds) if decode else []
            rows += sweeps + (kernels_varlen.sweep_rows(copy_tb) if varlen else [])
    copy = next((r.copy_tb_per_s for r in rows if r.copy_tb_per_s), None)
    print(f"# mlx {mx.__version__}, {platform.machine()} {platform.system()}, OpenBLAS preloaded: {openblas_in_use()}"
          + (f", copy ceiling {copy:.2f} TB/s (read+write)" if copy else ""))
    print(format_table(rows))
    if args.json:
        with open(args.json, "w") as fh:
            json.dump([dict(asdict(r), ratio=r.ratio) for r in rows], fh, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

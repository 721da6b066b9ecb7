"""Q6: with no separate VRAM to manage, is a page table still worth it?

Three measurements on one workload of mixed lengths (lognormal, like chat traffic):

1. waste: KV slots allocated but never written, for paged blocks of 8..64 tokens against
   the simpler designs a UMA engine could use instead: one contiguous buffer per sequence
   sized to the maximum length, the same grown in 256-token steps (mlx-lm's `KVCache`),
   and a batch padded to its longest member (mlx-lm's `BatchKVCache`);
2. concurrency at a fixed KV budget: how many of the workload's sequences fit at once,
   paged (counted by the real `BlockManager`, prefix sharing included) against the
   contiguous designs, with and without a shared system prompt;
3. attention speed: the paged decode kernel that runs here (`kernels.paged_attention`,
   reference backend) against MLX's dense SDPA over the same tokens laid out contiguously.

    python -m experiments.paged_vs_contiguous [--budget-mib 256] [--contexts 256,1024,4096]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from experiments.common import markdown_table, median_time, print_header, save_results
from experiments.models import DEMO_LARGE
from orchard import kernels
from orchard.kvcache import BlockManager, OutOfBlocks, root_hash

MAX_LEN = 2048
GROWTH_STEP = 256  # mlx_lm.models.cache.KVCache.step


def workload(n: int, seed: int = 0) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return np.clip(rng.lognormal(mean=6.0, sigma=1.0, size=n).astype(int), 16, MAX_LEN)


def waste_rows(lengths: np.ndarray, batch: int) -> list[list]:
    used = lengths.sum()

    def row(name, allocated):
        return [name, f"{100 * (allocated - used) / allocated:.1f} %", f"{allocated / used:.2f}x"]

    rows = [row(f"paged, block {bs}", (-(-lengths // bs) * bs).sum()) for bs in (8, 16, 32, 64)]
    rows.append(row(f"contiguous, grown in {GROWTH_STEP}-token steps (mlx-lm KVCache)",
                    (-(-lengths // GROWTH_STEP) * GROWTH_STEP).sum()))
    padded = sum(len(chunk) * chunk.max() for chunk in np.array_split(lengths, max(1, len(lengths) // batch)))
    rows.append(row(f"batch of {batch} padded to its longest (mlx-lm BatchKVCache)", padded))
    rows.append(row(f"contiguous, preallocated to max length {MAX_LEN}", len(lengths) * MAX_LEN))
    return rows


def paged_concurrency(lengths: np.ndarray, budget_tokens: int, prefix: list[int]) -> int:
    """Sequences the real BlockManager holds at once before OutOfBlocks, each at full length."""
    manager = BlockManager(budget_tokens // 16 + 1, 16, root_hash("exp/paged"), watermark=0.0)
    for i, n in enumerate(lengths):
        tokens = prefix + [(i * 100_003 + j) % 50_000 + 1 for j in range(int(n))]
        try:
            manager.allocate(i, tokens)
        except OutOfBlocks:
            return i
        manager.commit(i, tokens, len(tokens))
    return len(lengths)


def contiguous_concurrency(sizes: np.ndarray, budget_tokens: int) -> int:
    return int(np.searchsorted(np.cumsum(sizes), budget_tokens, side="right"))


def concurrency_rows(lengths: np.ndarray, budget_bytes: int, prefix_len: int) -> list[list]:
    budget_tokens = budget_bytes // DEMO_LARGE.kv_bytes_per_token
    rows = []
    for label, prefix in (("no shared prefix", []), (f"{prefix_len}-token shared system prompt", list(range(1, prefix_len + 1)))):
        full = lengths + len(prefix)
        rows.append([label, paged_concurrency(lengths, budget_tokens, prefix),
                     contiguous_concurrency(-(-full // GROWTH_STEP) * GROWTH_STEP, budget_tokens),
                     contiguous_concurrency(np.full(len(full), MAX_LEN + len(prefix)), budget_tokens)])
    return rows


def attention_rows(contexts: list[int], batch: int, repeats: int) -> list[list]:
    """Paged reference decode vs dense SDPA, Llama-3.1-8B head layout (32 q / 8 kv heads of 128), fp32."""
    rows = []
    rng = np.random.default_rng(0)
    for context in contexts:
        blocks_per_seq = context // 16
        num_blocks = batch * blocks_per_seq + 1
        tables = (rng.permutation(num_blocks - 1) + 1).astype(np.int32).reshape(batch, blocks_per_seq)
        k_cache = mx.random.normal((num_blocks, 16, 8, 128))
        v_cache = mx.random.normal((num_blocks, 16, 8, 128))
        queries = mx.random.normal((batch, 32, 128))
        lengths = np.full(batch, context, dtype=np.int32)
        slots = mx.array((tables[:, :, None] * 16 + np.arange(16)).reshape(batch, -1))
        dense_k = mx.contiguous(mx.take(k_cache.reshape(-1, 8, 128), slots, axis=0).transpose(0, 2, 1, 3))
        dense_v = mx.contiguous(mx.take(v_cache.reshape(-1, 8, 128), slots, axis=0).transpose(0, 2, 1, 3))
        mx.eval(k_cache, v_cache, queries, dense_k, dense_v)
        scale = 128 ** -0.5
        paged = median_time(lambda: mx.eval(kernels.paged_attention(queries, k_cache, v_cache, tables, lengths,
                                                                    scale=scale, backend="reference")), repeats)
        dense = median_time(lambda: mx.eval(mx.fast.scaled_dot_product_attention(queries[:, :, None], dense_k, dense_v,
                                                                                scale=scale)), repeats)
        out_p = kernels.paged_attention(queries, k_cache, v_cache, tables, lengths, scale=scale, backend="reference")
        out_d = mx.fast.scaled_dot_product_attention(queries[:, :, None], dense_k, dense_v, scale=scale)[:, :, 0]
        err = float(mx.abs(out_p - out_d).max())
        kv_mib = 2 * batch * context * 8 * 128 * 4 / 2**20
        rows.append([context, batch, f"{kv_mib:.0f}", f"{paged * 1e3:.2f}", f"{dense * 1e3:.2f}",
                     f"{paged / dense:.2f}x", f"{err:.1e}"])
        print(f"  context {context}: paged {paged * 1e3:.2f} ms, dense {dense * 1e3:.2f} ms", flush=True)
    return rows


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.paged_vs_contiguous", description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=2000)
    ap.add_argument("--batch", type=int, default=32, help="batch size for the padded-batch design")
    ap.add_argument("--budget-mib", type=int, default=256, help="KV budget for the concurrency rows (demo-large KV)")
    ap.add_argument("--prefix", type=int, default=512, help="shared system prompt length")
    ap.add_argument("--contexts", default="256,1024,4096")
    ap.add_argument("--attention-batch", type=int, default=4)
    ap.add_argument("--repeats", type=int, default=5)
    args = ap.parse_args(argv)
    print_header(__doc__.splitlines()[0])
    lengths = workload(args.sequences)
    print(f"workload: {len(lengths)} sequences, lognormal lengths, median {int(np.median(lengths))}, "
          f"mean {lengths.mean():.0f}, max {MAX_LEN}\n")
    waste = waste_rows(lengths, args.batch)
    print(markdown_table(["design", "allocated but unused", "allocated / used"], waste))
    conc = concurrency_rows(lengths, args.budget_mib << 20, args.prefix)
    print(f"\nsequences held at once in {args.budget_mib} MiB of KV ({DEMO_LARGE.name}, "
          f"{DEMO_LARGE.kv_bytes_per_token // 1024} KiB/token), each at its full length:")
    print(markdown_table(["workload", "paged (BlockManager, block 16)", f"contiguous, {GROWTH_STEP}-step growth",
                          f"contiguous, max length {MAX_LEN}"], conc))
    with mx.stream(mx.cpu):
        attn = attention_rows([int(c) for c in args.contexts.split(",")], args.attention_batch, args.repeats)
    print("\n" + markdown_table(["context", "batch", "KV MiB", "paged ms", "dense SDPA ms", "paged/dense", "max |diff|"], attn))
    save_results("paged_vs_contiguous", {"waste": waste, "concurrency": conc, "attention": attn, "args": vars(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

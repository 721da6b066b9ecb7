"""Q3: do block size and K/V layout change how well paged-attention reads use the caches?

The Apple GPU's system-level cache cannot be observed from Linux, so this times the
nearest analogue: the CPU's own L2/L3 under MLX's CPU backend. Each decode step gathers
every sequence's K and V through its block table (blocks scattered at random over a pool
twice the working set) and runs SDPA, repeated over the same KV, as a decode loop does.
The sweep covers block sizes 8/16/32/64, K and V in separate per-layer arrays (the
project's layout) against one array with each block's K and V side by side
(`[blocks, 2, block, heads, dim]`), and working sets below L2, below L3 and far above.

On a Mac, `--device gpu` runs the same sweep on the Metal GPU, whose reads go through the
system-level cache: that run is the one that answers the question for Apple Silicon.

    python -m experiments.cache_locality [--working-sets-mib 2,16,256] [--block-sizes 8,16,32,64] [--device cpu|gpu]
"""

from __future__ import annotations

import argparse
import os

import mlx.core as mx
import numpy as np

from experiments.common import best_time, gigabytes_per_s, markdown_table, new_figure, print_header, save_figure, save_results

HEADS_Q, HEADS_KV, HEAD_DIM = 32, 8, 128  # one layer of a Llama-3.1-8B-shaped model
LAYOUTS = ("separate", "interleaved", "dense")


def cpu_cache_sizes() -> dict[str, int]:
    """L2 and L3 sizes as the kernel reports them (per instance), for the plot's marks."""
    sizes = {}
    for index in range(8):
        base = f"/sys/devices/system/cpu/cpu0/cache/index{index}"
        if not os.path.exists(base):
            break
        level = open(f"{base}/level").read().strip()
        size = open(f"{base}/size").read().strip()
        if level in ("2", "3") and size.endswith("K"):
            sizes[f"L{level}"] = int(size[:-1]) * 1024
    return sizes


class PagedWorkload:
    """B sequences of T tokens whose blocks are scattered over a pool twice their size."""

    def __init__(self, batch: int, context: int, block_size: int, layout: str, dtype, seed: int = 0):
        rng = np.random.default_rng(seed)
        self.batch, self.context, self.block_size, self.layout = batch, context, block_size, layout
        blocks_per_seq = context // block_size
        num_blocks = 2 * batch * blocks_per_seq + 1
        tables = (rng.permutation(num_blocks - 1)[: batch * blocks_per_seq] + 1).reshape(batch, blocks_per_seq)
        positions = np.arange(context)
        slots = tables[:, positions // block_size] * block_size + positions % block_size  # [B, T]
        heads = np.arange(HEADS_KV)[None, :, None]
        shape = (num_blocks, block_size, HEADS_KV, HEAD_DIM)
        if layout == "interleaved":
            self.pool = mx.random.normal((num_blocks, 2, *shape[1:])).astype(dtype)
            block, offset = slots // block_size, slots % block_size
            base = (block * 2 * block_size + offset)[:, None, :]
            self.k_rows = mx.array(((base) * HEADS_KV + heads).astype(np.int32))
            self.v_rows = mx.array(((base + block_size) * HEADS_KV + heads).astype(np.int32))
            self.arrays = [self.pool]
        else:
            self.k_pool = mx.random.normal(shape).astype(dtype)
            self.v_pool = mx.random.normal(shape).astype(dtype)
            rows = (slots[:, None, :] * HEADS_KV + heads).astype(np.int32)
            self.k_rows = self.v_rows = mx.array(rows)
            self.arrays = [self.k_pool, self.v_pool]
        self.queries = mx.random.normal((batch, HEADS_Q, 1, HEAD_DIM)).astype(dtype)
        mx.eval(*self.arrays, self.queries, self.k_rows, self.v_rows)
        if layout == "dense":
            self.dense_k, self.dense_v = self._gather()
            mx.eval(self.dense_k, self.dense_v)

    def _gather(self):
        if self.layout == "interleaved":
            flat = self.pool.reshape(-1, HEAD_DIM)
            return mx.take(flat, self.k_rows, axis=0), mx.take(flat, self.v_rows, axis=0)
        return (mx.take(self.k_pool.reshape(-1, HEAD_DIM), self.k_rows, axis=0),
                mx.take(self.v_pool.reshape(-1, HEAD_DIM), self.v_rows, axis=0))

    def step(self) -> None:
        """Gather, then attention as two batched matmuls with the GQA group folded into the
        query rows, so each K/V row is read once per step (as the paged kernels do)."""
        keys, values = (self.dense_k, self.dense_v) if self.layout == "dense" else self._gather()
        group = HEADS_Q // HEADS_KV
        q = self.queries.reshape(self.batch, HEADS_KV, group, HEAD_DIM)
        scores = (q @ keys.swapaxes(-1, -2)) * HEAD_DIM ** -0.5
        mx.eval(mx.softmax(scores, axis=-1, precise=True) @ values)

    def gather_only(self) -> None:
        """Just the paged read: every K/V row of the step into a contiguous array."""
        if self.layout == "dense":
            mx.eval(self.dense_k + 0, self.dense_v + 0)
        else:
            mx.eval(*self._gather())

    @property
    def kv_bytes(self) -> int:
        return 2 * self.batch * self.context * HEADS_KV * HEAD_DIM * self.queries.itemsize


def shape_for(working_set: int, itemsize: int) -> tuple[int, int]:
    """(batch, context) whose K+V of one layer is about `working_set` bytes; context a multiple of 64."""
    per_token = 2 * HEADS_KV * HEAD_DIM * itemsize
    tokens = max(working_set // per_token, 64 * 4)
    batch = 4 if tokens <= 4096 else 8 if tokens <= 65536 else 16
    return batch, max(64, tokens // batch // 64 * 64)


def sweep(working_sets: list[int], block_sizes: list[int], dtype, repeats: int) -> list[dict]:
    rows = []
    itemsize = {mx.float32: 4, mx.float16: 2, mx.bfloat16: 2}[dtype]
    for ws in working_sets:
        batch, context = shape_for(ws, itemsize)
        for layout in LAYOUTS:
            for bs in (block_sizes if layout != "dense" else [block_sizes[0]]):
                work = PagedWorkload(batch, context, bs, layout, dtype)
                seconds = best_time(work.step, repeats=repeats, warmup=2)
                gather = best_time(work.gather_only, repeats=repeats, warmup=1)
                rows.append({"working_set": work.kv_bytes, "batch": batch, "context": context, "layout": layout,
                             "block_size": bs if layout != "dense" else None, "step_s": seconds,
                             "kv_gb_s": gigabytes_per_s(work.kv_bytes, seconds), "gather_s": gather,
                             "gather_gb_s": gigabytes_per_s(work.kv_bytes, gather)})
                print(f"  KV {work.kv_bytes / 2**20:7.1f} MiB  {layout:11s} block {bs:3d}: step "
                      f"{seconds * 1e3:8.2f} ms  {rows[-1]['kv_gb_s']:6.2f} GB/s; read alone "
                      f"{gather * 1e3:7.2f} ms {rows[-1]['gather_gb_s']:6.2f} GB/s", flush=True)
                del work
    return rows


def plot(rows: list[dict], caches: dict[str, int], key: str = "gather_gb_s", name: str = "cache_locality") -> str:
    fig, ax = new_figure()
    sets = sorted({r["working_set"] for r in rows})
    for layout, marker in (("separate", "o-"), ("interleaved", "s--")):
        for bs in sorted({r["block_size"] for r in rows if r["layout"] == layout}):
            pts = [next(r for r in rows if r["layout"] == layout and r["block_size"] == bs
                        and r["working_set"] == ws)[key] for ws in sets]
            ax.plot([ws / 2**20 for ws in sets], pts, marker, label=f"{layout}, block {bs}", alpha=0.8)
    dense = [next(r[key] for r in rows if r["layout"] == "dense" and r["working_set"] == ws) for ws in sets]
    ax.plot([ws / 2**20 for ws in sets], dense, "k^-", linewidth=2, label="dense (contiguous copy)")
    for name, size in caches.items():
        ax.axvline(size / 2**20, color="grey", linestyle=":")
        ax.text(size / 2**20, ax.get_ylim()[1] * 0.95, f" {name}", color="grey", fontsize=8, va="top")
    ax.set_xscale("log")
    ax.set_xlabel("K+V read per step (MiB, one layer)")
    ax.set_ylabel("KV read rate, paged gather (GB/s)")
    ax.set_title("Paged KV reads vs working set, block size, K/V layout (CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, ncol=2)
    return str(save_figure(fig, name))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.cache_locality", description=__doc__.splitlines()[0])
    ap.add_argument("--working-sets-mib", default="2,16,256")
    ap.add_argument("--block-sizes", default="8,16,32,64")
    ap.add_argument("--dtype", default="float32", choices=("float32", "float16", "bfloat16"))
    ap.add_argument("--repeats", type=int, default=5, help="best of this many steps")
    ap.add_argument("--device", default="cpu", choices=("cpu", "gpu"), help="gpu: Metal on a Mac (the SLC question)")
    args = ap.parse_args(argv)
    print_header(__doc__.splitlines()[0])
    caches = cpu_cache_sizes()
    print(f"# CPU caches (per instance): {', '.join(f'{k} {v >> 10} KiB' for k, v in caches.items())}")
    with mx.stream(mx.cpu if args.device == "cpu" else mx.gpu):
        rows = sweep([int(float(w) * 2**20) for w in args.working_sets_mib.split(",")],
                     [int(b) for b in args.block_sizes.split(",")], getattr(mx, args.dtype), args.repeats)
    table = []
    for ws in sorted({r["working_set"] for r in rows}):
        dense = next(r for r in rows if r["working_set"] == ws and r["layout"] == "dense")
        for r in (r for r in rows if r["working_set"] == ws):
            table.append([f"{ws / 2**20:.1f}", f"{r['batch']}x{r['context']}", r["layout"], r["block_size"] or "-",
                          f"{r['step_s'] * 1e3:.2f}", f"{r['kv_gb_s']:.2f}", f"{r['step_s'] / dense['step_s']:.2f}x",
                          f"{r['gather_gb_s']:.2f}"])
    print(markdown_table(["KV MiB", "B x T", "layout", "block", "step ms", "step KV GB/s", "step vs dense",
                          "read alone GB/s"], table))
    path = plot(rows, caches, name="cache_locality" if args.device == "cpu" else "cache_locality_gpu")
    save_results("cache_locality" if args.device == "cpu" else "cache_locality_gpu", {"rows": rows, "caches": caches, "plot": path, "dtype": args.dtype})
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

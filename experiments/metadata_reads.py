"""Q1: what do the scheduler's reads of block tables and KV metadata cost per step?

Block tables live on the host (Python lists in the block manager) and reach the kernels
as MLX arrays. On unified memory that hand-over is a memcpy into memory the GPU reads
directly (no DMA, no device-to-host copy to read it back). This script times, per decode
step of B sequences at a given context, every metadata read and conversion the engine
does, through the real objects:

1. bookkeeping: `KVCache.can_append` + `ensure_slots` + `commit` + `block_table` per sequence;
2. packing: `orchard.node.model.runner.pack_step` (positions, slot mapping, padded tables);
3. upload: `mx.array` of positions, slot mapping and tables (what `StepContext.build` does);
4. read-back of an evaluated MLX table: a copy (`np.array`) against a zero-copy view
   (`np.asarray(memoryview(a))`), which is what a scheduler could use on UMA.

With `--engine`, it also runs the engine on the demo model and reports the share of
step time spent outside the forward pass, for scale.

    python -m experiments.metadata_reads [--batches 1,8,32,128] [--context 1024] [--engine]
"""

from __future__ import annotations

import argparse

import mlx.core as mx
import numpy as np

from experiments.common import markdown_table, median_time, new_figure, print_header, save_figure, save_results
from orchard.kvcache import CacheConfig, KVCache
from orchard.kvcache.geometry import KVGeometry
from orchard.node.model.runner import SequenceChunk, pack_step

#: Bookkeeping does not depend on the KV shape, so the pool is as small as a pool can be.
TINY = KVGeometry("exp/metadata", num_layers=1, num_kv_heads=1, head_dim=8, block_size=16, dtype="float16")


class DecodingBatch:
    """B sequences of `context` tokens decoding one token per step, through KVCache."""

    def __init__(self, batch: int, context: int, steps: int):
        blocks = batch * (-(-(context + steps + 1) // TINY.block_size)) + 2
        self.kv = KVCache(TINY, CacheConfig(block_size=TINY.block_size, num_blocks=blocks, watermark=0.0))
        self.tokens = {f"s{i}": [(i * 7919 + j) % 30000 for j in range(context)] for i in range(batch)}
        for seq_id, tokens in self.tokens.items():
            self.kv.allocate(seq_id, tokens)
            self.kv.commit(seq_id, tokens, len(tokens))

    def bookkeeping(self) -> list[SequenceChunk]:
        """What the scheduler and engine read and update for one decode step."""
        chunks = []
        for seq_id, tokens in self.tokens.items():
            tokens.append(1)
            n = len(tokens)
            if not self.kv.can_append(seq_id, n):
                raise RuntimeError("pool too small")
            self.kv.ensure_slots(seq_id, n)
            chunks.append(SequenceChunk(tokens[-1:], n - 1, self.kv.block_table(seq_id)))
            self.kv.commit(seq_id, tokens, n)
        return chunks


def time_step_parts(batch: int, context: int, steps: int) -> dict:
    rig = DecodingBatch(batch, context, steps + 8)
    chunks = rig.bookkeeping()
    book = median_time(rig.bookkeeping, repeats=steps, warmup=2)
    pack = median_time(lambda: pack_step(chunks, TINY.block_size), repeats=steps)
    step = pack_step(chunks, TINY.block_size)

    def upload():
        arrays = [mx.array(np.asarray(step.positions, dtype=np.int32)),
                  mx.array(np.asarray(step.slot_mapping, dtype=np.int32)), mx.array(step.block_tables)]
        mx.eval(*arrays)

    up = median_time(upload, repeats=steps)
    device_table = mx.array(step.block_tables)
    mx.eval(device_table)
    copy_back = median_time(lambda: np.array(device_table), repeats=steps)
    view_back = median_time(lambda: np.asarray(memoryview(device_table)), repeats=steps)
    view = np.asarray(memoryview(device_table))
    return {"batch": batch, "context": context, "table_bytes": int(step.block_tables.nbytes),
            "bookkeeping_s": book, "pack_s": pack, "upload_s": up, "copy_back_s": copy_back,
            "view_back_s": view_back, "view_is_zero_copy": not view.flags["OWNDATA"],
            "view_matches": bool((view == step.block_tables).all())}


def engine_overhead(batch: int, prompt: int, steps: int) -> dict:
    """Share of engine step time outside the forward pass, demo model, `batch` decoding sequences."""
    from orchard.node.engine import EngineConfig, LLMEngine
    from orchard.node.model.demo import default_demo_model_path
    from orchard.node.types import SamplingParams

    engine = LLMEngine(EngineConfig(model=str(default_demo_model_path("large")), num_blocks=batch * (prompt + steps + 40) // 16 + 8,
                                    max_num_seqs=batch, max_num_batched_tokens=batch * prompt))
    params = SamplingParams(temperature=0.0, max_tokens=steps + 8, ignore_eos=True)
    for i in range(batch):
        engine.add_request(f"r{i}", [3 + (i * 31 + j) % 2000 for j in range(prompt)], params)
    while any(s.num_computed < s.num_prompt_tokens for s in engine.scheduler.running) or engine.scheduler.waiting:
        engine.step()
    engine.step()
    f0, s0 = engine.counters.forward_seconds, engine.counters.step_seconds
    for _ in range(steps):
        engine.step()
    forward = engine.counters.forward_seconds - f0
    total = engine.counters.step_seconds - s0
    return {"batch": batch, "prompt": prompt, "step_ms": total / steps * 1e3, "forward_ms": forward / steps * 1e3,
            "outside_forward_share": 1 - forward / total}


def plot(rows: list[dict], context: int) -> str:
    fig, ax = new_figure()
    batches = [r["batch"] for r in rows]
    bottom = np.zeros(len(rows))
    for key, label in (("bookkeeping_s", "block manager reads/updates"), ("pack_s", "pack_step (tables, slots)"),
                       ("upload_s", "mx.array upload (UMA memcpy)")):
        values = np.array([r[key] * 1e6 / r["batch"] for r in rows])
        ax.bar([str(b) for b in batches], values, bottom=bottom, label=label)
        bottom += values
    ax.set_xlabel("decoding sequences in the step")
    ax.set_ylabel("µs per sequence per step")
    ax.set_title(f"Metadata cost per decode step (context {context}, block 16)", fontsize=10)
    ax.legend(fontsize=8)
    ax.grid(True, axis="y", alpha=0.3)
    return str(save_figure(fig, "metadata_per_step"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.metadata_reads", description=__doc__.splitlines()[0])
    ap.add_argument("--batches", default="1,8,32,128")
    ap.add_argument("--context", type=int, default=1024)
    ap.add_argument("--steps", type=int, default=20)
    ap.add_argument("--engine", action="store_true", help="also time the demo-model engine's steps (slower)")
    args = ap.parse_args(argv)
    print_header(__doc__.splitlines()[0])
    rows = [time_step_parts(int(b), args.context, args.steps) for b in args.batches.split(",")]
    print(markdown_table(
        ["batch", "table KiB", "bookkeeping µs", "pack µs", "upload µs", "total µs/step", "µs/seq",
         "read back: copy µs", "read back: zero-copy view µs"],
        [[r["batch"], f"{r['table_bytes'] / 1024:.1f}", f"{r['bookkeeping_s'] * 1e6:.0f}", f"{r['pack_s'] * 1e6:.0f}",
          f"{r['upload_s'] * 1e6:.0f}", f"{(r['bookkeeping_s'] + r['pack_s'] + r['upload_s']) * 1e6:.0f}",
          f"{(r['bookkeeping_s'] + r['pack_s'] + r['upload_s']) * 1e6 / r['batch']:.1f}",
          f"{r['copy_back_s'] * 1e6:.1f}", f"{r['view_back_s'] * 1e6:.1f}"] for r in rows]))
    print(f"zero-copy view shares the array's memory: {all(r['view_is_zero_copy'] for r in rows)}; "
          f"values match: {all(r['view_matches'] for r in rows)}")
    result = {"rows": rows, "plot": plot(rows, args.context)}
    if args.engine:
        eng = [engine_overhead(b, 64, 12) for b in (8, 32)]
        print("\n" + markdown_table(["engine batch", "step ms", "forward ms", "outside forward"],
                                    [[e["batch"], f"{e['step_ms']:.1f}", f"{e['forward_ms']:.1f}",
                                      f"{e['outside_forward_share'] * 100:.1f} %"] for e in eng]))
        result["engine"] = eng
    save_results("metadata_reads", result)
    print(f"plot: {result['plot']}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

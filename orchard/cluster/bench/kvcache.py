"""KV-memory benchmark: `python -m orchard.cluster.bench.kvcache`.

Measures what the paged design is meant to buy: cheap block bookkeeping, little
wasted KV memory against contiguous preallocation, and a cold tier that restores a
prefix faster than the model can recompute it. Prints one table; with `--record` it also
rewrites docs/benchmarks.md's "## kvcache" section (only that section), never by default.
"""

from __future__ import annotations

import argparse
import datetime
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from orchard.kvcache.cold_tier import ColdTier, SlotLayout
from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.hashing import block_hashes, root_hash

SECTION = "## kvcache"
#: A Llama-3-8B-shaped block: 32 layers, 8 KV heads of 128, 16 tokens, bf16 = 2 MiB.
LLAMA8B_GEOMETRY = KVGeometry("bench/llama-3-8b-shape", 32, 8, 128, 16, "bfloat16")
#: The recompute model: mlx-lm's Llama with random weights, 8 layers, hidden 512.
SMALL_LLAMA = dict(model_type="llama", hidden_size=512, num_hidden_layers=8, intermediate_size=1408,
                   num_attention_heads=8, num_key_value_heads=4, rms_norm_eps=1e-5, vocab_size=32000)


@dataclass
class Row:
    metric: str
    value: str
    note: str = ""


# ---------------------------------------------------------------- block manager


def bench_block_manager(num_seqs: int, seed: int = 0) -> list[Row]:
    """Allocate then free `num_seqs` sequences: once with distinct prompts, once sharing a prefix."""
    try:
        from orchard.kvcache.block_manager import BlockManager
    except ImportError as err:
        return [Row("allocate/free ops/s", "skipped", f"orchard.kvcache.block_manager unavailable: {err}")]
    rng = np.random.default_rng(seed)
    lengths = rng.integers(64, 513, size=num_seqs)
    distinct = [list(range(i * 1000, i * 1000 + int(n))) for i, n in enumerate(lengths)]
    shared_prefix = list(range(10**7, 10**7 + 256))
    shared = [shared_prefix + list(range(i * 1000, i * 1000 + 64)) for i in range(num_seqs)]
    rows = []
    for label, prompts in (("distinct prompts", distinct), ("256-token shared prefix", shared)):
        ops_per_s, blocks = _time_allocate_free(BlockManager, prompts, warm_prefix=label != "distinct prompts")
        rows.append(Row(f"allocate+free ops/s ({label})", f"{ops_per_s:,.0f}",
                        f"ops = allocate or free calls; {num_seqs:,} sequences, {blocks:,} blocks, block 16"))
    return rows


def _time_allocate_free(manager_cls, prompts: list[list[int]], *, warm_prefix: bool) -> tuple[float, int]:
    block_size = 16
    total_blocks = sum(-(-len(p) // block_size) for p in prompts) + 2
    manager = manager_cls(total_blocks, block_size, root_hash("bench"), watermark=0.0)
    if warm_prefix:  # cache the shared prefix once, as a first request would
        manager.allocate("warm", prompts[0])
        manager.commit("warm", prompts[0], len(prompts[0]))
        manager.free("warm")
    start = time.perf_counter()
    for i, prompt in enumerate(prompts):
        manager.allocate(i, prompt)
    for i in range(len(prompts)):
        manager.free(i)
    elapsed = time.perf_counter() - start
    return 2 * len(prompts) / elapsed, total_blocks


# ---------------------------------------------------------------- waste


def bench_waste(num_seqs: int = 2000, block_size: int = 16, max_len: int = 2048, seed: int = 0) -> list[Row]:
    """KV slots allocated but never written, paged vs contiguous, on one mixed-length workload."""
    rng = np.random.default_rng(seed)
    lengths = np.clip(rng.lognormal(mean=6.0, sigma=1.0, size=num_seqs).astype(int), 1, max_len)
    paged, contiguous = waste_fractions(lengths, block_size, max_len)
    workload = f"{num_seqs} seqs, lognormal lengths (median {int(np.median(lengths))}, max {max_len})"
    return [
        Row("KV waste, paged", f"{100 * paged:.2f} %", f"{workload}, block {block_size}"),
        Row("KV waste, contiguous to max length", f"{100 * contiguous:.2f} %", workload),
    ]


def waste_fractions(lengths, block_size: int, max_len: int) -> tuple[float, float]:
    """(paged, contiguous) fraction of allocated KV slots that hold no token."""
    lengths = np.asarray(lengths, dtype=np.int64)
    paged_allocated = (-(-lengths // block_size) * block_size).sum()
    paged = (paged_allocated - lengths.sum()) / paged_allocated
    contiguous = (max_len - lengths).sum() / (max_len * len(lengths))
    return float(paged), float(contiguous)


# ---------------------------------------------------------------- cold tier


def bench_cold_restore(num_blocks: int, directory: Path) -> list[Row]:
    """Restore throughput of `num_blocks` Llama-8B-shaped blocks from the mmap file."""
    geometry = LLAMA8B_GEOMETRY
    keys = [f"block-{i}".encode() for i in range(num_blocks)]
    capacity = num_blocks * SlotLayout.for_geometry(geometry, 1 << 40).stride
    rng = np.random.default_rng(0)
    with ColdTier(directory, geometry, capacity) as tier:
        for key in keys:
            k, v = rng.integers(0, 1 << 16, size=(2, geometry.num_layers, *geometry.block_shape), dtype=np.uint16)
            tier.put(key, k, v, token_ids=list(range(16)), parent_hash=None)
        warm = _time_gets(tier, keys)
    dropped = _drop_page_cache(tier.path)
    with ColdTier(directory, geometry, capacity) as tier:
        cold = _time_gets(tier, keys)
    _drop_page_cache(tier.path)
    with ColdTier(directory, geometry, capacity) as tier:
        prefetched = _time_gets(tier, keys, prefetch=True)
    total = num_blocks * geometry.bytes_per_block
    size = f"{num_blocks} blocks x {geometry.bytes_per_block >> 20} MiB (32 layers, 8x128, bf16)"
    return [
        Row("cold-tier restore, page cache warm", f"{total / warm / 1e9:.2f} GB/s", size),
        Row("cold-tier restore, file pages dropped", f"{total / cold / 1e9:.2f} GB/s", f"{size}; {dropped}"),
        Row("cold-tier restore, pages dropped, prefetch first", f"{total / prefetched / 1e9:.2f} GB/s",
            "madvise(WILLNEED) on all slots, then get; timed together"),
    ]


def _time_gets(tier: ColdTier, keys: list[bytes], *, prefetch: bool = False) -> float:
    start = time.perf_counter()
    if prefetch:
        tier.prefetch(keys)
    for key in keys:
        if tier.get(key) is None:
            raise RuntimeError(f"cold tier lost {key!r}")
    return time.perf_counter() - start


def _drop_page_cache(path: Path) -> str:
    """Evict the closed file from the page cache without touching anyone else's pages."""
    if not hasattr(os, "posix_fadvise"):
        return "page cache not dropped (no posix_fadvise here)"
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    resident = _resident_bytes(path)
    left = "" if resident is None else f", {resident / 2**20:.1f} MiB still cached per fincore"
    return f"posix_fadvise(DONTNEED) after fsync{left}; a VM's host may still cache the disk"


def _resident_bytes(path: Path) -> int | None:
    """Bytes of `path` in the page cache, when util-linux's fincore is there to say."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=False)
    return int(out.stdout.split()[0]) if out.returncode == 0 and out.stdout.strip() else None


# ---------------------------------------------------------------- restore vs recompute


def bench_prefix_restore(directory: Path, prefix_tokens: int = 1024, repeats: int = 3) -> list[Row]:
    """Time a 1,024-token prefill against restoring the same KV from the cold tier into a pool."""
    import mlx.core as mx
    from mlx_lm.models import llama
    from mlx_lm.models.cache import make_prompt_cache

    from orchard.kvcache.pool import KVPool

    mx.random.seed(0)
    model = llama.Model(llama.ModelArgs(**SMALL_LLAMA))
    mx.eval(model.parameters())
    tokens = mx.array(np.random.default_rng(0).integers(0, SMALL_LLAMA["vocab_size"], prefix_tokens))[None]

    def prefill():
        cache = make_prompt_cache(model)
        mx.eval(model.model(tokens, cache=cache), *[c.state for c in cache])
        return cache

    prefill()  # warm-up
    recompute_s, cache = _best_of(repeats, prefill)
    geometry = KVGeometry("bench/small-llama", 8, 4, 64, 16, "float32")
    k_blocks, v_blocks = _cache_to_blocks(cache, geometry, prefix_tokens)
    hashes = block_hashes(np.asarray(tokens[0]).tolist(), geometry.block_size, root_hash(geometry.model_fingerprint))
    pool = KVPool(geometry, num_blocks=len(hashes) + 1)
    block_ids = list(range(1, len(hashes) + 1))
    capacity = len(hashes) * SlotLayout.for_geometry(geometry, 1 << 40).stride
    with ColdTier(directory, geometry, capacity) as tier:
        for i, h in enumerate(hashes):
            tier.put(h, k_blocks[:, i], v_blocks[:, i], list(range(16)), None)

        def restore():
            blocks = [tier.get(h) for h in hashes]
            pool.write_blocks(block_ids, np.stack([b.keys for b in blocks], 1), np.stack([b.values for b in blocks], 1))

        restore()
        restore_s, _ = _best_of(repeats, restore)
    got_k, _ = pool.read_blocks(block_ids)
    exact = "bit-exact" if got_k.tobytes() == k_blocks.tobytes() else "MISMATCH"
    model_note = "mlx-lm Llama, 8 layers, hidden 512, 8/4 heads, fp32, random weights"
    return [
        Row(f"recompute {prefix_tokens}-token prefix (prefill)", f"{recompute_s * 1e3:.1f} ms", model_note),
        Row(f"restore {prefix_tokens}-token prefix (cold get + pool write)", f"{restore_s * 1e3:.1f} ms",
            f"{len(hashes)} blocks, {len(hashes) * geometry.bytes_per_block >> 20} MiB, page cache warm, {exact}"),
        Row("restore speed-up over recompute", f"{recompute_s / restore_s:.1f} x", "best of 3 each"),
    ]


def _best_of(repeats: int, fn):
    import mlx.core as mx

    times, result = [], None
    for _ in range(repeats):
        start = time.perf_counter()
        result = fn()
        mx.synchronize()
        times.append(time.perf_counter() - start)
    return min(times), result


def _cache_to_blocks(cache, geometry: KVGeometry, n_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """mlx-lm's `[1, heads, T, dim]` per layer into `[layers, n_blocks, block, heads, dim]`."""
    n_blocks = n_tokens // geometry.block_size

    def blocks(arrays):
        stacked = np.stack([np.array(a[0, :, :n_tokens]) for a in arrays])  # [L, heads, T, dim]
        stacked = stacked.transpose(0, 2, 1, 3)  # [L, T, heads, dim]
        return np.ascontiguousarray(stacked.reshape(geometry.num_layers, n_blocks, *geometry.block_shape))

    return blocks([c.keys for c in cache]), blocks([c.values for c in cache])


# ---------------------------------------------------------------- report


def openblas_preloaded() -> bool:
    return "openblas" in os.environ.get("LD_PRELOAD", "").lower()


def machine_line() -> str:
    uname = " ".join(part for part in platform.uname() if part)
    load = os.getloadavg() if hasattr(os, "getloadavg") else ()
    loads = ", load average " + " ".join(f"{x:.2f}" for x in load) if load else ""
    return f"`{uname}`, {os.cpu_count()} cores{loads}"


def render(rows: list[Row]) -> None:
    from rich.console import Console
    from rich.table import Table

    table = Table(title="kvcache benchmark")
    for column in ("metric", "value", "note"):
        table.add_column(column)
    for row in rows:
        table.add_row(row.metric, row.value, row.note)
    console = Console()
    console.print(table)
    console.print(f"OpenBLAS preloaded: {openblas_preloaded()}   machine: {machine_line()}")


def markdown_section(rows: list[Row], command: str) -> str:
    lines = [
        SECTION,
        "",
        f"Measured {datetime.datetime.now().astimezone():%Y-%m-%d %H:%M %Z} with `{command}`.",
        f"Machine: {machine_line()}. OpenBLAS preloaded: {'yes' if openblas_preloaded() else 'no'}. "
        "Shared CPU: other processes ran at the same time.",
        "",
        "| metric | value | note |",
        "|---|---|---|",
        *(f"| {r.metric} | {r.value} | {r.note} |" for r in rows),
        "",
    ]
    return "\n".join(lines)


def write_section(path: Path, section: str) -> None:
    """Replace this benchmark's section of `path` (or append it), leaving other sections alone."""
    text = path.read_text() if path.exists() else "# Benchmarks\n"
    start = text.find(SECTION + "\n")
    if start < 0:
        text = text.rstrip("\n") + "\n\n" + section
    else:
        following = text.find("\n## ", start + len(SECTION))
        rest = text[following + 1 :] if following >= 0 else ""
        text = text[:start] + section + ("\n" + rest if rest else "")
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)


def command_line(argv: list[str] | None) -> str:
    args = sys.argv[1:] if argv is None else argv
    preload = os.environ.get("LD_PRELOAD")
    return (f"LD_PRELOAD={preload} " if preload else "") + " ".join([".venv/bin/python -m orchard.cluster.bench.kvcache", *args])


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m orchard.cluster.bench.kvcache", description=__doc__.splitlines()[0])
    parser.add_argument("--sequences", type=int, default=10_000, help="sequences to allocate and free")
    parser.add_argument("--cold-blocks", type=int, default=128, help="2 MiB blocks for the cold-tier restore")
    parser.add_argument("--no-recompute", action="store_true", help="skip the model prefill comparison")
    parser.add_argument("--record", type=Path, nargs="?", const=Path("docs/benchmarks.md"), default=None, metavar="FILE",
                        help="also rewrite the '## kvcache' section of FILE (default FILE: docs/benchmarks.md); "
                             "without it the figures are only printed")
    args = parser.parse_args(argv)
    directory = Path(tempfile.mkdtemp(prefix="kvcache-bench-"))
    try:
        rows = bench_block_manager(args.sequences) + bench_waste()
        rows += bench_cold_restore(args.cold_blocks, directory / "cold")
        if not args.no_recompute:
            rows += bench_prefix_restore(directory / "prefix")
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    render(rows)
    if args.record is not None:
        write_section(args.record, markdown_section(rows, command_line(argv)))
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Q8: could KV live on the SSD and be streamed in for every decode step?

A decode step reads every cached token's K and V in every layer, so a sequence whose
KV lives on disk needs `context x KV bytes per token` read per generated token. At a
read bandwidth BW the whole node can sustain at most

    tokens/s = BW / (context x KV bytes per token)

whatever the batch (sequences do not share KV beyond their common prefix). This script
measures BW here (sequential reads of a file whose pages were dropped, and the cold
tier's block reads), measures the demo model's decode rate with its KV in memory, and
tabulates the bound for public model shapes at the measured and published SSD speeds.

    python -m experiments.ssd_streaming [--file-mib 256] [--contexts 1024,4096,16384,32768]
"""

from __future__ import annotations

import argparse
import os
import tempfile
from pathlib import Path

import numpy as np

from experiments.cold_rig import ColdRig, random_prefix
from experiments.common import (
    drop_file_cache,
    gigabytes_per_s,
    markdown_table,
    new_figure,
    print_header,
    save_figure,
    save_results,
    timed,
)
from experiments.models import DEMO_LARGE, PUBLIC_SHAPES, decode_tokens_per_s, load_demo

#: Published figures (see docs/uma-kv-design.md for sources): internal SSD sequential reads of
#: recent Macs, and unified-memory bandwidth of the fastest single-die M4 part.
PUBLISHED_SSD_GB_S = {"Mac internal SSD, slow config (~2 GB/s)": 2.0, "Mac internal SSD, fast config (~6 GB/s)": 6.0}
M4_MAX_MEMORY_GB_S = 546.0


def sequential_read_gb_s(size: int, directory: Path) -> tuple[float, int | None]:
    """Read a file of `size` bytes front to back in 4 MiB reads after dropping its pages."""
    path = directory / "stream.bin"
    chunk = np.random.default_rng(0).integers(0, 255, size=4 << 20, dtype=np.uint8).tobytes()
    with open(path, "wb") as f:
        for _ in range(size // len(chunk)):
            f.write(chunk)
    resident = drop_file_cache(path)

    def read_all():
        fd = os.open(path, os.O_RDONLY)
        try:
            while os.read(fd, 4 << 20):
                pass
        finally:
            os.close(fd)

    seconds = timed(read_all)
    path.unlink()
    return gigabytes_per_s(size, seconds), resident


def cold_tier_read_gb_s(blocks: int) -> float:
    """`ColdTier.get` over Llama-3.1-8B-shaped blocks after the file's pages were dropped."""
    geometry = next(s for s in PUBLIC_SHAPES if s.name == "Llama-3.1-8B").geometry()
    prefix = random_prefix(geometry, blocks * geometry.block_size, seed=3)
    rig = ColdRig(geometry, [prefix])
    try:
        hashes = rig.kv.block_hashes(prefix.tokens)
        rig.drop_page_cache()
        seconds = timed(lambda: [rig.kv.cold.get(h) for h in hashes])
    finally:
        rig.close()
    return gigabytes_per_s(blocks * geometry.bytes_per_block, seconds)


def bound(bandwidth_gb_s: float, context: int, bytes_per_token: int) -> float:
    return bandwidth_gb_s * 1e9 / (context * bytes_per_token)


def plot(contexts: list[int], bandwidths: dict[str, float], measured_decode: list[tuple[int, float]]) -> str:
    fig, ax = new_figure(9.5, 4.6)
    shapes = [s for s in PUBLIC_SHAPES if s.name in ("Llama-3.1-8B", "Llama-3.1-70B")] + [DEMO_LARGE]
    colors = {"Llama-3.1-8B": "tab:blue", "Llama-3.1-70B": "tab:red", DEMO_LARGE.name: "tab:green"}
    styles = ["-", "--", ":", "-."]
    for shape in shapes:
        for style, (label, bw) in zip(styles, bandwidths.items()):
            ax.plot(contexts, [bound(bw, c, shape.kv_bytes_per_token) for c in contexts], style,
                    color=colors[shape.name], label=f"{shape.name}, {label}", alpha=0.85)
    ctx, rate = zip(*measured_decode)
    ax.plot(ctx, rate, "g*", markersize=12, label=f"{DEMO_LARGE.name} decode, KV in memory (measured)")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xlabel("context length (tokens)")
    ax.set_ylabel("tokens/s the KV stream allows (all sequences)")
    ax.set_title("Decode rate if every step streams the KV from disk")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return str(save_figure(fig, "ssd_streaming"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.ssd_streaming", description=__doc__.splitlines()[0])
    ap.add_argument("--file-mib", type=int, default=256, help="file size for the sequential read")
    ap.add_argument("--cold-blocks", type=int, default=64, help="2 MiB blocks for the cold-tier read")
    ap.add_argument("--contexts", default="1024,4096,16384,32768")
    ap.add_argument("--decode-contexts", default="256,1024", help="contexts for the demo model's measured decode")
    ap.add_argument("--decode-batch", type=int, default=2)
    args = ap.parse_args(argv)
    print_header(__doc__.splitlines()[0])
    directory = Path(tempfile.mkdtemp(prefix="uma-kv-ssd-"))
    try:
        seq_bw, resident = sequential_read_gb_s(args.file_mib << 20, directory)
    finally:
        directory.rmdir()
    tier_bw = cold_tier_read_gb_s(args.cold_blocks)
    print(f"sequential read, pages dropped: {seq_bw:.2f} GB/s (fincore resident after drop: {resident}); "
          f"cold-tier block reads, pages dropped: {tier_bw:.2f} GB/s")
    model = load_demo("large")
    decode = [(c, decode_tokens_per_s(model, args.decode_batch, c)) for c in map(int, args.decode_contexts.split(","))]
    for c, r in decode:
        kv_rate = r * c * DEMO_LARGE.kv_bytes_per_token / 1e9
        print(f"demo-large decode, batch {args.decode_batch}, context {c}: {r:.1f} tokens/s "
              f"(reads {kv_rate:.2f} GB/s of KV from memory); disk-streamed bound at {tier_bw:.2f} GB/s: "
              f"{bound(tier_bw, c, DEMO_LARGE.kv_bytes_per_token):.0f} tokens/s")
    bandwidths = {f"measured here, cold tier ({tier_bw:.1f} GB/s)": tier_bw, **PUBLISHED_SSD_GB_S,
                  f"M4 Max memory ({M4_MAX_MEMORY_GB_S:.0f} GB/s, KV only)": M4_MAX_MEMORY_GB_S}
    contexts = [int(c) for c in args.contexts.split(",")]
    rows = []
    for shape in (*PUBLIC_SHAPES, DEMO_LARGE):
        for label, bw in bandwidths.items():
            rows.append([shape.name, f"{shape.kv_bytes_per_token // 1024}", label,
                         *(f"{bound(bw, c, shape.kv_bytes_per_token):,.1f}" for c in contexts)])
    print(markdown_table(["model", "KV KiB/token", "bandwidth"] + [f"tok/s @ {c}" for c in contexts], rows))
    path = plot(sorted(set(contexts + [c for c, _ in decode])), bandwidths, decode)
    save_results("ssd_streaming", {"sequential_read_gb_s": seq_bw, "cold_tier_read_gb_s": tier_bw,
                                   "decode": decode, "rows": rows, "plot": path})
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

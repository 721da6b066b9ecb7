"""What the wire format's checksum costs a core, beside what the kernel's copy of the same bytes costs it.

Every byte a pull moves is checksummed twice, once at each end (xxh3_128, `orchard.kvcache.wire_transit`): the
sender hashes each batch just before the kernel copies it, the receiver each slice just after the kernel copied it.
Against raw TCP, each end's core then does its copy and a hash. This script times, on one core, the hash as the
link takes it (a running `xxh3_128` fed in the link's batch size) and a plain copy, each from the CPU's cache (one
buffer again and again) and from memory (consecutive slices of a region far larger than the caches).

On x86 the rate depends on which vector unit xxh3 runs on: xxhash 4.1 picks SSE2, AVX2 or AVX-512 at run time,
earlier wheels ran SSE2 alone. The header line says which xxhash and which units the CPU has.

A pull's bytes come in pieces: a layer's K or V of a chunk's blocks, or of each run of blocks reserved for it,
and the headers between them; each is one `update`. xxhash before 4.0 let the GIL go for every update, so a
thread hashing pieces waits for the GIL once a piece wherever another thread of the process wants it; 4.x keeps
it for 64 KiB or less. The second table hashes 8 MiB in pieces of each size alone, and beside a thread that
does what a link's thread does (a short system call, then a little Python, again and again).

    python -m experiments.checksum_rates [--sizes 524288,8388608] [--region-mib 1024] [--repeats 200]
                                         [--pieces 8192,32768,131072]

The numbers go to experiments/results/checksum_rates.json.
"""

from __future__ import annotations

import argparse
import socket
import statistics
import threading
from collections.abc import Callable
from pathlib import Path

import numpy as np
import xxhash

from experiments.common import markdown_table, median_time, print_header, save_results, timed
from orchard.node.serving.link_io import BATCH_BYTES


def stream_digest(view: memoryview, batch_bytes: int = BATCH_BYTES) -> bytes:
    """xxh3_128 of `view` fed `batch_bytes` at a time, as a link's end takes it."""
    digest = xxhash.xxh3_128()
    for start in range(0, len(view), batch_bytes):
        digest.update(view[start : start + batch_bytes])
    return digest.digest()


def vector_units() -> str:
    """The x86 vector units xxh3 may pick from, as /proc/cpuinfo lists them ('' elsewhere)."""
    cpuinfo = Path("/proc/cpuinfo")
    flags = set(cpuinfo.read_text().split()) if cpuinfo.exists() else set()
    return " ".join(unit for unit in ("sse2", "avx2", "avx512f") if unit in flags)


def _rates(work: Callable[[int], object], starts: list[int], size: int, repeats: int) -> tuple[float, float]:
    """Best and median bytes/s of `work(start)` over `repeats` calls, each at the next of `starts`."""
    work(starts[0])
    rates = [size / timed(lambda i=i: work(starts[i % len(starts)])) for i in range(repeats)]
    return max(rates), statistics.median(rates)


def measure(sizes: list[int], region_bytes: int, repeats: int) -> list[dict]:
    """One row a (size, from where, work): best and median bytes/s."""
    region = np.random.default_rng(0).integers(0, 256, region_bytes, dtype=np.uint8)
    target = np.zeros_like(region)
    source = memoryview(region)
    rows = []
    for size in sizes:
        works = {"xxh3_128, the link's batches": lambda start, size=size: stream_digest(source[start : start + size]),
                 "copy": lambda start, size=size: np.copyto(target[start : start + size], region[start : start + size])}
        for where, starts in (("cache", [0]), ("memory", list(range(0, region_bytes - size + 1, size)))):
            for name, work in works.items():
                best, median = _rates(work, starts, size, repeats)
                rows.append({"bytes": size, "from": where, "work": name, "best_Bps": best, "median_Bps": median})
    return rows


PIECES_BYTES = 8 << 20  # hashed in pieces, for the second table: a small model's 2,048-token pull


def pieces_rates(piece_bytes: int, repeats: int) -> tuple[float, float]:
    """Median bytes/s of hashing `PIECES_BYTES` in pieces of `piece_bytes`, one `update` each: alone, and beside
    a thread busy as a link's thread is."""
    data = np.random.default_rng(2).integers(0, 256, PIECES_BYTES, dtype=np.uint8)
    pieces = [memoryview(data)[i : i + piece_bytes] for i in range(0, PIECES_BYTES, piece_bytes)]

    def hash_pieces() -> bytes:
        digest = xxhash.xxh3_128()
        for piece in pieces:
            digest.update(piece)
        return digest.digest()

    alone = PIECES_BYTES / median_time(hash_pieces, repeats)
    stop = threading.Event()
    busy = threading.Thread(target=_busy_as_a_link, args=(stop,), daemon=True)
    busy.start()
    try:
        beside = PIECES_BYTES / median_time(hash_pieces, repeats)
    finally:
        stop.set()
        busy.join()
    return alone, beside


def _busy_as_a_link(stop: threading.Event) -> None:
    """A short system call (the GIL let go), then a little Python, until `stop`."""
    ours, theirs = socket.socketpair()
    with ours, theirs:
        while not stop.is_set():
            ours.send(b"x" * 64)
            theirs.recv(64)
            sum(range(200))


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default=f"{BATCH_BYTES},{8 << 20}", help="bytes a call, comma-separated")
    p.add_argument("--region-mib", type=int, default=1024)
    p.add_argument("--repeats", type=int, default=200)
    p.add_argument("--pieces", default="8192,32768,131072", help="piece sizes for the second table, comma-separated")
    args = p.parse_args(argv)
    print_header("the checksum's cost on one core, beside a copy")
    print(f"xxhash {xxhash.VERSION} (xxHash {xxhash.XXHASH_VERSION}); x86 vector units: {vector_units() or '-'}")
    rows = measure([int(s) for s in args.sizes.split(",")], args.region_mib << 20, args.repeats)
    print(markdown_table(["bytes", "from", "work", "best GB/s", "median GB/s"],
                         [[r["bytes"], r["from"], r["work"], f"{r['best_Bps'] / 1e9:.1f}", f"{r['median_Bps'] / 1e9:.1f}"]
                          for r in rows]))
    pieces = {int(size): pieces_rates(int(size), max(3, args.repeats // 10)) for size in args.pieces.split(",")}
    print(f"\n{PIECES_BYTES >> 20} MiB hashed in pieces, one update each (median GB/s):")
    print(markdown_table(["piece bytes", "alone", "beside a busy thread"],
                         [[size, f"{alone / 1e9:.1f}", f"{beside / 1e9:.1f}"] for size, (alone, beside) in pieces.items()]))
    save_results("checksum_rates", {"xxhash": xxhash.VERSION, "vector_units": vector_units(), "rows": rows,
                                    "pieces_Bps": {size: {"alone": a, "beside_busy": b} for size, (a, b) in pieces.items()}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

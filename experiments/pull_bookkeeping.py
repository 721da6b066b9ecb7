"""What a direct pull's bookkeeping costs at each end, with no byte moved: every call a pull makes on a pool,
timed alone on one thread for the small demo model's pool, with the caches warm and after they were cooled.

A pull's fixed costs include what both ends do to the pool's books for each block: the source pins the run and
reads each block's hash, parent and tokens (`KVCache.pin_layer_export`), cuts a chunk's rows from them
(`LayerRun.chunk`) and unpins the run once sent; the target reserves blocks (`KVCache.reserve_landing`), checks
and records each chunk as it lands (`BlockLanding.placing`, its KV not written here) and lists the run as cached
(`BlockLanding.adopt`). Inside a pull these calls run after the pull's own bytes went through the core (the
socket's copies, the checksum), which leave little else in its caches; each call here is timed twice: warm (the
same call just made) and right after `--cold-mib` MiB were copied from one buffer to another.

    python -m experiments.pull_bookkeeping [--tokens 2048] [--parts 2] [--repeats 300] [--cold-mib 16]

Prints one table of the median and the fastest tenth in microseconds a call, both ways; the numbers go to
experiments/results/pull_bookkeeping.json.
"""

from __future__ import annotations

import argparse
import functools
import statistics
from collections.abc import Callable

from experiments.common import markdown_table, print_header, save_results, timed
from experiments.kv_pull_profile import made_up_tokens


def _times(fn: Callable[..., object], repeats: int, setup: Callable[[], object] | None = None,
           teardown: Callable[[object], object] | None = None) -> tuple[float, float]:
    """(median, fastest tenth) microseconds of `fn(setup())` (or `fn()`); `setup`, `teardown(setup())` and the
    copy that cools the caches first (`cool`) untimed."""
    spent = []
    for _ in range(repeats + 5):
        args = (setup(),) if setup is not None else ()
        cool()
        spent.append(timed(functools.partial(fn, *args)))
        if teardown is not None:
            teardown(*args)
    spent = sorted(spent[5:])
    return statistics.median(spent) * 1e6, spent[len(spent) // 10] * 1e6


_COOL: list = []  # (from, to) buffers of `--cold-mib` each in the cooled pass, else none


def cool() -> None:
    """In the cooled pass, copy `--cold-mib` MiB from one buffer to another, as a pull's bytes pass through the
    core that then does its bookkeeping."""
    if _COOL:
        _COOL[1][...] = _COOL[0]


def _cache(num_blocks: int):
    """The KV cache of an engine of the small demo model, made as a node makes it by default."""
    from orchard.node.engine import EngineConfig, LLMEngine
    from orchard.node.model.demo import default_demo_model_path

    return LLMEngine(EngineConfig(model=str(default_demo_model_path("small")), block_size=16, num_blocks=num_blocks)).kv


def source_rows(kv, hashes: list[bytes], parts: int, repeats: int) -> list[tuple[str, float, float]]:
    """The source's calls for one part of `parts` (the run cut evenly), each pin finding the part's blocks
    free and each unpin freeing them, as between pulls."""
    part = hashes[: len(hashes) // parts]
    n = len(part)
    pinned: list[int] = []  # by the last pin

    def pin():
        pinned[:] = kv.pin_layer_export(part)[0]

    rows = [("pool views (`KVPool.layer_views`)", *_times(kv.pool.layer_views, repeats)),
            (f"pin {n} blocks and read them (`pin_layer_export`)", *_times(lambda _: pin(), repeats,
                                                                          lambda: pinned and kv.unpin_export(pinned)))]
    run = kv.pin_layer_export(part)[1]  # held twice now: its chunk does not read the block records
    rows.append((f"a chunk of {n} blocks' rows (`LayerRun.chunk`)", *_times(lambda: run.chunk(0, n), repeats)))
    kv.unpin_export(run.block_ids)
    kv.unpin_export(pinned)
    rows.append((f"unpin {n} blocks (`unpin_export`)", *_times(lambda _: kv.unpin_export(pinned), repeats, pin)))
    return rows


def target_rows(kv, tokens_len: int, parts: int, repeats: int) -> list[tuple[str, float, float]]:
    """The target's calls for a run of `tokens_len` tokens landed in `parts`, its KV not written: each landing
    a run of its own, as each pull is, so that none finds its blocks cached already."""
    runs = iter(range(1, 1 << 30))

    def reserved():
        hashes, chunks = _run(kv, tokens_len, parts, next(runs))
        return kv.transfer.reserve_landing(kv.root, hashes), chunks

    def place(landing, chunks):
        for (hashes, parents, tokens), part in zip(chunks, landing.parts([len(c[0]) for c in chunks])):
            with part.placing(hashes, parents, tokens):
                pass

    def landed():
        landing, chunks = reserved()
        place(landing, chunks)
        return landing

    n = tokens_len // kv.geometry.block_size
    return [
        (f"reserve {n} blocks (`reserve_landing`), released after", *_times(lambda r: r[0].release(), repeats, reserved)),
        (f"check and record {parts} chunks of {n // parts} blocks (`placing`, no KV written)",
         *_times(lambda r: place(*r), repeats, reserved, lambda r: r[0].release())),
        (f"list {n} landed blocks as cached (`BlockLanding.adopt`)", *_times(lambda landing: landing.adopt(), repeats, landed)),
        ("pool buffer addresses (`KVPool.buffer_addresses`)", *_times(kv.pool.buffer_addresses, repeats)),
        ("the cache's stats (`KVCache.stats`)", *_times(kv.stats, repeats)),
    ]


def _run(kv, tokens_len: int, parts: int, seed: int):
    """(hashes, each part's chunk as the wire has it: hash, parent and token rows) of a run of made-up tokens."""
    from orchard.kvcache.wire import hash_rows, token_rows

    bs = kv.geometry.block_size
    tokens = made_up_tokens(tokens_len, seed)
    hashes = [bytes(h) for h in kv.block_hashes(tokens)]
    parents = [kv.root, *hashes[:-1]]
    size = len(hashes) // parts
    chunks = [(hash_rows(hashes[i : i + size]), hash_rows(parents[i : i + size]),
               token_rows(tuple(tokens[j * bs : (j + 1) * bs]) for j in range(i, i + size)))
              for i in range(0, size * parts, size)]
    return hashes[: size * parts], chunks


def measure(tokens: int, parts: int, repeats: int, cold_mib: int) -> list[dict]:
    """A row a call: its end, its name and the median and fastest tenth µs warm, then cooled by `cold_mib`."""
    import numpy as np

    from orchard.cluster.bench.netns_node import seed_kv
    from orchard.node.heap import freeze_loaded_objects

    source, target = _cache(4 * tokens // 16), _cache(4 * tokens // 16)
    freeze_loaded_objects()  # as a node does once its engine is made
    hashes = seed_kv(source, made_up_tokens(tokens, 0), 1)
    passes = []
    for buffers in ([], [np.ones(cold_mib << 20, np.uint8), np.zeros(cold_mib << 20, np.uint8)]):
        _COOL[:] = buffers
        passes.append([("source", *row) for row in source_rows(source, hashes, parts, repeats)]
                      + [("target", *row) for row in target_rows(target, tokens, parts, repeats)])
    _COOL.clear()
    return [{"end": end, "call": call, "warm_median_us": wm, "warm_tenth_us": wt, "cold_median_us": cm, "cold_tenth_us": ct}
            for (end, call, wm, wt), (_, _, cm, ct) in zip(*passes)]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--tokens", type=int, default=2048, help="the run's tokens (the small model's 4 MiB a 1,024)")
    p.add_argument("--parts", type=int, default=2, help="the parts a pull spreads its run over (its connections)")
    p.add_argument("--repeats", type=int, default=300)
    p.add_argument("--cold-mib", type=int, default=16, help="MiB copied before each call of the cooled pass")
    args = p.parse_args()
    print_header(f"pull_bookkeeping --tokens {args.tokens} --parts {args.parts} --repeats {args.repeats} "
                 f"--cold-mib {args.cold_mib}")
    rows = measure(args.tokens, args.parts, args.repeats, args.cold_mib)
    print(markdown_table(["end", "call", "µs warm, median / fastest tenth", f"µs after {args.cold_mib} MiB copied"],
                         [(r["end"], r["call"], f"{r['warm_median_us']:.1f} / {r['warm_tenth_us']:.1f}",
                           f"{r['cold_median_us']:.1f} / {r['cold_tenth_us']:.1f}") for r in rows]))
    save_results("pull_bookkeeping", {"tokens": args.tokens, "parts": args.parts, "repeats": args.repeats,
                                      "cold_mib": args.cold_mib, "rows": rows})


if __name__ == "__main__":
    main()

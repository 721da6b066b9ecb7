"""Direct pulls with their blocks landed off the engine thread, against chunks imported on it, in turn.

While the target's engine steps, a pull's chunks land in pool blocks reserved for them, written by the
path's landing thread, and the engine thread caches the run once at the end
(`orchard.kvcache.block_landing`); while it idles, each chunk is imported on the engine thread as it
arrives. This forces each way in turn on one pair of processes, pulls alternating, on
loopback: the source in a child process, the target here, each with its engine thread and its direct
path, as `experiments/kv_pull_profile.py` sets them up. With `--busy N` the target decodes N sequences
all the while, as a serving node would, so its engine thread is in a step when chunks arrive.

    python -m experiments.kv_pull_landing [--size large] [--tokens 2048] [--repeats 6] [--busy 4]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import time

from experiments import kv_pull_profile as kp
from experiments.common import machine_line, print_header

PATHS = ("landed", "engine imports")


def _busy(loop, engine, sequences: int) -> None:
    """Keep `sequences` long greedy generations running on the target's engine (daemon: they end with it)."""
    from orchard.node.types import SamplingParams

    async def decode(request_id: str) -> None:
        prompt = [(j * 7 + 3) % 1500 + 20 for j in range(64 + len(request_id))]
        async for _ in engine.generate(request_id, prompt, SamplingParams(max_tokens=8000, temperature=0.0, ignore_eos=True)):
            pass

    for i in range(sequences):
        asyncio.run_coroutine_threadsafe(decode(f"busy-{i}"), loop)
    while engine.stats().get("running", 0) < sequences:  # the batch is running before the first pull
        time.sleep(0.05)


def _choose(path: str) -> None:
    """Make every pull take `path`, whether or not the target's engine is stepping (the product's rule
    lands only while it steps: `orchard.node.serving.direct_path.lands`)."""
    from orchard.node.serving import direct_path

    direct_path.lands = lambda engine: path == "landed"


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="large")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--repeats", type=int, default=6, help="pulls per path, after one of each to warm")
    p.add_argument("--busy", type=int, default=0, help="sequences the target decodes while it pulls")
    args = p.parse_args(argv)
    from orchard.cluster.bench.migration import tcp_throughput

    print_header(f"direct pulls, landed or imported ({args.size}, {args.tokens} tokens, target decoding {args.busy})")
    num_blocks = (2 * args.repeats + 4) * args.tokens // 16 + 256
    ours, source = kp.spawn_with_pipe(kp._source_main, args.size, num_blocks, 0.005, None)
    loop = kp.event_loop()
    engine = kp._engine(args.size, num_blocks)
    path = kp._path("dst", engine)
    address = ours.recv()
    tcp_Bps = tcp_throughput(256 << 20)
    _busy(loop, engine, args.busy)
    rates: dict[str, list[float]] = {name: [] for name in PATHS}
    seed = 2
    for round_ in range(args.repeats + 1):
        for name in PATHS:
            ours.send(("seed", (args.tokens, seed)))
            seed += 1
            hashes = ours.recv()
            _choose(name)
            result = kp._pull(loop, path, address, hashes)
            assert result.ok and result.imported == len(hashes), result
            if round_:
                rates[name].append(result.bytes_per_s)
    print(f"{result.bytes / 2**20:.1f} MiB a pull; raw TCP {tcp_Bps / 1e9:.2f} GB/s")
    for name, values in rates.items():
        print(f"  {name:>15}: best {max(values) / 1e9:.2f} GB/s ({100 * max(values) / tcp_Bps:.0f} %), "
              f"median {statistics.median(values) / 1e9:.2f} ({100 * statistics.median(values) / tcp_Bps:.0f} %)")
    print(machine_line())
    kp.stop(ours, source, path, engine)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

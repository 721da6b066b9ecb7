"""What lending an idle engine to a pull's threads is worth: direct pulls with it and without it, interleaved.

A direct pull (`orchard.node.serving.direct_path`) into an idle engine makes three calls on engines: the source
pins its run, the target closes the pull (lists its blocks as cached), the source unpins the run. Queued on an
idle engine thread, each call costs two thread wake-ups, and on two cores each wake-up waits for a core the
transfer's threads hold. Lent (`orchard.node.command_queue`), the idle engine runs the call on the thread that
makes it. Three modes, taken in turns over the same two processes:

- "queued": every call queued on the engine thread (how pulls ran before engines were lent);
- "lent": as built;
- "lent, listed as landed": lent, and the target's receive thread also lists each chunk's blocks as it lands,
  not all of them at the end (tried, not kept).

Raw TCP over the same loopback is read before and after the pulls. Each pull moves a fresh prefix.

    python -m experiments.kv_pull_lending [--size small] [--tokens 2048] [--rounds 6] [--pulls 12]

Prints a row a mode (best, 80th percentile, median GB/s); the numbers go to
experiments/results/kv_pull_lending.json, each mode's spread of pull rates to docs/img/kv_pull_lending.png
(for another size or prefix, kv_pull_lending_<size>_<tokens>.json and .png).
"""

from __future__ import annotations

import argparse
import statistics

from experiments import kv_pull_profile as kp
from experiments.common import markdown_table, new_figure, print_header, save_figure, save_results
from orchard.cluster.bench.migration import tcp_throughput
from orchard.node.async_engine import AsyncEngine
from orchard.node.serving import direct_path

MODES = ("queued", "lent", "lent, listed as landed")
_LENT = AsyncEngine.call_here_if_idle
_PLACED = direct_path._ChunkLander.placed


def _queued(engine, fn, settle, publish=False):
    engine.call_from_thread(fn, settle, publish)


def _listed_as_landed(sink, size):
    """`_ChunkLander.placed` listing every chunk's blocks as it lands, on the receive thread where the engine idles."""
    sink.result.bytes += size
    sink.engine.call_here_if_idle(lambda e: sink.landing.adopt_landed(), sink._listed)


def use(mode: str) -> None:
    """Make this process's pulls run as `mode` says."""
    AsyncEngine.call_here_if_idle = _queued if mode == "queued" else _LENT
    direct_path._ChunkLander.placed = _listed_as_landed if mode == "lent, listed as landed" else _PLACED


def _source(conn, size: str, num_blocks: int) -> None:
    """The source node: answers "mode" (switch), "seed" (a fresh prefix's hashes), "stop"."""
    kp.source_node(conn, size, num_blocks, _switch)


def _switch(command: str, mode: str) -> str:
    use(mode)
    return mode


def measure(size: str, tokens: int, rounds: int, pulls: int) -> dict:
    """{mode: [GB/s of each pull]} and raw TCP before and after, the modes taken in turns, `pulls` at a time."""
    num_blocks = (rounds * pulls * len(MODES) + 2) * tokens // 16 + 64
    tcp_before = tcp_throughput(256 << 20)
    ours, source, loop, engine, path, address = kp.pull_pair(_source, size, num_blocks)
    rates: dict[str, list[float]] = {mode: [] for mode in MODES}
    seed = 1
    try:
        for round_ in range(rounds):
            for mode in MODES:
                use(mode)
                ours.send(("mode", mode))
                ours.recv()
                for _ in range(pulls):
                    seed += 1
                    ours.send(("seed", (tokens, seed)))
                    hashes = ours.recv()
                    result = kp._pull(loop, path, address, hashes)
                    assert result.ok and result.imported == len(hashes), result
                    rates[mode].append(result.bytes_per_s / 1e9)
            print(f"round {round_ + 1}/{rounds}: " + ", ".join(
                f"{mode} median {statistics.median(r):.2f} GB/s" for mode, r in rates.items()), flush=True)
    finally:
        use("lent")
        kp.stop(ours, source, path, engine)
    return {"rates": rates, "tcp_GBps": [tcp_before / 1e9, tcp_throughput(256 << 20) / 1e9]}


def summary(rates: list[float]) -> dict:
    ordered = sorted(rates)
    return {"best": ordered[-1], "p80": ordered[int(0.8 * (len(ordered) - 1))], "median": statistics.median(ordered)}


def plot(rates: dict[str, list[float]], tcp: list[float], title: str, name: str):
    fig, ax = new_figure()
    for mode, values in rates.items():
        ordered = sorted(values)
        ax.plot(ordered, [(i + 1) / len(ordered) for i in range(len(ordered))], drawstyle="steps-post", label=mode)
    for gbps in tcp:
        ax.axvline(gbps / 2, color="grey", linestyle=":", linewidth=1)
    ax.set_xlabel("pull GB/s (dotted: half of raw TCP, before and after)")
    ax.set_ylabel("share of pulls at or below")
    ax.set_title(title, fontsize=9)
    ax.legend()
    return save_figure(fig, name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=6)
    p.add_argument("--pulls", type=int, default=12, help="pulls a mode takes in a row, each round")
    args = p.parse_args(argv)
    title = f"direct KV pulls, engine calls queued or lent ({args.size}, {args.tokens} tokens)"
    print_header(title)
    measured = measure(args.size, args.tokens, args.rounds, args.pulls)
    rows = {mode: summary(r) for mode, r in measured["rates"].items()}
    tcp = measured["tcp_GBps"]
    print(f"raw TCP {tcp[0]:.2f} GB/s before, {tcp[1]:.2f} after")
    print(markdown_table(["mode", "pulls", "best GB/s", "p80 GB/s", "median GB/s"],
                         [[mode, len(measured["rates"][mode]), *(f"{row[k]:.2f}" for k in ("best", "p80", "median"))]
                          for mode, row in rows.items()]))
    name = "kv_pull_lending" if (args.size, args.tokens) == ("small", 2048) else f"kv_pull_lending_{args.size}_{args.tokens}"
    save_results(name, {"size": args.size, "tokens": args.tokens, "rounds": args.rounds, "pulls": args.pulls,
                        "summary": rows, **measured})
    print(f"plot: {plot(measured['rates'], tcp, title, name)}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

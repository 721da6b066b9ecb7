"""Where a direct pull's time goes, in order: marks on both sides of each pull, read on a clock both share.

Two processes on loopback, as in `experiments.kv_pull_profile`: the source holds a prefix seeded by import, the
target pulls it over `orchard.node.serving.kv_link` as a node actor's `pull_blocks` does. A mark is the
`time.perf_counter` reading (CLOCK_MONOTONIC on Linux, which every process reads alike) taken as a function on
the pull's path starts or returns (`MARKS`). A mark reached more than once in a pull (a chunk sent, a chunk's
first bytes read; a request read, once a connection) is shown at its first and its last.

    python -m experiments.kv_pull_timeline [--size small] [--tokens 2048] [--pulls 100] [--connections N]
    python -m experiments.kv_pull_timeline --plot LABEL=OUTPUT ... [--plot-name NAME]

`--connections`: the connections each pull spreads its run over (`KVLinkConfig.connections_per_pull`; by default
as this machine's cores decide).

`--plot` draws runs printed before (their saved output, each with a label) into docs/img/<NAME>.png instead.

Prints each mark, in the order they come, in ms from the pull's start (`DirectPath.pull` entered): the median
over the fastest fifth of the pulls, and over all of them. The numbers go to
experiments/results/kv_pull_timeline.json (for another size or prefix, kv_pull_timeline_<size>_<tokens>.json).
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import importlib
import statistics
import time
from dataclasses import replace
from pathlib import Path

from experiments import kv_pull_profile as kp
from experiments.common import markdown_table, print_header, save_results

#: (side, label, module, attribute path, "start" or "end"): where a mark is taken.
MARKS = (
    ("target", "pull entered", "orchard.node.serving.direct_path", "DirectPath.pull", "start"),
    ("target", "request being sent", "orchard.node.serving.kv_link", "LinkStream.start", "start"),
    ("target", "receive loop running", "orchard.node.serving.kv_link", "LinkStream._receive", "start"),
    ("source", "request read", "orchard.node.serving.kv_link", "_read_request", "end"),
    ("source", "reply thread running", "orchard.node.serving.kv_link", "KVLinkServer._reply", "start"),
    ("source", "run pinned", "orchard.node.serving.direct_path", "DirectPath._export_layers", "end"),
    ("target", "lookup done", "orchard.node.serving.direct_path", "_plan", "end"),
    ("target", "blocks reserved", "orchard.node.serving.direct_path", "DirectPath._plan_and_take", "end"),
    ("source", "chunk sent", "orchard.node.serving.link_io", "send_payload", "start"),
    ("source", "batch being sent", "orchard.node.serving.link_io", "send_pieces", "start"),
    ("target", "chunk's size read", "orchard.node.serving.kv_link", "recv_exact", "end"),
    ("target", "chunk's first bytes read", "orchard.node.serving.kv_link", "LinkStream._receive_chunk", "start"),
    ("source", "reply ended", "orchard.node.serving.kv_link", "KVLinkServer._reply", "end"),
    ("target", "reply ended", "orchard.node.serving.kv_link", "LinkStream._finish", "start"),
    ("target", "blocks listed", "orchard.kvcache.block_landing", "BlockLanding.adopt", "end"),
    ("target", "pull returned", "orchard.node.serving.direct_path", "DirectPath.pull", "end"),
)
#: Marks reached more than once a pull: once a chunk or a batch, or once a connection.
REPEATED = {"chunk sent", "batch being sent", "chunk's size read", "chunk's first bytes read", "receive loop running",
            "request read", "reply thread running", "run pinned"}
START = "target: pull entered"

_marks: list[tuple[str, float]] = []  # (side: label, perf_counter) of this process, in the order taken


def install(side: str) -> None:
    """Wrap every function `MARKS` names for `side`, in this process, to take its marks."""
    for mark_side, label, module, path, when in MARKS:
        if mark_side != side:
            continue
        owner = importlib.import_module(module)
        *outer, name = path.split(".")
        for part in outer:
            owner = getattr(owner, part)
        setattr(owner, name, _marked(getattr(owner, name), f"{side}: {label}", when))


def take_mark(key: str) -> None:
    """The mark `key`, now, in this process."""
    _marks.append((key, time.perf_counter()))


def _marked(fn, key: str, when: str):
    """`fn` (a function or a coroutine function) taking the mark `key` as it starts or as it returns (`when`)."""
    def mark(at: str) -> None:
        if at == when:
            take_mark(key)

    if asyncio.iscoroutinefunction(fn):
        @functools.wraps(fn)
        async def marked_async(*args, **kwargs):
            mark("start")
            try:
                return await fn(*args, **kwargs)
            finally:
                mark("end")
        return marked_async

    @functools.wraps(fn)
    def marked(*args, **kwargs):
        mark("start")
        try:
            return fn(*args, **kwargs)
        finally:
            mark("end")
    return marked


def take_marks() -> list[tuple[str, float]]:
    taken = list(_marks)
    _marks.clear()
    return taken


def in_order(marks: list[tuple[str, float]]) -> list[tuple[float, str]]:
    """One pull's marks (both sides', any order) as (ms from the pull's start, mark), in order. Marks before the start
    are left out (a connection's thread reading the request before this pull's)."""
    start = min(t for key, t in marks if key == START)
    return sorted(((t - start) * 1e3, key) for key, t in marks if t >= start)


def offsets(marks: list[tuple[str, float]]) -> dict[str, float]:
    """ms from the pull's start to each mark of one pull (`in_order`): a repeated mark's first and last as
    "<mark> (first)" and "<mark> (last)", any other mark's first."""
    out: dict[str, float] = {}
    for ms, key in in_order(marks):
        if key.split(": ", 1)[1] in REPEATED:
            out.setdefault(f"{key} (first)", ms)
            out[f"{key} (last)"] = ms
        else:
            out.setdefault(key, ms)
    return out


def timeline(pulls: list[tuple[float, dict[str, float]]]) -> list[tuple[str, float, float]]:
    """(mark, median ms over the fastest fifth of `pulls`, median ms over all), in the order of the first: `pulls` are
    (wall seconds, `offsets`) each."""
    fastest = fastest_fifth(pulls)
    keys = {key for _, marks in pulls for key in marks}

    def median(of, key):
        values = [marks[key] for _, marks in of if key in marks]
        return statistics.median(values) if values else float("nan")

    rows = [(key, median(fastest, key), median(pulls, key)) for key in keys]
    return sorted(rows, key=lambda row: (row[1], row[2]))


def _source(conn, size: str, num_blocks: int) -> None:
    """The source node: answers "seed" (a fresh prefix's hashes), "marks" (this process's, then cleared), "stop"."""
    install("source")
    kp.source_node(conn, size, num_blocks, lambda command, arg: take_marks())


def measure(size: str, tokens: int, pulls: int, connections: int | None = None, source_main=None,
            install_target=None, keep=None) -> list[tuple[float, object]]:
    """(wall seconds, `keep(marks)`) of each of `pulls` pulls of a fresh prefix of `tokens` tokens, each over
    `connections` connections (None: as the config's default decides). By default the marks are this module's
    (`_source` in the source's process, `install` here) and what is kept of them their `offsets`."""
    num_blocks = (pulls + 2) * tokens // 16 + 64
    (install_target or install)("target")
    keep = keep or offsets
    ours, source, loop, engine, path, address = kp.pull_pair(source_main or _source, size, num_blocks)
    path.config = replace(path.config, connections_per_pull=connections)
    measured = []
    try:
        for seed in range(2, pulls + 2):
            ours.send(("seed", (tokens, seed)))
            hashes = ours.recv()
            take_marks()
            started = time.perf_counter()
            result = kp._pull(loop, path, address, hashes)
            wall = time.perf_counter() - started
            assert result.ok and result.imported == len(hashes), result
            ours.send(("marks", None))
            measured.append((wall, keep(take_marks() + ours.recv())))
    finally:
        kp.stop(ours, source, path, engine)
    return measured


#: Marks a run printed under another name (the runs of 2026-12-06 that tried these marks first), as named here.
RENAMED = {"target: taken seen, size read": "target: chunk's size read"}


def read_printed(path: str) -> dict[str, float]:
    """The fastest fifth's ms of each mark, read back from what `main` printed (a saved run's output); a repeated
    mark's last is left out where it came with its first (one connection's request, read once)."""
    rows = {}
    for line in Path(path).read_text().splitlines():
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if len(cells) == 3 and ": " in cells[0]:
            name, _, repeat = cells[0].partition(" (")
            rows[RENAMED.get(name, name) + (f" ({repeat}" if repeat else "")] = float(cells[1])
    return {key: ms for key, ms in rows.items()
            if not (key.endswith(" (last)") and rows.get(key.replace(" (last)", " (first)")) == ms)}


#: The marks `plot` draws: where a pull's time goes between its two ends.
PLOTTED = ("source: request read (first)", "source: request read (last)", "source: run pinned (first)",
           "source: run pinned (last)", "source: batch being sent (first)", "source: reply ended",
           "target: request being sent", "target: blocks reserved", "target: chunk's size read (first)",
           "target: reply ended", "target: blocks listed", "target: pull returned")


def plot(outputs: list[str], labels: list[str], name: str) -> None:
    """docs/img/<name>.png: each saved run's `PLOTTED` marks on a line of its own, the source's above it and the
    target's below, at the fastest fifth's ms from the pull's start."""
    from experiments.common import new_figure, save_figure

    fig, ax = new_figure(9.0, 1.0 + 2.2 * len(outputs))
    for row, (path, label) in enumerate(zip(outputs, labels)):
        base, marks = -4.0 * row, read_printed(path)
        shown = sorted((marks[key], key) for key in PLOTTED if key in marks)
        placed = {"source": 0, "target": 0}
        for ms, key in shown:
            side, mark = key.split(": ", 1)
            up, placed[side] = side == "source", placed[side] + 1
            y = base + (1 if up else -1) * (0.35 + 0.33 * (placed[side] % 5))  # staggered: neighbours' labels apart
            ax.plot([ms, ms], [base, y], color="tab:orange" if up else "tab:blue", lw=1)
            ax.annotate(f"{mark} {ms:.2f}", (ms, y), fontsize=7, va="bottom" if up else "top", ha="center")
        ax.axhline(base, color="grey", lw=0.5)
        ax.text(-0.15, base, label, ha="right", va="center", fontsize=8)
    ax.set_xlabel("ms from the pull's start (fastest fifth's median); the source above each line, the target below")
    ax.set_yticks([])
    ax.set_ylim(-4.0 * (len(outputs) - 1) - 2.2, 2.2)
    save_figure(fig, name, bbox_inches="tight")


def arguments(doc: str, pulls: int, plot_name: str, argv: list[str] | None) -> argparse.Namespace:
    """A pull bench's command line: the prefix, the pulls, their connections, or `--plot` of saved outputs."""
    p = argparse.ArgumentParser(description=doc.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--pulls", type=int, default=pulls)
    p.add_argument("--connections", type=int, default=None)
    p.add_argument("--plot", nargs="+", metavar="LABEL=OUTPUT", default=None,
                   help="draw saved runs' printed output instead of measuring (docs/img/<--plot-name>.png)")
    p.add_argument("--plot-name", default=plot_name)
    return p.parse_args(argv)


def plotted(args: argparse.Namespace, draw) -> bool:
    """Whether `args` asked for `--plot`, then drawn by `draw(outputs, labels, name)`."""
    if not args.plot:
        return False
    labels, outputs = zip(*(item.split("=", 1) for item in args.plot))
    draw(list(outputs), list(labels), args.plot_name)
    return True


def fastest_fifth(pulls: list[tuple[float, object]]) -> list[tuple[float, object]]:
    """The fastest fifth of `pulls`, (wall seconds, marks) each, fastest first (at least one)."""
    return sorted(pulls, key=lambda p: p[0])[: max(1, len(pulls) // 5)]


def fastest_fifths_median(walls: list[float]) -> float:
    """The median wall of the fastest fifth of `walls`."""
    return statistics.median(wall for wall, _ in fastest_fifth([(wall, None) for wall in walls]))


def main(argv: list[str] | None = None) -> int:
    args = arguments(__doc__, 100, "kv_pull_timeline", argv)
    if plotted(args, plot):
        return 0
    print_header(f"a direct KV pull's timeline ({args.size}, {args.tokens} tokens, {args.pulls} pulls, "
                 f"connections: {args.connections or 'default'})")
    pulls = measure(args.size, args.tokens, args.pulls, args.connections)
    rows = timeline(pulls)
    walls = sorted(wall for wall, _ in pulls)
    print(f"pull wall time: fastest fifth's median {fastest_fifths_median(walls) * 1e3:.2f} ms, "
          f"all {statistics.median(walls) * 1e3:.2f} ms")
    print(markdown_table(["mark", "ms, fastest fifth", "ms, all"], [[key, f"{a:.2f}", f"{b:.2f}"] for key, a, b in rows]))
    name = "kv_pull_timeline" if (args.size, args.tokens) == ("small", 2048) else f"kv_pull_timeline_{args.size}_{args.tokens}"
    save_results(name, {"size": args.size, "tokens": args.tokens, "walls_s": walls,
                        "rows": [{"mark": key, "fastest_fifth_ms": a, "all_ms": b} for key, a, b in rows]})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""Each connection's pace through a direct pull: every batch its source thread sends and every read its target
thread makes, in ms from the pull's start, per thread.

`experiments.kv_pull_timeline` shows a repeated mark at its first and its last; this shows every one, per thread,
so a pull over two connections can be read against one over one: whether the two threads of a side send or land
at once, and at what pace each. Two processes on loopback, as there (`experiments.kv_pull_profile.pull_pair`); a
mark is taken as `link_io.send_pieces` (source) or `link_io.recv_pieces` (target) starts (`>`) and returns (`<`),
tagged by its thread (`#n`, numbered in the order threads first took a mark in that process).

    python -m experiments.kv_pull_series [--connections N] [--pulls 40]
    python -m experiments.kv_pull_series --plot LABEL=OUTPUT ... [--plot-name NAME]

Prints, for the fastest fifth of the pulls, each thread's series of each mark (the median of each mark's n-th
reaching over those pulls), then every mark of one of those pulls in order. `--plot` draws runs printed before
(their saved output, each with a label) into docs/img/<NAME>.png: each source thread's batches sent over time.
"""

from __future__ import annotations

import statistics
import threading
from pathlib import Path

from experiments import kv_pull_profile as kp
from experiments import kv_pull_timeline as tl
from experiments.common import print_header

#: (side, module attribute of `orchard.node.serving.link_io`, mark as it starts, mark as it returns)
TAGGED = (("source", "send_pieces", "send>", "send<"), ("target", "recv_pieces", "recv>", "recv<"))
_threads: dict[int, int] = {}  # thread ident: its number in this process


def _tagged(fn, side: str, before: str, after: str):
    """`fn` taking the marks `before` and `after`, each tagged with the calling thread's number."""
    def tagged(*args, **kwargs):
        tag = _threads.setdefault(threading.get_ident(), len(_threads))
        tl.take_mark(f"{side}: {before} #{tag}")
        try:
            return fn(*args, **kwargs)
        finally:
            tl.take_mark(f"{side}: {after} #{tag}")
    return tagged


def install(side: str) -> None:
    """`kv_pull_timeline`'s marks, and `TAGGED`'s for `side`, in this process."""
    from orchard.node.serving import link_io

    tl.install(side)
    for mark_side, name, before, after in TAGGED:
        if mark_side == side:
            setattr(link_io, name, _tagged(getattr(link_io, name), side, before, after))


def _source(conn, size: str, num_blocks: int) -> None:
    install("source")
    kp.source_node(conn, size, num_blocks, lambda command, arg: tl.take_marks())


def measure(size: str, tokens: int, pulls: int, connections: int | None) -> list[tuple[float, list[tuple[float, str]]]]:
    """(wall seconds, every mark of both sides as (ms from the pull's start, mark), in order) of each pull."""
    return tl.measure(size, tokens, pulls, connections, _source, install, tl.in_order)


def series(pulls: list[tuple[float, list[tuple[float, str]]]]) -> dict[str, list[float]]:
    """Each tagged mark's series over the fastest fifth of `pulls`: the median ms of its n-th reaching, for n up to
    the fewest times any of those pulls reached it (a thread that took part in some pulls only is left out)."""
    fastest = tl.fastest_fifth(pulls)
    keys = sorted({key for _, marks in fastest for _, key in marks if " #" in key})
    out = {}
    for key in keys:
        each = [[ms for ms, k in marks if k == key] for _, marks in fastest]
        if min(map(len, each)) == 0:
            continue
        out[key] = [statistics.median(p[i] for p in each) for i in range(min(map(len, each)))]
    return out


def read_printed(path: str) -> dict[str, list[float]]:
    """The series `main` printed (a saved run's output), by mark."""
    out = {}
    for line in Path(path).read_text().splitlines():
        head, sep, values = line.partition("): ")
        if sep and " #" in head and head.count(" (") == 1:
            out[head.split(" (")[0]] = [float(v) for v in values.split()]
    return out


def plot(outputs: list[str], labels: list[str], name: str) -> None:
    """docs/img/<name>.png: a panel a saved run, each source thread's batches sent (`send<`) against ms."""
    from experiments.common import new_figure, save_figure

    fig, axes = new_figure(4.2 * len(outputs), 3.4, ncols=len(outputs), sharex=True, sharey=True)
    axes = axes if len(outputs) > 1 else [axes]
    for ax, path, label in zip(axes, outputs, labels):
        for key, values in sorted(read_printed(path).items()):
            if key.startswith("source: send<"):
                ax.step(values, range(1, len(values) + 1), where="post", label=f"thread {key.split('#')[1]}")
        ax.set_title(label, fontsize=9)
        ax.set_xlabel("ms from the pull's start (fastest fifth's median)")
        ax.legend(fontsize=8)
    axes[0].set_ylabel("batches sent by the source thread")
    save_figure(fig, name, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    args = tl.arguments(__doc__, 40, "kv_pull_series", argv)
    if tl.plotted(args, plot):
        return 0
    print_header(f"a direct KV pull's marks per thread ({args.size}, {args.tokens} tokens, {args.pulls} pulls, "
                 f"connections: {args.connections or 'default'})")
    pulls = measure(args.size, args.tokens, args.pulls, args.connections)
    walls = sorted(wall for wall, _ in pulls)
    print(f"connections {args.connections or 'default'}: wall fastest fifth median "
          f"{tl.fastest_fifths_median(walls) * 1e3:.2f} ms, all {statistics.median(walls) * 1e3:.2f}")
    for key, values in series(pulls).items():
        print(f"{key} ({len(values)}): " + " ".join(f"{ms:.2f}" for ms in values))
    fastest = tl.fastest_fifth(pulls)
    wall, marks = fastest[len(fastest) // 2]
    print(f"one pull ({wall * 1e3:.2f} ms), every mark:")
    for ms, key in marks:
        print(f"  {ms:7.3f}  {key}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

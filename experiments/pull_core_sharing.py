"""Two nodes on one machine: when a pull's two ends share a core, and what each pull then costs.

On a two-core machine a direct pull (`orchard.node.serving.kv_link`) keeps both cores busy: the source's
link thread sends (and runs the kernel's loopback delivery), the target's receive thread copies the bytes
into the pool. Where Linux puts both on one core (it places a thread woken by a socket near the thread
that woke it), the other core idles and the pull takes longer. This records every scheduler switch while
plain-process pulls run (`perf record` of the `sched` events; root), then reads, per pull, how long each
core idled within it (`perf sched timehist`).

Two modes, each its own pair of processes: "shared" leaves placement to the scheduler; "a core each"
pins the source process to core 0 and the target process to core 1, as two machines would give each end
cores of its own. Raw TCP is read in each mode the same way, its sending and receiving threads free or
pinned alike.

    python -m experiments.pull_core_sharing [--size small] [--tokens 2048] [--pulls 30]

Prints a row a mode; the numbers go to experiments/results/pull_core_sharing.json, the picture (each
pull's time against the idle time of its idler core) to docs/img/pull_core_sharing.png.
"""

from __future__ import annotations

import argparse
import os
import re
import signal
import statistics
import subprocess
import tempfile
import time
from pathlib import Path

from experiments import kv_pull_profile as kp
from experiments.common import new_figure, print_header, save_figure, save_results
from orchard.cluster.bench.netns import tcp_rate

MODES = {"shared": None, "a core each": (0, 1)}  # (the source's core, the target's core)


def _source(conn, size: str, num_blocks: int, core: int | None) -> None:
    if core is not None:
        os.sched_setaffinity(0, {core})
    kp._source_main(conn, size, num_blocks, 0.005, None)


def _target(conn, size: str, tokens: int, pulls: int, cores: tuple[int, int] | None) -> None:
    """Pull `pulls` fresh prefixes from a source process; send back each pull's (start, end) on
    CLOCK_MONOTONIC (perf's clock here) and bytes, and raw TCP's readings placed as the pulls were."""
    if cores is not None:
        os.sched_setaffinity(0, {cores[1]})
    num_blocks = (pulls + 2) * tokens // 16 + 64
    ours, source = kp.spawn_with_pipe(_source, size, num_blocks, cores[0] if cores else None)
    loop = kp.event_loop()
    engine = kp._engine(size, num_blocks)
    path = kp._path("dst", engine)
    address = ours.recv()
    windows = []
    for i in range(pulls + 1):  # the first warms the connection
        ours.send(("seed", (tokens, i + 2)))
        hashes = ours.recv()
        time.sleep(0.03)
        started = time.clock_gettime(time.CLOCK_MONOTONIC)
        result = kp._pull(loop, path, address, hashes)
        if i:
            windows.append((started, time.clock_gettime(time.CLOCK_MONOTONIC), result.bytes))
    ours.send(("stop", None))
    source.join(10)
    path.close()
    engine.shutdown()
    placed = dict(sender_core=cores[0], receiver_core=cores[1]) if cores else {}
    conn.send((windows, [tcp_rate("127.0.0.1", 256 << 20, **placed) for _ in range(5)]))


def idle_in(runs: list[tuple[float, int, float]], start: float, end: float, cores: int) -> list[float]:
    """Seconds each core idled within [start, end]: `runs` are the idle task's (`idle_runs`: when it
    stopped, core, how long it had run)."""
    idle = [0.0] * cores
    for stopped, core, ran in runs:
        overlap = min(stopped, end) - max(stopped - ran, start)
        if overlap > 0 and core < cores:
            idle[core] += overlap
    return idle


def read_timehist(data: Path) -> list[tuple[float, int, float]]:
    """The idle task's runs in a recording (`idle_runs`)."""
    return idle_runs(subprocess.run(["perf", "sched", "timehist", "-i", str(data)], capture_output=True, text=True).stdout)


def idle_runs(timehist: str) -> list[tuple[float, int, float]]:
    """The idle task's runs from `perf sched timehist`'s lines (time, [core], task, wait, delay, run in ms):
    (when it stopped, core, seconds it ran)."""
    runs = []
    for line in timehist.splitlines():
        m = re.match(r"\s*([\d.]+)\s+\[(\d+)\]\s+<idle>\s+[\d.]+\s+[\d.]+\s+([\d.]+)", line)
        if m:
            runs.append((float(m.group(1)), int(m.group(2)), float(m.group(3)) / 1e3))
    return runs


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--pulls", type=int, default=30)
    args = p.parse_args(argv)
    print_header(f"pulls of {args.size} {args.tokens} tokens, two processes, shared cores or a core each")
    cores = os.cpu_count() or 2
    results = {}
    with tempfile.TemporaryDirectory(prefix="orchard-sched-") as workdir:
        data = Path(workdir) / "sched.data"
        perf = subprocess.Popen(["perf", "record", "-q", "-e", "sched:sched_switch", "-e", "sched:sched_wakeup",
                                 "-k", "CLOCK_MONOTONIC", "-a", "-o", str(data)], stdout=subprocess.DEVNULL)
        try:
            time.sleep(1.0)
            for mode, pinned in MODES.items():
                ours, target = kp.spawn_with_pipe(_target, args.size, args.tokens, args.pulls, pinned, daemon=False)
                results[mode] = ours.recv()
                target.join(30)
                print(f"{mode}: {args.pulls} pulls done")
        finally:
            perf.send_signal(signal.SIGINT)
            perf.wait(60)
        runs = read_timehist(data)
    rows = {}
    for mode, (windows, tcp) in results.items():
        pulls = [{"ms": (end - start) * 1e3, "GBps": nbytes / (end - start) / 1e9,
                  "idle_ms": [x * 1e3 for x in idle_in(runs, start, end, cores)]} for start, end, nbytes in windows]
        rows[mode] = {"pulls": pulls, "tcp_GBps": [x / 1e9 for x in tcp]}
        ms = sorted(p["ms"] for p in pulls)
        idler = [max(p["idle_ms"]) for p in pulls]
        print(f"{mode:>11}: pull best {min(ms):.2f} ms, median {statistics.median(ms):.2f} ms; the idler core idled "
              f"{statistics.median(idler):.2f} ms at the median; raw TCP {statistics.median(tcp) / 1e9:.2f} GB/s "
              f"({', '.join(f'{x / 1e9:.2f}' for x in tcp)})")
    mib = results["shared"][0][0][2] / 2**20
    save_results("pull_core_sharing", {"size": args.size, "tokens": args.tokens, "MiB": mib, "modes": rows})
    draw(rows, mib)
    return 0


def draw(rows: dict, mib: float) -> Path:
    fig, ax = new_figure(6.0, 4.0)
    for mode, row in rows.items():
        tcp = statistics.median(row["tcp_GBps"])
        ax.plot([p["ms"] for p in row["pulls"]], [max(p["idle_ms"]) for p in row["pulls"]], "o", alpha=0.7,
                label=f"{mode} (raw TCP {tcp:.1f} GB/s)")
    ax.set_xlabel("pull (ms)")
    ax.set_ylabel("the idler core's idle time within it (ms)")
    ax.set_title(f"{mib:.0f} MiB pulls on two cores: placed by the scheduler, or a core each")
    ax.legend()
    return save_figure(fig, "pull_core_sharing")


if __name__ == "__main__":
    raise SystemExit(main())

"""What waking a sleeping thread costs on this machine: the hand-overs a pull makes between its threads, timed alone.

A direct pull hands its work from thread to thread a few times before its first byte and after its last
(docs/benchmarks.md, "## migration"): the target's request wakes the source's connection thread, which hands the
reply to a sending thread; the first chunk wakes the target's receive thread; the reply's end wakes the target's
event loop. Each time the woken thread was asleep, and its core may have been idle. What that costs is the
machine's, not the pull's: a core brought out of idle (and, in a virtual machine, a virtual CPU the hypervisor
must run again) takes longer than one already running.

Each row times one hand-over, one way, on the clock every thread and process shares (`time.perf_counter`,
CLOCK_MONOTONIC on Linux): the sender reads the clock and hands the reading over; the receiver reads the clock as it
wakes. Between two hand-overs the sender sleeps `--gap-ms`, so the receiver is asleep each time, as it is in a pull.

- `thread, Event`: one thread sets a `threading.Event` another waits on;
- `thread, SimpleQueue`: one thread puts into a `queue.SimpleQueue` another blocks on (`KeptThreads`' hand-over);
- `event loop, call_soon_threadsafe`: a thread has an idle asyncio loop run a callback (a pull's end);
- `process, TCP, blocking`: a process sends 8 bytes over a loopback TCP connection to one blocked in `recv`
  (a request or a chunk arriving);
- `process, TCP, spinning`: the same to a process that polls the socket without sleeping: the hand-over without
  the wake, for comparison.

    python -m experiments.wake_latency [--count 300] [--gap-ms 2]

Prints the median, p10 and p90 of each in microseconds. The numbers go to experiments/results/wake_latency.json.
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing
import queue
import socket
import statistics
import struct
import threading
import time
from collections.abc import Callable

from experiments.common import markdown_table, print_header, save_results

STAMP = struct.Struct("<d")


def thread_event(count: int, gap_s: float) -> list[float]:
    """Seconds from a `set` to the waiting thread running."""
    ring, ack, stamp, delays = threading.Event(), threading.Event(), [0.0], []

    def waiter() -> None:
        for _ in range(count):
            ring.wait()
            delays.append(time.perf_counter() - stamp[0])
            ring.clear()
            ack.set()

    def hand() -> None:
        stamp[0] = time.perf_counter()
        ring.set()

    def acknowledged() -> None:
        ack.wait()
        ack.clear()

    return _drive(waiter, count, gap_s, hand, acknowledged, delays)


def thread_queue(count: int, gap_s: float) -> list[float]:
    """Seconds from a `put` to the thread blocked in `get` running."""
    inbox, acks, delays = queue.SimpleQueue(), queue.SimpleQueue(), []

    def waiter() -> None:
        for _ in range(count):
            stamp = inbox.get()
            delays.append(time.perf_counter() - stamp)
            acks.put(None)

    return _drive(waiter, count, gap_s, lambda: inbox.put(time.perf_counter()), acks.get, delays)


def event_loop(count: int, gap_s: float) -> list[float]:
    """Seconds from `call_soon_threadsafe` to an idle loop running the callback."""
    delays: list[float] = []
    ack = threading.Event()

    def arrived(stamp: float) -> None:
        delays.append(time.perf_counter() - stamp)
        ack.set()

    async def main() -> None:
        loop = asyncio.get_running_loop()

        def sender() -> None:
            for _ in range(count):
                time.sleep(gap_s)
                loop.call_soon_threadsafe(arrived, time.perf_counter())
                ack.wait()
                ack.clear()

        await asyncio.to_thread(sender)

    asyncio.run(main())
    return delays


def _drive(waiter: Callable[[], None], count: int, gap_s: float, hand: Callable[[], object],
           acknowledged: Callable[[], object], delays: list[float]) -> list[float]:
    thread = threading.Thread(target=waiter, daemon=True)
    thread.start()
    for _ in range(count):
        time.sleep(gap_s)
        hand()
        acknowledged()
    thread.join()
    return delays


def tcp(count: int, gap_s: float, spin: bool) -> list[float]:
    """Seconds from `send` to another process, blocked in `recv` (or polling, with `spin`), having the bytes."""
    server = socket.create_server(("127.0.0.1", 0))
    child = multiprocessing.get_context("spawn").Process(target=_tcp_receiver,
                                                         args=(server.getsockname()[1], count, spin), daemon=True)
    child.start()
    conn, _ = server.accept()
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    delays = []
    with conn:
        for _ in range(count):
            time.sleep(gap_s)
            conn.sendall(STAMP.pack(time.perf_counter()))
            delays.append(STAMP.unpack(_recv_exact(conn, STAMP.size, spin=False))[0])
    child.join()
    server.close()
    return delays


def _tcp_receiver(port: int, count: int, spin: bool) -> None:
    with socket.create_connection(("127.0.0.1", port)) as sock:
        sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        for _ in range(count):
            stamp = STAMP.unpack(_recv_exact(sock, STAMP.size, spin))[0]
            sock.sendall(STAMP.pack(time.perf_counter() - stamp))


def _recv_exact(sock: socket.socket, n: int, spin: bool) -> bytes:
    data = b""
    while len(data) < n:
        try:
            got = sock.recv(n - len(data), socket.MSG_DONTWAIT if spin else 0)
        except BlockingIOError:
            continue
        if not got:
            raise ConnectionError("the peer closed")
        data += got
    return data


HAND_OVERS: dict[str, Callable[[int, float], list[float]]] = {
    "thread, Event": thread_event,
    "thread, SimpleQueue": thread_queue,
    "event loop, call_soon_threadsafe": event_loop,
    "process, TCP, blocking": lambda count, gap_s: tcp(count, gap_s, spin=False),
    "process, TCP, spinning": lambda count, gap_s: tcp(count, gap_s, spin=True),
}


def summary(delays: list[float]) -> dict[str, float]:
    """Median, p10 and p90 in microseconds."""
    deciles = statistics.quantiles(delays, n=10)
    return {"median_us": statistics.median(delays) * 1e6, "p10_us": deciles[0] * 1e6, "p90_us": deciles[-1] * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--count", type=int, default=300, help="hand-overs timed of each kind")
    parser.add_argument("--gap-ms", type=float, default=2.0, help="the sender's sleep between two hand-overs")
    args = parser.parse_args()
    print_header(f"one hand-over to a sleeping thread ({args.count} each, {args.gap_ms} ms apart)")
    results = {}
    for name, hand_over in HAND_OVERS.items():
        results[name] = summary(hand_over(args.count, args.gap_ms / 1e3))
        print(f"  {name}: median {results[name]['median_us']:.0f} us", flush=True)
    print(markdown_table(["hand-over", "median us", "p10 us", "p90 us"],
                         [[name, f"{r['median_us']:.0f}", f"{r['p10_us']:.0f}", f"{r['p90_us']:.0f}"]
                          for name, r in results.items()]))
    save_results("wake_latency", {"count": args.count, "gap_ms": args.gap_ms, "hand_overs": results})


if __name__ == "__main__":
    main()

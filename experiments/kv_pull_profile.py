"""Where a direct KV pull spends its time: two processes, no Ray, stage by stage.

The source runs in a child process (its own GIL, as a node actor has), holding a prefix
seeded by import; the target, in this process, pulls it over `orchard.node.serving.kv_link` as a node
actor's `pull_blocks` does. Each stage is timed by wrapping the function that does it, in
both processes, and summed over a pull (stages on different threads overlap, so they add up
to more than the pull's wall time; the one nearest the wall time bounds the pull):

    source: pin (pin_export or pin_layer_export on the engine thread), encode (the pieces), send (checksum + sendmsg)
    target: recv (socket to buffer + checksum), decode (check + parse), import (pool write, engine thread),
            place (a chunk from the socket straight into reserved pool blocks + checksum, receive thread)

With `--threads` (Linux), each pull also shows every thread of both processes that ran during it: its CPU
time and how long it waited, ready to run, for a CPU (`/proc/<pid>/task/<tid>/schedstat`), which tells
a pull held up by its own work from one held up by the machine's other threads.

Raw TCP over the same loopback, plain sockets, is measured in the same run. With `--link`
the two processes are two hosts of the namespace rig (`orchard.cluster.bench.netns`, needs root),
over a veth shaped to 1 or 10 Gbit/s or unshaped, and raw TCP goes through the same veths.

    python -m experiments.kv_pull_profile [--size large] [--tokens 8192] [--repeats 3] [--chunk-mib 4]
                                          [--link 1gbit|10gbit|none] [--threads] [--connections N]
"""

from __future__ import annotations

import argparse
import asyncio
import multiprocessing as mp
import statistics
import sys
import tempfile
import threading
import time
from collections import defaultdict
from pathlib import Path

from experiments.common import machine_line, print_header, save_results

KEY_SECRET = "a-cluster-token-of-at-least-32-characters-for-profiling"


class Stages:
    """Seconds and calls per stage, from any thread."""

    def __init__(self):
        self.lock = threading.Lock()
        self.seconds: dict[str, float] = defaultdict(float)
        self.calls: dict[str, int] = defaultdict(int)

    def wrap(self, owner, name: str, stage: str) -> None:
        real = getattr(owner, name)

        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return real(*args, **kwargs)
            finally:
                with self.lock:
                    self.seconds[stage] += time.perf_counter() - started
                    self.calls[stage] += 1

        setattr(owner, name, timed)

    def take(self) -> dict:
        with self.lock:
            out = {k: (self.seconds[k], self.calls[k]) for k in self.seconds}
            self.seconds.clear()
            self.calls.clear()
        return out


class ThreadTimes:
    """Per thread of this process: (name, CPU seconds, seconds waiting for a CPU), from the kernel's
    schedstat. A pull's receive thread ends with its reply, so `keep_receive_threads` records what it
    used as it ends, under its name."""

    def __init__(self):
        self.ended: list[tuple[str, float, float]] = []

    def now(self) -> dict[int, tuple[str, float, float]]:
        names = {t.native_id: t.name for t in threading.enumerate()}
        out = {}
        for tid, name in names.items():
            times = _schedstat(tid)
            if times is not None:
                out[tid] = (name, *times)
        return out

    def keep_receive_threads(self) -> None:
        from orchard.node.serving import kv_link

        real, ended = kv_link.LinkStream._receive, self.ended

        def receive(stream):
            first = _schedstat(threading.get_native_id())
            try:
                return real(stream)
            finally:
                last = _schedstat(threading.get_native_id())
                if first and last:
                    ended.append((threading.current_thread().name, last[0] - first[0], last[1] - first[1]))

        kv_link.LinkStream._receive = receive

    def since(self, before: dict) -> list[tuple[str, float, float]]:
        """Each thread's use since `before` (a `now`), the receive threads that ended meanwhile with them."""
        used = [(name, cpu - before[tid][1], wait - before[tid][2])
                for tid, (name, cpu, wait) in self.now().items() if tid in before]  # a pull's receive thread has ended
        used += self.ended
        self.ended.clear()
        return sorted((u for u in used if u[1] + u[2] > 50e-6), key=lambda u: -u[1])


def _schedstat(tid: int) -> tuple[float, float] | None:
    """(CPU seconds, seconds waiting on a run queue) of thread `tid` of this process, or None (not Linux)."""
    try:
        with open(f"/proc/self/task/{tid}/schedstat") as f:
            cpu_ns, wait_ns, _ = f.read().split()
    except OSError:
        return None
    return int(cpu_ns) / 1e9, int(wait_ns) / 1e9


def _engine(size: str, num_blocks: int):
    from orchard.node.async_engine import AsyncEngine
    from orchard.node.engine import EngineConfig, LLMEngine
    from orchard.node.heap import freeze_loaded_objects
    from orchard.node.model.demo import default_demo_model_path

    config = EngineConfig(model=str(default_demo_model_path(size)), block_size=16, num_blocks=num_blocks,
                          max_num_seqs=4, max_num_batched_tokens=512)
    engine = AsyncEngine(LLMEngine(config))
    freeze_loaded_objects()  # as a node actor does when it starts
    return engine


def _path(name: str, engine, chunk_mib: int = 4, host: str = "127.0.0.1", connections: int | None = None):
    from orchard.node.serving import link_auth
    from orchard.node.serving.direct_path import DirectPath
    from orchard.node.serving.kv_link import KVLinkConfig
    from orchard.node.serving.migration import BlockMover

    config = KVLinkConfig(chunk_bytes=chunk_mib << 20, host=host, connections_per_pull=connections)
    path = DirectPath(BlockMover(engine), name, link_auth.link_key(KEY_SECRET), config)
    path.start()
    return path


def _instrument(stages: Stages, side: str) -> None:
    from orchard.kvcache import cache, wire_transit
    from orchard.node.serving import kv_link, link_io

    if side == "source":
        stages.wrap(cache.KVCache, "pin_export", "pin")
        stages.wrap(kv_link, "payload_pieces", "encode")
        if hasattr(cache.KVCache, "pin_layer_export"):  # wire format version 3, where the tree has it
            stages.wrap(cache.KVCache, "pin_layer_export", "pin")
            stages.wrap(kv_link, "layer_pieces", "encode")
        stages.wrap(link_io, "send_payload", "send")
    else:
        stages.wrap(link_io, "receive_payload", "recv")
        stages.wrap(wire_transit.IncomingPayload, "decode", "decode")
        stages.wrap(cache.KVCache, "import_decoded", "import")
        if hasattr(wire_transit.IncomingPayload, "place"):  # chunks read straight into the pool, where the tree does
            stages.wrap(wire_transit.IncomingPayload, "place", "place")


def _seed(path, tokens_len: int, seed: int) -> list[bytes]:
    """A fresh prefix in the source's pool, imported from made-up KV under its true hashes."""
    from orchard.cluster.bench.netns_node import seed_kv

    return seed_kv(path.mover.engine.engine.kv, made_up_tokens(tokens_len, seed), seed)


def made_up_tokens(count: int, seed: int) -> list[int]:
    """`count` token ids of the small demo model's vocabulary, a different run for each `seed`."""
    return [(seed * 7919 + j * 13 + (j * j) % 97) % 1500 + 20 for j in range(count)]


def _source_main(conn, size: str, num_blocks: int, switch_s: float, where: tuple[str, str] | None) -> None:
    """The source node: answers "seed" (a fresh prefix), "stages" (and clears them), "stop".
    `where`: (namespace, address) of its host in the rig, entered before any socket is made."""
    if where is not None:
        from orchard.cluster.bench.netns import enter

        enter(where[0])
    sys.setswitchinterval(switch_s)
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="event-loop", daemon=True).start()
    engine = _engine(size, num_blocks)
    stages, threads = Stages(), ThreadTimes()
    _instrument(stages, "source")
    path = _path("src", engine, host=where[1] if where else "127.0.0.1")
    conn.send(path.address)
    before = threads.now()
    while True:
        command, arg = conn.recv()
        if command == "seed":
            conn.send(asyncio.run_coroutine_threadsafe(
                engine.run_on_engine(lambda e, a=arg: _seed(path, *a)), loop).result())
            before = threads.now()
        elif command == "stages":
            conn.send((stages.take(), threads.since(before)))
        else:
            break
    path.close()
    engine.shutdown()


def spawn_with_pipe(target, *args, daemon: bool = True):
    """(our end of a pipe, a process running `target(its end, *args)`), started: spawned, so that it has its
    own interpreter and GIL, as a node actor has. A daemon process ends with this one, but may start none."""
    ctx = mp.get_context("spawn")
    ours, theirs = ctx.Pipe()
    process = ctx.Process(target=target, args=(theirs, *args), daemon=daemon)
    process.start()
    return ours, process


def source_node(conn, size: str, num_blocks: int, answer) -> None:
    """A pull's source, in a process of its own (`spawn_with_pipe`): sends its link's address over `conn`, then
    answers "seed" with a fresh prefix's hashes (`_seed`, (tokens, seed)) and any other command but "stop" with
    `answer(command, arg)`."""
    loop = event_loop()
    engine = _engine(size, num_blocks)
    path = _path("src", engine)
    conn.send(path.address)
    while (message := conn.recv())[0] != "stop":
        command, arg = message
        if command == "seed":
            conn.send(asyncio.run_coroutine_threadsafe(engine.run_on_engine(lambda e, a=arg: _seed(path, *a)), loop).result())
        else:
            conn.send(answer(command, arg))
    path.close()
    engine.shutdown()


def pull_pair(source, size: str, num_blocks: int):
    """(our end of the pipe, the source's process, event loop, engine, path, the source's address) of a target here
    and a source spawned to run `source(conn, size, num_blocks)`, once a first small pull has connected the two and
    proved the key: every pull after reuses that connection. `stop` ends both."""
    ours, process = spawn_with_pipe(source, size, num_blocks)
    loop = event_loop()
    engine = _engine(size, num_blocks)
    path = _path("dst", engine)
    address = ours.recv()
    ours.send(("seed", (64, 1)))
    _pull(loop, path, address, ours.recv())
    return ours, process, loop, engine, path, address


def event_loop() -> asyncio.AbstractEventLoop:
    """A new event loop, running on a thread of its own (a node actor's pulls run on its loop)."""
    loop = asyncio.new_event_loop()
    threading.Thread(target=loop.run_forever, name="event-loop", daemon=True).start()
    return loop


def _pull(loop, path, address: str, hashes: list[bytes]):
    async def resolve(_peer):
        return address

    return asyncio.run_coroutine_threadsafe(path.pull("src", hashes, resolve), loop).result()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="large")
    p.add_argument("--tokens", type=int, default=8192)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--switch-ms", type=float, default=5.0, help="the interpreter's GIL switch interval, both processes")
    p.add_argument("--chunk-mib", type=int, default=4, help="chunk size the target asks for")
    p.add_argument("--connections", type=int, default=None,
                   help="the connections a pull spreads its run over (KVLinkConfig.connections_per_pull; "
                        "by default as this machine's cores decide)")
    p.add_argument("--link", choices=("1gbit", "10gbit", "none"), default=None,
                   help="source and target in two network namespaces over a link shaped with tc (root)")
    p.add_argument("--threads", action="store_true",
                   help="per pull, each thread's CPU time and wait for a CPU, in both processes (Linux)")
    args = p.parse_args(argv)
    if args.link is None:
        return _profile(args, None)
    from orchard.cluster.bench.netns import LINKS, NetLab

    with tempfile.TemporaryDirectory(prefix="orchard-profile-") as workdir, NetLab(Path(workdir)) as lab:
        lab.build({"a": "2", "b": "3"})
        lab.shape(LINKS[args.link])
        print(f"link {args.link}: {lab.qdisc('a')}")
        return _profile(args, lab)


def _profile(args, lab) -> int:
    """The run, on loopback (`lab` None) or from host a to host b of the rig: this process, the
    target, moves into b's namespace before it makes a socket or a thread."""
    from orchard.cluster.bench.migration import tcp_throughput

    if lab is not None:
        from orchard.cluster.bench.netns import enter

        enter(lab.ns("b"))

    print_header(f"direct KV pull, stage by stage ({args.size}, {args.tokens} tokens)")
    sys.setswitchinterval(args.switch_ms / 1e3)
    num_blocks = (args.repeats + 1) * args.tokens // 16 + 64
    where = (lab.ns("a"), lab.hosts["a"]) if lab is not None else None
    ours, source = spawn_with_pipe(_source_main, args.size, num_blocks, args.switch_ms / 1e3, where)
    loop = event_loop()
    engine = _engine(args.size, num_blocks)
    stages, threads = Stages(), ThreadTimes()
    _instrument(stages, "target")
    threads.keep_receive_threads()
    path = _path("dst", engine, args.chunk_mib, lab.hosts["b"] if lab is not None else "127.0.0.1", args.connections)
    address = ours.recv()
    ours.send(("seed", (64, 1)))
    _pull(loop, path, address, ours.recv())  # warm
    ours.send(("stages", None))
    ours.recv()
    stages.take()
    threads.since(threads.now())
    if lab is not None:
        from orchard.cluster.bench import netns

        tcp_Bps = netns.tcp_throughput(lab, "a", "b", 64 << 20)
    else:
        tcp_Bps = tcp_throughput(256 << 20)
    rates, pulls = [], []
    for i in range(args.repeats):
        ours.send(("seed", (args.tokens, i + 2)))
        hashes = ours.recv()
        before = threads.now()
        started = time.perf_counter()
        result = _pull(loop, path, address, hashes)
        wall = time.perf_counter() - started
        target_threads = threads.since(before)
        ours.send(("stages", None))
        source_stages, source_threads = ours.recv()
        target_stages = stages.take()
        assert result.ok and result.imported == len(hashes), result
        rates.append(result.bytes_per_s)
        pulls.append({"bytes": result.bytes, "wall_s": wall, "source": source_stages, "target": target_stages,
                      "threads": {"source": source_threads, "target": target_threads}})
        print(f"pull {i}: {result.bytes / 2**20:.1f} MiB in {wall * 1e3:.1f} ms "
              f"({result.bytes_per_s / 1e9:.2f} GB/s, {100 * result.bytes_per_s / tcp_Bps:.0f} % of TCP)")
        for side, table in (("source", source_stages), ("target", target_stages)):
            print(f"  {side}: " + ", ".join(f"{k} {s * 1e3:.1f} ms/{n}" for k, (s, n) in sorted(table.items())))
        if args.threads:
            for side, used in (("source", source_threads), ("target", target_threads)):
                print(f"  {side} threads (CPU / waiting for a CPU, ms): "
                      + ", ".join(f"{name} {cpu * 1e3:.2f}/{wait * 1e3:.2f}" for name, cpu, wait in used))
    print(f"raw TCP {tcp_Bps / 1e9:.2f} GB/s; pull best {max(rates) / 1e9:.2f} GB/s "
          f"({100 * max(rates) / tcp_Bps:.0f} %), median {statistics.median(rates) / 1e9:.2f} GB/s")
    save_results("kv_pull_profile", {"machine": machine_line(), "size": args.size, "tokens": args.tokens,
                                      "chunk_mib": args.chunk_mib, "link": args.link, "tcp_Bps": tcp_Bps,
                                      "pulls": pulls})
    stop(ours, source, path, engine)
    return 0


def stop(conn, source, path, engine) -> None:
    """End the source process (over its pipe `conn`), then this process's path and engine."""
    conn.send(("stop", None))
    source.join(10)
    path.close()
    engine.shutdown()


if __name__ == "__main__":
    raise SystemExit(main())

"""What a pull's bytes cost before any of the pull's own work: raw TCP replies of a pull's size, step by
step closer to what a pull must do with them, beside direct pulls, in one pair of processes.

The migration bench reads a pull against raw TCP replies of the same bytes (`orchard.cluster.bench.netns.tcp_replies`):
the source sends one buffer again and again and the target reads into one buffer again and again, so both stay in
the CPU's caches. A pull cannot: the source reads blocks from its pool, wherever they are, and the target writes
into blocks it reserved, which nothing has touched lately; both ends checksum every byte (`orchard.kvcache.wire`).
Each step adds one of those:

- `raw, hot, bench's reads`: the bench's raw TCP replies (one buffer each end, read as `recv_into` returns);
- `raw, hot`: the same, each reply read in one call that returns once it is whole (`MSG_WAITALL`), as the link
  reads;
- `raw, memory`: each reply sent from, and read into, the next slice of a region far larger than the caches;
- `raw, memory, checksummed`: each reply a payload sent and landed as `link_io.send_payload` and
  `link_io.receive_payload` do it: the sender checksums each batch before it goes, the receiver each slice once
  it landed, and compares; from and into the regions;
- `raw, memory, checksummed beside`: the same, each batch or slice checksummed on a thread of its own at each
  end while the link's thread sends the next or reads it: what the checksum costs where a core is free to
  take it. (The same inside a pull made pulls slower: docs/benchmarks.md, "## migration".)
- `raw, memory, two connections` and `raw, memory, checksummed, two connections`: each reply in two halves,
  each on a connection of its own, sent by a thread of its own and read by one of its own (the asking thread
  and a kept one): what spreading a pull's chunks over two connections could give where cores are free.
- `pull, 1 connection(s)`, `pull, 2 connection(s)`, ...: a direct pull of a fresh prefix, as the bench times it,
  its run asked for over one connection, then in parts over each count of `--pull-connections`
  (`KVLinkConfig.connections_per_pull`).

    python -m experiments.kv_pull_floor [--size small] [--tokens 2048] [--rounds 10] [--per-round 6]
                                        [--pull-connections 1,2]

The steps run in turns of `--per-round` of each, interleaved, so each sees the machine alike. Prints best, p80
and median GB/s of each, and each one's best and median as a share of the bench's raw TCP's. The numbers go to
experiments/results/kv_pull_floor.json.
"""

from __future__ import annotations

import argparse
import functools
import socket
import threading
import time
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import replace

import numpy as np
import xxhash

from experiments import kv_pull_profile as kp
from experiments.common import best_and_median, markdown_table, print_header, save_results
from orchard.cluster.bench.netns import read_reply
from orchard.node.serving import link_io

TWO = ", two connections"
RAW_HOT = "raw, hot, bench's reads"  # the bench's raw TCP replies, issue 19's "raw TCP on the same path"
CHECKSUMMED = "raw, memory, checksummed"  # what a pull's bytes must do over one connection, and nothing else
CHECKSUMMED_TWO = CHECKSUMMED + TWO  # the same over two
STEPS = (RAW_HOT, "raw, hot", "raw, memory", CHECKSUMMED, "raw, memory, checksummed beside", "raw, memory" + TWO,
         CHECKSUMMED_TWO)
REGION_BYTES = 1 << 30  # each end's region: well past any last-level cache here
SENT_BYTE = 7  # what every byte the source sends holds; the target's regions start as zeros


def _answer(command: str, arg) -> object:
    """The source process's side of a raw step: listen, answer each four-byte ask on each of the step's
    connections with its part of `nbytes` as `step` says, a thread a connection; returns the listener's port."""
    if command != "serve":
        raise ValueError(command)
    step, nbytes = arg
    server = socket.create_server(("127.0.0.1", 0))
    threading.Thread(target=_accept, args=(server, step, nbytes), daemon=True).start()
    return server.getsockname()[1]


def _accept(server: socket.socket, step: str, nbytes: int) -> None:
    with server:
        for part in _parts(step, nbytes):
            threading.Thread(target=_serve, args=(server.accept()[0], step, part), daemon=True).start()


def _parts(step: str, nbytes: int) -> list[int]:
    """The bytes each of the step's connections carries of an `nbytes` reply."""
    return [nbytes - nbytes // 2, nbytes // 2] if step.endswith(TWO) else [nbytes]


def _serve(conn: socket.socket, step: str, nbytes: int) -> None:
    conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)  # as the link's: a checksum's 16 bytes go at once
    region = nbytes if step.startswith("raw, hot") else REGION_BYTES // len(_parts(step, nbytes))
    slices = _Slices(nbytes, region, SENT_BYTE)
    helper = _helper(step)
    with conn:
        while conn.recv(4, socket.MSG_WAITALL):
            if step.startswith("raw, hot"):
                conn.sendall(slices.first)
            elif "checksummed" not in step:
                conn.sendall(slices.next())
            else:
                _send_checksummed(conn, slices.next(), helper)
    if helper is not None:
        helper.shutdown()


def _helper(step: str) -> ThreadPoolExecutor | None:
    """The thread a step takes its checksums on, beside the link's thread; None where it takes them there."""
    return ThreadPoolExecutor(1) if step.endswith("beside") else None


def _send_checksummed(conn: socket.socket, data: memoryview, helper: ThreadPoolExecutor | None) -> None:
    """One payload as the link sends it: its length, its bytes in batches of `link_io.BATCH_BYTES`, each
    checksummed before it goes (on `helper` meanwhile, where given), then the checksum."""
    digest = xxhash.xxh3_128()
    conn.sendall(link_io.U64.pack(len(data) + 16))
    for start in range(0, len(data), link_io.BATCH_BYTES):
        batch = data[start : start + link_io.BATCH_BYTES]
        _checksum(helper, digest.update, batch)
        link_io.send_pieces(conn, [batch])
    conn.sendall(_checksum(helper, digest.digest).result())


def _receive_checksummed(sock: socket.socket, view: memoryview, helper: ThreadPoolExecutor | None) -> bool:
    """One payload of `len(view)` bytes as the link lands it: in slices of `link_io.LANDING_BYTES`, each
    checksummed once it landed (on `helper` while the next lands, where given); raises where the checksum
    differs, False where the peer left first."""
    digest, body = xxhash.xxh3_128(), view[:-16]
    for start in range(0, len(body), link_io.LANDING_BYTES):
        part = body[start : start + link_io.LANDING_BYTES]
        if not link_io.recv_into(sock, part):
            return False
        _checksum(helper, digest.update, part)
    if not link_io.recv_into(sock, view[-16:]):
        return False
    if _checksum(helper, digest.digest).result() != view[-16:]:
        raise ValueError("a raw payload's checksum differs")
    return True


def _checksum(helper: ThreadPoolExecutor | None, fn, *args) -> Future:
    """`fn(*args)` on `helper` (in the order handed to it), or here, as a future either way."""
    if helper is not None:
        return helper.submit(fn, *args)
    done: Future = Future()
    done.set_result(fn(*args))
    return done


class _Slices:
    """Consecutive `nbytes` slices of a region of `region_bytes`, in turn; every page written once first, so
    none faults later."""

    def __init__(self, nbytes: int, region_bytes: int, fill: int = 0):
        self.region = np.full(region_bytes, fill, dtype=np.uint8)
        self.view = memoryview(self.region)
        self.nbytes, self.count, self.at = nbytes, region_bytes // nbytes, 0
        self.first = self.view[:nbytes]

    def next(self) -> memoryview:
        self.at = (self.at + 1) % self.count
        return self.view[self.at * self.nbytes : (self.at + 1) * self.nbytes]


class _Asker:
    """The target's side of a raw step: ask on each of the step's connections, read each part of the reply as
    the step says (the second on a kept thread, the first here meanwhile), time the whole."""

    def __init__(self, port: int, step: str, nbytes: int):
        self.step, self.nbytes = step, nbytes
        parts = _parts(step, nbytes)
        self.parts = [_Part(port, step, part, REGION_BYTES // len(parts)) for part in parts]
        self.reader = ThreadPoolExecutor(1) if len(self.parts) > 1 else None

    @property
    def slices(self) -> _Slices:
        """Where the first connection's replies land."""
        return self.parts[0].slices

    def once(self) -> float:
        started = time.perf_counter()
        for part in self.parts:
            part.sock.sendall(b"ask!")
        beside = [self.reader.submit(part.read) for part in self.parts[1:]]
        ok = self.parts[0].read() and all(future.result() for future in beside)
        if not ok:
            raise ConnectionError("the source closed mid-reply")
        return self.nbytes / (time.perf_counter() - started)

    def close(self) -> None:
        """Close the connections (the source's threads for this step then end) and the threads, if any."""
        for part in self.parts:
            part.close()
        if self.reader is not None:
            self.reader.shutdown()


class _Part:
    """One connection of a raw step and where its replies land."""

    def __init__(self, port: int, step: str, nbytes: int, region_bytes: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.step, self.nbytes = step, nbytes
        self.helper = _helper(step)
        room = nbytes + link_io.U64.size + 16  # a payload's length and checksum too
        self.slices = _Slices(room, room if step.startswith("raw, hot") else region_bytes)

    def read(self) -> bool:
        """This connection's part of one reply; False where the source closed first."""
        if self.step == RAW_HOT:
            return read_reply(self.sock, self.slices.first[: self.nbytes]) == self.nbytes
        if self.step == "raw, hot":
            return link_io.recv_into(self.sock, self.slices.first[: self.nbytes])
        if "checksummed" not in self.step:
            return link_io.recv_into(self.sock, self.slices.next()[: self.nbytes])
        size = link_io.U64.unpack(link_io.recv_exact(self.sock, 8))[0]
        return _receive_checksummed(self.sock, self.slices.next()[:size], self.helper)

    def close(self) -> None:
        self.sock.close()
        if self.helper is not None:
            self.helper.shutdown()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--size", default="small")
    p.add_argument("--tokens", type=int, default=2048)
    p.add_argument("--rounds", type=int, default=10)
    p.add_argument("--per-round", type=int, default=6)
    p.add_argument("--pull-connections", type=lambda text: [int(n) for n in text.split(",")], default=[1, 2],
                   help="the connections each pull step spreads over, comma separated")
    args = p.parse_args(argv)
    print_header(f"a pull's bytes, step by step ({args.size}, {args.tokens} tokens)")
    pulls = {f"pull, {n} connection(s)": n for n in args.pull_connections}
    _, rates = interleaved(args.size, args.tokens, STEPS, pulls, args.rounds, args.per_round)
    _report(args, rates)
    return 0


def interleaved(size: str, tokens: int, steps, pulls: dict[str, int | None], rounds: int,
                per_round: int) -> tuple[int, dict[str, list[float]]]:
    """In one pair of processes (the source's answering `serve` with `_answer`): a pull's bytes, and the bytes/s of
    each reply of each raw step of `steps` and of each pull of each of `pulls` (name: the connections it spreads
    over, None for the link's own choice), in `rounds` turns of `per_round` of each, each round's end printed."""
    source = functools.partial(kp.source_node, answer=_answer)
    ours, process, loop, engine, path, address = kp.pull_pair(source, size, (rounds * per_round + 2) * tokens // 16 + 64)
    try:
        nbytes = first_pull_bytes(ours, loop, path, address, tokens)  # what a pull's rate is counted over
        askers = raw_askers(ours, steps, nbytes)
        rates: dict[str, list[float]] = {step: [] for step in (*steps, *pulls)}
        seeds = iter(range(3, 1 << 30))
        for done in range(rounds):
            for step in steps:
                for _ in range(per_round):
                    time.sleep(0.005)  # idle between replies, as between the bench's pulls
                    rates[step].append(askers[step].once())
            for step, connections in pulls.items():
                path.config = replace(path.config, connections_per_pull=connections)
                for _ in range(per_round):
                    rates[step].append(fresh_pull(ours, loop, path, address, tokens, next(seeds)))
            print(f"round {done + 1}/{rounds}", flush=True)
        for asker in askers.values():
            asker.close()
        return nbytes, rates
    finally:
        kp.stop(ours, process, path, engine)


def first_pull_bytes(ours, loop, path, address: str, tokens: int) -> int:
    """The bytes of a first pull of `tokens` (which also warms the link): what each pull's rate is counted over."""
    ours.send(("seed", (tokens, 2)))
    return kp._pull(loop, path, address, ours.recv()).bytes


def raw_askers(ours, steps, nbytes: int) -> dict[str, _Asker]:
    """An asker a raw step, the source process listening for it ("serve"), each warmed by one reply."""
    askers = {}
    for step in steps:
        ours.send(("serve", (step, nbytes)))
        askers[step] = _Asker(ours.recv(), step, nbytes)
        askers[step].once()  # warm: the connection, the pages
    return askers


def fresh_pull(ours, loop, path, address: str, tokens: int, seed: int) -> float:
    """The bytes/s of one pull of a fresh prefix of `tokens` (seeded at the source as `seed`), after the idle the
    bench leaves between pulls; raises where it failed."""
    ours.send(("seed", (tokens, seed)))
    hashes = ours.recv()
    time.sleep(0.005)
    return _pulled(loop, path, address, hashes)


def _pulled(loop, path, address: str, hashes: list[bytes]) -> float:
    """The bytes/s of one pull of `hashes`, as the bench counts them; raises where it failed."""
    result = kp._pull(loop, path, address, hashes)
    if not result.ok or result.imported != len(hashes):
        raise RuntimeError(f"a pull failed: {result}")
    return result.bytes_per_s


def _report(args, rates: dict[str, list[float]]) -> None:
    hot_best, hot_median = best_and_median(rates[RAW_HOT])
    rows = []
    for step, values in rates.items():
        best, median = best_and_median(values)
        p80 = sorted(values, reverse=True)[len(values) // 5]
        rows.append([step, f"{best / 1e9:.2f}", f"{p80 / 1e9:.2f}", f"{median / 1e9:.2f}",
                     f"{100 * best / hot_best:.0f} %", f"{100 * median / hot_median:.0f} %"])
    print(markdown_table(["step", "best GB/s", "p80 GB/s", "median GB/s", "best, of the bench's raw", "median, of its"], rows))
    save_results("kv_pull_floor", {"size": args.size, "tokens": args.tokens, "rates_Bps": rates})


if __name__ == "__main__":
    raise SystemExit(main())

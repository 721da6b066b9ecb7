"""Several "hosts" on one Linux machine: network namespaces on a private bridge, links shaped with `tc`.

A switch namespace holds a bridge; each host is a namespace wired to it by a veth pair
and addressed in a private /24. Nothing is routed anywhere else and nothing touches the
machine's own namespace. `NetLab.close` kills every process started in the namespaces and
deletes them (the veths and their qdiscs go with them), whatever happened. Needs root.

Shaping puts a token bucket (`tc qdisc ... tbf`) on each host's egress, so every byte a
host sends leaves at the link's rate: a pull from a to b is held to it one way, its acks
the other. The bucket holds a millisecond of the rate and at least 128 KiB: more than one
GSO packet (64 KiB, else tbf splits them), and small beside the pulls measured (8 MiB and
up), so a pull's first burst flatters its rate little. tbf counts whole frames, so TCP's
payload gets ~96 % of the shaped rate (0.96 Gbit/s through a 1 Gbit/s bucket here).

A thread can `enter` a namespace (`setns` is per thread): a benchmark's socket threads and
its spawned node processes join the hosts without a shell in between.
"""

from __future__ import annotations

import ctypes
import os
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

#: Link speeds the rig emulates: tbf rate in bits/s, or None for an unshaped veth.
LINKS = {"1gbit": 1_000_000_000, "10gbit": 10_000_000_000, "none": None}
_CLONE_NEWNET = 0x40000000
_BUCKET_S = 1e-3  # the bucket: this much of the rate (module docstring)
_QUEUE_S = 0.02  # what tbf queues before dropping: this much of the rate


class NetLab:
    """Namespaces, a bridge and the processes started in them; `close` undoes everything."""

    def __init__(self, workdir: Path, subnet: str = "10.213.0", prefix: str = "orj", cwd: Path | None = None):
        """Logs go to `workdir`; processes started here run in `cwd`."""
        self.tag = uuid.uuid4().hex[:6]
        self.workdir, self.subnet, self.prefix, self.cwd = workdir, subnet, prefix, cwd
        self.namespaces: list[str] = []
        self.procs: list[subprocess.Popen] = []
        self.hosts: dict[str, str] = {}

    def ns(self, role: str) -> str:
        return f"{self.prefix}{self.tag}{role}"

    def build(self, hosts: dict[str, str]) -> None:
        """One namespace per role, at its address (a host number in `subnet`, or a whole address)."""
        switch = self._add_ns("sw")
        _ip("-n", switch, "link", "add", "br0", "type", "bridge", "mcast_snooping", "0")
        _ip("-n", switch, "link", "set", "br0", "up")
        for i, (role, address) in enumerate(hosts.items()):
            address = address if "." in address else f"{self.subnet}.{address}"
            host = self._add_ns(role)
            _ip("link", "add", f"p{i}", "netns", switch, "type", "veth", "peer", "name", "eth0", "netns", host)
            _ip("-n", switch, "link", "set", f"p{i}", "master", "br0", "up")
            _ip("-n", host, "addr", "add", f"{address}/24", "dev", "eth0")
            _ip("-n", host, "link", "set", "eth0", "up")
            _ip("-n", host, "link", "set", "lo", "up")
            self.hosts[role] = address

    def shape(self, bits_per_s: int | None) -> None:
        """Every host's egress held to `bits_per_s` (None: unshaped, any qdisc removed)."""
        for role in self.hosts:
            subprocess.run(["tc", "-n", self.ns(role), "qdisc", "del", "dev", "eth0", "root"], capture_output=True)
            if bits_per_s:
                _tc(self.ns(role), *tbf_args(bits_per_s))

    def qdisc(self, role: str) -> str:
        """`tc qdisc show` of the role's link, as the kernel has it."""
        return subprocess.run(["tc", "-n", self.ns(role), "qdisc", "show", "dev", "eth0"], capture_output=True,
                              text=True, check=True).stdout.strip()

    def start(self, role: str, argv: list[str], env: dict[str, str], log_name: str) -> subprocess.Popen:
        log = open(self.workdir / log_name, "ab")
        proc = subprocess.Popen(["ip", "netns", "exec", self.ns(role), *argv], env=env, cwd=self.cwd, stdout=log,
                                stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL, start_new_session=True)
        self.procs.append(proc)
        return proc

    def run(self, role: str, argv: list[str], env: dict[str, str], timeout: float) -> subprocess.CompletedProcess:
        return subprocess.run(["ip", "netns", "exec", self.ns(role), *argv], env=env, cwd=self.cwd, capture_output=True,
                              text=True, timeout=timeout)

    def close(self) -> None:
        for proc in self.procs:
            stop(proc, grace_s=15)
        for ns in self.namespaces:  # stragglers (daemons in their own sessions, children that setns'd), by pid
            for pid in subprocess.run(["ip", "netns", "pids", ns], capture_output=True, text=True).stdout.split():
                if int(pid) != os.getpid():
                    _kill(int(pid))
        for ns in reversed(self.namespaces):
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        self.namespaces.clear()

    def _add_ns(self, role: str) -> str:
        name = self.ns(role)
        _ip("netns", "add", name)
        self.namespaces.append(name)
        return name

    def __enter__(self) -> NetLab:
        return self

    def __exit__(self, *exc) -> None:
        self.close()


def unavailable() -> str | None:
    """Why this machine cannot build the rig, or None when it can."""
    if sys.platform != "linux":
        return "network namespaces are Linux-only"
    if os.geteuid() != 0:
        return "needs root to create network namespaces (ip netns add)"
    for tool in ("ip", "tc"):
        if shutil.which(tool) is None:
            return f"iproute2 (`{tool}`) is not installed"
    probe = f"orjprobe{os.getpid()}"
    made = subprocess.run(["ip", "netns", "add", probe], capture_output=True)
    if made.returncode != 0:
        return f"ip netns add failed: {made.stderr.decode().strip()}"
    subprocess.run(["ip", "netns", "del", probe], capture_output=True)
    return None


def tbf_args(bits_per_s: int) -> list[str]:
    """`tc qdisc add` arguments for a token bucket at `bits_per_s` on eth0 (module docstring)."""
    bucket = max(int(bits_per_s / 8 * _BUCKET_S), 128 << 10)
    queue = int(bits_per_s / 8 * _QUEUE_S)
    return ["qdisc", "add", "dev", "eth0", "root", "tbf", "rate", str(bits_per_s), "burst", str(bucket),
            "limit", str(queue)]


def enter(namespace: str) -> None:
    """Move the calling thread into `namespace` (`ip netns` names it): sockets it makes afterwards live there."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(f"/var/run/netns/{namespace}", os.O_RDONLY)
    try:
        if libc.setns(fd, _CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise OSError(err, f"setns({namespace}): {os.strerror(err)}")
    finally:
        os.close(fd)


@dataclass(frozen=True)
class RawTCP:
    """Raw TCP from the pulls' source to their target, over the path they take: the ceilings a pull is read
    against. `stream()`: bytes/s of one long stream (`tcp_rate`); `replies(nbytes, n)`: bytes/s of each of n
    request/reply exchanges of `nbytes` (`tcp_replies`), a pull's shape with nothing of a pull's work."""

    stream: Callable[[], float]
    replies: Callable[[int, int], list[float]]

    @classmethod
    def loopback(cls, stream_bytes: int) -> RawTCP:
        return cls(lambda: tcp_rate("127.0.0.1", stream_bytes), lambda nbytes, n: tcp_replies("127.0.0.1", nbytes, n))

    @classmethod
    def across(cls, lab: NetLab, source: str, target: str, stream_bytes: int) -> RawTCP:
        return cls(lambda: tcp_throughput(lab, source, target, stream_bytes),
                   lambda nbytes, n: tcp_reply_throughput(lab, source, target, nbytes, n))


def tcp_throughput(lab: NetLab, source: str, target: str, nbytes: int, chunk: int = 4 << 20) -> float:
    """Bytes per second of one plain TCP stream from host `source` to host `target` (`tcp_rate`)."""
    return tcp_rate(lab.hosts[target], nbytes, chunk, lab.ns(target), lab.ns(source))


def tcp_rate(host: str, nbytes: int, chunk: int = 4 << 20, receiver_ns: str | None = None,
             sender_ns: str | None = None, receiver_core: int | None = None, sender_core: int | None = None) -> float:
    """Bytes per second of one plain TCP stream to a listener at `host`, measured at the receiver
    (first byte sent to last byte read). Each end is a thread, in its namespace where one is named, on its
    core where one is named (Linux), else where the scheduler puts it."""
    ready, result, errors = threading.Event(), {}, []
    receiver = threading.Thread(target=_guard(_receive, errors),
                                args=((receiver_ns, receiver_core), host, nbytes, chunk, ready, result))
    receiver.start()
    if not ready.wait(10):
        raise RuntimeError(f"no TCP receiver at {host}: {errors}")
    sender = threading.Thread(target=_guard(_send, errors),
                              args=((sender_ns, sender_core), result["address"], nbytes, chunk, result))
    sender.start()
    sender.join()
    receiver.join()
    if errors:
        raise errors[0]
    return result["received"] / (result["ended"] - result["started"])


def _place(namespace: str | None, core: int | None) -> None:
    """Move the calling thread into `namespace` and onto `core`, each where named."""
    if namespace:
        enter(namespace)
    if core is not None:
        os.sched_setaffinity(0, {core})


def _receive(where, host, nbytes, chunk, ready, result) -> None:
    _place(*where)
    with socket.create_server((host, 0)) as server:
        result["address"] = server.getsockname()[:2]
        ready.set()
        server.settimeout(30)
        conn, _ = server.accept()
        buffer, got = bytearray(chunk), 0
        with conn:
            while got < nbytes and (n := conn.recv_into(buffer)):
                got += n
        result["received"], result["ended"] = got, time.perf_counter()


def _send(where, address, nbytes, chunk, result) -> None:
    _place(*where)
    payload = memoryview(os.urandom(chunk))
    with socket.create_connection(address, timeout=30) as client:
        result["started"] = time.perf_counter()
        for _ in range(0, nbytes, chunk):
            client.sendall(payload)


def tcp_reply_throughput(lab: NetLab, source: str, target: str, nbytes: int, repeats: int) -> list[float]:
    """`tcp_replies` from host `source` to host `target`: the target asks, the source answers."""
    return tcp_replies(lab.hosts[source], nbytes, repeats, client_ns=lab.ns(target), server_ns=lab.ns(source))


def tcp_replies(host: str, nbytes: int, repeats: int, client_ns: str | None = None, server_ns: str | None = None,
                gap_s: float = 0.02) -> list[float]:
    """Bytes per second of each of `repeats` exchanges on one plain TCP connection kept across them: the
    client asks with four bytes, a listener at `host` answers with `nbytes`, timed at the client from the
    request to the reply's last byte. A pull's shape (ask over a kept connection, read a reply of that
    size) with nothing else: no engine thread, no pool, no checks; the fixed cost of asking and of the
    first bytes is in it, as it is in a pull, where a long stream (`tcp_rate`) has none. The exchanges
    are `gap_s` apart, the connection idle in between, as it is between the bench's pulls. Each end is a
    thread, in its namespace where one is named."""
    ready, result, errors = threading.Event(), {}, []
    server = threading.Thread(target=_guard(_answer, errors), args=(server_ns, host, nbytes, ready, result))
    server.start()
    if not ready.wait(10):
        raise RuntimeError(f"no TCP listener at {host}: {errors}")
    client = threading.Thread(target=_guard(_ask, errors), args=(client_ns, result["address"], nbytes, repeats, gap_s, result))
    client.start()
    client.join()
    server.join()
    if errors:
        raise errors[0]
    return [nbytes / seconds for seconds in result["seconds"]]


def _answer(namespace, host, nbytes, ready, result) -> None:
    if namespace:
        enter(namespace)
    payload = bytes(nbytes)
    with socket.create_server((host, 0)) as server:
        result["address"] = server.getsockname()[:2]
        ready.set()
        server.settimeout(30)
        conn, _ = server.accept()
        with conn:
            while conn.recv(4, socket.MSG_WAITALL):  # one request: its four bytes whole
                conn.sendall(payload)


def _ask(namespace, address, nbytes, repeats, gap_s, result) -> None:
    if namespace:
        enter(namespace)
    view, seconds = memoryview(bytearray(nbytes)), []
    with socket.create_connection(address, timeout=30) as client:
        for _ in range(repeats):
            time.sleep(gap_s)
            started = time.perf_counter()
            client.sendall(b"ask!")
            if (got := read_reply(client, view)) < nbytes:
                raise ConnectionError(f"the reply ended after {got} of {nbytes} bytes")
            seconds.append(time.perf_counter() - started)
    result["seconds"] = seconds


def read_reply(sock: socket.socket, view: memoryview) -> int:
    """Fill `view` with `recv_into` calls, each taking what has arrived, until it is full or the peer closed;
    the bytes read (`tcp_replies`' reading, which the migration bench reads pulls against)."""
    got = 0
    while got < len(view) and (n := sock.recv_into(view[got:])):
        got += n
    return got


def _guard(fn, errors: list):
    def run(*args):
        try:
            fn(*args)
        except BaseException as exc:  # noqa: BLE001 - handed to the caller, which raises it
            errors.append(exc)

    return run


def stop(proc: subprocess.Popen, grace_s: float) -> int:
    """SIGTERM, then after `grace_s` SIGKILL to its whole session; returns its exit status."""
    if proc.poll() is None:
        proc.send_signal(signal.SIGTERM)
        try:
            proc.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
    return proc.returncode


def _kill(pid: int) -> None:
    try:
        os.kill(pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True)


def _tc(namespace: str, *args: str) -> None:
    subprocess.run(["tc", "-n", namespace, *args], check=True, capture_output=True)

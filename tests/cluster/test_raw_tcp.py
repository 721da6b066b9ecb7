"""The raw TCP readings the migration benches read their pulls against (`orchard.cluster.bench.netns`), and the
pull tables' columns for them (`orchard.cluster.bench.migration_report`)."""

from __future__ import annotations

import socket

import pytest

from orchard.cluster.bench import netns
from orchard.cluster.bench.migration_report import Case, print_report, reply_cells


def test_each_exchange_moves_the_whole_reply_over_one_kept_connection(monkeypatch):
    listeners, accepted = [], []
    real_create_server, real_accept = socket.create_server, socket.socket.accept

    def create_server(*args, **kwargs):
        listeners.append(real_create_server(*args, **kwargs))
        return listeners[-1]

    def accept(self):
        pair = real_accept(self)
        if any(self is listener for listener in listeners):  # the reading's listener, no other test's
            accepted.append(pair)
        return pair

    monkeypatch.setattr(socket, "create_server", create_server)
    monkeypatch.setattr(socket.socket, "accept", accept)
    rates = netns.tcp_replies("127.0.0.1", 3 << 20, 4, gap_s=0.001)
    assert len(rates) == 4 and all(r > 0 for r in rates)
    assert len(accepted) == 1  # one connection, kept across the exchanges as a pull's is


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="thread placement is Linux's")
def test_a_stream_read_with_a_core_each_runs_each_end_on_its_core(monkeypatch):
    import os
    import threading

    real, placed = netns._place, {}

    def place(namespace, core):
        real(namespace, core)
        placed[threading.current_thread().name] = os.sched_getaffinity(0)

    monkeypatch.setattr(netns, "_place", place)
    rate = netns.tcp_rate("127.0.0.1", 8 << 20, sender_core=0, receiver_core=0)
    free = netns.tcp_rate("127.0.0.1", 8 << 20)
    assert rate > 0 and free > 0
    assert sorted(map(sorted, list(placed.values())[:2])) == [[0], [0]]  # the pinned reading's two ends
    assert all(len(cores) == len(os.sched_getaffinity(0)) for cores in list(placed.values())[2:])


def test_a_reply_cut_short_is_an_error_not_a_rate(monkeypatch):
    def answer_half(namespace, host, nbytes, ready, result):
        with socket.create_server((host, 0)) as server:
            result["address"] = server.getsockname()[:2]
            ready.set()
            conn, _ = server.accept()
            with conn:
                conn.recv(4)
                conn.sendall(bytes(nbytes // 2))

    monkeypatch.setattr(netns, "_answer", answer_half)
    with pytest.raises(ConnectionError, match="ended after"):
        netns.tcp_replies("127.0.0.1", 1 << 20, 2, gap_s=0.001)


def test_the_pull_table_reads_the_pulls_against_the_same_sized_replies(capsys):
    row = {"size": "small", "tokens": 2048, "bytes": 8 << 20, "wire_bytes": 8 << 20, "direct_Bps": 1.5e9,
           "direct_median_Bps": 1.0e9, "reply_Bps": 3.0e9, "reply_median_Bps": 2.5e9, "ray_Bps": 0.1e9,
           "transfer_Bps": 0.3e9}
    assert reply_cells(1.5e9, 1.0e9, row).split() == ["3.00/2.50", "50/40%"]
    print_report([3.0e9], [row], [Case("demo-small", 32, 0.01, 0.02, True, 0.005, 0.015)], True, "loopback")
    out = capsys.readouterr().out
    header = next(ln for ln in out.splitlines() if "direct pull GB/s" in ln)
    line = next(ln for ln in out.splitlines() if ln.startswith("demo-small") and "2048" in ln)
    assert "TCP reply GB/s" in header and "% reply" in header
    assert "3.00/2.50" in line and "50/40%" in line
    assert "1.50" in line and "50%" in line  # the best pull against the stream, as before

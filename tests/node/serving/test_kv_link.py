"""The direct KV path without Ray: two in-process engines, each with its listener. Pins the
handshake (wrong key, no key, replay, wrong node all refused and counted), pulls that give
the greedy tokens of recomputing, and damaged, cut-off and foreign replies refused with the
failure counted and the request recomputed exactly."""

from __future__ import annotations

import asyncio
import select
import socket
import threading
import time
from contextlib import contextmanager
from dataclasses import replace

import pytest

from orchard.kvcache import block_transfer, wire_compressed
from orchard.kvcache.block_landing import BlockLanding, LandingPart
from orchard.kvcache.events import BlockRemoved, BlockStored
from orchard.kvcache.hashing import BlockHash
from orchard.kvcache.wire_transit import IncomingPayload
from orchard.node.async_engine import AsyncEngine
from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.serving import direct_path, kv_link, link_io
from orchard.node.serving import link_auth as auth
from orchard.node.serving.direct_path import DirectPath
from orchard.node.serving.kv_link import KVLinkConfig, connect
from orchard.node.serving.link_auth import LinkRefused
from orchard.node.serving.migration import BlockMover
from orchard.node.types import SamplingParams

BS = 16
KEY = auth.link_key("a-cluster-token-of-at-least-32-characters")
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
# Two demo blocks a chunk: several chunks. Replies from kept threads whatever this machine's cores (the default's
# choice, `test_replies_go_from_kept_threads_by_default_only_where_the_process_has_two_cores_or_fewer`).
# One connection a pull unless a test says (`nodes` runs each test over one connection and over two).
CONFIG = KVLinkConfig(chunk_bytes=2 * 65536, handshake_timeout_s=2.0, reply_from_kept_thread=True, connections_per_pull=1)


def prompt(seed: int, length: int = 90) -> list[int]:
    return [(seed * 29 + j * 5) % 2000 + 10 for j in range(length)]


@contextmanager
def linked(names: str, engine_config: EngineConfig, link_config: KVLinkConfig = CONFIG):
    """(loop, paths): an engine named by each letter of `names`, each with its direct path listening, on one
    event loop; all closed afterwards."""
    loop = asyncio.new_event_loop()
    engines = [AsyncEngine(LLMEngine(engine_config)) for _ in names]
    paths = {name: DirectPath(BlockMover(e), name, KEY, link_config) for name, e in zip(names, engines)}
    try:
        for path in paths.values():
            path.start()
        yield loop, paths
    finally:
        for path in paths.values():
            path.close()
        for e in engines:
            e.shutdown()
        loop.close()


@pytest.fixture(scope="module", params=[1, 2], ids=["one connection", "two connections"])
def nodes(request):
    """Source "a" and target "b" (and "c"), each an engine with its listener, on one event loop; pulls over one
    connection, each received on a thread started for it, then (a second set of nodes) over two at once, on
    threads kept between pulls, as where a process has more than two cores: a 90-token prompt's five blocks are
    three chunks, asked for as four blocks on one connection and one on the other."""
    config = replace(CONFIG, connections_per_pull=request.param, receive_on_kept_thread=request.param > 1)
    with linked("abc", EngineConfig(block_size=BS, num_blocks=64, max_num_batched_tokens=128), config) as linked_nodes:
        yield linked_nodes


def resolves_to(path: DirectPath):
    """A `resolve` for `DirectPath.pull` and `probe`: any peer is at `path`'s listener."""
    async def resolve(_peer):
        return path.address
    return resolve


async def generate(path: DirectPath, request_id: str, tokens: list[int]):
    last = None
    async for out in path.mover.engine.generate(request_id, tokens, GREEDY):
        last = out
    return last.outputs[0].token_ids, last.num_cached_tokens


def hashes_of(path: DirectPath, tokens: list[int]) -> list[BlockHash]:
    return path.mover.engine.engine.kv.block_hashes(tokens)


def pull(loop, paths, tokens, source="a", target="b", address=None):
    """Cache `tokens` on the source, pull them to the target; (result, migrated run, reference run)."""
    async def run():
        reference = await generate(paths[source], f"cache-{tokens[0]}-{len(tokens)}", tokens)

        async def resolve(_peer):
            return address or paths[source].address

        result = await paths[target].pull(source, hashes_of(paths[source], tokens), resolve)
        return result, await generate(paths[target], f"after-{tokens[0]}", tokens), reference

    return loop.run_until_complete(run())


# ---- the handshake ------------------------------------------------------------------------


def test_a_wrong_key_is_refused_and_counted(nodes):
    _, paths = nodes
    server = paths["a"].server
    refused = server.counters.refused
    with pytest.raises(LinkRefused):
        connect(server.address, auth.link_key("another-cluster-token-of-32-characters!"), "a", CONFIG)
    assert wait_until(lambda: server.counters.refused == refused + 1)
    assert paths["a"].refused == server.counters.refused


def test_a_client_without_the_handshake_is_refused_before_anything_is_read(nodes):
    _, paths = nodes
    server = paths["a"].server
    refused, accepted = server.counters.refused, server.counters.accepted
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        hello = sock.recv(64)
        assert hello.startswith(auth.MAGIC)
        sock.sendall(b"\0" * 4 + b"GET / HTTP/1.1\r\n\r\n" + bytes(64))  # a request with no proof
        assert closed_without_reply(sock)
    assert wait_until(lambda: server.counters.refused == refused + 1)
    assert server.counters.accepted == accepted


def test_a_replayed_handshake_is_refused(nodes):
    _, paths = nodes
    server = paths["a"].server
    host, port = server.address.rsplit(":", 1)
    with socket.create_connection((host, int(port)), timeout=5) as sock:  # a genuine exchange, recorded
        server_nonce = sock.recv(len(auth.MAGIC) + auth.NONCE_SIZE)[len(auth.MAGIC):]
        nonce = auth.new_nonce()
        recorded = nonce + auth.client_proof(KEY, server_nonce, nonce)
        sock.sendall(recorded)
        assert len(sock.recv(auth.PROOF_SIZE + 2)) == auth.PROOF_SIZE + 2
    refused = server.counters.refused
    with socket.create_connection((host, int(port)), timeout=5) as sock:
        sock.recv(len(auth.MAGIC) + auth.NONCE_SIZE)  # a fresh nonce the recording does not answer
        sock.sendall(recorded)
        assert closed_without_reply(sock)
    assert wait_until(lambda: server.counters.refused == refused + 1)


def test_a_listener_of_another_node_is_not_taken_for_the_source(nodes):
    _, paths = nodes
    with pytest.raises(LinkRefused, match="not node 'a'"):
        connect(paths["c"].address, KEY, "a", CONFIG)


# ---- pulls ----------------------------------------------------------------------------


def test_direct_pull_gives_the_greedy_tokens_of_recomputing_and_is_a_prefix_hit(nodes):
    loop, paths = nodes
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(1))
    assert (result.ok, result.via, result.requested, result.local, result.imported) == (True, "direct", 5, 0, 5)
    assert result.bytes > 5 * paths["a"].mover.geometry.bytes_per_block
    assert (migrated, hit) == (reference, 5 * BS)
    assert paths["b"].mover.counters.migrated_blocks >= 5


def test_a_direct_pull_goes_layer_major_in_several_chunks_and_decodes_token_exact(nodes, monkeypatch):
    loop, paths = nodes
    chunks = []
    real = kv_link.layer_pieces
    monkeypatch.setattr(kv_link, "layer_pieces", lambda geometry, chunk: chunks.append(len(chunk.hashes)) or real(geometry, chunk))
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(31))
    assert (result.ok, result.imported, sorted(chunks)) == (True, 5, [1, 2, 2])
    if paths["b"].config.pull_connections() == 1:
        assert chunks == [2, 2, 1]  # in the run's order (over two connections, 4 blocks on one and 1 on the other)
    assert (migrated, hit) == (reference, 5 * BS)


@pytest.mark.parametrize("kept", [True, False])
def test_each_reply_goes_from_a_kept_thread_or_the_connections_own_as_configured_and_its_failure_ends_it(monkeypatch, kept):
    senders, readers = [], []
    real, real_read = link_io.send_payload, kv_link._read_request
    monkeypatch.setattr(link_io, "send_payload", lambda sock, pieces: senders.append(threading.current_thread())
                        or real(sock, pieces))
    monkeypatch.setattr(kv_link, "_read_request", lambda conn: readers.append(threading.current_thread())
                        or real_read(conn))
    engine_config = EngineConfig(block_size=BS, num_blocks=64, max_num_batched_tokens=128)
    with linked("ab", engine_config, replace(CONFIG, reply_from_kept_thread=kept)) as (loop, paths):
        first, _, _ = pull(loop, paths, prompt(74))
        made = kv_link.SENDERS.made
        second, _, _ = pull(loop, paths, prompt(75))
        assert first.ok and second.ok and len(senders) == 6
        if kept:
            assert {t.name for t in senders} == {"kv-link-send"} and not set(senders) & set(readers)
            assert kv_link.SENDERS.made == made  # the second reply went from a thread kept idle, none made for it
        else:
            assert {t.name for t in senders} == {"kv-link-conn"} and set(senders) == set(readers)
        accepted = paths["a"].server.counters.accepted
        monkeypatch.setattr(link_io, "send_payload", lambda sock, pieces: (_ for _ in ()).throw(OSError("gone")))
        broken, _, _ = pull(loop, paths, prompt(76))
        monkeypatch.setattr(link_io, "send_payload", real)
        after, _, _ = pull(loop, paths, prompt(77))
        assert not broken.ok and after.ok and paths["a"].server.counters.accepted == accepted + 1  # a new connection


@pytest.mark.parametrize(("cores", "configured", "kept"), [(1, None, True), (2, None, True), (3, None, False),
                                                           (16, None, False), (2, False, False), (16, True, True)])
def test_replies_go_from_kept_threads_by_default_only_where_the_process_has_two_cores_or_fewer(monkeypatch, cores,
                                                                                                configured, kept):
    monkeypatch.setattr(kv_link, "usable_cores", lambda: cores)
    server = kv_link.KVLinkServer(KEY, "a", None, export=None, release=None,
                                  config=KVLinkConfig(reply_from_kept_thread=configured))
    try:
        assert server.replies_from_kept_threads is kept
    finally:
        server.close()


@pytest.mark.parametrize("kept", [True, False])
def test_a_pulls_receive_loop_runs_on_a_thread_kept_between_pulls_or_on_one_started_for_it(nodes, kept, monkeypatch):
    loop, paths = nodes
    monkeypatch.setattr(paths["b"], "config", replace(paths["b"].config, receive_on_kept_thread=kept))
    started = []
    real_start = threading.Thread.start
    monkeypatch.setattr(threading.Thread, "start", lambda thread: started.append(thread.name) or real_start(thread))
    pull(loop, paths, prompt(84 if kept else 86))
    made, started[:] = kv_link.RECEIVERS.made, []
    tokens = prompt(85 if kept else 87)
    connections = len(paths["b"]._parts(hashes_of(paths["a"], tokens), compress=False))
    result, (migrated, hit), (reference, _) = pull(loop, paths, tokens)
    assert (result.ok, result.imported, kv_link.RECEIVERS.made) == (True, 5, made)  # no kept thread made for it
    assert started.count("kv-link-recv") == (0 if kept else connections)  # one a connection
    assert (migrated, hit) == (reference, 5 * BS)


@pytest.mark.parametrize(("cores", "configured", "kept"), [(1, None, False), (2, None, False), (3, None, True),
                                                           (16, None, True), (16, False, False), (2, True, True)])
def test_pulls_are_received_on_kept_threads_by_default_only_where_the_process_has_more_than_two_cores(
        monkeypatch, cores, configured, kept):
    monkeypatch.setattr(kv_link, "usable_cores", lambda: cores)
    assert KVLinkConfig(receive_on_kept_thread=configured).receives_on_kept_threads() is kept


@pytest.mark.parametrize(("cores", "configured", "connections"), [(1, None, 1), (2, None, 1), (3, None, 2),
                                                                  (16, None, 2), (16, 1, 1), (2, 3, 3)])
def test_pulls_spread_over_two_connections_by_default_only_where_the_process_has_more_than_two_cores(
        monkeypatch, cores, configured, connections):
    monkeypatch.setattr(kv_link, "usable_cores", lambda: cores)
    assert KVLinkConfig(connections_per_pull=configured).pull_connections() == connections
    with pytest.raises(ValueError):
        KVLinkConfig(connections_per_pull=0)


def test_a_pull_over_two_connections_asks_for_its_run_in_parts_of_whole_chunks_each_placed_by_a_thread_of_its_own(
        monkeypatch):
    """Five blocks, two a chunk: four blocks asked on one connection and one on the other, each part read
    straight into the pool by its own receive thread; both connections kept for the next pull."""
    asked, placers = [], set()
    real_read, real_place = kv_link._read_request, IncomingPayload.place
    monkeypatch.setattr(kv_link, "_read_request", lambda conn: (request := real_read(conn)) and asked.append(
        len(request["hashes"])) or request)
    monkeypatch.setattr(IncomingPayload, "place", lambda self, *a: (placed := real_place(self, *a))
                        and placers.add(threading.get_ident()) or placed)
    engine_config = EngineConfig(block_size=BS, num_blocks=64, max_num_batched_tokens=128)
    with linked("ab", engine_config, replace(CONFIG, connections_per_pull=2)) as (loop, paths):
        result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(78))
        assert (result.ok, result.imported, sorted(asked), len(placers)) == (True, 5, [1, 4], 2)
        assert (migrated, hit) == (reference, 5 * BS)
        accepted = paths["a"].server.counters.accepted
        again, (migrated, hit), (reference, _) = pull(loop, paths, prompt(79, length=40))  # two blocks: one chunk
        assert (again.ok, again.imported, sorted(asked)) == (True, 2, [1, 2, 4])
        assert (migrated, hit) == (reference, 2 * BS) and paths["a"].server.counters.accepted == accepted
        assert len(paths["b"]._idle["a"]) == 2  # the one the last pull did not use is still kept


def test_a_pull_at_the_default_chunk_size_goes_as_one_chunk_on_each_of_its_two_connections(monkeypatch):
    """Forty blocks (2.5 MiB of the demo model's KV) at the link's default chunk size: twenty blocks asked on
    each connection, each sent as one chunk and read straight into the pool, token exact."""
    asked, chunks = [], []
    real_read, real_pieces = kv_link._read_request, kv_link.layer_pieces
    monkeypatch.setattr(kv_link, "_read_request", lambda conn: (request := real_read(conn)) and asked.append(
        (len(request["hashes"]), request["chunk_bytes"])) or request)
    monkeypatch.setattr(kv_link, "layer_pieces", lambda geometry, chunk: chunks.append(len(chunk.hashes))
                        or real_pieces(geometry, chunk))
    engine_config = EngineConfig(block_size=BS, num_blocks=128, max_num_batched_tokens=256)
    config = replace(CONFIG, chunk_bytes=KVLinkConfig().chunk_bytes, connections_per_pull=2, receive_on_kept_thread=True)
    with linked("ab", engine_config, config) as (loop, paths):
        result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(80, length=40 * BS + 8))
        per_block = paths["b"].mover.geometry.bytes_per_block
    assert (result.ok, result.imported, result.bytes >= 40 * per_block) == (True, 40, True)
    assert sorted(asked) == [(20, 20 * per_block), (20, 20 * per_block)] and chunks == [20, 20]
    assert (migrated, hit) == (reference, 40 * BS)


def test_a_run_is_asked_for_in_parts_of_whole_chunks_only_where_its_chunks_land_in_any_order(nodes, monkeypatch):
    """Two blocks a chunk: parts of whole chunks, as many as the connections and chunks allow; one part for
    compressed chunks, a hybrid model's run, a pool not in host memory, or a run of one chunk."""
    _, paths = nodes
    path = paths["b"]
    monkeypatch.setattr(path, "config", replace(path.config, connections_per_pull=2))
    run = [BlockHash(bytes([n]) * 16) for n in range(7)]  # four chunks
    assert path._parts(run, compress=False) == [run[:4], run[4:]]
    assert path._parts(run[:5], compress=False) == [run[:4], run[4:5]]
    assert path._parts(run[:2], compress=False) == [run[:2]]
    monkeypatch.setattr(path, "config", replace(path.config, connections_per_pull=3))
    assert path._parts(run, compress=False) == [run[:4], run[4:]]  # four chunks: parts of two, not three parts
    assert path._parts(run, compress=True) == [run] and path._parts(run, False, split=False) == [run]
    monkeypatch.setattr(direct_path, "host_memory", lambda: False)
    assert path._parts(run, compress=False) == [run]
    monkeypatch.setattr(direct_path, "host_memory", lambda: True)
    monkeypatch.setattr(type(path.mover), "state_geometry", property(lambda _mover: object()))
    assert path._parts(run, compress=False) == [run]


def test_a_pull_over_two_connections_whose_source_holds_part_of_the_run_caches_its_leading_blocks_only(monkeypatch):
    """The source holds three of eight blocks: the first connection's reply carries those three, the second's
    none; the blocks reserved for the rest are freed."""
    engine_config = EngineConfig(block_size=BS, num_blocks=64, max_num_batched_tokens=128)
    with linked("ab", engine_config, replace(CONFIG, connections_per_pull=2)) as (loop, paths):
        tokens = prompt(80, length=8 * BS + 3)
        loop.run_until_complete(generate(paths["a"], "held-80", tokens[: 3 * BS + 1]))
        result = loop.run_until_complete(paths["b"].pull("a", hashes_of(paths["a"], tokens), resolves_to(paths["a"])))
        assert (result.ok, result.requested, result.imported) == (True, 8, 3)
        manager = paths["b"].mover.engine.engine.kv.manager
        assert manager.num_cached == 3 and manager.num_used == 0
        (migrated, hit), (reference, _) = loop.run_until_complete(generate(paths["b"], "after-80", tokens[: 3 * BS + 1])), \
            loop.run_until_complete(generate(paths["a"], "again-80", tokens[: 3 * BS + 1]))
        assert (migrated, hit) == (reference, 3 * BS)


@pytest.mark.skipif(not hasattr(__import__("os"), "sched_setaffinity"), reason="the OS sets no affinity")
def test_the_usable_cores_are_those_the_process_may_run_on():
    """A node pinned to one core (taskset, a container's cpuset) counts one, whatever the machine has."""
    import subprocess
    import sys

    pinned = ("import os; from orchard.node.serving import kv_link; "
              "os.sched_setaffinity(0, {min(os.sched_getaffinity(0))}); print(kv_link.usable_cores())")
    assert subprocess.run([sys.executable, "-c", pinned], capture_output=True, text=True, check=True).stdout.strip() == "1"
    assert kv_link.usable_cores() >= 1


def test_the_source_engine_thread_only_pins_and_the_links_thread_makes_each_chunks_rows(nodes, monkeypatch):
    loop, paths = nodes
    rows_made = []
    real = block_transfer.token_rows
    monkeypatch.setattr(block_transfer, "token_rows", lambda tokens: rows_made.append(threading.current_thread().name)
                        or real(tokens))
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(71))
    assert result.ok and rows_made == ["kv-link-send"] * 3  # a chunk each, none on the engine thread
    assert (migrated, hit) == (reference, 5 * BS)


@pytest.mark.parametrize("compress", ["never", "always"])
def test_a_bfloat16_pool_is_pulled_layer_major_straight_from_and_into_its_arrays(monkeypatch, compress):
    """bfloat16 KV (most models') has no numpy dtype: the pool's views of it are uint16 over the same
    buffers, so its pulls take the same path as any, plain or compressed, and land token exact."""
    config = EngineConfig(block_size=BS, num_blocks=32, max_num_batched_tokens=128, dtype="bfloat16")
    chunks = []
    real = kv_link.layer_pieces
    monkeypatch.setattr(kv_link, "layer_pieces", lambda geometry, chunk: chunks.append(len(chunk.hashes)) or real(geometry, chunk))
    monkeypatch.setattr(kv_link, "payload_pieces", lambda *a: pytest.fail("version 2 sent"))
    with linked("ab", config, replace(CONFIG, compress=compress)) as (loop, paths):
        result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(51))
    assert paths["a"].mover.geometry.dtype == "bfloat16"
    assert (result.ok, result.imported, chunks) == (True, 5, [4, 1])
    assert (result.wire_bytes < result.bytes) == (compress == "always")
    assert (migrated, hit) == (reference, 5 * BS)


def pull_while_decoding(loop, paths, tokens):
    """`pull`, with the target decoding another sequence all the while (its engine thread stepping)."""
    async def run():
        reference = await generate(paths["a"], f"cache-{tokens[0]}", tokens)
        engine = paths["b"].mover.engine
        busy = asyncio.ensure_future(generate_many(engine, f"busy-{tokens[0]}"))
        while not engine.stats().get("running"):
            await asyncio.sleep(0.01)
        result = await paths["b"].pull("a", hashes_of(paths["a"], tokens), resolves_to(paths["a"]))
        running = engine.stats().get("running")
        await engine.abort(f"busy-{tokens[0]}")
        await busy
        return result, running, await generate(paths["b"], f"after-{tokens[0]}", tokens), reference

    return loop.run_until_complete(run())


async def generate_many(engine, request_id: str) -> None:
    async for _ in engine.generate(request_id, prompt(99, 20), SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True)):
        pass


def counting(monkeypatch, kv):
    """Record the threads that read chunks straight into the pool, land chunks from a buffer, list landed
    blocks as a run goes on and adopt runs, and the chunks imported on the engine thread."""
    seen = {"place": [], "land": [], "adopt_landed": [], "adopt": [], "import": []}
    real_land, real_adopt, real_import = LandingPart.land, BlockLanding.adopt, kv.import_decoded
    real_adopt_landed = BlockLanding.adopt_landed
    monkeypatch.setattr(BlockLanding, "adopt_landed", lambda self: seen["adopt_landed"].append(
        threading.current_thread().name) or real_adopt_landed(self))
    real_place = IncomingPayload.place
    monkeypatch.setattr(IncomingPayload, "place", lambda self, *a: (placed := real_place(self, *a))
                        and seen["place"].append(threading.current_thread().name) or placed)
    monkeypatch.setattr(LandingPart, "land", lambda self, blocks: seen["land"].append(threading.current_thread().name)
                        or real_land(self, blocks))
    monkeypatch.setattr(BlockLanding, "adopt", lambda self: seen["adopt"].append(threading.current_thread().name)
                        or real_adopt(self))
    monkeypatch.setattr(kv, "import_decoded", lambda blocks, state=None: seen["import"].append(len(blocks))
                        or real_import(blocks, state))
    return seen


def test_a_stepping_targets_pull_is_read_straight_into_its_pool_and_cached_in_one_engine_call(nodes, monkeypatch):
    loop, paths = nodes
    kv = paths["b"].mover.engine.engine.kv
    seen = counting(monkeypatch, kv)
    result, running, (migrated, hit), (reference, _) = pull_while_decoding(loop, paths, prompt(34))
    assert running == 1 and (result.ok, result.imported, result.bytes) == (True, 5, result.wire_bytes)
    assert len(seen["place"]) == 3 and all(name == "kv-link-recv" for name in seen["place"]) and seen["land"] == []
    assert len(seen["adopt"]) == 1 and not seen["adopt"][0].startswith("kv-") and seen["import"] == []
    assert seen["adopt_landed"] == seen["adopt"] * 3  # listed chunk by chunk between steps, on the engine thread
    assert (migrated, hit) == (reference, 5 * BS)
    assert kv.manager.num_used == 0  # every reserved block adopted or freed


def test_an_idle_target_reads_each_chunk_straight_into_its_pool_too_and_lists_them_in_one_call_on_its_receive_thread(
        nodes, monkeypatch):
    """The idle engine is lent to the receive thread for the closing call: no engine thread is woken."""
    loop, paths = nodes
    seen = counting(monkeypatch, paths["b"].mover.engine.engine.kv)
    real_finish = kv_link.LinkStream._finish  # the reply's end waits until the engine thread is back waiting:
    monkeypatch.setattr(kv_link.LinkStream, "_finish",  # on a loaded machine it may still be leaving `_plan`'s call
                        lambda stream, last: until_idle(paths["b"].mover.engine) or real_finish(stream, last))
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(36))
    assert (result.ok, result.imported, len(seen["place"])) == (True, 5, 3)
    assert seen["adopt_landed"] == [] and seen["adopt"] == ["kv-link-recv"]  # one call at the end, on that thread
    assert (seen["import"], seen["land"]) == ([], [])
    assert (migrated, hit) == (reference, 5 * BS)


def test_compressed_chunks_are_landed_off_a_stepping_engine_thread_and_imported_by_an_idle_one(nodes, monkeypatch):
    """A compressed frame is inflated into a buffer first, so it cannot be read straight into the pool:
    while the engine steps the landing thread copies it there; an idle engine thread imports it."""
    loop, paths = nodes
    kv = paths["b"].mover.engine.engine.kv
    compressing(paths, monkeypatch)
    seen = counting(monkeypatch, kv)
    result, running, (migrated, hit), (reference, _) = pull_while_decoding(loop, paths, prompt(37))
    assert running == 1 and (result.ok, result.imported, seen["place"], seen["import"]) == (True, 5, [], [])
    assert len(seen["land"]) == 3 and all(name.startswith("kv-land") for name in seen["land"])
    assert (migrated, hit) == (reference, 5 * BS)
    seen = counting(monkeypatch, kv)
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(38))
    assert (result.ok, result.imported, seen["import"], seen["land"], seen["place"]) == (True, 5, [2, 2, 1], [], [])
    assert (migrated, hit) == (reference, 5 * BS)
    assert kv.manager.num_used == 0


def test_where_the_pool_cannot_be_viewed_chunks_are_imported_on_the_engine_thread(nodes, monkeypatch):
    """A device whose arrays numpy cannot address (`KVPool.layer_views` None): no landing, even while
    the engine steps; each chunk imported by the engine thread as it arrives."""
    loop, paths = nodes
    kv = paths["b"].mover.engine.engine.kv
    monkeypatch.setattr(kv.transfer.pool, "layer_views", lambda: None)
    seen = counting(monkeypatch, kv)
    result, running, (migrated, hit), (reference, _) = pull_while_decoding(loop, paths, prompt(35))
    assert running == 1 and (result.ok, result.imported, seen["import"], seen["land"]) == (True, 5, [2, 2, 1], [])
    assert (migrated, hit) == (reference, 5 * BS)


def test_a_source_that_does_not_offer_layer_major_answers_in_version_2_and_the_pull_still_lands(nodes, monkeypatch):
    loop, paths = nodes
    monkeypatch.setattr(paths["a"].server, "_export_layers", None)  # a source of before version 3
    monkeypatch.setattr(kv_link, "layer_pieces", lambda *a: pytest.fail("version 3 sent"))
    versions = []
    real = kv_link.payload_pieces
    monkeypatch.setattr(kv_link, "payload_pieces", lambda *a: versions.append(2) or real(*a))
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(32))
    assert (result.ok, result.imported, versions) == (True, 5, [2, 2, 2])
    assert (migrated, hit) == (reference, 5 * BS)


def test_a_run_that_goes_on_to_disk_or_a_pool_numpy_cannot_view_is_not_laid_out_layer_major(nodes, monkeypatch):
    loop, paths = nodes
    kv = paths["a"].mover.engine.engine.kv
    tokens = prompt(33)
    loop.run_until_complete(generate(paths["a"], "layers-33", tokens))
    hashes = hashes_of(paths["a"], tokens)
    pinned, run = kv.pin_layer_export(hashes)
    assert len(run) == len(pinned) == 5 and run.chunk(0, 5).tokens.tolist()[0] == tokens[:BS]
    kv.unpin_export(pinned)
    monkeypatch.setattr(kv.transfer, "_on_disk", lambda h: True)
    assert kv.pin_layer_export([*hashes, BlockHash(bytes(16))]) is None
    monkeypatch.setattr(kv.transfer.pool, "layer_views", lambda: None)
    assert kv.pin_layer_export(hashes) is None


def test_a_pull_returns_once_every_chunk_is_imported_and_its_kv_events_are_published(nodes):
    """Many chunks, each imported by a call that publishes nothing: the pull's closing engine call
    runs after all of them and publishes their events before the pull returns."""
    loop, paths = nodes
    published = []
    paths["b"].mover.engine.add_kv_listener(published.extend)
    tokens = prompt(21, length=16 * 12)

    async def run():
        await generate(paths["a"], "cache-21", tokens)
        result = await paths["b"].pull("a", hashes_of(paths["a"], tokens), resolves_to(paths["a"]))
        return result, [e.block_hash for e in published if isinstance(e, BlockStored)]

    result, stored = loop.run_until_complete(run())
    assert (result.ok, result.imported) == (True, 12)  # six chunks of two blocks
    assert stored == hashes_of(paths["a"], tokens)


def test_a_pull_that_evicts_to_make_room_hands_its_kv_events_over_once_with_its_closing_call():
    """Reserving a pull's blocks in a full pool evicts cached ones; those events go to the listeners with the
    pull's closing call, in one hand-over with the blocks it stored, not in one of their own at its start: a
    node actor sends each hand-over to the coordinator in a Ray call."""
    handed = []
    tokens = prompt(41, length=BS * 12)
    with linked("ab", EngineConfig(block_size=BS, num_blocks=24, max_num_batched_tokens=128)) as (loop, paths):
        async def run():
            await generate(paths["b"], "fill", prompt(40, length=BS * 20))  # b's pool nearly all cached blocks
            await generate(paths["a"], "cache", tokens)
            paths["b"].mover.engine.add_kv_listener(lambda events: handed.append(list(events)))
            return await paths["b"].pull("a", hashes_of(paths["a"], tokens), resolves_to(paths["a"]))

        result = loop.run_until_complete(run())
    assert (result.ok, result.imported) == (True, 12)
    batches = [batch for batch in handed if batch]
    assert len(batches) == 1
    assert {type(e) for e in batches[0]} == {BlockRemoved, BlockStored}
    assert [e.block_hash for e in batches[0] if isinstance(e, BlockStored)] == hashes_of(paths["b"], tokens)


class HoldingSink:
    """Keeps every chunk's buffer, as a target whose engine thread is slow to import would."""

    def __init__(self):
        self.chunks, self.told_end, self.ended = threading.Event(), threading.Event(), 0

    def __call__(self, buffer, size, payload):
        self.chunks.set()

    def placed(self, size):
        raise AssertionError("no landing was given")

    def end(self):
        self.ended += 1
        self.told_end.set()


class ReturningSink(HoldingSink):
    """Gives each chunk's buffer back at once, keeping its size."""

    def __init__(self, stream):
        super().__init__()
        self.stream, self.sizes = stream, []

    def __call__(self, buffer, size, payload):
        self.sizes.append(size)
        self.stream.done(buffer)


def test_the_receive_thread_reads_nothing_of_the_reply_before_it_knows_where_the_chunks_go(nodes):
    """The reply waits in the kernel until `take`: the thread that gives the sink wakes the receive thread."""
    loop, paths = nodes
    tokens = prompt(72)

    async def run():
        await generate(paths["a"], "cache-72", tokens)
        sock = await asyncio.to_thread(connect, paths["a"].address, KEY, "a", CONFIG)
        stream = kv_link.LinkStream(sock, [bytearray(), bytearray()], paths["a"].mover.geometry)
        stream.start(hashes_of(paths["a"], tokens), CONFIG.chunk_bytes)
        readable, _, _ = await asyncio.to_thread(select.select, [sock], [], [], 5)  # the source has answered
        await asyncio.sleep(0.1)  # and the receive thread had time to read, were it reading
        waiting = sock.recv(8, socket.MSG_PEEK | socket.MSG_DONTWAIT) if readable else b""
        sink = ReturningSink(stream)
        stream.take(sink)
        assert await asyncio.to_thread(sink.told_end.wait, 5)
        return waiting, sink.sizes, stream.failure, stream.release() is sock

    waiting, sizes, failure, kept = loop.run_until_complete(run())
    assert len(sizes) == 3 and (failure, kept) == (None, True)
    assert link_io.U64.unpack(waiting) == (sizes[0],)  # the first chunk's length, still unread in the kernel


def test_a_pull_given_up_while_its_chunks_wait_for_a_buffer_ends_at_once_with_an_error(nodes):
    """One buffer, held by the sink: the receive thread reads the next chunk's length and waits for a
    buffer. Closing the stream then (a refused chunk does) ends the pull with an error and tells the sink
    the end once; the caller is not left waiting."""
    loop, paths = nodes
    tokens = prompt(51)

    async def run():
        await generate(paths["a"], "cache-51", tokens)
        sock = await asyncio.to_thread(connect, paths["a"].address, KEY, "a", CONFIG)
        sink = HoldingSink()
        stream = kv_link.LinkStream(sock, [bytearray()], paths["a"].mover.geometry)
        stream.take(sink)
        stream.start(hashes_of(paths["a"], tokens), CONFIG.chunk_bytes)
        await asyncio.to_thread(sink.chunks.wait, 5)
        await asyncio.sleep(0.2)  # the next chunk's length read, the thread waiting for a buffer
        stream.close()
        assert await asyncio.to_thread(sink.told_end.wait, 5)
        await stream.stopped()
        return sink.ended, type(stream.failure), stream._ready.qsize(), stream.release()

    assert loop.run_until_complete(run()) == (1, ConnectionError, 0, None)  # the sink, not the event loop, told


def until_idle(engine: AsyncEngine, timeout_s: float = 5.0) -> None:
    """Wait until `engine`'s thread waits for commands, as it does between requests once a step's outputs
    and events are handed over."""
    deadline = time.monotonic() + timeout_s
    while not engine._commands.borrow():
        assert time.monotonic() < deadline, "the engine thread never went idle"
        time.sleep(0.001)
    engine._commands.give_back()


def planning_threads(monkeypatch, target: DirectPath) -> list[str]:
    """The names of the threads `target` plans its pulls on, in order, as they plan them."""
    planned = []
    real = target._plan_and_take
    monkeypatch.setattr(target, "_plan_and_take", lambda *a: planned.append(threading.current_thread().name)
                        or real(*a))
    return planned


def pull_into_idle(loop, paths, n: int):
    """Cache `prompt(n)` on a, pull it into b once b's engine idles: (the result, the tokens)."""
    tokens = prompt(n)
    loop.run_until_complete(generate(paths["a"], f"cache-{n}", tokens))
    until_idle(paths["b"].mover.engine)
    return loop.run_until_complete(paths["b"].pull("a", hashes_of(paths["a"], tokens), resolves_to(paths["a"]))), tokens


def test_an_idle_target_plans_its_pull_on_its_event_loops_thread_and_a_stepping_one_on_its_engine_thread(
        nodes, monkeypatch):
    loop, paths = nodes
    target = paths["b"]
    planned = planning_threads(monkeypatch, target)
    idle, tokens = pull_into_idle(loop, paths, 143)
    assert idle.ok and idle.imported == len(tokens) // BS and planned == [threading.current_thread().name]
    planned.clear()

    async def pull_while_the_target_decodes():
        tokens = prompt(144)
        await generate(paths["a"], "cache-144", tokens)
        busy = asyncio.ensure_future(generate_many(target.mover.engine, "busy-144"))
        while not target.mover.engine.stats().get("running"):
            await asyncio.sleep(0.01)
        result = await target.pull("a", hashes_of(paths["a"], tokens), resolves_to(paths["a"]))
        await target.mover.engine.abort("busy-144")
        await busy
        return result, tokens

    stepping, tokens = loop.run_until_complete(pull_while_the_target_decodes())
    assert stepping.ok and stepping.imported == len(tokens) // BS and planned == ["orchard-engine"]


def test_a_target_with_a_cold_tier_plans_its_pull_on_its_engine_thread_even_while_idle(nodes, monkeypatch, tmp_path):
    """Its reservation may spill evicted blocks to disk through MLX, which only the engine thread may do."""
    from orchard.kvcache.cold_tier import ColdTier

    loop, paths = nodes
    kv = paths["b"].mover.engine.engine.kv
    monkeypatch.setattr(kv, "cold", ColdTier(tmp_path, kv.geometry, 1 << 20))
    planned = planning_threads(monkeypatch, paths["b"])
    result, tokens = pull_into_idle(loop, paths, 145)
    assert result.ok and result.imported == len(tokens) // BS and planned == ["orchard-engine"]


def test_an_idle_source_pins_and_unpins_on_its_links_thread_and_a_stepping_one_on_its_engine_thread(nodes, monkeypatch):
    loop, paths = nodes
    kv = paths["a"].mover.engine.engine.kv
    seen = {"pin": [], "unpin": []}
    for name, method in (("pin", "pin_layer_export"), ("unpin", "unpin_export")):
        real = getattr(kv, method)
        monkeypatch.setattr(kv, method, lambda *a, real=real, name=name: seen[name].append(
            threading.current_thread().name) or real(*a))
    source = paths["a"].mover.engine
    tokens = prompt(141, length=40)  # one chunk: one request, over one connection or two
    loop.run_until_complete(generate(paths["a"], "cache-141", tokens))
    until_idle(source)  # its last step handed over: a call made now is lent, not queued
    idle = loop.run_until_complete(paths["b"].pull("a", hashes_of(paths["a"], tokens), resolves_to(paths["a"])))
    assert idle.ok and seen == {"pin": ["kv-link-send"], "unpin": ["kv-link-send"]}
    seen["pin"].clear(), seen["unpin"].clear()

    async def pull_while_the_source_decodes():
        tokens = prompt(142, length=40)
        await generate(paths["a"], "cache-142", tokens)
        busy = asyncio.ensure_future(generate_many(source, "busy-142"))
        while not source.stats().get("running"):
            await asyncio.sleep(0.01)
        result = await paths["b"].pull("a", hashes_of(paths["a"], tokens), resolves_to(paths["a"]))
        await source.abort("busy-142")
        await busy
        return result

    stepping = loop.run_until_complete(pull_while_the_source_decodes())
    assert stepping.ok and seen == {"pin": ["orchard-engine"], "unpin": ["orchard-engine"]}


def test_the_source_unpins_a_sent_run_once_the_reply_went(nodes):
    """The link's thread does not wait for the unpin; the engine thread runs it before any later call."""
    loop, paths = nodes
    tokens = prompt(73)
    result, _, _ = pull(loop, paths, tokens)
    source = paths["a"].mover.engine
    refs = loop.run_until_complete(source.run_on_engine(lambda e: [
        e.kv.manager.block(e.kv.manager.cached_block(h)).ref_count for h in hashes_of(paths["a"], tokens)]))
    assert result.ok and refs == [0] * 5


def test_a_second_pull_from_the_same_source_reuses_the_authenticated_connection(nodes):
    loop, paths = nodes
    pull(loop, paths, prompt(3))
    accepted = paths["a"].server.counters.accepted
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(4))
    assert (result.ok, result.imported) == (True, 5) and (migrated, hit) == (reference, 5 * BS)
    assert paths["a"].server.counters.accepted == accepted


def test_a_kept_connection_the_source_closed_is_replaced_by_a_fresh_one(nodes):
    loop, paths = nodes
    pull(loop, paths, prompt(5))
    (kept, _), *_ = paths["b"]._idle["a"]
    kept.shutdown(socket.SHUT_WR)  # the listener reads the end and closes its side
    assert wait_until(lambda: kept.recv(1, socket.MSG_PEEK) == b"")
    accepted = paths["a"].server.counters.accepted
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(6))
    assert (result.ok, result.imported) == (True, 5) and (migrated, hit) == (reference, 5 * BS)
    assert paths["a"].server.counters.accepted == accepted + 1


def test_over_a_kept_connection_the_request_goes_while_the_target_reserves_its_blocks(nodes, monkeypatch):
    """The target's plan (its lookup and reservation, on its engine thread) waits here until the source
    has begun its reply: a pull that asked only once planned would wait out the timeout here."""
    loop, paths = nodes
    pull(loop, paths, prompt(61))  # leaves a kept connection
    exporting, seen = threading.Event(), []
    server = paths["a"].server
    real_export = server._export_layers

    def export_layers(hashes):
        exporting.set()
        return real_export(hashes)

    real_plan = direct_path._plan

    def plan(engine, hashes, places):
        seen.append(exporting.wait(5))
        return real_plan(engine, hashes, places)

    monkeypatch.setattr(server, "_export_layers", export_layers)
    monkeypatch.setattr(direct_path, "_plan", plan)
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(62))
    assert seen == [True]
    assert (result.ok, result.local, result.imported) == (True, 0, 5) and (migrated, hit) == (reference, 5 * BS)


def source_pins_none(paths) -> bool:
    return wait_until(lambda: paths["a"].mover.engine.engine.kv.manager.num_used == 0)


def test_a_run_partly_held_here_is_asked_for_again_from_its_first_missing_block(nodes):
    """Asked over a kept connection before the target knew it held the run's first three blocks: that
    reply is dropped, with its connection, and the two blocks it lacks come over a new one."""
    loop, paths = nodes
    pull(loop, paths, prompt(63))
    tokens = prompt(64)
    loop.run_until_complete(generate(paths["b"], "held-64", tokens[: 3 * BS]))
    accepted = paths["a"].server.counters.accepted
    result, (migrated, hit), (reference, _) = pull(loop, paths, tokens)
    assert (result.ok, result.local, result.imported) == (True, 3, 2) and (migrated, hit) == (reference, 5 * BS)
    assert paths["a"].server.counters.accepted == accepted + 1
    assert source_pins_none(paths)  # the dropped reply's run was let go


def test_a_target_with_room_for_part_of_the_run_asks_again_for_that_part(nodes, monkeypatch):
    loop, paths = nodes
    pull(loop, paths, prompt(65))
    manager = paths["b"].mover.engine.engine.kv.manager
    real_reserve = manager.reserve
    monkeypatch.setattr(manager, "reserve", lambda count: real_reserve(min(count, 3)))
    failures = paths["b"].mover.counters.migration_failures
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(66))
    assert (result.ok, result.local, result.imported) == (True, 0, 3) and (migrated, hit) == (reference, 3 * BS)
    assert paths["b"].mover.counters.migration_failures == failures
    assert source_pins_none(paths)


def test_a_kept_connection_that_cannot_carry_the_request_is_replaced_by_a_fresh_one(nodes, monkeypatch):
    loop, paths = nodes
    pull(loop, paths, prompt(67))
    real_start, refused = kv_link.LinkStream.start, []

    def start(stream, *args, **kwargs):
        if not refused:
            refused.append(stream.sock)
            raise BrokenPipeError("the peer went away")
        return real_start(stream, *args, **kwargs)

    monkeypatch.setattr(kv_link.LinkStream, "start", start)
    accepted = paths["a"].server.counters.accepted
    failures = paths["b"].mover.counters.migration_failures
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(68))
    assert (result.ok, result.imported) == (True, 5) and (migrated, hit) == (reference, 5 * BS)
    assert paths["a"].server.counters.accepted == accepted + 1 and refused[0].fileno() == -1  # closed
    assert paths["b"].mover.counters.migration_failures == failures


def test_a_reply_that_ends_before_the_target_has_planned_still_ends_the_pull(nodes, monkeypatch):
    """Asked first over a kept connection for blocks the source does not hold, the reply is its end marker
    alone, and it can come before the target's engine thread has given the stream its sink: the sink is
    still told the end, and the pull returns."""
    loop, paths = nodes
    pull(loop, paths, prompt(69))
    replied = threading.Event()
    real_send = paths["a"].server._send_chunks

    def send_chunks(*args):
        real_send(*args)
        replied.set()

    real_plan = direct_path._plan

    def plan(engine, hashes, places):
        replied.wait(5)
        time.sleep(0.05)  # the receive thread has read the end marker
        return real_plan(engine, hashes, places)

    monkeypatch.setattr(paths["a"].server, "_send_chunks", send_chunks)
    monkeypatch.setattr(direct_path, "_plan", plan)

    async def run():
        unknown = [BlockHash(bytes([n]) * 16) for n in range(3)]
        return await asyncio.wait_for(paths["b"].pull("a", unknown, resolves_to(paths["a"])), 10)

    result = loop.run_until_complete(run())
    assert replied.is_set() and (result.ok, result.local, result.imported) == (True, 0, 0)


def test_pull_from_an_address_where_nothing_listens_is_no_direct_path(nodes):
    loop, paths = nodes
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"
    failures = paths["b"].mover.counters.migration_failures
    result, _, _ = pull(loop, paths, prompt(2), source="c", address=closed)  # an address b has not used yet
    assert result is None  # the actor falls back to Ray; nothing counted as a failed migration
    assert paths["b"].mover.counters.migration_failures == failures


def test_a_probe_over_the_direct_path_times_a_verified_payload_of_the_size_asked(nodes):
    loop, paths = nodes
    nbytes, seconds = loop.run_until_complete(paths["b"].probe("a", 1 << 20, resolves_to(paths["a"])))
    assert (1 << 20) <= nbytes < (1 << 20) + 2 * paths["a"].mover.geometry.bytes_per_block and seconds > 0


@pytest.mark.parametrize("damage", ["flipped", "cut-off", "foreign"])
def test_damaged_replies_are_refused_counted_and_the_request_recomputes(nodes, monkeypatch, damage):
    loop, paths = nodes
    server = paths["a"].server
    monkeypatch.setattr(paths["b"], "config", replace(paths["b"].config, compress="never"))  # plain payloads
    if damage == "flipped":
        real = link_io.send_pieces

        def flipped(sock, pieces):
            if len(pieces) > 3 and len(pieces[3]) > 7:  # a batch with the first block's first layer of K
                kv = bytearray(pieces[3])  # damaged after its batch was checksummed, on its way out
                kv[7] ^= 0x40
                pieces = [*pieces[:3], bytes(kv), *pieces[4:]]
            real(sock, pieces)

        monkeypatch.setattr(link_io, "send_pieces", flipped)
    elif damage == "cut-off":
        def cut_off(sock, pieces):
            sock.sendall(link_io.U64.pack(sum(map(len, pieces)) + 16) + bytes(pieces[0])[:100])  # the length promises more
            sock.shutdown(socket.SHUT_RDWR)
            return 100

        monkeypatch.setattr(link_io, "send_payload", cut_off)
    else:
        monkeypatch.setattr(server, "geometry", replace(server.geometry, model_fingerprint="another-model"))
    failures = paths["b"].mover.counters.migration_failures
    result, (after, hit), (reference, _) = pull(loop, paths, prompt({"flipped": 11, "cut-off": 12, "foreign": 13}[damage]))
    expected = {"flipped": "CorruptKVPayload", "cut-off": "ConnectionError", "foreign": "IncompatibleKVPayload"}
    assert (result.ok, result.imported) == (False, 0) and expected[damage] in result.error
    assert paths["b"].mover.counters.migration_failures == failures + 1
    assert (after, hit) == (reference, 0)


def compressing(paths, monkeypatch, mode: str = "always", below: float | None = None) -> list[int]:
    """Set the target's compression and count the frames the source makes (each frame's element width)."""
    extra = {} if below is None else {"compress_below_bytes_per_s": below}
    monkeypatch.setattr(paths["b"], "config", replace(paths["b"].config, compress=mode, **extra))
    monkeypatch.setattr(paths["b"], "_link_rates", {})
    frames: list[int] = []
    real = wire_compressed.compressed_pieces
    monkeypatch.setattr(wire_compressed, "compressed_pieces", lambda pieces, width: frames.append(width) or real(pieces, width))
    return frames


def test_a_pull_asking_for_compressed_chunks_lands_them_exact_in_fewer_bytes(nodes, monkeypatch):
    loop, paths = nodes
    frames = compressing(paths, monkeypatch)
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(41))
    width = paths["a"].mover.geometry.itemsize
    assert (result.ok, result.imported, frames) == (True, 5, [width] * 3)
    assert 0 < result.wire_bytes < result.bytes  # the rate the router learns is of the KV, not of the frames
    assert (migrated, hit) == (reference, 5 * BS)


def test_auto_compresses_where_the_links_last_pull_long_enough_to_tell_ran_below_the_threshold(nodes, monkeypatch):
    loop, paths = nodes
    frames = compressing(paths, monkeypatch, "auto", below=1e18)  # any link is slower than this
    short, *_ = pull(loop, paths, prompt(42))  # 5 blocks, 320 KiB: too short to tell the link's rate
    assert (short.ok, frames, short.wire_bytes, paths["b"]._link_rates) == (True, [], short.bytes, {})
    blocks = kv_link.RATE_MIN_BYTES // paths["a"].mover.geometry.bytes_per_block + 1
    first, *_ = pull(loop, paths, prompt(43, length=blocks * BS))
    assert (first.ok, frames, first.wire_bytes) == (True, [], first.bytes)  # no rate known yet: as it is
    assert paths["b"]._link_rates["a"] > 0
    second, (migrated, hit), (reference, _) = pull(loop, paths, prompt(44))
    assert second.ok and len(frames) == 3 and second.wire_bytes < second.bytes
    assert (migrated, hit) == (reference, 5 * BS)
    monkeypatch.setattr(paths["b"], "config", replace(paths["b"].config, compress_below_bytes_per_s=1.0))
    third, *_ = pull(loop, paths, prompt(45))  # the link is faster than 1 byte/s: as it is
    assert third.ok and len(frames) == 3 and third.wire_bytes == third.bytes


def test_auto_pulls_plain_once_after_every_few_compressed_in_a_row_to_read_the_link_again(nodes, monkeypatch):
    """A compressed reply goes at the slower of the link and the compressor: a fast link read slow once would
    otherwise stay compressed, its pulls telling the compressor's pace."""
    _, paths = nodes
    path = paths["b"]
    monkeypatch.setattr(path, "_link_rates", {"slow": 1.0, "fast": 1e12})
    asks = [path.compress_next("slow") for _ in range(2 * direct_path.RECHECK_AFTER + 2)]
    assert asks == 2 * ([True] * direct_path.RECHECK_AFTER + [False])
    assert not path.compress_next("fast") and not path.compress_next("unknown")
    path._link_rates["slow"] = 1e12  # the plain pull read it fast
    assert not path.compress_next("slow") and "slow" not in path._compressed_in_a_row


def test_the_time_a_busy_target_keeps_its_buffers_is_not_taken_for_the_links_pace(nodes, monkeypatch):
    """A pull of more chunks than the receive thread has buffers, whose first import takes the target's
    engine thread a second (as a busy node's step would): the receive thread waits, the link does not;
    the rate learned leaves that wait out."""
    loop, paths = nodes
    real_plan = direct_path._plan  # each chunk imported on the engine thread, not read into the pool
    monkeypatch.setattr(direct_path, "_plan", lambda engine, hashes, places: real_plan(engine, hashes, False))
    monkeypatch.setattr(paths["b"], "_link_rates", {})
    kv = paths["b"].mover.engine.engine.kv
    real, imports = kv.import_decoded, []
    monkeypatch.setattr(kv, "import_decoded", lambda blocks, state=None: (imports or time.sleep(1.0), imports.append(1),
                                                                           real(blocks, state))[-1])
    blocks = kv_link.RATE_MIN_BYTES // paths["a"].mover.geometry.bytes_per_block + 1  # 9 chunks, 4 buffers
    result, (migrated, hit), (reference, _) = pull(loop, paths, prompt(48, length=blocks * BS + 5))
    assert result.ok and result.imported == blocks and result.seconds >= 1.0 and len(imports) == 9
    assert paths["b"]._link_rates["a"] > 4 * result.wire_bytes / 1.0
    assert (migrated, hit) == (reference, blocks * BS)


def test_a_probe_long_enough_to_tell_the_links_rate_decides_the_first_pull(nodes, monkeypatch):
    loop, paths = nodes
    frames = compressing(paths, monkeypatch, "auto", below=1e18)  # any link is slower than this
    resolve = resolves_to(paths["a"])
    loop.run_until_complete(paths["b"].probe("a", kv_link.RATE_MIN_BYTES // 2, resolve))
    assert paths["b"]._link_rates == {}  # too short to tell
    loop.run_until_complete(paths["b"].probe("a", 2 * kv_link.RATE_MIN_BYTES, resolve))
    assert paths["b"]._link_rates["a"] > 0
    first, (migrated, hit), (reference, _) = pull(loop, paths, prompt(47))
    assert first.ok and len(frames) == 3 and first.wire_bytes < first.bytes
    assert (migrated, hit) == (reference, 5 * BS)


def test_an_unknown_compression_mode_is_refused():
    with pytest.raises(ValueError, match="compress is one of"):
        KVLinkConfig(compress="gzip")


def test_a_compressed_chunk_damaged_on_the_way_is_refused_counted_and_the_request_recomputes(nodes, monkeypatch):
    loop, paths = nodes
    compressing(paths, monkeypatch)
    real = link_io.send_pieces

    def flipped(sock, pieces):
        body = next((i for i, p in enumerate(pieces) if len(p) > 1000), None)
        if body is not None:  # the frame's zstd body, damaged after it was checksummed
            damaged = bytearray(pieces[body])
            damaged[500] ^= 0x01
            pieces = [*pieces[:body], bytes(damaged), *pieces[body + 1 :]]
        real(sock, pieces)

    monkeypatch.setattr(link_io, "send_pieces", flipped)
    failures = paths["b"].mover.counters.migration_failures
    result, (after, hit), (reference, _) = pull(loop, paths, prompt(46))
    assert (result.ok, result.imported) == (False, 0) and "CorruptKVPayload" in result.error
    assert paths["b"].mover.counters.migration_failures == failures + 1
    assert (after, hit) == (reference, 0)


def closed_without_reply(sock: socket.socket) -> bool:
    try:
        return sock.recv(1024) == b""
    except ConnectionResetError:  # closed with our bytes unread
        return True


def wait_until(predicate, timeout: float = 5.0) -> bool:
    import time

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.01)
    return predicate()


def test_a_node_actors_link_listens_at_its_ray_node_address_by_default(monkeypatch):
    from orchard.node.serving import actor

    assert actor.NodeActorConfig("n", "c", "ns").link.host == actor.RAY_NODE_HOST
    monkeypatch.setattr(actor.ray.util, "get_node_ip_address", lambda: "10.1.2.3")
    assert actor.listen_config(actor.NodeActorConfig("n", "c", "ns").link).host == "10.1.2.3"
    named = actor.KVLinkConfig(host="127.0.0.1")
    assert actor.listen_config(named) == named  # an address given is kept


def test_a_silent_peer_times_out_under_the_kernels_timeout_of_an_authenticated_connection():
    with socket.create_server(("127.0.0.1", 0)) as server:
        with socket.create_connection(server.getsockname()) as client, server.accept()[0]:
            link_io.data_mode(client, 1.0)
            assert client.gettimeout() is None  # blocking: a chunk is one system call
            with pytest.raises(TimeoutError):
                link_io.recv_into(client, memoryview(bytearray(64)))


def test_a_small_pull_asks_for_smaller_chunks_so_its_stages_overlap():
    from orchard.node.serving.direct_path import MIN_CHUNK_BYTES, chunk_size

    mib, block = 1 << 20, 64 << 10
    assert chunk_size(128 * mib, 4 * mib) == 4 * mib  # a large pull: the configured size
    assert chunk_size(16 * mib, 4 * mib) == 2 * mib  # eight chunks
    assert chunk_size(2 * mib, 4 * mib) == MIN_CHUNK_BYTES  # never below the floor...
    assert chunk_size(2 * mib, 128 * 1024) == 128 * 1024  # ...nor above what is configured
    assert chunk_size(8 * mib, 4 * mib, chunks=2, block_bytes=block) == 4 * mib  # two chunks
    assert chunk_size(127 * block, 4 * mib, chunks=2, block_bytes=block) == 64 * block  # whole blocks, rounded up


def test_a_pull_read_straight_into_the_pool_asks_one_chunk_a_connection_and_others_eight(monkeypatch):
    """Chunks landed layer by layer as they come need no more of them than connections; chunks imported
    or copied once whole come in eight, so that one is written while the next arrives."""
    config = replace(CONFIG, chunk_bytes=4 << 20, connections_per_pull=2)
    with linked("b", EngineConfig(block_size=BS, num_blocks=16, max_num_batched_tokens=128), config) as (_, paths):
        path = paths["b"]
        per_block = path.mover.geometry.bytes_per_block
        run = [BlockHash(bytes([n % 256, n // 256]) * 8) for n in range((8 << 20) // per_block)]  # 8 MiB
        half = len(run) // 2
        assert path._chunk_bytes(run, placed=True) == half * per_block
        assert path._parts(run, compress=False) == [run[:half], run[half:]]
        assert path._chunk_bytes(run, placed=False) == (1 << 20) // per_block * per_block
        monkeypatch.setattr(path, "config", replace(config, connections_per_pull=1))
        assert path._chunk_bytes(run, placed=True) == 4 << 20  # one connection: no more than configured


def test_the_senders_buffer_grows_as_far_as_the_kernel_allows_and_a_refusal_is_not_an_error(monkeypatch):
    with socket.socket() as sock:
        before = sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF)
        link_io.grow_send_buffer(sock, 4 * before)
        assert sock.getsockopt(socket.SOL_SOCKET, socket.SO_SNDBUF) > before

    class Refusing:  # macOS: ENOBUFS past kern.ipc.maxsockbuf
        def __init__(self):
            self.asked = []

        def getsockopt(self, *_):
            return 1 << 16

        def setsockopt(self, _level, _name, nbytes):
            self.asked.append(nbytes)
            if nbytes > 1 << 20:
                raise OSError(55, "No buffer space available")

    refusing = Refusing()
    link_io.grow_send_buffer(refusing, 8 << 20)
    assert refusing.asked == [8 << 20, 4 << 20, 2 << 20, 1 << 20]


def test_pieces_the_kernel_takes_in_part_are_sent_whole_and_in_order():
    """A send that takes a few bytes at a time (a full socket buffer) resumes inside the piece it
    cut, across more pieces than one scatter-gather call sends."""

    class Trickle:
        def __init__(self):
            self.got, self.calls = bytearray(), 0

        def sendmsg(self, buffers):
            self.calls += 1
            taken = b"".join(bytes(b) for b in buffers)[: 7 + self.calls % 5]
            self.got += taken
            return len(taken)

    pieces = [bytes([i % 251]) * (1 + i % 9) if i % 2 else memoryview(bytes(range(i % 13, i % 13 + 6))) for i in range(1200)]
    sock = Trickle()
    link_io.send_pieces(sock, pieces)
    assert bytes(sock.got) == b"".join(bytes(p) for p in pieces)
    batches = []
    whole = Trickle()
    whole.sendmsg = lambda buffers: batches.append(len(buffers)) or sum(map(len, buffers))  # takes every batch whole
    link_io.send_pieces(whole, pieces)
    assert batches == [link_io.MAX_PIECES, link_io.MAX_PIECES, 1200 - 2 * link_io.MAX_PIECES]

"""A payload over a real socket pair as the KV link moves it: sent in checksummed batches, received
in checksummed slices, read back whole; cut off, or damaged after its batch was checksummed,
it is never read as blocks. Frames a gateway link's engine thread sends (`FrameSender`): never
blocking it, in order, nothing after the peer left."""

from __future__ import annotations

import asyncio
import socket
import threading

import numpy as np
import pytest

from orchard.kvcache.errors import CorruptKVPayload
from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.hashing import hash_block, root_hash
from orchard.kvcache.wire_stream import BlockPieces, decode_views, payload_pieces
from orchard.node.serving import link_io
from tests.kvcache.wire_pieces import encode_pieces

# 12 KiB a block: a payload of 100 blocks spans several batches and landing slices once they are shrunk
GEOMETRY = KVGeometry("fp", num_layers=3, num_kv_heads=2, head_dim=32, block_size=16, dtype="float16")


def pieces(n: int = 100) -> list[BlockPieces]:
    rng = np.random.default_rng(1)
    parent, out = root_hash("fp"), []
    for i in range(n):
        tokens = tuple(range(i * 16, i * 16 + 16))
        k, v = (rng.standard_normal((3, 16, 2, 32)).astype(np.float16) for _ in range(2))
        block_hash = hash_block(parent, tokens)
        out.append(BlockPieces(block_hash, parent, tokens, list(k), list(v)))
        parent = block_hash
    return out


@pytest.fixture
def small_slices(monkeypatch):
    monkeypatch.setattr(link_io, "BATCH_BYTES", 20_000)
    monkeypatch.setattr(link_io, "LANDING_BYTES", 30_000)


def send_in_background(fn) -> threading.Thread:
    thread = threading.Thread(target=fn, daemon=True)
    thread.start()
    return thread


def test_a_payload_sent_in_batches_lands_in_slices_as_the_blocks_sent(small_slices):
    blocks = pieces()
    expected = b"".join(bytes(p) for p in encode_pieces(GEOMETRY, blocks))
    a, b = socket.socketpair()
    with a, b:
        sizes = []
        sender = send_in_background(lambda: sizes.append(link_io.send_payload(a, payload_pieces(GEOMETRY, blocks))))
        size = link_io.U64.unpack(link_io.recv_exact(b, 8))[0]
        incoming = link_io.receive_payload(b, bytearray(size))
        sender.join(5)
        assert sizes == [size] == [len(expected)] and bytes(incoming.data) == expected
        for ours, theirs in zip(incoming.decode(GEOMETRY).blocks, decode_views(bytearray(expected), GEOMETRY), strict=True):
            assert ours.block_hash == theirs.block_hash and np.array_equal(ours.keys, theirs.keys)


def test_a_payload_cut_off_between_slices_is_no_payload(small_slices):
    payload = b"".join(bytes(p) for p in encode_pieces(GEOMETRY, pieces()))
    a, b = socket.socketpair()
    with b:
        with a:
            a.sendall(payload[:45_000])  # one slice and a half
        assert link_io.receive_payload(b, bytearray(len(payload))) is None


def test_a_byte_damaged_after_its_batch_was_checksummed_is_refused(small_slices, monkeypatch):
    real, calls = link_io.send_pieces, []

    def damaging(sock, batch):
        calls.append(len(batch))
        if len(calls) == 3:  # a batch in the middle, after the checksum took it
            kv = bytearray(batch[-1])
            kv[0] ^= 0x01
            batch = [*batch[:-1], bytes(kv)]
        real(sock, batch)

    monkeypatch.setattr(link_io, "send_pieces", damaging)
    a, b = socket.socketpair()
    with a, b:
        sender = send_in_background(lambda: link_io.send_payload(a, payload_pieces(GEOMETRY, pieces())))
        size = link_io.U64.unpack(link_io.recv_exact(b, 8))[0]
        incoming = link_io.receive_payload(b, bytearray(size))
        sender.join(5)
        assert len(calls) > 3  # several batches went out
        with pytest.raises(CorruptKVPayload, match="checksum"):
            incoming.decode(GEOMETRY)


def test_pieces_apart_in_memory_are_filled_in_order_from_bytes_sent_in_dribs_and_drabs():
    """A scatter read fills many views from one stream however the sender's writes split it: views cut
    across sends, empty views, more views than one call takes; and says when the peer left first."""
    data = np.random.default_rng(3).integers(0, 256, 300_000, dtype=np.uint8).tobytes()
    sizes = [0, 1, 7, 4096, 0, 65_536, *([100] * 600), 3, 170_357]
    assert sum(sizes) == len(data) and len(sizes) > link_io.MAX_PIECES
    target = bytearray(len(data) + 2 * len(sizes))  # a gap between each two views: they do not touch
    views, at = [], 0
    for size in sizes:
        views.append(memoryview(target)[at : at + size])
        at += size + 2
    a, b = socket.socketpair()
    with a, b:
        link_io.data_mode(b, 5.0)

        def dribble():
            for start in range(0, len(data), 10_007):
                a.sendall(data[start : start + 10_007])

        sender = send_in_background(dribble)
        assert link_io.recv_pieces(b, views)
        sender.join(5)
        assert b"".join(bytes(v) for v in views) == data
        assert all(bytes(target[at - 2 : at]) == bytes(2) for at in np.cumsum([size + 2 for size in sizes]))
        a.sendall(data[:10])
        a.shutdown(socket.SHUT_WR)
        assert not link_io.recv_pieces(b, [memoryview(bytearray(20))])


def test_the_length_comes_first_and_the_checksum_last_in_their_own_places():
    blocks = pieces(2)
    sent = []

    class Recorder:
        def sendmsg(self, buffers):
            sent.append([bytes(b) for b in buffers])
            return sum(map(len, buffers))

    size = link_io.send_payload(Recorder(), payload_pieces(GEOMETRY, blocks))
    whole = b"".join(b"".join(batch) for batch in sent)
    assert whole == link_io.U64.pack(size) + b"".join(bytes(p) for p in encode_pieces(GEOMETRY, blocks))
    assert sent[-1] == [whole[-16:]]  # the checksum, known once every batch went out


def test_frames_sent_from_a_thread_while_the_peer_reads_nothing_never_block_it_and_arrive_in_order():
    """A FrameSender's socket full (the peer not reading), frames from another thread wait in its backlog,
    the sending thread going on at once; the event loop writes them out, in order, once the peer reads."""
    async def scenario():
        loop = asyncio.get_running_loop()
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        sender = link_io.FrameSender(ours, loop)
        frames = [bytes([i % 256]) * 200_000 for i in range(40)]  # 8 MB: far more than the socket buffers hold

        def engine_thread():
            return all(sender.send(item) for item in frames)

        # The peer reads nothing until this returns: a send that waited for it would never return.
        assert await asyncio.wait_for(asyncio.to_thread(engine_thread), 30)
        backlog_after_sending = len(sender._backlog)
        theirs.setblocking(False)
        reader, writer = await asyncio.open_connection(sock=theirs)
        got = [await asyncio.wait_for(link_io.read_frame(reader), 10) for _ in frames]
        for _ in range(100):  # the loop stops watching the socket once the backlog is out
            if not sender._backlog:
                break
            await asyncio.sleep(0.01)
        sender.close()
        writer.close()
        ours.close()
        return frames, got, backlog_after_sending, len(sender._backlog)

    frames, got, backlog, left = asyncio.run(scenario())
    assert got == frames and backlog > 0 and left == 0


def test_a_frame_sender_whose_peer_left_says_so_and_sends_nothing_more():
    async def scenario():
        ours, theirs = socket.socketpair()
        ours.setblocking(False)
        sender = link_io.FrameSender(ours, asyncio.get_running_loop())
        theirs.close()
        results = [sender.send(b"x" * 100_000) for _ in range(3)]
        sender.close()
        ours.close()
        return results, sender.send(b"y")

    results, after_close = asyncio.run(scenario())
    assert results[-1] is False and after_close is False

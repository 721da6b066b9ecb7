"""Full blocks written and read all at once are the bytes and blocks of the per-block writer and
reader; an imported run takes the blocks, ids, events and KV a block-by-block import takes."""

from __future__ import annotations

import msgpack
import numpy as np
import pytest
import xxhash

from orchard.kvcache.block_transfer import BlockTransfer
from orchard.kvcache.cache import KVCache
from orchard.kvcache.config import CacheConfig
from orchard.kvcache.errors import CorruptKVPayload, IncompatibleKVPayload
from orchard.kvcache.geometry import KVGeometry
from orchard.kvcache.hashing import hash_block, hash_block_rows, root_hash
from orchard.kvcache.wire import BlockRun, KVBlockData, decode_blocks
from orchard.kvcache.wire_batch import record_layout, write_headers
from orchard.kvcache.wire_stream import BlockPieces, _block_header, decode_views
from tests.kvcache.wire_pieces import encode_pieces

GEOMETRY = KVGeometry("fp", num_layers=3, num_kv_heads=2, head_dim=8, block_size=4, dtype="float16")


def chain(n: int, root: bytes = root_hash("fp"), first_token: int = 70000) -> list[KVBlockData]:
    """`n` full chained blocks; token ids past 65535 so that msgpack would pack some narrower."""
    rng = np.random.default_rng(1)
    parent, out = root, []
    for i in range(n):
        tokens = (first_token + i, 3, 300, 1 << 31)
        k, v = (rng.standard_normal((3, 4, 2, 8)).astype(np.float16) for _ in range(2))
        block_hash = hash_block(parent, tokens)
        out.append(KVBlockData(block_hash, parent, tokens, k, v))
        parent = block_hash
    return out


def payload(blocks: list[KVBlockData]) -> bytearray:
    pieces = [BlockPieces(b.block_hash, b.parent_hash, b.token_ids, list(b.keys), list(b.values)) for b in blocks]
    return bytearray(b"".join(bytes(p) for p in encode_pieces(GEOMETRY, pieces)))


def test_headers_written_at_once_are_the_bytes_the_per_block_writer_writes():
    blocks = chain(20)
    at_once = write_headers(GEOMETRY, [b.block_hash for b in blocks], [b.parent_hash for b in blocks], [b.token_ids for b in blocks])
    pack = msgpack.Packer(use_bin_type=True).pack
    assert [bytes(h) for h in at_once] == [_block_header(GEOMETRY, b, pack) for b in blocks]


@pytest.mark.parametrize("odd", ["partial", "no parent", "token past uint32", "short hash"])
def test_blocks_not_all_full_and_plain_are_left_to_the_per_block_writer(odd):
    blocks = chain(3)
    hashes, parents, tokens = [b.block_hash for b in blocks], [b.parent_hash for b in blocks], [b.token_ids for b in blocks]
    if odd == "partial":
        tokens[1] = tokens[1][:3]
    elif odd == "no parent":
        parents[0] = None
    elif odd == "short hash":
        hashes[1] = hashes[1][:15]
    else:
        tokens[2] = (1 << 32, 0, 0, 0)
    assert write_headers(GEOMETRY, hashes, parents, tokens) is None


def test_a_payload_of_full_blocks_reads_as_one_run_of_the_blocks_msgpack_reads():
    blocks = chain(20)
    data = payload(blocks)
    run = decode_views(data, GEOMETRY)
    assert isinstance(run, BlockRun) and len(run) == 20
    for ours, theirs in zip(run, decode_blocks(bytes(data), GEOMETRY), strict=True):
        assert (ours.block_hash, ours.parent_hash, ours.token_ids) == (theirs.block_hash, theirs.parent_hash, theirs.token_ids)
        assert np.array_equal(ours.keys, theirs.keys) and np.array_equal(ours.values, theirs.values)
    assert np.shares_memory(run.keys, np.frombuffer(data, dtype=np.uint8))


def test_a_run_with_a_wrong_fixed_byte_is_refused_even_with_a_valid_checksum():
    data = payload(chain(5))
    start = data.index(b"\xa6parent", data.index(b"\xa6parent") + 1)  # the second block's field name
    data[start + 1] = ord("P")
    data[-16:] = xxhash.xxh3_128_digest(bytes(data[:-16]))
    with pytest.raises(CorruptKVPayload, match="block 1 is not laid out"):
        decode_views(data, GEOMETRY)


def test_hash_rows_are_hash_block_of_each_row():
    blocks = chain(7)
    parents = np.frombuffer(b"".join(b.parent_hash for b in blocks), np.uint8).reshape(7, 16)
    tokens = np.array([b.token_ids for b in blocks], dtype=np.uint32)
    assert hash_block_rows(parents, tokens) == b"".join(b.block_hash for b in blocks)


def test_record_layout_matches_a_written_record():
    blocks = chain(2)
    data = payload(blocks)
    layout = record_layout(GEOMETRY)
    first = data.index(b"\x85\xa4hash")
    assert data.index(b"\x85\xa4hash", first + 1) - first == layout.size
    assert bytes(data[first + layout.key_at : first + layout.key_at + layout.key_bytes]) == blocks[0].keys.tobytes()


# ---- importing a run ----------------------------------------------------------------


@pytest.fixture
def run_imports(monkeypatch) -> list[int]:
    """Lengths of the runs imported at once: the tests below must take that path, not the per-block one."""
    seen: list[int] = []
    real = BlockTransfer._import_run
    monkeypatch.setattr(BlockTransfer, "_import_run", lambda self, run, hashes, state: seen.append(len(run)) or real(self, run, hashes, state))
    return seen


def make_cache(num_blocks: int = 12) -> KVCache:
    return KVCache(GEOMETRY, CacheConfig(block_size=4, num_blocks=num_blocks, watermark=0.0))


def read_kv(cache: KVCache, block_hash: bytes) -> tuple[np.ndarray, np.ndarray]:
    keys, values = cache.pool.read_blocks([cache.manager.cached_block(block_hash)])
    return keys[:, 0], values[:, 0]


def test_an_imported_run_takes_the_ids_events_and_kv_a_block_by_block_import_takes(run_imports):
    cache = make_cache()
    blocks = chain(6, root=cache.root)
    by_run, by_block = make_cache(), make_cache()
    by_block.import_decoded(blocks[:2])  # both hold the first two already
    by_run.import_decoded(blocks[:2])
    for c in (by_run, by_block):
        c.drain_events()
    run = decode_views(payload(blocks), GEOMETRY)
    assert by_run.import_decoded(run) == by_block.import_decoded(blocks) == 4
    assert run_imports == [6]
    assert [by_run.manager.cached_block(b.block_hash) for b in blocks] == [by_block.manager.cached_block(b.block_hash) for b in blocks]
    assert by_run.drain_events() == by_block.drain_events()
    assert by_run.manager.stats() == by_block.manager.stats()
    for block in blocks:
        ours = read_kv(by_run, block.block_hash)
        assert np.array_equal(ours[0], block.keys) and np.array_equal(ours[1], block.values)


def test_a_run_with_one_forged_block_is_refused_whole(run_imports):
    cache = make_cache()
    blocks = chain(4, root=cache.root)
    blocks[2] = KVBlockData(blocks[2].block_hash, blocks[2].parent_hash, (9, 9, 9, 9), blocks[2].keys, blocks[2].values)
    with pytest.raises(IncompatibleKVPayload, match=blocks[2].block_hash.hex()):
        cache.import_decoded(decode_views(payload(blocks), GEOMETRY))
    assert cache.manager.num_cached == 0 and run_imports == [4]


def test_a_run_whose_first_parent_is_not_held_imports_nothing(run_imports):
    cache = make_cache()
    blocks = chain(4, root=cache.root)
    assert cache.import_decoded(decode_views(payload(blocks[1:]), GEOMETRY)) == 0
    assert cache.manager.num_cached == 0 and run_imports == [3]


def test_a_run_stops_where_the_pool_has_no_free_block(run_imports):
    cache = make_cache(num_blocks=4)  # three usable blocks
    blocks = chain(5, root=cache.root)
    assert cache.import_decoded(decode_views(payload(blocks), GEOMETRY)) == 3
    assert [cache.manager.cached_block(b.block_hash) is not None for b in blocks] == [True, True, True, False, False]
    assert run_imports == [5]


@pytest.mark.parametrize("form", ["run", "blocks"])
def test_importing_a_run_never_evicts_its_own_blocks_already_here(form):
    """With the pool full, the blocks of the run already cached stay; the import stops short instead
    of evicting one of them and leaving the blocks after it unreachable."""
    cache = make_cache(num_blocks=4)
    blocks = chain(4, root=cache.root)
    cache.import_decoded(blocks[:2])
    imported = cache.import_decoded(decode_views(payload(blocks), GEOMETRY) if form == "run" else blocks)
    cached = [cache.manager.cached_block(b.block_hash) is not None for b in blocks]
    assert (imported, cached) == (1, [True, True, True, False])
    assert cache.manager.num_used == 0  # nothing stays held

"""A pull's blocks landed in reserved pool blocks from another thread, then cached by the engine thread
(`orchard.kvcache.block_landing`): bit for bit, invisible until adopted, and refused or freed whole."""

import threading

import mlx.core as mx
import numpy as np
import pytest
import xxhash

from orchard.kvcache.errors import CorruptKVPayload, IncompatibleKVPayload, PoolMoved
from orchard.kvcache.events import BlockStored
from orchard.kvcache.wire import BlockRun
from orchard.kvcache.wire_layers import LayerChunk, layer_pieces, layout_of_size
from orchard.kvcache.wire_transit import IncomingPayload
from tests.kvcache.caches import kv_of, prefill, same_kv

PROMPT = list(range(100, 117))  # four full blocks and one token


def held_run(source, tokens=PROMPT):
    """The full blocks of `tokens` prefilled on `source`: their hashes, and the run as a pull decodes it."""
    prefill(source, "src", tokens, seed=3)
    ids = source.block_table("src")[: len(tokens) // 4]
    keys, values = kv_of(source, ids)
    hashes = source.block_hashes(tokens)
    rows = lambda hs: np.frombuffer(b"".join(bytes(h) for h in hs), np.uint8).reshape(-1, 16)  # noqa: E731
    run = BlockRun(rows(hashes), rows([source.root, *hashes[:-1]]),
                   np.array([tokens[i * 4 : i * 4 + 4] for i in range(len(hashes))], np.uint32),
                   np.ascontiguousarray(keys.swapaxes(0, 1)), np.ascontiguousarray(values.swapaxes(0, 1)))
    source.free("src")
    return hashes, run, (keys, values)


def hit_kv(target, blocks: int):
    """The K and V a request for PROMPT finds cached on `target`, as bytes: its first `blocks` blocks, all
    prefix hits."""
    assert target.allocate("a", PROMPT) == blocks * 4
    try:
        return tuple(part.tobytes() for part in kv_of(target, target.block_table("a")[:blocks]))
    finally:
        target.free("a")


def prefix_of(original, blocks: int):
    """The first `blocks` blocks of `held_run`'s K and V, as `hit_kv` gives them."""
    return tuple(part[:, :blocks].tobytes() for part in original)


def sub(run, start, stop):
    return BlockRun(run.hashes[start:stop], run.parents[start:stop], run.tokens[start:stop],
                    run.keys[start:stop], run.values[start:stop])


def test_blocks_land_from_another_thread_and_are_cached_bit_for_bit_once_adopted(make_cache):
    source, target = make_cache(), make_cache()
    hashes, run, original = held_run(source)
    target.drain_events()
    landing = target.reserve_landing(target.root, hashes)
    assert landing.capacity == 4 and target.manager.num_free == target.manager.num_usable - 4
    landed = []
    worker = threading.Thread(target=lambda: landed.extend([landing.land(sub(run, 0, 3)), landing.land(sub(run, 3, 4))]))
    worker.start()
    worker.join()
    assert landed == [3, 1]
    assert target.manager.cached_block(hashes[0]) is None  # landed, not yet a prefix hit
    assert target.drain_events() == []
    assert landing.adopt() == 4
    assert [e.block_hash for e in target.drain_events() if isinstance(e, BlockStored)] == hashes
    assert target.manager.num_used == 0 and target.manager.num_cached == 4
    assert hit_kv(target, 4) == prefix_of(original, 4)


def test_blocks_read_one_by_one_land_as_a_run_does_and_one_without_a_parent_is_refused(make_cache):
    """A version 2 payload whose records the run reader does not take is decoded block by block:
    a list of blocks, which lands the same."""
    source, target = make_cache(), make_cache()
    hashes, run, original = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    orphan = sub(run, 0, 1)[0]
    orphan.parent_hash = None
    with pytest.raises(IncompatibleKVPayload):
        landing.land([orphan])
    assert landing.land(list(run)) == 4 and landing.adopt() == 4
    assert hit_kv(target, 4) == prefix_of(original, 4)


def test_a_chunk_that_is_not_the_next_blocks_asked_for_is_refused_and_writes_nothing(make_cache):
    source, target = make_cache(), make_cache()
    hashes, run, _ = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    before = kv_of(target, landing.block_ids)
    with pytest.raises(IncompatibleKVPayload):
        landing.land(sub(run, 1, 3))  # skips the first block
    forged = sub(run, 0, 2)
    forged.tokens = forged.tokens.copy()
    forged.tokens[1, 0] += 1  # its hash no longer follows from its tokens
    with pytest.raises(IncompatibleKVPayload):
        landing.land(forged)
    assert same_kv(kv_of(target, landing.block_ids), before) and landing.landed == 0
    assert landing.adopt() == 0
    assert target.manager.num_cached == 0 and target.manager.num_free == target.manager.num_usable


def test_what_did_not_land_is_freed_and_what_landed_is_kept(make_cache):
    source, target = make_cache(), make_cache()
    hashes, run, original = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    assert landing.land(sub(run, 0, 2)) == 2  # then the reply broke off
    assert landing.adopt() == 2
    assert target.manager.num_cached == 2 and target.manager.num_available == target.manager.num_usable
    assert hit_kv(target, 2) == prefix_of(original, 2)
    with pytest.raises(IncompatibleKVPayload):
        landing.land(sub(run, 2, 4))  # a chunk after the end writes nothing


def test_a_pool_too_full_for_the_whole_run_reserves_what_it_has(make_cache):
    source, target = make_cache(), make_cache(num_blocks=4)  # three usable blocks
    hashes, run, _ = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    assert landing.capacity == 3
    with pytest.raises(IncompatibleKVPayload):
        landing.land(run)  # four blocks where three were reserved
    assert landing.land(sub(run, 0, 3)) == 3 and landing.adopt() == 3


def test_blocks_cached_here_meanwhile_keep_their_own_and_the_reserved_ones_are_freed(make_cache):
    source, target = make_cache(), make_cache()
    hashes, run, _ = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    landing.land(run)
    prefill(target, "local", PROMPT[:8], seed=9)  # the first two blocks computed here while the pull ran
    target.free("local")
    assert landing.adopt() == 2
    assert target.manager.num_cached == 4 and target.manager.num_used == 0


def test_nothing_is_cached_where_the_pools_buffers_moved_meanwhile(make_cache):
    source, target = make_cache(), make_cache()
    hashes, run, _ = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    landing.land(run)
    kept = target.pool.keys[-1]  # held, so the copy cannot take its buffer
    target.pool.keys[-1] = kept * 1  # as if a step had written the last layer's keys out of place
    mx.eval(target.pool.keys[-1])
    with pytest.raises(PoolMoved):
        landing.adopt()
    assert target.manager.num_cached == 0 and target.manager.num_free == target.manager.num_usable


def test_the_block_the_run_hangs_from_is_held_while_blocks_land(make_cache):
    source, target = make_cache(), make_cache(num_blocks=4)
    hashes, run, _ = held_run(source)
    prefill(target, "head", PROMPT[:4], seed=3)  # the run's first block, held here and then free (ref 0)
    target.free("head")
    landing = target.reserve_landing(hashes[0], hashes[1:])
    assert landing.capacity == 2  # the parent's block was not taken
    assert landing.land(sub(run, 1, 3)) == 2 and landing.adopt() == 2
    assert target.manager.num_cached == 3 and target.manager.num_used == 0


def test_a_landing_released_unused_frees_its_blocks(make_cache):
    source, target = make_cache(), make_cache()
    hashes, _, _ = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    landing.release()
    landing.release()
    assert target.manager.num_free == target.manager.num_usable and target.manager.num_cached == 0


def v3_payload(cache, run) -> bytes:
    """The run as a version 3 payload of `cache`'s model, checksum included (what a link's chunk carries)."""
    chunk = LayerChunk(run.hashes, run.parents, run.tokens, [np.ascontiguousarray(run.keys[:, i]) for i in range(2)],
                       [np.ascontiguousarray(run.values[:, i]) for i in range(2)])
    body = b"".join(bytes(p) for p in layer_pieces(cache.geometry, chunk))
    return body + xxhash.xxh3_128_digest(body)


def arriving(data: bytes):
    """A payload's bytes as a link's reader hands them out: (its first `meta` bytes landed, `read_into` for the rest)."""
    at = [0]

    def read_into(pieces):
        for piece in pieces:
            piece[:] = data[at[0] : at[0] + len(piece)]
            at[0] += len(piece)

    def landed(meta: int) -> IncomingPayload:
        incoming = IncomingPayload(bytearray(len(data)))
        read_into([incoming.data[:meta]])
        incoming.landed(meta)
        return incoming

    return landed, read_into, at


@pytest.mark.parametrize("order", ["consecutive", "scattered"])
def test_a_chunk_is_read_straight_into_its_reserved_blocks_bit_for_bit(make_cache, order):
    """The KV goes from the reader into the pool, one piece a layer or one a block where the reserved
    blocks are scattered, and the run is cached as if it had landed from a buffer."""
    source, target = make_cache(), make_cache()
    hashes, run, original = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    if order == "scattered":
        landing.block_ids.reverse()
    data = v3_payload(target, run)
    layout = layout_of_size(target.geometry, len(data))
    landed, read_into, at = arriving(data)
    incoming = landed(layout.meta_size)
    assert landing.places_wire_bytes and incoming.place(layout, landing, read_into)
    assert at[0] == len(data) and landing.landed == 4
    assert landing.adopt() == 4
    assert hit_kv(target, 4) == prefix_of(original, 4)


def test_a_chunk_damaged_on_the_way_into_its_blocks_is_refused_and_none_of_them_is_cached(make_cache):
    source, target = make_cache(), make_cache()
    hashes, run, _ = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    data = bytearray(v3_payload(target, run))
    layout = layout_of_size(target.geometry, len(data))
    data[layout.meta_size + 10] ^= 0x08  # in the first layer's K
    landed, read_into, _ = arriving(bytes(data))
    with pytest.raises(CorruptKVPayload):
        landed(layout.meta_size).place(layout, landing, read_into)
    assert landing.landed == 0 and landing.adopt() == 0
    assert target.manager.num_cached == 0 and target.manager.num_free == target.manager.num_usable


def test_another_models_chunk_is_not_placed_and_nothing_past_its_head_is_read(make_cache):
    source, target = make_cache(fingerprint="tiny-llamb"), make_cache()  # as long a name: a payload as long
    hashes, run, _ = held_run(source)
    landing = target.reserve_landing(target.root, target.block_hashes(PROMPT))
    data = v3_payload(source, run)
    layout = layout_of_size(target.geometry, len(data))
    landed, read_into, at = arriving(data)
    incoming = landed(layout.meta_size)
    assert not incoming.place(layout, landing, read_into) and at[0] == layout.meta_size
    with pytest.raises(IncompatibleKVPayload):  # read whole, it is refused as any foreign payload is
        read_into([incoming.data[layout.meta_size :]])
        incoming.landed(len(data))
        incoming.decode(target.geometry)
    landing.release()


def test_blocks_listed_as_they_land_are_prefix_hits_before_the_pull_ends_and_adopt_lists_the_rest(make_cache):
    source, target = make_cache(), make_cache()
    hashes, run, original = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    landing.land(sub(run, 0, 2))
    assert landing.adopt_landed() == 2 and landing.adopt_landed() == 0  # nothing new landed
    assert [target.manager.cached_block(h) is not None for h in hashes] == [True, True, False, False]
    landing.land(sub(run, 2, 3))  # then the reply broke off
    assert landing.adopt() == 1
    assert target.manager.num_cached == 3 and target.manager.num_used == 0
    with pytest.raises(RuntimeError):
        landing.adopt_landed()
    assert hit_kv(target, 3) == prefix_of(original, 3)


def test_a_run_whose_first_block_hangs_from_nothing_here_is_never_listed_chunk_by_chunk(make_cache):
    source, target = make_cache(), make_cache()
    hashes, run, _ = held_run(source)
    landing = target.reserve_landing(hashes[0], hashes[1:])  # the parent, hashes[0], is not held here
    landing.land(sub(run, 1, 3))
    assert landing.adopt_landed() == 0
    landing.land(sub(run, 3, 4))
    assert landing.adopt_landed() == 0 and landing.adopt() == 0
    assert target.manager.num_cached == 0 and target.manager.num_free == target.manager.num_usable


# ---- a run in parts, landed at once (a pull over several connections) ----------------------


def test_a_runs_parts_land_on_threads_of_their_own_in_any_order_and_only_its_leading_blocks_count(make_cache):
    """The second part lands whole before the first: nothing is landed or listed until the first has too."""
    source, target = make_cache(), make_cache()
    hashes, run, original = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    first, second = landing.parts([3, 1])
    worker = threading.Thread(target=second.land, args=(sub(run, 3, 4),))
    worker.start()
    worker.join()
    assert landing.landed == 0 and landing.adopt_landed() == 0
    assert target.manager.cached_block(hashes[3]) is None
    assert first.land(sub(run, 0, 2)) == 2 and landing.landed == 2
    assert first.land(sub(run, 2, 3)) == 1 and landing.landed == 4
    assert landing.adopt() == 4
    assert target.manager.num_cached == 4 and target.manager.num_used == 0
    assert hit_kv(target, 4) == prefix_of(original, 4)


def test_a_part_takes_only_its_own_blocks_in_order_and_none_twice(make_cache):
    source, target = make_cache(), make_cache()
    hashes, run, _ = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    with pytest.raises(ValueError):
        landing.parts([3, 2])  # more than was reserved
    first, second = landing.parts([2, 2])
    before = kv_of(target, landing.block_ids)
    for part, chunk in ((first, sub(run, 0, 3)), (second, sub(run, 0, 1)), (second, sub(run, 3, 4))):
        with pytest.raises(IncompatibleKVPayload):
            part.land(chunk)  # past the part's end; another part's blocks; not the part's next block
    assert same_kv(kv_of(target, landing.block_ids), before)
    assert second.land(sub(run, 2, 4)) == 2
    with pytest.raises(IncompatibleKVPayload):
        landing.land(sub(run, 2, 3))  # landed already, by the part
    assert first.land(sub(run, 0, 2)) == 2 and landing.adopt() == 4


def test_what_a_part_after_a_missing_one_landed_is_freed_not_listed(make_cache):
    """The first part's reply broke off after one block: the second part's blocks hang from a block that
    never landed, and go back to the free queue with the rest."""
    source, target = make_cache(), make_cache()
    hashes, run, original = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    first, second = landing.parts([2, 2])
    second.land(sub(run, 2, 4))
    first.land(sub(run, 0, 1))
    assert landing.adopt() == 1
    assert target.manager.num_cached == 1 and target.manager.num_available == target.manager.num_usable
    assert hit_kv(target, 1) == prefix_of(original, 1)


def test_parts_are_written_at_once_and_adopting_waits_for_a_part_being_written(make_cache):
    source, target = make_cache(), make_cache()
    hashes, run, original = held_run(source)
    landing = target.reserve_landing(target.root, hashes)
    first, second = landing.parts([2, 2])
    writing, go_on, adopted = threading.Event(), threading.Event(), []

    def write_second():
        chunk = sub(run, 2, 4)
        with second.placing(chunk.hashes, chunk.parents, chunk.tokens) as layers:
            writing.set()
            go_on.wait(5)
            for layer, (keys, values) in enumerate(layers):
                at = 0
                for key_rows, value_rows in zip(keys, values):
                    key_rows[...] = chunk.keys[at : at + len(key_rows), layer]
                    value_rows[...] = chunk.values[at : at + len(value_rows), layer]
                    at += len(key_rows)

    writer = threading.Thread(target=write_second)
    writer.start()
    assert writing.wait(5)
    lander = threading.Thread(target=first.land, args=(sub(run, 0, 2),))
    lander.start()
    lander.join(5)
    assert not lander.is_alive()  # another part landed while the second was being written
    adopter = threading.Thread(target=lambda: adopted.append(landing.adopt()))
    adopter.start()
    adopter.join(0.2)
    assert adopter.is_alive()  # waiting for the second part
    go_on.set()
    writer.join(5), adopter.join(5)
    assert adopted == [4] and hit_kv(target, 4) == prefix_of(original, 4)

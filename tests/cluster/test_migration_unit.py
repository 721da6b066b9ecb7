"""KV migration without Ray: node-side pulls between in-process engines, the gateway's
fallback logic with stand-in actors, the coordinator's counters and link rates, and the
replication planner."""

from __future__ import annotations

import asyncio
from dataclasses import replace

import pytest

from orchard.cluster.coordinator.coordinator import Coordinator, CoordinatorConfig
from orchard.cluster.coordinator.link_cost import LinkCostFit, MigrationOverhead
from orchard.cluster.coordinator.membership import NodeLoad
from orchard.cluster.coordinator.replication import NodeLoadView, ReplicationConfig, ReplicationPlanner
from orchard.cluster.coordinator.router import MigrationPlan, Router
from orchard.cluster.gateway.block_pull import MigrationPolicy, migration_hashes, pull_for_request
from orchard.kvcache.events import PackedEvents
from orchard.kvcache.wire import decode_blocks, encode_blocks
from orchard.node.async_engine import AsyncEngine
from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.serving.migration import BlockMover, MigrationConfig, chunked, probe_payload
from orchard.node.types import SamplingParams

BS = 16
GREEDY = SamplingParams(max_tokens=8, temperature=0.0, ignore_eos=True)


def prompt(seed: int, length: int = 70) -> list[int]:
    return [(seed * 31 + j * 7) % 2000 + 10 for j in range(length)]


def engine(**overrides) -> AsyncEngine:
    config = EngineConfig(block_size=BS, num_blocks=overrides.pop("num_blocks", 48), max_num_batched_tokens=128, **overrides)
    return AsyncEngine(LLMEngine(config))


@pytest.fixture
def engines():
    made: list[AsyncEngine] = []

    def make(**overrides) -> AsyncEngine:
        made.append(engine(**overrides))
        return made[-1]

    yield make
    for e in made:
        e.shutdown()


async def generate(eng: AsyncEngine, request_id: str, tokens: list[int]):
    last = None
    async for out in eng.generate(request_id, tokens, GREEDY):
        last = out
    return last.outputs[0].token_ids, last.num_cached_tokens


def hashes_of(eng: AsyncEngine, tokens: list[int]):
    return eng.engine.kv.block_hashes(tokens)


# ---- node side: pulls between two engines ---------------------------------------------


def test_pulled_prefix_gives_the_greedy_tokens_of_recomputing_and_is_hit(engines):
    source, target, fresh = engines(), engines(), engines()
    tokens = prompt(1)  # 4 full blocks + 6 tokens

    async def run():
        await generate(source, "warm", tokens)
        mover = BlockMover(target, MigrationConfig(chunk_bytes=2 * source.engine.kv.geometry.bytes_per_block))
        result = await mover.pull(BlockMover(source).export, "a", hashes_of(source, tokens))
        migrated = await generate(target, "migrated", tokens)
        recomputed = await generate(fresh, "recomputed", tokens)
        return result, mover, migrated, recomputed

    result, mover, (migrated, hit), (recomputed, fresh_hit) = asyncio.run(run())
    assert (result.ok, result.requested, result.local, result.imported) == (True, 4, 0, 4)
    assert result.bytes > 4 * source.engine.kv.geometry.bytes_per_block
    assert migrated == recomputed
    assert (hit, fresh_hit) == (4 * BS, 0)
    assert mover.counters.migrated_blocks == 4


def test_pull_skips_blocks_the_target_already_holds(engines):
    source, target = engines(), engines()
    tokens = prompt(2)

    async def run():
        await generate(source, "warm", tokens)
        await generate(target, "own", tokens[: 2 * BS + 1])  # target holds the first two blocks
        return await BlockMover(target).pull(BlockMover(source).export, "a", hashes_of(source, tokens))

    result = asyncio.run(run())
    assert (result.ok, result.local, result.imported) == (True, 2, 2)


def test_blocks_in_the_targets_cold_tier_are_restored_not_pulled(engines, tmp_path):
    source = engines()
    target = engines(num_blocks=8, cold_tier_dir=str(tmp_path), cold_tier_gb=0.05)
    tokens = prompt(3)

    async def run():
        await generate(source, "warm", tokens)
        await generate(target, "own", tokens)
        for i in range(3):  # push the prefix out of the target's memory into its cold tier
            await generate(target, f"evict{i}", prompt(100 + i))
        asked = []

        async def fetch(chunk):
            asked.append(len(chunk))
            return await BlockMover(source).export(chunk)

        result = await BlockMover(target).pull(fetch, "a", hashes_of(source, tokens))
        return result, asked, await generate(target, "again", tokens)

    result, asked, (_, hit) = asyncio.run(run())
    assert (result.ok, result.local, result.imported, asked) == (True, 4, 0, [])
    assert hit == 4 * BS


def test_corrupted_payload_is_refused_counted_and_imports_nothing(engines):
    source, target = engines(), engines()
    tokens = prompt(4)

    async def run():
        await generate(source, "warm", tokens)
        payload = bytearray(await BlockMover(source).export(hashes_of(source, tokens)))
        payload[len(payload) // 2] ^= 0xFF

        async def corrupted(_chunk):
            return bytes(payload)

        mover = BlockMover(target)
        result = await mover.pull(corrupted, "a", hashes_of(source, tokens))
        return result, mover, await generate(target, "after", tokens), await generate(source, "reference", tokens)

    result, mover, (tokens_after, hit), (reference, _) = asyncio.run(run())
    assert (result.ok, result.imported) == (False, 0)
    assert "CorruptKVPayload" in result.error
    assert mover.counters.migration_failures == 1
    assert (tokens_after, hit) == (reference, 0)


def test_payload_of_another_model_is_refused(engines):
    source, target = engines(), engines()
    tokens = prompt(5)

    async def run():
        await generate(source, "warm", tokens)
        geometry = source.engine.kv.geometry
        blocks = decode_blocks(await BlockMover(source).export(hashes_of(source, tokens)), geometry)
        foreign = encode_blocks(replace(geometry, model_fingerprint="another-model"), blocks)

        async def fetch(_chunk):
            return foreign

        return await BlockMover(target).pull(fetch, "a", hashes_of(source, tokens))

    result = asyncio.run(run())
    assert (result.ok, result.imported) == (False, 0)
    assert "IncompatibleKVPayload" in result.error


def test_source_dying_mid_transfer_keeps_the_blocks_that_arrived_whole(engines):
    source, target = engines(), engines()
    tokens = prompt(6)
    per_block = source.engine.kv.geometry.bytes_per_block

    async def run():
        await generate(source, "warm", tokens)
        calls = []

        async def dies_after_first(chunk):
            calls.append(chunk)
            if len(calls) > 1:
                raise ConnectionError("source raylet died")
            return await BlockMover(source).export(chunk)

        mover = BlockMover(target, MigrationConfig(chunk_bytes=2 * per_block))
        result = await mover.pull(dies_after_first, "a", hashes_of(source, tokens))
        after = await generate(target, "after", tokens)
        reference = await generate(source, "reference", tokens)
        return result, after, reference

    result, (after, hit), (reference, _) = asyncio.run(run())
    assert (result.ok, result.imported) == (False, 2)
    assert "ConnectionError" in result.error
    assert (after, hit) == (reference, 2 * BS)


def test_export_of_evicted_blocks_stops_at_the_first_missing_one(engines):
    source = engines(num_blocks=8)
    tokens = prompt(7)

    async def run():
        await generate(source, "warm", tokens)
        hashes = hashes_of(source, tokens)
        await generate(source, "evicts", prompt(200))  # needs 5 of the 7 usable blocks
        return decode_blocks(await BlockMover(source).export(hashes), source.engine.kv.geometry), hashes

    blocks, hashes = asyncio.run(run())
    assert [b.block_hash for b in blocks] == hashes[: len(blocks)]
    assert len(blocks) < 4


def test_probe_payload_decodes_and_never_chains_from_a_model_root():
    geometry = LLMEngine(EngineConfig(num_blocks=4)).kv.geometry
    blocks = decode_blocks(probe_payload(geometry, 3 * geometry.bytes_per_block), geometry)
    assert len(blocks) == 3
    assert [b.parent_hash for b in blocks[1:]] == [b.block_hash for b in blocks[:-1]]


def test_chunks_respect_the_byte_cap_and_keep_order():
    assert chunked(list(range(7)), 100, 250) == [[0, 1], [2, 3], [4, 5], [6]]
    assert chunked(list(range(3)), 1000, 10) == [[0], [1], [2]]


# ---- gateway side: the decision's hashes and the fallback -----------------------------


def test_migration_moves_the_run_after_the_targets_own_blocks():
    plan = MigrationPlan("a", num_blocks=3, est_transfer_s=0.1, est_recompute_s=1.0)
    assert migration_hashes(plan, 2, [bytes([i]) for i in range(8)]) == [bytes([2]), bytes([3]), bytes([4])]


def test_wait_is_a_multiple_of_the_estimate_with_a_floor():
    policy = MigrationPolicy(min_wait_s=2.0, slack=5.0)
    assert policy.wait_s(MigrationPlan("a", 1, 0.1, 1.0)) == 2.0
    assert policy.wait_s(MigrationPlan("a", 1, 3.0, 9.0)) == 15.0


class _Method:
    def __init__(self, fn):
        self.fn = fn
        self.calls = []

    def remote(self, *args):
        self.calls.append(args)
        return self.fn(*args)


class _Actor:
    def __init__(self, **methods):
        for name, fn in methods.items():
            setattr(self, name, _Method(fn))


def test_a_pull_that_outlasts_its_wait_falls_back_and_is_counted():
    async def slow_pull(*_):
        await asyncio.sleep(5)

    coordinator = _Actor(migration_failed=lambda *args: None)
    target = _Actor(pull_blocks=slow_pull)
    outcome = asyncio.run(pull_for_request(coordinator, target, "b", object(), "a", [b"h" * 16], wait_s=0.05))
    assert (outcome.ok, outcome.reported) == (False, False)
    assert "TimeoutError" in outcome.error
    assert coordinator.migration_failed.calls == [("b", "a", outcome.error)]


def test_a_refused_pull_reported_by_the_target_is_not_counted_twice():
    async def refused(*_):
        return {"ok": False, "requested": 4, "imported": 0, "local": 0, "error": "CorruptKVPayload: checksum"}

    coordinator = _Actor(migration_failed=lambda *args: None)
    outcome = asyncio.run(pull_for_request(coordinator, _Actor(pull_blocks=refused), "b", object(), "a", [b"h"], 1.0))
    assert (outcome.ok, outcome.reported, outcome.requested) == (False, True, 4)
    assert coordinator.migration_failed.calls == []


# ---- coordinator: counters, link rates, moves -------------------------------------------


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def coordinator_with(*node_ids, prefill_tps=1000.0, bytes_per_block=4096) -> tuple[Coordinator, Clock]:
    clock = Clock()
    # Routes here probe the cost model one at a time, so none may count as a prefix in flight.
    config = CoordinatorConfig(replication=ReplicationConfig(hot_arrivals=3), pending_prefix_ttl_s=0.0)
    coord = Coordinator(config, clock)
    for node_id in node_ids:
        info = {"model": "m", "block_size": BS, "bytes_per_block": bytes_per_block, "actor_name": f"actor-{node_id}"}
        coord.register_node(node_id, info)
        coord.kv_snapshot(node_id, 0, [])
        coord.heartbeat(node_id, {"prefill_tokens_per_s": prefill_tps, "decode_tokens_per_s": 100.0})
    return coord, clock


def test_migration_reports_count_blocks_and_failures_and_feed_the_link_rate():
    coord, _ = coordinator_with("a", "b")
    coord.migration_report("b", {"source": "a", "ok": True, "imported": 5, "bytes": 2e7, "seconds": 0.01,
                                 "bytes_per_s": 2e9})
    coord.migration_report("b", {"source": "a", "ok": False, "imported": 1, "error": "CorruptKVPayload"})
    coord.migration_failed("b", "a", "timeout")
    row = {r["node_id"]: r for r in coord.nodes()}["b"]
    assert (row["kv_migrated_blocks"], row["kv_migration_failures"]) == (6, 2)
    assert coord.link_rate("a", "b") == pytest.approx(2e9)
    assert coord.link_rate("b", "a") is None


def test_link_fit_separates_fixed_latency_from_rate():
    fit = LinkCostFit()
    for _ in range(3):
        fit.add(1e6, 0.020 + 1e6 / 1e9)
        fit.add(1e8, 0.020 + 1e8 / 1e9)
    assert fit.latency_s == pytest.approx(0.020, rel=1e-6)
    assert fit.bytes_per_s == pytest.approx(1e9, rel=1e-6)


def test_link_fit_of_one_size_goes_through_the_origin():
    fit = LinkCostFit()
    fit.add(1e6, 0.01)
    assert (fit.latency_s, fit.bytes_per_s) == (0.0, pytest.approx(1e8))


def test_link_fit_estimates_a_moves_seconds_from_both_terms():
    fit = LinkCostFit()
    assert fit.estimate_s(1e6) is None
    for nbytes in (1e6, 1e8, 1e6, 1e8):
        fit.add(nbytes, 0.005 + nbytes / 2e9)
    assert fit.estimate_s(4e8) == pytest.approx(0.005 + 0.2, rel=1e-6)


def test_moves_over_another_path_start_the_pairs_fit_afresh():
    coord, _ = coordinator_with("a", "b")
    for nbytes in (65536, 8 << 20):  # the Ray probes of a join: 0.5 GB/s, 20 ms fixed
        coord.record_transfer("a", "b", nbytes, 0.020 + nbytes / 5e8, "ray")
    assert coord.link_latency("a", "b") == pytest.approx(0.020, rel=1e-3)
    for nbytes in (65536, 8 << 20, 65536, 8 << 20):  # then pulls over the direct path: 2 GB/s, 1 ms fixed
        coord.migration_report("b", {"source": "a", "ok": True, "imported": 1, "bytes": nbytes,
                                     "seconds": 0.001 + nbytes / 2e9, "bytes_per_s": 1.0, "via": "direct"})
    assert coord.link_rate("a", "b") == pytest.approx(2e9, rel=1e-3)
    assert coord.link_latency("a", "b") == pytest.approx(0.001, rel=1e-3)


def test_a_pull_whose_fixed_cost_exceeds_the_prefill_is_not_planned():
    coord, _ = coordinator_with("a", "b", prefill_tps=1000.0, bytes_per_block=65536)
    hashes = [bytes([i]) * 16 for i in range(2)]
    coord.index.load_snapshot("a", 0, [(h, "memory") for h in hashes])
    coord.membership.get("a").load = NodeLoad(queued_prefill_tokens=100_000)
    coord.record_transfer("a", "b", 65536, 0.040 + 65536 / 1e9)  # 40 ms per pull, then 1 GB/s
    coord.record_transfer("a", "b", 8 << 20, 0.040 + (8 << 20) / 1e9)
    assert coord.route("m", hashes, 2 * BS + 1, BS).migration is None  # 32 tokens take 32 ms here
    many = [bytes([i]) * 16 for i in range(64)]
    coord.index.load_snapshot("a", 0, [(h, "memory") for h in many])
    assert coord.route("m", many, 64 * BS + 1, BS).migration.num_blocks == 64


def test_the_overhead_callers_measure_makes_a_short_prefix_recompute_while_a_long_one_migrates():
    coord, _ = coordinator_with("a", "b", prefill_tps=1000.0, bytes_per_block=65536)  # 1 ms a token
    short, long = [bytes([i]) * 16 for i in range(2)], [bytes([i]) * 16 for i in range(64)]
    coord.index.load_snapshot("a", 0, [(h, "memory") for h in long])
    coord.membership.get("a").load = NodeLoad(queued_prefill_tokens=100_000)
    for nbytes in (65536, 8 << 20, 65536, 8 << 20):  # pulls themselves: 1 ms fixed, then 1 GB/s
        coord.record_transfer("a", "b", nbytes, 0.001 + nbytes / 1e9, "direct")
    assert coord.route("m", short, 2 * BS + 1, BS).migration is not None  # ~1.1 ms against 32 ms
    coord.migration_overhead("a", "b", 65536, 0.040)  # what the gateway waited beyond a pull
    assert coord.link_latency("a", "b") == pytest.approx(0.041, rel=1e-3)
    assert coord.route("m", short, 2 * BS + 1, BS).migration is None  # 41 ms against 32 ms
    assert coord.route("m", long, 64 * BS + 1, BS).migration.num_blocks == 64  # 45 ms against 1 s


def test_a_pair_without_its_own_overhead_borrows_the_measured_mean():
    coord, _ = coordinator_with("a", "b", "c")
    coord.migration_overhead("a", "b", 65536, 0.010)
    coord.migration_overhead("c", "b", 65536, 0.030)
    assert coord.link_latency("a", "c") == pytest.approx(0.020)
    assert coord.link_latency("a", "b") == pytest.approx(0.010)


def test_a_pull_tells_the_coordinator_what_the_step_waited_beyond_the_pull():
    async def pull(*_):  # the target timed 160 ms of its 200 ms as the pull
        await asyncio.sleep(0.2)
        return {"ok": True, "requested": 1, "imported": 1, "local": 0, "bytes": 65536, "seconds": 0.16}

    coordinator = _Actor(migration_overhead=lambda *args: None, migration_failed=lambda *args: None)
    outcome = asyncio.run(pull_for_request(coordinator, _Actor(pull_blocks=pull), "b", object(), "a", [b"h"], 1.0))
    assert outcome.ok
    [(source, target, nbytes, seconds)] = coordinator.migration_overhead.calls
    assert (source, target, nbytes) == ("a", "b", 65536) and 0.04 <= seconds < 0.5
    assert seconds < 0.2  # the wait less the pull: not the whole wait


def test_only_the_fixed_part_of_an_overhead_that_grows_with_the_pull_is_priced():
    overhead = MigrationOverhead()
    assert overhead.fixed_s == 0.0
    overhead.add(1e6, 0.004)
    assert overhead.fixed_s == pytest.approx(0.004)  # one size: its mean
    growing = MigrationOverhead()
    for _ in range(3):
        growing.add(1e6, 0.003 + 1e6 * 3e-10)
        growing.add(3e7, 0.003 + 3e7 * 3e-10)  # 12 ms around the larger pull
    assert growing.fixed_s == pytest.approx(0.003, rel=1e-6)


def test_a_node_whose_steps_cost_mostly_a_fixed_part_recomputes_a_short_prefix():
    # 10 ms a step plus 0.1 ms a token: the average over a 33-token step is 0.4 ms a token,
    # which prices 32 tokens at 12.8 ms against a 6 ms migration; what they add is 3.2 ms.
    coord, _ = coordinator_with("a", "b", prefill_tps=1 / 0.0004, bytes_per_block=65536)
    short, long = [bytes([i]) * 16 for i in range(2)], [bytes([i]) * 16 for i in range(16)]
    coord.index.load_snapshot("a", 0, [(h, "memory") for h in long])
    coord.membership.get("a").load = NodeLoad(queued_prefill_tokens=100_000)
    for nbytes in (65536, 8 << 20):
        coord.record_transfer("a", "b", nbytes, 0.003 + nbytes / 1e9, "direct")
    coord.migration_overhead("a", "b", 65536, 0.003)
    assert coord.route("m", short, 2 * BS + 1, BS).migration is not None  # the average rate: 12.8 ms
    coord.heartbeat("b", {"prefill_tokens_per_s": 1 / 0.0004, "prefill_marginal_tokens_per_s": 1e4})
    assert coord.route("m", short, 2 * BS + 1, BS).migration is None  # 3.2 ms against 6 ms
    assert coord.route("m", long, 16 * BS + 1, BS).migration.num_blocks == 16  # 26 ms against 7 ms


def test_a_joining_node_is_told_its_peers_to_probe():
    coord, _ = coordinator_with("a", "b", "c")
    assert coord.link_peers("b") == [{"node_id": "a", "actor_name": "actor-a"}, {"node_id": "c", "actor_name": "actor-c"}]


def test_router_migrates_only_once_a_link_rate_is_measured_and_beats_prefill():
    coord, _ = coordinator_with("a", "b", prefill_tps=1000.0, bytes_per_block=1 << 20)
    hashes = [bytes([i]) * 16 for i in range(8)]
    coord.kv_events("a", PackedEvents.of([]))
    coord.index.load_snapshot("a", 0, [(h, "memory") for h in hashes])
    coord.membership.get("a").load = NodeLoad(queued_prefill_tokens=100_000)  # a is swamped
    assert coord.route("m", hashes, 8 * BS + 1, BS).migration is None  # no rate measured yet
    coord.record_link_rate("a", "b", 10e9)  # 8 MiB in ~0.8 ms vs 128 tokens in 128 ms
    decision = coord.route("m", hashes, 8 * BS + 1, BS)
    assert (decision.node_id, decision.reason, decision.migration.source, decision.migration.num_blocks) == (
        "b", "migrate", "a", 8)
    slow, _ = coordinator_with("a", "b", prefill_tps=1000.0, bytes_per_block=1 << 20)
    slow.index.load_snapshot("a", 0, [(h, "memory") for h in hashes])
    slow.membership.get("a").load = NodeLoad(queued_prefill_tokens=100_000)
    slow.record_link_rate("a", "b", 10e6)  # 8 MiB in 0.8 s: recomputing is faster
    assert slow.route("m", hashes, 8 * BS + 1, BS).migration is None


def test_a_hot_prefix_on_a_saturated_holder_is_handed_to_the_least_loaded_node():
    coord, clock = coordinator_with("a", "b", "c")
    hashes = [bytes([i]) * 16 for i in range(4)]
    coord.index.load_snapshot("a", 0, [(h, "memory") for h in hashes])
    coord.membership.get("a").load = NodeLoad(queued_prefill_tokens=5000)  # 5 s queued vs 64 ms to recompute
    coord.membership.get("c").load = NodeLoad(running=30)  # 0.3 s of decodes
    for _ in range(2):
        coord.route("m", hashes, 4 * BS + 3, BS)
        clock.now += 1
    assert coord.pending_moves("a") == []
    coord.route("m", hashes, 4 * BS + 3, BS)
    moves = coord.heartbeat("a", {})["moves"]
    assert moves == [{"target": "b", "target_actor": "actor-b", "hashes": hashes, "reason": "hot-prefix"}]
    coord.route("m", hashes, 4 * BS + 3, BS)  # cooling down: no second copy
    assert coord.pending_moves("a") == []


def test_a_hot_prefix_on_an_idle_holder_stays_where_it_is():
    coord, _ = coordinator_with("a", "b")
    hashes = [bytes([i]) * 16 for i in range(4)]
    coord.index.load_snapshot("a", 0, [(h, "memory") for h in hashes])
    for _ in range(5):
        coord.route("m", hashes, 4 * BS + 3, BS)
    assert coord.pending_moves("a") == []


def test_draining_hands_the_most_used_prefixes_to_other_nodes():
    coord, _ = coordinator_with("a", "b", "c")
    popular = [bytes([i]) * 16 for i in range(3)]
    rare = [bytes([50 + i]) * 16 for i in range(2)]
    elsewhere = [bytes([90 + i]) * 16 for i in range(2)]
    coord.index.load_snapshot("a", 0, [(h, "memory") for h in popular + rare + elsewhere])
    coord.index.load_snapshot("c", 0, [(h, "memory") for h in elsewhere])
    for hashes, times in ((popular, 3), (rare, 1), (elsewhere, 5)):
        for _ in range(times):
            coord.route("m", hashes, len(hashes) * BS + 1, BS)
    coord.drain("a")
    moves = coord.heartbeat("a", {})["moves"]
    assert [(m["hashes"], m["reason"]) for m in moves] == [(popular, "drain"), (rare, "drain")]
    assert {m["target"] for m in moves} == {"b", "c"}


def test_planner_forgets_the_least_recent_prefix_beyond_its_capacity():
    planner = ReplicationPlanner(ReplicationConfig(tracked_prefixes=2))
    views = [NodeLoadView("a", 0.0, 1e-3)]
    for key in (b"x", b"y", b"z"):
        planner.on_arrival([key], {"a": 1}, lambda: views, BS, 0.0)
    assert [planner.uses([k]) for k in (b"x", b"y", b"z")] == [0, 1, 1]


def test_router_load_seconds_uses_measured_rates():
    coord, _ = coordinator_with("a", prefill_tps=500.0)
    coord.membership.get("a").load = NodeLoad(queued_prefill_tokens=1000, running=2)
    (load, prefill), = Router().load_seconds(coord.membership.candidates("m")).values()
    assert prefill == pytest.approx(1 / 500)
    assert load == pytest.approx(1000 / 500 + 2 / 100)


def test_the_migration_bench_takes_the_connections_a_pull_spreads_over():
    from orchard.cluster.bench.migration import parse_args

    config, link, via_ray = parse_args(["--connections", "2", "--sizes", "small"])
    assert (config.connections, config.sizes, link, via_ray) == (2, ("small",), None, False)
    assert parse_args([])[0].connections is None  # the pulling node's cores decide

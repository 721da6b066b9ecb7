"""Coordinator without Ray: the node conversation, routing over the index, death, drain, restart."""

from __future__ import annotations

import pytest

from orchard.cluster.coordinator.coordinator import Coordinator, CoordinatorConfig
from orchard.cluster.coordinator.membership import MembershipConfig, NodeInfo
from orchard.cluster.coordinator.prefix_index import PrefixIndex
from orchard.cluster.coordinator.router import NoNodeAvailable, RouterConfig
from orchard.kvcache.events import MEMORY, EventLog, PackedEvents
from orchard.kvcache.hashing import block_hashes, root_hash

BS = 4
ROOT = root_hash("demo")
PROMPT = list(range(32))
HASHES = block_hashes(PROMPT, BS, ROOT)
LOAD = {"prefill_tokens_per_s": 1000.0, "decode_tokens_per_s": 100.0}


class Clock:
    def __init__(self):
        self.now = 100.0

    def __call__(self):
        return self.now


def make(*node_ids, model="demo", dead_after_s=5.0, policy="prefix"):
    clock = Clock()
    config = CoordinatorConfig(RouterConfig(policy=policy, seed=0), MembershipConfig(dead_after_s=dead_after_s))
    coord = Coordinator(config, clock=clock)
    logs = {}
    for node_id in node_ids:
        assert coord.register_node(node_id, {"model": model, "block_size": BS}) == {"snapshot": True}
        coord.kv_snapshot(node_id, 0, [])
        coord.heartbeat(node_id, LOAD)
        logs[node_id] = EventLog()
    return coord, clock, logs


def serve(coord, logs, node_id, hashes):
    """What a node does after prefilling: report the blocks it now caches."""
    log = logs[node_id]
    parent = None
    for h in hashes:
        log.stored(h, parent, (0,) * BS)
        parent = h
    return coord.kv_events(node_id, PackedEvents.of(log.drain()))


def route(coord, policy=None, exclude=(), request_id=""):
    return coord.route("demo", HASHES, len(PROMPT), BS, request_id=request_id, policy=policy, exclude=exclude)


def test_second_request_with_same_prefix_goes_to_the_node_that_served_the_first():
    coord, clock, logs = make("a", "b", "c")
    first = route(coord, request_id="first")
    assert serve(coord, logs, first.node_id, HASHES)
    coord.prefill_done(first.node_id, "first")
    second = route(coord)
    assert second.node_id == first.node_id
    assert second.cached_blocks == len(HASHES)
    assert second.reason == "prefix-hit"


def test_round_robin_spreads_the_same_prefix():
    coord, clock, logs = make("a", "b", "c", policy="round_robin")
    serve(coord, logs, "a", HASHES)
    assert [route(coord).node_id for _ in range(3)] == ["a", "b", "c"]


def test_events_before_snapshot_are_refused_after_register():
    coord = Coordinator()
    coord.register_node("a", NodeInfo(model="demo", block_size=BS))
    log = EventLog()
    log.stored(HASHES[0], None, (0,) * BS)
    assert coord.kv_events("a", PackedEvents.of(log.drain())) is False
    assert coord.heartbeat("a", LOAD)["snapshot"] is True
    coord.kv_snapshot("a", log.next_seq, [(HASHES[0], MEMORY)])
    assert coord.heartbeat("a", LOAD)["snapshot"] is False
    assert route(coord).cached_blocks == 1


def test_missed_heartbeats_mark_node_dead_and_drop_its_blocks():
    coord, clock, logs = make("a", "b", dead_after_s=3.0)
    serve(coord, logs, "a", HASHES)
    clock.now += 2.0
    coord.heartbeat("b", LOAD)
    clock.now += 2.0  # a: 4 s silent; b: 2 s
    assert coord.reap() == ["a"]
    assert coord.index.match(HASHES) == {}
    assert route(coord).node_id == "b"
    assert {n["node_id"]: n["status"] for n in coord.nodes()} == {"a": "dead", "b": "alive"}


def test_dead_nodes_leave_the_cluster_report_at_once_and_the_registry_later():
    coord, clock, logs = make("a", "b", dead_after_s=3.0)
    assert coord.node_failed("a", "actor died")
    assert [n["node_id"] for n in coord.cluster_info()["nodes"]] == ["b"]  # /v1/cluster and /metrics read this
    assert coord.node_status("a") == "dead"  # still answers those who ask about it
    clock.now += MembershipConfig().forget_dead_after_s + 1
    coord.heartbeat("b", LOAD)
    assert coord.node_status("a") is None
    assert [n["node_id"] for n in coord.nodes()] == ["b"]
    assert coord.register_node("a", {"model": "demo", "block_size": BS}) == {"snapshot": True}  # may come back


def test_node_failure_report_stops_routing_at_once():
    coord, clock, logs = make("a", "b")
    serve(coord, logs, "a", HASHES)
    assert coord.node_failed("a", "actor died")
    assert not coord.node_failed("a", "actor died")
    assert route(coord).node_id == "b"
    assert coord.kv_events("a", PackedEvents.of([])) is True  # ignored, not a snapshot request


def test_dead_node_heartbeat_is_told_to_register_again_and_rejoins_empty():
    coord, clock, logs = make("a", "b")
    serve(coord, logs, "a", HASHES)
    coord.node_failed("a")
    assert coord.heartbeat("a", LOAD)["known"] is False
    coord.register_node("a", {"model": "demo", "block_size": BS})
    coord.kv_snapshot("a", 0, [])
    assert coord.index.match(HASHES) == {}
    assert [n["status"] for n in coord.nodes() if n["node_id"] == "a"] == ["alive"]


def test_exclude_skips_a_node_a_resumed_request_just_lost():
    coord, clock, logs = make("a", "b")
    serve(coord, logs, "a", HASHES)
    assert route(coord, exclude=["a"]).node_id == "b"


def test_drain_stops_new_work_and_heartbeat_says_so():
    coord, clock, logs = make("a", "b")
    serve(coord, logs, "a", HASHES)
    assert coord.drain("a")["status"] == "draining"
    assert coord.heartbeat("a", LOAD)["draining"] is True
    assert {route(coord).node_id for _ in range(5)} == {"b"}
    coord.undrain("a")
    assert route(coord).node_id == "a"


def test_no_node_for_model_raises():
    coord, clock, logs = make("a")
    with pytest.raises(NoNodeAvailable):
        coord.route("other-model", HASHES, len(PROMPT), BS)


def test_restarted_coordinator_rebuilds_index_from_snapshots():
    coord, clock, logs = make("a", "b")
    serve(coord, logs, "b", HASHES)
    fresh = Coordinator()
    # Nodes learn of the restart from their next heartbeat, then register and send a snapshot.
    assert fresh.heartbeat("b", LOAD) == {"known": False, "snapshot": False, "draining": False}
    for node_id in ("a", "b"):
        fresh.register_node(node_id, {"model": "demo", "block_size": BS})
        blocks = [(h, MEMORY) for h in HASHES] if node_id == "b" else []
        fresh.kv_snapshot(node_id, logs[node_id].next_seq, blocks)
        fresh.heartbeat(node_id, LOAD)
    decision = fresh.route("demo", HASHES, len(PROMPT), BS)
    assert (decision.node_id, decision.cached_blocks) == ("b", len(HASHES))


def test_cluster_info_reports_nodes_index_and_routing_totals():
    coord, clock, logs = make("a", "b")
    serve(coord, logs, "a", HASHES)
    route(coord)
    info = coord.cluster_info()
    assert info["policy"] == "prefix"
    assert info["models"] == ["demo"]
    assert info["index"]["blocks"] == len(HASHES)
    assert info["routing"]["requests"] == 1
    assert info["routing"]["routed_hit_rate"] == pytest.approx(1.0)
    assert [d["node_id"] for d in info["recent_decisions"]] == ["a"]
    assert {n["node_id"]: n["indexed_blocks"] for n in info["nodes"]} == {"a": len(HASHES), "b": 0}


def test_routing_totals_count_decisions_by_node_and_reason_and_name_the_prefix():
    coord, clock, logs = make("a", "b")
    serve(coord, logs, "a", HASHES)
    route(coord, request_id="r1")
    route(coord, request_id="r2")
    info = coord.cluster_info()
    assert info["routing"]["decisions"] == [{"node": "a", "reason": "prefix-hit", "count": 2}]
    assert {d["prefix"] for d in info["recent_decisions"]} == {bytes(HASHES[0])[:6].hex()}


def test_set_policy_switches_router():
    coord, clock, logs = make("a", "b")
    serve(coord, logs, "b", HASHES)
    coord.set_policy("round_robin")
    assert [route(coord).node_id for _ in range(2)] == ["a", "b"]


def test_routed_prefill_counts_as_load_until_reported_done():
    coord, clock, logs = make("a", "b")
    serve(coord, logs, "a", HASHES)
    routed = [coord.route("demo", HASHES, 4000, BS, request_id=f"r{i}").node_id for i in range(3)]
    assert routed == ["a", "b", "a"]  # long prompts: pending prefill outweighs the prefix
    a = coord.membership.get("a")
    assert a.pending_prefill_tokens == 2 * (4000 - 32)
    coord.prefill_done("a", "r0")
    coord.prefill_done("a", "r2")
    assert a.pending_requests == 0
    assert coord.route("demo", HASHES, 4000, BS, request_id="r3").node_id == "a"


def test_prefill_reported_done_is_taken_off_a_stale_heartbeat():
    coord, clock, logs = make("a", "b")
    coord.route("demo", HASHES, 400, BS, request_id="r0")  # goes to a or b at random
    node = coord.membership.get("a") if coord.membership.get("a").pending else coord.membership.get("b")
    coord.heartbeat(node.node_id, {**LOAD, "queued_prefill_tokens": 400})  # sent while r0 waited
    coord.prefill_done(node.node_id, "r0")
    assert node.queued_prefill_tokens == 0


def test_unclosed_routed_work_expires():
    coord, clock, logs = make("a", dead_after_s=100.0)
    route(coord)
    clock.now += 61.0
    coord.heartbeat("a", LOAD)
    assert coord.membership.get("a").pending_requests == 0


def test_a_prefix_routed_but_not_yet_reported_counts_as_held_there_until_it_expires():
    coord, clock, logs = make("a", "b", "c", dead_after_s=1000.0)
    first = route(coord, request_id="first")
    coord.prefill_done(first.node_id, "first")  # its blocks are not reported yet
    second = route(coord, request_id="second")
    assert second.node_id == first.node_id and second.cached_blocks == len(HASHES)
    assert coord.index.match(HASHES) == {}  # the index itself still knows only events
    coord.prefill_done(first.node_id, "second")
    clock.now += CoordinatorConfig().pending_prefix_ttl_s + 1
    assert route(coord).cached_blocks == 0


def test_pending_prefixes_vanish_with_their_node():
    coord, clock, logs = make("a", "b")
    first = route(coord, request_id="first")
    coord.node_failed(first.node_id)
    assert len(coord.pending) == 0
    assert route(coord).node_id != first.node_id


def test_node_rows_carry_the_chip_and_memory_a_node_registered_with():
    coord = Coordinator(CoordinatorConfig(), clock=Clock())
    coord.register_node("m1", {"model": "demo", "block_size": BS, "chip": "Apple M4 Max", "memory_bytes": 128 << 30})
    (row,) = coord.cluster_info()["nodes"]
    assert (row["chip"], row["memory_bytes"]) == ("Apple M4 Max", 128 << 30)


def test_a_hybrid_node_is_credited_only_up_to_its_last_state():
    clock = Clock()
    coord = Coordinator(CoordinatorConfig(RouterConfig(policy="prefix", seed=0), MembershipConfig()), clock=clock)
    logs = {}
    for node_id in ("a", "b"):
        coord.register_node(node_id, {"model": "demo", "block_size": BS, "state_bytes": 4096})
        coord.kv_snapshot(node_id, 0, [])
        coord.heartbeat(node_id, LOAD)
        logs[node_id] = EventLog()
    serve(coord, logs, "a", HASHES)  # every block, a state after the second only
    logs["a"].state_stored(HASHES[1])
    coord.kv_events("a", PackedEvents.of(logs["a"].drain()))
    serve(coord, logs, "b", HASHES[:6])  # fewer blocks, a state after the sixth
    logs["b"].state_stored(HASHES[5])
    coord.kv_events("b", PackedEvents.of(logs["b"].drain()))
    assert coord.match(HASHES) == {"a": 2, "b": 6}
    decision = route(coord)
    assert (decision.node_id, decision.cached_blocks) == ("b", 6)
    other = block_hashes(list(range(900, 900 + 4 * BS)), BS, ROOT)
    coord.route("demo", other, 4 * BS, BS, exclude=["b"])  # a has a route pending now: its run is walked
    decision = route(coord, exclude=["b"])
    assert (decision.node_id, decision.cached_blocks) == ("a", 2)


def test_events_a_node_sends_packed_index_its_blocks_as_the_events_themselves_do():
    coord = make("a", "b")[0]
    log = EventLog()
    for parent, h in zip([None, *HASHES[:-1]], HASHES):
        log.stored(h, parent, (0,) * BS)
    log.removed(HASHES[-1])
    events = log.drain()
    assert coord.kv_events("a", PackedEvents.of(events)) is True
    plain = PrefixIndex()
    plain.load_snapshot("a", 0, [])
    assert plain.apply("a", events) is True
    assert coord.match(HASHES) == plain.match(HASHES) == {"a": len(HASHES) - 1}

"""Router: prefix affinity balanced against load; baselines; model filtering; migration by cost."""

from __future__ import annotations

import collections

import pytest

from orchard.cluster.coordinator.membership import Membership, NodeInfo, NodeLoad
from orchard.cluster.coordinator.router import NoNodeAvailable, Router, RouterConfig, RouteRequest, UnknownPolicy, ties

BS = 16


class Clock:
    def __init__(self):
        self.now = 0.0

    def __call__(self):
        return self.now


def cluster(*node_ids, model="m", prefill_tps=1000.0, decode_tps=100.0, bytes_per_block=0, state_bytes=0):
    members = Membership(clock=Clock())
    for node_id in node_ids:
        members.register(node_id, NodeInfo(model=model, block_size=BS, bytes_per_block=bytes_per_block, state_bytes=state_bytes))
        members.heartbeat(node_id, NodeLoad(prefill_tokens_per_s=prefill_tps, decode_tokens_per_s=decode_tps))
    return members


def request(held, num_tokens=256, model="m"):
    return RouteRequest(model=model, num_tokens=num_tokens, block_size=BS, held=held)


def test_prefix_holder_wins_when_loads_are_equal():
    members = cluster("a", "b", "c")
    decision = Router().route(request({"b": 12}), members.candidates("m"))
    assert decision.node_id == "b"
    assert decision.cached_blocks == 12
    assert decision.reason == "prefix-hit"


def test_longer_prefix_beats_shorter_one():
    members = cluster("a", "b")
    decision = Router().route(request({"a": 4, "b": 10}), members.candidates("m"))
    assert decision.node_id == "b"


def test_saturated_prefix_holder_loses_to_an_idle_node():
    members = cluster("a", "b")
    # 8,000 queued prefill tokens at 1,000 tok/s is 8 s of work; recomputing 256 tokens is 0.26 s.
    members.heartbeat("a", NodeLoad(queued_prefill_tokens=8000, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    decision = Router().route(request({"a": 16}), members.candidates("m"))
    assert decision.node_id == "b"
    assert decision.reason == "load"
    assert decision.cached_blocks == 0


def test_queued_prefill_counts_once_whether_seen_by_heartbeat_or_routing():
    members = cluster("a", "b")
    members.heartbeat("a", NodeLoad(queued_prefill_tokens=1000, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    members.note_routed("a", "r1", 1000)  # the same request the heartbeat already counts
    members.heartbeat("b", NodeLoad(queued_prefill_tokens=1500, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    decision = Router().route(request({}), members.candidates("m"))
    assert decision.node_id == "a"


def test_running_decodes_count_as_load():
    members = cluster("a", "b")
    members.heartbeat("a", NodeLoad(running=50, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    decision = Router().route(request({}), members.candidates("m"))
    assert decision.node_id == "b"


def test_work_routed_since_last_heartbeat_counts_as_load():
    members = cluster("a", "b")
    router = Router(RouterConfig(seed=1))
    first = router.route(request({}, num_tokens=4096), members.candidates("m"))
    members.note_routed(first.node_id, "r1", 4096)
    second = router.route(request({}, num_tokens=4096), members.candidates("m"))
    assert second.node_id != first.node_id


def test_slower_node_loses_at_equal_prefix():
    members = cluster("a", "b")
    members.heartbeat("a", NodeLoad(prefill_tokens_per_s=100.0, decode_tokens_per_s=10.0))
    decision = Router().route(request({}), members.candidates("m"))
    assert decision.node_id == "b"


def test_round_robin_ignores_the_prefix_and_cycles():
    members = cluster("a", "b", "c")
    router = Router(RouterConfig(policy="round_robin"))
    chosen = [router.route(request({"a": 16}), members.candidates("m")).node_id for _ in range(6)]
    assert chosen == ["a", "b", "c", "a", "b", "c"]


def test_least_loaded_ignores_prefix_and_picks_lowest_load():
    members = cluster("a", "b", "c")
    members.heartbeat("a", NodeLoad(running=1, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    members.heartbeat("b", NodeLoad(running=3, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    members.heartbeat("c", NodeLoad(running=2, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    decision = Router(RouterConfig(policy="least_loaded")).route(request({"b": 16}), members.candidates("m"))
    assert decision.node_id == "a"
    assert decision.reason == "least-loaded"


def test_random_policy_only_returns_candidates():
    members = cluster("a", "b", "c")
    router = Router(RouterConfig(policy="random", seed=3))
    chosen = {router.route(request({}), members.candidates("m")).node_id for _ in range(60)}
    assert chosen == {"a", "b", "c"}


def test_policy_can_be_overridden_per_call():
    members = cluster("a", "b")
    router = Router()
    decision = router.route(request({"b": 16}), members.candidates("m"), policy="round_robin")
    assert decision.node_id == "a"
    assert decision.policy == "round_robin"


def test_ties_are_broken_at_random_among_equals_only():
    members = cluster("a", "b", "c")
    members.heartbeat("c", NodeLoad(running=5, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    router = Router(RouterConfig(seed=7))
    counts = collections.Counter(router.route(request({}), members.candidates("m")).node_id for _ in range(200))
    assert set(counts) == {"a", "b"}
    assert min(counts.values()) > 50


def test_only_nodes_serving_the_model_are_candidates():
    members = cluster("a", "b", model="m")
    members.register("c", NodeInfo(model="other", block_size=BS))
    assert [n.node_id for n in members.candidates("other")] == ["c"]
    decision = Router().route(request({"a": 16}, model="other"), members.candidates("other"))
    assert decision.node_id == "c"
    assert decision.reason == "only-node"


def test_no_candidate_raises_no_node_available():
    with pytest.raises(NoNodeAvailable):
        Router().route(request({}), [])


def test_draining_node_is_not_a_candidate():
    members = cluster("a", "b")
    members.drain("a")
    decision = Router().route(request({"a": 16}), members.candidates("m"))
    assert decision.node_id == "b"


def test_unknown_policy_is_refused():
    with pytest.raises(UnknownPolicy):
        RouterConfig(policy="fastest")


def test_unmeasured_nodes_still_get_routed():
    members = Membership(clock=Clock())
    members.register("a", NodeInfo(model="m", block_size=BS))
    members.register("b", NodeInfo(model="m", block_size=BS))
    decision = Router().route(request({"a": 3}), members.candidates("m"))
    assert decision.node_id == "a"


def test_fast_link_makes_busy_holder_a_migration_source():
    members = cluster("a", "b", bytes_per_block=1_000_000)
    members.heartbeat("a", NodeLoad(queued_prefill_tokens=50_000, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    members.record_link_rate("a", "b", 1e9)  # 1 ms per block vs 16 ms to recompute one
    decision = Router().route(request({"a": 16}), members.candidates("m"), members.link_rate)
    assert decision.node_id == "b"
    assert decision.reason == "migrate"
    assert decision.migration.source == "a"
    assert decision.migration.num_blocks == 16
    assert decision.migration.est_transfer_s < decision.migration.est_recompute_s


def test_a_hybrid_models_state_counts_once_in_the_transfer_estimate():
    """A hybrid model's run travels with one recurrent state (0.3 s on this link): it tips a
    16-block pull (0.256 s of prefill) to recomputing, not a 64-block one (1.024 s)."""
    members = cluster("a", "b", bytes_per_block=1_000_000, state_bytes=300_000_000)
    members.heartbeat("a", NodeLoad(queued_prefill_tokens=50_000, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    members.record_link_rate("a", "b", 1e9)  # the link that makes the same 16-block request migrate above
    short = Router().route(request({"a": 16}), members.candidates("m"), members.link_rate)
    long = Router().route(request({"a": 64}, num_tokens=1024), members.candidates("m"), members.link_rate)
    assert short.node_id == "b" and short.migration is None
    assert long.node_id == "b" and long.migration.num_blocks == 64
    assert long.migration.est_transfer_s == pytest.approx(0.064 + 0.3)


def test_slow_link_means_recompute_instead_of_migrate():
    members = cluster("a", "b", bytes_per_block=1_000_000)
    members.heartbeat("a", NodeLoad(queued_prefill_tokens=50_000, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    members.record_link_rate("a", "b", 1e7)  # 100 ms per block: slower than recomputing
    decision = Router().route(request({"a": 16}), members.candidates("m"), members.link_rate)
    assert decision.node_id == "b"
    assert decision.migration is None


def test_the_tie_band_is_ten_percent_of_the_lower_estimate_plus_five_milliseconds():
    assert ties(1.104, 1.0) and not ties(1.106, 1.0)
    assert ties(0.0049, 0.0) and not ties(0.0051, 0.0)


def test_a_migration_whose_estimated_gain_is_within_noise_is_not_planned():
    def route_over(block_s: float):
        members = cluster("a", "b", bytes_per_block=1_000_000)
        members.heartbeat("a", NodeLoad(queued_prefill_tokens=50_000, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
        members.record_link_rate("a", "b", 1e6 / block_s)
        return Router().route(request({"a": 1}, num_tokens=BS + 1), members.candidates("m"), members.link_rate)

    assert (route_over(0.015).node_id, route_over(0.015).migration) == ("b", None)  # 15 ms against 16 ms to recompute
    assert route_over(0.008).migration.num_blocks == 1  # 8 ms: a gain past the band


def test_unmeasured_link_never_migrates():
    members = cluster("a", "b", bytes_per_block=1_000_000)
    members.heartbeat("a", NodeLoad(queued_prefill_tokens=50_000, prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    decision = Router().route(request({"a": 16}), members.candidates("m"), members.link_rate)
    assert decision.migration is None


def test_draining_holder_can_still_be_a_migration_source():
    members = cluster("a", "b", bytes_per_block=1000)
    members.record_link_rate("a", "b", 1e9)
    members.drain("a")
    decision = Router().route(request({"a": 10}), members.candidates("m"), members.link_rate)
    assert decision.node_id == "b"
    assert decision.migration.source == "a"
    assert decision.migration.num_blocks == 10


def test_full_prompt_hit_still_counts_one_token_of_prefill():
    members = cluster("a")
    decision = Router().route(request({"a": 16}, num_tokens=256), members.candidates("m"))
    assert decision.cached_blocks == 16
    assert decision.est_cost_s == pytest.approx(1 / 1000.0)


def test_recent_decisions_are_bounded():
    members = cluster("a")
    router = Router(RouterConfig(decisions_kept=3))
    for i in range(5):
        router.route(RouteRequest("m", 32, BS, {}, request_id=f"r{i}"), members.candidates("m"))
    assert [d.request_id for d in router.recent] == ["r2", "r3", "r4"]


def test_two_idle_nodes_share_new_prefixes_and_every_repeat_goes_to_its_holder():
    """a has one measurement, b five and a slightly faster rate: new prefixes still spread over both pools."""
    members = Membership(clock=Clock())
    for node_id in ("a", "b"):
        members.register(node_id, NodeInfo(model="m", block_size=BS, kv_blocks_total=1000))
    members.heartbeat("a", NodeLoad(kv_blocks_total=1000, prefill_tokens_per_s=1200.0, decode_tokens_per_s=85.0, requests_total=1))
    for requests in range(1, 6):  # b kept working and measuring
        members.heartbeat("b", NodeLoad(kv_blocks_total=1000, prefill_tokens_per_s=1333.0, decode_tokens_per_s=90.0, requests_total=requests))
    router = Router(RouterConfig(seed=3))
    holders: dict[int, str] = {}
    held_blocks = collections.Counter()
    for i in range(16):
        prefix = i % 4
        held = {holders[prefix]: 16} if prefix in holders else {}
        decision = router.route(request(held), members.candidates("m"), held_blocks=lambda n: held_blocks[n])
        if prefix in holders:
            assert decision.node_id == holders[prefix], f"repeat of prefix {prefix} left its holder"
        else:
            holders[prefix] = decision.node_id
            held_blocks[decision.node_id] += 16
    assert set(holders.values()) == {"a", "b"}, f"one pool took every prefix: {holders}"


def test_an_idle_nodes_old_rate_weighs_less_as_time_passes():
    clock = Clock()
    members = Membership(clock=clock)
    for node_id in ("a", "b"):
        members.register(node_id, NodeInfo(model="m", block_size=BS))
        members.heartbeat(node_id, NodeLoad(prefill_tokens_per_s=100.0 if node_id == "a" else 1000.0, requests_total=1))
    before = Router().load_seconds(members.candidates("m"))["a"][1]
    clock.now += 300.0
    members.heartbeat("a", NodeLoad(prefill_tokens_per_s=100.0, requests_total=1))  # idle: no new work
    after = Router().load_seconds(members.candidates("m"))["a"][1]
    assert after < before  # drifted toward the cluster's mean


def test_heartbeats_without_new_work_are_not_new_rate_evidence():
    members = cluster("a")
    node = members.get("a")
    assert node.rate_evidence == 1
    for _ in range(5):  # idle: the same rates again and again
        members.heartbeat("a", NodeLoad(prefill_tokens_per_s=1000.0, decode_tokens_per_s=100.0))
    assert node.rate_evidence == 1
    members.heartbeat("a", NodeLoad(prefill_tokens_per_s=500.0, decode_tokens_per_s=100.0))  # measured anew
    assert node.rate_evidence == 2


def test_a_migration_whose_gain_is_within_noise_does_not_take_a_repeat_from_its_holder():
    # Same machine, noisy measurements: the holder measured at half b's prefill rate. Pulling its
    # 16 blocks to b would save about 1 ms on a 3-token prefill, within the tie band: stay.
    members = cluster("a", "b", bytes_per_block=1000)
    members.heartbeat("a", NodeLoad(prefill_tokens_per_s=500.0, decode_tokens_per_s=100.0))
    members.record_link_rate("a", "b", 1e9)
    decision = Router().route(request({"a": 16}, num_tokens=259), members.candidates("m"), members.link_rate)
    assert (decision.node_id, decision.reason, decision.cached_blocks) == ("a", "prefix-hit", 16)
    # A holder far behind still loses the repeat to a migration.
    members.heartbeat("a", NodeLoad(running=20, prefill_tokens_per_s=500.0, decode_tokens_per_s=100.0))
    decision = Router().route(request({"a": 16}, num_tokens=259), members.candidates("m"), members.link_rate)
    assert (decision.node_id, decision.reason) == ("b", "migrate")

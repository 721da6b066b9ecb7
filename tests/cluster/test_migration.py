"""KV migration across two real Ray nodes (two raylets on this machine): a prefix cached on
one node is pulled by the other over the direct KV path (Ray's object store when no direct
path can be made), refused payloads fall back to recomputing, an export racing evictions
stays whole, and the counters say what moved."""

from __future__ import annotations

import asyncio
import re
import time
from dataclasses import replace

import pytest

ray = pytest.importorskip("ray")

from orchard.cluster.coordinator.coordinator import CoordinatorConfig  # noqa: E402
from orchard.cluster.coordinator.membership import MembershipConfig  # noqa: E402
from orchard.cluster.gateway.metrics import GatewayMetrics  # noqa: E402
from orchard.cluster.gateway.ray_backend import RayBackend  # noqa: E402
from orchard.cluster.runtime.ray_cluster import LocalCluster, ensure_coordinator, node_actor_config, start_node_actor  # noqa: E402
from orchard.kvcache.geometry import KVGeometry  # noqa: E402
from orchard.kvcache.hashing import block_hashes, root_hash  # noqa: E402
from orchard.kvcache.wire import decode_blocks, encode_blocks  # noqa: E402
from orchard.node.engine import EngineConfig  # noqa: E402
from orchard.node.model.loader import load_model  # noqa: E402
from orchard.node.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "orchard-demo"
BLOCK = 16
ENGINE = EngineConfig(block_size=BLOCK, num_blocks=40, max_num_seqs=8, max_num_batched_tokens=128)
GREEDY = SamplingParams(max_tokens=6, temperature=0.0, ignore_eos=True)
LINK_TOKEN = "a-test-cluster-token-for-the-kv-link-000"
BLOCK_BYTES = 65536  # a demo model block's KV on the wire


@pytest.fixture(scope="module")
def cluster():
    """Two raylets, node "a" on the head and node "b" on the worker, plus the coordinator. Node "b" pulls in
    chunks of two blocks over two connections at once (a four-block prefix: two blocks on each); node "a" as
    configured by default (one connection on this machine's cores)."""
    from orchard.node.serving.actor import RAY_NODE_HOST
    from orchard.node.serving.kv_link import KVLinkConfig

    local = LocalCluster(cpus_per_node=1).start(extra_nodes=1)
    try:
        ensure_coordinator(CoordinatorConfig(membership=MembershipConfig(dead_after_s=10.0)))
        worker = local.worker_nodes[0].node_id
        two_way = KVLinkConfig(host=RAY_NODE_HOST, chunk_bytes=2 * BLOCK_BYTES, connections_per_pull=2)
        actors = {
            "a": start_node_actor(local.head_ray_node_id, node_actor_config("a", ENGINE, heartbeat_s=0.5, link_token=LINK_TOKEN)),
            "b": start_node_actor(worker, node_actor_config("b", ENGINE, heartbeat_s=0.5, link_token=LINK_TOKEN,
                                                            link=two_way)),
        }
        yield actors
    finally:
        local.shutdown()


def coordinator():
    return ray.get_actor("orchard-coordinator", namespace="orchard")


def prompt(seed: int, length: int = 70) -> list[int]:
    return [(seed * 37 + j * 11) % 2000 + 10 for j in range(length)]


def hashes_of(tokens: list[int]) -> list[bytes]:
    spec = ray.get(coordinator().model_specs.remote())[MODEL]
    return block_hashes(tokens, BLOCK, root_hash(spec["fingerprint"], spec["cache_salt"]))


def generate_on(actor, request_id: str, tokens: list[int]) -> tuple[list[int], int]:
    """Greedy tokens and prefix-cache hit tokens of one request run on `actor` itself."""
    from orchard.node.serving.stream_delta import Cumulative

    rebuild, last = Cumulative(tokens), None
    for ref in actor.generate.options(num_returns="streaming").remote(request_id, tokens, GREEDY):
        last = rebuild(ray.get(ref))  # the node streams deltas only
    return last.outputs[0].token_ids, last.num_cached_tokens


def node_row(node_id: str) -> dict:
    return {r["node_id"]: r for r in ray.get(coordinator().nodes.remote())}[node_id]


def wait_for(predicate, timeout: float = 20.0) -> bool:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def geometry_of(actor) -> KVGeometry:
    """The KV layout the node's model has, as this process computes it from the same model."""
    geometry = load_model(ray.get(actor.info.remote())["model_path"]).geometry(BLOCK, None)
    assert geometry.bytes_per_block == ray.get(actor.info.remote())["bytes_per_block"]
    return geometry


def test_joining_nodes_probe_the_link_both_ways(cluster):
    def measured():
        return all(ray.get(coordinator().link_rate.remote(s, t)) for s, t in (("a", "b"), ("b", "a")))

    assert wait_for(measured)


def test_routed_request_pulls_the_prefix_and_matches_recomputing(cluster):
    backend = RayBackend()
    tokens = prompt(1)  # four full blocks and six more tokens
    reference, _ = generate_on(cluster["a"], "cache-on-a", tokens)
    hashes = hashes_of(tokens)
    assert wait_for(lambda: ray.get(coordinator().match.remote(hashes)) == {"a": 4})
    assert wait_for(lambda: ray.get(coordinator().link_rate.remote("a", "b")))
    before = node_row("b")["kv_migrated_blocks"]
    accepted = ray.get(cluster["a"].stats.remote())["kv_link_accepted"]
    ray.get(coordinator().drain.remote("a"))  # b is the only candidate; a still holds the prefix
    try:
        async def run():
            last = None
            async for out in backend.generate("routed", MODEL, tokens, GREEDY):
                last = out
            return last

        out = asyncio.run(run())
    finally:
        ray.get(coordinator().undrain.remote("a"))
    decision = ray.get(coordinator().recent_decisions.remote(1))[0]
    assert (decision["node_id"], decision["reason"], decision["migration"]["num_blocks"]) == ("b", "migrate", 4)
    assert (backend.last_migration.ok, backend.last_migration.imported) == (True, 4)
    assert ray.get(cluster["a"].stats.remote())["kv_link_accepted"] == accepted + 2  # b's pull: two connections
    assert out.outputs[0].token_ids == reference
    assert out.num_cached_tokens == 4 * BLOCK
    assert backend._streams.direct_readers == 0  # a gateway without the cluster's key reads the node's Ray stream
    assert wait_for(lambda: node_row("b")["kv_migrated_blocks"] == before + 4)
    assert wait_for(lambda: ray.get(coordinator().match.remote(hashes)) == {"a": 4, "b": 4})


def test_migrated_blocks_counter_is_exposed_per_node(cluster):
    tokens = prompt(2)
    generate_on(cluster["a"], "cache-2", tokens)
    before = ray.get(cluster["b"].stats.remote())["kv_migrated_blocks"]  # earlier tests pulled into b too
    report = ray.get(cluster["b"].pull_blocks.remote(cluster["a"], "a", hashes_of(tokens)))
    assert (report["ok"], report["imported"], report["via"]) == (True, 4, "direct")
    # a scrape reads every node's counters as it is made (the coordinator's rows may lag): this pull is in it at once
    text = GatewayMetrics().render(asyncio.run(RayBackend().cluster_info())).decode()
    value = re.search(r'orchard_kv_migrated_blocks_total\{node="b"\} (\S+)', text)
    assert value and float(value.group(1)) == before + 4


def test_corrupted_and_foreign_payloads_are_refused_and_the_request_recomputes(cluster):
    tokens = prompt(3)
    reference, _ = generate_on(cluster["a"], "cache-3", tokens)
    payload = ray.get(cluster["a"].export_blocks.remote(hashes_of(tokens)))
    corrupted = bytearray(payload)
    corrupted[len(corrupted) // 2] ^= 0x55
    geometry = geometry_of(cluster["a"])
    foreign = encode_blocks(replace(geometry, model_fingerprint="another-model"), decode_blocks(payload, geometry))
    failures = node_row("b")["kv_migration_failures"]
    reports = [ray.get(cluster["b"].import_blocks.remote([ray.put(bytes(p))], "a")) for p in (corrupted, foreign)]
    assert [(r["ok"], r["imported"]) for r in reports] == [(False, 0), (False, 0)]
    assert "CorruptKVPayload" in reports[0]["error"] and "IncompatibleKVPayload" in reports[1]["error"]
    assert wait_for(lambda: node_row("b")["kv_migration_failures"] == failures + 2)
    assert generate_on(cluster["b"], "after-refusal", tokens) == (reference, 0)


def test_export_racing_evictions_is_whole_or_stops_cleanly(cluster):
    tokens = prompt(4)
    reference, _ = generate_on(cluster["a"], "cache-4", tokens)
    hashes = hashes_of(tokens)
    before = cluster["a"].export_blocks.remote(hashes)
    flood = [cluster["a"].generate.options(num_returns="streaming").remote(f"flood-{i}", prompt(50 + i, 90), GREEDY)
             for i in range(8)]  # 48 blocks through a 39-block pool: every older cached block is evicted
    racing = cluster["a"].export_blocks.remote(hashes)
    for stream in flood:
        for ref in stream:
            ray.get(ref)
    after = cluster["a"].export_blocks.remote(hashes)
    geometry = geometry_of(cluster["a"])
    runs = [[b.block_hash for b in decode_blocks(ray.get(ref), geometry)] for ref in (before, racing, after)]
    assert all(run == hashes[: len(run)] for run in runs)  # whole blocks of a prefix run, never a gap
    assert (len(runs[0]), len(runs[2])) == (4, 0)
    report = ray.get(cluster["b"].import_blocks.remote([racing], "a"))
    assert report["ok"] and report["imported"] == len(runs[1])
    tokens_b, hit = generate_on(cluster["b"], "after-race", tokens)
    assert tokens_b == reference
    assert hit == report["imported"] * BLOCK


def test_draining_a_node_moves_its_used_prefix_to_the_other(cluster):
    tokens = prompt(5)
    generate_on(cluster["a"], "cache-5", tokens)
    hashes = hashes_of(tokens)
    assert wait_for(lambda: ray.get(coordinator().match.remote(hashes)) == {"a": 4})
    for i in range(2):  # the coordinator learns the prefix is in use
        decision = ray.get(coordinator().route.remote(MODEL, hashes, len(tokens), BLOCK, f"use-{i}"))
        ray.get(coordinator().prefill_done.remote(decision.node_id, f"use-{i}"))
    ray.get(coordinator().drain.remote("a"))
    try:
        assert wait_for(lambda: ray.get(coordinator().match.remote(hashes)) == {"a": 4, "b": 4})
    finally:
        ray.get(coordinator().undrain.remote("a"))


def test_a_node_streams_only_what_is_new_so_bytes_per_token_stay_bounded(cluster):
    import pickle

    from orchard.node.serving.stream_delta import Cumulative

    tokens = prompt(77, 300)
    params = SamplingParams(max_tokens=120, temperature=0.0, ignore_eos=True)
    rebuild, sizes, last = Cumulative(tokens), [], None
    for ref in cluster["a"].generate.options(num_returns="streaming").remote("bytes-per-token", tokens, params):
        out = ray.get(ref)
        sizes.append(len(pickle.dumps(out)))
        assert out.prompt_token_ids == [] and out.outputs[0].token_ids == [] and out.outputs[0].text == ""
        last = rebuild(out)
    assert len(last.outputs[0].token_ids) == 120 and last.prompt_token_ids == tokens
    assert last.outputs[0].token_ids[:6] == generate_on(cluster["b"], "bytes-per-token-b", tokens)[0]  # greedy: same start
    # Neither the 300-token prompt nor the answer so far rides along: the last outputs cost what the first did.
    assert sum(sizes) / 120 < 400, sizes
    assert max(sizes[-10:]) < min(sizes[:10]) + 100, sizes


def test_nodes_listen_where_ray_reaches_them_and_the_coordinator_knows_where(cluster):
    """A node's link binds its Ray node's address (loopback only when Ray is on loopback), so peers
    on other machines can reach it; the key guards it (test below)."""
    ray_address = {n["NodeID"]: n["NodeManagerAddress"] for n in ray.nodes() if n["Alive"]}
    for node_id, actor in cluster.items():
        address, info = ray.get(coordinator().kv_link.remote(node_id)), ray.get(actor.info.remote())
        assert address == info["kv_link"] and address.rpartition(":")[0] == ray_address[info["ray_node_id"]]


def test_a_node_refuses_and_counts_a_connection_without_the_cluster_key(cluster):
    from orchard.node.serving.kv_link import KVLinkConfig, connect
    from orchard.node.serving.link_auth import LinkRefused, link_key

    before = ray.get(cluster["a"].stats.remote())["kv_link_refused"]
    with pytest.raises(LinkRefused):
        connect(ray.get(coordinator().kv_link.remote("a")), link_key("not-" + LINK_TOKEN), "a", KVLinkConfig())
    assert wait_for(lambda: ray.get(cluster["a"].stats.remote())["kv_link_refused"] == before + 1)


def test_a_source_whose_listener_is_unreachable_is_pulled_through_ray(cluster):
    import socket

    tokens = prompt(6)
    reference, _ = generate_on(cluster["a"], "cache-6", tokens)
    with socket.socket() as probe:  # a port where nothing listens
        probe.bind(("127.0.0.1", 0))
        closed = f"127.0.0.1:{probe.getsockname()[1]}"
    # "a" under another name, whose listener the coordinator places at the closed port
    ray.get(coordinator().register_node.remote("a-unreachable", {"model": "another-model", "kv_link": closed}))
    try:
        failures = node_row("b")["kv_migration_failures"]
        report = ray.get(cluster["b"].pull_blocks.remote(cluster["a"], "a-unreachable", hashes_of(tokens)))
    finally:
        ray.get(coordinator().node_failed.remote("a-unreachable"))
    assert (report["ok"], report["imported"], report["via"]) == (True, 4, "ray")
    assert node_row("b")["kv_migration_failures"] == failures
    assert generate_on(cluster["b"], "after-fallback", tokens) == (reference, 4 * BLOCK)

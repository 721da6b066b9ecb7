"""The coordinator's route over a gateway's direct link, without Ray: a `Coordinator` behind its
listener on an event loop, a gateway's `RouteLink` calling it. Pins that a call over the link is
the coordinator's own `route` (its decision, its bookkeeping), that calls in flight together get
their own answers, that the coordinator's errors come back as themselves, that a peer without
the key is refused and counted, and that a link that ends fails its waiting calls. A gateway's
`RouteLinks`: calls that arrive together share one connection, and a route the coordinator has no
node for yet, ridden out as the gateway rides it out (`ray_backend.ride_out`), is asked again over the
link, not through Ray."""

from __future__ import annotations

import asyncio
import gc

import pytest

from orchard.cluster.coordinator.coordinator import Coordinator
from orchard.cluster.coordinator.route_link import RouteLink, RouteLinks, RouteLinkServer, route_link_key
from orchard.cluster.coordinator.router import NoNodeAvailable, RouteDecision
from orchard.cluster.gateway.ray_backend import ride_out
from orchard.kvcache.hashing import block_hashes, root_hash
from orchard.node.serving.link_auth import LinkRefused
from orchard.node.serving.link_io import write_frame

KEY = route_link_key("a-cluster-token-of-at-least-32-characters")
BS = 16


def hashes(seed: int) -> list[bytes]:
    return block_hashes([seed * 7 + i for i in range(3 * BS)], BS, root_hash("fp", ""))


def run(scenario, nodes=("a", "b")):
    """Run `scenario(coordinator, server)` with `nodes` registered and the listener on loopback."""
    async def main():
        coordinator = Coordinator()
        for node_id in nodes:
            coordinator.register_node(node_id, {"model": "demo", "block_size": BS})
        server = RouteLinkServer(KEY, coordinator, asyncio.get_running_loop(), "127.0.0.1")
        server.start()
        try:
            return await asyncio.wait_for(scenario(coordinator, server), 20)
        finally:
            server.close()

    return asyncio.run(main())


def test_a_call_over_the_link_is_the_coordinators_own_route():
    async def scenario(coordinator, server):
        link = await RouteLink.open(server.address, KEY)
        decision = await link.route("demo", hashes(1), 3 * BS, BS, "req-1", "round_robin", ("a",), "")
        link.close()
        return decision, coordinator.recent_decisions(1)[0], server.calls

    decision, recorded, calls = run(scenario)
    assert isinstance(decision, RouteDecision) and decision.node_id == "b"  # "a" excluded, as asked
    assert (recorded["node_id"], recorded["request_id"]) == ("b", "req-1") and calls == 1


def test_calls_in_flight_together_each_get_their_own_answer():
    async def scenario(coordinator, server):
        link = await RouteLink.open(server.address, KEY)
        calls = [link.route("demo", hashes(i), 3 * BS, BS, f"req-{i}", "round_robin", (), "") for i in range(8)]
        decisions = await asyncio.gather(*calls)
        link.close()
        return decisions, coordinator.recent_decisions(8)

    decisions, recorded = run(scenario)
    assert sorted(d.node_id for d in decisions) == ["a"] * 4 + ["b"] * 4
    by_request = {r["request_id"]: r["node_id"] for r in recorded}
    assert all(by_request[f"req-{i}"] == d.node_id for i, d in enumerate(decisions))


def test_the_coordinators_error_comes_back_as_itself_and_the_link_stays():
    async def scenario(coordinator, server):
        link = await RouteLink.open(server.address, KEY)
        with pytest.raises(NoNodeAvailable) as refused:
            await link.route("no-such-model", hashes(2), 3 * BS, BS, "req-x", None, (), "")
        decision = await link.route("demo", hashes(3), 3 * BS, BS, "req-y", None, (), "")
        link.close()
        return refused.value, decision

    refused, decision = run(scenario)
    assert refused.model == "no-such-model" and decision.node_id in ("a", "b")


def test_a_gateway_without_the_key_is_refused_and_counted():
    async def scenario(coordinator, server):
        with pytest.raises(LinkRefused):
            await RouteLink.open(server.address, route_link_key("another-cluster-token-of-32-characters"))
        for _ in range(100):  # the listener counts it on its own thread
            if server.refused:
                break
            await asyncio.sleep(0.02)
        return server.refused, coordinator.recent_decisions(1)

    refused, recorded = run(scenario)
    assert refused == 1 and recorded == []


def test_a_link_that_ends_fails_its_waiting_calls_and_says_it_is_closed():
    async def scenario(coordinator, server):
        link = await RouteLink.open(server.address, KEY)
        await link.route("demo", hashes(4), 3 * BS, BS, "req-1", None, (), "")
        server.close()  # no new connections; the open one is cut by the peer below
        link._writer.transport.abort()
        await asyncio.sleep(0.1)
        with pytest.raises(ConnectionError):
            await link.route("demo", hashes(5), 3 * BS, BS, "req-2", None, (), "")
        return link.closed

    assert run(scenario)


def links_to(server) -> RouteLinks:
    """A gateway's RouteLinks to `server`, counting how often it asked where the link is."""
    async def address():
        links.asked += 1
        return server.address

    links = RouteLinks(KEY, address)
    links.asked = 0
    return links


def test_calls_that_arrive_together_share_one_connection():
    async def scenario(coordinator, server):
        links = links_to(server)
        calls = [links.route("demo", hashes(i), 3 * BS, BS, f"req-{i}", "round_robin", (), "") for i in range(12)]
        decisions = await asyncio.gather(*calls)
        connections = server.connections
        links._opened().close()
        return decisions, links, connections

    decisions, links, connections = run(scenario)
    assert all(isinstance(d, RouteDecision) for d in decisions)
    assert (links.calls, links.asked, links.openings, connections, dict(links.through_ray)) == (12, 1, 1, 1, {})


def test_a_route_with_no_node_yet_is_asked_again_over_the_link_until_a_node_registers():
    async def scenario(coordinator, server):
        links = links_to(server)
        asking = asyncio.ensure_future(ride_out(lambda: links.route("demo", hashes(6), 3 * BS, BS, "req-early", None, (), ""), 10))
        for _ in range(400):  # refused twice over the link meanwhile: no node serves "demo" yet
            if server.calls >= 2:
                break
            await asyncio.sleep(0.02)
        coordinator.register_node("late", {"model": "demo", "block_size": BS})
        decision = await asyncio.wait_for(asking, 5)
        with pytest.raises(NoNodeAvailable):  # and what no node ever serves fails once the wait is over
            await ride_out(lambda: links.route("nobody-serves-this", hashes(7), 3 * BS, BS, "req-never", None, (), ""), 0.3)
        links._opened().close()
        return decision, links, server.calls

    decision, links, served = run(scenario, nodes=())
    assert decision.node_id == "late" and links.calls == 1 and dict(links.through_ray) == {}
    assert served >= 4  # two refusals or more, the decision and the last call's refusals: all over the link


def test_prefill_done_rides_the_open_link_and_closes_the_routes_pending_prefill():
    async def scenario(coordinator, server):
        links = links_to(server)
        assert not links.prefill_done("a", "req-none")  # no link open yet: the caller uses Ray
        decision = await links.route("demo", hashes(8), 3 * BS, BS, "req-8", None, (), "")
        pending = coordinator.membership.get(decision.node_id).pending_prefill_tokens
        sent = links.prefill_done(decision.node_id, "req-8")
        for _ in range(100):
            if server.notices:
                break
            await asyncio.sleep(0.01)
        after = coordinator.membership.get(decision.node_id).pending_prefill_tokens
        links._opened().close()
        return pending, sent, after, server, links

    pending, sent, after, server, links = run(scenario)
    assert pending == 3 * BS and sent and after == 0
    assert (server.notices, server.calls, links.notices) == (1, 1, 1)  # a notice is not a call: nothing answers it


def test_a_malformed_notice_ends_the_connection():
    async def scenario(coordinator, server):
        link = await RouteLink.open(server.address, KEY)
        write_frame(link._writer, ("prefill_done", ("only-a-node",)))
        await asyncio.sleep(0.2)
        return link.closed, server.notices

    assert run(scenario) == (True, 0)


def test_a_notice_while_the_link_is_down_goes_through_ray_and_the_next_route_opens_it_again():
    async def scenario(coordinator, server):
        links = links_to(server)
        first = await links.route("demo", hashes(9), 3 * BS, BS, "req-9", None, (), "")
        links._opened()._writer.transport.abort()  # the connection ends between a route and its notice
        await asyncio.sleep(0.1)
        told = links.prefill_done(first.node_id, "req-9")
        second = await links.route("demo", hashes(10), 3 * BS, BS, "req-10", None, (), "")
        told_again = links.prefill_done(second.node_id, "req-10")
        links._opened().close()
        return told, told_again, links

    told, told_again, links = run(scenario)
    assert not told and told_again  # False: the caller tells the coordinator through Ray
    assert (links.calls, links.openings, links.asked, dict(links.through_ray)) == (2, 2, 2, {})


def test_a_garbage_collection_on_the_coordinators_loop_leaves_the_link_open():
    """The listener's task for a connection is reachable from nothing but itself while it waits for a
    frame (asyncio holds tasks weakly); the listener holds it, or a collection ends the link between
    two routes."""
    async def scenario(coordinator, server):
        link = await RouteLink.open(server.address, KEY)
        first = await link.route("demo", hashes(11), 3 * BS, BS, "req-11", None, (), "")
        gc.collect()
        await asyncio.sleep(0.1)
        link.prefill_done(first.node_id, "req-11")
        await link.route("demo", hashes(12), 3 * BS, BS, "req-12", None, (), "")
        closed = link.closed
        link.close()
        return closed, server.connections, server.calls, server.notices

    assert run(scenario) == (False, 1, 2, 1)

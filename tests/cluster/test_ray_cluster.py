"""Across real, separate Ray nodes on this machine: routing follows the prefix, and
requests survive the loss of a node's actor and of a whole raylet mid-stream."""

from __future__ import annotations

import asyncio
import os
import signal
import time
from types import SimpleNamespace

import pytest

ray = pytest.importorskip("ray")

from orchard.cluster.coordinator.coordinator import CoordinatorConfig  # noqa: E402
from orchard.cluster.coordinator.membership import MembershipConfig  # noqa: E402
from orchard.cluster.gateway.ray_backend import RayBackend, RayBackendConfig  # noqa: E402
from orchard.cluster.runtime.ray_cluster import (  # noqa: E402
    LocalCluster,
    ensure_coordinator,
    node_actor_config,
    node_actor_name,
    start_node_actor,
)
from orchard.node.engine import EngineConfig  # noqa: E402
from orchard.node.types import SamplingParams  # noqa: E402

pytestmark = pytest.mark.slow

MODEL = "orchard-demo"
BLOCK = 16
ENGINE = EngineConfig(block_size=BLOCK, num_blocks=96, max_num_seqs=16, max_num_batched_tokens=256)
GREEDY = SamplingParams(max_tokens=12, temperature=0.0, ignore_eos=True)
# Long enough that a node killed once one of its streams has 3 tokens still has streams to cut: at 12 tokens a
# loaded machine once saw every stream on the victim finish before the kill landed (none resumed mid-stream).
LONG_GREEDY = SamplingParams(max_tokens=160, temperature=0.0, ignore_eos=True)
# The cluster's secret for nodes, coordinator and gateways, as `orchard serve` and `orchard head` give it:
# requests are routed and served over direct links (tests/cluster/test_migration.py keeps Ray's paths).
LINK_TOKEN = "a-test-cluster-token-for-the-output-link-0"


@pytest.fixture(scope="module")
def cluster():
    """Three raylets (head + two workers), one node actor each, and the coordinator."""
    local = LocalCluster(cpus_per_node=1).start(extra_nodes=2)
    try:
        ensure_coordinator(CoordinatorConfig(membership=MembershipConfig(dead_after_s=6.0), link_token=LINK_TOKEN))
        nodes, handles = {}, []  # non-detached actors live as long as a handle does
        ray_ids = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        for i, ray_node_id in enumerate(sorted(ray_ids, key=lambda r: r != local.head_ray_node_id)):
            node_id = "head" if i == 0 else f"w{i}"
            nodes[node_id] = ray_node_id
            handles.append(start_node_actor(ray_node_id, node_actor_config(node_id, ENGINE, heartbeat_s=0.5, link_token=LINK_TOKEN)))
        yield local, nodes
    finally:
        local.shutdown()


def coordinator():
    return ray.get_actor("orchard-coordinator", namespace="orchard")


def prompt(i: int, length: int = 40) -> list[int]:
    return [(i * 37 + j * 11) % 2000 + 10 for j in range(length)]


async def collect(backend, request_id, tokens, params, on_output=None):
    ids: list[int] = []
    async for out in backend.generate(request_id, MODEL, tokens, params):
        ids.extend(out.outputs[0].token_ids_delta)
        if on_output:
            await on_output(request_id, out)
        if out.finished:
            assert out.outputs[0].token_ids == ids
    return ids


async def run_all(backend, prompts, params, on_output=None):
    tasks = [collect(backend, f"req-{i}", p, params, on_output) for i, p in enumerate(prompts)]
    return await asyncio.gather(*tasks)


def wait_for(predicate, timeout=20.0):
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.2)
    return False


def _niceness(actor) -> int:
    return ray.get(actor.__ray_call__.remote(lambda _self: os.getpriority(os.PRIO_PROCESS, 0)))


def test_the_engines_and_the_coordinator_run_at_default_priority_not_rays_worker_niceness(cluster):
    _, nodes = cluster

    @ray.remote(num_cpus=0)
    class Plain:
        pass

    assert _niceness(Plain.remote()) == 15  # what Ray gives a worker: below the gateway and every other program
    actors = [ray.get_actor(node_actor_name(node_id), namespace="orchard") for node_id in nodes] + [coordinator()]
    assert [_niceness(actor) for actor in actors] == [0] * len(actors)


def test_node_actors_attend_on_the_backend_this_machine_defaults_to(cluster):
    """Node actors are processes of their own: the CPU kernel (orchard/kernels/cpu) must load in them too, not only here."""
    from orchard import kernels

    _, nodes = cluster
    backends = [ray.get(ray.get_actor(node_actor_name(node_id), namespace="orchard").__ray_call__.remote(
        lambda actor: actor.engine.engine.runner.attention_backend)) for node_id in nodes]
    assert backends == [kernels.default_backend()] * len(nodes)


def test_second_request_with_a_prefix_goes_to_the_node_holding_it(cluster):
    backend = RayBackend(RayBackendConfig(link_token=LINK_TOKEN))
    shared = prompt(1000, 64)  # four full blocks
    asyncio.run(collect(backend, "first", shared + [5, 6, 7], GREEDY))
    first = ray.get(coordinator().recent_decisions.remote(1))[0]
    holder = first["node_id"]
    from orchard.kvcache.hashing import block_hashes, root_hash

    spec = ray.get(coordinator().model_specs.remote())[MODEL]
    hashes = block_hashes(shared, BLOCK, root_hash(spec["fingerprint"], spec["cache_salt"]))
    assert wait_for(lambda: ray.get(coordinator().match.remote(hashes)) == {holder: 4})
    # The holder reports itself idle soon after the first request ends (an early heartbeat:
    # tests/node/serving/test_actor_heartbeat.py pins how soon; here only that it comes).
    assert wait_for(lambda: all(n["running"] == 0 for n in ray.get(coordinator().nodes.remote())), timeout=5.0)
    asyncio.run(collect(backend, "second", shared + [8, 9, 10], GREEDY))
    second = ray.get(coordinator().recent_decisions.remote(1))[0]
    assert (second["node_id"], second["cached_blocks"], second["reason"]) == (holder, 4, "prefix-hit"), (
        second, ray.get(coordinator().nodes.remote()))


def test_a_sessions_requests_stay_on_one_node_though_their_prompts_share_nothing(cluster):
    backend = RayBackend(RayBackendConfig(link_token=LINK_TOKEN))

    async def turns():
        for turn in range(4):
            async for _ in backend.generate(f"agent-turn-{turn}", MODEL, prompt(3000 + turn * 50), GREEDY, session="agent-7"):
                pass
    asyncio.run(turns())
    decisions = [d for d in ray.get(coordinator().recent_decisions.remote(20)) if d["request_id"].startswith("agent-turn-")]
    assert len(decisions) == 4 and len({d["node_id"] for d in decisions}) == 1, decisions
    assert [d["reason"] for d in decisions[1:]] == ["session"] * 3
    assert {n["node_id"]: n["max_num_seqs"] for n in ray.get(coordinator().nodes.remote())}[decisions[0]["node_id"]] == 16


class CountingCoordinator:
    """The coordinator handle with a tally of the methods called through it."""

    def __init__(self, handle):
        self.handle, self.calls = handle, []

    def __getattr__(self, method):
        self.calls.append(method)
        return getattr(self.handle, method)


def test_route_is_the_one_coordinator_call_a_request_waits_for(cluster):
    from orchard.cluster.gateway.state import Gateway, GatewayConfig

    backend = RayBackend(RayBackendConfig(link_token=LINK_TOKEN, specs_refresh_s=60.0))
    gateway = Gateway(backend, GatewayConfig())

    async def requests(first: int, count: int):
        for i in range(first, first + count):
            info = await gateway.model(MODEL)  # what every API route does first
            # prompts no node holds (prompt() repeats every 2,000): a prefix held elsewhere may be routed with a pull
            await collect(backend, f"one-call-{i}", prompt(3700 + i, 20), GREEDY)
        return info

    async def warm_and_count():
        assert (await requests(0, 1)).name == MODEL  # warm: specs, tokenizer and the route link, once
        backend._coordinator = CountingCoordinator(backend._coordinator)
        links = backend._route_links
        before = links.calls, links.notices, links.openings
        await requests(1, 5)
        return links.calls - before[0], links.notices - before[1], links.openings - before[2]

    routed_over_link, told_over_link, reopened = asyncio.run(warm_and_count())
    # node_status is asked only while a stream is silent past stall_check_s.
    ray_calls = [m for m in backend._coordinator.calls if m != "node_status"]
    why = (backend._coordinator.calls, backend._route_links.through_ray, told_over_link, reopened)
    assert routed_over_link == 5, why  # each route over the link
    # The link stays open from the warm-up on (a collection on the coordinator's loop once ended it:
    # tests/cluster/test_route_link.py pins that it no longer does), so each prefill_done (not awaited)
    # goes over it too: no Ray call at all.
    assert reopened == 0 and ray_calls == [] and told_over_link == 5, why

    through_ray = RayBackend(RayBackendConfig(link_token=None, specs_refresh_s=60.0))  # no key: no route link
    ray_gateway = Gateway(through_ray, GatewayConfig())

    async def counted_through_ray():
        await ray_gateway.model(MODEL)
        await collect(through_ray, "one-call-ray-0", prompt(3790, 20), GREEDY)
        through_ray._coordinator = CountingCoordinator(through_ray._coordinator)
        for i in range(1, 4):
            await ray_gateway.model(MODEL)
            await collect(through_ray, f"one-call-ray-{i}", prompt(3790 + i, 20), GREEDY)

    asyncio.run(counted_through_ray())
    awaited = [m for m in through_ray._coordinator.calls if m not in ("prefill_done", "node_status")]
    assert awaited == ["route"] * 3, through_ray._coordinator.calls


class SlowModelSpecs(CountingCoordinator):
    """The coordinator handle whose `model_specs` answers only after `delay` seconds."""

    def __init__(self, handle, delay: float):
        super().__init__(handle)
        self.delay = delay

    def __getattr__(self, method):
        real = super().__getattr__(method)
        if method != "model_specs":
            return real
        delay = self.delay

        async def answer():
            await asyncio.sleep(delay)
            return await real.remote()

        return SimpleNamespace(remote=answer)


def test_a_stale_model_list_is_refreshed_behind_requests_not_before_them(cluster):
    from orchard.cluster.gateway.state import Gateway, GatewayConfig

    backend = RayBackend(RayBackendConfig(link_token=LINK_TOKEN, specs_refresh_s=0.0))  # stale at every request
    gateway = Gateway(backend, GatewayConfig())
    asyncio.run(gateway.model(MODEL))  # the first list (and the tokenizer) is waited for
    backend._coordinator = SlowModelSpecs(backend._coordinator, delay=5.0)

    async def requests(count: int) -> list[float]:
        took = []
        for i in range(count):
            start = time.monotonic()
            await gateway.model(MODEL)
            await collect(backend, f"stale-list-{i}", prompt(3500 + i, 20), GREEDY)
            took.append(time.monotonic() - start)
        return took

    took = asyncio.run(requests(3))
    assert "model_specs" in backend._coordinator.calls  # a refresh was started...
    assert max(took) < 5.0, took  # ...and no request waited for it


def pending_prefills() -> int:
    """Routed requests the coordinator still counts as prefilling, over every node."""
    return ray.get(coordinator().__ray_call__.remote(
        lambda c: sum(n.pending_requests for n in c.membership.nodes())))


class ReportsSeen(CountingCoordinator):
    """The coordinator handle, adding to `reported` the request id of every `prefill_done` sent through it."""

    def __init__(self, handle, reported: list[str]):
        super().__init__(handle)
        self.reported = reported

    def __getattr__(self, method):
        real = super().__getattr__(method)
        if method != "prefill_done":
            return real

        def remote(node_id, request_id):
            self.reported.append(request_id)
            return real.remote(node_id, request_id)

        return SimpleNamespace(remote=remote)


def reports_seen(backend: RayBackend) -> list[str]:
    """The request ids of the backend's `prefill_done` reports, in the order sent, by Ray or over the route link."""
    reported: list[str] = []
    backend._coordinator = ReportsSeen(backend._coordinator, reported)
    over_link = backend._route_links.prefill_done

    def told(node_id, request_id):
        sent = over_link(node_id, request_id)
        if sent:
            reported.append(request_id)
        return sent

    backend._route_links.prefill_done = told
    return reported


@pytest.mark.parametrize("link_token", [LINK_TOKEN, None], ids=["over the route link", "through Ray"])
def test_a_request_is_reported_prefilled_after_its_first_output_however_it_ends(cluster, link_token):
    backend = RayBackend(RayBackendConfig(link_token=link_token))
    reported = reports_seen(backend)

    async def requests():
        await collect(backend, "read-to-the-end", prompt(3600, 20), GREEDY)
        await collect(backend, "one-token", prompt(3601, 20), SamplingParams(max_tokens=1, temperature=0.0))
        stream = backend.generate("left-after-one", MODEL, prompt(3602, 20), GREEDY)
        async for _ in stream:
            assert "left-after-one" not in reported  # the first token reaches the client first
            break  # the client went away after its first token
        await stream.aclose()
        assert "left-after-one" in reported

    asyncio.run(requests())
    assert sorted(reported) == ["left-after-one", "one-token", "read-to-the-end"]  # each once, whichever way
    assert (backend._route_links.notices > 0) == (link_token is not None)
    deadline = time.monotonic() + 10.0
    while pending_prefills() and time.monotonic() < deadline:
        time.sleep(0.05)  # the reports are not waited for by the gateway
    assert pending_prefills() == 0


def test_a_scrape_right_after_a_request_counts_it_on_the_node_that_served_it(cluster):
    from orchard.cluster.gateway.metrics import GatewayMetrics

    backend = RayBackend(RayBackendConfig(link_token=LINK_TOKEN))
    before = {n["node"]: n for n in asyncio.run(backend.cluster_info())["nodes"]}
    tokens = prompt(4000, 37)
    asyncio.run(collect(backend, "fresh-metrics", tokens, GREEDY))
    served = ray.get(coordinator().recent_decisions.remote(1))[0]["node_id"]
    after = {n["node"]: n for n in asyncio.run(backend.cluster_info())["nodes"]}  # no wait for a heartbeat
    looked_up = {n: after[n]["prefix_cache_query_tokens"] - before[n]["prefix_cache_query_tokens"] for n in after}
    assert looked_up[served] == len(tokens) and sum(looked_up.values()) == len(tokens), looked_up
    text = GatewayMetrics().render(asyncio.run(backend.cluster_info())).decode()
    assert f'orchard_prefix_cache_query_tokens_total{{node="{served}"}} {float(after[served]["prefix_cache_query_tokens"])}' in text


def test_a_node_sends_its_requests_outputs_coalesced_not_one_object_per_token(cluster):
    backend = RayBackend(RayBackendConfig(link_token=LINK_TOKEN, policy="round_robin"))
    prompts = [prompt(5000 + i, 24) for i in range(12)]
    asyncio.run(run_all(backend, prompts, GREEDY))  # every output checked against its deltas in collect()
    streams = backend._streams
    assert streams.direct_readers == 3  # one direct gateway link per node, not a Ray stream
    assert streams.direct_submissions == 12  # and every request submitted over it, not by a Ray call
    assert backend._route_links.calls == 12, backend._route_links.through_ray  # each routed over the link, not by Ray
    assert streams.outputs >= 12 * GREEDY.max_tokens
    # Four requests per node decode in the same steps: a message carries a step's outputs of all of them.
    assert streams.messages * 2 <= streams.outputs, (streams.messages, streams.outputs)


@pytest.mark.parametrize("link_token", [LINK_TOKEN, None], ids=["over the gateway link", "through Ray"])
def test_a_request_the_node_refuses_raises_the_engines_error_and_loses_no_node(cluster, link_token):
    from orchard.node.errors import PromptTooLong

    backend = RayBackend(RayBackendConfig(link_token=link_token, policy="round_robin"))
    limit = ray.get(ray.get_actor(node_actor_name("head"), namespace="orchard").info.remote())["max_model_len"]
    with pytest.raises(PromptTooLong) as refused:
        asyncio.run(collect(backend, f"too-long-{link_token is None}", prompt(7, limit + 5), GREEDY))
    assert (refused.value.prompt_tokens, refused.value.max_model_len) == (limit + 5, limit)
    assert backend._streams.direct_submissions == 0 and backend.resumed_mid_stream == 0
    assert all(n["status"] == "alive" for n in ray.get(coordinator().nodes.remote()))  # not taken for a lost node


def test_a_client_that_leaves_while_its_request_is_submitted_has_it_aborted_on_the_node(cluster):
    backend = RayBackend(RayBackendConfig(link_token=LINK_TOKEN, policy="round_robin"))
    asyncio.run(collect(backend, "warm-links", prompt(8), GREEDY))  # links open: the next submit is one write
    node_id = ray.get(coordinator().recent_decisions.remote(1))[0]["node_id"]
    actor = ray.get_actor(node_actor_name(node_id), namespace="orchard")
    before = ray.get(actor.stats.remote())["aborted_requests"]
    # The node's engine thread is held for a second: a submission waits that long for the engine to take it.
    actor.__ray_call__.remote(lambda node: node.engine._commands.put(("call", lambda _: time.sleep(1.0), lambda *_: None, False)))
    time.sleep(0.2)

    async def leave_while_submitting():
        backend._streams.open(node_id, actor, "leaves")  # the reader of this event loop, linked before the submit
        await asyncio.sleep(0.3)
        task = asyncio.ensure_future(backend._submit(node_id, "leaves", prompt(9), SamplingParams(max_tokens=64, temperature=0.0)))
        await asyncio.sleep(0.2)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await task
        # Watched while this loop, and so its link to the node, stays open: closing it would abort the request too.
        for _ in range(50):
            if (await actor.stats.remote())["aborted_requests"] == before + 1:
                return True
            await asyncio.sleep(0.1)
        return False

    assert asyncio.run(leave_while_submitting())


def test_round_robin_ignores_the_prefix(cluster):
    backend = RayBackend(RayBackendConfig(link_token=LINK_TOKEN, policy="round_robin"))
    shared = prompt(2000, 64)
    for i in range(3):
        asyncio.run(collect(backend, f"rr-{i}", shared + [i + 1], GREEDY))
    decisions = ray.get(coordinator().recent_decisions.remote(3))
    assert sorted(d["node_id"] for d in decisions) == ["head", "w1", "w2"]


def test_restarted_coordinator_rebuilds_the_index_from_node_snapshots(cluster):
    backend = RayBackend(RayBackendConfig(link_token=LINK_TOKEN))
    shared = prompt(3000, 48)  # three full blocks
    asyncio.run(collect(backend, "before-restart", shared + [1], GREEDY))
    holder = ray.get(coordinator().recent_decisions.remote(1))[0]["node_id"]
    spec = ray.get(coordinator().model_specs.remote())[MODEL]
    from orchard.kvcache.hashing import block_hashes, root_hash

    hashes = block_hashes(shared, BLOCK, root_hash(spec["fingerprint"], spec["cache_salt"]))
    assert wait_for(lambda: ray.get(coordinator().match.remote(hashes)).get(holder) == 3)
    ray.kill(coordinator(), no_restart=False)  # Ray restarts it empty

    def rebuilt():
        try:
            live = [n for n in ray.get(coordinator().nodes.remote()) if n["status"] == "alive"]
            return len(live) == 3 and ray.get(coordinator().match.remote(hashes)).get(holder) == 3
        except ray.exceptions.RayError:  # still restarting
            return False

    assert wait_for(rebuilt)


def _fault_run(kill, victim: str, params=LONG_GREEDY):
    """16 streaming requests; `kill()` fires once a request on `victim` has streamed 3 tokens."""
    backend = RayBackend(RayBackendConfig(link_token=LINK_TOKEN, policy="round_robin", stall_check_s=0.5))
    prompts = [prompt(i) for i in range(16)]
    reference = asyncio.run(run_all(backend, prompts, params))
    fired = asyncio.Event()
    streamed = {}

    async def on_output(request_id, out):
        streamed[request_id] = len(out.outputs[0].token_ids)
        node = backend._active.get(request_id, ("", ""))[0]
        if not fired.is_set() and node == victim and streamed[request_id] >= 3:
            fired.set()
            await asyncio.to_thread(kill)

    faulted = asyncio.run(run_all(backend, prompts, params, on_output))
    assert backend.resumed_mid_stream >= 1
    return reference, faulted, fired.is_set()


def test_requests_survive_a_node_actor_crash(cluster):
    local, nodes = cluster
    victim = ray.get_actor(node_actor_name("w1"), namespace="orchard")
    reference, faulted, fired = _fault_run(lambda: ray.kill(victim, no_restart=True), "w1")
    assert fired
    assert faulted == reference
    assert all(len(ids) == LONG_GREEDY.max_tokens for ids in faulted)
    status = {n["node_id"]: n["status"] for n in ray.get(coordinator().nodes.remote())}
    assert status["w1"] == "dead"


def test_requests_survive_a_raylet_being_killed(cluster):
    local, nodes = cluster
    raylet = next(n for n in local.worker_nodes if n.node_id == nodes["w2"])
    # A killed raylet's workers notice only after a moment, on a loaded machine long enough for every stream to
    # finish (two full suite runs saw no request resumed mid-stream): the node actor's process goes with its
    # raylet, as both do when a machine leaves, and streams are long enough to be cut.
    actor = ray.get_actor(node_actor_name("w2"), namespace="orchard")
    pid = ray.get(actor.__ray_call__.remote(lambda _self: os.getpid()))

    def machine_gone():
        # The actor's process first: killing it is immediate, while taking the raylet down waits for its
        # processes, and a full suite once saw every stream finish in that wait (none resumed mid-stream).
        try:
            os.kill(pid, signal.SIGKILL)
        except ProcessLookupError:
            pass
        local.kill_node(raylet)

    reference, faulted, fired = _fault_run(machine_gone, "w2")
    assert fired
    assert faulted == reference
    status = {n["node_id"]: n["status"] for n in ray.get(coordinator().nodes.remote())}
    assert status["w2"] == "dead"
    assert ray.get(coordinator().indexed_blocks.remote("w2")) == 0


# Greedy with every penalty, and seeded sampling with penalties: both pattern (i // 2) % 2,
# so that whichever node is the victim in a round-robin rotation gets requests of each kind; 96 tokens, so that
# the victim's streams are still running when the kill lands (as `LONG_GREEDY`).
PENALISED_GREEDY = SamplingParams(max_tokens=96, temperature=0.0, ignore_eos=True,
                                  presence_penalty=0.8, frequency_penalty=0.6, repetition_penalty=1.3)
SEEDED = SamplingParams(max_tokens=96, temperature=1.0, top_k=40, seed=1234, ignore_eos=True, frequency_penalty=0.4)


def _fresh_victim(cluster, node_id: str):
    """A new node actor on w1's raylet (its first actor is gone), to be killed by the test."""
    local, nodes = cluster
    start_node_actor(nodes["w1"], node_actor_config(node_id, ENGINE, heartbeat_s=0.5, link_token=LINK_TOKEN))
    assert wait_for(lambda: any(n["node_id"] == node_id and n["status"] == "alive"
                                for n in ray.get(coordinator().nodes.remote())))
    return ray.get_actor(node_actor_name(node_id), namespace="orchard")


def test_penalised_greedy_and_seeded_streams_continue_exactly_after_their_node_dies(cluster):
    try:
        victim = ray.get_actor(node_actor_name("w1"), namespace="orchard")
        ray.kill(victim, no_restart=True)  # if this test runs alone: free w1's raylet
        wait_for(lambda: any(n["node_id"] == "w1" and n["status"] == "dead" for n in ray.get(coordinator().nodes.remote())))
    except ValueError:
        pass
    victim = _fresh_victim(cluster, "w1-penalties")
    backend = RayBackend(RayBackendConfig(link_token=LINK_TOKEN, policy="round_robin", stall_check_s=0.5))
    kinds = [PENALISED_GREEDY if (i // 2) % 2 == 0 else SEEDED for i in range(12)]
    prompts = [prompt(i + 500) for i in range(12)]

    async def run(on_output=None):
        return await asyncio.gather(*[collect(backend, f"pen-{i}", p, k, on_output)
                                      for i, (p, k) in enumerate(zip(prompts, kinds))])

    reference = asyncio.run(run())
    on_victim, fired = set(), asyncio.Event()

    async def on_output(request_id, out):
        if backend._active.get(request_id, ("", ""))[0] == "w1-penalties":
            on_victim.add(request_id)
            if not fired.is_set() and len(out.outputs[0].token_ids) >= 4:
                fired.set()
                await asyncio.to_thread(ray.kill, victim, no_restart=True)

    faulted = asyncio.run(run(on_output))
    assert fired.is_set() and backend.resumed_mid_stream >= 1
    resumed_kinds = {kinds[int(r.split("-")[1])].temperature for r in on_victim}
    assert resumed_kinds == {0.0, 1.0}, on_victim  # both kinds lost their node
    assert faulted == reference


def test_a_stream_with_n_choices_that_loses_its_node_ends_with_an_error_not_repeated_text(cluster):
    from orchard.cluster.gateway.errors import as_api_error
    from orchard.cluster.gateway.ray_backend import ResumeImpossible

    victim = _fresh_victim(cluster, "w1-choices")
    backend = RayBackend(RayBackendConfig(link_token=LINK_TOKEN, policy="round_robin", stall_check_s=0.5))
    params = SamplingParams(max_tokens=48, temperature=0.8, seed=5, n=3, ignore_eos=True)
    fired = asyncio.Event()

    async def one(i: int):
        choices: dict[int, list[int]] = {}
        try:
            async for out in backend.generate(f"choices-{i}", MODEL, prompt(i + 900), params):
                for c in out.outputs:
                    choices.setdefault(c.index, []).extend(c.token_ids_delta)
                    assert c.token_ids == choices[c.index]  # each choice grows, never restarts
                node = backend._active.get(f"choices-{i}", ("", ""))[0]
                if node == "w1-choices" and not fired.is_set() and all(len(v) >= 3 for v in choices.values()):
                    fired.set()
                    await asyncio.to_thread(ray.kill, victim, no_restart=True)
        except ResumeImpossible as exc:
            return choices, exc
        return choices, None

    async def run():
        return await asyncio.gather(*[one(i) for i in range(4)])

    results = asyncio.run(run())
    assert fired.is_set()
    refused = [exc for _, exc in results if exc is not None]
    assert refused, "the request on the killed node should have been refused"
    error = as_api_error(refused[0])
    assert (error.status, error.code) == (503, "node_lost")
    for choices, exc in results:
        assert len(choices) == 3
        if exc is None:
            assert all(len(ids) == params.max_tokens for ids in choices.values())

"""Gateway <-> node transport: a Ray generator per request, the coalesced Ray stream (submitted by a
Ray call), and the node's direct gateway link (`orchard.node.serving.gateway_link`: submissions and the
same coalesced messages).

`python -m orchard.cluster.bench.stream`: one node actor on a local Ray, the same requests every
way, alternating: TTFT one request at a time (1-token answers), then output tok/s of 32
concurrent requests (128-token prompts, 64 tokens each). Prints one table.
"""

from __future__ import annotations

import argparse
import asyncio
import secrets
import statistics
import time

from orchard.cluster.gateway.node_streams import NodeStreams, next_item
from orchard.cluster.runtime.ray_cluster import LocalCluster, ensure_coordinator, node_actor_config, start_node_actor
from orchard.node.engine import EngineConfig
from orchard.node.serving.gateway_link import gateway_link_key
from orchard.node.types import SamplingParams

FIRST = SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True)


def prompt(seed: int, length: int) -> list[int]:
    return [(seed * 31 + j * 7) % 1900 + 20 for j in range(length)]


PATHS = ("generator", "coalesced", "direct")
#: The bench's own cluster secret: the node listens for gateway links with it, the direct path holds it.
LINK_TOKEN = secrets.token_urlsafe(32)


class Paths:
    def __init__(self, actor):
        self.actor, self.streams = actor, NodeStreams()
        self.direct_streams = NodeStreams(gateway_link_key(LINK_TOKEN))

    async def generator(self, request_id: str, tokens: list[int], params: SamplingParams, first_only: bool) -> int:
        count = 0
        async for ref in self.actor.generate.options(num_returns="streaming").remote(request_id, tokens, params):
            count += len((await ref).outputs[0].token_ids_delta)
            if first_only:
                break
        return count

    async def coalesced(self, request_id: str, tokens: list[int], params: SamplingParams, first_only: bool,
                        streams: NodeStreams | None = None) -> int:
        streams = streams or self.streams
        queue, receiver = streams.open("n", self.actor, request_id)
        if not await streams.submit("n", self.actor, request_id, tokens, params):  # over the link when there is one
            await self.actor.submit.remote(receiver, request_id, tokens, params)
        count = 0
        try:
            while True:
                out = await next_item(queue)
                count += len(out.outputs[0].token_ids_delta)
                if out.finished or first_only:
                    return count
        finally:
            streams.close("n", request_id)

    async def direct(self, request_id: str, tokens: list[int], params: SamplingParams, first_only: bool) -> int:
        return await self.coalesced(request_id, tokens, params, first_only, self.direct_streams)


async def measure(paths: Paths, samples: int, clients: int, output_tokens: int) -> dict:
    ttft: dict[str, list[float]] = {name: [] for name in PATHS}
    for i in range(samples):
        order = PATHS[i % len(PATHS):] + PATHS[: i % len(PATHS)]  # each path goes first, second and last in turn
        for k, name in enumerate(order):
            started = time.perf_counter()
            await getattr(paths, name)(f"t{name}{i}", prompt(len(PATHS) * i + k, 64), FIRST, True)
            ttft[name].append(time.perf_counter() - started)
    params = SamplingParams(max_tokens=output_tokens, temperature=0.0, ignore_eos=True)
    rates: dict[str, list[float]] = {name: [] for name in PATHS}
    for round_ in range(2):
        for name in PATHS:
            started = time.perf_counter()
            calls = [getattr(paths, name)(f"r{name}{round_}-{i}", prompt(1000 + i, 128), params, False) for i in range(clients)]
            tokens = sum(await asyncio.gather(*calls))
            rates[name].append(tokens / (time.perf_counter() - started))
    if paths.direct_streams.direct_readers != 1 or not paths.direct_streams.direct_submissions:
        raise RuntimeError("the direct path went through Ray: no gateway link was made")
    return {"ttft": ttft, "rates": rates, "messages": paths.streams.messages, "outputs": paths.streams.outputs}


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=40)
    parser.add_argument("--clients", type=int, default=32)
    parser.add_argument("--output-tokens", type=int, default=64)
    args = parser.parse_args(argv)
    local = LocalCluster(cpus_per_node=2).start(extra_nodes=0)
    try:
        ensure_coordinator()
        actor = start_node_actor(local.head_ray_node_id, node_actor_config("n", EngineConfig(block_size=16, num_blocks=512), link_token=LINK_TOKEN))
        result = asyncio.run(measure(Paths(actor), args.samples, args.clients, args.output_tokens))
    finally:
        local.shutdown()
    ttft, rates = result["ttft"], result["rates"]
    print("| path | TTFT p50, one at a time | output tok/s, 32 concurrent (two rounds) |")
    print("|---|---|---|")
    for name in PATHS:
        rounds = " / ".join(f"{r:.0f}" for r in rates[name])
        print(f"| {name} | {statistics.median(ttft[name][4:]) * 1e3:.1f} ms | {rounds} |")
    print(f"coalesced stream: {result['messages']} messages for {result['outputs']} outputs")


if __name__ == "__main__":
    main()

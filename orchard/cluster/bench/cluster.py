"""`orchard bench cluster`: routing policies on a multi-tenant workload, and the router's own cost.

Two parts, run together by default:

- `router`: the coordinator alone, in process: decision latency with 100,000 indexed blocks
  spread over 8 nodes (1,024-token prompts, p50/p99), and KV events ingested per second.
- `workload`: three raylets on this machine, one engine each. Tenants each own a long
  system prompt and hold multi-turn conversations; requests arrive as a Poisson process
  with tenants interleaved. For each policy, on fresh nodes: TTFT p50/p90, output tokens/s,
  the cluster's prefix-cache hit rate (tokens the serving node already held / prompt tokens)
  and the hit rate an oracle would get (infinite cache, perfect routing: the longest
  block-aligned prefix any earlier request shared).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import random
import statistics
import sys
import time
from collections import Counter
from dataclasses import asdict, dataclass, field

from orchard.cluster.coordinator.coordinator import Coordinator
from orchard.cluster.coordinator.membership import NodeInfo
from orchard.kvcache.events import BlockStored, PackedEvents
from orchard.kvcache.hashing import block_hashes, root_hash

POLICIES = ("prefix", "round_robin", "least_loaded")
#: A policy name with this suffix runs it with each request naming its tenant as its session
#: (what an agent client sends: orchard/cluster/gateway/sessions.py), e.g. "prefix+sessions".
SESSIONS = "+sessions"


# ---------------------------------------------------------------- router micro-benchmark


@dataclass
class RouterFigures:
    indexed_blocks: int
    nodes: int
    prompt_blocks: int
    decisions: int
    p50_us: float
    p99_us: float
    events_per_s: float


def bench_router(num_blocks: int = 100_000, num_nodes: int = 8, prompt_tokens: int = 1024,
                 block_size: int = 16, decisions: int = 5_000, seed: int = 0) -> RouterFigures:
    rng = random.Random(seed)
    coord = Coordinator()
    nodes = [f"n{i}" for i in range(num_nodes)]
    for node in nodes:
        coord.register_node(node, NodeInfo(model="m", block_size=block_size))
        coord.kv_snapshot(node, 0, [])
        coord.heartbeat(node, {"prefill_tokens_per_s": 2000.0 + rng.random(), "decode_tokens_per_s": 200.0})
    root = root_hash("bench")
    blocks_per_chain = prompt_tokens // block_size
    chains = [block_hashes([rng.randrange(30000) for _ in range(prompt_tokens)], block_size, root)
              for _ in range(num_blocks // blocks_per_chain)]
    batches = {node: [] for node in nodes}
    for chain in chains:
        for node in rng.sample(nodes, 1):
            batches[node].append(chain)
    started = time.perf_counter()
    applied = 0
    for node, node_chains in batches.items():
        seq = 0
        for chain in node_chains:
            events = [BlockStored(seq + i, h, None, ()) for i, h in enumerate(chain)]
            seq += len(events)
            coord.kv_events(node, PackedEvents.of(events))
            applied += len(events)
    events_per_s = applied / (time.perf_counter() - started)
    latencies = []
    for _ in range(decisions):
        chain = rng.choice(chains)
        cut = rng.randrange(1, len(chain) + 1)  # a prompt sharing part of a cached prefix
        t0 = time.perf_counter()
        coord.route("m", chain[:cut], prompt_tokens, block_size)
        latencies.append(time.perf_counter() - t0)
    latencies.sort()
    return RouterFigures(
        indexed_blocks=len(coord.index), nodes=num_nodes, prompt_blocks=blocks_per_chain, decisions=decisions,
        p50_us=latencies[len(latencies) // 2] * 1e6, p99_us=latencies[int(len(latencies) * 0.99)] * 1e6,
        events_per_s=events_per_s,
    )


# ---------------------------------------------------------------- multi-tenant workload


@dataclass(frozen=True)
class WorkloadConfig:
    tenants: int = 16
    turns: int = 8
    system_tokens: int = 1024
    turn_tokens: int = 32
    max_tokens: int = 16
    rate: float = 4.0  # requests per second, Poisson
    seed: int = 0
    block_size: int = 16
    num_blocks: int = 1024


@dataclass(frozen=True)
class Request:
    arrival_s: float
    tenant: int
    turn: int
    prompt: list[int]


def build_workload(cfg: WorkloadConfig, vocab: int = 2500) -> list[Request]:
    """Tenants' turns interleaved at random; each turn's prompt extends that tenant's last one."""
    rng = random.Random(cfg.seed)
    systems = [[rng.randrange(10, vocab) for _ in range(cfg.system_tokens)] for _ in range(cfg.tenants)]
    history = [list(s) for s in systems]
    order = [t for t in range(cfg.tenants) for _ in range(cfg.turns)]
    rng.shuffle(order)
    turn_of = [0] * cfg.tenants
    requests, clock = [], 0.0
    for tenant in order:
        history[tenant] = history[tenant] + [rng.randrange(10, vocab) for _ in range(cfg.turn_tokens)]
        clock += rng.expovariate(cfg.rate)
        requests.append(Request(clock, tenant, turn_of[tenant], list(history[tenant])))
        turn_of[tenant] += 1
    return requests


def oracle_hit_rate(requests: list[Request], block_size: int) -> float:
    """Hit rate with an infinite cache and perfect routing: block-aligned prefixes seen before."""
    root = root_hash("oracle")
    seen: set[bytes] = set()
    hit = total = 0
    for request in sorted(requests, key=lambda r: r.arrival_s):
        hashes = block_hashes(request.prompt, block_size, root)
        run = 0
        while run < len(hashes) and hashes[run] in seen:
            run += 1
        # The engine always computes a prompt's last token, so a whole-prompt hit gives one less block.
        if run * block_size >= len(request.prompt):
            run -= 1
        hit += run * block_size
        total += len(request.prompt)
        seen.update(hashes)
    return hit / total


@dataclass
class PolicyFigures:
    policy: str
    requests: int
    ttft_p50_s: float
    ttft_p90_s: float
    output_tokens_per_s: float
    hit_rate: float
    oracle_hit_rate: float
    wall_s: float
    # The cached tokens the router counted on when it chose (its prefix index, at that moment): below the
    # oracle, repeats were sent away from their holder; above `hit_rate`, blocks were gone when they arrived.
    routed_hit_rate: float = 0.0
    reasons: dict[str, int] = field(default_factory=dict)  # decisions by reason ("prefix-hit", "load", ...)


async def _one(backend, model, request: Request, t0: float, params, sessions: bool) -> tuple[float, int, int]:
    await asyncio.sleep(max(0.0, request.arrival_s - (time.perf_counter() - t0)))
    sent = time.perf_counter()
    ttft, tokens, cached = None, 0, 0
    session = f"tenant-{request.tenant}" if sessions else None
    async for out in backend.generate(f"t{request.tenant}-{request.turn}", model, request.prompt, params, session):
        if ttft is None and out.outputs[0].token_ids_delta:
            ttft = time.perf_counter() - sent
        tokens = len(out.outputs[0].token_ids)
        cached = out.num_cached_tokens
    return ttft, tokens, cached


async def _drive(backend, model, requests, params, sessions: bool):
    t0 = time.perf_counter()
    results = await asyncio.gather(*[_one(backend, model, r, t0, params, sessions) for r in requests])
    return results, time.perf_counter() - t0


def bench_policy(name: str, cfg: WorkloadConfig, requests: list[Request], nodes: int = 3,
                 model: str | None = None) -> PolicyFigures:
    """One policy (optionally `+sessions`) on a fresh cluster of `nodes` raylets serving `model` (the demo's by default)."""
    import ray

    from orchard.cluster.coordinator.coordinator import CoordinatorConfig
    from orchard.cluster.coordinator.router import RouterConfig
    from orchard.cluster.gateway.ray_backend import RayBackend, RayBackendConfig
    from orchard.cluster.runtime.ray_cluster import LocalCluster, ensure_coordinator, node_actor_config, start_node_actor
    from orchard.node.engine import EngineConfig
    from orchard.node.types import SamplingParams

    policy, sessions = name.removesuffix(SESSIONS), name.endswith(SESSIONS)
    engine = EngineConfig(model=model, block_size=cfg.block_size, num_blocks=cfg.num_blocks, max_num_batched_tokens=1024)
    with LocalCluster(cpus_per_node=1).start(extra_nodes=nodes - 1):
        coordinator = ensure_coordinator(CoordinatorConfig(router=RouterConfig(policy=policy)))
        live = [n["NodeID"] for n in ray.nodes() if n["Alive"]]
        actors = [  # kept: a non-detached actor lives only while a handle does
            start_node_actor(ray_node_id, node_actor_config(f"node{i}", engine, heartbeat_s=0.5))
            for i, ray_node_id in enumerate(live)
        ]
        backend = RayBackend(RayBackendConfig())
        model = asyncio.run(backend.models())[0].name
        params = SamplingParams(max_tokens=cfg.max_tokens, temperature=0.0, ignore_eos=True)
        results, wall = asyncio.run(_drive(backend, model, requests, params, sessions))
        routing = ray.get(coordinator.cluster_info.remote())["routing"]
        del actors
    reasons = Counter()
    for row in routing["decisions"]:
        reasons[row["reason"]] += row["count"]
    ttfts = sorted(r[0] for r in results)
    prompt_tokens = sum(len(r.prompt) for r in requests)
    return PolicyFigures(
        policy=name, requests=len(requests),
        ttft_p50_s=statistics.median(ttfts), ttft_p90_s=ttfts[int(0.9 * (len(ttfts) - 1))],
        output_tokens_per_s=sum(r[1] for r in results) / wall,
        hit_rate=sum(r[2] for r in results) / prompt_tokens,
        oracle_hit_rate=oracle_hit_rate(requests, cfg.block_size), wall_s=wall,
        routed_hit_rate=routing["routed_hit_rate"], reasons=dict(reasons.most_common()),
    )


# ---------------------------------------------------------------- entry point


def parse_args(argv: list[str]) -> argparse.Namespace:
    p = argparse.ArgumentParser(prog="orchard bench cluster", description=__doc__.splitlines()[0])
    p.add_argument("--part", choices=["all", "router", "workload"], default="all")
    p.add_argument("--policies", default=",".join(POLICIES),
                   help=f"comma-separated; a name ending in {SESSIONS} names each tenant's session")
    p.add_argument("--tenants", type=int, default=WorkloadConfig.tenants)
    p.add_argument("--turns", type=int, default=WorkloadConfig.turns)
    p.add_argument("--system-tokens", type=int, default=WorkloadConfig.system_tokens)
    p.add_argument("--turn-tokens", type=int, default=WorkloadConfig.turn_tokens)
    p.add_argument("--max-tokens", type=int, default=WorkloadConfig.max_tokens)
    p.add_argument("--rate", type=float, default=WorkloadConfig.rate, help="Poisson arrivals per second")
    p.add_argument("--num-blocks", type=int, default=WorkloadConfig.num_blocks, help="KV blocks per node")
    p.add_argument("--router-blocks", type=int, default=100_000)
    p.add_argument("--router-nodes", type=int, default=8)
    p.add_argument("--nodes", type=int, default=3, help="raylets (one engine each) of the workload's cluster")
    p.add_argument("--hybrid", action="store_true",
                   help="serve a random small Qwen3-Next (Gated DeltaNet + attention: cluster.bench.sessions) instead of the demo model")
    p.add_argument("--json", metavar="PATH", help="also write the figures as JSON")
    return p.parse_args(argv)


def _hybrid_checkpoint() -> str:
    """orchard.cluster.bench.sessions' hybrid shape with random weights, written where every raylet can load it."""
    import json
    import tempfile
    from pathlib import Path

    from orchard.cluster.bench.sessions import HYBRID_SHAPE
    from orchard.node.model.demo import default_demo_model_path
    from orchard.node.model.random_weights import write_random_checkpoint

    demo = Path(default_demo_model_path())
    vocab = json.loads((demo / "config.json").read_text())["vocab_size"]
    folder = Path(tempfile.mkdtemp(prefix="orchard-hybrid-")) / "qwen3-next-small"
    return str(write_random_checkpoint(folder, dict(HYBRID_SHAPE, vocab_size=vocab, torch_dtype="float32"), demo))


def main(argv: list[str] | None = None) -> int:
    args = parse_args(sys.argv[1:] if argv is None else argv)
    out: dict = {"openblas": bool(os.environ.get("LD_PRELOAD", "").count("openblas"))}
    if args.part in ("all", "router"):
        figures = bench_router(args.router_blocks, args.router_nodes)
        out["router"] = asdict(figures)
        print(f"router: {figures.indexed_blocks} blocks x {figures.nodes} nodes, {figures.prompt_blocks}-block prompts: "
              f"p50 {figures.p50_us:.1f} us, p99 {figures.p99_us:.1f} us; events {figures.events_per_s:,.0f}/s")
    if args.part in ("all", "workload"):
        cfg = WorkloadConfig(args.tenants, args.turns, args.system_tokens, args.turn_tokens, args.max_tokens,
                             args.rate, num_blocks=args.num_blocks)
        requests = build_workload(cfg)
        out["workload"] = asdict(cfg) | {"nodes": args.nodes, "hybrid": args.hybrid}
        out["policies"] = []
        model = _hybrid_checkpoint() if args.hybrid else None
        for policy in args.policies.split(","):
            figures = bench_policy(policy, cfg, requests, nodes=args.nodes, model=model)
            out["policies"].append(asdict(figures))
            print(f"{policy:>13}: TTFT p50 {figures.ttft_p50_s:.3f} s p90 {figures.ttft_p90_s:.3f} s, "
                  f"{figures.output_tokens_per_s:.1f} out tok/s, hit rate {figures.hit_rate:.1%} "
                  f"(oracle {figures.oracle_hit_rate:.1%}, routed {figures.routed_hit_rate:.1%}), {figures.wall_s:.1f} s; "
                  f"decisions {', '.join(f'{reason} {count}' for reason, count in figures.reasons.items())}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump(out, f, indent=2)
    return 0


if __name__ == "__main__":
    sys.exit(main())

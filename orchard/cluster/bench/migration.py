"""`orchard bench migration`: KV block migration between two Ray nodes, against the alternatives.

One run, two raylets on this machine (loopback; separate network namespaces are not used
here), one node actor on each (node "a" on the head, node "b" on the worker):

1. raw TCP throughput of the loopback link with plain sockets, the ceiling to compare with:
   measured once the raylets are up, before the nodes start, and again after each model's throughput rows (on a
   shared machine one reading swings 2x from minute to minute), percentages of their median; and per pull
   size, right after its pulls, `--repeats` raw request/reply exchanges of the same bytes on a kept connection
   (`orchard.cluster.bench.netns.tcp_replies`): what asking for that many bytes costs on the path with nothing
   of a pull's work, the direct pulls' best and median read against their best and median;
2. migration throughput of a prefix from a to b, per size: `pull_blocks` end to end (export
   on a, transfer, checks and import on b, blocks usable by b's engine) over the direct KV
   path (`orchard.node.serving.kv_link`, the best of `--repeats`) and through Ray's object store, and Ray's
   object-store transfer alone. These prefixes are placed on a by importing KV made up here
   (the right hashes, arbitrary values), so sizes past the model's context and repeats cost
   no prefill: a pull moves bytes, whatever they mean;
3. time to first token on b of a request whose prefix a holds: migrated first vs recomputed,
   per model (the demo model and the large demo model);
4. per case (model x prefix length), the router's choice for b (coordinator `route` with a
   excluded) against which of the two measured TTFTs was lower; both nodes prefill a few
   prompts first, so that the choice weighs measured prefill costs, not the configured prior.
   The bench's pulls go the way the gateway's do (`orchard.cluster.gateway.block_pull.timed_pull`), so
   the coordinator learns what a migration costs around its pull as it would in serving.

    python -m orchard.cluster.bench.migration [--prefix-tokens 2048] [--pull-tokens 2048,8192] [--sizes small,large]
                                              [--busy N]

With `--busy N`, b decodes N sequences while the throughput rows pull into it, as a serving node does.

With `--link 1gbit|10gbit|none` the two nodes run instead in two network namespaces over a
veth link shaped with `tc` (`orchard.cluster.bench.migration_netns`; needs root; no Ray); with
`--link ... --ray`, this bench as above with its two raylets in those two namespaces
(`orchard.cluster.bench.netns_ray`), raw TCP read across the same veths.
"""

from __future__ import annotations

import argparse
import secrets
import time
from contextlib import contextmanager
from dataclasses import dataclass, field

from orchard.cluster.bench.migration_report import Case, print_report, router_estimates, save_report
from orchard.cluster.bench.netns import RawTCP

DEFAULT_LENGTHS = {"small": (32, 256, 2048), "large": (256, 2048)}
HEARTBEAT_S = 0.5  # the node actors' heartbeat period


@dataclass(frozen=True)
class BenchConfig:
    prefix_tokens: int = 2048
    sizes: tuple[str, ...] = ("small", "large")
    tcp_mib: int = 256
    pull_tokens: tuple[int, ...] = (2048, 8192)
    repeats: int = 3
    block_size: int = 16
    lengths: dict = field(default_factory=lambda: dict(DEFAULT_LENGTHS))
    compress: str = "auto"  # the pulling node's `KVLinkConfig.compress`
    connections: int | None = None  # the pulling node's `KVLinkConfig.connections_per_pull`; its cores decide when None
    kv_dtype: str | None = None  # the nodes' KV dtype (`EngineConfig.dtype`); the model's when None
    busy: int = 0  # sequences b decodes while the throughput rows pull into it (a serving node's steps)
    json_path: str | None = None  # where to write the report's numbers too (`migration_report.save_report`)


#: What each of b's decoding sequences (`--busy`) holds at most: its prompt and the tokens it decodes.
BUSY_PROMPT_TOKENS, BUSY_DECODE_TOKENS = 64, 8000


# ---- raw TCP ------------------------------------------------------------------------


def tcp_throughput(nbytes: int, chunk: int = 4 << 20) -> float:
    """Bytes per second through a loopback TCP connection, plain sockets, one stream."""
    from orchard.cluster.bench.netns import tcp_rate

    return tcp_rate("127.0.0.1", nbytes, chunk)


# ---- the two nodes --------------------------------------------------------------------


class NodePair:
    """Node actors "a" and "b" serving one demo model, and the calls the bench makes on them."""

    def __init__(self, local, size: str, config: BenchConfig, num_blocks: int):
        import ray

        from orchard.cluster.runtime.ray_cluster import node_actor_config, start_node_actor
        from orchard.node.engine import EngineConfig
        from orchard.node.model.demo import default_demo_model_path
        from orchard.node.serving.actor import RAY_NODE_HOST
        from orchard.node.serving.kv_link import KVLinkConfig

        self.ray = ray
        self.model = f"demo-{size}"
        self.size = size
        self.block_size = config.block_size
        engine = EngineConfig(model=str(default_demo_model_path(size)), block_size=config.block_size,
                              num_blocks=num_blocks, max_num_seqs=4, max_num_batched_tokens=512, dtype=config.kv_dtype)
        options = dict(heartbeat_s=HEARTBEAT_S, model_name=self.model, link_token=secrets.token_urlsafe(32))
        pulling = dict(options, link=KVLinkConfig(host=RAY_NODE_HOST, compress=config.compress,
                                                  connections_per_pull=config.connections))
        self.a = start_node_actor(local.head_ray_node_id, node_actor_config(f"a-{size}", engine, **options))
        self.b = start_node_actor(local.worker_nodes[0].node_id, node_actor_config(f"b-{size}", engine, **pulling))
        self.a_id, self.b_id = f"a-{size}", f"b-{size}"
        self.coordinator = ray.get_actor("orchard-coordinator", namespace="orchard")
        self._seed = 0
        self.geometry = None  # the KV layout, loaded on first use
        self.kv_dtype = config.kv_dtype
        self._decoding: list[str] = []  # b's requests `keep_decoding` started

    def close(self) -> None:
        for actor in (self.a, self.b):
            self.ray.get(actor.shutdown.remote())
            self.ray.kill(actor)

    def fresh_prompt(self, prefix_tokens: int) -> list[int]:
        """A prompt whose full prefix no node holds yet, plus one partial block to compute."""
        self._seed += 1
        seed = self._seed * 7919 + len(self.model)
        return [(seed + j * 13 + (j * j) % 97) % 1500 + 20 for j in range(prefix_tokens + self.block_size // 2)]

    def hashes(self, tokens: list[int]) -> list[bytes]:
        from orchard.kvcache.hashing import block_hashes, root_hash

        spec = self.ray.get(self.coordinator.model_specs.remote())[self.model]
        return block_hashes(tokens, self.block_size, root_hash(spec["fingerprint"], spec["cache_salt"]))

    def first_token_s(self, actor, request_id: str, tokens: list[int]) -> float:
        from orchard.node.types import SamplingParams

        started = time.perf_counter()
        stream = actor.generate.options(num_returns="streaming").remote(
            request_id, tokens, SamplingParams(max_tokens=1, temperature=0.0, ignore_eos=True))
        first = None
        for ref in stream:
            self.ray.get(ref)
            first = first or time.perf_counter() - started
        return first

    def keep_decoding(self, sequences: int) -> None:
        """Start `sequences` long greedy generations on b, consumed on daemon threads, until `stop_decoding`."""
        import threading

        from orchard.node.types import SamplingParams

        params = SamplingParams(max_tokens=BUSY_DECODE_TOKENS, temperature=0.0, ignore_eos=True)
        self._decoding = [f"busy-{self.size}-{i}" for i in range(sequences)]
        for request_id in self._decoding:
            stream = self.b.generate.options(num_returns="streaming").remote(request_id, self.fresh_prompt(BUSY_PROMPT_TOKENS), params)
            threading.Thread(target=lambda s=stream: [self.ray.get(ref) for ref in s], daemon=True).start()
        while self.ray.get(self.b.stats.remote()).get("running", 0) < sequences:
            time.sleep(0.05)

    def stop_decoding(self) -> None:
        self.ray.get([self.b.abort.remote(request_id) for request_id in self._decoding])
        self._decoding = []

    def warm_rates(self) -> None:
        """Prefill prompts of two lengths on both nodes and wait for their heartbeats, so the
        router's first case weighs measured prefill costs rather than the configured prior: a
        node's first step is left out of its rates, and its marginal cost per token needs steps
        of different sizes (`orchard.node.rates.StepLine`)."""
        for actor in (self.a, self.b):
            for length in (24, 40, 400, 40, 400):
                self.first_token_s(actor, f"warm-{self._seed}", self.fresh_prompt(length))
        time.sleep(3 * HEARTBEAT_S)  # three heartbeats

    def cache_on_a(self, tokens: list[int]) -> list[bytes]:
        self.first_token_s(self.a, f"cache-{self._seed}", tokens)
        return self._indexed_on_a(self.hashes(tokens))

    def _indexed_on_a(self, hashes: list[bytes], poll_s: float = 0.02) -> list[bytes]:
        """`hashes`, once the coordinator's index holds all of them on a: the router pulls only a prefix
        it has indexed, so a pull never overlaps the indexing of its own prefix."""
        deadline = time.monotonic() + 30
        while self.ray.get(self.coordinator.match.remote(hashes)).get(self.a_id, 0) < len(hashes):
            if time.monotonic() > deadline:
                raise RuntimeError("the coordinator never indexed the cached prefix")
            time.sleep(poll_s)
        return hashes

    def pull(self, hashes: list[bytes], via_ray: bool = False) -> dict:
        """b pulls from a as the gateway has it pull (`timed_pull`: the coordinator also learns what
        the step cost beyond the pull); `via_ray` names a by an id the coordinator has no listener
        for, so the pull goes through Ray's object store."""
        import asyncio

        from orchard.cluster.gateway.block_pull import timed_pull

        source_id = f"{self.a_id}-via-ray" if via_ray else self.a_id
        report = asyncio.run(timed_pull(self.coordinator, self.b, self.b_id, self.a, source_id, hashes))
        if not report["ok"] or report["imported"] != len(hashes) or report["via"] != ("ray" if via_ray else "direct"):
            raise RuntimeError(f"pull fell short: {report}")
        return report

    def seed_on_a(self, prefix_tokens: int) -> list[bytes]:
        """A fresh prefix placed in a's pool by importing made-up KV under its true hashes, returned
        once the coordinator has indexed it."""
        import numpy as np

        from orchard.cluster.bench.netns_node import random_kv
        from orchard.kvcache.hashing import root_hash
        from orchard.kvcache.wire import KVBlockData, encode_blocks
        from orchard.node.model.loader import load_model

        if self.geometry is None:
            model_path = self.ray.get(self.a.info.remote())["model_path"]
            self.geometry = load_model(model_path).geometry(self.block_size, self.kv_dtype)
        tokens = self.fresh_prompt(prefix_tokens)[:prefix_tokens]
        hashes = self.hashes(tokens)
        spec = self.ray.get(self.coordinator.model_specs.remote())[self.model]
        parents = [root_hash(spec["fingerprint"], spec["cache_salt"]), *hashes[:-1]]
        rng = np.random.default_rng(self._seed)
        bs = self.block_size
        for start in range(0, len(hashes), 64):
            stop = min(start + 64, len(hashes))
            keys, values = random_kv(self.geometry, stop - start, rng), random_kv(self.geometry, stop - start, rng)
            blocks = [KVBlockData(hashes[i], parents[i], tuple(tokens[i * bs : (i + 1) * bs]), keys[i - start], values[i - start])
                      for i in range(start, stop)]
            report = self.ray.get(self.a.import_blocks.remote([self.ray.put(encode_blocks(self.geometry, blocks))], "bench"))
            if report["imported"] != len(blocks):
                raise RuntimeError(f"seeding a fell short: {report}")
        return self._indexed_on_a(hashes)

    def transfer_only(self, hashes: list[bytes], chunk_blocks: int) -> float:
        """Bytes/s of moving exported payloads from a's object store into b's, nothing else."""
        from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

        refs = [self.a.export_blocks.remote(hashes[i : i + chunk_blocks]) for i in range(0, len(hashes), chunk_blocks)]
        self.ray.wait(refs, num_returns=len(refs), fetch_local=False)
        worker = self.ray.get(self.b.info.remote())["ray_node_id"]
        on_b = _fetch_timed.options(scheduling_strategy=NodeAffinitySchedulingStrategy(worker, soft=False))
        nbytes, seconds = self.ray.get(on_b.remote(refs))
        return nbytes / seconds

    def migrated_ttft(self, tokens: list[int], hashes: list[bytes]) -> float:
        started = time.perf_counter()
        report = self.pull(hashes)
        if not report["ok"] or report["imported"] != len(hashes):
            raise RuntimeError(f"migration fell short: {report}")
        return time.perf_counter() - started + self.first_token_s(self.b, f"migrated-{self._seed}", tokens)

    def router_choice(self, tokens: list[int], hashes: list[bytes]) -> tuple[bool, float | None, float | None]:
        """Whether the router, sending this prompt to b, would pull the prefix from a, with its
        estimates of the migration and of recomputing the prefix on b."""
        request_id = f"route-{self._seed}"
        decision = self.ray.get(self.coordinator.route.remote(
            self.model, hashes, len(tokens), self.block_size, request_id, None, [self.a_id]))
        self.coordinator.prefill_done.remote(decision.node_id, request_id)
        latency = self.ray.get(self.coordinator.link_latency.remote(self.a_id, self.b_id))  # the pull's and the step's
        rate = self.ray.get(self.coordinator.link_rate.remote(self.a_id, self.b_id))
        info = self.ray.get(self.b.info.remote())
        row = next(r for r in self.ray.get(self.coordinator.nodes.remote()) if r["node_id"] == self.b_id)
        estimates = router_estimates(latency, rate, info["bytes_per_block"], row, len(hashes), self.block_size)
        return decision.migration is not None, *estimates


def _fetch_timed_body(refs: list) -> tuple[int, float]:
    import ray

    started = time.perf_counter()
    payloads = ray.get(refs)
    return sum(len(p) for p in payloads), time.perf_counter() - started


_fetch_timed_remote = None


def _fetch_timed_task():
    global _fetch_timed_remote
    if _fetch_timed_remote is None:
        import ray

        _fetch_timed_remote = ray.remote(num_cpus=0)(_fetch_timed_body)
    return _fetch_timed_remote


class _FetchTimed:
    def options(self, **kwargs):
        return _fetch_timed_task().options(**kwargs)


_fetch_timed = _FetchTimed()


# ---- the run --------------------------------------------------------------------------


def run_case(pair: NodePair, tokens_len: int) -> Case:
    migrated_prompt = pair.fresh_prompt(tokens_len)
    hashes = pair.cache_on_a(migrated_prompt)
    migrates, estimate, recompute_estimate = pair.router_choice(migrated_prompt, hashes)
    migrate_s = pair.migrated_ttft(migrated_prompt, hashes)
    recompute_prompt = pair.fresh_prompt(tokens_len)
    recompute_s = pair.first_token_s(pair.b, f"recompute-{pair._seed}", recompute_prompt)
    return Case(pair.model, tokens_len, migrate_s, recompute_s, migrates, estimate, recompute_estimate)


def throughput(pair: NodePair, config: BenchConfig, raw: RawTCP) -> list[dict]:
    """Per pull size: the direct path's best and median of `repeats` pulls, raw TCP's of as many
    request/reply exchanges of the same bytes, one pull through Ray, and Ray's object-store transfer
    alone, each of a fresh prefix."""
    from orchard.node.serving.migration import MigrationConfig

    pair.pull(pair.seed_on_a(4 * config.block_size))  # warm: connections, buffers, workers
    pair.pull(pair.seed_on_a(4 * config.block_size), via_ray=True)
    chunk_blocks = max(1, MigrationConfig().chunk_bytes // pair.geometry.bytes_per_block)
    rows = []
    for tokens in config.pull_tokens:
        direct = sorted((pair.pull(pair.seed_on_a(tokens)) for _ in range(config.repeats)), key=lambda r: r["bytes_per_s"])
        replies = sorted(raw.replies(direct[-1]["wire_bytes"], config.repeats))
        through_ray = pair.pull(pair.seed_on_a(tokens), via_ray=True)
        rows.append({"size": pair.size, "tokens": tokens, "bytes": direct[-1]["bytes"], "wire_bytes": direct[-1]["wire_bytes"],
                     "direct_Bps": direct[-1]["bytes_per_s"], "direct_median_Bps": direct[len(direct) // 2]["bytes_per_s"],
                     "reply_Bps": replies[-1], "reply_median_Bps": replies[len(replies) // 2],
                     "ray_Bps": through_ray["bytes_per_s"],
                     "transfer_Bps": pair.transfer_only(pair.seed_on_a(tokens), chunk_blocks)})
    return rows


def num_blocks_for(config: BenchConfig, size: str) -> int:
    """Room for every prefix the run caches on one node, so nothing is evicted mid-run."""
    tokens = max(2 * config.prefix_tokens + 2 * sum(config.lengths.get(size, ())), 2 * max(config.pull_tokens)) + 256
    busy = config.busy * (BUSY_PROMPT_TOKENS + BUSY_DECODE_TOKENS + config.block_size)  # what b decodes meanwhile
    return (tokens + busy) // config.block_size + 64


def main(argv: list[str] | None = None) -> int:
    config, link, via_ray = parse_args(argv)
    from orchard.node.openblas import openblas_in_use, reexec_with_openblas

    reexec_with_openblas()
    if link is not None and not via_ray:
        return _main_over_link(config, link, openblas_in_use())
    from orchard.cluster.coordinator.coordinator import CoordinatorConfig
    from orchard.cluster.runtime.ray_cluster import ensure_coordinator

    rows, cases = [], []
    with _two_raylets(config, link) as (local, raw, where):
        tcp = [raw.stream()]
        ensure_coordinator(CoordinatorConfig())
        for size in config.sizes:
            pair = NodePair(local, size, config, num_blocks_for(config, size))
            try:
                pair.keep_decoding(config.busy)
                rows += throughput(pair, config, raw)
                pair.stop_decoding()
                tcp.append(raw.stream())
                pair.warm_rates()
                cases += [run_case(pair, n) for n in config.lengths.get(size, (config.prefix_tokens,))]
            finally:
                pair.close()
    notes = f"; b decoding {config.busy} sequences while the throughput rows pull into it" if config.busy else ""
    notes += f"; pulls over {config.connections} connection(s) each" if config.connections else ""
    print_report(tcp, rows, cases, openblas_in_use(), where + notes)
    if config.json_path:
        save_report(config.json_path, link or "loopback", tcp, rows, cases, where + notes)
    return 0


@contextmanager
def _two_raylets(config: BenchConfig, link: str | None):
    """(cluster, raw TCP readings, where): on loopback, or in the namespace rig over `link`."""
    if link is None:
        from orchard.cluster.runtime.ray_cluster import LocalCluster

        with LocalCluster(cpus_per_node=1, object_store_mb=400).start(extra_nodes=1) as local:
            yield local, RawTCP.loopback(config.tcp_mib << 20), "two raylets on loopback (no network namespaces)"
        return
    from orchard.cluster.bench.netns_ray import rig_cluster

    with rig_cluster(link, min(config.tcp_mib, 64)) as (local, raw, qdisc):
        yield local, raw, f"two raylets in two network namespaces, link {link} ({qdisc})"


def _main_over_link(config: BenchConfig, link: str, openblas: bool) -> int:
    """The two nodes in two network namespaces over a shaped link (`orchard.cluster.bench.migration_netns`)."""
    from orchard.cluster.bench import migration_netns as netns

    over = netns.LinkBenchConfig(link=link, sizes=config.sizes, pull_tokens=config.pull_tokens, repeats=config.repeats,
                                 tcp_mib=min(config.tcp_mib, 64))
    netns.print_report(over, *netns.run(over), openblas)
    return 0


def parse_args(argv) -> tuple[BenchConfig, str | None, bool]:
    from orchard.node.serving.kv_link import COMPRESS_MODES

    p = argparse.ArgumentParser(prog="orchard bench migration", description=__doc__.split("\n\n")[0])
    p.add_argument("--prefix-tokens", type=int, default=2048, help="prefix moved for throughput and the TTFT row")
    p.add_argument("--sizes", default="small,large", help="demo model sizes, comma separated")
    p.add_argument("--tcp-mib", type=int, default=256, help="MiB sent through the raw TCP socket")
    p.add_argument("--pull-tokens", default="2048,8192", help="prefix sizes pulled for the throughput table")
    p.add_argument("--repeats", type=int, default=3, help="direct pulls per size (best and median shown)")
    p.add_argument("--link", choices=("1gbit", "10gbit", "none"), default=None,
                   help="run the nodes in two network namespaces over a link shaped with tc (root; no Ray unless --ray)")
    p.add_argument("--ray", action="store_true", help="with --link: two raylets across the namespaces, as without --link")
    p.add_argument("--compress", choices=COMPRESS_MODES, default="auto",
                   help="the pulling node's compressed chunks (KVLinkConfig.compress); over Ray only")
    p.add_argument("--connections", type=int, default=None,
                   help="connections each pull spreads over (KVLinkConfig.connections_per_pull; by default as the "
                        "pulling node's cores decide); over Ray only")
    p.add_argument("--kv-dtype", choices=("float32", "float16", "bfloat16"), default=None,
                   help="the nodes' KV dtype (the demo models' own is float32); over Ray only")
    p.add_argument("--busy", type=int, default=0,
                   help="sequences the pulling node decodes while the throughput rows pull into it; over Ray only")
    p.add_argument("--json", default=None, metavar="PATH",
                   help="also write what the report prints to PATH, for plots (experiments/migration_rates.py); over Ray only")
    args = p.parse_args(argv)
    sizes = tuple(s for s in args.sizes.split(",") if s)
    lengths = {s: tuple(sorted(set(DEFAULT_LENGTHS.get(s, ())) | {args.prefix_tokens})) for s in sizes}
    pull_tokens = tuple(int(n) for n in args.pull_tokens.split(",") if n)
    config = BenchConfig(prefix_tokens=args.prefix_tokens, sizes=sizes, tcp_mib=args.tcp_mib, lengths=lengths,
                         pull_tokens=pull_tokens, repeats=args.repeats, compress=args.compress, connections=args.connections,
                         kv_dtype=args.kv_dtype, busy=args.busy, json_path=args.json)
    return config, args.link, args.ray


if __name__ == "__main__":
    raise SystemExit(main())

"""`orchard bench migration --link 1gbit|10gbit|none`: KV migration between two hosts over a shaped link.

Two network namespaces on a bridge (`orchard.cluster.bench.netns`), each host's egress held to
the link's rate by a token bucket (or unshaped), one node process in each
(`orchard.cluster.bench.netns_node`): node "a" holds prefixes, node "b" pulls them over the
direct KV path, the way a node actor's `pull_blocks` does, across the veths. No Ray: this
bench starts no raylet in the rig (`tests/cluster/test_netns_join.py` does, with `orchard
head` and `orchard join`), so a migration here pays none of the Ray hops it pays in
serving; the driver plays the coordinator with the plain `Coordinator` class, fed as the
nodes would feed it (each pull's bytes and seconds, the wait around each pull, b's
heartbeat load, a's blocks).

Per demo model size:
1. raw TCP from a to b through the same veths and qdiscs, plain sockets, one stream:
   before the nodes start and after each model's pulls; percentages are of their median; and per pull
   size, right after its pulls, `--repeats` request/reply exchanges of the same bytes on a kept
   connection (`orchard.cluster.bench.netns.tcp_replies`);
2. end-to-end direct pulls (export on a, transfer, checks, import on b), best and median
   of `--repeats`, of prefixes seeded on a by import (true hashes, made-up KV: no prefill);
3. per prefix length, the router's choice for b (`Coordinator.route` with a excluded)
   against the two measured times to first token on b, each the median over three fresh
   prompts: pull then prefill the rest, or prefill it all (a few milliseconds apart for
   the shortest prefixes, where one sample would decide "faster" by noise). b prefills a
   few prompts first, so the choice weighs measured rates.
"""

from __future__ import annotations

import statistics
import tempfile
from dataclasses import dataclass
from pathlib import Path

from orchard.cluster.bench.migration_report import Case, router_estimates
from orchard.cluster.bench.netns import LINKS, NetLab, RawTCP, unavailable
from orchard.cluster.bench.netns_node import BLOCK_SIZE, NodeProcess, NodeSpec

#: Prefix lengths of the router cases, 32 to 8,192 tokens (the demo models' context is 16,384).
CASE_TOKENS = {"small": (32, 256, 2048, 8192), "large": (32, 256, 2048, 8192)}
HOSTS = {"a": "2", "b": "3"}


@dataclass(frozen=True)
class LinkBenchConfig:
    link: str = "1gbit"
    sizes: tuple[str, ...] = ("small", "large")
    pull_tokens: tuple[int, ...] = (2048, 8192)
    repeats: int = 3
    tcp_mib: int = 64
    case_tokens: dict | None = None
    ttft_repeats: int = 3

    def cases(self, size: str) -> tuple[int, ...]:
        return (self.case_tokens or CASE_TOKENS).get(size, ())


class Pair:
    """Nodes a and b of one model in the rig, and the coordinator that learns from their pulls."""

    def __init__(self, lab: NetLab, size: str, num_blocks: int, compress: str = "auto"):
        """`compress`: the nodes' pulls' `KVLinkConfig.compress`."""
        self.model, self.size = f"demo-{size}", size
        self.a, self.b = (NodeProcess(NodeSpec(name, lab.ns(name), lab.hosts[name], size, num_blocks, compress))
                          for name in HOSTS)
        self.coordinator = quiet_coordinator()
        for node in (self.a, self.b):
            self.coordinator.register_node(node.spec.name, self._node_info(node))
        self.on_a: list[bytes] = []
        self._seed = 0

    def close(self) -> None:
        self.a.close()
        self.b.close()

    def fresh_prompt(self, prefix_tokens: int) -> list[int]:
        """A prompt no node holds yet: the prefix, then half a block that b always computes."""
        self._seed += 1
        seed = self._seed * 7919 + len(self.model)
        return [(seed + j * 13 + (j * j) % 97) % 1500 + 20 for j in range(prefix_tokens + BLOCK_SIZE // 2)]

    def seed_on_a(self, prefix_tokens: int) -> tuple[list[int], list[bytes]]:
        tokens = self.fresh_prompt(prefix_tokens)
        hashes = self.a.seed(tokens, self._seed)
        self.on_a += hashes
        return tokens, hashes

    def pull(self, hashes: list[bytes]) -> dict:
        return self.report(self.b.pull(self.a, hashes))

    def report(self, pull: dict) -> dict:
        """Tell the coordinator what a pull cost, as the node (its bytes and seconds) and the
        gateway (the wait around it) do."""
        a, b = self.a.spec.name, self.b.spec.name
        self.coordinator.record_transfer(a, b, pull["bytes"], pull["seconds"], "direct")
        self.coordinator.migration_overhead(a, b, pull["bytes"], max(0.0, pull["wall_s"] - pull["seconds"]))
        return pull

    def heartbeat(self) -> None:
        for node in (self.a, self.b):
            self.coordinator.heartbeat(node.spec.name, node.load())

    def warm_rates(self) -> None:
        """Prefill prompts of two lengths on b, a heartbeat after each: b's marginal cost per token
        needs steps of different sizes, and its first step is left out of its rates."""
        for length in (24, 40, 400, 40, 400):
            self.b.first_token_s(self.fresh_prompt(length))
            self.heartbeat()

    def router_choice(self, tokens: list[int], hashes: list[bytes]) -> tuple[bool, float | None, float | None]:
        """Whether the coordinator, sending this prompt to b, would pull its prefix from a, with its
        estimates of the migration and of recomputing the prefix on b."""
        from orchard.cluster.coordinator.prefix_index import MEMORY

        self.heartbeat()
        self.coordinator.kv_snapshot(self.a.spec.name, 0, [(h, MEMORY) for h in self.on_a])
        request_id = f"route-{self._seed}"
        decision = self.coordinator.route(self.model, hashes, len(tokens), BLOCK_SIZE, request_id, None,
                                            [self.a.spec.name])
        self.coordinator.prefill_done(decision.node_id, request_id)
        return decision.migration is not None, *self._estimates(len(hashes))

    def _estimates(self, blocks: int) -> tuple[float | None, float | None]:
        coordinator, a, b = self.coordinator, self.a.spec.name, self.b.spec.name
        row = next(r for r in coordinator.nodes() if r["node_id"] == b)
        return router_estimates(coordinator.link_latency(a, b), coordinator.link_rate(a, b),
                                self.b.info["bytes_per_block"], row, blocks, BLOCK_SIZE)

    def _node_info(self, node: NodeProcess) -> dict:
        info = node.info
        return {"model": self.model, "block_size": info["block_size"], "bytes_per_block": info["bytes_per_block"],
                "fingerprint": info["fingerprint"], "kv_blocks_total": info["kv_blocks_total"],
                "kv_link": info["address"], "max_num_seqs": info["max_num_seqs"]}


def quiet_coordinator():
    """A plain coordinator that never declares these nodes dead: they heartbeat only between the
    driver's calls, so a node silent through a 10 s prefill is busy, not gone."""
    from orchard.cluster.coordinator.coordinator import Coordinator, CoordinatorConfig
    from orchard.cluster.coordinator.membership import MembershipConfig

    return Coordinator(CoordinatorConfig(membership=MembershipConfig(dead_after_s=3600.0)))


def run_case(pair: Pair, prefix_tokens: int, repeats: int) -> Case:
    """The router's choice for the first of `repeats` fresh prompts; each TTFT the median over them."""
    migrated, recomputed, choice = [], [], None
    for _ in range(repeats):
        tokens, hashes = pair.seed_on_a(prefix_tokens)
        choice = choice or pair.router_choice(tokens, hashes)
        migrated.append(pair.report(pair.b.migrated_ttft(pair.a, hashes, tokens))["ttft_s"])
        recomputed.append(pair.b.first_token_s(pair.fresh_prompt(prefix_tokens)))
    migrates, est_transfer, est_recompute = choice
    return Case(pair.model, prefix_tokens, statistics.median(migrated), statistics.median(recomputed), migrates,
                est_transfer, est_recompute)


def throughput(pair: Pair, config: LinkBenchConfig, raw: RawTCP) -> list[dict]:
    """Per pull size, `repeats` direct pulls of fresh prefixes: bytes, best and median bytes/s; and raw TCP's
    of as many request/reply exchanges of the same bytes."""
    pair.pull(pair.seed_on_a(4 * BLOCK_SIZE)[1])  # warm: the connection, buffers, threads
    rows = []
    for tokens in config.pull_tokens:
        pulls = sorted((pair.pull(pair.seed_on_a(tokens)[1]) for _ in range(config.repeats)),
                       key=lambda p: p["bytes"] / p["seconds"])
        rates = [p["bytes"] / p["seconds"] for p in pulls]
        replies = raw.replies(pulls[-1]["bytes"], config.repeats)
        rows.append({"size": pair.size, "tokens": tokens, "bytes": pulls[-1]["bytes"], "best_Bps": rates[-1],
                     "median_Bps": statistics.median(rates), "reply_Bps": max(replies),
                     "reply_median_Bps": statistics.median(replies)})
    return rows


def num_blocks_for(config: LinkBenchConfig, size: str) -> int:
    """Room for every prefix one node holds in a run, so nothing is evicted mid-run."""
    pulled = (config.repeats + 1) * sum(config.pull_tokens) + 2 * config.ttft_repeats * sum(config.cases(size))
    return pulled // BLOCK_SIZE + 256


def run(config: LinkBenchConfig) -> tuple[list[float], list[dict], list[Case], str]:
    """The whole bench on one link: TCP readings, pull rows, router cases and the qdisc in force."""
    reason = unavailable()
    if reason:
        raise SystemExit(f"the namespace rig cannot be built here: {reason}")
    tcp, rows, cases = [], [], []
    with tempfile.TemporaryDirectory(prefix="orchard-links-") as workdir, NetLab(Path(workdir)) as lab:
        lab.build(HOSTS)
        lab.shape(LINKS[config.link])
        qdisc = lab.qdisc("a")
        raw = RawTCP.across(lab, "a", "b", config.tcp_mib << 20)
        tcp.append(raw.stream())
        for size in config.sizes:
            pair = Pair(lab, size, num_blocks_for(config, size))
            try:
                rows += throughput(pair, config, raw)
                tcp.append(raw.stream())
                pair.warm_rates()
                cases += [run_case(pair, n, config.ttft_repeats) for n in config.cases(size)]
            finally:
                pair.close()
    return tcp, rows, cases, qdisc


def print_report(config: LinkBenchConfig, tcp: list[float], rows: list[dict], cases: list[Case], qdisc: str,
                 openblas: bool) -> None:
    from orchard.cluster.bench.migration_report import REPLY_HEADER, REPLY_NOTE, print_cases, reply_cells

    gb, tcp_Bps = 1e9, statistics.median(tcp)
    shaped = LINKS[config.link]
    print(f"KV migration between two network namespaces, link {config.link} ({qdisc}); OpenBLAS preloaded: {openblas}")
    print(f"raw TCP a -> b, plain sockets, one stream: {tcp_Bps / gb:.3f} GB/s ({8 * tcp_Bps / 1e9:.2f} Gbit/s), the "
          "median of " + ", ".join(f"{v / gb:.3f}" for v in tcp) + " (before the nodes, then after each model's pulls)")
    if shaped:
        print(f"shaped rate {shaped / 8 / gb:.3f} GB/s; raw TCP is {100 * tcp_Bps / (shaped / 8):.0f} % of it")
    print()
    print(f"{'model':<12}{'prefix':>7}{'MiB':>7}{'direct pull GB/s':>17}{'% TCP':>7}{'% link':>7}{'median':>8}"
          f"{'% TCP':>7}{'% link':>7}{REPLY_HEADER}")
    for row in rows:
        cells = "".join(f"{v / gb:>{w}.3f}{100 * v / tcp_Bps:>6.0f}%" + (f"{100 * v / (shaped / 8):>6.0f}%" if shaped else f"{'-':>7}")
                        for v, w in ((row["best_Bps"], 17), (row["median_Bps"], 8)))
        print(f"{'demo-' + row['size']:<12}{row['tokens']:>7}{row['bytes'] / 2**20:>7.1f}{cells}"
              + reply_cells(row["best_Bps"], row["median_Bps"], row))
    print()
    print(REPLY_NOTE)
    print()
    print_cases(cases)

"""Q5: can one model's load evict another model's KV blocks?

Two models share one `MemoryBudget`, each with its own quota, its own `KVCache` (pool,
block manager) and its own cold-tier file in the same directory. Model B caches some
prefixes; model A then runs a storm of distinct prompts that overflows its pool and its
cold tier many times over, and tries to open a second pool beyond its quota. The script
reports, for B, before and after: prefix blocks still cached, the prefix hit on its next
request, whether its KV is bit-exact, and a checksum of its cold file. A control run puts
both tenants in one shared pool (one KVCache, LRU over everything), which is what a
design without per-model pools would do.

    python -m experiments.isolation [--storm-sequences 400] [--quota-mib 8]
"""

from __future__ import annotations

import argparse
import shutil
import tempfile
import time
from pathlib import Path

import numpy as np
import xxhash

from experiments.common import markdown_table, print_header, save_results
from orchard.kvcache import CacheConfig, KVCache, MemoryBudget, QuotaExceeded
from orchard.kvcache.geometry import KVGeometry

BLOCK = 16


def geometry(name: str) -> KVGeometry:
    return KVGeometry(f"exp/isolation/{name}", num_layers=4, num_kv_heads=2, head_dim=64, block_size=BLOCK, dtype="float16")


def file_digest(path: Path) -> str:
    return xxhash.xxh3_64_hexdigest(path.read_bytes())


def cache_prefixes(kv: KVCache, prefixes: list[list[int]], seed: int) -> dict[int, tuple[np.ndarray, np.ndarray]]:
    """Write random KV for each prefix as a prefill would, commit, free (blocks stay cached)."""
    rng = np.random.default_rng(seed)
    written = {}
    g = kv.geometry
    for i, tokens in enumerate(prefixes):
        seq = f"prefix-{i}"
        kv.allocate(seq, tokens + [0])
        n = len(tokens) // BLOCK
        table = kv.block_table(seq)[:n]
        shape = (g.num_layers, n, *g.block_shape)
        keys, values = rng.standard_normal((2, *shape)).astype(np.float16)
        kv.pool.write_blocks(table, keys, values)
        kv.commit(seq, tokens + [0], len(tokens))
        kv.free(seq)
        written[i] = (keys, values)
    return written


def probe(kv: KVCache, prefixes: list[list[int]], written) -> dict:
    """Cached blocks, hit tokens and exactness of every prefix on a fresh request."""
    cached = sum(len(kv.manager.lookup_prefix(p)) for p in prefixes)
    hits, exact = 0, True
    for i, tokens in enumerate(prefixes):
        seq = f"probe-{i}-{time.perf_counter_ns()}"
        reused = kv.allocate(seq, tokens + [0])
        hits += reused
        n = reused // BLOCK
        keys, values = kv.pool.read_blocks(kv.block_table(seq)[:n])
        exact &= keys.tobytes() == written[i][0][:, :n].tobytes() and n == len(tokens) // BLOCK
        kv.free(seq)
    return {"cached_blocks": cached, "hit_tokens": hits, "bit_exact": bool(exact)}


def storm(kv: KVCache, sequences: int, length: int, seed: int) -> int:
    """Distinct prompts, each computed and freed: every one evicts older cached blocks."""
    rng = np.random.default_rng(seed)
    for i in range(sequences):
        tokens = rng.integers(40000, 60000, size=length).tolist()
        seq = f"storm-{i}"
        kv.allocate(seq, tokens)
        kv.commit(seq, tokens, len(tokens) - 1)
        kv.free(seq)
    return kv.stats().evictions


def isolated(args, directory: Path) -> dict:
    quota = args.quota_mib << 20
    budget = MemoryBudget(2 * quota)
    budget.set_quota("A", quota)
    budget.set_quota("B", quota)
    config = CacheConfig(block_size=BLOCK, kv_memory_gb=64.0, watermark=0.0, cold_tier_dir=str(directory),
                         cold_tier_gb=args.cold_mib / 1024)
    a = KVCache(geometry("A"), config, budget=budget, model_name="A")
    b = KVCache(geometry("B"), config, budget=budget, model_name="B")
    prefixes = [np.random.default_rng(100 + i).integers(1, 30000, size=args.prefix_tokens).tolist() for i in range(4)]
    written = cache_prefixes(b, prefixes, seed=1)
    b.cold.flush()
    b_file = b.cold.path
    before = {**probe(b, prefixes, written), "cold_file_xxh3": file_digest(b_file), "evictions": b.stats().evictions}
    evictions_a = storm(a, args.storm_sequences, args.storm_tokens, seed=2)
    try:
        KVCache(geometry("A2"), config, budget=budget, model_name="A")
        refused = "no (second pool opened)"
    except QuotaExceeded as err:
        refused = f"QuotaExceeded: {err}"
    b.cold.flush()
    after = {**probe(b, prefixes, written), "cold_file_xxh3": file_digest(b_file), "evictions": b.stats().evictions}
    out = {"pool_blocks": {"A": a.num_blocks, "B": b.num_blocks}, "budget_reserved": {n: budget.reserved(n) for n in "AB"},
           "files": sorted(p.name for p in directory.iterdir()), "a_evictions": evictions_a,
           "a_cold": vars(a.cold.stats()), "second_pool_for_A": refused, "b_before": before, "b_after": after,
           "prefix_tokens_total": sum(len(p) for p in prefixes)}
    a.close()
    b.close()
    return out


def shared(args) -> dict:
    """Control: both tenants in one pool of the same total size, one LRU, no cold tier."""
    g = geometry("shared")
    blocks = 2 * (args.quota_mib << 20) // g.bytes_per_block
    kv = KVCache(g, CacheConfig(block_size=BLOCK, num_blocks=blocks, watermark=0.0))
    prefixes = [np.random.default_rng(100 + i).integers(1, 30000, size=args.prefix_tokens).tolist() for i in range(4)]
    written = cache_prefixes(kv, prefixes, seed=1)
    before = probe(kv, prefixes, written)
    evictions = storm(kv, args.storm_sequences, args.storm_tokens, seed=2)
    after = probe(kv, prefixes, written)
    kv.close()
    return {"pool_blocks": blocks, "evictions": evictions, "b_before": before, "b_after": after}


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.isolation", description=__doc__.splitlines()[0])
    ap.add_argument("--quota-mib", type=int, default=8, help="each model's share of the KV budget")
    ap.add_argument("--cold-mib", type=int, default=16, help="each model's cold-tier file")
    ap.add_argument("--prefix-tokens", type=int, default=256)
    ap.add_argument("--storm-sequences", type=int, default=400)
    ap.add_argument("--storm-tokens", type=int, default=512)
    args = ap.parse_args(argv)
    print_header(__doc__.splitlines()[0])
    directory = Path(tempfile.mkdtemp(prefix="uma-kv-isolation-"))
    try:
        iso = isolated(args, directory)
    finally:
        shutil.rmtree(directory, ignore_errors=True)
    ctl = shared(args)
    total = iso["prefix_tokens_total"]
    print(f"pools: A {iso['pool_blocks']['A']} blocks, B {iso['pool_blocks']['B']} blocks "
          f"(each asked for 64 GiB; the {args.quota_mib} MiB quota capped it); reserved {iso['budget_reserved']}")
    print(f"cold-tier files in the shared directory: {iso['files']}")
    print(f"A's storm: {args.storm_sequences} prompts x {args.storm_tokens} tokens, {iso['a_evictions']} evictions in A's pool, "
          f"{iso['a_cold']['spills']} spills and {iso['a_cold']['drops']} drops in A's cold tier")
    print(f"A opening a second pool past its quota: {iso['second_pool_for_A']}\n")
    rows = []
    for label, res in (("separate pools + quotas (KVCache per model, MemoryBudget)", iso),
                       ("control: one shared pool, one LRU", ctl)):
        for when in ("before", "after"):
            r = res[f"b_{when}"]
            rows.append([label, f"{when} A's storm", f"{r['cached_blocks']}", f"{r['hit_tokens']} / {total}",
                         r["bit_exact"], r.get("cold_file_xxh3", "-"), r.get("evictions", "-")])
    print(markdown_table(["design", "B measured", "B prefix blocks cached", "B hit tokens", "B KV bit-exact",
                          "B cold file xxh3", "B evictions"], rows))
    save_results("isolation", {"isolated": iso, "shared_control": ctl, "args": vars(args)})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

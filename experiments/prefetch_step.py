"""Q7: does MADV_WILLNEED, issued a step ahead, hide the cold tier's latency?

The engine does not call `KVCache.prefetch` yet, so this measures at the kvcache level
what a step would see: one swapped-out sequence (its blocks only in the cold-tier file,
the file's pages dropped from the page cache) comes back per step, and each step also
does a fixed amount of compute standing in for the forward pass. Three policies:

- none: the step restores the sequence's blocks when it admits it (page faults inline);
- just before: `KVCache.prefetch` is called right before the restore (no overlap);
- one step ahead: the scheduler, which knows the next step's admissions, prefetches the
  next sequence before this step's compute, so the reads overlap the compute;
- page cache warm: every page already in memory, the floor that prefetch can reach.

Reported: the step time and the part of it spent restoring (the stall).

    python -m experiments.prefetch_step [--sequences 6] [--tokens 512] [--compute-ms 50] [--shape Llama-3.1-8B]
"""

from __future__ import annotations

import argparse
import time

import mlx.core as mx
import numpy as np

from experiments.cold_rig import ColdRig, random_prefix
from experiments.common import markdown_table, print_header, save_results
from experiments.models import PUBLIC_SHAPES

POLICIES = ("none", "just before", "one step ahead", "page cache warm (no I/O, lower bound)")
WARM = POLICIES[-1]


def calibrated_compute(target_s: float):
    """A function that keeps the CPU busy with MLX matmuls for about `target_s`."""
    a = mx.random.normal((384, 384))
    mx.eval(a)

    def run(n: int) -> None:
        x = a
        for _ in range(n):
            x = (x @ a) * 1e-3
        mx.eval(x)

    start = time.perf_counter()
    run(20)
    per = (time.perf_counter() - start) / 20
    n = max(1, int(target_s / per))
    return lambda: run(n)


def run_policy(rig: ColdRig, policy: str, compute) -> list[tuple[float, float]]:
    """(step seconds, restore seconds) for each returning sequence."""
    rig.evict_all()
    rig.drop_page_cache()
    if policy == WARM:
        for prefix in rig.prefixes:
            for block_hash in rig.kv.block_hashes(prefix.tokens):
                rig.kv.cold.get(block_hash)
    out = []
    if policy == "one step ahead":
        rig.prefetch(0)
    for index in range(len(rig.prefixes)):
        start = time.perf_counter()
        if policy == "one step ahead" and index + 1 < len(rig.prefixes):
            rig.prefetch(index + 1)
        compute()
        restore_start = time.perf_counter()
        if policy == "just before":
            rig.prefetch(index)
        reused = rig.restore(index)
        end = time.perf_counter()
        assert reused == len(rig.prefixes[index].tokens)
        out.append((end - start, end - restore_start))
    return out


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.prefetch_step", description=__doc__.splitlines()[0])
    ap.add_argument("--sequences", type=int, default=6, help="swapped sequences, one returning per step")
    ap.add_argument("--tokens", type=int, default=512, help="tokens of KV each returning sequence holds")
    ap.add_argument("--compute-ms", type=float, default=50.0, help="compute per step standing in for the forward pass")
    ap.add_argument("--shape", default="Llama-3.1-8B", choices=[s.name for s in PUBLIC_SHAPES])
    ap.add_argument("--rounds", type=int, default=3, help="times each policy runs (medians over all steps)")
    args = ap.parse_args(argv)
    print_header(__doc__.splitlines()[0])
    shape = next(s for s in PUBLIC_SHAPES if s.name == args.shape)
    geometry = shape.geometry()
    prefixes = [random_prefix(geometry, args.tokens, seed=i) for i in range(args.sequences)]
    mib = args.tokens * geometry.bytes_per_token / 2**20
    print(f"# {args.sequences} sequences x {args.tokens} tokens of {shape.name}-shaped KV ({mib:.0f} MiB each)")
    rig = ColdRig(geometry, prefixes)
    compute = calibrated_compute(args.compute_ms / 1e3)
    compute_s = float(np.median([_timed(compute) for _ in range(5)]))
    results = {}
    try:
        for _ in range(args.rounds):
            for policy in POLICIES:
                results.setdefault(policy, []).extend(run_policy(rig, policy, compute))
    finally:
        rig.close()
    rows = []
    for policy in POLICIES:
        steps = np.array([s for s, _ in results[policy]])
        stalls = np.array([r for _, r in results[policy]])
        rows.append([policy, f"{np.median(steps) * 1e3:.1f}", f"{np.median(stalls) * 1e3:.1f}",
                     f"{np.percentile(stalls, 90) * 1e3:.1f}", f"{mib / 1024 / np.median(stalls):.2f}"])
    print(f"compute per step alone: {compute_s * 1e3:.1f} ms")
    print(markdown_table(["prefetch policy", "step ms (median)", "restore stall ms (median)", "stall p90 ms",
                          "restore GiB/s"], rows))
    save_results("prefetch_step", {"args": vars(args), "compute_s": compute_s, "rows": rows,
                                   "raw": {p: results[p] for p in POLICIES}})
    return 0


def _timed(fn) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


if __name__ == "__main__":
    raise SystemExit(main())

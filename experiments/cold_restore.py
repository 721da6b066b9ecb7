"""Q2: can evicted KV live in an mmap'd file and come back faster than it can be recomputed?

For prefixes of several lengths, times a prefill of the demo model (recompute) against
`KVCache.allocate` pulling the same number of blocks back from the cold tier into the
pool (restore), with the file's pages warm in the page cache, dropped
(posix_fadvise DONTNEED), and dropped but prefetched with MADV_WILLNEED just before.
Also times the same restore for a Llama-3.1-8B-shaped block (2 MiB) and a plain memory
copy, which gives this machine's memory-vs-disk gap.

    python -m experiments.cold_restore [--tokens 128,256,512,1024] [--model large] [--big-blocks 64]
"""

from __future__ import annotations

import argparse

import numpy as np

from experiments.cold_rig import ColdRig, random_prefix
from experiments.common import (
    gigabytes_per_s,
    markdown_table,
    median_time,
    new_figure,
    print_header,
    save_figure,
    save_results,
    timed,
)
from experiments.models import DEMO_SHAPES, PUBLIC_SHAPES, load_demo, prefill_seconds

MODES = ("warm", "dropped", "dropped+prefetch")


def time_restore(rig: ColdRig, index: int, mode: str, repeats: int) -> tuple[float, int | None]:
    """Best-of-`repeats` seconds to restore prefix `index` in `mode`; also the bytes fincore saw resident after the drop."""
    samples, resident = [], None
    for _ in range(repeats):
        rig.evict_all()
        if mode == "warm":
            rig.restore(index)  # fault every page in, then put the blocks back on disk
            rig.evict_all()
        else:
            resident = rig.drop_page_cache()

        def run():
            if mode == "dropped+prefetch":
                rig.prefetch(index)
            reused = rig.restore(index)
            assert reused == len(rig.prefixes[index].tokens), f"restored {reused} tokens"

        samples.append(timed(run))
    return float(min(samples)), resident


def memory_copy_gb_s(nbytes: int = 256 << 20) -> float:
    src = np.ones(nbytes, dtype=np.uint8)
    dst = np.empty_like(src)
    seconds = median_time(lambda: np.copyto(dst, src), repeats=5)
    return gigabytes_per_s(2 * nbytes, seconds)  # read + write


def restore_rows(model_size: str, token_counts: list[int], repeats: int) -> list[dict]:
    shape = DEMO_SHAPES[model_size]
    geometry = shape.geometry()
    model = load_demo(model_size)
    rows = []
    prefixes = [random_prefix(geometry, n, seed=n) for n in token_counts]
    rig = ColdRig(geometry, prefixes)
    try:
        exact = rig.check_exact(len(prefixes) - 1)
        for index, n in enumerate(token_counts):
            recompute, _ = prefill_seconds(model, n, repeats=repeats)
            row = {"tokens": n, "blocks": n // geometry.block_size, "bytes": n * geometry.bytes_per_token,
                   "recompute_s": recompute, "bit_exact": exact}
            for mode in MODES:
                row[f"{mode}_s"], resident = time_restore(rig, index, mode, repeats)
                if resident is not None and mode == "dropped":
                    row["resident_after_drop"] = resident
            rows.append(row)
            print(f"  {n:5d} tokens: recompute {recompute * 1e3:8.1f} ms, " + ", ".join(
                f"{m} {row[f'{m}_s'] * 1e3:7.2f} ms" for m in MODES), flush=True)
    finally:
        rig.close()
    return rows


def big_block_rows(num_blocks: int, repeats: int) -> dict:
    """Restore bandwidth for Llama-3.1-8B-shaped blocks (32 layers x 8 x 128, bf16 = 2 MiB)."""
    shape = next(s for s in PUBLIC_SHAPES if s.name == "Llama-3.1-8B")
    geometry = shape.geometry()
    prefix = random_prefix(geometry, num_blocks * geometry.block_size, seed=1)
    rig = ColdRig(geometry, [prefix])
    try:
        out = {"model": shape.name, "blocks": num_blocks, "bytes": num_blocks * geometry.bytes_per_block}
        for mode in MODES:
            seconds, _ = time_restore(rig, 0, mode, repeats)
            out[f"{mode}_gb_s"] = gigabytes_per_s(out["bytes"], seconds)
            out[f"{mode}_ms_per_block"] = seconds / num_blocks * 1e3
        out.update(tier_read_gb_s(rig, repeats))
        single = random_prefix(geometry, geometry.block_size, seed=2)
    finally:
        rig.close()
    rig = ColdRig(geometry, [single])
    try:
        out["one_block_dropped_ms"] = time_restore(rig, 0, "dropped", repeats)[0] * 1e3
    finally:
        rig.close()
    return out


def tier_read_gb_s(rig: ColdRig, repeats: int) -> dict:
    """The storage side alone: `ColdTier.get` of every block (read, checksum, copy), no pool write."""
    hashes = rig.kv.block_hashes(rig.prefixes[0].tokens)
    nbytes = len(hashes) * rig.geometry.bytes_per_block
    out = {}
    for mode in ("warm", "dropped"):
        samples = []
        for _ in range(repeats):
            rig.evict_all()
            if mode == "dropped":
                rig.drop_page_cache()
            else:
                [rig.kv.cold.get(h) for h in hashes]
            samples.append(timed(lambda: [rig.kv.cold.get(h) for h in hashes]))
        out[f"tier_{mode}_gb_s"] = gigabytes_per_s(nbytes, float(min(samples)))
    return out


def plot(rows: list[dict], model_size: str) -> str:
    fig, ax = new_figure()
    tokens = [r["tokens"] for r in rows]
    ax.plot(tokens, [r["recompute_s"] * 1e3 for r in rows], "o-", color="black", label="recompute (prefill)")
    styles = {"warm": "s--", "dropped": "v-", "dropped+prefetch": "^:"}
    for mode in MODES:
        ax.plot(tokens, [r[f"{mode}_s"] * 1e3 for r in rows], styles[mode], label=f"restore, page cache {mode}")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.set_xticks(tokens, [str(t) for t in tokens])
    ax.set_xlabel("prefix length (tokens)")
    ax.set_ylabel("time to have the prefix's KV in the pool (ms)")
    ax.set_title(f"Restore from the mmap cold tier vs recompute (demo {model_size}, CPU)")
    ax.grid(True, which="both", alpha=0.3)
    ax.legend(fontsize=8)
    return str(save_figure(fig, "cold_restore_vs_recompute"))


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(prog="python -m experiments.cold_restore", description=__doc__.splitlines()[0])
    ap.add_argument("--tokens", default="128,256,512,1024", help="prefix lengths, multiples of 16")
    ap.add_argument("--model", default="large", choices=sorted(DEMO_SHAPES), help="demo model to recompute with")
    ap.add_argument("--big-blocks", type=int, default=64, help="Llama-8B-shaped 2 MiB blocks for the bandwidth rows")
    ap.add_argument("--repeats", type=int, default=3, help="best of this many runs for every timing")
    args = ap.parse_args(argv)
    print_header(__doc__.splitlines()[0])
    tokens = [int(t) for t in args.tokens.split(",")]
    rows = restore_rows(args.model, tokens, args.repeats)
    big = big_block_rows(args.big_blocks, args.repeats)
    memcpy = memory_copy_gb_s()
    table = [[r["tokens"], r["blocks"], f"{r['bytes'] / 2**20:.1f}", f"{r['recompute_s'] * 1e3:.1f}",
              *(f"{r[f'{m}_s'] * 1e3:.2f}" for m in MODES),
              f"{r['recompute_s'] / r['dropped_s']:.0f}x",
              f"{r['recompute_s'] / r['tokens'] * 16 * 1e3:.2f}", f"{r['dropped_s'] / r['blocks'] * 1e3:.3f}"]
             for r in rows]
    print(markdown_table(["tokens", "blocks", "MiB", "recompute ms", "restore warm ms", "restore dropped ms",
                          "dropped+prefetch ms", "recompute/dropped", "recompute ms/block", "restore dropped ms/block"], table))
    print(f"\nbit-exact restore: {rows[-1]['bit_exact']}; resident after drop: "
          f"{[r.get('resident_after_drop') for r in rows]} bytes (fincore)")
    print("\n" + markdown_table(["2 MiB blocks (Llama-3.1-8B shape)", "blocks", "page cache warm GB/s",
                                 "dropped GB/s", "dropped+prefetch GB/s", "ms/block dropped", "one block alone, dropped ms"],
                                [["restore into pool (KVCache.allocate)", big["blocks"], f"{big['warm_gb_s']:.2f}",
                                  f"{big['dropped_gb_s']:.2f}", f"{big['dropped+prefetch_gb_s']:.2f}",
                                  f"{big['dropped_ms_per_block']:.3f}", f"{big['one_block_dropped_ms']:.2f}"],
                                 ["tier read only (ColdTier.get)", big["blocks"], f"{big['tier_warm_gb_s']:.2f}",
                                  f"{big['tier_dropped_gb_s']:.2f}", "", "", ""]]))
    print(f"memory copy (numpy, read+write): {memcpy:.1f} GB/s")
    print(f"memory copy / tier read, dropped: {memcpy / big['tier_dropped_gb_s']:.1f}x; "
          f"memory copy / full restore, dropped: {memcpy / big['dropped_gb_s']:.1f}x")
    path = plot(rows, args.model)
    save_results("cold_restore", {"rows": rows, "big_blocks": big, "memory_copy_gb_s": memcpy, "plot": path})
    print(f"plot: {path}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

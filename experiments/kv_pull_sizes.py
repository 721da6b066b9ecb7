"""From what size a direct pull reaches half of raw TCP: pulls of several sizes beside raw TCP replies of the
same bytes, in one pair of processes for each size.

A pull pays fixed costs (the request, the source's export, the target's reservation and listing, the hand-overs
between threads) besides moving its bytes, so its share of raw TCP grows with its size. For each `--tokens`
(the small model's 4 MiB a 1,024 tokens), in turns of `--per-round` each: the bench's raw TCP replies (one
buffer each end, hot in the caches: `kv_pull_floor`'s first step, issue 19's "raw TCP on the same path"), raw
replies from and into memory, checksummed, over two connections (what a pull's bytes must do and nothing
else), and direct pulls of a fresh prefix over `--connections` (default: the link's own choice for this machine).

`--size large` pulls the large demo model's KV instead: 16 KiB a token where the small's is 4 KiB, so a pull of
the same bytes carries a quarter of the blocks, and a quarter of the per-block bookkeeping at both ends.

    python -m experiments.kv_pull_sizes [--tokens 1024,2048,4096,8192,16384] [--rounds 2] [--per-round 6]
                                        [--connections N] [--size small|large]
    python -m experiments.kv_pull_sizes --plot [LABEL=]RUN.json ... [--plot-name NAME]

Prints one table: each size's best and median GB/s of each, and the pull's best and median as a share of raw
TCP's. The numbers go to experiments/results/kv_pull_sizes.json; `--plot` draws saved runs' shares against
the size (docs/img/<--plot-name>.png).
"""

from __future__ import annotations

import argparse
import json
from pathlib import Path

from experiments import kv_pull_floor as floor
from experiments.common import best_and_median, markdown_table, new_figure, print_header, save_figure, save_results
from orchard.node.model.demo import DEMO_CONFIGS

PULL = "pull"
TARGET_SHARE = 0.5  # issue 19: a pull at half of raw TCP or more


def measure(size: str, tokens: int, rounds: int, per_round: int, connections: int | None) -> dict[str, list[float]]:
    """Bytes/s of each reply and pull of `tokens` of the `size` demo model's KV, in interleaved turns
    (`kv_pull_floor.interleaved`); `bytes` the pull's size."""
    nbytes, rates = floor.interleaved(size, tokens, (floor.RAW_HOT, floor.CHECKSUMMED_TWO), {PULL: connections}, rounds, per_round)
    return {"bytes": nbytes, **rates}


def shares(run: dict) -> tuple[float, float]:
    """The pull's best as a share of raw TCP's best, and its median of raw TCP's median."""
    (pull_best, pull_median), (raw_best, raw_median) = best_and_median(run[PULL]), best_and_median(run[floor.RAW_HOT])
    return pull_best / raw_best, pull_median / raw_median


def table(runs: dict[int, dict]) -> str:
    rows = []
    for tokens, run in runs.items():
        cells = [f"{tokens}", f"{run['bytes'] / 2**20:.1f}"]
        for step in (floor.RAW_HOT, floor.CHECKSUMMED_TWO, PULL):
            best, median = best_and_median(run[step])
            cells.append(f"{best / 1e9:.2f} / {median / 1e9:.2f}")
        best_share, median_share = shares(run)
        rows.append([*cells, f"{100 * best_share:.0f} %", f"{100 * median_share:.0f} %"])
    return markdown_table(["tokens", "MiB", "raw TCP, GB/s best / median", "raw checksummed, two connections",
                           "pull", "pull best, of raw's", "pull median, of raw's"], rows)


def plot(saved: list[str], name: str) -> Path:
    """Each saved run's pull as a share of raw TCP (best, median) against its MiB, with the target's line. A run is
    "LABEL=RUN.json" or "RUN.json" (labelled by its date); runs of one label share a colour and a legend entry."""
    fig, ax = new_figure(8.6, 3.8)
    machines, colours = set(), {}
    for item in saved:
        label, _, path = item.rpartition("=")
        data = json.loads(Path(path).read_text())
        machines.add(data["machine"].split(", load")[0])
        label = label or f"{data['date']}, {data.get('size', 'small')}"
        first = label not in colours
        colour = colours.setdefault(label, f"C{len(colours)}")
        runs = sorted(data["runs"].values(), key=lambda run: run["bytes"])
        mib = [run["bytes"] / 2**20 for run in runs]
        for which, style, kind in ((0, "o-", "best / raw's best"), (1, "s--", "median / raw's median")):
            ax.plot(mib, [100 * shares(run)[which] for run in runs], style, color=colour, alpha=0.9 - 0.45 * which,
                    label=f"{kind}, {label}" if first else None)
    ax.axhline(100 * TARGET_SHARE, linestyle=":", color="grey", label="issue 19's target")
    ax.set_xscale("log", base=2)
    ax.set_xticks(mib, [f"{m:.0f}" for m in mib])
    ax.set_xlabel("pull size, MiB (a demo model's KV)")
    ax.set_ylabel("% of raw TCP on the same path")
    ax.set_title("direct pull against raw TCP by size\n" + "; ".join(sorted(machines)), fontsize=9)
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    return save_figure(fig, name, bbox_inches="tight")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--tokens", type=lambda text: [int(n) for n in text.split(",")], default=[1024, 2048, 4096, 8192, 16384])
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--per-round", type=int, default=6)
    p.add_argument("--connections", type=int, default=None, help="a pull's connections (default: the link's choice)")
    p.add_argument("--size", choices=sorted(DEMO_CONFIGS), default="small", help="the demo model whose KV the pulls carry")
    p.add_argument("--plot", nargs="+", default=None, help="draw saved runs (LABEL=RUN.json or RUN.json) instead of measuring")
    p.add_argument("--plot-name", default="kv_pull_sizes")
    args = p.parse_args(argv)
    if args.plot is not None:
        print(plot(args.plot, args.plot_name))
        return 0
    print_header(f"direct pulls against raw TCP by size ({args.size}; {args.rounds} rounds of {args.per_round}; "
                 f"connections: {args.connections or 'default'})")
    runs = {}
    for tokens in args.tokens:
        runs[tokens] = measure(args.size, tokens, args.rounds, args.per_round, args.connections)
        print(f"{tokens} tokens done", flush=True)
    print(table(runs))
    save_results("kv_pull_sizes", {"size": args.size, "rounds": args.rounds, "per_round": args.per_round,
                                   "connections": args.connections, "runs": runs})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

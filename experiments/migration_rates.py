"""Direct pulls against what each link carries, as a picture: runs of `orchard bench migration --json`.

Each run is one link. A pull's best and median rate are drawn as a share of that link's reference: raw TCP
over the same path (the run's median reading) on loopback and across the unshaped veth, the shaped rate at
1 and 10 Gbit/s. A dashed line marks the target of issue 19 there (50 % and 80 %). Labelled groups of runs
(the trees being compared) sit side by side:

    python -m experiments.migration_rates before=a.json,b.json,c.json after=d.json,e.json,f.json [--name migration_pull_rates]

The picture goes to docs/img/<name>.png.
"""

from __future__ import annotations

import argparse
import json
import statistics
from pathlib import Path

from experiments.common import new_figure, save_figure
from orchard.cluster.bench.netns import LINKS

PANELS = {"loopback": "loopback", "none": "unshaped veth", "10gbit": "10 Gbit/s", "1gbit": "1 Gbit/s"}
TARGETS = {"loopback": 50, "none": 50, "10gbit": 80, "1gbit": 80}


def reference_Bps(run: dict) -> float:
    """What a pull is measured against on the run's link: the shaped rate, else raw TCP's median reading."""
    bits = LINKS.get(run["link"])
    return bits / 8 if bits else statistics.median(run["tcp_Bps"])


def shares(run: dict) -> list[tuple[str, float, float]]:
    """(row name, best %, median %) of each pull size of a run."""
    ref = reference_Bps(run)
    return [(f"{row['size']} {row['bytes'] / 2**20:.0f} MiB", 100 * row["direct_Bps"] / ref,
             100 * row["direct_median_Bps"] / ref) for row in run["rows"]]


def draw(groups: dict[str, list[dict]], name: str) -> Path:
    links = [link for link in PANELS if any(run["link"] == link for runs in groups.values() for run in runs)]
    fig, axes = new_figure(3.2 * len(links), 3.8, ncols=len(links), squeeze=False)
    axes = list(axes[0])
    width = 0.8 / len(groups)
    for ax, link in zip(axes, links):
        for g, (label, runs) in enumerate(groups.items()):
            run = next((r for r in runs if r["link"] == link), None)
            if run is None:
                continue
            rows = shares(run)
            xs = [i + (g - (len(groups) - 1) / 2) * width for i in range(len(rows))]
            ax.bar(xs, [best for _, best, _ in rows], width, label=f"{label} ({run['tree']}): best")
            ax.bar(xs, [median for _, _, median in rows], width * 0.5, color="black", alpha=0.35,
                   label="median (dark)" if g == 0 else None)
            ax.set_xticks(range(len(rows)), [name for name, _, _ in rows], rotation=30, ha="right", fontsize=7)
        ax.axhline(TARGETS[link], color="gray", linestyle="--", linewidth=1)
        unit = "shaped rate" if LINKS.get(link) else "raw TCP"
        ax.set_title(f"{PANELS[link]} (% of {unit})", fontsize=9)
        ax.set_ylim(0, 130)
    axes[0].set_ylabel("direct pull, % of the link's reference")
    axes[0].legend(fontsize=7, loc="upper left")
    return save_figure(fig, name)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("groups", nargs="+", help="label=run.json[,run.json...]")
    p.add_argument("--name", default="migration_pull_rates")
    args = p.parse_args(argv)
    groups = {}
    for spec in args.groups:
        label, _, paths = spec.partition("=")
        groups[label] = [json.loads(Path(path).read_text()) for path in paths.split(",") if path]
    print(draw(groups, args.name))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

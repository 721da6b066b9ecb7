"""Direct pulls against what each link carries, as a picture: runs of `orchard bench migration --json`.

One panel a link, in GB/s: each pull size's best (bar) and median (dark inner bar) of a run, beside what
the link carries and issue 19's target there (dashed): on loopback and across the unshaped veth, raw TCP
over the same path (the run's median reading, its other readings as a tick each) and half of it; at 1 and
10 Gbit/s, the shaped rate and 80 % of it. Where a group holds several runs of a link, the bars are the
medians of their bests and of their medians, each run's best is a dot, and the line is the median of what
the runs' links carried. Raw TCP on loopback reads about 2 or 3.5-7 GB/s from one
reading to the next on a two-core VM, so there the rates are drawn, not their share of one reading.
Labelled groups of runs (the trees compared) sit side by side:

    python -m experiments.migration_rates before=a.json,b.json after=c.json,d.json [--name migration_pull_rates]

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
TARGET_SHARE = {"loopback": 0.5, "none": 0.5, "10gbit": 0.8, "1gbit": 0.8}
GB = 1e9


def link_GBps(run: dict) -> tuple[float, list[float]]:
    """(what the run's link carries, the readings behind it): the shaped rate, else raw TCP's median reading."""
    bits = LINKS.get(run["link"])
    if bits:
        return bits / 8 / GB, []
    readings = [v / GB for v in run["tcp_Bps"]]
    return statistics.median(readings), readings


def draw(groups: dict[str, list[dict]], name: str) -> Path:
    links = [link for link in PANELS if any(run["link"] == link for runs in groups.values() for run in runs)]
    fig, axes = new_figure(3.3 * len(links), 4.0, ncols=len(links), squeeze=False)
    width = 0.8 / len(groups)
    for ax, link in zip(axes[0], links):
        for g, (label, runs) in enumerate(groups.items()):
            here = [r for r in runs if r["link"] == link]
            if not here:
                continue
            offset = (g - (len(groups) - 1) / 2) * width
            rows = here[0]["rows"]
            xs = [i + offset for i in range(len(rows))]
            bests = [[run["rows"][i]["direct_Bps"] / GB for run in here] for i in range(len(rows))]
            trees = sorted({run["tree"] for run in here})
            bars = ax.bar(xs, [statistics.median(b) for b in bests], width, label=f"{label} ({', '.join(trees)})")
            ax.bar(xs, [statistics.median(run["rows"][i]["direct_median_Bps"] / GB for run in here) for i in range(len(rows))],
                   width * 0.45, color="black", alpha=0.4, label="median" if g == 0 else None)
            if len(here) > 1:
                for x, b in zip(xs, bests):
                    ax.plot([x] * len(b), b, ".", color="black", markersize=4,
                            label="each run's best" if g == 0 and x == xs[0] else None)
            carried_each = [link_GBps(run) for run in here]
            carried = statistics.median(rate for rate, _ in carried_each)
            readings = [v for _, run_readings in carried_each for v in run_readings]
            colour = bars.patches[0].get_facecolor() if len(groups) > 1 and readings else "gray"
            ax.axhline(carried, color=colour, linewidth=1)
            ax.axhline(carried * TARGET_SHARE[link], color=colour, linestyle="--", linewidth=1)
            ax.plot([len(rows) - 0.45 + offset / 2] * len(readings), readings, "_", color=colour, markersize=8)
            ax.set_xticks(range(len(rows)), [f"{row['size']} {row['bytes'] / 2**20:.0f} MiB" for row in rows],
                          rotation=30, ha="right", fontsize=7)
        what = "raw TCP (line), half of it (dashed)" if not LINKS.get(link) else "shaped rate (line), 80 % (dashed)"
        ax.set_title(f"{PANELS[link]}\n{what}", fontsize=8)
    axes[0][0].set_ylabel("direct pull GB/s: best (bar), median (dark)")
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.tight_layout()
    fig.legend(handles, labels, fontsize=8, loc="upper center", bbox_to_anchor=(0.5, 0.0), ncol=len(labels))
    return save_figure(fig, name, bbox_inches="tight")


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

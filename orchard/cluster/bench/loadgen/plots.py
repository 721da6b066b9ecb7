"""PNG figures from a result document: latency CDFs, and throughput against concurrency.

CDFs rather than bar charts of percentiles, because the shape of the tail is what
differs between servers. Drawn with matplotlib's Agg backend so no display is needed.
"""

from __future__ import annotations

import os

import numpy as np

_PANELS = (("ttft_ms", "TTFT (ms)"), ("tpot_ms", "TPOT (ms)"), ("itl_ms", "ITL (ms)"), ("e2el_ms", "E2E latency (ms)"))


def _pyplot():
    import matplotlib

    matplotlib.use("Agg", force=True)
    import matplotlib.pyplot as plt

    return plt


def write_plots(doc: dict, folder: str, stem: str = "bench") -> list[str]:
    """Write every figure the document supports; returns the paths written."""
    os.makedirs(folder, exist_ok=True)
    paths = [plot_latency_cdfs(doc, os.path.join(folder, f"{stem}_latency_cdf.png"))]
    if len(doc["runs"]) > 1:
        paths.append(plot_throughput_vs_concurrency(doc, os.path.join(folder, f"{stem}_throughput_vs_concurrency.png")))
    return paths


def latency_samples(run: dict, key: str) -> list[float]:
    """Per-request values of one latency metric in ms (ITL: every gap of every request)."""
    ok = [r for r in run["requests"] if r["error"] is None]
    if key == "itl_ms":
        return [gap for r in ok for gap in r["itl_ms"]]
    return [r[key] for r in ok if r[key] is not None]


def plot_latency_cdfs(doc: dict, path: str) -> str:
    plt = _pyplot()
    fig, axes = plt.subplots(2, 2, figsize=(10, 7))
    for ax, (key, label) in zip(axes.flat, _PANELS):
        for run in doc["runs"]:
            values = np.sort(np.asarray(latency_samples(run, key), dtype=float))
            if values.size:
                ax.step(values, np.arange(1, values.size + 1) / values.size, where="post",
                        label=f"concurrency {run['max_concurrency'] or 'unbounded'}")
        ax.set_xlabel(label)
        ax.set_ylabel("fraction of requests" if key != "itl_ms" else "fraction of gaps")
        ax.set_ylim(0, 1.02)
        ax.grid(alpha=0.3)
    axes.flat[0].legend(fontsize="small")
    fig.suptitle(f"latency CDFs — {doc['target']['base_url']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def plot_throughput_vs_concurrency(doc: dict, path: str) -> str:
    plt = _pyplot()
    runs = [r for r in doc["runs"] if r["max_concurrency"] is not None]
    levels = [r["max_concurrency"] for r in runs]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    ax.plot(levels, [r["summary"]["output_throughput"] for r in runs], "o-", label="output tokens/s")
    ax.set_xscale("log", base=2)
    ax.set_xticks(levels, [str(level) for level in levels])
    ax.minorticks_off()
    ax.set_xlabel("max concurrency")
    ax.set_ylabel("output tokens/s")
    ax.grid(alpha=0.3)
    ttft = ax.twinx()
    ttft.plot(levels, [_nan_if_none(r["summary"]["ttft_ms"]["p50"]) for r in runs], "s--", color="tab:red", label="TTFT p50 (ms)")
    ttft.set_ylabel("TTFT p50 (ms)")
    handles = ax.get_legend_handles_labels()[0] + ttft.get_legend_handles_labels()[0]
    ax.legend(handles, [h.get_label() for h in handles], loc="upper left", fontsize="small")
    fig.suptitle(f"throughput vs concurrency — {doc['target']['base_url']}")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
    return path


def _nan_if_none(x: float | None) -> float:
    return float("nan") if x is None else x

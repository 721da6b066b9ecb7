"""What every experiment shares: how it states the machine, times things, drops the page
cache, prints its table and saves its numbers.

The numbers in docs/uma-kv-design.md are only worth something if a reader can tell what
machine made them and rerun the same command, so every script prints the same header.
"""

from __future__ import annotations

import json
import mmap
import os
import platform
import shutil
import statistics
import subprocess
import time
from collections.abc import Callable, Sequence
from pathlib import Path

RESULTS_DIR = Path(__file__).resolve().parent / "results"
IMG_DIR = Path(__file__).resolve().parent.parent / "docs" / "img"


def openblas_preloaded() -> bool:
    return "openblas" in os.environ.get("LD_PRELOAD", "").lower()


def machine_line() -> str:
    """One line a reader can compare with their own machine."""
    load = " ".join(f"{x:.1f}" for x in os.getloadavg()) if hasattr(os, "getloadavg") else "n/a"
    try:
        import mlx.core as mx

        device = str(mx.default_device())
        mlx_version = mx.__version__
    except ImportError:
        device, mlx_version = "no mlx", "-"
    return (f"{platform.system()} {platform.machine()}, {os.cpu_count()} cores, load {load}, "
            f"mlx {mlx_version} on {device}, OpenBLAS preloaded: {'yes' if openblas_preloaded() else 'no'}")


def print_header(title: str) -> None:
    print(f"# {title}")
    print(f"# {machine_line()}")


def timed(fn: Callable[[], object]) -> float:
    start = time.perf_counter()
    fn()
    return time.perf_counter() - start


def median_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Median seconds of `repeats` calls after `warmup` untimed ones: the shared CPU is noisy,
    and the median ignores the calls another engineer's job stole time from."""
    for _ in range(warmup):
        fn()
    return statistics.median(timed(fn) for _ in range(repeats))


def best_time(fn: Callable[[], object], repeats: int, warmup: int = 1) -> float:
    """Fastest of `repeats` calls: on a CPU shared with other jobs, the least disturbed run
    is the closest estimate of the work's own cost (used where the doc says "best of")."""
    for _ in range(warmup):
        fn()
    return min(timed(fn) for _ in range(repeats))


def sync() -> None:
    """Wait for MLX's queued work, so a timer measures the work and not its queueing."""
    import mlx.core as mx

    mx.synchronize()


def drop_file_cache(path: Path, mapping: mmap.mmap | None = None) -> int | None:
    """Evict `path` from the page cache; returns bytes fincore still sees resident (None if unknown).

    A mapped page cannot be dropped while a process maps it, so the caller's own
    mapping (if any) is told MADV_DONTNEED first, after its dirty pages are written.
    """
    if mapping is not None:
        mapping.flush()
        advice = getattr(mmap, "MADV_DONTNEED", None)
        if advice is not None:
            mapping.madvise(advice)
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
        if hasattr(os, "posix_fadvise"):
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)
    return resident_bytes(path)


def resident_bytes(path: Path) -> int | None:
    """Bytes of `path` in the page cache, when util-linux's fincore can say."""
    if shutil.which("fincore") is None:
        return None
    out = subprocess.run(["fincore", "--bytes", "--noheadings", "--output", "RES", str(path)],
                         capture_output=True, text=True, check=False)
    words = out.stdout.split()
    return int(words[0]) if out.returncode == 0 and words else None


def best_and_median(values: Sequence[float]) -> tuple[float, float]:
    """The largest of `values` and their median (the upper one of an even count): a rate's best and median."""
    ranked = sorted(values, reverse=True)
    return ranked[0], ranked[len(ranked) // 2]


def markdown_table(header: Sequence[str], rows: Sequence[Sequence[object]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(str(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def save_results(name: str, data: dict) -> Path:
    """Write the raw numbers next to the scripts, with the machine they came from."""
    RESULTS_DIR.mkdir(parents=True, exist_ok=True)
    path = RESULTS_DIR / f"{name}.json"
    path.write_text(json.dumps({"machine": machine_line(), "date": time.strftime("%Y-%m-%d %H:%M"), **data},
                               indent=1, default=float))
    return path


def new_figure(width: float = 6.4, height: float = 4.0, **subplots):
    """(figure, axes) off screen; `subplots` as `matplotlib.pyplot.subplots` takes them (nrows, ncols, ...)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt.subplots(figsize=(width, height), dpi=120, **subplots)


def save_figure(fig, name: str, **savefig) -> Path:
    """docs/img/<name>.png; `savefig` as `Figure.savefig` takes it (bbox_inches="tight" keeps a legend
    placed outside the axes)."""
    IMG_DIR.mkdir(parents=True, exist_ok=True)
    path = IMG_DIR / f"{name}.png"
    fig.tight_layout()
    fig.savefig(path, **savefig)
    return path


def gigabytes_per_s(nbytes: int, seconds: float) -> float:
    return nbytes / seconds / 1e9 if seconds > 0 else float("inf")

"""Find OpenBLAS so MLX's CPU build can use it instead of the reference BLAS it links.

MLX's Linux CPU wheel runs matrix products ~40x slower with netlib BLAS; preloading
OpenBLAS fixes that, but the preload must be in the environment before Python starts.
`python -m orchard.node.openblas` prints the library path (or nothing) for the Makefile, and
`reexec_with_openblas()` lets the CLI restart itself with the preload. Never required.

The restart also gives OpenBLAS one thread unless `OPENBLAS_NUM_THREADS` says otherwise.
Its worker threads wait for work by spinning on `sched_yield`, and a serving process
already keeps the cores busy (the engine thread, MLX's two CPU streams, the gateway, the
clients): on the 2-core VM a quarter to two fifths of the node's CPU samples under 32
streaming clients were that spin (docs/benchmarks.md, "serve").
"""

from __future__ import annotations

import ctypes.util
import glob
import os
import subprocess
import sys

_CANDIDATES = [
    "/usr/lib/*-linux-gnu/openblas-pthread/libopenblas.so.0",
    "/usr/lib/*-linux-gnu/libopenblas.so.0",
    "/usr/lib64/libopenblas.so.0",
    "/usr/local/lib/libopenblas.so.0",
]


def find_openblas() -> str | None:
    """Path of a system OpenBLAS shared library, or None (macOS uses Accelerate)."""
    if sys.platform != "linux":
        return None
    for pattern in _CANDIDATES:
        hits = sorted(glob.glob(pattern))
        if hits:
            return hits[0]
    try:
        out = subprocess.run(["ldconfig", "-p"], capture_output=True, text=True, timeout=5).stdout
    except (OSError, subprocess.SubprocessError):
        out = ""
    for line in out.splitlines():
        if "libopenblas.so.0" in line and "=>" in line:
            return line.split("=>")[-1].strip()
    name = ctypes.util.find_library("openblas")
    return name if name and os.path.isabs(name) else None


def openblas_in_use() -> bool:
    return "openblas" in os.environ.get("LD_PRELOAD", "")


def blas_environment(environ: dict[str, str], openblas: str | None) -> dict[str, str] | None:
    """`environ` with `openblas` preloaded and one BLAS thread unless set; None when nothing changes."""
    if environ.get("ORCHARD_NO_OPENBLAS"):
        return None
    env = dict(environ)
    preload = env.get("LD_PRELOAD", "")
    if "openblas" not in preload and openblas:
        env["LD_PRELOAD"] = ":".join(p for p in (openblas, preload) if p)
    if "openblas" in env.get("LD_PRELOAD", ""):
        env.setdefault("OPENBLAS_NUM_THREADS", "1")
    return env if env != dict(environ) else None


def reexec_with_openblas() -> None:
    """Restart the current process with OpenBLAS preloaded (and its threads set), once, when it exists."""
    if os.environ.get("ORCHARD_NO_OPENBLAS"):
        return
    env = blas_environment(dict(os.environ), None if openblas_in_use() else find_openblas())
    if env is not None:
        # orig_argv keeps `-m package.module`; argv[0] would rerun the module as a script, with
        # its own folder first on the path (orchard/cluster/bench/kvcache.py then shadows kvcache).
        os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], env)


if __name__ == "__main__":
    print(find_openblas() or "")

"""On what each thread spends its CPU during 8 MiB pulls, against raw TCP replies of the same bytes: perf's
samples of every thread of both processes, summed by thread and by kind of code, in ms a pull.

`kv_pull_profile --threads` says how much CPU each thread spends a pull; this says on what: the kernel's copies
to and from the socket, the rest of the kernel (TCP, wake-ups, page faults), the wire format's checksum (xxh3),
the Python interpreter (the python executable or libpython), and other user code (numpy, MLX, extension
modules, the C library). One pair of processes runs four phases
in turn, each of `--pulls` replies: direct pulls over two connections, the floor's raw checksummed replies over
two (`kv_pull_floor`'s "raw, memory, checksummed, two connections"), then both over one. The raw replies do what
a pull's bytes must (from and into memory out of cache, checksummed as they go) and nothing else, so a thread's
ms beyond its raw twin's are the pull's own work. Each thread started in either process takes its Python name as
its OS name (perf's `comm`); a process's main thread keeps the executable's.

    python -m experiments.kv_pull_cpu [--pulls 60] [--perf perf] [--frequency 2999] [--top 10]

Runs itself (`--phases`) under `perf record -F <frequency>` (cpu-clock samples, no call chains), then reads the
samples back with `perf script`. Needs perf (Debian's linux-perf) and leave to read kernel symbols (root, or
kernel.perf_event_paranoid <= 1 and kernel.kptr_restrict 0). Numbers go to experiments/results/kv_pull_cpu.json.
"""

from __future__ import annotations

import argparse
import ctypes
import os
import re
import shutil
import subprocess
import sys
import tempfile
import threading
import time
from collections import defaultdict
from dataclasses import replace
from pathlib import Path

from experiments import kv_pull_floor as floor
from experiments import kv_pull_profile as kp
from experiments.common import best_and_median, markdown_table, print_header, save_results

TOKENS = 2048  # the small model's 8 MiB
#: Each phase's pulls' connections, or the floor's raw step it times.
PHASES = {"pull, 2 connections": 2, "raw, 2 connections": floor.CHECKSUMMED_TWO,
          "pull, 1 connection": 1, "raw, 1 connection": floor.CHECKSUMMED}
KINDS = ("kernel: copies", "kernel: other", "checksum", "Python", "other user")
_COPY = re.compile(r"copy_(to|from)_iter|copy_user|rep_movs")
_SAMPLE = re.compile(r"^\s*(?P<comm>\S+)\s+(?P<pid>\d+)/(?P<tid>\d+)\s+(?P<time>[\d.]+):\s+(?P<period>\d+)\s+"
                     r"[0-9a-f]+\s+(?P<sym>.*?)\s+\((?P<dso>[^()]*)\)\s*$")


def name_threads() -> None:
    """From now on, each thread this process starts takes its Python name as its OS name (what perf reports),
    spaces dropped and "ThreadPoolExecutor-" shortened to "pool", cut to Linux's 15 bytes."""
    libc = ctypes.CDLL(None)
    boot = threading.Thread._bootstrap_inner

    def named(thread):
        libc.prctl(15, thread.name.replace(" ", "").replace("ThreadPoolExecutor-", "pool").encode()[:15], 0, 0, 0)
        boot(thread)

    threading.Thread._bootstrap_inner = named


def kind_of(sym: str, dso: str) -> str:
    """Which of `KINDS` a sample's function belongs to."""
    if dso == "[kernel.kallsyms]":
        return KINDS[0] if _COPY.search(sym) else KINDS[1]
    if sym.startswith("XXH"):
        return KINDS[2]
    if dso.rsplit("/", 1)[-1].startswith(("python", "libpython")) or dso.startswith("[JIT]"):
        return KINDS[3]  # the interpreter, not an extension module (numpy's `*.cpython-312-*.so` is other user code)
    return KINDS[4]


def _source(conn, size: str, num_blocks: int) -> None:
    name_threads()
    kp.source_node(conn, size, num_blocks, answer=floor._answer)


def run_phases(pulls: int) -> None:
    """The child's side: print `PIDS target source`, then `PHASE <i> <t0> <t1>` (CLOCK_MONOTONIC, perf's clock
    under `-k CLOCK_MONOTONIC`) and the phase's rates as each ends."""
    name_threads()
    num_blocks = (2 * pulls + 4) * TOKENS // 16 + 64
    ours, process, loop, engine, path, address = kp.pull_pair(_source, "small", num_blocks)
    print(f"PIDS {os.getpid()} {process.pid}", flush=True)
    try:
        nbytes = floor.first_pull_bytes(ours, loop, path, address, TOKENS)
        askers = floor.raw_askers(ours, [how for how in PHASES.values() if isinstance(how, str)], nbytes)
        seeds = iter(range(3, 1 << 30))
        for i, how in enumerate(PHASES.values()):
            started, rates = time.monotonic(), []
            if isinstance(how, int):
                path.config = replace(path.config, connections_per_pull=how)
            for _ in range(pulls):
                if isinstance(how, int):
                    rates.append(floor.fresh_pull(ours, loop, path, address, TOKENS, next(seeds)))
                else:
                    time.sleep(0.005)
                    rates.append(askers[how].once())
            best, median = best_and_median(rates)
            print(f"PHASE {i} {started:.6f} {time.monotonic():.6f} {nbytes} {best:.0f} {median:.0f}", flush=True)
        for asker in askers.values():
            asker.close()
    finally:
        kp.stop(ours, process, path, engine)


def record(perf: str, pulls: int, frequency: int, data: Path) -> tuple[dict, list[tuple]]:
    """Run the phases under perf; (the processes' pids by side, each phase's (t0, t1, bytes, best, median))."""
    command = [*perf.split(), "record", "-q", "-F", str(frequency), "-k", "CLOCK_MONOTONIC", "-o", str(data), "--",
               sys.executable, "-m", "experiments.kv_pull_cpu", "--phases", "--pulls", str(pulls)]
    done = subprocess.run(command, capture_output=True, text=True)
    out = done.stdout
    pids, phases = {}, []
    for line in out.splitlines():
        words = line.split()
        if words[:1] == ["PIDS"]:
            pids = {int(words[1]): "target", int(words[2]): "source"}
        elif words[:1] == ["PHASE"]:
            phases.append((float(words[2]), float(words[3]), int(words[4]), float(words[5]), float(words[6])))
    if not pids or len(phases) != len(PHASES):
        raise RuntimeError(f"the phases did not run whole (perf's exit {done.returncode}):\n{out}\n{done.stderr[-3000:]}")
    return pids, phases


def samples(perf: str, data: Path):
    """(pid, comm, time s, period ns, sym, dso) of each sample."""
    script = subprocess.run([*perf.split(), "script", "-i", str(data), "-G", "--ns", "-F",
                             "comm,pid,tid,time,period,ip,sym,dso"], capture_output=True, text=True, check=True).stdout
    for line in script.splitlines():
        if m := _SAMPLE.match(line):
            yield int(m["pid"]), m["comm"], float(m["time"]), int(m["period"]), m["sym"], m["dso"]


def tally(rows, pids: dict, phases: list[tuple], pulls: int):
    """ms a pull by (phase, side, thread, kind) and by (phase, side, thread, (symbol, dso))."""
    by_kind, by_sym = defaultdict(float), defaultdict(float)
    for pid, comm, at, period, sym, dso in rows:
        side = pids.get(pid)
        phase = next((i for i, (t0, t1, *_) in enumerate(phases) if t0 <= at < t1), None)
        if side is None or phase is None:
            continue
        ms = period / 1e6 / pulls
        by_kind[phase, side, comm, kind_of(sym, dso)] += ms
        by_sym[phase, side, comm, (sym, dso)] += ms
    return by_kind, by_sym


def report(by_kind, by_sym, phases: list[tuple], top: int) -> dict:
    """Print the phases' rates, each thread's ms by kind and each link thread's top functions; returns, for each
    thread kept, its ms by kind and its functions (symbol, library, ms) of 0.01 ms or more."""
    names = list(PHASES)
    print(markdown_table(["phase", "best GB/s", "median GB/s"],
                         [[names[i], f"{p[3] / 1e9:.2f}", f"{p[4] / 1e9:.2f}"] for i, p in enumerate(phases)]))
    functions = defaultdict(list)  # by (phase, side, thread): (ms, symbol, library), most first
    for (phase, side, comm, (sym, dso)), ms in sorted(by_sym.items(), key=lambda item: -item[1]):
        if ms >= 0.01:
            functions[phase, side, comm].append((ms, sym, dso))
    rows, saved, listed = [], {}, []
    for thread in sorted({key[:3] for key in by_kind}):
        phase, side, comm = thread
        kinds = [by_kind.get((*thread, k), 0.0) for k in KINDS]
        if comm.startswith("orchard-engine") or sum(kinds) < 0.05:
            continue  # the engine's ms are the source's seeding between pulls, not the pull
        rows.append([names[phase], side, comm, *(f"{v:.2f}" for v in kinds), f"{sum(kinds):.2f}"])
        saved[f"{names[phase]} | {side} | {comm}"] = {"by_kind": dict(zip(KINDS, kinds)),
                                                       "functions": [[sym, dso, ms] for ms, sym, dso in functions[thread]]}
        if comm.startswith(("kv-link", "Thread-", "pool")) or (side == "target" and comm.startswith("python")):
            top_functions = ", ".join(f"{sym} {ms:.2f}" for ms, sym, _ in functions[thread][:top] if ms >= 0.02)
            listed.append(f"\n{names[phase]}, {side}, {comm}: {top_functions}")
    print("\nms of CPU a pull or reply, each thread (the source's engine left out: it seeds between pulls)\n")
    print(markdown_table(["phase", "side", "thread", *KINDS, "total"], rows))
    print("\n".join(listed))
    return saved


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--pulls", type=int, default=60, help="pulls or replies a phase")
    p.add_argument("--perf", default="perf", help="the perf command (a path, or a command line)")
    p.add_argument("--frequency", type=int, default=2999, help="samples a second a CPU")
    p.add_argument("--top", type=int, default=10, help="symbols listed a link thread")
    p.add_argument("--phases", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.phases:
        run_phases(args.pulls)
        return 0
    if shutil.which(args.perf.split()[0]) is None:
        print(f"no {args.perf.split()[0]!r} here: install perf (linux-perf) or pass --perf", file=sys.stderr)
        return 2
    print_header(f"each thread's CPU during pulls and raw replies, by kind of code (small, {TOKENS} tokens)")
    with tempfile.TemporaryDirectory() as tmp:
        data = Path(tmp) / "perf.data"
        pids, phases = record(args.perf, args.pulls, args.frequency, data)
        by_kind, by_sym = tally(samples(args.perf, data), pids, phases, args.pulls)
    saved = report(by_kind, by_sym, phases, args.top)
    save_results("kv_pull_cpu", {"pulls": args.pulls, "frequency": args.frequency, "ms_a_pull": saved,
                                 "phases": {n: {"best_Bps": p[3], "median_Bps": p[4]} for n, p in zip(PHASES, phases)}})
    return 0


if __name__ == "__main__":
    raise SystemExit(main())

"""What `orchard bench migration` prints: a case of the migrate-or-recompute comparison, the pull table and the router's record.

Shared by the loopback bench (orchard/cluster/bench/migration.py) and the namespace one (orchard/cluster/bench/migration_netns.py).
"""

from __future__ import annotations

import json
import statistics
import subprocess
import time
from dataclasses import asdict, dataclass
from pathlib import Path


@dataclass
class Case:
    model: str
    tokens: int
    migrate_ttft_s: float
    recompute_ttft_s: float
    router_migrates: bool
    est_transfer_s: float | None
    est_recompute_s: float | None = None  # the prefix's tokens at b's marginal prefill cost (else its average)

    @property
    def router_was_right(self) -> bool:
        return self.router_migrates == (self.migrate_ttft_s < self.recompute_ttft_s)


def router_estimates(latency_s: float, bytes_per_s: float | None, bytes_per_block: int, target_row: dict,
                     blocks: int, block_size: int) -> tuple[float | None, float | None]:
    """The router's two prices of `blocks` the target lacks (`Router._plan_migration`): pulling them
    over the link, and recomputing their tokens at the target's marginal prefill cost (its average
    cost per token until it has reported one); None where the rate is not known yet."""
    transfer = latency_s + blocks * bytes_per_block / bytes_per_s if bytes_per_s else None
    per_token = target_row.get("prefill_marginal_tokens_per_s") or target_row.get("prefill_tokens_per_s")
    return transfer, (blocks * block_size / per_token if per_token else None)


def print_report(tcp: list[float], rows, cases: list[Case], openblas: bool, where: str) -> None:
    """The loopback bench's report: raw TCP, the pull table against it, then the router's cases."""
    gb = 1e9
    tcp_Bps = statistics.median(tcp)
    print(f"KV migration, {where}; OpenBLAS preloaded: {openblas}")
    print(f"raw TCP, plain sockets, one stream: {tcp_Bps / gb:.3f} GB/s, the median of "
          + ", ".join(f"{v / gb:.3f}" for v in tcp) + " (before the nodes, then after each model's pulls)")
    print()
    print(f"{'model':<12}{'prefix':>7}{'MiB':>7}{'wire MiB':>9}{'direct pull GB/s':>17}{'% TCP':>7}{'median':>8}{'% TCP':>7}"
          f"{REPLY_HEADER}{'Ray pull GB/s':>14}{'% TCP':>7}{'object store only':>18}{'% TCP':>7}")
    for row in rows:
        wire = row["wire_bytes"]  # the best pull's bytes on the link: fewer where compressed
        against_tcp = lambda cells: "".join(f"{v / gb:>{w}.2f}{100 * v / tcp_Bps:>6.0f}%" for v, w in cells)  # noqa: E731
        print(f"{'demo-' + row['size']:<12}{row['tokens']:>7}{row['bytes'] / 2**20:>7.1f}{wire / 2**20:>9.1f}"
              + against_tcp(((row["direct_Bps"], 17), (row["direct_median_Bps"], 8)))
              + reply_cells(row["direct_Bps"], row["direct_median_Bps"], row)
              + against_tcp(((row["ray_Bps"], 14), (row["transfer_Bps"], 18))))
    print()
    print(REPLY_NOTE)
    print()
    print_cases(cases)


#: The reply columns of both benches' pull tables (`reply_cells`), and what they are.
REPLY_HEADER = f"{'TCP reply GB/s':>16}{'% reply':>10}"
REPLY_NOTE = ("TCP reply: raw TCP moving the row's bytes as one request and reply on a kept connection, best / median of as "
              "many exchanges as pulls\n(`netns.tcp_replies`); % reply: the direct pulls' best / median against them")


def reply_cells(best_Bps: float, median_Bps: float, row: dict) -> str:
    """The pulls' best and median against raw TCP's same-size request/reply exchanges (`RawTCP.replies`)."""
    reply, reply_median = row["reply_Bps"], row["reply_median_Bps"]
    rates = f"{reply / 1e9:.2f}/{reply_median / 1e9:.2f}"
    shares = f"{100 * best_Bps / reply:.0f}/{100 * median_Bps / reply_median:.0f}%"
    return f"{rates:>16}{shares:>10}"


def print_cases(cases: list[Case]) -> None:
    print(f"{'model':<12}{'prefix':>7}{'TTFT migr s':>12}{'TTFT recomp s':>14}{'est migr s':>11}{'est recomp s':>13}"
          f"{'faster':>10}{'router':>10}{'right':>7}")
    for c in cases:
        faster = "migrate" if c.migrate_ttft_s < c.recompute_ttft_s else "recompute"
        choice = "migrate" if c.router_migrates else "recompute"
        estimates = [f"{v:.3f}" if v is not None else "-" for v in (c.est_transfer_s, c.est_recompute_s)]
        print(f"{c.model:<12}{c.tokens:>7}{c.migrate_ttft_s:>12.3f}{c.recompute_ttft_s:>14.3f}{estimates[0]:>11}"
              f"{estimates[1]:>13}{faster:>10}{choice:>10}{'yes' if c.router_was_right else 'no':>7}")
    right = sum(c.router_was_right for c in cases)
    print(f"router's migrate-or-recompute choice was the faster one in {right} of {len(cases)} cases")


def save_report(path: str, link: str, tcp: list[float], rows, cases: list[Case], where: str) -> Path:
    """The numbers `print_report` prints, as JSON at `path` with the link, the tree and the time, for plots
    (`experiments/migration_rates.py`)."""
    tree = _tree()
    out = Path(path)
    out.write_text(json.dumps({"link": link, "where": where, "tree": tree or None,
                               "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()),
                               "tcp_Bps": tcp, "rows": rows, "cases": [asdict(c) for c in cases]}, indent=1))
    return out


def _tree() -> str | None:
    """The checkout's commit, marked where tracked files differ from it."""
    git = lambda *args: subprocess.run(["git", *args], capture_output=True, text=True, check=False).stdout.strip()  # noqa: E731
    head = git("rev-parse", "--short", "HEAD")
    return None if not head else head + (" with local changes" if git("status", "--porcelain", "--untracked-files=no") else "")

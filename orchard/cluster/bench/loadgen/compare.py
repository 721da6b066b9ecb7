"""`bench compare A.json B.json`: every headline figure of B as a ratio of A's.

Runs are paired by concurrency level when both documents hold the same levels, else by
position. A ratio above 1 is better for throughputs and worse for latencies; the
table says which way each metric points so nobody has to remember.
"""

from __future__ import annotations

from dataclasses import dataclass

from rich.console import Console
from rich.table import Table

THROUGHPUTS = ("request_throughput", "output_throughput", "total_token_throughput", "goodput")
COUNTS = ("completed", "failed", "total_output_tokens")
LATENCIES = ("ttft_ms", "tpot_ms", "itl_ms", "e2el_ms")
STATS = ("mean", "p50", "p90", "p99")


@dataclass(frozen=True)
class ComparisonRow:
    """One metric at one concurrency level in both documents; ratio is b / a.

    `level` names the concurrency cap ("unbounded" when none), or both caps ("1 vs 4")
    when runs were paired by position.
    """

    level: str
    metric: str
    a: float | None
    b: float | None
    higher_is_better: bool | None

    @property
    def ratio(self) -> float | None:
        if self.a is None or self.b is None or self.a == 0:
            return None
        return self.b / self.a


def compare_documents(a: dict, b: dict) -> list[ComparisonRow]:
    rows: list[ComparisonRow] = []
    for run_a, run_b in _paired_runs(a["runs"], b["runs"]):
        level = _level_label(run_a["max_concurrency"], run_b["max_concurrency"])
        rows.extend(_compare_summaries(level, run_a["summary"], run_b["summary"]))
    return rows


def _paired_runs(runs_a: list[dict], runs_b: list[dict]) -> list[tuple[dict, dict]]:
    levels_a = [r["max_concurrency"] for r in runs_a]
    levels_b = [r["max_concurrency"] for r in runs_b]
    if sorted(levels_a, key=str) == sorted(levels_b, key=str) and len(set(map(str, levels_a))) == len(levels_a):
        by_level = {str(r["max_concurrency"]): r for r in runs_b}
        return [(r, by_level[str(r["max_concurrency"])]) for r in runs_a]
    return list(zip(runs_a, runs_b))


def _level_label(a: int | None, b: int | None) -> str:
    name_a, name_b = (str(x) if x else "unbounded" for x in (a, b))
    return name_a if name_a == name_b else f"{name_a} vs {name_b}"


def _compare_summaries(level: str, sa: dict, sb: dict) -> list[ComparisonRow]:
    rows = [ComparisonRow(level, k, sa.get(k), sb.get(k), True) for k in THROUGHPUTS]
    rows += [ComparisonRow(level, k, sa.get(k), sb.get(k), None) for k in COUNTS]
    for key in LATENCIES:
        for stat in STATS:
            rows.append(ComparisonRow(level, f"{key}.{stat}", sa[key].get(stat), sb[key].get(stat), False))
    return rows


def print_comparison(rows: list[ComparisonRow], name_a: str, name_b: str, console: Console | None = None) -> None:
    table = Table(title=f"B / A   (A = {name_a}, B = {name_b})")
    for col, justify in (("concurrency", "right"), ("metric", "left"), ("A", "right"), ("B", "right"),
                         ("B/A", "right"), ("better", "left")):
        table.add_column(col, justify=justify)
    for row in rows:
        if row.a is None and row.b is None:
            continue
        table.add_row(row.level, row.metric, _fmt(row.a), _fmt(row.b),
                      "-" if row.ratio is None else f"{row.ratio:.3f}x", _verdict(row))
    (console or Console()).print(table)


def _verdict(row: ComparisonRow) -> str:
    if row.ratio is None or row.higher_is_better is None or row.ratio == 1:
        return ""
    return "B" if (row.ratio > 1) == row.higher_is_better else "A"


def _fmt(x: float | None) -> str:
    if x is None:
        return "-"
    return f"{x:.2f}" if isinstance(x, float) else str(x)

"""The result document of `bench serve`: built, written as JSON, printed as a table.

One document holds the run's settings and one entry per concurrency level (a single
entry unless a sweep was asked for), each with its summary and every request's record,
so figures can be recomputed later and two documents compared field by field.
"""

from __future__ import annotations

import datetime as _dt
import json
import math
import os
from dataclasses import asdict
from typing import TYPE_CHECKING

from rich.console import Console
from rich.table import Table

from orchard.cluster.bench.loadgen.client import RequestRecord
from orchard.cluster.bench.loadgen.metrics import summarize

if TYPE_CHECKING:
    from orchard.cluster.bench.loadgen.client import EndpointConfig
    from orchard.cluster.bench.loadgen.config import ServeBenchConfig
    from orchard.cluster.bench.loadgen.prompts import PromptSource
    from orchard.cluster.bench.loadgen.runner import RunResult

SCHEMA = "orchard-bench-serve/1"


def result_document(cfg: ServeBenchConfig, endpoint: EndpointConfig, source: PromptSource,
                    runs: list[RunResult]) -> dict:
    dataset = asdict(cfg.dataset)
    dataset["prompt_lengths"] = source.describe()
    dataset["lengths_exact"] = source.exact
    return {
        "schema": SCHEMA,
        "created": _dt.datetime.now(_dt.timezone.utc).isoformat(timespec="seconds"),
        "target": {"base_url": endpoint.base_url, "model": endpoint.model, "api_key_used": bool(endpoint.api_key),
                   "temperature": endpoint.temperature, "ignore_eos": endpoint.ignore_eos},
        "dataset": dataset,
        "load": {**asdict(cfg.load), "request_rate": _finite_or_str(cfg.load.request_rate)},
        "slo": asdict(cfg.slo) if cfg.slo else None,
        "runs": [_run_entry(run, cfg) for run in runs],
    }


def _run_entry(run: RunResult, cfg: ServeBenchConfig) -> dict:
    return {
        "max_concurrency": run.max_concurrency,
        "summary": summarize(run.records, run.duration_s, cfg.slo).to_dict(),
        "requests": [request_entry(r, cfg.save_text) for r in run.records],
    }


def request_entry(rec: RequestRecord, save_text: bool = False) -> dict:
    entry = {
        "conversation_id": rec.conversation_id,
        "turn": rec.turn,
        "start_s": rec.start_s,
        "input_tokens": rec.input_tokens,
        "prompt_tokens": rec.prompt_tokens,
        "max_tokens": rec.max_tokens,
        "output_tokens": rec.output_tokens,
        "content_chunks": rec.content_chunks,
        "token_source": rec.token_source,
        "ttft_ms": _ms(rec.ttft_s),
        "tpot_ms": _ms(rec.tpot_s),
        "e2el_ms": _ms(rec.e2el_s),
        "itl_ms": [gap * 1000 for gap in rec.itl_s],
        "error": rec.error,
    }
    if save_text:
        entry["text"] = rec.text
    return entry


def write_json(doc: dict, path: str) -> None:
    folder = os.path.dirname(os.path.abspath(path))
    os.makedirs(folder, exist_ok=True)
    with open(path, "w", encoding="utf-8") as f:
        json.dump(doc, f, indent=1)
        f.write("\n")


def load_json(path: str) -> dict:
    with open(path, encoding="utf-8") as f:
        return json.load(f)


_LATENCIES = (("ttft_ms", "TTFT"), ("tpot_ms", "TPOT"), ("itl_ms", "ITL"), ("e2el_ms", "E2E latency"))


def print_summary(doc: dict, console: Console | None = None) -> None:
    console = console or Console()
    for run in doc["runs"]:
        s = run["summary"]
        table = Table(title=f"bench serve — {doc['target']['base_url']} — concurrency "
                            f"{run['max_concurrency'] or 'unbounded'}", show_header=True)
        table.add_column("metric")
        table.add_column("value", justify="right")
        for key in ("completed", "failed", "duration_s", "total_input_tokens", "total_output_tokens",
                    "request_throughput", "output_throughput", "total_token_throughput", "goodput"):
            if s.get(key) is not None:
                table.add_row(key, _fmt(s[key]))
        for key, name in _LATENCIES:
            d = s[key]
            if d["count"]:
                table.add_row(f"{name} ms mean / p50 / p90 / p99",
                              " / ".join(_fmt(d[k]) for k in ("mean", "p50", "p90", "p99")))
        console.print(table)
        if s["token_count_source"] != "usage":
            console.print("[yellow]the server sent no usage: output tokens counted as text chunks[/yellow]")
        if s["errors"]:
            console.print(f"[red]errors:[/red] {s['errors']}")
    if not doc["dataset"]["lengths_exact"]:
        console.print(f"[yellow]input lengths are {doc['dataset']['prompt_lengths']}[/yellow]")


def _ms(seconds: float | None) -> float | None:
    return None if seconds is None else seconds * 1000


def _fmt(value) -> str:
    return f"{value:.2f}" if isinstance(value, float) else str(value)


def _finite_or_str(x: float):
    return x if math.isfinite(x) else "inf"

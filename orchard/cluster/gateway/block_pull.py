"""Carrying out a route's migration plan: the target pulls the blocks before it prefills.

The gateway only introduces the two nodes: it asks the target actor to `pull_blocks` from
the source actor's handle. The target asks the source for payloads, whose ObjectRefs it
awaits itself, so the KV bytes go from the source's object store to the target's and never
through the gateway or the coordinator. The target reports what moved (and the effective
link rate it saw) to the coordinator; the caller reports what the step cost beyond the pull.

A migration is an optimisation, never a dependency: whatever goes wrong (a refused
payload, a dead source, a slow pull), the request goes ahead and recomputes what is
missing, and the failure is counted.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import ray.exceptions as rex

from orchard.cluster.coordinator.router import MigrationPlan
from orchard.kvcache.hashing import BlockHash

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class MigrationPolicy:
    """How long a request waits for its pull before it gives up and recomputes."""

    min_wait_s: float = 2.0
    # A pull may run this many times over its estimate: the estimate is a moving average.
    slack: float = 5.0

    def wait_s(self, plan: MigrationPlan) -> float:
        return max(self.min_wait_s, self.slack * plan.est_transfer_s)


@dataclass(frozen=True)
class MigrationOutcome:
    ok: bool
    requested: int
    imported: int = 0
    local: int = 0  # blocks the target already held (memory or its cold tier)
    error: str = ""
    reported: bool = True  # False: the target never answered, so the gateway counted the failure


def migration_hashes(plan: MigrationPlan, cached_blocks: int, hashes: Sequence[BlockHash]) -> list[BlockHash]:
    """The run of prompt hashes the plan moves: right after the target's own leading blocks."""
    return list(hashes[cached_blocks : cached_blocks + plan.num_blocks])


def outcome_from_report(report: dict) -> MigrationOutcome:
    return MigrationOutcome(
        ok=bool(report.get("ok")),
        requested=int(report.get("requested", 0)),
        imported=int(report.get("imported", 0)),
        local=int(report.get("local", 0)),
        error=str(report.get("error", "")),
    )


async def pull_for_request(
    coordinator: Any,
    target: Any,
    target_id: str,
    source: Any,
    source_id: str,
    hashes: Sequence[BlockHash],
    wait_s: float,
) -> MigrationOutcome:
    """Ask `target` to pull `hashes` from `source`; never raises for a failed migration."""
    try:
        report = await asyncio.wait_for(timed_pull(coordinator, target, target_id, source, source_id, hashes), timeout=wait_s)
    except (asyncio.TimeoutError, rex.RayError, ValueError) as exc:
        reason = f"{type(exc).__name__}: {exc}"
        log.info("migration %s -> %s did not finish: %s; recomputing", source_id, target_id, reason)
        _count_failure(coordinator, target_id, source_id, reason)
        return MigrationOutcome(ok=False, requested=len(hashes), error=reason, reported=False)
    return outcome_from_report(report)


async def timed_pull(coordinator: Any, target: Any, target_id: str, source: Any, source_id: str, hashes: Sequence[BlockHash]) -> dict:
    """The target's report of pulling `hashes` from `source`. A pull that went through also tells
    the coordinator how long the request waited beyond the pull the target timed: the call and
    its reply, a fixed cost that decides whether a short prefix is worth moving at all."""
    started = time.perf_counter()
    report = await target.pull_blocks.remote(source, source_id, [bytes(h) for h in hashes])
    waited = time.perf_counter() - started
    if report.get("ok") and report.get("seconds"):
        _report_overhead(coordinator, source_id, target_id, float(report.get("bytes", 0)), waited - float(report["seconds"]))
    return report


def _report_overhead(coordinator: Any, source_id: str, target_id: str, nbytes: float, seconds: float) -> None:
    try:
        coordinator.migration_overhead.remote(source_id, target_id, nbytes, seconds)
    except rex.RayError as exc:
        log.warning("could not report a migration's overhead to the coordinator: %s", exc)


def _count_failure(coordinator: Any, target_id: str, source_id: str, reason: str) -> None:
    try:
        coordinator.migration_failed.remote(target_id, source_id, reason)
    except rex.RayError as exc:
        log.warning("could not count a failed migration to %s: %s", target_id, exc)

"""Drive a workload against an endpoint: arrivals, a concurrency cap, a count or a duration.

Arrivals schedule conversations; within a conversation each turn waits for the reply
to the previous one (a user reads before typing), and its messages carry the whole
history, so multi-turn context grows by what the server actually answered. The
concurrency cap bounds requests in flight, not conversations. A duration run stops
issuing new requests at the deadline and lets those in flight finish.
"""

from __future__ import annotations

import asyncio
import contextlib
import math
import time
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from orchard.cluster.bench.loadgen.arrivals import arrival_offsets
from orchard.cluster.bench.loadgen.client import Outgoing, RequestRecord, StreamClient
from orchard.cluster.bench.loadgen.datasets import Conversation, Turn


@dataclass(frozen=True)
class LoadConfig:
    """How hard to push: arrival rate (inf = burst), cap on requests in flight, when to stop."""

    request_rate: float = math.inf
    max_concurrency: int | None = None
    num_prompts: int | None = 100
    duration_s: float | None = None
    seed: int = 0
    max_requests: int = 100_000

    def __post_init__(self) -> None:
        if (self.num_prompts is None) == (self.duration_s is None):
            raise ValueError("give exactly one of num_prompts and duration_s")
        if self.num_prompts is not None and self.num_prompts < 1:
            raise ValueError(f"num_prompts must be at least 1, got {self.num_prompts}")
        if self.duration_s is not None and self.duration_s <= 0:
            raise ValueError(f"duration must be positive, got {self.duration_s}")
        if self.max_concurrency is not None and self.max_concurrency < 1:
            raise ValueError(f"max_concurrency must be at least 1, got {self.max_concurrency}")
        if self.request_rate <= 0:
            raise ValueError(f"request rate must be positive, got {self.request_rate}")

    @property
    def request_budget(self) -> int:
        """Most requests this run may send: the count, or the safety cap for duration runs."""
        return self.num_prompts if self.num_prompts is not None else self.max_requests


@dataclass
class RunResult:
    """Records of one run in completion order and its wall time."""

    records: list[RequestRecord]
    duration_s: float
    max_concurrency: int | None


OnDone = Callable[[RequestRecord], None]


async def run_load(convs: Iterable[Conversation], client: StreamClient, load: LoadConfig,
                   on_done: OnDone = lambda rec: None) -> RunResult:
    """Send every conversation at its arrival time and wait for all of them."""
    cap = asyncio.Semaphore(load.max_concurrency) if load.max_concurrency else None
    start = time.perf_counter()
    deadline = start + load.duration_s if load.duration_s is not None else None
    records: list[RequestRecord] = []
    tasks: list[asyncio.Task] = []
    for conv, offset in zip(convs, arrival_offsets(load.request_rate, load.seed)):
        due = start + offset
        if deadline is not None and due >= deadline:
            break
        delay = due - time.perf_counter()
        if delay > 0:
            await asyncio.sleep(delay)
        session = _Session(client, cap, start, deadline, records, on_done)
        tasks.append(asyncio.create_task(session.run(conv)))
    await asyncio.gather(*tasks)
    return RunResult(records, time.perf_counter() - start, load.max_concurrency)


@dataclass
class _Session:
    client: StreamClient
    cap: asyncio.Semaphore | None
    start: float
    deadline: float | None
    records: list[RequestRecord]
    on_done: OnDone

    async def run(self, conv: Conversation) -> None:
        history: list[dict] = []
        context_tokens = 0
        for index, turn in enumerate(conv.turns):
            if self.deadline is not None and time.perf_counter() >= self.deadline:
                return
            out = _outgoing(conv, index, turn, history, context_tokens)
            async with self.cap or contextlib.nullcontext():
                rec = await self.client.send(out, self.start)
            self.records.append(rec)
            self.on_done(rec)
            if not rec.success:
                return  # the history would be missing a reply
            history += [{"role": "user", "content": turn.text}, {"role": "assistant", "content": rec.text}]
            context_tokens += turn.input_tokens + rec.output_tokens


def _outgoing(conv: Conversation, index: int, turn: Turn, history: list[dict], context_tokens: int) -> Outgoing:
    common = dict(conversation_id=conv.id, turn=index, input_tokens=context_tokens + turn.input_tokens,
                  max_tokens=turn.max_tokens)
    if conv.chat:
        return Outgoing(messages=(*history, {"role": "user", "content": turn.text}), **common)
    return Outgoing(prompt=turn.text, **common)

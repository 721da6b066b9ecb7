"""One HTTP request's engine jobs on the backend, from start to abort.

`Generation` merges the outputs of a request's jobs (one per prompt), measures their
latencies, and aborts every unfinished job the moment the request ends for any reason:
client gone, timeout, error. Aborts run shielded from cancellation, because they run
exactly when the surrounding task is being cancelled.
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass

import anyio
from fastapi import Request

from orchard.cluster.gateway.backend import Backend, ModelInfo
from orchard.cluster.gateway.errors import ClientClosedRequest, RequestTimedOut
from orchard.cluster.gateway.metrics import GatewayMetrics, JobTimes
from orchard.node.types import RequestOutput, SamplingParams


@dataclass
class Job:
    request_id: str
    prompt_token_ids: list[int]
    session: str | None = None  # the client's conversation key (cluster.gateway.sessions)


async def _merge(iterators: list[AsyncIterator[RequestOutput]]) -> AsyncIterator[tuple[int, RequestOutput]]:
    """(iterator index, item) in arrival order; closes every iterator on exit."""
    if len(iterators) == 1:
        try:
            async for item in iterators[0]:
                yield 0, item
        finally:
            with anyio.CancelScope(shield=True):
                await iterators[0].aclose()
        return
    pending = {asyncio.ensure_future(anext(it)): i for i, it in enumerate(iterators)}
    try:
        while pending:
            done, _ = await asyncio.wait(pending, return_when=asyncio.FIRST_COMPLETED)
            for task in done:
                i = pending.pop(task)
                try:
                    item = task.result()
                except StopAsyncIteration:
                    continue
                pending[asyncio.ensure_future(anext(iterators[i]))] = i
                yield i, item
    finally:
        with anyio.CancelScope(shield=True):
            for task in pending:
                task.cancel()
            await asyncio.gather(*pending, return_exceptions=True)
            for it in iterators:
                await it.aclose()


async def wait_for_disconnect(request: Request) -> None:
    """Returns when the client goes away (the server reports it once the body is read)."""
    while (await request.receive())["type"] != "http.disconnect":
        pass


class Generation:
    """One HTTP request's jobs on the backend, ended (and aborted) together."""

    def __init__(self, backend: Backend, info: ModelInfo, request: Request, metrics: GatewayMetrics,
                 timeout_s: float | None, admission=None):
        self.backend, self.info, self.request = backend, info, request
        self.metrics, self.timeout_s = metrics, timeout_s
        self.admission = admission  # the queue places its jobs hold until their first output
        self.started = time.perf_counter()
        self._times: dict[int, JobTimes] = {}

    async def outputs(self, jobs: list[Job], params: SamplingParams) -> AsyncIterator[tuple[int, RequestOutput]]:
        iterators = [self.backend.generate(j.request_id, self.info.name, j.prompt_token_ids, params, j.session) for j in jobs]
        handed = time.perf_counter()
        self._times = {i: JobTimes(self.started, handed, len(j.prompt_token_ids)) for i, j in enumerate(jobs)}
        finished: set[int] = set()
        started: set[int] = set()
        try:
            async for i, out in _merge(iterators):
                self._observe(i, out, params)
                if i not in started and self.admission is not None:
                    started.add(i)
                    self.admission.release()
                if out.finished:
                    finished.add(i)
                yield i, out
        finally:
            self._give_back_places()
            self._count_aborted(set(range(len(jobs))) - finished, params)
            with anyio.CancelScope(shield=True):
                for i, job in enumerate(jobs):
                    if i not in finished:
                        await self.backend.abort(job.request_id)

    def _give_back_places(self) -> None:
        """Queue places still held when the jobs end without having started (idempotent)."""
        if self.admission is not None:
            self.admission.release_all()

    def _count_aborted(self, jobs: set[int], params: SamplingParams) -> None:
        """Jobs cut off after their first tokens (client gone, timeout) finish as `abort`, as in vLLM."""
        for i in jobs:
            times = self._times[i]
            if times.node is not None:
                self.metrics.finished(times, self.info.name, times.node, ["abort"] * max(1, len(times.tokens)),
                                      params.max_tokens)

    def _observe(self, job: int, out: RequestOutput, params: SamplingParams) -> None:
        times, node, model = self._times[job], out.node_id or "local", self.info.name
        times.node = node
        delivered = sum(len(c.token_ids_delta) for c in out.outputs)
        if delivered:
            now = time.perf_counter()
            for c in out.outputs:
                times.tokens[c.index] = times.tokens.get(c.index, 0) + len(c.token_ids_delta)
            if times.first is None:
                times.first = now
                self.metrics.first_tokens(times, model, node)
            else:
                self.metrics.next_tokens(times, now, model, node)
            times.last = now
            self.metrics.tokens.inc(delivered)
        if out.finished:
            reasons = [c.finish_reason or "abort" for c in out.outputs]
            self.metrics.finished(times, model, node, reasons, params.max_tokens)

    async def collect(self, jobs: list[Job], params: SamplingParams, sink: Callable[[int, RequestOutput], None]) -> None:
        """Run to the end, unless the client leaves or time runs out; then abort and raise."""

        async def run() -> None:
            async for i, out in self.outputs(jobs, params):
                sink(i, out)

        work = asyncio.ensure_future(run())
        gone = asyncio.ensure_future(wait_for_disconnect(self.request))
        try:
            done, _ = await asyncio.wait({work, gone}, timeout=self.timeout_s, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not work.done():
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
            self._give_back_places()
        if work in done:
            work.result()
        elif gone in done:
            raise ClientClosedRequest()
        else:
            raise RequestTimedOut(self.timeout_s)

    async def stream(self, jobs: list[Job], params: SamplingParams) -> AsyncIterator[tuple[int, RequestOutput]]:
        """Like `outputs`, raising RequestTimedOut once the deadline passes."""
        loop = asyncio.get_running_loop()
        deadline = None if self.timeout_s is None else loop.time() + self.timeout_s
        events = self.outputs(jobs, params)
        try:
            while True:
                remaining = None if deadline is None else max(deadline - loop.time(), 0.0)
                try:
                    item = await asyncio.wait_for(anext(events), remaining)
                except StopAsyncIteration:
                    return
                except TimeoutError:
                    raise RequestTimedOut(self.timeout_s) from None
                yield item
        finally:
            with anyio.CancelScope(shield=True):
                await events.aclose()

    async def open_stream(self, jobs: list[Job], params: SamplingParams) -> AsyncIterator[tuple[int, RequestOutput]]:
        """`stream`, once its first output is in: errors before it (no node, a refusal,
        the deadline) still get their HTTP status instead of a 200 that carries an error."""
        events = self.stream(jobs, params)
        first = asyncio.ensure_future(anext(events))
        gone = asyncio.ensure_future(wait_for_disconnect(self.request))
        try:
            await asyncio.wait({first, gone}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            gone.cancel()
            if not first.done():
                first.cancel()
                await asyncio.gather(first, return_exceptions=True)
        if first.cancelled():
            await events.aclose()
            self._give_back_places()
            raise ClientClosedRequest()
        try:
            head = first.result()
        except StopAsyncIteration:
            return _replay([], events)
        except BaseException:
            await events.aclose()
            self._give_back_places()
            raise
        return _replay([head], events)


async def _replay(head: list, rest: AsyncIterator) -> AsyncIterator:
    """`head`'s items, then `rest`'s; closes `rest` on exit."""
    try:
        for item in head:
            yield item
        async for item in rest:
            yield item
    finally:
        with anyio.CancelScope(shield=True):
            await rest.aclose()

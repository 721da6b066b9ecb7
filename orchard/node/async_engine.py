"""An asyncio face on the engine: one thread runs `step()`, coroutines stream results.

MLX work is synchronous and heavy, so it must not run on the event loop. The engine
thread owns the engine; coroutines talk to it only through a command queue
(add, abort) and per-request asyncio queues fed with `call_soon_threadsafe`. While it waits
idle, another thread may run a call on the engine itself (`call_here_if_idle`), the engine
thread starting nothing meanwhile.
A consumer that stops iterating (a client gone) aborts its request at once.

A request can instead hand the engine thread an `OutputSink` (`start`): the thread then
gives the sink each step's outputs itself, all of one sink's requests in one call, with no
event loop between the step and the sink. A node's gateway link is such a sink: through the
actor's event loop a first token reached the gateway 0.77 ms after its step on two cores, from
the engine thread 0.41-0.52 ms (docs/benchmarks.md, "Outputs sent by the engine thread").
"""

from __future__ import annotations

import asyncio
import atexit
import logging
import threading
from collections.abc import AsyncIterator, Callable
from typing import Protocol

import mlx.core as mx

from orchard.node.command_queue import CommandQueue
from orchard.node.engine import EngineConfig, LLMEngine
from orchard.node.model.loader import evaluate_held_arrays
from orchard.node.types import RequestOutput, SamplingParams

_IDLE_WAIT_S = 0.05
log = logging.getLogger(__name__)


class EngineStepFailed(RuntimeError):
    """The engine raised inside a step; the requests it held were aborted."""


class OutputSink(Protocol):
    """Where the engine thread hands a request's fate; every method runs on the engine thread and
    must not block it. One sink may serve many requests: a step's outputs of all of them come in
    one `outputs` call."""

    def accepted(self, request_id: str) -> None: ...

    def refused(self, request_id: str, error: Exception) -> None: ...

    def outputs(self, outputs: list[RequestOutput]) -> None: ...

    def failed(self, request_id: str, error: Exception) -> None: ...


class _LoopStream:
    """`generate`'s sink: the request's asyncio queue and acceptance future, fed on their loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop):
        self.loop, self.queue, self.accepted_future = loop, asyncio.Queue(), loop.create_future()

    def accepted(self, request_id: str) -> None:
        self.loop.call_soon_threadsafe(_set_result, self.accepted_future, None)

    def refused(self, request_id: str, error: Exception) -> None:
        self.loop.call_soon_threadsafe(_set_exception, self.accepted_future, error)

    def outputs(self, outputs: list[RequestOutput]) -> None:
        for out in outputs:
            self.loop.call_soon_threadsafe(self.queue.put_nowait, out)

    def failed(self, request_id: str, error: Exception) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, error)


class AsyncEngine:
    def __init__(self, engine: LLMEngine):
        self.engine = engine
        evaluate_held_arrays(engine.model.model)  # the engine thread cannot evaluate this thread's lazy arrays
        self._commands = CommandQueue()
        self._streams: dict[str, OutputSink] = {}  # request id -> its sink; only the engine thread changes it
        self._stopped = threading.Event()
        self._stats: dict = engine.stats()
        self._kv_listeners: list = []
        self._thread = threading.Thread(target=self._run, name="orchard-engine", daemon=True)
        self._thread.start()
        atexit.register(self.shutdown)  # a live MLX thread at interpreter exit aborts the process

    @classmethod
    def from_config(cls, config: EngineConfig | None = None) -> AsyncEngine:
        return cls(LLMEngine(config))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    @property
    def max_model_len(self) -> int:
        return self.engine.max_model_len

    @property
    def model_name(self) -> str:
        return self.engine.model.name

    def add_kv_listener(self, callback) -> None:
        """`callback(events)` runs after each step with that step's KV events, and after each publishing call
        with the call's: on the engine thread, or for a call run while it idled, on the thread that ran it."""
        self._kv_listeners.append(callback)

    async def generate(
        self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None = None,
        on_accepted: Callable[[], None] | None = None,
    ) -> AsyncIterator[RequestOutput]:
        """Stream a request's outputs (deltas); raises the engine's error if it refuses it.

        `on_accepted` runs once the engine has taken the request, before its first output:
        a caller that streams elsewhere can answer "accepted" without waiting for a token."""
        stream = _LoopStream(asyncio.get_running_loop())
        self.start(request_id, prompt_token_ids, params, stream)
        finished = False
        try:
            await stream.accepted_future
            if on_accepted is not None:
                on_accepted()
            while True:
                out = await stream.queue.get()
                if isinstance(out, Exception):
                    raise out
                yield out
                if out.finished:
                    finished = True
                    return
        finally:
            if not finished:
                self.abort_from_thread(request_id)

    def start(self, request_id: str, prompt_token_ids: list[int], params: SamplingParams | None, sink: OutputSink) -> None:
        """Queue a request whose acceptance, outputs and failure the engine thread hands to `sink`
        (callable from any thread; nothing is awaited)."""
        self._commands.put(("add", request_id, list(prompt_token_ids), params or SamplingParams(), sink))

    async def abort(self, request_id: str) -> None:
        self.abort_from_thread(request_id)

    def abort_from_thread(self, request_id: str) -> None:
        """`abort` for a caller that is not a coroutine (any thread: nothing is awaited)."""
        self._commands.put(("abort", request_id))

    async def run_on_engine(self, fn, publish: bool = True, here_if_idle: bool = False):
        """`fn(engine)` on the engine thread between two steps (KV export/import for migration).

        The engine owns its KV cache outright, so this is the only safe way to touch it
        from outside; whatever `fn` raises is raised here. The KV events the call and those
        before it caused go to the listeners before it returns; with `publish` False they wait
        for the next step or publishing call (a pull's reservation goes with its closing call:
        each hand-over is a Ray call from a node actor). With `here_if_idle`, where the engine thread
        waits idle with nothing queued, `fn` runs at once on this, the event loop's, thread
        (`call_here_if_idle`, for the calls it allows): no thread is woken, neither the engine's for the
        call nor the loop's for its answer.
        """
        loop = asyncio.get_running_loop()
        done: asyncio.Future = loop.create_future()
        caller = threading.get_ident()

        def settle(result, exc) -> None:
            setter, value = (_set_result, result) if exc is None else (_set_exception, exc)
            if threading.get_ident() == caller:  # run here: the engine was lent to this thread
                setter(done, value)
            else:
                loop.call_soon_threadsafe(setter, done, value)

        if here_if_idle:
            self.call_here_if_idle(fn, settle, publish)
        else:
            self._commands.put(("call", fn, settle, publish))
        return await done

    def call_from_thread(self, fn, settle, publish: bool = False) -> None:
        """Queue `fn(engine)` from any thread, no event loop involved; `settle(result, exc)` runs
        on the engine thread once it ran (`exc` None unless it raised). Calls run in the order
        queued. A KV stream imports its chunks so, without waking a loop per chunk. The KV events
        a call causes go out with the next step or publishing call (`publish`, or `run_on_engine`;
        a stream ends with one), so a pull of 32 chunks sends the coordinator one batch, not 32,
        while its bytes move."""
        self._commands.put(("call", fn, settle, publish))

    def call_here_if_idle(self, fn, settle, publish: bool = False) -> None:
        """`call_from_thread`, but run on the calling thread at once where the engine thread waits idle with
        nothing queued (`orchard.node.command_queue`), `settle` too: no thread is woken for it. Queued as
        `call_from_thread` queues it otherwise, and from the engine thread itself. Only for calls that make
        no MLX array (bookkeeping, numpy views of evaluated arrays): MLX evaluates an array only on the thread
        whose stream made it."""
        if not self._commands.borrow():
            self.call_from_thread(fn, settle, publish)
            return
        try:
            self._call(fn, settle, publish)
        finally:
            self._commands.give_back()

    def stats(self) -> dict:
        """The last stats the engine thread published (safe from any thread)."""
        return self._stats

    def shutdown(self, timeout: float = 5.0) -> None:
        self._stopped.set()
        self._commands.put(("wake",))
        self._thread.join(timeout)

    # -- engine thread ---------------------------------------------------------------

    def _run(self) -> None:
        try:
            self._warm_up()
            self._loop()
        finally:
            self.engine.close()
            mx.synchronize()  # MLX asks each thread to release its streams before it ends
            mx.clear_streams()

    def _warm_up(self) -> None:
        """Trace the decode graphs in this thread, which replays them; a failure leaves them to
        be traced at first use."""
        try:
            self.engine.warm_up()
        except Exception:
            log.exception("decode graph warm-up failed; graphs will be traced as steps need them")

    def _loop(self) -> None:
        while not self._stopped.is_set():
            self._apply_commands(block=not self.engine.has_unfinished)
            if not self.engine.has_unfinished:
                continue
            try:
                outputs = self.engine.step()
            except Exception as exc:  # a broken step must not leave its callers waiting forever
                self._fail_all(exc)
                continue
            # Stats first: whoever wakes on an output (a heartbeat after a finished request) reads them fresh.
            self._stats = self.engine.stats()
            self._deliver(outputs)
            events = self.engine.drain_kv_events()
            for listener in self._kv_listeners:
                listener(events)

    def _fail_all(self, exc: Exception) -> None:
        """Abort every request in the engine and hand `exc` to each waiting stream."""
        log.exception("engine step failed; aborting %d requests", len(self.engine.requests))
        for request_id in list(self.engine.requests):
            self.engine.abort(request_id)
            self._deliver_error(request_id, EngineStepFailed(f"engine step failed: {exc!r}"))
        try:
            self.engine.step()  # drain the abort outputs nobody will read
        except Exception:
            log.exception("engine step failed again after aborting every request")

    def _deliver_error(self, request_id: str, exc: Exception) -> None:
        stream = self._streams.pop(request_id, None)
        if stream is not None:
            _hand(stream.failed, request_id, exc)

    def _apply_commands(self, block: bool) -> None:
        """Run what is queued, and what is queued meanwhile; waiting for a command first if `block`."""
        commands = self._commands.take(_IDLE_WAIT_S) if block else self._commands.take_nowait()
        while commands:
            for cmd in commands:
                self._apply(cmd)
            commands = self._commands.take_nowait()

    def _apply(self, cmd: tuple) -> None:
        if cmd[0] == "add":
            _, request_id, prompt, params, sink = cmd
            try:
                self.engine.add_request(request_id, prompt, params)
            except Exception as exc:  # refused: hand the named error to the caller
                _hand(sink.refused, request_id, exc)
                return
            self._streams[request_id] = sink
            _hand(sink.accepted, request_id)
        elif cmd[0] == "abort":
            self.engine.abort(cmd[1])  # its final output comes with the next step
            self._stats = self.engine.stats()
        elif cmd[0] == "call":
            self._call(*cmd[1:])

    def _call(self, fn, settle, publish: bool) -> None:
        try:
            result = fn(self.engine)
        except Exception as exc:  # e.g. a refused KV payload: the caller decides what follows
            settle(None, exc)
            return
        if not publish:
            settle(result, None)
            return
        events = self.engine.drain_kv_events()  # an idle engine runs no step that would send them
        for listener in self._kv_listeners:
            listener(events)
        self._stats = self.engine.stats()
        settle(result, None)

    def _deliver(self, outputs: list[RequestOutput]) -> None:
        """A step's outputs to their sinks, one call per sink; a finished request's sink is let go."""
        by_sink: dict[int, tuple[OutputSink, list[RequestOutput]]] = {}
        for out in outputs:
            sink = self._streams.pop(out.request_id, None) if out.finished else self._streams.get(out.request_id)
            if sink is not None:
                by_sink.setdefault(id(sink), (sink, []))[1].append(out)
        for sink, outs in by_sink.values():
            _hand(sink.outputs, outs)


def _hand(method, *args) -> None:
    """Call a sink's method on the engine thread; a sink that raises (its event loop closed, say)
    loses what it was handed, and the engine goes on serving every other request."""
    try:
        method(*args)
    except Exception:
        log.exception("an output sink failed; the engine goes on")


def _set_result(fut: asyncio.Future, value) -> None:
    if not fut.done():
        fut.set_result(value)


def _set_exception(fut: asyncio.Future, exc: BaseException) -> None:
    if not fut.done():
        fut.set_exception(exc)

"""Threads kept idle for work handed to them as it comes: each reply of a KV link's source where cores are few,
each pull's receive loop at its target where they are many.

On a machine of few cores a pull's source sends each reply from a thread other than the connection's
(`orchard.node.serving.kv_link.KVLinkConfig.reply_from_kept_thread`), and on one of more cores a pull's target
reads each connection's reply on a thread other than the one that asked (`KVLinkConfig.receive_on_kept_thread`).
A thread made for the one reply or the one pull costs the starter two wake-ups on the pull's path: Python's
`Thread.start` returns only once the new thread runs. A thread kept idle is handed its next work through a queue:
one wake-up, and the caller goes on at once (docs/benchmarks.md, "## migration").

Daemon threads, made when none is idle and kept for good: a thread blocked in a socket (a peer gone quiet)
never holds the process at exit, which a `concurrent.futures` pool's threads would.
"""

from __future__ import annotations

import queue
import threading
from collections.abc import Callable
from concurrent.futures import Future


class KeptThreads:
    """Run each callable handed to `run` on an idle thread of this set, or a new one where none is idle."""

    def __init__(self, name: str):
        self.name = name  # every thread's
        self._work: queue.SimpleQueue = queue.SimpleQueue()
        self._idle = threading.Semaphore(0)  # one count a thread waiting for work
        self._lock = threading.Lock()
        self.made = 0  # threads made so far

    def run(self, fn: Callable[[], object]) -> Future:
        """`fn()` on one of these threads, at once; its result (or what it raised) in the future returned."""
        done: Future = Future()
        self._work.put((fn, done))
        if not self._idle.acquire(blocking=False):  # none waiting: this one's work needs a thread of its own
            with self._lock:
                self.made += 1
            threading.Thread(target=self._serve, name=self.name, daemon=True).start()
        return done

    def _serve(self) -> None:
        while True:
            fn, done = self._work.get()
            runs = done.set_running_or_notify_cancel()  # False where it was cancelled before it began
            outcome = _outcome(fn) if runs else None
            self._idle.release()  # before the caller hears: the work it hands next finds this thread idle
            if runs:
                _settle(done, *outcome)
            del fn, done, outcome  # hold nothing of it while waiting for the next


def run_on_new_thread(name: str, fn: Callable[[], object]) -> Future:
    """`fn()` on a daemon thread started for it and named `name`, as `KeptThreads.run` runs it on a kept one: its
    result (or what it raised) in the future returned."""
    done: Future = Future()

    def serve() -> None:
        if done.set_running_or_notify_cancel():
            _settle(done, *_outcome(fn))

    threading.Thread(target=serve, name=name, daemon=True).start()
    return done


def _outcome(fn: Callable[[], object]) -> tuple[object, BaseException | None]:
    """(what `fn()` returned, None), or (None, what it raised)."""
    try:
        return fn(), None
    except BaseException as exc:  # noqa: BLE001 - handed to whoever waits on the future
        return None, exc


def _settle(done: Future, result: object, failure: BaseException | None) -> None:
    done.set_exception(failure) if failure is not None else done.set_result(result)

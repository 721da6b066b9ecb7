"""The engine thread's command queue, which also lends the engine to another thread while it waits idle.

A call queued for an idle engine thread costs two thread wake-ups before its caller has the answer: the
engine thread's, to run it, then the caller's, to take the answer. On two cores a direct KV pull paid
that twice on its path, once for the source's pin and once for the target's closing call, each waiting
for a core the transfer's threads held (docs/benchmarks.md, "## migration"). Where the engine thread waits
with nothing queued, a caller may run its call on its own thread instead (`borrow`, then `give_back`).
Calls still run one at a time and in the order each thread made them:

- a loan is made only while the engine thread waits in `take` with nothing queued, so every command
  queued before it has run;
- `take` returns nothing while the engine is lent, so the engine thread starts no command or step
  until the loan ends.

Ending a loan wakes the engine thread only where commands were queued during it. Woken otherwise, it would
find nothing and wait again, but on two cores the wake-up took the core from the thread that ended the loan,
a pull's sender with the end of its reply still to send (docs/benchmarks.md, "## migration"). An engine thread
whose wait timed out during a loan looks again each `timeout_s` until the loan ends, and then takes nothing.
"""

from __future__ import annotations

import threading
from collections import deque


class CommandQueue:
    """Commands for the engine thread, in order; `borrow` lends the engine to another thread while it waits."""

    def __init__(self):
        self._ready = threading.Condition(threading.Lock())
        self._queue: deque = deque()
        self._idle = False  # the engine thread waits in `take`
        self._lent = False  # another thread runs a call on the engine (`borrow` to `give_back`)

    def put(self, command) -> None:
        """Queue `command` (any thread)."""
        with self._ready:
            self._queue.append(command)
            self._ready.notify()

    def take(self, timeout_s: float) -> list:
        """Every command queued, waiting up to `timeout_s` for one (engine thread, idle); while the engine is
        lent, none until the loan ends, however long that takes."""
        with self._ready:
            self._idle = True
            self._ready.wait_for(lambda: self._queue and not self._lent, timeout_s)
            while self._lent:  # timed out during a loan: nothing is taken until it ends
                self._ready.wait(timeout_s)
            self._idle = False
            return self._drain()

    def take_nowait(self) -> list:
        """Every command queued, maybe none (engine thread, stepping)."""
        with self._ready:
            return self._drain()

    def borrow(self) -> bool:
        """Whether the engine is now lent to the calling thread, which must `give_back` once its call ran:
        only while the engine thread waits in `take` with nothing queued and no other loan made."""
        with self._ready:
            if not self._idle or self._lent or self._queue:
                return False
            self._lent = True
            return True

    def give_back(self) -> None:
        """End the loan `borrow` made: the engine thread may take commands again, and is woken where there are
        any to take."""
        with self._ready:
            self._lent = False
            if self._queue:
                self._ready.notify_all()

    def _drain(self) -> list:
        commands = list(self._queue)
        self._queue.clear()
        return commands

"""The engine thread's command queue lends the engine only while that thread idles with nothing queued."""

from __future__ import annotations

import threading
import time

from orchard.node.command_queue import CommandQueue


def waiting_in_take(queue: CommandQueue, timeout_s: float = 5.0):
    """A thread that takes from `queue` once (as an idle engine thread does); its answer lands in the list."""
    taken: list = []
    thread = threading.Thread(target=lambda: taken.append(queue.take(timeout_s)), daemon=True)
    thread.start()
    return thread, taken


def borrow_once_idle(queue: CommandQueue, within_s: float = 2.0) -> bool:
    deadline = time.monotonic() + within_s
    while time.monotonic() < deadline:
        if queue.borrow():
            return True
        time.sleep(0.001)
    return False


def test_nothing_is_lent_unless_the_engine_thread_waits_in_take():
    queue = CommandQueue()
    assert not queue.borrow()  # the engine thread is stepping (or not started): it owns the engine
    assert queue.take_nowait() == []


def test_take_returns_nothing_while_the_engine_is_lent_and_the_commands_queued_meanwhile_after():
    queue = CommandQueue()
    thread, taken = waiting_in_take(queue)
    assert borrow_once_idle(queue)
    assert not queue.borrow()  # one loan at a time
    queue.put("after the loan")
    thread.join(0.2)
    assert thread.is_alive() and taken == []  # a command is queued, but the engine is lent
    queue.give_back()
    thread.join(2.0)
    assert taken == [["after the loan"]]


class CountingCondition(threading.Condition):
    """A condition that counts the wake-ups it sends."""

    def __init__(self):
        super().__init__(threading.Lock())
        self.wakes = 0

    def notify(self, n: int = 1) -> None:
        self.wakes += 1
        super().notify(n)

    def notify_all(self) -> None:
        self.wakes += 1
        super().notify_all()


def test_a_loan_ended_with_nothing_queued_leaves_the_waiting_engine_thread_asleep():
    queue = CommandQueue()
    queue._ready = counting = CountingCondition()
    thread, taken = waiting_in_take(queue)
    assert borrow_once_idle(queue)
    queue.give_back()
    assert counting.wakes == 0  # nothing to take: the engine thread is not woken to find that out
    assert thread.is_alive() and taken == []
    queue.put("next")
    thread.join(2.0)
    assert taken == [["next"]] and counting.wakes == 1


def test_an_engine_waiting_past_its_timeout_while_lent_takes_nothing_until_the_loan_ends():
    queue = CommandQueue()
    thread, taken = waiting_in_take(queue, timeout_s=0.01)
    assert borrow_once_idle(queue)
    thread.join(0.1)
    assert thread.is_alive()  # its timeout passed: it still waits for the loan to end
    queue.give_back()
    thread.join(2.0)
    assert taken == [[]]


def test_take_times_out_with_nothing_and_hands_over_everything_queued_in_order():
    queue = CommandQueue()
    assert queue.take(0.01) == []
    for n in range(3):
        queue.put(n)
    assert queue.take(1.0) == [0, 1, 2] and queue.take_nowait() == []

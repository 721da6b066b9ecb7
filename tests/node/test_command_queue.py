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

    def __init__(self, lock):
        super().__init__(lock)
        self.wakes = 0

    def notify(self, n: int = 1) -> None:
        self.wakes += 1
        super().notify(n)

    def notify_all(self) -> None:
        self.wakes += 1
        super().notify_all()


def test_a_loan_ended_with_nothing_queued_leaves_the_waiting_engine_thread_asleep():
    queue = CommandQueue()
    queue._ready = counting = CountingCondition(queue._lock)
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


def borrow_on_thread(queue: CommandQueue, wait_s: float):
    """A thread that borrows once, waiting up to `wait_s` for another's loan to end; whether it got the engine
    lands in the list, and it gives the loan back at once."""
    got: list = []

    def borrow():
        lent = queue.borrow(wait_s)
        got.append(lent)
        if lent:
            queue.give_back()

    thread = threading.Thread(target=borrow, daemon=True)
    thread.start()
    return thread, got


def test_a_thread_waiting_for_anothers_loan_gets_the_engine_once_it_ends_and_the_engine_thread_sleeps_on():
    queue = CommandQueue()
    queue._ready = counting = CountingCondition(queue._lock)
    engine_thread, taken = waiting_in_take(queue)
    assert borrow_once_idle(queue)
    waiter, got = borrow_on_thread(queue, wait_s=5.0)
    waiter.join(0.1)
    assert waiter.is_alive() and got == []  # the engine is lent to this thread: the waiter waits
    queue.give_back()
    waiter.join(2.0)
    assert got == [True]  # lent to the waiter, not queued for the engine thread
    assert counting.wakes == 0 and engine_thread.is_alive() and taken == []
    queue.put("stop")
    engine_thread.join(2.0)


def test_a_thread_waiting_for_a_loan_leaves_a_command_queued_meanwhile_to_run_first():
    queue = CommandQueue()
    engine_thread, taken = waiting_in_take(queue)
    assert borrow_once_idle(queue)
    waiter, got = borrow_on_thread(queue, wait_s=5.0)
    waiter.join(0.05)
    queue.put("queued while lent")
    queue.give_back()
    waiter.join(2.0)
    engine_thread.join(2.0)
    assert got == [False] and taken == [["queued while lent"]]


def test_a_wait_for_a_loan_gives_up_after_its_time_and_a_loan_is_never_waited_for_without_one():
    queue = CommandQueue()
    engine_thread, _ = waiting_in_take(queue)
    assert borrow_once_idle(queue)
    started = time.monotonic()
    assert not queue.borrow()  # no wait asked: refused at once
    waiter, got = borrow_on_thread(queue, wait_s=0.05)
    waiter.join(2.0)
    assert got == [False] and time.monotonic() - started >= 0.05
    assert not queue.borrow(wait_s=5.0)  # the thread holding the loan does not wait for itself
    assert time.monotonic() - started < 2.0
    queue.give_back()
    queue.put("stop")
    engine_thread.join(2.0)

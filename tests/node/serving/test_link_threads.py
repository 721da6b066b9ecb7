"""The link's kept threads: work handed to an idle thread, a new one only where none is idle; and work on a thread
started for it, answered alike."""

from __future__ import annotations

import threading

import pytest

from orchard.node.serving.link_threads import KeptThreads, run_on_new_thread


def test_work_runs_on_a_named_daemon_thread_and_its_result_or_failure_comes_back():
    threads = KeptThreads("worker")
    ran = threads.run(lambda: threading.current_thread()).result(5)
    assert ran is not threading.current_thread() and ran.name == "worker" and ran.daemon
    with pytest.raises(ValueError, match="refused"):
        threads.run(lambda: (_ for _ in ()).throw(ValueError("refused"))).result(5)
    assert threads.run(lambda: threading.current_thread()).result(5) is ran  # the one thread, kept
    assert threads.made == 1


def test_work_handed_while_every_thread_is_busy_gets_a_thread_of_its_own():
    threads, release = KeptThreads("worker"), threading.Event()
    busy = [threads.run(lambda: release.wait() and threading.current_thread()) for _ in range(3)]  # none idle
    assert threads.made == 3
    release.set()
    three = {f.result(5) for f in busy}
    assert len(three) == 3  # a thread each
    later = {threads.run(lambda: threading.current_thread()).result(5) for _ in range(5)}
    assert threads.made == 3 and later <= three  # one at a time, each on one of those, kept idle


def test_work_on_a_thread_started_for_it_comes_back_as_kept_threads_give_it():
    first = run_on_new_thread("worker", lambda: threading.current_thread()).result(5)
    assert first is not threading.current_thread() and first.name == "worker" and first.daemon
    assert run_on_new_thread("worker", lambda: threading.current_thread()).result(5) is not first  # one each
    with pytest.raises(ValueError, match="refused"):
        run_on_new_thread("worker", lambda: (_ for _ in ()).throw(ValueError("refused"))).result(5)

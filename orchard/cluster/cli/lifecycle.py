"""Shared by long-running commands (`orchard head`, `orchard join`): stop cleanly on a signal."""

from __future__ import annotations

import logging
import signal
import threading

log = logging.getLogger("orchard")


def stop_on_signals(what: str) -> threading.Event:
    """An event set by SIGTERM or SIGINT, logging `what` the command does then (e.g. "stopping the head")."""
    stop = threading.Event()

    def handler(signum, frame) -> None:
        log.info("%s: %s", signal.Signals(signum).name, what)
        stop.set()

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
    return stop

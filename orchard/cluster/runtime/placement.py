"""The loop that gives every machine joining the cluster later its node actor.

`orchard head` runs it in a process of its own with detached actors, which outlive it;
`deploy/serve.py` runs it in a thread of its driver, whose actors end with the driver.
Placing itself (one actor per `orchard_node` machine, pinned to it) is `ray_cluster.place_node_actors`.
"""

from __future__ import annotations

import logging
import threading

from orchard.cluster.runtime.ray_cluster import place_node_actors

log = logging.getLogger("orchard.placement")


class Placer:
    """Every `every_s` seconds, a node actor on each serving machine that has none."""

    def __init__(self, engine_config, every_s: float, *, detached: bool = False):
        self._engine_config = engine_config
        self._every_s = every_s
        self._detached = detached
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._last_error = ""

    def place_once(self) -> None:
        try:
            for node_id in place_node_actors(self._engine_config, detached=self._detached):
                log.info("node %s joined: its node actor is serving", node_id)
            self._last_error = ""
        except Exception as exc:  # a machine that left mid-placement; the next round retries
            if str(exc) != self._last_error:
                log.warning("placing node actors failed: %s", exc)
            self._last_error = str(exc)

    def run(self) -> None:
        """Until `stop()`: wait a period, place, again."""
        while not self._stop.wait(self._every_s):
            self.place_once()

    def start(self) -> None:
        """`run` in a daemon thread; a period of 0 or less places nothing."""
        if self._every_s > 0:
            self._thread = threading.Thread(target=self.run, name="orchard-placer", daemon=True)
            self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        if self._thread is not None and self._thread.is_alive():
            self._thread.join(timeout=30)

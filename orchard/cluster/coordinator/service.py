"""The coordinator as the cluster's named Ray actor: `Coordinator`, plus the route link's listener.

With one `async` method (`route_link`) it is an asyncio actor: Ray runs its synchronous methods
on the actor's event loop one at a time, and the link's calls (`orchard.cluster.coordinator.route_link`)
run on the same loop, so the coordinator's state still needs no locks.
"""

from __future__ import annotations

import asyncio

import ray

from orchard.cluster.coordinator.coordinator import Coordinator, CoordinatorConfig
from orchard.cluster.coordinator.route_link import RouteLinkServer, route_link_key


class CoordinatorService(Coordinator):
    """The coordinator as Ray runs it: also answers `route` on its link, once asked where that is."""

    def __init__(self, config: CoordinatorConfig | None = None):
        super().__init__(config)
        self._route_link: RouteLinkServer | None = None

    async def route_link(self) -> str:
        """The link's "host:port", listening from the first call on; "" without the cluster's key."""
        if self._route_link is None:
            key = route_link_key(self.config.link_token)
            if key is None:
                return ""
            self._route_link = RouteLinkServer(key, self, asyncio.get_running_loop(), ray.util.get_node_ip_address())
            self._route_link.start()
        return self._route_link.address


CoordinatorActor = ray.remote(CoordinatorService)

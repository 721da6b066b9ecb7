"""Two raylets in two hosts of the namespace rig: the head in host a's namespace, a worker in b's.

`LocalCluster` starts each raylet as a child of the driver, and a child is born in the
network namespace of the thread that forks it; so the driver's main thread lives in a's
namespace, and steps into b's only while it starts the worker. Each raylet is told its
host's private address (Ray's own guess needs a default route, which the rig has none of),
and Ray's traffic between them, object transfers included, crosses the shaped veths.
Whatever Ray listens on is inside the namespaces; `rig_cluster` stops Ray, then removes
the rig, whatever happened.
"""

from __future__ import annotations

import tempfile
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

from orchard.cluster.bench.netns import LINKS, NetLab, RawTCP, enter, unavailable
from orchard.cluster.runtime.ray_cluster import NODE_RESOURCE, LocalCluster

HOSTS = {"a": "2", "b": "3"}


@dataclass
class RigCluster(LocalCluster):
    """A `LocalCluster` whose head raylet is host a and whose workers are host b."""

    lab: NetLab | None = None

    def add_node(self):
        enter(self.lab.ns("b"))
        try:
            node = self._cluster.add_node(num_cpus=self.cpus_per_node, resources={NODE_RESOURCE: 1},
                                          object_store_memory=self.object_store_mb << 20,
                                          node_ip_address=self.lab.hosts["b"])
        finally:
            enter(self.lab.ns("a"))
        self._workers.append(node)
        return node

    def _address_args(self) -> dict:
        return {"node_ip_address": self.lab.hosts["a"]}


@contextmanager
def rig_cluster(link: str, tcp_mib: int, object_store_mb: int = 400):
    """(cluster, raw, qdisc): the two raylets over `link`, raw TCP's readings from a to b (`RawTCP`), and
    the qdisc in force."""
    reason = unavailable()
    if reason:
        raise SystemExit(f"the namespace rig cannot be built here: {reason}")
    with tempfile.TemporaryDirectory(prefix="orchard-links-") as workdir, NetLab(Path(workdir)) as lab:
        lab.build(HOSTS)
        lab.shape(LINKS[link])
        enter(lab.ns("a"))  # the driver, and every raylet it starts, on host a (module docstring)
        raw = RawTCP.across(lab, "a", "b", tcp_mib << 20)
        with RigCluster(cpus_per_node=1, object_store_mb=object_store_mb, lab=lab).start(extra_nodes=1) as local:
            _check_addresses(set(lab.hosts.values()))
            yield local, raw, lab.qdisc("a")


def _check_addresses(expected: set[str]) -> None:
    """Each raylet at its own host's address: else the bench would not be measuring the link."""
    import ray

    found = {n["NodeManagerAddress"] for n in ray.nodes() if n.get("Alive")}
    if found != expected:
        raise RuntimeError(f"raylets at {sorted(found)}, expected {sorted(expected)}")

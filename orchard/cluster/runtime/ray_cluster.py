"""Start or attach to Ray, deploy the coordinator, and pin one node actor to each serving machine.

A machine serves when its raylet advertises the `orchard_node` custom resource; each node
actor asks for one unit of it and is placed with hard node affinity on that raylet, so
there is exactly one engine per machine and it never wanders. `LocalCluster` starts
several real raylets on this machine (separate processes, each its own Ray node), which is
how the multi-node tests and `orchard bench cluster` run without more hardware; it keeps
Ray's temp dir private so no other Ray user on the machine can attach to it by accident.
"""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from dataclasses import dataclass, field

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from orchard.cluster.coordinator.coordinator import COORDINATOR_NAME, NAMESPACE, CoordinatorConfig
from orchard.cluster.coordinator.service import CoordinatorActor

NODE_RESOURCE = "orchard_node"
NODE_ACTOR_PREFIX = "orchard-node-"
_READY_PROBE_S = 2.0  # a node actor silent this long is loading its model, not dead

# Handles of the node actors this process started: a non-detached actor lives only while
# some handle to it does, and callers should not have to remember that.
_started_actors: dict[str, object] = {}


def node_actor_name(node_id: str) -> str:
    return NODE_ACTOR_PREFIX + node_id


def default_node_id(ray_node_id: str) -> str:
    """A short, stable name for the machine behind a Ray node id."""
    return ray_node_id[:8]


def connect(address: str | None = None) -> None:
    """Join the cluster at `address` ("auto" for the local one) in the orchard namespace; Ray's
    own INFO chatter ("Connecting to existing Ray cluster...") stays out of the CLI's output."""
    if not ray.is_initialized():
        os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")
        ray.init(address=address, namespace=NAMESPACE, log_to_driver=False, logging_level=logging.WARNING)


def ensure_coordinator(config: CoordinatorConfig | None = None):
    """The cluster's coordinator, created (detached, restarted by Ray on failure) if missing.

    It lives on the head (whose loss ends the cluster anyway), also across restarts, so
    that losing a serving node never takes the coordinator and the index with it.
    """
    head = _head_ray_node_id()
    placement = NodeAffinitySchedulingStrategy(head, soft=False) if head else None
    return CoordinatorActor.options(
        scheduling_strategy=placement,
        name=COORDINATOR_NAME,
        namespace=NAMESPACE,
        lifetime="detached",
        get_if_exists=True,
        max_restarts=-1,
        num_cpus=0,
        runtime_env=SERVING_RUNTIME_ENV,
    ).remote(config or CoordinatorConfig())


#: Ray starts worker processes at niceness 15, below its own daemons, the gateway and every other program
#: on the machine; the engine's node actor and the coordinator are on every request's path, so they run at
#: the default priority (Ray honours the variable per actor, as its job manager does for job supervisors).
SERVING_RUNTIME_ENV = {"env_vars": {"RAY_worker_niceness": "0"}}


def _head_ray_node_id() -> str | None:
    for node in ray.nodes():
        if node.get("Alive") and "node:__internal_head__" in node.get("Resources", {}):
            return node["NodeID"]
    return None


def serving_ray_nodes() -> list[dict]:
    """Live Ray nodes that advertise `orchard_node`."""
    return [n for n in ray.nodes() if n.get("Alive") and n.get("Resources", {}).get(NODE_RESOURCE, 0) >= 1]


def start_node_actor(ray_node_id: str, node_config, *, detached: bool = False):
    """Create the node actor for one machine and wait until it has registered.

    `node_config` is a `orchard.node.serving.actor.NodeActorConfig`; the actor is named after its node id.
    Unless `detached`, it lives as long as this process (which keeps a handle to it).
    """
    from orchard.node.serving.actor import NodeActorRemote

    options = dict(
        name=node_actor_name(node_config.node_id),
        namespace=NAMESPACE,
        num_cpus=0,
        resources={NODE_RESOURCE: 1},
        scheduling_strategy=NodeAffinitySchedulingStrategy(ray_node_id, soft=False),
        runtime_env=SERVING_RUNTIME_ENV,
    )
    if detached:
        options["lifetime"] = "detached"
    actor = NodeActorRemote.options(**options).remote(node_config)
    ray.get(actor.start.remote())
    _started_actors[node_config.node_id] = actor
    return actor


def node_actor_config(node_id: str, engine_config, **options):
    """The actor's config; a cold tier gets a folder per node, since nodes sharing a machine
    cannot share one file (each locks its own)."""
    from dataclasses import replace as with_changes
    from pathlib import Path

    from orchard.node.serving.actor import NodeActorConfig

    if engine_config.cold_tier_dir:
        engine_config = with_changes(engine_config, cold_tier_dir=str(Path(engine_config.cold_tier_dir) / node_id))

    return NodeActorConfig(node_id, COORDINATOR_NAME, NAMESPACE, engine_config, **options)


def place_node_actors(engine_config, *, detached: bool = False, **options) -> dict[str, object]:
    """One node actor on every serving Ray node that has none alive; returns the new ones by node id."""
    started = {}
    for ray_node in serving_ray_nodes():
        node_id = default_node_id(ray_node["NodeID"])
        if not node_actor_wanted(node_id):
            continue
        config = node_actor_config(node_id, engine_config, **options)
        started[node_id] = start_node_actor(ray_node["NodeID"], config, detached=detached)
    return started


def node_actor_wanted(node_id: str) -> bool:
    """Whether `node_id` needs a node actor: none has its name, or only a dead one whose name is freed here.

    Ray keeps a dead actor's name, and answers `get_actor` with the dead actor, for as long
    as its creator holds the handle it was created with; dropping that handle frees the
    name for the replacement. One that does not answer yet is still loading its model.
    """
    name = node_actor_name(node_id)
    try:
        actor = ray.get_actor(name, namespace=NAMESPACE)
    except ValueError:
        return True
    try:
        ray.get(actor.__ray_ready__.remote(), timeout=_READY_PROBE_S)
        return False
    except ray.exceptions.GetTimeoutError:
        return False
    except ray.exceptions.RayActorError:
        del actor
        _started_actors.pop(node_id, None)
        return _name_freed(name)


def _name_freed(name: str, patience_s: float = 5.0) -> bool:
    """Whether Ray lets go of `name` within `patience_s` (another process may hold the first handle)."""
    deadline = time.monotonic() + patience_s
    while time.monotonic() < deadline:
        try:
            ray.get_actor(name, namespace=NAMESPACE)
        except ValueError:
            return True
        time.sleep(0.1)
    return False


# Fast failure detection for local clusters: a killed raylet is noticed in ~2 s, not ~30 s.
_LOCAL_SYSTEM_CONFIG = {
    "health_check_initial_delay_ms": 0,
    "health_check_period_ms": 500,
    "health_check_failure_threshold": 4,
}


@dataclass
class LocalCluster:
    """Several raylets on this machine, each a separate Ray node with `orchard_node`.

    The head raylet hosts the coordinator and (when `head_serves`) a node too. Use as a
    context manager: everything it started is stopped on exit.
    """

    cpus_per_node: int = 1
    head_serves: bool = True
    object_store_mb: int = 80
    loopback: bool = False  # every raylet on 127.0.0.1 only (needs `ray_access.require_token_auth(loopback=True)`)
    _cluster: object = None
    _workers: list = field(default_factory=list)
    _tmpdir: str = ""
    _saved_env: dict = field(default_factory=dict)

    def start(self, extra_nodes: int) -> LocalCluster:
        from ray.cluster_utils import Cluster

        self._isolate()
        head_resources = {NODE_RESOURCE: 1} if self.head_serves else {}
        self._cluster = Cluster(
            initialize_head=True,
            head_node_args=dict(
                num_cpus=self.cpus_per_node,
                resources=head_resources,
                object_store_memory=self.object_store_mb << 20,
                include_dashboard=False,
                _system_config=_LOCAL_SYSTEM_CONFIG,
                **self._address_args(),
            ),
        )
        for _ in range(extra_nodes):
            self.add_node()
        self._cluster.wait_for_nodes()
        ray.init(address=self._cluster.address, namespace=NAMESPACE, log_to_driver=False)
        return self

    def add_node(self):
        node = self._cluster.add_node(
            num_cpus=self.cpus_per_node,
            resources={NODE_RESOURCE: 1},
            object_store_memory=self.object_store_mb << 20,
            **self._address_args(),
        )
        self._workers.append(node)
        return node

    def _address_args(self) -> dict:
        """Loopback raylets, once Ray has been told to keep a loopback address (see `orchard.cluster.runtime.ray_access`)."""
        if not self.loopback:
            return {}
        from ray._private import ray_constants

        if ray_constants.ENABLE_RAY_CLUSTER:
            raise RuntimeError("a loopback LocalCluster needs ray_access.require_token_auth(loopback=True) before Ray is imported")
        return {"node_ip_address": "127.0.0.1"}

    def kill_node(self, node) -> None:
        """Kill a worker raylet and everything on it, as a crashed machine would."""
        self._cluster.remove_node(node, allow_graceful=False)
        self._workers.remove(node)

    @property
    def head_ray_node_id(self) -> str:
        return self._cluster.head_node.node_id

    @property
    def worker_nodes(self) -> list:
        return list(self._workers)

    @property
    def address(self) -> str:
        return self._cluster.address

    def shutdown(self) -> None:
        _started_actors.clear()
        try:
            if ray.is_initialized():
                ray.shutdown()
        finally:
            if self._cluster is not None:
                self._cluster.shutdown()
                self._cluster = None
            self._restore_env()
            shutil.rmtree(self._tmpdir, ignore_errors=True)

    def __enter__(self) -> LocalCluster:
        return self

    def __exit__(self, *exc) -> None:
        self.shutdown()

    def _isolate(self) -> None:
        """Private temp dir (short: raylet socket paths have a length limit) and no telemetry."""
        self._tmpdir = tempfile.mkdtemp(prefix="orc-", dir="/tmp")
        for key, value in {"RAY_TMPDIR": self._tmpdir, "RAY_USAGE_STATS_ENABLED": "0"}.items():
            self._saved_env[key] = os.environ.get(key)
            os.environ[key] = value

    def _restore_env(self) -> None:
        for key, value in self._saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value
        self._saved_env = {}

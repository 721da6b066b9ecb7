"""The join agent: keeps this machine in the cluster as a Ray worker node.

It runs `ray start --address HEAD --block` as a child process, so stopping the node stops
exactly the Ray processes this agent started (a machine-wide `ray stop` would also kill
any other Ray on the machine). The agent does not know how the head was found: whoever
runs it (`orchard join`) reports sightings with `head_seen` — from verified zeroconf
advertisements or a fixed `--head` address — and the agent reconciles:

- no Ray child and a head is known: start one (after a backoff if the last one failed);
- the head restarted (a new `head_id`) or moved: stop the child, join the new head;
- the child exited by itself (the head died, the network broke): back off, retry;
- stop requested (SIGTERM): drain through the caller's hook, then stop the child.

The node carries the `orchard_node` resource, which is where the coordinator places node
actors, and Ray labels for its chip, memory and MLX device.
"""

from __future__ import annotations

import json
import logging
import os
import re
import secrets
import shutil
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

ORCHARD_NODE_RESOURCE = "orchard_node"
LABEL_CHIP = "orchard/chip"
LABEL_MEMORY = "orchard/memory-gib"
LABEL_DEVICE = "orchard/mlx-device"
#: Set by `orchard join --cold-tier` in its raylet's environment (Ray's workers inherit it):
#: this machine's own cold tier, which `orchard.node.serving.actor.local_engine_config` puts in place of the
#: cluster's engine setting for the node actors on this machine.
COLD_TIER_DIR_ENV = "ORCHARD_COLD_TIER_DIR"
COLD_TIER_GB_ENV = "ORCHARD_COLD_TIER_GB"
LABEL_AGENT = "orchard/agent"  # random per agent: lets it find its own Ray node among many
STATIC_HEAD_ID = "static"

log = logging.getLogger("orchard.agent")


class RayNotFound(RuntimeError):
    """The `ray` command line tool is not installed next to this Python or on PATH."""


@dataclass(frozen=True)
class HeadSighting:
    """Where the head's Ray listens; `head_id` changes when the head restarts."""

    ray_address: str
    head_id: str = STATIC_HEAD_ID


@dataclass(frozen=True)
class AgentConfig:
    num_cpus: int | None = None
    node_ip: str | None = None  # Ray picks the address that reaches the head when None
    ray_temp_dir: str | None = None
    object_store_memory: int | None = None  # bytes
    extra_labels: dict[str, str] = field(default_factory=dict)
    cold_tier_dir: str | None = None  # this machine's own cold tier, for its node actor's engine
    cold_tier_gb: float = 4.0
    stop_grace_s: float = 20.0
    backoff_initial_s: float = 1.0
    backoff_max_s: float = 30.0
    poll_s: float = 0.25


# ---- describing this machine --------------------------------------------------------
def label_value(text: str) -> str:
    """Ray label values: <=63 chars of [A-Za-z0-9_.-], alphanumeric at both ends."""
    value = re.sub(r"[^A-Za-z0-9_.-]+", "-", text).strip("-_.")[:63].rstrip("-_.")
    return value or "unknown"


def chip_name() -> str:
    if sys.platform == "darwin":
        try:
            out = subprocess.run(["sysctl", "-n", "machdep.cpu.brand_string"], capture_output=True, text=True,
                                 timeout=5)
            if out.returncode == 0 and out.stdout.strip():
                return out.stdout.strip()
        except OSError:
            pass
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    import platform

    return platform.machine() or "unknown"


def memory_gib() -> int:
    return round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30)


def mlx_device() -> str:
    """metal, cuda or cpu: what MLX will compute on here; `none` when MLX is missing."""
    try:
        import mlx.core as mx
    except ImportError:
        return "none"
    if mx.metal.is_available():
        return "metal"
    cuda = getattr(mx, "cuda", None)
    if cuda is not None and cuda.is_available():
        return "cuda"
    return "cpu"


def node_labels(extra: dict[str, str] | None = None) -> dict[str, str]:
    labels = {
        LABEL_CHIP: label_value(chip_name()),
        LABEL_MEMORY: str(memory_gib()),
        LABEL_DEVICE: mlx_device(),
    }
    labels.update({k: label_value(v) for k, v in (extra or {}).items()})
    return labels


# ---- the Ray command ----------------------------------------------------------------
def ray_executable() -> str:
    beside = Path(sys.executable).parent / "ray"
    if beside.exists():
        return str(beside)
    found = shutil.which("ray")
    if not found:
        raise RayNotFound("the `ray` command is not installed; pip install 'ray[default]'")
    return found


def ray_start_command(config: AgentConfig, head: HeadSighting, labels: dict[str, str],
                      ray: str | None = None) -> list[str]:
    cmd = [
        ray or ray_executable(), "start", "--block",
        "--address", head.ray_address,
        "--resources", json.dumps({ORCHARD_NODE_RESOURCE: 1}),
        "--labels", ",".join(f"{k}={v}" for k, v in sorted(labels.items())),
        "--disable-usage-stats",
    ]
    if config.num_cpus is not None:
        cmd += ["--num-cpus", str(config.num_cpus)]
    if config.node_ip:
        cmd += ["--node-ip-address", config.node_ip]
    if config.ray_temp_dir:
        cmd += ["--temp-dir", config.ray_temp_dir]
    if config.object_store_memory:
        cmd += ["--object-store-memory", str(config.object_store_memory)]
    return cmd


def ray_environment(ray_token: str | None, base: dict[str, str] | None = None,
                    config: AgentConfig | None = None) -> dict[str, str]:
    """The child's environment: Ray token authentication on when there is a token, and this
    machine's cold tier for the node actor (Ray's workers inherit the raylet's environment;
    the path never leaves the machine)."""
    env = dict(os.environ if base is None else base)
    if config is not None and config.cold_tier_dir:
        env[COLD_TIER_DIR_ENV] = str(Path(config.cold_tier_dir).expanduser().resolve())
        env[COLD_TIER_GB_ENV] = repr(float(config.cold_tier_gb))
    env.setdefault("RAY_USAGE_STATS_ENABLED", "0")
    # Ray's own drain on SIGTERM waits for every lease to return, which a node actor never
    # does; orchard drains through the coordinator before it stops Ray instead.
    env.setdefault("RAY_GRACEFUL_SHUTDOWN_DRAIN_TIMEOUT_S", "0")
    if ray_token:
        env["RAY_AUTH_MODE"] = "token"
        env["RAY_AUTH_TOKEN"] = ray_token
        env.pop("RAY_AUTH_TOKEN_PATH", None)
    return env


# ---- the agent ----------------------------------------------------------------------
class JoinAgent:
    """Reconciles "the head I know of" with "the Ray node I run"; see the module doc."""

    def __init__(self, config: AgentConfig, ray_token: str | None = None,
                 drain: Callable[[], None] | None = None, labels: dict[str, str] | None = None,
                 spawn: Callable[..., subprocess.Popen] = subprocess.Popen, clock: Callable[[], float] = time.monotonic):
        self.config = config
        self._env = ray_environment(ray_token, config=config)
        self._drain = drain
        self._labels = labels if labels is not None else node_labels(config.extra_labels)
        self._spawn = spawn
        self._clock = clock
        self._lock = threading.Lock()
        self._latest: HeadSighting | None = None
        self._joined: HeadSighting | None = None
        self._child: subprocess.Popen | None = None
        self._backoff_s = config.backoff_initial_s
        self._retry_at = 0.0
        self._started_at = 0.0
        self.instance_id = secrets.token_hex(6)
        self.joins = 0  # how many times a Ray node was started, for status and tests

    # ---- called by whoever finds the head (any thread) ------------------------------
    def head_seen(self, head: HeadSighting) -> None:
        with self._lock:
            if self._latest != head:
                log.info("head at %s (head id %s)", head.ray_address, head.head_id)
                if self._latest is None or self._latest.head_id != head.head_id:
                    self._retry_at = 0.0  # a new head: try at once, not after the old backoff
                    self._backoff_s = self.config.backoff_initial_s
            self._latest = head

    def head_gone(self) -> None:
        with self._lock:
            self._latest = None

    @property
    def joined(self) -> HeadSighting | None:
        return self._joined if self._child is not None else None

    # ---- the loop -------------------------------------------------------------------
    def run(self, stop: threading.Event) -> int:
        """Reconcile until `stop` is set, then drain and leave."""
        try:
            while not stop.wait(self.config.poll_s):
                self.reconcile()
        finally:
            self.leave()
        return 0

    def reconcile(self) -> None:
        with self._lock:
            latest = self._latest
        if self._child is not None and self._child.poll() is not None:
            log.warning("Ray node exited with status %s; will join again", self._child.returncode)
            self._child = None
            self._schedule_retry()
        if self._child is not None and self._clock() - self._started_at > self.config.backoff_max_s:
            self._backoff_s = self.config.backoff_initial_s  # it stayed up: the next failure is news
        if self._child is not None and latest is not None and latest != self._joined:
            log.info("head changed (%s -> %s); joining again", self._joined, latest)
            self._stop_child()
        if self._child is None and latest is not None and self._clock() >= self._retry_at:
            self._start_child(latest)

    def leave(self) -> None:
        """Drain (so in-flight requests finish elsewhere or here), then stop Ray."""
        if self._child is None:
            return
        if self._drain is not None:
            try:
                self._drain()
            except Exception:  # the head may be gone already; leaving must still work
                log.exception("drain before leaving failed; stopping anyway")
        self._stop_child()

    def _start_child(self, head: HeadSighting) -> None:
        cmd = ray_start_command(self.config, head, {**self._labels, LABEL_AGENT: self.instance_id})
        log.info("joining: %s", " ".join(cmd))
        # Its own process group, so a kill on escalation reaches the Ray processes it spawned.
        self._child = self._spawn(cmd, env=self._env, stdin=subprocess.DEVNULL, start_new_session=True)
        self._joined = head
        self._started_at = self._clock()
        self.joins += 1

    def _stop_child(self) -> None:
        child, self._child = self._child, None
        if child is not None:
            stop_process_group(child, self.config.stop_grace_s)

    def _schedule_retry(self) -> None:
        self._retry_at = self._clock() + self._backoff_s
        self._backoff_s = min(self._backoff_s * 2, self.config.backoff_max_s)



def stop_process_group(child: subprocess.Popen, grace_s: float) -> None:
    """SIGTERM a child started in its own session and wait until its whole process group is
    gone (Ray's daemons outlive `ray start --block` by a moment, and a new head on the same
    port is refused while the old GCS process exists); SIGKILL what is left after `grace_s`."""
    if child.pid <= 1:  # never a group of ours: killpg(0) would hit the caller's own group
        raise ValueError(f"refusing to stop process group {child.pid}")
    deadline = time.monotonic() + grace_s
    if child.poll() is None:
        child.terminate()  # `ray start --block` stops the processes it started on SIGTERM
        try:
            child.wait(timeout=grace_s)
        except subprocess.TimeoutExpired:
            pass
    while _group_alive(child.pid) and time.monotonic() < deadline:
        time.sleep(0.2)
    if child.poll() is None or _group_alive(child.pid):
        log.warning("Ray processes did not stop within %.0fs; killing them", grace_s)
        _kill_group(child)
        child.wait()


def _group_alive(pgid: int) -> bool:
    """Whether any live (non-zombie) process is still in the group. Zombies count as gone:
    in a container without an init that reaps, they linger until their namespace ends."""
    proc = Path("/proc")
    if not proc.is_dir():  # macOS: launchd reaps orphans, so the kernel's answer is enough
        try:
            os.killpg(pgid, 0)
            return True
        except ProcessLookupError:
            return False
        except PermissionError:
            return True
    for stat in proc.glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except (OSError, IndexError):
            continue
        if fields[0] != "Z" and int(fields[2]) == pgid:
            return True
    return False

def _kill_group(child: subprocess.Popen) -> None:
    try:
        os.killpg(child.pid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        child.kill()

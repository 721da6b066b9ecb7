"""`orchard serve`: one command from nothing to an OpenAI-compatible endpoint.

By default it starts a private local Ray (or attaches to one with `--address`), the
coordinator and `--nodes` engine nodes, then the gateway; `--no-ray` (or a build without
the Ray backend) serves one in-process engine instead. It refuses to listen beyond
loopback without an API key, because anyone who can reach the port could use the model.
SIGTERM or Ctrl-C stops accepting, lets in-flight requests finish within `--grace`
seconds, then stops the engines.
"""

from __future__ import annotations

import asyncio
import contextlib
import ipaddress
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass

DEFAULT_PORT = 8000
API_KEYS_ENV = "ORCHARD_API_KEYS"
WARMUP_PROMPT = "Hello"
WARMUP_PATIENCE_S = 120.0


class InsecureBind(ValueError):
    """Listening beyond loopback without an API key."""


@dataclass
class Started:
    """A running backend, its served model, and how to stop what was started for it."""

    backend: object
    model: str
    stop: Callable[[], None]


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    p.add_argument("--model", default=None, help="mlx-lm model path or hub id (default: the bundled demo model)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need an API key)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"accept this bearer token (repeatable; also {API_KEYS_ENV}, comma-separated)")
    p.add_argument("--kv-memory", type=float, default=None, metavar="GB", help="KV cache memory per node, in GB")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default 16)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per engine batch (default 64)")
    p.add_argument("--max-model-len", type=int, default=None, help="context length cap (default: the model's)")
    p.add_argument("--cold-tier", default=None, metavar="DIR",
                   help="spill evicted KV blocks to a file in DIR (made 0700) instead of dropping them")
    p.add_argument("--cold-tier-gb", type=float, default=4.0, metavar="GB", help="cold tier size per node (default 4)")
    p.add_argument("--nodes", type=int, default=1, help="engine nodes to start on this machine (default 1)")
    p.add_argument("--address", default=None, help="attach to this Ray cluster instead of starting one")
    p.add_argument("--router", default=None, choices=_router_policies(),
                   help="routing policy (default: the coordinator's, prefix-aware)")
    p.add_argument("--no-ray", action="store_true", help="one in-process engine, no Ray")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S", help="abort requests running longer")
    p.add_argument("--max-queue", type=int, default=1024, help="waiting requests before new ones get 429")
    p.add_argument("--max-body-mb", type=float, default=32.0, metavar="MB",
                   help="largest request body accepted; larger ones get 413 unread (default 32)")
    p.add_argument("--grace", type=float, default=30.0, metavar="S", help="on SIGTERM, time left to in-flight requests")
    p.set_defaults(func=run)


def _router_policies() -> tuple[str, ...] | None:
    try:
        from cluster.coordinator.router import POLICIES
    except ImportError:
        return None
    return POLICIES


def api_keys(flags: list[str], environ: dict[str, str]) -> frozenset[str]:
    from_env = [k.strip() for k in environ.get(API_KEYS_ENV, "").split(",")]
    return frozenset(k for k in [*flags, *from_env] if k)


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def check_bind(host: str, keys: frozenset[str]) -> None:
    if keys or is_loopback(host):
        return
    raise InsecureBind(
        f"refusing to listen on {host} without an API key: anyone who can reach this machine could use "
        f"the model. Pass --api-key KEY (or set {API_KEYS_ENV}), or bind 127.0.0.1."
    )


def engine_config(args):
    from node.engine import EngineConfig

    return EngineConfig(
        model=args.model, block_size=args.block_size, kv_memory_gb=args.kv_memory,
        max_num_seqs=args.max_num_seqs, max_model_len=args.max_model_len,
        cold_tier_dir=args.cold_tier, cold_tier_gb=args.cold_tier_gb,
    )


def starts_local_ray(args) -> bool:
    return not args.no_ray and not args.address


def lock_down_local_ray() -> None:
    """The private Ray that `serve` starts: a fresh token that only this process tree knows,
    everything on loopback whatever `--host` says (only the gateway faces clients)."""
    from cluster.runtime.ray_access import new_ray_token, require_token_auth

    require_token_auth(new_ray_token(), loopback=True)


def start_local(args, step) -> Started:
    from cluster.gateway.backend import LocalBackend
    from node.async_engine import AsyncEngine

    step("loading model")
    engine = AsyncEngine.from_config(engine_config(args))
    return Started(LocalBackend(engine), engine.model_name, lambda: None)


def start_ray(args, step) -> Started:
    import ray

    from cluster.gateway.ray_backend import RayBackend, RayBackendConfig
    from cluster.runtime.ray_cluster import LocalCluster, connect, ensure_coordinator, place_node_actors

    local = None
    if args.address:
        step(f"attaching to Ray at {args.address}")
        connect(args.address)
    else:
        step(f"starting Ray with {args.nodes} node(s), on loopback, token required")
        local = LocalCluster(cpus_per_node=1, loopback=True).start(extra_nodes=max(args.nodes - 1, 0))
    ensure_coordinator()
    step("loading model on the nodes")
    place_node_actors(engine_config(args))
    backend = RayBackend(RayBackendConfig(policy=args.router))

    def stop() -> None:
        if local is not None:
            local.shutdown()
        elif ray.is_initialized():
            ray.shutdown()

    return Started(backend, "", stop)


async def warm_up(backend, patience_s: float = WARMUP_PATIENCE_S) -> str:
    """One short generation, so compilation and first allocations happen before any client.

    Nodes register before they can take requests, so a refusal is retried until
    `patience_s` runs out; then the last error stands.
    """
    from node.types import SamplingParams

    loop = asyncio.get_running_loop()
    deadline = loop.time() + patience_s
    attempt = 0
    while True:
        attempt += 1
        try:
            if not await backend.ready():
                raise RuntimeError("no node is ready")
            info = (await backend.models())[0]
            prompt = list(info.tokenizer.encode(WARMUP_PROMPT))
            params = SamplingParams(max_tokens=4, temperature=0.0)
            async for _ in backend.generate(f"orchard-warmup-{attempt}", info.name, prompt, params):
                pass
            return info.name
        except Exception:
            if loop.time() > deadline:
                raise
            await asyncio.sleep(0.5)


def start_backend(args) -> Started:
    """Start everything behind the gateway under a progress display."""
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    use_ray = not args.no_ray
    console = Console(stderr=True)
    with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console, transient=True) as bar:
        task = bar.add_task("starting", total=None)

        def step(what: str) -> None:
            bar.update(task, description=what)
            console.print(f"[dim]{what}[/dim]")

        started = (start_ray if use_ray else start_local)(args, step)
        try:
            step("warming up")
            started.model = asyncio.run(warm_up(started.backend))
        except BaseException:
            started.stop()
            raise
    return started


def bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # Name the protocol: asyncio turns Nagle off (TCP_NODELAY) only on sockets whose proto is
    # IPPROTO_TCP, and with Nagle on, each request after the first on a kept-alive connection
    # waited ~40 ms for a delayed ACK before its first streamed token.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.set_inheritable(True)
    return sock


def run(args) -> int:
    from node.openblas import reexec_with_openblas

    keys = api_keys(args.api_key, dict(os.environ))
    try:
        check_bind(args.host, keys)
        sock = bind(args.host, args.port)
    except InsecureBind as exc:
        print(f"orchard serve: {exc}", file=sys.stderr)
        return 2
    except OSError as exc:
        print(f"orchard serve: cannot listen on {args.host}:{args.port}: {exc.strerror or exc}", file=sys.stderr)
        return 1
    sock.close()  # checked early; bound again after the (possible) re-exec below
    if starts_local_ray(args):
        lock_down_local_ray()
    reexec_with_openblas()
    code = serve(args, keys)
    # Everything is stopped by now; skipping interpreter teardown avoids an abort that MLX's
    # native threads sometimes cause there ("terminate called without an active exception").
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def serve(args, keys: frozenset[str]) -> int:
    return serve_started(start_backend(args), args, keys)


def serve_started(started: Started, args, keys: frozenset[str]) -> int:
    """Run the gateway over a started backend until SIGTERM/Ctrl-C, then stop what it started.

    Split from `serve` so that a driver on an existing Ray cluster (deploy/serve.py) can do
    its own work between starting the backend and serving.
    """
    import uvicorn

    from cluster.gateway.app import create_app
    from cluster.gateway.state import GatewayConfig

    try:
        config = GatewayConfig(api_keys=keys, max_queue=args.max_queue, request_timeout_s=args.request_timeout,
                               max_body_bytes=int(args.max_body_mb * (1 << 20)))
        app = create_app(started.backend, config)
        server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", timeout_graceful_shutdown=args.grace, access_log=False,
        ))
        sock = bind(args.host, args.port)
        port = sock.getsockname()[1]
        host = f"[{args.host}]" if ":" in args.host else args.host
        auth = "API key required" if keys else "no API key"
        line = f"orchard: serving {started.model} at http://{host}:{port}/v1 ({auth}; Ctrl-C to stop)"
        with _stop_signals_end_quietly():
            _announce_when_listening(server, line)
            server.run(sockets=[sock])
    finally:
        started.stop()
    return 0


def _announce_when_listening(server, line: str) -> None:
    """Print `line` once uvicorn listens and handles SIGTERM itself: a stop signal sent on
    seeing it then drains the server instead of landing in the quiet handler below."""
    startup = server.startup

    async def startup_then_announce(sockets=None):
        await startup(sockets=sockets)
        if not server.should_exit:
            print(line, flush=True)

    server.startup = startup_then_announce


@contextlib.contextmanager
def _stop_signals_end_quietly():
    """uvicorn drains on SIGTERM/SIGINT, then raises the signal again once it is done; a
    no-op handler here lets that re-raise return, so the nodes are stopped and we exit 0."""
    previous = {sig: signal.signal(sig, lambda *_: None) for sig in (signal.SIGTERM, signal.SIGINT)}
    try:
        yield
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)

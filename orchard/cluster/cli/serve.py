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
import logging
import os
import signal
import socket
import sys
from collections.abc import Callable
from dataclasses import dataclass, field

from orchard.cluster.cli.serve_options import (
    BadFlag,
    InsecureBind,
    add_serve_flags,
    api_keys,
    chat_template_text,
    check_bind,
    check_parsers,
    check_tokenizer,
    engine_config,
    model_of,
)
from orchard.cluster.cli.serving_logs import RequestLog, ServedBackend, StatsLine
from orchard.node.heap import freeze_loaded_objects

WARMUP_PROMPT = "Hello"
WARMUP_PATIENCE_S = 120.0
PLACE_EVERY_S = 2.0  # how often `serve --nodes N` replaces a node actor that died
STATS_EVERY_S = 5.0

log = logging.getLogger("orchard.serve")


class StartupStopped(Exception):
    """SIGTERM or Ctrl-C arrived before the gateway listened."""

    def __init__(self, signum: int):
        super().__init__(signal.Signals(signum).name)
        self.signum = signum


@dataclass
class Started:
    """A running backend, its served model, and how to stop what was started for it."""

    backend: object
    model: str
    stop: Callable[[], None]
    pool: list[str] = field(default_factory=list)  # one line per node: blocks, GB, tokens


def register(sub) -> None:
    p = sub.add_parser("serve", help="serve a model over an OpenAI-compatible HTTP API")
    add_serve_flags(p)
    p.set_defaults(func=run)


def starts_local_ray(args) -> bool:
    return not args.no_ray and not args.address


def lock_down_local_ray() -> None:
    """The private Ray that `serve` starts: a fresh token that only this process tree knows,
    everything on loopback whatever `--host` says (only the gateway faces clients)."""
    from orchard.cluster.runtime.ray_access import new_ray_token, require_token_auth

    require_token_auth(new_ray_token(), loopback=True)


def start_local(args, step) -> Started:
    from orchard.cluster.gateway.backend import LocalBackend
    from orchard.node.async_engine import AsyncEngine

    step("loading model")
    engine = AsyncEngine.from_config(engine_config(args))
    kv = engine.engine.kv
    pool = [pool_line("local", kv.num_blocks, kv.block_size, kv.num_blocks * kv.geometry.bytes_per_block)]
    return Started(LocalBackend(engine), engine.model_name, engine.shutdown, pool)


def pool_line(node: str, blocks: int, block_size: int, nbytes: int | None) -> str:
    size = f"{nbytes / 1e9:.2f} GB, " if nbytes else ""
    return f"{node}: {blocks} blocks of {block_size} tokens ({size}{blocks * block_size} tokens)"


def start_ray(args, step) -> Started:
    import ray

    from orchard.cluster.gateway.ray_backend import RayBackend, RayBackendConfig
    from orchard.cluster.runtime.placement import Placer
    from orchard.cluster.runtime.ray_cluster import LocalCluster, connect, ensure_coordinator, place_node_actors

    local = placer = None

    def stop() -> None:
        if placer is not None:
            placer.stop()
        if local is not None:
            local.shutdown()
        elif ray.is_initialized():
            ray.shutdown()

    # "Connecting to existing Ray cluster" right after starting that cluster says nothing.
    logging.getLogger("ray._private.worker").setLevel(logging.WARNING)
    try:
        if args.address:
            step(f"attaching to Ray at {args.address}")
            connect(args.address)
        else:
            step(f"starting Ray with {args.nodes} node(s), on loopback, token required")
            local = LocalCluster(cpus_per_node=1, loopback=True)
            local.start(extra_nodes=max(args.nodes - 1, 0))
            step(f"Ray started (temp folder {local._tmpdir})")
        ensure_coordinator()
        step("loading model on the nodes")
        config = engine_config(args)
        place_node_actors(config)
        if local is not None:
            # As `orchard head`'s placer: a node actor that died gets a new one on its machine.
            placer = Placer(config, PLACE_EVERY_S)
            placer.start()
        backend = RayBackend(RayBackendConfig(policy=args.router))
    except BaseException:
        stop()
        raise
    return Started(backend, "", stop)


async def warm_up(backend, patience_s: float = WARMUP_PATIENCE_S, should_stop=lambda: False) -> str:
    """One short generation, so compilation and first allocations happen before any client.

    Nodes register before they can take requests, so a refusal is retried until
    `patience_s` runs out; then the last error stands.
    """
    from orchard.node.types import SamplingParams

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
            if loop.time() > deadline or should_stop():
                raise
            await asyncio.sleep(0.5)


def start_backend(args) -> Started:
    """Start everything behind the gateway under a progress display.

    SIGTERM or Ctrl-C meanwhile is held until the current step ends (Ray's own handler,
    installed by ray.init, is replaced at each step); then what was started is stopped and
    `StartupStopped` raised.
    """
    from rich.console import Console
    from rich.progress import Progress, SpinnerColumn, TextColumn, TimeElapsedColumn

    use_ray = not args.no_ray
    console = Console(stderr=True)
    stop_signal: list[int] = []

    def hold(signum, _frame) -> None:
        stop_signal.append(signum)

    def hold_signals() -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, hold)

    def check() -> None:
        hold_signals()
        if stop_signal:
            raise StartupStopped(stop_signal[0])

    previous = {sig: signal.getsignal(sig) for sig in (signal.SIGTERM, signal.SIGINT)}
    hold_signals()
    try:
        with Progress(SpinnerColumn(), TextColumn("{task.description}"), TimeElapsedColumn(), console=console,
                      transient=True) as bar:
            task = bar.add_task("starting", total=None)

            def step(what: str) -> None:
                check()
                bar.update(task, description=what)
                console.print(f"[dim]{what}[/dim]")

            started = (start_ray if use_ray else start_local)(args, step)
            try:
                step("warming up")
                backend = ServedBackend(started.backend, args.served_model_name,
                                        chat_template_text(getattr(args, "chat_template", None)))
                started.backend = backend
                started.model = asyncio.run(warm_up(backend, should_stop=lambda: bool(stop_signal)))
                if not started.pool:
                    started.pool = asyncio.run(ray_pool_lines(backend, args.block_size))
                check()
            except BaseException:
                started.stop()
                raise
    except SystemExit as exc:  # Ray's SIGTERM handler, between ray.init and the next step
        raise StartupStopped(signal.SIGTERM) from exc
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return started


async def ray_pool_lines(backend, block_size: int) -> list[str]:
    try:
        info = await backend.cluster_info()
    except Exception:
        return []
    return [pool_line(n["node"], n["kv_blocks_total"], block_size, None) for n in info.get("nodes", [])]


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
    from orchard.cluster.gateway.guard import WeakApiKey, check_api_keys
    from orchard.node.openblas import reexec_with_openblas

    keys = api_keys(args.api_key, dict(os.environ))
    try:
        model_of(args)
        check_tokenizer(args)
        chat_template_text(args.chat_template)
        check_parsers(args)
        check_bind(args.host, keys)
        check_api_keys(keys)
        sock = bind(args.host, args.port)
    except (InsecureBind, BadFlag, WeakApiKey) as exc:
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
    try:
        started = start_backend(args)
    except StartupStopped as stopped:
        print(f"orchard serve: stopped by {stopped} while starting", file=sys.stderr)
        return 128 + stopped.signum
    return serve_started(started, args, keys)


def serve_started(started: Started, args, keys: frozenset[str]) -> int:
    """Run the gateway over a started backend until SIGTERM/Ctrl-C, then stop what it started.

    Split from `serve` so that a driver on an existing Ray cluster (deploy/serve.py) can do
    its own work between starting the backend and serving.
    """
    import uvicorn

    from orchard.cluster.gateway.app import create_app
    from orchard.cluster.gateway.state import GatewayConfig

    setup_logging()
    try:
        config = GatewayConfig(api_keys=keys, max_queue=args.max_queue, request_timeout_s=args.request_timeout,
                               max_body_bytes=int(args.max_body_mb * (1 << 20)),
                               tool_call_parser=getattr(args, "tool_call_parser", None),
                               reasoning_parser=getattr(args, "reasoning_parser", None), history_every_s=2.0)
        app = RequestLog(create_app(started.backend, config))
        server = uvicorn.Server(uvicorn.Config(
            app, log_level="warning", timeout_graceful_shutdown=args.grace, access_log=False,
        ))
        sock = bind(args.host, args.port)
        port = sock.getsockname()[1]
        host = f"[{args.host}]" if ":" in args.host else args.host
        base = f"http://{host}:{port}"
        auth = "API key required" if keys else "no API key"
        summary = [f"orchard: model {started.model}"]
        summary += [f"orchard: KV pool {line}" for line in started.pool]
        summary += [f"orchard: API {base}/v1, metrics {base}/metrics, dashboard {base}/dashboard"]
        for line in summary:
            print(line, file=sys.stderr, flush=True)
        line = f"orchard: serving {started.model} at {base}/v1 ({auth}; Ctrl-C to stop)"
        stats = StatsLine(started.backend, STATS_EVERY_S)
        freeze_loaded_objects()  # the backend, the app and the tokenizer: out of the collector's full passes
        with _stop_signals_end_quietly():
            _announce_when_listening(server, line, stats)
            server.run(sockets=[sock])
    finally:
        started.stop()
    return 0


def setup_logging() -> None:
    """Access and stats lines on stderr, as uvicorn's and vLLM's are."""
    handler = logging.StreamHandler(sys.stderr)
    handler.setFormatter(logging.Formatter("%(asctime)s %(levelname)s %(name)s: %(message)s", "%H:%M:%S"))
    for name in ("orchard.access", "orchard.stats"):
        logger = logging.getLogger(name)
        logger.setLevel(logging.INFO)
        logger.addHandler(handler)
        logger.propagate = False


def _announce_when_listening(server, line: str, stats: StatsLine | None = None) -> None:
    """Print `line` once uvicorn listens and handles SIGTERM itself: a stop signal sent on
    seeing it then drains the server instead of landing in the quiet handler below. The
    periodic stats line starts then too."""
    startup = server.startup

    async def startup_then_announce(sockets=None):
        await startup(sockets=sockets)
        if not server.should_exit:
            if stats is not None:
                stats.start()
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

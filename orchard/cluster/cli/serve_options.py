"""`orchard serve`'s flags and what is checked of them before anything starts: the bind and its
API keys, the model and tokenizer, the chat template, the parsers, the engine's config.

`orchard head` shares these (orchard/cluster/cli/head.py), so the two never disagree.
"""

from __future__ import annotations

import argparse
import ipaddress
from pathlib import Path

DEFAULT_PORT = 8000
API_KEYS_ENV = "ORCHARD_API_KEYS"
DEFAULT_KV_FRACTION = 0.3  # node.engine.EngineConfig's memory_fraction
DTYPES = ("auto", "float16", "bfloat16", "float32")


class BadFlag(ValueError):
    """A flag that cannot be honoured, said before anything is loaded."""


class InsecureBind(ValueError):
    """Listening beyond loopback without an API key."""


def add_serve_flags(p) -> None:
    """Every `orchard serve` flag; `orchard head` borrows the ones that make sense for a head."""
    p.add_argument("model_arg", nargs="?", default=None, metavar="MODEL",
                   help="mlx-lm model path or hub id, as `--model` (default: the bundled demo model)")
    p.add_argument("--model", default=None, help="mlx-lm model path or hub id (default: the bundled demo model)")
    p.add_argument("--version", action="version", version=f"orchard {version()}")
    p.add_argument("--served-model-name", nargs="+", action="extend", default=None, metavar="NAME",
                   help="the name(s) /v1/models lists and requests use; the first is the main one, the others "
                        "aliases (default: the model's own name)")
    p.add_argument("--tokenizer", default=None, metavar="PATH",
                   help="tokenizer path or hub id (default: the model's; another one is refused, see README)")
    p.add_argument("--chat-template", default=None, metavar="PATH_OR_JINJA",
                   help="chat template for /v1/chat/completions: a file, or the Jinja text itself "
                        "(default: the model's, else ChatML)")
    p.add_argument("--tool-call-parser", default=None, metavar="NAME",
                   help="how the model writes tool calls, by vLLM's name: hermes, llama3_json, mistral, openai, ... "
                        "(default: chosen from the chat template)")
    p.add_argument("--reasoning-parser", default=None, metavar="NAME",
                   help="how the model writes its reasoning, by vLLM's name: qwen3, deepseek_r1, openai_gptoss "
                        "(default: chosen from the chat template)")
    p.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1; others need an API key)")
    p.add_argument("--port", type=int, default=DEFAULT_PORT, help=f"port (default {DEFAULT_PORT})")
    p.add_argument("--api-key", action="append", default=[], metavar="KEY",
                   help=f"accept this bearer token (repeatable; also {API_KEYS_ENV}, comma-separated)")
    p.add_argument("--kv-memory", type=float, default=None, metavar="GB",
                   help="KV cache memory per node, in GB (default: --kv-memory-fraction of the memory free "
                        "once the model is loaded; the size is printed at start)")
    p.add_argument("--kv-memory-fraction", type=float, default=DEFAULT_KV_FRACTION, metavar="F",
                   help="share of free memory the KV pool takes per node when --kv-memory is not given "
                        "(default %(default)s)")
    p.add_argument("--block-size", type=int, default=16, help="tokens per KV block (default %(default)s)")
    p.add_argument("--dtype", default="auto", choices=DTYPES,
                   help="KV cache dtype; auto follows the model (default %(default)s)")
    p.add_argument("--max-num-seqs", type=int, default=64, help="sequences per engine batch (default %(default)s)")
    p.add_argument("--max-num-batched-tokens", type=int, default=None,
                   help="tokens per engine step, prefill chunks and decodes together "
                        "(default: 1024 on a GPU, 512 on a CPU: node.engine.device_token_budget)")
    p.add_argument("--compiled-decode", default="auto", choices=("auto", "on", "off"),
                   help="replay decode-only steps from compiled graphs (off is vLLM's --enforce-eager); "
                        "auto: on where attention runs a compiled kernel (Metal, CUDA) (default %(default)s)")
    p.add_argument("--async-scheduling", action=argparse.BooleanOptionalAction, default=True,
                   help="build each engine step while the device runs the one before (default: on); off, "
                        "each token leaves the step that computed it, a step sooner")
    p.add_argument("--max-model-len", type=int, default=None,
                   help="context length cap; longer prompts get 400 (default: the model's)")
    p.add_argument("--enable-prefix-caching", action=argparse.BooleanOptionalAction, default=True,
                   help="reuse the KV of prompt prefixes seen before (default: on)")
    p.add_argument("--seed", type=int, default=0, help="seed for requests that bring none (default %(default)s)")
    p.add_argument("--cold-tier", default=None, metavar="DIR",
                   help="spill evicted KV blocks to a file in DIR (made 0700) instead of dropping them")
    p.add_argument("--cold-tier-gb", type=float, default=4.0, metavar="GB",
                   help="cold tier size per node (default %(default)s)")
    p.add_argument("--nodes", type=int, default=1,
                   help="engine nodes to start on this machine, each with the whole model (default %(default)s)")
    p.add_argument("--address", default=None, help="attach to this Ray cluster instead of starting one")
    p.add_argument("--router", default=None, choices=router_policies(),
                   help="routing policy (default: the coordinator's, prefix-aware)")
    p.add_argument("--no-ray", action="store_true", help="one in-process engine, no Ray")
    p.add_argument("--request-timeout", type=float, default=600.0, metavar="S",
                   help="abort requests running longer (default %(default)s)")
    p.add_argument("--max-queue", type=int, default=1024,
                   help="waiting requests before new ones get 429 (default %(default)s)")
    p.add_argument("--max-body-mb", type=float, default=32.0, metavar="MB",
                   help="largest request body accepted; larger ones get 413 unread (default %(default)s)")
    p.add_argument("--grace", type=float, default=30.0, metavar="S",
                   help="on SIGTERM, time left to in-flight requests (default %(default)s)")


def version() -> str:
    from orchard.cluster.discovery.adverts import orchard_version

    return orchard_version()


def router_policies() -> tuple[str, ...] | None:
    try:
        from orchard.cluster.coordinator.router import POLICIES
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


def model_of(args) -> str | None:
    """`orchard serve MODEL` or `--model MODEL` (both only when they agree)."""
    positional, flag = getattr(args, "model_arg", None), args.model
    if positional and flag and positional != flag:
        raise BadFlag(f"two models given: {positional!r} and --model {flag!r}")
    return positional or flag


def check_tokenizer(args) -> None:
    """mlx-lm loads the tokenizer from the model's own folder; a different one is refused."""
    tokenizer = getattr(args, "tokenizer", None)
    if tokenizer is None:
        return
    model = model_of(args)
    if model is not None and _same_source(tokenizer, model):
        return
    raise BadFlag(
        f"--tokenizer {tokenizer!r}: a tokenizer other than the model's is not supported (mlx-lm loads it "
        "from the model's folder). Copy its tokenizer files into the model folder and leave --tokenizer out."
    )


def _same_source(a: str, b: str) -> bool:
    pa, pb = Path(a).expanduser(), Path(b).expanduser()
    if pa.exists() and pb.exists():
        return pa.resolve() == pb.resolve()
    return a == b


def chat_template_text(value: str | None) -> str | None:
    """`--chat-template`: a readable file's text, else the value itself as Jinja."""
    if value is None:
        return None
    path = Path(value).expanduser()
    try:
        if path.is_file():
            return path.read_text()
    except OSError as exc:
        raise BadFlag(f"--chat-template {value!r}: {exc.strerror or exc}") from exc
    if "{" not in value:
        raise BadFlag(f"--chat-template {value!r} is neither a file nor a Jinja template")
    return value


def check_parsers(args) -> None:
    from orchard.cluster.gateway.reasoning import reasoning_parser_named
    from orchard.cluster.gateway.tool_parsers import parser_named

    for flag, named in (("tool_call_parser", parser_named), ("reasoning_parser", reasoning_parser_named)):
        value = getattr(args, flag, None)
        if value is not None:
            try:
                named(value)
            except ValueError as exc:
                raise BadFlag(f"--{flag.replace('_', '-')}: {exc}") from exc


def engine_config(args):
    from orchard.node.engine import EngineConfig

    dtype = getattr(args, "dtype", "auto")
    config = EngineConfig(
        model=model_of(args), block_size=args.block_size, kv_memory_gb=args.kv_memory,
        memory_fraction=getattr(args, "kv_memory_fraction", DEFAULT_KV_FRACTION),
        max_num_seqs=args.max_num_seqs,
        max_num_batched_tokens=getattr(args, "max_num_batched_tokens", None),
        max_model_len=args.max_model_len, dtype=None if dtype in (None, "auto") else dtype,
        cold_tier_dir=args.cold_tier, cold_tier_gb=args.cold_tier_gb, seed=getattr(args, "seed", 0),
        enable_prefix_caching=getattr(args, "enable_prefix_caching", True),
        compiled_decode={"on": True, "off": False}.get(getattr(args, "compiled_decode", "auto")),
        async_scheduling=getattr(args, "async_scheduling", True),
    )
    return config

"""`orchard`: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its
parser and sets `func`; heavy imports (MLX, Ray) happen inside the commands.
"""

from __future__ import annotations

import argparse
import importlib

# One module per subcommand, in help order.
_COMMANDS = [
    "orchard.cluster.cli.serve",
    "orchard.cluster.cli.head",
    "orchard.cluster.cli.join",
    "orchard.cluster.cli.status",
    "orchard.cluster.cli.drain",
    "orchard.cluster.cli.bench",
    "orchard.cluster.cli.demo_model",
]


def build_parser() -> argparse.ArgumentParser:
    from orchard.cluster.cli.serve_options import version

    parser = argparse.ArgumentParser(prog="orchard", description="Serve LLMs from a set of Macs as one endpoint.")
    parser.add_argument("--version", action="version", version=f"orchard {version()}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        importlib.import_module(name).register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        from orchard.node.openblas import reexec_with_openblas

        reexec_with_openblas()  # MLX's Linux CPU wheel is ~40x slower at matmul without it
    args = build_parser().parse_args(argv)
    if not getattr(args, "func", None):
        build_parser().print_help()
        return 2
    return int(args.func(args) or 0)


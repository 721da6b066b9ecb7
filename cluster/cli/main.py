"""`orchard`: one entry point, one module per subcommand.

Each subcommand lives in its own module exposing `register(subparsers)`, which adds its
parser and sets `func`; modules are imported only when present so the CLI stays usable
while commands are added, and heavy imports (MLX, Ray) happen inside the commands.
"""

from __future__ import annotations

import argparse
import importlib
import sys

# (module, attribute) for each subcommand group, in help order.
_COMMANDS = [
    "cluster.commands.serve",
    "cluster.commands.head",
    "cluster.commands.join",
    "cluster.commands.status",
    "cluster.commands.drain",
    "cluster.commands.bench",
    "cluster.commands.demo_model",
]


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="orchard", description="Serve LLMs from a set of Macs as one endpoint.")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name in _COMMANDS:
        try:
            module = importlib.import_module(name)
        except ModuleNotFoundError as exc:
            if exc.name != name:
                raise
            continue
        module.register(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    if argv is None:
        from node.openblas import reexec_with_openblas

        reexec_with_openblas()  # MLX's Linux CPU wheel is ~40x slower at matmul without it
    args = build_parser().parse_args(argv)
    if not getattr(args, "func", None):
        build_parser().print_help()
        return 2
    return int(args.func(args) or 0)


if __name__ == "__main__":
    sys.exit(main())

"""`orchard demo-model PATH`: write the bundled deterministic demo model."""

from __future__ import annotations


def register(sub) -> None:
    p = sub.add_parser("demo-model", help="write the demo model (Hugging Face layout) to PATH")
    p.add_argument("path", help="folder to write config.json, model.safetensors, tokenizer.json into")
    p.add_argument("--size", choices=["small", "large"], default="small", help="small for tests, large for benchmarks")
    p.set_defaults(func=run)


def run(args) -> int:
    from orchard.node.model.demo import write_demo_model

    write_demo_model(args.path, size=args.size)
    print(f"demo model ({args.size}) written to {args.path}")
    return 0

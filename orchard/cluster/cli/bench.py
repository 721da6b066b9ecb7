"""`orchard bench`: benchmarks, one subcommand each.

`serve` and `compare` live here (the load generator in `orchard/cluster/bench/loadgen`). The others
are modules of `orchard/cluster/bench/` with `main(argv) -> int`, so this group only forwards their
arguments.
"""

from __future__ import annotations

import argparse
import importlib
import math
import os
import sys

# subcommand -> (module with main(argv), what it measures)
DELEGATED = {
    "kv": ("orchard.cluster.bench.kvcache", "KV block pool and prefix cache"),
    "kernels": ("orchard.cluster.bench.kernels", "paged attention kernels"),
    "engine": ("orchard.cluster.bench.engine", "one node's engine, offline"),
    "grammar": ("orchard.cluster.bench.grammar", "structured-output mask cost at batch 32"),
    "cluster": ("orchard.cluster.bench.cluster", "routing across nodes"),
    "migration": ("orchard.cluster.bench.migration", "KV block migration between nodes"),
    "gateway": ("orchard.cluster.bench.gateway", "HTTP front vs engine; orchard serve vs mlx_lm.server"),
}


def register(sub) -> None:
    p = sub.add_parser("bench", help="benchmarks: serve, compare, kv, kernels, engine, cluster, migration")
    group = p.add_subparsers(dest="bench_command", metavar="BENCH")
    _add_serve(group)
    _add_compare(group)
    for name, (module, what) in DELEGATED.items():
        # '+' as the only prefix char: every argument, '--help' included, goes to the module.
        q = group.add_parser(name, help=f"{what} (runs {module})", add_help=False, prefix_chars="+")
        q.add_argument("argv", nargs=argparse.REMAINDER)
        q.set_defaults(func=lambda args, module=module: run_delegated(module, args.argv))
    p.set_defaults(func=lambda args: (p.print_help(), 2)[1])


def run_delegated(module_name: str, argv: list[str]) -> int:
    return int(importlib.import_module(module_name).main(list(argv)) or 0)


def _add_serve(group) -> None:
    p = group.add_parser("serve", help="load-test any OpenAI-compatible endpoint",
                         description="Load-test an OpenAI-compatible endpoint (orchard, mlx_lm.server, vLLM, ...).")
    t = p.add_argument_group("target")
    t.add_argument("--base-url", default="http://127.0.0.1:8000", help="server root, without /v1")
    t.add_argument("--model", help="model name to send (default: first id from /v1/models)")
    t.add_argument("--api-key", default=os.environ.get("ORCHARD_API_KEY") or os.environ.get("OPENAI_API_KEY"),
                   help="bearer token (default: $ORCHARD_API_KEY or $OPENAI_API_KEY)")
    t.add_argument("--api", choices=["completions", "chat"], default="completions",
                   help="endpoint for single-turn datasets (multi-turn always uses chat)")
    t.add_argument("--temperature", type=float, default=0.0)
    t.add_argument("--ignore-eos", action="store_true", help="ask the server to ignore EOS (vLLM, orchard)")
    t.add_argument("--timeout", type=float, default=600.0, help="seconds per request")
    d = p.add_argument_group("workload")
    d.add_argument("--dataset", choices=["random", "prefix-repetition", "multi-turn"], default="random")
    d.add_argument("--input-len", type=int, default=128,
                   help="prompt tokens (prefix-repetition: the unique suffix; multi-turn: each user turn)")
    d.add_argument("--output-len", type=int, default=32, help="max_tokens per request")
    d.add_argument("--range-ratio", type=float, default=0.0,
                   help="lengths drawn uniformly from [len*(1-r), len*(1+r)]")
    d.add_argument("--num-prefixes", type=int, default=4, help="prefix-repetition: distinct shared prefixes")
    d.add_argument("--prefix-len", type=int, default=256, help="prefix-repetition: tokens per shared prefix")
    d.add_argument("--turns", type=int, default=4, help="multi-turn: user turns per conversation (--num-prompts counts turns)")
    d.add_argument("--tokenizer", help="tokenizer.json (or its folder) to size prompts with (default: the server's /tokenize, "
                        "else the tokenizer of the model it names, else words: approximate)")
    d.add_argument("--seed", type=int, default=0)
    load = p.add_argument_group("load")
    load.add_argument("--request-rate", type=float, default=math.inf,
                      help="Poisson arrivals per second, of conversations for multi-turn (default inf: all at once)")
    load.add_argument("--max-concurrency", type=int, help="cap on requests in flight")
    load.add_argument("--sweep-concurrency", help="comma-separated caps, e.g. 1,4,16: one run each")
    stop = load.add_mutually_exclusive_group()
    stop.add_argument("--num-prompts", type=int, help="requests to send (default 100)")
    stop.add_argument("--duration", type=float, help="seconds to keep issuing requests")
    load.add_argument("--goodput", nargs="+", metavar="METRIC:MS", help="SLOs, e.g. ttft:500 tpot:50 e2el:2000")
    o = p.add_argument_group("output")
    o.add_argument("--result-file", help="write the JSON result here")
    o.add_argument("--plot-dir", help="write PNG plots here (default: beside --result-file)")
    o.add_argument("--save-text", action="store_true", help="keep generated text in the JSON")
    o.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run_serve)


def _add_compare(group) -> None:
    p = group.add_parser("compare", help="ratios of two `bench serve` results (B / A)")
    p.add_argument("a", metavar="A.json")
    p.add_argument("b", metavar="B.json")
    p.set_defaults(func=run_compare)


def serve_config(args):
    """The benchmark configuration the parsed arguments describe (validated here, once)."""
    from orchard.cluster.bench.loadgen import SLO, DatasetConfig, EndpointConfig, LengthRange, LoadConfig, ServeBenchConfig

    sweep = tuple(int(x) for x in args.sweep_concurrency.split(",")) if args.sweep_concurrency else ()
    num_prompts = args.num_prompts if args.num_prompts is not None or args.duration is not None else 100
    return ServeBenchConfig(
        endpoint=EndpointConfig(args.base_url, args.model, args.api_key, args.timeout, args.temperature,
                                args.ignore_eos),
        dataset=DatasetConfig(args.dataset, LengthRange(args.input_len, args.range_ratio),
                              LengthRange(args.output_len, args.range_ratio), args.num_prefixes,
                              args.prefix_len, args.turns, args.api, args.seed),
        load=LoadConfig(args.request_rate, args.max_concurrency, num_prompts, args.duration, args.seed),
        tokenizer=args.tokenizer,
        slo=SLO.parse(args.goodput),
        sweep_concurrency=sweep,
        progress=not args.no_progress,
        save_text=args.save_text,
    )


def run_serve(args) -> int:
    from rich.console import Console

    from orchard.cluster.bench.loadgen import run_bench
    from orchard.cluster.bench.loadgen.report import print_summary, write_json

    try:
        cfg = serve_config(args)
    except ValueError as exc:
        print(f"orchard bench serve: {exc}", file=sys.stderr)
        return 2
    console = Console(stderr=True)
    doc = run_bench(cfg, console)
    print_summary(doc, Console())
    if args.result_file:
        write_json(doc, args.result_file)
        console.print(f"result written to {args.result_file}")
    plot_dir = args.plot_dir or (os.path.dirname(os.path.abspath(args.result_file)) if args.result_file else None)
    if plot_dir:
        from orchard.cluster.bench.loadgen.plots import write_plots

        stem = os.path.splitext(os.path.basename(args.result_file))[0] if args.result_file else "bench"
        for path in write_plots(doc, plot_dir, stem):
            console.print(f"plot written to {path}")
    return 0 if doc["runs"] and all(r["summary"]["completed"] for r in doc["runs"]) else 1


def run_compare(args) -> int:
    from orchard.cluster.bench.loadgen.compare import compare_documents, print_comparison
    from orchard.cluster.bench.loadgen.report import load_json

    rows = compare_documents(load_json(args.a), load_json(args.b))
    print_comparison(rows, args.a, args.b)
    return 0

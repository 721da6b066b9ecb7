"""The benchmarks live in orchard/cluster/bench: every `orchard bench` subcommand reaches its module, and the
libraries they measure (kvcache, kernels, node) import none of them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from orchard.cluster.cli.bench import DELEGATED
from orchard.cluster.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(DELEGATED))
def test_every_delegated_subcommand_names_a_cluster_bench_module_with_main(name):
    module_name, _ = DELEGATED[name]
    assert module_name.startswith("orchard.cluster.bench.")
    assert callable(importlib.import_module(module_name).main)


@pytest.mark.parametrize("name", ["engine", "grammar", "kernels"])
def test_moved_benchmarks_answer_help_through_orchard_bench(name, capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["bench", name, "--help"])
    assert exit_info.value.code == 0
    assert capsys.readouterr().out.startswith("usage:")


def _imported_modules(path: Path):
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.ImportFrom) and node.module and not node.level:
            yield node.module
        elif isinstance(node, ast.Import):
            yield from (alias.name for alias in node.names)


@pytest.mark.parametrize("package", ["kvcache", "kernels", "node"])
def test_libraries_import_nothing_from_the_cluster(package):
    offenders = sorted(
        f"{path.relative_to(ROOT)}: {module}"
        for path in (ROOT / "orchard" / package).rglob("*.py")
        for module in _imported_modules(path)
        if module == "orchard.cluster" or module.startswith("orchard.cluster.")
    )
    assert not offenders


def test_the_serve_comparison_without_ray_compares_the_no_ray_server():
    """A host without Ray (the accelerator) measures `orchard serve --no-ray` against mlx_lm.server."""
    from orchard.cluster.bench import gateway

    cfg = gateway.parse_args(["--no-ray"])[0]
    assert not cfg.ray and cfg.peer
    load = lambda tok_s: {"output_throughput": tok_s, "ttft_ms": {"p50": 50.0}, "tpot_ms": {"p50": 9.0},  # noqa: E731
                          "completed": 96, "failed": 0}
    result = {"config": vars(cfg), "ttft_http_p50_ms": None, "ttft_http_no_ray_p50_ms": 12.0, "ttft_direct_p50_ms": 10.0,
              "orchard": None, "orchard_no_ray": load(300.0), "mlx_lm_server": load(200.0)}
    text = gateway.table(result)
    assert "| output tok/s, 32 streaming clients, orchard serve --no-ray | 300.0 (orchard --no-ray) | 200.0 (mlx_lm.server) | 1.50x | >= 1.5x: met |" in text
    assert "| 12.0 ms (HTTP) | 10.0 ms (engine direct) | +2.0 ms |" in text.splitlines()[2]
    assert "one request at a time" not in text  # the Ray path's TTFT row: not measured


def test_rounds_give_each_rounds_ratio_and_read_the_target_on_their_median():
    from orchard.cluster.bench import gateway

    cfg = gateway.parse_args(["--rounds", "3"])[0]
    assert cfg.rounds == 3 and cfg.ray and cfg.peer
    load = lambda tok_s: {"output_throughput": tok_s, "ttft_ms": {"p50": 50.0}, "tpot_ms": {"p50": 9.0},  # noqa: E731
                          "completed": 96, "failed": 0}
    rounds = [gateway._rates(load(280.0), load(300.0), load(200.0)),  # 1.40x, 1.50x
              gateway._rates(load(330.0), load(310.0), load(200.0)),  # 1.65x, 1.55x
              gateway._rates(load(155.0), load(140.0), load(100.0))]  # 1.55x, 1.40x
    result = {"config": vars(cfg), "ttft_http_p50_ms": 14.0, "ttft_http_no_ray_p50_ms": 12.0, "ttft_direct_p50_ms": 10.0,
              "orchard": load(280.0), "orchard_no_ray": load(300.0), "mlx_lm_server": load(200.0), "rounds": rounds}
    text = gateway.table(result)
    assert "| 280.0 (orchard) | 200.0 (mlx_lm.server) | 1.40x | >= 1.5x: missed |" in text  # the first round's own row
    assert ("| output tok/s ratio, orchard serve, median of 3 rounds | 1.550x | rounds: 1.40x, 1.65x, 1.55x |  | >= 1.5x: met |"
            in text)
    assert ("| output tok/s ratio, orchard serve --no-ray, median of 3 rounds | 1.500x | rounds: 1.50x, 1.55x, 1.40x |  | >= 1.5x: met |"
            in text)
    one_round = dict(result, rounds=rounds[:1])
    assert "median of" not in gateway.table(one_round)


def test_the_gateway_bench_peer_is_mlx_lm_server_with_a_listen_backlog_of_128():
    import subprocess
    import sys

    from orchard.cluster.bench import gateway

    launcher = gateway.PEER_LAUNCHER.replace("from mlx_lm.server import main; main()",
                                             "print(socketserver.TCPServer.request_queue_size)")
    assert subprocess.run([sys.executable, "-c", launcher], capture_output=True, text=True, check=True).stdout.strip() == "128"
    usage = subprocess.run([sys.executable, "-c", gateway.PEER_LAUNCHER, "--help"], capture_output=True, text=True, check=True).stdout
    assert usage.startswith("usage: mlx_lm.server") and "--decode-concurrency" in usage

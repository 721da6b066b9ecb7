"""The benchmarks live in cluster/bench: every `orchard bench` subcommand reaches its module, and the
libraries they measure (kvcache, kernels, node) import none of them."""

from __future__ import annotations

import ast
import importlib
from pathlib import Path

import pytest

from cluster.cli.bench import DELEGATED
from cluster.cli.main import main

ROOT = Path(__file__).resolve().parents[2]


@pytest.mark.parametrize("name", sorted(DELEGATED))
def test_every_delegated_subcommand_names_a_cluster_bench_module_with_main(name):
    module_name, _ = DELEGATED[name]
    assert module_name.startswith("cluster.bench.")
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
        for path in (ROOT / package).rglob("*.py")
        for module in _imported_modules(path)
        if module == "cluster" or module.startswith("cluster.")
    )
    assert not offenders

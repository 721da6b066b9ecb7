"""Every module of the project is imported under `orchard.`: a bare `kernels`, `node`, `cluster` or
`kvcache` names whatever another distribution installed at the top level (transformers brings a
`kernels`), so such an import works in one environment and breaks in the next."""

from __future__ import annotations

import ast
import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("kvcache", "kernels", "node", "cluster")
SOURCES = sorted(p for folder in ("orchard", "tests", "experiments", "deploy") for p in (ROOT / folder).rglob("*.py"))


def _bare_imports(path: Path) -> list[str]:
    found = []
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        names = ([node.module] if isinstance(node, ast.ImportFrom) and node.module and not node.level
                 else [a.name for a in node.names] if isinstance(node, ast.Import) else [])
        found += [f"{path.relative_to(ROOT)}:{node.lineno}: {name}" for name in names
                  if name.split(".")[0] in PACKAGES]
    return found


def test_no_module_imports_a_package_of_the_project_by_its_bare_name():
    assert len(SOURCES) > 300
    assert not [line for path in SOURCES for line in _bare_imports(path)]


@pytest.mark.parametrize("package", PACKAGES)
def test_each_package_is_found_under_orchard_in_this_checkout(package):
    spec = importlib.util.find_spec(f"orchard.{package}")
    assert spec is not None and Path(spec.origin).parent == ROOT / "orchard" / package

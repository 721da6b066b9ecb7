"""The README's supported-architectures table says what the family tests test, so the two cannot drift.

A `model_type` marked served must be one the token-exact family tests run (tests/node/test_families.py,
tests/node/test_hybrid.py for hybrid models, directly or through mlx-lm's own alias for it), and every
family they run must be marked served.
"""

from __future__ import annotations

import importlib.util
import re
from pathlib import Path

from mlx_lm.utils import MODEL_REMAPPING

from tests.node.test_families import FAMILIES, QUANTIZED
from tests.node.tiny_models import HYBRID_CONFIGS, REFUSED_CONFIGS, TINY_CONFIGS

README = Path(__file__).resolve().parents[2] / "README.md"


def table_rows() -> list[tuple[set[str], str]]:
    """(model types named in the first column, status column) of each row of the architectures table."""
    text = README.read_text().split("### Supported architectures", 1)[1]
    rows = []
    for line in text.splitlines():
        cells = [cell.strip() for cell in line.strip().strip("|").split("|")]
        if len(cells) == 3 and cells[0].startswith("`"):
            named = re.findall(r"`([a-z0-9_]+)`", cells[0])
            rows.append(({name for name in named if is_model_type(name)}, cells[2]))
    return rows


def is_model_type(name: str) -> bool:
    """A name mlx-lm has a model module for (directly or as an alias), not a config field named beside it."""
    return importlib.util.find_spec(f"mlx_lm.models.{MODEL_REMAPPING.get(name, name)}") is not None


def model_type_of(name: str) -> str:
    config = {**TINY_CONFIGS, **HYBRID_CONFIGS, **REFUSED_CONFIGS}[name]
    return config["model_type"]


def families_tested() -> set[str]:
    names = set(FAMILIES) | {base for base, _, _ in QUANTIZED.values()} | set(HYBRID_CONFIGS)  # test_hybrid runs each
    return {model_type_of(name) for name in names}


def test_every_served_type_in_the_readme_is_tested_token_exact():
    served = set().union(*(types for types, status in table_rows() if status.startswith("served")))
    untested = {t for t in served if MODEL_REMAPPING.get(t, t) not in families_tested() and t not in families_tested()}
    assert not untested, f"the README marks {sorted(untested)} served, but tests/node/test_families.py does not run them"


def test_every_family_the_tests_run_is_marked_served():
    served = set().union(*(types for types, status in table_rows() if status.startswith("served")))
    assert families_tested() <= served, f"tested but not in the README's table: {sorted(families_tested() - served)}"

import json

import pytest

from orchard.cluster.bench.loadgen.compare import compare_documents
from orchard.cluster.bench.loadgen.report import write_json
from orchard.cluster.cli.main import main
from tests.loadgen.docs import document


def rows_by_metric(rows, level="unbounded"):
    return {r.metric: r for r in rows if r.level == level}


def test_ratios_are_b_over_a_for_every_headline_metric():
    a = document(ttft=0.1, gap=0.02, n=4, duration_s=2.0)
    b = document(ttft=0.05, gap=0.01, n=4, duration_s=1.0)
    rows = rows_by_metric(compare_documents(a, b))
    assert rows["request_throughput"].ratio == pytest.approx(2.0)  # same count in half the time
    assert rows["output_throughput"].ratio == pytest.approx(2.0)
    assert rows["ttft_ms.mean"].ratio == pytest.approx(0.5)
    assert rows["itl_ms.p99"].ratio == pytest.approx(0.5)
    assert rows["e2el_ms.p50"].ratio == pytest.approx(0.5)
    assert rows["tpot_ms.mean"].ratio == pytest.approx(0.5)
    assert rows["completed"].ratio == pytest.approx(1.0)
    assert rows["ttft_ms.mean"].a == pytest.approx(a["runs"][0]["summary"]["ttft_ms"]["mean"])


def test_ratio_is_undefined_when_a_is_zero():
    a, b = document(), document()
    rows = rows_by_metric(compare_documents(a, b))
    assert rows["failed"].a == 0 and rows["failed"].ratio is None


def test_sweeps_are_paired_by_concurrency_level_not_position():
    a = document(levels=(1, 4), duration_s=2.0)
    b = document(levels=(4, 1), duration_s=2.0)
    b["runs"][0]["summary"]["output_throughput"] *= 3  # level 4 in B
    rows = compare_documents(a, b)
    assert rows_by_metric(rows, "4")["output_throughput"].ratio == pytest.approx(3.0)
    assert rows_by_metric(rows, "1")["output_throughput"].ratio == pytest.approx(1.0)


def test_compare_command_prints_the_ratio_table(tmp_path, capsys):
    a, b = tmp_path / "a.json", tmp_path / "b.json"
    write_json(document(duration_s=2.0), str(a))
    write_json(document(duration_s=4.0), str(b))
    assert json.loads(a.read_text())["schema"] == "orchard-bench-serve/1"
    assert main(["bench", "compare", str(a), str(b)]) == 0
    out = capsys.readouterr().out
    line = next(row for row in out.splitlines() if "request_throughput" in row)
    cells = [c.strip() for c in line.strip("│ \n").split("│")]
    assert cells == ["unbounded", "request_throughput", "2.00", "1.00", "0.500x", "A"]  # A is better


def test_runs_with_different_levels_are_paired_by_position_and_labelled_with_both():
    rows = compare_documents(document(levels=(2,)), document(levels=(None,)))
    assert {r.level for r in rows} == {"2 vs unbounded"}

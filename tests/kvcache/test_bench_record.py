"""`orchard bench kv` prints its table and touches no file unless `--record` names one."""

from __future__ import annotations

from orchard.cluster.bench import kvcache as bench

QUICK = ["--sequences", "20", "--cold-blocks", "2", "--no-recompute"]


def test_the_benchmark_records_only_when_asked(tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert bench.main(QUICK) == 0
    assert list(tmp_path.iterdir()) == []  # no docs/benchmarks.md appeared
    target = tmp_path / "figures.md"
    target.write_text("# Benchmarks\n\n## other\n\nkept\n")
    assert bench.main([*QUICK, "--record", str(target)]) == 0
    text = target.read_text()
    assert "## other\n\nkept" in text and bench.SECTION in text

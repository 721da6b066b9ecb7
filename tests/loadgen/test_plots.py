from orchard.cluster.bench.loadgen.plots import latency_samples, write_plots
from tests.loadgen.docs import document

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_single_run_writes_a_latency_cdf_png(tmp_path):
    paths = write_plots(document(), str(tmp_path), "one")
    assert [p.rsplit("/", 1)[1] for p in paths] == ["one_latency_cdf.png"]
    assert open(paths[0], "rb").read(8) == PNG_MAGIC


def test_sweep_also_writes_throughput_against_concurrency(tmp_path):
    paths = write_plots(document(levels=(1, 4, 16)), str(tmp_path), "sweep")
    names = sorted(p.rsplit("/", 1)[1] for p in paths)
    assert names == ["sweep_latency_cdf.png", "sweep_throughput_vs_concurrency.png"]
    for p in paths:
        data = open(p, "rb").read()
        assert data[:8] == PNG_MAGIC and len(data) > 10_000


def test_itl_samples_are_every_gap_of_every_successful_request():
    run = document(n=3)["runs"][0]
    run["requests"][0]["error"] = "HTTP 500"
    assert len(latency_samples(run, "itl_ms")) == 4
    assert len(latency_samples(run, "ttft_ms")) == 2

import pytest

from orchard.cluster.bench.loadgen.metrics import SLO, BadSLO, Distribution, summarize
from tests.loadgen.records import record


def ten_records():
    # TTFT 100, 200, ..., 1000 ms; two 20 ms gaps each; 3 output tokens; 10 prompt tokens.
    return [record(ttft=0.1 * i, itl=(0.02, 0.02)) for i in range(1, 11)]


def test_percentiles_interpolate_between_sorted_samples():
    d = Distribution.of_seconds([0.1 * i for i in range(10, 0, -1)])
    assert d.count == 10
    assert d.mean == pytest.approx(550.0)
    assert d.p50 == pytest.approx(550.0)
    assert d.p90 == pytest.approx(910.0)
    assert d.p99 == pytest.approx(991.0)
    assert (d.min, d.max) == (pytest.approx(100.0), pytest.approx(1000.0))


def test_empty_distribution_has_count_zero_and_no_values():
    assert Distribution.of_seconds([]) == Distribution(count=0)


def test_summary_counts_tokens_and_throughput_over_wall_time():
    s = summarize(ten_records() + [record(error="HTTP 500: boom")], duration_s=2.0)
    assert (s.completed, s.failed) == (10, 1)
    assert (s.total_input_tokens, s.total_output_tokens) == (100, 30)
    assert s.request_throughput == pytest.approx(5.0)
    assert s.output_throughput == pytest.approx(15.0)
    assert s.total_token_throughput == pytest.approx(65.0)
    assert s.errors == {"HTTP 500: boom": 1}
    assert s.itl_ms.count == 20 and s.itl_ms.mean == pytest.approx(20.0)
    assert s.e2el_ms.p50 == pytest.approx(590.0)
    assert s.token_count_source == "usage"


def test_tpot_spreads_decode_time_over_usage_tokens_not_chunks():
    rec = record(ttft=0.1, itl=(0.02, 0.04), out=5)  # 3 chunks, but the server says 5 tokens
    assert rec.tpot_s == pytest.approx(0.06 / 4)
    assert record(ttft=0.1, itl=(), out=1).tpot_s is None


def test_goodput_counts_requests_within_every_slo():
    slo = SLO.parse(["ttft:500", "tpot:50"])
    s = summarize(ten_records(), duration_s=2.0, slo=slo)
    assert s.goodput == pytest.approx(5 / 2.0)  # TTFT 100..500 ms pass, all TPOTs are 20 ms
    strict = summarize(ten_records(), duration_s=2.0, slo=SLO.parse(["tpot:10"]))
    assert strict.goodput == 0.0
    assert summarize(ten_records(), 2.0).goodput is None


def test_goodput_never_counts_failed_requests():
    assert not SLO(ttft_ms=10_000).met(record(error="timeout"))


def test_slo_parse_reads_milliseconds_per_metric():
    assert SLO.parse(["ttft:500", "tpot:50", "e2el:2000"]) == SLO(500.0, 50.0, 2000.0)
    assert SLO.parse(None) is None


@pytest.mark.parametrize("item", ["ttft", "latency:5", "tpot:fast"])
def test_slo_parse_rejects_malformed_items(item):
    with pytest.raises(BadSLO):
        SLO.parse([item])

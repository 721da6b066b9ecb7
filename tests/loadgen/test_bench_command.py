import sys
import types

import pytest

from orchard.cluster.cli.bench import DELEGATED, serve_config
from orchard.cluster.cli.main import build_parser, main


def test_delegated_bench_gets_every_argument_including_help(monkeypatch):
    seen = []
    fake = types.ModuleType("orchard_fake_bench")
    fake.main = lambda argv: seen.append(argv) or 7
    monkeypatch.setitem(sys.modules, "orchard_fake_bench", fake)
    monkeypatch.setitem(DELEGATED, "engine", ("orchard_fake_bench", "fake"))
    assert main(["bench", "engine", "--steps", "3", "-h", "x"]) == 7
    assert seen == [["--steps", "3", "-h", "x"]]


def test_serve_arguments_become_a_validated_config():
    args = build_parser().parse_args([
        "bench", "serve", "--base-url", "http://127.0.0.1:9", "--dataset", "prefix-repetition",
        "--input-len", "64", "--output-len", "16", "--range-ratio", "0.5", "--num-prefixes", "2",
        "--request-rate", "4", "--sweep-concurrency", "1,4,16", "--goodput", "ttft:500", "tpot:50",
        "--duration", "30", "--api-key", "k"])
    cfg = serve_config(args)
    assert cfg.levels == (1, 4, 16)
    assert (cfg.load.request_rate, cfg.load.duration_s, cfg.load.num_prompts) == (4.0, 30.0, None)
    assert (cfg.dataset.name, cfg.dataset.num_prefixes, cfg.dataset.input_len.low) == ("prefix-repetition", 2, 32)
    assert (cfg.slo.ttft_ms, cfg.slo.tpot_ms) == (500.0, 50.0)
    assert cfg.endpoint.headers() == {"Authorization": "Bearer k"}


def test_serve_defaults_to_one_hundred_prompts_in_a_burst():
    cfg = serve_config(build_parser().parse_args(["bench", "serve"]))
    assert cfg.load.num_prompts == 100 and cfg.load.request_rate == float("inf")
    assert cfg.levels == (None,)


def test_num_prompts_and_duration_are_mutually_exclusive():
    with pytest.raises(SystemExit):
        build_parser().parse_args(["bench", "serve", "--num-prompts", "3", "--duration", "2"])


def test_bad_goodput_item_exits_with_status_2(capsys):
    assert main(["bench", "serve", "--goodput", "speed:3", "--no-progress"]) == 2
    assert "goodput item 'speed:3'" in capsys.readouterr().err

"""The demo model: byte-identical everywhere, loadable by mlx-lm's own loader, cached once."""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
import threading
from pathlib import Path

import pytest

from orchard.node.model import demo
from orchard.node.model.demo import DEMO_CONFIG, LARGE_DEMO_CONFIG, UnknownDemoSize, write_demo_model

REPO_ROOT = Path(__file__).resolve().parents[3]
FILES = ("config.json", "model.safetensors", "tokenizer.json", "tokenizer_config.json",
         "special_tokens_map.json", "generation_config.json")


def _digests(folder: Path) -> dict[str, str]:
    return {name: hashlib.sha256((folder / name).read_bytes()).hexdigest() for name in FILES}


@pytest.fixture(scope="module")
def demo_path(tmp_path_factory) -> Path:
    return write_demo_model(tmp_path_factory.mktemp("demo") / "model")


def test_two_writes_in_separate_processes_give_identical_bytes(demo_path, tmp_path):
    # A fresh interpreter has other hash seeds and thread timings: the bytes must not care.
    other = tmp_path / "again"
    code = f"from orchard.node.model.demo import write_demo_model; write_demo_model({str(other)!r})"
    subprocess.run([sys.executable, "-c", code], cwd=REPO_ROOT, check=True, timeout=120)
    assert _digests(other) == _digests(demo_path)


def test_config_declares_llama_with_the_tokenizer_vocabulary(demo_path):
    config = json.loads((demo_path / "config.json").read_text())
    tokenizer = json.loads((demo_path / "tokenizer.json").read_text())
    assert config["model_type"] == "llama"
    assert config["vocab_size"] == len(tokenizer["model"]["vocab"])
    assert 2000 <= config["vocab_size"] <= 4096
    assert (config["num_hidden_layers"], config["num_key_value_heads"], config["head_dim"]) == (4, 2, 64)


def test_tokenizer_config_has_no_chat_template_and_names_eos(demo_path):
    tok_config = json.loads((demo_path / "tokenizer_config.json").read_text())
    assert "chat_template" not in tok_config
    assert tok_config["eos_token"] == "<|endoftext|>"
    assert json.loads((demo_path / "generation_config.json").read_text())["eos_token_id"] == [0, 2]


def test_mlx_lm_loads_it_and_special_tokens_encode_as_one_id(demo_path):
    import mlx_lm

    _, tokenizer = mlx_lm.load(str(demo_path))
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[0] == 1
    assert tokenizer.encode("<|im_start|>user<|im_end|>")[-1] == 2
    assert tokenizer.eos_token_ids == {0, 2}
    text = "The grandmother's jars: apple butter, café au lait — 12 of them."
    assert tokenizer.decode(tokenizer.encode(text)) == text


def test_mlx_lm_generate_gives_varied_repeatable_greedy_text(demo_path):
    import mlx_lm
    from mlx_lm.generate import stream_generate

    model, tokenizer = mlx_lm.load(str(demo_path))
    runs = [[r.token for r in stream_generate(model, tokenizer, "The orchard on the hill", max_tokens=24)]
            for _ in range(2)]
    assert runs[0] == runs[1]
    assert len(set(runs[0])) >= 12  # not one token repeated
    assert mlx_lm.generate(model, tokenizer, "Why do the old trees lean", max_tokens=8) != ""


def test_large_config_is_selectable_by_size_and_unknown_sizes_fail():
    assert demo.demo_config("large") is LARGE_DEMO_CONFIG
    assert LARGE_DEMO_CONFIG.hidden_size == 1024 and LARGE_DEMO_CONFIG.num_hidden_layers >= 8
    assert demo.demo_config("small") is DEMO_CONFIG
    with pytest.raises(UnknownDemoSize, match="huge"):
        write_demo_model("/nonexistent", size="huge")


def test_cache_dir_prefers_orchard_then_xdg_then_home(monkeypatch, tmp_path):
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    monkeypatch.delenv("ORCHARD_CACHE_DIR", raising=False)
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    assert demo.cache_dir() == tmp_path / "home" / ".cache" / "mlx-orchard"
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert demo.cache_dir() == tmp_path / "xdg" / "mlx-orchard"
    monkeypatch.setenv("ORCHARD_CACHE_DIR", str(tmp_path / "orchard"))
    assert demo.cache_dir() == tmp_path / "orchard"


def test_default_path_is_written_once_even_when_raced(monkeypatch, tmp_path, demo_path):
    monkeypatch.setenv("ORCHARD_CACHE_DIR", str(tmp_path))
    results: list[Path] = []
    threads = [threading.Thread(target=lambda: results.append(demo.default_demo_model_path()))
               for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    expected = tmp_path / f"demo-model-v{demo.DEMO_MODEL_VERSION}"
    assert results == [expected] * 3
    assert sorted(p.name for p in tmp_path.iterdir()) == [expected.name]  # no temporary leftovers
    assert _digests(expected) == _digests(demo_path)
    before = (expected / "model.safetensors").stat().st_mtime_ns
    assert demo.default_demo_model_path() == expected
    assert (expected / "model.safetensors").stat().st_mtime_ns == before

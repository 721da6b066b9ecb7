"""The model fingerprint covers every weight byte, the config and the tokenizer."""

from __future__ import annotations

import json
import shutil
import struct

import numpy as np
import pytest

from orchard.node.model.fingerprint import model_fingerprint
from orchard.node.model.loader import load_model

EDGE = 1 << 20  # what a sampled fingerprint would read from each end of a weight file


def tensor_spans(weights) -> dict[str, tuple[str, int, int]]:
    """name -> (dtype, start, end) in file offsets, from the safetensors header."""
    raw = weights.read_bytes()
    (header_len,) = struct.unpack("<Q", raw[:8])
    header = json.loads(raw[8 : 8 + header_len])
    base = 8 + header_len
    return {
        name: (meta["dtype"], base + meta["data_offsets"][0], base + meta["data_offsets"][1])
        for name, meta in header.items() if name != "__metadata__"
    }


def scale_middle_tensor(weights) -> str:
    """Scale, in place, the tensor nearest the file's middle and clear of both edges; its name."""
    size = weights.stat().st_size
    spans = {n: s for n, s in tensor_spans(weights).items() if s[0] == "F32" and s[1] >= EDGE and s[2] <= size - EDGE}
    assert spans, "the demo model is too small for a tensor away from both edges"
    name = min(spans, key=lambda n: abs((spans[n][1] + spans[n][2]) / 2 - size / 2))
    _, start, end = spans[name]
    data = bytearray(weights.read_bytes())
    data[start:end] = (np.frombuffer(bytes(data[start:end]), dtype="<f4") * 1.5).astype("<f4").tobytes()
    weights.write_bytes(bytes(data))
    return name


@pytest.fixture
def copy_of(demo_model_dir, tmp_path):
    copy = tmp_path / "copy"
    shutil.copytree(demo_model_dir, copy)
    return copy


def test_scaling_one_middle_tensor_changes_the_fingerprint(demo_model_dir, copy_of):
    assert model_fingerprint(copy_of) == model_fingerprint(demo_model_dir)
    weights = copy_of / "model.safetensors"
    before = weights.read_bytes()
    scale_middle_tensor(weights)
    after = weights.read_bytes()
    assert len(after) == len(before) and after[:EDGE] == before[:EDGE] and after[-EDGE:] == before[-EDGE:]
    assert model_fingerprint(copy_of) != model_fingerprint(demo_model_dir)


def test_the_tokenizer_is_part_of_the_fingerprint(demo_model_dir, copy_of):
    tokenizer = json.loads((copy_of / "tokenizer.json").read_text())
    tokenizer.setdefault("added_tokens", []).append(
        {"id": 99999, "content": "<|extra|>", "single_word": False, "lstrip": False, "rstrip": False,
         "normalized": False, "special": True}
    )
    (copy_of / "tokenizer.json").write_text(json.dumps(tokenizer))
    assert model_fingerprint(copy_of) != model_fingerprint(demo_model_dir)


def test_loaded_models_carry_the_full_fingerprint(demo_model_dir, copy_of):
    scale_middle_tensor(copy_of / "model.safetensors")
    original, scaled = load_model(str(demo_model_dir)), load_model(str(copy_of))
    assert original.fingerprint == model_fingerprint(demo_model_dir)
    assert scaled.fingerprint == model_fingerprint(copy_of)
    assert original.geometry(16).model_fingerprint != scaled.geometry(16).model_fingerprint

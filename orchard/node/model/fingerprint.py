"""A checkpoint's identity: one hash over every byte of its weights, config and tokenizer.

Block-hash roots, cold-tier file names and migration payloads all key on this id, so two
checkpoints that share it would share KV computed by the other. It therefore covers every
weight byte, not a sample of them: a tensor scaled anywhere in the middle of a file
changes it. xxh3 runs at memory bandwidth, so hashing is bounded by reading the files
once at load (the loader reads them right after, from the page cache).
"""

from __future__ import annotations

from pathlib import Path

import xxhash

FINGERPRINT_VERSION = b"orchard-model-fingerprint-v2"
#: Files besides the weights that change what the model computes or how text maps to tokens.
DESCRIPTION_FILES = (
    "config.json",
    "model.safetensors.index.json",
    "generation_config.json",
    "tokenizer.json",
    "tokenizer_config.json",
    "special_tokens_map.json",
    "added_tokens.json",
    "tokenizer.model",
    "vocab.json",
    "merges.txt",
    "chat_template.jinja",
    "chat_template.json",
)
WEIGHT_GLOB = "model*.safetensors"
_CHUNK_BYTES = 8 << 20


def model_fingerprint(path: Path) -> str:
    """32 hex digits naming the checkpoint in `path`; equal only for byte-equal checkpoints."""
    path = Path(path)
    digest = xxhash.xxh3_128(FINGERPRINT_VERSION)
    for name in DESCRIPTION_FILES:
        if (path / name).is_file():
            _update_with_file(digest, path / name)
    for weight_file in sorted(path.glob(WEIGHT_GLOB)):
        _update_with_file(digest, weight_file)
    return digest.hexdigest()


def _update_with_file(digest, file: Path) -> None:
    """Name, size, then every byte: the framing keeps two files from hashing as their concatenation."""
    size = file.stat().st_size
    digest.update(file.name.encode() + b"\0" + str(size).encode() + b"\0")
    buffer = bytearray(_CHUNK_BYTES)
    view = memoryview(buffer)
    with file.open("rb", buffering=0) as f:
        while n := f.readinto(buffer):
            digest.update(view[:n])

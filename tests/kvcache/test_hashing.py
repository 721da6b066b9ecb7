"""Prefix hashes: chained, partial blocks skipped, salted roots, same bytes in every process."""

import os
import subprocess
import sys

import numpy as np

from orchard.kvcache.hashing import block_hashes, hash_block, root_hash

ROOT = root_hash("tiny-llama")


def test_same_tokens_after_a_different_prefix_hash_differently():
    first = block_hashes([1, 2, 3, 4, 9, 9, 9, 9], 4, ROOT)
    second = block_hashes([5, 6, 7, 8, 9, 9, 9, 9], 4, ROOT)
    assert first[1] != second[1]
    assert hash_block(first[0], [9, 9, 9, 9]) == first[1]


def test_each_hash_chains_from_the_previous_one():
    tokens = list(range(12))
    hashes = block_hashes(tokens, 4, ROOT)
    parent = ROOT
    for index, expected in enumerate(hashes):
        parent = hash_block(parent, tokens[index * 4 : index * 4 + 4])
        assert parent == expected


def test_trailing_partial_block_is_not_hashed():
    tokens = list(range(10))
    assert len(block_hashes(tokens, 4, ROOT)) == 2
    assert block_hashes(tokens, 4, ROOT) == block_hashes(tokens[:8], 4, ROOT)
    assert block_hashes(tokens[:3], 4, ROOT) == []


def test_salt_and_model_change_the_root_and_every_hash():
    assert root_hash("tiny-llama", "tenant-a") != ROOT
    assert root_hash("tiny-llama", "tenant-a") != root_hash("tiny-llama", "tenant-b")
    assert root_hash("other-model") != ROOT
    tokens = [1, 2, 3, 4]
    assert block_hashes(tokens, 4, root_hash("tiny-llama", "tenant-a")) != block_hashes(tokens, 4, ROOT)


def test_hash_is_16_bytes_and_ignores_the_container_type():
    by_list = hash_block(ROOT, [1, 2, 3, 4])
    assert len(by_list) == 16
    assert by_list == hash_block(ROOT, (1, 2, 3, 4)) == hash_block(ROOT, np.array([1, 2, 3, 4], dtype=np.int64))


def test_extra_bytes_change_the_hash():
    assert hash_block(ROOT, [1, 2, 3, 4], b"image-0") != hash_block(ROOT, [1, 2, 3, 4])


def _hashes_in_subprocess(seed: str) -> str:
    code = (
        "from orchard.kvcache.hashing import block_hashes, root_hash;"
        "print(b''.join(block_hashes(list(range(40)), 16, root_hash('tiny-llama', 's'))).hex())"
    )
    env = {**os.environ, "PYTHONHASHSEED": seed}
    root = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=root, capture_output=True, text=True, check=True)
    return done.stdout.strip()


def test_hashes_are_equal_across_processes_with_different_hash_seeds():
    here = b"".join(block_hashes(list(range(40)), 16, root_hash("tiny-llama", "s"))).hex()
    assert _hashes_in_subprocess("1") == _hashes_in_subprocess("4242") == here
    assert len(here) == 2 * 16 * 2

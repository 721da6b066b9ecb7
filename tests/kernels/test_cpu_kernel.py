"""The CPU kernel (orchard/kernels/cpu): built where a compiler is, its rows split across threads exactly as one
thread computes them, shapes that do not fit refused, and tables it cannot trust never read outside the pool.
Its agreement with the float64 oracle over every layer variant is in the shared grids (tests/kernels/backends.py)."""

from __future__ import annotations

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path

import mlx.core as mx
import numpy as np
import pytest

from orchard import kernels
from orchard.kernels import cpu
from orchard.kernels.variants import layer_attention
from tests.kernels.paged_case import Rules, assert_close, make_paged_case, oracle_decode, random_stored

REPO = Path(__file__).resolve().parents[2]
needs_kernel = pytest.mark.skipif(not cpu.loaded(), reason="the CPU attention extension is not built here")


def test_make_builds_the_extension_where_a_compiler_is(monkeypatch):
    """In the environment `make` installs (.venv/.installed), with CMake and a C++ compiler at hand, the
    extension must be there: `make` builds it (orchard/kernels/cpu/build.py), so its absence means that step broke."""
    made_here = Path(sys.prefix).resolve() == (REPO / ".venv").resolve() and (REPO / ".venv" / ".installed").exists()
    toolchain = shutil.which("cmake") and shutil.which("c++") and importlib.util.find_spec("nanobind")
    if not (made_here and toolchain):
        pytest.skip("not the environment `make` installs, or no C++ toolchain: nothing says the extension was built")
    assert cpu.loaded(), "the toolchain is here but orchard/kernels/cpu/_paged_cpu is not: run `make venv`"
    monkeypatch.delenv(kernels.ENV_VAR, raising=False)
    if mx.default_device() == mx.cpu:
        assert kernels.default_backend() == "cpu"


@needs_kernel
@pytest.mark.parametrize("rules", [Rules(), Rules(window=100), Rules(sinks=np.linspace(-1.0, 1.0, 8))],
                         ids=["plain", "window", "sinks"])
def test_rows_split_across_threads_match_the_oracle(rules):
    """Enough keys that the call is cut across the worker threads (kParallelWork), lengths uneven."""
    rng = np.random.default_rng(7)
    lengths = rng.integers(1, 700, size=24).astype(np.int32)
    case = make_paged_case(rng, lengths, 2, 64, 16, "float32")
    queries = random_stored(rng, (24, 8, 64), "float32")
    out = kernels.paged_attention(queries, case.key_cache, case.value_cache, case.block_tables, case.context_lens,
                                  scale=0.125, backend="cpu", **rules.kwargs())
    assert_close(out, oracle_decode(case, queries, 0.125, rules), "float32")


@needs_kernel
def test_packed_rows_are_answered_in_the_order_asked():
    """`query_rows` picks rows of the packed queries; the answer keeps the order of the pick."""
    rng = np.random.default_rng(3)
    case = make_paged_case(rng, [40, 9, 77], 2, 64, 16, "float32")
    queries = random_stored(rng, (3, 4, 64), "float32")
    packed = mx.concatenate([mx.zeros((5, 4, 64)), queries[2:3], mx.zeros((2, 4, 64)), queries[0:1], queries[1:2]])
    rows = mx.array([5, 8, 9], dtype=mx.int32)
    tables, lengths = mx.array(case.block_tables[[2, 0, 1]]), mx.array(case.context_lens[[2, 0, 1]])
    out = cpu.attend_rows(packed, rows, case.key_cache, case.value_cache, tables, lengths, 0.125)
    expected = oracle_decode(case, queries, 0.125)
    assert_close(out, expected[[2, 0, 1]], "float32")


@needs_kernel
def test_shapes_that_do_not_fit_are_a_value_error():
    rng = np.random.default_rng(1)
    case = make_paged_case(rng, [20, 30], 2, 64, 16, "float32")
    queries = random_stored(rng, (2, 4, 64), "float32")
    rows, tables, lengths = mx.arange(2, dtype=mx.int32), mx.array(case.block_tables), mx.array(case.context_lens)
    with pytest.raises(ValueError, match="do not fit"):
        cpu.attend_rows(queries, rows, case.key_cache, case.value_cache[:, :8], tables, lengths, 0.125)
    with pytest.raises(ValueError, match="do not fit"):
        cpu.attend_rows(queries[:, :3], rows, case.key_cache, case.value_cache, tables, lengths, 0.125)
    with pytest.raises(ValueError, match="no queries"):
        cpu.attend_rows(queries[:0], rows, case.key_cache, case.value_cache, tables, lengths, 0.125)
    with pytest.raises(ValueError, match="sinks"):
        cpu.attend_rows(queries, rows, case.key_cache, case.value_cache, tables, lengths, 0.125,
                        layer_attention(None, None, mx.zeros((3,))))


@needs_kernel
def test_metadata_outside_the_pool_or_the_queries_is_clamped_into_them():
    """Device-array metadata is checked by shape only (no host read per step); a block id outside
    the pool (read as the null block), a length past the table or a query row past the queries
    must still never make the kernel read outside its inputs."""
    rng = np.random.default_rng(5)
    case = make_paged_case(rng, [32, 32], 2, 64, 16, "float32")
    pool_keys = mx.ones(case.key_cache.shape)
    queries = random_stored(rng, (2, 4, 64), "float32")
    tables = np.array(case.block_tables)
    tables[0, 0], tables[1, 1] = 10**6, -5
    lengths = mx.array([32, 10**6], dtype=mx.int32)
    out = kernels.paged_attention(queries, pool_keys, pool_keys, mx.array(tables), lengths, scale=0.125, backend="cpu")
    assert np.allclose(np.array(out), 1.0)  # every slot it read holds ones: it read the pool, nothing else
    rows = mx.array([7, -3], dtype=mx.int32)  # rows past the packed queries are clamped to them
    out = cpu.attend_rows(queries, rows, pool_keys, pool_keys, mx.array(tables), lengths, 0.125)
    assert out.shape == (2, 4, 64) and np.allclose(np.array(out), 1.0)


@needs_kernel
def test_one_thread_computes_exactly_what_the_split_computes(tmp_path):
    """ORCHARD_CPU_ATTENTION_THREADS=1 in a process of its own (the threads are made once a process)."""
    script = f"""
import numpy as np, mlx.core as mx
from orchard.kernels import cpu
rng = np.random.default_rng(2)
keys = mx.array(rng.standard_normal((400, 16, 2, 64)).astype(np.float32))
queries = mx.array(rng.standard_normal((48, 4, 64)).astype(np.float32))
tables = mx.array(rng.permutation(np.arange(1, 400))[:384].reshape(48, 8).astype(np.int32))
lengths = mx.array(rng.integers(1, 129, size=48).astype(np.int32))
out = cpu.attend_rows(queries, mx.arange(48, dtype=mx.int32), keys, keys, tables, lengths, 0.125)
np.save({str(tmp_path)!r} + "/" + __import__("os").environ.get("ORCHARD_CPU_ATTENTION_THREADS", "all") + ".npy", np.array(out))
"""
    for threads in ("1", None):
        env = {k: v for k, v in os.environ.items() if k != "ORCHARD_CPU_ATTENTION_THREADS"}
        if threads:
            env["ORCHARD_CPU_ATTENTION_THREADS"] = threads
        subprocess.run([sys.executable, "-c", script], check=True, env=env, cwd=REPO, timeout=120)
    one, split = np.load(tmp_path / "1.npy"), np.load(tmp_path / "all.npy")
    assert np.isfinite(one).all() and np.array_equal(one, split)

"""The varlen kernel (one launch for a mixed step) and its per-step plan, against the float64 oracle.

Three ways in: the public entry on every backend that runs here (the reference on the
CPU, CUDA on the GPU machine: `python -m pytest tests/kernels/test_varlen.py -m cuda`),
the Metal/CUDA kernel text on the CPU emulator (float32, small shapes), and the plan's
host-side work list checked by itself.
"""

from __future__ import annotations

import ctypes
import re
from dataclasses import replace

import mlx.core as mx
import numpy as np
import pytest

from orchard import kernels
from orchard.kernels import backends, mma_source, source
from orchard.kernels import plan as varlen_plan
from tests.kernels import emulator
from tests.kernels.backends import ALL_BACKENDS, CUDA
from tests.kernels.paged_case import PagedCase, assert_close, make_paged_case, oracle_prefill, random_stored, to_float64

#: (num_heads, num_kv_heads): GQA ratios 1, 4 and 8
HEADS = [(8, 8), (32, 8), (64, 8)]


@pytest.fixture
def rng():
    return np.random.default_rng()  # fresh inputs every run; a failure prints the values


def mixed_step(rng: np.random.Generator, chunk_lens, num_decodes: int, max_decode_context: int):
    """(q_lens, context_lens): chunks on random cached prefixes interleaved with decode rows."""
    q_lens, cached = [], []
    for chunk in chunk_lens:
        q_lens += [chunk, 1]
        cached += [int(rng.integers(0, 90)), int(rng.integers(1, max_decode_context))]
    for _ in range(num_decodes - len(chunk_lens)):
        q_lens.append(1)
        cached.append(int(rng.integers(1, max_decode_context)))
    q_lens = np.array(q_lens, dtype=np.int32)
    return q_lens, (q_lens + np.array(cached)).astype(np.int32)


def starts_of(q_lens) -> np.ndarray:
    return np.concatenate([[0], np.cumsum(q_lens)]).astype(np.int32)


def plan_for(case, starts, num_heads: int, backend: str, **tuning) -> kernels.VarlenPlan:
    return kernels.plan_varlen(
        starts, case.context_lens, case.block_tables, block_size=case.block_size, num_heads=num_heads,
        num_kv_heads=case.keys64.shape[2], head_dim=case.keys64.shape[3], backend=backend,
        num_blocks=case.keys64.shape[0], tuning=kernels.VarlenTuning(**tuning) if tuning else None,
    )


# --- the public entry, every backend -------------------------------------------------------


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("dtype", ["float32", "float16", "bfloat16"])
@pytest.mark.parametrize("head_dim", [64, 128])
@pytest.mark.parametrize("num_heads,num_kv_heads", HEADS)
def test_mixed_step_of_chunks_and_decodes_matches_float64_oracle(rng, backend, dtype, head_dim, num_heads, num_kv_heads):
    q_lens, lengths = mixed_step(rng, [1, 7, 16, 17, 500], num_decodes=8, max_decode_context=3000)
    case = make_paged_case(rng, lengths, num_kv_heads, head_dim, 16, dtype)
    starts = starts_of(q_lens)
    queries = random_stored(rng, (int(starts[-1]), num_heads, head_dim), dtype)
    scale = head_dim ** -0.5
    out = kernels.paged_varlen_attention(
        queries, case.key_cache, case.value_cache, plan_for(case, starts, num_heads, backend), scale=scale
    )
    assert out.dtype == queries.dtype
    assert_close(out, oracle_prefill(case, queries, starts, scale), dtype)


def another_layer(rng: np.random.Generator, case: PagedCase) -> PagedCase:
    """The same blocks of a second layer: new contents, the same NaN in every unowned slot."""
    poison = np.where(np.isnan(case.keys64), np.nan, 0.0).astype(np.float32)
    keys = random_stored(rng, case.keys64.shape, "float32") + mx.array(poison)
    values = random_stored(rng, case.keys64.shape, "float32") + mx.array(poison)
    return replace(case, key_cache=keys, value_cache=values, keys64=to_float64(keys), values64=to_float64(values))


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_one_plan_serves_every_layer(rng, backend):
    q_lens, lengths = mixed_step(rng, [7, 33], num_decodes=4, max_decode_context=700)
    starts = starts_of(q_lens)
    first = make_paged_case(rng, lengths, 2, 64, 16, "float32")
    step_plan = plan_for(first, starts, 8, backend)
    for layer in (first, another_layer(rng, first)):
        queries = random_stored(rng, (int(starts[-1]), 8, 64), "float32")
        out = kernels.paged_varlen_attention(queries, layer.key_cache, layer.value_cache, step_plan, scale=0.125)
        assert_close(out, oracle_prefill(layer, queries, starts, 0.125), "float32")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_long_contexts_split_across_partitions_match_oracle(rng, backend):
    lengths = np.array([4100, 1, 2049, 17, 3000], dtype=np.int32)
    case = make_paged_case(rng, lengths, 8, 128, 16, "float16")
    starts = starts_of(np.array([1, 1, 40, 1, 3], dtype=np.int32))
    queries = random_stored(rng, (int(starts[-1]), 32, 128), "float16")
    step_plan = plan_for(case, starts, 32, backend, partition_size=512, min_partition_size=256)
    out = kernels.paged_varlen_attention(queries, case.key_cache, case.value_cache, step_plan, scale=0.09)
    assert_close(out, oracle_prefill(case, queries, starts, 0.09), "float16")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_sequences_without_new_queries_contribute_no_rows(rng, backend):
    case = make_paged_case(rng, [20, 9, 40], 4, 64, 16, "float32")
    starts = np.array([0, 3, 3, 4], dtype=np.int32)
    queries = random_stored(rng, (4, 8, 64), "float32")
    out = kernels.paged_varlen_attention(queries, case.key_cache, case.value_cache, plan_for(case, starts, 8, backend), scale=0.125)
    assert_close(out, oracle_prefill(case, queries, starts, 0.125), "float32")


@pytest.mark.parametrize("backend", [CUDA])
def test_cuda_varlen_matches_cuda_decode_kernel_on_decode_rows(rng, backend):
    case = make_paged_case(rng, [5, 300, 4096, 33], 8, 128, 16, "float16")
    queries = random_stored(rng, (4, 32, 128), "float16")
    varlen = kernels.paged_varlen_attention(
        queries, case.key_cache, case.value_cache, plan_for(case, np.arange(5, dtype=np.int32), 32, backend), scale=0.09
    )
    decode = kernels.paged_attention(
        queries, case.key_cache, case.value_cache, case.block_tables, case.context_lens, scale=0.09, backend=backend
    )
    np.testing.assert_allclose(to_float64(varlen), to_float64(decode), rtol=1e-2, atol=1e-2)


def test_a_plan_is_refused_for_another_backend_or_other_shapes(rng):
    case = make_paged_case(rng, [5, 9], 2, 64, 16, "float32")
    step_plan = plan_for(case, np.array([0, 1, 2], dtype=np.int32), 4, "reference")
    with pytest.raises(kernels.InvalidAttentionMetadata, match="expects queries"):
        kernels.paged_varlen_attention(mx.zeros((3, 4, 64)), case.key_cache, case.value_cache, step_plan, scale=0.1)
    with pytest.raises(kernels.InvalidAttentionMetadata, match="expects queries"):
        kernels.paged_varlen_attention(mx.zeros((2, 8, 64)), case.key_cache, case.value_cache, step_plan, scale=0.1)


# --- metadata checked once, in plan_varlen -------------------------------------------------


def _plan(starts, lengths, tables, num_blocks=8, **kwargs):
    return kernels.plan_varlen(
        np.asarray(starts, dtype=np.int32), np.asarray(lengths, dtype=np.int32), np.asarray(tables, dtype=np.int32),
        block_size=16, num_heads=4, num_kv_heads=kwargs.pop("num_kv_heads", 2), head_dim=64, backend="reference",
        num_blocks=num_blocks, **kwargs,
    )


@pytest.mark.parametrize("starts,lengths,tables,message", [
    ([1, 2, 3], [5, 5], [[1], [2]], "rise from 0"),
    ([0, 3, 2], [5, 5], [[1], [2]], "rise from 0"),
    ([0, 6, 7], [5, 5], [[1], [2]], "more new queries"),
    ([0, 1, 2], [5, 17], [[1], [2]], "context_lens must lie"),
    ([0, 0, 1], [0, 5], [[1], [2]], "context_lens must lie"),
    ([0, 1, 2], [5, 5], [[1], [8]], "block ids"),
    ([0, 1], [5, 5], [[1], [2]], "expected query_start_loc"),
    ([0, 1, 2], [5, 5], [[1]], "expected query_start_loc"),
])
def test_inconsistent_metadata_is_refused_with_a_named_error(starts, lengths, tables, message):
    with pytest.raises(kernels.InvalidAttentionMetadata, match=message):
        _plan(starts, lengths, tables)


def test_heads_that_do_not_group_are_refused_by_the_plan():
    with pytest.raises(kernels.InvalidAttentionMetadata, match="multiple"):
        _plan([0, 1], [5], [[1]], num_kv_heads=3)


def test_padding_entries_past_a_context_are_not_checked_against_the_pool():
    _plan([0, 1], [5], [[1, 99]])  # the second table entry is never read


# --- the work list ------------------------------------------------------------------------


def _work(q_lens, lengths, q_tokens=4, head_tiles=8, **tuning):
    return varlen_plan.work_list(starts_of(q_lens), np.asarray(lengths, dtype=np.int32), q_tokens, head_tiles,
                                 kernels.VarlenTuning(**tuning))


def _unit_fields(work):
    return {name: work.units[:, i] for i, name in enumerate(source.UNIT_FIELDS)}


def test_every_chunk_row_is_in_exactly_one_tile_and_each_tile_covers_its_causal_context():
    q_lens, lengths = [1, 7, 16, 17, 1], [300, 7, 40, 1100, 5000]
    work = _work(q_lens, lengths, partition_size=512, min_partition_size=512)
    units = _unit_fields(work)
    covered = {}
    for seq, row, count, position, start, end in zip(units["seq"], units["query_row"], units["query_count"],
                                                      units["query_position"], units["kv_start"], units["kv_end"]):
        covered.setdefault((int(row), int(count), int(position)), []).append((int(start), int(end)))
        assert position == lengths[seq] - q_lens[seq] + (row - starts_of(q_lens)[seq])
    rows = sorted(r + i for (r, c, _), _ in covered.items() for i in range(c))
    assert rows == list(range(1, 41))  # rows 0 and 41 are decode rows: the decode kernel takes them
    for (_row, count, position), ranges in covered.items():
        ranges.sort()
        assert ranges[0][0] == 0 and ranges[-1][1] == position + count
        assert all(a[1] == b[0] and a[1] - a[0] == 512 for a, b in zip(ranges, ranges[1:]))


def test_decode_rows_are_planned_for_the_decode_kernel_with_their_own_tables():
    tables = np.arange(12, dtype=np.int32).reshape(3, 4)
    step = varlen_plan.plan_kernel("cuda", starts_of([1, 5, 1]), np.array([9, 20, 64], dtype=np.int32), tables,
                                   8, 2, 64, kernels.VarlenTuning())
    rows = step.decode
    assert rows.host_rows.tolist() == [0, 6] and not rows.every_row
    assert np.array(rows.block_tables).tolist() == [[0, 1, 2, 3], [8, 9, 10, 11]]
    assert np.array(rows.context_lens).tolist() == [9, 64]
    assert set(step.work.units[:, 0].tolist()) == {1}
    only_decodes = varlen_plan.plan_kernel("cuda", starts_of([1, 1]), np.array([9, 20], dtype=np.int32), tables[:2],
                                           8, 2, 64, kernels.VarlenTuning())
    assert only_decodes.decode.every_row and only_decodes.num_units == 0


def test_units_are_listed_longest_context_first():
    units = _unit_fields(_work([1, 1, 9], [10, 3000, 200]))
    spans = units["kv_end"] - units["kv_start"]
    assert (np.diff(spans) <= 0).all()


def test_split_tiles_get_disjoint_partial_rows_and_one_merge_row_per_query():
    work = _work([2, 6, 3], [2000, 1500, 10], partition_size=512, min_partition_size=512)
    units = _unit_fields(work)
    split = units["split"] == 1
    assert set(units["seq"][split].tolist()) == {0, 1} and not units["split"][units["seq"] == 2].any()
    partial = [int(p) + i for p, c in zip(units["partial_row"][split], units["query_count"][split]) for i in range(c)]
    assert sorted(partial) == list(range(work.num_partial_rows))
    assert sorted(work.split_rows[:, 0].tolist()) == list(range(8))  # every query of seqs 0 and 1
    assert work.split_rows[work.split_rows[:, 0] == 0, 3].tolist() == [4]  # 2000 tokens in 512s


def test_short_steps_shrink_partitions_to_fill_the_gpu_and_full_ones_do_not():
    one_long_chunk = _work([4], [8192], head_tiles=8, partition_size=1024, min_partition_size=256, target_threadgroups=512)
    assert one_long_chunk.partition_size == 256
    many = _work([4] * 64, [4096] * 64, head_tiles=8, partition_size=1024, target_threadgroups=512)
    assert many.partition_size == 1024


@pytest.mark.parametrize("dialect", ["cuda", "metal"])
@pytest.mark.parametrize("group,head_dim", [(1, 64), (4, 64), (4, 128), (8, 128), (8, 256), (4, 80)])
def test_tile_shape_fits_shared_memory_for_both_pool_widths_and_keeps_whole_gqa_groups(dialect, group, head_dim):
    budget = varlen_plan.SHARED_BYTES[dialect]
    shape = varlen_plan.tile_shape_for(group, head_dim, 500, budget, kernels.VarlenTuning())
    for itemsize in varlen_plan.ITEMSIZES:
        kv_tile = shape.kv_tile_for(itemsize)
        assert varlen_plan.shared_bytes(shape.rows, kv_tile, head_dim, itemsize) <= budget
        assert kv_tile in varlen_plan.KV_TILES and head_dim % kv_tile == 0
        assert shape.threads_for(itemsize) % 32 == 0 and shape.threads_for(itemsize) <= varlen_plan.MAX_THREADS
    assert shape.heads_per_tile == group and shape.rows % varlen_plan.SUB == 0


def test_tiles_hold_64_rows_for_the_measured_shapes_on_cuda():
    budget = varlen_plan.SHARED_BYTES["cuda"]
    shape = varlen_plan.tile_shape_for(4, 128, 512, budget, kernels.VarlenTuning())
    assert (shape.q_tokens, shape.heads_per_tile, shape.kv_tile, shape.threads_for(2)) == (16, 4, 32, 128)
    assert varlen_plan.tile_shape_for(4, 64, 512, budget, kernels.VarlenTuning()).kv_tile == 32
    assert varlen_plan.tile_shape_for(1, 64, 500, budget, kernels.VarlenTuning()).q_tokens == 64


def test_short_chunks_get_short_tiles_but_whole_row_blocks():
    budget = varlen_plan.SHARED_BYTES["cuda"]
    assert varlen_plan.tile_shape_for(4, 128, 3, budget, kernels.VarlenTuning()).q_tokens == 4
    assert varlen_plan.tile_shape_for(1, 64, 2, budget, kernels.VarlenTuning()).rows == 4


def test_head_dims_that_are_not_whole_16_byte_rows_are_refused():
    with pytest.raises(kernels.UnsupportedAttentionShape):
        varlen_plan.tile_shape_for(4, 36, 16, varlen_plan.SHARED_BYTES["cuda"], kernels.VarlenTuning())


# --- the kernel text ------------------------------------------------------------------------


def test_dialects_share_the_varlen_body_and_differ_only_in_prologue():
    for render, prologues in ((source.render_varlen, (source.CUDA_VARLEN_PROLOGUE, source.METAL_VARLEN_PROLOGUE)),
                              (source.render_varlen_merge, (source.CUDA_VARLEN_MERGE_PROLOGUE, source.METAL_VARLEN_MERGE_PROLOGUE))):
        cuda_header, cuda_body = render("cuda")
        _, metal_body = render("metal")
        assert cuda_body.replace(prologues[0], "") == metal_body.replace(prologues[1], "")
        assert "uint " not in cuda_body + cuda_header  # NVRTC has no `uint`
        assert "device " not in metal_body.replace(prologues[1], "")  # small inputs may be bound in `constant`


def test_threadgroup_memory_declared_by_the_body_is_what_the_plan_budgets():
    _, body = source.render_varlen("cuda")
    declared = [line.strip().split(" ", 2)[2] for line in body.splitlines() if line.strip().startswith("SHARED")]
    assert declared == ["T q_tile[HEAD_DIM * ROWS];", "T k_tile[HEAD_DIM * KV_TILE];", "T v_tile[KV_TILE * V_STRIDE];",
                        "float p_tile[KV_TILE * ROWS];"]
    assert "constexpr int V_STRIDE = HEAD_DIM + VEC;" in body and "constexpr int VEC = 16 / int(sizeof(T));" in body


def test_threadgroup_memory_declared_by_the_tensor_core_body_is_what_its_plan_budgets():
    """The bytes come from the body's own text: its constexpr sizes evaluated, then its SHARED arrays summed."""
    _, body = mma_source.render()
    declared = [line.strip().split(" ", 2)[2] for line in body.splitlines() if line.strip().startswith("SHARED")]
    assert [d.split("[")[0] for d in declared] == ["T k_tile", "T v_tile"]  # no Q tile: Q stays in registers
    sizes = dict(re.findall(r"constexpr int (STRIDE|TILE_ELEMS) = ([^;]+);", body))
    for head_dim, kv_tile in ((128, 32), (64, 64), (80, 64)):
        names = {"HEAD_DIM": head_dim, "KV_TILE": kv_tile, "ROW_PAD": mma_source.ROW_PAD}
        for name in ("STRIDE", "TILE_ELEMS"):
            names[name] = eval(sizes[name], {}, names)
        elements = sum(eval(d.split("[")[1].rstrip("];"), {}, names) for d in declared)
        assert elements * 2 == mma_source.shared_bytes(kv_tile, head_dim)


#: (num_kv_heads, group, head_dim, block_size, tuning): every key-tile width, head dims that do and
#: do not divide by 32, partitions small enough that chunks split, and a D=128 tile of 16 rows that fills
#: only half a warp (the other lanes only load and shuffle).
EMULATED = [
    (2, 4, 64, 16, dict(max_query_tokens=4, partition_size=64, min_partition_size=64)),
    (1, 8, 32, 8, dict(max_query_tokens=2, partition_size=96, min_partition_size=96, kv_tile=16)),
    (1, 1, 80, 16, dict(max_query_tokens=8, partition_size=64, min_partition_size=64, kv_tile=8)),
    (1, 2, 64, 32, dict(max_query_tokens=16, partition_size=1024, min_partition_size=1024)),
    (1, 4, 128, 16, dict(max_query_tokens=4, partition_size=128, min_partition_size=128)),
]


@pytest.fixture(scope="module")
def emulator_dir(tmp_path_factory):
    if emulator.COMPILER is None:
        pytest.skip("no g++ to build the CPU emulator of the kernel body")
    return tmp_path_factory.mktemp("emu-varlen")


def _emulated(case, starts, num_heads, tuning, emulator_dir, monkeypatch, rng, scale=0.11):
    monkeypatch.setattr(backends, "metal_available", lambda: True)  # plan for the Metal text; the emulator runs it
    step_plan = plan_for(case, starts, num_heads, "metal", **tuning)
    library = emulator.compile_library(emulator.varlen_source(emulator.varlen_constants(step_plan)), emulator_dir)
    queries = random_stored(rng, (int(starts[-1]), num_heads, case.keys64.shape[3]), "float32")
    out = emulator.run_varlen(library, step_plan, to_float64(queries), case.keys64, case.values64, case.block_tables, scale,
                              emulator_dir)
    return step_plan, out, oracle_prefill(case, queries, starts, scale)


@pytest.mark.parametrize("config", range(len(EMULATED)))
def test_varlen_text_on_cpu_emulator_matches_float64_oracle(emulator_dir, monkeypatch, rng, config):
    num_kv_heads, group, head_dim, block_size, tuning = EMULATED[config]
    chunks = [1, 7, 16, 17] if config < 3 else [500] if config == 3 else [2, 9]
    q_lens, lengths = mixed_step(rng, chunks, num_decodes=5, max_decode_context=400)
    case = make_paged_case(rng, lengths, num_kv_heads, head_dim, block_size, "float32")
    step_plan, out, expected = _emulated(case, starts_of(q_lens), num_kv_heads * group, tuning, emulator_dir, monkeypatch, rng)
    assert step_plan.kernel.shape.kv_tile_for(4) <= tuning.get("kv_tile", 32)
    assert step_plan.kernel.decode is not None and step_plan.kernel.num_units > 0
    assert np.isfinite(out).all(), "a NaN-poisoned slot or an unwritten row reached the output"
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


def test_emulated_partition_that_holds_no_key_of_some_queries_adds_nothing(emulator_dir, monkeypatch, rng):
    # Tiles of 4 over positions 123..129: the tile [127, 130) splits into [0, 64), [64, 128), [128, 130),
    # and query 127 sees no key of the last partition.
    case = make_paged_case(rng, [130, 90], 1, 64, 16, "float32")
    tuning = dict(max_query_tokens=4, partition_size=64, min_partition_size=64)
    step_plan, out, expected = _emulated(case, np.array([0, 7, 8], dtype=np.int32), 4, tuning, emulator_dir, monkeypatch, rng)
    assert step_plan.kernel.work.split_rows.shape[0] > 0
    np.testing.assert_allclose(out, expected, rtol=1e-5, atol=1e-5)


class EmulatedCompiler:
    """Stands in for `metal_kernel` / `cuda_kernel`: each launch runs the kernel text on the emulator,
    so the launcher's grid, template constants, output shapes and scatters are what gets checked.
    Decode rows run through the single-pass decode kernel (keep their contexts within one partition)."""

    def __init__(self, workdir):
        self.workdir = workdir
        self.library = None

    def __call__(self, name, input_names, output_names, header, body):
        def launch(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            arrays = [np.array(a.astype(mx.int32 if a.dtype == mx.int32 else mx.float32)) for a in inputs]
            groups = (grid[0] // threadgroup[0], grid[1])
            constants = {key: value for key, value in template if key != "T"}
            outputs = [np.full(shape, np.nan, dtype=np.float32) for shape in output_shapes]
            if name == "orchard_paged_varlen":
                self.library = emulator.compile_library(emulator.varlen_source(constants), self.workdir)
                self.library.run_varlen(*map(emulator._ptr, arrays + outputs), *map(ctypes.c_int, groups))
            elif name == "orchard_paged_varlen_merge":
                self.library.run_varlen_merge(*map(emulator._ptr, arrays + outputs), *map(ctypes.c_int, groups))
            elif name == "orchard_paged_decode":
                decode = emulator.build(constants, self.workdir)
                decode.run_single(*map(emulator._ptr, arrays + outputs), *map(ctypes.c_int, (*groups, grid[2])))
            else:
                raise NotImplementedError(name)
            return [mx.array(o).astype(dtype) for o, dtype in zip(outputs, output_dtypes)]

        return launch


def test_launcher_runs_plan_and_merge_through_the_emulated_kernel(emulator_dir, monkeypatch, rng):
    from orchard.kernels.varlen import PagedVarlenKernels

    monkeypatch.setattr(backends, "metal_available", lambda: True)
    # Both chunks reach past one 64-token partition, so they split and the merge kernel runs.
    q_lens = np.array([7, 1, 17, 1, 1, 1], dtype=np.int32)
    lengths = q_lens + np.array([80, 150, 70, 30, 199, 12], dtype=np.int32)
    case = make_paged_case(rng, lengths, 2, 64, 16, "float32")
    starts = starts_of(q_lens)
    step_plan = plan_for(case, starts, 8, "metal", max_query_tokens=8, partition_size=64, min_partition_size=64)
    assert step_plan.kernel.split_rows is not None and not step_plan.kernel.decode.plan.partitioned
    queries = random_stored(rng, (int(starts[-1]), 8, 64), "float32")
    out = PagedVarlenKernels("metal", EmulatedCompiler(emulator_dir))(queries, case.key_cache, case.value_cache, step_plan, 0.125)
    assert_close(out, oracle_prefill(case, queries, starts, 0.125), "float32")


@pytest.mark.parametrize("group,head_dim,kv_tile", [(4, 64, 64), (4, 128, 32), (1, 128, 32), (8, 64, 64)])
def test_cuda_plans_chunks_for_the_tensor_core_body_in_64_row_tiles(group, head_dim, kv_tile):
    tables = np.arange(8, dtype=np.int32).reshape(2, 4)
    step = varlen_plan.plan_kernel("cuda", starts_of([7, 1]), np.array([40, 20], dtype=np.int32), tables,
                                   8 * group, 8, head_dim, kernels.VarlenTuning())
    assert step.mma_kv_tile == kv_tile and step.shape.rows == 64 and step.shape.heads_per_tile == group
    assert step.work.units[:, 2].max() <= step.shape.q_tokens
    simt = varlen_plan.plan_kernel("cuda", starts_of([7, 1]), np.array([40, 20], dtype=np.int32), tables,
                                   8 * group, 8, head_dim, kernels.VarlenTuning(tensor_cores=False))
    metal = varlen_plan.plan_kernel("metal", starts_of([7, 1]), np.array([40, 20], dtype=np.int32), tables,
                                    8 * group, 8, head_dim, kernels.VarlenTuning())
    assert simt.mma_kv_tile is None and metal.mma_kv_tile is None
    assert mma_source.shared_bytes(kv_tile, head_dim) <= varlen_plan.SHARED_BYTES["cuda"]


@pytest.mark.parametrize("backend", [CUDA])
@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_cuda_tensor_core_and_simt_bodies_agree(rng, backend, dtype):
    q_lens, lengths = mixed_step(rng, [3, 64, 65, 300], num_decodes=6, max_decode_context=2000)
    case = make_paged_case(rng, lengths, 8, 128, 16, dtype)
    starts = starts_of(q_lens)
    queries = random_stored(rng, (int(starts[-1]), 32, 128), dtype)
    outs = [kernels.paged_varlen_attention(queries, case.key_cache, case.value_cache,
                                           plan_for(case, starts, 32, backend, tensor_cores=cores), scale=0.09)
            for cores in (True, False)]
    np.testing.assert_allclose(to_float64(outs[0]), to_float64(outs[1]), rtol=2e-2, atol=2e-2)


#: (num_kv_heads, group, head_dim, block_size, chunk lens, tuning) of the emulated tensor-core body
MMA_EMULATED = [
    (2, 4, 64, 16, [7, 40, 100], {}),
    (1, 1, 128, 16, [3, 70], dict(partition_size=64, min_partition_size=64)),
    (1, 8, 64, 32, [17, 2], dict(partition_size=64, min_partition_size=64)),
    (2, 2, 80, 16, [9, 33], {}),  # five 16-wide k-steps: the last one outside the paired ldmatrix loads
]


@pytest.mark.parametrize("config", range(len(MMA_EMULATED)))
def test_tensor_core_body_on_cpu_emulator_matches_float64_oracle(emulator_dir, monkeypatch, rng, config):
    from tests.kernels import mma_emulator

    num_kv_heads, group, head_dim, block_size, chunks, tuning = MMA_EMULATED[config]
    monkeypatch.setattr(backends, "cuda_available", lambda: True)  # plan for CUDA; the emulator runs the body
    q_lens = np.array(chunks, dtype=np.int32)
    # at least 50 earlier tokens, so a 17-token chunk's context passes a 64-token partition and splits
    lengths = (q_lens + rng.integers(50, 90, size=q_lens.size)).astype(np.int32)
    case = make_paged_case(rng, lengths, num_kv_heads, head_dim, block_size, "bfloat16")
    starts, num_heads = starts_of(q_lens), num_kv_heads * group
    step_plan = plan_for(case, starts, num_heads, "cuda", **tuning)
    assert step_plan.kernel.mma_kv_tile is not None and step_plan.kernel.decode is None
    assert bool(tuning) == (step_plan.kernel.split_rows is not None)  # the small partitions split, so the merge runs
    library = emulator.compile_library(mma_emulator.mma_varlen_source(mma_emulator.mma_constants(step_plan)), emulator_dir)
    queries = random_stored(rng, (int(starts[-1]), num_heads, head_dim), "bfloat16")
    out = mma_emulator.run_mma_varlen(library, step_plan, to_float64(queries), case.keys64, case.values64,
                                      case.block_tables, 0.11)
    assert np.isfinite(out).all(), "a NaN-poisoned slot or an unwritten row reached the output"
    assert_close(mx.array(out), oracle_prefill(case, queries, starts, 0.11), "bfloat16")

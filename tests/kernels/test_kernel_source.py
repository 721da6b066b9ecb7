"""The kernel text shared by Metal and CUDA: rendering per dialect, launch planning, and its
algorithm executed on the CPU through a thread-per-lane emulator."""

from __future__ import annotations

import numpy as np
import pytest

from orchard.kernels import launch, source
from orchard.kernels.errors import UnsupportedAttentionShape
from tests.kernels import emulator
from tests.kernels.paged_case import make_paged_case, oracle_decode, random_stored, to_float64


@pytest.mark.parametrize("partitioned", [False, True])
def test_dialects_share_the_kernel_body_and_differ_only_in_prologue(partitioned):
    cuda_header, cuda_body = source.render_decode("cuda", partitioned)
    metal_header, metal_body = source.render_decode("metal", partitioned)
    assert cuda_body.replace(source.CUDA_DECODE_PROLOGUE, "") == metal_body.replace(source.METAL_DECODE_PROLOGUE, "")
    assert "uint " not in cuda_body + cuda_header  # NVRTC has no `uint`
    assert "threadgroup_position_in_grid" in metal_body and "blockIdx" in cuda_body


def test_metal_body_binds_no_device_pointer_so_small_constant_inputs_compile():
    _, body = source.render_decode("metal", False)
    assert "device " not in body.replace(source.METAL_DECODE_PROLOGUE, "")


def test_partitioned_variant_writes_partition_states_not_the_output():
    _, body = source.render_decode("cuda", True)
    assert "part_max[r]" in body and "out[" not in body.replace("part_out[", "")


@pytest.mark.parametrize("head_dim,lanes", [(64, 8), (80, 16), (96, 16), (128, 16), (256, 32)])
def test_every_supported_head_dim_splits_into_at_most_eight_elements_per_lane(head_dim, lanes):
    assert launch.lanes_for(head_dim) == lanes


def test_head_dim_without_a_power_of_two_split_is_refused():
    with pytest.raises(UnsupportedAttentionShape):
        launch.lanes_for(72)


@pytest.mark.parametrize("group,head_dim,expected", [(1, 128, 1), (4, 128, 4), (8, 128, 8), (16, 128, 8), (8, 256, 4), (6, 256, 3)])
def test_heads_per_tile_divides_the_group_within_shared_memory(group, head_dim, expected):
    assert launch.heads_per_tile_for(group, head_dim, threads=128) == expected


def test_long_contexts_are_split_and_short_ones_are_not():
    tuning = launch.KernelTuning(partition_size=512, target_threadgroups=1)
    assert launch.plan_decode(64, 32, 8, 128, 512, tuning).num_partitions == 1
    assert launch.plan_decode(64, 32, 8, 128, 513, tuning).num_partitions == 2
    assert launch.plan_decode(64, 32, 8, 128, 32768, tuning).num_partitions == 64


def test_small_batches_get_smaller_partitions_until_the_grid_fills():
    tuning = launch.KernelTuning(partition_size=1024, min_partition_size=256, target_threadgroups=512)
    # 64 seqs x 8 tiles = 512 groups: enough already, even unsplit at T=512
    assert launch.plan_decode(64, 32, 8, 128, 4096, tuning).partition_size == 1024
    assert launch.plan_decode(64, 32, 8, 128, 512, tuning).num_partitions == 1
    # one sequence: 8 groups; halving stops at the 256-token floor
    plan = launch.plan_decode(1, 32, 8, 128, 4096, tuning)
    assert (plan.partition_size, plan.num_partitions) == (256, 16)
    assert launch.plan_decode(2, 32, 8, 128, 16384, tuning).partition_size == 512


def test_by_default_small_batches_split_no_finer_than_4096_tokens():
    """The defaults' floor (docs/benchmarks.md, "Fewer, longer partitions for small batches"): one sequence
    runs one pass up to 4,096 tokens and 4,096-token partitions past it; a batch of 64 keeps 8,192."""
    tuning = launch.KernelTuning()
    plans = {(b, t): launch.plan_decode(b, 32, 8, 128, t, tuning) for b, t in ((1, 2048), (1, 32768), (16, 16384), (64, 32768))}
    assert plans[1, 2048].num_partitions == 1
    assert (plans[1, 32768].partition_size, plans[1, 32768].num_partitions) == (4096, 8)
    assert (plans[16, 16384].partition_size, plans[16, 16384].num_partitions) == (8192, 2)
    assert (plans[64, 32768].partition_size, plans[64, 32768].num_partitions) == (8192, 4)


def test_partition_size_reaches_the_kernels_at_run_time_not_as_a_compiled_variant():
    """Batches of 1, 16 and 64 sequences plan 256-, 512- and 1,024-token partitions; all of them
    launch the same two compiled kernels (split decode, merge), the size travelling in `dims`."""
    import mlx.core as mx

    launches = []

    def compile_kernel(name, input_names, outputs, header, body):
        assert "PARTITION" not in body.replace("PARTITION_", "")

        def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            launches.append((name, tuple(template), tuple(np.array(inputs[input_names.index("dims")]).tolist())))
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return kernel

    # one KV head a threadgroup throughout: several a threadgroup are another compiled variant, chosen by grid, not partition
    kernels = launch.PagedDecodeKernels("cuda", compile_kernel, launch.KernelTuning(partition_size=1024, min_partition_size=256,
                                                                                 target_threadgroups=512, mma_tiles_per_threadgroup=1))
    sizes = set()
    for num_seqs in (1, 16, 64):
        case = make_paged_case(np.random.default_rng(num_seqs), [2500] * num_seqs, 8, 64, 16, "float16")
        queries = mx.zeros((num_seqs, 32, 64), dtype=mx.float16)
        kernels(queries, case.key_cache, case.value_cache, case.block_tables, case.context_lens, 0.125)
        sizes.add(launches[-2][2][2])
    assert sizes == {256, 512, 1024}
    assert len({(name, template) for name, template, _ in launches}) == 2

def test_context_bound_reads_host_lengths_else_table_capacity():
    tables = np.zeros((2, 10), dtype=np.int32)
    assert launch.context_bound(tables, np.array([3, 77], dtype=np.int32), 16) == 77
    import mlx.core as mx

    assert launch.context_bound(mx.array(tables), mx.array([3, 77]), 16) == 160


EMULATED = [
    # D=64 with whole GQA groups per threadgroup; D=80 splits each group into two tiles
    dict(HEAD_DIM=64, BLOCK_SIZE=16, NUM_KV_HEADS=2, GROUP=4, HEADS_PER_TILE=4, LANES=8, NUM_THREADS=64, UNROLL=2, PARTITION=64),
    dict(HEAD_DIM=80, BLOCK_SIZE=32, NUM_KV_HEADS=1, GROUP=4, HEADS_PER_TILE=2, LANES=16, NUM_THREADS=64, UNROLL=3, PARTITION=96),
]


@pytest.fixture(scope="module")
def emulated_libraries(tmp_path_factory):
    if emulator.COMPILER is None:
        pytest.skip("no g++ to build the CPU emulator of the kernel body")
    workdir = tmp_path_factory.mktemp("emu")
    return [emulator.build(constants, workdir) for constants in EMULATED]


@pytest.mark.parametrize("config", range(len(EMULATED)))
@pytest.mark.parametrize("split", [False, True])
def test_kernel_body_on_cpu_emulator_matches_float64_oracle(emulated_libraries, config, split):
    constants = EMULATED[config]
    rng = np.random.default_rng()
    lengths = [1, constants["PARTITION"], int(rng.integers(2, 300))]
    case = make_paged_case(rng, lengths, constants["NUM_KV_HEADS"], constants["HEAD_DIM"], constants["BLOCK_SIZE"], "float32")
    num_heads = constants["NUM_KV_HEADS"] * constants["GROUP"]
    queries = random_stored(rng, (len(lengths), num_heads, constants["HEAD_DIM"]), "float32")
    partitions = -(-max(lengths) // constants["PARTITION"]) if split else 1
    out = emulator.run_decode(
        emulated_libraries[config], constants, to_float64(queries), case.keys64, case.values64,
        case.block_tables, case.context_lens, 0.11, partitions,
    )
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, oracle_decode(case, queries, 0.11), rtol=1e-5, atol=1e-5)

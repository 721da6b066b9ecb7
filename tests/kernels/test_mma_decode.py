"""The tensor-core decode loop (orchard/kernels/mma_decode_source.py): where it runs, and its text on the CPU emulator.

The emulator runs the CUDA text with `mma.sync` emulated from the PTX fragment layouts in
bfloat16 (tests/kernels/mma_emulator.py), so the fragment permutations, the lane broadcasts
of the corrections and the masking of positions past a range are checked without a GPU;
on the H200 the same text runs against the float64 oracle in tests/kernels/test_paged_attention.py.
"""

from __future__ import annotations

import mlx.core as mx
import numpy as np
import pytest

from orchard.kernels import launch, mma_decode_source, source
from tests.kernels import emulator
from tests.kernels.paged_case import PLAIN, Rules, assert_close, make_paged_case, oracle_decode, random_stored, to_float64

# (num_kv_heads, group, head_dim, block_size, partition, threads[, head tiles a threadgroup takes]): Llama 3 8B's
# group and width, a 3-head group (Llama 3.2 3B), multi-head attention over 8-token blocks (a key tile spans
# two), a full 8-head group with 32-token blocks; then threadgroups of several KV heads: two warps each, and one.
EMULATED = [
    (2, 4, 128, 16, 64, 64),
    (1, 3, 64, 16, 64, 64),
    (2, 1, 64, 8, 96, 64),
    (1, 8, 128, 32, 64, 32),
    (2, 4, 128, 16, 64, 128, 2),
    (4, 2, 64, 16, 64, 128, 4),
]


# The loop's modes: pipelined or not
LOOPS = {"plain": False, "pipelined": True}


@pytest.fixture(scope="module")
def libraries(tmp_path_factory):
    if emulator.COMPILER is None:
        pytest.skip("no g++ to build the CPU emulator of the kernel body")
    workdir = tmp_path_factory.mktemp("emu-mma-decode")
    from tests.kernels import mma_emulator

    return {(config, mode): emulator.compile_library(mma_emulator.mma_decode_text(constants_of(config), LOOPS[mode]), workdir)
            for config in EMULATED for mode in LOOPS}


def constants_of(config) -> dict:
    """Template constants as the launcher passes them."""
    num_kv_heads, group, head_dim, block_size, partition, threads, *per_threadgroup = config
    return dict(HEAD_DIM=head_dim, BLOCK_SIZE=block_size, NUM_KV_HEADS=num_kv_heads, GROUP=group, HEADS_PER_TILE=group,
                LANES=16, NUM_THREADS=threads, UNROLL=4, PARTITION=partition, TILES_PER_THREADGROUP=(per_threadgroup or [1])[0])


def run_case(libraries, config, lengths, split: bool, rules: Rules = PLAIN, scale: float = 0.11, mode: str = "plain"):
    from tests.kernels import mma_emulator

    constants = constants_of(config)
    rng = np.random.default_rng(len(lengths) * 7 + config[1])
    case = make_paged_case(rng, lengths, constants["NUM_KV_HEADS"], constants["HEAD_DIM"], constants["BLOCK_SIZE"], "bfloat16")
    num_heads = constants["NUM_KV_HEADS"] * constants["GROUP"]
    queries = random_stored(rng, (len(lengths), num_heads, constants["HEAD_DIM"]), "bfloat16")
    partitions = -(-max(lengths) // constants["PARTITION"]) if split else 1
    out = mma_emulator.run_mma_decode(libraries[config, mode], constants, to_float64(queries), case.keys64, case.values64,
                                      case.block_tables, case.context_lens, scale, partitions, rules)
    return out, oracle_decode(case, queries, scale, rules)


@pytest.mark.parametrize("config", EMULATED)
@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("mode", list(LOOPS))
def test_tensor_core_decode_on_cpu_emulator_matches_float64_oracle(libraries, config, split, mode):
    # contexts of 1, a whole block, one past it, one past a partition, and one ending mid-tile
    lengths = [1, config[3], config[3] + 1, config[4] + 5, 123]
    out, expected = run_case(libraries, config, lengths, split, mode=mode)
    assert np.isfinite(out).all(), "a NaN-poisoned slot or an unwritten row reached the output"
    assert_close(mx.array(out), expected, "bfloat16")


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("mode", list(LOOPS))
def test_tensor_core_decode_applies_window_soft_cap_and_sinks(libraries, split, mode):
    config = EMULATED[0]
    heads = config[0] * config[1]
    rules = Rules(window=37, softcap=5.0, sinks=np.linspace(-1.0, 2.0, heads))
    out, expected = run_case(libraries, config, [5, 40, 150], split, rules, mode=mode)
    assert_close(mx.array(out), expected, "bfloat16")


@pytest.mark.parametrize("pipelined", [False, True])
def test_tensor_core_loop_shares_the_simt_kernels_setup_and_merge(pipelined):
    for partitioned in (False, True):
        body = mma_decode_source.render(partitioned, pipelined)[1]
        simt = source.render_decode("cuda", partitioned)[1]
        merge = source.DECODE_MERGE.replace("@WRITE@", source.PARTITION_WRITE if partitioned else source.SINGLE_WRITE)
        assert merge in body and merge in simt
        assert mma_decode_source.decode_loop(pipelined) in body and source.DECODE_SIMT_LOOP not in body


@pytest.mark.parametrize("group,head_dim,dtype,expected", [
    (4, 128, mx.bfloat16, True), (8, 64, mx.float16, True), (1, 128, mx.float16, True),
    (4, 128, mx.float32, False),  # float32 pools keep the SIMT loop
    (16, 128, mx.float16, False),  # more heads than one MMA tile's columns
    (4, 80, mx.float16, False),  # not a head dim the fragments are laid out for
])
def test_cuda_launches_the_tensor_core_loop_only_where_it_applies(group, head_dim, dtype, expected):
    tuning = launch.KernelTuning()
    plan = launch.plan_decode(8, 8 * group, 8, head_dim, 4096, tuning)
    kernels = {dialect: launch.PagedDecodeKernels(dialect, compile_kernel=None) for dialect in ("cuda", "metal")}
    assert kernels["cuda"].uses_tensor_cores(plan, tuning, 8 * group, 8, head_dim, dtype) is expected
    assert not kernels["metal"].uses_tensor_cores(plan, tuning, 8 * group, 8, head_dim, dtype)
    off = launch.KernelTuning(tensor_cores=False)
    assert not kernels["cuda"].uses_tensor_cores(plan, off, 8 * group, 8, head_dim, dtype)


def test_a_register_bound_kernel_compiles_under_its_own_name():
    """MLX caches a custom kernel by its name and template, not its text: a bound and an unbound loop
    under one name would run whichever compiled first."""
    compiled = []
    kernels = launch.PagedDecodeKernels("cuda", lambda name, *_: compiled.append(name) or name)
    for blocks in (None, 8, 6):
        kernels._decode_kernel(False, True, True, 64, blocks)
    assert len(set(compiled)) == 3, compiled
    assert mma_decode_source.register_bound(64, None) == ""
    assert "__launch_bounds__(64, 8)" in mma_decode_source.render(False, True, 64, 8)[0]


@pytest.mark.parametrize("num_seqs,partitions,span,expected", [
    (64, 1, 2048, (128, 4)),  # 8 KV heads, 4 a threadgroup: 128 threadgroups of four one-warp tiles
    (32, 4, 4096, (128, 4)),
    (32, 1, 2048, (64, 1)),  # 64 threadgroups, under the bound: one tile of two warps each
    (1, 8, 4096, (64, 1)),
    (64, 1, 8192, (64, 1)),  # a threadgroup reading 8,192 tokens
    (64, 4, 8192, (64, 1)),
])
def test_several_kv_heads_share_a_threadgroup_only_where_the_grid_stays_large_and_the_spans_short(num_seqs, partitions,
                                                                                                  span, expected):
    tuning = launch.KernelTuning()
    plan = launch.DecodePlan(lanes=16, heads_per_tile=4, partition_size=max(span, 4096), num_partitions=partitions, span=span)
    assert launch.threadgroup_shape(tuning, True, 8, num_seqs, plan) == expected
    assert launch.threadgroup_shape(tuning, False, 8, num_seqs, plan) == (tuning.threads, 1)  # the SIMT loop
    assert launch.threadgroup_shape(tuning, True, 6, 64, plan) == (tuning.threads, 1)  # 6 tiles do not split in fours


def test_a_plans_span_is_its_partition_or_its_longest_context():
    tuning = launch.KernelTuning()
    assert launch.plan_decode(64, 32, 8, 128, 1000, tuning).span == 1000
    assert launch.plan_decode(64, 32, 8, 128, 32768, tuning).span == tuning.partition_size


def test_the_cuda_launch_gives_the_kernel_its_tiles_per_threadgroup_and_a_grid_to_match():
    launched = []

    def compile_kernel(name, inputs, outputs, header, body):
        def run(**kwargs):
            launched.append(kwargs)
            return [mx.zeros(shape) for shape in kwargs["output_shapes"]]
        return run

    kernels = launch.PagedDecodeKernels("cuda", compile_kernel)
    queries = mx.zeros((64, 32, 128), dtype=mx.float16)
    pool = mx.zeros((65, 16, 8, 128), dtype=mx.float16)
    tables = np.arange(64, dtype=np.int32).reshape(64, 1) + 1
    kernels(queries, pool, pool, tables, np.full(64, 16, dtype=np.int32), scale=0.1)
    template = dict(launched[0]["template"])
    assert (template["TILES_PER_THREADGROUP"], template["NUM_THREADS"]) == (4, 128)
    assert launched[0]["grid"] == (128, 2, 64) and launched[0]["threadgroup"] == (128, 1, 1)


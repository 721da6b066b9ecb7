"""Sliding windows, attention sinks and soft-capped scores over the paged pool, against the float64 oracle.

The oracle (tests/kernels/paged_case.py) applies each rule from its definition: the query at
position p sees keys (p - window, p]; a sink logit joins the softmax denominator only; scaled
scores s become cap * tanh(s / cap). Windows are chosen to end inside blocks and inside chunks,
so chunks cross both. Every backend that runs here goes through the public entries (the
reference on the CPU; CUDA with `-m cuda` on the GPU machine); the Metal/CUDA text runs on the
CPU emulator in float32 (SIMT bodies) and bfloat16 (tensor-core body).
"""

from __future__ import annotations

import numpy as np
import pytest

from orchard import kernels
from orchard.kernels import backends, launch
from tests.kernels import emulator
from tests.kernels.backends import ALL_BACKENDS
from tests.kernels.paged_case import Rules, assert_close, make_paged_case, oracle_decode, oracle_prefill, random_stored, to_float64
from tests.kernels.test_varlen import mixed_step, plan_for, starts_of


def rules_named(name: str, num_heads: int, rng: np.random.Generator) -> Rules:
    sinks = rng.standard_normal(num_heads) * 2.0
    return {
        "window": Rules(window=37),
        "short_window": Rules(window=5),
        "sinks": Rules(sinks=sinks),
        "softcap": Rules(softcap=1.5),
        "all": Rules(window=21, softcap=2.0, sinks=sinks),
    }[name]


RULES = ["window", "short_window", "sinks", "softcap", "all"]


@pytest.fixture
def rng():
    return np.random.default_rng()


# --- the public entries, every backend -----------------------------------------------------


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("rules_name", RULES)
@pytest.mark.parametrize("dtype", ["float32", "bfloat16"])
@pytest.mark.parametrize("head_dim,num_heads,num_kv_heads", [(64, 8, 2), (128, 32, 8), (64, 4, 4)])
def test_mixed_step_with_layer_rules_matches_float64_oracle(rng, backend, rules_name, dtype, head_dim, num_heads, num_kv_heads):
    q_lens, lengths = mixed_step(rng, [7, 17, 40, 130], num_decodes=6, max_decode_context=600)
    case = make_paged_case(rng, lengths, num_kv_heads, head_dim, 16, dtype)
    starts = starts_of(q_lens)
    queries = random_stored(rng, (int(starts[-1]), num_heads, head_dim), dtype)
    rules, scale = rules_named(rules_name, num_heads, rng), head_dim ** -0.5
    plan = plan_for(case, starts, num_heads, backend)
    out = kernels.paged_varlen_attention(queries, case.key_cache, case.value_cache, plan, scale=scale, **rules.kwargs())
    assert_close(out, oracle_prefill(case, queries, starts, scale, rules), dtype)


@pytest.mark.parametrize("backend", ALL_BACKENDS)
@pytest.mark.parametrize("rules_name", RULES)
def test_decode_with_layer_rules_matches_float64_oracle_short_and_split(rng, backend, rules_name):
    # 3,000 and 4,100 tokens split the compiled decode into partitions; a window of 37 sees one or two of them.
    lengths = np.array([1, 5, 36, 37, 38, 300, 3000, 4100], dtype=np.int32)
    case = make_paged_case(rng, lengths, 2, 128, 16, "float16")
    queries = random_stored(rng, (lengths.size, 8, 128), "float16")
    rules = rules_named(rules_name, 8, rng)
    out = kernels.paged_attention(queries, case.key_cache, case.value_cache, case.block_tables, case.context_lens,
                                  scale=0.09, backend=backend, **rules.kwargs())
    assert_close(out, oracle_decode(case, queries, 0.09, rules), "float16")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_one_plan_serves_layers_with_different_windows(rng, backend):
    """Gemma 3's five local layers to one global: one step plan, the window per call."""
    q_lens, lengths = mixed_step(rng, [9, 33], num_decodes=4, max_decode_context=400)
    case = make_paged_case(rng, lengths, 2, 64, 16, "float32")
    starts = starts_of(q_lens)
    plan = plan_for(case, starts, 8, backend)
    queries = random_stored(rng, (int(starts[-1]), 8, 64), "float32")
    for window in (6, None, 6, 50, None):
        out = kernels.paged_varlen_attention(queries, case.key_cache, case.value_cache, plan, scale=0.125, window=window)
        assert_close(out, oracle_prefill(case, queries, starts, 0.125, Rules(window=window)), "float32")


@pytest.mark.parametrize("backend", ALL_BACKENDS)
def test_a_window_longer_than_every_context_changes_nothing(rng, backend):
    q_lens, lengths = mixed_step(rng, [12], num_decodes=3, max_decode_context=90)
    case = make_paged_case(rng, lengths, 2, 64, 16, "float32")
    starts = starts_of(q_lens)
    plan = plan_for(case, starts, 8, backend)
    queries = random_stored(rng, (int(starts[-1]), 8, 64), "float32")
    whole = kernels.paged_varlen_attention(queries, case.key_cache, case.value_cache, plan, scale=0.125)
    wide = kernels.paged_varlen_attention(queries, case.key_cache, case.value_cache, plan, scale=0.125, window=10_000)
    np.testing.assert_allclose(to_float64(wide), to_float64(whole), rtol=1e-6, atol=1e-6)


def test_a_window_of_one_attends_to_the_query_token_alone(rng):
    case = make_paged_case(rng, [20, 9], 2, 64, 16, "float32")
    starts = np.array([0, 5, 6], dtype=np.int32)
    queries = random_stored(rng, (6, 8, 64), "float32")
    plan = plan_for(case, starts, 8, "reference")
    out = kernels.paged_varlen_attention(queries, case.key_cache, case.value_cache, plan, scale=0.125, window=1)
    values = np.concatenate([case.values64[case.block_tables[0, p // 16], p % 16][None] for p in range(15, 20)]
                            + [case.values64[case.block_tables[1, 0], 8][None]])
    np.testing.assert_allclose(to_float64(out), np.repeat(values, 4, axis=1), rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize("kwargs,message", [
    (dict(window=0), "at least one key"),
    (dict(softcap=-1.0), "positive"),
    (dict(sinks=np.zeros(3, dtype=np.float32)), "3 sinks for 8 query heads"),
])
def test_rules_that_make_no_sense_are_refused_with_a_named_error(rng, kwargs, message):
    import mlx.core as mx

    kwargs = {k: mx.array(v) if isinstance(v, np.ndarray) else v for k, v in kwargs.items()}
    case = make_paged_case(rng, [9], 2, 64, 16, "float32")
    with pytest.raises(kernels.InvalidAttentionMetadata, match=message):
        kernels.paged_attention(random_stored(rng, (1, 8, 64), "float32"), case.key_cache, case.value_cache,
                                case.block_tables, case.context_lens, scale=0.1, **kwargs)


# --- one compiled variant for every window ---------------------------------------------------


def test_windows_reach_the_compiled_kernels_at_run_time_not_as_variants(rng, monkeypatch):
    import mlx.core as mx

    from orchard.kernels.varlen import PagedVarlenKernels

    compiled, windows = [], set()

    def compile_kernel(name, input_names, outputs, header, body):
        compiled.append(name)

        def kernel(*, inputs, template, grid, threadgroup, output_shapes, output_dtypes):
            if "window" in input_names:
                windows.add(int(np.array(inputs[input_names.index("window")])[0]))
            return [mx.zeros(shape, dtype=dtype) for shape, dtype in zip(output_shapes, output_dtypes)]
        return kernel

    q_lens = np.array([7, 1, 40, 1], dtype=np.int32)
    lengths = q_lens + np.array([300, 2000, 500, 10], dtype=np.int32)
    case = make_paged_case(rng, lengths, 2, 64, 16, "float16")
    starts = starts_of(q_lens)
    monkeypatch.setattr(backends, "cuda_available", lambda: True)  # plan for CUDA; the stand-in compiler runs nothing
    decode = launch.KernelTuning(partition_size=256, min_partition_size=256)  # the decode rows split too
    plan = plan_for(case, starts, 8, "cuda", partition_size=256, min_partition_size=256, decode=decode)
    assert plan.kernel.split_rows is not None and plan.kernel.decode.plan.partitioned
    varlen = PagedVarlenKernels("cuda", compile_kernel)
    queries = random_stored(rng, (int(starts[-1]), 8, 64), "float16")
    for window in (None, 4, 512, 4, None):
        varlen(queries, case.key_cache, case.value_cache, plan, 0.125, kernels.LayerAttention(window=window))
    assert windows == {0, 4, 512}
    assert len(compiled) == len(set(compiled))  # each kernel compiled once, whatever the window


def test_device_inputs_are_made_once_per_distinct_value_within_a_step(rng):
    import mlx.core as mx

    from orchard.kernels.variants import LayerInputCache

    inputs = LayerInputCache(num_heads=4)
    sinks = mx.array([0.5, -1.0, 2.0, 0.0])
    first = inputs(0.125, kernels.LayerAttention(window=8, sinks=sinks))
    again = inputs(0.125, kernels.LayerAttention(window=8, sinks=sinks))
    other = inputs(0.125, kernels.LayerAttention(window=None, softcap=30.0))
    assert first.window is again.window and first.sinks is again.sinks and first.scale is again.scale
    assert np.array(other.window).tolist() == [0] and np.array(first.window).tolist() == [8]
    np.testing.assert_allclose(np.array(first.sinks), np.array(sinks) * 1.4426950408889634, rtol=1e-6)
    np.testing.assert_allclose(np.array(other.scale), [0.125, 30.0 * 1.4426950408889634], rtol=1e-6)
    assert (np.array(other.sinks) <= -1e29).all()  # no sinks: nothing joins a denominator


# --- the kernel text on the CPU emulator -----------------------------------------------------


@pytest.fixture(scope="module")
def emulator_dir(tmp_path_factory):
    if emulator.COMPILER is None:
        pytest.skip("no g++ to build the CPU emulator of the kernel body")
    return tmp_path_factory.mktemp("emu-variants")


#: (num_kv_heads, group, head_dim, block_size, tuning) with partitions small enough that chunks split
EMULATED = [
    (2, 4, 64, 16, dict(max_query_tokens=4, partition_size=64, min_partition_size=64)),
    (1, 4, 128, 16, dict(max_query_tokens=8, partition_size=128, min_partition_size=128)),
    (1, 1, 64, 8, dict(max_query_tokens=16, partition_size=1024, min_partition_size=1024, kv_tile=16)),
]


@pytest.mark.parametrize("config", range(len(EMULATED)))
@pytest.mark.parametrize("rules_name", RULES)
def test_varlen_text_with_layer_rules_on_cpu_emulator_matches_float64_oracle(emulator_dir, monkeypatch, rng, config, rules_name):
    num_kv_heads, group, head_dim, block_size, tuning = EMULATED[config]
    num_heads = num_kv_heads * group
    monkeypatch.setattr(backends, "metal_available", lambda: True)  # plan for the Metal text; the emulator runs it
    q_lens, lengths = mixed_step(rng, [2, 9, 23], num_decodes=4, max_decode_context=200)
    case = make_paged_case(rng, lengths, num_kv_heads, head_dim, block_size, "float32")
    starts = starts_of(q_lens)
    step_plan = plan_for(case, starts, num_heads, "metal", **tuning)
    assert step_plan.kernel.decode is not None and step_plan.kernel.num_units > 0
    library = emulator.compile_library(emulator.varlen_source(emulator.varlen_constants(step_plan)), emulator_dir)
    queries = random_stored(rng, (int(starts[-1]), num_heads, head_dim), "float32")
    rules = rules_named(rules_name, num_heads, rng)
    out = emulator.run_varlen(library, step_plan, to_float64(queries), case.keys64, case.values64, case.block_tables, 0.11,
                              emulator_dir, rules)
    assert np.isfinite(out).all(), "a NaN-poisoned slot or an unwritten row reached the output"
    np.testing.assert_allclose(out, oracle_prefill(case, queries, starts, 0.11, rules), rtol=1e-5, atol=1e-5)


DECODE_CONSTANTS = dict(HEAD_DIM=64, BLOCK_SIZE=16, NUM_KV_HEADS=2, GROUP=4, HEADS_PER_TILE=4, LANES=8, NUM_THREADS=64,
                        UNROLL=2, PARTITION=64)


@pytest.mark.parametrize("split", [False, True])
@pytest.mark.parametrize("rules_name", RULES)
def test_decode_text_with_layer_rules_on_cpu_emulator_matches_float64_oracle(emulator_dir, rng, split, rules_name):
    library = emulator.build(DECODE_CONSTANTS, emulator_dir)
    lengths = [1, 5, 37, 64, 65, 150, 290]
    case = make_paged_case(rng, lengths, 2, 64, 16, "float32")
    queries = random_stored(rng, (len(lengths), 8, 64), "float32")
    rules = rules_named(rules_name, 8, rng)
    partitions = -(-max(lengths) // DECODE_CONSTANTS["PARTITION"]) if split else 1
    out = emulator.run_decode(library, DECODE_CONSTANTS, to_float64(queries), case.keys64, case.values64,
                              case.block_tables, case.context_lens, 0.11, partitions, rules)
    assert np.isfinite(out).all()
    np.testing.assert_allclose(out, oracle_decode(case, queries, 0.11, rules), rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("rules_name", RULES)
def test_tensor_core_text_with_layer_rules_on_cpu_emulator_matches_float64_oracle(emulator_dir, monkeypatch, rng, rules_name):
    from tests.kernels import mma_emulator

    monkeypatch.setattr(backends, "cuda_available", lambda: True)  # plan for CUDA; the emulator runs the body
    q_lens = np.array([3, 70, 17], dtype=np.int32)
    lengths = (q_lens + rng.integers(50, 90, size=q_lens.size)).astype(np.int32)
    case = make_paged_case(rng, lengths, 2, 64, 16, "bfloat16")
    starts = starts_of(q_lens)
    step_plan = plan_for(case, starts, 8, "cuda", partition_size=64, min_partition_size=64)
    assert step_plan.kernel.mma_kv_tile is not None and step_plan.kernel.split_rows is not None
    library = emulator.compile_library(mma_emulator.mma_varlen_source(mma_emulator.mma_constants(step_plan)), emulator_dir)
    queries = random_stored(rng, (int(starts[-1]), 8, 64), "bfloat16")
    rules = rules_named(rules_name, 8, rng)
    out = mma_emulator.run_mma_varlen(library, step_plan, to_float64(queries), case.keys64, case.values64,
                                      case.block_tables, 0.11, rules)
    assert np.isfinite(out).all(), "a NaN-poisoned slot or an unwritten row reached the output"
    import mlx.core as mx

    assert_close(mx.array(out), oracle_prefill(case, queries, starts, 0.11, rules), "bfloat16")

"""Run the shared kernel body (orchard/kernels/source.py) on the CPU: one std::thread per GPU thread.

A third dialect for the same text: shared memory becomes function statics, barriers are
std::barrier, a warp shuffle is a store / barrier / load through an exchange buffer. It
lets CI check the algorithm that Metal and CUDA compile (float32 storage only), so the
GPU machine is needed for speed, not for finding logic errors.
"""

from __future__ import annotations

import ctypes
import hashlib
import shutil
import subprocess
import tempfile
from pathlib import Path

import numpy as np

from orchard.kernels import source
from orchard.kernels.source import NO_SINK
from orchard.kernels.variants import LOG2E
from tests.kernels.paged_case import PLAIN, Rules

COMPILER = shutil.which("g++")

EMU_HEADER = r"""
#include <barrier>
#include <cmath>
#include <cstddef>
#include <memory>
#include <thread>
#include <vector>

struct EmuDim3 { int x, y, z; };
thread_local int emu_tid;
thread_local EmuDim3 emu_block;
static std::barrier<>* emu_group_barrier;
static std::vector<std::unique_ptr<std::barrier<>>> emu_warp_barriers;
static float emu_exchange[1024];

static float emu_xor(float value, int mask) {
  const int warp = emu_tid / 32, lane = emu_tid % 32;
  emu_exchange[emu_tid] = value;
  emu_warp_barriers[warp]->arrive_and_wait();
  const float other = emu_exchange[warp * 32 + (lane ^ mask)];
  emu_warp_barriers[warp]->arrive_and_wait();
  return other;
}

template <typename F>
static void emu_launch(int gx, int gy, int gz, int threads, F body) {
  for (int z = 0; z < gz; ++z)
    for (int y = 0; y < gy; ++y)
      for (int x = 0; x < gx; ++x) {
        std::barrier<> group(threads);
        emu_group_barrier = &group;
        emu_warp_barriers.clear();
        for (int w = 0; w < threads / 32; ++w) emu_warp_barriers.push_back(std::make_unique<std::barrier<>>(32));
        std::vector<std::thread> pool;
        for (int t = 0; t < threads; ++t)
          pool.emplace_back([=] { emu_tid = t; emu_block = EmuDim3{x, y, z}; body(); });
        for (auto& th : pool) th.join();
      }
}

#define SHARED static
#define BARRIER() emu_group_barrier->arrive_and_wait()
#define SIMD_XOR(value, mask) emu_xor((value), (mask))
#define FEXP2(x) std::exp2(x)
#define FTANH(x) std::tanh(x)
#define ROW_ALIGN alignas(16)
#define LOAD_ROW(dst, src) for (int i_ = 0; i_ < PER_LANE; ++i_) { (dst)[i_] = (src)[i_]; }
#define COPY_VEC(dst, src) for (int i_ = 0; i_ < VEC; ++i_) { (dst)[i_] = (src)[i_]; }
#define TILE_ALIGN __attribute__((aligned(16)))
#define WARP_BARRIER() emu_warp_barriers[emu_tid / 32]->arrive_and_wait()
#define LOAD4(dst, src) for (int i_ = 0; i_ < 4; ++i_) { (dst)[i_] = static_cast<float>((src)[i_]); }
"""

DECODE_PROLOGUE = """
  const int tid = emu_tid;
  const int part = emu_block.x;
  const int head_tile = emu_block.y;
  const int seq = emu_block.z;
"""

REDUCE_PROLOGUE = """
  const int tid = emu_tid;
  const int head = emu_block.x;
  const int seq = emu_block.y;
"""

DECODE_ARGS = (
    "const float* queries, const float* key_cache, const float* value_cache, "
    "const int* block_tables, const int* context_lens, const float* scale, const int* dims, const int* window, const float* sinks"
)


def _constants(values: dict) -> str:
    """Template constants as C++; the code of every layer addition stays compiled in (SOFTCAP,
    WINDOWED, SINKS 1), so one library serves every layer: the run-time values say which applies."""
    values = {"SOFTCAP": 1, "WINDOWED": 1, "SINKS": 1, "TILES_PER_THREADGROUP": 1, **values}
    return "".join(f"  constexpr int {name} = {value};\n" for name, value in values.items())


def emulator_source(constants: dict) -> str:
    """Both decode variants and the merge kernel, with the template constants baked in."""
    # the partition size is a run-time value (dims[2]); a constant of that name would hide a body still reading it
    decode_consts = "  using T = float;\n" + _constants({k: v for k, v in constants.items() if k != "PARTITION"})
    reduce_consts = "  using T = float;\n" + _constants({
        "HEAD_DIM": constants["HEAD_DIM"], "NUM_HEADS": constants["NUM_KV_HEADS"] * constants["GROUP"],
        "NUM_THREADS": constants["NUM_THREADS"],
    })
    single = source.render_decode("metal", False)[1].replace(source.METAL_DECODE_PROLOGUE, DECODE_PROLOGUE)
    split = source.render_decode("metal", True)[1].replace(source.METAL_DECODE_PROLOGUE, DECODE_PROLOGUE)
    reduce = source.REDUCE_BODY
    return EMU_HEADER + f"""
static void decode_single({DECODE_ARGS}, float* out) {{
{decode_consts}{single}
}}
static void decode_split({DECODE_ARGS}, float* part_out, float* part_max, float* part_sum) {{
{decode_consts}{split}
}}
static void merge(const float* part_out, const float* part_max, const float* part_sum,
                  const int* context_lens, const int* dims, const int* window, const float* sinks, float* out) {{
{reduce_consts}{REDUCE_PROLOGUE}{reduce}
}}
extern "C" void run_single({DECODE_ARGS}, float* out, int gx, int gy, int gz) {{
  emu_launch(gx, gy, gz, {constants["NUM_THREADS"]}, [=] {{
    decode_single(queries, key_cache, value_cache, block_tables, context_lens, scale, dims, window, sinks, out); }});
}}
extern "C" void run_split({DECODE_ARGS}, float* part_out, float* part_max, float* part_sum,
                          float* out, int gx, int gy, int gz, int heads) {{
  emu_launch(gx, gy, gz, {constants["NUM_THREADS"]}, [=] {{
    decode_split(queries, key_cache, value_cache, block_tables, context_lens, scale, dims, window, sinks,
                 part_out, part_max, part_sum); }});
  emu_launch(heads, gz, 1, {constants["NUM_THREADS"]}, [=] {{
    merge(part_out, part_max, part_sum, context_lens, dims, window, sinks, out); }});
}}
"""


def build(constants: dict, workdir: Path | None = None) -> ctypes.CDLL:
    """The decode kernels (single pass, split, merge) for one set of template constants."""
    return compile_library(emulator_source(constants), workdir)


def compile_library(text: str, workdir: Path | None = None) -> ctypes.CDLL:
    workdir = Path(workdir or tempfile.mkdtemp(prefix="orchard-emu-"))
    digest = hashlib.sha256(text.encode()).hexdigest()[:16]
    library = workdir / f"emu_{digest}.so"
    if not library.exists():
        (workdir / f"emu_{digest}.cpp").write_text(text)
        subprocess.run(
            [COMPILER, "-std=c++20", "-O1", "-shared", "-fPIC", "-pthread", "-o", str(library), str(workdir / f"emu_{digest}.cpp")],
            check=True, capture_output=True, text=True,
        )
    return ctypes.CDLL(str(library))


def _ptr(array: np.ndarray):
    return array.ctypes.data_as(ctypes.c_void_p)


def layer_arrays(rules: Rules, num_heads: int) -> tuple[np.ndarray, np.ndarray]:
    """(window, sinks) inputs as orchard/kernels/variants.py makes them: 0 for no window, base-2 sinks or NO_SINK."""
    window = np.array([rules.window or 0], dtype=np.int32)
    sinks = np.full(num_heads, NO_SINK) if rules.sinks is None else rules.sinks.astype(np.float32) * LOG2E
    return window, np.ascontiguousarray(sinks, dtype=np.float32)


def scale_array(scale: float, rules: Rules) -> np.ndarray:
    return np.array([scale, 0.0 if rules.softcap is None else rules.softcap * LOG2E], dtype=np.float32)


def run_decode(library: ctypes.CDLL, constants: dict, queries, key_cache, value_cache, block_tables, context_lens,
               scale: float, num_partitions: int, rules: Rules = PLAIN) -> np.ndarray:
    """Launch like orchard/kernels/launch.py does: grid (partitions, kv heads x tiles, seqs)."""
    num_seqs, num_heads, head_dim = queries.shape
    arrays = [np.ascontiguousarray(a, dtype=d) for a, d in (
        (queries, np.float32), (key_cache, np.float32), (value_cache, np.float32),
        (block_tables, np.int32), (context_lens, np.int32),
        (scale_array(scale, rules), np.float32), (np.array([block_tables.shape[1], num_partitions, constants["PARTITION"]]), np.int32),
        *zip(layer_arrays(rules, num_heads), (np.int32, np.float32)),
    )]
    out = np.zeros((num_seqs, num_heads, head_dim), dtype=np.float32)
    tiles = num_heads // constants["HEADS_PER_TILE"] // constants.get("TILES_PER_THREADGROUP", 1)
    ints = [ctypes.c_int(v) for v in (num_partitions, tiles, num_seqs)]
    if num_partitions == 1:
        library.run_single(*map(_ptr, arrays), _ptr(out), *ints)
        return out
    part_out = np.zeros((num_seqs, num_heads, num_partitions, head_dim), dtype=np.float32)
    part_max = np.zeros((num_seqs, num_heads, num_partitions), dtype=np.float32)
    part_sum = np.zeros_like(part_max)
    library.run_split(*map(_ptr, arrays), _ptr(part_out), _ptr(part_max), _ptr(part_sum), _ptr(out), *ints, ctypes.c_int(num_heads))
    return out


VARLEN_PROLOGUE = """
  const int tid = emu_tid;
  const int unit = emu_block.x;
  const int head_tile = emu_block.y;
"""

VARLEN_MERGE_PROLOGUE = """
  const int tid = emu_tid;
  const int head = emu_block.x;
  const int split_row = emu_block.y;
"""

VARLEN_ARGS = (
    "const float* queries, const float* key_cache, const float* value_cache, "
    "const int* block_tables, const int* units, const float* scale, const int* dims, const int* window, const float* sinks"
)
#: threads of the emulated merge kernel (its loop over head dims strides by the thread count)
MERGE_THREADS = 32


def varlen_source(constants: dict) -> str:
    """The varlen kernel and its merge kernel, with the template constants baked in (T is float)."""
    kernel = source.render_varlen("metal")[1].replace(source.METAL_VARLEN_PROLOGUE, VARLEN_PROLOGUE)
    merge = source.render_varlen_merge("metal")[1].replace(source.METAL_VARLEN_MERGE_PROLOGUE, VARLEN_MERGE_PROLOGUE)
    merge_consts = _constants({
        "HEAD_DIM": constants["HEAD_DIM"], "NUM_HEADS": constants["NUM_KV_HEADS"] * constants["GROUP"], "NUM_THREADS": MERGE_THREADS,
    })
    return EMU_HEADER + f"""
static void varlen_unit({VARLEN_ARGS}, float* out, float* part_out, float* part_max, float* part_sum) {{
  using T = float;
{_constants(constants)}{kernel}
}}
static void varlen_merge(const float* part_out, const float* part_max, const float* part_sum, const int* split_rows,
                         const float* sinks, float* merged) {{
  using T = float;
{merge_consts}{merge}
}}
extern "C" void run_varlen({VARLEN_ARGS}, float* out, float* part_out, float* part_max, float* part_sum, int units_count, int head_tiles) {{
  emu_launch(units_count, head_tiles, 1, {constants["NUM_THREADS"]}, [=] {{
    varlen_unit(queries, key_cache, value_cache, block_tables, units, scale, dims, window, sinks, out, part_out, part_max, part_sum); }});
}}
extern "C" void run_varlen_merge(const float* part_out, const float* part_max, const float* part_sum, const int* split_rows,
                                 const float* sinks, float* merged, int heads, int rows) {{
  emu_launch(heads, rows, 1, {MERGE_THREADS}, [=] {{ varlen_merge(part_out, part_max, part_sum, split_rows, sinks, merged); }});
}}
"""


def varlen_constants(plan) -> dict:
    """Template constants of a compiled-backend plan, as orchard/kernels/varlen.py passes them for a float32 pool."""
    shape = plan.kernel.shape
    return dict(
        HEAD_DIM=plan.head_dim, BLOCK_SIZE=plan.block_size, NUM_KV_HEADS=plan.num_kv_heads,
        GROUP=plan.num_heads // plan.num_kv_heads, HEADS_PER_TILE=shape.heads_per_tile, Q_TOKENS=shape.q_tokens,
        KV_TILE=shape.kv_tile_for(4), NUM_THREADS=shape.threads_for(4),
    )


def decode_constants(plan) -> dict:
    """Template constants of the decode kernel that serves a plan's decode rows, as orchard/kernels/launch.py passes them."""
    rows = plan.kernel.decode
    return dict(
        HEAD_DIM=plan.head_dim, BLOCK_SIZE=plan.block_size, NUM_KV_HEADS=plan.num_kv_heads,
        GROUP=plan.num_heads // plan.num_kv_heads, HEADS_PER_TILE=rows.plan.heads_per_tile, LANES=rows.plan.lanes,
        NUM_THREADS=rows.tuning.threads, UNROLL=rows.tuning.unroll, PARTITION=rows.plan.partition_size,
    )


def run_varlen(library: ctypes.CDLL, plan, queries, key_cache, value_cache, block_tables, scale: float,
               workdir: Path | None = None, rules: Rules = PLAIN) -> np.ndarray:
    """Launch like orchard/kernels/varlen.py does: one threadgroup per (unit, head tile), the merge of split rows,
    then the decode kernel for the decode rows."""
    work, shape = plan.kernel.work, plan.kernel.shape
    total_q, num_heads, head_dim = queries.shape
    arrays = [np.ascontiguousarray(a, dtype=d) for a, d in (
        (queries, np.float32), (key_cache, np.float32), (value_cache, np.float32), (block_tables, np.int32),
        (work.units, np.int32), (scale_array(scale, rules), np.float32), (np.array([block_tables.shape[1]]), np.int32),
        *zip(layer_arrays(rules, num_heads), (np.int32, np.float32)),
    )]
    out = np.full((total_q, num_heads, head_dim), np.nan, dtype=np.float32)
    partial_rows = max(work.num_partial_rows, 1)
    part_out = np.full((partial_rows, num_heads, head_dim), np.nan, dtype=np.float32)
    part_max = np.full((partial_rows, num_heads), np.nan, dtype=np.float32)
    part_sum = np.full_like(part_max, np.nan)
    head_tiles = num_heads // shape.heads_per_tile
    if work.units.shape[0]:
        library.run_varlen(*map(_ptr, arrays), _ptr(out), _ptr(part_out), _ptr(part_max), _ptr(part_sum),
                           ctypes.c_int(work.units.shape[0]), ctypes.c_int(head_tiles))
    if work.split_rows.shape[0]:
        split_rows = np.ascontiguousarray(work.split_rows, dtype=np.int32)
        merged = np.zeros((split_rows.shape[0], num_heads, head_dim), dtype=np.float32)
        library.run_varlen_merge(_ptr(part_out), _ptr(part_max), _ptr(part_sum), _ptr(split_rows), _ptr(arrays[-1]), _ptr(merged),
                                 ctypes.c_int(num_heads), ctypes.c_int(split_rows.shape[0]))
        out[split_rows[:, 0]] = merged
    rows = plan.kernel.decode
    if rows is not None:
        constants = decode_constants(plan)
        out[rows.host_rows] = run_decode(
            build(constants, workdir), constants, np.asarray(queries)[rows.host_rows], key_cache, value_cache,
            np.array(rows.block_tables), np.array(rows.context_lens), scale, rows.plan.num_partitions, rules,
        )
    return out

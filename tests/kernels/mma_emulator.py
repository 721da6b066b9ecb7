"""Run the tensor-core varlen body (orchard/kernels/mma_source.py) on the CPU emulator, in bfloat16.

The emulator's threads stand in for a warp's lanes; `mma.sync` becomes a warp-wide
exchange: every lane posts its A, B and C fragment registers, each lane rebuilds the
16x16 and 16x8 operands from the PTX ISA's fragment layout and computes its own four
accumulators. Storage is a 16-bit bfloat16 type, so the body's register pairs (two
elements per 32-bit word) are what is checked, not a float stand-in.
"""

from __future__ import annotations

import ctypes

import numpy as np

from orchard.kernels import mma_decode_source, mma_source, source
from tests.kernels import emulator
from tests.kernels.paged_case import PLAIN, Rules

EMU_MMA_HEADER = r"""
#include <cstdint>
#include <cstring>

struct EmuBf16 {
  uint16_t bits;
  EmuBf16() = default;
  EmuBf16(float f) {
    uint32_t u;
    std::memcpy(&u, &f, 4);
    if ((u & 0x7fffffffu) > 0x7f800000u) { bits = 0x7fc0; return; }  // NaN stays NaN
    u += 0x7fffu + ((u >> 16) & 1u);  // round to nearest even
    bits = uint16_t(u >> 16);
  }
  operator float() const {
    uint32_t u = uint32_t(bits) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return f;
  }
};

static float emu_bf16_half(uint32_t word, int high) {
  EmuBf16 h;
  h.bits = uint16_t(high ? word >> 16 : word & 0xffffu);
  return float(h);
}

static uint32_t emu_frag_a[1024][4];
static uint32_t emu_frag_b[1024][2];

template <typename U>
static uint32_t pair_at(const U* p) { return uint32_t(p[0].bits) | (uint32_t(p[1].bits) << 16); }

template <typename U>
static uint32_t pair_of(U lo, U hi) { return uint32_t(lo.bits) | (uint32_t(hi.bits) << 16); }

template <typename U>
static uint32_t pack_floats(float lo, float hi) { return pair_of<U>(U(lo), U(hi)); }

// cp.async done at once: the copy lands when issued, so committing and waiting have nothing to do.
template <typename U>
static void stage_copy(U* dst, const U* src, bool valid) {
  if (valid) {
    std::memcpy(dst, src, 16);
  } else {
    std::memset(dst, 0, 16);
  }
}
static void stage_commit() {}
template <int N>
static void stage_wait() {}

static bool emu_any_flags[1024];

static bool emu_warp_any(bool p) {
  const int warp = emu_tid / 32;
  emu_any_flags[emu_tid] = p;
  emu_warp_barriers[warp]->arrive_and_wait();
  bool any = false;
  for (int i = 0; i < 32; ++i) any = any || emu_any_flags[warp * 32 + i];
  emu_warp_barriers[warp]->arrive_and_wait();
  return any;
}
#define WARP_ANY(p) emu_warp_any(p)

static const void* emu_ld_rows[1024];

// ldmatrix .x4 as a warp-wide exchange: every lane posts the row it names, then builds its four registers.
template <typename U>
static void emu_ldmatrix_x4(unsigned int* r, const U* row, bool trans) {
  const int warp = emu_tid / 32, lane = emu_tid % 32;
  emu_ld_rows[emu_tid] = row;
  emu_warp_barriers[warp]->arrive_and_wait();
  for (int m = 0; m < 4; ++m) {
    const U* const* rows = reinterpret_cast<const U* const*>(&emu_ld_rows[warp * 32 + m * 8]);
    r[m] = trans ? pair_of(rows[2 * (lane % 4)][lane / 4], rows[2 * (lane % 4) + 1][lane / 4])
                 : pair_at(rows[lane / 4] + 2 * (lane % 4));
  }
  emu_warp_barriers[warp]->arrive_and_wait();
}

template <typename U>
static void ldmatrix_x4(unsigned int* r, const U* row) { emu_ldmatrix_x4(r, row, false); }

template <typename U>
static void ldmatrix_x4_trans(unsigned int* r, const U* row) { emu_ldmatrix_x4(r, row, true); }

template <typename U> struct MmaTile {
  // m16n8k16, row-major A, column-major B: lane = 4 * group + thread-in-group.
  static void run(float* c, const unsigned int* a, const unsigned int* b) {
    const int warp = emu_tid / 32, lane = emu_tid % 32;
    for (int i = 0; i < 4; ++i) emu_frag_a[emu_tid][i] = a[i];
    for (int i = 0; i < 2; ++i) emu_frag_b[emu_tid][i] = b[i];
    emu_warp_barriers[warp]->arrive_and_wait();
    const int group = lane / 4, in_group = lane % 4;
    for (int i = 0; i < 4; ++i) {
      const int row = group + (i >= 2 ? 8 : 0);
      const int col = in_group * 2 + (i % 2);
      float sum = 0.0f;
      for (int k = 0; k < 16; ++k) {
        const int a_lane = warp * 32 + (row % 8) * 4 + (k % 8) / 2;
        const int a_reg = (row >= 8 ? 1 : 0) + (k >= 8 ? 2 : 0);
        const int b_lane = warp * 32 + col * 4 + (k % 8) / 2;
        const int b_reg = k >= 8 ? 1 : 0;
        sum += emu_bf16_half(emu_frag_a[a_lane][a_reg], k % 2) * emu_bf16_half(emu_frag_b[b_lane][b_reg], k % 2);
      }
      c[i] += sum;
    }
    emu_warp_barriers[warp]->arrive_and_wait();
  }
};
"""

MMA_ARGS = (
    "const EmuBf16* queries, const EmuBf16* key_cache, const EmuBf16* value_cache, "
    "const int* block_tables, const int* units, const float* scale, const int* dims, const int* window, const float* sinks"
)


def mma_varlen_source(constants: dict) -> str:
    """The tensor-core body and the merge kernel (float partials), template constants baked in."""
    body = mma_source.render()[1].replace(mma_source.MMA_PROLOGUE, emulator.VARLEN_PROLOGUE)
    merge = source.render_varlen_merge("metal")[1].replace(source.METAL_VARLEN_MERGE_PROLOGUE, emulator.VARLEN_MERGE_PROLOGUE)
    merge_consts = emulator._constants({
        "HEAD_DIM": constants["HEAD_DIM"], "NUM_HEADS": constants["NUM_KV_HEADS"] * constants["GROUP"],
        "NUM_THREADS": emulator.MERGE_THREADS,
    })
    return emulator.EMU_HEADER + EMU_MMA_HEADER + f"""
static void mma_unit({MMA_ARGS}, EmuBf16* out, float* part_out, float* part_max, float* part_sum) {{
  using T = EmuBf16;
{emulator._constants(constants)}{body}
}}
static void varlen_merge(const float* part_out, const float* part_max, const float* part_sum, const int* split_rows,
                         const float* sinks, float* merged) {{
  using T = float;
{merge_consts}{merge}
}}
extern "C" void run_mma({MMA_ARGS}, EmuBf16* out, float* part_out, float* part_max, float* part_sum, int units_count, int head_tiles) {{
  emu_launch(units_count, head_tiles, 1, {constants["NUM_THREADS"]}, [=] {{
    mma_unit(queries, key_cache, value_cache, block_tables, units, scale, dims, window, sinks, out, part_out, part_max, part_sum); }});
}}
extern "C" void run_varlen_merge(const float* part_out, const float* part_max, const float* part_sum, const int* split_rows,
                                 const float* sinks, float* merged, int heads, int rows) {{
  emu_launch(heads, rows, 1, {emulator.MERGE_THREADS}, [=] {{ varlen_merge(part_out, part_max, part_sum, split_rows, sinks, merged); }});
}}
"""


def mma_constants(plan) -> dict:
    """Template constants as orchard/kernels/varlen.py passes them to the tensor-core body."""
    shape = plan.kernel.shape
    return dict(
        HEAD_DIM=plan.head_dim, BLOCK_SIZE=plan.block_size, NUM_KV_HEADS=plan.num_kv_heads,
        GROUP=plan.num_heads // plan.num_kv_heads, HEADS_PER_TILE=shape.heads_per_tile, Q_TOKENS=shape.q_tokens,
        KV_TILE=plan.kernel.mma_kv_tile, NUM_THREADS=shape.rows // mma_source.ROWS_PER_WARP * 32,
    )


def to_bf16_bits(values: np.ndarray) -> np.ndarray:
    """float values (already bfloat16-representable) as their 16-bit patterns."""
    return (np.ascontiguousarray(values, dtype=np.float32).view(np.uint32) >> 16).astype(np.uint16)


def from_bf16_bits(bits: np.ndarray) -> np.ndarray:
    return (bits.astype(np.uint32) << 16).view(np.float32)


def run_mma_varlen(library: ctypes.CDLL, plan, queries, key_cache, value_cache, block_tables, scale: float,
                   rules: Rules = PLAIN) -> np.ndarray:
    """The chunk rows of a step through the emulated tensor-core body and the merge; decode rows stay NaN."""
    work, shape = plan.kernel.work, plan.kernel.shape
    total_q, num_heads, head_dim = queries.shape
    halves = [to_bf16_bits(a) for a in (queries, key_cache, value_cache)]
    ints = [np.ascontiguousarray(block_tables, dtype=np.int32), np.ascontiguousarray(work.units, dtype=np.int32)]
    extras = [emulator.scale_array(scale, rules), np.array([block_tables.shape[1]], dtype=np.int32),
              *emulator.layer_arrays(rules, num_heads)]
    out = np.full((total_q, num_heads, head_dim), 0x7fc0, dtype=np.uint16)  # NaN until written
    partial_rows = max(work.num_partial_rows, 1)
    part_out = np.full((partial_rows, num_heads, head_dim), np.nan, dtype=np.float32)
    part_max = np.full((partial_rows, num_heads), np.nan, dtype=np.float32)
    part_sum = np.full_like(part_max, np.nan)
    ptr = emulator._ptr
    library.run_mma(*map(ptr, halves + ints + extras), ptr(out), ptr(part_out), ptr(part_max), ptr(part_sum),
                    ctypes.c_int(work.units.shape[0]), ctypes.c_int(num_heads // shape.heads_per_tile))
    result = from_bf16_bits(out)
    if work.split_rows.shape[0]:
        split_rows = np.ascontiguousarray(work.split_rows, dtype=np.int32)
        merged = np.zeros((split_rows.shape[0], num_heads, head_dim), dtype=np.float32)
        library.run_varlen_merge(ptr(part_out), ptr(part_max), ptr(part_sum), ptr(split_rows), ptr(extras[-1]), ptr(merged),
                                 ctypes.c_int(num_heads), ctypes.c_int(split_rows.shape[0]))
        result[split_rows[:, 0]] = from_bf16_bits(to_bf16_bits(merged))
    return result


EMU_MMA_DECODE_HEADER = r"""
static int64_t emu_shfl_words[1024];

template <typename V>
static V emu_shfl(V value, int src_lane) {
  const int warp = emu_tid / 32;
  std::memcpy(&emu_shfl_words[emu_tid], &value, sizeof(V));
  emu_warp_barriers[warp]->arrive_and_wait();
  V other;
  std::memcpy(&other, &emu_shfl_words[warp * 32 + src_lane], sizeof(V));
  emu_warp_barriers[warp]->arrive_and_wait();
  return other;
}
#define SIMD_SHFL(value, src_lane) emu_shfl((value), (src_lane))

template <typename U>
static void load_words(const U* src, unsigned int* dst) { std::memcpy(dst, src, 16); }
""" + mma_decode_source.PLAIN_HELPERS.replace("__device__ __forceinline__", "static")


def mma_decode_text(constants: dict, pipelined: bool) -> str:
    """The tensor-core decode kernel (single pass and split) and the partition merge, constants baked in."""
    single, split = (mma_decode_source.render(p, pipelined)[1].replace(source.CUDA_DECODE_PROLOGUE, emulator.DECODE_PROLOGUE)
                     for p in (False, True))
    consts = emulator._constants({k: v for k, v in constants.items() if k != "PARTITION"})
    reduce_consts = emulator._constants({
        "HEAD_DIM": constants["HEAD_DIM"], "NUM_HEADS": constants["NUM_KV_HEADS"] * constants["GROUP"],
        "NUM_THREADS": constants["NUM_THREADS"],
    })
    args = MMA_ARGS.replace("const int* units", "const int* context_lens")
    call = "queries, key_cache, value_cache, block_tables, context_lens, scale, dims, window, sinks"
    return emulator.EMU_HEADER + EMU_MMA_HEADER + EMU_MMA_DECODE_HEADER + f"""
static void decode_single({args}, EmuBf16* out) {{
  using T = EmuBf16;
{consts}{single}
}}
static void decode_split({args}, float* part_out, float* part_max, float* part_sum) {{
  using T = EmuBf16;
{consts}{split}
}}
static void merge(const float* part_out, const float* part_max, const float* part_sum,
                  const int* context_lens, const int* dims, const int* window, const float* sinks, float* out) {{
  using T = float;
{reduce_consts}{emulator.REDUCE_PROLOGUE}{source.REDUCE_BODY}
}}
extern "C" void run_single({args}, EmuBf16* out, int gx, int gy, int gz) {{
  emu_launch(gx, gy, gz, {constants["NUM_THREADS"]}, [=] {{ decode_single({call}, out); }});
}}
extern "C" void run_split({args}, float* part_out, float* part_max, float* part_sum, float* out,
                          int gx, int gy, int gz, int heads) {{
  emu_launch(gx, gy, gz, {constants["NUM_THREADS"]}, [=] {{ decode_split({call}, part_out, part_max, part_sum); }});
  emu_launch(heads, gz, 1, {constants["NUM_THREADS"]}, [=] {{
    merge(part_out, part_max, part_sum, context_lens, dims, window, sinks, out); }});
}}
"""


def run_mma_decode(library: ctypes.CDLL, constants: dict, queries, key_cache, value_cache, block_tables, context_lens,
                   scale: float, num_partitions: int, rules: Rules = PLAIN) -> np.ndarray:
    """Launch as orchard/kernels/launch.py does (grid: partitions, KV heads, sequences), bfloat16 storage."""
    num_seqs, num_heads, head_dim = queries.shape
    halves = [to_bf16_bits(a) for a in (queries, key_cache, value_cache)]
    ints = [np.ascontiguousarray(block_tables, dtype=np.int32), np.ascontiguousarray(context_lens, dtype=np.int32)]
    dims = np.array([block_tables.shape[1], num_partitions, constants["PARTITION"]], dtype=np.int32)
    extras = [emulator.scale_array(scale, rules), dims, *emulator.layer_arrays(rules, num_heads)]
    grid = [ctypes.c_int(v) for v in (num_partitions, num_heads // constants["HEADS_PER_TILE"] // constants.get("TILES_PER_THREADGROUP", 1), num_seqs)]
    ptr = emulator._ptr
    if num_partitions == 1:
        out = np.full((num_seqs, num_heads, head_dim), 0x7fc0, dtype=np.uint16)  # NaN until written
        library.run_single(*map(ptr, halves + ints + extras), ptr(out), *grid)
        return from_bf16_bits(out)
    part_out = np.full((num_seqs, num_heads, num_partitions, head_dim), np.nan, dtype=np.float32)
    part_max = np.full((num_seqs, num_heads, num_partitions), np.nan, dtype=np.float32)
    part_sum = np.full_like(part_max, np.nan)
    out = np.full((num_seqs, num_heads, head_dim), np.nan, dtype=np.float32)
    library.run_split(*map(ptr, halves + ints + extras), ptr(part_out), ptr(part_max), ptr(part_sum), ptr(out),
                      *grid, ctypes.c_int(num_heads))
    return out

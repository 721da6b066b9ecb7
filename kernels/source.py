"""One paged-decode kernel, written once and rendered for two dialects: Metal and CUDA (NVRTC).

The body below uses a handful of macros (shuffles, barriers, shared memory, exp2,
row loads) that each dialect's header defines, plus a short prologue that
names the thread and threadgroup indices the way that dialect spells them. Everything
else, the algorithm included, is the same text, so what is verified on CUDA is what
runs on Metal.

Algorithm (one threadgroup per sequence x group of query heads sharing one KV head x
partition of the context):
- LANES threads cooperate on one token: each holds PER_LANE consecutive elements of the
  token's K and V row, so a warp reads whole rows (coalesced) and the query heads of a
  GQA group share every K/V load.
- Tokens are looked up through the block table directly (no gather); each warp keeps an
  online softmax (running max, sum and weighted V) per query head, UNROLL tokens a step
  so several loads are in flight.
- Scores live in base 2 (log2(e) folded into the scale): exp2 is a single hardware op.
- Warps merge their states by shuffles, then through shared memory. Long contexts are
  split into partitions (split-K); a second kernel merges the partitions by their maxima
  and sums. Softmax runs in float32 whatever the storage dtype.
"""

from __future__ import annotations

DECODE_INPUTS = ["queries", "key_cache", "value_cache", "block_tables", "context_lens", "scale", "dims"]
SINGLE_OUTPUTS = ["out"]
PARTITION_OUTPUTS = ["part_out", "part_max", "part_sum"]
REDUCE_INPUTS = ["part_out", "part_max", "part_sum", "context_lens", "dims"]
REDUCE_OUTPUTS = ["out"]

CUDA_HEADER = r"""
#define SHARED __shared__
#define BARRIER() __syncthreads()
#define SIMD_XOR(value, mask) __shfl_xor_sync(0xffffffffu, (value), (mask))
#define FEXP2(x) exp2f(x)
#define ROW_ALIGN alignas(16)

// Rows are PER_LANE elements; when that is a whole number of 16-byte words the
// load is vectorised (rows start 16-byte aligned because head_dim * itemsize is).
template <int N, typename U>
__device__ __forceinline__ void load_row(const U* src, U* dst) {
  if constexpr ((N * sizeof(U)) % 16 == 0) {
#pragma unroll
    for (int i = 0; i < int(N * sizeof(U) / 16); ++i) {
      reinterpret_cast<uint4*>(dst)[i] = reinterpret_cast<const uint4*>(src)[i];
    }
  } else {
#pragma unroll
    for (int i = 0; i < N; ++i) {
      dst[i] = src[i];
    }
  }
}
#define LOAD_ROW(dst, src) load_row<PER_LANE>((src), (dst))
"""

METAL_HEADER = r"""
#define SHARED threadgroup
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define SIMD_XOR(value, mask) simd_shuffle_xor((value), (ushort)(mask))
#define FEXP2(x) metal::exp2(x)
#define ROW_ALIGN
#define LOAD_ROW(dst, src) for (int i_ = 0; i_ < PER_LANE; ++i_) { (dst)[i_] = (src)[i_]; }
"""

CUDA_DECODE_PROLOGUE = """
  const int tid = int(threadIdx.x);
  const int part = int(blockIdx.x);
  const int head_tile = int(blockIdx.y);
  const int seq = int(blockIdx.z);
"""

METAL_DECODE_PROLOGUE = """
  const int tid = int(thread_index_in_threadgroup);
  const int part = int(threadgroup_position_in_grid.x);
  const int head_tile = int(threadgroup_position_in_grid.y);
  const int seq = int(threadgroup_position_in_grid.z);
"""

CUDA_REDUCE_PROLOGUE = """
  const int tid = int(threadIdx.x);
  const int head = int(blockIdx.x);
  const int seq = int(blockIdx.y);
"""

METAL_REDUCE_PROLOGUE = """
  const int tid = int(thread_index_in_threadgroup);
  const int head = int(threadgroup_position_in_grid.x);
  const int seq = int(threadgroup_position_in_grid.y);
"""

DECODE_BODY = r"""
  constexpr int WARP = 32;
  constexpr int NUM_WARPS = NUM_THREADS / WARP;
  constexpr int PER_LANE = HEAD_DIM / LANES;
  constexpr int TOKENS_PER_WARP = WARP / LANES;
  constexpr int TOKENS_PER_STEP = NUM_WARPS * TOKENS_PER_WARP * UNROLL;
  constexpr int NUM_HEADS = NUM_KV_HEADS * GROUP;
  constexpr int TILES_PER_KV = GROUP / HEADS_PER_TILE;
  constexpr float NEG_BIG = -1.0e30f;
  SHARED float warp_max[NUM_WARPS][HEADS_PER_TILE];
  SHARED float warp_sum[NUM_WARPS][HEADS_PER_TILE];
  SHARED float warp_acc[NUM_WARPS][HEADS_PER_TILE][HEAD_DIM];

  const int warp = tid / WARP;
  const int lane = tid % WARP;
  const int slot_in_warp = lane / LANES;
  const int lane_in_token = lane % LANES;
  const int kv_head = head_tile / TILES_PER_KV;
  const int first_head = kv_head * GROUP + (head_tile % TILES_PER_KV) * HEADS_PER_TILE;
  const int max_blocks = dims[0];
  const int num_partitions = dims[1];
  const int context_len = context_lens[seq];
  @RANGE@

  float q[HEADS_PER_TILE][PER_LANE];
  float run_max[HEADS_PER_TILE];
  float run_sum[HEADS_PER_TILE];
  float acc[HEADS_PER_TILE][PER_LANE];
  // Scores are kept in base 2 (scale folded with log2(e)) so every exponential is one exp2.
  const float softmax_scale = scale[0] * 1.4426950408889634f;
  for (int g = 0; g < HEADS_PER_TILE; ++g) {
    const size_t q_row = (size_t(seq) * NUM_HEADS + first_head + g) * HEAD_DIM + lane_in_token * PER_LANE;
    for (int i = 0; i < PER_LANE; ++i) {
      q[g][i] = static_cast<float>(queries[q_row + i]) * softmax_scale;
      acc[g][i] = 0.0f;
    }
    run_max[g] = NEG_BIG;
    run_sum[g] = 0.0f;
  }

  // auto: Metal binds inputs of under 8 elements (a short block table) in `constant`, not `device`.
  const auto table = block_tables + size_t(seq) * max_blocks;
  const size_t lane_offset = size_t(kv_head) * HEAD_DIM + lane_in_token * PER_LANE;
  for (int base = start; base < end; base += TOKENS_PER_STEP) {
    ROW_ALIGN T k_row[UNROLL][PER_LANE];
    ROW_ALIGN T v_row[UNROLL][PER_LANE];
    bool valid[UNROLL];
    for (int u = 0; u < UNROLL; ++u) {
      const int t = base + (u * NUM_WARPS + warp) * TOKENS_PER_WARP + slot_in_warp;
      valid[u] = t < end;
      if (valid[u]) {
        const size_t slot = size_t(table[t / BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE;
        const size_t row = slot * (NUM_KV_HEADS * HEAD_DIM) + lane_offset;
        LOAD_ROW(k_row[u], key_cache + row);
        LOAD_ROW(v_row[u], value_cache + row);
      } else {
        for (int i = 0; i < PER_LANE; ++i) {
          k_row[u][i] = static_cast<T>(0.0f);
          v_row[u][i] = static_cast<T>(0.0f);
        }
      }
    }
    for (int g = 0; g < HEADS_PER_TILE; ++g) {
      float score[UNROLL];
      float step_max = run_max[g];
      for (int u = 0; u < UNROLL; ++u) {
        float dot = 0.0f;
        for (int i = 0; i < PER_LANE; ++i) {
          dot += q[g][i] * static_cast<float>(k_row[u][i]);
        }
        for (int mask = LANES / 2; mask > 0; mask /= 2) {
          dot += SIMD_XOR(dot, mask);
        }
        score[u] = dot;
        step_max = (valid[u] && dot > step_max) ? dot : step_max;
      }
      const float correction = FEXP2(run_max[g] - step_max);
      run_sum[g] *= correction;
      for (int i = 0; i < PER_LANE; ++i) {
        acc[g][i] *= correction;
      }
      for (int u = 0; u < UNROLL; ++u) {
        const float p = valid[u] ? FEXP2(score[u] - step_max) : 0.0f;
        run_sum[g] += p;
        for (int i = 0; i < PER_LANE; ++i) {
          acc[g][i] += p * static_cast<float>(v_row[u][i]);
        }
      }
      run_max[g] = step_max;
    }
  }

  // Merge the token slots of each warp: lanes that differ only above LANES hold the same dims.
  for (int mask = LANES; mask < WARP; mask *= 2) {
    for (int g = 0; g < HEADS_PER_TILE; ++g) {
      const float other_max = SIMD_XOR(run_max[g], mask);
      const float other_sum = SIMD_XOR(run_sum[g], mask);
      const float merged = other_max > run_max[g] ? other_max : run_max[g];
      const float mine_w = FEXP2(run_max[g] - merged);
      const float other_w = FEXP2(other_max - merged);
      run_sum[g] = run_sum[g] * mine_w + other_sum * other_w;
      for (int i = 0; i < PER_LANE; ++i) {
        const float other_acc = SIMD_XOR(acc[g][i], mask);
        acc[g][i] = acc[g][i] * mine_w + other_acc * other_w;
      }
      run_max[g] = merged;
    }
  }

  if (slot_in_warp == 0) {
    for (int g = 0; g < HEADS_PER_TILE; ++g) {
      if (lane_in_token == 0) {
        warp_max[warp][g] = run_max[g];
        warp_sum[warp][g] = run_sum[g];
      }
      for (int i = 0; i < PER_LANE; ++i) {
        warp_acc[warp][g][lane_in_token * PER_LANE + i] = acc[g][i];
      }
    }
  }
  BARRIER();

  for (int idx = tid; idx < HEADS_PER_TILE * HEAD_DIM; idx += NUM_THREADS) {
    const int g = idx / HEAD_DIM;
    const int d = idx % HEAD_DIM;
    float block_max = NEG_BIG;
    for (int w = 0; w < NUM_WARPS; ++w) {
      block_max = warp_max[w][g] > block_max ? warp_max[w][g] : block_max;
    }
    float total = 0.0f;
    float weighted = 0.0f;
    for (int w = 0; w < NUM_WARPS; ++w) {
      const float c = FEXP2(warp_max[w][g] - block_max);
      total += warp_sum[w][g] * c;
      weighted += warp_acc[w][g][d] * c;
    }
    const size_t head_row = size_t(seq) * NUM_HEADS + first_head + g;
    @WRITE@
  }
"""

SINGLE_RANGE = """const int start = 0;
  const int end = context_len;"""

PARTITION_RANGE = """const int start = part * PARTITION;
  const int end = (start + PARTITION < context_len) ? start + PARTITION : context_len;"""

SINGLE_WRITE = """out[head_row * HEAD_DIM + d] = static_cast<T>(weighted / total);"""

PARTITION_WRITE = """const size_t r = head_row * num_partitions + part;
    part_out[r * HEAD_DIM + d] = total > 0.0f ? weighted / total : 0.0f;
    if (d == 0) {
      part_max[r] = block_max;
      part_sum[r] = total;
    }"""

REDUCE_BODY = r"""
  constexpr float NEG_BIG = -1.0e30f;
  const int num_partitions = dims[1];
  const int used = (context_lens[seq] + PARTITION - 1) / PARTITION;
  const size_t r0 = (size_t(seq) * NUM_HEADS + head) * num_partitions;
  float global_max = NEG_BIG;
  for (int p = 0; p < used; ++p) {
    global_max = part_max[r0 + p] > global_max ? part_max[r0 + p] : global_max;
  }
  float total = 0.0f;
  for (int p = 0; p < used; ++p) {
    total += part_sum[r0 + p] * FEXP2(part_max[r0 + p] - global_max);
  }
  for (int d = tid; d < HEAD_DIM; d += NUM_THREADS) {
    float weighted = 0.0f;
    for (int p = 0; p < used; ++p) {
      weighted += part_out[(r0 + p) * HEAD_DIM + d] * part_sum[r0 + p] * FEXP2(part_max[r0 + p] - global_max);
    }
    out[(size_t(seq) * NUM_HEADS + head) * HEAD_DIM + d] = static_cast<T>(weighted / total);
  }
"""

DIALECTS = {
    "cuda": (CUDA_HEADER, CUDA_DECODE_PROLOGUE, CUDA_REDUCE_PROLOGUE),
    "metal": (METAL_HEADER, METAL_DECODE_PROLOGUE, METAL_REDUCE_PROLOGUE),
}


def render_decode(dialect: str, partitioned: bool) -> tuple[str, str]:
    """(header, body) of the decode kernel; the partitioned variant writes per-partition states."""
    header, prologue, _ = DIALECTS[dialect]
    body = DECODE_BODY.replace("@RANGE@", PARTITION_RANGE if partitioned else SINGLE_RANGE)
    body = body.replace("@WRITE@", PARTITION_WRITE if partitioned else SINGLE_WRITE)
    return header, prologue + body


def render_reduce(dialect: str) -> tuple[str, str]:
    """(header, body) of the kernel that merges partitions into the final output."""
    header, _, prologue = DIALECTS[dialect]
    return header, prologue + REDUCE_BODY

"""One paged-decode kernel, written once and rendered for two dialects: Metal and CUDA (NVRTC).

The body below uses a handful of macros (shuffles, barriers, shared memory, exp2,
row loads) that each dialect's header defines, plus a short prologue that
names the thread and threadgroup indices the way that dialect spells them. Everything
else, the algorithm included, is the same text, so what is verified on CUDA is what
runs on Metal.

Algorithm (one threadgroup per sequence x group of query heads sharing one KV head x
partition of the context; the tensor-core loop may give a threadgroup several such groups,
TILES_PER_THREADGROUP, each its own warps, and the setup and merge below serve both):
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
- A layer's additions (orchard/kernels/variants.py) are run-time inputs, so one compiled kernel
  serves every layer: `window` (0: none) moves the first key read to len - window, `scale[1]`
  soft-caps scores, `sinks` (base 2; -1e30 where the layer has none) joins each head's
  denominator once, where the final output is written. Whether a layer has each of them is
  a template constant (`SOFTCAP`, `WINDOWED`, `SINKS`, 0 or 1; their values stay run-time), so
  a plain layer's kernels compile to the code they had before these existed: `tanhf` is a call
  that moved the decode kernel's register rows to a 288-byte stack frame (ptxas, sm_90) and
  made it 5x slower on the H200, and the window's bounds cost the decode kernel a third
  (docs/benchmarks.md).
"""

from __future__ import annotations

#: scale float32 [2]: the softmax scale and the soft cap in base-2 units (0: none); window int32 [1] (0: none);
#: sinks float32 [num_heads] in base-2 units (NO_SINK where the layer has none)
DECODE_INPUTS = ["queries", "key_cache", "value_cache", "block_tables", "context_lens", "scale", "dims", "window", "sinks"]
SINGLE_OUTPUTS = ["out"]
PARTITION_OUTPUTS = ["part_out", "part_max", "part_sum"]
REDUCE_INPUTS = ["part_out", "part_max", "part_sum", "context_lens", "dims", "window", "sinks"]
REDUCE_OUTPUTS = ["out"]
#: a sink logit that adds nothing to any denominator: exp2(NO_SINK - max) is 0
NO_SINK = -1.0e30

CUDA_HEADER = r"""
#define SHARED __shared__
#define BARRIER() __syncthreads()
#define SIMD_XOR(value, mask) __shfl_xor_sync(0xffffffffu, (value), (mask))
#define FEXP2(x) exp2f(x)
#define FTANH(x) tanhf(x)
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
#define COPY_VEC(dst, src) load_row<VEC>((src), (dst))
#define TILE_ALIGN __attribute__((aligned(16)))
#define WARP_BARRIER() __syncwarp()

// Four consecutive elements of a threadgroup tile as float, in one 8- or 16-byte load
// (tile offsets are multiples of four elements).
template <typename U>
__device__ __forceinline__ void load4(const U* src, float* dst) {
  if constexpr (sizeof(U) == 4) {
    const float4 v = *reinterpret_cast<const float4*>(src);
    dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
  } else {
    alignas(8) U tmp[4];
    *reinterpret_cast<uint2*>(tmp) = *reinterpret_cast<const uint2*>(src);
#pragma unroll
    for (int i = 0; i < 4; ++i) {
      dst[i] = static_cast<float>(tmp[i]);
    }
  }
}
#define LOAD4(dst, src) load4((src), (dst))
"""

METAL_HEADER = r"""
#define SHARED threadgroup
#define BARRIER() threadgroup_barrier(mem_flags::mem_threadgroup)
#define SIMD_XOR(value, mask) simd_shuffle_xor((value), (ushort)(mask))
#define FEXP2(x) metal::exp2(x)
#define FTANH(x) metal::precise::tanh(x)
#define ROW_ALIGN
#define LOAD_ROW(dst, src) for (int i_ = 0; i_ < PER_LANE; ++i_) { (dst)[i_] = (src)[i_]; }
#define COPY_VEC(dst, src) for (int i_ = 0; i_ < VEC; ++i_) { (dst)[i_] = (src)[i_]; }
#define TILE_ALIGN
#define WARP_BARRIER() simdgroup_barrier(mem_flags::mem_threadgroup)
#define LOAD4(dst, src) for (int i_ = 0; i_ < 4; ++i_) { (dst)[i_] = static_cast<float>((src)[i_]); }
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

# What every decode body shares: names, the threadgroup's shared partial states, its KV head and range.
DECODE_SETUP = r"""
  constexpr int WARP = 32;
  constexpr int NUM_WARPS = NUM_THREADS / WARP;
  constexpr int HEAD_WARPS = NUM_WARPS / TILES_PER_THREADGROUP;  // warps that share one head tile's range
  constexpr int NUM_HEADS = NUM_KV_HEADS * GROUP;
  constexpr int TILES_PER_KV = GROUP / HEADS_PER_TILE;
  constexpr float NEG_BIG = -1.0e30f;
  SHARED float warp_max[NUM_WARPS][HEADS_PER_TILE];
  SHARED float warp_sum[NUM_WARPS][HEADS_PER_TILE];
  SHARED float warp_acc[NUM_WARPS][HEADS_PER_TILE][HEAD_DIM];

  const int warp = tid / WARP;
  const int lane = tid % WARP;
  const int head_warp = warp % HEAD_WARPS;  // this warp's turn among its head tile's warps
  // A threadgroup takes TILES_PER_THREADGROUP consecutive head tiles, HEAD_WARPS warps each; a tile's
  // first query head (the merge below asks it of every tile of the threadgroup).
  #define TILE_FIRST_HEAD(tile) (((tile) / TILES_PER_KV) * GROUP + ((tile) % TILES_PER_KV) * HEADS_PER_TILE)
  const int my_tile = head_tile * TILES_PER_THREADGROUP + warp / HEAD_WARPS;
  const int kv_head = my_tile / TILES_PER_KV;
  const int first_head = TILE_FIRST_HEAD(my_tile);
  const int max_blocks = dims[0];
  const int num_partitions = dims[1];
  const int context_len = context_lens[seq];
  const int kv_window = WINDOWED ? window[0] : 0;
  const int kv_first = (kv_window > 0 && context_len > kv_window) ? context_len - kv_window : 0;
  @RANGE@
"""

# The SIMT loop: LANES threads a token, UNROLL tokens a step, one online softmax per head and lane.
DECODE_SIMT_LOOP = r"""  constexpr int PER_LANE = HEAD_DIM / LANES;
  constexpr int TOKENS_PER_WARP = WARP / LANES;
  constexpr int TOKENS_PER_STEP = HEAD_WARPS * TOKENS_PER_WARP * UNROLL;
  const int slot_in_warp = lane / LANES;
  const int lane_in_token = lane % LANES;

  float q[HEADS_PER_TILE][PER_LANE];
  float run_max[HEADS_PER_TILE];
  float run_sum[HEADS_PER_TILE];
  float acc[HEADS_PER_TILE][PER_LANE];
  // Scores are kept in base 2 (scale folded with log2(e)) so every exponential is one exp2.
  const float softmax_scale = scale[0] * 1.4426950408889634f;
  const float softcap = scale[1];
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
      const int t = base + (u * HEAD_WARPS + head_warp) * TOKENS_PER_WARP + slot_in_warp;
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
        if (SOFTCAP && softcap > 0.0f) {
          dot = softcap * FTANH(dot / softcap);
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
"""

# Every warp has left its per-head max, sum and weighted V in shared memory: merge them and write.
DECODE_MERGE = r"""  BARRIER();

  for (int idx = tid; idx < TILES_PER_THREADGROUP * HEADS_PER_TILE * HEAD_DIM; idx += NUM_THREADS) {
    const int tile_in_group = idx / (HEADS_PER_TILE * HEAD_DIM);
    const int g = (idx / HEAD_DIM) % HEADS_PER_TILE;
    const int d = idx % HEAD_DIM;
    const int w0 = tile_in_group * HEAD_WARPS;
    float block_max = NEG_BIG;
    for (int w = w0; w < w0 + HEAD_WARPS; ++w) {
      block_max = warp_max[w][g] > block_max ? warp_max[w][g] : block_max;
    }
    float total = 0.0f;
    float weighted = 0.0f;
    for (int w = w0; w < w0 + HEAD_WARPS; ++w) {
      const float c = FEXP2(warp_max[w][g] - block_max);
      total += warp_sum[w][g] * c;
      weighted += warp_acc[w][g][d] * c;
    }
    const int head = TILE_FIRST_HEAD(head_tile * TILES_PER_THREADGROUP + tile_in_group) + g;
    const size_t head_row = size_t(seq) * NUM_HEADS + head;
    const float sink = SINKS ? sinks[head] : NEG_BIG;
    @WRITE@
  }
"""

DECODE_BODY = DECODE_SETUP + DECODE_SIMT_LOOP + DECODE_MERGE

SINGLE_RANGE = """const int start = kv_first;
  const int end = context_len;"""

# Partitions cover the keys the window sees, from kv_first; those past the context read nothing.
PARTITION_RANGE = """const int partition = dims[2];
  const int start = kv_first + part * partition;
  const int end = (start + partition < context_len) ? start + partition : context_len;"""

# The sink joins the denominator only, under a common maximum with the keys' scores.
SINGLE_WRITE = """const float top = sink > block_max ? sink : block_max;
    const float keep = FEXP2(block_max - top);
    out[head_row * HEAD_DIM + d] = static_cast<T>(weighted * keep / (total * keep + FEXP2(sink - top)));"""

PARTITION_WRITE = """const size_t r = head_row * num_partitions + part;
    part_out[r * HEAD_DIM + d] = total > 0.0f ? weighted / total : 0.0f;
    if (d == 0) {
      part_max[r] = block_max;
      part_sum[r] = total;
    }"""

REDUCE_BODY = r"""
  constexpr float NEG_BIG = -1.0e30f;
  const int num_partitions = dims[1];
  const int partition = dims[2];
  const int context_len = context_lens[seq];
  const int kv_window = WINDOWED ? window[0] : 0;
  const int kv_first = (kv_window > 0 && context_len > kv_window) ? context_len - kv_window : 0;
  const int used = (context_len - kv_first + partition - 1) / partition;
  const size_t r0 = (size_t(seq) * NUM_HEADS + head) * num_partitions;
  const float sink = SINKS ? sinks[head] : NEG_BIG;
  float global_max = sink;
  for (int p = 0; p < used; ++p) {
    global_max = part_max[r0 + p] > global_max ? part_max[r0 + p] : global_max;
  }
  float total = FEXP2(sink - global_max);
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

# ---------------------------------------------------------------------------------------------
# Varlen kernel: one launch for the prefill chunks of a step (FlashAttention-2 tiling on SIMT).
#
# Work decomposition (the list is built on the host, orchard/kernels/plan.py): each chunk's queries
# are cut into tiles of Q_TOKENS tokens; a tile's causal context 0..last query is cut into
# partitions; one work unit is one (tile, partition), and one threadgroup runs one unit for
# HEADS_PER_TILE query heads of one KV head: ROWS = Q_TOKENS x HEADS_PER_TILE query rows that
# share every K/V tile it loads. Decode rows (q_len 1) never reach this kernel: the host sends
# them to the decode kernel, whose one-token tiles read K/V at the memory roofline.
# - The query tile and each key tile of KV_TILE keys sit in threadgroup memory in the pool's
#   dtype (Q and K transposed, d-major), loaded with 16-byte reads through the block table.
# - Scores: each thread owns a SUB x SUB register block (SUB rows x SUB consecutive keys);
#   per head dim it reads SUB rows of Q and SUB keys of K as two vector loads and does
#   SUB * SUB float32 FMAs. KEY_LANES = KV_TILE / SUB adjacent lanes share a row block, so a
#   row's max and sum reduce over them by shuffles, and the softmax state stays in registers.
# - Weighted values: the same thread owns its SUB rows x HEAD_DIM / KEY_LANES dims of the
#   output; the weights of its row block go through threadgroup memory within one warp.
# - Two barriers per key tile (tile loaded; tile consumed); the causal mask is evaluated only
#   on tiles that reach past the tile's first query position or the partition end, or, under
#   a sliding window, before the window of the tile's last query. A windowed unit starts at the
#   first key its first query sees, so units wholly before the window read no key at all.
# - Soft cap and sinks as in the decode kernel: the cap on every score, the sink once per row
#   where the final output is written (the merge kernel's, for split tiles).
# - A unit that is its tile's only partition writes the output; the partitions of a split
#   tile write (output, max, sum) per row and the varlen merge kernel combines them.
# Lanes beyond ROWS / SUB row blocks (a tile smaller than one warp) only help load and shuffle.
# ---------------------------------------------------------------------------------------------

VARLEN_INPUTS = ["queries", "key_cache", "value_cache", "block_tables", "units", "scale", "dims", "window", "sinks"]
VARLEN_OUTPUTS = ["out", "part_out", "part_max", "part_sum"]
VARLEN_MERGE_INPUTS = ["part_out", "part_max", "part_sum", "split_rows", "sinks"]
VARLEN_MERGE_OUTPUTS = ["merged"]
#: int32 fields of one work unit, in this order (orchard/kernels/plan.py writes them)
UNIT_FIELDS = ("seq", "query_row", "query_count", "query_position", "kv_start", "kv_end", "partial_row", "split")
#: int32 fields of one row of a split tile: packed query row, first partial row, stride between partitions, partitions
SPLIT_ROW_FIELDS = ("query_row", "partial_row", "partial_stride", "partitions")

CUDA_VARLEN_PROLOGUE = """
  const int tid = int(threadIdx.x);
  const int unit = int(blockIdx.x);
  const int head_tile = int(blockIdx.y);
"""

METAL_VARLEN_PROLOGUE = """
  const int tid = int(thread_index_in_threadgroup);
  const int unit = int(threadgroup_position_in_grid.x);
  const int head_tile = int(threadgroup_position_in_grid.y);
"""

CUDA_VARLEN_MERGE_PROLOGUE = """
  const int tid = int(threadIdx.x);
  const int head = int(blockIdx.x);
  const int split_row = int(blockIdx.y);
"""

METAL_VARLEN_MERGE_PROLOGUE = """
  const int tid = int(thread_index_in_threadgroup);
  const int head = int(threadgroup_position_in_grid.x);
  const int split_row = int(threadgroup_position_in_grid.y);
"""

VARLEN_BODY = r"""
  constexpr int NUM_HEADS = NUM_KV_HEADS * GROUP;
  constexpr int TILES_PER_KV = GROUP / HEADS_PER_TILE;
  constexpr int ROWS = Q_TOKENS * HEADS_PER_TILE;
  constexpr int SUB = 4;
  constexpr int KEY_LANES = KV_TILE / SUB;
  constexpr int ROW_BLOCKS = ROWS / SUB;
  constexpr int OUT_CHUNKS = HEAD_DIM / KV_TILE;
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr int CHUNKS = HEAD_DIM / VEC;
  constexpr int V_STRIDE = HEAD_DIM + VEC;
  constexpr float NEG_BIG = -1.0e30f;
  // V rows are padded by 16 bytes so the 16-byte stores of one quarter-warp hit different banks.
  SHARED TILE_ALIGN T q_tile[HEAD_DIM * ROWS];
  SHARED TILE_ALIGN T k_tile[HEAD_DIM * KV_TILE];
  SHARED TILE_ALIGN T v_tile[KV_TILE * V_STRIDE];
  SHARED TILE_ALIGN float p_tile[KV_TILE * ROWS];

@UNIT@
  const int key_lane = tid % KEY_LANES;
  const bool helper = tid / KEY_LANES >= ROW_BLOCKS;
  const int row0 = helper ? 0 : (tid / KEY_LANES) * SUB;

  // Row r of the tile is query token r / HEADS_PER_TILE, head first_head + r % HEADS_PER_TILE.
  for (int idx = tid; idx < HEAD_DIM * ROWS; idx += NUM_THREADS) {
    const int r = idx % ROWS;
    const size_t q_at = (size_t(query_row + r / HEADS_PER_TILE) * NUM_HEADS + first_head + r % HEADS_PER_TILE) * HEAD_DIM + idx / ROWS;
    q_tile[idx] = r < active_rows ? queries[q_at] : static_cast<T>(0.0f);
  }

  bool row_live[SUB];
  int row_position[SUB];
  float run_max[SUB];
  float run_sum[SUB];
  float acc[SUB][OUT_CHUNKS * SUB];
  for (int i = 0; i < SUB; ++i) {
    row_live[i] = !helper && row0 + i < active_rows;
    row_position[i] = query_position + (row0 + i) / HEADS_PER_TILE;
    run_max[i] = NEG_BIG;
    run_sum[i] = 0.0f;
    for (int e = 0; e < OUT_CHUNKS * SUB; ++e) {
      acc[i][e] = 0.0f;
    }
  }

  // Scores are kept in base 2 (scale folded with log2(e)) so every exponential is one exp2.
  const float softmax_scale = scale[0] * 1.4426950408889634f;
  const float softcap = scale[1];
  // auto: Metal binds inputs of under 8 elements (a short block table) in `constant`, not `device`.
  const auto table = block_tables + size_t(seq) * max_blocks;
  for (int base = kv_first; base < kv_end; base += KV_TILE) {
    // Adjacent lanes take adjacent keys of one 16-byte chunk: the transposed K stores are conflict-free.
    for (int idx = tid; idx < KV_TILE * CHUNKS; idx += NUM_THREADS) {
      const int j = idx % KV_TILE;
      const int c = idx / KV_TILE;
      const int t = base + j;
@KV_CHUNK@
      for (int e = 0; e < VEC; ++e) {
        k_tile[(c * VEC + e) * KV_TILE + j] = k_row[e];
      }
      COPY_VEC(v_tile + j * V_STRIDE + c * VEC, v_row);
    }
    BARRIER();

    float s[SUB][SUB];
    for (int i = 0; i < SUB; ++i) {
      for (int j = 0; j < SUB; ++j) {
        s[i][j] = 0.0f;
      }
    }
    for (int d = 0; d < HEAD_DIM; ++d) {
      float qv[SUB];
      float kv[SUB];
      LOAD4(qv, q_tile + d * ROWS + row0);
      LOAD4(kv, k_tile + d * KV_TILE + key_lane * SUB);
      for (int i = 0; i < SUB; ++i) {
        for (int j = 0; j < SUB; ++j) {
          s[i][j] += qv[i] * kv[j];
        }
      }
    }

    // Below the diagonal (and inside every row's window) every key of the tile is visible to every live row.
    const bool unmasked = base + KV_TILE <= kv_end && base + KV_TILE - 1 <= query_position && base >= window_floor;
    const int key0 = base + key_lane * SUB;
    for (int i = 0; i < SUB; ++i) {
      bool visible[SUB];
      float tile_max = NEG_BIG;
      for (int j = 0; j < SUB; ++j) {
        visible[j] = row_live[i] && (unmasked || (key0 + j < kv_end && key0 + j <= row_position[i]
                                                  && (kv_window == 0 || key0 + j > row_position[i] - kv_window)));
        s[i][j] *= softmax_scale;
        if (SOFTCAP && softcap > 0.0f) {
          s[i][j] = softcap * FTANH(s[i][j] / softcap);
        }
        tile_max = (visible[j] && s[i][j] > tile_max) ? s[i][j] : tile_max;
      }
      for (int mask = KEY_LANES / 2; mask > 0; mask /= 2) {
        const float other = SIMD_XOR(tile_max, mask);
        tile_max = other > tile_max ? other : tile_max;
      }
      const float new_max = tile_max > run_max[i] ? tile_max : run_max[i];
      const float correction = FEXP2(run_max[i] - new_max);
      float tile_sum = 0.0f;
      for (int j = 0; j < SUB; ++j) {
        s[i][j] = visible[j] ? FEXP2(s[i][j] - new_max) : 0.0f;
        tile_sum += s[i][j];
      }
      run_sum[i] = run_sum[i] * correction + tile_sum;
      run_max[i] = new_max;
      for (int e = 0; e < OUT_CHUNKS * SUB; ++e) {
        acc[i][e] *= correction;
      }
    }
    if (!helper) {
      for (int j = 0; j < SUB; ++j) {
        for (int i = 0; i < SUB; ++i) {
          p_tile[(key_lane * SUB + j) * ROWS + row0 + i] = s[i][j];
        }
      }
    }
    // A row block's weights are written and read by the lanes of one warp only.
    WARP_BARRIER();

    if (!helper) {
      for (int j = 0; j < KV_TILE; ++j) {
        float pv[SUB];
        LOAD4(pv, p_tile + j * ROWS + row0);
        for (int c = 0; c < OUT_CHUNKS; ++c) {
          float vv[SUB];
          LOAD4(vv, v_tile + j * V_STRIDE + (c * KEY_LANES + key_lane) * SUB);
          for (int i = 0; i < SUB; ++i) {
            for (int e = 0; e < SUB; ++e) {
              acc[i][c * SUB + e] += pv[i] * vv[e];
            }
          }
        }
      }
    }
    BARRIER();
  }

  for (int i = 0; i < SUB; ++i) {
    float total = run_sum[i];
    for (int mask = KEY_LANES / 2; mask > 0; mask /= 2) {
      total += SIMD_XOR(total, mask);
    }
    if (!row_live[i]) {
      continue;
    }
    const int token = (row0 + i) / HEADS_PER_TILE;
    const int head = first_head + (row0 + i) % HEADS_PER_TILE;
    const size_t out_row = split ? size_t(partial_row + token) * NUM_HEADS + head : size_t(query_row + token) * NUM_HEADS + head;
@SINK@
    for (int c = 0; c < OUT_CHUNKS; ++c) {
      for (int e = 0; e < SUB; ++e) {
        const int d = (c * KEY_LANES + key_lane) * SUB + e;
        if (!split) {
          out[out_row * HEAD_DIM + d] = static_cast<T>(acc[i][c * SUB + e] * keep / denominator);
        } else {
          part_out[out_row * HEAD_DIM + d] = total > 0.0f ? acc[i][c * SUB + e] / total : 0.0f;
        }
      }
    }
    if (split && key_lane == 0) {
      part_max[out_row] = run_max[i];
      part_sum[out_row] = total;
    }
  }
"""

#: Reading one work unit's fields (UNIT_FIELDS) and the query heads its threadgroup serves;
#: shared by this body and the tensor-core one (orchard/kernels/mma_source.py).
VARLEN_UNIT = r"""
  const int max_blocks = dims[0];
  const int u0 = unit * UNIT_FIELDS;
  const int seq = units[u0 + 0];
  const int query_row = units[u0 + 1];
  const int query_count = units[u0 + 2];
  const int query_position = units[u0 + 3];
  const int kv_start = units[u0 + 4];
  const int kv_end = units[u0 + 5];
  const int partial_row = units[u0 + 6];
  const bool split = units[u0 + 7] != 0;
  const int kv_head = head_tile / TILES_PER_KV;
  const int first_head = kv_head * GROUP + (head_tile % TILES_PER_KV) * HEADS_PER_TILE;
  const int active_rows = query_count * HEADS_PER_TILE;
  // A window hides keys before each row's position - window + 1: the first row's bound is where
  // reading starts, the last row's is where every key of a tile is visible to every row.
  const int kv_window = WINDOWED ? window[0] : 0;
  const int window_floor = kv_window > 0 ? query_position + query_count - kv_window : 0;
  const int kv_first = (kv_window > 0 && query_position - kv_window + 1 > kv_start) ? query_position - kv_window + 1 : kv_start;
"""

#: A row's sink joins its denominator when the unit writes the final output (split units leave it to
#: the merge): `keep` rescales the row's sums to the common maximum. Shared by both varlen bodies.
VARLEN_SINK = r"""
    const float sink = (split || !SINKS) ? NEG_BIG : sinks[head];
    const float top = sink > row_max ? sink : row_max;
    const float keep = FEXP2(row_max - top);
    const float denominator = total * keep + FEXP2(sink - top);
"""

#: Pool element where 16-byte chunk `c` of key `t`'s K (or V) row starts for this unit's KV head, through the
#: sequence's block table row `table`. Both varlen bodies read the pool through it.
VARLEN_KV_ROW_AT = "((size_t(table[t / BLOCK_SIZE]) * BLOCK_SIZE + t % BLOCK_SIZE) * NUM_KV_HEADS + kv_head) * HEAD_DIM + c * VEC"

#: One 16-byte chunk `c` of key `t`'s K and V row, read into registers (k_row, v_row); zeros past the
#: unit's context. The SIMT body's load (the tensor-core body copies chunks by cp.async instead).
VARLEN_KV_CHUNK = r"""
      ROW_ALIGN T k_row[VEC];
      ROW_ALIGN T v_row[VEC];
      if (t < kv_end) {
        const size_t at = @KV_ROW_AT@;
        COPY_VEC(k_row, key_cache + at);
        COPY_VEC(v_row, value_cache + at);
      } else {
        // Zeros, not the pool's contents: a weight of 0 times an unowned (NaN) slot would still be NaN.
        for (int e = 0; e < VEC; ++e) {
          k_row[e] = static_cast<T>(0.0f);
          v_row[e] = static_cast<T>(0.0f);
        }
      }
"""

VARLEN_MERGE_BODY = r"""
  constexpr float NEG_BIG = -1.0e30f;
  // Field 0 (the packed query row) is where the host scatters the merged row; the kernel writes row split_row.
  const int s0 = split_row * SPLIT_ROW_FIELDS;
  const int first = split_rows[s0 + 1];
  const int stride = split_rows[s0 + 2];
  const int partitions = split_rows[s0 + 3];
  const float sink = SINKS ? sinks[head] : NEG_BIG;
  float global_max = sink;
  for (int p = 0; p < partitions; ++p) {
    const float m = part_max[size_t(first + p * stride) * NUM_HEADS + head];
    global_max = m > global_max ? m : global_max;
  }
  float total = FEXP2(sink - global_max);
  for (int p = 0; p < partitions; ++p) {
    const size_t r = size_t(first + p * stride) * NUM_HEADS + head;
    total += part_sum[r] * FEXP2(part_max[r] - global_max);
  }
  for (int d = tid; d < HEAD_DIM; d += NUM_THREADS) {
    float weighted = 0.0f;
    for (int p = 0; p < partitions; ++p) {
      const size_t r = size_t(first + p * stride) * NUM_HEADS + head;
      weighted += part_out[r * HEAD_DIM + d] * part_sum[r] * FEXP2(part_max[r] - global_max);
    }
    merged[(size_t(split_row) * NUM_HEADS + head) * HEAD_DIM + d] = static_cast<T>(weighted / total);
  }
"""

VARLEN_DIALECTS = {
    "cuda": (CUDA_VARLEN_PROLOGUE, CUDA_VARLEN_MERGE_PROLOGUE),
    "metal": (METAL_VARLEN_PROLOGUE, METAL_VARLEN_MERGE_PROLOGUE),
}


def _field_count(name: str, fields: tuple) -> str:
    return f"  constexpr int {name} = {len(fields)};\n"


def render_decode(dialect: str, partitioned: bool, body: str = DECODE_BODY) -> tuple[str, str]:
    """(header, body) of the decode kernel; the partitioned variant writes per-partition states.
    `body` is DECODE_BODY or another loop between DECODE_SETUP and DECODE_MERGE (orchard/kernels/mma_decode_source.py)."""
    header, prologue, _ = DIALECTS[dialect]
    body = body.replace("@RANGE@", PARTITION_RANGE if partitioned else SINGLE_RANGE)
    body = body.replace("@WRITE@", PARTITION_WRITE if partitioned else SINGLE_WRITE)
    return header, prologue + body


def render_reduce(dialect: str) -> tuple[str, str]:
    """(header, body) of the kernel that merges partitions into the final output."""
    header, _, prologue = DIALECTS[dialect]
    return header, prologue + REDUCE_BODY


def render_varlen(dialect: str) -> tuple[str, str]:
    """(header, body) of the varlen kernel: one work unit (query tile x context partition) per threadgroup."""
    header = DIALECTS[dialect][0]
    return header, VARLEN_DIALECTS[dialect][0] + _field_count("UNIT_FIELDS", UNIT_FIELDS) + render_shared(VARLEN_BODY, "run_max[i]")


def render_shared(body: str, row_max: str) -> str:
    """A varlen body with the snippets both bodies share filled in; `row_max` names the row's running max."""
    sink = VARLEN_SINK.replace("row_max", row_max)
    body = body.replace("@UNIT@", VARLEN_UNIT).replace("@KV_CHUNK@", VARLEN_KV_CHUNK).replace("@SINK@", sink)
    return body.replace("@KV_ROW_AT@", VARLEN_KV_ROW_AT)


def render_varlen_merge(dialect: str) -> tuple[str, str]:
    """(header, body) of the kernel that merges the partitions of split tiles, one split row per threadgroup."""
    header = DIALECTS[dialect][0]
    return header, VARLEN_DIALECTS[dialect][1] + _field_count("SPLIT_ROW_FIELDS", SPLIT_ROW_FIELDS) + VARLEN_MERGE_BODY

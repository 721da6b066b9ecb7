"""The varlen kernel on NVIDIA's tensor cores: the same work units as VARLEN_BODY, both matmuls in `mma.sync`.

Why a second body: the SIMT body (orchard/kernels/source.py) computes one score per lane with
float32 FMAs, 10-16x slower than dense SDPA on prefill chunks (docs/benchmarks.md); the
matrix units are the only way to chunk attention at the speed the rest of a prefill runs.
It reads the same plan (`units`, partial rows, the merge kernel) and writes the same
outputs, so the host side only picks which body to launch; float32 pools, and Metal, keep
the SIMT body (a `simdgroup_matrix` twin for Metal is the next step, not written yet).

One threadgroup: WARPS warps x 16 query rows (rows are tokens x heads of one KV group, as
in the SIMT body). Key tiles of KV_TILE keys are copied from the pool through the block
table into shared memory by `cp.async`, two buffers deep: the next tile's copies are in
flight while this one is computed on (FlashAttention-2's pipeline; a load-then-compute loop
left every tile's load latency exposed). Per tile:
- S = Q K^T with m16n8k16 MMAs (Q fragments are read from global memory once a unit and
  stay in registers, so shared memory holds only K and V);
- online softmax on the accumulator fragments in registers, base 2 (log2 e folded into the
  scale), row maxima shared by the four lanes of a row through two shuffles;
- O += P V: the S accumulators of two adjacent 8-key tiles are exactly the A fragment of a
  16-key MMA, so P never touches shared memory (FlashAttention-2's register reuse). O's rescale
  by a row's correction is skipped while no row of the warp has a new maximum, which also keeps
  the body at 168 registers (three threadgroups an SM) for layers without a window, sinks or cap.
Fragment layouts follow the PTX ISA for `mma.sync.aligned.m16n8k16.row.col` (lane = 4 x
group + thread-in-group). K's and V's fragments come out of shared memory by `ldmatrix`
(V's transposed), four 8x8 matrices an instruction, where element-wise loads took 6x the
instructions. Shared rows are padded by 8 elements so the 8 rows of each matrix hit
distinct banks.
"""

from __future__ import annotations

from orchard.kernels import source

#: query rows of one warp's MMA tile
ROWS_PER_WARP = 16
#: query rows of one threadgroup (4 warps)
ROWS = 64
#: elements each shared row is padded by (16 bytes of a half type)
ROW_PAD = 8

MMA_HEADER = source.CUDA_HEADER + r"""
template <typename U> struct MmaTile;

template <> struct MmaTile<__half> {
  static __device__ __forceinline__ void run(float* c, const unsigned int* a, const unsigned int* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

template <> struct MmaTile<__nv_bfloat16> {
  static __device__ __forceinline__ void run(float* c, const unsigned int* a, const unsigned int* b) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%0,%1,%2,%3};\n"
        : "+f"(c[0]), "+f"(c[1]), "+f"(c[2]), "+f"(c[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b[0]), "r"(b[1]));
  }
};

// Two consecutive half elements as one 32-bit register (the operand unit of an MMA fragment).
template <typename U>
__device__ __forceinline__ unsigned int pair_at(const U* p) {
  return *reinterpret_cast<const unsigned int*>(p);
}

template <typename U>
__device__ __forceinline__ unsigned int pair_of(U lo, U hi) {
  alignas(4) U pair[2] = {lo, hi};
  return *reinterpret_cast<const unsigned int*>(pair);
}

template <typename U>
__device__ __forceinline__ unsigned int pack_floats(float lo, float hi) {
  return pair_of<U>(static_cast<U>(lo), static_cast<U>(hi));
}

// Whether `p` holds in any lane of the warp (every lane gets the same answer, so a branch on it is uniform).
#define WARP_ANY(p) __any_sync(0xffffffffu, (p))

// Sixteen bytes of a row copied into shared memory by cp.async (sm_80 and later), bypassing registers and L1;
// zeros where `valid` is false (nothing is read then: a NaN in an unowned pool slot stays out).
template <typename U>
__device__ __forceinline__ void stage_copy(U* dst, const U* src, bool valid) {
  const unsigned int to = static_cast<unsigned int>(__cvta_generic_to_shared(dst));
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16, %2;\n" :: "r"(to), "l"(src), "r"(valid ? 16 : 0) : "memory");
}

__device__ __forceinline__ void stage_commit() { asm volatile("cp.async.commit_group;\n" ::: "memory"); }

// Wait until at most N committed groups of this thread's copies are still in flight.
template <int N>
__device__ __forceinline__ void stage_wait() { asm volatile("cp.async.wait_group %0;\n" :: "n"(N) : "memory"); }

// Four 8x8 matrices of 16-bit elements out of shared memory, one warp-wide instruction: lane L names row L % 8
// of matrix L / 8 (16 aligned bytes); register m of lane L gets row L / 4, elements 2 (L % 4) and the next, of
// matrix m, which is an MMA fragment's layout. `_trans` hands out each matrix transposed: column L / 4, rows
// 2 (L % 4) and the next.
template <typename U>
__device__ __forceinline__ void ldmatrix_x4(unsigned int* r, const U* row) {
  const unsigned int at = static_cast<unsigned int>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}

template <typename U>
__device__ __forceinline__ void ldmatrix_x4_trans(unsigned int* r, const U* row) {
  const unsigned int at = static_cast<unsigned int>(__cvta_generic_to_shared(row));
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0,%1,%2,%3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3]) : "r"(at));
}
"""

MMA_PROLOGUE = source.CUDA_VARLEN_PROLOGUE

MMA_BODY = r"""
  constexpr int NUM_HEADS = NUM_KV_HEADS * GROUP;
  constexpr int TILES_PER_KV = GROUP / HEADS_PER_TILE;
  constexpr int ROWS = Q_TOKENS * HEADS_PER_TILE;
  constexpr int STRIDE = HEAD_DIM + ROW_PAD;
  constexpr int K_STEPS = HEAD_DIM / 16;
  constexpr int S_TILES = KV_TILE / 8;
  constexpr int P_STEPS = KV_TILE / 16;
  constexpr int O_TILES = HEAD_DIM / 8;
  constexpr int VEC = 16 / int(sizeof(T));
  constexpr int CHUNKS = HEAD_DIM / VEC;
  constexpr float NEG_BIG = -1.0e30f;
  constexpr float MASKED = -2.0e30f;  // below any running max: exp2(MASKED - max) is 0
  constexpr int TILE_ELEMS = KV_TILE * STRIDE;
  // Two K and two V tiles: the next tile's copies land in one while the other is computed on.
  SHARED TILE_ALIGN T k_tile[2 * TILE_ELEMS];
  SHARED TILE_ALIGN T v_tile[2 * TILE_ELEMS];

@UNIT@
  const int warp = tid / 32;
  const int lane = tid % 32;
  const int group_id = lane / 4;
  const int in_group = lane % 4;

  const auto table = block_tables + size_t(seq) * max_blocks;
  // The copies of the key tile from `first`, into buffer `buf`, as one committed group.
  auto stage_tile = [&](int first, int buf) {
    for (int idx = tid; idx < KV_TILE * CHUNKS; idx += NUM_THREADS) {
      const int j = idx / CHUNKS;
      const int c = idx % CHUNKS;
      const int t = first + j;
      const bool valid = t < kv_end;
      const size_t at = valid ? @KV_ROW_AT@ : 0;
      stage_copy(k_tile + buf * TILE_ELEMS + j * STRIDE + c * VEC, key_cache + at, valid);
      stage_copy(v_tile + buf * TILE_ELEMS + j * STRIDE + c * VEC, value_cache + at, valid);
    }
    stage_commit();
  };
  stage_tile(kv_first, 0);

  // This lane's two rows: r (accumulator elements 0, 1) and r + 8 (elements 2, 3). Row r of the tile is query
  // token r / HEADS_PER_TILE, head first_head + r % HEADS_PER_TILE. Q's fragments come from global memory once a
  // unit, while the first tile's copies are in flight; shared memory holds only K and V.
  const int my_row[2] = {warp * 16 + group_id, warp * 16 + group_id + 8};
  unsigned int qa[K_STEPS][4];
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    const bool live = my_row[h] < active_rows;
    const T* q_at = queries + (size_t(query_row + my_row[h] / HEADS_PER_TILE) * NUM_HEADS + first_head
                               + my_row[h] % HEADS_PER_TILE) * HEAD_DIM + in_group * 2;
    #pragma unroll
    for (int kk = 0; kk < K_STEPS; ++kk) {
      qa[kk][h] = live ? pair_at(q_at + kk * 16) : 0u;
      qa[kk][h + 2] = live ? pair_at(q_at + kk * 16 + 8) : 0u;
    }
  }
  bool row_live[2];
  int row_position[2];
  float run_max[2];
  float run_sum[2];
  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    row_live[h] = my_row[h] < active_rows;
    row_position[h] = query_position + my_row[h] / HEADS_PER_TILE;
    run_max[h] = NEG_BIG;
    run_sum[h] = 0.0f;
  }
  float o[O_TILES][4];
  #pragma unroll
  for (int t = 0; t < O_TILES; ++t) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      o[t][e] = 0.0f;
    }
  }

  const float softmax_scale = scale[0] * 1.4426950408889634f;
  const float softcap = scale[1];
  for (int base = kv_first, buf = 0; base < kv_end; base += KV_TILE, buf ^= 1) {
    if (base + KV_TILE < kv_end) {
      stage_tile(base + KV_TILE, buf ^ 1);  // the other buffer, free since the last iteration's closing barrier
      stage_wait<1>();
    } else {
      stage_wait<0>();
    }
    BARRIER();
    const T* k_buf = k_tile + buf * TILE_ELEMS;
    const T* v_buf = v_tile + buf * TILE_ELEMS;

    float s[S_TILES][4];
    #pragma unroll
    for (int nt = 0; nt < S_TILES; ++nt) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[nt][e] = 0.0f;
      }
      // B fragments of two k-steps in one ldmatrix: lane L names key nt * 8 + L % 8, dims kk * 16 + (L / 8) * 8.
      const T* k_rows = k_buf + (nt * 8 + lane % 8) * STRIDE + (lane / 8) * 8;
      #pragma unroll
      for (int kk = 0; kk + 1 < K_STEPS; kk += 2) {
        unsigned int b[4];
        ldmatrix_x4(b, k_rows + kk * 16);
        MmaTile<T>::run(s[nt], qa[kk], b);
        MmaTile<T>::run(s[nt], qa[kk + 1], b + 2);
      }
      if (K_STEPS % 2) {  // head dims of an odd number of 16s: the last step by pairs
        const T* k_at = k_buf + (nt * 8 + group_id) * STRIDE + (K_STEPS - 1) * 16 + in_group * 2;
        const unsigned int b[2] = {pair_at(k_at), pair_at(k_at + 8)};
        MmaTile<T>::run(s[nt], qa[K_STEPS - 1], b);
      }
    }

    // Below the diagonal (and inside every row's window) every key of the tile is visible to every live row.
    const bool unmasked = base + KV_TILE <= kv_end && base + KV_TILE - 1 <= query_position && base >= window_floor;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      float tile_max = NEG_BIG;
      #pragma unroll
      for (int nt = 0; nt < S_TILES; ++nt) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int key = base + nt * 8 + in_group * 2 + e;
          const bool visible = row_live[h] && (unmasked || (key < kv_end && key <= row_position[h]
                                                            && (kv_window == 0 || key > row_position[h] - kv_window)));
          float v = s[nt][2 * h + e] * softmax_scale;
          if (SOFTCAP && softcap > 0.0f) {
            v = softcap * FTANH(v / softcap);
          }
          v = visible ? v : MASKED;
          s[nt][2 * h + e] = v;
          tile_max = v > tile_max ? v : tile_max;
        }
      }
      #pragma unroll
      for (int mask = 1; mask < 4; mask *= 2) {
        const float other = SIMD_XOR(tile_max, mask);
        tile_max = other > tile_max ? other : tile_max;
      }
      const float new_max = tile_max > run_max[h] ? tile_max : run_max[h];
      const float correction = FEXP2(run_max[h] - new_max);
      float tile_sum = 0.0f;
      #pragma unroll
      for (int nt = 0; nt < S_TILES; ++nt) {
        #pragma unroll
        for (int e = 0; e < 2; ++e) {
          const float p = FEXP2(s[nt][2 * h + e] - new_max);
          s[nt][2 * h + e] = p;
          tile_sum += p;
        }
      }
      run_sum[h] = run_sum[h] * correction + tile_sum;
      run_max[h] = new_max;
      // Once a row's maximum settles (most tiles of a long context) its correction is exactly 1: the warp skips
      // the rescale of O unless some lane's row moved.
      if (WARP_ANY(correction != 1.0f)) {
        #pragma unroll
        for (int t = 0; t < O_TILES; ++t) {
          o[t][2 * h] *= correction;
          o[t][2 * h + 1] *= correction;
        }
      }
    }

    #pragma unroll
    for (int kk = 0; kk < P_STEPS; ++kk) {
      const unsigned int pa[4] = {
          pack_floats<T>(s[2 * kk][0], s[2 * kk][1]), pack_floats<T>(s[2 * kk][2], s[2 * kk][3]),
          pack_floats<T>(s[2 * kk + 1][0], s[2 * kk + 1][1]), pack_floats<T>(s[2 * kk + 1][2], s[2 * kk + 1][3]),
      };
      // B fragments of two O tiles in one transposing ldmatrix: lane L names key kk * 16 + (L / 8 % 2) * 8 + L % 8,
      // dims (t + L / 16) * 8 (O_TILES is even: head dims are whole 16s).
      const T* v_rows = v_buf + (kk * 16 + (lane / 8 % 2) * 8 + lane % 8) * STRIDE + (lane / 16) * 8;
      #pragma unroll
      for (int t = 0; t < O_TILES; t += 2) {
        unsigned int b[4];
        ldmatrix_x4_trans(b, v_rows + t * 8);
        MmaTile<T>::run(o[t], pa, b);
        MmaTile<T>::run(o[t + 1], pa, b + 2);
      }
    }
    BARRIER();
  }
  stage_wait<0>();  // a unit with no keys still issued (zero-filling) copies of one tile: none outlives the thread

  #pragma unroll
  for (int h = 0; h < 2; ++h) {
    float total = run_sum[h];
    total += SIMD_XOR(total, 1);
    total += SIMD_XOR(total, 2);
    if (!row_live[h]) {
      continue;
    }
    const int token = my_row[h] / HEADS_PER_TILE;
    const int head = first_head + my_row[h] % HEADS_PER_TILE;
    const size_t out_row = split ? size_t(partial_row + token) * NUM_HEADS + head : size_t(query_row + token) * NUM_HEADS + head;
@SINK@
    #pragma unroll
    for (int t = 0; t < O_TILES; ++t) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        const int d = t * 8 + in_group * 2 + e;
        if (!split) {
          out[out_row * HEAD_DIM + d] = static_cast<T>(o[t][2 * h + e] * keep / denominator);
        } else {
          part_out[out_row * HEAD_DIM + d] = total > 0.0f ? o[t][2 * h + e] / total : 0.0f;
        }
      }
    }
    if (split && in_group == 0) {
      part_max[out_row] = run_max[h];
      part_sum[out_row] = total;
    }
  }
"""


def shared_bytes(kv_tile: int, head_dim: int, itemsize: int = 2) -> int:
    """Threadgroup memory MMA_BODY declares: two K and two V tiles, rows padded (Q stays in registers)."""
    return itemsize * (head_dim + ROW_PAD) * 4 * kv_tile


def kv_tile_for(head_dim: int, budget_bytes: int) -> int | None:
    """The widest key tile (a multiple of the 16-key MMA step) whose tiles fit the budget."""
    for kv_tile in (64, 32, 16):
        if shared_bytes(kv_tile, head_dim) <= budget_bytes:
            return kv_tile
    return None


def supports(head_dim: int) -> bool:
    """Head dims the body serves: whole 16-wide MMA steps, and at most 128 (accumulators live in registers)."""
    return head_dim % 16 == 0 and head_dim <= 128


def render() -> tuple[str, str]:
    constants = f"  constexpr int ROW_PAD = {ROW_PAD};\n"
    body = source.render_shared(MMA_BODY, "run_max[h]")
    return MMA_HEADER, MMA_PROLOGUE + source._field_count("UNIT_FIELDS", source.UNIT_FIELDS) + constants + body

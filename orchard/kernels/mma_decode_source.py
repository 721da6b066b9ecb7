"""The paged decode kernel on NVIDIA's tensor cores: a GQA group's scores and outputs in `mma.sync`.

Why a second decode loop: the SIMT loop (orchard/kernels/source.py) spends most of a token on
arithmetic, not on its loads: 16 lanes share a key row, so every query head's score costs
4 shuffle rounds a token, and the rows it keeps in flight are capped by 128 registers a
thread (docs/benchmarks.md, "Paged decode kernel, still missed"). Here one m16n8k16 MMA
computes 8 keys x 16 dims of every head of the group at once, and K and V go from global
memory straight into MMA fragments: no shared memory in the loop and no shuffle per key.

It shares the SIMT loop's setup, grid, inputs, partition states and final merge
(DECODE_SETUP and DECODE_MERGE), so the launcher only picks which text to compile. A
threadgroup takes TILES_PER_THREADGROUP head tiles (KV heads), HEAD_WARPS warps each: by
default four KV heads of one warp, which read the same pool blocks at the same time
(`orchard.kernels.launch.threadgroup_shape`). Each warp takes 16 keys a step (a tile's warps
interleave their key tiles) and keeps an online softmax per query head:
- S = Q K^T, rows = the group's query heads (up to 8 of the MMA's 16 rows), columns = 8
  keys. A lane holds B = K^T's fragment for key `group_id`; which head dims each fragment
  register holds is a permutation of our choosing (a dot product does not care), picked so
  that a lane's K slice is 16-byte vectors and 4 lanes read a key's 64 contiguous bytes at
  once. Q's fragments use the same permutation, loaded once.
- O^T = V^T P^T, rows = head dims, columns = query heads: P's fragment is exactly S's
  accumulator registers packed to half (FlashAttention-2's reuse, with keys as the inner
  dimension), and V's fragment pairs two keys' elements of one dim, which a lane builds from
  its own 16-byte loads of four keys (8 lanes read a key's row, 128 contiguous bytes).
  Rescaling O^T by a head's correction takes two lane broadcasts a step.
- Block-table entries: lane L reads the entry of the warp's next tile's position L % 16
  while the current tile computes, and lanes take their positions' blocks by broadcast.
- Pipelined (the default, `KernelTuning.pipelined`): the next tile's K is loaded once this
  tile's scores are taken and its V once this tile's V is used, so a warp's loads are in
  flight while it computes; on the H200 it measured as fast as the plain loop to 5 % faster
  at T = 4,096 and 32,768 (docs/benchmarks.md, "The recorded run: the pipelined tensor-core loop").
  Staging the next tiles through shared memory with cp.async instead, 1 to 4 tiles ahead, measured
  1.4-1.7x slower at T >= 4,096 (docs/benchmarks.md, "K and V staged through shared memory").
Keys past the range are neither loaded nor weighted, so a NaN in an unused pool slot never
reaches an MMA. Half pools only (fp16 or bf16); head dims of 64 and 128; groups of at most
8 query heads a KV head, the whole group in one threadgroup. Everything else keeps the SIMT
loop.
"""

from __future__ import annotations

from orchard.kernels import mma_source, source

#: most query heads one KV head's group may have here: the columns of one O^T MMA tile
MAX_GROUP = 8

#: plain C++ but for its qualifiers, which the CPU emulator swaps for `static` (tests/kernels/mma_emulator.py);
#: `load_words` is each side's own (a vector load here, a copy there)
PLAIN_HELPERS = r"""
// Element e of two keys' rows (as words, two elements a word) side by side in one word: key a's low.
__device__ __forceinline__ unsigned int element_pair(const unsigned int* a, const unsigned int* b, int e) {
  return (e % 2) ? (a[e / 2] >> 16) | (b[e / 2] & 0xffff0000u) : (a[e / 2] & 0xffffu) | (b[e / 2] << 16);
}

// Sixteen bytes of a row into four words, or zeros for a row past the range (never read, so a NaN there stays out).
template <typename U>
__device__ __forceinline__ void load_words_if(bool valid, const U* src, unsigned int* dst) {
  if (valid) {
    load_words(src, dst);
  } else {
    dst[0] = dst[1] = dst[2] = dst[3] = 0u;
  }
}
"""

MMA_DECODE_HEADER = mma_source.MMA_HEADER + r"""
#define SIMD_SHFL(value, src_lane) __shfl_sync(0xffffffffu, (value), (src_lane))

// Sixteen bytes of a row as four 32-bit fragment words, in one vector load (rows are 16-byte aligned).
template <typename U>
__device__ __forceinline__ void load_words(const U* src, unsigned int* dst) {
  const uint4 v = *reinterpret_cast<const uint4*>(src);
  dst[0] = v.x; dst[1] = v.y; dst[2] = v.z; dst[3] = v.w;
}

""" + PLAIN_HELPERS

# Before the loop over key tiles: Q's fragments, the accumulators, the first tile's block entries.
LOOP_SETUP = r"""  constexpr int KEY_TILE = 16;
  constexpr int K_WORDS = HEAD_DIM / 8;  // words of a key row this lane holds (4 lanes a key)
  constexpr int V_WORDS = HEAD_DIM / 16;  // words of a value row this lane holds (8 lanes a key)
  constexpr int K_STEPS = HEAD_DIM / 16;
  constexpr int D_TILES = HEAD_DIM / 16;  // O^T's row tiles
  constexpr float MASKED = -2.0e30f;  // below any running max: exp2(MASKED - max) is 0
  const int group_id = lane / 4;
  const int in_group = lane % 4;
  const bool head_live = group_id < HEADS_PER_TILE;
  const float softmax_scale = scale[0] * 1.4426950408889634f;
  const float softcap = scale[1];
  // The warps of a head tile take turns over its range, 16 keys each.
  const int first_tile = start + head_warp * KEY_TILE;
  const int tile_stride = HEAD_WARPS * KEY_TILE;
  // Word w of a lane's K slice holds dims (w / 4) * 32 + in_group * 8 + (w % 4) * 2 and the next;
  // k-step s reads words 2s (fragment register 0) and 2s + 1 (register 1), for Q and K alike.
  unsigned int qw[K_WORDS];
  #pragma unroll
  for (int c = 0; c < HEAD_DIM / 32; ++c) {
    const size_t q_at = (size_t(seq) * NUM_HEADS + first_head + group_id) * HEAD_DIM + c * 32 + in_group * 8;
    load_words_if(head_live, queries + q_at, qw + 4 * c);
  }
  float o[D_TILES][4];
  #pragma unroll
  for (int i = 0; i < D_TILES; ++i) {
    #pragma unroll
    for (int e = 0; e < 4; ++e) {
      o[i][e] = 0.0f;
    }
  }
  float run_max = NEG_BIG;
  float run_sum = 0.0f;  // this lane's keys only; the group's four lanes add up at the end

  const auto table = block_tables + size_t(seq) * max_blocks;
  const size_t head_offset = size_t(kv_head) * HEAD_DIM;
  constexpr int SLOT_STRIDE = NUM_KV_HEADS * HEAD_DIM;
  // Lane L holds the pool block of position base + L % 16 (0 past the range: the table may end there).
  // The next tile's entries are read while this tile computes, so a table read never sits between a
  // tile's start and its K/V loads; lanes take their positions' blocks by broadcast.
  int block = first_tile + lane % KEY_TILE < end ? int(table[(first_tile + lane % KEY_TILE) / BLOCK_SIZE]) : 0;
"""

# A tile's K into kw: keys @BASE@ + group_id and @BASE@ + 8 + group_id; @BLOCK@ holds the tile's block entries.
LOAD_K = r"""    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      const int t = @BASE@ + h * 8 + group_id;
      const size_t row = (size_t(SIMD_SHFL(@BLOCK@, h * 8 + group_id)) * BLOCK_SIZE + t % BLOCK_SIZE) * SLOT_STRIDE + head_offset;
      #pragma unroll
      for (int c = 0; c < HEAD_DIM / 32; ++c) {
        load_words_if(t < end, key_cache + row + c * 32 + in_group * 8, kw[h] + 4 * c);
      }
    }
"""

# A tile's V into vw: keys @BASE@ + {0, 1, 8, 9} + 2 * in_group, word w holding dims
# (w / 4) * 64 + group_id * 8 + (w % 4) * 2 and the next.
LOAD_V = r"""    #pragma unroll
    for (int j = 0; j < 4; ++j) {
      const int t = @BASE@ + (j / 2) * 8 + 2 * in_group + j % 2;
      const size_t row = (size_t(SIMD_SHFL(@BLOCK@, t - (@BASE@))) * BLOCK_SIZE + t % BLOCK_SIZE) * SLOT_STRIDE + head_offset;
      #pragma unroll
      for (int c = 0; c < HEAD_DIM / 64; ++c) {
        load_words_if(t < end, value_cache + row + c * 64 + group_id * 8, vw[j] + 4 * c);
      }
    }

"""

# S = Q K^T for the tile in kw.
SCORES = r"""    float s[2][4];
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      #pragma unroll
      for (int e = 0; e < 4; ++e) {
        s[h][e] = 0.0f;
      }
      #pragma unroll
      for (int ks = 0; ks < K_STEPS; ++ks) {
        const unsigned int a[4] = {qw[2 * ks], 0u, qw[2 * ks + 1], 0u};
        const unsigned int b[2] = {kw[h][2 * ks], kw[h][2 * ks + 1]};
        MmaTile<T>::run(s[h], a, b);
      }
    }

"""

# Masking, the online softmax, and the correction of this lane's running state.
SOFTMAX = r"""    // This lane's scores: head group_id, keys base + h * 8 + 2 * in_group + e.
    float tile_max = NEG_BIG;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        float v = s[h][e] * softmax_scale;
        if (SOFTCAP && softcap > 0.0f) {
          v = softcap * FTANH(v / softcap);
        }
        v = base + h * 8 + 2 * in_group + e < end ? v : MASKED;
        s[h][e] = v;
        tile_max = v > tile_max ? v : tile_max;
      }
    }
    #pragma unroll
    for (int mask = 1; mask < 4; mask *= 2) {
      const float other = SIMD_XOR(tile_max, mask);
      tile_max = other > tile_max ? other : tile_max;
    }
    const float new_max = tile_max > run_max ? tile_max : run_max;
    const float correction = FEXP2(run_max - new_max);
    float tile_sum = 0.0f;
    #pragma unroll
    for (int h = 0; h < 2; ++h) {
      #pragma unroll
      for (int e = 0; e < 2; ++e) {
        s[h][e] = FEXP2(s[h][e] - new_max);
        tile_sum += s[h][e];
      }
    }
    run_sum = run_sum * correction + tile_sum;
    run_max = new_max;

"""

# O^T += V^T P^T for the tile in vw.
ACCUMULATE = r"""    // O^T's columns in this lane are heads 2 * in_group and 2 * in_group + 1: their corrections
    // live in the lanes of groups 2 * in_group and 2 * in_group + 1.
    const float keep_lo = SIMD_SHFL(correction, 8 * in_group);
    const float keep_hi = SIMD_SHFL(correction, 8 * in_group + 4);
    const unsigned int pb[2] = {pack_floats<T>(s[0][0], s[0][1]), pack_floats<T>(s[1][0], s[1][1])};
    #pragma unroll
    for (int i = 0; i < D_TILES; ++i) {
      o[i][0] *= keep_lo;
      o[i][1] *= keep_hi;
      o[i][2] *= keep_lo;
      o[i][3] *= keep_hi;
      // Row group_id of tile i is element i of this lane's V slice, row group_id + 8 element D_TILES + i;
      // fragment registers 0 and 1 pair keys 2 * in_group and + 1, registers 2 and 3 those 8 later.
      const unsigned int a[4] = {element_pair(vw[0], vw[1], i), element_pair(vw[0], vw[1], D_TILES + i),
                                 element_pair(vw[2], vw[3], i), element_pair(vw[2], vw[3], D_TILES + i)};
      MmaTile<T>::run(o[i], a, pb);
    }
"""

LOOP_END = r"""
  run_sum += SIMD_XOR(run_sum, 1);
  run_sum += SIMD_XOR(run_sum, 2);
"""

KV_REGISTERS = r"""    unsigned int kw[2][K_WORDS];
    unsigned int vw[4][V_WORDS];
"""


def _loads(load: str, base: str, block: str) -> str:
    return load.replace("@BASE@", base).replace("@BLOCK@", block)


def decode_loop(pipelined: bool) -> str:
    """The loop over key tiles. Plain: a tile's K and V are loaded, then used. Pipelined: the next tile's
    K is loaded as soon as this tile's scores are taken and its V as soon as this tile's V is used (the
    same registers), so a warp has loads in flight while it computes."""
    if not pipelined:
        return (LOOP_SETUP + "  for (int base = first_tile; base < end; base += tile_stride) {\n"
                "    const int ahead = base + tile_stride + lane % KEY_TILE;\n"
                "    const int next_block = ahead < end ? int(table[ahead / BLOCK_SIZE]) : 0;\n"
                + KV_REGISTERS + _loads(LOAD_K, "base", "block") + _loads(LOAD_V, "base", "block")
                + SCORES + SOFTMAX + ACCUMULATE + "    block = next_block;\n  }\n" + LOOP_END)
    return (LOOP_SETUP + KV_REGISTERS
            + _loads(LOAD_K, "first_tile", "block") + _loads(LOAD_V, "first_tile", "block")
            + "  {\n    const int second = first_tile + tile_stride + lane % KEY_TILE;\n"
            "    block = second < end ? int(table[second / BLOCK_SIZE]) : 0;\n  }\n"
            + "  for (int base = first_tile; base < end; base += tile_stride) {\n"
            "    const int later = base + 2 * tile_stride + lane % KEY_TILE;\n"
            "    const int later_block = later < end ? int(table[later / BLOCK_SIZE]) : 0;\n"
            + SCORES + _loads(LOAD_K, "(base + tile_stride)", "block") + SOFTMAX + ACCUMULATE
            + _loads(LOAD_V, "(base + tile_stride)", "block")
            + "    block = later_block;\n  }\n" + LOOP_END)


# Warps split one KV head's range: each leaves its states for DECODE_MERGE.
SHARED_STATES = r"""  if (head_live && in_group == 0) {
    warp_max[warp][group_id] = run_max;
    warp_sum[warp][group_id] = run_sum;
  }
  // Element e of this lane's V slice is dim (e / 8) * 64 + group_id * 8 + e % 8.
  #pragma unroll
  for (int c = 0; c < 2; ++c) {
    const int head = 2 * in_group + c;
    if (head < HEADS_PER_TILE) {
      #pragma unroll
      for (int i = 0; i < D_TILES; ++i) {
        const int lo = i, hi = D_TILES + i;
        warp_acc[warp][head][(lo / 8) * 64 + group_id * 8 + lo % 8] = o[i][c];
        warp_acc[warp][head][(hi / 8) * 64 + group_id * 8 + hi % 8] = o[i][2 + c];
      }
    }
  }
"""


def supports(head_dim: int, group: int, heads_per_tile: int, itemsize: int) -> bool:
    """Whether this loop serves a layer: half pools, head dims of 64 or 128, a whole group of at most 8 heads
    in one threadgroup (the launcher's plan decides heads_per_tile)."""
    return itemsize == 2 and head_dim in (64, 128) and heads_per_tile == group <= MAX_GROUP


def register_bound(threads: int, blocks: int | None) -> str:
    """Header lines that bound the kernel's registers so `blocks` threadgroups of `threads` fit an SM
    (`__launch_bounds__`); "" for the compiler's own choice. MLX declares the kernel itself, right after
    the header, so the bound goes in by redefining `__global__` there. Unbounded, the loop takes 180
    registers (five 64-thread threadgroups an SM); bounded for eight it takes 128 and spills 76 bytes,
    and on the H200 a single-pass launch took 7-18 % less time so, a split one 10-17 % more
    (docs/benchmarks.md, "Register bounds, residency and block sizes")."""
    if not blocks:
        return ""
    return f"#undef __global__\n#define __global__ __location__(global) __launch_bounds__({threads}, {blocks})\n"


def render(partitioned: bool, pipelined: bool, threads: int = 64, register_blocks: int | None = None) -> tuple[str, str]:
    """(header, body) of the tensor-core decode kernel, CUDA only; partition states as the SIMT kernel's;
    registers bounded for `register_blocks` threadgroups of `threads` an SM when given (`register_bound`)."""
    body = source.DECODE_SETUP + decode_loop(pipelined) + SHARED_STATES + source.DECODE_MERGE
    _, body = source.render_decode("cuda", partitioned, body)
    return register_bound(threads, register_blocks) + MMA_DECODE_HEADER, body

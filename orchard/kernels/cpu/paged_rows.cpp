// Paged attention on the CPU, row by row, reading K and V from the pool in place.
//
// MLX's reference path gathers a step's context out of the pool into a padded copy and
// then runs SDPA over the copy: three passes over the KV bytes. This primitive makes one:
// each query row (a decode row, or one position of a prefill chunk, causal by its own
// length) reads its keys block by block through its block table, scores them against all
// its query heads (GQA: a key is read once for its group), and reads the values once to sum
// them. Softmax in float32, with the layer's window, attention sinks and soft cap, as
// orchard/kernels/variants.py defines them.

#include <algorithm>
#include <cmath>
#include <condition_variable>
#include <cstdint>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <vector>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"
#include "mlx/utils.h"

#include "mlx_exp.h"
#include "paged_rows.h"

namespace orchard {

namespace {

struct Dims {
  int rows;          // query rows answered
  int num_queries;   // packed queries the rows pick from
  int num_heads;     // query heads
  int num_kv_heads;
  int head_dim;      // keys and queries
  int value_dim;
  int num_blocks;    // pool blocks
  int block_size;
  int max_blocks;    // block-table width
  int window;        // 0: the whole context
  float scale;
  float softcap;     // 0: none
  bool has_sinks;
};

template <typename T>
inline float as_float(T x) {
  return static_cast<float>(x);
}

template <typename KV>
inline float dot(const float* q, const KV* k, int n) {
  float s = 0.f;
#pragma omp simd reduction(+ : s)
  for (int d = 0; d < n; ++d) {
    s += q[d] * as_float(k[d]);
  }
  return s;
}

template <typename KV>
inline void axpy(float* acc, float w, const KV* v, int n) {
#pragma omp simd
  for (int d = 0; d < n; ++d) {
    acc[d] += w * as_float(v[d]);
  }
}

// Calls visit(slot, position) for positions first..length-1 in order, a block at a time: the
// pool slot of a position is its block's id times the block size plus its offset in the block.
template <typename Visit>
inline void for_each_token(const Dims& dm, const int32_t* table, int first, int length, Visit&& visit) {
  for (int b = first / dm.block_size; b * dm.block_size < length; ++b) {
    int block = table[b];
    if (block < 0 || block >= dm.num_blocks) {
      block = 0;  // the planner refuses such tables; never read outside the pool
    }
    const int start = b * dm.block_size;
    const int stop = std::min(start + dm.block_size, length);
    const size_t base = static_cast<size_t>(block) * dm.block_size - start;
    for (int t = std::max(start, first); t < stop; ++t) {
      visit(base + t, t);
    }
  }
}

// Threads that split a call's rows with the thread MLX runs it on. MLX's CPU backend runs a
// stream's primitives on one thread and the engine's other work is mostly waiting for them, so
// the other cores are idle while a step attends. Made on first use, kept for the process.
class Workers {
 public:
  static Workers& shared() {
    static std::mutex making;  // two CPU streams may ask first at once
    std::lock_guard<std::mutex> lock(making);
    if (instance_ == nullptr) {
      int threads = static_cast<int>(std::max(1u, std::min(std::thread::hardware_concurrency(), 8u)));
      if (const char* asked = std::getenv("ORCHARD_CPU_ATTENTION_THREADS")) {
        threads = std::clamp(std::atoi(asked), 1, 64);
      }
      instance_ = new Workers(threads);  // lives as long as the process
    }
    return *instance_;
  }

  int size() const {
    return static_cast<int>(threads_.size()) + 1;
  }

  // task(part) for part in [0, parts): part 0 on the calling thread, the rest on the workers; returns
  // when every part has run. One call at a time (MLX may run several CPU streams).
  void run(int parts, const std::function<void(int)>& task) {
    parts = std::min(parts, size());
    if (parts <= 1) {
      task(0);
      return;
    }
    std::lock_guard<std::mutex> one_call(call_);
    {
      std::lock_guard<std::mutex> lock(mutex_);
      task_ = &task;
      parts_ = parts;
      pending_ = parts - 1;
      ++generation_;
    }
    wake_.notify_all();
    task(0);
    std::unique_lock<std::mutex> lock(mutex_);
    finished_.wait(lock, [this] { return pending_ == 0; });
    task_ = nullptr;
  }

 private:
  explicit Workers(int size) {
    for (int part = 1; part < size; ++part) {
      threads_.emplace_back([this, part] { loop(part); });
      threads_.back().detach();
    }
  }

  void loop(int part) {
    long seen = 0;
    while (true) {
      const std::function<void(int)>* task;
      {
        std::unique_lock<std::mutex> lock(mutex_);
        wake_.wait(lock, [&] { return generation_ != seen; });
        seen = generation_;
        if (part >= parts_) {
          continue;
        }
        task = task_;
      }
      (*task)(part);
      std::lock_guard<std::mutex> lock(mutex_);
      if (--pending_ == 0) {
        finished_.notify_one();
      }
    }
  }

  static inline Workers* instance_ = nullptr;
  std::vector<std::thread> threads_;
  std::mutex call_, mutex_;
  std::condition_variable wake_, finished_;
  const std::function<void(int)>* task_ = nullptr;
  long generation_ = 0;
  int parts_ = 0;
  int pending_ = 0;
};

// Rows cut into `parts` runs of about equal work (keys read), in order.
std::vector<int> split_rows(const int32_t* lengths, int rows, int parts, int window, int capacity) {
  std::vector<long> work(rows + 1, 0);
  for (int i = 0; i < rows; ++i) {
    const int length = std::clamp(lengths[i], 1, capacity);
    work[i + 1] = work[i] + (window > 0 ? std::min(length, window) : length);
  }
  std::vector<int> bounds(parts + 1, rows);
  bounds[0] = 0;
  for (int part = 1; part < parts; ++part) {
    const long target = work[rows] * part / parts;
    bounds[part] = static_cast<int>(std::lower_bound(work.begin(), work.end(), target) - work.begin());
  }
  return bounds;
}

// Keys (positions x query heads) below which a call runs on its own thread: waking a worker costs more
constexpr long kParallelWork = 8192;

// One query row, all its heads: the keys of a position (every KV head's) lie together in the
// pool, so each is read once, in order, a block at a time; then the values the same way.
template <typename Q, typename KV, typename O>
void attend_row(const Dims& dm, const Q* q_row, const KV* keys, const KV* values, const int32_t* table, int length,
                const float* sinks, O* out_row, std::vector<float>& scores, std::vector<float>& work) {
  const int heads = dm.num_heads;
  const int group = heads / dm.num_kv_heads;
  const int first = dm.window > 0 ? std::max(length - dm.window, 0) : 0;
  const size_t seen = static_cast<size_t>(length - first);
  scores.resize(heads * seen);
  work.resize(static_cast<size_t>(heads) * (dm.head_dim + dm.value_dim + 1));
  float* q = work.data();
  float* acc = q + static_cast<size_t>(heads) * dm.head_dim;
  float* denominators = acc + static_cast<size_t>(heads) * dm.value_dim;
  for (size_t i = 0; i < static_cast<size_t>(heads) * dm.head_dim; ++i) {
    q[i] = as_float(q_row[i]) * dm.scale;
  }
  const size_t key_row = static_cast<size_t>(dm.num_kv_heads) * dm.head_dim;
  const size_t value_row = static_cast<size_t>(dm.num_kv_heads) * dm.value_dim;
  for_each_token(dm, table, first, length, [&](const size_t slot, const int t) {
    const KV* k = keys + slot * key_row;
    for (int head = 0; head < heads; ++head) {
      scores[head * seen + (t - first)] = dot(q + head * dm.head_dim, k + (head / group) * dm.head_dim, dm.head_dim);
    }
  });
  for (int head = 0; head < heads; ++head) {
    float* s = scores.data() + head * seen;
    if (dm.softcap > 0.f) {
      for (size_t t = 0; t < seen; ++t) {
        s[t] = dm.softcap * std::tanh(s[t] / dm.softcap);
      }
    }
    float top = dm.has_sinks ? sinks[head] : -INFINITY;
#pragma omp simd reduction(max : top)
    for (size_t t = 0; t < seen; ++t) {
      top = std::max(top, s[t]);
    }
    float sum = dm.has_sinks ? mlx_exp(sinks[head] - top) : 0.f;
#pragma omp simd reduction(+ : sum)
    for (size_t t = 0; t < seen; ++t) {
      s[t] = mlx_exp(s[t] - top);
      sum += s[t];
    }
    denominators[head] = sum;
  }
  std::fill(acc, acc + static_cast<size_t>(heads) * dm.value_dim, 0.f);
  for_each_token(dm, table, first, length, [&](const size_t slot, const int t) {
    const KV* v = values + slot * value_row;
    for (int head = 0; head < heads; ++head) {
      axpy(acc + head * dm.value_dim, scores[head * seen + (t - first)], v + (head / group) * dm.value_dim, dm.value_dim);
    }
  });
  for (int head = 0; head < heads; ++head) {
    const float inverse = 1.f / denominators[head];
    for (int d = 0; d < dm.value_dim; ++d) {
      out_row[head * dm.value_dim + d] = static_cast<O>(acc[head * dm.value_dim + d] * inverse);
    }
  }
}

template <typename Q, typename KV>
void run(const Dims& dm, const mx::array& queries, const mx::array& rows, const mx::array& keys,
         const mx::array& values, const mx::array& tables, const mx::array& lengths, const mx::array* sinks,
         mx::array& out, mx::Stream stream) {
  out.set_data(mx::allocator::malloc(out.nbytes()));
  auto& encoder = mx::cpu::get_command_encoder(stream);
  for (const auto* a : {&queries, &rows, &keys, &values, &tables, &lengths}) {
    encoder.set_input_array(*a);
  }
  if (sinks != nullptr) {
    encoder.set_input_array(*sinks);
  }
  encoder.set_output_array(out);
  encoder.dispatch([dm, q = queries.data<Q>(), r = rows.data<int32_t>(), k = keys.data<KV>(), v = values.data<KV>(),
                    tb = tables.data<int32_t>(), ln = lengths.data<int32_t>(), sk = sinks ? sinks->data<float>() : nullptr,
                    o = out.data<Q>()]() {
    const size_t q_stride = static_cast<size_t>(dm.num_heads) * dm.head_dim;
    const size_t o_stride = static_cast<size_t>(dm.num_heads) * dm.value_dim;
    const int capacity = dm.max_blocks * dm.block_size;
    auto rows_from = [&](int begin, int end) {
      std::vector<float> scores, work;
      for (int i = begin; i < end; ++i) {
        // Lengths and query rows clamped, as block ids are: metadata that arrives as arrays is checked by
        // shape only, and must still never make the kernel read outside its inputs.
        const int length = std::clamp(ln[i], 1, capacity);
        const size_t query = static_cast<size_t>(std::clamp(r[i], 0, std::max(dm.num_queries - 1, 0)));
        attend_row<Q, KV, Q>(dm, q + query * q_stride, k, v,
                             tb + static_cast<size_t>(i) * dm.max_blocks, length, sk, o + i * o_stride, scores, work);
      }
    };
    long total = 0;
    for (int i = 0; i < dm.rows; ++i) {
      total += std::clamp(ln[i], 1, capacity);
    }
    auto& workers = Workers::shared();
    const int parts = total * dm.num_heads < kParallelWork ? 1 : std::min(workers.size(), dm.rows);
    if (parts <= 1) {
      rows_from(0, dm.rows);
      return;
    }
    const std::vector<int> bounds = split_rows(ln, dm.rows, parts, dm.window, capacity);
    workers.run(parts, [&](int part) { rows_from(bounds[part], bounds[part + 1]); });
  });
}

template <typename Q>
void run_kv(const Dims& dm, const std::vector<mx::array>& in, mx::array& out, mx::Stream stream) {
  const mx::array* sinks = in.size() > 6 ? &in[6] : nullptr;  // only a layer with sinks passes them
  switch (in[2].dtype()) {
    case mx::float32:
      return run<Q, float>(dm, in[0], in[1], in[2], in[3], in[4], in[5], sinks, out, stream);
    case mx::float16:
      return run<Q, mx::float16_t>(dm, in[0], in[1], in[2], in[3], in[4], in[5], sinks, out, stream);
    case mx::bfloat16:
      return run<Q, mx::bfloat16_t>(dm, in[0], in[1], in[2], in[3], in[4], in[5], sinks, out, stream);
    default:
      throw std::invalid_argument("orchard paged rows: KV of an unsupported dtype");
  }
}

}  // namespace

class PagedRows : public mx::UnaryPrimitive {
 public:
  PagedRows(mx::Stream stream, Dims dims) : mx::UnaryPrimitive(stream), dims_(dims) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    switch (inputs[0].dtype()) {
      case mx::float32:
        return run_kv<float>(dims_, inputs, out, stream());
      case mx::float16:
        return run_kv<mx::float16_t>(dims_, inputs, out, stream());
      case mx::bfloat16:
        return run_kv<mx::bfloat16_t>(dims_, inputs, out, stream());
      default:
        throw std::invalid_argument("orchard paged rows: queries of an unsupported dtype");
    }
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("orchard paged rows runs on the CPU only");
  }

  const char* name() const override {
    return "OrchardPagedRows";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    const auto& o = static_cast<const PagedRows&>(other);
    return dims_.scale == o.dims_.scale && dims_.window == o.dims_.window && dims_.softcap == o.dims_.softcap &&
           dims_.has_sinks == o.dims_.has_sinks && dims_.rows == o.dims_.rows;
  }

 private:
  Dims dims_;
};

mx::array paged_rows(const mx::array& queries, const mx::array& query_rows, const mx::array& key_cache,
                     const mx::array& value_cache, const mx::array& block_tables, const mx::array& context_lens,
                     const std::optional<mx::array>& sinks, float scale, int window, float softcap,
                     mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("orchard paged rows runs on the CPU stream only");
  }
  if (queries.ndim() != 3 || key_cache.ndim() != 4 || value_cache.ndim() != 4 || block_tables.ndim() != 2 ||
      query_rows.ndim() != 1 || context_lens.ndim() != 1) {
    throw std::invalid_argument("orchard paged rows: queries [N, Hq, D], rows [n], caches [blocks, block_size, Hkv, D], "
                                "tables [n, max_blocks], lengths [n]");
  }
  Dims dm{};
  dm.rows = query_rows.shape(0);
  dm.num_queries = queries.shape(0);
  dm.num_heads = queries.shape(1);
  dm.num_kv_heads = key_cache.shape(2);
  dm.head_dim = key_cache.shape(3);
  dm.value_dim = value_cache.shape(3);
  dm.num_blocks = key_cache.shape(0);
  dm.block_size = key_cache.shape(1);
  dm.max_blocks = block_tables.shape(1);
  dm.window = std::max(window, 0);
  dm.scale = scale;
  dm.softcap = std::max(softcap, 0.f);
  dm.has_sinks = sinks.has_value();
  if (queries.shape(2) != dm.head_dim || dm.num_kv_heads == 0 || dm.num_heads % dm.num_kv_heads != 0 ||
      value_cache.shape(0) != dm.num_blocks ||
      value_cache.shape(1) != dm.block_size || value_cache.shape(2) != dm.num_kv_heads ||
      block_tables.shape(0) != dm.rows || context_lens.shape(0) != dm.rows || key_cache.dtype() != value_cache.dtype()) {
    throw std::invalid_argument("orchard paged rows: shapes or dtypes do not fit together");
  }
  if (dm.rows > 0 && dm.num_queries == 0) {
    throw std::invalid_argument("orchard paged rows: rows asked of no queries");
  }
  if (dm.has_sinks && (sinks->ndim() != 1 || sinks->shape(0) != dm.num_heads)) {
    throw std::invalid_argument("orchard paged rows: sinks must be [num_heads]");
  }
  // A step's metadata reaches every layer as the same evaluated int32 arrays: taken as they are, so a
  // layer's call adds one node to the graph, not one per input.
  auto as_is = [&](const mx::array& a, mx::Dtype dtype) {
    if (a.dtype() == dtype && a.is_available() && a.flags().row_contiguous) {
      return a;
    }
    return mx::contiguous(mx::astype(a, dtype, stream), false, stream);
  };
  std::vector<mx::array> inputs = {
      as_is(queries, queries.dtype()),         as_is(query_rows, mx::int32),  as_is(key_cache, key_cache.dtype()),
      as_is(value_cache, value_cache.dtype()), as_is(block_tables, mx::int32), as_is(context_lens, mx::int32),
  };
  if (dm.has_sinks) {
    inputs.push_back(as_is(*sinks, mx::float32));
  }
  return mx::array({dm.rows, dm.num_heads, dm.value_dim}, queries.dtype(), std::make_shared<PagedRows>(stream, dm),
                   std::move(inputs));
}

}  // namespace orchard

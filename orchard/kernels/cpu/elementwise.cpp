// A layer's elementwise work on the CPU in one pass each, bit for bit what MLX's CPU ops compute.
//
// SwiGLU. MLX's x86 CPU build runs its unary ops one element at a time, and its `exp` (a
// polynomial of six fused multiply-adds) calls the C library's `fmaf` for each of them: the wheel's
// libmlx.so is built for baseline x86-64 and holds no FMA instruction (it imports `fmaf`). A sigmoid
// takes ~20 ns an element, and mlx-lm's SwiGLU was a fifth of a small model's decode step on the CPU
// (docs/benchmarks.md, "serve"). This loop is the same arithmetic in the same order -- the same
// polynomial, `fma` exactly rounded in hardware, rewritten
// only where no result can change (mlx_exp.h) -- vectorized.
//
// Rotary embedding. On the CPU `mx.fast.rope` is composed of MLX ops: per call it computes the
// cosines and sines of every row's angles (the same slow scalar path) and rotates in six more ops,
// for the queries and again for the keys of every layer. Here the tables come once a step
// (orchard/node/model/positions.py takes them from the model's own rope) and each call is one pass
// of the same products and differences.
//
// Both equal MLX's results bit for bit (tests/kernels/test_cpu_elementwise.py). Contraction of
// a * b + c into fma is off for this file (CMakeLists.txt): it would round differently from MLX's
// separate steps.

#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "elementwise.h"
#include "mlx_exp.h"

namespace orchard {

namespace {

// unary_ops.h's Sigmoid, then Multiply twice: silu(g) = g * sigmoid(g), times up.
inline float swiglu_one(float g, float up) {
  const float y = 1.0f / (1.0f + mlx_exp(std::fabs(g)));
  const float sigmoid = g < 0.0f ? y : 1.0f - y;
  return (g * sigmoid) * up;
}

void swiglu_rows(const float* __restrict src, float* __restrict dst, size_t rows, size_t width) {
  for (size_t r = 0; r < rows; ++r) {
    const float* __restrict gate = src + r * 2 * width;
    const float* __restrict up = gate + width;
    float* __restrict out = dst + r * width;
#pragma omp simd
    for (size_t i = 0; i < width; ++i) {
      out[i] = swiglu_one(gate[i], up[i]);
    }
  }
}

class SwiGLU : public mx::UnaryPrimitive {
 public:
  SwiGLU(mx::Stream stream, int intermediate) : mx::UnaryPrimitive(stream), intermediate_(intermediate) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array& in = inputs[0];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    encoder.set_input_array(in);
    encoder.set_output_array(out);
    encoder.dispatch([src = in.data<float>(), dst = out.data<float>(), rows = static_cast<size_t>(in.shape(0)),
                      width = static_cast<size_t>(intermediate_)]() { swiglu_rows(src, dst, rows, width); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("orchard swiglu runs on the CPU only");
  }

  const char* name() const override {
    return "OrchardSwiGLU";
  }

  bool is_equivalent(const mx::Primitive& other) const override {
    return intermediate_ == static_cast<const SwiGLU&>(other).intermediate_;
  }

 private:
  int intermediate_;
};

void rotate(const float* __restrict x, const float* __restrict cos, const float* __restrict sin,
            float* __restrict out, size_t rows, size_t per_row, size_t half) {
  for (size_t r = 0; r < rows; ++r) {
    const float* __restrict c = cos + r * half;
    const float* __restrict s = sin + r * half;
    for (size_t v = 0; v < per_row; ++v) {
      const float* __restrict x1 = x + (r * per_row + v) * 2 * half;
      const float* __restrict x2 = x1 + half;
      float* __restrict o1 = out + (r * per_row + v) * 2 * half;
      float* __restrict o2 = o1 + half;
#pragma omp simd
      for (size_t i = 0; i < half; ++i) {
        o1[i] = x1[i] * c[i] - x2[i] * s[i];
        o2[i] = x2[i] * c[i] + x1[i] * s[i];
      }
    }
  }
}

class RotateRows : public mx::UnaryPrimitive {
 public:
  explicit RotateRows(mx::Stream stream) : mx::UnaryPrimitive(stream) {}

  void eval_cpu(const std::vector<mx::array>& inputs, mx::array& out) override {
    const mx::array &x = inputs[0], &cos = inputs[1], &sin = inputs[2];
    out.set_data(mx::allocator::malloc(out.nbytes()));
    auto& encoder = mx::cpu::get_command_encoder(stream());
    for (const auto* a : {&x, &cos, &sin}) {
      encoder.set_input_array(*a);
    }
    encoder.set_output_array(out);
    const size_t rows = static_cast<size_t>(x.shape(0));
    const size_t half = static_cast<size_t>(x.shape(-1)) / 2;
    const size_t per_row = rows == 0 ? 0 : x.size() / rows / (2 * half);
    encoder.dispatch([x = x.data<float>(), c = cos.data<float>(), s = sin.data<float>(), o = out.data<float>(), rows,
                      per_row, half]() { rotate(x, c, s, o, rows, per_row, half); });
  }

  void eval_gpu(const std::vector<mx::array>&, mx::array&) override {
    throw std::runtime_error("orchard rotate_rows runs on the CPU only");
  }

  const char* name() const override {
    return "OrchardRotateRows";
  }

  bool is_equivalent(const mx::Primitive&) const override {
    return true;
  }
};

// An array's flags are known once it is evaluated; until then MLX's contiguous (free when the layout
// already fits) makes the rows a loop reads.
mx::array row_major(const mx::array& a, mx::Stream stream) {
  return a.is_available() && a.flags().row_contiguous ? a : mx::contiguous(a, false, stream);
}

}  // namespace

mx::array swiglu(const mx::array& gate_up, int intermediate, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("orchard swiglu runs on the CPU stream only");
  }
  if (gate_up.ndim() != 2 || intermediate <= 0 || gate_up.shape(1) != 2 * intermediate) {
    throw std::invalid_argument("orchard swiglu: gate_up must be [rows, 2 * intermediate]");
  }
  if (gate_up.dtype() != mx::float32) {
    throw std::invalid_argument("orchard swiglu: float32 only");
  }
  return mx::array({gate_up.shape(0), intermediate}, mx::float32, std::make_shared<SwiGLU>(stream, intermediate),
                   {row_major(gate_up, stream)});
}

mx::array rotate_rows(const mx::array& x, const mx::array& cos, const mx::array& sin, mx::StreamOrDevice s) {
  auto stream = mx::to_stream(s);
  if (stream.device != mx::Device::cpu) {
    throw std::invalid_argument("orchard rotate_rows runs on the CPU stream only");
  }
  if (x.dtype() != mx::float32 || cos.dtype() != mx::float32 || sin.dtype() != mx::float32) {
    throw std::invalid_argument("orchard rotate_rows: float32 only");
  }
  const int rows = x.ndim() >= 2 ? x.shape(0) : -1;
  const int width = x.ndim() >= 2 ? x.shape(-1) : 0;
  if (rows < 0 || width <= 0 || width % 2 != 0 || cos.ndim() < 1 || sin.ndim() < 1 ||
      cos.size() != static_cast<size_t>(rows) * (width / 2) || sin.size() != cos.size() || cos.shape(0) != rows ||
      sin.shape(0) != rows) {
    throw std::invalid_argument("orchard rotate_rows: x [T, ..., D] with D even, cos and sin [T, D / 2]");
  }
  return mx::array(x.shape(), mx::float32, std::make_shared<RotateRows>(stream),
                   {row_major(x, stream), row_major(cos, stream), row_major(sin, stream)});
}

}  // namespace orchard

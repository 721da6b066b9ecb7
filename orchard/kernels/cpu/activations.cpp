// silu(gate) * up on the CPU, vectorized, bit for bit what MLX's CPU ops compute.
//
// MLX's x86 CPU build runs its unary ops one element at a time, and its `exp` (a polynomial of
// six fused multiply-adds) calls the C library's `fma`, which a build for baseline x86-64 runs
// in software: a sigmoid takes ~20 ns an element, and mlx-lm's SwiGLU was a fifth of a small
// model's decode step on the CPU (docs/benchmarks.md, "serve"). This loop is the same
// arithmetic in the same order -- the same polynomial, `fma` exactly rounded in hardware, rewritten
// only where no result can change (mlx_exp.h) -- so its results equal MLX's bit for bit
// (tests/kernels/test_cpu_activations.py), compiled for the machine it runs on and vectorized.
// Contraction of a * b + c into fma is off for this file (CMakeLists.txt): it would round
// differently from MLX's separate steps.

#include <cmath>
#include <cstdint>
#include <stdexcept>

#include "mlx/allocator.h"
#include "mlx/backend/cpu/encoder.h"
#include "mlx/ops.h"
#include "mlx/primitives.h"

#include "activations.h"
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
  // An array's flags are known once it is evaluated; until then MLX's contiguous (free when the
  // layout already fits) makes the rows the loop reads.
  auto input = gate_up.is_available() && gate_up.flags().row_contiguous ? gate_up : mx::contiguous(gate_up, false, stream);
  return mx::array({gate_up.shape(0), intermediate}, mx::float32, std::make_shared<SwiGLU>(stream, intermediate),
                   {input});
}

}  // namespace orchard

// MLX's CPU exp as a loop can vectorize it (with -fno-trapping-math); shared by the CPU kernels.
#pragma once

#include <bit>
#include <cmath>
#include <cstdint>

namespace orchard {

// mlx/backend/cpu/simd/math.h's exp for one float, step for step. Two rewrites keep it exact and let
// the loop vectorize: MLX's floor(x + 0.5), taken in double, is floor(x) plus one when x's fraction is
// at least a half (x - floor(x) is exact for |x| < 2^23); and the input is clamped to [-88, 88]
// (NaN to 0) first, which changes no value the result keeps (NaN and |x| > 88 are replaced at the end) and keeps
// the float-to-int conversion defined.
inline float mlx_exp(float x_init) {
  float clamped = x_init > 88.0f ? 88.0f : x_init;
  clamped = clamped < -88.0f ? -88.0f : clamped;
  clamped = clamped == clamped ? clamped : 0.0f;
  float x = clamped * 1.442695f;
  float ipart = std::floor(x);
  ipart += (x - ipart >= 0.5f) ? 1.0f : 0.0f;
  const float fpart = x - ipart;
  x = 1.535336188319500e-4f;
  x = std::fma(x, fpart, 1.339887440266574e-3f);
  x = std::fma(x, fpart, 9.618437357674640e-3f);
  x = std::fma(x, fpart, 5.550332471162809e-2f);
  x = std::fma(x, fpart, 2.402264791363012e-1f);
  x = std::fma(x, fpart, 6.931472028550421e-1f);
  x = std::fma(x, fpart, 1.000000000000000f);
  const float two_to_ipart = std::bit_cast<float>((static_cast<int32_t>(ipart) + 127) << 23);
  float result = x_init != x_init ? x_init : two_to_ipart * x;  // NaN stays NaN
  result = x_init > 88.0f ? INFINITY : result;
  return x_init < -88.0f ? 0.0f : result;
}

}  // namespace orchard

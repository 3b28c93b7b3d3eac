// The elementwise loops of Velox's native ops. CMake compiles this file once
// per instruction set, each time with VELOX_ISA naming the namespace and the
// compiler flags for that set (-mavx512f ..., -mavx2, none); the vector
// extensions below then lower to that set's registers. Compiled without FMA
// contraction, so every multiply and add rounds as in the pure-MLX kernel.

#include <cmath>
#include <cstring>

#include "isa_vectors.h"
#include "loops.h"

namespace velox::VELOX_ISA {
namespace {

constexpr int SQUARINGS = 5;                          // velox_cache.kernels.kernel.SQUARINGS
constexpr float CUTOFF = -64.0f / (1 << SQUARINGS);  // velox_cache.kernels.kernel.CUTOFF / 2**SQUARINGS
constexpr float TAYLOR[7] = {1.0f, 1.0f, 0.5f, static_cast<float>(1.0 / 6), static_cast<float>(1.0 / 24),
                             static_cast<float>(1.0 / 120), static_cast<float>(1.0 / 720)};

void row_max(const float* x, float* out, int64_t n) { *out = row_maximum(x, n); }

void shifted_exp(const float* x, float shift, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    float t = x[i] - shift;
    t = ((t != t) | (t > CUTOFF)) ? t : CUTOFF;  // as mx.maximum(t, CUTOFF): NaN stays NaN
    float y = TAYLOR[6] * t + TAYLOR[5];
    y = y * t + TAYLOR[4];
    y = y * t + TAYLOR[3];
    y = y * t + TAYLOR[2];
    y = y * t + TAYLOR[1];
    y = y * t + TAYLOR[0];
    y = y * y;  // SQUARINGS = 5 squarings
    y = y * y;
    y = y * y;
    y = y * y;
    y = y * y;
    out[i] = y;
  }
}

// exp(v) in float32, ~1 ulp: v = n ln2 + r with |r| <= ln2 / 2, exp(r) by Cephes' polynomial.
inline float exp_float32(float v) {
  v = v < 88.3762626647949f ? v : 88.3762626647949f;
  v = v > -87.3365447504019f ? v : -87.3365447504019f;
  constexpr float round = 12582912.0f;  // 1.5 * 2**23: adding and subtracting it rounds to an integer
  const float n = (v * 1.44269504088896341f + round) - round;
  float r = v - n * 0.693359375f;
  r = r - n * -2.12194440e-4f;
  float p = 1.9875691500e-4f;
  p = p * r + 1.3981999507e-3f;
  p = p * r + 8.3334519073e-3f;
  p = p * r + 4.1665795894e-2f;
  p = p * r + 1.6666665459e-1f;
  p = p * r + 5.0000001201e-1f;
  p = p * r * r + r + 1.0f;
  const int32_t bits = (static_cast<int32_t>(n) + 127) << 23;
  float scale;
  std::memcpy(&scale, &bits, sizeof scale);
  return p * scale;
}

void swiglu(const float* gate, const float* x, float* out, int64_t n) {
  for (int64_t i = 0; i < n; ++i) {
    const float g = gate[i];
    out[i] = g / (1.0f + exp_float32(-g)) * x[i];
  }
}

void rope(const float* x, const float* cos, const float* sin, float* out, int64_t half, int64_t n,
          bool traditional) {
  if (traditional) {
    for (int64_t i = 0; i < half; ++i) {
      const float x0 = x[2 * i], x1 = x[2 * i + 1];
      out[2 * i] = x0 * cos[i] - x1 * sin[i];
      out[2 * i + 1] = x0 * sin[i] + x1 * cos[i];
    }
  } else {
    for (int64_t i = 0; i < half; ++i) {
      const float x0 = x[i], x1 = x[i + half];
      out[i] = x0 * cos[i] - x1 * sin[i];
      out[i + half] = x0 * sin[i] + x1 * cos[i];
    }
  }
  for (int64_t i = 2 * half; i < n; ++i) out[i] = x[i];
}

void rms_norm(const float* x, const float* weight, float* out, int64_t n, float inverse_n, float eps) {
  float sum = 0.0f;
  for (int64_t i = 0; i < n; ++i) sum += x[i] * x[i];  // in order: no reassociation, no contraction
  const float scale = 1.0f / std::sqrt(sum * inverse_n + eps);
  for (int64_t i = 0; i < n; ++i) out[i] = x[i] * scale * weight[i];
}

}  // namespace

const Loops loops = {VELOX_NAME(VELOX_ISA), row_max, shifted_exp, swiglu, rope, rms_norm};

}  // namespace velox::VELOX_ISA

// What every per-instruction-set loop file shares: CMake compiles each of them once per instruction set with
// VELOX_ISA naming the namespace (avx512, avx2 or baseline) and that set's compiler flags, and the GCC vector
// types below then lower to that set's registers.
#pragma once

#include <cmath>
#include <cstdint>
#include <cstring>

#ifndef VELOX_ISA
#error "VELOX_ISA must name the instruction set (avx512, avx2 or baseline)"
#endif
#define VELOX_STRINGIFY(x) #x
#define VELOX_NAME(x) VELOX_STRINGIFY(x)

namespace velox::VELOX_ISA {

#if defined(__AVX512F__)
constexpr int VECTOR_BYTES = 64;
#elif defined(__AVX__)
constexpr int VECTOR_BYTES = 32;
#else
constexpr int VECTOR_BYTES = 16;
#endif
constexpr int LANES = VECTOR_BYTES / 4;  // float32 lanes of a vector
typedef float Floats __attribute__((vector_size(VECTOR_BYTES)));
typedef int32_t Ints __attribute__((vector_size(VECTOR_BYTES)));

// The larger of two floats, NaN if either is NaN (as MLX's max).
inline float max_or_nan(float best, float v) { return ((v > best) | (v != v)) ? v : best; }

// The largest of x[0:n], NaN if any is (as MLX's max over a row).
inline float row_maximum(const float* x, int64_t n) {
  Floats best;
  Ints nan = {};
  for (int j = 0; j < LANES; ++j) best[j] = -INFINITY;
  int64_t i = 0;
  for (; i + LANES <= n; i += LANES) {
    Floats v;
    std::memcpy(&v, x + i, sizeof v);
    best = v > best ? v : best;
    nan |= v != v;
  }
  float result = -INFINITY;
  for (int j = 0; j < LANES; ++j) result = nan[j] ? NAN : max_or_nan(result, best[j]);
  for (; i < n; ++i) result = max_or_nan(result, x[i]);
  return result;
}

}  // namespace velox::VELOX_ISA

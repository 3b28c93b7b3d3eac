// The elementwise loops behind Velox's native ops, one set per instruction set.
#pragma once

#include <cstdint>

namespace velox {

struct Loops {
  const char* instruction_set;
  // out[0] = max(x[0:n]), NaN if any x is NaN
  void (*row_max)(const float* x, float* out, int64_t n);
  // out[i] = the kernel's exp((x[i] - shift) * 2**5), multiply/add only
  void (*shifted_exp)(const float* x, float shift, float* out, int64_t n);
  // out[i] = silu(gate[i]) * x[i]
  void (*swiglu)(const float* gate, const float* x, float* out, int64_t n);
  // one row of RoPE: the first 2 * half features rotated by (cos, sin) pairs, the rest copied;
  // traditional pairs are (2i, 2i + 1), the others (i, i + half)
  void (*rope)(const float* x, const float* cos, const float* sin, float* out, int64_t half, int64_t n,
               bool traditional);
  // one row of RMS norm as MLX's CPU fallback of mx.fast.rms_norm computes it: the squares summed in index
  // order, times inverse_n, plus eps, 1 / sqrt of that, then out[i] = (x[i] * it) * weight[i]
  void (*rms_norm)(const float* x, const float* weight, float* out, int64_t n, float inverse_n, float eps);
};

namespace avx512 { extern const Loops loops; }
namespace avx2 { extern const Loops loops; }
namespace baseline { extern const Loops loops; }

// The fastest set this CPU can run (and this build has).
const Loops& best_loops();

}  // namespace velox

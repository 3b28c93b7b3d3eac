// Velox's quantized matmul: the problem one call describes and the loops
// (quantized_loops.cpp, compiled once per instruction set) that solve a range of it.
#pragma once

#include <cstdint>

namespace velox {

enum ScaleType : int { SCALE_FLOAT32 = 0, SCALE_FLOAT16 = 1, SCALE_BFLOAT16 = 2 };

// out = x @ dequantize(w).T, MLX's affine layout: row n of w holds in_features values of `bits` bits, value k
// in bits [k * bits, (k + 1) * bits) of the little-endian row (k % 2 == 0 the low nibble of byte k / 2 at 4 bits);
// value k of row n is q * scales[n, k / group_size] + biases[n, k / group_size].
struct QuantizedProblem {
  const float* x;  // [rows, in_features] float32, each row reordered by the loops' prepare_row
  int64_t rows, in_features, out_features;
  const uint8_t* weights;  // [out_features, in_features * bits / 8], row-major
  const void* scales;      // [out_features, in_features / group_size], row-major, of scale_type
  const void* biases;      // likewise
  int scale_type, bits, group_size;
  float* output;  // [rows, out_features] row-major
};

struct QuantizedLoops {
  const char* instruction_set;
  // One row of x [in_features] in the order run() reads it (at 4 bits the even and odd values of each
  // chunk apart, as a chunk's bytes hold them); `to` has in_features floats.
  void (*prepare_row)(const float* x, float* to, int64_t in_features, int bits);
  // The outputs [first, last) of every row. Each output is summed in one order whatever the range, the number
  // of rows or the thread: the same bits for a row alone or in a batch.
  void (*run)(const QuantizedProblem& problem, int64_t first, int64_t last);
  // The float32 weights of rows [first, last) into `to` ([out_features, in_features] row-major; x, rows and
  // output unused): each fl32(q * scale + bias), as the matmul uses them.
  void (*dequantize)(const QuantizedProblem& problem, int64_t first, int64_t last, float* to);
};

namespace avx512 { extern const QuantizedLoops quantized_loops; }
namespace avx2 { extern const QuantizedLoops quantized_loops; }
namespace baseline { extern const QuantizedLoops quantized_loops; }

// The fastest set this CPU can run (the avx2 set needs FMA too); VELOX_NATIVE_ISA=baseline|avx2|avx512
// picks one by name (for tests and benchmarks; an ISA this CPU lacks is refused).
const QuantizedLoops& best_quantized_loops();

}  // namespace velox

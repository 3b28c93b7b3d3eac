// Velox's greedy choice over a vocabulary: the loops (sampling_loops.cpp, compiled once per
// instruction set) that pick one row's token and its log-probability in one call.
#pragma once

#include <cstdint>

namespace velox {

struct SamplingLoops {
  const char* instruction_set;
  // For logits x[0:n]: lse = MLX's CPU logsumexp of x (max, then exp(x - max) summed in index order, then
  // log(sum) + max); *token = MLX's argmax of x[i] - lse (the first NaN if any, else the first largest),
  // *logprob = that x[i] - lse. `scratch` holds n floats.
  void (*greedy)(const float* x, int64_t n, float* scratch, uint32_t* token, float* logprob);
};

namespace avx512 { extern const SamplingLoops sampling_loops; }
namespace avx2 { extern const SamplingLoops sampling_loops; }
namespace baseline { extern const SamplingLoops sampling_loops; }

// The fastest set this CPU can run (the avx2 set needs FMA too); VELOX_NATIVE_ISA picks one by name.
const SamplingLoops& best_sampling_loops();

}  // namespace velox

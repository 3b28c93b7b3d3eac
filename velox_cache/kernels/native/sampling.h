// Velox's greedy choice over a vocabulary: the loops (sampling_loops.cpp, compiled once per
// instruction set) that pick one row's token and its log-probability in one call (and, for teacher
// forcing, a given token's log-probability from the same pass).
#pragma once

#include <cstdint>

namespace velox {

struct SamplingLoops {
  const char* instruction_set;
  // For logits x[0:n]: lse = MLX's CPU logsumexp of x (max, then exp(x - max) summed in index order, then
  // log(sum) + max); *token = MLX's argmax of x[i] - lse (the first NaN if any, else the first largest),
  // *logprob = that x[i] - lse. `scratch` holds n floats. Where target_logprob is not null, also
  // *target_logprob = x[target] - lse (NaN for a target outside [0, n)): a given token's log-probability.
  void (*greedy)(const float* x, int64_t n, float* scratch, uint32_t* token, float* logprob, int64_t target,
                 float* target_logprob);
};

namespace avx512 { extern const SamplingLoops sampling_loops; }
namespace avx2 { extern const SamplingLoops sampling_loops; }
namespace baseline { extern const SamplingLoops sampling_loops; }

// The fastest set this CPU can run (the avx2 set needs FMA too); VELOX_NATIVE_ISA picks one by name.
const SamplingLoops& best_sampling_loops();

}  // namespace velox

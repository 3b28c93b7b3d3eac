// Picks the loops (loops.cpp, attention_loops.cpp, quantized_loops.cpp, sampling_loops.cpp) for the CPU the module runs on.
#include <cstdlib>
#include <cstring>

#include "attention.h"
#include "loops.h"
#include "quantized.h"
#include "sampling.h"

namespace velox {

namespace {

// The set VELOX_NATIVE_ISA asks for where this CPU runs it, else the fastest it runs (FMA with the x86 sets).
template <typename Set>
const Set& pick(const Set& avx512_set, const Set& avx2_set, const Set& baseline_set) {
  const char* asked = std::getenv("VELOX_NATIVE_ISA");
#if defined(VELOX_HAS_X86_LOOPS)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("fma");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (asked != nullptr && std::strcmp(asked, "baseline") == 0) return baseline_set;
  if (asked != nullptr && std::strcmp(asked, "avx2") == 0 && avx2) return avx2_set;
  if (avx512 && (asked == nullptr || std::strcmp(asked, "avx512") == 0)) return avx512_set;
  if (avx2) return avx2_set;
#else
  (void)asked;
  (void)avx512_set;
  (void)avx2_set;
#endif
  return baseline_set;
}

}  // namespace

// Every op's set is chosen by `pick`, so VELOX_NATIVE_ISA selects the loops of all of them.
const Loops& best_loops() {
#if defined(VELOX_HAS_X86_LOOPS)
  return pick(avx512::loops, avx2::loops, baseline::loops);
#else
  return baseline::loops;
#endif
}

const AttentionLoops& best_attention_loops() {
#if defined(VELOX_HAS_X86_LOOPS)
  return pick(avx512::attention_loops, avx2::attention_loops, baseline::attention_loops);
#else
  return baseline::attention_loops;
#endif
}

const QuantizedLoops& best_quantized_loops() {
#if defined(VELOX_HAS_X86_LOOPS)
  return pick(avx512::quantized_loops, avx2::quantized_loops, baseline::quantized_loops);
#else
  return baseline::quantized_loops;
#endif
}

const SamplingLoops& best_sampling_loops() {
#if defined(VELOX_HAS_X86_LOOPS)
  return pick(avx512::sampling_loops, avx2::sampling_loops, baseline::sampling_loops);
#else
  return baseline::sampling_loops;
#endif
}

}  // namespace velox

// Picks the loops (loops.cpp, attention_loops.cpp) for the CPU the module runs on.
#include <cstdlib>
#include <cstring>

#include "attention.h"
#include "loops.h"

namespace velox {

const Loops& best_loops() {
#if defined(VELOX_HAS_X86_LOOPS)
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq")) return avx512::loops;
  if (__builtin_cpu_supports("avx2")) return avx2::loops;
#endif
  return baseline::loops;
}

const AttentionLoops& best_attention_loops() {
  const char* asked = std::getenv("VELOX_NATIVE_ISA");
#if defined(VELOX_HAS_X86_LOOPS)
  __builtin_cpu_init();
  const bool avx512 = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512dq") &&
                      __builtin_cpu_supports("avx512bw") && __builtin_cpu_supports("avx512vl") &&
                      __builtin_cpu_supports("fma");
  const bool avx2 = __builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma");
  if (asked != nullptr && std::strcmp(asked, "baseline") == 0) return baseline::attention_loops;
  if (asked != nullptr && std::strcmp(asked, "avx2") == 0 && avx2) return avx2::attention_loops;
  if (avx512 && (asked == nullptr || std::strcmp(asked, "avx512") == 0)) return avx512::attention_loops;
  if (avx2) return avx2::attention_loops;
#else
  (void)asked;
#endif
  return baseline::attention_loops;
}

}  // namespace velox

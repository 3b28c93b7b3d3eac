// Picks the loops (loops.cpp) for the CPU the module runs on.
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

}  // namespace velox

// The pool of helper threads kept for the process that Velox's native ops share (the quantized matmul's
// output ranges, the fused attention's tasks): a decode step makes hundreds of small calls, and waking a
// spinning helper costs microseconds where starting a thread costs tens of them.
#pragma once

#include <functional>

namespace velox {

// work() on the calling thread and on up to `threads` - 1 helpers; returns once every call of work() has.
// work() claims its share itself (an atomic counter of tasks): the caller never waits for a helper to wake,
// and a helper that comes late finds nothing left. A call that finds the pool busy (another stream's job)
// runs work() alone.
void run_shared(unsigned threads, const std::function<void()>& work);

// The threads an op takes: `variable`'s count where the environment sets it (1 to 256), else one per core up
// to 8. Callers read it once per process.
unsigned threads_wanted(const char* variable);

}  // namespace velox

// The helper threads Velox's native ops share (pool.h).

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstdlib>
#include <functional>
#include <mutex>
#include <thread>

#include <unistd.h>

#include "pool.h"

namespace velox {
namespace {

// Enough threads for whichever op asks the most (each call still takes only what its own limit says).
unsigned pool_threads() {
  return std::max({threads_wanted("VELOX_QUANTIZED_THREADS"), threads_wanted("VELOX_ATTENTION_THREADS"), 1u});
}

// Helper threads kept for the process: a call wakes them instead of starting threads. After a job a helper
// spins 50 us for the next one, then sleeps. One job at a time: a call that finds the pool busy (another
// stream's) runs alone. A forked child makes its own pool.
class Pool {
 public:
  explicit Pool(unsigned helpers) : pid_(getpid()) {
    for (unsigned i = 0; i < helpers; ++i) std::thread([this, i] { loop(i); }).detach();
    helpers_ = helpers;
  }

  static Pool& instance() {
    static std::mutex creating;
    static Pool* pool = nullptr;
    std::lock_guard lock(creating);
    if (pool == nullptr || pool->pid_ != getpid()) pool = new Pool(pool_threads() - 1);  // never freed: threads outlive
    return *pool;
  }

  // work(), on the calling thread and on up to `threads` - 1 helpers. The caller never waits for a helper to
  // wake: once its own work() returns (every task claimed) it closes the job, and only helpers that joined
  // while it was open are waited for.
  void run(unsigned threads, const std::function<void()>& work) {
    std::unique_lock busy(running_, std::try_to_lock);
    const unsigned helpers = std::min(threads > 0 ? threads - 1 : 0, helpers_);
    if (!busy.owns_lock() || helpers == 0) {
      work();
      return;
    }
    {
      std::lock_guard lock(mutex_);
      job_ = &work;
      open_ = true;
      wanted_ = helpers;
      generation_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_all();
    work();
    {
      std::lock_guard lock(mutex_);
      open_ = false;
    }
    while (active_.load(std::memory_order_acquire) != 0) spin_pause();
  }

 private:
  static void spin_pause() {
#if defined(__x86_64__) || defined(__i386__)
    __builtin_ia32_pause();
#else
    std::this_thread::yield();
#endif
  }

  void loop(unsigned) {
    uint64_t seen = 0;  // the generation at construction: a job posted before this thread ran is still its
    for (;;) {
      const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(SPIN_MICROSECONDS);
      while (generation_.load(std::memory_order_acquire) == seen && std::chrono::steady_clock::now() < until) {
        for (int i = 0; i < 16; ++i) spin_pause();
      }
      const std::function<void()>* job = nullptr;
      {
        std::unique_lock lock(mutex_);
        wake_.wait(lock, [&] { return generation_.load(std::memory_order_acquire) != seen; });
        seen = generation_.load(std::memory_order_acquire);
        if (open_ && wanted_ > 0) {
          --wanted_;
          job = job_;
          active_.fetch_add(1, std::memory_order_acq_rel);
        }
      }
      if (job != nullptr) {
        (*job)();
        active_.fetch_sub(1, std::memory_order_acq_rel);
      }
    }
  }

  static constexpr int SPIN_MICROSECONDS = 50;  // a layer's next matmul comes within this in decoding
  const pid_t pid_;
  unsigned helpers_ = 0;
  std::mutex running_, mutex_;
  std::condition_variable wake_;
  std::atomic<uint64_t> generation_{0};
  const std::function<void()>* job_ = nullptr;
  bool open_ = false;    // the job takes helpers (under mutex_)
  unsigned wanted_ = 0;  // helpers it still takes (under mutex_)
  std::atomic<unsigned> active_{0};  // helpers inside a job
};

}  // namespace

unsigned threads_wanted(const char* variable) {
  constexpr unsigned DEFAULT_MAX_THREADS = 8;
  const char* value = std::getenv(variable);
  const int n = value != nullptr ? std::atoi(value) : 0;
  if (n >= 1) return static_cast<unsigned>(std::min(n, 256));
  return std::min(std::max(1u, std::thread::hardware_concurrency()), DEFAULT_MAX_THREADS);
}

void run_shared(unsigned threads, const std::function<void()>& work) { Pool::instance().run(threads, work); }

}  // namespace velox

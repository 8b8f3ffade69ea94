// The phases of a call, and the pool helpers that share them (threads.h).

#include "threads.h"

#include <atomic>
#include <chrono>
#include <memory>
#include <mutex>
#include <thread>
#include <vector>

#include "isa.h"

namespace terra::native {

namespace {

// The calling thread opens a phase, claims its chunks, and waits for the chunks claimed by helpers
// before it opens the next; helpers follow it from phase to phase. The state is reference-counted,
// so a helper that runs after the call returned finds no chunk and touches nothing but this state.
struct Phases {
  static constexpr int kMax = 4;
  int n_phases = 0;
  int64_t n_chunks[kMax] = {};
  std::atomic<int> open{-1};
  std::atomic<int64_t> next[kMax];
  std::atomic<int64_t> done[kMax];
  std::function<void(int phase, int64_t chunk)> run;

  Phases() {
    for (int p = 0; p < kMax; ++p) next[p].store(0), done[p].store(0);
  }

  // Claims and runs chunks of phase p until none is left; returns after the last claimed by this thread.
  void Work(int p) {
    for (int64_t c; (c = next[p].fetch_add(1, std::memory_order_relaxed)) < n_chunks[p];) {
      run(p, c);
      done[p].fetch_add(1, std::memory_order_release);
    }
  }

  void Help() {
    for (int p; (p = open.load(std::memory_order_acquire)) < n_phases;) {
      if (p >= 0) Work(p);
      for (int64_t spins = 0; open.load(std::memory_order_acquire) == p;) Pause(spins);
    }
  }

  // A waiting thread spins for about kSpins pauses, then yields its core at each check: XLA's
  // executor runs independent operations on the same pool (the Terraformer's two residual
  // streams), and a thread spinning on a core that an operation it waits for needs held that
  // operation off for a scheduler time slice. Past kYields yields it sleeps between checks: on
  // oversubscribed cores (another process, or XLA's own parallel operations over long caches)
  // a yield hands the core to another yielding thread rather than to the one being waited for,
  // and threads that only yield starved each other (docs/decode_speed.md, "Long documents").
  // `spins` counts on every platform: LingeringHelpers::Wait reads it to know when to look at the
  // clock.
  static TERRA_INLINE void Pause(int64_t& spins) {
    ++spins;
#if TERRA_X86
    if (spins < kSpins) return _mm_pause();
#endif
    if (spins < kSpins + kYields) return std::this_thread::yield();
    std::this_thread::sleep_for(std::chrono::microseconds(kSleepUs));
  }
  static constexpr int64_t kSpins = 64;
  static constexpr int64_t kYields = 256;
  static constexpr int64_t kSleepUs = 20;
};

// Helpers stay for the next call. A pool thread woken for a call starts its chunks well into the
// call (a sizeable part of a fused sparse layer's call, during which one core works alone), and
// the calls of a decode step follow each other closely. So a helper that has finished waits up
// to kLingerNs for the next call's phases before it gives its pool thread back, and a call that
// finds a helper waiting hands its phases to it instead of scheduling one. A call never waits for
// a helper: one that arrives late finds the phases closed.
class LingeringHelpers {
 public:
  // Hands `phases` to a waiting helper; false when none is waiting for work.
  bool Post(const std::shared_ptr<Phases>& phases) {
    std::lock_guard<std::mutex> lock(mutex_);
    if (waiting_ <= static_cast<int64_t>(posted_.size())) return false;
    posted_.push_back(phases);
    generation_.fetch_add(1, std::memory_order_release);
    return true;
  }

  // Called by a helper that has finished a call: the next call's phases, or null after kLingerNs.
  std::shared_ptr<Phases> Wait() {
    int64_t seen;
    {
      std::lock_guard<std::mutex> lock(mutex_);
      ++waiting_;
      seen = generation_.load(std::memory_order_relaxed);
    }
    const auto start = std::chrono::steady_clock::now();
    for (int64_t spins = 0;;) {
      const bool posted = generation_.load(std::memory_order_acquire) != seen;
      // The clock is read at each yield, and every 64 pauses before.
      const bool expired = !posted && (spins >= Phases::kSpins || (spins & 63) == 63) &&
                           std::chrono::steady_clock::now() - start > std::chrono::nanoseconds(kLingerNs);
      if (posted || expired) {
        std::lock_guard<std::mutex> lock(mutex_);
        seen = generation_.load(std::memory_order_relaxed);
        if (!posted_.empty()) {
          std::shared_ptr<Phases> phases = std::move(posted_.back());
          posted_.pop_back();
          --waiting_;
          return phases;
        }
        if (expired) {
          --waiting_;
          return nullptr;
        }
      }
      Phases::Pause(spins);
    }
  }

  static constexpr int64_t kLingerNs = 100000;

 private:
  std::mutex mutex_;
  int64_t waiting_ = 0;  // helpers in Wait, each owed at most one posted call
  std::vector<std::shared_ptr<Phases>> posted_;
  std::atomic<int64_t> generation_{0};
};

// Never destroyed: a pool thread may still be waiting in it while the process exits.
LingeringHelpers& Lingering() {
  static LingeringHelpers* helpers = new LingeringHelpers;
  return *helpers;
}

// Helpers scheduled on a pool and not started yet, and the phases this thread is scheduling a
// helper for (set only during pool.Schedule).
std::atomic<int64_t> g_queued{0};
thread_local const Phases* t_scheduling = nullptr;

}  // namespace

int64_t Workers(ffi::ThreadPool& pool) {
  static const int64_t cores = std::max(1u, std::thread::hardware_concurrency());
  return 1 + std::max<int64_t>(0, std::min<int64_t>(pool.num_threads(), cores - 1));
}

void RunPhases(ffi::ThreadPool& pool, bool parallel, std::initializer_list<int64_t> chunks,
               std::function<void(int, int64_t)> run) {
  const int64_t helpers = parallel ? Workers(pool) - 1 : 0;
  if (helpers == 0) {
    int p = 0;
    for (int64_t n : chunks) {
      for (int64_t c = 0; c < n; ++c) run(p, c);
      ++p;
    }
    return;
  }
  auto phases = std::make_shared<Phases>();
  for (int64_t n : chunks)
    if (phases->n_phases < Phases::kMax) phases->n_chunks[phases->n_phases++] = n;
  phases->run = std::move(run);
  for (int64_t h = 0; h < helpers; ++h) {
    if (Lingering().Post(phases)) continue;
    // A helper still queued from an earlier call (its pool threads busy) will linger for the
    // next calls once it starts: queueing more would only pile up helpers in the pool's queue.
    if (g_queued.load(std::memory_order_acquire) >= helpers) break;
    g_queued.fetch_add(1, std::memory_order_acq_rel);
    t_scheduling = phases.get();
    // Eigen's pool runs a task inside Schedule when its queue is full: that helper would wait
    // for phases this thread has not opened yet, so it returns at once instead.
    pool.Schedule([phases] {
      g_queued.fetch_sub(1, std::memory_order_acq_rel);
      if (t_scheduling == phases.get()) return;
      for (std::shared_ptr<Phases> next = phases; next; next = Lingering().Wait()) next->Help();
    });
    t_scheduling = nullptr;
  }
  for (int p = 0; p < phases->n_phases; ++p) {
    phases->open.store(p, std::memory_order_release);
    phases->Work(p);
    for (int64_t spins = 0; phases->done[p].load(std::memory_order_acquire) < phases->n_chunks[p];)
      Phases::Pause(spins);
  }
  phases->open.store(phases->n_phases, std::memory_order_release);
}

}  // namespace terra::native

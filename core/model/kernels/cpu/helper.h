// The threads a kernel splits its work over: the calling thread (one of XLA's) and one helper
// thread of our own, shared by every kernel of the process.
#pragma once

#include <immintrin.h>
#include <unistd.h>

#include <atomic>
#include <condition_variable>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>

// A job of n pieces that threads take one at a time until none is left.
struct Job {
  const std::function<void(int64_t)>* body = nullptr;
  int64_t n = 0;
  std::atomic<int64_t> next{0}, done{0};
  void work() {
    for (int64_t k; (k = next.fetch_add(1)) < n; done.fetch_add(1)) (*body)(k);
  }
};

// One helper thread of our own, started on first use, that spins for a while after each job
// before it sleeps: a decoding step calls the kernel a few hundred times, a tenth of a
// millisecond each, and a thread woken from sleep for each call (XLA's intra-op pool) starts
// too late to take a share.
class Helper {
 public:
  static Helper& get() {
    static Helper* helper = new Helper();  // never destroyed: its thread runs to the process's end
    return *helper;
  }

  // body(k) for k in [0, n) on the calling thread and the helper; on the caller alone while
  // another caller has the helper.
  void run(int64_t n, const std::function<void(int64_t)>& body) {
    std::unique_lock<std::mutex> busy(busy_, std::try_to_lock);
    if (!busy.owns_lock() || n < 2 || getpid() != process_) {  // a forked child has no helper
      for (int64_t k = 0; k < n; ++k) body(k);
      return;
    }
    job_.body = &body;
    job_.n = n;
    job_.next.store(0);
    job_.done.store(0);
    {
      std::lock_guard<std::mutex> lock(sleep_);
      posted_.fetch_add(1, std::memory_order_release);
    }
    wake_.notify_one();
    job_.work();
    while (job_.done.load(std::memory_order_acquire) < n) _mm_pause();
    // The helper may still be about to read `next`; wait until it is back to waiting.
    while (taken_.load(std::memory_order_acquire) != posted_.load()) _mm_pause();
  }

 private:
  Helper() : process_(getpid()) { std::thread([this] { loop(); }).detach(); }

  void loop() {
    for (uint64_t seen = 0;;) {
      for (int spin = 0; posted_.load(std::memory_order_acquire) == seen && spin < kSpins; ++spin) _mm_pause();
      if (posted_.load(std::memory_order_acquire) == seen) {
        std::unique_lock<std::mutex> lock(sleep_);
        wake_.wait(lock, [&] { return posted_.load() != seen; });
      }
      seen = posted_.load(std::memory_order_acquire);
      job_.work();
      taken_.store(seen, std::memory_order_release);
    }
  }

  static constexpr int kSpins = 2000;  // pauses (tens of microseconds): longer than the gaps between a step's products
  const pid_t process_;
  Job job_;
  std::mutex busy_, sleep_;
  std::condition_variable wake_;
  std::atomic<uint64_t> posted_{0}, taken_{0};
};

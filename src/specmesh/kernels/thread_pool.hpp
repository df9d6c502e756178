// A fixed pool of worker threads that run one data-parallel job at a time.
//
// A decode step hands the pool a few hundred short jobs (one per matmul); waking a sleeping
// thread costs tens of microseconds, so workers spin briefly on the job counter before they
// block, and the caller spins for the stragglers the same way.
#pragma once

#include <atomic>
#include <condition_variable>
#include <cstddef>
#include <cstdint>
#include <functional>
#include <mutex>
#include <thread>
#include <vector>

namespace specmesh {

class ThreadPool {
 public:
  explicit ThreadPool(int n_threads);  // n_threads >= 1; the caller counts as one
  ~ThreadPool();
  ThreadPool(const ThreadPool&) = delete;
  ThreadPool& operator=(const ThreadPool&) = delete;

  int size() const { return n_threads_; }

  // Runs fn(ith, nth) on every thread (ith in [0, nth)) and returns when all are done.
  // Not reentrant: one caller at a time (a device actor serialises its jobs).
  void run(const std::function<void(int ith, int nth)>& fn);

  // Splits [0, n) into contiguous ranges, one per thread, and calls fn(begin, end) for each.
  void parallel_for(size_t n, const std::function<void(size_t begin, size_t end)>& fn);

 private:
  void worker(int ith);

  int n_threads_;
  std::vector<std::thread> threads_;
  std::mutex mu_;
  std::condition_variable cv_start_;
  std::condition_variable cv_done_;
  const std::function<void(int, int)>* job_ = nullptr;
  std::atomic<uint64_t> generation_{0};
  std::atomic<int> pending_{0};
  int sleepers_ = 0;     // workers blocked on cv_start_ (guarded by mu_)
  bool caller_waiting_ = false;
  std::atomic<bool> stop_{false};
};

}  // namespace specmesh

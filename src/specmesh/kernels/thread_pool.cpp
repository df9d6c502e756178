#include "specmesh/kernels/thread_pool.hpp"

#include <algorithm>
#if defined(__x86_64__) || defined(__i386__)
#include <immintrin.h>
#define SPECMESH_PAUSE() _mm_pause()
#else
#define SPECMESH_PAUSE() std::this_thread::yield()
#endif

namespace specmesh {

namespace {
// About 50-100 us of polling: longer than the gap between two matmuls of a decode step,
// far shorter than a scheduler time slice.
constexpr int kSpin = 20000;
}  // namespace

ThreadPool::ThreadPool(int n_threads) : n_threads_(std::max(1, n_threads)) {
  for (int i = 1; i < n_threads_; ++i) threads_.emplace_back([this, i] { worker(i); });
}

ThreadPool::~ThreadPool() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
    generation_.fetch_add(1, std::memory_order_release);
  }
  cv_start_.notify_all();
  for (auto& t : threads_) t.join();
}

void ThreadPool::run(const std::function<void(int, int)>& fn) {
  if (n_threads_ == 1) {
    fn(0, 1);
    return;
  }
  job_ = &fn;
  pending_.store(n_threads_ - 1, std::memory_order_relaxed);
  generation_.fetch_add(1, std::memory_order_release);
  {
    std::lock_guard<std::mutex> lk(mu_);
    if (sleepers_ > 0) cv_start_.notify_all();
  }
  fn(0, n_threads_);  // the caller does its share instead of sleeping
  for (int i = 0; i < kSpin && pending_.load(std::memory_order_acquire) != 0; ++i) SPECMESH_PAUSE();
  if (pending_.load(std::memory_order_acquire) != 0) {
    std::unique_lock<std::mutex> lk(mu_);
    caller_waiting_ = true;
    cv_done_.wait(lk, [this] { return pending_.load(std::memory_order_acquire) == 0; });
    caller_waiting_ = false;
  }
  job_ = nullptr;
}

void ThreadPool::parallel_for(size_t n, const std::function<void(size_t, size_t)>& fn) {
  run([&](int ith, int nth) {
    size_t per = (n + nth - 1) / nth;
    size_t b = std::min(n, per * ith), e = std::min(n, b + per);
    if (b < e) fn(b, e);
  });
}

void ThreadPool::worker(int ith) {
  uint64_t seen = 0;
  for (;;) {
    // Spin for the next job, then block.
    for (int i = 0; i < kSpin && generation_.load(std::memory_order_acquire) == seen; ++i) SPECMESH_PAUSE();
    if (generation_.load(std::memory_order_acquire) == seen) {
      std::unique_lock<std::mutex> lk(mu_);
      ++sleepers_;
      cv_start_.wait(lk, [&] { return generation_.load(std::memory_order_acquire) != seen; });
      --sleepers_;
    }
    if (stop_.load()) return;
    seen = generation_.load(std::memory_order_acquire);
    (*job_)(ith, n_threads_);
    if (pending_.fetch_sub(1, std::memory_order_acq_rel) == 1) {
      std::lock_guard<std::mutex> lk(mu_);
      if (caller_waiting_) cv_done_.notify_one();
    }
  }
}

}  // namespace specmesh

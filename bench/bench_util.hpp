// Helpers the benchmarks share: thread pools kept across benchmark runs, medians, wall-clock
// seconds, and the machine's streaming read bandwidth (what rooflines are drawn from).
#pragma once

#include <immintrin.h>

#include <algorithm>
#include <chrono>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <map>
#include <memory>
#include <vector>

#include "specmesh/kernels/aligned_buffer.hpp"
#include "specmesh/kernels/thread_pool.hpp"

namespace specmesh::bench {

// One pool per thread count, made on first use and kept (starting threads is not what a
// benchmark measures).
inline ThreadPool& pool(int n) {
  static std::map<int, std::unique_ptr<ThreadPool>> pools;
  auto& p = pools[n];
  if (!p) p = std::make_unique<ThreadPool>(n);
  return *p;
}

// The upper median: the middle element, or the higher of the two middle ones.
inline double median(std::vector<double> x) {
  std::sort(x.begin(), x.end());
  return x[x.size() / 2];
}

// Wall-clock seconds since t0.
inline double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

// The sum of buf[b, e) with 256-bit loads, eight in flight (e - b a multiple of 32): on the
// development machine about 1.25x the bandwidth 64-bit loads reach, and above what decode
// reaches, so a roofline built on it is not one decode can beat.
__attribute__((target("avx2"))) inline uint64_t sum_avx2(const uint64_t* buf, size_t b, size_t e) {
  __m256i a0 = _mm256_setzero_si256(), a1 = a0, a2 = a0, a3 = a0;
  for (size_t i = b; i < e; i += 32) {
    const __m256i* p = reinterpret_cast<const __m256i*>(buf + i);
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(p));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(p + 1));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(p + 2));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(p + 3));
    a0 = _mm256_add_epi64(a0, _mm256_loadu_si256(p + 4));
    a1 = _mm256_add_epi64(a1, _mm256_loadu_si256(p + 5));
    a2 = _mm256_add_epi64(a2, _mm256_loadu_si256(p + 6));
    a3 = _mm256_add_epi64(a3, _mm256_loadu_si256(p + 7));
  }
  const __m256i a = _mm256_add_epi64(_mm256_add_epi64(a0, a1), _mm256_add_epi64(a2, a3));
  uint64_t lanes[4];
  std::memcpy(lanes, &a, sizeof lanes);
  return lanes[0] + lanes[1] + lanes[2] + lanes[3];
}

// The sum of buf[b, e), read as fast as this CPU reads: what the bandwidth figures stream.
inline uint64_t read_sum(const uint64_t* buf, size_t b, size_t e) {
  uint64_t s = 0;
  if (__builtin_cpu_supports("avx2")) {
    const size_t m = b + (e - b) / 32 * 32;
    s = sum_avx2(buf, b, m);
    b = m;
  }
  uint64_t a0 = 0, a1 = 0, a2 = 0, a3 = 0;
  for (; b + 4 <= e; b += 4) {
    a0 += buf[b];
    a1 += buf[b + 1];
    a2 += buf[b + 2];
    a3 += buf[b + 3];
  }
  for (; b < e; ++b) s += buf[b];
  return s + a0 + a1 + a2 + a3;
}

// The sum of thread ith's share of buf[0, words) when nth threads read it: contiguous shares
// of a multiple of the 32 words read_sum takes at a time, the last one to the end.
inline uint64_t read_share(const uint64_t* buf, size_t words, int ith, int nth) {
  const size_t per = words / size_t(nth) / 32 * 32;
  return read_sum(buf, per * size_t(ith), ith + 1 == nth ? words : per * size_t(ith + 1));
}

// Streaming read bandwidth (GB/s) over a buffer much larger than the caches, like the
// read-only part of STREAM: each thread sums its own contiguous share, the best of `reps`.
inline double read_bandwidth(ThreadPool& pool, size_t bytes, int reps = 5) {
  // Allocated as the weights and the KV cache are (AlignedBuffer: huge pages where the kernel
  // gives them). A std::vector's 4 KiB pages read 14-16 % slower here (page walks, and the
  // hardware prefetcher stops at every page), a roofline decode then beat by up to 25 %.
  static AlignedBuffer mem;
  if (mem.size() < bytes) {
    mem = AlignedBuffer(bytes, false);
    std::fill_n(reinterpret_cast<uint64_t*>(mem.data()), bytes / 8, uint64_t(1));
  }
  const uint64_t* buf = reinterpret_cast<const uint64_t*>(mem.data());
  const size_t words = bytes / 8;
  double best = 0;
  std::vector<uint64_t> partial(pool.size() * 8);  // a cache line per thread
  for (int rep = 0; rep < reps; ++rep) {
    const auto t0 = std::chrono::steady_clock::now();
    pool.run([&](int ith, int nth) { partial[ith * 8] = read_share(buf, words, ith, nth); });
    const double sec = seconds_since(t0);
    uint64_t check = 0;
    for (uint64_t p : partial) check += p;
    if (check == 0) std::fprintf(stderr, "impossible\n");  // keeps the loads alive
    best = std::max(best, double(words) * 8.0 / sec / 1e9);
  }
  return best;
}

}  // namespace specmesh::bench

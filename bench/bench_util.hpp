// Helpers the benchmarks share: thread pools kept across benchmark runs, and medians.
#pragma once

#include <algorithm>
#include <map>
#include <memory>
#include <vector>

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

}  // namespace specmesh::bench

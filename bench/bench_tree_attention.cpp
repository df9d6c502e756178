// Tree attention: the interval-masked tiled kernel against the dense-mask kernel, on the same
// inputs in the same run, for N tree tokens over a committed prefix of P keys.
//
// Layout: 8 query heads sharing 2 KV heads (GQA 4:1), head_dim 64 -- one slice of a
// TinyLlama-class layer. Trees: "chain" is a spine with a one-leaf side branch on every 8th
// spine node; "bushy" is a complete 4-ary tree. Both are stored in DFS pre-order.
//
// Each configuration alternates tiled and dense runs until its time budget is spent and
// keeps each kernel's fastest run, which filters out interference from other processes.
//
//   bench_tree_attention [--quick | --full] [--csv FILE]
//
// --quick (default, about 30 s on one free core) gives each configuration 0.1 s, so the
// largest (N = 4096 over 8192 prefix keys) runs each kernel once; --full gives each 1 s.
// Mask bytes: the intervals take 8 N + 4 (two int32 per node and the prefix length), the
// dense mask N^2. "max diff" is the largest difference between the two kernels' outputs.
#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <memory>
#include <random>
#include <string>
#include <vector>

#include "specmesh/kernels/thread_pool.hpp"
#include "specmesh/kernels/tree_attention.hpp"

namespace {

using namespace specmesh;

constexpr int kHeads = 8, kHeadsKv = 2, kHeadDim = 64;

// Intervals of a forest given by parent links whose nodes are already in DFS pre-order
// (parent[i] < i, subtrees contiguous): start = i, end = i + subtree size.
std::vector<TreeSpan> pre_order_spans(const std::vector<int>& parent) {
  const size_t n = parent.size();
  std::vector<int32_t> size(n, 1);
  for (size_t i = n; i-- > 1;)
    if (parent[i] >= 0) size[parent[i]] += size[i];
  std::vector<TreeSpan> spans(n);
  for (size_t i = 0; i < n; ++i) spans[i] = TreeSpan{int32_t(i), int32_t(i) + size[i]};
  return spans;
}

// A spine whose every 8th node first gets a leaf, then the next spine node.
std::vector<int> chain_like(size_t n) {
  std::vector<int> parent;
  int spine = -1;
  for (size_t k = 0; parent.size() < n; ++k) {
    if (k % 8 == 7 && spine >= 0) parent.push_back(spine);
    if (parent.size() == n) break;
    parent.push_back(spine);
    spine = int(parent.size()) - 1;
  }
  return parent;
}

// The first n nodes, in pre-order, of a complete `width`-ary tree deep enough to hold n.
std::vector<int> bushy(size_t n, int width) {
  int depth = 0;
  for (size_t full = 1, level = 1; full < n; ++depth) level *= width, full += level;
  std::vector<int> parent;
  std::vector<std::pair<int, int>> stack;  // (node, depth)
  parent.push_back(-1);
  stack.push_back({0, 0});
  std::vector<int> children_left{width};
  while (!stack.empty() && parent.size() < n) {
    auto [u, d] = stack.back();
    if (d == depth || children_left[u] == 0) {
      stack.pop_back();
      continue;
    }
    --children_left[u];
    parent.push_back(u);
    children_left.push_back(width);
    stack.push_back({int(parent.size()) - 1, d + 1});
  }
  return parent;
}

struct Inputs {
  std::vector<TreeSpan> spans;
  std::vector<uint8_t> mask;
  std::vector<float> q, k, v;
  std::vector<int32_t> cells;
  size_t n_prefix;

  TreeAttnProblem problem(float* out) const {
    const size_t qs = size_t(kHeads) * kHeadDim;
    return TreeAttnProblem{q.data(), qs, KvRows{k.data(), v.data(), size_t(kHeadsKv) * kHeadDim}, cells.data(),
                           n_prefix, spans.size(), kHeads, kHeadsKv, kHeadDim, 1.0f / std::sqrt(float(kHeadDim)),
                           out, qs};
  }
};

Inputs make_inputs(const std::vector<int>& parent, size_t n_prefix) {
  Inputs in;
  in.spans = pre_order_spans(parent);
  in.mask = dense_tree_mask(in.spans.data(), in.spans.size());
  in.n_prefix = n_prefix;
  const size_t n = parent.size(), rows = n_prefix + n;
  std::mt19937 rng(42);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  in.q.resize(n * kHeads * kHeadDim);
  in.k.resize(rows * kHeadsKv * kHeadDim);
  in.v.resize(in.k.size());
  for (auto* buf : {&in.q, &in.k, &in.v})
    for (auto& x : *buf) x = dist(rng);
  in.cells.resize(rows);
  for (size_t i = 0; i < rows; ++i) in.cells[i] = int32_t(i);
  return in;
}

double seconds_since(std::chrono::steady_clock::time_point t0) {
  return std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
}

struct Result {
  double tiled_s = INFINITY, dense_s = INFINITY, max_diff = 0;
};

Result measure(const Inputs& in, ThreadPool* pool, double budget_s) {
  std::vector<float> out_tiled(in.q.size()), out_dense(in.q.size());
  const TreeAttnProblem pt = in.problem(out_tiled.data()), pd = in.problem(out_dense.data());
  Result r;
  const auto start = std::chrono::steady_clock::now();
  do {
    auto t0 = std::chrono::steady_clock::now();
    tree_attention(pt, in.spans.data(), pool);
    r.tiled_s = std::min(r.tiled_s, seconds_since(t0));
    t0 = std::chrono::steady_clock::now();
    tree_attention_dense(pd, in.mask.data(), pool);
    r.dense_s = std::min(r.dense_s, seconds_since(t0));
  } while (seconds_since(start) < budget_s);
  for (size_t i = 0; i < out_tiled.size(); ++i)
    r.max_diff = std::max(r.max_diff, double(std::fabs(out_tiled[i] - out_dense[i])));
  return r;
}

}  // namespace

int main(int argc, char** argv) {
  bool full = false;
  std::string csv_path;
  for (int i = 1; i < argc; ++i) {
    const std::string a = argv[i];
    if (a == "--full") {
      full = true;
    } else if (a == "--quick") {
      full = false;
    } else if (a == "--csv" && i + 1 < argc) {
      csv_path = argv[++i];
    } else {
      std::fprintf(stderr, "usage: %s [--quick | --full] [--csv FILE]\n", argv[0]);
      return 2;
    }
  }
  const double budget_s = full ? 1.0 : 0.1;

  std::unique_ptr<std::ofstream> csv;
  if (!csv_path.empty()) {
    csv = std::make_unique<std::ofstream>(csv_path);
    if (!*csv) {
      std::fprintf(stderr, "cannot write %s\n", csv_path.c_str());
      return 1;
    }
    *csv << "shape,n_tree,n_prefix,threads,tiled_ms,dense_ms,speedup,interval_mask_bytes,dense_mask_bytes,"
            "max_abs_diff\n";
  }

  std::printf("tree attention: %d query heads, %d KV heads, head_dim %d; best of runs within %.1f s\n", kHeads,
              kHeadsKv, kHeadDim, budget_s);
  std::printf("%-6s %5s %6s %3s %11s %11s %7s %10s %10s %9s\n", "shape", "N", "prefix", "thr", "tiled ms",
              "dense ms", "speedup", "ivl bytes", "mask bytes", "max diff");
  ThreadPool pool1(1), pool2(2);
  for (const char* shape : {"chain", "bushy"}) {
    for (size_t n : {16, 64, 256, 1024, 4096}) {
      const auto parent = std::strcmp(shape, "chain") == 0 ? chain_like(n) : bushy(n, 4);
      for (size_t prefix : {0, 512, 8192}) {
        const Inputs in = make_inputs(parent, prefix);
        const size_t ivl_bytes = 8 * n + 4, mask_bytes = n * n;
        for (ThreadPool* pool : {&pool1, &pool2}) {
          const Result r = measure(in, pool, budget_s);
          std::printf("%-6s %5zu %6zu %3d %11.3f %11.3f %6.2fx %10zu %10zu %9.2e\n", shape, n, prefix, pool->size(),
                      r.tiled_s * 1e3, r.dense_s * 1e3, r.dense_s / r.tiled_s, ivl_bytes, mask_bytes, r.max_diff);
          std::fflush(stdout);
          if (csv)
            *csv << shape << ',' << n << ',' << prefix << ',' << pool->size() << ',' << r.tiled_s * 1e3 << ','
                 << r.dense_s * 1e3 << ',' << r.dense_s / r.tiled_s << ',' << ivl_bytes << ',' << mask_bytes << ','
                 << r.max_diff << '\n';
        }
      }
    }
  }
  return 0;
}

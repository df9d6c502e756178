// Tree attention: the interval-masked tiled kernel against the dense-mask kernel and against a
// per-query softmax over exactly the visible keys (found from parent links, not intervals),
// on chains, bushy and random trees, with and without a prefix, GQA and not, both SIMD paths
// and several thread counts.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <numeric>
#include <random>
#include <string>
#include <tuple>
#include <vector>

#include "specmesh/kernels/matmul.hpp"
#include "specmesh/kernels/thread_pool.hpp"
#include "specmesh/kernels/tree_attention.hpp"

#include "isa.hpp"

namespace specmesh {
namespace {

using test::isas;

// A tree in DFS pre-order: parent[i] < i (or -1 for a root) and spans from one DFS counter.
struct Tree {
  std::vector<int> parent;
  std::vector<TreeSpan> spans;
};

// Reorders a forest given by parent links (any node order, -1 = root) into DFS pre-order,
// children in their original order, and records each node's (entry count, count after subtree).
Tree dfs_order(const std::vector<int>& parent) {
  const int n = int(parent.size());
  std::vector<std::vector<int>> children(n);
  std::vector<int> roots;
  for (int u = 0; u < n; ++u) (parent[u] < 0 ? roots : children[parent[u]]).push_back(u);
  Tree t;
  t.parent.resize(n);
  t.spans.resize(n);
  std::vector<int> rank(n);
  int counter = 0;
  // Explicit stack of (node, next child index): deep chains would overflow recursion.
  std::vector<std::pair<int, size_t>> stack;
  for (int root : roots) {
    stack.push_back({root, 0});
    rank[root] = counter;
    t.parent[counter] = -1;
    t.spans[counter].start = counter;
    ++counter;
    while (!stack.empty()) {
      auto& [u, next] = stack.back();
      if (next < children[u].size()) {
        const int c = children[u][next++];
        rank[c] = counter;
        t.parent[counter] = rank[u];
        t.spans[counter].start = counter;
        ++counter;
        stack.push_back({c, 0});
      } else {
        t.spans[rank[u]].end = counter;
        stack.pop_back();
      }
    }
  }
  return t;
}

std::vector<int> chain(int n) {
  std::vector<int> p(n);
  for (int i = 0; i < n; ++i) p[i] = i - 1;
  return p;
}

// Complete `width`-ary tree numbered breadth first (so DFS order differs from the input order).
std::vector<int> bushy(int n, int width) {
  std::vector<int> p(n);
  for (int i = 0; i < n; ++i) p[i] = i == 0 ? -1 : (i - 1) / width;
  return p;
}

// Each node hangs under a random earlier node; a few extra roots make it a forest.
std::vector<int> random_tree(int n, uint32_t seed) {
  std::mt19937 rng(seed);
  std::vector<int> p(n);
  for (int i = 0; i < n; ++i) {
    if (i == 0 || rng() % 97 == 0) {
      p[i] = -1;
    } else {
      // Bias towards recent nodes for depth, with occasional jumps back for width.
      const int back = rng() % 4 == 0 ? int(rng() % i) : int(rng() % std::min(i, 6));
      p[i] = i - 1 - back;
    }
  }
  return p;
}

struct Layout {
  int n_head, n_head_kv, head_dim;
};

struct Case {
  Tree tree;
  size_t n_prefix;
  Layout lay;
  std::vector<float> q, k, v;
  std::vector<int32_t> cells;
  size_t kv_stride;

  TreeAttnProblem problem(float* out) const {
    const size_t qs = size_t(lay.n_head) * lay.head_dim;
    return TreeAttnProblem{q.data(), qs, KvRows{k.data(), v.data(), kv_stride}, cells.data(), n_prefix,
                           tree.spans.size(), lay.n_head, lay.n_head_kv, lay.head_dim,
                           1.0f / std::sqrt(float(lay.head_dim)), out, qs};
  }
};

// Random queries and a KV cache with more rows than used, cells in shuffled order and the
// KV heads padded within each row, so indexing mistakes show.
Case make_case(const std::vector<int>& parent, size_t n_prefix, Layout lay, uint32_t seed) {
  Case c;
  c.tree = dfs_order(parent);
  c.n_prefix = n_prefix;
  c.lay = lay;
  const size_t n = parent.size();
  std::mt19937 rng(seed);
  std::normal_distribution<float> dist(0.0f, 1.0f);
  c.q.resize(n * lay.n_head * lay.head_dim);
  for (auto& x : c.q) x = 2.0f * dist(rng);  // sharper softmax than unit queries
  const size_t n_rows = n_prefix + n + 7;
  c.kv_stride = size_t(lay.n_head_kv) * lay.head_dim + 3;
  c.k.resize(n_rows * c.kv_stride);
  c.v.resize(n_rows * c.kv_stride);
  for (auto& x : c.k) x = dist(rng);
  for (auto& x : c.v) x = dist(rng);
  std::vector<int32_t> rows(n_rows);
  std::iota(rows.begin(), rows.end(), 0);
  std::shuffle(rows.begin(), rows.end(), rng);
  c.cells.assign(rows.begin(), rows.begin() + (n_prefix + n));
  return c;
}

// Softmax over the prefix and the ancestors-or-self of each query (via parent links), in double.
std::vector<float> naive(const Case& c) {
  const auto& lay = c.lay;
  const size_t n = c.tree.parent.size(), d = lay.head_dim, group = lay.n_head / lay.n_head_kv;
  const double scale = 1.0 / std::sqrt(double(d));
  std::vector<float> out(n * lay.n_head * d);
  for (size_t i = 0; i < n; ++i) {
    std::vector<size_t> keys(c.n_prefix);
    std::iota(keys.begin(), keys.end(), 0);
    for (int a = int(i); a >= 0; a = c.tree.parent[a]) keys.push_back(c.n_prefix + a);
    for (int h = 0; h < lay.n_head; ++h) {
      const float* q = c.q.data() + (i * lay.n_head + h) * d;
      const size_t off = (h / group) * d;
      std::vector<double> s(keys.size());
      double mx = -INFINITY;
      for (size_t j = 0; j < keys.size(); ++j) {
        const float* k = c.k.data() + size_t(c.cells[keys[j]]) * c.kv_stride + off;
        double dot = 0;
        for (size_t x = 0; x < d; ++x) dot += double(q[x]) * k[x];
        s[j] = dot * scale;
        mx = std::max(mx, s[j]);
      }
      double sum = 0;
      std::vector<double> o(d, 0.0);
      for (size_t j = 0; j < keys.size(); ++j) {
        const double w = std::exp(s[j] - mx);
        sum += w;
        const float* v = c.v.data() + size_t(c.cells[keys[j]]) * c.kv_stride + off;
        for (size_t x = 0; x < d; ++x) o[x] += w * v[x];
      }
      for (size_t x = 0; x < d; ++x) out[(i * lay.n_head + h) * d + x] = float(o[x] / sum);
    }
  }
  return out;
}

std::vector<float> run_tiled(const Case& c, ThreadPool* pool) {
  std::vector<float> out(c.q.size(), NAN);
  tree_attention(c.problem(out.data()), c.tree.spans.data(), pool);
  return out;
}

std::vector<float> run_dense(const Case& c, ThreadPool* pool) {
  std::vector<float> out(c.q.size(), NAN);
  const auto mask = dense_tree_mask(c.tree.spans.data(), c.tree.spans.size());
  tree_attention_dense(c.problem(out.data()), mask.data(), pool);
  return out;
}

void expect_near(const std::vector<float>& got, const std::vector<float>& want, float tol, const std::string& what) {
  ASSERT_EQ(got.size(), want.size()) << what;
  float worst = 0;
  size_t at = 0;
  for (size_t i = 0; i < got.size(); ++i) {
    const float e = std::isfinite(got[i]) ? std::fabs(got[i] - want[i]) : INFINITY;
    if (!(e <= worst)) worst = e, at = i;
  }
  EXPECT_LE(worst, tol) << what << ": worst at " << at << " got " << got[at] << " want " << want[at];
}

struct Shape {
  std::string name;
  std::vector<int> parent;
};

std::vector<Shape> shapes() {
  std::vector<Shape> v{
      {"single", chain(1)},
      {"chain40", chain(40)},
      {"chain100", chain(100)},
      {"bushy4x85", bushy(85, 4)},
      {"bushy5x200", bushy(200, 5)},
      {"wide_root", bushy(70, 69)},  // a root and 69 leaves
  };
  // Chains and branches whose DFS order crosses query (16) and key (32) tile boundaries.
  for (int n : {15, 17, 31, 33, 47, 65, 130, 257}) v.push_back({"random" + std::to_string(n), random_tree(n, 7 + n)});
  return v;
}

const Layout kGqa{8, 2, 64};
const Layout kMha{4, 4, 32};
const Layout kOddDim{2, 1, 20};  // head_dim not a multiple of 8: the portable path

class TreeAttention : public test::IsaTest {};

TEST_F(TreeAttention, DenseMaskIsAncestorOrSelf) {
  for (const auto& sh : shapes()) {
    const Tree t = dfs_order(sh.parent);
    const size_t n = t.parent.size();
    const auto mask = dense_tree_mask(t.spans.data(), n);
    for (size_t i = 0; i < n; ++i) {
      std::vector<uint8_t> want(n, 0);
      for (int a = int(i); a >= 0; a = t.parent[a]) want[a] = 1;
      for (size_t j = 0; j < n; ++j) ASSERT_EQ(mask[i * n + j], want[j]) << sh.name << " i=" << i << " j=" << j;
    }
  }
}

TEST_F(TreeAttention, MatchesNaiveAndDenseOnEveryShape) {
  for (const auto& isa : isas()) {
    ASSERT_TRUE(matmul_set_isa(isa.c_str()));
    for (const Layout& lay : {kGqa, kMha, kOddDim}) {
      for (size_t prefix : {size_t(0), size_t(37), size_t(64)}) {
        for (const auto& sh : shapes()) {
          const std::string what = isa + " " + sh.name + " prefix " + std::to_string(prefix) + " heads " +
                                   std::to_string(lay.n_head) + "/" + std::to_string(lay.n_head_kv) + " d " +
                                   std::to_string(lay.head_dim);
          const Case c = make_case(sh.parent, prefix, lay, 11);
          const auto tiled = run_tiled(c, nullptr);
          expect_near(tiled, naive(c), 2e-5f, what + " vs naive");
          expect_near(tiled, run_dense(c, nullptr), 1e-6f, what + " vs dense");
        }
      }
    }
  }
}

TEST_F(TreeAttention, LargeRandomTreeWithLongPrefix) {
  for (const auto& isa : isas()) {
    ASSERT_TRUE(matmul_set_isa(isa.c_str()));
    const Case c = make_case(random_tree(600, 3), 300, kGqa, 5);
    const auto tiled = run_tiled(c, nullptr);
    expect_near(tiled, naive(c), 2e-5f, isa + " vs naive");
    expect_near(tiled, run_dense(c, nullptr), 1e-6f, isa + " vs dense");
  }
}

TEST_F(TreeAttention, ThreadCountDoesNotChangeTheResult) {
  ThreadPool p2(2), p3(3);
  for (const auto& isa : isas()) {
    ASSERT_TRUE(matmul_set_isa(isa.c_str()));
    for (const Layout& lay : {kGqa, kMha}) {
      for (const auto& parent : {random_tree(300, 9), bushy(200, 4), chain(90)}) {
        const Case c = make_case(parent, 45, lay, 13);
        const auto one = run_tiled(c, nullptr);
        EXPECT_EQ(run_tiled(c, &p2), one) << isa;
        EXPECT_EQ(run_tiled(c, &p3), one) << isa;
        const auto dense = run_dense(c, nullptr);
        EXPECT_EQ(run_dense(c, &p2), dense) << isa;
        EXPECT_EQ(run_dense(c, &p3), dense) << isa;
      }
    }
  }
}

TEST_F(TreeAttention, SimdPathsAgree) {
  const auto paths = isas();
  if (paths.size() < 2) GTEST_SKIP() << "no AVX2 on this CPU";
  const Case c = make_case(random_tree(200, 21), 50, kGqa, 17);
  ASSERT_TRUE(matmul_set_isa("scalar"));
  const auto scalar = run_tiled(c, nullptr);
  ASSERT_TRUE(matmul_set_isa("avx2"));
  expect_near(run_tiled(c, nullptr), scalar, 2e-6f, "avx2 vs scalar");
}

// The paper's entry/exit counter (+1 on entering and on leaving a node) gives the same result.
TEST_F(TreeAttention, EntryExitCounterConvention) {
  Case c = make_case(random_tree(100, 4), 20, kGqa, 8);
  const auto want = run_tiled(c, nullptr);
  const size_t n = c.tree.spans.size();
  // (time, tie order, node): exits sharing a time leave the deepest (latest) node first.
  std::vector<std::tuple<int, int, int>> events;
  for (int i = 0; i < int(n); ++i) {
    events.push_back({c.tree.spans[i].start * 2, i, i});
    events.push_back({c.tree.spans[i].end * 2 - 1, -i, i});
  }
  std::sort(events.begin(), events.end());
  for (size_t t = 0; t < events.size(); ++t) {
    const auto [time, order, node] = events[t];
    TreeSpan& s = c.tree.spans[node];
    (time % 2 == 0 ? s.start : s.end) = int32_t(t);
  }
  expect_near(run_tiled(c, nullptr), want, 0.0f, "entry/exit counter");
}

}  // namespace
}  // namespace specmesh

#include "specmesh/kernels/tree_attention.hpp"

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "specmesh/kernels/matmul.hpp"
#include "specmesh/kernels/thread_pool.hpp"

#if defined(__x86_64__) || defined(__i386__)
#define SPECMESH_HAVE_AVX2_TU 1
#endif

namespace specmesh {

namespace tree_attn_detail {
namespace {

constexpr size_t kB = kTreeKeyTile;

void scores_portable(const float* q, size_t rows, int head_dim, const float* kt, float* s) {
  for (size_t r = 0; r < rows; ++r) {
    float acc[kB] = {};
    for (int x = 0; x < head_dim; ++x) {
      const float qx = q[r * head_dim + x];
      for (size_t c = 0; c < kB; ++c) acc[c] += qx * kt[x * kB + c];
    }
    std::memcpy(s + r * kB, acc, sizeof(acc));
  }
}

void softmax_portable(float* s, size_t rows, size_t group, const uint32_t* vis, float* m, float* l,
                      float* alpha) {
  for (size_t r = 0; r < rows; ++r) {
    float* row = s + r * kB;
    const uint32_t bits = vis[r / group];
    float mx = -INFINITY;
    for (size_t c = 0; c < kB; ++c)
      if ((bits >> c) & 1u) mx = std::max(mx, row[c]);
    const float m_new = std::max(m[r], mx);
    if (m_new == -INFINITY) {  // nothing visible yet: keep the empty partial
      alpha[r] = 1.0f;
      std::fill(row, row + kB, 0.0f);
      continue;
    }
    alpha[r] = std::exp2(m[r] - m_new);
    float sum = 0;
    for (size_t c = 0; c < kB; ++c) {
      row[c] = ((bits >> c) & 1u) ? std::exp2(row[c] - m_new) : 0.0f;
      sum += row[c];
    }
    l[r] = l[r] * alpha[r] + sum;
    m[r] = m_new;
  }
}

void accumulate_portable(const float* p, size_t rows, const float* v, int head_dim,
                         const float* alpha, float* o) {
  for (size_t r = 0; r < rows; ++r) {
    float* orow = o + r * head_dim;
    for (int x = 0; x < head_dim; ++x) orow[x] *= alpha[r];
    for (size_t c = 0; c < kB; ++c) {
      const float w = p[r * kB + c];
      for (int x = 0; x < head_dim; ++x) orow[x] += w * v[c * head_dim + x];
    }
  }
}

}  // namespace
}  // namespace tree_attn_detail

namespace {

using tree_attn_detail::TileSteps;

constexpr size_t kQ = kTreeQueryTile;
constexpr size_t kB = kTreeKeyTile;
static_assert(kB == 32, "visibility is one 32-bit word per query and key tile");
constexpr float kLog2e = 1.4426950408889634f;
// Below this many multiply-adds (counting every tree key) a call takes tens of microseconds,
// about what waking the pool costs.
constexpr size_t kSmallWork = size_t(1) << 20;

const TileSteps& steps(int head_dim) {
  static const TileSteps portable{tree_attn_detail::scores_portable, tree_attn_detail::softmax_portable,
                                  tree_attn_detail::accumulate_portable};
#ifdef SPECMESH_HAVE_AVX2_TU
  // The project's one SIMD switch (CPU check, SPECMESH_ISA, tests) lives with matmul.
  if (head_dim % 8 == 0 && matmul_isa_has_avx2()) return tree_attn_detail::tile_steps_avx2();
#endif
  return portable;
}

uint32_t low_bits(size_t n) { return n >= 32 ? ~0u : (1u << n) - 1u; }

enum class TileKind { Skip, Whole, Test };

// The interval range of a run of consecutive tree nodes.
struct Bounds {
  int32_t min_start, max_start, min_end, max_end;
};

std::vector<Bounds> tile_bounds(const TreeSpan* spans, size_t n, size_t tile) {
  std::vector<Bounds> out;
  out.reserve((n + tile - 1) / tile);
  for (size_t i0 = 0; i0 < n; i0 += tile) {
    Bounds b{spans[i0].start, spans[i0].start, spans[i0].end, spans[i0].end};
    for (size_t i = i0 + 1; i < std::min(n, i0 + tile); ++i) {
      b.min_start = std::min(b.min_start, spans[i].start);
      b.max_start = std::max(b.max_start, spans[i].start);
      b.min_end = std::min(b.min_end, spans[i].end);
      b.max_end = std::max(b.max_end, spans[i].end);
    }
    out.push_back(b);
  }
  return out;
}

class IntervalMask {
 public:
  IntervalMask(const TreeSpan* spans, size_t n)
      : spans_(spans), queries_(tile_bounds(spans, n, kQ)), keys_(tile_bounds(spans, n, kB)) {}

  TileKind kind(size_t qt, size_t kt) const {
    const Bounds& q = queries_[qt];
    const Bounds& k = keys_[kt];
    // No key starts early enough, ends late enough, or is still open when the queries start.
    if (k.min_start > q.max_start || k.max_end < q.min_end || k.max_end <= q.min_start) return TileKind::Skip;
    if (k.max_start <= q.min_start && k.min_end >= q.max_end) return TileKind::Whole;
    return TileKind::Test;
  }

  uint32_t bits(size_t i, size_t j0, size_t n_keys) const {
    const TreeSpan qi = spans_[i];
    uint32_t b = 0;
    for (size_t c = 0; c < n_keys; ++c) {
      const TreeSpan kj = spans_[j0 + c];
      b |= uint32_t(tree_sees(qi, kj)) << c;
    }
    return b;
  }

 private:
  const TreeSpan* spans_;
  std::vector<Bounds> queries_;
  std::vector<Bounds> keys_;
};

class DenseMask {
 public:
  DenseMask(const uint8_t* mask, size_t n) : mask_(mask), n_(n) {}

  TileKind kind(size_t, size_t) const { return TileKind::Test; }

  uint32_t bits(size_t i, size_t j0, size_t n_keys) const {
    const uint8_t* row = mask_ + i * n_ + j0;
    uint32_t b = 0;
    for (size_t c = 0; c < n_keys; ++c) b |= uint32_t(row[c] != 0) << c;
    return b;
  }

 private:
  const uint8_t* mask_;
  size_t n_;
};

// Per-thread buffers of one work unit.
struct Scratch {
  std::vector<float> q, o, s, kt, vt, m, l, alpha, krow;
  uint32_t vis[kQ];
};

Scratch& scratch() {
  thread_local Scratch sc;
  return sc;
}

// One query tile against one KV head: rows are (tree node, query head of the group), node-major.
template <class Mask>
void run_unit(const TreeAttnProblem& p, const Mask& mask, const TileSteps& st, size_t qt, int kvh, Scratch& sc) {
  const size_t group = size_t(p.n_head / p.n_head_kv);
  const size_t d = size_t(p.head_dim);
  const size_t i0 = qt * kQ;
  const size_t nq = std::min(kQ, p.n_tree - i0);
  const size_t rows = nq * group;
  const size_t kv_off = p.kv.offset + size_t(kvh) * d;

  sc.q.resize(rows * d);
  sc.o.assign(rows * d, 0.0f);
  sc.s.resize(rows * kB);
  sc.kt.resize(d * kB);
  sc.m.assign(rows, -INFINITY);
  sc.l.assign(rows, 0.0f);
  sc.alpha.resize(rows);
  sc.vt.resize(kB * d);
  sc.krow.resize(d);

  const float qscale = p.scale * kLog2e;
  for (size_t t = 0; t < nq; ++t) {
    const float* src = p.q + (i0 + t) * p.q_stride + size_t(kvh) * group * d;
    float* dst = sc.q.data() + t * group * d;
    for (size_t x = 0; x < group * d; ++x) dst[x] = src[x] * qscale;
  }

  // The tile's keys transposed and its values packed, so the tile steps stream them.
  auto tile = [&](size_t c0, size_t n_keys) {
    for (size_t c = 0; c < n_keys; ++c) {
      const int32_t cell = p.cells[c0 + c];
      kv_load(p.kv.type, p.kv.k_row(cell), kv_off, d, sc.krow.data());
      for (size_t x = 0; x < d; ++x) sc.kt[x * kB + c] = sc.krow[x];
      kv_load(p.kv.type, p.kv.v_row(cell), kv_off, d, sc.vt.data() + c * d);
    }
    for (size_t x = 0; x < d; ++x) std::fill(sc.kt.begin() + x * kB + n_keys, sc.kt.begin() + (x + 1) * kB, 0.0f);
    std::fill(sc.vt.begin() + n_keys * d, sc.vt.end(), 0.0f);
    st.scores(sc.q.data(), rows, p.head_dim, sc.kt.data(), sc.s.data());
    st.softmax(sc.s.data(), rows, group, sc.vis, sc.m.data(), sc.l.data(), sc.alpha.data());
    st.accumulate(sc.s.data(), rows, sc.vt.data(), p.head_dim, sc.alpha.data(), sc.o.data());
  };

  // The prefix is visible to every query: whole tiles.
  for (size_t c0 = 0; c0 < p.n_prefix; c0 += kB) {
    const size_t n_keys = std::min(kB, p.n_prefix - c0);
    std::fill(sc.vis, sc.vis + nq, low_bits(n_keys));
    tile(c0, n_keys);
  }
  for (size_t kt = 0, j0 = 0; j0 < p.n_tree; ++kt, j0 += kB) {
    const TileKind kind = mask.kind(qt, kt);
    if (kind == TileKind::Skip) continue;
    const size_t n_keys = std::min(kB, p.n_tree - j0);
    if (kind == TileKind::Whole) {
      std::fill(sc.vis, sc.vis + nq, low_bits(n_keys));
    } else {
      for (size_t t = 0; t < nq; ++t) sc.vis[t] = mask.bits(i0 + t, j0, n_keys);
    }
    tile(p.n_prefix + j0, n_keys);
  }

  for (size_t t = 0; t < nq; ++t) {
    float* dst = p.out + (i0 + t) * p.out_stride + size_t(kvh) * group * d;
    for (size_t g = 0; g < group; ++g) {
      const size_t r = t * group + g;
      const float inv = sc.l[r] > 0 ? 1.0f / sc.l[r] : 0.0f;
      for (size_t x = 0; x < d; ++x) dst[g * d + x] = sc.o[r * d + x] * inv;
    }
  }
}

void check(const TreeAttnProblem& p) {
  if (p.n_head <= 0 || p.n_head_kv <= 0 || p.n_head % p.n_head_kv != 0)
    throw std::invalid_argument("tree_attention: n_head must be a positive multiple of n_head_kv");
  if (p.head_dim <= 0) throw std::invalid_argument("tree_attention: head_dim must be positive");
}

template <class Mask>
void run(const TreeAttnProblem& p, const Mask& mask, ThreadPool* pool) {
  check(p);
  if (p.n_tree == 0) return;
  const TileSteps& st = steps(p.head_dim);
  const size_t n_qt = (p.n_tree + kQ - 1) / kQ;
  const size_t n_units = n_qt * size_t(p.n_head_kv);
  // Later query tiles see more keys: hand them out first so the last units are short ones.
  auto unit = [&](size_t u) {
    run_unit(p, mask, st, n_qt - 1 - u / size_t(p.n_head_kv), int(u % size_t(p.n_head_kv)), scratch());
  };
  const size_t work = p.n_tree * size_t(p.n_head) * (p.n_prefix + p.n_tree) * size_t(p.head_dim);
  if (pool == nullptr || pool->size() <= 1 || n_units == 1 || work < kSmallWork) {
    for (size_t u = 0; u < n_units; ++u) unit(u);
    return;
  }
  std::atomic<size_t> next{0};
  pool->run([&](int, int) {
    for (size_t u = next.fetch_add(1, std::memory_order_relaxed); u < n_units;
         u = next.fetch_add(1, std::memory_order_relaxed))
      unit(u);
  });
}

}  // namespace

void tree_attention(const TreeAttnProblem& p, const TreeSpan* spans, ThreadPool* pool) {
  run(p, IntervalMask(spans, p.n_tree), pool);
}

void tree_attention_dense(const TreeAttnProblem& p, const uint8_t* mask, ThreadPool* pool) {
  run(p, DenseMask(mask, p.n_tree), pool);
}

std::vector<uint8_t> dense_tree_mask(const TreeSpan* spans, size_t n) {
  std::vector<uint8_t> mask(n * n);
  for (size_t i = 0; i < n; ++i)
    for (size_t j = 0; j < n; ++j)
      mask[i * n + j] = tree_sees(spans[i], spans[j]);
  return mask;
}

}  // namespace specmesh

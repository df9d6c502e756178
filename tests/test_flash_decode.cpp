// Flash decode and speculative flash decode (ALSpec): the key layout, accuracy of the full and
// speculative outputs against a double-precision softmax reference, the fused lambda check
// against an independently computed decision, and bit-exact agreement across thread counts
// and with plain per-head attention, on both SIMD paths.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

#include "specmesh/kernels/flash_decode.hpp"
#include "specmesh/kernels/matmul.hpp"
#include "specmesh/kernels/thread_pool.hpp"

#include "isa.hpp"

namespace specmesh {
namespace {

using test::isas;

class FlashDecodeTest : public test::IsaTest {};

size_t round_up(size_t x, size_t m) { return (x + m - 1) / m * m; }

// One layer's cache and one decode token. Keys are stored in shuffled cells of a larger cache,
// so the cell list is a real gather. `focus` pulls the speculative region's keys towards each
// group's mean query, which raises its attention mass (and lowers the speculation error).
struct Problem {
  HeadShape hs;
  size_t n;
  float scale;
  size_t stride;
  std::vector<float> q, k, v;
  std::vector<int32_t> cells;
  KvRows kv() const { return KvRows{k.data(), v.data(), stride}; }
};

// Reference membership of the speculative region, written from the definition, not the plan.
bool in_spec_region(size_t j, size_t n, size_t S, size_t tile) {
  if (n < 2 * S) return true;
  return j < S || j >= round_up(n, tile) - S;
}

Problem make_problem(HeadShape hs, size_t n, uint32_t seed, size_t S = 128, size_t tile = 32, float focus = 0) {
  Problem p{hs, n, 1.0f / std::sqrt(float(hs.head_dim)), size_t(hs.n_head_kv) * hs.head_dim, {}, {}, {}, {}};
  const size_t D = hs.head_dim, cap = n + 17;
  std::mt19937 rng(seed);
  std::normal_distribution<float> g(0.0f, 1.0f);
  p.q.resize(hs.n_head * D);
  for (auto& x : p.q) x = g(rng);
  p.k.resize(cap * p.stride);
  p.v.resize(cap * p.stride);
  for (auto& x : p.k) x = g(rng);
  for (auto& x : p.v) x = g(rng);
  std::vector<int32_t> perm(cap);
  std::iota(perm.begin(), perm.end(), 0);
  std::shuffle(perm.begin(), perm.end(), rng);
  p.cells.assign(perm.begin(), perm.begin() + n);
  if (focus != 0) {
    const int group = hs.n_head / hs.n_head_kv;
    for (int kh = 0; kh < hs.n_head_kv; ++kh) {
      std::vector<float> dir(D, 0.0f);
      for (int h = kh * group; h < (kh + 1) * group; ++h)
        for (size_t d = 0; d < D; ++d) dir[d] += p.q[h * D + d];
      double norm = 0;
      for (float x : dir) norm += double(x) * x;
      for (size_t j = 0; j < n; ++j) {
        if (!in_spec_region(j, n, S, tile)) continue;
        float* kr = p.k.data() + size_t(p.cells[j]) * p.stride + kh * D;
        for (size_t d = 0; d < D; ++d) kr[d] += focus * float(dir[d] / std::sqrt(norm));
      }
    }
  }
  return p;
}

// Softmax attention of every head over the keys j < n with keep(j), in double.
template <class Keep>
std::vector<double> reference(const Problem& p, Keep keep) {
  const size_t D = p.hs.head_dim;
  const int group = p.hs.n_head / p.hs.n_head_kv;
  std::vector<double> out(p.hs.n_head * D, 0.0);
  for (int h = 0; h < p.hs.n_head; ++h) {
    const size_t off = size_t(h / group) * D;
    std::vector<double> s(p.n, -INFINITY);
    double m = -INFINITY;
    for (size_t j = 0; j < p.n; ++j) {
      if (!keep(j)) continue;
      const float* kr = p.k.data() + size_t(p.cells[j]) * p.stride + off;
      double dot = 0;
      for (size_t d = 0; d < D; ++d) dot += double(p.q[h * D + d]) * kr[d];
      s[j] = dot * p.scale;
      m = std::max(m, s[j]);
    }
    double l = 0;
    for (size_t j = 0; j < p.n; ++j) {
      if (!keep(j)) continue;
      const double w = std::exp(s[j] - m);
      l += w;
      const float* vr = p.v.data() + size_t(p.cells[j]) * p.stride + off;
      for (size_t d = 0; d < D; ++d) out[h * D + d] += w * vr[d];
    }
    for (size_t d = 0; d < D; ++d) out[h * D + d] /= l;
  }
  return out;
}

struct Ref {
  std::vector<double> full, spec;
  double d2 = 0, n2 = 0;
  double ratio() const { return std::sqrt(d2 / n2); }
};

Ref reference_spec(const Problem& p, size_t S, size_t tile) {
  Ref r;
  r.full = reference(p, [](size_t) { return true; });
  r.spec = reference(p, [&](size_t j) { return in_spec_region(j, p.n, S, tile); });
  for (size_t i = 0; i < r.full.size(); ++i) {
    r.d2 += (r.spec[i] - r.full[i]) * (r.spec[i] - r.full[i]);
    r.n2 += r.full[i] * r.full[i];
  }
  return r;
}

void expect_near(const std::vector<float>& got, const std::vector<double>& want, const std::string& what) {
  ASSERT_EQ(got.size(), want.size());
  double worst = 0;
  for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - want[i]));
  EXPECT_LT(worst, 2e-5) << what;
}

bool same_bits(const std::vector<float>& a, const std::vector<float>& b) {
  return a.size() == b.size() && std::memcmp(a.data(), b.data(), a.size() * sizeof(float)) == 0;
}

struct SpecRun {
  std::vector<float> full, spec;
  SpecCheck check;
};

SpecRun run_spec(const Problem& p, const SpecConfig& cfg, ThreadPool* pool = nullptr) {
  SpecRun r;
  r.full.resize(p.hs.n_head * p.hs.head_dim);
  r.spec.resize(r.full.size());
  r.check = speculative_flash_decode(p.q.data(), p.hs, p.scale, p.kv(), p.cells.data(), p.n, r.full.data(),
                                     r.spec.data(), cfg, pool);
  return r;
}

SpecConfig config(size_t S, size_t chunk, float lambda = 0.1f, size_t tile = 32) {
  SpecConfig c;
  c.layout.spec_len = S;
  c.layout.chunk = chunk;
  c.layout.tile = tile;
  c.lambda = lambda;
  return c;
}

TEST(FlashPlan, RegionsFollowTheTileAlignedWindow) {
  const FlashLayout def;
  EXPECT_EQ(def.spec_len, 128u);
  EXPECT_EQ(def.chunk, 256u);
  EXPECT_EQ(def.tile, 32u);
  EXPECT_FLOAT_EQ(SpecConfig{}.lambda, 0.1f);

  FlashPlan p = flash_plan(256, def);  // n = 2S, P = 256: window [128, 256), no middle
  EXPECT_FALSE(p.exact);
  EXPECT_EQ(p.sink_end, 128u);
  EXPECT_EQ(p.window_begin, 128u);
  EXPECT_EQ(p.n_middle(), 0u);

  p = flash_plan(257, def);  // P = 288: window [160, 288) holds 97 real keys
  EXPECT_EQ(p.window_begin, 160u);
  EXPECT_EQ(p.n_middle(), 1u);
  size_t b, e;
  p.slot_keys(3, b, e);
  EXPECT_EQ(b, 128u);
  EXPECT_EQ(e, 160u);

  p = flash_plan(1000, def);  // P = 1024: window [896, 1000), middle [128, 896) in 3 chunks
  EXPECT_EQ(p.window_begin, 896u);
  EXPECT_EQ(p.n_middle(), 3u);
  p.slot_keys(1, b, e);
  EXPECT_EQ(b, 896u);
  EXPECT_EQ(e, 1000u);

  p = flash_plan(255, def);  // below 2S: exact
  EXPECT_TRUE(p.exact);
  EXPECT_EQ(p.sink_end, 128u);
  EXPECT_EQ(p.window_begin, 128u);
  EXPECT_EQ(p.n_middle(), 0u);

  FlashLayout small;
  small.spec_len = 16;  // shorter than a tile: the window can hold no real key
  p = flash_plan(33, small);
  EXPECT_FALSE(p.exact);
  EXPECT_EQ(p.window_begin, 33u);
  p.slot_keys(1, b, e);
  EXPECT_EQ(b, e);

  FlashLayout bad;
  bad.chunk = 0;
  EXPECT_THROW(flash_plan(10, bad), std::invalid_argument);
}

struct Case {
  HeadShape hs;
  size_t S, chunk, n;
};

std::vector<Case> cases() {
  std::vector<Case> v;
  const HeadShape gqa{8, 2, 64}, mha{4, 4, 32}, odd{6, 3, 20};
  // Default S = 128: from 2S upward, across window tiles (P boundaries +-1).
  for (size_t n : {256, 257, 287, 288, 289, 319, 320, 321, 383, 384, 385, 1000, 2049})
    for (const HeadShape& hs : {gqa, mha}) v.push_back({hs, 128, 128, n});
  // S not a multiple of the tile, chunk different from S, head_dim not a multiple of 8.
  for (size_t n : {96, 97, 127, 128, 129, 159, 160, 161, 700}) {
    v.push_back({gqa, 48, 48, n});
    v.push_back({odd, 48, 100, n});
  }
  // Head sizes that are multiples of 64 take the AVX-512 kernel's routes: scores of four heads
  // that share a KV head (groups of 4 and 8, head_dim 64, 128 and 192) or not (groups of 1 and
  // 2), values of eight, four, two or one heads of a KV head at a time.
  for (size_t n : {257, 1000})
    for (const HeadShape& hs : {HeadShape{8, 8, 64}, HeadShape{8, 4, 128}, HeadShape{16, 2, 128}, HeadShape{8, 2, 192}})
      v.push_back({hs, 128, 128, n});
  // S shorter than a tile: the window may be empty.
  for (size_t n : {32, 33, 40, 63, 64, 65, 200}) v.push_back({mha, 16, 16, n});
  return v;
}

TEST_F(FlashDecodeTest, MatchesReferenceAndDecidesLikeIt) {
  for (const std::string& isa : isas()) {
    use(isa);
    uint32_t seed = 1;
    for (const Case& c : cases()) {
      const std::string what = isa + " n=" + std::to_string(c.n) + " S=" + std::to_string(c.S) +
                               " heads=" + std::to_string(c.hs.n_head) + "/" + std::to_string(c.hs.n_head_kv);
      const Problem p = make_problem(c.hs, c.n, seed++, c.S);
      const Ref ref = reference_spec(p, c.S, 32);
      const SpecRun r = run_spec(p, config(c.S, c.chunk));
      expect_near(r.full, ref.full, what + " full");
      expect_near(r.spec, ref.spec, what + " spec");
      EXPECT_FALSE(r.check.exact) << what;
      EXPECT_NEAR(r.check.d2, ref.d2, 1e-4 * ref.d2 + 1e-9) << what;
      EXPECT_NEAR(r.check.n2, ref.n2, 1e-5 * ref.n2) << what;
      EXPECT_FALSE(run_spec(p, config(c.S, c.chunk, 0.0f)).check.accept) << what;
      // At n = 2S with n on a tile boundary the two regions cover every key.
      if (ref.d2 == 0) {
        EXPECT_TRUE(same_bits(r.spec, r.full)) << what;
        EXPECT_TRUE(r.check.accept) << what;
        continue;
      }
      // Decisions at lambda 5% either side of the true ratio.
      const double ratio = ref.ratio();
      ASSERT_GT(ratio, 1e-3) << what;
      for (double f : {0.95, 1.05}) {
        const float lambda = float(ratio * f);
        const SpecRun d = run_spec(p, config(c.S, c.chunk, lambda));
        EXPECT_EQ(d.check.accept, f > 1) << what << " lambda=" << lambda;
        EXPECT_EQ(d.check.accept, spec_accept(d.check.d2, d.check.n2, lambda)) << what;
      }
    }
  }
}

TEST_F(FlashDecodeTest, DefaultLambdaAcceptsOnlyCloseSpeculations) {
  const HeadShape hs{8, 2, 64};
  for (const std::string& isa : isas()) {
    use(isa);
    // Focused keys put most attention mass in the speculative region; random keys do not.
    const Problem close = make_problem(hs, 3000, 7, 128, 32, 20.0f);
    const Problem far = make_problem(hs, 3000, 7);
    const Ref rc = reference_spec(close, 128, 32), rf = reference_spec(far, 128, 32);
    ASSERT_LT(rc.ratio(), 0.05);
    ASSERT_GT(rf.ratio(), 0.2);
    const SpecRun c = run_spec(close, SpecConfig{});
    const SpecRun f = run_spec(far, SpecConfig{});
    EXPECT_TRUE(c.check.accept) << isa;
    EXPECT_FALSE(f.check.accept) << isa;
    expect_near(c.spec, rc.spec, isa + " focused spec");
    EXPECT_FALSE(run_spec(close, config(128, 128, 0.0f)).check.accept) << isa;
  }
}

TEST_F(FlashDecodeTest, BelowTwoSIsExactAndAccepted) {
  for (const std::string& isa : isas()) {
    use(isa);
    for (size_t n : {1, 2, 31, 100, 128, 129, 200, 255}) {
      const Problem p = make_problem({8, 2, 64}, n, 100 + uint32_t(n));
      const SpecRun r = run_spec(p, config(128, 128, 0.0f));
      EXPECT_TRUE(r.check.exact) << n;
      EXPECT_TRUE(r.check.accept) << n;  // lambda = 0 too: taking spec changes nothing
      EXPECT_TRUE(same_bits(r.full, r.spec)) << n;
      EXPECT_EQ(r.check.d2, 0.0f);
      expect_near(r.full, reference(p, [](size_t) { return true; }), isa + " exact n=" + std::to_string(n));
    }
  }
}

TEST_F(FlashDecodeTest, ThreadCountDoesNotChangeABit) {
  ThreadPool two(2), three(3);
  for (const std::string& isa : isas()) {
    use(isa);
    for (const Case& c : {Case{{8, 2, 64}, 128, 128, 4097}, Case{{6, 3, 20}, 48, 100, 3001},
                          Case{{32, 8, 128}, 128, 128, 1500}, Case{{8, 2, 64}, 128, 128, 200}}) {
      const Problem p = make_problem(c.hs, c.n, 42);
      const SpecConfig cfg = config(c.S, c.chunk);
      const SpecRun one = run_spec(p, cfg);
      for (ThreadPool* pool : {&two, &three}) {
        const SpecRun r = run_spec(p, cfg, pool);
        EXPECT_TRUE(same_bits(r.full, one.full)) << isa << " n=" << c.n << " threads=" << pool->size();
        EXPECT_TRUE(same_bits(r.spec, one.spec)) << isa << " n=" << c.n << " threads=" << pool->size();
        EXPECT_EQ(std::memcmp(&r.check.d2, &one.check.d2, sizeof(float)), 0);
        EXPECT_EQ(std::memcmp(&r.check.n2, &one.check.n2, sizeof(float)), 0);
      }
    }
  }
}

// flash_decode's merge is flash_combine's, bit for bit: the partials of the plan's slots
// computed one by one, the sink and the window combined into slot 2, slot 2 and the middle
// combined and divided by l give its output, on every path, alone or on two threads (the merge
// reads the slots in another order than flash_combine and is split by heads over the pool).
TEST_F(FlashDecodeTest, MergeIsFlashCombineOverThePlansSlots) {
  ThreadPool two(2);
  for (const std::string& isa : isas()) {
    use(isa);
    for (const Case& c : {Case{{32, 4, 64}, 128, 128, 9000}, Case{{6, 3, 20}, 48, 100, 3001}}) {
      const Problem p = make_problem(c.hs, c.n, 11);
      FlashLayout layout;
      layout.spec_len = c.S;
      layout.chunk = c.chunk;
      const FlashPlan plan = flash_plan(c.n, layout);
      const int H = c.hs.n_head, D = c.hs.head_dim, group = H / c.hs.n_head_kv;
      FlashPartials parts;
      parts.reset(plan.n_slots(), H, D);
      for (size_t s = 0; s < plan.n_slots(); ++s) {
        if (s == 2) continue;
        size_t b, e;
        plan.slot_keys(s, b, e);
        flash_partial(p.q.data(), H, group, p.kv(), 0, p.scale, p.cells.data() + b, e - b, parts, s);
      }
      std::vector<float> want(p.q.size());
      for (int h = 0; h < H; ++h) {
        const size_t a = parts.at(2, h);
        flash_combine(parts, 0, 2, h, parts.o_at(2, h), parts.m[a], parts.l[a]);
      }
      for (int h = 0; h < H; ++h) {
        float m, l;
        float* o = want.data() + size_t(h) * D;
        flash_combine(parts, 2, plan.n_slots(), h, o, m, l);
        for (int d = 0; d < D; ++d) o[d] = l > 0 ? o[d] / l : 0.0f;
      }
      for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &two}) {
        std::vector<float> got(p.q.size());
        flash_decode(p.q.data(), c.hs, p.scale, p.kv(), p.cells.data(), c.n, got.data(), layout, pool);
        EXPECT_TRUE(same_bits(got, want)) << isa << " n=" << c.n << (pool ? " two threads" : " one thread");
      }
    }
  }
}

// Several tokens at once give each token the bits flash_decode gives it alone: a causal run
// (token i sees the cells of tokens 0..i, across a window tile boundary so that the run
// splits), tokens below 2S, and a token whose cells are another order of the same keys (it
// shares nothing), on every path and thread count, for GQA, MHA and an odd head size.
TEST_F(FlashDecodeTest, RowsMatchSingleTokensBitForBit) {
  ThreadPool two(2);
  for (const std::string& isa : isas()) {
    use(isa);
    for (const HeadShape& hs : {HeadShape{8, 2, 64}, HeadShape{4, 4, 32}, HeadShape{6, 3, 20}}) {
      for (size_t first : {size_t(600), size_t(150)}) {
        const size_t rows = 11, D = size_t(hs.head_dim), row_values = size_t(hs.n_head) * D;
        const Problem p = make_problem(hs, first + rows, 5);
        std::vector<float> q(rows * row_values);
        std::mt19937 rng(9);
        std::normal_distribution<float> g(0.0f, 1.0f);
        for (auto& x : q) x = g(rng);
        std::vector<std::vector<int32_t>> cells(rows);
        for (size_t r = 0; r < rows; ++r) cells[r].assign(p.cells.begin(), p.cells.begin() + ptrdiff_t(first + r));
        std::reverse(cells[4].begin(), cells[4].end());  // same keys, other order: no sharing
        std::vector<const int32_t*> ptrs;
        std::vector<size_t> counts;
        for (const auto& c : cells) ptrs.push_back(c.data()), counts.push_back(c.size());
        const FlashLayout layout{128, 128, 32};
        std::vector<float> single(rows * row_values);
        for (size_t r = 0; r < rows; ++r)
          flash_decode(q.data() + r * row_values, hs, p.scale, p.kv(), ptrs[r], counts[r],
                       single.data() + r * row_values, layout);
        for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &two}) {
          std::vector<float> batched(rows * row_values, -1.0f);
          flash_decode_rows(q.data(), hs, p.scale, p.kv(), ptrs.data(), counts.data(), rows, batched.data(), layout,
                            pool);
          EXPECT_TRUE(same_bits(batched, single))
              << isa << " heads " << hs.n_head << "/" << hs.n_head_kv << " first " << first << (pool ? " pool" : "");
        }
      }
    }
  }
}

// The speculative output can leave before the middle of the full attention is computed: the
// callback sees it complete (and the full output not yet written), and the results are the
// same bits as without a callback, with and without threads.
TEST_F(FlashDecodeTest, SpeculativeOutputIsReadyBeforeTheMiddle) {
  ThreadPool two(2);
  const Problem p = make_problem({8, 2, 64}, 4097, 7);
  const SpecConfig cfg = config(128, 128);
  const SpecRun plain = run_spec(p, cfg);
  for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &two}) {
    SpecRun r;
    r.full.assign(plain.full.size(), -1.0f);
    r.spec.resize(plain.spec.size());
    int calls = 0;
    r.check = speculative_flash_decode(p.q.data(), p.hs, p.scale, p.kv(), p.cells.data(), p.n, r.full.data(),
                                       r.spec.data(), cfg, pool, [&] {
                                         ++calls;
                                         EXPECT_TRUE(same_bits(r.spec, plain.spec));
                                         EXPECT_TRUE(std::all_of(r.full.begin(), r.full.end(), [](float v) { return v == -1.0f; }));
                                       });
    EXPECT_EQ(calls, 1);
    EXPECT_TRUE(same_bits(r.full, plain.full));
    EXPECT_TRUE(same_bits(r.spec, plain.spec));
    EXPECT_EQ(r.check.accept, plain.check.accept);
  }
}

// A rejected speculation must reproduce plain decoding: each head on its own (as a batch row
// of the forward pass computes it) and the non-speculative flash_decode give the speculative
// kernel's full output bit for bit.
TEST_F(FlashDecodeTest, PlainAttentionEqualsSpeculativeFullOutput) {
  ThreadPool two(2);
  for (const std::string& isa : isas()) {
    use(isa);
    // Each head alone against the whole layer: on the AVX-512 path the layer's heads take the
    // shared routes (groups of 4, 8 and 7, the last with a block of four that spans two KV
    // heads), a lone head the others.
    for (const Case& c : {Case{{8, 2, 64}, 128, 128, 2049}, Case{{4, 4, 32}, 128, 128, 300},
                          Case{{6, 3, 20}, 48, 100, 161}, Case{{8, 2, 64}, 128, 128, 77},
                          Case{{32, 4, 64}, 128, 128, 1001}, Case{{14, 2, 64}, 128, 128, 517}}) {
      const Problem p = make_problem(c.hs, c.n, 9);
      const SpecConfig cfg = config(c.S, c.chunk);
      const SpecRun r = run_spec(p, cfg, &two);
      const size_t D = c.hs.head_dim;
      const int group = c.hs.n_head / c.hs.n_head_kv;
      std::vector<float> plain(r.full.size()), layer(r.full.size());
      for (int h = 0; h < c.hs.n_head; ++h) {
        const size_t off = size_t(h / group) * D;
        flash_decode(p.q.data() + h * D, HeadShape{1, 1, int(D)}, p.scale, p.kv().shifted(off),
                     p.cells.data(), p.n, plain.data() + h * D, cfg.layout);
      }
      flash_decode(p.q.data(), c.hs, p.scale, p.kv(), p.cells.data(), p.n, layer.data(), cfg.layout);
      EXPECT_TRUE(same_bits(plain, r.full)) << isa << " n=" << c.n;
      EXPECT_TRUE(same_bits(layer, r.full)) << isa << " n=" << c.n;
    }
  }
}

// Partials over any split of the keys, merged by flash_combine, give attention.
// p's keys and values stored as `type`, and p with them widened back to F32.
struct Stored {
  std::vector<uint8_t> k, v;
  DType type;
  size_t stride;
  KvRows rows() const { return KvRows{k.data(), v.data(), stride, type}; }
};

Stored store(Problem& p, DType type) {
  Stored st{{}, {}, type, p.stride};
  const size_t row = kv_row_bytes(type, p.stride), n_rows = p.k.size() / p.stride;
  st.k.resize(n_rows * row);
  st.v.resize(n_rows * row);
  for (size_t r = 0; r < n_rows; ++r) {
    kv_store(type, p.k.data() + r * p.stride, p.stride, st.k.data() + r * row);
    kv_store(type, p.v.data() + r * p.stride, p.stride, st.v.data() + r * row);
    kv_load(type, st.k.data() + r * row, 0, p.stride, p.k.data() + r * p.stride);
    kv_load(type, st.v.data() + r * row, 0, p.stride, p.v.data() + r * p.stride);
  }
  return st;
}

// Whether this path scores Q8_0 keys with 8-bit dot products against quantised queries: both
// SIMD kernels do, for rows they read in place (heads of whole Q8_0 blocks);
// Q8KeysScoreAgainstQuantisedQueries.
bool int8_scores(const std::string& isa, const HeadShape& hs) { return isa != "scalar" && hs.head_dim % 32 == 0; }

// The paths with 8-bit scores on this CPU.
std::vector<std::string> int8_isas() {
  std::vector<std::string> v;
  for (const std::string& isa : isas())
    if (isa != "scalar") v.push_back(isa);
  return v;
}

// The asks for the rows a thread reads next are hints: with them or without, in cells in order
// (each middle chunk's rows one range of bytes, asked for in halves) or shuffled (row by row),
// on every path and stored type, the bits are the same.
TEST_F(FlashDecodeTest, AsksForTheNextRowsChangeNoBit) {
  ThreadPool two(2);
  for (const std::string& isa : isas()) {
    use(isa);
    for (DType type : {DType::F32, DType::F16, DType::Q8_0})
      for (const bool in_order : {true, false}) {
        Problem p = make_problem(HeadShape{32, 4, 64}, 1500, 17);
        if (in_order) std::sort(p.cells.begin(), p.cells.end());
        const Stored st = store(p, type);
        FlashLayout quiet;
        quiet.ask_ahead = false;
        std::vector<float> asked(p.q.size()), not_asked(p.q.size());
        flash_decode(p.q.data(), p.hs, p.scale, st.rows(), p.cells.data(), p.n, asked.data(), FlashLayout{}, &two);
        flash_decode(p.q.data(), p.hs, p.scale, st.rows(), p.cells.data(), p.n, not_asked.data(), quiet, &two);
        EXPECT_TRUE(same_bits(asked, not_asked)) << isa << " " << kv_type_name(type) << (in_order ? " in order" : "");
      }
  }
}

// Rows stored as F16 or Q8_0 give, on every path and thread count, the bits the same kernel
// gives F32 rows holding their widened values (every path reads them in place, widening as it
// goes), and the widening is what kv_load gives. The exceptions, Q8_0 keys scored in 8 bits and
// F16 rows multiplied in bf16, have their own tests below.
TEST_F(FlashDecodeTest, StoredTypesReadAsTheirWidenedValues) {
  ThreadPool two(2);
  for (const std::string& isa : isas()) {
    use(isa);
    for (const HeadShape& hs : {HeadShape{8, 2, 64}, HeadShape{8, 8, 64}, HeadShape{16, 2, 128}, HeadShape{4, 4, 32},
                                HeadShape{6, 3, 20}}) {
      for (DType type : {DType::F16, DType::Q8_0}) {
        if (type == DType::Q8_0 && size_t(hs.n_head_kv * hs.head_dim) % 32 != 0) continue;
        if (type == DType::Q8_0 && int8_scores(isa, hs)) continue;
        if (type == DType::F16 && flash_bf16_products(type, hs.head_dim)) continue;
        for (size_t n : {size_t(100), size_t(1100)}) {
          Problem p = make_problem(hs, n, 17);
          const Problem f32 = p;
          const Stored st = store(p, type);
          for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &two}) {
            const std::string what = isa + " " + std::string(dtype_name(type)) + " D=" +
                                     std::to_string(hs.head_dim) + " n=" + std::to_string(n);
            const SpecConfig cfg = config(32, 64);
            SpecRun want = run_spec(p, cfg, pool), got;
            got.full.resize(want.full.size());
            got.spec.resize(want.full.size());
            got.check = speculative_flash_decode(p.q.data(), hs, p.scale, st.rows(), p.cells.data(), n,
                                                 got.full.data(), got.spec.data(), cfg, pool);
            EXPECT_TRUE(same_bits(got.full, want.full)) << what;
            EXPECT_TRUE(same_bits(got.spec, want.spec)) << what;
            // And the rounding is real: the widened rows differ from the F32 ones.
            EXPECT_NE(p.k, f32.k) << what;
          }
        }
      }
    }
  }
}

// The query of head h quantised as the SIMD kernels quantise it for Q8_0 keys: per block of
// 32 values, d = amax / 127 and q = x * (127 / amax) rounded to nearest even, in float.
std::vector<float> quantised_query(const std::vector<float>& q) {
  std::vector<float> out(q.size());
  for (size_t b = 0; b < q.size(); b += 32) {
    float amax = 0;
    for (size_t i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(q[i]));
    const float d = amax / 127.0f, id = amax > 0 ? 127.0f / amax : 0.0f;
    for (size_t i = b; i < b + 32; ++i) out[i] = float(double(d) * std::nearbyint(q[i] * id));
  }
  return out;
}

// Q8_0 keys on the SIMD paths: the scores are 8-bit dot products of the stored keys with the
// query quantised per 32-value block. Checked two ways, each able to fail: against attention in
// double over the same quantised query and the widened rows (the kernel's own rounding only),
// and against the dequantise-then-F32 reference, exact query, within the bound the query's
// rounding allows: a score moves by at most delta = scale * sum_b d_b/2 * sum_i |k_i| (d_b the
// query block's step), so each softmax weight by a factor within e^(+-2 delta), and an output
// by at most (e^(2 delta_max) - 1) max|v|. The bound's delta is also checked to hold.
TEST_F(FlashDecodeTest, Q8KeysScoreAgainstQuantisedQueries) {
  if (int8_isas().empty()) GTEST_SKIP() << "this CPU has no SIMD path";
  ThreadPool two(2);
  for (const std::string& isa : int8_isas())
  for (const HeadShape& hs : {HeadShape{8, 2, 64}, HeadShape{8, 8, 64}, HeadShape{16, 2, 128}, HeadShape{32, 4, 64},
                              HeadShape{12, 1, 64}, HeadShape{4, 4, 32}, HeadShape{6, 2, 96}}) {
    use(isa);
    for (size_t n : {size_t(7), size_t(100), size_t(1100)}) {
      Problem p = make_problem(hs, n, 23);
      const Stored st = store(p, DType::Q8_0);  // p now holds the widened rows
      Problem quant = p;
      quant.q = quantised_query(p.q);
      const std::vector<double> exact = reference(p, [](size_t) { return true; });
      const std::vector<double> of_quant = reference(quant, [](size_t) { return true; });
      // delta per head, from its blocks' steps and its KV head's keys.
      const size_t D = size_t(hs.head_dim);
      const int group = hs.n_head / hs.n_head_kv;
      double bound = 0, vmax = 0;
      for (float x : p.v) vmax = std::max(vmax, double(std::fabs(x)));
      for (int h = 0; h < hs.n_head; ++h) {
        double delta = 0, moved = 0;
        for (size_t j = 0; j < n; ++j) {
          const float* kr = p.k.data() + size_t(p.cells[j]) * p.stride + size_t(h / group) * D;
          double bound_j = 0, diff = 0;
          for (size_t b = 0; b < D; b += 32) {
            float amax = 0;
            for (size_t i = b; i < b + 32; ++i) amax = std::max(amax, std::fabs(p.q[h * D + i]));
            double sum_k = 0;
            for (size_t i = b; i < b + 32; ++i) sum_k += std::fabs(kr[i]);
            bound_j += double(amax) / 127.0 / 2.0 * sum_k;
          }
          for (size_t i = 0; i < D; ++i) diff += (double(quant.q[h * D + i]) - p.q[h * D + i]) * kr[i];
          delta = std::max(delta, bound_j * p.scale);
          moved = std::max(moved, std::fabs(diff) * p.scale);
        }
        EXPECT_LE(moved, delta * (1 + 1e-6)) << "the bound on a score's change";
        bound = std::max(bound, std::expm1(2 * delta) * vmax);
      }
      for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &two}) {
        const std::string what = isa + " H=" + std::to_string(hs.n_head) + "/" + std::to_string(hs.n_head_kv) + " D=" +
                                 std::to_string(hs.head_dim) + " n=" + std::to_string(n);
        std::vector<float> got(p.q.size());
        flash_decode(p.q.data(), hs, p.scale, st.rows(), p.cells.data(), n, got.data(), FlashLayout{}, pool);
        expect_near(got, of_quant, what + " against the quantised query in double");
        double worst = 0;
        for (size_t i = 0; i < got.size(); ++i) worst = std::max(worst, std::fabs(got[i] - exact[i]));
        EXPECT_LE(worst, bound + 2e-5) << what << " against the exact query";
        EXPECT_GT(worst, 1e-6) << what << ": the scores do use the quantised query";
      }
    }
  }
}

// x rounded to bf16, to nearest even, as vcvtne2ps2bf16 rounds (no NaN here).
float bf16_round(float x) {
  uint32_t u;
  std::memcpy(&u, &x, sizeof u);
  u = (u + 0x7fffu + ((u >> 16) & 1u)) & 0xffff0000u;
  std::memcpy(&x, &u, sizeof x);
  return x;
}

// F16 rows where the products are bf16 (flash_bf16_products: the AVX-512 path of a CPU with
// AVX-512 BF16). Each factor is rounded to bf16, relative error at most e = 2^-9: query and key
// values in the scores, weight and value in the outputs, the weights' sum l adding the rounded
// weights. Checked two ways, each able to fail:
// - against attention in double over the rounded query, keys and values: the outputs then
//   differ by the weights' rounding alone, each normalised weight by a factor within
//   (1 + e) / (1 - e) of its own, so by at most 2e / (1 - e) max|v| (plus f32 arithmetic);
// - against the dequantise-then-F32 reference: a score moves by at most
//   delta = scale * sum_i |q_i k_i| (2e + e^2) (checked to hold, plus the f32 sum's own error),
//   a normalised weight by a factor within (1 + e) / (1 - e) e^(2 delta), and a value by e |v|.
TEST_F(FlashDecodeTest, F16RowsMultiplyInBf16WithinTheirBound) {
  constexpr double e = 1.0 / 512;
  bool any = false;
  ThreadPool two(2);
  for (const std::string& isa : isas())
    for (const HeadShape& hs : {HeadShape{8, 2, 64}, HeadShape{8, 8, 64}, HeadShape{16, 2, 128}, HeadShape{32, 4, 64},
                                HeadShape{12, 1, 64}, HeadShape{6, 2, 192}}) {
      use(isa);
      if (!flash_bf16_products(DType::F16, hs.head_dim)) continue;
      any = true;
      for (size_t n : {size_t(7), size_t(100), size_t(1100)}) {
        Problem p = make_problem(hs, n, 29);
        const Stored st = store(p, DType::F16);  // p now holds the widened rows
        Problem rounded = p;
        for (std::vector<float>* x : {&rounded.q, &rounded.k, &rounded.v})
          for (float& y : *x) y = bf16_round(y);
        const std::vector<double> exact = reference(p, [](size_t) { return true; });
        const std::vector<double> of_rounded = reference(rounded, [](size_t) { return true; });
        const size_t D = size_t(hs.head_dim);
        const int group = hs.n_head / hs.n_head_kv;
        double vmax = 0;
        for (float x : p.v) vmax = std::max(vmax, double(std::fabs(x)));
        double delta = 0, f32 = 0;
        for (int h = 0; h < hs.n_head; ++h)
          for (size_t j = 0; j < n; ++j) {
            const size_t row = size_t(p.cells[j]) * p.stride + size_t(h / group) * D;
            double sum_abs = 0, moved = 0;
            for (size_t i = 0; i < D; ++i) {
              sum_abs += std::fabs(double(p.q[h * D + i]) * p.k[row + i]);
              moved += double(rounded.q[h * D + i]) * rounded.k[row + i] - double(p.q[h * D + i]) * p.k[row + i];
            }
            const double bound_j = p.scale * sum_abs * (2 * e + e * e);
            EXPECT_LE(std::fabs(moved) * p.scale, bound_j * (1 + 1e-9)) << "the bound on a score's change";
            // The kernel's f32 sum of D products adds at most D ulps of sum |q_i k_i|.
            const double f32_j = p.scale * sum_abs * (1 + e) * (1 + e) * double(D) * std::ldexp(1.0, -24);
            f32 = std::max(f32, f32_j);
            delta = std::max(delta, bound_j + f32_j);
          }
        const double weight = (1 + e) / (1 - e);
        const double bound_rounded = (weight * std::exp(2 * f32) - 1) * vmax * (1 + e);
        const double bound_exact = (weight * std::exp(2 * delta) - 1 + e) * vmax;
        for (ThreadPool* pool : {static_cast<ThreadPool*>(nullptr), &two}) {
          const std::string what = isa + " H=" + std::to_string(hs.n_head) + "/" + std::to_string(hs.n_head_kv) +
                                   " D=" + std::to_string(hs.head_dim) + " n=" + std::to_string(n);
          std::vector<float> got(p.q.size());
          flash_decode(p.q.data(), hs, p.scale, st.rows(), p.cells.data(), n, got.data(), FlashLayout{}, pool);
          double worst_rounded = 0, worst_exact = 0;
          for (size_t i = 0; i < got.size(); ++i) {
            worst_rounded = std::max(worst_rounded, std::fabs(got[i] - of_rounded[i]));
            worst_exact = std::max(worst_exact, std::fabs(got[i] - exact[i]));
          }
          EXPECT_LE(worst_rounded, bound_rounded + 2e-5) << what << " against the rounded factors in double";
          EXPECT_LE(worst_exact, bound_exact + 2e-5) << what << " against the exact reference";
          EXPECT_GT(worst_exact, 1e-5) << what << ": the products are bf16";
        }
      }
    }
  if (!any) GTEST_SKIP() << "no path multiplies F16 rows in bf16 on this CPU";
}

// A thread quantises the queries for a Q8_0 cache once per call and reuses them for the call's
// other partials. A query buffer refilled in place (as a model refills its q for the next
// layer) must be quantised again: its result is what a fresh buffer with those values gives,
// bit for bit, and not the old query's.
TEST_F(FlashDecodeTest, Q8QueriesRefilledInPlaceAreQuantisedAgain) {
  if (int8_isas().empty()) GTEST_SKIP() << "this CPU has no SIMD path";
  for (const std::string& isa : int8_isas()) {
  SCOPED_TRACE(isa);
  use(isa);
  const HeadShape hs{8, 2, 64};
  const size_t n = 700;
  Problem p = make_problem(hs, n, 29);
  const Stored st = store(p, DType::Q8_0);
  const Problem other = make_problem(hs, n, 31);  // only its query is used
  auto attend = [&](const std::vector<float>& q) {
    std::vector<float> out(q.size());
    flash_decode(q.data(), hs, p.scale, st.rows(), p.cells.data(), n, out.data());
    return out;
  };
  std::vector<float> q = p.q;
  const std::vector<float> first = attend(q);
  q = other.q;  // the same buffer, new values
  const std::vector<float> refilled = attend(q);
  const std::vector<float> fresh = attend(std::vector<float>(other.q));
  EXPECT_TRUE(same_bits(refilled, fresh));
  EXPECT_FALSE(same_bits(refilled, first));
  q = p.q;  // and back
  EXPECT_TRUE(same_bits(attend(q), first));
  // One value changed in the last block is enough to quantise again.
  q.back() = q.back() * 0.5f + 0.25f;
  EXPECT_TRUE(same_bits(attend(q), attend(std::vector<float>(q))));
  EXPECT_FALSE(same_bits(attend(q), first));
  }
}

TEST(KvRows, StoreAndLoadRoundAsDocumented) {
  std::mt19937 rng(3);
  std::normal_distribution<float> g(0.0f, 3.0f);
  std::vector<float> x(96), y(96);
  for (auto& v : x) v = g(rng);
  for (DType type : {DType::F32, DType::F16, DType::Q8_0}) {
    std::vector<uint8_t> row(kv_row_bytes(type, x.size()));
    kv_store(type, x.data(), x.size(), row.data());
    kv_load(type, row.data(), 0, x.size(), y.data());
    for (size_t i = 0; i < x.size(); ++i) {
      const float amax = type == DType::Q8_0 ? [&] {
        float a = 0;
        for (size_t j = i / 32 * 32; j < i / 32 * 32 + 32; ++j) a = std::max(a, std::fabs(x[j]));
        return a;
      }() : std::fabs(x[i]);
      // F16: half an ulp (subnormals: 2^-25). Q8_0: half a step d = amax / 127, plus d's own
      // F16 rounding times the quant (up to 127 * 2^-11 d).
      const float bound = type == DType::F32   ? 0
                          : type == DType::F16 ? std::max(amax * 0x1p-11f, 0x1p-25f)
                                               : amax / 127 * (0.5f + 127 * 0x1p-11f);
      EXPECT_LE(std::fabs(y[i] - x[i]), bound) << dtype_name(type) << " " << i;
    }
    // A slice reads the same values as the whole row.
    std::vector<float> part(20);
    kv_load(type, row.data(), 27, 20, part.data());
    EXPECT_TRUE(std::equal(part.begin(), part.end(), y.begin() + 27)) << dtype_name(type);
  }
  EXPECT_EQ(kv_row_bytes(DType::F16, 64), 128u);
  EXPECT_EQ(kv_row_bytes(DType::Q8_0, 64), 68u);
  EXPECT_EQ(parse_kv_type("Q8_0"), DType::Q8_0);
  EXPECT_EQ(kv_type_name(DType::F16), "f16");
  EXPECT_THROW(parse_kv_type("q4_0"), std::invalid_argument);
}

TEST_F(FlashDecodeTest, PartialsAndCombine) {
  const Problem p = make_problem({4, 2, 32}, 500, 5);
  const std::vector<double> want = reference(p, [](size_t) { return true; });
  const size_t bounds[] = {0, 0, 7, 200, 200, 333, 500};  // includes empty slots
  for (const std::string& isa : isas()) {
    use(isa);
    FlashPartials parts;
    parts.reset(6, 4, 32);
    for (size_t s = 0; s < 6; ++s)
      flash_partial(p.q.data(), 4, 2, p.kv(), 0, p.scale, p.cells.data() + bounds[s], bounds[s + 1] - bounds[s],
                    parts, s);
    std::vector<float> out(4 * 32);
    for (int h = 0; h < 4; ++h) {
      float m, l;
      flash_combine(parts, 0, 6, h, out.data() + h * 32, m, l);
      for (int d = 0; d < 32; ++d) out[h * 32 + d] /= l;
    }
    expect_near(out, want, isa + " combine");
  }
}

}  // namespace
}  // namespace specmesh

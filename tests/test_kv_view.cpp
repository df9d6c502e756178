// The model seams: the attention-mask type (DFS spans, O(N) state) and KV views (a view
// reads exactly the cells it selects, the same as a cache that holds only those cells).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "specmesh/model/attention_mask.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/kv_view.hpp"
#include "specmesh/model/retrieval_cache.hpp"
#include "refdata.hpp"

using namespace specmesh;
using specmesh::test::refdata;

namespace {

// Ancestor-or-self by walking parent links: the reference the spans must agree with.
bool is_ancestor(const std::vector<int32_t>& parent, int32_t j, int32_t i) {
  for (int32_t a = i; a >= 0; a = parent[a])
    if (a == j) return true;
  return false;
}

std::vector<int32_t> positions(const std::vector<int32_t>& parent, int32_t prefix) {
  std::vector<int32_t> pos(parent.size());
  for (size_t i = 0; i < parent.size(); ++i) pos[i] = parent[i] < 0 ? prefix : pos[parent[i]] + 1;
  return pos;
}

}  // namespace

TEST(AttentionMask, SpansAgreeWithAncestorWalksOnEveryPair) {
  // Two roots; the first has a chain and a bushy subtree, the second a single child.
  const std::vector<int32_t> parent = {-1, 0, 1, 2, 1, 4, 4, 4, 0, -1, 9};
  const auto m = AttentionMask::tree(parent, positions(parent, 17));
  ASSERT_TRUE(m.is_tree());
  EXPECT_EQ(m.prefix(), 17);
  for (size_t i = 0; i < parent.size(); ++i)
    for (size_t j = 0; j < parent.size(); ++j)
      EXPECT_EQ(m.sees(i, j), is_ancestor(parent, int32_t(j), int32_t(i))) << "query " << i << ", key " << j;
  EXPECT_EQ(m.spans()[0].end, 9);  // node 0's subtree is nodes 0..8
  EXPECT_EQ(m.spans()[4].end, 8);
  EXPECT_EQ(m.spans()[10].end, 11);
}

TEST(AttentionMask, StateGrowsLinearlyWithTheTree) {
  for (int n : {16, 256, 4096}) {
    // A root with branches of five nodes each, built on the DFS path so the order is valid.
    std::vector<int32_t> parent(n), path;
    for (int i = 0; i < n; ++i) {
      if (i % 5 == 0 && !path.empty()) path.resize(1);
      parent[i] = path.empty() ? -1 : path.back();
      path.push_back(i);
    }
    const auto m = AttentionMask::tree(parent, positions(parent, 0));
    EXPECT_EQ(m.bytes(), size_t(n) * 2 * sizeof(int32_t) + sizeof(int32_t));
  }
}

TEST(AttentionMask, RejectsNonDfsOrderAndWrongPositions) {
  auto error = [](std::vector<int32_t> parent, std::vector<int32_t> pos) -> std::string {
    try {
      AttentionMask::tree(parent, pos);
    } catch (const std::invalid_argument& e) {
      return e.what();
    }
    return "accepted";
  };
  EXPECT_NE(error({-1, 0, 0, 1}, {5, 6, 6, 7}).find("node 3 has parent 1"), std::string::npos);
  EXPECT_NE(error({-1, 2, 0}, {5, 6, 6}).find("node 1 has parent 2"), std::string::npos);
  EXPECT_NE(error({-1, 0}, {5, 7}).find("node 1 is at position 7, expected 6"), std::string::npos);
  EXPECT_NE(error({-1, -1}, {5, 6}).find("node 1 is at position 6, expected 5"), std::string::npos);
  EXPECT_NE(error({-1, 0}, {5}).find("differ in length"), std::string::npos);
  EXPECT_EQ(error({-1, 0, 1, 0, -1}, {5, 6, 7, 6, 5}), "accepted");
}

namespace {

double max_diff(const std::vector<float>& x, const std::vector<float>& y) {
  EXPECT_EQ(x.size(), y.size());
  double e = 0;
  for (size_t i = 0; i < x.size() && i < y.size(); ++i) e = std::max(e, double(std::fabs(x[i] - y[i])));
  return e;
}

// Prefills `n` tokens of a fixed text into sequence 0 and returns the logits of one more.
struct Probe {
  std::unique_ptr<Model> m = Model::load(refdata("gguf-models/stories260K.gguf"));
  std::vector<int32_t> prompt;
  Probe() {
    prompt = m->tokenizer().encode(
        "A small cat sat by the window every morning. It watched the birds, the rain and the old man next door "
        "who fed the ducks. One day the cat jumped down and followed him to the pond.",
        true);
  }
  void prefill(Context& c) const {
    Batch b;
    for (size_t i = 0; i < prompt.size(); ++i) b.add(prompt[i], int32_t(i), seq_bit(0), false);
    c.forward(b);
  }
  std::vector<float> next(Context& c) const {
    Batch b;
    b.add(prompt.back(), int32_t(prompt.size()), seq_bit(0), true);
    return c.forward(b).logits;
  }
};

}  // namespace

TEST(KvView, SinkWindowMatchesACacheHoldingOnlyThoseCells) {
  SPECMESH_REQUIRE_REFDATA();
  Probe p;
  const int32_t n = int32_t(p.prompt.size()), sink = 4, recent = 8;
  ASSERT_GT(n, sink + recent + 4);

  Context viewed(*p.m, {});
  p.prefill(viewed);
  viewed.set_view(0, std::make_shared<SinkWindowView>(sink, recent));
  const auto a = p.next(viewed);

  Context cut(*p.m, {});
  p.prefill(cut);
  cut.kv().seq_rm(0, sink, n + 1 - recent);  // the query at position n keeps [n + 1 - recent, n]
  const auto b = p.next(cut);
  // The same cells, but the cut cache places the new token in a freed cell among the sink,
  // so the kernel sums in another order: equal within float rounding.
  EXPECT_LT(max_diff(a, b), 1e-5);

  Context full(*p.m, {});
  p.prefill(full);
  EXPECT_GT(max_diff(p.next(full), a), 1e-3) << "the view changed nothing";
}

TEST(KvView, ChunkViewMatchesACacheHoldingTheChunksAndChoosesPerHead) {
  SPECMESH_REQUIRE_REFDATA();
  Probe p;
  const auto& hp = p.m->hparams();
  const int32_t n = int32_t(p.prompt.size()), chunk = 8;
  ASSERT_GT(n, 4 * chunk);
  auto view = [&](std::vector<int32_t> head0) {
    std::vector<std::vector<int32_t>> sets(size_t(hp.n_layer) * hp.n_head_kv, std::vector<int32_t>{0, 2});
    for (int l = 0; l < hp.n_layer; ++l) sets[size_t(l) * hp.n_head_kv] = head0;
    return std::make_shared<ChunkView>(chunk, 0, hp.n_head_kv, std::move(sets), n);  // position n is fresh
  };

  Context viewed(*p.m, {});
  p.prefill(viewed);
  viewed.set_view(0, view({0, 2}));
  const auto a = p.next(viewed);

  Context cut(*p.m, {});
  p.prefill(cut);
  cut.kv().seq_rm(0, chunk, 2 * chunk);
  cut.kv().seq_rm(0, 3 * chunk, n);
  EXPECT_LT(max_diff(a, p.next(cut)), 1e-5);

  // A different choice for KV head 0 alone changes the result: selection is per head.
  Context other(*p.m, {});
  p.prefill(other);
  other.set_view(0, view({0, 1}));
  EXPECT_GT(max_diff(p.next(other), a), 1e-3);
}

TEST(KvView, ViewsAreChosenBySequence) {
  SPECMESH_REQUIRE_REFDATA();
  Probe p;
  Context c(*p.m, {});
  p.prefill(c);
  c.set_view(1, std::make_shared<SinkWindowView>(2, 2));  // sequence 1 only
  const auto a = p.next(c);
  Context plain(*p.m, {});
  p.prefill(plain);
  EXPECT_EQ(p.next(plain), a) << "a view of sequence 1 changed sequence 0";
  EXPECT_THROW(c.set_view(kMaxSeqs, nullptr), std::invalid_argument);
}

TEST(KvView, RetrievalViewOverwritesTheLeastImportantEntriesAndKeepsTheSink) {
  // One layer, one KV head, a prompt of 12 positions ranked: chunk 0 (0..3), then 8..11, then 4..7.
  std::vector<int32_t> rank = {0, 1, 2, 3, 8, 9, 10, 11, 4, 5, 6, 7};
  RetrievalView v(0, 1, /*budget*/ 10, /*sink*/ 4, /*fresh_from*/ 12, {rank});
  KvCache kv(32, 0, 1, 4);
  Batch b;
  for (int32_t p = 0; p < 20; ++p) b.add(0, p, seq_bit(0), false);
  kv.place(b);
  auto read = [&](int32_t q) {
    std::vector<int32_t> cells;
    kv.visible_cells(q, seq_bit(0), cells);
    v.select(kv, 0, 0, q, cells);
    std::vector<int32_t> pos;
    for (int32_t c : cells) pos.push_back(kv.cell(c).pos);
    return pos;
  };
  // The query at 12 is the first fresh token: budget 10 = itself + the 9 best entries.
  EXPECT_EQ(read(12), (std::vector<int32_t>{0, 1, 2, 3, 4, 8, 9, 10, 11, 12}));
  EXPECT_EQ(v.entries_read(12), 9);
  // Each further token overwrites the worst entry left.
  EXPECT_EQ(read(14), (std::vector<int32_t>{0, 1, 2, 3, 8, 9, 10, 12, 13, 14}));
  EXPECT_EQ(read(17), (std::vector<int32_t>{0, 1, 2, 3, 12, 13, 14, 15, 16, 17}));
  // Past the budget the sink stays (the owner rebuilds before this happens).
  EXPECT_EQ(read(19), (std::vector<int32_t>{0, 1, 2, 3, 12, 13, 14, 15, 16, 17, 18, 19}));
  EXPECT_THROW(RetrievalView(0, 1, 10, 4, 12, {std::vector<int32_t>(5)}), std::invalid_argument);
}

TEST(KvView, RetrievalCacheRanksChunksByTheLastQueryPerKvHead) {
  SPECMESH_REQUIRE_REFDATA();
  Probe p;
  const auto& hp = p.m->hparams();
  ASSERT_EQ(hp.n_head, 2 * hp.n_head_kv);  // grouped-query attention: the group's scores add up
  const int32_t n = int32_t(p.prompt.size()), chunk = 8, D = hp.head_dim;
  ASSERT_NE(n % chunk, 0) << "the prompt should end in a partial chunk";
  Context c(*p.m, {});
  p.prefill(c);
  EXPECT_THROW(build_retrieval_view(c, n - 1, chunk, 32), std::invalid_argument);  // not the last query
  const auto view = build_retrieval_view(c, n, chunk, 32);
  ASSERT_EQ(view->fresh_from(), n);
  const int32_t n_chunks = (n + chunk - 1) / chunk;
  bool heads_differ = false;
  for (int l = 0; l < hp.n_layer; ++l) {
    const std::vector<float>& q = c.last_query(l);
    std::vector<int32_t> first_order;
    for (int h = 0; h < hp.n_head_kv; ++h) {
      // The reference: every chunk's mean key (the partial last one over what it has) against
      // the group's queries.
      std::vector<double> score(static_cast<size_t>(n_chunks));
      for (int32_t ch = 0; ch < n_chunks; ++ch) {
        const int32_t end = std::min(n, (ch + 1) * chunk);
        for (int g = 0; g < 2; ++g)
          for (int d = 0; d < D; ++d) {
            double mean = 0;
            for (int32_t pos = ch * chunk; pos < end; ++pos) {
              std::vector<float> key(size_t(hp.kv_dim()));
              c.kv().read(l, pos, key.data(), nullptr);
              mean += key[size_t(h * D + d)];
            }
            score[size_t(ch)] += double(q[size_t((2 * h + g) * D + d)]) * mean / (end - ch * chunk);
          }
      }
      const std::vector<int32_t>& rank = view->ranks(l, h);
      // Chunk 0 first, in order; then chunks in falling score, each chunk's positions together.
      for (int32_t pos = 0; pos < chunk; ++pos) EXPECT_EQ(rank[size_t(pos)], pos);
      std::vector<int32_t> order;
      for (int32_t r = chunk; r < n; ++r)
        for (int32_t pos = 0; pos < n; ++pos)
          if (rank[size_t(pos)] == r && (order.empty() || order.back() != pos / chunk)) order.push_back(pos / chunk);
      ASSERT_EQ(order.size(), size_t(n_chunks - 1));
      for (size_t i = 1; i < order.size(); ++i)
        EXPECT_GE(score[size_t(order[i - 1])], score[size_t(order[i])] - 1e-6) << "layer " << l << " head " << h;
      if (h == 0) first_order = order;
      else heads_differ |= order != first_order;
    }
  }
  EXPECT_TRUE(heads_differ) << "every KV head chose the same chunks";

  // Reading through the view changes the next token's logits (a budget of 32 of the prompt).
  Batch b;
  b.add(p.prompt.back(), n, seq_bit(0), true);
  c.set_view(0, view);
  const auto viewed = c.forward(b).logits;
  Context full(*p.m, {});
  p.prefill(full);
  EXPECT_GT(max_diff(p.next(full), viewed), 1e-4) << "a budget of 32 of " << n << " entries changed nothing";
}

// The model seams: the attention-mask type (DFS spans, O(N) state) and KV views (a view
// reads exactly the cells it selects, the same as a cache that holds only those cells).
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>

#include "specmesh/model/attention_mask.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/kv_view.hpp"
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

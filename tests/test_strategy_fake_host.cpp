// The fake host the strategy tests stand on: its cache follows KvCache's sequence semantics
// and in-order processing, so what its oracles see is what a real stage would attend to.
#include <gtest/gtest.h>

#include "fake_host.hpp"

using namespace specmesh;
using namespace specmesh::test;

namespace {

Batch tokens_at(const std::vector<int32_t>& toks, int32_t pos, int seq) {
  Batch b;
  for (size_t i = 0; i < toks.size(); ++i) b.add(toks[i], pos + int32_t(i), seq_bit(seq), i + 1 == toks.size());
  return b;
}

FakeHost host() {
  FakeHost h({}, {.vocab = 16});
  h.script("t", [](const std::vector<int32_t>&) { return std::vector<float>(16, 0.0f); });
  return h;
}

TEST(StrategyFakeHost, RowsSeeTheirSequencesCellsAfterCopyRemoveAndKeep) {
  FakeHost h = host();
  h.launch("t", tokens_at({1, 2, 3}, 0, 0), false);
  h.kv_ops("t", {{KvOpKind::copy, 0, 1, 0, 2}});  // sequence 1 borrows positions 0 and 1
  const uint64_t a = h.launch("t", tokens_at({7}, 2, 1), true);
  h.kv_ops("t", {{KvOpKind::remove, 0, -1, 2, -1}});  // sequence 0 drops position 2
  const uint64_t b = h.launch("t", tokens_at({4}, 2, 0), false);
  h.kv_ops("t", {{KvOpKind::keep, 1, -1, -1, -1}});  // only sequence 1 survives
  const uint64_t c = h.launch("t", tokens_at({9}, 3, 1), false);
  // Results arrive in any order; the stage still processed everything in order.
  h.deliver(c);
  h.deliver(a);
  h.deliver(b);
  EXPECT_EQ(h.launch_of(a).seen, (std::vector<std::vector<int32_t>>{{1, 2, 7}}));
  EXPECT_EQ(h.launch_of(b).seen, (std::vector<std::vector<int32_t>>{{1, 2, 4}}));
  EXPECT_EQ(h.launch_of(c).seen, (std::vector<std::vector<int32_t>>{{1, 2, 7, 9}}));
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategyFakeHost, ReportsARowThatSeesAPositionTwiceOrMissesOne) {
  FakeHost h = host();
  h.launch("t", tokens_at({1, 2}, 0, 0), false);
  h.deliver(h.launch("t", tokens_at({3}, 1, 0), false));  // position 1 again, never removed
  ASSERT_EQ(h.errors().size(), 1u);
  EXPECT_NE(h.errors()[0].find("sees positions 0 1 1"), std::string::npos) << h.errors()[0];
  h.deliver(h.launch("t", tokens_at({5}, 4, 0), false));  // nothing at 2 and 3
  EXPECT_EQ(h.errors().size(), 2u);
}

TEST(StrategyFakeHost, SkipsRunsCancelledBeforeTheStageReachesThem) {
  FakeHost h = host();
  h.launch("t", tokens_at({1}, 0, 0), false);
  const uint64_t spec = h.launch("t", tokens_at({2}, 1, 0), true);
  h.cancel("t", {spec});
  const uint64_t next = h.launch("t", tokens_at({3}, 1, 0), false);
  h.deliver(next);
  // The cancelled run placed no cell: position 1 is the later run's alone.
  EXPECT_TRUE(h.launch_of(spec).dropped);
  EXPECT_EQ(h.launch_of(next).seen, (std::vector<std::vector<int32_t>>{{1, 3}}));
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
  ASSERT_EQ(h.events(EventKind::cancel).size(), 1u);
  EXPECT_EQ(h.events(EventKind::cancel)[0].runs, std::vector<uint64_t>{spec});
}

TEST(StrategyFakeHost, EndsGenerationAtTheLimitAndFlagsLaterAccepts) {
  FakeHost h({1}, {.vocab = 16, .n_predict = 2, .stop_token = 9});
  EXPECT_TRUE(h.accept(4));
  EXPECT_FALSE(h.accept(5));
  EXPECT_TRUE(h.done());
  EXPECT_EQ(h.generated(), (std::vector<int32_t>{4, 5}));
  EXPECT_TRUE(h.errors().empty());
  EXPECT_FALSE(h.accept(6));
  EXPECT_EQ(h.errors().size(), 1u);
}

}  // namespace

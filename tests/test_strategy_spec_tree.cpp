// Tree speculation at the message level: one target run carries the whole tree (DFS order,
// positions prefix + depth), only the accepted path's cells survive in both caches (range
// operations, checked by the fake stage's cache on every later row), and the output is the
// target's whatever the drafts propose.
#include <gtest/gtest.h>

#include <random>

#include "fake_host.hpp"
#include "specmesh/model/attention_mask.hpp"

using namespace specmesh;
using namespace specmesh::test;
using namespace specmesh::test::scripted;

namespace {

// A draft whose best guess is wrong and whose second guess is the target's token, so the
// target's path runs through second children only.
Oracle second_best(const NextToken& target) {
  return [=](const std::vector<int32_t>& seen) {
    const int32_t right = target(seen), wrong = (right + 1) % kVocab;
    std::vector<float> l(kVocab, 0.0f);
    l[size_t(wrong)] = 5.0f;
    l[size_t(right)] = 4.0f;
    return l;
  };
}

FakeHost host(Oracle draft, int n_predict, Oracle draft2 = {}) {
  FakeHost h(kPrompt, {.vocab = kVocab, .n_predict = n_predict});
  h.script(kTargetRole, greedy_oracle(kVocab, kTarget));
  h.script("draft", std::move(draft));
  if (draft2) h.script("draft2", std::move(draft2));
  return h;
}

const LaunchRecord& next_verification(FakeHost& h) {
  const size_t before = h.launches(kTargetRole).size();
  while (h.launches(kTargetRole).size() == before) {
    bool any = false;
    for (const char* role : {"draft", "draft2"}) any |= h.settle_next(role);
    if (!any) throw std::logic_error("no draft run pending and no verification sent");
  }
  return *h.launches(kTargetRole).back();
}

}  // namespace

TEST(StrategySpecTree, OneTargetRunCarriesTheWholeTreeInDfsOrder) {
  FakeHost h = host(second_best(kTarget), 12);
  h.start("spec", {{"tree", std::vector<int>{2, 2}}, {"p_accept", 0.0}});
  // Prefill, then the tree: two roots (wrong, right), each with two children.
  const LaunchRecord& v = next_verification(h);
  const Batch& b = v.batch;
  ASSERT_TRUE(b.is_tree());
  ASSERT_EQ(b.size(), size_t(L) + 6);  // the uncached prompt leads, then 6 nodes
  // The mask accepts it: DFS pre-order, each node at prefix + depth.
  EXPECT_NO_THROW(AttentionMask::tree(b.parent, b.pos));
  for (size_t i = L; i < b.size(); ++i) EXPECT_TRUE(b.logits[i]);
  const std::vector<int32_t> depth_pos = {L, L + 1, L + 1, L, L + 1, L + 1};
  EXPECT_EQ(std::vector<int32_t>(b.pos.begin() + L, b.pos.end()), depth_pos);

  // The target's token is the second root and its second child: two accepted, then the bonus.
  const auto greedy = greedy_continuation(kPrompt, kTarget, 12);
  h.deliver(v.run);
  EXPECT_EQ(h.generated(), std::vector<int32_t>(greedy.begin(), greedy.begin() + 3));
  EXPECT_EQ(h.metrics().accepted, 2);
  EXPECT_EQ(h.metrics().drafted, 6);
  EXPECT_EQ(h.metrics().tree_size(), 6.0);
  EXPECT_EQ(h.metrics().max_accepted_depth, 2);

  // The target keeps the accepted path by range operations: sequence 0 leaves the tree, the
  // path's branch rejoins it, every branch sequence goes.
  const auto ops = h.events(EventKind::kv_ops, kTargetRole).back().ops;
  ASSERT_GE(ops.size(), 2u);
  EXPECT_EQ(ops[0], (KvOp{KvOpKind::remove, 0, -1, L, -1}));
  EXPECT_EQ(ops[1].kind, KvOpKind::copy);
  EXPECT_EQ(ops[1].dst_seq, 0);
  EXPECT_EQ(ops[1].pos_begin, L);
  EXPECT_EQ(ops[1].pos_end, L + 2);
  ASSERT_EQ(ops.size(), 3u);
  EXPECT_EQ(ops[2], (KvOp{KvOpKind::keep, 0, -1, -1, -1}));  // the four branch sequences, in one sweep

  // Later rows see exactly one cell per position (the fake stage checks), so the caches hold
  // the accepted path and nothing else.
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategySpecTree, ARightFirstGuessTakesTheFirstRootsSubtree) {
  FakeHost h = host(greedy_oracle(kVocab, kTarget), 16);
  h.start("spec", {{"tree", std::vector<int>{1, 1, 3, 1}}, {"p_accept", 0.0}});
  const LaunchRecord& v = next_verification(h);
  EXPECT_EQ(v.batch.size(), size_t(L) + 8);  // 1 + 1 + 3 + 3 nodes
  h.deliver(v.run);
  EXPECT_EQ(h.metrics().accepted, 4);  // a full path of the tree, then the bonus
  EXPECT_EQ(h.metrics().tree_size(), 8.0);
  EXPECT_EQ(h.metrics().accepted_depth(), 4.0);
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 16));
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategySpecTree, MatchesTheTargetsGreedySequenceWhateverTheDrafts) {
  std::mt19937 rng(7);
  for (int trial = 0; trial < 40; ++trial) {
    SCOPED_TRACE("trial " + std::to_string(trial));
    std::vector<int32_t> off1, off2;
    for (int k = 0; k < 12; ++k) {
      off1.push_back(L + int32_t(rng() % 40));
      off2.push_back(L + int32_t(rng() % 40));
    }
    std::vector<int> shape;
    for (int d = 0, depth = 1 + int(rng() % 4); d < depth; ++d) shape.push_back(1 + int(rng() % 3));
    const bool two = trial % 2;
    FakeHost h = host(greedy_oracle(kVocab, disagree_at(kTarget, off1, kVocab)), 30,
                      two ? second_best(disagree_at(kTarget, off2, kVocab)) : Oracle{});
    h.start("spec", {{"tree", shape}, {"p_accept", 0.0}});
    h.run_to_end(FakeHost::shuffled(uint64_t(trial)));
    EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 30));
    EXPECT_TRUE(h.errors().empty()) << h.errors().front();
  }
}

TEST(StrategySpecTree, TwoDraftsMergeIntoOneTreeWithSharedNodes) {
  // Both drafts are right first: their chains coincide and merge into one chain.
  FakeHost h = host(greedy_oracle(kVocab, kTarget), 8, greedy_oracle(kVocab, kTarget));
  h.start("spec", {{"n_draft", 3}, {"p_accept", 0.0}});
  const LaunchRecord& v = next_verification(h);
  EXPECT_EQ(v.batch.size(), size_t(L) + 3) << "the two drafts' identical chains did not merge";
  h.deliver(v.run);
  EXPECT_EQ(h.metrics().accepted, 3);
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 8));
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

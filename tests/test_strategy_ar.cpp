// Plain autoregression at the message level: one single-token target run per token, fed the
// token just accepted, and exactly the oracle's greedy continuation.
#include <gtest/gtest.h>

#include <algorithm>

#include "fake_host.hpp"

using namespace specmesh;
using namespace specmesh::test;

namespace {

constexpr int kVocab = 32;
const std::vector<int32_t> kPrompt = {3, 1, 4, 1, 5, 9, 2};

FakeHost make_host(FakeHostOptions o) {
  FakeHost h(kPrompt, o);
  h.script(kTargetRole, greedy_oracle(kVocab, history_hash(kVocab)));
  return h;
}

TEST(StrategyAr, EmitsTheOraclesGreedyContinuation) {
  FakeHost h = make_host({.vocab = kVocab, .n_predict = 20});
  h.start("ar");
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, history_hash(kVocab), 20));
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategyAr, LaunchesOneSingleTokenRunPerTokenAfterAcceptingIt) {
  const int n = 8;
  FakeHost h = make_host({.vocab = kVocab, .n_predict = n});
  h.start("ar");
  h.run_to_end(FakeHost::oldest_first(), [&] {
    int pending = 0;
    for (const LaunchRecord& r : h.launches()) pending += r.pending();
    EXPECT_LE(pending, 1) << "autoregression never has two runs in flight";
  });
  const auto expect = greedy_continuation(kPrompt, history_hash(kVocab), n);
  ASSERT_EQ(h.generated(), expect);
  // The prompt in one run, then one run per accepted token except the last.
  const auto runs = h.launches(kTargetRole);
  ASSERT_EQ(runs.size(), size_t(n));
  EXPECT_EQ(runs[0]->batch.tokens, kPrompt);
  EXPECT_EQ(std::count(runs[0]->batch.logits.begin(), runs[0]->batch.logits.end(), 1), 1);
  for (int i = 1; i < n; ++i) {
    const Batch& b = runs[i]->batch;
    ASSERT_EQ(b.size(), 1u);
    EXPECT_EQ(b.tokens[0], expect[i - 1]);
    EXPECT_EQ(b.pos[0], int32_t(kPrompt.size()) + i - 1);
    EXPECT_EQ(b.seqs[0], seq_bit(0));
    EXPECT_TRUE(b.logits[0]);
    EXPECT_FALSE(runs[i]->speculative);
  }
  // Each accept is immediately followed by the launch of the token it accepted, the last by
  // the end of generation.
  const auto& ev = h.events();
  int accepts = 0;
  for (size_t i = 0; i < ev.size(); ++i) {
    if (ev[i].kind != EventKind::accept) continue;
    ASSERT_LT(i + 1, ev.size());
    if (++accepts < n) {
      ASSERT_EQ(ev[i + 1].kind, EventKind::launch);
      EXPECT_EQ(h.launch_of(ev[i + 1].run).batch.tokens[0], ev[i].token);
    } else {
      EXPECT_EQ(ev[i + 1].kind, EventKind::finish);
    }
  }
  EXPECT_EQ(accepts, n);
  EXPECT_TRUE(h.events(EventKind::kv_ops).empty());
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategyAr, StopsAtTheStopTokenWithoutEmittingIt) {
  const auto free_run = greedy_continuation(kPrompt, history_hash(kVocab), 20);
  const int32_t stop = free_run[5];
  const auto expect = greedy_continuation(kPrompt, history_hash(kVocab), 20, stop);
  ASSERT_LT(expect.size(), 20u);
  FakeHost h = make_host({.vocab = kVocab, .n_predict = 20, .stop_token = stop});
  h.start("ar");
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), expect);
  EXPECT_FALSE(h.strategy_alive());
  // Nothing is launched once the stop token ended generation.
  const auto& ev = h.events();
  ASSERT_EQ(ev.back().kind, EventKind::finish);
  EXPECT_EQ(ev[ev.size() - 2].kind, EventKind::accept);
  EXPECT_EQ(ev[ev.size() - 2].token, stop);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategyAr, StopsAtTheLimitEvenForOneToken) {
  FakeHost h = make_host({.vocab = kVocab, .n_predict = 1});
  h.start("ar");
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, history_hash(kVocab), 1));
  EXPECT_EQ(h.launches().size(), 1u);
  EXPECT_EQ(h.events(EventKind::finish).size(), 1u);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategyAr, FeedsALongPromptInNBatchChunksWithLogitsOnlyForTheLast) {
  FakeHost h = make_host({.vocab = kVocab, .n_batch = 3, .n_predict = 6});
  h.start("ar");
  const auto prefill = h.launches(kTargetRole);
  ASSERT_EQ(prefill.size(), 3u);  // 7 prompt tokens: 3 + 3 + 1
  std::vector<int32_t> fed;
  for (const LaunchRecord* r : prefill) {
    EXPECT_LE(r->batch.size(), 3u);
    for (size_t i = 0; i < r->batch.size(); ++i) {
      EXPECT_EQ(r->batch.pos[i], int32_t(fed.size()));
      EXPECT_EQ(bool(r->batch.logits[i]), fed.size() + 1 == kPrompt.size());
      fed.push_back(r->batch.tokens[i]);
    }
  }
  EXPECT_EQ(fed, kPrompt);
  // The chunks without logits are ignored; only the last one yields a token.
  h.deliver(prefill[0]->run);
  h.deliver(prefill[1]->run);
  EXPECT_TRUE(h.generated().empty());
  EXPECT_EQ(h.launches().size(), 3u);
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, history_hash(kVocab), 6));
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

}  // namespace

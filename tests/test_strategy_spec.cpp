// Speculative decoding at the message level: what the draft is fed, what the target batch
// carries, which cache operations roll both caches back after a rejection, and that the
// output is the target's whatever the draft proposes.
#include <gtest/gtest.h>

#include <cmath>
#include <random>
#include <stdexcept>

#include "fake_host.hpp"

using namespace specmesh;
using namespace specmesh::test;
using namespace specmesh::test::scripted;

namespace {

FakeHost make_host(const NextToken& draft, int n_predict, int n_batch = 512) {
  FakeHost h(kPrompt, {.vocab = kVocab, .n_batch = n_batch, .n_predict = n_predict});
  h.script(kTargetRole, greedy_oracle(kVocab, kTarget));
  h.script(kDraft, greedy_oracle(kVocab, draft));
  return h;
}

// Settles draft runs until the strategy sends a target run; returns it.
const LaunchRecord& next_verification(FakeHost& h) {
  const size_t before = h.launches(kTargetRole).size();
  while (h.launches(kTargetRole).size() == before)
    if (!h.settle_next(kDraft)) throw std::logic_error("no draft run pending and no verification sent");
  return *h.launches(kTargetRole).back();
}

// The last rows of a batch: the tokens that carry logits.
std::vector<int32_t> logit_tokens(const Batch& b) {
  std::vector<int32_t> out;
  for (size_t i = 0; i < b.size(); ++i)
    if (b.logits[i]) out.push_back(b.tokens[i]);
  return out;
}

std::vector<KvOp> ops_of(const FakeHost& h, const std::string& role) {
  std::vector<KvOp> out;
  for (const Event& e : h.events(EventKind::kv_ops, role)) out.insert(out.end(), e.ops.begin(), e.ops.end());
  return out;
}

TEST(StrategySpec, SpecAcceptsUpToFirstMismatchAtEachPosition) {
  const int n_draft = 4;
  const auto greedy = greedy_continuation(kPrompt, kTarget, 24);
  for (int j = 0; j < n_draft; ++j) {
    SCOPED_TRACE("draft wrong at index " + std::to_string(j));
    const NextToken draft = disagree_at(kTarget, {L + j}, kVocab);
    FakeHost h = make_host(draft, 24);
    h.start("spec", {{"n_draft", n_draft}, {"p_accept", 0}});

    // The draft proposes its own chain, the wrong token and what it predicts after it.
    const LaunchRecord& v = next_verification(h);
    const auto chain = greedy_continuation(kPrompt, draft, n_draft);
    std::vector<int32_t> fed = kPrompt;
    fed.insert(fed.end(), chain.begin(), chain.end());
    EXPECT_EQ(v.batch.tokens, fed);
    std::vector<int32_t> rows = {kPrompt.back()};
    rows.insert(rows.end(), chain.begin(), chain.end());
    EXPECT_EQ(logit_tokens(v.batch), rows);

    // The first j drafts stand, then the target's correction.
    h.deliver(v.run);
    EXPECT_EQ(h.generated(), std::vector<int32_t>(greedy.begin(), greedy.begin() + j + 1));
    EXPECT_EQ(h.metrics().accepted, j);
    EXPECT_EQ(h.metrics().drafted, n_draft);

    h.run_to_end(FakeHost::oldest_first());
    EXPECT_EQ(h.generated(), greedy);
    // Both caches drop everything from the rejected token on; the draft never saw its last
    // draft, so a rejection there leaves its cache as it is.
    EXPECT_EQ(ops_of(h, kTargetRole), (std::vector<KvOp>{{KvOpKind::remove, 0, -1, L + j, -1}}));
    if (j < n_draft - 1)
      EXPECT_EQ(ops_of(h, kDraft), (std::vector<KvOp>{{KvOpKind::remove, 0, -1, L + j, -1}}));
    else
      EXPECT_TRUE(ops_of(h, kDraft).empty());
    EXPECT_TRUE(h.errors().empty()) << h.errors().front();
  }
}

TEST(StrategySpec, SpecFullAcceptanceAddsTheBonusTokenAndNeedsNoRollback) {
  const int n_draft = 4;
  const auto greedy = greedy_continuation(kPrompt, kTarget, 15);
  FakeHost h = make_host(kTarget, 15);
  h.start("spec", {{"n_draft", n_draft}});
  h.deliver(next_verification(h).run);
  EXPECT_EQ(h.generated(), std::vector<int32_t>(greedy.begin(), greedy.begin() + n_draft + 1));

  // Next round: the bonus token (not yet in the target's cache) and the four new drafts.
  const LaunchRecord& v = next_verification(h);
  std::vector<int32_t> carried = {greedy[n_draft]};
  carried.insert(carried.end(), greedy.begin() + n_draft + 1, greedy.begin() + 2 * n_draft + 1);
  EXPECT_EQ(v.batch.tokens, carried);
  for (size_t i = 0; i < v.batch.size(); ++i) {
    EXPECT_EQ(v.batch.pos[i], L + n_draft + int32_t(i));
    EXPECT_EQ(v.batch.seqs[i], seq_bit(0));
    EXPECT_TRUE(v.batch.logits[i]);
  }
  // The draft was fed its last draft and the bonus token in one run.
  const LaunchRecord& d = *h.launches(kDraft)[n_draft];
  EXPECT_EQ(d.batch.tokens, (std::vector<int32_t>{greedy[n_draft - 1], greedy[n_draft]}));

  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy);
  EXPECT_EQ(h.metrics().accepted, h.metrics().drafted);
  EXPECT_EQ(h.launches(kTargetRole).size(), 3u);  // 15 tokens: 5 + 5 + 5
  EXPECT_TRUE(h.events(EventKind::kv_ops).empty());
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategySpec, SpecStopsDraftingWhenConfidenceFallsBelowPAccept) {
  // The draft is right everywhere but unsure of the third token after the prompt.
  auto unsure_third = [](const std::vector<int32_t>& seen) {
    return peaked(kVocab, kTarget(seen), int32_t(seen.size()) == L + 2 ? 0.3f : 0.99f);
  };
  for (float p_accept : {0.5f, 0.2f}) {
    SCOPED_TRACE("p_accept " + std::to_string(p_accept));
    FakeHost h(kPrompt, {.vocab = kVocab, .n_predict = 12});
    h.script(kTargetRole, greedy_oracle(kVocab, kTarget));
    h.script(kDraft, unsure_third);
    h.start("spec", {{"n_draft", 4}, {"p_accept", p_accept}});
    const LaunchRecord& v = next_verification(h);
    const size_t drafts = p_accept > 0.3f ? 2 : 4;
    EXPECT_EQ(logit_tokens(v.batch).size(), drafts + 1);
    EXPECT_EQ(h.launches(kDraft).size(), drafts + 1 - (drafts == 4));
    h.run_to_end(FakeHost::oldest_first());
    EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 12));
    EXPECT_TRUE(h.errors().empty()) << h.errors().front();
  }
}

TEST(StrategySpec, SpecWithoutAConfidentDraftVerifiesTheLastTokenAlone) {
  FakeHost h(kPrompt, {.vocab = kVocab, .n_predict = 6});
  h.script(kTargetRole, greedy_oracle(kVocab, kTarget));
  h.script(kDraft, greedy_oracle(kVocab, kTarget, 0.1f));
  h.start("spec", {{"n_draft", 4}, {"p_accept", 0.5}});
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 6));
  for (const LaunchRecord* r : h.launches(kTargetRole)) EXPECT_EQ(logit_tokens(r->batch).size(), 1u);
  EXPECT_EQ(h.metrics().drafted, 0);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategySpec, SpecMatchesTheTargetsGreedySequenceWhateverTheDraft) {
  const auto greedy = greedy_continuation(kPrompt, kTarget, 30);
  std::mt19937 rng(7);
  for (int trial = 0; trial < 60; ++trial) {
    std::vector<int32_t> wrong;
    for (int32_t p = L; p < L + 30; ++p)
      if (rng() % 3 == 0) wrong.push_back(p);
    const NextToken draft = disagree_at(kTarget, wrong, kVocab);
    const float conf = 0.3f + 0.1f * float(rng() % 7);
    const int n_draft = 1 + int(rng() % 6), n_batch = 2 + int(rng() % 6);
    SCOPED_TRACE("trial " + std::to_string(trial) + ": n_draft " + std::to_string(n_draft) + ", n_batch " +
                 std::to_string(n_batch));
    FakeHost h(kPrompt, {.vocab = kVocab, .n_batch = n_batch, .n_predict = 30});
    h.script(kTargetRole, greedy_oracle(kVocab, kTarget));
    h.script(kDraft, greedy_oracle(kVocab, draft, conf));
    h.start("spec", {{"n_draft", n_draft}, {"p_accept", 0.5}});
    h.run_to_end(FakeHost::oldest_first());
    ASSERT_EQ(h.generated(), greedy);
    ASSERT_TRUE(h.errors().empty()) << h.errors().front();
  }
}

// Logits of a temperature-1 distribution over `support` with these weights, nothing elsewhere.
std::vector<float> weights(const std::vector<std::pair<int32_t, float>>& support) {
  std::vector<float> l(kVocab, -1e4f);
  for (auto [t, w] : support) l[size_t(t)] = std::log(w);
  return l;
}

FakeHost stochastic_host(uint64_t seed, int n_predict) {
  return FakeHost(kPrompt, {.vocab = kVocab, .n_predict = n_predict, .sampling = {.temperature = 1.0f, .seed = seed}});
}

TEST(StrategySpec, SpecStochasticAcceptsEveryDraftWhenDraftAndTargetAgree) {
  // Both models spread their mass over the same two tokens: p/q = 1, nothing is rejected.
  auto two_way = [](const std::vector<int32_t>& seen) {
    const int32_t t = kTarget(seen);
    return weights({{t, 0.6f}, {(t + 7) % kVocab, 0.4f}});
  };
  for (uint64_t seed : {1u, 2u, 3u}) {
    FakeHost h = stochastic_host(seed, 20);
    h.script(kTargetRole, two_way);
    h.script(kDraft, two_way);
    h.start("spec", {{"n_draft", 3}, {"p_accept", 0}});
    h.run_to_end(FakeHost::oldest_first());
    EXPECT_EQ(h.generated().size(), 20u);
    EXPECT_EQ(h.metrics().accepted, h.metrics().drafted);
    EXPECT_GT(h.metrics().drafted, 0);
    EXPECT_EQ(h.launches(kTargetRole).size(), 5u);  // 4 tokens a verification
    EXPECT_TRUE(h.errors().empty()) << h.errors().front();
  }
}

TEST(StrategySpec, SpecStochasticRejectsDraftsTheTargetNeverSamples) {
  // Disjoint supports: every draft is rejected and the target's own token follows.
  FakeHost h = stochastic_host(5, 12);
  h.script(kTargetRole, [](const std::vector<int32_t>& s) { return weights({{kTarget(s), 1.0f}}); });
  h.script(kDraft, [](const std::vector<int32_t>& s) { return weights({{(kTarget(s) + 1) % kVocab, 1.0f}}); });
  h.start("spec", {{"n_draft", 3}, {"p_accept", 0}});
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 12));
  EXPECT_EQ(h.metrics().accepted, 0);
  EXPECT_EQ(h.launches(kTargetRole).size(), 12u);  // one token per verification
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategySpec, SpecStochasticEmitsTheTargetDistribution) {
  // The draft always proposes token 1; the target gives it probability p1 and token 2 the
  // rest. The first token is 1 with probability p1, not 1 as the draft would have it.
  for (float p1 : {0.5f, 0.25f}) {
    int ones = 0, n = 2000;
    for (int seed = 0; seed < n; ++seed) {
      FakeHost h = stochastic_host(uint64_t(seed), 1);
      h.script(kTargetRole, [&](const std::vector<int32_t>&) { return weights({{1, p1}, {2, 1 - p1}}); });
      h.script(kDraft, [](const std::vector<int32_t>&) { return weights({{1, 1.0f}}); });
      h.start("spec", {{"n_draft", 1}, {"p_accept", 0}});
      h.run_to_end(FakeHost::oldest_first());
      ASSERT_EQ(h.generated().size(), 1u);
      ASSERT_TRUE(h.errors().empty()) << h.errors().front();
      ones += h.generated()[0] == 1;
    }
    // Binomial(2000, p1): four standard deviations are under 0.045.
    EXPECT_NEAR(double(ones) / n, p1, 0.045) << "p1 = " << p1;
  }
}

}  // namespace

// DFlash at the message level: what the drafter's runs carry (context rows naming the target
// run whose taps hold them, then the anchor and mask rows), how both caches are cropped, and
// that the output is the target's whatever the drafter proposes.
#include <gtest/gtest.h>

#include <numeric>

#include "fake_host.hpp"
#include "specmesh/speculation/registry.hpp"

using namespace specmesh;
using namespace specmesh::test;
using namespace specmesh::test::scripted;

namespace {

// The id of mask rows: one past the vocabulary.
constexpr int32_t kMask = kVocab;

// A block drafter that sees [context..., anchor, mask x k] and predicts the token k positions
// after the anchor the way `guess` continues the sequence (its own guesses feeding the next).
Oracle block_oracle(NextToken guess) {
  return [guess](const std::vector<int32_t>& seen) {
    std::vector<int32_t> prefix = seen;
    int k = 0;
    while (!prefix.empty() && prefix.back() == kMask) prefix.pop_back(), ++k;
    int32_t t = prefix.empty() ? 0 : prefix.back();
    for (int i = 0; i < k; ++i) prefix.push_back(t = guess(prefix));
    return peaked(kVocab, t, 0.99f);
  };
}

FakeHost make_host(const NextToken& draft, int n_predict, FakeHostOptions o = {}) {
  o.vocab = kVocab;
  o.n_predict = n_predict;
  FakeHost h(kPrompt, o);
  h.script(kTargetRole, greedy_oracle(kVocab, kTarget));
  h.script(kDraft, block_oracle(draft));
  return h;
}

void run_to_end(FakeHost& h) { h.run_to_end(FakeHost::oldest_first()); }

int64_t sum(const std::vector<int64_t>& v) { return std::accumulate(v.begin(), v.end(), int64_t(0)); }

TEST(StrategyDFlash, PerfectDrafterHasEveryBlockAccepted) {
  const int block = 4, n = 21;  // 1 token from the prefill, then 5 steps of 4
  FakeHost h = make_host(kTarget, n);
  h.start("dflash", {{"block", block}});
  run_to_end(h);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, n));
  const SpecMetrics& m = h.metrics();
  EXPECT_EQ(m.verifications, 5);
  EXPECT_EQ(m.accepted, 15);
  EXPECT_EQ(m.accepted_hist, (std::vector<int64_t>{0, 0, 0, 5}));
  EXPECT_DOUBLE_EQ(m.tokens_per_verification(), 4.0);
}

TEST(StrategyDFlash, DraftRunsCarryTheTargetsTapsThenTheBlock) {
  const int block = 4;
  // n_batch 2: the prompt's 5 positions come from three prefill runs.
  FakeHost h = make_host(disagree_at(kTarget, {L + 2}, kVocab), 12, {.n_batch = 2});
  h.start("dflash", {{"block", block}});
  run_to_end(h);
  ASSERT_TRUE(h.errors().empty()) << h.errors().front();
  const auto drafts = h.launches(kDraft);
  const auto targets = h.launches(kTargetRole);
  ASSERT_GE(drafts.size(), 2u);
  ASSERT_GE(targets.size(), 5u);
  // The first draft run: the prompt's rows, each naming the prefill run that computed it, then
  // the anchor (the prefill's token) and three mask rows with logits.
  const LaunchRecord& d0 = *drafts[0];
  ASSERT_EQ(d0.batch.size(), size_t(L + block));
  for (int p = 0; p < L; ++p) {
    EXPECT_EQ(d0.batch.pos[size_t(p)], p);
    EXPECT_EQ(d0.inputs[size_t(p)], (TapRow{targets[size_t(p / 2)]->run, p % 2})) << "position " << p;
    EXPECT_FALSE(d0.batch.logits[size_t(p)]);
  }
  EXPECT_EQ(d0.batch.tokens[size_t(L)], h.generated()[0]);
  for (int i = 0; i < block; ++i) {
    EXPECT_EQ(d0.inputs[size_t(L + i)].run, 0u);
    EXPECT_EQ(bool(d0.batch.logits[size_t(L + i)]), i > 0);
    if (i > 0) EXPECT_EQ(d0.batch.tokens[size_t(L + i)], kMask);
  }
  // The drafter was wrong two positions after the anchor: the verification accepted one
  // proposal, so the next draft takes the anchor's and that proposal's rows from it.
  const LaunchRecord& v0 = *targets[3];
  EXPECT_EQ(v0.batch.size(), size_t(block));
  const LaunchRecord& d1 = *drafts[1];
  ASSERT_GE(d1.batch.size(), 2u + size_t(block));
  EXPECT_EQ(d1.batch.pos[0], L);
  EXPECT_EQ(d1.inputs[0], (TapRow{v0.run, 0}));
  EXPECT_EQ(d1.inputs[1], (TapRow{v0.run, 1}));
  EXPECT_EQ(d1.inputs[2].run, 0u);
  EXPECT_GE(h.metrics().accepted_hist[1], 1);
  // Each step crops the target's cache after the kept tokens and the drafter's at what it has
  // taken (its block rows are not context).
  bool target_cropped = false;
  for (const Event& e : h.events(EventKind::kv_ops, kTargetRole))
    for (const KvOp& op : e.ops) target_cropped |= op.kind == KvOpKind::remove && op.seq == 0 && op.pos_begin == L + 2;
  EXPECT_TRUE(target_cropped);
}

TEST(StrategyDFlash, OutputIsTheTargetsWhateverTheDrafterProposes) {
  const int n = 40;
  const auto greedy = greedy_continuation(kPrompt, kTarget, n);
  for (int block : {2, 3, 8}) {
    for (const std::vector<int32_t>& wrong :
         std::vector<std::vector<int32_t>>{{}, {L + 1}, {L + 2, L + 3, L + 9}, {L + 1, L + 4, L + 7, L + 20}}) {
      SCOPED_TRACE("block " + std::to_string(block) + ", wrong at " + std::to_string(wrong.size()) + " positions");
      FakeHost h = make_host(disagree_at(kTarget, wrong, kVocab), n);
      h.start("dflash", {{"block", block}});
      run_to_end(h);
      EXPECT_TRUE(h.errors().empty()) << h.errors().front();
      EXPECT_EQ(h.generated(), greedy);
      const SpecMetrics& m = h.metrics();
      EXPECT_EQ(sum(m.accepted_hist), m.verifications);
      // Each step yields its accepted proposals and the target's token, but the last may end
      // at the limit before that token.
      EXPECT_GE(m.accepted + m.verifications + 1, int64_t(greedy.size()));
      EXPECT_LE(m.accepted + m.verifications, int64_t(greedy.size()));
    }
  }
  // A drafter that is always wrong: every step yields the target's own token only.
  FakeHost h = make_host([](const std::vector<int32_t>& s) { return (kTarget(s) + 1) % kVocab; }, 20);
  h.start("dflash", {{"block", 4}});
  run_to_end(h);
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 20));
  EXPECT_EQ(h.metrics().accepted, 0);
}

TEST(StrategyDFlash, AsyncDraftsTheNextBlockWhileTheTargetVerifies) {
  // A perfect drafter: every guess holds, so after the first step each draft was launched with
  // the verification before it, and used.
  FakeHost h = make_host(kTarget, 25);
  h.start("dflash", {{"block", 4}, {"async", 1}});
  // The first draft, then its verification and at once the next block's draft, whose context
  // rows are the verification's block and whose anchor is the drafter's guess.
  ASSERT_TRUE(h.settle_next(kTargetRole));  // the prefill
  ASSERT_TRUE(h.settle_next(kDraft));
  const auto targets = h.launches(kTargetRole);
  const auto drafts = h.launches(kDraft);
  ASSERT_EQ(targets.size(), 2u);
  ASSERT_EQ(drafts.size(), 2u);
  const LaunchRecord& v = *targets[1];
  const LaunchRecord& g = *drafts[1];
  EXPECT_TRUE(v.in_flight());
  // The verification carries the anchor and 2 proposals; the third is the guess.
  ASSERT_EQ(v.batch.size(), 3u);
  for (int i = 0; i < 3; ++i) {
    EXPECT_EQ(g.inputs[size_t(i)], (TapRow{v.run, i}));
    EXPECT_EQ(g.batch.tokens[size_t(i)], v.batch.tokens[size_t(i)]);
    EXPECT_EQ(g.batch.pos[size_t(i)], L + i);
  }
  EXPECT_EQ(g.batch.pos[3], L + 3);  // the guessed anchor after the block
  EXPECT_EQ(g.batch.tokens[3], greedy_continuation(kPrompt, kTarget, 4)[3]);
  EXPECT_EQ(g.batch.size(), 3u + 4u);  // and a block of 4
  run_to_end(h);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 25));
  const SpecMetrics& m = h.metrics();
  EXPECT_GE(m.speculative_drafts, 5);
  EXPECT_GE(m.speculative_drafts_used, m.speculative_drafts - 1);
  EXPECT_TRUE(h.events(EventKind::cancel, kDraft).empty() || m.speculative_drafts_used < m.speculative_drafts);
}

TEST(StrategyDFlash, AsyncCancelsAWrongGuessAndStaysLossless) {
  const int n = 40;
  const auto greedy = greedy_continuation(kPrompt, kTarget, n);
  for (uint64_t seed : {1, 2, 3, 4}) {
    for (const std::vector<int32_t>& wrong :
         std::vector<std::vector<int32_t>>{{L + 1}, {L + 4, L + 8}, {L + 2, L + 3, L + 9, L + 13, L + 30}}) {
      SCOPED_TRACE("seed " + std::to_string(seed) + ", wrong at " + std::to_string(wrong.size()) + " positions");
      FakeHost h = make_host(disagree_at(kTarget, wrong, kVocab), n);
      h.start("dflash", {{"block", 4}, {"async", 1}});
      // Any order of arrival between the pipelines: a guess's logits may come before the
      // verification it assumes.
      h.run_to_end(FakeHost::shuffled(seed));
      EXPECT_TRUE(h.errors().empty()) << h.errors().front();
      EXPECT_EQ(h.generated(), greedy);
      const SpecMetrics& m = h.metrics();
      EXPECT_GT(m.speculative_drafts, m.speculative_drafts_used);
      EXPECT_FALSE(h.events(EventKind::cancel, kDraft).empty());
    }
  }
}

TEST(StrategyDFlash, SamplesAsPlainDecodingDoesAtTemperatureOne) {
  // Every emitted token is one draw of the sampler from the target's row, in the order plain
  // decoding draws them: with the same seed the outputs are the same tokens.
  auto run = [](const std::string& strategy, const std::map<std::string, ParamValue>& params) {
    FakeHostOptions o{.vocab = kVocab, .n_predict = 30, .sampling = {.temperature = 1.0f, .seed = 77}};
    FakeHost h(kPrompt, o);
    h.script(kTargetRole, greedy_oracle(kVocab, kTarget, 0.6f));
    h.script(kDraft, block_oracle(kTarget));
    h.start(strategy, params);
    h.run_to_end(FakeHost::oldest_first());
    EXPECT_TRUE(h.errors().empty()) << h.errors().front();
    return h.generated();
  };
  const auto ar = run("ar", {});
  EXPECT_EQ(run("dflash", {{"block", 5}}), ar);
  EXPECT_EQ(run("dflash", {{"block", 5}, {"async", 1}}), ar);
  EXPECT_NE(ar, greedy_continuation(kPrompt, kTarget, 30));  // the draws really vary
}

TEST(StrategyDFlash, BlocksShrinkAtTheEndOfTheContext) {
  FakeHost ar = make_host(kTarget, 100, {.n_ctx = 16});
  ar.start("ar");
  run_to_end(ar);
  FakeHost h = make_host(kTarget, 100, {.n_ctx = 16});
  h.start("dflash", {{"block", 8}});
  run_to_end(h);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();  // no run past position 15
  EXPECT_EQ(h.generated(), ar.generated());
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 16 - L + 1));
  EXPECT_GT(h.launches(kDraft).back()->batch.size(), 0u);
}

TEST(StrategyDFlash, BadParametersAreRefusedWithTheKey) {
  const StrategyInfo& s = strategy("dflash");
  EXPECT_THROW(s.resolve({{"block", 65}}), std::invalid_argument);
  try {
    s.check(s.resolve({{"taps", 24}}), {});
    ADD_FAILURE() << "taps 24 accepted";
  } catch (const ParamConflict& c) {
    EXPECT_EQ(c.key, "taps");
  }
  try {
    s.check(s.resolve({{"block", 32}}), {.n_ctx = 16});
    ADD_FAILURE() << "a block longer than the context accepted";
  } catch (const ParamConflict& c) {
    EXPECT_EQ(c.key, "block");
  }
  EXPECT_EQ(s.roles, (std::vector<std::string>{kTargetRole, kDraftRole}));
  EXPECT_EQ(s.drafter_role, kDraftRole);
}

}  // namespace

// Context shift at the message level: a session whose context fills goes on as llama.cpp's
// loop does (the first n_keep tokens stay, half of the rest go, the tail moves down in every
// cache), with ar, alspec, spec (chains and trees), dflash, pipeinfer (chains and branches) and
// triforce (every middle level), whatever the draft proposes
// and whatever order results arrive in. No run ever goes past the context, and without the
// shift the session ends where the context is full.
#include <gtest/gtest.h>

#include <cmath>
#include <random>

#include "fake_host.hpp"
#include "specmesh/speculation/registry.hpp"

using namespace specmesh;
using namespace specmesh::test;
using namespace specmesh::test::scripted;

namespace {

// A draft that agrees with the target where a hash of what it has seen says so (about
// `agree` of the time), with confidence `conf` in its top token and the target's token second
// where it is wrong (so pipeinfer's branches can foresee the miss).
Oracle hashed_draft(float agree, float conf, uint64_t salt) {
  return [=](const std::vector<int32_t>& seen) {
    uint64_t h = salt;
    for (int32_t t : seen) h = (h ^ uint64_t(t + 7)) * 1099511628211ull;
    const int32_t want = kTarget(seen);
    const bool right = double((h >> 11) % 1000) < agree * 1000.0;
    const int32_t top = right ? want : (want + 1) % kVocab;
    const int32_t second = right ? (want + 2) % kVocab : want;
    const double p2 = 0.8 * (1.0 - conf), rest = (1.0 - conf - p2) / (kVocab - 2);
    std::vector<float> l(size_t(kVocab), float(std::log(rest)));
    l[size_t(top)] = float(std::log(conf));
    l[size_t(second)] = float(std::log(p2));
    return l;
  };
}

// TriForce small enough for a context of 12: a retrieval cache of 8 entries in chunks of 2,
// and the draft's StreamingLLM cache of 2 + 6 tokens.
const std::map<std::string, ParamValue> kTriForce = {{"budget", 8}, {"chunk", 2}, {"gamma1", 2}, {"gamma2", 2},
                                                     {"sink", 2},   {"window", 6}, {"rebuild_every", 0}};

struct Case {
  std::string strategy;
  std::map<std::string, ParamValue> params;
};

std::vector<Case> cases() {
  return {{"ar", {}},
          {"alspec", {}},
          {"spec", {{"n_draft", 4}}},
          {"spec", {{"n_draft", 7}, {"p_accept", 0.1}}},
          {"spec", {{"tree", ParamValue(std::vector<int>{3, 2, 1})}, {"p_accept", 0.05}}},
          {"dflash", {{"block", 4}}},
          {"dflash", {{"block", 5}, {"async", 1}}},
          {"pipeinfer", {{"max_runs", 4}}},
          {"pipeinfer", {{"max_runs", 6}, {"max_micro_batch", 3}, {"n_parallel", 3}, {"p_split", 0.05}}},
          {"triforce", kTriForce},
          {"triforce", with(kTriForce, {{"rebuild_every", 5}, {"gamma1", 1}})},
          {"triforce", with(kTriForce, {{"middle", 2}})},
          {"triforce", with(kTriForce, {{"middle", 0}})},
          {"triforce", with(kTriForce, {{"use_draft", false}})}};
}

std::string name(const Case& c) {
  std::string s = c.strategy;
  for (const auto& [k, v] : c.params) s += " " + k;
  return s;
}

// Every pipeline's cache held at most one cell per position of the context plus the
// strategy's spare cells (StrategyInfo::spare_cells), which is what the head sets aside.
void expect_cells_within_share(const FakeHost& h, const std::string& strategy_name, int n_ctx) {
  const int spare = strategy(strategy_name).spare_cells_for(h.params(), {kTargetRole, kDraft});
  for (const char* role : {kTargetRole, kDraft})
    EXPECT_LE(h.peak_cells(role), n_ctx + spare) << role << ": spare " << spare;
}

}  // namespace

TEST(StrategyContextShift, EveryStrategyGoesOnPastAFullContextAsLlamaCppDoes) {
  const int n = 150;
  std::mt19937 rng(5);
  for (const Case& c : cases())
    for (int n_ctx : {12, 17, 24, 64})
      for (int n_keep : {0, 3}) {
        const auto want = greedy_shifting(kPrompt, kTarget, n, n_ctx, n_keep);
        for (int order = 0; order < 4; ++order) {
          SCOPED_TRACE(name(c) + ", n_ctx " + std::to_string(n_ctx) + ", n_keep " + std::to_string(n_keep) + ", order " +
                       std::to_string(order));
          FakeHost h(kPrompt, {.vocab = kVocab, .n_batch = 8, .n_predict = n, .cancel_too_late = order == 3,
                               .n_ctx = n_ctx, .context_shift = true, .n_keep = n_keep});
          h.script(kTargetRole, greedy_oracle(kVocab, kTarget));
          if (c.strategy != "ar" && c.strategy != "alspec") h.script(kDraft, hashed_draft(0.7f, 0.3f + 0.1f * float(order), rng()));
          const FakeHost::Pick pick = order == 0   ? FakeHost::oldest_first()
                                      : order == 1 ? FakeHost::prefer(kDraft)
                                                   : FakeHost::shuffled(rng());
          h.start(c.strategy, c.params);
          h.run_to_end(pick);
          ASSERT_TRUE(h.errors().empty()) << h.errors().front() << " after " << h.generated().size() << " tokens, " << h.events().size() << " events";
          ASSERT_EQ(h.generated(), want);
          EXPECT_GE(h.context_shifts(), 3);
          expect_cells_within_share(h, c.strategy, n_ctx);
        }
      }
}

// Without the shift, the session ends with the token that fills the context, as ar does, and
// no strategy launches a run past it on the way.
TEST(StrategyContextShift, WithoutTheShiftEveryStrategyStopsAtAFullContext) {
  const int n_ctx = 20;
  const auto want = greedy_continuation(kPrompt, kTarget, n_ctx + 1 - L);
  for (const Case& c : cases()) {
    SCOPED_TRACE(name(c));
    FakeHost h(kPrompt, {.vocab = kVocab, .n_predict = 100, .n_ctx = n_ctx});
    h.script(kTargetRole, greedy_oracle(kVocab, kTarget));
    if (c.strategy != "ar" && c.strategy != "alspec") h.script(kDraft, hashed_draft(0.9f, 0.9f, 3));
    h.start(c.strategy, c.params);
    h.run_to_end(FakeHost::oldest_first());
    ASSERT_TRUE(h.errors().empty()) << h.errors().front();
    EXPECT_EQ(h.generated(), want);
    EXPECT_EQ(h.context_shifts(), 0);
  }
}

// The spare cells of the strategies that hold more than one cell per position, over a grid of
// their parameters, drafts good and bad, and results in any order, cancels late or not.
TEST(StrategyContextShift, NoSessionHoldsMoreCellsThanItsContextAndItsSpare) {
  std::vector<Case> grid;
  for (int runs : {2, 5, 8})
    for (int micro : {1, 3})
      for (int parallel : {1, 2, 4})
        grid.push_back({"pipeinfer", {{"max_runs", runs}, {"max_micro_batch", micro}, {"n_parallel", parallel}, {"p_split", 0.02}}});
  for (const std::vector<int>& tree : std::vector<std::vector<int>>{{2, 2, 2}, {4, 1}, {1, 3, 1, 2}, {5}})
    grid.push_back({"spec", {{"tree", ParamValue(tree)}, {"p_accept", 0.0}}});
  for (int g1 : {1, 3})
    for (int g2 : {1, 4})
      for (int middle : {0, 1, 2})
        grid.push_back({"triforce", with(kTriForce, {{"gamma1", g1}, {"gamma2", g2}, {"middle", middle}, {"budget", 16}, {"sink", 2}, {"window", 8}})});
  std::mt19937 rng(11);
  for (const Case& c : grid)
    for (int n_ctx : {24, 40})
      for (int order = 0; order < 3; ++order) {
        SCOPED_TRACE(name(c) + ", n_ctx " + std::to_string(n_ctx) + ", order " + std::to_string(order));
        FakeHost h(kPrompt, {.vocab = kVocab, .n_batch = 8, .n_predict = 120, .cancel_too_late = order == 2,
                             .n_ctx = n_ctx, .context_shift = true});
        h.script(kTargetRole, greedy_oracle(kVocab, kTarget));
        h.script(kDraft, hashed_draft(order == 0 ? 0.95f : 0.6f, 0.9f, rng()));
        h.start(c.strategy, c.params);
        h.run_to_end(order == 0 ? FakeHost::oldest_first() : FakeHost::shuffled(rng()));
        ASSERT_TRUE(h.errors().empty()) << h.errors().front();
        ASSERT_EQ(h.generated(), greedy_shifting(kPrompt, kTarget, 120, n_ctx, 0));
        expect_cells_within_share(h, c.strategy, n_ctx);
      }
}

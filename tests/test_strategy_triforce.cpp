// TriForce at the message level: which runs go to which KV sequence with which view, how the
// retrieval cache is built and rebuilt, that both levels roll their caches back, and that the
// output is the target's (greedy: token for token; sampled: in distribution) whatever the
// draft and the middle level's partial cache propose. The fake host's views hand the middle
// level's rows a filtered history, so the middle level really differs from the full cache.
#include <gtest/gtest.h>

#include <cmath>
#include <functional>
#include <map>
#include <stdexcept>

#include "fake_host.hpp"
#include "specmesh/speculation/registry.hpp"

using namespace specmesh;
using namespace specmesh::test;

namespace {

constexpr int kVocab = 32;
const char* const kDraft = "draft";
// A long prompt, so the retrieval cache drops some of it.
const std::vector<int32_t> kLongPrompt = [] {
  std::vector<int32_t> p;
  for (int i = 0; i < 40; ++i) p.push_back((i * 7 + 3) % kVocab);
  return p;
}();
const NextToken kTarget = history_hash(kVocab);

const std::map<std::string, ParamValue> kSmall = {{"budget", 16}, {"chunk", 4}, {"gamma1", 2}, {"gamma2", 3},
                                                  {"sink", 4},    {"window", 12}, {"rebuild_every", 0}};

FakeHost make_host(const NextToken& draft, int n_predict, FakeHostOptions o = {}) {
  o.vocab = kVocab;
  o.n_predict = n_predict;
  FakeHost h(kLongPrompt, o);
  h.script(kTargetRole, greedy_oracle(kVocab, kTarget));
  h.script(kDraft, greedy_oracle(kVocab, draft));
  return h;
}

std::vector<KvOp> ops_of(const FakeHost& h, const std::string& role) {
  std::vector<KvOp> out;
  for (const Event& e : h.events(EventKind::kv_ops, role)) out.insert(out.end(), e.ops.begin(), e.ops.end());
  return out;
}

bool in_seq(const Batch& b, int seq) {
  for (SeqSet s : b.seqs)
    if (s != seq_bit(seq)) return false;
  return true;
}

TEST(StrategyTriForce, GreedyOutputIsTheTargetsInEveryMode) {
  const auto greedy = greedy_continuation(kLongPrompt, kTarget, 40);
  const std::vector<std::pair<std::string, NextToken>> drafts = {
      {"perfect", kTarget},
      {"wrong at some", disagree_at(kTarget, {41, 44, 45, 52, 60, 61, 62}, kVocab)},
      {"always wrong", [](const std::vector<int32_t>& s) { return (kTarget(s) + 1) % kVocab; }},
      {"local", [](const std::vector<int32_t>& s) { return (s.back() * 5 + 1) % kVocab; }}};
  const std::vector<std::map<std::string, ParamValue>> modes = {
      kSmall,
      with(kSmall, {{"gamma1", 1}, {"gamma2", 1}}),
      with(kSmall, {{"gamma1", 4}, {"gamma2", 6}, {"budget", 24}}),
      with(kSmall, {{"rebuild_every", 5}}),
      with(kSmall, {{"rebuild_below", 0.9}}),
      with(kSmall, {{"middle", 2}}),
      with(kSmall, {{"middle", 0}}),
      with(kSmall, {{"use_draft", false}}),
      with(kSmall, {{"window", 2}, {"sink", 0}}),
  };
  // Results arrive in launch order, in any order across the roles, with the draft's device
  // much faster, and with cancels that come too late to stop a run.
  const std::vector<std::pair<std::string, std::function<FakeHost::Pick()>>> orders = {
      {"oldest first", [] { return FakeHost::oldest_first(); }},
      {"shuffled", [] { return FakeHost::shuffled(7); }},
      {"fast draft", [] { return FakeHost::favour(kDraft, 0.8, 3); }}};
  for (const auto& [name, draft] : drafts)
    for (size_t m = 0; m < modes.size(); ++m)
      for (int n_batch : {512, 3})
        for (const auto& [order, pick] : orders)
          for (bool late : {false, true}) {
            SCOPED_TRACE("draft " + name + ", mode " + std::to_string(m) + ", n_batch " + std::to_string(n_batch) + ", " +
                         order + (late ? ", late cancels" : ""));
            FakeHost h = make_host(draft, 40, {.n_batch = n_batch, .cancel_too_late = late});
            h.start("triforce", modes[m]);
            h.run_to_end(pick());
            EXPECT_EQ(h.generated(), greedy);
            EXPECT_TRUE(h.errors().empty()) << h.errors().front();
          }
}

TEST(StrategyTriForce, LowerLevelsRunAheadAndDieWithTheirProposal) {
  // While the full cache verifies, the draft and the middle level go on past the tokens it
  // verifies; a rejection there cancels their runs still in flight, which were all launched
  // after that verification (they built on its proposal).
  const NextToken draft = disagree_at(kTarget, {44, 50, 51, 57, 63, 70}, kVocab);
  for (const auto& params : {kSmall, with(kSmall, {{"use_draft", false}}), with(kSmall, {{"middle", 0}})}) {
    FakeHost h = make_host(draft, 40);
    h.start("triforce", params);
    // Settle the full cache's runs last whenever something else is pending: the lower
    // levels get as far ahead as they may.
    h.run_to_end(FakeHost::favour(kTargetRole, 0.1, 5));
    ASSERT_TRUE(h.errors().empty()) << h.errors().front();
    EXPECT_EQ(h.generated(), greedy_continuation(kLongPrompt, kTarget, 40));
    int ahead = 0, cancelled = 0;
    uint64_t top = 0;          // the latest full-cache verification launched
    bool top_pending = false;  // and not yet answered
    for (const Event& e : h.events()) {
      if (e.kind == EventKind::launch) {
        const LaunchRecord& r = h.launch_of(e.run);
        if (r.role == kTargetRole && !r.speculative) top = e.run, top_pending = true;
        else if (top_pending) ++ahead;
      }
      if (e.kind == EventKind::accept) top_pending = false;
      if (e.kind == EventKind::cancel)
        for (uint64_t run : e.runs) {
          ++cancelled;
          EXPECT_GT(run, top) << "run " << run << " was cancelled, though it did not build on verification " << top;
        }
    }
    EXPECT_GT(ahead, 3);
    EXPECT_GT(cancelled, 0);
  }
}

TEST(StrategyTriForce, LevelsUseTheirSequencesAndViews) {
  FakeHost h = make_host(kTarget, 12);
  h.start("triforce", kSmall);
  h.run_to_end(FakeHost::oldest_first());
  ASSERT_TRUE(h.errors().empty()) << h.errors().front();
  const auto L = int32_t(kLongPrompt.size());
  // The prefill goes to sequence 0, and the retrieval cache is built right after it from the
  // last prompt token's query, before anything reads sequence 1.
  const auto target = h.launches(kTargetRole);
  ASSERT_GE(target.size(), 3u);
  EXPECT_TRUE(in_seq(target[0]->batch, 0));
  EXPECT_EQ(target[0]->batch.tokens, kLongPrompt);
  const auto ops = ops_of(h, kTargetRole);
  ASSERT_FALSE(ops.empty());
  EXPECT_EQ(ops[0], retrieval_view_op(1, L, 4, 16));
  // Middle-level runs are speculative runs of sequence 1; top-level runs are sequence 0's.
  int middle = 0, top = 0;
  for (const LaunchRecord* r : target) {
    if (r->speculative) {
      EXPECT_TRUE(in_seq(r->batch, 1));
      ++middle;
    } else {
      EXPECT_TRUE(in_seq(r->batch, 0));
      ++top;
    }
  }
  EXPECT_GT(middle, 0);
  EXPECT_GT(top, 1);
  // A perfect draft and a middle level that agrees (the target depends on the whole history,
  // but every accepted token is fresh, so the view reads the same tokens until the prompt
  // loses entries) give tokens per verification above one at both levels.
  EXPECT_GT(h.metrics().middle_drafted, 0);
  EXPECT_GT(h.metrics().middle_accepted, 0);
  EXPECT_EQ(h.metrics().verifications + h.metrics().cache_rebuilds, top - 1);
}

TEST(StrategyTriForce, MiddleLevelRowsAreScratchAndRollBack) {
  // Sequence 1 restarts from sequence 0 every round, and a middle-level rejection drops the
  // rejected drafts' rows from sequence 1 only.
  FakeHost h = make_host([](const std::vector<int32_t>& s) { return (kTarget(s) + 1) % kVocab; }, 6);
  h.start("triforce", kSmall);
  h.run_to_end(FakeHost::oldest_first());
  ASSERT_TRUE(h.errors().empty()) << h.errors().front();
  bool restarted = false, dropped = false;
  for (const KvOp& op : ops_of(h, kTargetRole)) {
    if (op.kind == KvOpKind::copy) restarted |= op.seq == 0 && op.dst_seq == 1;
    if (op.kind == KvOpKind::remove && op.seq == 1 && op.pos_begin >= 0) dropped = true;
  }
  EXPECT_TRUE(restarted);
  EXPECT_TRUE(dropped);
  EXPECT_EQ(h.metrics().middle_accepted, 0);
}

TEST(StrategyTriForce, RebuildsAtTheStrideAndOnLowAcceptance) {
  {
    FakeHost h = make_host(kTarget, 30);
    h.start("triforce", with(kSmall, {{"rebuild_every", 6}}));
    h.run_to_end(FakeHost::oldest_first());
    ASSERT_TRUE(h.errors().empty()) << h.errors().front();
    std::vector<int32_t> built;
    for (const KvOp& op : ops_of(h, kTargetRole))
      if (op.kind == KvOpKind::retrieve) built.push_back(op.pos_begin);
    ASSERT_GE(built.size(), 4u);
    EXPECT_EQ(h.metrics().cache_rebuilds, int64_t(built.size()) - 1);
    for (size_t i = 1; i < built.size(); ++i) {
      EXPECT_GE(built[i] - built[i - 1], 6);
      EXPECT_LE(built[i] - built[i - 1], 6 + 3 + 2 + 1);  // at most one round past the stride
    }
  }
  // Without a stride, a rolling acceptance below the threshold rebuilds as well; the middle
  // level misses part of the prompt here, and the target depends on all of it, so the full
  // cache rejects most of its tokens.
  auto rebuilds = [&](double below) {
    FakeHost h = make_host(kTarget, 40);
    h.start("triforce", with(kSmall, {{"budget", 40}, {"rebuild_below", below}}));
    h.run_to_end(FakeHost::oldest_first());
    EXPECT_TRUE(h.errors().empty()) << h.errors().front();
    EXPECT_EQ(h.generated(), greedy_continuation(kLongPrompt, kTarget, 40));
    return h.metrics().cache_rebuilds;
  };
  EXPECT_GT(rebuilds(1.0), rebuilds(0.0) + 1);
}

TEST(StrategyTriForce, SinkIsNeverOverwritten) {
  // With the smallest budget the load check allows, the strategy rebuilds before a round's
  // fresh tokens could reach chunk 0, and every rebuild starts from the newest token.
  FakeHost h = make_host(kTarget, 40);
  h.start("triforce", with(kSmall, {{"budget", 12}, {"chunk", 4}, {"gamma1", 2}, {"gamma2", 3}}));
  h.run_to_end(FakeHost::oldest_first());
  ASSERT_TRUE(h.errors().empty()) << h.errors().front();
  EXPECT_EQ(h.generated(), greedy_continuation(kLongPrompt, kTarget, 40));
  EXPECT_GT(h.metrics().cache_rebuilds, 2);
  int32_t fresh_from = 0;
  for (const Event& e : h.events()) {
    if (e.kind == EventKind::kv_ops)
      for (const KvOp& op : e.ops)
        if (op.kind == KvOpKind::retrieve) fresh_from = op.pos_begin;
    if (e.kind == EventKind::launch && e.role == kTargetRole) {
      const Batch& b = h.launch_of(e.run).batch;
      if (!h.launch_of(e.run).speculative) continue;
      for (int32_t p : b.pos) EXPECT_LE(p - fresh_from + 1, 12 - 4) << "middle-level query at " << p;
    }
  }
}

TEST(StrategyTriForce, DraftCacheStaysInsideSinkAndWindow) {
  FakeHost h = make_host(kTarget, 30);
  h.start("triforce", with(kSmall, {{"sink", 4}, {"window", 10}}));
  h.run_to_end(FakeHost::oldest_first());
  ASSERT_TRUE(h.errors().empty()) << h.errors().front();
  for (const LaunchRecord* r : h.launches(kDraft))
    for (int32_t p : r->batch.pos) EXPECT_LT(p, 4 + 10) << "draft run " << r->run;
  // What the draft saw: the first four prompt tokens, then its recent window.
  const LaunchRecord* last = h.launches(kDraft).back();
  ASSERT_FALSE(last->seen.empty());
  const std::vector<int32_t>& seen = last->seen.back();
  EXPECT_EQ(std::vector<int32_t>(seen.begin(), seen.begin() + 4), std::vector<int32_t>(kLongPrompt.begin(), kLongPrompt.begin() + 4));
  EXPECT_LE(seen.size(), 14u);
}

TEST(StrategyTriForce, AContextShiftRebuildsTheRetrievalCacheAndRestartsTheDraft) {
  // The shift moves and drops entries the retrieval cache was built from, and the draft's
  // StreamingLLM cache holds tokens at positions of its own, which the shift does not know.
  const int n_ctx = 64, n = 100;
  for (int n_keep : {0, 5}) {
    SCOPED_TRACE("n_keep " + std::to_string(n_keep));
    FakeHost h = make_host(kTarget, n, {.n_ctx = n_ctx, .context_shift = true, .n_keep = n_keep});
    h.start("triforce", with(kSmall, {{"budget", 32}, {"rebuild_below", 0.0}}));
    h.run_to_end(FakeHost::oldest_first());
    ASSERT_TRUE(h.errors().empty()) << h.errors().front();
    EXPECT_EQ(h.generated(), greedy_shifting(kLongPrompt, kTarget, n, n_ctx, n_keep));
    EXPECT_GE(h.context_shifts(), 2);
    // After each shift the retrieval cache is rebuilt before a middle-level run reads it, and
    // the draft's cache is emptied and filled again from position 0.
    bool stale_view = false, stale_draft = false;
    int shifts = 0;
    for (const Event& e : h.events()) {
      if (e.kind == EventKind::kv_ops)
        for (size_t i = 0; i < e.ops.size(); ++i) {
          if (context_shift_at(e.ops, i)) {
            (e.role == kTargetRole ? stale_view : stale_draft) = true;
            shifts += e.role == kTargetRole;
          }
          if (e.role == kTargetRole && e.ops[i].kind == KvOpKind::retrieve) stale_view = false;
        }
      if (e.kind != EventKind::launch) continue;
      const LaunchRecord& r = h.launch_of(e.run);
      if (e.role == kTargetRole && r.speculative) EXPECT_FALSE(stale_view) << "middle-level run " << e.run << " read a moved retrieval cache";
      if (e.role == kDraft && stale_draft) {
        EXPECT_EQ(r.batch.pos.front(), 0) << "the draft's first run after a shift";
        stale_draft = false;
      }
    }
    EXPECT_EQ(shifts, h.context_shifts());
  }
}

TEST(StrategyTriForce, BadParametersAreRejectedWithTheKeyAndTheReason) {
  const StrategyInfo& s = strategy("triforce");
  auto conflict = [&](const std::map<std::string, ParamValue>& given, int n_ctx) -> std::string {
    try {
      s.check(s.resolve(given), {n_ctx, {kTargetRole, kDraft}});
    } catch (const ParamConflict& e) {
      return e.key + ": " + e.what();
    }
    return {};
  };
  EXPECT_EQ(conflict({}, 512), "");
  EXPECT_NE(conflict({{"budget", 60}}, 512).find("budget: budget 60 is not a multiple of chunk (8)"), std::string::npos);
  EXPECT_NE(conflict({{"budget", 512}}, 512).find("budget: budget 512 is not below the context of 512"), std::string::npos);
  EXPECT_NE(conflict({{"budget", 16}, {"gamma2", 8}}, 512).find("budget:"), std::string::npos);
  EXPECT_NE(conflict({{"middle", 0}, {"use_draft", false}}, 512).find("use_draft:"), std::string::npos);
  EXPECT_NE(conflict({{"window", 600}}, 512).find("window:"), std::string::npos);
  for (const char* gamma : {"gamma1", "gamma2"}) {
    try {
      s.resolve({{gamma, 0}});
      ADD_FAILURE() << gamma << " = 0 was accepted";
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(gamma), std::string::npos) << e.what();
    }
  }
}

// --- temperature 1 ---------------------------------------------------------------------------

// Logits over a small support that depend on the last token and on how many tokens the row
// sees, so the middle level (which sees fewer) has its own distribution.
Oracle spread(int salt, bool by_length) {
  return [=](const std::vector<int32_t>& seen) {
    std::vector<float> l(size_t(kVocab), -30.0f);
    const uint32_t key = uint32_t(seen.back() * 131 + salt * 17 + (by_length ? int(seen.size() % 3) * 7 : 0));
    for (int t = 0; t < 4; ++t) l[size_t(t)] = float((key >> (t * 3)) % 7) * 0.45f;
    return l;
  };
}

// Softmax probability of token t.
double prob(const std::vector<float>& l, int32_t t) {
  double m = l[0], s = 0;
  for (float v : l) m = std::max(m, double(v));
  for (float v : l) s += std::exp(double(v) - m);
  return std::exp(double(l[size_t(t)]) - m) / s;
}

// The target's probability of generating `tail` after `s` plus any `skip` tokens.
double prob_after(const Oracle& target, std::vector<int32_t> s, int skip, const std::vector<int32_t>& tail) {
  if (skip > 0) {
    double sum = 0;
    for (int32_t t = 0; t < 4; ++t) {
      const double pt = prob(target(s), t);
      s.push_back(t);
      sum += pt * prob_after(target, s, skip - 1, tail);
      s.pop_back();
    }
    return sum;
  }
  double p = 1;
  for (int32_t t : tail) {
    p *= prob(target(s), t);
    s.push_back(t);
  }
  return p;
}

// Chi-square goodness of fit of three generated tokens, after the first `skip`, against the
// target's joint.
double chi_square_of_triforce(const std::map<std::string, ParamValue>& params, int runs, int* dof, int skip = 0,
                              const std::function<FakeHost::Pick()>& pick = FakeHost::oldest_first) {
  const Oracle target = spread(1, true), draft = spread(2, false);
  std::map<std::vector<int32_t>, int> counts;
  for (int seed = 0; seed < runs; ++seed) {
    FakeHost h(kLongPrompt,
               {.vocab = kVocab, .n_predict = 3 + skip, .sampling = {.temperature = 1.0f, .seed = uint64_t(seed)}});
    h.script(kTargetRole, target);
    h.script(kDraft, draft);
    h.start("triforce", params);
    h.run_to_end(pick());
    EXPECT_TRUE(h.errors().empty()) << h.errors().front();
    const std::vector<int32_t> g = h.generated();
    ++counts[std::vector<int32_t>(g.begin() + skip, g.end())];
  }
  double chi2 = 0, rare_obs = 0, rare_exp = 0;
  int cells = 0;
  for (int32_t a = 0; a < 4; ++a)
    for (int32_t b = 0; b < 4; ++b)
      for (int32_t c = 0; c < 4; ++c) {
        const double p = prob_after(target, kLongPrompt, skip, {a, b, c});
        const double e = p * runs, o = counts[{a, b, c}];
        if (e < 5) {
          rare_obs += o, rare_exp += e;
          continue;
        }
        chi2 += (o - e) * (o - e) / e;
        ++cells;
      }
  if (rare_exp > 0) chi2 += (rare_obs - rare_exp) * (rare_obs - rare_exp) / rare_exp, ++cells;
  *dof = cells - 1;
  return chi2;
}

// Upper 0.1 % point of chi-square (Wilson-Hilferty).
double chi2_critical(int k) {
  const double h = 2.0 / (9.0 * k);
  return k * std::pow(1 - h + 3.0902 * std::sqrt(h), 3);
}

TEST(StrategyTriForce, SampledOutputFollowsTheTargetDistribution) {
  for (const auto& params : {kSmall, with(kSmall, {{"gamma1", 1}, {"gamma2", 1}}), with(kSmall, {{"middle", 2}}),
                             with(kSmall, {{"use_draft", false}})}) {
    int dof = 0;
    const double chi2 = chi_square_of_triforce(params, 6000, &dof);
    EXPECT_LT(chi2, chi2_critical(dof)) << "chi2 " << chi2 << " with " << dof << " dof";
    EXPECT_GT(dof, 20);
  }
  // Later tokens, which the lower levels' run-ahead proposed while the full cache verified
  // the tokens before them, with results arriving in any order.
  for (const auto& params : {with(kSmall, {{"gamma1", 1}, {"gamma2", 1}}), with(kSmall, {{"gamma2", 2}})}) {
    int dof = 0;
    const double chi2 = chi_square_of_triforce(params, 6000, &dof, 3, [] { return FakeHost::favour(kTargetRole, 0.2, 11); });
    EXPECT_LT(chi2, chi2_critical(dof)) << "chi2 " << chi2 << " with " << dof << " dof";
    EXPECT_GT(dof, 20);
  }
}

}  // namespace

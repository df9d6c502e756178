// PipeInfer at the message level: several target runs in flight, cancellation of runs built
// on rejected tokens, the adaptive confidence cutoff, micro-batch sizes, and the target's
// greedy output whatever order results arrive in.
#include <gtest/gtest.h>

#include <algorithm>
#include <bit>
#include <cmath>
#include <random>

#include "fake_host.hpp"

using namespace specmesh;
using namespace specmesh::test;
using namespace specmesh::test::scripted;

namespace {

FakeHost make_host(const Oracle& draft, int n_predict, bool cancel_too_late = false) {
  FakeHost h(kPrompt, {.vocab = kVocab, .n_predict = n_predict, .cancel_too_late = cancel_too_late});
  h.script(kTargetRole, greedy_oracle(kVocab, kTarget));
  h.script(kDraft, draft);
  return h;
}

// Settles every draft run, so the strategy fills the target pipeline as far as it will.
void draft_all(FakeHost& h) {
  while (h.settle_next(kDraft)) {
  }
}

std::vector<const LaunchRecord*> speculative_runs(const FakeHost& h) {
  std::vector<const LaunchRecord*> out;
  for (const LaunchRecord* r : h.launches(kTargetRole))
    if (r->speculative) out.push_back(r);
  return out;
}

std::vector<size_t> sizes(const std::vector<const LaunchRecord*>& runs) {
  std::vector<size_t> out;
  for (const LaunchRecord* r : runs) out.push_back(r->batch.size());
  return out;
}

int seq_of(const LaunchRecord& r) { return std::countr_zero(r.batch.seqs[0]); }

// Cancels the strategy sent while generating (abandon() cancels what is left at the end).
std::vector<Event> cancels_while_generating(const FakeHost& h) {
  std::vector<Event> out;
  for (const Event& e : h.events()) {
    if (e.kind == EventKind::finish) break;
    if (e.kind == EventKind::cancel) out.push_back(e);
  }
  return out;
}

// Runs of a role launched and neither answered nor cancelled yet.
int in_flight(const FakeHost& h, const std::string& role) {
  int n = 0;
  for (const LaunchRecord* r : h.launches(role)) n += r->in_flight();
  return n;
}

// Whether an in-flight target run feeds the newest accepted token, and how.
enum class Carrier { none, non_speculative, speculative };
Carrier newest_token_carrier(const FakeHost& h) {
  const auto& A = h.tokens();
  const int32_t last = int32_t(A.size()) - 1;
  Carrier found = Carrier::none;
  for (const LaunchRecord* r : h.launches(kTargetRole)) {
    if (!r->in_flight()) continue;
    const Batch& b = r->batch;
    // A row carries the token when it sits at its position and its path (the rows of its
    // sequences up to it) agrees with the accepted tokens.
    bool carries = false;
    for (size_t i = 0; i < b.size() && !carries; ++i) {
      if (b.pos[i] != last || !b.logits[i]) continue;
      bool agrees = true;
      for (size_t j = 0; j < b.size(); ++j)
        if ((b.seqs[j] & b.seqs[i]) && b.pos[j] <= b.pos[i])
          agrees = agrees && b.tokens[j] == A[size_t(b.pos[j])];
      carries = agrees;
    }
    if (!carries) continue;
    if (!r->speculative) return Carrier::non_speculative;
    found = Carrier::speculative;
  }
  return found;
}

TEST(StrategyPipeInfer, PipeInferCancelsRunsBuiltOnARejectedToken) {
  // One-token micro-batches; the draft is wrong about the second token after the prompt, so
  // the second and third speculative runs are built on a token the target rejects.
  FakeHost h = make_host(greedy_oracle(kVocab, disagree_at(kTarget, {L + 1}, kVocab)), 16);
  h.start("pipeinfer", {{"max_micro_batch", 1}, {"max_runs", 4}, {"p_accept", 0}, {"p_recovery", 0}});
  draft_all(h);
  const auto spec = speculative_runs(h);
  ASSERT_EQ(spec.size(), 3u);  // with the prompt run: max_runs in flight
  const auto greedy = greedy_continuation(kPrompt, kTarget, 16);
  EXPECT_EQ(spec[0]->batch.tokens, std::vector<int32_t>{greedy[0]});
  EXPECT_NE(spec[1]->batch.tokens[0], greedy[1]);
  EXPECT_TRUE(h.events(EventKind::cancel).empty());

  h.settle_next(kTargetRole);  // the prompt: accepts greedy[0], which the first run carries
  EXPECT_TRUE(h.events(EventKind::cancel).empty());
  h.settle_next(kTargetRole);  // the first speculative run: greedy[1] rejects the second
  const auto cancels = h.events(EventKind::cancel, kTargetRole);
  ASSERT_EQ(cancels.size(), 1u);
  EXPECT_EQ(cancels[0].runs, (std::vector<uint64_t>{spec[1]->run, spec[2]->run}));
  // Acceptance counts the drafts that reached a verification: the cancelled runs' never do.
  EXPECT_EQ(h.metrics().drafted, 1);
  EXPECT_EQ(h.metrics().accepted, 1);
  EXPECT_EQ(h.metrics().verifications, 1);
  // The branch's sequence is freed right after the cancel, in order with the runs.
  const auto& ev = h.events();
  auto at = std::find_if(ev.begin(), ev.end(), [](const Event& e) { return e.kind == EventKind::cancel; });
  ASSERT_NE(at + 1, ev.end());
  EXPECT_EQ((at + 1)->kind, EventKind::kv_ops);
  EXPECT_EQ(seq_of(*spec[1]), seq_of(*spec[0]));
  EXPECT_EQ((at + 1)->ops, (std::vector<KvOp>{{KvOpKind::remove, seq_of(*spec[1]), -1, -1, -1}}));
  // The corrected token goes back in as a non-speculative run; a new branch borrows the
  // canonical cells, that token's included.
  ASSERT_NE(at + 2, ev.end());
  ASSERT_EQ((at + 2)->kind, EventKind::launch);
  const LaunchRecord& next = h.launch_of((at + 2)->run);
  EXPECT_FALSE(next.speculative);
  EXPECT_EQ(next.batch.tokens, std::vector<int32_t>{greedy[1]});
  EXPECT_EQ(next.batch.pos, std::vector<int32_t>{L + 1});
  auto borrow = std::find_if(at + 3, ev.end(), [](const Event& e) { return e.kind == EventKind::kv_ops && e.role == kTargetRole; });
  ASSERT_NE(borrow, ev.end());
  ASSERT_EQ(borrow->ops.size(), 1u);
  EXPECT_EQ(borrow->ops[0].kind, KvOpKind::copy);
  EXPECT_EQ(borrow->ops[0].seq, 0);
  EXPECT_EQ(borrow->ops[0].pos_end, L + 2);

  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy);
  EXPECT_TRUE(spec[1]->dropped && spec[2]->dropped);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategyPipeInfer, PipeInferWithoutCancelLetsInvalidRunsFinishAndWastes) {
  FakeHost h = make_host(greedy_oracle(kVocab, disagree_at(kTarget, {L + 1}, kVocab)), 16);
  h.start("pipeinfer", {{"max_micro_batch", 1}, {"max_runs", 4}, {"p_accept", 0}, {"p_recovery", 0}, {"cancel", 0}});
  draft_all(h);
  const auto spec = speculative_runs(h);
  ASSERT_EQ(spec.size(), 3u);
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 16));
  EXPECT_TRUE(cancels_while_generating(h).empty());
  EXPECT_TRUE(spec[1]->delivered && spec[2]->delivered);
  EXPECT_GE(h.metrics().runs_wasted, 2);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategyPipeInfer, PipeInferIgnoresCancelledRunsWhoseLogitsArriveAnyway) {
  FakeHost h = make_host(greedy_oracle(kVocab, disagree_at(kTarget, {L + 1, L + 6}, kVocab)), 16, true);
  h.start("pipeinfer", {{"max_micro_batch", 1}, {"max_runs", 4}, {"p_accept", 0}, {"p_recovery", 0}});
  h.run_to_end(FakeHost::prefer(kDraft));
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 16));
  int late = 0;
  for (const LaunchRecord* r : h.launches(kTargetRole)) late += r->cancelled && r->delivered;
  EXPECT_GE(late, 2);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategyPipeInfer, PipeInferLetsAValidSpeculativeRunCarryTheNewestToken) {
  // The first speculative run feeds the token the prompt run then yields, so no
  // non-speculative run is launched for it: the speculative run's logits are the next token.
  FakeHost h = make_host(greedy_oracle(kVocab, kTarget), 16);
  h.start("pipeinfer", {{"max_micro_batch", 1}, {"max_runs", 3}, {"p_accept", 0}, {"p_recovery", 0}});
  draft_all(h);
  h.settle_next(kTargetRole);
  EXPECT_EQ(newest_token_carrier(h), Carrier::speculative);
  const auto target = h.launches(kTargetRole);
  EXPECT_EQ(std::count_if(target.begin(), target.end(), [](auto* r) { return !r->speculative; }), 1)
      << "only the prompt ran non-speculatively";
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 16));
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategyPipeInfer, PipeInferWithoutPlainRunsLeavesTheCorrectedTokenToTheNextSpeculativeRun) {
  // As in PipeInferCancelsRunsBuiltOnARejectedToken, the draft is wrong about the second token
  // after the prompt; without plain runs the corrected token waits for the next micro-batch and
  // is its first row, with the cells of the tokens before it borrowed from sequence 0.
  FakeHost h = make_host(greedy_oracle(kVocab, disagree_at(kTarget, {L + 1}, kVocab)), 16);
  h.start("pipeinfer", {{"max_micro_batch", 2}, {"max_runs", 4}, {"p_accept", 0}, {"p_recovery", 0}, {"plain_runs", 0}});
  draft_all(h);
  const auto greedy = greedy_continuation(kPrompt, kTarget, 16);
  h.settle_next(kTargetRole);  // the prompt
  h.settle_next(kTargetRole);  // the first micro-batch: greedy[1] rejects its second token
  const size_t launched = h.launches(kTargetRole).size();
  EXPECT_EQ(newest_token_carrier(h), Carrier::none);
  draft_all(h);
  const auto target = h.launches(kTargetRole);
  ASSERT_GT(target.size(), launched);
  const LaunchRecord& next = *target[launched];
  EXPECT_TRUE(next.speculative);
  ASSERT_EQ(next.batch.size(), 2u);  // the corrected token and one drafted after it
  EXPECT_EQ(next.batch.tokens[0], greedy[1]);
  EXPECT_EQ(next.batch.pos[0], L + 1);
  EXPECT_EQ(next.batch.tokens[1], greedy[2]);
  EXPECT_EQ(newest_token_carrier(h), Carrier::speculative);
  // Only the prompt ran non-speculatively.
  EXPECT_EQ(std::count_if(target.begin(), target.end(), [](auto* r) { return !r->speculative; }), 1);
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

// The speculative micro-batches launched in one burst, before any target result.
std::vector<size_t> first_burst(float confidence, const std::map<std::string, ParamValue>& params) {
  FakeHost h = make_host(greedy_oracle(kVocab, kTarget, confidence), 40);
  h.start("pipeinfer", params);
  draft_all(h);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
  return sizes(speculative_runs(h));
}

TEST(StrategyPipeInfer, PipeInferCutoffRisesByPRecoveryPerRunInABurst) {
  // Confidence 0.65 against cutoffs 0.5, 0.6, 0.7, 0.8: full micro-batches until the cutoff
  // passes it, then the one token launched regardless.
  std::map<std::string, ParamValue> p = {{"max_micro_batch", 4}, {"max_runs", 5}, {"p_accept", 0.5},
                                     {"p_recovery", 0.1}, {"p_decay", 0}};
  EXPECT_EQ(first_burst(0.65f, p), (std::vector<size_t>{4, 4, 1, 1}));
  p["p_recovery"] = 0;
  EXPECT_EQ(first_burst(0.65f, p), (std::vector<size_t>{4, 4, 4, 4}));
}

TEST(StrategyPipeInfer, PipeInferCutoffRecoveryResetsOnATargetResult) {
  FakeHost h = make_host(greedy_oracle(kVocab, kTarget, 0.65f), 40);
  h.start("pipeinfer", {{"max_micro_batch", 4}, {"max_runs", 5}, {"p_accept", 0.5}, {"p_recovery", 0.1}, {"p_decay", 0}});
  draft_all(h);
  ASSERT_EQ(sizes(speculative_runs(h)), (std::vector<size_t>{4, 4, 1, 1}));
  h.settle_next(kTargetRole);
  draft_all(h);
  EXPECT_EQ(sizes(speculative_runs(h)), (std::vector<size_t>{4, 4, 1, 1, 4}));
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategyPipeInfer, PipeInferCutoffDecaysWhenSpeculationWouldYieldNothing) {
  // Confidence 0.35 never clears 0.5: the first run carries one token anyway and lowers the
  // cutoff to 0.4, the second lowers it to 0.3, which 0.35 clears from then on.
  std::map<std::string, ParamValue> p = {{"max_micro_batch", 4}, {"max_runs", 5}, {"p_accept", 0.5},
                                     {"p_recovery", 0}, {"p_decay", 0.1}};
  EXPECT_EQ(first_burst(0.35f, p), (std::vector<size_t>{1, 4, 4, 4}));
  p["p_decay"] = 0;
  EXPECT_EQ(first_burst(0.35f, p), (std::vector<size_t>{1, 1, 1, 1}));
}

TEST(StrategyPipeInfer, PipeInferCutoffDecayEndsWhenTheTargetAcceptsADraftTokenWithDecayReset) {
  // As above, the cutoff falls 0.5 -> 0.4 -> 0.3 over the first burst. The first speculative
  // run's token is right: with decay_reset the cutoff is back at 0.5, so the next run carries
  // one token again (and the cutoff falls anew); without it the cutoff stays at 0.3 and the
  // next run is a full micro-batch.
  for (bool reset : {true, false}) {
    SCOPED_TRACE(reset ? "decay_reset" : "no decay_reset");
    FakeHost h = make_host(greedy_oracle(kVocab, kTarget, 0.35f), 40);
    h.start("pipeinfer", {{"max_micro_batch", 4}, {"max_runs", 5}, {"p_accept", 0.5}, {"p_recovery", 0}, {"p_decay", 0.1},
                          {"decay_reset", reset}});
    draft_all(h);
    ASSERT_EQ(sizes(speculative_runs(h)), (std::vector<size_t>{1, 4, 4, 4}));
    h.settle_next(kTargetRole);  // the prompt's run: no draft token in it
    draft_all(h);
    ASSERT_EQ(sizes(speculative_runs(h)), (std::vector<size_t>{1, 4, 4, 4, 4}));
    h.settle_next(kTargetRole);  // the first speculative run: its draft token is accepted
    draft_all(h);
    EXPECT_EQ(sizes(speculative_runs(h)), (std::vector<size_t>{1, 4, 4, 4, 4, reset ? 1u : 4u}));
    h.run_to_end(FakeHost::oldest_first());
    EXPECT_EQ(h.generated(), greedy_continuation(kPrompt, kTarget, 40));
    EXPECT_TRUE(h.errors().empty()) << h.errors().front();
  }
}

TEST(StrategyPipeInfer, PipeInferLaunchesMicroBatchesOfMaxMicroBatchTokens) {
  for (int mb = 1; mb <= 4; ++mb) {
    SCOPED_TRACE("max_micro_batch " + std::to_string(mb));
    FakeHost h = make_host(greedy_oracle(kVocab, kTarget), 24);
    h.start("pipeinfer", {{"max_micro_batch", mb}, {"max_runs", 4}, {"p_recovery", 0}});
    draft_all(h);
    const auto spec = speculative_runs(h);
    ASSERT_EQ(spec.size(), 3u);
    const auto greedy = greedy_continuation(kPrompt, kTarget, 24);
    std::vector<int> seqs;
    int32_t next_pos = L;
    for (const LaunchRecord* r : spec) {
      const Batch& b = r->batch;
      ASSERT_EQ(b.size(), size_t(mb));
      for (size_t i = 0; i < b.size(); ++i) {
        EXPECT_EQ(b.pos[i], next_pos);
        EXPECT_EQ(b.tokens[i], greedy[size_t(next_pos - L)]);
        EXPECT_EQ(b.seqs[i], b.seqs[0]);
        EXPECT_TRUE(b.logits[i]);
        ++next_pos;
      }
      EXPECT_EQ(std::popcount(b.seqs[0]), 1);
      seqs.push_back(seq_of(*r));
    }
    // One branch: every run in its sequence, never the canonical one.
    EXPECT_EQ(std::count(seqs.begin(), seqs.end(), seqs.front()), int(seqs.size()));
    EXPECT_GT(seqs.front(), 0);
    h.run_to_end(FakeHost::oldest_first());
    EXPECT_EQ(h.generated(), greedy);
    EXPECT_TRUE(cancels_while_generating(h).empty()) << "a perfect draft invalidates nothing";
    EXPECT_TRUE(h.errors().empty()) << h.errors().front();
  }
}

// A draft whose top token is `top(seen)` with probability p_top and whose runner-up is the
// target's token (or the one after the top when they agree) with probability p_second.
Oracle two_peaks(NextToken top, float p_top, float p_second, std::vector<int32_t> at = {}) {
  return [=](const std::vector<int32_t>& seen) {
    const int32_t t = top(seen), want = kTarget(seen);
    const int32_t second = want != t ? want : (t + 1) % kVocab;
    const bool here = at.empty() || std::find(at.begin(), at.end(), int32_t(seen.size())) != at.end();
    const double p2 = here ? p_second : 0.0, rest = (1.0 - p_top - p2) / (kVocab - (here ? 2 : 1));
    std::vector<float> l(size_t(kVocab), float(std::log(rest)));
    l[size_t(t)] = float(std::log(p_top));
    if (here) l[size_t(second)] = float(std::log(p2));
    return l;
  };
}

const std::map<std::string, ParamValue> kTreeParams = {
    {"max_micro_batch", 4}, {"max_runs", 4}, {"p_accept", 0.5}, {"p_recovery", 0}, {"n_parallel", 2}, {"p_split", 0.3}};

// The sequences a run's rows use, together.
SeqSet seqs_of(const Batch& b) {
  SeqSet s = 0;
  for (SeqSet x : b.seqs) s |= x;
  return s;
}

TEST(StrategyPipeInfer, PipeInferSplitsWhenTheRunnerUpClearsPSplit) {
  // The runner-up reaches 0.4 only for the second token after the prompt.
  for (float p_split : {0.3f, 0.45f}) {
    SCOPED_TRACE("p_split " + std::to_string(p_split));
    FakeHost h = make_host(two_peaks(kTarget, 0.55f, 0.4f, {L + 1}), 16);
    auto params = kTreeParams;
    params["p_split"] = p_split;
    h.start("pipeinfer", params);
    draft_all(h);
    const auto spec = speculative_runs(h);
    ASSERT_FALSE(spec.empty());
    const Batch& b = spec[0]->batch;
    const auto greedy = greedy_continuation(kPrompt, kTarget, 16);
    EXPECT_FALSE(b.is_tree()) << "branches are told apart by their sequences";
    if (p_split > 0.4f) {
      // No split: one branch, four tokens.
      EXPECT_EQ(b.size(), 4u);
      EXPECT_EQ(std::popcount(seqs_of(b)), 1);
      continue;
    }
    // The main branch's four tokens, then the new branch's: the runner-up at depth 1 and the
    // draft's continuation of it; the first token, common to both, is one row in both sequences.
    std::vector<int32_t> alt_path = kPrompt;
    alt_path.push_back(greedy[0]);
    alt_path.push_back((greedy[1] + 1) % kVocab);
    const int32_t c2 = kTarget(alt_path);
    alt_path.push_back(c2);
    const int32_t c3 = kTarget(alt_path);
    EXPECT_EQ(b.tokens, (std::vector<int32_t>{greedy[0], greedy[1], greedy[2], greedy[3], (greedy[1] + 1) % kVocab, c2, c3}));
    EXPECT_EQ(b.pos, (std::vector<int32_t>{L, L + 1, L + 2, L + 3, L + 1, L + 2, L + 3}));
    const SeqSet main = b.seqs[1], alt = b.seqs[4];
    EXPECT_EQ(std::popcount(main), 1);
    EXPECT_EQ(std::popcount(alt), 1);
    EXPECT_NE(main, alt);
    EXPECT_EQ(b.seqs[0], main | alt);
    for (size_t i : {2u, 3u}) EXPECT_EQ(b.seqs[i], main);
    for (size_t i : {5u, 6u}) EXPECT_EQ(b.seqs[i], alt);
    EXPECT_EQ((main | alt) & seq_bit(0), 0u);
    // Later runs continue both branches, each in its own sequence.
    ASSERT_GE(spec.size(), 2u);
    EXPECT_EQ(seqs_of(spec[1]->batch), main | alt);
    h.run_to_end(FakeHost::oldest_first());
    EXPECT_EQ(h.generated(), greedy);
    EXPECT_TRUE(h.errors().empty()) << h.errors().front();
  }
}

TEST(StrategyPipeInfer, PipeInferGoesOnAlongTheBranchTheTargetTakesWithoutDrainingThePipeline) {
  // The draft's top token is wrong at the second position, its runner-up right: the branch
  // that starts there wins, and since every run also carries its continuation, the target
  // goes on with the runs already in flight: no run is cancelled and none restarts from the
  // accepted tokens.
  FakeHost h = make_host(two_peaks(disagree_at(kTarget, {L + 1}, kVocab), 0.55f, 0.4f, {L + 1}), 16);
  auto params = kTreeParams;
  params["max_micro_batch"] = 3;
  h.start("pipeinfer", params);
  draft_all(h);
  const auto spec = speculative_runs(h);
  // Two runs: with both branches' rows they hold max_runs * max_micro_batch target tokens in
  // flight (with the prompt's run), all a chain would.
  ASSERT_EQ(spec.size(), 2u);
  size_t in_flight = 1;
  for (const LaunchRecord* r : spec) in_flight += r->batch.size();
  EXPECT_GE(in_flight, size_t(4 * 3));
  const auto greedy = greedy_continuation(kPrompt, kTarget, 16);
  const Batch& first = spec[0]->batch;
  EXPECT_EQ(first.tokens[3], greedy[1]);  // the runner-up, on its own branch
  EXPECT_EQ(first.tokens[4], greedy[2]);
  const int main_seq = std::countr_zero(first.seqs[1]), alt_seq = std::countr_zero(first.seqs[3]);
  EXPECT_NE(first.tokens[1], greedy[1]);
  for (const LaunchRecord* r : spec) EXPECT_EQ(seqs_of(r->batch), seq_bit(main_seq) | seq_bit(alt_seq));

  h.settle_next(kTargetRole);  // the prompt: accepts greedy[0]
  const size_t before = h.events().size();
  h.settle_next(kTargetRole);  // greedy[1] by the common first row, then greedy[2] and greedy[3] along the branch
  EXPECT_EQ(h.generated(), (std::vector<int32_t>{greedy[0], greedy[1], greedy[2], greedy[3]}));
  bool copied = false, removed = false, relaunched = false;
  for (size_t i = before; i < h.events().size(); ++i) {
    const Event& e = h.events()[i];
    relaunched = relaunched || (e.kind == EventKind::launch && e.role == kTargetRole && !h.launch_of(e.run).speculative);
    for (const KvOp& op : e.ops) {
      copied = copied || op == KvOp{KvOpKind::copy, alt_seq, 0, L, L + 3};  // the branch's cells become canonical
      removed = removed || op == KvOp{KvOpKind::remove, main_seq, -1, -1, -1};  // the losing branch is freed
    }
  }
  EXPECT_TRUE(copied);
  EXPECT_TRUE(removed);
  EXPECT_FALSE(relaunched) << "the winning branch's next token was already in flight";
  EXPECT_TRUE(h.events(EventKind::cancel, kTargetRole).empty());

  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategyPipeInfer, PipeInferGivesALaunchedAlternativeUpForALikelierOneAndNeverUsesItsRows) {
  // The draft is wrong about the second token and barely doubts it (runner-up, the target's
  // token, at 0.15); it doubts the third more (0.4). With room for one alternative, the first
  // run carries the weak one; the second round gives it up for the stronger one. When the
  // target then takes the given-up branch's token, that branch's rows (right, but their
  // sequence freed) must not be used: the token goes back in as a non-speculative run.
  const Oracle draft = [](const std::vector<int32_t>& seen) {
    const bool weak = seen.size() == size_t(L + 1), strong = seen.size() == size_t(L + 2);
    const int32_t want = kTarget(seen), top = weak ? (want + 1) % kVocab : want;
    const int32_t second = weak ? want : (top + 1) % kVocab;
    const double p2 = weak ? 0.15 : strong ? 0.4 : 0.0, rest = (1.0 - 0.55 - p2) / (kVocab - 2);
    std::vector<float> l(size_t(kVocab), float(std::log(rest)));
    l[size_t(top)] = float(std::log(0.55));
    if (p2 > 0) l[size_t(second)] = float(std::log(p2));
    return l;
  };
  FakeHost h = make_host(draft, 16);
  h.start("pipeinfer", {{"max_micro_batch", 2}, {"max_runs", 3}, {"p_accept", 0.5}, {"p_recovery", 0}, {"n_parallel", 2},
                        {"p_split", 0.1}});
  draft_all(h);
  const auto spec = speculative_runs(h);
  ASSERT_EQ(spec.size(), 2u);
  const auto greedy = greedy_continuation(kPrompt, kTarget, 16);
  const Batch& first = spec[0]->batch;
  ASSERT_EQ(first.size(), 3u);
  EXPECT_EQ(first.tokens[2], greedy[1]);  // the weak alternative, right
  EXPECT_EQ(first.pos[2], L + 1);
  const int weak_seq = std::countr_zero(first.seqs[2]);
  EXPECT_EQ(seqs_of(spec[1]->batch) & seq_bit(weak_seq), 0u) << "the second run no longer extends it";
  bool freed = false;
  for (const Event& e : h.events(EventKind::kv_ops, kTargetRole))
    for (const KvOp& op : e.ops) freed = freed || op == KvOp{KvOpKind::remove, weak_seq, -1, -1, -1};
  EXPECT_TRUE(freed);

  h.settle_next(kTargetRole);  // the prompt
  h.settle_next(kTargetRole);  // the first run: greedy[1] from its first row, and no further
  EXPECT_EQ(h.generated(), (std::vector<int32_t>{greedy[0], greedy[1]}));
  const auto target = h.launches(kTargetRole);
  ASSERT_FALSE(target.back()->speculative);
  EXPECT_EQ(target.back()->batch.tokens, std::vector<int32_t>{greedy[1]});
  h.run_to_end(FakeHost::oldest_first());
  EXPECT_EQ(h.generated(), greedy);
  EXPECT_TRUE(h.errors().empty()) << h.errors().front();
}

TEST(StrategyPipeInfer, PipeInferMatchesGreedyAndKeepsItsInvariantsInAnyDeliveryOrder) {
  const int n = 40;
  const auto greedy = greedy_continuation(kPrompt, kTarget, n);
  std::mt19937 rng(11);
  int trees = 0;
  for (int trial = 0; trial < 160; ++trial) {
    std::vector<int32_t> wrong;
    for (int32_t p = L; p < L + n + 8; ++p)
      if (rng() % 4 == 0) wrong.push_back(p);
    const bool cancel = trial % 2 == 0, too_late = trial % 4 == 1 || trial % 4 == 2;
    const int mb = 1 + int(rng() % 4), max_runs = 1 + int(rng() % 8);
    const float conf = 0.35f + 0.1f * float(rng() % 7);
    // A third of the trials speculate with chains, the rest with trees of 2-3 branches whose
    // runner-up (the target's token where the top one is wrong) often clears p_split.
    const int n_parallel = 1 + trial % 3;
    const float p_split = 0.05f * float(rng() % 4);
    // Half the trials in adaptive mode, whose micro-batch and cutoff follow the (real-clock)
    // latencies of this host: whatever it chooses, the invariants hold.
    const bool adaptive = trial % 8 >= 4;
    // Half the trials (16 of every 32) leave a corrected token to the next speculative run.
    const bool plain_runs = trial % 32 < 16;
    SCOPED_TRACE("trial " + std::to_string(trial) + ": cancel " + std::to_string(cancel) + ", too late " +
                 std::to_string(too_late) + ", max_micro_batch " + std::to_string(mb) + ", max_runs " +
                 std::to_string(max_runs) + ", n_parallel " + std::to_string(n_parallel) + ", adaptive " +
                 std::to_string(adaptive) + ", plain runs " + std::to_string(plain_runs));
    const NextToken top = disagree_at(kTarget, wrong, kVocab);
    FakeHost h = make_host(n_parallel == 1 ? greedy_oracle(kVocab, top, conf) : two_peaks(top, conf, 0.8f * (1 - conf)), n,
                           too_late);
    // From a draft as fast as the target (it never finishes a micro-batch before the chain
    // moves) to one that always answers first.
    const FakeHost::Pick pick = trial % 5 == 0   ? FakeHost::oldest_first()
                                : trial % 5 == 1 ? FakeHost::prefer(kDraft)
                                : trial % 5 == 2 ? FakeHost::shuffled(rng())
                                                 : FakeHost::favour(kDraft, trial % 5 == 3 ? 0.8 : 0.95, rng());
    h.start("pipeinfer", {{"max_micro_batch", mb}, {"max_runs", max_runs}, {"cancel", cancel}, {"n_parallel", n_parallel},
                          {"p_split", p_split}, {"adaptive", adaptive}, {"plain_runs", plain_runs}});
    bool ok = true;
    h.run_to_end(pick, [&] {
      if (!ok || h.done()) return;
      // Without plain runs the newest token may wait for the draft run in flight (the round
      // whose micro-batch will carry it), and only for that.
      ok = newest_token_carrier(h) != Carrier::none || (!plain_runs && in_flight(h, kDraft) > 0);
      EXPECT_TRUE(ok) << "nothing in flight feeds the newest accepted token";
      EXPECT_LE(in_flight(h, kTargetRole), max_runs);
      if (!cancel) return;
      for (const LaunchRecord* r : h.launches(kTargetRole))
        if (r->in_flight() && r->speculative)
          EXPECT_GE(*std::max_element(r->batch.pos.begin(), r->batch.pos.end()) + 1, int32_t(h.tokens().size()))
              << "superfluous run " << r->run;
    });
    ASSERT_EQ(h.generated(), greedy);
    ASSERT_TRUE(h.errors().empty()) << h.errors().front();
    if (!cancel) ASSERT_TRUE(cancels_while_generating(h).empty());
    for (const LaunchRecord* r : h.launches(kTargetRole)) trees += std::popcount(seqs_of(r->batch)) > 1;
    // Draft work survives changes of the accepted tokens: an answer the draft computed for a
    // branch that lives on is used, never computed again. Computing it again starts by
    // removing the branch's last draft cell (to feed its token once more).
    int refed = 0;
    for (const Event& e : h.events(EventKind::kv_ops, kDraft))
      for (const KvOp& op : e.ops) refed += op.kind == KvOpKind::remove && op.pos_begin >= 0;
    EXPECT_EQ(refed, 0) << "draft answers computed twice";
  }
  EXPECT_GT(trees, 100) << "the trials must exercise runs with several branches";
}

}  // namespace

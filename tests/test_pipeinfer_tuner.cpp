// PipeInfer's adaptive mode: the tuner's choices on scripted measurements.
#include <gtest/gtest.h>

#include "specmesh/speculation/pipeinfer_tuner.hpp"

namespace specmesh {
namespace {

// Target runs of a + b * rows seconds with `runs` in flight, draft steps of `d` seconds, and
// verdicts with the given acceptance, rows of 1 to 16 so the fit sees the slope.
void feed(PipeInferTuner& t, double a, double b, int runs, double d, double accept_rate, int n = 200) {
  for (int i = 0; i < n; ++i) {
    const int rows = 1 + i % 16;
    t.target_run(rows, a + b * rows, runs);
    t.draft_step(d);
    t.verdict(0.9f, double(i % 100) < 100 * accept_rate);
  }
}

// The k in 1..16 with the most expected tokens per unit of cost, from the tuner's own model.
int best_k(const PipeInferTuner& t) {
  int best = 1;
  for (int k = 2; k <= 16; ++k)
    if (t.expected_tokens(k) / t.cost(k) > t.expected_tokens(best) / t.cost(best) * (1 + 1e-9)) best = k;
  return best;
}

TEST(PipeInferTuner, StaticValuesHoldUntilItHasMeasured) {
  PipeInferTuner t(16, 4, 0.4f);
  EXPECT_EQ(t.micro_batch(), 4);
  EXPECT_FLOAT_EQ(t.cutoff(), 0.4f);
  t.target_run(4, 0.02, 4);  // one target run and no draft step: nothing to go on yet
  t.verdict(0.9f, true);
  EXPECT_EQ(t.micro_batch(), 4);
  EXPECT_FLOAT_EQ(t.cutoff(), 0.4f);
}

TEST(PipeInferTuner, ExpectedTokensCountARowOnceEveryTokenBeforeItWasAccepted) {
  PipeInferTuner t(16, 4, 0.4f);
  for (int i = 0; i < 400; ++i) t.verdict(0.9f, i % 2 == 0);  // alpha -> 1/2
  EXPECT_NEAR(t.alpha(), 0.5, 0.02);
  EXPECT_NEAR(t.expected_tokens(1), t.alpha(), 1e-12);
  EXPECT_NEAR(t.expected_tokens(3), t.alpha() + t.alpha() * t.alpha() + t.alpha() * t.alpha() * t.alpha(), 1e-12);
}

TEST(PipeInferTuner, AFastDraftOnACheapPerRowTargetGetsLongMicroBatches) {
  // A run costs 24 ms plus 0.3 ms per row over 4 runs in flight; the draft 0.2 ms a token.
  PipeInferTuner t(16, 4, 0.4f);
  feed(t, 0.024, 0.0003, 4, 0.0002, 0.9);
  EXPECT_NEAR(t.cost(1), (0.024 + 0.0003) / 4, 1e-6);
  EXPECT_EQ(t.micro_batch(), best_k(t));
  EXPECT_GT(t.micro_batch(), 4);
}

TEST(PipeInferTuner, ExpensiveRowsAndPoorAcceptanceGetShortMicroBatches) {
  // Each row costs as much as the run's fixed part, and half the tokens are rejected: the
  // target is the bottleneck and long runs waste it.
  PipeInferTuner t(16, 4, 0.4f);
  feed(t, 0.004, 0.004, 1, 0.0001, 0.5);
  EXPECT_EQ(t.micro_batch(), best_k(t));
  EXPECT_LT(t.micro_batch(), 4);
}

TEST(PipeInferTuner, ASlowDraftKeepsTheStaticMicroBatchAsTheFloor) {
  // The draft takes 10 ms a token against a target share of 6 ms a run: the draft is the
  // bottleneck at every k, where its model would pick 1.
  PipeInferTuner t(16, 4, 0.4f);
  feed(t, 0.024, 0.0001, 4, 0.010, 0.9);
  EXPECT_EQ(best_k(t), 1);
  EXPECT_EQ(t.micro_batch(), 4);
}

TEST(PipeInferTuner, TheCutoffRisesAboveConfidencesTheTargetRejects) {
  PipeInferTuner t(16, 4, 0.4f);
  feed(t, 0.024, 0.0003, 4, 0.0002, 0.9, 50);
  // Tokens the draft gives 0.2 to 0.5 are rejected, those at 0.9 accepted.
  for (int i = 0; i < 100; ++i) {
    t.verdict(0.25f + 0.1f * float(i % 3), false);
    t.verdict(0.95f, true);
  }
  EXPECT_GE(t.cutoff(), 0.5f);
  EXPECT_LE(t.cutoff(), 0.9f);
  // The text changes: the draft is right at every confidence now. The old verdicts fade and
  // the cutoff falls to 0.
  for (int i = 0; i < 400; ++i) t.verdict(0.05f + 0.1f * float(i % 10), true);
  EXPECT_FLOAT_EQ(t.cutoff(), 0.0f);
}

}  // namespace
}  // namespace specmesh

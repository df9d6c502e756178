// PipeInfer's adaptive mode (beyond the paper): the micro-batch size and the base confidence
// cutoff chosen online from what the head measures, instead of fixed parameters.
//
// Measured, each with exponential forgetting so that the choice follows the text:
//   - alpha: the share of drafted tokens the target accepted, among those it tested (every
//     token before them on their path accepted);
//   - per confidence bin (tenths of the draft's top probability), the same share;
//   - a target run's latency from launch to logits, fitted as a + b * rows;
//   - a draft step's latency (the draft proposes one token per step per branch).
// The model: k drafted tokens in a run yield E(k) = alpha + ... + alpha^k tokens on average
// (a row counts once every token before it was accepted), and cost the pipeline
// c(k) = max(L(k) / runs in flight, k * draft step): with the runs in flight, a new run can
// start once a run's share of the target's time has passed and the draft has proposed its
// tokens. The micro-batch is the k in 1..max_k with the most tokens per unit of cost; where
// the draft's term is the larger, not below the static micro-batch (see choose()).
// The cutoff: a token whose confidence bin is accepted less often than the marginal row of
// that best k pays for itself (c(k + 1) - c(k) of cost for the tokens per cost the best k
// gives) is not drafted; the strategy's recovery and decay still move around that base.
// Until both latencies and a few verdicts have been measured, the static parameters hold.
#pragma once

#include <array>

namespace specmesh {

class PipeInferTuner {
 public:
  // max_k: the largest micro-batch it may choose; the static values hold until it has data,
  // and static_k stays the floor where the draft is the bottleneck.
  PipeInferTuner(int max_k, int static_k, float static_cutoff);

  // A target run of `rows` rows came back `seconds` after its launch, with `in_flight` runs
  // (itself included) in flight when it was launched.
  void target_run(int rows, double seconds, int in_flight);
  // A draft step (one proposed token per branch) took `seconds`.
  void draft_step(double seconds);
  // The target tested a drafted token the draft gave confidence `conf` (every token before it
  // on its path was accepted): `accepted`, whether it took it.
  void verdict(float conf, bool accepted);

  int micro_batch() const { return k_; }
  float cutoff() const { return cutoff_; }
  double alpha() const { return alpha_; }

  // E(k) and c(k) as above, and c's two terms, for the tests and the choice.
  double expected_tokens(int k) const;
  double cost(int k) const;
  double target_share(int k) const;
  double draft_time(int k) const;

 private:
  void choose();

  int max_k_, static_k_, k_;
  float cutoff_;
  // Acceptance: overall and per tenth of confidence, as decayed counts.
  double alpha_, accepted_ = 0, verdicts_ = 0;
  std::array<double, 10> bin_acc_{}, bin_n_{};
  // Least squares of latency on rows with forgetting: sums of 1, k, k^2, t, k t; the fitted
  // a and b; and the sum of runs in flight.
  double s1_ = 0, sk_ = 0, skk_ = 0, st_ = 0, skt_ = 0, runs_ = 0, a_ = 0, b_ = 0;
  double draft_s_ = 0, draft_n_ = 0;
};

}  // namespace specmesh

#include "specmesh/speculation/pipeinfer_tuner.hpp"

#include <algorithm>
#include <cmath>

namespace specmesh {

namespace {

// Each new sample weighs 1 against the decayed sum of the ones before: about the last 50
// samples count.
constexpr double kKeep = 0.98;
// Acceptance starts from a prior of kPriorVerdicts verdicts at kPriorAlpha, so that the
// micro-batch can follow the first latencies; the cutoff waits for kMinVerdicts real
// verdicts, and a confidence bin for kMinBin.
constexpr double kPriorAlpha = 0.8, kPriorVerdicts = 4, kMinVerdicts = 8, kMinBin = 3;

}  // namespace

PipeInferTuner::PipeInferTuner(int max_k, int static_k, float static_cutoff)
    : max_k_(std::max(1, max_k)), static_k_(std::clamp(static_k, 1, max_k_)), k_(static_k_), cutoff_(static_cutoff),
      alpha_(kPriorAlpha) {}

void PipeInferTuner::target_run(int rows, double seconds, int in_flight) {
  const double k = rows;
  s1_ = kKeep * s1_ + 1;
  sk_ = kKeep * sk_ + k;
  skk_ = kKeep * skk_ + k * k;
  st_ = kKeep * st_ + seconds;
  skt_ = kKeep * skt_ + k * seconds;
  runs_ = kKeep * runs_ + std::max(1, in_flight);
  // The fit, once per sample (choose() reads it for every k): latency a + b k by least squares;
  // with one row count seen so far, a flat a.
  const double det = s1_ * skk_ - sk_ * sk_;
  b_ = 0;
  a_ = st_ / s1_;
  if (det > 1e-9 * s1_ * skk_) {
    b_ = std::max(0.0, (s1_ * skt_ - sk_ * st_) / det);
    a_ = (st_ - b_ * sk_) / s1_;
  }
  choose();
}

void PipeInferTuner::draft_step(double seconds) {
  draft_s_ = kKeep * draft_s_ + seconds;
  draft_n_ = kKeep * draft_n_ + 1;
  choose();
}

void PipeInferTuner::verdict(float conf, bool accepted) {
  accepted_ = kKeep * accepted_ + (accepted ? 1 : 0);
  verdicts_ = kKeep * verdicts_ + 1;
  alpha_ = (accepted_ + kPriorAlpha * kPriorVerdicts) / (verdicts_ + kPriorVerdicts);
  const size_t bin = size_t(std::clamp(int(conf * 10), 0, 9));
  for (size_t b = 0; b < bin_n_.size(); ++b) {
    bin_acc_[b] *= kKeep;
    bin_n_[b] *= kKeep;
  }
  bin_acc_[bin] += accepted ? 1 : 0;
  bin_n_[bin] += 1;
  choose();
}

double PipeInferTuner::expected_tokens(int k) const {
  double e = 0, p = 1;
  for (int i = 0; i < k; ++i) e += (p *= alpha_);
  return e;
}

double PipeInferTuner::target_share(int k) const { return std::max(0.0, a_ + b_ * k) / (runs_ / s1_); }

double PipeInferTuner::draft_time(int k) const { return k * draft_s_ / draft_n_; }

double PipeInferTuner::cost(int k) const { return std::max(target_share(k), draft_time(k)); }

void PipeInferTuner::choose() {
  if (s1_ < 2 || draft_n_ < 2) return;
  int best = 1;
  double best_rate = 0;
  for (int k = 1; k <= max_k_; ++k) {
    const double c = cost(k);
    if (c <= 0) return;
    const double rate = expected_tokens(k) / c;
    if (rate > best_rate * (1 + 1e-9)) best = k, best_rate = rate;
  }
  // Where the draft is the bottleneck, its tokens are accepted at the same rate whatever the
  // micro-batch (a run launched sooner only moves the wait to the target), and a smaller one
  // spends more target runs and per-run costs: the static value is the floor there.
  k_ = draft_time(best) > target_share(best) ? std::max(best, static_k_) : best;
  // The marginal row of the best k: worth drafting when its token is accepted at least this
  // often (it adds c(k + 1) - c(k) of cost, which at the best rate buys that many tokens).
  if (verdicts_ < kMinVerdicts) return;
  const double q_min = std::clamp((cost(best + 1) - cost(best)) * best_rate, 0.0, 0.95);
  float cut = 0;
  for (size_t b = 0; b < bin_n_.size(); ++b)
    if (bin_n_[b] >= kMinBin && bin_acc_[b] / bin_n_[b] < q_min) cut = float(b + 1) / 10;
  cutoff_ = std::min(cut, 0.95f);
}

}  // namespace specmesh

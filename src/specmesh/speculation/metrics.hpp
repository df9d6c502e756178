// What a speculative generation run measured: latency, throughput, acceptance and how much
// speculative work was launched, cancelled or thrown away. One row of a benchmark table.
#pragma once

#include <chrono>
#include <cstdint>
#include <optional>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

#include "specmesh/generation.hpp"

namespace specmesh {

// The public Metrics with their JSON and CSV forms (the columns are part of the output format).
struct SpecMetrics : Metrics {
  SpecMetrics() = default;
  SpecMetrics(const Metrics& m) : Metrics(m) {}

  // One verification accepted `depth` draft tokens. Strategies count `drafted` with it: the
  // draft tokens that reached that verification (a cancelled run's never do).
  void verified(int64_t depth) {
    ++verifications;
    accepted += depth;
    if (depth > max_accepted_depth) max_accepted_depth = depth;
    if (depth >= 0) {
      if (accepted_hist.size() <= size_t(depth)) accepted_hist.resize(size_t(depth) + 1, 0);
      ++accepted_hist[size_t(depth)];
    }
  }

  // Every field above plus the derived ratios, under the CSV column names.
  nlohmann::json to_json() const;

  // The CSV columns in their fixed order, and this run's values in that order.
  static const std::vector<std::string>& csv_columns();
  std::vector<std::string> csv_values() const;
  // Appends one row to path, writing the header first when the file is new or empty. Throws
  // std::runtime_error naming path when it cannot be written or already starts with a
  // different header (its columns would not line up).
  void append_csv(const std::string& path) const;
};

// nlohmann's conversion hook, so `nlohmann::json j = metrics;` works.
void to_json(nlohmann::json& j, const Metrics& m);

// Timestamps generated tokens as they become accepted (steady_clock) and turns them into the
// latency fields. Tokens accepted by one verification share its timestamp.
class TokenRecorder {
 public:
  using Clock = std::chrono::steady_clock;

  explicit TokenRecorder(Clock::time_point start = Clock::now()) : start_(start) {}

  // Forgets the tokens and starts timing again (e.g. when the request really begins).
  void restart(Clock::time_point start = Clock::now());
  // n tokens became accepted at t. Throws std::invalid_argument when t is before the start or
  // before the previous tokens, or n is negative.
  void accept(int n = 1, Clock::time_point t = Clock::now());
  // The prompt's logits reached the head at t (the end of prompt processing); only the first
  // call counts (a failover processes the prompt again).
  void prompt_processed(Clock::time_point t = Clock::now());

  int64_t tokens() const { return int64_t(times_.size()); }
  const std::vector<Clock::time_point>& times() const { return times_; }
  Clock::time_point start() const { return start_; }

  // Sets generated_tokens, ttft_ms, prefill_ms, ttft_after_prefill_ms, the inter-token
  // latencies (mean, p50, p99) and decode_tokens_per_s of m: the one definition every
  // strategy's figures go through. With fewer than two tokens the inter-token fields are 0,
  // as is the rate when all tokens arrived at once.
  void fill(SpecMetrics& m) const;

 private:
  Clock::time_point start_;
  std::vector<Clock::time_point> times_;
  std::optional<Clock::time_point> prefill_end_;
};

}  // namespace specmesh

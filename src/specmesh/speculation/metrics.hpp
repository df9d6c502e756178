// What a speculative generation run measured: latency, throughput, acceptance and how much
// speculative work was launched, cancelled or thrown away. One row of a benchmark table.
#pragma once

#include <chrono>
#include <cstdint>
#include <string>
#include <vector>

#include <nlohmann/json_fwd.hpp>

namespace specmesh {

struct SpecMetrics {
  std::string strategy;      // e.g. "autoregressive", "chain", "tree"
  std::string target;        // target model name (CSV / JSON column target_model)
  std::string draft;         // draft model name, empty without one (column draft_model)
  int64_t prompt_tokens = 0;
  int64_t generated_tokens = 0;
  double ttft_ms = 0;              // start to the first generated token
  double mean_itl_ms = 0;          // mean gap between consecutive generated tokens after the first
  double decode_tokens_per_s = 0;  // generated tokens after the first, per second
  int64_t drafted = 0;             // draft tokens proposed for verification
  int64_t accepted = 0;            // draft tokens the target accepted
  int64_t verifications = 0;       // target runs that verified drafts
  int64_t runs_launched = 0;       // speculative runs started
  int64_t runs_cancelled = 0;      // runs stopped before they finished
  int64_t runs_wasted = 0;         // runs that finished but whose result was discarded

  // accepted / drafted; 0 when nothing was drafted.
  double acceptance_rate() const;
  // Tokens one verification yields: its accepted drafts plus the target's own token,
  // (accepted + verifications) / verifications; 0 without verifications.
  double tokens_per_verification() const;

  // Every field above plus the two derived ratios, under the CSV column names.
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
void to_json(nlohmann::json& j, const SpecMetrics& m);

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

  int64_t tokens() const { return int64_t(times_.size()); }
  const std::vector<Clock::time_point>& times() const { return times_; }
  Clock::time_point start() const { return start_; }

  // Sets generated_tokens, ttft_ms, mean_itl_ms and decode_tokens_per_s of m. With fewer than
  // two tokens the inter-token fields are 0, as is the rate when all tokens arrived at once.
  void fill(SpecMetrics& m) const;

 private:
  Clock::time_point start_;
  std::vector<Clock::time_point> times_;
};

}  // namespace specmesh

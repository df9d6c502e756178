// What the server has done, for GET /metrics in Prometheus' text format (version 0.0.4):
// requests and errors by status, the generations' tokens, latencies and acceptance,
// aggregated from each GenerationResult's Metrics, and the bytes allocated on the heap.
#pragma once

#include <array>
#include <cstdint>
#include <map>
#include <mutex>
#include <string>
#include <vector>

#include "specmesh/generation.hpp"

namespace specmesh::serve {

// A Prometheus histogram: cumulative counts over fixed upper bounds, and the sum.
class Histogram {
 public:
  explicit Histogram(std::vector<double> bounds) : bounds_(std::move(bounds)), counts_(bounds_.size(), 0) {}
  void observe(double v);
  // The _bucket, _sum and _count lines of metric `name` with extra labels `labels` ("" or
  // "strategy=\"ar\"").
  void write(std::string& out, const std::string& name, const std::string& labels) const;

 private:
  std::vector<double> bounds_;
  std::vector<uint64_t> counts_;  // per bound, not cumulative
  uint64_t count_ = 0;
  double sum_ = 0;
};

class ServerMetrics {
 public:
  // An answered HTTP request (every route); `path` is the route's pattern.
  void count_request(const std::string& path, int status);
  // A generation that ended; `outcome` is "ok", "cancelled" or an error kind.
  void count_generation(const GenerationResult& result, const std::string& outcome);
  void generation_started() { std::lock_guard lk(mu_); ++in_flight_; }
  void generation_ended() { std::lock_guard lk(mu_); --in_flight_; }
  // The text exposition of everything so far.
  std::string exposition() const;

 private:
  struct PerStrategy {
    uint64_t generations = 0, prompt_tokens = 0, generated_tokens = 0, drafted = 0, accepted = 0;
    uint64_t runs_launched = 0, runs_cancelled = 0, runs_wasted = 0;
    uint64_t decoded_tokens = 0;  // tokens after each generation's first
    double decode_seconds = 0;    // the time they took, summed
    Histogram ttft{{0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30}};
    Histogram itl{{0.0005, 0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1}};
    Histogram tokens_per_s{{1, 5, 10, 25, 50, 100, 250, 500, 1000, 2500, 5000, 10000}};
  };
  mutable std::mutex mu_;
  std::map<std::pair<std::string, int>, uint64_t> requests_;       // (path, status)
  std::map<std::pair<std::string, std::string>, uint64_t> outcomes_;  // (strategy, outcome)
  std::map<std::string, PerStrategy> strategies_;
  int64_t in_flight_ = 0;
};

}  // namespace specmesh::serve

// How long the head waits for a run's answer before it calls the run lost.
//
// Heartbeats find a peer that is gone or frozen. They cannot find a run that a live peer
// dropped (a bug, a cache it could not extend, a message lost in between): without a deadline
// the generation would wait forever. Every run therefore gets one when it is launched:
//
//   deadline = launch + floor + factor x (modelled time of the run and of the runs still
//                                         outstanding ahead of it on the same pipeline)
//
// The modelled time of a run prices each stage's layers with its device profile and, on top,
// with a deliberately slow CPU (1 GFLOP/s per thread, 1 GB/s), because a stage takes the
// longer of its real compute and its profile; each hop adds the link profile's latency and
// transfer time. floor and factor leave room for a busy machine; the deadline is a backstop
// for lost runs, not a performance target.
#pragma once

#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>
#include <vector>

#include "specmesh/model/model.hpp"
#include "specmesh/profiles.hpp"

namespace specmesh {

// One stage of a pipeline as the head prices runs on it.
struct StagePrice {
  std::shared_ptr<const Model> model;
  int layer_begin = 0, layer_end = 0;
  std::optional<DeviceProfile> profile;
  int threads = 1;
};

struct PipelinePrice {
  std::vector<StagePrice> stages;
  LinkProfile link;
  int n_ctx = 0;  // keys a token attends to, at most
  // Modelled seconds of one run of `tokens` tokens through every stage and hop.
  double run_seconds(int tokens) const;
};

class RunDeadlines {
 public:
  using Clock = std::chrono::steady_clock;
  struct Overdue {
    uint64_t run = 0;
    std::string role;
    double budget_ms = 0;
  };

  explicit RunDeadlines(std::map<std::string, PipelinePrice> prices, Clock::duration floor = std::chrono::seconds(2),
                        double factor = 4);

  void launched(uint64_t run, const std::string& role, int tokens, Clock::time_point now = Clock::now());
  // Its answer arrived, or it was cancelled (a cancelled run sends nothing back).
  void settled(uint64_t run);
  // Forgets every run (the strategy that launched them was dropped).
  void clear() {
    runs_.clear();
    queued_.clear();
  }
  // The oldest outstanding run whose deadline has passed.
  std::optional<Overdue> overdue(Clock::time_point now = Clock::now()) const;
  std::size_t outstanding() const { return runs_.size(); }
  bool awaits(uint64_t run) const { return runs_.count(run) != 0; }
  // The outstanding runs by role.
  std::map<std::string, std::vector<uint64_t>> outstanding_by_role() const {
    std::map<std::string, std::vector<uint64_t>> out;
    for (const auto& [run, r] : runs_) out[r.role].push_back(run);
    return out;
  }

 private:
  struct Run {
    std::string role;
    double seconds = 0;
    Clock::time_point launched, deadline;
  };
  std::map<std::string, PipelinePrice> prices_;
  Clock::duration floor_;
  double factor_;
  std::map<uint64_t, Run> runs_;
  std::map<std::string, double> queued_;  // per role: modelled seconds of its outstanding runs
  // A run's price by (role, tokens): pricing walks every weight of every stage, and a decode
  // launches runs of the same few sizes again and again.
  std::map<std::pair<std::string, int>, double> prices_seen_;
};

}  // namespace specmesh

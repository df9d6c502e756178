// The devices of a stage that computes tensor-parallel (StageConfig::tp_devices): a context per
// rank, each on its own device actor, and the jobs every rank runs together.
//
// A job (a run, a cache operation) goes to every rank's device. The ranks exchange their
// shares inside a forward pass (model/tensor_parallel.hpp) through memory, since they are one
// node's devices, like the chips of one host. Jobs keep their order across the ranks: a rank
// starts a job once every rank has left the one before, and the last rank to leave a job
// reports how it ended. A rank that fails breaks the exchange, so the others stop waiting for
// it instead of hanging; a job cancelled before it started is skipped on every rank alike.
//
// A stage on one device is the same with one rank and no exchange.
#pragma once

#include <condition_variable>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <vector>

#include "specmesh/actors/stage.hpp"
#include "specmesh/model/tp_group.hpp"

namespace specmesh {

class TpRanks : public std::enable_shared_from_this<TpRanks> {
 public:
  struct Rank {
    std::shared_ptr<Context> ctx;
    StageConfig stage;                  // the stage's, with this rank's device
    std::shared_ptr<StageStats> stats;  // rank 0: the stage's; the others' count nothing
  };

  // Builds each rank's context from `cp` on its device's pool. Throws std::invalid_argument
  // when the model cannot be split over the devices or their states are missing.
  static std::shared_ptr<TpRanks> make(const StageConfig& cfg, ContextParams cp, std::shared_ptr<StageStats> stats);

  int size() const { return int(ranks_.size()); }
  Rank& rank(int r) { return ranks_.at(size_t(r)); }
  Context& ctx() { return *ranks_[0].ctx; }

  // Runs work(r) on every rank's device as the stage's next job. When skip() (asked once, by
  // the first rank to start) says so, no rank runs it and `skipped` is called instead. When a
  // rank throws, `failed` gets the first exception that is not another rank's broken wait.
  // `hold` is kept until every rank is done (a run's admission).
  void schedule(std::function<bool()> skip, std::function<void(int rank)> work, std::function<void()> skipped,
                std::function<void(const std::exception_ptr&)> failed, std::shared_ptr<void> hold = nullptr);

 private:
  TpRanks() = default;
  std::vector<Rank> ranks_;
  std::unique_ptr<TpExchange> exchange_;

  std::mutex mu_;
  std::condition_variable turn_;
  uint64_t scheduled_ = 0;  // jobs handed to the ranks (by the stage actor)
  uint64_t completed_ = 0;  // jobs every rank has left
  int left_ = 0;            // ranks that have left job completed_
  bool decided_ = false, skip_ = false;
  std::vector<std::exception_ptr> errors_;
};

}  // namespace specmesh

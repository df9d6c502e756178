// A tensor-parallel group in one process: n contexts of one model, rank r holding its share
// (tensor_parallel.hpp), each on a thread of its own, exchanging shares through memory.
//
// This is the group an application embeds, and the reference the device-actor groups (which
// exchange the same shares as messages) are tested against: its logits equal one context's
// bit for bit, for any group size.
#pragma once

#include <exception>
#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

#include "specmesh/model/context.hpp"

namespace specmesh {

// What a rank waiting in an exchange throws when another rank failed.
struct TpGroupBroken : std::runtime_error {
  TpGroupBroken() : std::runtime_error("tensor-parallel group: another rank failed") {}
};

// Of the ranks' failures in one job (null: the rank did not fail), the cause: the first that is
// not a broken wait (TpGroupBroken), else the first broken wait; null when none failed.
std::exception_ptr tp_failure_cause(const std::vector<std::exception_ptr>& errors);

// The exchange of a group whose ranks run on threads of one process: each rank's TpLink, and a
// way out when a rank fails. Ranks of a group may run on any threads (TpGroup's, or device
// actors'), one each.
class TpExchange {
 public:
  explicit TpExchange(int n);
  ~TpExchange();
  int size() const;
  TpLink& link(int rank);
  // A rank failed: every rank waiting in an exchange, or entering one, throws instead.
  void fail();
  // Usable again; call once no rank is inside an exchange.
  void reset();

 private:
  struct State;
  class Link;
  std::unique_ptr<State> state_;
  std::vector<std::unique_ptr<Link>> links_;
};

class TpGroup {
 public:
  // `params` is every rank's (its tp and tp_link are set here); n_threads is per rank. Throws
  // std::invalid_argument when the model cannot be split n ways.
  TpGroup(const Model& model, ContextParams params, int n);
  ~TpGroup();
  TpGroup(const TpGroup&) = delete;
  TpGroup& operator=(const TpGroup&) = delete;

  int size() const { return int(ctx_.size()); }
  Context& rank(int r) { return *ctx_.at(size_t(r)); }

  // Runs fn(r) for every rank at once, rank 0 on the calling thread, and returns when all have.
  // When one throws, the group's exchange is broken for the others (their waits throw), and the
  // first exception is rethrown here; the group stays usable.
  void run(const std::function<void(int rank)>& fn);

  // Context::forward on every rank; returns rank 0's output (every rank has the same logits).
  ForwardOutput forward(const Batch& batch, const float* hidden_in = nullptr);

 private:
  std::unique_ptr<TpExchange> exchange_;
  std::vector<std::unique_ptr<Context>> ctx_;
  std::unique_ptr<ThreadPool> threads_;
};

}  // namespace specmesh

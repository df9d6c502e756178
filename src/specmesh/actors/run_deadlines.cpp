#include "specmesh/actors/run_deadlines.hpp"

#include <algorithm>

#include "specmesh/model/context.hpp"

namespace specmesh {

namespace {

// Far below what any machine we run on does, so that real compute never outlasts the price.
double slow_cpu_seconds(const WorkCost& c, int threads) {
  return std::max(c.flops / (1e9 * std::max(threads, 1)), c.bytes / 1e9);
}

}  // namespace

double PipelinePrice::run_seconds(int tokens) const {
  double s = 0;
  for (const StagePrice& st : stages) {
    const Model& m = *st.model;
    // KV bytes counted as F32, the widest cache, so that the price is an upper bound.
    const WorkCost c = forward_cost(m, st.layer_begin, st.layer_end, tokens, n_ctx, tokens, DType::F32);
    s += slow_cpu_seconds(c, st.threads) + (st.profile ? st.profile->seconds(c) : 0.0);
    // The hop into the stage carries the batch's hidden states (or token ids into the first).
    s += link.seconds(double(tokens) * m.hparams().n_embd * sizeof(float));
  }
  if (!stages.empty()) {
    const Model& last = *stages.back().model;
    s += link.seconds(double(tokens) * last.hparams().n_vocab * sizeof(float));  // logits home
  }
  return s;
}

RunDeadlines::RunDeadlines(std::map<std::string, PipelinePrice> prices, Clock::duration floor, double factor)
    : prices_(std::move(prices)), floor_(floor), factor_(factor) {}

void RunDeadlines::launched(uint64_t run, const std::string& role, int tokens, Clock::time_point now) {
  auto [seen, fresh] = prices_seen_.try_emplace({role, tokens}, 0.0);
  if (fresh) {
    auto p = prices_.find(role);
    seen->second = p == prices_.end() ? 0.0 : p->second.run_seconds(tokens);
  }
  Run r;
  r.role = role;
  r.seconds = seen->second;
  r.launched = now;
  // Stages work in arrival order: the runs ahead of this one on its pipeline come first.
  double& queued = queued_[role];
  queued += r.seconds;
  r.deadline = now + floor_ + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(factor_ * queued));
  runs_[run] = std::move(r);
}

void RunDeadlines::settled(uint64_t run) {
  auto it = runs_.find(run);
  if (it == runs_.end()) return;
  double& queued = queued_[it->second.role];
  queued = std::max(0.0, queued - it->second.seconds);
  runs_.erase(it);
}

std::optional<RunDeadlines::Overdue> RunDeadlines::overdue(Clock::time_point now) const {
  const std::pair<const uint64_t, Run>* worst = nullptr;
  for (const auto& e : runs_)
    if (e.second.deadline < now && (!worst || e.second.launched < worst->second.launched)) worst = &e;
  if (!worst) return std::nullopt;
  return Overdue{worst->first, worst->second.role,
                 std::chrono::duration<double, std::milli>(worst->second.deadline - worst->second.launched).count()};
}

}  // namespace specmesh

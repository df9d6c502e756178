#include "specmesh/actors/tp_ranks.hpp"

#include <stdexcept>

#include <caf/send.hpp>

#include "specmesh/devices/device.hpp"

namespace specmesh {

std::shared_ptr<TpRanks> TpRanks::make(const StageConfig& cfg, ContextParams cp, std::shared_ptr<StageStats> stats) {
  const int n = 1 + int(cfg.tp_devices.size());
  if (cfg.tp_device_states.size() != cfg.tp_devices.size())
    throw std::invalid_argument("a stage's tensor-parallel devices and their states differ in number");
  check_tp_shard({0, n}, cfg.model->hparams().n_head_kv);
  std::shared_ptr<TpRanks> t(new TpRanks());
  if (n > 1) t->exchange_ = std::make_unique<TpExchange>(n);
  for (int r = 0; r < n; ++r) {
    Rank rank;
    rank.stage = cfg;
    rank.stage.tp_devices.clear();
    rank.stage.tp_device_states.clear();
    if (r > 0) {
      rank.stage.device = cfg.tp_devices[size_t(r - 1)];
      rank.stage.device_state = cfg.tp_device_states[size_t(r - 1)];
    }
    rank.stats = r == 0 ? stats : std::make_shared<StageStats>();
    ContextParams p = cp;
    p.tp = {r, n};
    p.tp_link = n > 1 ? &t->exchange_->link(r) : nullptr;
    rank.ctx = std::make_shared<Context>(*cfg.model, p, &rank.stage.device_state->pool());
    t->ranks_.push_back(std::move(rank));
  }
  return t;
}

void TpRanks::schedule(std::function<bool()> skip, std::function<void(int)> work, std::function<void()> skipped,
                       std::function<void(const std::exception_ptr&)> failed, std::shared_ptr<void> hold) {
  struct Job {
    uint64_t number;
    std::function<bool()> skip;
    std::function<void(int)> work;
    std::function<void()> skipped;
    std::function<void(const std::exception_ptr&)> failed;
    std::shared_ptr<void> hold;
  };
  auto job = std::make_shared<Job>(Job{scheduled_++, std::move(skip), std::move(work), std::move(skipped),
                                       std::move(failed), std::move(hold)});
  const int n = size();
  for (int r = 0; r < n; ++r) {
    auto dj = std::make_shared<DeviceJob>();
    dj->run = [self = shared_from_this(), job, r, n](ThreadPool&) -> WorkCost {
      TpRanks& t = *self;
      bool skip;
      {
        std::unique_lock lk(t.mu_);
        t.turn_.wait(lk, [&] { return t.completed_ == job->number; });
        if (!t.decided_) {
          t.decided_ = true;
          t.skip_ = job->skip && job->skip();
          t.errors_.assign(size_t(n), nullptr);
        }
        skip = t.skip_;
      }
      std::exception_ptr err;
      if (!skip) {
        try {
          job->work(r);
        } catch (...) {
          err = std::current_exception();
          if (t.exchange_) t.exchange_->fail();  // the other ranks stop waiting for this one
        }
      }
      std::unique_lock lk(t.mu_);
      t.errors_[size_t(r)] = err;
      if (++t.left_ < n) return {};
      // The last rank out: the job is over on every rank.
      const std::exception_ptr cause = tp_failure_cause(t.errors_);
      if (t.exchange_ && cause) t.exchange_->reset();
      lk.unlock();
      // Reported before the next job starts, so the reports keep the jobs' order.
      if (skip && job->skipped) job->skipped();
      if (cause && job->failed) job->failed(cause);
      job->hold.reset();
      lk.lock();
      t.left_ = 0;
      t.decided_ = false;
      ++t.completed_;
      lk.unlock();
      t.turn_.notify_all();
      return {};
    };
    caf::anon_send(ranks_[size_t(r)].stage.device, compute_atom::value, std::move(dj));
  }
}

}  // namespace specmesh

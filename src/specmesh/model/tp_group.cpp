#include "specmesh/model/tp_group.hpp"

#include <algorithm>
#include <atomic>
#include <chrono>
#include <condition_variable>
#include <cstring>
#include <exception>
#include <mutex>
#include <stdexcept>
#include <string>
#include <thread>

namespace specmesh {

// The ranks' meeting point: a reusable barrier that a failing rank can break, and each rank's
// buffer for the exchange in progress. A rank reads the others' buffers between two barriers,
// so none is changed or freed while it is read.
struct TpExchange::State {
  explicit State(int n) : n(n), parts(size_t(n)) {}
  const int n;
  std::vector<const float*> parts;
  std::mutex mu;
  std::condition_variable cv;
  int arrived = 0;
  std::atomic<uint64_t> generation{0};
  std::atomic<bool> broken{false};

  void wait() {
    std::unique_lock lock(mu);
    if (broken) throw TpGroupBroken();
    const uint64_t gen = generation.load();
    if (++arrived == n) {
      arrived = 0;
      generation.fetch_add(1);
      cv.notify_all();
      return;
    }
    lock.unlock();
    // The other ranks are usually a few microseconds away, each on its own core: look for them
    // for a while (yielding, so ranks that share a core still run) before sleeping, which costs
    // a wake-up of tens of microseconds and comes four times a layer.
    const auto until = std::chrono::steady_clock::now() + std::chrono::microseconds(50);
    while (generation.load(std::memory_order_acquire) == gen && !broken.load(std::memory_order_relaxed) &&
           std::chrono::steady_clock::now() < until)
      std::this_thread::yield();
    lock.lock();
    cv.wait(lock, [&] { return generation.load() != gen || broken.load(); });
    if (generation.load() == gen) throw TpGroupBroken();
  }
  void fail() {
    std::lock_guard lock(mu);
    broken = true;
    cv.notify_all();
  }
  void reset() {
    std::lock_guard lock(mu);
    broken = false;
    arrived = 0;
  }
};

class TpExchange::Link final : public TpLink {
 public:
  Link(State& ex, TpShard shard) : ex_(ex), shard_(shard) {}
  TpShard shard() const override { return shard_; }

  void all_gather(const float* mine, size_t rows, const size_t* shares, size_t total, float* out) override {
    ex_.parts[size_t(shard_.rank)] = mine;
    ex_.wait();
    size_t col = 0;
    for (int r = 0; r < shard_.size; ++r) {
      const size_t w = shares[r];
      for (size_t i = 0; i < rows && w > 0; ++i)
        std::memcpy(out + i * total + col, ex_.parts[size_t(r)] + i * w, w * sizeof(float));
      col += w;
    }
    if (col != total) throw std::logic_error("tensor-parallel all-gather: the shares do not add up");
    ex_.wait();
  }

  void all_reduce_sum(float* v, size_t n) override {
    ex_.parts[size_t(shard_.rank)] = v;
    ex_.wait();
    sum_.assign(ex_.parts[0], ex_.parts[0] + n);
    for (int r = 1; r < shard_.size; ++r)
      for (size_t i = 0; i < n; ++i) sum_[i] += ex_.parts[size_t(r)][i];
    ex_.wait();
    std::copy(sum_.begin(), sum_.end(), v);
  }

 private:
  State& ex_;
  TpShard shard_;
  std::vector<float> sum_;
};

TpExchange::TpExchange(int n) : state_(std::make_unique<State>(n)) {
  for (int r = 0; r < n; ++r) links_.push_back(std::make_unique<Link>(*state_, TpShard{r, n}));
}
TpExchange::~TpExchange() = default;
int TpExchange::size() const { return state_->n; }
TpLink& TpExchange::link(int rank) { return *links_.at(size_t(rank)); }
void TpExchange::fail() { state_->fail(); }
void TpExchange::reset() { state_->reset(); }

TpGroup::TpGroup(const Model& model, ContextParams params, int n) {
  check_tp_shard({0, n}, model.hparams().n_head_kv);
  exchange_ = std::make_unique<TpExchange>(n);
  for (int r = 0; r < n; ++r) {
    ContextParams p = params;
    p.tp = {r, n};
    p.tp_link = n > 1 ? &exchange_->link(r) : nullptr;
    ctx_.push_back(std::make_unique<Context>(model, p));
  }
  // A thread per rank (the caller is rank 0), living as long as the group, so a decode step's
  // several runs start no threads.
  threads_ = std::make_unique<ThreadPool>(n);
}

TpGroup::~TpGroup() = default;

std::exception_ptr tp_failure_cause(const std::vector<std::exception_ptr>& errors) {
  std::exception_ptr first, broken;
  for (const std::exception_ptr& e : errors) {
    if (!e) continue;
    try {
      std::rethrow_exception(e);
    } catch (const TpGroupBroken&) {
      if (!broken) broken = e;
    } catch (...) {
      if (!first) first = e;
    }
  }
  return first ? first : broken;
}

void TpGroup::run(const std::function<void(int)>& fn) {
  std::vector<std::exception_ptr> errors(ctx_.size());
  threads_->run([&](int r, int) {
    try {
      fn(r);
    } catch (...) {
      errors[size_t(r)] = std::current_exception();
      exchange_->fail();  // the other ranks stop waiting for this one
    }
  });
  const std::exception_ptr cause = tp_failure_cause(errors);
  if (!cause) return;
  exchange_->reset();
  std::rethrow_exception(cause);
}

ForwardOutput TpGroup::forward(const Batch& batch, const float* hidden_in) {
  std::vector<ForwardOutput> out(ctx_.size());
  run([&](int r) { out[size_t(r)] = ctx_[size_t(r)]->forward(batch, hidden_in); });
  return std::move(out[0]);
}

}  // namespace specmesh

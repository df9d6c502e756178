#include "specmesh/transport/router.hpp"

#include <caf/send.hpp>

#include "specmesh/transport/gateway.hpp"

namespace specmesh {

size_t wire_bytes(const Envelope& env) {
  size_t n = 64;
  std::visit(
      [&](const auto& p) {
        using T = std::decay_t<decltype(p)>;
        if constexpr (std::is_same_v<T, Activations>) {
          for (const auto& t : p.tensors) n += t.data.size();
          n += p.batch.tokens.size() * 16;
        } else if constexpr (std::is_same_v<T, Logits>) {
          n += p.logits.data.size();
        } else if constexpr (std::is_same_v<T, HiddenStates>) {
          n += p.states.data.size() + p.rows.size() * 8;
        } else if constexpr (std::is_same_v<T, RunStart>) {
          n += p.tokens.size() * 16;
        }
      },
      env.payload);
  return n;
}

Router::Router(std::string self, Gateway* gateway, LinkProfile link)
    : self_(std::move(self)), gateway_(gateway), link_(link), shaped_(link.latency_s > 0 || link.bytes_per_s > 0) {
  if (shaped_) thread_ = std::thread([this] { shaper(); });
}

Router::~Router() {
  {
    std::lock_guard<std::mutex> lk(mu_);
    stop_ = true;
  }
  cv_.notify_all();
  if (thread_.joinable()) thread_.join();
}

bool Router::deliver(const std::string& node, Envelope env) {
  std::lock_guard<std::mutex> lk(gw_mu_);
  if (!gateway_) return false;
  if (node == self_) {
    if (!local_) return false;
    caf::anon_send(local_, self_, std::move(env));
    return true;
  }
  return gateway_->send(node, std::move(env));
}

bool Router::reachable(const std::string& node) {
  std::lock_guard<std::mutex> lk(gw_mu_);
  if (!gateway_) return false;
  return node == self_ || gateway_->peer_alive(node);
}

void Router::close() {
  std::lock_guard<std::mutex> lk(gw_mu_);
  gateway_ = nullptr;
  local_ = nullptr;
}

bool Router::send(const std::string& node, Envelope env) {
  if (!shaped_ || node == self_) return deliver(node, std::move(env));
  // Control messages have their own connection: they pay the latency, never the queue.
  if (is_control(env.type())) {
    std::lock_guard<std::mutex> lk(mu_);
    const auto due = std::chrono::steady_clock::now() + std::chrono::duration_cast<std::chrono::steady_clock::duration>(
                                                            std::chrono::duration<double>(link_.latency_s));
    queue_.push({due, order_++, node, std::move(env)});
    cv_.notify_one();
    return true;
  }
  using Clock = std::chrono::steady_clock;
  std::lock_guard<std::mutex> lk(mu_);
  // The link serialises messages one after another; each then flies for the latency.
  auto now = Clock::now();
  auto& free_at = link_free_[node];
  const auto start = std::max(now, free_at);
  const auto tx = std::chrono::duration_cast<Clock::duration>(
      std::chrono::duration<double>(link_.bytes_per_s > 0 ? wire_bytes(env) / link_.bytes_per_s : 0));
  free_at = start + tx;
  const auto due = free_at + std::chrono::duration_cast<Clock::duration>(std::chrono::duration<double>(link_.latency_s));
  queue_.push({due, order_++, node, std::move(env)});
  cv_.notify_one();
  return true;
}

void Router::shaper() {
  std::unique_lock<std::mutex> lk(mu_);
  while (!stop_) {
    if (queue_.empty()) {
      cv_.wait(lk);
      continue;
    }
    const auto due = queue_.top().due;
    if (std::chrono::steady_clock::now() < due) {
      cv_.wait_until(lk, due);
      continue;
    }
    Pending p = std::move(const_cast<Pending&>(queue_.top()));
    queue_.pop();
    lk.unlock();
    deliver(p.node, std::move(p.env));
    lk.lock();
  }
}

}  // namespace specmesh

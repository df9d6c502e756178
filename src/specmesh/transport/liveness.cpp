#include "specmesh/transport/liveness.hpp"

#include <spdlog/spdlog.h>

#include <algorithm>
#include <string>

namespace specmesh::gw {

Liveness::Liveness(const GatewayConfig& cfg, Links& links, Subscriptions& subs)
    : cfg_(cfg), links_(links), subs_(subs), peers_(links.size()), next_heartbeat_(Clock::now()) {
  for (auto& p : peers_) p.last_heard = next_heartbeat_;
}

void Liveness::heard(uint32_t i) {
  Peer& p = peers_[i];
  p.last_heard = Clock::now();
  p.ever_heard = true;
  if (!p.alive.load(std::memory_order_relaxed)) {
    p.alive.store(true, std::memory_order_relaxed);
    if (p.reported_down) spdlog::info("gateway '{}': peer '{}' is back", cfg_.node, links_[i].name);
    else spdlog::debug("gateway '{}': peer '{}' is up", cfg_.node, links_[i].name);
    p.reported_down = false;
  }
}

void Liveness::send_heartbeats() {
  auto now_ns = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
  for (std::size_t i = 0; i < links_.size(); ++i) {
    // Never queued: a stale heartbeat proves nothing.
    Envelope hb = make_envelope(0, Heartbeat{now_ns});
    if (!links_.send_now(links_[i], hb)) n_dropped_.fetch_add(1, std::memory_order_relaxed);
  }
}

void Liveness::tick(Clock::time_point now) {
  if (now >= next_heartbeat_) {
    send_heartbeats();
    next_heartbeat_ = now + cfg_.heartbeat;
  }
  for (std::size_t i = 0; i < peers_.size(); ++i) {
    Peer& p = peers_[i];
    if (p.reported_down || now - p.last_heard < timeout(p)) continue;
    p.reported_down = true;
    p.alive.store(false, std::memory_order_relaxed);
    const Link& l = links_[i];
    auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - p.last_heard).count();
    std::string msg = p.ever_heard ? "peer '" + l.name + "' silent for " + std::to_string(ms) + " ms (" +
                                         l.endpoint[kData] + "): gone, frozen or unreachable"
                                   : "peer '" + l.name + "' not reachable at " + l.endpoint[kData] + " after " +
                                         std::to_string(ms) + " ms";
    spdlog::error("gateway '{}': {}", cfg_.node, msg);
    subs_.deliver(l.name, make_envelope(0, Error{ErrorCode::peer_down, l.name, msg}));
  }
}

Clock::time_point Liveness::next_tick() const {
  auto d = next_heartbeat_;
  for (const auto& p : peers_)
    if (!p.reported_down) d = std::min(d, p.last_heard + timeout(p));
  return d;
}

}  // namespace specmesh::gw

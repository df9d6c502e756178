// Whether the gateway's peers are there (private to transport/).
//
// Application heartbeats on the control channel detect a peer whose process is gone, frozen
// or whose gateway stopped serving (the kernel drops dead TCP connections: see set_common in
// link.cpp for why ZeroMQ's own heartbeats are off). When a peer has been silent
// for peer_timeout, error subscribers receive an Error{code = peer_down, peer = name} envelope
// (run_id 0) once; the peer counts as alive again when it is heard from. A peer never heard
// from is reported the same way ("not reachable") first_contact_timeout after the gateway starts.
#pragma once

#include "specmesh/transport/delivery.hpp"
#include "specmesh/transport/link.hpp"

#include <atomic>
#include <cstdint>
#include <vector>

namespace specmesh::gw {

class Liveness {
 public:
  // Every peer of `links` starts its silence now. Peer-down errors go through `subs`.
  Liveness(const GatewayConfig& cfg, Links& links, Subscriptions& subs);

  // I/O thread.
  void heard(uint32_t peer);
  // Sends the heartbeats that are due and reports peers silent for too long.
  void tick(Clock::time_point now);
  Clock::time_point next_tick() const;

  // Any thread.
  bool alive(uint32_t peer) const { return peers_[peer].alive.load(); }
  uint64_t heartbeats_dropped() const { return n_dropped_.load(); }

 private:
  struct Peer {
    Clock::time_point last_heard;
    bool ever_heard = false;
    bool reported_down = false;
    std::atomic<bool> alive{false};
  };
  void send_heartbeats();
  // The silence after which `p` is reported down.
  std::chrono::milliseconds timeout(const Peer& p) const {
    return p.ever_heard ? cfg_.peer_timeout : cfg_.first_contact_timeout;
  }

  const GatewayConfig& cfg_;
  Links& links_;
  Subscriptions& subs_;
  std::vector<Peer> peers_;  // by Link::index
  Clock::time_point next_heartbeat_;
  std::atomic<uint64_t> n_dropped_{0};
};

}  // namespace specmesh::gw

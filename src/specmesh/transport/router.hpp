// Where a node's actors send envelopes: to another node through the gateway, or straight to
// a local actor when the destination is this node. With a link profile, every inter-node
// hop is delayed by the modelled latency and serialisation time of its bytes (links are
// full duplex and serialise one message at a time per destination).
#pragma once

#include <condition_variable>
#include <map>
#include <memory>
#include <mutex>
#include <queue>
#include <string>
#include <thread>
#include <vector>

#include <caf/actor.hpp>

#include "specmesh/profiles.hpp"
#include "specmesh/messages/protocol.hpp"

namespace specmesh {

class Gateway;

class Router {
 public:
  Router(std::string self, Gateway* gateway, LinkProfile link);
  ~Router();

  const std::string& self() const { return self_; }
  // Local deliveries to this node go to `dispatcher` as (from, Envelope), as the gateway does.
  void set_local(caf::actor dispatcher) { local_ = std::move(dispatcher); }

  // Sends `env` to `node`; false when the node is unknown or the router is closed.
  bool send(const std::string& node, Envelope env);
  // Whether `node` answers now: this node, or a peer the gateway has heard from lately (false
  // from its peer_down report until it is heard again, and once the router is closed).
  bool reachable(const std::string& node);
  // Stops using the gateway (before it is destroyed); later sends return false.
  void close();

 private:
  struct Pending {
    std::chrono::steady_clock::time_point due;
    uint64_t order;
    std::string node;
    Envelope env;
    bool operator>(const Pending& o) const { return due > o.due || (due == o.due && order > o.order); }
  };
  void shaper();
  bool deliver(const std::string& node, Envelope env);

  std::string self_;
  std::mutex gw_mu_;
  Gateway* gateway_;
  LinkProfile link_;
  caf::actor local_;
  bool shaped_;
  std::mutex mu_;
  std::condition_variable cv_;
  std::priority_queue<Pending, std::vector<Pending>, std::greater<>> queue_;
  std::map<std::string, std::chrono::steady_clock::time_point> link_free_;
  uint64_t order_ = 0;
  bool stop_ = false;
  std::thread thread_;
};

// Bytes an envelope puts on the wire (tensor payloads plus a small header).
size_t wire_bytes(const Envelope& env);

}  // namespace specmesh

// What tests that run actors and gateways share: an actor system tuned like a node's, fresh
// endpoints per transport (ipc socket files removed when the test program ends), polling with
// a deadline, and a blocking inbox to subscribe on a gateway.
#pragma once

#include "ports.hpp"
#include "specmesh/transport/gateway.hpp"

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/all.hpp>
#include <gtest/gtest.h>

#include <stdlib.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <deque>
#include <filesystem>
#include <map>
#include <memory>
#include <mutex>
#include <optional>
#include <stdexcept>
#include <string>
#include <thread>
#include <utility>
#include <vector>

namespace specmesh::test {

inline constexpr std::chrono::milliseconds kWait{5000};  // bound for what should take milliseconds

// A gateway that notices a silent peer within 250 ms and closes at once.
inline GatewayConfig quick_gateway(std::string node, std::string bind, std::map<std::string, std::string> peers) {
  GatewayConfig c;
  c.node = std::move(node);
  c.bind = std::move(bind);
  c.peers = std::move(peers);
  c.heartbeat = std::chrono::milliseconds(50);
  c.peer_timeout = std::chrono::milliseconds(250);
  c.first_contact_timeout = c.peer_timeout;
  c.linger = std::chrono::milliseconds(0);
  return c;
}

// Node `node` of a mesh whose every node's endpoint is in `eps` (the others are its peers).
inline GatewayConfig mesh_gateway(const std::string& node, const std::map<std::string, std::string>& eps,
                                  std::chrono::milliseconds peer_timeout) {
  GatewayConfig c;
  c.node = node;
  c.bind = eps.at(node);
  for (const auto& [n, ep] : eps)
    if (n != node) c.peers[n] = ep;
  c.linger = std::chrono::milliseconds(0);
  c.peer_timeout = peer_timeout;
  return c;
}

// An f32 tensor of `shape` holding base, base + 1, base + 2, ...
inline Tensor float_tensor(std::vector<int64_t> shape, float base) {
  std::size_t n = 1;
  for (auto d : shape) n *= std::size_t(d);
  std::vector<float> v(n);
  for (std::size_t i = 0; i < n; ++i) v[i] = base + float(i);
  return Tensor::from(WireDType::f32, std::move(shape), std::move(v));
}

struct System {
  caf::actor_system_config cfg;
  std::unique_ptr<caf::actor_system> sys;
  System() {
    configure_low_latency_scheduler(cfg);
    sys = std::make_unique<caf::actor_system>(cfg);
  }
};

// Unique within the machine: the pid separates concurrent test programs.
inline std::string unique_tag() {
  static std::atomic<int> n{0};
  return std::to_string(::getpid()) + "-" + std::to_string(n++);
}

// ipc socket files go into a private directory of this test program (the gateway refuses
// directories that group or others can use), removed with whatever ZeroMQ left in it when the
// program ends.
struct IpcCleanup : ::testing::Environment {
  std::mutex mu;
  std::string dir;
  void TearDown() override {
    std::lock_guard<std::mutex> g(mu);
    std::error_code ec;
    if (!dir.empty()) std::filesystem::remove_all(dir, ec);
  }
};
inline IpcCleanup* const ipc_cleanup = static_cast<IpcCleanup*>(::testing::AddGlobalTestEnvironment(new IpcCleanup));

inline std::string ipc_ep() {
  std::lock_guard<std::mutex> g(ipc_cleanup->mu);
  if (ipc_cleanup->dir.empty()) {
    char tmpl[] = "/tmp/specmesh-test-XXXXXX";  // mkdtemp makes it 0700
    if (::mkdtemp(tmpl) == nullptr) throw std::runtime_error("mkdtemp failed");
    ipc_cleanup->dir = tmpl;
  }
  return "ipc://" + ipc_cleanup->dir + "/" + unique_tag();
}

// A fresh data endpoint on "inproc", "ipc" or "tcp" (loopback).
inline std::string endpoint_for(const std::string& transport) {
  if (transport == "inproc") return "inproc://test-" + unique_tag();
  if (transport == "ipc") return ipc_ep();
  return "tcp://127.0.0.1:" + std::to_string(free_port_pair());
}

// Polls `p` until it holds or the timeout passes; returns its last value.
template <class Pred>
bool wait_until(Pred&& p, std::chrono::milliseconds timeout = kWait) {
  auto end = std::chrono::steady_clock::now() + timeout;
  while (std::chrono::steady_clock::now() < end) {
    if (p()) return true;
    std::this_thread::sleep_for(std::chrono::milliseconds(2));
  }
  return p();
}

// A blocking CAF actor to subscribe with; next() waits for one delivered message.
// CAF 0.17.6's blocking receive() may run the handler for several messages in one call when
// high-priority messages are pending, so handled messages are buffered.
struct Inbox {
  caf::scoped_actor self;
  std::deque<std::pair<std::string, Envelope>> buffered;
  explicit Inbox(caf::actor_system& sys) : self(sys) {}
  caf::actor handle() { return caf::actor_cast<caf::actor>(self); }
  std::optional<std::pair<std::string, Envelope>> next(std::chrono::milliseconds timeout = kWait) {
    if (buffered.empty())
      self->receive([&](const std::string& from, const Envelope& e) { buffered.emplace_back(from, e); },
                    caf::after(timeout) >> [] {});
    if (buffered.empty()) return std::nullopt;
    auto out = std::move(buffered.front());
    buffered.pop_front();
    return out;
  }
};

}  // namespace specmesh::test

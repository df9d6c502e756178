// How the gateway hands accepted messages to local CAF actors (private to transport/).
//
// Subscribed actors receive `(const std::string& from, const specmesh::Envelope& env)`.
// Control messages (cancel, error) are enqueued with caf::message_priority::high so they
// overtake queued data in the actor's mailbox; a running handler is not interrupted, so long
// computations must poll their own cancel flag. (CAF 0.17.6 quirk, measured: a blocking
// actor's receive() may run its handler for several messages in one call while high-priority
// messages are pending; collect results in the handler, not one per call.)
//
// Latency (bench/bench_hop.cpp, round trip = 2 hops, 2-core VM): with scheduled delivery a hop
// costs one CAF worker wake-up more than raw ZeroMQ; inline delivery removes it. On the idle
// VM (every cross-CPU wake-up ~20-40 us, raw 1 KiB ~95 us) inline measured 1.03-1.13x raw for
// 1 KiB and 1 MiB over ipc and tcp, scheduled 1.4-1.6x (1 KiB). With cheap wake-ups (all
// threads on one CPU, raw 1 KiB ~19 us) inline adds ~10 us (1.5x) for 1 KiB and 1.1x for 1 MiB.
//
// Peers may talk before this process has subscribed its actors: messages of a type nobody
// subscribed to yet are held (bounded; the oldest goes when full) and go to the first
// subscriber, in order, before anything newer. An actor that takes several types subscribes
// to them in one call: held messages of all of them then reach it in the order they arrived
// (subscribed one type at a time, a run could overtake the cache operation sent before it).
#pragma once

#include "specmesh/messages/protocol.hpp"
#include "specmesh/transport/gateway.hpp"

#include <caf/actor.hpp>
#include <caf/mailbox_element.hpp>

#include <array>
#include <atomic>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <utility>
#include <vector>

namespace specmesh::gw {

class InlineUnit;

class Subscriptions {
 public:
  explicit Subscriptions(std::string node);  // our node name, for logs
  ~Subscriptions();
  Subscriptions(const Subscriptions&) = delete;
  Subscriptions& operator=(const Subscriptions&) = delete;

  // Any thread. Held messages of these types go to `who` first, in arrival order.
  void subscribe(const std::vector<MsgType>& types, caf::actor who, Delivery how);
  void unsubscribe(const caf::actor& who);
  bool has_subscriber(MsgType type) const;

  // I/O thread only: inline subscribers run on the calling thread.
  void deliver(const std::string& from, Envelope&& env);

  uint64_t delivered() const { return n_delivered_.load(); }
  uint64_t unrouted() const { return n_unrouted_.load(); }
  uint64_t held() const;

 private:
  struct Subscriber {
    caf::actor actor;
    Delivery how;
  };
  void push(const Subscriber& t, caf::mailbox_element_ptr elem);

  static constexpr std::size_t kMaxHeld = 65536;

  std::string node_;
  mutable std::mutex mu_;
  std::array<std::vector<Subscriber>, kMsgTypeMax + 1> subs_;                       // guarded by mu_
  struct Held {
    std::string from;
    Envelope env;
  };
  std::deque<Held> held_;  // guarded by mu_; every type, in arrival order
  std::unique_ptr<InlineUnit> inline_unit_;  // I/O thread only; created on first inline delivery
  std::vector<Subscriber> targets_;          // I/O-thread scratch
  std::atomic<uint64_t> n_delivered_{0}, n_unrouted_{0};
};

}  // namespace specmesh::gw

// The per-process ZeroMQ gateway: the only owner of this process's ZeroMQ sockets, bridging
// remote peers to local CAF actors.
//
// Usage (one Gateway per process; it must be destroyed before the caf::actor_system):
//
//   specmesh::GatewayConfig cfg;
//   cfg.node = "stage1";
//   cfg.bind = "tcp://127.0.0.1:5600";              // control channel: tcp port + 1
//   cfg.peers = {{"head", "tcp://127.0.0.1:5500"}};
//   specmesh::Gateway gw(cfg);                        // binds, connects, starts its I/O thread
//   gw.subscribe(specmesh::MsgType::activations, stage_actor);
//   gw.subscribe(specmesh::MsgType::cancel, stage_actor);
//   gw.subscribe(specmesh::MsgType::error, stage_actor);  // remote errors and peer_down
//   gw.send("head", specmesh::make_envelope(run_id, specmesh::Logits{...}));
//
// Subscribed actors receive `(const std::string& from, const specmesh::Envelope& env)`.
// Pass Delivery::inline_io to subscribe() for short non-blocking handlers (routers, samplers)
// to run them on the gateway thread and save a thread wake-up per message.
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
// Topology: each node binds two ROUTER sockets (data and control) and connects two DEALERs
// (routing id = node name) to every configured peer. Control traffic (cancel, heartbeat,
// error) has its own socket and TCP connection, and is received and sent before data, so a
// cancel is never stuck behind queued tensors. Endpoints:
//   tcp://HOST:PORT  -> control on tcp://HOST:PORT+1   (HOST must be loopback unless
//                       allow_non_loopback; peers are connected wherever they are)
//   ipc://PATH       -> control on ipc://PATH.ctl
//   inproc://NAME    -> control on inproc://NAME.ctl   (gateways of one process share a
//                       process-wide ZeroMQ context, so inproc links work between them)
//
// Ordering: every (link, channel) carries its own sequence numbers, starting at 0 for each
// sender session (a random id per Gateway instance, so a restarted peer starts a new stream).
// A gap, duplicate or reordered message is rejected, logged and counted. After a gap the
// receiver resynchronises so the link keeps working, and error subscribers receive an
// Error{code = messages_lost, peer = name} envelope, since runs in flight may be broken.
//
// Liveness: ZMTP heartbeats (ZMQ_HEARTBEAT_IVL/TIMEOUT) drop dead connections inside ZeroMQ,
// and application heartbeats on the control channel detect a peer whose process is gone,
// frozen or whose gateway stopped serving. When a peer has been silent for peer_timeout,
// error subscribers receive an Error{code = peer_down, peer = name} envelope (run_id 0) once;
// peer_alive() turns true again when it is heard from. A peer never heard from is reported
// the same way ("not reachable") peer_timeout after the gateway starts; wait for
// peer_alive() before starting work if peers start in any order.
//
// Threading: the I/O thread (named "specmesh-gw") owns the listening ROUTERs (receive, decode, deliver), runs the
// heartbeats and polls. Each outgoing DEALER belongs to its link and is used under the link's
// mutex, which is the full memory barrier ZeroMQ requires for a socket to change threads; so
// send() encodes and hands the message to ZeroMQ directly on the calling actor's thread.
// Only when ZeroMQ refuses (high-water mark reached) are messages parked, and the I/O thread
// then owns that DEALER until the backlog is flushed, keeping order.
//
// Rejections (malformed, truncated, wrong version, unknown peer, bad sequence, ...) never
// stop the gateway: each is logged through spdlog with its reason and counted (stats()).
#pragma once

#include "specmesh/messages/protocol.hpp"

#include <caf/actor.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <string>

namespace caf {
class actor_system_config;
}

namespace specmesh {

struct GatewayConfig {
  std::string node;                          // our name; also our ZeroMQ routing id (1..255 bytes)
  std::string bind;                          // our data endpoint (control endpoint is derived)
  std::map<std::string, std::string> peers;  // peer name -> its data endpoint
  std::chrono::milliseconds heartbeat{100};     // application + ZMTP heartbeat interval
  std::chrono::milliseconds peer_timeout{300};  // silence after which a peer is reported down
  std::chrono::milliseconds linger{200};        // ZMQ_LINGER: bounded wait for unsent data at close
  bool allow_non_loopback = false;              // permit binding tcp to non-loopback interfaces
  int64_t max_message_bytes = int64_t{1} << 31; // ZMQ_MAXMSGSIZE per frame on our listening sockets
  // true: send() hands the message to ZeroMQ on the caller's thread (one thread wake-up less
  // per hop); false: every message goes through the I/O thread. See the threading note above.
  bool send_from_caller = true;
};

enum class RejectReason : uint8_t {
  truncated = 0,
  malformed,
  too_deep,
  trailing_bytes,
  wrong_version,
  unknown_type,
  bad_enum,
  bad_tensor,
  unknown_peer,   // routing id not in GatewayConfig::peers
  bad_frames,     // no header frame, or too many frames
  wrong_channel,  // data message on the control socket or vice versa
  seq_reordered,  // sequence number below the expected one (duplicate or late)
  seq_gap,        // sequence number above the expected one (messages missing)
  count_
};
inline constexpr std::size_t kRejectReasonCount = static_cast<std::size_t>(RejectReason::count_);
const char* to_string(RejectReason r);

// How accepted messages reach a subscriber.
enum class Delivery : uint8_t {
  // Enqueued into the actor's mailbox; a CAF worker wakes up and runs the handler. Right for
  // any actor, in particular ones that compute.
  scheduled,
  // The handler runs right away on the gateway's I/O thread, which saves the CAF worker
  // wake-up of every hop (see bench/bench_hop.cpp). Only for actors whose handlers are short
  // and never block: while one runs, this process receives nothing, not even a cancel or a
  // heartbeat. Messages the actor sends or actors it spawns are scheduled normally; a backlog
  // in its mailbox beyond one message is handed to the scheduler. Detached and blocking
  // actors are always woken normally.
  inline_io,
};

struct GatewayStats {
  uint64_t sent = 0;         // messages handed to ZeroMQ
  uint64_t received = 0;     // messages accepted (including heartbeats)
  uint64_t delivered = 0;    // deliveries to local actors (one per subscriber)
  uint64_t unrouted = 0;     // messages dropped while held for a type nobody subscribed to yet
  uint64_t send_dropped = 0; // heartbeats dropped because the peer's queue was full
  std::array<uint64_t, kRejectReasonCount> rejected{};
  uint64_t rejected_total() const;
  uint64_t rejected_for(RejectReason r) const { return rejected[static_cast<std::size_t>(r)]; }
};

class Gateway {
 public:
  // Validates the config, binds, connects to all peers and starts the I/O thread.
  // Throws std::invalid_argument for a bad config and std::runtime_error if binding fails.
  explicit Gateway(GatewayConfig cfg);
  // Stops the I/O thread and closes the sockets (waiting at most `linger` for unsent data).
  ~Gateway();
  Gateway(const Gateway&) = delete;
  Gateway& operator=(const Gateway&) = delete;

  // Sends `env` to `peer`; thread-safe and non-blocking, callable from any actor. The
  // gateway assigns seq and session. Returns false if the peer is unknown or the gateway is
  // shutting down. Throws std::invalid_argument if a tensor's size contradicts its shape.
  // Messages to a peer that is down wait in ZeroMQ / gateway queues until it returns.
  bool send(const std::string& peer, Envelope env);

  // Delivers every accepted message of `type` to `who` (several subscribers all receive it).
  // Heartbeats are consumed by the gateway unless someone subscribes to them.
  // Throws std::invalid_argument for an invalid handle.
  void subscribe(MsgType type, caf::actor who, Delivery how = Delivery::scheduled);
  // Removes `who` from all subscriptions. The gateway holds strong references to subscribers
  // until then (or until it is destroyed).
  void unsubscribe(const caf::actor& who);

  GatewayStats stats() const;
  bool peer_alive(const std::string& peer) const;
  const GatewayConfig& config() const;
  std::string data_endpoint() const;
  std::string control_endpoint() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Derives the control endpoint from a data endpoint (see the table above).
// Throws std::invalid_argument for unsupported transports or malformed tcp endpoints.
std::string control_endpoint_for(const std::string& data_endpoint);

// CAF scheduler settings for processes hosting a gateway: the work-sharing policy, whose idle
// workers block on a condition variable and are woken by the enqueue, with `max_threads`
// workers. CAF's default work stealing sleep-polls (50 us naps before it blocks), which made
// a scheduled-delivery round trip (ipc, 1 KiB, idle VM) 266 us against 157 us with sharing
// (raw ZeroMQ 94 us). Call before constructing the caf::actor_system.
void configure_low_latency_scheduler(caf::actor_system_config& cfg, std::size_t max_threads = 2);

}  // namespace specmesh

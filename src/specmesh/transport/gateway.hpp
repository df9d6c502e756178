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
//
// Security (see README.md, "Security"): with GatewayConfig::curve set, every tcp:// connection
// runs CURVE (encrypted, and both ends authenticated by their long-term keys): our listening
// sockets are CURVE servers that accept only the configured peers' public keys (a ZAP
// handler, transport/zap.hpp), our connecting sockets check the peer's public key as the
// server key, and every received message must come from the key of the node whose name it
// claims (RejectReason::identity_mismatch otherwise). Handshakes that fail (a peer without
// keys, with unknown or wrong keys) deliver nothing, are counted in GatewayStats and logged
// (rate-limited). ipc:// sockets live in directories only this user can use
// (transport/ipc_dir.hpp); inproc:// never leaves the process. The runtime always sets curve
// for topologies with tcp:// nodes; without it a gateway binds tcp only on loopback.
//
// The parts, each documented beside its code (private headers):
//   transport/link.hpp      sockets, the I/O thread, send paths, ordering, rejections
//   transport/zap.hpp       the process's ZAP handler (which CURVE clients are accepted)
//   transport/ipc_dir.hpp   private ipc socket directories
//   transport/liveness.hpp  application heartbeats and peer_down reports
//   transport/delivery.hpp  subscriptions, message priority, inline delivery, held messages
#pragma once

#include "specmesh/messages/protocol.hpp"

#include <caf/actor.hpp>

#include <array>
#include <chrono>
#include <cstdint>
#include <map>
#include <memory>
#include <optional>
#include <string>

namespace caf {
class actor_system_config;
}

namespace specmesh {

// CURVE settings of one gateway; keys are Z85 text (40 characters), as ZeroMQ and
// `specmesh keygen` write them.
struct CurveConfig {
  std::string public_key;  // this node's long-term key pair
  std::string secret_key;
  // Peer name -> its public key. Needed for every peer when we bind tcp (any peer may connect
  // to us), else for every peer reached over tcp; only listed peers are accepted.
  std::map<std::string, std::string> peer_keys;
};

struct GatewayConfig {
  std::string node;                          // our name; also our ZeroMQ routing id (1..255 bytes)
  std::string bind;                          // our data endpoint (control endpoint is derived)
  std::map<std::string, std::string> peers;  // peer name -> its data endpoint
  std::chrono::milliseconds heartbeat{100};     // application heartbeat interval
  std::chrono::milliseconds peer_timeout{300};  // silence after which a peer is reported down
  // How long a peer never heard from may take to appear before it is reported unreachable:
  // processes started together come up seconds apart on a loaded machine, and a peer that is
  // merely late must not be taken for one that died.
  std::chrono::milliseconds first_contact_timeout{10000};
  std::chrono::milliseconds linger{200};        // ZMQ_LINGER: bounded wait for unsent data at close
  bool allow_non_loopback = false;              // permit binding tcp to non-loopback interfaces (needs curve)
  int64_t max_message_bytes = int64_t{1} << 31; // ZMQ_MAXMSGSIZE per frame on our listening sockets
  // true: send() hands the message to ZeroMQ on the caller's thread (one thread wake-up less
  // per hop); false: every message goes through the I/O thread (see transport/link.hpp).
  bool send_from_caller = true;
  // CURVE on every tcp connection (see the top of this file); the node name must then be at
  // most 246 bytes (the routing id carries a per-connection suffix).
  std::optional<CurveConfig> curve;
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
  identity_mismatch,  // CURVE: the sender's key belongs to another node than the name it claims
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
  uint64_t held = 0;         // messages held now for a type nobody subscribed to yet
  uint64_t send_dropped = 0; // heartbeats dropped because the peer's queue was full
  // CURVE (tcp only): handshakes that failed on our sockets, either end (a peer without keys
  // or with wrong keys, a key we refused or one a peer refused), and the part of them our ZAP
  // handler refused because the client's public key is no configured peer's.
  uint64_t handshakes_failed = 0;
  uint64_t auth_denied = 0;
  std::array<uint64_t, kRejectReasonCount> rejected{};
  uint64_t rejected_total() const;
  uint64_t rejected_for(RejectReason r) const { return rejected[static_cast<std::size_t>(r)]; }
};

class Gateway {
 public:
  // Validates the config, binds, connects to all peers and starts the I/O thread.
  // Throws std::invalid_argument for a bad config (malformed or missing CURVE keys included)
  // and std::runtime_error if binding fails or an ipc directory is not private.
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
  // The same for several types at once: messages held before (sent before anyone subscribed)
  // reach `who` in the order they arrived, whatever their types.
  void subscribe(const std::vector<MsgType>& types, caf::actor who, Delivery how = Delivery::scheduled);
  // Removes `who` from all subscriptions. The gateway holds strong references to subscribers
  // until then (or until it is destroyed).
  void unsubscribe(const caf::actor& who);

  GatewayStats stats() const;
  // True from the first message heard from `peer` until it is reported down (an Error with
  // code peer_down to error subscribers). Wait for it before starting work if peers start in
  // any order.
  bool peer_alive(const std::string& peer) const;
  const GatewayConfig& config() const;
  std::string data_endpoint() const;
  std::string control_endpoint() const;

 private:
  struct Impl;
  std::unique_ptr<Impl> impl_;
};

// Derives the control endpoint from a data endpoint:
//   tcp://HOST:PORT  -> control on tcp://HOST:PORT+1   (HOST must be loopback unless
//                       allow_non_loopback and curve; peers are connected wherever they are)
//   ipc://PATH       -> control on ipc://PATH.ctl
//   inproc://NAME    -> control on inproc://NAME.ctl   (gateways of one process share a
//                       process-wide ZeroMQ context, so inproc links work between them)
// Throws std::invalid_argument for unsupported transports or malformed tcp endpoints.
std::string control_endpoint_for(const std::string& data_endpoint);

// CAF scheduler settings for processes hosting a gateway: the work-sharing policy, whose idle
// workers block on a condition variable and are woken by the enqueue, with `max_threads`
// workers. CAF's default work stealing sleep-polls (50 us naps before it blocks), which made
// a scheduled-delivery round trip (ipc, 1 KiB, idle VM) 266 us against 157 us with sharing
// (raw ZeroMQ 94 us). One worker by default: the actors on it route messages and sample
// tokens, while the work runs on the devices' own threads (detached actors), so a second
// worker mostly turned actor-to-actor hops into wake-ups of another thread. With one, a run
// through the runtime in one process cost 62 us beyond its forward pass instead of 152-217 us
// (bench_run_cost, stories-target-1M, 2-core VM). Call before constructing the actor_system.
void configure_low_latency_scheduler(caf::actor_system_config& cfg, std::size_t max_threads = 1);

}  // namespace specmesh

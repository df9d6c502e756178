// The gateway's ZeroMQ side (private to transport/): its sockets, the I/O thread that polls
// them, and the paths by which messages leave and enter the process.
//
// Topology: each node binds two ROUTER sockets (data and control) and connects two DEALERs
// (routing id = node name) to every configured peer. Control traffic (cancel, heartbeat,
// error) has its own socket and TCP connection, and is received and sent before data, so a
// cancel is never stuck behind queued tensors. control_endpoint_for() (gateway.hpp) derives
// the control endpoint from the data endpoint.
//
// Ordering: every (link, channel) carries its own sequence numbers, starting at 0 for each
// sender session (a random id per Gateway instance, so a restarted peer starts a new stream).
// A gap, duplicate or reordered message is rejected, logged and counted. After a gap the
// receiver resynchronises so the link keeps working, and error subscribers receive an
// Error{code = messages_lost, peer = name} envelope, since runs in flight may be broken.
//
// Threading: the I/O thread (named "specmesh-gw") owns the listening ROUTERs (receive, decode,
// hand on), runs the timers of LinkEvents and polls. Each outgoing DEALER belongs to its link
// and is used under the link's mutex, which is the full memory barrier ZeroMQ requires for a
// socket to change threads; so send() encodes and hands the message to ZeroMQ directly on the
// calling actor's thread. Only when ZeroMQ refuses (high-water mark reached) are messages
// parked, and the I/O thread then owns that DEALER until the backlog is flushed, keeping order.
//
// Rejections (malformed, truncated, wrong version, unknown peer, bad sequence, ...) never
// stop the gateway: each is logged through spdlog with its reason and counted.
//
// CURVE (GatewayConfig::curve, tcp endpoints only): our ROUTERs are CURVE servers with a ZAP
// domain of their own (zap.hpp), which accepts the configured peers' public keys and names
// the connection after the key's node (ZeroMQ's User-Id message property). Our DEALERs are
// CURVE clients that take the peer's public key as server key. A DEALER's routing id is then
// its node name, a NUL byte and 8 random bytes, new for every socket: the name is what the
// peer claims, and recv_one() accepts a message only if the User-Id of its connection is that
// name (RejectReason::identity_mismatch otherwise). The random part keeps routing ids unique
// per connection, so a restarted peer never collides with its old connection and the ROUTERs
// can refuse duplicates (ZMQ_ROUTER_HANDOVER off): a key holder claiming another node's name
// cannot take over that node's connection. Handshake failures on any of these sockets are read
// from ZeroMQ socket monitors on the I/O thread, counted and logged (rate-limited).
#pragma once

#include "specmesh/messages/protocol.hpp"
#include "specmesh/transport/gateway.hpp"

#include <zmq.hpp>

#include <array>
#include <atomic>
#include <chrono>
#include <cstdint>
#include <deque>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <unordered_map>
#include <utility>
#include <vector>

namespace specmesh::gw {

class ZapDomain;

// The ZeroMQ context of every gateway of this process, so that inproc:// links work between
// them (and one ZAP handler serves them all).
zmq::context_t& process_context();

using Clock = std::chrono::steady_clock;
enum Channel : int { kData = 0, kControl = 1 };
const char* channel_name(int ch);

// What the I/O thread hands to the rest of the gateway; called on the I/O thread only.
class LinkEvents {
 public:
  virtual ~LinkEvents() = default;
  // Any message from a configured peer, accepted or not: the peer's process is there.
  virtual void heard(uint32_t peer) = 0;
  // An accepted message in sequence order, or the messages_lost Error of a gap.
  virtual void arrived(const std::string& from, Envelope&& env) = 0;
  // Runs after every poll; the poll sleeps until next_tick() at the latest.
  virtual void tick(Clock::time_point now) = 0;
  virtual Clock::time_point next_tick() const = 0;
};

// One peer: our two DEALERs connected to it and the sequence state of both directions.
struct Link {
  uint32_t index = 0;  // position in Links, stable for the gateway's lifetime
  std::string name;
  std::string endpoint[2];
  // Outgoing side, guarded by `mu`. The DEALERs only ever send, so whoever holds `mu` may use
  // them. While pending[ch] is non-empty only the I/O thread touches out[ch]: it polls it for
  // POLLOUT without holding `mu`, and it is the only one that empties pending.
  std::mutex mu;
  zmq::socket_t out[2];
  uint64_t next_seq[2] = {0, 0};
  std::deque<Envelope> pending[2];  // waiting for the I/O thread (HWM reached, or queued mode)
  // Incoming side, I/O thread only.
  bool in_started[2] = {false, false};
  uint64_t in_session[2] = {0, 0};
  uint64_t in_next[2] = {0, 0};
};

class Links {
 public:
  // Checks the endpoints, binds our ROUTERs and connects a Link to every peer. Throws
  // std::invalid_argument for a bad endpoint and std::runtime_error if binding fails.
  explicit Links(const GatewayConfig& cfg);
  // Stops the I/O thread if it runs and closes the sockets (waiting at most `linger`).
  ~Links();
  Links(const Links&) = delete;
  Links& operator=(const Links&) = delete;

  // Starts the I/O thread, which reports to `events` until stop().
  void start(LinkEvents& events);
  // Joins the I/O thread after handing what is still queued to ZeroMQ; sends fail from now on.
  void stop();

  // Any thread. Sends at once unless messages are already waiting (order is kept) or the
  // config asks for I/O-thread sends; otherwise parks the message for the I/O thread.
  // False for an unknown peer or while stopping; throws std::invalid_argument, on the
  // caller's thread, for a tensor whose byte size contradicts its shape.
  bool send(const std::string& peer, Envelope env);
  // Any thread. Sends on the control channel at once or not at all (backlog or HWM): for
  // messages that are worthless late.
  bool send_now(Link& l, Envelope& env);

  std::size_t size() const { return links_.size(); }
  Link& operator[](std::size_t i) { return *links_[i]; }
  const Link* find(const std::string& peer) const;
  const std::string& endpoint(int ch) const { return endpoint_[ch]; }

  uint64_t sent() const { return n_sent_.load(); }
  uint64_t received() const { return n_received_.load(); }
  uint64_t rejected(RejectReason r) const { return n_rejected_[static_cast<std::size_t>(r)].load(); }
  uint64_t handshakes_failed() const { return n_handshakes_failed_.load(); }
  uint64_t auth_denied() const;

 private:
  void open();
  void run();
  bool try_send(Link& l, int ch, Envelope& env);
  void wake();
  void flush_pending(Link& l, int ch);
  void flush_all_pending();
  bool recv_one(int ch);
  void drain_control();
  bool check_sequence(Link& l, int ch, const Envelope& env);
  void reject(RejectReason r, const std::string& peer, int ch, const std::string& detail);
  // CURVE handshake failures of `s`, read from a socket monitor by the I/O thread.
  void watch_handshakes(zmq::socket_t& s, const std::string& what);
  void read_monitor(std::size_t i);

  const GatewayConfig& cfg_;
  std::string endpoint_[2];
  uint64_t session_;
  zmq::socket_t in_[2];  // ROUTERs
  bool curve_in_ = false;  // our ROUTERs are CURVE servers (curve set and a tcp bind)
  std::unique_ptr<ZapDomain> zap_;
  struct Monitor {
    void* watched;        // the monitored socket's handle
    zmq::socket_t events; // PAIR receiving its events
    std::string what;     // "incoming data", "control to 'stage1'", ... for logs
  };
  std::vector<Monitor> monitors_;
  std::atomic<uint64_t> n_handshakes_failed_{0};
  std::vector<std::unique_ptr<Link>> links_;
  std::unordered_map<std::string, uint32_t> index_;
  int wake_fd_ = -1;  // wakes the I/O thread: new pending messages, or shutdown
  std::atomic<bool> stopping_{false};
  LinkEvents* events_ = nullptr;
  std::thread io_;

  std::atomic<uint64_t> n_sent_{0}, n_received_{0};
  std::array<std::atomic<uint64_t>, kRejectReasonCount> n_rejected_{};

  // I/O-thread scratch, reused to avoid per-message allocations.
  std::vector<zmq::message_t> frames_;
  std::vector<Blob> in_blobs_;
  std::vector<zmq_pollitem_t> items_;
  std::vector<std::pair<Link*, int>> item_links_;
};

}  // namespace specmesh::gw

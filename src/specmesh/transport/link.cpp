#include "specmesh/transport/link.hpp"

#include "specmesh/log/rate_limited.hpp"
#include "specmesh/transport/curve.hpp"
#include "specmesh/transport/endpoint.hpp"
#include "specmesh/transport/ipc_dir.hpp"
#include "specmesh/transport/zap.hpp"

#include <spdlog/spdlog.h>

#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <algorithm>
#include <cstdio>
#include <cstring>
#include <map>
#include <random>
#include <stdexcept>

namespace specmesh {

const char* to_string(RejectReason r) {
  switch (r) {
    case RejectReason::truncated: return "truncated";
    case RejectReason::malformed: return "malformed";
    case RejectReason::too_deep: return "too_deep";
    case RejectReason::trailing_bytes: return "trailing_bytes";
    case RejectReason::wrong_version: return "wrong_version";
    case RejectReason::unknown_type: return "unknown_type";
    case RejectReason::bad_enum: return "bad_enum";
    case RejectReason::bad_tensor: return "bad_tensor";
    case RejectReason::unknown_peer: return "unknown_peer";
    case RejectReason::bad_frames: return "bad_frames";
    case RejectReason::wrong_channel: return "wrong_channel";
    case RejectReason::seq_reordered: return "seq_reordered";
    case RejectReason::seq_gap: return "seq_gap";
    case RejectReason::identity_mismatch: return "identity_mismatch";
    case RejectReason::count_: break;
  }
  return "unknown";
}

namespace {

// Blobs below this size are copied into the frame: a ZeroMQ zero-copy frame costs an
// allocation plus a release callback, and small frames are copied into ZeroMQ's batch anyway.
constexpr std::size_t kZeroCopyMin = 8 * 1024;
// Header + tensor frames; far above any real message, low enough to bound per-message work.
constexpr std::size_t kMaxFrames = 1 + 256;
// Consecutive data messages received before control and pending sends are looked at again.
constexpr int kDataBatch = 16;

RejectReason reason_for(DecodeError e) {
  switch (e) {
    case DecodeError::truncated: return RejectReason::truncated;
    case DecodeError::too_deep: return RejectReason::too_deep;
    case DecodeError::trailing_bytes: return RejectReason::trailing_bytes;
    case DecodeError::wrong_version: return RejectReason::wrong_version;
    case DecodeError::unknown_type: return RejectReason::unknown_type;
    case DecodeError::bad_enum: return RejectReason::bad_enum;
    case DecodeError::bad_tensor: return RejectReason::bad_tensor;
    case DecodeError::none:
    case DecodeError::malformed: break;
  }
  return RejectReason::malformed;
}

// Routing ids of unknown senders are arbitrary bytes: keep logs printable and short.
std::string printable(const void* data, std::size_t n) {
  std::string s;
  auto p = static_cast<const unsigned char*>(data);
  for (std::size_t i = 0; i < n && i < 64; ++i) s += (p[i] >= 0x20 && p[i] < 0x7f) ? char(p[i]) : '?';
  return s;
}

bool is_tcp(const std::string& ep) { return ep.rfind("tcp://", 0) == 0; }
bool is_ipc(const std::string& ep) { return ep.rfind("ipc://", 0) == 0; }

// Other interfaces only on purpose, and only encrypted and authenticated.
void check_bind_allowed(const std::string& ep, bool allow_non_loopback, bool curve) {
  if (!is_tcp(ep) || is_loopback_host(parse_tcp(ep).host)) return;
  if (!allow_non_loopback)
    throw std::invalid_argument("bind endpoint '" + ep + "' is not a loopback address (127.x.x.x or [::1]); " +
                                "set allow_non_loopback to listen on other interfaces");
  if (!curve)
    throw std::invalid_argument("bind endpoint '" + ep + "' is not a loopback address, and listening on other " +
                                "interfaces needs CURVE keys (GatewayConfig::curve)");
}

// name, NUL, 8 random bytes: see "CURVE" in link.hpp.
std::string curve_routing_id(const std::string& node) {
  std::random_device rd;
  std::string id = node;
  id += '\0';
  for (int i = 0; i < 2; ++i) {
    const uint32_t r = rd();
    id.append(reinterpret_cast<const char*>(&r), sizeof r);
  }
  return id;
}

std::string describe_handshake_failure(uint16_t event, uint32_t value) {
  if (event == ZMQ_EVENT_HANDSHAKE_FAILED_AUTH)
    return "the key was refused (ZAP status " + std::to_string(value) + ": not a configured peer's key)";
  if (event == ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL) {
    if (value == ZMQ_PROTOCOL_ERROR_ZMTP_MECHANISM_MISMATCH) return "the other end does not use CURVE (no keys?)";
    if (value == ZMQ_PROTOCOL_ERROR_ZMTP_CRYPTOGRAPHIC)
      return "cryptographic error (the client has a wrong public key for this server?)";
    char buf[64];
    std::snprintf(buf, sizeof buf, "protocol error 0x%x", value);
    return buf;
  }
  return "no detail (errno " + std::to_string(value) + ")";
}

void release_blob(void*, void* hint) { delete static_cast<std::shared_ptr<const void>*>(hint); }

zmq::message_t frame_of(const Blob& b) {
  if (b.size() < kZeroCopyMin) return zmq::message_t(b.data(), b.size());
  return zmq::message_t(const_cast<std::byte*>(b.data()), b.size(), release_blob,
                        new std::shared_ptr<const void>(b.owner()));
}

// Throws here, on the caller's thread, so a bad tensor never reaches the I/O thread.
void check_tensors(const Envelope& env) {
  auto check = [](const Tensor& t) {
    if (t.data.size() != t.expected_bytes())
      throw std::invalid_argument("Gateway::send: tensor byte size does not match dtype and shape");
  };
  if (auto* a = std::get_if<Activations>(&env.payload))
    for (const auto& t : a->tensors) check(t);
  else if (auto* l = std::get_if<Logits>(&env.payload))
    check(l->logits);
}

uint64_t random_session() {
  std::random_device rd;
  uint64_t s = 0;
  while (s == 0) s = (uint64_t(rd()) << 32) ^ rd();
  return s;
}

// No ZMTP heartbeats (ZMQ_HEARTBEAT_IVL). A connection whose input ZeroMQ stopped because our
// receive queue is full cannot read the peer's answers to them, so they dropped it after the
// heartbeat timeout, and the messages behind it with it: the peer, redialling, took a new
// routing id. And libzmq 4.3.4, Debian bookworm's, aborts the process
// (stream_engine_base.cpp:331, libzmq issue #4364) when the peer closes such a connection and
// a heartbeat falls due before the queue drains: a peer that leaves while we are behind (the
// Gateway tests *FellBehind and *LeavesWhileItsQueueIsFull show both). Liveness (liveness.hpp)
// notices silent peers with its own heartbeats; a dead TCP connection, which only ZeroMQ can
// redial, is dropped by the kernel instead: once nothing sent on it is acknowledged for
// kDeadConnection (ZMQ_TCP_MAXRT, TCP_USER_TIMEOUT on Linux), or once keepalive probes on an
// idle one go unanswered. That is far longer than peer_timeout: a peer is reported down long
// before, and a congested link must not lose what it carries. A process that dies closes its
// end at once (on tcp too); the tcp options do nothing on ipc and inproc sockets.
constexpr std::chrono::seconds kDeadConnection{10};

void set_common(zmq::socket_t& s, const GatewayConfig& cfg) {
  s.set(zmq::sockopt::ipv6, 1);  // dual stack, so [::1] works as well as 127.0.0.1
  s.set(zmq::sockopt::linger, static_cast<int>(cfg.linger.count()));
  s.set(zmq::sockopt::tcp_maxrt, static_cast<int>(std::chrono::milliseconds(kDeadConnection).count()));
  s.set(zmq::sockopt::tcp_keepalive, 1);
  s.set(zmq::sockopt::tcp_keepalive_idle, static_cast<int>(kDeadConnection.count()) / 2);
  s.set(zmq::sockopt::tcp_keepalive_intvl, 1);
  s.set(zmq::sockopt::tcp_keepalive_cnt, static_cast<int>(kDeadConnection.count()) / 2);
}

}  // namespace

std::string control_endpoint_for(const std::string& ep) {
  if (ep.rfind("tcp://", 0) == 0) {
    auto t = parse_tcp(ep);
    return "tcp://" + t.host + ":" + std::to_string(t.port + 1);
  }
  if ((ep.rfind("ipc://", 0) == 0 && ep.size() > 6) || (ep.rfind("inproc://", 0) == 0 && ep.size() > 9))
    return ep + ".ctl";
  throw std::invalid_argument("endpoint '" + ep + "': expected tcp://, ipc:// or inproc://");
}

namespace gw {

// One context per process so that inproc:// links work between gateways of one process.
zmq::context_t& process_context() {
  static zmq::context_t ctx(1);
  return ctx;
}

const char* channel_name(int ch) { return ch == kControl ? "control" : "data"; }

Links::Links(const GatewayConfig& cfg) : cfg_(cfg), session_(random_session()) {
  check_bind_allowed(cfg_.bind, cfg_.allow_non_loopback, cfg_.curve.has_value());
  endpoint_[kData] = cfg_.bind;
  endpoint_[kControl] = control_endpoint_for(cfg_.bind);
  for (auto& [name, ep] : cfg_.peers) {
    if (name.empty() || name.size() > 255) throw std::invalid_argument("gateway: bad peer name '" + name + "'");
    (void)control_endpoint_for(ep);
  }
  wake_fd_ = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (wake_fd_ < 0) throw std::runtime_error("gateway: eventfd failed");
  try {
    open();
  } catch (...) {
    ::close(wake_fd_);
    throw;
  }
  std::string peers;
  for (auto& [name, ep] : cfg_.peers) peers += (peers.empty() ? "" : ", ") + name + "=" + ep;
  spdlog::info("gateway '{}': data {} control {}, peers [{}]{}", cfg_.node, endpoint_[kData], endpoint_[kControl],
               peers, cfg_.curve ? ", CURVE on tcp" : "");
}

void Links::open() {
  auto& ctx = process_context();
  const CurveConfig* curve = cfg_.curve ? &*cfg_.curve : nullptr;
  curve_in_ = curve && is_tcp(cfg_.bind);
  if (curve_in_) {
    std::map<std::string, std::string> accepted;  // raw public key -> node name
    for (const auto& [name, key] : curve->peer_keys) accepted[z85_key_bytes(key)] = name;
    zap_ = std::make_unique<ZapDomain>(cfg_.node, std::move(accepted));
  }
  if (is_ipc(cfg_.bind)) ensure_private_ipc_dir(cfg_.bind.substr(6));
  for (int ch : {kData, kControl}) {
    in_[ch] = zmq::socket_t(ctx, zmq::socket_type::router);
    set_common(in_[ch], cfg_);
    if (curve_in_) {
      in_[ch].set(zmq::sockopt::curve_server, 1);
      in_[ch].set(zmq::sockopt::curve_secretkey, curve->secret_key);
      in_[ch].set(zmq::sockopt::zap_domain, zap_->name());
      // Routing ids are unique per connection here (see link.hpp): a duplicate is a forgery.
      in_[ch].set(zmq::sockopt::router_handover, 0);
      // Refuse every client when the ZAP handler is missing (a draft option: where libzmq
      // lacks it, recv_one() still refuses messages without a User-Id).
      const int one = 1;
      (void)zmq_setsockopt(in_[ch].handle(), 93 /* ZMQ_ZAP_ENFORCE_DOMAIN */, &one, sizeof one);
      watch_handshakes(in_[ch], std::string("incoming ") + channel_name(ch));
    } else {
      // A restarted peer reuses its routing id; without handover its messages are dropped.
      in_[ch].set(zmq::sockopt::router_handover, 1);
    }
    in_[ch].set(zmq::sockopt::maxmsgsize, cfg_.max_message_bytes);
    try {
      in_[ch].bind(endpoint_[ch]);
    } catch (const zmq::error_t& e) {
      throw std::runtime_error("gateway '" + cfg_.node + "': cannot bind " + channel_name(ch) + " endpoint '" +
                               endpoint_[ch] + "': " + e.what());
    }
    if (is_ipc(endpoint_[ch])) make_ipc_file_private(endpoint_[ch].substr(6));
  }
  for (auto& [name, ep] : cfg_.peers) {
    auto l = std::make_unique<Link>();
    l->index = static_cast<uint32_t>(links_.size());
    l->name = name;
    l->endpoint[kData] = ep;
    l->endpoint[kControl] = control_endpoint_for(ep);
    // Connecting to a socket in a directory others control could reach anyone's listener.
    if (is_ipc(ep)) ensure_private_ipc_dir(ep.substr(6));
    const bool curve_out = curve && is_tcp(ep);
    for (int ch : {kData, kControl}) {
      l->out[ch] = zmq::socket_t(ctx, zmq::socket_type::dealer);
      set_common(l->out[ch], cfg_);
      if (curve_out) {
        l->out[ch].set(zmq::sockopt::curve_serverkey, curve->peer_keys.at(name));
        l->out[ch].set(zmq::sockopt::curve_publickey, curve->public_key);
        l->out[ch].set(zmq::sockopt::curve_secretkey, curve->secret_key);
        l->out[ch].set(zmq::sockopt::routing_id, zmq::buffer(curve_routing_id(cfg_.node)));
        watch_handshakes(l->out[ch], std::string(channel_name(ch)) + " to '" + name + "'");
      } else {
        l->out[ch].set(zmq::sockopt::routing_id, zmq::buffer(cfg_.node));
      }
      l->out[ch].connect(l->endpoint[ch]);
    }
    index_.emplace(name, l->index);
    links_.push_back(std::move(l));
  }
}

Links::~Links() {
  stop();
  for (auto& m : monitors_) {
    (void)zmq_socket_monitor(m.watched, nullptr, 0);
    m.events.close();
  }
  for (auto& l : links_)
    for (auto& s : l->out) s.close();
  for (auto& s : in_) s.close();
  ::close(wake_fd_);
}

uint64_t Links::auth_denied() const { return zap_ ? zap_->denied() : 0; }

void Links::watch_handshakes(zmq::socket_t& s, const std::string& what) {
  static std::atomic<uint64_t> next{0};
  const std::string ep = "inproc://specmesh-monitor-" + std::to_string(session_) + "-" + std::to_string(next++);
  if (zmq_socket_monitor(s.handle(), ep.c_str(),
                         ZMQ_EVENT_HANDSHAKE_FAILED_NO_DETAIL | ZMQ_EVENT_HANDSHAKE_FAILED_PROTOCOL |
                             ZMQ_EVENT_HANDSHAKE_FAILED_AUTH) != 0)
    throw std::runtime_error("gateway '" + cfg_.node + "': cannot monitor a socket: " + zmq_strerror(zmq_errno()));
  Monitor m{s.handle(), zmq::socket_t(process_context(), zmq::socket_type::pair), what};
  m.events.set(zmq::sockopt::linger, 0);
  m.events.connect(ep);
  monitors_.push_back(std::move(m));
}

// I/O thread: one event is two frames, (u16 event, u32 value) and the peer's address.
void Links::read_monitor(std::size_t i) {
  Monitor& m = monitors_[i];
  for (int k = 0; k < 64; ++k) {
    zmq::message_t ev, addr;
    if (!m.events.recv(ev, zmq::recv_flags::dontwait)) return;
    if (ev.more()) (void)m.events.recv(addr);
    if (ev.size() < 6) continue;
    uint16_t event;
    uint32_t value;
    std::memcpy(&event, ev.data(), sizeof event);
    std::memcpy(&value, static_cast<const char*>(ev.data()) + 2, sizeof value);
    const uint64_t n = n_handshakes_failed_.fetch_add(1, std::memory_order_relaxed) + 1;
    // A peer with wrong keys retries every reconnect interval: keep the log readable.
    if (n <= 10 || n % 100 == 0)
      spdlog::warn("gateway '{}': CURVE handshake failed on {} ({}): {} (#{} handshake failure)", cfg_.node, m.what,
                   addr.to_string(), describe_handshake_failure(event, value), n);
  }
}

void Links::start(LinkEvents& events) {
  events_ = &events;
  // Sockets were created on this thread; starting the thread is the memory barrier that
  // hands them over to the I/O thread, which owns them from now on.
  io_ = std::thread([this] { run(); });
}

void Links::stop() {
  stopping_.store(true);
  if (!io_.joinable()) return;
  wake();
  io_.join();
}

const Link* Links::find(const std::string& peer) const {
  auto it = index_.find(peer);
  return it == index_.end() ? nullptr : links_[it->second].get();
}

// --- sending ---------------------------------------------------------------------------

// Hands one message to ZeroMQ; false if the peer's queue is full (HWM). Caller holds l.mu.
bool Links::try_send(Link& l, int ch, Envelope& env) {
  // Per thread: senders encode on their own thread, in parallel with the I/O thread.
  thread_local std::vector<char> header;
  thread_local std::vector<Blob> blobs;
  env.session = session_;
  env.seq = l.next_seq[ch];
  encode(env, header, blobs);
  zmq::message_t head(header.data(), header.size());
  auto flags = zmq::send_flags::dontwait;
  if (!blobs.empty()) flags = flags | zmq::send_flags::sndmore;
  if (!l.out[ch].send(head, flags)) {
    blobs.clear();
    return false;
  }
  // Once the first part is accepted ZeroMQ accepts the rest of the message.
  for (std::size_t i = 0; i < blobs.size(); ++i) {
    auto f = frame_of(blobs[i]);
    (void)l.out[ch].send(f, i + 1 < blobs.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
  blobs.clear();
  ++l.next_seq[ch];
  n_sent_.fetch_add(1, std::memory_order_relaxed);
  return true;
}

void Links::wake() {
  uint64_t one = 1;
  (void)!::write(wake_fd_, &one, sizeof one);
}

// Messages parked per link and channel before send() refuses more: a peer that stops reading
// (or a flood of replies to one) cannot make this process queue without end. A pipeline keeps
// at most a few thousand messages in flight towards one peer; ZeroMQ itself holds its
// high-water mark (1000) before anything is parked.
constexpr std::size_t kMaxPending = 65536;

bool Links::send(const std::string& peer, Envelope env) {
  auto it = index_.find(peer);
  if (it == index_.end()) {
    spdlog::warn("gateway '{}': send to unknown peer '{}'", cfg_.node, peer);
    return false;
  }
  check_tensors(env);
  if (stopping_.load()) return false;
  Link& l = *links_[it->second];
  const int ch = is_control(env.type()) ? kControl : kData;
  bool was_empty;
  {
    std::lock_guard<std::mutex> g(l.mu);
    was_empty = l.pending[ch].empty();
    if (was_empty && cfg_.send_from_caller && try_send(l, ch, env)) return true;
    if (l.pending[ch].size() >= kMaxPending) {
      static RateLimitedLog full_log;
      full_log.log(peer, spdlog::level::warn,
                   "gateway '" + cfg_.node + "': " + std::to_string(kMaxPending) + " messages wait for '" + peer +
                       "' on " + channel_name(ch) + " channel; " + to_string(env.type()) + " not sent");
      return false;
    }
    l.pending[ch].push_back(std::move(env));
  }
  // A non-empty queue is already in the I/O thread's poll set.
  if (was_empty) wake();
  return true;
}

bool Links::send_now(Link& l, Envelope& env) {
  std::lock_guard<std::mutex> g(l.mu);
  return l.pending[kControl].empty() && try_send(l, kControl, env);
}

// I/O thread: sends parked messages until ZeroMQ refuses (then POLLOUT is awaited).
void Links::flush_pending(Link& l, int ch) {
  std::lock_guard<std::mutex> g(l.mu);
  auto& p = l.pending[ch];
  while (!p.empty() && try_send(l, ch, p.front())) p.pop_front();
  // A drained deque keeps its map, sized for the longest backlog it held: start afresh.
  if (p.empty()) std::deque<Envelope>().swap(p);
}

void Links::flush_all_pending() {
  // Control first: a cancel must not wait behind data.
  for (int ch : {kControl, kData})
    for (auto& l : links_) flush_pending(*l, ch);
}

// --- receiving -------------------------------------------------------------------------

void Links::reject(RejectReason r, const std::string& peer, int ch, const std::string& detail) {
  uint64_t n = n_rejected_[static_cast<std::size_t>(r)].fetch_add(1, std::memory_order_relaxed) + 1;
  // A hostile or broken peer must not be able to flood the log.
  if (n <= 100 || n % 1000 == 0)
    spdlog::warn("gateway '{}': rejected message from '{}' on {} channel: {}: {} (#{} for this reason)", cfg_.node,
                 peer, channel_name(ch), to_string(r), detail, n);
}

// Receives and handles one message; false when the socket has nothing to read.
bool Links::recv_one(int ch) {
  zmq::message_t id;
  if (!in_[ch].recv(id, zmq::recv_flags::dontwait)) return false;
  frames_.clear();
  bool too_many = false;
  // Parts of one message arrive together, so the blocking receives return at once.
  for (bool more = id.more(); more;) {
    zmq::message_t f;
    (void)in_[ch].recv(f);
    more = f.more();
    if (frames_.size() < kMaxFrames) frames_.push_back(std::move(f));
    else too_many = true;
  }
  std::string claimed(static_cast<const char*>(id.data()), id.size());
  if (curve_in_) {
    // The name part of the routing id (see link.hpp) must be the node whose key ZAP accepted.
    claimed = claimed.substr(0, claimed.find('\0'));
    const char* user = frames_.empty() ? nullptr : zmq_msg_gets(frames_[0].handle(), "User-Id");
    if (user == nullptr || claimed != user) {
      reject(RejectReason::identity_mismatch, printable(claimed.data(), claimed.size()), ch,
             user ? "its CURVE key is node '" + std::string(user) + "'s" : std::string("no authenticated CURVE key"));
      return true;
    }
  }
  auto it = index_.find(claimed);
  if (it == index_.end()) {
    reject(RejectReason::unknown_peer, printable(id.data(), id.size()), ch, "routing id not configured");
    return true;
  }
  Link& l = *links_[it->second];
  events_->heard(l.index);
  if (too_many || frames_.empty()) {
    reject(RejectReason::bad_frames, l.name, ch,
           too_many ? "more than " + std::to_string(kMaxFrames) + " frames" : std::string("no header frame"));
    return true;
  }
  in_blobs_.clear();
  for (std::size_t i = 1; i < frames_.size(); ++i) {
    // The blob keeps the received frame alive: tensors are handed to actors without a copy.
    auto owner = std::make_shared<zmq::message_t>(std::move(frames_[i]));
    in_blobs_.emplace_back(owner, owner->data(), owner->size());
  }
  auto res = decode(std::span<const std::byte>(static_cast<const std::byte*>(frames_[0].data()), frames_[0].size()),
                    in_blobs_);
  in_blobs_.clear();
  if (!res.ok()) {
    reject(reason_for(res.error), l.name, ch, res.detail);
    return true;
  }
  Envelope& env = res.envelope;
  if (is_control(env.type()) != (ch == kControl)) {
    reject(RejectReason::wrong_channel, l.name, ch, std::string(to_string(env.type())) + " does not belong here");
    return true;
  }
  if (!check_sequence(l, ch, env)) return true;
  n_received_.fetch_add(1, std::memory_order_relaxed);
  events_->arrived(l.name, std::move(env));
  return true;
}

bool Links::check_sequence(Link& l, int ch, const Envelope& env) {
  if (!l.in_started[ch] || l.in_session[ch] != env.session) {
    if (l.in_started[ch])
      spdlog::info("gateway '{}': peer '{}' started a new session on {} channel", cfg_.node, l.name, channel_name(ch));
    // A fresh receiver cannot know what it missed before it started listening.
    if (env.seq != 0)
      spdlog::warn("gateway '{}': joined {} stream of '{}' at seq {}", cfg_.node, channel_name(ch), l.name, env.seq);
    l.in_started[ch] = true;
    l.in_session[ch] = env.session;
    l.in_next[ch] = env.seq + 1;
    return true;
  }
  uint64_t expected = l.in_next[ch];
  if (env.seq == expected) {
    l.in_next[ch] = expected + 1;
    return true;
  }
  if (env.seq > expected) {
    std::string what = "seq " + std::to_string(env.seq) + ", expected " + std::to_string(expected) + " (" +
                       std::to_string(env.seq - expected) + " missing)";
    // The message after a gap is dropped too: acting on it could corrupt state that the lost
    // ones would have set up (a KV cache, say). Subscribers learn about the loss.
    reject(RejectReason::seq_gap, l.name, ch, what);
    l.in_next[ch] = env.seq + 1;  // resynchronise so later messages are accepted
    events_->arrived(l.name, make_envelope(0, Error{ErrorCode::messages_lost, l.name,
                                                    std::string("messages from '") + l.name + "' lost on " +
                                                        channel_name(ch) + " channel: " + what}));
    return false;
  }
  reject(RejectReason::seq_reordered, l.name, ch,
         "seq " + std::to_string(env.seq) + ", expected " + std::to_string(expected));
  return false;
}

void Links::drain_control() {
  for (int i = 0; i < 256 && recv_one(kControl); ++i) {
  }
}

// --- the I/O loop ----------------------------------------------------------------------

void Links::run() {
  pthread_setname_np(pthread_self(), "specmesh-gw");
  while (!stopping_.load()) {
    items_.clear();
    item_links_.clear();
    items_.push_back({nullptr, wake_fd_, ZMQ_POLLIN, 0});
    items_.push_back({in_[kControl].handle(), 0, ZMQ_POLLIN, 0});
    items_.push_back({in_[kData].handle(), 0, ZMQ_POLLIN, 0});
    for (auto& l : links_) {
      std::lock_guard<std::mutex> g(l->mu);
      for (int ch : {kControl, kData})
        if (!l->pending[ch].empty()) {
          items_.push_back({l->out[ch].handle(), 0, ZMQ_POLLOUT, 0});
          item_links_.emplace_back(l.get(), ch);
        }
    }
    const std::size_t first_monitor = items_.size();
    for (auto& m : monitors_) items_.push_back({m.events.handle(), 0, ZMQ_POLLIN, 0});
    auto wait = std::chrono::ceil<std::chrono::milliseconds>(events_->next_tick() - Clock::now()).count();
    int rc = zmq_poll(items_.data(), static_cast<int>(items_.size()), std::max<long>(wait, 0));
    if (rc < 0) {
      if (zmq_errno() == ETERM) break;
      if (zmq_errno() != EINTR) spdlog::error("gateway '{}': zmq_poll: {}", cfg_.node, zmq_strerror(zmq_errno()));
      continue;
    }
    try {
      // Control first: a cancel must not wait behind data in either direction.
      if (items_[1].revents & ZMQ_POLLIN) drain_control();
      if (items_[0].revents & ZMQ_POLLIN) {
        uint64_t v;
        (void)!::read(wake_fd_, &v, sizeof v);
        flush_all_pending();
      } else {
        for (std::size_t i = 0; i < item_links_.size(); ++i)
          if (items_[3 + i].revents & ZMQ_POLLOUT) flush_pending(*item_links_[i].first, item_links_[i].second);
      }
      if (items_[2].revents & ZMQ_POLLIN) {
        for (int i = 0; i < kDataBatch && recv_one(kData); ++i) drain_control();
      }
      for (std::size_t i = 0; i < monitors_.size(); ++i)
        if (items_[first_monitor + i].revents & ZMQ_POLLIN) read_monitor(i);
      events_->tick(Clock::now());
    } catch (const zmq::error_t& e) {
      if (e.num() == ETERM) break;
      spdlog::error("gateway '{}': I/O error: {}", cfg_.node, e.what());
    } catch (const std::exception& e) {
      spdlog::error("gateway '{}': I/O thread: {}", cfg_.node, e.what());
    }
  }
  // Best effort: hand what is still queued to ZeroMQ; linger bounds the wait at close.
  flush_all_pending();
}

}  // namespace gw
}  // namespace specmesh

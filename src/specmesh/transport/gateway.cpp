#include "specmesh/transport/gateway.hpp"

#include <caf/abstract_actor.hpp>
#include <caf/actor_cast.hpp>
#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/atom.hpp>
#include <caf/execution_unit.hpp>
#include <caf/mailbox_element.hpp>
#include <caf/resumable.hpp>
#include <caf/scheduler/abstract_coordinator.hpp>

#include <spdlog/spdlog.h>
#include <zmq.hpp>

#include <arpa/inet.h>
#include <netinet/in.h>
#include <pthread.h>
#include <sys/eventfd.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <mutex>
#include <random>
#include <stdexcept>
#include <thread>
#include <unordered_map>
#include <vector>

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
    case RejectReason::count_: break;
  }
  return "unknown";
}

uint64_t GatewayStats::rejected_total() const {
  uint64_t n = 0;
  for (auto v : rejected) n += v;
  return n;
}

namespace {

using Clock = std::chrono::steady_clock;
enum Channel : int { kData = 0, kControl = 1 };
const char* channel_name(int ch) { return ch == kControl ? "control" : "data"; }

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

struct TcpParts {
  std::string host;
  int port = 0;
};

TcpParts parse_tcp(const std::string& ep) {
  auto rest = ep.substr(6);
  auto colon = rest.rfind(':');
  if (colon == std::string::npos || colon == 0 || colon + 1 == rest.size())
    throw std::invalid_argument("endpoint '" + ep + "': expected tcp://HOST:PORT");
  TcpParts t;
  t.host = rest.substr(0, colon);
  std::size_t used = 0;
  try {
    t.port = std::stoi(rest.substr(colon + 1), &used);
  } catch (const std::exception&) {
    used = 0;
  }
  if (used != rest.size() - colon - 1 || t.port <= 0 || t.port >= 65535)
    throw std::invalid_argument("endpoint '" + ep + "': port must be 1..65534 (control uses port+1)");
  return t;
}

// Literal addresses only: ZeroMQ binds interface names and addresses, never DNS names.
bool is_loopback_host(std::string h) {
  if (h.size() > 2 && h.front() == '[' && h.back() == ']') h = h.substr(1, h.size() - 2);
  in_addr v4{};
  if (::inet_pton(AF_INET, h.c_str(), &v4) == 1) return (ntohl(v4.s_addr) >> 24) == 127;
  in6_addr v6{};
  return ::inet_pton(AF_INET6, h.c_str(), &v6) == 1 && IN6_IS_ADDR_LOOPBACK(&v6);
}

void check_bind_allowed(const std::string& ep, bool allow_non_loopback) {
  if (ep.rfind("tcp://", 0) != 0 || allow_non_loopback) return;
  auto host = parse_tcp(ep).host;
  if (!is_loopback_host(host))
    throw std::invalid_argument("bind endpoint '" + ep + "' is not a loopback address (127.x.x.x or [::1]); " +
                                "set allow_non_loopback to listen on other interfaces");
}

// One context per process so that inproc:// links work between gateways of one process.
zmq::context_t& process_context() {
  static zmq::context_t ctx(1);
  return ctx;
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

// Runs an actor on the calling (I/O) thread when a delivery wakes it up, instead of waking a
// CAF worker. CAF calls exec_later() from inside enqueue() exactly when the enqueue unblocked
// the actor, so at most one thread ever resumes it, as with a scheduler worker. Anything else
// scheduled through this unit (actors the inline actor messages or spawns) goes to the
// regular scheduler: only the subscriber itself runs inline.
class InlineUnit : public caf::execution_unit {
 public:
  explicit InlineUnit(caf::actor_system* sys) : caf::execution_unit(sys) {}

  void exec_later(caf::resumable* job) override {
    if (capturing_ && captured_ == nullptr) {
      captured_ = job;
      return;
    }
    system().scheduler().enqueue(job);
  }

  void deliver(caf::abstract_actor* dest, caf::mailbox_element_ptr elem) {
    capturing_ = true;
    dest->enqueue(std::move(elem), this);
    capturing_ = false;
    auto* job = std::exchange(captured_, nullptr);
    if (job == nullptr) return;
    // One message per inline run; a longer backlog is left to the scheduler, mirroring what
    // a worker does with resume_later.
    switch (job->resume(this, 1)) {
      case caf::resumable::resume_later:
        system().scheduler().enqueue(job);  // hands over our reference
        break;
      case caf::resumable::done:
      case caf::resumable::awaiting_message:
      case caf::resumable::shutdown_execution_unit:
        caf::intrusive_ptr_release(job);
        break;
    }
  }

 private:
  bool capturing_ = false;
  caf::resumable* captured_ = nullptr;
};

uint64_t random_session() {
  std::random_device rd;
  uint64_t s = 0;
  while (s == 0) s = (uint64_t(rd()) << 32) ^ rd();
  return s;
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

void configure_low_latency_scheduler(caf::actor_system_config& cfg, std::size_t max_threads) {
  cfg.set("scheduler.policy", caf::atom("sharing"));
  cfg.set("scheduler.max-threads", max_threads);
}

struct Link {
  std::string name;
  std::string endpoint[2];
  // Outgoing side, guarded by `mu`. The DEALERs only ever send, so whoever holds `mu` may use
  // them (the mutex is the full memory barrier ZeroMQ requires when a socket changes
  // threads). While pending[ch] is non-empty only the I/O thread touches out[ch]: it polls it
  // for POLLOUT without holding `mu`, and it is the only one that empties pending.
  std::mutex mu;
  zmq::socket_t out[2];                // DEALERs connected to the peer's ROUTERs
  uint64_t next_seq[2] = {0, 0};
  std::deque<Envelope> pending[2];     // waiting for the I/O thread (HWM reached, or queued mode)
  // Incoming side, I/O thread only.
  bool in_started[2] = {false, false};
  uint64_t in_session[2] = {0, 0};
  uint64_t in_next[2] = {0, 0};
  Clock::time_point last_heard;        // any frame from this peer; starts at gateway start
  bool ever_heard = false;
  bool reported_down = false;
  std::atomic<bool> alive{false};
};

struct Gateway::Impl {
  GatewayConfig cfg;
  std::string endpoint[2];
  uint64_t session = random_session();
  zmq::socket_t in[2];  // ROUTERs
  std::vector<std::unique_ptr<Link>> links;
  std::unordered_map<std::string, uint32_t> link_index;
  int wake_fd = -1;  // wakes the I/O thread: new pending messages, or shutdown
  std::atomic<bool> stopping{false};

  struct Subscriber {
    caf::actor actor;
    Delivery how;
  };
  mutable std::mutex sub_mu;
  std::array<std::vector<Subscriber>, kMsgTypeMax + 1> subs;
  std::unique_ptr<InlineUnit> inline_unit;  // I/O thread only; created on first inline delivery

  std::atomic<uint64_t> n_sent{0}, n_received{0}, n_delivered{0}, n_unrouted{0}, n_send_dropped{0};
  static constexpr std::size_t kMaxHeld = 65536;
  std::array<std::deque<std::pair<std::string, Envelope>>, kMsgTypeMax + 1> held;  // guarded by sub_mu
  std::array<std::atomic<uint64_t>, kRejectReasonCount> n_rejected{};

  std::thread io;

  // I/O-thread scratch, reused to avoid per-message allocations.
  std::vector<zmq::message_t> frames;
  std::vector<Blob> in_blobs;
  std::vector<zmq_pollitem_t> items;
  std::vector<std::pair<Link*, int>> item_links;
  std::vector<Subscriber> targets;

  explicit Impl(GatewayConfig c) : cfg(std::move(c)) {}

  void set_common(zmq::socket_t& s) {
    s.set(zmq::sockopt::ipv6, 1);  // dual stack, so [::1] works as well as 127.0.0.1
    s.set(zmq::sockopt::linger, static_cast<int>(cfg.linger.count()));
    s.set(zmq::sockopt::heartbeat_ivl, static_cast<int>(cfg.heartbeat.count()));
    s.set(zmq::sockopt::heartbeat_timeout, static_cast<int>(cfg.peer_timeout.count()));
    s.set(zmq::sockopt::heartbeat_ttl, static_cast<int>(cfg.peer_timeout.count()));
  }

  void open() {
    auto& ctx = process_context();
    for (int ch : {kData, kControl}) {
      in[ch] = zmq::socket_t(ctx, zmq::socket_type::router);
      set_common(in[ch]);
      // A restarted peer reuses its routing id; without handover its messages are dropped.
      in[ch].set(zmq::sockopt::router_handover, 1);
      in[ch].set(zmq::sockopt::maxmsgsize, cfg.max_message_bytes);
      try {
        in[ch].bind(endpoint[ch]);
      } catch (const zmq::error_t& e) {
        throw std::runtime_error("gateway '" + cfg.node + "': cannot bind " + channel_name(ch) +
                                 " endpoint '" + endpoint[ch] + "': " + e.what());
      }
    }
    for (auto& [name, ep] : cfg.peers) {
      auto l = std::make_unique<Link>();
      l->name = name;
      l->endpoint[kData] = ep;
      l->endpoint[kControl] = control_endpoint_for(ep);
      l->last_heard = Clock::now();
      for (int ch : {kData, kControl}) {
        l->out[ch] = zmq::socket_t(ctx, zmq::socket_type::dealer);
        set_common(l->out[ch]);
        l->out[ch].set(zmq::sockopt::routing_id, zmq::buffer(cfg.node));
        l->out[ch].connect(l->endpoint[ch]);
      }
      link_index.emplace(name, static_cast<uint32_t>(links.size()));
      links.push_back(std::move(l));
    }
  }

  // --- statistics and rejection ----------------------------------------------------------

  void reject(RejectReason r, const std::string& peer, int ch, const std::string& detail) {
    uint64_t n = n_rejected[static_cast<std::size_t>(r)].fetch_add(1, std::memory_order_relaxed) + 1;
    // A hostile or broken peer must not be able to flood the log.
    if (n <= 100 || n % 1000 == 0)
      spdlog::warn("gateway '{}': rejected message from '{}' on {} channel: {}: {} (#{} for this reason)",
                   cfg.node, peer, channel_name(ch), to_string(r), detail, n);
  }

  // --- delivery --------------------------------------------------------------------------

  void deliver(const std::string& from, Envelope&& env) {
    const auto id = caf::make_message_id(is_control(env.type()) ? caf::message_priority::high
                                                                : caf::message_priority::normal);
    {
      // A copy, so handlers running inline may (un)subscribe without deadlocking.
      std::lock_guard<std::mutex> g(sub_mu);
      targets = subs[static_cast<std::size_t>(env.type())];
      if (targets.empty()) {
        // Peers may talk before this process has subscribed its actors: hold the message
        // for the first subscriber (bounded; the oldest goes when full).
        auto& h = held[static_cast<std::size_t>(env.type())];
        if (h.size() >= kMaxHeld) {
          h.pop_front();
          n_unrouted.fetch_add(1, std::memory_order_relaxed);
          spdlog::debug("gateway '{}': no subscriber for {} from '{}'", cfg.node, to_string(env.type()), from);
        }
        h.emplace_back(from, std::move(env));
        return;
      }
    }
    n_delivered.fetch_add(targets.size(), std::memory_order_relaxed);
    if (targets.size() == 1) {
      push(targets[0], caf::make_mailbox_element(nullptr, id, {}, from, std::move(env)));
    } else {
      // One shared (copy-on-write) message for all subscribers.
      auto msg = caf::make_message(from, std::move(env));
      for (auto& t : targets) push(t, caf::make_mailbox_element(nullptr, id, {}, msg));
    }
    targets.clear();
  }

  void push(const Subscriber& t, caf::mailbox_element_ptr elem) {
    auto* dest = caf::actor_cast<caf::abstract_actor*>(t.actor);
    if (dest == nullptr) return;
    if (t.how == Delivery::inline_io) {
      if (!inline_unit) inline_unit = std::make_unique<InlineUnit>(&dest->home_system());
      if (&inline_unit->system() == &dest->home_system()) {
        inline_unit->deliver(dest, std::move(elem));
        return;
      }
    }
    dest->enqueue(std::move(elem), nullptr);
  }

  // --- receiving -------------------------------------------------------------------------

  // Receives and handles one message; false when the socket has nothing to read.
  bool recv_one(int ch) {
    zmq::message_t id;
    if (!in[ch].recv(id, zmq::recv_flags::dontwait)) return false;
    frames.clear();
    bool too_many = false;
    // Parts of one message arrive together, so the blocking receives return at once.
    for (bool more = id.more(); more;) {
      zmq::message_t f;
      (void)in[ch].recv(f);
      more = f.more();
      if (frames.size() < kMaxFrames) frames.push_back(std::move(f));
      else too_many = true;
    }
    auto it = link_index.find(std::string(static_cast<const char*>(id.data()), id.size()));
    if (it == link_index.end()) {
      reject(RejectReason::unknown_peer, printable(id.data(), id.size()), ch, "routing id not configured");
      return true;
    }
    Link& l = *links[it->second];
    heard(l);
    if (too_many || frames.empty()) {
      reject(RejectReason::bad_frames, l.name, ch,
             too_many ? "more than " + std::to_string(kMaxFrames) + " frames" : std::string("no header frame"));
      return true;
    }
    in_blobs.clear();
    for (std::size_t i = 1; i < frames.size(); ++i) {
      // The blob keeps the received frame alive: tensors are handed to actors without a copy.
      auto owner = std::make_shared<zmq::message_t>(std::move(frames[i]));
      in_blobs.emplace_back(owner, owner->data(), owner->size());
    }
    auto res = decode(std::span<const std::byte>(static_cast<const std::byte*>(frames[0].data()), frames[0].size()),
                      in_blobs);
    in_blobs.clear();
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
    n_received.fetch_add(1, std::memory_order_relaxed);
    if (env.type() == MsgType::heartbeat) {
      std::lock_guard<std::mutex> g(sub_mu);
      if (subs[static_cast<std::size_t>(MsgType::heartbeat)].empty()) return true;
    }
    deliver(l.name, std::move(env));
    return true;
  }

  bool check_sequence(Link& l, int ch, const Envelope& env) {
    if (!l.in_started[ch] || l.in_session[ch] != env.session) {
      if (l.in_started[ch])
        spdlog::info("gateway '{}': peer '{}' started a new session on {} channel", cfg.node, l.name,
                     channel_name(ch));
      // A fresh receiver cannot know what it missed before it started listening.
      if (env.seq != 0)
        spdlog::warn("gateway '{}': joined {} stream of '{}' at seq {}", cfg.node, channel_name(ch), l.name,
                     env.seq);
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
      deliver(l.name, make_envelope(0, Error{ErrorCode::messages_lost, l.name,
                                             std::string("messages from '") + l.name + "' lost on " +
                                                 channel_name(ch) + " channel: " + what}));
      return false;
    }
    reject(RejectReason::seq_reordered, l.name, ch,
           "seq " + std::to_string(env.seq) + ", expected " + std::to_string(expected));
    return false;
  }

  void heard(Link& l) {
    l.last_heard = Clock::now();
    l.ever_heard = true;
    if (!l.alive.load(std::memory_order_relaxed)) {
      l.alive.store(true, std::memory_order_relaxed);
      if (l.reported_down) spdlog::info("gateway '{}': peer '{}' is back", cfg.node, l.name);
      else spdlog::debug("gateway '{}': peer '{}' is up", cfg.node, l.name);
      l.reported_down = false;
    }
  }

  void drain_control() {
    for (int i = 0; i < 256 && recv_one(kControl); ++i) {
    }
  }

  // --- sending ---------------------------------------------------------------------------

  // Hands one message to ZeroMQ; false if the peer's queue is full (HWM). Caller holds l.mu.
  bool try_send(Link& l, int ch, Envelope& env) {
    // Per thread: senders encode on their own thread, in parallel with the I/O thread.
    thread_local std::vector<char> header;
    thread_local std::vector<Blob> blobs;
    env.session = session;
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
    n_sent.fetch_add(1, std::memory_order_relaxed);
    return true;
  }

  void wake() {
    uint64_t one = 1;
    (void)!::write(wake_fd, &one, sizeof one);
  }

  // Any thread. Sends at once unless messages are already waiting (order is kept) or the
  // config asks for I/O-thread sends; otherwise parks the message for the I/O thread.
  void submit(Link& l, int ch, Envelope&& env) {
    bool was_empty;
    {
      std::lock_guard<std::mutex> g(l.mu);
      was_empty = l.pending[ch].empty();
      if (was_empty && cfg.send_from_caller && try_send(l, ch, env)) return;
      l.pending[ch].push_back(std::move(env));
    }
    // A non-empty queue is already in the I/O thread's poll set.
    if (was_empty) wake();
  }

  // I/O thread: sends parked messages until ZeroMQ refuses (then POLLOUT is awaited).
  void flush_pending(Link& l, int ch) {
    std::lock_guard<std::mutex> g(l.mu);
    auto& p = l.pending[ch];
    while (!p.empty() && try_send(l, ch, p.front())) p.pop_front();
  }

  void flush_all_pending() {
    // Control first: a cancel must not wait behind data.
    for (int ch : {kControl, kData})
      for (auto& l : links) flush_pending(*l, ch);
  }

  // --- liveness --------------------------------------------------------------------------

  void send_heartbeats() {
    auto now_ns = static_cast<uint64_t>(Clock::now().time_since_epoch().count());
    for (auto& l : links) {
      // Heartbeats are never queued: a stale heartbeat proves nothing.
      std::lock_guard<std::mutex> g(l->mu);
      Envelope hb = make_envelope(0, Heartbeat{now_ns});
      if (!l->pending[kControl].empty() || !try_send(*l, kControl, hb))
        n_send_dropped.fetch_add(1, std::memory_order_relaxed);
    }
  }

  void check_liveness(Clock::time_point now) {
    for (auto& l : links) {
      if (l->reported_down || now - l->last_heard < cfg.peer_timeout) continue;
      l->reported_down = true;
      l->alive.store(false, std::memory_order_relaxed);
      auto ms = std::chrono::duration_cast<std::chrono::milliseconds>(now - l->last_heard).count();
      std::string msg = l->ever_heard
                            ? "peer '" + l->name + "' silent for " + std::to_string(ms) + " ms (" +
                                  l->endpoint[kData] + "): gone, frozen or unreachable"
                            : "peer '" + l->name + "' not reachable at " + l->endpoint[kData] + " after " +
                                  std::to_string(ms) + " ms";
      spdlog::error("gateway '{}': {}", cfg.node, msg);
      deliver(l->name, make_envelope(0, Error{ErrorCode::peer_down, l->name, msg}));
    }
  }

  Clock::time_point next_deadline(Clock::time_point next_hb) const {
    auto d = next_hb;
    for (auto& l : links)
      if (!l->reported_down) d = std::min(d, l->last_heard + cfg.peer_timeout);
    return d;
  }

  // --- the I/O loop ----------------------------------------------------------------------

  void run() {
    pthread_setname_np(pthread_self(), "specmesh-gw");
    auto next_hb = Clock::now();
    while (!stopping.load()) {
      items.clear();
      item_links.clear();
      items.push_back({nullptr, wake_fd, ZMQ_POLLIN, 0});
      items.push_back({in[kControl].handle(), 0, ZMQ_POLLIN, 0});
      items.push_back({in[kData].handle(), 0, ZMQ_POLLIN, 0});
      for (auto& l : links) {
        std::lock_guard<std::mutex> g(l->mu);
        for (int ch : {kControl, kData})
          if (!l->pending[ch].empty()) {
            items.push_back({l->out[ch].handle(), 0, ZMQ_POLLOUT, 0});
            item_links.emplace_back(l.get(), ch);
          }
      }
      auto now = Clock::now();
      auto wait = std::chrono::ceil<std::chrono::milliseconds>(next_deadline(next_hb) - now).count();
      int rc = zmq_poll(items.data(), static_cast<int>(items.size()), std::max<long>(wait, 0));
      if (rc < 0) {
        if (zmq_errno() == ETERM) break;
        if (zmq_errno() != EINTR) spdlog::error("gateway '{}': zmq_poll: {}", cfg.node, zmq_strerror(zmq_errno()));
        continue;
      }
      try {
        // Control first: a cancel must not wait behind data in either direction.
        if (items[1].revents & ZMQ_POLLIN) drain_control();
        if (items[0].revents & ZMQ_POLLIN) {
          uint64_t v;
          (void)!::read(wake_fd, &v, sizeof v);
          flush_all_pending();
        } else {
          for (std::size_t i = 0; i < item_links.size(); ++i)
            if (items[3 + i].revents & ZMQ_POLLOUT) flush_pending(*item_links[i].first, item_links[i].second);
        }
        if (items[2].revents & ZMQ_POLLIN) {
          for (int i = 0; i < kDataBatch && recv_one(kData); ++i) drain_control();
        }
        now = Clock::now();
        if (now >= next_hb) {
          send_heartbeats();
          next_hb = now + cfg.heartbeat;
        }
        check_liveness(now);
      } catch (const zmq::error_t& e) {
        if (e.num() == ETERM) break;
        spdlog::error("gateway '{}': I/O error: {}", cfg.node, e.what());
      } catch (const std::exception& e) {
        spdlog::error("gateway '{}': I/O thread: {}", cfg.node, e.what());
      }
    }
    // Best effort: hand what is still queued to ZeroMQ; linger bounds the wait at close.
    flush_all_pending();
  }
};

Gateway::Gateway(GatewayConfig cfg) : impl_(std::make_unique<Impl>(std::move(cfg))) {
  auto& c = impl_->cfg;
  if (c.node.empty() || c.node.size() > 255 || c.node[0] == '\0')
    throw std::invalid_argument("gateway: node name must be 1..255 bytes and not start with NUL");
  if (c.peers.count(c.node)) throw std::invalid_argument("gateway '" + c.node + "': peers must not include itself");
  if (c.heartbeat.count() <= 0 || c.peer_timeout <= c.heartbeat)
    throw std::invalid_argument("gateway '" + c.node + "': need 0 < heartbeat < peer_timeout");
  check_bind_allowed(c.bind, c.allow_non_loopback);
  impl_->endpoint[kData] = c.bind;
  impl_->endpoint[kControl] = control_endpoint_for(c.bind);
  for (auto& [name, ep] : c.peers) {
    if (name.empty() || name.size() > 255) throw std::invalid_argument("gateway: bad peer name '" + name + "'");
    (void)control_endpoint_for(ep);
  }
  impl_->wake_fd = ::eventfd(0, EFD_NONBLOCK | EFD_CLOEXEC);
  if (impl_->wake_fd < 0) throw std::runtime_error("gateway: eventfd failed");
  try {
    impl_->open();
  } catch (...) {
    ::close(impl_->wake_fd);
    throw;
  }
  std::string peers;
  for (auto& [name, ep] : c.peers) peers += (peers.empty() ? "" : ", ") + name + "=" + ep;
  spdlog::info("gateway '{}': data {} control {}, peers [{}]", c.node, impl_->endpoint[kData],
               impl_->endpoint[kControl], peers);
  // Sockets were created on this thread; starting the thread is the memory barrier that
  // hands them over to the I/O thread, which owns them from now on.
  impl_->io = std::thread([this] { impl_->run(); });
}

Gateway::~Gateway() {
  impl_->stopping.store(true);
  impl_->wake();
  impl_->io.join();
  for (auto& l : impl_->links)
    for (auto& s : l->out) s.close();
  for (auto& s : impl_->in) s.close();
  ::close(impl_->wake_fd);
}

bool Gateway::send(const std::string& peer, Envelope env) {
  auto it = impl_->link_index.find(peer);
  if (it == impl_->link_index.end()) {
    spdlog::warn("gateway '{}': send to unknown peer '{}'", impl_->cfg.node, peer);
    return false;
  }
  check_tensors(env);
  if (impl_->stopping.load()) return false;
  impl_->submit(*impl_->links[it->second], is_control(env.type()) ? kControl : kData, std::move(env));
  return true;
}

void Gateway::subscribe(MsgType type, caf::actor who, Delivery how) {
  if (!who) throw std::invalid_argument("Gateway::subscribe: invalid actor handle");
  std::lock_guard<std::mutex> g(impl_->sub_mu);
  auto& held = impl_->held[static_cast<std::size_t>(type)];
  // Messages that arrived before anyone subscribed go first, in order; the I/O thread waits
  // on sub_mu meanwhile, so nothing newer overtakes them.
  for (auto& [from, env] : held) {
    const auto id = caf::make_message_id(is_control(env.type()) ? caf::message_priority::high
                                                                : caf::message_priority::normal);
    impl_->n_delivered.fetch_add(1, std::memory_order_relaxed);
    caf::actor_cast<caf::abstract_actor*>(who)->enqueue(caf::make_mailbox_element(nullptr, id, {}, from, std::move(env)),
                                                       nullptr);
  }
  held.clear();
  impl_->subs[static_cast<std::size_t>(type)].push_back({std::move(who), how});
}

void Gateway::unsubscribe(const caf::actor& who) {
  std::lock_guard<std::mutex> g(impl_->sub_mu);
  for (auto& v : impl_->subs) std::erase_if(v, [&](const Impl::Subscriber& s) { return s.actor == who; });
}

GatewayStats Gateway::stats() const {
  GatewayStats s;
  s.sent = impl_->n_sent.load();
  s.received = impl_->n_received.load();
  s.delivered = impl_->n_delivered.load();
  s.unrouted = impl_->n_unrouted.load();
  s.send_dropped = impl_->n_send_dropped.load();
  for (std::size_t i = 0; i < kRejectReasonCount; ++i) s.rejected[i] = impl_->n_rejected[i].load();
  return s;
}

bool Gateway::peer_alive(const std::string& peer) const {
  auto it = impl_->link_index.find(peer);
  return it != impl_->link_index.end() && impl_->links[it->second]->alive.load();
}

const GatewayConfig& Gateway::config() const { return impl_->cfg; }
std::string Gateway::data_endpoint() const { return impl_->endpoint[kData]; }
std::string Gateway::control_endpoint() const { return impl_->endpoint[kControl]; }

}  // namespace specmesh

// Gateway tests over inproc/ipc/loopback tcp only, each bounded by short timeouts: delivery to
// CAF actors, rejection of hostile/out-of-order input while serving on, control overtaking
// data, and peer-down reporting for dead, frozen and unreachable peers.
#include "specmesh/transport/gateway.hpp"

#include "actor_harness.hpp"

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/all.hpp>
#include <gtest/gtest.h>
#include <msgpack.hpp>
#include <spdlog/sinks/ringbuffer_sink.h>
#include <spdlog/spdlog.h>
#include <zmq.hpp>

#include <netinet/in.h>
#include <pthread.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <deque>
#include <future>
#include <mutex>
#include <optional>
#include <set>
#include <thread>

namespace specmesh {
namespace {

using namespace std::chrono_literals;
using namespace test;

bool has_ipv6_loopback() {
  int s = ::socket(AF_INET6, SOCK_STREAM, 0);
  if (s < 0) return false;
  sockaddr_in6 a{};
  a.sin6_family = AF_INET6;
  a.sin6_addr = in6addr_loopback;
  bool ok = ::bind(s, reinterpret_cast<sockaddr*>(&a), sizeof a) == 0;
  ::close(s);
  return ok;
}

GatewayConfig config(std::string node, std::string bind, std::map<std::string, std::string> peers) {
  return quick_gateway(std::move(node), std::move(bind), std::move(peers));
}

// Routes spdlog's default logger into a ring buffer for the lifetime of the object.
struct LogCapture {
  std::shared_ptr<spdlog::sinks::ringbuffer_sink_mt> sink = std::make_shared<spdlog::sinks::ringbuffer_sink_mt>(512);
  std::shared_ptr<spdlog::logger> prev = spdlog::default_logger();
  LogCapture() { spdlog::set_default_logger(std::make_shared<spdlog::logger>("gwtest", sink)); }
  ~LogCapture() { spdlog::set_default_logger(prev); }
  bool contains(const std::string& needle) {
    for (auto& line : sink->last_formatted())
      if (line.find(needle) != std::string::npos) return true;
    return false;
  }
};

// A hand-driven peer speaking raw ZeroMQ, for feeding the gateway arbitrary frames.
struct RawPeer {
  zmq::context_t ctx{1};
  zmq::socket_t sock[2];
  uint64_t session = 0x5eed;
  RawPeer(const std::string& id, const std::string& gateway_data_ep) {
    std::string eps[2] = {gateway_data_ep, control_endpoint_for(gateway_data_ep)};
    for (int ch = 0; ch < 2; ++ch) {
      sock[ch] = zmq::socket_t(ctx, zmq::socket_type::dealer);
      sock[ch].set(zmq::sockopt::linger, 0);
      sock[ch].set(zmq::sockopt::routing_id, zmq::buffer(id));
      sock[ch].connect(eps[ch]);
    }
  }
  void send_frames(int ch, const std::string& header, const std::vector<Blob>& blobs = {}) {
    zmq::message_t h(header.data(), header.size());
    (void)sock[ch].send(h, blobs.empty() ? zmq::send_flags::none : zmq::send_flags::sndmore);
    for (std::size_t i = 0; i < blobs.size(); ++i) {
      zmq::message_t f(blobs[i].data(), blobs[i].size());
      (void)sock[ch].send(f, i + 1 < blobs.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
    }
  }
  // Sends a well-formed envelope with an explicit sequence number.
  void send_env(Envelope env, uint64_t seq) {
    env.seq = seq;
    env.session = session;
    std::vector<char> h;
    std::vector<Blob> b;
    encode(env, h, b);
    send_frames(is_control(env.type()) ? 1 : 0, std::string(h.begin(), h.end()), b);
  }
};

std::string header_of(const Envelope& env) {
  std::vector<char> h;
  std::vector<Blob> b;
  encode(env, h, b);
  return std::string(h.begin(), h.end());
}

// --- delivery over each transport ---------------------------------------------------------

class GatewayTransport : public ::testing::TestWithParam<std::string> {};

TEST_P(GatewayTransport, DeliversEveryMessageTypeBothWays) {
  System s;
  auto ea = endpoint_for(GetParam()), eb = endpoint_for(GetParam());
  Gateway a(config("a", ea, {{"b", eb}}));
  Gateway b(config("b", eb, {{"a", ea}}));
  Inbox in_a(*s.sys), in_b(*s.sys);
  for (auto t : {MsgType::run_start, MsgType::activations, MsgType::logits, MsgType::kv_cache_op,
                 MsgType::cancel, MsgType::error}) {
    a.subscribe(t, in_a.handle());
    b.subscribe(t, in_b.handle());
  }
  std::vector<Envelope> msgs = {
      make_envelope(1, RunStart{"target", {5, 6, 7}, {0, 1, 2}, {1, 1, 1}, {}, {}, true}),
      make_envelope(1, Activations{"target", 4, {}, {float_tensor({3, 4096}, 1.0f), float_tensor({3, 2}, 9.0f)}}),
      make_envelope(1, Logits{"target", {2}, float_tensor({1, 100}, -3.0f)}),
      make_envelope(1, KvCacheOp{"target", 2, {{KvOpKind::copy, 0, 1, 0, 3}}}),
      make_envelope(0, Cancel{{1, 2}}),
      make_envelope(1, Error{ErrorCode::invalid_request, "a", "bad batch"}),
  };
  // Data and control travel on separate sockets, so compare per type rather than by order.
  auto check = [&](Inbox& in, const std::string& from) {
    std::map<MsgType, Envelope> got;
    for (std::size_t i = 0; i < msgs.size(); ++i) {
      auto m = in.next();
      if (!m) {
        std::string types;
        for (auto& [t, e] : got) types += std::string(to_string(t)) + " ";
        FAIL() << "timed out after " << i << " messages from " << from << ": " << types;
      }
      EXPECT_EQ(m->first, from);
      got[m->second.type()] = m->second;
    }
    for (auto& sent : msgs) {
      ASSERT_TRUE(got.count(sent.type())) << to_string(sent.type());
      EXPECT_EQ(got[sent.type()].payload, sent.payload) << to_string(sent.type());
      EXPECT_EQ(got[sent.type()].run_id, sent.run_id);
    }
  };
  for (auto& m : msgs) ASSERT_TRUE(a.send("b", m));
  check(in_b, "a");
  for (auto& m : msgs) ASSERT_TRUE(b.send("a", m));
  check(in_a, "b");
  EXPECT_EQ(a.stats().rejected_total(), 0u);
  EXPECT_EQ(b.stats().rejected_total(), 0u);
  EXPECT_TRUE(wait_until([&] { return a.peer_alive("b") && b.peer_alive("a"); }));
}

INSTANTIATE_TEST_SUITE_P(Transports, GatewayTransport, ::testing::Values("inproc", "ipc", "tcp"));

TEST(Gateway, EverySubscriberReceives) {
  System s;
  auto ea = ipc_ep(), eb = ipc_ep();
  Gateway a(config("a", ea, {{"b", eb}}));
  Gateway b(config("b", eb, {{"a", ea}}));
  Inbox x(*s.sys), y(*s.sys);
  b.subscribe(MsgType::logits, x.handle());
  b.subscribe(MsgType::logits, y.handle());
  ASSERT_TRUE(a.send("b", make_envelope(3, Logits{"target", {0}, float_tensor({1, 8}, 0.0f)})));
  auto mx = x.next(), my = y.next();
  ASSERT_TRUE(mx && my);
  EXPECT_EQ(mx->second.run_id, 3u);
  EXPECT_EQ(my->second.payload, mx->second.payload);
  b.unsubscribe(x.handle());
  ASSERT_TRUE(a.send("b", make_envelope(4, Logits{"target", {0}, float_tensor({1, 8}, 0.0f)})));
  ASSERT_TRUE(y.next());
  EXPECT_FALSE(x.next(100ms)) << "unsubscribed actor still receives";
}

// Work a peer sends before anyone here subscribed is held; an actor that takes several types
// in one subscribe() gets it in the order it was sent, across types (a run must not overtake
// the cache operation sent before it). Types it did not take stay held for their subscriber.
TEST(Gateway, HeldWorkKeepsItsOrderAcrossTypes) {
  System s;
  auto ea = ipc_ep(), eb = ipc_ep();
  Gateway a(config("a", ea, {{"b", eb}}));
  Gateway b(config("b", eb, {{"a", ea}}));
  RunStart run;
  run.pipeline = "target";
  ASSERT_TRUE(a.send("b", make_envelope(1, KvCacheOp{"target", 0, {{KvOpKind::remove, -1, -1, -1, -1}}})));
  ASSERT_TRUE(a.send("b", make_envelope(2, run)));
  ASSERT_TRUE(a.send("b", make_envelope(3, Logits{"target", {0}, float_tensor({1, 8}, 0.0f)})));
  ASSERT_TRUE(a.send("b", make_envelope(4, KvCacheOp{"target", 0, {{KvOpKind::keep, 0, -1, -1, -1}}})));
  ASSERT_TRUE(a.send("b", make_envelope(5, run)));
  ASSERT_TRUE(wait_until([&] { return b.stats().held == 5; })) << "the messages were not held";
  Inbox work(*s.sys), logits(*s.sys);
  b.subscribe({MsgType::run_start, MsgType::kv_cache_op}, work.handle());
  std::vector<uint64_t> order;
  for (int i = 0; i < 4; ++i)
    if (auto m = work.next()) order.push_back(m->second.run_id);
  EXPECT_EQ(order, (std::vector<uint64_t>{1, 2, 4, 5}));
  b.subscribe(MsgType::logits, logits.handle());
  auto l = logits.next();
  ASSERT_TRUE(l);
  EXPECT_EQ(l->second.run_id, 3u);
  EXPECT_FALSE(work.next(50ms));
}

std::string thread_name() {
  char buf[32] = {};
  pthread_getname_np(pthread_self(), buf, sizeof buf);
  return buf;
}

// Inline delivery runs the subscriber on the gateway thread; whatever that actor sends or
// spawns, and any backlog, goes to the regular scheduler. Order is kept throughout.
TEST(Gateway, InlineDeliveryRunsOnGatewayThreadAndKeepsOrder) {
  System s;
  auto ea = ipc_ep(), eb = ipc_ep();
  Gateway a(config("a", ea, {{"b", eb}}));
  Gateway b(config("b", eb, {{"a", ea}}));
  constexpr int kMsgs = 500;
  struct Seen {
    std::mutex mu;
    std::vector<uint64_t> runs;
    std::set<std::string> threads;
    std::string forwarded_thread;
    int self_msgs = 0;
  };
  auto seen = std::make_shared<Seen>();
  std::promise<void> all, forwarded;
  auto sink = s.sys->spawn([seen, &forwarded](caf::event_based_actor*) -> caf::behavior {
    return {[seen, &forwarded](int) {
      std::lock_guard<std::mutex> g(seen->mu);
      seen->forwarded_thread = thread_name();
      forwarded.set_value();
    }};
  });
  auto inl = s.sys->spawn([seen, sink, &all, &b](caf::event_based_actor* self) -> caf::behavior {
    return {[=, &all, &b](const std::string&, const Envelope& e) {
      std::lock_guard<std::mutex> g(seen->mu);
      seen->runs.push_back(e.run_id);
      seen->threads.insert(thread_name());
      if (seen->runs.size() == 1) {
        self->send(sink, 1);
        // A backlog behind the inline run: must be finished by the scheduler.
        for (int k = 0; k < 10; ++k) self->send(self, k);
        // Re-entering the gateway from an inline handler must not deadlock.
        b.subscribe(MsgType::logits, caf::actor_cast<caf::actor>(self), Delivery::inline_io);
        b.unsubscribe(sink);
      }
      if (seen->runs.size() == kMsgs) all.set_value();
    },
            [=](int) {
              std::lock_guard<std::mutex> g(seen->mu);
              ++seen->self_msgs;
            },
            [](caf::get_atom) { return true; }};
  });
  b.subscribe(MsgType::kv_cache_op, inl, Delivery::inline_io);
  ASSERT_TRUE(wait_until([&] { return a.peer_alive("b"); }));
  // An actor runs inline only when a delivery wakes it from waiting. Until a worker has started
  // it, deliveries queue in its mailbox, and on a loaded machine that may take the whole burst:
  // so it answers once first.
  caf::scoped_actor probe{*s.sys};
  bool started = false;
  probe->request(inl, caf::infinite, caf::get_atom::value).receive([&](bool) { started = true; }, [](caf::error&) {});
  ASSERT_TRUE(started);
  // A burst, so that some messages queue up behind a running handler.
  for (int i = 0; i < kMsgs; ++i) ASSERT_TRUE(a.send("b", make_envelope(uint64_t(i), KvCacheOp{})));
  ASSERT_EQ(all.get_future().wait_for(kWait), std::future_status::ready);
  ASSERT_EQ(forwarded.get_future().wait_for(kWait), std::future_status::ready);
  std::lock_guard<std::mutex> g(seen->mu);
  for (int i = 0; i < kMsgs; ++i) ASSERT_EQ(seen->runs[i], uint64_t(i)) << "out of order at " << i;
  EXPECT_TRUE(seen->threads.count("specmesh-gw")) << "never ran inline";
  EXPECT_NE(seen->forwarded_thread, "specmesh-gw") << "an actor messaged by the inline actor ran inline too";
  EXPECT_EQ(seen->self_msgs, 10);
  b.unsubscribe(inl);
  caf::anon_send_exit(inl, caf::exit_reason::user_shutdown);
  caf::anon_send_exit(sink, caf::exit_reason::user_shutdown);
}

TEST(Gateway, InlineSubscriberThatQuitsIsHarmless) {
  System s;
  auto ea = ipc_ep(), eb = ipc_ep();
  Gateway a(config("a", ea, {{"b", eb}}));
  Gateway b(config("b", eb, {{"a", ea}}));
  std::atomic<int> handled{0};
  auto quitter = s.sys->spawn([&handled](caf::event_based_actor* self) -> caf::behavior {
    return {[self, &handled](const std::string&, const Envelope&) {
      ++handled;
      self->quit();
    }};
  });
  Inbox other(*s.sys);
  b.subscribe(MsgType::logits, quitter, Delivery::inline_io);
  b.subscribe(MsgType::logits, other.handle());
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(a.send("b", make_envelope(uint64_t(i), Logits{"target", {0}, float_tensor({1, 4}, 0.0f)})));
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(other.next()) << i;
  // A message that reaches the quitter before its actor has started waits in its mailbox, so
  // the other subscriber may see all three first (seen once on a loaded CI machine): wait for it.
  for (int i = 0; i < 200 && handled.load() == 0; ++i) std::this_thread::sleep_for(std::chrono::milliseconds(10));
  EXPECT_EQ(handled.load(), 1);
  EXPECT_EQ(b.stats().delivered, 6u);
}

// --- hostile and broken input -------------------------------------------------------------

TEST(Gateway, RejectsBadInputWithReasonAndKeepsServing) {
  LogCapture log;
  System s;
  auto eg = ipc_ep();
  Gateway g(config("g", eg, {{"raw", ipc_ep()}}));
  Inbox in(*s.sys);
  g.subscribe(MsgType::activations, in.handle());
  g.subscribe(MsgType::logits, in.handle());
  RawPeer raw("raw", eg);

  auto expect_reject = [&](RejectReason r, auto&& send) {
    uint64_t before = g.stats().rejected_for(r);
    uint64_t total_before = g.stats().rejected_total();
    send();
    EXPECT_TRUE(wait_until([&] { return g.stats().rejected_for(r) == before + 1; }))
        << "not rejected as " << to_string(r);
    EXPECT_EQ(g.stats().rejected_total(), total_before + 1) << "counted under another reason too";
    EXPECT_TRUE(wait_until([&] { return log.contains(to_string(r)); }, 1s)) << "no log line for " << to_string(r);
  };

  auto good = make_envelope(1, Logits{"target", {0}, float_tensor({1, 16}, 2.0f)});
  good.session = raw.session;
  auto good_header = header_of(good);
  std::vector<Blob> good_blobs = {std::get<Logits>(good.payload).logits.data};

  expect_reject(RejectReason::malformed, [&] { raw.send_frames(0, std::string("\xc1\xc1\xc1", 3)); });
  expect_reject(RejectReason::truncated, [&] { raw.send_frames(0, good_header.substr(0, good_header.size() - 3)); });
  expect_reject(RejectReason::truncated, [&] { raw.send_frames(0, std::string("\xdd\xff\xff\xff\xff", 5)); });
  expect_reject(RejectReason::trailing_bytes, [&] { raw.send_frames(0, good_header + "zz", good_blobs); });
  expect_reject(RejectReason::wrong_version, [&] {
    auto v2 = good;
    v2.version = kProtocolVersion + 1;
    raw.send_frames(0, header_of(v2), good_blobs);
  });
  expect_reject(RejectReason::unknown_type, [&] {
    msgpack::sbuffer sb;
    msgpack::packer<msgpack::sbuffer> pk(sb);
    pk.pack_array(6);
    pk.pack(kProtocolVersion);
    pk.pack(99);
    pk.pack(1);
    pk.pack(0);
    pk.pack(raw.session);
    pk.pack_nil();
    raw.send_frames(0, std::string(sb.data(), sb.size()));
  });
  expect_reject(RejectReason::bad_enum, [&] {
    auto e = make_envelope(1, Error{ErrorCode::internal, "x", "y"});
    auto h = header_of(e);
    auto pos = h.size() - 1 - 1 - 1 - 1 - 1;  // [code, "x", "y"]: code byte sits before the two fixstrs
    h[pos] = '\x7f';
    raw.send_frames(1, h);
  });
  expect_reject(RejectReason::bad_tensor, [&] { raw.send_frames(0, good_header); });  // frame missing
  expect_reject(RejectReason::wrong_channel, [&] { raw.send_frames(1, good_header, good_blobs); });
  expect_reject(RejectReason::unknown_peer, [&] {
    RawPeer stranger("stranger", eg);
    stranger.send_frames(0, good_header, good_blobs);
    wait_until([&] { return g.stats().rejected_for(RejectReason::unknown_peer) > 0; });
  });
  EXPECT_EQ(g.stats().delivered, 0u);

  // Still serving: a well-formed message is delivered after all of the above.
  raw.send_env(good, 0);
  auto m = in.next();
  ASSERT_TRUE(m);
  EXPECT_EQ(m->first, "raw");
  EXPECT_EQ(m->second.payload, good.payload);
  EXPECT_EQ(g.stats().delivered, 1u);
}

TEST(Gateway, DetectsGapsAndReordering) {
  LogCapture log;
  System s;
  auto eg = ipc_ep();
  Gateway g(config("g", eg, {{"raw", ipc_ep()}}));
  Inbox in(*s.sys), errors(*s.sys);
  g.subscribe(MsgType::kv_cache_op, in.handle());
  g.subscribe(MsgType::cancel, in.handle());
  g.subscribe(MsgType::error, errors.handle());
  RawPeer raw("raw", eg);
  auto msg = [](int32_t tag) { return make_envelope(uint64_t(tag), KvCacheOp{"target", 2, {{KvOpKind::keep, tag, -1, -1, -1}}}); };

  for (uint64_t seq : {0, 1, 3, 2, 4, 4, 5}) raw.send_env(msg(int32_t(seq)), seq);
  std::vector<uint64_t> seqs;
  for (int i = 0; i < 4; ++i) {
    auto m = in.next();
    ASSERT_TRUE(m) << "after " << i;
    seqs.push_back(m->second.seq);
  }
  // 3 arrives after a gap (2 missing): rejected, stream resyncs to 4. The late 2 and the
  // duplicate 4 are rejected as reordered.
  EXPECT_EQ(seqs, (std::vector<uint64_t>{0, 1, 4, 5}));
  EXPECT_EQ(g.stats().rejected_for(RejectReason::seq_gap), 1u);
  EXPECT_EQ(g.stats().rejected_for(RejectReason::seq_reordered), 2u);
  EXPECT_TRUE(log.contains("seq_gap"));
  EXPECT_TRUE(log.contains("expected 2"));
  auto lost = errors.next();
  ASSERT_TRUE(lost) << "gap not reported to error subscribers";
  const auto& err = std::get<Error>(lost->second.payload);
  EXPECT_EQ(err.code, ErrorCode::messages_lost);
  EXPECT_EQ(err.peer, "raw");
  EXPECT_NE(err.message.find("1 missing"), std::string::npos) << err.message;

  // The control channel has its own sequence: its first message is seq 0 again.
  raw.send_env(make_envelope(0, Cancel{{7}}), 0);
  auto c = in.next();
  ASSERT_TRUE(c);
  EXPECT_EQ(c->second.type(), MsgType::cancel);

  // A restarted peer (new session) starts again from 0 and is accepted.
  raw.session = 0x5eed2;
  raw.send_env(msg(100), 0);
  auto r = in.next();
  ASSERT_TRUE(r);
  EXPECT_EQ(r->second.run_id, 100u);
  EXPECT_EQ(g.stats().rejected_total(), 3u);
}

// --- priorities ---------------------------------------------------------------------------

class GatewayControl : public ::testing::TestWithParam<std::string> {};

TEST_P(GatewayControl, CancelOvertakesQueuedTensors) {
  System s;
  auto ea = endpoint_for(GetParam()), eb = endpoint_for(GetParam());
  Gateway a(config("a", ea, {{"b", eb}}));
  Gateway b(config("b", eb, {{"a", ea}}));
  constexpr int kData = 48;
  std::promise<int> data_seen_at_cancel;
  std::promise<void> all_data;
  auto counter = s.sys->spawn([&](caf::event_based_actor* self) {
    auto seen = std::make_shared<int>(0);
    return caf::behavior{[&, seen](const std::string&, const Envelope& e) {
      if (e.type() == MsgType::cancel) data_seen_at_cancel.set_value(*seen);
      else if (++*seen == kData) all_data.set_value();
    }};
  });
  b.subscribe(MsgType::activations, counter);
  b.subscribe(MsgType::cancel, counter);
  // Make sure the links are up so the measurement is about queuing, not connecting.
  ASSERT_TRUE(wait_until([&] { return a.peer_alive("b") && b.peer_alive("a"); }));
  // Build everything first so the sends below queue 48 MiB in one burst.
  std::vector<Envelope> burst;
  for (int i = 0; i < kData; ++i)
    burst.push_back(make_envelope(1, Activations{"target", 0, {}, {float_tensor({256, 1024}, float(i))}}));  // 1 MiB each
  for (auto& env : burst) ASSERT_TRUE(a.send("b", std::move(env)));
  ASSERT_TRUE(a.send("b", make_envelope(0, Cancel{{1}})));
  auto f = data_seen_at_cancel.get_future();
  ASSERT_EQ(f.wait_for(kWait), std::future_status::ready);
  int seen = f.get();
  EXPECT_LT(seen, kData) << "cancel arrived only after all queued data";
  ASSERT_EQ(all_data.get_future().wait_for(kWait), std::future_status::ready);
  b.unsubscribe(counter);
  caf::anon_send_exit(counter, caf::exit_reason::user_shutdown);
}

INSTANTIATE_TEST_SUITE_P(Transports, GatewayControl, ::testing::Values("ipc", "tcp"));

// More messages than ZeroMQ queues for an absent peer: the rest wait in the gateway and
// everything arrives in order once the peer starts.
TEST(Gateway, BacklogForAbsentPeerArrivesInOrder) {
  System s;
  auto ea = ipc_ep(), eb = ipc_ep();
  Gateway a(config("a", ea, {{"b", eb}}));
  constexpr int kMsgs = 3000;  // above ZeroMQ's default high-water mark of 1000 per pipe
  for (int i = 0; i < kMsgs; ++i) ASSERT_TRUE(a.send("b", make_envelope(uint64_t(i), KvCacheOp{})));
  auto runs = std::make_shared<std::vector<uint64_t>>();
  std::promise<void> all;
  auto collector = s.sys->spawn([runs, &all](caf::event_based_actor*) -> caf::behavior {
    return {[runs, &all](const std::string&, const Envelope& e) {
      runs->push_back(e.run_id);
      if (runs->size() == kMsgs) all.set_value();
    }};
  });
  Gateway b(config("b", eb, {{"a", ea}}));
  b.subscribe(MsgType::kv_cache_op, collector);
  ASSERT_EQ(all.get_future().wait_for(kWait), std::future_status::ready)
      << "received " << b.stats().received << " sent " << a.stats().sent;
  for (int i = 0; i < kMsgs; ++i) ASSERT_EQ((*runs)[i], uint64_t(i)) << "out of order at " << i;
  EXPECT_EQ(b.stats().rejected_total(), 0u);
  b.unsubscribe(collector);
  caf::anon_send_exit(collector, caf::exit_reason::user_shutdown);
}

// --- liveness -----------------------------------------------------------------------------

TEST(Gateway, ReportsDeadPeerByNameAndSeesItReturn) {
  LogCapture log;
  System s;
  auto ea = ipc_ep(), eb = ipc_ep();
  Gateway a(config("a", ea, {{"b", eb}}));
  Inbox errors(*s.sys), data(*s.sys);
  a.subscribe(MsgType::error, errors.handle());
  a.subscribe(MsgType::logits, data.handle());
  {
    Gateway b(config("b", eb, {{"a", ea}}));
    ASSERT_TRUE(wait_until([&] { return a.peer_alive("b"); }));
    EXPECT_FALSE(errors.next(100ms)) << "peer reported down while alive";
  }
  auto t0 = std::chrono::steady_clock::now();
  auto e = errors.next();
  ASSERT_TRUE(e) << "dead peer not reported";
  auto took = std::chrono::steady_clock::now() - t0;
  EXPECT_LT(took, 1s);
  EXPECT_EQ(e->first, "b");
  const auto& err = std::get<Error>(e->second.payload);
  EXPECT_EQ(err.code, ErrorCode::peer_down);
  EXPECT_EQ(err.peer, "b");
  EXPECT_NE(err.message.find("'b'"), std::string::npos) << err.message;
  EXPECT_FALSE(a.peer_alive("b"));
  EXPECT_TRUE(log.contains("peer 'b' silent"));

  // The peer restarts under the same name (ROUTER_HANDOVER) and traffic flows both ways.
  Gateway b2(config("b", eb, {{"a", ea}}));
  Inbox in_b(*s.sys);
  b2.subscribe(MsgType::logits, in_b.handle());
  ASSERT_TRUE(wait_until([&] { return a.peer_alive("b"); }));
  ASSERT_TRUE(b2.send("a", make_envelope(5, Logits{"target", {0}, float_tensor({1, 4}, 0.0f)})));
  auto d = data.next();
  ASSERT_TRUE(d);
  EXPECT_EQ(d->second.run_id, 5u);
  ASSERT_TRUE(a.send("b", make_envelope(6, Logits{"target", {0}, float_tensor({1, 4}, 0.0f)})));
  auto d2 = in_b.next();
  ASSERT_TRUE(d2);
  EXPECT_EQ(d2->second.run_id, 6u);
  EXPECT_FALSE(errors.next(100ms)) << "restarted peer reported down again";
}

TEST(Gateway, DetectsFrozenPeerWhoseConnectionStaysUp) {
  System s;
  auto eg = ipc_ep();
  Gateway g(config("g", eg, {{"raw", ipc_ep()}}));
  Inbox errors(*s.sys);
  g.subscribe(MsgType::error, errors.handle());
  RawPeer raw("raw", eg);
  // The raw peer keeps its sockets open (ZeroMQ sees a healthy connection) but its
  // application heartbeats stop after a while, as with a hung gateway thread.
  uint64_t seq = 0;
  for (int i = 0; i < 8; ++i) {
    raw.send_env(make_envelope(0, Heartbeat{uint64_t(i)}), seq++);
    std::this_thread::sleep_for(40ms);
  }
  EXPECT_TRUE(g.peer_alive("raw"));
  EXPECT_FALSE(errors.next(10ms));
  auto e = errors.next(2s);
  ASSERT_TRUE(e) << "frozen peer not reported";
  EXPECT_EQ(std::get<Error>(e->second.payload).peer, "raw");
  EXPECT_FALSE(g.peer_alive("raw"));
  raw.send_env(make_envelope(0, Heartbeat{99}), seq++);
  EXPECT_TRUE(wait_until([&] { return g.peer_alive("raw"); }));
}

// libzmq 4.3.4 aborts the process (stream_engine_base.cpp:331, libzmq issue #4364) when a
// connection whose input is stopped, because this side's receive queue is full, is closed by
// the peer and a ZMTP heartbeat falls due before the queue drains. A stalled I/O thread and a
// peer that floods then leaves is how that happened at the end of a run on a loaded machine.
TEST(Gateway, SurvivesAPeerThatLeavesWhileItsQueueIsFull) {
  System s;
  auto eg = ipc_ep();
  Gateway g(config("g", eg, {{"raw", ipc_ep()}, {"next", ipc_ep()}}));
  std::atomic<int> handled{0};
  // An inline handler that blocks stalls the I/O thread (as a starved thread would).
  auto slow = s.sys->spawn([&handled](caf::event_based_actor*) -> caf::behavior {
    return {[&handled](const std::string&, const Envelope&) {
      if (handled++ == 0) std::this_thread::sleep_for(1500ms);
    }};
  });
  g.subscribe(MsgType::kv_cache_op, slow, Delivery::inline_io);
  constexpr int kFlood = 4000;  // well past the 1000-message receive queue
  {
    RawPeer raw("raw", eg);
    raw.sock[0].set(zmq::sockopt::sndhwm, 0);
    for (int i = 0; i < kFlood; ++i) raw.send_env(make_envelope(uint64_t(i), KvCacheOp{}), uint64_t(i));
    std::this_thread::sleep_for(20ms);  // its queue reaches ours, which fills and stops
  }  // leaves while the gateway is still stalled
  // What reached this process before the peer left is delivered once the handler returns
  // (how much did depends on the peer's threads, so only that the delivery ends is checked).
  int seen = -1;
  ASSERT_TRUE(wait_until([&] {
    const int now = handled.load();
    if (now > 1 && now == seen) return true;
    seen = now;
    std::this_thread::sleep_for(300ms);
    return false;
  }, 10s)) << handled.load();
  // Still serving: a new peer is heard.
  RawPeer next("next", eg);
  next.send_env(make_envelope(1, KvCacheOp{}), 0);
  const int before = handled.load();
  EXPECT_TRUE(wait_until([&] { return handled.load() > before; }, 5s));
  g.unsubscribe(slow);
  caf::anon_send_exit(slow, caf::exit_reason::user_shutdown);
}

// A gateway that falls behind a peer keeps the connection and everything sent over it, however
// long it takes to catch up: nothing then comes out of order, twice, or from a stranger.
TEST(Gateway, KeepsEveryMessageOfAPeerItFellBehind) {
  System s;
  auto eg = ipc_ep();
  Gateway g(config("g", eg, {{"raw", ipc_ep()}}));
  std::mutex mu;
  std::vector<uint64_t> runs;
  auto slow = s.sys->spawn([&](caf::event_based_actor*) -> caf::behavior {
    return {[&](const std::string&, const Envelope& e) {
      std::lock_guard<std::mutex> lk(mu);
      runs.push_back(e.run_id);
      if (runs.size() == 1) std::this_thread::sleep_for(1500ms);
    }};
  });
  g.subscribe(MsgType::kv_cache_op, slow, Delivery::inline_io);
  constexpr int kFlood = 4000;
  RawPeer raw("raw", eg);
  raw.sock[0].set(zmq::sockopt::sndhwm, 0);
  for (int i = 0; i < kFlood; ++i) raw.send_env(make_envelope(uint64_t(i), KvCacheOp{}), uint64_t(i));
  ASSERT_TRUE(wait_until([&] { std::lock_guard<std::mutex> lk(mu); return runs.size() >= kFlood; }, 20s));
  std::lock_guard<std::mutex> lk(mu);
  ASSERT_EQ(runs.size(), std::size_t(kFlood));
  for (int i = 0; i < kFlood; ++i) ASSERT_EQ(runs[i], uint64_t(i));
  EXPECT_EQ(g.stats().rejected_total(), 0u);
  g.unsubscribe(slow);
  caf::anon_send_exit(slow, caf::exit_reason::user_shutdown);
}

// A peer never heard from is given first_contact_timeout (not peer_timeout) to appear.
TEST(Gateway, ReportsPeerThatNeverAppears) {
  System s;
  auto cfg = config("a", ipc_ep(), {{"ghost", ipc_ep()}});
  cfg.first_contact_timeout = 1200ms;
  const auto t0 = std::chrono::steady_clock::now();
  Gateway a(cfg);
  Inbox errors(*s.sys);
  a.subscribe(MsgType::error, errors.handle());
  auto e = errors.next(5s);
  EXPECT_GE(std::chrono::steady_clock::now() - t0, cfg.first_contact_timeout) << "reported before its first contact was due";
  ASSERT_TRUE(e);
  const auto& err = std::get<Error>(e->second.payload);
  EXPECT_EQ(err.code, ErrorCode::peer_down);
  EXPECT_EQ(err.peer, "ghost");
  EXPECT_NE(err.message.find("not reachable"), std::string::npos) << err.message;
  EXPECT_FALSE(errors.next(300ms)) << "reported more than once";
}

// --- configuration ------------------------------------------------------------------------

// A topology draws all its ports before any is bound: a range once handed out is never handed
// out again, so two nodes of one test never share a port (300 random pairs would collide
// several times otherwise).
TEST(Gateway, FreePortRangesNeverOverlap) {
  std::set<int> ports;
  for (int i = 0; i < 300; ++i) {
    const int p = free_port_pair();
    EXPECT_TRUE(ports.insert(p).second) << p;
    EXPECT_TRUE(ports.insert(p + 1).second) << p + 1;
  }
}

// Nor do two processes drawing at once (a test and the nodes of a concurrent test, two
// `specmesh run --spawn`): neither has bound its ports yet, so only the lease keeps them apart.
// 300 pairs each out of 22000 ports would overlap about 16 times without it.
TEST(Gateway, FreePortRangesOfConcurrentProcessesNeverOverlap) {
  int fds[2];
  ASSERT_EQ(::pipe(fds), 0);
  const pid_t child = ::fork();
  ASSERT_GE(child, 0);
  if (child == 0) {
    ::close(fds[0]);
    for (int i = 0; i < 300; ++i) {
      const int p = free_port_pair();
      if (::write(fds[1], &p, sizeof p) != sizeof p) ::_exit(2);
    }
    ::_exit(0);
  }
  ::close(fds[1]);
  std::set<int> mine;
  for (int i = 0; i < 300; ++i) {
    const int p = free_port_pair();
    mine.insert({p, p + 1});
  }
  int theirs = 0, overlaps = 0, p = 0;
  while (::read(fds[0], &p, sizeof p) == sizeof p) {
    ++theirs;
    overlaps += int(mine.count(p) + mine.count(p + 1));
  }
  ::close(fds[0]);
  int status = 0;
  ::waitpid(child, &status, 0);
  EXPECT_EQ(theirs, 300);
  EXPECT_EQ(overlaps, 0);
}

TEST(Gateway, BindsLoopbackOnlyUnlessAllowed) {
  int port = free_port_pair();
  for (std::string host : {"0.0.0.0", "*", "10.1.2.3", "eth0", "localhost", "127.evil.example", "[::]"}) {
    auto cfg = config("a", "tcp://" + host + ":" + std::to_string(port), {});
    EXPECT_THROW(Gateway g(cfg), std::invalid_argument) << host;
  }
  {
    Gateway ok(config("a", "tcp://127.0.0.1:" + std::to_string(port), {}));
    EXPECT_EQ(ok.control_endpoint(), "tcp://127.0.0.1:" + std::to_string(port + 1));
  }
  if (has_ipv6_loopback()) {
    Gateway v6(config("a", "tcp://[::1]:" + std::to_string(port), {}));
    EXPECT_EQ(v6.control_endpoint(), "tcp://[::1]:" + std::to_string(port + 1));
  }
}

TEST(Gateway, RejectsBadConfigClearly) {
  EXPECT_THROW(Gateway(config("", ipc_ep(), {})), std::invalid_argument);
  EXPECT_THROW(Gateway(config("a", ipc_ep(), {{"a", ipc_ep()}})), std::invalid_argument);
  EXPECT_THROW(Gateway(config("a", "udp://127.0.0.1:5", {})), std::invalid_argument);
  EXPECT_THROW(Gateway(config("a", "tcp://127.0.0.1:notaport", {})), std::invalid_argument);
  EXPECT_THROW(Gateway(config("a", ipc_ep(), {{"b", "tcp://127.0.0.1"}})), std::invalid_argument);
  GatewayConfig impatient = config("a", ipc_ep(), {});
  impatient.first_contact_timeout = impatient.peer_timeout / 2;
  EXPECT_THROW(Gateway{impatient}, std::invalid_argument);
  EXPECT_EQ(control_endpoint_for("ipc:///tmp/x"), "ipc:///tmp/x.ctl");
  EXPECT_EQ(control_endpoint_for("inproc://x"), "inproc://x.ctl");
  EXPECT_EQ(control_endpoint_for("tcp://[::1]:7000"), "tcp://[::1]:7001");

  // Binding a port that is taken names the endpoint in the error.
  int port = free_port_pair();
  zmq::context_t ctx;
  zmq::socket_t squatter(ctx, zmq::socket_type::router);
  squatter.set(zmq::sockopt::linger, 0);
  squatter.bind("tcp://127.0.0.1:" + std::to_string(port));
  try {
    Gateway g(config("a", "tcp://127.0.0.1:" + std::to_string(port), {}));
    ADD_FAILURE() << "bind to a taken port succeeded";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find(std::to_string(port)), std::string::npos) << e.what();
  }
}

TEST(Gateway, SendChecksPeerAndTensors) {
  Gateway a(config("a", ipc_ep(), {{"b", ipc_ep()}}));
  EXPECT_FALSE(a.send("nobody", make_envelope(0, Cancel{{1}})));
  Tensor bad = float_tensor({2, 2}, 0.0f);
  bad.shape = {3, 3};
  EXPECT_THROW(a.send("b", make_envelope(0, Logits{"target", {0}, bad})), std::invalid_argument);
}

}  // namespace
}  // namespace specmesh

// CURVE on tcp, private ipc directories and the keys of a topology: good peers talk, every
// kind of bad peer (no keys, unknown keys, a wrong server key, another node's key under a
// borrowed name) delivers nothing, leaves a running exchange alone and shows up in the
// gateway's stats; bad key files and unsafe settings are refused with errors that name them.
#include "private_dir.hpp"
#include "specmesh/runtime/keys.hpp"
#include "specmesh/transport/curve.hpp"
#include "specmesh/transport/gateway.hpp"
#include "specmesh/transport/ipc_dir.hpp"

#include "actor_harness.hpp"
#include "processes.hpp"
#include "refdata.hpp"

#include <gtest/gtest.h>
#include <zmq.hpp>

#include <sys/stat.h>
#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <thread>

namespace specmesh {
namespace {

using namespace std::chrono_literals;
using namespace test;
namespace fs = std::filesystem;

std::string tcp_ep() { return "tcp://127.0.0.1:" + std::to_string(free_port_pair()); }

GatewayConfig config(std::string node, std::string bind, std::map<std::string, std::string> peers) {
  return quick_gateway(std::move(node), std::move(bind), std::move(peers));
}

// A mesh of named nodes with a key pair each; curve_for(n) is node n's view of it.
struct Keys {
  std::map<std::string, CurveKeyPair> pairs;
  explicit Keys(std::initializer_list<std::string> nodes) {
    for (const auto& n : nodes) pairs[n] = curve_keypair();
  }
  CurveConfig curve_for(const std::string& node, const std::map<std::string, std::string>& peers) const {
    CurveConfig c{pairs.at(node).public_key, pairs.at(node).secret_key, {}};
    for (const auto& [p, ep] : peers) c.peer_keys[p] = pairs.at(p).public_key;
    return c;
  }
  GatewayConfig gateway(const std::string& node, const std::string& bind,
                        const std::map<std::string, std::string>& peers) const {
    GatewayConfig c = config(node, bind, peers);
    c.curve = curve_for(node, peers);
    return c;
  }
};

// A hand-driven DEALER pair speaking to a gateway's two ROUTERs, with whatever keys and
// routing id a hostile peer might use (no keys at all when `client` is empty).
struct RawPeer {
  zmq::context_t ctx{1};
  zmq::socket_t sock[2];
  RawPeer(const std::string& routing_id, const std::string& gateway_ep, const std::optional<CurveKeyPair>& client,
          const std::string& server_public) {
    const std::string eps[2] = {gateway_ep, control_endpoint_for(gateway_ep)};
    for (int ch = 0; ch < 2; ++ch) {
      sock[ch] = zmq::socket_t(ctx, zmq::socket_type::dealer);
      sock[ch].set(zmq::sockopt::linger, 0);
      sock[ch].set(zmq::sockopt::routing_id, zmq::buffer(routing_id));
      if (client) {
        sock[ch].set(zmq::sockopt::curve_serverkey, server_public);
        sock[ch].set(zmq::sockopt::curve_publickey, client->public_key);
        sock[ch].set(zmq::sockopt::curve_secretkey, client->secret_key);
      }
      sock[ch].connect(eps[ch]);
    }
  }
  // A well-formed envelope; what a real peer would send first.
  void send_env(Envelope env, uint64_t seq = 0) {
    env.seq = seq;
    env.session = 0x5eed;
    std::vector<char> h;
    std::vector<Blob> b;
    encode(env, h, b);
    const int ch = is_control(env.type()) ? 1 : 0;
    zmq::message_t head(h.data(), h.size());
    // Never blocks: without a completed handshake there is nobody to queue for.
    if (!sock[ch].send(head, b.empty() ? zmq::send_flags::dontwait : zmq::send_flags::dontwait | zmq::send_flags::sndmore))
      return;
    for (std::size_t i = 0; i < b.size(); ++i) {
      zmq::message_t f(b[i].data(), b[i].size());
      (void)sock[ch].send(f, i + 1 < b.size() ? zmq::send_flags::sndmore | zmq::send_flags::dontwait
                                              : zmq::send_flags::dontwait);
    }
  }
  // Keeps sending (a new heartbeat and a new activation every 20 ms) for `d`.
  void keep_sending(std::chrono::milliseconds d) {
    const auto end = std::chrono::steady_clock::now() + d;
    for (uint64_t i = 0; std::chrono::steady_clock::now() < end; ++i) {
      send_env(make_envelope(0, Heartbeat{}), i);
      send_env(make_envelope(666, Activations{"target", 0, {}, {float_tensor({2, 8}, 6.0f)}}), i);
      std::this_thread::sleep_for(20ms);
    }
  }
};

// b streams numbered activations to a while `attack` runs, then a checks it got every one, in
// order, with no sequence trouble: the exchange between good peers was not disturbed.
void expect_undisturbed_exchange(const Keys& keys, const std::function<void(const std::string& a_ep)>& attack,
                                 const std::function<void(const GatewayStats&)>& check_stats) {
  System s;
  const std::string ea = tcp_ep(), eb = tcp_ep();
  Gateway a(keys.gateway("a", ea, {{"b", eb}, {"c", tcp_ep()}}));
  Gateway b(keys.gateway("b", eb, {{"a", ea}}));
  Inbox in(*s.sys);
  a.subscribe(MsgType::activations, in.handle());
  ASSERT_TRUE(b.send("a", make_envelope(1, Activations{"target", 0, {}, {float_tensor({1, 4}, 0.0f)}})));
  ASSERT_TRUE(in.next()) << "good peers do not talk";
  std::atomic<bool> stop{false};
  std::atomic<int> sent{0};
  std::thread streamer([&] {
    while (!stop.load()) {
      const int i = ++sent;
      (void)b.send("a", make_envelope(uint64_t(1000 + i), Activations{"target", 0, {}, {float_tensor({2, 64}, float(i))}}));
      std::this_thread::sleep_for(5ms);
    }
  });
  attack(ea);
  stop = true;
  streamer.join();
  for (int i = 1; i <= sent.load(); ++i) {
    auto m = in.next();
    ASSERT_TRUE(m) << "message " << i << " of " << sent.load() << " from the good peer never arrived";
    EXPECT_EQ(m->first, "b");
    ASSERT_EQ(m->second.run_id, uint64_t(1000 + i)) << "the good peer's stream was broken";
  }
  EXPECT_FALSE(in.next(200ms)) << "something else was delivered";
  const GatewayStats st = a.stats();
  EXPECT_EQ(st.rejected_for(RejectReason::seq_gap), 0u);
  EXPECT_EQ(st.rejected_for(RejectReason::seq_reordered), 0u);
  EXPECT_TRUE(a.peer_alive("b"));
  check_stats(st);
}

// --- gateways under CURVE ---------------------------------------------------------------

TEST(Curve, GoodPeersExchangeTensorsBothWays) {
  System s;
  Keys keys{"a", "b"};
  const std::string ea = tcp_ep(), eb = tcp_ep();
  Gateway a(keys.gateway("a", ea, {{"b", eb}}));
  Gateway b(keys.gateway("b", eb, {{"a", ea}}));
  Inbox in_a(*s.sys), in_b(*s.sys);
  for (auto t : {MsgType::activations, MsgType::logits, MsgType::cancel}) {
    a.subscribe(t, in_a.handle());
    b.subscribe(t, in_b.handle());
  }
  const Envelope act = make_envelope(7, Activations{"target", 3, {}, {float_tensor({3, 4096}, 1.5f), float_tensor({3, 2}, 9.0f)}});
  const Envelope logits = make_envelope(7, Logits{"target", {2}, float_tensor({1, 100}, -3.0f)});
  ASSERT_TRUE(a.send("b", act));
  ASSERT_TRUE(b.send("a", logits));
  ASSERT_TRUE(a.send("b", make_envelope(0, Cancel{{7}})));
  auto m1 = in_b.next(), m2 = in_b.next(), m3 = in_a.next();
  ASSERT_TRUE(m1 && m2 && m3);
  const Envelope& got_act = m1->second.type() == MsgType::activations ? m1->second : m2->second;
  EXPECT_EQ(got_act.payload, act.payload);
  EXPECT_EQ(m3->first, "b");
  EXPECT_EQ(m3->second.payload, logits.payload);
  EXPECT_TRUE(wait_until([&] { return a.peer_alive("b") && b.peer_alive("a"); }));
  for (const Gateway* g : {&a, &b}) {
    EXPECT_EQ(g->stats().rejected_total(), 0u);
    EXPECT_EQ(g->stats().handshakes_failed, 0u);
    EXPECT_EQ(g->stats().auth_denied, 0u);
  }
}

TEST(Curve, MixedTransportsUseCurveOnlyOnTcp) {
  // b listens on ipc, a on tcp: b reaches a with CURVE, a reaches b over the private socket.
  System s;
  Keys keys{"a", "b"};
  const std::string ea = tcp_ep(), eb = ipc_ep();
  Gateway a(keys.gateway("a", ea, {{"b", eb}}));
  Gateway b(keys.gateway("b", eb, {{"a", ea}}));
  Inbox in_a(*s.sys), in_b(*s.sys);
  a.subscribe(MsgType::logits, in_a.handle());
  b.subscribe(MsgType::logits, in_b.handle());
  ASSERT_TRUE(a.send("b", make_envelope(1, Logits{"target", {0}, float_tensor({1, 8}, 0.0f)})));
  ASSERT_TRUE(b.send("a", make_envelope(2, Logits{"target", {0}, float_tensor({1, 8}, 1.0f)})));
  ASSERT_TRUE(in_a.next());
  ASSERT_TRUE(in_b.next());
  EXPECT_EQ(a.stats().rejected_total() + b.stats().rejected_total(), 0u);
}

TEST(Curve, PeerWithoutKeysDeliversNothing) {
  Keys keys{"a", "b", "c"};
  expect_undisturbed_exchange(
      keys,
      [&](const std::string& ea) {
        RawPeer plain("b", ea, std::nullopt, "");
        plain.keep_sending(600ms);
      },
      [](const GatewayStats& st) {
        EXPECT_GT(st.handshakes_failed, 0u) << "the refused handshake is not counted";
        EXPECT_EQ(st.auth_denied, 0u) << "a peer without CURVE never reaches the ZAP handler";
      });
}

TEST(Curve, PeerWithUnknownKeysIsDeniedByZap) {
  Keys keys{"a", "b", "c"};
  expect_undisturbed_exchange(
      keys,
      [&](const std::string& ea) {
        RawPeer stranger("b", ea, curve_keypair(), keys.pairs.at("a").public_key);
        stranger.keep_sending(600ms);
      },
      [](const GatewayStats& st) {
        EXPECT_GT(st.auth_denied, 0u) << "the unknown key was not refused by ZAP";
        EXPECT_GT(st.handshakes_failed, 0u);
      });
}

TEST(Curve, PeerWithWrongServerKeyDeliversNothing) {
  Keys keys{"a", "b", "c"};
  expect_undisturbed_exchange(
      keys,
      [&](const std::string& ea) {
        // c's own valid key pair, but not a's public key as the server key.
        RawPeer confused("c", ea, keys.pairs.at("c"), curve_keypair().public_key);
        confused.keep_sending(600ms);
      },
      [](const GatewayStats& st) { EXPECT_GT(st.handshakes_failed, 0u); });
}

TEST(Curve, ValidKeyUnderAnotherNodesNameIsRejected) {
  Keys keys{"a", "b", "c"};
  expect_undisturbed_exchange(
      keys,
      [&](const std::string& ea) {
        // c holds its own valid key and claims to be b, with b's bare name and with the
        // form a real gateway uses (name, NUL, random bytes).
        RawPeer bare("b", ea, keys.pairs.at("c"), keys.pairs.at("a").public_key);
        RawPeer suffixed(std::string("b\0abcdefgh", 10), ea, keys.pairs.at("c"), keys.pairs.at("a").public_key);
        std::thread t([&] { suffixed.keep_sending(600ms); });
        bare.keep_sending(600ms);
        t.join();
      },
      [](const GatewayStats& st) {
        EXPECT_GT(st.rejected_for(RejectReason::identity_mismatch), 0u) << "the borrowed name was not noticed";
        EXPECT_EQ(st.auth_denied, 0u) << "c's key itself is a configured peer's";
      });
  EXPECT_STREQ(to_string(RejectReason::identity_mismatch), "identity_mismatch");
}

TEST(Curve, GatewayOnOurSideRefusesAPeerThatDoesNotKnowUs) {
  // b has a key for a that is not a's: its handshakes fail, and it says so in its own stats.
  System s;
  Keys keys{"a", "b"};
  const std::string ea = tcp_ep(), eb = tcp_ep();
  Gateway a(keys.gateway("a", ea, {{"b", eb}}));
  GatewayConfig cb = keys.gateway("b", eb, {{"a", ea}});
  cb.curve->peer_keys["a"] = curve_keypair().public_key;
  Gateway b(cb);
  Inbox in(*s.sys);
  a.subscribe(MsgType::logits, in.handle());
  ASSERT_TRUE(b.send("a", make_envelope(1, Logits{"target", {0}, float_tensor({1, 8}, 0.0f)})));
  EXPECT_FALSE(in.next(500ms));
  EXPECT_TRUE(wait_until([&] { return b.stats().handshakes_failed > 0 && a.stats().handshakes_failed > 0; }));
  EXPECT_FALSE(a.peer_alive("b"));
}

TEST(Curve, BadCurveSettingsAreRefusedClearly) {
  Keys keys{"a", "b"};
  const std::string ea = tcp_ep(), eb = tcp_ep();
  auto expect_refused = [&](GatewayConfig c, const std::string& needle) {
    try {
      Gateway g(c);
      ADD_FAILURE() << "accepted: " << needle;
    } catch (const std::invalid_argument& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  GatewayConfig c = keys.gateway("a", ea, {{"b", eb}});
  c.curve->secret_key = "not a key";
  expect_refused(c, "secret key is not a Z85 key");
  c = keys.gateway("a", ea, {{"b", eb}});
  c.curve->public_key = keys.pairs.at("b").public_key;
  expect_refused(c, "does not belong to the secret key");
  c = keys.gateway("a", ea, {{"b", eb}});
  c.curve->peer_keys.clear();
  expect_refused(c, "no public key for peer 'b'");
  c = keys.gateway("a", ea, {{"b", eb}});
  c.curve->peer_keys["zed"] = keys.pairs.at("b").public_key;
  expect_refused(c, "'zed', which is no peer");
  c = keys.gateway("a", ea, {{"b", eb}});
  c.curve->peer_keys["b"] = std::string(40, '~');
  expect_refused(c, "key of peer 'b' is not a Z85 key");
  EXPECT_FALSE(is_z85_key(std::string(39, 'a')));
  EXPECT_TRUE(is_z85_key(keys.pairs.at("a").public_key));
  EXPECT_EQ(curve_public_of(keys.pairs.at("a").secret_key), keys.pairs.at("a").public_key);
}

TEST(Curve, NonLoopbackBindNeedsPermissionAndCurve) {
  const std::string ep = "tcp://10.255.255.1:" + std::to_string(free_port_pair());
  GatewayConfig plain = config("a", ep, {});
  EXPECT_THROW(Gateway g(plain), std::invalid_argument);
  plain.allow_non_loopback = true;
  try {
    Gateway g(plain);
    ADD_FAILURE() << "non-loopback bind without CURVE accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("needs CURVE keys"), std::string::npos) << e.what();
  }
  // With both, the only obstacle left is that this host has no such address.
  Keys keys{"a"};
  GatewayConfig ok = keys.gateway("a", ep, {});
  ok.allow_non_loopback = true;
  EXPECT_THROW(Gateway g(ok), std::runtime_error);
}

// --- private ipc directories ------------------------------------------------------------

struct TempDir : test::ScopedTempDir {
  TempDir() : ScopedTempDir("curve-test") {}
};

mode_t mode_of(const std::string& p) {
  struct stat st {};
  return ::stat(p.c_str(), &st) == 0 ? (st.st_mode & 07777) : 0;
}

TEST(IpcDir, SocketFilesArePrivateAndMissingDirectoriesAreMade0700) {
  TempDir t;
  const std::string dir = t.path + "/made/here";
  Gateway g(config("a", "ipc://" + dir + "/a", {}));
  EXPECT_EQ(mode_of(t.path + "/made"), 0700u);
  EXPECT_EQ(mode_of(dir), 0700u);
  EXPECT_EQ(mode_of(dir + "/a"), 0600u);
  EXPECT_EQ(mode_of(dir + "/a.ctl"), 0600u);
}

TEST(IpcDir, SharedOrForeignDirectoriesAreRefusedByName) {
  TempDir t;
  auto expect_refused = [](const std::string& ep, const std::string& needle) {
    try {
      Gateway g(config("a", ep, {}));
      ADD_FAILURE() << "bound " << ep;
    } catch (const std::runtime_error& e) {
      EXPECT_NE(std::string(e.what()).find(needle), std::string::npos) << e.what();
    }
  };
  fs::create_directory(t.path + "/open");
  ::chmod((t.path + "/open").c_str(), 0755);
  expect_refused("ipc://" + t.path + "/open/a", "'" + t.path + "/open' is accessible by group or others (mode 0755)");
  expect_refused("ipc:///tmp/specmesh-curve-test-" + std::to_string(::getpid()), "'/tmp' is accessible");
  expect_refused("ipc://@specmesh-abstract", "abstract sockets");
  if (::geteuid() == 0) {
    fs::create_directory(t.path + "/theirs");
    ::chmod((t.path + "/theirs").c_str(), 0700);
    ASSERT_EQ(::chown((t.path + "/theirs").c_str(), 65534, 65534), 0);
    expect_refused("ipc://" + t.path + "/theirs/a", "is owned by uid 65534");
  }
  // Connecting to a peer whose socket is in a shared directory is refused as well.
  try {
    Gateway g(config("a", ipc_ep(), {{"b", "ipc://" + t.path + "/open/b"}}));
    ADD_FAILURE() << "connected into a shared directory";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("/open"), std::string::npos) << e.what();
  }
}


// --- keys in the topology ---------------------------------------------------------------

std::string message_of(const std::function<void()>& f) {
  try {
    f();
  } catch (const std::exception& e) {
    return e.what();
  }
  return "(no error)";
}

const std::string kTcpNodes =
    "[models.m]\npath = \"m.gguf\"\n[run]\n"                     // lines 1-3
    "[nodes.head]\nendpoint = \"tcp://127.0.0.1:47310\"\nhead = true\n"  // 4-6
    "[nodes.n0]\nendpoint = \"tcp://127.0.0.1:47320\"\n"              // 7-8
    "[devices.d]\nnode = \"n0\"\n";                                  // 9-10

TEST(TopologySecurity, SecurityTableParsesWithLinesAndResolvesTheKeyDirectory) {
  Topology t = Topology::parse(kTcpNodes + "[security]\nkeys = \"k\"\nallow_remote = true\n", "t.toml", "/base");
  EXPECT_EQ(t.security.keys, "/base/k");
  EXPECT_TRUE(t.security.allow_remote);
  EXPECT_EQ(t.lines.at("security.keys"), 12);
  EXPECT_EQ(t.lines.at("nodes.n0.endpoint"), 8);
  EXPECT_EQ(Topology::parse(kTcpNodes, "t.toml", "/base").security.keys, "");
  EXPECT_EQ(message_of([] { Topology::parse(kTcpNodes + "[security]\nkeyz = \"k\"\n", "t.toml", "/"); }),
            "t.toml:12: security.keyz: unknown key");
  EXPECT_EQ(message_of([] { Topology::parse(kTcpNodes + "[security]\nkeys = \"\"\n", "t.toml", "/"); }),
            "t.toml:12: security.keys: must name a directory");
  EXPECT_EQ(message_of([] { Topology::parse(kTcpNodes + "[security]\nallow_remote = 1\n", "t.toml", "/"); }),
            "t.toml:12: security.allow_remote: expected true or false");
}

TEST(TopologySecurity, TcpWithoutKeysIsAConfigErrorThatSuggestsKeygen) {
  const Topology t = Topology::parse(kTcpNodes, "t.toml", "/");
  const std::string m = message_of([&] { check_security(t, {"n0"}); });
  EXPECT_EQ(m.rfind("t.toml:8: security.keys: missing: node 'n0' uses tcp://", 0), 0u) << m;
  EXPECT_NE(m.find("specmesh keygen --topology t.toml"), std::string::npos) << m;
  EXPECT_NE(message_of([&] { (void)node_curve(t, "n0"); }).find("security.keys: missing"), std::string::npos);
  // ipc and inproc topologies need none.
  const Topology ipc = Topology::parse("[models.m]\npath = \"m.gguf\"\n[run]\n[nodes.h]\nendpoint = \"ipc:///x/h\"\nhead = true\n",
                                       "t.toml", "/");
  EXPECT_NO_THROW(check_security(ipc, {"h"}));
  EXPECT_FALSE(node_curve(ipc, "h"));
}

TEST(TopologySecurity, AllowRemoteNeedsKeysAndNonLoopbackNeedsAllowRemote) {
  const Topology no_keys = Topology::parse(kTcpNodes + "[security]\nallow_remote = true\n", "t.toml", "/");
  EXPECT_EQ(message_of([&] { check_security(no_keys, {}); }).rfind("t.toml:12: security.allow_remote: listening beyond "
                                                                  "loopback is allowed only with CURVE keys", 0),
            0u);
  std::string remote = kTcpNodes;
  remote.replace(remote.find("127.0.0.1:47320"), 9, "10.9.8.7");
  Topology t = Topology::parse(remote + "[security]\nkeys = \"k\"\n", "t.toml", "/");
  EXPECT_NO_THROW(check_security(t, {"head"})) << "only the nodes this process hosts bind";
  EXPECT_EQ(message_of([&] { check_security(t, {"n0"}); }),
            "t.toml:8: nodes.n0.endpoint: 'tcp://10.9.8.7:47320' is not a loopback address (127.x.x.x or [::1]); to "
            "listen on other interfaces set allow_remote = true in [security] (or pass --allow-remote), with CURVE keys");
  t.security.allow_remote = true;
  EXPECT_NO_THROW(check_security(t, {"n0"}));
}

struct KeyDir : test::ScopedTempDir {
  KeyDir() : ScopedTempDir("keys-test") {}
};

// Runs the specmesh binary; its exit status and what it printed.
std::pair<int, std::string> specmesh_cli(const std::vector<std::string>& args, const std::string& log) {
  const pid_t p = start_cli(args, log);
  const auto st = test::wait_exit(p, 10000ms);
  if (!st) {
    ::kill(p, SIGKILL);
    ::waitpid(p, nullptr, 0);
  }
  return {st.value_or(-1), test::read_file(log)};
}

TEST(Keygen, WritesZcertFilesWithPrivateSecretsAndRefusesToOverwrite) {
  KeyDir d;
  const std::string keys = d.path + "/new/keys";
  auto [rc, out] = specmesh_cli({"keygen", keys, "head", "stage0"}, d.path + "/keygen.log");
  ASSERT_EQ(rc, 0) << out;
  EXPECT_EQ(mode_of(keys), 0700u);
  for (const std::string n : {"head", "stage0"}) {
    const std::string pub = keys + "/" + n + ".key", sec = keys + "/" + n + ".key_secret";
    EXPECT_NE(out.find(pub), std::string::npos) << out;
    EXPECT_EQ(mode_of(pub), 0644u);
    EXPECT_EQ(mode_of(sec), 0600u);
    const std::string pub_text = read_file(pub), sec_text = read_file(sec);
    EXPECT_NE(pub_text.find("curve\n    public-key = \""), std::string::npos) << pub_text;
    EXPECT_NE(pub_text.find("name = \"" + n + "\""), std::string::npos) << pub_text;
    EXPECT_EQ(pub_text.find("secret-key"), std::string::npos) << "the public file holds the secret";
    EXPECT_NE(sec_text.find("    secret-key = \""), std::string::npos) << sec_text;
    const CurveKeyPair k = read_secret_key(sec);
    EXPECT_EQ(read_public_key(pub), k.public_key);
    EXPECT_EQ(curve_public_of(k.secret_key), k.public_key);
  }
  EXPECT_NE(read_public_key(keys + "/head.key"), read_public_key(keys + "/stage0.key"));
  const std::string before = read_public_key(keys + "/head.key");
  auto [rc2, out2] = specmesh_cli({"keygen", keys, "head"}, d.path + "/again.log");
  EXPECT_EQ(rc2, 1);
  EXPECT_NE(out2.find(keys + "/head.key_secret: exists; pass --force"), std::string::npos) << out2;
  EXPECT_EQ(read_public_key(keys + "/head.key"), before);
  auto [rc3, out3] = specmesh_cli({"keygen", keys, "head", "--force"}, d.path + "/force.log");
  EXPECT_EQ(rc3, 0) << out3;
  EXPECT_NE(read_public_key(keys + "/head.key"), before);
  auto [rc4, out4] = specmesh_cli({"keygen", keys, "../escape"}, d.path + "/escape.log");
  EXPECT_EQ(rc4, 1);
  EXPECT_NE(out4.find("cannot name a key file"), std::string::npos) << out4;
}

TEST(Keygen, TopologyOptionMakesKeysForEveryNodeIntoItsKeyDirectory) {
  KeyDir d;
  const std::string topo = d.path + "/t.toml";
  std::ofstream(topo) << kTcpNodes << "[security]\nkeys = \"keys\"\n";
  auto [rc, out] = specmesh_cli({"keygen", "--topology", topo}, d.path + "/keygen.log");
  ASSERT_EQ(rc, 0) << out;
  const Topology t = Topology::load(topo);
  const auto head = node_curve(t, "head");
  ASSERT_TRUE(head);
  EXPECT_EQ(head->peer_keys.at("n0"), read_public_key(d.path + "/keys/n0.key"));
  EXPECT_EQ(head->public_key, read_public_key(d.path + "/keys/head.key"));
  // Without [security] keys it needs a directory.
  std::ofstream(topo) << kTcpNodes;
  auto [rc2, out2] = specmesh_cli({"keygen", "--topology", topo}, d.path + "/nodir.log");
  EXPECT_EQ(rc2, 1);
  EXPECT_NE(out2.find(topo + ": security.keys: not set"), std::string::npos) << out2;
}

TEST(Keygen, BadKeyFilesAreRefusedByPath) {
  KeyDir d;
  write_node_keys(d.path, "a");
  write_node_keys(d.path, "b");
  const std::string pub = d.path + "/a.key", sec = d.path + "/a.key_secret";
  EXPECT_EQ(message_of([&] { read_public_key(d.path + "/nobody.key"); })
                .rfind(d.path + "/nobody.key: cannot read the public key file", 0),
            0u);
  std::ofstream(d.path + "/bad.key") << "# comment\ncurve\n    public-key = \"tooshort\"\n";
  EXPECT_EQ(message_of([&] { read_public_key(d.path + "/bad.key"); }),
            d.path + "/bad.key:3: public-key: not a Z85 CURVE key (40 characters)");
  std::ofstream(d.path + "/empty.key") << "metadata\n";
  EXPECT_NE(message_of([&] { read_public_key(d.path + "/empty.key"); }).find("empty.key: no public-key"),
            std::string::npos);
  ::chmod(sec.c_str(), 0640);
  EXPECT_EQ(message_of([&] { read_secret_key(sec); }),
            sec + ": the secret key file is accessible by group or others (mode 0640); chmod 600 " + sec);
  ::chmod(sec.c_str(), 0600);
  // A secret file whose public key is another node's.
  std::string text = read_file(sec);
  const std::string a_pub = read_public_key(pub), b_pub = read_public_key(d.path + "/b.key");
  text.replace(text.find(a_pub), a_pub.size(), b_pub);
  { std::ofstream(sec) << text; }
  EXPECT_EQ(message_of([&] { read_secret_key(sec); }), sec + ": public-key does not belong to secret-key");
  // A node's public file that does not match its secret: the others would refuse it.
  write_node_keys(d.path, "a", true);
  write_node_keys(d.path, "c");
  std::filesystem::copy_file(d.path + "/c.key", pub, fs::copy_options::overwrite_existing);
  Topology t = Topology::parse(kTcpNodes, "t.toml", "/");
  t.nodes = {{"a", {"a", "tcp://127.0.0.1:1000", true}}, {"b", {"b", "tcp://127.0.0.1:1002", false}}};
  t.security.keys = d.path;
  EXPECT_NE(message_of([&] { (void)node_curve(t, "a"); }).find(pub + ": does not match " + sec), std::string::npos);
  EXPECT_NO_THROW((void)node_curve(t, "b"));
  write_node_keys(d.path, "a", true);
  fs::remove(d.path + "/b.key");
  EXPECT_NE(message_of([&] { (void)node_curve(t, "a"); }).find(d.path + "/b.key: cannot read"), std::string::npos);
}

TEST(Keygen, HandStartedNodeWithoutKeysExitsWithTheConfigError) {
  KeyDir d;
  const std::string topo = d.path + "/t.toml";
  std::ofstream(topo) << kTcpNodes;
  auto [rc, out] = specmesh_cli({"node", "--config", topo, "--name", "n0"}, d.path + "/node.log");
  EXPECT_EQ(rc, 1);
  EXPECT_NE(out.find(topo + ":8: security.keys: missing: node 'n0' uses tcp://"), std::string::npos) << out;
  EXPECT_NE(out.find("specmesh keygen --topology"), std::string::npos) << out;
}

TEST(Keygen, SpawnedTcpRunUsesThrowawayKeysAndRemovesThem) {
  SPECMESH_REQUIRE_REFDATA();
  KeyDir d;  // TMPDIR for the run: its throwaway key directory goes here
  const std::string topo = d.path + "/t.toml";
  const int base = free_port_range(4);
  std::ofstream(topo) << "[models.m]\npath = \"" << refdata("gguf-models/stories260K.gguf") << "\"\n[run]\n"
                      << "[nodes.head]\nendpoint = \"tcp://127.0.0.1:" << base << "\"\nhead = true\n"
                      << "[nodes.n0]\nendpoint = \"tcp://127.0.0.1:" << base + 2 << "\"\n"
                      << "[devices.d]\nnode = \"n0\"\n";
  ::setenv("TMPDIR", d.path.c_str(), 1);
  ::setenv("SPECMESH_LOG", "info", 1);
  auto [rc, out] = specmesh_cli({"run", topo, "--spawn", "-p", "Once upon a time", "-n", "4"}, d.path + "/run.log");
  ::unsetenv("TMPDIR");
  ::unsetenv("SPECMESH_LOG");
  EXPECT_EQ(rc, 0) << out;
  EXPECT_NE(out.find("gateway 'n0'"), std::string::npos) << out;
  EXPECT_NE(out.find(", CURVE on tcp"), std::string::npos) << "the run did not encrypt: " << out;
  for (const auto& e : fs::directory_iterator(d.path))
    EXPECT_EQ(e.path().filename().string().rfind("specmesh-keys-", 0), std::string::npos) << e.path() << " was left behind";
}

}  // namespace
}  // namespace specmesh

// Round-trip latency through the gateway versus raw ZeroMQ, between two processes.
//
//   hop: actor -> gateway -> ZeroMQ -> gateway -> echo actor -> gateway -> ZeroMQ -> gateway -> actor
//   raw: thread -> DEALER -> ZeroMQ -> ROUTER -> echo thread -> ROUTER -> ZeroMQ -> DEALER -> thread
//
// One round trip is two hops. Both sides send the same frames (a header frame the size of the
// gateway's envelope header plus the payload frame) and both use zero-copy sends for large
// payloads. The echo side runs in a child process started by re-executing this binary, so
// each side has its own ZeroMQ context and CAF scheduler. Raw and gateway runs alternate in
// rounds so that background load drifts affect all alike.
//
// Gateway variants (columns):
//   sched   actors subscribed with Delivery::scheduled (a CAF worker wakes per message)
//   inline  actors subscribed with Delivery::inline_io (handler runs on the gateway thread)
//   queued  like sched, but GatewayConfig::send_from_caller = false (sends via the I/O thread)
//
// On a VM the absolute numbers depend on whether idle vCPUs have to be woken: on an idle
// machine every cross-CPU wake-up costs ~20-40 us and dominates; under load, or with
// `taskset -c 0 bench_hop`, wake-ups are cheap. Compare the columns of one run.
//
// Usage: bench_hop [--rounds N] [--iters N] [--variants sched,inline,queued]
//                  [--scheduler sharing|stealing|detached] [--transports ipc,tcp]
//                  [--sizes 1024,1048576]
#include "specmesh/transport/gateway.hpp"
#include "ports.hpp"

#include <caf/all.hpp>
#include <spdlog/spdlog.h>
#include <zmq.hpp>

#include <netinet/in.h>
#include <signal.h>
#include <sys/socket.h>
#include <sys/wait.h>
#include <unistd.h>

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstring>
#include <future>
#include <sstream>
#include <string>
#include <thread>
#include <vector>

using namespace specmesh;
using Clock = std::chrono::steady_clock;

namespace {

struct Options {
  int rounds = 3;
  int iters = 0;  // 0: chosen per size
  std::string scheduler = "sharing";
  std::vector<std::string> variants = {"sched", "inline"};
  std::vector<std::string> transports = {"ipc", "tcp"};
  std::vector<std::size_t> sizes = {1024, 1 << 20};
};

std::vector<std::string> split(const std::string& s) {
  std::vector<std::string> out;
  std::stringstream ss(s);
  for (std::string item; std::getline(ss, item, ',');)
    if (!item.empty()) out.push_back(item);
  return out;
}

void configure(caf::actor_system_config& cfg, const std::string& scheduler) {
  if (scheduler == "stealing") {
    cfg.set("scheduler.max-threads", std::size_t{2});  // CAF defaults otherwise
  } else {
    configure_low_latency_scheduler(cfg);  // "sharing" and "detached" (actors get own threads)
  }
}

using test::free_port_pair;  // shared with the tests

std::string endpoint(const std::string& transport, const std::string& tag) {
  if (transport == "tcp") return "tcp://127.0.0.1:" + std::to_string(free_port_pair());
  return "ipc:///tmp/specmesh-bench-" + std::to_string(::getpid()) + "-" + tag;
}

// Re-executes this binary with `args`; the child is killed by the parent when done.
pid_t spawn_child(const std::vector<std::string>& args) {
  std::vector<char*> argv;
  static std::string self = "/proc/self/exe";
  argv.push_back(self.data());
  std::vector<std::string> copy = args;
  for (auto& a : copy) argv.push_back(a.data());
  argv.push_back(nullptr);
  pid_t pid = ::fork();
  if (pid == 0) {
    ::execv("/proc/self/exe", argv.data());
    ::_exit(127);
  }
  return pid;
}

void stop_child(pid_t pid) {
  ::kill(pid, SIGTERM);
  int status = 0;
  ::waitpid(pid, &status, 0);
}

void no_free(void*, void*) {}

// --- children -------------------------------------------------------------------------------

int run_raw_echo(const std::string& ep) {
  zmq::context_t ctx(1);
  zmq::socket_t router(ctx, zmq::socket_type::router);
  router.set(zmq::sockopt::linger, 0);
  router.bind(ep);
  for (;;) {
    std::vector<zmq::message_t> parts;
    for (bool more = true; more;) {
      zmq::message_t m;
      (void)router.recv(m);
      more = m.more();
      parts.push_back(std::move(m));
    }
    for (std::size_t i = 0; i < parts.size(); ++i)
      (void)router.send(parts[i], i + 1 < parts.size() ? zmq::send_flags::sndmore : zmq::send_flags::none);
  }
}

int run_gateway_echo(const std::string& own, const std::string& peer, const std::string& scheduler,
                     const std::string& variant) {
  caf::actor_system_config cfg;
  configure(cfg, scheduler);
  caf::actor_system sys{cfg};
  GatewayConfig gc;
  gc.node = "echo";
  gc.bind = own;
  gc.peers = {{"bench", peer}};
  gc.linger = std::chrono::milliseconds(0);
  gc.send_from_caller = variant != "queued";
  Gateway gw(gc);
  auto echo = [&gw](caf::event_based_actor*) -> caf::behavior {
    // The received tensor frame is sent back as is: zero-copy in both directions.
    return {[&gw](const std::string& from, const Envelope& env) { gw.send(from, env); }};
  };
  auto actor = scheduler == "detached" ? sys.spawn<caf::detached>(echo) : sys.spawn(echo);
  gw.subscribe(MsgType::activations, actor, variant == "inline" ? Delivery::inline_io : Delivery::scheduled);
  for (;;) std::this_thread::sleep_for(std::chrono::seconds(1));
}

// --- parents --------------------------------------------------------------------------------

// The gateway header for an Activations message with one u8 tensor of `size` bytes.
std::size_t header_size(std::size_t size) {
  auto env = make_envelope(1, Activations{"target", 0, {}, {Tensor{WireDType::u8, {int64_t(size)}, Blob::copy_of(std::string(size, 'x').data(), size)}}});
  env.seq = 1000;
  env.session = 0xffffffffffffull;
  std::vector<char> h;
  std::vector<Blob> b;
  encode(env, h, b);
  return h.size();
}

std::vector<double> run_raw(const std::string& transport, std::size_t size, int warmup, int iters) {
  auto ep = endpoint(transport, "raw");
  pid_t child = spawn_child({"--raw-echo", ep});
  std::vector<double> rt;
  {
    zmq::context_t ctx(1);
    zmq::socket_t dealer(ctx, zmq::socket_type::dealer);
    dealer.set(zmq::sockopt::linger, 0);
    dealer.connect(ep);
    std::string header(header_size(size), 'h');
    std::vector<char> payload(size, 'x');
    for (int i = 0; i < warmup + iters; ++i) {
      auto t0 = Clock::now();
      zmq::message_t h(header.data(), header.size());
      zmq::message_t p = size >= 8192 ? zmq::message_t(payload.data(), size, no_free, nullptr)
                                      : zmq::message_t(payload.data(), size);
      (void)dealer.send(h, zmq::send_flags::sndmore);
      (void)dealer.send(p, zmq::send_flags::none);
      zmq::message_t r1, r2;
      (void)dealer.recv(r1);
      (void)dealer.recv(r2);
      auto t1 = Clock::now();
      if (r2.size() != size) std::fprintf(stderr, "raw: wrong reply size\n");
      if (i >= warmup) rt.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
    }
  }
  stop_child(child);
  if (transport == "ipc") ::unlink(ep.substr(6).c_str());
  return rt;
}

std::vector<double> run_hop(caf::actor_system& sys, const std::string& scheduler, const std::string& variant,
                            const std::string& transport, std::size_t size, int warmup, int iters) {
  auto own = endpoint(transport, "gw-a"), peer = endpoint(transport, "gw-b");
  pid_t child = spawn_child({"--gw-echo", peer, own, scheduler, variant});
  std::vector<double> rt;
  {
    GatewayConfig gc;
    gc.node = "bench";
    gc.bind = own;
    gc.peers = {{"echo", peer}};
    gc.linger = std::chrono::milliseconds(0);
    gc.send_from_caller = variant != "queued";
    Gateway gw(gc);
    auto tensor = Tensor{WireDType::u8, {int64_t(size)}, Blob::adopt(std::vector<uint8_t>(size, 'x'))};
    Envelope msg = make_envelope(1, Activations{"target", 0, {}, {tensor}});
    std::promise<void> done;
    Clock::time_point t0;
    int n = 0;
    auto pinger = [&](caf::event_based_actor*) -> caf::behavior {
      return {[&](const std::string&, const Envelope& env) {
        auto t1 = Clock::now();
        if (n >= warmup) rt.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
        if (++n == warmup + iters) {
          done.set_value();
          return;
        }
        t0 = Clock::now();
        gw.send("echo", msg);
      }};
    };
    auto actor = scheduler == "detached" ? sys.spawn<caf::detached>(pinger) : sys.spawn(pinger);
    gw.subscribe(MsgType::activations, actor, variant == "inline" ? Delivery::inline_io : Delivery::scheduled);
    t0 = Clock::now();
    gw.send("echo", msg);
    auto f = done.get_future();
    if (f.wait_for(std::chrono::seconds(120)) != std::future_status::ready)
      std::fprintf(stderr, "hop: timed out after %d round trips\n", n);
    gw.unsubscribe(actor);
    caf::anon_send_exit(actor, caf::exit_reason::user_shutdown);
  }
  stop_child(child);
  if (transport == "ipc")
    for (auto& ep : {own, peer}) {
      ::unlink(ep.substr(6).c_str());
      ::unlink((ep.substr(6) + ".ctl").c_str());
    }
  return rt;
}

double pct(std::vector<double> v, double p) {
  if (v.empty()) return 0;
  std::sort(v.begin(), v.end());
  return v[std::min(v.size() - 1, std::size_t(p * double(v.size())))];
}

std::string size_name(std::size_t s) {
  if (s >= (1 << 20) && s % (1 << 20) == 0) return std::to_string(s >> 20) + " MiB";
  if (s >= 1024 && s % 1024 == 0) return std::to_string(s >> 10) + " KiB";
  return std::to_string(s) + " B";
}

}  // namespace

int main(int argc, char** argv) {
  std::vector<std::string> args(argv + 1, argv + argc);
  if (args.size() == 2 && args[0] == "--raw-echo") return run_raw_echo(args[1]);
  if (args.size() == 5 && args[0] == "--gw-echo") return run_gateway_echo(args[1], args[2], args[3], args[4]);

  spdlog::set_level(spdlog::level::warn);
  Options opt;
  for (std::size_t i = 0; i + 1 < args.size(); i += 2) {
    if (args[i] == "--rounds") opt.rounds = std::stoi(args[i + 1]);
    else if (args[i] == "--iters") opt.iters = std::stoi(args[i + 1]);
    else if (args[i] == "--scheduler") opt.scheduler = args[i + 1];
    else if (args[i] == "--variants") opt.variants = split(args[i + 1]);
    else if (args[i] == "--transports") opt.transports = split(args[i + 1]);
    else if (args[i] == "--sizes") {
      opt.sizes.clear();
      for (auto& s : split(args[i + 1])) opt.sizes.push_back(std::stoul(s));
    } else {
      std::fprintf(stderr, "unknown option %s\n", args[i].c_str());
      return 2;
    }
  }

  caf::actor_system_config cfg;
  configure(cfg, opt.scheduler);
  caf::actor_system sys{cfg};

  double load[3] = {0, 0, 0};
  getloadavg(load, 3);
  std::printf("bench_hop: round-trip (= 2 hops) latency in us; scheduler=%s, rounds=%d, load avg %.2f\n",
              opt.scheduler.c_str(), opt.rounds, load[0]);
  std::printf("%-9s %-7s %9s %9s", "transport", "size", "raw p50", "raw p99");
  for (auto& v : opt.variants) {
    std::printf(" %9s %9s %7s", (v + " p50").c_str(), (v + " p99").c_str(), "ratio");
  }
  std::printf("\n");
  for (auto& transport : opt.transports) {
    for (auto size : opt.sizes) {
      int iters = opt.iters > 0 ? opt.iters : (size >= (1 << 20) ? 300 : 2000);
      int warmup = std::max(50, iters / 10);
      std::vector<double> raw;
      std::vector<std::vector<double>> hop(opt.variants.size());
      for (int r = 0; r < opt.rounds; ++r) {
        auto a = run_raw(transport, size, warmup, iters);
        raw.insert(raw.end(), a.begin(), a.end());
        for (std::size_t v = 0; v < opt.variants.size(); ++v) {
          auto b = run_hop(sys, opt.scheduler, opt.variants[v], transport, size, warmup, iters);
          hop[v].insert(hop[v].end(), b.begin(), b.end());
        }
      }
      double r50 = pct(raw, 0.5);
      std::printf("%-9s %-7s %9.1f %9.1f", transport.c_str(), size_name(size).c_str(), r50, pct(raw, 0.99));
      for (auto& h : hop) {
        double h50 = pct(h, 0.5);
        std::printf(" %9.1f %9.1f %6.2fx", h50, pct(h, 0.99), r50 > 0 ? h50 / r50 : 0.0);
      }
      std::printf("\n");
      std::fflush(stdout);
    }
  }
  return 0;
}

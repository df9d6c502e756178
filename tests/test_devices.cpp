// Emulated hardware: device profiles stretch jobs to the modelled time, forward costs follow
// the batch and the layer range, and shaped links delay messages by latency + bytes/bandwidth.
#include <gtest/gtest.h>

#include <caf/actor_system.hpp>
#include <caf/actor_system_config.hpp>
#include <caf/event_based_actor.hpp>
#include <caf/send.hpp>

#include <atomic>
#include <chrono>
#include <condition_variable>
#include <future>
#include <map>
#include <mutex>
#include <thread>
#include <unistd.h>

#include "specmesh/transport/gateway.hpp"
#include "specmesh/transport/router.hpp"
#include "specmesh/devices/device.hpp"
#include "specmesh/model/context.hpp"
#include "actor_harness.hpp"
#include "refdata.hpp"

using namespace specmesh;
using specmesh::test::refdata;
using specmesh::test::System;
using namespace std::chrono_literals;
using Clock = std::chrono::steady_clock;

namespace {

double seconds_since(Clock::time_point t0) { return std::chrono::duration<double>(Clock::now() - t0).count(); }

// Upper-bound slack for a shared, loaded 2-core machine; lower bounds are exact.
constexpr double kSlack = 0.5;

}  // namespace

TEST(Device, ProfileStretchesAJobToTheModelledDuration) {
  // layer_s: 40 ms per layer at batch 1, so 3 layers take 120 ms whatever the CPU does.
  DeviceProfile table{"table", 0, 0, 0, 0.040, 0.0};
  Device d("emu", 1, table);
  WorkCost cost;
  cost.layers = 3;
  cost.tokens = 1;
  ASSERT_DOUBLE_EQ(table.seconds(cost), 0.120);
  auto t0 = Clock::now();
  d.execute([&](ThreadPool&) { return cost; });
  const double took = seconds_since(t0);
  EXPECT_GE(took, 0.120);
  EXPECT_LT(took, 0.120 + kSlack);
  EXPECT_GT(d.modelled_ns.load(), 100'000'000u);
  EXPECT_EQ(d.jobs.load(), 1u);

  // Roofline rates: 2e8 flops at 1 GFLOP/s is 200 ms, more than the 50 ms the bytes need.
  DeviceProfile rates{"rates", 1e9, 1e9, 0, 0, 0};
  Device r("rates", 1, rates);
  WorkCost heavy;
  heavy.flops = 2e8;
  heavy.bytes = 5e7;
  t0 = Clock::now();
  r.execute([&](ThreadPool&) { return heavy; });
  EXPECT_GE(seconds_since(t0), 0.200);
}

TEST(Device, RealComputeCountsTowardsTheModelledDuration) {
  // A job that already takes longer than modelled is not stretched further.
  Device d("emu", 1, DeviceProfile{"p", 0, 0, 0, 0.010, 0});
  WorkCost one;
  one.layers = 1;
  auto t0 = Clock::now();
  d.execute([&](ThreadPool&) {
    std::this_thread::sleep_for(60ms);
    return one;
  });
  const double took = seconds_since(t0);
  EXPECT_GE(took, 0.060);
  EXPECT_LT(took, 0.060 + kSlack);
  EXPECT_EQ(d.modelled_ns.load(), 0u);
}

TEST(Device, WithoutAProfileNothingIsAdded) {
  Device d("cpu", 1, std::nullopt);
  WorkCost huge;
  huge.flops = 1e18;
  huge.bytes = 1e18;
  huge.layers = 1000;
  huge.ops = 1000000;
  auto t0 = Clock::now();
  d.execute([&](ThreadPool&) { return huge; });
  EXPECT_LT(seconds_since(t0), 0.1);
  EXPECT_EQ(d.modelled_ns.load(), 0u);
  EXPECT_EQ(d.jobs.load(), 1u);
}

TEST(Device, ActorRunsJobsOneAtATime) {
  System s;
  auto dev = std::make_shared<Device>("emu", 1, DeviceProfile{"p", 0, 0, 0, 0.050, 0});
  caf::actor a = spawn_device_actor(*s.sys, dev);
  std::promise<void> all_done;
  const auto t0 = Clock::now();
  for (int i = 0; i < 3; ++i) {
    auto job = std::make_shared<DeviceJob>();
    job->run = [](ThreadPool&) {
      WorkCost c;
      c.layers = 1;
      return c;
    };
    caf::anon_send(a, compute_atom::value, job);
  }
  // Jobs run in arrival order, so this zero-cost one marks the end of the three above.
  auto last = std::make_shared<DeviceJob>();
  last->run = [&](ThreadPool&) {
    all_done.set_value();
    return WorkCost{};
  };
  caf::anon_send(a, compute_atom::value, last);
  ASSERT_EQ(all_done.get_future().wait_for(5s), std::future_status::ready);
  const double took = seconds_since(t0);
  EXPECT_GE(took, 0.150);  // 3 x 50 ms, serialised
  EXPECT_LT(took, 0.150 + kSlack);
  caf::anon_send_exit(a, caf::exit_reason::user_shutdown);
}

namespace {

// A context over layers [begin, end) of stories260K; end < n_layer leaves out the classifier.
std::unique_ptr<Context> layer_context(const Model& m, int begin, int end) {
  ContextParams p;
  p.n_ctx = 64;
  p.layer_begin = begin;
  p.layer_end = end;
  return std::make_unique<Context>(m, p);
}

Batch tokens(int n, int pos0 = 0, bool logits_last = false) {
  Batch b;
  for (int i = 0; i < n; ++i) b.add(1 + i, pos0 + i, seq_bit(0), logits_last && i + 1 == n);
  return b;
}

}  // namespace

TEST(WorkCostOfForward, ScalesWithTokensAndLayers) {
  SPECMESH_REQUIRE_REFDATA();
  auto m = Model::load(refdata("gguf-models/stories260K.gguf"));
  ASSERT_EQ(m->hparams().n_layer, 5);

  auto one_layer = layer_context(*m, 1, 2);
  auto two_layers = layer_context(*m, 1, 3);
  const WorkCost c1 = one_layer->cost(tokens(1));
  const WorkCost c2 = two_layers->cost(tokens(1));
  EXPECT_EQ(c1.layers, 1);
  EXPECT_EQ(c2.layers, 2);
  EXPECT_EQ(c1.tokens, 1);
  EXPECT_GT(c1.flops, 0);
  EXPECT_GT(c1.bytes, 0);
  // stories260K's layers all have the same shape.
  EXPECT_DOUBLE_EQ(c2.flops, 2 * c1.flops);
  EXPECT_DOUBLE_EQ(c2.bytes, 2 * c1.bytes);
  EXPECT_EQ(c2.ops, 2 * c1.ops);

  // Matmul work grows with the batch (plus attention over the batch itself); the weights
  // are read once per pass, so bytes barely move.
  const WorkCost c8 = one_layer->cost(tokens(8));
  EXPECT_EQ(c8.tokens, 8);
  EXPECT_GE(c8.flops, 8 * c1.flops);
  EXPECT_LT(c8.flops, 9 * c1.flops);
  EXPECT_GE(c8.bytes, c1.bytes);
  EXPECT_LT(c8.bytes, 1.1 * c1.bytes);

  // Cached context makes attention more expensive for the next token.
  const std::vector<float> hidden(16 * m->hparams().n_embd, 0.1f);  // input from the stage before
  one_layer->forward(tokens(16), hidden.data());
  const WorkCost after = one_layer->cost(tokens(1, 16));
  EXPECT_GT(after.flops, c1.flops);
  EXPECT_GT(after.bytes, c1.bytes);

  // Layer ranges of a pipeline add up to the whole model, whose last stage pays the classifier.
  auto whole = layer_context(*m, 0, 5);
  auto front = layer_context(*m, 0, 2);
  auto back = layer_context(*m, 2, 5);
  const Batch b = tokens(4, 0, true);
  const WorkCost w = whole->cost(b), f = front->cost(b), k = back->cost(b);
  EXPECT_EQ(f.layers + k.layers, w.layers);
  EXPECT_DOUBLE_EQ(f.flops + k.flops, w.flops);
  EXPECT_DOUBLE_EQ(f.bytes + k.bytes, w.bytes);
  Batch no_logits = tokens(4);
  EXPECT_GT(whole->cost(b).flops, whole->cost(no_logits).flops);

  // What a device model makes of it: more layers or tokens, more modelled time.
  const DeviceProfile slow = *device_profile("slow-node");
  EXPECT_GT(slow.seconds(c2), slow.seconds(c1));
  EXPECT_GT(slow.seconds(c8), slow.seconds(c1));
}

namespace {

// Arrival times of envelopes delivered by a gateway, by run id.
struct Arrivals {
  std::mutex mu;
  std::condition_variable cv;
  std::map<uint64_t, Clock::time_point> at;

  bool wait_for(size_t n, std::chrono::milliseconds timeout) {
    std::unique_lock<std::mutex> lk(mu);
    return cv.wait_for(lk, timeout, [&] { return at.size() >= n; });
  }
};

struct Pair {
  System s;
  std::unique_ptr<Gateway> a, b;
  std::shared_ptr<Arrivals> arrivals = std::make_shared<Arrivals>();
  caf::actor sink;

  Pair() {
    static std::atomic<int> n{0};
    const std::string tag = std::to_string(::getpid()) + "-" + std::to_string(n++);
    GatewayConfig ca, cb;
    ca.node = "a";
    ca.bind = "inproc://devtest-a-" + tag;
    cb.node = "b";
    cb.bind = "inproc://devtest-b-" + tag;
    ca.peers = {{"b", cb.bind}};
    cb.peers = {{"a", ca.bind}};
    ca.linger = cb.linger = 0ms;
    a = std::make_unique<Gateway>(ca);
    b = std::make_unique<Gateway>(cb);
    sink = s.sys->spawn([arr = arrivals](caf::event_based_actor*) -> caf::behavior {
      return {[arr](const std::string&, const Envelope& env) {
        std::lock_guard<std::mutex> lk(arr->mu);
        arr->at.emplace(env.run_id, Clock::now());
        arr->cv.notify_all();
      }};
    });
    b->subscribe(MsgType::logits, sink);
    b->subscribe(MsgType::cancel, sink);
    const auto deadline = Clock::now() + 5s;
    while (!(a->peer_alive("b") && b->peer_alive("a")) && Clock::now() < deadline) std::this_thread::sleep_for(5ms);
  }
  ~Pair() {
    b->unsubscribe(sink);
    caf::anon_send_exit(sink, caf::exit_reason::user_shutdown);
    a.reset();
    b.reset();
  }
};

// Logits of `bytes` bytes (f32), the kind of payload that crosses the last hop.
Envelope logits_of(uint64_t run, size_t bytes) {
  Logits l;
  l.pipeline = "t";
  l.rows = {0};
  l.logits = Tensor::from(WireDType::f32, {int64_t(bytes / 4)}, std::vector<float>(bytes / 4, 0.5f));
  return make_envelope(run, std::move(l));
}

}  // namespace

TEST(LinkShaping, DelaysByLatencyPlusBytesOverBandwidth) {
  Pair p;
  ASSERT_TRUE(p.a->peer_alive("b") && p.b->peer_alive("a")) << "inproc gateways did not connect";
  // 40 ms latency, 10 MB/s: 500 kB take 50 ms to serialise.
  const LinkProfile link{0.040, 10e6};
  Router r("a", p.a.get(), link);
  const Envelope big = logits_of(1, 500'000);
  const double tx = double(wire_bytes(big)) / link.bytes_per_s;
  ASSERT_NEAR(tx, 0.050, 0.001);

  // Two messages back to back share the link: the second waits for the first to be sent.
  const auto t0 = Clock::now();
  ASSERT_TRUE(r.send("b", big));
  ASSERT_TRUE(r.send("b", logits_of(2, 500'000)));
  // A control message has its own connection: it pays the latency only.
  ASSERT_TRUE(r.send("b", make_envelope(3, Cancel{{1}})));
  ASSERT_TRUE(p.arrivals->wait_for(3, 5s));
  auto after = [&](uint64_t run) { return std::chrono::duration<double>(p.arrivals->at.at(run) - t0).count(); };
  EXPECT_GE(after(1), link.latency_s + tx);
  EXPECT_LT(after(1), link.latency_s + tx + kSlack);
  EXPECT_GE(after(2), link.latency_s + 2 * tx);
  EXPECT_LT(after(2), link.latency_s + 2 * tx + kSlack);
  EXPECT_GE(after(3), link.latency_s);
  EXPECT_LT(after(3), after(1)) << "the cancel waited behind the data";
  r.close();
}

TEST(LinkShaping, UnshapedLinkAndLocalDeliveryAddNothing) {
  Pair p;
  ASSERT_TRUE(p.a->peer_alive("b") && p.b->peer_alive("a")) << "inproc gateways did not connect";
  Router plain("a", p.a.get(), LinkProfile{});
  auto t0 = Clock::now();
  ASSERT_TRUE(plain.send("b", logits_of(1, 500'000)));
  ASSERT_TRUE(p.arrivals->wait_for(1, 5s));
  // Far below what the shaped link above needs for the same message (90 ms).
  EXPECT_LT(std::chrono::duration<double>(p.arrivals->at.at(1) - t0).count(), 0.090);
  plain.close();

  // A node's messages to itself never cross a link, shaped or not.
  Router shaped("b", p.b.get(), LinkProfile{0.200, 1e3});
  shaped.set_local(p.sink);
  t0 = Clock::now();
  ASSERT_TRUE(shaped.send("b", logits_of(2, 4'000)));
  ASSERT_TRUE(p.arrivals->wait_for(2, 5s));
  EXPECT_LT(std::chrono::duration<double>(p.arrivals->at.at(2) - t0).count(), 0.150);
  shaped.close();
}

// Hidden-state taps: a stage configured with tap layers sends, for every tapped layer it
// computes, one HiddenStates message equal bit for bit to what a Context capturing the same
// layers produces, ahead of the run's logits, to an actor subscribed on a real gateway; over
// inproc and ipc, with one stage or two, and never for a cancelled run.
#include <gtest/gtest.h>

#include <caf/send.hpp>

#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "actor_harness.hpp"
#include "synthetic_model.hpp"
#include "specmesh/actors/stage.hpp"
#include "specmesh/devices/device.hpp"
#include "specmesh/kernels/ggml_types.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/synthetic.hpp"
#include "specmesh/transport/router.hpp"

namespace specmesh {
namespace {

using namespace std::chrono_literals;
using namespace test;

constexpr int kCtx = 64;
const std::string kPipeline = "target";

// A random-weight qwen3 (4 layers, n_embd 256, q/k norms), written once per test program.
std::shared_ptr<const Model> model() { return test::synthetic_model("tiny-qwen3", 11); }

// The runs every test sends, in order: a prompt with logits for its last token only (taps
// still carry every row), then one more token, which reads the KV cache the first one wrote.
std::vector<Batch> runs() {
  Batch prompt;
  const int32_t tokens[] = {1, 17, 42, 99, 7};
  for (int i = 0; i < 5; ++i) prompt.add(tokens[i], i, seq_bit(0), i == 4);
  Batch next;
  next.add(300, 5, seq_bit(0), true);
  return {prompt, next};
}

// What a single Context capturing `layers` produces for runs().
std::vector<ForwardOutput> reference(const std::vector<int>& layers) {
  ContextParams p;
  p.n_ctx = kCtx;
  p.capture_layers = layers;
  Context ctx(*model(), p);
  std::vector<ForwardOutput> out;
  for (const Batch& b : runs()) out.push_back(ctx.forward(b));
  return out;
}

// Node name -> data endpoint, all on one transport.
using Endpoints = std::map<std::string, std::string>;

Endpoints endpoints(const std::string& transport, std::initializer_list<const char*> nodes) {
  Endpoints e;
  for (const char* n : nodes) e[n] = endpoint_for(transport);
  return e;
}

GatewayConfig gateway_config(const std::string& node, const Endpoints& eps) {
  return mesh_gateway(node, eps, 1s);  // the sink takes errors: no false peer_down on a loaded machine
}

struct Taps {
  std::vector<int> layers;
  WireDType dtype = WireDType::f32;
};

// One node hosting one stage, wired as a node host wires it except that the stage is
// subscribed on the gateway directly (the node's dispatcher only forwards). Taps, logits and
// errors go to the "sink" node.
struct StageNode {
  std::unique_ptr<Gateway> gw;
  std::shared_ptr<Router> router;
  std::shared_ptr<Device> device;
  std::shared_ptr<StageStats> stats = std::make_shared<StageStats>();
  caf::actor device_actor, stage;

  StageNode(caf::actor_system& sys, const std::string& node, const Endpoints& eps, int layer_begin, int layer_end,
            const std::string& next_node, const Taps& taps, std::optional<DeviceProfile> profile = std::nullopt) {
    gw = std::make_unique<Gateway>(gateway_config(node, eps));
    router = std::make_shared<Router>(node, gw.get(), LinkProfile{});
    device = std::make_shared<Device>("cpu", 1, std::move(profile));
    device_actor = spawn_device_actor(sys, device);
    StageConfig sc;
    sc.pipeline = kPipeline;
    sc.self_node = node;
    sc.next_node = next_node;
    sc.head_node = "sink";
    sc.model = model();
    sc.context.n_ctx = kCtx;
    sc.context.layer_begin = layer_begin;
    sc.context.layer_end = layer_end;
    sc.tap_layers = taps.layers;
    sc.tap_node = "sink";
    sc.tap_dtype = taps.dtype;
    sc.device = device_actor;
    sc.device_state = device;
    sc.router = router;
    stage = spawn_stage(sys, sc, stats);
    for (MsgType t : {MsgType::run_start, MsgType::activations, MsgType::kv_cache_op, MsgType::cancel})
      gw->subscribe(t, stage);
  }
  ~StageNode() {
    gw->unsubscribe(stage);
    caf::anon_send_exit(stage, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(device_actor, caf::exit_reason::user_shutdown);
    router->close();
    gw.reset();
  }
};

// The receiving end: a test actor subscribed on the sink node's gateway to what a head gets.
struct Sink {
  Gateway gw;
  Inbox inbox;
  Sink(caf::actor_system& sys, const Endpoints& eps) : gw(gateway_config("sink", eps)), inbox(sys) {
    for (MsgType t : {MsgType::hidden_states, MsgType::logits, MsgType::error}) gw.subscribe(t, inbox.handle());
  }
  ~Sink() { gw.unsubscribe(inbox.handle()); }

  void start(uint64_t run, const Batch& b) { ASSERT_TRUE(gw.send("s0", make_envelope(run, to_run_start(kPipeline, b, false)))); }

  // Everything received for `run` until both its logits and `n_taps` hidden states are in, in
  // arrival order; fails the test on anything else or on a timeout.
  std::vector<Envelope> collect(uint64_t run, size_t n_taps) {
    std::vector<Envelope> got;
    bool logits = false;
    size_t taps = 0;
    while (!logits || taps < n_taps) {
      auto m = inbox.next();
      if (!m) {
        ADD_FAILURE() << "run " << run << ": timed out with " << taps << " of " << n_taps << " taps, logits "
                      << (logits ? "in" : "missing");
        break;
      }
      const Envelope& e = m->second;
      EXPECT_EQ(e.run_id, run) << to_string(e.type()) << " from " << m->first;
      if (const auto* err = std::get_if<Error>(&e.payload)) ADD_FAILURE() << "error from " << err->peer << ": " << err->message;
      logits = logits || std::holds_alternative<Logits>(e.payload);
      taps += std::holds_alternative<HiddenStates>(e.payload);
      got.push_back(e);
    }
    return got;
  }
};

// Checks one run's messages against the reference pass that captured `layers`: one
// HiddenStates per layer in `layers`, bit for bit, and the logits. With `taps_first`, every
// tap must have arrived before the logits (taps and logits shared a link).
void expect_matches(const std::vector<Envelope>& got, const Batch& b, const ForwardOutput& ref,
                    const std::vector<int>& layers, WireDType dtype, bool taps_first) {
  const HParams& hp = model()->hparams();
  const int64_t n = int64_t(b.size());
  size_t logits_at = got.size();
  for (size_t i = 0; i < got.size(); ++i)
    if (const auto* l = std::get_if<Logits>(&got[i].payload)) {
      logits_at = i;
      EXPECT_EQ(l->rows, ref.rows);
      EXPECT_EQ(l->logits, Tensor::from(WireDType::f32, {int64_t(ref.rows.size()), hp.n_vocab}, ref.logits));
    }
  ASSERT_LT(logits_at, got.size()) << "no logits";
  ASSERT_EQ(got.size(), layers.size() + 1) << "one message per tapped layer plus the logits";
  std::vector<int32_t> all_rows(b.size());
  for (size_t r = 0; r < all_rows.size(); ++r) all_rows[r] = int32_t(r);
  for (size_t k = 0; k < layers.size(); ++k) {
    SCOPED_TRACE("layer " + std::to_string(layers[k]));
    size_t found = got.size();
    for (size_t i = 0; i < got.size(); ++i)
      if (const auto* h = std::get_if<HiddenStates>(&got[i].payload); h && h->layer == layers[k]) found = i;
    ASSERT_LT(found, got.size()) << "tap missing";
    if (taps_first) EXPECT_LT(found, logits_at) << "tap arrived after the logits";
    const auto& h = std::get<HiddenStates>(got[found].payload);
    EXPECT_EQ(h.pipeline, kPipeline);
    EXPECT_EQ(h.rows, all_rows);
    EXPECT_EQ(h.positions, b.pos);
    const std::vector<float>& want = ref.captured.at(k);
    if (dtype == WireDType::f16) {
      std::vector<uint16_t> half(want.size());
      for (size_t i = 0; i < want.size(); ++i) half[i] = fp32_to_fp16(want[i]);
      EXPECT_EQ(h.states, Tensor::from(WireDType::f16, {n, hp.n_embd}, half));
    } else {
      EXPECT_EQ(h.states, Tensor::from(WireDType::f32, {n, hp.n_embd}, want)) << "not bit for bit";
    }
  }
}

// Sends runs() through the pipeline and checks every run against the reference.
void expect_pipeline_taps(Sink& sink, const std::vector<int>& layers, WireDType dtype, bool taps_first) {
  const auto ref = reference(layers);
  const auto batches = runs();
  for (size_t i = 0; i < batches.size(); ++i) {
    SCOPED_TRACE("run " + std::to_string(i + 1));
    sink.start(i + 1, batches[i]);
    expect_matches(sink.collect(i + 1, layers.size()), batches[i], ref[i], layers, dtype, taps_first);
  }
}

// A two-stage pipeline, layers [0, 2) on s0 and [2, 4) on s1; both stages get the same taps.
void expect_two_stage_taps(const std::string& transport, const std::vector<int>& layers, bool taps_first) {
  System s;
  const auto eps = endpoints(transport, {"sink", "s0", "s1"});
  Sink sink(*s.sys, eps);
  StageNode s0(*s.sys, "s0", eps, 0, 2, "s1", {layers});
  StageNode s1(*s.sys, "s1", eps, 2, 4, "sink", {layers});
  expect_pipeline_taps(sink, layers, WireDType::f32, taps_first);
}

class HiddenStatesOver : public ::testing::TestWithParam<std::string> {};

TEST_P(HiddenStatesOver, OneStageSendsEveryTappedLayerBeforeTheLogits) {
  System s;
  const auto eps = endpoints(GetParam(), {"sink", "s0"});
  Sink sink(*s.sys, eps);
  StageNode s0(*s.sys, "s0", eps, 0, -1, "sink", {{3, 0, 1, 3}});  // any order, duplicates once
  expect_pipeline_taps(sink, {0, 1, 3}, WireDType::f32, true);
  EXPECT_EQ(s0.stats->runs.load(), 2u);
}

TEST_P(HiddenStatesOver, TappedLayerOnTheSecondStage) {
  // Layer 3 is computed from the hidden state the first stage handed over; taps and logits
  // both leave the second stage, so the taps come first.
  expect_two_stage_taps(GetParam(), {3}, true);
  // The second stage's first layer too.
  expect_two_stage_taps(GetParam(), {2, 3}, true);
}

TEST_P(HiddenStatesOver, EachStageSendsTheTapsItComputes) {
  // Layer 1 leaves the first stage on its own link: it precedes the logits causally (it is
  // sent before the activations), but no link orders it against them, so order is not checked.
  expect_two_stage_taps(GetParam(), {1, 3}, false);
}

INSTANTIATE_TEST_SUITE_P(Transports, HiddenStatesOver, ::testing::Values("inproc", "ipc"));

TEST(HiddenStates, F16TapsAreTheRoundedStates) {
  System s;
  const auto eps = endpoints("inproc", {"sink", "s0"});
  Sink sink(*s.sys, eps);
  StageNode s0(*s.sys, "s0", eps, 0, -1, "sink", {{2}, WireDType::f16});
  expect_pipeline_taps(sink, {2}, WireDType::f16, true);
}

TEST(HiddenStates, WithoutTapsOnlyTheLogitsAreSent) {
  System s;
  const auto eps = endpoints("inproc", {"sink", "s0"});
  Sink sink(*s.sys, eps);
  StageNode s0(*s.sys, "s0", eps, 0, -1, "sink", {});
  expect_pipeline_taps(sink, {}, WireDType::f32, true);
  EXPECT_FALSE(sink.inbox.next(100ms)) << "nothing may follow the last run's logits";
}

TEST(HiddenStates, CancelledRunsSendNothing) {
  System s;
  const auto eps = endpoints("inproc", {"sink", "s0"});
  Sink sink(*s.sys, eps);
  // 150 ms per layer: the pass sleeps out its modelled time before each layer after the first,
  // where it also checks for cancels.
  DeviceProfile slow{"slow", 0, 0, 0, 0.150, 0};
  StageNode s0(*s.sys, "s0", eps, 0, -1, "sink", {{0, 3}}, slow);
  const auto batches = runs();
  auto send = [&](uint64_t run, Payload p) { caf::anon_send(s0.stage, std::string("sink"), make_envelope(run, std::move(p))); };

  // Cancelled before it starts: the stage's mailbox holds the cancel first.
  send(0, Cancel{{1}});
  send(1, to_run_start(kPipeline, batches[0], false));
  // Cancelled between layers once the tapped layer 0 is computed: the first pacing sleep
  // (before layer 1) is the sign.
  send(2, to_run_start(kPipeline, batches[0], false));
  ASSERT_TRUE(wait_until([&] { return s0.device->modelled_ns.load() > 0; }));
  send(0, Cancel{{2}});
  ASSERT_TRUE(wait_until([&] { return s0.stats->runs_cancelled.load() == 2; }));
  EXPECT_GE(s0.stats->layers_computed.load(), 1u);
  EXPECT_LT(s0.stats->layers_computed.load(), 4u) << "run 2 finished before its cancel landed";
  EXPECT_EQ(s0.stats->runs.load(), 0u);
  EXPECT_FALSE(sink.inbox.next(200ms)) << "a cancelled run sent something";
}

TEST(HiddenStates, ImpossibleTapsAreRejected) {
  System s;
  // Rejected before anything is spawned, so the config needs nothing else.
  auto spawn = [&](std::vector<int> layers, std::string node, WireDType dtype) {
    StageConfig sc;
    sc.model = model();
    sc.tap_layers = std::move(layers);
    sc.tap_node = std::move(node);
    sc.tap_dtype = dtype;
    spawn_stage(*s.sys, sc, std::make_shared<StageStats>());
  };
  EXPECT_THROW(spawn({4}, "sink", WireDType::f32), std::invalid_argument) << "the model has 4 layers";
  EXPECT_THROW(spawn({-1}, "sink", WireDType::f32), std::invalid_argument);
  EXPECT_THROW(spawn({1}, "", WireDType::f32), std::invalid_argument) << "taps need somewhere to go";
  EXPECT_THROW(spawn({1}, "sink", WireDType::bf16), std::invalid_argument);
}

}  // namespace
}  // namespace specmesh

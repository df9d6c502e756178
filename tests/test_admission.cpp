// What a stage takes on and what it refuses on arrival (actors/admission.hpp): the per-peer
// cap on runs in flight, runs that can never be computed, cache operations on sequences the
// cache lacks; and a stage actor that refuses beyond its cap at once, with an Error each,
// while another peer's runs and later runs of the same peer go through. Also the gateway's
// cap on messages parked for a peer that does not read.
#include <gtest/gtest.h>

#include <caf/send.hpp>

#include <algorithm>
#include <filesystem>
#include <map>
#include <memory>
#include <string>
#include <thread>
#include <vector>

#include "actor_harness.hpp"
#include "synthetic_model.hpp"
#include "specmesh/actors/admission.hpp"
#include "specmesh/actors/stage.hpp"
#include "specmesh/devices/device.hpp"
#include "specmesh/model/synthetic.hpp"
#include "specmesh/transport/router.hpp"

namespace specmesh {
namespace {

using namespace std::chrono_literals;
using namespace test;

TEST(RunAdmission, CapsRunsInFlightPerSender) {
  RunAdmission a(3);
  std::vector<RunAdmission::PlacePtr> head;
  for (int i = 0; i < 3; ++i) head.push_back(a.admit("head"));
  for (const auto& p : head) EXPECT_TRUE(p);
  EXPECT_FALSE(a.admit("head")) << "a fourth run from one sender";
  auto other = a.admit("stage1");
  EXPECT_TRUE(other) << "another sender has places of its own";
  EXPECT_EQ(a.in_flight("head"), 3);
  EXPECT_EQ(a.in_flight(), 4);
  head.pop_back();  // a job done: its place comes back
  EXPECT_EQ(a.in_flight("head"), 2);
  EXPECT_TRUE(a.admit("head"));  // taken and at once given back (a temporary)
  EXPECT_EQ(a.in_flight("head"), 2);
}

TEST(RunAdmission, PlacesOutliveTheAdmission) {
  RunAdmission::PlacePtr p;
  {
    RunAdmission a(1);
    p = a.admit("head");
    ASSERT_TRUE(p);
  }
  p.reset();  // the stage is gone before its last job: nothing dangles
}

TEST(RunAdmission, RefusesACapBelowOne) {
  EXPECT_THROW(RunAdmission(0), std::invalid_argument);
  EXPECT_EQ(RunAdmission().max_per_sender(), kDefaultMaxRunsPerSender);
}

RunStart decode_run(int32_t pos) {
  RunStart r;
  r.pipeline = "target";
  r.tokens = {5};
  r.positions = {pos};
  r.seq_masks = {1};
  r.logits = {1};
  return r;
}

TEST(RunProblem, RefusesRunsThatCanNeverBeComputed) {
  EXPECT_EQ(run_problem(decode_run(3), 16), "");
  RunStart r = decode_run(3);
  r.positions.push_back(4);
  EXPECT_EQ(run_problem(r, 16), "run batch fields have different lengths");
  EXPECT_EQ(run_problem(RunStart{}, 16), "run without tokens");
  r = decode_run(3);
  r.tokens.assign(17, 5);
  r.positions.assign(17, 3);
  r.seq_masks.assign(17, 1);
  r.logits.clear();
  EXPECT_EQ(run_problem(r, 16), "run of 17 tokens is larger than the KV cache (16 cells)");
  r = decode_run(3);
  r.seq_masks = {0};
  EXPECT_EQ(run_problem(r, 16), "token 0 of the run is in no sequence");
  EXPECT_EQ(run_problem(decode_run(-1), 16), "token 0 of the run has a negative position");
  r = decode_run(3);
  r.seq_masks = {~uint64_t(0)};  // all 64 sequences: every bit names one the cache has
  EXPECT_EQ(run_problem(r, 16), "");
}

TEST(KvOpsProblem, OnlySequencesTheCacheHas) {
  EXPECT_EQ(kv_ops_problem({{KvOpKind::remove, -1, -1, -1, -1}}), "") << "remove from every sequence";
  EXPECT_EQ(kv_ops_problem({{KvOpKind::copy, 0, 63, 0, -1}, {KvOpKind::keep, 5, -1, -1, -1}}), "");
  EXPECT_NE(kv_ops_problem({{KvOpKind::copy, 0, 64, 0, -1}}), "");
  EXPECT_NE(kv_ops_problem({{KvOpKind::copy, -1, 3, 0, -1}}), "") << "copy from 'every sequence'";
  EXPECT_NE(kv_ops_problem({{KvOpKind::keep, -1, -1, -1, -1}}), "");
  EXPECT_EQ(kv_ops_problem({{KvOpKind::shift, 2, 4, 10, -1, -4}}), "") << "a shift of sequences 2..4";
  EXPECT_NE(kv_ops_problem({{KvOpKind::shift, 4, 2, 10, -1, -4}}), "") << "a range that ends before it starts";
  EXPECT_NE(kv_ops_problem({{KvOpKind::shift, 2, 64, 10, -1, -4}}), "");
  EXPECT_NE(kv_ops_problem({{KvOpKind::remove, 64, -1, -1, -1}}), "");
  EXPECT_EQ(kv_ops_problem({{KvOpKind::remove, 0, -1, -1, -1}, {KvOpKind::copy, 2, 70, 0, -1}}),
            "sequence id 70 out of range (the KV cache has 64 sequences, 0..63)");
}

std::shared_ptr<const Model> model() { return test::synthetic_model("tiny-qwen3", 5); }

GatewayConfig gateway_config(const std::string& node, const std::map<std::string, std::string>& eps) {
  return mesh_gateway(node, eps, 2s);
}

// A stage node "s0" whose device takes 100 ms per run (4 layers of 25 ms), a head that receives its logits and
// errors, and a second peer "other" that sends runs too.
struct SlowStage {
  std::map<std::string, std::string> eps{{"s0", ipc_ep()}, {"head", ipc_ep()}, {"other", ipc_ep()}};
  Gateway gw{gateway_config("s0", eps)};
  Gateway head{gateway_config("head", eps)};
  Gateway other{gateway_config("other", eps)};
  std::shared_ptr<Router> router = std::make_shared<Router>("s0", &gw, LinkProfile{});
  std::shared_ptr<Device> device = std::make_shared<Device>("cpu", 1, DeviceProfile{"slow", 0, 0, 0, 0.025, 0});
  std::shared_ptr<StageStats> stats = std::make_shared<StageStats>();
  caf::actor device_actor, stage;
  Inbox inbox;

  SlowStage(caf::actor_system& sys, int cap) : inbox(sys) {
    device_actor = spawn_device_actor(sys, device);
    StageConfig sc;
    sc.pipeline = "target";
    sc.self_node = "s0";
    sc.next_node = "head";
    sc.head_node = "head";
    sc.model = model();
    sc.context.n_ctx = 64;
    sc.max_runs_per_sender = cap;
    sc.device = device_actor;
    sc.device_state = device;
    sc.router = router;
    stage = spawn_stage(sys, sc, stats);
    for (MsgType t : {MsgType::run_start, MsgType::kv_cache_op, MsgType::cancel}) gw.subscribe(t, stage);
    for (MsgType t : {MsgType::logits, MsgType::error}) head.subscribe(t, inbox.handle());
  }
  ~SlowStage() {
    head.unsubscribe(inbox.handle());
    gw.unsubscribe(stage);
    caf::anon_send_exit(stage, caf::exit_reason::user_shutdown);
    caf::anon_send_exit(device_actor, caf::exit_reason::user_shutdown);
    router->close();
  }
};

TEST(StageAdmission, RefusesRunsBeyondThePeersCapAtOnceAndServesOn) {
  System s;
  SlowStage st(*s.sys, 3);
  ASSERT_TRUE(wait_until([&] { return st.head.peer_alive("s0") && st.other.peer_alive("s0"); }));
  // Eight runs from the head (each takes 100 ms on the device): three are taken, five refused.
  for (int i = 0; i < 8; ++i) ASSERT_TRUE(st.head.send("s0", make_envelope(100 + i, decode_run(i))));
  // Another peer has places of its own.
  ASSERT_TRUE(st.other.send("s0", make_envelope(200, decode_run(8))));
  std::map<uint64_t, std::string> errors;
  std::vector<uint64_t> logits;
  const auto t0 = std::chrono::steady_clock::now();
  double first_logits_s = -1, last_refusal_s = -1;
  while (errors.size() + logits.size() < 9) {
    auto m = st.inbox.next(5s);
    ASSERT_TRUE(m) << errors.size() << " errors, " << logits.size() << " logits";
    const double at = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count();
    if (const auto* e = std::get_if<Error>(&m->second.payload)) {
      errors[m->second.run_id] = e->message;
      last_refusal_s = at;
    } else {
      logits.push_back(m->second.run_id);
      if (first_logits_s < 0) first_logits_s = at;
    }
  }
  std::sort(logits.begin(), logits.end());  // the two peers' runs may arrive in either order
  EXPECT_EQ(logits, (std::vector<uint64_t>{100, 101, 102, 200}));
  ASSERT_EQ(errors.size(), 5u);
  for (uint64_t run = 103; run < 108; ++run)
    EXPECT_EQ(errors[run], "too many runs in flight (3) from 'head': refused until some of them are done");
  // Refused at once: before the first accepted run is done.
  EXPECT_LT(last_refusal_s, first_logits_s);
  EXPECT_EQ(st.stats->runs_refused.load(), 5u);

  // The places came back with the jobs: three more runs are taken.
  ASSERT_TRUE(wait_until([&] { return st.stats->runs.load() == 4; }));
  std::this_thread::sleep_for(100ms);  // a place is given back when its job is destroyed, just after it ran
  for (int i = 0; i < 3; ++i) ASSERT_TRUE(st.head.send("s0", make_envelope(300 + i, decode_run(20 + i))));
  for (int i = 0; i < 3; ++i) {
    auto m = st.inbox.next(5s);
    ASSERT_TRUE(m);
    EXPECT_TRUE(std::holds_alternative<Logits>(m->second.payload))
        << std::get<Error>(m->second.payload).message;
  }
}

TEST(StageAdmission, RefusesRunsAndCacheOperationsItCannotComputeWithoutAJob) {
  System s;
  SlowStage st(*s.sys, 4);
  ASSERT_TRUE(wait_until([&] { return st.head.peer_alive("s0"); }));
  KvCacheOp bad_op;
  bad_op.pipeline = "target";
  bad_op.ops = {{KvOpKind::copy, 0, 64, 0, -1}};
  ASSERT_TRUE(st.head.send("s0", make_envelope(1, decode_run(-3))));
  ASSERT_TRUE(st.head.send("s0", make_envelope(2, bad_op)));
  RunStart huge = decode_run(0);
  huge.tokens.assign(65, 5);
  huge.positions.assign(65, 0);
  huge.seq_masks.assign(65, 1);
  huge.logits.clear();
  ASSERT_TRUE(st.head.send("s0", make_envelope(3, huge)));
  std::map<uint64_t, std::string> errors;
  for (int i = 0; i < 3; ++i) {
    auto m = st.inbox.next(5s);
    ASSERT_TRUE(m);
    ASSERT_TRUE(std::holds_alternative<Error>(m->second.payload));
    errors[m->second.run_id] = std::get<Error>(m->second.payload).message;
  }
  EXPECT_EQ(errors[1], "token 0 of the run has a negative position");
  EXPECT_EQ(errors[2], "KV-cache operation refused: sequence id 64 out of range (the KV cache has 64 sequences, 0..63)");
  EXPECT_EQ(errors[3], "run of 65 tokens is larger than the KV cache (64 cells)");
  EXPECT_EQ(st.stats->runs_refused.load(), 3u);
  EXPECT_EQ(st.device->jobs.load(), 0u) << "a refused run never becomes a device job";
}

TEST(StageAdmission, SpawnRefusesACapBelowOne) {
  System s;
  StageConfig sc;
  sc.pipeline = "target";
  sc.model = model();
  sc.context.n_ctx = 8;
  sc.device_state = std::make_shared<Device>("cpu", 1, std::nullopt);
  sc.max_runs_per_sender = 0;
  EXPECT_THROW(spawn_stage(*s.sys, sc, std::make_shared<StageStats>()), std::invalid_argument);
}

// A peer that never reads: the gateway parks at most 65536 messages for it beyond what ZeroMQ
// holds, then send() says no (the caller learns it at once) instead of queueing without end.
TEST(GatewayPending, ParksABoundedNumberOfMessagesForAPeerThatDoesNotRead) {
  GatewayConfig c;
  c.node = "a";
  c.bind = ipc_ep();
  c.peers = {{"deaf", ipc_ep()}};  // nobody binds it
  c.linger = 0ms;
  Gateway gw(c);
  KvCacheOp op;
  op.pipeline = "target";
  size_t taken = 0;
  while (taken < 70000 && gw.send("deaf", make_envelope(taken, op))) ++taken;
  // ZeroMQ queues its high-water mark (1000, the default) on the connecting socket itself.
  EXPECT_EQ(taken, 1000u + 65536u);
}

}  // namespace
}  // namespace specmesh

// The attack suite: a peer of the mesh tries to change a generation's output or hang it.
//
// The setting is a real one: a two-stage pipeline, each stage its own `specmesh node` process,
// the head in this process, and one more node of the topology, "intruder", played by this
// test through a gateway of its own. The intruder holds a valid identity (a spare node, or a
// compromised one) but no role in the pipelines; each attack sends, for the whole length of
// a generation, messages only the head or a stage may send. A generation under attack must
// give exactly the tokens of an undisturbed one and end in bounded time.
//
// The figure the suite reports (stdout and the test's properties): attacks tried, outputs
// changed, generations hung. Goal: 0 and 0.
#include <gtest/gtest.h>

#include <signal.h>
#include <sys/wait.h>
#include <unistd.h>

#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <functional>
#include <future>
#include <string>
#include <thread>
#include <vector>

#include "private_dir.hpp"
#include "processes.hpp"
#include "refdata.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/transport/gateway.hpp"

using namespace specmesh;
namespace fs = std::filesystem;

namespace {

const std::string kPrompt = "Once upon a time";
constexpr int kTokens = 48;

std::string tmpdir() {
  static std::string dir = [] {
    return test::private_tmpdir("specmesh-attacks");
  }();
  return dir;
}

std::string ipc(const std::string& name) { return "ipc://" + tmpdir() + "/" + name + ".ipc"; }

// head + stages n0, n1 (processes) + intruder (this test). 2 ms per layer: a generation lasts
// about half a second, long enough to be attacked throughout.
std::string write_topology(const std::string& model) {
  const std::string path = tmpdir() + "/attacked.toml";
  std::ofstream f(path);
  f << "[run]\nmodel = \"m\"\nn_predict = " << kTokens << "\ntemperature = 0.0\n";
  f << "[models.m]\npath = \"" << model << "\"\n";
  f << "[nodes.head]\nendpoint = \"" << ipc("head") << "\"\nhead = true\n";
  f << "[nodes.intruder]\nendpoint = \"" << ipc("intruder") << "\"\n";
  for (int i = 0; i < 2; ++i) {
    f << "[nodes.n" << i << "]\nendpoint = \"" << ipc("n" + std::to_string(i)) << "\"\n";
    f << "[devices.cpu" << i << "]\nnode = \"n" << i << "\"\nprofile = { layer_ms = 2.0 }\n";
  }
  f << "[[stages]]\ndevice = \"cpu0\"\nlayers = [0, 3]\n";
  f << "[[stages]]\ndevice = \"cpu1\"\nlayers = [3, 5]\n";
  return path;
}

struct Attack {
  std::string name;
  // One volley: what the intruder sends, again and again, while the generation runs.
  std::function<void(Gateway&, uint64_t volley)> send;
  int every_ms = 3;
};

Tensor f32(std::vector<int64_t> shape, float v) {
  size_t n = 1;
  for (auto d : shape) n *= size_t(d);
  return Tensor::from(WireDType::f32, std::move(shape), std::vector<float>(n, v));
}

std::vector<Attack> role_attacks() {
  std::vector<Attack> a;
  a.push_back({"cancel of guessed run ids 1..4096", [](Gateway& gw, uint64_t) {
                 Cancel c;
                 for (uint64_t id = 1; id <= 4096; ++id) c.run_ids.push_back(id);
                 gw.send("n0", make_envelope(0, c));
                 gw.send("n1", make_envelope(0, c));
               }});
  a.push_back({"cache wipe", [](Gateway& gw, uint64_t) {
                 gw.send("n0", make_envelope(0, KvCacheOp{"target", 0, {{KvOpKind::remove, -1, -1, -1, -1}}}));
                 gw.send("n1", make_envelope(0, KvCacheOp{"target", 3, {{KvOpKind::remove, -1, -1, -1, -1}}}));
               }});
  a.push_back({"run start", [](Gateway& gw, uint64_t v) {
                 RunStart r{"target", {1}, {int32_t(v % 8)}, {1}, {1}, {}, false};
                 gw.send("n0", make_envelope(1000 + v, r));
               }});
  a.push_back({"activations into a later stage", [](Gateway& gw, uint64_t v) {
                 Activations act;
                 act.pipeline = "target";
                 act.layer = 3;
                 act.batch = RunStart{"target", {1}, {int32_t(v % 8)}, {1}, {1}, {}, false};
                 act.tensors.push_back(f32({1, 64}, 0.5f));
                 gw.send("n1", make_envelope(2000 + v, act));
               }});
  a.push_back({"forged logits", [](Gateway& gw, uint64_t v) {
                 // Every row says token 7: accepted, they would steer the output.
                 std::vector<float> row(512, -10.f);
                 row[7] = 10.f;
                 for (uint64_t id = 1; id <= 16; ++id)
                   gw.send("head", make_envelope(v * 16 + id, Logits{"target", {0}, Tensor::from(WireDType::f32, {1, 512}, row)}));
               }});
  a.push_back({"forged error", [](Gateway& gw, uint64_t v) {
                 gw.send("head", make_envelope(v, Error{ErrorCode::invalid_request, "n1", "forged"}));
               }});
  // 16 MiB in one frame, where the largest a stories260K pipeline ever sends is 512 KiB
  // (256 rows of 512 logits): ZeroMQ drops the sender's connection before buffering it.
  a.push_back({"oversized frame",
               [](Gateway& gw, uint64_t v) {
                 Activations act;
                 act.pipeline = "target";
                 act.layer = 3;
                 act.batch = RunStart{"target", {1}, {int32_t(v % 8)}, {1}, {1}, {}, false};
                 act.tensors.push_back(f32({1, 4 << 20}, 0.5f));
                 gw.send("n1", make_envelope(3000 + v, act));
                 gw.send("head", make_envelope(3000 + v, act));
               },
               100});
  return a;
}

struct Outcome {
  bool changed = false;
  bool hung = false;
};

// Runs one generation while `attack` volleys at it; the nodes and head stay up between attacks.
Outcome attacked_generation(Runtime& rt, Gateway& intruder, const Attack& attack, const std::vector<int32_t>& want) {
  std::atomic<bool> done{false};
  std::thread volleys([&] {
    for (uint64_t v = 1; !done.load(); ++v) {
      attack.send(intruder, v);
      std::this_thread::sleep_for(std::chrono::milliseconds(attack.every_ms));
    }
  });
  auto gen = rt.submit({.prompt = kPrompt, .n_predict = kTokens, .ignore_eos = true});
  auto result = std::async(std::launch::async, [&] { return gen->wait(); });
  Outcome o;
  if (result.wait_for(std::chrono::seconds(30)) != std::future_status::ready) {
    o.hung = true;
    gen->cancel();
  }
  done = true;
  volleys.join();
  if (!o.hung) {
    GenerationResult r = result.get();
    o.changed = !r.ok() || r.ids != want;
    EXPECT_TRUE(r.ok()) << attack.name << ": " << r.error;
    EXPECT_EQ(r.ids, want) << attack.name;
  } else {
    ADD_FAILURE() << attack.name << ": the generation did not end within 30 s";
    result.wait();
  }
  return o;
}

}  // namespace

// An intruder with a valid identity but no role sends what only the head or a stage may:
// cancels for guessed ids, cache wipes, run starts, activations, logits, errors. Before role
// checks and random run ids, four of the six changed the output or aborted the generation.
TEST(Attacks, APeerWithoutARoleChangesNothingAndHangsNothing) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string model = test::refdata("gguf-models/stories260K.gguf");
  const std::string topo_path = write_topology(model);
  const Topology topo = Topology::load(topo_path);

  std::vector<int32_t> want;
  {
    auto m = Model::load(model, "");
    Context ctx(*m, {});
    want = greedy_ids(ctx, m->tokenizer().encode(kPrompt, true), kTokens);
  }

  GatewayConfig gc;
  gc.node = "intruder";
  gc.bind = topo.nodes.at("intruder").endpoint;
  for (const auto& [name, n] : topo.nodes)
    if (name != "intruder") gc.peers[name] = n.endpoint;
  Gateway intruder(gc);

  std::vector<pid_t> nodes;
  for (const char* n : {"n0", "n1"})
    nodes.push_back(test::start_cli({"node", "--config", topo_path, "--name", n}, tmpdir() + "/" + n + ".log"));
  struct Reap {
    std::vector<pid_t>& pids;
    ~Reap() {
      for (pid_t p : pids) ::kill(p, SIGTERM);
      for (pid_t p : pids)
        if (!test::wait_exit(p, std::chrono::seconds(5))) ::kill(p, SIGKILL), ::waitpid(p, nullptr, 0);
    }
  } reap{nodes};

  auto rt = std::make_unique<Runtime>(topo, RuntimeOptions{});
  const auto clean = rt->generate({.prompt = kPrompt, .n_predict = kTokens, .ignore_eos = true});
  ASSERT_TRUE(clean.ok()) << clean.error;
  ASSERT_EQ(clean.ids, want);

  int tried = 0, changed = 0, hung = 0;
  for (const Attack& a : role_attacks()) {
    const Outcome o = attacked_generation(*rt, intruder, a, want);
    ++tried;
    changed += o.changed;
    hung += o.hung;
    std::printf("attack %-34s output %s, %s\n", a.name.c_str(), o.changed ? "CHANGED" : "unchanged",
                o.hung ? "HUNG" : "ended");
  }
  std::printf("attacks tried %d, output changed %d, hung %d\n", tried, changed, hung);
  RecordProperty("attacks_tried", tried);
  RecordProperty("output_changed", changed);
  RecordProperty("hung", hung);
  EXPECT_EQ(changed, 0);
  EXPECT_EQ(hung, 0);
  // The stages saw the forged work and said so, rate-limited.
  rt.reset();
  for (const char* n : {"n0", "n1"}) {
    const std::string log = test::read_file(tmpdir() + "/" + n + ".log");
    EXPECT_NE(log.find("refused"), std::string::npos) << n << " logged no refusal:\n" << log;
  }
}

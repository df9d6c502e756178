// ALSpec as actors: the two device groups of the `alspec` strategy, in one process and in two
// node processes, against plain decoding with the same attention layout and against the
// sequential two-device executor; parameters; a killed group.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <regex>
#include <sstream>

#include "specmesh/model/generate.hpp"
#include "specmesh/model/synthetic.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/speculation/alspec_pair.hpp"
#include "specmesh/speculation/registry.hpp"
#include "specmesh/topology.hpp"
#include "processes.hpp"
#include "private_dir.hpp"
#include "refdata.hpp"
#include "shifting_reference.hpp"

using namespace specmesh;
using specmesh::test::refdata;
using specmesh::test::node_options;
using specmesh::test::child_processes;
using specmesh::test::shifting_reference;

namespace {

constexpr int kWindow = 8;  // 2S = 16 keys: most steps speculate over a real middle
constexpr int kPredict = 40;
const std::string kPrompt = "Once upon a time";

std::string tmpdir() {
  static const std::string dir = test::private_tmpdir("specmesh-alspec-actors");
  return dir;
}

// A synthetic GQA Qwen3 (query heads over fewer KV heads, q_dim != n_embd), written once.
const std::string& qwen3_path() {
  static const std::string path = [] {
    const std::string p = tmpdir() + "/tiny-qwen3.gguf";
    SyntheticSpec s = *synthetic_preset("tiny-qwen3");
    s.n_ctx = 512;
    write_synthetic_model(s, p);
    return p;
  }();
  return path;
}

std::vector<std::string> all_models() {
  std::vector<std::string> out;
  for (const char* m : {"stories260K-draft-tiny", "stories260K-draft-small", "stories260K", "stories-target-1M"})
    out.push_back(refdata(std::string("gguf-models/") + m + ".gguf"));
  out.push_back(qwen3_path());
  return out;
}

FlashLayout layout() { return {kWindow, kWindow, 32}; }

// Plain greedy decoding on one context with the pair's attention layout.
std::vector<int32_t> plain(const std::string& path) {
  auto m = Model::load(path);
  Context ctx(*m, {.attention_layout = layout()});
  return greedy_ids(ctx, m->tokenizer().encode(kPrompt, true), kPredict, true);
}

// Greedy decoding through the sequential executor (same hits as the actors should take).
std::vector<int32_t> sequential_pair(const std::string& path, float lambda) {
  auto m = Model::load(path);
  AlspecPair pair(*m, {SpecConfig{layout(), lambda}, 0, 1});
  const int V = m->hparams().n_vocab;
  const auto prompt = m->tokenizer().encode(kPrompt, true);
  std::vector<float> logits = pair.prefill(prompt);
  std::vector<int32_t> out;
  int32_t pos = int32_t(prompt.size());
  while (true) {
    out.push_back(Sampler::argmax(logits.data(), V));
    if (int(out.size()) == kPredict) return out;
    logits = pair.decode(out.back(), pos++).logits;
  }
}

// Head node plus one node per group; "inproc" keeps them in this process, "ipc" spawns the
// two groups as node processes.
// "inproc-one-node": both groups on one node, whose syncs go from device thread to device
// thread without the router (alspec_stage's LocalGroups).
// tp_a / tp_b: the devices of each group (tensor-parallel ranks), all on the group's node.
std::string topology(const std::string& model, const std::string& transport, const std::string& params, int n_ctx = 0,
                     int tp_a = 1, int tp_b = 1) {
  const bool one_node = transport == "inproc-one-node";
  static std::atomic<int> n{0};
  const int id = n++;
  auto ep = [&](const std::string& node) {
    if (transport.starts_with("inproc")) return "inproc://alspec-" + std::to_string(::getpid()) + "-" + std::to_string(id) + "-" + node;
    return "ipc://" + tmpdir() + "/" + std::to_string(id) + "-" + node + ".ipc";
  };
  const std::string path = tmpdir() + "/alspec-" + std::to_string(id) + ".toml";
  std::ofstream f(path);
  f << "[run]\nmodel = \"m\"\nstrategy = \"alspec\"\nn_predict = " << kPredict << "\nn_ctx = " << n_ctx << "\n"
    << "[run.params]\nwindow = " << kWindow << "\n" << params << "\n"
    << "[run.roles]\nreceiver = \"m\"\n[models.m]\npath = \"" << model << "\"\n"
    << "[nodes.head]\nendpoint = \"" << ep("head") << "\"\nhead = true\n"
    << "[nodes.a]\nendpoint = \"" << ep("a") << "\"\n"
    << (one_node ? "" : "[nodes.b]\nendpoint = \"" + ep("b") + "\"\n")
    << "[devices.ga]\nnode = \"a\"\n[devices.gb]\nnode = \"" << (one_node ? "a" : "b") << "\"\n";
  auto ranks = [&](const std::string& g, const std::string& node, int n) {
    std::string list;
    for (int r = 1; r < n; ++r) {
      f << "[devices." << g << r << "]\nnode = \"" << node << "\"\n";
      list += (list.empty() ? "\"" : ", \"") + g + std::to_string(r) + "\"";
    }
    return n > 1 ? "tensor_parallel = [" + list + "]\n" : std::string();
  };
  const std::string tpa = ranks("ga", "a", tp_a), tpb = ranks("gb", one_node ? "a" : "b", tp_b);
  f << "[[stages]]\nrole = \"target\"\ndevice = \"ga\"\nfraction = 1.0\n" << tpa
    << "[[stages]]\nrole = \"receiver\"\ndevice = \"gb\"\nfraction = 1.0\n" << tpb;
  return path;
}

RuntimeOptions opts(const std::string& transport) { return node_options(!transport.starts_with("inproc")); }

GenerationResult run(Runtime& rt) {
  return rt.generate({.prompt = kPrompt, .n_predict = kPredict, .sampling = SamplingParams{}, .ignore_eos = true});
}

void expect_exact(const std::string& transport, const std::string& params) {
  for (const std::string& model : all_models()) {
    auto rt = Runtime::open(topology(model, transport, params), opts(transport));
    // Twice: the second session starts from emptied caches and the first priorities.
    for (int k = 0; k < 2; ++k) {
      GenerationResult r = run(*rt);
      ASSERT_TRUE(r.ok()) << r.error;
      EXPECT_EQ(r.ids, plain(model)) << model << " (" << transport << ", " << params << "), session " << k;
      EXPECT_EQ(r.metrics.attention_checks, int64_t(kPredict - 1) * Model::load(model)->hparams().n_layer);
      EXPECT_EQ(r.metrics.token_hit_rates.size(), size_t(kPredict - 1));
    }
  }
}

}  // namespace

// SP + TPn: each group's stage split over several devices (tensor-parallel ranks); the groups
// exchange whole rows, so they may differ in size.
TEST(AlspecActors, TensorParallelGroupsEqualPlainDecodingInProcessAndOverTwoProcesses) {
  SPECMESH_REQUIRE_REFDATA();
  for (const std::string& model : all_models()) {
    if (Model::load(model)->hparams().n_head_kv < 2) continue;
    const std::vector<int32_t> want = plain(model);
    for (const auto& [transport, tp_a, tp_b] :
         std::vector<std::tuple<std::string, int, int>>{{"inproc", 2, 2}, {"inproc-one-node", 2, 1}, {"ipc", 2, 2}}) {
      for (const std::string params : {"lambda = 0.0", "lambda = 10.0\nforce_miss = true"}) {
        SCOPED_TRACE(model + " (" + transport + ", TP" + std::to_string(tp_a) + " + TP" + std::to_string(tp_b) + ", " + params + ")");
        auto rt = Runtime::open(topology(model, transport, params, 0, tp_a, tp_b), opts(transport));
        for (int k = 0; k < 2; ++k) {
          GenerationResult r = run(*rt);
          ASSERT_TRUE(r.ok()) << r.error;
          EXPECT_EQ(r.ids, want) << "session " << k;
          EXPECT_EQ(r.metrics.attention_checks, int64_t(kPredict - 1) * Model::load(model)->hparams().n_layer);
        }
      }
    }
  }
}

TEST(AlspecActors, TensorParallelGroupsTakeTheSequentialPairsSpeculations) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string model = refdata("gguf-models/stories-target-1M.gguf");
  auto rt = Runtime::open(topology(model, "inproc", "lambda = 10.0", 0, 2, 2), opts("inproc"));
  GenerationResult r = run(*rt);
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.ids, sequential_pair(model, 10.0f));
  EXPECT_GT(r.metrics.attention_hits, 0);
}

TEST(AlspecActors, TensorParallelStagesAreChecked) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string model = refdata("gguf-models/stories260K.gguf");
  const std::string base = std::string("[run]\nmodel = \"m\"\nstrategy = \"alspec\"\n[run.roles]\nreceiver = \"m\"\n") +
                           "[models.m]\npath = \"" + model + "\"\n[nodes.head]\nendpoint = \"inproc://tp-checks-" +
                           std::to_string(::getpid()) + "\"\nhead = true\n[nodes.b]\nendpoint = \"inproc://tp-checks-b-" +
                           std::to_string(::getpid()) + "\"\n[devices.a]\nnode = \"head\"\n[devices.a1]\nnode = \"head\"\n" +
                           "[devices.a2]\nnode = \"head\"\n[devices.a3]\nnode = \"head\"\n[devices.a4]\nnode = \"head\"\n" +
                           "[devices.a5]\nnode = \"head\"\n" +
                           "[devices.b]\nnode = \"b\"\n";
  auto expect_error = [&](const std::string& stages, const std::string& what) {
    try {
      Runtime rt(Topology::parse(base + stages, "t.toml", "/"));
      ADD_FAILURE() << "accepted: " << stages;
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(what), std::string::npos) << e.what();
    }
  };
  const std::string receiver = "[[stages]]\nrole = \"receiver\"\ndevice = \"a4\"\nfraction = 1.0\n";
  expect_error("[[stages]]\nrole = \"target\"\ndevice = \"a\"\nfraction = 1.0\ntensor_parallel = [\"b\"]\n" + receiver,
               "t.toml:31: stages[0].tensor_parallel: 'b' is on node 'b', not on the stage's node 'head'");
  expect_error("[[stages]]\nrole = \"target\"\ndevice = \"a\"\nfraction = 1.0\ntensor_parallel = [\"x\"]\n" + receiver,
               "stages[0].tensor_parallel: names no device in [devices]: 'x'");
  expect_error("[[stages]]\nrole = \"target\"\ndevice = \"a\"\nfraction = 1.0\ntensor_parallel = [\"a1\", \"a1\"]\n" + receiver,
               "'a1' is named twice in the stage");
  // stories260K has 4 KV heads: five devices cannot each hold one.
  expect_error("[[stages]]\nrole = \"target\"\ndevice = \"a\"\nfraction = 1.0\ntensor_parallel = [\"a1\", \"a2\", \"a3\", \"a5\"]\n" +
                   receiver,
               "t.toml:27: stages: tensor parallelism: 5 devices for 4 KV heads");
  expect_error("[[stages]]\nrole = \"target\"\ndevice = \"a\"\nfraction = 1.0\ntensor_parallel = [\"a1\", \"a4\"]\n" + receiver,
               "t.toml:34: stages[1].device: device 'a4' also computes for stages[0]; the devices of a "
               "tensor-parallel stage are its own");
}

TEST(AlspecActors, LambdaZeroAndForcedMissEqualPlainDecodingInProcess) {
  SPECMESH_REQUIRE_REFDATA();
  for (const std::string transport : {"inproc", "inproc-one-node"}) {
    expect_exact(transport, "lambda = 0.0");
    expect_exact(transport, "lambda = 10.0\nforce_miss = true");
  }
}

TEST(AlspecActors, LambdaZeroAndForcedMissEqualPlainDecodingOverTwoProcesses) {
  SPECMESH_REQUIRE_REFDATA();
  expect_exact("ipc", "lambda = 0.0");
  expect_exact("ipc", "lambda = 10.0\nforce_miss = true");
}

// A full context shifts (llama.cpp's context shift) in both groups' caches, the receiver's
// through the sender's group, and decoding goes on as plain decoding with the shift does.
TEST(AlspecActors, ContextShiftGoesOnAsPlainDecodingDoes) {
  SPECMESH_REQUIRE_REFDATA();
  const int ctx = 48, n = 120;
  const std::string model = refdata("gguf-models/stories260K.gguf");
  auto m = Model::load(model);
  for (const std::string transport : {"inproc", "ipc"}) {
    auto rt = Runtime::open(topology(model, transport, "lambda = 0.0", ctx), opts(transport));
    for (int n_keep : {0, 4}) {
      GenerationResult r = rt->generate({.prompt = kPrompt, .n_predict = n, .sampling = SamplingParams{}, .ignore_eos = true,
                                         .context_shift = true, .n_keep = n_keep});
      ASSERT_TRUE(r.ok()) << r.error;
      EXPECT_EQ(r.ids, shifting_reference(*m, ctx, r.prompt_ids, n, n_keep, {.attention_layout = layout()}))
          << transport << ", n_keep " << n_keep;
      EXPECT_GE(r.context_shifts, 2);
    }
  }
}

TEST(AlspecActors, AcceptedSpeculationsFollowTheSequentialPair) {
  SPECMESH_REQUIRE_REFDATA();
  for (const std::string& model : all_models()) {
    for (const std::string transport : {"inproc", "inproc-one-node"}) {
      auto rt = Runtime::open(topology(model, transport, "lambda = 10.0"), opts(transport));
      GenerationResult r = run(*rt);
      ASSERT_TRUE(r.ok()) << r.error;
      EXPECT_EQ(r.ids, sequential_pair(model, 10.0f)) << model << " (" << transport << ")";
      // Steps over fewer than 2S keys are exact and always accepted; more hits than those
      // means real speculations were taken.
      const int n_layer = Model::load(model)->hparams().n_layer;
      const int64_t exact_steps = std::max<int64_t>(0, 2 * kWindow - 1 - int64_t(r.prompt_ids.size()));
      EXPECT_GT(r.metrics.attention_hits, exact_steps * n_layer) << model;
      ASSERT_FALSE(r.metrics.layer_hit_rates.empty());
      for (double h : r.metrics.layer_hit_rates) EXPECT_TRUE(h >= 0 && h <= 1);
    }
  }
}

TEST(AlspecActors, ParametersAreChecked) {
  const StrategyInfo& s = strategy("alspec");
  EXPECT_EQ(s.roles, (std::vector<std::string>{"target", "receiver"}));
  const StrategyParams d = s.resolve({});
  EXPECT_FLOAT_EQ(d.real("lambda"), 0.1f);
  EXPECT_EQ(d.integer("window"), 128);
  const AlspecSettings a = s.pair_settings(d);
  EXPECT_EQ(a.spec.layout.spec_len, 128u);
  EXPECT_EQ(a.spec.layout.chunk, 128u) << "chunk 0 means the window";
  EXPECT_EQ(s.pair_settings(s.resolve({{"window", 64}, {"chunk", 32}})).spec.layout.chunk, 32u);
  auto error = [&](std::map<std::string, ParamValue> given) {
    try {
      s.resolve(given);
      return std::string("no error");
    } catch (const std::invalid_argument& e) {
      return std::string(e.what());
    }
  };
  EXPECT_NE(error({{"lambda", -0.5}}).find("lambda"), std::string::npos);
  EXPECT_NE(error({{"window", 0}}).find("window"), std::string::npos);
  EXPECT_NE(error({{"chunk", -1}}).find("chunk"), std::string::npos);
  EXPECT_THROW(s.check(s.resolve({{"window", 512}}), {256, {}}), ParamConflict);
}

TEST(AlspecActors, GroupsOnOneDeviceOrWithAnotherModelAreRejected) {
  SPECMESH_REQUIRE_REFDATA();
  auto error = [](const std::string& text) {
    try {
      Runtime rt(Topology::parse(text, "t.toml", "/"));
      return std::string("no error");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
  };
  const std::string head = "[run]\nmodel = \"m\"\nstrategy = \"alspec\"\n[models.m]\npath = \"" +
                           refdata("gguf-models/stories260K.gguf") + "\"\n[nodes.head]\nendpoint = \"inproc://alspec-checks\"\n"
                           "head = true\n[devices.cpu]\nnode = \"head\"\n";
  EXPECT_NE(error(head).find("devices of their own"), std::string::npos) << error(head);
  // Another endpoint name: the first runtime's inproc socket may not be released yet.
  const std::string other = std::regex_replace(head, std::regex("alspec-checks"), "alspec-checks-2") +
                            "[run.roles]\nreceiver = \"o\"\n[models.o]\npath = \"" +
                            refdata("gguf-models/stories260K-draft-tiny.gguf") + "\"\n[devices.gpu]\nnode = \"head\"\n"
                            "[[stages]]\nrole = \"receiver\"\ndevice = \"gpu\"\nfraction = 1.0\n";
  EXPECT_NE(error(other).find("must run the target's model"), std::string::npos) << error(other);
}

// Kills the node process of one group (0: the target's, 1: the receiver's) mid-generation.
void kill_group(int group, int tp = 1) {
  auto rt = Runtime::open(topology(refdata("gguf-models/stories-target-1M.gguf"), "ipc", "lambda = 0.1", 0, tp, tp), opts("ipc"));
  std::vector<pid_t> kids = child_processes();
  ASSERT_EQ(kids.size(), 2u);
  std::sort(kids.begin(), kids.end());  // spawned in node order: a (target), then b
  std::chrono::steady_clock::time_point killed_at;
  int seen = 0;
  auto r = rt->generate({.prompt = kPrompt, .n_predict = 400, .ignore_eos = true}, [&](int32_t, const std::string&) {
    if (++seen == 5) {
      killed_at = std::chrono::steady_clock::now();
      ::kill(kids[group], SIGKILL);
    }
    return true;
  });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.error.find(group == 0 ? "node 'a'" : "node 'b'"), std::string::npos) << r.error;
  EXPECT_NE(r.error.find("stopped answering"), std::string::npos) << r.error;
  EXPECT_GE(r.ids.size(), 5u);
  EXPECT_LT(r.ids.size(), 400u);
  EXPECT_LT(waited, 2.0);
  std::printf("group %d of %d device(s) killed: the client had the error after %.0f ms\n", group, tp, 1e3 * waited);
}

TEST(AlspecActors, KilledSenderOrReceiverGivesAClearError) {
  SPECMESH_REQUIRE_REFDATA();
  for (int tp : {1, 2}) {  // a group on one device, and a tensor-parallel group on two
    kill_group(0, tp);
    kill_group(1, tp);
  }
}

// Paced pair stages: every op waits out its modelled time, and a hit layer overlaps the
// receiver's rest of the layer with the sender's attention through the two devices' real
// concurrency, so a token costs n x max(attention, rest) with every layer a hit and
// n x (attention + rest) with none (the same as plain decoding on one such device).
static double paced_token_ms(const std::string& params, bool pair) {
  const std::string model = refdata("gguf-models/stories260K.gguf");
  std::string text = topology(model, "inproc", params);
  Topology t = Topology::load(text);
  if (!pair) {
    t.run.strategy = "ar";
    t.run.roles.clear();
    t.run.params.clear();
    t.stages.pop_back();
    t.devices.erase("gb");
  }
  DeviceProfile p;
  p.name = "paced";
  LayerTimes lt;
  lt.non_attention.points = {{0, 0.004}};
  lt.flash.points = {{0, 0.006}};
  lt.spec_sender = lt.flash;
  lt.spec_receiver.points = {{0, 0.0}};
  lt.fixed.points = {{0, 0.002}};
  p.times = lt;
  for (auto& [name, d] : t.devices) d.profile = p;
  Runtime rt(std::move(t));
  GenerationResult r = rt.generate({.prompt = kPrompt, .n_predict = 7, .sampling = SamplingParams{}, .ignore_eos = true});
  EXPECT_TRUE(r.ok()) << r.error;
  return 1e3 / r.stats.decode_tokens_per_s;
}

TEST(AlspecActors, PacedStagesOverlapHitLayers) {
  SPECMESH_REQUIRE_REFDATA();
  const int n = Model::load(refdata("gguf-models/stories260K.gguf"))->hparams().n_layer;
  const double hit = paced_token_ms("emulate_hit_rate = 1.0", true);
  const double miss = paced_token_ms("force_miss = true", true);
  const double plain = paced_token_ms("", false);
  // Pacing is a floor (a token never takes less than its profile); above it, load on the
  // shared cores only adds, so the overlap is checked as a ratio within the same run.
  EXPECT_GE(hit, 0.95 * (2 + n * 6.0));
  EXPECT_GE(miss, 0.95 * (2 + n * 10.0));
  EXPECT_GE(plain, 0.95 * (2 + n * 10.0));
  EXPECT_LT(hit / miss, 0.8) << "hit layers overlap: expected about " << (2 + n * 6.0) / (2 + n * 10.0);
  EXPECT_NEAR(plain / miss, 1.0, 0.2);
  EXPECT_LT(hit, 1.5 * (2 + n * 6.0));
}

TEST(AlspecActors, EmulatedHitPatternGivesRoundedCount) {
  for (int n : {1, 5, 32}) {
    for (double r : {0.0, 0.5, 0.625, 0.65, 0.75, 0.875, 1.0}) {
      int hits = 0;
      for (int l = 0; l < n; ++l) hits += emulated_hit(l, n, r);
      EXPECT_EQ(hits, int(std::lround(r * n))) << n << " layers at " << r;
      EXPECT_EQ(emulated_hits(n, r), hits);
    }
  }
  EXPECT_EQ(emulated_hits(32, 0.65), 21) << "20.8 rounds to 21";
  EXPECT_THROW(emulated_hits(32, 1.5), std::invalid_argument);
  // Hits are spread: 4 of 8 alternate.
  for (int l = 0; l < 8; ++l) EXPECT_EQ(emulated_hit(l, 8, 0.5), l % 2 == 1);
}

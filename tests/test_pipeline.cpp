// Plain generation through pipelines of stage actors spread over threads and processes must
// give exactly the tokens of the single-process core.
#include <gtest/gtest.h>

#include <signal.h>
#include <unistd.h>

#include <array>
#include <atomic>
#include <chrono>
#include <filesystem>
#include <fstream>
#include <nlohmann/json.hpp>
#include <thread>

#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/model/synthetic.hpp"
#include "ports.hpp"
#include "processes.hpp"
#include "private_dir.hpp"
#include "refdata.hpp"
#include "specmesh/runtime.hpp"

using namespace specmesh;
using specmesh::test::refdata;
using specmesh::test::node_options;
using specmesh::test::child_processes;

namespace {

std::string tmpdir() {
  static const std::string dir = test::private_tmpdir("specmesh-pipeline");
  return dir;
}


std::string endpoint(const std::string& transport, const std::string& name) {
  if (transport == "ipc") return "ipc://" + tmpdir() + "/" + name + ".ipc";
  if (transport == "tcp") return "tcp://127.0.0.1:" + std::to_string(test::free_port_pair());
  static std::atomic<int> n{0};
  return "inproc://" + name + "-" + std::to_string(n++);
}

// A topology with the head on its own node and one node per stage, layers split evenly.
std::string write_topology(const std::string& model, const std::string& tokenizer, int n_stages,
                           const std::string& transport, const std::string& extra = "") {
  static std::atomic<int> n{0};
  const std::string path = tmpdir() + "/topo-" + std::to_string(n++) + ".toml";
  std::ofstream f(path);
  f << "[run]\nmodel = \"target\"\nn_predict = 40\ntemperature = 0.0\n" << extra << "\n";
  f << "[models.target]\npath = \"" << model << "\"\n";
  if (!tokenizer.empty()) f << "tokenizer = \"" << tokenizer << "\"\n";
  f << "[nodes.head]\nendpoint = \"" << endpoint(transport, "head") << "\"\nhead = true\n";
  for (int i = 0; i < n_stages; ++i) {
    f << "[nodes.n" << i << "]\nendpoint = \"" << endpoint(transport, "n" + std::to_string(i)) << "\"\n";
    f << "[devices.cpu" << i << "]\nnode = \"n" << i << "\"\nthreads = 1\n";
  }
  for (int i = 0; i < n_stages; ++i)
    f << "[[stages]]\ndevice = \"cpu" << i << "\"\nfraction = " << 1.0 / n_stages << "\n";
  return path;
}

std::vector<int32_t> reference(const std::string& model, const std::string& tokenizer, const std::string& prompt, int n) {
  auto m = Model::load(model, tokenizer);
  Context ctx(*m, {});
  return greedy_ids(ctx, m->tokenizer().encode(prompt, true), n);
}


std::string qwen3_model() {
  static std::string path = [] {
    SyntheticSpec s = *synthetic_preset("tiny-qwen3");
    s.vocab_from = refdata("llama2c/tok512.bin");
    s.seed = 7;
    std::string p = tmpdir() + "/tiny-qwen3.gguf";
    write_synthetic_model(s, p);
    return p;
  }();
  return path;
}

void expect_pipeline_matches(const std::string& model, const std::string& tok, int stages, const std::string& transport,
                             bool spawn) {
  const std::string prompt = "Once upon a time";
  auto want = reference(model, tok, prompt, 40);
  auto rt = Runtime::open(write_topology(model, tok, stages, transport), node_options(spawn));
  auto got = rt->generate({.prompt = prompt, .n_predict = 40});
  ASSERT_TRUE(got.ok()) << got.error;
  EXPECT_EQ(got.ids, want) << stages << " stages over " << transport;
  // A second request on the same runtime starts from a clean cache.
  auto again = rt->generate({.prompt = prompt, .n_predict = 40});
  EXPECT_EQ(again.ids, want);
}

}  // namespace

TEST(Pipeline, InProcessStagesMatchGenerate) {
  SPECMESH_REQUIRE_REFDATA();
  expect_pipeline_matches(refdata("gguf-models/stories260K.gguf"), "", 2, "inproc", false);
  expect_pipeline_matches(refdata("llama2c/stories260K.bin"), refdata("llama2c/tok512.bin"), 3, "inproc", false);
}

TEST(Pipeline, TwoAndThreeProcessesOverIpcMatchGenerate) {
  SPECMESH_REQUIRE_REFDATA();
  for (int stages : {2, 3}) {
    expect_pipeline_matches(refdata("gguf-models/stories260K.gguf"), "", stages, "ipc", true);
    expect_pipeline_matches(qwen3_model(), "", stages, "ipc", true);
  }
}

TEST(Pipeline, TwoAndThreeProcessesOverTcpMatchGenerate) {
  SPECMESH_REQUIRE_REFDATA();
  for (int stages : {2, 3}) {
    expect_pipeline_matches(refdata("gguf-models/stories260K.gguf"), "", stages, "tcp", true);
    expect_pipeline_matches(qwen3_model(), "", stages, "tcp", true);
  }
}

TEST(Pipeline, KilledStageGivesAClearErrorAndKeepsAcceptedTokens) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string model = refdata("gguf-models/stories-target-1M.gguf");
  auto rt = Runtime::open(write_topology(model, "", 2, "ipc"), node_options(true));
  // Find the stage processes: the children of this process running `specmesh node`.
  std::vector<pid_t> kids = child_processes();
  ASSERT_EQ(kids.size(), 2u);
  std::chrono::steady_clock::time_point killed_at;
  int seen = 0;
  auto result = rt->generate({.prompt = "Once upon a time", .n_predict = 400, .ignore_eos = true},
                             [&](int32_t, const std::string&) {
                               if (++seen == 5) {
                                 killed_at = std::chrono::steady_clock::now();
                                 ::kill(kids[1], SIGKILL);
                               }
                               return true;
                             });
  const double waited = std::chrono::duration<double>(std::chrono::steady_clock::now() - killed_at).count();
  EXPECT_FALSE(result.ok());
  EXPECT_NE(result.error.find("stopped answering"), std::string::npos) << result.error;
  EXPECT_GE(result.ids.size(), 5u);
  EXPECT_LT(result.ids.size(), 400u);
  EXPECT_LT(waited, 2.0);
}

TEST(Pipeline, UnreachableNodeIsNamed) {
  SPECMESH_REQUIRE_REFDATA();
  RuntimeOptions o;
  o.connect_timeout = std::chrono::milliseconds(500);
  try {
    Runtime rt(Topology::load(write_topology(refdata("gguf-models/stories260K.gguf"), "", 2, "ipc")), o);
    FAIL() << "expected an error";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("node 'n0'"), std::string::npos) << e.what();
  }
}

TEST(Topology, ErrorsNameFileLineAndKey) {
  auto err = [](const std::string& text) {
    try {
      Topology::parse(text, "t.toml", "/");
      return std::string("no error");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
  };
  EXPECT_EQ(err("[run]\nstrategy = \"ar\"\n"), "t.toml: models: at least one model is needed");
  EXPECT_EQ(err("[models.t]\npath = \"x\"\n[run]\nstrategy = \"fast\"\n"),
            "t.toml:4: run.strategy: unknown strategy \"fast\" (registered: ar, spec, pipeinfer, alspec, triforce, dflash)");
  // A strategy's roles and parameters come from the registry.
  EXPECT_EQ(err("[models.t]\npath = \"x\"\n[run]\nstrategy = \"spec\"\n"),
            "t.toml:4: run.strategy: \"spec\" needs a pipeline for role \"draft\"");
  // A parameter may leave a role unused: triforce without its draft needs only the target.
  EXPECT_EQ(err("[models.t]\npath = \"x\"\n[run]\nstrategy = \"triforce\"\n"),
            "t.toml:4: run.strategy: \"triforce\" needs a pipeline for role \"draft\"");
  EXPECT_EQ(err("[models.t]\npath = \"x\"\n[run]\nstrategy = \"triforce\"\n[run.params]\nuse_draft = false\n"),
            "no error");
  const std::string two = "[models.t]\npath = \"x\"\n[models.d]\npath = \"y\"\n[run]\nmodel = \"t\"\ndraft = \"d\"\n";
  EXPECT_EQ(err(two + "strategy = \"spec\"\n[run.params]\nn_draft = 0\n"),
            "t.toml:10: run.params.n_draft: parameter n_draft (int, 1..64, default 4): must be between 1 and 64, not 0");
  // A whole number no integer type holds is named as written (found by the topology fuzzer).
  EXPECT_EQ(err(two + "strategy = \"spec\"\n[run.params]\nn_draft = 1e308\n"),
            "t.toml:10: run.params.n_draft: parameter n_draft (int, 1..64, default 4): must be between 1 and 64, not 1e+308");
  EXPECT_EQ(err(two + "strategy = \"spec\"\n[run.params]\nn_draft = 2.5\n"),
            "t.toml:10: run.params.n_draft: parameter n_draft (int, 1..64, default 4): expected an integer");
  EXPECT_EQ(err(two + "strategy = \"spec\"\n[run.params]\np_accept = nan\n"),
            "t.toml:10: run.params.p_accept: parameter p_accept (float, 0..1, default 0.5): must be a finite number");
  EXPECT_EQ(err(two + "strategy = \"spec\"\n[run.params]\ncancel = true\n"),
            "t.toml:10: run.params.cancel: strategy \"spec\" has no parameter 'cancel' (it takes n_draft, p_accept, tree, tree_nodes)");
  // Token trees: checked at load against their schema and against each other.
  EXPECT_EQ(err(two + "[run.params]\ntree = []\n"),
            "t.toml:9: run.params.tree: parameter tree (int list, 1..16 each, at most 16, default none): must not be empty");
  EXPECT_EQ(err(two + "[run.params]\ntree = \"1,0,3\"\n"),
            "t.toml:9: run.params.tree: parameter tree (int list, 1..16 each, at most 16, default none): entry 2 must be "
            "between 1 and 16, not 0");
  EXPECT_EQ(err(two + "[run.params]\ntree = \"1,x\"\n"),
            "t.toml:9: run.params.tree: expected a number, true/false, or a list of integers, not \"1,x\"");
  EXPECT_EQ(err(two + "[run.params]\ntree = [4, 4, 4]\n"),
            "t.toml:9: run.params.tree: the tree 4,4,4 has 84 nodes, more than tree_nodes (64)");
  EXPECT_EQ(err(two + "n_ctx = 16\n[run.params]\ntree = [3, 3, 1]\n"),
            "t.toml:10: run.params.tree: the tree 3,3,1 (21 nodes) does not fit a context of 16 tokens");
  EXPECT_EQ(err(two + "[run.params]\ntree = [8, 8]\ntree_nodes = 100\n"),
            "t.toml:9: run.params.tree: the tree 8,8 has 64 leaves, more than the 63 branches a KV cache can tell apart");
  EXPECT_EQ(err(two + "[run.roles]\ndraft2 = \"nope\"\n"), "t.toml:9: run.roles.draft2: names no model in [models]: 'nope'");
  EXPECT_EQ(err(two + "[[stages]]\nrole = \"retrieval\"\n"), "t.toml:9: stages[0].role: names no pipeline role of [run]: 'retrieval'");
  EXPECT_EQ(err("[models.t]\npath = \"x\"\n[run]\nn_predict = \"many\"\n"), "t.toml:4: run.n_predict: expected an integer");
  EXPECT_EQ(err("[models.t]\npath = \"x\"\n[run]\n[nodes.a]\nendpoint = \"http://x\"\nhead = true\n"),
            "t.toml:5: nodes.a.endpoint: must start with inproc://, ipc:// or tcp://");
  EXPECT_EQ(err("[models.t]\npath = \"x\"\nsize = 3\n[run]\n"), "t.toml:3: models.t.size: unknown key");
  EXPECT_NE(err("[models.t\n").find("t.toml:1:"), std::string::npos);
  EXPECT_EQ(err("[models.t]\npath = \"x\"\n[run]\n[[stages]]\ndevice = \"gpu\"\nlayers = [0, 2]\n"),
            "t.toml:5: stages[0].device: names no device in [devices]: 'gpu'");
}

TEST(Topology, SamplingSettingsOutsideTheirRangeAreRefusedWithTheKey) {
  auto err = [](const std::string& run) {
    try {
      Topology::parse("[models.t]\npath = \"x\"\n[run]\n" + run + "\n", "t.toml", "/");
      return std::string("no error");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
  };
  EXPECT_EQ(err("temperature = nan"), "t.toml:4: run.temperature: must be a finite number, not nan");
  EXPECT_EQ(err("temperature = inf"), "t.toml:4: run.temperature: must be a finite number, not inf");
  EXPECT_EQ(err("temperature = -1.0"), "t.toml:4: run.temperature: must not be negative");
  EXPECT_EQ(err("top_k = -5"), "t.toml:4: run.top_k: must not be negative (0: off)");
  EXPECT_EQ(err("top_p = 7.0"), "t.toml:4: run.top_p: must be between 0 and 1, not 7");
  EXPECT_EQ(err("top_p = nan"), "t.toml:4: run.top_p: must be between 0 and 1, not nan");
  EXPECT_EQ(err("min_p = -1.0"), "t.toml:4: run.min_p: must be between 0 and 1, not -1");
  EXPECT_EQ(err("n_ctx = -5"), "t.toml:4: run.n_ctx: must not be negative (0: the model's own)");
  EXPECT_EQ(err("kv_type = \"q4_0\""), "t.toml:4: run.kv_type: unknown KV cache type 'q4_0' (expected f16, q8_0 or f32)");
  EXPECT_EQ(err("temperature = 0.7\ntop_k = 40\ntop_p = 0.9\nmin_p = 0.05\nn_ctx = 256\nkv_type = \"Q8_0\""), "no error");
  EXPECT_EQ(Topology::parse("[models.t]\npath = \"x\"\n[run]\nkv_type = \"Q8_0\"\n", "t.toml", "/").run.kv_type, "q8_0");
  EXPECT_EQ(Topology::parse("[models.t]\npath = \"x\"\n[run]\n", "t.toml", "/").run.kv_type, "f16");
}

// Found by fuzzing (fuzz/topology.cpp): an integer key given a float too large for int64
// (n_predict = 1.69e20) was converted before its range was known, which is undefined behaviour;
// and integers too large for their key were cut down to fit (n_predict = 4294967297 ran 1 token).
TEST(Topology, IntegersMustFitTheirKey) {
  auto err = [](const std::string& text) {
    try {
      Topology::parse("[models.t]\npath = \"x\"\n" + text + "\n", "t.toml", "/");
      return std::string("no error");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
  };
  EXPECT_EQ(err("[run]\nn_predict = 169223372036854775807.9"), "t.toml:4: run.n_predict: expected an integer");
  EXPECT_EQ(err("[run]\nn_predict = 1e300"), "t.toml:4: run.n_predict: expected an integer");
  EXPECT_EQ(err("[run]\nn_predict = 4294967297"),
            "t.toml:4: run.n_predict: expected an integer between -2147483648 and 2147483647, not 4294967297");
  EXPECT_EQ(err("[run]\nseed = -1"), "t.toml:4: run.seed: expected an integer between 0 and 9223372036854775807, not -1");
  EXPECT_EQ(err("[run]\n[devices.cpu]\nthreads = 4294967298"),
            "t.toml:5: devices.cpu.threads: expected an integer between -2147483648 and 2147483647, not 4294967298");
  EXPECT_EQ(err("[run]\n[[stages]]\nlayers = [0, 4294967298]"),
            "t.toml:5: stages[0].layers: expected [first, end) as two integers between -2147483648 and 2147483647, not "
            "4294967298");
  EXPECT_EQ(err("[run]\n[[stages]]\nlayers = [0, 1e20]"), "t.toml:5: stages[0].layers: expected [first, end) as two integers");
  EXPECT_EQ(err("[run]\ndraft = \"t\"\n[run.params]\ntree = [1, 1e20]"),
            "t.toml:6: run.params.tree: expected integers in the list");
  // Whole numbers written as floats still count, as before.
  EXPECT_EQ(err("[run]\nn_predict = 64.0\nseed = 9223372036854775807\n[[stages]]\nlayers = [0, 2.0]"), "no error");
}

// Timing models take rates and durations: a negative or NaN one would make time run backwards
// (or not at all); an integer beyond its field would wrap.
TEST(Topology, LinkAndProfileValuesAndIntegersOutsideTheirRangeAreRefusedWithTheKey) {
  auto err = [](const std::string& rest) {
    try {
      Topology::parse("[models.t]\npath = \"x\"\n[run]\n" + rest + "\n", "t.toml", "/");
      return std::string("no error");
    } catch (const ConfigError& e) {
      return std::string(e.what());
    }
  };
  EXPECT_EQ(err("[link]\nlatency_us = -50.0\ngbps = 1.0"), "t.toml:5: link.latency_us: must not be negative, not -50");
  EXPECT_EQ(err("[link]\nlatency_us = 50.0\ngbps = nan"), "t.toml:6: link.gbps: must be a finite number, not nan");
  EXPECT_EQ(err("[link]\nlatency_us = inf"), "t.toml:5: link.latency_us: must be a finite number, not inf");
  for (const char* key : {"flops_per_s", "bytes_per_s", "op_overhead_us", "layer_ms", "layer_token_ms"}) {
    SCOPED_TRACE(key);
    const std::string pre = "[devices.d]\nprofile = { " + std::string(key) + " = ";
    EXPECT_EQ(err(pre + "-1.0 }"), "t.toml:5: devices.d.profile." + std::string(key) + ": must not be negative, not -1");
    EXPECT_EQ(err(pre + "nan }"), "t.toml:5: devices.d.profile." + std::string(key) + ": must be a finite number, not nan");
  }
  EXPECT_EQ(err("[devices.d]\nprofile = { layer_ms = 2.0, layer_token_ms = 0.5 }\n[link]\nlatency_us = 0.0"), "no error");
  EXPECT_EQ(err("n_ctx = 5000000000"),
            "t.toml:4: run.n_ctx: expected an integer between -2147483648 and 2147483647, not 5000000000");
  EXPECT_EQ(err("temperature = 1e300"), "t.toml:4: run.temperature: must be a finite number, not 1e+300");
  // A virtual context drives measured timing curves only.
  EXPECT_EQ(err("[devices.d]\nprofile = \"rpi5\"\nvirtual_context = 4096"),
            "t.toml:6: devices.d.virtual_context: needs a profile with measured per-op timing (n150, n300, n300x2, t3k, "
            "h100-tp4, p300-dflash)");
  EXPECT_EQ(err("[devices.d]\nprofile = \"n150\"\nvirtual_context = 0"),
            "t.toml:6: devices.d.virtual_context: expected a number of keys between 1 and 1099511627776, not 0");
  const Topology t = Topology::parse("[models.t]\npath = \"x\"\n[run]\n[devices.d]\nprofile = \"n150\"\nvirtual_context = 65536\n",
                                     "t.toml", "/");
  EXPECT_EQ(t.devices.at("d").profile->virtual_context, 65536);
}

TEST(Topology, FractionsResolveToContiguousRanges) {
  Topology t = Topology::parse(
      "[models.t]\npath = \"m.gguf\"\n[run]\n[devices.a]\n[devices.b]\n"
      "[[stages]]\ndevice = \"a\"\nfraction = 0.4\n[[stages]]\ndevice = \"b\"\nfraction = 0.6\n",
      "t.toml", "/models");
  EXPECT_EQ(t.models.at("t").path, "/models/m.gguf");
  t.resolve_layers("target", 5);
  EXPECT_EQ(t.stages[0].layer_begin, 0);
  EXPECT_EQ(t.stages[0].layer_end, 2);
  EXPECT_EQ(t.stages[1].layer_begin, 2);
  EXPECT_EQ(t.stages[1].layer_end, 5);
  Topology bad = Topology::parse(
      "[models.t]\npath = \"m.gguf\"\n[run]\n[devices.a]\n[[stages]]\ndevice = \"a\"\nlayers = [0, 3]\n", "t.toml", "/");
  EXPECT_THROW(bad.resolve_layers("target", 5), ConfigError);
}

// A model can serve several roles: each role gets a pipeline (and a KV cache) of its own.
TEST(Topology, RolesHaveTheirOwnPipelines) {
  Topology t = Topology::parse(
      "[models.m]\npath = \"m.gguf\"\n[models.s]\npath = \"s.gguf\"\n[run]\nmodel = \"m\"\ndraft = \"m\"\n"
      "[run.roles]\ndraft2 = \"s\"\n[devices.a]\n[devices.b]\n"
      "[[stages]]\nmodel = \"m\"\ndevice = \"a\"\nfraction = 1.0\n[[stages]]\nrole = \"draft\"\ndevice = \"b\"\nfraction = 1.0\n",
      "t.toml", "/");
  EXPECT_EQ(t.run.strategy, "spec");  // the registry's default for target + draft
  const auto roles = t.role_models();
  ASSERT_EQ(roles.size(), 3u);
  EXPECT_EQ(roles.at("draft2"), "s");
  ASSERT_EQ(t.stages_of("target").size(), 1u);
  EXPECT_EQ(t.stages_of("target")[0]->device, "a");
  ASSERT_EQ(t.stages_of("draft").size(), 1u);  // its own tagged stage, not m's untagged one
  EXPECT_EQ(t.stages_of("draft")[0]->device, "b");
  ASSERT_EQ(t.stages_of("draft2").size(), 1u);  // added on the head node's first device
  EXPECT_EQ(t.stages_of("draft2")[0]->model, "s");
}

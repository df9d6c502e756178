// Tensor-parallel pipeline stages: a stage split over several device actors of its node gives
// the tokens of one device, for plain decoding, draft-model speculation and block drafting on
// the target's taps, in one process and across node processes.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <string>
#include <vector>

#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/topology.hpp"
#include "processes.hpp"
#include "private_dir.hpp"
#include "refdata.hpp"

using namespace specmesh;
using specmesh::test::node_options;
using specmesh::test::refdata;

namespace {

const std::string kPrompt = "Once upon a time";
constexpr int kPredict = 40;

std::string tmpdir() {
  static const std::string dir = test::private_tmpdir("specmesh-tp-stages");
  return dir;
}

std::vector<int32_t> plain(const std::string& path) {
  auto m = Model::load(path);
  Context ctx(*m, {});
  return greedy_ids(ctx, m->tokenizer().encode(kPrompt, true), kPredict, true);
}

struct StagePlan {
  std::vector<int> ranks;  // devices of each target stage (the layers are split evenly)
};

// The target's stages on nodes s0, s1, ... (one per stage, each with its ranks' devices), the
// head on its own node; `extra` adds the run's strategy and any draft role.
// `device_keys` go into every target device's table (a profile).
std::string topology(const std::string& target, const StagePlan& plan, const std::string& transport,
                     const std::string& run_extra, const std::string& extra_tables, const std::string& device_keys = "") {
  static std::atomic<int> n{0};
  const int id = n++;
  auto ep = [&](const std::string& node) {
    if (transport == "inproc") return "inproc://tp-stages-" + std::to_string(::getpid()) + "-" + std::to_string(id) + "-" + node;
    return "ipc://" + tmpdir() + "/" + std::to_string(id) + "-" + node + ".ipc";
  };
  const std::string path = tmpdir() + "/tp-" + std::to_string(id) + ".toml";
  std::ofstream f(path);
  f << "[run]\nmodel = \"target\"\nn_predict = " << kPredict << "\n" << run_extra << "\n"
    << "[models.target]\npath = \"" << target << "\"\n"
    << "[nodes.head]\nendpoint = \"" << ep("head") << "\"\nhead = true\n";
  const size_t stages = plan.ranks.size();
  for (size_t s = 0; s < stages; ++s) {
    const std::string node = "s" + std::to_string(s);
    f << "[nodes." << node << "]\nendpoint = \"" << ep(node) << "\"\n";
    for (int r = 0; r < plan.ranks[s]; ++r)
      f << "[devices." << node << "r" << r << "]\nnode = \"" << node << "\"\n" << device_keys;
  }
  f << extra_tables;
  for (size_t s = 0; s < stages; ++s) {
    const std::string node = "s" + std::to_string(s);
    f << "[[stages]]\nmodel = \"target\"\ndevice = \"" << node << "r0\"\nfraction = " << 1.0 / double(stages) << "\n";
    if (plan.ranks[s] > 1) {
      f << "tensor_parallel = [";
      for (int r = 1; r < plan.ranks[s]; ++r) f << (r > 1 ? ", " : "") << "\"" << node << "r" << r << "\"";
      f << "]\n";
    }
  }
  return path;
}

GenerationResult run(Runtime& rt) {
  return rt.generate({.prompt = kPrompt, .n_predict = kPredict, .sampling = SamplingParams{}, .ignore_eos = true});
}

TEST(TpStages, PlainDecodingOverTensorParallelStagesGivesOneDevicesTokens) {
  SPECMESH_REQUIRE_REFDATA();
  for (const char* name : {"stories260K", "stories-target-1M"}) {
    const std::string model = refdata(std::string("gguf-models/") + name + ".gguf");
    const std::vector<int32_t> want = plain(model);
    for (const auto& [transport, plan] : std::vector<std::pair<std::string, StagePlan>>{
             {"inproc", {{2}}}, {"inproc", {{4}}}, {"inproc", {{2, 3}}}, {"ipc", {{2, 2}}}}) {
      SCOPED_TRACE(std::string(name) + " " + transport + " stages of " + std::to_string(plan.ranks[0]) +
                   (plan.ranks.size() > 1 ? " and " + std::to_string(plan.ranks[1]) : "") + " devices");
      if (std::max(plan.ranks[0], plan.ranks.back()) > Model::load(model)->hparams().n_head_kv) continue;
      auto rt = Runtime::open(topology(model, plan, transport, "", ""), node_options(transport != "inproc"));
      for (int k = 0; k < 2; ++k) {
        GenerationResult r = run(*rt);
        ASSERT_TRUE(r.ok()) << r.error;
        EXPECT_EQ(r.ids, want) << "session " << k;
      }
    }
  }
}

TEST(TpStages, SpeculationOnATensorParallelTargetIsLossless) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string target = refdata("gguf-models/stories260K.gguf");
  const std::string draft = refdata("gguf-models/stories260K-draft-small.gguf");
  const std::vector<int32_t> want = plain(target);
  const std::string draft_tables = "[models.d]\npath = \"" + draft + "\"\n[devices.dd]\nnode = \"head\"\n" +
                                   "[[stages]]\nmodel = \"d\"\ndevice = \"dd\"\nfraction = 1.0\n";
  for (const char* strategy : {"spec", "pipeinfer"}) {
    SCOPED_TRACE(strategy);
    auto rt = Runtime::open(topology(target, {{2, 2}}, "inproc", "draft = \"d\"\nstrategy = \"" + std::string(strategy) + "\"",
                                     draft_tables),
                            node_options(false));
    GenerationResult r = run(*rt);
    ASSERT_TRUE(r.ok()) << r.error;
    EXPECT_EQ(r.ids, want);
    EXPECT_GT(r.metrics.accepted, 0);
  }
  // PipeInfer cancels runs the chain no longer needs, often in the middle of a forward pass:
  // one rank may stop at a layer the others are past. With the target's layers slowed down
  // (each device paced to 2 ms a layer) many runs are cancelled that way; decoding goes on.
  auto rt = Runtime::open(topology(target, {{2, 2}}, "inproc", "draft = \"d\"\nstrategy = \"pipeinfer\"", draft_tables,
                                   "profile = { layer_ms = 2.0 }\n"),
                          node_options(false));
  GenerationResult r = run(*rt);
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_GT(r.metrics.runs_cancelled, 0);
  EXPECT_EQ(r.ids, want);
}

TEST(TpStages, BlockDraftingTakesItsTapsFromTensorParallelStages) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string target = refdata("gguf-models/stories-target-1M.gguf");
  const std::string drafter = std::string(SPECMESH_SOURCE_DIR) + "/models/dflash-stories-target-1M";
  const std::vector<int32_t> want = plain(target);
  const std::string drafter_tables = "[models.dr]\npath = \"" + drafter + "\"\n[devices.dd]\nnode = \"head\"\n" +
                                     "[[stages]]\nmodel = \"dr\"\ndevice = \"dd\"\nfraction = 1.0\n";
  for (const std::string transport : {"inproc", "ipc"}) {
    SCOPED_TRACE(transport);
    auto rt = Runtime::open(topology(target, {{2, 2}}, transport, "draft = \"dr\"\nstrategy = \"dflash\"", drafter_tables),
                            node_options(transport != "inproc"));
    GenerationResult r = run(*rt);
    ASSERT_TRUE(r.ok()) << r.error;
    EXPECT_EQ(r.ids, want);
    EXPECT_GT(r.metrics.accepted, 0);
  }
}

TEST(TpStages, ADrafterStageCannotBeSplit) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string target = refdata("gguf-models/stories-target-1M.gguf");
  const std::string drafter = std::string(SPECMESH_SOURCE_DIR) + "/models/dflash-stories-target-1M";
  const std::string tables = "[models.dr]\npath = \"" + drafter + "\"\n[devices.dd]\nnode = \"head\"\n" +
                             "[devices.dd1]\nnode = \"head\"\n[[stages]]\nmodel = \"dr\"\ndevice = \"dd\"\nfraction = 1.0\n" +
                             "tensor_parallel = [\"dd1\"]\n";
  try {
    auto rt = Runtime::open(topology(target, {{1}}, "inproc", "draft = \"dr\"\nstrategy = \"dflash\"", tables),
                            node_options(false));
    ADD_FAILURE() << "accepted a split drafter";
  } catch (const std::exception& e) {
    EXPECT_NE(std::string(e.what()).find("a DFlash drafter runs on one device"), std::string::npos) << e.what();
  }
}

}  // namespace

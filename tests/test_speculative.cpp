// Speculative strategies must be lossless: at temperature 0, spec and pipeinfer emit exactly
// the tokens of plain autoregression, whatever the draft, the pipeline split or cancellation.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <map>

#include "model/context.hpp"
#include "model/generate.hpp"
#include "refdata.hpp"
#include "runtime/runtime.hpp"

using namespace specmesh;
using specmesh::test::refdata;

namespace {

const std::vector<std::string> kModels = {"stories260K-draft-tiny", "stories260K-draft-small", "stories260K",
                                          "stories-target-1M"};

std::string path_of(const std::string& m) { return refdata("gguf-models/" + m + ".gguf"); }

std::string tmpdir() {
  static std::string dir = [] {
    auto d = std::filesystem::temp_directory_path() / ("specmesh-spec-" + std::to_string(::getpid()));
    std::filesystem::create_directories(d);
    return d.string();
  }();
  return dir;
}

std::vector<int32_t> reference(const std::string& model, const std::string& prompt, int n) {
  static std::map<std::string, std::vector<int32_t>> cache;
  auto& r = cache[model + "|" + prompt + "|" + std::to_string(n)];
  if (!r.empty()) return r;
  auto m = Model::load(path_of(model));
  Context ctx(*m, {});
  GenerateParams gp;
  gp.n_predict = n;
  gp.sampling.temperature = 0;
  generate(ctx, m->tokenizer().encode(prompt, true), gp, [&](int32_t t) { r.push_back(t); return true; });
  return r;
}

// transport "inproc": every node in this process; otherwise separate processes.
std::string topology(const std::string& target, const std::string& draft, const std::string& strategy, int stages,
                     const std::string& transport, const std::string& params) {
  static std::atomic<int> n{0};
  const int id = n++;
  stages = std::min(stages, Model::load(path_of(target))->hparams().n_layer);  // draft-tiny has 2 layers
  const std::string path = tmpdir() + "/spec-" + std::to_string(id) + ".toml";
  auto ep = [&](const std::string& node) {
    if (transport == "inproc") return "inproc://spec-" + std::to_string(::getpid()) + "-" + std::to_string(id) + "-" + node;
    return "ipc://" + tmpdir() + "/" + std::to_string(id) + "-" + node + ".ipc";
  };
  std::ofstream f(path);
  f << "[run]\nmodel = \"target\"\ndraft = \"draft\"\nstrategy = \"" << strategy << "\"\nn_predict = 48\n"
    << "[run.params]\n" << params << "\n";
  f << "[models.target]\npath = \"" << path_of(target) << "\"\n[models.draft]\npath = \"" << path_of(draft) << "\"\n";
  f << "[nodes.head]\nendpoint = \"" << ep("head") << "\"\nhead = true\n";
  f << "[devices.draft]\nnode = \"head\"\n";
  for (int i = 0; i < stages; ++i)
    f << "[nodes.n" << i << "]\nendpoint = \"" << ep("n" + std::to_string(i)) << "\"\n[devices.cpu" << i << "]\nnode = \"n"
      << i << "\"\n";
  for (int i = 0; i < stages; ++i) f << "[[stages]]\nmodel = \"target\"\ndevice = \"cpu" << i << "\"\nfraction = " << 1.0 / stages << "\n";
  f << "[[stages]]\nmodel = \"draft\"\ndevice = \"draft\"\nlayers = [0, " << Model::load(path_of(draft))->hparams().n_layer
    << "]\n";
  return path;
}

RuntimeOptions opts(const std::string& transport) {
  RuntimeOptions o;
  o.spawn_nodes = transport != "inproc";
  o.specmesh_binary = SPECMESH_CLI_PATH;
  return o;
}

void expect_lossless(const std::string& strategy, const std::string& transport, int stages, const std::string& params) {
  const std::vector<std::string> prompts = {"Once upon a time", "Lily and Tom"};
  for (const auto& target : kModels) {
    for (const auto& draft : kModels) {
      if (draft == target) continue;
      auto rt = Runtime::open(topology(target, draft, strategy, stages, transport, params), opts(transport));
      for (const auto& prompt : prompts) {
        auto r = rt->generate({.prompt = prompt, .n_predict = 48});
        ASSERT_TRUE(r.ok()) << r.error;
        EXPECT_EQ(r.ids, reference(target, prompt, 48))
            << strategy << " " << draft << " -> " << target << " over " << stages << " stages (" << transport << ", "
            << params << "), prompt '" << prompt << "'";
      }
    }
  }
}

}  // namespace

TEST(Lossless, SpecSingleProcess) {
  SPECMESH_REQUIRE_REFDATA();
  expect_lossless("spec", "inproc", 1, "n_draft = 4\np_accept = 0.0");
  expect_lossless("spec", "inproc", 2, "n_draft = 3\np_accept = 0.3");
}

TEST(Lossless, PipeInferSingleProcessWithAndWithoutCancellation) {
  SPECMESH_REQUIRE_REFDATA();
  expect_lossless("pipeinfer", "inproc", 3, "cancel = 1");
  expect_lossless("pipeinfer", "inproc", 3, "cancel = 0\np_accept = 0.2");
}

TEST(Lossless, SpecAndPipeInferOverThreeProcesses) {
  SPECMESH_REQUIRE_REFDATA();
  expect_lossless("spec", "ipc", 3, "n_draft = 4");
  expect_lossless("pipeinfer", "ipc", 3, "cancel = 1");
  expect_lossless("pipeinfer", "ipc", 3, "cancel = 0");
}

// Speculative strategies must be lossless: at temperature 0, spec and pipeinfer emit exactly
// the tokens of plain autoregression, whatever the draft, the pipeline split or cancellation.
#include <gtest/gtest.h>

#include <unistd.h>

#include <algorithm>
#include <atomic>
#include <filesystem>
#include <fstream>
#include <cmath>
#include <map>
#include <nlohmann/json.hpp>
#include <sstream>

#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "chi_square.hpp"
#include "processes.hpp"
#include "private_dir.hpp"
#include "refdata.hpp"
#include "specmesh/runtime.hpp"
#include "specmesh/speculation/metrics.hpp"

using namespace specmesh;
using specmesh::test::refdata;
using specmesh::test::node_options;
using specmesh::test::chi2_critical;
using specmesh::test::homogeneity;

namespace {

const std::vector<std::string> kModels = {"stories260K-draft-tiny", "stories260K-draft-small", "stories260K",
                                          "stories-target-1M"};

std::string path_of(const std::string& m) { return refdata("gguf-models/" + m + ".gguf"); }

std::string tmpdir() {
  static const std::string dir = test::private_tmpdir("specmesh-spec");
  return dir;
}

std::vector<int32_t> reference(const std::string& model, const std::string& prompt, int n) {
  static std::map<std::string, std::vector<int32_t>> cache;
  auto& r = cache[model + "|" + prompt + "|" + std::to_string(n)];
  if (!r.empty()) return r;
  auto m = Model::load(path_of(model));
  Context ctx(*m, {});
  r = greedy_ids(ctx, m->tokenizer().encode(prompt, true), n);
  return r;
}

// transport "inproc": every node in this process; otherwise separate processes.
// `draft2`, when set, is a second draft (role draft2) on the head's device.
std::string topology(const std::string& target, const std::string& draft, const std::string& strategy, int stages,
                     const std::string& transport, const std::string& params, const std::string& draft2 = "") {
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
  if (!draft2.empty())
    f << "[run.roles]\ndraft2 = \"draft2\"\n[models.draft2]\npath = \"" << path_of(draft2) << "\"\n[[stages]]\nmodel = \"draft2\"\n"
      << "device = \"draft\"\nlayers = [0, " << Model::load(path_of(draft2))->hparams().n_layer << "]\n";
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

RuntimeOptions opts(const std::string& transport) { return node_options(transport != "inproc"); }

// With two_drafts, the second draft is the next model after the first that is not the target.
// Returns the runs the strategy cancelled in all.
int64_t expect_lossless(const std::string& strategy, const std::string& transport, int stages, const std::string& params,
                     bool two_drafts = false,
                     const std::vector<std::string>& prompts = {"Once upon a time", "Lily and Tom"},
                     const std::vector<std::string>& targets = kModels) {
  int64_t cancelled = 0;
  for (const auto& target : targets) {
    for (const auto& draft : kModels) {
      if (draft == target) continue;
      std::string draft2;
      for (size_t k = 1; two_drafts && k < kModels.size() && draft2.empty(); ++k) {
        const std::string& m = kModels[(std::find(kModels.begin(), kModels.end(), draft) - kModels.begin() + k) % kModels.size()];
        if (m != target) draft2 = m;
      }
      auto rt = Runtime::open(topology(target, draft, strategy, stages, transport, params, draft2), opts(transport));
      for (const auto& prompt : prompts) {
        auto r = rt->generate({.prompt = prompt, .n_predict = 48});
        EXPECT_TRUE(r.ok()) << r.error;
        EXPECT_EQ(r.ids, reference(target, prompt, 48))
            << strategy << " " << draft << (draft2.empty() ? "" : " + " + draft2) << " -> " << target << " over " << stages << " stages (" << transport << ", "
            << params << "), prompt '" << prompt << "'";
        cancelled += r.metrics.runs_cancelled;
        // Every strategy's timings come through one code path: the prompt's logits arrive
        // before the first token, and the paper's TTFT runs from them to the second.
        const Metrics& m = r.metrics;
        EXPECT_GT(m.prefill_ms, 0.0) << strategy;
        EXPECT_LE(m.prefill_ms, m.ttft_ms) << strategy;
        EXPECT_GT(m.ttft_after_prefill_ms, 0.0) << strategy;
        EXPECT_GE(m.prefill_ms + m.ttft_after_prefill_ms, m.ttft_ms - 1e-9) << strategy;
      }
    }
  }
  return cancelled;
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
  expect_lossless("pipeinfer", "inproc", 3, "adaptive = true");
  expect_lossless("pipeinfer", "inproc", 2, "adaptive = true\nn_parallel = 3\np_split = 0.05");
  expect_lossless("pipeinfer", "inproc", 3, "plain_runs = false\np_accept = 0.2");
  expect_lossless("pipeinfer", "inproc", 2, "plain_runs = false\ncancel = 0\nn_parallel = 3\np_split = 0.05");
}

TEST(Lossless, PipeInferTreesInProcessAndOverThreeProcesses) {
  SPECMESH_REQUIRE_REFDATA();
  expect_lossless("pipeinfer", "inproc", 3, "n_parallel = 3\np_split = 0.05");
  expect_lossless("pipeinfer", "inproc", 2, "n_parallel = 2\np_split = 0.1\ncancel = 0\np_accept = 0.2");
  expect_lossless("pipeinfer", "ipc", 3, "n_parallel = 3\np_split = 0.05");
}

TEST(Lossless, SpecAndPipeInferOverThreeProcesses) {
  SPECMESH_REQUIRE_REFDATA();
  expect_lossless("spec", "ipc", 3, "n_draft = 4");
  expect_lossless("pipeinfer", "ipc", 3, "cancel = 1");
  expect_lossless("pipeinfer", "ipc", 3, "cancel = 0");
  expect_lossless("pipeinfer", "ipc", 3, "adaptive = true");
  expect_lossless("pipeinfer", "ipc", 3, "plain_runs = false");
}

// `draft = "m"` with `model = "m"`: one model entry serves both roles, each with a pipeline
// and KV cache of its own (the draft on the stages tagged with its role, or else on the
// model's untagged stages, or else on a stage added for it), as two entries of one file do.
TEST(Lossless, DraftMayNameTheTargetsOwnModelEntry) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string model = "stories-target-1M";
  for (const std::string strategy : {"spec", "pipeinfer"}) {
    for (const std::string transport : {"inproc", "ipc"}) {
      for (const std::string draft_stage : {"", "[[stages]]\nrole = \"draft\"\ndevice = \"draft\"\nfraction = 1.0\n"}) {
        static int n = 0;
        const std::string id = "same-" + std::to_string(n++);
        auto ep = [&](const std::string& node) {
          return transport == "inproc" ? "inproc://" + id + "-" + std::to_string(::getpid()) + "-" + node
                                       : "ipc://" + tmpdir() + "/" + id + "-" + node + ".ipc";
        };
        const std::string path = tmpdir() + "/" + id + ".toml";
        std::ofstream(path) << "[run]\nmodel = \"m\"\ndraft = \"m\"\nstrategy = \"" << strategy << "\"\n"
                            << "[models.m]\npath = \"" << path_of(model) << "\"\n"
                            << "[nodes.head]\nendpoint = \"" << ep("head") << "\"\nhead = true\n[devices.draft]\nnode = \"head\"\n"
                            << "[nodes.n0]\nendpoint = \"" << ep("n0") << "\"\n[devices.cpu0]\nnode = \"n0\"\n"
                            << "[nodes.n1]\nendpoint = \"" << ep("n1") << "\"\n[devices.cpu1]\nnode = \"n1\"\n"
                            << "[[stages]]\nmodel = \"m\"\ndevice = \"cpu0\"\nfraction = 0.5\n"
                            << "[[stages]]\nmodel = \"m\"\ndevice = \"cpu1\"\nfraction = 0.5\n" << draft_stage;
        SCOPED_TRACE(strategy + " over " + transport + (draft_stage.empty() ? ", draft on the target's stages" : ", draft on its own stage"));
        auto rt = Runtime::open(path, opts(transport));
        auto r = rt->generate({.prompt = "Once upon a time", .n_predict = 48});
        ASSERT_TRUE(r.ok()) << r.error;
        EXPECT_EQ(r.ids, reference(model, "Once upon a time", 48));
        if (strategy == "spec") EXPECT_EQ(r.metrics.accepted, r.metrics.drafted) << "a draft that is the target agrees";
      }
    }
  }
  // Untagged stages of the shared model for the draft only: the error says why they clash.
  const std::string path = tmpdir() + "/same-clash.toml";
  std::ofstream(path) << "[run]\nmodel = \"m\"\ndraft = \"m\"\n[models.m]\npath = \"" << path_of(model) << "\"\n"
                      << "[devices.a]\n[devices.b]\n[[stages]]\ndevice = \"a\"\nfraction = 1.0\n"
                      << "[[stages]]\nmodel = \"m\"\ndevice = \"b\"\nfraction = 1.0\n";
  try {
    Runtime rt(Topology::load(path));
    FAIL() << "expected an error";
  } catch (const ConfigError& e) {
    EXPECT_NE(std::string(e.what()).find("(roles 'draft' and 'target' both run model 'm' and so share its untagged stages; "
                                         "give one stages of its own with role = \"draft\")"),
              std::string::npos)
        << e.what();
  }
}

TEST(Lossless, TreeSpecSingleProcess) {
  SPECMESH_REQUIRE_REFDATA();
  expect_lossless("spec", "inproc", 1, "tree = \"1,1,3,1,1,1\"\np_accept = 0.0");
  expect_lossless("spec", "inproc", 2, "tree = [2, 2, 2]\np_accept = 0.2\ntree_nodes = 14");
}

TEST(Lossless, TreeSpecMergesTwoDrafts) {
  SPECMESH_REQUIRE_REFDATA();
  expect_lossless("spec", "inproc", 1, "n_draft = 4\np_accept = 0.0", true);
  expect_lossless("spec", "inproc", 2, "tree = \"1,2,1,1\"\np_accept = 0.1", true);
}

TEST(Lossless, TreeSpecOverThreeProcesses) {
  SPECMESH_REQUIRE_REFDATA();
  expect_lossless("spec", "ipc", 3, "tree = \"1,1,3,1,1\"\np_accept = 0.0");
  expect_lossless("spec", "ipc", 3, "tree = \"2,1,1\"\np_accept = 0.0", true);
}

// TriForce: the target over a retrieval cache of 16 entries (chunks of 4) drafts for itself
// over its full cache, with forced rebuilds every few tokens; the middle level's views live on
// the stages, so over three processes each stage builds its own layers' part.
const std::string kTriForce = "budget = 16\nchunk = 4\ngamma1 = 2\ngamma2 = 4\nsink = 4\nwindow = 24\n";
const std::vector<std::string> kLongPrompts = {
    "Once upon a time, there was a little girl named Lily. She loved to play outside in the park with her dog Max. "
    "One day, Lily and Max found a big red ball under a tree.",
    "Lily and Tom"};

TEST(Lossless, TriForceSingleProcess) {
  SPECMESH_REQUIRE_REFDATA();
  expect_lossless("triforce", "inproc", 1, kTriForce, false, kLongPrompts);
  expect_lossless("triforce", "inproc", 2, kTriForce + "rebuild_every = 8\nrebuild_below = 0.9", false, kLongPrompts,
                  {"stories260K", "stories-target-1M"});
  for (const std::string ablation : {"middle = 2", "middle = 0", "use_draft = false"})
    expect_lossless("triforce", "inproc", 1, kTriForce + ablation, false, kLongPrompts, {"stories260K", "stories-target-1M"});
}

TEST(Lossless, TriForceOverThreeProcesses) {
  SPECMESH_REQUIRE_REFDATA();
  // The lower levels run ahead while the full cache verifies; rejections cancel their runs
  // across the stage processes.
  EXPECT_GT(expect_lossless("triforce", "ipc", 3, kTriForce, false, kLongPrompts, {"stories260K", "stories-target-1M"}), 0);
}

namespace {

// Per-position token counts of `runs` sampled generations of `n` tokens at temperature 1.
std::vector<std::map<int32_t, int>> sample_counts(const std::string& strategy, int runs, int n,
                                                  const std::string& extra = "") {
  const std::string target = "stories260K", draft = "stories260K-draft-tiny";
  // ar takes no parameters; it runs on the same topology, the draft pipeline idle.
  const std::string params = strategy == "ar"          ? ""
                             : strategy == "pipeinfer" ? "max_micro_batch = 3\np_accept = 0.0\n" + extra
                             : strategy == "triforce"  ? kTriForce + extra
                                                       : "n_draft = 3\np_accept = 0.0\n" + extra;
  auto rt = Runtime::open(topology(target, draft, strategy, 1, "inproc", params), opts("inproc"));
  std::vector<std::map<int32_t, int>> counts(n);
  for (int i = 0; i < runs; ++i) {
    SamplerParams sp{.temperature = 1.0f, .seed = uint64_t(1000 + i)};
    auto r = rt->generate({.prompt = "Once upon a time", .n_predict = n, .sampling = sp, .ignore_eos = true});
    EXPECT_TRUE(r.ok()) << r.error;
    for (int k = 0; k < n && k < int(r.ids.size()); ++k) ++counts[k][r.ids[k]];
  }
  return counts;
}

}  // namespace

// Stochastic speculative decoding samples from the target's distribution: the tokens it emits
// at each position are distributed like plain sampling's.
TEST(Stochastic, SpecTokenFrequenciesMatchAutoregression) {
  SPECMESH_REQUIRE_REFDATA();
  const int runs = 600, n = 4;
  auto ar = sample_counts("ar", runs, n);
  auto spec = sample_counts("spec", runs, n);
  for (int k = 0; k < n; ++k) {
    auto [chi2, dof] = homogeneity(ar[k], spec[k]);
    ASSERT_GT(dof, 0);
    EXPECT_LT(chi2, chi2_critical(dof)) << "position " << k << ": chi2 " << chi2 << " with " << dof << " dof";
  }
  // The positions after the first really vary (a test on constant outputs would prove nothing).
  EXPECT_GT(ar[1].size(), 3u);
}

// Tree speculation samples from the target's distribution too: children drawn without
// replacement, verified with the residual on both sides.
TEST(Stochastic, TreeSpecTokenFrequenciesMatchAutoregression) {
  SPECMESH_REQUIRE_REFDATA();
  const int runs = 600, n = 4;
  auto ar = sample_counts("ar", runs, n);
  auto tree = sample_counts("spec", runs, n, "tree = \"3,2,1\"");
  for (int k = 0; k < n; ++k) {
    auto [chi2, dof] = homogeneity(ar[k], tree[k]);
    ASSERT_GT(dof, 0);
    EXPECT_LT(chi2, chi2_critical(dof)) << "position " << k << ": chi2 " << chi2 << " with " << dof << " dof";
  }
}

// PipeInfer at temperature > 0 samples each token from the target row that carries the accepted
// path and goes on only where a speculative row holds the sampled token: lossless by
// construction, with one branch and with three, and with corrected tokens left to the next
// speculative run (no plain runs).
TEST(Stochastic, PipeInferTokenFrequenciesMatchAutoregression) {
  SPECMESH_REQUIRE_REFDATA();
  const int runs = 600, n = 4;
  auto ar = sample_counts("ar", runs, n);
  for (const std::string extra : {"", "n_parallel = 3\np_split = 0.05", "plain_runs = false"}) {
    auto pipe = sample_counts("pipeinfer", runs, n, extra);
    for (int k = 0; k < n; ++k) {
      auto [chi2, dof] = homogeneity(ar[k], pipe[k]);
      ASSERT_GT(dof, 0);
      EXPECT_LT(chi2, chi2_critical(dof)) << extra << " position " << k << ": chi2 " << chi2 << " with " << dof << " dof";
    }
  }
}

// TriForce samples at both levels with the exact residual: per position, its tokens are
// distributed like plain sampling's, with the retrieval cache and with StreamingLLM's.
TEST(Stochastic, TriForceTokenFrequenciesMatchAutoregression) {
  SPECMESH_REQUIRE_REFDATA();
  const int runs = 600, n = 4;
  auto ar = sample_counts("ar", runs, n);
  for (const std::string extra : {"", "middle = 2"}) {
    auto tri = sample_counts("triforce", runs, n, extra);
    for (int k = 0; k < n; ++k) {
      auto [chi2, dof] = homogeneity(ar[k], tri[k]);
      ASSERT_GT(dof, 0);
      EXPECT_LT(chi2, chi2_critical(dof)) << extra << " position " << k << ": chi2 " << chi2 << " with " << dof << " dof";
    }
  }
}

// Early cancellation removes work: with slow target stages and a weak draft, fewer stage
// layers are computed with cancellation on, for the same (lossless) output.
TEST(Cancellation, RemovesStageWork) {
  SPECMESH_REQUIRE_REFDATA();
  auto layers = [&](bool cancel) {
    std::string path = topology("stories-target-1M", "stories260K-draft-tiny", "pipeinfer", 6, "inproc",
                                std::string("cancel = ") + (cancel ? "1" : "0") + "\np_accept = 0.0\nmax_runs = 8");
    // Slow target devices (2 ms per layer) so speculative runs are still in the pipeline when
    // their verdict is known.
    std::string text;
    {
      std::ifstream in(path);
      std::stringstream ss;
      ss << in.rdbuf();
      text = ss.str();
    }
    for (int i = 0; i < 6; ++i) {
      const std::string dev = "[devices.cpu" + std::to_string(i) + "]\nnode = \"n" + std::to_string(i) + "\"\n";
      text.replace(text.find(dev), dev.size(), dev + "profile = { layer_ms = 2.0 }\n");
    }
    std::ofstream(path) << text;
    auto rt = Runtime::open(path, opts("inproc"));
    auto r = rt->generate({.prompt = "Once upon a time", .n_predict = 48});
    EXPECT_TRUE(r.ok()) << r.error;
    EXPECT_EQ(r.ids, reference("stories-target-1M", "Once upon a time", 48));
    uint64_t total = 0;
    for (const auto& s : rt->stage_counters())
      if (s.pipeline == "target") total += s.layers_computed;
    if (cancel) EXPECT_GT(r.metrics.runs_cancelled, 0);
    std::printf("cancel=%d: %s\n", int(cancel), SpecMetrics(r.metrics).to_json().dump().c_str());
    return total;
  };
  const uint64_t with = layers(true), without = layers(false);
  std::printf("stage-layers computed: %llu with cancellation, %llu without\n", (unsigned long long)with,
              (unsigned long long)without);
  EXPECT_LT(with, without);
}

// The dflash strategy end to end: the target's stages tap the drafter's layers and send them to
// the drafter's stage, in process and with the target over stage processes. Lossless at
// temperature 0 against plain decoding on stories-target-1M with the committed trained drafter
// and on a synthetic Qwen3 (GQA) with a random drafter; at temperature 1 distributed per
// position like plain sampling; bad drafters refused with the file and the defect.
#include <gtest/gtest.h>

#include <unistd.h>

#include <atomic>
#include <filesystem>
#include <fstream>
#include <numeric>
#include <tuple>

#include "chi_square.hpp"
#include "private_dir.hpp"
#include "processes.hpp"
#include "refdata.hpp"
#include "shifting_reference.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/dflash_synthetic.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/model/synthetic.hpp"
#include "specmesh/runtime.hpp"

using namespace specmesh;
using namespace specmesh::test;

namespace {

const std::string kTrained = std::string(SPECMESH_SOURCE_DIR) + "/models/dflash-stories-target-1M";
const std::vector<std::string> kPrompts = {"Once upon a time", "Lily and Tom went to the park", "The little dog"};

std::string stories_target() { return refdata("gguf-models/stories-target-1M.gguf"); }

// The target over `stages` stages on nodes n0.. (processes unless inproc), the drafter on a
// device of the head node (without one for strategy ar).
std::string topology(const std::string& dir, const std::string& target, const std::string& drafter, int stages,
                     const std::string& transport, const std::string& params, int n_predict,
                     const std::string& strategy = "dflash") {
  const bool draft = strategy == "dflash";
  static std::atomic<int> n{0};
  const int id = n++;
  const std::string path = dir + "/dflash-" + std::to_string(id) + ".toml";
  auto ep = [&](const std::string& node) {
    if (transport == "inproc") return "inproc://dflash-" + std::to_string(::getpid()) + "-" + std::to_string(id) + "-" + node;
    return "ipc://" + dir + "/" + std::to_string(id) + "-" + node + ".ipc";
  };
  std::ofstream f(path);
  f << "[run]\nmodel = \"target\"\n" << (draft ? "draft = \"drafter\"\n" : "") << "strategy = \"" << strategy
    << "\"\nn_predict = " << n_predict << "\n[run.params]\n" << params << "\n";
  f << "[models.target]\npath = \"" << target << "\"\n";
  if (draft) f << "[models.drafter]\npath = \"" << drafter << "\"\n";
  f << "[nodes.head]\nendpoint = \"" << ep("head") << "\"\nhead = true\n[devices.drafter]\nnode = \"head\"\n";
  for (int i = 0; i < stages; ++i)
    f << "[nodes.n" << i << "]\nendpoint = \"" << ep("n" + std::to_string(i)) << "\"\n[devices.cpu" << i << "]\nnode = \"n"
      << i << "\"\n";
  for (int i = 0; i < stages; ++i) f << "[[stages]]\nmodel = \"target\"\ndevice = \"cpu" << i << "\"\nfraction = " << 1.0 / stages << "\n";
  if (draft) f << "[[stages]]\nmodel = \"drafter\"\ndevice = \"drafter\"\nfraction = 1.0\n";
  return path;
}

// Replaces the first `from` in the file at `path` with `to` (a variation of a written topology).
void replace_in_file(const std::string& path, const std::string& from, const std::string& to) {
  std::string text;
  {
    std::ifstream in(path);
    text.assign(std::istreambuf_iterator<char>(in), {});
  }
  const size_t at = text.find(from);
  ASSERT_NE(at, std::string::npos) << "'" << from << "' is not in " << path;
  text.replace(at, from.size(), to);
  std::ofstream(path) << text;
}

std::vector<int32_t> greedy(const std::string& model_path, const std::vector<int32_t>& prompt, int n) {
  auto m = Model::load(model_path);
  Context ctx(*m, {});
  return greedy_ids(ctx, prompt, n, true);
}

// Generates every prompt at temperature 0 and checks the ids are plain decoding's; returns the
// accepted-length histogram over all of them.
// `guesses`, when given, gets the async guesses made and used.
std::vector<int64_t> expect_lossless(const std::string& target, const std::string& drafter, int stages,
                                     const std::string& transport, const std::string& params,
                                     const std::vector<std::string>& prompts, int n = 48,
                                     std::pair<int64_t, int64_t>* guesses = nullptr) {
  ScopedTempDir dir("dflash-rt");
  std::filesystem::permissions(dir.path, std::filesystem::perms::owner_all);
  auto rt = Runtime::open(topology(dir.path, target, drafter, stages, transport, params, n), node_options(transport != "inproc"));
  std::vector<int64_t> hist;
  for (const std::string& prompt : prompts) {
    auto r = rt->generate({.prompt = prompt, .n_predict = n, .sampling = SamplerParams{.temperature = 0}, .ignore_eos = true});
    EXPECT_TRUE(r.ok()) << r.error;
    EXPECT_EQ(r.ids, greedy(target, r.prompt_ids, n))
        << "dflash over " << stages << " stages (" << transport << ", " << params << "), prompt '" << prompt << "'";
    EXPECT_EQ(r.metrics.strategy, "dflash");
    EXPECT_GT(r.metrics.verifications, 0);
    EXPECT_EQ(std::accumulate(r.metrics.accepted_hist.begin(), r.metrics.accepted_hist.end(), int64_t(0)),
              r.metrics.verifications);
    if (guesses) guesses->first += r.metrics.speculative_drafts, guesses->second += r.metrics.speculative_drafts_used;
    hist.resize(std::max(hist.size(), r.metrics.accepted_hist.size()), 0);
    for (size_t d = 0; d < r.metrics.accepted_hist.size(); ++d) hist[d] += r.metrics.accepted_hist[d];
  }
  return hist;
}

double tau(const std::vector<int64_t>& hist) {
  int64_t steps = 0, tokens = 0;
  for (size_t d = 0; d < hist.size(); ++d) steps += hist[d], tokens += hist[d] * int64_t(d + 1);
  return steps ? double(tokens) / double(steps) : 0.0;
}

void print_hist(const std::string& what, const std::vector<int64_t>& hist) {
  std::printf("%s: tau %.3f, accepted-length histogram", what.c_str(), tau(hist));
  for (int64_t c : hist) std::printf(" %lld", static_cast<long long>(c));
  std::printf("\n");
}

}  // namespace

TEST(DFlashRuntime, LosslessWithTheTrainedDrafterInProcessAndOverThreeProcesses) {
  SPECMESH_REQUIRE_REFDATA();
  const auto one = expect_lossless(stories_target(), kTrained, 1, "inproc", "", kPrompts);
  print_hist("trained drafter, 1 stage in process", one);
  EXPECT_GT(tau(one), 1.2);  // the trained drafter is right more than by chance
  expect_lossless(stories_target(), kTrained, 2, "inproc", "block = 4\ntaps = 16\nwindow = 8", {kPrompts[0]});
  const auto three = expect_lossless(stories_target(), kTrained, 3, "ipc", "", kPrompts);
  print_hist("trained drafter, 3 stage processes", three);
  EXPECT_EQ(three, one);  // the same proposals wherever the stages run
  // Drafting the next block while the target verifies.
  std::pair<int64_t, int64_t> guesses{0, 0};
  print_hist("async, 3 stage processes", expect_lossless(stories_target(), kTrained, 3, "ipc", "async = 1", kPrompts, 48, &guesses));
  std::printf("async over 3 stage processes: %lld of %lld guessed drafts used\n", static_cast<long long>(guesses.second),
              static_cast<long long>(guesses.first));
  EXPECT_GT(guesses.first, 0);
  EXPECT_GT(guesses.second, 0);
}

TEST(DFlashRuntime, LosslessOnASyntheticQwen3WithARandomDrafter) {
  ScopedTempDir dir("dflash-qwen3");
  SyntheticSpec spec = *synthetic_preset("tiny-qwen3");
  spec.seed = 5;
  spec.n_threads = 1;
  const std::string target = dir.path + "/qwen3.gguf", drafter = dir.path + "/drafter";
  write_synthetic_model(spec, target);
  DFlashConfig c = dflash_config_for(*Model::load(target), 2, 2, 6);
  write_random_dflash_drafter(c, drafter, 11);
  expect_lossless(target, drafter, 1, "inproc", "", {"hello world", "a b c"}, 32);
  expect_lossless(target, drafter, 2, "ipc", "block = 3", {"hello world"}, 32);
}

// A full context shifts in the target's stages and in the drafter's cache (its keys re-rotated,
// its taps taken by row, not position), and decoding goes on as llama.cpp's loop does.
TEST(DFlashRuntime, ContextShiftGoesOnAsPlainDecodingDoes) {
  SPECMESH_REQUIRE_REFDATA();
  ScopedTempDir dir("dflash-shift");
  std::filesystem::permissions(dir.path, std::filesystem::perms::owner_all);
  const int ctx = 64, n = 150;
  auto m = Model::load(stories_target());
  for (const auto& [stages, transport, params] :
       std::vector<std::tuple<int, std::string, std::string>>{{1, "inproc", ""}, {1, "inproc", "async = 1\nwindow = 16"},
                                                              {3, "ipc", "async = 1"}}) {
    std::string path = topology(dir.path, stories_target(), kTrained, stages, transport, params, n);
    replace_in_file(path, "[run]\n", "[run]\nn_ctx = " + std::to_string(ctx) + "\n");
    auto rt = Runtime::open(path, node_options(transport != "inproc"));
    for (int n_keep : {0, 4}) {
      GenerationResult r = rt->generate({.prompt = kPrompts[1], .n_predict = n, .sampling = SamplerParams{.temperature = 0},
                                         .ignore_eos = true, .context_shift = true, .n_keep = n_keep});
      ASSERT_TRUE(r.ok()) << r.error;
      EXPECT_EQ(r.ids, shifting_reference(*m, ctx, r.prompt_ids, n, n_keep))
          << stages << " stages (" << transport << ", " << params << "), n_keep " << n_keep;
      EXPECT_GE(r.context_shifts, 2);
      EXPECT_GT(r.metrics.tokens_per_verification(), 1.5);  // the drafter still drafts well after the shifts
    }
  }
}

// At temperature 1 dflash draws each token from the target's row in plain decoding's order, so
// per position its tokens are distributed like plain sampling's.
TEST(DFlashRuntime, TokenFrequenciesMatchAutoregressionAtTemperatureOne) {
  SPECMESH_REQUIRE_REFDATA();
  ScopedTempDir dir("dflash-hot");
  const int runs = 400, n = 4;
  auto counts = [&](const std::string& strategy) {
    auto rt = Runtime::open(topology(dir.path, stories_target(), kTrained, 1, "inproc", "", n, strategy), node_options(false));
    std::vector<std::map<int32_t, int>> out(n);
    for (int i = 0; i < runs; ++i) {
      auto r = rt->generate({.prompt = "Once upon a time", .n_predict = n,
                             .sampling = SamplerParams{.temperature = 1.0f, .seed = uint64_t(5000 + i * 7919)},
                             .ignore_eos = true});
      EXPECT_TRUE(r.ok()) << r.error;
      for (int k = 0; k < n && k < int(r.ids.size()); ++k) ++out[size_t(k)][r.ids[size_t(k)]];
    }
    return out;
  };
  const auto ar = counts("ar"), dflash = counts("dflash");
  for (int k = 0; k < n; ++k) {
    auto [chi2, dof] = homogeneity(ar[size_t(k)], dflash[size_t(k)]);
    ASSERT_GT(dof, 0);
    EXPECT_LT(chi2, chi2_critical(dof)) << "position " << k << ": chi2 " << chi2 << " with " << dof << " dof";
  }
  EXPECT_GT(ar[1].size(), 3u);  // the positions after the first really vary
}

TEST(DFlashRuntime, ABadDrafterIsRefusedWithTheFileAndTheDefect) {
  SPECMESH_REQUIRE_REFDATA();
  ScopedTempDir dir("dflash-bad");
  auto target = Model::load(stories_target());
  auto open_with = [&](const DFlashConfig& c) -> std::string {
    const std::string d = dir.path + "/d" + std::to_string(c.target_layer_ids.back()) + "-" + std::to_string(c.mask_token_id);
    write_random_dflash_drafter(c, d, 3);
    try {
      Runtime::open(topology(dir.path, stories_target(), d, 1, "inproc", "", 8), node_options(false));
    } catch (const std::exception& e) {
      return e.what();
    }
    return "(opened)";
  };
  DFlashConfig c = dflash_config_for(*target, 1, 2, 4);
  c.target_layer_ids = {1, target->hparams().n_layer};  // beyond the target
  std::string why = open_with(c);
  EXPECT_NE(why.find("config.json"), std::string::npos) << why;
  EXPECT_NE(why.find("not a layer of the"), std::string::npos) << why;
  EXPECT_NE(why.find("run.draft"), std::string::npos) << why;
  c = dflash_config_for(*target, 1, 2, 4);
  c.mask_token_id = target->hparams().n_vocab + 5;  // neither the vocabulary's nor its own
  why = open_with(c);
  EXPECT_NE(why.find("mask_token_id"), std::string::npos) << why;
  // A drafter's directory as another strategy's draft model.
  std::string path = topology(dir.path, stories_target(), kTrained, 1, "inproc", "", 8);
  replace_in_file(path, "strategy = \"dflash\"", "strategy = \"spec\"");
  try {
    Runtime::open(path, node_options(false));
    ADD_FAILURE() << "spec opened with a drafter directory as its draft";
  } catch (const std::exception& e) {
    why = e.what();
    EXPECT_NE(why.find("run.draft"), std::string::npos) << why;
    EXPECT_NE(why.find("a block drafter's directory"), std::string::npos) << why;
  }
}

// A setup built for dflash runs a strategy that does not draft with its drafter (`specmesh run
// dflash.toml --strategy ar`) without building the drafter's stage, in process and over stage
// processes; per request, a strategy that would take the drafter for a draft model is refused.
TEST(DFlashRuntime, ADrafterSetupRunsOtherStrategiesWithoutTheDrafter) {
  SPECMESH_REQUIRE_REFDATA();
  ScopedTempDir dir("dflash-other");
  std::filesystem::permissions(dir.path, std::filesystem::perms::owner_all);
  const int n = 24;
  for (const auto& [stages, transport] : std::vector<std::pair<int, std::string>>{{1, "inproc"}, {3, "ipc"}}) {
    std::string path = topology(dir.path, stories_target(), kTrained, stages, transport, "", n);
    replace_in_file(path, "strategy = \"dflash\"", "strategy = \"ar\"");
    auto rt = Runtime::open(path, node_options(transport != "inproc"));
    EXPECT_EQ(rt->topology().roles(), (std::set<std::string>{"target"}));
    GenerationResult r = rt->generate({.prompt = kPrompts[0], .n_predict = n, .sampling = SamplerParams{.temperature = 0}, .ignore_eos = true});
    ASSERT_TRUE(r.ok()) << r.error;
    EXPECT_EQ(r.metrics.strategy, "ar");
    EXPECT_EQ(r.ids, greedy(stories_target(), r.prompt_ids, n)) << stages << " stages (" << transport << ")";
    // dflash asked for per request: the setup does not build its drafter.
    r = rt->generate({.prompt = kPrompts[0], .n_predict = n, .sampling = SamplerParams{.temperature = 0}, .strategy = "dflash"});
    EXPECT_FALSE(r.ok());
    EXPECT_NE(r.error.find("does not build"), std::string::npos) << r.error;
  }
  // Built for dflash (the default for a drafter directory as the draft): ar runs on its target's
  // stages; spec would take the drafter for its draft.
  std::string path = topology(dir.path, stories_target(), kTrained, 1, "inproc", "", n);
  replace_in_file(path, "strategy = \"dflash\"\n", "");
  auto rt = Runtime::open(path, node_options(false));
  EXPECT_EQ(rt->topology().run.strategy, "dflash");
  GenerationResult r = rt->generate({.prompt = kPrompts[1], .n_predict = n, .sampling = SamplerParams{.temperature = 0},
                                     .ignore_eos = true, .strategy = "ar"});
  ASSERT_TRUE(r.ok()) << r.error;
  EXPECT_EQ(r.metrics.strategy, "ar");
  EXPECT_EQ(r.ids, greedy(stories_target(), r.prompt_ids, n));
  r = rt->generate({.prompt = kPrompts[1], .n_predict = n, .sampling = SamplerParams{.temperature = 0}, .strategy = "spec"});
  EXPECT_FALSE(r.ok());
  EXPECT_NE(r.error.find("block drafter"), std::string::npos) << r.error;
}

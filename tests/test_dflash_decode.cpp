// DFlash decoding in one process: lossless against plain decoding on a synthetic Qwen3 target
// (GQA, q_dim != n_embd) and on stories-target-1M, each with a random drafter, token for token at
// temperature 0 and at temperature 1 with the same seed (every emitted token is one draw of the
// target's sampler, in the same order as plain decoding draws them).
#include <gtest/gtest.h>

#include <numeric>

#include "private_dir.hpp"
#include "refdata.hpp"
#include "specmesh/kernels/thread_pool.hpp"
#include "specmesh/model/dflash_synthetic.hpp"
#include "specmesh/speculation/dflash_decode.hpp"
#include "synthetic_model.hpp"

using namespace specmesh;

namespace {

struct DraftRun {
  std::vector<int32_t> ids;
  DFlashStats stats;
};

DraftRun run_dflash(const Model& target, const DFlashDrafter& d, const std::vector<int32_t>& prompt, int n, int block,
               float temperature, uint64_t seed) {
  ContextParams cp;
  cp.n_ctx = 512;
  Context ctx(target, dflash_target_params(d, cp));
  ThreadPool pool(1);
  DFlashParams p;
  p.gen.n_predict = n;
  p.gen.ignore_eos = true;
  p.gen.sampling.temperature = temperature;
  p.gen.sampling.seed = seed;
  p.block = block;
  DraftRun r;
  r.stats = dflash_generate(ctx, d, pool, prompt, p, [&](int32_t t) {
    r.ids.push_back(t);
    return true;
  });
  return r;
}

std::vector<int32_t> run_ar(const Model& target, const std::vector<int32_t>& prompt, int n, float temperature,
                            uint64_t seed) {
  ContextParams cp;
  cp.n_ctx = 512;
  Context ctx(target, cp);
  GenerateParams gp;
  gp.n_predict = n;
  gp.ignore_eos = true;
  gp.sampling.temperature = temperature;
  gp.sampling.seed = seed;
  std::vector<int32_t> ids;
  generate(ctx, prompt, gp, [&](int32_t t) {
    ids.push_back(t);
    return true;
  });
  return ids;
}

// Every emitted token after the first comes from a step: sum of t * hist[t] over the steps.
void expect_consistent(const DraftRun& r, int block) {
  int64_t emitted = 0;
  for (size_t t = 0; t < r.stats.tau_hist.size(); ++t) emitted += int64_t(t) * r.stats.tau_hist[t];
  EXPECT_EQ(emitted + 1, int64_t(r.ids.size()));
  EXPECT_EQ(std::accumulate(r.stats.tau_hist.begin(), r.stats.tau_hist.end(), int64_t(0)), r.stats.steps);
  EXPECT_EQ(r.stats.tau_hist.size(), size_t(block) + 1);
  EXPECT_GE(r.stats.tau(), 1.0);
}

}  // namespace

TEST(DFlashDecode, LosslessOnSyntheticQwen3WithARandomDrafter) {
  auto target = specmesh::test::synthetic_model("tiny-qwen3", 5);
  specmesh::test::ScopedTempDir dir("dflash-rand");
  DFlashConfig c = dflash_config_for(*target, 2, 2, 6);
  c.target_layer_ids = {1, 3};
  write_random_dflash_drafter(c, dir.path, 11);
  auto d = DFlashDrafter::load(dir.path);
  d->check_target(*target);
  const std::vector<int32_t> prompt = {1, 300, 17, 42, 99};
  for (int block : {6, 3}) {
    const DraftRun r = run_dflash(*target, *d, prompt, 40, block, 0.0f, 0);
    EXPECT_EQ(r.ids, run_ar(*target, prompt, 40, 0.0f, 0)) << "block " << block;
    expect_consistent(r, block);
  }
  const DraftRun hot = run_dflash(*target, *d, prompt, 40, 6, 1.0f, 1234);
  EXPECT_EQ(hot.ids, run_ar(*target, prompt, 40, 1.0f, 1234));
  expect_consistent(hot, 6);
}

TEST(DFlashDecode, LosslessOnStoriesTarget) {
  SPECMESH_REQUIRE_REFDATA();
  auto target = Model::load(specmesh::test::refdata("gguf-models/stories-target-1M.gguf"));
  specmesh::test::ScopedTempDir dir("dflash-stories");
  const DFlashConfig c = dflash_config_for(*target, 1, 2, 8);
  write_random_dflash_drafter(c, dir.path, 3);
  auto d = DFlashDrafter::load(dir.path);
  d->check_target(*target);
  const std::vector<int32_t> prompt = target->tokenizer().encode_prompt("Once upon a time");
  const DraftRun r = run_dflash(*target, *d, prompt, 60, 8, 0.0f, 0);
  EXPECT_EQ(r.ids, run_ar(*target, prompt, 60, 0.0f, 0));
  expect_consistent(r, 8);
  std::printf("random drafter on stories-target-1M, block 8: tau %.3f over %lld steps\n", r.stats.tau(),
              (long long)r.stats.steps);
  const DraftRun hot = run_dflash(*target, *d, prompt, 60, 8, 1.0f, 77);
  EXPECT_EQ(hot.ids, run_ar(*target, prompt, 60, 1.0f, 77));
}

TEST(DFlashDecode, RefusesAContextWithoutTheTaps) {
  auto target = specmesh::test::synthetic_model("tiny-qwen3", 5);
  specmesh::test::ScopedTempDir dir("dflash-notaps");
  write_random_dflash_drafter(dflash_config_for(*target, 1, 1, 4), dir.path, 1);
  auto d = DFlashDrafter::load(dir.path);
  ContextParams cp;
  cp.n_ctx = 64;
  Context ctx(*target, cp);
  ThreadPool pool(1);
  DFlashParams p;
  p.gen.n_predict = 4;
  EXPECT_THROW(dflash_generate(ctx, *d, pool, {1, 2}, p, [](int32_t) { return true; }), std::invalid_argument);
  p.gen.n_predict = 100;
  EXPECT_THROW(dflash_generate(ctx, *d, pool, {1, 2}, p, [](int32_t) { return true; }), std::invalid_argument);
}

// The committed drafter trained for stories-target-1M (models/dflash-stories-target-1M, recipe in
// its README): lossless, and its acceptance at block size 8 over 20 prompts (tau = mean tokens a
// step emits, the mean accepted length plus one), printed with its histogram.
TEST(DFlashDecode, TrainedStoriesDrafter) {
  SPECMESH_REQUIRE_REFDATA();
  auto target = Model::load(specmesh::test::refdata("gguf-models/stories-target-1M.gguf"));
  auto d = DFlashDrafter::load(std::string(SPECMESH_SOURCE_DIR) + "/models/dflash-stories-target-1M");
  d->check_target(*target);
  EXPECT_NE(d->mask_embedding(), nullptr);  // the stories vocabulary has no spare row
  const char* starts[] = {"Once upon a time", "One day", "Tom and Sue", "The little dog", "Lily wanted",
                          "There was a big", "The sun was", "Ben had a red", "A girl named Mia", "The cat sat",
                          "Mom said", "In the park", "The boy found", "Anna and her mom", "It was a rainy day",
                          "The bird flew", "Max liked to", "Sam saw a", "The old man", "Once there was a bunny"};
  int64_t steps = 0, accepted = 0;
  std::vector<int64_t> hist(9, 0);
  for (const char* s : starts) {
    const std::vector<int32_t> prompt = target->tokenizer().encode_prompt(s);
    const DraftRun r = run_dflash(*target, *d, prompt, 128, 8, 0.0f, 0);
    ASSERT_EQ(r.ids, run_ar(*target, prompt, 128, 0.0f, 0)) << s;
    expect_consistent(r, 8);
    steps += r.stats.steps;
    accepted += r.stats.accepted;
    for (size_t t = 0; t < hist.size(); ++t) hist[t] += r.stats.tau_hist[t];
  }
  const double tau = double(accepted + steps) / double(steps);
  std::string h;
  for (size_t t = 1; t < hist.size(); ++t) h += " " + std::to_string(t) + ":" + std::to_string(hist[t]);
  std::printf("trained drafter, block 8, 20 prompts x 128 tokens: tau %.3f over %lld steps; histogram%s\n", tau,
              (long long)steps, h.c_str());
  // A random drafter stays at tau ~1.0 (LosslessOnStoriesTarget prints it); this one (two layers, seventeen rounds of
  // training, see its README) reaches 4.59, past the goal of 2.5 at block size 8.
  EXPECT_GE(tau, 2.5);
}

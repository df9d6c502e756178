// Tensor parallelism: the shares of a group, and a group's forward passes against one context.
#include <gtest/gtest.h>

#include <algorithm>
#include <cstring>
#include <filesystem>
#include <map>
#include <utility>
#include <unistd.h>
#include <random>
#include <stdexcept>
#include <string>

#include "specmesh/model/context.hpp"
#include "specmesh/model/tp_group.hpp"
#include "refdata.hpp"
#include "synthetic_model.hpp"

using namespace specmesh;
using specmesh::test::refdata;

namespace {

TEST(TensorParallel, SharesCoverEveryRowOnceInWholeTiles) {
  for (size_t total : {1, 31, 32, 64, 96, 100, 512, 768, 2816}) {
    for (int n = 1; n <= 8; ++n) {
      size_t next = 0;
      for (int r = 0; r < n; ++r) {
        const RowRange s = tp_rows(total, {r, n});
        EXPECT_EQ(s.begin, next) << total << " rows, rank " << r << " of " << n;
        if (s.end != total) EXPECT_EQ(s.end % 32, 0u);
        next = s.end;
      }
      EXPECT_EQ(next, total);
    }
  }
  EXPECT_EQ(tp_rows(768, {1, 3}).size(), 256u);
  EXPECT_EQ(tp_kv_heads(4, {1, 2}).begin, 2u);
  EXPECT_EQ(tp_kv_heads(4, {1, 2}).end, 4u);
  EXPECT_EQ(tp_kv_heads(4, {2, 3}).size(), 2u);
}

TEST(TensorParallel, ImpossibleGroupsAreRefused) {
  auto m = test::synthetic_model("tiny-qwen3", 1);  // 2 KV heads
  EXPECT_THROW(TpGroup(*m, {.n_ctx = 64}, 3), std::invalid_argument);
  EXPECT_THROW(TpGroup(*m, {.n_ctx = 64}, 0), std::invalid_argument);
  // A rank without its link.
  EXPECT_THROW(Context(*m, {.n_ctx = 64, .tp = {1, 2}}), std::invalid_argument);
  EXPECT_THROW(Context(*m, {.n_ctx = 64, .tp = {2, 2}}), std::invalid_argument);
}

TEST(TensorParallel, AFailingRankBreaksTheExchangeInsteadOfHanging) {
  auto m = test::synthetic_model("tiny-qwen3", 1);
  TpGroup g(*m, {.n_ctx = 64}, 2);
  try {
    g.run([&](int r) {
      if (r == 1) throw std::runtime_error("rank 1 failed");
      float v = 1;
      g.rank(0).tp_link()->all_reduce_sum(&v, 1);  // rank 1 never comes
    });
    FAIL() << "the failure was not reported";
  } catch (const std::runtime_error& e) {
    EXPECT_STREQ(e.what(), "rank 1 failed") << "the cause, not the broken exchange, is reported";
  }
  // The group works again afterwards.
  std::vector<float> sums(2);
  g.run([&](int r) {
    float v[2] = {float(r + 1), 0.5f};
    g.rank(r).tp_link()->all_reduce_sum(v, 2);
    if (r == 1) sums.assign(v, v + 2);
  });
  EXPECT_EQ(sums, (std::vector<float>{3.0f, 1.0f}));
}

struct Case {
  std::string name;
  std::shared_ptr<const Model> model;
};

std::vector<Case> cases() {
  std::vector<Case> out;
  if (!test::refdata_dir().empty())
    for (const char* name : {"stories260K", "stories-target-1M"})
      out.push_back({name, std::shared_ptr<const Model>(Model::load(refdata(std::string("gguf-models/") + name + ".gguf")))});
  out.push_back({"tiny-qwen2", test::synthetic_model("tiny-qwen2", 2)});  // biases on Q, K, V
  out.push_back({"tiny-qwen3", test::synthetic_model("tiny-qwen3", 3)});  // q/k norms, q_dim != n_embd
  return out;
}

// Quantised matrices (packed on AVX-512) and 4 KV heads, so groups of 2, 3 and 4 split
// everything unevenly somewhere.
std::shared_ptr<const Model> quantised_llama(DType type) {
  static std::map<DType, std::shared_ptr<const Model>> models;
  std::shared_ptr<const Model>& m = models[type];
  if (!m) {
    SyntheticSpec s = *synthetic_preset("tiny-llama");  // 256 wide, 8 heads over 4 KV heads, FFN 768
    s.weight_type = type;
    s.n_ff = 736;  // 23 tiles of 32: the FFN's shares differ
    s.n_threads = 1;
    const std::string path = (std::filesystem::temp_directory_path() /
                              ("specmesh-tp-" + std::to_string(int(type)) + "-" + std::to_string(::getpid()) + ".gguf"))
                                 .string();
    write_synthetic_model(s, path);
    m = Model::load(path);
    std::filesystem::remove(path);
  }
  return m;
}

// A prompt in batches, then greedy decoding: every step's logits from the group equal one
// context's bit for bit.
void expect_same_as_one_context(const Model& m, int n, int threads) {
  const HParams& hp = m.hparams();
  Context one(m, {.n_ctx = 160});
  TpGroup group(m, {.n_ctx = 160, .n_threads = threads}, n);
  std::mt19937 rng(11);
  std::vector<int32_t> prompt(40);
  for (int32_t& t : prompt) t = int32_t(rng() % uint32_t(hp.n_vocab));
  int32_t pos = 0;
  std::vector<float> logits;
  for (size_t i = 0; i < prompt.size(); i += 16) {
    Batch b;
    for (size_t j = i; j < std::min(prompt.size(), i + 16); ++j) b.add(prompt[j], pos++, seq_bit(0), true);
    const ForwardOutput want = one.forward(b), got = group.forward(b);
    ASSERT_EQ(got.logits.size(), want.logits.size());
    ASSERT_EQ(std::memcmp(got.logits.data(), want.logits.data(), want.logits.size() * 4), 0) << "prompt batch at " << i;
    logits.assign(want.logits.end() - hp.n_vocab, want.logits.end());
  }
  for (int step = 0; step < 40; ++step) {
    Batch b;
    b.add(int32_t(std::max_element(logits.begin(), logits.end()) - logits.begin()), pos++, seq_bit(0), true);
    const ForwardOutput want = one.forward(b), got = group.forward(b);
    ASSERT_EQ(got.logits.size(), want.logits.size());
    ASSERT_EQ(std::memcmp(got.logits.data(), want.logits.data(), want.logits.size() * 4), 0) << "decode step " << step;
    logits = want.logits;
  }
  // Each rank's cache holds its heads' rows and no more.
  for (int r = 0; r < n; ++r) EXPECT_EQ(group.rank(r).kv().kv_dim(), int(tp_kv_heads(hp.n_head_kv, {r, n}).size()) * hp.head_dim);
}

TEST(TensorParallel, GroupsOfAnySizeGiveOneContextsLogitsBitForBit) {
  for (const Case& c : cases()) {
    for (int n = 2; n <= std::min(4, c.model->hparams().n_head_kv); ++n) {
      SCOPED_TRACE(c.name + " over " + std::to_string(n));
      expect_same_as_one_context(*c.model, n, 1);
    }
  }
  if (!!test::refdata_dir().empty()) GTEST_SKIP() << "refdata absent: the stories models were not split";
}

TEST(TensorParallel, QuantisedMatricesSplitBitForBit) {
  const std::pair<DType, const char*> types[] = {
      {DType::Q8_0, "Q8_0"}, {DType::Q4_0, "Q4_0"}, {DType::Q4_K, "Q4_K"}, {DType::F16, "F16"}};
  for (const auto& [type, name] : types) {
    for (int n : {2, 3, 4}) {
      SCOPED_TRACE(std::string(name) + " over " + std::to_string(n));
      expect_same_as_one_context(*quantised_llama(type), n, n == 2 ? 2 : 1);
    }
  }
}

}  // namespace

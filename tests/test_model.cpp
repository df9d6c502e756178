// End-to-end checks of the inference core on the real stories260K family.
#include <gtest/gtest.h>

#include <climits>
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <nlohmann/json.hpp>

#include "specmesh/kernels/matmul.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/model/synthetic.hpp"
#include "refdata.hpp"

using namespace specmesh;
using specmesh::test::refdata;

namespace {

std::unique_ptr<Model> load_bin(const std::string& name = "stories260K") {
  return Model::load(refdata("llama2c/" + name + ".bin"), refdata("llama2c/tok512.bin"));
}
std::unique_ptr<Model> load_gguf(const std::string& name = "stories260K") {
  return Model::load(refdata("gguf-models/" + name + ".gguf"));
}

// Runs every case of stories260K_greedy_reference.json (run.c semantics: `steps` forward
// passes, prompt tokens forced, stop at BOS) and compares ids and printed text.
void check_goldens(const Model& m) {
  std::ifstream f(refdata("llama2c/stories260K_greedy_reference.json"));
  auto ref = nlohmann::json::parse(f);
  ASSERT_EQ(ref["cases"].size(), 6u);
  for (const auto& c : ref["cases"]) {
    SCOPED_TRACE("prompt '" + c["prompt"].get<std::string>() + "'");
    const auto prompt_ids = c["prompt_ids_with_bos"].get<std::vector<int32_t>>();
    EXPECT_EQ(m.tokenizer().encode(c["prompt"].get<std::string>(), true), prompt_ids);
    Context ctx(m, {});
    const int steps = c["steps"];
    auto ids = greedy_ids(ctx, prompt_ids, steps - int(prompt_ids.size()) + 1);
    EXPECT_EQ(ids, c["generated_ids"].get<std::vector<int32_t>>());

    StreamDecoder dec(m.tokenizer());
    for (int32_t t : prompt_ids) dec.feed(t);
    std::string text;
    for (int32_t t : ids) text += dec.feed(t);
    text += dec.flush();
    EXPECT_EQ(c["prompt"].get<std::string>() + text, c["stdout_without_trailing_newline"].get<std::string>());
  }
}

}  // namespace

TEST(Goldens, Stories260KLlama2cMatchesRunC) {
  SPECMESH_REQUIRE_REFDATA();
  check_goldens(*load_bin());
}

TEST(Goldens, Stories260KGgufMatchesRunC) {
  SPECMESH_REQUIRE_REFDATA();
  check_goldens(*load_gguf());
}

// The largest distance of the logits of the first 16 greedy positions from run.c's (F32
// throughout), with the KV cache stored as kv_type.
static double logits_error(const Model& m, DType kv_type) {
  std::ifstream f(refdata("llama2c/stories260K_logits_pos0-15.f32"), std::ios::binary);
  std::vector<float> ref(16 * 512);
  f.read(reinterpret_cast<char*>(ref.data()), ref.size() * 4);
  EXPECT_TRUE(f);
  const std::vector<int32_t> seq = {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426};
  Context ctx(m, {.kv_type = kv_type});
  double max_err = 0;
  for (int p = 0; p < 16; ++p) {
    Batch b;
    b.add(seq[p], p, seq_bit(0), true);
    auto out = ctx.forward(b);
    for (int v = 0; v < 512; ++v) max_err = std::max(max_err, double(std::fabs(out.logits[v] - ref[p * 512 + v])));
  }
  return max_err;
}

TEST(Goldens, LogitsOfFirst16PositionsWithin1e4) {
  SPECMESH_REQUIRE_REFDATA();
  for (auto& m : {load_bin(), load_gguf()}) EXPECT_LT(logits_error(*m, DType::F32), 1e-4) << m->format();
}

// A narrower cache moves the logits by its rounding: an F16 row keeps 11 significant bits
// (relative error up to 2^-11), Q8_0 about 8 (up to 1/254 of its block's largest value; in
// this model a block of 32 spans four heads of 8, so a small head shares a large one's step).
// The bounds are about 2x what was measured (1.3e-2 and 0.75 on logits of magnitude up to 13).
TEST(Goldens, LogitsWithF16AndQ8_0Caches) {
  SPECMESH_REQUIRE_REFDATA();
  for (auto& m : {load_bin(), load_gguf()}) {
    const double f16 = logits_error(*m, DType::F16), q8 = logits_error(*m, DType::Q8_0);
    EXPECT_LT(f16, 3e-2) << m->format();
    EXPECT_LT(q8, 1.5) << m->format();
    EXPECT_GT(f16, 1e-4) << "an F16 cache that changes nothing is not storing F16";
    std::printf("%s: max logit error, F16 cache %.3g, Q8_0 cache %.3g\n", m->format().c_str(), f16, q8);
  }
}

TEST(Goldens, DistilledModelsMatchTheirGreedyIds) {
  SPECMESH_REQUIRE_REFDATA();
  // MODELS.md "Greedy ids for golden tests": prompt "Once upon a time", 64 greedy ids.
  const std::map<std::string, std::vector<int32_t>> expect = {
      {"stories260K-draft-tiny", {432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 335, 311, 267, 422, 419, 426, 385, 328, 432, 358, 394, 261, 370, 268, 414, 444, 426, 338, 286, 399, 393, 269, 279, 411, 429, 292, 266, 267, 337, 335, 311, 267, 422, 419, 426, 338, 286, 399, 393, 269, 279, 292, 416, 439, 413, 391, 267, 337}},
      {"stories260K-draft-small", {432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 268, 414, 444, 335, 261, 370, 432, 352, 266, 268, 388, 426, 338, 391, 266, 267, 337, 335, 311, 267, 422, 419, 269, 282, 323, 312, 322, 265, 282, 295}},
      {"stories-target-1M", {432, 383, 286, 261, 376, 298, 315, 421, 395, 317, 426, 338, 401, 396, 267, 337, 410, 408, 419, 292, 411, 322, 265, 282, 295, 433, 426, 385, 328, 432, 358, 394, 261, 370, 268, 414, 444, 322, 265, 282, 295, 433, 426, 338, 391, 266, 267, 262, 411, 411, 263, 415, 294, 286, 322, 419, 292, 411, 426, 338, 261, 419, 355, 311}},
  };
  for (const auto& [name, ids] : expect) {
    for (auto& m : {load_bin(name), load_gguf(name)}) {
      Context ctx(*m, {});
      EXPECT_EQ(greedy_ids(ctx, {1, 403, 407, 261, 378}, 64), ids) << name << " " << m->format();
    }
  }
}

// A batch of n tokens must give the same bits per position as n single-token steps: greedy
// speculative output is compared with plain decoding exactly.
TEST(Forward, BatchIsBitIdenticalToSingleSteps) {
  SPECMESH_REQUIRE_REFDATA();
  for (const char* name : {"stories260K", "stories-target-1M"}) {
    auto m = load_gguf(name);
    const std::vector<int32_t> seq = {1, 403, 407, 261, 378, 432, 383, 286, 261, 376, 298, 315, 421};
    for (int threads : {1, 2}) {
      Context single(*m, {.n_threads = threads}), batched(*m, {.n_threads = 1});
      std::vector<float> a, b;
      for (size_t p = 0; p < seq.size(); ++p) {
        Batch one;
        one.add(seq[p], int32_t(p), seq_bit(0), true);
        auto o = single.forward(one);
        a.insert(a.end(), o.logits.begin(), o.logits.end());
      }
      Batch all;
      for (size_t p = 0; p < seq.size(); ++p) all.add(seq[p], int32_t(p), seq_bit(0), true);
      b = batched.forward(all).logits;
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << name << " threads " << threads;
    }
  }
}

// The same with heads of 64 values (the refdata models' are 8 and 16), which is where the
// AVX-512 attention takes its fastest paths, Q8_0 keys scored in 8 bits among them; every KV
// cache type, 2 query heads per KV head, and a context longer than the attention's sink and
// window, so middle chunks are merged too.
TEST(Forward, BatchIsBitIdenticalToSingleStepsForEveryKvTypeAt64ValueHeads) {
  SyntheticSpec spec;
  spec.n_embd = 256;
  spec.n_head = 4;
  spec.n_head_kv = 2;
  spec.head_dim = 64;
  spec.n_ff = 256;
  spec.n_layer = 2;
  spec.n_threads = 1;
  const std::string path = ::testing::TempDir() + "/batch-64-" + std::to_string(::getpid()) + ".gguf";
  write_synthetic_model(spec, path);
  auto m = Model::load(path);
  std::remove(path.c_str());
  std::printf("attention path: %s\n", matmul_isa());
  // A prompt of 300 tokens as one batch, then 13 tokens: as single steps, and as one batch.
  std::vector<int32_t> prompt(300), seq(13);
  for (size_t i = 0; i < prompt.size(); ++i) prompt[i] = int32_t((i * 37 + 11) % 512);
  for (size_t i = 0; i < seq.size(); ++i) seq[i] = int32_t((i * 101 + 5) % 512);
  for (DType kv : {DType::F16, DType::Q8_0, DType::F32}) {
    for (int threads : {1, 2}) {
      Context single(*m, {.kv_type = kv, .n_threads = threads}), batched(*m, {.kv_type = kv, .n_threads = 1});
      for (Context* c : {&single, &batched}) {
        Batch pre;
        for (size_t p = 0; p < prompt.size(); ++p) pre.add(prompt[p], int32_t(p), seq_bit(0), false);
        c->forward(pre);
      }
      std::vector<float> a, b;
      for (size_t p = 0; p < seq.size(); ++p) {
        Batch one;
        one.add(seq[p], int32_t(prompt.size() + p), seq_bit(0), true);
        auto o = single.forward(one);
        a.insert(a.end(), o.logits.begin(), o.logits.end());
      }
      Batch all;
      for (size_t p = 0; p < seq.size(); ++p) all.add(seq[p], int32_t(prompt.size() + p), seq_bit(0), true);
      b = batched.forward(all).logits;
      ASSERT_EQ(a.size(), b.size());
      EXPECT_EQ(std::memcmp(a.data(), b.data(), a.size() * 4), 0) << dtype_name(kv) << " threads " << threads;
    }
  }
}

TEST(Forward, LayerRangesChainToTheFullModel) {
  SPECMESH_REQUIRE_REFDATA();
  auto m = load_bin();
  Context full(*m, {}), s0(*m, {.layer_begin = 0, .layer_end = 2}), s1(*m, {.layer_begin = 2, .layer_end = 4}),
      s2(*m, {.layer_begin = 4, .layer_end = -1});
  Batch b;
  const std::vector<int32_t> seq = {1, 403, 407, 261, 378};
  for (size_t p = 0; p < seq.size(); ++p) b.add(seq[p], int32_t(p), seq_bit(0), p + 1 == seq.size());
  auto ref = full.forward(b);
  auto h0 = s0.forward(b);
  EXPECT_TRUE(h0.logits.empty());
  ASSERT_EQ(h0.hidden.size(), seq.size() * 64);
  auto h1 = s1.forward(b, h0.hidden.data());
  auto out = s2.forward(b, h1.hidden.data());
  ASSERT_EQ(out.logits.size(), ref.logits.size());
  EXPECT_EQ(std::memcmp(out.logits.data(), ref.logits.data(), ref.logits.size() * 4), 0);
  EXPECT_THROW(Context(*m, {.layer_begin = 3, .layer_end = 9}), std::invalid_argument);
}

TEST(Forward, CapturesHiddenStatesAfterChosenLayers) {
  SPECMESH_REQUIRE_REFDATA();
  auto m = load_bin();
  Context cap(*m, {.capture_layers = {1}}), first(*m, {.layer_begin = 0, .layer_end = 2});
  Batch b;
  b.add(1, 0, seq_bit(0), true);
  b.add(403, 1, seq_bit(0), true);
  auto o = cap.forward(b);
  auto h = first.forward(b);
  ASSERT_EQ(o.captured.size(), 1u);
  EXPECT_EQ(o.captured[0], h.hidden);
}

// Tree attention: two branches verified in one pass equal each branch run on its own.
TEST(Forward, TreeBatchMatchesSeparateChains) {
  SPECMESH_REQUIRE_REFDATA();
  auto m = load_bin();
  const std::vector<int32_t> prompt = {1, 403, 407};
  // Tree in DFS pre-order: root 261 (pos 3) with children 378 and 300 (pos 4); 378 has child
  // 432 (pos 5), stored before its uncle 300.
  Context tree_ctx(*m, {});
  prefill(tree_ctx, prompt, 0, 64);
  Batch t;
  t.add(261, 3, seq_bit(0), true);
  t.add(378, 4, seq_bit(0), true);
  t.add(432, 5, seq_bit(0), true);
  t.add(300, 4, seq_bit(0), true);
  t.parent = {-1, 0, 1, 0};
  auto tree = tree_ctx.forward(t);

  auto chain = [&](const std::vector<int32_t>& toks) {
    Context c(*m, {});
    prefill(c, prompt, 0, 64);
    Batch b;
    for (size_t i = 0; i < toks.size(); ++i) b.add(toks[i], 3 + int32_t(i), seq_bit(0), true);
    return c.forward(b).logits;
  };
  auto a = chain({261, 378, 432});
  auto b = chain({261, 300});
  const int V = 512;
  auto row = [&](const std::vector<float>& v, int r) { return std::vector<float>(v.begin() + r * V, v.begin() + (r + 1) * V); };
  auto near = [](const std::vector<float>& x, const std::vector<float>& y) {
    double e = 0;
    for (size_t i = 0; i < x.size(); ++i) e = std::max(e, double(std::fabs(x[i] - y[i])));
    return e;
  };
  EXPECT_LT(near(row(tree.logits, 0), row(a, 0)), 1e-5);
  EXPECT_LT(near(row(tree.logits, 1), row(a, 1)), 1e-5);
  EXPECT_LT(near(row(tree.logits, 2), row(a, 2)), 1e-5);
  EXPECT_LT(near(row(tree.logits, 3), row(b, 1)), 1e-5);

  // Breadth-first order (300 before 432) is not DFS pre-order: a clear error, cache untouched.
  Context bad(*m, {});
  prefill(bad, prompt, 0, 64);
  const int used = bad.kv().used();
  Batch bfs = t;
  bfs.tokens = {261, 378, 300, 432};
  bfs.pos = {3, 4, 4, 5};
  bfs.parent = {-1, 0, 0, 1};
  try {
    bad.forward(bfs);
    ADD_FAILURE() << "a breadth-first tree was accepted";
  } catch (const std::invalid_argument& e) {
    EXPECT_NE(std::string(e.what()).find("node 3 has parent 1"), std::string::npos) << e.what();
  }
  EXPECT_EQ(bad.kv().used(), used);
}

// Sequences share cells: a speculative branch in sequence 1 sees the canonical prefix, and
// dropping it leaves sequence 0 exactly as plain decoding would have it.
TEST(KvCache, SequencesForkAcceptAndDrop) {
  SPECMESH_REQUIRE_REFDATA();
  auto m = load_bin();
  Context ctx(*m, {}), ref(*m, {});
  prefill(ctx, {1, 403, 407}, 0, 64);
  ctx.kv().seq_cp(0, 1, 0, -1);
  EXPECT_EQ(ctx.kv().seq_pos_max(1), 2);
  Batch spec;
  spec.add(261, 3, seq_bit(1), true);
  spec.add(999 % 512, 4, seq_bit(1), true);
  ctx.forward(spec);
  EXPECT_EQ(ctx.kv().used(), 5);
  // Accept the first speculative token into sequence 0, drop the rest of sequence 1.
  ctx.kv().seq_cp(1, 0, 3, 4);
  ctx.kv().seq_rm(1, -1, -1);
  EXPECT_EQ(ctx.kv().used(), 4);
  EXPECT_EQ(ctx.kv().seq_pos_max(0), 3);

  Batch next;
  next.add(378, 4, seq_bit(0), true);
  auto got = ctx.forward(next).logits;
  auto want = prefill(ref, {1, 403, 407, 261, 378}, 0, 64);
  EXPECT_EQ(got, want);

  ctx.kv().seq_cp(0, 2, 0, -1);
  ctx.kv().seq_keep(2);
  EXPECT_EQ(ctx.kv().seq_pos_max(0), -1);
  EXPECT_EQ(ctx.kv().seq_pos_max(2), 4);
  ctx.kv().clear();
  EXPECT_EQ(ctx.kv().used(), 0);
}

TEST(KvCache, FullCacheIsAClearError) {
  SPECMESH_REQUIRE_REFDATA();
  auto m = load_bin();
  Context ctx(*m, {.n_ctx = 4});
  prefill(ctx, {1, 2, 3, 4}, 0, 8);
  Batch b;
  b.add(5, 4, seq_bit(0), true);
  EXPECT_THROW(ctx.forward(b), std::runtime_error);
}

// n_ctx = INT_MAX asks for terabytes: a clear error naming the size, not std::bad_alloc.
TEST(KvCache, CacheLargerThanTheMachineIsAClearError) {
  SPECMESH_REQUIRE_REFDATA();
  auto m = load_bin();
  try {
    Context ctx(*m, {.n_ctx = INT32_MAX});
    FAIL() << "expected an error";
  } catch (const std::runtime_error& e) {
    EXPECT_NE(std::string(e.what()).find("a KV cache of 2147483647 cells for layers [0, 5) needs 1280.0 GiB, more than "
                                         "this machine's "),
              std::string::npos)
        << e.what();
  }
}

// The llama2.c header's vocab_size is negative when the classifier has weights of its own;
// INT32_MIN has no positive counterpart (negating it was undefined behaviour).
TEST(Llama2c, HeaderWithAnImpossibleVocabularySizeIsRefused) {
  SPECMESH_REQUIRE_REFDATA();
  const std::string path = testing::TempDir() + "/vocab-int-min.bin";
  for (int32_t vocab : {INT32_MIN, 0}) {
    SCOPED_TRACE(vocab);
    {
      const int32_t header[7] = {64, 172, 5, 8, 4, vocab, 512};
      std::ofstream f(path, std::ios::binary);
      f.write(reinterpret_cast<const char*>(header), sizeof header);
      f << std::string(4096, '\0');
    }
    try {
      Model::load(path, refdata("llama2c/tok512.bin"));
      FAIL() << "expected an error";
    } catch (const std::exception& e) {
      EXPECT_NE(std::string(e.what()).find(path + ": not a GGUF file and not a valid llama2.c checkpoint header (vocab_size " +
                                           std::to_string(vocab) + " is not a vocabulary size)"),
                std::string::npos)
          << e.what();
    }
  }
}

TEST(Forward, CancelCheckStopsBetweenLayers) {
  SPECMESH_REQUIRE_REFDATA();
  auto m = load_bin();
  Context ctx(*m, {});
  int layers_started = 0;
  ctx.set_cancel_check([&] { return ++layers_started > 2; });
  Batch b;
  b.add(1, 0, seq_bit(3), true);
  EXPECT_THROW(ctx.forward(b), ForwardCancelled);
  EXPECT_EQ(layers_started, 3);
}

// Attention-level speculation: the layer ops of a forward pass, the priority gating, and the
// two-device executor against plain decoding.
#include <gtest/gtest.h>

#include <algorithm>
#include <cmath>
#include <cstdio>
#include <cstring>
#include <filesystem>
#include <random>
#include <string>
#include <unistd.h>

#include "specmesh/model/forward_pass.hpp"
#include "specmesh/model/generate.hpp"
#include "specmesh/model/synthetic.hpp"
#include "specmesh/speculation/alspec_gating.hpp"
#include "specmesh/speculation/alspec_pair.hpp"
#include "private_dir.hpp"
#include "refdata.hpp"

using namespace specmesh;
using specmesh::test::refdata;

namespace {

// ---- gating ----------------------------------------------------------------------------

// What Algorithm 2 makes each device do at one layer.
struct LayerTrace {
  bool pre[2];
  int sender;
  bool post[2];
};

// Walks both devices' gates through one hit/miss verdict per layer; `holder` is the sender
// of the all-gather after the last layer.
std::vector<LayerTrace> walk(AlspecGate (&g)[2], const std::vector<bool>& hits, int* holder = nullptr) {
  std::vector<LayerTrace> out;
  for (bool hit : hits) {
    LayerTrace t{};
    for (int d = 0; d < 2; ++d) t.pre[d] = !g[d].skip_compute();
    const int p0 = g[0].priority(), p1 = g[1].priority();
    g[0].all_gather(p1);
    g[1].all_gather(p0);
    EXPECT_EQ(g[0].sender(), g[1].sender());
    t.sender = g[0].sender();
    EXPECT_EQ(g[t.sender].role(), AlspecRole::Sender);
    EXPECT_EQ(g[1 - t.sender].role(), AlspecRole::Receiver);
    g[t.sender].sent(hit);
    g[1 - t.sender].received();
    for (int d = 0; d < 2; ++d) t.post[d] = !g[d].skip_compute();
    out.push_back(t);
  }
  if (holder) {
    const int p0 = g[0].priority(), p1 = g[1].priority();
    g[0].all_gather(p1);
    g[1].all_gather(p0);
    *holder = g[0].sender();
  }
  return out;
}

TEST(AlspecGating, StartsWithDeviceZeroSendingAndDeviceOneSkipping) {
  AlspecGate g0(0), g1(1);
  EXPECT_EQ(g0.priorities(), (std::array<int, 2>{2, 0}));
  EXPECT_FALSE(g0.skip_compute());
  EXPECT_TRUE(g1.skip_compute());
  g0.all_gather(g1.priority());
  EXPECT_EQ(g0.role(), AlspecRole::Sender);
  EXPECT_THROW(AlspecGate(2), std::invalid_argument);
}

TEST(AlspecGating, ScriptedHitsAndMissesFollowAlgorithm2) {
  AlspecGate g[2] = {AlspecGate(0), AlspecGate(1)};
  int holder = -1;
  const auto t = walk(g, {true, true, false, false, true, false}, &holder);
  // Worked by hand from the rules: [2,0] -hit-> [0,1] -hit-> [1,0] -miss-> [2,1] -miss-> [2,1]
  // -hit-> [0,1] -miss(sender 1)-> [1,2].
  const int sender[] = {0, 1, 0, 0, 0, 1};
  const bool pre0[] = {1, 0, 1, 1, 1, 0}, pre1[] = {0, 1, 0, 1, 1, 1};
  const bool post0[] = {0, 1, 1, 1, 0, 1}, post1[] = {1, 0, 1, 1, 1, 1};
  for (size_t i = 0; i < t.size(); ++i) {
    SCOPED_TRACE("layer " + std::to_string(i));
    EXPECT_EQ(t[i].sender, sender[i]);
    EXPECT_EQ(t[i].pre[0], pre0[i]);
    EXPECT_EQ(t[i].pre[1], pre1[i]);
    EXPECT_EQ(t[i].post[0], post0[i]);
    EXPECT_EQ(t[i].post[1], post1[i]);
  }
  EXPECT_EQ(g[0].priorities(), (std::array<int, 2>{1, 2}));
  EXPECT_EQ(holder, 1);
}

TEST(AlspecGating, RandomScriptsKeepTheInvariants) {
  std::mt19937 rng(7);
  for (int run = 0; run < 50; ++run) {
    AlspecGate g[2] = {AlspecGate(0), AlspecGate(1)};
    std::vector<bool> hits(40);
    for (size_t i = 0; i < hits.size(); ++i) hits[i] = rng() % 3 != 0;
    const auto t = walk(g, hits);
    for (size_t i = 0; i < t.size(); ++i) {
      const int s = t[i].sender, r = 1 - s;
      EXPECT_TRUE(t[i].pre[s]) << "the sender computed its q, k, v";
      EXPECT_TRUE(t[i].post[r]) << "the receiver always goes on";
      EXPECT_EQ(t[i].post[s], !hits[i]) << "the sender skips exactly on a hit";
      if (i + 1 < t.size()) {
        EXPECT_EQ(t[i + 1].sender, hits[i] ? r : s) << "a hit swaps the roles, a miss keeps them";
        for (int d = 0; d < 2; ++d) EXPECT_EQ(t[i + 1].pre[d], t[i].post[d]) << "one gate spans both op groups";
      }
    }
  }
}

TEST(AlspecGating, TiesAndWrongRolesAreRefused) {
  AlspecGate g(0);
  EXPECT_THROW(g.all_gather(2), std::logic_error);
  AlspecGate h(1);
  EXPECT_THROW(h.all_gather(3), std::logic_error);
  h.all_gather(2);
  EXPECT_THROW(h.sent(true), std::logic_error);
  AlspecGate s(0);
  s.all_gather(0);
  EXPECT_THROW(s.received(), std::logic_error);
}

// ---- models ----------------------------------------------------------------------------

struct NamedModel {
  std::string name;
  std::unique_ptr<Model> model;
  std::vector<int32_t> prompt;
};

// A synthetic GQA Qwen3 (8 query heads over 2 KV heads, q_dim != n_embd), written once.
const std::string& qwen3_path() {
  static const std::string path = [] {
    const std::string p = test::private_tmpdir("specmesh-alspec") + "/tiny-qwen3.gguf";
    SyntheticSpec s = *synthetic_preset("tiny-qwen3");
    s.n_ctx = 512;
    write_synthetic_model(s, p);
    return p;
  }();
  return path;
}

std::vector<NamedModel> all_models() {
  std::vector<NamedModel> out;
  const std::string text = "Once upon a time, there was a little girl named Lily. She";
  for (const char* name : {"stories260K", "stories260K-draft-small", "stories260K-draft-tiny", "stories-target-1M"}) {
    auto m = Model::load(refdata(std::string("gguf-models/") + name + ".gguf"));
    auto prompt = m->tokenizer().encode(text, true);
    out.push_back({std::string(name) + ".gguf", std::move(m), std::move(prompt)});
  }
  auto bin = Model::load(refdata("llama2c/stories260K.bin"), refdata("llama2c/tok512.bin"));
  auto prompt = bin->tokenizer().encode(text, true);
  out.push_back({"stories260K.bin", std::move(bin), std::move(prompt)});
  out.push_back({"tiny-qwen3", Model::load(qwen3_path()), {1, 17, 300, 42, 99, 7, 250, 3, 64, 128}});
  return out;
}

SpecConfig spec_config(size_t S, float lambda) { return SpecConfig{{S, S, 32}, lambda}; }

// Plain greedy decoding with the given attention layout; n tokens, stop tokens ignored.
std::vector<int32_t> plain_greedy(const Model& m, const std::vector<int32_t>& prompt, int n, const FlashLayout& layout) {
  Context ctx(m, {.n_ctx = 256, .attention_layout = layout});
  return greedy_ids(ctx, prompt, n, true);
}

// Both devices' caches (rank `rank` of each group) hold the same K/V rows in every used cell
// of every layer.
void expect_same_caches(AlspecPair& pair, int rank = 0) {
  KvCache& a = pair.device(0, rank).kv();
  KvCache& b = pair.device(1, rank).kv();
  const size_t bytes = size_t(a.n_cells()) * a.rows(a.layer_begin()).row_bytes();
  for (int il = a.layer_begin(); il < a.layer_end(); ++il) {
    EXPECT_EQ(std::memcmp(a.rows(il).k, b.rows(il).k, bytes), 0) << "K rows of layer " << il;
    EXPECT_EQ(std::memcmp(a.rows(il).v, b.rows(il).v, bytes), 0) << "V rows of layer " << il;
  }
}

// ---- layer ops -------------------------------------------------------------------------

TEST(ForwardPass, OpsInOrderEqualForwardBitForBit) {
  SPECMESH_REQUIRE_REFDATA();
  for (auto& nm : all_models()) {
    SCOPED_TRACE(nm.name);
    const Model& m = *nm.model;
    const HParams& hp = m.hparams();
    const SpecConfig cfg = spec_config(16, 0.1f);
    Context ref(m, {.n_ctx = 128, .attention_layout = cfg.layout});
    Context plain_ops(m, {.n_ctx = 128, .attention_layout = cfg.layout});
    Context spec_ops(m, {.n_ctx = 128, .attention_layout = cfg.layout});
    std::vector<float> full(hp.q_dim()), spec(hp.q_dim());
    std::mt19937 rng(3);
    for (int32_t p = 0; p < 80; ++p) {  // past 2S: the speculative kernel splits keys
      Batch b;
      b.add(int32_t(rng() % hp.n_vocab), p, seq_bit(0), true);
      const std::vector<float> want = ref.forward(b).logits;
      ForwardPass a(plain_ops, b), s(spec_ops, b);
      for (int il = 0; il < hp.n_layer; ++il) {
        a.pre_attention(il);
        a.attention(il, full.data());
        a.post_attention(il, full.data());
        s.pre_attention(il);
        const SpecCheck c = s.attention(il, full.data(), spec.data(), &cfg);
        EXPECT_EQ(c.exact, p + 1 < 32);
        s.post_attention(il, full.data());
      }
      const std::vector<float> got_a = a.output().logits, got_s = s.output().logits;
      ASSERT_EQ(got_a.size(), want.size());
      ASSERT_EQ(got_s.size(), want.size());
      ASSERT_EQ(std::memcmp(got_a.data(), want.data(), want.size() * 4), 0) << "plain ops, pos " << p;
      ASSERT_EQ(std::memcmp(got_s.data(), want.data(), want.size() * 4), 0) << "speculative kernel, pos " << p;
    }
  }
}

TEST(ForwardPass, KvRowsRoundTripAndAttentionNeedsItsQ) {
  SPECMESH_REQUIRE_REFDATA();
  auto m = Model::load(refdata("gguf-models/stories260K.gguf"));
  Context ctx(*m, {.n_ctx = 16});
  Batch b;
  b.add(1, 0, seq_bit(0), true);
  ForwardPass pass(ctx, b);
  std::vector<float> att(m->hparams().q_dim());
  EXPECT_THROW(pass.attention(0, att.data()), std::logic_error);
  pass.pre_attention(0);
  const int KV = m->hparams().kv_dim();
  std::vector<float> k(KV), v(KV), k2(KV), v2(KV);
  pass.read_kv(0, 0, k.data(), v.data());
  std::vector<float> stored(KV);
  ctx.kv().read(0, 0, stored.data(), nullptr);
  EXPECT_EQ(k, stored);
  // The default cache is F16: what was read back is exactly representable there.
  EXPECT_EQ(ctx.kv().type(), DType::F16);
  for (float x : k) EXPECT_EQ(fp16_to_fp32(fp32_to_fp16(x)), x);
  // A written row reads back rounded to the cache's type.
  for (auto& x : k) x += 1.0f / 3;
  pass.write_kv(0, 0, k.data(), v.data());
  pass.read_kv(0, 0, k2.data(), v2.data());
  for (auto& x : k) x = fp16_to_fp32(fp32_to_fp16(x));
  EXPECT_EQ(k, k2);
  EXPECT_EQ(v, v2);
}

// ---- the pair --------------------------------------------------------------------------

TEST(AlspecPair, LambdaZeroDecodesExactlyAsPlainGreedy) {
  SPECMESH_REQUIRE_REFDATA();
  constexpr int kTokens = 60;
  for (auto& nm : all_models()) {
    for (size_t S : {16, 32}) {
      SCOPED_TRACE(nm.name + " S=" + std::to_string(S));
      const SpecConfig cfg = spec_config(S, 0.0f);
      const auto want = plain_greedy(*nm.model, nm.prompt, kTokens, cfg.layout);
      AlspecPair pair(*nm.model, {.spec = cfg, .n_ctx = 256});
      int speculated = 0;
      const auto got = pair.greedy(nm.prompt, kTokens, [&](const AlspecToken& t, int32_t, int32_t pos) {
        for (size_t il = 0; il < t.hits.size(); ++il) {
          EXPECT_EQ(bool(t.hits[il]), t.checks[il].exact) << "lambda 0 accepts only exact steps";
          speculated += !t.checks[il].exact;
        }
        EXPECT_EQ(t.checks[0].exact, size_t(pos + 1) < 2 * S);
      });
      EXPECT_EQ(got, want);
      EXPECT_GT(speculated, 0) << "the contexts reached 2S";
      expect_same_caches(pair);
    }
  }
}

TEST(AlspecPair, ForcedMissesDecodeExactlyAsPlainGreedy) {
  SPECMESH_REQUIRE_REFDATA();
  constexpr int kTokens = 50;
  for (auto& nm : all_models()) {
    SCOPED_TRACE(nm.name);
    const SpecConfig cfg = spec_config(16, 10.0f);
    const auto want = plain_greedy(*nm.model, nm.prompt, kTokens, cfg.layout);
    AlspecPair pair(*nm.model, {.spec = cfg, .n_ctx = 256});
    pair.set_verdict([](int, const SpecCheck&) { return false; });
    const auto got = pair.greedy(nm.prompt, kTokens, [&](const AlspecToken& t, int32_t, int32_t) {
      EXPECT_EQ(t.holder, 0) << "device 0 stays the sender on misses";
    });
    EXPECT_EQ(got, want);
    expect_same_caches(pair);
    EXPECT_EQ(pair.work(1).sent, 0);
    EXPECT_EQ(pair.work(0).post_skipped, 0);
  }
}

// One context doing what the pair does without a second device: per layer the speculative
// kernel, then the speculative output where accepted, else the full one.
struct SpeculativeReference {
  Context ctx;
  SpecConfig cfg;
  SpeculativeReference(const Model& m, const SpecConfig& c)
      : ctx(m, {.n_ctx = 256, .attention_layout = c.layout}), cfg(c) {}
  std::vector<float> decode(int32_t token, int32_t pos) {
    const HParams& hp = ctx.model().hparams();
    Batch b;
    b.add(token, pos, seq_bit(0), true);
    ForwardPass pass(ctx, b);
    std::vector<float> full(hp.q_dim()), spec(hp.q_dim());
    for (int il = 0; il < hp.n_layer; ++il) {
      pass.pre_attention(il);
      const SpecCheck c = pass.attention(il, full.data(), spec.data(), &cfg);
      pass.post_attention(il, c.accept ? spec.data() : full.data());
    }
    return pass.output().logits;
  }
};

TEST(AlspecPair, LargeLambdaHitsAlternatesRolesAndKeepsDevicesInSync) {
  SPECMESH_REQUIRE_REFDATA();
  constexpr int kTokens = 60;
  constexpr size_t S = 16;
  for (auto& nm : all_models()) {
    SCOPED_TRACE(nm.name);
    const Model& m = *nm.model;
    const int L = m.hparams().n_layer;
    const SpecConfig cfg = spec_config(S, 10.0f);
    AlspecPair pair(m, {.spec = cfg, .n_ctx = 256});
    SpeculativeReference ref(m, cfg);
    prefill(ref.ctx, nm.prompt, 0, 256);
    int sender = pair.gate(0).sender();  // device 0 sends at the first attention
    int speculated = 0;
    const auto got = pair.greedy(nm.prompt, kTokens, [&](const AlspecToken& t, int32_t token, int32_t pos) {
      for (int il = 0; il < L; ++il) {
        EXPECT_TRUE(t.hits[il]) << "layer " << il << " at " << pos + 1 << " keys";
        speculated += !t.checks[il].exact;
      }
      // Every layer hits, so the roles swap at every attention; the holder is the last receiver.
      sender = (sender + L) % 2;
      EXPECT_EQ(t.holder, sender);
      // The synced pair computes what one device choosing spec or full per layer computes.
      const std::vector<float> want = ref.decode(token, pos);
      ASSERT_EQ(want.size(), t.logits.size());
      EXPECT_EQ(std::memcmp(want.data(), t.logits.data(), want.size() * 4), 0) << "pos " << pos;
      for (float x : t.logits) ASSERT_TRUE(std::isfinite(x));
      expect_same_caches(pair);
    });
    EXPECT_GT(speculated, 0);
    for (int32_t id : got) EXPECT_TRUE(id >= 0 && id < m.hparams().n_vocab);
    // Each gated op ran on exactly one device per layer: the overlap halves the non-attention work.
    const int steps = kTokens - 1;
    EXPECT_EQ(pair.work(0).post_run + pair.work(1).post_run, steps * L);
    EXPECT_EQ(pair.work(0).pre_run + pair.work(1).pre_run, steps * L);
    EXPECT_EQ(pair.work(0).sent + pair.work(1).sent, steps * L);
    EXPECT_EQ(pair.work(0).heads + pair.work(1).heads, steps);
  }
}

TEST(AlspecPair, LargeLambdaTextIsPlainUntil2SAndReadable) {
  SPECMESH_REQUIRE_REFDATA();
  auto m = Model::load(refdata("gguf-models/stories260K.gguf"));
  const auto prompt = m->tokenizer().encode("Once upon a time, there was a little girl named Lily. She", true);
  const SpecConfig cfg = spec_config(16, 10.0f);
  const auto plain = plain_greedy(*m, prompt, 60, cfg.layout);
  AlspecPair pair(*m, {.spec = cfg, .n_ctx = 256});
  const auto got = pair.greedy(prompt, 60);
  // Speculation starts at 2S = 32 keys, so the first tokens are plain decoding's.
  const size_t exact = 32 - prompt.size();
  EXPECT_TRUE(std::equal(plain.begin(), plain.begin() + exact, got.begin()));
  const std::string text = m->tokenizer().decode(got);
  EXPECT_FALSE(text.empty());
  std::printf("lambda 10: %s\n", text.c_str());
}

// ---- SP + TPn: each device a tensor-parallel group ---------------------------------------

TEST(AlspecPair, TensorParallelGroupsDecodeExactlyAsPlainGreedyAtLambdaZeroAndOnMisses) {
  SPECMESH_REQUIRE_REFDATA();
  constexpr int kTokens = 50;
  for (auto& nm : all_models()) {
    for (int tp : {2, 4}) {
      if (tp > nm.model->hparams().n_head_kv) continue;
      for (bool force_miss : {false, true}) {
        SCOPED_TRACE(nm.name + " TP" + std::to_string(tp) + (force_miss ? " forced misses" : " lambda 0"));
        const SpecConfig cfg = spec_config(16, force_miss ? 10.0f : 0.0f);
        const auto want = plain_greedy(*nm.model, nm.prompt, kTokens, cfg.layout);
        AlspecPair pair(*nm.model, {.spec = cfg, .n_ctx = 256, .tp = tp});
        if (force_miss) pair.set_verdict([](int, const SpecCheck&) { return false; });
        int speculated = 0;
        const auto got = pair.greedy(nm.prompt, kTokens, [&](const AlspecToken& t, int32_t, int32_t) {
          for (const SpecCheck& c : t.checks) speculated += !c.exact;
        });
        EXPECT_EQ(got, want);
        EXPECT_GT(speculated, 0);
        for (int r = 0; r < tp; ++r) expect_same_caches(pair, r);
      }
    }
  }
}

TEST(AlspecPair, TensorParallelGroupsHitAsOneDeviceDoes) {
  // With every speculation accepted, groups of 2 take the same path as single devices: the same
  // speculative outputs per head, the check's squares summed over the ranks, the same tokens.
  SPECMESH_REQUIRE_REFDATA();
  constexpr int kTokens = 50;
  for (auto& nm : all_models()) {
    if (nm.model->hparams().n_head_kv < 2) continue;
    SCOPED_TRACE(nm.name);
    const int L = nm.model->hparams().n_layer;
    const SpecConfig cfg = spec_config(16, 0.3f);
    AlspecPair one(*nm.model, {.spec = cfg, .n_ctx = 256});
    AlspecPair two(*nm.model, {.spec = cfg, .n_ctx = 256, .tp = 2});
    std::vector<AlspecToken> steps;
    const auto want = one.greedy(nm.prompt, kTokens, [&](const AlspecToken& t, int32_t, int32_t) { steps.push_back(t); });
    size_t i = 0;
    int hits = 0, misses = 0;
    const auto got = two.greedy(nm.prompt, kTokens, [&](const AlspecToken& t, int32_t, int32_t pos) {
      ASSERT_LT(i, steps.size());
      const AlspecToken& w = steps[i++];
      EXPECT_EQ(t.hits, w.hits) << "pos " << pos;
      EXPECT_EQ(t.holder, w.holder);
      for (int il = 0; il < L; ++il) {
        EXPECT_NEAR(t.checks[il].d2, w.checks[il].d2, 1e-4f * w.checks[il].n2 + 1e-12f);
        EXPECT_NEAR(t.checks[il].n2, w.checks[il].n2, 1e-5f * w.checks[il].n2);
        if (!t.checks[il].exact) (t.hits[il] ? hits : misses)++;
      }
      EXPECT_EQ(std::memcmp(t.logits.data(), w.logits.data(), w.logits.size() * 4), 0) << "pos " << pos;
      for (int r = 0; r < 2; ++r) expect_same_caches(two, r);
    });
    EXPECT_EQ(got, want);
    std::printf("%s lambda 0.3: %d speculative hits, %d misses\n", nm.name.c_str(), hits, misses);
    EXPECT_EQ(two.work(0, 0).sent + two.work(1, 0).sent, (kTokens - 1) * L);
    EXPECT_EQ(two.work(0, 1).sent, two.work(0, 0).sent) << "the ranks of a group take the same roles";
  }
}

}  // namespace

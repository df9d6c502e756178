// DFlash drafter: its forward pass against the training script's own PyTorch forward on the same
// weights (tests/data/dflash, written by `tools/dflash_drafter.py fixture tests/data/dflash`),
// the context-only draft cache, and bad drafter files refused with the file and the defect.
#include <gtest/gtest.h>

#include <cmath>
#include <cstdio>
#include <filesystem>
#include <fstream>
#include <regex>
#include <sstream>

#include "private_dir.hpp"
#include "refdata.hpp"
#include "specmesh/formats/safetensors.hpp"
#include "specmesh/kernels/quant.hpp"
#include "specmesh/kernels/thread_pool.hpp"
#include "specmesh/model/dflash_drafter.hpp"
#include "specmesh/model/synthetic.hpp"

using namespace specmesh;
namespace fs = std::filesystem;

namespace {

const std::string kFixture = std::string(SPECMESH_SOURCE_DIR) + "/tests/data/dflash";

// Pearson correlation of two equally long vectors.
double pcc(const float* a, const float* b, size_t n) {
  double ma = 0, mb = 0;
  for (size_t i = 0; i < n; ++i) ma += a[i], mb += b[i];
  ma /= double(n), mb /= double(n);
  double sab = 0, saa = 0, sbb = 0;
  for (size_t i = 0; i < n; ++i) {
    sab += (a[i] - ma) * (b[i] - mb);
    saa += (a[i] - ma) * (a[i] - ma);
    sbb += (b[i] - mb) * (b[i] - mb);
  }
  return sab / std::sqrt(saa * sbb);
}

std::vector<float> values(const SafetensorsTensor& t) {
  std::vector<float> v(size_t(t.n_elements()));
  dequantize_row(t.type, t.data, v.data(), v.size());
  return v;
}

struct Tensor {
  std::string name;
  std::vector<int64_t> shape;
  std::vector<float> v;
  DType type;
};

std::vector<Tensor> read_all(const std::string& path) {
  SafetensorsFile f(path);
  std::vector<Tensor> out;
  for (const SafetensorsTensor& t : f.tensors()) out.push_back({t.name, t.shape, values(t), t.type});
  return out;
}

void write_all(const std::string& path, const std::vector<Tensor>& ts) {
  std::vector<SafetensorsEntry> e;
  for (const Tensor& t : ts) e.push_back({t.name, t.shape, t.v, t.type});
  write_safetensors(path, e);
}

std::string read_text(const std::string& path) {
  std::ifstream f(path);
  std::stringstream s;
  s << f.rdbuf();
  return s.str();
}
void write_text(const std::string& path, const std::string& text) { std::ofstream(path) << text; }

// The fixture copied into a private folder, to be spoiled by a test.
struct DrafterCopy {
  specmesh::test::ScopedTempDir dir{"dflash"};
  DrafterCopy() {
    for (const char* f : {"config.json", "model.safetensors"}) fs::copy_file(kFixture + "/" + f, dir.path + "/" + f);
  }
  std::string config() const { return dir.path + "/config.json"; }
  std::string weights() const { return dir.path + "/model.safetensors"; }
  void edit_config(const std::string& from, const std::string& to) {
    std::string text = read_text(config());
    const size_t at = text.find(from);
    ASSERT_NE(at, std::string::npos) << from;
    write_text(config(), text.replace(at, from.size(), to));
  }
};

// The load error of DIR (empty when it loads and fits `target`, when given).
std::string load_error(const std::string& dir, const Model* target = nullptr) {
  try {
    auto d = DFlashDrafter::load(dir);
    if (target) d->check_target(*target);
  } catch (const FormatError& e) {
    return e.what();
  }
  return {};
}

// A random qwen3 target of the fixture's shape: 8 layers, 16 wide, 300 tokens.
std::unique_ptr<Model> fixture_target(int n_layer = 8, int n_embd = 16) {
  SyntheticSpec s;
  s.arch = "qwen3";
  s.n_vocab = 300;
  s.n_embd = n_embd;
  s.n_layer = n_layer;
  s.n_head = 4;
  s.n_head_kv = 2;
  s.n_ff = 32;
  s.n_threads = 1;
  specmesh::test::ScopedTempDir dir("dflash-target");
  write_synthetic_model(s, dir.path + "/t.gguf");
  return Model::load(dir.path + "/t.gguf");  // mapped: the file may go
}

}  // namespace

TEST(DFlashDrafter, LoadsThePublishedLayout) {
  auto d = DFlashDrafter::load(kFixture);
  const DFlashConfig& c = d->config();
  EXPECT_EQ(c.hidden_size, 16);
  EXPECT_EQ(c.n_layer, 2);
  EXPECT_EQ(c.n_head, 4);
  EXPECT_EQ(c.n_head_kv, 2);
  EXPECT_EQ(c.head_dim, 8);
  EXPECT_EQ(c.block_size, 4);
  EXPECT_EQ(c.target_layer_ids, (std::vector<int>{1, 3, 5}));
  EXPECT_EQ(c.mask_token_id, 9);
  EXPECT_EQ(d->layers.size(), 2u);
  EXPECT_EQ(d->fc.cols, 48u);
  EXPECT_EQ(d->fc.type, DType::F16);
  EXPECT_EQ(d->mask_embedding(), nullptr);
  auto target = fixture_target();
  EXPECT_NO_THROW(d->check_target(*target));
}

TEST(DFlashDrafter, ForwardMatchesTheTrainingScriptsForward) {
  auto d = DFlashDrafter::load(kFixture);
  const auto ref = read_all(kFixture + "/reference.safetensors");
  auto get = [&](const std::string& name) -> const std::vector<float>& {
    for (const Tensor& t : ref)
      if (t.name == name) return t.v;
    throw std::runtime_error("reference.safetensors lacks " + name);
  };
  const std::vector<float>& taps = get("taps");
  const std::vector<float>& steps = get("steps");  // (rows kept, context rows after the append) per step
  const size_t H = 16, T = 48, B = 4;
  ThreadPool pool(1);
  DFlashState st(*d, pool);
  for (size_t s = 0; s < steps.size() / 2; ++s) {
    const size_t keep = size_t(steps[2 * s]), total = size_t(steps[2 * s + 1]);
    st.crop(keep);
    const std::vector<float>& embd = get("embd" + std::to_string(s));
    const std::vector<float>& want = get("out" + std::to_string(s));
    const std::vector<float> got = st.step(taps.data() + keep * T, total - keep, embd.data(), B);
    ASSERT_EQ(got.size(), B * H);
    EXPECT_EQ(st.n_ctx(), total);  // context rows only: the block is not cached
    const double r = pcc(got.data(), want.data(), got.size());
    EXPECT_GE(r, 0.999) << "step " << s;
    double max_err = 0;
    for (size_t i = 0; i < got.size(); ++i) max_err = std::max(max_err, double(std::abs(got[i] - want[i])));
    EXPECT_LT(max_err, 1e-3) << "step " << s << " pcc " << r;
    std::printf("step %zu (%zu context rows): PCC %.7f, max |error| %.2e\n", s, total, r, max_err);
  }
}

TEST(DFlashDrafter, BlockPositionAndContextChangeTheOutput) {
  // Guards against a forward that ignores the context or the block's RoPE offset: the same block
  // after a different context (or none) gives a different output.
  auto d = DFlashDrafter::load(kFixture);
  ThreadPool pool(1);
  std::vector<float> taps(5 * 48), embd(4 * 16);
  for (size_t i = 0; i < taps.size(); ++i) taps[i] = std::sin(0.37f * float(i));
  for (size_t i = 0; i < embd.size(); ++i) embd[i] = std::cos(0.11f * float(i));
  DFlashState a(*d, pool), b(*d, pool);
  const std::vector<float> with5 = a.step(taps.data(), 5, embd.data(), 4);
  const std::vector<float> with3 = b.step(taps.data(), 3, embd.data(), 4);
  b.crop(0);
  const std::vector<float> none = b.step(nullptr, 0, embd.data(), 4);
  EXPECT_NE(with5, with3);
  EXPECT_NE(with3, none);
  EXPECT_THROW(b.crop(1), std::invalid_argument);
}

TEST(DFlashDrafter, AWindowKeepsOnlyTheLatestContextRows) {
  auto d = DFlashDrafter::load(kFixture);
  ThreadPool pool(1);
  std::vector<float> taps(5 * 48), other(5 * 48), more(2 * 48), embd(4 * 16);
  for (size_t i = 0; i < taps.size(); ++i) taps[i] = other[i] = std::sin(0.37f * float(i));
  for (size_t i = 0; i < 4 * 48; ++i) other[i] = std::cos(0.91f * float(i));  // rows 0..3 differ, row 4 the same
  for (size_t i = 0; i < more.size(); ++i) more[i] = std::sin(0.05f * float(i) + 1.0f);
  for (size_t i = 0; i < embd.size(); ++i) embd[i] = std::cos(0.11f * float(i));
  // A window wider than the context changes nothing.
  DFlashState all(*d, pool), wide(*d, pool, 100);
  EXPECT_EQ(all.step(taps.data(), 5, embd.data(), 4), wide.step(taps.data(), 5, embd.data(), 4));
  EXPECT_EQ(all.step(more.data(), 2, embd.data(), 4), wide.step(more.data(), 2, embd.data(), 4));
  // A window of 3: after 7 context rows only positions 4..6 count, whatever rows 0..3 held.
  DFlashState a(*d, pool, 3), b(*d, pool, 3);
  a.step(taps.data(), 5, embd.data(), 4);
  b.step(other.data(), 5, embd.data(), 4);
  const std::vector<float> wa = a.step(more.data(), 2, embd.data(), 4);
  EXPECT_EQ(wa, b.step(more.data(), 2, embd.data(), 4));
  EXPECT_NE(wa, all.step(nullptr, 0, embd.data(), 4));  // the unbounded cache sees all 7
  EXPECT_EQ(a.n_ctx(), 7u);
  a.crop(5);  // rows past the window stay a while for crops
  EXPECT_EQ(a.n_ctx(), 5u);
  EXPECT_EQ(a.first(), 0u);
  // Past the window and its slack they go.
  const size_t n = 3 + DFlashState::kCropSlack + 10;
  std::vector<float> many(n * 48);
  for (size_t i = 0; i < many.size(); ++i) many[i] = std::sin(0.013f * float(i));
  a.step(many.data(), n, embd.data(), 4);
  EXPECT_EQ(a.n_ctx(), 5 + n);
  EXPECT_EQ(a.first(), 5 + n - 3 - DFlashState::kCropSlack);
  EXPECT_THROW(a.crop(a.first() - 1), std::invalid_argument);  // those rows are gone
  a.crop(a.first());
  // Its cost stops growing with the context.
  auto target = fixture_target();
  EXPECT_EQ(d->cost(*target, 1, 4, 3, 3).context, 8);
}

TEST(DFlashDrafter, RefusesAMissingConfigKey) {
  DrafterCopy c;
  c.edit_config("\"block_size\": 4,", "");
  const std::string err = load_error(c.dir.path);
  EXPECT_EQ(err, c.config() + ": block_size: missing");
  DrafterCopy m;
  m.edit_config("\"mask_token_id\": 9,", "");
  EXPECT_EQ(load_error(m.dir.path), m.config() + ": dflash_config.mask_token_id: missing");
}

TEST(DFlashDrafter, RefusesBadConfigValuesNamingTheLine) {
  DrafterCopy c;
  c.edit_config("\"num_attention_heads\": 4", "\"num_attention_heads\": \"four\"");
  const std::string err = load_error(c.dir.path);
  EXPECT_TRUE(std::regex_search(err, std::regex(":[0-9]+: num_attention_heads: must be an integer"))) << err;
  EXPECT_EQ(err.rfind(c.config() + ":", 0), 0u) << err;

  DrafterCopy j;
  write_text(j.config(), "{\"hidden_size\": 16,");
  EXPECT_NE(load_error(j.dir.path).find(j.config() + ": not valid JSON"), std::string::npos);

  DrafterCopy l;
  l.edit_config("\"full_attention\",", "\"sliding_attention\",");
  EXPECT_NE(load_error(l.dir.path).find("layer_types: layer type \"sliding_attention\" is not supported"), std::string::npos);
}

TEST(DFlashDrafter, RefusesAMissingOrMisshapenTensor) {
  auto spoil = [](const std::function<void(std::vector<Tensor>&)>& f) {
    auto c = std::make_unique<DrafterCopy>();
    auto ts = read_all(c->weights());
    f(ts);
    write_all(c->weights(), ts);
    return c;
  };
  auto missing = spoil([](std::vector<Tensor>& ts) {
    std::erase_if(ts, [](const Tensor& t) { return t.name == "layers.1.mlp.up_proj.weight"; });
  });
  EXPECT_EQ(load_error(missing->dir.path),
            missing->weights() + ": missing tensor 'layers.1.mlp.up_proj.weight' (shape [24, 16])");

  auto shape = spoil([](std::vector<Tensor>& ts) {
    for (Tensor& t : ts)
      if (t.name == "fc.weight") t.shape = {32, 24};
  });
  EXPECT_EQ(load_error(shape->dir.path),
            shape->weights() + ": tensor 'fc.weight' has shape [32, 24], config.json gives [16, 48]");

  auto extra = spoil([](std::vector<Tensor>& ts) { ts.push_back({"layers.2.mlp.up_proj.weight", {1}, {1.0f}, DType::F32}); });
  EXPECT_NE(load_error(extra->dir.path).find("unexpected tensor 'layers.2.mlp.up_proj.weight'"), std::string::npos);

  DrafterCopy cut;
  fs::resize_file(cut.weights(), fs::file_size(cut.weights()) - 10);
  const std::string err = load_error(cut.dir.path);
  EXPECT_EQ(err.rfind(cut.weights() + ": ", 0), 0u) << err;
  EXPECT_NE(err.find("lies outside the data buffer"), std::string::npos) << err;

  DrafterCopy gone;
  fs::remove(gone.weights());
  EXPECT_NE(load_error(gone.dir.path).find(gone.weights() + ": cannot open"), std::string::npos);
}

TEST(DFlashDrafter, RefusesATapLayerBeyondTheTarget) {
  DrafterCopy c;
  c.edit_config("\"target_layer_ids\": [\n      1,\n      3,\n      5\n    ]", "\"target_layer_ids\": [1, 3, 8]");
  const std::string err = load_error(c.dir.path);
  EXPECT_TRUE(std::regex_search(err, std::regex(":[0-9]+: dflash_config.target_layer_ids: entry 8 is not a layer of the "
                                                "8-layer target")))
      << err;

  // A drafter made for a deeper target: its taps exist there, not in this one.
  DrafterCopy deep;
  deep.edit_config("\"num_target_layers\": 8", "\"num_target_layers\": 12");
  deep.edit_config("\"target_layer_ids\": [\n      1,\n      3,\n      5\n    ]", "\"target_layer_ids\": [1, 3, 10]");
  auto target = fixture_target();
  EXPECT_EQ(load_error(deep.dir.path),"");
  EXPECT_NE(load_error(deep.dir.path, target.get()).find(deep.config() + ": num_target_layers 12 differs from the 8 layers"),
            std::string::npos);

  auto narrow = fixture_target(8, 32);
  EXPECT_NE(load_error(kFixture, narrow.get()).find("hidden_size 16 differs from the embedding size 32"), std::string::npos);
}

TEST(DFlashDrafter, MaskIdMustBeInTheVocabularyOrTheDraftersOwn) {
  auto target = fixture_target();  // 300 tokens
  DrafterCopy outside;
  outside.edit_config("\"mask_token_id\": 9", "\"mask_token_id\": 300");
  EXPECT_EQ(load_error(outside.dir.path, target.get()),
            outside.config() + ": dflash_config.mask_token_id 300 is neither in the 300-token vocabulary of the target " +
                target->path() + " nor the drafter's own (model.safetensors has no mask_embedding)");

  // The format extension: the drafter's own mask row, under the id just past the vocabulary.
  DrafterCopy own;
  own.edit_config("\"mask_token_id\": 9", "\"mask_token_id\": 300");
  auto ts = read_all(own.weights());
  std::vector<float> mask(16);
  for (int i = 0; i < 16; ++i) mask[i] = 0.5f - 0.03f * float(i);
  ts.push_back({"mask_embedding", {16}, mask, DType::F32});
  write_all(own.weights(), ts);
  EXPECT_EQ(load_error(own.dir.path, target.get()), "");
  auto d = DFlashDrafter::load(own.dir.path);
  std::vector<float> block(3 * 16);
  d->embed_block(*target, 7, 3, block.data());
  for (int r = 1; r < 3; ++r)
    for (int i = 0; i < 16; ++i) EXPECT_EQ(block[r * 16 + i], mask[i]);
  std::vector<float> row7(16);
  dequantize_row(target->tok_embd.type,
                 static_cast<const uint8_t*>(target->tok_embd.data) + row_bytes(target->tok_embd.type, 16) * 7, row7.data(), 16);
  for (int i = 0; i < 16; ++i) EXPECT_EQ(block[i], row7[i]);

  // An own mask row under an id of the vocabulary is ambiguous.
  DrafterCopy both;
  write_all(both.weights(), ts);
  EXPECT_NE(load_error(both.dir.path, target.get()).find("must use the id just past the target's vocabulary (300)"),
            std::string::npos);
}

// `specmesh dflash-data` writes, beside the taps, the target's own greedy choice after every
// position. Where a story continues greedily (all of it at temperature 0; after the first N
// tokens with --greedy-after N) each next token must be that choice: generation (one token at a
// time) and the data's single pass over the whole sequence agree token for token.
TEST(DFlashData, GreedyLabelsAreTheTargetsOwnChoices) {
  SPECMESH_REQUIRE_REFDATA();
  specmesh::test::ScopedTempDir dir("dflash-data");
  for (const auto& [flags, sampled] : {std::pair<std::string, size_t>{"--temp 0", 0}, {"--temp 1 --greedy-after 10", 10}}) {
    SCOPED_TRACE(flags);
    const std::string out = dir.path + "/data.safetensors";
    const std::string cmd = std::string(SPECMESH_CLI_PATH) + " dflash-data -m " +
                            specmesh::test::refdata("gguf-models/stories-target-1M.gguf") + " --taps 1,5 --samples 3 --tokens 40 " +
                            flags + " --seed 7 -o " + out + " > " + dir.path + "/log 2>&1";
    ASSERT_EQ(std::system(cmd.c_str()), 0) << read_text(dir.path + "/log");
    SafetensorsFile f(out);
    for (const char* name : {"tokens", "greedy", "offsets", "taps", "tok_embd", "output"})
      ASSERT_NE(f.tensor(name), nullptr) << name;
    const std::vector<float> tokens = values(*f.tensor("tokens")), greedy = values(*f.tensor("greedy")),
                             offsets = values(*f.tensor("offsets"));
    ASSERT_EQ(greedy.size(), tokens.size());
    EXPECT_EQ(f.tensor("taps")->shape, (std::vector<int64_t>{int64_t(tokens.size()), 2 * 128}));
    ASSERT_EQ(offsets.size(), 4u);
    size_t checked = 0, sampled_off_greedy = 0;
    for (size_t s = 0; s + 1 < offsets.size(); ++s) {
      const size_t b = size_t(offsets[s]), e = size_t(offsets[s + 1]);
      // Position i holds the BOS (i = 0) or the i-th generated token.
      for (size_t i = b; i + 1 < e; ++i) {
        if (i - b >= sampled) {
          ASSERT_EQ(greedy[i], tokens[i + 1]) << "sequence " << s << ", position " << i - b;
          ++checked;
        } else {
          sampled_off_greedy += greedy[i] != tokens[i + 1];
        }
      }
    }
    EXPECT_GE(checked, 3u * 25);
    if (sampled > 0) EXPECT_GT(sampled_off_greedy, 0u) << "the first tokens were to be sampled at temperature 1";
  }
}

// Bad flags are refused up front, naming the flag, before any sampling (an unwritable output
// would otherwise fail only after minutes of it).
TEST(DFlashData, RefusesBadFlagsNamingThem) {
  SPECMESH_REQUIRE_REFDATA();
  specmesh::test::ScopedTempDir dir("dflash-data-bad");
  const std::string base = std::string(SPECMESH_CLI_PATH) + " dflash-data -m " +
                           specmesh::test::refdata("gguf-models/stories-target-1M.gguf") + " ";
  for (const auto& [flags, says] : std::vector<std::pair<std::string, std::string>>{
           {"--taps 1 --samples 0 -o " + dir.path + "/d.st", "--samples"},
           {"--taps 1 --tokens 0 -o " + dir.path + "/d.st", "--tokens"},
           {"--taps 1 --temp -1 -o " + dir.path + "/d.st", "--temp"},
           {"--taps 1 -t 0 -o " + dir.path + "/d.st", "--threads"},
           {"--taps 1 --greedy-after -2 -o " + dir.path + "/d.st", "--greedy-after"},
           {"--taps 9 -o " + dir.path + "/d.st", "layer 9"},
           {"--taps 1 -o " + dir.path + "/missing/d.st", "cannot write into " + dir.path + "/missing"}}) {
    SCOPED_TRACE(flags);
    const std::string log = dir.path + "/log";
    EXPECT_NE(std::system((base + flags + " > " + log + " 2>&1").c_str()), 0);
    EXPECT_NE(read_text(log).find(says), std::string::npos) << read_text(log);
    EXPECT_FALSE(fs::exists(dir.path + "/d.st"));
  }
}

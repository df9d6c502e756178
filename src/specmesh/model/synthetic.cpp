#include "specmesh/model/synthetic.hpp"

#include <cmath>
#include <cstdio>
#include <cstring>
#include <fstream>
#include <stdexcept>

#include "specmesh/formats/gguf.hpp"
#include "specmesh/formats/gguf_writer.hpp"
#include "specmesh/tokenizer/tokenizer.hpp"

namespace specmesh {

namespace {

[[noreturn]] void bad(const std::string& what) { throw std::invalid_argument("synthetic model: " + what); }

uint64_t splitmix64(uint64_t& state) {
  uint64_t z = (state += 0x9E3779B97F4A7C15ull);
  z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
  z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
  return z ^ (z >> 31);
}

uint64_t fnv1a(std::string_view s) {
  uint64_t h = 0xcbf29ce484222325ull;
  for (unsigned char c : s) h = (h ^ c) * 0x100000001b3ull;
  return h;
}

// Values offset + scale * z with z ~ approximately N(0, 1): the sum of the four 16-bit lanes of
// one splitmix64 draw (Irwin-Hall, n = 4), bounded by +-3.46 so no outlier blows up a quant block.
// Every row has its own stream, so the output does not depend on how rows are split over threads.
struct Filler {
  uint64_t seed;
  float scale;
  float offset;
  void operator()(int64_t row, float* dst, int64_t n) const {
    uint64_t s = seed ^ (uint64_t(row) * 0xD1B54A32D192ED03ull);
    splitmix64(s);
    constexpr float kMean = 4 * 32767.5f;
    const float k = scale / 37837.23f;  // 1 / std of the sum: 2 * sqrt((65536^2 - 1) / 12)
    for (int64_t i = 0; i < n; ++i) {
      const uint64_t z = splitmix64(s);
      const uint32_t sum = uint32_t(z & 0xffff) + uint32_t((z >> 16) & 0xffff) + uint32_t((z >> 32) & 0xffff) +
                           uint32_t(z >> 48);
      dst[i] = offset + (float(sum) - kMean) * k;
    }
  }
};

// Entries in a llama2.c tokenizer file: i32 max_len, then {f32 score, i32 len, bytes} until EOF.
int count_llama2c_tokens(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw FormatError(path + ": cannot open tokenizer file");
  f.seekg(0, std::ios::end);
  const int64_t size = f.tellg();
  f.seekg(0);
  std::vector<char> buf(static_cast<size_t>(size));
  f.read(buf.data(), size);
  int64_t off = 4, n = 0;
  while (off < size) {
    int32_t len;
    if (size - off < 8) throw FormatError(path + ": truncated token entry " + std::to_string(n));
    std::memcpy(&len, buf.data() + off + 4, 4);
    if (len < 0 || len > size - off - 8) throw FormatError(path + ": token " + std::to_string(n) + " runs past the end");
    off += 8 + len;
    ++n;
  }
  if (n == 0) throw FormatError(path + ": no tokens");
  return int(n);
}

// SPM vocabulary: <unk> <s> </s>, the 256 byte tokens (so any text encodes), then printable
// ASCII and U+2581, then every string of length 2, 3, ... over {U+2581, a..z}. All prefixes of
// a filler piece are pieces too, so BPE merges can reach each of them.
Vocab synthetic_vocab(int n_vocab) {
  if (n_vocab < 259) bad("a synthetic vocabulary needs at least 259 tokens (3 special + 256 bytes), got " + std::to_string(n_vocab));
  Vocab v;
  v.kind = VocabKind::Spm;
  v.pre = "default";
  auto add = [&](std::string piece, TokenType type, float score) {
    v.tokens.push_back(std::move(piece));
    v.types.push_back(type);
    v.scores.push_back(score);
  };
  add("<unk>", TokenType::Unknown, 0);
  add("<s>", TokenType::Control, 0);
  add("</s>", TokenType::Control, 0);
  v.unk = 0;
  v.bos = 1;
  v.eos = 2;
  for (int b = 0; b < 256; ++b) {
    char s[8];
    std::snprintf(s, sizeof s, "<0x%02X>", b);
    add(s, TokenType::Byte, 0);
  }
  const std::string space = "\xE2\x96\x81";
  float score = 0;
  auto filler = [&](std::string piece) {
    if (int(v.tokens.size()) < n_vocab) add(std::move(piece), TokenType::Normal, score--);
  };
  filler(space);
  for (char c = 0x21; c < 0x7f; ++c) filler(std::string(1, c));
  std::vector<std::string> alphabet{space};
  for (char c = 'a'; c <= 'z'; ++c) alphabet.emplace_back(1, c);
  std::vector<std::string> level(alphabet);
  while (int(v.tokens.size()) < n_vocab) {
    std::vector<std::string> longer;
    for (const auto& p : level) {
      for (const auto& a : alphabet) {
        if (int(v.tokens.size()) >= n_vocab) break;
        longer.push_back(p + a);
        filler(longer.back());
      }
    }
    level = std::move(longer);
  }
  return v;
}

void put_vocab(GgufWriter& w, const Vocab& v) {
  w.set_string("tokenizer.ggml.model", v.kind == VocabKind::Spm ? "llama" : "gpt2");
  w.set_string("tokenizer.ggml.pre", v.pre);
  w.set_array_strings("tokenizer.ggml.tokens", v.tokens);
  if (!v.scores.empty()) w.set_array_f32("tokenizer.ggml.scores", v.scores);
  std::vector<int32_t> types(v.types.size());
  for (size_t i = 0; i < types.size(); ++i) types[i] = static_cast<int32_t>(v.types[i]);
  w.set_array_i32("tokenizer.ggml.token_type", types);
  if (!v.merges.empty()) w.set_array_strings("tokenizer.ggml.merges", v.merges);
  auto id = [&](const char* key, int32_t x) {
    if (x >= 0) w.set_u32(key, uint32_t(x));
  };
  id("tokenizer.ggml.bos_token_id", v.bos);
  id("tokenizer.ggml.eos_token_id", v.eos);
  id("tokenizer.ggml.unknown_token_id", v.unk);
  id("tokenizer.ggml.padding_token_id", v.pad);
  id("tokenizer.ggml.eot_token_id", v.eot);
  w.set_bool("tokenizer.ggml.add_bos_token", v.add_bos);
  w.set_bool("tokenizer.ggml.add_eos_token", v.add_eos);
  w.set_bool("tokenizer.ggml.add_space_prefix", v.add_space_prefix);
}

// Writes the tokenizer keys and returns the vocabulary size.
int put_tokenizer(GgufWriter& w, const SyntheticSpec& s) {
  if (s.vocab_from.empty()) {
    put_vocab(w, synthetic_vocab(s.n_vocab));
    return s.n_vocab;
  }
  if (is_gguf_file(s.vocab_from)) {
    GgufFile src(s.vocab_from);
    const GgufValue* tokens = src.find("tokenizer.ggml.tokens");
    if (!tokens || !tokens->is_array() || tokens->elem_type != GgufType::STRING || tokens->strings.empty())
      throw FormatError(s.vocab_from + ": no tokenizer.ggml.tokens string array to copy");
    for (const auto& kv : src.metadata())
      if (kv.key.starts_with("tokenizer.")) w.set(kv.key, kv.value);
    return int(tokens->strings.size());
  }
  Vocab v = vocab_from_llama2c(s.vocab_from, count_llama2c_tokens(s.vocab_from));
  put_vocab(w, v);
  return int(v.tokens.size());
}

size_t block_of(DType t) {
  const DTypeTraits* tr = dtype_traits(static_cast<uint32_t>(t));
  if (!tr) bad("unsupported tensor type " + std::to_string(uint32_t(t)));
  return tr->block_elems;
}

}  // namespace

uint32_t llama_file_type(DType type) {
  switch (type) {
    case DType::F32: return 0;
    case DType::F16: return 1;
    case DType::Q4_0: return 2;
    case DType::Q8_0: return 7;
    case DType::Q4_K: return 14;  // Q4_K_S: every matrix Q4_K
    case DType::Q6_K: return 18;
    case DType::BF16: return 32;
  }
  bad("unsupported tensor type " + std::to_string(uint32_t(type)));
}

std::vector<std::string> synthetic_preset_names() {
  return {"tinyllama-1.1b", "stories260k", "tiny-llama", "tiny-qwen2", "tiny-qwen3", "qwen2.5-0.5b", "qwen3-0.6b"};
}

std::optional<SyntheticSpec> synthetic_preset(std::string_view name) {
  // arch, vocab, embd, layers, heads, kv heads, head dim, ff, ctx, theta, eps, tied
  auto make = [](const char* arch, int V, int E, int L, int H, int Hkv, int D, int F, int ctx, float theta,
                 float eps, bool tied) {
    SyntheticSpec s;
    s.arch = arch;
    s.n_vocab = V;
    s.n_embd = E;
    s.n_layer = L;
    s.n_head = H;
    s.n_head_kv = Hkv;
    s.head_dim = D;
    s.n_ff = F;
    s.n_ctx = ctx;
    s.rope_theta = theta;
    s.rms_eps = eps;
    s.tied_output = tied;
    return s;
  };
  if (name == "tinyllama-1.1b") return make("llama", 32000, 2048, 22, 32, 4, 64, 5632, 2048, 10000.f, 1e-5f, false);
  if (name == "stories260k") return make("llama", 512, 64, 5, 8, 4, 8, 172, 512, 10000.f, 1e-5f, false);
  // Tiny shapes whose row lengths are multiples of 256, so every type (K-quants too) applies.
  if (name == "tiny-llama") return make("llama", 512, 256, 4, 8, 4, 32, 768, 1024, 10000.f, 1e-5f, false);
  if (name == "tiny-qwen2") return make("qwen2", 512, 256, 4, 8, 2, 32, 768, 2048, 1e6f, 1e-6f, true);
  // n_head * head_dim (512) != n_embd (256), as in real Qwen3 models.
  if (name == "tiny-qwen3") return make("qwen3", 512, 256, 4, 8, 2, 64, 768, 4096, 1e6f, 1e-6f, true);
  if (name == "qwen2.5-0.5b") return make("qwen2", 151936, 896, 24, 14, 2, 64, 4864, 32768, 1e6f, 1e-6f, true);
  if (name == "qwen3-0.6b") return make("qwen3", 151936, 1024, 28, 16, 8, 128, 3072, 40960, 1e6f, 1e-6f, true);
  return std::nullopt;
}

void write_synthetic_model(const SyntheticSpec& spec, const std::string& path) {
  SyntheticSpec s = spec;
  if (s.arch != "llama" && s.arch != "qwen2" && s.arch != "qwen3") bad("unknown arch '" + s.arch + "' (llama, qwen2, qwen3)");
  auto positive = [](const char* what, int v) {
    if (v <= 0) bad(std::string(what) + " must be positive, got " + std::to_string(v));
  };
  positive("n_embd", s.n_embd);
  positive("n_layer", s.n_layer);
  positive("n_head", s.n_head);
  positive("n_head_kv", s.n_head_kv);
  positive("n_ff", s.n_ff);
  positive("n_ctx", s.n_ctx);
  if (s.head_dim == 0) {
    if (s.n_embd % s.n_head != 0) bad("n_embd " + std::to_string(s.n_embd) + " is not a multiple of n_head; give head_dim");
    s.head_dim = s.n_embd / s.n_head;
  }
  positive("head_dim", s.head_dim);
  if (s.head_dim % 2 != 0) bad("head_dim must be even (RoPE rotates pairs)");
  if (s.n_head % s.n_head_kv != 0) bad("n_head must be a multiple of n_head_kv");
  if (!(s.rope_theta > 0) || !(s.rms_eps > 0)) bad("rope_theta and rms_eps must be positive");
  block_of(s.weight_type);
  block_of(s.embd_type);

  GgufWriter w;
  w.set_threads(s.n_threads);
  const std::string& a = s.arch;
  w.set_string("general.architecture", a);
  w.set_string("general.name", "synthetic-" + a);
  w.set_u32("general.file_type", llama_file_type(s.weight_type));
  w.set_u32("general.quantization_version", 2);
  w.set_u64("general.synthetic.seed", s.seed);
  w.set_u32(a + ".context_length", uint32_t(s.n_ctx));
  w.set_u32(a + ".embedding_length", uint32_t(s.n_embd));
  w.set_u32(a + ".block_count", uint32_t(s.n_layer));
  w.set_u32(a + ".feed_forward_length", uint32_t(s.n_ff));
  w.set_u32(a + ".attention.head_count", uint32_t(s.n_head));
  w.set_u32(a + ".attention.head_count_kv", uint32_t(s.n_head_kv));
  w.set_u32(a + ".attention.key_length", uint32_t(s.head_dim));
  w.set_u32(a + ".attention.value_length", uint32_t(s.head_dim));
  w.set_u32(a + ".rope.dimension_count", uint32_t(s.head_dim));
  w.set_f32(a + ".rope.freq_base", s.rope_theta);
  w.set_f32(a + ".attention.layer_norm_rms_epsilon", s.rms_eps);
  s.n_vocab = put_tokenizer(w, s);
  w.set_u32(a + ".vocab_size", uint32_t(s.n_vocab));

  const int64_t E = s.n_embd, V = s.n_vocab, F = s.n_ff, D = s.head_dim;
  const int64_t Q = int64_t(s.n_head) * D, KV = int64_t(s.n_head_kv) * D;
  // Input projections keep unit-variance inputs at unit variance (std 1/sqrt(fan_in)); the
  // projections into the residual stream are further scaled by 1/sqrt(2 n_layer) (GPT-2
  // style) so the stream stays bounded however deep the model is.
  const float resid = 1.0f / std::sqrt(2.0f * float(s.n_layer));
  auto tensor = [&](const std::string& name, DType type, std::vector<int64_t> ne, float scale, float offset) {
    if (ne.size() == 2 && ne[0] % int64_t(block_of(type)) != 0) type = DType::F16;
    if (ne.size() == 1) type = DType::F32;  // norms and biases stay F32, as llama.cpp keeps them
    const Filler fill{fnv1a(name) ^ (s.seed * 0x9E3779B97F4A7C15ull), scale, offset};
    const int64_t n = ne[0];
    w.add_tensor_rows_f32(name, type, ne, [fill, n](int64_t row, float* dst) { fill(row, dst, n); });
  };
  auto matrix = [&](const std::string& name, DType type, int64_t n_in, int64_t n_out, float extra = 1.0f) {
    tensor(name, type, {n_in, n_out}, extra / std::sqrt(float(n_in)), 0.0f);
  };
  auto norm = [&](const std::string& name, int64_t n) { tensor(name, DType::F32, {n}, 0.02f, 1.0f); };

  const DType wt = s.weight_type;
  // Embedding rows have unit-variance elements like the normalised activations, so the
  // current token stays as visible in the residual stream as what the layers add (with
  // 1/sqrt(n_embd) it drowns and an untied random model repeats one token whatever the
  // input). Logits get a std of about kLogitStd: from output.weight, or, when the classifier
  // is the unit-scale embedding itself, from a smaller output_norm. Tied random models still
  // tend to echo the current token under greedy decoding (its classifier row is its own
  // embedding, present in the residual stream); no embedding scale avoids a fixed point there.
  constexpr float kLogitStd = 4.0f;
  tensor("token_embd.weight", s.embd_type, {E, V}, 1.0f, 0.0f);
  if (s.tied_output) {
    const float g = kLogitStd / std::sqrt(float(E));
    tensor("output_norm.weight", DType::F32, {E}, 0.02f * g, g);
  } else {
    norm("output_norm.weight", E);
    matrix("output.weight", wt, E, V, kLogitStd);
  }
  for (int l = 0; l < s.n_layer; ++l) {
    const std::string p = "blk." + std::to_string(l) + ".";
    norm(p + "attn_norm.weight", E);
    matrix(p + "attn_q.weight", wt, E, Q);
    matrix(p + "attn_k.weight", wt, E, KV);
    matrix(p + "attn_v.weight", wt, E, KV);
    if (a == "qwen2") {
      tensor(p + "attn_q.bias", DType::F32, {Q}, 0.1f, 0.0f);
      tensor(p + "attn_k.bias", DType::F32, {KV}, 0.1f, 0.0f);
      tensor(p + "attn_v.bias", DType::F32, {KV}, 0.1f, 0.0f);
    }
    if (a == "qwen3") {
      norm(p + "attn_q_norm.weight", D);
      norm(p + "attn_k_norm.weight", D);
    }
    matrix(p + "attn_output.weight", wt, Q, E, resid);
    norm(p + "ffn_norm.weight", E);
    matrix(p + "ffn_gate.weight", wt, E, F);
    matrix(p + "ffn_up.weight", wt, E, F);
    matrix(p + "ffn_down.weight", wt, F, E, resid);
  }
  w.write(path);
}

}  // namespace specmesh

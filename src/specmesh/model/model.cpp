#include "specmesh/model/model.hpp"

#include <cstdint>
#include <cstring>

#include "specmesh/formats/gguf.hpp"
#include "specmesh/kernels/packed_weights.hpp"
#include "specmesh/kernels/quant.hpp"

namespace specmesh {

std::unique_ptr<Model> Model::load(const std::string& path, const std::string& tokenizer_path) {
  MappedFile file(path);
  if (is_gguf_file(file) || tokenizer_path.empty()) return load(std::move(file));
  const MappedFile tokenizer(tokenizer_path);
  return load(std::move(file), &tokenizer);
}

std::unique_ptr<Model> Model::load(MappedFile file, const MappedFile* tokenizer) {
  std::unique_ptr<Model> m(new Model());
  m->path_ = file.path();
  // GGUF files say so; llama2.c checkpoints start with a bare header.
  if (is_gguf_file(file)) m->load_gguf(std::move(file));
  else m->load_llama2c(std::move(file), tokenizer);
  return m;
}

size_t Model::weight_bytes_per_token() const {
  auto bytes = [](const WeightView& w) { return w.data ? row_bytes(w.type, w.cols) * w.rows : 0; };
  size_t total = bytes(output) + row_bytes(tok_embd.type, tok_embd.cols);
  for (const auto& l : layers)
    total += bytes(l.wq) + bytes(l.wk) + bytes(l.wv) + bytes(l.wo) + bytes(l.w_gate) + bytes(l.w_up) + bytes(l.w_down);
  return total;
}

bool Model::stops_at(int32_t token) const {
  if (format_ == "llama2c") return token == tokenizer_->bos();
  return tokenizer_->is_eog(token);
}

// ---------------------------------------------------------------- GGUF

void Model::load_gguf(MappedFile file) {
  format_ = "gguf";
  gguf_ = std::make_shared<GgufFile>(std::move(file));
  const GgufFile& f = *gguf_;
  const std::string& path = f.path();
  auto fail = [&](const std::string& what) -> void { throw FormatError(path + ": " + what); };

  std::string arch = f.get_string("general.architecture").value_or("");
  const ArchSpec* spec = find_arch(arch);
  if (!spec) fail("unsupported architecture '" + arch + "' (supported: " + arch_names() + ")");
  hp_.arch = spec->arch;

  auto req = [&](const std::string& key) -> int {
    auto v = f.get_int(arch + "." + key);
    if (!v) fail("missing metadata '" + arch + "." + key + "'");
    if (*v <= 0 || *v > (1 << 24)) fail("metadata '" + arch + "." + key + "' has invalid value " + std::to_string(*v));
    return static_cast<int>(*v);
  };
  hp_.n_embd = req("embedding_length");
  hp_.n_layer = req("block_count");
  hp_.n_ff = req("feed_forward_length");
  hp_.n_head = req("attention.head_count");
  hp_.n_head_kv = f.get_int(arch + ".attention.head_count_kv") ? req("attention.head_count_kv") : hp_.n_head;
  hp_.head_dim = f.get_int(arch + ".attention.key_length") ? req("attention.key_length") : hp_.n_embd / hp_.n_head;
  hp_.n_ctx_train = f.get_int(arch + ".context_length") ? req("context_length") : 2048;
  hp_.n_rot = f.get_int(arch + ".rope.dimension_count") ? req("rope.dimension_count") : hp_.head_dim;
  hp_.rms_eps = static_cast<float>(f.get_float(arch + ".attention.layer_norm_rms_epsilon").value_or(1e-5));
  hp_.rope_theta = static_cast<float>(f.get_float(arch + ".rope.freq_base").value_or(10000.0));
  hp_.rope = spec->rope;
  if (hp_.n_head % hp_.n_head_kv != 0) fail("head_count is not a multiple of head_count_kv");
  // Each is at most 2^24, their product need not be: it must fit the int that q_dim() returns.
  if (int64_t(hp_.n_head) * hp_.head_dim > (1 << 24))
    fail("attention.head_count x attention.key_length = " + std::to_string(int64_t(hp_.n_head) * hp_.head_dim) +
         " is larger than 2^24");
  if (hp_.n_rot > hp_.head_dim || hp_.n_rot % 2) fail("rope.dimension_count must be even and at most the head size");

  auto tensor = [&](const std::string& name, std::initializer_list<int64_t> shape, bool optional = false) -> const GgufTensorInfo* {
    const GgufTensorInfo* t = f.tensor(name);
    if (!t) {
      if (optional) return nullptr;
      fail("missing tensor '" + name + "'");
    }
    size_t d = 0;
    for (int64_t want : shape) {
      if (t->ne[d] != want) {
        auto join = [](auto begin, auto end) {
          std::string text;
          for (auto it = begin; it != end; ++it) {
            if (it != begin) text += ',';
            text += std::to_string(*it);
          }
          return text;
        };
        const std::string got = join(t->ne, t->ne + t->n_dims), exp = join(shape.begin(), shape.end());
        fail("tensor '" + name + "' has shape {" + got + "}, expected {" + exp + "}");
      }
      ++d;
    }
    for (; d < 4; ++d)
      if (t->ne[d] != 1) fail("tensor '" + name + "' has more dimensions than expected");
    return t;
  };
  auto matrix = [&](const std::string& name, int64_t cols, int64_t rows) {
    const GgufTensorInfo* t = tensor(name, {cols, rows});
    return WeightView{t->type, t->data, size_t(rows), size_t(cols)};
  };
  auto vec = [&](const std::string& name, int64_t n, bool optional = false) -> const float* {
    const GgufTensorInfo* t = tensor(name, {n}, optional);
    if (!t) return nullptr;
    if (t->type == DType::F32 && reinterpret_cast<uintptr_t>(t->data) % alignof(float) == 0)
      return reinterpret_cast<const float*>(t->data);
    owned_.emplace_back(n);
    dequantize_row(t->type, t->data, owned_.back().data(), n);
    return owned_.back().data();
  };

  const GgufTensorInfo* emb = f.tensor("token_embd.weight");
  if (!emb) fail("missing tensor 'token_embd.weight'");
  hp_.n_vocab = static_cast<int>(emb->ne[1]);
  const int E = hp_.n_embd, V = hp_.n_vocab;
  tok_embd = matrix("token_embd.weight", E, V);
  output_norm = vec("output_norm.weight", E);
  output = f.tensor("output.weight") ? matrix("output.weight", E, V) : tok_embd;  // tied when absent

  // Layer by layer: a block_count (up to 2^24) that the file has no tensors for fails at the
  // first missing one, rather than after allocating that many layers.
  for (int i = 0; i < hp_.n_layer; ++i) {
    const std::string p = "blk." + std::to_string(i) + ".";
    auto& l = layers.emplace_back();
    l.attn_norm = vec(p + "attn_norm.weight", E);
    l.wq = matrix(p + "attn_q.weight", E, hp_.q_dim());
    l.wk = matrix(p + "attn_k.weight", E, hp_.kv_dim());
    l.wv = matrix(p + "attn_v.weight", E, hp_.kv_dim());
    l.wo = matrix(p + "attn_output.weight", hp_.q_dim(), E);
    spec->load_layer([&](const std::string& name, int64_t n) { return vec(name, n); }, p, hp_, l);
    l.ffn_norm = vec(p + "ffn_norm.weight", E);
    l.w_gate = matrix(p + "ffn_gate.weight", E, hp_.n_ff);
    l.w_up = matrix(p + "ffn_up.weight", E, hp_.n_ff);
    l.w_down = matrix(p + "ffn_down.weight", hp_.n_ff, E);
  }
  pack_for_kernels();

  Vocab vocab = vocab_from_gguf(f);
  if (static_cast<int>(vocab.tokens.size()) > V) fail("vocabulary has more tokens than token_embd has rows");
  tokenizer_ = std::make_unique<Tokenizer>(std::move(vocab));
}

// Gives every matrix the matmul path would read faster rearranged its packed copy (the
// embedding's rows stay as stored: they are looked up, not multiplied).
void Model::pack_for_kernels() {
  auto pack = [&](WeightView& w) {
    if (!PackedWeights::wanted(w.type)) return;
    packed_.emplace_back(w);
    w.packed = packed_.back().data();
  };
  pack(output);
  for (auto& l : layers)
    for (WeightView* w : {&l.wq, &l.wk, &l.wv, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) pack(*w);
}

// ---------------------------------------------------------------- llama2.c

void Model::load_llama2c(MappedFile file, const MappedFile* tokenizer) {
  format_ = "llama2c";
  map_ = std::move(file);
  const std::string& path = map_.path();
  auto fail = [&](const std::string& what) -> void { throw FormatError(path + ": " + what); };
  if (map_.size() < 28) fail("too small for a llama2.c header (and not a GGUF file)");
  int32_t h[7];
  std::memcpy(h, map_.data(), sizeof h);
  const int dim = h[0], hidden = h[1], n_layers = h[2], n_heads = h[3], n_kv = h[4], seq_len = h[6];
  // vocab_size's sign says whether the classifier shares the embedding's weights; its
  // magnitude must be a vocabulary size (INT32_MIN has no positive counterpart).
  if (h[5] == 0 || h[5] == INT32_MIN)
    fail("not a GGUF file and not a valid llama2.c checkpoint header (vocab_size " + std::to_string(h[5]) +
         " is not a vocabulary size)");
  const bool shared = h[5] > 0;
  const int vocab = shared ? h[5] : -h[5];
  if (dim <= 0 || hidden <= 0 || n_layers <= 0 || n_heads <= 0 || n_kv <= 0 || vocab <= 0 || seq_len <= 0 ||
      dim > 65536 || hidden > 262144 || n_layers > 4096 || vocab > (1 << 22) || seq_len > (1 << 22) ||
      dim % n_heads || n_heads % n_kv)
    fail("not a GGUF file and not a valid llama2.c checkpoint header");
  const int head = dim / n_heads, kv_dim = n_kv * head;

  hp_.arch = kLlamaArch.arch;
  hp_.n_vocab = vocab;
  hp_.n_embd = dim;
  hp_.n_layer = n_layers;
  hp_.n_head = n_heads;
  hp_.n_head_kv = n_kv;
  hp_.head_dim = head;
  hp_.n_ff = hidden;
  hp_.n_ctx_train = seq_len;
  hp_.n_rot = head;
  hp_.rms_eps = 1e-5f;
  hp_.rope_theta = 10000.0f;
  hp_.rope = kLlamaArch.rope;

  const size_t L = n_layers;
  const size_t floats = size_t(vocab) * dim + L * dim + L * dim * dim + 2 * L * dim * kv_dim + L * dim * dim + L * dim +
                        3 * L * dim * hidden + dim + size_t(seq_len) * head + (shared ? 0 : size_t(vocab) * dim);
  if (map_.size() != 28 + floats * 4)
    fail("size " + std::to_string(map_.size()) + " does not match its header (expected " + std::to_string(28 + floats * 4) + " bytes)");

  const float* p = reinterpret_cast<const float*>(map_.data() + 28);
  auto take = [&](size_t n) { const float* r = p; p += n; return r; };
  auto mat = [](const float* d, size_t rows, size_t cols) { return WeightView{DType::F32, d, rows, cols}; };
  const float* emb = take(size_t(vocab) * dim);
  const float* rms_att = take(L * dim);
  const float* wq = take(L * dim * dim);
  const float* wk = take(L * dim * kv_dim);
  const float* wv = take(L * dim * kv_dim);
  const float* wo = take(L * dim * dim);
  const float* rms_ffn = take(L * dim);
  const float* w1 = take(L * dim * hidden);
  const float* w2 = take(L * hidden * dim);
  const float* w3 = take(L * dim * hidden);
  output_norm = take(dim);
  take(size_t(seq_len) * head);  // legacy freq_cis tables: RoPE is computed, not read
  tok_embd = mat(emb, vocab, dim);
  output = shared ? tok_embd : mat(take(size_t(vocab) * dim), vocab, dim);

  layers.resize(L);
  for (size_t i = 0; i < L; ++i) {
    auto& l = layers[i];
    l.attn_norm = rms_att + i * dim;
    l.wq = mat(wq + i * dim * dim, dim, dim);
    l.wk = mat(wk + i * dim * kv_dim, kv_dim, dim);
    l.wv = mat(wv + i * dim * kv_dim, kv_dim, dim);
    l.wo = mat(wo + i * dim * dim, dim, dim);
    l.ffn_norm = rms_ffn + i * dim;
    l.w_gate = mat(w1 + i * dim * hidden, hidden, dim);
    l.w_down = mat(w2 + i * hidden * dim, dim, hidden);
    l.w_up = mat(w3 + i * dim * hidden, hidden, dim);
  }

  if (!tokenizer) fail("a llama2.c checkpoint needs its tokenizer file (-z tok512.bin)");
  tokenizer_ = std::make_unique<Tokenizer>(vocab_from_llama2c(*tokenizer, vocab));
}

}  // namespace specmesh

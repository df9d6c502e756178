#include "specmesh/model/dflash_drafter.hpp"

#include <cmath>
#include <cstring>
#include <fstream>
#include <numeric>
#include <set>
#include <sstream>

#include "specmesh/kernels/flash_decode.hpp"
#include "specmesh/kernels/ops.hpp"
#include "specmesh/kernels/quant.hpp"
#include "specmesh/kernels/thread_pool.hpp"
#include "specmesh/messages/protocol.hpp"

namespace specmesh {

namespace {

std::string shape_text(const std::vector<int64_t>& s) {
  std::string t = "[";
  for (size_t i = 0; i < s.size(); ++i) t += (i ? ", " : "") + std::to_string(s[i]);
  return t + "]";
}

std::string read_text(const std::string& path) {
  std::ifstream f(path, std::ios::binary);
  if (!f) throw FormatError(path + ": cannot open");
  std::ostringstream s;
  s << f.rdbuf();
  return s.str();
}

}  // namespace

std::unique_ptr<DFlashDrafter> DFlashDrafter::load(const std::string& dir) {
  std::unique_ptr<DFlashDrafter> d(new DFlashDrafter());
  d->dir_ = dir;
  d->config_path_ = dir + "/config.json";
  d->cfg_ = parse_dflash_config(read_text(d->config_path_), d->config_path_);
  d->weights_ = std::make_unique<SafetensorsFile>(dir + "/model.safetensors");
  const SafetensorsFile& f = *d->weights_;
  const DFlashConfig& c = d->cfg_;
  const int64_t H = c.hidden_size, Q = c.q_dim(), KV = c.kv_dim(), F = c.intermediate_size, D = c.head_dim;

  std::set<std::string> used;
  auto get = [&](const std::string& name, std::vector<int64_t> shape) -> const SafetensorsTensor& {
    const SafetensorsTensor* t = f.tensor(name);
    if (!t) throw FormatError(f.path() + ": missing tensor '" + name + "' (shape " + shape_text(shape) + ")");
    if (t->shape != shape)
      throw FormatError(f.path() + ": tensor '" + name + "' has shape " + shape_text(t->shape) + ", config.json gives " +
                        shape_text(shape));
    used.insert(name);
    return *t;
  };
  auto matrix = [&](const std::string& name, int64_t rows, int64_t cols) {
    const SafetensorsTensor& t = get(name, {rows, cols});
    return WeightView{t.type, t.data, size_t(rows), size_t(cols)};
  };
  auto vector = [&](const std::string& name, int64_t n) -> const float* {
    const SafetensorsTensor& t = get(name, {n});
    std::vector<float>& v = d->owned_.emplace_back(size_t(n));
    dequantize_row(t.type, t.data, v.data(), size_t(n));
    return v.data();
  };

  d->fc = matrix("fc.weight", H, H * c.n_taps());
  d->hidden_norm = vector("hidden_norm.weight", H);
  d->norm = vector("norm.weight", H);
  for (int il = 0; il < c.n_layer; ++il) {
    const std::string p = "layers." + std::to_string(il) + ".";
    DFlashLayer& l = d->layers.emplace_back();
    l.attn_norm = vector(p + "input_layernorm.weight", H);
    l.ffn_norm = vector(p + "post_attention_layernorm.weight", H);
    l.q_norm = vector(p + "self_attn.q_norm.weight", D);
    l.k_norm = vector(p + "self_attn.k_norm.weight", D);
    l.wq = matrix(p + "self_attn.q_proj.weight", Q, H);
    l.wk = matrix(p + "self_attn.k_proj.weight", KV, H);
    l.wv = matrix(p + "self_attn.v_proj.weight", KV, H);
    l.wo = matrix(p + "self_attn.o_proj.weight", H, Q);
    l.w_gate = matrix(p + "mlp.gate_proj.weight", F, H);
    l.w_up = matrix(p + "mlp.up_proj.weight", F, H);
    l.w_down = matrix(p + "mlp.down_proj.weight", H, F);
  }
  if (f.tensor("mask_embedding")) d->mask_embd_ = vector("mask_embedding", H);
  for (const SafetensorsTensor& t : f.tensors())
    if (!used.count(t.name))
      throw FormatError(f.path() + ": unexpected tensor '" + t.name + "' (not part of a " + std::to_string(c.n_layer) +
                        "-layer drafter with " + std::to_string(c.n_taps()) + " taps)");
  return d;
}

void DFlashDrafter::check_target(const Model& target) const {
  const HParams& hp = target.hparams();
  const std::string& cp = config_path_;
  const std::string what = " of the target " + target.path();
  if (cfg_.hidden_size != hp.n_embd)
    throw FormatError(cp + ": hidden_size " + std::to_string(cfg_.hidden_size) + " differs from the embedding size " +
                      std::to_string(hp.n_embd) + what);
  if (cfg_.num_target_layers != hp.n_layer)
    throw FormatError(cp + ": num_target_layers " + std::to_string(cfg_.num_target_layers) + " differs from the " +
                      std::to_string(hp.n_layer) + " layers" + what);
  for (int id : cfg_.target_layer_ids)
    if (id >= hp.n_layer)
      throw FormatError(cp + ": dflash_config.target_layer_ids: layer " + std::to_string(id) + " is beyond the " +
                        std::to_string(hp.n_layer) + " layers" + what);
  if (cfg_.vocab_size && cfg_.vocab_size != hp.n_vocab)
    throw FormatError(cp + ": vocab_size " + std::to_string(cfg_.vocab_size) + " differs from the " +
                      std::to_string(hp.n_vocab) + "-token vocabulary" + what);
  if (mask_embd_) {
    if (cfg_.mask_token_id != hp.n_vocab)
      throw FormatError(cp + ": dflash_config.mask_token_id " + std::to_string(cfg_.mask_token_id) +
                        ": a drafter with its own mask_embedding must use the id just past the target's vocabulary (" +
                        std::to_string(hp.n_vocab) + ")");
  } else if (cfg_.mask_token_id >= hp.n_vocab) {
    throw FormatError(cp + ": dflash_config.mask_token_id " + std::to_string(cfg_.mask_token_id) +
                      " is neither in the " + std::to_string(hp.n_vocab) + "-token vocabulary" + what +
                      " nor the drafter's own (model.safetensors has no mask_embedding)");
  }
}

void DFlashDrafter::embed_block(const Model& target, int32_t anchor, int n, float* out) const {
  const size_t H = size_t(cfg_.hidden_size);
  const WeightView& w = target.tok_embd;
  auto row = [&](int64_t id, float* dst) {
    if (id < 0 || id >= int64_t(w.rows)) throw std::invalid_argument("token id " + std::to_string(id) + " out of range");
    dequantize_row(w.type, static_cast<const uint8_t*>(w.data) + row_bytes(w.type, w.cols) * size_t(id), dst, H);
  };
  row(anchor, out);
  for (int i = 1; i < n; ++i) {
    if (mask_embd_) std::memcpy(out + i * H, mask_embd_, H * sizeof(float));
    else row(cfg_.mask_token_id, out + i * H);
  }
}

WorkCost DFlashDrafter::cost(const Model& target, size_t n_new, size_t n_block, size_t n_ctx, size_t outputs) const {
  auto bytes = [](const WeightView& w) { return double(row_bytes(w.type, w.cols)) * w.rows; };
  auto params = [](const WeightView& w) { return double(w.rows) * w.cols; };
  const double keys = double(n_ctx + n_new + n_block);
  WorkCost c;
  c.tokens = int(n_block);
  c.layers = int(layers.size());
  c.context = int64_t(keys);
  c.head = outputs > 0;
  c.bytes = bytes(fc);
  c.flops = 2 * params(fc) * double(n_new);
  for (const DFlashLayer& l : layers) {
    for (const WeightView* m : {&l.wk, &l.wv}) {
      c.bytes += bytes(*m);
      c.flops += 2 * params(*m) * double(n_new + n_block);
    }
    for (const WeightView* m : {&l.wq, &l.wo, &l.w_gate, &l.w_up, &l.w_down}) {
      c.bytes += bytes(*m);
      c.flops += 2 * params(*m) * double(n_block);
    }
    c.bytes += 2.0 * keys * cfg_.kv_dim() * sizeof(float);
    c.flops += 4.0 * double(n_block) * keys * cfg_.q_dim();
    c.ops += 12;
  }
  if (outputs) {
    c.bytes += bytes(target.output);
    c.flops += 2 * params(target.output) * double(outputs);
    c.ops += 1;
  }
  return c;
}

// ---------------------------------------------------------------- forward

DFlashState::DFlashState(const DFlashDrafter& drafter, ThreadPool& pool, size_t window)
    : d_(drafter), pool_(pool), window_(window), k_(drafter.layers.size()), v_(drafter.layers.size()) {}

void DFlashState::crop(size_t n) {
  if (n > n_ctx_) throw std::invalid_argument("cannot crop the draft cache to " + std::to_string(n) + " rows: it holds " +
                                              std::to_string(n_ctx_));
  if (n < first_)
    throw std::invalid_argument("cannot crop the draft cache to " + std::to_string(n) + " rows: its window starts at " +
                                std::to_string(first_));
  n_ctx_ = n;
  const size_t KV = size_t(d_.config().kv_dim());
  for (size_t il = 0; il < k_.size(); ++il) {
    k_[il].resize((n - first_) * KV);
    v_[il].resize((n - first_) * KV);
  }
}

void DFlashState::shift(size_t n_keep, size_t n_discard) {
  const DFlashConfig& c = d_.config();
  const size_t KV = size_t(c.kv_dim()), end = n_keep + n_discard;
  const auto moved = [&](size_t p) { return size_t(shifted_position(int64_t(p), int64_t(n_keep), int64_t(n_discard))); };
  // Rows (indices from first_) that go, and those that move.
  const size_t gone_begin = std::clamp(n_keep, first_, n_ctx_) - first_, gone_end = std::clamp(end, first_, n_ctx_) - first_;
  for (size_t il = 0; il < k_.size(); ++il) {
    k_[il].erase(k_[il].begin() + long(gone_begin * KV), k_[il].begin() + long(gone_end * KV));
    v_[il].erase(v_[il].begin() + long(gone_begin * KV), v_[il].begin() + long(gone_end * KV));
    for (size_t r = gone_begin; r * KV < k_[il].size(); ++r)
      rope(k_[il].data() + r * KV, c.n_head_kv, c.head_dim, c.head_dim, -int32_t(n_discard), c.rope_theta, RopeStyle::Neox);
  }
  n_ctx_ = moved(n_ctx_);
  first_ = moved(first_);
}

const std::vector<float>& DFlashState::step(const float* taps, size_t n_new, const float* embd, size_t n_block) {
  const DFlashConfig& c = d_.config();
  const size_t H = size_t(c.hidden_size), Q = size_t(c.q_dim()), KV = size_t(c.kv_dim()), F = size_t(c.intermediate_size);
  const int D = c.head_dim;
  const int32_t start = int32_t(n_ctx_ + n_new);  // the block follows the context
  const float scale = 1.0f / std::sqrt(float(D));
  // Rows cached before the step; the oldest ones past the window and its slack go once the new
  // ones are in, and a block attends to the latest `window_` of those kept.
  const size_t held = n_ctx_ - first_;
  const size_t keep_most = window_ ? window_ + kCropSlack : SIZE_MAX;
  const size_t drop = held + n_new > keep_most ? held + n_new - keep_most : 0;
  const size_t kept = held + n_new - drop;
  const size_t visible = window_ ? std::min(kept, window_) : kept;

  // The new context rows: hidden_norm(fc(taps)), the same for every layer.
  ctx_.resize(n_new * H);
  if (n_new) {
    matmul(d_.fc, taps, n_new, ctx_.data(), pool_);
    for (size_t r = 0; r < n_new; ++r) rmsnorm(ctx_.data() + r * H, d_.hidden_norm, ctx_.data() + r * H, H, c.rms_eps);
  }

  x_.assign(embd, embd + n_block * H);
  h_.resize(n_block * H);
  q_.resize(n_block * Q);
  att_.resize(n_block * Q);
  proj_.resize(n_block * H);
  gate_.resize(n_block * F);
  up_.resize(n_block * F);
  const size_t n_keys = visible + n_block;
  cells_.resize(n_keys);
  std::iota(cells_.begin(), cells_.end(), int32_t(kept - visible));

  // K (k_norm, then RoPE at position pos0 + r) and V of `n` rows of `in` into rows
  // [row0, row0 + n) of layer il's cache.
  auto project_kv = [&](const DFlashLayer& l, size_t il, const float* in, size_t n, size_t row0, size_t pos0) {
    if (!n) return;
    float* k = k_[il].data() + row0 * KV;
    float* v = v_[il].data() + row0 * KV;
    matmul(l.wk, in, n, k, pool_);
    matmul(l.wv, in, n, v, pool_);
    for (size_t r = 0; r < n; ++r) {
      float* kr = k + r * KV;
      for (int h = 0; h < c.n_head_kv; ++h) rmsnorm(kr + h * D, l.k_norm, kr + h * D, size_t(D), c.rms_eps);
      rope(kr, c.n_head_kv, D, D, int32_t(pos0 + r), c.rope_theta, RopeStyle::Neox);
    }
  };

  for (size_t il = 0; il < d_.layers.size(); ++il) {
    const DFlashLayer& l = d_.layers[il];
    k_[il].resize((held + n_new + n_block) * KV);
    v_[il].resize((held + n_new + n_block) * KV);
    project_kv(l, il, ctx_.data(), n_new, held, n_ctx_);
    if (drop) {
      k_[il].erase(k_[il].begin(), k_[il].begin() + long(drop * KV));
      v_[il].erase(v_[il].begin(), v_[il].begin() + long(drop * KV));
    }

    for (size_t i = 0; i < n_block; ++i) rmsnorm(x_.data() + i * H, l.attn_norm, h_.data() + i * H, H, c.rms_eps);
    project_kv(l, il, h_.data(), n_block, kept, n_ctx_ + n_new);
    matmul(l.wq, h_.data(), n_block, q_.data(), pool_);
    for (size_t i = 0; i < n_block; ++i) {
      float* qi = q_.data() + i * Q;
      for (int h = 0; h < c.n_head; ++h) rmsnorm(qi + h * D, l.q_norm, qi + h * D, size_t(D), c.rms_eps);
      rope(qi, c.n_head, D, D, start + int32_t(i), c.rope_theta, RopeStyle::Neox);
    }
    // Non-causal: every block row attends to every cached context row and every block row.
    const KvRows rows{k_[il].data(), v_[il].data(), KV};
    const HeadShape shape{c.n_head, c.n_head_kv, D};
    for (size_t i = 0; i < n_block; ++i)
      flash_decode(q_.data() + i * Q, shape, scale, rows, cells_.data(), n_keys, att_.data() + i * Q, FlashLayout{}, &pool_);

    matmul(l.wo, att_.data(), n_block, proj_.data(), pool_);
    add(x_.data(), proj_.data(), n_block * H);
    for (size_t i = 0; i < n_block; ++i) rmsnorm(x_.data() + i * H, l.ffn_norm, h_.data() + i * H, H, c.rms_eps);
    matmul(l.w_gate, h_.data(), n_block, gate_.data(), pool_);
    matmul(l.w_up, h_.data(), n_block, up_.data(), pool_);
    swiglu(gate_.data(), up_.data(), n_block * F);
    matmul(l.w_down, gate_.data(), n_block, proj_.data(), pool_);
    add(x_.data(), proj_.data(), n_block * H);

    // The block rows are not context: only the context rows stay cached.
    k_[il].resize(kept * KV);
    v_[il].resize(kept * KV);
  }
  n_ctx_ += n_new;
  first_ += drop;

  out_.resize(n_block * H);
  for (size_t i = 0; i < n_block; ++i) rmsnorm(x_.data() + i * H, d_.norm, out_.data() + i * H, H, c.rms_eps);
  return out_;
}

}  // namespace specmesh

#include "specmesh/model/context.hpp"

#include <algorithm>
#include <cmath>
#include <cstring>
#include <stdexcept>

#include "specmesh/kernels/attention.hpp"
#include "specmesh/kernels/ops.hpp"
#include "specmesh/kernels/quant.hpp"

namespace specmesh {

int context_size(const Model& m, int n_ctx) {
  if (n_ctx > 0) return n_ctx;
  return std::min(m.hparams().n_ctx_train, 4096);
}

Context::Context(const Model& model, ContextParams params, ThreadPool* pool)
    : model_(model),
      own_pool_(pool ? nullptr : std::make_unique<ThreadPool>(params.n_threads)),
      pool_(pool ? pool : own_pool_.get()),
      begin_(params.layer_begin),
      end_(params.layer_end < 0 ? model.hparams().n_layer : params.layer_end),
      kv_(context_size(model, params.n_ctx), begin_, end_, model.hparams().kv_dim()),
      capture_(std::move(params.capture_layers)) {
  const int L = model.hparams().n_layer;
  if (begin_ < 0 || begin_ > end_ || end_ > L)
    throw std::invalid_argument("layer range [" + std::to_string(begin_) + ", " + std::to_string(end_) +
                                ") is outside the model's " + std::to_string(L) + " layers");
}

ForwardOutput Context::forward(const Batch& batch, const float* hidden_in) {
  const HParams& hp = model_.hparams();
  const size_t n = batch.size(), E = hp.n_embd;
  if (n == 0) return {};
  if (batch.pos.size() != n || batch.seqs.size() != n || batch.logits.size() != n ||
      (batch.is_tree() && batch.parent.size() != n))
    throw std::invalid_argument("batch fields have different lengths");
  if (begin_ > 0 && !hidden_in) throw std::invalid_argument("a stage after layer 0 needs input hidden states");

  std::vector<float> x(n * E);
  if (begin_ == 0) {
    for (size_t i = 0; i < n; ++i) {
      const int32_t t = batch.tokens[i];
      if (t < 0 || t >= hp.n_vocab) throw std::invalid_argument("token id " + std::to_string(t) + " out of range");
      const auto& w = model_.tok_embd;
      dequantize_row(w.type, static_cast<const uint8_t*>(w.data) + row_bytes(w.type, w.cols) * t, x.data() + i * E, E);
    }
  } else {
    std::memcpy(x.data(), hidden_in, n * E * sizeof(float));
  }

  // Claim cells; tree batches are checked (DFS pre-order, positions prefix + depth) first.
  const AttentionMask mask = batch.is_tree() ? AttentionMask::tree(batch.parent, batch.pos) : AttentionMask{};
  const std::vector<int32_t> slots = kv_.place(batch);
  const Visibility visible(kv_, batch, slots, mask, views_);

  ForwardOutput out;
  out.captured.resize(capture_.size());
  for (int il = begin_; il < end_; ++il) {
    if (cancel_check_ && cancel_check_()) throw ForwardCancelled();
    layer(il, batch, slots, visible, x.data());
    for (size_t c = 0; c < capture_.size(); ++c)
      if (capture_[c] == il) out.captured[c].assign(x.begin(), x.end());
  }

  if (!has_head()) {
    out.rows.resize(n);
    for (size_t i = 0; i < n; ++i) out.rows[i] = int32_t(i);
    out.hidden = std::move(x);
    return out;
  }
  for (size_t i = 0; i < n; ++i)
    if (batch.logits[i]) out.rows.push_back(int32_t(i));
  const size_t r = out.rows.size();
  std::vector<float> normed(r * E);
  for (size_t k = 0; k < r; ++k) rmsnorm(x.data() + out.rows[k] * E, model_.output_norm, normed.data() + k * E, E, hp.rms_eps);
  out.logits.resize(r * size_t(hp.n_vocab));
  matmul(model_.output, normed.data(), r, out.logits.data(), *pool_);
  return out;
}

void Context::set_view(int seq, std::shared_ptr<const KvView> view) {
  if (seq < 0 || seq >= kMaxSeqs) throw std::invalid_argument("sequence " + std::to_string(seq) + " out of range");
  views_[seq] = std::move(view);
}

WorkCost Context::cost(const Batch& batch) const {
  const HParams& hp = model_.hparams();
  auto bytes = [](const WeightView& w) { return double(row_bytes(w.type, w.cols)) * w.rows; };
  auto params = [](const WeightView& w) { return double(w.rows) * w.cols; };
  WorkCost c;
  c.tokens = int(batch.size());
  c.layers = end_ - begin_;
  const double n = double(batch.size());
  const double ctx = double(kv_.used()) + n;  // keys each query reads, at most
  for (int il = begin_; il < end_; ++il) {
    const LayerWeights& w = model_.layers[il];
    for (const WeightView* m : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w_gate, &w.w_up, &w.w_down}) {
      c.bytes += bytes(*m);
      c.flops += 2 * params(*m) * n;
    }
    c.bytes += 2.0 * ctx * hp.kv_dim() * sizeof(float);
    c.flops += 4.0 * n * ctx * hp.q_dim();
    c.ops += 12;  // 7 matmuls, 2 norms, rope, attention, swiglu
  }
  if (has_head()) {
    size_t outputs = 0;
    for (uint8_t l : batch.logits) outputs += l;
    c.bytes += bytes(model_.output);
    c.flops += 2 * params(model_.output) * outputs;
    c.ops += 2;
  }
  return c;
}

void Context::layer(int il, const Batch& batch, const std::vector<int32_t>& slots, const Visibility& visible,
                    float* x) {
  const HParams& hp = model_.hparams();
  const LayerWeights& w = model_.layers[il];
  const ArchSpec& arch = arch_spec(hp.arch);
  const size_t n = batch.size(), E = hp.n_embd, Q = hp.q_dim(), KV = hp.kv_dim(), F = hp.n_ff;
  const int D = hp.head_dim;

  std::vector<float> h(n * E), q(n * Q), k(n * KV), v(n * KV), att(n * Q), proj(n * E);
  for (size_t i = 0; i < n; ++i) rmsnorm(x + i * E, w.attn_norm, h.data() + i * E, E, hp.rms_eps);
  matmul(w.wq, h.data(), n, q.data(), *pool_);
  matmul(w.wk, h.data(), n, k.data(), *pool_);
  matmul(w.wv, h.data(), n, v.data(), *pool_);

  float* kc = kv_.k(il);
  float* vc = kv_.v(il);
  for (size_t i = 0; i < n; ++i) {
    float* qi = q.data() + i * Q;
    float* ki = k.data() + i * KV;
    float* vi = v.data() + i * KV;
    arch.shape_qkv(hp, w, qi, ki, vi);
    rope(qi, hp.n_head, D, hp.n_rot, batch.pos[i], hp.rope_theta, hp.rope);
    rope(ki, hp.n_head_kv, D, hp.n_rot, batch.pos[i], hp.rope_theta, hp.rope);
    std::memcpy(kc + size_t(slots[i]) * KV, ki, KV * sizeof(float));
    std::memcpy(vc + size_t(slots[i]) * KV, vi, KV * sizeof(float));
  }

  // One (token, KV head) pair per work item: its cell list is built once for the query heads
  // of its group. Each item is computed the same way whatever the split.
  const KvRows rows{kc, vc, KV};
  const float scale = 1.0f / std::sqrt(float(D));
  const int group = hp.n_head / hp.n_head_kv;
  const size_t items = n * hp.n_head_kv;
  auto work = [&](size_t b, size_t e) {
    thread_local std::vector<int32_t> cells;
    for (size_t it = b; it < e; ++it) {
      const size_t i = it / hp.n_head_kv;
      const int kvh = int(it % hp.n_head_kv);
      visible.cells(i, il, kvh, cells);
      for (int hh = kvh * group; hh < (kvh + 1) * group; ++hh)
        attention(q.data() + i * Q + hh * D, rows, size_t(kvh) * D, D, scale, cells.data(), cells.size(),
                  att.data() + i * Q + hh * D);
    }
  };
  if (items * size_t(kv_.used()) * group * D < 32768) work(0, items);
  else pool_->parallel_for(items, work);

  matmul(w.wo, att.data(), n, proj.data(), *pool_);
  for (size_t i = 0; i < n * E; ++i) x[i] += proj[i];

  std::vector<float> gate(n * F), up(n * F);
  for (size_t i = 0; i < n; ++i) rmsnorm(x + i * E, w.ffn_norm, h.data() + i * E, E, hp.rms_eps);
  matmul(w.w_gate, h.data(), n, gate.data(), *pool_);
  matmul(w.w_up, h.data(), n, up.data(), *pool_);
  swiglu(gate.data(), up.data(), n * F);
  matmul(w.w_down, gate.data(), n, proj.data(), *pool_);
  for (size_t i = 0; i < n * E; ++i) x[i] += proj[i];
}

}  // namespace specmesh

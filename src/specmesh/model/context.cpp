#include "specmesh/model/context.hpp"

#include <algorithm>
#include <stdexcept>

#include "specmesh/kernels/ops.hpp"
#include "specmesh/kernels/quant.hpp"
#include "specmesh/model/forward_pass.hpp"

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
      tp_(params.tp),
      link_(params.tp_link),
      kv_heads_((check_tp_shard(tp_, model.hparams().n_head_kv), tp_kv_heads(model.hparams().n_head_kv, tp_))),
      kv_(context_size(model, params.n_ctx), begin_, end_, int(kv_heads_.size()) * model.hparams().head_dim,
          params.kv_type),
      capture_(std::move(params.capture_layers)),
      layout_(params.attention_layout),
      last_query_(size_t(std::max(0, end_ - begin_))) {
  const int L = model.hparams().n_layer;
  if (begin_ < 0 || begin_ > end_ || end_ > L)
    throw std::invalid_argument("layer range [" + std::to_string(begin_) + ", " + std::to_string(end_) +
                                ") is outside the model's " + std::to_string(L) + " layers");
  if (tp_.size > 1 && (!link_ || link_->shard().rank != tp_.rank || link_->shard().size != tp_.size))
    throw std::invalid_argument("tensor parallelism: rank " + std::to_string(tp_.rank) + " of " +
                                std::to_string(tp_.size) + " needs a link for that rank");
}

ForwardOutput Context::forward(const Batch& batch, const float* hidden_in) {
  if (batch.size() == 0) return {};
  ForwardPass pass(*this, batch, hidden_in);
  std::vector<float> att(batch.size() * size_t(q_dim()));
  std::vector<std::vector<float>> captured(capture_.size());
  for (int il = begin_; il < end_; ++il) {
    if (cancel_check_ && cancel_check_()) throw ForwardCancelled();
    pass.pre_attention(il);
    pass.attention(il, att.data());
    pass.post_attention(il, att.data());
    for (size_t c = 0; c < capture_.size(); ++c)
      if (capture_[c] == il) captured[c].assign(pass.x(), pass.x() + pass.size() * model_.hparams().n_embd);
  }
  ForwardOutput out = pass.output();
  out.captured = std::move(captured);
  return out;
}

void Context::shift_positions(int seq, int32_t p0, int32_t p1, int32_t delta, int seq_last) {
  const std::vector<int32_t> cells = kv_.seq_add(seq, p0, p1, delta, seq_last);
  const HParams& hp = model_.hparams();
  // Each key is read as floats, rotated and stored again (rounded to the cache's type once
  // more, as llama.cpp's K-shift does for an F16 cache).
  std::vector<float> key(static_cast<size_t>(kv_dim()));
  for (int il = begin_; il < end_; ++il) {
    for (int32_t c : cells) {
      kv_.read(il, c, key.data(), nullptr);
      rope(key.data(), int(kv_heads_.size()), hp.head_dim, hp.n_rot, delta, hp.rope_theta, hp.rope);
      kv_.write(il, c, key.data(), nullptr);
    }
  }
}

const std::vector<float>& Context::last_query(int layer) const {
  if (layer < begin_ || layer >= end_)
    throw std::out_of_range("layer " + std::to_string(layer) + " is outside this context's [" + std::to_string(begin_) +
                            ", " + std::to_string(end_) + ")");
  return last_query_[size_t(layer - begin_)];
}

void Context::set_view(int seq, std::shared_ptr<const KvView> view) {
  if (seq < 0 || seq >= kMaxSeqs) throw std::invalid_argument("sequence " + std::to_string(seq) + " out of range");
  views_[seq] = std::move(view);
}

WorkCost forward_cost(const Model& model, int layer_begin, int layer_end, int tokens, int64_t context, int outputs,
                      DType kv_type) {
  const HParams& hp = model.hparams();
  auto bytes = [](const WeightView& w) { return double(row_bytes(w.type, w.cols)) * w.rows; };
  auto params = [](const WeightView& w) { return double(w.rows) * w.cols; };
  WorkCost c;
  c.tokens = tokens;
  c.layers = layer_end - layer_begin;
  const double n = double(tokens);
  const double ctx = double(context);
  c.context = context;
  c.head = layer_end == hp.n_layer;
  for (int il = layer_begin; il < layer_end; ++il) {
    const LayerWeights& w = model.layers[il];
    for (const WeightView* m : {&w.wq, &w.wk, &w.wv, &w.wo, &w.w_gate, &w.w_up, &w.w_down}) {
      c.bytes += bytes(*m);
      c.flops += 2 * params(*m) * n;
    }
    c.bytes += 2.0 * ctx * double(kv_row_bytes(kv_type, size_t(hp.kv_dim())));
    c.flops += 4.0 * n * ctx * hp.q_dim();
    c.ops += 12;  // 7 matmuls, 2 norms, rope, attention, swiglu
  }
  if (c.head) {
    c.bytes += bytes(model.output);
    c.flops += 2 * params(model.output) * outputs;
    c.ops += 2;
  }
  return c;
}

WorkCost Context::cost(const Batch& batch) const {
  int outputs = 0;
  for (uint8_t l : batch.logits) outputs += l;
  // Keys each query reads, at most.
  WorkCost c = forward_cost(model_, begin_, end_, int(batch.size()), int64_t(kv_.used()) + int64_t(batch.size()),
                            outputs, kv_.type());
  // A tensor-parallel rank does its share of the matrices and heads (the norms and the
  // embedding row, which every rank repeats, are small beside them).
  c.bytes /= tp_.size;
  c.flops /= tp_.size;
  return c;
}

}  // namespace specmesh

#include "specmesh/model/forward_pass.hpp"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "specmesh/kernels/attention.hpp"
#include "specmesh/kernels/matmul.hpp"
#include "specmesh/kernels/ops.hpp"
#include "specmesh/kernels/quant.hpp"
#include "specmesh/model/arch.hpp"

namespace specmesh {

namespace {

// Checks everything that can be wrong with a batch before the pass claims cache cells, so a
// rejected batch leaves the cache as it was.
const Batch& checked(const Context& ctx, const Batch& batch, const float* hidden_in) {
  const HParams& hp = ctx.model().hparams();
  const size_t n = batch.size();
  if (batch.pos.size() != n || batch.seqs.size() != n || batch.logits.size() != n ||
      (batch.is_tree() && batch.parent.size() != n))
    throw std::invalid_argument("batch fields have different lengths");
  if (ctx.layer_begin() > 0 && !hidden_in)
    throw std::invalid_argument("a stage after layer 0 needs input hidden states");
  if (ctx.layer_begin() == 0)
    for (int32_t t : batch.tokens)
      if (t < 0 || t >= hp.n_vocab) throw std::invalid_argument("token id " + std::to_string(t) + " out of range");
  return batch;
}

}  // namespace

ForwardPass::ForwardPass(Context& ctx, const Batch& batch, const float* hidden_in)
    : ctx_(ctx),
      batch_(checked(ctx, batch, hidden_in)),
      // Tree batches are checked (DFS pre-order, positions prefix + depth) before cells are claimed.
      mask_(batch_.is_tree() ? AttentionMask::tree(batch_.parent, batch_.pos) : AttentionMask{}),
      slots_(ctx.kv().place(batch_)),
      visible_(ctx.kv(), batch_, slots_, mask_, ctx.views_) {
  const size_t n = batch_.size(), E = ctx.model().hparams().n_embd;
  x_.resize(n * E);
  if (ctx.layer_begin() > 0) {
    std::memcpy(x_.data(), hidden_in, n * E * sizeof(float));
    return;
  }
  const WeightView& w = ctx.model().tok_embd;
  for (size_t i = 0; i < n; ++i)
    dequantize_row(w.type, static_cast<const uint8_t*>(w.data) + row_bytes(w.type, w.cols) * batch_.tokens[i],
                   x_.data() + i * E, E);
}

void ForwardPass::pre_attention(int il) {
  const Model& model = ctx_.model();
  const HParams& hp = model.hparams();
  const LayerWeights& w = model.layers[il];
  const ArchSpec& arch = arch_spec(hp.arch);
  const size_t n = size(), E = hp.n_embd, Q = hp.q_dim(), KV = hp.kv_dim();
  const int D = hp.head_dim;
  ThreadPool& pool = ctx_.pool();

  std::vector<float> h(n * E), k(n * KV), v(n * KV);
  q_.resize(n * Q);
  for (size_t i = 0; i < n; ++i) rmsnorm(x_.data() + i * E, w.attn_norm, h.data() + i * E, E, hp.rms_eps);
  matmul(w.wq, h.data(), n, q_.data(), pool);
  matmul(w.wk, h.data(), n, k.data(), pool);
  matmul(w.wv, h.data(), n, v.data(), pool);

  float* kc = ctx_.kv().k(il);
  float* vc = ctx_.kv().v(il);
  for (size_t i = 0; i < n; ++i) {
    float* qi = q_.data() + i * Q;
    float* ki = k.data() + i * KV;
    float* vi = v.data() + i * KV;
    arch.shape_qkv(hp, w, qi, ki, vi);
    rope(qi, hp.n_head, D, hp.n_rot, batch_.pos[i], hp.rope_theta, hp.rope);
    rope(ki, hp.n_head_kv, D, hp.n_rot, batch_.pos[i], hp.rope_theta, hp.rope);
    std::memcpy(kc + size_t(slots_[i]) * KV, ki, KV * sizeof(float));
    std::memcpy(vc + size_t(slots_[i]) * KV, vi, KV * sizeof(float));
  }
  q_layer_ = il;
}

SpecCheck ForwardPass::attention(int il, float* full, float* spec, const SpecConfig* cfg,
                                 const std::function<void()>& spec_ready) {
  if (q_layer_ != il) throw std::logic_error("attention of a layer whose pre-attention ops did not run");
  const HParams& hp = ctx_.model().hparams();
  const size_t n = size(), Q = hp.q_dim(), KV = hp.kv_dim();
  const int D = hp.head_dim;
  const KvRows rows{ctx_.kv().k(il), ctx_.kv().v(il), KV};
  const float scale = 1.0f / std::sqrt(float(D));
  const int group = hp.n_head / hp.n_head_kv;

  if (cfg) {
    if (n != 1 || visible_.per_head() || !spec)
      throw std::invalid_argument("speculative attention needs one token, one cell list and a spec buffer");
    std::vector<int32_t> cells;
    visible_.cells(0, il, 0, cells);
    return speculative_flash_decode(q_.data(), HeadShape{hp.n_head, hp.n_head_kv, D}, scale, rows, cells.data(),
                                    cells.size(), full, spec, *cfg, &ctx_.pool(), spec_ready);
  }

  const FlashLayout& layout = ctx_.attention_layout();
  // A decode step whose heads read one cell list: every head in one flash decode, split over
  // the pool by KV chunks. Bit for bit what the per-head path below gives (the kernels' tests
  // hold them equal), so a token's result still does not depend on its batch.
  if (n == 1 && !visible_.per_head()) {
    thread_local std::vector<int32_t> cells;
    visible_.cells(0, il, 0, cells);
    flash_decode(q_.data(), HeadShape{hp.n_head, hp.n_head_kv, D}, scale, rows, cells.data(), cells.size(), full,
                 layout, &ctx_.pool());
    return {};
  }

  // One (token, KV head) pair per work item: its cell list is built once for the query heads
  // of its group. Each item is computed the same way whatever the split.
  const size_t items = n * hp.n_head_kv;
  auto work = [&](size_t b, size_t e) {
    thread_local std::vector<int32_t> cells;
    for (size_t it = b; it < e; ++it) {
      const size_t i = it / hp.n_head_kv;
      const int kvh = int(it % hp.n_head_kv);
      visible_.cells(i, il, kvh, cells);
      for (int hh = kvh * group; hh < (kvh + 1) * group; ++hh)
        specmesh::attention(q_.data() + i * Q + hh * D, rows, size_t(kvh) * D, D, scale, cells.data(), cells.size(),
                            full + i * Q + hh * D, layout);
    }
  };
  if (items * size_t(ctx_.kv().used()) * group * D < 32768) work(0, items);
  else ctx_.pool().parallel_for(items, work);
  return {};
}

void ForwardPass::post_attention(int il, const float* att) {
  const HParams& hp = ctx_.model().hparams();
  const LayerWeights& w = ctx_.model().layers[il];
  const size_t n = size(), E = hp.n_embd, F = hp.n_ff;
  ThreadPool& pool = ctx_.pool();
  float* x = x_.data();

  std::vector<float> h(n * E), proj(n * E), gate(n * F), up(n * F);
  matmul(w.wo, att, n, proj.data(), pool);
  for (size_t i = 0; i < n * E; ++i) x[i] += proj[i];

  for (size_t i = 0; i < n; ++i) rmsnorm(x + i * E, w.ffn_norm, h.data() + i * E, E, hp.rms_eps);
  matmul(w.w_gate, h.data(), n, gate.data(), pool);
  matmul(w.w_up, h.data(), n, up.data(), pool);
  swiglu(gate.data(), up.data(), n * F);
  matmul(w.w_down, gate.data(), n, proj.data(), pool);
  for (size_t i = 0; i < n * E; ++i) x[i] += proj[i];
}

void ForwardPass::read_kv(int il, size_t i, float* k, float* v) const {
  const size_t KV = ctx_.kv().kv_dim(), off = size_t(slots_.at(i)) * KV;
  KvCache& kv = ctx_.kv();
  std::memcpy(k, kv.k(il) + off, KV * sizeof(float));
  std::memcpy(v, kv.v(il) + off, KV * sizeof(float));
}

void ForwardPass::write_kv(int il, size_t i, const float* k, const float* v) {
  const size_t KV = ctx_.kv().kv_dim(), off = size_t(slots_.at(i)) * KV;
  std::memcpy(ctx_.kv().k(il) + off, k, KV * sizeof(float));
  std::memcpy(ctx_.kv().v(il) + off, v, KV * sizeof(float));
}

ForwardOutput ForwardPass::output() {
  const Model& model = ctx_.model();
  const HParams& hp = model.hparams();
  const size_t n = size(), E = hp.n_embd;
  ForwardOutput out;
  if (!ctx_.has_head()) {
    out.rows.resize(n);
    for (size_t i = 0; i < n; ++i) out.rows[i] = int32_t(i);
    out.hidden = std::move(x_);
    return out;
  }
  for (size_t i = 0; i < n; ++i)
    if (batch_.logits[i]) out.rows.push_back(int32_t(i));
  const size_t r = out.rows.size();
  std::vector<float> normed(r * E);
  for (size_t k = 0; k < r; ++k) rmsnorm(x_.data() + out.rows[k] * E, model.output_norm, normed.data() + k * E, E, hp.rms_eps);
  out.logits.resize(r * size_t(hp.n_vocab));
  matmul(model.output, normed.data(), r, out.logits.data(), ctx_.pool());
  return out;
}

}  // namespace specmesh

#include "specmesh/model/forward_pass.hpp"

#include <cmath>
#include <cstring>
#include <stdexcept>

#include "specmesh/kernels/flash_decode.hpp"
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
      visible_(ctx.kv(), batch_, slots_, mask_, ctx.views_),
      kv_used_(ctx.kv().used()) {
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
  const size_t n = size(), E = hp.n_embd, Q = size_t(ctx_.q_dim()), KV = size_t(ctx_.kv_dim());
  const int D = hp.head_dim;
  const RowRange heads = ctx_.kv_heads();
  const size_t group = size_t(hp.n_head / hp.n_head_kv);
  ThreadPool& pool = ctx_.pool();

  h_.resize(n * E);
  k_.resize(n * KV);
  v_.resize(n * KV);
  q_.resize(n * Q);
  for (size_t i = 0; i < n; ++i) rmsnorm(x_.data() + i * E, w.attn_norm, h_.data() + i * E, E, hp.rms_eps);
  // This rank's heads: every head without tensor parallelism.
  matmul_rows(w.wq, heads.begin * group * D, heads.end * group * D, h_.data(), n, q_.data(), pool);
  matmul_rows(w.wk, heads.begin * D, heads.end * D, h_.data(), n, k_.data(), pool);
  matmul_rows(w.wv, heads.begin * D, heads.end * D, h_.data(), n, v_.data(), pool);

  KvCache& kv = ctx_.kv();
  const int n_kv = int(heads.size());
  for (size_t i = 0; i < n; ++i) {
    float* qi = q_.data() + i * Q;
    float* ki = k_.data() + i * KV;
    float* vi = v_.data() + i * KV;
    arch.shape_qkv(hp, w, int(heads.begin), int(heads.end), qi, ki, vi);
    rope(qi, n_kv * int(group), D, hp.n_rot, batch_.pos[i], hp.rope_theta, hp.rope);
    rope(ki, n_kv, D, hp.n_rot, batch_.pos[i], hp.rope_theta, hp.rope);
    kv.write(il, slots_[i], ki, vi);
  }
  ctx_.last_query_[size_t(il - ctx_.begin_)].assign(q_.end() - ptrdiff_t(Q), q_.end());
  ctx_.last_query_pos_ = batch_.pos[n - 1];
  q_layer_ = il;
}

SpecCheck ForwardPass::attention(int il, float* full, float* spec, const SpecConfig* cfg,
                                 const std::function<void()>& spec_ready) {
  if (q_layer_ != il) throw std::logic_error("attention of a layer whose pre-attention ops did not run");
  const HParams& hp = ctx_.model().hparams();
  const size_t n = size(), Q = size_t(ctx_.q_dim());
  const int n_kv = int(ctx_.kv_heads().size()), kv_begin = int(ctx_.kv_heads().begin);
  const int D = hp.head_dim;
  const KvRows rows = ctx_.kv().rows(il);
  const float scale = 1.0f / std::sqrt(float(D));
  const int group = hp.n_head / hp.n_head_kv;
  const FlashLayout& layout = ctx_.attention_layout();

  if (!visible_.per_head()) {
    if (!lists_built_) build_cell_lists(il);
    const HeadShape shape{n_kv * group, n_kv, D};
    // A decode step: every head in one flash decode, split over the pool by KV chunks.
    if (n == 1) {
      if (cfg) {
        if (!spec) throw std::invalid_argument("speculative attention needs a spec buffer");
        return speculative_flash_decode(q_.data(), shape, scale, rows, lists_[0], n_cells_[0], full, spec, *cfg,
                                        &ctx_.pool(), spec_ready);
      }
      flash_decode(q_.data(), shape, scale, rows, lists_[0], n_cells_[0], full, layout, &ctx_.pool());
      return {};
    }
    // Several tokens: all of them in one flash decode, which reads the keys and values they
    // share (a prompt's, a verified run's cached prefix) once.
    if (cfg) throw std::invalid_argument("speculative attention needs one token and one cell list");
    flash_decode_rows(q_.data(), shape, scale, rows, lists_.data(), n_cells_.data(), n, full, layout, &ctx_.pool());
    return {};
  }
  if (cfg) throw std::invalid_argument("speculative attention needs one token and one cell list");

  // A view that gives KV heads their own cells: one work item per (token, KV head), its cell
  // list built once for the query heads that read it, which go through one flash decode (each
  // head is computed the same way whatever the grouping, so a token's result does not depend
  // on its batch).
  const size_t items = n * size_t(n_kv);
  auto work = [&](size_t b, size_t e) {
    thread_local std::vector<int32_t> cells;
    for (size_t it = b; it < e; ++it) {
      const size_t i = it / size_t(n_kv);
      const int kvh = int(it % size_t(n_kv));
      visible_.cells(i, il, kv_begin + kvh, cells);
      const size_t off = i * Q + size_t(kvh) * group * D;
      flash_decode(q_.data() + off, HeadShape{group, 1, D}, scale,
                   rows.shifted(size_t(kvh) * D), cells.data(), cells.size(), full + off,
                   layout, nullptr);
    }
  };
  if (n * size_t(n_kv) * size_t(kv_used_) * group * D < 32768) work(0, items);
  else ctx_.pool().parallel_for(items, work);
  return {};
}

void ForwardPass::build_cell_lists(int il) {
  const size_t n = size();
  thread_local std::vector<int32_t> row;
  cells_.clear();
  starts_.resize(n);
  n_cells_.resize(n);
  for (size_t i = 0; i < n; ++i) {
    visible_.cells(i, il, 0, row);
    starts_[i] = cells_.size();
    n_cells_[i] = row.size();
    cells_.insert(cells_.end(), row.begin(), row.end());
  }
  lists_.resize(n);
  for (size_t i = 0; i < n; ++i) lists_[i] = cells_.data() + starts_[i];
  lists_built_ = true;
}

void ForwardPass::gather(const float* mine, size_t rows, size_t total, bool by_heads, float* out) {
  const int size = ctx_.tp().size;
  const HParams& hp = ctx_.model().hparams();
  if (by_heads) tp_head_shares(hp.n_head_kv, size_t(hp.n_head / hp.n_head_kv) * size_t(hp.head_dim), size, shares_);
  else tp_row_shares(total, size, shares_);
  ctx_.tp_link()->all_gather(mine, rows, shares_.data(), total, out);
}

const float* ForwardPass::project(const WeightView& w, const float* in, std::vector<float>& local,
                                  std::vector<float>& whole) {
  const size_t n = size();
  whole.resize(n * w.rows);
  if (ctx_.tp().size == 1) {
    matmul(w, in, n, whole.data(), ctx_.pool());
    return whole.data();
  }
  const RowRange rows = tp_rows(w.rows, ctx_.tp());
  local.resize(n * rows.size());
  matmul_rows(w, rows.begin, rows.end, in, n, local.data(), ctx_.pool());
  gather(local.data(), n, w.rows, false, whole.data());
  return whole.data();
}

void ForwardPass::post_attention(int il, const float* att) {
  const HParams& hp = ctx_.model().hparams();
  const LayerWeights& w = ctx_.model().layers[il];
  const size_t n = size(), E = hp.n_embd;
  const bool tp = ctx_.tp().size > 1;
  float* x = x_.data();

  if (tp) {  // every rank's heads
    att_.resize(n * size_t(hp.q_dim()));
    gather(att, n, size_t(hp.q_dim()), true, att_.data());
    att = att_.data();
  }
  const float* proj = project(w.wo, att, local_, proj_);
  for (size_t i = 0; i < n * E; ++i) x[i] += proj[i];

  h_.resize(n * E);
  for (size_t i = 0; i < n; ++i) rmsnorm(x + i * E, w.ffn_norm, h_.data() + i * E, E, hp.rms_eps);
  // The gate and up rows of this rank's share of the inner dimension, then all of it.
  const RowRange ff = tp_rows(size_t(hp.n_ff), ctx_.tp());
  gate_.resize(n * ff.size());
  up_.resize(n * ff.size());
  matmul_rows(w.w_gate, ff.begin, ff.end, h_.data(), n, gate_.data(), ctx_.pool());
  matmul_rows(w.w_up, ff.begin, ff.end, h_.data(), n, up_.data(), ctx_.pool());
  swiglu(gate_.data(), up_.data(), n * ff.size());
  const float* inner = gate_.data();
  if (tp) {
    inner_.resize(n * size_t(hp.n_ff));
    gather(gate_.data(), n, size_t(hp.n_ff), false, inner_.data());
    inner = inner_.data();
  }
  proj = project(w.w_down, inner, local_, proj_);
  for (size_t i = 0; i < n * E; ++i) x[i] += proj[i];
}

void ForwardPass::read_kv(int il, size_t i, float* k, float* v) const { ctx_.kv().read(il, slots_.at(i), k, v); }

void ForwardPass::write_kv(int il, size_t i, const float* k, const float* v) { ctx_.kv().write(il, slots_.at(i), k, v); }

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
  if (ctx_.tp().size == 1) {
    matmul(model.output, normed.data(), r, out.logits.data(), ctx_.pool());
    return out;
  }
  // Each rank's share of the vocabulary, for the rows that want logits.
  const RowRange rows = tp_rows(size_t(hp.n_vocab), ctx_.tp());
  local_.resize(r * rows.size());
  matmul_rows(model.output, rows.begin, rows.end, normed.data(), r, local_.data(), ctx_.pool());
  gather(local_.data(), r, size_t(hp.n_vocab), false, out.logits.data());
  return out;
}

}  // namespace specmesh

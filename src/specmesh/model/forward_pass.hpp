// One forward pass of a batch through a context, op by op.
//
// A layer is three ops: pre_attention (norm, Q/K/V projections, architecture shaping, RoPE,
// K/V written into the tokens' cells), attention, and post_attention (output projection,
// residual, FFN block). Context::forward runs them in order; a caller that wants to act
// between them (attention-level speculation runs them on two devices, each skipping some)
// drives the same ops itself, and gets the same bits when it runs them in the same order.
#pragma once

#include <cstddef>
#include <cstdint>
#include <functional>
#include <vector>

#include "specmesh/kernels/flash_decode.hpp"
#include "specmesh/model/attention_mask.hpp"
#include "specmesh/model/batch.hpp"
#include "specmesh/model/context.hpp"
#include "specmesh/model/visibility.hpp"

namespace specmesh {

class ForwardPass {
 public:
  // Claims the batch's cells in ctx's KV cache and sets up the residual stream: the embedded
  // tokens for a context starting at layer 0, else `hidden_in` (n_batch x n_embd). Throws
  // std::invalid_argument on a malformed batch, as Context::forward does.
  ForwardPass(Context& ctx, const Batch& batch, const float* hidden_in = nullptr);
  // Visibility refers to the batch and mask held here, so a pass stays where it was built.
  ForwardPass(const ForwardPass&) = delete;
  ForwardPass& operator=(const ForwardPass&) = delete;

  size_t size() const { return batch_.size(); }
  const Batch& batch() const { return batch_; }
  // The residual stream: n_batch x n_embd, the input of the next op.
  float* x() { return x_.data(); }
  const float* x() const { return x_.data(); }

  // Under tensor parallelism (Context's tp) every op computes the rank's part: q, K and V of its
  // KV heads, attention of its query heads (att and the K/V rows below are of those), its
  // rows of the other matrices; post_attention() and output() gather the rest from the group,
  // so the residual stream and the logits are whole on every rank.
  //
  // Norm, Q/K/V, shaping, RoPE, K/V rows into the cells. Keeps q for attention(il).
  void pre_attention(int il);

  // Attention of layer il into `full` (n_batch x ctx.q_dim()), with the context's attention layout.
  // With `cfg`, a single-token batch whose heads share one cell list also gets the
  // speculative output in `spec` (ctx.q_dim()) and the check, through the speculative kernel; its
  // full output equals the plain one bit for bit when cfg->layout is the context's layout.
  // Without cfg the returned check is default (not exact, not accepted). `spec_ready` is called
  // once `spec` is complete, before the rest of the full output is computed.
  SpecCheck attention(int il, float* full, float* spec = nullptr, const SpecConfig* cfg = nullptr,
                      const std::function<void()>& spec_ready = {});

  // Output projection of `att` (n_batch x ctx.q_dim()) added to the residual, then the FFN block.
  void post_attention(int il, const float* att);

  // The K and V rows (ctx.kv_dim() each) batch token i wrote in layer il.
  void read_kv(int il, size_t i, float* k, float* v) const;
  void write_kv(int il, size_t i, const float* k, const float* v);

  // Logits of the tokens flagged in Batch::logits (a context with the head), else the hidden
  // states of every token. Ends the pass: the residual stream is moved out.
  ForwardOutput output();

 private:
  Context& ctx_;
  Batch batch_;
  AttentionMask mask_;
  std::vector<int32_t> slots_;
  Visibility visible_;
  const int kv_used_;  // cells in use, sizing the attention work (the pass's cells included)
  std::vector<float> x_, q_;
  int q_layer_ = -1;  // the layer q_ belongs to
  // Each token's cell list (a view not per_head() gives every layer the same), built at the
  // pass's first attention and read by every layer: token i's n_cells_[i] cells at
  // cells_[starts_[i]..].
  void build_cell_lists(int il);
  std::vector<int32_t> cells_;
  std::vector<size_t> starts_, n_cells_;
  std::vector<const int32_t*> lists_;
  bool lists_built_ = false;
  // Per-layer scratch, sized once for the batch.
  std::vector<float> h_, k_, v_, proj_, gate_, up_;
  // Tensor parallelism: this rank's rows, and the whole matrices gathered from the group.
  std::vector<float> local_, att_, inner_;
  std::vector<size_t> shares_;
  // Gathers the group's columns of a rows x total matrix, split by KV heads (the attention
  // output) or by tp_rows.
  void gather(const float* mine, size_t rows, size_t total, bool by_heads, float* out);
  // w x in for every batch token: all rows, or this rank's rows gathered from the group into
  // `whole`; returns whole's data.
  const float* project(const WeightView& w, const float* in, std::vector<float>& local, std::vector<float>& whole);
};

}  // namespace specmesh

// Runs forward passes of a model (or a layer range of it) over batches, with its KV cache.
// The layer ops themselves are in ForwardPass (forward_pass.hpp).
#pragma once

#include <functional>
#include <memory>
#include <stdexcept>
#include <vector>

#include "specmesh/profiles.hpp"
#include "specmesh/kernels/flash_decode.hpp"
#include "specmesh/kernels/thread_pool.hpp"
#include "specmesh/model/batch.hpp"
#include "specmesh/model/kv_cache.hpp"
#include "specmesh/model/kv_view.hpp"
#include "specmesh/model/model.hpp"
#include "specmesh/model/tensor_parallel.hpp"
#include "specmesh/model/visibility.hpp"

namespace specmesh {

// The KV cells a context gets for n_ctx: n_ctx itself, or when 0 the model's training context
// capped at 4096.
int context_size(const Model& model, int n_ctx);

// The work a forward pass does over layers [layer_begin, layer_end) of `model` for `tokens`
// tokens that attend to `context` keys each at most, `outputs` of them through the classifier
// (counted only when the range ends at the last layer). Device timing models read it; the
// head uses it to bound how long a run may take before it is called lost.
// KV bytes count rows of kv_type.
WorkCost forward_cost(const Model& model, int layer_begin, int layer_end, int tokens, int64_t context, int outputs,
                      DType kv_type);

struct ContextParams {
  int n_ctx = 0;            // KV cells; 0: the model's training context (at most 4096)
  DType kv_type = kDefaultKvType;  // how the KV cache stores rows: F16, Q8_0 or F32 (kv_rows.hpp)
  int n_threads = 1;        // used when no pool is given
  int layer_begin = 0;      // this context computes layers [layer_begin, layer_end)
  int layer_end = -1;       // -1: the last layer (and the classifier)
  std::vector<int> capture_layers;  // hidden states after these layers are kept
  // Key ranges plain attention splits into; results are the same up to rounding for any
  // layout, bit for bit only for the same one (speculative decoding compares with this).
  FlashLayout attention_layout{};
  // One rank of a tensor-parallel group (tensor_parallel.hpp): the KV cache holds this rank's
  // KV heads and every pass exchanges its shares over `tp_link` (required when tp.size > 1,
  // with the same shard; it must outlive the context). All ranks run the same passes.
  TpShard tp{};
  TpLink* tp_link = nullptr;
};

// What one forward pass produced, for the batch tokens flagged in Batch::logits.
struct ForwardOutput {
  std::vector<int32_t> rows;      // batch index of each output row
  std::vector<float> logits;      // rows x n_vocab (when the range ends at the last layer)
  std::vector<float> hidden;      // rows x n_embd (when it ends earlier: input to the next stage)
  // capture_layers[i] -> n_batch x n_embd hidden states after that layer
  std::vector<std::vector<float>> captured;

  const float* logits_row(size_t r, int n_vocab) const { return logits.data() + r * n_vocab; }
};

class Context {
 public:
  Context(const Model& model, ContextParams params, ThreadPool* pool = nullptr);

  const Model& model() const { return model_; }
  KvCache& kv() { return kv_; }
  const KvCache& kv() const { return kv_; }
  ThreadPool& pool() { return *pool_; }
  int layer_begin() const { return begin_; }
  int layer_end() const { return end_; }
  bool has_head() const { return end_ == model_.hparams().n_layer; }
  const FlashLayout& attention_layout() const { return layout_; }
  const TpShard& tp() const { return tp_; }
  TpLink* tp_link() const { return link_; }
  // This rank's KV heads, and its widths of q and of a K/V row (the model's without TP).
  RowRange kv_heads() const { return kv_heads_; }
  int kv_dim() const { return int(kv_heads_.size()) * model_.hparams().head_dim; }
  int q_dim() const { return kv_dim() * (model_.hparams().n_head / model_.hparams().n_head_kv); }

  // Runs the batch through this context's layers. A context starting at layer 0 embeds
  // batch.tokens; a later stage takes `hidden_in` (n_batch x n_embd). A context ending before
  // the last layer returns hidden states of every batch token (stages pass all of them on).
  ForwardOutput forward(const Batch& batch, const float* hidden_in = nullptr);

  // The work forward(batch) does on this context's layers, for device timing models.
  WorkCost cost(const Batch& batch) const;

  // Moves the cells of `seq` (< 0: every sequence) in positions [p0, p1) by delta and rotates
  // their cached keys by delta in every layer of this context, as llama.cpp's K-shift does:
  // RoPE rotations compose, so a key rotated for position p and then by delta equals the key
  // rotated for p + delta (up to rounding), for either rope style.
  // seq_last as KvCache::seq_add's.
  void shift_positions(int seq, int32_t p0, int32_t p1, int32_t delta, int seq_last = -1);

  // Attention of tokens in sequence `seq` reads the cells `view` selects (nullptr: every
  // visible cell, the default). A token in several sequences uses the lowest one's view.
  void set_view(int seq, std::shared_ptr<const KvView> view);

  // The post-RoPE query (q_dim(): this rank's heads) of the last token of the latest forward
  // pass in `layer` (one of this context's), and that token's position (-1 before any pass):
  // what a retrieval cache is scored with (retrieval_cache.hpp).
  const std::vector<float>& last_query(int layer) const;
  int32_t last_query_pos() const { return last_query_pos_; }

  // Stops a forward pass between layers (checked before each layer): returns true to abort.
  // An aborted pass throws ForwardCancelled; cells it claimed stay labelled and must be
  // removed by the caller's sequence operation.
  void set_cancel_check(std::function<bool()> check) { cancel_check_ = std::move(check); }

 private:
  friend class ForwardPass;  // reads the KV views, keeps the last query

  const Model& model_;
  std::unique_ptr<ThreadPool> own_pool_;
  ThreadPool* pool_;
  int begin_, end_;
  TpShard tp_;
  TpLink* link_;
  RowRange kv_heads_;
  KvCache kv_;
  std::vector<int> capture_;
  FlashLayout layout_;
  KvViews views_;
  std::vector<std::vector<float>> last_query_;  // per layer of this context
  int32_t last_query_pos_ = -1;
  std::function<bool()> cancel_check_;
};

struct ForwardCancelled : std::runtime_error {
  ForwardCancelled() : std::runtime_error("forward pass cancelled") {}
};

}  // namespace specmesh

// Which KV cells one batch token attends to in one layer: the cache's sequences and positions,
// the batch's attention mask, then the token's KV view. Lists are built on demand, per token
// and KV head, into the caller's buffer, so a forward pass holds O(n + cells) of mask state
// however long the context, instead of a list per token.
#pragma once

#include <array>
#include <memory>
#include <vector>

#include "specmesh/model/attention_mask.hpp"
#include "specmesh/model/batch.hpp"
#include "specmesh/model/kv_cache.hpp"
#include "specmesh/model/kv_view.hpp"

namespace specmesh {

using KvViews = std::array<std::shared_ptr<const KvView>, kMaxSeqs>;

class Visibility {
 public:
  // `slots`: the cells the batch's tokens were placed in (KvCache::place).
  Visibility(const KvCache& kv, const Batch& batch, const std::vector<int32_t>& slots, const AttentionMask& mask,
             const KvViews& views);

  // The cells token i reads in `layer` for KV head `kv_head`, in cell order (the order the
  // attention kernel accumulates in, so a token's result does not depend on its batch).
  void cells(size_t i, int layer, int kv_head, std::vector<int32_t>& out) const;
  // Whether lists differ per layer or KV head for some token (otherwise one list serves all).
  bool per_head() const { return per_head_; }

 private:
  const KvCache& kv_;
  const Batch& batch_;
  const AttentionMask& mask_;
  std::vector<int32_t> batch_index_;       // tree batches: per cell, the batch token placed there, or -1
  std::vector<const KvView*> view_of_;     // per token, or null: every visible cell
  bool per_head_ = false;
};

}  // namespace specmesh

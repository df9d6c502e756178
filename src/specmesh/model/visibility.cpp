#include "specmesh/model/visibility.hpp"

#include <bit>

namespace specmesh {

Visibility::Visibility(const KvCache& kv, const Batch& batch, const std::vector<int32_t>& slots,
                       const AttentionMask& mask, const KvViews& views)
    : kv_(kv), batch_(batch), mask_(mask), batch_index_(kv.n_cells(), -1), view_of_(batch.size(), nullptr) {
  for (size_t i = 0; i < slots.size(); ++i) batch_index_[slots[i]] = int32_t(i);
  for (size_t i = 0; i < batch.size(); ++i) {
    for (SeqSet s = batch.seqs[i]; s; s &= s - 1) {
      const auto& v = views[std::countr_zero(s)];
      if (!v) continue;
      view_of_[i] = v.get();
      per_head_ |= v->per_head();
      break;
    }
  }
}

void Visibility::cells(size_t i, int layer, int kv_head, std::vector<int32_t>& out) const {
  out.clear();
  const SeqSet seqs = batch_.seqs[i];
  const int32_t pos = batch_.pos[i];
  const bool tree = mask_.is_tree();
  for (int c = 0; c < kv_.n_cells(); ++c) {
    const KvCell& cell = kv_.cell(c);
    const int32_t b = batch_index_[c];
    bool visible;
    if (tree && b >= 0) visible = mask_.sees(i, size_t(b));           // tree nodes: ancestors and self
    else if (!(cell.seqs & seqs)) visible = false;
    else if (tree) visible = cell.pos < mask_.prefix();               // the committed prefix
    else visible = cell.pos <= pos;                                   // causal, batch tokens included
    if (visible) out.push_back(c);
  }
  if (view_of_[i]) view_of_[i]->select(kv_, layer, kv_head, pos, out);
}

}  // namespace specmesh

#include "specmesh/model/visibility.hpp"

#include <algorithm>
#include <bit>

namespace specmesh {

Visibility::Visibility(const KvCache& kv, const Batch& batch, const std::vector<int32_t>& slots,
                       const AttentionMask& mask, const KvViews& views)
    : kv_(kv), batch_(batch), mask_(mask), view_of_(batch.size(), nullptr) {
  if (mask.is_tree()) {
    batch_index_.assign(size_t(kv.n_cells()), -1);
    for (size_t i = 0; i < slots.size(); ++i) batch_index_[size_t(slots[i])] = int32_t(i);
  }
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
  const SeqSet seqs = batch_.seqs[i];
  const int32_t pos = batch_.pos[i];
  if (!mask_.is_tree()) {
    kv_.visible_cells(pos, seqs, out);  // causal, batch tokens included
  } else {
    out.clear();
    for (int c = 0; c < kv_.n_cells(); ++c) {
      const int32_t b = batch_index_[size_t(c)];
      if (b >= 0 ? mask_.sees(i, size_t(b))                                     // tree nodes: ancestors and self
                 : (kv_.cell(c).seqs & seqs) && kv_.cell(c).pos < mask_.prefix())  // the committed prefix
        out.push_back(c);
    }
  }
  // Attention reads the cells in position order, wherever they were placed: a session whose
  // tokens landed in cells another session freed computes exactly what it would alone.
  auto by_pos = [&](int32_t a, int32_t b) { return kv_.cell(a).pos < kv_.cell(b).pos; };
  if (!std::is_sorted(out.begin(), out.end(), by_pos)) std::stable_sort(out.begin(), out.end(), by_pos);
  if (view_of_[i]) view_of_[i]->select(kv_, layer, kv_head, pos, out);
}

}  // namespace specmesh

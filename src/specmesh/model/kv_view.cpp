#include "specmesh/model/kv_view.hpp"

#include <algorithm>
#include <stdexcept>
#include <string>

namespace specmesh {

void SinkWindowView::select(const KvCache& kv, int, int, int32_t query_pos, std::vector<int32_t>& cells) const {
  const int32_t recent_from = query_pos - recent_ + 1;
  std::erase_if(cells, [&](int32_t c) {
    const int32_t p = kv.cell(c).pos;
    return p >= sink_ && p < recent_from;
  });
}

ChunkView::ChunkView(int32_t chunk, int layer_begin, int n_kv_head, std::vector<std::vector<int32_t>> chunks,
                     int32_t fresh_from)
    : chunk_(chunk), layer_begin_(layer_begin), n_kv_head_(n_kv_head), fresh_from_(fresh_from) {
  if (chunk <= 0 || n_kv_head <= 0) throw std::invalid_argument("ChunkView: chunk size and head count must be positive");
  chosen_.resize(chunks.size());
  for (size_t i = 0; i < chunks.size(); ++i)
    for (int32_t c : chunks[i]) {
      if (c < 0) throw std::invalid_argument("ChunkView: negative chunk id " + std::to_string(c));
      if (size_t(c) >= chosen_[i].size()) chosen_[i].resize(size_t(c) + 1, 0);
      chosen_[i][size_t(c)] = 1;
    }
}

void ChunkView::select(const KvCache& kv, int layer, int kv_head, int32_t, std::vector<int32_t>& cells) const {
  const size_t i = size_t(layer - layer_begin_) * n_kv_head_ + kv_head;
  if (i >= chosen_.size())
    throw std::out_of_range("ChunkView: no chunks for layer " + std::to_string(layer) + ", KV head " + std::to_string(kv_head));
  const auto& chosen = chosen_[i];
  std::erase_if(cells, [&](int32_t c) {
    const int32_t p = kv.cell(c).pos;
    if (p >= fresh_from_) return false;
    const size_t id = size_t(p / chunk_);
    return id >= chosen.size() || !chosen[id];
  });
}

RetrievalView::RetrievalView(int layer_begin, int n_kv_head, int32_t budget, int32_t sink, int32_t fresh_from,
                             std::vector<std::vector<int32_t>> ranks)
    : layer_begin_(layer_begin), n_kv_head_(n_kv_head), budget_(budget), sink_(sink), fresh_from_(fresh_from),
      ranks_(std::move(ranks)) {
  if (n_kv_head <= 0 || budget <= 0 || sink < 0 || fresh_from < 0)
    throw std::invalid_argument("RetrievalView: head count and budget must be positive, sink and prompt not negative");
  for (const auto& r : ranks_)
    if (r.size() != size_t(fresh_from))
      throw std::invalid_argument("RetrievalView: " + std::to_string(r.size()) + " ranks for a prompt of " +
                                  std::to_string(fresh_from) + " positions");
}

int32_t RetrievalView::entries_read(int32_t query_pos) const {
  const int32_t fresh = std::max(0, query_pos - fresh_from_ + 1);
  return std::min(fresh_from_, std::max(std::min(sink_, budget_), budget_ - fresh));
}

const std::vector<int32_t>& RetrievalView::ranks(int layer, int kv_head) const {
  const size_t i = size_t(layer - layer_begin_) * n_kv_head_ + kv_head;
  if (layer < layer_begin_ || kv_head < 0 || kv_head >= n_kv_head_ || i >= ranks_.size())
    throw std::out_of_range("RetrievalView: no ranks for layer " + std::to_string(layer) + ", KV head " +
                            std::to_string(kv_head));
  return ranks_[i];
}

void RetrievalView::select(const KvCache& kv, int layer, int kv_head, int32_t query_pos,
                           std::vector<int32_t>& cells) const {
  const std::vector<int32_t>& rank = ranks(layer, kv_head);
  const int32_t keep = entries_read(query_pos);
  std::erase_if(cells, [&](int32_t c) {
    const int32_t p = kv.cell(c).pos;
    return p < fresh_from_ && rank[size_t(p)] >= keep;
  });
}

}  // namespace specmesh

// KV views: which of the cells a query may see attention actually reads, per layer and KV
// head. The cache and the mask decide what is visible (sequences, positions, tree spans); a
// view narrows that, so long-context methods (a StreamingLLM sink + recent window, a retrieval
// cache of chosen chunks) select cells without a fork of the attention code or a copy of the
// cache. A Context holds one view per sequence; a token reads through the view of the lowest
// sequence it belongs to that has one, and through all its visible cells otherwise.
#pragma once

#include <cstdint>
#include <memory>
#include <vector>

#include "specmesh/model/kv_cache.hpp"

namespace specmesh {

class KvView {
 public:
  virtual ~KvView() = default;
  // `cells`: what the query at `query_pos` may see, in cell order. Keep those this view reads
  // for (layer, kv_head), in the same order. A view keeps the query's own cell.
  virtual void select(const KvCache& kv, int layer, int kv_head, int32_t query_pos,
                      std::vector<int32_t>& cells) const = 0;
  // Whether select depends on the layer or kv_head (attention then builds a list per layer and
  // KV head; otherwise one list serves every layer and head of a decode step).
  virtual bool per_head() const { return false; }
};

// StreamingLLM: the first `sink` positions and the `recent` positions up to the query's.
class SinkWindowView final : public KvView {
 public:
  SinkWindowView(int32_t sink, int32_t recent) : sink_(sink), recent_(recent) {}
  void select(const KvCache& kv, int layer, int kv_head, int32_t query_pos, std::vector<int32_t>& cells) const override;

 private:
  int32_t sink_, recent_;
};

// A retrieval cache: per layer and KV head a set of chunks (chunk c holds positions
// [c * chunk, (c + 1) * chunk)), plus every position from `fresh_from` on (tokens written
// after the chunks were chosen).
class ChunkView final : public KvView {
 public:
  // chunks[(layer - layer_begin) * n_kv_head + kv_head]: chunk ids, any order.
  ChunkView(int32_t chunk, int layer_begin, int n_kv_head, std::vector<std::vector<int32_t>> chunks,
            int32_t fresh_from);
  void select(const KvCache& kv, int layer, int kv_head, int32_t query_pos, std::vector<int32_t>& cells) const override;
  bool per_head() const override { return true; }

 private:
  int32_t chunk_;
  int layer_begin_, n_kv_head_;
  std::vector<std::vector<uint8_t>> chosen_;  // per (layer, head): chosen_[c] != 0
  int32_t fresh_from_;
};

// TriForce's retrieval cache (the middle level of its hierarchy), a fixed budget of entries per
// layer and KV head. The positions before `fresh_from` (the prompt, or the sequence when the
// cache was last built) are ranked per (layer, head), most important first; a query at
// position p reads the positions from fresh_from to p (the tokens generated since: f of them,
// its own included) and the best budget - f ranked entries: every generated token overwrites
// the least important entry left. The first `sink` ranks are never overwritten (the attention
// sink, chunk 0): once f > budget - sink the view reads sink + f entries, more than the
// budget, and its owner should rebuild it (retrieval_cache.hpp).
class RetrievalView final : public KvView {
 public:
  // ranks[(layer - layer_begin) * n_kv_head + kv_head][pos], pos < fresh_from: the entry's rank.
  RetrievalView(int layer_begin, int n_kv_head, int32_t budget, int32_t sink, int32_t fresh_from,
                std::vector<std::vector<int32_t>> ranks);
  void select(const KvCache& kv, int layer, int kv_head, int32_t query_pos, std::vector<int32_t>& cells) const override;
  bool per_head() const override { return true; }

  int32_t budget() const { return budget_; }
  int32_t fresh_from() const { return fresh_from_; }
  // The prompt entries a query at query_pos reads (per layer and head).
  int32_t entries_read(int32_t query_pos) const;
  const std::vector<int32_t>& ranks(int layer, int kv_head) const;

 private:
  int layer_begin_, n_kv_head_;
  int32_t budget_, sink_, fresh_from_;
  std::vector<std::vector<int32_t>> ranks_;
};

}  // namespace specmesh

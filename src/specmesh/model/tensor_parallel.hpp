// Tensor parallelism: which part of a layer one device of an n-way group computes, and the
// exchange the group needs between those parts.
//
// Rank r of n holds KV heads [kv_begin, kv_end) (and their query heads) in its own KV cache,
// and computes a contiguous share of the output rows of every other matrix: the output
// projection, the FFN's gate, up and down projections and the classifier. A layer then needs
// four all-gathers per token: the attention output (each rank has its heads), the output
// projection, the FFN's inner activations (each rank has its share of the inner dimension) and
// the down projection. Every rank then holds the whole residual stream.
//
// This is the all-gather form of Megatron's split, not the all-reduce form (the output and down
// projections split by input columns, partial sums added over the group): summing partial dot
// products changes the rounding with the group size, while a row of a matrix product here is
// computed by the same kernel on the same inputs whichever device holds it, so a group of any
// size produces the logits of one device bit for bit. The cost is moving full rows (n_embd and
// n_ff per token) where the all-reduce form moves n_embd twice.
#pragma once

#include <algorithm>
#include <cstddef>
#include <stdexcept>
#include <string>
#include <vector>

namespace specmesh {

struct TpShard {
  int rank = 0;
  int size = 1;
};

struct RowRange {
  size_t begin = 0, end = 0;
  size_t size() const { return end - begin; }
};

// Rank r's share of `total` rows: contiguous, in whole tiles of `align` rows (32, a Tenstorrent
// tile and a multiple of every packed matrix panel), as even as the tiles allow. Ranks may get
// no rows when there are fewer tiles than ranks.
inline RowRange tp_rows(size_t total, TpShard s, size_t align = 32) {
  const size_t tiles = (total + align - 1) / align;
  auto edge = [&](int r) { return std::min(total, align * (tiles * size_t(r) / size_t(s.size))); };
  return {edge(s.rank), edge(s.rank + 1)};
}

// Rank r's KV heads: an even split, every rank at least one.
inline RowRange tp_kv_heads(int n_head_kv, TpShard s) {
  return {size_t(n_head_kv) * size_t(s.rank) / size_t(s.size), size_t(n_head_kv) * size_t(s.rank + 1) / size_t(s.size)};
}

// Every rank's column count of a matrix split by tp_rows (`total` columns) or by KV heads
// (`per_kv_head` columns each), into `out` (size entries): the shares TpLink::all_gather takes.
inline void tp_row_shares(size_t total, int size, std::vector<size_t>& out) {
  out.resize(size_t(size));
  for (int r = 0; r < size; ++r) out[size_t(r)] = tp_rows(total, {r, size}).size();
}
inline void tp_head_shares(int n_head_kv, size_t per_kv_head, int size, std::vector<size_t>& out) {
  out.resize(size_t(size));
  for (int r = 0; r < size; ++r) out[size_t(r)] = tp_kv_heads(n_head_kv, {r, size}).size() * per_kv_head;
}

// Throws std::invalid_argument unless the shard is one of a group the model can be split into.
inline void check_tp_shard(TpShard s, int n_head_kv) {
  if (s.size < 1 || s.rank < 0 || s.rank >= s.size)
    throw std::invalid_argument("tensor parallelism: rank " + std::to_string(s.rank) + " of a group of " +
                                std::to_string(s.size));
  if (s.size > n_head_kv)
    throw std::invalid_argument("tensor parallelism: " + std::to_string(s.size) + " devices for " +
                                std::to_string(n_head_kv) + " KV heads (each device needs one at least)");
}

// One rank's end of the group's exchange. Calls block until every rank has made the same call
// (the ranks of a group make the same calls in the same order).
class TpLink {
 public:
  virtual ~TpLink() = default;
  virtual TpShard shard() const = 0;
  // `mine` is rows x share(r) floats, this rank's columns of a rows x total matrix, where
  // share(r) is the r-th of the consecutive column counts `shares` (size() entries, summing to
  // total); `out` receives the whole matrix.
  virtual void all_gather(const float* mine, size_t rows, const size_t* shares, size_t total, float* out) = 0;
  // Adds up `v` (n floats) over the ranks in rank order, so every rank gets the same bits.
  virtual void all_reduce_sum(float* v, size_t n) = 0;
};

}  // namespace specmesh

// Softmax attention of one query head with chunked online softmax.
//
// A chunk of keys yields a partial result (o, m, l): o = sum_j e^(s_j - m) v_j unnormalised,
// m = max_j s_j, l = sum_j e^(s_j - m). Partials merge associatively, so attention over a
// long cache can be split across chunks, threads or devices and combined later.
#pragma once

#include <cstddef>
#include <cmath>
#include <cstdint>

namespace specmesh {

// Keys and values of one layer: row c holds cell c, n_kv_heads * head_dim values.
struct KvRows {
  const float* k;
  const float* v;
  size_t row_stride;  // floats between consecutive cells
};

struct AttnPartial {
  float m = -INFINITY;
  float l = 0.0f;
};

// Accumulates the keys/values of `cells[0..n)` (head offset kv_off within each row) into the
// partial (o[head_dim], p). An empty partial starts with m = -inf, l = 0, o = 0.
void attn_partial(const float* q, const KvRows& kv, size_t kv_off, int head_dim, float scale,
                  const int32_t* cells, size_t n, float* o, AttnPartial& p);

// Merges partial (o2, p2) into (o, p).
void attn_merge(float* o, AttnPartial& p, const float* o2, const AttnPartial& p2, int head_dim);

// Full attention over cells[0..n) in chunks of `chunk` cells, merged in order; out = o / l.
// The chunking depends only on n, so the result is the same however it is scheduled.
constexpr size_t kAttnChunk = 256;
void attention(const float* q, const KvRows& kv, size_t kv_off, int head_dim, float scale,
               const int32_t* cells, size_t n, float* out);

}  // namespace specmesh

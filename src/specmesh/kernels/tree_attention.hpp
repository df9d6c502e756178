// Attention of the N nodes of a speculated token tree over a committed prefix and the tree.
//
// Query i sees every prefix key and tree key j iff j is i or an ancestor of i. The tree is
// stored in DFS pre-order and each node carries the interval TreeSpan{start, end} of one DFS
// counter that counts node entries: start = the counter when the node is entered (its
// pre-order rank), end = the counter once its whole subtree is done (start + subtree size).
// Then j is i or an ancestor of i iff  start_j <= start_i && end_i <= end_j.
// The kernels rely only on that predicate and on start < end, so the entry/exit counter of
// the FlashSpecInfer paper (+1 on entry and on exit) works as well. The mask state is two
// int32 per node plus the prefix length, instead of the N x N mask of SpecInfer.
//
// Both kernels walk query tiles x key tiles with online-softmax partials (as flash_decode.hpp).
// tree_attention() classifies each tree tile from the interval bounds of its queries and
// keys: skipped (no key can be an ancestor of any query), taken whole (every key is visible
// to every query) or tested key by key. tree_attention_dense() is the same kernel driven by a
// dense N x N byte mask, testing every tree key; it is the baseline. In pre-order, ancestors
// precede their descendants, so tiles above the diagonal and tiles of finished subtrees go.
#pragma once

#include <cstddef>
#include <cstdint>
#include <vector>

#include "specmesh/kernels/flash_decode.hpp"

namespace specmesh {

class ThreadPool;

struct TreeSpan {
  int32_t start;
  int32_t end;
};

// Whether node `key` is an ancestor of node `query`, or the node itself: its interval holds
// the query's.
inline bool tree_sees(const TreeSpan& query, const TreeSpan& key) { return key.start <= query.start && query.end <= key.end; }

// One tree-attention call. Keys and values: cells[0, n_prefix) are the prefix rows,
// cells[n_prefix, n_prefix + n_tree) the rows of tree nodes 0..n_tree-1 (DFS pre-order);
// a contiguous cache passes cells = 0, 1, 2, ... Query row i (n_head * head_dim floats,
// head h at h * head_dim) belongs to tree node i; so does output row i. Query head h reads
// KV head h / (n_head / n_head_kv) at offset (h / group) * head_dim within a KV row.
struct TreeAttnProblem {
  const float* q;
  size_t q_stride;  // floats between consecutive query rows
  KvRows kv;
  const int32_t* cells;
  size_t n_prefix;
  size_t n_tree;
  int n_head;
  int n_head_kv;  // n_head is a multiple of it
  int head_dim;
  float scale;
  float* out;
  size_t out_stride;  // floats between consecutive output rows
};

// Tile sizes shared by both kernels: a query tile is kTreeQueryTile tree nodes (times the
// query heads of one KV head), a key tile kTreeKeyTile keys. Tree key tiles start at tree
// node 0, not at the prefix, so they line up with query tiles.
constexpr size_t kTreeQueryTile = 16;
constexpr size_t kTreeKeyTile = 32;

// Interval-masked tiled kernel. spans[i] is tree node i's interval.
// The work is split into (query tile, KV head) units, each computed start to finish by one
// thread in a fixed order, so the result does not depend on the pool size. pool may be null.
void tree_attention(const TreeAttnProblem& p, const TreeSpan* spans, ThreadPool* pool);

// Dense-mask baseline: mask[i * n_tree + j] != 0 iff tree query i sees tree key j. The prefix
// is visible to all queries and needs no mask bytes.
void tree_attention_dense(const TreeAttnProblem& p, const uint8_t* mask, ThreadPool* pool);

// The N x N byte mask the intervals describe.
std::vector<uint8_t> dense_tree_mask(const TreeSpan* spans, size_t n);

// The per-tile steps, portable and AVX2; private to the kernel's translation units.
// Scores are in log2 units: queries arrive pre-multiplied by scale * log2(e), so the
// softmax exponentiates with exp2. A tile always has kTreeKeyTile keys; those past its last
// key are zero and masked out, so their weights are zero.
namespace tree_attn_detail {

struct TileSteps {
  // s[r][c] = q[r] . kt[., c] for rows x kTreeKeyTile scores; kt is head_dim x kTreeKeyTile.
  void (*scores)(const float* q, size_t rows, int head_dim, const float* kt, float* s);
  // Online-softmax step in place: s[r] becomes the weights e^(s - m_new) of row r, with
  // column c kept iff bit c of vis[r / group] is set; m and l move to the new maximum and
  // alpha[r] receives the factor that rescales row r's accumulated output.
  void (*softmax)(float* s, size_t rows, size_t group, const uint32_t* vis, float* m, float* l,
                  float* alpha);
  // o[r] = o[r] * alpha[r] + sum_c p[r][c] * v[c]; v is kTreeKeyTile x head_dim.
  void (*accumulate)(const float* p, size_t rows, const float* v, int head_dim,
                     const float* alpha, float* o);
};

const TileSteps& tile_steps_avx2();

}  // namespace tree_attn_detail

}  // namespace specmesh

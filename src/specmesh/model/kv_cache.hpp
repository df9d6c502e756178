// The KV cache: cells that know their position and the set of sequences they belong to.
//
// Sequences share cells: a token accepted into the canonical sequence and a speculative run
// built on it refer to the same cell, so forking or accepting is metadata work, not copying.
#pragma once

#include <cstdint>
#include <string>
#include <vector>

#include "specmesh/kernels/aligned_buffer.hpp"
#include "specmesh/kernels/kv_rows.hpp"
#include "specmesh/model/batch.hpp"

namespace specmesh {

struct KvCell {
  int32_t pos = -1;  // -1: free
  SeqSet seqs = 0;
  bool empty() const { return seqs == 0; }
};

// This machine's physical memory in bytes: more than any one process can hold.
uint64_t physical_memory_bytes();
// Bytes as "12.3 GiB" (or MiB, KiB), for messages.
std::string bytes_text(uint64_t bytes);

class KvCache {
 public:
  // Holds layers [layer_begin, layer_end) of a model with kv_dim values per key/value row,
  // stored as `type` (kv_rows.hpp). Throws std::invalid_argument for a type that cannot hold
  // KV rows or a Q8_0 cache whose kv_dim is not a multiple of 32, and std::runtime_error,
  // naming the size, when it is more than this machine's memory or cannot be allocated.
  KvCache(int n_cells, int layer_begin, int layer_end, int kv_dim, DType type = kDefaultKvType);

  // Bytes of keys and values n_cells cells of n_layers layers hold.
  static uint64_t bytes_needed(int64_t n_cells, int n_layers, int kv_dim, DType type = kDefaultKvType) {
    return uint64_t(n_cells) * uint64_t(n_layers) * uint64_t(kv_row_bytes(type, size_t(kv_dim))) * 2;
  }

  int n_cells() const { return static_cast<int>(cells_.size()); }
  int layer_begin() const { return layer_begin_; }
  int layer_end() const { return layer_end_; }
  int kv_dim() const { return kv_dim_; }
  DType type() const { return type_; }
  const KvCell& cell(int i) const { return cells_[i]; }
  int used() const;

  // Rows of layer `layer` (absolute index) as the attention kernels read them: n_cells rows
  // of kv_dim values, 64-byte aligned (the kernels' loads are about 10 % slower at 16K keys
  // when each one straddles two lines).
  KvRows rows(int layer) const;
  // Writes cell `cell`'s key and value rows (kv_dim floats each) in layer `layer`, converted
  // to the cache's type; nullptr leaves that row as it is.
  void write(int layer, int32_t cell, const float* k, const float* v);
  // Reads them back as floats (what the kernels see); nullptr skips that row.
  void read(int layer, int32_t cell, float* k, float* v) const;

  // Claims one free cell per batch token (lowest free indices first) and labels it;
  // throws std::runtime_error when the cache is full.
  std::vector<int32_t> place(const Batch& batch);

  // Sequence operations (llama.cpp's kv_self_seq_* semantics); p1 < 0 means "to the end".
  void seq_rm(int seq, int32_t p0, int32_t p1);          // seq < 0: every sequence
  void seq_cp(int src, int dst, int32_t p0, int32_t p1);  // dst joins src's cells in range
  void seq_keep(int seq);                                // drop every other sequence
  // Adds delta to the positions of the cells of `seq` (seq < 0: every sequence; with
  // seq_last >= seq: any of seq..seq_last, each cell once) in [p0, p1) and returns the cells
  // moved (llama.cpp's seq_add); a cell moved below position 0 is freed. Their keys still carry
  // the old rotation: Context::shift_positions re-rotates them.
  std::vector<int32_t> seq_add(int seq, int32_t p0, int32_t p1, int32_t delta, int seq_last = -1);
  void clear();
  int32_t seq_pos_max(int seq) const;                    // -1 when empty

  // The cells a token at `pos` in sequences `seqs` attends to, in cell order.
  void visible_cells(int32_t pos, SeqSet seqs, std::vector<int32_t>& out) const;

 private:
  // Index of `layer` in k_ / v_, and the byte offset of `cell`'s row; both throw
  // std::out_of_range naming what is outside.
  size_t layer_index(int layer) const;
  size_t row_offset(int32_t cell) const;

  int layer_begin_, layer_end_, kv_dim_;
  DType type_;
  size_t row_bytes_;
  std::vector<KvCell> cells_;
  std::vector<AlignedBuffer> k_, v_;  // zeroed
};

}  // namespace specmesh
